"""AUTOMATIC1111's model hashes (the sha256 of a file), computed off the caller's thread and kept across starts.

`FileHashes(cache_root)` owns one background thread (started on first need, named "diffgraph-hash") that reads
files whole, one at a time: a 7 GB checkpoint takes about a minute, so nothing that answers a client may wait for
it. `get(path)` answers at once: the hash of the file's current version when known, else None, having queued the
file for hashing (a listing shows null, then the hash once known). `short(path)` is A1111's short form (the first
10 hex digits). `compute(path)` hashes on the calling thread (`diffgraph models --dir --hashes`, which asked to wait).

A file's version is (size, mtime_ns, inode): a file rewritten in place or replaced under its name is hashed again,
and a hash read while the file changed is refused (`FileChanged`), never stored. Hashes are kept in memory and in
`cache_root`/hashes.json (by real path; rewritten whole through a temporary file, merged with what other processes
wrote meanwhile), so a restart hashes nothing it hashed before. A folder has no hash (A1111 hashes none). Standard
library only (the HTTP process uses this).

For an infotext (AUTOMATIC1111's `Model hash`, `Lora hashes`): `model(path)` is `short` (None until hashed: a
request never waits for a checkpoint's hash; the server queues the default model's at start), `lora(path)` a LoRA
file's 12 hex digits, `sshs_model_hash` from its safetensors metadata where it has one, else kohya-ss's "addnet" hash
(the sha256 of the file after its header), which AUTOMATIC1111 reads; adapter files are small, so that is hashed on
the caller's thread once per version.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
from collections import deque
from typing import Any, Callable

from ..safe_files import FileChanged, UnusableFile, check_regular, read_json

logger = logging.getLogger(__name__)

HASH_CACHE = "hashes.json"
HASH_CHUNK = 1 << 20
MAX_FILE_BYTES = 1 << 40
MAX_CACHE_BYTES = 16 << 20
SHORT = 10  # hex digits of A1111's short hash
LORA_SHORT = 12  # ... of its LoRA hashes

Version = tuple[int, int, int]  # size, mtime_ns, inode
Reader = Callable[[str, os.stat_result], str]


def version_of(st: os.stat_result) -> Version:
    return st.st_size, st.st_mtime_ns, st.st_ino


def sha256_of(path: str, st: os.stat_result, offset: int = 0) -> str:
    """The sha256 of the regular file `st` describes (from byte `offset` on), read in 1 MiB chunks. Raises
    FileChanged when it was removed, replaced or written meanwhile, UnusableFile when it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in after the stat: no block
    except FileNotFoundError:
        raise FileChanged(f"{path} was removed while it was hashed; list the folder again") from None
    except OSError as e:
        raise UnusableFile(f"{path} cannot be opened ({e.strerror or e}); check its permissions") from None
    try:
        digest, opened = hashlib.sha256(), os.fstat(fd)
        if stat.S_ISREG(opened.st_mode) and offset:
            os.lseek(fd, offset, os.SEEK_SET)
        while stat.S_ISREG(opened.st_mode) and (chunk := os.read(fd, HASH_CHUNK)):
            digest.update(chunk)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(opened.st_mode) or (opened.st_ino, *version_of(after)[:2]) != \
            (st.st_ino, st.st_size, st.st_mtime_ns):
        raise FileChanged(f"{path} was replaced or written while it was hashed; hash it again")
    return digest.hexdigest()


