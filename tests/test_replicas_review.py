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
from diffgraph.server.protocol import APIError

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
