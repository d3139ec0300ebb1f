"""`ControlNetDir`: the ControlNet models of a `--controlnet-dir` folder (issue 32): names and folders, no torch (the
HTTP process lists them for GET /v1/controlnets).

Each diffusers ControlNet folder under the root (a `config.json` whose `_class_name` is ControlNetModel, beside its
safetensors weights) is a ControlNet named by its path relative to the root, "/" between folders; one added later is
found without a restart. Names follow `--lora-dir`'s rules: relative, without "..", backslashes or NUL, nothing that
resolves outside the root (symbolic links included). Pickled weights are never read.
"""

from __future__ import annotations

import difflib
import json
import os

from ..errors import ParamError

WEIGHTS = "diffusion_pytorch_model.safetensors"
CLASS_NAME = "ControlNetModel"


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
        out = {}
        for folder, dirs, files in os.walk(root, followlinks=False):
            dirs.sort()
            if "config.json" in files and WEIGHTS in files:
                try:
                    with open(os.path.join(folder, "config.json")) as f:
                        if json.load(f).get("_class_name") != CLASS_NAME:
                            continue
                except (OSError, ValueError):
                    continue
                out[os.path.relpath(folder, root).replace(os.sep, "/")] = folder
        return out

    def folder(self, name: str) -> str:
        if "\x00" in name or "\\" in name or name.startswith("/") or os.path.isabs(name) or ".." in name.split("/"):
            raise ParamError("controls", f"ControlNet name {name!r} is not allowed: names are relative, with '/' "
                                         "between folders, without '..', backslashes or NUL (GET /v1/controlnets)")
        for root in self.roots:
            full = os.path.join(root, *name.split("/"))
            real = os.path.realpath(full)
            if os.path.isfile(os.path.join(full, WEIGHTS)) and os.path.commonpath([real, root]) == root:
                return real
        names = list(self.listing())
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else \
            f"; known: {', '.join(names[:10]) or 'none'}"
        raise ParamError("controls", f"ControlNet {name!r} is unknown{hint}")

    def describe(self) -> list[dict]:
        """GET /v1/controlnets' rows: each ControlNet's name and what its config says it steers."""
        rows = []
        for name, folder in self.listing().items():
            try:
                with open(os.path.join(folder, "config.json")) as f:
                    config = json.load(f)
            except (OSError, ValueError):  # changed since the listing
                continue
            rows.append({"name": name, "cross_attention_dim": config.get("cross_attention_dim"),
                         "block_out_channels": config.get("block_out_channels"),
                         "conditioning_channels": config.get("conditioning_channels", 3),
                         "added_conditions": config.get("addition_embed_type")})  # SDXL's: "text_time"
        return rows
