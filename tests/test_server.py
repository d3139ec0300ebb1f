"""The HTTP server, end to end: a real `python -m diffgraph.server.cli` process on a free port (random:tiny, CPU).

One module-scoped server answers most tests, with a request timeout no happy path can reach on a loaded machine;
the tests of the request timeout itself share a second server with a short one; the queue-full / SIGTERM and drain
tests start their own, since they end them. In process on `digits` (conftest's `digits_client`): a streamed request
(server-sent events) is counted by how its stream ends, not as a success when the response hands over to the stream.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import signal
import socket
import threading
import time

import httpx
import pytest
from PIL import Image

from diffgraph.api.protocol import APIError
from diffgraph.server import image_routes
from diffgraph.server.process import ServerProcess as _ServerProcess
from sse_util import read_stream

MODEL = "random:tiny"
TIMEOUT_S = 4        # the short-timeout server's --request-timeout (only the timeout tests use it)
LONG_TIMEOUT_S = 600  # the module server's: happy paths never depend on a wall-clock limit
MAX_PROMPT = 256     # the module server's --max-prompt-bytes
MAX_PIXELS = 200_000  # the module server's --max-pixels (512x512 is over it)


class ServerProcess(_ServerProcess):
    """The project's server helper with this module's model (random:tiny on the CPU)."""

    def __init__(self, *flags: str):
        super().__init__(*flags, model=MODEL)

    def stop(self) -> None:
        super().stop(timeout=30)


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--request-timeout", str(LONG_TIMEOUT_S), "--max-prompt-bytes", str(MAX_PROMPT),
                      "--max-queue", "64", "--max-pixels", str(MAX_PIXELS))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def short_server():
    """A server whose request timeout the timeout tests reach on purpose."""
    s = ServerProcess("--request-timeout", str(TIMEOUT_S), "--max-pixels", "0")  # 0: its long requests are on purpose
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def generate(url: str, timeout: float = 600, **body) -> httpx.Response:
    body.setdefault("prompt", "a red fox")
    return httpx.post(url + "/v1/images/generations", json=body, timeout=timeout)


def png(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    image.load()
    return image


def metrics(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (the labels as printed)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=300).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def wait_for(predicate, timeout: float = 300.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def live_rows(url: str, group: str) -> float:
    return metrics(url).get(f'diffgraph_live_rows{{group="{group}"}}', 0.0)


def outcome(url: str, name: str) -> float:
    return metrics(url)[f'diffgraph_requests_total{{outcome="{name}"}}']


# -- the happy path ---------------------------------------------------------------------------------------------
def test_png_of_the_asked_size(server):
    r = generate(server.url, size="96x64", num_inference_steps=2, seed=11, n=2)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["seed"] == 11
    assert len(body["data"]) == 2
    for item in body["data"]:
        assert png(item["b64_json"]).size == (96, 64)  # WxH
    assert set(body["timings"]) == {"queue_ms", "denoise_ms", "decode_ms", "total_ms"}


def test_same_seed_same_bytes(server):
    a, b, c = (generate(server.url, num_inference_steps=3, seed=s).json()["data"][0]["b64_json"] for s in (5, 5, 6))
    assert a == b
    assert a != c


def test_jpeg_output_format(server):
    r = generate(server.url, num_inference_steps=1, output_format="jpeg", seed=1)
    assert r.status_code == 200, r.text
    assert Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).format == "JPEG"


def test_32_concurrent_requests_share_steps(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            return await asyncio.gather(*(client.post("/v1/images/generations", json={
                "prompt": f"prompt {i % 4}", "num_inference_steps": 2, "seed": i}) for i in range(32)))

    before = metrics(server.url)
    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 32
    assert [r.json()["seed"] for r in responses] == list(range(32))
    assert len({r.json()["data"][0]["b64_json"] for r in responses}) == 32
    after = metrics(server.url)
    steps = after["diffgraph_step_rows_count"] - before["diffgraph_step_rows_count"]
    single = after['diffgraph_step_rows_bucket{le="1.0"}'] - before['diffgraph_step_rows_bucket{le="1.0"}']
    assert steps < 32 * 2   # rows of different requests ran in one step
    assert single < steps   # some steps ran in a bucket above 1


def test_streaming_yields_one_progress_event_per_step(server):
    steps = 5
    with httpx.stream("POST", server.url + "/v1/images/generations", timeout=600,
                      json={"prompt": "a red fox", "num_inference_steps": steps, "seed": 9, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        stream = read_stream(r.iter_lines())
    assert [(d["step"], d["total"]) for d in stream.progress] == [(i, steps) for i in range(1, steps + 1)]
    assert stream.events == ["progress"] * steps + ["image_generation.completed"]  # no previews unasked
    final = stream.answer
    assert png(final["data"][0]["b64_json"]).size == (64, 64) and final["seed"] == 9
    plain = generate(server.url, num_inference_steps=steps, seed=9).json()
    assert final["data"][0]["b64_json"] == plain["data"][0]["b64_json"]  # streaming does not change the image


def test_a_plain_prompt_with_automatic1111_syntax_gets_a_warning_header(server):
    """Under the default prompt_syntax "plain", `<lora:...>` and `(word:1.3)` are words: the answer says so in
    X-Diffgraph-Warnings (OpenAI's answer has no field for it), streamed or not; prompts without them, or read as
    "a1111", get none."""
    tagged = generate(server.url, prompt="a fox <lora:ink:0.8>, (snow:1.3)", num_inference_steps=1, seed=2,
                      negative_prompt="(blurry:1.2)")
    assert tagged.status_code == 200, tagged.text
    prompt, negative = tagged.headers["x-diffgraph-warnings"].split(" | ")
    assert prompt.startswith("prompt holds AUTOMATIC1111 syntax (<lora:...> tags and (word:1.3) weights)")
    assert '"prompt_syntax": "a1111"' in prompt and negative.startswith("negative_prompt holds AUTOMATIC1111 "
                                                                       "syntax ((word:1.3) weights)")
    for quiet in (generate(server.url, prompt="a fox (in snow)", num_inference_steps=1, seed=2),
                  generate(server.url, prompt="a fox, (snow:1.3)", prompt_syntax="a1111", num_inference_steps=1)):
        assert quiet.status_code == 200 and "x-diffgraph-warnings" not in quiet.headers, quiet.text
    with httpx.stream("POST", server.url + "/v1/images/generations", timeout=600,
                      json={"prompt": "<lora:ink>", "num_inference_steps": 1, "stream": True}) as r:
        assert r.status_code == 200 and "<lora:...> tags" in r.headers["x-diffgraph-warnings"]
        read_stream(r.iter_lines())


def test_models_health_ready(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/ready").json()["model"] == MODEL


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    result = client.images.generate(model=MODEL, prompt="a red fox", size="64x64", response_format="b64_json", n=2,
                                    extra_body={"num_inference_steps": 2, "seed": 4, "sampler": "dpmpp_2m"})
    assert len(result.data) == 2
    assert all(png(d.b64_json).size == (64, 64) for d in result.data)
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(model=MODEL, prompt="a red fox", size="64x60", extra_body={"num_inference_steps": 1})
    assert "multiple of 8" in str(info.value)


def test_openai_client_streams_partial_images_and_reads_each_image_from_its_typed_field(server):
    """OpenAI's image stream: `partial_images` previews as image_generation.partial_image events, one
    image_generation.completed per image with the image in `b64_json`; diffgraph's progress lines are skipped."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    params = dict(model=MODEL, prompt="a red fox", size="64x64", n=2, extra_body={"num_inference_steps": 6, "seed": 4})
    events = list(client.images.generate(stream=True, partial_images=2, **params))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 4 + ["image_generation.completed"] * 2
    assert [(e.partial_image_index, e.image_index) for e in events[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [e.step for e in events[:4]] == [2, 2, 4, 4]  # 2 previews spread over 6 steps
    preview = Image.open(io.BytesIO(base64.b64decode(events[0].b64_json)))
    assert preview.format == "JPEG" and preview.size == (8, 8)  # at latent resolution
    plain = client.images.generate(response_format="b64_json", **params)
    assert [e.b64_json for e in events[4:]] == [d.b64_json for d in plain.data]  # the same images, typed field
    assert events[4].output_format == "png" and events[4].size == "64x64" and events[4].seed == 4


def test_a_preview_stream_and_its_errors(server):
    body = {"prompt": "a red fox", "num_inference_steps": 6, "seed": 2, "stream": True,
            "preview": {"every": 2, "format": "png"}}
    with httpx.stream("POST", server.url + "/v1/images/generations", json=body, timeout=600) as r:
        stream = read_stream(r.iter_lines())
    assert [p["step"] for p in stream.partials] == [2, 4, 6] and stream.events[-1] == "image_generation.completed"
    assert png(stream.partials[0]["b64_json"]).format == "PNG"
    assert stream.events.index("image_generation.completed") > stream.events.index("image_generation.partial_image")
    for extra, param, words in (({"partial_images": 2}, "partial_images", "not both"),
                                ({"preview": None, "partial_images": 4}, "partial_images", "0..3"),
                                ({"preview": {"every": -1}}, "preview", "preview.every -1 is out of range"),
                                ({"preview": {"every": 2, "format": "gif"}}, "preview", "jpeg, png, webp")):
        r = httpx.post(server.url + "/v1/images/generations", json={**body, **extra}, timeout=600)
        assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"]


def test_an_image_over_max_pixels_is_a_400_naming_size_with_the_limit(server):
    r = httpx.post(server.url + "/v1/images/generations", json={"prompt": "a fox", "size": "512x512"}, timeout=600)
    assert r.status_code == 400 and r.json()["error"]["param"] == "size"
    assert r.json()["error"]["message"] == ("size 512x512 is 262144 pixels; this server takes at most 200000 pixels "
                                            "an image (--max-pixels)")
    assert httpx.post(server.url + "/v1/images/generations", json={"prompt": "a fox", "size": "384x512",
                                                                   "num_inference_steps": 1},
                      timeout=600).status_code == 200  # 196608 pixels: under it


def _cpu_info(native: int = 512):
    from diffgraph.request import ModelInfo
    return ModelInfo(name="m", family="sd", native_size=native, default_guidance=7.5, max_rows=16, mode="eager",
                     device="cpu")


def test_the_cpu_pixel_limit_follows_the_step_time_and_the_timeout():
    from diffgraph.server.requests import cpu_pixel_limit

    info = _cpu_info()
    # steps whose cost grows with the pixels alone: 2 s at 512x512 and a 600 s timeout: 20 steps may take 150 s,
    # 3.75x the pixels of 512x512
    linear = [(512 * 512, 2.0), (512 * 256, 1.0)]
    assert abs(cpu_pixel_limit(info, linear, 600.0) - 512 * 512 * 3.75) <= 1
    assert cpu_pixel_limit(info, [(512 * 512, 60.0), (512 * 256, 30.0)], 600.0) == 512 * 512  # never below native


def test_the_cpu_pixel_limit_follows_a_cost_that_grows_faster_than_the_pixels():
    from diffgraph.server.requests import cpu_pixel_limit, step_cost_fit

    info = _cpu_info()
    native = 512 * 512  # a 1.6 s step there, half of it attention, whose share grows with the size
    a, b = 0.8 / native, 0.8 / native ** 2  # seconds per pixel, per pixel squared

    def cost(p):
        return a * p + b * p * p
    samples = [(512 * 512, cost(512 * 512)), (512 * 256, cost(512 * 256))]
    fit_a, fit_b = step_cost_fit(samples)
    assert fit_a == pytest.approx(a) and fit_b == pytest.approx(b)
    limit = cpu_pixel_limit(info, samples, 600.0)
    assert cost(limit) * 20 == pytest.approx(150.0, rel=1e-6)  # 20 steps take a quarter of the timeout
    # the linear estimate from the native step alone would have allowed far more (1024x1024 here)
    linear = 512 * 512 * 150.0 / (20 * cost(512 * 512))
    assert limit < 1024 * 1024 < linear
    # noise that bends the fit down, or one size only: never a larger limit than the costlier sample per pixel says
    assert step_cost_fit([(100, 2.0), (200, 3.0)]) == (0.02, 0.0)
    assert step_cost_fit([(100, 1.0)]) == (0.0, 1e-4)
    assert step_cost_fit([(100, 1.0), (200, 5.0)]) == (0.0, 5.0 / 200 ** 2)  # steeper than quadratic: all quadratic


def test_step_timing_takes_two_sizes_and_the_median_of_each():
    from types import SimpleNamespace

    from diffgraph.engine.replica_process import time_step_sizes
    from diffgraph.request import ParamError
    from diffgraph.server.requests import cpu_pixel_limit

    engine = SimpleNamespace(info=_cpu_info())
    calls = []

    def timed(slow):  # a fake timing: 1 us a pixel, one step in three `slow` times slower (a loaded machine)
        def step_seconds(height, width):
            calls.append((height, width))
            return height * width * 1e-6 * (slow if len(calls) % 3 == 1 else 1.0)
        return step_seconds
    quiet = time_step_sizes(engine, step_seconds=timed(1.0))
    assert sorted(set(calls)) == [(512, 256), (512, 512)] and len(calls) == 6
    assert quiet == ((512 * 512, 512 * 512 * 1e-6), (512 * 256, 512 * 256 * 1e-6))
    loaded = time_step_sizes(engine, step_seconds=timed(5.0))  # another start on a loaded machine: the same limit
    assert cpu_pixel_limit(engine.info, loaded, 600.0) == cpu_pixel_limit(engine.info, quiet, 600.0)
    calls.clear()  # a 64-pixel model has no half size: twice its width instead
    assert [p for p, _ in time_step_sizes(SimpleNamespace(info=_cpu_info(64)), step_seconds=timed(1.0))] == \
        [64 * 64, 64 * 128]

    def refusing(height, width):  # an engine that takes its native size only
        if width != 512:
            raise ParamError("width", "not this size")
        return 1.0
    assert time_step_sizes(engine, step_seconds=refusing) == ((512 * 512, 1.0),)


# -- bad input ---------------------------------------------------------------------------------------------------
BAD = [
    # (body or raw bytes, status, param, words the message must hold)
    (b'{"prompt": "a fox", ', 400, None, "not valid JSON"),
    (b'["a fox"]', 400, None, "JSON object"),
    ({}, 400, "prompt", "prompt is required"),
    ({"prompt": 7}, 400, "prompt", "must be a string"),
    ({"prompt": ""}, 400, "prompt", "prompt is empty"),
    ({"prompt": "   "}, 400, "prompt", "prompt is empty"),
    ({"prompt": "é" * MAX_PROMPT}, 400, "prompt", f"the limit is {MAX_PROMPT}"),
    ({"prompt": "a", "negative_prompt": "x" * (MAX_PROMPT + 1)}, 400, "negative_prompt", "the limit is"),
    ({"prompt": "a", "negative_prompt": 3}, 400, "negative_prompt", "must be a string"),
    ({"prompt": "a", "n": 0}, 400, "n", "n 0 is out of range; allowed: 1..16"),
    ({"prompt": "a", "n": 17}, 400, "n", "n 17 is out of range"),
    ({"prompt": "a", "n": "2"}, 400, "n", "must be an integer"),
    ({"prompt": "a", "n": 10**40}, 400, "n", "out of range"),
    ({"prompt": "a", "size": "64x60"}, 400, "size", "height 60 is not a multiple of 8; use 64"),
    ({"prompt": "a", "size": "big"}, 400, "size", "WIDTHxHEIGHT"),
    ({"prompt": "a", "size": "4096x4096"}, 400, "size", "outside the supported range 64..2048"),
    ({"prompt": "a", "size": "32x32"}, 400, "size", "outside the supported range"),
    ({"prompt": "a", "size": 64}, 400, "size", "must be a string"),
    ({"prompt": "a", "num_inference_steps": 0}, 400, "num_inference_steps", "allowed: 1..200"),
    ({"prompt": "a", "num_inference_steps": 201}, 400, "num_inference_steps", "allowed: 1..200"),
    ({"prompt": "a", "num_inference_steps": 2.5}, 400, "num_inference_steps", "must be an integer"),
    ({"prompt": "a", "guidance_scale": -1}, 400, "guidance_scale", "allowed: 0..100"),
    ({"prompt": "a", "guidance_scale": 1e300}, 400, "guidance_scale", "allowed: 0..100"),
    (b'{"prompt": "seven", "negative_prompt": "\\udfff"}', 400, "negative_prompt", "unpaired surrogate"),
    ({"prompt": "a", "guidance_scale": "high"}, 400, "guidance_scale", "must be"),
    ({"prompt": "a", "sampler": "Euler CFG++"}, 400, "sampler", "sampler 'Euler CFG++' is not supported here; allowed: "
     "euler"),
    ({"prompt": "a", "sampler": "bogus"}, 400, "sampler", "sampler 'bogus' is unknown; allowed: euler"),
    ({"prompt": "a", "schedule": "cosine"}, 400, "schedule", "schedule 'cosine' is unknown"),
    ({"prompt": "a", "seed": -1}, 400, "seed", "seed -1 is out of range"),
    ({"prompt": "a", "model": "dall-e-3"}, 400, "model", f"this server serves '{MODEL}'"),
    ({"prompt": "a", "response_format": "base64"}, 400, "response_format", "allowed: b64_json, url"),
    ({"prompt": "a", "output_format": "gif"}, 400, "output_format", "output_format 'gif' is unknown"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream", "true or false"),
    ({"prompt": "a", "steps": 10}, 400, "steps", "unknown parameter 'steps'; accepted: prompt"),
    ({"prompt": "a", "quality": "ultra"}, 400, "quality", "quality 'ultra' is unknown; allowed: low"),
    ({"prompt": "a", "background": "transparent"}, 400, "background", "cannot be honoured"),
    ({"prompt": "a", "style": "cute"}, 400, "style", "allowed: vivid, natural"),
    ({"prompt": "a", "moderation": "off"}, 400, "moderation", "allowed: auto, low"),
    ({"prompt": "a", "output_compression": 101}, 400, "output_compression", "allowed: 0..100"),
    (b"{" * 100_000, 413, None, "limit"),
]


def test_openai_fields_and_explicit_nulls(server):
    """Every field of OpenAI's images API is taken: explicit nulls mean the default, `quality` sets the steps where
    none are given (low: half the default), `output_compression` is applied to JPEG, `style` and `moderation` are
    accepted with no effect."""
    plain = generate(server.url, seed=4, num_inference_steps=10)
    nulls = generate(server.url, seed=4, num_inference_steps=10, n=None, response_format=None, output_format=None,
                     stream=None, quality=None, background=None, style=None, moderation=None, user=None,
                     output_compression=None, guidance_rescale=None, emphasis=None)
    low = generate(server.url, seed=4, quality="low", background="opaque", style="natural", moderation="low")
    assert plain.status_code == nulls.status_code == low.status_code == 200, (nulls.text, low.text)
    assert nulls.json()["data"] == plain.json()["data"] == low.json()["data"]  # low: 10 of the default 20 steps
    hd = generate(server.url, seed=4, quality="hd", num_inference_steps=10)  # explicit steps win
    assert hd.json()["data"] == plain.json()["data"]
    sizes = [len(base64.b64decode(generate(server.url, seed=4, num_inference_steps=1, output_format="jpeg",
                                           output_compression=c).json()["data"][0]["b64_json"])) for c in (0, 90)]
    assert sizes[0] > sizes[1], sizes


def test_bad_input_gets_a_clear_error(server):
    before = outcome(server.url, "bad_request")
    for body, status, param, words in BAD:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(server.url + "/v1/images/generations", timeout=600, **kwargs)
        where = f"{body!r:.60}"
        assert r.status_code == status, (where, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, where
        assert error["type"] == "invalid_request_error", where
        assert error["param"] == param, (where, error)
        assert words in error["message"], (where, error["message"])
    assert outcome(server.url, "bad_request") - before == len(BAD)
    # not a generation request, still the OpenAI error shape
    r = httpx.get(server.url + "/v1/images/generations")
    assert r.status_code == 405 and "error" in r.json()
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["type"] == "not_found_error"
    # and the server still serves
    assert httpx.get(server.url + "/health").status_code == 200
    r = generate(server.url, num_inference_steps=1, seed=1)
    assert r.status_code == 200 and png(r.json()["data"][0]["b64_json"]).size == (64, 64)


# -- requests that end early --------------------------------------------------------------------------------------
def test_timeout_answers_504_and_frees_rows(short_server):
    server = short_server
    before = outcome(server.url, "timeout")
    t0 = time.monotonic()
    r = generate(server.url, size="512x512", num_inference_steps=200, seed=1)  # far longer than the timeout
    assert r.status_code == 504, r.text
    assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + 30
    assert "request timeout" in r.json()["error"]["message"]
    wait_for(lambda: live_rows(server.url, "512x512") == 0, what="rows of the timed-out request freed")
    assert outcome(server.url, "timeout") - before == 1


def test_disconnect_aborts_and_frees_rows(server):
    before = outcome(server.url, "aborted")
    body = json.dumps({"prompt": "a red fox", "size": "256x256", "num_inference_steps": 200}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(lambda: live_rows(server.url, "256x256") == 1, what="the request to be running")
    sock.close()
    wait_for(lambda: live_rows(server.url, "256x256") == 0, timeout=300, what="rows freed after disconnect")
    wait_for(lambda: outcome(server.url, "aborted") - before == 1, what="an aborted outcome")
    m = metrics(server.url)
    assert m["diffgraph_queue_depth"] == 0
    assert m["diffgraph_inflight_requests"] == 0
    assert m["diffgraph_growth_holds_total"] == 0  # eager on the CPU: no buckets, nothing held


def test_bench_serve(server, tmp_path, capsys):
    from diffgraph.bench.serve import main

    out = tmp_path / "bench.json"
    assert main(["--url", server.url, "--rate", "8", "--duration", "1", "--mix", "64x64/2:3,96x64/1",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    assert report["sent"] > 0 and report["ok"] == report["sent"] and report["errors"] == {}
    assert 0 < report["latency_s"]["p50"] <= report["latency_s"]["p99"]
    assert report["images_per_s"] > 0
    # a sweep over two rates with its plot
    plot = tmp_path / "serve.png"
    assert main(["--url", server.url, "--rate", "4,8", "--duration", "1", "--mix", "64x64/2", "--json", str(out),
                 "--plot", str(plot)]) == 0
    sweep = json.loads(out.read_text())
    assert [r["rate"] for r in sweep["runs"]] == [4.0, 8.0] and all(r["ok"] == r["sent"] for r in sweep["runs"])
    assert Image.open(plot).size[0] > 800


# -- a server of its own: queue full, then SIGTERM ------------------------------------------------------------
def test_queue_full_then_sigterm_drains():
    # One guided image per group (two denoiser rows) and one waiting request: A runs, B waits, C finds the queue full.
    s = ServerProcess("--batch-buckets", "2", "--max-queue", "1", "--drain-timeout", "60")
    try:
        s.wait_ready()
        # the server listened before the engine was built, and said so
        assert s.first_ready_status == 503 and s.first_ready_body["error"]["code"] == "not_ready"
        results: dict[str, httpx.Response] = {}

        def send(name, **body):
            results[name] = generate(s.url, timeout=600, size="128x128", **body)

        a = threading.Thread(target=send, args=("A",), kwargs=dict(num_inference_steps=60, seed=1))
        a.start()
        wait_for(lambda: live_rows(s.url, "128x128") == 1, what="A running")
        b = threading.Thread(target=send, args=("B",), kwargs=dict(num_inference_steps=2, seed=2))
        b.start()
        wait_for(lambda: metrics(s.url)["diffgraph_queue_depth"] == 1, what="B waiting")
        c = generate(s.url, size="128x128", num_inference_steps=2)
        assert c.status_code == 429, c.text
        assert c.json()["error"]["type"] == "rate_limit_error" and "queue is full" in c.json()["error"]["message"]

        s.proc.send_signal(signal.SIGTERM)
        d = wait_for(lambda: (lambda r: r if r.status_code == 503 else None)(generate(s.url, num_inference_steps=1)),
                     what="new requests refused while draining")
        assert d.json()["error"]["code"] == "draining"
        assert httpx.get(s.url + "/ready").status_code == 503
        assert httpx.get(s.url + "/health").status_code == 200
        a.join(120)
        b.join(120)
        for name in "AB":
            assert results[name].status_code == 200, results[name].text
            assert png(results[name].json()["data"][0]["b64_json"]).size == (128, 128)
        assert s.proc.wait(30) == 0, s.output()
    finally:
        s.stop()


def _partial_post(url: str, sent: bytes = b'{"prompt": ') -> socket.socket:
    """A POST whose body stops after `sent` (Content-Length promises 100 bytes)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=300)
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n" + sent)
    return sock


def test_a_body_that_stops_arriving_times_out_or_counts_as_aborted(short_server):
    server = short_server
    timeouts, aborted = outcome(server.url, "timeout"), outcome(server.url, "aborted")
    sock = _partial_post(server.url)
    t0 = time.monotonic()
    answer = b""
    while b"body_timeout" not in answer and (chunk := sock.recv(65536)):  # headers and body may come apart
        answer += chunk
    answer = answer.decode()
    sock.close()
    assert answer.startswith("HTTP/1.1 408") and "body_timeout" in answer, answer
    assert TIMEOUT_S - 0.5 < time.monotonic() - t0 < TIMEOUT_S + 30  # the request timeout, not forever
    assert outcome(server.url, "timeout") - timeouts == 1
    sock = _partial_post(server.url)
    time.sleep(0.3)
    sock.close()  # the client leaves while sending: aborted, not an unhandled error
    wait_for(lambda: outcome(server.url, "aborted") - aborted == 1, what="the disconnect counted as aborted")
    assert "unhandled error" not in server.output()
    assert generate(server.url, num_inference_steps=1, seed=1).status_code == 200


def test_drain_ends_even_when_a_body_never_arrives():
    """SIGTERM with a client stuck sending its body (request timeout 600 s): the process exits soon after the
    drain timeout and its grace period."""
    s = ServerProcess("--drain-timeout", "1", "--request-timeout", "600")
    try:
        s.wait_ready()
        sock = _partial_post(s.url)
        wait_for(lambda: metrics(s.url)["diffgraph_inflight_requests"] == 1, what="the stuck request in flight")
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0, s.output()
        assert time.monotonic() - t0 < 20
        assert "still open" in s.output()
        sock.close()
    finally:
        s.stop()


def test_a_body_finished_after_the_drain_timeout_is_refused_cleanly():
    """A request still sending its body when the drain timeout aborts everything is refused with a JSON 503 when
    the body arrives, not run and then cut off by the exit."""
    s = ServerProcess("--drain-timeout", "1", "--request-timeout", "600")
    try:
        s.wait_ready()
        body = b'{"prompt": "a red fox", "num_inference_steps": 2}'.ljust(100)
        sock = _partial_post(s.url, body[:10])
        wait_for(lambda: metrics(s.url)["diffgraph_inflight_requests"] == 1, what="the request in flight")
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(2.0)  # past the drain timeout: its aborts have run
        sock.sendall(body[10:])
        answer = b""
        while b"}}" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
        sock.close()
        head, _, payload = answer.decode().partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 503"), answer
        assert json.loads(payload)["error"]["code"] == "aborted"
        assert s.proc.wait(30) == 0, s.output()
        assert "Exception in ASGI application" not in s.output()
    finally:
        s.stop()


def test_drain_aborts_count_as_aborted():
    from diffgraph.server.requests import outcome as _outcome
    from diffgraph.api.protocol import APIError

    assert _outcome(APIError(503, "the server shut down before this request finished", code="aborted")) == "aborted"
    assert _outcome(APIError(503, "draining", code="draining")) == "unavailable"
    assert _outcome(APIError(408, "body", code="body_timeout")) == "timeout"


def test_a_dead_engine_loop_is_not_ready():
    """A bug in the engine loop itself: /ready and the diffgraph_ready gauge say so at once, and new requests get a
    503 that says what happened instead of being queued to a loop that will never run them. The loop never runs
    again in this process, so /health answers 503 too (a liveness probe restarts the server)."""
    from fastapi.testclient import TestClient

    from diffgraph.server.app import create_app
    from diffgraph.api.config import ServerConfig

    from diffgraph import Engine

    # the engine in this process (a factory's), so that the test can break its loop
    app = create_app(ServerConfig(model=MODEL, device="cpu"), engine_factory=lambda: Engine(MODEL, device="cpu"))
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").text
            time.sleep(0.2)
        assert "diffgraph_ready 1.0" in client.get("/metrics").text
        core = app.state.server.engine.replicas[0].engine.core
        core.scheduler.schedule = lambda: 1 / 0  # the loop's next pass raises
        r = client.post("/v1/images/generations", json={"prompt": "x", "size": "64x64", "num_inference_steps": 1})
        assert r.status_code >= 500 and "error" in r.json()
        core._thread.join(timeout=60)
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
        assert "diffgraph_ready 0.0" in client.get("/metrics").text
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["ready"] is False, health.text
        assert "the engine loop stopped" in health.json()["error"] or "internal error" in health.json()["error"]
        r = client.post("/v1/images/generations", json={"prompt": "x", "size": "64x64", "num_inference_steps": 1})
        assert r.status_code == 503 and "internal error" in r.json()["error"]["message"]


def test_a1111_prompts_are_sized_then_parsed_off_the_event_loop(monkeypatch):
    """/v1/images/generations with prompt_syntax "a1111": a prompt over --max-prompt-bytes is refused before it is
    parsed (20,000 characters of '<a:' were parsed first, quadratic in the tag pattern, on the event loop), and the
    worst prompt within the limit is parsed on a worker thread while /health answers. In process (digits)."""
    from fastapi.testclient import TestClient

    from diffgraph import Engine
    from diffgraph.server.app import create_app
    from diffgraph.api.config import ServerConfig
    from diffgraph import prompt_syntax as syntax
    from offloop_util import HeldParser, post_while_probing

    app = create_app(ServerConfig(model="digits", device="cpu", max_prompt_bytes=MAX_PROMPT),
                     engine_factory=lambda: Engine("digits", device="cpu"))
    body = {"size": "64x64", "num_inference_steps": 1, "prompt_syntax": "a1111"}
    with TestClient(app) as client:
        wait_for(lambda: client.get("/ready").status_code == 200, what="the engine is ready")
        held = HeldParser(syntax.schedule_a1111)
        monkeypatch.setattr(syntax, "schedule_a1111", held)
        r = client.post("/v1/images/generations", json={**body, "prompt": "<a:" * 6666})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert f"has 19998 bytes (UTF-8); the limit is {MAX_PROMPT}" in r.json()["error"]["message"]
        assert held.calls == 0
        worst = "x <lora" + " " * (MAX_PROMPT - 7)
        r, health = post_while_probing(client, held, "/v1/images/generations", {**body, "prompt": worst})
        assert (health, held.first) == (200, (False, True))
        assert r.status_code == 400 and "does not close" in r.json()["error"]["message"], r.text


# -- in process on digits (conftest's digits_client): a streamed request is counted by how its stream ends -------
@pytest.fixture
def client(digits_client):
    return digits_client


STREAMED = {"prompt": "a handwritten digit three", "size": "64x64", "num_inference_steps": 2, "seed": 1}


def _outcomes(client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("diffgraph_requests_total{"):
            name, value = line.split(" ")
            out[name.split('"')[1]] = float(value)
    return out


def test_a_stream_that_fails_after_the_handoff_is_counted_by_its_failure(client, monkeypatch):
    before = _outcomes(client)
    r = client.post("/v1/images/generations", json={**STREAMED, "stream": True})
    assert r.status_code == 200 and "event: image_generation.completed" in r.text
    done = _outcomes(client)
    assert done["success"] == before["success"] + 1

    def full(*args, **kwargs):
        raise APIError(507, "the image store is full", code="image_store_full")

    monkeypatch.setattr(image_routes, "_response", full)  # the image made, its answer not: after the handoff
    r = client.post("/v1/images/generations", json={**STREAMED, "stream": True})
    assert r.status_code == 200 and "event: error" in r.text and "image_store_full" in r.text
    after = _outcomes(client)
    assert after["success"] == done["success"]  # not counted a success
    assert after["error"] == done["error"] + 1
