"""The engine loop on the CPU: concurrent mixed requests equal their solo images; abort; failures; queue."""

import re
import threading
import time

import numpy as np
import pytest

from diffgraph import Engine
from diffgraph.engine.engine import EngineStepError
from diffgraph.engine.scheduler import QueueFullError, RequestAborted

SAMPLERS = ["euler", "euler_a", "dpmpp_2m", "ddim"]


def _mix(engine, count=20):
    """Requests that differ in steps, sampler, schedule, guidance, seed, prompt, negative, num_images and size."""
    reqs = []
    for i in range(count):
        reqs.append(engine.make_request(
            ["a red fox", "a blue car", "a castle at night", "a bowl of fruit"][i % 4],
            negative_prompt=[None, "blurry"][i % 2],
            width=64, height=[64, 96][(i // 2) % 2],
            num_inference_steps=[3, 5, 8, 4][i % 4],
            sampler=SAMPLERS[i % 4], schedule=["default", "karras"][(i // 4) % 2],
            guidance_scale=[1.0, 4.0, 7.5][i % 3], seed=1000 + i, num_images=[1, 2, 1, 3][(i // 3) % 4],
            request_id=f"mix-{id(engine)}-{i}"))
    return reqs


@pytest.mark.parametrize("model", ["tiny", "tiny_xl"])
def test_concurrent_mix_equals_alone(request, model):
    engine = request.getfixturevalue(f"{model}_engine")
    reqs = _mix(engine)
    alone = [engine.run(r).arrays for r in reqs]
    steps_before = engine.stats["steps"]
    futures = [engine.submit(r) for r in reqs]
    results = [f.result(timeout=300) for f in futures]
    for r, res, ref in zip(reqs, results, alone):
        assert res.request_id == r.request_id and res.arrays.shape == (r.num_images, r.height, r.width, 3)
        np.testing.assert_allclose(res.arrays, ref, atol=1e-4, rtol=0)
    # they really shared steps: fewer steps than running them one after another
    assert engine.stats["steps"] - steps_before < sum(r.num_inference_steps for r in reqs)


def test_modes_give_the_same_images(tiny_engine):
    reqs = _mix(tiny_engine, 6)
    ref = [tiny_engine.run(r).arrays for r in reqs]
    for batching in ("request", "off"):
        with Engine(model="random:tiny", device="cpu", batching=batching, max_wait_ms=5) as e:
            futures = [e.submit(r) for r in reqs]
            for f, a in zip(futures, ref):
                np.testing.assert_allclose(f.result(timeout=300).arrays, a, atol=1e-4, rtol=0)


def test_abort_frees_rows():
    with Engine(model="random:tiny", device="cpu") as e:
        started = threading.Event()
        req = e.make_request("long", num_inference_steps=200, num_images=3, seed=1)
        fut = e.submit(req, on_progress=lambda rid, step, total: started.set())
        assert started.wait(60)
        assert e.live_rows()[(64, 64)] == 3
        assert e.abort(req.request_id)
        with pytest.raises(RequestAborted):
            fut.result(timeout=60)
        deadline = time.time() + 10
        while e.live_rows().get((64, 64), 0) != 0 and time.time() < deadline:
            time.sleep(0.01)
        assert e.live_rows().get((64, 64), 0) == 0
        assert e.generate("after", num_inference_steps=2, seed=3).arrays.shape == (1, 64, 64, 3)


def test_failing_step_fails_only_its_batch():
    with Engine(model="random:tiny", device="cpu", max_wait_ms=50) as e:
        real = e.runner.step
        calls = {"n": 0}

        def flaky(key, n, coefs, noise=None, stack=0, parts=None):
            if key == (96, 64) and calls["n"] == 0:
                calls["n"] += 1
                raise RuntimeError("simulated CUDA error")
            return real(key, n, coefs, noise, stack, parts)

        e.runner.step = flaky
        bad = [e.submit(e.make_request("x", height=96, num_inference_steps=3, seed=i)) for i in range(2)]
        good = [e.submit(e.make_request("y", num_inference_steps=3, seed=i)) for i in range(2)]
        for f in bad:
            with pytest.raises(EngineStepError, match="simulated CUDA error"):
                f.result(timeout=60)
        for f in good:
            assert f.result(timeout=60).arrays.shape == (1, 64, 64, 3)
        # the loop keeps serving the same group afterwards
        assert e.generate("x", height=96, num_inference_steps=2, seed=5).arrays.shape == (1, 96, 64, 3)


def test_full_queue_rejects_and_nothing_is_lost():
    with Engine(model="random:tiny", device="cpu", max_queue=3, batching="off") as e:
        futures, rejected = [], 0
        for i in range(12):
            try:
                futures.append(e.submit(e.make_request("q", num_inference_steps=20, seed=i)))
            except QueueFullError as err:
                assert "queue is full" in str(err)
                rejected += 1
        assert rejected > 0
        results = [f.result(timeout=120) for f in futures]
        assert len({r.request_id for r in results}) == len(futures)


def test_prompt_cache_and_output_formats(tiny_engine):
    hits = tiny_engine.stats["prompt_cache_hits"]
    r = tiny_engine.generate("cached prompt", num_inference_steps=2, seed=1, output_format="png")
    r2 = tiny_engine.generate("cached prompt", num_inference_steps=2, seed=1, output_format="webp")
    assert tiny_engine.stats["prompt_cache_hits"] >= hits + 2  # prompt and empty negative
    assert r.encoded[0][:8] == b"\x89PNG\r\n\x1a\n" and r2.encoded[0][:4] == b"RIFF"
    np.testing.assert_array_equal(r.arrays, r2.arrays)
    with pytest.raises(ValueError, match="output_format 'gif' is unknown"):
        tiny_engine.make_request("x", output_format="gif")


def test_async_engine_stream_and_generate(tiny_engine):
    import asyncio

    from diffgraph import AsyncEngine, ProgressEvent

    async def main():
        ae = AsyncEngine(tiny_engine)
        req = ae.make_request("a fox", num_inference_steps=4, seed=2)
        events = [e async for e in ae.stream(req)]
        res = await ae.generate("a fox", num_inference_steps=4, seed=2)
        return events, res

    events, res = asyncio.run(main())
    steps = [e.step for e in events if isinstance(e, ProgressEvent)]
    assert steps == [1, 2, 3, 4]
    np.testing.assert_array_equal(events[-1].arrays, res.arrays)


def test_async_cancel_and_early_close_abort_quietly(caplog):
    """Cancelling `generate` and closing a stream early both free the rows, and nothing is logged as a
    never-retrieved exception."""
    import asyncio
    import contextlib
    import gc

    from diffgraph import AsyncEngine

    async def main(ae):
        tasks = [asyncio.create_task(ae.generate("x", num_inference_steps=60, seed=i)) for i in range(3)]
        await asyncio.sleep(0.3)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        async with contextlib.aclosing(ae.stream(ae.make_request("y", num_inference_steps=60, seed=9))) as events:
            async for _ in events:
                break
        for _ in range(200):  # rows are freed at the next step boundary
            if not any(ae.engine.live_rows().values()) and not ae.engine.queue_depth():
                break
            await asyncio.sleep(0.05)
        return dict(ae.engine.live_rows()), ae.engine.queue_depth()

    with Engine(model="random:tiny", device="cpu") as e:
        with caplog.at_level("ERROR", logger="asyncio"):
            live, waiting = asyncio.run(main(AsyncEngine(e)))
            gc.collect()
        assert not any(live.values()) and waiting == 0
        assert "never retrieved" not in caplog.text
        assert e.generate("z", num_inference_steps=2, seed=1).arrays.shape == (1, 64, 64, 3)


def test_bad_input_is_rejected_before_it_reaches_a_batch(tiny_engine):
    with pytest.raises(ValueError, match="guidance_scale 1e\\+300 is out of range; allowed: 0..100"):
        tiny_engine.make_request("x", guidance_scale=1e300)
    with pytest.raises(ValueError, match="prompt is not valid text: it holds an unpaired surrogate"):
        tiny_engine.make_request("seven \ud800")
    with pytest.raises(ValueError, match="negative_prompt is not valid text"):
        tiny_engine.make_request("seven", negative_prompt="\udfff")
    with pytest.raises(ValueError, match="width 2050 is not a multiple of 8; use 2048$"):
        tiny_engine.make_request("x", width=2050)
    with pytest.raises(ValueError, match="device 'tpu' is not understood"):
        Engine(model="random:tiny", device="tpu")


def test_requests_made_any_way_are_checked(tiny_engine):
    """`dataclasses.replace` and the constructor check what `create` checks: nothing unchecked reaches a batch."""
    import dataclasses

    ok = tiny_engine.make_request("x", num_inference_steps=2, seed=1)
    for change, needle in [({"guidance_scale": -50}, "guidance_scale -50 is out of range"),
                           ({"guidance_scale": float("nan")}, "guidance_scale nan is out of range"),
                           ({"guidance_scale": 10**400}, "guidance_scale (an integer of about 401 digits) is out of range"),
                           ({"seed": -1}, "seed -1 is out of range"), ({"width": 60}, "width 60 is not a multiple of 8"),
                           ({"width": 0}, "width 0 is outside the supported range"),
                           ({"width": "512"}, "width must be an integer number of pixels, got '512'"),
                           ({"num_images": 0}, "num_images 0 is out of range"),
                           ({"output_format": "gif"}, "output_format 'gif' is unknown"),
                           ({"request_id": ""}, "request_id must be a non-empty string")]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            dataclasses.replace(ok, **change)
    with pytest.raises(ValueError, match=re.escape("guidance_scale (an integer of about 401 digits) is out of range")):
        tiny_engine.make_request("x", guidance_scale=10**400)
    with pytest.raises(ValueError, match=re.escape("seed (an integer of about 5001 digits) is out of range")):
        tiny_engine.make_request("x", seed=10**5000)  # too long for str(): the message must not call it
    with pytest.raises(ValueError, match=re.escape("width -(an integer of about 5001 digits) is outside the supported")):
        tiny_engine.make_request("x", width=-10**5000)


def test_step_count_the_model_schedule_cannot_take_is_bad_input():
    """Trailing spacing (Turbo/Lightning-style schedulers) degenerates at some step counts: a ValueError naming
    num_inference_steps at make_request and at submit, and the engine keeps serving."""
    import dataclasses

    from diffgraph.models.loader import load_model

    m = load_model("random:tiny", device="cpu")
    m = dataclasses.replace(m, scheduler_config={**m.scheduler_config, "timestep_spacing": "trailing"})
    with Engine(model=m) as e:
        with pytest.raises(ValueError, match="^num_inference_steps 61 does not work with sampler 'euler'"):
            e.make_request("x", num_inference_steps=61)
        ok = e.make_request("x", num_inference_steps=2, seed=1)
        with pytest.raises(ValueError, match="^num_inference_steps 61 "):
            e.submit(dataclasses.replace(ok, num_inference_steps=61))
        assert e.run(ok).arrays.shape == (1, 64, 64, 3)


def test_request_id_in_flight_is_refused_and_free_again_after():
    with Engine(model="random:tiny", device="cpu") as e:
        first = e.submit(e.make_request("one", num_inference_steps=30, seed=1, request_id="job-1"))
        with pytest.raises(ValueError, match="request_id 'job-1' is already in flight; give each request its own"):
            e.submit(e.make_request("two", num_inference_steps=2, seed=2, request_id="job-1"))
        first.result(timeout=120)  # the first is untouched by the refused one
        assert e.run(e.make_request("two", num_inference_steps=2, seed=2, request_id="job-1")).request_id == "job-1"


def test_a_dead_loop_is_not_ready_and_refuses_work(monkeypatch):
    """A bug in the loop itself: everyone waiting is answered, `ready` turns False, submits are refused."""
    e = Engine(model="random:tiny", device="cpu")
    assert e.ready
    monkeypatch.setattr(e.scheduler, "schedule", lambda: 1 / 0)
    fut = e.submit(e.make_request("x", num_inference_steps=2, seed=1))
    with pytest.raises(RuntimeError, match=re.escape("the engine failed (its loop stopped after an internal error "
                                                      "(ZeroDivisionError: division by zero)); retry this request")):
        fut.result(timeout=60)  # the engine is failed, as a tripped failure policy (a replica process restarts)
    e.core._thread.join(timeout=60)
    assert not e.ready
    with pytest.raises(RuntimeError, match="loop stopped after an internal error"):
        e.submit(e.make_request("y", num_inference_steps=2, seed=2))
    e.close()


def test_a_request_aborted_while_waiting_is_answered_when_the_loop_dies(monkeypatch):
    """The loop's last work answers requests aborted while waiting even when it ends on an internal error."""
    e = Engine(model="random:tiny", device="cpu")
    try:
        request = e.make_request("x", num_inference_steps=2, seed=1)
        with e.core._cv:  # the loop polls only once both are done
            fut = e.submit(request)
            assert e.abort(request.request_id)
            monkeypatch.setattr(e.scheduler, "schedule", lambda: 1 / 0)
        with pytest.raises(RequestAborted, match=f"request {request.request_id} was aborted"):
            fut.result(timeout=60)
    finally:
        e.close()


def test_failed_admission_fails_only_that_request():
    with Engine(model="random:tiny", device="cpu", max_wait_ms=100) as e:
        real = e.runner.text_encoder.encode

        def picky(prompts, graphs=True):
            if any(p.text == "poison" for p in prompts):
                raise RuntimeError("tokenizer rejected the text")
            return real(prompts, graphs)

        e.runner.text_encoder.encode = picky
        good = e.submit(e.make_request("fine", num_inference_steps=3, seed=1))
        bad = e.submit(e.make_request("poison", num_inference_steps=3, seed=2))
        with pytest.raises(ValueError, match="could not be admitted: RuntimeError: tokenizer rejected"):
            bad.result(timeout=60)
        ref = Engine(model="random:tiny", device="cpu").generate("fine", num_inference_steps=3, seed=1).arrays
        np.testing.assert_allclose(good.result(timeout=60).arrays, ref, atol=1e-4, rtol=0)
        assert e.generate("fine again", num_inference_steps=2, seed=3).arrays.shape == (1, 64, 64, 3)


def test_failing_readback_fails_only_the_finished_requests(monkeypatch):
    """Reading a finished request's latents back (or decoding them) fails: that request gets an EngineStepError,
    the requests still denoising go on, and the loop keeps serving."""
    with Engine(model="random:tiny", device="cpu") as e:
        real = e.runner.read_latents
        calls = []

        def read_once_broken(*args):
            calls.append(args)
            if len(calls) == 1:
                raise RuntimeError("CUDA out of memory (simulated)")
            return real(*args)

        monkeypatch.setattr(e.runner, "read_latents", read_once_broken)
        long = e.submit(e.make_request("long", num_inference_steps=40, seed=2))
        short = e.submit(e.make_request("short", num_inference_steps=3, seed=1))
        with pytest.raises(EngineStepError, match="decoding failed: RuntimeError: CUDA out of memory"):
            short.result(timeout=120)
        assert long.result(timeout=120).arrays.shape == (1, 64, 64, 3)
        assert e.ready and e.generate("again", num_inference_steps=2, seed=3).arrays.shape == (1, 64, 64, 3)


def test_broken_callbacks_do_not_stop_the_loop():
    with Engine(model="random:tiny", device="cpu") as e:
        e.step_listeners.append(lambda plan, seconds: 1 / 0)
        fut = e.submit(e.make_request("x", num_inference_steps=2, seed=1),
                       on_progress=lambda *a: (_ for _ in ()).throw(RuntimeError("client gone")))
        assert fut.result(timeout=60).arrays.shape == (1, 64, 64, 3)
        assert e.generate("y", num_inference_steps=2, seed=2).arrays.shape == (1, 64, 64, 3)


def test_tiny_prompt_cache_and_released_sizes():
    with Engine(model="random:tiny", device="cpu", prompt_cache_size=0) as e:
        futures = [e.submit(e.make_request(f"p{i}", num_inference_steps=2, seed=i, width=64 + 8 * (i % 3)))
                   for i in range(6)]
        assert all(f.result(timeout=60).arrays.shape[0] == 1 for f in futures)
        deadline = time.time() + 10
        while e.runner.groups and time.time() < deadline:  # idle groups give their buffers back
            time.sleep(0.01)
        assert e.runner.groups == {}


def test_the_prompt_cache_is_bounded_by_bytes_as_well_as_entries():
    """An LLM encoder's prompt row is megabytes: the cache keeps at most `max_bytes` of rows (least recently used out
    first), a row larger than the whole budget is not kept, and its byte count stays exact."""
    import torch

    from diffgraph.engine.prompts import PromptCache
    from diffgraph.text.prepared import PromptText

    def row(n):  # n float32 values: 4n bytes
        return {"embeds": torch.zeros(1, n)}

    cache = PromptCache(size=10, max_bytes=1000)
    keys = [("+", PromptText(f"p{i}", ids=((i,),)), ()) for i in range(5)]
    rows = {k: row(n) for k, n in zip(keys, (100, 100, 50, 300, 10))}
    encoded = []

    def encode(texts, loras):
        encoded.extend(t.text for t in texts)
        return [rows[next(k for k in keys if k[1] is t)] for t in texts]

    cache.embed(keys[:3], 0, encode, None)                # 400 + 400 + 200 bytes: the budget, all kept
    assert cache.nbytes() == 1000 and encoded == ["p0", "p1", "p2"]
    cache.embed([keys[0]], 0, encode, None)               # p0 used again: p1 is now the least recent
    cache.embed([keys[4]], 0, encode, None)               # +40 bytes: p1 (400) goes
    assert cache.nbytes() == 640
    cache.embed([keys[0], keys[1], keys[2]], 0, encode, None)
    assert encoded[-1:] == ["p1"]                         # only the evicted row is encoded again
    cache.embed([keys[3]], 0, encode, None)               # 1200 bytes alone: never kept
    assert cache.nbytes() == sum(4 * r["embeds"].numel() for r in cache._cache.values()) <= 1000
    assert all(k[1].text != "p3" for k in cache._cache)


def test_bucket_growth_policy_keeps_every_image(tiny_engine):
    """Graph mode (emulated on the CPU) hands the buckets to the scheduler; holding growth into a larger
    bucket changes who shares a batch, never an image."""
    from diffgraph.config import GraphConfig

    reqs = _mix(tiny_engine, 10)
    ref = [tiny_engine.run(r).arrays for r in reqs]
    graphs = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=((64, 64), (96, 64)), backend="emulated",
                         prewarm=False)
    with Engine(model=tiny_engine.model, mode="graph", graphs=graphs, grow_fill=1.0, grow_hold_ms=30) as e:
        assert e.scheduler.config.buckets == (1, 2, 4, 8) and e.scheduler.config.grow_fill == 1.0
        assert e.scheduler.config.padded == ((64, 64), (96, 64))
        futures = []
        for r in reqs:
            futures.append(e.submit(r))
            time.sleep(0.01)
        for f, a in zip(futures, ref):
            np.testing.assert_allclose(f.result(timeout=300).arrays, a, atol=1e-4, rtol=0)
        deadline = time.time() + 10
        while any(e.live_rows().values()) and time.time() < deadline:
            time.sleep(0.01)
        assert e.live_rows() == {(64, 64): 0, (96, 64): 0}  # graphed sizes always listed, at 0 when idle
        e.reconfigure(grow_fill=0.0)
        assert e.scheduler.config.grow_fill == 0.0 and e.scheduler.config.buckets == (1, 2, 4, 8)
        with pytest.raises(ValueError, match="cannot change"):
            e.reconfigure(max_rows=3)


def test_growth_hold_happens_and_changes_no_image(tiny_engine):
    """One request live on bucket 1; two more arrive: the first joins (bucket 2, full), the second would grow the
    batch to 3 rows on bucket 4 and waits (grow_fill 1.0) until grow_hold_ms or a free row; images as alone."""
    from diffgraph.config import GraphConfig

    long = tiny_engine.make_request("a long one", num_inference_steps=40, seed=5, request_id="hold-long")
    short = [tiny_engine.make_request(p, num_inference_steps=6, seed=s, request_id=f"hold-{s}")
             for p, s in (("first", 6), ("second", 7))]
    ref = [tiny_engine.run(r).arrays for r in [long, *short]]
    graphs = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=((64, 64),), backend="emulated", prewarm=False)
    with Engine(model=tiny_engine.model, mode="graph", graphs=graphs, grow_fill=1.0, grow_hold_ms=300) as e:
        started = threading.Event()
        futures = [e.submit(long, on_progress=lambda *a: started.set())]
        assert started.wait(60)
        futures += [e.submit(r) for r in short]
        for f, a in zip(futures, ref):
            np.testing.assert_allclose(f.result(timeout=300).arrays, a, atol=1e-4, rtol=0)
        assert e.scheduler.growth_holds >= 1


_EXIT_WHILE_STEPPING = """
import time
from diffgraph import Engine
engine = Engine(model="random:tiny", device="cpu")
engine.generate("a fox", num_inference_steps=2, width=64, height=64)
start = engine.stats["steps"]
future = engine.submit(engine.make_request("a fox", num_inference_steps=200, width=256, height=256))
while engine.stats["steps"] < start + 3:  # its steps are running
    time.sleep(0.01)
print("exiting while a step runs", flush=True)
"""


def test_a_script_that_exits_while_its_engine_steps_exits_cleanly():
    """An Engine never closed (a script's last line returns while a request steps) is closed at the interpreter's
    exit: its loop finishes the step it runs, instead of the teardown aborting the process under that native op
    ("terminate called without an active exception", SIGABRT: what README blocks that end without close() met)."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _EXIT_WHILE_STEPPING], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0 and "exiting while a step runs" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
    assert "terminate called" not in proc.stderr


def test_the_loop_waits_for_the_image_threads_once_their_backlog_passes_its_bound(monkeypatch):
    """Decoded pixels waiting for the image threads are bounded: past `max_backlog` bytes the loop waits for them
    before it decodes more (the backlog of a fast GPU and slow PNG encoders used to grow without limit)."""
    import diffgraph.engine.retirement as retirement
    entered, release = threading.Event(), threading.Event()
    real = retirement.encode_image

    def gated(*args, **kwargs):
        entered.set()
        assert release.wait(120), "the test never released the image threads"
        return real(*args, **kwargs)

    monkeypatch.setattr(retirement, "encode_image", gated)
    with Engine(model="random:tiny", device="cpu", dtype="fp32", image_threads=1) as e:
        ret = e.core.retirement
        ret.max_backlog, ret.decode_log = 1, []  # a byte: the second decode waits for the first's delivery
        first = e.submit(e.make_request("a cat", num_inference_steps=2, seed=1, output_format="png"))
        second = e.submit(e.make_request("a dog", num_inference_steps=4, seed=2, output_format="png"))
        assert entered.wait(120)  # the first request's image is being encoded, and stays so
        deadline = time.monotonic() + 120
        while ret.backlog_waits == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ret.backlog_waits == 1 and len(ret.decode_log) == 1  # the loop waits: the second is not decoded
        assert not first.done() and not second.done()
        release.set()
        a, b = first.result(timeout=120), second.result(timeout=120)
        # a result is set before its image thread takes its bytes off the backlog (`Retirement._deliver`)
        deadline = time.monotonic() + 120  # a failure bound
        while ret._backlog and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(ret.decode_log) == 2 and ret._backlog == 0
    assert a.encoded[0][:8] == b.encoded[0][:8] == b"\x89PNG\r\n\x1a\n"
    assert e.core.retirement.backlog_waits == 1
