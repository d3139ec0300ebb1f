"""IP-Adapter image prompts (issue 32) on the CPU: parity with diffusers' `load_ip_adapter` + `set_ip_adapter_scale`
on the same modules (fp32, same seeds), image-prompt rows mixed with plain, control and LoRA rows equal each alone,
scale 0 equals the plain image exactly, and bad input (an extreme aspect is a ParamError, never a huge resize).

The adapters are written by the test for the tiny presets' UNets in h94/IP-Adapter's layout (`image_proj.*` and
`ip_adapter.{1 + 2j}.to_k_ip / to_v_ip`), with seeded random weights, beside a tiny CLIP vision encoder in an
`image_encoder` folder."""

from __future__ import annotations

import copy
import json
import time

import numpy as np
import pytest
import torch
from PIL import Image

from diffgraph import Engine
from diffgraph.features.image_prompt import cross_attention_layers
from diffgraph.request import ParamError

from control_util import assert_together_equals_alone

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
        dim = attn.inner_kv_dim
        state[f"ip_adapter.{1 + 2 * j}.to_k_ip.weight"] = torch.randn(dim, cross, generator=g) * gain
        state[f"ip_adapter.{1 + 2 * j}.to_v_ip.weight"] = torch.randn(dim, cross, generator=g) * gain
    save_file(state, str(root / f"{name}.safetensors"))


def make_plus_ip_adapter(unet, root, name: str, seed: int, gain: float = 0.5) -> None:
    """An IP-Adapter "plus" (a perceiver resampler over the encoder's penultimate hidden states, 16 tokens): made as
    diffusers' IPAdapterPlusImageProjection, written back in h94's names (the inverse of diffusers' reader)."""
    import re

    from diffusers.models.embeddings import IPAdapterPlusImageProjection
    from safetensors.torch import save_file
    torch.manual_seed(seed)
    proj = IPAdapterPlusImageProjection(embed_dims=32, output_dims=unet.config.cross_attention_dim, hidden_dims=64,
                                        depth=4, dim_head=64, heads=1, num_queries=16)
    ours = proj.state_dict()
    state = {}
    for k, v in ours.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", k)
        if not m:
            state[f"image_proj.{k}"] = v
            continue
        i, rest = m[1], m[2]
        if rest.startswith("attn.to_v"):
            continue
        rest = (rest.replace("ln0", "0.norm1").replace("ln1", "0.norm2").replace("attn.to_q", "0.to_q")
                .replace("attn.to_out.0", "0.to_out").replace("ff.1.net.0.proj", "1.1").replace("ff.1.net.2", "1.3")
                .replace("ff.0", "1.0"))
        if rest.startswith("attn.to_k"):
            rest, v = "0.to_kv.weight", torch.cat([v, ours[f"layers.{i}.attn.to_v.weight"]])
        state[f"image_proj.layers.{i}.{rest}"] = v
    g = torch.Generator().manual_seed(seed)
    cross = unet.config.cross_attention_dim
    for j, (_, attn) in enumerate(cross_attention_layers(unet)):
        dim = attn.inner_kv_dim
        state[f"ip_adapter.{1 + 2 * j}.to_k_ip.weight"] = torch.randn(dim, cross, generator=g) * gain
        state[f"ip_adapter.{1 + 2 * j}.to_v_ip.weight"] = torch.randn(dim, cross, generator=g) * gain
    save_file({k: v.contiguous() for k, v in state.items()}, str(root / f"{name}.safetensors"))


def picture(seed: int, size: int = 48) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((size, size), Image.NEAREST)


@pytest.fixture(scope="module", params=["random:tiny", "random:tiny-xl"])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("ip-adapters")
    with Engine(model=request.param, device="cpu", dtype="fp32") as plain:
        make_ip_adapter(plain.model.denoiser, root, "base", seed=1)
        make_ip_adapter(plain.model.denoiser, root, "other", seed=2)
        make_plus_ip_adapter(plain.model.denoiser, root, "plus", seed=3)
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


@pytest.mark.parametrize("weight,scale,count", [("base", 1.0, 1), ("base", 0.6, 2), ("plus", 0.8, 1),
                                                ("plus", 1.0, 2)])
