"""Review of `--model-dir`'s faults: a model file that goes between the folder's listing and a stat or hash of it, a
model whose load failed once (still offered, and tried again once its file is fixed), and `--model` given as a path
inside `--model-dir` (one model, one name: not listed twice, nor loaded a second time under its folder name)."""

from __future__ import annotations

import asyncio
import json
import io
import os
import shutil
import time

import pytest
from fastapi.testclient import TestClient

from diffgraph.engine.held_models import HeldModels
from diffgraph.engine.model_set import ModelSet, folder_builder
from diffgraph.engine.remote_models import ModelClient, ModelSetSpec, RemoteResident
from diffgraph.models import catalog, file_hashes
from diffgraph.models.presets import shipped_preset_folder
from diffgraph.safe_files import FileChanged
from diffgraph.server import ServerConfig, create_app
from diffgraph.server.models import ModelRouting, Target
from diffgraph.api.protocol import APIError
from test_model_sets_review import _checkpoint  # a few-byte file the catalog reads as an SD1 checkpoint

DEFAULT = Target(None, None, None)


class _LocalSet:
    """The models backend of a `ModelSet` in this process (what `RemoteModels` asks of a replica's set)."""

    def __init__(self, models: ModelSet) -> None:
        self.set = models

    def acquire(self, name: str, timeout: float | None = None) -> RemoteResident:
        resident = self.set.acquire(name, timeout)
        return RemoteResident(name, ModelClient(None, None, resident.client.info, 0), resident.memory_bytes)

    def release(self, resident: RemoteResident) -> None:
        self.set.release(next(r for r in self.set.resident() if r.name == resident.name))

    def resident(self) -> list[RemoteResident]:
        return [RemoteResident(r.name, ModelClient(None, None, r.client.info, 0), r.memory_bytes)
                for r in self.set.resident()]

    def loading(self) -> list[str]:
        return self.set.loading()

    @property
    def errors(self) -> dict[str, str]:
        return dict(self.set.errors)

    def close(self) -> None:
        self.set.close()


def _set(root, default: str = "random:tiny") -> _LocalSet:
    return _LocalSet(ModelSet(folder_builder(str(root), default, {"device": "cpu", "image_threads": 1}), "cpu"))


def _target_error(routing: ModelRouting, name: str) -> APIError:
    with pytest.raises(APIError) as e:
        asyncio.run(routing.target(name, 600.0, DEFAULT))
    return e.value


def _gone_before_stat(monkeypatch, victim: str) -> None:
    """Removes `victim` just before the catalog's stat of it: as `rm` between the folder's walk and the stat."""
    check = catalog.check_regular

    def racing(path: str, max_bytes: int):
        if os.path.basename(path) == victim and os.path.exists(path):
            os.remove(path)
        return check(path, max_bytes)
    monkeypatch.setattr(catalog, "check_regular", racing)


# -- 1. a file that goes between the listing and a stat or hash of it ------------------------------------------------
def test_a_file_removed_between_the_folders_walk_and_its_stat_is_not_listed(tmp_path, monkeypatch):
    _checkpoint(tmp_path / "kept.safetensors", 0.0)
    _checkpoint(tmp_path / "gone.safetensors", 0.0)
    _gone_before_stat(monkeypatch, "gone.safetensors")
    listed = catalog.ModelDir(str(tmp_path)).listing()
    assert [(e.name, e.error) for e in listed] == [("kept", None)]  # was ("gone", "gone.safetensors does not exist")


def test_a_file_removed_while_it_is_hashed_is_a_file_changed_and_the_offline_listing_goes_on(tmp_path, monkeypatch):
    _checkpoint(tmp_path / "m.safetensors", 0.0)
    sha256 = file_hashes.sha256_of

    def removed_first(path: str, st: os.stat_result) -> str:
        os.remove(path)  # after the stat, before the hash opens it
        return sha256(path, st)
    monkeypatch.setattr(file_hashes, "sha256_of", removed_first)
    with pytest.raises(FileChanged, match="m.safetensors was removed while it was hashed"):
        file_hashes.FileHashes(str(tmp_path / "cache")).compute(str(tmp_path / "m.safetensors"))  # was FileNotFound
    _checkpoint(tmp_path / "m.safetensors", 0.0)
    out = io.StringIO()
    assert catalog.print_model_dir(str(tmp_path), out, hashes=True, cache_root=str(tmp_path / "cache")) == 0
    assert out.getvalue().split()[0] == "m" and out.getvalue().split()[-1] == "-"  # no hash this time, no crash


