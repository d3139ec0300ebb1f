"""`ReplicaClient`: one engine in its own process (one per device), behind the `EngineClient` protocol.

The parent talks to the replica over one duplex pipe; everything on it is the protocol's picklable data:

    parent -> replica   ("submit", request, progress) | ("abort", request_id) | ("stats", token) | ("close",)
    replica -> parent   ("ready", ModelInfo) | ("failed", message) | ("accepted", request_id)
                        | ("rejected", request_id, error) | ("progress", ProgressEvent) | ("step", StepEvent)
                        | ("done", request_id, result, error) | ("stats", token, EngineStats)
                        | ("beat", seconds its engine loop has been inside one pass, 0 when waiting)

Results carry the images encoded by the replica (its image threads), and no float pixels when the request asked
for an encoded format: the bytes move once; nor their request (the parent keeps it: an edit's input image never
comes back). The replica's engine threads only queue their messages; its output thread sends them, the small ones
queued together as one ("batch", [...]) message, each result on its own, so the GPU loop never waits for the pipe. The parent's reader thread answers each request's handle; when the
pipe breaks (the process died), every request in flight on it is answered at once with EngineClosed (HTTP 503,
retryable), and the replica is started again after a backoff, unless it crashed `max_restarts` times within
`restart_window_s`: then it is left down and reported so (`state`), not restarted in a loop.

Heartbeat: a ready replica sends a beat every quarter of `replica_timeout` from a thread of its own. A replica that
sends nothing for `replica_timeout` (stopped by SIGSTOP, starved) or whose engine loop has been inside one pass for
longer (wedged in a driver call) is "unresponsive": not ready (routed around), its requests in flight answered at once
with EngineClosed (503, retryable; the router moves those that had not started) and aborted on its side. When it
answers again within `replica_timeout` it is ready again; one that stays unresponsive for 4 x `replica_timeout` is
killed and restarted like a crashed one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from ..request import EngineClosed, GenerationRequest, ModelInfo
from .async_engine import RequestHandleImpl
from .client import EngineStats, StepEvent

logger = logging.getLogger(__name__)

STATES = ("starting", "ready", "unresponsive", "restarting", "down", "closed")


def _replica_main(conn: Any, device: str, engine_kwargs: dict[str, Any], torch_threads: int | None,
                  beat_s: float = 1.0) -> None:
    """The replica process: build the engine, then serve the pipe until "close" or the parent goes away."""
    if torch_threads is not None:
        import torch
        torch.set_num_threads(torch_threads)
    from .async_engine import AsyncEngine
    from .engine import Engine

    outbox: queue.SimpleQueue = queue.SimpleQueue()
    send = outbox.put  # the engine's threads only queue their messages: the output thread sends them
    output = threading.Thread(target=_send_all, args=(conn, outbox), name="diffgraph-replica-output", daemon=True)
    output.start()

    def last(message: tuple) -> None:  # a final message: queued after everything else, sent before the exit
        outbox.put(message)
        outbox.put(None)
        output.join(30)

    try:
        engine = Engine(device=device, **engine_kwargs)
        engine.generate("warm-up", num_inference_steps=1, seed=0)
    except Exception as e:
        return last(("failed", f"{type(e).__name__}: {e}"))
    client = AsyncEngine(engine)

    def failed(reason: str) -> None:  # the failure policy tripped: its requests are answered; say why, exit
        last(("failed", reason))
        os._exit(3)  # the parent restarts it (with backoff); a poisoned device context is not worth a clean close
    engine.core.on_failure.append(failed)
    client.add_step_listener(lambda event: send(("step", event)))
    send(("ready", engine.info))
    beating = threading.Event()

    def beat() -> None:  # its own thread: beats while the loop steps, and says how long the current pass runs
        while not beating.wait(beat_s):
            since = engine.core.loop.busy_since
            send(("beat", 0.0 if since is None else time.monotonic() - since))
    threading.Thread(target=beat, name="diffgraph-replica-beat", daemon=True).start()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        kind = message[0]
        if kind == "submit":
            _, request, progress = message
            on_progress = (lambda rid, step, total: send(("progress", rid, step, total))) if progress else None
            on_preview = (lambda e: send(("progress", e.request_id, e.step, e.total, e.previews, e.preview_format))
                          ) if progress else None
            try:
                future = engine.submit(request, on_progress=on_progress, on_preview=on_preview)
            except Exception as e:  # ParamError, QueueFullError, EngineClosed: the caller's answer
                send(("rejected", request.request_id, e))
                continue
            send(("accepted", request.request_id))
            future.add_done_callback(lambda f, rid=request.request_id: send(("done", rid, *_outcome(f))))
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "stats":
            send(("stats", message[1], client.stats()))
        elif kind == "close":
            break
    beating.set()
    engine.close()
    outbox.put(None)  # the output thread ends after what is queued
    output.join(30)


def _send_all(conn: Any, outbox: queue.SimpleQueue) -> None:
    """The replica's output thread: what the engine's threads queued, in order; the small messages queued together
    (progress, steps, beats, acceptances) go as one ("batch", [...]) message, a result on its own. The GPU loop
    never waits for the pipe, however slowly the parent reads."""
    while True:
        message = outbox.get()
        small: list[tuple] = []
        while message is not None and message[0] != "done" and len(small) < 256:
            small.append(message)
            try:
                message = outbox.get_nowait()
            except queue.Empty:
                message = ()
                break
        try:
            if small:
                conn.send(small[0] if len(small) == 1 else ("batch", small))
            if message:
                conn.send(message)
        except (OSError, ValueError):  # the parent is gone: nothing to answer
            return
        if message is None:
            return


def _outcome(future: Future) -> tuple[Any, BaseException | None]:
    error = future.exception()
    if error is not None:
        return None, error
    result = future.result()
    if result.encoded is not None:
        result.arrays = None  # the encoded bytes are what the caller sends on: do not move the pixels too
    result.request = None  # the parent has it (with an edit's input image): results do not carry inputs back
    return result, None


class ReplicaClient:
    """An engine replica process on `device`; thread-safe; restarts after a crash (with backoff)."""

    def __init__(self, device: str, engine_kwargs: dict[str, Any] | None = None, name: str | None = None,
                 max_restarts: int = 3, restart_window_s: float = 300.0, backoff_s: float = 1.0,
                 torch_threads: int | None = None, replica_timeout: float = 30.0):
        if not replica_timeout > 0:
            raise ValueError(f"replica_timeout {replica_timeout} must be > 0 seconds (--replica-timeout)")
        self.replica_timeout = replica_timeout
        self.device = device
        self._threads = torch_threads
        self.name = name or device
        self._kwargs = {k: v for k, v in (engine_kwargs or {}).items() if k != "device"}
        self._max_restarts = max_restarts
        self._window_s = restart_window_s
        self._backoff_s = backoff_s
        self._lock = threading.Lock()
        self._handles: dict[str, RequestHandleImpl] = {}
        self._requests: dict[str, GenerationRequest] = {}  # what its results are answers to (not sent back)
        self._pending: dict[str, Future] = {}     # submits waiting for accepted / rejected
        self._stats: dict[int, Future] = {}
        self._tokens = itertools.count()
        self._listeners: list[Callable[[StepEvent], None]] = []
        self._crashes: list[float] = []
        self.state = "starting"
        self.error: str | None = None
        self.restarts = 0
        self.info: ModelInfo | None = None
        self._ready_event = threading.Event()
        self._start()

    # -- process lifetime ------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA state or threads inherited
        parent, child = ctx.Pipe(duplex=True)
        self._conn = parent
        self._process = ctx.Process(target=_replica_main, args=(child, self.device, self._kwargs, self._threads,
                                                                self.replica_timeout / 4),
                                    name=f"diffgraph-replica-{self.name}", daemon=True)
        self._process.start()
        child.close()
        threading.Thread(target=self._read, args=(parent, self._process), name=f"diffgraph-replica-{self.name}",
                         daemon=True).start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Waits until the replica is ready or has given up (a bound for callers, not a timing assumption)."""
        self._ready_event.wait(timeout)
        return self.state == "ready"

    def _read(self, conn: Any, process: Any) -> None:
        heard = time.monotonic()
        while True:
            try:
                if not conn.poll(self.replica_timeout / 4):
                    self._check(time.monotonic() - heard, 0.0, process)
                    continue
                message = conn.recv()
            except (EOFError, OSError):
                break
            heard = time.monotonic()
            if message[0] == "beat":
                self._check(0.0, message[1], process)
            else:
                self._dispatch(message)
        process.join(5)
        self._on_exit(process.exitcode)

    def _check(self, silent_s: float, busy_s: float, process: Any) -> None:
        """The heartbeat's verdict (module docstring): unresponsive, back, or killed after 4 timeouts."""
        stuck = max(silent_s, busy_s)
        if stuck < self.replica_timeout:
            if self.state == "unresponsive":
                logger.warning("replica %s answers again; ready", self.name)
                self.state, self.error = "ready", None
            return
        if self.state == "ready":
            self.state = "unresponsive"
            self.error = (f"no heartbeat for {silent_s:.0f} s" if silent_s else
                          f"its engine loop has been in one step for {busy_s:.0f} s") + \
                f" (--replica-timeout {self.replica_timeout:g})"
            logger.error("replica %s is unresponsive: %s; its requests are answered 503", self.name, self.error)
            self._answer_all(EngineClosed(f"replica {self.name} stopped answering ({self.error}); retry this "
                                          "request (other replicas keep serving)"), abort=True)
        elif self.state == "unresponsive" and stuck >= 4 * self.replica_timeout:
            logger.error("replica %s unresponsive for %.0f s: killing it to restart it", self.name, stuck)
            process.kill()

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            self.info, self.error = message[1], None
            if self.state != "closed":
                self.state = "ready"
            self._ready_event.set()
        elif kind == "failed":
            self.error = message[1]
            logger.error("replica %s %s: %s", self.name, "failed" if self.state == "ready" else
                         "could not build its engine", self.error)
            if self.state == "ready":  # its engine failed: routed around until it restarts
                self.state = "restarting"
        elif kind in ("accepted", "rejected"):
            with self._lock:
                future = self._pending.pop(message[1], None)
            if future is not None:
                future.set_result(message[2] if kind == "rejected" else None)
        elif kind == "progress":
            from ..request import ProgressEvent
            handle = self._handles.get(message[1])
            if handle is not None:
                handle.progress(ProgressEvent(*message[1:]))
        elif kind == "done":
            with self._lock:
                handle = self._handles.pop(message[1], None)
                request = self._requests.pop(message[1], None)
            if handle is not None:
                if message[2] is not None:
                    message[2].request = request
                handle.finish(message[2], message[3])
        elif kind == "batch":
            for part in message[1]:
                self._dispatch(part)
        elif kind == "step":
            for listener in list(self._listeners):
                try:
                    listener(message[1])
                except Exception:
                    logger.exception("step listener %r failed", listener)
        elif kind == "stats":
            with self._lock:
                future = self._stats.pop(message[1], None)
            if future is not None:
                future.set_result(message[2])

    def _answer_all(self, error: EngineClosed, abort: bool = False) -> int:
        """Answers every request in flight, pending submit and stats call with `error` (and, with `abort`, asks the
        replica to drop them when it reads its pipe again); returns how many requests it answered."""
        with self._lock:
            handles, self._handles = self._handles, {}
            pending, self._pending = self._pending, {}
            stats, self._stats = self._stats, {}
            self._requests.clear()
        for handle in handles.values():
            handle.finish(None, error)
        for future in (*pending.values(), *stats.values()):
            if not future.done():
                future.set_result(error)
        for request_id in (handles if abort else ()):
            self._send(("abort", request_id))
        return len(handles)

    def _on_exit(self, exitcode: int | None) -> None:
        closing = self.state == "closed"
        delay = None
        if not closing:  # the state first: whoever the answers below wake (a retry) sees the replica as down
            now = time.monotonic()
            self._crashes = [t for t in self._crashes if now - t < self._window_s] + [now]
            if len(self._crashes) > self._max_restarts:
                self.state = "down"
                self.error = f"crashed {len(self._crashes)} times within {self._window_s:g} s; left down"
            else:
                self.state = "restarting"
                self._ready_event.clear()
                delay = self._backoff_s * 2 ** (len(self._crashes) - 1)
                self.restarts += 1
        answered = self._answer_all(EngineClosed(f"replica {self.name} stopped (exit code {exitcode}) before this "
                                                 "request finished; retry it (other replicas keep serving)"))
        if closing:
            self._ready_event.set()
            return
        logger.error("replica %s died (exit code %s); %d request(s) in flight answered 503", self.name, exitcode,
                     answered)
        if delay is None:
            logger.error("replica %s %s", self.name, self.error)
            self._ready_event.set()
            return
        timer = threading.Timer(delay, self._restart)
        timer.daemon = True
        timer.start()

    def _restart(self) -> None:
        if self.state == "restarting":
            logger.warning("restarting replica %s", self.name)
            self._start()

    # -- EngineClient ----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def ready_s(self) -> float:
        return self.info.ready_s if self.info else 0.0

    def _send(self, message: tuple) -> bool:
        try:
            with self._lock:
                self._conn.send(message)
            return True
        except (OSError, ValueError, EOFError):
            return False

    async def submit(self, request: GenerationRequest, progress: bool = False) -> RequestHandleImpl:
        if self.state != "ready":
            raise EngineClosed(f"replica {self.name} is {self.state}; retry shortly")
        handle = RequestHandleImpl(lambda h: self.abort(h.request_id), request, progress)
        answer: Future = Future()
        with self._lock:
            self._handles[request.request_id] = handle
            self._requests[request.request_id] = request
            self._pending[request.request_id] = answer
        if not self._send(("submit", request, progress)):
            with self._lock:
                self._handles.pop(request.request_id, None)
                self._requests.pop(request.request_id, None)
                self._pending.pop(request.request_id, None)
            raise EngineClosed(f"replica {self.name} is not reachable; retry shortly")
        rejected = await asyncio.wrap_future(answer)
        if rejected is not None:
            with self._lock:
                self._handles.pop(request.request_id, None)
                self._requests.pop(request.request_id, None)
            raise rejected
        return handle

    def abort(self, request_id: str) -> bool:
        return request_id in self._handles and self._send(("abort", request_id))

    def stats(self) -> EngineStats | None:
        """The replica's stats, or None when it is not ready or does not answer within 10 s."""
        if self.state != "ready":
            return None
        token = next(self._tokens)
        future: Future = Future()
        with self._lock:
            self._stats[token] = future
        if not self._send(("stats", token)):
            return None
        try:
            answer = future.result(timeout=10)
        except Exception:
            with self._lock:
                self._stats.pop(token, None)
            return None
        return answer if isinstance(answer, EngineStats) else None

    def graph_table(self) -> list[dict[str, Any]]:
        stats = self.stats()
        return [] if stats is None else stats.graphs

    def add_step_listener(self, listener: Callable[[StepEvent], None]) -> None:
        self._listeners.append(listener)

    def in_flight(self) -> int:
        return len(self._handles)

    def kill(self) -> None:
        """Ends the replica's process at once (tests and operators: as a crash would)."""
        self._process.kill()

    def close(self) -> None:
        self.state = "closed"
        self._send(("close",))
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
