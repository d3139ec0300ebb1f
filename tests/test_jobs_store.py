"""The job store and its coordinator, in process, over a fake engine (no model: its images are PNGs of one grey
level per seed, with the request's settings inside, as the engine encodes them): the write order (temporary name,
fsync, rename, fsync of the folder, THEN the commit), resume after a crash at each point of it (no image made
twice once stored, none lost, none half written), a full disk or an unwritable folder failing the job's candidates
with a clear error and nothing else, retries and refusals, round-robin across jobs within the in-flight bound,
cancel aborting the requests in flight, one coordinator per state folder (the lock), retention; a job cancelled while
one of its candidates is being submitted aborts that request; `diffgraph batch`'s planning decodes an item's images
once for all its candidates."""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
import sys

import numpy as np
import pytest
from PIL import Image

from diffgraph.image_metadata import encode_image
from diffgraph.jobs import files
from diffgraph.jobs.backend import EngineBackend
from diffgraph.jobs.coordinator import Coordinator, CoordinatorSettings
from diffgraph.jobs.spec import JobItem, JobSpec
from diffgraph.jobs.store import JobStore, KeyLimits, QuotaError
from diffgraph.request import EngineStepError, GenerationResult, ModelInfo, ParamError, QueueFullError
from diffgraph.api.config import ServerConfig

INFO = ModelInfo(name="digits", family="sd", native_size=64, default_guidance=7.5, max_rows=32, mode="eager",
                 device="cpu")
CONFIG = ServerConfig(model="digits")
BOUND_S = 60.0  # a failure bound for waits on a state, never a timing assumption
FAST = CoordinatorSettings(inflight=4, poll_s=0.05, lock_retry_s=0.05, retry_base_s=0.01, retry_cap_s=0.05)


class FakeHandle:
    def __init__(self, engine: "FakeEngine", request):
        self.engine, self.request, self.request_id = engine, request, request.request_id

    async def result(self) -> GenerationResult:
        await self.engine.gate.wait()
        r = self.request
        if self.engine.errors.get(r.seed):
            raise self.engine.errors[r.seed].pop(0)
        png = encode_image(np.full((r.height, r.width, 3), (r.seed % 251) / 255.0), "png", r, INFO.name)
        self.engine.made.append((r.job, r.seed))
        return GenerationResult(r.request_id, None, r.seed, {}, r, [png])

    def abort(self) -> bool:
        if self.request not in self.engine.aborted:  # a second abort of a request is a no-op, as the engine's
            self.engine.aborted.append(self.request)
        return True


