"""What a single-file checkpoint holds, from its safetensors header alone; standard library only.

`inspect_checkpoint(path)` reads a `.safetensors` file's header and says what it holds: the architecture kind
(`checkpoint_configs.KINDS`: SD1.x, SD2.x base or v, SDXL base, their inpainting variants) from its key layout
(original Stable Diffusion names, as AUTOMATIC1111 and ComfyUI load them), the prediction type and zero-SNR marks
(`v_pred` / `ztsnr` keys, modelspec metadata), whether it carries its VAE. Files that are not such a checkpoint (a
LoRA, an embedding, a VAE, a ControlNet, an SD3, Flux or video model, a refiner, a diffusers component file) are
refused with one line naming what the file looks like; pickles (`.ckpt`, `.pt`, `.bin`) are refused before they
are opened (they can run code when unpickled). SD2's 512 epsilon and 768 v-prediction checkpoints have the same
keys: modelspec metadata or the file name (`512`, `base`, `768`) decide, else v with a warning naming
`--prediction-type`. The server checks a `--model` file with this before it starts, without torch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from .. import safe_files

logger = logging.getLogger(__name__)

PICKLE_EXTENSIONS = (".ckpt", ".pt", ".pth", ".bin", ".pkl")
UNET = "model.diffusion_model."
VAE = "first_stage_model."
SUPPORTED = ("supported: SD1.x, SD2.x and SDXL base checkpoints (and their inpainting variants) as one .safetensors "
             "file, diffusers folders, or presets")
_FIRST_CONV = UNET + "input_blocks.0.0.weight"
_TEXT_KEYS = {  # a text encoder key per layout: which layout's encoders the file carries
    "sd1": ("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight",
            "cond_stage_model.transformer.embeddings.token_embedding.weight"),
    "sd2": ("cond_stage_model.model.token_embedding.weight",),
    "sdxl-base": ("conditioner.embedders.1.model.token_embedding.weight",),
}
_CONTEXT_DIMS = {768: "SD1.x", 1024: "SD2.x", 2048: "SDXL"}
_INPAINT = {"sd1": "sd1-inpaint", "sdxl-base": "sdxl-inpaint"}


@dataclass(frozen=True)
class CheckpointInfo:
    """What a single-file checkpoint holds, read from its header."""

    path: str
    kind: str                    # a checkpoint_configs.KINDS key
    prediction_type: str | None  # marked in the file (v_pred key, modelspec), else None: the kind's default
    zero_snr: bool               # marked with a `ztsnr` key
    has_vae: bool
    dtype: str                   # the UNet's stored dtype ("F16", "BF16", "F32")
    note: str = ""               # how an ambiguous kind was decided (SD2 512 / 768)


def refuse_pickle(path: str) -> None:
    if path.lower().endswith(PICKLE_EXTENSIONS):
        raise ValueError(f"model {path!r} is a pickle checkpoint ({os.path.splitext(path)[1]}); diffgraph never "
                         "unpickles files to load them (they can run code): convert it first with `diffgraph convert "
                         f"{path} OUT.safetensors` (it rebuilds the tensors and runs nothing in the file)")


def inspect_checkpoint(path: str, max_bytes: int = 1 << 40) -> CheckpointInfo:
    """The checkpoint's kind and marks from its header; ValueError (one line) for anything else."""
    refuse_pickle(path)
    if not path.endswith(".safetensors"):
        raise ValueError(f"model {path!r} is a file but not a .safetensors checkpoint; {SUPPORTED}")
    try:
        header, _small = safe_files.read_header(path, max_bytes)  # refuses FIFOs and devices before opening
    except safe_files.UnusableFile as e:
        hint = " (it starts like a zip: a pickle .ckpt renamed .safetensors? convert it instead)" \
            if isinstance(e, safe_files.NotSafetensors) and _starts_with(path, b"PK") else ""
        raise ValueError(f"model {path!r} {e}{hint}") from None
    except OSError as e:
        raise ValueError(f"model {path!r} cannot be read ({e.strerror}); check the path and its permissions") from None
    return classify(path, {k: t.shape for k, t in header.tensors.items()},
                    {k: t.dtype for k, t in header.tensors.items()}, header.metadata)


