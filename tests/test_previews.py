"""Live previews (engine/previews.py): every K steps a small image of the rows' denoised prediction, for the requests
that ask. On `digits`: a 20-step request with every=2 gets 10 previews, all before its result, each closer to the
final one; requests without previews in the same batch are unchanged; the fitted latent-to-RGB factors track the
model's own VAE; OpenAI's partial_images spreads its previews over the steps. Over HTTP (random:tiny, uvicorn in
this process): the preview settings a client can give (every 0 needs the limit it asks for; an unknown preview field
names the preview's fields), refused whether the request streams or not, and a streaming client that stops reading
(its connection is reset once its writes have been paused for the send timeout, not held for ever)."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from diffgraph import Engine
from diffgraph.engine.previews import fit_factors, published_factors
from diffgraph.models.families.sd import SDFamily
from diffgraph.models.families.sdxl import SDXLFamily
from diffgraph.errors import ParamError
from diffgraph.request import PreviewSpec
from server_util import listening
from sse_util import read_stream


@pytest.fixture(scope="module")
def engine():
    with Engine("digits", device="cpu") as e:
        yield e


def _submit(engine, request):
    events, order, lock = [], [], threading.Lock()

    def on_preview(event):
        with lock:
            events.append(event)
            order.append(event.step)

    future = engine.submit(request, on_preview=on_preview)
    future.add_done_callback(lambda f: order.append("result"))
    return future, events, order


def test_every_two_steps_over_twenty_gives_ten_previews_that_approach_the_final_one(engine):
    request = engine.make_request("a handwritten digit seven", num_inference_steps=20, seed=7, num_images=2,
                                  preview={"every": 2, "format": "jpeg"})
    future, events, order = _submit(engine, request)
    result = future.result(timeout=600)
    assert [e.step for e in events] == list(range(2, 21, 2)) and {e.total for e in events} == {20}
    assert order[-1] == "result" and order[:-1] == list(range(2, 21, 2))  # every preview before the image
    _, h, w = engine.core.runner.latent_shape(request.key)  # previews at latent resolution
    frames = []
    for e in events:
        assert e.preview_format == "jpeg" and len(e.previews) == 2  # one per image of the request
        images = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB"), np.float32) for b in e.previews]
        assert all(i.shape == (h, w, 3) for i in images)
        frames.append(np.stack(images))
    distance = [np.abs(f - frames[-1]).mean() for f in frames]
    closer = sum(b < a for a, b in zip(distance, distance[1:]))
    assert closer >= 8, distance
    assert distance[0] > 5.0  # the first preview is far from the last: they show the image forming
    assert result.arrays.shape[0] == 2


def test_rows_without_previews_are_unchanged_beside_rows_with_them(engine):
    plain = engine.make_request("a handwritten digit three", num_inference_steps=6, seed=3, request_id="plain")
    alone = engine.run(plain).arrays
    watched = engine.make_request("a handwritten digit five", num_inference_steps=6, seed=5, preview={"every": 1})
    watched_alone = engine.run(watched).arrays
    sent = engine.core.previews.sent
    f1, events, _ = _submit(engine, watched)
    f2 = engine.submit(plain)
    # within the isolation tolerance of every mixed batch (a batch's float sums differ in the last bits)
    np.testing.assert_allclose(f2.result(timeout=600).arrays, alone, atol=1e-4, rtol=0)
    np.testing.assert_allclose(f1.result(timeout=600).arrays, watched_alone, atol=1e-4, rtol=0)
    assert len(events) == 6 and engine.core.previews.sent - sent == 6  # none for the plain request


def test_fitted_factors_track_the_models_own_decoder(engine):
    runner = engine.core.runner
    key = engine.make_request("a digit").key
    rgb = fit_factors(runner, key)  # the key is the size (a UNet family)
    assert rgb.source == "fitted" and rgb.weight.shape == (runner.latent_shape(key)[0], 3)
    z = torch.randn((4, *runner.latent_shape(key)), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        cells = torch.nn.functional.adaptive_avg_pool2d(runner.decode_pixels(z).float(), z.shape[2:])
    truth = cells.permute(0, 2, 3, 1).numpy()
    approx = np.einsum("nchw,cr->nhwr", z.numpy(), rgb.weight) + rgb.bias
    baseline = np.abs(truth - truth.mean(axis=(0, 1, 2))).mean()  # the best constant colour
    assert np.abs(truth - approx).mean() < 0.8 * baseline


def test_published_factors_only_for_the_sd_vae_with_trained_weights():
    class Config:
        block_out_channels, latent_channels = [128, 256, 512, 512], 4

    sd1 = published_factors(SDFamily.preview_factors, Config, False)
    sdxl = published_factors(SDXLFamily.preview_factors, Config, False)
    np.testing.assert_allclose(sd1.weight[0] * 2, [0.298, 0.207, 0.208])  # AUTOMATIC1111's, first latent channel
    np.testing.assert_allclose(sdxl.weight[3] * 2, [-0.3730, -0.2499, -0.2088])
    assert sd1.bias.tolist() == [0.5] * 3 and sd1.source == "published"
    assert published_factors(SDFamily.preview_factors, Config, True) is None  # a random-weight preset: fitted
    assert published_factors(None, Config, False) is None  # a family without published factors

    class Small:
        block_out_channels, latent_channels = [32, 64, 64, 64], 4
    assert published_factors(SDFamily.preview_factors, Small, False) is None  # digits' VAE


def test_partial_images_spread_over_the_steps_and_bad_previews_are_refused():
    spec = PreviewSpec.partial_images(3)
    assert [s for s in range(1, 21) if spec.due(s, 20)] == [5, 10, 15]
    assert [s for s in range(1, 40) if spec.due(s, 39)] == [10, 20, 29]  # heun, 20 steps: 39 evaluations
    assert [s for s in range(1, 6) if PreviewSpec.partial_images(2).due(s, 5)] == [2, 3]
    assert [s for s in range(1, 3) if spec.due(s, 2)] == [1, 2]
    assert [s for s in range(1, 21) if PreviewSpec(every=4, limit=2).due(s, 20)] == [4, 8]
    assert PreviewSpec.partial_images(0) is None
    with pytest.raises(ParamError, match="partial_images"):
        PreviewSpec.partial_images(4)
    with pytest.raises(ParamError, match="needs a limit"):
        PreviewSpec(every=0)
    with pytest.raises(ParamError, match="preview format 'gif' is unknown; allowed: jpeg, png, webp"):
        PreviewSpec(every=2, format="gif")
    with pytest.raises(ParamError) as e:
        PreviewSpec(every=-1)
    assert e.value.param == "preview" and str(e.value).startswith("preview.every -1 is out of range")
    from diffgraph.request import make_preview
    with pytest.raises(ParamError, match="unknown fields"):
        make_preview({"every": 2, "size": 5})


def test_the_preview_cost_benchmark_runs_its_scenarios(engine):
    from diffgraph.bench import preview_cost

    report = preview_cost.run(engine, 2, engine.make_request("a digit").key, repeats=1)
    assert list(report["scenarios"]) == [name for name, _ in preview_cost.SCENARIOS]
    assert all(r["images_per_s"] > 0 for r in report["scenarios"].values())
    sent = [r["previews"] for r in report["scenarios"].values()]
    # warm-up and run: 2 x 2 requests x 20 previews, then 2 x 1 request x 5
    assert sent[1] - sent[0] == 80 and sent[2] - sent[1] == 10
    assert len(report["ratios"]) == 2


@pytest.fixture(scope="module")
def tiny_decoder(tmp_path_factory):
    """A small random-weight AutoencoderTiny (TAESD's architecture, narrow), saved as a diffusers folder."""
    from diffusers import AutoencoderTiny

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("taesd")
    AutoencoderTiny(encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                    num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1)).save_pretrained(folder)
    return str(folder)


