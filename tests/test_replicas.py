"""Engine replicas in their own processes behind a router (`diffgraph serve --devices cpu,cpu`): the same images
as one engine, a replica killed mid-load loses no request silently and comes back, the HTTP server over two."""

import asyncio
import io
import signal
import time

import numpy as np
import pytest
from PIL import Image

from diffgraph import EngineClosed
from diffgraph.engine.replica import ReplicaClient
from diffgraph.engine.router import Router

MODEL = dict(model="random:tiny", dtype="fp32")
BOUND_S = 600  # a failure bound for waits, never a timing assumption


def pixels(result) -> np.ndarray:
    return np.stack([np.asarray(Image.open(io.BytesIO(b))) for b in result.encoded]).astype(int)


@pytest.fixture(scope="module")
def router():
    # replica_timeout: beats every 2 s; 8 s of silence is far beyond what a loaded 2-core machine delays a thread
    r = Router([ReplicaClient("cpu", MODEL, name=f"cpu#{i}", torch_threads=1, replica_timeout=8.0) for i in range(2)])
    # every replica, not only min_ready of them: the tests below need both serving
    assert all(replica.wait_ready(BOUND_S) for replica in r.replicas), r.replica_states()
    yield r
    r.close()


def run_all(router, requests):
    async def go():
        handles = [await router.submit(q) for q in requests]
        return await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
    return asyncio.run(go())


def test_replicas_give_one_engines_images_and_share_the_work(router, tiny_engine):
    requests = [tiny_engine.make_request("a cat", num_inference_steps=4, seed=i, num_images=1 + i % 2,
                                         sampler=["euler", "dpmpp_2m"][i % 2], output_format="png") for i in range(8)]
    results = run_all(router, requests)
    for q, r in zip(requests, results):
        assert r.request_id == q.request_id and r.arrays is None  # the bytes crossed, not the pixels
        assert np.abs(pixels(r) - pixels(tiny_engine.run(q))).max() <= 1
    stats = [r.stats() for r in router.replicas]
    assert None not in stats, router.replica_states()
    steps = [s.steps for s in stats]
    assert all(s > 0 for s in steps), steps  # both replicas served
    assert router.stats().steps == sum(steps) and router.ready
    assert [s["state"] for s in router.replica_states()] == ["ready", "ready"]


def test_a_killed_replica_answers_its_requests_and_comes_back(router, tiny_engine):
    requests = [tiny_engine.make_request("a dog", num_inference_steps=60, seed=i, output_format="png")
                for i in range(6)]

    async def go():
        handles = [await router.submit(q, progress=True) for q in requests]
        victim = router.replicas[0]
        first = handles[[router._work[h.request_id][0] for h in handles].index(victim)]  # one of the victim's
        async for item in first.events():  # the victim is busy: one of its requests made progress
            break
        victim.kill()
        return await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
    results = asyncio.run(go())
    lost = [r for r in results if isinstance(r, EngineClosed)]
    assert lost and all(isinstance(r, EngineClosed) or r.encoded for r in results), results
    assert all("stopped" in str(e) and "retry" in str(e) for e in lost)
    victim = router.replicas[0]
    assert victim.wait_ready(BOUND_S) and victim.restarts == 1
    again = run_all(router, [tiny_engine.make_request("a cat", num_inference_steps=2, seed=9, output_format="png")
                             for _ in range(4)])
    assert all(not isinstance(r, Exception) for r in again)