def _starts_with(path: str, magic: bytes) -> bool:
    """Whether a file that read_header found regular (and not safetensors) starts with `magic`."""
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def classify(path: str, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str],
             metadata: dict[str, str]) -> CheckpointInfo:
    keys = shapes.keys()
    what = _foreign(keys)
    if what:
        raise ValueError(f"model {path!r} looks like {what}; {SUPPORTED}")
    if _FIRST_CONV not in shapes:
        sample = ", ".join(sorted({k.split(".")[0] for k in keys})[:5]) or "no tensors"
        raise ValueError(f"model {path!r} is not a Stable Diffusion checkpoint (no {_FIRST_CONV}; its keys start "
                         f"with {sample}); {SUPPORTED}")
    channels = shapes[_FIRST_CONV][1] if len(shapes[_FIRST_CONV]) == 4 else -1
    if channels not in (4, 9):
        extra = " (an instruct-pix2pix checkpoint)" if channels == 8 else ""
        raise ValueError(f"model {path!r} has a UNet with {channels} input channels{extra}; diffgraph takes 4 "
                         f"(text-to-image) or 9 (inpainting); {SUPPORTED}")
    layout = next((f for f, ks in _TEXT_KEYS.items() if any(k in shapes for k in ks)), None)
    if layout is None:
        if any(k.startswith("conditioner.embedders.0.model.") for k in keys):
            raise ValueError(f"model {path!r} looks like an SDXL refiner checkpoint (one OpenCLIP bigG text "
                             f"encoder); refiners are not supported; {SUPPORTED}")
        context = shapes.get(UNET + "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight") or \
            shapes.get(UNET + "input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight")
        guess = _CONTEXT_DIMS.get(context[1] if context and len(context) == 2 else 0, "Stable Diffusion")
        raise ValueError(f"model {path!r} is a {guess} checkpoint without its text encoders inside "
                         "(no cond_stage_model / conditioner keys); use the full checkpoint or its diffusers folder")
    prediction = _marked_prediction(shapes, metadata)
    kind, note = layout, ""
    if layout == "sd2":
        kind, note, prediction = _sd2_kind(path, channels == 9, prediction, metadata)
    elif channels == 9:
        kind = _INPAINT[layout]
    unet_dtype = dtypes.get(_FIRST_CONV, "F32")
    return CheckpointInfo(path=path, kind=kind, prediction_type=prediction, zero_snr="ztsnr" in shapes,
                          has_vae=VAE + "decoder.conv_in.weight" in shapes, dtype=unet_dtype, note=note)


def _foreign(keys: Any) -> str | None:
    """What a file that is not an SD checkpoint looks like, from its keys, or None."""
    def has(*parts: str) -> bool:
        return any(p in k for k in keys for p in parts)
    if has("lora_down", "lora_up", "lora_A.", "lora_B.", "hada_w1", "lokr_w1", ".lora."):
        return "a LoRA adapter, not a model: put it in --lora-dir and ask for it in a request's loras"
    if keys and set(keys) <= {"emb_params", "string_to_param", "string_to_token", "clip_l", "clip_g", "name", "step"}:
        return "a textual-inversion embedding: put it in --embeddings-dir and name it in prompts"
    if has("input_hint_block", "controlnet_cond_embedding", "control_model."):
        return "a ControlNet, not a model (ControlNets are not supported yet)"
    if has("joint_blocks."):
        return "an SD3 / SD3.5 checkpoint (an MMDiT), which is not supported"
    if has("double_blocks.", "single_blocks.", "single_transformer_blocks."):
        return "a Flux checkpoint, which is not supported"
    if has("time_stack", "time_mixer", "motion_modules", "temporal_transformer"):
        return "a video model (SVD / AnimateDiff layers), which is not supported"
    if not has(UNET) and has("encoder.conv_in.weight") and has("decoder.conv_in.weight"):
        return "a VAE file, not a model: give it with --vae"
    if not has(UNET) and has("down_blocks.0.resnets.0.conv1.weight"):
        return ("a diffusers-format component weights file: point --model at its pipeline folder (the one with "
                "model_index.json)")
    return None


def _marked_prediction(shapes: dict[str, tuple[int, ...]], metadata: dict[str, str]) -> str | None:
    if "v_pred" in shapes:
        return "v_prediction"
    marked = metadata.get("modelspec.prediction_type", "").lower()
    if marked in ("v", "v_prediction", "v-prediction"):
        return "v_prediction"
    if marked in ("epsilon", "eps"):
        return "epsilon"
    arch = metadata.get("modelspec.architecture", "").lower()
    return "v_prediction" if arch.endswith("-v") or "-v/" in arch else None


def _sd2_kind(path: str, inpaint: bool, prediction: str | None,
              metadata: dict[str, str]) -> tuple[str, str, str | None]:
    """SD2's 512 epsilon and 768 v checkpoints share every key: metadata, then the file name, then v."""
    if inpaint:
        return "sd2-inpaint", "", prediction
    arch, res = metadata.get("modelspec.architecture", ""), metadata.get("modelspec.resolution", "")
    if prediction == "v_prediction" or "768" in arch or res.startswith("768"):
        return "sd2-v", "v-prediction (marked in the file)", "v_prediction"
    if prediction == "epsilon" or "512" in arch or res.startswith("512"):
        return "sd2-base", "512 epsilon (marked in the file)", "epsilon"
    name = os.path.basename(path).lower()
    if "768" in name:
        return "sd2-v", "768 v-prediction (from the file name)", "v_prediction"
    if "512" in name or "base" in name:
        return "sd2-base", "512 epsilon (from the file name)", "epsilon"
    logger.warning("%s is an SD2 checkpoint that does not say whether it is the 768 v-prediction or the 512 epsilon "
                   "model; reading it as v-prediction (give --prediction-type epsilon for an SD2-base fine-tune)",
                   path)
    return "sd2-v", "v-prediction (SD2's default: not marked in the file)", None
