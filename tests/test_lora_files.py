"""Reading LoRA files (diffgraph.lora.files, toward issue 12): the diffusers/PEFT layout (written with peft and
diffusers' save_lora_weights) and the kohya layout with alphas, UNet and text-encoder parts, SD and SDXL, read into
per-layer weights whose delta (scale * B @ A) equals what diffusers' own load_lora_weights (with peft) puts on the
same layers; unsupported kinds and bad files are refused by name, an empty weight in one line (read or header
only); a kohya text-encoder LoRA without out_proj layers is read."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors.torch import save_file

from diffgraph.lora.files import AdapterError, header_adapter, module_path, read_adapter

from lora_util import _pipeline_class, _write_diffusers, _write_kohya

def _diffusers_deltas(engine, path) -> dict[str, torch.Tensor]:
    """component.module -> scale * B @ A as diffusers' load_lora_weights (peft) sets them up."""
    pipe = copy.deepcopy(engine.diffusers_pipeline())
    pipe.load_lora_weights(path, adapter_name="x")
    out = {}
    for component in ("unet", "text_encoder", "text_encoder_2"):
        root = getattr(pipe, component, None)
        if root is None:
            continue
        for name, mod in root.named_modules():
            if hasattr(mod, "lora_A") and "x" in getattr(mod, "lora_A", {}):
                a, b = mod.lora_A["x"].weight, mod.lora_B["x"].weight
                out[f"{component}.{name}"] = mod.scaling["x"] * (b.reshape(b.shape[0], -1) @ a.reshape(a.shape[0], -1))
    return out


@pytest.mark.parametrize("model", ["tiny", "tiny_xl"])
@pytest.mark.parametrize("layout", ["diffusers", "kohya"])
def test_adapters_read_as_diffusers_loads_them(request, tmp_path, model, layout):
    engine = request.getfixturevalue(f"{model}_engine")
    path = str(tmp_path / "style.safetensors")
    (_write_diffusers if layout == "diffusers" else _write_kohya)(engine, path)
    adapter = read_adapter(path, _pipeline_class(engine), "style")
    assert adapter.rank == 4 and adapter.version == (os.path.getsize(path), os.stat(path).st_mtime_ns)
    expected = _diffusers_deltas(engine, path)
    ours = {}
    for component, layers in adapter.layers.items():
        root = engine.model.denoiser if component == "unet" else engine.model.text_encoders[component != "text_encoder"]
        for module, w in layers.items():
            resolved = module_path(root, module)
            assert resolved is not None, f"{component}.{module} is not a module of the model"
            ours[f"{component}.{resolved}"] = w.scale * (w.b.float() @ w.a.float())
            if layout == "kohya":
                assert w.scale == 0.5  # alpha 2 / rank 4
    assert set(ours) == set(expected) and len(ours) > 20
    components = {"unet", "text_encoder", "text_encoder_2"} if model == "tiny_xl" else {"unet", "text_encoder"}
    if model == "tiny_xl" and layout == "kohya":
        components = {"unet"}
    assert {k.split(".")[0] for k in ours} == components
    for key, delta in expected.items():
        assert torch.allclose(ours[key], delta.float(), atol=1e-6), key


def test_bad_adapter_files_are_refused_by_name(tiny_engine, tmp_path):
    good = str(tmp_path / "good.safetensors")
    _write_diffusers(tiny_engine, good)
    cls = _pipeline_class(tiny_engine)
    cases = []
    pickle = tmp_path / "style.ckpt"
    pickle.write_bytes(b"not read")
    cases.append((str(pickle), "only safetensors adapters are read"))
    cases.append((str(tmp_path / "missing.safetensors"), "does not exist"))
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(open(good, "rb").read()[:300])
    cases.append((str(truncated), "not a readable safetensors file"))
    loha = tmp_path / "loha.safetensors"
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.hada_w1_a": torch.zeros(4, 4)}, str(loha))
    cases.append((str(loha), "is LoHa"))
    locon = tmp_path / "locon.safetensors"
    save_file({"unet.down_blocks.0.resnets.0.conv1.lora_A.weight": torch.zeros(4, 32, 3, 3),
               "unet.down_blocks.0.resnets.0.conv1.lora_B.weight": torch.zeros(32, 4, 1, 1)}, str(locon))
    cases.append((str(locon), "3x3 convolution LoRA"))
    half = tmp_path / "half.safetensors"
    save_file({"unet.down_blocks.0.attentions.0.proj_in.lora_A.weight": torch.zeros(4, 32)}, str(half))
    cases.append((str(half), "lacks its up"))
    for path, needle in cases:
        with pytest.raises(AdapterError, match=needle):
            read_adapter(path, cls, "x")


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
