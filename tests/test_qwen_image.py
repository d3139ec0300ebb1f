"""Qwen-Image (models/families/qwen_image.py) against its oracle, diffusers' `QwenImagePipeline`, on a tiny random
folder.

One tiny architecture (two double-stream blocks 32 wide, a two-layer Qwen2.5-VL with Qwen's vocabulary and the
shipped Qwen2.5 tokenizer, a narrow Qwen-Image VAE with the published per-channel latents mean and std), saved with
save_pretrained as the published folder is, with Qwen-Image's scheduler config (dynamic shift, shift_terminal 0.02).
fp32 on the CPU: each image within one uint8 level of the pipeline's with the same seed, with and without true CFG
(the pipeline's per-token norm rescale; " " as the negative prompt where the request has none); rows of different
prompt lengths, sizes of one token bucket, steps and guidance run in one step and each equals its request alone.
ComfyUI's split files, and the transformer as a GGUF (F16, Q8_0), give the folder's image within their bound.
"""

import io
import json

import numpy as np
import pytest
import torch

from diffgraph import Engine, GenerationRequest, ParamError
from diffgraph.models.families.qwen_image import (DROPPED, LIGHTNING, SCHEDULER, TEMPLATE, tiny_encoder,
                                                  tiny_transformer, tiny_vae)
from diffgraph.models.qwen_tokenizer import qwen_tokenizer
from diffgraph.sampling.flow import FlowSchedule
from diffgraph.text.prepared import prepare

from loop_util import calls_per_request, images_together

SIZES = [(64, 64), (64, 96), (96, 64)]  # 16, 24 and 24 tokens (16 px each): one bucket of 256


def pipeline(vae: dict | None = None):
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(**tiny_transformer())
    with torch.no_grad():  # at its initial scale the prompt moves the tiny model's image by a level or two
        for p in transformer.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**tiny_encoder()))
    vae = AutoencoderKLQwenImage(**(vae or tiny_vae()))
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae.eval(),
                             text_encoder=encoder.eval(), tokenizer=qwen_tokenizer("qwen2.5"),
                             transformer=transformer.eval())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen") / "Qwen-Image"
    pipe = pipeline()
    pipe.save_pretrained(str(path))
    return str(path), pipe


@pytest.fixture(scope="module")
def qwen(folder):
    with Engine(model=folder[0], device="cpu") as e:
        yield e


