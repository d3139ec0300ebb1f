"""POST /v1/images/edits (issue 15) against a `diffgraph serve` process (random:tiny on the CPU): the same images
as the in-process engine for image-to-image and inpainting, OpenAI's mask conventions (alpha: transparent =
repaint; no alpha: white = repaint; no mask: the image's transparent pixels), streaming, `diffgraph generate --url
--image`, and every bad input answered 400 in OpenAI's shape with the server healthy after. Against the suite's
tiny engine served in this process, what OpenAI's client sends and reads: `image_edit.*` stream events, `image[]`
parts, and POST /v1/images/variations, each answer validated with the client's own types.

Values that are valid but were read wrong: 16-bit and float images and masks are scaled to 8 bits, not clipped; sizes
take ASCII digits only; the form's numbers are parsed as the JSON route parses them (n="2.0" is refused like
{"n": 2.0}). Hostile input: formats that decode before their size is checked, pixel modes PIL cannot convert, masks
whose transparency is a tRNS colour, forms cut off before their closing boundary, text fields that are not UTF-8, a
capitalized Content-Type, a signed URL whose expiry is not ASCII digits, EXIF orientation."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image, ImageFile
from pydantic import ValidationError

from diffgraph import Engine
from diffgraph.api.protocol import APIError, ImageGenerationRequest, decode_upload, error_from_validation
from diffgraph.api.config import ServerConfig
from diffgraph.server.edits import (VARIATION_STRENGTH, FormFiles, ImageEditForm, edit_arrays, edit_input,
                                    read_form)
from diffgraph.server.image_store import ImageLinks, MemoryImageStore, NotSigned, UrlSigner
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


# -- values that are valid but were read wrong: 16-bit and float pixels, non-ASCII digits, the form's numbers ----
RAMP16 = (np.arange(64 * 64, dtype=np.uint32) * 16).reshape(64, 64).astype(np.uint16)  # 0 .. 65520


@pytest.mark.parametrize("image, expected", [
    (Image.fromarray(RAMP16), RAMP16 / 257),                                   # I;16
    (Image.fromarray(RAMP16.astype(np.int32)), RAMP16 / 257),                  # I, 16-bit values
    (Image.fromarray(RAMP16.astype(np.float32) / 65535), RAMP16 / 257),        # F in [0, 1]
    (Image.fromarray((RAMP16 // 257).astype(np.int32)), RAMP16 // 257),        # I holding 8-bit values: as they are
])
def test_16_bit_and_float_images_are_scaled_not_clipped(image, expected):
    rgb, mask = edit_arrays(image)
    assert rgb.dtype == np.uint8 and rgb.shape == (64, 64, 3) and mask is None
    assert np.abs(rgb[..., 0].astype(float) - expected).max() <= 0.5 + 1e-6
    assert (rgb[..., 0] == 255).mean() < 0.01  # clipped, 99.6% of this image was white
    assert (rgb[..., 0] == rgb[..., 2]).all()


def test_a_16_bit_png_upload_is_scaled_and_its_16_bit_mask_repaints_only_its_white():
    mask16 = np.zeros((64, 64), np.uint16)
    mask16[:16] = 65535
    mask16[16:32] = 1000  # dark grey: clipped to L it was white, and repainted
    files = FormFiles([_png(Image.fromarray(RAMP16))], {"mask": _png(Image.fromarray(mask16))})
    edit = edit_input(files, None, (0.8, 1.0), max_bytes=10_000_000, max_pixels=1 << 20)
    assert np.abs(np.asarray(edit.image)[..., 0].astype(float) - RAMP16 / 257).max() <= 0.5 + 1e-6
    mask = np.asarray(edit.mask)
    assert (mask[:16] == 255).all() and (mask[16:32] == 4).all() and (mask[32:] == 0).all()


@pytest.mark.parametrize("size", ["٥١٢x٥١٢", "５１２x５１２", "512x۵۱۲"])
def test_sizes_take_ascii_digits_only(size):
    with pytest.raises(APIError) as error:
        ImageGenerationRequest(prompt="x", size=size).width_height()
    assert error.value.status == 400 and error.value.param == "size"
    assert ImageGenerationRequest(prompt="x", size=" 512 x 768 ").width_height() == (512, 768)


def _json_route_error(**fields) -> str:
    try:
        ImageGenerationRequest.model_validate({"prompt": "x", **fields})
    except ValidationError as e:
        return error_from_validation(e).message
    raise AssertionError(f"the JSON route accepted {fields}")


def _form_error(**fields) -> str:
    try:
        ImageEditForm.model_validate({"prompt": "x", **fields})
    except ValidationError as e:
        return error_from_validation(e, ImageEditForm).message
    raise AssertionError(f"the form accepted {fields}")


@pytest.mark.parametrize("field, text, number", [
    ("n", "2.0", 2.0), ("seed", "1e3", 1e3), ("num_inference_steps", "20.5", 20.5)])
def test_form_integers_are_refused_where_the_json_route_refuses_them(field, text, number):
    assert _form_error(**{field: text}) == _json_route_error(**{field: number}) == \
        f"{field}: must be an integer, got {number!r}"


@pytest.mark.parametrize("field, text", [("n", "٢"), ("n", "２"), ("n", "+2"), ("seed", "1_000"),
                                         ("guidance_scale", "٧.٥"), ("strength", "abc")])
def test_form_numbers_take_json_numbers_only(field, text):
    assert _form_error(**{field: text}).startswith(f"{field}: must be ")


def test_form_numbers_that_json_reads_are_read():
    form = ImageEditForm.model_validate({"prompt": "x", "n": "2", "seed": " 7 ", "guidance_scale": "7",
                                         "strength": "0.5", "num_inference_steps": "-3"})
    assert (form.n, form.seed, form.guidance_scale, form.strength, form.num_inference_steps) == (2, 7, 7, 0.5, -3)


def test_the_multipart_route_refuses_n_2_0():
    """read_form on a real multipart body (starlette's parser), as the edits route reads it."""
    from starlette.requests import Request

    built = httpx.Request("POST", "http://test/v1/images/edits", data={"prompt": "a fox", "n": "2.0"},
                          files={"image": ("a.png", _png(Image.new("RGB", (8, 8))), "image/png")})
    body = built.read()
    scope = {"type": "http", "method": "POST", "path": "/v1/images/edits", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in built.headers.items()]}

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}
    with pytest.raises(APIError) as error:
        asyncio.run(read_form(Request(scope, receive), max_image_bytes=1_000_000))
    assert (error.value.status, error.value.param, error.value.message) == (400, "n", "n: must be an integer, got 2.0")


