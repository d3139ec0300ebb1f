"""`DeviceLoop`: the one thread that runs the steps of every engine core on one device.

An `Engine` serving one model makes its own loop with its one core. Several models behind one server (a
`ModelSet`) share one loop per device, so their steps never contend for the GPU from two threads: each pass
takes the next core with work in turn (one step each, round robin: no model's groups starve another's), runs it
outside the lock, and waits on the shared condition when no core has work (until the nearest scheduling deadline).
The loop owns the thread and the condition; each core keeps its scheduler, runner and requests. A core that is
closed is finished on the loop thread (its last between-step work, its requests answered) and detached; an
exception in one core's pass stops that core only. The thread ends when no core is attached and a later attach
starts a new one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

logger = logging.getLogger(__name__)

Work = tuple[Any, list, list]  # (a StepPlan or None, aborted requests, between-step work)
STOPPED = "stopped"  # what a closed core's poll answers: the loop finishes and detaches it
LOOP_NAME = "diffgraph-engine"  # the loop threads' names (a prefix)


class LoopCore(Protocol):
    """What the loop needs of an engine core (engine/core.py's EngineCore)."""

    def poll(self) -> Work | str | None:
        """Under the loop's lock: this core's next work, None (idle), or STOPPED (closed). Raises when its scheduler
        is broken."""

    def next_deadline(self) -> float | None:
        """Under the loop's lock: seconds until this core's scheduler wants another look, or None."""

    def run(self, work: Work, waited: bool) -> None:
        """On the loop thread, outside the lock: one pass (between-step work, the step, its results)."""

    def finish(self, error: BaseException | None) -> None:
        """On the loop thread, outside the lock, once: answer everything left (`error`: the loop's own failure)."""


def loops_running() -> list[str]:
    """The names of this process's engine loop threads still alive (a step still running when the process is asked
    to exit: `diffgraph serve` then ends without the interpreter's teardown, which aborts under a busy native op)."""
    return [t.name for t in threading.enumerate() if t.name.startswith(LOOP_NAME) and t.is_alive()]


class DeviceLoop:
    def __init__(self, name: str = LOOP_NAME):
        self.cv = threading.Condition()
        self.name = name
        self._cores: list[LoopCore] = []
        self._turn = 0
        self._running = False
        self.thread: threading.Thread | None = None  # the current thread (a plain attribute: cores read it)
        self.busy_since: float | None = None  # when the pass running now began (None: waiting): a wedged step shows

    def attach(self, core: LoopCore) -> None:
        thread = None
        with self.cv:
            if core not in self._cores:
                self._cores.append(core)
            if not self._running:
                self._running = True
                self.thread = thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.cv.notify_all()
        if thread is not None:  # outside the lock: its first pass runs at once, as the caller goes on
            thread.start()

    def wake(self) -> None:
        """Makes the loop look at its cores again (something a scheduler waits for, other than a request, changed)."""
        with self.cv:
            self.cv.notify_all()

    def _next(self) -> tuple[LoopCore, Work | None, BaseException | None, bool] | None:
        """Under the lock: the next core to serve, in turn: (core, its work, a poll failure, whether the loop waited
        for it), or None when no core is attached (the thread then ends)."""
        waited = False
        while True:
            if not self._cores:
                self._running = False
                return None
            n = len(self._cores)
            deadlines = []
            for i in range(n):
                core = self._cores[(self._turn + i) % n]
                try:
                    work = core.poll()
                except BaseException as e:  # a broken scheduler: that core stops
                    return core, None, e, waited
                if work == STOPPED:
                    self._turn = (self._turn + i + 1) % n
                    return core, None, None, waited
                if work is not None:
                    self._turn = (self._turn + i + 1) % n
                    return core, work, None, waited
                deadlines.append(core.next_deadline())
            timeouts = [d for d in deadlines if d is not None]
            waited = True
            self.cv.wait(timeout=min(timeouts) if timeouts else None)

    def _run(self) -> None:
        while True:
            with self.cv:
                picked = self._next()
            if picked is None:
                return
            core, work, failure, waited = picked
            if work is None:  # closed, or its scheduler failed: finish it and let it go
                if failure is not None:
                    logger.error("the engine loop stopped after an internal error", exc_info=failure)
                self._retire(core, failure)
                del picked, core
                continue
            self.busy_since = time.monotonic()
            try:
                core.run(work, waited)
            except BaseException as e:  # a bug in the core's pass: answer its requests, refuse its new work
                logger.exception("the engine loop stopped after an internal error")
                self._retire(core, e)
            self.busy_since = None
            del picked, core, work  # while it waits, the loop holds no core (an evicted model's memory goes)

    def _retire(self, core: LoopCore, error: BaseException | None) -> None:
        with self.cv:
            if core in self._cores:
                self._cores.remove(core)
            self.cv.notify_all()
        try:
            core.finish(error)
        except Exception:
            logger.exception("finishing an engine core failed")
