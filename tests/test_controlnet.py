"""ControlNet rows (issue 32) on the CPU: parity with diffusers' StableDiffusion(XL)ControlNetPipeline built from the
same modules (fp32, same seeds; one and two ControlNets, scales 0.5 / 1.0, windows [0, 1] and [0.2, 0.8]), rows
with different ControlNets, scales and windows and plain rows submitted together equal each alone, and bad input.

The ControlNets are made from the presets' UNets as diffusers' `ControlNetModel.from_unet` starts one, with its
zero-initialised parts (the residual projections and the conditioning embedding's last conv) re-initialised with
seeded random weights: a ControlNet left at zeros would add nothing, and an engine ignoring it would pass.

Faults a request can trigger (on `slot_engine`: random:tiny with three ControlNets on two slots, and two of other
input channels): each bad input is a ParamError naming its field (an HTTP 400), never a hang, a memory blow-up (an
extreme aspect's crop_and_resize) or another request's failure."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from diffgraph import Engine
from diffgraph.request import ParamError

from control_util import assert_together_equals_alone, control_image, make_controlnet
from server_util import b64png

PROMPT = "a red fox in the snow"
STEPS = 5


@pytest.fixture(scope="module", params=["random:tiny", "random:tiny-xl"])
def engine(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("controlnets")
    with Engine(model=request.param, device="cpu", dtype="fp32") as plain:
        for i, name in enumerate(("edges", "depth")):
            make_controlnet(plain.model.denoiser, str(folder / name), seed=10 + i)
        (folder / "not-a-net").mkdir()
        with Engine(model=plain.model, controlnet_dir=str(folder)) as e:
            yield e


def _reference(engine, controls, seed, steps=STEPS, guidance=None, negative=None):
    import diffusers
    from diffusers import ControlNetModel
    pipe = engine.diffusers_pipeline("euler")
    nets = [ControlNetModel.from_pretrained(os.path.join(engine.runner.controls.root, c["model"])) for c in controls]
    cls = (diffusers.StableDiffusionXLControlNetPipeline if engine.model.adapter.name == "sdxl"
           else diffusers.StableDiffusionControlNetPipeline)
    names = {"My prompt is more important": "prompt", 1: "prompt"}
    modes = {names.get(c.get("control_mode"), c.get("control_mode", "balanced")) for c in controls}
    assert len(modes) == 1, "diffusers' pipelines take one guess mode for all their ControlNets"
    if modes == {"prompt"}:  # diffusers' guess-mode scales inside the net, in both branches (the pipeline's default)
        for net in nets:
            forward = net.forward
            net.forward = lambda *a, _f=forward, **k: _f(*a, **{**k, "guess_mode": True})
    cpipe = cls.from_pipe(pipe, controlnet=nets if len(nets) > 1 else nets[0])
    one = len(nets) == 1
    pick = (lambda k: controls[0][k]) if one else (lambda k: [c[k] for c in controls])
    return cpipe(PROMPT, negative_prompt=negative, image=pick("image"), num_inference_steps=steps,
                 guess_mode=modes == {"control"},
                 controlnet_conditioning_scale=pick("scale"), control_guidance_start=pick("start"),
                 control_guidance_end=pick("end"), generator=torch.Generator().manual_seed(seed),
                 guidance_scale=engine.model.default_guidance if guidance is None else guidance,
                 output_type="np").images


CASES = [
    [dict(model="edges", scale=1.0, start=0.0, end=1.0)],
    [dict(model="edges", scale=0.5, start=0.2, end=0.8)],
    [dict(model="edges", scale=1.0, start=0.0, end=1.0), dict(model="depth", scale=0.5, start=0.2, end=0.8)],
    # AUTOMATIC1111's control modes: "ControlNet is more important" is diffusers' guess mode; "My prompt is more
    # important" its scales in both branches
    [dict(model="edges", scale=1.5, start=0.0, end=1.0, control_mode="control")],
    [dict(model="edges", scale=1.5, start=0.0, end=1.0, control_mode="My prompt is more important"),
     dict(model="depth", scale=1.0, start=0.0, end=1.0, control_mode=1)],
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_controls_equal_diffusers_controlnet_pipeline(engine, case):
    controls = [dict(c, image=control_image(64, 3 + i)) for i, c in enumerate(CASES[case])]
    ours = engine.generate(PROMPT, num_inference_steps=STEPS, seed=7, sampler="euler", controls=controls)
    ref = _reference(engine, controls, seed=7)
    plain = engine.generate(PROMPT, num_inference_steps=STEPS, seed=7, sampler="euler")
    assert ours.arrays.shape == ref.shape == (1, 64, 64, 3)
    assert np.abs(ours.arrays - plain.arrays).max() * 255 > 8  # the control reaches the image
    assert np.abs(ours.arrays - ref).max() * 255 <= 1.0, np.abs(ours.arrays - ref).max() * 255


def test_control_rows_mixed_with_plain_rows_equal_each_alone(engine):
    e = engine
    kinds = [dict(controls=[dict(model="edges", image=control_image(64, 1))]),
             dict(),
             dict(controls=[dict(model="depth", image=control_image(64, 2), scale=0.5, start=0.2, end=0.8)]),
             dict(controls=[dict(model="edges", image=control_image(64, 3), scale=0.7),
                            dict(model="depth", image=control_image(64, 4), end=0.5)], guidance_scale=1.0),
             dict(guidance_scale=1.0)]
    reqs = [e.make_request(PROMPT, num_inference_steps=4, seed=30 + i, sampler="euler", **k)
            for i, k in enumerate(kinds)]
    alone = assert_together_equals_alone(e, reqs)
    assert np.abs(alone[1] - alone[0]).max() > 0  # different requests, different images


@pytest.mark.parametrize("controls,match", [
    ([dict(model="edgez", image=np.zeros((64, 64, 3), np.uint8))], "unknown; did you mean 'edges'"),
    ([dict(model="../edges", image=np.zeros((64, 64, 3), np.uint8))], "not allowed"),
    ([dict(model="not-a-net", image=np.zeros((64, 64, 3), np.uint8))], "unknown"),
    ([dict(model="edges", image=np.zeros((64, 64, 3), np.uint8))] * 4, "at most 3"),
    ([dict(model="edges", image=np.zeros((64, 64), np.uint8))], "RGB pixels"),
    ([dict(model="edges", image="a.png")], "RGB pixels"),
    ([dict(model="edges", image=np.zeros((64, 64, 3), np.uint8), start=0.5, end=0.5)], "below its end"),
    ([dict(model="edges", image=np.zeros((64, 64, 3), np.uint8), scale=float("nan"))], "out of range"),
    ([dict(model="edges", image=np.zeros((64, 64, 3), np.uint8), weight=1)], "unknown control fields"),
    ([dict(model="edges", image=np.zeros((64, 64, 3), np.uint8), resize_mode="stretch")], "resize_mode 'stretch'"),
    ([dict(model="edges", image=np.zeros((64, 64, 3), np.uint8), control_mode=3)], "control_mode 3 is unknown"),
])
def test_bad_controls_are_param_errors_and_the_engine_keeps_serving(engine, controls, match):
    with pytest.raises(ParamError, match=match) as info:
        engine.generate(PROMPT, num_inference_steps=2, seed=1, controls=controls)
    assert info.value.param.startswith("controls")
    assert engine.generate(PROMPT, num_inference_steps=1, seed=1).arrays.shape == (1, 64, 64, 3)


def test_a_controlnet_of_another_family_is_refused(tmp_path):
    with Engine(model="random:tiny-xl", device="cpu", dtype="fp32") as xl:
        make_controlnet(xl.model.denoiser, str(tmp_path / "xl-edges"), seed=1)
    with Engine(model="random:tiny", device="cpu", dtype="fp32", controlnet_dir=str(tmp_path)) as e:
        with pytest.raises(ParamError, match="another model family"):
            e.generate(PROMPT, num_inference_steps=1, seed=1,
                       controls=[dict(model="xl-edges", image=np.zeros((64, 64, 3), np.uint8))])


def test_a_single_file_controlnet_of_another_family_is_refused(tmp_path):
    import sys

    from safetensors.torch import save_file
    sys.path.insert(0, os.path.dirname(__file__))
    from original_layout import controlnet_original

    from diffusers import ControlNetModel
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as sd:
        net = ControlNetModel.from_unet(sd.model.denoiser)
    save_file(controlnet_original(net.state_dict(), net.config), str(tmp_path / "sd-edges.safetensors"))
    with Engine(model="random:tiny-xl", device="cpu", dtype="fp32", controlnet_dir=str(tmp_path)) as e:
        with pytest.raises(ParamError, match="does not fit this model's ControlNet"):
            e.generate(PROMPT, num_inference_steps=1, seed=1,
                       controls=[dict(model="sd-edges", image=np.zeros((64, 64, 3), np.uint8))])
        assert e.generate(PROMPT, num_inference_steps=1, seed=1).arrays.shape == (1, 64, 64, 3)


def test_a_controlnet_folder_whose_config_cannot_be_read_is_left_out_of_the_listing(tmp_path):
    """A config.json of 200,000 brackets, or one that is not an object, costs its own folder only (they were a
    RecursionError and an AttributeError out of GET /v1/controlnets)."""
    from diffgraph.models.controlnet_dir import WEIGHTS, ControlNetDir

    for name, config in (("deep", "[" * 200_000 + "]" * 200_000), ("list", "[1]"),
                         ("edges", json.dumps({"_class_name": "ControlNetModel", "cross_attention_dim": 32}))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config)
        (tmp_path / name / WEIGHTS).write_bytes(b"")
    catalog = ControlNetDir(str(tmp_path))
    assert list(catalog.listing()) == ["edges"]
    assert [(r["name"], r["cross_attention_dim"]) for r in catalog.describe()] == [("edges", 32)]


def test_a_controlnet_that_cannot_be_read_is_named_relative_to_its_folder(tiny_engine, tmp_path):
    """diffusers' reader names the whole path of the file it could not read; the 400 names it relative to
    --controlnet-dir (it showed where the server keeps its files)."""
    from diffgraph.models.controlnet_dir import WEIGHTS

    make_controlnet(tiny_engine.model.denoiser, str(tmp_path / "lines" / "cut"), seed=1)
    weights = tmp_path / "lines" / "cut" / WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with Engine(model=tiny_engine.model, controlnet_dir=str(tmp_path)) as e:
        with pytest.raises(ParamError, match="ControlNet 'lines/cut'") as got:
            e.generate(PROMPT, num_inference_steps=1, controls=[dict(model="lines/cut", image=control_image(64, 1))])
    assert str(tmp_path) not in str(got.value) and os.path.realpath(tmp_path) not in str(got.value)
    assert f"{WEIGHTS} is not a readable safetensors file" in str(got.value)


def test_a_controlnet_rewritten_in_place_while_it_loads_is_a_400_naming_it(tmp_path, cut_while_loading):
    """diffusers maps a ControlNet's weights, and on the CPU at the file's dtype its parameters stayed views of that
    map: a folder rewritten in place (`cp new old`) killed the replica with SIGBUS. It is streamed tensor by tensor
    through the checked reader instead: cut while a request loads it, that request is a ParamError (a 400) naming
    the file and saying to wait, the next names the cut file, and once it is whole again the engine makes the same
    image as before."""
    controls = [dict(model="edges", image=control_image(64, 1))]
    weights = str(tmp_path / "edges" / "diffusion_pytorch_model.safetensors")
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as plain:
        make_controlnet(plain.model.denoiser, str(tmp_path / "edges"), seed=10)
        with Engine(model=plain.model, controlnet_dir=str(tmp_path)) as e:
            want = e.generate(PROMPT, num_inference_steps=2, seed=1, controls=controls).arrays
        with open(weights, "rb") as f:
            whole = f.read()
        cuts = cut_while_loading(weights)
        with Engine(model=plain.model, controlnet_dir=str(tmp_path)) as e:
            with pytest.raises(ParamError) as info:
                e.generate(PROMPT, num_inference_steps=1, seed=1, controls=controls)
            message = str(info.value)
            assert len(cuts) == 1 and info.value.param == "controls" and "\n" not in message, message
            assert message.startswith("ControlNet 'edges': diffusion_pytorch_model.safetensors ") and \
                message.endswith("; wait until it is written completely, or copy it again"), message
            with pytest.raises(ParamError) as info:
                e.generate(PROMPT, num_inference_steps=1, seed=1, controls=controls)
            assert str(info.value).startswith("ControlNet 'edges': diffusion_pytorch_model.safetensors is not a "
                                              "readable safetensors file (0 bytes"), str(info.value)
            assert e.generate(PROMPT, num_inference_steps=1, seed=1).arrays.shape == (1, 64, 64, 3)
            with open(weights, "r+b") as f:
                f.write(whole)
            got = e.generate(PROMPT, num_inference_steps=2, seed=1, controls=controls).arrays
            assert np.array_equal(got, want) and len(cuts) == 1



@pytest.mark.parametrize("how", ["in place", "cut"])
def test_a_single_file_controlnet_rewritten_while_it_loads_is_a_400_naming_it(tmp_path, monkeypatch, how):
    """A ControlNet kept as one .safetensors file (AUTOMATIC1111's and ComfyUI's way), rewritten in place or cut while
    a request reads it: that request is a one-line ParamError naming the file and saying to wait, the engine keeps
    serving, and once the file is whole again it makes the same image as before."""
    from safetensors.torch import load_file, save_file

    from rewrite_util import rewrite_on_read
    controls = [dict(model="lines", image=control_image(64, 1))]
    (tmp_path / "nets").mkdir()
    path = tmp_path / "nets" / "lines.safetensors"
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as plain:
        make_controlnet(plain.model.denoiser, str(tmp_path / "made"), seed=10)
        save_file(load_file(str(tmp_path / "made" / "diffusion_pytorch_model.safetensors")), str(path))  # one file
        whole = path.read_bytes()
        with Engine(model=plain.model, controlnet_dir=str(tmp_path / "nets")) as e:
            want = e.generate(PROMPT, num_inference_steps=2, seed=1, controls=controls).arrays
            calls = rewrite_on_read(monkeypatch, str(path), how)  # (a new mtime: the kept copy is read again)
            with pytest.raises(ParamError) as info:
                e.generate(PROMPT, num_inference_steps=1, seed=1, controls=controls)
            monkeypatch.undo()
            assert len(calls) == 2 and info.value.param == "controls", calls
            assert str(info.value) == "ControlNet file 'lines.safetensors' changed while it was read; wait until it " \
                                      "is written completely, then load it again", str(info.value)
            assert e.generate(PROMPT, num_inference_steps=1, seed=1).arrays.shape == (1, 64, 64, 3)
            path.write_bytes(whole)
            got = e.generate(PROMPT, num_inference_steps=2, seed=1, controls=controls).arrays
            assert np.array_equal(got, want)

def test_controls_need_a_controlnet_dir():
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as e:
        with pytest.raises(ParamError, match="--controlnet-dir"):
            e.generate(PROMPT, num_inference_steps=1, seed=1,
                       controls=[dict(model="edges", image=np.zeros((64, 64, 3), np.uint8))])


def test_control_rows_replay_the_control_step_graph_as_eager_runs_them(engine):
    """Graph mode (the CPU's emulated backend: the same capture and replay bookkeeping): control rows replay the one
    `step_controlon` graph of their bucket after the ControlNet prepass; plain rows replay `step`."""
    from diffgraph import GraphConfig
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), backend="emulated")
    kinds = [dict(controls=[dict(model="edges", image=control_image(64, 1), scale=0.8)]), dict(),
             dict(controls=[dict(model="depth", image=control_image(64, 2), start=0.25)], guidance_scale=1.0)]
    with Engine(model=engine.model, mode="graph", graphs=cfg, controlnet_dir=engine.runner.controls.root) as g:
        reqs = [g.make_request(PROMPT, num_inference_steps=4, seed=40 + i, sampler="euler", **k)
                for i, k in enumerate(kinds)]
        futures: list = []
        g.core.call_between_steps(lambda: futures.extend(g.submit(r) for r in reqs)).result()
        graphed = [f.result().arrays for f in futures]
        plain = g.generate(PROMPT, num_inference_steps=2, seed=1)
        replays = {r["kind"]: r["replays"] for r in g.runner.graph_table() if r["replays"]}
    eager = [engine.run(r).arrays for r in reqs]
    for a, b in zip(eager, graphed):
        assert np.abs(a - b).max() * 255 <= 1.0
    assert replays.get("step_controlon", 0) >= 4 and replays.get("step", 0) >= 2, replays
    # each ControlNet replayed its own graph over only its gathered rows
    assert sum(v for k, v in replays.items() if k.startswith("control")) >= 6, replays
    assert plain.arrays.shape == (1, 64, 64, 3)


def test_switching_controlnets_in_one_slot_copies_weights_in_place_and_never_captures(engine):
    """One device slot, ControlNets of one architecture taking turns: the second and later loads copy weights into
    the slot's module (its graphs stay valid), so nothing is captured after the first load, and each image equals
    eager."""
    from diffgraph import GraphConfig
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), backend="emulated")
    order = ["edges", "depth", "edges"]
    with Engine(model=engine.model, mode="graph", graphs=cfg, controlnet_dir=engine.runner.controls.root,
                max_controlnets=1) as g:
        reqs = [g.make_request(PROMPT, num_inference_steps=3, seed=50 + i, sampler="euler",
                               controls=[dict(model=m, image=control_image(64, 5 + i))]) for i, m in enumerate(order)]
        graphed, captures, modules = [], [], []
        for r in reqs:
            graphed.append(g.run(r).arrays)
            table = [t for t in g.runner.graph_table() if t["kind"].startswith("control")]
            captures.append(sum(t["status"] == "captured" for t in table))
            modules.append(g.runner.controls.module(1))
            assert all(t["on_demand"] == 0 and t["invalidations"] == 0 for t in table), table
    assert captures == [3, 3, 3] and modules[0] is modules[1] is modules[2]  # buckets 1, 2, 4 at 64x64, once
    for r, b in zip(reqs, graphed):
        assert np.abs(engine.run(r).arrays - b).max() * 255 <= 1.0
    assert np.abs(graphed[0] - graphed[1]).max() * 255 > 1  # the slot really ran another ControlNet


@pytest.fixture(scope="module")
def http_folder(tmp_path_factory, tiny_engine):
    root = tmp_path_factory.mktemp("http-controlnets")
    make_controlnet(tiny_engine.model.denoiser, str(root / "lines" / "edges"), seed=21)
    return str(root)


def _png(image: Image.Image) -> bytes:
    import io
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_controls_over_http_equal_the_engine_and_bad_ones_are_400s(http_folder):
    import base64
    import io

    import httpx

    from diffgraph.server.process import ServerProcess
    image = control_image(64, 5)
    with Engine("random:tiny", device="cpu", dtype="fp32", controlnet_dir=http_folder) as e:
        want = e.generate(PROMPT, num_inference_steps=3, seed=3, sampler="euler",
                          controls=[dict(model="lines/edges", image=image, scale=0.8, start=0.0, end=0.7)])
        edited = e.generate(PROMPT, num_inference_steps=3, seed=4, sampler="euler", image=_edit_image(1), strength=0.6,
                            controls=[dict(model="lines/edges", image=image, control_mode="control")])
    expected = (want.arrays[0] * 255).round().astype(int)
    s = ServerProcess("--controlnet-dir", http_folder, model="random:tiny")
    try:
        s.wait_ready()
        listed = httpx.get(f"{s.url}/v1/controlnets", timeout=60).json()
        assert [c["name"] for c in listed["data"]] == ["lines/edges"] and listed["max_controlnets"] == 2
        body = {"prompt": PROMPT, "num_inference_steps": 3, "seed": 3, "sampler": "euler",
                "controls": [{"model": "lines/edges", "image": "data:image/png;base64," + b64png(image), "scale": 0.8,
                              "end": 0.7}]}
        r = httpx.post(f"{s.url}/v1/images/generations", json=body, timeout=600)
        assert r.status_code == 200, r.text
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).convert("RGB"))
        assert np.abs(got.astype(int) - expected).max() <= 1
        for control, needle in [({"model": "lines/edgez"}, "did you mean 'lines/edges'"),
                                ({"image": "not base64!"}, "base64"),
                                ({"scale": 1e9}, "out of range"), ({"start": 0.9, "end": 0.1}, "below its end")]:
            bad = dict(body, controls=[dict(body["controls"][0], **control)])
            r = httpx.post(f"{s.url}/v1/images/generations", content=json.dumps(bad), timeout=600,
                           headers={"content-type": "application/json"})
            assert r.status_code == 400, (control, r.text)
            error = r.json()["error"]
            assert (error["param"] or "").startswith("controls"), (control, error)
            assert needle is None or needle in error["message"], error
        # the edits form: the controls as a JSON field, each map as its file part (A1111's control-mode label)
        form = {"prompt": PROMPT, "num_inference_steps": "3", "seed": "4", "sampler": "euler", "strength": "0.6",
                "controls": json.dumps([{"model": "lines/edges", "control_mode": "ControlNet is more important"}])}
        parts = {"image": ("in.png", _png(_edit_image(1))), "control_image_0": ("edges.png", _png(image))}
        r = httpx.post(f"{s.url}/v1/images/edits", data=form, files=parts, timeout=600)
        assert r.status_code == 200, r.text
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).convert("RGB"))
        assert np.abs(got.astype(int) - (edited.arrays[0] * 255).round().astype(int)).max() <= 1
        for data, files, needle in [(form, {"image": parts["image"]}, "needs its control image once"),
                                    (dict(form, controls="[]"), parts, "has no control in controls"),
                                    (dict(form, controls=json.dumps([{"model": "lines/edges", "resize_mode": "x"}])),
                                     parts, "resize_mode 'x' is unknown")]:
            r = httpx.post(f"{s.url}/v1/images/edits", data=data, files=files, timeout=600)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        r = httpx.post(f"{s.url}/v1/images/generations", json=dict(body, controls=None), timeout=600)
        assert r.status_code == 200  # still serving
    finally:
        s.stop(timeout=30)


@pytest.mark.parametrize("preprocess", ["canny", "invert"])
def test_a_preprocessed_control_equals_its_map_sent_as_the_image(engine, preprocess):
    import cv2
    rng = np.random.default_rng(0)
    photo = np.kron(rng.integers(0, 256, (8, 8, 3)), np.ones((8, 8, 1))).astype(np.uint8)  # blocks: real edges
    made = np.repeat(cv2.Canny(photo, 50, 150)[:, :, None], 3, 2) if preprocess == "canny" else 255 - photo
    assert 0 < made.mean() < 255
    kw = dict(num_inference_steps=2, seed=5, sampler="euler")
    a = engine.generate(PROMPT, controls=[dict(model="edges", image=photo, preprocess=preprocess, canny_low=50,
                                               canny_high=150)], **kw)
    b = engine.generate(PROMPT, controls=[dict(model="edges", image=made)], **kw)
    c = engine.generate(PROMPT, controls=[dict(model="edges", image=photo)], **kw)
    np.testing.assert_array_equal(a.arrays, b.arrays)
    assert np.abs(a.arrays - c.arrays).max() > 0


def test_the_cli_generates_with_a_control_locally(http_folder, tmp_path):
    """`diffgraph generate --control NAME:IMAGE:SCALE:START:END --controlnet-dir DIR` equals the engine's image."""
    import subprocess
    import sys
    control_image(64, 5).save(tmp_path / "edges.png")
    out = tmp_path / "out.png"
    run = subprocess.run([sys.executable, "-m", "diffgraph.cli", "generate", PROMPT, "--model", "random:tiny",
                          "--device", "cpu", "--steps", "3", "--seed", "3", "--sampler", "euler",
                          "--controlnet-dir", http_folder, "--control", f"lines/edges:{tmp_path / 'edges.png'}:0.8:0:0.7",
                          "--control-mode", "control", "--resize-mode", "crop_and_resize", "-o", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    with Engine("random:tiny", device="cpu", dtype="fp32", controlnet_dir=http_folder) as e:
        want = e.generate(PROMPT, num_inference_steps=3, seed=3, sampler="euler",
                          controls=[dict(model="lines/edges", image=control_image(64, 5), scale=0.8, end=0.7,
                                         control_mode="control", resize_mode="crop_and_resize")])
    got = np.asarray(Image.open(out).convert("RGB")).astype(int)
    assert np.abs(got - (want.arrays[0] * 255).round().astype(int)).max() <= 1
    bad = subprocess.run([sys.executable, "-m", "diffgraph.cli", "generate", PROMPT, "--model", "random:tiny",
                          "--controlnet-dir", http_folder, "--control", "lines/edges"], capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode != 0 and "must look like NAME:IMAGE" in bad.stderr


def test_resize_modes_prepare_the_map_as_automatic1111_does(engine):
    """A 64x32 map for a 64x64 image: "crop_and_resize" is its centre 32x32 square resized, "resize_and_fill" the
    map itself centred on its border's median colour ("just_resize" stretches it: diffusers' pipelines' way)."""
    wide = np.zeros((32, 64, 3), np.uint8)
    wide[8:24, 24:40] = 255          # a square in the middle, far from the crop's edges
    wide[0, :5] = 200                # a few border pixels off the median (which stays black)

    def prepared(image, **mode):
        request = engine.make_request(PROMPT, num_inference_steps=1, controls=[dict(model="edges", image=image,
                                                                                    **mode)])
        return engine.runner.controls.resolve(request)[0].image

    cropped = prepared(wide, resize_mode="Crop and Resize")
    assert np.abs((cropped - prepared(np.ascontiguousarray(wide[:, 16:48]))).numpy()).max() <= 1 / 255 + 1e-6
    filled = np.zeros((64, 64, 3), np.uint8)
    filled[16:48] = wide
    assert torch.equal(prepared(wide, resize_mode="resize_and_fill"), prepared(filled))
    assert not torch.equal(prepared(wide), prepared(filled))  # just_resize stretches it
    assert prepared(wide, resize_mode=2).shape == (1, 3, 64, 64)


def _edit_image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((64, 64), Image.BICUBIC)


@pytest.mark.parametrize("task", ["img2img", "inpaint"])
def test_controls_with_edits_equal_diffusers_controlnet_img2img_and_inpaint_pipelines(engine, task):
    import diffusers
    from diffusers import ControlNetModel
    image, control = _edit_image(4), control_image(64, 6)
    mask = None
    if task == "inpaint":
        m = np.zeros((64, 64), np.uint8)
        m[16:48, 8:40] = 255
        mask = Image.fromarray(m)
    ours = engine.generate(PROMPT, image=image, mask_image=mask, strength=0.7, num_inference_steps=STEPS, seed=9,
                           sampler="euler", controls=[dict(model="edges", image=control, scale=0.8, end=0.8)])
    xl = engine.model.adapter.name == "sdxl"
    cls = getattr(diffusers, f"StableDiffusion{'XL' if xl else ''}ControlNet{'Img2Img' if task == 'img2img' else 'Inpaint'}"
                             "Pipeline")
    net = ControlNetModel.from_pretrained(os.path.join(engine.runner.controls.root, "edges"))
    pipe = cls.from_pipe(engine.diffusers_pipeline("euler"), controlnet=net)
    extra = dict(mask_image=mask) if task == "inpaint" else {}
    ref = pipe(PROMPT, image=image, control_image=control, strength=0.7, num_inference_steps=STEPS,
               controlnet_conditioning_scale=0.8, control_guidance_end=0.8, guidance_scale=engine.model.default_guidance,
               generator=torch.Generator().manual_seed(9), output_type="np", **extra).images
    plain = engine.generate(PROMPT, image=image, mask_image=mask, strength=0.7, num_inference_steps=STEPS, seed=9,
                            sampler="euler")
    assert ours.arrays.shape == ref.shape == (1, 64, 64, 3)
    assert np.abs(ours.arrays - plain.arrays).max() * 255 > 4  # the control reaches the edited image
    assert np.abs(ours.arrays - ref).max() * 255 <= 1.0, np.abs(ours.arrays - ref).max() * 255


@pytest.mark.parametrize("shape", [(32, 64), (70, 40), (64, 64)])
def test_fitted_maps_equal_diffusers_resize_modes(shape):
    """control_maps.fit_map (torch-free: the HTTP process shows it) is diffusers' own resize for its two modes."""
    from diffusers.image_processor import VaeImageProcessor

    from diffgraph.control_maps import fit_map
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    processor = VaeImageProcessor(vae_scale_factor=8, do_convert_rgb=True, do_normalize=False)
    for ours, theirs in (("just_resize", "default"), ("crop_and_resize", "crop")):
        want = np.asarray(processor.resize(Image.fromarray(pixels), 48, 56, resize_mode=theirs))
        np.testing.assert_array_equal(fit_map(pixels, 56, 48, ours), want)
    assert fit_map(pixels, 56, 48, "resize_and_fill").shape == (48, 56, 3)


def test_the_map_preview_route_is_the_engines_map(engine):
    """POST /v1/controlnets/preview (the playground shows it before generating) gives the map the engine prepares:
    the preprocessor, then the resize mode; bad input is a 400 naming its field."""
    import base64
    import io

    from fastapi.testclient import TestClient

    from diffgraph.server.app import create_app
    from diffgraph.api.config import ServerConfig
    rng = np.random.default_rng(2)
    photo = np.kron(rng.integers(0, 256, (6, 12, 3)), np.ones((8, 8, 1))).astype(np.uint8)  # 96x48, blocky
    config = ServerConfig(model="random:tiny", controlnet_dir=engine.runner.controls.root)
    with TestClient(create_app(config, engine_factory=lambda: engine)) as client:
        body = {"image": b64png(Image.fromarray(photo)), "preprocess": "canny", "canny_low": 50, "canny_high": 150,
                "resize_mode": "Crop and Resize", "size": "64x64"}
        r = client.post("/v1/controlnets/preview", json=body)
        assert r.status_code == 200, r.text
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["image"]))).convert("RGB"))
        request = engine.make_request(PROMPT, controls=[dict(model="edges", image=photo, preprocess="canny",
                                                             canny_low=50, canny_high=150,
                                                             resize_mode="crop_and_resize")])
        want = engine.runner.controls.resolve(request)[0].image[0].permute(1, 2, 0).numpy()
        assert got.shape == (64, 64, 3) and 0 < got.mean() < 255
        assert np.abs(got / 255.0 - want).max() <= 0.5 / 255 + 1e-6
        for bad, param in [(dict(body, size="64by64"), "size"), (dict(body, preprocess="depth"), "controls"),
                           (dict(body, image="nope!"), "image"), (dict(body, extra=1), "extra")]:
            r = client.post("/v1/controlnets/preview", json=bad)
            assert r.status_code == 400 and (r.json()["error"]["param"] or "").startswith(param), r.text