def oracle(pipe, prompt: str, size: tuple[int, int], steps: int, guidance: float, seed: int,
           negative: str | None = None) -> np.ndarray:
    """diffusers' image: guidance is the pipeline's true_cfg_scale; above 1 without a negative prompt it guides with
    " " (the pipeline's documented usage, which the engine follows)."""
    if guidance > 1 and negative is None:
        negative = " "
    image = pipe(prompt=prompt, negative_prompt=negative, height=size[0], width=size[1], num_inference_steps=steps,
                 true_cfg_scale=guidance, generator=torch.Generator().manual_seed(seed), output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


@pytest.mark.parametrize("size", [(64, 64), (64, 96)])
def test_text_to_image_equals_the_pipeline_without_guidance(folder, qwen, size):
    got = images_together(qwen, [dict(prompt="a red fox in the snow", height=size[0], width=size[1],
                                      num_inference_steps=3, guidance_scale=1.0, seed=7)])[0]
    want = oracle(folder[1], "a red fox in the snow", size, 3, 1.0, 7)
    assert got.shape == (*size, 3) and np.abs(got - want).max() <= 1
    assert qwen.info.family == "qwen-image" and qwen.info.default_steps == 50 and qwen.info.default_guidance == 4.0


def test_true_cfg_equals_the_pipeline_with_and_without_a_negative_prompt(folder, qwen):
    """A negative prompt as given; none: " " (never one row, never ""); each within a level of the pipeline's, and
    the guidance shows."""
    pipe = folder[1]
    requests = [dict(prompt="a red fox", negative_prompt="snow at dusk", height=64, width=64, num_inference_steps=2,
                     guidance_scale=3.0, seed=5),
                dict(prompt="a red fox", height=64, width=64, num_inference_steps=2, guidance_scale=4.0, seed=5)]
    got = [images_together(qwen, [r])[0] for r in requests]
    for r, image in zip(requests, got):
        want = oracle(pipe, r["prompt"], (64, 64), 2, r["guidance_scale"], 5, r.get("negative_prompt"))
        assert np.abs(image - want).max() <= 1, r
    plain = oracle(pipe, "a red fox", (64, 64), 2, 1.0, 5)
    assert np.abs(got[1] - plain).max() > 3
    blank = oracle(pipe, "a red fox", (64, 64), 2, 4.0, 5, negative="")
    assert np.abs(got[1] - blank).max() > 0  # " " is not ""


def test_a_step_gathers_the_rows_rotary_tables_and_builds_none(qwen, monkeypatch):
    """A row's RoPE tables are per-row state, built with its group's per-size fields (once, twice where the group's
    buffers are new), never in a step: a request of 2 steps and one of 4 build no more than those (a step that built
    them would make 2 and 4)."""
    from diffgraph.models.families import qwen_image

    request = dict(prompt="a red fox", height=80, width=64, guidance_scale=1.0)  # a size no other test runs
    (first, two), (again, four) = calls_per_request(qwen, monkeypatch, qwen_image, "row_rope", request, (2, 4))
    assert (two, four) == (2, 4) and first in (1, 2) and again <= first


def test_mixed_rows_share_a_step_and_each_equals_the_pipeline(folder, qwen):
    """Prompts of 2 and 30 words, three sizes of one token bucket, 2/3 steps, guidance off, on without a negative
    prompt and on with one: submitted together, each equals diffusers' image of its request alone."""
    pipe = folder[1]
    long = ", ".join(["a lighthouse on a cliff at dusk"] * 5)
    requests = [dict(prompt="red fox", height=SIZES[0][0], width=SIZES[0][1], num_inference_steps=3,
                     guidance_scale=1.0, seed=1),
                dict(prompt=long, negative_prompt="snow", height=SIZES[1][0], width=SIZES[1][1],
                     num_inference_steps=2, guidance_scale=2.5, seed=2),
                dict(prompt="a red fox at dusk", height=SIZES[2][0], width=SIZES[2][1], num_inference_steps=3,
                     guidance_scale=4.0, seed=3)]
    adapter = qwen.model.adapter
    assert {adapter.group_key(qwen.model, s, 40) for s in SIZES} == {(128, 256)}
    # the slot counts the tokens a row holds: the template's dropped system prompt is not among them
    made = [GenerationRequest.create(model=qwen.info, **r) for r in requests]
    assert [qwen.runner.group_key(m.key, prepare(qwen.runner.text_setup, m)) for m in made] == [(128, 256)] * 3
    wide = GenerationRequest.create(model=qwen.info, prompt="fox " * 110, height=64, width=64)
    held = len(qwen_tokenizer("qwen2.5")(TEMPLATE[0] + "fox " * 110 + TEMPLATE[1]).input_ids) - DROPPED
    assert held <= 128 < held + DROPPED
    assert qwen.runner.group_key(wide.key, prepare(qwen.runner.text_setup, wide)) == (128, 256)
    got = images_together(qwen, requests)
    for r, image in zip(requests, got):
        want = oracle(pipe, r["prompt"], (r["height"], r["width"]), r["num_inference_steps"],
                      r["guidance_scale"], r["seed"], r.get("negative_prompt"))
        assert image.shape == (r["height"], r["width"], 3)
        assert np.abs(image - want).max() <= 1, r


def test_the_schedule_is_the_pipeline_s_shift_with_its_terminal(folder):
    """sigmas of 2 and 50 steps at 16, 4096 and 6889 tokens (1328 x 1328) equal the scheduler's with the pipeline's
    mu (calculate_shift), stretched to shift_terminal."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    pipe = folder[1]
    schedule = FlowSchedule.from_config(dict(SCHEDULER))
    for tokens, steps in ((16, 2), (4096, 50), (6889, 50)):
        mu = calculate_shift(tokens, 256, 8192, 0.5, 0.9)
        pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        want = pipe.scheduler.sigmas.numpy()
        got = schedule.sigmas(steps, tokens)
        assert np.abs(got - want).max() < 1e-6 and abs(got[-2] - 0.02) < 1e-9


def test_the_template_drops_the_system_prompt():
    """The pipeline's prompt_template_encode_start_idx (34) is its system message's token count in the shipped
    tokenizer: what remains is the prompt and the template's tail."""
    tokenizer = qwen_tokenizer("qwen2.5")
    ids = tokenizer(TEMPLATE[0] + "a red fox" + TEMPLATE[1]).input_ids
    assert len(tokenizer(TEMPLATE[0]).input_ids) == DROPPED
    assert tokenizer.decode(ids[DROPPED:]) == "a red fox" + TEMPLATE[1]


def test_it_refuses_what_it_does_not_read(qwen):
    with pytest.raises(ParamError) as e:
        GenerationRequest.create(prompt="fox", sampler="heun", height=64, width=64, model=qwen.info)
    assert e.value.param == "sampler" and "flow_euler, flow_euler_a, flow_dpmpp_2m" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ParamError) as e:
        GenerationRequest.create(prompt="fox", height=64, width=72, model=qwen.info)
    assert e.value.param == "width" and "16" in str(e.value)


