"""Reading files that someone else may rewrite, replace or fake while we read them: small files whole (`read_file`,
`read_json`), safetensors headers (`read_header`), the open file that `safe_tensors` streams weights from
(`OpenFile`, `checked_header`), and model folders' weights for libraries that want a path (`private_view`). JSON
read from a user's folder (configs, model indexes, safetensors headers) goes through `parse_json`, which bounds its
nesting: a file of 200,000 brackets is an UnusableFile, never a RecursionError in whatever lists it. A folder whose
JSON a library parses itself (tokenizers, configs: `from_pretrained`) has every JSON file checked first
(`bad_json_file`).

A memory-mapped file whose pages a writer truncates kills the process with SIGBUS, so nothing here maps a file:
`read_file` copies the bytes into memory (a private copy that no writer can touch), `OpenFile.readinto` reads into
the caller's buffer, and `read_header` reads a safetensors header without the tensors. Before anything is opened,
`check_regular` refuses by type (FIFOs, which block an open for reading; devices; sockets; dangling links) and by
size (a 1 TB sparse file); the open itself is non-blocking and checked to be the file that was looked at. A file that changes while it is
read (its size or mtime moves, it grows past its size, a read comes up short) raises `FileChanged`: callers read
it again, or report it. `FileStamp` (size, mtime_ns, inode, device) is the version that was read, for caches.

Libraries that insist on a path and map what it names (diffusers' and transformers' `from_pretrained` for folders
with only pickle weights) are given `private_view(folder, copies)`: a temporary folder of links to the original
files, where the weights files are links to private copies (`private_copy`: an anonymous in-memory file, Linux's
memfd, that nobody else can open). They map the copy, which no writer of the original can cut, and keep their own
reading rules (variants, shards, formats); the copy costs host memory of the file's size while they load.

`FileReader` runs reads on a small pool of its own, with a time limit per call, so a stalled disk neither takes
the caller's threads nor blocks shutdown (daemon threads). It owns its threads; nothing here is module state.
Only the standard library is imported: the HTTP process, which never imports torch, uses this too.
"""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import stat
import struct
import tempfile
import threading
from concurrent.futures import CancelledError, Future, TimeoutError as FutureTimeout
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

HEADER_LIMIT = 100 << 20       # safetensors' own limit on its JSON header
JSON_DEPTH = 64                # nesting of JSON read from a user's folder (diffusers' configs nest 3 deep)
JSON_FILE_LIMIT = 256 << 20    # one JSON file of a model folder (a large vocabulary's tokenizer.json: tens of MB)
MAX_TENSORS = 1 << 20          # tensors of one safetensors header (an SDXL checkpoint has ~2,500)
MAX_DIMS = 16                  # dimensions of one tensor (safetensors' own files have at most 5)
MAX_KEY_CHARS = 1 << 12        # a tensor's name, its dtype
FILE_LIMIT = 1 << 40           # bytes per weights file (a 1 TB sparse file is refused by its size, before it is read)
CHUNK = 1 << 30                # one read call (Linux reads at most ~2 GiB at a time)
COPY_CHUNK = 64 << 20          # one write into a private copy (bounds the copy's transient memory)
IDLE_S = 30.0                  # a FileReader thread idle this long leaves
KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
              "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8, "C128": 16}


class UnusableFile(ValueError):
    """A file refused by type, size or contents; the message (a phrase after the file's name) says why."""


class FileChanged(UnusableFile):
    """The file changed while it was read: read it again for its new version."""


class NotSafetensors(UnusableFile):
    """A regular file whose bytes are not a whole safetensors file (truncated, still being written, foreign)."""


class NotJson(UnusableFile):
    """Bytes that are not JSON, or that nest deeper than the limit; `why` is the phrase without the advice."""

    def __init__(self, why: str):
        super().__init__(f"{why}: copy or download it again")
        self.why = why

    def __reduce__(self):  # picklable (across a replica process boundary)
        return (type(self), (self.why,))


