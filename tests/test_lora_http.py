"""LoRA adapters over HTTP and the CLI (issue 12): `diffgraph serve --lora-dir` lists its adapters at GET /v1/loras
(pickles ignored and reported), `loras: [{"name", "scale"}]` in /v1/images/generations and (a JSON text field) in
/v1/images/edits gives the in-process engine's image; every bad adapter input is a 400 in OpenAI's shape naming
`loras`, with the server serving after; `diffgraph generate --lora` locally and with --url."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from diffgraph import Engine
from diffgraph.server.process import ServerProcess
from lora_util import _write_diffusers, _write_kohya

PROMPT = "a fox in the snow"


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).astype(int)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_engine):
    root = tmp_path_factory.mktemp("http-loras")
    _write_diffusers(tiny_engine, str(root / "style.safetensors"), rank=4, seed=0)
    (root / "styles").mkdir()
    _write_kohya(tiny_engine, str(root / "styles" / "ink.safetensors"), rank=4, seed=10)
    (root / "old.ckpt").write_bytes(b"a pickle is never loaded")
    _write_diffusers(tiny_engine, str(root / "fast.safetensors"), rank=4, seed=20)
    (root / "fast.diffgraph.toml").write_text("steps = 3\nguidance = 2.0\n")  # its sidecar (features/slot_files.py)
    return str(root)


@pytest.fixture(scope="module")
def server(folder):
    s = ServerProcess("--lora-dir", folder, "--max-loras", "4", "--max-lora-rank", "8", model="random:tiny")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop(timeout=30)


@pytest.fixture(scope="module")
def engine(folder):
    with Engine("random:tiny", device="cpu", dtype="fp32", lora_dir=folder, max_loras=4, max_lora_rank=8) as e:
        yield e


def _expected(engine, loras, seed=3, **kw) -> np.ndarray:
    result = engine.generate(PROMPT, num_inference_steps=4, seed=seed, loras=loras, **kw)
    return (result.arrays[0] * 255).round().astype(int)


def test_loras_are_listed(server):
    r = httpx.get(f"{server.url}/v1/loras", timeout=60)
    assert r.status_code == 200
    body = r.json()
    by_name = {a["name"]: a for a in body["data"]}
    assert set(by_name) == {"style", "styles/ink", "fast"}
    assert (by_name["fast"]["steps"], by_name["fast"]["guidance"]) == (3, 2.0) and "steps" not in by_name["style"]
    assert by_name["style"]["rank"] == 4 and by_name["style"]["family"] == "sd"
    assert set(by_name["style"]["targets"]) == {"unet", "text_encoder"}
    assert body["ignored"] == ["old.ckpt"] and body["max_loras"] == 4 and body["max_lora_rank"] == 8


def test_generations_with_loras_equal_the_engine(server, engine):
    for loras in ([("style", 1.0)], [("styles/ink", 0.5), ("style", 0.7)]):
        r = httpx.post(f"{server.url}/v1/images/generations", timeout=600,
                       json={"prompt": PROMPT, "num_inference_steps": 4, "seed": 3,
                             "loras": [{"name": n, "scale": s} for n, s in loras]})
        assert r.status_code == 200, r.text
        got = _pixels(r.json()["data"][0]["b64_json"])
        assert np.abs(got - _expected(engine, loras)).max() <= 1
        assert np.abs(got - _expected(engine, ())).max() > 8
    listed = {a["name"]: a["loaded"] for a in httpx.get(f"{server.url}/v1/loras", timeout=60).json()["data"]}
    assert listed == {"style": True, "styles/ink": True, "fast": False}


def test_a_sidecar_s_steps_and_guidance_run_where_the_body_leaves_them_out(server, engine):
    """A body naming `fast` and neither num_inference_steps nor guidance_scale runs its sidecar's 3 steps at
    guidance 2 (the engine's image with those given); a body that gives its steps keeps them."""
    def generate(**body) -> np.ndarray:
        r = httpx.post(f"{server.url}/v1/images/generations", timeout=600,
                       json={"prompt": PROMPT, "seed": 5, "loras": [{"name": "fast", "scale": 1.0}], **body})
        assert r.status_code == 200, r.text
        return _pixels(r.json()["data"][0]["b64_json"])
    declared = engine.generate(PROMPT, num_inference_steps=3, guidance_scale=2.0, seed=5, loras=[("fast", 1.0)])
    got = generate()
    assert np.abs(got - (declared.arrays[0] * 255).round().astype(int)).max() <= 1
    given = generate(num_inference_steps=4)
    assert np.abs(given - _expected(engine, [("fast", 1.0)], seed=5, guidance_scale=2.0)).max() <= 1
    assert np.abs(given - got).max() > 8


def test_edits_take_loras(server, engine):
    rng = np.random.default_rng(0)
    source = Image.fromarray((rng.random((64, 64, 3)) * 255).astype(np.uint8))
    buf = io.BytesIO()
    source.save(buf, "PNG")
    r = httpx.post(f"{server.url}/v1/images/edits", timeout=600, files={"image": ("a.png", buf.getvalue(), "image/png")},
                   data={"prompt": PROMPT, "num_inference_steps": "4", "seed": "3", "strength": "0.75",
                         "loras": json.dumps([{"name": "style", "scale": 1.0}])})
    assert r.status_code == 200, r.text
    expected = _expected(engine, [("style", 1.0)], image=np.asarray(source), strength=0.75)
    assert np.abs(_pixels(r.json()["data"][0]["b64_json"]) - expected).max() <= 1


@pytest.mark.parametrize("loras, needle", [
    ([{"name": "stlye"}], "did you mean 'style'"),
    ([{"name": "style", "scale": 9}], "allowed: -8..8"),
    ([{"name": "style", "scale": "x"}], "scale"),
    ([{"name": f"a{i}"} for i in range(9)], "at most 8 (--max-request-loras)"),
    ([{"name": "../etc/passwd"}], "not allowed"),
    ([{"name": "/etc/passwd"}], "not allowed"),
    ([{"name": "old"}], "unknown"),
    ("style", "loras"),
    ([{"name": "style", "path": "/etc/passwd"}], "path"),
])
def test_bad_loras_are_400_naming_the_field(server, loras, needle):
    r = httpx.post(f"{server.url}/v1/images/generations", timeout=600,
                   json={"prompt": PROMPT, "num_inference_steps": 2, "loras": loras})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("loras") and needle in error["message"], error
    ok = httpx.post(f"{server.url}/v1/images/generations", timeout=600,
                    json={"prompt": PROMPT, "num_inference_steps": 2, "loras": [{"name": "style"}]})
    assert ok.status_code == 200


def test_generate_cli_with_lora(server, engine, folder, tmp_path):
    from diffgraph.cli import main

    remote, local = tmp_path / "remote.png", tmp_path / "local.png"
    assert main(["generate", PROMPT, "--url", server.url, "--lora", "style:0.5", "--steps", "4", "--seed", "3",
                 "-o", str(remote)]) == 0
    assert main(["generate", PROMPT, "--model", "random:tiny", "--lora-dir", folder, "--lora", "style:0.5",
                 "--steps", "4", "--seed", "3", "-o", str(local)]) == 0
    expected = _expected(engine, [("style", 0.5)])
    for path in (remote, local):
        assert np.abs(np.asarray(Image.open(path).convert("RGB")).astype(int) - expected).max() <= 1
    assert main(["generate", PROMPT, "--model", "random:tiny", "--lora-dir", folder, "--lora", "nope",
                 "--steps", "2", "-o", str(local)]) == 2
