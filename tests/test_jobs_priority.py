"""Interactive requests ahead of a running job (issue 35 point 3), through the real job machinery (store,
coordinator, backend) on the `digits` engine: an interactive request sent while a 200-item job keeps the engine
busy starts at the next step and runs its steps back to back (its own steps plus at most the one in progress when
it arrived; counted in steps, not seconds), at the job's size and at another size; the job then goes on."""

from __future__ import annotations

import asyncio
import json

import pytest

from diffgraph import Engine
from diffgraph.engine.async_engine import AsyncEngine
from diffgraph.jobs.backend import EngineBackend
from diffgraph.jobs.coordinator import Coordinator, CoordinatorSettings
from diffgraph.jobs.spec import SpecLimits, parse_job
from diffgraph.jobs.store import JobStore
from diffgraph.api.config import ServerConfig

ITEMS, STEPS, PERSON_STEPS = 200, 6, 4


@pytest.fixture(scope="module")
def engine():
    with Engine("digits", device="cpu") as e:
        yield e


def _job() -> bytes:
    return "\n".join(json.dumps({"prompt": f"a handwritten digit {i % 10}", "num_inference_steps": STEPS,
                                 "seeds": [i]}) for i in range(ITEMS)).encode()


@pytest.mark.parametrize("size", [None, 80])  # the job's own size (its group), and another size (its own group)
def test_an_interactive_request_runs_at_once_beside_a_200_item_job(engine, tmp_path, size):
    plans: list[list[str]] = []
    listener = lambda plan, _: plans.append([s.request_id for s in plan.live])  # noqa: E731 (the loop thread)

    async def scenario() -> tuple[int, list[int], int]:
        client = AsyncEngine(engine)
        store = JobStore(str(tmp_path))
        backend = EngineBackend(ServerConfig(model="digits", device="cpu"), lambda: client.info, client.submit)
        coordinator = Coordinator(store, backend, None, CoordinatorSettings(poll_s=0.05))
        job = store.create("", parse_job(_job(), "jsonl", SpecLimits()), client.info.name)
        task = asyncio.ensure_future(coordinator.run())
        try:
            while len(plans) < 3 or coordinator.running() < 2:  # the job is stepping with rows in the engine
                await asyncio.sleep(0.01)
            side = engine.info.native_size if size is None else size
            person = engine.make_request("a handwritten digit 7", width=side, height=side, seed=1,
                                         num_inference_steps=PERSON_STEPS)
            handle = await client.submit(person)
            arrived = len(plans)  # steps already run when it was queued (the one in progress may still end)
            await handle.result()
            # its result can arrive before its last step's listeners ran (the image thread answers while the loop
            # thread finishes that step): wait for the loop to pass a step boundary, then count
            await asyncio.wrap_future(engine.core.call_between_steps(lambda: None))
            mine = [i for i, ids in enumerate(plans) if person.request_id in ids]
            done_before = store.job(job.id).done
            return arrived, mine, done_before
        finally:
            coordinator.drop(job.id)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            store.close()

    engine.step_listeners.append(listener)
    try:
        arrived, mine, done = asyncio.run(scenario())
    finally:
        engine.step_listeners.remove(listener)
    assert len(mine) == PERSON_STEPS
    assert mine[0] <= arrived + 1  # it started at the next step (after at most the one in progress)
    assert mine == list(range(mine[0], mine[0] + PERSON_STEPS))  # its steps back to back: nothing ran between
    assert done < ITEMS  # the job was still running beside it
