"""The CLI: generate writes PNGs, models lists presets, bad input exits 2 with one line."""

import subprocess
import sys

import pytest
from PIL import Image

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
    (["--sampler", "plms"], "--sampler 'plms' is unknown; allowed: euler, euler_a, dpmpp_2m, ddim"),
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
