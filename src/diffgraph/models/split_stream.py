"""Split DiT files (ComfyUI's layout: a diffusion-model file, a text-encoder file, a VAE file) streamed into modules
built with their parameters on the meta device: what the Z-Image, FLUX.2 and Qwen-Image families' `load_split` load.

Each file's header comes first and is checked as zimage_files' readers check it (the kind asked for, its size,
quantisations diffgraph cannot read). Its tensors are then made as meta tensors of the header's shapes and dtypes
(the fp8 layers' scales, small, are read for real) and put through the layout's key conversion (rename, split and
drop: zimage_files' `transformer_from_original` and `qwen3_from_comfy`, flux2_files' `transformer_from_original`
and `mistral_from_comfy`),
which gives the module's state as meta tensors: the config comes from their shapes, and each is a source tensor
itself, a view of one (a fused qkv's rows), or what the conversion computes from one tensor alone (FLUX.2's final
modulation, its shift and scale swapped). The module is built with its parameters on the meta device
(`stream_load.meta_parameters`; its buffers are made real by its constructor, on the device), its names checked
against the file's (a tensor missing, or one without a place: zimage_files' one-line error, before any tensor is
read), then each source tensor is read straight to the device (`TensorFile.read` / `GgufFile.read`: the host holds
one tensor at the file's dtype while it moves), converted (to the compute dtype; an fp8 weight dequantised with its
scale, or kept with `keep_fp8` and installed as an `Fp8Linear` at the end; a view cloned, so the source goes) and
assigned in place of its meta parameter before the next is read. Host memory while loading is one tensor plus the
reader's chunk; device memory the module plus one tensor. Tensors the module has no use for (Lumina 2's
`norm_final`, a causal LM's `lm_head`) are not read. The floating buffers end at the compute dtype, as a module built
and then cast has them.

The VAE (small) is read whole by its reader (diffusers' converter takes the whole dict) into a module built on meta,
each tensor assigned (`load_vae`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from .. import safe_files
from ..safe_tensors import CHANGED_FIX, DTYPES, FILE_LIMIT, TensorFile
from . import flux2_files as ff, zimage_files as zf
from .gguf_files import GgufFile
from .split_files import GGUF_SUFFIX
from .stream_load import assign, meta_parameters, unfilled

Convert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
View = tuple[tuple[int, ...], tuple[int, ...], int]  # a view's size, stride and storage offset in its source
Recipe = tuple[str, "View | str | None"]              # (the module's name, its view; None: the source; CONVERTED)
CONVERTED = "converted"                                 # the conversion of the source tensor alone makes it
AUX = (".scaled_fp8", ".scale_input", ".input_scale", ".scale_weight", ".weight_scale")  # read first, all (small)


@dataclass(frozen=True)
class Layout:
    """How one kind of file becomes one module: its key conversion, its config from the module's state (meta
    tensors), the module from the config. `finish_first`: the file's tensors are dequantised and cast before the
    conversion (one that knows no fp8 scales: FLUX.2's), else after it, each with its own (split) scale."""

    kind: zf.Kind
    convert: Convert
    config_of: Callable[[dict[str, torch.Tensor]], Any]
    build: Callable[[Any], nn.Module]
    what: str
    finish_first: bool = False


@dataclass(frozen=True)
class _Source:
    """An open file, its header checked: its tensors as meta tensors (with the fp8 layers' real scales as
    `<layer>.weight_scale`: zimage_files' `fp8_layers` form), the order to read them in, and `read(key)`."""

    state: dict[str, torch.Tensor]
    order: list[str]
    read: Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class _Plan:
    reads: dict[str, list[Recipe]]     # a source tensor -> what it makes of the module (none: not read)
    scales: dict[str, torch.Tensor]    # `<layer>.weight_scale`: the file's layers' (finish_first), else the module's
    meta: dict[str, torch.Tensor]      # the module's state as meta tensors


def load_transformer(path: str, dtype: torch.dtype, device: torch.device | str, keep_fp8: bool = False,
                     max_bytes: int = FILE_LIMIT) -> tuple[nn.Module, tuple[str, ...]]:
    """A Z-Image transformer file (safetensors in any of zimage_files' layouts and fp8 conventions, or `.gguf`) as a
    ZImageTransformer2DModel on `device`, and the layers installed in fp8 (keep_fp8)."""
    from diffusers import ZImageTransformer2DModel

    layout = Layout("transformer", zf.transformer_from_original, zf.transformer_config,
                    lambda config: ZImageTransformer2DModel(**config), "a Z-Image transformer")
    return stream(path, layout, dtype, device, keep_fp8, None, max_bytes)


def load_text_encoder(path: str, dtype: torch.dtype, device: torch.device | str, keep_fp8: bool = False,
                      config: Any = None, max_bytes: int = FILE_LIMIT) -> tuple[nn.Module, tuple[str, ...]]:
    """A Qwen3 text encoder file as a Qwen3Model on `device` (`config`: a file of another size is refused from its
    header, as `zimage_files.read_text_encoder` refuses it), and the layers installed in fp8."""
    from transformers import Qwen3Config, Qwen3Model

    layout = Layout("text_encoder", zf.qwen3_from_comfy, zf.qwen3_config,
                    lambda values: Qwen3Model(Qwen3Config(**values)), "a Qwen3 text encoder")
    return stream(path, layout, dtype, device, keep_fp8, config, max_bytes)


def load_mistral_text_encoder(path: str, dtype: torch.dtype, device: torch.device | str, head: int = ff.MISTRAL_HEAD,
                              max_bytes: int = FILE_LIMIT) -> nn.Module:
    """A Mistral 3 text encoder file (ComfyUI's, full or pruned; fp8 layers dequantised) as the MistralModel FLUX.2 dev
    runs (flux2_files' `mistral_reader`: 30 layers, no final norm) on `device`; `head` its attention head width."""
    layout = Layout("mistral_text_encoder", ff.mistral_from_comfy, lambda state: ff.mistral_config(state, head),
                    ff.mistral_reader, "a Mistral Small 3 text encoder")
    return stream(path, layout, dtype, device, False, {"num_hidden_layers": ff.MISTRAL_READ}, max_bytes)[0]


def load_flux2_transformer(path: str, dtype: torch.dtype, device: torch.device | str,
                           max_bytes: int = FILE_LIMIT) -> nn.Module:
    """A FLUX.2 transformer file (BFL's layout or diffusers' names; fp8 layers dequantised; or its `.gguf`) as a
    Flux2Transformer2DModel on `device`."""
    from diffusers import Flux2Transformer2DModel

    layout = Layout("flux2_transformer", ff.transformer_from_original, ff.transformer_config,
                    lambda config: Flux2Transformer2DModel(**config), "a FLUX.2 transformer", finish_first=True)
    return stream(path, layout, dtype, device, False, None, max_bytes)[0]


def load_qwen_image(path: str, text_encoder: str, dtype: torch.dtype, device: torch.device | str,
                    max_bytes: int = FILE_LIMIT, vision: bool = False,
                    zero_cond_t: bool = False) -> tuple[nn.Module, nn.Module]:
    """A Qwen-Image transformer file (safetensors or GGUF) and a Qwen2.5-VL text encoder file (qwen_image_files.py) as
    QwenImageTransformer2DModel (`zero_cond_t`: Edit-2511's) and Qwen2_5_VLTextModel on `device`; with `vision` the
    encoder with its vision tower, as Qwen2_5_VLModel."""
    from diffusers import QwenImageTransformer2DModel
    from transformers.models.qwen2_5_vl import (Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2_5_VLTextConfig,
                                                Qwen2_5_VLTextModel)

    from . import qwen_image_files as qf
    transformer = Layout("qwen_image_transformer", qf.transformer_from_comfy, qf.transformer_config,
                         lambda config: QwenImageTransformer2DModel(**config, zero_cond_t=zero_cond_t),
                         "a Qwen-Image transformer")
    encoder = Layout("qwen25_text_encoder", qf.vl_from_comfy, qf.vl_config,
                     lambda values: Qwen2_5_VLModel(Qwen2_5_VLConfig(**values)), "a Qwen2.5-VL encoder") if vision \
        else Layout("qwen25_text_encoder", qf.text_encoder_from_comfy, qf.text_config,
                    lambda values: Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**values)), "a Qwen2.5-VL text encoder")
    return (stream(path, transformer, dtype, device, False, None, max_bytes)[0],
            stream(text_encoder, encoder, dtype, device, False, None, max_bytes)[0])


