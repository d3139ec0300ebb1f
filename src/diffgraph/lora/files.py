"""Reading LoRA adapter files: local .safetensors files in the formats diffusers'
`load_lora_weights` takes for SD1.x/SD2.x and SDXL (diffusers/PEFT keys, kohya / A1111 keys with alphas), read by
diffusers' own `lora_state_dict` and key converters, into per-layer low-rank weights for `sidepath.LoraSlots`.

Only .safetensors files are adapters: a .bin/.pt/.ckpt file is a pickle, and loading one can run code. Plain LoRA
on Linear layers and convolutions is read: a convolution's down weight [rank, in, kh, kw] (LoCon: the ResNet
blocks' conv1/conv2, the samplers' convs, as kohya LoCon files and few-step adapters such as LCM-LoRA, TCD and
Hyper-SD ship them) is kept flattened [rank, in * kh * kw] with its kernel size, its up weight is [out, rank] (a
1x1 [out, rank, 1, 1]). k x k convolution weights are read when the caller asks (`convolutions=True`: the LoRA
manager, which then decides per layer whether a side path runs it); without it they are refused by name. Kinds
other than plain LoRA (LoHa, LoKr, DoRA, LoCon's Tucker mid weights, IA3, full weight differences, a k x k up
weight) are refused at read time with a message naming what is unsupported. Each layer's scale is alpha / rank
(kohya alphas), else 1.

A file is read into memory (safe_tensors.TensorFile: streamed into the tensors, never a memory map that a writer
can cut under us), after its header says its tensors are floating point (catalog.check_dtype). A file that changes while
it is read raises `AdapterChanged`: the caller reads it again. Each layer's largest change, ||B|| ||A|| alpha/rank,
must be finite and at most `EFFECT_LIMIT` (a huge-but-finite adapter would overflow the model into a black
image). `header_adapter` is the same reading from the header alone (meta tensors: layouts, names and shapes
checked, values not), for listings.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..safe_files import FileChanged, FileStamp, SafetensorsHeader, UnusableFile, read_header
from ..safe_tensors import DTYPES, TensorFile
from .catalog import MAX_ADAPTER_BYTES, check_dtype
from .targets import LoraLayout, unet_layout

# key fragments of adapter kinds that are not plain LoRA -> their names
UNSUPPORTED = {"hada_": "LoHa", "lokr_": "LoKr", "dora_scale": "DoRA", "lora_magnitude_vector": "DoRA",
               ".lora_mid.": "LoCon with a Tucker mid weight", "ia3": "IA3", ".diff": "a full weight difference",
               ".diff_b": "a bias difference"}
# a layer's change at request scale 8 (request_inputs.MAX_LORA_SCALE) stays within fp16's range for a unit input
EFFECT_LIMIT = 65504.0 / 8
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# a UNet's block names in any of its adapters' key layouts (kohya's underscores, diffusers' and LDM's dots)
_UNET_KEY = re.compile(r"(^|[._])(down_blocks|up_blocks|mid_block|input_blocks|output_blocks|middle_block)[._]")


class AdapterError(ValueError):
    """An adapter file that cannot be used; the message says why and what to do."""


class AdapterChanged(AdapterError):
    """The file changed while it was read: read it again for its new version."""


@dataclass(frozen=True)
class LayerWeights:
    a: torch.Tensor   # [rank, in] (CPU, the file's dtype); a convolution's [rank, in * kh * kw]
    b: torch.Tensor   # [out, rank]
    scale: float      # alpha / rank (1 without an alpha)
    kernel: tuple[int, int] | None = None  # (kh, kw) of a convolution's down weight (the file's 4-d one), else None

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class AdapterFile:
    name: str
    path: str | None
    version: tuple[int, int] | None                  # (size, mtime_ns) of the file read; None for a state dict
    layers: dict[str, dict[str, LayerWeights]]       # component -> module path in it -> weights
    stamp: FileStamp | None = None                   # the full version read (inode and device too)

    @property
    def rank(self) -> int:
        return max((w.rank for part in self.layers.values() for w in part.values()), default=0)

    @property
    def targets(self) -> list[str]:
        return [f"{c}.{m}" for c, part in self.layers.items() for m in part]


def read_adapter(source: str | dict[str, torch.Tensor], layout: LoraLayout | str, name: str,
                 convolutions: bool = False) -> AdapterFile:
    """The adapter in `source` (a .safetensors path or a state dict) for a model of `pipeline_class` (e.g.
    "StableDiffusionPipeline", "StableDiffusionXLPipeline"); `convolutions`: read k x k convolution weights (LoCon)
    too, else refuse them. Raises AdapterError (AdapterChanged: read it again)."""
    if not isinstance(source, str):
        for key, t in source.items():
            check_dtype(name, key, DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch.")), t.numel())
        return _adapter(dict(source), layout, name, None, None, convolutions)
    _refuse_pickle(source, name)
    header, state = _read(_tensors, source, name, name)
    return _adapter(state, layout, name, source, header.stamp, convolutions)


def _tensors(path: str, max_bytes: int, name: str) -> tuple[SafetensorsHeader, dict[str, torch.Tensor]]:
    """The file's header and tensors, its dtypes checked on the header before any tensor is read."""
    with TensorFile(path, max_bytes) as f:
        for key, t in f.header.tensors.items():
            check_dtype(name, key, t.dtype, t.numel)
        return f.header, f.read()


