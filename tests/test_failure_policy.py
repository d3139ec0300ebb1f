"""The failure policy (issue 28, point 1; engine/failures.py): K consecutive failed steps, or one error that leaves
the device unusable, mark the engine failed: not ready (a router routes around it), its requests answered
retryable, the next submit refused naming the reason; a successful step resets the count."""

from __future__ import annotations

import asyncio

import pytest

from diffgraph import Engine
from diffgraph.engine.async_engine import AsyncEngine
from diffgraph.engine.failures import FailurePolicy, poisons_the_device
from diffgraph.engine.router import Router
from diffgraph.request import EngineClosed, EngineStepError


def _break(engine, monkeypatch, error=lambda: RuntimeError("a step that fails (a test)"), sizes=None):
    runner = engine.core.runner
    real = runner.step

    def step(key, *args):
        if sizes is None or key in sizes:
            raise error()
        return real(key, *args)
    monkeypatch.setattr(runner, "step", step)


def _request(engine, seed, width=64, steps=3):
    return engine.make_request("a digit", width=width, height=64, num_inference_steps=steps, seed=seed)


def test_k_consecutive_failed_steps_fail_the_engine_and_a_success_resets_the_count(monkeypatch):
    with Engine("digits", device="cpu", max_step_failures=2) as engine:
        _break(engine, monkeypatch, sizes={(64, 72)})
        assert isinstance(engine.submit(_request(engine, 1, 72)).exception(timeout=600), EngineStepError)
        assert engine.submit(_request(engine, 2)).result(timeout=600).arrays.shape == (1, 64, 64, 3)  # resets
        assert isinstance(engine.submit(_request(engine, 3, 72)).exception(timeout=600), EngineStepError)
        assert engine.ready and engine.core.failures.streak == 1
        assert isinstance(engine.submit(_request(engine, 4, 72)).exception(timeout=600), EngineStepError)
        assert not engine.ready  # two in a row: failed
        with pytest.raises(EngineClosed, match="the engine failed: 2 consecutive steps failed .*a step that fails"):
            engine.submit(_request(engine, 5))


def test_an_error_that_poisons_the_device_fails_the_engine_at_once_and_answers_every_request(monkeypatch):
    with Engine("digits", device="cpu", max_step_failures=5) as engine:
        _break(engine, monkeypatch, lambda: RuntimeError("CUDA error: an illegal memory access was encountered"),
               sizes={(64, 72)})
        bad = engine.submit(_request(engine, 1, 72, steps=2))
        others = [engine.submit(_request(engine, 10 + i, steps=200)) for i in range(3)]  # running or queued
        assert isinstance(bad.exception(timeout=600), EngineStepError)
        errors = [f.exception(timeout=600) for f in others]
        assert not engine.ready  # the oldest request's group ran first: the others were still running or queued
        assert all(isinstance(e, EngineClosed) and "retry this request on another replica" in str(e) for e in errors)
        assert "leaves the device unusable" in engine.core.failures.reason


def test_a_router_stops_choosing_a_failed_engine_and_moves_its_waiting_requests():
    """One good and one broken engine behind a router, 40 requests at once: before the policy, the broken engine
    (it answers fastest: least outstanding work) took most of them and 38 of 40 failed while both said they were
    ready. Now only the requests whose step failed there fail (K = 3 steps); the ones it had not started move to the
    good engine, and everything after goes there."""
    # the broken engine steps 2 rows at a time (max_rows 2): most of what it is sent waits there
    good, bad = Engine("digits", device="cpu"), Engine("digits", device="cpu", max_step_failures=3, max_rows=2)

    def broken(*args):
        raise RuntimeError("a broken device (a test)")
    bad.core.runner.step = broken
    router = Router([AsyncEngine(good, name="good"), AsyncEngine(bad, name="bad")])
    try:
        async def wave(seeds):
            handles = [await router.submit(_request(good, i, steps=2)) for i in seeds]
            return await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
        first = asyncio.run(wave(range(40)))
        failed = [r for r in first if isinstance(r, Exception)]
        # only the rows of the broken engine's 3 failed steps failed (2 rows each); what it held waiting moved
        assert failed and all(isinstance(r, EngineStepError) for r in failed), failed
        assert bad.core.stats["failed_steps"] == 3 and len(failed) <= 3 * 2 and router.moved > 0
        states = {s["replica"]: s for s in router.replica_states()}
        assert states["bad"]["state"] == "failed" and "3 consecutive steps failed" in states["bad"]["error"]
        assert states["good"]["state"] == "ready" and router.ready
        second = asyncio.run(wave(range(40, 60)))
        assert all(r.arrays.shape == (1, 64, 64, 3) for r in second)  # every one on the good engine
    finally:
        router.close()


