"""The ingress side of diffgraph on Ray Serve (ray.py holds the deployments and the application builder):
`RayEngineClient`, the `EngineClient` an ingress replica's app runs over the engine deployment's handle, and, with
`--model-dir`, `RayModels`, the `ModelsBackend` (engine/remote_models.py) the app's model routing asks.

Models under Ray: each engine replica holds a model set of its own (engine/held_models.py); a request for a folder
model carries Ray Serve's `multiplexed_model_id`, so Ray's router sends it to a replica where that model is loaded
(or loading), and a replica that has not got it loads it on first use (Ray's multiplexing API: the engine
deployment's `_routed` loader). The set's own LRU (count and memory budget, never a busy model) decides what stays
resident; Ray's per-replica model count only steers routing. Listings (/v1/models, /status) are the replicas' model
views as the stats poll last got them, each replica's kept for VIEW_TTL_S.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .engine import replica_messages as M
from .engine.client import EngineStats
from .engine.remote_models import ModelClient, ModelsView, RemoteResident, merged_residents, status_rows
from .request import EngineClosed, GenerationRequest, GenerationResult, ModelInfo, ProgressEvent, QueueFullError

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "DiffgraphEngine"
STATS_PERIOD_S = 2.0  # how often the ingress refreshes the engine figures it shows on /metrics and /status
UNHEALTHY_AFTER = 3   # stats polls in a row that no ready engine replica answers: the ingress is not ready
VIEW_TTL_S = 30.0     # a replica's model view older than this is dropped from the listing (it went away)


class RayEngineClient:
    """The `EngineClient` of an ingress replica: requests go to the engine deployment through its handle (Ray
    routes them among the engine replicas). Engine figures (stats, graph table) are one replica's, refreshed every
    STATS_PERIOD_S; Ray's own metrics and dashboard cover the deployment as a whole."""

    restarts = 0

    def __init__(self, handle: Any, name: str = f"ray:{ENGINE_DEPLOYMENT}", stats_timeout_s: float = 30.0,
                 models: bool = False):
        self._handle = handle
        self._models = models  # the engine replicas hold --model-dir sets: their views are polled with the stats
        self.model_views: dict[str, tuple[float, ModelsView]] = {}  # replica -> (when, its set's view)
        self.name = name
        self.error: str | None = None  # why the engine deployment is not healthy (None: it is)
        self._misses = 0
        self._stats_timeout_s = stats_timeout_s
        self.info: ModelInfo = handle.info.remote().result()  # waits for the first engine replica
        self._streams: dict[str, Any] = {}
        self._stats: EngineStats | None = None
        self._closed = threading.Event()
        self._poll = threading.Thread(target=self._poll_stats, name="diffgraph-ray-stats", daemon=True)
        self._poll.start()

    @property
    def ready(self) -> bool:
        """The engine deployment's health as the ingress sees it: its replicas answer and report ready (a replica
        that is down or whose failure policy tripped is what Ray's health check replaces)."""
        return not self._closed.is_set() and self.error is None

    @property
    def state(self) -> str:
        return "closed" if self._closed.is_set() else "ready" if self.error is None else "unhealthy"

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.ready

    def _poll_stats(self) -> None:
        while not self._closed.is_set():
            self.poll_once()
            self._closed.wait(STATS_PERIOD_S)

    def poll_once(self) -> None:
        """One stats call: the figures, and the deployment's health (UNHEALTHY_AFTER failed or not-ready answers
        in a row make the ingress not ready; one good answer makes it ready again)."""
        try:
            stats = self._handle.stats.remote().result(timeout_s=self._stats_timeout_s)
        except Exception as e:  # no replica answers (all restarting, or none left)
            logger.debug("engine stats not available: %s", e)
            why = f"no engine replica answers ({type(e).__name__})"
        else:
            self._stats = stats
            why = None if stats.ready else "the engine replica reports not ready (its failure policy tripped)"
        if self._models:
            try:
                replica, view = self._handle.models.remote().result(timeout_s=self._stats_timeout_s)
                self.model_views[replica] = (time.monotonic(), view)
            except Exception as e:
                logger.debug("engine model views not available: %s", e)
        self._misses = 0 if why is None else self._misses + 1

        if why is None:
            self.error = None
        elif self._misses >= UNHEALTHY_AFTER:
            self.error = why

    async def submit(self, request: GenerationRequest, progress: bool = False,
                     model: str | None = None) -> "_RayRequest":
        """Streams the request to an engine replica; with `model` (a --model-dir model) to one where Ray's router
        knows it loaded."""
        if self._closed.is_set():
            raise EngineClosed("the engine client is closed")
        options: dict[str, Any] = {"stream": True}
        if model is not None:
            options["multiplexed_model_id"] = model
        stream = self._handle.options(**options).run.remote(request, progress, model)
        try:
            first = await stream.__anext__()
        except Exception as e:
            if _back_pressure(e):  # every replica busy and Ray's queue for them full: diffgraph's 429
                raise QueueFullError("every engine replica is busy and the deployment's queue is full; retry later "
                                     "(or add replicas)") from None
            raise _unavailable(e) from None
        if isinstance(first, M.Rejected):
            raise first.error
        handle = _RayRequest(self, stream, request.request_id)
        self._streams[request.request_id] = handle
        return handle

    def abort(self, request_id: str) -> bool:
        handle = self._streams.get(request_id)
        return handle is not None and handle.abort()

    def stats(self) -> EngineStats | None:
        return self._stats

    def views(self) -> list[tuple[str, ModelsView]]:
        """The engine replicas' model views seen within VIEW_TTL_S."""
        now = time.monotonic()
        return [(replica, view) for replica, (when, view) in list(self.model_views.items()) if now - when < VIEW_TTL_S]

    def model_info(self, name: str, seconds: float) -> tuple[ModelInfo, int]:
        """Loads `name` on an engine replica (one where it is loaded already, by Ray's multiplexed routing) and
        returns its ModelInfo and bytes; ModelLoadError, TimeoutError, EngineClosed as `ModelSet.acquire`."""
        try:
            answer = self._handle.options(multiplexed_model_id=name).model_info.remote(name, seconds).result(
                timeout_s=seconds + self._stats_timeout_s)
        except TimeoutError:
            raise
        except Exception as e:
            if "Timeout" in type(e).__name__:
                raise TimeoutError(f"model {name!r} is still loading") from None
            raise _unavailable(e) from None
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def graph_table(self) -> list[dict[str, Any]]:
        return [] if self._stats is None else self._stats.graphs

    def add_step_listener(self, listener: Any) -> None:
        """Steps run in the engine replicas: their per-step histograms are not collected at the ingress."""

    def close(self) -> None:
        self._closed.set()
        for handle in list(self._streams.values()):
            handle.abort()


