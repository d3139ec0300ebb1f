"""`diffgraph convert SOURCE OUT`: model files into the forms diffgraph serves, without running anyone's code.

Three conversions, picked by what SOURCE is:
  * a pickle checkpoint (.ckpt .pt .pth .bin; an ESRGAN upscaler's .pth too) -> one .safetensors file, read by
    `unpickle.read_pickle_checkpoint` (tensors rebuilt, every other global stubbed). Nested state dicts are
    flattened with "." between keys: `key` picks one part (`params_ema`, `model.ema`); by default `state_dict`
    when the checkpoint has one, else everything. Values that are not tensors are left out and counted.
  * a diffusers folder of an SD1.x / SD2.x / SDXL pipeline -> one original-layout .safetensors file (the key map
    of `original_layout.to_original`), in the folder's stored dtype unless `dtype` says otherwise.
  * an original-layout .safetensors checkpoint -> a diffusers folder, read through the loader (diffusers'
    single_file_utils conversion; `--model-config` or a sidecar's config folder applies) and written with `save_pretrained`.
Errors are one-line ValueErrors that say how to fix them.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import safe_files
from .checkpoint_kind import PICKLE_EXTENSIONS
from .model import parse_dtype

MAX_SOURCE_BYTES = 1 << 40
MAX_DEPTH = 32  # nested state dicts (a Lightning checkpoint's are 2 or 3 deep)
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def convert(source: str, out: str, key: str | None = None, dtype: str | None = None, layout: str | None = None,
            config: str | None = None, overwrite: bool = False) -> str:
    """Converts `source` to `out` (see the module docstring); returns a one-line summary."""
    if not os.path.exists(source):
        raise ValueError(f"{source!r} does not exist; give a .ckpt/.pt/.pth/.bin/.safetensors file or a diffusers "
                         "folder")
    if os.path.exists(out) and not overwrite:
        raise ValueError(f"{out!r} already exists; remove it, give another output path, or pass --overwrite")
    if os.path.realpath(source) == os.path.realpath(out):
        raise ValueError(f"{out!r} is the source itself; give another output path")
    cast = parse_dtype(dtype) if dtype else None
    if os.path.isdir(source):
        _need_suffix(out, source)
        if key:
            raise ValueError("--key picks part of a pickle checkpoint; a diffusers folder has none: leave it out")
        return folder_to_file(source, out, layout, cast)
    if config and (os.path.isdir(source) or not source.endswith(".safetensors")):
        raise ValueError(f"--model-config reads a .safetensors checkpoint; it does not apply to {source!r}: leave it "
                         "out")
    for name, value in (("--key", key), ("--layout", layout)):
        if value and not (name == "--key" and source.lower().endswith(PICKLE_EXTENSIONS)):
            raise ValueError(f"{name} does not apply to {source!r}; leave it out")
    if source.lower().endswith(PICKLE_EXTENSIONS):
        _need_suffix(out, source)
        return pickle_to_file(source, out, key, cast)
    if source.endswith(".safetensors"):
        if out.endswith(".safetensors"):
            raise ValueError(f"{source!r} is already a .safetensors file; to get a diffusers folder, give a folder "
                             "path as the output")
        return file_to_folder(source, out, cast, config)
    raise ValueError(f"{source!r} is neither a pickle checkpoint ({', '.join(PICKLE_EXTENSIONS)}), a .safetensors "
                     "checkpoint nor a diffusers folder; give one of those")


def _need_suffix(out: str, source: str) -> None:
    if not out.endswith(".safetensors"):
        raise ValueError(f"{source!r} converts to one file: give an output path ending in .safetensors")


# -- pickles ---------------------------------------------------------------------------------------------------------

def pickle_to_file(source: str, out: str, key: str | None, cast: torch.dtype | None) -> str:
    from .unpickle import read_pickle_checkpoint

    obj = read_pickle_checkpoint(source, MAX_SOURCE_BYTES)
    part = select(obj, key, source)
    tensors: dict[str, torch.Tensor] = {}
    left_out = flatten(part, "", tensors)
    if not tensors:
        raise ValueError(f"{source!r} holds no tensors{f' under {key!r}' if key else ''}; "
                         f"{_keys_hint(obj)}")
    if cast is not None:
        tensors = {k: v.to(cast) if v.is_floating_point() else v for k, v in tensors.items()}
    _save(tensors, out, {"diffgraph.converted_from": os.path.basename(source)})
    note = f", {left_out} non-tensor values left out" if left_out else ""
    return f"wrote {out}: {len(tensors)} tensors from {source}{f' [{key}]' if key else ''}{note}"


def select(obj: Any, key: str | None, source: str) -> Any:
    """The part of a checkpoint `key` names ("a.b": nested), or by default its `state_dict` when it has one."""
    if key is None:
        return obj["state_dict"] if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict) else obj
    part = obj
    for i, name in enumerate(key.split(".")):
        if not isinstance(part, dict) or name not in part:
            where = ".".join(key.split(".")[:i]) or "the top level"
            raise ValueError(f"{source!r} has no {name!r} at {where}; {_keys_hint(part)}")
        part = part[name]
    return part


def _keys_hint(obj: Any) -> str:
    if not isinstance(obj, dict):
        return "it is not a dictionary of weights"
    names = [str(k) for k, v in obj.items() if isinstance(v, (dict, torch.Tensor))][:8]
    return f"give --key one of: {', '.join(names)}" if names else "it holds no dictionaries of weights"


def flatten(obj: Any, prefix: str, into: dict[str, torch.Tensor], depth: int = 0) -> int:
    """Tensors of nested dicts into `into` under dotted names; returns how many other values were left out."""
    if depth > MAX_DEPTH:
        raise ValueError(f"the checkpoint nests dictionaries deeper than {MAX_DEPTH} levels (at {prefix[:80]!r}...); "
                         "pick the weights' part with --key")
    if isinstance(obj, torch.Tensor):
        if prefix[:-1] in into:
            raise ValueError(f"two tensors would be named {prefix[:-1]!r}; pick one part with --key")
        into[prefix[:-1]] = obj
        return 0
    if isinstance(obj, dict):
        return sum(flatten(v, f"{prefix}{k}.", into, depth + 1) for k, v in obj.items())
    return 1


def _save(tensors: dict[str, torch.Tensor], out: str, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = f"{out}.partial"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
    os.replace(tmp, out)  # a file under the final name is whole


# -- diffusers folders and original-layout files ----------------------------------------------------------------------

def folder_to_file(folder: str, out: str, layout: str | None, cast: torch.dtype | None) -> str:
    from .catalog import pipeline_family
    from .original_layout import LAYOUTS, load_folder_modules, to_original
    from .single_file import read_model_index

    if not os.path.isfile(os.path.join(folder, "model_index.json")):
        raise ValueError(f"{folder!r} is a folder without model_index.json; give a diffusers pipeline folder")
    index = read_model_index(folder)
    if pipeline_family(index.get("_class_name")) is None:
        raise ValueError(f"{folder!r} is a {index.get('_class_name')} folder; only SD1.x, SD2.x and SDXL pipelines "
                         "convert to one original-layout file")
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    unet, vae, encoders = load_folder_modules(folder)
    layout = layout or _layout_of(encoders)
    state = to_original(unet, vae, encoders, layout)
    target = cast or _stored_dtype(folder)
    tensors = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
    metadata = {"diffgraph.converted_from": os.path.basename(os.path.normpath(folder))}
    scheduler = os.path.join(folder, "scheduler", "scheduler_config.json")
    if os.path.isfile(scheduler) and safe_files.read_json(scheduler, 1 << 20)[0].get("prediction_type") \
            == "v_prediction":
        metadata["modelspec.prediction_type"] = "v"  # the file has no scheduler config: its mark says it
    _save(tensors, out, metadata)
    return f"wrote {out}: {layout} layout, {len(tensors)} tensors, {str(target).removeprefix('torch.')}"


def _layout_of(encoders: list) -> str:
    if len(encoders) == 2:
        return "sdxl"
    return "sd2" if getattr(encoders[0].config, "hidden_act", "") == "gelu" else "sd1"  # OpenCLIP's GELU


def _stored_dtype(folder: str) -> torch.dtype:
    """The UNet's stored floating dtype (fp32 when the folder does not say): what the single file keeps."""
    unet = os.path.join(folder, "unet")
    names = sorted(n for n in os.listdir(unet) if n.endswith(".safetensors")) if os.path.isdir(unet) else []
    for name in names:
        header = safe_files.read_header(os.path.join(unet, name), MAX_SOURCE_BYTES)[0]
        for info in header.tensors.values():
            if info.dtype in _ST_DTYPES:
                return _ST_DTYPES[info.dtype]
    return torch.float32


def file_to_folder(source: str, out: str, cast: torch.dtype | None, config: str | None) -> str:
    from ..config import LoadOptions
    from .checkpoint_kind import inspect_checkpoint
    from .loader import load_model
    from .original_layout import pipeline_of

    info = inspect_checkpoint(source, MAX_SOURCE_BYTES)
    target = cast or _ST_DTYPES.get(info.dtype, torch.float32)
    model = load_model(source, "cpu", target, options=LoadOptions(model_config=config))
    pipe = pipeline_of(model.denoiser, model.vae, list(model.text_encoders), list(model.tokenizers),
                       model.scheduler_config, model.force_zeros_for_empty_prompt)
    pipe.save_pretrained(out, safe_serialization=True)
    return f"wrote {out}: a {type(pipe).__name__} folder ({info.kind}), {str(target).removeprefix('torch.')}"