def test_image_prompts_equal_diffusers_load_ip_adapter(engine, weight, scale, count):
    images = [picture(3 + i) for i in range(count)]
    ours = engine.generate(PROMPT, num_inference_steps=STEPS, seed=5, sampler="euler",
                           image_prompts=dict(model=weight, images=images, scale=scale))
    ref = _reference(engine, images, scale, seed=5, weight=weight)
    plain = engine.generate(PROMPT, num_inference_steps=STEPS, seed=5, sampler="euler")
    assert ours.arrays.shape == ref.shape
    assert np.abs(ours.arrays - plain.arrays).max() * 255 > 8  # the image prompt reaches the image
    assert np.abs(ours.arrays - ref).max() * 255 <= 1.0, np.abs(ours.arrays - ref).max() * 255


def test_scale_zero_is_exactly_the_plain_image(engine):
    kw = dict(num_inference_steps=STEPS, seed=6, sampler="euler")
    zero = engine.generate(PROMPT, image_prompts=dict(model="base", images=[picture(1)], scale=0.0), **kw)
    np.testing.assert_array_equal(zero.arrays, engine.generate(PROMPT, **kw).arrays)


def test_image_prompt_rows_mixed_with_other_rows_equal_each_alone(engine):
    e = engine
    kinds = [dict(image_prompts=dict(model="base", images=[picture(1)])), dict(),
             dict(image_prompts=dict(model="other", images=[picture(2), picture(3)], scale=0.5), sampler="dpmpp_2m"),
             dict(image_prompts=dict(model="base", images=[picture(4)], scale=0.8), guidance_scale=1.0),
             dict(guidance_scale=1.0, sampler="euler_a"),
             dict(image_prompts=dict(model="other", images=[picture(5)]), image=picture(6, 64), strength=0.6)]
    reqs = [e.make_request(PROMPT, num_inference_steps=3, seed=40 + i, **{"sampler": "euler", **k})
            for i, k in enumerate(kinds)]
    assert_together_equals_alone(e, reqs)


@pytest.mark.parametrize("prompt,match", [
    (dict(model="bse", images=[np.zeros((32, 32, 3), np.uint8)]), "did you mean 'base'"),
    (dict(model="../base", images=[np.zeros((32, 32, 3), np.uint8)]), "not allowed"),
    (dict(model="base", images=[]), "1 to 2 images"),
    (dict(model="base", images=[np.zeros((32, 32), np.uint8)]), "RGB pixels"),
    (dict(model="base", images=[np.zeros((32, 32, 3), np.uint8)], scale=float("nan")), "out of range"),
    (dict(model="base", images=[np.zeros((32, 32, 3), np.uint8)], weight=1), "unknown image prompt fields"),
    (dict(images=[np.zeros((32, 32, 3), np.uint8)]), "name the IP-Adapter"),  # the folder has three
])
def test_bad_image_prompts_are_param_errors_and_the_engine_keeps_serving(engine, prompt, match):
    with pytest.raises(ParamError, match=match) as info:
        engine.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=prompt)
    assert info.value.param == "image_prompts"
    assert engine.generate(PROMPT, num_inference_steps=1, seed=1).arrays.shape[0] == 1


def test_an_image_prompt_needs_an_ip_adapter_dir():
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as e:
        with pytest.raises(ParamError, match="--ip-adapter-dir"):
            e.generate(PROMPT, num_inference_steps=1, seed=1,
                       image_prompts=dict(model="base", images=[np.zeros((32, 32, 3), np.uint8)]))


