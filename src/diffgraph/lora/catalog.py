"""Which adapters exist and which device slot holds which (toward issue 12): pure bookkeeping, no tensors.

`AdapterDir`: the adapters of a `--lora-dir` folder. Each *.safetensors file under it is an adapter named by its
path relative to the folder, with "/" between folders and without the suffix (`styles/ink`); a file added later is
found without a restart. Clients name adapters, never paths: a name that is absolute, holds "..", a backslash or a
NUL, or resolves outside the folder (symbolic links included) is refused; pickles (.bin/.pt/.ckpt/.pth) are never
adapters, and the listing reports them as ignored.

`SlotCache`: which (adapter name, file version) each of `slots` device slots holds. A request pins the slots of its
adapters while its rows live; loading an adapter takes an empty slot, else the least recently used unpinned one; a
slot in use is never evicted; when every slot is pinned the request waits (`SlotsBusy`), it does not fail. A file
replaced on disk has a new version, so it gets a slot of its own: rows in flight finish with the version they began
with, new requests get the new one, never a silent mix.
"""

from __future__ import annotations

import difflib
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SUFFIX = ".safetensors"

AdapterKey = tuple[str, tuple[int, int]]  # (name, (size, mtime_ns))


class AdapterNameError(ValueError):
    """A bad or unknown adapter name (HTTP 400); the message says why and lists close names."""


class AdapterNotFound(AdapterNameError):
    """An allowed name that no file in the folder has."""


class SlotsBusy(RuntimeError):
    """Every slot holds an adapter that live rows use: the request waits for one to be released."""


@dataclass(frozen=True)
class Listing:
    adapters: dict[str, str]   # name -> absolute path
    ignored: list[str]         # relative paths of files that are not adapters (pickles)


class AdapterDir:
    def __init__(self, root: str):
        if not os.path.isdir(root):
            raise ValueError(f"lora dir {root!r} is not a folder; give a folder of .safetensors adapters")
        self.root = os.path.realpath(root)

    def listing(self) -> Listing:
        adapters: dict[str, str] = {}
        ignored: list[str] = []
        for folder, _, files in os.walk(self.root, followlinks=False):
            for f in sorted(files):
                full = os.path.join(folder, f)
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                if f.endswith(SUFFIX) and self._inside(full):
                    adapters[rel[: -len(SUFFIX)]] = os.path.realpath(full)
                elif f.lower().endswith(PICKLES):
                    ignored.append(rel)
        return Listing(adapters=dict(sorted(adapters.items())), ignored=sorted(ignored))

    def _inside(self, path: str) -> bool:
        real = os.path.realpath(path)
        return os.path.commonpath([real, self.root]) == self.root

    def path(self, name: str) -> str:
        """The file of adapter `name`. Raises AdapterNameError for a name that is not allowed or not there."""
        if not isinstance(name, str) or not name:
            raise AdapterNameError("an adapter name must be a non-empty string, e.g. 'styles/ink'")
        if "\x00" in name or "\\" in name or name.startswith("/") or os.path.isabs(name) \
                or ".." in name.split("/"):
            raise AdapterNameError(f"adapter name {name!r} is not allowed: names are relative, with '/' between "
                                   "folders, without '..', backslashes or NUL (GET /v1/loras lists them)")
        full = os.path.join(self.root, *name.split("/")) + SUFFIX
        if os.path.isfile(full):
            if not self._inside(full):
                raise AdapterNameError(f"adapter {name!r} resolves outside the adapter folder (a symbolic link?); "
                                       "it is not served")
            return os.path.realpath(full)
        names = list(self.listing().adapters)
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else \
            f"; known: {', '.join(names[:10]) or 'none'}"
        raise AdapterNotFound(f"adapter {name!r} is unknown{hint}")


_COMPONENT_PREFIXES = (("text_encoder_2.", "text_encoder_2"), ("lora_te2_", "text_encoder_2"),
                       ("text_encoder.", "text_encoder"), ("lora_te1_", "text_encoder"), ("lora_te_", "text_encoder"),
                       ("unet.", "unet"), ("lora_unet_", "unet"))


def describe(path: str) -> dict[str, Any]:
    """Rank and targeted layers per component of an adapter file, from its header (no weights are read, nothing is
    checked against a model): what a server that holds no engine in its own process lists."""
    from safetensors import safe_open

    rank, layers = 0, {}
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            if not any(part in key for part in (".lora_A.", ".lora_down.")):
                continue
            component = next((c for prefix, c in _COMPONENT_PREFIXES if key.startswith(prefix)), "other")
            layers[component] = layers.get(component, 0) + 1
            rank = max(rank, f.get_slice(key).get_shape()[0])
    return {"rank": rank, "targets": layers}


@dataclass
class _Slot:
    key: AdapterKey | None = None
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

    def slot_of(self, key: AdapterKey) -> int | None:
        return next((i for i, s in self._slots.items() if s.key == key), None)

    def acquire(self, key: AdapterKey) -> tuple[int, bool]:
        """(slot, whether its weights must be written) for `key`, pinned once more. Raises SlotsBusy."""
        got = self.acquire_all([key])
        if got is None:
            raise SlotsBusy(f"all {self.slots} adapter slots are in use by running requests")
        return got[0]

    def _plan(self, keys: list[AdapterKey]) -> list[int] | None:
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

    def can_acquire(self, keys: list[AdapterKey]) -> bool:
        return self._plan(keys) is not None

    def acquire_all(self, keys: list[AdapterKey]) -> list[tuple[int, bool]] | None:
        """Pins a slot for each of `keys` (distinct), all or none: [(slot, whether its weights must be written)], or
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
        """Forgets every unpinned slot holding adapter `name` (removed); returns those slots (to be zeroed)."""
        freed = [i for i, s in self._slots.items() if s.key is not None and s.key[0] == name and s.pins == 0]
        for i in freed:
            self._slots[i].key = None
        return freed

    def holding(self) -> dict[int, tuple[AdapterKey | None, int]]:
        return {i: (s.key, s.pins) for i, s in self._slots.items()}
