"""LoRA as a capability: its host half (`LoraCapability`) and its step half (`LoraRows`), both over the engine's
`lora.manager.LoraManager`, which this module knows by what it asks of it (`AdapterFiles`).

The host half: its request parameter is the request's own `loras` field ((name, scale) pairs), resolved on the
submitting thread by the manager (names, file versions, what each adapter has weights for; the files read on the
manager's pool); its files are the manager's `SlotFiles` (the admission gate over the adapter slots, the loads between
steps); its text adapters are what the text encoders run with for a request's prompts. The engine core and the model
runner iterate over the capabilities and name none of them.

Its recommendations: an adapter file's sidecar (features/slot_files.py) may declare the schedule, steps and guidance its
author samples with; a request that leaves those to the model's defaults runs them (`recommends`).

The step half, a row feature: per row, the device slots (0 = none) and scales of its UNet adapters.

The denoiser's side paths (lora/sidepath.py) read the slots of each denoiser row, set just before the denoiser call
and cleared after it. The variant part is the stack depth the step's side paths read: 0 (no side path: adapter-free
traffic pays nothing), 1, 4 (where more may stack: stacks of 2 to 4 pay no deeper side path) or the most a request
may stack (--max-request-loras); a step takes the smallest that covers its live rows.
Which slots a request gets is the adapter manager's business (the admission gate, its files); this feature only
writes them, read from its admission (`Admission.slots["lora"]`, and the scales from the adapters resolved at submit).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from ..errors import ParamError
from .base import Admission, FieldSpec, RowFeature, StepView
from .capability import Capability
from .slot_files import SlotFiles


class SidePathRows(Protocol):
    """What the denoiser's side paths read (lora.sidepath.RowLoras)."""

    max_stack: int  # the most adapters a row may stack

    def set(self, idx: torch.Tensor | None, scale: torch.Tensor | None) -> None: ...


SHALLOW_STACK = 4  # the depth below the deepest that gets its own variant
FILES = "lora.files"  # where a request's resolved adapters are in its preparations (the files' `held_key`)


class LoraRows(RowFeature):
    name = "lora"

    def __init__(self, side_paths: SidePathRows, max_stack: int):
        self._rows, self._max = side_paths, max_stack

    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        return {"lora.idx": FieldSpec((self._max,), torch.int64), "lora.scale": FieldSpec((self._max,), torch.float32)}

    def _adapters(self, admission: Admission) -> list[tuple[int, float]]:
        """(slot, scale) of the request's denoiser adapters: the LoRA capability's files resolved at submit
        (lora/capability.py: objects with `key`, `scale`, `has_unet`) and the slots they were admitted to."""
        held = admission.prepared.get(FILES, ())
        if not held:
            return []
        slots = admission.slots.get(self.name, {})
        return [(slots[a.key[0]], a.scale) for a in held if a.has_unet]

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        loras = self._adapters(admission)
        if not loras:
            return {}
        pad = loras + [(0, 0.0)] * (self._max - len(loras))
        return {"lora.idx": torch.tensor([[s for s, _ in pad]]),
                "lora.scale": torch.tensor([[c for _, c in pad]], dtype=torch.float32)}

    def variants(self) -> Sequence[Any]:
        return tuple(sorted({0, 1, min(SHALLOW_STACK, self._max), self._max}))

    def part(self, admission: Admission) -> Any:
        return len(self._adapters(admission))

    def variant(self, parts: Sequence[Any]) -> Any:
        need = max(parts, default=0)
        return next(k for k in self.variants() if k >= need)

    def before_denoise(self, view: StepView, part: Any) -> None:
        if part:
            self._rows.set(view.gather(view.fields["lora.idx"][:, :part]),
                           view.gather(view.fields["lora.scale"][:, :part]))

    def after_denoise(self, view: StepView, part: Any) -> None:
        if part:
            self._rows.set(None, None)


class AdapterFiles(Protocol):
    """What the capability asks of the engine's adapters (lora.manager.LoraManager)."""

    enabled: bool      # requests may name adapters (there are slots)
    files: SlotFiles   # its named files: host copies, slots, the admission gate

    def resolve(self, loras: tuple[tuple[str, float], ...]) -> tuple: ...


class LoraCapability(Capability):
    name = "lora"
    extension = False  # listed by GET /v1/loras; its parameter is a field of the request
    fields = ("loras",)

    def __init__(self, manager: AdapterFiles | None):
        self.manager = manager

    def host_files(self, model: Any, settings: Any, feature: RowFeature | None) -> SlotFiles | None:
        return self.manager.files if self.manager is not None and self.manager.enabled else None

    def resolve(self, request: Any, settings: Any, files: SlotFiles | None) -> tuple:
        """The request's adapters read and checked (lora.manager.Resolved: key, source, has_unet, has_text, scale).
        Raises ParamError("loras") naming the problem."""
        if not request.loras:
            return ()
        if files is None:
            raise ParamError("loras", "this engine serves no LoRA adapters; start it with --lora-dir DIR or "
                                      "--max-loras N (Engine(lora_dir=..., max_loras=...))")
        try:
            return self.manager.resolve(request.loras)
        except ValueError as e:  # AdapterError, AdapterNameError
            raise ParamError("loras", str(e)) from None

    def recommends(self, held: tuple) -> dict[str, Any]:
        """What the request's adapters' sidecars declare (features/slot_files.py: schedule, steps, guidance), by request
        field; two adapters that declare different values for one field are a ParamError("loras") naming them."""
        out: dict[str, tuple[Any, str]] = {}
        for a in held:
            for field, value in (a.recommended.values() if a.recommended is not None else {}).items():
                seen = out.setdefault(field, (value, a.key[0]))
                if seen[0] != value:
                    raise ParamError("loras", f"adapters {seen[1]!r} and {a.key[0]!r} declare different {field} "
                                              f"({seen[0]!r}, {value!r}) in their sidecars; give {field} in the "
                                              "request")
        return {field: value for field, (value, _) in out.items()}

    def text_adapters(self, held: tuple, slots: dict[str, int]) -> tuple:
        return tuple((a.key, a.scale, slots[a.key[0]]) for a in held if a.has_text and a.key[0] in slots)