def test_a_tiny_decoder_gives_full_resolution_previews_through_its_own_graphs(tiny_decoder):
    from diffgraph import GraphConfig

    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), backend="emulated")
    with Engine("digits", device="cpu", mode="graph", graphs=cfg, preview_decoder=tiny_decoder) as e:
        assert {r["kind"] for r in e.graph_table()} >= {"step", "vae", "preview"}
        request = e.make_request("a handwritten digit two", num_inference_steps=4, seed=2, num_images=2,
                                 preview={"every": 2})
        future, events, _ = _submit(e, request)
        future.result(timeout=600)
        assert [ev.step for ev in events] == [2, 4]
        frames = [[np.asarray(Image.open(io.BytesIO(b))) for b in ev.previews] for ev in events]
        assert all(f.shape == (64, 64, 3) for pair in frames for f in pair)  # full resolution, not latent
        replays = sum(r["replays"] for r in e.graph_table() if r["kind"] == "preview")
        assert replays == 2  # one per preview (2 rows: bucket 2), no eager fallback
        assert all(r["eager_fallbacks"] == 0 for r in e.graph_table() if r["kind"] == "preview")


def test_a_bad_preview_decoder_is_refused_saying_what_to_give(tmp_path, tiny_decoder):
    with pytest.raises(ParamError, match="AutoencoderTiny") as e:
        Engine("digits", device="cpu", preview_decoder=str(tmp_path))
    assert e.value.param == "preview_decoder"
    from diffusers import AutoencoderTiny

    AutoencoderTiny(encoder_block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4, latent_channels=16,
                    num_encoder_blocks=(1,) * 4, num_decoder_blocks=(1,) * 4).save_pretrained(tmp_path / "sd3")
    with pytest.raises(ParamError, match="16-channel latents but digits makes 4-channel"):
        Engine("digits", device="cpu", preview_decoder=str(tmp_path / "sd3"))


