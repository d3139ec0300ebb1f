"""Z-Image's single files as ComfyUI users download them, read into the state dicts of the classes the Z-Image family
builds: the transformer (`diffusion_models/z_image_turbo_bf16.safetensors`) for diffusers' ZImageTransformer2DModel,
the text encoder (`text_encoders/qwen_3_4b.safetensors`) for transformers' Qwen3Model, the VAE (`vae/ae.safetensors`)
for diffusers' AutoencoderKL.

Layouts read:
  * transformer: the original (Tongyi / ComfyUI NextDiT) layout, keys bare or under `model.diffusion_model.`:
    `x_embedder` / `final_layer` (one patch size, 2x2x1) become `all_x_embedder.2-1` / `all_final_layer.2-1`, the
    fused `attention.qkv` splits into `to_q` / `to_k` / `to_v` (q has `dim` rows, k and v share the rest),
    `attention.out` is `to_out.0`, `q_norm` / `k_norm` are `norm_q` / `norm_k`; Lumina 2's unused `norm_final` is
    dropped. A file already in diffusers' names (`all_x_embedder.`) is read as it is (`transformer_from_original`).
  * text encoder: Qwen3's transformers names under any prefix ending where `embed_tokens.weight` begins (`model.` in
    ComfyUI's file, nothing in a Qwen3Model's); a causal LM's `lm_head` is dropped (`qwen3_from_comfy`).
  * VAE: the original BFL / LDM layout (`encoder.down.0.block.0...`, bare or under `first_stage_model.` / `vae.`),
    converted by diffusers' own `convert_ldm_vae_checkpoint`, the converter diffgraph's single-file VAEs go through;
    a file in diffusers' names (`encoder.down_blocks.`) is read as it is.

ComfyUI's fp8 conventions: (a) a `scaled_fp8` marker tensor with per-layer `scale_weight` (and `scale_input`);
(b) `weight_scale` (and `input_scale`) per layer, with `_quantization_metadata` in the safetensors metadata (or
`.comfy_quant` tensors) naming each layer's format; and plain fp8 weights without scales. A layer's fp8 weight
and its scale (one per tensor, or one per output row) are read as an `Fp8Weight` in diffgraph's fp8 tier's form
(quantize/fp8.py: an e4m3fn [out, in] weight, a float32 [1] or [out] scale), kept with `keep_fp8`, otherwise
dequantised (weight.float() * scale, then the compute dtype). Static input scales are not used: the fp8 tier
quantises activations per token. Other quantisations (`int8_blockwise`, `mxfp8`, `nvfp4`, ... by the metadata, the
dtypes or the key suffixes; nunchaku's SVDQuant by its `.qweight` / `.wscales` / `.smooth_factor` / `.proj_down` /
`.proj_up`) are refused by name, in one line, from the header, before any tensor is read.

GGUF: a transformer's `.gguf` file (city96 / ComfyUI-GGUF's quantisations, Q4_K_M ... F16 / BF16: the original layout
with the prefix stripped, architecture `lumina2`; tensors its converter stored reshaped get their
`comfy.gguf.orig_shape` back) is read through `gguf_files.GgufFile`, each tensor dequantised to the compute dtype on
the device asked for (the family's: the GPU dequantises), then mapped as above; a tensor of a GGML type diffgraph does
not read is refused by name from the header, before any tensor is read. A text encoder's `.gguf` (llama.cpp's
language models: unsloth's Qwen3) is read in transformers' names (gguf_llm.py), then as its safetensors file is
(split_stream.py streams it; `read_file` reads it whole).

Every other file is read through `safe_tensors.TensorFile` (streamed and checked, never mapped). Each file's header
comes first, which must hold the kind asked for (keys and shapes; a file of another kind is named as what it looks
like, with split_files' signatures). Errors are ValueError, one line naming the file and saying what to use instead.
`read_file` is the same reading for another family's converter (flux2_files.py: a FLUX.2 transformer, its VAE).
`load_into` puts a `FileWeights` into a module: strict, fp8 pairs installed as `Fp8Linear` where they fit. The
families load their split files through split_stream.py instead (a module built on meta, filled tensor by tensor),
which reads with the pieces here: `checked_formats` (the header's checks), the key conversions, `finish_tensor`
(one tensor's dtype and fp8 scale), `install_fp8` and `misfit` (the one-line error of a file that does not fit).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import torch
from torch import nn

from .. import safe_files
from ..quantize.fp8 import Fp8Linear
from ..safe_tensors import CHANGED_FIX, FILE_LIMIT, TensorFile
from .gguf_files import GgufFile
from .split_files import GGUF_SUFFIX, PARTS, SPLIT_KINDS, header_shapes

Kind = Literal["transformer", "text_encoder", "vae", "flux2_transformer", "qwen_image_vae", "qwen_image_transformer",
               "qwen25_text_encoder", "mistral_text_encoder"]
Quantisation = Literal["none", "fp8", "scaled_fp8", "quantization_metadata", "gguf"]
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")  # ComfyUI's format names of the layers read here
TRANSFORMER_PREFIX = "model.diffusion_model."
SVDQUANT_SUFFIXES = (".qweight", ".wscales", ".wcscales", ".wtscale", ".wzeros", ".smooth_factor",
                     ".smooth_factor_orig", ".proj_down", ".proj_up")
USE_INSTEAD = "use the model's bf16 or fp8 (float8_e4m3fn) file"
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_MODULE_RENAMES = ((".attention.out.", ".attention.to_out.0."), (".attention.q_norm.", ".attention.norm_q."),
                   (".attention.k_norm.", ".attention.norm_k."))
_TOP_RENAMES = (("x_embedder.", "all_x_embedder.2-1."), ("final_layer.", "all_final_layer.2-1."))
_DROPPED = ("norm_final.weight",)  # Lumina 2's final RMSNorm: in its files, unused by Z-Image
# what a file of another kind looks like, by a key fragment (after split_files' sized signatures)
_LOOKS = (("cap_embedder.", "a Z-Image transformer"), ("txt_norm.", "a Qwen-Image transformer"), ("double_blocks.", "a FLUX transformer"),
          ("input_blocks.", "an SD UNet"), ("encoder.block.", "a T5 text encoder"),
          ("text_model.encoder.layers.", "a CLIP text encoder"), ("transformer.resblocks.", "an OpenCLIP text encoder"),
          ("self_attn.q_proj.bias", "a Qwen2 / Qwen2.5 text encoder"), ("self_attn.q_norm.", "a Qwen3 text encoder"),
          ("embed_tokens.", "a language model"),
          ("decoder.middle.0.residual.", "a Wan 2.1 / Qwen-Image VAE"), ("encoder.conv_in.", "a VAE"),
          ("token_embd.", "a llama.cpp language model"))
_WANTED = {"transformer": "a Z-Image transformer", "text_encoder": "a Qwen3 text encoder", "vae": "a VAE",
           "flux2_transformer": "a FLUX.2 transformer", "qwen_image_vae": "a Qwen-Image (Wan 2.1) VAE",
           "qwen_image_transformer": "a Qwen-Image transformer", "qwen25_text_encoder": "a Qwen2.5-VL text encoder",
           "mistral_text_encoder": "a Mistral Small 3 text encoder"}


@dataclass(frozen=True)
class Fp8Weight:
    """One layer's fp8 weight as the fp8 tier takes it: weight ~ weight.float() * scale[:, None]."""

    weight: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor   # float32 [1] (per tensor) or [out] (per output row)

    @property
    def granularity(self) -> str:
        return "tensor" if self.scale.numel() == 1 else "channel"

    def dequantised(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.scale.reshape(-1, 1)).to(dtype)


