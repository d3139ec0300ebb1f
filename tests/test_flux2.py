"""FLUX.2 klein (models/families/flux2.py) against its oracle, diffusers' `Flux2KleinPipeline`, on tiny random folders.

Two folders of one tiny architecture (one double and one single block, a 28-layer 16-wide Qwen3 with Qwen's
vocabulary and the shipped tokenizer, a four-level FLUX.2 VAE with batch-norm statistics that are not the identity),
saved with save_pretrained as the published ones are: "FLUX.2-klein-4B" (step-distilled: no guidance) and
"FLUX.2-klein-base-4B" (true classifier-free guidance). fp32 on the CPU: each image within one uint8 level of the
pipeline's with the same seed; rows of different prompt lengths, sizes of one token bucket, steps and guidance run in
one step and each equals its request alone.
"""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from diffgraph import Engine, GenerationRequest, ParamError
from diffgraph.models.families.flux2 import (CHECKPOINTS, SCHEDULER, checkpoint_of, empirical_mu, tiny_qwen3,
                                             tiny_transformer, tiny_vae)
from diffgraph.sampling.flow import FlowSchedule
from diffgraph.models.qwen_tokenizer import qwen_tokenizer

from loop_util import calls_per_request, images_together

SIZES = [(128, 128), (96, 160), (160, 96)]  # 64, 60 and 60 tokens (16 px cells): one bucket of 256


def pipeline(distilled: bool, vae: dict | None = None):
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, \
        Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(**tiny_transformer(text_width=16))
    with torch.no_grad():  # at its initial scale the prompt moves the tiny model's image by a level or two
        for p in transformer.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    encoder = Qwen3ForCausalLM(Qwen3Config(**tiny_qwen3(151936)))
    vae = AutoencoderKLFlux2(**(vae or tiny_vae()))
    with torch.no_grad():  # batch-norm statistics a wrong (de)normalisation cannot pass
        vae.bn.running_mean.normal_(std=0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    vae.enable_tiling()  # as the engine above the native area (64x64 here): diffusers' tiles, its overlap and blend
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER, time_shift_type="exponential")
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae.eval(), text_encoder=encoder.eval(),
                              tokenizer=qwen_tokenizer("qwen3"), transformer=transformer.eval(),
                              is_distilled=distilled)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2")
    out = {}
    for name, distilled in (("FLUX.2-klein-4B", True), ("FLUX.2-klein-base-4B", False)):
        pipe = pipeline(distilled)
        pipe.save_pretrained(str(root / name))
        out[name] = (str(root / name), pipe)
    return out


@pytest.fixture(scope="module")
def klein(folders):
    with Engine(model=folders["FLUX.2-klein-4B"][0], device="cpu") as e:
        yield e


@pytest.fixture(scope="module")
def base(folders):
    with Engine(model=folders["FLUX.2-klein-base-4B"][0], device="cpu") as e:
        yield e


