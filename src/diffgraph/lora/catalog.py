"""Which adapters exist and which device slot holds which: pure bookkeeping, no tensors.

`AdapterDir`: the adapters of a `--lora-dir` folder, a features/slot_files.py `Folder` of *.safetensors files (its
names, its refusals, its listing of ignored pickles), each file larger than `MAX_ADAPTER_BYTES` refused unread. Its
`SlotCache` (which adapter each device slot holds) is slot_files.py's too; `AdapterNameError`, `AdapterNotFound`,
`AdapterUnusable` and `AdapterKey` are that module's names for a LoRA folder.

`describe` and `check_dtype` are what an adapter file's header says, without torch (the HTTP process lists the
adapters of replicas in other processes with them): adapter weights are bf16, fp16 or fp32, alphas any real number.
"""

from __future__ import annotations

import os
from typing import Any

from ..features.slot_files import (PICKLES, SUFFIX, FileKey, Folder, Listing, NameRefused, NameUnknown, NameUnusable,
                                   SidecarError, SlotCache, SlotsBusy, read_recommended)
from ..safe_files import UnusableFile, read_header

__all__ = ["PICKLES", "SUFFIX", "MAX_ADAPTER_BYTES", "AdapterDir", "AdapterKey", "AdapterNameError", "AdapterNotFound",
           "AdapterUnusable", "Listing", "SlotCache", "SlotsBusy", "check_dtype", "describe", "unusable"]

MAX_ADAPTER_BYTES = 4 << 30   # an SDXL rank-256 adapter is ~1.7 GB; a bigger "adapter" is not one (a sparse file?)
WEIGHT_DTYPES = ("F16", "BF16", "F32")
ALPHA_DTYPES = WEIGHT_DTYPES + ("F64", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")
AdapterKey = FileKey
AdapterNameError = NameRefused  # a bad or unknown adapter name (HTTP 400)
AdapterNotFound = NameUnknown
AdapterUnusable = NameUnusable


class AdapterDir(Folder):
    """The adapters of a `--lora-dir` folder (features/slot_files.py `Folder`)."""

    def __init__(self, root: str):
        super().__init__(root, what="adapter", label="lora dir", listed_by="GET /v1/loras", max_bytes=MAX_ADAPTER_BYTES)


def unusable(name: str, path: str, error: UnusableFile) -> AdapterUnusable:
    """The error for adapter `name` whose file `path` is refused by type or size (`error` says why)."""
    return AdapterUnusable(f"adapter {name!r} is unusable: {os.path.basename(path)} {error}")


_COMPONENT_PREFIXES = (("text_encoder_2.", "text_encoder_2"), ("lora_te2_", "text_encoder_2"),
                       ("text_encoder.", "text_encoder"), ("lora_te1_", "text_encoder"), ("lora_te_", "text_encoder"),
                       ("unet.", "unet"), ("lora_unet_", "unet"))


def describe(path: str) -> dict[str, Any]:
    """Rank and targeted layers per component of an adapter file, from its header (no weights are read, nothing is
    checked against a model), and what its sidecar declares (schedule, steps, guidance: features/slot_files.py): what a
    server that holds no engine in its own process lists. Raises AdapterUnusable (not a regular
    file, too large, not safetensors, a tensor that is not floating point, a sidecar that is not valid)."""
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
    try:
        declared = read_recommended(path)
    except SidecarError as e:
        raise AdapterUnusable(str(e)) from None
    return {"rank": rank, "targets": layers, **(declared.listing() if declared is not None else {})}


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