def test_single_file_controlnets_as_automatic1111_and_comfyui_keep_them(engine, tmp_path):
    """A ControlNet as one .safetensors file, in the original layout (with AUTOMATIC1111's `control_model.` prefix
    and without it) or in diffusers' layout, loads offline (its config is the UNet's) and gives exactly the image its
    diffusers folder gives; files that hold no ControlNet are not listed."""
    import shutil
    import sys

    from safetensors.torch import save_file
    sys.path.insert(0, os.path.dirname(__file__))
    from original_layout import controlnet_original

    from diffusers import ControlNetModel
    source = os.path.join(engine.runner.controls.root, "edges")
    shutil.copytree(source, tmp_path / "edges")
    net = ControlNetModel.from_pretrained(source)
    state = {k: v.contiguous() for k, v in net.state_dict().items()}
    (tmp_path / "files").mkdir()
    save_file(controlnet_original(state, net.config), str(tmp_path / "files" / "a1111.safetensors"))
    save_file(controlnet_original(state, net.config, prefix=""), str(tmp_path / "files" / "comfy.safetensors"))
    save_file(state, str(tmp_path / "files" / "diffusers-layout.safetensors"))
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(2, 2)}, str(tmp_path / "files" / "not-a-net.safetensors"))
    with Engine(model=engine.model, controlnet_dir=str(tmp_path)) as e:
        names = [r["name"] for r in e.runner.controls.catalog.describe()]
        assert names == ["edges", "files/a1111", "files/comfy", "files/diffusers-layout"], names
        rows = {r["name"]: r for r in e.runner.controls.catalog.describe()}
        assert rows["files/a1111"]["format"] == "single_file"
        assert rows["files/a1111"]["cross_attention_dim"] == net.config.cross_attention_dim
        kw = dict(num_inference_steps=3, seed=12, sampler="euler")
        image = control_image(64, 8)
        want = e.generate(PROMPT, controls=[dict(model="edges", image=image)], **kw).arrays
        for name in ("files/a1111", "files/comfy", "files/diffusers-layout"):
            got = e.generate(PROMPT, controls=[dict(model=name, image=image)], **kw).arrays
            assert np.abs(got - want).max() == 0, name
        with pytest.raises(ParamError, match="unknown"):
            e.generate(PROMPT, controls=[dict(model="files/not-a-net", image=image)], **kw)


