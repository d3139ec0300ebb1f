"""server/config.py and settings.py: each setting is declared once, on its ServerConfig field, and reaches its flag of
`diffgraph serve` (in its argument group), its TOML key and, where it has one, its `Engine` keyword."""

import argparse
import ast
import dataclasses
import json
import pathlib

import pytest

from diffgraph.server.cli import add_serve_arguments, config_from_args
from diffgraph.server.config import ServerConfig, load_config
from diffgraph.settings import GROUPS, declared

ROOT = pathlib.Path(__file__).resolve().parents[1]
SERVE_ONLY_FLAGS = {"--config", "--data-parallel", "--ray", "--ray-address"}  # how to serve, not settings


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
    d = str(folder)
    return {
        "model": ("random:tiny-lcm", {}), "host": ("0.0.0.0", {}), "port": (9001, {}), "device": ("cpu", {}),
        "dtype": ("fp32", {}), "mode": ("eager", {}), "batching": ("request", {}), "batch_buckets": ([1, 2], {}),
        "resolutions": (["64x96"], {}), "prewarm": ("none", {}), "max_queue": (9, {}), "max_wait_ms": (5.0, {}),
        "grow_fill": (0.5, {}), "grow_hold_ms": (10.0, {}), "request_timeout": (30.0, {}),
        "max_prompt_bytes": (100, {}), "drain_timeout": (3.0, {}), "header_timeout": (2.0, {}),
        "body_timeout": (9.0, {}), "max_connections": (50, {}), "max_client_connections": (5, {}),
        "trusted_proxies": (["10.0.0.5"], {}), "body_deadline": (3.0, {}), "min_body_rate": (0, {}),
        "log_level": ("debug", {}), "access_log": (False, {}), "api_keys": (["k1"], {}),
        "api_key_file": (str(keys), {}), "protect_metrics": (True, {}), "playground": (False, {}),
        "torch_threads": (3, {}), "image_threads": (3, {}), "devices": (["cpu", "cpu"], {}),
        "min_ready": (2, {"devices": ["cpu", "cpu"]}), "max_image_bytes": (1000, {}),
        "max_image_pixels": (10_000, {}), "lora_dir": (d, {}), "max_loras": (4, {}), "max_lora_rank": (32, {}),
        "lora_conv": (True, {}), "fuse_loras": (["ink:0.5"], {}), "controlnet_dir": (d, {}),
        "max_controlnets": (3, {}), "ip_adapter_dir": (d, {}), "compile": (True, {}),
        "compile_mode": ("max-autotune-no-cudagraphs", {"compile": True}), "quantize": ("fp8", {}),
        "quantize_min_features": (64, {"quantize": "fp8"}), "embeddings_dir": (d, {}), "max_prompt_chunks": (2, {}),
        "clip_skip": (1, {}), "prompt_syntax": ("a1111", {}), "compile_cache": (d, {"compile": True}),
        "metadata": (False, {}), "preview_decoder": (d, {}), "max_step_failures": (5, {}),
        "replica_timeout": (5.0, {}), "lora_host_bytes": (100, {}), "max_pixels": (4096, {}),
        "image_ttl": (60.0, {}), "image_store": (d, {}), "image_store_bytes": (2 << 20, {}),
        "public_url": ("https://images.example.com", {}), "model_dir": (d, {}), "max_models": (3, {}),
        "model_memory": (4.0, {}), "preload": (["a"], {"model_dir": d}), "vae": (d, {}), "vae_upcast": (False, {}),
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
    words = " ".join(text.split())
    assert "--max-queue N waiting requests before new ones get 429 (default: 256)" in words  # {default}
    assert "has waited this long (default: 2000)" in words  # --grow-hold-ms's {default:g}


def test_each_setting_reaches_its_toml_key_its_flag_and_its_engine_keyword(tmp_path):
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