def test_a_prompt_beyond_1024_tokens_is_refused_naming_its_count(qwen):
    """1024 tokens after the dropped system prompt, as the pipeline reads at most: a longer prompt is a ParamError
    (HTTP 400) naming the count and the limit."""
    long = GenerationRequest.create(prompt="fox " * 1100, height=64, width=64, num_inference_steps=1,
                                    model=qwen.info)
    with pytest.raises(ParamError) as e:
        qwen.submit(long)
    assert e.value.param == "prompt" and "at most 1024" in str(e.value)
    ids = qwen_tokenizer("qwen2.5")(TEMPLATE[0] + "fox " * 1100 + TEMPLATE[1]).input_ids
    assert int(str(e.value).split()[2]) == len(ids) - DROPPED > 1100  # the prompt and the template's tail


def test_the_tiny_preset_is_served_over_http():
    """`random:qwen-image-tiny` on the OpenAI route: an image of the asked size; `true_cfg_scale`-free defaults from
    the checkpoint; an SD sampler is a one-line 400 listing the family's."""
    import base64

    from PIL import Image

    from diffgraph.server import ServerConfig
    from server_util import served

    name = "random:qwen-image-tiny"
    with served(Engine(model=name, device="cpu"), ServerConfig(model=name, device="cpu")) as client:
        card = client.get("/v1/models").json()["data"][0]
        assert (card["default_steps"], card["default_guidance"]) == (50, 4.0)
        answer = client.post("/v1/images/generations", json={"prompt": "a red fox", "size": "96x64", "seed": 3,
                                                              "num_inference_steps": 2})
        assert answer.status_code == 200, answer.text
        image = Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))
        assert image.size == (96, 64)
        # true_cfg_scale (vLLM-Omni's name) is guidance_scale: the same image; both, unequal, a 400 naming it
        alias = [client.post("/v1/images/generations", json={"prompt": "a red fox", "size": "64x64", "seed": 3,
                                                              "num_inference_steps": 2, key: 2.5}).json()
                 for key in ("true_cfg_scale", "guidance_scale")]
        assert alias[0]["data"][0]["b64_json"] == alias[1]["data"][0]["b64_json"]
        both = client.post("/v1/images/generations", json={"prompt": "a red fox", "size": "64x64",
                                                           "true_cfg_scale": 2.5, "guidance_scale": 3.0})
        assert both.status_code == 400 and both.json()["error"]["param"] == "true_cfg_scale"
        # AUTOMATIC1111's txt2img: cfg_scale is the true CFG scale, 'Euler' the family's flow Euler
        a1111 = client.post("/sdapi/v1/txt2img", json={"prompt": "a red fox", "negative_prompt": "snow", "width": 64,
                                                       "height": 64, "steps": 2, "cfg_scale": 3, "seed": 3,
                                                       "sampler_name": "Euler"})
        assert a1111.status_code == 200, a1111.text
        info = json.loads(a1111.json()["info"])
        assert (info["steps"], info["cfg_scale"], info["sampler_name"]) == (2, 3.0, "flow_euler")
        bad = client.post("/v1/images/generations", json={"prompt": "a red fox", "size": "64x64",
                                                          "sampler": "DPM++ SDE"})
        assert bad.status_code == 400 and "flow_euler, flow_euler_a, flow_dpmpp_2m" in bad.text
        assert "\n" not in json.dumps(bad.json())


