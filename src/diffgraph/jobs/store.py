"""The durable state of jobs: SQLite in WAL mode under `--state-dir`, images beside it.

    STATE_DIR/jobs.sqlite3                 jobs, their items (the images request of each, as JSON) and candidates
    STATE_DIR/images/JOB/ITEM-K.png        candidate K of item ITEM, with its settings inside (image_metadata.py)

A job belongs to the API key that made it, stored as a hash of the key (`owner_of`), never the key. A candidate
is pending, done or failed (with its error); the job counts its done and failed candidates as they change, in the
same transaction, so its status is one row read. A candidate becomes done only after its image is whole on disk
(files.py: temporary name, fsync, rename, fsync of the folder, THEN the commit here): after a crash an image is
either stored and marked, stored and not yet marked (adopted on restart once it decodes with the candidate's
settings: `adopt`), or absent (made again); never half written, never made twice once stored. Commits use
synchronous=FULL, so a commit that returned survives a power cut too.

A job is written in transactions of INSERT_CHUNK rows ("creating" until it is whole, then "queued"), its owner's
limits (`KeyLimits`: unfinished jobs, bytes kept) checked in the first; a job is "paused" with the reason while its
disk is full or its key keeps --max-key-bytes (`quota_reason`; the coordinator pauses and resumes it). SQLite's
errors become a `StoreError` whose status and hint fit the cause (`store_error`: damaged, locked, full, unwritable).

Several processes may share one state folder (replicas or Ray Serve ingress replicas on one host): SQLite's locks
order their writes (busy timeout 30 s); each process writes on one connection behind a lock and reads on another,
so a read never waits behind this process's writes (WAL readers do not wait for writers). WAL needs the
processes on one machine (its index is shared memory): a state folder on a network file system is not supported.
Finished jobs are deleted with their images after `--job-retention` (the coordinator sweeps), or by DELETE.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from .files import make_folder, matches, write_image
from .spec import JobSpec

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, name TEXT, model TEXT NOT NULL, status TEXT NOT NULL,
    created REAL NOT NULL, started REAL, finished REAL, items INTEGER NOT NULL, candidates INTEGER NOT NULL,
    done INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    webhook TEXT, webhook_state TEXT, webhook_error TEXT, bytes INTEGER NOT NULL DEFAULT 0, reason TEXT);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs (owner, created);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status);
CREATE TABLE IF NOT EXISTS items (
    job TEXT NOT NULL, item INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY (job, item)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS candidates (
    job TEXT NOT NULL, item INTEGER NOT NULL, k INTEGER NOT NULL, seed INTEGER NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending', error TEXT, finished REAL,
    PRIMARY KEY (job, item, k)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS candidates_status ON candidates (job, status, finished);
"""
UNFINISHED = ("queued", "running", "paused")  # paused: its disk is full or its key at --max-key-bytes (the reason)
HELD = ("creating",) + UNFINISHED  # what counts against a key's --max-key-jobs
RATE_WINDOW_S = 60.0  # images/s is measured over the last minute while a job runs
INSERT_CHUNK = 2000   # rows one transaction of `create` writes: the store's lock is never held for long
ROW_BYTES = 64        # what a candidate's row costs on disk, counted against --max-key-bytes with the item bodies
WRITE_BUSY_S = 30.0   # how long a write waits for another process's write lock (SQLite's busy timeout)
READ_BUSY_S = 2.0     # how long a read waits (in WAL mode only a crash's recovery or an exclusive lock holds one)
CREATING_STALE_S = 3600.0  # a job still being created after this long was left by a crash: swept
_JOB_COLUMNS = ("id, owner, name, model, status, created, started, finished, items, candidates, done, failed, "
                "webhook, webhook_state, webhook_error, bytes, reason")
_ADDED_COLUMNS = (("bytes", "INTEGER NOT NULL DEFAULT 0"), ("reason", "TEXT"))  # to a store made before them


