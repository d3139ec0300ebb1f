"""The settings inside every image (issue 34, point 4): AUTOMATIC1111's infotext, the request as JSON in PNG / JPEG /
WebP, `--no-metadata`, and `diffgraph generate --from-image` reproducing an image exactly."""

import dataclasses
import io
import json
import random
import re

import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from diffgraph import image_metadata as meta
from diffgraph.cli import main
from diffgraph.request import GenerationRequest


def _edit_request(**overrides):
    params = dict(negative_prompt="lowres, blurry", width=64, height=64, num_inference_steps=20, guidance_scale=7.0,
                  sampler="dpmpp_2m", schedule="karras", seed=123, loras=[("ink", 0.8), ("styles/soft", 1.0)],
                  clip_skip=1, image=np.zeros((64, 64, 3), np.uint8), strength=0.75)
    return GenerationRequest.create("masterpiece, a cat", **{**params, **overrides})


def test_infotext_is_automatic1111s():
    assert meta.infotext(_edit_request(), "digits") == (
        "masterpiece, a cat <lora:ink:0.8> <lora:styles/soft:1>\n"
        "Negative prompt: lowres, blurry\n"
        "Steps: 20, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7, Seed: 123, Size: 64x64, Model: digits, "
        "Denoising strength: 0.75, Clip skip: 2")
    plain = GenerationRequest.create("a dog", width=96, height=64, num_inference_steps=4, guidance_scale=7.5,
                                     sampler="euler_a", seed=5)
    assert meta.infotext(plain, "random:tiny") == (
        'a dog\nSteps: 4, Sampler: Euler a, Schedule type: Automatic, CFG scale: 7.5, Seed: 5, Size: 96x64, '
        'Model: "random:tiny"')  # a value with a colon is quoted, as AUTOMATIC1111's quote() does


def test_a1111_prompt_tags_are_not_written_twice():
    r = GenerationRequest.create("a cat <lora:ink:0.5>", width=64, height=64, guidance_scale=7.0, seed=1,
                                 prompt_syntax="a1111", loras=[("soft", 1.0)])
    assert r.loras == (("soft", 1.0), ("ink", 0.5))
    assert meta.infotext(r, "digits").splitlines()[0] == "a cat <lora:ink:0.5> <lora:soft:1>"
    fields = meta.request_fields(r, "digits")
    assert fields["loras"] == [["soft", 1.0]] and fields["prompt"] == "a cat <lora:ink:0.5>"
    again = GenerationRequest.create(**{k: v for k, v in fields.items() if k not in ("version", "model")})
    assert again.loras == r.loras


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_the_request_round_trips_through_each_format(fmt):
    r = _edit_request(prompt_syntax="a1111", emphasis="no_norm", guidance_rescale=0.5,
                      guidance_interval=(0.1, 0.9), negative_prompt="ünïcode ✓", timestep_spacing="trailing")
    data = meta.embed(fmt, Image.new("RGB", (64, 64)), r, "digits")
    text, raw = meta.read_texts(data)
    assert text == meta.infotext(r, "digits") and json.loads(raw)["version"] == meta.FORMAT_VERSION
    saved = meta.read_request(data)
    assert saved == {"model": "digits", "prompt": "masterpiece, a cat", "negative_prompt": "ünïcode ✓",
                     "width": 64, "height": 64, "num_inference_steps": 20, "guidance_scale": 7.0,
                     "sampler": "dpmpp_2m", "schedule": "karras", "seed": 123, "num_images": 1,
                     "loras": (("ink", 0.8), ("styles/soft", 1.0)), "guidance_interval": (0.1, 0.9),
                     "guidance_rescale": 0.5, "prompt_syntax": "a1111", "clip_skip": 1, "emphasis": "no_norm", "timestep_spacing": "trailing",
                     "strength": 0.75, "inpaint": False}
    if fmt != "png":  # the infotext as AUTOMATIC1111 (piexif) writes it: "UNICODE\0" and UTF-16 big-endian
        comment = Image.open(io.BytesIO(data)).getexif().get_ifd(meta.EXIF_IFD)[meta.USER_COMMENT]
        assert comment == b"UNICODE\0" + meta.infotext(r, "digits").encode("utf-16-be")


