"""Single-file checkpoints (issue 29): loaded offline through diffusers' single-file loader, giving the folder's images.

The checkpoints are written by the tests (tests/original_layout.py inverts diffusers' key conversion) from the tiny
variants and the shipped digits models; kind detection reads header-only files with the full-size key layouts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import original_layout as O
from diffgraph.config import LoadOptions
from diffgraph.engine.engine import Engine
from diffgraph.models import checkpoint_configs as C
from diffgraph.models.checkpoint_kind import classify, inspect_checkpoint
from diffgraph.models.loader import load_model
from diffgraph.models.presets import shipped_preset_folder

PROMPT = "a handwritten digit seven"


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path_factory):
    """Every test here runs with a hub endpoint that refuses, offline mode off and a socket guard: any connection
    attempt fails the test (diffusers' single-file loader downloads configs when it lacks them)."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("DIFFGRAPH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    attempts = []

    def refuse(self, address, *args):
        attempts.append(address)
        raise AssertionError(f"network access attempted: {address}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield
    assert attempts == []


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Folder and single file of each model: (folder, file) by name."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, layout in (("digits", "sd1"), ("digits-xl", "sdxl")):
        folder = shipped_preset_folder(name)
        path = str(root / f"{name}.safetensors")
        O.write_single_file(folder, path, layout)
        out[name] = (folder, path)
    for kind in ("sd2", "sd1-inpaint"):
        folder = O.variant_folder(str(root), kind)
        path = str(root / f"{kind}.safetensors")
        O.write_single_file(folder, path, O.VARIANTS[kind][1])
        out[kind] = (folder, path)
    return out


def _image(model, **kw) -> np.ndarray:
    engine = Engine(model, device="cpu", mode="eager", image_threads=1, **kw)
    try:
        return np.asarray(engine.generate(PROMPT, seed=3, num_inference_steps=4, guidance_scale=4.0)[0])
    finally:
        engine.close()


@pytest.mark.parametrize("name,prediction", [("digits", None), ("digits-xl", None), ("sd2", "epsilon"),
                                             ("sd2", "v_prediction"), ("sd1-inpaint", None)])
def test_a_single_file_gives_the_folders_image_exactly(made, name, prediction):
    folder, path = made[name]
    options = LoadOptions(model_config=folder, prediction_type=prediction)
    from_file = _image(path, load=options)
    reference = load_model(folder, "cpu", "fp32", options=LoadOptions(prediction_type=prediction))
    assert reference.scheduler_config["prediction_type"] == (prediction or "epsilon")
    from_folder = _image(reference)
    assert from_file.shape == from_folder.shape and np.array_equal(from_file, from_folder)


def test_the_modules_round_trip_exactly_and_keep_the_tokenizer(made):
    folder, path = made["digits-xl"]
    a = load_model(path, "cpu", "fp32", options=LoadOptions(model_config=folder))
    b = load_model(folder, "cpu", "fp32")
    assert a.family == b.family == "sdxl" and a.native_size == b.native_size
    for x, y in zip((a.unet, a.vae, *a.text_encoders), (b.unet, b.vae, *b.text_encoders)):
        sx, sy = x.state_dict(), y.state_dict()
        assert sx.keys() == sy.keys() and all(torch.equal(sx[k], sy[k]) for k in sy)
    assert [t(PROMPT).input_ids for t in a.tokenizers] == [t(PROMPT).input_ids for t in b.tokenizers]
    assert a.force_zeros_for_empty_prompt is True



def test_a_model_config_folder_whose_tokenizer_json_nests_too_deep_is_a_one_line_error_naming_it(made, tmp_path):
    """--model-config is a user's folder too: diffusers reads its tokenizers' JSON without a depth limit (200,000
    brackets: a RecursionError); it is parsed with the bounded parser first."""
    import shutil

    folder, path = made["digits"]
    shutil.copytree(folder, tmp_path / "config")
    (tmp_path / "config" / "tokenizer" / "tokenizer_config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError) as info:
        load_model(path, "cpu", "fp32", options=LoadOptions(model_config=str(tmp_path / "config")))
    assert str(info.value) == (f"model-config {str(tmp_path / 'config')!r}: tokenizer/tokenizer_config.json nests "
                               "JSON deeper than 64 levels (the limit for this file; a damaged or hostile one): copy "
                               "or download it again")

def test_fp16_and_bf16_files_load_to_the_requested_dtype(made, tmp_path):
    folder, _ = made["digits"]
    for dtype in (torch.float16, torch.bfloat16):
        path = str(tmp_path / f"half-{dtype}.safetensors")
        O.write_single_file(folder, path, "sd1", dtype=dtype)
        assert inspect_checkpoint(path).dtype == {torch.float16: "F16", torch.bfloat16: "BF16"}[dtype]
        m = load_model(path, "cpu", "fp32", options=LoadOptions(model_config=folder))
        ref = load_model(folder, "cpu", "fp32")
        p, q = m.unet.conv_in.weight, ref.unet.conv_in.weight
        assert p.dtype == torch.float32 and torch.equal(p, q.to(dtype).float())


def test_a_checkpoint_without_a_vae_names_the_flag_and_loads_with_one(made, tmp_path):
    folder, _ = made["digits"]
    path = str(tmp_path / "novae.safetensors")
    O.write_single_file(folder, path, "sd1", drop=("first_stage_model.",))
    assert inspect_checkpoint(path).has_vae is False
    with pytest.raises(ValueError, match=r"has no VAE inside.*--vae"):
        load_model(path, "cpu", "fp32", options=LoadOptions(model_config=folder))
    # the VAE as a single file in the original layout (a VAE-only file), and as a diffusers folder
    vae_file = str(tmp_path / "vae.safetensors")
    ref = load_model(folder, "cpu", "fp32")
    state = {k[len("first_stage_model."):]: v for k, v in
             O.to_original(ref.unet, ref.vae, ref.text_encoders, "sd1").items() if k.startswith("first_stage_model.")}
    save_file({k: v.contiguous() for k, v in state.items()}, vae_file)
    for vae in (vae_file, os.path.join(folder, "vae")):
        m = load_model(path, "cpu", "fp32", options=LoadOptions(model_config=folder, vae=vae))
        assert all(torch.equal(a, b) for a, b in zip(m.vae.state_dict().values(), ref.vae.state_dict().values()))


def test_a_vae_file_rewritten_while_it_is_read_is_a_one_line_error(made, tmp_path, monkeypatch):
    """A single-file VAE is streamed into tensors (safe_tensors), never mapped: rewritten in place between two of its
    reads, the load is a ValueError naming the file and what to do, never a SIGBUS; read again, it loads."""
    from diffgraph.models.single_file import load_vae
    from diffgraph.safe_files import OpenFile

    folder, _ = made["digits"]
    ref = load_model(folder, "cpu", "fp32").vae
    vae_file = str(tmp_path / "vae.safetensors")
    save_file(ref.state_dict(), vae_file)  # (diffusers' layout: a model class's from_single_file reads it too)
    os.utime(vae_file, ns=(0, 0))
    real, reads = OpenFile.readinto, []

    def rewriting(self, view, offset):
        real(self, view, offset)
        reads.append(offset)
        if len(reads) == 1:
            os.utime(vae_file)  # (a writer's mtime; the bytes stay, so the next load reads the same weights)

    monkeypatch.setattr(OpenFile, "readinto", rewriting)
    with pytest.raises(ValueError) as e:
        load_vae(vae_file, torch.float32, folder, 1 << 40)
    assert str(e.value) == f"vae {vae_file!r} changed while it was read; wait until it is written completely, then " \
        "load it again" and len(reads) == 1
    vae = load_vae(vae_file, torch.float32, folder, 1 << 40)
    assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), ref.state_dict().values(), strict=True))


