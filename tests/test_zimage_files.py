"""Z-Image's single files (diffgraph.models.zimage_files): tiny random diffusers / transformers modules written in
the layouts ComfyUI's files use (the transformer by the inverse of the key map here, checked against diffusers' own
converter; the VAE by original_layout.py's inverse of diffusers' converter), read back equal, tensor for tensor, and
loaded strictly; fp8 files of both ComfyUI conventions equal the model holding their dequantised weights; GGUF files
as city96's converter writes them equal the model (BF16, F16 to its rounding) or gguf's own dequantisation; other
quantisations, other kinds of file and damaged files are refused in one line naming the file."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from diffgraph.models.gguf_files import gguf_header
from diffgraph.models.original_layout import vae_original
from diffgraph.models.zimage_files import (Fp8Weight, load_into, qwen3_from_comfy, read_text_encoder,
                                           read_transformer, read_vae, transformer_from_original)
from diffgraph.quantize.fp8 import Fp8Linear
from diffgraph.safe_tensors import read_safetensors
from gguf_util import write_gguf

PREFIX = "model.diffusion_model."
E4M3 = torch.float8_e4m3fn


def tiny_transformer():
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(0)
    model = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64, n_layers=2,
                                     n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                                     axes_dims=[8, 12, 12], axes_lens=[256, 64, 64])
    return _randomised(model)


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return _randomised(Qwen3Model(config))


def tiny_vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(2)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                        latent_channels=16, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False)
    return _randomised(vae)


def _randomised(module):
    """Every parameter random (the pad tokens and norms start as constants, which would hide a swapped key)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return module.eval()


def to_original(state: dict[str, torch.Tensor], prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    """ZImageTransformer2DModel's state dict in ComfyUI's layout: the inverse of zimage_files' map, with Lumina 2's
    unused norm_final that ComfyUI's files carry."""
    out = {}
    for key, value in state.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            key, value = key.replace(".to_q.", ".qkv."), torch.cat(
                [value, state[key.replace(".to_q.", ".to_k.")], state[key.replace(".to_q.", ".to_v.")]])
        key = key.replace("all_x_embedder.2-1.", "x_embedder.").replace("all_final_layer.2-1.", "final_layer.")
        key = key.replace(".to_out.0.", ".out.").replace(".norm_q.", ".q_norm.").replace(".norm_k.", ".k_norm.")
        out[prefix + key] = value.contiguous()
    out[prefix + "norm_final.weight"] = torch.ones(64)
    return out


def diffusers_converted(path: str) -> dict[str, torch.Tensor]:
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    return convert_z_image_transformer_checkpoint_to_diffusers(read_safetensors(path))


def assert_equal_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def one_line_error(call, *words: str) -> str:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message
    return message


# -- the transformer -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", [PREFIX, ""])
def test_transformer_from_comfy_layout_equals_the_model(tmp_path, prefix):
    model = tiny_transformer()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = str(tmp_path / "z_image_turbo_bf16.safetensors")
    save_file(to_original(want, prefix), path)
    got = read_transformer(path, dtype=torch.float32)
    assert got.quantisation == "none" and got.fp8 == {}
    assert_equal_state(got.state, want)
    assert_equal_state(got.state, diffusers_converted(path))  # diffusers' own converter reads the file alike
    other = _fresh_transformer()
    assert load_into(other, got) == ()
    assert all(torch.equal(other.state_dict()[k], v) for k, v in want.items())


def _fresh_transformer():
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64, n_layers=2,
                                    n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                                    axes_dims=[8, 12, 12], axes_lens=[256, 64, 64])


def test_transformer_in_diffusers_names_reads_as_it_is(tmp_path):
    want = {k: v.detach().clone() for k, v in tiny_transformer().state_dict().items()}
    path = str(tmp_path / "z.safetensors")
    save_file({PREFIX + k: v for k, v in want.items()}, path)
    assert_equal_state(read_transformer(path, dtype=torch.float32).state, want)


