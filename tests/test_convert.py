"""`diffgraph convert` (diffgraph.models.convert, unpickle): pickle checkpoints read without running them (both of
torch.save's formats, nested state dicts, malicious payloads stubbed), diffusers folders to original-layout files
and back exactly, and one-line errors."""

from __future__ import annotations

import os
import pickle
import socket
from collections import OrderedDict

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffgraph.cli import main
from diffgraph.engine.engine import Engine
from diffgraph.models.convert import convert
from diffgraph.models.presets import shipped_preset_folder
from diffgraph.models.unpickle import Stub, read_pickle_checkpoint


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DIFFGRAPH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))

    def refuse(self, address, *args):
        raise AssertionError(f"network access attempted: {address}")
    monkeypatch.setattr(socket.socket, "connect", refuse)


def _weights():
    return OrderedDict(conv=torch.arange(12, dtype=torch.float16).reshape(3, 4), bias=torch.tensor([1.5, -2.0]),
                       steps=torch.tensor(7), view=torch.arange(10.0)[2:8:2],
                       param=torch.nn.Parameter(torch.ones(2, 2, dtype=torch.bfloat16)))


def _save(obj, path, legacy=False):
    torch.save(obj, str(path), _use_new_zipfile_serialization=not legacy)
    return str(path)


@pytest.mark.parametrize("legacy", [False, True])
def test_both_torch_formats_are_rebuilt_exactly(tmp_path, legacy):
    path = _save({"state_dict": _weights(), "epoch": 3, "optimizer": {"lr": 0.1}}, tmp_path / "m.ckpt", legacy)
    expected = torch.load(path, weights_only=True)["state_dict"]
    got = read_pickle_checkpoint(path)["state_dict"]
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v)
    out = str(tmp_path / "m.safetensors")
    assert "5 tensors" in convert(path, out)  # state_dict taken by default: epoch and optimizer are not in it
    written = load_file(out)
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)


def test_nested_dicts_flatten_and_key_picks_one_part(tmp_path):
    w = _weights()
    esrgan = _save({"params": {"conv_first.weight": w["conv"]}, "params_ema": {"conv_first.weight": w["bias"]},
                    "iter": 5}, tmp_path / "RealESRGAN_x4plus.pth")
    out = str(tmp_path / "all.safetensors")
    assert "1 non-tensor values left out" in convert(esrgan, out)
    assert set(load_file(out)) == {"params.conv_first.weight", "params_ema.conv_first.weight"}
    ema = str(tmp_path / "ema.safetensors")
    convert(esrgan, ema, key="params_ema", dtype="fp16")
    assert torch.equal(load_file(ema)["conv_first.weight"], w["bias"].half())
    nested = _save({"model": {"ema": {"a": w["bias"]}}}, tmp_path / "n.pt")
    convert(nested, str(tmp_path / "n.safetensors"), key="model.ema")
    assert set(load_file(str(tmp_path / "n.safetensors"))) == {"a"}
    with pytest.raises(ValueError, match=r"has no 'emma' at model; give --key one of: ema$"):
        convert(nested, str(tmp_path / "x.safetensors"), key="model.emma")


class _Payload:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class _EvalPayload:
    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return eval, (self.code,)


class _StatePayload:
    def __reduce__(self):  # BUILD on an allowed object: its state is dropped, never set
        return OrderedDict, (), {"__class__": "x", "injected": 1}


@pytest.mark.parametrize("legacy", [False, True])
def test_a_malicious_pickle_is_stubbed_and_runs_nothing(tmp_path, legacy):
    marker = tmp_path / "pwned"
    evil = {"state_dict": {"w": torch.ones(2), "hook": _Payload(f"touch {marker}")},
            "callbacks": _EvalPayload(f"open({str(marker)!r}, 'w')"), "dtype": torch.float16, "odd": _StatePayload()}
    path = _save(evil, tmp_path / "evil.ckpt", legacy)
    obj = read_pickle_checkpoint(path)
    assert isinstance(obj["state_dict"]["hook"], Stub) and isinstance(obj["callbacks"], Stub)
    assert obj["state_dict"]["hook"].qualname.endswith(".system") and obj["dtype"] is torch.float16
    assert type(obj["odd"]) is OrderedDict and not hasattr(obj["odd"], "injected")
    out = str(tmp_path / "evil.safetensors")
    assert "1 non-tensor values left out" in convert(path, out)
    assert set(load_file(out)) == {"w"}
    assert not marker.exists()
    raw = tmp_path / "raw.pt"  # a bare pickle, not torch.save's format: refused, still without running it
    raw.write_bytes(pickle.dumps(_Payload(f"touch {marker}")))
    with pytest.raises(ValueError, match="neither a torch.save zip nor a legacy torch checkpoint"):
        convert(str(raw), str(tmp_path / "raw.safetensors"))
    assert not marker.exists()


