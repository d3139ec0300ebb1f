"""Ray Serve: diffgraph over many GPUs and hosts. `build_app` is a Ray Serve application builder:

    serve run diffgraph.ray:build_app model=/models/sd15 num_replicas=4        # against a running cluster
    diffgraph serve --ray --model /models/sd15 --data-parallel 4               # starts a local Ray when none is given

Two deployments: `DiffgraphIngress` (the same FastAPI app as `diffgraph serve`: the OpenAI-shaped API, SSE
streaming, the playground, /ready, /metrics and the API key) and `DiffgraphEngine` (one engine per replica, one GPU
each; its step-level batching stays inside the replica, Ray's routing is between replicas). The ingress talks to the
engine deployment through `RayEngineClient`, an `EngineClient` (engine/client.py) over a Ray deployment handle, so
the ingress app runs the same code path (a Router of one client) as on one host. Only the protocol's picklable data
crosses: requests in, progress events and a result with the encoded image bytes out (the replica encodes).

Settings (`key=value` after `serve run`, `args:` of a serve config, or the flags of `diffgraph serve --ray`): every
`diffgraph serve` setting (model, device, dtype, batch-buckets, resolutions, ...; `config=FILE.toml` reads a file
first), plus `num_replicas` (an integer, or "auto" to autoscale), `min_replicas` / `max_replicas` (autoscaling
bounds), `num_gpus` (per engine replica: 1, or 0 for CPU replicas; default from `device`), `num_cpus` (per engine
replica, fractional: default 1 with a GPU, 0.5 on the CPU) and `ingress_replicas`. A serve config's per-deployment
overrides (autoscaling_config, ray_actor_options, ...) apply on top, by the deployment names above.
`max_ongoing_requests` of an engine replica is set from its row capacity (Ray's default of 5 would cap our batches).
The API key: `api_key=...` or, better, DIFFGRAPH_API_KEY in the ingress replica's environment (a Kubernetes secret).
A replica that dies answers its requests in flight with 503 (retryable) at once; Ray Serve starts a new one, and its
health check is the engine's readiness. With `model_dir` every engine replica holds a model set and Ray's model
multiplexing routes a folder model's requests (ray_ingress.py says how).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Mapping

from .engine import replica_messages as M
from .engine.client import EngineStats
from .engine.remote_models import ModelSetSpec, ModelsView
from .ray_ingress import ENGINE_DEPLOYMENT, RayEngineClient, RayModels
from .request import GenerationRequest, ModelInfo, ProgressEvent

logger = logging.getLogger(__name__)

INGRESS_DEPLOYMENT = "DiffgraphIngress"
RAY_KEYS = ("num_replicas", "min_replicas", "max_replicas", "num_gpus", "num_cpus", "ingress_replicas", "config")


# -- the engine deployment (one engine per replica) -------------------------------------------------------
class EngineDeployment:
    """One engine in a Ray Serve replica, or with `models` (--model-dir) a model set whose default model is that
    engine (engine/held_models.py). Its methods are what the ingress calls through the deployment handle."""

    def __init__(self, engine_kwargs: dict[str, Any], torch_threads: int | None = None,
                 models: ModelSetSpec | None = None):
        from .engine.async_engine import AsyncEngine
        from .models.quiet import quiet_known_warnings

        quiet_known_warnings()
        if torch_threads is not None:
            import torch
            torch.set_num_threads(torch_threads)
        self._held: Any = None
        if models is None:
            from .engine.engine import Engine
            engine = Engine(**engine_kwargs)
            engine.generate("warm-up", num_inference_steps=1, seed=0)  # a broken model fails here, not on a request
            self._client = AsyncEngine(engine, name=_replica_name())
        else:
            from .engine.held_models import HeldModels
            kwargs = {k: v for k, v in engine_kwargs.items() if k != "device"}
            self._held = HeldModels(models, engine_kwargs.get("device", "cuda"), kwargs)  # each build warms up
            self._client = self._held.default_client

    async def info(self) -> ModelInfo:
        return self._client.info

    async def stats(self) -> EngineStats:
        return dataclasses.replace(self._client.stats(), replicas=[])

    async def models(self) -> tuple[str, ModelsView]:
        """This replica's model set as the ingress lists it (/v1/models, /status)."""
        return _replica_name(), self._held.view() if self._held is not None else ModelsView()

    async def _routed(self, model_id: str) -> str:
        """Ray's multiplexed loader (wrapped by `serve.multiplexed` in `application`): the model resident in the set,
        so Ray routes its requests here; the set's LRU, not Ray's, decides what stays (the name is all Ray keeps)."""
        import asyncio

        hold = (await asyncio.to_thread(self._held.acquire, model_id, 3600.0))[0]
        self._held.release(hold)
        return model_id

    async def model_info(self, name: str, seconds: float) -> Any:
        """(ModelInfo, bytes) of a folder model once resident here, or the load's error as a value."""
        import asyncio

        try:
            await asyncio.wait_for(asyncio.shield(self._routed(name)), seconds)  # the load goes on past the wait
            hold, info, memory_bytes = await asyncio.to_thread(self._held.acquire, name, seconds)
            self._held.release(hold)
            return info, memory_bytes
        except TimeoutError:
            return TimeoutError(f"model {name!r} is still loading")
        except Exception as e:  # ModelLoadError, no model set: the caller's answer
            return e

    async def run(self, request: GenerationRequest, progress: bool, model: str | None = None):
        """Streams the replica pipe's typed messages (engine/replica_messages.py): `Accepted` or `Rejected`, then
        progress events, then `Done` (the result or the error)."""
        import asyncio

        hold = None
        try:
            client = self._client
            if model is not None:  # a folder model: held from before its submit until after (never evicted under it)
                if self._held is None:
                    raise ValueError(f"model {model!r}: this deployment serves one model (no model_dir)")
                await self._routed(model)
                hold = (await asyncio.to_thread(self._held.acquire, model, 3600.0))[0]
                client = self._held.client_of(hold)
            handle = await client.submit(request, progress=progress)
        except Exception as e:  # ParamError, QueueFullError, EngineClosed, ModelLoadError: the caller's answer
            yield M.Rejected(request.request_id, e)
            return
        finally:
            if hold is not None:
                self._held.release(hold)
        yield M.Accepted(request.request_id)
        events = handle.events()
        try:
            async for item in events:  # a cancelled stream (client gone, abort) aborts the request here
                if isinstance(item, ProgressEvent):
                    yield item
                else:
                    if item.encoded is not None:
                        item.arrays = None  # the encoded bytes are what the ingress sends on: move them once
                    yield M.Done(request.request_id, item)
        except Exception as e:
            yield M.Done(request.request_id, error=e)
        finally:
            await events.aclose()

    async def check_health(self) -> None:
        """Ray Serve's replica health check: the engine's readiness (its loop runs), every resident model's with a
        set (they share the device: one model's failure policy tripping replaces the replica)."""
        clients = [self._client] if self._held is None else [r.client for r in self._held.set.resident()]
        for client in clients:
            if not client.ready and client.state != "closed":  # closed: evicted between the listing and now
                raise RuntimeError(f"engine {client.name} is {client.state}")

    def __del__(self) -> None:
        held, client = getattr(self, "_held", None), getattr(self, "_client", None)
        if held is not None:
            held.close()
        elif client is not None:
            client.close()


