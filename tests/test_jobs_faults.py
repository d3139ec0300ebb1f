"""Faults of batch jobs found in review, each with the test that showed it: a job cancelled while one of its
candidates is being submitted (the engine has the request, its answer has not come back); `diffgraph batch`'s
planning decoding an item's images once per candidate."""

from __future__ import annotations

import asyncio

from test_jobs_store import CONFIG, FAST, INFO, FakeEngine, FakeHandle, spec, until

from diffgraph.jobs.backend import EngineBackend
from diffgraph.jobs.coordinator import Coordinator
from diffgraph.jobs.store import JobStore


class SlowAcceptEngine(FakeEngine):
    """An engine that has a request as soon as it is submitted (a replica process once it is sent down the pipe,
    an in-process engine once its thread queues it) and answers "accepted" only when `accept` is set: cancelling
    the caller's wait does not take the request back."""

    def __init__(self):
        super().__init__()
        self.accept = asyncio.Event()
        self.queued: list[FakeHandle] = []

    async def submit(self, request) -> FakeHandle:
        self.submitted.append(request)
        handle = FakeHandle(self, request)
        self.queued.append(handle)  # in the engine from now on, whatever happens to the caller
        await asyncio.shield(self.accept.wait())
        return handle


def test_a_job_cancelled_while_its_candidate_is_being_submitted_aborts_that_request(tmp_path):
    """The cancel cancelled the candidate's task inside `submit`; the engine accepted the request a moment later and
    made its image for nobody (no handle left to abort: a batch row held for the whole run)."""
    store = JobStore(str(tmp_path))
    a = store.create("", spec(1, seeds=(1,)), "digits").id
    engine = SlowAcceptEngine()
    released = []

    async def main():
        engine.gate.clear()  # an accepted request waits in the engine: only an abort ends it before the gate opens
        backend = EngineBackend(CONFIG, info=lambda: INFO, submit=engine.submit, release=released.append)
        coordinator = Coordinator(store, backend, None, FAST)
        task = asyncio.create_task(coordinator.run())
        await until(lambda: len(engine.queued) == 1, "the candidate is being submitted")
        store.cancel(a)
        coordinator.drop(a)
        engine.accept.set()  # the engine answers after the cancel
        await until(lambda: len(engine.aborted) == 1, "the request accepted after the cancel is aborted")
        assert coordinator.running() == 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert [r.job for r in engine.aborted] == [a]
    assert released == engine.queued  # forgotten by the server's table of requests in flight too
    assert engine.made == []
    assert (store.job(a).status, store.job(a).done, store.job(a).failed) == ("cancelled", 0, 0)


def test_batch_planning_decodes_an_items_images_once_and_shares_them_across_its_candidates(tmp_path, monkeypatch):
    """`diffgraph batch` builds every candidate's request up front: an item's base64 images (controls, image prompts)
    were decoded once per seed (up to 64 copies), every copy held until the run ended."""
    import base64
    import io

    from PIL import Image

    from diffgraph.jobs.batch_work import plan
    from diffgraph.jobs.spec import JobItem, JobSpec
    from diffgraph.api import protocol as uploads  # the uploads are decoded there

    def b64(colour) -> str:
        buf = io.BytesIO()
        Image.new("RGB", (32, 32), colour).save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()

    decoded, real = [], uploads.decode_upload
    monkeypatch.setattr(uploads, "decode_upload", lambda *a: decoded.append(a[0]) or real(*a))
    body = {"prompt": "a digit", "num_inference_steps": 2, "image_prompts": {"model": "face", "images": [b64("red")]},
            "controls": [{"model": "outline", "image": b64("blue")}]}
    seeds = (1, 2, 3, 4)
    spec = JobSpec((JobItem(body, seeds), JobItem({"prompt": "plain", "num_inference_steps": 2}, (5, 6))))
    work = plan(spec, CONFIG, INFO, str(tmp_path), lambda body: ())
    assert len(decoded) == 2  # the item's two images, once each
    assert [w.request.seed for w in work] == [*seeds, 5, 6]
    first = work[0].request
    assert first.image_prompts.images[0][0, 0].tolist() == [255, 0, 0]
    assert first.controls[0].image[0, 0].tolist() == [0, 0, 255]
    for w in work[1:4]:  # the same arrays, not copies
        assert w.request.image_prompts.images[0] is first.image_prompts.images[0]
        assert w.request.controls[0].image is first.controls[0].image
    assert all(w.request.controls == () and w.request.image_prompts is None for w in work[4:])