def header_adapter(path: str, layout: LoraLayout | str, name: str, convolutions: bool = False) -> AdapterFile:
    """The adapter of file `path` as its header describes it: its layers' weights are meta tensors (shapes and
    layout checked, as read_adapter does, but no values), its alphas real. For listings: reads the header only."""
    _refuse_pickle(path, name)
    header, small = _read(read_header, path, name, 16)
    state = {}
    for key, t in header.tensors.items():
        check_dtype(name, key, t.dtype, t.numel)
        dtype = DTYPES[t.dtype]
        state[key] = torch.frombuffer(bytearray(small[key]), dtype=dtype).reshape(t.shape) if key in small else \
            torch.empty(t.shape, dtype=dtype, device="meta")
    return _adapter(state, layout, name, path, header.stamp, convolutions)


def _refuse_pickle(path: str, name: str) -> None:
    if not path.endswith(".safetensors"):
        raise AdapterError(f"adapter {name!r}: {os.path.basename(path)} is not a .safetensors file; only "
                           "safetensors adapters are read (a .bin/.pt/.ckpt file is a pickle and loading one "
                           "can run code): convert it to .safetensors")


def _read(reader: Any, path: str, name: str, *args: Any) -> Any:
    try:
        return reader(path, MAX_ADAPTER_BYTES, *args)
    except FileChanged as e:
        raise AdapterChanged(f"adapter {name!r}: {os.path.basename(path)} {e}") from None
    except UnusableFile as e:
        raise AdapterError(f"adapter {name!r}: {os.path.basename(path)} {e}") from None


def _adapter(state: dict[str, torch.Tensor], layout: LoraLayout | str, name: str, path: str | None,
             stamp: FileStamp | None, convolutions: bool = False) -> AdapterFile:
    import diffusers

    _refuse_unsupported(list(state), name)
    if isinstance(layout, str):  # an SD pipeline class: its components
        layout = unet_layout(layout, 1)
    if layout.components and layout.denoiser_component != "unet":
        _refuse_unet(list(state), name, layout)
    pipeline_class, components = layout.pipeline_class, layout.names
    try:
        if layout.prepare is not None:
            state = layout.prepare(state)
        if pipeline_class is None:  # PEFT keys as they are (`component.module.lora_A.weight`, `....alpha`)
            alphas = {k: float(v) for k, v in state.items() if k.endswith(".alpha")}
            state = {k: v for k, v in state.items() if not k.endswith(".alpha")}
        else:
            read = getattr(diffusers, pipeline_class).lora_state_dict(state)
            # the SD readers return (state, alphas); the DiT ones the state, their alphas applied to the weights
            state, alphas = (read, {}) if isinstance(read, dict) else read[:2]
    except Exception as e:
        raise AdapterError(f"adapter {name!r} could not be read as a LoRA for {pipeline_class}: "
                           f"{type(e).__name__}: {e}") from None
    layers: dict[str, dict[str, LayerWeights]] = {}
    for component in components:
        part = {k[len(component) + 1:]: v for k, v in state.items() if k.startswith(component + ".")}
        if part:
            try:
                layers[component] = _layers(component, part, alphas or {}, name, convolutions)
            except AdapterError:
                raise
            except (KeyError, RuntimeError, ValueError) as e:  # diffusers' converters on a layout they do not know
                raise AdapterError(f"adapter {name!r}: its {component} weights could not be read as a LoRA "
                                   f"({type(e).__name__}: {e})") from None
    known = {k for k in state if k.split(".", 1)[0] in components}
    if set(state) - known:
        extra = sorted(set(state) - known)[:3]
        raise AdapterError(f"adapter {name!r} has weights for no component diffgraph knows ({', '.join(extra)}...); "
                           f"components: {', '.join(components)}")
    if not layers:
        raise AdapterError(f"adapter {name!r} holds no LoRA weights")
    return AdapterFile(name=name, path=path, version=tuple(stamp[:2]) if stamp else None, layers=layers, stamp=stamp)


