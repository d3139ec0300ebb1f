"""Reading LoRA files (diffgraph.lora.files, toward issue 12): the diffusers/PEFT layout (written with peft and
diffusers' save_lora_weights) and the kohya layout with alphas, UNet and text-encoder parts, SD and SDXL, read into
per-layer weights whose delta (scale * B @ A) equals what diffusers' own load_lora_weights (with peft) puts on the
same layers; unsupported kinds and bad files are refused by name."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors.torch import save_file

from diffgraph.lora.files import AdapterError, module_path, read_adapter

from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model  # the test extra has peft

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def _peft_weights(module, targets, rank, seed):
    torch.manual_seed(seed)
    m = copy.deepcopy(module)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False), m)
    return get_peft_model_state_dict(m)


def _pipeline_class(engine) -> str:
    return "StableDiffusionXLPipeline" if engine.model.family == "sdxl" else "StableDiffusionPipeline"


def _write_diffusers(engine, path, rank=4, seed=0):
    import diffusers

    m = engine.model
    parts = {"unet_lora_layers": _peft_weights(m.unet, UNET_TARGETS, rank, seed),
             "text_encoder_lora_layers": _peft_weights(m.text_encoders[0], TEXT_TARGETS, rank, seed + 1)}
    if m.family == "sdxl":
        parts["text_encoder_2_lora_layers"] = _peft_weights(m.text_encoders[1], TEXT_TARGETS, rank, seed + 2)
    getattr(diffusers, _pipeline_class(engine)).save_lora_weights(os.path.dirname(path), **parts,
                                                                  weight_name=os.path.basename(path))
    return parts


def _write_kohya(engine, path, rank=4, seed=0, alpha=2.0):
    """The kohya / A1111 layout: lora_unet_* / lora_te_* keys, lora_down / lora_up, and an alpha per layer."""
    parts = _write_diffusers(engine, path + ".tmp.safetensors", rank, seed)
    os.remove(path + ".tmp.safetensors")
    prefixes = {"unet_lora_layers": "lora_unet_", "text_encoder_lora_layers": "lora_te_text_model_"}
    if engine.model.family == "sdxl":
        # UNet only: with transformers 5 (CLIP models without their `text_model.` level) diffusers' own
        # load_lora_weights, the oracle here, fails on kohya SDXL text-encoder keys (an empty rank table)
        prefixes = {"unet_lora_layers": "lora_unet_"}
    out = {}
    for part, prefix in prefixes.items():
        for key, value in parts[part].items():
            module, _, kind = key.rpartition(".lora_")
            name = prefix + module.replace(".", "_")
            out[f"{name}.lora_{'down' if kind.startswith('A') else 'up'}.weight"] = value.contiguous()
            out[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(out, path)


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
        root = engine.model.unet if component == "unet" else engine.model.text_encoders[component != "text_encoder"]
        for module, w in layers.items():
            resolved = module_path(root, module)
            assert resolved is not None, f"{component}.{module} is not a module of the model"
            ours[f"{component}.{resolved}"] = w.scale * (w.b @ w.a)
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
