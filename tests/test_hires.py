"""The hires fix below the server (hires.py): AUTOMATIC1111's target sizes and second-pass steps, image-to-image from
latents (`EditInput.latents`, `return_latents`), and `generate_hires` equal to its two passes built by hand, alone and
batched with other rows. `random:tiny` on the CPU, 64x64 first passes, 2-3 steps."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from diffgraph.hires import HiresFix, generate_hires, hires_size, second_pass_steps
from diffgraph.request import EditInput, ParamError, Variation


@pytest.mark.parametrize("first, scale, resize, multiple, size, cover", [
    ((64, 64), 2.0, (0, 0), 8, (128, 128), (128, 128)),
    ((512, 512), 1.5, (0, 0), 8, (768, 768), (768, 768)),
    ((512, 768), 2.0, (1024, 0), 8, (1024, 1536), (1024, 1536)),   # one side given: the aspect kept
    ((512, 768), 2.0, (0, 1024), 8, (680, 1024), (680, 1024)),
    ((512, 512), 2.0, (1024, 768), 8, (1024, 768), (1024, 1024)),  # both: cover, then the centre cut
    ((520, 512), 2.0, (1000, 900), 8, (1000, 904), (1000, 984)),  # whole latent cells cut: 10 of 123, not 84 px
    ((72, 72), 1.5, (0, 0), 16, (96, 96), (96, 96)),               # a token family's multiple
])
def test_hires_size_follows_automatic1111(first, scale, resize, multiple, size, cover):
    assert hires_size(*first, scale, *resize, multiple) == (size, cover)


@pytest.mark.parametrize("steps, strength, rule, total", [
    (2, 0.5, "sd", 4), (20, 0.7, "sd", 28), (20, 0.7, "flow", 28), (3, 1.0, "sd", 3), (7, 0.33, "flow", 21),
])
def test_second_pass_runs_its_steps_of_a_longer_schedule(steps, strength, rule, total):
    """AUTOMATIC1111's setup_img2img_steps with the steps given: `steps` run, of int(steps / strength)."""
    got_total, got_strength = second_pass_steps(steps, strength, rule)
    assert got_total == total
    assert EditInput(np.zeros((64, 64, 3), np.uint8), strength=got_strength, steps_rule=rule).denoising_steps(
        total) == steps


def test_second_pass_steps_refuses_a_schedule_too_long():
    with pytest.raises(ParamError) as e:
        second_pass_steps(20, 0.001)
    assert e.value.param == "denoising_strength"


@pytest.mark.parametrize("kwargs, param", [
    ({"image": np.zeros((64, 64, 3), np.uint8), "latents": np.zeros((4, 8, 8), np.float32)}, "image"),
    ({"image": None, "latents": np.zeros((4, 8, 8), np.float64)}, "latents"),
    ({"image": None, "latents": np.full((4, 8, 8), np.nan, np.float32)}, "latents"),
    ({"image": None}, "image"),
])
def test_edit_input_takes_an_image_or_latents(kwargs, param):
    with pytest.raises(ParamError) as e:
        EditInput(**kwargs)
    assert e.value.param == param


def test_latents_of_another_size_are_refused_at_submit(tiny_engine):
    edit = EditInput(None, strength=0.5, latents=np.zeros((4, 8, 8), np.float32))
    with pytest.raises(ParamError) as e:
        tiny_engine.make_request("a fox", width=128, height=128, num_inference_steps=2, image=edit)
    assert e.value.param == "latents" and "(4, 16, 16)" in str(e.value)


def _first(engine, **changes):
    return engine.make_request("a red fox", width=64, height=64, num_inference_steps=3, seed=11, **changes)


def test_return_latents_gives_the_final_latents(tiny_engine):
    request = _first(tiny_engine)
    plain = tiny_engine.run(request)
    kept = tiny_engine.run(dataclasses.replace(request, return_latents=True))
    assert plain.latents is None and kept.latents.shape == (1, 4, 8, 8) and kept.latents.dtype == np.float32
    np.testing.assert_array_equal(kept.arrays, plain.arrays)  # the same image, its latents beside it