def test_image_prompt_rows_replay_the_image_prompt_step_graph_as_eager_runs_them(engine):
    """Graph mode (the emulated backend): image-prompt rows replay the `step_ipon` graph of their bucket, plain
    rows `step`, each image as eager gives it."""
    from diffgraph import GraphConfig
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), backend="emulated")
    kinds = [dict(image_prompts=dict(model="base", images=[picture(1)], scale=0.7)), dict(),
             dict(image_prompts=dict(model="other", images=[picture(2)]), guidance_scale=1.0)]
    with Engine(model=engine.model, mode="graph", graphs=cfg, ip_adapter_dir=str(engine.ip_root)) as g:
        reqs = [g.make_request(PROMPT, num_inference_steps=3, seed=60 + i, sampler="euler", **k)
                for i, k in enumerate(kinds)]
        futures: list = []
        g.core.call_between_steps(lambda: futures.extend(g.submit(r) for r in reqs)).result()
        graphed = [f.result().arrays for f in futures]
        g.generate(PROMPT, num_inference_steps=2, seed=1)
        replays = {r["kind"]: r["replays"] for r in g.runner.graph_table() if r["replays"]}
    for r, b in zip(reqs, graphed):
        assert np.abs(engine.run(r).arrays - b).max() * 255 <= 1.0
    assert replays.get("step_ipon", 0) >= 3 and replays.get("step", 0) >= 2, replays


