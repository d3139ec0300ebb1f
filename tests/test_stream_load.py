"""models/stream_load.py: a component folder read tensor by tensor through the checked reader equals what the class's
from_pretrained makes of the same folder, every parameter and buffer bit for bit (one file, shards, an fp16 variant,
tied embeddings, a base model read from a head model's file); a file rewritten while it loads, or lacking a tensor,
is a one-line error naming it; nothing maps the user's file."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from diffgraph.models import presets as P
from diffgraph.models import stream_load
from diffgraph.models.families.flux2 import tiny_qwen3, tiny_transformer, tiny_vae
from diffgraph.models.stream_load import load_part
from diffgraph.models.weights_view import UnreadableWeights


def _tiny_modules() -> dict[str, torch.nn.Module]:
    """One small random module of each class the loaders read."""
    from diffusers import (AutoencoderKL, AutoencoderKLFlux2, AutoencoderTiny, ControlNetModel, Flux2Transformer2DModel,
                           UNet2DConditionModel, ZImageTransformer2DModel)
    from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPVisionConfig,
                              CLIPVisionModelWithProjection, Qwen3Config, Qwen3ForCausalLM)

    preset = P.RANDOM_PRESETS["random:tiny-xl"]
    torch.manual_seed(0)
    return {
        "unet": UNet2DConditionModel(**preset.unet),
        "vae": AutoencoderKL(**preset.vae),
        "flux2_vae": AutoencoderKLFlux2(**tiny_vae()),
        "taesd": AutoencoderTiny(encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8)),
        "controlnet": ControlNetModel(**{k: v for k, v in P.RANDOM_PRESETS["random:tiny"].unet.items()
                                         if k not in ("out_channels", "up_block_types", "sample_size")},
                                      conditioning_embedding_out_channels=(8, 16)),
        "zimage": ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64,
                                           n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                                           axes_dims=[8, 12, 12], axes_lens=[1024, 256, 256]),
        "flux2": Flux2Transformer2DModel(**tiny_transformer(text_width=16)),
        "clip": CLIPTextModel(CLIPTextConfig(**preset.text_encoders[0])),
        "clip_proj": CLIPTextModelWithProjection(CLIPTextConfig(**preset.text_encoders[1])),
        "clip_vision": CLIPVisionModelWithProjection(CLIPVisionConfig(
            hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32,
            patch_size=8, projection_dim=24)),
        "qwen3_tied": Qwen3ForCausalLM(Qwen3Config(**{**tiny_qwen3(1000), "num_hidden_layers": 2,
                                                      "tie_word_embeddings": True})),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[type, str]]:
    root = tmp_path_factory.mktemp("parts")
    out = {}
    for name, module in _tiny_modules().items():
        module.save_pretrained(str(root / name), safe_serialization=True)
        out[name] = (type(module), str(root / name))
    return out


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update({f"buffer:{k}": v for k, v in module.named_buffers(remove_duplicate=False)})
    return named


def _assert_same(got: torch.nn.Module, want: torch.nn.Module) -> None:
    a, b = _tensors(got), _tensors(want)
    assert sorted(a) == sorted(b)
    for name in b:
        assert a[name].dtype == b[name].dtype and a[name].device == b[name].device, name
        assert a[name].shape == b[name].shape and torch.equal(a[name], b[name]), name
    assert got.training == want.training is False
    config = dict(got.config) if isinstance(got.config, dict) else got.config.to_dict()
    wanted = dict(want.config) if isinstance(want.config, dict) else want.config.to_dict()
    assert {k: v for k, v in config.items() if k != "_name_or_path"} == \
        {k: v for k, v in wanted.items() if k != "_name_or_path"}
    assert getattr(got.config, "_attn_implementation", None) == getattr(want.config, "_attn_implementation", None)


def _from_pretrained(cls: type, path: str, dtype: torch.dtype | None, **kw) -> torch.nn.Module:
    from diffusers import ModelMixin

    key = "torch_dtype" if issubclass(cls, ModelMixin) else "dtype"
    return cls.from_pretrained(path, local_files_only=True, **{key: dtype}, **kw)


NAMES = ["unet", "vae", "flux2_vae", "taesd", "controlnet", "zimage", "flux2", "clip", "clip_proj", "clip_vision",
         "qwen3_tied"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_each_class_loads_as_from_pretrained_loads_it(saved, name, dtype):
    cls, path = saved[name]
    got = load_part(cls, path, f"test {name!r}", dtype=dtype)
    _assert_same(got, _from_pretrained(cls, path, dtype))


def test_a_tiny_decoder_without_a_dtype_loads_at_its_configs_default(saved):
    cls, path = saved["taesd"]
    got = load_part(cls, path, "test")
    assert next(got.parameters()).dtype == torch.float32
    _assert_same(got, cls.from_pretrained(path, local_files_only=True))


def test_tied_embeddings_stay_tied_and_a_base_model_reads_a_head_models_file(saved):
    from transformers import AutoModel

    cls, path = saved["qwen3_tied"]
    assert not any("lm_head" in k for k in stream_load.TensorFile(os.path.join(path, "model.safetensors")).header
                   .tensors)  # save_pretrained leaves the tied head out
    got = load_part(cls, path, "test", dtype=torch.float32)
    assert got.lm_head.weight is got.model.embed_tokens.weight
    base = load_part(AutoModel, path, "test", dtype=torch.float32)
    assert type(base).__name__ == "Qwen3Model"
    _assert_same(base, AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32))


def test_shards_and_an_fp16_variant_load_as_from_pretrained_loads_them(saved, tmp_path):
    cls, path = saved["unet"]
    module = cls.from_pretrained(path, local_files_only=True)
    module.save_pretrained(str(tmp_path / "sharded"), max_shard_size="200KB")
    shards = [f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]
    assert len(shards) > 2 and os.path.isfile(tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json")
    _assert_same(load_part(cls, str(tmp_path / "sharded"), "test", dtype=torch.float16),
                 _from_pretrained(cls, str(tmp_path / "sharded"), torch.float16))
    module.to(torch.float16).save_pretrained(str(tmp_path / "variant"), variant="fp16")
    _assert_same(load_part(cls, str(tmp_path / "variant"), "test", dtype=torch.float32, variant="fp16"),
                 _from_pretrained(cls, str(tmp_path / "variant"), torch.float32, variant="fp16"))
    qcls, qpath = saved["qwen3_tied"]
    qwen = qcls.from_pretrained(qpath, local_files_only=True)
    qwen.save_pretrained(str(tmp_path / "qwen"), max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "qwen" / "model.safetensors.index.json")
    _assert_same(load_part(qcls, str(tmp_path / "qwen"), "test", dtype=torch.bfloat16),
                 _from_pretrained(qcls, str(tmp_path / "qwen"), torch.bfloat16))


def test_a_component_in_a_subfolder_is_read_to_a_device(saved):
    cls, path = saved["vae"]
    parent, sub = os.path.split(path)
    got = load_part(cls, parent, "test", sub=sub, dtype=torch.float16, device="cpu")
    _assert_same(got, _from_pretrained(cls, path, torch.float16))


def test_nothing_maps_the_users_file(saved, monkeypatch):
    import safetensors
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("the user's file was mapped")
    monkeypatch.setattr(mmap, "mmap", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(safetensors.torch, "safe_open", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    import transformers.modeling_utils
    monkeypatch.setattr(transformers.modeling_utils, "safe_open", refuse, raising=False)  # (its own import of it)
    for name in ("unet", "clip", "qwen3_tied"):
        cls, path = saved[name]
        model = load_part(cls, path, "test", dtype=torch.float32)
        assert all(not p.is_meta for p in model.parameters())
    from diffgraph.models.loader import load_model
    digits = os.path.join(os.path.dirname(__file__), os.pardir, "src", "diffgraph", "assets", "digits")
    model = load_model(digits, "cpu", "fp16")  # a whole model folder, as the family loads it
    assert all(not p.is_meta for m in (model.denoiser, model.vae, *model.text_encoders) for p in m.parameters())


def test_a_file_rewritten_while_it_loads_is_a_clean_error(saved, tmp_path, monkeypatch):
    import shutil

    cls, path = saved["unet"]
    folder = tmp_path / "unet"
    shutil.copytree(path, folder)
    weights = folder / "diffusion_pytorch_model.safetensors"
    assigned = []
    assign = stream_load.assign

    def rewrite_after_the_first(model, name, tensor):
        assign(model, name, tensor)
        assigned.append(name)
        if len(assigned) == 1:  # same size, new bytes and mtime: `cp new old` over the file being read
            data = bytearray(weights.read_bytes())
            data[-4:] = b"\x00\x00\x80\x7f"
            with open(weights, "r+b") as f:
                f.write(data)
            os.utime(weights, ns=(os.stat(weights).st_atime_ns, os.stat(weights).st_mtime_ns + 10 ** 9))
    monkeypatch.setattr(stream_load, "assign", rewrite_after_the_first)
    with pytest.raises(UnreadableWeights) as e:
        load_part(cls, str(folder), f"model folder {str(folder)!r}", dtype=torch.float32)
    message = str(e.value)
    assert len(assigned) == 1 and len(message.splitlines()) == 1
    assert message.startswith(f"model folder {str(folder)!r}: diffusion_pytorch_model.safetensors ")
    assert message.endswith("wait until it is written completely, or copy it again")


def test_a_file_lacking_a_tensor_names_the_folder_file_and_tensor(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    cls, path = saved["clip"]
    folder = tmp_path / "clip"
    folder.mkdir()
    (folder / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    state = load_file(os.path.join(path, "model.safetensors"))
    gone = next(k for k in state if k.endswith("final_layer_norm.weight"))  # (transformers 5 has no text_model.)
    save_file({k: v for k, v in state.items() if k != gone}, str(folder / "model.safetensors"))
    with pytest.raises(UnreadableWeights) as e:
        load_part(cls, str(tmp_path), "model folder 'm'", sub="clip", dtype=torch.float32)
    assert str(e.value) == (f"model folder 'm': clip/model.safetensors lacks tensor {gone!r}, which its config.json "
                            "needs: the weights are cut short or not this config's; copy or download the folder again")


def test_pickle_weights_are_read_by_from_pretrained_from_a_private_copy(saved, tmp_path):
    cls, path = saved["vae"]
    module = cls.from_pretrained(path, local_files_only=True)
    module.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    assert os.path.isfile(tmp_path / "bin" / "diffusion_pytorch_model.bin")
    _assert_same(load_part(cls, str(tmp_path / "bin"), "test", dtype=torch.float32), module)


def test_weights_of_another_config_name_the_tensor_and_both_shapes(saved, tmp_path):
    import json
    import shutil

    cls, path = saved["clip"]
    shutil.copytree(path, tmp_path / "clip")
    config = json.loads((tmp_path / "clip" / "config.json").read_text())
    config["intermediate_size"] = 48
    (tmp_path / "clip" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnreadableWeights) as e:
        load_part(cls, str(tmp_path / "clip"), "model folder 'm'", dtype=torch.float32)
    message = str(e.value)
    assert message.startswith("model folder 'm': model.safetensors holds '") and "\n" not in message
    assert "holds 'encoder.layers.0.mlp.fc1.bias' as [64] where its config.json makes [48]" in message
    assert message.endswith("use the config.json saved with them"), message


def test_a_vae_saved_with_old_attention_names_is_renamed_as_diffusers_renames_it(saved, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    cls, path = saved["vae"]
    shutil.copytree(path, tmp_path / "vae")
    old = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}
    state = load_file(os.path.join(path, "diffusion_pytorch_model.safetensors"))
    renamed = {}
    for key, value in state.items():
        for new, before in old.items():
            key = key.replace(new, before) if "attentions" in key else key
        renamed[key] = value
    assert any(".query." in k for k in renamed)
    save_file(renamed, str(tmp_path / "vae" / "diffusion_pytorch_model.safetensors"))
    got = load_part(cls, str(tmp_path / "vae"), "test", dtype=torch.float32)
    _assert_same(got, _from_pretrained(cls, str(tmp_path / "vae"), torch.float32))
    _assert_same(got, _from_pretrained(cls, path, torch.float32))


def test_only_the_loading_thread_builds_with_meta_parameters():
    import threading

    original = torch.nn.Module.register_parameter
    other = []
    with stream_load._meta_parameters(torch.float16):
        here = torch.nn.Linear(4, 4)
        thread = threading.Thread(target=lambda: other.append(torch.nn.Linear(4, 4)))
        thread.start()
        thread.join()
    assert here.weight.is_meta and here.weight.dtype == torch.float16
    assert not other[0].weight.is_meta  # (its dtype: the default dtype is process-wide, as under from_pretrained)
    assert torch.nn.Module.register_parameter is original and torch.get_default_dtype() == torch.float32


def test_a_model_folder_with_sharded_and_variant_parts_loads_as_the_plain_one(tmp_path):
    """load_model over a pipeline folder whose UNet is sharded, whose VAE is an fp16 variant only and whose text
    encoder is sharded gives the same modules as the shipped plain folder."""
    import shutil

    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    from diffgraph.models.loader import load_model
    digits = os.path.join(os.path.dirname(__file__), os.pardir, "src", "diffgraph", "assets", "digits")
    folder = tmp_path / "digits"
    shutil.copytree(digits, folder)
    for sub, cls, save in (("unet", UNet2DConditionModel, dict(max_shard_size="300KB")),
                           ("vae", AutoencoderKL, dict(variant="fp16")),
                           ("text_encoder", CLIPTextModel, dict(max_shard_size="100KB"))):
        module = cls.from_pretrained(os.path.join(digits, sub), local_files_only=True)
        shutil.rmtree(folder / sub)
        module.save_pretrained(str(folder / sub), **save)
    assert len([f for f in os.listdir(folder / "unet") if f.endswith(".safetensors")]) > 1
    assert os.listdir(folder / "vae") and all(".fp16." in f for f in os.listdir(folder / "vae") if "safetensors" in f)
    assert os.path.isfile(folder / "text_encoder" / "model.safetensors.index.json")
    want, got = load_model(digits, "cpu", "fp32"), load_model(str(folder), "cpu", "fp32")
    for a, b in ((got.denoiser, want.denoiser), (got.vae, want.vae), (got.text_encoders[0], want.text_encoders[0])):
        _assert_same(a.requires_grad_(False), b.requires_grad_(False))


@pytest.mark.gpu
def test_parts_read_to_the_gpu_equal_from_pretrained_moved_there(saved):
    for name in ("unet", "clip", "qwen3_tied"):
        cls, path = saved[name]
        got = load_part(cls, path, "test", dtype=torch.float16, device="cuda")
        _assert_same(got, _from_pretrained(cls, path, torch.float16).to("cuda"))