@dataclass(frozen=True)
class FileWeights:
    """A file read for one module: `state` in the module's key names (floating tensors at the compute dtype, fp8
    layers dequantised unless kept), `fp8` the kept layers by the Linear's qualified name (their `.weight` is not in
    `state`), `quantisation` the file's convention."""

    path: str
    state: dict[str, torch.Tensor]
    fp8: dict[str, Fp8Weight] = field(default_factory=dict)
    quantisation: Quantisation = "none"


# -- the readers ---------------------------------------------------------------------------------------------------

def read_transformer(path: str, dtype: torch.dtype = torch.bfloat16, keep_fp8: bool = False,
                     max_bytes: int = FILE_LIMIT, device: torch.device | str | None = None) -> FileWeights:
    """A Z-Image transformer file as ZImageTransformer2DModel's state dict (`transformer_from_original`). A `.gguf`
    file's tensors are dequantised to `dtype` on `device` (default the CPU) and stay there; a safetensors file's are
    read on the host."""
    if path.endswith(GGUF_SUFFIX):
        state = _read_gguf(path, "transformer", dtype, device, max_bytes)
        return FileWeights(path, transformer_from_original(state), {}, "gguf")
    state, convention = _read(path, "transformer", max_bytes)
    return _finish(path, transformer_from_original(state), convention, dtype, keep_fp8)


