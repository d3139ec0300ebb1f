"""One loader for every model: local diffusers folders and single-file checkpoints (offline), and presets.

`load_model(name_or_path, device, dtype)` returns a `DiffusionModel`: the UNet, VAE, text encoders
and tokenizers of an SD1.x/SD2.x or SDXL-base pipeline, its scheduler config and its family. Nothing
is ever downloaded: folders are read with local_files_only, presets are built in code.

A folder's weight files are checked before diffusers reads them (present, and as long as their header says), so
that an incomplete copy fails with one line naming the file, not diffusers' traceback about a `.bin` fallback; so is
every JSON file of it (tokenizers, configs: nested too deep, not JSON), which transformers and diffusers parse
without a depth limit.
Then the family reads each component (`stream_load.load_part`, a `--vae` folder too): built from its config with
meta parameters and filled tensor by tensor from the checked reader, never a map of the file, so a model file
rewritten while it loads is a one-line error naming it, and one cut after it loaded changes nothing. A single file's sidecar (`NAME.diffgraph.toml`, sidecar.py) names the config folder it is read with. A file
in a ComfyUI split folder (`diffusion_models/`, `unet/`) is read with the companions split_files.py chooses for it.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import zipfile
from typing import Any

import torch

from .. import safe_files
from . import presets as P
from ..config import LoadOptions
from .checkpoint_configs import config_folder
from .clip_vocab import default_cache_root
from .families import FamilyRegistry, default_registry
from .model import DiffusionModel, parse_dtype
from .quiet import quiet_known_warnings
from .sidecar import read_sidecar, sidecar_path
from .single_file import CONFIG_BYTES, load_single_file, load_vae, read_model_index
from .split_files import SplitFiles, checked_part, models_root, preset_of, split_kind_of, split_model
from .weights_view import MODEL_FILE_LIMIT, WEIGHTS_EXT, weights_group

logger = logging.getLogger(__name__)

__all__ = ["DiffusionModel", "load_model", "parse_dtype"]



def _supported_message(families: FamilyRegistry) -> str:
    names = ", ".join({**P.available_presets(), **families.random_presets()})
    return (f"supported: a local diffusers folder of {' or '.join(families.pipeline_classes())} "
            f"(with model_index.json), an SD1.x / SD2.x / SDXL checkpoint file (.safetensors), or a preset: {names}")


def load_model(model: str, device: str | torch.device = "cpu", dtype: str | torch.dtype = "fp32",
               families: FamilyRegistry | None = None, options: LoadOptions | None = None) -> DiffusionModel:
    """Loads a preset, a local diffusers folder or a single-file checkpoint, with the family adapter `families` maps
    its pipeline class to (default: the built-in SD and SDXL families). `options`: a single file's config folder,
    prediction-type / zero-SNR overrides, a VAE in place of the model's. Errors list what is supported."""
    quiet_known_warnings()
    options = options or LoadOptions()
    loaded = _load_any(model, device, dtype, families or default_registry(), options)
    if options.vae_upcast is not None:  # over the VAE's own config (a single file is read with the model's config)
        loaded.vae.register_to_config(force_upcast=options.vae_upcast)
    return loaded


def _load_any(model: str, device: str | torch.device, dtype: str | torch.dtype, families: FamilyRegistry,
              options: LoadOptions) -> DiffusionModel:
    families = families or default_registry()
    device = torch.device(device)
    torch_dtype = parse_dtype(dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available on this machine; use the CPU "
                         "(device cpu, or leave the device out: it defaults to cuda only where there is one)")
    if device.type == "cuda" and device.index is None:  # the model lives on one numbered device
        device = torch.device("cuda", torch.cuda.current_device())
    owner = families.random_owner(model)
    if owner is not None or model in P.RANDOM_PRESETS:
        if options.vae or options.model_config:
            raise ValueError(f"{'vae' if options.vae else 'model-config'} needs a model folder or checkpoint file; "
                             f"preset {model!r} is built in code")
        if owner is not None:  # a family's own (a transformer family's tiny preset)
            logger.warning("model %s has random weights: its images are noise (use it for tests and timing)", model)
            built = owner.build_random(model, device, torch_dtype)
            built.is_random = True
            return _overridden(_finish(built), options)
        return _overridden(_build_random(P.RANDOM_PRESETS[model], device, torch_dtype, families), options)
    if model in P.SHIPPED_PRESETS:
        folder = P.shipped_preset_folder(model)
        if folder is None:
            raise ValueError(f"preset {model!r} is not shipped in this install; {_supported_message(families)}")
        return _load_folder(folder, device, torch_dtype, model, families, options)
    if os.path.isdir(model):
        return _load_folder(model, device, torch_dtype, model, families, options)
    if os.path.exists(model):  # a file: a single-file checkpoint (anything else is refused by what it holds)
        split = _split(model, options)
        if split is not None:
            return _finish(_load_split(split, device, torch_dtype, model, families))
        given = options
        options = _with_sidecar(model, options)
        try:
            return _finish(load_single_file(model, device, torch_dtype, model, families, options, MODEL_FILE_LIMIT))
        except ValueError as e:
            if options is given:
                raise
            raise ValueError(f"{e} (the config came from its sidecar {os.path.basename(sidecar_path(model))}: fix "
                             "or remove it)") from None
    close = difflib.get_close_matches(model, [*P.available_presets(), *families.random_presets()], n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"model {model!r} is neither a local folder nor a known preset; {_supported_message(families)}"
                     f"{hint}")


