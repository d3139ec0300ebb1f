"""`--quantize` from the user's settings to the Engine (issue 33): generate, info, serve's flag and TOML key (through
the engine settings a replica process and Ray get), `/info`, and `diffgraph compare --quantize fp8` end to end on
the digits preset; bad values refused in one line that names the flag (or TOML key) and the choices."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from diffgraph import Engine
from diffgraph.bench import throughput
from diffgraph.cli import main
from diffgraph.engine.replica import ReplicaClient
from diffgraph.quantize import Fp8Config
from diffgraph.bench.fp8_compare import pixel_difference, seed_prompts
from diffgraph.ray import split_args
from diffgraph.server.cli import add_serve_arguments, config_from_args
from diffgraph.api.config import ServerConfig, load_config
from diffgraph.server.pages import server_info

DIGITS_LINEARS = 70  # the digits UNet's transformer linears of 64 inputs or more: all of them fp8 at min-features 64


@pytest.fixture
def built(monkeypatch):
    """The keyword arguments and the engine of every Engine the command line builds (closed afterwards)."""
    out: list[tuple[dict, Engine]] = []

    class Recorded(Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            out.append((kwargs, self))

    monkeypatch.setattr("diffgraph.engine.engine.Engine", Recorded)
    yield out
    for _, engine in out:
        engine.close()


def test_generate_hands_the_quantize_flags_to_the_engine(tmp_path, built):
    base = ["generate", "a handwritten digit three", "--model", "digits", "--steps", "2", "--device", "cpu", "-q"]
    assert main(base + ["-o", str(tmp_path / "a.png")]) == 0
    assert main(base + ["-o", str(tmp_path / "b.png"), "--quantize", "fp8", "--quantize-min-features", "64"]) == 0
    (plain_kwargs, plain), (fp8_kwargs, fp8) = built
    assert plain_kwargs["quantize"] is None and plain.quantized is None
    assert fp8_kwargs["quantize"] == Fp8Config(min_features=64)
    assert len(fp8.quantized.quantized) == DIGITS_LINEARS
    assert (tmp_path / "b.png").read_bytes() != (tmp_path / "a.png").read_bytes()  # fp8 changed the pixels


def test_info_prints_the_tiers(capsys):
    assert main(["info", "--model", "digits", "--device", "cpu", "--quantize", "fp8",
                 "--quantize-min-features", "64"]) == 0
    out = capsys.readouterr().out
    assert f"tiers: compile off, quantize fp8: {DIGITS_LINEARS} linears quantised" in out, out


def test_serve_flag_and_toml_key_reach_the_engine_settings_and_info(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('model = "digits"\nquantize = "fp8"\n')
    config = load_config(str(path))
    assert config.quantize == "fp8" and config.engine_kwargs()["quantize"] == "fp8"
    assert ServerConfig(model="digits").engine_kwargs()["quantize"] is None  # the default: 16 bits
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert config_from_args(p.parse_args(["--config", str(path), "--quantize", "none"])).quantize == "none"
    assert config_from_args(p.parse_args(["--model", "digits", "--quantize", "fp8"])).quantize == "fp8"
    info = server_info(SimpleNamespace(config=config, engine=None, ready=False))
    assert (info["quantize"], info["compile"]) == ("fp8", False)
    _, ray_config = split_args({"model": "digits", "device": "cpu", "quantize": "fp8"})  # `serve run ... quantize=fp8`
    assert ray_config.engine_kwargs()["quantize"] == "fp8"
    path.write_text('model = "digits"\nquantize = "int8"\n')
    with pytest.raises(ValueError, match=re.escape("quantize 'int8' is unknown; allowed: none, fp8")):
        load_config(str(path))


def test_serve_takes_the_least_fp8_width_without_importing_torch(tmp_path):
    """`--quantize-min-features` / TOML `quantize-min-features` / Ray's `quantize_min_features=` reach the engine
    settings as an Fp8Config built in the HTTP process, which never imports torch (a fresh interpreter checks it);
    bad values are one line naming the setting."""
    code = ("import sys; from diffgraph.ray import split_args; "
            "_, c = split_args({'model': 'digits', 'device': 'cpu', 'quantize': 'fp8', 'quantize_min_features': '64'}); "
            "print(repr(c.engine_kwargs()['quantize']), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "Fp8Config(min_features=64, weight_granularity='channel') False", out.stderr
    path = tmp_path / "serve.toml"
    path.write_text('model = "digits"\nquantize = "fp8"\nquantize-min-features = 1280\n')
    config = load_config(str(path))
    assert config.engine_kwargs()["quantize"] == Fp8Config(min_features=1280)
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    config = config_from_args(p.parse_args(["--config", str(path), "--quantize-min-features", "64"]))
    assert config.engine_kwargs()["quantize"] == Fp8Config(min_features=64)
    info = server_info(SimpleNamespace(config=config, engine=None, ready=False))
    assert (info["quantize"], info["quantize_min_features"]) == ("fp8", 64)
    for quantize, width in (("fp8", 640), ("none", None)):  # the default width where fp8 runs; none without it
        info = server_info(SimpleNamespace(config=ServerConfig(model="digits", quantize=quantize), engine=None,
                                           ready=False))
        assert info["quantize_min_features"] == width
    for toml, needle in (('quantize-min-features = 64', 'quantize-min-features needs quantize fp8 (--quantize fp8, '
                                                        'or quantize = "fp8")'),
                         ('quantize = "fp8"\nquantize-min-features = 8', "quantize-min-features 8 is below 16"),
                         ('quantize = "fp8"\nquantize-min-features = "wide"',
                          "quantize-min-features must be an integer, got 'wide'")):
        path.write_text(f'model = "digits"\n{toml}\n')
        with pytest.raises(ValueError, match=re.escape(needle)):
            load_config(str(path))


def test_a_replica_process_builds_its_engine_with_the_setting(caplog):
    """The settings travel to the replica process, whose Engine quantises: the digits model's linears are all
    narrower than the default 640 inputs, so its fp8 engine is refused there, with the reason (logged)."""
    replica = ReplicaClient("cpu", ServerConfig(model="digits", quantize="fp8").engine_kwargs(), torch_threads=1,
                            max_restarts=0)
    try:
        replica.wait_ready(120)
        assert replica.state == "down", replica.state
    finally:
        replica.close()
    assert "could not build its engine: ParamError: no nn.Linear qualifies for fp8 (80 linears; 70 below " \
           "min_features=640)" in caplog.text


def test_serve_reports_an_fp8_refusal_in_its_own_words():
    """A server whose engine refuses fp8 (no linear as wide as the width) keeps the reason in serve's words: its
    setting's flag and TOML key, not the Python API's `min_features`."""
    from diffgraph.server.app import create_app

    config = ServerConfig(model="digits", device="cpu", quantize="fp8")
    state = create_app(config, lambda: Engine(**config.engine_kwargs())).state.server
    state.start()
    state._thread.join(120)
    assert state.engine is None and state.error is not None, state.error
    assert state.error.endswith("below min_features=640); lower --quantize-min-features (TOML "
                                "quantize-min-features)"), state.error


@pytest.mark.parametrize("argv, needle", [
    (["generate", "x", "--quantize", "int4"], "--quantize 'int4' is unknown; allowed: none, fp8"),
    (["generate", "x", "--quantize-min-features", "64"], "--quantize-min-features needs --quantize fp8"),
    (["generate", "x", "--quantize", "fp8", "--quantize-min-features", "8"], "--quantize-min-features 8 is below 16"),
    (["generate", "x", "--quantize", "fp8", "--model", "digits", "--device", "cpu"],
     "below min_features=640); lower --quantize-min-features"),
    (["generate", "x", "--quantize", "fp8", "--url", "http://127.0.0.1:9"], "--quantize cannot be used with --url"),
    (["serve", "--quantize", "int4"], "quantize 'int4' is unknown; allowed: none, fp8"),
    (["compare", "--model", "digits"], "compare measures the fp8 tier against 16 bits: give --quantize fp8"),
    (["compare", "--model", "digits", "--quantize", "none"], "give --quantize fp8"),
    (["compare", "--model", "digits", "--quantize", "int4"], "--quantize 'int4' is unknown; allowed: none, fp8"),
    (["compare", "--model", "digits", "--quantize", "fp8", "--seeds", "0"], "--seeds 0 must be at least 1"),
    (["compare", "--model", "digits", "--quantize", "fp8", "--size", "100x64"], "multiples of 8"),
    (["compare", "--model", "random:nope", "--quantize", "fp8", "--device", "cpu"], "neither a local folder nor a "
                                                                                     "known preset"),
])
def test_bad_settings_exit_2_with_one_line(tmp_path, capsys, argv, needle):
    rc = main(argv + (["-o", str(tmp_path / "x.png")] if argv[0] == "generate" else []))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1, (rc, err)


def test_bench_throughput_refuses_a_bad_value_before_anything_loads(capsys):
    assert throughput.main(["--quantize", "int4"]) == 2
    assert "--quantize 'int4' is unknown; allowed: none, fp8" in capsys.readouterr().out


def test_compare_prints_sane_figures_for_the_digits_preset(capsys):
    assert main(["compare", "--quantize", "fp8", "--model", "digits", "--seeds", "2", "--steps", "4",
                 "--min-features", "64", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("digits: fp8 against float32 on cpu, 2 seed(s), 4 steps, 64x64"), out
    assert f"fp8: {DIGITS_LINEARS} linears quantised" in out
    step = float(re.search(r"relative L2 error: ([0-9.]+)", out).group(1))
    mean, peak = map(float, re.search(r"mean ([0-9.]+), max ([0-9.]+)", out).groups())
    reference, fp8 = map(float, re.search(r"float32 ([0-9.]+), fp8 ([0-9.]+)", out).groups())
    assert 0 < step < 0.2, step  # measured 0.011: fp8's 3 mantissa bits, not a wrong scale (that is ~1)
    assert peak >= mean > 0, (mean, peak)
    assert 0 <= reference <= 1 and 0 <= fp8 <= 1


def test_the_shared_measures():
    assert seed_prompts("digits", 12)[11] == ("a handwritten digit one", 1)
    assert seed_prompts("digits-xl", 3)[2] == ("the number 2", 2)
    assert seed_prompts("my.safetensors", 2, "a cat") == [("a cat", None), ("a cat", None)]
    ref = np.zeros((1, 2, 2, 3))
    out = ref.copy()
    out[0, 0, 0, 0] = 1.0
    assert pixel_difference(ref, out) == pytest.approx((255 / 12, 255.0))
