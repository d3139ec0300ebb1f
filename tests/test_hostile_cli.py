"""The command line's mistakes (issue 36, point 5): each ends in one line naming the fix and exit 2, before the model
loads where it can: an unwritable -o, a CUDA device asked of a CPU build of torch (generate and serve), a model
folder with missing or truncated weights (the file named), `--seed -1` as random, `--lora PATH`, "did you mean"
for samplers, schedules and models. And the logs (point 4): `diffgraph serve --log-level info` prints diffgraph's
INFO lines, and a truncated prompt's warning names token counts, never the prompt."""

from __future__ import annotations

import base64
import logging
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from diffgraph.cli import main

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


def test_prompt_truncation_warning_names_counts_not_the_prompt(caplog):
    from diffgraph.models.families.base import FamilyAdapter
    from diffgraph.models.tokenizer import preset_tokenizer

    tokenizer = preset_tokenizer()
    prompt = "secretword " * 200
    with caplog.at_level(logging.WARNING, logger="diffgraph"):
        FamilyAdapter().tokenize(SimpleNamespace(tokenizers=[tokenizer]), [prompt])
    (record,) = [r for r in caplog.records if "truncated" in r.getMessage()]
    message = record.getMessage()
    assert "secretword" not in message
    dropped = len(tokenizer(prompt).input_ids) - tokenizer.model_max_length
    assert f"CLIP reads {tokenizer.model_max_length} tokens" in message and f"{dropped} dropped" in message
