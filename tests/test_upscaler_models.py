"""Model upscalers from --upscaler-dir (upscaler_models.py) on the AUTOMATIC1111 routes: the listing, extras with a
tiny ESRGAN equal to spandrel running it directly, tiling, the SD upscale script with it, a pickle and a corrupt file
refused in one line. One in-process server on `random:tiny` (CPU) with a folder of a tiny 2x RRDBNet
(upscaler_util.py), a pickle and a file that is not safetensors."""

from __future__ import annotations

import base64
import importlib.util
import io
import json

import numpy as np
import pytest
from PIL import Image

if importlib.util.find_spec("spandrel") is None:  # diffgraph[upscale]; CI installs it (.ci/run)
    pytest.skip("spandrel is not installed", allow_module_level=True)

from diffgraph.upscaler_models import UpscalerModels, unwrap  # noqa: E402
from diffgraph.upscalers import UpscalerError, upscale  # noqa: E402
from server_util import served  # noqa: E402
from upscaler_util import spandrel_upscale, tiny_esrgan  # noqa: E402


def picture(width: int = 48, height: int = 40) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    return Image.fromarray(np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // width], -1)
                           .astype(np.uint8), "RGB")


def png64(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


def decoded(text: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(text))).convert("RGB")).astype(int)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("upscalers")
    tiny_esrgan(root / "tiny_x2.safetensors")
    (root / "old.pth").write_bytes(b"\x80\x04K\x01.")  # a pickle: never opened
    (root / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}     ")
    (root / "notes.txt").write_text("not a model")
    return root


@pytest.fixture(scope="module")
def client(folder):
    from diffgraph import Engine
    from diffgraph.server import ServerConfig
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as engine:
        with served(engine, ServerConfig(model="random:tiny", device="cpu", upscaler_dir=str(folder))) as c:
            yield c


def test_upscalers_lists_the_models_after_the_built_ins(client):
    items = client.get("/sdapi/v1/upscalers").json()
    assert [u["name"] for u in items] == ["None", "Lanczos", "Nearest", "broken", "tiny_x2"]
    assert items[-1] == {"name": "tiny_x2", "model_name": "ESRGAN", "model_path": "tiny_x2.safetensors",
                         "model_url": None, "scale": 4.0}
    choices = client.get("/sdapi/v1/script-info").json()[0]["args"][2]["choices"]
    assert choices == ["None", "Lanczos", "Nearest", "broken", "tiny_x2"]


def test_extra_single_image_equals_spandrel_running_the_model(client, folder):
    """Scale 2 with a 2x model: one pass of the model, whole (the image is within one tile), no resize after."""
    source = picture()
    r = client.post("/sdapi/v1/extra-single-image", json={"image": png64(source), "upscaling_resize": 2,
                                                          "upscaler_1": "TINY_X2"})
    assert r.status_code == 200, r.text
    got, expected = decoded(r.json()["image"]), spandrel_upscale(folder / "tiny_x2.safetensors", source)
    assert got.shape == (80, 96, 3) and np.abs(got - expected).max() <= 1
    assert expected.std() > 10  # the picture shows through: not a flat answer
    assert r.json()["html_info"] == "<p>Postprocess upscale by: 2, Postprocess upscaler: tiny_x2</p>"


def test_a_scale_past_the_models_runs_it_again_then_lanczos(folder):
    """AUTOMATIC1111's Upscaler.upscale: the model until the image covers the size (2x twice for 3x), then Lanczos."""
    models = UpscalerModels(str(folder))
    source = picture(24, 16)
    twice = spandrel_upscale(folder / "tiny_x2.safetensors",
                             Image.fromarray(spandrel_upscale(folder / "tiny_x2.safetensors", source)))
    expected = np.asarray(Image.fromarray(twice).resize((72, 48), Image.LANCZOS)).astype(int)
    got = np.asarray(upscale(source, "tiny_x2", 3.0, models)).astype(int)
    assert got.shape == (48, 72, 3) and np.abs(got - expected).max() <= 1


def test_a_large_image_runs_tile_by_tile_close_to_whole(folder):
    """Tiles of 32 with 4 pixels of overlap, pasted back with the overlaps blended: within a few levels of the whole
    image's run (a tile sees less context at its edges)."""
    source = picture(72, 56)
    whole = spandrel_upscale(folder / "tiny_x2.safetensors", source).astype(int)
    tiled = np.asarray(UpscalerModels(str(folder), tile=32, overlap=4).enlarge(source, "tiny_x2")).astype(int)
    assert tiled.shape == whole.shape == (112, 144, 3)
    assert np.abs(tiled - whole).mean() < 2 and np.abs(tiled - whole)[8:-8, 8:-8].max() <= 48


@pytest.mark.parametrize("name, words", [("old", "diffgraph convert"), ("broken", "broken.safetensors"),
                                         ("missing", "not available")])
def test_a_pickle_a_corrupt_file_or_an_unknown_name_is_a_one_line_400(client, name, words):
    r = client.post("/sdapi/v1/extra-single-image", json={"image": png64(picture()), "upscaling_resize": 2,
                                                          "upscaler_1": name})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "upscaler_1" and words in error["message"] and "\n" not in error["message"]