def test_graph_mode_replays_the_bucket_s_step_graphs(folder):
    """In graph mode (the CPU's emulated graphs, verified against eager at capture) a guided row and an unguided one
    of two sizes replay the step graphs of their group, (128, 256); each image equals the pipeline's."""
    from diffgraph import GraphConfig

    path, pipe = folder
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=tuple(SIZES[:2]), prewarm=False, verify=True,
                      backend="emulated", capture_text_encoder=False)
    requests = [dict(prompt="red fox", height=SIZES[0][0], width=SIZES[0][1], num_inference_steps=2,
                     guidance_scale=1.0, seed=1),
                dict(prompt="a lighthouse", negative_prompt="snow", height=SIZES[1][0], width=SIZES[1][1],
                     num_inference_steps=2, guidance_scale=2.5, seed=2)]
    with Engine(model=path, device="cpu", mode="graph", graphs=cfg) as graphed:
        got = images_together(graphed, requests)
        table = graphed.runner.graph_table()
    steps = [row for row in table if row["kind"] == "step" and row["replays"]]
    assert steps and {(row["height"], row["width"]) for row in steps} == {(128, 256)}, table
    assert all(row["verify_max_abs"] is not None and row["verify_max_abs"] < 1e-4 for row in steps)
    for r, image in zip(requests, got):
        want = oracle(pipe, r["prompt"], (r["height"], r["width"]), r["num_inference_steps"], r["guidance_scale"],
                      r["seed"], r.get("negative_prompt"))
        assert np.abs(image - want).max() <= 1, r


def wan_original(state: dict) -> dict:
    """AutoencoderKLQwenImage's state dict in Wan 2.1's original names (ComfyUI's qwen_image_vae.safetensors), the
    published layout (four levels, two resnets each): the inverse of diffusers' `convert_wan_vae_to_diffusers`."""
    resnet = {"norm1.gamma": "residual.0.gamma", "conv1.": "residual.2.", "norm2.gamma": "residual.3.gamma",
              "conv2.": "residual.6.", "conv_shortcut.": "shortcut."}
    top = {"quant_conv.": "conv1.", "post_quant_conv.": "conv2.", "encoder.conv_in.": "encoder.conv1.",
           "decoder.conv_in.": "decoder.conv1.", "encoder.norm_out.": "encoder.head.0.",
           "encoder.conv_out.": "encoder.head.2.", "decoder.norm_out.": "decoder.head.0.",
           "decoder.conv_out.": "decoder.head.2."}
    out = {}
    for key, value in state.items():
        new = next((key.replace(a, b, 1) for a, b in top.items() if key.startswith(a)), None)
        parts = key.split(".")
        if new is None and ".mid_block.attentions.0." in key:
            new = key.replace("mid_block.attentions.0", "middle.1")
        elif new is None and ".mid_block.resnets." in key:
            new = f"{parts[0]}.middle.{2 * int(parts[3])}." + ".".join(parts[4:])
        elif new is None and key.startswith("encoder.down_blocks."):
            new = "encoder.downsamples." + ".".join(parts[2:])
        elif new is None and ".upsamplers.0." in key:
            new = f"decoder.upsamples.{4 * int(parts[2]) + 3}." + ".".join(parts[5:])
        elif new is None and key.startswith("decoder.up_blocks."):
            new = f"decoder.upsamples.{4 * int(parts[2]) + int(parts[4])}." + ".".join(parts[5:])
        if ".resample." not in new and ".time_conv." not in new and ("middle.1." not in new):
            for a, b in resnet.items():
                tail = new.split(".", 3)[-1] if new.startswith(("encoder.downsamples", "decoder.upsamples",
                                                                "encoder.middle", "decoder.middle")) else ""
                if tail.startswith(a):
                    new = new[:len(new) - len(tail)] + b + tail[len(a):]
                    break
        out[new] = value.contiguous()
    return out


