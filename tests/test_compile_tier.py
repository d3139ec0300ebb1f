"""The compile tier on the CPU (issue 13, first part), with torch.compile's light `aot_eager` backend: compiled steps
equal uncompiled ones in eager and (emulated) graph mode, weights changed in place reach compiled code without a
recompile, a backend that fails falls back visibly (log, stat, metric) with the same images, and the cache folder
is keyed by what compiled code depends on."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from diffgraph import Engine
from diffgraph.config import CompileConfig, GraphConfig

PROMPT = "a red fox"


@pytest.fixture(autouse=True)
def _own_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # restored after each test


def _images(engine: Engine, **kw) -> np.ndarray:
    return np.concatenate([engine.generate(PROMPT, num_inference_steps=3, seed=s, **kw).arrays for s in (1, 2)])


def test_compiled_steps_equal_uncompiled_and_follow_weights(tiny_engine, tmp_path):
    torch._dynamo.reset()
    config = CompileConfig(backend="aot_eager", cache_dir=str(tmp_path))
    with Engine("random:tiny", device="cpu", dtype="fp32", compile=config) as compiled:
        np.testing.assert_allclose(_images(compiled), _images(tiny_engine), atol=1e-5)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        weight = compiled.model.unet.conv_in.weight
        with torch.no_grad():
            weight.mul_(1.5)  # in place, as a LoRA slot or a fused adapter is written
        changed = _images(compiled)
        shared = tiny_engine.model.unet.conv_in.weight
        original = shared.detach().clone()
        with torch.no_grad():
            shared.mul_(1.5)
        try:
            np.testing.assert_allclose(changed, _images(tiny_engine), atol=1e-5)
        finally:
            with torch.no_grad():
                shared.copy_(original)  # exactly as it was: other tests share this engine
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # no recompile
        assert compiled.stats["compile_fallbacks"] == 0
    assert list(tmp_path.iterdir()), "no cache folder was made"


def test_graph_mode_captures_compiled_callables(tiny_engine, tmp_path):
    torch._dynamo.reset()
    cfg = GraphConfig(batch_buckets=(1, 2), resolutions=((64, 64),), backend="emulated")
    with Engine("random:tiny", device="cpu", dtype="fp32", mode="graph", graphs=cfg,
                compile=CompileConfig(backend="aot_eager", cache_dir=str(tmp_path))) as compiled:
        names = {c.name for c in compiled.runner.compiled}
        assert {"the whole step", "the text encoder", "the VAE decoder"} <= names
        assert all(r["status"] == "captured" for r in compiled.graph_table())
        np.testing.assert_allclose(_images(compiled), _images(tiny_engine), atol=1e-5)
        by_name = {c.name: c for c in compiled.runner.compiled}
        assert by_name["the whole step"].failed is None and by_name["the text encoder"].failed is None
        # aot_eager on the CPU cannot run the VAE's group norm on the non-contiguous output of its attention (a
        # torch limitation of that backend there): those kinds fall back, visibly, and the images are unchanged
        failed = [c for c in compiled.runner.compiled if c.failed]
        assert all("VAE" in c.name for c in failed)
        assert compiled.stats["compile_fallbacks"] == len(failed)


def test_a_failing_backend_falls_back_visibly(tiny_engine, tmp_path, caplog):
    from torch._dynamo import register_backend

    @register_backend(name="diffgraph_test_broken")
    def broken(gm, example_inputs):
        raise RuntimeError("this backend cannot compile anything")

    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="diffgraph.graphs.compiled"):
        with Engine("random:tiny", device="cpu", dtype="fp32",
                    compile=CompileConfig(backend="diffgraph_test_broken", cache_dir=str(tmp_path))) as engine:
            np.testing.assert_allclose(_images(engine), _images(tiny_engine), atol=1e-5)
            assert engine.stats["compile_fallbacks"] == 1
            assert "cannot compile anything" in engine.runner.compiled[0].failed
    assert any("runs uncompiled from now on" in r.getMessage() for r in caplog.records)


def test_cache_folder_is_keyed_by_what_compiled_code_depends_on(tiny_engine, tiny_xl_engine, tmp_path):
    from diffgraph.graphs.compiled import cache_dir, cache_key, use_cache_dir

    cpu = torch.device("cpu")
    key = cache_key(tiny_engine.model, cpu)
    assert key == cache_key(tiny_engine.model, cpu)  # stable
    assert key != cache_key(tiny_xl_engine.model, cpu)  # another model config
    half = tiny_engine.model.__class__(**{**tiny_engine.model.__dict__, "dtype": torch.float16})
    assert key != cache_key(half, cpu)  # another dtype
    config = CompileConfig(cache_dir=str(tmp_path))
    folder = cache_dir(config, tiny_engine.model, cpu)
    assert folder.startswith(str(tmp_path)) and folder.endswith(key) and "tiny" in folder
    use_cache_dir(folder)
    import os
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == folder and os.path.isdir(folder)


def test_serve_and_generate_flags_reach_the_engine(tmp_path):
    from diffgraph.server.config import load_config

    config = load_config(None, {"model": "random:tiny", "compile": True, "compile_cache": str(tmp_path)})
    assert config.engine_kwargs()["compile"] == CompileConfig(cache_dir=str(tmp_path))
    assert load_config(None, {"model": "random:tiny"}).engine_kwargs()["compile"] is False
