"""Image-to-image and inpainting (issue 15) on the CPU: parity with diffusers' StableDiffusion(XL)Img2Img and
Inpaint pipelines built from the same modules (fp32, same seeds), a 9-channel inpainting UNet, odd sizes,
isolation of mixed text-to-image / edit batches, the `digits` oracle, and bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from diffgraph import Engine
from diffgraph.request import ParamError
from diffgraph.sampling.schedules import SAMPLERS

from loop_util import together

PROMPT = "a red fox in the snow"
STEPS = 8


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


def _mask(width: int, height: int) -> Image.Image:
    m = np.zeros((height, width), np.uint8)
    m[height // 4: 3 * height // 4, width // 8: 5 * width // 8] = 255
    return Image.fromarray(m)


@pytest.fixture(scope="module")
def inpaint_engine():
    engine = Engine(model="random:tiny-inpaint", device="cpu", dtype="fp32")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def inpaint_xl_engine():
    engine = Engine(model="random:tiny-xl-inpaint", device="cpu", dtype="fp32")
    yield engine
    engine.close()


def _reference(engine, task, sampler, strength, image, mask=None, width=None, height=None, n=1, schedule="default",
               seed=7, negative=None):
    pipe = engine.diffusers_pipeline(sampler, schedule, task=task)
    kwargs = dict(image=image, strength=strength, num_inference_steps=STEPS, num_images_per_prompt=n,
                  guidance_scale=engine.model.default_guidance, generator=torch.Generator("cpu").manual_seed(seed),
                  output_type="np")
    if task == "inpaint":  # the inpainting pipelines default to the UNet's size; ours to the image's
        kwargs.update(mask_image=mask, width=width or image.width // 8 * 8, height=height or image.height // 8 * 8)
    elif width is not None:  # StableDiffusionImg2ImgPipeline takes no size: resize as its processor does
        kwargs["image"] = pipe.image_processor.resize(image, height=height, width=width)
    return pipe(PROMPT, negative_prompt=negative, **kwargs).images


# the first four samplers at three strengths, and three of the others (a stochastic multistep one, a two-evaluation
# one, a predictor-corrector) at the two ends
EDIT_CASES = [(s, k) for s in SAMPLERS[:4] for k in (0.3, 0.75, 1.0)] + [
    (s, k) for s in ("dpmpp_2m_sde", "heun", "unipc") for k in (0.3, 1.0)]


@pytest.mark.parametrize("model", ["tiny", "tiny_xl", "inpaint", "inpaint_xl"])
@pytest.mark.parametrize("sampler,strength", EDIT_CASES)
def test_edits_match_diffusers(request, model, sampler, strength):
    engine = request.getfixturevalue(f"{model}_engine")
    image = _image(70, 74)  # odd size: the output is 64x72 (rounded down to multiples of 8, as diffusers does)
    tasks = ("inpaint",) if model.startswith("inpaint") else ("img2img", "inpaint")
    for task in tasks:
        mask = _mask(70, 74) if task == "inpaint" else None
        ours = engine.generate(PROMPT, image=image, mask_image=mask, strength=strength, num_inference_steps=STEPS,
                               sampler=sampler, seed=7)
        ref = _reference(engine, task, sampler, strength, image, mask)
        assert ours.arrays.shape == ref.shape == (1, 72, 64, 3)
        assert ours.arrays.std() > 1e-3  # not a flat image: the comparison means something
        assert np.abs(ours.arrays - ref).max() * 255 <= 1.0, (task, np.abs(ours.arrays - ref).max())


@pytest.mark.filterwarnings("ignore:You have passed 2 text prompts:FutureWarning")  # diffusers' own, n=2
@pytest.mark.parametrize("model", ["tiny", "tiny_xl"])
def test_edits_with_a_size_several_images_karras_and_a_negative_prompt_match_diffusers(request, model):
    engine = request.getfixturevalue(f"{model}_engine")
    image = _image(80, 72, seed=3)
    for task in ("img2img", "inpaint"):
        mask = _mask(80, 72) if task == "inpaint" else None
        ours = engine.generate(PROMPT, image=image, mask_image=mask, strength=0.6, width=64, height=96,
                               num_inference_steps=STEPS, sampler="dpmpp_2m", schedule="karras", num_images=2, seed=11,
                               negative_prompt="blurry")
        ref = _reference(engine, task, "dpmpp_2m", 0.6, image, mask, width=64, height=96, n=2, schedule="karras",
                         seed=11, negative="blurry")
        assert ours.arrays.shape == ref.shape == (2, 96, 64, 3)
        assert np.abs(ours.arrays - ref).max() * 255 <= 1.0, task
        assert np.abs(ours.arrays[0] - ours.arrays[1]).max() > 1e-3  # the rows differ (their own noise)


def test_the_strength_changes_the_image_and_defaults_follow_the_pipelines(tiny_engine, tiny_xl_engine):
    image = _image(64, 64)
    weak = tiny_engine.generate(PROMPT, image=image, strength=0.3, num_inference_steps=STEPS, seed=1)
    strong = tiny_engine.generate(PROMPT, image=image, strength=0.9, num_inference_steps=STEPS, seed=1)
    source = np.asarray(image) / 255.0
    # a weak edit stays closer to its input than a strong one
    assert np.abs(weak.arrays[0] - source).mean() < np.abs(strong.arrays[0] - source).mean()
    assert tiny_engine.make_request(PROMPT, image=image).edit.strength == 0.8
    assert tiny_engine.make_request(PROMPT, image=image, mask_image=_mask(64, 64)).edit.strength == 1.0
    assert tiny_xl_engine.make_request(PROMPT, image=image).edit.strength == 0.3
    assert tiny_xl_engine.make_request(PROMPT, image=image, mask_image=_mask(64, 64)).edit.strength == 0.9999
    r = tiny_engine.make_request(PROMPT, image=image, strength=0.5, num_inference_steps=10)
    assert r.denoising_steps == 5 and tiny_engine.runner.request_plan(r).num_steps == 5


def test_text_and_edit_requests_in_one_batch_equal_their_solo_runs(tiny_engine):
    image, mask = _image(64, 64, seed=5), _mask(64, 64)
    variants = [dict(), dict(image=image, strength=0.5), dict(image=image, mask_image=mask, strength=1.0),
                dict(image=image, mask_image=mask, strength=0.7, sampler="euler_a"), dict(sampler="dpmpp_2m"),
                dict(image=image, strength=0.9, num_images=2, sampler="ddim")]
    requests = [tiny_engine.make_request(PROMPT, num_inference_steps=STEPS, seed=20 + i, **kw)
                for i, kw in enumerate(variants)]
    solo = [tiny_engine.run(dataclasses.replace(r, request_id=f"solo-{i}")) for i, r in enumerate(requests)]
    futures = [tiny_engine.submit(r) for r in requests]  # together: they share steps
    for r, s, f in zip(requests, solo, futures):
        assert np.abs(f.result().arrays - s.arrays).max() <= 1e-5, r.request_id


@pytest.mark.parametrize("kwargs,param,message", [
    (dict(strength=0.0), "strength", r"strength 0\.0 is out of range; allowed: a number in \(0, 1\]"),
    (dict(strength=1.5), "strength", "strength 1.5 is out of range"),
    (dict(strength=float("nan")), "strength", "is out of range"),
    (dict(strength=0.04, num_inference_steps=20), "strength", "strength 0.04 with num_inference_steps 20 leaves no"),
    (dict(mask_image=Image.new("L", (32, 64))), "mask", "mask is 32x64 but the image is 64x64"),
])
def test_bad_edit_parameters_name_the_parameter(tiny_engine, kwargs, param, message):
    with pytest.raises(ParamError, match=message) as e:
        tiny_engine.make_request(PROMPT, image=_image(64, 64), **kwargs)
    assert e.value.param == param


def test_bad_images_name_the_parameter(tiny_engine):
    with pytest.raises(ParamError, match="image is 40x64; each side must be at least 64") as e:
        tiny_engine.make_request(PROMPT, image=_image(40, 64))
    assert e.value.param == "image"
    with pytest.raises(ParamError, match="image must be a PIL image or a uint8 numpy array"):
        tiny_engine.make_request(PROMPT, image="cat.png")
    with pytest.raises(ParamError, match="mask_image and strength need an image") as e:
        tiny_engine.make_request(PROMPT, strength=0.5)
    assert e.value.param == "image"


def test_digits_image_to_image_and_inpainting_oracle():
    """From a generated 3 towards an 8: at strength 0.9 an 8, at 0.3 still a 3 (5 of 6 seeds each); inpainting
    keeps the known region's latents exactly (the decoder of this tiny VAE mixes the whole 8x8 latent, so pixels
    near and even far from the mask move: the blend is checked where it acts, in latent space) and changes the
    masked region's pixels (mean difference above 10 levels)."""
    pytest.importorskip("sklearn")
    from test_digits import features, oracle_and_heldout

    from diffgraph.models import presets
    if presets.shipped_preset_folder("digits") is None:
        pytest.skip("the digits preset is not built")
    classifier, _ = oracle_and_heldout()
    engine = Engine("digits", device="cpu")
    try:
        # each stage's requests submitted together (they share steps)
        threes = together(engine, [engine.make_request("a handwritten digit three", seed=seed, num_inference_steps=20)
                                   for seed in range(6)])
        edits = together(engine, [engine.make_request("a handwritten digit eight", image=three.images[0],
                                                      strength=strength, seed=100 + seed, num_inference_steps=20)
                                  for seed, three in enumerate(threes) for strength in (0.9, 0.3)])
        strong, weak = ([int(classifier.predict(features(edit.arrays))[0]) for edit in edits[k::2]] for k in (0, 1))
        assert strong.count(8) >= 5, strong
        assert weak.count(3) >= 5, weak

        source = engine.generate("a handwritten digit three", seed=1, num_inference_steps=20)
        mask = np.zeros((64, 64), np.uint8)
        mask[:, 32:] = 255
        decoded: list[torch.Tensor] = []
        decode = engine.runner.decode_async
        engine.runner.decode_async = lambda key, latents, size=None: (decoded.append(latents.clone()),
                                                                      decode(key, latents, size))[1]
        try:
            inpainted = engine.generate("a handwritten digit eight", image=source.images[0], mask_image=mask, seed=3,
                                        num_inference_steps=20)
        finally:
            engine.runner.decode_async = decode
        # the image's latents as the pipeline draws them: the posterior sample comes first from the generator
        from diffusers.image_processor import VaeImageProcessor
        pixels = VaeImageProcessor(vae_scale_factor=8).preprocess(source.images[0])
        with torch.no_grad():
            posterior = engine.model.vae.encode(pixels).latent_dist
        sample = posterior.sample(torch.Generator("cpu").manual_seed(3)) * engine.model.vae.config.scaling_factor
        assert torch.abs(decoded[0][..., :, :4] - sample[..., :, :4]).max() <= 1e-5  # known: latent columns 0..3
        assert torch.abs(decoded[0][..., :, 4:] - sample[..., :, 4:]).mean() > 0.1   # repainted
        assert np.abs(inpainted.arrays[0, :, 32:] - source.arrays[0, :, 32:]).mean() * 255 > 10
    finally:
        engine.close()


def test_edit_pixels_are_preprocessed_on_the_submitting_thread_not_the_engine_loop(tiny_engine, monkeypatch):
    """Issue 28: the resize of an edit's image (up to 16 MP) and mask runs at submit, never on the loop that every
    live row waits for; the admitted request does not keep the pixels."""
    import threading

    from diffgraph.engine import core
    threads = []
    real = core.preprocess_edit

    def recorded(request, factor):
        threads.append(threading.current_thread())
        return real(request, factor)
    monkeypatch.setattr(core, "preprocess_edit", recorded)
    size = tiny_engine.info.native_size
    image = (np.arange(size * size * 3) % 251).astype(np.uint8).reshape(size, size, 3)
    mask = np.zeros((size, size), np.uint8)
    mask[:, size // 2:] = 255
    before = tiny_engine.generate("a cat", image=image, mask_image=mask, num_inference_steps=3, seed=4).arrays
    assert threads == [threading.current_thread()] and threads[0] is not tiny_engine.core.loop.thread
    monkeypatch.setattr(core, "preprocess_edit", real)
    again = tiny_engine.generate("a cat", image=image, mask_image=mask, num_inference_steps=3, seed=4).arrays
    np.testing.assert_array_equal(before, again)
