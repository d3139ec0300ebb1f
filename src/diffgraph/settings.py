"""Settings declared once: each is a field of its config dataclass whose metadata (`setting(...)`) says its help, its
argument group, its flag (name, metavar, choices, form), how a TOML or flag value is read, and the `Engine` keyword it
feeds. From those declarations come the command line's flags (`add_flags`, in argument groups), the TOML keys
(`read`: by the field's type unless the setting names its own parser) and the engine's keywords (the config's
`engine_kwargs`). Standard library only, so `--help` stays fast.

    port: int = field(default=8000, metadata=setting("port to listen on (default: {default})", "server"))
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterator

# argument groups in the order `--help` shows them: key -> title
GROUPS = {"model": "model", "graphs": "graphs and compile", "capabilities": "capabilities", "server": "server",
          "limits": "limits and security", "jobs": "jobs", "replicas": "replicas"}


@dataclass(frozen=True)
class Setting:
    """One setting's declaration (the field holds its name, type and default)."""

    help: str                     # "{default}" (or "{default:g}") is replaced by the field's default
    group: str                    # a key of GROUPS
    engine: str | None = None     # the Engine keyword it feeds; several settings may feed one built keyword
    parse: Callable[[Any], Any] | None = None  # a TOML or flag value -> the field's value (default: by its type)
    flags: tuple[str, ...] = ()   # default: --NAME with dashes
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    action: str | None = None     # "store_true", "append", "bool" (--NAME / --no-NAME: a bool setting's default)

    def flag_names(self, name: str) -> tuple[str, ...]:
        return self.flags or (f"--{name.replace('_', '-')}",)

    def add_to(self, p: Any, name: str, kind: type | None = None, default: Any = None,
               flags: tuple[str, ...] = ()) -> None:
        """Its flag on an argparse parser or group, with dest `name` and default None (a flag not given leaves the
        TOML value, or the default the help names, in place). `kind`: the field's scalar type (int and float flags
        are typed unless the setting reads its own values)."""
        kw: dict[str, Any] = {"dest": name, "default": None, "help": fill_default(self.help, default)}
        if self.action == "store_true" or self.action == "append":
            kw["action"] = self.action
        elif self.action == "bool" or (kind is bool and self.parse is None):
            kw["action"] = argparse.BooleanOptionalAction
        elif kind in (int, float) and self.parse is None:
            kw["type"] = kind
        if self.metavar is not None:
            kw["metavar"] = self.metavar
        if self.choices is not None:
            kw["choices"] = self.choices
        p.add_argument(*(flags or self.flag_names(name)), **kw)


def setting(help: str, group: str, **kw: Any) -> dict[str, Setting]:
    """A field's metadata declaring it a setting: `field(default=..., metadata=setting(help, group, ...))`."""
    if group not in GROUPS:
        raise ValueError(f"unknown argument group {group!r}; allowed: {', '.join(GROUPS)}")
    return {"setting": Setting(help, group, **kw)}


def fill_default(help: str, default: Any) -> str:
    return re.sub(r"\{default(?::([^}]*))?\}", lambda m: format(default, m.group(1) or ""), help)


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def declared(cls: type) -> Iterator[tuple[dataclasses.Field, Setting]]:
    """The fields of `cls` that are settings, in their order, with their declarations."""
    for f in dataclasses.fields(cls):
        if "setting" in f.metadata:
            yield f, f.metadata["setting"]


def scalar(hint: Any) -> tuple[Any, bool]:
    """(the type a value is read as, whether None is allowed) of a field's resolved type hint."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        rest = [a for a in args if a is not type(None)]
        return typing.get_origin(rest[0]) or rest[0], len(rest) < len(args)
    return typing.get_origin(hint) or hint, False


def add_flags(p: argparse.ArgumentParser, cls: type) -> dict[str, Any]:
    """Every setting of `cls` as a flag, in the argument groups of GROUPS (returned by key, for flags that are not
    settings)."""
    groups = {key: p.add_argument_group(title) for key, title in GROUPS.items()}
    hints = typing.get_type_hints(cls)
    for f, s in declared(cls):
        s.add_to(groups[s.group], f.name, scalar(hints[f.name])[0], default_of(f))
    return groups


def read(name: str, hint: Any, s: Setting, value: Any) -> Any:
    """A TOML or flag value of setting `name` (its field's type hint `hint`) as the field's value; a ValueError
    naming the setting otherwise."""
    kind, optional = scalar(hint)
    label = name.replace("_", "-")
    if value is None and (optional or kind is str):
        return None
    if s.parse is not None:
        return s.parse(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{label} must be true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"{label} must be an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{label} must be an integer, got {value!r}") from None
    if kind is float:
        if isinstance(value, bool):
            raise ValueError(f"{label} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{label} must be a number, got {value!r}") from None
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{label} must be a string, got {value!r}")
    return value


def comma_list(error: str, lower: bool = False) -> Callable[[Any], tuple[str, ...]]:
    """A parser of a list of strings (a TOML list, or one comma-separated string); `error` when it is neither."""

    def parse(value: Any) -> tuple[str, ...]:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise ValueError(error)
        return tuple((v.strip().lower() if lower else v.strip()) for v in items if v.strip())

    return parse
