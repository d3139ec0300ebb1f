"""The compile tier on the CPU (issue 13, first part), with torch.compile's light `aot_eager` backend: compiled steps
equal uncompiled ones in eager and (emulated) graph mode, weights changed in place reach compiled code without a
recompile, a backend that fails falls back visibly (log, stat, metric) with the same images, and the cache folder
is keyed by what compiled code depends on."""

from __future__ import annotations

import dataclasses
import logging
import os

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


def _follows_an_in_place_change(compiled: Engine, reference: Engine, atol: float) -> None:
    """conv_in's weight x1.5 in place in both engines (as a LoRA slot or a fused adapter is written): the compiled
    engine's images equal the reference's; the reference's weight is restored exactly (other tests share it)."""
    with torch.no_grad():
        compiled.model.denoiser.conv_in.weight.mul_(1.5)
    changed = _images(compiled)
    shared = reference.model.denoiser.conv_in.weight
    original = shared.detach().clone()
    with torch.no_grad():
        shared.mul_(1.5)
    try:
        np.testing.assert_allclose(changed, _images(reference), atol=atol)
    finally:
        with torch.no_grad():
            shared.copy_(original)


def test_compiled_steps_equal_uncompiled_and_follow_weights(tiny_engine, tmp_path):
    torch._dynamo.reset()
    config = CompileConfig(backend="aot_eager", cache_dir=str(tmp_path))
    with Engine("random:tiny", device="cpu", dtype="fp32", compile=config) as compiled:
        np.testing.assert_allclose(_images(compiled), _images(tiny_engine), atol=1e-5)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        _follows_an_in_place_change(compiled, tiny_engine, atol=1e-5)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # no recompile
        assert compiled.stats["compile_fallbacks"] == 0
    assert list(tmp_path.iterdir()), "no cache folder was made"


