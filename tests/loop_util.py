"""Holding an engine's loop between two steps, for tests that queue several requests before any of them is planned."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def held_loop(engine) -> Iterator[None]:
    """Inside the block the engine's loop waits between steps (its current pass already planned, with what was
    queued before the block); it plans again, with everything submitted inside, once the block ends."""
    entered, hold = threading.Event(), threading.Event()

    def blocker():
        entered.set()
        hold.wait()
    held = engine.core.call_between_steps(blocker)
    entered.wait()
    try:
        yield
    finally:
        hold.set()
    held.result()


def together(engine, requests) -> list:
    """The results of `requests` (made with `engine.make_request`), all submitted while the loop is held, so that
    they share steps (in batches up to the engine's rows) instead of running one after another; in order."""
    with held_loop(engine):
        futures = [engine.submit(r) for r in requests]
    return [f.result(timeout=600) for f in futures]


def images_together(engine, requests: list[dict]) -> list:
    """`GenerationRequest.create` keywords submitted between two steps (so they are admitted together); each
    request's first image as int16 uint8 levels [H, W, 3]."""
    import numpy as np

    from diffgraph import GenerationRequest

    futures = []
    made = [GenerationRequest.create(model=engine.info, **r) for r in requests]
    engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in made)).result()
    return [np.round(f.result(timeout=600).arrays[0] * 255).astype(np.int16) for f in futures]


def calls_per_request(engine, monkeypatch, owner, name: str, request: dict, steps: tuple[int, ...]) -> list:
    """(calls of `owner.name`, denoiser calls) made while `request` (`images_together` keywords) runs alone at each
    step count of `steps` in turn, that function (a class's method or a module's function) and the runner's eager
    denoiser patched to count."""
    calls, steps_run = [], []
    method, denoise = getattr(owner, name), engine.runner.denoise_eager
    monkeypatch.setattr(owner, name, lambda *a: calls.append(1) or method(*a))
    monkeypatch.setattr(engine.runner, "denoise_eager", lambda *a: steps_run.append(1) or denoise(*a))
    out = []
    for i, n in enumerate(steps):
        before = (len(calls), len(steps_run))
        images_together(engine, [dict(request, num_inference_steps=n, seed=i)])
        out.append((len(calls) - before[0], len(steps_run) - before[1]))
    return out


def step_graphs(engine) -> dict:
    """The engine's step graphs that ran, by (group, bucket): their graph table rows (kind "step"), and under "eager"
    the step groups no graph covered (their eager runs)."""
    table = [r for r in engine.runner.graph_table() if r["kind"] == "step"]
    out = {((r["height"], r["width"]), r["bucket"]): r for r in table if r["replays"] or r["status"] != "pending"}
    out["eager"] = {(r["height"], r["width"]): r["eager_fallbacks"] for r in table if r["status"] == "uncovered"}
    return out