def test_qkv_split_of_grouped_heads():
    """q takes in_features rows, k and v half the rest each (n_kv_heads < n_heads); a per-row scale splits alike."""
    w, scale = torch.arange(8 * 4.).reshape(8, 4), torch.arange(8.)
    out = transformer_from_original({"layers.0.attention.qkv.weight": w, "layers.0.attention.qkv.weight_scale": scale})
    assert [out[f"layers.0.attention.to_{x}.weight"].shape[0] for x in "qkv"] == [4, 2, 2]
    assert torch.equal(out["layers.0.attention.to_v.weight"], w[6:])
    assert torch.equal(out["layers.0.attention.to_k.weight_scale"], scale[4:6])


def _quantised(original: dict[str, torch.Tensor], per_row: bool) -> tuple[dict, dict]:
    """Each 2-D weight in e4m3 with its scale (one per tensor, or per row), and the dequantised original."""
    fp8, dequantised = {}, dict(original)
    for key, w in original.items():
        if not key.endswith(".weight") or w.ndim != 2:
            continue
        amax = w.abs().amax(dim=1) if per_row else w.abs().amax().reshape(())
        scale = (amax / 448.0).float()
        q = (w / (scale.reshape(-1, 1) if per_row else scale)).to(E4M3)
        fp8[key] = (q, scale)
        dequantised[key] = q.float() * (scale.reshape(-1, 1) if per_row else scale)
    return fp8, dequantised


@pytest.mark.parametrize("convention,per_row", [("scaled_fp8", False), ("quantization_metadata", False),
                                                ("quantization_metadata", True)])
def test_fp8_transformer_equals_its_dequantised_model(tmp_path, convention, per_row):
    model = tiny_transformer()
    original = to_original(model.state_dict())
    fp8, dequantised = _quantised(original, per_row)
    tensors, layers = dict(original), {}
    for key, (q, scale) in fp8.items():
        layer = key.removesuffix(".weight")
        tensors[key] = q
        if convention == "scaled_fp8":
            tensors[layer + ".scale_weight"], tensors[layer + ".scale_input"] = scale, torch.tensor(1.0)
        else:
            tensors[layer + ".weight_scale"], tensors[layer + ".input_scale"] = scale, torch.tensor(0.5)
            layers[layer] = {"format": "float8_e4m3fn"}
    metadata = None
    if convention == "scaled_fp8":
        tensors[PREFIX + "scaled_fp8"] = torch.empty(0, dtype=E4M3)
    else:
        metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    path = str(tmp_path / "z_image_turbo_fp8_scaled.safetensors")
    save_file(tensors, path, metadata=metadata)
    plain = str(tmp_path / "dequantised.safetensors")
    save_file(dequantised, plain)
    want = diffusers_converted(plain)

    got = read_transformer(path, dtype=torch.float32)
    assert got.quantisation == convention and got.fp8 == {}
    assert_equal_state(got.state, want)

    kept = read_transformer(path, dtype=torch.float32, keep_fp8=True)
    assert sorted(kept.fp8) == sorted(k.removesuffix(".weight") for k, v in want.items()
                                      if v.ndim == 2 and k not in kept.state)
    assert "layers.1.attention.to_v" in kept.fp8 and "layers.1.attention.to_v.weight" not in kept.state
    for layer, pair in kept.fp8.items():
        assert pair.weight.dtype == E4M3 and pair.scale.dtype == torch.float32
        assert pair.granularity == ("channel" if per_row else "tensor")
        assert torch.equal(pair.dequantised(torch.float32), want[layer + ".weight"]), layer
    fresh = _fresh_transformer()
    installed = load_into(fresh, kept)
    smaller = _fresh_transformer()
    del smaller.layers[1]
    one_line_error(lambda: load_into(smaller, kept), path, "layers.1.", "no place for")
    assert "layers.0.attention.to_q" in installed and "layers.0.feed_forward.w1" not in installed  # 170 rows: not /16
    assert isinstance(fresh.get_submodule("layers.0.attention.to_q"), Fp8Linear)
    assert torch.equal(fresh.get_submodule("layers.0.attention.to_q").weight.view(torch.uint8),
                       kept.fp8["layers.0.attention.to_q"].weight.view(torch.uint8))
    assert torch.equal(fresh.layers[0].feed_forward.w1.weight, want["layers.0.feed_forward.w1.weight"])
    assert torch.equal(fresh.cap_embedder[1].bias, want["cap_embedder.1.bias"])


