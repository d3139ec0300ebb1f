"""Loading single-file checkpoints: diffusers' single-file conversion, offline, from tensors streamed out of the file.

`load_single_file` reads a checkpoint that `checkpoint_kind.inspect_checkpoint` recognised as diffusers'
`from_single_file` would, with a config folder written by `checkpoint_configs.py` (or the user's `--model-config`), so
nothing is downloaded, but without a path for diffusers to map: the file is opened once (`safe_tensors.TensorFile`)
and each component (UNet, VAE, text encoders) is made by diffusers' own `load_single_file_sub_model` from a dict of
only its own tensors (`_own_keys`), streamed from the file just before straight to the model's device, where the
conversion runs and the parameters are made (`_component`: diffusers' model classes are given the `device` their
`from_single_file` places parameters on; CLIP text encoders are made by `_clip_text_model`, the steps of diffusers'
`create_diffusers_clip_model_from_ldm` with that device). So on a GPU the host holds one chunk buffer of the reader
while loading, and the GPU at most the modules already made plus one component's tensors as read (at the file's
dtype, or float32 for a float32 load), which become its parameters where their dtype and layout fit (the parameters
then add nothing); on the CPU, the same on the host. A file rewritten while it is read is a `FileChanged`, reported
in one line. The checkpoint's marks and the `LoadOptions` overrides (prediction type, zero
SNR) go into the scheduler config; `--vae` replaces the VAE (`load_vae`: a single file streamed into tensors by
`safe_tensors`, or a diffusers folder streamed by `stream_load`, on the model's device). Weights that are NaN or
infinite are refused by name, on the device they were made on.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch

from .. import safe_files
from ..config import LoadOptions
from ..safe_tensors import CHANGED_FIX, TensorFile, read_safetensors
from . import checkpoint_configs as C
from .checkpoint_kind import VAE, SUPPORTED, inspect_checkpoint, refuse_pickle
from .families import FamilyRegistry
from .model import DiffusionModel
from .stream_load import load_part

logger = logging.getLogger(__name__)
CONFIG_BYTES = 16 << 20  # a model folder's model_index.json (diffusers' are under 1 KB)


def load_single_file(path: str, device: torch.device, dtype: torch.dtype, name: str, families: FamilyRegistry,
                     options: LoadOptions, max_bytes: int) -> DiffusionModel:
    """The checkpoint's modules as a DiffusionModel, their parameters made on `device` at `dtype`."""
    import diffusers

    from .checkpoint_configs import config_folder
    from .clip_vocab import default_cache_root

    info = inspect_checkpoint(path, max_bytes)
    if not info.has_vae and options.vae is None:
        raise ValueError(f"model {path!r} has no VAE inside (no {VAE} keys); give one with --vae FILE_OR_FOLDER "
                         "(e.g. the VAE its model page names)")
    config = options.model_config or config_folder(info.kind, options.cache_dir or default_cache_root())
    pipeline_name = _pipeline_class(config)
    bad = safe_files.bad_json_file(config) if options.model_config else None  # (a user's folder: diffusers parses
    if bad is not None:                                                        # its tokenizers and configs unbounded)
        raise ValueError(f"model-config {config!r}: {bad[0]} {bad[1]}")
    adapter = families.for_pipeline(pipeline_name)
    if adapter is None:
        raise ValueError(f"model-config {config!r} is a {pipeline_name} folder, which is not supported; {SUPPORTED}")
    extra: dict[str, Any] = {}
    if options.vae is not None:
        extra["vae"] = load_vae(options.vae, dtype, config, max_bytes, device)
    if "safety_checker" in getattr(getattr(diffusers, pipeline_name), "_optional_components", ()):
        extra.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    try:
        pipe = _pipeline(path, getattr(diffusers, pipeline_name), config, dtype, extra, max_bytes, device)
    except safe_files.FileChanged as e:
        raise ValueError(f"model {path!r} {e}; {CHANGED_FIX}") from None
    except safe_files.UnusableFile as e:
        raise ValueError(f"model {path!r} {e}") from None
    except (KeyError, RuntimeError, ValueError) as e:  # a key layout or shapes the config does not fit
        what = C.DESCRIPTIONS[info.kind] if not options.model_config else f"--model-config {config!r}"
        raise ValueError(f"model {path!r} does not fit the {what} architecture ({_mismatch(e)}); if it is another "
                         "architecture, name its diffusers config folder with --model-config") from None
    _check_finite(path, [pipe.unet, pipe.vae, *(getattr(pipe, p[0]) for p in adapter.text_parts)])
    schedule = dict(pipe.scheduler.config)
    prediction = options.prediction_type or info.prediction_type
    if prediction:
        schedule["prediction_type"] = prediction
    if options.zero_snr if options.zero_snr is not None else info.zero_snr:
        schedule.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
    if info.note:
        logger.info("%s: read as %s: %s", path, C.DESCRIPTIONS[info.kind], info.note)
    unet, vae = pipe.unet, pipe.vae
    native = int(unet.config.sample_size) * 2 ** (len(vae.config.block_out_channels) - 1)
    index = dict(pipe.config)
    return DiffusionModel(
        name=name, family=adapter.name, adapter=adapter, denoiser=unet, vae=vae,
        text_encoders=[getattr(pipe, p[0]) for p in adapter.text_parts],
        tokenizers=[getattr(pipe, p[1]) for p in adapter.text_parts], scheduler_config=schedule, device=device,
        dtype=dtype, native_size=native,
        force_zeros_for_empty_prompt=bool(index.get("force_zeros_for_empty_prompt", adapter.force_zeros_default)))


