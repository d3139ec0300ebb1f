"""RequestHandleImpl (engine/handles.py): the per-request queue between the engine's threads and the event loop.
A reader that lags (a slow stream client) holds at most the newest PREVIEWS_KEPT previews, since a later preview
supersedes an earlier one, while every progress event and the result arrive, in order."""

from __future__ import annotations

import asyncio

from diffgraph.engine.handles import PREVIEWS_KEPT, RequestHandleImpl
from diffgraph.request import GenerationRequest, GenerationResult, ProgressEvent

STEPS = 40


def _request() -> GenerationRequest:
    return GenerationRequest.create("a digit", width=64, height=64, guidance_scale=5.0, num_inference_steps=STEPS,
                                   request_id="r1")


def _produce(handle: RequestHandleImpl, request: GenerationRequest, steps: range) -> None:
    """What the engine sends for these steps: a progress event each, and a preview (64 KiB) each."""
    for step in steps:
        handle.progress(ProgressEvent("r1", step, STEPS))
        handle.progress(ProgressEvent("r1", step, STEPS, (bytes(65536),), "jpeg"))


async def _read(handle: RequestHandleImpl) -> list:
    return [item async for item in handle.events()]


def test_a_reader_that_lags_gets_only_the_newest_previews_and_every_progress_event_and_the_result():
    async def main():
        request = _request()
        handle = RequestHandleImpl(lambda h: True, request, progress=True)
        result = GenerationResult("r1", None, 1, {}, request)

        def engine():  # the engine's threads run ahead: nothing is read until the request is done
            _produce(handle, request, range(1, STEPS + 1))
            handle.finish(result, None)
        await asyncio.to_thread(engine)
        return await _read(handle), result

    items, result = asyncio.run(main())
    progress = [i.step for i in items if isinstance(i, ProgressEvent) and not i.previews]
    previews = [i.step for i in items if isinstance(i, ProgressEvent) and i.previews]
    assert PREVIEWS_KEPT == 4
    assert progress == list(range(1, STEPS + 1))  # never dropped
    assert previews == list(range(STEPS - PREVIEWS_KEPT + 1, STEPS + 1))  # the newest only: the bound
    assert items[-1] is result
    order = [(i.step, bool(i.previews)) for i in items[:-1]]
    assert order == sorted(order)  # still in the order they were sent


def test_a_reader_that_keeps_up_gets_every_preview():
    async def main():
        request = _request()
        handle = RequestHandleImpl(lambda h: True, request, progress=True)
        got = []
        for step in range(1, STEPS + 1):
            await asyncio.to_thread(_produce, handle, request, range(step, step + 1))
            got += [await handle.next(), await handle.next()]
        handle.finish(GenerationResult("r1", None, 1, {}, request), None)
        got.append(await handle.next())
        return got

    items = asyncio.run(main())
    assert [i.step for i in items if isinstance(i, ProgressEvent) and i.previews] == list(range(1, STEPS + 1))
    assert isinstance(items[-1], GenerationResult)


def test_the_previews_a_lagging_reader_missed_are_counted_in_the_servers_metrics():
    """`diffgraph_previews_dropped_total`: what the server's reader of a handle (server/requests.py `results`) was
    never given, added when its reading ends; through the router the count follows the request."""
    from types import SimpleNamespace

    from diffgraph.engine.router import _Tracked
    from diffgraph.server.metrics import ServerMetrics
    from diffgraph.server.requests import results

    class Connected:
        async def is_disconnected(self) -> bool:
            return False

    async def main(metrics):
        request = _request()
        handle = RequestHandleImpl(lambda h: True, request, progress=True)
        await asyncio.to_thread(_produce, handle, request, range(1, STEPS + 1))
        handle.finish(GenerationResult("r1", None, 1, {}, request), None)
        router = SimpleNamespace(_progress=lambda *a: None, _done=lambda *a: None, replicas=[])
        tracked = _Tracked(handle, router, request, progress=True)
        state = SimpleNamespace(metrics=metrics, drain_aborted=False, handles={"r1": tracked})
        return [item async for item in results(state, tracked, float("inf"), Connected())]

    metrics = ServerMetrics(lambda: None, (1,))
    items = asyncio.run(main(metrics))
    assert isinstance(items[-1], GenerationResult)
    dropped = metrics.registry.get_sample_value("diffgraph_previews_dropped_total")
    assert dropped == STEPS - PREVIEWS_KEPT  # 36 superseded previews, none of them sent