def test_a_preview_decoder_cut_after_it_loaded_keeps_its_weights_and_one_cut_while_it_loads_is_refused(
        tmp_path, tiny_decoder, cut_while_loading):
    """diffusers maps the tiny decoder's weights (on the CPU its parameters stayed views of that map): a folder
    rewritten in place while or after it loaded could kill the server with SIGBUS. It is streamed through the checked
    reader instead: cut after it loaded, the decoder keeps its weights; cut while it loads, the engine is refused in
    one line naming the file and saying to wait; cut before, in one line naming the file."""
    import shutil

    from diffusers import AutoencoderTiny
    folder = tmp_path / "taesd"
    shutil.copytree(tiny_decoder, folder)
    want = AutoencoderTiny.from_pretrained(tiny_decoder).state_dict()
    weights = folder / "diffusion_pytorch_model.safetensors"
    with Engine("digits", device="cpu", preview_decoder=str(folder)) as e:
        weights.write_bytes(b"")
        got = e.core.previews.decoder.module.state_dict()
        assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(got.values(), want.values(), strict=True))
    shutil.copy(os.path.join(tiny_decoder, "diffusion_pytorch_model.safetensors"), weights)
    cuts = cut_while_loading(str(weights))
    with pytest.raises(ParamError) as info:
        Engine("digits", device="cpu", preview_decoder=str(folder))
    message = str(info.value)
    assert cuts and info.value.param == "preview_decoder" and "\n" not in message
    assert message.startswith(f"--preview-decoder {str(folder)!r}: diffusion_pytorch_model.safetensors ") and \
        message.endswith("; wait until it is written completely, or copy it again"), message
    with pytest.raises(ParamError) as info:
        Engine("digits", device="cpu", preview_decoder=str(folder))
    assert info.value.param == "preview_decoder" and "\n" not in str(info.value)
    assert str(info.value).startswith(f"--preview-decoder {str(folder)!r}: diffusion_pytorch_model.safetensors is not "
                                      "a readable safetensors file (0 bytes"), str(info.value)


def test_a_stream_every_two_steps_over_twenty_has_ten_previews_approaching_the_final_one():
    """The same over HTTP (issue 34's test): `preview: {"every": 2}` on a 20-step digits request streams 10
    image_generation.partial_image events before the image, each closer to the last preview."""
    import httpx
    from sse_util import read_stream

    from diffgraph.server.process import ServerProcess

    server = ServerProcess("--request-timeout", "600", model="digits")
    try:
        server.wait_ready()
        body = {"prompt": "a handwritten digit four", "num_inference_steps": 20, "seed": 4, "stream": True,
                "preview": {"every": 2, "format": "png"}}
        with httpx.stream("POST", server.url + "/v1/images/generations", json=body, timeout=600) as r:
            stream = read_stream(r.iter_lines())
    finally:
        server.stop(timeout=30)
    assert [p["step"] for p in stream.partials] == list(range(2, 21, 2))
    assert stream.events.index("image_generation.completed") > max(
        i for i, e in enumerate(stream.events) if e == "image_generation.partial_image")
    frames = [np.asarray(Image.open(io.BytesIO(base64.b64decode(p["b64_json"]))).convert("RGB"), np.float32)
              for p in stream.partials]
    distance = [np.abs(f - frames[-1]).mean() for f in frames]
    assert sum(b < a for a, b in zip(distance, distance[1:])) >= 8, distance


