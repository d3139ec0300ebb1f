"""`diffgraph batch FILE --out DIR` on a local digits engine (issue 35, point 4), as a user runs it (a subprocess):
every candidate written with its settings inside, a contact sheet per item with --grid, and a re-run that resumes:
it skips the images already in DIR with their settings (the drawn seeds kept, so those match too) and makes only
the missing, broken or changed ones. A bad file is refused with its line and field before any model loads.
(`--url` is tested against the server of tests/test_jobs_http.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from PIL import Image

from diffgraph.image_metadata import read_request
from diffgraph.server.process import SRC

ITEMS = [{"prompt": "a handwritten digit three", "num_inference_steps": 2, "seeds": [1, 2, 3]},
         {"prompt": "a handwritten digit seven", "num_inference_steps": 2, "n": 2},   # seeds drawn, then kept
         {"prompt": "a handwritten digit one", "num_inference_steps": 3, "seed": 40, "n": 2, "guidance_scale": 4}]


def batch(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "diffgraph.cli", "batch", *args, "--device", "cpu"],
                          capture_output=True, text=True, env=env, timeout=600)


def write_jsonl(path, items) -> None:
    path.write_text("".join(json.dumps(i) + "\n" for i in items))


def images(out) -> dict[str, float]:
    return {n: os.stat(out / n).st_mtime_ns for n in sorted(os.listdir(out)) if n.endswith(".png")}


def test_batch_makes_every_candidate_then_a_rerun_resumes(tmp_path):
    job, out = tmp_path / "shots.jsonl", tmp_path / "out"
    write_jsonl(job, ITEMS)
    first = batch(str(job), "--out", str(out), "--grid")
    assert first.returncode == 0, first.stderr
    assert "7 of 7 images (7 made, 0 already there), 0 failed" in first.stderr
    names = [f"{i:05d}-{k}.png" for i, item in enumerate(ITEMS) for k in range(len(item.get("seeds", [])) or
                                                                                  item["n"])]
    sheets = [f"{i:05d}-sheet.png" for i in range(3)]
    assert sorted(images(out)) == sorted(names + sheets)
    seeds = {n: read_request(str(out / n))["seed"] for n in names}
    assert [seeds[f"00000-{k}.png"] for k in range(3)] == [1, 2, 3]
    assert [seeds[f"00002-{k}.png"] for k in range(2)] == [40, 41]
    assert read_request(str(out / "00002-0.png"))["guidance_scale"] == 4.0
    with Image.open(out / "00000-sheet.png") as sheet:  # three 64x64 candidates side by side, labelled below
        assert sheet.width >= 3 * 64 and sheet.height > 64
    before = images(out)

    second = batch(str(job), "--out", str(out))  # nothing to do: every image is there with its settings
    assert second.returncode == 0, second.stderr
    assert "7 of 7 images (0 made, 7 already there)" in second.stderr
    assert images(out) == before

    os.remove(out / "00000-1.png")  # missing
    with open(out / "00001-0.png", "r+b") as f:  # half written by something else
        f.truncate(200)
    ITEMS[2] = {**ITEMS[2], "negative_prompt": "blurry"}  # changed: both its images are made again
    write_jsonl(job, ITEMS)
    third = batch(str(job), "--out", str(out), "--grid")
    assert third.returncode == 0, third.stderr
    assert "7 of 7 images (4 made, 3 already there)" in third.stderr
    after = images(out)
    remade = {n for n in names if after[n] != before.get(n)}
    assert remade == {"00000-1.png", "00001-0.png", "00002-0.png", "00002-1.png"}
    assert read_request(str(out / "00001-0.png"))["seed"] == seeds["00001-0.png"]  # the drawn seed, kept
    assert read_request(str(out / "00002-1.png"))["negative_prompt"] == "blurry"
    for n in names:
        with Image.open(out / n) as im:
            im.load()


def test_a_bad_job_file_is_refused_before_the_model_loads(tmp_path):
    job = tmp_path / "bad.jsonl"
    job.write_text('{"prompt": "a handwritten digit two"}\n{"prompt": "x", "steps": 4}\n')
    r = batch(str(job), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"diffgraph: error: {job}: line 2: unknown field 'steps'; an item takes prompt, size, model, quality, "
        "background, style, moderation, output_compression, safety_identifier, complexity, frame_count, "
        "frame_duration_ms, svg, negative_prompt, num_inference_steps, guidance_scale, true_cfg_scale, schedule_shift, "
        "guidance_interval, guidance_rescale, sampler, schedule, output_format, loras, controls, image_prompts, "
        "prompt_syntax, clip_skip, emphasis, timestep_spacing, eta, tiling, n, seed, seeds, cfg_truncation, "
        "cfg_normalization, reference_images, step_cache"]  # and the built-in capabilities' parameters, checked once it loads
    job.write_text('{"prompt": "a handwritten digit two", "size": "60x64"}\n')  # the model's rules, after it loads
    r = batch(str(job), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.strip().endswith("line 1: width 60 is not a multiple of 8; use 64")


def test_the_capabilities_settings_are_batch_flags_of_its_local_engine(tmp_path):
    """`--step-cache auto` (the step cache capability's setting, its flag generated) is the step cache of the items
    that name none, which their images record; with --url it is refused (the server has its own settings)."""
    job, out = tmp_path / "job.jsonl", tmp_path / "out"
    write_jsonl(job, [{"prompt": "a handwritten digit four", "num_inference_steps": 2, "seeds": [7]}])
    r = batch(str(job), "--out", str(out), "--step-cache", "auto")
    assert r.returncode == 0, r.stderr
    assert read_request(str(out / "00000-0.png"))["extras"] == {"step_cache": "auto"}
    r = batch(str(job), "--out", str(out), "--step-cache", "auto", "--url", "http://127.0.0.1:9")
    assert r.returncode == 2 and "--step-cache cannot be used with --url" in r.stderr, r.stderr


def test_an_item_s_capability_parameters_reach_its_request_and_a_bad_value_is_refused_before_any_image(tmp_path):
    """`step_cache` in an item (a capability of the digits UNet) is the request's: its image records it, and is the
    image of the same request made on an engine; a value the model refuses is exit status 2 naming the line and the
    field, before any image is made."""
    from diffgraph import Engine

    cache = {"method": "deepcache", "interval": 2}
    item = {"prompt": "a handwritten digit four", "num_inference_steps": 4, "seeds": [7], "step_cache": cache}
    job, out = tmp_path / "cached.jsonl", tmp_path / "out"
    write_jsonl(job, [item, {**item, "step_cache": "off"}])
    r = batch(str(job), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert read_request(str(out / "00000-0.png"))["extras"] == {"step_cache": cache}
    made = [np.asarray(Image.open(out / f"{i:05d}-0.png").convert("RGB")).astype(int) for i in range(2)]
    with Engine("digits", device="cpu", dtype="fp32") as engine:
        alone = engine.generate(item["prompt"], num_inference_steps=4, seed=7, extras={"step_cache": cache})
    assert np.abs(made[0] - np.asarray(alone.images[0].convert("RGB")).astype(int)).max() <= 1
    assert np.abs(made[0] - made[1]).max() > 1  # the cache ran
    write_jsonl(job, [item, {**item, "step_cache": {"method": "deepcache", "branch": 9}}])
    bad = batch(str(job), "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "line 2: step_cache.branch 9 is out of range; this UNet has skip branches 0..3"), bad.stderr
    assert not any(n.endswith(".png") for n in os.listdir(tmp_path / "bad"))