def test_graph_mode_compiles_every_version_before_ready_and_serves_them_uncompiled_equal(tiny_engine, tmp_path):
    """Graph mode captures compiled callables (the whole step, the text encoder, the VAE decoder), and with a partial
    prewarm everything serving would compile compiles at start-up instead: the batch dimension is dynamic (buckets 2
    and 4 share one version of the step, bucket 1 has its own), a version per resolution, and past Dynamo's recompile
    limit (8 by default; 2 here) nothing silently runs uncompiled: the engine raises the limit to the versions its
    step needs (2 resolutions x (bucket 1, the rest) = 4). Serving then only captures, each capture verified against
    the uncompiled step, and every bucket's images equal the uncompiled engine's. One engine for all of it: each
    compile of the tiny step costs the CPU run tens of seconds."""
    torch._dynamo.reset()
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64), (64, 96)), backend="emulated", verify=True,
                      prewarm=((64, 64, 2),))
    # the config's own patch (restored on exit); pytest's monkeypatch would delete the entry on undo
    with torch._dynamo.config.patch(recompile_limit=2), \
            Engine("random:tiny", device="cpu", dtype="fp32", mode="graph", graphs=cfg,
                   compile=CompileConfig(backend="aot_eager", cache_dir=str(tmp_path))) as compiled:
        by_name = {c.name: c for c in compiled.runner.compiled}
        assert {"the whole step", "the text encoder", "the VAE decoder"} <= set(by_name)
        before = {c.name: c.compiles for c in compiled.runner.compiled}
        assert before["the whole step"] == 4 and before["the text encoder"] == 2
        assert torch._dynamo.config.recompile_limit >= 4
        assert by_name["the whole step"].failed is None and by_name["the text encoder"].failed is None
        # aot_eager on the CPU cannot run the VAE's group norm on the non-contiguous output of its attention (a
        # torch limitation of that backend there): those kinds fall back, visibly, and the images are unchanged
        failed = [c for c in compiled.runner.compiled if c.failed]
        assert all("VAE" in c.name for c in failed)
        np.testing.assert_allclose(_images(compiled), _images(tiny_engine), atol=1e-5)  # 64x64, bucket 2
        # two guided images: 4 denoiser rows, bucket 4; one unguided: bucket 1; 64x96, bucket 2: not prewarmed
        for kw in ({"num_images": 2}, {"guidance_scale": 1.0}, {"width": 96, "height": 64}):
            np.testing.assert_allclose(_images(compiled, **kw), _images(tiny_engine, **kw), atol=1e-5, err_msg=str(kw))
        assert {c.name: c.compiles for c in compiled.runner.compiled} == before  # serving compiled nothing
        assert compiled.stats["compile_fallbacks"] == len(failed) and compiled.stats["compiles"] >= 6
        steps = {(r["height"], r["width"], r["bucket"]): r for r in compiled.graph_table() if r["kind"] == "step"}
        served = [(64, 64, 1), (64, 64, 2), (64, 64, 4), (64, 96, 2)]
        assert all(steps[k]["status"] == "captured" and steps[k]["verify_max_abs"] <= 1e-5 for k in served), steps
        assert [steps[k]["on_demand"] for k in served] == [1, 0, 1, 1]


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
    import os

    from diffgraph.graphs.compiled import cache_dir, cache_key, use_cache_dir

    cpu = torch.device("cpu")
    key = cache_key(tiny_engine.model, cpu)
    assert key == cache_key(tiny_engine.model, cpu)  # stable, and across processes (hash seeds: set orders)
    import subprocess
    import sys
    code = ("import torch; from diffgraph.models.loader import load_model; from diffgraph.graphs.compiled import "
            "cache_key; print(cache_key(load_model('random:tiny', device='cpu', dtype='fp32'), torch.device('cpu')))")
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"  # a hash seed other than this process's
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONHASHSEED": seed})
    assert done.stdout.strip().splitlines()[-1] == key, done.stderr[-1000:]
    assert key != cache_key(tiny_xl_engine.model, cpu)  # another model config
    half = dataclasses.replace(tiny_engine.model, dtype=torch.float16)
    assert key != cache_key(half, cpu)  # another dtype
    config = CompileConfig(cache_dir=str(tmp_path))
    folder = cache_dir(config, tiny_engine.model, cpu)
    assert folder.startswith(str(tmp_path)) and folder.endswith(key) and "tiny" in folder
    use_cache_dir(folder)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == folder and os.path.isdir(folder)


def test_the_cache_folder_follows_diffgraphs_own_source(tiny_engine, tmp_path, monkeypatch):
    """Precompiled code runs without Dynamo's guards: code traced from another diffgraph (an upgrade, an edit) must
    land in another folder."""
    from diffgraph.graphs import compiled

    package = tmp_path / "pkg"
    (package / "graphs").mkdir(parents=True)
    (package / "graphs" / "step.py").write_text("x = 1\n")
    (package / "notes.txt").write_text("not code")
    first = compiled.code_version(str(package))
    assert first == compiled.code_version(str(package)) and len(first) == 16
    (package / "notes.txt").write_text("still not code")
    assert compiled.code_version(str(package)) == first  # only .py files count
    (package / "graphs" / "step.py").write_text("x = 2\n")
    assert compiled.code_version(str(package)) != first
    (package / "graphs" / "step.py").write_text("x = 1\n")
    (package / "graphs" / "step.py").rename(package / "graphs" / "other.py")
    assert compiled.code_version(str(package)) != first  # the same bytes under another name
    assert compiled.code_version() == compiled.code_version()  # this package's: stable
    cpu = torch.device("cpu")
    key = compiled.cache_key(tiny_engine.model, cpu)
    monkeypatch.setattr(compiled, "code_version", lambda package=None: "another release")
    assert compiled.cache_key(tiny_engine.model, cpu) != key


