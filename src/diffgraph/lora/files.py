"""Reading LoRA adapter files (toward issue 12): local .safetensors files in the formats diffusers'
`load_lora_weights` takes for SD1.x/SD2.x and SDXL (diffusers/PEFT keys, kohya / A1111 keys with alphas), read by
diffusers' own `lora_state_dict` and key converters, into per-layer low-rank weights for `sidepath.LoraSlots`.

Only .safetensors files are adapters: a .bin/.pt/.ckpt file is a pickle, and loading one can run code. Kinds other
than plain LoRA on Linear layers and 1x1 convolutions (LoHa, LoKr, DoRA, a 3x3-convolution LoCon) are refused at
read time with a message naming what is unsupported. Each layer's scale is alpha / rank (kohya alphas), else 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

COMPONENTS = ("unet", "text_encoder", "text_encoder_2")
# key fragments of adapter kinds that are not plain LoRA -> their names
UNSUPPORTED = {"hada_": "LoHa", "lokr_": "LoKr", "dora_scale": "DoRA", "lora_magnitude_vector": "DoRA",
               ".lora_mid.": "LoCon with a Tucker mid weight", "ia3": "IA3", ".diff": "a full weight difference",
               ".diff_b": "a bias difference"}


class AdapterError(ValueError):
    """An adapter file that cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class LayerWeights:
    a: torch.Tensor   # [rank, in] (CPU, the file's dtype)
    b: torch.Tensor   # [out, rank]
    scale: float      # alpha / rank (1 without an alpha)

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class AdapterFile:
    name: str
    path: str | None
    version: tuple[int, int] | None                  # (size, mtime_ns) of the file read; None for a state dict
    layers: dict[str, dict[str, LayerWeights]]       # component -> module path in it -> weights

    @property
    def rank(self) -> int:
        return max((w.rank for part in self.layers.values() for w in part.values()), default=0)

    @property
    def targets(self) -> list[str]:
        return [f"{c}.{m}" for c, part in self.layers.items() for m in part]


def file_version(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def read_adapter(source: str | dict[str, torch.Tensor], pipeline_class: str, name: str) -> AdapterFile:
    """The adapter in `source` (a .safetensors path or a state dict) for a model of `pipeline_class` (e.g.
    "StableDiffusionPipeline", "StableDiffusionXLPipeline"). Raises AdapterError."""
    import diffusers

    path = version = None
    if isinstance(source, str):
        path = source
        if not path.endswith(".safetensors"):
            raise AdapterError(f"adapter {name!r}: {os.path.basename(path)} is not a .safetensors file; only "
                               "safetensors adapters are read (a .bin/.pt/.ckpt file is a pickle and loading one "
                               "can run code): convert it to .safetensors")
        if not os.path.isfile(path):
            raise AdapterError(f"adapter {name!r}: {path} does not exist")
        version = file_version(path)
        keys = _file_keys(path, name)
    else:
        keys = list(source)
    _refuse_unsupported(keys, name)
    try:
        state, alphas = getattr(diffusers, pipeline_class).lora_state_dict(source)[:2]
    except Exception as e:
        raise AdapterError(f"adapter {name!r} could not be read as a LoRA for {pipeline_class}: "
                           f"{type(e).__name__}: {e}") from None
    layers: dict[str, dict[str, LayerWeights]] = {}
    for component in COMPONENTS:
        part = {k[len(component) + 1:]: v for k, v in state.items() if k.startswith(component + ".")}
        if part:
            layers[component] = _layers(component, part, alphas or {}, name)
    known = {k for k in state if k.split(".", 1)[0] in COMPONENTS}
    if set(state) - known:
        extra = sorted(set(state) - known)[:3]
        raise AdapterError(f"adapter {name!r} has weights for no component diffgraph knows ({', '.join(extra)}...); "
                           f"components: {', '.join(COMPONENTS)}")
    if not layers:
        raise AdapterError(f"adapter {name!r} holds no LoRA weights")
    return AdapterFile(name=name, path=path, version=version, layers=layers)


def _file_keys(path: str, name: str) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # truncated, corrupt, not safetensors at all
        raise AdapterError(f"adapter {name!r}: {os.path.basename(path)} is not a readable safetensors file "
                           f"({type(e).__name__}: {e}); it may be truncated: copy it again") from None


def _refuse_unsupported(keys: list[str], name: str) -> None:
    for key in keys:
        for fragment, kind in UNSUPPORTED.items():
            if fragment in key:
                raise AdapterError(f"adapter {name!r} is {kind} (key {key!r}); diffgraph runs plain LoRA on Linear "
                                   "layers and 1x1 convolutions")


def _convert(component: str, part: dict[str, Any]) -> dict[str, Any]:
    """diffusers' converters: any of its LoRA key layouts -> PEFT keys (`module.lora_A.weight`)."""
    from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft, \
        convert_unet_state_dict_to_peft

    if any(".lora_A." in k or ".lora_B." in k for k in part):
        return part
    if component == "unet":
        return convert_unet_state_dict_to_peft(part)
    return convert_state_dict_to_peft(convert_state_dict_to_diffusers(part))


def _layers(component: str, part: dict[str, torch.Tensor], alphas: dict[str, float],
            name: str) -> dict[str, LayerWeights]:
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
        if a.ndim == 4 and a.shape[2:] != (1, 1):
            raise AdapterError(f"adapter {name!r}: {component}.{module} is a {a.shape[2]}x{a.shape[3]} convolution "
                               "LoRA (LoCon); diffgraph runs LoRA on Linear layers and 1x1 convolutions")
        a2, b2 = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        if b2.shape[1] != a2.shape[0]:
            raise AdapterError(f"adapter {name!r}: {component}.{module} has down rank {a2.shape[0]} but up rank "
                               f"{b2.shape[1]}")
        rank = a2.shape[0]
        alpha = module_alpha.get(module)
        out[module] = LayerWeights(a=a2, b=b2, scale=alpha / rank if alpha is not None else 1.0)
    unknown = [k for k in peft if not k.endswith((".lora_A.weight", ".lora_B.weight"))]
    if unknown:
        raise AdapterError(f"adapter {name!r} has keys diffgraph cannot use: {', '.join(unknown[:3])}")
    return out


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