def test_dictionaries_nested_without_end_are_one_line(tmp_path):
    deep = {"w": torch.ones(1)}
    for _ in range(200):
        deep = {"x": deep}
    with pytest.raises(ValueError, match="deeper than 32 levels .* pick the weights' part with --key$"):
        convert(_save(deep, tmp_path / "deep.pt"), str(tmp_path / "deep.safetensors"))


def test_a_storage_that_a_tensor_overruns_is_refused(tmp_path):
    path = _save({"w": torch.ones(4)}, tmp_path / "m.pt", legacy=True)
    data = open(path, "rb").read()
    cut = data[:-8]  # the last storage ends early
    open(path, "wb").write(cut)
    with pytest.raises(ValueError, match="ends inside a storage"):
        read_pickle_checkpoint(path)


@pytest.mark.parametrize("preset,layout,prefix", [("digits", "sd1", "cond_stage_model.transformer."),
                                                  ("digits-xl", "sdxl", "conditioner.embedders.1.model.")])
def test_a_folder_round_trips_through_one_original_file_exactly(tmp_path, preset, layout, prefix):
    folder = shipped_preset_folder(preset)
    single, back = str(tmp_path / f"{preset}.safetensors"), str(tmp_path / "back")
    assert f"{layout} layout" in convert(folder, single)
    with safe_open(single, "pt") as f:
        assert any(k.startswith(prefix) for k in f.keys()) and any(k.startswith("model.diffusion_model.")
                                                                   for k in f.keys())
    convert(single, back, config=folder)
    for sub in ("unet", "vae", "text_encoder", "text_encoder_2"):
        if not os.path.isdir(os.path.join(folder, sub)):
            continue
        name = next(n for n in os.listdir(os.path.join(folder, sub)) if n.endswith(".safetensors"))
        a, b = load_file(os.path.join(folder, sub, name)), load_file(os.path.join(back, sub, name))
        assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    if preset == "digits":
        assert np.array_equal(_image(folder), _image(back))


def _image(model) -> np.ndarray:
    engine = Engine(model, device="cpu", mode="eager", image_threads=1)
    try:
        return np.asarray(engine.generate("a handwritten digit seven", seed=3, num_inference_steps=3,
                                          guidance_scale=4.0)[0])
    finally:
        engine.close()


def test_errors_are_one_line_and_say_what_to_do(tmp_path, capsys):
    folder = shipped_preset_folder("digits")
    weights = _save({"w": torch.ones(1)}, tmp_path / "m.pt")
    (tmp_path / "taken.safetensors").write_bytes(b"x")
    cases = [
        ([weights, str(tmp_path / "taken.safetensors")], "already exists; remove it, give another output path, or "
                                                         "pass --overwrite"),
        ([weights, str(tmp_path / "out")], "give an output path ending in .safetensors"),
        ([folder, str(tmp_path / "f.safetensors"), "--key", "x"], "a diffusers folder has none: leave it out"),
        ([str(tmp_path / "missing.ckpt"), str(tmp_path / "o.safetensors")], "does not exist"),
        ([_save({"note": "text"}, tmp_path / "none.pt"), str(tmp_path / "o.safetensors")], "holds no tensors"),
        ([weights, str(tmp_path / "o.safetensors"), "--model-config", folder], "--model-config reads a .safetensors"),
    ]
    for argv, words in cases:
        assert main(["convert", *argv]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert main(["convert", weights, str(tmp_path / "ok.safetensors")]) == 0
    assert "wrote" in capsys.readouterr().out


def test_an_a1111_embedding_pickle_converts_to_a_file_the_embedding_reader_takes(tmp_path):
    from diffgraph.text.embeddings import EmbeddingDir

    vectors = torch.randn(2, 768)
    pt = _save({"string_to_token": {"*": torch.tensor(265)}, "string_to_param": {"*": vectors}, "name": "style",
                "step": 3000, "sd_checkpoint": None}, tmp_path / "style.pt")
    (tmp_path / "emb").mkdir()
    convert(pt, str(tmp_path / "emb" / "style.safetensors"))
    emb = EmbeddingDir(str(tmp_path / "emb")).load("style", {"default": 768})
    assert emb.count == 2 and torch.equal(emb.vectors["default"], vectors)