# -- hostile input to the edits path --------------------------------------------------------------------------
def _encoded(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _ico_claiming_16x16(inner: int) -> bytes:
    """An ICO whose directory says 16x16 and whose one entry is an inner x inner PNG."""
    png = _encoded(Image.new("RGB", (inner, inner), (200, 10, 10)))
    return struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 16, 16, 0, 0, 1, 32, len(png), 22) + png


def test_an_icon_is_refused_before_its_pixels_are_decoded_past_the_pixel_limit(monkeypatch):
    decoded = []
    load = ImageFile.ImageFile.load

    def spy(self):
        decoded.append(self.size[0] * self.size[1])
        return load(self)
    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    with pytest.raises(APIError) as error:
        decode_upload("image", _ico_claiming_16x16(1024), 10_000_000, 256 * 256)
    assert error.value.status == 400 and error.value.param == "image"
    assert all(pixels <= 256 * 256 for pixels in decoded), decoded  # 1024x1024 was decoded, then refused


def _form(**parts: bytes) -> FormFiles:
    """The files of a form with these parts (its image as the part `image`)."""
    return FormFiles([parts["image"]], parts)


def _la_tiff() -> bytes:
    """A gray + premultiplied-alpha TIFF (ExtraSamples = 1: PIL mode La)."""
    data = bytearray(_encoded(Image.new("LA", (64, 64), (100, 128)), "TIFF"))
    at = data.find(struct.pack("<HH", 338, 3))
    data[at + 8:at + 10] = struct.pack("<H", 1)
    return bytes(data)


@pytest.mark.parametrize("files", [
    {"image": _la_tiff()},
    {"image": _encoded(Image.new("RGB", (64, 64))), "mask": _encoded(Image.new("LAB", (64, 64)), "TIFF")},
    {"image": _encoded(Image.new("RGB", (64, 64))), "mask": _la_tiff()},
])
def test_uploads_in_modes_pil_cannot_convert_directly_are_read(files):
    assert Image.open(io.BytesIO(files.get("mask", files["image"]))).mode in ("La", "LAB")
    edit = edit_input(_form(**files), None, (0.8, 1.0), 10_000_000, 1 << 20)  # was a ValueError: a 500
    assert edit.image.shape == (64, 64, 3)


