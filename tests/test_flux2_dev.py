"""FLUX.2 dev (models/families/flux2_dev.py) against its oracle, diffusers' `Flux2Pipeline`, on a tiny random folder.

One folder "FLUX.2-dev" saved with save_pretrained as the published one is: a transformer of one double and one single
block with the guidance embedder, a 31-layer 16-wide Mistral3 (its language model read at layers 10, 20 and 30) with
the byte-level Tekken tokenizer, a four-level FLUX.2 VAE with batch-norm statistics that are not the identity. fp32 on
the CPU: each image within one uint8 level of the pipeline's with the same seed, at two guidance values and with a
reference image; rows of different guidance values, steps, sizes and references run together and each equals its
request alone.
"""

import json

import numpy as np
import pytest
import torch

from diffgraph import Engine, GenerationRequest, ParamError
from diffgraph.models.families.flux2 import SCHEDULER, tiny_transformer, tiny_vae
from diffgraph.models.families.flux2_dev import tiny_mistral3
from diffgraph.models.mistral_tokenizer import SYSTEM_MESSAGE, chat_prompt, tekken_bytes_tokenizer

from loop_util import images_together
from test_flux2 import lora_files
from test_flux2_references import picture

PROMPT = "a red fox in the snow"
REFERENCE = picture(72, 88, 1)  # cropped to 64x80 by both: 20 reference tokens
# rows of different guidance values, steps and sizes (one token bucket), one with a reference image
REQUESTS = (dict(prompt=PROMPT, height=128, width=128, num_inference_steps=3, guidance_scale=2.5, seed=7),
            dict(prompt="a lighthouse on a cliff at dusk", height=96, width=160, num_inference_steps=2,
                 guidance_scale=6.0, seed=8),
            dict(prompt=PROMPT, height=128, width=128, num_inference_steps=2, seed=9,
                 extras={"reference_images": [REFERENCE]}))


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    """(engine on the saved folder with klein's test LoRA files in its LoRA folder, the pipeline it was saved from,
    those files by layout)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(**{**tiny_transformer(text_width=16), "guidance_embeds": True})
    with torch.no_grad():  # at its initial scale the prompt and the guidance move the tiny model's image by a level
        for p in transformer.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    encoder = Mistral3ForConditionalGeneration(Mistral3Config(**tiny_mistral3()))
    vae = AutoencoderKLFlux2(**tiny_vae())
    with torch.no_grad():
        vae.bn.running_mean.normal_(std=0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    vae.enable_tiling()  # as the engine above the native area (64x64 here)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER, time_shift_type="exponential")
    pipe = Flux2Pipeline(scheduler=scheduler, vae=vae.eval(), text_encoder=encoder.eval(),
                         tokenizer=tekken_bytes_tokenizer(), transformer=transformer.eval())
    folder = tmp_path_factory.mktemp("flux2") / "FLUX.2-dev"
    pipe.save_pretrained(str(folder))
    loras = tmp_path_factory.mktemp("loras")
    files = lora_files(pipe, loras)
    with Engine(model=str(folder), device="cpu", lora_dir=str(loras)) as engine:
        yield engine, pipe, files


def oracle(pipe, request: dict, guidance: float | None = None) -> np.ndarray:
    """diffusers' image of one `images_together` request (the pipeline's guidance 4 where it names none)."""
    from PIL import Image

    refs = (request.get("extras") or {}).get("reference_images")
    image = pipe(prompt=request["prompt"], image=[Image.fromarray(r) for r in refs] if refs else None,
                 height=request["height"], width=request["width"], num_inference_steps=request["num_inference_steps"],
                 guidance_scale=guidance or request.get("guidance_scale", 4.0),
                 generator=torch.Generator().manual_seed(request["seed"]), output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


@pytest.fixture(scope="module")
def alone(dev):
    """The engine's image of each of REQUESTS submitted alone."""
    return [images_together(dev[0], [r])[0] for r in REQUESTS]


