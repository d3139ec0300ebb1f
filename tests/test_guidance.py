"""Guidance as a row feature (issue 27): per row and per step, one denoiser branch or two.

diffusers is the oracle where it has a counterpart: guidance <= 1 (its pipelines skip the unconditional branch),
`guidance_rescale`, and LCM-distilled UNets (`time_cond_proj_dim`: embedded guidance, one branch). For
`guidance_interval` the reference is a plain loop over diffusers' scheduler and the same UNet, written below. Mixed
rows (guiding, guidance-free, interval, rescale, adapters, edits) submitted together equal each alone, and the
scheduler accounts denoiser rows: one per guidance-free image, two per guiding one, reserved at their peak.
"""

import os
import tempfile

import numpy as np
import pytest
import torch
from PIL import Image

from diffgraph import Engine

PROMPT = "a photo of a red fox in the snow"


def _pipe(engine, sampler="euler", schedule="default"):
    return engine.diffusers_pipeline(sampler, schedule)


def _costs(engine):
    """(image rows, denoiser rows the step cost) of every step from now on (listener removed by _stop), added once
    the loop has passed the steps of earlier requests (a result may come before its last step's listener)."""
    costs = []
    engine.core.call_between_steps(lambda: None).result()
    engine.step_listeners.append(lambda plan, seconds: costs.append((plan.n_rows, plan.cost_rows)))
    return costs


def _stop(engine):
    """Removes the step listener once the loop has passed the last step (a result may come before its listener)."""
    engine.core.call_between_steps(lambda: None).result()
    engine.step_listeners.pop()


@pytest.mark.parametrize("model", ["tiny", "tiny_xl"])
@pytest.mark.parametrize("guidance", [0.0, 1.0])
def test_guidance_up_to_one_runs_one_branch_and_equals_diffusers(request, model, guidance):
    engine = request.getfixturevalue(f"{model}_engine")
    costs = _costs(engine)
    try:
        ours = engine.generate(PROMPT, negative_prompt="blurry", num_inference_steps=4, seed=3, num_images=2,
                               guidance_scale=guidance)
    finally:
        _stop(engine)
    ref = _pipe(engine)(PROMPT, negative_prompt="blurry", num_inference_steps=4, guidance_scale=guidance,
                        num_images_per_prompt=2, generator=torch.Generator().manual_seed(3), output_type="np").images
    assert ours.arrays.std() > 1e-3
    np.testing.assert_allclose(ours.arrays, ref, atol=1e-4, rtol=0)
    assert costs == [(2, 2)] * 4  # two images, one denoiser row each, every step


@pytest.mark.parametrize("model", ["tiny", "tiny_xl"])
def test_guidance_rescale_equals_diffusers(request, model):
    engine = request.getfixturevalue(f"{model}_engine")
    ours = engine.generate(PROMPT, num_inference_steps=4, seed=4, guidance_scale=6.0, guidance_rescale=0.7)
    plain = engine.generate(PROMPT, num_inference_steps=4, seed=4, guidance_scale=6.0)
    ref = _pipe(engine)(PROMPT, num_inference_steps=4, guidance_scale=6.0, guidance_rescale=0.7,
                        generator=torch.Generator().manual_seed(4), output_type="np").images
    np.testing.assert_allclose(ours.arrays, ref, atol=1e-4, rtol=0)
    assert np.abs(ours.arrays - plain.arrays).max() > 1e-3  # the rescale changed the image


@pytest.fixture(scope="module", params=["random:tiny-lcm", "random:tiny-xl-lcm"])
def lcm_engine(request):
    with Engine(model=request.param, device="cpu", dtype="fp32") as engine:
        yield engine


def test_embedded_guidance_equals_diffusers_with_one_branch(lcm_engine):
    """A UNet with `time_cond_proj_dim` takes the guidance as an embedding (diffusers' pipelines then run no CFG)."""
    costs = _costs(lcm_engine)
    try:
        ours = lcm_engine.generate(PROMPT, num_inference_steps=4, seed=5, guidance_scale=8.0)
        other = lcm_engine.generate(PROMPT, num_inference_steps=4, seed=5, guidance_scale=2.0)
    finally:
        _stop(lcm_engine)
    ref = _pipe(lcm_engine)(PROMPT, num_inference_steps=4, guidance_scale=8.0,
                            generator=torch.Generator().manual_seed(5), output_type="np").images
    np.testing.assert_allclose(ours.arrays, ref, atol=1e-4, rtol=0)
    assert np.abs(ours.arrays - other.arrays).max() > 1e-3  # the guidance reaches the image
    assert costs == [(1, 1)] * 8  # one denoiser row per image at every step