def test_a_stopped_replica_is_routed_around_its_requests_end_and_it_comes_back(router, tiny_engine):
    """SIGSTOP of one of two replicas under load (issue 28 point 1): no heartbeat within the replica timeout makes it
    unresponsive: its requests end with 503 (those not started move to the other replica and succeed), new
    requests succeed on the other, and SIGCONT brings it back."""
    import os
    requests = [tiny_engine.make_request("a dog", num_inference_steps=40, seed=i, output_format="png")
                for i in range(8)]
    victim = router.replicas[1]
    moved = router.moved

    async def go():
        handles = [await router.submit(q, progress=True) for q in requests]
        first = handles[[router._work[h.request_id][0] for h in handles].index(victim)]
        async for item in first.events():  # the victim is busy: one of its requests made progress
            break
        os.kill(victim._process.pid, signal.SIGSTOP)
        results = await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
        assert victim.state == "unresponsive" and router.ready and "no heartbeat" in victim.error
        later = [tiny_engine.make_request("a cat", num_inference_steps=2, seed=i, output_format="png")
                 for i in range(3)]
        extra = await asyncio.gather(*[(await router.submit(q)).result() for q in later], return_exceptions=True)
        return results, extra
    try:
        results, extra = asyncio.run(go())
    finally:
        os.kill(victim._process.pid, signal.SIGCONT)
    lost = [r for r in results if isinstance(r, EngineClosed)]
    assert lost and all(isinstance(r, EngineClosed) or r.encoded for r in results), results
    assert all("stopped answering" in str(e) and "retry" in str(e) for e in lost)
    assert all(not isinstance(r, Exception) for r in extra), extra  # new requests went to the other replica
    deadline = time.monotonic() + BOUND_S
    while victim.state != "ready" and time.monotonic() < deadline:  # SIGCONT: its beats resume, it is ready again
        time.sleep(0.1)
    assert victim.state == "ready" and victim.restarts == 0 and router.moved >= moved
    again = run_all(router, [tiny_engine.make_request("a cat", num_inference_steps=2, seed=9, output_format="png")
                             for _ in range(4)])
    assert all(not isinstance(r, Exception) for r in again)


def test_results_do_not_carry_their_inputs_back(router, tiny_engine):
    """An edit's result comes back without its request (the parent re-attaches its own: the input image crosses
    once), and matches the in-process engine's."""
    size = tiny_engine.info.native_size
    image = (np.arange(size * size * 3) % 251).astype(np.uint8).reshape(size, size, 3)
    q = tiny_engine.make_request("a cat", num_inference_steps=4, seed=3, image=image, output_format="png")
    result = run_all(router, [q])[0]
    assert result.request is q  # the parent's own object, not a copy that travelled back
    assert np.abs(pixels(result) - pixels(tiny_engine.run(q))).max() <= 1


def test_the_output_thread_sends_small_messages_together_and_results_alone():
    import queue

    from diffgraph.engine.replica_messages import Batch, Beat, Done, Progress, Step
    from diffgraph.engine.replica_process import _send_all

    class Pipe:
        def __init__(self):
            self.sent = []

        def send(self, message):
            self.sent.append(message)

    outbox, pipe = queue.SimpleQueue(), Pipe()
    for m in [Progress("a", 1, 4), Progress("b", 1, 4), Step("e"), Done("a", "result", None), Beat(0.0), None]:
        outbox.put(m)
    _send_all(pipe, outbox)  # returns at the None
    assert pipe.sent == [Batch((Progress("a", 1, 4), Progress("b", 1, 4), Step("e"))), Done("a", "result", None),
                         Beat(0.0)]


def test_data_parallel_and_device_settings():
    from diffgraph.server.cli import data_parallel_devices
    from diffgraph.api.config import ServerConfig, load_config

    assert data_parallel_devices("2", visible=4) == "cuda:0,cuda:1"
    assert data_parallel_devices("all", visible=3) == "cuda:0,cuda:1,cuda:2"
    with pytest.raises(ValueError, match="has 1 visible GPU"):
        data_parallel_devices("2", visible=1)
    assert load_config(None, {"model": "random:tiny", "devices": "cpu,cpu"}).devices == ("cpu", "cpu")
    with pytest.raises(ValueError, match="min-ready 3 must be in 1..2"):
        ServerConfig(model="random:tiny", devices=("cpu", "cpu"), min_ready=3)
    with pytest.raises(ValueError, match="not understood"):
        ServerConfig(model="random:tiny", devices=("tpu",))