class FakeEngine:
    """Answers requests with images (when `gate` is open), or with the errors queued for a seed."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.gate.set()
        self.submitted, self.made, self.aborted = [], [], []
        self.errors: dict[int, list[Exception]] = {}

    async def submit(self, request) -> FakeHandle:
        self.submitted.append(request)
        queued = self.errors.get(request.seed)
        if queued and not isinstance(queued[0], EngineStepError):  # a step's failure comes with the result
            raise queued.pop(0)
        return FakeHandle(self, request)

    def backend(self) -> EngineBackend:
        return EngineBackend(CONFIG, info=lambda: INFO, submit=self.submit)


def spec(n_items: int, seeds=(1, 2), steps: int = 2, base: int = 0) -> JobSpec:
    return JobSpec(tuple(JobItem({"prompt": f"a digit {i}", "num_inference_steps": steps},
                                 tuple(s + 1000 * (base + i) for s in seeds)) for i in range(n_items)))


async def until(predicate, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BOUND_S
    while not predicate():
        if loop.time() > deadline:
            for task in asyncio.all_tasks():  # where each task waits: what a failure needs to be understood
                task.print_stack(file=sys.stderr)
            raise AssertionError(f"not within {BOUND_S} s: {what}")
        await asyncio.sleep(0.005)


def run_jobs(store: JobStore, engine: FakeEngine, jobs: list[str], settings=FAST, done=None, limits=None) -> None:
    """Coordinates until every job in `jobs` has finished (and `done()`, when given)."""
    async def main():
        coordinator = Coordinator(store, engine.backend(), None, settings, limits)
        task = asyncio.create_task(coordinator.run())
        await until(lambda: all(not store.job(j).unfinished for j in jobs) and (done is None or done()),
                    "the jobs finish")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())


def stored(store: JobStore, job: str) -> list[str]:
    return sorted(os.listdir(os.path.join(store.images, job)))


# -- creating a job, the keys' limits ------------------------------------------------------------------------------
def test_a_large_job_is_stored_in_short_transactions_that_let_other_keys_in_between(tmp_path, monkeypatch):
    """A 6.4-million-candidate job was inserted in one transaction: 49-97 s holding the store's lock while other
    keys' requests waited. Now every transaction writes at most INSERT_CHUNK rows, the lock is free between them (a
    read of another key is served there), and the job is invisible until it is whole."""
    import threading
    from contextlib import contextmanager

    from diffgraph.jobs import store as store_module
    monkeypatch.setattr(store_module, "INSERT_CHUNK", 100)
    store = JobStore(str(tmp_path))
    other = store.create("b", spec(1), "digits")
    transactions, served = [], []
    real_write = store._write

    @contextmanager
    def write():
        with real_write() as db:
            before = db.total_changes
            yield db
            transactions.append(db.total_changes - before)
        reader = threading.Thread(target=lambda: served.append((
            [j.id for j in store.jobs("b")], [j.id for j in store.unfinished()], [j.id for j in store.jobs("a")])))
        reader.start()  # another thread: it would wait for the store's lock if a transaction still held it
        reader.join(BOUND_S)
        assert not reader.is_alive(), "the store's lock is held between the chunks"

    monkeypatch.setattr(store, "_write", write)
    job = store.create("a", spec(50, seeds=tuple(range(20))), "digits")  # 50 items, 1,000 candidates
    assert (job.status, job.items, job.candidates) == ("queued", 50, 1000)
    assert len(transactions) == 1 + 1 + 10 + 1  # the row, the items, ten chunks of candidates, queued
    assert max(transactions) <= 100
    during = served[:-1]  # reads between the chunks: the other key served, the job not yet runnable or listed
    assert all(r == ([other.id], [other.id], []) for r in during) and len(during) == 12
    assert served[-1] == ([other.id], [other.id, job.id], [job.id])
    assert len(store.pending(job.id, (-1, -1), 2000)) == 1000


def test_a_job_whose_creation_fails_midway_leaves_nothing_and_a_crashs_leftover_is_swept(tmp_path, monkeypatch):
    from contextlib import contextmanager

    from diffgraph.jobs import store as store_module
    from diffgraph.jobs.store import CREATING_STALE_S, StoreError
    monkeypatch.setattr(store_module, "INSERT_CHUNK", 10)
    store = JobStore(str(tmp_path))
    real_write, writes = store._write, []

    @contextmanager
    def failing():
        writes.append(1)
        if len(writes) == 4:  # the row, the items, then a chunk of candidates fails
            raise StoreError("the job store could not be written: disk I/O error", 503)
        with real_write() as db:
            yield db

    monkeypatch.setattr(store, "_write", failing)
    with pytest.raises(StoreError, match="disk I/O error"):
        store.create("a", spec(10, seeds=(1, 2, 3)), "digits")
    assert store._read("SELECT count(*) FROM jobs")[0][0] == 0
    assert store._read("SELECT count(*) FROM candidates")[0][0] == store._read("SELECT count(*) FROM items")[0][0] == 0
    monkeypatch.setattr(store, "_write", real_write)
    job = store.create("a", spec(1), "digits").id
    with store._write() as db:  # as a crash mid-creation leaves it
        db.execute("UPDATE jobs SET status = 'creating' WHERE id = ?", (job,))
    assert store.jobs("a") == [] and store.unfinished() == []  # never listed, never run
    created = store._read("SELECT created FROM jobs WHERE id = ?", (job,))[0][0]
    assert store.expired(0.0, now=created + CREATING_STALE_S / 2) == []  # perhaps still being written elsewhere
    assert store.expired(0.0, now=created + CREATING_STALE_S + 1) == [job]


def test_a_keys_unfinished_jobs_and_stored_bytes_are_bounded_and_other_keys_go_on(tmp_path):
    store = JobStore(str(tmp_path))
    limits = KeyLimits(jobs=2, bytes=10_000)
    first = store.create("a", spec(2), "digits", limits=limits)
    store.create("a", spec(2), "digits", limits=limits)
    with pytest.raises(QuotaError, match=r"this API key has 2 unfinished jobs; at most 2 at once \(--max-key-jobs\)") \
            as info:
        store.create("a", spec(2), "digits", limits=limits)
    assert info.value.status == 429
    with pytest.raises(QuotaError, match="--max-key-jobs"):  # the route's check before it reads a job's body
        store.check_quota("a", limits)
    store.check_quota("b", limits)
    store.create("b", spec(2), "digits", limits=limits)  # another key is not held back
    store.cancel(first.id)
    big = store.create("a", spec(2), "digits", limits=limits)  # one ended: room again
    c = store.pending(big.id, (-1, -1), 1)[0]
    store.store_image(c, b"\x89PNG" + bytes(9000))  # its images count
    assert store.job(big.id).bytes == first.bytes + 9004
    store.cancel(big.id)
    with pytest.raises(QuotaError, match=r"this API key's jobs keep .* \(--max-key-bytes\)") as info:
        store.create("a", spec(2), "digits", limits=limits)
    assert info.value.status == 507
    store.delete(big.id)
    store.create("a", spec(2), "digits", limits=limits)
    assert [j.status for j in store.jobs("a")] == ["queued", "queued", "cancelled"]


# -- a damaged or locked store ------------------------------------------------------------------------------------
def damage(root: str) -> str:
    """Every page of jobs.sqlite3 after its first overwritten (the schema on page 1 still reads: the store opens)."""
    path = os.path.join(root, "jobs.sqlite3")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(4096)
        f.write(b"\xff" * (size - 4096))
    return path


def test_a_damaged_store_says_so_with_what_to_do_on_read_and_write(tmp_path):
    """Reads of a damaged store raised sqlite3.DatabaseError (a 500 with a traceback); its writes said "free disk
    space"."""
    from diffgraph.jobs.store import StoreError
    store = JobStore(str(tmp_path))
    job = store.create("", spec(20), "digits").id
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    path = damage(str(tmp_path))
    store = JobStore(str(tmp_path))
    for action in (lambda: store.job(job), lambda: store.jobs(""), lambda: store.create("", spec(1), "digits")):
        with pytest.raises(StoreError) as info:
            action()
        e = info.value
        assert (e.status, e.code) == (503, "job_store_damaged")
        assert f"the job store {path} could not be" in str(e) and "database disk image is malformed" in str(e)
        assert "the file is damaged: stop the servers sharing --state-dir" in str(e) and "free disk" not in str(e)
    with open(path, "r+b") as f:
        f.write(b"\xff" * 100)  # its header too: not a database at all
    with pytest.raises(StoreError, match="cannot be opened: file is not a database; the file is damaged") as info:
        JobStore(str(tmp_path))
    assert info.value.code == "job_store_damaged"


