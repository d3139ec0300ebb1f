"""Z-Image (models/families/zimage.py) against its oracle, diffusers' `ZImagePipeline`, on tiny random folders.

Two folders of one tiny architecture (two main layers, a two-layer Qwen3, a two-level Flux-style VAE), saved with
save_pretrained as the published ones are: "Z-Image-Turbo" (fixed shift 3, no guidance by default) and "Z-Image"
(guided). Their tokenizer is a byte-level BPE the test trains on a few phrases, with Qwen's control tokens and Qwen3's chat
template. fp32 on the CPU: each image within one uint8 level of the
pipeline's with the same seed; rows of different prompt lengths, sizes of one token bucket, steps and guidance run
in one step and each equals its request alone. The tiny VAE's native size is 64: larger images decode in its tiles,
so the oracle runs with `vae.enable_tiling()`.
"""

import json
import os

import numpy as np
import pytest
import torch

from diffgraph import Engine, GenerationRequest, ParamError
from diffgraph.models.families.zimage import CHECKPOINTS, ZImageFamily, checkpoint_of
from diffgraph.models.qwen_tokenizer import chat_template, qwen_tokenizer
from diffgraph.text.prepared import prepare

from loop_util import calls_per_request, images_together

SIZES = [(128, 128), (96, 160), (160, 96)]  # 64, 60 and 60 image tokens (2x2 cells of 8x latents): one bucket


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["a red fox in the snow", "a lighthouse on a cliff at dusk, waves", "user assistant"] * 4,
                            trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    fast.chat_template = chat_template("qwen3")  # Qwen3's own (the pipeline renders it, the engine its string)
    return fast


def pipeline(shift: float, qwen_vocabulary: bool = False):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64,
                                           n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                                           axes_dims=[8, 12, 12], axes_lens=[1024, 64, 64])
    with torch.no_grad():  # its pad tokens and final layer start at zero: give them values
        for p in (transformer.x_pad_token, transformer.cap_pad_token):
            p.normal_()
        for p in transformer.all_final_layer.parameters():
            p.normal_(std=0.05)
    encoder = Qwen3Model(Qwen3Config(vocab_size=151936 if qwen_vocabulary else 400, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                     max_position_embeddings=1024))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(32, 32, 32, 32),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=1, norm_num_groups=32, scaling_factor=0.3611, shift_factor=0.1159,
                        use_quant_conv=False, use_post_quant_conv=False, sample_size=64)
    vae.enable_tiling()  # as the engine above the native area (64x64 here): diffusers' tiles, its overlap and blend
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift, use_dynamic_shifting=False)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=encoder.eval(),
                          tokenizer=qwen_tokenizer("qwen3") if qwen_vocabulary else tokenizer(),
                          transformer=transformer.eval())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("zimage")
    out = {}
    for name, shift in (("Z-Image-Turbo", 3.0), ("Z-Image", 6.0)):
        pipe = pipeline(shift)
        pipe.save_pretrained(str(root / name))
        out[name] = (str(root / name), pipe)
    return out


@pytest.fixture(scope="module")
def turbo(folders):
    with Engine(model=folders["Z-Image-Turbo"][0], device="cpu") as e:
        yield e


