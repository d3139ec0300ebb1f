"""POST /v1/images/edits (issue 15) against a `diffgraph serve` process (random:tiny on the CPU): the same images
as the in-process engine for image-to-image and inpainting, OpenAI's mask conventions (alpha: transparent =
repaint; no alpha: white = repaint; no mask: the image's transparent pixels), streaming, `diffgraph generate --url
--image`, and every bad input answered 400 in OpenAI's shape with the server healthy after. Against the suite's
tiny engine served in this process, what OpenAI's client sends and reads: `image_edit.*` stream events, `image[]`
parts, and POST /v1/images/variations, each answer validated with the client's own types."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image

from diffgraph import Engine
from diffgraph.api.config import ServerConfig
from diffgraph.server.edits import VARIATION_STRENGTH
from diffgraph.server.process import ServerProcess
from server_util import served
from sse_util import read_stream

MODEL = "random:tiny"
MAX_BYTES = 200_000
MAX_PIXELS = 512 * 512


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _source(seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((64, 64, 3)) * 255).astype(np.uint8))


def _repaint_rows() -> np.ndarray:
    m = np.zeros((64, 64), np.uint8)
    m[16:48] = 255
    return m


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-image-bytes", str(MAX_BYTES), "--max-image-pixels", str(MAX_PIXELS), model=MODEL)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop(timeout=30)


@pytest.fixture(scope="module")
def engine():
    e = Engine(model=MODEL, device="cpu", dtype="fp32")
    yield e
    e.close()


def _edit(url: str, files: dict, timeout: float = 600, **fields) -> httpx.Response:
    data = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in fields.items()}
    return httpx.post(f"{url}/v1/images/edits", files={k: ("f.png", v, "image/png") for k, v in files.items()},
                      data=data, timeout=timeout)


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64)))).astype(int)


def _expected(engine, **kw) -> np.ndarray:
    return np.asarray(engine.generate("a fox", num_inference_steps=6, seed=4, **kw).images[0]).astype(int)


def test_image_to_image_and_inpainting_equal_the_engine(server, engine):
    src = _source()
    r = _edit(server.url, {"image": _png(src)}, prompt="a fox", strength=0.6, num_inference_steps=6, seed=4)
    assert r.status_code == 200, r.text
    assert np.abs(_pixels(r.json()["data"][0]["b64_json"]) - _expected(engine, image=src, strength=0.6)).max() <= 1

    white = _repaint_rows()
    expected = _expected(engine, image=src, mask_image=white)  # inpainting: strength 1.0 by default
    # a mask without alpha: white = repaint (diffusers)
    r = _edit(server.url, {"image": _png(src), "mask": _png(Image.fromarray(white))}, prompt="a fox",
              num_inference_steps=6, seed=4)
    assert np.abs(_pixels(r.json()["data"][0]["b64_json"]) - expected).max() <= 1
    # a mask with alpha: fully transparent = repaint (OpenAI)
    rgba = np.zeros((64, 64, 4), np.uint8)
    rgba[..., 3] = np.where(white == 255, 0, 255)
    r = _edit(server.url, {"image": _png(src), "mask": _png(Image.fromarray(rgba, "RGBA"))}, prompt="a fox",
              num_inference_steps=6, seed=4)
    assert np.abs(_pixels(r.json()["data"][0]["b64_json"]) - expected).max() <= 1
    # no mask, an image with transparent pixels: inpainted where transparent (OpenAI)
    holed = np.dstack([np.asarray(src), np.where(white == 255, 0, 255).astype(np.uint8)])
    r = _edit(server.url, {"image": _png(Image.fromarray(holed, "RGBA"))}, prompt="a fox", num_inference_steps=6,
              seed=4)
    assert np.abs(_pixels(r.json()["data"][0]["b64_json"]) - expected).max() <= 1
    # an opaque RGBA image is image-to-image
    opaque = np.dstack([np.asarray(src), np.full((64, 64), 255, np.uint8)])
    r = _edit(server.url, {"image": _png(Image.fromarray(opaque, "RGBA"))}, prompt="a fox", strength=0.6,
              num_inference_steps=6, seed=4)
    assert np.abs(_pixels(r.json()["data"][0]["b64_json"]) - _expected(engine, image=src, strength=0.6)).max() <= 1


def test_edits_stream_progress_and_take_a_size(server):
    with httpx.stream("POST", f"{server.url}/v1/images/edits", timeout=600,
                      files={"image": ("a.png", _png(_source(1)), "image/png")},
                      data={"prompt": "a fox", "strength": "0.5", "num_inference_steps": "10", "stream": "true",
                            "size": "64x96", "n": "2"}) as r:
        assert r.status_code == 200
        stream = read_stream(r.iter_lines())
    assert [e["step"] for e in stream.progress] == [1, 2, 3, 4, 5]  # strength 0.5 of 10 steps
    done = stream.answer
    assert len(stream.completed) == 2 and len(done["data"]) == 2  # one completed event per image
    assert _pixels(done["data"][0]["b64_json"]).shape == (96, 64, 3)


def test_edits_stream_live_previews(server):
    """OpenAI's partial_images and diffgraph's preview (a JSON text field) on the edits form, as on generations."""
    cases = (({"partial_images": "2"}, [2, 3]),  # 2 previews spread over its 5 steps
             ({"preview": '{"every": 1, "format": "png"}'}, [1, 2, 3, 4, 5]))
    for fields, steps in cases:
        with httpx.stream("POST", f"{server.url}/v1/images/edits", timeout=600,
                          files={"image": ("a.png", _png(_source(1)), "image/png")},
                          data={"prompt": "a fox", "strength": "0.5", "num_inference_steps": "10", "stream": "true",
                                "seed": "3", **fields}) as r:
            assert r.status_code == 200
            stream = read_stream(r.iter_lines())
        assert [p["step"] for p in stream.partials] == steps and len(stream.completed) == 1


def test_generate_url_with_image_and_mask(server, engine, tmp_path):
    from diffgraph.cli import main

    src, mask = tmp_path / "in.png", tmp_path / "mask.png"
    _source().save(src)
    Image.fromarray(_repaint_rows()).save(mask)
    out = tmp_path / "out.png"
    assert main(["generate", "a fox", "--url", server.url, "--image", str(src), "--mask", str(mask), "--steps", "6",
                 "--seed", "4", "-o", str(out)]) == 0
    expected = _expected(engine, image=_source(), mask_image=_repaint_rows())
    assert np.abs(np.asarray(Image.open(out)).astype(int) - expected).max() <= 1


def _bomb_png(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares width x height (its data is not even there)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + header
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(header)) + chunk
            + struct.pack(">I", zlib.crc32(chunk)) + b"\x00\x00\x00\x00IEND\xaeB`\x82")


@pytest.mark.parametrize("files,fields,param,needle", [
    ({"image": b""}, {}, "image", "image is empty"),
    ({"image": b"not an image"}, {}, "image", "not an image this server can read"),
    ({"image": _png(_source())[:200]}, {}, "image", "could not be decoded"),
    ({"mask": _png(_source())}, {}, "image", "image is required"),
    ({"image": _png(_source()), "mask": b"\x89PNG"}, {}, "mask", "mask is not an image"),
    ({"image": _png(_source()), "mask": _png(Image.new("L", (32, 64)))}, {}, "mask",
     "mask is 32x64 but the image is 64x64"),
    ({"image": _png(Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 300, 3), np.uint8)))}, {},
     "image", "the limit is 200000"),
    ({"image": _bomb_png(4096, 4096)}, {}, "image", "(16777216 pixels); the limit is 262144"),
    ({"image": _png(_source())}, {"strength": "0"}, "strength", "strength 0.0 is out of range"),
    ({"image": _png(_source())}, {"strength": "nan"}, "strength", "out of range"),
    ({"image": _png(_source())}, {"strength": "1.5"}, "strength", "strength 1.5 is out of range"),
    ({"image": _png(_source())}, {"strength": "0.02", "num_inference_steps": "20"}, "strength",
     "strength 0.02 with num_inference_steps 20 leaves no denoising step"),
    ({"image": _png(_source())}, {"strength": "lots"}, "strength", "strength: must be a number"),
    ({"image": _png(_source())}, {"steps": "3"}, "steps", "unknown parameter 'steps'"),
])
def test_bad_edits_get_a_400_naming_the_field_and_the_server_stays_healthy(server, files, fields, param, needle):
    body = {"prompt": "a fox", **fields}
    r = _edit(server.url, files, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 200


def test_a_json_body_gets_told_what_the_endpoint_takes(server):
    r = httpx.post(f"{server.url}/v1/images/edits", json={"prompt": "a fox", "image": "aGVsbG8="}, timeout=60)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "multipart/form-data" in message and "/v1/images/generations" in message
    ok = _edit(server.url, {"image": _png(_source())}, prompt="a fox", strength=0.5, num_inference_steps=4)
    assert ok.status_code == 200


def test_the_openai_client_edits(server, engine, tmp_path):
    import openai

    src, mask = tmp_path / "in.png", tmp_path / "mask.png"
    _source().save(src)
    Image.fromarray(_repaint_rows()).save(mask)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    with open(src, "rb") as image, open(mask, "rb") as m:
        out = client.images.edit(model=MODEL, image=image, mask=m, prompt="a fox", response_format="b64_json",
                                 extra_body={"strength": 0.9, "num_inference_steps": 6, "seed": 4})
    expected = _expected(engine, image=_source(), mask_image=_repaint_rows(), strength=0.9)
    assert np.abs(_pixels(out.data[0].b64_json) - expected).max() <= 1


@pytest.fixture(scope="module")
def served_engine():
    """The engine `app` serves, its own (the app closes the engine it serves: never the suite's shared one, which
    earlier tests may also have changed)."""
    from diffgraph import Engine

    return Engine(model=MODEL, device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def app(served_engine):
    with served(served_engine, ServerConfig(model=MODEL, device="cpu")) as client:
        yield client


def _client(app):
    import openai
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=app, max_retries=0)


def test_a_streamed_edit_sends_image_edit_events_that_the_openai_client_types_read(app):
    from openai.types import ImageEditCompletedEvent, ImageEditPartialImageEvent

    fields = {"prompt": "a fox", "strength": "0.5", "num_inference_steps": "4", "seed": "3", "partial_images": "1"}
    with app.stream("POST", "/v1/images/edits", files={"image": ("a.png", _png(_source()), "image/png")},
                    data={**fields, "stream": "true"}) as r:
        stream = read_stream(r.iter_lines())
    assert [e for e in stream.events if e != "progress"] == ["image_edit.partial_image", "image_edit.completed"]
    ImageEditPartialImageEvent.model_validate(stream.partials[0])  # OpenAI's types: every field they require
    done = ImageEditCompletedEvent.model_validate(stream.completed[0])
    plain = app.post("/v1/images/edits", files={"image": ("a.png", _png(_source()), "image/png")}, data=fields)
    assert done.b64_json == plain.json()["data"][0]["b64_json"]  # the image a plain edit answers
    events = list(_client(app).images.edit(image=_png(_source()), prompt="a fox", stream=True, partial_images=1,
                                           extra_body={"strength": 0.5, "num_inference_steps": 4, "seed": 3}))
    assert [type(e).__name__ for e in events] == ["ImageEditPartialImageEvent", "ImageEditCompletedEvent"]
    assert events[1].b64_json == done.b64_json


def test_image_list_parts_are_read_as_the_image_and_more_than_one_is_refused_naming_them(app):
    import openai

    client, source = _client(app), _png(_source())
    params = dict(prompt="a fox", response_format="b64_json", extra_body={"num_inference_steps": 2, "seed": 5})
    listed = client.images.edit(image=[source], **params)  # sent as one `image[]` part
    assert listed.data[0].b64_json == client.images.edit(image=source, **params).data[0].b64_json
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(image=[source, _png(_source(1))], **params)
    error = info.value.body
    assert error["param"] == "image[]" and "image[] has 2 images; model 'random:tiny' takes one image" in error[
        "message"]
    both = app.post("/v1/images/edits", files=[("image", ("a.png", source)), ("image[]", ("b.png", source))],
                    data={"prompt": "a fox"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "image[]"


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # OpenAI marks create_variation deprecated
def test_a_variation_is_the_image_to_image_of_its_image_with_an_empty_prompt(app, served_engine):
    from openai.types import ImagesResponse

    client = _client(app)
    out = client.images.create_variation(image=_png(_source()), n=2, response_format="b64_json",
                                         extra_body={"num_inference_steps": 5, "seed": 7})
    expected = served_engine.generate("", image=_source(), strength=VARIATION_STRENGTH, num_inference_steps=5,
                                      seed=7, num_images=2).images
    assert all(np.abs(_pixels(d.b64_json) - np.asarray(e).astype(int)).max() <= 1 for d, e in zip(out.data, expected))
    raw = app.post("/v1/images/variations", files={"image": ("a.png", _png(_source()), "image/png")},
                   data={"num_inference_steps": "2", "response_format": "url", "size": "64x64"})
    by_url = ImagesResponse.model_validate(raw.json())  # OpenAI's answer: created, data with url
    assert by_url.created > 0 and len(by_url.data) == 1 and app.get(by_url.data[0].url).status_code == 200
    for field, value in (("prompt", "a fox"), ("stream", "true")):
        r = app.post("/v1/images/variations", files={"image": ("a.png", _png(_source()), "image/png")},
                     data={field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field and "/v1/images/edits" in r.json()[
            "error"]["message"]


# a form text value for each body field whose type has no generic one (a list, an object, a model)
_STRUCTURED = {"guidance_interval": [0.25, 0.75], "svg": {"mode": "paths"}, "loras": [{"name": "ink", "scale": 0.5}],
               "controls": [{"model": "edges", "scale": 0.5}], "image_prompts": {"model": "ip", "scale": 0.5},
               "preview": {"every": 2, "format": "png", "limit": 0}}


def _form_value(name: str, annotation) -> object:
    """A value (not the default) of the body field `name` of this type, as the test sends it."""
    if name in _STRUCTURED:
        return _STRUCTURED[name]
    text = str(annotation)
    for kind, value in (("bool", True), ("int", 3), ("float", 0.25), ("str", f"v-{name}")):
        if kind in text:
            return value
    raise AssertionError(f"no test value for the body field {name} ({annotation}): add one to _STRUCTURED")


def _read_edit_form(fields: dict[str, str]):
    """read_form on a real multipart body (starlette's parser) with these text fields and an image part."""
    import asyncio

    from starlette.requests import Request

    from diffgraph.server.edits import read_form
    built = httpx.Request("POST", "http://test/v1/images/edits", data=fields,
                          files={"image": ("a.png", _png(_source()), "image/png")})
    body = built.read()
    scope = {"type": "http", "method": "POST", "path": "/v1/images/edits", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in built.headers.items()]}

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}
    return asyncio.run(read_form(Request(scope, receive), max_image_bytes=MAX_BYTES))