def test_the_policy_counts_and_names_what_poisons_a_device():
    p = FailurePolicy(2)
    assert not p.step_failed(ValueError("bad input")) and p.reason is None
    assert p.step_failed(ValueError("bad input")) and "2 consecutive" in p.reason
    assert not p.step_failed(ValueError("again"))  # trips once
    assert poisons_the_device(RuntimeError("CUDA error: uncorrectable ECC error encountered"))
    assert poisons_the_device(RuntimeError("CUDA error: device-side assert triggered"))
    assert not poisons_the_device(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(ValueError, match=">= 1"):
        FailurePolicy(0)


def test_rows_held_for_companions_are_answered_retryable_when_the_device_fails_not_decoded_on_it(monkeypatch):
    """A job's finished rows wait a few steps for companions to decode with (engine/decode_batches.py). When an error
    poisons the device meanwhile, they are answered like every request the engine holds (EngineClosed: retry on
    another replica), with no decode run on the failed device, and the engine's loop ends cleanly."""
    import dataclasses
    with Engine("random:tiny", device="cpu", max_step_failures=5) as engine:
        runner, calls = engine.core.runner, {"steps": 0, "decodes_after": 0}
        real_step, real_decode = runner.step, runner.decode_async

        def step(*args, **kw):
            calls["steps"] += 1
            if calls["steps"] >= 3:  # the 2-step request finished at step 2 and is held (the 10-step one is live)
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return real_step(*args, **kw)

        def decode_async(*args, **kw):
            calls["decodes_after"] += calls["steps"] >= 3
            return real_decode(*args, **kw)
        monkeypatch.setattr(runner, "step", step)
        monkeypatch.setattr(runner, "decode_async", decode_async)
        batch = [dataclasses.replace(_request(engine, seed, steps=steps), priority="batch", job="j")
                 for seed, steps in ((1, 2), (2, 10))]
        with engine.core._cv:  # both admitted at the loop's next boundary, together
            held, live = [engine.submit(r) for r in batch]
        assert isinstance(live.exception(timeout=600), EngineStepError)  # its step failed
        error = held.exception(timeout=600)
        assert isinstance(error, EngineClosed) and "retry this request on another replica" in str(error)
        assert calls["decodes_after"] == 0 and not engine.ready


def test_a_decode_that_poisons_the_device_fails_the_engine_and_another_decode_error_does_not(monkeypatch):
    """A decode error that leaves the device unusable marks the engine failed at once, as such a step error does (not
    ready, the next submit refused with the reason), so nothing more waits for that device; any other decode error
    fails its own request only."""
    with Engine("random:tiny", device="cpu", max_step_failures=5) as engine:
        runner, errors = engine.core.runner, [RuntimeError("a decode that fails (a test)"),
                                              RuntimeError("CUDA error: an illegal memory access was encountered")]

        def decode_async(*args, **kw):
            raise errors.pop(0)
        monkeypatch.setattr(runner, "decode_async", decode_async)
        assert isinstance(engine.submit(_request(engine, 1, steps=2)).exception(timeout=600), EngineStepError)
        assert engine.ready
        error = engine.submit(_request(engine, 2, steps=2)).exception(timeout=600)
        assert isinstance(error, EngineStepError) and "illegal memory access" in str(error)
        assert not engine.ready and "a decode failed with an error that leaves the device unusable" in \
            engine.core.failures.reason
        with pytest.raises(EngineClosed, match="the engine failed: a decode failed"):
            engine.submit(_request(engine, 3, steps=2))