def load_vae(source: str, dtype: torch.dtype, config: str, max_bytes: int,
             device: torch.device | str = "cpu") -> Any:
    """A VAE from a single file (original or diffusers layout) or a diffusers folder (an AutoencoderKL's, or a
    pipeline folder's vae/), read with `config`'s vae/config.json where the file carries no config, its tensors read
    straight to `device` and its parameters made there."""
    from diffusers import AutoencoderKL

    if os.path.isdir(source):
        sub = "vae" if os.path.isfile(os.path.join(source, "vae", "config.json")) else None
        if not os.path.isfile(os.path.join(source, sub or "", "config.json")):
            raise ValueError(f"vae {source!r} is a folder without a VAE config.json (or a vae/ subfolder with one); "
                             "give a diffusers AutoencoderKL folder or a .safetensors VAE file")
        return load_part(AutoencoderKL, source, f"vae {source!r}", sub, dtype, device=device)
    refuse_pickle(source)
    try:
        state = read_safetensors(source, max_bytes, device=device)
    except safe_files.FileChanged as e:
        raise ValueError(f"vae {source!r} {e}; {CHANGED_FIX}") from None
    except safe_files.UnusableFile as e:
        raise ValueError(f"vae {source!r} {e}") from None
    try:  # (a model class's from_single_file takes a state dict; only the pipeline's wants a path)
        return AutoencoderKL.from_single_file(state, config=config, subfolder="vae", local_files_only=True,
                                              torch_dtype=dtype, device=torch.device(device))
    except (KeyError, RuntimeError, ValueError) as e:
        raise ValueError(f"vae {source!r} is not a VAE of this model's architecture ({_mismatch(e)})") from None


