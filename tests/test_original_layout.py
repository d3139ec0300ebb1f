"""The original-layout test checkpoints (tests/original_layout.py) against diffusers' own single-file conversion.

Each small test model and each shipped preset goes folder -> one original-layout .safetensors -> diffusers'
`from_single_file(file, config=folder, local_files_only=True)`, offline, and must come back with exactly the
folder's parameters. The full-size layouts are checked on the meta device: diffusers' model-kind detection and its
converters must read them as real SD1.5 / SD2 / SDXL checkpoints, key for key and shape for shape.
"""

import json
import os
import socket

import diffusers
import pytest
import torch
from diffusers.loaders import single_file_utils as sfu
from safetensors import safe_open
from safetensors.torch import save_file

from diffgraph.models.loader import load_model
from diffgraph.models.presets import shipped_preset_folder

import original_layout as ol

MODULES = ("unet", "vae", "text_encoder", "text_encoder_2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    dest = str(tmp_path_factory.mktemp("variants"))
    return {kind: ol.variant_folder(dest, kind) for kind in ol.VARIANTS}


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 and every socket connect refused and recorded: the test asserts none was tried."""
    attempts = []

    def refuse(sock, address, *args):
        attempts.append(address)
        raise OSError(f"network disabled in this test (connect to {address})")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def _pipeline_class(folder):
    with open(os.path.join(folder, "model_index.json"), encoding="utf-8") as f:
        return getattr(diffusers, json.load(f)["_class_name"])


def _assert_same(got, want, what):
    got, want = got.state_dict(), want.state_dict()
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        assert got[key].device.type != "meta", f"{what}: {key} was never loaded"
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), f"{what}: {key} differs"


def _round_trip(folder, layout, path, offline):
    ol.write_single_file(folder, path, layout)
    cls = _pipeline_class(folder)
    pipe = cls.from_single_file(path, config=folder, local_files_only=True, dtype=torch.float32)
    assert offline == []
    return pipe, cls.from_pretrained(folder, local_files_only=True, dtype=torch.float32)


@pytest.mark.parametrize("kind", list(ol.VARIANTS))
def test_variant_round_trip_is_exact(folders, kind, tmp_path, offline):
    layout = ol.VARIANTS[kind][1]
    pipe, ref = _round_trip(folders[kind], layout, str(tmp_path / "model.safetensors"), offline)
    for name in MODULES:
        if getattr(ref, name, None) is not None:
            _assert_same(getattr(pipe, name), getattr(ref, name), f"{kind} {name}")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    prefixes = (ol.UNET_PREFIX, ol.VAE_PREFIX, *(p for p, _ in ol.TEXT_PREFIXES[layout]))
    assert all(k.startswith(prefixes) for k in keys)
    assert {f"{ol.UNET_PREFIX}input_blocks.0.0.weight", f"{ol.VAE_PREFIX}decoder.up.0.block.0.conv1.weight"} <= keys


@pytest.mark.parametrize("name, layout", [("digits", "sd1"), ("digits-xl", "sdxl")])
def test_shipped_preset_round_trip_is_exact(name, layout, tmp_path, offline):
    folder = shipped_preset_folder(name)
    if folder is None:
        pytest.skip(f"{name} is not shipped in this install")
    path = str(tmp_path / "model.safetensors")
    pipe, ref = _round_trip(folder, layout, path, offline)
    encoders = [e for e in (ref.text_encoder, getattr(ref, "text_encoder_2", None)) if e is not None]
    for module in ("unet", "vae", "text_encoder"):
        _assert_same(getattr(pipe, module), getattr(ref, module), f"{name} {module}")
    if len(encoders) == 2:
        # digits-xl's two encoders are both 48 wide, and diffusers tells SDXL's encoders apart by width only: its
        # text_encoder_2 gets CLIP-L's weights (and no projection). Real SDXL (768 vs 1280) is unaffected; the
        # second encoder's layout is checked with diffusers' own OpenCLIP converter instead.
        assert encoders[0].config.hidden_size == encoders[1].config.hidden_size
        token = "text_model.embeddings.token_embedding.weight"
        assert torch.equal(ol.text_state(pipe.text_encoder_2)[token], ol.text_state(ref.text_encoder)[token])
        with safe_open(path, "pt") as f:
            checkpoint = {k: f.get_tensor(k) for k in f.keys()}
        converted = sfu.convert_open_clip_checkpoint(ref.text_encoder_2, checkpoint,
                                                     prefix="conditioner.embedders.1.model.")
        state = ref.text_encoder_2.state_dict()
        assert sorted(converted) == sorted(state)
        assert all(torch.equal(converted[k], v) for k, v in state.items())


def test_extras_are_what_real_checkpoints_carry_and_diffusers_ignores(folders, tmp_path, offline):
    unet, vae, encoders = ol.build_modules(ol.VARIANTS["sd2"][0])
    full = ol.to_original(unet, vae, encoders, "sd2")
    bare = ol.to_original(unet, vae, encoders, "sd2", extras=False)
    extra = "cond_stage_model.model.transformer.resblocks.2."  # the tiny encoder has layers 0 and 1
    assert set(full) - set(bare) == {"cond_stage_model.model.logit_scale", "cond_stage_model.model.text_projection",
                                     *(k for k in full if k.startswith(extra))}
    assert {k.replace(extra, "") for k in full if k.startswith(extra)} == {
        "attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight", "attn.out_proj.bias", "ln_1.weight",
        "ln_1.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
        "mlp.c_proj.bias"}
    path = str(tmp_path / "bare.safetensors")
    save_file({k: v.contiguous() for k, v in bare.items()}, path)
    pipe = diffusers.StableDiffusionPipeline.from_single_file(path, config=folders["sd2"], local_files_only=True,
                                                               dtype=torch.float32)
    for module, want in zip(("unet", "vae", "text_encoder"), (unet, vae, encoders[0])):
        _assert_same(getattr(pipe, module), want, f"sd2 without extras {module}")
    sd1 = ol.to_original(*ol.build_modules(ol.VARIANTS["sd1"][0]), "sd1")
    assert sd1["cond_stage_model.transformer.text_model.embeddings.position_ids"].tolist() == [list(range(77))]
    assert sd1["first_stage_model.encoder.mid.attn_1.q.weight"].shape == (32, 32, 1, 1)  # 1x1 convs, as in LDM


def test_dtype_metadata_and_drop(folders, tmp_path, offline):
    folder = folders["sd1"]
    path = str(tmp_path / "half.safetensors")
    ol.write_single_file(folder, path, "sd1", dtype=torch.float16, metadata={"modelspec.title": "tiny"},
                         drop=("first_stage_model.",))
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"modelspec.title": "tiny"}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert tensors and not any(k.startswith("first_stage_model.") for k in tensors)
    assert {v.dtype for k, v in tensors.items() if not k.endswith("position_ids")} == {torch.float16}
    assert tensors["cond_stage_model.transformer.text_model.embeddings.position_ids"].dtype == torch.int64
    ref = diffusers.StableDiffusionPipeline.from_pretrained(folder, local_files_only=True)
    pipe = diffusers.StableDiffusionPipeline.from_single_file(path, config=folder, vae=ref.vae, local_files_only=True,
                                                               dtype=torch.float16)
    assert offline == []
    _assert_same(pipe.unet, ref.unet.to(torch.float16), "fp16 unet")
    _assert_same(pipe.text_encoder, ref.text_encoder.to(torch.float16), "fp16 text encoder")


@pytest.mark.parametrize("preset, pipeline", [("random:tiny", "StableDiffusionPipeline"),
                                              ("random:tiny-inpaint", "StableDiffusionInpaintPipeline"),
                                              ("random:tiny-xl", "StableDiffusionXLPipeline")])
def test_write_folder_is_read_by_load_model_and_diffusers(preset, pipeline, tmp_path):
    model = load_model(preset)
    folder = ol.write_folder(model, str(tmp_path / "model"))
    assert _pipeline_class(folder).__name__ == pipeline
    again = load_model(folder)
    assert again.family == model.family and again.force_zeros_for_empty_prompt == model.force_zeros_for_empty_prompt
    assert again.scheduler_config["beta_schedule"] == model.scheduler_config["beta_schedule"]
    for got, want in zip((again.unet, again.vae, *again.text_encoders), (model.unet, model.vae, *model.text_encoders)):
        _assert_same(got, want, f"{preset} through write_folder")
    pipe = _pipeline_class(folder).from_pretrained(folder, local_files_only=True)
    _assert_same(pipe.unet, model.unet, f"{preset} unet via diffusers")
    assert pipe.tokenizer("a digit").input_ids == model.tokenizers[0]("a digit").input_ids


def test_variants_are_deterministic_and_shaped_as_asked(folders, tmp_path):
    again = ol.variant_folder(str(tmp_path), "sd2")
    for sub in ("unet/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        with open(os.path.join(folders["sd2"], sub), "rb") as a, open(os.path.join(again, sub), "rb") as b:
            assert a.read() == b.read(), sub
    sd2 = diffusers.StableDiffusionPipeline.from_pretrained(again, local_files_only=True)
    assert sd2.unet.config.use_linear_projection and sd2.text_encoder.config.hidden_act == "gelu"
    assert sd2.tokenizer.pad_token == "!"
    assert _pipeline_class(folders["sdxl-inpaint"]).__name__ == "StableDiffusionXLInpaintPipeline"


@pytest.mark.parametrize("preset, kind", [("random:sd15", "v1"), ("sd2", "v2"), ("random:sdxl", "xl_base"),
                                          ("random:sd15-inpaint", "inpainting")])
def test_full_size_layouts_read_as_real_checkpoints(preset, kind):
    unet, vae, encoders = ol.full_size_modules(preset)
    layout = ol.FULL_SIZE[preset][1]
    checkpoint = ol.to_original(unet, vae, encoders, layout)
    assert {v.device.type for v in checkpoint.values()} == {"meta"}
    assert sfu.infer_diffusers_model_type(checkpoint) == kind
    converted = [(sfu.convert_ldm_unet_checkpoint(checkpoint, unet.config), unet.state_dict()),
                 (sfu.convert_ldm_vae_checkpoint(checkpoint, vae.config), vae.state_dict())]
    for encoder, (prefix, text_kind) in zip(encoders, ol.TEXT_PREFIXES[layout]):
        if text_kind == "hf":
            got = sfu.convert_ldm_clip_checkpoint(checkpoint)
            got.pop("text_model.embeddings.position_ids")  # a buffer, not a parameter
        else:
            got = sfu.convert_open_clip_checkpoint(encoder, checkpoint, prefix=prefix)
        converted.append((got, ol.text_state(encoder)))  # both text_model.-prefixed, whatever transformers does
    for got, want in converted:
        assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in want.items()}


def test_full_size_layouts_have_the_real_keys():
    layout = ol.full_size_layout("random:sdxl", "sdxl")
    expected = {
        "model.diffusion_model.input_blocks.0.0.weight": (320, 4, 3, 3),
        "model.diffusion_model.label_emb.0.0.weight": (1280, 2816),
        "model.diffusion_model.output_blocks.2.2.conv.weight": (1280, 1280, 3, 3),
        "model.diffusion_model.output_blocks.8.0.skip_connection.weight": (320, 640, 1, 1),
        "conditioner.embedders.1.model.transformer.resblocks.31.attn.in_proj_weight": (3840, 1280),
        "conditioner.embedders.1.model.text_projection": (1280, 1280),
        "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight": (49408, 768),
        "first_stage_model.decoder.conv_in.weight": (512, 4, 3, 3),
        "first_stage_model.encoder.mid.attn_1.q.weight": (512, 512, 1, 1),
    }
    assert {k: layout[k] for k in expected} == {k: ("F16", v) for k, v in expected.items()}
    assert layout["conditioner.embedders.0.transformer.text_model.embeddings.position_ids"] == ("I64", (1, 77))
    assert "conditioner.embedders.1.model.transformer.resblocks.32.ln_1.weight" not in layout
    sd15 = ol.full_size_layout("random:sd15", "sd1")
    assert sd15[sfu.CHECKPOINT_KEY_NAMES["v1"]] == ("F16", (320, 640, 1, 1))
    assert sd15["model.diffusion_model.input_blocks.1.1.proj_in.weight"] == ("F16", (320, 320, 1, 1))
    sd2 = ol.full_size_layout("sd2", "sd2")
    assert sd2["cond_stage_model.model.transformer.resblocks.23.attn.in_proj_weight"] == ("F16", (3072, 1024))
    assert sd2["model.diffusion_model.input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight"] == ("F16", (320, 1024))


def test_header_only_describes_tensors_without_their_bytes(tmp_path):
    layout = ol.full_size_layout("random:sdxl", "sdxl", dtype="BF16")
    path = str(tmp_path / "sdxl.safetensors")
    ol.header_only(path, layout, metadata={"modelspec.architecture": "stable-diffusion-xl-v1-base"})
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    assert n % 8 == 0 and os.path.getsize(path) == 8 + n
    assert header.pop("__metadata__") == {"modelspec.architecture": "stable-diffusion-xl-v1-base"}
    assert {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()} == layout
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    q = header["first_stage_model.encoder.mid.attn_1.q.weight"]["data_offsets"]
    assert q[1] - q[0] == 2 * 512 * 512
