"""`IPAdapterDir`: the IP-Adapters of an `--ip-adapter-dir` folder: names, files and image encoders, no
torch.

Each `.safetensors` file under the root whose header holds `image_proj.` and `ip_adapter.` tensors (the layout
diffusers' `load_ip_adapter` reads, as h94/IP-Adapter publishes them) is an IP-Adapter named by its path relative to
the root without the extension. Its image encoder is the nearest `image_encoder` folder (a CLIP vision model in
transformers' layout: `config.json` and safetensors weights) in the file's folder or a folder above it, up to the
root: h94's `models/image_encoder` beside `models/ip-adapter_sd15.safetensors`. Names follow `--lora-dir`'s rules;
pickled weights are never read.
"""

from __future__ import annotations

import os

from ..errors import ParamError, unknown_hint

SUFFIX = ".safetensors"
ENCODER = "image_encoder"


def is_ip_adapter(path: str) -> bool:
    from ..safe_files import UnusableFile, read_header
    try:
        header, _ = read_header(path, 64 << 30)
    except (UnusableFile, OSError):
        return False
    keys = header.tensors
    return any(k.startswith("image_proj.") for k in keys) and any(k.startswith("ip_adapter.") for k in keys)


class IPAdapterDir:
    def __init__(self, root: str):
        if not os.path.isdir(root):
            raise ValueError(f"ip-adapter dir {root!r} is not a folder; give a folder of IP-Adapter .safetensors "
                             "files with their image_encoder folder")
        self.root = os.path.realpath(root)

    def listing(self) -> dict[str, str]:
        out = {}
        for folder, dirs, files in os.walk(self.root, followlinks=False):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(folder, name)
                if name.endswith(SUFFIX) and not os.path.islink(path) and is_ip_adapter(path):
                    out[os.path.relpath(path, self.root)[:-len(SUFFIX)].replace(os.sep, "/")] = path
        return out

    def file(self, name: str) -> str:
        if "\x00" in name or "\\" in name or name.startswith("/") or os.path.isabs(name) or ".." in name.split("/"):
            raise ParamError("image_prompts", f"IP-Adapter name {name!r} is not allowed: names are relative, with '/' "
                                             "between folders, without '..', backslashes or NUL")
        path = os.path.realpath(os.path.join(self.root, *name.split("/")) + SUFFIX)
        if os.path.isfile(path) and os.path.commonpath([path, self.root]) == self.root:
            if is_ip_adapter(path):
                return path
            raise ParamError("image_prompts", f"'{name}{SUFFIX}' in --ip-adapter-dir is not an IP-Adapter: one is a "
                                              "safetensors file with image_proj.* and ip_adapter.* tensors (as "
                                              "h94/IP-Adapter publishes them); name one of GET /v1/ip-adapters")
        raise ParamError("image_prompts", f"IP-Adapter {name!r} is unknown{unknown_hint(name, list(self.listing()))}")

    def only(self) -> str:
        """The folder's one IP-Adapter, for requests that name none. Raises ParamError when it has none or several."""
        names = list(self.listing())
        if len(names) != 1:
            raise ParamError("image_prompts", f"name the IP-Adapter (image_prompts.model): this server has "
                                              f"{len(names)}" + (f": {', '.join(names[:10])}" if names else ""))
        return names[0]

    def encoder(self, path: str) -> str:
        """The image encoder folder of the adapter at `path`."""
        folder = os.path.dirname(path)
        while True:
            candidate = os.path.join(folder, ENCODER)
            if os.path.isfile(os.path.join(candidate, "config.json")):
                return candidate
            if folder == self.root or os.path.commonpath([folder, self.root]) != self.root:
                break
            folder = os.path.dirname(folder)
        raise ParamError("image_prompts", f"IP-Adapter {os.path.relpath(path, self.root)!r} has no image encoder: put "
                                         f"its CLIP vision model in an '{ENCODER}' folder beside it (or above it)")
