"""`SlotFiles`: named files with host copies and device slots, the one implementation every capability that loads
files per request keeps (LoRA adapters, ControlNets, IP-Adapters, textual-inversion embeddings, a capability
registered at run time), and its parts: `Folder` (the named files of a folder: LoRA's adapters, embeddings, a run-time
capability's files) and `SlotCache` (which file each device slot holds); a named file's sidecar (`read_recommended`:
the request fields its author recommends, such as a LoRA's schedule, steps and guidance).

A capability's files are named (`locate(name)`: where the file is and its version, a file rewritten on disk being a
new version); on the submitting thread `resolve(names)` reads each into a host copy (`load(name, source)`, which
raises a ParamError naming the request's field), cached for the most recent `keep` files, and returns them as `Held`
(the request holds its own host copies until it is done, so an admitted request always has them; a copy the cache
dropped while a request held it is shared, not read again). With `slots` > 0 the files are also an admission gate on
the loop thread (`can_admit`, `admit`, `release` over a `SlotCache`; when every slot is pinned the request waits, it
does not fail; a request that names more files than there are slots is refused at `resolve`), and `load_admitted`
places the host copies of the files admitted this step into their slots between steps (`place(slot, host)`); a
request naming none costs the gate one emptiness test and nothing per step.

Host copies that are large and many (LoRA's adapters) take three more options: `weigh` and `max_bytes` bound the
cache by bytes too (the newest copy always stays); `reader` (a safe_files.FileReader) reads files on its own pool,
one read per file version however many requests ask, bounded in time, and lets a request hold only its files' names
and versions (a `Held`-like object whose `host` is None and `source` says where it was read from): a copy the cache
dropped meanwhile is read again at admission on that pool, never on the loop (`wake` is called when it is ready; a
copy that cannot be read again, the file having changed since, fails that request at its load with the reason);
`changed` names the exception `load` raises when the file is not the version `locate` gave (rewritten between the
two, or while it was read; its message names the file and what happened): it is located and read again, a few times,
before the request is refused with that message.

`Folder`: each file with the suffix under the folder is named by its path relative to the folder, with "/" between
folders and without the suffix (`styles/ink`); a file added later is found without a restart. Clients name files,
never paths: a name that is absolute, holds "..", a backslash or a NUL, or resolves outside the folder (symbolic links
included) is refused; pickles (.bin/.pt/.ckpt/.pth) are never served, and the listing reports them as ignored. A name
whose entry is not a regular file (a FIFO, a device, a socket, a dangling link) or is larger than the folder's limit is
refused with that reason, looked at with a stat and never opened (opening a FIFO blocks).

`SlotCache`: which (name, file version) each of `slots` device slots holds. A request pins the slots of its files
while its rows live; loading a file takes an empty slot, else the least recently used unpinned one; a slot in use is
never evicted; when every slot is pinned the request waits (`SlotsBusy`), it does not fail. A file replaced on disk
has a new version, so it gets a slot of its own: rows in flight finish with the version they began with, new requests
get the new one, never a silent mix.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ..errors import ParamError, unknown_hint
from ..request import MAX_GUIDANCE, MAX_SHIFT
from ..safe_files import FileReader, ReadTimeout, UnusableFile, check_regular, read_sidecar_table, stamp_of
from ..sampling.schedules import MAX_STEPS

PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SUFFIX = ".safetensors"

FileKey = tuple[str, tuple]  # (name, version): a file's safe_files.FileStamp, ("added", n) for an added one
READ_ATTEMPTS, READ_BACKOFF_S = 3, 0.05  # reads of a file that changes while read (`changed`), and their pauses
FAILURES_KEPT = 256  # why recent re-reads at admission failed (a key is one file version: a few are enough)


class NameRefused(ValueError):
    """A bad or unknown file name (HTTP 400); the message says why and lists close names."""


class NameUnknown(NameRefused):
    """An allowed name that no file in the folder has."""


class NameUnusable(NameRefused):
    """A name whose entry in the folder is not a file that can be read (a FIFO, a device, a dangling link, too
    large): the message says what it is."""


class SlotsBusy(RuntimeError):
    """Every slot holds a file that live rows use: the request waits for one to be released."""


@dataclass(frozen=True)
class Listing:
    files: dict[str, str]   # name -> absolute path
    ignored: list[str]      # relative paths of files that are not served (pickles)

    @property
    def adapters(self) -> dict[str, str]:  # (a LoRA folder's files)
        return self.files


class Folder:
    """The named files of folder `root` (see the module's docstring). `what` names a file in errors ("adapter"),
    `label` the folder ("lora dir"), `listed_by` the route that lists the names; `param`: the request field a
    ParamError from `locate` names."""

    def __init__(self, root: str, what: str = "file", label: str = "folder", listed_by: str = "",
                 max_bytes: int = 4 << 30, param: str | None = None, suffix: str = SUFFIX):
        if not os.path.isdir(root):
            raise ValueError(f"{label} {root!r} is not a folder; give a folder of {suffix} {what}s")
        self.root = os.path.realpath(root)
        self.what, self.listed_by, self.max_bytes, self.param, self.suffix = what, listed_by, max_bytes, param, suffix

    def listing(self) -> Listing:
        found: dict[str, str] = {}
        ignored: list[str] = []
        for folder, _, files in os.walk(self.root, followlinks=False):
            for f in sorted(files):
                full = os.path.join(folder, f)
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                if f.endswith(self.suffix):
                    real = os.path.realpath(full)  # once per file: listings walk every file
                    if os.path.commonpath([real, self.root]) == self.root:
                        # a dangling link stays a link, so that its reader says so
                        found[rel[: -len(self.suffix)]] = real if os.path.exists(real) else full
                elif f.lower().endswith(PICKLES):
                    ignored.append(rel)
        return Listing(files=dict(sorted(found.items())), ignored=sorted(ignored))

    def names(self) -> list[str]:
        return list(self.listing().files)

    def _inside(self, path: str) -> bool:
        real = os.path.realpath(path)
        return os.path.commonpath([real, self.root]) == self.root

    def path(self, name: str) -> str:
        """The file named `name`. Raises NameRefused for a name that is not allowed or not there."""
        what, listed = self.what, f" ({self.listed_by} lists them)" if self.listed_by else ""
        if not isinstance(name, str) or not name:
            raise NameRefused(f"an {what} name must be a non-empty string, e.g. 'styles/ink'" if what[0] in "aeiou"
                              else f"a {what} name must be a non-empty string, e.g. 'styles/ink'")
        if "\x00" in name or "\\" in name or name.startswith("/") or os.path.isabs(name) \
                or ".." in name.split("/"):
            raise NameRefused(f"{what} name {name!r} is not allowed: names are relative, with '/' between folders, "
                              f"without '..', backslashes or NUL{listed}")
        full = os.path.join(self.root, *name.split("/")) + self.suffix
        if os.path.lexists(full):
            if not self._inside(full):
                raise NameRefused(f"{what} {name!r} resolves outside the {what} folder (a symbolic link?); it is not "
                                  "served")
            try:
                check_regular(full, self.max_bytes)
            except UnusableFile as e:
                raise NameUnusable(f"{what} {name!r} is unusable: {os.path.basename(full)} {e}") from None
            return os.path.realpath(full)
        raise NameUnknown(f"{what} {name!r} is unknown{unknown_hint(name, self.names())}")

    def locate(self, name: str) -> tuple[str, tuple]:
        """(its file, its version), for `SlotFiles`. Raises ParamError naming `param`."""
        try:
            path = self.path(name)
        except NameRefused as e:
            raise ParamError(self.param or "", str(e)) from None
        return path, file_version(path)


@dataclass
class _Slot:
    key: FileKey | None = None
    pins: int = 0


@dataclass
class SlotCache:
    slots: int
    _slots: dict[int, _Slot] = field(default_factory=dict)
    _lru: OrderedDict = field(default_factory=OrderedDict)  # slot -> None, least recently used first
    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots {self.slots} must be >= 1")
        self._slots = {i: _Slot() for i in range(1, self.slots + 1)}  # slot 0 is the empty "no adapter" slot
        self._lru = OrderedDict((i, None) for i in self._slots)

    def slot_of(self, key: FileKey) -> int | None:
        return next((i for i, s in self._slots.items() if s.key == key), None)

    def acquire(self, key: FileKey) -> tuple[int, bool]:
        """(slot, whether its file must be written) for `key`, pinned once more. Raises SlotsBusy."""
        got = self.acquire_all([key])
        if got is None:
            raise SlotsBusy(f"all {self.slots} slots are in use by running requests")
        return got[0]

    def _plan(self, keys: list[FileKey]) -> list[int] | None:
        """The slots `keys` would get (held ones, then empty, then least recently used unpinned), or None."""
        held = {k: self.slot_of(k) for k in keys}
        mine = {s for s in held.values() if s is not None}
        free = [i for i, s in self._slots.items() if s.key is None and i not in mine]
        free += [i for i in self._lru if self._slots[i].pins == 0 and self._slots[i].key is not None
                 and i not in mine]
        need = [k for k in keys if held[k] is None]
        if len(need) > len(free):
            return None
        taken = iter(free)
        return [held[k] if held[k] is not None else next(taken) for k in keys]

    def can_acquire(self, keys: list[FileKey]) -> bool:
        return self._plan(keys) is not None

    def acquire_all(self, keys: list[FileKey]) -> list[tuple[int, bool]] | None:
        """Pins a slot for each of `keys` (distinct), all or none: [(slot, whether its file must be written)], or
        None when there are not enough slots free of live rows (the request waits)."""
        plan = self._plan(keys)
        if plan is None:
            return None
        out = []
        for key, slot in zip(keys, plan):
            s = self._slots[slot]
            write = s.key != key
            s.key = key
            s.pins += 1
            self._lru.move_to_end(slot)
            out.append((slot, write))
        return out

    def release(self, slot: int) -> None:
        s = self._slots[slot]
        if s.pins <= 0:
            raise ValueError(f"slot {slot} is not pinned")
        s.pins -= 1

    def forget(self, slot: int) -> None:
        """The slot holds nothing usable (its load failed); its pins stay as they are."""
        self._slots[slot].key = None

    def drop(self, name: str) -> list[int]:
        """Forgets every unpinned slot holding file `name` (removed); returns those slots (to be zeroed)."""
        freed = [i for i, s in self._slots.items() if s.key is not None and s.key[0] == name and s.pins == 0]
        for i in freed:
            self._slots[i].key = None
        return freed

    def holding(self) -> dict[int, tuple[FileKey | None, int]]:
        return {i: (s.key, s.pins) for i, s in self._slots.items()}


@dataclass(frozen=True, eq=False)
class Held:
    key: tuple  # (name, version of its file)
    host: Any   # its host copy, held by the request until it is done (the cache may drop it)
    source: Any = None  # where it was read from (what `locate` gave): a copy the cache dropped is read again from it

    @property
    def name(self) -> str:
        return self.key[0]


def file_version(path: str) -> tuple:
    """A file's version: what changes when it is rewritten (safe_files.stamp_of)."""
    return tuple(stamp_of(os.stat(path)))


def names_in(value: Any, param: str) -> list[str]:
    """The file names a request parameter's value holds: a name, a list of names, or a list of objects with a
    "name" (dicts or attributes). Raises ParamError naming `param` for anything else."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    names = [i if isinstance(i, str) else i.get("name") if isinstance(i, dict) else getattr(i, "name", None)
             for i in items or ()]
    if items is None or not all(isinstance(n, str) for n in names):
        raise ParamError(param, f"{param} must name files: a name, a list of names, or a list of objects with a "
                                f"\"name\", got {value!r}"[:300])
    return names


class SlotFiles:
    """One capability's named files (see the module's docstring). `param`: the request field its errors name;
    `limit`: what raises the slot count (a flag), named when a request names too many files."""

    def __init__(self, name: str, param: str, locate: Callable[[str], tuple[Any, tuple]],
                 load: Callable[[str, Any], Any], slots: int = 0, keep: int | None = None,
                 place: Callable[[int, Any], None] | None = None, listing: Callable[[], Iterable[str]] | None = None,
                 held_of: Callable[[Any], Sequence[Any]] | None = None, limit: str = "", what: str = "file",
                 weigh: Callable[[Any], int] | None = None, max_bytes: int | None = None,
                 reader: FileReader | None = None, changed: type[Exception] | None = None):
        self.name, self.param, self.what, self.limit = name, param, what, limit
        self._locate, self._load, self._place, self._listing = locate, load, place, listing
        self.slots = SlotCache(slots) if slots else None
        self.keep = keep if keep is not None else max(slots, 1)
        self._weigh, self.max_bytes, self.reader = weigh, max_bytes, reader
        self._changed = (changed,) if changed is not None else ()
        # a request's Held (objects with .key and .host): by default what `resolve` gave, which its capabilities'
        # preparations keep under `held_key`
        self.held_key = f"{name}.files"
        self._held_of = held_of or (lambda state: state.prepared.get(self.held_key, ()))
        self._host: OrderedDict[tuple, Any] = OrderedDict()  # key -> host copy, most recent last
        self._held: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # copies requests still hold
        self._writes: list[tuple[int, tuple, Any]] = []
        self._lock = threading.Lock()  # host copies: submitting threads read, the loop thread takes
        self._fetching: set[tuple] = set()  # host copies being read again for admission (with a `reader`)
        self._failed: dict[tuple, str] = {}  # ... and why one could not be
        self.wake: Callable[[], None] | None = None  # called when a copy read again is ready (the core plans again)

    # -- on the submitting thread ----------------------------------------------------------------------
    def names(self) -> list[str]:
        """The names a request may give (the folder's listing)."""
        return sorted(self._listing()) if self._listing is not None else []

    def resolve(self, names: Sequence[str]) -> tuple[Held, ...]:
        """Each distinct name found and read into its host copy. Raises ParamError naming `param`."""
        names = list(dict.fromkeys(names))
        if self.slots is not None and len(names) > self.slots.slots:  # it could never be admitted
            n, most = len(names), self.slots.slots
            flag, more = (f" ({self.limit})", f", or start the server with {self.limit} {n}") if self.limit else ("", "")
            raise ParamError(self.param, f"this request names {n} different {self.what}s; this server holds at most "
                                         f"{most} at once{flag}: use at most {most}{more}")
        return tuple(self.held(name) for name in names)

    def held(self, name: str) -> Held:
        """One file's host copy (cached, else read). A file rewritten between its `locate` and its read (`changed`)
        is located again, a few times."""
        for attempt in range(READ_ATTEMPTS if self._changed else 1):
            time.sleep(READ_BACKOFF_S * attempt)  # (0 at first) a writer may be about to finish
            source, version = self._locate(name)
            try:
                return Held((name, version), self.host((name, version), source), source)
            except self._changed as e:
                last = e
        raise ParamError(self.param, f"{last}, {READ_ATTEMPTS} times; wait until it is written completely, then use "
                                     "it")

    def host(self, key: tuple, source: Any) -> Any:
        """The host copy of file version `key` read from `source`: cached, else read (on the `reader`'s pool when
        there is one, once however many callers ask at the same time). Raises ParamError naming `param`."""
        with self._lock:
            if key in self._host:
                self._host.move_to_end(key)
                return self._host[key]
            host = self._held.get(key)
            if host is not None:
                self._keep(key, host)
                return host
        try:
            if self.reader is None:
                return self._read(key, source)
            return self.reader.once(key, self._read, key, source, what=f"reading {self.what} {key[0]!r}")
        except ReadTimeout as e:
            raise ParamError(self.param, f"{self.what} {key[0]!r}: {e}") from None
        except (ParamError, *self._changed):
            raise
        except Exception as e:  # a file its reader cannot read: the caller's 400, naming it
            why = " ".join(str(e).split())[:200]
            raise ParamError(self.param, f"{self.what} {key[0]!r} could not be read ({type(e).__name__}: {why}); "
                                         "use an intact file") from None

    def _read(self, key: tuple, source: Any) -> Any:
        """Reads a host copy and caches it (on the reader's pool when there is one)."""
        host = self._load(key[0], source)
        with self._lock:
            self._keep(key, host)
        return host

    def _keep(self, key: tuple, host: Any) -> None:
        """Caches a host copy (under the lock): the most recent `keep` ones stay, within `max_bytes` (the newest one
        always); requests holding their own copies keep them."""
        self._host[key] = host
        try:
            self._held[key] = host
        except TypeError:  # not weakly referable: only the cache keeps it
            pass
        while len(self._host) > self.keep or (len(self._host) > 1 and self.max_bytes is not None
                                              and self._bytes() > self.max_bytes):
            self._host.popitem(last=False)

    def _bytes(self) -> int:
        return sum(self._weigh(h) for h in list(self._host.values())) if self._weigh is not None else 0

    def host_bytes(self) -> int:
        """Bytes of the host copies the cache keeps (what `max_bytes` bounds; 0 without `weigh`)."""
        with self._lock:
            return self._bytes()

    def peek(self, key: tuple) -> Any:
        """The cached host copy of `key`, or None, without touching the cache's order (a listing reads it)."""
        with self._lock:
            return self._host.get(key)

    def drop(self, name: str) -> list[int]:
        """Forgets every host copy of file `name` and its unpinned slots (a file removed); returns those slots."""
        with self._lock:
            for key in [k for k in self._host if k[0] == name]:
                del self._host[key]
        return self.slots.drop(name) if self.slots is not None else []

    # -- the admission gate (the loop thread, under the scheduler's lock) -------------------------------
    def _keys(self, state: Any) -> list[tuple]:
        return list(dict.fromkeys(h.key for h in self._held_of(state)))

    def can_admit(self, state: Any) -> bool:
        """Slots for all its files, and (with a `reader`) the host copy of each one that is in no slot and that the
        request does not hold: missing ones are read again on the reader's pool, off the loop."""
        held = self._held_of(state)
        if not held:
            return True
        if not self.slots.can_acquire(self._keys(state)):
            return False
        if self.reader is None:
            return True
        missing = [h for h in held if h.host is None and self.slots.slot_of(h.key) is None
                   and self.peek(h.key) is None and h.key not in self._failed]
        for h in missing:  # (one that failed is admitted, to fail at its load)
            self._fetch(h)
        return not missing

    def _fetch(self, held: Any) -> None:
        """Reads a host copy again on the reader's pool (once per key at a time); a read that fails is kept as the
        reason its requests fail."""
        key = held.key
        with self._lock:
            if key in self._fetching or key in self._failed:
                return
            self._fetching.add(key)

        def read() -> None:
            try:
                self._read(key, held.source)
            except Exception as e:  # the file changed or went away since the request was queued
                with self._lock:
                    while len(self._failed) >= FAILURES_KEPT:
                        del self._failed[next(iter(self._failed))]
                    self._failed[key] = (f"{self.what} {key[0]!r} could not be read again at admission ({e}); it "
                                         "changed on disk since the request was queued: send the request again")
            finally:
                with self._lock:
                    self._fetching.discard(key)
                if self.wake is not None:
                    self.wake()
        self.reader.submit(read)

    def admit(self, state: Any) -> list[int] | None:
        """Pins a slot per distinct file of the request (all or none); None: it waits."""
        held = self._held_of(state)
        if not held:
            return []
        if self.reader is not None and not self.can_admit(state):  # (host copies to read again first)
            return None
        keys = self._keys(state)
        got = self.slots.acquire_all(keys)
        if got is None:
            return None
        hosts = {h.key: h.host for h in held}
        self._writes += [(slot, key, self._host_of(key, hosts[key])) for (slot, write), key in zip(got, keys) if write]
        return [slot for slot, _ in got]

    def _host_of(self, key: tuple, host: Any) -> Any:
        """What a slot write places: the request's own copy, else the cache's, else why there is none (a str)."""
        if host is not None:
            return host
        with self._lock:
            return self._host.get(key, self._failed.get(key))

    def release(self, state: Any, taken: list[int]) -> None:
        for slot in taken:
            self.slots.release(slot)

    def load_admitted(self) -> dict[int, str]:
        """Places the files admitted this step into their slots; returns slot -> reason for those that failed (it
        fails the requests that pinned it, alone)."""
        writes, self._writes, broken = self._writes, [], {}
        for slot, key, host in writes:
            try:
                if isinstance(host, str):  # its host copy could not be read again
                    raise RuntimeError(host)
                if host is None:
                    raise RuntimeError(f"{self.what} {key[0]!r} has no host copy (not resolved by this engine, or "
                                       "dropped from host memory); retry")
                self._place(slot, host)
            except Exception as e:  # the slot holds nothing usable: read again by the next request naming it
                self.slots.forget(slot)
                broken[slot] = str(e)
        return broken

    def slot_map(self, state: Any, taken: list[int]) -> dict[str, int]:
        """File name -> the slot it holds for an admitted request."""
        return {key[0]: slot for key, slot in zip(self._keys(state), taken)}


SIDECAR_SUFFIX = ".diffgraph.toml"
SIDECAR_MAX_BYTES = 64 << 10
# A named file's sidecar: `NAME.diffgraph.toml` beside `NAME.safetensors` (for a link, beside its target), saying
# how its author samples with it (a LoRA's schedule, steps, guidance, schedule_shift). A request using the file takes
# these for the fields it leaves to the model's defaults (`Recommended.values`); a value the request gives wins.
# `read_recommended` returns None without a sidecar and raises a one-line SidecarError naming it otherwise.
# sidecar key -> (the request field it fills, its type, the bounds of a number)
SIDECAR_KEYS: dict[str, tuple[str, type, tuple[float, float] | None]] = {
    "schedule": ("schedule", str, None),
    "steps": ("num_inference_steps", int, (1, MAX_STEPS)),
    "guidance": ("guidance_scale", float, (0.0, MAX_GUIDANCE)),
    "schedule_shift": ("schedule_shift", float, (0.01, MAX_SHIFT)),
}


class SidecarError(ValueError):
    """A sidecar that cannot be used; the message names it and says what to fix."""


@dataclass(frozen=True)
class Recommended:
    """What an adapter's sidecar declares (None: not declared)."""

    sidecar: str                 # the sidecar's file name, for messages
    schedule: str | None = None
    steps: int | None = None
    guidance: float | None = None
    schedule_shift: float | None = None

    def values(self) -> dict[str, Any]:
        """The declared values by the request field each fills."""
        return {field: getattr(self, key) for key, (field, _, _) in SIDECAR_KEYS.items()
                if getattr(self, key) is not None}

    def listing(self) -> dict[str, Any]:
        """The declared values by the sidecar's names (what GET /v1/loras lists)."""
        return {key: getattr(self, key) for key in SIDECAR_KEYS if getattr(self, key) is not None}


def sidecar_path(adapter_file: str) -> str:
    real = os.path.realpath(adapter_file)
    return (real[: -len(".safetensors")] if real.endswith(".safetensors") else real) + SIDECAR_SUFFIX


def read_recommended(adapter_file: str) -> Recommended | None:
    """The sidecar of adapter file `adapter_file`, or None. Raises SidecarError (one line)."""
    read = read_sidecar_table(sidecar_path(adapter_file), SIDECAR_MAX_BYTES, tuple(SIDECAR_KEYS), SidecarError)
    if read is None:
        return None
    name, table, _ = read
    return Recommended(name, **{key: _value(name, key, v) for key, v in table.items()})


def _value(name: str, key: str, value: Any) -> Any:
    _, kind, bounds = SIDECAR_KEYS[key]
    if kind is str:
        if not isinstance(value, str) or not value:
            raise SidecarError(f"sidecar {name}: {key} must be a non-empty string (a schedule's name), not {value!r}")
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or
                                                                                  isinstance(value, int))
    if not number or not bounds[0] <= value <= bounds[1]:
        what = "a whole number" if kind is int else "a number"
        raise SidecarError(f"sidecar {name}: {key} must be {what} in {bounds[0]:g}..{bounds[1]:g}, not {value!r}")
    return kind(value)
