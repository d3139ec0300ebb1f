"""Values that are valid but were read wrong (issue 36, point 3): 16-bit and float images and masks are scaled to
8 bits, not clipped; sizes take ASCII digits only; the edits form's numbers are parsed as the JSON route parses
them (n="2.0" is refused like {"n": 2.0})."""

from __future__ import annotations

import asyncio
import io

import httpx
import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from diffgraph.server.edits import FormFiles, ImageEditForm, edit_arrays, edit_input, read_form
from diffgraph.api.protocol import APIError, ImageGenerationRequest, error_from_validation

RAMP16 = (np.arange(64 * 64, dtype=np.uint32) * 16).reshape(64, 64).astype(np.uint16)  # 0 .. 65520


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


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