class ReadTimeout(UnusableFile):
    """A read on a `FileReader` did not finish within its time limit."""


class FileStamp(NamedTuple):
    size: int
    mtime_ns: int
    inode: int
    device: int


def parse_json(data: bytes | str, max_depth: int = JSON_DEPTH) -> Any:
    """`data` parsed as JSON, refused when it is not JSON or nests deeper than `max_depth` (lists and objects). Raises
    NotJson, whose message is a phrase after the file's name, as the other refusals here."""
    try:
        value = json.loads(data)
    except RecursionError:  # (the decoder recurses per level: far past max_depth, before any value exists)
        value = None
        depth = max_depth + 1
    except (UnicodeDecodeError, ValueError) as e:
        raise NotJson(f"is not valid JSON ({e})") from None
    else:
        depth = _depth(value, max_depth)
    if depth > max_depth:
        raise NotJson(f"nests JSON deeper than {max_depth} levels (the limit for this file; a damaged or hostile one)")
    return value


def _depth(value: Any, max_depth: int) -> int:
    """The nesting depth of parsed JSON, counted without recursion; it stops once past `max_depth`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > max_depth:
                break
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)
                         if isinstance(v, (dict, list)))
    return deepest


def read_json(path: str, max_bytes: int) -> tuple[Any, FileStamp]:
    """The JSON file at `path` parsed (`parse_json`), and the version read. Raises UnusableFile / FileChanged."""
    data, stamp = read_file(path, max_bytes)
    return parse_json(data), stamp


def bad_json_file(folder: str, cache: dict[str, tuple[FileStamp, UnusableFile | None]] | None = None,
                  max_bytes: int = JSON_FILE_LIMIT) -> tuple[str, UnusableFile] | None:
    """The first `*.json` file under `folder` (subfolders too, sorted; links to folders not followed) that `read_json`
    refuses (nested too deep, not JSON, too large, not a regular file): its path relative to `folder` ("/" between
    folders) and the refusal; None when every one parses. A folder goes to a library that parses its JSON without a
    depth limit (transformers' and diffusers' `from_pretrained`, tokenizers: a RecursionError) only after this.
    `cache`: path -> (the version parsed, its refusal or None), so that a listing parses a file once per version."""
    for here, dirs, files in os.walk(folder, followlinks=False):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".json")):
            path = os.path.join(here, name)
            try:
                stamp = stamp_of(os.stat(path))
            except OSError:  # removed meanwhile, or a dangling link: whoever reads it names it
                continue
            kept = cache.get(path) if cache is not None else None
            if kept is not None and kept[0] == stamp:
                why = kept[1]
            else:
                try:
                    read_json(path, max_bytes)
                    why = None
                except UnusableFile as e:
                    why = e
                if cache is not None:
                    cache[path] = (stamp, why)
            if why is not None:
                return os.path.relpath(path, folder).replace(os.sep, "/"), why
    return None


def stamp_of(st: os.stat_result) -> FileStamp:
    return FileStamp(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def check_regular(path: str, max_bytes: int) -> os.stat_result:
    """The stat of `path` if it is a regular file (links followed) of at most `max_bytes`; never opens it. Raises
    UnusableFile naming what it is instead."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise UnusableFile(f"is a dangling link (to {os.readlink(path)!r}, which does not exist)") from None
        raise UnusableFile("does not exist") from None
    except OSError as e:
        raise UnusableFile(f"cannot be looked at ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in KINDS if test(st.st_mode)), "not a regular file")
        raise UnusableFile(f"is {kind}, not a regular file; only regular files are read")
    if st.st_size > max_bytes:
        raise UnusableFile(f"has {st.st_size} bytes, above the limit of {max_bytes} ({max_bytes >> 20} MiB)")
    return st


class OpenFile:
    """A regular file opened without blocking, checked to be the one `check_regular` looked at; `read` and
    `readinto` read at an offset, `unchanged` checks the open file against the stat taken before it was opened."""

    def __init__(self, path: str, max_bytes: int):
        self.path = path
        self.st = check_regular(path, max_bytes)
        # O_NONBLOCK: should a FIFO take the file's place after the stat, the open still returns at once
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
        except FileNotFoundError:
            raise FileChanged("was removed while it was opened") from None
        except OSError as e:
            raise UnusableFile(f"cannot be opened ({e.strerror or e})") from None
        try:
            now = os.fstat(self.fd)
            if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (self.st.st_dev, self.st.st_ino):
                raise FileChanged("was replaced while it was opened")
        except BaseException:
            os.close(self.fd)
            raise

    @property
    def size(self) -> int:
        return self.st.st_size

    def read(self, n: int, offset: int) -> bytes:
        """Exactly n bytes at offset; FileChanged when the file ends first (it was cut while read)."""
        parts, got = [], 0
        while got < n:
            part = os.pread(self.fd, min(n - got, CHUNK), offset + got)
            if not part:
                raise FileChanged("got shorter while it was read")
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readinto(self, view: memoryview, offset: int) -> None:
        """Fills the writable byte buffer `view` with the bytes at offset, straight from the kernel where the
        system has preadv (no intermediate bytes object); FileChanged when the file ends first."""
        got, n = 0, len(view)
        while got < n:
            part = view[got:got + min(n - got, CHUNK)]
            if hasattr(os, "preadv"):
                count = os.preadv(self.fd, [part], offset + got)
            else:
                data = os.pread(self.fd, len(part), offset + got)
                count = len(data)
                part[:count] = data
            if not count:
                raise FileChanged("got shorter while it was read")
            got += count

    def unchanged(self, whole: bool = False) -> FileStamp:
        """The stamp read, once the file is checked to be as it was when opened (and, `whole`, not longer)."""
        now = os.fstat(self.fd)
        if (now.st_size, now.st_mtime_ns) != (self.st.st_size, self.st.st_mtime_ns) or \
                (whole and os.pread(self.fd, 1, self.st.st_size)):
            raise FileChanged("changed while it was read")
        return stamp_of(self.st)

    def unchanged_in_place(self) -> FileStamp:
        """`unchanged(whole=True)`, and the path still names the file that was opened (not removed, not replaced)."""
        stamp = self.unchanged(whole=True)
        try:
            now = os.stat(self.path)
        except OSError:
            raise FileChanged("was removed while it was read") from None
        if (now.st_dev, now.st_ino) != (self.st.st_dev, self.st.st_ino):
            raise FileChanged("was replaced while it was read")
        return stamp

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "OpenFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_file(path: str, max_bytes: int) -> tuple[bytes, FileStamp]:
    """The whole file as a private copy, and the version read. Raises UnusableFile / FileChanged."""
    with OpenFile(path, max_bytes) as f:
        data = f.read(f.size, 0)
        return data, f.unchanged(whole=True)


def read_toml(path: str, max_bytes: int) -> tuple[dict[str, Any], FileStamp]:
    """A small TOML file's table (sidecars), and the version read. Raises UnusableFile (also for text that is not
    TOML: "is not TOML (why); fix or remove it") / FileChanged."""
    import tomllib

    data, stamp = read_file(path, max_bytes)
    try:
        return tomllib.loads(data.decode("utf-8")), stamp
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UnusableFile(f"is not TOML ({str(e).splitlines()[0][:100]}); fix or remove it") from None


def read_sidecar_table(path: str, max_bytes: int, allowed: Sequence[str],
                       error: type[ValueError] = ValueError) -> tuple[str, dict[str, Any], FileStamp] | None:
    """A sidecar's (file name, TOML table, version read), or None where there is no file at `path`. An unusable file
    or a key outside `allowed` is a one-line `error` naming the sidecar."""
    if not os.path.lexists(path):
        return None
    name = os.path.basename(path)
    try:
        table, stamp = read_toml(path, max_bytes)
    except UnusableFile as e:
        raise error(f"sidecar {name} {e}") from None
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise error(f"sidecar {name} has unknown key {unknown[0]!r}; allowed: {', '.join(allowed)}")
    return name, table, stamp


@dataclass(frozen=True)
class TensorInfo:
    dtype: str                 # safetensors' name: "F16", "BF16", "F32", "I64", ...
    shape: tuple[int, ...]
    begin: int                 # byte offsets in the data section
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int            # the data section's offset in the file
    stamp: FileStamp


def read_header(path: str, max_bytes: int, small_bytes: int = 0) -> tuple[SafetensorsHeader, dict[str, bytes]]:
    """A safetensors file's header, checked against the file's size, without its tensors; and the bytes of the
    tensors of at most `small_bytes` (scalars such as LoRA alphas). Raises UnusableFile / FileChanged."""
    with OpenFile(path, max_bytes) as f:
        header = checked_header(f)
        small = {key: f.read(t.end - t.begin, header.data_start + t.begin) for key, t in header.tensors.items()
                 if 0 < t.end - t.begin <= small_bytes}
        f.unchanged()
        return header, small


def checked_header(f: OpenFile) -> SafetensorsHeader:
    """The safetensors header of the open file, checked against its size (bounded: tensors, dimensions, names; data
    offsets that tile the data section exactly, as safetensors' own reader demands). Raises NotSafetensors, or
    FileChanged when the file moved while its header was read."""
    try:
        return _header(f)
    except NotSafetensors:
        f.unchanged()  # a file being written reads as a truncated one: FileChanged when it moved meanwhile
        raise


def _header(f: OpenFile) -> SafetensorsHeader:
    if f.size < 8:
        raise NotSafetensors(f"is not a readable safetensors file ({f.size} bytes, too few): it may be truncated; "
                             "copy it again")
    (n,) = struct.unpack("<Q", f.read(8, 0))
    if not 2 <= n <= min(HEADER_LIMIT, f.size - 8):
        raise NotSafetensors(f"is not a readable safetensors file (its header length {n} does not fit its {f.size} "
                             "bytes): it may be truncated; copy it again")
    try:
        raw = parse_json(f.read(n, 8), max_depth=3)  # {name: {"shape": [...]}}; __metadata__: {name: "text"}
    except NotJson as e:
        raise NotSafetensors(f"is not a readable safetensors file (its header {e.why}): it may be truncated or still "
                             "being written; copy it again") from None
    if not isinstance(raw, dict):
        raise NotSafetensors("is not a readable safetensors file (its header is not a JSON object)")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):  # (as safetensors)
        raise NotSafetensors("is not a readable safetensors file (its __metadata__ is not a map of strings)")
    if len(raw) > MAX_TENSORS:
        raise NotSafetensors(f"is not a readable safetensors file (its header lists {len(raw)} tensors, above the "
                             f"limit of {MAX_TENSORS})")
    tensors = {key: _tensor(key, entry) for key, entry in raw.items()}
    _check_offsets(tensors, f.size - 8 - n, f.size)
    return SafetensorsHeader(tensors, metadata, 8 + n, stamp_of(f.st))


