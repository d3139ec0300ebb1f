"""`ReplicaClient`: one engine in its own process (one per device), behind the `EngineClient` protocol. This is the
parent's side; what runs in the replica process is replica_process.py.

The parent talks to the replica over one duplex pipe; everything on it is one of the typed messages of
replica_messages.py (frozen dataclasses, pickled): `Submit`, `Abort`, `Ask`, `Release` and `Close` to the replica;
`Ready` or `Failed`, `Beat`, `Accepted` or `Rejected`, `Progress`, `Done`, `Step`, `Answer` and `Batch` back.

Results carry the images encoded by the replica (its image threads), and no float pixels when the request asked
for an encoded format: the bytes move once; nor their request (the parent keeps it: an edit's input image never
comes back). The replica's engine threads only queue their messages; its output thread sends them, the small ones
queued together as one `Batch` message, each result on its own, so the GPU loop never waits for the pipe.
The parent's sends go through a writer thread too (`_Sender`): a replica that stops reading its pipe (SIGSTOP, a busy
intake) fills it, and that must block neither the event loop nor the reader thread that finds it unresponsive. The
parent's reader thread answers each request's handle; when the pipe breaks (the process died), every request in
flight on it is answered at once with EngineClosed (HTTP 503, retryable), and the replica is started again after a
backoff, unless it crashed `max_restarts` times within `restart_window_s`: then it is left down and reported so
(`state`), not restarted in a loop.

Heartbeat: a replica sends a beat every quarter of `replica_timeout` from a thread of its own, from the moment it
starts building its engine (a build that stops beating for 4 x `replica_timeout`, stopped or stuck with the
interpreter's lock held, is killed and restarted like a crashed one; a slow build that beats is waited for). A ready
replica that sends nothing for `replica_timeout` (stopped by SIGSTOP, starved) or whose engine loop has been inside
one pass for longer (wedged in a driver call) is "unresponsive": not ready (routed around), its requests in flight
answered at once with EngineClosed (503, retryable; the router moves those that had not started) and aborted on its
side. When it answers again within `replica_timeout` it is ready again; one that stays unresponsive for 4 x
`replica_timeout` is killed and restarted like a crashed one.
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
from .handles import RequestHandleImpl
from . import replica_messages as M
from .remote_models import ModelSetSpec
from .replica_process import replica_main
from .client import EngineStats, StepEvent

logger = logging.getLogger(__name__)

STATES = ("starting", "ready", "unresponsive", "restarting", "down", "closed")


def _parent_log_level() -> int | None:
    root = logging.getLogger()
    return root.level if root.handlers else None


class ReplicaClient:
    """An engine replica process on `device`; thread-safe; restarts after a crash (with backoff)."""

    def __init__(self, device: str | None, engine_kwargs: dict[str, Any] | None = None, name: str | None = None,
                 max_restarts: int = 3, restart_window_s: float = 300.0, backoff_s: float = 1.0,
                 torch_threads: int | None = None, replica_timeout: float = 30.0, measure_step: bool = False,
                 models: ModelSetSpec | None = None):
        if not replica_timeout > 0:
            raise ValueError(f"replica_timeout {replica_timeout} must be > 0 seconds (--replica-timeout)")
        self.replica_timeout = replica_timeout
        self.device = device  # None: the replica's default (cuda when it has one, else cpu)
        self._threads = torch_threads  # applied when the replica's device is the CPU
        self._measure = measure_step   # a CPU replica times warm steps at start-up (step_samples)
        self._models = models          # a --model-dir set held in the replica (remote_models.py)
        self.name = name or device or "engine"
        self._kwargs = {k: v for k, v in (engine_kwargs or {}).items() if k != "device"}
        self._max_restarts = max_restarts
        self._window_s = restart_window_s
        self._backoff_s = backoff_s
        self._lock = threading.Lock()
        self._handles: dict[str, RequestHandleImpl] = {}
        self._requests: dict[str, GenerationRequest] = {}  # what its results are answers to (not sent back)
        self._pending: dict[str, Future] = {}     # submits waiting for accepted / rejected
        self._asked: dict[int, Future] = {}      # stats and listing calls waiting for their answer
        self._tokens = itertools.count()
        self._listeners: list[Callable[[StepEvent], None]] = []
        self._crashes: list[float] = []
        self.state = "starting"
        self.error: str | None = None
        self.restarts = 0
        self.info: ModelInfo | None = None
        # (pixels, seconds) of warm steps at two sizes, measured at start-up by a CPU replica (time_step_sizes)
        self.step_samples: tuple[tuple[int, float], ...] | None = None
        self._ready_event = threading.Event()
        self._start()

    # -- process lifetime ------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA state or threads inherited
        parent, child = ctx.Pipe(duplex=True)
        self._conn = _Sender(parent, f"diffgraph-replica-{self.name}-writer", self._unsent)
        self._process = ctx.Process(target=replica_main, args=(child, self.device, self._kwargs, self._threads,
                                                                self.replica_timeout / 4, _parent_log_level(),
                                                                self._measure, self._models, os.getpid()),
                                    name=f"diffgraph-replica-{self.name}", daemon=True)
        self._process.start()
        child.close()
        threading.Thread(target=self._read, args=(parent, self._process, self._conn),
                         name=f"diffgraph-replica-{self.name}", daemon=True).start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Waits until the replica is ready or has given up (a bound for callers, not a timing assumption)."""
        self._ready_event.wait(timeout)
        return self.state == "ready"

    def _read(self, conn: Any, process: Any, sender: "_Sender | None" = None) -> None:
        heard, spoke = time.monotonic(), False  # spoke: the process began (its interpreter's start is not judged)
        while True:
            try:
                if not conn.poll(self.replica_timeout / 4):
                    self._check(time.monotonic() - heard, 0.0, process, spoke)
                    continue
                message = conn.recv()
            except (EOFError, OSError):
                break
            heard, spoke = time.monotonic(), True
            if isinstance(message, M.Beat):
                self._check(0.0, message.busy_s, process)
            else:
                self._dispatch(message)
        if sender is not None:  # before the answers below: a later send fails at once (EngineClosed to its caller)
            sender.end()
        process.join(5)
        self._on_exit(process.exitcode)

    def _check(self, silent_s: float, busy_s: float, process: Any, spoke: bool = True) -> None:
        """The heartbeat's verdict (module docstring): unresponsive, back, or killed after 4 timeouts; a process
        that began beating while it builds its engine and then went silent for 4 timeouts is killed too."""
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
        elif self.state in ("starting", "restarting") and spoke and silent_s >= 4 * self.replica_timeout:
            self.error = f"no heartbeat for {silent_s:.0f} s while building its engine (--replica-timeout " \
                         f"{self.replica_timeout:g})"
            logger.error("replica %s is stuck building its engine (%s): killing it to restart it", self.name,
                         self.error)
            process.kill()

    def _dispatch(self, message: object) -> None:
        if isinstance(message, M.Ready):
            self.info, self.step_samples, self.error = message.info, message.step_s, None
            if self.state != "closed":
                self.state = "ready"
            self._ready_event.set()
        elif isinstance(message, M.Failed):
            self.error = message.reason
            logger.error("replica %s %s: %s", self.name, "failed" if self.state == "ready" else
                         "could not build its engine", self.error)
            if self.state == "ready":  # its engine failed: routed around until it restarts
                self.state = "restarting"
        elif isinstance(message, (M.Accepted, M.Rejected)):
            with self._lock:
                future = self._pending.pop(message.request_id, None)
            if future is not None:
                future.set_result(message.error if isinstance(message, M.Rejected) else None)
        elif isinstance(message, M.Progress):
            handle = self._handles.get(message.request_id)
            if handle is not None:
                handle.progress(message.event())
        elif isinstance(message, M.Done):
            with self._lock:
                handle = self._handles.pop(message.request_id, None)
                request = self._requests.pop(message.request_id, None)
            if handle is not None:
                if message.result is not None:
                    message.result.request = request
                handle.finish(message.result, message.error)
        elif isinstance(message, M.Batch):
            for part in message.messages:
                self._dispatch(part)
        elif isinstance(message, M.Step):
            for listener in list(self._listeners):
                try:
                    listener(message.event)
                except Exception:
                    logger.exception("step listener %r failed", listener)
        elif isinstance(message, M.Answer):
            with self._lock:
                future = self._asked.pop(message.token, None)
            if future is not None:
                future.set_result(message.value)
        else:
            logger.error("replica %s sent a message of unknown kind %s", self.name, type(message).__name__)

    def _answer_all(self, error: EngineClosed, abort: bool = False) -> int:
        """Answers every request in flight, pending submit and stats call with `error` (and, with `abort`, asks the
        replica to drop them when it reads its pipe again); returns how many requests it answered."""
        with self._lock:
            handles, self._handles = self._handles, {}
            pending, self._pending = self._pending, {}
            asked, self._asked = self._asked, {}
            self._requests.clear()
        for handle in handles.values():
            handle.finish(None, error)
        for future in (*pending.values(), *asked.values()):
            if not future.done():
                future.set_result(error)
        for request_id in (handles if abort else ()):
            self._send(M.Abort(request_id))
        return len(handles)

    def _on_exit(self, exitcode: int | None) -> None:
        closing = self.state == "closed"
        delay = None
        if not closing:  # the state first: whoever the answers below wake (a retry) sees the replica as down
            now = time.monotonic()
            self._crashes = [t for t in self._crashes if now - t < self._window_s] + [now]
            if len(self._crashes) > self._max_restarts:
                self.state = "down"
                last = f" (its last error: {self.error})" if self.error else ""  # e.g. why its engine did not build
                n = len(self._crashes)
                self.error = f"crashed {n} time{'s' * (n != 1)} within {self._window_s:g} s; left down{last}"
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

    def _unsent(self, message: object, error: BaseException) -> None:
        """A submit or question the writer could not send: answered here (EngineClosed), not left waiting."""
        future = None
        with self._lock:
            if isinstance(message, M.Submit):
                self._handles.pop(message.request.request_id, None)
                self._requests.pop(message.request.request_id, None)
                future = self._pending.pop(message.request.request_id, None)
            elif isinstance(message, M.Ask):
                future = self._asked.pop(message.token, None)
        if future is not None and not future.done():
            logger.warning("replica %s: a %s message was not sent: %s", self.name, type(message).__name__, error)
            future.set_result(EngineClosed(f"replica {self.name} is not reachable; retry shortly"))

    def _restart(self) -> None:
        if self.state == "restarting":
            logger.warning("restarting replica %s", self.name)
            self._start()

    # -- EngineClient ----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def pid(self) -> int | None:
        """The replica process's id (operators, and tests that kill it)."""
        return self._process.pid

    @property
    def ready_s(self) -> float:
        return self.info.ready_s if self.info else 0.0

    def _send(self, message: object) -> bool:
        try:
            with self._lock:
                self._conn.send(message)
            return True
        except (OSError, ValueError, EOFError):
            return False

    async def submit(self, request: GenerationRequest, progress: bool = False,
                     hold: int | None = None) -> RequestHandleImpl:
        """Queues a request on the replica's engine, or with `hold` (a model set's, remote_models.py) on that held
        model's engine."""
        if self.state != "ready":
            raise EngineClosed(f"replica {self.name} is {self.state}; retry shortly")
        handle = RequestHandleImpl(lambda h: self.abort(h.request_id), request, progress)
        answer: Future = Future()
        with self._lock:
            self._handles[request.request_id] = handle
            self._requests[request.request_id] = request
            self._pending[request.request_id] = answer
        if not self._send(M.Submit(request, progress, hold)):
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
        return request_id in self._handles and self._send(M.Abort(request_id))

    def ask(self, kind: str, timeout: float | None, *args: Any) -> Any:
        """Asks the replica `kind` (replica_messages.ASKS) with `args` and waits up to `timeout` s (None: until
        answered or the replica goes) for its answer; None when not ready, unreachable or not answered in time;
        EngineClosed when it went meanwhile."""
        if kind not in M.ASKS:
            raise ValueError(f"a replica answers {', '.join(M.ASKS)}; not {kind!r}")
        if self.state != "ready":
            return None
        token = next(self._tokens)
        future: Future = Future()
        with self._lock:
            self._asked[token] = future
        if not self._send(M.Ask(kind, token, args)):
            with self._lock:
                self._asked.pop(token, None)
            return None
        try:
            return future.result(timeout=timeout)
        except Exception:
            with self._lock:
                self._asked.pop(token, None)
            return None

    def tell(self, message: M.Release) -> bool:
        """Sends a message that has no answer (a model set's release)."""
        return self._send(message)

    def stats(self) -> EngineStats | None:
        """The replica's stats, or None when it is not ready or does not answer within 10 s."""
        answer = self.ask("stats", 10.0)
        return answer if isinstance(answer, EngineStats) else None

    def loras(self) -> dict[str, Any]:
        """The replica engine's adapter listing (`Engine.loras()`, with which are loaded in its slots); blocks: call
        it off the event loop. EngineClosed when the replica is not ready; its error when the listing failed."""
        answer = self.ask("loras", 60.0)
        if isinstance(answer, BaseException):
            raise answer
        if answer is None:
            raise EngineClosed(f"replica {self.name} did not list its adapters (it is {self.state}); retry shortly")
        return answer

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
        self._send(M.Close())
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()


class _Sender:
    """The parent's side of a replica's pipe for sending: `send` queues (never blocks its caller on a full pipe), a
    writer thread sends in order; after `end` (the replica is gone) `send` raises OSError as a closed pipe does."""

    def __init__(self, conn: Any, name: str, unsent: Callable[[object, BaseException], None]):
        self._conn, self._unsent = conn, unsent
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ended = False
        threading.Thread(target=self._write, name=name, daemon=True).start()

    def send(self, message: object) -> None:
        with self._lock:
            if self._ended:
                raise OSError("the replica's pipe is closed")
            self._queue.put(message)

    def end(self) -> None:
        """The writer sends what is queued (to a dead process: those fail, answered by the reader), then ends."""
        with self._lock:
            self._ended = True
            self._queue.put(None)

    def _write(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._conn.send(message)
            except Exception as e:  # a dead process, or a message that does not pickle: answered, never lost
                self._unsent(message, e)