def test_an_automatic1111_png_reads_back():
    info = PngInfo()
    info.add_text("parameters", "masterpiece, a cat\nNegative prompt: lowres\nSteps: 20, Sampler: DPM++ 2M, Schedule "
                                "type: Karras, CFG scale: 7, Seed: 123, Size: 64x64, Model: digits")
    buf = io.BytesIO()
    Image.new("RGB", (64, 64)).save(buf, format="PNG", pnginfo=info)
    assert meta.read_request(buf.getvalue()) == {
        "prompt": "masterpiece, a cat", "negative_prompt": "lowres", "prompt_syntax": "a1111",
        "num_inference_steps": 20, "sampler": "dpmpp_2m", "schedule": "karras", "guidance_scale": 7.0, "seed": 123,
        "width": 64, "height": 64, "model": "digits"}
    old = meta.parse_infotext("a cat\nSteps: 30, Sampler: DPM++ 2M Karras, CFG scale: 6.5, Seed: 9, Size: 512x768, "
                              'Model hash: 6ce0161689, Model: "v1-5", Clip skip: 2, Denoising strength: 0.4')
    assert (old["sampler"], old["schedule"], old["guidance_scale"], old["width"], old["height"], old["model"],
            old["clip_skip"], old["strength"], old["negative_prompt"]) == \
        ("dpmpp_2m", "karras", 6.5, 512, 768, "v1-5", 1, 0.4, None)