def test_the_server_over_two_cpu_replicas():
    import concurrent.futures

    import base64

    import httpx
    from test_server import generate

    from diffgraph import Engine
    from diffgraph.server.process import ServerProcess

    s = ServerProcess("--devices", "cpu,cpu", "--max-queue", "64", model="digits")
    try:
        s.wait_ready()  # /ready says 200 once one replica (--min-ready 1) is ready; the other may still start
        from test_server import wait_for
        ready = wait_for(lambda: (lambda b: b if all(r["state"] == "ready" for r in b["replicas"]) else None)(
            httpx.get(s.url + "/ready", timeout=300).json()), what="both replicas ready")
        assert [r["replica"] for r in ready["replicas"]] == ["cpu#0", "cpu#1"]
        prompt = "a handwritten digit {}".format
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda i: generate(s.url, prompt=prompt(i), num_inference_steps=6, seed=i),
                                    range(6)))
        assert [a.status_code for a in answers] == [200] * 6 and [a.json()["seed"] for a in answers] == list(range(6))
        one = Engine("digits", device="cpu")  # the same seeds on one engine in this process: the same images
        try:
            for i, a in enumerate(answers):
                got = np.asarray(Image.open(io.BytesIO(base64.b64decode(a.json()["data"][0]["b64_json"])))).astype(int)
                want = np.asarray(one.generate(prompt(i), num_inference_steps=6, seed=i).images[0]).astype(int)
                assert np.abs(got - want).max() <= 1, i
        finally:
            one.close()
        streamed = httpx.post(s.url + "/v1/images/generations", timeout=600,
                              json={"prompt": "a handwritten digit one", "num_inference_steps": 3, "stream": True,
                                    "seed": 1})
        assert streamed.text.count(": progress ") == 3 and "event: image_generation.completed" in streamed.text
        metrics = httpx.get(s.url + "/metrics", timeout=300).text
        lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
        per = [float(lines[f'diffgraph_replica_engine_steps_total{{replica="cpu#{i}"}}']) for i in (0, 1)]
        assert sum(per) == float(lines["diffgraph_engine_steps_total"]) and min(per) > 0  # totals and each replica
        assert lines['diffgraph_replica_ready{replica="cpu#1"}'] == "1.0"
        # SIGTERM drains every replica: a request in flight finishes, then the process exits 0
        import threading
        late = {}
        t = threading.Thread(target=lambda: late.update(r=generate(s.url, num_inference_steps=80, seed=3)))
        t.start()
        wait_for(lambda: httpx.get(s.url + "/metrics", timeout=300).text.count("diffgraph_inflight_requests 1.0"),
                 what="the late request in flight")
        s.proc.send_signal(signal.SIGTERM)
        t.join(600)
        assert late["r"].status_code == 200 and s.proc.wait(120) == 0
    finally:
        s.stop()


def test_the_heartbeat_verdicts_wedged_back_and_killed():
    """ReplicaClient._check without a process: a beat saying the loop has been in one pass past the timeout (a
    driver call that never returns) makes the replica unresponsive and answers its requests 503 (aborted on its side);
    a beat under it brings it back; 4 timeouts of silence kill the process to restart it."""
    import threading as th
    from diffgraph.engine.replica_messages import Abort

    from diffgraph.engine.handles import RequestHandleImpl

    class Pipe:
        def __init__(self):
            self.sent = []

        def send(self, message):
            self.sent.append(message)

    class Process:
        killed = False

        def kill(self):
            self.killed = True

    r = object.__new__(ReplicaClient)
    r.name, r.state, r.error, r.replica_timeout = "cpu#9", "ready", None, 10.0
    r._lock, r._conn = th.Lock(), Pipe()
    r._handles, r._pending, r._asked, r._requests = {}, {}, {}, {}
    errors = []

    async def go():
        handle = RequestHandleImpl(lambda h: True, _request(), progress=False)
        handle.finish = lambda result, error: errors.append(error)
        r._handles["q1"] = handle
        process = Process()
        r._check(0.0, 3.0, process)
        assert r.state == "ready"  # a long step under the timeout: nothing to say
        r._check(0.0, 12.0, process)
        assert r.state == "unresponsive" and "in one step for 12 s" in r.error and not r._handles
        assert r._conn.sent == [Abort("q1")]
        r._check(0.0, 0.0, process)
        assert r.state == "ready" and r.error is None  # it answers again
        r._check(15.0, 0.0, process)
        assert r.state == "unresponsive" and "no heartbeat for 15 s" in r.error and not process.killed
        r._check(41.0, 0.0, process)
        assert process.killed  # 4 timeouts: killed, restarted as a crashed replica is
    asyncio.run(go())
    assert len(errors) == 1 and isinstance(errors[0], EngineClosed) and "stopped answering" in str(errors[0])