def load_vae(cls: type[nn.Module], config: Mapping[str, Any], read: Callable[[Any], zf.FileWeights],
             dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """A VAE of class `cls` built from `config` with its parameters on meta, then filled from `read(its config)` (a
    file's reader: the whole state, small), each tensor moved to `device`."""
    with meta_parameters(), torch.device(device):
        model = cls(**config)
    weights = read(model.config)
    _check_places(weights.path, model, weights.state)
    for name, value in weights.state.items():
        assign(model, name, value.to(device))
    return _finished(weights.path, model, {}, dtype)[0]


def stream(path: str, layout: Layout, dtype: torch.dtype, device: torch.device | str, keep_fp8: bool,
           size_config: Any, max_bytes: int) -> tuple[nn.Module, tuple[str, ...]]:
    """The file at `path` streamed into the module `layout` builds (see the module's docstring)."""
    with _opened(path, layout.kind, dtype, device, max_bytes, size_config) as source:
        plan = _plan(path, source, layout.convert, dtype, layout.finish_first)
        try:
            config = layout.config_of(plan.meta)
        except KeyError as e:
            raise ValueError(f"{path} lacks the tensor {e.args[0]!r}: it is not a complete file of {layout.what}; "
                             "copy it again, or use the file made for this model") from None
        with meta_parameters(), torch.device(device):
            model = layout.build(config)
        _check_places(path, model, plan.meta)
        kept = _fill(model, plan, source, layout.convert, dtype, keep_fp8, layout.finish_first)
    return _finished(path, model, kept, dtype)


@contextlib.contextmanager
def _opened(path: str, kind: zf.Kind, dtype: torch.dtype, device: torch.device | str, max_bytes: int,
            size_config: Any) -> Iterator[_Source]:
    """The file open and its header checked; its errors (FileChanged included, while it is read) one line each."""
    try:
        if path.endswith(GGUF_SUFFIX):
            with GgufFile(path, max_bytes) as g:
                shapes = g.shapes  # (the model's names: a llama.cpp text encoder's in transformers')
                zf.check_kind(path, kind, shapes, size_config)
                g.check_types(shapes)
                state = {k: torch.empty(s, dtype=dtype, device="meta") for k, s in shapes.items()}
                yield _Source(state, list(shapes), lambda key: g.read([key], device=device, dtype=dtype)[key])
        else:
            with TensorFile(path, max_bytes) as f:
                formats = zf.checked_formats(f, kind, size_config)
                tensors = f.header.tensors
                scales = f.read((k for k in tensors if k == "scaled_fp8" or k.endswith(AUX)), device=device)
                order = sorted((k for k in tensors if k not in scales and not k.endswith(".comfy_quant")),
                               key=lambda k: tensors[k].begin)
                meta = {k: torch.empty(tensors[k].shape, dtype=DTYPES.get(tensors[k].dtype, torch.uint8),
                                       device="meta") for k in order}  # (an unknown dtype is refused when read)
                state = zf.fp8_layers(path, {**meta, **scales}, formats)[0]
                yield _Source(state, order, lambda key: f.read([key], device=device)[key])
    except safe_files.FileChanged as e:
        raise ValueError(f"{path} {e}; {CHANGED_FIX}") from None
    except safe_files.UnusableFile as e:
        raise ValueError(f"{path} {e}") from None


def _plan(path: str, source: _Source, convert: Convert, dtype: torch.dtype, finish_first: bool) -> _Plan:
    """The conversion run on the meta tensors: which module tensors each source tensor makes, and how."""
    state = source.state
    if finish_first:
        inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()
                  if not k.endswith(".weight_scale")}
        scales = {k: v for k, v in state.items() if k.endswith(".weight_scale")}
    else:
        inputs, scales = dict(state), {}
    owner = {id(v): k for k, v in inputs.items() if v.is_meta}
    reads: dict[str, list[Recipe]] = {k: [] for k in owner.values()}
    meta, orphans = {}, {}
    for name, value in convert(dict(inputs)).items():
        if not value.is_meta:  # a layer's fp8 scale (split with its weight), read already
            scales[name] = value
            continue
        meta[name] = value
        base = value if id(value) in owner else value._base
        if base is not None and id(base) in owner:
            view = None if base is value else (tuple(value.size()), tuple(value.stride()), value.storage_offset())
            reads[owner[id(base)]].append((name, view))
        else:
            orphans[name] = value
    if orphans:
        _place_computed(path, reads, inputs, convert, orphans)
    return _Plan(reads, scales, meta)