def oracle(pipe, prompt: str, size: tuple[int, int], steps: int, guidance: float, seed: int,
           negative: str | None = None) -> np.ndarray:
    """diffusers' image (guidance the pipeline's own scale, which is diffgraph's; the negative prompt as the
    pipeline takes one: its embeddings, "" without)."""
    negative_embeds = None if negative is None else pipe.encode_prompt(negative)[0]
    image = pipe(prompt=prompt, negative_prompt_embeds=negative_embeds, height=size[0], width=size[1],
                 num_inference_steps=steps, guidance_scale=guidance, generator=torch.Generator().manual_seed(seed),
                 output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


@pytest.mark.parametrize("size", [(128, 128), (96, 160)])
def test_distilled_klein_equals_the_pipeline_without_guidance(folders, klein, size):
    pipe = folders["FLUX.2-klein-4B"][1]
    got = images_together(klein, [dict(prompt="a red fox in the snow", height=size[0], width=size[1],
                                       num_inference_steps=3, seed=7)])[0]
    assert klein.info.default_guidance == 1.0 and klein.info.guidance == "none"
    assert klein.info.default_steps == 4 and klein.model.extra["checkpoint"] == CHECKPOINTS["flux.2-klein"]
    want = oracle(pipe, "a red fox in the snow", size, 3, 4.0, 7)  # the pipeline's default 4.0, ignored
    assert got.shape == (*size, 3) and np.abs(got - want).max() <= 1


@pytest.mark.parametrize("size", [(128, 128), (160, 96)])
def test_base_klein_equals_the_pipeline_with_guidance_and_a_negative_prompt(folders, base, size):
    pipe = folders["FLUX.2-klein-base-4B"][1]
    got = images_together(base, [dict(prompt="a red fox", negative_prompt="snow at dusk", height=size[0],
                                      width=size[1], num_inference_steps=2, guidance_scale=3.0, seed=5)])[0]
    assert base.info.guidance == "cfg" and base.info.default_guidance == 4.0 and base.info.default_steps == 50
    want = oracle(pipe, "a red fox", size, 2, 3.0, 5, "snow at dusk")
    assert np.abs(got - want).max() <= 1
    assert np.abs(want - oracle(pipe, "a red fox", size, 2, 1.0, 5)).max() > 3  # the guidance shows


def test_a_step_gathers_the_rows_rotary_tables_and_builds_none(klein, monkeypatch):
    """A row's RoPE tables are per-row state, built with its group's per-size fields (the image's, the text's and the
    neutral references': three embedder calls, as many more where the group's buffers are new), never in a step: a
    request of 2 steps and one of 4 build no more than those (a step that built them would make 4 and 8 calls)."""
    embedder = type(klein.model.denoiser.pos_embed)
    request = dict(prompt="a red fox", height=112, width=80)  # a size no other test runs
    (first, two), (again, four) = calls_per_request(klein, monkeypatch, embedder, "forward", request, (2, 4))
    assert (two, four) == (2, 4) and first in (3, 6) and again <= first


def test_mixed_rows_share_a_step_and_each_equals_the_pipeline(folders, base):
    """Prompts of 2 and 30 words, three sizes of one token bucket, 2/3/4 steps, guidance off, on without a negative
    prompt and on with one: submitted together, each equals diffusers' image of its request alone."""
    pipe = folders["FLUX.2-klein-base-4B"][1]
    long = ", ".join(["a lighthouse on a cliff at dusk"] * 5)
    requests = [dict(prompt="red fox", height=SIZES[0][0], width=SIZES[0][1], num_inference_steps=3,
                     guidance_scale=1.0, seed=1),
                dict(prompt=long, negative_prompt="snow", height=SIZES[1][0], width=SIZES[1][1],
                     num_inference_steps=2, guidance_scale=2.5, seed=2),
                dict(prompt="a red fox at dusk", height=SIZES[2][0], width=SIZES[2][1], num_inference_steps=4,
                     guidance_scale=4.0, seed=3)]
    assert {base.model.adapter.group_key(base.model, s) for s in SIZES} == {(0, 256)}
    got = images_together(base, requests)
    for r, image in zip(requests, got):
        want = oracle(pipe, r["prompt"], (r["height"], r["width"]), r["num_inference_steps"],
                      r["guidance_scale"], r["seed"], r.get("negative_prompt"))
        assert image.shape == (r["height"], r["width"], 3)
        assert np.abs(image - want).max() <= 1, r


def test_graph_mode_replays_the_bucket_s_step_graphs(folders):
    """In graph mode (the CPU's emulated graphs, verified against eager at capture) rows of two sizes, guided and
    not, replay the step graphs of their one token bucket, (0, 256); each image equals the pipeline's."""
    from diffgraph import GraphConfig

    path, pipe = folders["FLUX.2-klein-base-4B"]
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=tuple(SIZES[:2]), prewarm=False, verify=True,
                      backend="emulated", capture_text_encoder=False)
    requests = [dict(prompt="red fox", height=SIZES[0][0], width=SIZES[0][1], num_inference_steps=2,
                     guidance_scale=1.0, seed=1),
                dict(prompt="a lighthouse", negative_prompt="snow", height=SIZES[1][0], width=SIZES[1][1],
                     num_inference_steps=2, guidance_scale=2.5, seed=2)]
    with Engine(model=path, device="cpu", mode="graph", graphs=cfg) as graphed:
        assert graphed.runner.graphed_resolutions() == ((0, 256),)
        got = images_together(graphed, requests)
        table = graphed.runner.graph_table()
    steps = [row for row in table if row["kind"] == "step" and row["replays"]]
    assert steps and {(row["height"], row["width"]) for row in steps} == {(0, 256)}, table
    assert all(row["verify_max_abs"] is not None and row["verify_max_abs"] < 1e-4 for row in steps)
    for r, image in zip(requests, got):
        want = oracle(pipe, r["prompt"], (r["height"], r["width"]), r["num_inference_steps"], r["guidance_scale"],
                      r["seed"], r.get("negative_prompt"))
        assert np.abs(image - want).max() <= 1, r


def test_the_schedule_is_the_pipelines_empirical_shift(folders):
    """sigmas of 4 and 50 steps at 64 and 4096 tokens equal the scheduler's with the pipeline's mu."""
    pipe = folders["FLUX.2-klein-4B"][1]
    schedule = FlowSchedule.from_config(dict(SCHEDULER))
    for tokens, steps in ((64, 4), (4096, 4), (4096, 50), (6000, 28)):
        mu = empirical_mu(tokens, steps)
        pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        want = pipe.scheduler.sigmas.numpy()
        assert np.abs(schedule.sigmas(steps, tokens, mu=mu) - want).max() < 1e-6
    assert empirical_mu(4096, 4) != empirical_mu(4096, 50) and empirical_mu(6000, 4) == empirical_mu(6000, 50)


def test_the_checkpoint_comes_from_the_folder_or_its_name():
    assert checkpoint_of("/m/FLUX.2-klein-4B") == CHECKPOINTS["flux.2-klein"]
    assert checkpoint_of("/hub/models--black-forest-labs--FLUX.2-klein-base-9B/snapshots/0abc") == \
        CHECKPOINTS["flux.2-klein-base"]
    assert checkpoint_of("/m/FLUX.2-klein-4B", distilled=False) == CHECKPOINTS["flux.2-klein-base"]
    with pytest.raises(ValueError, match="FLUX.2-klein-4B, FLUX.2-klein-base-4B.* `preset` in a split file's "
                                         "sidecar to one of flux.2-klein, flux.2-klein-base"):
        checkpoint_of("/m/my-model")
    # a split file's sidecar preset beats its name
    assert checkpoint_of("/m/flux-2-klein-4b.safetensors", preset="flux.2-klein-base") == \
        CHECKPOINTS["flux.2-klein-base"]
    assert checkpoint_of("/m/my-model.safetensors", preset="flux.2-klein") == CHECKPOINTS["flux.2-klein"]
    with pytest.raises(ValueError, match="^FLUX.2 klein preset 'z-image' is unknown; use one of flux.2-klein, "
                                         "flux.2-klein-base$"):
        checkpoint_of("/m/FLUX.2-klein-4B", preset="z-image")