def test_the_vae_reads_from_comfyui_s_file_and_diffusers_names(tmp_path):
    """A VAE of the published layout (narrow) written in Wan 2.1's original names, as ComfyUI ships
    qwen_image_vae.safetensors, and in diffusers' names: each loads through `qwen_image_files` into a module whose
    every tensor equals the source's, the config derived from the file; another kind of file is a one-line error
    naming what it is."""
    from diffusers import AutoencoderKLQwenImage
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    from safetensors.torch import save_file

    from diffgraph.models import qwen_image_files as qf, split_stream

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                 temperal_downsample=[False, True, True])
    state = vae.state_dict()
    original = wan_original(state)
    assert "decoder.upsamples.4.shortcut.weight" in original and "encoder.conv1.weight" in original
    back = convert_wan_vae_to_diffusers(dict(original))
    assert set(back) == set(state)  # the inverse is diffusers' map's
    for name, tensors in (("qwen_image_vae.safetensors", original), ("diffusers_vae.safetensors", state)):
        path = str(tmp_path / name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
        config = qf.vae_config(path)
        assert config["base_dim"] == 8 and config["z_dim"] == 16
        loaded = split_stream.load_vae(AutoencoderKLQwenImage, config,
                                       lambda c, p=path: qf.read_vae(p, c, torch.float32), torch.float32, "cpu")
        got = loaded.state_dict()
        assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state), name
    flux = str(tmp_path / "ae.safetensors")
    save_file({"encoder.conv_in.weight": torch.zeros(8, 3, 3, 3), "decoder.conv_in.weight": torch.zeros(8, 16, 3, 3)},
              flux)
    with pytest.raises(ValueError, match="is a FLUX.1 VAE .*, not a Qwen-Image \\(Wan 2.1\\) VAE; give") as e:
        qf.read_vae(flux, qf.vae_config(flux), torch.float32)
    assert "\n" not in str(e.value)


def test_comfyui_split_files_equal_the_pipeline(tmp_path):
    """The transformer under `model.diffusion_model.`, the Qwen2.5-VL encoder as the causal LM saved it before
    transformers 4.52 (`model.layers.*`, `visual.*`, `lm_head`), the VAE (the published layout, narrow) in Wan 2.1's
    names, as three files: loaded by the family (configs from their shapes, its language model alone, the shipped
    tokenizer) the image equals the pipeline's on the same modules, with true CFG."""
    from safetensors.torch import save_file

    from diffgraph.models.families import QwenImageFamily
    from diffgraph.models.split_files import SPLIT_KINDS, SplitFiles

    pipe = pipeline(vae=dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                             temperal_downsample=[False, True, True]))
    paths = [str(tmp_path / n) for n in ("qwen_image_tiny.safetensors", "qwen_2.5_vl_tiny.safetensors",
                                         "qwen_image_vae.safetensors")]
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in pipe.transformer.state_dict().items()},
              paths[0])
    encoder = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v.clone()
               for k, v in pipe.text_encoder.state_dict().items()}
    assert "visual.patch_embed.proj.weight" in encoder and "model.layers.0.self_attn.q_proj.bias" in encoder
    save_file(encoder, paths[1])
    save_file(wan_original(pipe.vae.state_dict()), paths[2])
    kind = next(k for k in SPLIT_KINDS if k.family == "qwen-image")
    model = QwenImageFamily().load_split(SplitFiles(kind, *paths, ()), torch.device("cpu"), torch.float32, paths[0])
    assert type(model.text_encoders[0]).__name__ == "Qwen2_5_VLTextModel"
    with Engine(model=model) as engine:
        got = images_together(engine, [dict(prompt="a red fox", negative_prompt="snow", height=64, width=96,
                                            num_inference_steps=2, guidance_scale=3.0, seed=4)])[0]
        assert engine.info.default_steps == 50
    assert np.abs(got - oracle(pipe, "a red fox", (64, 96), 2, 3.0, 4, "snow")).max() <= 1


def split_files(root, name: str, transformer: dict, encoder: dict, vae: dict, qtype=None) -> tuple[list, dict]:
    """A model's three files in ComfyUI's folders under `root`: the transformer as `diffusion_models/NAME` (under
    `model.diffusion_model.`, or with a GGUF `qtype` as city96's GGUF of diffusers' names), the Qwen2.5-VL encoder as
    ComfyUI's file (`model.*`, `visual.*`, a causal LM's `lm_head`) from a Qwen2_5_VLModel's or a causal LM's state,
    the VAE in diffusers' names (the tiny layout: Wan 2.1's names are read by diffusers' map of the published one).
    Returns the three paths and each transformer tensor as the file holds it (dequantised: GGUF)."""
    from safetensors.torch import save_file

    from test_zimage_files import write_gguf

    for sub in ("diffusion_models", "text_encoders", "vae"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    paths = [str(root / "diffusion_models" / name), str(root / "text_encoders" / "qwen_2.5_vl_tiny.safetensors"),
             str(root / "vae" / "qwen_image_vae.safetensors")]
    held = {k: v.float() for k, v in transformer.items()}
    if qtype is None:
        save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in transformer.items()}, paths[0])
    else:
        held = write_gguf(paths[0], {k: v.contiguous() for k, v in transformer.items()}, qtype)
    comfy = {}
    for key, value in encoder.items():
        key = key.removeprefix("model.")
        comfy[key if key.startswith(("visual.", "lm_head.")) else "model." + key.removeprefix("language_model.")] = \
            value.clone().contiguous()
    save_file(comfy, paths[1])
    save_file({k: v.contiguous() for k, v in vae.items()}, paths[2])
    return paths, held


