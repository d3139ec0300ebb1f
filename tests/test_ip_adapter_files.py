"""Broken IP-Adapter files (engine/ip_adapters.py, models/ip_adapter_dir.py): a projection that does not take its
image encoder's output, one whose tokens its to_k_ip / to_v_ip layers cannot take, non-finite weights, a projection
diffusers cannot read, a file in the folder that is not an IP-Adapter. Each is a one-line ParamError("image_prompts")
naming the adapter and what is wrong when the adapter is loaded (a 400 over HTTP, never a 500), and the engine keeps
serving."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from diffgraph import Engine
from diffgraph.request import ParamError

from test_ip_adapter import PROMPT, make_ip_adapter

IMAGE = np.zeros((32, 32, 3), np.uint8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """random:tiny's model and a folder of broken adapters beside a good one ("base")."""
    from safetensors.torch import load_file, save_file
    root = tmp_path_factory.mktemp("broken-ip-adapters")
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as plain:
        make_ip_adapter(plain.model.denoiser, root, "base", seed=1)
        base = load_file(str(root / "base.safetensors"))
        cross = plain.model.denoiser.config.cross_attention_dim  # 32; the encoder's projection_dim is 24

        def write(name: str, **changes: torch.Tensor) -> None:
            state = {**base, **{k.replace("__", "."): v for k, v in changes.items()}}
            save_file(state, str(root / f"{name}.safetensors"))
        write("narrow", image_proj__proj__weight=torch.randn(cross * 4, 16))  # takes 16-wide embeddings, not 24
        write("wide_tokens", image_proj__proj__weight=torch.randn(cross * 8, 24), image_proj__proj__bias=torch.zeros(
            cross * 8), image_proj__norm__weight=torch.ones(cross * 2), image_proj__norm__bias=torch.zeros(cross * 2))
        write("nan", image_proj__proj__weight=torch.full((cross * 4, 24), float("nan")))
        write("bad_bias", image_proj__proj__bias=torch.zeros(7))
        save_file({"lora_unet_down.lora_up.weight": torch.zeros(4, 4)}, str(root / "a_lora.safetensors"))
        (root / "text.safetensors").write_bytes(b"not a safetensors file")
        yield plain.model, root


@pytest.fixture(scope="module")
def engine(folder):
    model, root = folder
    with Engine(model=model, ip_adapter_dir=str(root)) as e:
        yield e


@pytest.mark.parametrize("name,match", [
    ("narrow", r"IP-Adapter 'narrow': its image projection does not take its image encoder's image embeddings "
               r"\(24 wide"),
    ("wide_tokens", r"IP-Adapter 'wide_tokens': its image projection makes 64-wide tokens but its to_k_ip / to_v_ip "
                    r"layers take 32-wide ones"),
    ("nan", r"IP-Adapter 'nan' has non-finite weights \(NaN or infinity"),
    ("bad_bias", r"IP-Adapter 'bad_bias': its image projection could not be read \(RuntimeError: .*size mismatch "
                 r"for image_embeds.bias"),
    ("a_lora", r"'a_lora.safetensors' in --ip-adapter-dir is not an IP-Adapter"),
    ("text", r"'text.safetensors' in --ip-adapter-dir is not an IP-Adapter"),
])
def test_a_broken_ip_adapter_file_is_a_one_line_param_error_naming_it_and_the_engine_keeps_serving(engine, name, match):
    for _ in range(2):  # the second time too (nothing half-loaded stays cached)
        with pytest.raises(ParamError, match=match) as info:
            engine.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=dict(model=name, images=[IMAGE]))
        assert info.value.param == "image_prompts" and "\n" not in str(info.value), str(info.value)
    good = engine.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=dict(model="base", images=[IMAGE]))
    assert np.isfinite(good.arrays).all() and good.arrays.shape[0] == 1


def test_a_broken_ip_adapter_over_http_is_a_400_naming_it_not_a_500(folder):
    from fastapi.testclient import TestClient

    from diffgraph.server.app import create_app
    from diffgraph.api.config import ServerConfig
    model, root = folder
    config = ServerConfig(model="random:tiny", ip_adapter_dir=str(root))
    factory = lambda: Engine(model=model, ip_adapter_dir=str(root))  # the app closes its own
    with TestClient(create_app(config, engine_factory=factory)) as client:
        deadline = time.monotonic() + 300  # the engine is built on a thread of the app's
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").text
            time.sleep(0.1)
        import base64
        import io

        from PIL import Image
        buf = io.BytesIO()
        Image.fromarray(IMAGE).save(buf, format="PNG")
        body = {"prompt": PROMPT, "num_inference_steps": 1, "seed": 1,
                "image_prompts": {"model": "narrow", "images": [base64.b64encode(buf.getvalue()).decode()]}}
        for name, needle in [("narrow", "does not take its image encoder's"), ("wide_tokens", "64-wide tokens"),
                             ("nan", "non-finite weights")]:
            r = client.post("/v1/images/generations", json=dict(body, image_prompts=dict(body["image_prompts"],
                                                                                       model=name)))
            assert r.status_code == 400 and r.json()["error"]["param"] == "image_prompts", r.text
            assert f"'{name}'" in r.json()["error"]["message"] and needle in r.json()["error"]["message"], r.text
        assert client.post("/v1/images/generations", json=dict(body, image_prompts=None)).status_code == 200


