"""Engine replicas in their own processes behind a router (`diffgraph serve --devices cpu,cpu`): the same images
as one engine, a replica killed mid-load loses no request silently and comes back, the HTTP server over two. Failure
paths: a stopped replica does not block the server's event loop on its pipe, an aborted routed request leaves its
replica's outstanding work (also while it moves to another replica), and a replica beats while it builds its engine
(one that stops beating then is killed and restarted)."""

import asyncio
import io
import os
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from diffgraph import EngineClosed
from diffgraph.api.protocol import APIError
from diffgraph.engine.handles import RequestHandleImpl
from diffgraph.engine.replica import ReplicaClient
from diffgraph.engine.router import Router
from diffgraph.request import GenerationRequest
from diffgraph.server import requests as server_requests

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


# -- failure paths: a stopped replica's pipe, aborted routed requests, beats while a replica builds ------------
def request(prompt: str = "a cat", steps: int = 2) -> GenerationRequest:
    return GenerationRequest.create(prompt, num_inference_steps=steps, width=64, height=64, guidance_scale=5.0)


class _FakeReplica:
    """A ready replica that accepts every request and records aborts (what the router asks of a replica)."""

    def __init__(self, name: str):
        self.name, self.state, self.error, self.info, self.aborted = name, "ready", None, None, asyncio.Event()

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def submit(self, request, progress=False, hold=None):
        await asyncio.sleep(0)  # answers after a turn of the loop, as a replica's "accepted" does
        return RequestHandleImpl(lambda h: self.abort(h.request_id), request, progress)

    def abort(self, request_id: str) -> bool:
        self.aborted.set()
        return True


def test_a_late_routed_submission_that_is_aborted_leaves_its_replicas_work():
    """`_bounded` gives up on a submission (timeout, client gone) and aborts the handle when it arrives; nobody
    reads its events, so the abort itself must take the request off the router's count, else the replica looks
    busy forever (least-work routing skews, /replicas shows ghosts in flight)."""
    async def go():
        replicas = [_FakeReplica("a"), _FakeReplica("b")]
        router = Router(replicas)
        state = SimpleNamespace(config=SimpleNamespace(request_timeout=1.0))
        with pytest.raises(APIError) as e:  # the deadline has passed: 504 before the submission completed
            await server_requests._bounded(state, router.submit(request()), time.monotonic() - 1.0, None)
        assert e.value.status == 504
        aborted = asyncio.ensure_future(asyncio.wait([asyncio.ensure_future(r.aborted.wait()) for r in replicas],
                                                     return_when=asyncio.FIRST_COMPLETED))
        await asyncio.wait_for(aborted, 30)  # the late handle was aborted (a failure bound)
        return [router.outstanding(r) for r in replicas], router.replica_states()
    outstanding, states = asyncio.run(go())
    assert outstanding == [(0, 0), (0, 0)], outstanding
    assert [s["in_flight"] for s in states] == [0, 0]


def test_a_stopped_replica_does_not_block_the_event_loop_on_its_pipe():
    """Submissions to a replica that stopped reading its pipe (SIGSTOP, or its intake busy) fill the pipe; the
    send must not block the event loop (the whole HTTP server) nor deadlock the reader thread, which has to find
    the replica unresponsive and answer those submissions with EngineClosed."""
    replica = ReplicaClient("cpu", MODEL, name="stopped", torch_threads=1, replica_timeout=4.0)
    done = threading.Event()
    outcome: list = []
    try:
        assert replica.wait_ready(BOUND_S), replica.error
        # together far more than a pipe's buffer (about 200 KB): a sender to a stopped reader blocks on it
        requests = [request("a cat " * 3000) for _ in range(100)]
        os.kill(replica.pid, signal.SIGSTOP)

        def serve() -> None:
            async def go():
                return await asyncio.gather(*(replica.submit(q) for q in requests), return_exceptions=True)
            outcome.extend(asyncio.run(go()))
            done.set()
        threading.Thread(target=serve, daemon=True).start()
        answered = done.wait(60)  # a failure bound: the heartbeat finds it unresponsive after 4 s
    finally:
        replica.kill()  # also unblocks a sender stuck on the stopped replica's pipe
        replica.close()
    assert answered, "the event loop was blocked sending to a stopped replica"
    assert len(outcome) == len(requests) and all(isinstance(r, EngineClosed) for r in outcome), outcome[:3]


