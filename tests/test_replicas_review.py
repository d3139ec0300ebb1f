"""Replica and router failure paths found in review: a stopped replica must not block the server's event loop on
its pipe, and an aborted routed request must leave its replica's outstanding work."""

import asyncio
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from diffgraph import EngineClosed
from diffgraph.engine.handles import RequestHandleImpl
from diffgraph.engine.replica import ReplicaClient
from diffgraph.engine.router import Router
from diffgraph.request import GenerationRequest
from diffgraph.server import requests as server_requests
from diffgraph.api.protocol import APIError

MODEL = dict(model="random:tiny", dtype="fp32")
BOUND_S = 600  # a failure bound for waits, never a timing assumption


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