def test_ddim_cfgpp_is_refused_on_an_embedded_guidance_model(lcm_engine):
    """CFG++ steps along the unconditional branch: a model without a second branch refuses it by name (it would
    walk plain DDIM)."""
    with pytest.raises(ValueError, match=r"^sampler 'ddim_cfgpp' steps along classifier-free guidance's "
                                         r"unconditional branch, which model .* does not run \(embedded guidance\); "
                                         r"use 'ddim'$") as e:
        lcm_engine.make_request(PROMPT, sampler="DDIM CFG++", num_inference_steps=4)
    assert e.value.param == "sampler"


def _interval_reference(engine, lo, hi, steps, guidance, seed):
    """SD, Euler: the guided output only at steps i with lo <= i / steps < hi, the text branch elsewhere."""
    pipe = _pipe(engine)
    sched = pipe.scheduler
    sched.set_timesteps(steps)
    with torch.no_grad():
        cond, uncond = pipe.encode_prompt(PROMPT, "cpu", 1, True, None)
        gen = torch.Generator().manual_seed(seed)
        latents = torch.randn((1, 4, 8, 8), generator=gen) * sched.init_noise_sigma
        for i, t in enumerate(sched.timesteps):
            x = sched.scale_model_input(latents, t)
            text = engine.model.denoiser(x, t, encoder_hidden_states=cond).sample
            out = text
            if lo * steps <= i < hi * steps:
                neg = engine.model.denoiser(x, t, encoder_hidden_states=uncond).sample
                out = neg + guidance * (text - neg)
            latents = sched.step(out, t, latents, generator=gen).prev_sample
        image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample
    return (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def test_guidance_interval_equals_a_reference_loop_and_costs_rows_per_step(tiny_engine):
    costs = _costs(tiny_engine)
    try:
        ours = tiny_engine.generate(PROMPT, num_inference_steps=5, seed=6, guidance_scale=7.5,
                                    guidance_interval=[0.2, 0.8], sampler="euler")
    finally:
        _stop(tiny_engine)
    ref = _interval_reference(tiny_engine, 0.2, 0.8, 5, 7.5, 6)
    np.testing.assert_allclose(ours.arrays, ref, atol=1e-4, rtol=0)
    # steps 0..4 of 5: i / 5 in [0.2, 0.8) guides steps 1, 2, 3
    assert [c for _, c in costs] == [1, 2, 2, 2, 1]
    full = tiny_engine.generate(PROMPT, num_inference_steps=5, seed=6, guidance_scale=7.5, sampler="euler")
    assert np.abs(full.arrays - ours.arrays).max() > 1e-3


@pytest.mark.parametrize("value", [[0.5], [0.8, 0.2], [-0.1, 0.5], [0.1, 1.5], "0.2,0.8", [float("nan"), 1]])
def test_bad_intervals_and_rescales_name_their_field(tiny_engine, value):
    with pytest.raises(ValueError, match="guidance_interval") as e:
        tiny_engine.make_request(PROMPT, guidance_interval=value)
    assert e.value.param == "guidance_interval"
    for bad in (-0.1, 1.5, float("nan"), "0.7"):
        with pytest.raises(ValueError, match="guidance_rescale"):
            tiny_engine.make_request(PROMPT, guidance_rescale=bad)


@pytest.fixture(scope="module")
def lora_engine(tiny_engine):
    from lora_util import _write_diffusers

    with Engine(model="random:tiny", device="cpu", dtype="fp32", max_loras=4, max_lora_rank=4) as engine:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "a.safetensors")
            _write_diffusers(tiny_engine, path, rank=4, seed=0)  # written from a plain engine's modules
            engine.add_lora("ink", path)
        yield engine


def test_mixed_rows_together_equal_each_alone(lora_engine):
    e = lora_engine
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 64))
    kinds = [dict(guidance_scale=7.5), dict(guidance_scale=1.0), dict(guidance_scale=0.0, num_images=2),
             dict(guidance_scale=6.0, guidance_interval=[0.25, 0.75]), dict(guidance_scale=5.0, guidance_rescale=0.5),
             dict(guidance_scale=7.5, loras=[("ink", 0.8)]), dict(guidance_scale=1.0, loras=[("ink", 1.0)]),
             dict(guidance_scale=7.5, image=image, strength=0.6), dict(guidance_scale=4.0, image=image, mask_image=mask),
             dict(guidance_scale=0.5, image=image, strength=0.9, sampler="euler_a")]
    requests = [e.make_request(PROMPT, num_inference_steps=4, seed=40 + i, **k) for i, k in enumerate(kinds)]
    alone = [e.run(r).arrays for r in requests]
    costs = _costs(e)
    try:
        together = [f.result().arrays for f in [e.submit(r) for r in requests]]
    finally:
        _stop(e)
    for i, (a, t) in enumerate(zip(alone, together)):
        np.testing.assert_allclose(t, a, atol=1e-5, rtol=0, err_msg=f"request {i}: {kinds[i]}")
    assert max(n for n, _ in costs) > 1 and any(c < 2 * n for n, c in costs)  # batched, mixed branches
    assert len({a.tobytes() for a in alone}) == len(alone)  # every request is its own image