def test_sd_upscale_script_with_the_model(client):
    body = {"prompt": "a red fox", "seed": 5, "steps": 2, "width": 64, "height": 64, "sampler_name": "Euler",
            "denoising_strength": 0.5, "init_images": [png64(picture(48, 40))], "script_name": "sd upscale",
            "script_args": ["", 8, "tiny_x2", 2.0]}
    r = client.post("/sdapi/v1/img2img", json=body)
    assert r.status_code == 200, r.text
    (image,) = r.json()["images"]
    assert decoded(image).shape == (80, 96, 3)  # the 2x model's 96x80, tiled by 64x64 tiles
    assert json.loads(r.json()["info"])["extra_generation_params"]["SD upscale upscaler"] == "tiny_x2"
    by_index = client.post("/sdapi/v1/img2img", json={**body, "script_args": ["", 8, 4, 2.0]})
    assert by_index.status_code == 200 and decoded(by_index.json()["images"][0]).tolist() == decoded(image).tolist()
    pickle = client.post("/sdapi/v1/img2img", json={**body, "script_args": ["", 8, "old", 2.0]})
    assert pickle.status_code == 400 and "diffgraph convert" in pickle.json()["error"]["message"]


def test_a_converted_real_esrgan_file_reads_its_ema_weights(folder):
    """`diffgraph convert` of a Real-ESRGAN .pth keeps `params` and `params_ema` under their prefixes: the EMA's."""
    state = {"params_ema.a": 1, "params.a": 2, "params_ema.b": 3}
    assert unwrap(state) == {"a": 1, "b": 3}
    assert unwrap({"model.0.weight": 1}) == {"model.0.weight": 1}  # an old-layout ESRGAN's own keys
    models = UpscalerModels(str(folder))
    with pytest.raises(UpscalerError, match="diffgraph convert"):
        models.find("old", "upscaler_1")
    assert models.find("nothing", "upscaler_1") is None


def test_a_real_esrgan_pth_converted_by_diffgraph_convert_is_served(folder, tmp_path):
    """A Real-ESRGAN-style pickle ({"params": ..., "params_ema": ...}) through `diffgraph convert` without --key: the
    folder serves it, from its EMA weights, equal to spandrel on those weights."""
    import torch
    from safetensors.torch import load_file

    from diffgraph.models.convert import convert
    weights = load_file(str(folder / "tiny_x2.safetensors"))
    noise = {k: v + 0.05 for k, v in weights.items()}
    torch.save({"params": noise, "params_ema": weights, "iter": 3}, tmp_path / "real_x2.pth")
    convert(str(tmp_path / "real_x2.pth"), str(tmp_path / "real_x2.safetensors"))
    (tmp_path / "real_x2.pth").unlink()
    source = picture(24, 16)
    got = np.asarray(UpscalerModels(str(tmp_path)).enlarge(source, "real_x2")).astype(int)
    assert np.abs(got - spandrel_upscale(folder / "tiny_x2.safetensors", source)).max() <= 1


def test_a_1x_model_runs_three_times_then_lanczos(tmp_path):
    """A 1x (restoration) model, as AUTOMATIC1111's Upscaler.upscale runs one for a scale of 2: three passes, none of
    which reaches the size, then Lanczos."""
    path = tiny_esrgan(tmp_path / "one_x.safetensors", seed=3, scale=1)
    source = picture(24, 16)
    expected = source
    for _ in range(3):
        expected = Image.fromarray(spandrel_upscale(path, expected))
    expected = np.asarray(expected.resize((48, 32), Image.LANCZOS)).astype(int)
    got = np.asarray(upscale(source, "one_x", 2.0, UpscalerModels(str(tmp_path)))).astype(int)
    assert got.shape == (32, 48, 3) and np.abs(got - expected).max() <= 1


def test_a_pass_above_the_pixel_bound_is_a_400_before_it_runs(client, monkeypatch):
    from diffgraph import upscaler_models
    monkeypatch.setattr(upscaler_models, "MAX_PASS_PIXELS", 96 * 80 - 1)  # the 2x pass of a 48x40 image: 96x80
    r = client.post("/sdapi/v1/extra-single-image", json={"image": png64(picture()), "upscaling_resize": 1.5,
                                                          "upscaler_1": "tiny_x2"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "upscaler_1"
    assert "would make a 96x80 image" in r.json()["error"]["message"]


@pytest.mark.parametrize("how", ["in place", "cut"])
def test_a_model_rewritten_while_it_is_read_is_a_one_line_400_naming_it_and_the_server_keeps_serving(
        client, folder, monkeypatch, how):
    """A model file rewritten in place (`cp new old`, `rsync --inplace`) or cut while a request reads it: that request
    is a 400 naming the file and saying to wait (it said only "changed while it was read"), and once the file is whole
    again the next request runs the model as spandrel does."""
    from rewrite_util import rewrite_on_read

    path = folder / "tiny_x2.safetensors"
    whole, source = path.read_bytes(), picture()
    body = {"image": png64(source), "upscaling_resize": 2, "upscaler_1": "tiny_x2"}
    calls = rewrite_on_read(monkeypatch, str(path), how)  # (a new mtime: the kept model is read again)
    try:
        r = client.post("/sdapi/v1/extra-single-image", json=body)
        assert r.status_code == 400 and len(calls) == 2, r.text
        error = r.json()["error"]
        assert error["param"] == "upscaler_1" and error["message"] == (
            "upscaler_1: upscaler 'tiny_x2' (tiny_x2.safetensors) changed while it was read; wait until it is written "
            "completely, then load it again"), error
    finally:
        monkeypatch.undo()
        path.write_bytes(whole)
    r = client.post("/sdapi/v1/extra-single-image", json=body)
    assert r.status_code == 200, r.text
    assert np.abs(decoded(r.json()["image"]) - spandrel_upscale(path, source)).max() <= 1