def test_an_fp16_safe_vae_file_decodes_sdxl_in_fp16_with_no_vae_upcast(made, tmp_path):
    """A single-file VAE carries no config: it is read with the model's, whose force_upcast (SDXL's) keeps an fp16
    model's decode in fp32; `vae_upcast=False` (--no-vae-upcast) is how an fp16-safe file (sdxl-vae-fp16-fix) says
    otherwise, and `True` forces the upcast on any VAE."""
    folder, _ = made["digits-xl"]
    ref = load_model(folder, "cpu", "fp32")
    vae_file = str(tmp_path / "sdxl-vae-fp16-fix.safetensors")
    state = O.to_original(ref.unet, ref.vae, ref.text_encoders, "sdxl")
    save_file({k[len("first_stage_model."):]: v.half().contiguous() for k, v in state.items()
               if k.startswith("first_stage_model.")}, vae_file)
    cases = ((None, torch.float32), (False, torch.float16), (True, torch.float32))
    for upcast, decode in cases:
        m = load_model(folder, "cpu", "fp16", options=LoadOptions(vae=vae_file, vae_upcast=upcast))
        assert m.vae.config.force_upcast is (upcast is not False)
        assert m.adapter.vae_dtype(m) == decode, upcast
        assert torch.equal(m.vae.decoder.conv_in.weight, ref.vae.decoder.conv_in.weight.half())
    from diffgraph.api.config import load_config
    assert load_config(None, {"vae": vae_file, "vae_upcast": False}).load_options().vae_upcast is False
    with pytest.raises(ValueError, match="vae-upcast must be true or false"):
        load_config(None, {"vae_upcast": "maybe"})


