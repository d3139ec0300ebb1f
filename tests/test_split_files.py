"""Split diffusion models in ComfyUI's models folder (diffgraph.models.split_files, listed by catalog.py): a file in
diffusion_models/ (or unet/) is listed with the text encoder and VAE its sidecar names, or with the only compatible
file of each, else as incomplete with one line saying what to add; companions are never listed as models; the loader
gets the same choice as typed `SplitFiles`.

The files are safetensors (or GGUF) headers with the real architectures' key names and sizes over sparse data (nothing
is written but the header), so the kinds are read exactly as from the published files; a GGUF quantisation in a split
folder is listed under its full name with the same companions."""

from __future__ import annotations

import json
import os
import struct

import pytest

from diffgraph.models.catalog import ModelDir, ModelUnusable
from diffgraph.models.split_files import SplitFiles, split_model
from model_dir_util import _checkpoint  # a few-byte file the catalog reads as an SD1 checkpoint

ZIMAGE = {"x_embedder.weight": (3840, 64), "cap_embedder.0.weight": (2560,), "cap_embedder.1.weight": (3840, 2560),
          "context_refiner.0.attention.qkv.weight": (11520, 3840),
          "noise_refiner.0.attention.qkv.weight": (11520, 3840), "layers.0.attention.qkv.weight": (11520, 3840)}
KLEIN_4B = {"img_in.weight": (3072, 128), "txt_in.weight": (3072, 7680),
            "double_blocks.0.img_attn.qkv.weight": (9216, 3072), "single_blocks.0.linear1.weight": (27648, 3072)}
QWEN3_4B = {"model.embed_tokens.weight": (151936, 2560), "model.layers.0.self_attn.q_norm.weight": (128,)}
DEV = {"img_in.weight": (6144, 128), "txt_in.weight": (6144, 15360), "double_blocks.0.img_attn.qkv.weight": (18432, 6144),
       "single_blocks.0.linear1.weight": (55296, 6144)}
MISTRAL_SMALL = {"model.embed_tokens.weight": (131072, 5120), "model.layers.0.self_attn.q_proj.weight": (4096, 5120),
                 "tekken_model": (64,)}  # ComfyUI's file: tekken.json's bytes beside the language model
T5_XXL = {"encoder.block.0.layer.0.SelfAttention.q.weight": (4096, 4096), "shared.weight": (32128, 4096)}
FLUX_VAE = {"encoder.conv_in.weight": (128, 3, 3, 3), "decoder.conv_in.weight": (512, 16, 3, 3)}
FLUX2_VAE = {"encoder.conv_in.weight": (128, 3, 3, 3), "decoder.conv_in.weight": (512, 32, 3, 3)}
SD_VAE = {"encoder.conv_in.weight": (128, 3, 3, 3), "decoder.conv_in.weight": (512, 4, 3, 3)}