def test_admission_reserves_peak_denoiser_rows():
    """A row that starts guiding mid-schedule is admitted with its peak: the group never needs more denoiser
    rows than the largest bucket, while guidance-free rows fill what guiding rows leave."""
    with Engine(model="random:tiny", device="cpu", dtype="fp32", max_rows=4) as e:
        costs = _costs(e)
        reqs = [e.make_request(PROMPT, num_inference_steps=4, seed=i, guidance_scale=7.5,
                               guidance_interval=[0.5, 1.0]) for i in range(2)]
        reqs += [e.make_request(PROMPT, num_inference_steps=4, seed=9, guidance_scale=1.0, num_images=2)]
        results = [f.result() for f in [e.submit(r) for r in reqs]]
        _stop(e)
        assert all(len(r) == r.request.num_images for r in results)
    assert costs and max(c for _, c in costs) <= 4
    assert (2, 4) in costs  # both interval rows guiding: the guidance-free pair waited for room, as reserved


def test_rows_that_stop_guiding_make_room_for_rows_that_start():
    """Admission checks each request's per-step denoiser rows against the group's at every future step: a row that
    guides in the first half, one that guides in the second half and a guidance-free one fit in 4 denoiser rows at
    every step (their peaks, 2 + 2 + 1, would not)."""
    with Engine(model="random:tiny", device="cpu", dtype="fp32", max_rows=4) as e:
        costs = _costs(e)
        kinds = [dict(guidance_scale=7.5, guidance_interval=[0.0, 0.5]),
                 dict(guidance_scale=7.5, guidance_interval=[0.5, 1.0]), dict(guidance_scale=1.0)]
        reqs = [e.make_request(PROMPT, num_inference_steps=4, seed=20 + i, **k) for i, k in enumerate(kinds)]
        alone = [e.run(r).arrays for r in reqs]
        _stop(e)
        costs = _costs(e)
        e.core.call_between_steps(lambda: None).result()
        futures = []
        # queued between two steps, so the three are admitted at one step boundary
        e.core.call_between_steps(lambda: futures.extend(e.submit(r) for r in reqs)).result()
        together = [f.result().arrays for f in futures]
        _stop(e)
    assert costs == [(3, 4)] * 4  # all three in every step, 4 denoiser rows each step
    for a, t in zip(alone, together):
        np.testing.assert_allclose(t, a, atol=1e-5, rtol=0)


# -- what a model without classifier-free guidance refuses, and what a one-branch request never encodes -----------


@pytest.mark.parametrize("params, name", [({"negative_prompt": "blurry"}, "negative_prompt"),
                                          ({"guidance_interval": [0.2, 0.8]}, "guidance_interval"),
                                          ({"guidance_rescale": 0.5}, "guidance_rescale")])
def test_cfg_parameters_on_an_embedded_guidance_model_are_refused_by_name(lcm_engine, params, name):
    from diffgraph.request import GenerationRequest, ParamError

    assert lcm_engine.info.guidance == "embedded"
    assert lcm_engine.info.capabilities[0] == "embedded_guidance"
    with pytest.raises(ParamError) as e:
        lcm_engine.generate(PROMPT, num_inference_steps=2, seed=1, **params)
    assert e.value.param == name and "classifier-free guidance" in str(e.value)
    # a request built without the model's info is refused at submit all the same
    bare = GenerationRequest.create(PROMPT, width=64, height=64, guidance_scale=1.0, num_inference_steps=2, **params)
    with pytest.raises(ParamError) as e:
        lcm_engine.submit(bare)
    assert e.value.param == name


def test_neutral_cfg_parameters_are_accepted_on_an_embedded_guidance_model(lcm_engine):
    plain = lcm_engine.generate(PROMPT, num_inference_steps=2, seed=7)
    neutral = lcm_engine.generate(PROMPT, num_inference_steps=2, seed=7, negative_prompt="  ", guidance_rescale=0.0,
                                  guidance_interval=None)
    np.testing.assert_array_equal(plain.arrays, neutral.arrays)


