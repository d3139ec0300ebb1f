"""Which adapters exist and which device slot holds which: pure bookkeeping, no tensors.

`AdapterDir`: the adapters of a `--lora-dir` folder. Each *.safetensors file under it is an adapter named by its
path relative to the folder, with "/" between folders and without the suffix (`styles/ink`); a file added later is
found without a restart. Clients name adapters, never paths: a name that is absolute, holds "..", a backslash or a
NUL, or resolves outside the folder (symbolic links included) is refused; pickles (.bin/.pt/.ckpt/.pth) are never
adapters, and the listing reports them as ignored. A name whose entry is not a regular file (a FIFO, a device, a
socket, a dangling link) or is larger than `MAX_ADAPTER_BYTES` is refused with that reason, looked at with a stat
and never opened (opening a FIFO blocks); the listing names such entries, and their readers report them unusable.

`describe` and `check_dtype` are what an adapter file's header says, without torch (the HTTP process lists the
adapters of replicas in other processes with them): adapter weights are bf16, fp16 or fp32, alphas any real number.

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

from ..safe_files import UnusableFile, check_regular, read_header

PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SUFFIX = ".safetensors"
MAX_ADAPTER_BYTES = 4 << 30   # an SDXL rank-256 adapter is ~1.7 GB; a bigger "adapter" is not one (a sparse file?)
WEIGHT_DTYPES = ("F16", "BF16", "F32")
ALPHA_DTYPES = WEIGHT_DTYPES + ("F64", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")

AdapterKey = tuple[str, tuple]  # (name, version): a file's safe_files.FileStamp, ("added", n) for an added one


class AdapterNameError(ValueError):
    """A bad or unknown adapter name (HTTP 400); the message says why and lists close names."""


class AdapterNotFound(AdapterNameError):
    """An allowed name that no file in the folder has."""


class AdapterUnusable(AdapterNameError):
    """A name whose entry in the folder is not a file that can be read (a FIFO, a device, a dangling link, too
    large): the message says what it is."""


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
                if f.endswith(SUFFIX):
                    real = os.path.realpath(full)  # once per file: listings walk every file
                    if os.path.commonpath([real, self.root]) == self.root:
                        # a dangling link stays a link, so that its reader says so
                        adapters[rel[: -len(SUFFIX)]] = real if os.path.exists(real) else full
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
        if os.path.lexists(full):
            if not self._inside(full):
                raise AdapterNameError(f"adapter {name!r} resolves outside the adapter folder (a symbolic link?); "
                                       "it is not served")
            try:
                check_regular(full, MAX_ADAPTER_BYTES)
            except UnusableFile as e:
                raise unusable(name, full, e) from None
            return os.path.realpath(full)
        names = list(self.listing().adapters)
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else \
            f"; known: {', '.join(names[:10]) or 'none'}"
        raise AdapterNotFound(f"adapter {name!r} is unknown{hint}")


def unusable(name: str, path: str, error: UnusableFile) -> AdapterUnusable:
    """The error for adapter `name` whose file `path` is refused by type or size (`error` says why)."""
    return AdapterUnusable(f"adapter {name!r} is unusable: {os.path.basename(path)} {error}")


_COMPONENT_PREFIXES = (("text_encoder_2.", "text_encoder_2"), ("lora_te2_", "text_encoder_2"),
                       ("text_encoder.", "text_encoder"), ("lora_te1_", "text_encoder"), ("lora_te_", "text_encoder"),
                       ("unet.", "unet"), ("lora_unet_", "unet"))


def describe(path: str) -> dict[str, Any]:
    """Rank and targeted layers per component of an adapter file, from its header (no weights are read, nothing is
    checked against a model): what a server that holds no engine in its own process lists. Raises AdapterUnusable
    (not a regular file, too large, not safetensors, a tensor that is not floating point)."""
    label = os.path.basename(path)
    try:
        header, _ = read_header(path, MAX_ADAPTER_BYTES)
    except UnusableFile as e:
        raise AdapterUnusable(f"{label} {e}") from None
    rank, layers = 0, {}
    for key, t in header.tensors.items():
        check_dtype(label, key, t.dtype, t.numel)
        if not any(part in key for part in (".lora_A.", ".lora_down.")) or not t.shape:
            continue
        component = next((c for prefix, c in _COMPONENT_PREFIXES if key.startswith(prefix)), "other")
        layers[component] = layers.get(component, 0) + 1
        rank = max(rank, t.shape[0])
    return {"rank": rank, "targets": layers}


def check_dtype(name: str, key: str, dtype: str, numel: int) -> None:
    """Adapter weights must be bf16, fp16 or fp32 (an integer, bool, fp8 or complex tensor cast to the model's dtype
    is not the adapter its author trained); an alpha (a scalar) may be any real number. `dtype`: safetensors'
    name. Raises AdapterUnusable naming the adapter and the tensor."""
    alpha = key.endswith(".alpha") and numel <= 1
    if dtype not in (ALPHA_DTYPES if alpha else WEIGHT_DTYPES):
        allowed = "a real number" if alpha else "bf16, fp16 or fp32"
        raise AdapterUnusable(f"adapter {name!r}: tensor {key!r} is {dtype}; adapter "
                              f"{'alphas' if alpha else 'weights'} must be {allowed}: save it with floating-point "
                              "weights (e.g. `.half()` or `.float()` before save_file)")


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
