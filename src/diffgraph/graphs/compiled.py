"""The compile tier's callables: functions compiled by torch.compile and then captured in the
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
device, diffgraph's source), under `CompileConfig.cache_dir` (default: the user's cache folder); `use_cache_dir`
points Inductor's on-disk caches (FX graphs, AOTAutograd, Triton kernels) there for this process.

Precompiled versions (the graph kinds, with Inductor on a torch that has `torch.compiler.load_compiled_function`):
Dynamo's tracing, which Inductor's caches cannot skip, is most of a warm start. So each version of a graph kind is
compiled whole (`fullgraph`, torch's AOT compile) and saved as one file under `<cache folder>/precompiled`, named by
the arguments' `signature`; a later start (or a copy of the folder) loads the file and runs it without tracing and
without Dynamo guards: `Compiled` itself picks the version by the signature, so no guard can fail while serving.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from functools import partial
from typing import Any, Callable, Iterable

import torch

from ..config import CompileConfig

logger = logging.getLogger(__name__)


class Compiled:
    """`fn` compiled by torch.compile. `batch_of(args)` names the argument tensors whose first dimension is the batch:
    they are marked dynamic before each call, so one compile serves every bucket of a resolution above 1. Dynamo
    specialises a batch of 1 (its own compile); with precompiled versions, a batch of 1 runs the dynamic batch's
    version instead where there is one (`_version`). Without `batch_of`, or with `per_bucket`, each shape is its own
    compile. During a CUDA-graph capture a call that would compile (a guard failed) runs `fn`
    instead: that key's graph holds the uncompiled code, counted in `fallbacks` and logged. With `folder`, versions
    are precompiled there (`precompile_dir`), keyed by the arguments' `signature` and `tag`: what else the traced
    code depends on (the weights' layout, the modules' structure: adapter slots), and the Inductor `options`."""

    def __init__(self, fn: Callable[..., Any], config: CompileConfig, name: str,
                 batch_of: Callable[[tuple], Iterable[torch.Tensor]] | None = None, dynamic: bool | None = False,
                 folder: str | None = None, tag: str = "", options: dict[str, Any] | None = None,
                 tokens_of: Callable[[tuple], Iterable[torch.Tensor]] | None = None):
        self.fn = fn
        self.tag = tag  # what else the code depends on, beyond the arguments' signature (layout, adapter slots)
        self.name = name
        self.backend = config.backend
        self._batch_of = None if config.per_bucket else batch_of
        self._tokens_of = tokens_of  # tensors whose second dimension (prompt tokens) is dynamic, at every length
        self._dynamic = dynamic
        # Inductor's options: its mode's (its own CUDA graphs off: ours capture the code), plus `options`
        self.options = {**config.inductor_options(), **(options or {})} if config.backend == "inductor" else None
        self.compiled = torch.compile(fn, backend=config.backend, dynamic=dynamic, options=self.options)
        self._key_prefix = (tag, sorted((self.options or {}).items()))  # part of every precompiled version's key
        # precompiled versions (see `precompile_dir`): one per argument signature, called without guards
        self.precompile_dir = precompile_dir(config, folder) if batch_of is not None else None
        self._versions: dict[str, Callable[..., Any]] = {}
        self.failed: str | None = None  # why it fell back for good, once it did
        self.fallbacks = 0
        self.compiles = 0       # graphs compiled (or loaded from Inductor's caches) by this callable
        self.compile_s = 0.0    # wall time of the calls that compiled
        self.loaded = 0         # precompiled versions loaded from files (nothing traced, nothing compiled)
        self.load_s = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed is None:
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            try:
                if self.precompile_dir is not None:
                    version = self._precompiled(args, kwargs, capturing)
                    if version is not None:
                        return version(*args, **kwargs)
                    if capturing:  # a signature first seen inside a capture: never compile there
                        self.fallbacks += 1
                        logger.warning("%s met new shapes inside a CUDA-graph capture; this graph holds the "
                                       "uncompiled code", self.name)
                        return self.fn(*args, **kwargs)
                self._mark_batch(args)
                before = _graphs_compiled()
                t0 = time.perf_counter()
                if capturing:  # never compile inside a capture: a guard failure raises instead
                    with torch.compiler.set_stance("fail_on_recompile"):
                        out = self.compiled(*args, **kwargs)
                else:
                    out = self.compiled(*args, **kwargs)
                if _graphs_compiled() > before:
                    self.compiles += _graphs_compiled() - before
                    self.compile_s += time.perf_counter() - t0
                return out
            except Exception as e:  # a compile error or a backend failure: this kind runs uncompiled from now on
                cause = getattr(e, "inner_exception", None) or e  # BackendCompilerFailed wraps the backend's error
                why = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"[:300]
                if capturing:
                    if "fail_on_recompile" not in str(e):
                        raise  # compiled code failed mid-capture: the capture fails, and that key runs eagerly
                    # the guards failed before anything ran: capture the uncompiled function in its place
                    self.fallbacks += 1
                    logger.warning("%s would have compiled inside a CUDA-graph capture (%s); this graph holds the "
                                   "uncompiled code", self.name, why)
                    return self.fn(*args, **kwargs)
                self.fallbacks += 1
                self.failed = why
                logger.warning("compiling %s with backend %r failed (%s); it runs uncompiled from now on (graphs "
                               "captured from here on hold the uncompiled code)", self.name, self.backend, self.failed)
        return self.fn(*args, **kwargs)

    def _mark_batch(self, args: tuple) -> None:
        if self._batch_of is not None:
            for t in self._batch_of(args):
                if t.shape[0] > 1:
                    torch._dynamo.mark_dynamic(t, 0)
        for t in self._tokens(args):
            torch._dynamo.maybe_mark_dynamic(t, 1)

    def _tokens(self, args: tuple) -> list[torch.Tensor]:
        return [] if self._tokens_of is None else list(self._tokens_of(args))

    def _precompiled(self, args: tuple, kwargs: dict, capturing: bool) -> Callable[..., Any] | None:
        """`_version`, or None with precompiling off for good where it fails outside a capture (a graph break, a
        value torch cannot save): this kind then compiles with Dynamo's guards, as without precompiled versions."""
        try:
            return self._version(args, kwargs, capturing)
        except Exception as e:
            if capturing:
                raise
            logger.debug("precompiling %s failed", self.name, exc_info=True)  # where, for a bug report
            first_line = str(e).splitlines()[0][:300] if str(e) else ""
            logger.warning("precompiling %s failed (%s: %s); it compiles with Dynamo's guards instead (later starts "
                           "trace it again)", self.name, type(e).__name__, first_line)
            self.precompile_dir = None
            return None

    def _version(self, args: tuple, kwargs: dict, capturing: bool) -> Callable[..., Any] | None:
        """The precompiled version for these arguments' signature: in memory, else loaded from its file, else
        compiled (torch's AOT compile, whole graph) and saved; None inside a capture when there is none yet. A batch
        of 1 runs the version of the dynamic batch where there is one (compiled at a larger batch: the prewarm
        captures the largest bucket first), so a row runs the same code alone and in a batch: its own compile moved
        a single image beyond the fp16 tolerance from the same request in a batch (BENCHMARKS.md: where batch
        variance comes from). Else (a
        batch of 1 met first) it gets its own version."""
        batch = {id(t) for t in self._batch_of(args)} if self._batch_of is not None else set()
        tokens = {id(t) for t in self._tokens(args)}
        own = self._key(args, kwargs, batch, one_as_any=False, tokens=tokens)
        for key in dict.fromkeys((self._key(args, kwargs, batch, one_as_any=True, tokens=tokens), own)):
            version = self._versions.get(key) or (None if capturing else self._load(key))
            if version is not None:
                return version
        if capturing:
            return None
        t0 = time.perf_counter()
        self._mark_batch(args)
        with torch._dynamo.config.patch(enable_aot_compile=True):  # off by default before torch 2.13
            whole = torch.compile(_invoke, backend=self.backend, dynamic=self._dynamic, fullgraph=True,
                                  options={**(self.options or {}), "guard_filter_fn": _no_guards})
            version = whole.aot_compile(((self.fn, *args), kwargs))
        self.compiles += 1
        self.compile_s += time.perf_counter() - t0
        try:
            os.makedirs(self.precompile_dir, exist_ok=True)
            write_atomically(version.save_compiled_function, self._path(own))
        except Exception as e:  # a read-only or full disk: this process runs compiled; the next compiles again
            logger.warning("precompiled %s could not be saved to %s (%s: %s)", self.name, self._path(own),
                           type(e).__name__, e)
        self._versions[own] = version = partial(version, self.fn)
        return version

    def _key(self, args: tuple, kwargs: dict, batch: set[int], one_as_any: bool, tokens: set[int] = frozenset()) -> str:
        return repr((*self._key_prefix, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                     signature(args, batch, one_as_any, tokens), signature(kwargs, batch, one_as_any, tokens)))

    def _path(self, key: str) -> str:
        return os.path.join(self.precompile_dir,
                            f"{_slug(self.name)}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.bin")

    def _load(self, key: str) -> Callable[..., Any] | None:
        """The version saved under `key`, or None: no file, or one that does not load (other versions, damaged)."""
        path, t0 = self._path(key), time.perf_counter()
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                version = torch.compiler.load_compiled_function(f)
        except Exception as e:  # a file from other versions, or a damaged one: compile it again
            logger.warning("precompiled %s could not be loaded from %s (%s: %s); compiling it again", self.name,
                           path, type(e).__name__, e)
            return None
        self.loaded += 1
        self.load_s += time.perf_counter() - t0
        self._versions[key] = version = partial(version, self.fn)
        return version