def test_vae_override_on_a_folder_replaces_its_vae(made, tmp_path):
    folder, _ = made["digits"]
    other = load_model(made["sd1-inpaint"][0], "cpu", "fp32")  # another VAE of the same (tiny) architecture
    assert not torch.equal(other.vae.decoder.conv_in.weight, load_model(folder, "cpu", "fp32").vae.decoder.conv_in.weight)
    m = load_model(folder, "cpu", "fp32", options=LoadOptions(vae=os.path.join(made["sd1-inpaint"][0], "vae")))
    assert torch.equal(m.vae.decoder.conv_in.weight, other.vae.decoder.conv_in.weight)
    with pytest.raises(ValueError, match="vae needs a model folder or checkpoint"):
        load_model("random:tiny", "cpu", "fp32", options=LoadOptions(vae=os.path.join(folder, "vae")))


@pytest.mark.parametrize("layout", ["vae folder", "pipeline folder"])
def test_a_vae_folder_cut_after_it_loaded_changes_nothing_and_one_cut_while_it_loads_is_refused(
        made, tmp_path, cut_while_loading, layout):
    """diffusers maps a `--vae` folder's weights, and on the CPU at the file's dtype the VAE's parameters stayed views
    of that map: a folder rewritten in place while (or after) it loaded could kill the process with SIGBUS. It is
    streamed through the checked reader instead: cut after it loaded, the VAE keeps its weights; cut while it loads,
    the load is a one-line ValueError naming the file and saying to wait; cut before, one naming the file."""
    import shutil

    from diffgraph.models.single_file import load_vae
    folder, _ = made["digits"]
    ref = load_model(folder, "cpu", "fp32").vae
    source = tmp_path / "vae" if layout == "vae folder" else tmp_path
    shutil.copytree(os.path.join(folder, "vae"), tmp_path / "vae")
    if layout == "pipeline folder":
        shutil.copy(os.path.join(folder, "model_index.json"), tmp_path)
    weights = tmp_path / "vae" / "diffusion_pytorch_model.safetensors"
    whole = weights.read_bytes()
    vae = load_vae(str(source), torch.float32, folder, 1 << 40)
    weights.write_bytes(b"")
    assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), ref.state_dict().values(), strict=True))
    weights.write_bytes(whole)
    cuts = cut_while_loading(str(weights))
    rel = "diffusion_pytorch_model.safetensors" if layout == "vae folder" else "vae/diffusion_pytorch_model.safetensors"
    with pytest.raises(ValueError) as e:
        load_vae(str(source), torch.float32, folder, 1 << 40)
    assert cuts and str(e.value).startswith(f"vae {str(source)!r}: {rel} ") and "\n" not in str(e.value)
    assert str(e.value).endswith("; wait until it is written completely, or copy it again"), e.value
    with pytest.raises(ValueError) as e:
        load_vae(str(source), torch.float32, folder, 1 << 40)
    assert str(e.value).startswith(f"vae {str(source)!r}: {rel} is not a readable safetensors file (0 bytes"), e.value
    assert "\n" not in str(e.value) and "copy" in str(e.value)