@pytest.mark.parametrize("upscaler", ["Latent (bicubic antialiased)", "Lanczos", "None"])
def test_generate_hires_equals_its_two_passes_by_hand(tiny_engine, upscaler):
    request = _first(tiny_engine)
    fix = HiresFix(96, 96, upscaler, strength=0.5, steps=2)
    (got,) = generate_hires(tiny_engine, request, fix)
    first = tiny_engine.run(dataclasses.replace(request, return_latents=True))
    if upscaler.startswith("Latent"):
        start = EditInput(None, strength=0.5, latents=torch.nn.functional.interpolate(
            torch.from_numpy(first.latents), size=(12, 12), mode="bicubic", antialias=True)[0].numpy())
    else:
        start = np.asarray(first.images[0].resize((96, 96), Image.LANCZOS))  # both: one Lanczos resize at 1.5x
    second = tiny_engine.run(tiny_engine.make_request("a red fox", width=96, height=96, num_inference_steps=4,
                                                      seed=11, image=start, strength=None if upscaler.startswith(
                                                          "Latent") else 0.5))
    assert got.request.num_inference_steps == 4 and got.request.denoising_steps == 2
    np.testing.assert_allclose(got.arrays, second.arrays, atol=1e-5, rtol=0)


def test_a_second_pass_batches_with_other_rows_and_equals_itself_alone(tiny_engine):
    """A second pass from latents, a text-to-image request of its size and an image edit, submitted together: each
    as alone, in shared steps."""
    first = tiny_engine.run(_first(tiny_engine, return_latents=True))
    latents = torch.nn.functional.interpolate(torch.from_numpy(first.latents), size=(16, 16), mode="nearest")[0]
    requests = [
        tiny_engine.make_request("a red fox", width=128, height=128, num_inference_steps=4, seed=11,
                                 image=EditInput(None, strength=0.5, latents=latents.numpy())),
        tiny_engine.make_request("a lighthouse", width=128, height=128, num_inference_steps=2, seed=12),
        tiny_engine.make_request("a boat", width=128, height=128, num_inference_steps=4, seed=13, strength=0.5,
                                 image=np.asarray(first.images[0].resize((128, 128)))),
    ]
    alone = [tiny_engine.run(r).arrays for r in requests]
    steps_before = tiny_engine.stats["steps"]
    together = [f.result(timeout=300) for f in [tiny_engine.submit(r) for r in requests]]
    for got, ref in zip(together, alone):
        np.testing.assert_allclose(got.arrays, ref, atol=1e-4, rtol=0)
    assert tiny_engine.stats["steps"] - steps_before < sum(r.denoising_steps for r in requests)


def test_a_token_family_runs_the_hires_fix_on_its_size_multiple():
    """Z-Image (packed latent tokens, a 16-pixel size multiple, flow-matching edits): the second pass from its
    unpacked latents, resized, equals that edit by hand."""
    from diffgraph import Engine
    with Engine(model="random:zimage-tiny", device="cpu") as engine:
        request = engine.make_request("a red fox", width=64, height=64, num_inference_steps=3, seed=5)
        size, cover = hires_size(64, 64, 1.5, 0, 0, engine.info.size_multiple)
        (got,) = generate_hires(engine, request, HiresFix(*size, "Latent", strength=0.6, steps=2, cover=cover))
        first = engine.run(dataclasses.replace(request, return_latents=True))
        latents = torch.nn.functional.interpolate(torch.from_numpy(first.latents), size=(12, 12), mode="bilinear")
        assert got.request.num_inference_steps == 3 and got.request.denoising_steps == 2  # int(2 / 0.6) = 3
        start = EditInput(None, strength=got.request.edit.strength, latents=latents[0].numpy())
        second = engine.run(engine.make_request("a red fox", width=96, height=96, num_inference_steps=3, seed=5,
                                                image=start))
    assert size == (96, 96) and first.latents.shape == (1, 16, 8, 8)
    np.testing.assert_allclose(got.arrays, second.arrays, atol=1e-5, rtol=0)


def test_the_second_pass_keeps_the_variation_seed_but_not_the_resize(tiny_engine):
    """AUTOMATIC1111's hires pass draws its noise with the image's subseed and strength, at its own size."""
    fix = HiresFix(96, 96, "Lanczos", strength=0.5, steps=2)
    varied = dataclasses.replace(_first(tiny_engine), variation=Variation(7, 0.4, (32, 96)))
    (got,) = generate_hires(tiny_engine, varied, fix)
    assert got.request.variation == Variation(7, 0.4, None) and got.request.seed == varied.seed
    resized_only = dataclasses.replace(varied, variation=Variation(7, 0.0, (32, 96)))
    (plain,) = generate_hires(tiny_engine, resized_only, fix)
    assert plain.request.variation is None
