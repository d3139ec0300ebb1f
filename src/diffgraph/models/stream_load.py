"""`load_part`: one component folder of a diffusers or transformers model (a UNet, VAE, transformer, ControlNet, text
or image encoder, tiny decoder), as its class's `from_pretrained` would load it, read without ever mapping the user's
file.

The module is built from its config.json with its parameters on the meta device (no memory; its buffers are made as
its constructor makes them, in the requested dtype, as `from_pretrained` makes them), then filled tensor by tensor:
each tensor is read by `safe_tensors.TensorFile` (streamed in chunks straight into the tensor, on the host or on
`device`, the file's size and mtime checked between chunks and its path at the end), converted to the dtype
`from_pretrained` gives it, and assigned in place of its meta parameter before the next one is read. Host memory
while loading is the module's own tensors plus one tensor at the file's dtype; on a device, the reader's one chunk
buffer.

What `from_pretrained` does beside reading is done the same way: the files it reads (`{stem}.safetensors`, the
`variant`'s, or the shards a `*.safetensors.index.json` names), its key renames (diffusers' old attention-block
names in an unsharded file; transformers' checkpoint renames and base-model prefix), `_keep_in_fp32_modules`, tied
weights (`tie_weights`), eval mode. Tensors the module has no place for are not read; a parameter or persistent
buffer the files lack is an `UnreadableWeights` naming the folder, the file and the tensor, as is a file that cannot
be read (`FileChanged` included: "wait until it is written completely ...") and a JSON file of the folder nested
too deep or not JSON (`safe_files.bad_json_file`, before the library parses its config). Folders with only pickle (`.bin`)
weights are read by `from_pretrained` itself, through private copies (`weights_view`).

Meta parameters come from a patch of `Module.register_parameter` that acts on the building thread alone (modules
other threads make meanwhile are real); the default dtype is process-wide while a module is built, as under
`from_pretrained`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Iterator, TypeVar

import torch

from .. import safe_files
from ..safe_tensors import TensorFile
from .weights_view import MODEL_FILE_LIMIT, UnreadableWeights, unreadable, weights_view

M = TypeVar("M", bound=torch.nn.Module)
INDEX_LIMIT = 64 << 20  # bytes of a shard index (a 20B model's: ~100 KB)
STEMS = {"diffusers": "diffusion_pytorch_model", "transformers": "model"}  # save_pretrained's weights file names

_empty = threading.local()      # set while this thread builds a module with meta parameters
_build_lock = threading.Lock()  # one patched build at a time (the patch and the default dtype are process-wide)


def load_part(cls: type[M], folder: str, label: str, sub: str | None = None, dtype: torch.dtype | None = None,
              variant: str | None = None, device: torch.device | str | None = None, pickle: bool = True) -> M:
    """The `cls` module (a diffusers ModelMixin or transformers PreTrainedModel class; transformers' AutoModel picks
    the class of the config) of `folder/sub`, in `dtype` (None: the config's default, float32), its parameters read to
    `device` (default the host) and its buffers moved there. `label` names `folder` in errors ("model folder '/m'").
    `pickle=False`: a folder without safetensors weights is a ValueError (from_pretrained's use_safetensors=True)."""
    path = os.path.join(folder, sub) if sub else folder
    bad = safe_files.bad_json_file(path)  # its config, before the library's reader parses it unbounded
    if bad is not None:
        raise UnreadableWeights(f"{label}: {_rel(sub, bad[0])} {bad[1]}")
    library = "diffusers" if _is_diffusers(cls) else "transformers"
    found = _safetensors_files(path, STEMS[library], variant, label, sub)
    if found is None and not pickle:
        raise ValueError(f"no file named {STEMS[library]}.safetensors in {path!r}; save the model with "
                         "save_pretrained(safe_serialization=True)")
    if found is None:  # pickle weights only: from_pretrained reads private copies
        return _from_pretrained(cls, folder, label, sub, dtype, variant, library)
    files, index = found
    cls = _concrete(cls, path)
    model = _meta_module(cls, path, dtype, library)
    loaded = _read_into(model, path, files, index is not None, dtype, device, library, label, sub)
    _check_complete(model, loaded, _rel(sub, index or files[0]), label)
    if library == "diffusers":
        model.register_to_config(_name_or_path=path)
    else:  # (as from_pretrained leaves the config)
        model.config.name_or_path = path
        if dtype is not None:
            model.config.dtype = dtype
    if device is not None:
        model.to(device)  # its buffers (the parameters are there already)
    return model.eval()


def _is_diffusers(cls: type) -> bool:
    from diffusers import ModelMixin

    return issubclass(cls, ModelMixin)


def _concrete(cls: type[M], path: str) -> type[M]:
    """transformers' AutoModel: the base-model class its config.json names (as AutoModel.from_pretrained picks)."""
    from transformers import AutoConfig, AutoModel

    if cls is not AutoModel:
        return cls
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    return MODEL_MAPPING[type(AutoConfig.from_pretrained(path, local_files_only=True))]


def _safetensors_files(path: str, stem: str, variant: str | None, label: str,
                       sub: str | None) -> tuple[list[str], str | None] | None:
    """The safetensors files from_pretrained reads in `path` (one, or the shards its index names) and the index's
    name (None: one file), or None when there are none (pickle weights, if any, are from_pretrained's to read)."""
    tag = f".{variant}" if variant else ""
    index = f"{stem}.safetensors.index{tag}.json"
    if not os.path.isfile(os.path.join(path, index)):
        single = f"{stem}{tag}.safetensors"
        return ([single], None) if os.path.lexists(os.path.join(path, single)) else None
    try:
        weight_map = safe_files.read_json(os.path.join(path, index), INDEX_LIMIT)[0]
    except safe_files.UnusableFile as e:
        raise unreadable(label, _rel(sub, index), e) from None
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UnreadableWeights(f"{label}: {_rel(sub, index)} has no weight_map of tensor names to files; copy or "
                                "download that file again")
    names = sorted(set(weight_map.values()), key=str)
    bad = next((n for n in names if not isinstance(n, str) or os.path.basename(n) != n
                or not n.endswith(".safetensors")), None)
    if bad is not None:
        raise UnreadableWeights(f"{label}: {_rel(sub, index)} names {str(bad)[:200]!r}, not a .safetensors file "
                                "beside it; copy or download that file again")
    return names, index


def _from_pretrained(cls: type[M], folder: str, label: str, sub: str | None, dtype: torch.dtype | None,
                     variant: str | None, library: str) -> M:
    options = {"torch_dtype": dtype, "variant": variant} if library == "diffusers" else {"dtype": dtype}
    with weights_view(folder, label, [sub or "."]) as view:
        return cls.from_pretrained(os.path.join(view, sub) if sub else view, local_files_only=True, **options)


@contextlib.contextmanager
def _meta_parameters(dtype: torch.dtype | None) -> Iterator[None]:
    """Modules made by this thread inside get their parameters on the meta device (their buffers stay real); the
    default dtype is `dtype` meanwhile, as from_pretrained builds."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and getattr(_empty, "on", False):
            made = module._parameters[name]
            module._parameters[name] = type(made)(made.to("meta"), requires_grad=made.requires_grad)

    with _build_lock:
        previous = torch.get_default_dtype()
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
        _empty.on = True
        try:
            if dtype is not None:
                torch.set_default_dtype(dtype)
            yield
        finally:
            _empty.on = False
            if torch.nn.Module.register_parameter is register:  # (else another patch, accelerate's, came between)
                torch.nn.Module.register_parameter = original  # type: ignore[method-assign]
            torch.set_default_dtype(previous)


def meta_parameters(dtype: torch.dtype | None = None) -> contextlib.AbstractContextManager[None]:
    """Modules this thread builds inside get their parameters on the meta device and their buffers real (a module
    built from a config without its weights, to be filled by `assign`); the default dtype is `dtype` meanwhile."""
    return _meta_parameters(dtype)


def unfilled(model: torch.nn.Module) -> list[str]:
    """The module's parameters and persistent buffers still on the meta device (not assigned yet), in its order."""
    params = [name for name, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    return params + [n for n, b in model.named_buffers() if b.is_meta and _persistent(model, n)]


def _meta_module(cls: type[M], path: str, dtype: torch.dtype | None, library: str) -> M:
    if library == "diffusers":
        config = cls.load_config(path, local_files_only=True)
        with _meta_parameters(dtype):
            return cls.from_config(config)
    config = cls.config_class.from_pretrained(path, local_files_only=True)
    with _meta_parameters(dtype):
        return cls(config)


def _rel(sub: str | None, name: str) -> str:
    return os.path.join(sub, name) if sub else name


Renamer = Callable[[list[str]], list[tuple[str, str]]]  # a file's keys -> [(file's key, the module's name)]


def _diffusers_renamer(model: torch.nn.Module, sharded: bool) -> Renamer:
    """diffusers renames old attention-block keys (query -> to_q ...) in unsharded files only."""
    def renames(keys: list[str]) -> list[tuple[str, str]]:
        if sharded:
            return [(k, k) for k in keys]
        renamed = {k: k for k in keys}
        model._fix_state_dict_keys_on_load(renamed)  # (renames the dict's keys in place: new name -> file's)
        return [(old, new) for new, old in renamed.items()]
    return renames


def _transformers_renamer(model: torch.nn.Module, wanted: dict[str, torch.Tensor]) -> Renamer:
    """transformers' checkpoint renames (its conversion mapping's renamings) and base-model prefix, key by key."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
        transforms = get_model_conversion_mapping(model)
    except ImportError:  # transformers 4: the prefix only
        transforms, rename_source_key = [], None
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if t not in converters]
    prefix = getattr(model, "base_model_prefix", "") or ""

    def rename(key: str) -> str:
        if rename_source_key is not None:
            new, converted = rename_source_key(key, renamings, converters, prefix or None, wanted)
            if converted is not None:  # several tensors merged into one: a conversion, not a rename
                raise ValueError(f"holds {key[:200]!r} in a layout transformers converts while loading; re-save the "
                                 "model with save_pretrained")
            return new
        if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in wanted:
            return key[len(prefix) + 1:]
        return f"{prefix}.{key}" if prefix and f"{prefix}.{key}" in wanted else key

    return lambda keys: [(key, rename(key)) for key in keys]


def _fp32_modules(model: torch.nn.Module, dtype: torch.dtype | None, library: str) -> set[str]:
    """The module names whose floating tensors from_pretrained keeps in float32."""
    if dtype is None:
        return set()
    names = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    if library == "transformers":  # (transformers keeps them for fp16 only; its strict list for bf16 too)
        names = names if dtype == torch.float16 else set()
        if dtype in (torch.float16, torch.bfloat16):
            names |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    return names


def _read_into(model: torch.nn.Module, path: str, files: list[str], sharded: bool, dtype: torch.dtype | None,
               device: torch.device | str | None, library: str, label: str, sub: str | None) -> set[str]:
    """Reads every tensor of `files` the module has a place for into it, one at a time; returns the names filled."""
    wanted = model.state_dict(keep_vars=True)
    renamer = _diffusers_renamer(model, sharded) if library == "diffusers" \
        else _transformers_renamer(model, wanted)
    fp32 = _fp32_modules(model, dtype, library)
    loaded: set[str] = set()
    for name in files:
        try:
            with TensorFile(os.path.join(path, name), MODEL_FILE_LIMIT) as f:
                tensors = f.header.tensors
                for key, target in renamer(list(tensors)):
                    place = wanted.get(target)
                    if place is None:
                        continue  # a tensor the module has no place for (from_pretrained ignores it too)
                    if tuple(place.shape) != tuple(tensors[key].shape):
                        raise ValueError(
                            f"holds {key[:200]!r} as {list(tensors[key].shape)} where its config.json makes "
                            f"{list(place.shape)}: the weights are not this config's; use the config.json saved with "
                            "them")
                    floating = _floating(tensors[key].dtype)
                    want = torch.float32 if fp32 and fp32 & set(target.split(".")) and floating \
                        else (dtype if dtype is not None and floating else place.dtype)
                    tensor = f.read([key], device=device, dtype=want)[key].to(want)
                    assign(model, target, tensor)
                    loaded.add(target)
        except safe_files.UnusableFile as e:
            raise unreadable(label, _rel(sub, name), e) from None
        except ValueError as e:
            raise UnreadableWeights(f"{label}: {_rel(sub, name)} {e}") from None
    return loaded


def _floating(name: str) -> bool:
    """Whether a safetensors dtype name (F16, BF16, F8_E4M3 ...) is a floating-point one."""
    return name.startswith(("F", "BF"))


def assign(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Puts `tensor` in place of the module's parameter or buffer `name` (a parameter stays a parameter)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    old = getattr(module, leaf)
    if isinstance(old, torch.nn.Parameter):
        tensor = type(old)(tensor, requires_grad=old.requires_grad)
    setattr(module, leaf, tensor)


def _check_complete(model: torch.nn.Module, loaded: set[str], where: str, label: str) -> None:
    """Ties what the module ties, then refuses a parameter or persistent buffer the files (`where`: the file or the
    shard index) did not fill."""
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    params = {name for name, p in model.named_parameters(remove_duplicate=False) if p.is_meta}
    missing = sorted(params | {n for n, _ in model.named_buffers() if n not in loaded and _persistent(model, n)})
    if missing:
        raise UnreadableWeights(f"{label}: {where} lacks tensor {missing[0][:200]!r}"
                                f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}, which its "
                                "config.json needs: the weights are cut short or not this config's; copy or download "
                                "the folder again")


def _persistent(model: torch.nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf not in model.get_submodule(owner)._non_persistent_buffers_set
