"""AUTOMATIC1111's hashes of the files a request uses, for its infotext and the answers that name them:

- a checkpoint: the sha256 of the whole file (`catalog.full_hash`, kept in the cache folder's hashes.json, so a
  restart reads no file again); its `Model hash` is the first 10 hex digits (AUTOMATIC1111's short hash);
- a LoRA: `sshs_model_hash` where its safetensors metadata holds one, else kohya-ss's "addnet" hash, the sha256 of
  the file after its header (AUTOMATIC1111 reads its LoRAs' hashes so); its `Lora hashes` take the first 12 hex digits.

Folders and presets have no such file and no hash (None): AUTOMATIC1111's hashes name a file that tools (civitai,
its own checkpoint lookup) can find, and a hash of something else would name nothing they know.

`FileHashes` keeps them in memory by file version (real path, size, mtime, inode): a file is read once per version
however many requests name it (one reader at a time per file; the others wait for its answer), and a file replaced
under its name is read again. Reads happen on the caller's thread: the server calls it from its worker threads.
Standard library only.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from typing import Callable

from ..lora.catalog import MAX_ADAPTER_BYTES
from ..safe_files import UnusableFile, read_header
from .catalog import full_hash, tail_hash

logger = logging.getLogger(__name__)

MODEL_HASH_DIGITS, LORA_HASH_DIGITS = 10, 12  # AUTOMATIC1111's short hashes: a checkpoint's, a LoRA's

Version = tuple[str, str, int, int, int]  # (kind, real path, size, mtime_ns, inode)


def lora_hash(path: str) -> str:
    """A LoRA file's hash as AUTOMATIC1111 reads it (see the module doc). Raises UnusableFile."""
    header, _ = read_header(path, MAX_ADAPTER_BYTES)
    given = header.metadata.get("sshs_model_hash", "").strip()
    return given or tail_hash(path, header.data_start)


class FileHashes:
    def __init__(self, cache_root: str):
        self.cache_root = cache_root
        self._known: dict[Version, str | None] = {}
        self._readers: dict[Version, threading.Lock] = {}
        self._lock = threading.Lock()

    def model(self, path: str | None) -> str | None:
        """A checkpoint file's short hash (`Model hash`); None for a folder, a preset name or a file that cannot be
        read."""
        digest = self._get("model", path, lambda real: full_hash(real, self.cache_root))
        return digest[:MODEL_HASH_DIGITS] if digest else None

    def lora(self, path: str | None) -> str | None:
        """A LoRA file's short hash (its `Lora hashes` entry); None where it cannot be read."""
        digest = self._get("lora", path, lora_hash)
        return digest[:LORA_HASH_DIGITS] if digest else None

    def _get(self, kind: str, path: str | None, compute: Callable[[str], str | None]) -> str | None:
        if not path:
            return None
        try:
            real = os.path.realpath(path)
            st = os.stat(real)
        except (OSError, ValueError):
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        version = (kind, real, st.st_size, st.st_mtime_ns, st.st_ino)
        with self._lock:
            if version in self._known:
                return self._known[version]
            reader = self._readers.setdefault(version, threading.Lock())
        with reader:  # one read per version: a second request for it waits for the first one's answer
            with self._lock:
                if version in self._known:
                    return self._known[version]
            try:
                value = compute(real)
            except (UnusableFile, OSError) as e:  # changed while it was read, or unreadable: no hash this time
                logger.warning("cannot hash %s: %s", real, e)
                value = None
            with self._lock:
                self._readers.pop(version, None)
                if value is not None:  # the file's older versions are forgotten
                    self._known = {v: h for v, h in self._known.items() if v[:2] != version[:2]}
                    self._known[version] = value
        return value
