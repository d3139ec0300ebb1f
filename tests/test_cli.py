"""The CLI: generate writes PNGs (locally or through a running server with --url), models lists presets, bad
input exits 2 with one line, and the light commands import no torch. The command line's mistakes each end in one line
naming the fix and exit 2, before the model loads where it can: an unwritable -o, a CUDA device asked of a CPU build
of torch (generate, and serve from flags, the TOML file or `python -m diffgraph.server.cli`), a model folder with
missing or truncated weights (the file named), `--seed -1` as random, `--lora PATH`, "did you mean" for samplers,
schedules and models; `diffgraph serve --log-level info` prints diffgraph's INFO lines."""

import base64
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diffgraph.sampling.names import SAMPLERS
from PIL import Image, PngImagePlugin

from diffgraph.cli import main


def test_generate_writes_png(tmp_path, capsys):
    out = tmp_path / "img.png"
    rc = main(["generate", "a cat", "-o", str(out), "--model", "random:tiny", "--steps", "3", "--seed", "1",
               "--width", "64", "--height", "96"])
    assert rc == 0
    with Image.open(out) as im:
        assert im.size == (64, 96) and im.mode == "RGB"


def test_generate_numbered_files(tmp_path):
    out = tmp_path / "img.png"
    rc = main(["generate", "a cat", "-o", str(out), "--model", "random:tiny", "--steps", "2", "-n", "3", "--seed", "2"])
    assert rc == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["img-0.png", "img-1.png", "img-2.png"]
    a, b = (Image.open(tmp_path / f).tobytes() for f in files[:2])
    assert a != b


