"""Many models behind one server (issue 29, point 3): `--model-dir` serves every diffusers folder and checkpoint file
under it by name, each request picks one with `model`, models load on first use and the least recently used idle
one is evicted; a model with requests in flight never is. The listing's hashes follow replaced files, requests waiting
for a model load do not starve the server's shared worker threads (nor leak a hold when they go), and the memory
budget evicts idle models before a load, not only after it. Faults: a model file that goes between the folder's
listing and a stat or hash of it, a model whose load failed once (still offered, and tried again once its file is
fixed), and `--model` given as a path inside `--model-dir` (one model, one name)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from safetensors.torch import save_file

from diffgraph import Engine
from diffgraph.api.protocol import APIError
from diffgraph.config import default_cpu_threads
from diffgraph.engine.held_models import HeldModels
from diffgraph.engine.model_set import ModelSet, folder_builder
from diffgraph.engine.remote_models import ModelClient, ModelSetSpec, RemoteModels, RemoteResident
from diffgraph.models import catalog, file_hashes
from diffgraph.models.presets import shipped_preset_folder
from diffgraph.safe_files import FileChanged
from diffgraph.server import ServerConfig, create_app
from diffgraph.server import models as server_models
from diffgraph.server.models import ModelRouting, Target
from diffgraph.server.process import ServerProcess
from model_dir_util import _checkpoint  # a few-byte file the catalog reads as an SD1 checkpoint

PROMPT = "a handwritten digit seven"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(shipped_preset_folder("digits"), root / "sd" / "digits-copy")
    shutil.copytree(shipped_preset_folder("digits-xl"), root / "xl" / "digits-xl")
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 32)},
              str(root / "a-lora.safetensors"))
    (root / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    (root / "sidecar-bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    (root / "sidecar-bad.diffgraph.toml").write_text('config = "configs/missing"\n')
    shutil.copytree(shipped_preset_folder("digits"), root / "broken")  # its UNet weights cut short: fails to load
    unet = root / "broken" / "unet" / "diffusion_pytorch_model.safetensors"
    unet.write_bytes(unet.read_bytes()[:4096])
    return root


@pytest.fixture(scope="module")
def server(model_dir):
    s = ServerProcess("--model-dir", str(model_dir), "--max-models", "2", "--request-timeout", "600")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop(timeout=60)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """torch's intra-op threads of the server under test, for a solo engine in this process: the same reductions,
    so exactly the same pixels (with other counts a pixel may round one level apart)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _generate(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/images/generations", timeout=600,
                      json={"prompt": PROMPT, "seed": 5, "num_inference_steps": 4, **body})


def _pixels(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))


def _models(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=60).json()["data"]}


def test_the_listing_names_every_model_and_why_some_cannot_serve(server):
    models = _models(server.url)
    assert set(models) == {"random:tiny", "sd/digits-copy", "xl/digits-xl", "a-lora", "cut", "broken", "sidecar-bad"}
    assert "sidecar sidecar-bad.diffgraph.toml: config 'configs/missing' is not a diffusers folder" in \
        models["sidecar-bad"]["error"]
    assert models["random:tiny"]["default"] and models["random:tiny"]["resident"]
    assert models["random:tiny"]["memory_bytes"] > 0
    assert (models["xl/digits-xl"]["family"], models["xl/digits-xl"]["native_size"]) == ("sdxl", 64)
    assert "LoRA adapter" in models["a-lora"]["error"] and "truncated" in models["cut"]["error"]
    metrics = httpx.get(server.url + "/metrics", timeout=60).text
    assert 'diffgraph_model_resident{model="random:tiny"} 1.0' in metrics
    assert 'diffgraph_model_memory_bytes{model="random:tiny"}' in metrics


