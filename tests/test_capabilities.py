"""A capability registered at run time, with nothing in engine/, request.py or server/ edited for it.

`Tint` declares both halves in one class (features/capability.py): a request parameter (`tint`, neutral 0), a
setting (`max_tint`, its flag `--tint-max-tint` generated), a check (a ParamError naming `tint` above the setting), a
preparation on the submitting thread (the per-channel shift as a tensor) and a row feature (the shift added to the
request's latents at its last step, through a per-step coefficient column). The SD family has it, SDXL does not. The
test checks the values: the tinted request's final latents are the plain request's plus the shift, a tinted row in
a batch with plain rows equals itself alone, and the 400s name the parameter (over HTTP too).
"""

import argparse
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from diffgraph import Engine, GenerationRequest, ParamError
from diffgraph.features.base import FieldSpec, RowFeature
from diffgraph.features.capability import Capabilities, Capability, Param
from diffgraph.features.slot_files import Folder, SlotFiles

from server_util import served

PREPARED_ON: list[str] = []


@dataclass
class TintSettings:
    max_tint: float = field(default=1.0, metadata={"help": "the largest |tint| a request may ask"})


class LastStepRows(RowFeature):
    """A row feature with one column, `NAME.last`: 1 at a row's last step."""

    def columns(self):
        return (f"{self.name}.last",)

    def plan_columns(self, request, index):
        return {f"{self.name}.last": (index == request.num_inference_steps - 1).astype(np.float64)}


class TintRows(LastStepRows):
    name = "tint"

    def __init__(self, channels: int):
        self.channels = channels

    def fields(self, latent_shape):
        return {"tint.shift": FieldSpec((latent_shape[0], *(1,) * (len(latent_shape) - 1)), torch.float32)}


    def rows(self, admission):
        prepared = admission.prepared.get("tint")
        return {} if prepared is None else {"tint.shift": prepared}

    def after_update(self, view, x_next, denoised):
        return x_next + view.column("tint.last") * view.fields["tint.shift"]


class Tint(Capability):
    name = "tint"
    params = (Param("tint", 0.0, float, "added to every latent channel at the last step"),)
    settings = TintSettings

    def applies(self, model):
        return model.family == "sd"

    def check(self, values, settings):
        if abs(values["tint"]) > settings.max_tint:
            raise ParamError("tint", f"tint {values['tint']} is beyond this server's {settings.max_tint}")

    def prepare(self, values, settings):
        PREPARED_ON.append(threading.current_thread().name)
        return torch.full((4, 1, 1), values["tint"])

    def feature(self, model, settings):
        return TintRows(model.latent_channels)


@pytest.fixture(scope="module")
def registry():
    return Capabilities((Tint(),))


@pytest.fixture(scope="module")
def engine(registry):
    with Engine(model="random:tiny", device="cpu", dtype="fp32", capabilities=registry,
                capability_settings={"tint": {"max_tint": 0.5}}) as e:
        yield e


def _latents_of(engine, requests):
    """Each request's final latents (read where the engine retires rows) and its image, submitted at one step."""
    seen, futures = [], []
    read = engine.runner.read_latents

    def recording(key, start, count):
        out = read(key, start, count)
        seen.append((start, out.clone()))
        return out
    engine.runner.read_latents = recording
    try:
        engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in requests)).result()
        results = [f.result(timeout=600) for f in futures]
    finally:
        del engine.runner.read_latents
    return seen, results


def _request(engine, **kw):
    return GenerationRequest.create("a lighthouse", model=engine.info,
                                    **{"num_inference_steps": 3, "seed": 5, "width": 64, "height": 64, **kw})


def test_the_capability_shifts_its_rows_latents_at_the_last_step_only(engine):
    (_, plain), = _latents_of(engine, [_request(engine)])[0]
    (_, tinted), = _latents_of(engine, [_request(engine, extras={"tint": 0.25})])[0]
    torch.testing.assert_close(tinted, plain + 0.25, rtol=0, atol=1e-5)
    assert PREPARED_ON and "loop" not in PREPARED_ON[-1]  # prepared on the submitting thread
    # the neutral value asks nothing: the same image as no parameter
    (_, neutral), = _latents_of(engine, [_request(engine, extras={"tint": 0.0})])[0]
    torch.testing.assert_close(neutral, plain, rtol=0, atol=0)