def test_models_lists_presets(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("random:tiny", "random:tiny-xl", "random:sd15", "random:sdxl"):
        assert name in out


@pytest.mark.parametrize("args, needle", [
    (["--width", "100"], "--width 100 is not a multiple of 8; use 96 or 104"),
    (["--steps", "0"], "--steps 0 is out of range"),
    (["--sampler", "bogus"], "--sampler 'bogus' is unknown; allowed: " + ", ".join(SAMPLERS)),
    (["--schedule", "cosine"], "--schedule 'cosine' is unknown"),
    (["--guidance", "-1"], "--guidance -1.0 is out of range"),
    (["-n", "17"], "-n/--num-images 17 is out of range"),
    (["--device", "tpu"], "--device 'tpu' is not understood; use cpu, cuda or cuda:N"),
    (["--model", "random:nope"], "neither a local folder nor a known preset; supported:"),
    (["-o", "out.gif"], "must end in .png"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, needle):
    base = ["generate", "a cat", "--model", "random:tiny", "-o", str(tmp_path / "x.png")]
    rc = main(base + args)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert needle in err
    assert len(err.splitlines()) == 1


def test_empty_prompt_is_refused_as_the_server_refuses_it(tmp_path, capsys):
    assert main(["generate", "  ", "--model", "random:tiny", "-o", str(tmp_path / "x.png")]) == 2
    assert "the prompt is empty; describe the image to generate" in capsys.readouterr().err


def test_console_script_runs_as_module(tmp_path):
    out = tmp_path / "m.png"
    proc = subprocess.run([sys.executable, "-m", "diffgraph.cli", "generate", "x", "--model", "random:tiny",
                           "--steps", "1", "-o", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.exists()


def test_unwritable_output_fails_before_the_model_loads(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    rc = main(["generate", "a cat", "--model", "random:nope", "-o", str(blocker / "x.png")])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert rc == 2 and "cannot be created or written" in err and "choose another -o" in err  # before the model
    assert not (tmp_path / "new").exists()
    rc = main(["generate", "a cat", "--model", "random:tiny", "--steps", "0", "-o", str(tmp_path / "new" / "x.png")])
    assert rc == 2 and not (tmp_path / "new").exists()  # a bad argument leaves no empty folder behind
    capsys.readouterr()


def test_serve_flags_are_built_for_serve(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--batch-buckets" in out and "--drain-timeout" in out


# -- import cost: a subprocess, so that this test process's own imports do not count -----------------------

_IMPORT_PROBE = r'''
import base64, contextlib, io, json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

HEAVY = ("torch", "diffusers", "transformers")
loaded = {}

import diffgraph
loaded["import diffgraph"] = [m for m in HEAVY if m in sys.modules]

from diffgraph.cli import _parser, main
_parser()
loaded["building the parser"] = [m for m in HEAVY if m in sys.modules]


class Canned(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"data": [{"b64_json": base64.b64encode(b"not really a png").decode()}], "seed": 1,
                           "output_format": "png", "timings": {"total_ms": 1.0}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
threading.Thread(target=server.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{server.server_address[1]}"
for argv in (["--help"], ["generate", "--help"], ["models"],
             ["generate", "a cat", "-o", sys.argv[1], "--url", url]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    assert rc == 0, (argv, rc)
    loaded[" ".join(argv[:2]) + (" --url" if "--url" in argv else "")] = [m for m in HEAVY if m in sys.modules]
server.shutdown()
print(json.dumps(loaded))
'''


def test_help_models_and_url_import_no_torch(tmp_path):
    """`--help`, `models` and `generate --url` import neither torch, diffusers nor transformers."""
    proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, str(tmp_path / "x.png")], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert set(loaded) == {"import diffgraph", "building the parser", "--help", "generate --help", "models",
                           "generate a cat --url"}
    assert (tmp_path / "x.png").read_bytes() == b"not really a png"  # the --url run did write its image
    assert all(mods == [] for mods in loaded.values()), loaded  # neither the package nor the command line


# -- generate --url: a canned server in a thread answers like `diffgraph serve` -----------------------------

class _Canned(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append({"path": self.path, "headers": dict(self.headers), "body": body})
        status, answer = self.server.answer
        payload = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def canned():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Canned)
    server.seen, server.answer = [], (500, {})
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def _encoded(color: tuple[int, int, int], fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format=fmt)
    return buf.getvalue()


def _images_answer(*blobs: bytes, seed: int = 42) -> tuple[int, dict]:
    return 200, {"created": 1, "id": "img-1", "seed": seed, "output_format": "png",
                 "data": [{"b64_json": base64.b64encode(b).decode()} for b in blobs],
                 "timings": {"queue_ms": 1.0, "denoise_ms": 100.0, "decode_ms": 2.0, "total_ms": 123.4}}


def test_generate_url_writes_the_servers_images(tmp_path, capsys, canned, monkeypatch):
    monkeypatch.delenv("DIFFGRAPH_API_KEY", raising=False)
    red, blue = _encoded((255, 0, 0)), _encoded((0, 0, 255))
    canned.answer = _images_answer(red, blue)
    out = tmp_path / "new" / "img.png"
    rc = main(["generate", "a cat", "-o", str(out), "--url", canned.url + "/", "-n", "2", "--seed", "42",
               "--width", "64", "--height", "96", "--steps", "3", "--guidance", "5", "--sampler", "ddim",
               "--schedule", "karras", "--negative-prompt", "blurry"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    paths = [str(tmp_path / "new" / "img-0.png"), str(tmp_path / "new" / "img-1.png")]
    assert captured.out.splitlines() == paths  # the lines the local path prints
    assert captured.err.splitlines() == ["seed 42, 123 ms"]
    assert [open(p, "rb").read() for p in paths] == [red, blue]  # written as the server encoded them
    (request,) = canned.seen
    assert request["path"] == "/v1/images/generations"
    assert "Authorization" not in request["headers"]
    assert request["body"] == {"prompt": "a cat", "negative_prompt": "blurry", "size": "64x96",
                               "num_inference_steps": 3, "guidance_scale": 5.0, "sampler": "ddim",
                               "schedule": "karras", "seed": 42, "n": 2, "output_format": "png",
                               "response_format": "b64_json"}


@pytest.mark.parametrize("ext, fmt", [(".jpg", "jpeg"), (".jpeg", "jpeg"), (".webp", "webp"), (".PNG", "png")])
def test_generate_url_asks_for_the_format_of_the_output_file(tmp_path, capsys, canned, ext, fmt):
    canned.answer = _images_answer(b"bytes")
    assert main(["generate", "a cat", "-o", str(tmp_path / f"x{ext}"), "--url", canned.url]) == 0
    body = canned.seen[0]["body"]
    assert body["output_format"] == fmt
    # the model's defaults are the server's: nothing the user did not give is sent
    assert set(body) == {"prompt", "n", "output_format", "response_format"}
    assert capsys.readouterr().err.strip() == "seed 42, 123 ms"


def _server_error(**bad) -> tuple[int, dict]:
    """The answer `diffgraph serve` gives for these parameters (its validation and its error shape)."""
    from diffgraph.request import GenerationRequest, ParamError
    from diffgraph.api.protocol import error_from_param_error

    params = {"width": 64, "height": 64, "guidance_scale": 7.5, **bad}
    with pytest.raises(ParamError) as e:
        GenerationRequest.create("a cat", **params)
    error = error_from_param_error(e.value)
    return error.status, error.body()


@pytest.mark.parametrize("bad, needle", [
    ({"width": 100}, "--width 100 is not a multiple of 8; use 96 or 104"),
    ({"num_inference_steps": 0}, "--steps 0 is out of range"),
    ({"sampler": "bogus"}, "--sampler 'bogus' is unknown; allowed: " + ", ".join(SAMPLERS)),
    ({"schedule": "cosine"}, "--schedule 'cosine' is unknown"),
    ({"guidance_scale": -1.0}, "--guidance -1.0 is out of range"),
    ({"num_images": 17}, "-n/--num-images 17 is out of range"),
])
def test_generate_url_names_the_flag_of_a_server_error(tmp_path, capsys, canned, bad, needle):
    """The server's 400 reads like the local check's message for the same flag (test_bad_input_exits_2_...)."""
    canned.answer = _server_error(**bad)
    assert canned.answer[0] == 400 and canned.answer[1]["error"]["param"] is not None
    rc = main(["generate", "a cat", "-o", str(tmp_path / "x.png"), "--url", canned.url])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("diffgraph: error: ") and needle in err
    assert len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("status, error, needles", [
    (401, {"message": "this server requires an API key: send `Authorization: Bearer KEY`", "type":
           "authentication_error", "param": None, "code": "invalid_api_key"}, ["requires an API key", "--api-key KEY"]),
    (503, {"message": "the model is loading; retry when GET /ready answers 200", "type": "service_unavailable",
           "param": None, "code": None}, ["answered 503: the model is loading"]),
    (400, {"message": "model 'sdxl' is not served here; this server serves 'digits' (GET /v1/models)",
           "type": "invalid_request_error", "param": "model", "code": "model_not_found"},
     ["error: --model 'sdxl' is not served here"]),
    (404, None, ["the server at http://", "answered 404 Not Found"]),  # not a diffgraph server: no error body
])
def test_generate_url_other_server_errors_exit_2(tmp_path, capsys, canned, status, error, needles):
    canned.answer = (status, {"error": error} if error else {"detail": "Not Found"})
    rc = main(["generate", "a cat", "-o", str(tmp_path / "x.png"), "--url", canned.url])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert all(n in err for n in needles), err


def test_generate_url_unreachable_says_how_to_start_a_server(tmp_path, capsys):
    with socket.socket() as s:  # a port nobody listens on (closed again before the request)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    rc = main(["generate", "a cat", "-o", str(tmp_path / "x.png"), "--url", url])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert f"the server at {url} could not be reached" in err and "diffgraph serve" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag, env, sent", [
    (["--api-key", "k1"], None, "Bearer k1"),
    ([], "k2", "Bearer k2"),
    ([], " k3 , k4", "Bearer k3"),  # the server reads several comma-separated keys: the first is sent
    (["--api-key", "k5"], "k6", "Bearer k5"),  # the flag wins
    ([], None, None),
])
def test_generate_url_sends_the_api_key(tmp_path, capsys, canned, monkeypatch, flag, env, sent):
    if env is None:
        monkeypatch.delenv("DIFFGRAPH_API_KEY", raising=False)
    else:
        monkeypatch.setenv("DIFFGRAPH_API_KEY", env)
    canned.answer = _images_answer(b"bytes")
    assert main(["generate", "a cat", "-o", str(tmp_path / "x.png"), "--url", canned.url, *flag]) == 0
    assert canned.seen[0]["headers"].get("Authorization") == sent
    capsys.readouterr()


@pytest.mark.parametrize("args, needle", [
    (["--width", "64"], "give both --width and --height"),
    (["--device", "cuda"], "--device cannot be used with --url"),
    (["--compile"], "--compile cannot be used with --url"),
    (["--lora-dir", "."], "--lora-dir cannot be used with --url"),
    (["--lora", "a:b"], "the scale of 'a:b' is not a number"),
    (["-o", "x.gif"], "must end in .png"),
])
def test_generate_url_refuses_what_it_cannot_send(tmp_path, capsys, canned, args, needle):
    rc = main(["generate", "a cat", "-o", str(tmp_path / "x.png"), "--url", canned.url, *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1
    assert canned.seen == []  # refused before anything was sent


def test_a_sampler_label_that_names_its_schedule_is_taken_alone(tmp_path, canned):
    """`--sampler "DPM++ 2M Karras"` without --schedule: the label's schedule (it was refused as contradicting the
    flag's default schedule); the sampler and schedule flags default to the model's."""
    from diffgraph.request import GenerationRequest

    canned.answer = _images_answer(b"bytes")
    assert main(["generate", "a cat", "-o", str(tmp_path / "x.png"), "--url", canned.url,
                 "--sampler", "DPM++ 2M Karras"]) == 0
    assert canned.seen[0]["body"]["sampler"] == "DPM++ 2M Karras" and "schedule" not in canned.seen[0]["body"]
    request = GenerationRequest.create("a cat", width=64, height=64, guidance_scale=7.5, sampler="DPM++ 2M Karras")
    assert (request.sampler, request.schedule) == ("dpmpp_2m", "karras")


def test_tiling_is_a_flag_and_comes_back_from_an_image(tmp_path, canned):
    """`--tiling` sends the images body's `tiling`; `--from-image` of an image whose infotext says `Tiling: True`
    (AUTOMATIC1111's) asks for it again; without either it is left out."""
    from diffgraph.image_metadata import PNG_KEY

    canned.answer = _images_answer(b"bytes")
    out = str(tmp_path / "x.png")
    assert main(["generate", "a cat", "-o", out, "--url", canned.url, "--tiling"]) == 0
    assert main(["generate", "a cat", "-o", out, "--url", canned.url]) == 0
    saved = tmp_path / "a1111.png"
    info = PngImagePlugin.PngInfo()
    info.add_text(PNG_KEY, "a cat\nSteps: 3, Sampler: Euler, CFG scale: 7, Seed: 5, Size: 64x64, Tiling: True")
    Image.new("RGB", (8, 8)).save(saved, pnginfo=info)
    assert main(["generate", "-o", out, "--url", canned.url, "--from-image", str(saved)]) == 0
    assert [seen["body"].get("tiling") for seen in canned.seen] == [True, None, True]


def _reference_pictures(folder) -> list[str]:
    """Two smooth RGB pictures as PNG files (72x88 and 96x64: cropped to multiples of 16 as the pipeline does)."""
    out = []
    for i, (h, w) in enumerate(((72, 88), (96, 64))):
        small = np.random.default_rng(i).integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        path = folder / f"ref{i}.png"
        Image.fromarray(small).resize((w, h), Image.BILINEAR).save(path)
        out.append(str(path))
    return out


def test_generate_reference_images_equal_the_python_api(tmp_path, capsys):
    """`--reference-image PATH` (repeatable) reaches the request's `reference_images` as --step-cache reaches
    `step_cache`: on the tiny FLUX.2 klein the CLI's image equals the same request through the Python API (and
    differs from the image without them); on a model without the capability, one line naming the flag."""
    from diffgraph import Engine

    refs = _reference_pictures(tmp_path)
    out = tmp_path / "fox.png"
    common = ["--width", "64", "--height", "64", "--steps", "2", "--seed", "3", "--device", "cpu"]
    rc = main(["generate", "a red fox", "--model", "random:flux2-klein-tiny", "-o", str(out), *common,
               "--reference-image", refs[0], "--reference-image", refs[1]])
    assert rc == 0, capsys.readouterr().err
    with Engine(model="random:flux2-klein-tiny", device="cpu") as engine:
        images = [Image.open(p).convert("RGB") for p in refs]
        want = engine.generate("a red fox", width=64, height=64, num_inference_steps=2, seed=3,
                               extras={"reference_images": images})[0]
        plain = engine.generate("a red fox", width=64, height=64, num_inference_steps=2, seed=3)[0]
    got = np.array(Image.open(out).convert("RGB"))
    assert np.array_equal(got, np.array(want))
    assert not np.array_equal(got, np.array(plain))
    rc = main(["generate", "a cat", "--model", "random:zimage-tiny", "-o", str(tmp_path / "z.png"), *common,
               "--reference-image", refs[0]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == ("diffgraph: error: --reference-image is not a parameter of model "
                                   "'random:zimage-tiny'; leave it out")
    rc = main(["generate", "a cat", "-o", str(tmp_path / "y.png"), "--reference-image", str(tmp_path / "none.png")])
    assert rc == 2 and "--reference-image" in capsys.readouterr().err


def test_generate_without_steps_runs_the_model_s_steps_or_a_lora_sidecar_s(tmp_path, capsys):
    """Without --steps the request leaves its steps unset: the distilled klein runs its 4, and a LoRA whose sidecar
    declares 3 runs 3 (the PNG's infotext says which); --steps still wins over both."""
    from safetensors.torch import save_file

    from diffgraph.image_metadata import PNG_KEY
    from diffgraph.models.families.flux2 import LORA_TARGETS
    from diffgraph.models.loader import load_model

    g, state = torch.Generator().manual_seed(0), {}
    for name, layer in load_model("random:flux2-klein-tiny").denoiser.named_modules():
        if isinstance(layer, torch.nn.Linear) and "blocks." in name and name.endswith(LORA_TARGETS):
            state[f"transformer.{name}.lora_A.weight"] = torch.randn((2, layer.in_features), generator=g) * 0.1
            state[f"transformer.{name}.lora_B.weight"] = torch.randn((layer.out_features, 2), generator=g) * 0.1
    save_file(state, str(tmp_path / "fast.safetensors"))
    (tmp_path / "fast.diffgraph.toml").write_text("steps = 3\n")
    common = ["a red fox", "--model", "random:flux2-klein-tiny", "--width", "64", "--height", "64", "--seed", "3",
              "--device", "cpu"]
    runs = {"model": [], "sidecar": ["--lora-dir", str(tmp_path), "--lora", "fast"],
            "flag": ["--lora-dir", str(tmp_path), "--lora", "fast", "--steps", "2"]}
    steps = {}
    for what, flags in runs.items():
        out = tmp_path / f"{what}.png"
        assert main(["generate", *common, "-o", str(out), *flags]) == 0, capsys.readouterr().err
        steps[what] = re.search(r"Steps: (\d+),", Image.open(out).text[PNG_KEY]).group(1)
    assert steps == {"model": "4", "sidecar": "3", "flag": "2"}


def test_generate_url_sends_reference_images_as_base64(tmp_path, capsys, canned):
    canned.answer = _images_answer(_encoded((1, 2, 3)))
    refs = _reference_pictures(tmp_path)
    rc = main(["generate", "a fox", "-o", str(tmp_path / "a.png"), "--url", canned.url, "--reference-image", refs[0],
               "--reference-image", refs[1]])
    assert rc == 0, capsys.readouterr().err
    with open(refs[1], "rb") as f:
        assert canned.seen[0]["body"]["reference_images"][1] == base64.b64encode(f.read()).decode()
    assert len(canned.seen[0]["body"]["reference_images"]) == 2
    rc = main(["generate", "a fox", "-o", str(tmp_path / "b.png"), "--url", canned.url, "--reference-image", refs[0],
               "--image", refs[1]])
    assert rc == 2 and "--reference-image cannot be sent with --image over --url" in capsys.readouterr().err


def test_generate_url_sends_the_step_cache(tmp_path, capsys, canned):
    canned.answer = _images_answer(_encoded((1, 2, 3)))
    rc = main(["generate", "a cat", "-o", str(tmp_path / "a.png"), "--url", canned.url, "--step-cache",
               '{"method": "deepcache", "interval": 2}'])
    assert rc == 0, capsys.readouterr().err
    assert canned.seen[0]["body"]["step_cache"] == {"method": "deepcache", "interval": 2}
    rc = main(["generate", "a cat", "-o", str(tmp_path / "b.png"), "--url", canned.url, "--step-cache", "{oops"])
    assert rc == 2 and "--step-cache is not a JSON object" in capsys.readouterr().err


# -- --from-image: the variation seed and the hires fix come back -------------------------------------------

VARIED = ("a cat\nSteps: 2, Sampler: Euler, CFG scale: 7, Seed: 5, Size: 64x64, Variation seed: 11, "
          "Variation seed strength: 0.4, Seed resize from: 48x64")
HIRES = ("a cat\nSteps: 2, Sampler: Euler, CFG scale: 7, Seed: 5, Size: 64x64, Variation seed: 11, "
         "Variation seed strength: 0.4, Denoising strength: 0.5, Hires upscale: 1.5, Hires steps: 2, "
         "Hires upscaler: Latent (nearest)")


def _infotext_image(path, text: str) -> str:
    from diffgraph.image_metadata import PNG_KEY

    info = PngImagePlugin.PngInfo()
    info.add_text(PNG_KEY, text)
    Image.new("RGB", (8, 8)).save(path, pnginfo=info)
    return str(path)


def _pixels(path) -> "np.ndarray":
    import numpy as np
    return np.asarray(Image.open(path).convert("RGB"))


def _levels(a, b) -> int:
    """The largest difference between two uint8 images, in levels (two engines in one process may differ by one:
    a prompt cached from another batch encodes a float apart)."""
    return int(np.abs(np.asarray(a).astype(int) - np.asarray(b).astype(int)).max())


def test_from_image_restores_a_variation_seed(tmp_path, tiny_engine):
    """An infotext's `Variation seed` / `Variation seed strength` / `Seed resize from` regenerate the same image
    here as the request that names them; the output carries them again."""

    from diffgraph.image_metadata import read_request

    saved, out = _infotext_image(tmp_path / "a1111.png", VARIED), tmp_path / "x.png"
    assert main(["generate", "-o", str(out), "--model", "random:tiny", "--from-image", saved, "-q"]) == 0
    variation = {"subseed": 11, "strength": 0.4, "resize_from": [48, 64]}
    assert read_request(str(out))["variation"] == variation
    plain = dict(width=64, height=64, num_inference_steps=2, guidance_scale=7.0, sampler="euler", seed=5,
                 prompt_syntax="a1111")
    expected = tiny_engine.run(tiny_engine.make_request("a cat", variation=variation, **plain))
    assert _levels(_pixels(out), expected.images[0]) <= 1
    assert _levels(_pixels(out), tiny_engine.run(tiny_engine.make_request("a cat", **plain)).images[0]) > 1


def test_from_image_restores_a_hires_fix(tmp_path, tiny_engine):
    """A hires infotext runs both passes here, equal to hires.generate_hires called directly (with the variation
    seed, which the second pass keeps); the output's infotext has the hires entries, read back as the same fix."""

    from diffgraph.hires import HiresFix, generate_hires
    from diffgraph.image_metadata import read_request, read_texts

    saved, out = _infotext_image(tmp_path / "a1111.png", HIRES), tmp_path / "x.png"
    assert main(["generate", "-o", str(out), "--model", "random:tiny", "--from-image", saved, "-q"]) == 0
    request = tiny_engine.make_request("a cat", width=64, height=64, num_inference_steps=2, guidance_scale=7.0,
                                       sampler="euler", seed=5, prompt_syntax="a1111",
                                       variation={"subseed": 11, "strength": 0.4})
    (expected,) = generate_hires(tiny_engine, request, HiresFix(96, 96, "Latent (nearest)", 0.5, 2))
    assert _pixels(out).shape == (96, 96, 3)
    assert _levels(_pixels(out), expected.images[0]) <= 1
    text = read_texts(str(out))[0]
    assert "Size: 64x64" in text and "Hires upscale: 1.5, Hires steps: 2, Hires upscaler: Latent (nearest)" in text
    assert read_request(str(out))["hires"] == {"scale": 1.5, "resize": None, "steps": 2,
                                               "upscaler": "Latent (nearest)", "strength": 0.5}


def test_from_image_with_url_posts_a_hires_fix_to_txt2img(tmp_path, capsys, canned):
    """With --url a variation seed and a hires fix go to the server's AUTOMATIC1111 txt2img route (the OpenAI route
    carries neither), the flags given here overriding the file's; what that route cannot carry is refused."""
    png = _encoded((1, 2, 3))
    canned.answer = 200, {"images": [base64.b64encode(png).decode()], "parameters": {},
                          "info": json.dumps({"seed": 5})}
    saved, out = _infotext_image(tmp_path / "a1111.png", HIRES), tmp_path / "x.png"
    assert main(["generate", "-o", str(out), "--url", canned.url, "--from-image", saved, "--hires-steps", "3"]) == 0
    assert out.read_bytes() == png and capsys.readouterr().err.strip() == "seed 5"
    (seen,) = canned.seen
    assert seen["path"] == "/sdapi/v1/txt2img"
    assert seen["body"] == {"prompt": "a cat", "steps": 2, "cfg_scale": 7.0, "sampler_name": "Euler", "seed": 5,
                            "batch_size": 1, "width": 64, "height": 64, "subseed": 11, "subseed_strength": 0.4,
                            "enable_hr": True, "hr_scale": 1.5, "hr_upscaler": "Latent (nearest)",
                            "hr_second_pass_steps": 3, "denoising_strength": 0.5}
    assert main(["generate", "-o", str(out), "--url", canned.url, "--from-image", saved,
                 "--step-cache", "auto"]) == 2
    err = capsys.readouterr().err
    assert "--step-cache cannot be sent with a variation seed or a hires fix over --url" in err
    assert len(err.splitlines()) == 1 and len(canned.seen) == 1


def test_hires_flags_need_a_size(tmp_path, capsys):
    assert main(["generate", "a cat", "-o", str(tmp_path / "x.png"), "--hires-steps", "3"]) == 2
    assert capsys.readouterr().err.strip() == ("diffgraph: error: --hires-steps need --hires-scale or --hires-resize "
                                               "(the hires fix's size)")
    assert main(["generate", "a cat", "-o", str(tmp_path / "x.png"), "--hires-scale", "2",
                 "--hires-upscaler", "ESRGAN_9x"]) == 2
    assert "--hires-upscaler 'ESRGAN_9x' is not a built-in upscaler" in capsys.readouterr().err


def test_compare_step_cache_shows_cached_and_uncached_side_by_side(tmp_path, capsys):
    out = tmp_path / "side.png"
    rc = main(["compare", "--step-cache", '{"method": "deepcache", "interval": 2, "branch": 1}', "--model", "digits",
               "--seeds", "2", "--steps", "4", "--device", "cpu", "-o", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.startswith("digits: step cache uniform interval 2, branch 1 against uncached on cpu, 2 seed(s), "
                           "4 evaluations, 64x64"), text
    assert "full evaluations: 2 / 4 (interval 2.00)" in text
    skip = float(re.search(r"skips (\d+)% of the UNet", text).group(1)) / 100
    cost = float(re.search(r"UNet work per image ([0-9.]+)", text).group(1))
    assert 0 < skip < 1 and cost == pytest.approx(0.5 + 0.5 * (1 - skip), abs=0.01)
    mean, peak = map(float, re.search(r"mean ([0-9.]+), max ([0-9]+)", text).groups())
    assert 0 < mean <= peak <= 255
    uncached, cached = map(float, re.search(r"uncached ([0-9.]+), cached ([0-9.]+)", text).groups())
    assert 0 <= uncached <= 1 and 0 <= cached <= 1
    with Image.open(out) as im:  # two pairs, each uncached | 4 px | cached, 8 px between the pairs
        assert im.size == (2 * (64 + 4 + 64) + 8, 64) and im.mode == "RGB"
        sheet = np.asarray(im).astype(int)
    shown = (np.abs(sheet[:, :64] - sheet[:, 68:132]).mean() + np.abs(sheet[:, 140:204] - sheet[:, 208:]).mean()) / 2
    assert shown == pytest.approx(mean, abs=0.005)  # the printed mean is the pictured pairs' difference
    assert f"side by side (per seed, uncached left of cached): {out}" in text


@pytest.mark.parametrize("args, needle", [
    (["--step-cache", "auto", "--quantize", "fp8"], "give --quantize fp8 or --step-cache SETTING, not both"),
    (["--step-cache", "{oops"], "--step-cache is not a JSON object"),
    (["--step-cache", '{"method": "teacache"}'], "step_cache method 'teacache' is for transformer (DiT) models"),
    (["--step-cache", '{"method": "deepcache", "interval": 0}'], "step_cache.interval 0 is out of range"),
])
def test_compare_step_cache_bad_input_exits_2_with_one_line(tmp_path, capsys, args, needle):
    rc = main(["compare", "--model", "random:tiny", "--device", "cpu", "-o", str(tmp_path / "x.png")] + args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1, (rc, err)


# -- mistakes on the command line: one line naming the fix, exit 2, before the model loads where it can ----------
DIGITS = os.path.join(os.path.dirname(__file__), os.pardir, "src", "diffgraph", "assets", "digits")


def _one_line_error(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("diffgraph: error: ")
    return err


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_output_under_proc_fails_before_the_model(capsys):
    # os.access says /proc is writable to root; the model name is wrong too, so this fails before any loading
    err = _one_line_error(capsys, ["generate", "a cat", "--model", "random:nope", "-o", "/proc/x.png"])
    assert "'/proc' is not a writable folder" in err and "choose another -o" in err


def test_output_that_is_a_folder_fails_before_the_model(tmp_path, capsys):
    (tmp_path / "out.png").mkdir()
    err = _one_line_error(capsys, ["generate", "a cat", "--model", "random:nope", "-o", str(tmp_path / "out.png")])
    assert "is a folder; choose another -o" in err


@pytest.fixture
def cpu_only_torch(monkeypatch):
    """torch as a CPU-only build reports itself (whatever this machine has)."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_generate_on_cuda_with_a_cpu_build_says_how_to_fix_it(tmp_path, capsys, cpu_only_torch, device):
    err = _one_line_error(capsys, ["generate", "a cat", "--model", "random:tiny", "--device", device,
                                   "-o", str(tmp_path / "x.png")])
    assert f"--device {device}: this torch" in err and "CPU-only build" in err
    assert "install a CUDA build" in err and "--device cpu" in err


def test_generate_on_cuda_without_a_gpu_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _one_line_error(capsys, ["generate", "a cat", "--model", "random:tiny", "--device", "cuda",
                                   "-o", str(tmp_path / "x.png")])
    assert "sees no GPU" in err and "--device cpu" in err


@pytest.mark.parametrize("flags", [["--device", "cuda"], ["--devices", "cpu,cuda:1"]])
def test_serve_on_cuda_with_a_cpu_build_fails_before_the_server(capsys, cpu_only_torch, monkeypatch, flags):
    import diffgraph.server.cli as server_cli

    def never(args):
        raise AssertionError("the server was started")
    monkeypatch.setattr(server_cli, "run_serve", never)
    err = _one_line_error(capsys, ["serve", "--model", "random:tiny", *flags])
    assert f"{flags[0]} {flags[1]}: this torch" in err and "install a CUDA build" in err and "--device cpu" in err


@pytest.mark.parametrize("damage, needle", [
    ("remove unet", "lacks the weights of its 'unet': unet/ has a config.json but no "
                    "diffusion_pytorch_model.safetensors"),
    ("truncate unet", "unet/diffusion_pytorch_model.safetensors is truncated (100000 bytes of the"),
    ("truncate text_encoder", "text_encoder/model.safetensors is truncated (5 bytes, less than its header)"),
])
def test_a_folder_with_missing_or_truncated_weights_names_the_file(tmp_path, damage, needle):
    from diffgraph.models.loader import load_model

    folder = tmp_path / "model"
    shutil.copytree(DIGITS, folder)
    action, sub = damage.split()
    (weights,) = (folder / sub).glob("*.safetensors")
    if action == "remove":
        weights.unlink()
    else:
        with open(weights, "r+b") as f:
            f.truncate(100_000 if sub == "unet" else 5)
    with pytest.raises(ValueError) as error:
        load_model(str(folder))
    message = str(error.value)
    assert needle in message and "\n" not in message
    assert ".bin" not in message  # diffusers' fallback, which named a file the user never had


def test_seed_minus_one_is_random(tmp_path, capsys, monkeypatch):
    import httpx

    sent = []

    def post(url, **kwargs):
        sent.append(kwargs["json"])
        return SimpleNamespace(status_code=200, json=lambda: {
            "data": [{"b64_json": base64.b64encode(b"png").decode()}], "seed": 7, "timings": {"total_ms": 1.0}})
    monkeypatch.setattr(httpx, "post", post)
    url = "http://127.0.0.1:9"  # not contacted: httpx.post is the fake above
    assert main(["generate", "a cat", "--seed", "-1", "--url", url, "-o", str(tmp_path / "x.png")]) == 0
    assert "seed" not in sent[0]  # no seed: the server draws one (and prints it)
    assert capsys.readouterr().err.strip() == "seed 7, 1 ms"
    # other negative seeds are still refused
    err = _one_line_error(capsys, ["generate", "a cat", "--model", "random:tiny", "--seed", "-2",
                                   "-o", str(tmp_path / "x.png")])
    assert "--seed -2 is out of range" in err


def test_seed_help_says_minus_one_is_random(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "left out, or -1 (as in AUTOMATIC1111 and ComfyUI): a random seed" in help_text


@pytest.mark.parametrize("lora, extra, needle", [
    ("/data/loras/ink.safetensors", [], "--lora takes a name in --lora-dir: --lora-dir /data/loras --lora ink"),
    ("./ink.safetensors:0.7", [], "--lora-dir . --lora ink"),
    ("{dir}/styles/ink.safetensors", ["--lora-dir", "{dir}"], "--lora takes its name under --lora-dir: "
                                                              "--lora styles/ink"),
    ("/data/ink.safetensors", ["--url", "http://127.0.0.1:9"], "with --url give the name of an adapter in the "
                                                                "server's --lora-dir"),
])
def test_lora_given_a_path_points_to_lora_dir(tmp_path, capsys, lora, extra, needle):
    lora, extra = lora.replace("{dir}", str(tmp_path)), [e.replace("{dir}", str(tmp_path)) for e in extra]
    err = _one_line_error(capsys, ["generate", "a cat", "--model", "random:nope", "--lora", lora, *extra,
                                   "-o", str(tmp_path / "x.png")])
    assert "is a file path" in err and needle in err


@pytest.mark.parametrize("flag, value, needle", [
    ("--sampler", "eulr", "did you mean 'euler' or 'euler_a'?"),
    ("--sampler", "dpmpp2m", "did you mean 'dpmpp_2m'?"),
    ("--schedule", "karas", "did you mean 'karras'?"),
])
def test_sampler_and_schedule_typos_get_did_you_mean(tmp_path, capsys, flag, value, needle):
    err = _one_line_error(capsys, ["generate", "a cat", "--model", "random:tiny", flag, value,
                                   "-o", str(tmp_path / "x.png")])
    assert f"{flag} {value!r} is unknown" in err and needle in err


def test_model_typo_gets_did_you_mean():
    from diffgraph.models.loader import load_model

    with pytest.raises(ValueError, match=r"did you mean 'random:tiny'"):
        load_model("random:tyni")
    with pytest.raises(ValueError) as error:
        load_model("something-else-entirely")
    assert "did you mean" not in str(error.value)


_SERVE_PROBE = r'''
import logging, sys
import diffgraph.server.cli as server_cli

def serve(config):  # the server itself is not started: its log lines go where diffgraph's log lines go
    logging.getLogger("diffgraph.server").info("engine ready (probe)")
    logging.getLogger("diffgraph.engine").debug("a debug line (probe)")
    return 0

server_cli.serve = serve
from diffgraph.cli import main
sys.exit(main(["serve", "--model", "random:tiny", "--log-level", "info"]))
'''


def test_serve_log_level_info_prints_diffgraphs_info_lines():
    """A subprocess: logging is configured once per process, and pytest's handlers are on this one's root."""
    proc = subprocess.run([sys.executable, "-c", _SERVE_PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "INFO diffgraph.server: engine ready (probe)" in proc.stderr
    assert "debug line" not in proc.stderr


# -- `diffgraph serve`: a CUDA device from the TOML file (or under python -m diffgraph.server.cli), a mistyped model --
@pytest.fixture
def never_served(monkeypatch):
    import diffgraph.server.cli as server_cli

    def never(*args, **kwargs):
        raise AssertionError("the server was started")
    monkeypatch.setattr(server_cli, "serve", never)


def _serve_error(capsys, argv: list[str], module: bool) -> str:
    from diffgraph.server.cli import main as serve_main

    rc = serve_main(argv) if module else main(["serve", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("diffgraph: error: ")
    return err


@pytest.mark.parametrize("module", [True, False], ids=["python -m diffgraph.server.cli", "diffgraph serve"])
@pytest.mark.parametrize("setting, flag", [('device = "cuda"', "--device cuda"),
                                           ('devices = "cpu,cuda:1"', "--devices cpu,cuda:1")])
def test_serve_on_cuda_from_the_config_file_with_a_cpu_build_fails_in_one_line(
        tmp_path, capsys, cpu_only_torch, never_served, module, setting, flag):
    toml = tmp_path / "serve.toml"
    toml.write_text(f'[serve]\nmodel = "random:tiny"\n{setting}\n')
    err = _serve_error(capsys, ["--config", str(toml)], module)
    assert f"{flag}: this torch" in err and "CPU-only build" in err
    assert "install a CUDA build" in err and "--device cpu" in err


@pytest.mark.parametrize("module", [True, False], ids=["python -m diffgraph.server.cli", "diffgraph serve"])
def test_serve_a_mistyped_model_says_did_you_mean(capsys, never_served, module):
    err = _serve_error(capsys, ["--model", "digts"], module)
    assert "model 'digts' is neither a local diffusers folder nor a preset" in err
    assert "; did you mean 'digits' or 'digits-xl'?" in err