def test_an_image_without_settings_is_one_error(tmp_path, capsys):
    bare = tmp_path / "bare.png"
    Image.new("RGB", (64, 64)).save(bare)
    with pytest.raises(meta.MetadataError):
        meta.read_request(str(bare))
    assert main(["generate", "--from-image", str(bare), "-o", str(tmp_path / "x.png"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "carries no generation settings" in err


def _pixels(path):
    return np.asarray(Image.open(path).convert("RGB"))


def test_from_image_reproduces_the_image_and_no_metadata_leaves_it_out(tmp_path):
    first, again, bare = tmp_path / "first.png", tmp_path / "again.png", tmp_path / "bare.png"
    assert main(["generate", "a handwritten digit seven", "--negative-prompt", "blurry", "--model", "digits",
                 "--device", "cpu", "--steps", "3", "--seed", "77", "--sampler", "euler_a", "--guidance", "4",
                 "-o", str(first)]) == 0
    text = Image.open(first).text
    assert text["parameters"] == ("a handwritten digit seven\nNegative prompt: blurry\nSteps: 3, Sampler: Euler a, "
                                  f"Schedule type: Automatic, CFG scale: 4, Seed: 77, Size: {_size(first)}, "
                                  "Model: digits")
    assert json.loads(text["diffgraph"])["seed"] == 77
    assert main(["generate", "--from-image", str(first), "--device", "cpu", "-o", str(again)]) == 0
    assert np.array_equal(_pixels(first), _pixels(again))
    assert Image.open(again).text == text
    # a flag given on the command line overrides the file's value
    assert main(["generate", "--from-image", str(first), "--device", "cpu", "--seed", "78", "--no-metadata",
                 "-o", str(bare)]) == 0
    assert Image.open(bare).text == {} and not np.array_equal(_pixels(first), _pixels(bare))


def _size(path):
    w, h = Image.open(path).size
    return f"{w}x{h}"


def test_the_switches():
    from diffgraph.image_metadata import encode_image
    from diffgraph.server.cli import add_serve_arguments
    from diffgraph.api.config import ServerConfig
    import argparse

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args(["--no-metadata"]).metadata is False and p.parse_args([]).metadata is None
    assert ServerConfig(model="digits").engine_kwargs()["metadata"] is True
    assert ServerConfig.from_mapping({"model": "digits", "metadata": False}).engine_kwargs()["metadata"] is False

    r = GenerationRequest.create("x", width=64, height=64, guidance_scale=7.0, seed=3)
    pixels = np.full((64, 64, 3), 0.5, np.float32)
    assert Image.open(io.BytesIO(encode_image(pixels, "png", r, "digits"))).text["parameters"].startswith("x\nSteps")
    assert Image.open(io.BytesIO(encode_image(pixels, "png", r, "digits", metadata=False))).text == {}
    assert Image.open(io.BytesIO(encode_image(pixels, "png"))).text == {}


def test_ddim_eta_is_written_and_read_as_automatic1111s_eta_ddim():
    noisy = GenerationRequest.create("a dog", width=64, height=64, num_inference_steps=4, sampler="ddim", eta=0.5,
                                     guidance_scale=7.0, seed=5)
    text = meta.infotext(noisy, "digits")
    assert text.endswith("Model: digits, Eta DDIM: 0.5")
    assert meta.parse_infotext(text)["eta"] == 0.5 and meta.parse_infotext(text)["sampler"] == "ddim"
    still = GenerationRequest.create("a dog", width=64, height=64, num_inference_steps=4, sampler="ddim", seed=5,
                                     guidance_scale=7.0)
    assert "Eta" not in meta.infotext(still, "digits")  # eta 0 (or none): AUTOMATIC1111 leaves it out
    tcd = GenerationRequest.create("a dog", width=64, height=64, num_inference_steps=4, guidance_scale=1.0,
                                   sampler="tcd", eta=0.5)
    assert "Eta" not in meta.infotext(tcd, "digits") and "eta" not in meta.parse_infotext(meta.infotext(tcd, "d"))


# AUTOMATIC1111's infotext_utils.re_param, which parse_infotext reads without (it is quadratic in a line with no ':')
RE_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
BODY_LIMIT = 96_000  # about the A1111 route's body limit at the default --max-prompt-bytes


def test_infotext_pairs_are_those_automatic1111s_re_param_finds():
    """The settings line is split into the pairs re_param's findall gives, on every kind of line: keys with spaces,
    dashes and slashes, JSON-quoted values with escapes and commas, quotes that do not close, stray colons."""
    alphabet = ["a", "B", "é", "1", "_", " ", "\t", "-", "/", ":", ",", '"', "\\", "!", "Steps: 3", '"x, y"']
    rng = random.Random(0)
    for _ in range(20_000):
        line = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        assert meta._params(line) == RE_PARAM.findall(line), line


@pytest.mark.parametrize("last", ["a" * BODY_LIMIT, "a " * (BODY_LIMIT // 2), " " * BODY_LIMIT + "!",
                                  "<a:" * (BODY_LIMIT // 3), "Steps" * (BODY_LIMIT // 5)])
def test_a_hostile_last_line_at_the_body_limit_is_prompt_text(last):
    """A last line with no `Key: value` pairs (re_param scanned each of its runs again from every start: 96,000
    characters took minutes) is prompt text, as AUTOMATIC1111 reads it; the lines above keep their meaning."""
    fields = meta.parse_infotext(f"a fox\nNegative prompt: blur\n{last}")
    assert fields["prompt"] == "a fox" and fields["negative_prompt"] == f"blur\n{last}".strip()
    assert set(fields) == {"prompt", "negative_prompt", "prompt_syntax"}
    only = meta.parse_infotext(last)
    assert only["prompt"] == last.strip() and only["negative_prompt"] is None


def test_settings_after_a_hostile_prompt_at_the_body_limit_are_read():
    prompt = "a" * BODY_LIMIT
    text = (f'{prompt}\nSteps: 7, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 6.5, Seed: 42, '
            f'Size: 64x96, Model: "m, {"q" * 1000}", Note: {"b " * 1000}')
    fields = meta.parse_infotext(text)
    assert fields["prompt"] == prompt and fields["negative_prompt"] is None
    assert (fields["num_inference_steps"], fields["sampler"], fields["schedule"], fields["guidance_scale"],
            fields["seed"], fields["width"], fields["height"]) == (7, "dpmpp_2m", "karras", 6.5, 42, 64, 96)
    assert fields["model"] == "m, " + "q" * 1000


def test_a_variation_seed_is_written_as_automatic1111_writes_it_and_reads_back():
    r = GenerationRequest.create("a dog", width=64, height=64, num_inference_steps=4, guidance_scale=7.5, seed=5,
                                 sampler="euler", variation={"subseed": 11, "strength": 0.3, "resize_from": (32, 96)})
    text = meta.infotext(r, "digits")
    assert text.endswith("Seed: 5, Size: 64x64, Model: digits, Variation seed: 11, Variation seed strength: 0.3, "
                         "Seed resize from: 32x96")
    assert meta.parse_infotext(text)["variation"] == {"subseed": 11, "strength": 0.3, "resize_from": (32, 96)}
    for fmt in ("png", "webp"):
        saved = meta.read_request(meta.embed(fmt, Image.new("RGB", (64, 64)), r, "digits"))
        again = GenerationRequest.create(**{k: v for k, v in saved.items() if k != "model"})
        assert again.variation == r.variation
    again = GenerationRequest.create(**{k: v for k, v in meta.parse_infotext(text).items()
                                        if k not in ("model", "prompt_syntax")})
    assert again.variation == r.variation
    # a resize alone (strength 0) writes only its size; no variation writes neither
    resized = GenerationRequest.create("a dog", width=64, height=64, guidance_scale=7.5, seed=5,
                                       variation={"subseed": 11, "strength": 0, "resize_from": (32, 96)})
    text = meta.infotext(resized, "digits")
    assert "Seed resize from: 32x96" in text and "Variation seed" not in text
    assert meta.parse_infotext(text)["variation"] == {"subseed": 0, "strength": 0.0, "resize_from": (32, 96)}
    plain = meta.infotext(dataclasses.replace(r, variation=None), "digits")
    assert "Variation" not in plain and "variation" not in meta.parse_infotext(plain)


@pytest.mark.parametrize("sampler,schedule,labels", [
    ("dpmpp_2s_a", "karras", "Sampler: DPM++ 2S a, Schedule type: Karras"),
    ("dpmpp_2m_sde_heun", "kl_optimal", "Sampler: DPM++ 2M SDE Heun, Schedule type: KL Optimal"),
    ("restart", "align_your_steps", "Sampler: Restart, Schedule type: Align Your Steps"),
    ("dpm_fast", "default", "Sampler: DPM fast, Schedule type: Automatic"),
    ("euler", "ddim_uniform", "Sampler: Euler, Schedule type: DDIM"), ("euler", "turbo", "Schedule type: Turbo"),
    ("euler", "uniform", "Schedule type: Uniform"), ("euler", "polyexponential", "Schedule type: Polyexponential"),
])
def test_the_newer_samplers_and_schedules_are_written_and_read_by_automatic1111s_labels(sampler, schedule, labels):
    r = GenerationRequest.create("a cat", width=64, height=64, num_inference_steps=20, guidance_scale=7.0,
                                 sampler=sampler, schedule=schedule, seed=1)
    text = meta.infotext(r, "digits")
    assert labels in text
    fields = meta.parse_infotext(text)
    assert (fields["sampler"], fields["schedule"]) == (sampler, schedule)


def test_ensd_is_written_and_read_back():
    """AUTOMATIC1111's `ENSD` entry (eta_noise_seed_delta): written where a request has one, read back."""
    from diffgraph.image_metadata import infotext, parse_infotext, request_fields
    from diffgraph.request import GenerationRequest

    request = GenerationRequest.create("a cat", width=64, height=64, guidance_scale=7.0, seed=3, sampler="euler_a",
                                       noise_seed_delta=31337)
    text = infotext(request, "tiny")
    assert "ENSD: 31337" in text and request_fields(request, "tiny")["noise_seed_delta"] == 31337
    assert parse_infotext(text)["noise_seed_delta"] == 31337
    plain = GenerationRequest.create("a cat", width=64, height=64, guidance_scale=7.0, seed=3)
    assert "ENSD" not in infotext(plain, "tiny") and "noise_seed_delta" not in request_fields(plain, "tiny")