def test_a_tinted_row_beside_plain_rows_equals_itself_alone(engine):
    alone = _latents_of(engine, [_request(engine, extras={"tint": -0.3}, seed=9)])[1][0].arrays
    mixed = _latents_of(engine, [_request(engine, seed=1), _request(engine, extras={"tint": -0.3}, seed=9),
                                 _request(engine, seed=2)])[1]
    assert np.abs(mixed[1].arrays - alone).max() <= 1 / 255
    assert np.abs(mixed[0].arrays - mixed[1].arrays).max() > 0.01


def test_its_check_and_its_types_name_the_parameter(engine):
    for extras, words in (({"tint": 0.9}, "beyond this server's 0.5"), ({"tint": "red"}, "must be a number")):
        with pytest.raises(ParamError) as e:
            engine.submit(_request(engine, extras=extras))
        assert e.value.param == "tint" and words in str(e.value)
    with pytest.raises(ParamError) as e:
        _request(engine, extras={"tone": 1.0})
    assert e.value.param == "tone"
    assert "tint" in engine.info.capabilities and engine.info.extension_params == ("tint", "step_cache")


def test_its_settings_make_flags(registry):
    parser = argparse.ArgumentParser()
    registry.add_flags(parser)
    args = parser.parse_args(["--tint-max-tint", "0.75"])
    settings = registry.settings(registry.settings_from_args(args))
    assert settings["tint"] == TintSettings(max_tint=0.75)
    assert "the largest |tint|" in parser.format_help() and "capability tint" in parser.format_help()
    assert registry.settings({})["tint"] == TintSettings()
    with pytest.raises(ValueError, match="not registered"):
        registry.settings({"tone": {}})