def _left_down(name: str, last_error: str | None = None) -> ReplicaClient:
    """A replica client (no process) whose replica exited once with no restarts allowed: left down. `last_error`: what
    its process reported before it exited."""
    import threading as th

    r = object.__new__(ReplicaClient)
    r.name, r.state, r.error, r.restarts = name, "starting", None, 0
    r._crashes, r._window_s, r._max_restarts, r._backoff_s = [], 60.0, 0, 1.0
    r._lock, r._ready_event = th.Lock(), th.Event()
    r._handles, r._pending, r._asked, r._requests = {}, {}, {}, {}
    if last_error is not None:
        from diffgraph.engine.replica_messages import Failed
        r._dispatch(Failed(last_error))
    r._on_exit(1)
    return r


def test_a_replica_left_down_still_says_why_its_engine_failed():
    """The engine's own error (here, a build failure its process reported before exiting) stays in the replica's
    error once it is left down, not only in the log."""
    r = _left_down("cpu#3", "could not build the engine: no model at /models/x.safetensors")
    assert r.state == "down" and r._ready_event.is_set()
    assert r.error == ("crashed 1 time within 60 s; left down (its last error: could not build the engine: no model "
                       "at /models/x.safetensors)")


def test_replicas_left_down_fail_health_once_fewer_than_min_ready_can_serve():
    """A replica left down after repeated crashes is never started again. With too few left to be ready, /ready and
    every request answered 503 for good while /health answered 200, so a liveness probe never restarted the server.
    /health answers 503 with the reason then; while enough replicas can serve, or may come back (restarting), 200."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from diffgraph.server.app import create_app
    from diffgraph.api.config import ServerConfig
    down = _left_down("cpu#0")
    up = SimpleNamespace(name="cpu#1", state="ready", ready=True, error=None, info=None)
    back = SimpleNamespace(name="cpu#1", state="restarting", ready=False, error="exit code -9", info=None)
    app = create_app(ServerConfig(model="random:tiny", device="cpu"), engine_factory=lambda: None)
    client = TestClient(app)  # outside a `with`: no lifespan, nothing is built; the routers below are its engine
    for replicas, min_ready, healthy in (([down, up], 1, True), ([down, back], 1, True), ([down, up], 2, False),
                                         ([down], 1, False)):
        app.state.server.engine = Router(replicas, min_ready)
        r = client.get("/health")
        assert r.json()["ready"] is (up in replicas and min_ready == 1), r.text
        if healthy:
            assert r.status_code == 200 and r.json()["status"] == "ok", r.text
            continue
        assert r.status_code == 503 and r.json()["status"] == "down", r.text
        assert "cpu#0: crashed 1 time within 60 s; left down" in r.json()["error"], r.text
        assert "restart the server" in r.json()["error"], r.text
    assert client.get("/ready").status_code == 503


def _request():
    from diffgraph.request import GenerationRequest
    return GenerationRequest.create("a cat", width=64, height=64, guidance_scale=5.0, request_id="q1")