def test_plain_fp8_weights_read_with_scale_one(tmp_path):
    model = tiny_transformer()
    original = {k: (v.to(E4M3) if k.endswith("qkv.weight") else v) for k, v in to_original(model.state_dict()).items()}
    path = str(tmp_path / "z_fp8.safetensors")
    save_file(original, path)
    got = read_transformer(path, dtype=torch.float32)
    assert got.quantisation == "fp8"
    assert torch.equal(got.state["layers.0.attention.to_k.weight"],
                       original[PREFIX + "layers.0.attention.qkv.weight"][64:128].float())
    kept = read_transformer(path, dtype=torch.float32, keep_fp8=True)
    assert kept.fp8["noise_refiner.0.attention.to_q"].scale.tolist() == [1.0]


# -- refused quantisations ------------------------------------------------------------------------------------------

def _refused_layer(fmt: str) -> tuple[dict[str, torch.Tensor], str | None]:
    layer = PREFIX + "layers.0.attention.qkv"
    if fmt == "int8_blockwise":
        return {layer + ".weight": torch.ones(192, 64, dtype=torch.int8),
                layer + ".weight_scale": torch.ones(2, 1)}, fmt
    if fmt == "mxfp8":
        return {layer + ".weight": torch.ones(192, 64).to(E4M3),
                layer + ".weight_scale": torch.full((192, 2), 127, dtype=torch.uint8)}, fmt
    if fmt == "nvfp4":
        return {layer + ".weight": torch.ones(192, 32, dtype=torch.uint8),
                layer + ".weight_scale": torch.ones(192, 4).to(E4M3), layer + ".weight_scale_2": torch.ones(())}, fmt
    if fmt == "nvfp4 without metadata":
        return _refused_layer("nvfp4")[0], None
    if fmt == "comfy_quant marker":  # the per-layer marker names a format the dtypes alone would call int8_tensorwise
        marker = torch.tensor(list(json.dumps({"format": "w4a8_int8"}).encode()), dtype=torch.uint8)
        return {layer + ".weight": torch.ones(192, 64, dtype=torch.int8), layer + ".weight_scale": torch.ones(()),
                layer + ".comfy_quant": marker}, None
    return {layer + ".qweight": torch.ones(192, 32, dtype=torch.int8), layer + ".wscales": torch.ones(1, 192),
            layer + ".smooth_factor": torch.ones(64), layer + ".proj_down": torch.ones(64, 16),
            layer + ".proj_up": torch.ones(192, 16)}, None


@pytest.mark.parametrize("fmt,named", [("int8_blockwise", "int8_blockwise"), ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"),
                                       ("nvfp4 without metadata", "nvfp4"), ("comfy_quant marker", "w4a8_int8"),
                                       ("svdquant", "nunchaku SVDQuant")])
def test_refused_quantisations_name_their_format(tmp_path, fmt, named):
    tensors = {k: v for k, v in to_original(tiny_transformer().state_dict()).items() if ".layers.0.attention.qkv."
               not in k}
    extra, meta_format = _refused_layer(fmt)
    tensors.update(extra)
    metadata = None if meta_format is None else {"_quantization_metadata": json.dumps(
        {"format_version": "1.0", "layers": {PREFIX + "layers.0.attention.qkv": {"format": meta_format}}})}
    path = str(tmp_path / "z_image_turbo_q.safetensors")
    save_file(tensors, path, metadata=metadata)
    message = one_line_error(lambda: read_transformer(path), path, named, "bf16 or fp8")
    assert "layers.0.attention.qkv" in message


# -- GGUF quantisations of the transformer ---------------------------------------------------------------------------

@pytest.mark.parametrize("qtype,prefix", [("BF16", ""), ("F16", PREFIX)])
def test_gguf_of_plain_floats_equals_the_model(tmp_path, qtype, prefix):
    model = tiny_transformer()
    dtype = torch.bfloat16 if qtype == "BF16" else torch.float32
    want = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    path = str(tmp_path / f"z_image_turbo-{qtype}.gguf")
    import gguf

    write_gguf(path, to_original(want, prefix), gguf.GGMLQuantizationType[qtype])
    got = read_transformer(path, dtype=dtype, device="cpu")
    assert got.quantisation == "gguf" and got.fp8 == {}
    if qtype == "F16":  # a float32 model's 2-D weights in fp16, its 1-D ones kept in F32
        want = {k: v.half().float() if v.ndim > 1 and v.numel() > 1024 else v for k, v in want.items()}
        assert sum(not torch.equal(got.state[k], model.state_dict()[k]) for k in want) > 20  # the rounding is there
    assert_equal_state(got.state, want)  # BF16: exactly the model
    fresh = _fresh_transformer().to(dtype)
    assert load_into(fresh, got) == ()
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())


