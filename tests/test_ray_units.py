"""The Ray ingress's engine client without a Ray cluster (a fake deployment handle): its readiness follows the
engine deployment's health, and a saturated deployment (Ray's bounded queue full) is diffgraph's 429 (issue 28
point 5), not a request held forever; a request streams from the engine deployment to the ingress as the replica
pipe's typed messages."""

import asyncio
import time

import pytest

pytest.importorskip("ray.serve")

from diffgraph import ray_ingress as dray  # noqa: E402
from diffgraph.engine.client import EngineStats  # noqa: E402
from diffgraph.engine.remote_models import ModelsView  # noqa: E402
from diffgraph.errors import ModelLoadError  # noqa: E402
from diffgraph.request import GenerationRequest, ModelInfo, QueueFullError  # noqa: E402

INFO = ModelInfo(name="m", family="sd", native_size=64, default_guidance=7.5, max_rows=4, mode="eager",
                 device="cpu")


def stats(ready: bool) -> EngineStats:
    return EngineStats(ready=ready, queue_depth=0, live_rows={}, steps=0, failed_steps=0, growth_holds=0,
                       prompt_cache_hits=0, prompt_cache_misses=0, device_memory_bytes=0)


class Call:
    def __init__(self, fn):
        self.fn = fn

    def result(self, timeout_s=None):
        return self.fn()


class FakeHandle:
    """What RayEngineClient calls on a deployment handle."""

    def __init__(self):
        self.answer = lambda: stats(True)
        self.calls = 0
        self.first_item = None
        outer = self

        class Method:
            def __init__(self, fn):
                self.fn = fn

            def remote(self, *args):
                return self.fn(*args)

        def stats_call():
            outer.calls += 1
            return Call(lambda: outer.answer())
        self.info = Method(lambda: Call(lambda: INFO))
        self.stats = Method(stats_call)
        self.run = Method(lambda request, progress, model=None: outer._stream())
        self.model_answer = (INFO, 123)
        self.model_info = Method(lambda name, seconds: Call(lambda: outer.model_answer))
        self.view = ModelsView(resident=[("a", INFO, 5, 1)], stats={"a": {"steps": 7}})
        self.models = Method(lambda: Call(lambda: ("replica-1", outer.view)))

    def options(self, **_):
        return self

    def _stream(self):
        async def gen():
            raise self.first_item
            yield  # noqa: unreachable: an async generator
        return gen()


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setattr(dray, "STATS_PERIOD_S", 3600.0)  # the client's own poller polls once, at start
    handle = FakeHandle()
    c = dray.RayEngineClient(handle, stats_timeout_s=1.0)
    deadline = time.monotonic() + 60
    while handle.calls < 1 and time.monotonic() < deadline:  # its first poll has run
        time.sleep(0.01)
    yield c, handle
    c.close()


def test_readiness_follows_the_engine_deployments_health(client):
    c, handle = client
    assert c.ready and c.state == "ready"

    def down():
        raise TimeoutError("no replica")
    handle.answer = down
    for i in range(dray.UNHEALTHY_AFTER):
        assert c.ready  # one missed poll is not a verdict
        c.poll_once()
    assert not c.ready and c.state == "unhealthy" and "no engine replica answers" in c.error
    handle.answer = lambda: stats(True)
    c.poll_once()
    assert c.ready and c.error is None
    handle.answer = lambda: stats(False)  # a replica whose failure policy tripped
    for _ in range(dray.UNHEALTHY_AFTER):
        c.poll_once()
    assert not c.ready and "not ready" in c.error


def test_a_saturated_deployment_is_a_queue_full_error(client):
    from ray.serve.exceptions import BackPressureError
    c, handle = client
    handle.first_item = BackPressureError(num_queued_requests=8, max_queued_requests=8)
    request = GenerationRequest.create("a cat", model=INFO)
    with pytest.raises(QueueFullError, match="deployment's queue is full"):
        asyncio.run(c.submit(request))
    handle.first_item = ConnectionError("replica died")
    with pytest.raises(Exception, match="unavailable"):
        asyncio.run(c.submit(request))