def test_requests_to_two_models_at_once_equal_each_models_solo_image(server):
    results: dict[str, httpx.Response] = {}

    def ask(name):
        results[name] = _generate(server.url, model=name)
    threads = [threading.Thread(target=ask, args=(n,)) for n in ("sd/digits-copy", "xl/digits-xl")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, preset in (("sd/digits-copy", "digits"), ("xl/digits-xl", "digits-xl")):
        with _threads(default_cpu_threads()), Engine(preset, device="cpu") as solo:
            alone = np.asarray(solo.generate(PROMPT, seed=5, num_inference_steps=4)[0])
        assert np.array_equal(_pixels(results[name]), alone), name
    assert np.array_equal(_pixels(_generate(server.url)), _pixels(_generate(server.url, model="random:tiny")))


def test_bad_model_names_are_refused_naming_model_and_the_others_keep_serving(server):
    cases = [("nope", 404, "not in the model folder"), ("a-lora", 400, "LoRA adapter"), ("cut", 400, "truncated"),
             ("sidecar-bad", 400, "sidecar"),
             ("../etc", 400, "not allowed"), ("broken", 400, "could not be loaded")]
    for name, status, words in cases:
        r = _generate(server.url, model=name)
        assert r.status_code == status, (name, r.text)
        error = r.json()["error"]
        assert error["param"] == "model" and words in error["message"], (name, error)
    assert _generate(server.url, model="sd/digits-copy").status_code == 200
    assert "truncated" in _models(server.url)["broken"]["error"]  # the load's reason, listed


def test_a_model_with_requests_in_flight_is_not_evicted(server):
    """Two slots: the default is pinned, so a third model must evict the second, unless it is busy."""
    busy: dict[str, httpx.Response] = {}
    long = threading.Thread(target=lambda: busy.update(r=_generate(server.url, model="sd/digits-copy",
                                                                    num_inference_steps=60)))
    long.start()
    try:
        deadline_steps = 0
        while not _models(server.url)["sd/digits-copy"]["resident"]:  # it is loaded (or already was)
            deadline_steps += 1
            assert deadline_steps < 6000
            threading.Event().wait(0.05)
        other = _generate(server.url, model="xl/digits-xl")  # needs a slot while digits-copy is busy
        assert other.status_code == 200, other.text
    finally:
        long.join()
    assert busy["r"].status_code == 200, busy["r"].text  # the busy model was not evicted under its request
    models = _models(server.url)
    assert models["random:tiny"]["resident"]  # the default is never evicted
    after = _generate(server.url, model="sd/digits-copy")  # a later load brings the set back to its bound
    assert after.status_code == 200
    resident = [m for m, card in _models(server.url).items() if card["resident"]]
    assert len(resident) == 2 and "random:tiny" in resident and "sd/digits-copy" in resident


def test_the_memory_budget_evicts_idle_models_never_a_busy_one():
    """ModelSet with a budget smaller than one model: after each load the set is over it, so every idle model but
    the newest goes; a model with a request in flight stays until it is idle."""
    from diffgraph.engine.model_set import ModelSet

    def build(name, loop):
        return Engine(name, device="cpu", loop=loop, image_threads=1)
    models = ModelSet(build, "cpu", max_models=8, memory_bytes=1)
    try:
        a = models.acquire("random:tiny")
        assert a.memory_bytes == sum(t.numel() * t.element_size() for m in
                                     (a.client.engine.model.denoiser, a.client.engine.model.vae,
                                      *a.client.engine.model.text_encoders)
                                     for t in [*m.parameters(), *m.buffers()])
        engine = a.client.engine
        gate = threading.Event()
        engine.core.call_between_steps(gate.wait)  # the loop waits here: a's request stays queued, a stays busy
        future = engine.submit(engine.make_request("x", num_inference_steps=4, seed=1))
        models.release(a)
        b = models.acquire("digits")
        assert {r.name for r in models.resident()} == {"random:tiny", "digits"}  # a is busy: kept, over budget
        gate.set()
        future.result(timeout=600)
        assert future.result().arrays.shape[0] == 1  # its request finished on the engine that was kept
        models.release(b)
        c = models.acquire("digits-xl")  # now a and b are idle: both go
        assert [r.name for r in models.resident()] == ["digits-xl"]
        models.release(c)
    finally:
        models.close()


def _tensor_bytes(folder) -> int:
    """The bytes of every tensor in a folder's safetensors files, as stored."""
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*/*.safetensors")):
        with safe_open(str(path), "pt") as f:
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    return total


def test_a_model_whose_weights_exceed_the_memory_budget_is_refused_by_name_and_the_others_serve(tmp_path):
    """`--model-memory` below a model's weights (estimated from its files at the load dtype before it loads: the
    fp16 digits folder at fp32 is twice its tensors' bytes, what the loaded model then measures): one line naming
    it, its size and the budget; nothing is built for it and the default keeps serving; with room it loads."""
    from diffgraph.engine.model_set import ModelSet, ModelTooLarge, folder_builder, folder_estimate

    shutil.copytree(shipped_preset_folder("digits"), tmp_path / "sd" / "digits")
    estimate = folder_estimate(str(tmp_path), "random:tiny", "cpu")
    need = estimate("sd/digits")
    assert need == 2 * _tensor_bytes(tmp_path / "sd" / "digits") and estimate("random:tiny") is None
    assert folder_estimate(str(tmp_path), "random:tiny", "cpu", "bf16")("sd/digits") == need // 2
    assert folder_estimate(str(tmp_path), "random:tiny", "cpu", quantized=True)("sd/digits") == need // 4  # fp8
    build, built = folder_builder(str(tmp_path), "random:tiny", {"device": "cpu", "image_threads": 1}), []
    models = ModelSet(lambda name, loop: built.append(name) or build(name, loop), "cpu", max_models=4,
                      memory_bytes=need // 2, estimate=estimate)
    try:
        default = models.acquire("random:tiny")
        with pytest.raises(ModelTooLarge) as e:
            models.acquire("sd/digits")
        message = str(e.value)
        assert message == (f"model 'sd/digits' needs about {need / 2**30:.3g} GiB of weights, more than "
                           f"--model-memory {need / 2 / 2**30:.3g} GiB; raise --model-memory or use an fp8/GGUF file")
        assert built == ["random:tiny"] and models.errors["sd/digits"] == message and not models.loading()
        image = default.client.engine.generate("x", num_inference_steps=1, seed=1)  # the default still serves
        assert image.arrays.shape == (1, 64, 64, 3)
        models.memory_bytes = 4 * need
        digits = models.acquire("sd/digits")
        assert abs(digits.memory_bytes - need) <= need // 100  # the estimate is what it measures once loaded
        assert "sd/digits" not in models.errors
        models.release(digits)
        models.release(default)
    finally:
        models.close()


def test_an_out_of_memory_load_answers_one_line_frees_what_it_built_and_the_next_load_works():
    """A CUDA out-of-memory error while a model builds (simulated: the builder raises it after allocating) is one
    ModelTooLarge line naming the model; what the build held is collected before the answer; the set is not stuck:
    the next model loads and serves."""
    import weakref

    from diffgraph.engine.model_set import ModelSet, ModelTooLarge

    held = []

    def build(name, loop):
        if name == "random:tiny-xl":
            partial = torch.nn.Linear(256, 256)  # what a build had allocated when the device ran out
            held.append(weakref.ref(partial))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.\nSee the docs")
        return Engine(name, device="cpu", loop=loop, image_threads=1)
    models = ModelSet(build, "cpu", max_models=2)
    try:
        with pytest.raises(ModelTooLarge) as e:
            models.acquire("random:tiny-xl")
        assert str(e.value).startswith("model 'random:tiny-xl' ran out of device memory while it loaded (0 GiB held")
        assert "\n" not in str(e.value) and models.errors["random:tiny-xl"] == str(e.value)
        assert held[0]() is None and not models.loading()  # collected before the answer came
        tiny = models.acquire("random:tiny")
        assert tiny.client.engine.generate("x", num_inference_steps=1, seed=1).arrays.shape == (1, 64, 64, 3)
        models.release(tiny)
    finally:
        models.close()


def test_an_eviction_has_given_its_engine_back_once_the_set_has_settled():
    """An eviction started by an acquire (the set over its bound) closes and collects the engine on its own thread:
    once `wait_settled` returns, nothing of it is alive (on CUDA: its memory is back; tools/probe_eviction.py)."""
    import gc
    import weakref

    from diffgraph.engine.model_set import ModelSet

    models = ModelSet(lambda name, loop: Engine(name, device="cpu", loop=loop, image_threads=1), "cpu", max_models=2)
    try:
        models.release(models.acquire("random:tiny"))
        b = models.acquire("digits")
        gone = weakref.ref(b.client.engine.model.denoiser)
        models.release(b)
        del b
        models.max_models = 1
        models.release(models.acquire("random:tiny"))  # over the bound: the idle "digits" goes, on another thread
        assert models.wait_settled(600)
        gc.collect()
        assert gone() is None and [r.name for r in models.resident()] == ["random:tiny"]
    finally:
        models.close()


def test_a_model_asked_for_while_the_engine_process_is_away_is_a_retryable_503(tmp_path):
    """The set lives in the engine's process: while that process is not there (starting, restarting after a crash),
    a request for another model is a 503 to retry, not a 500."""
    import asyncio

    from diffgraph.engine.remote_models import RemoteModels
    from diffgraph.server.models import ModelRouting, Target
    from diffgraph.api.protocol import APIError

    shutil.copytree(shipped_preset_folder("digits"), tmp_path / "other")
    routing = ModelRouting(str(tmp_path), "random:tiny", RemoteModels())  # no replica yet
    default = Target(None, None, None)
    assert asyncio.run(routing.target(None, 10.0, default)) is default
    with pytest.raises(APIError) as e:
        asyncio.run(routing.target("other", 10.0, default))
    assert e.value.status == 503 and "the engine process is starting; retry shortly" in str(e.value)
    assert [(m["id"], m["resident"]) for m in routing.listing(0)] == [("random:tiny", False), ("other", False)]


def test_a_model_dir_over_two_replica_processes(model_dir):
    """--devices with --model-dir: each replica holds a set of its own; a folder's model is loaded where it is asked
    for first and its requests go there (images equal to the model alone); the listing sums the replicas."""
    s = ServerProcess("--devices", "cpu,cpu", "--model-dir", str(model_dir), "--max-models", "2",
                      "--request-timeout", "600", "--torch-threads", "1")
    try:
        s.wait_ready()
        deadline = time.monotonic() + 600  # a failure bound: the second replica may still be loading
        while not all(r["state"] == "ready" for r in httpx.get(s.url + "/ready", timeout=60).json()["replicas"]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with _threads(1), Engine("digits", device="cpu") as solo:
            alone = np.asarray(solo.generate(PROMPT, seed=5, num_inference_steps=4)[0])
        assert np.array_equal(_pixels(_generate(s.url, model="sd/digits-copy")), alone)
        once = _models(s.url)["sd/digits-copy"]["memory_bytes"]
        assert np.array_equal(_pixels(_generate(s.url, model="sd/digits-copy")), alone)
        models = _models(s.url)  # the second went where the first loaded it: one copy's bytes, not two
        assert models["sd/digits-copy"]["resident"] and models["sd/digits-copy"]["memory_bytes"] == once > 0
        assert models["random:tiny"]["resident"] and models["random:tiny"]["memory_bytes"] > 0
        states = httpx.get(s.url + "/ready", timeout=60).json()["replicas"]
        assert [r["state"] for r in states] == ["ready", "ready"]
        _a_held_models_requests_count_like_the_defaults(s.url)
    finally:
        s.stop(timeout=60)


def _steps(url: str) -> float:
    line = next(x for x in httpx.get(url + "/metrics", timeout=60).text.splitlines()
                if x.startswith("diffgraph_step_seconds_count"))
    return float(line.split()[-1])


def _a_held_models_requests_count_like_the_defaults(url: str) -> None:
    """A folder model's requests are its replica's work as the router counts it (in flight on /ready), its steps
    are in the step metrics, /status has a row per resident model and replica, /v1/loras?model= lists for it."""
    before = _steps(url)
    with httpx.stream("POST", url + "/v1/images/generations", timeout=600,
                      json={"prompt": PROMPT, "seed": 5, "num_inference_steps": 200, "model": "sd/digits-copy",
                            "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith(": progress "))  # it runs
        in_flight = [x["in_flight"] for x in httpx.get(url + "/ready", timeout=60).json()["replicas"]]
        rows = httpx.get(url + "/status", timeout=60).json()["models"]
        for _ in lines:
            pass
    assert sorted(in_flight) == [0, 1], in_flight
    assert _steps(url) - before >= 200  # its steps reached the server's step metrics
    mine = [row for row in rows if row["model"] == "sd/digits-copy"]
    assert len(mine) == 1 and mine[0]["in_flight"] == 1 and mine[0]["memory_bytes"] > 0, rows
    assert {row["model"] for row in rows} == {"random:tiny", "sd/digits-copy"}
    assert [row["in_flight"] for row in rows if row["model"] == "random:tiny"] == [0, 0]  # the default, on both
    listing = httpx.get(url + "/v1/loras", params={"model": "sd/digits-copy"}, timeout=60)
    assert listing.status_code == 200 and listing.json()["object"] == "list", listing.text
    unknown = httpx.get(url + "/v1/loras", params={"model": "nope"}, timeout=60)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_comfyuis_models_folder_over_http_lists_checkpoints_and_split_models(tmp_path):
    """`--model-dir` on ComfyUI's models folder: GET /v1/models lists its checkpoints as any file and a split diffusion
    model with its companion files (relative names) and why it cannot serve yet; the A1111 titles keep what serves."""
    from fastapi.testclient import TestClient

    from diffgraph.engine.remote_models import RemoteModels
    from diffgraph.server import ServerConfig, create_app
    from test_split_files import FLUX_VAE, QWEN3_4B, ZIMAGE, header_file

    _checkpoint(tmp_path / "checkpoints" / "sd15.safetensors", 0.0)
    header_file(tmp_path / "diffusion_models" / "z.safetensors", ZIMAGE)
    header_file(tmp_path / "text_encoders" / "qwen_3_4b.safetensors", QWEN3_4B)
    header_file(tmp_path / "vae" / "ae.safetensors", FLUX_VAE)
    http = TestClient(create_app(ServerConfig(model="random:tiny", model_dir=str(tmp_path), device="cpu"),
                                 engine_factory=lambda: None, models=RemoteModels()), raise_server_exceptions=False)
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert list(cards) == ["random:tiny", "checkpoints/sd15", "diffusion_models/z"]
    assert (cards["checkpoints/sd15"]["family"], cards["checkpoints/sd15"]["error"]) == ("sd", None)
    z = cards["diffusion_models/z"]
    assert z["files"] == {"text_encoder": "text_encoders/qwen_3_4b.safetensors", "vae": "vae/ae.safetensors"}
    assert (z["kind"], z["error_kind"], z["hash"], z["error"]) == ("z-image", None, None, None)  # the family reads it
    assert cards["checkpoints/sd15"]["files"] is None
    assert [m["filename"] for m in http.get("/sdapi/v1/sd-models").json()] == ["random:tiny", "checkpoints/sd15",
                                                                             "diffusion_models/z"]


def test_the_listing_never_waits_for_a_hash_and_shows_it_once_known(tmp_path):
    import hashlib

    from diffgraph.engine.remote_models import RemoteModels
    from diffgraph.models.file_hashes import FileHashes
    from diffgraph.server.models import ModelRouting
    from test_file_hashes import BOUND_S, GatedReader

    _checkpoint(tmp_path / "m.safetensors", 0.0)
    reader = GatedReader()  # a hash that takes as long as the test says (a 7 GB file: a minute)
    routing = ModelRouting(str(tmp_path), "random:tiny", RemoteModels(),
                           hashes=FileHashes(str(tmp_path / "cache"), read=reader))
    assert {c["id"]: c["hash"] for c in routing.listing(0)}["m"] is None
    assert reader.started.wait(BOUND_S)
    assert {c["id"]: c["hash"] for c in routing.listing(0)}["m"] is None  # answered while the hash is under way
    reader.gate.set()
    assert routing.hashes.wait_idle(BOUND_S)
    digest = hashlib.sha256((tmp_path / "m.safetensors").read_bytes()).hexdigest()[:10]
    assert {c["id"]: c["hash"] for c in routing.listing(0)}["m"] == digest
    assert len(reader.calls) == 1


# == serving many models: hashes of replaced files, waits for a load, the memory budget before a load ============
BOUND_S = 20.0  # a failure bound, never a wait the test relies on


def _join_hashing() -> None:
    for t in threading.enumerate():
        if t.name == "diffgraph-hash":
            t.join(BOUND_S)
            assert not t.is_alive()


def test_the_listed_hash_follows_a_file_replaced_under_its_name(tmp_path, monkeypatch):
    monkeypatch.setattr(server_models, "default_cache_root", lambda: str(tmp_path / "cache"))
    root = tmp_path / "models"
    _checkpoint(root / "m.safetensors", 0.0)
    routing = ModelRouting(str(root), "random:tiny", RemoteModels())

    def listed_hash() -> str | None:
        routing.listing(0)  # starts the hashing of what is not hashed yet
        _join_hashing()
        return {c["id"]: c["hash"] for c in routing.listing(0)}["m"]
    first = listed_hash()
    assert first is not None and len(first) == 10
    _checkpoint(root / "m.safetensors", 1.0)  # another model under the same name
    second = listed_hash()
    assert second is not None and second != first, "the listing still shows the replaced file's hash"


class _SlowLoads:
    """A models backend whose loads wait for `gate` (a model that takes minutes to load)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.entered = 0
        self.released: list[int] = []
        self.errors: dict[str, str] = {}

    def acquire(self, name: str, timeout: float | None = None) -> RemoteResident:
        with self.lock:
            self.entered += 1
            hold = self.entered
        assert self.gate.wait(BOUND_S)
        return RemoteResident(name, ModelClient(None, None, None, hold), 1)

    def release(self, resident: RemoteResident) -> None:
        with self.lock:
            self.released.append(resident.client.hold)

    def resident(self) -> list[RemoteResident]:
        return []

    def loading(self) -> list[str]:
        return [] if self.gate.is_set() else ["other"]

    def close(self) -> None:
        pass


async def _until(condition) -> None:
    for _ in range(int(BOUND_S * 100)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reached within the failure bound")


def test_requests_waiting_for_a_load_leave_the_worker_threads_to_other_requests(tmp_path):
    """Requests for a model that is loading wait for it; the default executor's few threads (every other request's
    listings, file reads and image encodes) must stay free meanwhile."""
    _checkpoint(tmp_path / "other.safetensors", 0.0)
    backend = _SlowLoads()
    routing = ModelRouting(str(tmp_path), "random:tiny", backend)
    default = Target(None, None, None)

    async def main() -> None:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(4))  # a small machine's count
        waiting = [asyncio.create_task(routing.target("other", 600.0, default)) for _ in range(8)]
        try:
            await _until(lambda: backend.entered >= 4)
            cards = await asyncio.wait_for(asyncio.to_thread(routing.listing, 0), BOUND_S)  # another request's
            assert {c["id"]: c["loading"] for c in cards}["other"]
        finally:
            backend.gate.set()
        targets = await asyncio.gather(*waiting)
        assert sorted(t.hold.client.hold for t in targets) == list(range(1, 9))
    asyncio.run(main())


def test_a_request_gone_while_its_model_loads_releases_its_hold(tmp_path):
    _checkpoint(tmp_path / "other.safetensors", 0.0)
    backend = _SlowLoads()
    routing = ModelRouting(str(tmp_path), "random:tiny", backend)

    async def main() -> None:
        task = asyncio.create_task(routing.target("other", 600.0, Target(None, None, None)))
        await _until(lambda: backend.entered == 1)
        task.cancel()
        backend.gate.set()
        await asyncio.gather(task, return_exceptions=True)
        await _until(lambda: backend.released == [1])  # else the model stays held (never evictable) for good
    asyncio.run(main())


def test_a_set_over_its_memory_budget_evicts_idle_models_before_the_next_load():
    """A busy model stays past the budget; once it is idle, the next load makes room first (before the build takes
    the device's memory), not only after it."""
    from diffgraph.engine.model_set import ModelSet

    seen: dict[str, list[str]] = {}

    def build(name, loop):
        seen[name] = sorted(r.name for r in models.resident())
        return Engine(name, device="cpu", loop=loop, image_threads=1)
    models = ModelSet(build, "cpu", max_models=8, memory_bytes=1)
    try:
        a = models.acquire("random:tiny")
        engine = a.client.engine
        gate = threading.Event()
        engine.core.call_between_steps(gate.wait)  # a's request stays queued: a is busy
        future = engine.submit(engine.make_request("x", num_inference_steps=2, seed=1))
        models.release(a)
        models.release(models.acquire("digits"))
        assert sorted(r.name for r in models.resident()) == ["digits", "random:tiny"]  # over the budget: a is busy
        gate.set()
        future.result(timeout=600)
        models.release(models.acquire("digits-xl"))
        assert seen["digits-xl"] == [], "the idle models over the budget were still resident during the load"
        assert [r.name for r in models.resident()] == ["digits-xl"]
    finally:
        models.close()


def test_a_busy_model_kept_over_the_memory_budget_goes_once_idle():
    """As with max-models: a model kept past the budget while busy is evicted on a later acquire once it is idle,
    not left holding its memory until some other model loads."""
    from diffgraph.engine.model_set import ModelSet

    models = ModelSet(lambda name, loop: Engine(name, device="cpu", loop=loop, image_threads=1), "cpu",
                      max_models=8, memory_bytes=1)
    try:
        a = models.acquire("random:tiny")
        engine = a.client.engine
        gate = threading.Event()
        engine.core.call_between_steps(gate.wait)
        future = engine.submit(engine.make_request("x", num_inference_steps=2, seed=1))
        models.release(a)
        models.release(models.acquire("digits"))
        assert sorted(r.name for r in models.resident()) == ["digits", "random:tiny"]
        gate.set()
        future.result(timeout=600)
        models.release(models.acquire("digits"))  # resident: no load, but the set is over its budget
        for t in threading.enumerate():
            if t.name == "diffgraph-trim":
                t.join(BOUND_S)
        assert [r.name for r in models.resident()] == ["digits"]
    finally:
        models.close()


def test_a_preload_that_cannot_load_is_listed_with_its_error_and_the_default_still_serves(tmp_path):
    """`--preload` of a model whose weights are cut short (or a name not in the folder) failed the replica's whole
    start: it was restarted and left down, so the server never became ready because of an optional model."""
    import shutil

    from diffgraph.engine.held_models import HeldModels
    from diffgraph.engine.remote_models import ModelSetSpec
    from diffgraph.models.presets import shipped_preset_folder
    shutil.copytree(shipped_preset_folder("digits"), tmp_path / "digits")
    shutil.copytree(shipped_preset_folder("digits"), tmp_path / "broken")
    unet = tmp_path / "broken" / "unet" / "diffusion_pytorch_model.safetensors"
    unet.write_bytes(unet.read_bytes()[:4096])
    held = HeldModels(ModelSetSpec(str(tmp_path), "digits", preload=("broken", "nope")), "cpu", {})
    try:
        assert held.default.generate("a digit", num_inference_steps=1, seed=0).arrays.shape[0] == 1
        assert "broken" in held.set.errors and "nope" in held.set.errors
        assert "not in the model folder" in held.set.errors["nope"]
        assert [name for name, *_ in held.view().resident] == ["digits"]
    finally:
        held.close()


def test_a_model_just_loaded_is_not_evicted_by_the_next_load_before_its_waiting_request_holds_it(monkeypatch):
    """max-models 1, two models asked for at once: the second load, queued behind the first, made room by evicting
    the first model the moment it was built, before the request waiting for it had taken its hold: that request
    then loaded it again (and could evict the second one the same way)."""
    from diffgraph.engine import model_set

    builds: list[str] = []
    second_built = threading.Event()

    class LateWaiter(model_set.Future):  # the request waiting for the first load comes back after the second began
        def result(self, timeout=None):
            out = super().result(timeout)
            if threading.current_thread().name == "acquire-first":
                assert second_built.wait(BOUND_S)
            return out
    monkeypatch.setattr(model_set, "Future", LateWaiter)
    got: dict[str, object] = {}

    def build(name, loop):
        builds.append(name)
        if name == "digits":
            second_built.set()
        elif builds.count("random:tiny") == 1:  # the second model is asked for while the first builds
            threading.Thread(target=lambda: got.update(second=models.acquire("digits", BOUND_S)),
                             name="acquire-second", daemon=True).start()
            for _ in range(int(BOUND_S / 0.01)):  # (a failure bound: its load queues behind this one at once)
                if "digits" in models.loading():
                    break
                threading.Event().wait(0.01)
        return Engine(name, device="cpu", loop=loop, image_threads=1)
    models = model_set.ModelSet(build, "cpu", max_models=1)
    try:
        first = threading.Thread(target=lambda: got.update(first=models.acquire("random:tiny", BOUND_S * 3)),
                                 name="acquire-first")
        first.start()
        first.join(BOUND_S * 6)
        assert not first.is_alive() and "first" in got
        for t in threading.enumerate():
            if t.name == "acquire-second":
                t.join(BOUND_S * 3)
        assert builds == ["random:tiny", "digits"]  # each model built once
        assert got["first"].client.ready and got["first"].holds == 1
        assert sorted(r.name for r in models.resident()) == ["digits", "random:tiny"]  # held both: over the count
    finally:
        models.close()


def test_a_resident_model_whose_engine_failed_is_closed_before_it_loads_again():
    """A resident model whose engine stopped (not ready) is loaded again by the next request; the failed engine was
    left open beside the new one under the same name, its weights and graphs never given back."""
    from diffgraph.engine import model_set

    built: list = []

    def build(name, loop):
        built.append(Engine(name, device="cpu", loop=loop, image_threads=1))
        return built[-1]
    models = model_set.ModelSet(build, "cpu", max_models=2)
    try:
        first = models.acquire("random:tiny", BOUND_S)
        models.release(first)
        first.client.core._live = lambda: False  # its loop stopped: the state a device failure leaves
        assert not first.client.ready
        again = models.acquire("random:tiny", BOUND_S)
        assert again is not first and again.client.ready and len(built) == 2
        assert first.client.state == "closed"  # closed (was "failed": open, holding its memory)
        assert [r.name for r in models.resident()] == ["random:tiny"]
        models.release(again)
    finally:
        models.close()


# == faults: files that go between the listing and a stat or hash, failed loads, --model inside --model-dir =======
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