def test_twenty_four_mixed_requests_together_equal_each_alone(engine, tmp_path_factory):
    """Image prompts (base and plus, one and two images, scales), ControlNet controls (every control mode, windows,
    two ControlNets), LoRA rows, image-to-image and inpainting rows, eight samplers, guidance-free and plain rows,
    with and without each other, all submitted at one step boundary: each image equals the same request alone."""
    from control_util import control_image, make_controlnet
    from lora_util import _write_diffusers
    nets, loras = tmp_path_factory.mktemp("mixed-nets"), tmp_path_factory.mktemp("mixed-loras")
    for i, name in enumerate(("edges", "depth")):
        make_controlnet(engine.model.denoiser, str(nets / name), seed=30 + i)
    _write_diffusers(engine, str(loras / "style.safetensors"), rank=4, seed=3)
    samplers = ["euler", "euler_a", "dpmpp_2m", "ddim", "dpmpp_2m_sde", "heun", "unipc", "lms"]
    mask = np.zeros((64, 64), np.uint8)
    mask[8:40, 16:56] = 255
    with Engine(model=engine.model, controlnet_dir=str(nets), lora_dir=str(loras),
                ip_adapter_dir=str(engine.ip_root)) as e:
        reqs = []
        for i in range(24):
            kw: dict = dict(sampler=samplers[i % 8], seed=100 + i, num_inference_steps=3 + i % 2)
            if i % 3 == 0:
                kw["controls"] = [dict(model=("edges", "depth")[i % 2], image=control_image(64, i),
                                       control_mode=("balanced", "prompt", "control")[(i // 3) % 3],
                                       scale=0.5 + (i % 4) / 4, end=(1.0, 0.6)[i % 2])]
            if i % 6 == 1:
                kw["controls"] = [dict(model="edges", image=control_image(64, i)),
                                  dict(model="depth", image=control_image(64, i + 50), start=0.3)]
            if i % 4 == 1:
                kw["loras"] = [("style", 0.8)]
            if i % 5 in (2, 3):
                kw.update(image=picture(i, 64), strength=0.7, mask_image=mask if i % 5 == 3 else None)
            if i % 7 == 4:
                kw["guidance_scale"] = 1.0
            if i % 2 == 0:
                kw["image_prompts"] = dict(model=("base", "plus", "other")[i % 3],
                                          images=[picture(200 + i)] * (1 + (i // 2) % 2), scale=(1.0, 0.5)[i % 4 // 2])
            reqs.append(e.make_request(PROMPT if i % 2 else "a castle on a hill", **kw))
        assert sum(bool(r.controls) for r in reqs) >= 10 and sum(bool(r.loras) for r in reqs) >= 5
        assert sum(r.edit is not None for r in reqs) >= 8 and sum(r.image_prompts is not None for r in reqs) == 12
        assert {c.control_mode for r in reqs for c in r.controls} == {"balanced", "prompt", "control"}
        assert_together_equals_alone(e, reqs)


def _png(image: Image.Image) -> bytes:
    import io
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_image_prompts_over_http_equal_the_engine_and_bad_ones_are_400s(engine):
    """GET /v1/ip-adapters lists them; `image_prompts` in a generations body (base64 images) and in the edits form
    (a JSON field, its images the file parts image_prompt_<i>) give the engine's images; bad ones are 400s naming
    image_prompts, and the server keeps serving."""
    import base64
    import io

    from fastapi.testclient import TestClient

    from diffgraph.server.app import create_app
    from diffgraph.api.config import ServerConfig
    if engine.model.adapter.name != "sd":
        pytest.skip("the HTTP side does not depend on the family: SD covers it")
    a, b = picture(11), picture(12, 64)
    kw = dict(num_inference_steps=3, seed=8, sampler="euler")
    want = engine.generate(PROMPT, image_prompts=dict(model="plus", images=[a], scale=0.7), **kw).arrays[0]
    edited = engine.generate(PROMPT, image=b, strength=0.6, image_prompts=dict(model="base", images=[a, a]),
                             **kw).arrays[0]
    config = ServerConfig(model="random:tiny", ip_adapter_dir=str(engine.ip_root))
    decode = lambda r: np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
    b64 = base64.b64encode(_png(a)).decode()
    factory = lambda: Engine(model=engine.model, ip_adapter_dir=str(engine.ip_root))  # the app closes its own
    with TestClient(create_app(config, engine_factory=factory)) as client:
        deadline = time.monotonic() + 300  # the engine is built on a thread of the app's
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").text
            time.sleep(0.1)
        assert [x["name"] for x in client.get("/v1/ip-adapters").json()["data"]] == ["base", "other", "plus"]
        body = {"prompt": PROMPT, "num_inference_steps": 3, "seed": 8, "sampler": "euler",
                "image_prompts": {"model": "plus", "images": [b64], "scale": 0.7}}
        r = client.post("/v1/images/generations", json=body)
        assert r.status_code == 200, r.text
        assert np.abs(decode(r).astype(int) - (want * 255).round().astype(int)).max() <= 1
        form = {"prompt": PROMPT, "num_inference_steps": "3", "seed": "8", "sampler": "euler", "strength": "0.6",
                "image_prompts": json.dumps({"model": "base"})}
        files = {"image": ("b.png", _png(b)), "image_prompt_0": ("a.png", _png(a)), "image_prompt_1": ("a.png", _png(a))}
        r = client.post("/v1/images/edits", data=form, files=files)
        assert r.status_code == 200, r.text
        assert np.abs(decode(r).astype(int) - (edited * 255).round().astype(int)).max() <= 1
        for bad, needle in [(dict(body["image_prompts"], model="plu"), "did you mean 'plus'"),
                            (dict(body["image_prompts"], images=["not base64!"]), "base64"),
                            (dict(body["image_prompts"], scale=9.0), "out of range"),
                            (dict(body["image_prompts"], images=[b64] * 3), "1 to 2 images")]:
            r = client.post("/v1/images/generations", json=dict(body, image_prompts=bad))
            assert r.status_code == 400 and r.json()["error"]["param"].startswith("image_prompts"), r.text
            assert needle in r.json()["error"]["message"], r.text
        r = client.post("/v1/images/edits", data=dict(form, image_prompts=json.dumps({"model": "base"})),
                        files={"image": files["image"]})
        assert r.status_code == 400 and "needs its images once" in r.json()["error"]["message"]
        assert client.post("/v1/images/generations", json=dict(body, image_prompts=None)).status_code == 200


def test_the_cli_generates_with_an_image_prompt(engine, tmp_path):
    import subprocess
    import sys
    if engine.model.adapter.name != "sd":
        pytest.skip("the CLI does not depend on the family: SD covers it")
    picture(13).save(tmp_path / "face.png")
    out = tmp_path / "out.png"
    run = subprocess.run([sys.executable, "-m", "diffgraph.cli", "generate", PROMPT, "--model", "random:tiny",
                          "--device", "cpu", "--steps", "3", "--seed", "3", "--sampler", "euler",
                          "--ip-adapter-dir", str(engine.ip_root), "--ip-adapter", "base",
                          "--image-prompt", f"{tmp_path / 'face.png'}:0.8",
                          "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    want = engine.generate(PROMPT, num_inference_steps=3, seed=3, sampler="euler",
                           image_prompts=dict(model="base", images=[picture(13)], scale=0.8))
    got = np.asarray(Image.open(out).convert("RGB")).astype(int)
    assert np.abs(got - (want.arrays[0] * 255).round().astype(int)).max() <= 1
    bad = subprocess.run([sys.executable, "-m", "diffgraph.cli", "generate", PROMPT, "--model", "random:tiny",
                          "--ip-adapter-dir", str(engine.ip_root), "--image-prompt", str(tmp_path / "missing.png")],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "--image-prompt" in bad.stderr and "missing.png" in bad.stderr, bad.stderr


def test_a_batch_job_takes_controls_and_image_prompts(engine, tmp_path):
    """`diffgraph batch` items with `controls` and `image_prompts` (base64 images, as the generations body has them)
    give the engine's images: the job path decodes them, it does not drop them."""
    import base64
    import os
    import subprocess
    import sys

    from control_util import control_image, make_controlnet
    if engine.model.adapter.name != "sd":
        pytest.skip("the job path does not depend on the family: SD covers it")
    # a model of its own: the fixture's UNet may carry an earlier test's LoRA side paths, which from_unet cannot copy
    fresh = Engine(model="random:tiny", device="cpu", dtype="fp32")
    make_controlnet(fresh.model.denoiser, str(tmp_path / "nets" / "edges"), seed=7)
    b64 = lambda im: base64.b64encode(_png(im)).decode()
    item = {"prompt": PROMPT, "num_inference_steps": 3, "seed": 9, "sampler": "euler",
            "controls": [{"model": "edges", "image": b64(control_image(64, 2)), "scale": 0.8}],
            "image_prompts": {"model": "base", "images": [b64(picture(21))], "scale": 0.7}}
    (tmp_path / "job.jsonl").write_text(json.dumps(item) + "\n")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "diffgraph.cli", "batch", str(tmp_path / "job.jsonl"), "--out",
                          str(tmp_path / "out"), "--model", "random:tiny", "--device", "cpu", "--controlnet-dir",
                          str(tmp_path / "nets"), "--ip-adapter-dir", str(engine.ip_root), "-q"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    with fresh, Engine(model=fresh.model, controlnet_dir=str(tmp_path / "nets"), ip_adapter_dir=str(engine.ip_root)) as e:
        want = e.generate(PROMPT, num_inference_steps=3, seed=9, sampler="euler",
                          controls=[dict(model="edges", image=control_image(64, 2), scale=0.8)],
                          image_prompts=dict(model="base", images=[picture(21)], scale=0.7)).arrays[0]
        plain = e.generate(PROMPT, num_inference_steps=3, seed=9, sampler="euler").arrays[0]
    got = np.asarray(Image.open(tmp_path / "out" / "00000-0.png").convert("RGB")).astype(int)
    assert np.abs(got - (want * 255).round().astype(int)).max() <= 1
    assert np.abs(got - (plain * 255).round().astype(int)).max() > 8


def test_an_image_prompt_without_a_model_takes_the_folders_only_adapter(engine, tmp_path):
    make_ip_adapter(engine.model.denoiser, tmp_path, "solo", seed=1)  # the same weights as the fixture's "base"
    kw = dict(num_inference_steps=2, seed=4, sampler="euler")
    with Engine(model=engine.model, ip_adapter_dir=str(tmp_path)) as e:
        unnamed = e.generate(PROMPT, image_prompts={"images": [picture(7)], "scale": 0.7}, **kw).arrays
    named = engine.generate(PROMPT, image_prompts={"model": "base", "images": [picture(7)], "scale": 0.7}, **kw).arrays
    np.testing.assert_array_equal(unnamed, named)


def test_an_extreme_aspect_image_prompt_is_a_param_error_not_a_huge_resize(tmp_path, no_huge_resizes):
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as plain:
        make_ip_adapter(plain.model.denoiser, tmp_path, "base", seed=1)
        with Engine(model=plain.model, ip_adapter_dir=str(tmp_path)) as e:
            # the test encoder's side is 32: 8x140000 would be resized to 32x560000 (a real encoder's 224: 224x3.9M)
            narrow = np.zeros((8, 140_000, 3), np.uint8)
            with pytest.raises(ParamError, match="too long and narrow") as info:
                e.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=dict(images=[narrow]))
            assert info.value.param == "image_prompts"
            ok = e.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=dict(images=[narrow[:, :8000]]))
            assert ok.arrays.shape == (1, 64, 64, 3)