# -- over HTTP: the preview settings a client can give, and a streaming client that stops reading ----------------
# One server in this process (uvicorn with the connection guard, as `serve` runs it) on an engine of its own; its
# listening socket has a small send buffer, so that a client that reads nothing fills the buffers with a small image.
MODEL = "random:tiny"
HEADER_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def served():
    """(the server's URL, the peers of the connections its guard let go of)"""
    from diffgraph import Engine
    from diffgraph.api.config import ServerConfig
    from diffgraph.server.connections import ConnectionGuard, guarded_protocol, listen

    config = ServerConfig(model=MODEL, device="cpu", header_timeout=HEADER_TIMEOUT_S, request_timeout=600,
                          max_pixels=0)
    sockets = listen("127.0.0.1", 0)
    sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # inherited by the accepted sockets

    class Guard(ConnectionGuard):  # records the peers of the connections it let go of
        def closed(self, conn):
            released.add(conn.transport.get_extra_info("peername"))
            super().closed(conn)

    released: set = set()
    with listening(config, lambda: Engine(MODEL, device="cpu", dtype="fp32"), sockets,
                   timeout_keep_alive=HEADER_TIMEOUT_S,
                   http=guarded_protocol(Guard(100, HEADER_TIMEOUT_S, HEADER_TIMEOUT_S))) as url:
        yield url, released


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/images/generations", json=body, timeout=600)


def test_preview_every_zero_takes_the_limit_its_error_asks_for(served):
    server = served[0]
    """`preview: {"every": 0}` is refused saying it needs a limit; the limit it asks for must then be accepted
    (it was refused as an unknown parameter: the error's fix could not be followed)."""
    body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 4, "seed": 1, "stream": True}
    r = _post(server, {**body, "preview": {"every": 0}})
    assert r.status_code == 400 and "needs a limit" in r.json()["error"]["message"]
    with httpx.stream("POST", server + "/v1/images/generations", timeout=600,
                      json={**body, "preview": {"every": 0, "limit": 2, "format": "png"}}) as r:
        assert r.status_code == 200, r.read()
        stream = read_stream(r.iter_lines())
    assert [p["step"] for p in stream.partials] == [1, 3] and stream.events[-1] == "image_generation.completed"
    with httpx.stream("POST", server + "/v1/images/generations", timeout=600,
                      json={**body, "preview": {"every": 1, "limit": 1}}) as r:
        assert [p["step"] for p in read_stream(r.iter_lines()).partials] == [1]


def test_an_unknown_preview_field_lists_the_preview_fields(served):
    server = served[0]
    """An unknown field inside `preview` names the fields `preview` takes, not the body's top-level fields."""
    r = _post(server, {"prompt": "a red fox", "stream": True, "preview": {"every": 2, "size": 5}})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "preview.size"
    assert error["message"] == "unknown parameter 'preview.size'; accepted: every, format, limit"


def test_a_stream_whose_client_reads_nothing_is_reset_after_the_send_timeout(served):
    """A streaming client that stops reading (its connection open, its receive window full) held its connection
    for ever, the response's bytes buffered behind it: neither the request timeout nor the header timeout applies
    to a response being written, and the guard never evicts a busy connection. Its connection is reset once the
    server's writes have been paused for the send timeout (1 s here, 60 s by default)."""
    server, released = served
    body = json.dumps({"prompt": "a red fox", "size": "256x256", "n": 2, "num_inference_steps": 2, "seed": 3,
                       "stream": True, "output_format": "png"}).encode()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    client.connect(("127.0.0.1", int(server.rsplit(":", 1)[1])))
    try:
        client.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 180  # a bound that fails instead of hanging; no timing is measured
        while client.getsockname() not in released:  # the server holds the connection
            assert time.monotonic() < deadline, "the server still holds the stalled stream's connection"
            time.sleep(0.2)
        received = b""
        client.settimeout(60)
        try:
            while chunk := client.recv(1 << 16):
                received += chunk
        except ConnectionResetError:
            pass
        assert received.startswith(b"HTTP/1.1 200"), received[:200]
        assert not received.endswith(b"0\r\n\r\n"), \
            f"the whole stream ({len(received)} bytes) fit in the buffers: nothing was stalled"
    finally:
        client.close()


def test_a_bad_preview_is_refused_whether_the_request_streams_or_not(served):
    """A request that does not stream gets no previews, but a bad `preview` was silently ignored there (a 200)
    while the same body with stream true was a 400."""
    server, _ = served
    for stream in (True, False):
        body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 1, "stream": stream,
                "preview": {"every": 0}}
        r = httpx.post(server + "/v1/images/generations", json=body, timeout=600)
        assert r.status_code == 400, (stream, r.text)
        assert r.json()["error"]["param"] == "preview" and "needs a limit" in r.json()["error"]["message"]
    ok = httpx.post(server + "/v1/images/generations", timeout=600, json={
        "prompt": "a red fox", "size": "64x64", "num_inference_steps": 1, "preview": {"every": 1, "format": "png"}})
    assert ok.status_code == 200, ok.text