def test_without_model_config_the_detected_config_is_used_and_never_downloaded(made):
    # the tiny model is not SD1.5's architecture: the detected SD1.5 config (written here, offline) says so in a line
    _, path = made["digits"]
    with pytest.raises(ValueError) as e:
        load_model(path, "cpu", "fp32")
    msg = str(e.value)
    assert "\n" not in msg and "SD1.x (512, epsilon)" in msg and "--model-config" in msg and "[77, 64]" in msg


def test_the_written_configs_are_the_published_architectures():
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTokenizer

    from diffgraph.models.clip_vocab import default_cache_root

    sizes = {"sd1": 859.52, "sd2-base": 865.91, "sd2-v": 865.91, "sdxl-base": 2567.46}
    for kind in C.KINDS:
        folder = C.config_folder(kind, default_cache_root())
        assert C.config_folder(kind, default_cache_root()) == folder  # written once
        with torch.device("meta"):
            unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder, subfolder="unet"))
            AutoencoderKL.from_config(AutoencoderKL.load_config(folder, subfolder="vae"))
        base = C.KINDS[kind][0]
        assert round(sum(p.numel() for p in unet.parameters()) / 1e6, 2) == pytest.approx(sizes[base], abs=0.02)
        assert unet.config.in_channels == (9 if C.KINDS[kind][2] else 4)
        index = json.load(open(os.path.join(folder, "model_index.json")))
        assert index["_class_name"] == C.KINDS[kind][1]
        for sub, pad in C.tokenizer_pads(kind).items():
            tok = CLIPTokenizer.from_pretrained(folder, subfolder=sub, local_files_only=True)
            assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
            assert tok.pad_token == pad
        text = CLIPTextConfig.from_pretrained(os.path.join(folder, "text_encoder"), local_files_only=True)
        assert text.eos_token_id == 2 and text.vocab_size == 49408


def test_sdxl_pools_at_the_end_of_text_token_with_the_real_tokenizer():
    """With `eos_token_id: 2` as shipped, transformers pools at the highest id: CLIP's end-of-text token (49407),
    the first one for the EOS-padded tokenizer and the only one for the "!"-padded second tokenizer."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    from diffgraph.models.clip_vocab import default_cache_root

    folder = C.config_folder("sdxl-base", default_cache_root())
    config = CLIPTextConfig.from_pretrained(os.path.join(folder, "text_encoder_2"), local_files_only=True)
    small = CLIPTextConfig(**{**config.to_dict(), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "projection_dim": 16})
    torch.manual_seed(0)
    model = CLIPTextModelWithProjection(small).eval()
    for sub in ("tokenizer", "tokenizer_2"):
        tok = CLIPTokenizer.from_pretrained(folder, subfolder=sub, local_files_only=True)
        ids = tok(PROMPT, padding="max_length", max_length=77, return_tensors="pt").input_ids
        end = int((ids[0] == 49407).nonzero()[0])
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
            at_end = model.text_projection(model.text_model.final_layer_norm(out.last_hidden_state[0, end])) \
                if hasattr(model, "text_model") else \
                model.text_projection(out.last_hidden_state[0, end])
        assert torch.allclose(out.text_embeds[0], at_end, atol=1e-6)


# -- detection from headers: the full-size key layouts, without their bytes -------------------------------------------

def _classify(path: str):
    """inspect_checkpoint's classification of a header-only file (which holds no tensor bytes)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {})
    return classify(path, {k: tuple(v["shape"]) for k, v in header.items()},
                    {k: v["dtype"] for k, v in header.items()}, meta)


@pytest.fixture(scope="module")
def layouts():
    return {name: O.full_size_layout(name) for name in ("random:sd15", "sd2", "random:sdxl")}


