"""`ControlNetDir`: the ControlNet models of a `--controlnet-dir` folder: names and folders, no torch (the
HTTP process lists them for GET /v1/controlnets).

Each diffusers ControlNet folder under the root (a `config.json` whose `_class_name` is ControlNetModel, beside its
safetensors weights) is a ControlNet named by its path relative to the root, "/" between folders; so is each single
`.safetensors` file that holds a ControlNet, as AUTOMATIC1111 and ComfyUI keep them (the original ControlNet layout,
with or without its `control_model.` prefix, or diffusers' layout in one file; named by its path without the
extension; told apart from other files by its header's keys, the tensors never read here). One added later is found
without a restart. Names follow `--lora-dir`'s rules: relative, without "..", backslashes or NUL, nothing that
resolves outside the root (symbolic links included). Pickled weights are never read.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ParamError, unknown_hint
from ..safe_files import UnusableFile, read_header, read_json

WEIGHTS = "diffusion_pytorch_model.safetensors"
CLASS_NAME = "ControlNetModel"
SINGLE_FILE = ".safetensors"
HEADER_BYTES = 64 << 30  # a single file's size limit when its header is read (ControlNets are GBs at most)
CONFIG_BYTES = 1 << 20   # a config.json (diffusers' are about 2 KB)
# a key only a ControlNet has: the original layout's hint encoder, or diffusers' conditioning embedding
MARKS = ("input_hint_block.0.weight", "control_model.input_hint_block.0.weight",
         "controlnet_cond_embedding.conv_in.weight")


def single_file_marks(path: str) -> dict | None:
    """What a single file's header says of the ControlNet in it ({"cross_attention_dim", "added_conditions"}), or
    None when it holds no ControlNet (or cannot be read as safetensors)."""
    try:
        header, _ = read_header(path, HEADER_BYTES)
    except (UnusableFile, OSError):
        return None
    keys = header.tensors
    if not any(k in keys for k in MARKS):
        return None
    prefix = "control_model." if "control_model.input_hint_block.0.weight" in keys else ""
    # a cross-attention's key projection: its input width is the text's (the same name in both layouts)
    cross = next((t.shape for k, t in keys.items() if k.endswith("attn2.to_k.weight")), None)
    added = any(k in keys for k in (prefix + "label_emb.0.0.weight", "add_embedding.linear_1.weight"))
    return {"cross_attention_dim": cross[1] if cross and len(cross) == 2 else None,
            "added_conditions": "text_time" if added else None}


class ControlNetDir:
    """`roots`: the `--controlnet-dir` first, then a model's built-in controls; a name in an earlier root shadows
    the same name in a later one."""

    def __init__(self, *roots: str):
        for root in roots:
            if not os.path.isdir(root):
                raise ValueError(f"controlnet dir {root!r} is not a folder; give a folder of diffusers ControlNet "
                                 "folders")
        self.roots = tuple(os.path.realpath(r) for r in roots)
        self.root = self.roots[0]

    def listing(self) -> dict[str, str]:
        """name -> folder of every ControlNet under the roots (an earlier root's name wins)."""
        out: dict[str, str] = {}
        for root in reversed(self.roots):
            out.update(self._listing(root))
        return dict(sorted(out.items()))

    @staticmethod
    def _listing(root: str) -> dict[str, str]:
        out, singles = {}, {}
        for folder, dirs, files in os.walk(root, followlinks=False):
            dirs.sort()
            if "config.json" in files and WEIGHTS in files:
                if _config(folder).get("_class_name") != CLASS_NAME:
                    continue
                out[os.path.relpath(folder, root).replace(os.sep, "/")] = folder
                continue  # its files are its weights
            for name in sorted(files):
                path = os.path.join(folder, name)
                if name.endswith(SINGLE_FILE) and not os.path.islink(path) and single_file_marks(path) is not None:
                    singles[os.path.relpath(path, root)[:-len(SINGLE_FILE)].replace(os.sep, "/")] = path
        return {**singles, **out}  # a folder's name wins over a file of the same name

    def folder(self, name: str) -> str:
        """The ControlNet's diffusers folder, or its single file. Raises ParamError("controls")."""
        if "\x00" in name or "\\" in name or name.startswith("/") or os.path.isabs(name) or ".." in name.split("/"):
            raise ParamError("controls", f"ControlNet name {name!r} is not allowed: names are relative, with '/' "
                                         "between folders, without '..', backslashes or NUL (GET /v1/controlnets)")
        for root in self.roots:
            full = os.path.join(root, *name.split("/"))
            real = os.path.realpath(full)
            if os.path.isfile(os.path.join(full, WEIGHTS)) and os.path.commonpath([real, root]) == root:
                return real
            file = os.path.realpath(full + SINGLE_FILE)
            if os.path.isfile(file) and os.path.commonpath([file, root]) == root and single_file_marks(file):
                return file
        raise ParamError("controls", f"ControlNet {name!r} is unknown{unknown_hint(name, list(self.listing()))}")

    def describe(self) -> list[dict]:
        """GET /v1/controlnets' rows: each ControlNet's name and what its config says it steers."""
        rows = []
        for name, folder in self.listing().items():
            if os.path.isfile(folder):  # a single file: what its header says
                marks = single_file_marks(folder)
                if marks is not None:
                    rows.append({"name": name, "format": "single_file", **marks})
                continue
            config = _config(folder)
            if not config:  # changed since the listing
                continue
            rows.append({"name": name, "format": "diffusers", "cross_attention_dim": config.get("cross_attention_dim"),
                         "block_out_channels": config.get("block_out_channels"),
                         "conditioning_channels": config.get("conditioning_channels", 3),
                         "added_conditions": config.get("addition_embed_type")})  # SDXL's: "text_time"
        return rows


def _config(folder: str) -> dict[str, Any]:
    """A ControlNet folder's config.json, or {} when it is not a readable JSON object (not listed, then)."""
    try:
        config = read_json(os.path.join(folder, "config.json"), CONFIG_BYTES)[0]
    except (UnusableFile, OSError):
        return {}
    return config if isinstance(config, dict) else {}