def _pipeline(path: str, pipeline_class: type, config: str, dtype: torch.dtype, passed: dict[str, Any],
              max_bytes: int, device: torch.device | str = "cpu") -> Any:
    """The pipeline diffusers' `from_single_file(path, config=config, torch_dtype=dtype, **passed)` builds, each
    component made by `_component` from only its own tensors, streamed from the file to `device`."""
    from diffusers.loaders.single_file import SINGLE_FILE_OPTIONAL_COMPONENTS

    config_dict = pipeline_class.load_config(config)
    config_dict.pop("_ignore_files", None)
    expected, optional = pipeline_class._get_signature_keys(pipeline_class)
    init_dict, _unused, _ = pipeline_class.extract_init_dict(config_dict)
    init_kwargs = {**{k: init_dict.pop(k) for k in optional if k in init_dict},
                   **{k: v for k, v in passed.items() if k in optional}}
    # To float32 as read (diffusers converts every floating tensor to it, and widening is exact), so the file's dtype
    # is held one tensor at a time; a narrower load reads the file's dtype (diffusers keeps some modules in float32)
    read_as = torch.float32 if dtype == torch.float32 else None
    with TensorFile(path, max_bytes) as f:
        for name, (library, class_name) in sorted(init_dict.items()):
            if name in passed or library is None or name in SINGLE_FILE_OPTIONAL_COMPONENTS:
                continue
            own = f.read(_own_keys(name, list(f.header.tensors)), device=device, dtype=read_as)
            init_kwargs[name] = _component(library, class_name, name, own, config, dtype, torch.device(device))
            del own  # (the component's parameters hold what they use of it)
    missing = set(expected) - set(init_kwargs) - set(passed) - set(pipeline_class._optional_components)
    if missing:
        raise ValueError(f"the config folder's model_index.json names no {', '.join(sorted(missing))}")
    for name in set(expected) - set(init_kwargs):  # passed ones, and optional ones the config leaves out (None)
        init_kwargs[name] = passed.get(name)
    return pipeline_class(**init_kwargs)


def _component(library: str, class_name: str, name: str, checkpoint: dict[str, torch.Tensor], config: str,
               dtype: torch.dtype, device: torch.device) -> Any:
    """Component `name` as diffusers' `load_single_file_sub_model` makes it from `checkpoint` (tensors on `device`),
    its parameters made on `device` from those tensors, never copied through the host: a diffusers model's
    `from_single_file` is given the `device` it places them on, a CLIP text encoder is made by `_clip_text_model`,
    and tokenizers and schedulers (no tensors) come from the config folder as diffusers reads them."""
    import importlib

    from diffusers import FromOriginalModelMixin, pipelines
    from diffusers.loaders.single_file import load_single_file_sub_model
    from diffusers.loaders.single_file_utils import is_clip_model_in_single_file

    in_pipelines = hasattr(pipelines, library)
    cls = getattr(getattr(pipelines, library) if in_pipelines else importlib.import_module(library), class_name)
    if is_clip_model_in_single_file(cls, checkpoint):
        return _clip_text_model(cls, checkpoint, config, name, dtype, device)
    placed = {"device": device} if issubclass(cls, FromOriginalModelMixin) else {}
    return load_single_file_sub_model(
        library_name=library, class_name=class_name, name=name, checkpoint=checkpoint, pipelines=pipelines,
        is_pipeline_module=in_pipelines, cached_model_config_path=config, torch_dtype=dtype, local_files_only=True,
        **placed)


def _clip_text_model(cls: type, checkpoint: dict[str, torch.Tensor], config: str, name: str, dtype: torch.dtype,
                     device: torch.device) -> Any:
    """diffusers' `create_diffusers_clip_model_from_ldm(cls, checkpoint, name, config, dtype)` (its config, its
    choice of converter, its loading into meta parameters), with the parameters made on `device`, where it makes
    them on the CPU (it takes no device)."""
    from diffusers.loaders import single_file_utils as U

    model_config = cls.config_class.from_pretrained(config, subfolder=name, local_files_only=True)
    with U.init_empty_weights():
        model = cls(model_config)
    wrapped = hasattr(model, "text_model")
    width = (model.text_model if wrapped else model).embeddings.position_embedding.weight.shape[-1]

    def fits(kind: str) -> bool:
        return checkpoint[U.CHECKPOINT_KEY_NAMES[kind]].shape[-1] == width

    if U.is_clip_model(checkpoint) or (U.is_clip_sdxl_model(checkpoint) and fits("clip_sdxl")):
        state = U.convert_ldm_clip_checkpoint(checkpoint)
    elif U.is_clip_sd3_model(checkpoint) and fits("clip_sd3"):
        state = U.convert_ldm_clip_checkpoint(checkpoint, "text_encoders.clip_l.transformer.")
        state["text_projection.weight"] = torch.eye(width, device=device)
    elif U.is_open_clip_model(checkpoint):
        state = U.convert_open_clip_checkpoint(model, checkpoint, prefix="cond_stage_model.model.")
    elif U.is_open_clip_sdxl_model(checkpoint) and fits("open_clip_sdxl"):
        state = U.convert_open_clip_checkpoint(model, checkpoint, prefix="conditioner.embedders.1.model.")
    elif U.is_open_clip_sdxl_refiner_model(checkpoint):
        state = U.convert_open_clip_checkpoint(model, checkpoint, prefix="conditioner.embedders.0.model.")
    elif U.is_open_clip_sd3_model(checkpoint) and fits("open_clip_sd3"):
        state = U.convert_ldm_clip_checkpoint(checkpoint, "text_encoders.clip_g.transformer.")
    else:
        raise ValueError("The provided checkpoint does not seem to contain a valid CLIP model.")
    if not wrapped:
        state = {k.removeprefix("text_model."): v for k, v in state.items()}
    U.load_model_dict_into_meta(model, state, dtype=dtype, device_map={"": device})
    U.empty_device_cache()
    return model.to(device=device, dtype=dtype).eval()  # (buffers made at init, e.g. position ids, moved too)