def _invoke(target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """What a precompiled version compiles: `target` (a function, a bound method, a partial over a model) is an
    argument, so the saved file holds code and kernels only, never the modules a closure or bound object reaches."""
    return target(*args, **kwargs)


def _no_guards(entries: list) -> list[bool]:
    """Precompiled versions keep no Dynamo guards: `Compiled` picks the version by the arguments' signature (shapes,
    strides, dtypes, devices, the batch dimension as 1 or any), which is what the guards would check."""
    return [False] * len(entries)


def signature(obj: Any, batch: set[int], one_as_any: bool = False, tokens: set[int] = frozenset()) -> Any:
    """What compiled code depends on in `obj` (arguments: tensors, dataclasses, dicts, sequences, scalars): tensors'
    shapes, strides, dtypes and devices (a batch tensor's first dimension as 1 or -1: any above 1; with
    `one_as_any`, 1 as -1 too; a `tokens` tensor's second dimension as -1), scalars' values, other objects'
    types."""
    if isinstance(obj, torch.Tensor):
        shape = list(obj.shape)
        if id(obj) in batch and shape and (shape[0] > 1 or one_as_any and shape[0] == 1):
            shape[0] = -1
        if id(obj) in tokens and len(shape) > 1:
            shape[1] = -1
        return ("T", tuple(shape), obj.stride()[1:], str(obj.dtype), str(obj.device))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__,) + tuple((f.name, signature(getattr(obj, f.name), batch, one_as_any, tokens))
                                             for f in dataclasses.fields(obj))
    if isinstance(obj, dict):
        return tuple(sorted((str(k), signature(v, batch, one_as_any, tokens)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(signature(v, batch, one_as_any, tokens) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(obj)
    return type(obj).__qualname__


def precompile_available() -> bool:
    """Whether this torch saves and loads whole compiled functions (`torch.compiler.load_compiled_function`, 2.10+)."""
    return hasattr(torch.compiler, "load_compiled_function") and hasattr(torch._dynamo.config, "enable_aot_compile")


def precompile_dir(config: CompileConfig, folder: str | None) -> str | None:
    """Where a kind's precompiled versions go (`<cache folder>/precompiled`), or None where they are not used: no
    folder, `precompile` off, a backend other than Inductor, or a torch without the API."""
    if folder is None or not config.precompile or config.backend != "inductor" or not precompile_available():
        return None
    return os.path.join(folder, "precompiled")


def plain(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The uncompiled function of a `Compiled`, or `fn` itself (the reference a graph's verification compares to)."""
    return fn.fn if isinstance(fn, Compiled) else fn


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def code_version(package: str | None = None) -> str:
    """A hash of diffgraph's own source (every .py file under `package`, default this package's folder: path and
    bytes). Precompiled versions are called without Dynamo's guards, so code traced from another diffgraph (an
    upgrade, a local edit) must never be loaded: any source change gives a new cache folder."""
    root = package or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read() + b"\0")
    return digest.hexdigest()[:16]


def cache_key(model: Any, device: torch.device) -> str:
    """What compiled code depends on: the modules' configs, the dtype, torch's and triton's versions, the device and
    diffgraph's own source (`code_version`)."""
    def settings(module: Any) -> dict[str, Any]:  # "_" keys are bookkeeping, some in set order (hash seeded)
        config = module.config if isinstance(module.config, dict) else module.config.to_dict()
        return {"class": type(module).__name__, **{k: v for k, v in config.items() if not k.startswith("_")}}

    configs = {"unet": settings(model.denoiser), "vae": settings(model.vae),
               "text": [settings(e) for e in model.text_encoders]}
    fp8 = [n for n, b in model.denoiser.named_buffers() if b.dtype == torch.float8_e4m3fn]
    if fp8:  # the denoiser's layers in fp8 (quantize/fp8.py): the traced code differs from the 16-bit model's
        configs["fp8"] = fp8
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    where = (torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)) \
        if device.type == "cuda" else ("cpu",)
    blob = json.dumps([configs, str(model.dtype), torch.__version__, triton_version, where, model.family,
                       code_version()],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "diffgraph", "compile")


def cache_dir(config: CompileConfig, model: Any, device: torch.device) -> str:
    """The folder of this model's compiled artifacts: `<root>/<model name>-<key>`."""
    name = _slug(os.path.basename(str(model.name).rstrip("/")))
    return os.path.join(config.cache_dir or default_root(), f"{name}-{cache_key(model, device)}")


def _slug(text: str) -> str:
    """`text` as a file-name part: letters, digits, "-", "_" and "." kept, anything else "-"."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


def open_cache(config: CompileConfig, model: Any, device: torch.device) -> str:
    """This model's cache folder (`cache_dir`), made Inductor's for this process, its saved artifacts loaded."""
    folder = cache_dir(config, model, device)
    use_cache_dir(folder)
    load_artifacts(folder)
    return folder


def use_cache_dir(folder: str) -> None:
    """Points Inductor's on-disk caches at `folder` for this process (Inductor reads TORCHINDUCTOR_CACHE_DIR at each
    compile; Triton's kernels go under it unless TRITON_CACHE_DIR says otherwise)."""
    os.makedirs(folder, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(folder)


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


ARTIFACTS = "artifacts.bin"  # torch.compiler's portable cache artifacts ("mega-cache") of everything compiled


def load_artifacts(folder: str) -> int:
    """Loads the folder's saved artifacts into this process's caches (what a copy of the folder on another machine
    of the same GPU and versions needs); returns their size in bytes, 0 where there are none."""
    path = os.path.join(folder, ARTIFACTS)
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        blob = f.read()
    try:
        torch.compiler.load_cache_artifacts(blob)
    except Exception as e:  # a file from other versions: compile as if it were not there
        logger.warning("compile cache artifacts %s could not be loaded (%s: %s); compiling instead", path,
                       type(e).__name__, e)
        return 0
    return len(blob)


def write_atomically(save: Callable[[str], Any], path: str) -> None:
    """`save(temporary path)` then a rename onto `path`: a reader (another replica sharing the cache folder) sees
    the old file or the whole new one, never a partial write; the temporary file is this process's and thread's own,
    and is removed when `save` fails."""
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        save(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_artifacts_if_new(folder: str) -> int:
    """`save_artifacts` where this process compiled something from scratch (an Inductor cache miss) or the folder
    has no artifacts yet; 0 otherwise (a warm start rewrites nothing)."""
    from torch._dynamo.utils import counters
    if counters["inductor"]["fxgraph_cache_miss"] == 0 and os.path.exists(os.path.join(folder, ARTIFACTS)):
        return 0
    return save_artifacts(folder)


def save_artifacts(folder: str) -> int:
    """Writes the artifacts of everything compiled or loaded in this process to the folder (atomically); returns
    their size in bytes, 0 where torch had nothing to save."""
    saved = torch.compiler.save_cache_artifacts()
    if not saved:
        return 0
    blob = saved[0]
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{ARTIFACTS}.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, os.path.join(folder, ARTIFACTS))
    return len(blob)