def test_it_refuses_what_it_does_not_read(klein):
    with pytest.raises(ParamError) as e:
        GenerationRequest.create(prompt="fox", sampler="heun", height=128, width=128, model=klein.info)
    assert e.value.param == "sampler" and "flow_euler, flow_euler_a, flow_dpmpp_2m" in str(e.value)
    with pytest.raises(ParamError) as e:
        GenerationRequest.create(prompt="fox", height=128, width=120, model=klein.info)
    assert e.value.param == "width" and "16" in str(e.value)
    assert json.loads(json.dumps(klein.info.samplers)) == ["flow_euler", "flow_euler_a", "flow_dpmpp_2m"]
    with pytest.raises(ParamError) as e:  # the distilled checkpoint runs no guidance: a scale other than 1 is unread
        GenerationRequest.create(prompt="fox", guidance_scale=4.0, height=128, width=128, model=klein.info)
    assert e.value.param == "guidance_scale" and "step-distilled" in str(e.value)
    with pytest.raises(ParamError) as e:  # and so is a negative prompt
        GenerationRequest.create(prompt="fox", negative_prompt="snow", height=128, width=128, model=klein.info)
    assert e.value.param == "negative_prompt"


def test_a_prompt_beyond_the_encoder_is_refused_naming_its_count(base):
    """512 tokens with the template, as the pipeline pads them: a longer prompt is a ParamError (HTTP 400) naming
    the count and the limit, never cut silently."""
    long = GenerationRequest.create(prompt="fox " * 600, height=128, width=128, num_inference_steps=1,
                                    model=base.info)
    with pytest.raises(ParamError) as e:
        base.submit(long)
    assert e.value.param == "prompt" and "at most 512" in str(e.value)
    assert int(str(e.value).split()[2]) > 512
    negative = GenerationRequest.create(prompt="fox", negative_prompt="snow " * 600, guidance_scale=2.0, height=128,
                                        width=128, num_inference_steps=1, model=base.info)
    with pytest.raises(ParamError) as e:
        base.submit(negative)
    assert e.value.param == "negative_prompt"


def test_the_tiny_random_preset_runs_with_the_shipped_tokenizer():
    with Engine(model="random:flux2-klein-tiny", device="cpu") as engine:
        assert engine.model.is_random and engine.info.family == "flux2" and engine.info.default_steps == 4
        assert len(engine.model.tokenizers[0]) == 151669  # Qwen3's vocabulary and control tokens
        image = engine.generate("a red fox", height=64, width=96, num_inference_steps=2, seed=1)
    assert image.arrays[0].shape == (64, 96, 3) and image.arrays[0].std() > 0


