"""A capability's settings and request flags, declared once and generated everywhere, in the standard library only
(so `diffgraph serve --help` imports no torch).

A capability's settings are a dataclass (fields with defaults and a "help" metadata entry); each field is the flag
`--NAME-FIELD` (dashes for underscores), or `--NAME` for a field named as its capability, in an argument group of
its own, the TOML key of the same name (`toml_settings`), and a field of its entry in
`Engine(capability_settings={NAME: ...})`. A capability's request parameters may declare a flag of `diffgraph
generate` (`RequestFlag`: a value, JSON read when it is an object, or a repeatable image file).

The built-in capabilities declare themselves in the modules (or subpackages) of the `diffgraph.capabilities` package
(each a `DECLARATION`, standard library only); `builtin()` finds them there, so adding one edits no table: a
capability no family registers names its implementation there too, and every engine's default registry makes it
(features/capability.py `builtin_capabilities`). A capability
registered at run time (features/capability.py `Capabilities`) declares the same through its `settings` and `params`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import pkgutil
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

PACKAGE = "diffgraph.capabilities"


@dataclass(frozen=True)
class RequestFlag:
    """A flag of `diffgraph generate` that sets request parameter `param`."""

    param: str
    help: str
    flag: str = ""          # default: --PARAM with dashes
    metavar: str | None = None
    json: bool = False      # a value that starts with "{" is read as a JSON object
    images: bool = False    # repeatable; each an image file read as RGB (sent base64 over HTTP)

    @property
    def name(self) -> str:
        return self.flag or f"--{self.param.replace('_', '-')}"

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


@dataclass(frozen=True)
class Declaration:
    """What a built-in capability declares without torch: its name, its settings dataclass, its request parameters
    (their names: what a job file read before its model loads lets through) and their flags."""

    name: str
    settings: type | None = None
    params: tuple[str, ...] = ()
    flags: tuple[RequestFlag, ...] = ()
    # "module:Class" of its `Capability`, for one that no family registers: every engine's default registry makes it
    # (imported when an engine is built, never by the command line's flags)
    implementation: str = ""

    def param_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.params, *(f.param for f in self.flags))))


@functools.lru_cache(maxsize=None)
def builtin() -> tuple[Declaration, ...]:
    """Every `DECLARATION` of the modules of `diffgraph.capabilities`, by name."""
    package = importlib.import_module(PACKAGE)
    found = [importlib.import_module(f"{PACKAGE}.{m.name}").DECLARATION for m in pkgutil.iter_modules(package.__path__)]
    return tuple(sorted(found, key=lambda d: d.name))


def builtin_settings() -> dict[str, type]:
    """The built-in capabilities' settings dataclasses by capability name (those that have settings)."""
    return {d.name: d.settings for d in builtin() if d.settings is not None}


def builtin_params() -> tuple[str, ...]:
    """The built-in capabilities' request parameters: what a job file read before its model loads lets through
    beside the images fields, each checked once the model is known."""
    return tuple(p for d in builtin() for p in d.param_names())


def flag_of(name: str, field: str) -> str:
    """The flag (and, without its dashes, the TOML key) of field `field` of capability `name`'s settings."""
    return f"--{name if field == name else f'{name}-{field}'}".replace("_", "-")


def _kind(f: dataclasses.Field) -> type:
    return f.type if isinstance(f.type, type) else type(f.default)


def add_capability_flags(parser: argparse.ArgumentParser, settings: Mapping[str, type | None],
                         group: "argparse._ArgumentGroup | None" = None) -> None:
    """The flags of every capability's settings (`settings`: its name -> its settings dataclass, or None), in
    `group` (an argument group: `serve`'s "capabilities"), else in an argument group of each capability's own."""
    for name, cls in settings.items():
        if cls is None:
            continue
        into = group or parser.add_argument_group(f"capability {name}")
        for f in dataclasses.fields(cls):
            into.add_argument(flag_of(name, f.name), dest=f"capability__{name}__{f.name}", type=_kind(f),
                              default=None, metavar=f.metadata.get("metavar"),
                              help=f"{f.metadata.get('help', '')} (default: {f.default})")


def capability_args(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The flags `add_capability_flags` made that were given: capability name -> {field: value}."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if key.startswith("capability__") and value is not None:
            _, name, field = key.split("__", 2)
            out.setdefault(name, {})[field] = value
    return out


def toml_settings(values: Mapping[str, Any], settings: Mapping[str, type | None]) -> tuple[dict[str, Any],
                                                                                          dict[str, dict[str, Any]]]:
    """A TOML file's keys split into (the other settings, capability name -> {field: value}): each capability
    settings field's key is its flag without the dashes (`step-cache = "auto"`; underscores or dashes). A value of
    the wrong type is a ValueError naming the key."""
    keys = {flag_of(name, f.name)[2:]: (name, f) for name, cls in settings.items() if cls is not None
            for f in dataclasses.fields(cls)}
    rest: dict[str, Any] = {}
    found: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        hit = keys.get(key.replace("_", "-"))
        if hit is None:
            rest[key] = value
            continue
        name, f = hit
        kind = _kind(f)
        if kind in (int, float) and not isinstance(value, bool) and isinstance(value, (int, float)):
            value = kind(value)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ValueError(f"{key} must be a {kind.__name__}, got {value!r}")
        found.setdefault(name, {})[f.name] = value
    return rest, found


def add_request_flags(parser: argparse.ArgumentParser, flags: Iterable[RequestFlag]) -> None:
    """`diffgraph generate`'s flags of capability request parameters."""
    for f in flags:
        if f.images:
            parser.add_argument(f.name, dest=f.dest, action="append", default=None, metavar=f.metavar, help=f.help)
        else:
            parser.add_argument(f.name, dest=f.dest, default=None, metavar=f.metavar, help=f.help)


def request_values(args: argparse.Namespace, flags: Iterable[RequestFlag]) -> dict[str, Any]:
    """The request parameters the value flags of `flags` set (not the image ones): a JSON object read. Raises
    ValueError naming the flag."""
    out = {}
    for f in flags:
        value = getattr(args, f.dest, None)
        if value is None or f.images:
            continue
        if f.json and isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{f.name} is not a JSON object: {e}") from None
        out[f.param] = value
    return out
