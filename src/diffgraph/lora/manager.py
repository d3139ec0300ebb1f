"""`LoraManager`: the adapters one engine serves and the device slots that hold them.

Owns, for one model: the side paths (sidepath.attach on the UNet's and the text encoders' attention, feed-forward
and proj_in/proj_out layers; with the `conv` option also the UNet's ResNet and sampler layers that LoCon files and
few-step adapters such as LCM-LoRA, TCD and Hyper-SD target: CONV_TARGETS) over `max_loras` slots of rank <=
`max_lora_rank`; the adapters it knows (the files of
a `--lora-dir`, found by name on every request, and those added with `add`). Its files are features/slot_files.py's
`SlotFiles` (`files`), as every capability's with host copies and device slots: the host copies of read adapters,
padded and in the model's dtype (pinned on a GPU), so that loading one into a slot between two steps is two copies
per layer, bounded by bytes (`--lora-host-bytes`) and by the slot count; the slot bookkeeping; the admission gate
and the loads between steps. A queued request holds its adapters' names and file versions only (`Resolved`), never
their host copies: one the cache dropped is read again at admission. Adapters merged into the base weights at
start-up (`fuse`) cost nothing per step.

Threads: `resolve` runs on the caller's thread at submit, never on the engine loop; the files themselves are read
(into memory, never memory-mapped: a file rewritten while it is read cannot crash the process) and prepared on
this manager's own small pool (safe_files.FileReader, the files' `reader`) with a time limit, one read per file
version however many requests wait for it. A file that keeps changing while it is read is a clear 400. `listing` reads
headers only (files.header_adapter: layouts and shapes checked against the model, no weights), caches them by
file version (size, mtime_ns, inode) and never touches the host copies that requests use.
`files` (the scheduler's admission gate) and `write` run on the loop thread.
Every problem with an adapter is an AdapterError / AdapterNameError whose message says what to do.
An adapter file's sidecar (features/slot_files.py: its schedule, steps, guidance) is read with the request that uses
it and with every listing (`recommended`); its schedule must be one of the model family's.

The `conv` option (off by default; sidepath.py says why: SD1.5's convolution banks take more memory than the attention
ones, and every adapter step pays them at the full rank) is this manager's own: LoraManager(
model, config, conv=True), or a `conv` field of LoraConfig once there is one (read when `conv` is left None). With it
off, an adapter with weights on those layers is refused by name, with the option to turn on or --fuse-lora; fused
adapters (`fuse`) may hold convolution weights either way.
"""

from __future__ import annotations

import difflib
import itertools
import logging
import math
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import LoraConfig
from ..errors import ParamError
from ..features.slot_files import Recommended, SidecarError, SlotFiles, read_recommended
from ..safe_files import FileReader, FileStamp, ReadTimeout, UnusableFile, check_regular, stamp_of
from .catalog import MAX_ADAPTER_BYTES, AdapterDir, AdapterKey, AdapterNameError, AdapterNotFound, unusable
from .files import AdapterChanged, AdapterError, AdapterFile, header_adapter, module_path, read_adapter
from .sidepath import LoraLayer, LoraSlots, RowLoras, attach, takes
from .targets import CONV_TARGETS, DENOISER, TEXT_TARGETS, UNET_TARGETS, LoraLayout  # noqa: F401 (the SD names)

logger = logging.getLogger(__name__)

READ_WORKERS, READ_TIMEOUT_S = 2, 60.0  # adapter reads at once (each may hold a file in memory), and their bound


@dataclass
class Prepared:
    """An adapter checked against this model, on the host as one row per side-path bank (its layers padded to the
    slots' rank, scales folded in, zeros elsewhere; pinned on a GPU): loading it into a slot is one copy per bank."""

    key: AdapterKey
    adapter: AdapterFile
    rows: dict[str, torch.Tensor]  # bank (the files' component: "unet", "text_encoder", ...) -> its slot row
    denoiser: str = "unet"         # the denoiser's bank

    @property
    def has_unet(self) -> bool:  # weights for the denoiser (whatever its architecture)
        return self.denoiser in self.rows

    @property
    def has_text(self) -> bool:
        return any(c != self.denoiser for c in self.rows)

    @property
    def bytes(self) -> int:
        """Its host rows' bytes (what `--lora-host-bytes` bounds)."""
        return sum(t.numel() * t.element_size() for t in self.rows.values())