def _write(tmp_path, name, tensors, metadata=None):
    path = str(tmp_path / name)
    O.header_only(path, tensors, metadata)
    return path


def _inpaint(tensors):
    key = "model.diffusion_model.input_blocks.0.0.weight"
    dtype, shape = tensors[key]
    return {**tensors, key: (dtype, (shape[0], 9, *shape[2:]))}


def test_kinds_are_detected_from_the_real_key_layouts(layouts, tmp_path, caplog):
    sd15, sd2, sdxl = layouts["random:sd15"], layouts["sd2"], layouts["random:sdxl"]
    cases = [("a.safetensors", sd15, None, "sd1", None), ("b.safetensors", _inpaint(sd15), None, "sd1-inpaint", None),
             ("c.safetensors", sdxl, None, "sdxl-base", None), ("d.safetensors", _inpaint(sdxl), None, "sdxl-inpaint", None),
             ("e.safetensors", _inpaint(sd2), None, "sd2-inpaint", None),
             ("f.safetensors", sd2, {"modelspec.architecture": "stable-diffusion-v2-512"}, "sd2-base", "epsilon"),
             ("g.safetensors", sd2, {"modelspec.architecture": "stable-diffusion-v2-768-v"}, "sd2-v", "v_prediction"),
             ("sd21-768.safetensors", sd2, None, "sd2-v", "v_prediction"),
             ("sd21-base.safetensors", sd2, None, "sd2-base", "epsilon")]
    for name, tensors, meta, kind, prediction in cases:
        info = _classify(_write(tmp_path, name, tensors, meta))
        assert (info.kind, info.prediction_type, info.has_vae, info.dtype) == (kind, prediction, True, "F16"), name
    caplog.clear()
    info = _classify(_write(tmp_path, "plain.safetensors", sd2))
    assert info.kind == "sd2-v" and "--prediction-type epsilon" in caplog.text  # SD2's default, with a warning
    marked = _classify(_write(tmp_path, "noob.safetensors", {**sdxl, "v_pred": ("F16", (0,)), "ztsnr": ("F16", (0,))}))
    assert (marked.kind, marked.prediction_type, marked.zero_snr) == ("sdxl-base", "v_prediction", True)
    novae = {k: v for k, v in sd15.items() if not k.startswith("first_stage_model.")}
    assert _classify(_write(tmp_path, "novae.safetensors", novae)).has_vae is False


