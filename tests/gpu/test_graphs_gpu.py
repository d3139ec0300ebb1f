"""GPU tests (marker `gpu`, skipped without CUDA): graph replays against eager, isolation of rows,
padding, capture failure, GraphedUNet in a stock pipeline, memory over 1000 replays."""

import os
import threading

import numpy as np
import pytest
import torch

from diffgraph import Engine, GraphConfig, GraphedUNet

pytestmark = pytest.mark.gpu
# the device every engine and tensor of this module uses: DIFFGRAPH_TEST_DEVICE=cuda:1 runs it all on the second
# GPU (tests/gpu/test_device_affinity.py checks that nothing then touches the first)
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")

REPORT = {}  # measured figures, printed once the module's tests have run (tests/conftest.py: module_report)


@pytest.fixture(scope="module")
def sd15():
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8, 16), resolutions=((512, 512), (768, 512)), prewarm=False)
    engine = Engine(model="random:sd15", device=DEVICE, dtype="fp16", mode="graph", graphs=cfg)
    yield engine
    engine.close()


def test_replay_equals_eager_every_bucket_two_resolutions(sd15):
    runner = sd15.runner.graph_runner
    for (h, w) in ((512, 512), (768, 512)):
        sd15.runner.buffers((h, w))
        for b in (16, 8, 4, 2, 1):
            key = ("step", h, w, b)
            runner.config = GraphConfig(**{**runner.config.__dict__, "verify": True})
            assert runner.capture(key), runner.stats[key].error
    diffs = {k: s.verify_max_abs for k, s in runner.stats.items() if k[0] == "step"}
    REPORT["step replay vs eager max abs (latent, fp16)"] = max(diffs.values())
    print("replay vs eager:", diffs)
    assert all(d is not None and np.isfinite(d) and d <= 1e-2 for d in diffs.values()), diffs


def test_text_and_vae_graphs_match_eager(sd15):
    w = sd15.runner
    prompts = ["a red fox", "a blue car", ""]
    graphed = w.encode_texts(prompts)
    eager = w.adapter.encode(w.model, prompts)
    text_diff = float((graphed["embeds"].float() - eager["embeds"].float()).abs().max())
    lat = torch.randn((3, 4, 64, 64), device=DEVICE)
    img_graph = w.decode((512, 512), lat)
    img_eager = w.decode_pixels(lat.to(w.model.vae_dtype)).permute(0, 2, 3, 1).float().cpu().numpy()
    vae_diff = float(np.abs(img_graph - img_eager).max())
    REPORT["text graph max abs"] = text_diff
    REPORT["vae graph max abs"] = vae_diff
    assert text_diff <= 1e-2 and vae_diff <= 1e-2
    kinds = {r["kind"] for r in sd15.graph_table() if r["replays"] > 0}
    assert {"text", "vae"} <= kinds