def lora_files(pipe, folder) -> dict[str, str]:
    """One rank-4 adapter on the double block's attention (both streams) and feed-forwards and the single block's
    linears, written five ways: diffusers / PEFT keys (split q/k/v); Kohya's `lora_unet_*` with alphas (fused qkv);
    ai-toolkit's `diffusion_model.*` (BFL's names, fused qkv, lora_A/B); ComfyUI's (the same names, lora_down/up with
    alphas); and `diffusion_model.*` in diffusers' names. q, k and v share their down weight, so the fused files hold
    the same adapter."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(21)
    # diffusers' module -> BFL's original name (None: one of a fused qkv)
    double = {"attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj", "ff.linear_in": "img_mlp.0",
              "ff.linear_out": "img_mlp.2", "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2"}
    single = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
    fused = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
             "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
    weights = {}  # diffusers' full module path -> (a, b)
    for original, modules in fused.items():
        shared = torch.randn((4, 32), generator=g) * 0.3
        for m in modules:
            weights[f"transformer_blocks.0.{m}"] = (shared, torch.randn((32, 4), generator=g) * 0.3)
    for blocks, names in (("transformer_blocks.0", double), ("single_transformer_blocks.0", single)):
        for m in names:
            linear = pipe.transformer.get_submodule(f"{blocks}.{m}")
            weights[f"{blocks}.{m}"] = (torch.randn((4, linear.in_features), generator=g) * 0.3,
                                        torch.randn((linear.out_features, 4), generator=g) * 0.3)
    original = {**{f"double_blocks.0.{o}": f"transformer_blocks.0.{m}" for m, o in double.items()},
                **{f"single_blocks.0.{o}": f"single_transformer_blocks.0.{m}" for m, o in single.items()}}
    peft = {f"transformer.{m}.lora_{x}.weight": w for m, (a, b) in weights.items() for x, w in (("A", a), ("B", b))}
    split = {k.replace("transformer.", "diffusion_model.", 1): v for k, v in peft.items()}
    kohya, toolkit, comfy = {}, {}, {}
    fused_weights = {f"double_blocks.0.{o}": (weights[f"transformer_blocks.0.{ms[0]}"][0],
                                               torch.cat([weights[f"transformer_blocks.0.{m}"][1] for m in ms]))
                     for o, ms in fused.items()}
    for name, (a, b) in {**{o: weights[m] for o, m in original.items()}, **fused_weights}.items():
        flat = "lora_unet_" + name.replace(".", "_")
        kohya[f"{flat}.lora_down.weight"], kohya[f"{flat}.lora_up.weight"] = a * 2, b  # alpha 2 of rank 4
        kohya[f"{flat}.alpha"] = torch.tensor(2.0)
        toolkit[f"diffusion_model.{name}.lora_A.weight"], toolkit[f"diffusion_model.{name}.lora_B.weight"] = a, b
        comfy[f"diffusion_model.{name}.lora_down.weight"], comfy[f"diffusion_model.{name}.lora_up.weight"] = a / 2, b
        comfy[f"diffusion_model.{name}.alpha"] = torch.tensor(8.0)  # alpha 8 of rank 4
    out = {}
    for name, state in (("peft", peft), ("kohya", kohya), ("toolkit", toolkit), ("comfy", comfy), ("split", split)):
        out[name] = str(folder / f"{name}.safetensors")
        save_file({k: v.clone().contiguous() for k, v in state.items()}, out[name])
    return out


def test_lora_files_of_five_layouts_run_per_row_and_equal_diffusers(folders, tmp_path):
    """Rows with the adapter from each file and a row without, in one step: each adapter row equals the pipeline
    with diffusers' load_lora_weights of the PEFT file at the same scale, the plain row the pipeline without. A
    Z-Image adapter (PEFT or Kohya keys) is refused naming it."""
    from safetensors.torch import save_file

    path, pipe = folders["FLUX.2-klein-4B"]
    files = lora_files(pipe, tmp_path)
    save_file({"transformer.layers.0.attention.to_q.lora_A.weight": torch.ones(4, 64),
               "transformer.layers.0.attention.to_q.lora_B.weight": torch.ones(64, 4)},
              str(tmp_path / "zimage_style.safetensors"))
    save_file({"lora_unet_layers_0_attention_to_q.lora_down.weight": torch.ones(4, 64),
               "lora_unet_layers_0_attention_to_q.lora_up.weight": torch.ones(64, 4)},
              str(tmp_path / "zimage_kohya.safetensors"))
    with Engine(model=path, device="cpu", lora_dir=str(tmp_path)) as engine:
        common = dict(prompt="a red fox", height=96, width=96, num_inference_steps=2, seed=6)
        got = images_together(engine, [dict(common, loras=[(name, 0.8)]) for name in files] + [common])
        for name in ("zimage_style", "zimage_kohya"):
            with pytest.raises(ParamError, match=f"'{name}' .*made for another model") as e:
                engine.submit(GenerationRequest.create(model=engine.info, **common, loras=[(name, 1.0)])).result()
            assert e.value.param == "loras" and "\n" not in str(e.value)
    pipe.load_lora_weights(files["peft"], adapter_name="fox")
    pipe.set_adapters(["fox"], [0.8])
    try:
        want = oracle(pipe, "a red fox", (96, 96), 2, 1.0, 6)
    finally:
        pipe.unload_lora_weights()
    plain = oracle(pipe, "a red fox", (96, 96), 2, 1.0, 6)
    for name, image in zip(files, got):
        assert np.abs(image - want).max() <= 1, name
    assert np.abs(got[-1] - plain).max() <= 1 and np.abs(want - plain).max() > 3


def test_guidance_on_a_distilled_klein_is_refused_by_openai_and_ignored_by_a1111(folders):
    """The step-distilled checkpoint runs no guidance: a guidance_scale other than 1 is a one-line 400 naming it on
    the images route (and a ParamError from GenerationRequest.create), while AUTOMATIC1111's route runs the request
    with cfg_scale 1 and a warning (its clients send 7 by default); the image equals the pipeline's."""
    import base64
    import io

    from PIL import Image

    from diffgraph.server import ServerConfig
    from server_util import served

    path, pipe = folders["FLUX.2-klein-4B"]
    with served(Engine(model=path, device="cpu"), ServerConfig(model=path, device="cpu")) as client:
        body = {"prompt": "a red fox", "size": "96x64", "seed": 3, "num_inference_steps": 2}
        bad = client.post("/v1/images/generations", json={**body, "guidance_scale": 3.5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "guidance_scale", bad.text
        message = bad.json()["error"]["message"]
        assert "3.5" in message and "no guidance" in message and "\n" not in message
        assert client.post("/v1/images/generations", json={**body, "guidance_scale": 1}).status_code == 200
        a1111 = client.post("/sdapi/v1/txt2img", json={"prompt": "a red fox", "width": 96, "height": 64, "seed": 3,
                                                       "steps": 2, "cfg_scale": 7, "sampler_name": "Euler"})
        assert a1111.status_code == 200, a1111.text
        assert any(w.startswith("cfg_scale was ignored") for w in a1111.json()["warnings"]), a1111.json()
        assert json.loads(a1111.json()["info"])["cfg_scale"] == 1.0
        image = np.array(Image.open(io.BytesIO(base64.b64decode(a1111.json()["images"][0]))))
    assert np.abs(image.astype(np.int16) - oracle(pipe, "a red fox", (64, 96), 2, 1.0, 3)).max() <= 1


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """(a distilled tiny pipeline whose VAE is 32 wide, as a width's group norm of 32 groups, the only count a file
    implies; its VAE in BFL's layout as a file; its image for SPLIT_REQUEST). The split VAE's config is FLUX.2's
    (native 1024): its images decode whole."""
    from safetensors.torch import save_file

    from diffgraph.models import flux2_files
    from diffgraph.models.original_layout import vae_original

    pipe = pipeline(True, vae={**tiny_vae(), "block_out_channels": (32,) * 4, "norm_num_groups": 32})
    pipe.vae.disable_tiling()
    path = str(tmp_path_factory.mktemp("flux2-split") / "flux2-vae.safetensors")
    vae = pipe.vae.state_dict()
    coders = vae_original({k: v for k, v in vae.items() if not k.startswith("bn.")}, 4)
    save_file({k: v.contiguous() for k, v in flux2_files.vae_to_original(vae, coders).items()}, path)
    return pipe, path, _split_oracle(pipe)


SPLIT_REQUEST = dict(prompt="a red fox", height=96, width=128, num_inference_steps=2, seed=4)


def _split_oracle(pipe) -> np.ndarray:
    r = SPLIT_REQUEST
    return oracle(pipe, r["prompt"], (r["height"], r["width"]), r["num_inference_steps"], 1.0, r["seed"])


def _split_image(model) -> np.ndarray:
    with Engine(model=model) as engine:
        return images_together(engine, [SPLIT_REQUEST])[0]


def test_comfyui_split_files_equal_the_pipeline(split, tmp_path):
    """The transformer in BFL's layout under `model.diffusion_model.` (fused qkv), the Qwen3 encoder under `model.`,
    the FLUX.2 VAE in BFL's layout (the LDM coders, `encoder.quant_conv`, the batch-norm statistics), as three files:
    loaded by the family (configs from their shapes, the shipped tokenizer) the image equals the pipeline's on the
    same modules. (The tiny files are below the split kinds' size signatures, so the SplitFiles the catalog would
    choose is made here.)"""
    from safetensors.torch import save_file

    from diffgraph.models import flux2_files
    from diffgraph.models.families import default_registry
    from diffgraph.models.split_files import SPLIT_KINDS, SplitFiles

    pipe, vae_path, want = split
    paths = [str(tmp_path / name) for name in ("flux-2-klein-tiny.safetensors", "qwen_3_tiny.safetensors")]
    save_file({k: v.contiguous() for k, v in flux2_files.transformer_to_original(
        pipe.transformer.state_dict()).items()}, paths[0])
    save_file({f"model.{k}": v.contiguous() for k, v in pipe.text_encoder.model.state_dict().items()}, paths[1])
    files = SplitFiles(next(k for k in SPLIT_KINDS if k.name == "flux2-klein-4b"), *paths, vae_path, ())
    assert files.kind.family == "flux2"
    model = default_registry().by_name("flux2").load_split(files, torch.device("cpu"), torch.float32, paths[0])
    with Engine(model=model) as engine:
        got = images_together(engine, [SPLIT_REQUEST])[0]
        assert engine.info.default_steps == 4 and engine.info.guidance == "none"
    assert np.abs(got - want).max() <= 1
    with pytest.raises(ValueError, match="is a FLUX.2 VAE.*not a FLUX.2 transformer"):
        flux2_files.read_transformer(vae_path)
    mine = SplitFiles(files.kind, str(tmp_path / "mine.safetensors"), paths[1], vae_path, ())
    with pytest.raises(ValueError, match="cannot tell which FLUX.2 klein checkpoint"):
        default_registry().by_name("flux2").load_split(mine, torch.device("cpu"), torch.float32, "mine")
    os.rename(paths[0], mine.diffusion_model)  # a name that says nothing: its sidecar's preset decides
    base = default_registry().by_name("flux2").load_split(dataclasses.replace(mine, preset="flux.2-klein-base"),
                                                          torch.device("cpu"), torch.float32, "mine")
    assert base.extra["checkpoint"] == CHECKPOINTS["flux.2-klein-base"]


Q8_MAX, Q8_MEAN = 8, 1.0  # a Q8_0 transformer's image against the float32 pipeline's (measured: 8 and 0.96 levels)


def test_gguf_transformers_and_a_llama_cpp_encoder_equal_the_pipeline(split, tmp_path):
    """ComfyUI-GGUF's quantisations of the transformer (BFL's names, prefix stripped, architecture `flux`; 1-D and
    small tensors F32) and the Qwen3 encoder as llama.cpp writes it (`blk.N.attn_q` ...; F32): the encoder's prompt
    embeddings equal the pipeline's; an F16 transformer's image is within 1 level of the float32 pipeline's, a Q8_0
    one's within Q8_MAX levels (Q8_MEAN on average: the tiny model's weights are scaled up, so its error shows), its
    transformer holding exactly gguf's own dequantisation of the file's weights. A Z-Image GGUF in the transformer's
    place is refused in one line naming the file and what it is."""
    import gguf

    from diffgraph.models import flux2_files
    from diffgraph.models.families import default_registry
    from diffgraph.models.split_files import SPLIT_KINDS, SplitFiles
    from gguf_util import write_gguf, write_llama_cpp
    from test_zimage_files import to_original, tiny_transformer as zimage_transformer

    pipe, vae_path, want = split
    encoder, config = str(tmp_path / "Qwen3-tiny-F32.gguf"), pipe.text_encoder.config
    write_llama_cpp(encoder, {f"model.{k}": v for k, v in pipe.text_encoder.model.state_dict().items()}, "qwen3",
                    config.num_attention_heads, config.num_key_value_heads)
    kind, family = next(k for k in SPLIT_KINDS if k.name == "flux2-klein-4b"), default_registry().by_name("flux2")
    state = pipe.transformer.state_dict()
    original = flux2_files.transformer_to_original(state, prefix="")
    for qtype in ("F16", "Q8_0"):
        path = str(tmp_path / f"flux-2-klein-tiny-{qtype}.gguf")
        held = write_gguf(path, original, gguf.GGMLQuantizationType[qtype], arch="flux")
        model = family.load_split(SplitFiles(kind, path, encoder, vae_path, ()), torch.device("cpu"), torch.float32,
                                  path)
        if qtype == "F16":
            embeds = family.encode(model, [SPLIT_REQUEST["prompt"]])["embeds"]
            assert (embeds - pipe.encode_prompt(SPLIT_REQUEST["prompt"])[0]).abs().max().item() <= 1e-5
        error = np.abs(_split_image(model) - want)
        if qtype == "F16":
            assert error.max() <= 1 and error.mean() <= 0.05  # (measured: 1, 0.04)
            continue
        assert 1 <= error.max() <= Q8_MAX and error.mean() <= Q8_MEAN  # (the quantisation's error reaches the image)
        loaded, dequantised = model.denoiser.state_dict(), flux2_files.transformer_from_original(held)
        assert sorted(loaded) == sorted(state) and all(torch.equal(loaded[k], dequantised[k]) for k in state)
    zimage = str(tmp_path / "flux-2-klein-4b-Q8_0.gguf")  # (a Z-Image file under a klein name)
    write_gguf(zimage, to_original(zimage_transformer().state_dict(), ""), gguf.GGMLQuantizationType.Q8_0)
    for load in (lambda: flux2_files.read_transformer(zimage),
                 lambda: family.load_split(SplitFiles(kind, zimage, encoder, vae_path, ()), torch.device("cpu"),
                                           torch.float32, zimage)):
        with pytest.raises(ValueError) as e:
            load()
        assert str(e.value) == (f"{zimage} is a Z-Image transformer, not a FLUX.2 transformer; give a FLUX.2 "
                                "transformer's file here")

# -- step caching (models/families/token_cache.py, first_block_cache.py; flux2.py `blocks`) ---------------------------
# The references are the methods written here on the pipeline: TaylorSeer around the transformer's forward (one state
# per CFG branch: the pipeline calls the transformer once per branch), the first-block rule in place of its blocks.
CACHE_KW = dict(prompt="a red fox in the snow", height=128, width=128, seed=7)
REAL = 64  # 128x128: 8x8 tokens of 16 px


def _cache_kw(cache=None, refs=(), **kw):
    extras = {**({"step_cache": cache} if cache is not None else {}), **({"reference_images": list(refs)} if refs
                                                                          else {})}
    return {**CACHE_KW, **kw, "extras": extras or None}


def _pipe_image(pipe, steps: int, guidance: float, refs=()) -> np.ndarray:
    from PIL import Image

    image = pipe(prompt=CACHE_KW["prompt"], image=[Image.fromarray(r) for r in refs] or None, height=128, width=128,
                 num_inference_steps=steps, guidance_scale=guidance, generator=torch.Generator().manual_seed(7),
                 output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


def _taylorseer_by_hand(net, interval: int, order: int, branches: int):
    """The transformer's forward replaced by TaylorSeer: evaluation e (the step; `branches` calls each) runs it where
    e % interval == 0 and keeps its output F and finite differences D1 = (F - F_last) / dist, D2 = (D1 - D1_last) /
    dist (order 2); else it returns F + D1 k + D2 k^2 / 2, k evaluations after the last full one. Returns the
    function that puts the forward back."""
    forward, calls = net.forward, [0]
    kept = [{"last": None, "terms": (None, None, None)} for _ in range(branches)]

    def taylor(**kw):
        e, state = calls[0] // branches, kept[calls[0] % branches]
        calls[0] += 1
        f0, d1, d2 = state["terms"]
        if e % interval == 0:
            f = forward(**kw)[0].float()
            g1 = None if f0 is None else (f - f0) / (e - state["last"])
            g2 = None if order < 2 or d1 is None else (g1 - d1) / (e - state["last"])
            state["last"], state["terms"] = e, (f, g1, g2)
            return (f,)
        k = e - state["last"]
        return (f0 + (0 if d1 is None else d1 * k) + (0 if d2 is None else d2 * k * k / 2),)
    net.forward = taylor
    return lambda: delattr(net, "forward")


@pytest.mark.parametrize("checkpoint,interval,order,guidance,steps,refs", [
    ("FLUX.2-klein-4B", 2, 1, 1.0, 6, 0), ("FLUX.2-klein-4B", 3, 2, 1.0, 7, 1),
    ("FLUX.2-klein-base-4B", 2, 2, 3.0, 6, 0)])
def test_taylorseer_equals_the_forecast_by_hand_on_the_pipeline(folders, klein, base, checkpoint, interval, order,
                                                               guidance, steps, refs):
    from test_flux2_references import picture

    engine, pipe = (klein if checkpoint == "FLUX.2-klein-4B" else base), folders[checkpoint][1]
    pictures = [picture(72, 88, 1)][:refs]
    kw = dict(num_inference_steps=steps, guidance_scale=guidance)
    got = images_together(engine, [_cache_kw({"method": "taylorseer", "interval": interval, "order": order},
                                             pictures, **kw)])[0]
    plain = images_together(engine, [_cache_kw(None, pictures, **kw)])[0]
    put_back = _taylorseer_by_hand(pipe.transformer, interval, order, 2 if guidance > 1 else 1)
    try:
        want = _pipe_image(pipe, steps, guidance, pictures)
    finally:
        put_back()
    assert np.abs(got - want).max() <= 1
    assert np.abs(got - plain).max() > 1  # it forecast something


class _FirstBlockByHand(torch.nn.Module):
    """The first-block rule in place of the transformer's blocks: the first double block runs; its image residual over
    the image's real tokens compared with the one kept from the last full evaluation (mean |r - r_prev| /
    mean |r_prev|); below the threshold the image tokens are the first block's output plus the kept remaining
    residual (the other blocks skipped), else the other double blocks and the single ones run and both residuals are
    kept. `singles` is the module that stands for the single blocks."""

    def __init__(self, net, threshold: float):
        super().__init__()
        self.doubles, self.threshold = net.transformer_blocks, threshold
        self.kept, self.reusing, self.log = None, False, []
        hand = self

        class Singles(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = net.single_transformer_blocks

            def forward(self, hidden_states, **kw):
                text = hidden_states.shape[1] - hand.h1.shape[1]
                if hand.reusing:
                    out = hidden_states.clone()
                    out[:, text:text + REAL] = hand.h1[:, :REAL] + hand.kept[1]
                    return out
                for block in self.blocks:
                    hidden_states = block(hidden_states=hidden_states, **kw)
                hand.kept = (hand.first, hidden_states[:, text:text + REAL] - hand.h1[:, :REAL])
                return hidden_states
        self.singles = Singles()

    def forward(self, hidden_states, encoder_hidden_states, **kw):
        c, h = self.doubles[0](hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, **kw)
        self.h1, self.first = h, (h - hidden_states)[:, :REAL]
        previous = None if self.kept is None else self.kept[0]
        self.reusing = previous is not None and bool(
            (self.first - previous).abs().mean() / previous.abs().mean() < self.threshold)
        self.log.append(self.reusing)
        if not self.reusing:
            for block in self.doubles[1:]:
                c, h = block(hidden_states=h, encoder_hidden_states=c, **kw)
        return c, h


@pytest.mark.parametrize("refs", [0, 1])
def test_first_block_equals_the_rule_by_hand_on_the_pipeline(folders, klein, refs):
    from test_flux2_references import picture

    pipe, net = folders["FLUX.2-klein-4B"][1], folders["FLUX.2-klein-4B"][1].transformer
    pictures = [picture(72, 88, 1)][:refs]
    cache = {"method": "first_block", "threshold": 1.05}  # the tiny random model's residuals move a lot
    got = images_together(klein, [_cache_kw(cache, pictures, num_inference_steps=8)])[0]
    plain = images_together(klein, [_cache_kw(None, pictures, num_inference_steps=8)])[0]
    doubles, singles = net.transformer_blocks, net.single_transformer_blocks
    hand = _FirstBlockByHand(net, cache["threshold"])
    net.transformer_blocks, net.single_transformer_blocks = torch.nn.ModuleList([hand]), torch.nn.ModuleList(
        [hand.singles])
    try:
        want = _pipe_image(pipe, 8, 1.0, pictures)
    finally:
        net.transformer_blocks, net.single_transformer_blocks = doubles, singles
    assert np.abs(got - want).max() <= 1
    assert 0 < sum(hand.log) < 7, hand.log  # it reused some evaluations, not all
    assert np.abs(got - plain).max() > 1


def test_off_changes_no_image_and_interval_1_or_threshold_0_is_the_uncached_image(klein):
    plain = images_together(klein, [_cache_kw(num_inference_steps=4)])[0]
    for cache in ("off", {"method": "taylorseer", "interval": 1, "order": 2}, {"method": "first_block",
                                                                               "threshold": 0}):
        np.testing.assert_array_equal(images_together(klein, [_cache_kw(cache, num_inference_steps=4)])[0], plain)


@pytest.mark.parametrize("checkpoint", ["FLUX.2-klein-4B", "FLUX.2-klein-base-4B"])
def test_cached_uncached_other_interval_first_block_and_reference_rows_together_equal_each_alone(klein, base,
                                                                                                 checkpoint):
    """Rows with and without references (two groups in one burst; the reference rows share a step), TaylorSeer at
    two intervals, first-block and uncached rows, guided and not on the base checkpoint."""
    from test_flux2_references import picture

    engine = klein if checkpoint == "FLUX.2-klein-4B" else base
    one, two = [picture(72, 88, 1)], [picture(72, 88, 1), picture(96, 64, 2)]
    fb = {"method": "first_block", "threshold": 1.05}
    requests = [_cache_kw({"method": "taylorseer", "interval": 2}, seed=1, num_inference_steps=6),
                _cache_kw(None, seed=2, num_inference_steps=5, guidance_scale=2.5),
                _cache_kw({"method": "taylorseer", "interval": 3, "order": 2}, one, seed=3, num_inference_steps=7,
                          guidance_scale=3.0),
                _cache_kw(fb, two, seed=4, num_inference_steps=8, height=96, width=160),
                _cache_kw(None, one, seed=5, num_inference_steps=4),
                _cache_kw(fb, seed=6, num_inference_steps=6, guidance_scale=2.0, prompt="a lighthouse at dusk")]
    if engine is klein:  # step-distilled: no guidance
        requests = [{k: v for k, v in r.items() if k != "guidance_scale"} for r in requests]
    alone = [images_together(engine, [r])[0] for r in requests]
    together = images_together(engine, requests)
    for i, (a, b) in enumerate(zip(alone, together)):
        assert np.abs(a - b).max() <= 1, i


BAD_CACHE = [({"method": "teacache"}, "step_cache.method", "taylorseer"),
             ({"method": "taylorseer", "interval": 0}, "step_cache.interval", "out of range"),
             ({"method": "first_block", "threshold": float("nan")}, "step_cache.threshold", "finite number"),
             ({"method": "deepcache", "interval": 3}, "step_cache.method", "UNet")]


def test_bad_step_cache_values_are_one_line_400s_naming_the_field(folders, klein):
    from diffgraph.server import ServerConfig
    from server_util import served

    for value, field, words in BAD_CACHE:
        with pytest.raises(ParamError) as e:
            klein.submit(GenerationRequest.create(model=klein.info, **_cache_kw(value, num_inference_steps=2)))
        assert e.value.param == field and words in str(e.value) and "\n" not in str(e.value), (value, str(e.value))
    path = folders["FLUX.2-klein-4B"][0]
    with Engine(model=path, device="cpu") as engine, served(engine, ServerConfig(model=path, device="cpu")) as client:
        for value, field, words in BAD_CACHE[:3]:
            body = {"prompt": "a fox", "size": "128x128", "step_cache": value}
            r = client.post("/v1/images/generations", content=json.dumps(body).replace("NaN", '"nan"'),  # JSON has no NaN
                            headers={"content-type": "application/json"})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == field, r.text
            assert words in error["message"] and "\n" not in error["message"]
        cached = {"method": "taylorseer", "interval": 2}
        r = client.post("/v1/images/generations", json={"prompt": CACHE_KW["prompt"], "size": "128x128",
                                                       "seed": 7, "num_inference_steps": 4, "step_cache": cached,
                                                       "response_format": "b64_json"})
        assert r.status_code == 200, r.text
    from PIL import Image
    import base64
    import io
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).convert("RGB"))
    want = images_together(klein, [_cache_kw(cached, num_inference_steps=4)])[0]
    assert np.abs(got.astype(np.int16) - want).max() <= 1


def test_in_graph_mode_cache_rows_after_plain_ones_replay_their_own_graphs_and_equal_the_eager_engine(folders, klein):
    """The group's step graphs are captured over its buffers by a plain request, before any cache row allocated the
    cache's (lazy) fields; TaylorSeer rows then replay their own variants, captured at first use, and equal the eager
    engine's images."""
    from diffgraph import GraphConfig

    path = folders["FLUX.2-klein-4B"][0]
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((128, 128),), backend="emulated",
                      capture_text_encoder=False)
    requests = [_cache_kw(seed=2, num_inference_steps=4),
                _cache_kw({"method": "taylorseer", "interval": 2}, seed=1, num_inference_steps=5),
                _cache_kw({"method": "taylorseer", "interval": 3, "order": 2}, seed=3, num_inference_steps=6)]
    with Engine(model=path, device="cpu", mode="graph", graphs=cfg) as graphed:
        buffers = graphed.runner.groups[(0, 256)]  # a graphed group's buffers are kept
        images_together(graphed, requests[:1])
        assert buffers.fields["taylor.terms"].shape[0] == 0 and buffers.fields["fbc.kept"].shape[0] == 0
        got = images_together(graphed, requests)
        assert buffers.fields["taylor.terms"].shape[0] == buffers.num_rows and buffers.fields["fbc.kept"].numel() == 0
        graphed.core.call_between_steps(lambda: None).result()
        table = [r for r in graphed.runner.graph_table() if r["kind"].startswith("step")]
    assert not any(r["eager_fallbacks"] for r in table)
    assert any(r["replays"] for r in table if r["kind"] == "step")
    assert any(r["replays"] for r in table if r["kind"].startswith("step_step_cache_run")), table
    for r, image in zip(requests, got):
        assert np.abs(image - images_together(klein, [r])[0]).max() <= 1
