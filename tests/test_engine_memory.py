"""Memory bounded by design (issue 28, point 3): a resolution group's buffers are released whenever it empties,
by a finish, an abort or a failed step, so a client that starts and abandons requests at many sizes (any multiple
of 8 is valid) cannot pile them up."""

from __future__ import annotations

from concurrent.futures import wait

import pytest

from diffgraph import Engine
from diffgraph.request import EngineStepError, RequestAborted


@pytest.fixture(scope="module")
def engine():
    with Engine("digits", device="cpu") as e:
        yield e


def test_fifty_abandoned_requests_at_fifty_sizes_leave_no_buffers(engine):
    idle = dict(engine.core.runner.groups)
    seen: set = set()

    def abort_after_first_step(request_id, step, total):
        seen.add(request_id)
        engine.abort(request_id)
    futures = [engine.submit(engine.make_request("a digit", width=64 + 8 * i, height=64, num_inference_steps=30,
                                                 seed=i), on_progress=abort_after_first_step) for i in range(50)]
    wait(futures, timeout=600)
    assert all(isinstance(f.exception(), RequestAborted) for f in futures)
    assert len(seen) == 50  # each ran a step: its size's buffers were allocated
    engine.core.call_between_steps(lambda: None).result(timeout=600)  # the loop has passed the last abort
    assert engine.core.runner.groups == idle  # back to the idle figure: nothing held for the 50 sizes
    held = engine.memory()  # what the metrics show (diffgraph_buffer_groups, diffgraph_engine_memory_bytes)
    assert held["buffer_groups"] == len(idle) and held["prompt_cache_bytes"] > 0


def test_the_metrics_show_what_the_engine_holds(engine):
    from prometheus_client import CollectorRegistry, generate_latest

    from diffgraph.engine.async_engine import AsyncEngine
    from diffgraph.server.metrics import _EngineCollector
    client = AsyncEngine(engine)
    running = []
    engine.step_listeners.append(lambda plan, _: running.append(engine.memory()))
    try:
        engine.generate("a digit", num_inference_steps=2, seed=1)
    finally:
        engine.step_listeners.pop()
    during = running[0]
    assert during["buffer_groups"] >= 1 and during["buffer_bytes"] > 0  # a group's buffers while it steps
    registry = CollectorRegistry()
    registry.register(_EngineCollector(lambda: client))
    text = generate_latest(registry).decode()
    assert "diffgraph_buffer_groups " in text
    for part in ("buffer", "pinned", "prompt_cache", "lora_host"):
        assert f'diffgraph_engine_memory_bytes{{part="{part}"}}' in text


def test_a_failed_step_releases_its_sizes_buffers(engine, monkeypatch):
    runner = engine.core.runner
    real = runner.step

    def broken(key, *args):
        if key == (64, 136):
            raise RuntimeError("a step that fails (a test)")
        return real(key, *args)
    monkeypatch.setattr(runner, "step", broken)
    bad = engine.submit(engine.make_request("a digit", width=136, height=64, num_inference_steps=4, seed=1))
    assert isinstance(bad.exception(timeout=600), EngineStepError)
    good = engine.submit(engine.make_request("a digit", width=64, height=64, num_inference_steps=4, seed=2))
    assert good.result(timeout=600).arrays.shape == (1, 64, 64, 3)
    engine.core.call_between_steps(lambda: None).result(timeout=600)
    assert (64, 136) not in runner.groups and (64, 64) not in runner.groups