def test_an_image_encoder_that_cannot_be_read_is_named_relative_to_the_folder(folder, tmp_path):
    """transformers' reader names the whole path of the encoder it could not read; the error names it relative to
    --ip-adapter-dir (it showed where the server keeps its files)."""
    import os

    model, _ = folder
    make_ip_adapter(model.unet, tmp_path / "styles", "cut", seed=1)
    weights = tmp_path / "styles" / "image_encoder" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with Engine(model=model, ip_adapter_dir=str(tmp_path)) as e:
        with pytest.raises(ParamError, match="the image encoder in 'styles/image_encoder': model.safetensors is "
                                             "not a readable safetensors file") as info:
            e.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=dict(model="styles/cut", images=[IMAGE]))
    assert str(tmp_path) not in str(info.value) and os.path.realpath(tmp_path) not in str(info.value), info.value


def test_an_image_encoder_cut_after_it_loaded_changes_nothing_and_one_cut_while_it_loads_is_a_400(
        folder, tmp_path, cut_while_loading):
    """transformers maps the image encoder's weights: a folder rewritten in place while or after it loaded could kill
    the process with SIGBUS. It is streamed through the checked reader instead: cut after it loaded, the engine makes
    the same image; cut while an engine reads it, the request is a one-line ParamError naming the file and saying to
    wait, the next names the cut file, and the engine keeps serving."""
    import shutil

    model, root = folder
    shutil.copytree(root / "image_encoder", tmp_path / "image_encoder")
    shutil.copy(root / "base.safetensors", tmp_path / "base.safetensors")
    weights = tmp_path / "image_encoder" / "model.safetensors"
    whole = weights.read_bytes()
    prompt = dict(model="base", images=[IMAGE])
    with Engine(model=model, ip_adapter_dir=str(tmp_path)) as e:
        want = e.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=prompt).arrays
        weights.write_bytes(b"")
        got = e.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=prompt).arrays
        assert np.array_equal(got, want)
    weights.write_bytes(whole)
    cuts = cut_while_loading(str(weights))
    with Engine(model=model, ip_adapter_dir=str(tmp_path)) as e:
        with pytest.raises(ParamError) as info:
            e.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=prompt)
        message = str(info.value)
        assert cuts and info.value.param == "image_prompts" and "\n" not in message, message
        assert "image encoder in 'image_encoder': model.safetensors " in message and str(tmp_path) not in message
        assert message.endswith("; wait until it is written completely, or copy it again"), message
        with pytest.raises(ParamError) as info:
            e.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=prompt)
        message = str(info.value)
        assert "image encoder in 'image_encoder': model.safetensors is not a readable safetensors file " \
               "(0 bytes" in message and str(tmp_path) not in message, message
        assert e.generate(PROMPT, num_inference_steps=1, seed=1).arrays.shape[0] == 1



@pytest.mark.parametrize("file, how, words", [
    ("base.safetensors", "in place", "IP-Adapter 'base': its file changed while it was read; wait until it is written "
                                     "completely, then load it again"),
    ("base.safetensors", "cut", "IP-Adapter 'base': its file changed while it was read; wait until it is written "
                                "completely, then load it again"),
    ("image_encoder/model.safetensors", "in place", "the image encoder in 'image_encoder': model.safetensors changed "
                                                    "while it was read; wait until it is written completely, or copy "
                                                    "it again")])
def test_an_ip_adapter_rewritten_while_it_loads_is_a_400_naming_it(folder, tmp_path, monkeypatch, file, how, words):
    """The adapter's own weights rewritten in place or cut while a request reads them, or its image encoder's
    rewritten in place (the test above cuts them): that request is a one-line ParamError naming the file and saying
    to wait, the engine keeps serving, and once the file is whole again it makes the same image as before."""
    import shutil

    from diffgraph.safe_tensors import TensorFile
    from rewrite_util import rewrite_on_read

    model, root = folder
    shutil.copytree(root / "image_encoder", tmp_path / "image_encoder")
    shutil.copy(root / "base.safetensors", tmp_path / "base.safetensors")
    path, prompt = tmp_path / file, dict(model="base", images=[IMAGE])
    whole = path.read_bytes()
    with Engine(model=model, ip_adapter_dir=str(tmp_path)) as e:
        want = e.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=prompt).arrays
    with TensorFile(str(tmp_path / "base.safetensors")) as f:  # a new engine reads the adapter (one read a tensor)
        before = 0 if file == "base.safetensors" else len(f.header.tensors)  # ... then the encoder
    with Engine(model=model, ip_adapter_dir=str(tmp_path)) as e:
        calls = rewrite_on_read(monkeypatch, str(path), how, after=before + 2)
        with pytest.raises(ParamError) as info:
            e.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=prompt)
        monkeypatch.undo()
        assert len(calls) == before + 2 and info.value.param == "image_prompts"
        assert str(info.value) == words, str(info.value)
        assert e.generate(PROMPT, num_inference_steps=1, seed=1).arrays.shape == (1, 64, 64, 3)
        path.write_bytes(whole)
        got = e.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=prompt).arrays
        assert np.array_equal(got, want)
