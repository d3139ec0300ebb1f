"""What the token families' GPU tests share: rows of several prompt lengths, sizes of one bucket, steps and guidance
submitted together in graph mode (or the compile tier), against each run alone."""

import numpy as np
import torch

from diffgraph import Engine, GenerationRequest, GraphConfig
from diffgraph.text.prepared import prepare


def picture(h: int, w: int, seed: int) -> np.ndarray:
    """A smooth random RGB picture (uint8 [h, w, 3]) for reference and input images."""
    g = torch.Generator().manual_seed(seed)
    small = torch.rand((1, 3, h // 8 + 1, w // 8 + 1), generator=g)
    return (torch.nn.functional.interpolate(small, size=(h, w), mode="bilinear")[0].permute(1, 2, 0).numpy()
            * 255).round().astype(np.uint8)


def _levels(a: np.ndarray) -> np.ndarray:
    return (a * 255).round().astype(np.int16)


def worst_levels(together: list, alone: list) -> list[int]:
    """Each image's largest uint8 difference between its run with the others and its run alone."""
    return [int(np.abs(_levels(a) - _levels(b)).max()) for a, b in zip(together, alone)]


def _graph_engine(model: str, device: str, dtype: str, compile: bool) -> Engine:
    """Graph mode (256x256 graphed, buckets 1, 2 and 4), or the compile tier."""
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((256, 256),), prewarm=False)
    return Engine(model=model, device=device, dtype=dtype, mode="graph", graphs=cfg, compile=compile)


def _images(engine: Engine, made: list, requests: list[dict]) -> tuple[list, list]:
    """(each image of `made` submitted together in one step, each image of `requests` run alone)."""
    alone = [engine.submit(GenerationRequest.create(model=engine.info, **r)).result(timeout=600).arrays[0]
             for r in requests]
    futures = []
    engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in made)).result()
    return [f.result(timeout=600).arrays[0] for f in futures], alone


def images_and_graphs(model: str, requests: list[dict], device: str, dtype: str, compile: bool
                      ) -> tuple[list, list, list, list]:
    """(the requests as made, each image submitted together, each alone, the graph table)."""
    with _graph_engine(model, device, dtype, compile) as engine:
        made = [GenerationRequest.create(model=engine.info, **r) for r in requests]
        together, alone = _images(engine, made, requests)
        return made, together, alone, engine.runner.graph_table()


def together_and_alone(model: str, requests: list[dict], device: str, dtype: str,
                       compile: bool) -> tuple[list, set, list[int]]:
    """(each request's group key, the (height, width) of the step graphs that replayed, each image's worst level
    difference between the requests submitted together and each alone)."""
    with _graph_engine(model, device, dtype, compile) as engine:
        made = [GenerationRequest.create(model=engine.info, **r) for r in requests]
        keys = [engine.runner.group_key(m.key, prepare(engine.runner.text_setup, m)) for m in made]
        together, alone = _images(engine, made, requests)
        steps = [row for row in engine.runner.graph_table() if row["kind"] == "step" and row["replays"]]
    return keys, {(row["height"], row["width"]) for row in steps}, worst_levels(together, alone)
