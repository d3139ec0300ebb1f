"""Issue 33, points 3 and 5 on the CPU: the compile tier's Inductor mode (`--compile-mode`, CompileConfig.mode: its
options reach torch.compile, join the precompiled files' keys, and the modes that turn Inductor's own CUDA graphs on
are refused), and `bench throughput --tiers`' parts that need no GPU (its tiers, peaks and the step's FLOP count)."""

from __future__ import annotations

import argparse
import os
import re

import pytest
import torch

from diffgraph.config import CompileConfig, parse_compile_mode


def test_a_compile_mode_gives_inductor_its_options_with_its_own_cuda_graphs_off():
    from diffgraph.graphs.compiled import Compiled
    default = Compiled(lambda x: x + 1, CompileConfig(), "f")
    tuned = Compiled(lambda x: x + 1, CompileConfig(mode="max-autotune-no-cudagraphs"), "f")
    assert default.options == {"triton.cudagraphs": False}  # as before the mode existed: old caches stay valid
    assert tuned.options == {"max_autotune": True, "coordinate_descent_tuning": True, "triton.cudagraphs": False}
    assert default._key_prefix != tuned._key_prefix  # each mode's precompiled versions are their own
    assert Compiled(lambda x: x, CompileConfig(backend="aot_eager", mode="max-autotune-no-cudagraphs"), "f").options \
        is None  # other backends take no Inductor options


@pytest.mark.parametrize("mode, words", [("max-autotune", "turns Inductor's own CUDA graphs on"),
                                         ("reduce-overhead", "use max-autotune-no-cudagraphs"),
                                         ("fast", "is unknown")])
def test_modes_our_graphs_cannot_capture_are_refused_naming_the_choices(mode, words):
    with pytest.raises(ValueError, match=words) as e:
        CompileConfig(mode=mode)
    assert "default, max-autotune-no-cudagraphs" in str(e.value)
    with pytest.raises(ValueError, match="--compile-mode"):
        parse_compile_mode(mode)


def test_compile_from_args_and_the_flags_errors():
    from diffgraph.cli_flags import compile_from_args
    args = argparse.Namespace(compile=True, compile_mode="max-autotune-no-cudagraphs")
    assert compile_from_args(args, "/tmp/c") == CompileConfig(cache_dir="/tmp/c", mode="max-autotune-no-cudagraphs")
    assert compile_from_args(argparse.Namespace(compile=True, compile_mode=None)) == CompileConfig()
    assert compile_from_args(argparse.Namespace(compile=False, compile_mode=None)) is False
    with pytest.raises(ValueError, match="--compile-mode needs --compile"):
        compile_from_args(argparse.Namespace(compile=False, compile_mode="max-autotune-no-cudagraphs"))


def test_generate_refuses_a_compile_mode_without_compile_and_a_bad_one(capsys, tmp_path):
    from diffgraph.cli import main
    out = str(tmp_path / "x.png")
    assert main(["generate", "a fox", "--output", out, "--compile-mode", "max-autotune-no-cudagraphs"]) == 2
    assert "--compile-mode needs --compile" in capsys.readouterr().err
    assert main(["generate", "a fox", "--output", out, "--compile", "--compile-mode", "max-autotune"]) == 2
    assert "turns Inductor's own CUDA graphs on" in capsys.readouterr().err


def test_serve_takes_the_compile_mode_from_flags_and_toml(tmp_path):
    from diffgraph.api.config import load_config
    config = load_config(None, {"compile": True, "compile_mode": "max-autotune-no-cudagraphs"})
    assert config.engine_kwargs()["compile"].mode == "max-autotune-no-cudagraphs"
    toml = tmp_path / "serve.toml"
    toml.write_text('compile = true\ncompile-mode = "reduce-overhead"\n')
    with pytest.raises(ValueError, match="compile-mode 'reduce-overhead' turns Inductor's own CUDA graphs on"):
        load_config(str(toml))
    with pytest.raises(ValueError, match="needs compile"):
        load_config(None, {"compile_mode": "max-autotune-no-cudagraphs"})


def test_the_tiers_bench_parses_its_tiers_and_knows_the_peaks():
    from diffgraph.bench.tiers import engine_options, parse_tiers, peak_tflops
    assert parse_tiers("graph, compile,autotune-fp8") == ("graph", "compile", "autotune-fp8")
    with pytest.raises(ValueError, match="unknown tier.*int8.*choose from graph, compile, fp8"):
        parse_tiers("graph,int8")
    assert peak_tflops("NVIDIA H200") == 989.4 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4 and peak_tflops("Some GPU") is None
    assert peak_tflops("Some GPU", 100.0) == 100.0
    assert engine_options("graph", "/c") == {}
    fp8 = engine_options("autotune-fp8", "/c")
    assert fp8["quantize"] == "fp8" and fp8["compile"] == CompileConfig(cache_dir="/c/autotune-fp8",
                                                                         mode="max-autotune-no-cudagraphs")
    assert engine_options("compile", "/c")["compile"].mode == "default"