def _check_offsets(tensors: dict[str, TensorInfo], room: int, size: int) -> None:
    """The tensors' data offsets tile the data section (`room` bytes) exactly: no overlap, no gap, nothing past the
    file's end, nothing after the last tensor (safetensors' own rule)."""
    expected, previous = 0, None
    for key, t in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if t.end > room:
            raise NotSafetensors(f"is not a readable safetensors file (tensor {key[:200]!r} ends at byte "
                                 f"{size - room + t.end}, past the file's end at {size}): it is truncated or still "
                                 "being written; copy it again")
        if t.begin != expected:
            what = f"overlaps tensor {previous[:200]!r}" if t.begin < expected else \
                f"starts {t.begin - expected} bytes after the tensor before it"
            raise NotSafetensors(f"is not a readable safetensors file (tensor {key[:200]!r} {what} in its data "
                                 "section): it was written wrongly; save or download it again")
        expected, previous = t.end, key
    if expected != room:
        raise NotSafetensors(f"is not a readable safetensors file ({size} bytes, its header describes "
                             f"{size - room + expected}): it is damaged or was written wrongly; copy it again")


def _tensor(key: str, entry: Any) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        ok = isinstance(dtype, str) and len(dtype) <= MAX_KEY_CHARS and len(key) <= MAX_KEY_CHARS and \
            isinstance(shape, list) and len(shape) <= MAX_DIMS and all(type(d) is int and d >= 0 for d in shape) \
            and type(begin) is int and type(end) is int and 0 <= begin <= end
        shape = tuple(shape)
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise NotSafetensors(f"is not a readable safetensors file (tensor {key[:200]!r} has a malformed header entry: "
                             f"a dtype, at most {MAX_DIMS} dimensions, data offsets; names of at most "
                             f"{MAX_KEY_CHARS} characters)")
    t = TensorInfo(dtype, shape, begin, end)
    size = ITEM_BYTES.get(dtype)
    if size is not None and t.numel * size != end - begin:
        raise NotSafetensors(f"is not a readable safetensors file (tensor {key!r}: {dtype} {list(shape)} is "
                             f"{t.numel * size} bytes, its offsets span {end - begin}): it was written wrongly; "
                             "save or download it again")
    return t


