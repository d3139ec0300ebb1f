"""models/stream_load.py: a component folder read tensor by tensor through the checked reader equals what the class's
from_pretrained makes of the same folder, every parameter and buffer bit for bit (one file, shards, an fp16 variant,
tied embeddings, a base model read from a head model's file); a file rewritten while it loads, or lacking a tensor,
is a one-line error naming it; nothing maps the user's file. Model files that change or misbehave: a weights file cut
after it loaded changes nothing (no SIGBUS), one cut while it loads is a one-line error naming it; a private view
copies only the weights from_pretrained reads; weights that are a FIFO or a dangling link, and tokenizer or config
JSON that nests too deep, are one-line errors naming the file."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from diffgraph import safe_files
from diffgraph.cli import main
from diffgraph.models import presets as P
from diffgraph.models import stream_load
from diffgraph.models.families.flux2 import tiny_qwen3, tiny_transformer, tiny_vae
from diffgraph.models.stream_load import load_part
from diffgraph.models.weights_view import UnreadableWeights, weights_read


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


# -- model files that change or misbehave under a loaded model ------------------------------------------------
DIGITS = os.path.join(os.path.dirname(__file__), os.pardir, "src", "diffgraph", "assets", "digits")
WEIGHTS = ("unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
           "text_encoder/model.safetensors")

# In a child process, so that a SIGBUS fails this test instead of killing pytest. fp16 is the digits files' dtype:
# the case where the parameters aliased the file's map. `during` is cut once its files are checked (before their
# tensors are read): a one-line error naming the file; `after` once it has loaded: it generates a 1-step image, and
# its weights are the shipped ones.
CHILD = textwrap.dedent("""
    import os, sys, torch
    from diffgraph import Engine
    from diffgraph.models.families import default_registry
    from diffgraph.models.loader import load_model

    shipped, during, after = sys.argv[1:4]
    weights = sys.argv[4:]

    def cut(folder):
        for name in weights:
            with open(os.path.join(folder, name), "r+b") as f:
                f.truncate(0)

    def params(model):
        return [p.detach().clone() for m in (model.unet, model.vae, *model.text_encoders) for p in m.parameters()]

    expected = params(load_model(shipped, "cpu", "fp16"))
    families = default_registry()
    adapter = families.for_pipeline("StableDiffusionPipeline")
    load_folder = adapter.load_folder
    adapter.load_folder = lambda *args: (cut(during), load_folder(*args))[1]
    try:
        load_model(during, "cpu", "fp16", families=families)
        raise AssertionError("a model folder cut while it loaded was loaded")
    except ValueError as e:
        assert str(e).startswith(f"model folder {during!r}: {weights[0]} is not a readable safetensors file (0 bytes")
        assert "\\n" not in str(e)
    loaded = load_model(after, "cpu", "fp16")
    cut(after)
    assert all(torch.equal(a, b) for a, b in zip(params(loaded), expected, strict=True))
    image = Engine(loaded).generate("a handwritten digit seven", num_inference_steps=1, seed=3)[0]
    assert image.size == (loaded.native_size, loaded.native_size)
    print("refused the cut folder; generated after the cut")