@dataclass(frozen=True)
class Resolved:
    """One adapter of a request, checked at submit: its name and file version (`key`), where it is read from, what
    it has weights for, and its scale. A queued request holds this, never the prepared weights: those live in the
    manager's host cache (`files`), bounded by bytes (`host_bytes`), and are read again at admission if it dropped
    them."""

    key: AdapterKey
    source: Any      # (its file's path or an added adapter's state dict, which the manager holds anyway; its version)
    has_unet: bool
    has_text: bool
    scale: float
    recommended: Recommended | None = None  # what its file's sidecar declares (features/slot_files.py)

    @property
    def host(self) -> None:  # (slot_files.Held's: the request holds no host copy)
        return None


@dataclass
class _Added:
    source: Any      # a path or a state dict
    version: tuple   # ("added", n): every add is a new version
    summary: dict    # its listing entry (without `loaded`)


@dataclass
class LoraManager:
    name = "lora"  # as the scheduler's admission gate: what it took for a request is its slots
    model: Any
    config: LoraConfig
    unet_rows: RowLoras = field(default_factory=RowLoras)
    text_rows: RowLoras = field(default_factory=RowLoras)
    conv: bool | None = None  # side paths on CONV_TARGETS too; None: the config's `conv` field if it has one, else off

    def __post_init__(self) -> None:
        if self.conv is None:
            self.conv = bool(getattr(self.config, "conv", False))
        self.family = self.model.family
        self.layout: LoraLayout | None = self.model.adapter.lora_layout(self.model)  # the family's (lora/targets.py)
        self.dir = AdapterDir(self.config.lora_dir) if self.config.lora_dir else None
        self.builtin = AdapterDir(self.config.builtin_dir) if self.config.builtin_dir else None
        self._lock = threading.Lock()
        self._added: dict[str, _Added] = {}
        self._versions = itertools.count(1)
        self._listed: dict[str, tuple[AdapterKey, Any]] = {}  # path -> (name, stamp), its listing entry or error
        self._listing = threading.Lock()  # one listing computes at a time; callers that arrive meanwhile share it
        self._flight: Future | None = None
        self.reader = FileReader(READ_WORKERS, READ_TIMEOUT_S, name="diffgraph-lora-files")
        self.banks: dict[str, LoraSlots] = {}
        layout = self.layout or LoraLayout((), ())
        self.denoiser = layout.denoiser_component if layout.components else "unet"
        self.components = {c: self.model.denoiser if m == DENOISER else self.model.text_encoders[int(m[5:])]
                           for c, m in layout.components}
        # module names per component, for looking up an adapter's layers (before side paths wrap them: the
        # wrapped layer keeps its name, and its base gains a `.base` child that no adapter names)
        self._names = {c: {name for name, _ in root.named_modules()} for c, root in self.components.items()}
        if any(isinstance(m, LoraLayer) for root in self.components.values() for m in root.modules()):
            raise ValueError("this model already has LoRA side paths (another engine made them); load the model "
                             "again for this engine")
        if (self.config.slots or self.config.fuse) and self.layout is None:
            raise ValueError(f"LoRA adapters are not supported for model family {self.family!r}")
        for name, scale in self.config.fuse:
            self.fuse(name, scale)
        # pinned host rows (an SDXL rank-64 adapter is 340 MB): bounded by bytes, the newest kept
        self.files = SlotFiles(self.name, "loras", self._locate, self._read, slots=self.config.slots,
                               keep=max(self.config.slots, 1), place=self._place,
                               what="adapter", weigh=lambda p: p.bytes, max_bytes=self.config.host_bytes,
                               reader=self.reader, changed=AdapterChanged)
        self.slots = self.files.slots
        self.unet_rows.max_stack = self.text_rows.max_stack = self.config.max_stack
        if self.slots is not None:
            n, rank = self.config.slots, self.config.max_lora_rank
            targets = layout.denoiser + (layout.conv if self.conv else ())
            self.banks[self.denoiser] = attach(self.model.denoiser, _targets(self.model.denoiser, targets, self.conv),
                                               n, rank, self.unet_rows, convolutions=self.conv)
            for component, root in self.components.items():
                if component != self.denoiser:
                    self.banks[component] = attach(root, _targets(root, layout.text), n, rank, self.text_rows)
        self.loads = 0  # slot writes (adapters loaded into a slot)
        if self.slots is not None:
            self._warm()

    def _warm(self) -> None:
        """What the first adapter load would otherwise pay on its request: the import of diffusers' reader (its
        pipeline module), and on a GPU one pinned host row per bank (freed into torch's pinned-memory cache, which
        later rows of the same size reuse)."""
        import diffusers

        if self.layout.pipeline_class is not None:
            getattr(diffusers, self.layout.pipeline_class)
        if self.model.device.type == "cuda":
            for bank in self.banks.values():
                if bank.flat is not None:
                    del_row = torch.empty(bank.flat.shape[1], dtype=bank.flat.dtype, pin_memory=True)
                    del del_row

    @property
    def enabled(self) -> bool:
        """Whether requests may name adapters (there are slots)."""
        return self.slots is not None

    # -- which adapters exist ------------------------------------------------------------------
    def add(self, name: str, source: str | dict[str, torch.Tensor]) -> dict[str, Any]:
        """Registers adapter `name` from a .safetensors path or a state dict, checked now (AdapterError). A name
        added again is a new version: rows in flight finish with the old one."""
        self._need_slots()
        if not isinstance(name, str) or not name or "\x00" in name:
            raise AdapterNameError(f"adapter name {name!r} must be a non-empty string")
        version = ("added", next(self._versions))
        prepared = self.files.host((name, version), (source, version))
        summary = self._summary(name, prepared.adapter, "added")
        with self._lock:
            self._added[name] = _Added(source, version, summary)
        return {**summary, "loaded": False}

    def remove(self, name: str) -> list[int]:
        """Forgets an added adapter; returns the unpinned slots that held it (the caller clears them between
        steps; rows in flight keep theirs until they finish)."""
        with self._lock:
            if name not in self._added:
                where = " (it comes from the lora dir: delete its file instead)" if self.dir and \
                    name in self.dir.listing().adapters else ""
                raise AdapterNameError(f"adapter {name!r} was not added with add_lora{where}")
            del self._added[name]
        return self.files.drop(name)

    def resolve(self, loras: tuple[tuple[str, float], ...]) -> tuple[Resolved, ...]:
        """A request's adapters, read and checked (the caller's thread). Raises AdapterError / AdapterNameError."""
        if not loras:
            return ()
        self._need_slots()
        if len(loras) > self.config.max_per_request:
            raise AdapterError(f"{len(loras)} adapters in one request; this server takes at most "
                               f"{self.config.max_per_request} (--max-request-loras): send fewer")
        if len(loras) > self.slots.slots:
            raise AdapterError(f"{len(loras)} adapters in one request, but this engine has {self.slots.slots} "
                               "adapter slots; use fewer or start it with a larger --max-loras")
        return tuple(Resolved(h.key, h.source, h.host.has_unet, h.host.has_text, scale, self.recommended(h.key[0],
                                                                                                  h.source[0]))
                     for h, (_, scale) in zip(map(self.files.held, (n for n, _ in loras)), loras))

    def recommended(self, name: str, source: Any) -> Recommended | None:
        """What adapter `name`'s sidecar declares (None: it has none, or it was added as a state dict), its schedule
        checked against this model's family. Raises AdapterError naming the adapter."""
        if not isinstance(source, str):
            return None
        try:
            declared = read_recommended(source)
        except SidecarError as e:
            raise AdapterError(f"adapter {name!r}: {e}") from None
        schedules = self.model.adapter.schedules
        if declared is not None and declared.schedule is not None and declared.schedule not in schedules:
            raise AdapterError(f"adapter {name!r}: its sidecar {declared.sidecar} declares schedule "
                               f"{declared.schedule!r}, which {self.family} models lack; schedules: "
                               f"{', '.join(schedules)} (fix the sidecar)")
        return declared

    def listing(self) -> dict[str, Any]:
        """Every adapter: name, rank, targets, family, loaded (in a slot), source; files that are not adapters. Files
        are described from their headers, each version once (a second listing reads nothing it has read). Concurrent
        callers share one computation (started after they asked): twelve listings cost one walk of the folder."""
        with self._listing:
            flight, owner = self._flight, self._flight is None
            if owner:
                flight = self._flight = Future()
        if not owner:
            return flight.result()
        try:
            result = self._compute_listing()
            flight.set_result(result)
            return result
        except BaseException as e:
            flight.set_exception(e)
            raise
        finally:
            with self._listing:
                self._flight = None

    def _compute_listing(self) -> dict[str, Any]:
        held = {key[0] for key, _ in (self.slots.holding().values() if self.slots else ()) if key is not None}
        files: dict[str, str] = {}
        walked = {}
        for label, folder in (("builtin", self.builtin), ("dir", self.dir)):  # the lora dir shadows built-ins
            if folder is not None:
                walked[label] = folder.listing()
                files.update(walked[label].adapters)
        entries = {name: self._declared(name, path, self._file_entry(name, path)) for name, path in files.items()}
        with self._lock:
            self._listed = {p: v for p, v in self._listed.items() if p in set(files.values())}
        with self._lock:
            entries.update({name: added.summary for name, added in self._added.items()})
        out = [{**e, "loaded": name in held} for name, e in entries.items() if isinstance(e, dict)]
        errors = [{"name": name, "error": e} for name, e in entries.items() if not isinstance(e, dict)]
        ignored = walked["dir"].ignored if "dir" in walked else []
        return {"data": out, "unusable": errors, "ignored": ignored, "max_loras": self.config.slots,
                "max_lora_rank": self.config.max_lora_rank}

    def _declared(self, name: str, path: str, entry: dict[str, Any] | str) -> dict[str, Any] | str:
        """A file's listing entry with what its sidecar declares (`schedule`, `steps`, `guidance`: read on every
        listing, as requests read it), or why it is unusable."""
        if not isinstance(entry, dict):
            return entry
        try:
            declared = self.recommended(name, path)
        except AdapterError as e:
            return str(e)
        return {**entry, **declared.listing()} if declared is not None else entry

    def _file_entry(self, name: str, path: str) -> dict[str, Any] | str:
        """The listing entry of one adapter file (or why it is unusable): from a request's host copy of this version
        when there is one, else from the cache of headers read, else from its header, read now on the pool."""
        try:
            stamp = stamp_of(check_regular(path, MAX_ADAPTER_BYTES))
        except UnusableFile as e:
            return str(unusable(name, path, e))
        hit = self.files.peek((name, stamp))  # (looked at, not touched: a listing moves nothing in their LRU order)
        with self._lock:
            cached = self._listed.get(path)
        if hit is not None:
            return self._summary(name, hit.adapter, self._source(path))
        if cached is not None and cached[0] == (name, stamp):
            return cached[1]
        try:
            return self.reader.call(self._describe, name, path, stamp, what=f"reading adapter {name!r}'s header")
        except ReadTimeout as e:
            return f"adapter {name!r}: {e}"

    def _describe(self, name: str, path: str, stamp: FileStamp) -> dict[str, Any] | str:
        """(On the pool.) An adapter file's entry from its header, checked against this model, and cached."""
        try:
            adapter = header_adapter(path, self.layout, name, convolutions=True)
            self._pad(adapter)
            entry: dict[str, Any] | str = self._summary(name, adapter, self._source(path))
            stamp = adapter.stamp or stamp
        except AdapterChanged as e:  # not cached: the next listing reads its new version
            return str(e)
        except (AdapterError, AdapterNameError) as e:
            entry = str(e)
        with self._lock:
            self._listed[path] = ((name, stamp), entry)
        return entry

    def _source(self, path: str | None) -> str:
        return "lora_dir" if path and self.dir and path.startswith(self.dir.root + os.sep) else "builtin"

    def _summary(self, name: str, adapter: AdapterFile, source: str) -> dict[str, Any]:
        counts = {c: len(layers) for c, layers in adapter.layers.items()}
        return {"name": name, "rank": adapter.rank, "targets": counts, "family": self.family, "source": source}

    def _need_slots(self) -> None:
        if self.slots is None:
            raise AdapterError("this engine has no adapter slots; start it with --lora-dir DIR or --max-loras N "
                               "(Engine(lora_dir=..., max_loras=...))")

    def _locate(self, name: str) -> tuple[tuple[Any, tuple], tuple]:
        """(where adapter `name` is read from and its version, its version), for `files`: an added one first, then
        the lora dir, then the built-ins. Raises AdapterNameError / AdapterError naming the problem."""
        with self._lock:
            added = self._added.get(name)
        if added is not None:
            return (added.source, added.version), added.version
        folders = [d for d in (self.dir, self.builtin) if d is not None]  # the lora dir first, then built-ins
        for folder in folders:
            try:
                path = folder.path(name)
            except AdapterNotFound:  # (a name that is not allowed is refused by the first folder)
                continue
            try:
                stamp = stamp_of(check_regular(path, MAX_ADAPTER_BYTES))
            except UnusableFile as e:
                raise unusable(name, path, e) from None
            return (path, stamp), stamp
        known = sorted(set(self._added).union(*(d.listing().adapters for d in folders)))
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else \
            f"known: {', '.join(known[:10]) or 'none'} (GET /v1/loras lists them)"
        raise AdapterNameError(f"adapter {name!r} is unknown; {hint}")

    def _read(self, name: str, located: tuple[Any, tuple]) -> Prepared:
        """(On the files' pool.) `files`' load: the host copy of adapter `name` from where `_locate` found it.
        Raises ParamError naming the problem (AdapterChanged: the file is not the version located)."""
        source, version = located
        try:
            return self._build((name, version), source)
        except AdapterChanged:
            raise
        except ValueError as e:  # AdapterError, an unusable file
            raise ParamError("loras", str(e)) from None

    def _build(self, key: AdapterKey, source: Any) -> Prepared:
        """(On the pool.) Reads and checks an adapter, and makes its host rows."""
        adapter = read_adapter(source, self.layout, key[0], convolutions=True)
        if isinstance(key[1], FileStamp) and adapter.stamp != key[1]:  # (an added file is read as it is)
            raise AdapterChanged(f"adapter {key[0]!r} changed between its stat and its read")
        cuda = self.model.device.type == "cuda"
        rows = {c: self.banks[c].host_row(weights, pin=cuda) for c, weights in self._pad(adapter).items()}
        for component, row in rows.items():
            if not _finite(row):
                raise AdapterError(f"adapter {key[0]!r} has non-finite {component} weights (or they overflow "
                                   f"{row.dtype})")
        return Prepared(key, adapter, rows, self.denoiser)

    def host_bytes(self) -> int:
        """Bytes of the prepared host copies kept (what `--lora-host-bytes` bounds)."""
        return self.files.host_bytes()

    def _pad(self, adapter: AdapterFile) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Checks the adapter against the side paths: per bank, side-path module -> (A [r, in], B^T [r, out] with
        the layer's scale folded in)."""
        rank = self.config.max_lora_rank
        if adapter.rank > rank:
            raise AdapterError(f"adapter {adapter.name!r} has rank {adapter.rank}, above this engine's maximum "
                               f"{rank}; start it with --max-lora-rank {adapter.rank} (or more)")
        out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for component, layers in adapter.layers.items():
            root, bank = self.components.get(component), self.banks.get(component)
            if root is None or bank is None:
                raise AdapterError(f"adapter {adapter.name!r} has weights for {component}, which this "
                                   f"{self.family} model does not have: it was made for another model family")
            part = out[component] = {}
            for module, w in layers.items():
                path = module_path(root, module, self._names[component])
                if path is None:
                    raise AdapterError(f"adapter {adapter.name!r} targets {component}.{module}, which this "
                                       f"{self.family} model does not have: it was made for another model")
                slot = bank.layers.get(path)
                if slot is None:
                    raise AdapterError(self._no_side_path(adapter.name, component, path, root.get_submodule(path)))
                if (w.kernel or (1, 1)) != (slot.kernel or (1, 1)) or w.a.shape[1] != slot.a.shape[2] \
                        or w.b.shape[0] != slot.n_out:
                    got = (f"{w.a.shape[1] // math.prod(w.kernel)} -> {w.b.shape[0]} channels, "
                           f"{w.kernel[0]}x{w.kernel[1]} kernel") if w.kernel else \
                        f"{w.a.shape[1]} -> {w.b.shape[0]} features"
                    raise AdapterError(f"adapter {adapter.name!r} does not fit this {self.family} model: "
                                       f"{component}.{path} takes {slot.describe()}, the adapter {got} (made for "
                                       "another model family or size?)")
                part[path] = (w.a, (w.b.float() * w.scale).t() if w.scale != 1.0 else w.b.t())
        return out

    def _no_side_path(self, name: str, component: str, path: str, module: nn.Module) -> str:
        """Why an adapter's layer that the model has cannot run per request, and what to do."""
        what = f"adapter {name!r} targets {component}.{path}"
        if isinstance(module, nn.Conv2d) and module.groups != 1:
            return (f"{what}, a grouped convolution (groups={module.groups}), which LoRA side paths do not take; "
                    "merge the adapter into a checkpoint with its own tool instead")
        kind = f", a {module.kernel_size[0]}x{module.kernel_size[1]} convolution" if isinstance(module, nn.Conv2d) \
            else ""
        if component == self.denoiser and not self.conv and _targets(self.components[component], self.layout.conv,
                                                                     True, [path]):
            return (f"{what}{kind}, whose side path is off in this engine (convolution LoRA, LoCon: LCM-LoRA, TCD, "
                    "Hyper-SD and kohya LoCon files have them): start the engine with --lora-conv "
                    "(LoraManager(conv=True); its slots cost more device memory), or merge the adapter into the "
                    "weights with --fuse-lora")
        served = "attention, feed-forward, proj_in/proj_out" + (
            " and ResNet / sampler layers" if self.conv else "") + " layers"
        return (f"{what}{kind}, which has no LoRA side path (diffgraph serves adapters on {served}); merge it into "
                "the weights with --fuse-lora")

    # -- slots: the scheduler's admission gate is `files` (the engine loop's thread) ---------------------
    def _place(self, slot: int, prepared: Prepared) -> None:
        """`files`' place: loads an admitted adapter into its slot (host to device copies, between steps)."""
        try:
            with torch.no_grad():
                self.write(slot, prepared)
        except Exception as e:
            logger.exception("loading adapter %s into slot %d failed", prepared.key[0], slot)
            raise RuntimeError(f"loading its LoRA adapter into a device slot failed ({type(e).__name__}: {e})") \
                from None

    def write(self, slot: int, prepared: Prepared) -> None:
        """Loads an adapter into a slot in place (between steps, on the device's stream): no capture, no compile."""
        for component, bank in self.banks.items():
            bank.write_flat(slot, prepared.rows.get(component))
        self.loads += 1

    def clear(self, slot: int) -> None:
        for bank in self.banks.values():
            bank.clear(slot)

    # -- fused adapters ------------------------------------------------------------------------
    def fuse(self, name: str, scale: float) -> None:
        """Merges an adapter into the base weights in place: W += scale * layer scale * B @ A."""
        if not math.isfinite(scale):
            raise AdapterError(f"fuse scale {scale} for {name!r} is not finite")
        source = name if name.endswith(".safetensors") else None
        if source is None:
            if self.dir is None:
                raise AdapterNameError(f"fused adapter {name!r}: give a .safetensors path, or a name in --lora-dir")
            source = self.dir.path(name)
        adapter = read_adapter(source, self.layout, name, convolutions=True)
        with torch.no_grad():
            for component, layers in adapter.layers.items():
                root = self.components.get(component)
                if root is None:
                    raise AdapterError(f"fused adapter {name!r} has weights for {component}, which this "
                                       f"{self.family} model does not have")
                for module, w in layers.items():
                    path = module_path(root, module, self._names[component])
                    layer = root.get_submodule(path) if path else None
                    weight = getattr(layer, "weight", None)
                    if weight is None or weight[0].numel() != w.a.shape[1] or weight.shape[0] != w.b.shape[0] or \
                            w.kernel not in (None, tuple(weight.shape[2:])):
                        raise AdapterError(f"fused adapter {name!r} does not fit {component}.{module} of this "
                                           f"{self.family} model (made for another model?)")
                    delta = (w.b.float() @ w.a.float()) * (w.scale * scale)
                    weight += delta.reshape(weight.shape).to(weight.device, weight.dtype)


def _finite(t: torch.Tensor) -> bool:
    """No inf or NaN in `t`; for half types from the exponent bits (torch.isfinite on a CPU fp16 tensor of an SDXL
    adapter takes a third of a second)."""
    mask = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}.get(t.dtype)
    if mask is None:
        return bool(torch.isfinite(t).all())
    return not bool(((t.view(torch.int16) & mask) == mask).any())


def _targets(root: nn.Module, ends: tuple[str, ...], convolutions: bool = False,
             names: list[str] | None = None) -> list[str]:
    """The modules of `root` (or of `names` among them) whose path ends with one of `ends` and that
    sidepath.attach takes (Linear layers, 1x1 convolutions, and with `convolutions` any with groups 1: a grouped
    one is left out, and an adapter on it refused by name)."""
    modules = ((n, root.get_submodule(n)) for n in names) if names is not None else root.named_modules()
    return [n for n, m in modules if n.endswith(ends) and takes(m, convolutions)]
