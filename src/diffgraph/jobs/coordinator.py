"""The job coordinator: the asyncio task that makes the images of unfinished jobs.

On start it resumes every unfinished job where it stopped (the store holds which candidates are done; an image
stored but not yet committed before a crash is adopted, not made again; temporary files are swept). It keeps a
bounded number of candidates in the engine (`--batch-inflight`, default two of the largest bucket's rows per
replica: enough to fill every bucket, far below the waiting queue's bound, so interactive requests are never
refused because of a job), choosing the next one fairly by API key, then by that key's jobs (the key with the
fewest candidates in flight, then its job with the fewest: one key's ten jobs get what another key's one job gets,
and a second job does not wait for the first), each a one-image request of the batch class marked with its job and
its key's share (backend.py), which the scheduler runs in the slots interactive rows leave free, shared the same
way (engine/priority.py). A candidate whose request was answered "retry" (queue full, engine closed or
restarting, aborted under it) is retried with exponential backoff, at most `max_attempts` times; one the engine
refuses (ParamError) or fails (EngineStepError) fails with the engine's message; one whose image cannot be written
(an unwritable folder) fails with that error, and nothing else is affected. A full disk (ENOSPC or a quota on an
image, SQLITE_FULL on a commit) pauses every job instead: their status is "paused" with the error as its reason,
nothing is submitted, the images already made are kept here (not made again), and every `space_probe_s` a probe file
is written; once it can be, the kept images are stored and the jobs resume. An API key whose jobs keep
`--max-key-bytes` or more (`KeyLimits.bytes`: all its jobs' images and rows, counted here as its images are stored
and read again from the store at each poll, so deletes and expiry made elsewhere are seen) gets nothing more
submitted: its unfinished jobs are "paused" with a reason that says so and how to go on (`store.quota_reason`), other
keys' jobs go on, and once it keeps less (a job deleted or expired) its jobs resume by themselves. The check is made
before each candidate is submitted, so the limit can be passed by at most the candidates of that key in flight when
it was reached: their images are stored, never thrown away. The two pauses are distinct: a job held by its key's
limit shows that reason (only the key can end it) and stays paused when the disk has space again; one whose key is
back under its limit while the disk is full shows the disk's reason and waits for the probe. A job stored paused
(either way) is judged again when it is read after a restart. Cancelling a job aborts its
requests in flight, which frees their rows at the next step boundary. When a job ends, its webhook is due
(webhook.py). Finished jobs are deleted after `--job-retention`.

Several processes on one state folder (server replicas, or Ray Serve ingress replicas on one host sharing a disk):
exactly one coordinates, the one holding an exclusive `fcntl.flock` on STATE_DIR/coordinator.lock; the others
take, list, read and cancel jobs through SQLite and try the lock every `lock_retry_s`, so when the coordinator's
process ends (even by SIGKILL: the kernel drops the lock) another takes over and resumes its jobs. The coordinator
finds jobs made elsewhere by polling the store every `poll_s` (jobs made in its own process wake it at once), and
notices a job cancelled or deleted elsewhere at the same poll. With Ray Serve the job coordinator is thus whichever
ingress replica holds the lock: give every ingress replica the same `state_dir` on one node's local disk (pin the
ingress to that node, or run one ingress replica); its submissions go through its `RayEngineClient`, so Ray spreads
the job over every engine replica (set `batch_inflight` to about 2 x the largest bucket x the engine replicas, since
one ingress cannot count them).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import heapq
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Iterable

from ..engine.client import RequestHandle
from ..request import GenerationRequest
from .backend import CandidateError, EngineBackend
from .files import ImageWriteError, sweep_temporary, write_image
from .store import Candidate, JobRow, JobStore, KeyLimits, StoreError, job_summary, quota_paused, quota_reason
from .webhook import WebhookSender

logger = logging.getLogger("diffgraph.jobs")

PAGE = 256  # pending candidates read from the store at a time, per job
PROBE_BYTES = 4 << 20  # written to see whether a full disk has space again (an image of 1024x1024 is ~1.5 MiB)


@dataclass(frozen=True)
class CoordinatorSettings:
    inflight: int | None = None   # candidates in the engine at once; None: the backend's default
    retention_s: float = 7 * 86400.0
    poll_s: float = 0.5           # how often the store is read for jobs made, cancelled or deleted elsewhere
    lock_retry_s: float = 2.0     # how often a process that does not coordinate tries the lock
    max_attempts: int = 12        # submissions of a candidate answered "retry", then it fails
    retry_base_s: float = 0.25    # backoff: base x 2^(attempt - 1), at most retry_cap_s
    retry_cap_s: float = 30.0
    sweep_s: float = 600.0        # how often finished jobs past the retention are deleted
    space_probe_s: float = 5.0    # while the disk is full: how often a probe file is written to see if space returned


@dataclass
class _Run:
    """An unfinished job in the coordinator: its pending candidates read so far, those in flight, those waiting
    for a retry."""

    row: JobRow
    buffer: deque[Candidate] = field(default_factory=deque)
    cursor: tuple[int, int] = (-1, -1)  # the last (item, k) read from the store
    exhausted: bool = False
    inflight: set[tuple[str, int, int]] = field(default_factory=set)
    retries: list[tuple[float, int, int, Candidate]] = field(default_factory=list)  # (when, item, k, c): a heap
    attempts: dict[tuple[str, int, int], int] = field(default_factory=dict)
    started: bool = False
    served: int = -1  # the coordinator's turn when a candidate of it was last picked
    unwritten: dict[tuple[str, int, int], tuple[Candidate, bytes]] = field(default_factory=dict)  # disk full
    shown: str | None = None  # the reason its stored status is paused with (None: not paused)

    @property
    def idle(self) -> bool:
        return self.exhausted and not self.buffer and not self.inflight and not self.retries and not self.unwritten


class Coordinator:
    def __init__(self, store: JobStore, backend: EngineBackend, webhooks: WebhookSender | None,
                 settings: CoordinatorSettings = CoordinatorSettings(), limits: KeyLimits | None = None):
        self.store, self.backend, self.webhooks, self.settings = store, backend, webhooks, settings
        self.limits = limits  # its bytes: what a key's jobs may keep while they run (None: no limit)
        self.coordinating = False
        self._runs: dict[str, _Run] = {}
        self._turn = 0                             # a clock of picks: who was served longest ago goes first
        self._owner_served: dict[str, int] = {}    # owner -> the turn it was last served
        self._tasks: dict[tuple[str, int, int], asyncio.Task] = {}
        self._handles: dict[tuple[str, int, int], RequestHandle] = {}  # the requests of those tasks in the engine
        self._deliveries: dict[str, asyncio.Task] = {}
        self._wake = asyncio.Event()
        self._building = asyncio.Lock()  # one candidate's request built at a time, in the order chosen (FIFO)
        self._dirty = True
        self._lock_fd: int | None = None
        self._skipped: set[str] = set()  # jobs made for another model (logged once)
        self._full: str | None = None    # why the jobs are paused (the disk is full): nothing is submitted meanwhile
        self._next_probe = 0.0
        self._kept: dict[str, int] = {}  # owner -> bytes its jobs keep: read at each poll, grown as images are stored
        self._counting: dict[str, int] | None = None  # while `_kept` is read: the bytes stored meanwhile
        self._settling = asyncio.Lock()  # the stored statuses are written by one step at a time

    # -- what the routes call (the event loop) --------------------------------------------------------------------
    def wake(self) -> None:
        """A job was made, cancelled or deleted in this process: read the store now."""
        self._dirty = True
        self._wake.set()

    def drop(self, job: str) -> None:
        """Stops running `job` (cancelled or deleted): its requests in flight are aborted now (their rows are freed
        at the next step boundary), their tasks cancelled."""
        run = self._runs.pop(job, None)
        if run is not None:
            for key in run.inflight:
                handle, task = self._handles.pop(key, None), self._tasks.get(key)
                if handle is not None:
                    handle.abort()
                if task is not None:
                    task.cancel()
        self.wake()

    def running(self) -> int:
        """Candidates in the engine now."""
        return len(self._tasks)

    # -- the task -------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Coordinates while this process holds the lock (until then, tries it every lock_retry_s); until cancelled."""
        try:
            while not self._take_lock():
                await asyncio.sleep(self.settings.lock_retry_s)
            self.coordinating = True
            logger.info("coordinating the jobs of %s", self.store.root)
            await self._loop()
        finally:
            tasks = list(self._tasks.values()) + list(self._deliveries.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.coordinating = False
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the lock
                self._lock_fd = None

    def _take_lock(self) -> bool:
        try:
            fd = os.open(os.path.join(self.store.root, "coordinator.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            logger.error("cannot open the coordinator lock in %s: %s", self.store.root, e)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process coordinates
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # for a person looking: which process coordinates
        self._lock_fd = fd
        return True

    async def _loop(self) -> None:
        next_poll = next_sweep = 0.0
        while True:
            self._wake.clear()
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + self.settings.sweep_s
                await self._guarded(self._sweep())
            if self._dirty or now >= next_poll:
                self._dirty, next_poll = False, now + self.settings.poll_s
                await self._guarded(self._refresh())
            if self._full is not None and now >= self._next_probe:
                await self._guarded(self._probe())
            await self._guarded(self._fill())
            await self._guarded(self._finish())
            # asyncio.wait, not wait_for: Python 3.11's wait_for can swallow a cancellation that arrives as the wait
            # ends, and this loop must stop when the app stops
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                due = min(next_poll, self._next_retry(), self._next_probe if self._full is not None else next_poll)
                await asyncio.wait({waiter}, timeout=max(0.0, due - time.monotonic()))
            finally:
                waiter.cancel()

    async def _guarded(self, step: Awaitable[None]) -> None:
        """A step of the loop whose failure is logged, never the end of coordination (a store that cannot be read
        now may be readable at the next poll)."""
        try:
            await step
        except StoreError as e:
            logger.error("%s", e)
        except Exception:  # a bug: logged, and the loop goes on after a poll's pause rather than spinning
            logger.exception("the job coordinator's step failed")
            await asyncio.sleep(self.settings.poll_s)

    async def _refresh(self) -> None:
        rows = {row.id: row for row in await asyncio.to_thread(self.store.unfinished)}
        await self._read_kept()
        for job in list(self._runs):
            if job not in rows:  # cancelled or deleted by another process
                self.drop(job)
        info = self.backend.info()
        for job, row in rows.items():
            if job in self._runs or info is None:
                continue
            if row.model != info.name:
                if job not in self._skipped:
                    self._skipped.add(job)
                    logger.warning("job %s was made for model %s; this server serves %s: it waits for a server of "
                                   "its model", job, row.model, info.name)
                continue
            await asyncio.to_thread(sweep_temporary, os.path.join(self.store.images, job))
            self._runs[job] = _Run(row, shown=(row.reason or "") if row.status == "paused" else None)
            if self._full is not None or (row.status == "paused" and not quota_paused(row.reason)):
                await self._pause(row.reason or "the disk was full", [job])  # paused before a restart: probe at once
        await self._settle(list(self._runs))  # a key's jobs paused or resumed by what it keeps now
        for row in await asyncio.to_thread(self.store.due_webhooks):
            if row.id not in self._deliveries:
                self._deliveries[row.id] = asyncio.create_task(self._deliver(row))

    async def _sweep(self) -> None:
        for job in await asyncio.to_thread(self.store.expired, time.time() - self.settings.retention_s):
            self.drop(job)
            await asyncio.to_thread(self.store.delete, job)
            logger.info("deleted job %s (past --job-retention)", job)

    async def _fill(self) -> None:
        if self._full is not None:
            return
        limit = self.backend.capacity(self.settings.inflight)
        while limit is not None and len(self._tasks) < limit:
            picked = await self._next()
            if picked is None:
                return
            run, c = picked
            if run.row.id not in self._runs:  # dropped while its candidates were read
                continue
            run.inflight.add(c.key)
            self._tasks[c.key] = asyncio.create_task(self._candidate(run, c))

    async def _next(self) -> tuple[_Run, Candidate] | None:
        """The next candidate, shared fairly by the keys, then by each key's jobs: the key with the fewest candidates
        in flight (ties: the one served longest ago), its job with the fewest in flight (likewise); from it a retry
        that is due, else its next pending one. One key's ten jobs get what another key's one job gets; a key whose
        jobs keep its --max-key-bytes gets none."""
        now = time.monotonic()
        by_owner: dict[str, list[_Run]] = {}
        for run in self._runs.values():
            by_owner.setdefault(run.row.owner, []).append(run)
        for owner in sorted(by_owner, key=lambda o: (sum(len(r.inflight) for r in by_owner[o]),
                                                     self._owner_served.get(o, -1))):
            if self._over(owner):  # paused by its key's byte limit (_store and _refresh wrote why)
                continue
            for run in sorted(by_owner[owner], key=lambda r: (len(r.inflight), r.served)):
                c = heapq.heappop(run.retries)[3] if run.retries and run.retries[0][0] <= now else \
                    await self._take(run)
                if c is None:
                    continue
                self._turn += 1
                run.served = self._owner_served[owner] = self._turn
                if not run.started:
                    run.started = True
                    await asyncio.to_thread(self.store.mark_running, run.row.id)
                return run, c
        return None

    async def _take(self, run: _Run) -> Candidate | None:
        while not run.buffer and not run.exhausted:
            page = await asyncio.to_thread(self.store.pending, run.row.id, run.cursor, PAGE)
            run.exhausted = len(page) < PAGE
            if page:
                run.cursor = (page[-1].item, page[-1].k)
                run.buffer.extend(c for c in page if c.key not in run.inflight)
        return run.buffer.popleft() if run.buffer else None

    def _next_retry(self) -> float:
        """When the next retry is due; never while its job is paused (nothing is submitted: the loop would spin)."""
        if self._full is not None:
            return float("inf")
        due = [run.retries[0][0] for run in self._runs.values() if run.retries and not self._over(run.row.owner)]
        return min(due, default=float("inf"))

    async def _candidate(self, run: _Run, c: Candidate) -> None:
        try:
            await self._make(run, c)
        finally:
            self._tasks.pop(c.key, None)
            run.inflight.discard(c.key)
            self._wake.set()

    async def _make(self, run: _Run, c: Candidate) -> None:
        try:
            request = await self._build(c, run.row.owner or None)
            # a stat here, the image's check on a thread only when there is a file: the candidates reach the engine
            # in the order they were chosen (fair shares), not in the order threads happen to finish
            if os.path.exists(self.store.image_path(*c.key)) and \
                    await asyncio.to_thread(self.store.adopt, c, self.backend.expected(request)):
                return  # stored before a crash, not yet committed: adopted
            self._handles[c.key] = await self.backend.submit(request)
            try:
                data = await self.backend.result(self._handles[c.key])
            finally:
                self._handles.pop(c.key, None)
            await self._store(run, c, data)
        except CandidateError as e:
            attempts = run.attempts.get(c.key, 0) + 1
            if e.retryable and attempts < self.settings.max_attempts:
                run.attempts[c.key] = attempts
                delay = min(self.settings.retry_cap_s, self.settings.retry_base_s * 2 ** (attempts - 1))
                heapq.heappush(run.retries, (time.monotonic() + delay, c.item, c.k, c))
                return
            await self._fail(c, f"{e.message} (gave up after {attempts} attempts)" if e.retryable else e.message)
        except ImageWriteError as e:
            await self._fail(c, str(e))
        except StoreError as e:  # the candidate stays pending: made again once the store works
            logger.error("%s", e)
        except Exception as e:  # a bug must fail one candidate, never the coordinator
            logger.exception("candidate %s/%d-%d failed", *c.key)
            await self._fail(c, f"internal error: {type(e).__name__}: {e}")

    async def _store(self, run: _Run, c: Candidate, data: bytes) -> None:
        """Stores a made image; with the disk full it is kept here (not made again) and every job is paused. The
        image counts against its key's bytes: at the limit, the key's jobs are paused."""
        try:
            await asyncio.to_thread(self.store.store_image, c, data)
        except (ImageWriteError, StoreError) as e:
            if not (e.full if isinstance(e, ImageWriteError) else e.status == 507):
                raise
            run.unwritten[c.key] = (c, data)
            await self._pause(str(e), list(self._runs))
            return
        owner = run.row.owner
        self._count(owner, len(data))
        if self._over(owner):
            await self._settle([job for job, r in self._runs.items() if r.row.owner == owner])

    async def _read_kept(self) -> None:
        """Reads what each key keeps (a delete or an expiry made elsewhere is seen here). An image stored while it is
        read may or may not be in the sum: it is counted again, so a key's count is never short of what it keeps."""
        if self.limits is None:
            return
        self._counting = {}
        try:
            kept = await asyncio.to_thread(self.store.kept)
        finally:
            counted, self._counting = self._counting, None
        for owner, size in counted.items():
            kept[owner] = kept.get(owner, 0) + size
        self._kept = kept

    def _count(self, owner: str, size: int) -> None:
        """An image of the owner stored: its bytes count against its limit."""
        self._kept[owner] = self._kept.get(owner, 0) + size
        if self._counting is not None:
            self._counting[owner] = self._counting.get(owner, 0) + size

    def _over(self, owner: str) -> bool:
        """Whether the owner's jobs keep its --max-key-bytes or more: nothing of it is submitted."""
        return self.limits is not None and self._kept.get(owner, 0) >= self.limits.bytes

    def _reason(self, owner: str) -> str | None:
        """Why the owner's jobs are paused now (its byte limit before the full disk), or None: they run."""
        if self.limits is not None and self._over(owner):
            return quota_reason(self._kept.get(owner, 0), self.limits.bytes)
        return self._full

    async def _settle(self, jobs: Iterable[str]) -> None:
        """Writes the status of each of `jobs` where it changed: paused by its key's byte limit (that reason first:
        only the key can end it), paused by the full disk, or resumed. A write that fails is made at the next poll."""
        async with self._settling:
            changed: dict[str | None, list[_Run]] = {}
            for job in jobs:
                run = self._runs.get(job)
                if run is None:
                    continue
                reason = self._reason(run.row.owner)
                if reason != run.shown:
                    changed.setdefault(reason, []).append(run)
            for reason, runs in changed.items():
                ids = [run.row.id for run in runs]
                try:
                    if reason is None:
                        await asyncio.to_thread(self.store.resume, ids)
                    else:
                        await asyncio.to_thread(self.store.pause, ids, reason)
                except StoreError as e:  # the store's disk is full too: the status catches up at a later poll
                    logger.warning("%s", e)
                    continue
                if any(quota_paused(reason) != quota_paused(run.shown) for run in runs):
                    logger.info("jobs %s %s", ", ".join(ids), f"paused: {reason}" if reason else "resumed")
                for run in runs:
                    run.shown = reason

    async def _pause(self, reason: str, jobs: list[str]) -> None:
        """Pauses `jobs` (their status says why) and stops submitting until a probe finds space again."""
        if self._full is None:
            logger.error("jobs paused: %s; they resume once a %d MiB probe file can be written", reason,
                         PROBE_BYTES >> 20)
            self._full, self._next_probe = reason, time.monotonic()
        await self._settle(jobs)

    async def _probe(self) -> None:
        """While paused: a probe file written and removed, then the images kept here written; then the jobs resume."""
        self._next_probe = time.monotonic() + self.settings.space_probe_s
        probe = os.path.join(self.store.root, ".space-probe")
        try:
            await asyncio.to_thread(write_image, probe, bytes(PROBE_BYTES))
        except ImageWriteError:
            return
        finally:
            with contextlib.suppress(OSError):
                os.unlink(probe)
        for run in list(self._runs.values()):
            for key, (c, data) in list(run.unwritten.items()):
                try:
                    await asyncio.to_thread(self.store.store_image, c, data)
                except (ImageWriteError, StoreError):
                    return  # still full (or the store cannot be written): the next probe tries again
                del run.unwritten[key]
                self._count(run.row.owner, len(data))
        self._full = None
        logger.info("jobs resumed: the disk has space again")
        await self._settle(list(self._runs))  # those of a key at its byte limit stay paused, with that reason

    async def _build(self, c: Candidate, share: str | None) -> GenerationRequest:
        """The candidate's request, built on a thread: an item's base64 images (image prompts, controls) are decoded
        there, never on the event loop. One at a time, in the order the candidates were chosen (asyncio's lock wakes
        its waiters first come first served), so they still reach the engine in their fair order."""
        async with self._building:
            return await asyncio.to_thread(self.backend.build, c, share)

    async def _fail(self, c: Candidate, message: str) -> None:
        try:
            await asyncio.to_thread(self.store.fail, c, message)
        except StoreError as e:
            logger.error("%s", e)

    async def _finish(self) -> None:
        for job, run in list(self._runs.items()):
            if not run.idle:
                continue
            del self._runs[job]
            row = await asyncio.to_thread(self.store.finish, job)
            if row is not None:
                logger.info("job %s %s: %d done, %d failed", job, row.status, row.done, row.failed)
                self.wake()  # its webhook is due

    async def _deliver(self, row: JobRow) -> None:
        try:
            if self.webhooks is None or row.webhook is None:
                error: str | None = "webhooks are off on this server (--webhook-allow)"
            else:
                summary = job_summary(row, await asyncio.to_thread(self.store.rate, row))
                error = await self.webhooks.deliver(row.webhook, summary)
            if error:
                logger.warning("the webhook of job %s failed: %s", row.id, error)
            await asyncio.to_thread(self.store.webhook_sent, row.id, error)
        except StoreError as e:
            logger.error("%s", e)
        finally:
            self._deliveries.pop(row.id, None)