""")


def test_weights_cut_while_and_after_loading_never_kill_the_process(tmp_path):
    folders = [str(tmp_path / name) for name in ("during", "after")]
    for folder in folders:
        shutil.copytree(DIGITS, folder)
    proc = subprocess.run([sys.executable, "-c", CHILD, DIGITS, *folders, *WEIGHTS], capture_output=True, text=True)
    assert proc.returncode not in (135, -7), "SIGBUS: the parameters still read the cut file's map"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused the cut folder; generated after the cut" in proc.stdout


def test_private_view_copies_what_is_read_links_the_rest_and_hides_the_others(tmp_path):
    src = tmp_path / "model"
    (src / "unet").mkdir(parents=True)
    save_file({"w": torch.arange(4.0)}, str(src / "unet" / "w.safetensors"))
    weights = (src / "unet" / "w.safetensors").read_bytes()
    (src / "unet" / "w.bin").write_bytes(b"pickle")
    (src / "unet" / "config.json").write_text("{}")
    with safe_files.private_view(str(src), ["unet/w.safetensors"], ["unet/w.bin"], max_bytes=1 << 20) as view:
        copy = os.path.join(view, "unet", "w.safetensors")
        with open(src / "unet" / "w.safetensors", "r+b") as f:
            f.truncate(0)  # the original is cut: the copy is not
        with open(copy, "rb") as f:
            assert f.read() == weights
        assert not os.path.lexists(os.path.join(view, "unet", "w.bin"))
        assert os.path.realpath(os.path.join(view, "unet", "config.json")) == str((src / "unet" / "config.json"))
    assert not os.path.exists(view)


@pytest.mark.parametrize("files, read", [
    (["m.safetensors", "m.bin", "m.fp16.safetensors"], ["m.safetensors"]),
    (["m.bin", "m.fp16.safetensors"], ["m.bin"]),
    (["m.fp16.safetensors", "m.fp16.bin", "m.ema.bin"], ["m.fp16.safetensors"]),
    (["m-00001-of-00002.safetensors", "m-00002-of-00002.safetensors", "m.bin"],
     ["m-00001-of-00002.safetensors", "m-00002-of-00002.safetensors"]),
])
def test_only_the_weights_from_pretrained_reads_are_copied(tmp_path, files, read):
    (tmp_path / "unet").mkdir()
    for name in files:
        (tmp_path / "unet" / name).write_bytes(b"x")
    copies, omit = weights_read(str(tmp_path))
    assert copies == [os.path.join("unet", f) for f in read]
    assert sorted(omit) == sorted(os.path.join("unet", f) for f in files if f not in read)


@pytest.mark.parametrize("kind, needle", [("fifo", "is a FIFO (named pipe), not a regular file"),
                                          ("dangling", "is a dangling link")])
def test_weights_that_are_a_fifo_or_a_dangling_link_fail_in_one_line(tmp_path, capsys, kind, needle):
    folder = tmp_path / "model"
    shutil.copytree(DIGITS, folder)
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    weights.unlink()
    if kind == "fifo":  # opened for reading, it blocks until a writer comes: refused by its type before any open
        os.mkfifo(weights)
    else:
        weights.symlink_to(tmp_path / "gone.safetensors")
    rc = main(["generate", "a cat", "--model", str(folder), "--steps", "1", "-o", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "unet/diffusion_pytorch_model.safetensors " + needle in err and "copy or download that file again" in err


@pytest.mark.parametrize("file", ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
                                  "text_encoder/generation_config.json"])
def test_a_model_folder_whose_tokenizer_json_nests_too_deep_is_a_one_line_error_naming_it(tmp_path, file):
    """transformers and diffusers parse a folder's tokenizer and config JSON without a depth limit: 200,000 brackets
    were a RecursionError out of load_model. Every JSON file of the folder is parsed with the bounded parser first."""
    from diffgraph.models.loader import load_model

    shutil.copytree(DIGITS, tmp_path / "m")
    (tmp_path / "m" / file).write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError) as info:
        load_model(str(tmp_path / "m"))
    assert str(info.value) == (f"model folder {str(tmp_path / 'm')!r}: {file} nests JSON deeper than 64 levels (the "
                               "limit for this file; a damaged or hostile one): copy or download it again")


def test_a_component_folder_whose_config_nests_too_deep_is_a_one_line_error_naming_it(tmp_path):
    """A folder read alone (a --vae folder, an IP-Adapter's image encoder, a ControlNet): its config.json too."""
    from diffusers import AutoencoderKL

    from diffgraph.models.stream_load import load_part
    from diffgraph.models.weights_view import UnreadableWeights

    shutil.copytree(os.path.join(DIGITS, "vae"), tmp_path / "vae")
    (tmp_path / "vae" / "config.json").write_text('{"a": ' * 200_000 + "1" + "}" * 200_000)
    with pytest.raises(UnreadableWeights) as info:  # was a RecursionError from diffusers' load_config
        load_part(AutoencoderKL, str(tmp_path / "vae"), "vae 'vae'")
    assert str(info.value) == ("vae 'vae': config.json nests JSON deeper than 64 levels (the limit for this file; a "
                               "damaged or hostile one): copy or download it again")