@pytest.mark.parametrize("qtype,bound", [("F16", 1), ("Q8_0", 2)])
def test_a_gguf_transformer_gives_the_folder_s_image(folder, qwen, tmp_path, qtype, bound):
    """The folder's transformer as city96's GGUF (F16, or Q8_0: 8-bit blocks of 32 with an f16 scale; small and 1-D
    tensors F32) beside ComfyUI's encoder and VAE files (the tiny VAE's levels read from its file): loaded by the
    family, each tensor dequantised as it is read, its image under true CFG is within `bound` uint8 levels of the
    folder's fp32 image (F16: one level, as a 16-bit folder's; Q8_0: two levels, its weights within half a step of
    their block's scale), though the file was quantised."""
    import gguf

    from diffgraph.models.families import QwenImageFamily
    from diffgraph.models.split_files import SPLIT_KINDS, SplitFiles

    pipe = folder[1]
    paths, held = split_files(tmp_path, f"qwen-image-tiny-{qtype}.gguf", pipe.transformer.state_dict(),
                              pipe.text_encoder.state_dict(), pipe.vae.state_dict(), gguf.GGMLQuantizationType[qtype])
    kind = next(k for k in SPLIT_KINDS if k.name == "qwen-image")
    model = QwenImageFamily().load_split(SplitFiles(kind, *paths, ()), torch.device("cpu"), torch.float32, paths[0])
    loaded = model.denoiser.state_dict()
    assert all(torch.equal(loaded[k], held[k]) for k in held)
    assert any(not torch.equal(held[k], v) for k, v in pipe.transformer.state_dict().items())
    r = dict(prompt="a red fox", negative_prompt="snow", height=64, width=96, num_inference_steps=2,
             guidance_scale=3.0, seed=4)
    with Engine(model=model) as engine:
        got = images_together(engine, [r])[0]
    assert np.abs(got - images_together(qwen, [r])[0]).max() <= bound


def test_a_peft_lora_runs_per_row_and_equals_diffusers(folder, tmp_path):
    """A rank-4 adapter on both blocks' attention, feed-forwards and modulation (diffusers / PEFT keys): a row with it
    and a row without, in one step, equal the pipeline with diffusers' load_lora_weights at the same scale and the
    pipeline without; an SD LoRA is a one-line refusal naming it."""
    from safetensors.torch import save_file

    path, pipe = folder
    g = torch.Generator().manual_seed(21)
    state = {}
    for block in range(2):
        for module in ("attn.to_q", "attn.add_k_proj", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.0.proj",
                       "img_mod.1"):
            linear = pipe.transformer.get_submodule(f"transformer_blocks.{block}.{module}")
            state[f"transformer.transformer_blocks.{block}.{module}.lora_A.weight"] = \
                torch.randn((4, linear.in_features), generator=g) * 0.3
            state[f"transformer.transformer_blocks.{block}.{module}.lora_B.weight"] = \
                torch.randn((linear.out_features, 4), generator=g) * 0.3
    save_file(state, str(tmp_path / "fox.safetensors"))
    sd = "lora_unet_down_blocks_0_attentions_0_proj_in"
    save_file({f"{sd}.lora_down.weight": torch.ones(4, 320), f"{sd}.lora_up.weight": torch.ones(320, 4)},
              str(tmp_path / "sd_style.safetensors"))
    common = dict(prompt="a red fox", height=64, width=64, num_inference_steps=2, guidance_scale=1.0, seed=6)
    with Engine(model=path, device="cpu", lora_dir=str(tmp_path)) as engine:
        got = images_together(engine, [dict(common, loras=[("fox", 0.8)]), common])
        with pytest.raises(ParamError) as e:
            engine.submit(GenerationRequest.create(model=engine.info, **common, loras=[("sd_style", 1.0)])).result()
        assert "sd_style" in str(e.value) and "\n" not in str(e.value)
    pipe.load_lora_weights(str(tmp_path / "fox.safetensors"), adapter_name="fox")
    pipe.set_adapters(["fox"], [0.8])
    try:
        want = oracle(pipe, "a red fox", (64, 64), 2, 1.0, 6)
    finally:
        pipe.unload_lora_weights()
    plain = oracle(pipe, "a red fox", (64, 64), 2, 1.0, 6)
    assert np.abs(got[0] - want).max() <= 1 and np.abs(got[1] - plain).max() <= 1
    assert np.abs(want - plain).max() > 3