def test_served_over_http_with_its_400_on_a_model_without_it(registry, engine):
    from diffgraph.server import ServerConfig

    body = {"prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 3, "seed": 5}
    with served(engine, ServerConfig(model="random:tiny", device="cpu")) as client:
        plain = client.post("/v1/images/generations", json=body)
        tinted = client.post("/v1/images/generations", json={**body, "tint": 0.25})
        assert plain.status_code == 200 and tinted.status_code == 200, tinted.text
        assert plain.json()["data"][0]["b64_json"] != tinted.json()["data"][0]["b64_json"]
        too_much = client.post("/v1/images/generations", json={**body, "tint": 0.9})
        assert too_much.status_code == 400 and too_much.json()["error"]["param"] == "tint"
        assert "tint" in client.get("/v1/models").text
    with Engine(model="random:tiny-xl", device="cpu", dtype="fp32", capabilities=registry) as xl, \
            served(xl, ServerConfig(model="random:tiny-xl", device="cpu")) as client:
        refused = client.post("/v1/images/generations", json={**body, "tint": 0.25})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "tint" and "does not have" in error["message"]
        neutral = client.post("/v1/images/generations", json={**body, "tint": 0.0, "num_inference_steps": 1})
        assert neutral.status_code == 200, neutral.text


# -- a capability with host resources: a folder of named files loaded into device slots between steps ---------------

MAX_BIASES = 2  # files a request may name


@dataclass
class BiasSettings:
    folder: str = field(default="", metadata={"help": "a folder of NAME.safetensors files, each a per-channel `shift`"})
    slots: int = field(default=2, metadata={"help": "bias files held on the device at once"})


class BiasRows(LastStepRows):
    """The shifts of a row's files (device slots of `store`; slot 0 holds zeros) added at the row's last step."""

    name = "bias"

    def __init__(self, model, slots: int):
        self.store = torch.zeros((slots + 1, model.latent_channels), dtype=torch.float32, device=model.device)

    def fields(self, latent_shape):
        return {"bias.slots": FieldSpec((MAX_BIASES,), torch.int64)}


    def rows(self, admission):
        slot_of = admission.slots.get("bias")
        if not slot_of:
            return {}
        slots = [slot_of[name] for name in admission.prepared["bias"]]
        return {"bias.slots": torch.tensor(slots + [0] * (MAX_BIASES - len(slots)))}

    def after_update(self, view, x_next, denoised):
        shift = self.store[view.fields["bias.slots"]].sum(1).to(x_next.dtype)  # [n, C]
        return x_next + view.column("bias.last") * shift.view(*shift.shape, *(1,) * (x_next.dim() - 2))

    def place(self, slot, host):  # between steps, on the loop thread: in place, so captured graphs stay valid
        self.store[slot].copy_(host)


def read_shift(name, path):
    from diffgraph.safe_tensors import read_safetensors

    shift = read_safetensors(path, 1 << 20).get("shift")
    if shift is None or shift.shape != (4,):
        raise ParamError("bias", f"bias file {name!r} has no `shift` of 4 values")
    return shift.float()


class Bias(Capability):
    name = "bias"
    params = (Param("bias", (), tuple, f"up to {MAX_BIASES} files of the server's bias folder, whose shifts are added "
                                       "to the latents at the last step"),)
    settings = BiasSettings

    def applies(self, model):
        return model.family == "sd"

    def check(self, values, settings):
        if not settings.folder:
            raise ParamError("bias", "this server has no bias folder; start it with --bias-folder DIR")
        if len(values["bias"]) > MAX_BIASES or not all(isinstance(n, str) for n in values["bias"]):
            raise ParamError("bias", f"bias takes up to {MAX_BIASES} file names")

    def prepare(self, values, settings):
        return tuple(dict.fromkeys(values["bias"]))

    def feature(self, model, settings):
        return BiasRows(model, settings.slots)

    def host_files(self, model, settings, feature):
        if not settings.folder:
            return None
        folder = Folder(settings.folder, what="bias file", label="bias folder", param="bias")
        return SlotFiles("bias", "bias", folder.locate, read_shift, slots=settings.slots, place=feature.place,
                         listing=folder.names, limit="--bias-slots", what="bias file")


SHIFTS = {"warm": [0.1, 0.2, 0.0, -0.1], "cold": [-0.2, 0.0, 0.1, 0.05], "styles/hot": [0.3, -0.1, 0.0, 0.2]}


def make_bias_folder(root):
    """`SHIFTS` as a folder of bias files under `root` (a pathlib.Path)."""
    from safetensors.torch import save_file

    for name, values in SHIFTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        save_file({"shift": torch.tensor(values)}, str(root / f"{name}.safetensors"))
    return root


@pytest.fixture(scope="module")
def bias_folder(tmp_path_factory):
    return make_bias_folder(tmp_path_factory.mktemp("biases"))


@pytest.fixture(scope="module")
def bias_registry():
    return Capabilities((Bias(),))


@pytest.fixture(scope="module")
def bias_engine(bias_registry, bias_folder):
    with Engine(model="random:tiny", device="cpu", dtype="fp32", capabilities=bias_registry,
                capability_settings={"bias": {"folder": str(bias_folder), "slots": 2}}) as e:
        yield e


def _shift(*names):
    return sum(torch.tensor(SHIFTS[n]) for n in names).view(4, 1, 1)


def test_a_capabilitys_files_reach_their_slots_and_the_rows_that_name_them(bias_engine):
    files = bias_engine.runner.capabilities.files["bias"]
    assert files.names() == ["cold", "styles/hot", "warm"]
    (_, plain), = _latents_of(bias_engine, [_request(bias_engine)])[0]
    (_, warm), = _latents_of(bias_engine, [_request(bias_engine, extras={"bias": ["warm"]})])[0]
    torch.testing.assert_close(warm, plain + _shift("warm"), rtol=0, atol=1e-5)
    (_, both), = _latents_of(bias_engine, [_request(bias_engine, extras={"bias": ["warm", "styles/hot"]})])[0]
    torch.testing.assert_close(both, plain + _shift("warm", "styles/hot"), rtol=0, atol=1e-5)
    # two slots: a request whose files do not fit beside those of a live one waits for them, then runs; each equals
    # itself alone, and a plain row beside them is unchanged
    seen, results = _latents_of(bias_engine, [_request(bias_engine, extras={"bias": ["warm", "styles/hot"]}),
                                              _request(bias_engine, extras={"bias": ["cold"]}), _request(bias_engine)])
    assert len(results) == 3 and len(seen) == 3
    latents = dict(seen)
    assert len(latents) == 2  # the request naming `cold` waited, and ran later at row 0
    assert files.slots.holding()[files.slots.slot_of(("cold", files.held("cold").key[1]))][1] == 0  # unpinned
    ((_, cold),), (alone,) = _latents_of(bias_engine, [_request(bias_engine, extras={"bias": ["cold"]})])
    torch.testing.assert_close(cold, plain + _shift("cold"), rtol=0, atol=1e-5)
    assert np.abs(results[1].arrays - alone.arrays).max() <= 1 / 255
    assert np.abs(results[1].arrays - results[2].arrays).max() > 0.01


def check_files_reach_graphed_steps(engine):
    """With one slot: each file placed in it in place between steps reaches the step's graphs (a graphed engine)."""
    (_, plain), = _latents_of(engine, [_request(engine)])[0]
    for names in (["warm"], ["cold"], ["warm"]):  # the one slot rewritten each time
        (_, got), = _latents_of(engine, [_request(engine, extras={"bias": names})])[0]
        torch.testing.assert_close(got, plain + _shift(*names).to(got.device), rtol=0, atol=1e-4)
    files = engine.runner.capabilities.files["bias"]
    assert [key[0] for key, pins in files.slots.holding().values()] == ["warm"]


def test_a_capabilitys_files_reach_graphed_steps(bias_registry, bias_folder):
    from diffgraph.config import GraphConfig

    graphs = GraphConfig(resolutions=((64, 64),), batch_buckets=(1, 2), backend="emulated")
    with Engine(model="random:tiny", device="cpu", dtype="fp32", mode="graph", graphs=graphs,
                capabilities=bias_registry, capability_settings={"bias": {"folder": str(bias_folder), "slots": 1}}) as e:
        check_files_reach_graphed_steps(e)
        assert e.runner.graph_table()  # the steps replayed graphs


def test_a_capabilitys_files_are_refused_by_name(bias_engine):
    for names, words in ((["tepid"], "bias file 'tepid' is unknown"), (["../warm"], "is not allowed"),
                         (["warm", "cold", "styles/hot"], "bias takes up to 2")):
        with pytest.raises(ParamError) as e:
            bias_engine.submit(_request(bias_engine, extras={"bias": names}))
        assert e.value.param == "bias" and words in str(e.value)


def test_a_capability_with_files_over_http_and_its_400_on_a_model_without_it(bias_registry, bias_engine, bias_folder):
    from diffgraph.server import ServerConfig

    body = {"prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 3, "seed": 5}
    with served(bias_engine, ServerConfig(model="random:tiny", device="cpu")) as client:
        plain = client.post("/v1/images/generations", json=body)
        warm = client.post("/v1/images/generations", json={**body, "bias": ["warm"]})
        assert plain.status_code == 200 and warm.status_code == 200, warm.text
        assert plain.json()["data"][0]["b64_json"] != warm.json()["data"][0]["b64_json"]
        unknown = client.post("/v1/images/generations", json={**body, "bias": ["wram"]})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "bias"
        assert "did you mean 'warm'" in unknown.json()["error"]["message"]
    with Engine(model="random:tiny-xl", device="cpu", dtype="fp32", capabilities=bias_registry,
                capability_settings={"bias": {"folder": str(bias_folder)}}) as xl, \
            served(xl, ServerConfig(model="random:tiny-xl", device="cpu")) as client:
        refused = client.post("/v1/images/generations", json={**body, "bias": ["warm"]})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "bias" and "does not have" in refused.json()["error"]["message"]


def test_a_declared_capability_with_files_reaches_serve_and_every_engine(monkeypatch, bias_folder):
    """Declared (capability_settings.Declaration, as a module of diffgraph.capabilities declares it, here patched in),
    a capability with files gets `diffgraph serve`'s flags and joins every engine's default registry: nothing else is
    edited for it (its package, its test and its line in ARCHITECTURE.md are the whole of it)."""
    from diffgraph import capability_settings
    from diffgraph.capability_settings import Declaration
    from diffgraph.cli import _parser
    from diffgraph.server.cli import config_from_args

    declared = Declaration("bias", BiasSettings, params=("bias",), implementation=f"{Bias.__module__}:Bias")
    monkeypatch.setattr(capability_settings, "builtin", lambda original=capability_settings.builtin(): (*original,
                                                                                                       declared))
    assert "bias" in capability_settings.builtin_params()
    args = _parser().parse_args(["serve", "--model", "random:tiny", "--device", "cpu", "--dtype", "fp32",
                                 "--bias-folder", str(bias_folder), "--bias-slots", "1"])
    config = config_from_args(args)
    assert config.capability_options() == {"bias": {"folder": str(bias_folder), "slots": 1}}
    body = {"prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 2, "seed": 5}
    with Engine(**config.engine_kwargs()) as e, served(e, config) as client:
        assert "bias" in e.info.capabilities and e.runner.capabilities.files["bias"].slots.slots == 1
        plain = client.post("/v1/images/generations", json=body)
        warm = client.post("/v1/images/generations", json={**body, "bias": ["warm"]})
        assert plain.status_code == 200 and warm.status_code == 200, warm.text
        assert plain.json()["data"][0]["b64_json"] != warm.json()["data"][0]["b64_json"]
        two = client.post("/v1/images/generations", json={**body, "bias": ["warm", "cold"]})  # one slot
        assert two.status_code == 400 and "at most 1 at once (--bias-slots)" in two.json()["error"]["message"]


def test_the_built_in_capabilities_parameters_are_listed_torch_free():
    """`builtin_params()` (what `diffgraph batch` lets through before its model loads), found in the declarations of
    `diffgraph.capabilities`, is every parameter of the capabilities the built-in families register
    (models/families/), and no other; their settings are the declared ones."""
    import importlib
    import pkgutil

    import diffgraph.models.families as families
    from diffgraph.capability_settings import builtin_params, builtin_settings

    for m in pkgutil.iter_modules(families.__path__):
        importlib.import_module(f"{families.__name__}.{m.name}")

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)
    found = [c for c in subclasses(Capability) if c.__module__.startswith(families.__name__)]
    params = {p.name for c in found for p in c.params}
    assert params == set(builtin_params()) and len(builtin_params()) == len(params) == 4
    assert {c.name: c.settings for c in found if c.settings} == builtin_settings()


# a value for each built-in capability setting that is not its default (the generic check below falls back to the
# default for a setting not named here)
EXAMPLES = {("step_cache", "step_cache"): "auto"}


def test_each_capability_setting_reaches_its_flag_its_toml_key_and_the_engine(tmp_path, registry):
    """Declared once (the settings dataclass): `diffgraph serve`'s flag, the TOML key and `Engine`'s keyword carry
    every built-in capability setting, and a run-time capability's through its registry."""
    import dataclasses

    from diffgraph.api.config import load_config
    from diffgraph.capability_settings import builtin_settings, capability_args, flag_of
    from diffgraph.cli import _parser
    from diffgraph.server.cli import config_from_args

    given = {name: {f.name: EXAMPLES.get((name, f.name), f.default) for f in dataclasses.fields(cls)}
             for name, cls in builtin_settings().items()}
    assert given
    for name, fields in given.items():
        for field_name, value in fields.items():
            flag = flag_of(name, field_name)
            args = _parser().parse_args(["serve", flag, str(value)])
            assert config_from_args(args).engine_kwargs()["capability_settings"] == {name: {field_name: value}}
            args = _parser().parse_args(["batch", "job.jsonl", "--out", str(tmp_path), flag, str(value)])
            assert capability_args(args) == {name: {field_name: value}}  # `batch`'s local engine takes them too
            toml = tmp_path / "serve.toml"
            toml.write_text(f"{flag[2:]} = {value!r}\n".replace("'", '"'))
            assert load_config(str(toml)).engine_kwargs()["capability_settings"] == {name: {field_name: value}}
    with Engine(model="random:tiny", device="cpu", dtype="fp32", capability_settings=given) as e:
        for name, fields in given.items():
            assert dataclasses.asdict(e.runner.capabilities.settings[name]) == fields
        assert dict(e.info.extension_defaults) == {"step_cache": "auto"}
    # a run-time capability: its flag, its TOML key and its engine entry from its dataclass alone
    rest, toml = registry.settings_from_toml({"tint-max-tint": 0.25, "port": 8000})
    assert rest == {"port": 8000} and registry.settings(toml)["tint"] == TintSettings(max_tint=0.25)
    with pytest.raises(ValueError, match="tint-max-tint must be a float"):
        registry.settings_from_toml({"tint-max-tint": "lots"})