def test_reads_are_served_while_a_write_waits_for_another_processs_lock_which_is_a_clear_503(tmp_path):
    """A status read waited 44 s behind this process's own write, which waited for another process's lock."""
    import threading

    from diffgraph.jobs.store import StoreError, store_error
    store = JobStore(str(tmp_path), busy_s=BOUND_S)
    job = store.create("", spec(1), "digits").id
    other = sqlite3.connect(store.path, isolation_level=None)  # another process, inside a write
    other.execute("BEGIN IMMEDIATE")
    writer = threading.Thread(target=lambda: store.create("", spec(1, base=5), "digits"))
    writer.start()
    while store._lock.acquire(blocking=False):  # until the writer holds the store and waits for SQLite's lock
        store._lock.release()
        writer.join(0.001)
    read = []
    reader = threading.Thread(target=lambda: read.append(store.job(job).status))
    reader.start()
    reader.join(BOUND_S)
    assert read == ["queued"] and writer.is_alive()  # served while the write still waits
    other.execute("ROLLBACK")
    writer.join(BOUND_S)
    assert len(store.jobs("")) == 2
    impatient = JobStore(str(tmp_path), busy_s=0.01)
    other.execute("BEGIN IMMEDIATE")
    with pytest.raises(StoreError, match="database is locked; another process holds the store's lock: retry in a "
                                         "moment") as info:
        impatient.create("", spec(1), "digits")
    assert (info.value.status, info.value.code) == (503, "job_store_busy")
    other.execute("ROLLBACK")
    full = store_error(sqlite3.OperationalError("database or disk is full"), store.path, "could not be written")
    assert (full.status, full.code) == (507, "job_store_full") and str(full).endswith("free disk space or change "
                                                                                        "--state-dir")


# -- the write order ----------------------------------------------------------------------------------------------
def test_an_image_is_whole_under_its_name_and_fsynced_before_its_commit(tmp_path, monkeypatch):
    store = JobStore(str(tmp_path))
    job = store.create("", spec(1, seeds=(7,)), "digits")
    c = store.pending(job.id, (-1, -1), 10)[0]
    final = store.image_path(job.id, 0, 0)
    observer = sqlite3.connect(os.path.join(str(tmp_path), "jobs.sqlite3"))
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def status() -> str:
        return observer.execute("SELECT status FROM candidates WHERE job = ?", (job.id,)).fetchone()[0]

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("fsync", os.path.basename(target) if os.path.isfile(target) else "folder",
                       os.path.exists(final), status()))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(src), os.path.basename(dst), status()))
        assert open(src, "rb").read() == data  # the whole image, fsynced, under its temporary name
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    data = b"\x89PNG...the image"
    store.store_image(c, data)
    temp = f".0-0.png.{os.getpid()}.tmp"
    assert events == [("fsync", "folder", False, "pending")] * 2 + [  # images/ and images/JOB/ made durable
        ("fsync", temp, False, "pending"), ("replace", temp, "0-0.png", "pending"),
        ("fsync", "folder", True, "pending")]
    assert status() == "done" and store.job(job.id).done == 1  # committed last
    assert open(final, "rb").read() == data and stored(store, job.id) == ["0-0.png"]


# -- resume after a crash -----------------------------------------------------------------------------------------
class Crash(BaseException):
    """SIGKILL at a point of the write: nothing after it runs."""