def test_every_generations_body_field_is_a_form_field_whose_value_reaches_the_request():
    """The edits form is derived from the generations body: each body field (but NOT_EDIT's) is read from its form
    text into the generations request the route builds (the controls and image prompt into the form, which reads
    them with its file parts)."""
    import json

    from diffgraph.api.protocol import ImageGenerationRequest
    from diffgraph.server.edits import NOT_EDIT, WITH_FILES, ImageEditForm
    body_fields = {k: v for k, v in ImageGenerationRequest.model_fields.items() if k not in NOT_EDIT}
    assert set(body_fields) <= set(ImageEditForm.model_fields)
    assert set(ImageEditForm.model_fields) - set(body_fields) == {"input_fidelity", "strength"}
    sent = {name: _form_value(name, info.annotation) for name, info in body_fields.items()}
    text = {name: json.dumps(v) if not isinstance(v, str) else v for name, v in sent.items()}
    form, files = _read_edit_form(text)
    request = form.generation()
    assert form.model_fields_set == set(sent) and files.images == [_png(_source())]
    for name, value in sent.items():
        got = getattr(form if name in WITH_FILES else request, name)
        got = [v.model_dump(exclude_unset=True) for v in got] if name in ("loras", "controls") else got
        got = got.model_dump(exclude_unset=True) if name in ("image_prompts", "preview") else got
        assert got == value, name
    assert request.model_fields_set == set(sent) - set(WITH_FILES)


def test_a_field_added_to_the_body_is_a_form_field_with_no_edit_of_the_form():
    from pydantic import StrictInt, create_model

    from diffgraph.api.protocol import ImageGenerationRequest
    from diffgraph.server.edits import EditForm, form_fields

    class Body(ImageGenerationRequest):
        new_steps: StrictInt | None = None
    form = create_model("Form", __base__=EditForm, **form_fields(Body)).model_validate(
        {"prompt": "x", "new_steps": "5", "strength": "0.5"})
    assert (form.new_steps, form.strength) == (5, 0.5)