def _replica_name() -> str:
    try:
        from ray import serve
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a replica (tests)
        return "ray"


# -- the application builder --------------------------------------------------------------------------------
def split_args(args: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """`build_app`'s arguments -> (Ray options, ServerConfig). Values may be strings (`serve run k=v`)."""
    from .api.config import load_config

    ray_opts = {k.replace("-", "_"): v for k, v in args.items() if k.replace("-", "_") in RAY_KEYS}
    server = {k: _boolean(v) for k, v in args.items() if k.replace("-", "_") not in RAY_KEYS}
    config = load_config(ray_opts.pop("config", None), server)
    opts: dict[str, Any] = {}
    for key in ("num_replicas", "min_replicas", "max_replicas", "ingress_replicas"):
        value = ray_opts.get(key)
        if value is None or (key == "num_replicas" and value == "auto"):
            opts[key] = value
            continue
        try:
            opts[key] = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be an integer{' or auto' if key == 'num_replicas' else ''}, "
                             f"got {value!r}") from None
        if opts[key] < (0 if key == "min_replicas" else 1):
            raise ValueError(f"{key} {opts[key]} is out of range")
    cpu = config.device == "cpu"
    for key, default in (("num_gpus", 0.0 if cpu else 1.0), ("num_cpus", 0.5 if cpu else 1.0)):
        try:
            opts[key] = float(ray_opts.get(key, default))
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be a number, got {ray_opts[key]!r}") from None
        if opts[key] < 0:
            raise ValueError(f"{key} {opts[key]} must be >= 0")
    if cpu and opts["num_gpus"]:
        raise ValueError("device=cpu replicas take no GPU: leave num_gpus out (or 0)")
    if config.devices:
        raise ValueError("devices is for one host without Ray; under Ray, num_replicas sets the engine replicas "
                         "(one GPU each)")
    return opts, config


def _boolean(value: Any) -> Any:
    return {"true": True, "false": False}.get(value.lower(), value) if isinstance(value, str) else value


def build_app(args: Mapping[str, Any] | None = None) -> Any:
    """The Ray Serve application (ingress bound to the engine deployment) for `args` (see the module doc)."""
    opts, config = split_args(args or {})
    return application(config, opts)