def test_the_compile_tier_graphs_the_controlnet_compiled_and_switching_compiles_nothing(engine, tmp_path):
    """The compile tier (aot_eager on the CPU's emulated graphs): the control graphs capture the ControlNet through
    its `Compiled` (it compiled, no fallback), the images equal eager within 1 level, and a ControlNet of the same
    architecture taking the slot's turn compiles and captures nothing."""
    from diffgraph import GraphConfig
    from diffgraph.config import CompileConfig
    # the text encoder's and VAE's compiles are test_compile_tier.py's: here only the step's and the ControlNet's
    cfg = GraphConfig(batch_buckets=(1,), resolutions=((64, 64),), backend="emulated", capture_vae=False,
                      capture_text_encoder=False)
    with Engine(model=engine.model, mode="graph", graphs=cfg, controlnet_dir=engine.runner.controls.root,
                max_controlnets=1, compile=CompileConfig(backend="aot_eager", cache_dir=str(tmp_path))) as g:
        reqs = [g.make_request(PROMPT, num_inference_steps=2, seed=60 + i, sampler="euler", guidance_scale=1.0,
                               controls=[dict(model=m, image=control_image(64, 9 + i))])
                for i, m in enumerate(["edges", "depth"])]
        first = g.run(reqs[0]).arrays
        (net,) = [c for c in g.runner.compiled if c.name == "the ControlNet"]
        compiles, captured = net.compiles, [t["replays"] for t in g.runner.graph_table() if t["kind"] == "control1"]
        second = g.run(reqs[1]).arrays
        table = [t for t in g.runner.graph_table() if t["kind"] == "control1"]
        assert net.compiles == compiles >= 1 and net.fallbacks == 0 and net.failed is None
        assert all(t["on_demand"] == 0 and t["invalidations"] == 0 for t in table), table
        assert sum(t["replays"] for t in table) > sum(captured) >= 1
    for r, b in zip(reqs, (first, second)):
        assert np.abs(engine.run(r).arrays - b).max() * 255 <= 1.0


