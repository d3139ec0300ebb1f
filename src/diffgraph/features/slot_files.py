"""`SlotFiles`: named files with host copies and device slots, the one implementation every capability that loads
files per request keeps (ControlNets, IP-Adapters, a capability registered at run time).

A capability's files are named (`locate(name)`: where the file is and its version, a file rewritten on disk being a
new version); on the submitting thread `resolve(names)` reads each into a host copy (`load(name, source)`, which
raises a ParamError naming the request's field), cached for the most recent `keep` files, and returns them as `Held`
(the request holds its own host copies until it is done, so an admitted request always has them; a copy the cache
dropped while a request held it is shared, not read again). With `slots` > 0 the files are also an admission gate on
the loop thread (`can_admit`, `admit`, `release`: lora.catalog.SlotCache's slots, a slot in use never evicted, the
least recently used unpinned one reused; when every slot is pinned the request waits, it does not fail; a request
that names more files than there are slots is refused at `resolve`), and `load_admitted` places the host copies of
the files admitted this step into their slots between steps (`place(slot, host)`); a request naming none costs the
gate one emptiness test and nothing per step.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ..errors import ParamError
from ..lora.catalog import SlotCache
from ..safe_files import stamp_of


@dataclass(frozen=True, eq=False)
class Held:
    key: tuple  # (name, version of its file)
    host: Any   # its host copy, held by the request until it is done (the cache may drop it)

    @property
    def name(self) -> str:
        return self.key[0]


def file_version(path: str) -> tuple:
    """A file's version: what changes when it is rewritten (safe_files.stamp_of)."""
    return tuple(stamp_of(os.stat(path)))


def names_in(value: Any) -> list[str]:
    """The file names a request parameter's value holds: a name, a list of names, or a list of objects with a
    "name" (dicts or attributes)."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    return [i if isinstance(i, str) else i["name"] if isinstance(i, dict) else i.name for i in items]


class SlotFiles:
    """One capability's named files (see the module's docstring). `param`: the request field its errors name;
    `limit`: what raises the slot count (a flag), named when a request names too many files."""

    def __init__(self, name: str, param: str, locate: Callable[[str], tuple[str, tuple]],
                 load: Callable[[str, str], Any], slots: int = 0, keep: int | None = None,
                 place: Callable[[int, Any], None] | None = None, listing: Callable[[], Iterable[str]] | None = None,
                 held_of: Callable[[Any], Sequence[Any]] | None = None, limit: str = "", what: str = "file"):
        self.name, self.param, self.what, self.limit = name, param, what, limit
        self._locate, self._load, self._place, self._listing = locate, load, place, listing
        self.slots = SlotCache(slots) if slots else None
        self.keep = keep if keep is not None else max(slots, 1)
        # a request's Held (objects with .key and .host): by default what `resolve` gave, under the gate's name in its
        # capabilities' preparations
        self._held_of = held_of or (lambda state: state.prepared.get(self.name, ()))
        self._host: OrderedDict[tuple, Any] = OrderedDict()  # key -> host copy, most recent last
        self._held: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # copies requests still hold
        self._writes: list[tuple[int, tuple, Any]] = []
        self._lock = threading.Lock()  # host copies: submitting threads read, the loop thread takes

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
        """One file's host copy (cached, else read)."""
        source, version = self._locate(name)
        key = (name, version)
        with self._lock:
            if key in self._host:
                self._host.move_to_end(key)
                return Held(key, self._host[key])
            host = self._held.get(key)
            if host is not None:
                self._keep(key, host)
                return Held(key, host)
        host = self._load(name, source)
        with self._lock:
            self._keep(key, host)
        return Held(key, host)

    def _keep(self, key: tuple, host: Any) -> None:
        """Caches a host copy (under the lock): the most recent `keep` ones stay; requests hold their own."""
        self._host[key] = host
        try:
            self._held[key] = host
        except TypeError:  # not weakly referable: only the cache keeps it
            pass
        while len(self._host) > self.keep:
            self._host.popitem(last=False)

    # -- the admission gate (the loop thread, under the scheduler's lock) -------------------------------
    def _keys(self, state: Any) -> list[tuple]:
        return list(dict.fromkeys(h.key for h in self._held_of(state)))

    def can_admit(self, state: Any) -> bool:
        return not self._held_of(state) or self.slots.can_acquire(self._keys(state))

    def admit(self, state: Any) -> list[int] | None:
        """Pins a slot per distinct file of the request (all or none); None: it waits."""
        held = self._held_of(state)
        if not held:
            return []
        keys = self._keys(state)
        got = self.slots.acquire_all(keys)
        if got is None:
            return None
        hosts = {h.key: h.host for h in held}
        self._writes += [(slot, key, hosts[key]) for (slot, write), key in zip(got, keys) if write]
        return [slot for slot, _ in got]

    def release(self, state: Any, taken: list[int]) -> None:
        for slot in taken:
            self.slots.release(slot)

    def load_admitted(self) -> dict[int, str]:
        """Places the files admitted this step into their slots; returns slot -> reason for those that failed (it
        fails the requests that pinned it, alone)."""
        writes, self._writes, broken = self._writes, [], {}
        for slot, key, host in writes:
            try:
                if host is None:
                    raise RuntimeError(f"{self.what} {key[0]!r} has no host copy (not resolved by this engine); retry")
                self._place(slot, host)
            except Exception as e:  # the slot holds nothing usable: read again by the next request naming it
                self.slots.forget(slot)
                broken[slot] = str(e)
        return broken

    def slot_map(self, state: Any, taken: list[int]) -> dict[str, int]:
        """File name -> the slot it holds for an admitted request."""
        return {key[0]: slot for key, slot in zip(self._keys(state), taken)}