def _encoded_rows(engine):
    """The prompts the text encoder is run on from now on (one entry per batch row); `hook.remove()` ends it."""
    rows = []

    def count(module, args, kwargs):
        rows.append((args[0] if args else kwargs["input_ids"]).shape[0])
    return rows, engine.model.text_encoders[0].register_forward_pre_hook(count, with_kwargs=True)


def test_a_request_without_a_second_branch_never_encodes_its_negative_prompt(tiny_engine):
    rows, hook = _encoded_rows(tiny_engine)
    try:
        one = tiny_engine.generate("a lone lighthouse on a cliff", negative_prompt="a negative never read before",
                                   guidance_scale=1.0, num_inference_steps=2, seed=2)
        encoded_one = sum(rows)
        two = tiny_engine.generate("a lone lighthouse on a cliff", negative_prompt="another negative, guided",
                                   guidance_scale=5.0, num_inference_steps=2, seed=2)
    finally:
        hook.remove()
    assert encoded_one == 1          # the prompt alone
    assert sum(rows) == 2            # then the guided request's negative prompt (the prompt was cached)
    plain = tiny_engine.generate("a lone lighthouse on a cliff", guidance_scale=1.0, num_inference_steps=2, seed=2)
    np.testing.assert_array_equal(one.arrays, plain.arrays)  # the negative prompt of a one-branch row changes nothing
    assert np.abs(two.arrays - plain.arrays).max() > 1e-3


def test_the_images_route_refuses_and_the_a1111_route_ignores_cfg_parameters_on_an_embedded_guidance_model():
    from server_util import served
    from diffgraph.server import ServerConfig

    engine = Engine("random:tiny-lcm", device="cpu", dtype="fp32")
    with engine, served(engine, ServerConfig(model="random:tiny-lcm", device="cpu")) as c:
        assert "embedded_guidance" in c.get("/v1/models").json()["data"][0]["capabilities"]
        body = {"prompt": PROMPT, "size": "64x64", "num_inference_steps": 2, "seed": 3}
        for extra, name in (({"negative_prompt": "blurry"}, "negative_prompt"),
                            ({"guidance_interval": [0.1, 0.9]}, "guidance_interval"),
                            ({"guidance_rescale": 0.3}, "guidance_rescale")):
            r = c.post("/v1/images/generations", json={**body, **extra})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == name and "classifier-free guidance" in r.json()["error"]["message"]
        assert c.post("/v1/images/generations", json={**body, "negative_prompt": ""}).status_code == 200
        rows, hook = _encoded_rows(engine)
        try:
            r = c.post("/sdapi/v1/txt2img", json={"prompt": PROMPT, "negative_prompt": "a negative nobody reads",
                                                  "width": 64, "height": 64, "steps": 2, "seed": 3, "cfg_scale": 1})
        finally:
            hook.remove()
        assert r.status_code == 200, r.text
        assert any("negative_prompt was ignored" in w for w in r.json()["warnings"])
        assert sum(rows) <= 1  # the prompt at most (it may be cached), never the negative prompt


# ---- DDIM CFG++: both branches reach the sampler -------------------------------------------------------------------

