"""The edits path under hostile input (a review): formats that decode before their size is checked, pixel modes
PIL cannot convert, masks whose transparency is a tRNS colour, forms cut off before their closing boundary, text
fields that are not UTF-8, a capitalized Content-Type, and a signed URL whose expiry is not ASCII digits."""

from __future__ import annotations

import asyncio
import io
import struct

import numpy as np
import pytest
from PIL import Image, ImageFile

from diffgraph.server.edits import FormFiles, edit_input, read_form
from diffgraph.server.image_store import ImageLinks, MemoryImageStore, NotSigned, UrlSigner
from diffgraph.api.protocol import APIError
from diffgraph.api.protocol import decode_upload


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