def test_serve_and_generate_flags_reach_the_engine(tmp_path):
    from diffgraph.api.config import load_config

    config = load_config(None, {"model": "random:tiny", "compile": True, "compile_cache": str(tmp_path)})
    assert config.engine_kwargs()["compile"] == CompileConfig(cache_dir=str(tmp_path))
    assert load_config(None, {"model": "random:tiny"}).engine_kwargs()["compile"] is False


def test_a_call_that_would_compile_inside_a_capture_runs_uncompiled(monkeypatch):
    from diffgraph.graphs.compiled import Compiled

    torch._dynamo.reset()
    def fn(x):
        return x * 2

    c = Compiled(fn, CompileConfig(backend="aot_eager"), "toy", batch_of=lambda args: args[:1])
    torch.testing.assert_close(c(torch.ones(4, 3)), torch.full((4, 3), 2.0))  # compiled (traced once)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    torch.testing.assert_close(c(torch.ones(2, 3)), torch.full((2, 3), 2.0))  # same compiled code: guards hold
    assert c.fallbacks == 0
    torch.testing.assert_close(c(torch.ones(2, 5)), torch.full((2, 5), 2.0))  # would compile: runs fn instead
    assert c.fallbacks == 1 and c.failed is None and c.compiles == 1  # that call only: no lasting fallback
    torch.testing.assert_close(c(torch.ones(3, 3)), torch.full((3, 3), 2.0))
    assert c.fallbacks == 1


