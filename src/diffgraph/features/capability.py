"""Capabilities as plug-ins: one object declares both halves of a per-request capability.

A `Capability` names its request parameters (`Param`: the flat field name a request and an HTTP body carry, the value
that asks nothing of it, its type), its settings (a dataclass whose fields, defaults and `help` metadata make its
server flags `--NAME-FIELD`, `--NAME` for a field named as the capability, and its
`Engine(capability_settings={NAME: ...})` entry), which models have it (`applies`), the check of its values on a
model that has it (`check`: a ParamError naming the field), its preparation on the submitting thread (`prepare`:
whatever its row feature needs at admission, `Admission.prepared`), its row feature in the denoising step (`feature`)
and its named files with host copies and device slots (`host_files`: slot_files.py's `SlotFiles`, whose names the
engine resolves at submit, whose slots gate admission and which it places between steps). A `Capabilities` registry
holds them; the engine asks it at build (the features of the step, the files' gates), at submit (values checked and
prepared) and for `ModelInfo` (the parameters each model takes, which the server lets through); no module of the
engine, the request or the server names a capability.

On a model without the capability its parameters are a 400 naming them unless they carry their neutral value.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from .. import capability_settings
from ..capability_settings import add_capability_flags, capability_args, toml_settings
from ..errors import ParamError
from .base import RowFeature
from .slot_files import SlotFiles, names_in


@dataclass(frozen=True)
class Param:
    """One request parameter of a capability."""

    name: str        # the request's field (and the HTTP body's key), flat beside the built-in ones
    neutral: Any     # the value that asks nothing of the capability (any model accepts it)
    # what a value is read as (float, int, str, bool; tuple: a list of items the check reads; or a function that reads
    # a value, raising a ParamError naming the field)
    kind: Any = float
    help: str = ""
    images: bool = False  # a list of images: the HTTP routes decode its base64 strings into images (`image_params`)
    # a list's most items and what they are called ("input images"): refused past it as "4 input images; send at
    # most 3" (the server's check and the playground's, which reads both from /info's `image_limits`); 0: no limit
    limit: int = 0
    items: str = ""


class Capability:
    """The interface; every hook has the neutral behaviour."""

    name: str = ""
    params: tuple[Param, ...] = ()
    settings: type | None = None  # a dataclass (fields with defaults; metadata "help"), or None
    # listed among a model's extensions (`ModelInfo.extensions`); False for one whose parameter is the request's own
    # field and which has a listing route of its own (LoRA: `loras`, GET /v1/loras)
    extension: bool = True
    # the request's own fields its `resolve` reads (LoRA: "loras"); a request whose fields are all empty asks nothing
    # of it, and the engine does not call it (nor moves off an event loop for it)
    fields: tuple[str, ...] = ()

    def applies(self, model: Any) -> bool:
        """Whether a loaded model (models.model.DiffusionModel) has this capability."""
        return True

    def check(self, values: dict[str, Any], settings: Any) -> None:
        """ParamError naming the field whose value this model cannot honour."""

    def prepare(self, values: dict[str, Any], settings: Any) -> Any:
        """On the submitting thread: what the row feature reads at admission (`Admission.prepared[name]`)."""
        return values

    def feature(self, model: Any, settings: Any) -> RowFeature | None:
        """Its row feature in the model's step (None: it has no step half)."""
        return None

    def host_files(self, model: Any, settings: Any, feature: RowFeature | None) -> SlotFiles | None:
        """Its named files with host copies and device slots (features/slot_files.py), made once per model after its
        row feature (`feature`, whose device slots they may fill): the engine resolves the names a request gives in
        the files' `param` on the submitting thread (`admission.prepared` keeps them), admits the request when its
        files have slots (else it waits), places them between steps and hands the row feature each name's slot
        (`admission.slots[files.name]`). None: it keeps no files."""
        return None

    def resolve(self, request: Any, settings: Any, files: SlotFiles | None) -> tuple:
        """On the submitting thread, for a capability whose parameter is a field of the request itself rather than
        an extension in `extras` (LoRA's `loras`): the files the request names, resolved (objects with `key`,
        `host`, `source`, as `SlotFiles.held` gives, the capability's own richer ones included), which its files'
        gate admits and its row feature reads (`admission.prepared[files.held_key]`). A ParamError naming the field
        for what this engine cannot serve (`files` None: it has no files)."""
        return ()

    def text_adapters(self, held: tuple, slots: dict[str, int]) -> tuple:
        """What the text encoders run with for an admitted request, from its resolved files (`held`) and their slots
        (file name -> slot): part of its prompts' cache keys, handed to the encoder (LoRA's text side paths:
        (file key, scale, slot) each). () by default."""
        return ()

    def recommends(self, held: tuple) -> dict[str, Any]:
        """The request fields (of request.DEFAULTABLE) its resolved files (`held`, from `resolve`) recommend, which a
        request that left them to the model's defaults runs with (LoRA: its sidecar's schedule, steps, guidance).
        A ParamError naming the field for files that recommend different values. {} by default."""
        return {}

    def defaults(self, settings: Any) -> dict[str, Any]:
        """The parameter values a request that names none takes from the server's settings (a server default that
        asks something of the capability), written into the request when it is made, so that what ran is what its
        image's metadata records and `--from-image` reproduces."""
        return {}


