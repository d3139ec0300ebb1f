"""Model files that change or misbehave (issue 36, point 1, model files): diffusers and transformers memory-map
safetensors, and on the CPU at the file's dtype the parameters stay views of that map, so cutting a weights file
after it loaded killed the process with SIGBUS (exit 135) at the next generation. The loader now streams each tensor
through the checked reader (models/stream_load.py): a file cut after it loaded changes nothing, one cut while it
loads is a one-line error naming it. Weights that are a FIFO or a
dangling link are refused by type, in one line, before any open (a FIFO blocked the header check for good).
And `diffgraph serve`'s model and device mistakes (point 5): a CUDA device set in the TOML file, or given to
`python -m diffgraph.server.cli`, on a CPU build of torch, and a mistyped model name, each end in one line, exit 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from diffgraph import safe_files
from diffgraph.cli import main
from diffgraph.models.weights_view import weights_read

DIGITS = os.path.join(os.path.dirname(__file__), os.pardir, "src", "diffgraph", "assets", "digits")
WEIGHTS = ("unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
           "text_encoder/model.safetensors")

# In a child process, so that a SIGBUS fails this test instead of killing pytest. fp16 is the digits files' dtype:
# the case where the parameters aliased the file's map. `during` is cut once its files are checked (before their
# tensors are read): a one-line error naming the file; `after` once it has loaded: it generates a 1-step image, and
# its weights are the shipped ones.
CHILD = textwrap.dedent("""
    import os, sys, torch
    from diffgraph import Engine
    from diffgraph.models.families import default_registry
    from diffgraph.models.loader import load_model

    shipped, during, after = sys.argv[1:4]
    weights = sys.argv[4:]

    def cut(folder):
        for name in weights:
            with open(os.path.join(folder, name), "r+b") as f:
                f.truncate(0)

    def params(model):
        return [p.detach().clone() for m in (model.unet, model.vae, *model.text_encoders) for p in m.parameters()]

    expected = params(load_model(shipped, "cpu", "fp16"))
    families = default_registry()
    adapter = families.for_pipeline("StableDiffusionPipeline")
    load_folder = adapter.load_folder
    adapter.load_folder = lambda *args: (cut(during), load_folder(*args))[1]
    try:
        load_model(during, "cpu", "fp16", families=families)
        raise AssertionError("a model folder cut while it loaded was loaded")
    except ValueError as e:
        assert str(e).startswith(f"model folder {during!r}: {weights[0]} is not a readable safetensors file (0 bytes")
        assert "\\n" not in str(e)
    loaded = load_model(after, "cpu", "fp16")
    cut(after)
    assert all(torch.equal(a, b) for a, b in zip(params(loaded), expected, strict=True))
    image = Engine(loaded).generate("a handwritten digit seven", num_inference_steps=1, seed=3)[0]
    assert image.size == (loaded.native_size, loaded.native_size)
    print("refused the cut folder; generated after the cut")