def test_resume_after_a_crash_at_each_point_makes_each_missing_image_once(tmp_path, monkeypatch):
    store = JobStore(str(tmp_path))
    job = store.create("", spec(4), "digits").id
    engine = FakeEngine()
    cands = store.pending(job, (-1, -1), 10)
    backend = engine.backend()

    def png(c) -> bytes:
        request = backend.build(c)
        return asyncio.run(FakeHandle(engine, request).result()).encoded[0]

    # candidate 0: stored and committed; 1: renamed, crash before the commit; 2: crash before the rename (a
    # temporary file left); 3: a file under its name that is not its image (another seed); 4..7: never started
    store.store_image(cands[0], png(cands[0]))
    with monkeypatch.context() as m:
        m.setattr(JobStore, "_done", lambda *a: (_ for _ in ()).throw(Crash()))
        with pytest.raises(Crash):
            store.store_image(cands[1], png(cands[1]))
        m.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(Crash()))
        with pytest.raises(Crash):
            store.store_image(cands[2], png(cands[2]))
    files.write_image(store.image_path(job, cands[3].item, cands[3].k), png(cands[0]))
    assert store.job(job).done == 1
    assert stored(store, job) == sorted(["0-0.png", "0-1.png", "1-1.png", f".1-0.png.{os.getpid()}.tmp"])
    engine.made.clear()

    run_jobs(JobStore(str(tmp_path)), engine, [job])  # the restart
    row = store.job(job)
    assert (row.status, row.done, row.failed) == ("completed", 8, 0)
    assert stored(store, job) == sorted(f"{i}-{k}.png" for i in range(4) for k in range(2))  # temporary swept
    remade = sorted(seed for _, seed in engine.made)
    assert remade == sorted(c.seed for c in cands[2:])  # not 0 (done) nor 1 (adopted); 3 made again
    for c in cands:
        with Image.open(store.image_path(job, c.item, c.k)) as im:
            im.load()
            assert im.getpixel((0, 0))[0] == round((c.seed % 251) / 255 * 255)  # each its own image


# -- a full disk, an unwritable folder ----------------------------------------------------------------------------
def test_an_unwritable_folder_fails_the_jobs_candidates_with_a_clear_error_and_nothing_else(tmp_path, monkeypatch):
    code, hint = errno.EACCES, "make the folder writable or change --state-dir"
    store = JobStore(str(tmp_path))
    full = store.create("", spec(3), "digits").id
    real_open = os.open

    def open_(path, flags, *args):
        if full in str(path) and flags & os.O_CREAT:
            raise OSError(code, os.strerror(code), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_)
    engine = FakeEngine()
    run_jobs(store, engine, [full])
    row = store.job(full)
    assert (row.status, row.done, row.failed) == ("failed", 0, 6)
    errors = {e for r in store.results(full, 0, 10) for e in r.errors}
    folder = os.path.join(store.images, full)
    assert errors == {f"could not write the image to {folder}/{i}-{k}.png: {os.strerror(code)}; {hint}"
                      for i in range(3) for k in range(2)}
    assert os.listdir(folder) == []  # no temporary file left behind
    fine = store.create("", spec(2, base=10), "digits").id  # the store, the coordinator: still working
    run_jobs(store, engine, [fine])
    assert (store.job(fine).status, store.job(fine).done) == ("completed", 4)