def private_copy(path: str, max_bytes: int) -> tuple[int, FileStamp]:
    """A private copy of the file, as an open descriptor the caller closes, and the version copied: an anonymous
    in-memory file (memfd) where Linux has one, else an unlinked temporary file. No other process can open it, so a
    map of it cannot lose its pages to a writer of the original. A `.safetensors` file's header is checked before
    its body is copied. Raises UnusableFile / FileChanged / NotSafetensors."""
    with OpenFile(path, max_bytes) as f:
        if path.endswith(".safetensors"):
            checked_header(f)
        fd = _anonymous_file(os.path.basename(path))
        try:
            offset = 0
            while offset < f.size:
                part = memoryview(f.read(min(COPY_CHUNK, f.size - offset), offset))
                offset += len(part)
                while part:
                    part = part[os.write(fd, part):]
            return fd, f.unchanged(whole=True)
        except BaseException:
            os.close(fd)
            raise


def _anonymous_file(name: str) -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create(f"diffgraph-{name}", os.MFD_CLOEXEC)
    fd, path = tempfile.mkstemp(prefix="diffgraph-")
    os.unlink(path)  # reachable through the descriptor only
    return fd


def fd_path(fd: int) -> str:
    """A path that opens the file behind this process's descriptor `fd` (what a library that wants a path gets)."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


@contextmanager
def private_view(folder: str, copies: Iterable[str], omit: Iterable[str] = (), max_bytes: int = 1 << 40,
                 on_error: Callable[[str, UnusableFile], BaseException] | None = None) -> Iterator[str]:
    """A temporary folder that mirrors `folder` by links (to the originals), except that the files in `copies`
    (paths relative to `folder`) link to private copies (`private_copy`) and those in `omit` are left out. Read
    through it while the block runs; the folder and the descriptors go when it ends (maps of the copies stay valid:
    a map keeps its file's pages). A file that cannot be copied raises `on_error(relative path, error)`, or the
    UnusableFile itself."""
    copies, omit = set(copies), set(omit)
    view = tempfile.mkdtemp(prefix="diffgraph-view-")
    fds: list[int] = []
    try:
        root = os.path.abspath(folder)
        for here, _dirs, files in os.walk(root, followlinks=True):  # (a hub cache links its folders)
            rel_dir = os.path.relpath(here, root)
            target_dir = view if rel_dir == "." else os.path.join(view, rel_dir)
            os.makedirs(target_dir, exist_ok=True)
            for name in files:
                rel = os.path.normpath(os.path.join(rel_dir, name))
                if rel in omit:
                    continue
                source = os.path.join(here, name)
                if rel in copies:
                    try:
                        fd, _ = private_copy(source, max_bytes)
                    except UnusableFile as e:
                        raise (on_error(rel, e) if on_error else e) from None
                    fds.append(fd)
                    source = fd_path(fd)
                os.symlink(source, os.path.join(target_dir, name))
        yield view
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(view, ignore_errors=True)


def fsync_folder(folder: str) -> None:
    """Makes a folder's entries (a rename into it, a new file) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, data: bytes, temp: str, sync: bool = True) -> None:
    """Writes `data` at `path` so that a reader sees the old file or the whole new one: to `temp` (a name of the same
    folder), then os.replace; with `sync`, the file is fsynced before the rename and the folder after it, so a crash
    once this returns loses nothing. Raises OSError, `temp` removed."""
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
        if sync:
            fsync_folder(os.path.dirname(path) or ".")
    except OSError:
        with suppress(OSError):
            os.unlink(temp)
        raise


class FileReader:
    """A bounded pool of daemon threads for file reads, with a time limit per call (queueing included).

        reader = FileReader(workers=2, timeout=60)
        data = reader.call(read_file, path, limit, what="reading x.safetensors")   # ReadTimeout past 60 s
        data = reader.once(key, read_file, path, limit)   # callers asking for one key at once share one read

    Threads start on first use and leave when idle; a call that times out leaves its read running (a stalled disk
    cannot be interrupted) and its result unused."""

    def __init__(self, workers: int = 2, timeout: float = 60.0, name: str = "diffgraph-files"):
        if workers < 1 or not timeout > 0:
            raise ValueError(f"FileReader needs workers >= 1 and a positive timeout (got {workers}, {timeout})")
        self.workers, self.timeout, self.name = workers, timeout, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._once: dict[Any, Future] = {}
        self._lock = threading.RLock()  # (a future done at once runs its callback, which takes it, on this thread)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:  # (a thread leaving when idle checks the queue under this lock)
            if len(self._threads) < self.workers:
                t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._queue.put((future, fn, args))
        return future

    def wait(self, future: Future, what: str) -> Any:
        """The future's result within the time limit; ReadTimeout (the read is cancelled if it has not begun)."""
        try:
            return future.result(self.timeout)
        except (FutureTimeout, CancelledError):  # (cancelled: another caller waiting on it timed out)
            future.cancel()
            raise ReadTimeout(f"{what} took longer than {self.timeout:g} s (a slow or stalled disk?); retry") \
                from None

    def call(self, fn: Callable[..., Any], *args: Any, what: str = "reading a file") -> Any:
        return self.wait(self.submit(fn, *args), what)

    def once(self, key: Any, fn: Callable[..., Any], *args: Any, what: str = "reading a file") -> Any:
        """fn(*args) on the pool, one run for all the callers that ask for `key` while it runs."""
        with self._lock:
            future = self._once.get(key)
            if future is None:
                future = self._once[key] = self.submit(fn, *args)
                future.add_done_callback(lambda f: self._forget(key, f))
        return self.wait(future, what)

    def _forget(self, key: Any, future: Future) -> None:
        with self._lock:
            if self._once.get(key) is future:
                del self._once[key]

    def _work(self) -> None:
        while True:
            try:
                future, fn, args = self._queue.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():  # idle: leave (an engine closed long ago keeps no threads)
                        self._threads.remove(threading.current_thread())
                        return
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the waiting caller
                future.set_exception(e)