def header_file(path, shapes: dict[str, tuple[int, ...]]) -> str:
    """A safetensors file of these tensors (U8: one byte each) whose data is a hole: GB-sized tensors, no GB written."""
    header, offset = {}, 0
    for key, shape in shapes.items():
        size = 1
        for d in shape:
            size *= d
        header[key] = {"dtype": "U8", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return str(path)


def gguf_header_file(path, shapes: dict[str, tuple[int, ...]]) -> str:
    """A GGUF file of these tensors (Q4_K where 2-D rows are whole blocks of 256, else F32): a header over a hole."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "lumina2")
    size = 0
    for key, shape in shapes.items():
        qtype = Q.Q4_K if len(shape) > 1 and shape[-1] % 256 == 0 else Q.F32
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * block_bytes
        w.add_tensor_info(key, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        size += -(-nbytes // 32) * 32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(path, "r+b") as f:
        f.truncate(-(-os.path.getsize(path) // 32) * 32 + size)
    return str(path)


@pytest.fixture
def comfy(tmp_path):
    """ComfyUI's models folder: a checkpoint, a Z-Image model with its only encoder and VAE beside other kinds, and
    the folders of other things."""
    root = tmp_path / "models"
    _checkpoint(root / "checkpoints" / "sd15.safetensors", 0.0)
    header_file(root / "diffusion_models" / "z_image_turbo.safetensors", ZIMAGE)
    header_file(root / "text_encoders" / "qwen_3_4b.safetensors", QWEN3_4B)
    header_file(root / "clip" / "t5xxl.safetensors", T5_XXL)  # the older folder name, another encoder
    header_file(root / "vae" / "ae.safetensors", FLUX_VAE)
    header_file(root / "vae" / "sd_vae.safetensors", SD_VAE)
    header_file(root / "loras" / "style.safetensors", {"lora_unet_x.lora_down.weight": (4, 8)})
    return root


def _listing(root) -> dict[str, object]:
    return {e.name: e for e in ModelDir(str(root)).listing()}


def test_a_diffusion_model_is_listed_with_the_only_compatible_file_of_each_kind(comfy):
    entries = _listing(comfy)
    assert sorted(entries) == ["checkpoints/sd15", "diffusion_models/z_image_turbo"]  # no companion, no LoRA
    assert entries["checkpoints/sd15"].kind == "sd1" and entries["checkpoints/sd15"].error is None  # as today
    z = entries["diffusion_models/z_image_turbo"]
    assert isinstance(z.split, SplitFiles) and z.kind == "z-image" and z.split.kind.name == "z-image"
    assert z.description == "Z-Image (split)"  # as `diffgraph models --dir` prints it
    assert (z.split.text_encoder, z.split.vae) == (str(comfy / "text_encoders" / "qwen_3_4b.safetensors"),
                                                   str(comfy / "vae" / "ae.safetensors"))
    assert z.split.chosen_by == (("text_encoder", "only file"), ("vae", "only file"))
    assert z.error is None  # complete: the Z-Image family loads it


def test_missing_and_ambiguous_companions_are_incomplete_with_what_to_do(comfy):
    os.remove(comfy / "text_encoders" / "qwen_3_4b.safetensors")
    header_file(comfy / "vae" / "flux" / "ae_copy.safetensors", FLUX_VAE)  # a second fit, in a subfolder
    z = _listing(comfy)["diffusion_models/z_image_turbo"]
    assert z.split is None
    assert z.error == ("diffusion_models/z_image_turbo.safetensors: Z-Image needs a Qwen3-4B text encoder: add its "
                       "text encoder to text_encoders/ or name it in z_image_turbo.diffgraph.toml; 2 files fit as its "
                       "VAE (vae/ae.safetensors, vae/flux/ae_copy.safetensors); name one in "
                       "z_image_turbo.diffgraph.toml")
    with pytest.raises(ModelUnusable, match="needs a Qwen3-4B text encoder"):
        ModelDir(str(comfy)).resolve("diffusion_models/z_image_turbo")
    header_file(comfy / "clip" / "qwen.safetensors", QWEN3_4B)  # added later: found without a restart
    catalog = ModelDir(str(comfy))
    assert "text encoder" not in catalog.listing()[1].error
    side = comfy / "diffusion_models" / "z_image_turbo.diffgraph.toml"
    side.write_text('vae = "../vae/flux/ae_copy.safetensors"\n')
    z = {e.name: e for e in catalog.listing()}["diffusion_models/z_image_turbo"]
    assert z.split.vae == str(comfy / "vae" / "flux" / "ae_copy.safetensors")
    assert z.split.text_encoder == str(comfy / "clip" / "qwen.safetensors")
    assert z.split.chosen_by == (("text_encoder", "only file"), ("vae", "sidecar"))


def test_a_sidecar_names_the_files_and_a_wrong_kind_is_refused(comfy):
    header_file(comfy / "diffusion_models" / "klein.safetensors", KLEIN_4B)
    header_file(comfy / "elsewhere" / "flux2_vae.safetensors", FLUX2_VAE)  # not in vae/: only a sidecar finds it
    side = comfy / "diffusion_models" / "klein.diffgraph.toml"
    side.write_text('text_encoder = "../text_encoders/qwen_3_4b.safetensors"\nvae = "../vae/ae.safetensors"\n')
    entries = _listing(comfy)
    assert entries["diffusion_models/klein"].error == (
        "diffusion_models/klein.safetensors: the VAE its sidecar names, vae/ae.safetensors, is a FLUX.1 VAE (16 "
        "latent channels); FLUX.2 klein 4B needs a FLUX.2 VAE (32 latent channels)")
    side.write_text('text_encoder = "../text_encoders/qwen_3_4b.safetensors"\n'
                    'vae = "../elsewhere/flux2_vae.safetensors"\n')
    klein = _listing(comfy)["diffusion_models/klein"]
    assert klein.kind == "flux2-klein-4b" and klein.split.vae == str(comfy / "elsewhere" / "flux2_vae.safetensors")
    assert klein.split.chosen_by == (("text_encoder", "sidecar"), ("vae", "sidecar"))
    side.write_text('vae = "../vae/missing.safetensors"\n')  # a bad sidecar: its own reason
    assert "vae '../vae/missing.safetensors' is not a file" in _listing(comfy)["diffusion_models/klein"].error
    assert _listing(comfy)["diffusion_models/z_image_turbo"].split is not None  # the others keep their files


def test_unknown_and_pickle_files_in_a_split_folder_say_what_they_are(comfy):
    _checkpoint(comfy / "unet" / "sd15_copy.safetensors", 0.0)  # a whole checkpoint in the older folder name
    (comfy / "unet" / "old.ckpt").write_bytes(b"PK")
    entries = _listing(comfy)
    assert entries["unet/sd15_copy"].error.startswith(
        "unet/sd15_copy.safetensors is not a split diffusion model diffgraph recognises (its keys start with "
        "cond_stage_model, first_stage_model, model); recognised: Z-Image, FLUX.2 dev")
    assert entries["unet/sd15_copy"].error.endswith("whole checkpoints go in checkpoints/")
    assert "diffgraph convert" in entries["unet/old.ckpt"].error


def test_a_gguf_diffusion_model_is_listed_with_its_companions_and_loaded_as_its_kind(comfy):
    from diffgraph.models.gguf_files import gguf_header
    from diffgraph.models.loader import load_model

    small = {k: (192, 64) if ".qkv." in k else v for k, v in ZIMAGE.items()}  # (what the load reads: fast)
    gguf_header_file(comfy / "unet" / "z_image_turbo-Q4_K_M.gguf", small)
    gguf_header_file(comfy / "diffusion_models" / "klein-Q4_K_M.gguf", KLEIN_4B)
    (comfy / "diffusion_models" / "cut.gguf").write_bytes(
        open(comfy / "unet" / "z_image_turbo-Q4_K_M.gguf", "rb").read()[:200])
    header = gguf_header(str(comfy / "unet" / "z_image_turbo-Q4_K_M.gguf"))
    assert header.shapes() == small and header.types() == {"Q4_K": 1, "F32": 5}  # a 5 MB tensor, a sparse file
    entries = _listing(comfy)
    assert "text_encoders/qwen_3_4b" not in entries and "text_encoders/qwen_3_4b.gguf" not in entries
    z = entries["unet/z_image_turbo-Q4_K_M.gguf"]
    assert z.kind == "z-image" and z.error is None and z.family == "zimage"
    assert z.split == SplitFiles(z.split.kind, str(comfy / "unet" / "z_image_turbo-Q4_K_M.gguf"),
                                 str(comfy / "text_encoders" / "qwen_3_4b.safetensors"),
                                 str(comfy / "vae" / "ae.safetensors"), (("text_encoder", "only file"),
                                                                          ("vae", "only file")))
    assert entries["diffusion_models/klein-Q4_K_M.gguf"].error.startswith(
        "diffusion_models/klein-Q4_K_M.gguf: FLUX.2 klein 4B needs a FLUX.2 VAE (32 latent channels): add its VAE to "
        "vae/ or name it in klein-Q4_K_M.gguf.diffgraph.toml")
    cut = entries["diffusion_models/cut.gguf"].error
    assert cut.startswith("diffusion_models/cut.gguf is not a readable GGUF file (200 bytes; its header's ") and \
        "truncated or still being written" in cut and "\n" not in cut
    path = str(comfy / "unet" / "z_image_turbo-Q4_K_M.gguf")
    assert split_model(path) == z.split
    assert ModelDir(str(comfy)).resolve("unet/z_image_turbo-Q4_K_M.gguf").split == z.split
    with pytest.raises(ValueError, match=r"z_image_turbo-Q4_K_M.gguf lacks the tensor .*: it is not a complete file "
                                         r"of a Z-Image transformer"):
        load_model(path)  # the family reads it (these files are headers of a few tensors)


def test_a_folder_that_is_not_comfyuis_lists_everything_as_before(tmp_path):
    header_file(tmp_path / "vae" / "ae.safetensors", FLUX_VAE)  # no checkpoints/ or diffusion_models/ here
    assert [e.name for e in ModelDir(str(tmp_path)).listing()] == ["vae/ae"]


def test_the_loader_hands_the_same_files_to_the_family(comfy):
    from diffgraph.models.loader import load_model

    path = str(comfy / "diffusion_models" / "z_image_turbo.safetensors")
    files = split_model(path)
    assert files == ModelDir(str(comfy)).listing()[1].split
    assert split_model(str(comfy / "checkpoints" / "sd15.safetensors")) is None
    with pytest.raises(ValueError, match=r"z_image_turbo.safetensors lacks the tensor .*: it is not a complete file of "
                                         r"a Z-Image transformer"):
        load_model(path)  # the family reads it (these files are headers of a few tensors)


def test_a_sidecar_preset_names_the_checkpoint_of_a_split_file(comfy, tmp_path):
    """`preset` in a split file's sidecar names its published checkpoint (Z-Image's Turbo or base, klein's distilled
    or base) for a file whose name does not say it: carried in SplitFiles from the catalog's choice, from
    --text-encoder/--vae and from split_model alike; a preset of another kind, or a split model's preset on a whole
    checkpoint, is one line naming the allowed ones."""
    from diffgraph.config import LoadOptions
    from diffgraph.models.loader import _split

    mine = header_file(comfy / "diffusion_models" / "mine.safetensors", ZIMAGE)
    side = comfy / "diffusion_models" / "mine.diffgraph.toml"
    side.write_text('preset = "z-image"\n')
    assert _listing(comfy)["diffusion_models/mine"].split.preset == "z-image"
    assert split_model(mine).preset == "z-image"
    assert _listing(comfy)["diffusion_models/z_image_turbo"].split.preset is None  # no sidecar: its name decides
    flagged = _split(mine, LoadOptions(text_encoder=str(comfy / "text_encoders" / "qwen_3_4b.safetensors"),
                                       vae=str(comfy / "vae" / "ae.safetensors")))
    assert (flagged.preset, flagged.chosen_by) == ("z-image", (("text_encoder", "flag"), ("vae", "flag")))

    klein = header_file(comfy / "diffusion_models" / "klein.safetensors", KLEIN_4B)
    header_file(comfy / "elsewhere" / "flux2_vae.safetensors", FLUX2_VAE)
    (comfy / "diffusion_models" / "klein.diffgraph.toml").write_text(
        'preset = "flux.2-klein-base"\nvae = "../elsewhere/flux2_vae.safetensors"\n')
    assert split_model(klein).preset == "flux.2-klein-base"

    side.write_text('preset = "flux.2-klein"\n')
    assert _listing(comfy)["diffusion_models/mine"].error == (
        "sidecar mine.diffgraph.toml: preset 'flux.2-klein' is not a Z-Image preset; one of z-image-turbo, z-image, "
        "digits-zimage")
    (comfy / "checkpoints" / "sd15.diffgraph.toml").write_text('preset = "z-image"\n')
    assert _listing(comfy)["checkpoints/sd15"].error == (
        "sidecar sd15.diffgraph.toml: preset 'z-image' is a split diffusion model's, but this file is a whole "
        "checkpoint; one of sd1, sd1-inpaint, sd2-base, sd2-v, sd2-inpaint, sdxl-base, sdxl-inpaint")


def test_flux2_dev_needs_the_tokenizer_folder_its_sidecar_or_the_flag_names(comfy, tmp_path):
    """FLUX.2 dev's split files (its Mistral encoder and the FLUX.2 VAE found beside it) are incomplete without the
    checkpoint's tokenizer folder: one line naming the sidecar's `tokenizer` and --tokenizer; the sidecar's folder, or
    the flag's in its place, is carried in SplitFiles; models whose tokenizer is shipped leave the flag (a server's
    models share it)."""
    from diffgraph.config import LoadOptions
    from diffgraph.models.loader import _split

    dev = header_file(comfy / "diffusion_models" / "flux2_dev_bf16.safetensors", DEV)
    header_file(comfy / "text_encoders" / "mistral_3_small_flux2_bf16.safetensors", MISTRAL_SMALL)
    header_file(comfy / "vae" / "flux2-vae.safetensors", FLUX2_VAE)
    entry = _listing(comfy)["diffusion_models/flux2_dev_bf16"]
    assert entry.kind == "flux2-dev" and entry.split is None and entry.error == (
        "diffusion_models/flux2_dev_bf16.safetensors: FLUX.2 dev needs its checkpoint's tokenizer folder "
        "(tokenizer.json and its config; diffgraph ships none): pass --tokenizer DIR or name it in "
        'flux2_dev_bf16.diffgraph.toml (tokenizer = "DIR")')
    (comfy / "tokenizers" / "flux2-dev").mkdir(parents=True)
    (comfy / "diffusion_models" / "flux2_dev_bf16.diffgraph.toml").write_text('tokenizer = "../tokenizers/flux2-dev"\n')
    entry = _listing(comfy)["diffusion_models/flux2_dev_bf16"]
    assert entry.error is None and entry.family == "flux2-dev"
    assert entry.split.tokenizer == str(comfy / "tokenizers" / "flux2-dev")
    assert entry.split.text_encoder == str(comfy / "text_encoders" / "mistral_3_small_flux2_bf16.safetensors")
    assert _split(dev, LoadOptions(tokenizer=str(tmp_path))).tokenizer == str(tmp_path)  # the flag's first
    klein = header_file(comfy / "diffusion_models" / "klein.safetensors", KLEIN_4B)
    assert _split(klein, LoadOptions(tokenizer=str(tmp_path), vae=str(comfy / "vae" / "flux2-vae.safetensors"),
                                     text_encoder=str(comfy / "text_encoders" / "qwen_3_4b.safetensors"))
                  ).tokenizer is None