class FileHashes:
    """sha256 of files by version, hashed on one background thread; see the module docstring."""

    def __init__(self, cache_root: str, read: Reader | None = None):
        self.cache_root = cache_root
        self._read = read or sha256_of  # the hashing itself (tests inject a slow or counting one)
        self._lock = threading.Lock()
        self._known: dict[str, tuple[Version, str]] | None = None  # real path -> version, hex; loaded on first use
        self._failed: dict[str, Version] = {}  # versions that could not be hashed: not retried until they change
        self._queued: set[str] = set()
        self._todo: deque[str] = deque()
        self._worker: threading.Thread | None = None
        self._loras: dict[str, tuple[Version, str | None]] = {}  # real path -> version, its LoRA hash

    @property
    def cache_file(self) -> str:
        return os.path.join(self.cache_root, HASH_CACHE)

    def get(self, path: str) -> str | None:
        """The file's sha256 (hex) if its current version was hashed, else None with the file queued for hashing.
        Never reads the file on this thread (a stat, and the cache file once per process)."""
        found = self._current(path)
        if found is None:
            return None
        key, version, digest = found
        if digest is None:
            self._enqueue(key, version)
        return digest

    def short(self, path: str) -> str | None:
        """A1111's short model hash of the file (`get`'s first 10 hex digits), or None while unknown."""
        digest = self.get(path)
        return digest[:SHORT] if digest else None

    def model(self, path: str | None) -> str | None:
        """A checkpoint file's `Model hash` (`short`); None for a folder, a preset name or while not yet hashed."""
        return self.short(path) if path and os.path.exists(path) else None

    def lora(self, path: str | None) -> str | None:
        """A LoRA file's `Lora hashes` entry (see the module docstring); None where it cannot be read."""
        if not path:
            return None
        try:
            key = os.path.realpath(path)
            version = version_of(check_regular(key, MAX_FILE_BYTES))
        except (UnusableFile, OSError, ValueError):
            return None
        with self._lock:
            hit = self._loras.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        try:
            digest: str | None = lora_hash(key)[:LORA_SHORT]
        except (UnusableFile, OSError) as e:  # changed while read, or unreadable: no hash this time
            logger.warning("cannot hash %s: %s", key, e)
            digest = None
        with self._lock:
            self._loras[key] = (version, digest)
        return digest

    def compute(self, path: str) -> str | None:
        """The file's sha256, hashed on this thread when not known; None for a folder. Raises UnusableFile (not a
        regular file, unreadable) and FileChanged (written, replaced or removed while it was hashed)."""
        if os.path.isdir(path):
            return None
        key = os.path.realpath(path)
        st = check_regular(key, MAX_FILE_BYTES)
        known = self._lookup(key, version_of(st))
        return known if known is not None else self._hash(key, st)

    def _current(self, path: str) -> tuple[str, Version, str | None] | None:
        """(real path, version, known hash or None) of a regular file; None for anything else (no hash, no work)."""
        if os.path.isdir(path):
            return None
        key = os.path.realpath(path)
        try:
            version = version_of(check_regular(key, MAX_FILE_BYTES))
        except UnusableFile:
            return None
        return key, version, self._lookup(key, version)

    def _lookup(self, key: str, version: Version) -> str | None:
        with self._lock:
            if self._known is None:
                self._known = _read_cache(self.cache_file)
            hit = self._known.get(key)
        return hit[1] if hit is not None and hit[0] == version else None

    def _enqueue(self, key: str, version: Version) -> None:
        with self._lock:
            if key in self._queued or self._failed.get(key) == version:
                return
            self._queued.add(key)
            self._todo.append(key)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="diffgraph-hash", daemon=True)
                self._worker.start()

    def _work(self) -> None:
        while True:
            with self._lock:  # the queue and the worker's end under one lock: a file queued is always picked up
                if not self._todo:
                    self._worker = None
                    return
                key = self._todo.popleft()
            st = None
            try:
                st = check_regular(key, MAX_FILE_BYTES)
                if self._lookup(key, version_of(st)) is None:
                    self._hash(key, st)
            except (OSError, ValueError) as e:
                logger.warning("hashing %s failed: %s", key, e)
                with self._lock:
                    if st is not None:
                        self._failed[key] = version_of(st)
            finally:
                with self._lock:
                    self._queued.discard(key)

    def _hash(self, key: str, st: os.stat_result) -> str:
        digest = self._read(key, st)
        with self._lock:
            assert self._known is not None
            self._known[key] = (version_of(st), digest)
            self._failed.pop(key, None)
        self._save(key, version_of(st), digest)
        return digest

    def _save(self, key: str, version: Version, digest: str) -> None:
        """Adds one hash to the cache file, merged with what it holds now (another process may have added hashes)."""
        cache = {k: {"version": list(v), "sha256": d} for k, (v, d) in _read_cache(self.cache_file).items()}
        cache[key] = {"version": list(version), "sha256": digest}
        tmp = None
        try:
            os.makedirs(self.cache_root, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{HASH_CACHE}-", dir=self.cache_root)
            with os.fdopen(fd, "w") as f:
                json.dump(cache, f)
            os.replace(tmp, self.cache_file)  # writers race harmlessly: the last one's file wins, whole
        except OSError as e:
            logger.warning("cannot write the hash cache %s (%s); hashes are recomputed next time", self.cache_file, e)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def wait_idle(self, timeout: float) -> bool:
        """Whether the queue emptied within `timeout` seconds (for callers that must have the hashes: tests, tools)."""
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.join(timeout)
        with self._lock:
            return not self._queued


def _read_cache(cache_file: str) -> dict[str, tuple[Version, str]]:
    """The cache file's entries that are well formed; a missing or damaged file is empty (rewritten on a hash)."""
    try:
        data: Any = read_json(cache_file, MAX_CACHE_BYTES)[0]
    except UnusableFile:
        return {}
    out: dict[str, tuple[Version, str]] = {}
    for key, hit in (data.items() if isinstance(data, dict) else ()):
        v = hit.get("version") if isinstance(hit, dict) else None
        digest = hit.get("sha256") if isinstance(hit, dict) else None
        if isinstance(v, list) and len(v) == 3 and all(type(x) is int for x in v) and isinstance(digest, str):
            out[key] = ((v[0], v[1], v[2]), digest)
    return out


def lora_hash(path: str) -> str:
    """A LoRA file's hash as AUTOMATIC1111 reads it: `sshs_model_hash` from its metadata, else the sha256 of its
    tensors (the file after its header). Raises UnusableFile (FileChanged among them)."""
    from ..safe_files import read_header

    header, _ = read_header(path, MAX_FILE_BYTES)
    given = str(header.metadata.get("sshs_model_hash", "")).strip()
    return given or sha256_of(path, os.stat(path), header.data_start)
