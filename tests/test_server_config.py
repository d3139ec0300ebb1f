"""server/config.py and settings.py: each setting is declared once, on its ServerConfig field, and reaches its flag of
`diffgraph serve` (in its argument group), its TOML key and, where it has one, its `Engine` keyword."""

import argparse
import ast
import dataclasses
import json
import pathlib
import re

import pytest

from diffgraph.capability_settings import builtin_settings, flag_of
from diffgraph.server.cli import add_serve_arguments, config_from_args
from diffgraph.api.config import ServerConfig, load_config
from diffgraph.settings import GROUPS, declared

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = "random:tiny"
# how to serve, not settings; and the built-in capabilities' own flags (capability_settings.py)
SERVE_ONLY_FLAGS = {"--config", "--data-parallel", "--ray", "--ray-address", "--step-cache"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diffgraph serve")
    add_serve_arguments(p)
    return p


def _samples(tmp: pathlib.Path) -> dict[str, tuple]:
    """A value other than the default for every setting, with the settings it needs beside it."""
    folder = tmp / "folder"
    folder.mkdir()
    (folder / "model_index.json").write_text("{}")  # a diffusers folder, for model-config
    keys = tmp / "keys"
    keys.write_text("k-file\n")
    styles = tmp / "styles.csv"
    styles.write_text("name,prompt,negative_prompt\nink,\"{prompt}, ink\",blurry\n")
    d = str(folder)
    return {
        "model": ("random:tiny-lcm", {}), "host": ("0.0.0.0", {}), "port": (9001, {}), "device": ("cpu", {}),
        "dtype": ("fp32", {}), "mode": ("eager", {}), "batching": ("request", {}), "batch_buckets": ([1, 2], {}),
        "resolutions": (["64x96"], {}), "reference_slots": ([256, 512], {}), "prewarm": ("none", {}), "max_queue": (9, {}), "max_wait_ms": (5.0, {}),
        "grow_fill": (0.5, {}), "grow_hold_ms": (10.0, {}), "request_timeout": (30.0, {}),
        "max_prompt_bytes": (100, {}), "drain_timeout": (3.0, {}), "header_timeout": (2.0, {}),
        "body_timeout": (9.0, {}), "max_connections": (50, {}), "max_client_connections": (5, {}),
        "trusted_proxies": (["10.0.0.5"], {}), "body_deadline": (3.0, {}), "min_body_rate": (0, {}),
        "log_level": ("debug", {}), "access_log": (False, {}), "api_keys": (["k1"], {}),
        "api_key_file": (str(keys), {}), "protect_metrics": (True, {}), "playground": (False, {}),
        "torch_threads": (3, {}), "image_threads": (3, {}), "devices": (["cpu", "cpu"], {}),
        "min_ready": (2, {"devices": ["cpu", "cpu"]}), "max_image_bytes": (1000, {}),
        "max_image_pixels": (10_000, {}), "lora_dir": (d, {}), "max_loras": (4, {}), "max_request_loras": (6, {}),
        "max_lora_rank": (32, {}), "lora_conv": (True, {}), "fuse_loras": (["ink:0.5"], {}),
        "capability_settings": ('{"step_cache": {"step_cache": "auto"}}', {}), "controlnet_dir": (d, {}),
        "max_controlnets": (3, {}), "ip_adapter_dir": (d, {}), "upscaler_dir": (d, {}), "compile": (True, {}),
        "compile_mode": ("max-autotune-no-cudagraphs", {"compile": True}), "quantize": ("fp8", {}),
        "quantize_min_features": (64, {"quantize": "fp8"}), "embeddings_dir": (d, {}), "max_prompt_chunks": (2, {}),
        "clip_skip": (1, {}), "prompt_syntax": ("a1111", {}), "styles": (str(styles), {}),
        "compile_cache": (d, {"compile": True}),
        "metadata": (False, {}), "preview_decoder": (d, {}), "max_step_failures": (5, {}),
        "replica_timeout": (5.0, {}), "lora_host_bytes": (100, {}), "max_pixels": (4096, {}),
        "image_ttl": (60.0, {}), "image_store": (d, {}), "image_store_bytes": (2 << 20, {}),
        "public_url": ("https://images.example.com", {}), "model_dir": (d, {}), "max_models": (3, {}),
        "model_memory": (4.0, {}), "preload": (["a"], {"model_dir": d}), "vae": (d, {}), "vae_upcast": (False, {}),
        "text_encoder": (str(styles), {}), "tokenizer": (d, {}),
        "model_config": (d, {}), "prediction_type": ("v_prediction", {}), "zero_snr": (True, {}),
        "state_dir": (str(tmp / "state"), {}), "job_retention": (3600.0, {}), "max_batch_items": (10, {}),
        "max_job_candidates": (10, {}), "max_key_jobs": (2, {}), "max_key_bytes": (2 << 20, {}),
        "batch_inflight": (4, {}), "webhook_allow": (["hooks.example.com"], {"webhook_secret": "s"}),
        "webhook_secret": ("s", {}),
    }


def _toml(values: dict) -> str:
    def literal(v):
        return ("true" if v else "false") if isinstance(v, bool) else json.dumps(v)
    return "".join(f"{k.replace('_', '-')} = {literal(v)}\n" for k, v in values.items())


def _argv(flag: str, action: argparse.Action, value) -> list[str]:
    if isinstance(value, bool):
        return [flag] if value else [f"--no-{flag[2:]}"]
    if isinstance(value, list):
        if isinstance(action, argparse._AppendAction):
            return [a for v in value for a in (flag, str(v))]
        return [flag, ",".join(map(str, value))]
    return [flag, str(value)]


def test_every_field_is_one_declared_setting_with_one_flag():
    settings = dict((f.name, s) for f, s in declared(ServerConfig))
    assert set(settings) == {f.name for f in dataclasses.fields(ServerConfig)}  # no field without its declaration
    assert {s.group for s in settings.values()} == set(GROUPS)  # every group holds settings
    flags = [flag for name, s in settings.items() for flag in s.flag_names(name)]
    assert len(flags) == len(set(flags))
    by_flag = {}
    for action in _parser()._actions:
        for flag in action.option_strings:
            by_flag[flag] = action
    for name, s in settings.items():  # each setting's flag sets its field
        for flag in s.flag_names(name):
            assert by_flag[flag].dest == name, flag
    options = {a.option_strings[0] for a in _parser()._actions if a.option_strings and a.dest != "help"}
    assert options - set(flags) == SERVE_ONLY_FLAGS  # every other flag of serve is one setting's


def test_serve_help_shows_the_argument_groups_in_order():
    p = _parser()
    text = p.format_help()
    positions = [text.index(f"\n{title}:\n") for title in GROUPS.values()]
    assert positions == sorted(positions)
    group_of = {a.dest: g.title for g in p._action_groups for a in g._group_actions}
    for f, s in declared(ServerConfig):
        assert group_of[f.name] == GROUPS[s.group], f.name
    capability_flags = {d: g for d, g in group_of.items() if d.startswith("capability__")}
    assert capability_flags and set(capability_flags.values()) == {GROUPS["capabilities"]}  # --step-cache's too
    assert set(g.title for g in p._action_groups) == {"positional arguments", "options", *GROUPS.values()}
    words = " ".join(text.split())
    assert "--max-queue N waiting requests before new ones get 429 (default: 256)" in words  # {default}
    assert "has waited this long (default: 2000)" in words  # --grow-hold-ms's {default:g}


def test_each_setting_reaches_its_toml_key_its_flag_and_its_engine_keyword(tmp_path, monkeypatch):
    from diffgraph import upscaler_models
    monkeypatch.setattr(upscaler_models, "spandrel_installed", lambda: True)  # upscaler-dir's check, without the extra
    samples = _samples(tmp_path)
    settings = dict((f.name, s) for f, s in declared(ServerConfig))
    assert set(samples) == set(settings), "give every setting a sample value here"
    actions = {a.dest: a for a in _parser()._actions}
    path = tmp_path / "serve.toml"
    for name, (value, needs) in samples.items():
        path.write_text(_toml({**needs, name: value}))
        config = load_config(str(path))
        path.write_text(_toml(needs))
        base = load_config(str(path))
        assert getattr(config, name) != getattr(base, name), name  # the TOML key sets the field
        flag = settings[name].flag_names(name)[0]
        argv = ["--config", str(path), *_argv(flag, actions[name], value)]
        assert getattr(config_from_args(_parser().parse_args(argv)), name) == getattr(config, name), flag
        keyword = settings[name].engine
        if keyword is not None:  # and reaches the engine
            assert config.engine_kwargs()[keyword] != base.engine_kwargs()[keyword], name


def test_the_engine_keywords_are_engines_own():
    tree = ast.parse((ROOT / "src" / "diffgraph" / "engine" / "engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    init = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    keywords = {a.arg for a in init.args.args + init.args.kwonlyargs}
    declared_keywords = {s.engine for _, s in declared(ServerConfig) if s.engine}
    assert declared_keywords <= keywords
    assert set(ServerConfig(model="digits").engine_kwargs()) == declared_keywords
    assert {"graphs", "load", "compile", "quantize"} <= declared_keywords  # the built ones


def test_a_value_of_the_wrong_type_names_its_setting():
    for values, needle in [({"port": "x"}, "port must be an integer, got 'x'"),
                           ({"port": True}, "port must be an integer, got True"),
                           ({"grow-fill": True}, "grow-fill must be a number, got True"),
                           ({"access-log": "yes"}, "access-log must be true or false, got 'yes'"),
                           ({"host": 5}, "host must be a string, got 5"),
                           ({"max_queue": None}, "max-queue must be an integer, got None"),
                           ({"devices": 5}, "devices must be a comma-separated list like cuda:0,cuda:1 or cpu,cpu"),
                           ({"api-key": ""}, "api-key is empty"),
                           ({"job-retention": "5y"}, "job-retention must be a duration")]:
        with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
            ServerConfig.from_mapping({"model": "digits", **values})
    assert ServerConfig.from_mapping({"model": "digits", "max_loras": None, "zero_snr": None}).max_loras is None
    # a setting's flag name is a TOML key too
    assert ServerConfig.from_mapping({"model": "digits", "fuse-lora": ["ink:0.5"]}).fuse_loras == (("ink", 0.5),)


# -- files, flags and refusals -----------------------------------------------------------------------------------
def test_the_example_config_holds_every_setting_and_loads():
    path = ROOT / "examples" / "serve.toml"
    text = path.read_text()
    keys = set(re.findall(r"^#? ?([a-z][a-z0-9-]*) = ", text, re.M))
    names = set()
    for f, s in declared(ServerConfig):  # each setting is there, set or as a commented line, by its name or flag's
        mine = {f.name.replace("_", "-")} | {flag[2:] for flag in s.flags}
        assert keys & mine, f"examples/serve.toml lacks {f.name.replace('_', '-')}"
        names |= mine
    for name, cls in builtin_settings().items():  # and each built-in capability's settings, by their flags' names
        for f in dataclasses.fields(cls):
            key = flag_of(name, f.name)[2:]
            assert key in keys, f"examples/serve.toml lacks {key}"
            names.add(key)
    assert keys <= names, f"examples/serve.toml names what is no setting: {sorted(keys - names)}"
    config = load_config(str(path))
    assert config == ServerConfig(model="digits") and config.api_keys == ()


def test_api_keys_from_flags_file_and_environment(tmp_path, monkeypatch):
    from diffgraph.api.config import load_config

    monkeypatch.setenv("DIFFGRAPH_API_KEY", "env1,env2")
    assert load_config(None, {"model": MODEL}).api_keys == ("env1", "env2")
    assert load_config(None, {"model": MODEL, "api_keys": ["flag"]}).api_keys == ("flag",)
    path = tmp_path / "s.toml"
    path.write_text(f'model = "{MODEL}"\napi-key = ["file"]\n')
    assert load_config(str(path)).api_keys == ("file",)
    assert "file" not in repr(load_config(str(path)))  # never printed
    with pytest.raises(ValueError, match="api-key"):
        load_config(None, {"model": MODEL, "api_keys": ["has space"]})


def test_config_file_and_flags(tmp_path):
    import argparse

    from diffgraph.server.cli import add_serve_arguments, config_from_args, main

    path = tmp_path / "serve.toml"
    path.write_text('model = "random:tiny"\nport = 9001\nbatch-buckets = [1, 2, 4]\nresolutions = ["96x64"]\n'
                    'prewarm = "none"\nrequest_timeout = 30\n')
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    config = config_from_args(p.parse_args(["--config", str(path), "--port", "9002", "--max-queue", "8"]))
    assert (config.model, config.port, config.max_queue, config.request_timeout) == (MODEL, 9002, 8, 30.0)
    assert config.batch_buckets == (1, 2, 4) and config.resolutions == ((64, 96),) and config.prewarm is False
    assert config.engine_kwargs()["graphs"].max_bucket == 4  # the engine derives max_rows from it
    assert (config.grow_fill, config.grow_hold_ms) == (0.85, 2000.0)
    config = config_from_args(p.parse_args(["--config", str(path), "--grow-fill", "0.5", "--grow-hold-ms", "200"]))
    assert (config.engine_kwargs()["grow_fill"], config.engine_kwargs()["grow_hold_ms"]) == (0.5, 200.0)

    path.write_text('port = 9001\nbatch_size = 4\n')
    with pytest.raises(ValueError, match="unknown setting 'batch_size'; allowed: model"):
        config_from_args(p.parse_args(["--config", str(path)]))
    assert main(["--model", "no-such-model"]) == 2
    assert main(["--model", MODEL, "--request-timeout", "0"]) == 2
    assert main(["--model", MODEL, "--grow-fill", "2"]) == 2
    assert main(["--model", MODEL, "--grow-hold-ms", "nan"]) == 2
    assert main(["--model", MODEL, "--max-wait-ms", "nan"]) == 2
    assert main(["--model", MODEL, "--max-wait-ms", "1e13"]) == 2


@pytest.mark.parametrize("toml, needle", [
    ("batch-buckets = 5", "batch buckets 5 must be a comma-separated string or a list"),
    ("batch-buckets = [1.5]", "must be positive integers"),
    ("batch-buckets = [true]", "must be positive integers"),
    ("batch-buckets = [1, 4096]", "batch bucket 4096 is above 256"),
    ("resolutions = 512", "resolutions 512 must be a comma-separated string or a list"),
    ('resolutions = ["8x8"]', "resolution '8x8': width and height must be multiples of 8 in 64..2048"),
    ('resolutions = ["100000x64"]', "must be multiples of 8 in 64..2048"),
    ("prewarm = 5", "prewarm 5 must be 'all', 'none' or a list"),
    ('batch-buckets = [1, 2, 4]\nprewarm = "64x64@3"', "prewarm 64x64@3: bucket 3 is not a batch bucket (1,2,4)"),
    ('resolutions = ["64x64"]\nprewarm = "96x96"', "prewarm 96x96 is not among the graphed resolutions (64x64)"),
    ("serve = 5", "'serve' must be a table"),
    ('log-level = "trace"', "log_level 'trace' is unknown"),
    ('device = "tpu"', "device 'tpu' is not understood"),
    ('dtype = "fp64"', "dtype 'fp64' is unknown"),
    ('mode = "fast"', "mode 'fast' is unknown"),
    ("request-timeout = 1e-9", "request_timeout 1e-09 must be >= 1 second"),
])
def test_config_file_nonsense_is_refused_before_loading(tmp_path, toml, needle):
    from diffgraph.api.config import load_config

    path = tmp_path / "serve.toml"
    path.write_text(f'model = "{MODEL}"\n{toml}\n')
    with pytest.raises(ValueError) as info:
        load_config(str(path))
    assert needle in str(info.value)


def test_config_file_prewarm_list_and_trailing_comma(tmp_path):
    from diffgraph.api.config import load_config

    path = tmp_path / "serve.toml"
    path.write_text(f'model = "{MODEL}"\nresolutions = ["64x64", "96x64"]\nprewarm = ["64x64@1/2", "96x64"]\n')
    assert load_config(str(path)).prewarm == ((64, 64, 1), (64, 64, 2), (64, 96, 0))
    path.write_text(f'model = "{MODEL}"\nresolutions = ["64x64"]\nprewarm = "64x64,"\n')
    assert load_config(str(path)).prewarm == ((64, 64, 0),)


def test_upscaler_dir_is_a_folder_and_needs_spandrel(tmp_path, monkeypatch):
    from diffgraph import upscaler_models
    with pytest.raises(ValueError, match="upscaler-dir .* is not a folder"):
        ServerConfig.from_mapping({"model": "digits", "upscaler-dir": str(tmp_path / "none")})
    monkeypatch.setattr(upscaler_models, "spandrel_installed", lambda: False)
    with pytest.raises(ValueError, match=r"needs the spandrel package.*diffgraph\[upscale\]"):
        ServerConfig.from_mapping({"model": "digits", "upscaler-dir": str(tmp_path)})


def test_python_m_diffgraph_is_the_diffgraph_command():
    import os
    import subprocess
    import sys

    src = str(pathlib.Path(__file__).parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "diffgraph", "serve", "--help"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: diffgraph serve") and "\ncapabilities:\n" in r.stdout