def oracle(pipe, prompt: str, size: tuple[int, int], steps: int, guidance: float, seed: int,
           negative: str | None = None) -> np.ndarray:
    """diffusers' image at diffgraph's guidance `guidance` (the pipeline's guidance_scale + 1)."""
    image = pipe(prompt=prompt, negative_prompt=negative, height=size[0], width=size[1], num_inference_steps=steps,
                 guidance_scale=guidance - 1.0, generator=torch.Generator().manual_seed(seed),
                 output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


def test_turbo_equals_the_pipeline_without_guidance(folders, turbo):
    pipe = folders["Z-Image-Turbo"][1]
    got = images_together(turbo, [dict(prompt="a red fox in the snow", height=128, width=128,
                                       num_inference_steps=3, seed=7)])[0]
    assert turbo.info.default_guidance == 1.0 and turbo.model.extra["checkpoint"] == CHECKPOINTS["z-image-turbo"]
    want = oracle(pipe, "a red fox in the snow", (128, 128), 3, 1.0, 7)
    assert np.abs(got - want).max() <= 1
    misses = turbo.stats["prompt_cache_misses"]  # the same prompt again: from the cache, no encoder pass
    again = images_together(turbo, [dict(prompt="a red fox in the snow", height=128, width=128, num_inference_steps=3,
                                  seed=7)])[0]
    assert turbo.stats["prompt_cache_misses"] == misses and np.array_equal(again, got)


def test_a_step_gathers_the_rows_rotary_tables_and_builds_none(turbo, monkeypatch):
    """A row's RoPE tables are per-row state, built with its group's per-size fields (the image grid's table and the
    text slot's: two embedder calls, two more where the group's buffers are new), never in a step: a request of 3
    steps and one of 6 build no more than those (a step that built them would make 6 and 12 calls)."""
    rope = type(turbo.model.denoiser.rope_embedder)
    request = dict(prompt="a red fox", height=96, width=112)  # a size no other test runs
    (first, three), (again, six) = calls_per_request(turbo, monkeypatch, rope, "__call__", request, (3, 6))
    assert (three, six) == (3, 6) and first in (2, 4) and again <= first


def test_a_request_s_plan_is_made_once_for_the_runner_and_the_guidance(turbo, monkeypatch):
    """The guidance feature reads a request's sigmas (cfg_truncation) from the runner's own planner: a request of a
    new (sampler, steps, size) makes its flow plan once, not once per planner; the same again makes none."""
    from diffgraph.models.families import tokens

    made = []
    flow_plan = tokens.flow_plan
    monkeypatch.setattr(tokens, "flow_plan", lambda *a, **k: made.append(a[3]) or flow_plan(*a, **k))
    request = dict(prompt="a red fox", height=112, width=96, num_inference_steps=5, seed=3)  # a key no other test
    images_together(turbo, [request])
    assert made == [5]
    images_together(turbo, [dict(request, seed=4)])
    assert made == [5]


def test_mixed_rows_share_a_step_and_each_equals_the_pipeline(folders, turbo):
    """Prompts of 2 and 30 words, three sizes of one token bucket, 2/3/4 steps, guidance off and on with a negative
    prompt: submitted together, each equals diffusers' image of its request alone."""
    pipe = folders["Z-Image-Turbo"][1]
    long = ", ".join(["a lighthouse on a cliff at dusk"] * 5)
    requests = [dict(prompt="red fox", height=SIZES[0][0], width=SIZES[0][1], num_inference_steps=3, seed=1),
                dict(prompt=long, negative_prompt="snow", height=SIZES[1][0], width=SIZES[1][1],
                     num_inference_steps=2, guidance_scale=2.5, seed=2),
                dict(prompt="a red fox at dusk", height=SIZES[2][0], width=SIZES[2][1], num_inference_steps=4,
                     guidance_scale=4.0, seed=3)]
    keys = {turbo.runner.group_key(s, prepare(turbo.runner.text_setup, made))
            for s, made in zip(SIZES, (GenerationRequest.create(model=turbo.info, **r) for r in requests))}
    assert keys == {(128, 256)}  # every prompt within the smallest text slot: one group, one step
    got = images_together(turbo, requests)
    for r, image in zip(requests, got):
        want = oracle(pipe, r["prompt"], (r["height"], r["width"]), r["num_inference_steps"],
                      r.get("guidance_scale", 1.0), r["seed"], r.get("negative_prompt"))
        assert image.shape == (r["height"], r["width"], 3)
        assert np.abs(image - want).max() <= 1, r


def test_text_slots_group_prompts_by_length_and_each_equals_the_pipeline(folders, turbo):
    """A row reads the smallest text slot its prompt fits (template included): a 3-word and a ~330-token prompt run
    in slots 128 and 512, each equal to the pipeline; the graphs' groups cover every slot of a size."""
    pipe = folders["Z-Image-Turbo"][1]
    adapter, model = turbo.model.adapter, turbo.model
    assert [adapter.group_key(model, (128, 128), n) for n in (0, 1, 128, 129, 300, 512)] == \
        [(512, 256), (128, 256), (128, 256), (256, 256), (512, 256), (512, 256)]
    assert adapter.group_keys(model, (128, 128)) == ((128, 256), (256, 256), (512, 256))
    long = ", ".join(["a lighthouse on a cliff at dusk"] * 40)
    requests = [dict(prompt="a red fox", height=128, width=128, num_inference_steps=2, seed=4),
                dict(prompt=long, height=128, width=128, num_inference_steps=2, seed=5)]
    keys = [turbo.runner.group_key((128, 128), prepare(turbo.runner.text_setup, made))
            for made in (GenerationRequest.create(model=turbo.info, **r) for r in requests)]
    assert keys == [(128, 256), (512, 256)]
    for r, image in zip(requests, images_together(turbo, requests)):
        assert np.abs(image - oracle(pipe, r["prompt"], (128, 128), 2, 1.0, r["seed"])).max() <= 1


@pytest.mark.parametrize("guidance", [0.0, 0.5, 1.0, 1.5, 4.0])
def test_guidance_means_what_it_means_on_every_family(folders, guidance):
    """diffgraph's scale g is the pipeline's g - 1: 1 and below run one branch (the pipeline's <= 0), above it
    pos + (g - 1)(pos - neg)."""
    path, pipe = folders["Z-Image"]
    engine = _base_engine(path)
    got = images_together(engine, [dict(prompt="a red fox", negative_prompt="dusk", height=96, width=96,
                                        num_inference_steps=2, guidance_scale=guidance, seed=5)])[0]
    assert np.abs(got - oracle(pipe, "a red fox", (96, 96), 2, guidance, 5, "dusk")).max() <= 1


_BASE: dict = {}


def _base_engine(path):
    if path not in _BASE:
        _BASE[path] = Engine(model=path, device="cpu")
    return _BASE[path]


@pytest.fixture(scope="module", autouse=True)
def _close_base():
    yield
    for e in _BASE.values():
        e.close()


def test_the_checkpoint_comes_from_the_name():
    assert checkpoint_of("/m/Z-Image-Turbo") == CHECKPOINTS["z-image-turbo"]
    assert checkpoint_of("/hub/models--Tongyi-MAI--Z-Image/snapshots/0abc") == CHECKPOINTS["z-image"]
    assert checkpoint_of("/m/anything", preset="Z-Image-Turbo") == CHECKPOINTS["z-image-turbo"]
    with pytest.raises(ValueError, match="z-image-turbo, z-image"):
        checkpoint_of("/m/my-model")


def test_the_random_presets_carry_their_checkpoints_defaults():
    """random:zimage-base (built on the meta device: no memory) samples as the base model: 50 steps, guidance 5,
    shift 6; random:zimage-turbo as Turbo."""
    family = ZImageFamily()
    for name, key, steps, guidance, shift in (("random:zimage-base", "z-image", 50, 5.0, 6.0),
                                              ("random:zimage-turbo", "z-image-turbo", 8, 1.0, 3.0)):
        model = family.build_random(name, torch.device("meta"), torch.bfloat16)
        assert model.extra["checkpoint"] == CHECKPOINTS[key] and model.scheduler_config["shift"] == shift
        assert (family.default_steps(model), family.model_guidance(model)) == (steps, guidance)


def test_it_refuses_what_it_does_not_read(turbo):
    with pytest.raises(ParamError) as e:
        GenerationRequest.create(prompt="fox", sampler="heun", height=128, width=128, model=turbo.info)
    assert e.value.param == "sampler" and "flow_euler, flow_euler_a, flow_dpmpp_2m" in str(e.value)
    with pytest.raises(ParamError) as e:
        GenerationRequest.create(prompt="fox", height=128, width=120, model=turbo.info)
    assert e.value.param == "width" and "16" in str(e.value)
    assert json.loads(json.dumps(turbo.info.samplers)) == ["flow_euler", "flow_euler_a", "flow_dpmpp_2m"]


def test_flow_samplers_share_a_step_and_each_equals_itself_alone(turbo):
    """AUTOMATIC1111's 'Euler a' and 'DPM++ 2M' are the family's stochastic Euler and flow DPM-Solver++ (their
    walks: tests/test_sampling_flow.py); rows of the three samplers submitted together equal each alone."""
    requests = [dict(prompt="a red fox", height=128, width=128, num_inference_steps=4, seed=2, sampler=s)
                for s in ("flow_euler", "Euler a", "DPM++ 2M")]
    made = [GenerationRequest.create(model=turbo.info, **r) for r in requests]
    assert [m.sampler for m in made] == ["flow_euler", "flow_euler_a", "flow_dpmpp_2m"]
    together = images_together(turbo, requests)
    alone = [images_together(turbo, [r])[0] for r in requests]
    assert max(np.abs(a - b).max() for a, b in zip(together, alone)) <= 1
    assert np.abs(together[0] - together[2]).max() > 0 and np.abs(together[0] - together[1]).max() > 0


def test_a_prompt_beyond_the_encoder_is_refused_naming_its_count(turbo):
    """512 tokens with the template, as the pipeline reads them: a longer prompt is a ParamError (HTTP 400) naming
    the count and the limit, never cut silently; one just within runs."""
    long = GenerationRequest.create(prompt="fox " * 600, height=128, width=128, num_inference_steps=1,
                                    model=turbo.info)
    with pytest.raises(ParamError) as e:
        turbo.submit(long)
    assert e.value.param == "prompt" and "at most 512" in str(e.value)
    assert int(str(e.value).split()[2]) > 512
    negative = GenerationRequest.create(prompt="fox", negative_prompt="snow " * 600, guidance_scale=2.0, height=128,
                                        width=128, num_inference_steps=1, model=turbo.info)
    with pytest.raises(ParamError) as e:
        turbo.submit(negative)
    assert e.value.param == "negative_prompt"


def test_the_tiny_random_preset_runs_with_the_shipped_tokenizer():
    with Engine(model="random:zimage-tiny", device="cpu") as engine:
        assert engine.model.is_random and engine.info.family == "zimage" and engine.info.default_steps == 8
        assert len(engine.model.tokenizers[0]) == 151669  # Qwen3's vocabulary and control tokens
        image = engine.generate("a red fox", height=64, width=96, num_inference_steps=2, seed=1)
    assert image.arrays[0].shape == (64, 96, 3)


def split_files(pipe, tmp_path, name: str):
    """The pipeline's modules as ComfyUI's three split files (the transformer's `diffusion_models/NAME`), with the
    SplitFiles the catalog would choose for them (the tiny files are below the split kinds' size signatures)."""
    from safetensors.torch import save_file

    from diffgraph.models.original_layout import vae_original
    from diffgraph.models.split_files import SPLIT_KINDS, SplitFiles
    from test_zimage_files import to_original

    models = tmp_path / "models"
    for sub in ("diffusion_models", "text_encoders", "vae"):
        (models / sub).mkdir(parents=True, exist_ok=True)
    paths = (str(models / "diffusion_models" / name), str(models / "text_encoders" / "qwen_3_tiny.safetensors"),
             str(models / "vae" / "ae.safetensors"))
    save_file(to_original(pipe.transformer.state_dict()), paths[0])
    save_file({f"model.{k}": v.contiguous() for k, v in pipe.text_encoder.state_dict().items()}, paths[1])
    save_file({k: v.contiguous() for k, v in vae_original(pipe.vae.state_dict(), 4).items()}, paths[2])
    return SplitFiles(next(k for k in SPLIT_KINDS if k.family == "zimage"), *paths, ())


def test_comfyui_split_files_equal_the_pipeline(tmp_path):
    """The transformer in ComfyUI's layout (fused qkv, `model.diffusion_model.` keys), the Qwen3 encoder under
    `model.`, the VAE in the original layout, as three files: loaded by the family (configs from their shapes, the
    shipped tokenizer) the image equals the pipeline's on the same modules."""
    from diffgraph.models.split_files import SplitFiles

    pipe = pipeline(3.0, qwen_vocabulary=True)
    pipe.vae.disable_tiling()  # the split VAE's config is Flux's (native 1024): a 96x128 image decodes whole
    files = split_files(pipe, tmp_path, "z_image_turbo_tiny.safetensors")
    model = default_family().load_split(files, torch.device("cpu"), torch.float32, files.diffusion_model)
    assert model.scheduler_config["shift"] == 3.0
    with Engine(model=model) as engine:
        got = images_together(engine, [dict(prompt="a red fox", height=96, width=128, num_inference_steps=2,
                                            seed=4)])[0]
        assert engine.info.default_steps == 8
    assert np.abs(got - oracle(pipe, "a red fox", (96, 128), 2, 1.0, 4)).max() <= 1
    with pytest.raises(ValueError, match="cannot tell which Z-Image checkpoint"):
        default_family().load_split(SplitFiles(files.kind, str(tmp_path / "mine.safetensors"), files.text_encoder,
                                               files.vae, ()), torch.device("cpu"), torch.float32, "mine")


def test_a_split_base_file_samples_with_the_base_schedule_and_a_sidecar_preset_decides(tmp_path):
    """The published Z-Image (base) scheduler is FlowMatchEuler at shift 6.0, Turbo's at 3.0: a split file whose name
    says base gets shift 6 and the base card's defaults, and its image equals the pipeline's at shift 6; its
    sigmas differ from Turbo's at the same steps. A sidecar's `preset` beats the file name (a base file named
    "turbo", a file whose name says nothing), through the catalog's choice as through --text-encoder/--vae; a preset
    of another family or an unknown one is one line naming the allowed ones."""
    import dataclasses

    from diffgraph.models.sidecar import read_sidecar

    pipe = pipeline(6.0, qwen_vocabulary=True)
    pipe.vae.disable_tiling()
    files = split_files(pipe, tmp_path, "z_image_bf16.safetensors")
    cpu, fp32 = torch.device("cpu"), torch.float32
    base = default_family().load_split(files, cpu, fp32, files.diffusion_model)
    turbo = default_family().load_split(dataclasses.replace(files, preset="z-image-turbo"), cpu, fp32, "t")
    assert (base.scheduler_config["shift"], base.extra["checkpoint"]) == (6.0, CHECKPOINTS["z-image"])
    assert (turbo.scheduler_config["shift"], turbo.extra["checkpoint"]) == (3.0, CHECKPOINTS["z-image-turbo"])
    plans = [default_family().planner(m)("flow_euler", "default", 8, (128, 128)).sigmas for m in (base, turbo)]
    shifted, turbo_sigmas = np.asarray(plans[0], dtype=np.float64), np.asarray(plans[1], dtype=np.float64)
    unshifted = turbo_sigmas / (3.0 - 2.0 * turbo_sigmas)          # Turbo's shift 3 undone
    assert np.abs(shifted - 6.0 * unshifted / (1.0 + 5.0 * unshifted)).max() < 1e-5  # the same times at shift 6
    assert np.abs(shifted - turbo_sigmas)[1:-1].min() > 0.01
    with Engine(model=base) as engine:
        assert (engine.info.default_steps, engine.info.default_guidance) == (50, 5.0)
        got = images_together(engine, [dict(prompt="a red fox", height=96, width=128, num_inference_steps=3,
                                            guidance_scale=1.0, seed=4)])[0]
    assert np.abs(got - oracle(pipe, "a red fox", (96, 128), 3, 1.0, 4)).max() <= 1  # the pipeline at shift 6

    renamed = tmp_path / "models" / "diffusion_models" / "z_image_turbo_bf16.safetensors"  # the name says Turbo
    os.rename(files.diffusion_model, renamed)
    side = renamed.with_name("z_image_turbo_bf16.diffgraph.toml")
    side.write_text('preset = "z-image"\n')
    preset = read_sidecar(str(renamed)).split_preset(files.kind.name, files.kind.label)  # as PartFiles.choose reads it
    chosen = dataclasses.replace(files, diffusion_model=str(renamed), preset=preset)
    loaded = default_family().load_split(chosen, cpu, fp32, "b")
    assert (loaded.scheduler_config["shift"], loaded.extra["checkpoint"]) == (6.0, CHECKPOINTS["z-image"])
    side.write_text('preset = "flux.2-klein"\n')
    with pytest.raises(ValueError) as e:
        read_sidecar(str(renamed)).split_preset(files.kind.name, files.kind.label)
    assert str(e.value) == ("sidecar z_image_turbo_bf16.diffgraph.toml: preset 'flux.2-klein' is not a Z-Image "
                            "preset; one of z-image-turbo, z-image, digits-zimage")
    side.write_text('preset = "z-image-base"\n')
    with pytest.raises(ValueError, match=r"preset 'z-image-base' is unknown; one of sd1, .*, z-image-turbo, z-image, "
                                         r"digits-zimage, flux.2-klein, flux.2-klein-base, qwen-image, qwen-image-edit, "
                                         r"qwen-image-edit-2509, qwen-image-edit-2511$"):
        read_sidecar(str(renamed))


def default_family():
    from diffgraph.models.families import default_registry
    return default_registry().by_name("zimage")


def lora_files(pipe, folder) -> dict[str, str]:
    """One rank-4 adapter on both main layers' attention and feed-forward, written three ways: diffusers / PEFT keys,
    Kohya's `lora_unet_*` with alphas, and ComfyUI's original layout with the fused qkv projection (q, k and v share
    their down weight, so the fused file holds the same adapter)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(21)
    peft, kohya, comfy = {}, {}, {}
    for layer in range(2):
        shared = torch.randn((4, 64), generator=g) * 0.3
        ups = {}
        for module in ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                       "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
            linear = pipe.transformer.get_submodule(f"layers.{layer}.{module}")
            a = shared if module in ("attention.to_q", "attention.to_k", "attention.to_v") else \
                torch.randn((4, linear.in_features), generator=g) * 0.3
            b = torch.randn((linear.out_features, 4), generator=g) * 0.3
            ups[module] = b
            peft[f"transformer.layers.{layer}.{module}.lora_A.weight"] = a
            peft[f"transformer.layers.{layer}.{module}.lora_B.weight"] = b
            flat = f"lora_unet_layers_{layer}_{module.replace('.', '_')}"
            kohya[f"{flat}.lora_down.weight"], kohya[f"{flat}.lora_up.weight"] = a * 2, b  # alpha 2 of rank 4
            kohya[f"{flat}.alpha"] = torch.tensor(2.0)
            if not module.startswith("attention.to_") or module == "attention.to_out.0":
                name = module.replace("attention.to_out.0", "attention.out")
                comfy[f"diffusion_model.layers.{layer}.{name}.lora_A.weight"] = a
                comfy[f"diffusion_model.layers.{layer}.{name}.lora_B.weight"] = b
        comfy[f"diffusion_model.layers.{layer}.attention.qkv.lora_A.weight"] = shared
        comfy[f"diffusion_model.layers.{layer}.attention.qkv.lora_B.weight"] = torch.cat(
            [ups["attention.to_q"], ups["attention.to_k"], ups["attention.to_v"]])
    out = {}
    for name, state in (("peft", peft), ("kohya", kohya), ("comfy", comfy)):
        out[name] = str(folder / f"{name}.safetensors")
        save_file({k: v.clone() for k, v in state.items()}, out[name])
    return out


def test_lora_files_of_three_layouts_run_per_row_and_equal_diffusers(folders, tmp_path):
    """Rows with the adapter from each file and a row without, in one step: each adapter row equals the pipeline
    with diffusers' load_lora_weights of the PEFT file at the same scale, the plain row the pipeline without."""
    path, pipe = folders["Z-Image-Turbo"]
    from safetensors.torch import save_file

    files = lora_files(pipe, tmp_path)
    sd = "lora_unet_down_blocks_0_attentions_0_proj_in"
    save_file({f"{sd}.lora_down.weight": torch.ones(4, 320), f"{sd}.lora_up.weight": torch.ones(320, 4)},
              str(tmp_path / "sd_style.safetensors"))
    with Engine(model=path, device="cpu", lora_dir=str(tmp_path)) as engine:
        common = dict(prompt="a red fox", height=96, width=96, num_inference_steps=2, seed=6)
        got = images_together(engine, [dict(common, loras=[(name, 0.8)]) for name in files] + [common])
        with pytest.raises(ParamError, match="adapter 'sd_style' is a LoRA for a Stable Diffusion UNet .*, not for "
                                             "this model's transformer; use a LoRA made for ZImagePipeline"):
            engine.submit(GenerationRequest.create(model=engine.info, **common, loras=[("sd_style", 1.0)])).result()
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


def test_image_to_image_equals_the_img2img_pipeline(folders, turbo):
    """ZImageImg2ImgPipeline's strength rule (4 steps at 0.6 run the last 3), its flow noising and VAE scaling: the
    engine's image within one level of the pipeline's, beside a text-to-image row in the same step; a mask is
    refused (its packed rows take no inpainting blend)."""
    from diffusers import ZImageImg2ImgPipeline

    pipe = ZImageImg2ImgPipeline(**folders["Z-Image-Turbo"][1].components)
    source = (np.random.default_rng(3).random((96, 128, 3)) * 255).astype(np.uint8)
    edit = dict(prompt="a red fox", image=source, strength=0.6, num_inference_steps=4, seed=8)
    request = GenerationRequest.create(model=turbo.info, **edit)
    assert request.denoising_steps == 3 and turbo.info.edit_steps_rule == "flow"
    got, _ = images_together(turbo, [edit, dict(prompt="a red fox", height=96, width=128, num_inference_steps=2,
                                                seed=1)])
    from PIL import Image
    want = pipe(prompt="a red fox", image=Image.fromarray(source), strength=0.6, num_inference_steps=4,
                guidance_scale=0.0, generator=torch.Generator().manual_seed(8), output_type="np").images[0]
    assert np.abs(got - (want * 255).round().astype(np.int16)).max() <= 1
    with pytest.raises(ParamError) as e:
        turbo.submit(GenerationRequest.create(model=turbo.info, **edit, mask_image=np.zeros((96, 128), np.uint8)))
    assert e.value.param == "mask"


def test_above_the_native_area_the_vae_decodes_in_diffusers_tiles(folders, turbo):
    """The tiny VAE's native size is 64: a 128x128 image (above 64x64) decodes in diffusers' tiles and equals the
    pipeline with `vae.enable_tiling()`, not the whole decode; 64x64 (the native area) decodes whole and equals the
    untiled pipeline."""
    pipe = folders["Z-Image-Turbo"][1]
    assert turbo.model.native_size == 64 and pipe.vae.use_tiling
    sizes = [(128, 128), (64, 64)]
    got = images_together(turbo, [dict(prompt="a red fox", height=h, width=w, num_inference_steps=2, seed=5)
                                  for h, w in sizes])
    tiled = oracle(pipe, "a red fox", sizes[0], 2, 1.0, 5)
    pipe.vae.disable_tiling()
    try:
        whole = [oracle(pipe, "a red fox", size, 2, 1.0, 5) for size in sizes]
    finally:
        pipe.vae.enable_tiling()
    assert np.abs(got[0] - tiled).max() <= 1 and np.abs(got[0] - whole[0]).max() > 3
    assert got[1].shape[:2] == (64, 64) and np.abs(got[1] - whole[1]).max() <= 1


def test_a_graphed_size_above_the_native_area_decodes_eagerly(folders):
    """In graph mode (the emulated backend) the VAE's graphs cover only the sizes it decodes whole: 128x128 has no
    decoder or encoder graph, its decode runs eagerly in tiles and equals the tiled pipeline."""
    from diffgraph.config import GraphConfig

    path, pipe = folders["Z-Image-Turbo"]
    graphs = GraphConfig(resolutions=((64, 64), (128, 128)), batch_buckets=(1,), backend="emulated")
    with Engine(model=path, device="cpu", mode="graph", graphs=graphs) as engine:
        assert engine.runner.graphs.vae.resolutions() == ((64, 64),)
        assert engine.runner.graphs.encode.resolutions() == ((64, 64),)
        got = images_together(engine, [dict(prompt="a red fox", height=128, width=128, num_inference_steps=2,
                                            seed=5)])[0]
    assert np.abs(got - oracle(pipe, "a red fox", (128, 128), 2, 1.0, 5)).max() <= 1


def test_the_prewarm_captures_each_distinct_graph_once(monkeypatch):
    """In graph mode (the emulated backend) the prewarm of the tiny preset captures each (kind, group, bucket) of
    the graph table once: the step's at each text slot (its rows read that many prompt tokens: a graph of its own
    shape) and bucket, the VAE decoder's and encoder's at each bucket; 3 x 2 + 2 + 2 captures. A prewarm list's
    image size brings the step graphs of its groups (each text slot's) at the listed bucket."""
    from diffgraph.config import GraphConfig
    from diffgraph.graphs.runner import GraphRunner

    captured = []
    capture = GraphRunner.capture
    monkeypatch.setattr(GraphRunner, "capture", lambda self, key: captured.append(key) or capture(self, key))
    graphs = GraphConfig(resolutions=((64, 64),), batch_buckets=(1, 2), backend="emulated")
    with Engine(model="random:zimage-tiny", device="cpu", mode="graph", graphs=graphs) as engine:
        table = {(g["kind"], g["height"], g["width"], g["bucket"]) for g in engine.runner.graph_table()}
    assert len(captured) == len(set(captured)) == len(table) == 10 and set(captured) == table
    assert sorted(k for k in captured if k[0] == "step") == [
        ("step", slot, 256, b) for slot in ZImageFamily.text_buckets for b in (1, 2)]
    captured.clear()  # a prewarm list names image sizes: a token family's step graphs of one are its groups'
    graphs = GraphConfig(resolutions=((64, 64),), batch_buckets=(1, 2), backend="emulated", prewarm=((64, 64, 1),))
    with Engine(model="random:zimage-tiny", device="cpu", mode="graph", graphs=graphs):
        pass
    assert sorted(captured) == sorted([("step", slot, 256, 1) for slot in ZImageFamily.text_buckets]
                                      + [("vae", 64, 64, 1), ("vae_encode", 64, 64, 1)])


def test_guidance_truncation_and_normalisation_as_the_pipeline(folders):
    """ZImagePipeline's cfg_truncation (guide only while 1 - sigma <= it) and cfg_normalization (the guided norm at most
    that ratio of the prompt branch's), per row: rows with and without them in one step each equal the pipeline."""
    path, pipe = folders["Z-Image"]
    engine = _base_engine(path)
    assert "cfg_shaping" in engine.info.capabilities
    base = dict(prompt="a red fox", negative_prompt="dusk", height=96, width=96, num_inference_steps=4,
                guidance_scale=4.0, seed=9)
    # (shift 6, 4 steps: 1 - sigma is 0, 0.05, 0.14, 0.33 at the four steps)
    shaped = [dict(base, extras={"cfg_truncation": 0.1}), dict(base, extras={"cfg_normalization": 0.5}),
              dict(base, extras={"cfg_truncation": 0.2, "cfg_normalization": 0.8}), base]
    got = images_together(engine, shaped)
    for r, image in zip(shaped, got):
        options = r.get("extras", {})
        want = pipe(prompt="a red fox", negative_prompt="dusk", height=96, width=96, num_inference_steps=4,
                    guidance_scale=3.0, cfg_truncation=options.get("cfg_truncation", 1.0),
                    cfg_normalization=options.get("cfg_normalization", False),
                    generator=torch.Generator().manual_seed(9), output_type="np").images[0]
        assert np.abs(image - (want * 255).round().astype(np.int16)).max() <= 1, options
    assert len({g.tobytes() for g in got}) == 4  # each option changes the image
    with pytest.raises(ParamError) as e:
        engine.submit(GenerationRequest.create(model=engine.info, **base, extras={"cfg_truncation": 1.5}))
    assert e.value.param == "cfg_truncation"


def test_split_files_given_by_flag_are_checked(tmp_path):
    """--text-encoder / --vae name a split model's files anywhere (LoadOptions): each is checked against the kind the
    diffusion model needs, from its header, before any weight is read; --text-encoder on a whole checkpoint is refused."""
    from diffgraph.config import LoadOptions
    from diffgraph.models.loader import load_model
    from test_split_files import FLUX_VAE, QWEN3_4B, SD_VAE, ZIMAGE, header_file

    model = header_file(tmp_path / "z_image_turbo.safetensors", ZIMAGE)
    encoder = header_file(tmp_path / "enc" / "qwen.safetensors", QWEN3_4B)
    vae, sd_vae = header_file(tmp_path / "ae.safetensors", FLUX_VAE), header_file(tmp_path / "sd.safetensors", SD_VAE)
    with pytest.raises(ValueError, match="--vae sd.safetensors is an SD VAE .*; Z-Image needs a FLUX.1 VAE"):
        load_model(model, options=LoadOptions(text_encoder=encoder, vae=sd_vae))
    with pytest.raises(ValueError, match="--text-encoder ae.safetensors is a FLUX.1 VAE .*; Z-Image needs a Qwen3-4B"):
        load_model(model, options=LoadOptions(text_encoder=vae, vae=vae))
    with pytest.raises(ValueError, match="give its vae file too"):
        load_model(model, options=LoadOptions(text_encoder=encoder))
    with pytest.raises(ValueError, match="lacks the tensor"):  # the files are right: the family reads them
        load_model(model, options=LoadOptions(text_encoder=encoder, vae=vae))


def test_served_over_http_with_the_checkpoint_s_defaults(folders):
    """The OpenAI and AUTOMATIC1111 routes on Turbo: a body without steps runs the checkpoint's 8 (the image equals
    the pipeline's at 8 steps), `/v1/models` lists the defaults, the pipeline's guidance options are JSON keys, and
    AUTOMATIC1111's 'Euler' is the family's flow Euler with its steps and cfg_scale left to the model."""
    import base64
    import io

    from PIL import Image

    from diffgraph.server import ServerConfig
    from server_util import served

    path, pipe = folders["Z-Image-Turbo"]
    with served(Engine(model=path, device="cpu"), ServerConfig(model=path, device="cpu")) as client:
        card = client.get("/v1/models").json()["data"][0]
        assert (card["default_steps"], card["default_guidance"]) == (8, 1.0) and "cfg_shaping" in card["capabilities"]
        answer = client.post("/v1/images/generations", json={"prompt": "a red fox", "size": "96x64", "seed": 3,
                                                              "cfg_truncation": 0.5})
        assert answer.status_code == 200, answer.text
        image = np.array(Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"]))))
        assert np.abs(image.astype(np.int16) - oracle(pipe, "a red fox", (64, 96), 8, 1.0, 3)).max() <= 1
        a1111 = client.post("/sdapi/v1/txt2img", json={"prompt": "a red fox", "width": 96, "height": 64, "seed": 3,
                                                       "sampler_name": "Euler"})
        assert a1111.status_code == 200, a1111.text
        info = json.loads(a1111.json()["info"])
        assert (info["steps"], info["cfg_scale"]) == (8, 1.0)
        bad = client.post("/v1/images/generations", json={"prompt": "a red fox", "size": "96x64",
                                                          "sampler": "DPM++ SDE"})
        assert bad.status_code == 400 and "flow_euler, flow_euler_a, flow_dpmpp_2m" in bad.text


def test_serve_accepts_the_family_s_presets_and_split_files(tmp_path):
    """`diffgraph serve`'s fast check before start (in the HTTP process, without torch): the families' random presets
    are left to the engine's loader, a split DiT file passes (its companions are checked where it loads); an unknown
    name still fails listing the presets."""
    from diffgraph.server.cli import _check_model
    from test_split_files import ZIMAGE, header_file

    _check_model("random:zimage-tiny")
    _check_model(header_file(tmp_path / "z_image_turbo.safetensors", ZIMAGE))
    with pytest.raises(ValueError, match="presets: .*digits"):
        _check_model("zimage-tinny")
    with pytest.raises(ValueError, match="did you mean 'random:zimage-tiny'"):  # the loader, in the engine's process
        from diffgraph.models.loader import load_model
        load_model("random:zimage-tinny")