def read_value(param: Param, value: Any) -> Any:
    """A request's value as the parameter's kind; ParamError naming it otherwise."""
    if value is None:
        return param.neutral
    if param.kind is bool:
        if isinstance(value, bool):
            return value
        raise ParamError(param.name, f"{param.name} must be true or false, got {value!r}")
    if param.kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ParamError(param.name, f"{param.name} must be a number, got {value!r}")
    if param.kind is tuple and not isinstance(value, (list, tuple)):
        raise ParamError(param.name, f"{param.name} must be a list, got {type(value).__name__}")
    if param.kind is str and not isinstance(value, str):
        raise ParamError(param.name, f"{param.name} must be a string, got {value!r}")
    try:
        return param.kind(value)
    except ParamError:  # a kind that reads its own values (a function) names the field itself
        raise
    except (TypeError, ValueError):
        raise ParamError(param.name, f"{param.name} must be a {param.kind.__name__}, got {value!r}") from None


class Capabilities:
    """A registry of capabilities (nothing shared between registries). Register them, then hand it to
    `Engine(capabilities=...)` (and to the server's flags: `add_flags`, `settings_from_args`)."""

    def __init__(self, capabilities: tuple[Capability, ...] = ()):
        self._by_name: dict[str, Capability] = {}
        self._param_of: dict[str, tuple[Capability, Param]] = {}
        for c in capabilities:
            self.register(c)

    def register(self, capability: Capability) -> None:
        if not capability.name or not capability.name.replace("_", "").isalnum():
            raise ValueError(f"{type(capability).__name__} needs a `name` of letters, digits and underscores")
        if capability.name in self._by_name:
            raise ValueError(f"a capability named {capability.name!r} is registered already")
        for p in capability.params:
            if p.name in self._param_of:
                raise ValueError(f"parameter {p.name!r} of {capability.name!r} is {self._param_of[p.name][0].name!r}'s")
        self._by_name[capability.name] = capability
        self._param_of.update({p.name: (capability, p) for p in capability.params})

    def __iter__(self):
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def param_names(self) -> tuple[str, ...]:
        return tuple(self._param_of)

    # -- settings ----------------------------------------------------------------------------------
    def settings(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Each capability's settings: `given[name]` (its dataclass, or a dict of its fields), else its defaults."""
        given = dict(given or {})
        unknown = set(given) - set(self._by_name)
        if unknown:
            raise ValueError(f"settings for capabilities that are not registered: {', '.join(sorted(unknown))}; "
                             f"registered: {', '.join(self._by_name) or 'none'}")
        out = {}
        for name, c in self._by_name.items():
            value = given.get(name)
            if c.settings is None:
                if value:
                    raise ValueError(f"capability {name!r} takes no settings")
                out[name] = None
            elif value is None or isinstance(value, dict):
                out[name] = c.settings(**(value or {}))
            elif isinstance(value, c.settings):
                out[name] = value
            else:
                raise ValueError(f"settings of capability {name!r} must be a {c.settings.__name__} or a dict")
        return out

    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        """`--NAME-FIELD` flags (dashes for underscores) of every capability's settings, one argument group each
        (a field named as its capability: `--NAME`)."""
        add_capability_flags(parser, {name: c.settings for name, c in self._by_name.items()})

    def settings_from_args(self, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
        """The flags `add_flags` made, as `settings()`'s `given` (only those set)."""
        return capability_args(args)

    def settings_from_toml(self, values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """A TOML file's keys as (the other keys, `settings()`'s `given`): each settings field's key is its flag
        without the dashes."""
        return toml_settings(values, {name: c.settings for name, c in self._by_name.items()})

    # -- per model, per request ------------------------------------------------------------------------
    def for_model(self, model: Any, settings: Mapping[str, Any]) -> "ModelCapabilities":
        return ModelCapabilities(self, tuple(c for c in self if c.applies(model)), dict(settings))


def builtin_capabilities() -> Capabilities:
    """A fresh registry of the built-in capabilities that declare their implementation (capability_settings.py
    `Declaration.implementation`): the default of `Engine(capabilities=...)`."""
    made = []
    for d in capability_settings.builtin():
        if d.implementation:
            module, _, name = d.implementation.partition(":")
            made.append(getattr(importlib.import_module(module), name)())
    return Capabilities(tuple(made))


@dataclass
class ModelCapabilities:
    """The registry seen from one loaded model: which capabilities it has, with their settings (and, once `features`
    made them, their files by capability name)."""

    registry: Capabilities
    present: tuple[Capability, ...]
    settings: dict[str, Any]
    files: dict[str, SlotFiles] = field(default_factory=dict)
    # the request fields the present capabilities' `resolve` reads (`Capability.fields`): a request with all of them
    # empty is not handed to `resolve`
    request_fields: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.request_fields = tuple(dict.fromkeys(f for c in self.present for f in c.fields))

    def names(self) -> tuple[str, ...]:
        """The extensions this model has (`Capability.extension`)."""
        return tuple(c.name for c in self.present if c.extension)

    def params(self) -> tuple[str, ...]:
        """Every registered capability's parameter names (the server lets them through; the engine decides)."""
        return self.registry.param_names()

    def defaults(self) -> tuple[tuple[str, Any], ...]:
        """The parameter values this model's capabilities give a request that names none (`Capability.defaults`)."""
        return tuple(sorted(kv for c in self.present for kv in c.defaults(self.settings[c.name]).items()))

    def image_params(self) -> tuple[str, ...]:
        """The parameters of this model's capabilities that take a list of images (`Param.images`)."""
        return tuple(p.name for c in self.present for p in c.params if p.images)

    def image_limits(self) -> tuple[tuple[str, int, str], ...]:
        """(name, most items, what they are called) of those image parameters that have a limit (`Param.limit`)."""
        return tuple((p.name, p.limit, p.items) for c in self.present for p in c.params if p.images and p.limit)

    def features(self, model: Any) -> tuple[RowFeature, ...]:
        """The row features of the capabilities this model has; their files made beside them (`files`)."""
        out = []
        for c in self.present:
            feature = c.feature(model, self.settings[c.name])
            files = c.host_files(model, self.settings[c.name], feature)
            if files is not None:
                self.files[c.name] = files
            if feature is not None:
                out.append(feature)
        return tuple(out)

    def gates(self) -> tuple[SlotFiles, ...]:
        """The admission gates of the capabilities' files that have device slots."""
        return tuple(f for f in self.files.values() if f.slots is not None)

    def prepare(self, extras: Mapping[str, Any], model_name: str) -> dict[str, Any]:
        """On the submitting thread: a request's capability parameters checked (`check`) and prepared, by capability
        name, and the files they name read (`SlotFiles.resolve`, under `SlotFiles.held_key`). Raises ParamError
        naming the field."""
        out: dict[str, Any] = {}
        for c, values in self._asked(extras, model_name):
            files = self.files.get(c.name)
            if files is not None:
                out[files.held_key] = files.resolve(names_in(values.get(files.param), files.param))
            out[c.name] = c.prepare(values, self.settings[c.name])
        return out

    def resolve(self, request: Any) -> dict[str, Any]:
        """On the submitting thread: the files the request names in its own fields (`request_fields`), by their
        files' `held_key` (`Capability.resolve`; none asked: {}). Raises ParamError naming the field."""
        out: dict[str, Any] = {}
        for c in self.present:
            if not any(getattr(request, f) for f in c.fields):
                continue
            files = self.files.get(c.name)
            held = c.resolve(request, self.settings[c.name], files)
            if held:
                out[files.held_key] = held
        return out

    def recommended(self, request: Any, resolved: Mapping[str, Any]) -> Any:
        """`request` with what its resolved files (`resolve`'s) recommend for the fields it left to the model's
        defaults (`Capability.recommends`, `request.defaulted`), each then no longer defaulted: what runs, and what
        its image's metadata records."""
        values: dict[str, Any] = {}
        for c in self.present:
            files = self.files.get(c.name)
            held = resolved.get(files.held_key) if files is not None else None
            if held:
                values.update(c.recommends(held))
        values = {k: v for k, v in values.items() if k in request.defaulted}
        if not values:
            return request
        return dataclasses.replace(request, defaulted=tuple(f for f in request.defaulted if f not in values), **values)

    def slots(self, state: Any) -> dict[str, dict[str, int]]:
        """An admitted request's file slots, by files' name: file name -> slot (`Admission.slots`)."""
        return {f.name: f.slot_map(state, state.admitted[f.name]) for f in self.gates() if state.admitted.get(f.name)}

    def text_adapters(self, state: Any) -> tuple:
        """What the text encoders run with for an admitted request (`Capability.text_adapters`)."""
        if not state.admitted:
            return ()
        slots = self.slots(state)
        return tuple(a for c in self.present if c.name in self.files for a in c.text_adapters(
            state.prepared.get(self.files[c.name].held_key, ()), slots.get(self.files[c.name].name, {})))

    def check(self, extras: Mapping[str, Any], model_name: str) -> None:
        """A request's capability parameters checked without preparing them (unknown names, values, neutral ones on a
        model without the capability): what a batch job's items are checked by when the job is submitted. Raises
        ParamError naming the field."""
        for _ in self._asked(extras, model_name):
            pass

    def _asked(self, extras: Mapping[str, Any], model_name: str) -> Iterator[tuple[Capability, dict[str, Any]]]:
        """Each present capability a request asks something of, with its values read and checked."""
        unknown = [k for k in extras if k not in self.registry._param_of]
        if unknown:
            raise ParamError(unknown[0], f"{unknown[0]} is not a parameter of this server; leave it out")
        for c in self.registry:
            values = {p.name: read_value(p, extras.get(p.name)) for p in c.params}
            if c not in self.present:
                for p in c.params:
                    if values[p.name] != p.neutral:
                        raise ParamError(p.name, f"{p.name} needs capability {c.name!r}, which model {model_name!r} "
                                                 f"does not have; leave {p.name} out")
                continue
            if all(values[p.name] == p.neutral for p in c.params):
                continue  # asks nothing: its row feature keeps its neutral fields
            c.check(values, self.settings[c.name])
            yield c, values
