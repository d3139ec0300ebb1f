"""`ModelSet`: several models behind one server on one device (`--model-dir`).

Every model under `--model-dir` (models/catalog.py names them) and the default `--model` can be asked for by a
request's `model`. A model is resident as an `Engine` of its own (its graphs, prompt cache and adapter slots), and
every resident engine's core runs on the set's one `DeviceLoop`, so two models' steps never contend for the device
from two threads. A model loads on first use (or at start, `preload`) on a loader thread, one at a time; requests
for it wait (bounded by their caller's timeout) instead of failing; a model that fails to load answers every
request waiting for it with that error (a `ModelLoadError`, the caller's 400) and the others keep serving; the next
request for it tries again.

Residency is bounded by `max_models` and by a memory budget (`memory_bytes`) that counts each engine's weights and
graph pools: on CUDA the allocator's reserved bytes the engine's build added (weights, buffers, prewarm graphs), on
the CPU its parameters' and buffers' bytes. The least recently used engine goes first, never one with requests in
flight (submitted and not answered), one a caller holds (`acquire` to `release`, around validation and submit) or
one just loaded whose callers have not taken their holds yet (another load queued behind it would evict it first):
when every other resident model is busy, the new one loads anyway and the set is over its bound until one frees.
Before a load the model's weights are estimated from its files (`folder_estimate`): a model whose weights alone
exceed the budget is refused with one line (`ModelTooLarge`), and idle models make room for the estimate first; a
CUDA out-of-memory error while a model builds is the same one-line error, given once what the build held is
collected and the allocator's cache emptied.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import ModelLoadError
from .async_engine import AsyncEngine
from .device_loop import DeviceLoop
from .engine import Engine

logger = logging.getLogger(__name__)

__all__ = ["ModelLoadError", "ModelSet", "ModelTooLarge", "Resident", "folder_builder", "folder_estimate"]


class ModelTooLarge(ModelLoadError):
    """A model refused because its weights alone exceed the memory budget, or one whose load ran out of device
    memory; the message names it, its size and the fix."""


def folder_builder(root: str, default: str, engine_kwargs: dict) -> Callable[[str, DeviceLoop], Engine]:
    """The build function of a `--model-dir` set: the default `--model` by its own path, the folder's models by
    their catalog names; each engine warmed up with one image (a broken model fails here, not on a request)."""
    from ..models.catalog import ModelDir

    catalog = ModelDir(root)

    def build(name: str, loop: DeviceLoop) -> Engine:
        path = default if name == default else catalog.resolve(name).path
        engine = Engine(**{**engine_kwargs, "model": path, "loop": loop, "name": name})
        try:
            engine.generate("warm-up", num_inference_steps=1, seed=0)
        except Exception:
            engine.close()
            raise
        return engine
    return build


def folder_estimate(root: str, default: str, device: str, dtype: str | None = None,
                    quantized: bool = False) -> Callable[[str], int | None]:
    """The weights estimate of a `--model-dir` set's models before they load (`catalog.weights_bytes` at the
    engines' float dtype: `dtype`, else fp16 on CUDA and fp32 on the CPU as `Engine` picks); None for the default
    `--model` (a preset or a path the set does not list). `quantized` (the fp8 tier): every float counted at one
    byte, a bound below what loads (the files do not say which layers the tier will take), so no model that would
    fit is refused."""
    from ..models.catalog import ModelDir, weights_bytes

    catalog = ModelDir(root)
    chosen = str(dtype or ("fp16" if torch.device(device).type == "cuda" else "fp32")).lower().removeprefix("torch.")
    float_bytes = 1 if quantized else 4 if chosen in ("fp32", "float32", "float") else 2

    def estimate(name: str) -> int | None:
        return None if name == default else weights_bytes(catalog.resolve(name), float_bytes)
    return estimate


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


@dataclass
class Resident:
    name: str
    client: AsyncEngine
    memory_bytes: int
    loaded_s: float
    last_used: float = field(default_factory=time.monotonic)
    holds: int = 0  # callers between acquire and release

    @property
    def busy(self) -> bool:
        return self.holds > 0 or self.client.in_flight() > 0 or self.client.core.has_work()


class ModelSet:
    def __init__(self, build: Callable[[str, DeviceLoop], Engine], device: str, max_models: int = 2,
                 memory_bytes: int | None = None, on_load: Callable[[AsyncEngine], None] | None = None,
                 estimate: Callable[[str], int | None] | None = None):
        """`on_load`: called with each model's client once it is built, before any request reaches it (the replica
        hooks its failure policy and step events there). `estimate`: a model's weights bytes before it loads
        (`folder_estimate`; None: unknown): one above `memory_bytes` is refused, the rest make room for it first."""
        if max_models < 1:
            raise ValueError(f"max-models {max_models} must be >= 1")
        self._build, self.device, self._on_load = build, torch.device(device), on_load
        self._estimate = estimate
        self.max_models, self.memory_bytes = max_models, memory_bytes
        self.loop = DeviceLoop()
        self._lock = threading.Lock()
        self._resident: dict[str, Resident] = {}
        self._loading: dict[str, Future] = {}
        # callers waiting for a model's load: once built it is theirs before any other load or trim may evict it
        self._waiters: dict[str, int] = {}
        self._loader = threading.Lock()  # one load at a time (a load takes the device's memory and bandwidth)
        self.errors: dict[str, str] = {}  # the last load failure per model (GET /v1/models shows it)
        self._closed = False

    # -- callers ---------------------------------------------------------------------------------------------------
    def acquire(self, name: str, timeout: float | None = None) -> Resident:
        """The resident model `name`, loading it first if needed; held (not evicted) until `release`. Raises
        ModelLoadError, TimeoutError (still loading after `timeout` seconds) or RuntimeError once closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = False  # counted in `_waiters` (taken off under the lock that then takes the hold)
        while True:
            with self._lock:
                if waited:
                    self._unwait(name)
                    waited = False
                if self._closed:
                    raise RuntimeError("the model set is closed")
                resident = self._resident.get(name)
                if resident is not None and resident.client.ready:
                    resident.holds += 1
                    resident.last_used = time.monotonic()
                    over = len(self._resident) > self.max_models or self._over_memory()
                    # over its count or budget, since a busy model stayed: trimmed once another one is idle
                    if over and not self._loading and any(not r.busy for r in self._resident.values()
                                                          if r is not resident):
                        threading.Thread(target=self._trim, args=(name,), name="diffgraph-trim", daemon=True).start()
                    return resident
                future = self._loading.get(name)
                if future is None:
                    future = self._loading[name] = Future()
                    threading.Thread(target=self._load, args=(name, future), name=f"diffgraph-load-{name}",
                                     daemon=True).start()
                self._waiters[name] = self._waiters.get(name, 0) + 1
                waited = True
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                future.result(left)
            except BaseException as e:
                with self._lock:
                    self._unwait(name)
                if isinstance(e, TimeoutError):
                    raise TimeoutError(f"model {name!r} is still loading") from None
                raise

    def _unwait(self, name: str) -> None:  # (under the lock)
        self._waiters[name] -= 1
        if not self._waiters[name]:
            del self._waiters[name]

    def release(self, resident: Resident) -> None:
        with self._lock:
            resident.holds -= 1

    def resident(self) -> list[Resident]:
        with self._lock:
            return list(self._resident.values())

    def loading(self) -> list[str]:
        with self._lock:
            return list(self._loading)

    def wait_settled(self, timeout: float | None = None) -> bool:
        """Waits until no load or eviction is running (an eviction's memory is given back when it ends: the engine's
        objects are collected on the evicting thread, and another thread's gc.collect() returns at once while that
        collection runs); False if one still runs after `timeout` seconds."""
        if not self._loader.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._loader.release()
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            residents, self._resident = list(self._resident.values()), {}
        for r in residents:
            r.client.close()

    # -- the loader thread -----------------------------------------------------------------------------------------
    def _trim(self, keep: str) -> None:
        with self._loader:
            self._make_room(exclude=keep, need_slot=False)

    def _load(self, name: str, future: Future) -> None:
        try:
            with self._loader:
                self._drop_failed(name)
                self._make_room(exclude=name, need_slot=True, incoming=self._weights_estimate(name))
                before = self._used_bytes()
                t0 = time.perf_counter()
                engine = self._build_engine(name)
                client = AsyncEngine(engine, name=name)
                if self._on_load is not None:
                    self._on_load(client)
                resident = Resident(name, client, self._measure(engine, before), time.perf_counter() - t0)
                with self._lock:
                    closed = self._closed
                    if not closed:
                        self._resident[name] = resident
                        self.errors.pop(name, None)
                if closed:
                    client.close()
                    raise RuntimeError("the model set is closed")
                logger.info("model %s loaded in %.1f s (%.2f GiB of weights and graphs)", name, resident.loaded_s,
                            resident.memory_bytes / 2**30)
                self._make_room(exclude=name, need_slot=False)
            future.set_result(None)
        except Exception as e:
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            logger.warning("model %s could not be loaded: %s", name, message)
            with self._lock:
                self.errors[name] = message
            future.set_exception(e if isinstance(e, ModelTooLarge) else
                                 ModelLoadError(f"model {name!r} could not be loaded: {message}"))
        finally:
            with self._lock:
                self._loading.pop(name, None)

    def _weights_estimate(self, name: str) -> int:
        """The estimate of `name`'s weights (0 without an estimator or a budget); raises ModelTooLarge when it alone
        exceeds the budget (nothing is evicted or loaded for it)."""
        if self._estimate is None or self.memory_bytes is None:
            return 0
        need = self._estimate(name) or 0
        if need > self.memory_bytes:
            raise ModelTooLarge(f"model {name!r} needs about {_gib(need)} of weights, more than --model-memory "
                                f"{_gib(self.memory_bytes)}; raise --model-memory or use an fp8/GGUF file")
        return need

    def _build_engine(self, name: str) -> Engine:
        """The build of `name`; a CUDA out-of-memory error during it becomes a one-line ModelTooLarge once what was
        built is collected and the allocator's cache given back (the set goes on serving the others)."""
        try:
            return self._build(name, self.loop)
        except torch.cuda.OutOfMemoryError:
            pass  # leaving the handler drops the traceback, and with it the frames that hold the partial engine
        self._free_device()
        held = sum(r.memory_bytes for r in self.resident())
        raise ModelTooLarge(f"model {name!r} ran out of device memory while it loaded ({_gib(held)} held by the "
                            "resident models); lower --model-memory or --max-models so fewer stay resident, or use an "
                            "fp8/GGUF file")

    def _free_device(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _drop_failed(self, name: str) -> None:
        """A resident `name` whose engine failed (its loop stopped: not ready) is closed before it loads again, so
        its weights and graphs are given back rather than kept beside the new copy under the same name."""
        with self._lock:
            failed = self._resident.get(name)
            if failed is None or failed.client.ready:
                return
            del self._resident[name]
        logger.warning("model %s stopped serving (its engine failed); closing it and loading it again", name)
        failed.client.close()

    def _over_memory(self, incoming: int = 0) -> bool:
        """Whether what is resident, and `incoming` bytes more, exceeds the memory budget (under the lock)."""
        return self.memory_bytes is not None and sum(r.memory_bytes for r in self._resident.values()) + incoming > \
            self.memory_bytes

    def _make_room(self, exclude: str, need_slot: bool, incoming: int = 0) -> None:
        """Evicts idle models (never `exclude`), least recently used first: before a load until the new one has a
        slot under `max_models` (need_slot) and what is resident fits the memory budget beside the new one's
        estimated weights (`incoming`; a busy model kept it over), after it until the set fits its count and memory
        budget."""
        while True:
            with self._lock:
                others = [r for r in self._resident.values() if r.name != exclude]
                count = len(others) + 1 if need_slot else len(self._resident)
                over_memory = self._over_memory(incoming)
                idle = sorted((r for r in others if not r.busy and r.name not in self._waiters),
                              key=lambda r: r.last_used)
                if not (count > self.max_models or over_memory) or not idle:
                    return
                victim = idle[0]
                del self._resident[victim.name]
                others = idle = []  # no reference but `victim` is left to it
            logger.info("model %s evicted (%s)", victim.name, "the memory budget" if over_memory else "max-models")
            victim.client.close()
            del victim
            self._free_device()

    def _used_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0

    def _measure(self, engine: Engine, before: int) -> int:
        if self.device.type == "cuda":
            return max(0, torch.cuda.memory_reserved(self.device) - before)
        model = engine.model
        modules = [model.denoiser, model.vae, *model.text_encoders]
        return sum(t.numel() * t.element_size() for m in modules for t in [*m.parameters(), *m.buffers()])
