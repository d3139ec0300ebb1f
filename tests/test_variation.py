"""AUTOMATIC1111's variation seeds (engine/variation.py): the initial noise slerped towards a subseed's, and drawn at
another size's shape and pasted centred; only the initial noise changes, row by row."""

import math

import numpy as np
import pytest
import torch

from diffgraph.request import GenerationRequest, ParamError, Variation

SIZE = (64, 64)


def _request(engine, **kw):
    return GenerationRequest.create("a lighthouse", model=engine.info,
                                    **{"num_inference_steps": 2, "seed": 5, "width": 64, "height": 64, **kw})


def _initial(engine, request):
    """The request's initial latents as the engine writes them (its generator: CPU, seeded with its seed)."""
    generator = torch.Generator("cpu").manual_seed(request.seed)
    return engine.runner.initial_latents(request.num_images, request.key, generator, 1.0, None, request)


def _randn(seed, shape):  # the engine's convention: a CPU generator seeded with the seed, in the model's dtype
    return torch.randn((1, *shape), generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)[0]


def _a1111_slerp(val, low, high):
    """AUTOMATIC1111's processing.slerp on one image's noise [C, H, W], written out."""
    low_norm = low / torch.norm(low, dim=1, keepdim=True)
    high_norm = high / torch.norm(high, dim=1, keepdim=True)
    dot = (low_norm * high_norm).sum(1)
    assert dot.mean() <= 0.9995  # two seeds' noises are far from parallel: the slerp branch
    omega = torch.acos(dot)
    so = torch.sin(omega)
    return (torch.sin((1.0 - val) * omega) / so).unsqueeze(1) * low + (torch.sin(val * omega) / so).unsqueeze(1) * high


def test_strength_0_3_is_automatic1111s_slerp_of_the_two_seeds_noises(tiny_engine):
    shape = tiny_engine.runner.image_latent_shape(SIZE)
    got = _initial(tiny_engine, _request(tiny_engine, variation={"subseed": 11, "strength": 0.3}))
    want = _a1111_slerp(0.3, _randn(5, shape), _randn(11, shape))
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-6)
    # moved away from the seed's own noise
    assert not torch.allclose(got[0], _randn(5, shape), atol=0.05)


def test_strength_0_is_no_variation_and_strength_1_is_the_subseeds_noise(tiny_engine):
    plain = _initial(tiny_engine, _request(tiny_engine))
    zero = _initial(tiny_engine, _request(tiny_engine, variation={"subseed": 11, "strength": 0.0}))
    assert torch.equal(zero, plain)
    one = _initial(tiny_engine, _request(tiny_engine, variation={"subseed": 11, "strength": 1.0}))
    torch.testing.assert_close(one, _initial(tiny_engine, _request(tiny_engine, seed=11)), rtol=0, atol=1e-6)


