"""Review of users' files: hostile or unusual adapter and checkpoint headers answer one line, never a traceback that
takes a whole listing down; a kohya text-encoder LoRA without out_proj layers is read."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from diffgraph.lora.files import AdapterError, header_adapter, read_adapter
from diffgraph.models.catalog import ModelDir
from diffgraph.models.checkpoint_kind import inspect_checkpoint

SD = "StableDiffusionPipeline"
UNET = "lora_unet_down_blocks_0_attentions_0_proj_in"
TE = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"


@pytest.mark.parametrize("reader", [read_adapter, header_adapter])
@pytest.mark.parametrize("down, up", [((0, 32), (32, 0)), ((4, 32), (0, 4))])
def test_an_empty_lora_weight_is_refused_in_one_line(tmp_path, reader, down, up):
    path = str(tmp_path / "empty.safetensors")
    save_file({f"{UNET}.lora_down.weight": torch.zeros(down), f"{UNET}.lora_up.weight": torch.zeros(up)}, path)
    with pytest.raises(AdapterError, match="has an empty weight"):  # was a RuntimeError from reshape
        reader(path, SD, "empty")


@pytest.mark.parametrize("reader", [read_adapter, header_adapter])
def test_a_kohya_text_encoder_lora_without_out_proj_is_read(tmp_path, reader):
    torch.manual_seed(0)
    down, up = torch.randn(4, 32), torch.randn(32, 4) * 0.01
    path = str(tmp_path / "q_only.safetensors")
    save_file({f"{TE}.lora_down.weight": down, f"{TE}.lora_up.weight": up, f"{TE}.alpha": torch.tensor(2.0)}, path)
    adapter = reader(path, SD, "q_only")  # was ValueError("Could not automatically infer state dict type")
    layer = adapter.layers["text_encoder"]["text_model.encoder.layers.0.self_attn.q_proj"]
    assert layer.scale == 0.5 and layer.a.shape == (4, 32) and layer.b.shape == (32, 4)
    if reader is read_adapter:
        assert torch.equal(layer.a, down) and torch.equal(layer.b, up)


def _header_file(path, tensors, metadata=None):
    header, offset = {}, 0
    for key, shape in tensors.items():
        n = 2 * int(torch.tensor(shape).prod())
        header[key] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + bytes(offset))


FIRST = {"model.diffusion_model.input_blocks.0.0.weight": (4, 4, 3, 3)}
SD2_TEXT = {"cond_stage_model.model.token_embedding.weight": (4, 4)}


@pytest.mark.parametrize("name, tensors, metadata, needle", [
    ("ctx", {**FIRST, "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (768,)},
     None, "without its text encoders"),
    ("pred", {**FIRST, **SD2_TEXT}, {"modelspec.prediction_type": 5}, "__metadata__ is not a map of strings"),
    ("res", {**FIRST, **SD2_TEXT}, {"modelspec.resolution": [768, 768]}, "__metadata__ is not a map of strings"),
])
def test_odd_checkpoint_headers_are_one_line_errors_and_the_listing_survives(tmp_path, name, tensors, metadata,
                                                                             needle):
    path = str(tmp_path / f"{name}.safetensors")
    _header_file(path, tensors, metadata)
    with pytest.raises(ValueError, match=needle):  # was IndexError / AttributeError
        inspect_checkpoint(path)
    _header_file(str(tmp_path / "other.safetensors"), {**FIRST, **SD2_TEXT}, {"modelspec.resolution": "512"})
    entries = {e.name: e for e in ModelDir(str(tmp_path)).listing()}
    assert needle in entries[name].error and entries["other"].kind == "sd2-base" and entries["other"].error is None