def test_a_full_disk_pauses_the_jobs_with_why_and_they_resume_when_space_returns(tmp_path, monkeypatch):
    """With the disk full a job stayed "running" with no error, making images and throwing them away (5 ERROR lines a
    second). Now every job is paused, its status says why, nothing is submitted meanwhile, the images made are kept
    and written once a probe finds space: each candidate is made exactly once."""
    from diffgraph.jobs.store import job_summary
    store = JobStore(str(tmp_path))
    job = store.create("", spec(3), "digits").id
    other = store.create("", spec(1, base=10), "digits").id
    full = [True]
    real_open = os.open

    def open_(path, flags, *args):
        if full[0] and flags & os.O_CREAT and (str(path).startswith(store.images) or "space-probe" in str(path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_)
    engine = FakeEngine()
    settings = CoordinatorSettings(inflight=4, poll_s=0.01, retry_base_s=0.01, space_probe_s=0.01)

    async def main():
        coordinator = Coordinator(store, engine.backend(), None, settings)
        task = asyncio.create_task(coordinator.run())
        await until(lambda: store.job(job).status == "paused" and coordinator.running() == 0, "the jobs pause")
        made = len(engine.made)
        for _ in range(20):  # many polls and probes: nothing more is submitted while the disk is full
            await asyncio.sleep(0.01)
        assert len(engine.made) == len(engine.submitted) == made == 4
        summary = job_summary(store.job(job), None)
        assert summary["status"] == "paused" and store.job(other).status == "paused"
        assert "No space left on device; free disk space or change --state-dir" in summary["reason"]
        full[0] = False  # space again
        await until(lambda: not store.job(job).unfinished and not store.job(other).unfinished, "they resume")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    for j, candidates in ((job, 6), (other, 2)):
        row = store.job(j)
        assert (row.status, row.done, row.failed, row.reason) == ("completed", candidates, 0, None)
    assert sorted(seed for _, seed in engine.made) == sorted(c for i in (0, 1, 2, 10) for c in (1000 * i + 1,
                                                                                                 1000 * i + 2))
    assert len(stored(store, job)) == 6 and not os.path.exists(os.path.join(str(tmp_path), ".space-probe"))


# -- a key's bytes kept, while its jobs run -----------------------------------------------------------------------
def finished_job_keeping(store: JobStore, owner: str, size: int) -> str:
    """A finished job of `owner` whose one image keeps `size` bytes."""
    job = store.create(owner, spec(1, seeds=(1,), base=90), "digits").id
    store.store_image(store.pending(job, (-1, -1), 1)[0], b"\x89PNG" + bytes(size - 4))
    assert store.finish(job).status == "completed"
    return job


def made_of(engine: FakeEngine, job: str) -> list[int]:
    return sorted(seed for j, seed in engine.made if j == job)


def test_a_key_at_its_byte_limit_while_its_job_runs_is_paused_with_why_and_resumes_once_it_keeps_less(tmp_path):
    """--max-key-bytes was checked only when a job was made: a running job's images grew its key's bytes far past
    it. Now nothing more of a key at its limit is submitted and its job is paused with why, while another key's job
    completes; its finished job deleted, it resumes by itself, every image made once."""
    from diffgraph.jobs.store import job_summary, quota_reason
    store = JobStore(str(tmp_path))
    old = finished_job_keeping(store, "a", 100_000)
    job = store.create("a", spec(4), "digits").id
    other = store.create("b", spec(4, base=10), "digits").id
    limit = store.job(old).bytes + store.job(job).bytes + 1  # the first image of `job` reaches it
    engine = FakeEngine()

    def submitted(j: str) -> int:
        return sum(r.job == j for r in engine.submitted)

    async def main():
        coordinator = Coordinator(store, engine.backend(), None, FAST, KeyLimits(bytes=limit))
        task = asyncio.create_task(coordinator.run())
        await until(lambda: store.job(job).status == "paused" and store.job(job).done == submitted(job),
                    "a's job pauses and its images in flight are stored")
        await until(lambda: not store.job(other).unfinished, "b's job goes on and completes")
        made = submitted(job)
        for _ in range(20):  # many polls: nothing more of a is submitted while it keeps its limit
            await asyncio.sleep(0.01)
        row = store.job(job)
        assert submitted(job) == made == row.done and 1 <= made <= 2  # its share of the bound, in flight, stored
        kept = store.job(old).bytes + row.bytes
        assert kept > limit
        summary = job_summary(row, None)
        assert (summary["status"], summary["reason"]) == ("paused", quota_reason(kept, limit))
        assert summary["reason"] == (f"this API key's jobs keep {kept} bytes, at most {limit} (--max-key-bytes): "
                                     "delete finished jobs (DELETE /v1/jobs/ID) to resume, or wait until they expire")
        assert store.delete(old)  # as DELETE /v1/jobs/ID does
        coordinator.wake()
        await until(lambda: not store.job(job).unfinished, "a's job resumes and completes")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    for j, base in ((job, 0), (other, 10)):
        row = store.job(j)
        assert (row.status, row.done, row.failed, row.reason) == ("completed", 8, 0, None)
        assert made_of(engine, j) == sorted(1000 * (base + i) + s for i in range(4) for s in (1, 2))  # each once
        assert len(stored(store, j)) == 8


def test_the_full_disk_pause_and_a_keys_byte_limit_pause_do_not_resume_each_other(tmp_path, monkeypatch):
    """A job held by its key's limit shows that reason and stays paused when the disk has space again; once its key
    keeps less while the disk is full, it shows the disk's reason and waits for space."""
    from diffgraph.jobs.store import quota_paused
    store = JobStore(str(tmp_path))
    old = finished_job_keeping(store, "a", 100_000)
    job = store.create("a", spec(2), "digits").id
    limit = store.job(old).bytes + store.job(job).bytes + 1
    full = [False]
    real_open = os.open

    def open_(path, flags, *args):
        if full[0] and flags & os.O_CREAT and (str(path).startswith(store.images) or "space-probe" in str(path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_)
    engine = FakeEngine()
    # one in flight: a's first image reaches its limit while the rest of its job is still to be submitted
    settings = CoordinatorSettings(inflight=1, poll_s=0.01, retry_base_s=0.01, space_probe_s=0.01)

    def submitted(j: str) -> int:
        return sum(r.job == j for r in engine.submitted)

    def status(j: str) -> tuple[str, str]:
        row = store.job(j)
        return row.status, row.reason or ""

    async def disk_full(coordinator: Coordinator, base: int) -> str:
        """The disk fills: a job of b made now cannot store its images, every job pauses."""
        full[0] = True
        b = store.create("b", spec(1, base=base), "digits").id
        coordinator.wake()
        await until(lambda: status(b)[0] == "paused" and coordinator.running() == 0, "the disk's pause")
        assert "No space left on device; free disk space or change --state-dir" in status(b)[1]
        return b

    async def main():
        coordinator = Coordinator(store, engine.backend(), None, settings, KeyLimits(bytes=limit))
        task = asyncio.create_task(coordinator.run())
        await until(lambda: status(job)[0] == "paused" and store.job(job).done == submitted(job), "a's job is held")
        held = submitted(job)

        def by_its_key() -> bool:  # the byte count in the reason may move (a re-read counts a racing image again)
            state, reason = status(job)
            return state == "paused" and quota_paused(reason) and submitted(job) == held

        assert by_its_key()
        first = await disk_full(coordinator, 10)
        assert by_its_key()  # its key's reason: only the key can end it
        full[0] = False
        await until(lambda: not store.job(first).unfinished, "b's job resumes with space and completes")
        assert by_its_key()  # the disk's resume left it held
        made = submitted(job)
        second = await disk_full(coordinator, 20)
        assert store.delete(old)
        coordinator.wake()
        await until(lambda: "No space left on device" in status(job)[1], "a's job now waits for the disk")
        for _ in range(20):  # many polls and probes: still nothing of a while the disk is full
            await asyncio.sleep(0.01)
        assert status(job)[0] == "paused" and submitted(job) == made
        full[0] = False
        await until(lambda: not store.job(job).unfinished and not store.job(second).unfinished, "both complete")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    for j, n in ((job, 4), (first_of(store, "b", 0), 2), (first_of(store, "b", 1), 2)):
        row = store.job(j)
        assert (row.status, row.done, row.failed, row.reason) == ("completed", n, 0, None)
    assert made_of(engine, job) == [1, 2, 1001, 1002]  # each image once: none thrown away, none made twice


def first_of(store: JobStore, owner: str, index: int) -> str:
    """The owner's index-th job, oldest first."""
    return store.jobs(owner)[::-1][index].id


def test_a_job_stored_paused_by_its_keys_byte_limit_is_judged_again_after_a_restart(tmp_path):
    from diffgraph.jobs.store import quota_reason
    store = JobStore(str(tmp_path))
    old = finished_job_keeping(store, "a", 100_000)
    job = store.create("a", spec(2), "digits").id
    store.pause([job], quota_reason(1, 0))  # as a server left it
    kept = store.job(old).bytes + store.job(job).bytes
    engine = FakeEngine()

    async def main():  # the key still at its limit: held, with the numbers of now; not a full disk (no probe)
        coordinator = Coordinator(store, engine.backend(), None, FAST, KeyLimits(bytes=kept))
        task = asyncio.create_task(coordinator.run())
        await until(lambda: store.job(job).reason == quota_reason(kept, kept), "the restart judges it")
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert store.job(job).status == "paused" and engine.submitted == [] and coordinator._full is None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    run_jobs(store, engine, [job], limits=KeyLimits(bytes=kept + 1))  # under it now (the images may pass it)
    row = store.job(job)
    assert (row.status, row.done, row.reason) == ("completed", 4, None)


# -- retries, refusals --------------------------------------------------------------------------------------------
def test_retryable_answers_are_retried_and_refusals_fail_with_the_engines_message(tmp_path):
    store = JobStore(str(tmp_path))
    job = store.create("", spec(3, seeds=(1,)), "digits").id
    engine = FakeEngine()
    engine.errors = {1: [QueueFullError("the queue is full"), QueueFullError("the queue is full")],
                     1001: [ParamError("loras", "adapter 'ink' is not in --lora-dir")],
                     2001: [EngineStepError("CUDA error: an illegal memory access")]}
    run_jobs(store, engine, [job])
    results = store.results(job, 0, 10)
    assert [r.statuses for r in results] == [("done",), ("failed",), ("failed",)]
    assert results[1].errors == ("adapter 'ink' is not in --lora-dir",)
    assert results[2].errors == ("the engine failed to make the image: CUDA error: an illegal memory access",)
    assert [r.seed for r in engine.submitted].count(1) == 3 and store.job(job).status == "completed"
    always = store.create("", spec(1, seeds=(5,), base=7), "digits").id
    engine.errors = {7005: [QueueFullError("the queue is full")] * FAST.max_attempts}
    run_jobs(store, engine, [always])
    assert store.results(always, 0, 1)[0].errors == (f"the queue is full (gave up after {FAST.max_attempts} "
                                                     "attempts)",)
    assert store.job(always).status == "failed"


# -- fairness, the in-flight bound, cancel --------------------------------------------------------------------------
def test_two_jobs_share_the_engine_round_robin_within_the_inflight_bound_and_cancel_aborts(tmp_path):
    store = JobStore(str(tmp_path))
    a = store.create("", spec(6), "digits").id
    b = store.create("", spec(6, base=100), "digits").id
    engine = FakeEngine()

    async def main():
        engine.gate.clear()  # every request waits in the engine: the bound holds the rest back
        coordinator = Coordinator(store, engine.backend(), None, FAST)
        task = asyncio.create_task(coordinator.run())
        await until(lambda: len(engine.submitted) == 4, "the bound fills")
        await asyncio.sleep(0.1)  # two polls: every chance to submit a fifth
        assert len(engine.submitted) == 4 == coordinator.running()
        assert [r.job for r in engine.submitted] == [a, b, a, b]  # round-robin, not first come first served
        assert all(r.priority == "batch" and r.num_images == 1 for r in engine.submitted)
        store.cancel(a)
        coordinator.drop(a)
        await until(lambda: len(engine.aborted) == 2, "a's two requests in flight are aborted")
        assert {r.job for r in engine.aborted} == {a}
        engine.gate.set()
        await until(lambda: not store.job(b).unfinished, "b finishes")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert (store.job(a).status, store.job(a).done) == ("cancelled", 0)
    assert (store.job(b).status, store.job(b).done) == ("completed", 12)
    assert [r.job for r in engine.submitted].count(a) == 2  # nothing of a after its cancel


def test_the_batch_capacity_is_shared_by_the_keys_then_by_each_keys_jobs(tmp_path):
    """Capacity was shared per job: one key's 20-image job took 10x longer beside another key's ten jobs. Now the
    key with the fewest candidates in flight goes next, then its job with the fewest."""
    store = JobStore(str(tmp_path))
    many = [store.create("a", spec(2, base=100 * j), "digits").id for j in range(10)]  # 10 jobs x 4 candidates
    one = store.create("b", spec(10, base=5000), "digits").id                        # 1 job x 20 candidates
    engine = FakeEngine()

    async def main():
        engine.gate.clear()
        coordinator = Coordinator(store, engine.backend(), None, FAST)
        task = asyncio.create_task(coordinator.run())
        await until(lambda: len(engine.submitted) == 4, "the bound fills")
        assert sorted(r.job == one for r in engine.submitted) == [False, False, True, True]  # two each
        assert len({r.job for r in engine.submitted if r.job != one}) == 2  # a's two from two of its jobs
        assert {r.share for r in engine.submitted} == {"a", "b"}  # and the engine shares its rows the same way
        engine.gate.set()
        await until(lambda: not store.job(one).unfinished, "b's job finishes")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    order = [r.job == one for r in engine.submitted]
    # b's one job got as much as a's ten together: its 20 were submitted among the first ~40 (shared per job, a's 40
    # went first, ten to one: b's last was the 60th)
    assert sum(order) == 20 and len(order) - order[::-1].index(True) <= 45
    firsts = [r.job for r in engine.submitted if r.job != one][:10]
    assert len(set(firsts)) >= 8  # and a's share goes round its jobs
    assert set(many) >= set(firsts)


def test_an_items_images_are_decoded_off_the_event_loop_and_candidates_still_go_round_robin(tmp_path, monkeypatch):
    """A job item's base64 images (its image prompts, its controls) are decoded when each candidate's request is
    built: that ran on the event loop, stalling every HTTP request of the server for each decode. (The fake engine
    makes images of any request: the IP-Adapter named is never looked up.)"""
    import base64
    import io
    import threading

    from diffgraph.api import protocol as uploads  # the uploads are decoded there
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buf, format="PNG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    decoded_on, real = [], uploads.decode_upload
    monkeypatch.setattr(uploads, "decode_upload", lambda *a: decoded_on.append(threading.get_ident()) or real(*a))
    store = JobStore(str(tmp_path))
    items = tuple(JobItem({"prompt": f"a digit {i}", "num_inference_steps": 2, "seed": 1,
                           "image_prompts": {"model": "face", "images": [b64]}}, (1000 * i + 1, 1000 * i + 2))
                  for i in range(2))
    a = store.create("", JobSpec(items), "digits").id
    b = store.create("", spec(2, base=100), "digits").id
    engine = FakeEngine()
    loop_thread = []

    async def main():
        loop_thread.append(threading.get_ident())
        engine.gate.clear()
        coordinator = Coordinator(store, engine.backend(), None, FAST)
        task = asyncio.create_task(coordinator.run())
        await until(lambda: len(engine.submitted) == 4, "the bound fills")
        assert [r.job for r in engine.submitted] == [a, b, a, b]  # still round-robin, in the order chosen
        engine.gate.set()
        await until(lambda: not store.job(a).unfinished and not store.job(b).unfinished, "both finish")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())
    assert len(decoded_on) == 4 and loop_thread[0] not in decoded_on  # each of a's candidates, off the loop
    assert len(stored(store, a)) == len(stored(store, b)) == 4


# -- one coordinator per state folder, retention ------------------------------------------------------------------
def test_one_process_coordinates_and_another_takes_over_when_it_ends(tmp_path):
    job = JobStore(str(tmp_path)).create("", spec(4), "digits").id

    async def main():
        first, second = JobStore(str(tmp_path)), JobStore(str(tmp_path))  # two processes' connections
        e1, e2 = FakeEngine(), FakeEngine()
        e1.gate.clear()
        c1 = Coordinator(first, e1.backend(), None, FAST)
        c2 = Coordinator(second, e2.backend(), None, FAST)
        t1 = asyncio.create_task(c1.run())
        await until(lambda: c1.coordinating and len(e1.submitted) == 4, "the first coordinates")
        t2 = asyncio.create_task(c2.run())
        await asyncio.sleep(0.2)  # four lock retries
        assert not c2.coordinating and e2.submitted == []
        t1.cancel()  # its process ends: its lock is released, its requests aborted
        await asyncio.gather(t1, return_exceptions=True)
        assert len(e1.aborted) == 4
        await until(lambda: not second.job(job).unfinished, "the second takes over and finishes")
        assert c2.coordinating
        t2.cancel()
        await asyncio.gather(t2, return_exceptions=True)
        return second.job(job)

    row = asyncio.run(main())
    assert (row.status, row.done) == ("completed", 8)


def test_finished_jobs_past_the_retention_are_deleted_with_their_images(tmp_path):
    store = JobStore(str(tmp_path))
    old, recent = store.create("", spec(1), "digits").id, store.create("", spec(1, base=5), "digits").id
    run_jobs(store, FakeEngine(), [old, recent])
    with store._write() as db:  # the old job ended two days ago
        db.execute("UPDATE jobs SET finished = finished - 2 * 86400 WHERE id = ?", (old,))
    run_jobs(store, FakeEngine(), [], CoordinatorSettings(retention_s=86400.0, poll_s=0.05),
             done=lambda: store.job(old) is None)  # the sweep at the coordinator's start
    assert store.job(old) is None and not os.path.exists(os.path.join(store.images, old))
    assert store.job(recent).status == "completed" and stored(store, recent) == ["0-0.png", "0-1.png"]


# -- a cancel while a candidate is being submitted; `diffgraph batch`'s planning ---------------------------------
class SlowAcceptEngine(FakeEngine):
    """An engine that has a request as soon as it is submitted (a replica process once it is sent down the pipe,
    an in-process engine once its thread queues it) and answers "accepted" only when `accept` is set: cancelling
    the caller's wait does not take the request back."""

    def __init__(self):
        super().__init__()
        self.accept = asyncio.Event()
        self.queued: list[FakeHandle] = []

    async def submit(self, request) -> FakeHandle:
        self.submitted.append(request)
        handle = FakeHandle(self, request)
        self.queued.append(handle)  # in the engine from now on, whatever happens to the caller
        await asyncio.shield(self.accept.wait())
        return handle


def test_a_job_cancelled_while_its_candidate_is_being_submitted_aborts_that_request(tmp_path):
    """The cancel cancelled the candidate's task inside `submit`; the engine accepted the request a moment later and
    made its image for nobody (no handle left to abort: a batch row held for the whole run)."""
    store = JobStore(str(tmp_path))
    a = store.create("", spec(1, seeds=(1,)), "digits").id
    engine = SlowAcceptEngine()
    released = []

    async def main():
        engine.gate.clear()  # an accepted request waits in the engine: only an abort ends it before the gate opens
        backend = EngineBackend(CONFIG, info=lambda: INFO, submit=engine.submit, release=released.append)
        coordinator = Coordinator(store, backend, None, FAST)
        task = asyncio.create_task(coordinator.run())
        await until(lambda: len(engine.queued) == 1, "the candidate is being submitted")
        store.cancel(a)
        coordinator.drop(a)
        engine.accept.set()  # the engine answers after the cancel
        await until(lambda: len(engine.aborted) == 1, "the request accepted after the cancel is aborted")
        assert coordinator.running() == 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert [r.job for r in engine.aborted] == [a]
    assert released == engine.queued  # forgotten by the server's table of requests in flight too
    assert engine.made == []
    assert (store.job(a).status, store.job(a).done, store.job(a).failed) == ("cancelled", 0, 0)


def test_batch_planning_decodes_an_items_images_once_and_shares_them_across_its_candidates(tmp_path, monkeypatch):
    """`diffgraph batch` builds every candidate's request up front: an item's base64 images (controls, image prompts)
    were decoded once per seed (up to 64 copies), every copy held until the run ended."""
    import base64
    import io

    from PIL import Image

    from diffgraph.jobs.batch_work import plan
    from diffgraph.jobs.spec import JobItem, JobSpec
    from diffgraph.api import protocol as uploads  # the uploads are decoded there

    def b64(colour) -> str:
        buf = io.BytesIO()
        Image.new("RGB", (32, 32), colour).save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()

    decoded, real = [], uploads.decode_upload
    monkeypatch.setattr(uploads, "decode_upload", lambda *a: decoded.append(a[0]) or real(*a))
    body = {"prompt": "a digit", "num_inference_steps": 2, "image_prompts": {"model": "face", "images": [b64("red")]},
            "controls": [{"model": "outline", "image": b64("blue")}]}
    seeds = (1, 2, 3, 4)
    spec = JobSpec((JobItem(body, seeds), JobItem({"prompt": "plain", "num_inference_steps": 2}, (5, 6))))
    work = plan(spec, CONFIG, INFO, str(tmp_path), lambda body: ())
    assert len(decoded) == 2  # the item's two images, once each
    assert [w.request.seed for w in work] == [*seeds, 5, 6]
    first = work[0].request
    assert first.image_prompts.images[0][0, 0].tolist() == [255, 0, 0]
    assert first.controls[0].image[0, 0].tolist() == [0, 0, 255]
    for w in work[1:4]:  # the same arrays, not copies
        assert w.request.image_prompts.images[0] is first.image_prompts.images[0]
        assert w.request.controls[0].image is first.controls[0].image
    assert all(w.request.controls == () and w.request.image_prompts is None for w in work[4:])