def _own_keys(name: str, keys: list[str]) -> list[str]:
    """The checkpoint keys component `name`'s converter reads (diffusers' `single_file_utils`; none for the tokenizers
    and the scheduler, which come from the config folder). The first text encoder's also hold the marker tensors by
    which diffusers tells CLIP kinds apart (one small tensor each). SDXL's second text encoder gets its own keys only:
    diffusers picks an encoder's keys by its width, which both encoders share in small models."""
    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES, LDM_CLIP_PREFIX_TO_REMOVE, LDM_UNET_KEY, \
        LDM_VAE_KEYS

    markers = {CHECKPOINT_KEY_NAMES[k] for k in ("clip", "clip_sdxl", "clip_sd3", "open_clip", "open_clip_sdxl",
                                                 "open_clip_sdxl_refiner", "open_clip_sd3")}
    first = tuple(p.removesuffix("transformer.") for p in LDM_CLIP_PREFIX_TO_REMOVE)  # CLIP-L and OpenCLIP-H
    prefixes = {"unet": (LDM_UNET_KEY,), "vae": tuple(LDM_VAE_KEYS), "text_encoder": first,
                "text_encoder_2": ("conditioner.embedders.1.",)}.get(name, ())
    return [k for k in keys if k.startswith(prefixes) or (name == "text_encoder" and k in markers)]


def _mismatch(e: Exception) -> str:
    """diffusers' and torch's load errors in a few words: the first tensor whose shape or name does not fit."""
    text = str(e)
    shape = re.search(r"because (\S+) expected shape (torch\.Size\(\[[^]]*\]\)), but got (torch\.Size\(\[[^]]*\]\))",
                      text)
    if shape:
        return f"{shape.group(1)} is {shape.group(3)[11:-1]} in the file, {shape.group(2)[11:-1]} in the config"
    return f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}"


def read_model_index(folder: str) -> dict[str, Any]:
    """A diffusers folder's model_index.json as a dict; a file that is not a JSON object is a ValueError naming it."""
    path = os.path.join(folder, "model_index.json")
    try:
        index = safe_files.read_json(path, CONFIG_BYTES)[0]
    except safe_files.UnusableFile as e:
        why = e.why if isinstance(e, safe_files.NotJson) else str(e)
        raise ValueError(f"{path!r} {why}; restore the folder's model_index.json from its source") from None
    if not isinstance(index, dict):
        raise ValueError(f"{path!r} holds a JSON {type(index).__name__}, not an object; restore the folder's "
                         "model_index.json from its source")
    return index


def _pipeline_class(config: str) -> str:
    return str(read_model_index(config).get("_class_name"))


def _check_finite(path: str, modules: list[Any]) -> None:
    for module in modules:
        for pname, p in module.named_parameters():
            if p.is_meta:  # left at its empty initialisation: the file lacks it
                raise ValueError(f"model {path!r} lacks {type(module).__name__}.{pname} (not in the file); it is "
                                 "not a complete checkpoint of this architecture: check --model-config")
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                raise ValueError(f"model {path!r} holds NaN or infinite weights ({type(module).__name__}.{pname}); "
                                 "the file is damaged: download or convert it again")
