"""The `openai` Python client, unchanged, against the server (issue 67): images.generate with every documented
parameter (explicit nulls among them), both response formats and streaming; images.edit with one image, an `image[]`
list, a mask and streaming; images.create_variation; models.list / retrieve; sync and async. Every answer is read
by the client into its own pydantic types (ImagesResponse, the ImageGen / ImageEdit stream events, Model), and
their values are checked. tools/survey_openai.py prints the same checks as a table (BENCHMARKS.md session 42).

One server for the clients' tests (conftest's `clients_url`: random:tiny on the CPU, native 64x64), 2 steps.
"""

from __future__ import annotations

import asyncio
import base64
import io
import warnings

import httpx
import numpy as np
import pytest
from PIL import Image

openai = pytest.importorskip("openai")
from openai.types import ImagesResponse, Model  # noqa: E402

FAST = {"num_inference_steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def client(clients_url):
    return openai.OpenAI(base_url=f"{clients_url}/v1", api_key="unused", max_retries=0)


def png(seed: int = 0, size: int = 64, mode: str = "RGB") -> bytes:
    a = np.random.default_rng(seed).integers(0, 255, (size, size, len(mode)), dtype=np.uint8)
    if mode == "RGBA":  # OpenAI's mask: its transparent pixels are repainted
        a[..., 3] = 255
        a[16:48, 16:48, 3] = 0
    out = io.BytesIO()
    Image.fromarray(a, mode).save(out, "PNG")
    return out.getvalue()


def image(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def sizes(answer) -> list[tuple[int, int]]:
    assert isinstance(answer, ImagesResponse) and answer.created > 0
    return [image(d.b64_json).size for d in answer.data]


def test_generate_takes_every_documented_parameter_and_explicit_nulls(client):
    every = dict(model="random:tiny", prompt="a cat", n=2, size="64x64", quality="low", style="natural",
                 background="opaque", moderation="auto", output_compression=90, output_format="png",
                 response_format="b64_json", user="someone", safety_identifier="someone", complexity="medium")
    assert sizes(client.images.generate(**every, extra_body=FAST)) == [(64, 64)] * 2
    nulls = dict(n=None, response_format=None, output_format=None, stream=None, quality=None, style=None,
                 background=None, moderation=None, output_compression=None, partial_images=None, size=None,
                 model=None, complexity=None, frame_count=None, frame_duration_ms=None, svg=None,
                 safety_identifier=None)
    plain = client.images.generate(prompt="a cat", extra_body=FAST)
    assert sizes(plain) == [(64, 64)]  # the model's native size
    assert client.images.generate(prompt="a cat", **nulls, extra_body=FAST).data[0].b64_json == plain.data[0].b64_json


def test_generate_formats_and_urls(client, clients_url):
    jpeg = client.images.generate(prompt="a cat", output_format="jpeg", output_compression=50, extra_body=FAST)
    assert image(jpeg.data[0].b64_json).format == "JPEG"
    webp = client.images.generate(prompt="a cat", output_format="webp", extra_body=FAST)
    assert image(webp.data[0].b64_json).format == "WEBP"
    by_url = client.images.generate(prompt="a cat", response_format="url", extra_body=FAST)
    assert by_url.data[0].b64_json is None and by_url.data[0].url
    link = by_url.data[0].url
    fetched = httpx.get(link if link.startswith("http") else clients_url + link)
    assert fetched.status_code == 200 and Image.open(io.BytesIO(fetched.content)).size == (64, 64)


def test_refusals_name_their_field(client):
    cases = [(dict(background="transparent"), "background"), (dict(frame_count=4), "frame_count"),
             (dict(complexity="extreme"), "complexity"), (dict(extra_body={"no_such_key": 1}), "no_such_key")]
    for params, field in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.images.generate(prompt="a cat", **params)
        assert info.value.body["param"] == field, info.value.body


def test_streamed_generations_and_edits_parse_as_their_event_types(client):
    from openai.types import ImageEditCompletedEvent, ImageGenCompletedEvent
    plain = client.images.generate(prompt="a cat", extra_body=FAST).data[0].b64_json
    events = list(client.images.generate(prompt="a cat", stream=True, partial_images=1, extra_body=FAST))
    assert [type(e).__name__ for e in events] == ["ImageGenPartialImageEvent", "ImageGenCompletedEvent"]
    assert isinstance(events[-1], ImageGenCompletedEvent) and events[-1].b64_json == plain
    assert events[0].type == "image_generation.partial_image" and events[0].partial_image_index == 0
    events = list(client.images.edit(image=png(), prompt="a fox", stream=True, partial_images=1, extra_body=FAST))
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    assert isinstance(events[-1], ImageEditCompletedEvent) and image(events[-1].b64_json).size == (64, 64)


def test_edits_one_image_a_list_a_mask_and_every_parameter(client):
    one = client.images.edit(image=png(), prompt="a fox", extra_body=FAST)
    assert sizes(one) == [(64, 64)]
    assert client.images.edit(image=[png()], prompt="a fox", extra_body=FAST).data[0].b64_json == one.data[0].b64_json
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(image=[png(), png(1)], prompt="a fox", extra_body=FAST)
    assert info.value.body["param"] == "image[]"
    masked = client.images.edit(image=png(), mask=png(mode="RGBA"), prompt="a fox", model="random:tiny", n=2,
                                size="64x64", quality="low", background="opaque", input_fidelity="low",
                                output_compression=100, output_format="png", response_format="b64_json",
                                user="someone", extra_body=FAST)
    assert sizes(masked) == [(64, 64)] * 2
    unmasked = client.images.edit(image=png(), prompt="a fox", model="random:tiny", n=2, extra_body=FAST)
    assert masked.data[0].b64_json != unmasked.data[0].b64_json  # the mask was read (the kept part blended back)


def test_variations_and_models(client):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # OpenAI marks create_variation deprecated
        out = client.images.create_variation(image=png(), n=2, size="256x256", response_format="b64_json",
                                             extra_body=FAST)
    assert sizes(out) == [(256, 256)] * 2
    listed = client.models.list().data
    assert [m.id for m in listed] == ["random:tiny"] and all(isinstance(m, Model) for m in listed)
    card = client.models.retrieve("random:tiny")
    assert isinstance(card, Model) and card.id == "random:tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_the_async_client(clients_url):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{clients_url}/v1", api_key="unused", max_retries=0) as ac:
            answer = await ac.images.generate(prompt="a cat", n=2, extra_body=FAST)
            events = [e async for e in await ac.images.generate(prompt="a cat", stream=True, extra_body=FAST)]
            return answer, events

    answer, events = asyncio.run(run())
    assert sizes(answer) == [(64, 64)] * 2
    assert [e.type for e in events] == ["image_generation.completed"]