def _mix(engine, n=20):
    reqs = []
    for i in range(n):
        reqs.append(engine.make_request(
            ["a red fox", "a blue car", "a castle", "fruit"][i % 4], negative_prompt=[None, "blurry"][i % 2],
            width=512, height=[512, 768][(i // 2) % 2], num_inference_steps=[4, 6, 8, 5][i % 4],
            sampler=["euler", "euler_a", "dpmpp_2m", "ddim"][i % 4], schedule=["default", "karras"][(i // 4) % 2],
            guidance_scale=[1.0, 4.0, 7.5][i % 3], seed=100 + i, num_images=[1, 2, 1, 3][(i // 3) % 4]))
    return reqs


def test_mixed_rows_equal_alone_under_graphs(sd15):
    """Rows at different steps, samplers, guidance, seeds and sizes share replays; each equals its solo run."""
    reqs = _mix(sd15)
    alone = [sd15.run(r).arrays for r in reqs]
    replays_before = sum(r["replays"] for r in sd15.graph_table() if r["kind"] == "step")
    # staggered arrivals: half now, the rest once the first ones are mid-way
    started = threading.Event()
    futures = [sd15.submit(r, on_progress=lambda *a: started.set()) for r in reqs[:10]]
    started.wait(60)
    futures += [sd15.submit(r) for r in reqs[10:]]
    results = [f.result(timeout=300) for f in futures]
    worst = max(float(np.abs(res.arrays - ref).max()) for res, ref in zip(results, alone))
    REPORT["mixed batch vs alone, max abs (pixels, fp16)"] = worst
    replays = sum(r["replays"] for r in sd15.graph_table() if r["kind"] == "step") - replays_before
    assert replays > 0
    assert worst <= 2e-2, worst


def test_a_preempted_batch_row_resumes_exactly_under_graphs(sd15):
    """Issue 35 point 3 under CUDA graphs: a full bucket of batch rows, an interactive request arrives, a batch
    request gives its rows at the next step boundary (saved from the static buffers, restored into other rows
    later) and its images equal the uninterrupted ones; the interactive one starts at the next step."""
    import dataclasses
    reqs = [dataclasses.replace(sd15.make_request("a red fox", width=512, height=512, num_inference_steps=8,
                                                  sampler=["dpmpp_2m", "euler_a"][i % 2], guidance_scale=7.5,
                                                  seed=300 + i, num_images=2), priority="batch", job="j")
            for i in range(4)]  # 4 x 2 guided images: 16 denoiser rows, the full bucket
    alone = [sd15.run(r).arrays for r in reqs]
    person = sd15.make_request("a castle", width=512, height=512, num_inference_steps=4, guidance_scale=7.5, seed=9)
    person_alone = sd15.run(person).arrays
    plans, late = [], []
    mine = {r.request_id for r in reqs}

    def listener(plan, _):
        if mine.intersection(s.request_id for s in plan.live):
            plans.append(([s.request_id for s in plan.live], [s.request_id for s, _ in plan.preempted]))
            if len(plans) == 2:
                late.append(sd15.submit(person))
    entered, hold = threading.Event(), threading.Event()

    def blocker():
        entered.set()
        hold.wait()
    sd15.step_listeners.append(listener)
    try:
        held = sd15.core.call_between_steps(blocker)
        entered.wait(60)
        futures = [sd15.submit(r) for r in reqs]
        hold.set()
        held.result(timeout=60)
        results = [f.result(timeout=300) for f in futures]
        person_result = late[0].result(timeout=300)
    finally:
        hold.set()
        sd15.step_listeners.remove(listener)
    assert len(plans[0][0]) == 4 and person.request_id in plans[2][0] and plans[2][1]
    worst = max(float(np.abs(res.arrays - ref).max()) for res, ref in zip(results + [person_result],
                                                                         alone + [person_alone]))
    REPORT["preempted batch rows vs uninterrupted, max abs (pixels, fp16)"] = worst
    assert worst <= 2e-2, worst


def test_padding_rows_never_change_live_rows(sd15):
    w = sd15.runner
    key = (512, 512)
    buf = w.buffers(key)
    request = sd15.make_request("a cat", num_inference_steps=10, sampler="euler", guidance_scale=7.5)
    coefs = w.request_plan(request).coefs  # the sampler's columns and the guidance feature's (CFG 7.5)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    start = torch.randn(buf.x[:3].shape, generator=gen, device=DEVICE) * 10
    outs = []
    for garbage in (0.0, 1e4):
        buf.x[:3] = start
        buf.d_prev[:3] = 0
        buf.x[3] = garbage
        buf.cond("embeds")[3] = garbage / 1e3
        # 3 guiding rows: 6 denoiser rows, bucket 8 (image rows 3-7 pad), replayed
        assert w.step(key, np.repeat(coefs[2][None], 3, 0), [(0, 1, 2), (1, 1, 2), (2, 1, 2)], None) == 8
        torch.cuda.synchronize(DEVICE)
        outs.append(buf.x[:4].clone())
        assert torch.isfinite(buf.x[3]).all()
    assert torch.equal(outs[0][:3], outs[1][:3])


def test_capture_failure_falls_back_and_keeps_serving():
    class SyncingUNet(torch.nn.Module):
        """Calls synchronize while being captured at batch 4 (bucket 4: two guided images): not allowed under
        capture."""

        def __init__(self, unet):
            super().__init__()
            self.unet = unet

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self._modules["unet"], name)

        def forward(self, sample, *args, **kwargs):
            if sample.shape[0] == 4 and torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize(DEVICE)
            return self.unet(sample, *args, **kwargs)

    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), prewarm=False)
    with Engine(model="random:tiny", device=DEVICE, mode="graph", graphs=cfg) as graphed, \
            Engine(model="random:tiny", device=DEVICE, mode="eager") as eager:
        graphed.model.denoiser = SyncingUNet(graphed.model.denoiser)
        for n in (2, 1, 2):
            a = graphed.generate("x", num_images=n, num_inference_steps=4, seed=3).arrays
            b = eager.generate("x", num_images=n, num_inference_steps=4, seed=3).arrays
            assert np.abs(a - b).max() <= 2e-2
        rows = {(r["kind"], r["bucket"]): r for r in graphed.graph_table()}
        assert rows[("step", 4)]["status"] == "failed" and rows[("step", 4)]["eager_fallbacks"] >= 8
        assert rows[("step", 2)]["status"] == "captured" and rows[("step", 2)]["replays"] >= 4


def test_graphed_unet_in_stock_pipeline_equals_plain(sd15):
    pipe = sd15.diffusers_pipeline("euler", "default")
    kwargs = dict(num_inference_steps=4, guidance_scale=7.5, output_type="np", width=512, height=512)
    ref = pipe("a cat", num_images_per_prompt=3, generator=torch.Generator().manual_seed(3), **kwargs).images
    plain = pipe.unet
    try:
        pipe.unet = GraphedUNet(plain, batch_buckets=(2, 4, 8), resolutions=[(512, 512)])
        out = pipe("a cat", num_images_per_prompt=3, generator=torch.Generator().manual_seed(3), **kwargs).images
        out2 = pipe("a cat", num_images_per_prompt=3, generator=torch.Generator().manual_seed(3), **kwargs).images
        table = pipe.unet.graph_table()
    finally:
        pipe.unet = plain
    diff = float(np.abs(out - ref).max())
    REPORT["GraphedUNet pipeline vs plain max abs (pixels)"] = diff
    assert diff <= 2e-2
    np.testing.assert_array_equal(out, out2)
    assert next(r for r in table if r["bucket"] == 8)["replays"] == 8


def test_memory_flat_over_1000_replays(sd15):
    w = sd15.runner
    key = (512, 512)
    request = sd15.make_request("a cat", num_inference_steps=10, sampler="euler_a")
    coefs = np.repeat(w.request_plan(request).coefs[5][None], 2, 0)
    noise = [(0, 2, torch.Generator().manual_seed(0))]
    rows = [(0, 2, 2)]
    w.buffers(key).x[:2] = 0
    for _ in range(10):
        w.step(key, coefs, rows, noise)
    torch.cuda.synchronize(DEVICE)
    before = torch.cuda.memory_allocated(DEVICE)
    for _ in range(1000):
        w.step(key, coefs, rows, noise)
    torch.cuda.synchronize(DEVICE)
    after = torch.cuda.memory_allocated(DEVICE)
    REPORT["allocated bytes growth over 1000 replays"] = after - before
    assert after == before


def test_replaced_weights_take_effect_after_invalidate():
    """A graph holds the weight tensors it was captured with: a module whose parameter is replaced by a new tensor
    keeps replaying the old one until `invalidate` drops the graphs; in-place copies need nothing."""
    cfg = GraphConfig(batch_buckets=(1, 2), resolutions=((64, 64),))
    with Engine(model="random:tiny", device=DEVICE, mode="graph", graphs=cfg) as graphed, \
            Engine(model="random:tiny", device=DEVICE, mode="eager") as eager:
        def both():
            kw = dict(num_inference_steps=4, seed=5)
            return graphed.generate("a cat", **kw).arrays, eager.generate("a cat", **kw).arrays
        a, b = both()
        assert np.abs(a - b).max() <= 2e-2
        with torch.no_grad():  # in place, in both engines: the same pointers, the graphs see it at once
            for e in (graphed, eager):
                e.model.denoiser.conv_out.weight.mul_(-1.0)
        a2, b2 = both()
        assert np.abs(a2 - b2).max() <= 2e-2 and np.abs(a2 - a).max() > 0.05
        new = graphed.model.denoiser.conv_out.weight.detach() * 0.5
        # a new tensor: the captured graph still reads the old one (kept alive here: once freed, its memory may be
        # reused, and a stale graph then reads garbage, which is why a replaced module needs `invalidate`)
        old = [e.model.denoiser.conv_out.weight for e in (graphed, eager)]
        for e in (graphed, eager):
            e.model.denoiser.conv_out.weight = torch.nn.Parameter(new.clone().to(e.model.device), requires_grad=False)
        stale, b3 = both()
        assert np.abs(stale - a2).max() <= 2e-2 and np.abs(b3 - b2).max() > 0.05
        graphed.invalidate("step")
        del old
        a3, _ = both()
        assert np.abs(a3 - b3).max() <= 2e-2
        rows = [r for r in graphed.graph_table() if r["kind"] == "step"]
        assert all(r["invalidations"] == 1 for r in rows) and sum(r["on_demand"] for r in rows) == 1
        REPORT["replaced weights after invalidate, graph vs eager max abs"] = float(np.abs(a3 - b3).max())