def _place_computed(path: str, reads: dict[str, list[Recipe]], inputs: dict[str, torch.Tensor], convert: Convert,
                    orphans: dict[str, torch.Tensor]) -> None:
    """Module tensors the conversion computed: each from the one unused source tensor whose conversion alone makes
    it (same name and shape)."""
    for key in [k for k, r in reads.items() if not r]:
        try:
            alone = convert({key: inputs[key]})
        except (KeyError, ValueError):
            continue
        if alone and all(n in orphans and tuple(orphans[n].shape) == tuple(v.shape) for n, v in alone.items()):
            reads[key] = [(n, CONVERTED) for n in alone]
            for n in alone:
                del orphans[n]
    if orphans:
        raise ValueError(f"{path}: its {next(iter(orphans))!r} is made from several of the file's tensors, which "
                         "diffgraph does not stream; convert the file to diffusers' names")


def _check_places(path: str, model: nn.Module, names: Iterable[str]) -> None:
    """The file's tensors (in the module's names) against the module's parameters and persistent buffers."""
    names, wanted = list(names), model.state_dict(keep_vars=True)
    given = set(names)
    missing = [k for k in wanted if k not in given]
    unexpected = [k for k in names if k not in wanted]
    if missing or unexpected:
        raise zf.misfit(path, model, missing, unexpected)