@pytest.mark.parametrize("order", ["rgb", "bgr"])
def test_the_step_controlnet_takes_the_admission_embedding_as_diffusers_takes_the_image(order):
    """engine/controlnets.py computes a row's `controlnet_cond_embedding` once at admission; `after_embedding`'s
    ControlNet given it equals diffusers' ControlNet given the image, for either channel order, and shares weights."""
    from diffusers import ControlNetModel

    from diffgraph.engine.controlnets import after_embedding, control_embedding
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as e:
        net = ControlNetModel.from_unet(e.model.denoiser, conditioning_channels=3).eval()
        net.register_to_config(controlnet_conditioning_channel_order=order)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        net.controlnet_cond_embedding.conv_out.weight.normal_(0, 0.3, generator=g)
        net.controlnet_down_blocks[0].weight.normal_(0, 0.3, generator=g)
    image = torch.rand(2, 3, 64, 64, generator=g)
    image[:, 0] = 1.0  # the channels differ: a flip shows
    x, t = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([500.0, 20.0])
    states = torch.randn(2, 77, net.config.cross_attention_dim, generator=g)
    view = after_embedding(net)
    with torch.no_grad():
        ref = net(x, t, encoder_hidden_states=states, controlnet_cond=image, return_dict=False)
        embed = control_embedding(net, image)
        got = view(x, t, encoder_hidden_states=states, controlnet_cond=embed, return_dict=False)
    for a, b in zip([*ref[0], ref[1]], [*got[0], got[1]]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert net.config.controlnet_conditioning_channel_order == order  # the view changed nothing of the net's
    assert view.controlnet_down_blocks[0].weight is net.controlnet_down_blocks[0].weight
    assert isinstance(net.controlnet_cond_embedding, torch.nn.Module) and not isinstance(
        net.controlnet_cond_embedding, torch.nn.Identity)


# -- faults a request can trigger: more ControlNets than slots or host copies, other input channels, extreme aspects --
@pytest.fixture(scope="module")
def slot_engine(tmp_path_factory):
    """random:tiny with three ControlNets and two ControlNet slots (the default --max-controlnets), plus a ControlNet
    taking 9 input channels (an inpainting UNet's, not the latents a ControlNet is given)."""
    from diffusers import ControlNetModel
    folder = tmp_path_factory.mktemp("review-controlnets")
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as plain:
        for i, name in enumerate(("a", "b", "c")):
            make_controlnet(plain.model.denoiser, str(folder / name), seed=i)
        net = ControlNetModel.from_unet(plain.model.denoiser)
        net.conv_in = torch.nn.Conv2d(9, net.conv_in.out_channels, 3, padding=1)
        net.register_to_config(in_channels=9)
        net.save_pretrained(str(folder / "nine"), safe_serialization=True)
        ControlNetModel.from_unet(plain.model.denoiser, conditioning_channels=1).save_pretrained(str(folder / "gray"))
        with Engine(model=plain.model, controlnet_dir=str(folder), max_controlnets=2) as e:
            yield e


def _submit_together(engine, reqs):
    futures: list = []
    engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in reqs)).result()
    return futures