def test_the_template_and_defaults_are_the_pipelines(dev):
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE as PIPELINE_SYSTEM

    engine, pipe, _ = dev
    assert SYSTEM_MESSAGE == PIPELINE_SYSTEM
    assert engine.info.family == "flux2-dev" and engine.info.guidance == "embedded"
    assert (engine.info.default_steps, engine.info.default_guidance) == (50, 4.0)
    assert "embedded_guidance" in engine.info.capabilities and "reference_images" in engine.info.capabilities
    ours = engine.model.tokenizers[0]([chat_prompt(PROMPT)], add_special_tokens=False).input_ids[0]
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input
    theirs = pipe.tokenizer.apply_chat_template(format_input([PROMPT]), add_generation_prompt=False, tokenize=True,
                                                return_dict=True)["input_ids"][0]
    assert list(ours) == list(theirs) and theirs[:2] == [1, 17]  # <s>[SYSTEM_PROMPT]


@pytest.mark.parametrize("index", range(len(REQUESTS)))
def test_each_row_equals_the_pipeline(dev, alone, index):
    """Guidance 2.5 and 6.0 (embedded: one denoiser row each) and a reference image at the default 4."""
    want = oracle(dev[1], REQUESTS[index])
    assert alone[index].shape == want.shape and np.abs(alone[index] - want).max() <= 1
    if index == 0:  # the guidance value shows
        assert np.abs(want - oracle(dev[1], REQUESTS[0], guidance=6.0)).max() > 3


def test_rows_of_different_guidance_steps_and_references_together_equal_each_alone(dev, alone):
    together = images_together(dev[0], list(REQUESTS))
    for index, (got, want) in enumerate(zip(together, alone)):
        assert np.abs(got - want).max() <= 1, index


def test_lora_rows_beside_a_plain_row_equal_the_pipeline_with_load_lora_weights(dev):
    """The PEFT file and Kohya's (fused qkv, alphas) of one adapter at 0.8, with a plain row, in one step: the LoRA rows
    equal Flux2Pipeline with diffusers' load_lora_weights of the PEFT file, the plain row the pipeline without."""
    engine, pipe, files = dev
    common = dict(prompt=PROMPT, height=96, width=96, num_inference_steps=2, guidance_scale=3.0, seed=6)
    got = images_together(engine, [dict(common, loras=[(name, 0.8)]) for name in ("peft", "kohya")] + [common])
    pipe.load_lora_weights(files["peft"], adapter_name="fox")
    pipe.set_adapters(["fox"], [0.8])
    try:
        want = oracle(pipe, common)
    finally:
        pipe.unload_lora_weights()
    plain = oracle(pipe, common)
    assert all(np.abs(image - want).max() <= 1 for image in got[:2])
    assert np.abs(got[2] - plain).max() <= 1 and np.abs(want - plain).max() > 3


def test_a_negative_prompt_and_cfg_parameters_are_refused(dev):
    """dev runs no classifier-free guidance: a negative prompt, an interval or a rescale is a 400 naming it (the
    OpenAI routes and the Python API share this check); an empty negative prompt is neutral."""
    engine = dev[0]
    for name, value in (("negative_prompt", "snow"), ("guidance_rescale", 0.7)):
        with pytest.raises(ParamError) as e:
            GenerationRequest.create(prompt="fox", height=128, width=128, model=engine.info, **{name: value})
        assert e.value.param == name and "embedded guidance" in str(e.value) and "\n" not in str(e.value)
    GenerationRequest.create(prompt="fox", negative_prompt="", height=128, width=128, model=engine.info)


def test_a_prompt_over_512_tokens_is_refused_naming_the_count_and_the_limit(dev):
    """512 tokens with the system message and template: one more is a 400 naming both, never cut."""
    engine = dev[0]
    template = len(chat_prompt(""))  # one token a byte with the byte-level tokenizer, `<s>` and the controls aside
    fits = "x" * (512 - (template - len("<s>[SYSTEM_PROMPT][/SYSTEM_PROMPT][INST][/INST]") + 5))
    engine.submit(GenerationRequest.create(prompt=fits, height=64, width=64, num_inference_steps=1,
                                           model=engine.info)).result(timeout=600)
    with pytest.raises(ParamError) as e:
        engine.submit(GenerationRequest.create(prompt=fits + "y", height=64, width=64, num_inference_steps=1,
                                               model=engine.info))
    assert e.value.param == "prompt" and str(e.value).split()[2] == "513" and "at most 512" in str(e.value)
    assert "\n" not in str(e.value)


