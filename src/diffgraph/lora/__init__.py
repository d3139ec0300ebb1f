"""LoRA adapters under CUDA graphs (issue 12, in progress): `sidepath.py` holds the per-row side paths over fixed
device slots. Reading adapter files, the slot cache and the engine wiring are still to come; nothing else in
diffgraph imports this package yet."""