def _split(path: str, options: LoadOptions) -> SplitFiles | None:
    """The split model at `path` with its companions (split_files.split_model), those given by --text-encoder /
    --vae in place of the ones found and the --tokenizer folder in place of its sidecar's (for a kind that reads one;
    the others, and other models, leave it: the server's models share the flags); a file outside a split folder given
    with --text-encoder is one too (its kind read from its header). None: not a split model."""
    given = {"text_encoder": options.text_encoder, "vae": options.vae}
    if not any(given.values()):
        return split_model(path, options.tokenizer)
    kind = split_kind_of(path) if path.endswith((".safetensors", ".gguf")) else None
    if kind is None:
        if options.text_encoder:
            raise ValueError(f"--text-encoder is for split diffusion models (a DiT file with its text encoder and VAE "
                             f"in files of their own); {os.path.basename(path)} is not one: leave it out")
        return None  # a whole checkpoint with --vae: the VAE override as before
    chosen = {}
    for role, file in given.items():
        if file is None:
            found = split_model(path, options.tokenizer) if models_root(path) else None
            if found is None:
                raise ValueError(f"{os.path.basename(path)} is a {kind.label} diffusion model: give its "
                                 f"{role.replace('_', '-')} file too (--{role.replace('_', '-')} FILE)")
            file = found.files()[role]
        chosen[role] = checked_part(file, role, kind)
    side = read_sidecar(os.path.realpath(path))
    tokenizer = options.tokenizer or (side.tokenizer if side else None)
    return SplitFiles(kind, os.path.realpath(path), chosen["text_encoder"], chosen["vae"],
                      tuple((role, "flag" if given[role] else "only file") for role in given),
                      preset_of(kind, os.path.realpath(path), side),
                      os.path.realpath(tokenizer) if tokenizer and kind.tokenizer else None)


def _load_split(files: SplitFiles, device: torch.device, dtype: torch.dtype, name: str,
                families: FamilyRegistry) -> DiffusionModel:
    """A split diffusion model (split_files.py): the family that reads its kind loads it from `files`; a kind no
    family reads is refused naming the files that were chosen."""
    family = files.family
    if family is None or family not in {a.name for a in families.adapters()}:
        raise ValueError(f"{files.diffusion_model} is a {files.kind.label} diffusion model (text encoder "
                         f"{files.text_encoder}, VAE {files.vae}); no model family loads split files of it yet")
    return families.by_name(family).load_split(files, device, dtype, name)


def _with_sidecar(path: str, options: LoadOptions) -> LoadOptions:
    """The file's sidecar (sidecar.py), if it has one: its config folder (or its preset's) replaces --model-config."""
    side = read_sidecar(os.path.realpath(path))
    if side is None or not (side.config or side.checkpoint_preset()):
        return options
    config = side.config or config_folder(str(side.preset), options.cache_dir or default_cache_root())
    return dataclasses.replace(options, model_config=config)


def preset_modules(preset: P.RandomPreset, device: str | torch.device = "cpu",
                   vocab: int | None = None) -> tuple[Any, Any, list[Any]]:
    """A random preset's UNet, VAE and text encoders (`vocab`: another vocabulary size), built on `device`
    (torch.device("meta"): shapes only) from a fixed seed: the same preset gives the same weights on every run of one
    torch version and device type. Module initialisers draw from torch's default generators, so the seed is set
    inside fork_rng: the caller's generator states come back untouched."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        with device:  # on the target device: fast init for the full-size models
            unet = UNet2DConditionModel(**preset.unet)
            vae = AutoencoderKL(**preset.vae)
            encoders = []
            for cfg in preset.text_encoders:
                config = CLIPTextConfig(**({**cfg, "vocab_size": vocab} if vocab else cfg))
                cls = CLIPTextModelWithProjection if "projection_dim" in cfg else CLIPTextModel
                encoders.append(cls(config))
    return unet, vae, encoders


def _build_random(preset: P.RandomPreset, device: torch.device, dtype: torch.dtype,
                  families: FamilyRegistry) -> DiffusionModel:
    from .tokenizer import preset_tokenizer

    adapter = families.by_name(preset.family)
    logger.warning("model %s has random weights: its images are noise (use it for tests and timing)", preset.name)
    unet, vae, encoders = preset_modules(preset, device)
    model = DiffusionModel(
        name=preset.name, family=adapter.name, adapter=adapter, denoiser=unet, vae=vae, text_encoders=encoders,
        tokenizers=[preset_tokenizer(pad) for pad in preset.tokenizer_pads],
        scheduler_config=dict(P.SD_SCHEDULER_CONFIG), device=device, dtype=dtype,
        native_size=preset.native_size, force_zeros_for_empty_prompt=adapter.force_zeros_default, is_random=True,
    )
    return _finish(model)


def _place(module: Any, device: torch.device, dtype: torch.dtype) -> None:
    # Cast only when needed: diffusers warns on every dtype cast, even a no-op one.
    params = list(module.parameters())
    if not params:
        return
    if params[0].dtype != dtype:
        module.to(dtype=dtype)
    if params[0].device != device:
        module.to(device=device)
    module.eval().requires_grad_(False)


def _finish(model: DiffusionModel) -> DiffusionModel:
    for module in (model.denoiser, model.vae, *model.text_encoders):
        if isinstance(module, torch.nn.Module):
            _place(module, model.device, model.dtype)
    return model


def _overridden(model: DiffusionModel, options: LoadOptions) -> DiffusionModel:
    """The model with the options' prediction type and zero-SNR overrides in its scheduler config."""
    if options.prediction_type:
        model.scheduler_config["prediction_type"] = options.prediction_type
    if options.zero_snr is not None:
        model.scheduler_config["rescale_betas_zero_snr"] = options.zero_snr
        if options.zero_snr:
            model.scheduler_config["timestep_spacing"] = "trailing"
    return model