def test_foreign_files_get_one_line_naming_what_they_look_like(layouts, tmp_path):
    sd15, sdxl = layouts["random:sd15"], layouts["random:sdxl"]
    unet_only = {k: v for k, v in sd15.items() if k.startswith("model.diffusion_model.")}
    refiner = {**{k: v for k, v in sdxl.items() if not k.startswith("conditioner.")},
               "conditioner.embedders.0.model.token_embedding.weight": ("F16", (49408, 1280))}
    cases = {
        "lora": ({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": ("F16", (4, 320))}, "a LoRA adapter"),
        "embedding": ({"emb_params": ("F32", (2, 768))}, "textual-inversion embedding"),
        "vae": ({"encoder.conv_in.weight": ("F16", (128, 3, 3, 3)), "decoder.conv_in.weight": ("F16", (512, 4, 3, 3))},
                "a VAE file"),
        "controlnet": ({"control_model.input_hint_block.0.weight": ("F16", (16, 3, 3, 3))}, "a ControlNet"),
        "sd3": ({"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": ("F16", (4608, 1536))}, "SD3"),
        "flux": ({"double_blocks.0.img_attn.qkv.weight": ("BF16", (9216, 3072))}, "Flux"),
        "svd": ({**sd15, "model.diffusion_model.input_blocks.1.0.time_stack.in_layers.0.weight": ("F16", (320,))},
                "video model"),
        "diffusers-unet": ({"down_blocks.0.resnets.0.conv1.weight": ("F16", (320, 320, 3, 3))}, "diffusers-format"),
        "pix2pix": ({**sd15, "model.diffusion_model.input_blocks.0.0.weight": ("F16", (320, 8, 3, 3))}, "instruct-pix2pix"),
        "unet-only": (unet_only, "without its text encoders"),
        "refiner": (refiner, "SDXL refiner"),
        "other": ({"transformer.h.0.attn.weight": ("F16", (8, 8))}, "not a Stable Diffusion checkpoint"),
    }
    for name, (tensors, words) in cases.items():
        with pytest.raises(ValueError) as e:
            _classify(_write(tmp_path, f"{name}.safetensors", tensors))
        assert words in str(e.value) and "\n" not in str(e.value), name


def test_bad_files_are_refused_in_one_line(made, tmp_path):
    folder, good = made["digits"]
    data = open(good, "rb").read()
    pickled = tmp_path / "model.ckpt"
    torch.save({"state_dict": {"a": torch.zeros(1)}}, pickled)
    renamed = tmp_path / "renamed.safetensors"
    renamed.write_bytes(pickled.read_bytes())
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    bad_len = tmp_path / "badlen.safetensors"
    bad_len.write_bytes((10**12).to_bytes(8, "little") + data[8:])
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    cases = {str(pickled): "pickle checkpoint", str(renamed): "pickle .ckpt renamed", str(truncated): "truncated",
             str(bad_len): "header length", str(empty): "too few", str(tmp_path / "model.bin"): "pickle checkpoint"}
    (tmp_path / "model.bin").write_bytes(b"PK\x03\x04")
    os.mkfifo(tmp_path / "pipe.safetensors")  # refused by its type, never opened (an open would block)
    cases[str(tmp_path / "pipe.safetensors")] = "FIFO"
    for path, words in cases.items():
        with pytest.raises(ValueError) as e:
            load_model(path, "cpu", "fp32", options=LoadOptions(model_config=folder))
        assert words in str(e.value) and "\n" not in str(e.value), path
    # NaN weights: named, one line
    state = O.to_original(*O.load_folder_modules(folder), "sd1")
    state["model.diffusion_model.out.2.weight"] = state["model.diffusion_model.out.2.weight"].clone()
    state["model.diffusion_model.out.2.weight"][0, 0, 0, 0] = float("nan")
    nan = str(tmp_path / "nan.safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, nan)
    with pytest.raises(ValueError, match=r"NaN or infinite weights \(UNet2DConditionModel\.conv_out\.weight\)"):
        load_model(nan, "cpu", "fp32", options=LoadOptions(model_config=folder))


def test_generate_from_a_checkpoint_file_on_the_command_line(made, tmp_path):
    folder, path = made["digits"]
    out = tmp_path / "out.png"
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    proc = subprocess.run([sys.executable, "-m", "diffgraph.cli", "generate", PROMPT, "--model", path,
                           "--model-config", folder, "--steps", "4", "--guidance", "4", "--seed", "3",
                           "--device", "cpu", "-o", str(out)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    from PIL import Image
    # another process may round a few pixels the other way (its own kernels' choices): within 1 level
    cli = np.asarray(Image.open(out).convert("RGB")).astype(int)
    assert np.abs(cli - _image(folder).astype(int)).max() <= 1
    (tmp_path / "x.ckpt").write_bytes(b"PK\x03\x04")
    bad = subprocess.run([sys.executable, "-m", "diffgraph.cli", "generate", PROMPT, "--model",
                          str(tmp_path / "x.ckpt"), "--device", "cpu"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


@pytest.mark.parametrize("text, words", [("{not json", "is not valid JSON"), ("[1, 2]", "holds a JSON list"),
                                         (b"\xff\xfe{}", "is not valid JSON"),
                                         ("[" * 200_000, "nests JSON deeper than 64 levels")])
def test_a_folder_whose_model_index_is_not_a_json_object_is_refused_naming_the_file(tmp_path, text, words):
    """A broken model_index.json (a model folder, or a checkpoint's --model-config) is a one-line error naming the file,
    not a bare JSONDecodeError."""
    folder = tmp_path / "model"
    folder.mkdir()
    index = folder / "model_index.json"
    index.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=f"model_index.json' {words}") as e:
        load_model(str(folder), "cpu", torch.float32)
    assert str(index) in str(e.value) and "restore the folder's model_index.json" in str(e.value)
    from diffgraph.models.single_file import _pipeline_class
    with pytest.raises(ValueError, match=words):
        _pipeline_class(str(folder))


def test_a_model_dir_file_with_a_sidecar_loads_with_its_config_folder(made, tmp_path):
    from diffgraph.models.catalog import ModelDir

    folder, path = made["digits"]
    root = tmp_path / "models"
    (root / "configs").mkdir(parents=True)
    shutil.copytree(folder, root / "configs" / "digits")
    shutil.copy(path, root / "digits.safetensors")
    entry = ModelDir(str(root)).resolve("digits")
    with pytest.raises(ValueError, match=r"does not fit the SD1.x .* is \[77, 64\] in the file, \[77, 768\] in"):
        load_model(entry.path, "cpu", "fp32")
    (root / "digits.diffgraph.toml").write_text('config = "configs/digits"\n')
    entry = ModelDir(str(root)).resolve("digits")
    assert (entry.family, entry.native_size) == ("sd", 64)
    assert np.array_equal(_image(entry.path), _image(load_model(folder, "cpu", "fp32")))
    (root / "digits.diffgraph.toml").write_text('config = "configs/none"\n')
    with pytest.raises(ValueError, match="is not a diffusers folder"):
        load_model(entry.path, "cpu", "fp32")


def test_a_sidecar_preset_reads_the_file_with_that_presets_config(made, tmp_path):
    from diffgraph.models import loader
    from diffgraph.models.checkpoint_configs import config_folder

    path = tmp_path / "model.safetensors"
    shutil.copy(made["digits"][1], path)
    (tmp_path / "model.diffgraph.toml").write_text('preset = "sd2-v"\n')
    options = loader._with_sidecar(str(path), LoadOptions(model_config=made["digits"][0]))
    assert options.model_config == config_folder("sd2-v", os.environ["DIFFGRAPH_CACHE"])  # over --model-config
    with pytest.raises(ValueError, match=r"does not fit the --model-config .* from its sidecar model.diffgraph.toml: "
                                         "fix or remove it"):
        load_model(str(path), "cpu", "fp32")


def _from_single_file(path: str, folder: str, dtype: torch.dtype):
    """diffusers' own pipeline `from_single_file` over the path (which it maps): the oracle of the streamed load."""
    import diffusers

    name = json.load(open(os.path.join(folder, "model_index.json")))["_class_name"]
    extra = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False} \
        if name == "StableDiffusionPipeline" else {}
    return getattr(diffusers, name).from_single_file(path, config=folder, local_files_only=True, torch_dtype=dtype,
                                                     **extra)


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


@pytest.mark.parametrize("kind,file_dtype,dtype", [("sd1", None, "fp32"), ("sd1", torch.float16, "fp16"),
                                                   ("sdxl", None, "fp32"), ("sdxl", torch.float16, "fp32")])
def test_the_streamed_load_equals_diffusers_from_single_file_bit_for_bit(tmp_path, kind, file_dtype, dtype):
    """Each component made from only its own tensors, streamed: the same parameters and buffers (values and dtypes),
    scheduler config and tokenisers as diffusers' pipeline `from_single_file` reading the whole file."""
    folder = O.variant_folder(str(tmp_path), kind)
    path = str(tmp_path / f"{kind}.safetensors")
    O.write_single_file(folder, path, O.VARIANTS[kind][1], dtype=file_dtype)
    m = load_model(path, "cpu", dtype, options=LoadOptions(model_config=folder))
    pipe = _from_single_file(path, folder, {"fp32": torch.float32, "fp16": torch.float16}[dtype])
    ours = (m.unet, m.vae, *m.text_encoders)
    theirs = (pipe.unet, pipe.vae, pipe.text_encoder, *([pipe.text_encoder_2] if kind == "sdxl" else []))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        x, y = _tensors(a), _tensors(b)
        assert x.keys() == y.keys() and x
        assert all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in y)
    assert m.scheduler_config == dict(pipe.scheduler.config)
    assert [t(PROMPT).input_ids for t in m.tokenizers] == \
        [t(PROMPT).input_ids for t in (pipe.tokenizer, *([pipe.tokenizer_2] if kind == "sdxl" else []))]


def test_nothing_maps_or_copies_the_checkpoint(made, monkeypatch):
    """The checkpoint is streamed by safe_tensors: no mmap, no safetensors reader, no private copy of the file."""
    import mmap

    import safetensors
    import safetensors.torch
    from diffusers.loaders import single_file_utils

    from diffgraph import safe_files

    folder, path = made["digits-xl"]
    ref = load_model(path, "cpu", "fp32", options=LoadOptions(model_config=folder))

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was mapped or copied")
    for owner, attr in ((mmap, "mmap"), (safetensors, "safe_open"), (safetensors.torch, "load_file"),
                        (safetensors.torch, "safe_open"), (safe_files, "private_copy"),
                        (safe_files, "private_view"), (single_file_utils, "load_single_file_checkpoint")):
        monkeypatch.setattr(owner, attr, refuse)
    m = load_model(path, "cpu", "fp32", options=LoadOptions(model_config=folder))
    for a, b in zip((m.unet, m.vae, *m.text_encoders), (ref.unet, ref.vae, *ref.text_encoders), strict=True):
        x, y = a.state_dict(), b.state_dict()
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in y)


def test_each_component_is_read_and_made_on_the_models_device(made, tmp_path, monkeypatch):
    """The reader is asked for the model's device and every parameter and buffer of every component (a --vae file's
    too) is made there: the meta device stands in for a GPU, so a tensor copied through the host on the way would
    show as a CPU one. A CPU load reads to the CPU."""
    from diffgraph.models import single_file
    from diffgraph.models.families import default_registry
    from diffgraph.safe_tensors import TensorFile

    asked, read = [], TensorFile.read

    def spy(self, keys=None, device=None, dtype=None):
        out = read(self, keys, device, dtype)
        if out:  # (tokenizers and schedulers read no tensors)
            asked.append(device)
        return out
    monkeypatch.setattr(TensorFile, "read", spy)
    folder, path = made["digits"]
    vae_file = str(tmp_path / "vae.safetensors")
    save_file({k: v.contiguous() for k, v in _tensors(load_model(folder, "cpu", "fp32").vae).items()}, vae_file)
    asked.clear()
    load_model(path, "cpu", "fp32", options=LoadOptions(model_config=folder))
    assert len(asked) == 3 and set(asked) == {torch.device("cpu")}  # UNet, VAE, text encoder
    monkeypatch.setattr(single_file, "_check_finite", lambda path, modules: None)  # (meta tensors hold no values)
    meta = torch.device("meta")
    for name, vae in (("digits", None), ("digits", vae_file), ("digits-xl", None), ("sd2", None)):
        folder, path = made[name]
        asked.clear()
        m = single_file.load_single_file(path, meta, torch.float16, name, default_registry(),
                                         LoadOptions(model_config=folder, vae=vae), 1 << 34)
        assert len(asked) == 3 + (name == "digits-xl") and set(asked) == {meta}
        for module in (m.denoiser, m.vae, *m.text_encoders):
            tensors = _tensors(module)
            assert tensors and {t.device for t in tensors.values()} == {meta}, type(module).__name__
            assert {t.dtype for t in module.parameters()} == {torch.float16}


@pytest.mark.parametrize("how", ["in place", "cut", "replaced"])
def test_a_checkpoint_rewritten_while_it_is_read_is_a_one_line_error(made, tmp_path, monkeypatch, how):
    from rewrite_util import rewrite_on_read

    folder, original = made["digits"]
    path = str(tmp_path / "model.safetensors")
    shutil.copyfile(original, path)
    reads = rewrite_on_read(monkeypatch, path, how, after=3)
    with pytest.raises(ValueError) as e:
        load_model(path, "cpu", "fp32", options=LoadOptions(model_config=folder))
    what = "was replaced" if how == "replaced" else "changed"
    assert str(e.value) == f"model {path!r} {what} while it was read; wait until it is written completely, then " \
        "load it again" and len(reads) >= 3
