"""IP-Adapter image prompts (issue 32) on the CPU: parity with diffusers' `load_ip_adapter` + `set_ip_adapter_scale`
on the same modules (fp32, same seeds), image-prompt rows mixed with plain, control and LoRA rows equal each alone,
scale 0 equals the plain image exactly, and bad input.

The adapters are written by the test for the tiny presets' UNets in h94/IP-Adapter's layout (`image_proj.*` and
`ip_adapter.{1 + 2j}.to_k_ip / to_v_ip`), with seeded random weights, beside a tiny CLIP vision encoder in an
`image_encoder` folder."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from diffgraph import Engine
from diffgraph.features.image_prompt import cross_attention_layers
from diffgraph.request import ParamError

PROMPT = "a red fox in the snow"
STEPS = 4


def make_ip_adapter(unet, root, name: str, seed: int, gain: float = 0.5) -> None:
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
    g = torch.Generator().manual_seed(seed)
    if not (root / "image_encoder").exists():
        torch.manual_seed(0)
        config = CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=32, patch_size=8, projection_dim=24)
        CLIPVisionModelWithProjection(config).save_pretrained(str(root / "image_encoder"), safe_serialization=True)
    cross = unet.config.cross_attention_dim
    state = {"image_proj.proj.weight": torch.randn(cross * 4, 24, generator=g) * 0.3,
             "image_proj.proj.bias": torch.randn(cross * 4, generator=g) * 0.1,
             "image_proj.norm.weight": 1 + torch.randn(cross, generator=g) * 0.1,
             "image_proj.norm.bias": torch.randn(cross, generator=g) * 0.1}
    for j, (_, attn) in enumerate(cross_attention_layers(unet)):
        dim = attn.to_k.out_features
        state[f"ip_adapter.{1 + 2 * j}.to_k_ip.weight"] = torch.randn(dim, cross, generator=g) * gain
        state[f"ip_adapter.{1 + 2 * j}.to_v_ip.weight"] = torch.randn(dim, cross, generator=g) * gain
    save_file(state, str(root / f"{name}.safetensors"))


def picture(seed: int, size: int = 48) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((size, size), Image.NEAREST)


@pytest.fixture(scope="module", params=["random:tiny", "random:tiny-xl"])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("ip-adapters")
    with Engine(model=request.param, device="cpu", dtype="fp32") as plain:
        make_ip_adapter(plain.model.unet, root, "base", seed=1)
        make_ip_adapter(plain.model.unet, root, "other", seed=2)
        with Engine(model=plain.model, ip_adapter_dir=str(root)) as e:
            e.ip_root = root
            yield e


def _reference(engine, images, scale, seed, weight="base"):
    pipe = engine.diffusers_pipeline("euler")
    pipe.register_modules(unet=copy.deepcopy(pipe.unet))  # load_ip_adapter rewrites the UNet's processors
    pipe.load_ip_adapter(str(engine.ip_root), subfolder="", weight_name=f"{weight}.safetensors",
                         image_encoder_folder="image_encoder")
    pipe.set_ip_adapter_scale(scale)
    return pipe(PROMPT, ip_adapter_image=[images], num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed),
                guidance_scale=engine.model.default_guidance, output_type="np").images


@pytest.mark.parametrize("scale,count", [(1.0, 1), (0.6, 2)])
def test_image_prompts_equal_diffusers_load_ip_adapter(engine, scale, count):
    images = [picture(3 + i) for i in range(count)]
    ours = engine.generate(PROMPT, num_inference_steps=STEPS, seed=5, sampler="euler",
                           image_prompt=dict(model="base", images=images, scale=scale))
    ref = _reference(engine, images, scale, seed=5)
    plain = engine.generate(PROMPT, num_inference_steps=STEPS, seed=5, sampler="euler")
    assert ours.arrays.shape == ref.shape
    assert np.abs(ours.arrays - plain.arrays).max() * 255 > 8  # the image prompt reaches the image
    assert np.abs(ours.arrays - ref).max() * 255 <= 1.0, np.abs(ours.arrays - ref).max() * 255


def test_scale_zero_is_exactly_the_plain_image(engine):
    kw = dict(num_inference_steps=STEPS, seed=6, sampler="euler")
    zero = engine.generate(PROMPT, image_prompt=dict(model="base", images=[picture(1)], scale=0.0), **kw)
    np.testing.assert_array_equal(zero.arrays, engine.generate(PROMPT, **kw).arrays)


def test_image_prompt_rows_mixed_with_other_rows_equal_each_alone(engine):
    e = engine
    kinds = [dict(image_prompt=dict(model="base", images=[picture(1)])), dict(),
             dict(image_prompt=dict(model="other", images=[picture(2), picture(3)], scale=0.5), sampler="dpmpp_2m"),
             dict(image_prompt=dict(model="base", images=[picture(4)], scale=0.8), guidance_scale=1.0),
             dict(guidance_scale=1.0, sampler="euler_a"),
             dict(image_prompt=dict(model="other", images=[picture(5)]), image=picture(6, 64), strength=0.6)]
    reqs = [e.make_request(PROMPT, num_inference_steps=3, seed=40 + i, **{"sampler": "euler", **k})
            for i, k in enumerate(kinds)]
    alone = [e.run(r).arrays for r in reqs]
    futures: list = []
    e.core.call_between_steps(lambda: futures.extend(e.submit(r) for r in reqs)).result()
    together = [f.result().arrays for f in futures]
    for i, (a, t) in enumerate(zip(alone, together)):
        assert np.abs(a - t).max() * 255 <= 1.0, (i, np.abs(a - t).max() * 255)


@pytest.mark.parametrize("prompt,match", [
    (dict(model="bse", images=[np.zeros((32, 32, 3), np.uint8)]), "did you mean 'base'"),
    (dict(model="../base", images=[np.zeros((32, 32, 3), np.uint8)]), "not allowed"),
    (dict(model="base", images=[]), "1 to 2 images"),
    (dict(model="base", images=[np.zeros((32, 32), np.uint8)]), "RGB pixels"),
    (dict(model="base", images=[np.zeros((32, 32, 3), np.uint8)], scale=float("nan")), "out of range"),
    (dict(model="base", images=[np.zeros((32, 32, 3), np.uint8)], weight=1), "unknown image prompt fields"),
])
def test_bad_image_prompts_are_param_errors_and_the_engine_keeps_serving(engine, prompt, match):
    with pytest.raises(ParamError, match=match) as info:
        engine.generate(PROMPT, num_inference_steps=1, seed=1, image_prompt=prompt)
    assert info.value.param == "image_prompt"
    assert engine.generate(PROMPT, num_inference_steps=1, seed=1).arrays.shape[0] == 1


def test_an_image_prompt_needs_an_ip_adapter_dir():
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as e:
        with pytest.raises(ParamError, match="--ip-adapter-dir"):
            e.generate(PROMPT, num_inference_steps=1, seed=1,
                       image_prompt=dict(model="base", images=[np.zeros((32, 32, 3), np.uint8)]))