def _refuse_unsupported(keys: list[str], name: str) -> None:
    for key in keys:
        for fragment, kind in UNSUPPORTED.items():
            if fragment in key:
                raise AdapterError(f"adapter {name!r} is {kind} (key {key!r}); diffgraph runs plain LoRA (on Linear "
                                   "layers and convolutions): merge it into a checkpoint with its own tool instead")


def _refuse_unet(keys: list[str], name: str, layout: LoraLayout) -> None:
    """A UNet's adapter (SD1.x/2.x, SDXL: kohya, diffusers or LDM keys) for a transformer family is refused by what it
    is, before the family's converter makes its keys into names the model lacks."""
    key = next((k for k in keys if _UNET_KEY.search(k)), None)
    if key is not None:
        raise AdapterError(f"adapter {name!r} is a LoRA for a Stable Diffusion UNet (key {key!r}), not for this "
                           f"model's transformer; use a LoRA made for {layout.pipeline_class or 'this model'}")


def _convert(component: str, part: dict[str, Any]) -> dict[str, Any]:
    """diffusers' converters: any of its LoRA key layouts -> PEFT keys (`module.lora_A.weight`)."""
    from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft, \
        convert_unet_state_dict_to_peft
    from diffusers.utils.state_dict_utils import StateDictType

    if any(".lora_A." in k or ".lora_B." in k for k in part):
        return part
    if component == "unet":
        return convert_unet_state_dict_to_peft(part)
    # diffusers makes kohya text-encoder keys its old layout (`self_attn.to_q_lora.down`), which its converter
    # recognises only by a `to_out_lora` key: a file without out_proj layers (q/k/v only) is said so here
    old = StateDictType.DIFFUSERS_OLD if any("_lora.down." in k or "_lora.up." in k for k in part) else None
    return convert_state_dict_to_peft(convert_state_dict_to_diffusers(part, old))