def test_seed_resize_from_pastes_the_drawn_noise_centred_as_automatic1111(tiny_engine):
    c, h, w = tiny_engine.runner.image_latent_shape(SIZE)
    factor = SIZE[0] // h
    from_w, from_h = 32, 96  # narrower and taller than 64x64: pasted across, cropped down
    drawn = (c, from_h // factor, from_w // factor)
    got = _initial(tiny_engine, _request(tiny_engine, variation={"subseed": 11, "strength": 0.3,
                                                                 "resize_from": (from_w, from_h)}))
    noise = _a1111_slerp(0.3, _randn(5, drawn), _randn(11, drawn))
    x = _randn(5, (c, h, w))
    dx, dy = (w - drawn[2]) // 2, (h - drawn[1]) // 2
    cw = drawn[2] if dx >= 0 else drawn[2] + 2 * dx
    ch = drawn[1] if dy >= 0 else drawn[1] + 2 * dy
    tx, ty, sx, sy = max(dx, 0), max(dy, 0), max(-dx, 0), max(-dy, 0)
    x[:, ty:ty + ch, tx:tx + cw] = noise[:, sy:sy + ch, sx:sx + cw]
    assert (dx, dy) == (w // 4, -h // 4)
    torch.testing.assert_close(got[0], x, rtol=1e-5, atol=1e-6)
    # resized at strength 0: the seed's own noise at the other shape, pasted
    alone = _initial(tiny_engine, _request(tiny_engine, variation={"subseed": 11, "strength": 0.0,
                                                                   "resize_from": (from_w, from_h)}))
    x[:, ty:ty + ch, tx:tx + cw] = _randn(5, drawn)[:, sy:sy + ch, sx:sx + cw]
    torch.testing.assert_close(alone[0], x, rtol=0, atol=0)


def test_a_variation_row_beside_a_plain_row_equals_each_alone(tiny_engine):
    varied = _request(tiny_engine, seed=9, variation={"subseed": 3, "strength": 0.5})
    plain = _request(tiny_engine, seed=9)
    futures = []
    tiny_engine.core.call_between_steps(
        lambda: futures.extend(tiny_engine.submit(r) for r in (varied, plain))).result()
    together = [f.result(timeout=600).arrays for f in futures]
    alone = [tiny_engine.submit(r).result(timeout=600).arrays for r in (varied, plain)]
    for both, one in zip(together, alone):
        assert np.abs(both - one).max() <= 1 / 255
    assert np.abs(together[0] - together[1]).max() > 0.01  # the variation changed the image


@pytest.mark.parametrize("fields,param", [
    ({"subseed": 1, "strength": 1.5}, "variation.strength"), ({"subseed": 1, "strength": -0.1}, "variation.strength"),
    ({"subseed": 1, "strength": math.nan}, "variation.strength"),
    ({"subseed": 1, "strength": 0.2, "resize_from": (-64, 64)}, "variation.resize_from"),
    ({"subseed": -3, "strength": 0.2}, "variation.subseed"), ({"strength": 0.2}, "variation"),
])
def test_bad_values_name_the_field(fields, param):
    with pytest.raises(ParamError) as e:
        GenerationRequest.create("a", width=64, height=64, guidance_scale=7.0, seed=1, variation=fields)
    assert e.value.param == param and "\n" not in str(e.value)


def test_a_request_takes_a_variation_or_its_fields():
    r = GenerationRequest.create("a", width=64, height=64, guidance_scale=7.0, seed=1,
                                 variation={"subseed": 4, "strength": 1, "resize_from": [96, 32]})
    assert r.variation == Variation(4, 1.0, (96, 32)) and isinstance(r.variation.strength, float)


def test_ensd_reseeds_only_the_noise_drawn_after_the_initial_noise(tiny_engine):
    """AUTOMATIC1111's eta_noise_seed_delta (`noise_seed_delta`, its rng.ImageRNG): the initial noise is the seed's,
    the noise a sampler draws later comes from seed + delta. Euler a's image changes; Euler, which draws nothing
    after the initial noise, is bit-equal; an ENSD row beside a plain row equals each alone."""
    runs = {(sampler, delta): tiny_engine.run(_request(tiny_engine, sampler=sampler, noise_seed_delta=delta)).arrays
            for sampler in ("euler_a", "euler") for delta in (0, 31337)}
    assert np.abs(runs["euler_a", 0] - runs["euler_a", 31337]).max() > 0.01
    assert np.array_equal(runs["euler", 0], runs["euler", 31337])
    futures = []
    tiny_engine.core.call_between_steps(lambda: futures.extend(
        tiny_engine.submit(_request(tiny_engine, sampler="euler_a", noise_seed_delta=d)) for d in (31337, 0))).result()
    for future, delta in zip(futures, (31337, 0)):
        assert np.abs(future.result(timeout=600).arrays - runs["euler_a", delta]).max() <= 1 / 255
    with pytest.raises(ParamError) as e:
        _request(tiny_engine, noise_seed_delta=-1)
    assert e.value.param == "noise_seed_delta"
