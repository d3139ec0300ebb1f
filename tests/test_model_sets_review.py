"""Review of serving many models (`--model-dir`): the listing's hashes follow replaced files, requests waiting for a
model load do not starve the server's shared worker threads (nor leak a hold when they go), and the memory budget
evicts idle models before a load, not only after it."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import save_file

from diffgraph import Engine
from diffgraph.engine.remote_models import ModelClient, RemoteModels, RemoteResident
from diffgraph.server import models as server_models
from diffgraph.server.models import ModelRouting, Target

BOUND_S = 20.0  # a failure bound, never a wait the test relies on


def _checkpoint(path, fill: float) -> None:
    """A few-byte safetensors file the catalog reads as an SD1 checkpoint (test_model_catalog.py's keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path) + ".tmp"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(1, 4, 1, 1, dtype=torch.float16),
               "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight": torch.zeros(1, 1),
               "first_stage_model.decoder.conv_in.weight": torch.full((1, 1), fill)}, tmp)
    os.replace(tmp, path)  # as a copy tool finishes: a new file under the old name


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