""")


def test_weights_cut_while_and_after_loading_never_kill_the_process(tmp_path):
    folders = [str(tmp_path / name) for name in ("during", "after")]
    for folder in folders:
        shutil.copytree(DIGITS, folder)
    proc = subprocess.run([sys.executable, "-c", CHILD, DIGITS, *folders, *WEIGHTS], capture_output=True, text=True)
    assert proc.returncode not in (135, -7), "SIGBUS: the parameters still read the cut file's map"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused the cut folder; generated after the cut" in proc.stdout


def test_private_view_copies_what_is_read_links_the_rest_and_hides_the_others(tmp_path):
    src = tmp_path / "model"
    (src / "unet").mkdir(parents=True)
    save_file({"w": torch.arange(4.0)}, str(src / "unet" / "w.safetensors"))
    weights = (src / "unet" / "w.safetensors").read_bytes()
    (src / "unet" / "w.bin").write_bytes(b"pickle")
    (src / "unet" / "config.json").write_text("{}")
    with safe_files.private_view(str(src), ["unet/w.safetensors"], ["unet/w.bin"], max_bytes=1 << 20) as view:
        copy = os.path.join(view, "unet", "w.safetensors")
        with open(src / "unet" / "w.safetensors", "r+b") as f:
            f.truncate(0)  # the original is cut: the copy is not
        with open(copy, "rb") as f:
            assert f.read() == weights
        assert not os.path.lexists(os.path.join(view, "unet", "w.bin"))
        assert os.path.realpath(os.path.join(view, "unet", "config.json")) == str((src / "unet" / "config.json"))
    assert not os.path.exists(view)


@pytest.mark.parametrize("files, read", [
    (["m.safetensors", "m.bin", "m.fp16.safetensors"], ["m.safetensors"]),
    (["m.bin", "m.fp16.safetensors"], ["m.bin"]),
    (["m.fp16.safetensors", "m.fp16.bin", "m.ema.bin"], ["m.fp16.safetensors"]),
    (["m-00001-of-00002.safetensors", "m-00002-of-00002.safetensors", "m.bin"],
     ["m-00001-of-00002.safetensors", "m-00002-of-00002.safetensors"]),
])
def test_only_the_weights_from_pretrained_reads_are_copied(tmp_path, files, read):
    (tmp_path / "unet").mkdir()
    for name in files:
        (tmp_path / "unet" / name).write_bytes(b"x")
    copies, omit = weights_read(str(tmp_path))
    assert copies == [os.path.join("unet", f) for f in read]
    assert sorted(omit) == sorted(os.path.join("unet", f) for f in files if f not in read)


@pytest.mark.parametrize("kind, needle", [("fifo", "is a FIFO (named pipe), not a regular file"),
                                          ("dangling", "is a dangling link")])
def test_weights_that_are_a_fifo_or_a_dangling_link_fail_in_one_line(tmp_path, capsys, kind, needle):
    folder = tmp_path / "model"
    shutil.copytree(DIGITS, folder)
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    weights.unlink()
    if kind == "fifo":  # opened for reading, it blocks until a writer comes: refused by its type before any open
        os.mkfifo(weights)
    else:
        weights.symlink_to(tmp_path / "gone.safetensors")
    rc = main(["generate", "a cat", "--model", str(folder), "--steps", "1", "-o", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "unet/diffusion_pytorch_model.safetensors " + needle in err and "copy or download that file again" in err


# -- `diffgraph serve`: a CUDA device from the TOML file (or under python -m diffgraph.server.cli), a mistyped model --


@pytest.mark.parametrize("file", ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
                                  "text_encoder/generation_config.json"])
def test_a_model_folder_whose_tokenizer_json_nests_too_deep_is_a_one_line_error_naming_it(tmp_path, file):
    """transformers and diffusers parse a folder's tokenizer and config JSON without a depth limit: 200,000 brackets
    were a RecursionError out of load_model. Every JSON file of the folder is parsed with the bounded parser first."""
    from diffgraph.models.loader import load_model

    shutil.copytree(DIGITS, tmp_path / "m")
    (tmp_path / "m" / file).write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError) as info:
        load_model(str(tmp_path / "m"))
    assert str(info.value) == (f"model folder {str(tmp_path / 'm')!r}: {file} nests JSON deeper than 64 levels (the "
                               "limit for this file; a damaged or hostile one): copy or download it again")


def test_a_component_folder_whose_config_nests_too_deep_is_a_one_line_error_naming_it(tmp_path):
    """A folder read alone (a --vae folder, an IP-Adapter's image encoder, a ControlNet): its config.json too."""
    from diffusers import AutoencoderKL

    from diffgraph.models.stream_load import load_part
    from diffgraph.models.weights_view import UnreadableWeights

    shutil.copytree(os.path.join(DIGITS, "vae"), tmp_path / "vae")
    (tmp_path / "vae" / "config.json").write_text('{"a": ' * 200_000 + "1" + "}" * 200_000)
    with pytest.raises(UnreadableWeights) as info:  # was a RecursionError from diffusers' load_config
        load_part(AutoencoderKL, str(tmp_path / "vae"), "vae 'vae'")
    assert str(info.value) == ("vae 'vae': config.json nests JSON deeper than 64 levels (the limit for this file; a "
                               "damaged or hostile one): copy or download it again")

@pytest.fixture
def cpu_only_torch(monkeypatch):
    """torch as a CPU-only build reports itself (whatever this machine has)."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


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
