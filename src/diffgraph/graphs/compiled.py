"""The compile tier's callables (issue 13, first part): functions compiled by torch.compile and then captured in the
bucketed graphs exactly as the eager ones are.

`Compiled(fn, config, name)` is what a graph kind captures in place of `fn`: the first call of a shape compiles (the
graph runner's warm-up iterations, on the capture stream, before capture: nothing compiles inside a capture, and a
replay runs no Python, so no guard can fail and nothing recompiles while serving). If compiling or running the
compiled code fails, that callable falls back to `fn` for good: a log line, and `fallbacks` counts it (the engine's
`compile_fallbacks` stat, the server's `diffgraph_compile_fallbacks_total`); the graph of that key is then the
uncompiled one. The eager paths of the model runner never call a `Compiled` (they run their own eager callables).

Weights stay ordinary parameters: torch.compile passes them as graph inputs (no freezing, no constant folding), so
in-place updates (LoRA slots, fused adapters, a user's copy_) are seen by compiled code without recompiling. Inductor
runs without its own CUDA graphs (`triton.cudagraphs` off): the graphs are ours.

The persistent cache: `cache_dir(config, model)` is a folder per (model config, dtype, torch and triton versions,
device), under `CompileConfig.cache_dir` (default: the user's cache folder); `use_cache_dir` points Inductor's
on-disk caches (FX graphs, AOTAutograd, Triton kernels) there for this process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Callable

import torch

from ..config import CompileConfig

logger = logging.getLogger(__name__)


class Compiled:
    def __init__(self, fn: Callable[..., Any], config: CompileConfig, name: str):
        self.fn = fn
        self.name = name
        self.backend = config.backend
        options = {"triton.cudagraphs": False} if config.backend == "inductor" else None
        self.compiled = torch.compile(fn, backend=config.backend, dynamic=config.dynamic, options=options)
        self.failed: str | None = None  # why it fell back, once it did
        self.fallbacks = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed is None:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as e:  # a compile error or a backend failure: this kind runs uncompiled from now on
                cause = getattr(e, "inner_exception", None) or e  # BackendCompilerFailed wraps the backend's error
                self.failed = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"[:300]
                self.fallbacks += 1
                logger.warning("compiling %s with backend %r failed (%s); it runs uncompiled from now on (graphs "
                               "captured from here on hold the uncompiled code)", self.name, self.backend, self.failed)
        return self.fn(*args, **kwargs)


def cache_key(model: Any, device: torch.device) -> str:
    """What compiled code depends on: the modules' configs, the dtype, torch's and triton's versions, the device."""
    configs = {"unet": dict(model.unet.config), "vae": dict(model.vae.config),
               "text": [e.config.to_dict() for e in model.text_encoders]}
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    where = (torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)) \
        if device.type == "cuda" else ("cpu",)
    blob = json.dumps([configs, str(model.dtype), torch.__version__, triton_version, where, model.family],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "diffgraph", "compile")


def cache_dir(config: CompileConfig, model: Any, device: torch.device) -> str:
    """The folder of this model's compiled artifacts: `<root>/<model name>-<key>`."""
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in os.path.basename(str(model.name).rstrip("/")))
    return os.path.join(config.cache_dir or default_root(), f"{name}-{cache_key(model, device)}")


def use_cache_dir(folder: str) -> None:
    """Points Inductor's on-disk caches at `folder` for this process (Inductor reads TORCHINDUCTOR_CACHE_DIR at each
    compile; Triton's kernels go under it unless TRITON_CACHE_DIR says otherwise)."""
    os.makedirs(folder, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(folder)


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)