def test_more_distinct_controlnets_than_slots_is_a_param_error_not_a_request_that_waits_forever(slot_engine):
    controls = [dict(model=n, image=control_image(64, 1)) for n in "abc"]
    with pytest.raises(ParamError, match="at most 2 at once") as info:
        slot_engine.submit(slot_engine.make_request(PROMPT, num_inference_steps=2, seed=1, controls=controls))
    assert info.value.param == "controls"
    # the same ControlNet three times is one slot
    same = [dict(model="a", image=control_image(64, i)) for i in range(3)]
    assert slot_engine.generate(PROMPT, num_inference_steps=2, seed=1, controls=same).arrays.shape == (1, 64, 64, 3)


def test_requests_in_flight_with_more_controlnets_than_the_host_cache_all_complete(slot_engine):
    """Three requests, each its own ControlNet, queued at once on two slots: the third's resolve used to drop the
    first's host copy, and the first then failed ("dropped from host memory; retry")."""
    reqs = [slot_engine.make_request(PROMPT, num_inference_steps=2, seed=i,
                                     controls=[dict(model=n, image=control_image(64, i))]) for i, n in enumerate("abc")]
    alone = [slot_engine.run(r).arrays for r in reqs]
    together = [f.result(timeout=300).arrays for f in _submit_together(slot_engine, reqs)]
    for a, t in zip(alone, together):
        assert np.abs(a - t).max() * 255 <= 1.0


