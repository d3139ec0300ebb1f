"""Drives the `openai` Python client (its images and models resources) against a running `diffgraph serve` and checks
that its own pydantic types parse every answer; prints one markdown row per check. Usage (issue 67's measurement;
BENCHMARKS.md session 42):

    diffgraph serve --model random:tiny --device cpu --port 7861 &
    python tools/survey_openai.py http://127.0.0.1:7861
"""

from __future__ import annotations

import asyncio
import base64
import io
import sys
import warnings
from typing import Any, Callable

import httpx
import numpy as np
import openai
from openai.types import (ImageEditCompletedEvent, ImageEditPartialImageEvent, ImageGenCompletedEvent,
                          ImageGenPartialImageEvent, ImagesResponse, Model)
from PIL import Image

FAST = {"num_inference_steps": 2, "seed": 3}


def png(seed: int = 0, size: int = 64) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def mask_png(size: int = 64) -> bytes:
    a = np.full((size, size, 4), 255, np.uint8)
    a[16:48, 16:48, 3] = 0  # transparent: repaint (OpenAI's mask)
    out = io.BytesIO()
    Image.fromarray(a, "RGBA").save(out, "PNG")
    return out.getvalue()


def image_of(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def sized(r: ImagesResponse, n: int = 1, size: tuple[int, int] = (64, 64)) -> bool:
    assert isinstance(r, ImagesResponse), type(r)
    assert len(r.data) == n, len(r.data)
    assert all(image_of(d.b64_json).size == size for d in r.data), [image_of(d.b64_json).size for d in r.data]
    return True


def checks(c: openai.OpenAI, ac: openai.AsyncOpenAI, url: str) -> list[tuple[str, Callable[[], Any]]]:
    """(check, a call that raises when the check fails)"""
    g = c.images.generate
    card = c.models.list().data[0]
    model, native = card.id, getattr(card, "native_size", None) or 512
    every = dict(model=model, prompt="a cat", n=1, size="64x64", quality="low", style="natural", background="opaque",
                 moderation="auto", output_compression=90, output_format="png", response_format="b64_json",
                 user="someone", safety_identifier="someone")
    nulls = dict(n=None, response_format=None, output_format=None, stream=None, quality=None, style=None,
                 background=None, moderation=None, output_compression=None, partial_images=None, size=None,
                 model=None, complexity=None, frame_count=None, frame_duration_ms=None, svg=None)

    def stream_events(events, kinds):
        events = list(events)
        names = [type(e).__name__ for e in events]
        assert names == kinds, names
        assert image_of(events[-1].b64_json).size == (64, 64)
        return True

    def url_answer():
        r = g(prompt="a cat", size="64x64", response_format="url", extra_body=FAST)
        assert isinstance(r, ImagesResponse) and r.data[0].url
        fetched = httpx.get(r.data[0].url if r.data[0].url.startswith("http") else url + r.data[0].url, timeout=600)
        assert fetched.status_code == 200 and Image.open(io.BytesIO(fetched.content)).size == (64, 64)
        return True

    async def async_generate():
        return sized(await ac.images.generate(prompt="a cat", size="64x64", extra_body=FAST))

    def variation():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return sized(c.images.create_variation(image=png(), n=2, size="256x256", response_format="b64_json",
                                                   extra_body=FAST), 2, (256, 256))

    def listed():
        page = c.models.list()
        assert page.data and all(isinstance(m, Model) for m in page.data)
        return True

    return [
        ("generate, minimal (b64_json)", lambda: sized(g(prompt="a cat", size="64x64", extra_body=FAST))),
        ("generate, every documented parameter", lambda: sized(g(**every, extra_body=FAST))),
        ("generate, null optional parameters", lambda: sized(g(prompt="a cat", **nulls, extra_body=FAST), 1,
                                                             (native, native))),
        ("generate, n=2", lambda: sized(g(prompt="a cat", n=2, size="64x64", extra_body=FAST), 2)),
        ("generate, quality low and auto",
         lambda: all(sized(g(prompt="a cat", size="64x64", quality=q, extra_body={"seed": 1}))
                     for q in ("low", "auto"))),
        ("generate, output_format jpeg + output_compression", lambda: g(
            prompt="a cat", size="64x64", output_format="jpeg", output_compression=50,
            extra_body=FAST).data[0].b64_json.startswith("/9j/")),
        ("generate, output_format webp", lambda: image_of(g(prompt="a cat", size="64x64", output_format="webp",
                                                            extra_body=FAST).data[0].b64_json).format == "WEBP"),
        ("generate, response_format url (and the url fetched)", url_answer),
        ("generate, usage / output_format fields parse", lambda: isinstance(g(
            prompt="a cat", size="64x64", extra_body=FAST).created, int)),
        ("generate, stream=True partial_images=2 -> ImageGenStreamEvent",
         lambda: stream_events(g(prompt="a cat", size="64x64", stream=True, partial_images=2, extra_body=FAST),
                               ["ImageGenPartialImageEvent", "ImageGenCompletedEvent"])),
        ("generate, stream=True partial_images=0",
         lambda: stream_events(g(prompt="a cat", size="64x64", stream=True, partial_images=0, extra_body=FAST),
                               ["ImageGenCompletedEvent"])),
        ("generate, background transparent -> 400 naming it", lambda: _refused(
            lambda: g(prompt="a cat", size="64x64", background="transparent", extra_body=FAST), "background")),
        ("generate, unknown key -> 400", lambda: _refused(
            lambda: g(prompt="a cat", size="64x64", extra_body={"no_such_key": 1}), "no_such_key")),
        ("async generate", lambda: asyncio.run(async_generate())),
        ("edit, single image", lambda: sized(c.images.edit(image=png(), prompt="a fox", response_format="b64_json",
                                                           extra_body=FAST))),
        ("edit, image[] list of one", lambda: sized(c.images.edit(image=[png()], prompt="a fox", extra_body=FAST))),
        ("edit, image[] list of two -> 400 naming image[]", lambda: _refused(
            lambda: c.images.edit(image=[png(), png(1)], prompt="a fox", extra_body=FAST), "image[]")),
        ("edit, mask", lambda: sized(c.images.edit(image=png(), mask=mask_png(), prompt="a fox", extra_body=FAST))),
        ("edit, every documented parameter", lambda: sized(c.images.edit(
            image=png(), prompt="a fox", mask=mask_png(), model=model, n=1, size="64x64", quality="low",
            background="opaque", input_fidelity="low", output_compression=100, output_format="png",
            response_format="b64_json", user="someone", extra_body=FAST))),
        ("edit, null optional parameters", lambda: sized(c.images.edit(
            image=png(), prompt="a fox", n=None, response_format=None, output_format=None, quality=None,
            background=None, size=None, input_fidelity=None, output_compression=None, extra_body=FAST))),
        ("edit, stream=True -> ImageEditStreamEvent (image_edit.*)",
         lambda: stream_events(c.images.edit(image=png(), prompt="a fox", stream=True, partial_images=1,
                                             extra_body=FAST),
                               ["ImageEditPartialImageEvent", "ImageEditCompletedEvent"])),
        ("create_variation", variation),
        ("models.list", listed),
        ("models.retrieve", lambda: isinstance(c.models.retrieve(model), Model)),
        ("models.retrieve unknown -> 404", lambda: _refused(lambda: c.models.retrieve("no-such-model"), "",
                                                             openai.NotFoundError)),
    ]


def _refused(call: Callable[[], Any], name: str, kind: type = openai.BadRequestError) -> bool:
    try:
        call()
    except kind as e:
        assert name in str(e), str(e)
        return True
    raise AssertionError("not refused")


def run(url: str) -> list[tuple[str, bool, str]]:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    rows = []
    for name, call in checks(c, ac, url):
        try:
            ok = call() is not False
            rows.append((name, ok, "" if ok else "wrong answer"))
        except Exception as e:  # noqa: BLE001 - a survey: every failure is a row
            rows.append((name, False, f"{type(e).__name__}: {e}"[:160].replace("|", "/").replace("\n", " ")))
    return rows


def main() -> None:
    rows = run(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:7861")
    print("| check | passes | detail |\n|---|---|---|")
    for name, ok, detail in rows:
        print(f"| {name} | {'yes' if ok else 'no'} | {detail} |")
    print(f"\n{sum(ok for _, ok, _ in rows)} of {len(rows)} checks pass")


if __name__ == "__main__":
    main()