def test_a_mask_whose_transparency_is_a_trns_colour_repaints_its_transparent_pixels():
    mask = np.full((64, 64, 3), 255, np.uint8)
    mask[:16] = 0  # black, and transparent by its tRNS chunk: OpenAI's "repaint here"
    image = _encoded(Image.new("RGB", (64, 64), (50, 60, 70)))
    edit = edit_input(_form(image=image, mask=_encoded(Image.fromarray(mask), transparency=(0, 0, 0))), None,
                      (0.8, 1.0), 10_000_000, 1 << 20)
    assert (edit.mask[:16] == 255).all() and (edit.mask[16:] == 0).all()
    gray = _encoded(Image.fromarray(mask[..., 0]), transparency=0)  # L with a tRNS gray, no mask: inpaint there
    edit = edit_input(_form(image=gray), None, (0.8, 1.0), 10_000_000, 1 << 20)
    assert edit.mask is not None and (edit.mask[:16] == 255).all() and (edit.mask[16:] == 0).all()


class _Http:
    def __init__(self, body: bytes, content_type: str = "multipart/form-data; boundary=XX"):
        self.headers = {"content-type": content_type, "content-length": str(len(body))}
        self.body = body

    async def stream(self):
        for i in range(0, len(self.body), 1000):
            yield self.body[i:i + 1000]


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    file = f'; filename="{filename}"' if filename else ""
    return f'--XX\r\nContent-Disposition: form-data; name="{name}"{file}\r\n\r\n'.encode() + value + b"\r\n"


_PNG = _encoded(Image.new("RGB", (64, 64)))
_FORM = _part("prompt", b"a fox") + _part("image", _PNG, "a.png") + _part("mask", _PNG, "m.png") + b"--XX--\r\n"


@pytest.mark.parametrize("body", [_FORM[:-len(b"--XX--\r\n")], _FORM[:-40], _FORM[:-len(_PNG)]])
def test_a_form_cut_off_before_its_closing_boundary_is_refused_not_read_without_its_last_part(body):
    with pytest.raises(APIError) as error:  # was: the mask silently dropped, an image-to-image answer
        asyncio.run(read_form(_Http(body), 1_000_000))
    assert error.value.status == 400 and "closing boundary" in error.value.message
    form, files = asyncio.run(read_form(_Http(_FORM), 1_000_000))
    assert form.prompt == "a fox" and set(files.parts) == {"image", "mask"} and files.images == [_PNG]


def test_a_text_field_that_is_not_utf8_is_refused_naming_it():
    body = _part("prompt", b"a \xff\xfe fox") + _part("image", _PNG, "a.png") + b"--XX--\r\n"
    with pytest.raises(APIError) as error:  # was: generated for the prompt "a \ufffd\ufffd fox"
        asyncio.run(read_form(_Http(body), 1_000_000))
    assert error.value.status == 400 and error.value.param == "prompt" and "UTF-8" in error.value.message


def test_the_content_type_is_matched_without_regard_to_case():
    form, files = asyncio.run(read_form(_Http(_FORM, "Multipart/Form-Data; boundary=XX"), 1_000_000))
    assert form.prompt == "a fox" and set(files.parts) == {"image", "mask"} and files.images == [_PNG]


@pytest.mark.parametrize("exp", ["\u00b2", "\u0663" * 10])
def test_a_signed_url_whose_expiry_is_not_ascii_digits_is_a_401_not_a_500(exp):
    links = ImageLinks(MemoryImageStore(60, 1 << 20), UrlSigner(("key",)), None)
    url = links.maker("http://x")(b"img", "png")
    name = url.split("/")[-1].split("?")[0]
    with pytest.raises(NotSigned):
        links.serve(name, exp, "0" * 32, key_given=False)


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_a_photo_with_an_exif_orientation_is_read_upright_as_diffusers_load_image_reads_it(orientation):
    """A phone stores its photo sideways with an EXIF orientation mark; every viewer (and diffusers' load_image)
    shows it turned. Uploads were read as stored, so an edit came back sideways (and a mask drawn on the photo as
    shown did not fit it)."""
    from diffusers.utils import load_image

    from diffgraph.api.protocol import decode_upload
    pixels = np.zeros((48, 64, 3), np.uint8)
    pixels[:8, :16] = 255  # a mark in the stored image's top-left corner
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", exif=exif)
    got = decode_upload("image", buf.getvalue(), 1 << 20, 1 << 20)
    expected = load_image(Image.open(io.BytesIO(buf.getvalue())))
    assert got.size == expected.size == ((64, 48) if orientation == 3 else (48, 64))
    assert np.array_equal(np.asarray(got.convert("RGB")), np.asarray(expected.convert("RGB")))
