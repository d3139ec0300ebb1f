"""The capabilities' settings as server flags, and the built-in capabilities' settings, in the standard library only
(so `diffgraph serve --help` imports no torch).

A capability's settings are a dataclass (fields with defaults and a "help" metadata entry); each field is the flag
`--NAME-FIELD` (dashes for underscores), or `--NAME` for a field named as its capability, in an argument group of
its own. `BUILTIN` holds the settings of the capabilities the built-in families register (models/families/), which
`diffgraph serve` offers as flags and hands to the engine (`Engine(capability_settings=...)`); `BUILTIN_PARAMS` their
request parameters.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class StepCacheSettings:
    """The step cache's (models/families/unet_cache.py, token_cache.py)."""

    step_cache: str = dataclasses.field(default="off", metadata={
        "metavar": "off|auto|JSON", "help": "the step cache of a request that names none (SD families' UNets; "
                "Z-Image): off, auto, or a JSON object such as '{\"method\": \"deepcache\", \"interval\": 3}'"})


BUILTIN: dict[str, type] = {"step_cache": StepCacheSettings}
# the request parameters of the capabilities the built-in families register: what a job file read before its model
# loads (`diffgraph batch`) lets through beside the images fields, each checked once the model is known
BUILTIN_PARAMS: tuple[str, ...] = ("step_cache", "reference_images", "cfg_truncation", "cfg_normalization")


def add_capability_flags(parser: argparse.ArgumentParser, settings: Mapping[str, type | None]) -> None:
    """The flags of every capability's settings (`settings`: its name -> its settings dataclass, or None)."""
    for name, cls in settings.items():
        if cls is None:
            continue
        group = parser.add_argument_group(f"capability {name}")
        for f in dataclasses.fields(cls):
            flag = f"--{name if f.name == name else f'{name}-{f.name}'}".replace("_", "-")
            kind = f.type if isinstance(f.type, type) else type(f.default)
            group.add_argument(flag, dest=f"capability__{name}__{f.name}", type=kind, default=None,
                               metavar=f.metadata.get("metavar"), help=f"{f.metadata.get('help', '')} (default: {f.default})")


def capability_args(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The flags `add_capability_flags` made that were given: capability name -> {field: value}."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if key.startswith("capability__") and value is not None:
            _, name, field = key.split("__", 2)
            out.setdefault(name, {})[field] = value
    return out