def _cfgpp_reference(engine, steps, scale, seed, eta=0.0, negative=None):
    """AUTOMATIC1111's ddim_cfgpp update written out over the engine's UNet, on DDIMScheduler's timesteps and
    alpha-bars (each step to t - 1000 // steps, the last to final_alpha_cumprod): the guided noise at scale / 12.5
    gives x0, the unconditional branch's noise the direction to x_t; eta's noise from the request's generator after
    the initial latents, as DDIMScheduler draws it."""
    pipe = _pipe(engine, "ddim")
    sched = pipe.scheduler
    sched.set_timesteps(steps)
    ac = sched.alphas_cumprod
    with torch.no_grad():
        cond, uncond = pipe.encode_prompt(PROMPT, "cpu", 1, True, negative)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn((1, 4, 8, 8), generator=gen) * sched.init_noise_sigma
        for t in sched.timesteps:
            text = engine.model.denoiser(x, t, encoder_hidden_states=cond).sample
            neg = engine.model.denoiser(x, t, encoder_hidden_states=uncond).sample
            e_t = neg + scale / 12.5 * (text - neg)
            prev = int(t) - sched.config.num_train_timesteps // steps
            a_t, a_prev = ac[t], ac[prev] if prev >= 0 else sched.final_alpha_cumprod
            sigma_t = eta * ((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)) ** 0.5
            pred_x0 = (x - (1 - a_t) ** 0.5 * e_t) / a_t ** 0.5
            x = a_prev ** 0.5 * pred_x0 + (1 - a_prev - sigma_t ** 2) ** 0.5 * neg
            if eta:
                x = x + sigma_t * torch.randn(x.shape, generator=gen)
        image = pipe.vae.decode(x / pipe.vae.config.scaling_factor).sample
    return (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def test_ddim_cfgpp_equals_a_reference_loop_with_both_branches_at_any_scale(tiny_engine):
    """DDIM CFG++ (AUTOMATIC1111's label) equals the loop above, at scale 7.5 with a negative
    prompt and at scale 1 with eta 0.5: both run two denoiser rows a step (the scale never turns the second branch
    off: 1 is a guided weight of 0.08); plain DDIM at the same scale is another image."""
    costs = _costs(tiny_engine)
    try:
        guided = tiny_engine.generate(PROMPT, negative_prompt="blurry", num_inference_steps=4, seed=8,
                                      guidance_scale=7.5, sampler="DDIM CFG++")
        low = tiny_engine.generate(PROMPT, num_inference_steps=4, seed=9, guidance_scale=1.0, sampler="ddim_cfgpp",
                                   eta=0.5)
    finally:
        _stop(tiny_engine)
    assert costs == [(1, 2)] * 8
    assert guided.request.sampler == "ddim_cfgpp" and guided.arrays.std() > 1e-3
    # (1e-4, as the diffusers comparisons above: a fortieth of a level; the tiny UNet's branches are close, and
    # scale 7 instead of 7.5 moves this image by half a level)
    np.testing.assert_allclose(guided.arrays, _cfgpp_reference(tiny_engine, 4, 7.5, 8, negative="blurry"), atol=1e-4,
                               rtol=0)
    np.testing.assert_allclose(low.arrays, _cfgpp_reference(tiny_engine, 4, 1.0, 9, eta=0.5), atol=1e-4, rtol=0)
    plain = tiny_engine.generate(PROMPT, negative_prompt="blurry", num_inference_steps=4, seed=8, guidance_scale=7.5,
                                 sampler="ddim")
    assert np.abs(plain.arrays - guided.arrays).max() > 1e-3


def test_ddim_cfgpp_outside_its_interval_is_plain_ddim(tiny_engine):
    """A row that runs one branch (no step inside its guidance_interval) walks DDIM on its text branch."""
    costs = _costs(tiny_engine)
    try:
        ours = tiny_engine.generate(PROMPT, num_inference_steps=4, seed=10, guidance_scale=7.5, sampler="ddim_cfgpp",
                                    guidance_interval=[0.9, 1.0])
    finally:
        _stop(tiny_engine)
    assert [c for _, c in costs] == [1] * 4
    ddim = tiny_engine.generate(PROMPT, num_inference_steps=4, seed=10, guidance_scale=1.0, sampler="ddim")
    np.testing.assert_allclose(ours.arrays, ddim.arrays, atol=1e-5, rtol=0)


def test_ddim_cfgpp_rows_with_ddim_and_euler_rows_together_equal_each_alone(tiny_engine):
    from loop_util import together

    kinds = [dict(sampler="ddim_cfgpp", guidance_scale=7.5, negative_prompt="blurry"),
             dict(sampler="ddim", guidance_scale=7.5), dict(sampler="euler", guidance_scale=1.0, num_images=2),
             dict(sampler="ddim_cfgpp", guidance_scale=0.0, eta=0.5, guidance_interval=[0.25, 0.75], num_images=2),
             dict(sampler="ddim_cfgpp", guidance_scale=1.0, num_inference_steps=5), dict(sampler="ddim", eta=0.3)]
    requests = [tiny_engine.make_request(PROMPT, seed=60 + i, **{"num_inference_steps": 4, **k})
                for i, k in enumerate(kinds)]
    alone = [tiny_engine.run(r).arrays for r in requests]
    steps_before = tiny_engine.stats["steps"]
    results = together(tiny_engine, requests)
    assert tiny_engine.stats["steps"] - steps_before < sum(r.num_inference_steps for r in requests)  # shared steps
    for i, (a, r) in enumerate(zip(alone, results)):
        np.testing.assert_allclose(r.arrays, a, atol=1e-5, rtol=0, err_msg=f"request {i}: {kinds[i]}")
    assert len({a.tobytes() for a in alone}) == len(alone)
