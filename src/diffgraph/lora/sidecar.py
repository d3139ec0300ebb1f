"""An adapter file's sidecar: `NAME.diffgraph.toml` beside `NAME.safetensors` (for a link, beside its target; the
convention model files follow, models/sidecar.py), saying how its author samples with it:

    schedule = "lightning"   # the model family's schedule it was distilled for (Qwen-Image-Lightning's: mu = log 3)
    steps = 8                # its steps
    guidance = 1.0           # its guidance scale (1: one denoiser row, no classifier-free guidance)
    schedule_shift = 3.0     # or: a flow family's fixed time shift at every size (the request field's meaning)

A request using the adapter takes these for the fields it leaves to the model's defaults (`schedule`,
`num_inference_steps`, `guidance_scale`, `schedule_shift`: `Recommended.values`); a value the request gives wins. `read_recommended`
returns None when there is no sidecar and raises a one-line AdapterError (unknown key, wrong type, not TOML, too large)
naming the file otherwise. Standard library only: the HTTP process lists adapters with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..request import MAX_GUIDANCE, MAX_SHIFT
from ..safe_files import UnusableFile, read_toml
from ..sampling.schedules import MAX_STEPS

SUFFIX = ".diffgraph.toml"
MAX_BYTES = 64 << 10
# sidecar key -> (the request field it fills, its type, the bounds of a number)
KEYS: dict[str, tuple[str, type, tuple[float, float] | None]] = {
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
        return {field: getattr(self, key) for key, (field, _, _) in KEYS.items() if getattr(self, key) is not None}

    def listing(self) -> dict[str, Any]:
        """The declared values by the sidecar's names (what GET /v1/loras lists)."""
        return {key: getattr(self, key) for key in KEYS if getattr(self, key) is not None}


def sidecar_path(adapter_file: str) -> str:
    real = os.path.realpath(adapter_file)
    return (real[: -len(".safetensors")] if real.endswith(".safetensors") else real) + SUFFIX


def read_recommended(adapter_file: str) -> Recommended | None:
    """The sidecar of adapter file `adapter_file`, or None. Raises SidecarError (one line)."""
    path = sidecar_path(adapter_file)
    if not os.path.lexists(path):
        return None
    name = os.path.basename(path)
    try:
        table = read_toml(path, MAX_BYTES)[0]
    except UnusableFile as e:
        raise SidecarError(f"sidecar {name} {e}") from None
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise SidecarError(f"sidecar {name} has unknown key {unknown[0]!r}; allowed: {', '.join(KEYS)}")
    return Recommended(name, **{key: _value(name, key, v) for key, v in table.items()})


def _value(name: str, key: str, value: Any) -> Any:
    _, kind, bounds = KEYS[key]
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
