"""What the token families' GPU tests share: rows of several prompt lengths, sizes of one bucket, steps and guidance
submitted together in graph mode (or the compile tier), against each run alone."""

import numpy as np

from diffgraph import Engine, GenerationRequest, GraphConfig
from diffgraph.text.prepared import prepare


def _levels(a: np.ndarray) -> np.ndarray:
    return (a * 255).round().astype(np.int16)


def together_and_alone(model: str, requests: list[dict], device: str, dtype: str,
                       compile: bool) -> tuple[list, set, list[int]]:
    """(each request's group key, the (height, width) of the step graphs that replayed, each image's worst level
    difference between the requests submitted together and each alone)."""
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((256, 256),), prewarm=False)
    with Engine(model=model, device=device, dtype=dtype, mode="graph", graphs=cfg, compile=compile) as engine:
        made = [GenerationRequest.create(model=engine.info, **r) for r in requests]
        keys = [engine.runner.group_key(m.key, prepare(engine.runner.text_setup, m)) for m in made]
        alone = [engine.submit(GenerationRequest.create(model=engine.info, **r)).result(timeout=600).arrays[0]
                 for r in requests]
        futures = []
        engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in made)).result()
        together = [f.result(timeout=600).arrays[0] for f in futures]
        steps = [row for row in engine.runner.graph_table() if row["kind"] == "step" and row["replays"]]
    worst = [int(np.abs(_levels(a) - _levels(b)).max()) for a, b in zip(together, alone)]
    return keys, {(row["height"], row["width"]) for row in steps}, worst