class StoreError(Exception):
    """The job store cannot be opened, read or written (one line: where, why, what to do). `status`: 503 (damaged,
    locked by another process, unreadable: the images API serves on) or 507 (the disk is full); `code` says which."""

    def __init__(self, message: str, status: int = 503, code: str = "job_store_error"):
        super().__init__(message)
        self.status, self.code = status, code


def store_error(e: sqlite3.Error, path: str, what: str) -> StoreError:
    """SQLite's error as a StoreError whose hint fits its cause (SQLite's result code where Python gives it)."""
    name, text = getattr(e, "sqlite_errorname", "") or "", str(e)
    where = f"the job store {path} {what}: {text}"
    if name in ("SQLITE_CORRUPT", "SQLITE_NOTADB") or "malformed" in text or "not a database" in text:
        return StoreError(f"{where}; the file is damaged: stop the servers sharing --state-dir, then move jobs.sqlite3 "
                          "(with its -wal and -shm files) aside to start with no jobs, or restore it from a backup "
                          "(`sqlite3 jobs.sqlite3 .recover` may save its rows)", 503, "job_store_damaged")
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text or "busy" in text:
        return StoreError(f"{where}; another process holds the store's lock: retry in a moment (`fuser {path}` shows "
                          "which processes have it open)", 503, "job_store_busy")
    if name == "SQLITE_FULL" or "disk is full" in text:
        return StoreError(f"{where}; free disk space or change --state-dir", 507, "job_store_full")
    if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")) or "readonly" in text:
        return StoreError(f"{where}; make the folder writable or change --state-dir", 503, "job_store_unwritable")
    return StoreError(f"{where}; check the disk (dmesg) or change --state-dir", 503, "job_store_error")