@pytest.mark.parametrize("qtype,shape_fix", [("Q8_0", False), ("Q4_0", True)])
def test_quantised_gguf_equals_ggufs_dequantisation(tmp_path, qtype, shape_fix):
    import gguf

    original = to_original(tiny_transformer().state_dict(), "")
    held = write_gguf(tmp_path / "z_image_turbo-Q.gguf", original, gguf.GGMLQuantizationType[qtype], shape_fix)
    header = gguf_header(str(tmp_path / "z_image_turbo-Q.gguf"))
    assert header.types()[qtype] >= 20 and header.architecture == "lumina2"
    assert bool(header.orig_shapes) == shape_fix and header.shapes() == {k: tuple(v.shape) for k, v in original.items()}
    got = read_transformer(str(tmp_path / "z_image_turbo-Q.gguf"), dtype=torch.float32)
    want = transformer_from_original(held)
    assert_equal_state(got.state, want)
    assert not torch.equal(want["layers.0.attention.to_q.weight"],  # the quantisation's error is there
                           transformer_from_original(original)["layers.0.attention.to_q.weight"])
    assert load_into(_fresh_transformer(), got) == ()


def test_damaged_or_unreadable_gguf_is_refused_in_one_line(tmp_path):
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    original = to_original(tiny_transformer().state_dict(), "")
    path = str(tmp_path / "z_image_turbo-Q8_0.gguf")
    write_gguf(path, original, Q.Q8_0)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    one_line_error(lambda: read_transformer(path), path, "is not a readable GGUF file", "truncated")
    w = gguf.GGUFWriter(path, "lumina2")  # one tensor in a type diffgraph does not read
    for key, value in original.items():
        if key == "t_embedder.mlp.0.weight":  # [1024, 256]: whole IQ2_XXS blocks
            w.add_tensor(key, np.random.default_rng(0).integers(0, 256, (1024, 66), dtype=np.uint8),
                         raw_dtype=Q.IQ2_XXS)
        else:
            w.add_tensor(key, value.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    one_line_error(lambda: read_transformer(path), path, "'t_embedder.mlp.0.weight' in IQ2_XXS",
                   "does not read; use a Q4_K, Q8_0 or F16 file")
    flux = str(tmp_path / "flux1-dev-Q8_0.gguf")
    w = gguf.GGUFWriter(flux, "flux")
    w.add_tensor("double_blocks.0.img_attn.qkv.weight", np.ones((6, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    one_line_error(lambda: read_transformer(flux), flux, "is a FLUX transformer, not a Z-Image transformer")


# -- the text encoder ------------------------------------------------------------------------------------------------

def test_qwen3_from_comfy_layout_equals_the_model(tmp_path):
    encoder = tiny_qwen3()
    want = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
    path = str(tmp_path / "qwen_3_4b.safetensors")
    save_file({"model." + k: v for k, v in want.items()} | {"lm_head.weight": want["embed_tokens.weight"].clone()},
              path)
    got = read_text_encoder(path, dtype=torch.float32, config=encoder.config)
    assert_equal_state(got.state, want)
    from transformers import Qwen3Model

    fresh = Qwen3Model(encoder.config)
    assert load_into(fresh, got) == ()
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
    assert sorted(qwen3_from_comfy({"text_encoders.qwen3_4b.transformer.model.embed_tokens.weight": torch.ones(1),
                                    "text_encoders.qwen3_4b.transformer.lm_head.weight": torch.ones(1)})) == \
        ["embed_tokens.weight"]


def test_fp8_text_encoder_keeps_pairs(tmp_path):
    encoder = tiny_qwen3()
    original = {"model." + k: v.detach().clone() for k, v in encoder.state_dict().items()}
    fp8, dequantised = _quantised(original, per_row=False)
    tensors = dict(original) | {"scaled_fp8": torch.empty(0, dtype=E4M3)}
    for key, (q, scale) in fp8.items():
        tensors[key], tensors[key.removesuffix(".weight") + ".scale_weight"] = q, scale
    path = str(tmp_path / "qwen_3_4b_fp8_scaled.safetensors")
    save_file(tensors, path)
    got = read_text_encoder(path, dtype=torch.float32)
    assert got.quantisation == "scaled_fp8"
    assert_equal_state(got.state, {k.removeprefix("model."): v for k, v in dequantised.items()})
    kept = read_text_encoder(path, dtype=torch.float32, keep_fp8=True)
    pair = kept.fp8["layers.1.mlp.down_proj"]
    assert isinstance(pair, Fp8Weight) and torch.equal(
        pair.weight.view(torch.uint8), fp8["model.layers.1.mlp.down_proj.weight"][0].view(torch.uint8))


def test_text_encoder_of_another_family_or_size_is_refused(tmp_path):
    clip = str(tmp_path / "clip_l.safetensors")
    save_file({"text_model.encoder.layers.0.self_attn.q_proj.weight": torch.ones(4, 4),
               "text_model.embeddings.token_embedding.weight": torch.ones(8, 4)}, clip)
    one_line_error(lambda: read_text_encoder(clip), clip, "a CLIP text encoder", "not a Qwen3 text encoder")
    qwen2 = str(tmp_path / "qwen_2.5_vl_7b.safetensors")
    save_file({"model.embed_tokens.weight": torch.ones(8, 4),
               "model.layers.0.self_attn.q_proj.weight": torch.ones(4, 4),
               "model.layers.0.self_attn.q_proj.bias": torch.ones(4)}, qwen2)
    one_line_error(lambda: read_text_encoder(qwen2), qwen2, "Qwen2 / Qwen2.5")
    encoder = tiny_qwen3()
    path = str(tmp_path / "qwen_3_small.safetensors")
    save_file({"model." + k: v.contiguous() for k, v in encoder.state_dict().items()}, path)
    wider = encoder.config.to_dict() | {"hidden_size": 64}
    one_line_error(lambda: read_text_encoder(path, config=wider), path, "width 32", "64")


# -- the VAE ---------------------------------------------------------------------------------------------------------

def test_flux_vae_from_original_layout_equals_the_model(tmp_path):
    vae = tiny_vae()
    want = {k: v.detach().clone() for k, v in vae.state_dict().items()}
    path = str(tmp_path / "ae.safetensors")
    save_file({k: v.contiguous() for k, v in vae_original(want, len(vae.config.up_block_types)).items()}, path)
    assert any(k.startswith("encoder.down.0.block.0.") for k in read_safetensors(path))
    got = read_vae(path, vae.config, dtype=torch.float32)
    assert_equal_state(got.state, want)
    from diffusers import AutoencoderKL

    fresh = AutoencoderKL.from_config(vae.config)
    load_into(fresh, got)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
    sd_like = dict(vae.config) | {"latent_channels": 4}
    one_line_error(lambda: read_vae(path, sd_like), path, "16 latent channels", "has 4")


# -- other kinds, damaged files ----------------------------------------------------------------------------------------

def test_files_of_another_kind_or_damaged_are_refused_naming_them(tmp_path):
    vae = tiny_vae()
    path = str(tmp_path / "ae.safetensors")
    save_file({k: v.contiguous() for k, v in vae_original(vae.state_dict(), 2).items()}, path)
    one_line_error(lambda: read_transformer(path), path, "is a FLUX.1 VAE", "not a Z-Image transformer")
    one_line_error(lambda: read_text_encoder(path), path, "not a Qwen3 text encoder")
    z = str(tmp_path / "z_image_turbo_bf16.safetensors")
    save_file(to_original(tiny_transformer().state_dict()), z)
    one_line_error(lambda: read_vae(z, vae.config), z, "a Z-Image transformer", "not a VAE;")
    with open(z, "r+b") as f:
        f.truncate(os.path.getsize(z) - 100)
    one_line_error(lambda: read_transformer(z), z)