def test_the_ray_model_backend_acquires_through_the_deployment_and_lists_the_polled_views(monkeypatch):
    monkeypatch.setattr(dray, "STATS_PERIOD_S", 3600.0)
    handle = FakeHandle()
    client = dray.RayEngineClient(handle, stats_timeout_s=1.0, models=True)
    models = dray.RayModels()
    with pytest.raises(Exception, match="no engine replica is ready"):
        dray.RayModels().acquire("a")  # before the app built its client: a retryable 503
    models.client = client
    try:
        resident = models.acquire("a", 10)
        assert (resident.name, resident.memory_bytes, resident.client.info) == ("a", 123, INFO)
        handle.model_answer = ModelLoadError("model 'b' could not be loaded: truncated")
        with pytest.raises(ModelLoadError, match="truncated"):
            models.acquire("b", 10)
        client.poll_once()  # the views come with the stats poll
        assert [(r.name, r.memory_bytes, r.client.in_flight()) for r in models.resident()] == [("a", 5, 1)]
        assert models.status() == [{"model": "a", "replica": "replica-1", "in_flight": 1, "memory_bytes": 5,
                                    "steps": 7}]
        monkeypatch.setattr(dray, "VIEW_TTL_S", 0.0)  # a replica not heard from within the TTL is left out
        assert models.resident() == [] and models.status() == []
    finally:
        client.close()


class _FakeEngineClient:
    """The engine client of an engine deployment: its submit refuses (`error`) or gives a handle whose events are
    one progress event and the result."""

    def __init__(self, error: BaseException | None = None):
        self.error = error

    def close(self):
        pass

    async def submit(self, request, progress=False):
        from diffgraph.request import GenerationResult, ProgressEvent
        if self.error is not None:
            raise self.error

        class Handle:
            async def events(self):
                yield ProgressEvent(request.request_id, 1, 2)
                yield GenerationResult(request.request_id, None, request.seed, {"total": 1.0}, request,
                                       encoded=[b"png"])
        return Handle()


def _deployment(engine_client):
    from diffgraph.ray import EngineDeployment
    deployment = object.__new__(EngineDeployment)  # without its engine build: the fake client stands for it
    deployment._client, deployment._held = engine_client, None
    return deployment


def test_a_request_streams_from_the_engine_deployment_to_the_ingress_as_typed_messages(client):
    """The engine deployment's `run` sends the replica pipe's typed messages (Accepted, progress events, Done) and
    the ingress's client reads them: the progress event, then the result; a refused submit is the caller's error."""
    from diffgraph.engine import replica_messages as M
    from diffgraph.errors import ParamError
    from diffgraph.request import GenerationResult, ProgressEvent
    c, handle = client
    request = GenerationRequest.create("a cat", model=INFO, seed=3)
    deployment = _deployment(_FakeEngineClient())
    handle.run.fn = lambda request, progress, model=None: deployment.run(request, progress, model)

    async def sent():
        return [m async for m in deployment.run(request, True)]
    messages = asyncio.run(sent())
    assert [type(m) for m in messages] == [M.Accepted, ProgressEvent, M.Done]
    assert messages[0].request_id == messages[2].request_id == request.request_id and messages[2].error is None

    async def received():
        stream = await c.submit(request, progress=True)
        return [item async for item in stream.events()]
    progress, result = asyncio.run(received())
    assert (progress.step, progress.total) == (1, 2)
    assert isinstance(result, GenerationResult) and result.encoded == [b"png"] and result.seed == 3
    deployment._client = _FakeEngineClient(ParamError("width", "width 65 is not a multiple of 8"))
    assert [type(m) for m in asyncio.run(sent())] == [M.Rejected]
    with pytest.raises(ParamError, match="width 65"):
        asyncio.run(c.submit(request))