def test_a_model_removed_after_its_name_resolved_is_a_404_naming_model(tmp_path):
    _checkpoint(tmp_path / "m.safetensors", 0.0)
    backend = _set(tmp_path)
    acquire = backend.acquire

    def removed_first(name: str, timeout: float | None = None) -> RemoteResident:
        os.remove(tmp_path / "m.safetensors")  # after the request's name was resolved, before its model loads
        return acquire(name, timeout)
    backend.acquire = removed_first
    routing = ModelRouting(str(tmp_path), "random:tiny", backend)
    try:
        error = _target_error(routing, "m")
        assert (error.status, error.param, error.code) == (404, "model", "model_not_found")  # was a 400
        assert "model 'm' is not in the model folder" in str(error) and "GET /v1/models lists them" in str(error)
        assert [c["id"] for c in routing.listing(0)] == ["random:tiny"]
    finally:
        routing.close()


# -- 2. a model whose load failed once ---------------------------------------------------------------------------------
def test_a_model_whose_load_failed_is_still_offered_and_loads_once_its_file_is_fixed(tmp_path):
    shutil.copytree(shipped_preset_folder("digits"), tmp_path / "digits")
    unet = tmp_path / "digits" / "unet" / "diffusion_pytorch_model.safetensors"
    whole = unet.read_bytes()
    unet.write_bytes(whole[:4096])
    backend = _set(tmp_path)
    routing = ModelRouting(str(tmp_path), "random:tiny", backend)
    app = create_app(ServerConfig(model="random:tiny", model_dir=str(tmp_path), device="cpu"),
                     engine_factory=lambda: None, models=backend)  # no lifespan: the engine is never built
    http = TestClient(app, raise_server_exceptions=False)
    try:
        error = _target_error(routing, "digits")
        assert (error.status, error.param) == (400, "model") and "could not be loaded" in str(error)
        titles = [m["title"] for m in http.get("/sdapi/v1/sd-models").json()]
        assert titles == ["random:tiny", "digits"]  # was ["random:tiny"]: hidden until a load succeeded
        card = {c["id"]: c for c in http.get("/v1/models").json()["data"]}["digits"]
        assert "truncated" in card["error"] and card["error_kind"] == "load"  # its reason, listed
        unet.write_bytes(whole)  # the file fixed: the next request tries again
        target = asyncio.run(routing.target("digits", 600.0, DEFAULT))
        assert target.info.name == "digits" and target.info.family == "sd"
        target.release(routing)
        card = {c["id"]: c for c in http.get("/v1/models").json()["data"]}["digits"]
        assert (card["resident"], card["error"], card["error_kind"]) == (True, None, None)
    finally:
        routing.close()


def test_a_file_the_catalog_cannot_serve_stays_out_of_the_a1111_titles(tmp_path):
    _checkpoint(tmp_path / "m.safetensors", 0.0)
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    backend = _set(tmp_path)
    http = TestClient(create_app(ServerConfig(model="random:tiny", model_dir=str(tmp_path), device="cpu"),
                                 engine_factory=lambda: None, models=backend), raise_server_exceptions=False)
    try:
        card = {c["id"]: c for c in http.get("/v1/models").json()["data"]}["cut"]
        assert "truncated" in card["error"] and card["error_kind"] == "file"
        assert [m["filename"] for m in http.get("/sdapi/v1/sd-models").json()] == ["random:tiny", "m"]
    finally:
        backend.close()


# -- 3. --model PATH inside --model-dir DIR ----------------------------------------------------------------------------
def test_a_default_model_inside_the_model_dir_is_one_model_under_one_name(tmp_path):
    _checkpoint(tmp_path / "sub" / "m.safetensors", 0.0)
    _checkpoint(tmp_path / "other.safetensors", 0.0)
    default = str(tmp_path / "sub" / ".." / "sub" / "m.safetensors")  # any spelling of the path
    routing = ModelRouting(str(tmp_path), default, _set(tmp_path, default))
    try:
        assert [c["id"] for c in routing.listing(0)] == [default, "other"]  # was [default, "other", "sub/m"]
        assert asyncio.run(routing.resolve("sub/m")) == default
        assert asyncio.run(routing.target("sub/m", 600.0, DEFAULT)) is DEFAULT  # not a second engine of the file
        assert routing.family(default) is None and routing.family("other") == "sd"
    finally:
        routing.close()


def test_a_default_preset_name_that_is_also_a_path_into_the_model_dir_is_the_preset(tmp_path, monkeypatch):
    shutil.copytree(shipped_preset_folder("digits"), tmp_path / "sub" / "digits")
    monkeypatch.chdir(tmp_path / "sub")  # "digits" is a path here too, but the loader reads a preset's name first
    routing = ModelRouting(str(tmp_path), "digits", _set(tmp_path, "digits"))
    try:
        assert [c["id"] for c in routing.listing(0)] == ["digits", "sub/digits"]
        assert asyncio.run(routing.resolve("sub/digits")) == "sub/digits"
    finally:
        routing.close()