def test_compiled_code_failing_inside_a_capture_fails_that_capture(monkeypatch):
    """Compiled code that raises while it runs inside a capture (after launching work) must not be papered over with
    the uncompiled function in the same capture: the error reaches the graph runner, which runs that key eagerly."""
    from torch._dynamo import register_backend

    from diffgraph.graphs.compiled import Compiled

    broken = {"now": False}

    @register_backend(name="diffgraph_test_fails_at_run")
    def fails_at_run(gm, example_inputs):
        def run(*args):
            if broken["now"]:
                raise RuntimeError("a kernel failed")
            return gm(*args)
        return run

    torch._dynamo.reset()
    c = Compiled(lambda x: x * 2, CompileConfig(backend="diffgraph_test_fails_at_run"), "toy")
    torch.testing.assert_close(c(torch.ones(2)), torch.full((2,), 2.0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    broken["now"] = True
    with pytest.raises(RuntimeError, match="a kernel failed"):
        c(torch.ones(2))
    assert c.fallbacks == 0 and c.failed is None


_TOY = """
import json, sys, torch
from diffgraph.config import CompileConfig
from diffgraph.graphs.compiled import Compiled, load_artifacts, save_artifacts_if_new, use_cache_dir
use_cache_dir(sys.argv[1])
loaded = load_artifacts(sys.argv[1])
def toy(x, w):
    return torch.nn.functional.gelu(x @ w).sum(dim=1)
c = Compiled(toy, CompileConfig(precompile=sys.argv[2] == "pre"), "toy", lambda a: a[:1], folder=sys.argv[1])
w = torch.linspace(-1, 1, 64).reshape(8, 8)
out = [c(torch.linspace(0, 1, 8 * n).reshape(n, 8), w).tolist() for n in (4, 2)]
saved = save_artifacts_if_new(sys.argv[1])
from torch._dynamo.utils import counters
print(json.dumps({"loaded": loaded, "saved": saved, "out": out, "fallbacks": c.fallbacks, "compiles": c.compiles,
                  "versions_loaded": c.loaded,
                  "hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def _toy_run(folder, mode: str) -> dict:
    import json
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _TOY, str(folder), mode], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_copied_cache_folder_starts_warm_in_a_fresh_process(tmp_path):
    """Inductor (CPU) on a toy function, without precompiled versions: the first process compiles and saves the
    artifacts; a fresh process on a copy of the folder elsewhere compiles nothing (every graph a cache hit) and gets
    the same values."""
    import shutil

    first = _toy_run(tmp_path / "a", "traced")
    assert first["misses"] == 1 and first["hits"] == 0 and first["saved"] > 0 and first["fallbacks"] == 0
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere" / "b")
    second = _toy_run(tmp_path / "elsewhere" / "b", "traced")
    assert second["loaded"] == first["saved"] and second["misses"] == 0 and second["hits"] == 1
    assert second["saved"] == 0  # a warm start rewrites nothing
    assert second["out"] == first["out"]


def test_a_copied_folder_of_precompiled_versions_loads_them_in_a_fresh_process(tmp_path):
    """The same toy with precompiled versions: the first process compiles two (a batch of 4, which serves every
    batch above 1, and the batch of 2 reuses it: one version; nothing else), saved as files; a fresh process on a
    copy elsewhere loads that version, traces and compiles nothing, and gets the same values."""
    import shutil

    from diffgraph.graphs.compiled import precompile_available

    if not precompile_available():
        pytest.skip("this torch has no torch.compiler.load_compiled_function (2.10+)")
    first = _toy_run(tmp_path / "a", "pre")
    assert (first["compiles"], first["versions_loaded"], first["fallbacks"]) == (1, 0, 0)
    assert len(list((tmp_path / "a" / "precompiled").iterdir())) == 1
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere" / "b")
    second = _toy_run(tmp_path / "elsewhere" / "b", "pre")
    assert (second["compiles"], second["versions_loaded"], second["misses"], second["hits"]) == (0, 1, 0, 0)
    assert second["out"] == first["out"]


def test_verification_compares_replays_with_the_uncompiled_function(tmp_path):
    """A backend whose code is off by 1e-3: the verification figure of the text graph shows that 1e-3 (the replay
    holds the compiled code, the reference is the uncompiled encoder), so `verify_max_abs` measures the compile."""
    from torch._dynamo import register_backend

    @register_backend(name="diffgraph_test_offset")
    def offset(gm, example_inputs):
        def run(*args):
            out = gm(*args)
            return type(out)(o + 1e-3 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out)
        return run

    torch._dynamo.reset()
    cfg = GraphConfig(batch_buckets=(1,), resolutions=((64, 64),), backend="emulated", verify=True,
                      capture_vae=False)
    with Engine("random:tiny", device="cpu", dtype="fp32", mode="graph", graphs=cfg,
                compile=CompileConfig(backend="diffgraph_test_offset", cache_dir=str(tmp_path))) as compiled:
        text = next(r for r in compiled.graph_table() if r["kind"] == "text")
        assert text["verify_max_abs"] == pytest.approx(1e-3, rel=1e-2)


def test_precompiled_steps_load_without_compiling_and_equal_uncompiled(tiny_engine, tmp_path):
    """Inductor (CPU) with precompiled versions: the first engine compiles the whole step once (at bucket 2, captured
    first; bucket 1 runs that version too) and saves it as one file; a second engine on the folder loads it and
    compiles nothing; both give the uncompiled images, and an in-place weight change reaches the loaded code. (A
    fresh process on a copy: the toy test below.)"""
    from diffgraph.graphs.compiled import precompile_available

    if not precompile_available():
        pytest.skip("this torch has no torch.compiler.load_compiled_function (2.10+): no precompiled versions")
    torch._dynamo.reset()
    cfg = GraphConfig(batch_buckets=(1, 2), resolutions=((64, 64),), backend="emulated", verify=True,
                      capture_vae=False, capture_text_encoder=False)
    config = CompileConfig(cache_dir=str(tmp_path))
    for run in ("cold", "warm"):
        with Engine("random:tiny", device="cpu", dtype="fp32", mode="graph", graphs=cfg, compile=config) as engine:
            step = next(c for c in engine.runner.compiled if c.name == "the whole step")
            assert (step.compiles, step.loaded) == ((1, 0) if run == "cold" else (0, 1)), run
            rows = [r for r in engine.graph_table() if r["kind"] == "step"]
            assert len(rows) == 2 and all(r["status"] == "captured" and r["verify_max_abs"] <= 1e-4 for r in rows)
            np.testing.assert_allclose(_images(engine), _images(tiny_engine), atol=2e-4)
            assert engine.stats["compile_fallbacks"] == 0
            if run == "warm":
                _follows_an_in_place_change(engine, tiny_engine, atol=2e-4)
                assert step.compiles == 0
    files = list((next(tmp_path.iterdir()) / "precompiled").iterdir())
    assert len(files) == 1 and files[0].name.startswith("the-whole-step-")


def test_precompiled_versions_are_picked_by_signature_and_never_compiled_in_a_capture(monkeypatch, tmp_path):
    """A version per signature (the batch dimension as 1 or any above 1; a batch of 1 runs the dynamic batch's version
    where there is one); shapes first met inside a capture run the uncompiled function (counted), and nothing is
    compiled there."""
    from diffgraph.graphs.compiled import Compiled, precompile_available

    if not precompile_available():
        pytest.skip("this torch has no torch.compiler.load_compiled_function (2.10+)")
    class Owner:  # a bound method over an object that holds a module, as the VAE decoder's is
        def __init__(self):
            self.scale = torch.nn.Linear(1, 1, bias=False)
            torch.nn.init.constant_(self.scale.weight, 2.0)

        def run(self, x):
            return self.scale(x.unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        c = Compiled(Owner().run, CompileConfig(), "toy", batch_of=lambda args: args[:1], folder=str(tmp_path))
        torch.testing.assert_close(c(torch.ones(4, 3)), torch.full((4, 3), 2.0))
        again = Compiled(Owner().run, CompileConfig(), "toy", batch_of=lambda args: args[:1], folder=str(tmp_path))
        torch.testing.assert_close(again(torch.ones(5, 3)), torch.full((5, 3), 2.0))  # the saved version, loaded
    assert (again.compiles, again.loaded) == (0, 1)
    c = Compiled(lambda x: x * 2, CompileConfig(), "toy2", batch_of=lambda args: args[:1], folder=str(tmp_path))
    torch.testing.assert_close(c(torch.ones(4, 3)), torch.full((4, 3), 2.0))
    torch.testing.assert_close(c(torch.ones(2, 3)), torch.full((2, 3), 2.0))  # the same version
    torch.testing.assert_close(c(torch.ones(1, 3)), torch.full((1, 3), 2.0))  # a batch of 1 runs it too
    assert (c.compiles, c.fallbacks) == (1, 0)
    first_one = Compiled(lambda x: x * 3, CompileConfig(), "toy3", batch_of=lambda args: args[:1],
                         folder=str(tmp_path))
    torch.testing.assert_close(first_one(torch.ones(1, 3)), torch.full((1, 3), 3.0))  # met first: its own version
    torch.testing.assert_close(first_one(torch.ones(4, 3)), torch.full((4, 3), 3.0))  # the dynamic batch's
    torch.testing.assert_close(first_one(torch.ones(1, 3)), torch.full((1, 3), 3.0))  # now that one
    assert first_one.compiles == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    torch.testing.assert_close(c(torch.ones(3, 3)), torch.full((3, 3), 2.0))  # known: runs the precompiled code
    torch.testing.assert_close(c(torch.ones(2, 5)), torch.full((2, 5), 2.0))  # new: the uncompiled function
    assert (c.compiles, c.fallbacks, c.failed) == (1, 1, None)


def test_layout_defaults_and_conv_layout_keep_the_parameters(tiny_engine):
    from diffgraph.engine.graph_setup import layout, set_conv_layout

    sd = tiny_engine.model.adapter
    assert layout(CompileConfig(), sd) == sd.compile_layout == (True, "auto")  # cuDNN attention: batch-variant
    assert layout(CompileConfig(channels_last=False, attention="cudnn"), sd) == (False, "cudnn")
    with pytest.raises(ValueError, match="not an attention backend"):
        CompileConfig(attention="fast")
    from diffgraph.engine.graph_setup import attention_first
    q = torch.randn(1, 2, 4, 8)
    for _ in range(2):  # a factory: a fresh context each call (the math backend runs anywhere)
        with attention_first("math")():
            torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(q, q, q),
                                       torch.softmax(q @ q.transpose(-1, -2) / 8 ** 0.5, -1) @ q)
    conv = torch.nn.Conv2d(4, 8, 3)
    weight, before = conv.weight, conv.weight.detach().clone()
    set_conv_layout(conv, channels_last=True)
    assert conv.weight is weight and weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(weight.detach(), before)
    set_conv_layout(conv, channels_last=False)
    assert weight.is_contiguous()


def test_inductor_options_reach_inductor_only_and_name_the_version():
    from diffgraph.engine.graph_setup import STEP_OPTIONS, VAE_OPTIONS
    from diffgraph.graphs.compiled import Compiled

    def fn(x):
        return x + 1

    assert STEP_OPTIONS == {"force_layout_optimization": True}  # what the step's compile asks of Inductor
    assert VAE_OPTIONS == STEP_OPTIONS  # and a 16-bit VAE decoder's (channels-last activations, session 30)
    inductor = Compiled(fn, CompileConfig(), "f", options=STEP_OPTIONS)
    assert inductor.options == {"triton.cudagraphs": False, "force_layout_optimization": True}
    assert Compiled(fn, CompileConfig(), "f").options == {"triton.cudagraphs": False}
    assert Compiled(fn, CompileConfig(backend="aot_eager"), "f", options=STEP_OPTIONS).options is None


def test_precompiled_files_are_written_to_a_temporary_name_and_renamed(tmp_path, monkeypatch):
    """Replicas sharing a cache folder never read a half-written precompiled file (issue 28 point 5): the save goes
    to a temporary name of this process and thread, then one rename; a failed save leaves neither file."""
    from diffgraph.graphs.compiled import write_atomically
    path = str(tmp_path / "step-abc.bin")
    seen = []

    def save(tmp):
        assert tmp != path and os.path.dirname(tmp) == str(tmp_path) and not os.path.exists(path)
        with open(tmp, "wb") as f:
            f.write(b"version")
        seen.append(tmp)

    renames = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renames.append((a, b)), real(a, b)))
    write_atomically(save, path)
    assert renames == [(seen[0], path)] and open(path, "rb").read() == b"version"

    def broken(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomically(broken, str(tmp_path / "other.bin"))
    assert sorted(os.listdir(tmp_path)) == ["step-abc.bin"]


def test_sdxl_text_encoders_precompile_and_a_warm_start_loads_them(tmp_path):
    """SDXL's encoders ask for hidden states, and transformers installs its output-capturing hooks at a model's
    first such call under a threading lock Dynamo cannot trace: the precompile failed ("Unsupported context
    manager") and every start traced the encoders again. Now the engine installs them before compiling: the first
    engine precompiles the text encoder (no fallback to Dynamo's guards), a second loads it and compiles nothing."""
    from diffgraph.graphs.compiled import precompile_available

    if not precompile_available():
        pytest.skip("this torch has no torch.compiler.load_compiled_function (2.10+): no precompiled versions")
    torch._dynamo.reset()
    cfg = GraphConfig(batch_buckets=(1,), resolutions=((64, 64),), backend="emulated", capture_vae=False)
    config = CompileConfig(cache_dir=str(tmp_path))
    for run in ("cold", "warm"):
        with Engine("random:tiny-xl", device="cpu", dtype="fp32", mode="graph", graphs=cfg, compile=config) as engine:
            text = next(c for c in engine.runner.compiled if c.name == "the text encoder")
            engine.generate("a cat", seed=0, num_inference_steps=1, guidance_scale=1.0)
            assert text.precompile_dir is not None, "precompiling the text encoder fell back to Dynamo's guards"
            assert (text.compiles, text.loaded) == ((1, 0) if run == "cold" else (0, 1)), run