def test_the_refusal_counts_a_tokenizer_s_own_bos_once():
    """A folder's tokenizer may add `<s>` itself (the template writes it too): the text the refusal counts then
    leaves it out, so that the count is the encoder's ids, as with the byte-level tokenizer, which adds none."""
    from types import SimpleNamespace

    from tokenizers import processors

    from diffgraph.models.families.flux2_dev import Flux2DevFamily

    tokenizer, family = tekken_bytes_tokenizer(), Flux2DevFamily()
    encoded = tokenizer(chat_prompt(PROMPT), add_special_tokens=False).input_ids
    for adds_bos in (False, True):
        if adds_bos:
            tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
                single="<s> $A", special_tokens=[("<s>", 1)])
        before, after = family.prompt_template(SimpleNamespace(tokenizers=[tokenizer]))
        assert before.startswith("<s>") != adds_bos
        assert tokenizer(before + PROMPT + after).input_ids == encoded and encoded[:2] == [1, 17]


def test_the_random_preset_over_http_refuses_a_negative_prompt_and_a_long_one_and_a1111_warns():
    """`random:flux2-dev` with the byte-level tokenizer, served: the OpenAI route answers a negative prompt and a
    prompt over 512 tokens with a 400 naming the field; AUTOMATIC1111's ignores the negative prompt with a warning."""
    from diffgraph.server import ServerConfig
    from server_util import served

    engine = Engine(model="random:flux2-dev", device="cpu")
    assert engine.model.is_random and len(engine.model.tokenizers[0]) == 1256  # Tekken's 1000 controls, 256 bytes
    with engine, served(engine, ServerConfig(model="random:flux2-dev", device="cpu")) as client:
        assert "embedded_guidance" in client.get("/v1/models").json()["data"][0]["capabilities"]
        body = {"prompt": "a red fox", "size": "64x96", "num_inference_steps": 2, "seed": 1, "guidance_scale": 3.5}
        assert client.post("/v1/images/generations", json=body).status_code == 200
        for extra, name, words in (({"negative_prompt": "snow"}, "negative_prompt", "embedded guidance"),
                                   ({"prompt": "fox " * 200}, "prompt", "at most 512")):
            answer = client.post("/v1/images/generations", json={**body, **extra})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == name, answer.text
            assert words in answer.json()["error"]["message"]
        answer = client.post("/sdapi/v1/txt2img", json={"prompt": "a red fox", "negative_prompt": "snow", "width": 64,
                                                         "height": 64, "steps": 2, "seed": 3})
        assert answer.status_code == 200, answer.text
        assert any("negative_prompt was ignored" in w for w in answer.json()["warnings"])


def test_a_folder_with_another_text_encoder_is_refused_naming_it(dev, tmp_path):
    import shutil

    folder = tmp_path / "FLUX.2-dev"
    shutil.copytree(dev[0].model.name, folder)
    config = json.loads((folder / "text_encoder" / "config.json").read_text())
    (folder / "text_encoder" / "config.json").write_text(json.dumps({**config, "model_type": "qwen3"}))
    with pytest.raises(ValueError, match="its text encoder is 'qwen3'; FLUX.2 dev reads Mistral Small 3.1") as e:
        Engine(model=str(folder), device="cpu")
    assert "\n" not in str(e.value)
    shutil.rmtree(folder / "tokenizer")
    with pytest.raises(ValueError, match="lacks its 'tokenizer' subfolder"):
        Engine(model=str(folder), device="cpu")


def test_the_transformer_in_bfl_layout_reads_back_with_its_guidance_embedder(dev, tmp_path):
    """dev's transformer differs from klein's in its config only (the guidance embedder, BFL's `guidance_in`): the
    file reader and the streaming loader give back every tensor from BFL's layout, the config from the shapes."""
    from safetensors.torch import save_file

    from diffgraph.models import flux2_files, split_stream

    state = dev[1].transformer.state_dict()
    original = flux2_files.transformer_to_original(state)
    assert "model.diffusion_model.guidance_in.in_layer.weight" in original
    path = str(tmp_path / "flux2-dev.safetensors")
    save_file({k: v.contiguous() for k, v in original.items()}, path)
    config = flux2_files.transformer_config(flux2_files.read_transformer(path, torch.float32).state)
    assert config["guidance_embeds"] is True and config["joint_attention_dim"] == 48
    streamed = split_stream.load_flux2_transformer(path, torch.float32, torch.device("cpu")).state_dict()
    assert sorted(streamed) == sorted(state) and all(torch.equal(streamed[k], state[k]) for k in state)


