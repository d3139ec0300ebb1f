"""A `--model-dir` model set as an engine process holds it (a replica process, replica_process.py, or a Ray engine
replica, ray.py): the set itself (engine/model_set.py) with its default model held for good, the holds the server
takes around a request's validation and submit (by id, so they cross a pipe or a Ray call), and the set's state
as a `ModelsView` (remote_models.py) for the server's listing and /status.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Callable

from ..request import EngineClosed
from .remote_models import ModelSetSpec, ModelsView

logger = logging.getLogger(__name__)


class HeldModels:
    """The replica's side of a model set: the set (engine/model_set.py), its default model held for good, and the
    holds the server took (`acquire` to `release`, around validation and submit), by id."""

    def __init__(self, spec: ModelSetSpec, device: str, engine_kwargs: dict[str, Any],
                 on_load: Callable[[Any], None] | None = None):
        from ..models.catalog import ModelDir, model_path
        from .model_set import ModelSet, folder_builder, folder_estimate

        self.spec, self.catalog = spec, ModelDir(spec.root)
        self.set = ModelSet(folder_builder(spec.root, spec.default, {**engine_kwargs, "device": device}), device,
                            spec.max_models, spec.memory_bytes, on_load,
                            folder_estimate(spec.root, spec.default, device, engine_kwargs.get("dtype"),
                                            engine_kwargs.get("quantize") is not None))
        self._default = self.set.acquire(spec.default)  # never released: /ready follows it
        self.default_client = self._default.client
        self.default = self.default_client.engine
        default_path = model_path(spec.default)
        for name in spec.preload:  # one that cannot load is listed with its error; the default still serves
            try:
                entry = self.catalog.resolve(name)
                if entry.path != default_path:  # else it is the default (`--model PATH` inside the folder)
                    self.set.release(self.set.acquire(entry.name))
            except ValueError as e:  # ModelNameError (not in the folder, unusable), ModelLoadError
                logger.error("preloading model %r failed: %s", name, e)
                self.set.errors.setdefault(name, str(e))
        self._holds: dict[int, Any] = {}
        self._requests: dict[str, Any] = {}  # request id -> the resident it was submitted to, until answered
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def acquire(self, name: str, seconds: float) -> tuple[int, Any, int]:
        resident = self.set.acquire(name, seconds)
        with self._lock:
            hold = next(self._ids)
            self._holds[hold] = resident
        return hold, resident.client.info, resident.memory_bytes

    def release(self, hold: int) -> None:
        with self._lock:
            resident = self._holds.pop(hold, None)
        if resident is not None:
            self.set.release(resident)

    def client_of(self, hold: int) -> Any:
        """The held model's `AsyncEngine` (EngineClosed once the hold is gone)."""
        with self._lock:
            resident = self._holds.get(hold)
        if resident is None:
            raise EngineClosed("the model this request was validated against is no longer held here (the engine "
                               "process restarted); retry it")
        return resident.client

    def engine_of(self, hold: int) -> Any:
        return self.client_of(hold).engine

    def submit(self, hold: int | None, request: Any, **callbacks: Any) -> Any:
        """Submits to the held model's engine (hold None: the default's; `Engine.submit`: a Future), counted as that
        model's in flight until answered (the listing and /status show it)."""
        with self._lock:
            resident = self._default if hold is None else self._holds.get(hold)
        if resident is None:
            self.client_of(hold)  # raises the hold's EngineClosed
        future = resident.client.engine.submit(request, **callbacks)
        with self._lock:
            self._requests[request.request_id] = resident
        future.add_done_callback(lambda _: self._answered(request.request_id))
        return future

    def _answered(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def owner(self, request_id: str) -> Any | None:
        """The engine a held request was submitted to (None: not one of the set's other models')."""
        with self._lock:
            resident = self._requests.get(request_id)
        return None if resident is None else resident.client.engine

    def resident_engine(self, name: str) -> Any | None:
        return next((r.client.engine for r in self.set.resident() if r.name == name), None)

    def view(self) -> ModelsView:
        residents = self.set.resident()
        with self._lock:
            held = [r.name for r in self._requests.values()]
        return ModelsView(resident=[(r.name, r.client.info, r.memory_bytes, r.client.in_flight() + held.count(r.name))
                                    for r in residents],
                          loading=self.set.loading(), errors=dict(self.set.errors),
                          stats={r.name: _model_stats(r.client.stats()) for r in residents})

    def close(self) -> None:
        self.set.close()


def _model_stats(stats: Any) -> dict[str, Any]:
    """The figures of one resident model's engine that /status shows per model."""
    return {"queue_depth": stats.queue_depth, "steps": stats.steps, "failed_steps": stats.failed_steps,
            "live_rows": dict(stats.live_rows)}