class _RayRequest:
    """One request's stream from an engine replica, as a RequestHandle."""

    def __init__(self, client: RayEngineClient, stream: Any, request_id: str):
        self.request_id = request_id
        self._client, self._stream = client, stream
        self._finished = False
        self.dropped_previews = 0  # a lagging reader's previews are dropped in the engine replica, counted there

    async def events(self):
        try:
            while True:
                try:
                    item = await self._stream.__anext__()
                except StopAsyncIteration:
                    raise EngineClosed("the engine replica ended the request without a result; retry it") from None
                except Exception as e:
                    raise _unavailable(e) from None
                if isinstance(item, ProgressEvent):
                    yield item
                    continue
                self._finished = True
                if item.error is not None:
                    raise item.error
                yield item.result
                return
        finally:
            self._client._streams.pop(self.request_id, None)
            if not self._finished:
                self.abort()

    async def result(self) -> GenerationResult:
        async for item in self.events():
            if not isinstance(item, ProgressEvent):
                return item
        raise EngineClosed("the engine replica ended the request without a result; retry it")

    def abort(self) -> bool:
        self._finished = True
        self._stream.cancel()  # the replica's generator is cancelled: it aborts the request there
        return True


def _back_pressure(error: BaseException) -> bool:
    try:
        from ray.serve.exceptions import BackPressureError
    except ImportError:  # an older Ray without a bounded queue
        return False
    return isinstance(error, BackPressureError)


def _unavailable(error: BaseException) -> EngineClosed:
    """A Ray failure on the way to or from an engine replica (it died, or is being replaced): a retryable 503."""
    logger.warning("engine replica unavailable: %s: %s", type(error).__name__, error)
    return EngineClosed(f"the engine replica serving this request is unavailable ({type(error).__name__}); retry it "
                        "(Ray Serve replaces the replica, the others keep serving)")


class RayModelClient(ModelClient):
    """A folder model's requests through the ingress's engine client, routed by Ray to a replica that has it."""

    def __init__(self, client: RayEngineClient, name: str, info: ModelInfo):
        super().__init__(None, client, info, 0)
        self.name = name

    async def submit(self, request: GenerationRequest, progress: bool = False) -> Any:
        return await self.replica.submit(request, progress, model=self.name)


class RayModels:
    """The `ModelsBackend` of an ingress over engine replicas that hold --model-dir sets (the module's doc).
    `client` is set once the app built its engine client."""

    def __init__(self) -> None:
        self.client: RayEngineClient | None = None

    def _views(self) -> list[tuple[str, ModelsView]]:
        return [] if self.client is None else self.client.views()

    def _client(self) -> RayEngineClient:
        if self.client is None or not self.client.ready:
            raise EngineClosed("no engine replica is ready; retry shortly")
        return self.client

    def acquire(self, name: str, timeout: float | None = None) -> RemoteResident:
        client = self._client()
        info, memory_bytes = client.model_info(name, 3600.0 if timeout is None else max(0.0, timeout))
        return RemoteResident(name, RayModelClient(client, name, info), memory_bytes)

    def release(self, resident: RemoteResident) -> None:
        """Nothing: a replica holds the model only around its own submit of the request."""

    def resident(self) -> list[RemoteResident]:
        return merged_residents(self._views(), lambda _, info, in_flight: ModelClient(None, self.client, info, 0,
                                                                                       in_flight))

    def loading(self) -> list[str]:
        return sorted({n for _, view in self._views() for n in view.loading})

    @property
    def errors(self) -> dict[str, str]:
        return {n: e for _, view in self._views() for n, e in view.errors.items()}

    def status(self) -> list[dict[str, Any]]:
        return status_rows(self._views())

    def loras(self, name: str) -> dict[str, Any] | None:
        """None: each engine replica has its own slots; the listing is the folder's, with the model's family."""
        return None

    def close(self) -> None:
        """Nothing here: each set closes with its engine replica."""