# -- split files (ComfyUI's three, with the tokenizer folder the user gives) --------------------------------------------

@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """(SplitFiles of dev's three files written from a tiny pipeline: the transformer in BFL's layout, the Mistral
    encoder in ComfyUI's layout with tekken.json's bytes as `tekken_model`, the FLUX.2 VAE in BFL's layout; the
    pipeline, saved as a diffusers folder: the tokenizer folder given). The VAE is 32 wide, as a width's group norm of
    32 groups, the only count a file implies."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from safetensors.torch import save_file
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from diffgraph.models import flux2_files
    from diffgraph.models.original_layout import vae_original
    from diffgraph.models.split_files import SPLIT_KINDS, SplitFiles

    torch.manual_seed(1)
    transformer = Flux2Transformer2DModel(**{**tiny_transformer(text_width=16), "guidance_embeds": True})
    with torch.no_grad():
        for p in transformer.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    vae = AutoencoderKLFlux2(**{**tiny_vae(), "block_out_channels": (32,) * 4, "norm_num_groups": 32})
    pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER, time_shift_type="exponential"),
                         vae=vae.eval(), text_encoder=Mistral3ForConditionalGeneration(Mistral3Config(
                             **tiny_mistral3())).eval(), tokenizer=tekken_bytes_tokenizer(),
                         transformer=transformer.eval())
    root = tmp_path_factory.mktemp("flux2-dev-split")
    pipe.save_pretrained(str(root / "FLUX.2-dev"))
    paths = [str(root / name) for name in ("flux2-dev-tiny.safetensors", "mistral_3_small_flux2_tiny.safetensors",
                                           "flux2-vae.safetensors")]
    save_file({k: v.contiguous() for k, v in flux2_files.transformer_to_original(transformer.state_dict()).items()},
              paths[0])
    language = pipe.text_encoder.model.language_model.state_dict()
    save_file({**{f"model.{k}": v.contiguous() for k, v in language.items()},
               "tekken_model": torch.frombuffer(bytearray(b'{"vocab": []}'), dtype=torch.uint8)}, paths[1])
    state = vae.state_dict()
    coders = vae_original({k: v for k, v in state.items() if not k.startswith("bn.")}, 4)
    save_file({k: v.contiguous() for k, v in flux2_files.vae_to_original(state, coders).items()}, paths[2])
    kind = next(k for k in SPLIT_KINDS if k.name == "flux2-dev")
    files = SplitFiles(kind, *paths, (), tokenizer=str(root / "FLUX.2-dev"))
    return files, pipe


def test_comfyui_split_files_with_the_tokenizer_folder_equal_the_pipeline(split, tmp_path):
    """The three files (the full encoder, then ComfyUI's pruned one: 30 layers, no final norm) with the tokenizer
    given as the checkpoint's diffusers folder (its text_encoder config gives the head width, 8 here): the family
    reads them into the 30 layers dev runs, and the image equals Flux2Pipeline's on the same modules."""
    import dataclasses

    from safetensors.torch import load_file, save_file

    from diffgraph.models.families import default_registry

    files, pipe = split
    assert files.kind.family == "flux2-dev" and files.kind.tokenizer
    request = dict(prompt="a red fox", height=64, width=96, num_inference_steps=2, guidance_scale=3.0, seed=4)
    want = oracle(pipe, request)
    pruned = str(tmp_path / "mistral_3_small_flux2_pruned.safetensors")
    full = load_file(files.text_encoder)
    save_file({k: v for k, v in full.items() if k != "model.norm.weight" and not k.startswith("model.layers.30.")},
              pruned)
    for encoder in (files.text_encoder, pruned):
        model = default_registry().by_name("flux2-dev").load_split(dataclasses.replace(files, text_encoder=encoder),
                                                                   torch.device("cpu"), torch.float32, "split")
        assert len(model.text_encoders[0].layers) == 30 and isinstance(model.text_encoders[0].norm, torch.nn.Identity)
        with Engine(model=model) as engine:
            assert engine.info.family == "flux2-dev" and engine.info.default_steps == 50
            got = images_together(engine, [request])[0]
        assert got.shape == want.shape and np.abs(got - want).max() <= 1, encoder



def test_gguf_transformers_and_a_llama_cpp_mistral_equal_the_pipeline(split, tmp_path):
    """dev's transformer as ComfyUI-GGUF quantises it (BFL's names with `guidance_in`, architecture `flux`) and the
    Mistral encoder as llama.cpp writes Mistral Small 3.1 (architecture `llama`: `blk.N.*` names, the query and key
    rows permuted, the LM head as `output`; F32): the embeddings equal the pipeline's and the image with the F16
    transformer is within 1 level of the pipeline's (0.05 on average; measured: 1, 0.04); a Q8_0 transformer streams
    in holding exactly gguf's own dequantisation of its weights, the guidance embedder included (its image against the
    pipeline's: klein's GGUF test)."""
    import dataclasses

    import gguf

    from diffgraph.models import flux2_files, split_stream
    from diffgraph.models.families import default_registry
    from gguf_util import write_gguf, write_llama_cpp

    files, pipe = split
    request = dict(prompt="a red fox", height=64, width=96, num_inference_steps=2, guidance_scale=3.0, seed=4)
    family = default_registry().by_name("flux2-dev")
    language, text = pipe.text_encoder.model.language_model, pipe.text_encoder.config.text_config
    encoder = str(tmp_path / "Mistral-Small-3.1-tiny-F32.gguf")
    write_llama_cpp(encoder, {**{f"model.{k}": v for k, v in language.state_dict().items()},
                              "lm_head.weight": pipe.text_encoder.lm_head.weight}, "llama",
                    text.num_attention_heads, text.num_key_value_heads)
    state = pipe.transformer.state_dict()
    original = flux2_files.transformer_to_original(state, prefix="")
    paths = {q: str(tmp_path / f"flux2-dev-tiny-{q}.gguf") for q in ("F16", "Q8_0")}
    held = {q: write_gguf(p, original, gguf.GGMLQuantizationType[q], arch="flux") for q, p in paths.items()}
    model = family.load_split(dataclasses.replace(files, diffusion_model=paths["F16"], text_encoder=encoder),
                              torch.device("cpu"), torch.float32, "split")
    embeds = family.encode(model, [request["prompt"]])["embeds"]
    assert (embeds - pipe.encode_prompt(request["prompt"])[0]).abs().max().item() <= 1e-5
    with Engine(model=model) as engine:
        error = np.abs(images_together(engine, [request])[0] - oracle(pipe, request))
    assert error.max() <= 1 and error.mean() <= 0.05
    loaded = split_stream.load_flux2_transformer(paths["Q8_0"], torch.float32, torch.device("cpu")).state_dict()
    dequantised = flux2_files.transformer_from_original(held["Q8_0"])
    assert sorted(loaded) == sorted(state) and "time_guidance_embed.guidance_embedder.linear_1.weight" in loaded
    assert all(torch.equal(loaded[k], dequantised[k]) for k in state)
    assert not torch.equal(loaded["transformer_blocks.0.attn.to_q.weight"],
                           state["transformer_blocks.0.attn.to_q.weight"])  # (Q8_0's rounding is there)

def test_split_files_without_a_tokenizer_or_with_klein_s_encoder_are_refused_in_one_line(split, tmp_path):
    """No tokenizer folder: one line naming --tokenizer and the sidecar's `tokenizer` (the file's `tekken_model` is
    not read in its place); the tokenizer/ folder alone with the tiny encoder: Mistral Small 3.1's published head width
    (128) does not divide its 16-row projections, one line saying to give the diffusers folder; klein's Qwen3 encoder
    file in the encoder's place: one line naming what it is, before any weight is read."""
    import dataclasses
    import os

    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3Model

    from diffgraph.models.families import default_registry
    from diffgraph.models.families.flux2 import tiny_qwen3

    files, _ = split
    family, cpu = default_registry().by_name("flux2-dev"), torch.device("cpu")
    qwen3 = str(tmp_path / "qwen_3_4b.safetensors")
    save_file({f"model.{k}": v.contiguous() for k, v in Qwen3Model(Qwen3Config(**tiny_qwen3(64))).state_dict().items()},
              qwen3)
    cases = ((dataclasses.replace(files, tokenizer=None), ("needs its checkpoint's tokenizer folder", "--tokenizer DIR",
                                                           'tokenizer = "DIR"')),
             (dataclasses.replace(files, tokenizer=os.path.join(files.tokenizer, "tokenizer")),
              ("not whole heads of 128", "diffusers folder")),
             (dataclasses.replace(files, text_encoder=qwen3), ("is a Qwen3 text encoder, not a Mistral Small 3 text "
                                                               "encoder",)))
    for given, words in cases:
        with pytest.raises(ValueError) as e:
            family.load_split(given, cpu, torch.float32, "split")
        assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


def test_the_full_preset_is_the_published_architecture_built_on_meta():
    """`random:flux2-dev-full` (GPU timing) built on meta here, no weights: FLUX.2-dev's transformer config (8 double,
    48 single blocks, 48 heads of 128, text width 3 x 5120, the guidance embedder) at its published 32B, and the
    30 layers of Mistral Small 3.1 it runs (32 heads of 128, 8 key-value heads, no final norm), which at the
    published 40 layers with the LM head are its 24B's language model."""
    from diffgraph.models.families.flux2_dev import FULL, Flux2DevFamily, full_modules

    assert FULL in Flux2DevFamily().random_presets()
    transformer, encoder, vae = full_modules(torch.device("cpu"))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert all(p.is_meta for m in (transformer, encoder, vae) for p in m.parameters())
    config = transformer.config
    assert (config.num_layers, config.num_single_layers, config.num_attention_heads, config.attention_head_dim,
            config.joint_attention_dim, config.guidance_embeds) == (8, 48, 48, 128, 15360, True)
    assert 32.0e9 < count(transformer) < 32.5e9  # "a 32 billion parameter rectified flow transformer"
    text = encoder.config
    assert (len(encoder.layers), text.hidden_size, text.num_attention_heads, text.num_key_value_heads,
            text.head_dim) == (30, 5120, 32, 8, 128)
    assert isinstance(encoder.norm, torch.nn.Identity) and 3 * text.hidden_size == config.joint_attention_dim
    layer = count(encoder.layers[0])
    embed = encoder.embed_tokens.weight.numel()
    assert count(encoder) == 30 * layer + embed and 23.4e9 < 40 * layer + 2 * embed + 5120 < 23.8e9
    assert vae.config.latent_channels == 32


def test_materialised_makes_each_meta_parameter_on_the_device():
    """What the full preset's modules go through on the device, on a tiny transformer here: every parameter made in
    the dtype asked for (matrices at std 1 / sqrt(fan-in), scales one, biases zero), the same weights from the fixed
    seed."""
    from diffusers import Flux2Transformer2DModel

    from diffgraph.models.families.tokens import materialised
    from diffgraph.models.stream_load import meta_parameters

    def made():
        with meta_parameters():
            net = Flux2Transformer2DModel(**tiny_transformer(text_width=16))
        return materialised(net, torch.device("cpu"), torch.float64)

    net, again = made(), made()
    params = dict(net.named_parameters())
    assert all(not p.is_meta and p.dtype == torch.float64 for p in params.values())
    assert torch.equal(params["transformer_blocks.0.attn.norm_q.weight"], torch.ones(16, dtype=torch.float64))
    with meta_parameters():
        norm = torch.nn.LayerNorm(4)  # (FLUX.2's transformer has no biases)
    norm = materialised(norm, torch.device("cpu"), torch.float64)
    assert torch.equal(norm.weight, torch.ones(4, dtype=torch.float64)) and not norm.bias.any()
    linear = params["single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"]
    assert abs(linear.std().item() * linear.shape[1] ** 0.5 - 1) < 0.1
    assert all(torch.equal(p, dict(again.named_parameters())[k]) for k, p in params.items())