def test_a_preload_of_the_default_under_its_folder_name_loads_nothing_more(tmp_path):
    shutil.copytree(shipped_preset_folder("digits"), tmp_path / "sd" / "digits")
    default = str(tmp_path / "sd" / "digits")
    held = HeldModels(ModelSetSpec(str(tmp_path), default, preload=("sd/digits",)), "cpu", {"image_threads": 1})
    try:
        assert [r.name for r in held.set.resident()] == [default]  # was [default, "sd/digits"]: two engines
        assert held.set.errors == {}
    finally:
        held.close()


# -- 4. answers name files relative to their folders -------------------------------------------------------------------
def test_no_answer_shows_where_the_server_keeps_its_files(tmp_path):
    """Listings and errors name models and adapters as clients name them, relative to --model-dir and --lora-dir:
    the server's absolute paths are for its own log (they were in /v1/models' errors and in the 400s of unusable and
    unloadable models)."""
    from diffgraph import Engine

    models, loras = tmp_path / "models", tmp_path / "loras"
    shutil.copytree(shipped_preset_folder("digits"), models / "broken")
    unet = models / "broken" / "unet" / "diffusion_pytorch_model.safetensors"
    unet.write_bytes(unet.read_bytes()[:4096])  # fails to load
    _checkpoint(models / "ok.safetensors", 0.0)
    (models / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    (models / "old.ckpt").write_bytes(b"PK\x03\x04 never unpickled")
    loras.mkdir()
    (loras / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    backend = _set(models)
    config = ServerConfig(model="random:tiny", model_dir=str(models), lora_dir=str(loras), device="cpu")
    app = create_app(config, engine_factory=lambda: Engine("random:tiny", device="cpu", lora_dir=str(loras)),
                     models=backend)
    roots = {str(tmp_path), os.path.realpath(tmp_path)}
    bodies = []
    with TestClient(app, raise_server_exceptions=False) as http:
        for _ in range(6000):  # the engine is built on a background thread (a failure bound, not a timing)
            if http.get("/ready").status_code == 200:
                break
            time.sleep(0.05)
        for path in ("/v1/models", "/v1/loras", "/sdapi/v1/sd-models", "/sdapi/v1/loras", "/v1/loras?model=cut"):
            bodies.append(http.get(path).text)
        for extra in ({"model": "broken"}, {"model": "cut"}, {"model": "old.ckpt"}, {"model": "nope"},
                      {"loras": [{"name": "cut", "scale": 1.0}]}, {"loras": [{"name": "nope", "scale": 1.0}]}):
            r = http.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 1, **extra})
            assert r.status_code in (400, 404), r.text
            bodies.append(r.text)
        cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
        bodies.append(json.dumps(cards))
    leaks = [b for b in bodies if any(root in b for root in roots)]
    assert leaks == []
    assert cards["broken"]["error"].startswith("model folder 'broken': unet/diffusion_pytorch_model.safetensors is "
                                               "truncated")
    assert cards["cut"]["error"].startswith("model 'cut.safetensors' is not a readable safetensors file")
    assert "old.ckpt" in cards["old.ckpt"]["error"] and "diffgraph convert" in cards["old.ckpt"]["error"]


@pytest.mark.parametrize("file", ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"])
def test_a_folder_whose_tokenizer_json_nests_too_deep_is_listed_with_why_and_the_others_serve(tmp_path, file):
    """200,000 brackets in a folder model's tokenizer JSON (transformers parses it without a depth limit): GET
    /v1/models lists that model with the file named and keeps the others; a request naming it is a one-line 400."""
    shutil.copytree(shipped_preset_folder("digits"), tmp_path / "deep")
    (tmp_path / "deep" / file).write_text("[" * 200_000 + "]" * 200_000)
    _checkpoint(tmp_path / "ok.safetensors", 0.0)
    backend = _set(tmp_path)
    routing = ModelRouting(str(tmp_path), "random:tiny", backend)
    http = TestClient(create_app(ServerConfig(model="random:tiny", model_dir=str(tmp_path), device="cpu"),
                                 engine_factory=lambda: None, models=backend), raise_server_exceptions=False)
    try:
        r = http.get("/v1/models")
        assert r.status_code == 200, r.text
        cards = {c["id"]: c for c in r.json()["data"]}
        assert sorted(cards) == ["deep", "ok", "random:tiny"]
        assert cards["deep"]["error"] == (f"deep/{file} nests JSON deeper than 64 levels (the limit for this file; a "
                                          "damaged or hostile one): copy or download it again")
        assert cards["ok"]["error"] is None and cards["deep"]["error_kind"] == "file"
        error = _target_error(routing, "deep")
        assert (error.status, error.param) == (400, "model") and f"deep/{file} nests JSON" in str(error)
        assert "\n" not in str(error) and str(tmp_path) not in str(error)
    finally:
        routing.close()