def _fill(model: nn.Module, plan: _Plan, source: _Source, convert: Convert, dtype: torch.dtype, keep_fp8: bool,
          finish_first: bool) -> dict[str, zf.Fp8Weight]:
    """Reads each source tensor the module uses, in file order, and assigns what it makes before the next is read;
    returns the fp8 layers kept (installed once the module's biases are in)."""
    kept: dict[str, zf.Fp8Weight] = {}
    for key in source.order:
        recipes = plan.reads.get(key)
        if not recipes:
            continue
        real = source.read(key)
        if finish_first:
            real = zf.finish_tensor(real, _scale(plan.scales, key), dtype, False)
        converted = convert({key: real}) if any(view == CONVERTED for _, view in recipes) else {}
        for name, view in recipes:
            value = converted[name] if view == CONVERTED else real if view is None else \
                real.as_strided(view[0], view[1], real.storage_offset() + view[2])
            shared = view is not None or len(recipes) > 1
            scale = None if finish_first else _scale(plan.scales, name)
            _put(model, kept, name, _own(value, real, shared), scale, dtype, keep_fp8)
        del real, converted, value  # (before the next tensor is read)
    return kept


def _put(model: nn.Module, kept: dict[str, zf.Fp8Weight], name: str, value: torch.Tensor,
         scale: torch.Tensor | None, dtype: torch.dtype, keep_fp8: bool) -> None:
    """One module tensor finished (zimage_files' `finish_tensor`) and assigned, or kept as an fp8 pair."""
    done = zf.finish_tensor(value, scale, dtype, keep_fp8)
    if isinstance(done, zf.Fp8Weight):
        kept[name.removesuffix(".weight")] = zf.Fp8Weight(done.weight, done.scale.to(done.weight.device))
    else:
        assign(model, name, done)


def _scale(scales: dict[str, torch.Tensor], key: str) -> torch.Tensor | None:
    return scales.get(key.removesuffix(".weight") + ".weight_scale") if key.endswith(".weight") else None


def _own(value: torch.Tensor, source: torch.Tensor, shared: bool) -> torch.Tensor:
    """`value` with memory of its own where it is a part of `source` (so the source goes once its parts are in)."""
    if shared and value.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        return value.clone(memory_format=torch.contiguous_format)
    return value


def _finished(path: str, model: nn.Module, kept: Mapping[str, zf.Fp8Weight],
              dtype: torch.dtype) -> tuple[nn.Module, tuple[str, ...]]:
    """The module's floating buffers at `dtype` (as a module built, then cast), its kept fp8 layers installed, every
    parameter filled."""
    for name, buffer in list(model.named_buffers()):
        if buffer.is_floating_point() and buffer.dtype != dtype:
            assign(model, name, buffer.to(dtype))
    installed = zf.install_fp8(model, kept, dtype)
    left = unfilled(model)
    if left:
        raise zf.misfit(path, model, left, [])
    return model, installed