class QuotaError(Exception):
    """A key past one of its limits: `status` 429 (unfinished jobs: retry when one ends) or 507 (bytes kept)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class KeyLimits:
    jobs: int = 16              # --max-key-jobs: unfinished jobs at once
    bytes: int = 256 * 2**30    # --max-key-bytes: images and rows kept


def owner_of(key: bytes | None) -> str:
    """Who owns a job: a hash of the API key that made it ("" on a server without keys: one owner, everyone)."""
    return hashlib.sha256(b"diffgraph job owner\n" + key).hexdigest()[:32] if key else ""


@dataclass(frozen=True)
class JobRow:
    id: str
    owner: str
    name: str | None
    model: str
    status: str          # creating | queued | running | paused | completed | failed | cancelled
    created: float
    started: float | None
    finished: float | None
    items: int
    candidates: int
    done: int
    failed: int
    webhook: str | None
    webhook_state: str | None  # None (no webhook) | pending | sent | failed
    webhook_error: str | None
    bytes: int = 0             # its images and rows on disk
    reason: str | None = None  # why it is paused (a full disk, its key at --max-key-bytes); None once it ends

    @property
    def pending(self) -> int:
        return self.candidates - self.done - self.failed

    @property
    def unfinished(self) -> bool:
        return self.status in UNFINISHED


@dataclass(frozen=True)
class Candidate:
    """One image to make: item `item`'s candidate `k`, with its seed and the item's images request fields."""

    job: str
    item: int
    k: int
    seed: int
    body: dict[str, Any]

    @property
    def key(self) -> tuple[str, int, int]:
        return self.job, self.item, self.k


@dataclass(frozen=True)
class ItemResult:
    item: int
    prompt: str | None
    seeds: tuple[int, ...]
    statuses: tuple[str, ...]        # per candidate: pending | done | failed
    errors: tuple[str | None, ...]


def quota_reason(kept: int, limit: int) -> str:
    """Why a key's unfinished jobs are paused while it keeps `limit` bytes or more (the coordinator's check)."""
    return (f"this API key's jobs keep {kept} bytes, at most {limit} (--max-key-bytes): delete finished jobs "
            "(DELETE /v1/jobs/ID) to resume, or wait until they expire")


def quota_paused(reason: str | None) -> bool:
    """Whether a paused job's reason is its key's byte limit (`quota_reason`), not a full disk."""
    return reason is not None and "(--max-key-bytes)" in reason


def image_name(item: int, k: int) -> str:
    return f"{item}-{k}.png"


def job_summary(row: JobRow, rate: float | None) -> dict[str, Any]:
    """A job as GET /v1/jobs/ID answers it (and as its webhook is called): status, counts, images/s and ETA."""
    def stamp(t: float | None) -> int | None:
        return None if t is None else int(t)
    return {"id": row.id, "object": "job", "status": row.status, "name": row.name, "model": row.model,
            "created": stamp(row.created), "started": stamp(row.started), "finished": stamp(row.finished),
            "counts": {"items": row.items, "candidates": row.candidates, "done": row.done, "failed": row.failed,
                       "pending": row.pending},
            "images_per_s": None if rate is None else round(rate, 3),
            "eta_s": round(row.pending / rate, 1) if rate and row.status in ("queued", "running") else None,
            "reason": row.reason,
            "webhook": None if row.webhook is None else {"url": row.webhook, "state": row.webhook_state,
                                                         "error": row.webhook_error},
            "results_url": f"/v1/jobs/{row.id}/results"}


class JobStore:
    def __init__(self, root: str, busy_s: float = WRITE_BUSY_S, read_busy_s: float = READ_BUSY_S):
        self.root = os.path.abspath(root)
        self.images = os.path.join(self.root, "images")
        self._lock = threading.RLock()      # the write connection's
        self._read_lock = threading.Lock()  # the read connection's: reads never wait behind this process's writes
        self.path = os.path.join(self.root, "jobs.sqlite3")
        try:
            make_folder(self.root)
            self._db = sqlite3.connect(self.path, timeout=busy_s, isolation_level=None, check_same_thread=False)
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise sqlite3.OperationalError(f"the file system does not support WAL mode (got {mode!r})")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(jobs)")}
            for name, declared in _ADDED_COLUMNS:
                if name not in columns:
                    try:
                        self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {declared}")
                    except sqlite3.OperationalError as e:  # another process added it meanwhile
                        if "duplicate column" not in str(e):
                            raise
            self._reader = sqlite3.connect(self.path, timeout=read_busy_s, isolation_level=None,
                                           check_same_thread=False)
            self._reader.execute("PRAGMA query_only=1")
        except OSError as e:
            raise StoreError(f"the job store {self.path} cannot be opened: {e}; give --state-dir a writable folder "
                             "on a local disk") from None
        except sqlite3.Error as e:
            raise store_error(e, self.path, "cannot be opened") from None

    def close(self) -> None:
        with self._lock, self._read_lock:
            self._db.close()
            self._reader.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE: the write lock first, so two processes never deadlock)."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    self._db.rollback()
                    raise
                try:
                    self._db.commit()
                except sqlite3.Error:  # SQLite may leave the transaction open: every later BEGIN would fail
                    if self._db.in_transaction:
                        self._db.rollback()
                    raise
            except sqlite3.Error as e:
                raise store_error(e, self.path, "could not be written") from None

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._read_lock:
            try:
                return self._reader.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise store_error(e, self.path, "could not be read") from None

    # -- jobs ---------------------------------------------------------------------------------------------------
    def create(self, owner: str, spec: JobSpec, model: str, now: float | None = None,
               limits: KeyLimits | None = None) -> JobRow:
        """Stores a job: its row first ("creating", invisible to the coordinator and the listings, checked against
        the owner's `limits` in the same transaction), its items and candidates in transactions of INSERT_CHUNK rows
        (the store's lock is released between them, so other keys' reads and writes go on), then "queued". A
        failure deletes what was written. Raises QuotaError, StoreError."""
        job = f"job_{secrets.token_hex(12)}"
        bodies = [json.dumps(item.body, ensure_ascii=False) for item in spec.items]
        size = sum(len(b.encode("utf-8")) for b in bodies) + ROW_BYTES * spec.candidates
        with self._write() as db:
            if limits is not None:
                _check_quota(db, owner, limits, size)
            db.execute(f"INSERT INTO jobs ({_JOB_COLUMNS}) VALUES (?, ?, ?, ?, 'creating', ?, NULL, NULL, ?, ?, 0, 0, "
                       "?, NULL, NULL, ?, NULL)", (job, owner, spec.name, model, time.time() if now is None else now,
                                                   len(spec.items), spec.candidates, spec.webhook, size))
        try:
            for chunk in _chunks(((job, i, body) for i, body in enumerate(bodies)), INSERT_CHUNK):
                with self._write() as db:
                    db.executemany("INSERT INTO items VALUES (?, ?, ?)", chunk)
            for chunk in _chunks(((job, i, k, seed) for i, item in enumerate(spec.items)
                                  for k, seed in enumerate(item.seeds)), INSERT_CHUNK):
                with self._write() as db:
                    db.executemany("INSERT INTO candidates (job, item, k, seed) VALUES (?, ?, ?, ?)", chunk)
            with self._write() as db:
                db.execute("UPDATE jobs SET status = 'queued' WHERE id = ? AND status = 'creating'", (job,))
        except BaseException:
            try:
                self.delete(job)
            except StoreError:  # swept later (CREATING_STALE_S)
                pass
            raise
        row = self.job(job)
        assert row is not None
        return row

    def check_quota(self, owner: str, limits: KeyLimits) -> None:
        """QuotaError when the owner is at a limit already (before a job's body is read; `create` checks again)."""
        with self._read_lock:
            try:
                _check_quota(self._reader, owner, limits, 0)
            except sqlite3.Error as e:
                raise store_error(e, self.path, "could not be read") from None

    def kept(self) -> dict[str, int]:
        """The bytes each owner with an unfinished job keeps, all its jobs' together (what `_check_quota` sums)."""
        return dict(self._read(f"SELECT owner, coalesce(sum(bytes), 0) FROM jobs WHERE owner IN (SELECT owner FROM "
                               f"jobs WHERE status IN {UNFINISHED}) GROUP BY owner"))

    def job(self, job: str) -> JobRow | None:
        rows = self._read(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job,))
        return JobRow(*rows[0]) if rows else None

    def jobs(self, owner: str, limit: int = 100) -> list[JobRow]:
        """The owner's jobs, newest first."""
        return [JobRow(*r) for r in self._read(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE owner = ? AND status != "
                                               "'creating' ORDER BY created DESC LIMIT ?", (owner, limit))]

    def unfinished(self) -> list[JobRow]:
        """The jobs still to run, oldest first."""
        return [JobRow(*r) for r in self._read(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE status IN {UNFINISHED} "
                                               "ORDER BY created")]

    def mark_running(self, job: str, now: float | None = None) -> None:
        with self._write() as db:
            db.execute("UPDATE jobs SET status = 'running', started = coalesce(started, ?) WHERE id = ? AND status "
                       "= 'queued'", (time.time() if now is None else now, job))

    def pause(self, jobs: list[str], reason: str) -> None:
        """Marks unfinished jobs paused, with why (their disk is full, their key keeps --max-key-bytes): their status
        says so until `resume`."""
        with self._write() as db:
            db.executemany(f"UPDATE jobs SET status = 'paused', reason = ? WHERE id = ? AND status IN {UNFINISHED}",
                           [(reason, job) for job in jobs])

    def resume(self, jobs: list[str]) -> None:
        with self._write() as db:
            db.executemany("UPDATE jobs SET status = CASE WHEN started IS NULL THEN 'queued' ELSE 'running' END, "
                           "reason = NULL WHERE id = ? AND status = 'paused'", [(job,) for job in jobs])

    def finish(self, job: str, now: float | None = None) -> JobRow | None:
        """Ends a job whose candidates are all done or failed: completed (at least one image) or failed (none); its
        webhook is due. None when it is not finished (or no longer unfinished)."""
        with self._write() as db:
            changed = db.execute(
                "UPDATE jobs SET status = CASE WHEN done = 0 THEN 'failed' ELSE 'completed' END, finished = ?, "
                "reason = NULL, webhook_state = CASE WHEN webhook IS NULL THEN NULL ELSE 'pending' END WHERE id = ? "
                f"AND status IN {UNFINISHED} AND done + failed = candidates", (time.time() if now is None else now, job)
            ).rowcount
        return self.job(job) if changed else None

    def cancel(self, job: str, now: float | None = None) -> JobRow | None:
        """Cancels an unfinished job (its pending candidates stay pending, never made); its webhook is due."""
        with self._write() as db:
            db.execute("UPDATE jobs SET status = 'cancelled', finished = ?, reason = NULL, webhook_state = CASE WHEN "
                       f"webhook IS NULL THEN NULL ELSE 'pending' END WHERE id = ? AND status IN {UNFINISHED}",
                       (time.time() if now is None else now, job))
        return self.job(job)

    def delete(self, job: str) -> bool:
        """Deletes a job's rows, then its images."""
        with self._write() as db:
            db.execute("DELETE FROM candidates WHERE job = ?", (job,))
            db.execute("DELETE FROM items WHERE job = ?", (job,))
            found = db.execute("DELETE FROM jobs WHERE id = ?", (job,)).rowcount > 0
        shutil.rmtree(os.path.join(self.images, job), ignore_errors=True)
        return found

    def expired(self, before: float, now: float | None = None) -> list[str]:
        """Finished jobs that ended before `before` (--job-retention), and jobs a crash left half created."""
        stale = (time.time() if now is None else now) - CREATING_STALE_S
        return [r[0] for r in self._read(f"SELECT id FROM jobs WHERE (status NOT IN {HELD} "
                                         "AND finished < ?) OR (status = 'creating' AND created < ?)", (before, stale))]

    def due_webhooks(self) -> list[JobRow]:
        return [JobRow(*r) for r in self._read(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE webhook_state = 'pending'")]

    def webhook_sent(self, job: str, error: str | None) -> None:
        with self._write() as db:
            db.execute("UPDATE jobs SET webhook_state = ?, webhook_error = ? WHERE id = ?",
                       ("failed" if error else "sent", error, job))

    def rate(self, row: JobRow, now: float | None = None) -> float | None:
        """Images a second: over the whole run once it finished, else over the last RATE_WINDOW_S."""
        now = time.time() if now is None else now
        if row.started is None or row.done == 0:
            return None
        if not row.unfinished:
            return row.done / max(1e-3, (row.finished or now) - row.started)
        since = max(now - RATE_WINDOW_S, row.started)
        count = self._read("SELECT count(*) FROM candidates WHERE job = ? AND status = 'done' AND finished >= ?",
                           (row.id, since))[0][0]
        return count / max(1e-3, now - since)

    # -- candidates ---------------------------------------------------------------------------------------------
    def pending(self, job: str, after: tuple[int, int], limit: int) -> list[Candidate]:
        """Up to `limit` pending candidates of `job` after (item, k), in order."""
        rows = self._read("SELECT c.item, c.k, c.seed, i.body FROM candidates c JOIN items i ON i.job = c.job AND "
                          "i.item = c.item WHERE c.job = ? AND c.status = 'pending' AND (c.item, c.k) > (?, ?) "
                          "ORDER BY c.item, c.k LIMIT ?", (job, after[0], after[1], limit))
        bodies: dict[int, dict[str, Any]] = {}
        return [Candidate(job, item, k, seed, bodies.setdefault(item, json.loads(body)))
                for item, k, seed, body in rows]

    def image_path(self, job: str, item: int, k: int) -> str:
        return os.path.join(self.images, job, image_name(item, k))

    def store_image(self, c: Candidate, data: bytes, now: float | None = None) -> None:
        """Writes the candidate's image (files.py's order), then commits it as done. ImageWriteError when the image
        cannot be written (the candidate stays pending: the caller fails it); StoreError when the commit fails."""
        path = self.image_path(c.job, c.item, c.k)
        write_image(path, data)
        self._done(c, path, len(data), now)

    def adopt(self, c: Candidate, expected: dict[str, Any] | None) -> bool:
        """A pending candidate whose image is already stored (a crash after the rename, before the commit): marked
        done when the file decodes with the candidate's settings (`expected`); otherwise the file is removed."""
        path = self.image_path(c.job, c.item, c.k)
        if not os.path.exists(path):
            return False
        if matches(path, expected):
            self._done(c, path, os.path.getsize(path), None)
            return True
        try:
            os.unlink(path)
        except OSError:
            pass
        return False

    def _done(self, c: Candidate, path: str, size: int, now: float | None) -> None:
        with self._write() as db:
            changed = db.execute("UPDATE candidates SET status = 'done', finished = ? WHERE job = ? AND item = ? AND "
                                 "k = ? AND status = 'pending'", (time.time() if now is None else now, *c.key)).rowcount
            if changed:
                db.execute("UPDATE jobs SET done = done + 1, bytes = bytes + ? WHERE id = ?", (size, c.job))
            exists = changed or db.execute("SELECT 1 FROM jobs WHERE id = ?", (c.job,)).fetchone() is not None
        if not exists:  # the job was deleted while its image was made: nothing may be left of it
            try:
                os.unlink(path)
                os.rmdir(os.path.dirname(path))
            except OSError:
                pass

    def fail(self, c: Candidate, error: str, now: float | None = None) -> None:
        with self._write() as db:
            changed = db.execute("UPDATE candidates SET status = 'failed', error = ?, finished = ? WHERE job = ? AND "
                                 "item = ? AND k = ? AND status = 'pending'",
                                 (error, time.time() if now is None else now, *c.key)).rowcount
            if changed:
                db.execute("UPDATE jobs SET failed = failed + 1 WHERE id = ?", (c.job,))

    def results(self, job: str, offset: int, limit: int) -> list[ItemResult]:
        """Items offset..offset+limit-1: each candidate's seed, status and error."""
        prompts = {item: json.loads(body).get("prompt") for item, body in self._read(
            "SELECT item, body FROM items WHERE job = ? AND item >= ? AND item < ? ORDER BY item",
            (job, offset, offset + limit))}
        rows: dict[int, list[tuple]] = {item: [] for item in prompts}
        for item, seed, status, error in self._read(
                "SELECT item, seed, status, error FROM candidates WHERE job = ? AND item >= ? AND item < ? ORDER BY "
                "item, k", (job, offset, offset + limit)):
            rows[item].append((seed, status, error))
        return [ItemResult(item, prompts[item], tuple(r[0] for r in cs), tuple(r[1] for r in cs),
                           tuple(r[2] for r in cs)) for item, cs in rows.items()]


def _check_quota(db: sqlite3.Connection, owner: str, limits: KeyLimits, size: int) -> None:
    held, kept = db.execute(f"SELECT count(*) FILTER (WHERE status IN {HELD}), coalesce(sum(bytes), 0) FROM jobs "
                            "WHERE owner = ?", (owner,)).fetchone()
    if held >= limits.jobs:
        raise QuotaError(f"this API key has {held} unfinished jobs; at most {limits.jobs} at once (--max-key-jobs): "
                         "submit this one when one ends, or cancel one", 429)
    if kept + size > limits.bytes:
        raise QuotaError(f"this API key's jobs keep {kept} bytes and this one needs {size} more; at most "
                         f"{limits.bytes} a key (--max-key-bytes): delete finished jobs (DELETE /v1/jobs/ID) or wait "
                         "until they expire", 507)


def _chunks(rows: Iterator[tuple], size: int) -> Iterator[list[tuple]]:
    chunk: list[tuple] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