def _layers(component: str, part: dict[str, torch.Tensor], alphas: dict[str, float],
            name: str, convolutions: bool = False) -> dict[str, LayerWeights]:
    peft = _convert(component, part)
    # the alphas' keys are in the file's layout: convert them as weight keys to find their modules
    mine = {k[len(component) + 1:-len(".alpha")]: float(v) for k, v in alphas.items()
            if k.startswith(component + ".") and k.endswith(".alpha")}
    module_alpha = {k: v for k, v in mine.items() if not k.endswith(".weight")}
    # old attention-processor keys: their modules are what the converter makes of them (converted together, as the
    # converter infers the layout from the whole dict; each carries its index to be found again)
    old = [k for k in mine if k.endswith(".weight")]
    if old:
        for key, index in _convert(component, {k: torch.tensor([i]) for i, k in enumerate(old)}).items():
            module_alpha[key.split(".lora_")[0]] = mine[old[int(index)]]
    out: dict[str, LayerWeights] = {}
    modules = sorted({k.split(".lora_")[0] for k in peft})
    for module in modules:
        a, b = peft.get(f"{module}.lora_A.weight"), peft.get(f"{module}.lora_B.weight")
        if a is None or b is None:
            raise AdapterError(f"adapter {name!r}: {component}.{module} lacks its "
                               f"{'down (lora_A)' if a is None else 'up (lora_B)'} weight; the file is incomplete")
        if a.ndim not in (2, 4) or b.ndim not in (2, 4):
            raise AdapterError(f"adapter {name!r}: {component}.{module} has a {a.ndim}-d down and a {b.ndim}-d up "
                               "weight; LoRA weights are 2-d (Linear) or 4-d (convolution): the file is not a LoRA")
        if b.ndim == 4 and b.shape[2:] != (1, 1):
            raise AdapterError(f"adapter {name!r}: {component}.{module} has a {b.shape[2]}x{b.shape[3]} up weight; "
                               "diffgraph runs LoRA with 1x1 up weights (a LoCon's [out, rank, 1, 1])")
        if a.ndim == 4 and a.shape[2:] != (1, 1) and not convolutions:
            raise AdapterError(f"adapter {name!r}: {component}.{module} is a {a.shape[2]}x{a.shape[3]} convolution "
                               "LoRA (LoCon), read only with read_adapter(..., convolutions=True)")
        if 0 in a.shape or 0 in b.shape:
            raise AdapterError(f"adapter {name!r}: {component}.{module} has an empty weight (down {list(a.shape)}, "
                               f"up {list(b.shape)}); the file is not a usable LoRA: export it again")
        kernel = tuple(a.shape[2:]) if a.ndim == 4 else None
        a2, b2 = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        if b2.shape[1] != a2.shape[0]:
            raise AdapterError(f"adapter {name!r}: {component}.{module} has down rank {a2.shape[0]} but up rank "
                               f"{b2.shape[1]}")
        rank = a2.shape[0]
        alpha = module_alpha.get(module)
        out[module] = w = LayerWeights(a=a2, b=b2, scale=alpha / rank if alpha is not None else 1.0, kernel=kernel)
        _check_effect(w, f"{component}.{module}", name)
    unknown = [k for k in peft if not k.endswith((".lora_A.weight", ".lora_B.weight"))]
    if unknown:
        raise AdapterError(f"adapter {name!r} has keys diffgraph cannot use: {', '.join(unknown[:3])}")
    return out


def _check_effect(w: LayerWeights, layer: str, name: str) -> None:
    """||B|| ||A|| alpha/rank (Frobenius norms: a bound on the layer's change for a unit input, a convolution's for
    a unit input patch) is finite and at most EFFECT_LIMIT. Meta tensors (a header's layers) have no values to
    check."""
    if w.a.is_meta or w.b.is_meta:
        return
    norms = [_norm(t, torch.float32) for t in (w.a, w.b)]
    if not all(math.isfinite(n) for n in norms):  # inf/nan weights, or a sum of squares past fp32: look closer
        norms = [_norm(t, torch.float64) for t in (w.a, w.b)]
    effect = norms[0] * norms[1] * abs(w.scale)
    if not math.isfinite(effect) and not all(math.isfinite(n) for n in norms):
        raise AdapterError(f"adapter {name!r} has non-finite weights in {layer} (inf or NaN); the file is broken: "
                           "export it again")
    if not effect <= EFFECT_LIMIT:
        raise AdapterError(f"adapter {name!r}: {layer} changes its layer by up to {effect:.3g} (||B|| * ||A|| * "
                           f"alpha/rank), above the limit {EFFECT_LIMIT:g}; such weights overflow the model into a "
                           "black or NaN image: they are scaled wrongly (export the adapter again)")


def _norm(t: torch.Tensor, dtype: torch.dtype) -> float:
    # (a flat dot product: on the CPU, vector_norm(fp16 weights, dtype=float32) is far slower)
    flat = t.to(dtype).reshape(-1)
    return math.sqrt(float(torch.dot(flat, flat)))


def module_path(root: torch.nn.Module, path: str, names: "set[str] | None" = None) -> str | None:
    """`path` as it exists in `root`, or None. CLIP text models lost their `text_model.` level in transformers 5,
    while kohya files (and diffusers' conversion of them) keep it: both spellings are tried. `names`: the module
    names of `root`, when the caller looks up many paths (an SDXL adapter has over a thousand)."""
    if names is None:
        names = {name for name, _ in root.named_modules()}
    for candidate in (path, path.removeprefix("text_model."), f"text_model.{path}"):
        if candidate in names:
            return candidate
    return None
