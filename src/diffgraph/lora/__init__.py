"""LoRA adapters under CUDA graphs: `files.py` reads adapter files (diffusers/PEFT and
kohya layouts, through diffusers' readers and converters) into per-layer low-rank weights; `catalog.py` names the
adapters of a folder (and refuses unsafe names) and keeps the LRU table of device slots; `sidepath.py` holds the
per-row side paths over fixed device slots. The engine wiring and the API are still to come; nothing else in
diffgraph imports this package yet."""
