"""A model file's sidecar: `NAME.diffgraph.toml` beside `NAME.safetensors` (for a link, beside its target).

    config = "configs/my-sdxl"     # a diffusers config folder to read the file with (in place of --model-config)
    preset = "sdxl-base"           # or: the architecture preset (a checkpoint_configs.KINDS key) to read it as;
                                   #   for a split DiT file, its published checkpoint (`SPLIT_PRESETS`: "z-image"
                                   #   or "z-image-turbo", "flux.2-klein" or "flux.2-klein-base", "qwen-image" or
                                   #   "qwen-image-edit" (-2509, -2511)), which its file name need not say then
    text_encoder = "te.safetensors"  # split files (a DiT's text encoder and VAE): their kind checked by
    vae = "vae.safetensors"          #   split_files.py against what the model needs
    tokenizer = "tokenizer"          # a split model's tokenizer folder, where diffgraph ships none (FLUX.2 dev's)

Relative paths are relative to the sidecar's folder. `read_sidecar(model_file)` returns None when there is none, a
`Sidecar` when it is valid, and raises a one-line ValueError (unknown key, wrong type, missing folder or file, not
TOML, too large) otherwise: the catalog lists such a model as unusable with that reason, the loader refuses it.
Standard library only (the catalog reads it in the HTTP process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..safe_files import FileStamp, read_sidecar_table
from .checkpoint_configs import KINDS

SUFFIX = ".diffgraph.toml"
MAX_BYTES = 64 << 10
_FILES = ("text_encoder", "vae")
# the checkpoints a split diffusion model's sidecar may name, by split kind (split_files.SPLIT_KINDS names; each
# family's CHECKPOINTS keys: families/zimage.py, families/flux2.py; a kind's variants: split_files.py)
_KLEIN = ("flux.2-klein", "flux.2-klein-base")
SPLIT_PRESETS: dict[str, tuple[str, ...]] = {"z-image": ("z-image-turbo", "z-image", "digits-zimage"),
                                             "flux2-klein-4b": _KLEIN, "flux2-klein-9b": _KLEIN,
                                             "qwen-image": ("qwen-image", "qwen-image-edit", "qwen-image-edit-2509",
                                                            "qwen-image-edit-2511")}
ALL_PRESETS = (*KINDS, *dict.fromkeys(p for presets in SPLIT_PRESETS.values() for p in presets))


@dataclass(frozen=True)
class Sidecar:
    path: str
    stamp: FileStamp
    config: str | None = None        # absolute: a diffusers folder with model_index.json
    preset: str | None = None        # a checkpoint_configs.KINDS key, or a SPLIT_PRESETS one
    text_encoder: str | None = None  # absolute paths of regular files
    vae: str | None = None
    tokenizer: str | None = None     # absolute: a folder

    def checkpoint_preset(self) -> str | None:
        """The preset of a whole checkpoint (a KINDS key); a split model's preset here is a one-line ValueError."""
        if self.preset is None or self.preset in KINDS:
            return self.preset
        raise ValueError(f"sidecar {os.path.basename(self.path)}: preset {self.preset!r} is a split diffusion "
                         f"model's, but this file is a whole checkpoint; one of {', '.join(KINDS)}")

    def split_preset(self, kind: str, label: str) -> str | None:
        """The preset of a split model of split kind `kind` (`label`: how messages name it); one of another kind is
        a one-line ValueError naming the kind's."""
        allowed = SPLIT_PRESETS.get(kind, ())
        if self.preset is None or self.preset in allowed:
            return self.preset
        raise ValueError(f"sidecar {os.path.basename(self.path)}: preset {self.preset!r} is not a {label} preset; "
                         f"one of {', '.join(allowed) or 'none (leave preset out)'}")


def sidecar_path(model_file: str) -> str:
    stem = model_file[: -len(".safetensors")] if model_file.endswith(".safetensors") else model_file
    return stem + SUFFIX


def read_sidecar(model_file: str) -> Sidecar | None:
    path = sidecar_path(model_file)
    read = read_sidecar_table(path, MAX_BYTES, ("config", "preset", *_FILES, "tokenizer"))
    if read is None:
        return None
    name, table, stamp = read
    wrong = next((k for k, v in table.items() if not isinstance(v, str) or not v), None)
    if wrong:
        raise ValueError(f"sidecar {name}: {wrong} must be a non-empty string (a quoted path or name), not "
                         f"{table[wrong]!r}")
    here = os.path.dirname(os.path.abspath(path))
    found = {k: os.path.join(here, v) for k, v in table.items() if k != "preset"}
    if "config" in table and "preset" in table:
        raise ValueError(f"sidecar {name} gives both config and preset; keep one")
    if "config" in found and not os.path.isfile(os.path.join(found["config"], "model_index.json")):
        raise ValueError(f"sidecar {name}: config {table['config']!r} is not a diffusers folder (no model_index.json "
                         "there); give the folder's path, relative to the sidecar")
    if "preset" in table and table["preset"] not in ALL_PRESETS:
        raise ValueError(f"sidecar {name}: preset {table['preset']!r} is unknown; one of {', '.join(ALL_PRESETS)}")
    for key in _FILES:
        if key in found and not os.path.isfile(found[key]):
            raise ValueError(f"sidecar {name}: {key} {table[key]!r} is not a file; give its path, relative to the "
                             "sidecar")
    if "tokenizer" in found and not os.path.isdir(found["tokenizer"]):
        raise ValueError(f"sidecar {name}: tokenizer {table['tokenizer']!r} is not a folder; give the path of the "
                         "checkpoint's tokenizer folder, relative to the sidecar")
    return Sidecar(path, stamp, found.get("config"), table.get("preset"), found.get("text_encoder"), found.get("vae"),
                   found.get("tokenizer"))