def test_a_replica_that_stops_beating_while_it_builds_is_killed_and_restarted(monkeypatch):
    """A replica whose build went silent (stopped, or stuck holding the interpreter's lock) stayed "starting"
    forever: the heartbeat began only once it was ready. Now a process that began beating and then says nothing for
    4 x replica_timeout while building is killed (and so restarted like a crashed one); a process that has not yet
    said anything (its interpreter still starting) and a building one that beats are left alone."""
    monkeypatch.setattr(ReplicaClient, "_start", lambda self: None)
    replica = ReplicaClient("cpu", MODEL, name="builder", replica_timeout=2.0)
    killed: list[int] = []
    process = SimpleNamespace(kill=lambda: killed.append(1))
    for state in ("starting", "restarting"):
        replica.state, replica.error = state, None
        replica._check(7.9, 0.0, process, spoke=True)  # under 4 timeouts: a slow build
        replica._check(60.0, 0.0, process, spoke=False)  # its interpreter has not begun: not judged
        assert killed == [] and replica.error is None
        replica._check(8.0, 0.0, process, spoke=True)
        assert killed == [1] and "no heartbeat for 8 s while building its engine" in replica.error
        killed.clear()
    replica.state = "ready"
    replica._check(8.0, 0.0, process, spoke=True)  # a ready one goes unresponsive first, as before
    assert replica.state == "unresponsive" and killed == []


def test_a_replica_beats_while_it_builds_its_engine(monkeypatch):
    """replica_main beats from the moment it starts building (the parent's judge of a stuck build above), and
    stops once the build ends (here: fails, reported as "failed")."""
    import multiprocessing

    import diffgraph.engine.engine as engine_module
    from diffgraph.engine.replica_process import replica_main
    release = threading.Event()

    class SlowEngine:
        def __init__(self, **kwargs):
            release.wait(BOUND_S)
            raise ValueError("the model folder went away")

    monkeypatch.setattr(engine_module, "Engine", SlowEngine)
    parent, child = multiprocessing.Pipe(duplex=True)
    thread = threading.Thread(target=replica_main, args=(child, "cpu", {}, None, 0.01), daemon=True)
    thread.start()
    from diffgraph.engine.replica_messages import Batch

    kinds: list[str] = []

    def read() -> None:
        message = parent.recv()
        kinds.extend(type(m).__name__ for m in (message.messages if isinstance(message, Batch) else (message,)))
    while "Beat" not in kinds and parent.poll(BOUND_S):  # a failure bound: beats come every 0.01 s
        read()
    release.set()
    while "Failed" not in kinds and parent.poll(BOUND_S):
        read()
    thread.join(BOUND_S)
    assert "Beat" in kinds and "Failed" in kinds and "Ready" not in kinds, kinds


def test_an_abort_by_id_reaches_a_request_while_it_moves_to_another_replica():
    """Its first replica closed before it ran (EngineClosed): while the router submits it to the next one, an abort
    by id (A1111's /interrupt, a cancelled job) found no replica holding it and answered False, and the request ran
    to its end there. Now the abort is taken and the next replica's handle is aborted as it arrives."""
    async def go():
        closing, slow = _FakeReplica("a"), _FakeReplica("b")
        entered, gate, aborted_ids = asyncio.Event(), asyncio.Event(), []

        async def closes(req, progress=False, hold=None):
            handle = RequestHandleImpl(lambda h: False, req, progress)
            handle.finish(None, EngineClosed("replica a stopped"))
            closing.state = "stopped"  # it stopped with the request waiting there
            return handle

        async def waits(req, progress=False, hold=None):
            entered.set()
            await gate.wait()
            def abort(h):  # as an engine does: the aborted request ends
                aborted_ids.append(h.request_id)
                h.finish(None, RuntimeError("aborted"))
                return True
            return RequestHandleImpl(abort, req, progress)
        closing.submit, slow.submit = closes, waits
        router = Router([closing, slow])
        req = request()
        handle = await router.submit(req)
        result = asyncio.ensure_future(handle.result())
        await asyncio.wait_for(entered.wait(), BOUND_S)  # a failure bound: it is on its way to replica b
        taken = router.abort(req.request_id)
        gate.set()
        with pytest.raises(RuntimeError, match="aborted"):
            await asyncio.wait_for(result, BOUND_S)
        return taken, aborted_ids, router.moved, [router.outstanding(r) for r in (closing, slow)]
    taken, aborted_ids, moved, outstanding = asyncio.run(go())
    assert taken is True and moved == 1
    assert aborted_ids and set(aborted_ids) == {aborted_ids[0]}, aborted_ids
    assert outstanding == [(0, 0), (0, 0)], outstanding