@pytest.mark.parametrize("name,field", [("nine", "in_channels"), ("gray", "conditioning_channels")])
def test_a_controlnet_of_other_input_channels_is_refused_and_fails_no_other_request(slot_engine, name, field):
    bad = slot_engine.make_request(PROMPT, num_inference_steps=2, seed=1,
                                   controls=[dict(model=name, image=control_image(64, 1))])
    with pytest.raises(ParamError, match=field) as info:
        slot_engine.submit(bad)
    assert info.value.param == "controls"
    plain = slot_engine.make_request(PROMPT, num_inference_steps=2, seed=2)
    assert slot_engine.run(plain).arrays.shape == (1, 64, 64, 3)


def test_crop_and_resize_of_an_extreme_aspect_is_a_param_error_not_a_huge_resize(slot_engine, no_huge_resizes):
    from diffgraph.control_maps import fit_map
    strip = np.zeros((8, 4096, 3), np.uint8)
    with pytest.raises(ParamError, match="crop_and_resize") as info:
        fit_map(strip, 1024, 1024, "crop_and_resize")
    assert info.value.param == "controls"
    with pytest.raises(ParamError, match="crop_and_resize"):
        slot_engine.submit(slot_engine.make_request(PROMPT, num_inference_steps=1, seed=1, controls=[
            dict(model="a", image=np.zeros((8, 300_000, 3), np.uint8), resize_mode="crop_and_resize")]))
    assert fit_map(strip, 1024, 1024, "resize_and_fill").shape == (1024, 1024, 3)  # the other modes stay bounded