def application(config: Any, opts: dict[str, Any]) -> Any:
    """The application for a ServerConfig and Ray options (split_args' keys; missing ones take their defaults)."""
    from ray import serve

    opts = {**split_args({"device": config.device or "cuda"})[0], **opts}
    rows = max(config.batch_buckets)
    scaling: dict[str, Any]
    if opts["num_replicas"] == "auto" or opts["min_replicas"] is not None or opts["max_replicas"] is not None:
        lo = opts["min_replicas"] if opts["min_replicas"] is not None else 1
        hi = opts["max_replicas"] if opts["max_replicas"] is not None else max(lo, 1) * 4
        if hi < max(lo, 1):
            raise ValueError(f"max_replicas {hi} must be >= min_replicas {lo} (and >= 1)")
        scaling = {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": rows}}
    else:
        scaling = {"num_replicas": opts["num_replicas"] or 1}
    engine_kwargs = dict(config.engine_kwargs(), device="cpu" if config.device == "cpu" else "cuda")
    threads = config.resolved_torch_threads() if config.device == "cpu" else None
    spec = config.model_set()
    deployment: type = EngineDeployment
    if spec is not None:  # Ray's multiplexed routing of folder models (ray_ingress.py's doc); the default is not one
        routed = serve.multiplexed(max_num_models_per_replica=max(1, spec.max_models - 1))(EngineDeployment._routed)
        deployment = type("EngineDeployment", (EngineDeployment,), {"_routed": routed})
    engine = serve.deployment(
        deployment, name=ENGINE_DEPLOYMENT,
        ray_actor_options={"num_gpus": opts["num_gpus"], "num_cpus": opts["num_cpus"]},
        # the rows a replica batches, plus as many waiting: its scheduler fills rows as soon as others retire
        max_ongoing_requests=2 * rows, health_check_period_s=10, health_check_timeout_s=60,
        # Ray's own queue in front of the replicas, bounded like an engine's: past it a request is a 429, not a wait
        max_queued_requests=config.max_queue,
        graceful_shutdown_timeout_s=config.drain_timeout, **scaling)

    def asgi_app() -> Any:  # evaluated in each ingress replica
        from .server.app import create_app

        cfg = config
        if not cfg.api_keys and os.environ.get("DIFFGRAPH_API_KEY"):
            cfg = dataclasses.replace(cfg, api_keys=tuple(k.strip() for k in os.environ["DIFFGRAPH_API_KEY"].split(",")
                                                          if k.strip()))
        app_name = serve.get_replica_context().app_name
        models = RayModels() if spec is not None else None

        def engine_client() -> RayEngineClient:
            client = RayEngineClient(serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app_name),
                                     models=models is not None)
            if models is not None:
                models.client = client
            return client
        return create_app(cfg, engine_factory=engine_client, models=models)

    class Ingress:
        def __init__(self, engine_handle: Any):
            self.engine_handle = engine_handle  # binding it makes the engine deployment part of the application

    ingress = serve.deployment(
        serve.ingress(asgi_app)(Ingress), name=INGRESS_DEPLOYMENT, num_replicas=opts["ingress_replicas"] or 1,
        ray_actor_options={"num_cpus": 0.25},
        max_ongoing_requests=config.max_queue + 4 * rows,  # waiting HTTP requests are cheap; the engines queue
        graceful_shutdown_timeout_s=config.drain_timeout + 5)
    return ingress.bind(engine.bind(engine_kwargs, threads, spec))


# Ray Serve's proxy checks (5 s to be ready, 10 s per health check, 3 misses and it is killed): a local Ray on a
# loaded machine (CPU-bound engine replicas beside it) misses them; these bounds are what diffgraph starts it with
PATIENT_RAY_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
                   "RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S": "20"}


def patient_ray_env() -> None:
    """Sets PATIENT_RAY_ENV where the environment does not say otherwise, before a local Ray starts (its processes
    inherit it)."""
    for key, value in PATIENT_RAY_ENV.items():
        os.environ.setdefault(key, value)


def serve_flags(config: Any, data_parallel: int | None, address: str | None) -> int:
    """`diffgraph serve --ray`: Ray Serve with `--data-parallel` engine replicas (default 1), one line and exit code 2
    for a bad value."""
    import sys
    try:
        opts = split_args({"device": config.device or "cuda",
                           "num_replicas": data_parallel if data_parallel is not None else 1})[0]
    except ValueError as e:
        print(f"diffgraph: error: --data-parallel: {e}", file=sys.stderr)
        return 2
    return serve_local(config, opts, address=address)


def serve_local(config: Any, opts: dict[str, Any], address: str | None = None) -> int:
    """`diffgraph serve --ray`: connects to the Ray cluster at `address` (or RAY_ADDRESS), else starts a local
    one; runs the application at config.host:config.port until SIGTERM or Ctrl-C, then shuts Serve down (the
    replicas drain for up to the drain timeout) and returns 0."""
    import signal

    import ray
    from ray import serve

    stop = threading.Event()
    if address is None and not os.environ.get("RAY_ADDRESS"):  # a local Ray of our own
        patient_ray_env()
    ray.init(address=address, include_dashboard=False, log_to_driver=config.log_level == "debug")
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(application(config, opts), name="diffgraph", route_prefix="/", blocking=False)
        logger.info("diffgraph on Ray Serve at http://%s:%d (GET /ready answers 200 once an engine replica is "
                    "ready)", config.host, config.port)
        stop.wait()
        logger.info("shutting down: the replicas drain for up to %g s", config.drain_timeout)
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0


__all__ = ["build_app", "serve_flags", "serve_local", "application", "split_args", "RayEngineClient", "EngineDeployment"]
