"""Many models behind one server (issue 29, point 3): `--model-dir` serves every diffusers folder and checkpoint file
under it by name, each request picks one with `model`, models load on first use and the least recently used idle
one is evicted; a model with requests in flight never is."""

from __future__ import annotations

import base64
import contextlib
import io
import shutil
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from diffgraph import Engine
from diffgraph.config import default_cpu_threads
from diffgraph.models.presets import shipped_preset_folder
from diffgraph.server.process import ServerProcess

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
    from test_model_sets_review import _checkpoint
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
    from test_model_sets_review import _checkpoint

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