def test_the_step_flops_are_the_unets_over_the_steps_denoiser_rows():
    """FlopCounterMode over one eager engine step at 4 denoiser rows (2 images with CFG) counts what the UNet counts
    over 4 rows: the step's guidance and sampler arithmetic adds no matmul, convolution or attention."""
    from torch.utils.flop_counter import FlopCounterMode

    from diffgraph import Engine
    from diffgraph.bench.tiers import step_flops
    got = step_flops("random:tiny", (64, 64), 4, device="cpu")
    with Engine("random:tiny", device="cpu") as e:
        unet = e.model.denoiser
        x = torch.zeros(4, unet.config.in_channels, 8, 8)
        states = torch.zeros(4, 77, unet.config.cross_attention_dim)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            unet(x, torch.full((4,), 500.0), encoder_hidden_states=states)
    assert got == counter.get_total_flops() > 0


def test_a_tier_runs_its_burst_its_step_replay_and_one_image_alone(capsys):
    """`run_tier`'s figures on the CPU (the emulated graph backend): the burst's images/s, the top bucket's step
    replay and one image alone, submit to result (the issue's one-image target), each a positive measurement."""
    from diffgraph.bench.tiers import print_tier, run_tier
    from diffgraph.config import GraphConfig
    graphs = GraphConfig(resolutions=((64, 64),), batch_buckets=(1, 2, 4), backend="emulated")
    r = run_tier("random:tiny", "graph", (64, 64), 2, 1, "/nonexistent", graphs=graphs, device="cpu")
    assert r["tier"] == "graph" and r["bucket"] == 4 and r["compiles"] == 0
    assert r["images_per_s"] > 0 and r["seconds"] > 0 and r["step_ms"] > 0 and r["one_image_ms"] > 0
    print_tier({**r, "peak_share": None}, r)
    assert re.search(r"graph .*\(1\.000x\).*bucket-4 step .* one image +\d+\.\d ms", capsys.readouterr().out)


def test_the_throughput_bench_takes_the_checkpoint_flags(monkeypatch, capsys):
    """`bench throughput --vae F --no-vae-upcast` (SDXL's decode in fp16 with an fp16-safe VAE, issue 33's one-image
    target): the flags reach the tiers' engines as LoadOptions; a VAE path that does not exist is refused first."""
    from diffgraph.bench import throughput, tiers
    from diffgraph.config import LoadOptions
    assert throughput.main(["--tiers", "compile", "--vae", "/nonexistent/vae.safetensors"]) == 2
    assert "vae '/nonexistent/vae.safetensors' does not exist" in capsys.readouterr().out
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tiers, "run", lambda *a, **k: seen.update(k) or {"tiers": []})
    monkeypatch.setattr(tiers, "print_report", lambda report: None)
    assert throughput.main(["--tiers", "compile", "--no-vae-upcast", "--json", os.devnull]) == 0
    assert seen["load"] == LoadOptions(vae_upcast=False)


def test_autotune_tunes_the_step_and_the_decoder_not_the_text_encoder(tmp_path):
    """Issue 33 point 3 names the step and the VAE: the text encoders (once a request) keep Inductor's default code
    under max-autotune-no-cudagraphs, so a cold autotuned start does not spend minutes on them."""
    from diffgraph import Engine
    from diffgraph.config import GraphConfig
    tuned = CompileConfig(cache_dir=str(tmp_path), mode="max-autotune-no-cudagraphs")
    graphs = GraphConfig(prewarm=False, backend="emulated")
    # nothing compiles before a first call: only the callables are built
    with Engine("random:tiny", device="cpu", dtype="fp32", mode="graph", graphs=graphs, compile=tuned) as engine:
        options = {c.name: c.options for c in engine.runner.compiled}
    assert options["the text encoder"]["max_autotune"] is False
    assert options["the text encoder"]["coordinate_descent_tuning"] is False
    assert options["the whole step"]["max_autotune"] is True
    assert options["the VAE decoder"]["max_autotune"] is True
    with Engine("random:tiny", device="cpu", dtype="fp32", mode="graph", graphs=graphs,
                compile=CompileConfig(cache_dir=str(tmp_path))) as engine:  # the default mode: as before
        assert {c.name: c.options for c in engine.runner.compiled}["the text encoder"] == {"triton.cudagraphs": False}