def _load_folder(folder: str, device: torch.device, dtype: torch.dtype, name: str,
                 families: FamilyRegistry, options: LoadOptions) -> DiffusionModel:
    index_path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index_path):
        raise ValueError(f"{folder!r} has no model_index.json, so it is not a diffusers pipeline folder; "
                         f"{_supported_message(families)}")
    index = read_model_index(folder)
    bad = safe_files.bad_json_file(folder)  # before transformers' and diffusers' readers parse them unbounded
    if bad is not None:
        raise ValueError(f"model folder {folder!r}: {bad[0]} {bad[1]}")
    cls_name = index.get("_class_name")
    adapter = families.for_pipeline(cls_name)
    if adapter is None:
        raise ValueError(f"{folder!r} holds a {cls_name}, which is not supported; {_supported_message(families)}")
    for sub in ("unet", "transformer", "vae", *(part[0] for part in adapter.text_parts)):
        _check_weights(folder, sub, index.get(sub))
    model = adapter.load_folder(folder, index, device, dtype, name)
    if options.vae:
        model.vae = load_vae(options.vae, dtype, folder, MODEL_FILE_LIMIT, device)
    return _finish(_overridden(model, options))


# a component's library (model_index.json) -> the weights file its save_pretrained writes
_WEIGHTS_NAME = {"diffusers": "diffusion_pytorch_model.safetensors", "transformers": "model.safetensors"}


def _check_weights(folder: str, sub: str, component: Any) -> None:
    """Raises ValueError naming the file when the model component in `folder/sub` (a folder with a config.json;
    others are the family's to refuse) has no weights, or the ones diffusers would read are cut short."""
    path = os.path.join(folder, sub)
    if not os.path.isfile(os.path.join(path, "config.json")):
        return
    try:  # read here, bounded, before diffusers reads it unbounded
        safe_files.read_json(os.path.join(path, "config.json"), CONFIG_BYTES)
    except safe_files.UnusableFile as e:
        raise ValueError(f"model folder {folder!r}: {sub}/config.json {e}") from None
    weights = sorted(f for f in os.listdir(path) if f.endswith(WEIGHTS_EXT))
    if not weights:
        library = component[0] if isinstance(component, list) and component else None
        expected = _WEIGHTS_NAME.get(library, "a .safetensors file")
        raise ValueError(f"model folder {folder!r} lacks the weights of its {sub!r}: {sub}/ has a config.json but no "
                         f"{expected}; copy the folder again completely (or re-save it with save_pretrained)")
    for name in weights_group(weights):
        problem = _weights_problem(os.path.join(path, name))
        if problem:
            raise ValueError(f"model folder {folder!r}: {sub}/{name} {problem}; copy or download that file again")


def _weights_problem(path: str) -> str | None:
    """What is wrong with a weights file, from its type, size and header alone, or None."""
    try:  # (a FIFO would block the open below for good; a dangling link is a missing file)
        size = safe_files.check_regular(path, MODEL_FILE_LIMIT).st_size
    except safe_files.UnusableFile as e:
        return str(e)
    if path.endswith(".bin"):  # torch.save's zip format ends with the zip directory, which a cut file lacks
        with open(path, "rb") as f:
            zipped = f.read(2) == b"PK"
        return f"is truncated ({size} bytes, no zip directory at its end)" if zipped and not zipfile.is_zipfile(path) \
            else None
    with open(path, "rb") as f:  # safetensors: 8 bytes of header length, a JSON header, then the tensor data
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else None
        if header_len is None or 8 + header_len > size:
            return f"is truncated ({size} bytes, less than its header)"
        if header_len > 100_000_000:  # safetensors' own bound: not a header, so not a safetensors file
            return "is not a readable safetensors file (its header is damaged)"
        try:
            header = safe_files.parse_json(f.read(header_len), max_depth=3)
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):  # (NotJson is a ValueError)
            return "is not a readable safetensors file (its header is damaged)"
    if 8 + header_len + end > size:
        return f"is truncated ({size} bytes of the {8 + header_len + end} its header describes)"
    return None