def read_text_encoder(path: str, dtype: torch.dtype = torch.bfloat16, keep_fp8: bool = False,
                      config: Any = None, max_bytes: int = FILE_LIMIT) -> FileWeights:
    """A Qwen3 text encoder file as Qwen3Model's state dict (`qwen3_from_comfy`). With `config` (a Qwen3Config or its
    dict), a file of another size is refused from its header: width, vocabulary, layers."""
    state, convention = _read(path, "text_encoder", max_bytes, config)
    return _finish(path, qwen3_from_comfy(state), convention, dtype, keep_fp8)


def read_vae(path: str, config: Mapping[str, Any], dtype: torch.dtype = torch.bfloat16,
             max_bytes: int = FILE_LIMIT) -> FileWeights:
    """A VAE file as AutoencoderKL's state dict for `config` (its config dict: block types, latent channels); a VAE
    with other latent channels is refused from its header. fp8 layers are always dequantised."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    state, convention = _read(path, "vae", max_bytes, config)
    weights = _finish(path, state, convention, dtype, keep_fp8=False)  # (before the conversion: it knows no scales)
    if any(".down_blocks." in k for k in weights.state):
        return weights
    return FileWeights(path, convert_ldm_vae_checkpoint(weights.state, dict(config)), {}, convention)


def read_file(path: str, kind: Kind, dtype: torch.dtype = torch.bfloat16, config: Any = None,
              max_bytes: int = FILE_LIMIT, device: torch.device | str | None = None) -> FileWeights:
    """A safetensors or `.gguf` file of `kind` in its own key names (another family's converter maps them:
    flux2_files.py), its header checked as the readers above check it, fp8 layers dequantised to `dtype`; a GGUF
    file's tensors dequantised to `dtype` on `device` (default the CPU)."""
    if path.endswith(GGUF_SUFFIX):
        return FileWeights(path, _read_gguf(path, kind, dtype, device, max_bytes, config), {}, "gguf")
    state, convention = _read(path, kind, max_bytes, config)
    return _finish(path, state, convention, dtype, keep_fp8=False)


def load_into(module: nn.Module, weights: FileWeights) -> tuple[str, ...]:
    """Loads `weights` into `module`, every parameter and buffer of it (else ValueError naming the file and the first
    missing or unexpected key); each kept fp8 layer becomes an `Fp8Linear` where it is an nn.Linear whose dims are
    multiples of 16 (the fp8 matmul's), else its dequantised weight. Call it after the module's last `.to(dtype)`
    (a cast would turn the fp8 weights into floats). Returns the names of the layers installed in fp8."""
    result = module.load_state_dict(weights.state, strict=False)
    missing = [k for k in result.missing_keys if k.removesuffix(".weight") not in weights.fp8]
    unexpected = [*result.unexpected_keys, *(n + ".weight" for n in weights.fp8 if n + ".weight"
                                             not in result.missing_keys)]
    if missing or unexpected:
        raise misfit(weights.path, module, missing, unexpected)
    return install_fp8(module, weights.fp8)


def misfit(path: str, module: nn.Module, missing: list[str], unexpected: list[str]) -> ValueError:
    """The one-line error of a file whose tensors do not fit `module`: the first missing key, else the first
    unexpected one."""
    what = (f"lacks {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "") if missing
            else f"holds {unexpected[0]!r}, which this model has no place for")
    return ValueError(f"{path} {what}: it does not fit this {type(module).__name__}'s config; use the file made for "
                      "this model")