def test_the_lightning_schedule_runs_per_row_as_its_release_samples(folder, qwen):
    """schedule "lightning" (the Lightning LoRAs' scheduler: mu = log 3 at every size, no terminal): its sigmas are
    the release's scheduler's at 256 and 16384 tokens; a 2-step unguided Lightning row beside a 3-step CFG row of the
    model's schedule, in one step, equals the pipeline with that scheduler, the other the pipeline's own."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    lightning = FlowMatchEulerDiscreteScheduler(**LIGHTNING)
    for size, steps in (((256, 256), 2), ((2048, 2048), 8)):
        lightning.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=np.log(3))
        got = qwen.model.adapter.planner(qwen.model)("flow_euler", "lightning", steps, size).sigmas
        assert np.abs(np.asarray(got) - lightning.sigmas.numpy()).max() < 1e-6
    requests = [dict(prompt="a red fox", height=64, width=64, num_inference_steps=2, guidance_scale=1.0, seed=8,
                     schedule="lightning"),
                dict(prompt="a red fox", height=64, width=96, num_inference_steps=3, guidance_scale=3.0, seed=9)]
    got = images_together(qwen, requests)
    pipe = folder[1]
    own = pipe.scheduler
    pipe.scheduler = lightning
    try:
        want = oracle(pipe, "a red fox", (64, 64), 2, 1.0, 8)
    finally:
        pipe.scheduler = own
    assert np.abs(got[0] - want).max() <= 1
    assert np.abs(got[1] - oracle(pipe, "a red fox", (64, 96), 3, 3.0, 9)).max() <= 1
    assert np.abs(want - oracle(pipe, "a red fox", (64, 64), 2, 1.0, 8)).max() > 0  # the schedules differ


def test_the_fp8_tier_takes_the_blocks_linears_and_leaves_the_rest_in_16_bits():
    """Both streams' attention projections and feed-forwards in fp8; the embedders, the modulation layers, the
    timestep embedder and the final projection not."""
    from diffusers import QwenImageTransformer2DModel

    from diffgraph.models.families.qwen_image import FP8_LINEARS
    from diffgraph.quantize.fp8 import SkipReason, named_linears, quantize_linears

    module = QwenImageTransformer2DModel(**tiny_transformer())
    report = quantize_linears(module, min_features=16, select=named_linears(FP8_LINEARS))
    assert {n.split(".", 2)[2] for n in report.quantized} == set(FP8_LINEARS)
    assert {n.split(".")[0] for n in report.quantized} == {"transformer_blocks"}
    left = {n for n, why in report.skipped if why is SkipReason.NOT_SELECTED}
    assert {"img_in", "txt_in", "proj_out", "transformer_blocks.0.img_mod.1", "norm_out.linear"} <= left


@pytest.mark.parametrize("form", ["scaled_fp8", "Q8_0"])
def test_fp8_and_gguf_transformer_files_load_as_their_dequantised_weights(tmp_path, form):
    """The tiny transformer as ComfyUI's scaled fp8 file (every 2-D weight e4m3 with its per-row scale) and as a
    city96-style GGUF (Q8_0): streamed by the family's split loader, every tensor equals the file's dequantised one;
    the encoder file beside it loads as in the bf16 case."""
    import gguf
    from diffusers import QwenImageTransformer2DModel
    from safetensors.torch import save_file
    from test_zimage_files import E4M3, _quantised, write_gguf
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from diffgraph.models import split_stream

    torch.manual_seed(5)
    state = {k: v.contiguous() for k, v in QwenImageTransformer2DModel(**tiny_transformer()).state_dict().items()}
    if form == "Q8_0":
        path = str(tmp_path / "qwen-image-tiny-Q8_0.gguf")
        want = write_gguf(path, state, gguf.GGMLQuantizationType.Q8_0)
    else:
        fp8, want = _quantised(dict(state), True)
        tensors = {f"model.diffusion_model.{k}": v for k, v in state.items()}
        for key, (q, scale) in fp8.items():
            tensors[f"model.diffusion_model.{key}"] = q
            tensors[f"model.diffusion_model.{key.removesuffix('.weight')}.weight_scale"] = scale
        tensors["model.diffusion_model.scaled_fp8"] = torch.empty(0, dtype=E4M3)
        path = str(tmp_path / "qwen_image_tiny_fp8_e4m3fn.safetensors")
        save_file(tensors, path)
    encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**tiny_encoder()))
    text = str(tmp_path / "qwen_2.5_vl_tiny.safetensors")
    save_file({k: v.clone() for k, v in encoder.state_dict().items()}, text)
    transformer, _ = split_stream.load_qwen_image(path, text, torch.float32, "cpu")
    got = transformer.state_dict()
    assert set(got) == set(state)
    assert max(float((got[k] - want[k].float()).abs().max()) for k in state) == 0.0
    assert any(not torch.equal(want[k].float(), state[k]) for k in state)  # the file was quantised


def test_a_variant_transformer_is_refused_in_one_line(folder, tmp_path):
    """An Edit-2511 transformer (zero_cond_t: its reference tokens modulated apart) in a QwenImagePipeline folder is a
    one-line error naming what is read, not images made without its per-token modulation."""
    import os
    import shutil

    path = tmp_path / "Qwen-Image-2511"
    path.mkdir()
    for sub in os.listdir(folder[0]):
        if sub != "transformer":
            os.symlink(os.path.join(folder[0], sub), path / sub)
    shutil.copytree(os.path.join(folder[0], "transformer"), path / "transformer")
    config = json.loads((path / "transformer" / "config.json").read_text())
    (path / "transformer" / "config.json").write_text(json.dumps({**config, "zero_cond_t": True}))
    with pytest.raises(ValueError, match="Edit-2511, Layered or guidance-distilled variant.*QwenImagePipeline") as e:
        Engine(model=str(path), device="cpu")
    assert "\n" not in str(e.value)


def test_above_the_native_area_the_vae_decodes_in_its_tiles(folder, qwen):
    """Above the native area (128 x 128 for the tiny preset's checkpoint; 1328 x 1328 for Qwen-Image) the one-frame
    VAE decodes in its own tiles (256 px, stride 192, blended) as the pipeline with `vae.enable_tiling()` does."""
    pipe = folder[1]
    assert qwen.model.native_size == 1328 and qwen.model.adapter.tiles(qwen.model, (1344, 1344))
    qwen.model.native_size = 128  # (the tiny test at a tiny size: 320 x 320 is then above it)
    try:
        got = images_together(qwen, [dict(prompt="a red fox", height=320, width=320, num_inference_steps=2,
                                          guidance_scale=1.0, seed=2)])[0]
    finally:
        qwen.model.native_size = 1328
    pipe.vae.enable_tiling()
    try:
        want = oracle(pipe, "a red fox", (320, 320), 2, 1.0, 2)
    finally:
        pipe.vae.disable_tiling()
    assert np.abs(got - want).max() <= 1
    assert np.abs(want - oracle(pipe, "a red fox", (320, 320), 2, 1.0, 2)).max() > 0  # the tiles show


def test_the_engine_s_diffusers_pipeline_is_the_oracle_on_its_own_modules(qwen):
    """`Engine.diffusers_pipeline("flow_euler")` builds QwenImagePipeline on the engine's modules (the encoder without
    its head, no copies): its image equals the engine's, with true CFG."""
    pipe = qwen.diffusers_pipeline("flow_euler")
    assert pipe.transformer is qwen.model.denoiser and pipe.text_encoder is qwen.model.text_encoders[0]
    got = images_together(qwen, [dict(prompt="a red fox", negative_prompt="snow", height=64, width=96,
                                      num_inference_steps=2, guidance_scale=3.0, seed=4)])[0]
    assert np.abs(got - oracle(pipe, "a red fox", (64, 96), 2, 3.0, 4, "snow")).max() <= 1