def install_fp8(module: nn.Module, fp8: Mapping[str, Fp8Weight], dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """Each kept fp8 layer of `module` as an `Fp8Linear` (on the device of its pair's weight) where it is an nn.Linear
    whose dims are multiples of 16, else its weight dequantised to `dtype` (default the Linear's); the Linear's own
    weight may be a meta tensor. Returns the names of the layers installed in fp8."""
    installed = []
    for name, pair in fp8.items():
        linear = module.get_submodule(name)
        device = pair.weight.device if linear.weight.is_meta else linear.weight.device
        if type(linear) is nn.Linear and linear.in_features % 16 == 0 and linear.out_features % 16 == 0:
            module.set_submodule(name, Fp8Linear(pair.weight.to(device), pair.scale.to(device), linear.bias,
                                                 pair.granularity))
            installed.append(name)
        else:
            linear.weight = nn.Parameter(pair.dequantised(dtype or linear.weight.dtype).to(device),
                                         requires_grad=linear.weight.requires_grad)
    return tuple(installed)


# -- key conversions (rename, split and drop only: they work on meta tensors too) -----------------------------------

def transformer_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The original / ComfyUI layout's keys (bare or under `model.diffusion_model.`) as ZImageTransformer2DModel's.
    A fused qkv splits by rows: q has the layer's in_features (`dim`) rows, k and v half the rest each; a per-row
    `weight_scale` splits alike, a per-tensor one goes to all three."""
    state = {k.removeprefix(TRANSFORMER_PREFIX): v for k, v in state.items()}
    if any(k.startswith("all_x_embedder.") for k in state):
        return state  # diffusers' own names
    out = {}
    for key, value in state.items():
        if key in _DROPPED:
            continue
        if ".attention.qkv." in key:
            if key.endswith(".weight"):
                out.update(_split_qkv(key, value, state))
            continue
        for old, new in _TOP_RENAMES:
            if key.startswith(old):
                key = new + key[len(old):]
        for old, new in _MODULE_RENAMES:
            key = key.replace(old, new)
        out[key] = value
    return out


def _split_qkv(key: str, weight: torch.Tensor, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    layer = key.removesuffix(".weight")
    rows, q = weight.shape[0], weight.shape[1]
    if rows <= q or (rows - q) % 2:
        raise ValueError(f"fused attention {key!r} is {list(weight.shape)}: not q ({q} rows) plus k and v of one size")
    sizes = [q, (rows - q) // 2, (rows - q) // 2]
    parts = {"weight": weight.split(sizes)}
    scale = state.get(layer + ".weight_scale")
    if scale is not None:
        parts["weight_scale"] = scale.split(sizes) if scale.numel() == rows else (scale,) * 3
    base = layer.removesuffix(".qkv")
    return {f"{base}.to_{x}.{param}": tensors[i] for param, tensors in parts.items() for i, x in enumerate("qkv")}


def qwen3_from_comfy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen3 text encoder's keys under their prefix (`model.` in ComfyUI's file, as in a causal LM; none in a
    Qwen3Model's) as Qwen3Model's; an `lm_head` (tied to the embeddings in Qwen3-4B) is dropped."""
    prefix = embeddings_prefix(state, "Qwen3")
    out, stray = {}, []
    for key, value in state.items():
        if key.startswith(prefix):
            out[key[len(prefix):]] = value
        elif not key.endswith("lm_head.weight"):
            stray.append(key)
    if stray:
        raise ValueError(f"Qwen3 weights with {len(stray)} tensors outside {prefix!r} (e.g. {stray[0]!r}): more than "
                         "a text encoder")
    return out


def embeddings_prefix(state: Mapping[str, torch.Tensor], model: str) -> str:
    """What a language model's keys start with before `embed_tokens.weight` (`model`: "Qwen3", "Mistral", how the
    error names it); a ValueError where no key ends so."""
    embed = next((k for k in state if k.endswith("embed_tokens.weight")), None)
    if embed is None:
        raise ValueError(f"{model} weights without embed_tokens.weight: not a {model} text encoder")
    return embed.removesuffix("embed_tokens.weight")


# -- reading a file: header checks, tensors, fp8 ---------------------------------------------------------------------

def _read(path: str, kind: Kind, max_bytes: int, config: Any = None) -> tuple[dict[str, torch.Tensor], Quantisation]:
    """The file's tensors in its own names, after its header was checked (kind, size, quantisation), each fp8 layer
    as `<layer>.weight` (fp8) with `<layer>.weight_scale` (float32 [1] or [out]); input scales and markers dropped."""
    try:
        with TensorFile(path, max_bytes) as f:
            formats = checked_formats(f, kind, config)
            state = f.read(k for k in f.header.tensors if not k.endswith(".comfy_quant"))
    except safe_files.FileChanged as e:
        raise ValueError(f"{path} {e}; {CHANGED_FIX}") from None
    except safe_files.UnusableFile as e:
        raise ValueError(f"{path} {e}") from None
    return fp8_layers(path, state, formats)


def checked_formats(f: TensorFile, kind: Kind, config: Any = None) -> dict[str, str]:
    """The open file's header checked (the kind asked for, its size against `config`, no quantisation diffgraph cannot
    read): each quantised layer's format as the file names it (`.comfy_quant` tensors, the only ones read here)."""
    shapes = {k: t.shape for k, t in f.header.tensors.items()}
    check_kind(f.path, kind, shapes, config)
    marks = f.read(k for k in f.header.tensors if k.endswith(".comfy_quant"))
    formats = _layer_formats(f.path, f.header.metadata, marks)
    _refuse_quantised(f.path, f.header.tensors, formats)
    return formats


def _read_gguf(path: str, kind: Kind, dtype: torch.dtype, device: torch.device | str | None,
               max_bytes: int, config: Any = None) -> dict[str, torch.Tensor]:
    """A GGUF file's tensors in the model's names (its own; a llama.cpp language model's in transformers', gguf_llm.py)
    and the shapes the model holds, dequantised to `dtype` on `device`, after its header was checked: the kind asked
    for (of `config`'s size, given one), every tensor of a type diffgraph reads."""
    try:
        with GgufFile(path, max_bytes) as f:
            check_kind(path, kind, f.shapes, config)
            return f.read(device=device, dtype=dtype)
    except safe_files.FileChanged as e:
        raise ValueError(f"{path} {e}; {CHANGED_FIX}") from None
    except safe_files.UnusableFile as e:
        raise ValueError(f"{path} {e}") from None


def check_kind(path: str, kind: Kind, shapes: dict[str, tuple[int, ...]], config: Any) -> None:
    """A ValueError naming what the file looks like unless its header's `shapes` are of `kind` (and of `config`'s
    size, given one); split_stream.py checks a header with it before any tensor is read."""
    keys = list(shapes)
    if kind == "transformer":
        ok = any("noise_refiner." in k for k in keys) and any("cap_embedder." in k for k in keys)
    elif kind == "flux2_transformer":
        ok = any("double_blocks." in k for k in keys) and any("single_stream_modulation." in k for k in keys)
    elif kind == "qwen_image_transformer":
        ok = any("txt_norm." in k for k in keys) and any(".img_mod." in k for k in keys)
    elif kind == "qwen25_text_encoder":  # Qwen2.5's attention has biases (Qwen3's has q_norm instead)
        ok = any(k.endswith("self_attn.q_proj.bias") for k in keys) and any(
            k.endswith("embed_tokens.weight") for k in keys)
    elif kind == "qwen_image_vae":  # Wan 2.1's original names (ComfyUI's file) or diffusers'
        ok = any(k.endswith(("decoder.middle.0.residual.0.gamma", "decoder.mid_block.resnets.0.norm1.gamma"))
                 for k in keys)
    elif kind == "text_encoder":
        ok = any(k.endswith("self_attn.q_norm.weight") for k in keys) and any(
            k.endswith("embed_tokens.weight") for k in keys)
    elif kind == "mistral_text_encoder":  # Llama's layout: no q/k norms (Qwen3), no attention biases (Qwen2)
        ok = any(k.endswith("embed_tokens.weight") for k in keys) and any(
            k.endswith("self_attn.q_proj.weight") for k in keys) and not any(
            k.endswith(("self_attn.q_norm.weight", "self_attn.q_proj.bias")) for k in keys)
    else:
        ok = any(k.endswith("encoder.conv_in.weight") for k in keys) and any(
            k.endswith("decoder.conv_in.weight") for k in keys)
    if not ok:
        raise ValueError(f"{path} is {_looks_like(shapes)}, not {_WANTED[kind]}; give {_WANTED[kind]}'s file here")
    if config is not None:
        _check_size(path, kind, shapes, config)


def _check_size(path: str, kind: Kind, shapes: dict[str, tuple[int, ...]], config: Any) -> None:
    get = config.get if isinstance(config, Mapping) else lambda name, default=None: getattr(config, name, default)
    if kind == "qwen_image_vae":
        found = next(s for k, s in shapes.items() if k.endswith(("decoder.conv1.weight", "decoder.conv_in.weight")))[1]
        if found != get("z_dim"):
            raise ValueError(f"{path} is a VAE of {found} latent channels; this model's has {get('z_dim')}; give the "
                             "VAE its model page names")
        return
    if kind == "vae":
        found = next(s for k, s in shapes.items() if k.endswith("decoder.conv_in.weight"))[1]
        if found != get("latent_channels"):
            raise ValueError(f"{path} is a VAE of {found} latent channels; this model's has "
                             f"{get('latent_channels')}; give the VAE its model page names")
        return
    layers = len({m[1] for k in shapes if (m := re.search(r"layers\.(\d+)\.", k))})
    if kind == "mistral_text_encoder":  # (its later layers are not read)
        if layers < get("num_hidden_layers"):
            raise ValueError(f"{path} is a language model of {layers} layers; this model reads the hidden states "
                             f"after layer {get('num_hidden_layers')}: give the text encoder its model page names")
        return
    if kind == "text_encoder":
        vocab, width = next(s for k, s in shapes.items() if k.endswith("embed_tokens.weight"))
        want = (get("vocab_size"), get("hidden_size"), get("num_hidden_layers"))
        if (vocab, width, layers) != want:
            raise ValueError(f"{path} is a Qwen3 text encoder of vocabulary {vocab}, width {width} and {layers} "
                             f"layers{_known(shapes, ' ({})')}; this model's has {want[0]}, {want[1]} and {want[2]}; "
                             "give the text encoder its model page names")


def _known(shapes: dict[str, tuple[int, ...]], template: str = "{}") -> str:
    """The kind split_files recognises by its key markers and sizes ("a FLUX.1 VAE ..."), in `template`; else ""."""
    for kinds in (*PARTS.values(), SPLIT_KINDS):
        found = next((k.label for k in kinds if k.signature.matches(shapes)), None)
        if found:
            return template.format(found if found.startswith(("a ", "an ")) else f"a {found} transformer")
    return ""


def _looks_like(shapes: dict[str, tuple[int, ...]]) -> str:
    """What a file is, in a few words: a kind split_files recognises, else by a key fragment, else its keys."""
    found = _known(shapes) or next((what for fragment, what in _LOOKS if any(fragment in k for k in shapes)), None)
    if found:
        return found
    sample = ", ".join(sorted({k.split(".")[0] for k in shapes})[:4]) or "no tensors"
    return f"a file of another kind (its keys start with {sample})"


def _layer_formats(path: str, metadata: dict[str, str], marks: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each quantised layer's format as the file names it: `_quantization_metadata`, then `.comfy_quant` tensors."""
    layers: dict[str, Any] = {}
    raw = metadata.get("_quantization_metadata")
    if raw is not None:
        try:
            parsed = safe_files.parse_json(raw)
        except safe_files.NotJson as e:
            raise ValueError(f"{path} has _quantization_metadata that {e}; download or convert it again") from None
        layers.update(parsed.get("layers", {}) if isinstance(parsed, dict) else {})
    for key, tensor in marks.items():
        try:
            layers[key.removesuffix(".comfy_quant")] = safe_files.parse_json(bytes(tensor.to(torch.uint8).tolist()))
        except safe_files.NotJson as e:
            raise ValueError(f"{path} has a {key!r} that {e}; download or convert it again") from None
    return {layer: str(conf.get("format") if isinstance(conf, dict) else conf) for layer, conf in layers.items()}


def _refuse_quantised(path: str, tensors: dict[str, safe_files.TensorInfo], formats: dict[str, str]) -> None:
    """One line naming the first quantisation diffgraph cannot read: nunchaku's SVDQuant by its keys, a named format
    that is not fp8, else what the dtypes of a layer's weight and scale say (int8, nvfp4, mxfp8, block-wise fp8)."""
    svd = next((k for k in tensors if k.endswith(SVDQUANT_SUFFIXES)), None)
    if svd is not None:
        raise ValueError(f"{path} is a nunchaku SVDQuant file (e.g. {svd!r}): its 4-bit layers need nunchaku's "
                         f"kernels, which diffgraph does not have; {USE_INSTEAD}")
    found = {layer: fmt for layer, fmt in formats.items() if fmt not in FP8_FORMATS}
    for key, t in tensors.items():
        layer = key.removesuffix(".weight")
        if key == layer or layer in found:
            continue
        scale = tensors.get(layer + ".weight_scale") or tensors.get(layer + ".scale_weight")
        if layer + ".weight_scale_2" in tensors or (t.dtype == "U8" and scale is not None):
            found[layer] = "nvfp4"
        elif t.dtype == "I8":
            found[layer] = "int8_blockwise" if scale is not None and len(scale.shape) == 2 else "int8_tensorwise"
        elif t.dtype in FP8_DTYPES and scale is not None and scale.dtype not in ("F32", "F16", "BF16"):
            found[layer] = "mxfp8"
        elif t.dtype in FP8_DTYPES and scale is not None and scale.numel not in (1, t.shape[0]):
            found[layer] = "block-wise fp8"
    if found:
        layer, fmt = next(iter(found.items()))
        same = sum(f == fmt for f in found.values())
        raise ValueError(f"{path} holds {same} layer{'s' if same > 1 else ''} quantised as {fmt} (e.g. {layer!r}), "
                         f"which diffgraph cannot read; {USE_INSTEAD}")


def fp8_layers(path: str, state: dict[str, torch.Tensor],
               formats: dict[str, str]) -> tuple[dict[str, torch.Tensor], Quantisation]:
    """The tensors with every fp8 weight's scale as `<layer>.weight_scale`, float32 [1] or [out] (1 where the file
    has none); the `scaled_fp8` marker and input scales dropped."""
    scaled = any(k == "scaled_fp8" or k.endswith(".scaled_fp8") for k in state)
    convention: Quantisation = "scaled_fp8" if scaled else "quantization_metadata" if formats else "none"
    out = {}
    for key, value in state.items():
        if key == "scaled_fp8" or key.endswith((".scaled_fp8", ".scale_input", ".input_scale", ".scale_weight",
                                                ".weight_scale")):
            continue
        out[key] = value
        layer = key.removesuffix(".weight")
        if key == layer or value.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            continue
        scale = state.get(layer + ".scale_weight", state.get(layer + ".weight_scale"))
        scale = torch.ones(1) if scale is None else scale.float().reshape(-1)
        if scale.numel() not in (1, value.shape[0]):
            raise ValueError(f"{path} has fp8 layer {layer!r} with {scale.numel()} scales for {value.shape[0]} rows: "
                             f"block-wise scales, which diffgraph cannot read; {USE_INSTEAD}")
        out[layer + ".weight_scale"] = scale
        convention = "fp8" if convention == "none" else convention
    return out, convention


def _finish(path: str, state: dict[str, torch.Tensor], convention: Quantisation, dtype: torch.dtype,
            keep_fp8: bool) -> FileWeights:
    """Floating tensors at `dtype`; each fp8 layer kept as an `Fp8Weight` (e4m3fn [out, in] weights, with keep_fp8)
    or dequantised."""
    out, kept = {}, {}
    for key, value in state.items():
        if key.endswith(".weight_scale"):
            continue
        layer = key.removesuffix(".weight")
        done = finish_tensor(value, state.get(layer + ".weight_scale") if key != layer else None, dtype, keep_fp8)
        if isinstance(done, Fp8Weight):
            kept[layer] = done
        else:
            out[key] = done
    return FileWeights(path, out, kept, convention)


def finish_tensor(value: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
                  keep_fp8: bool) -> torch.Tensor | Fp8Weight:
    """One tensor as `_finish` leaves it: a floating one at `dtype`; an fp8 weight with its `scale` kept as an
    `Fp8Weight` (keep_fp8, e4m3fn [out, in]) or dequantised on its device (weight.float() * scale, then `dtype`)."""
    if scale is None:
        return value.to(dtype) if value.is_floating_point() else value
    if keep_fp8 and value.dtype == torch.float8_e4m3fn and value.ndim == 2:
        return Fp8Weight(value, scale)
    return (value.float() * scale.to(value.device).reshape(-1, *[1] * (value.ndim - 1))).to(dtype)


# -- configs from the weights (a split file carries no config) --------------------------------------------------------

def _count(state: Mapping[str, Any], prefix: str) -> int:
    """How many numbered children `prefix` has ("layers." -> 30 for layers.0. .. layers.29.)."""
    return len({k[len(prefix):].split(".", 1)[0] for k in state if k.startswith(prefix)})


def transformer_config(state: Mapping[str, torch.Tensor], fp8: Mapping[str, Fp8Weight] = {}) -> dict[str, Any]:
    """ZImageTransformer2DModel's config for a state dict in its names (`read_transformer`'s): widths, layers and
    heads from the shapes; RoPE's axes split the head as the published model does (a quarter for the caption axis,
    three eighths for each image axis)."""
    def shape(key: str) -> tuple[int, ...]:
        return tuple(fp8[key[:-7]].weight.shape) if key.endswith(".weight") and key[:-7] in fp8 else \
            tuple(state[key].shape)
    dim, cap = shape("cap_embedder.1.weight")
    head = shape("layers.0.attention.norm_q.weight")[0]
    return dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=shape("all_x_embedder.2-1.weight")[1] // 4,
                dim=dim, n_layers=_count(state, "layers."), n_refiner_layers=_count(state, "noise_refiner."),
                n_heads=dim // head, n_kv_heads=shape("layers.0.attention.to_k.weight")[0] // head, cap_feat_dim=cap,
                axes_dims=[head // 4, head * 3 // 8, head * 3 // 8])


def qwen3_config(state: Mapping[str, torch.Tensor], fp8: Mapping[str, Fp8Weight] = {}) -> dict[str, Any]:
    """Qwen3Config's keywords for a Qwen3Model state dict (`read_text_encoder`'s); the rest Qwen3's defaults (RoPE
    theta 1e6, RMS eps 1e-6, 40960 positions)."""
    def shape(key: str) -> tuple[int, ...]:
        return tuple(fp8[key[:-7]].weight.shape) if key[:-7] in fp8 else tuple(state[key].shape)
    vocab, hidden = shape("embed_tokens.weight")
    head = shape("layers.0.self_attn.q_norm.weight")[0]
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=shape("layers.0.mlp.gate_proj.weight")[0],
                num_hidden_layers=_count(state, "layers."), head_dim=head,
                num_attention_heads=shape("layers.0.self_attn.q_proj.weight")[0] // head,
                num_key_value_heads=shape("layers.0.self_attn.k_proj.weight")[0] // head,
                max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def vae_config(path: str, base: Mapping[str, Any]) -> dict[str, Any]:
    """AutoencoderKL's config for a VAE file (original or diffusers names): `base` (the family's: scaling, shift,
    latent channels) with the levels' widths and blocks per level from the file's header."""
    try:
        shapes = header_shapes(path)
    except safe_files.UnusableFile as e:
        raise ValueError(f"{path} {e}") from None
    names = {k.split("first_stage_model.", 1)[-1].split("vae.", 1)[-1]: v for k, v in shapes.items()}
    ldm = any(k.startswith("encoder.down.") for k in names)
    level, block = ("encoder.down.", ".block.") if ldm else ("encoder.down_blocks.", ".resnets.")
    levels = _count(names, level)
    if not levels:
        raise ValueError(f"{path} holds no VAE encoder levels ({level}N.): it is not a VAE file")
    widths = tuple(names[f"{level}{i}{block}0.conv1.weight"][0] for i in range(levels))
    return {**dict(base), "block_out_channels": widths, "layers_per_block": _count(names, f"{level}0{block}"),
            "down_block_types": ("DownEncoderBlock2D",) * levels, "up_block_types": ("UpDecoderBlock2D",) * levels}
