"""LoRA adapters per request in the engine (issue 12): images equal diffusers' pipeline with load_lora_weights and
set_adapters (same files and scales, fp32, <= 1 uint8 level) for SD and SDXL, both file layouts, UNet and
text-encoder weights, one adapter and a stack of two; each case also shows the adapter changes the image. Requests
with different adapters (or none) batched together equal their solo runs; more distinct adapters than slots wait,
never fail; bad adapters are refused by name and affect nothing else; a replaced file takes effect for the next
request, and a removed adapter is gone."""

from __future__ import annotations

import copy
import math
import os
import shutil
import threading

import numpy as np
import pytest
import torch

from diffgraph import Engine
from diffgraph.request import ParamError
from lora_util import _write_diffusers, _write_kohya

PROMPT = "a photo of a red fox in the snow"
STEPS = 4


def _uint8(arrays: np.ndarray) -> np.ndarray:
    return (arrays * 255).round().astype(np.int16)


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory, tiny_engine, tiny_xl_engine):
    """One adapter folder per family: `style` (diffusers layout, UNet and text encoders), `ink` (kohya layout with
    alphas; SDXL: UNet only, see lora_util), and `styles/sub` (another diffusers-layout file in a sub-folder)."""
    out = {}
    for family, engine in (("sd", tiny_engine), ("sdxl", tiny_xl_engine)):
        root = tmp_path_factory.mktemp(f"loras-{family}")
        _write_diffusers(engine, str(root / "style.safetensors"), rank=4, seed=0)
        _write_kohya(engine, str(root / "ink.safetensors"), rank=4, seed=10, alpha=2.0)
        os.makedirs(root / "styles")
        _write_diffusers(engine, str(root / "styles" / "sub.safetensors"), rank=8, seed=20)
        out[family] = str(root)
    return out


@pytest.fixture(scope="module")
def lora_engine(lora_dirs):
    with Engine("random:tiny", device="cpu", dtype="fp32", lora_dir=lora_dirs["sd"], max_loras=4,
                max_lora_rank=8) as engine:
        yield engine


@pytest.fixture(scope="module")
def lora_xl_engine(lora_dirs):
    with Engine("random:tiny-xl", device="cpu", dtype="fp32", lora_dir=lora_dirs["sdxl"], max_loras=4,
                max_lora_rank=8) as engine:
        yield engine


def _diffusers_image(base: Engine, folder: str, stack: list[tuple[str, float]], seed: int) -> np.ndarray:
    pipe = copy.deepcopy(base.diffusers_pipeline())
    for name, _ in stack:
        pipe.load_lora_weights(os.path.join(folder, name + ".safetensors"), adapter_name=name.replace("/", "_"))
    pipe.set_adapters([n.replace("/", "_") for n, _ in stack], adapter_weights=[s for _, s in stack])
    return pipe(PROMPT, num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(seed),
                output_type="np").images


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_adapters_match_diffusers(request, lora_dirs, family):
    engine = request.getfixturevalue("lora_engine" if family == "sd" else "lora_xl_engine")
    base = request.getfixturevalue("tiny_engine" if family == "sd" else "tiny_xl_engine")
    seed = 7
    plain = engine.generate(PROMPT, num_inference_steps=STEPS, seed=seed).arrays  # caches the plain prompt
    np.testing.assert_allclose(plain, base.generate(PROMPT, num_inference_steps=STEPS, seed=seed).arrays, atol=1e-5)
    for stack in ([("style", 1.0)], [("ink", 0.5)], [("style", 0.5), ("ink", 1.0)], [("styles/sub", 1.0)]):
        ours = engine.generate(PROMPT, num_inference_steps=STEPS, seed=seed, loras=stack).arrays
        ref = _diffusers_image(base, lora_dirs[family], stack, seed)
        diff = np.abs(_uint8(ours) - _uint8(ref)).max()
        assert diff <= 1, (stack, diff)
        assert np.abs(_uint8(ours) - _uint8(plain)).max() > 8, f"{stack} did not change the image"


def test_text_encoder_adapter_weights_reach_the_image(lora_engine, lora_dirs, tmp_path):
    """A file with text-encoder weights only changes the image too (its prompt embeddings are cached apart)."""
    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(lora_dirs["sd"], "style.safetensors"))
    text_only = {k: v for k, v in state.items() if k.startswith("text_encoder.")}
    assert text_only
    lora_engine.add_lora("text-only", text_only)
    try:
        plain = lora_engine.generate(PROMPT, num_inference_steps=STEPS, seed=3).arrays
        ours = lora_engine.generate(PROMPT, num_inference_steps=STEPS, seed=3, loras=[("text-only", 1.0)]).arrays
        assert np.abs(_uint8(ours) - _uint8(plain)).max() > 8
        again = lora_engine.generate(PROMPT, num_inference_steps=STEPS, seed=3).arrays
        np.testing.assert_array_equal(again, plain)  # the adapter's embeddings did not replace the plain ones
    finally:
        lora_engine.remove_lora("text-only")


def test_mixed_adapters_in_one_batch_equal_their_solo_runs(lora_engine):
    sets = [(), (("style", 1.0),), (("ink", 0.5),), (("style", 0.5), ("ink", 1.0))]
    requests = [lora_engine.make_request(PROMPT, num_inference_steps=STEPS, seed=100 + i, loras=sets[i % 4])
                for i in range(12)]
    solo = [lora_engine.run(r).arrays for r in requests]
    together = [f.result() for f in [lora_engine.submit(r) for r in requests]]
    for r, s, t in zip(requests, solo, together):
        assert np.abs(_uint8(t.arrays) - _uint8(s)).max() <= 1, r.loras
    # staggered: each is submitted once the one before it has run a step, so it joins a running batch
    futures, started = [], [threading.Event() for _ in requests]
    for i, r in enumerate(requests):
        if i:
            started[i - 1].wait()
        futures.append(lora_engine.submit(r, on_progress=lambda _id, step, total, e=started[i]: e.set()))
    for r, s, f in zip(requests, solo, futures):
        assert np.abs(_uint8(f.result().arrays) - _uint8(s)).max() <= 1, r.loras
    assert len({tuple(s.flatten()[:64]) for s in solo[:4]}) == 4  # the four sets give four different images


def test_more_distinct_adapters_than_slots_wait(lora_engine, lora_dirs):
    """Six adapters over four slots, all at once: every request completes with its own image."""
    from safetensors.torch import load_file

    state = load_file(os.path.join(lora_dirs["sd"], "style.safetensors"))
    names = [f"copy{i}" for i in range(6)]
    try:
        for i, name in enumerate(names):
            lora_engine.add_lora(name, {k: v * (1 + 0.1 * i) for k, v in state.items()})
        requests = [lora_engine.make_request(PROMPT, num_inference_steps=STEPS, seed=5, loras=[(n, 1.0)])
                    for n in names]
        results = [f.result() for f in [lora_engine.submit(r) for r in requests]]
        for r, res in zip(requests, results):
            solo = lora_engine.run(r).arrays
            assert np.abs(_uint8(res.arrays) - _uint8(solo)).max() <= 1
        assert len({tuple(_uint8(r.arrays).flatten()[:256]) for r in results}) == 6
    finally:
        for name in names:
            lora_engine.remove_lora(name)


def test_bad_adapters_are_refused_by_name(lora_engine, lora_dirs, tiny_engine, tiny_xl_engine, tmp_path):
    folder = lora_dirs["sd"]
    bad: list[tuple[object, str]] = [
        ([("stlye", 1.0)], "did you mean 'style'"),
        ([("style", 9.0)], "allowed: -8..8"),
        ([("style", math.nan)], "allowed: -8..8"),
        ([("style", 1.0), ("ink", 1.0), ("styles/sub", 1.0), ("a", 1.0), ("b", 1.0)], "has 4 adapter slots"),
        ([(f"a{i}", 1.0) for i in range(9)], "at most 8 (--max-request-loras"),
        ([(f"a{i}", 1.0) for i in range(17)], "at most 16 on any server"),
        ([("style", 1.0), ("style", 0.5)], "listed twice"),
        ([("/etc/passwd", 1.0)], "not allowed"),
        ([("../loras-sdxl0/style", 1.0)], "not allowed"),
        ([("styles\\sub", 1.0)], "not allowed"),
        ([("sty\x00le", 1.0)], "not allowed"),
        ("style", "must be a list"),
    ]
    _write_diffusers(tiny_xl_engine, os.path.join(folder, "xl.safetensors"))  # another family's adapter
    bad.append(([("xl", 1.0)], "made for another model"))
    with open(os.path.join(folder, "cut.safetensors"), "wb") as f:  # truncated
        f.write(open(os.path.join(folder, "style.safetensors"), "rb").read()[:200])
    bad.append(([("cut", 1.0)], "truncated"))
    _write_diffusers(tiny_engine, os.path.join(folder, "big.safetensors"), rank=16)
    bad.append(([("big", 1.0)], "--max-lora-rank 16"))
    outside = tmp_path / "outside.safetensors"
    shutil.copy(os.path.join(folder, "style.safetensors"), outside)
    os.symlink(outside, os.path.join(folder, "link.safetensors"))
    bad.append(([("link", 1.0)], "outside the adapter folder"))
    with open(os.path.join(folder, "evil.ckpt"), "wb") as f:
        f.write(b"a pickle would run code")
    try:
        for loras, needle in bad:
            with pytest.raises(ParamError, match=needle.replace("(", r"\(").replace(".", r"\.")) as info:
                lora_engine.generate(PROMPT, num_inference_steps=1, loras=loras)
            assert info.value.param == "loras"
        listing = lora_engine.loras()
        assert "evil.ckpt" in listing["ignored"]
        assert {"style", "ink", "styles/sub"} <= {a["name"] for a in listing["data"]}
        assert {"xl", "cut", "big"} <= {a["name"] for a in listing["unusable"]}
        style = next(a for a in listing["data"] if a["name"] == "style")
        assert style["rank"] == 4 and style["family"] == "sd" and set(style["targets"]) == {"unet", "text_encoder"}
        # nothing else was affected
        ok = lora_engine.generate(PROMPT, num_inference_steps=STEPS, seed=7, loras=[("style", 1.0)])
        assert ok.arrays.std() > 1e-3
    finally:
        for name in ("xl.safetensors", "cut.safetensors", "big.safetensors", "link.safetensors", "evil.ckpt"):
            os.remove(os.path.join(folder, name))


def test_non_finite_adapter_weights_are_refused(lora_engine, lora_dirs):
    from safetensors.torch import load_file

    state = load_file(os.path.join(lora_dirs["sd"], "style.safetensors"))
    key = next(k for k in state if k.startswith("unet.") and "lora_B" in k)
    for bad in (math.inf, math.nan):
        broken = dict(state)
        broken[key] = broken[key].clone()
        broken[key][0, 0] = bad
        with pytest.raises(ParamError, match="non-finite"):
            lora_engine.add_lora("broken", broken)
    assert "broken" not in {a["name"] for a in lora_engine.loras()["data"]}


def test_engine_without_slots_refuses_adapters(tiny_engine):
    with pytest.raises(ParamError, match="--lora-dir"):
        tiny_engine.generate(PROMPT, num_inference_steps=1, loras=[("style", 1.0)])
    assert tiny_engine.loras()["data"] == []


def test_lora_is_a_registered_capability_whose_files_gate_admission(lora_engine, tiny_engine):
    """The engine core names no capability: LoRA's files reach its gates, its resolution and its text side paths
    through the registered capability, which a model's extensions do not list (GET /v1/loras lists adapters)."""
    caps = lora_engine.runner.capabilities
    assert "lora" in [c.name for c in caps.present] and caps.files["lora"] is lora_engine.runner.loras.files
    assert lora_engine.core.scheduler.gates[0] is caps.files["lora"] and caps.request_fields == ("loras",)
    assert "lora" not in lora_engine.info.extensions and "loras" not in lora_engine.info.extension_params
    assert "lora" in [c.name for c in tiny_engine.runner.capabilities.present]  # (its refusal, without slots)
    assert "lora" not in tiny_engine.runner.capabilities.files and not tiny_engine.core.scheduler.gates


def test_replaced_file_takes_effect_for_the_next_request(lora_engine, lora_dirs, tiny_engine):
    folder = lora_dirs["sd"]
    path = os.path.join(folder, "swap.safetensors")
    _write_diffusers(tiny_engine, path, rank=4, seed=30)
    try:
        first = lora_engine.generate(PROMPT, num_inference_steps=STEPS, seed=9, loras=[("swap", 1.0)]).arrays
        _write_diffusers(tiny_engine, path, rank=4, seed=31)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new version even on a coarse clock
        second = lora_engine.generate(PROMPT, num_inference_steps=STEPS, seed=9, loras=[("swap", 1.0)]).arrays
        assert np.abs(_uint8(second) - _uint8(first)).max() > 8
        shutil.copy(path, os.path.join(folder, "swap2.safetensors"))
        fresh = lora_engine.generate(PROMPT, num_inference_steps=STEPS, seed=9, loras=[("swap2", 1.0)]).arrays
        np.testing.assert_allclose(second, fresh, atol=1e-6)
    finally:
        for name in ("swap.safetensors", "swap2.safetensors"):
            if os.path.exists(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))


def test_fused_adapter_equals_the_adapter_at_its_scale(lora_dirs, lora_engine):
    path = os.path.join(lora_dirs["sd"], "style.safetensors")
    with Engine("random:tiny", device="cpu", dtype="fp32", fuse_loras=[(path, 0.5)]) as fused:
        ours = fused.generate(PROMPT, num_inference_steps=STEPS, seed=11).arrays
    side = lora_engine.generate(PROMPT, num_inference_steps=STEPS, seed=11, loras=[("style", 0.5)]).arrays
    assert np.abs(_uint8(ours) - _uint8(side)).max() <= 1


EIGHT = [(f"s{i}", round(0.6 - 0.15 * i, 2)) for i in range(8)]  # scales 0.6 .. -0.45


def test_eight_adapters_in_one_request_equal_them_fused_and_a_ninth_is_refused(tiny_engine, tmp_path):
    """--max-request-loras' default, 8: eight rank-4 adapters (UNet and text encoder) stacked on one request, in the
    8 default slots, equal the model with all eight merged into its weights at those scales; a ninth is a ParamError
    naming loras and the setting; 4 is a server's limit when it says so."""
    paths = []
    for i, (name, _) in enumerate(EIGHT):
        paths.append(str(tmp_path / f"{name}.safetensors"))
        _write_diffusers(tiny_engine, paths[-1], rank=4, seed=100 + i)
    with Engine("random:tiny", device="cpu", dtype="fp32", lora_dir=str(tmp_path), max_lora_rank=4) as stacked:
        (rows,) = [f for f in stacked.runner.program.features if f.name == "lora"]
        assert rows.variants() == (0, 1, 4, 8)  # the side-path depths a step may take
        side = stacked.generate(PROMPT, num_inference_steps=STEPS, seed=12, loras=EIGHT).arrays
        with pytest.raises(ParamError, match=r"9 adapters .* at most 8 \(--max-request-loras\)") as e:
            stacked.generate(PROMPT, num_inference_steps=STEPS, seed=12, loras=EIGHT + [("t", 1.0)])
        assert e.value.param == "loras"
    with Engine("random:tiny", device="cpu", dtype="fp32",
                fuse_loras=[(p, s) for p, (_, s) in zip(paths, EIGHT)]) as fused:
        merged = fused.generate(PROMPT, num_inference_steps=STEPS, seed=12).arrays
    plain = tiny_engine.generate(PROMPT, num_inference_steps=STEPS, seed=12).arrays
    assert np.abs(_uint8(merged) - _uint8(side)).max() <= 1
    assert np.abs(_uint8(plain) - _uint8(side)).mean() > 1  # the adapters change the image
    with Engine("random:tiny", device="cpu", dtype="fp32", lora_dir=str(tmp_path), max_lora_rank=4,
                max_request_loras=4) as four:
        with pytest.raises(ParamError, match=r"5 adapters .* at most 4 \(--max-request-loras\)"):
            four.generate(PROMPT, num_inference_steps=STEPS, seed=12, loras=EIGHT[:5])


def test_graph_mode_runs_adapters_without_captures(lora_dirs, lora_engine):
    """Graph mode (emulated on the CPU): the side-path variants are captured at start-up; rows with and without
    adapters, one or a stack, replay them and equal the eager engine; loads and switches capture nothing."""
    from diffgraph.config import GraphConfig

    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), backend="emulated")
    with Engine("random:tiny", device="cpu", dtype="fp32", mode="graph", graphs=cfg, lora_dir=lora_dirs["sd"],
                max_loras=4, max_lora_rank=8) as graphed:
        captured = {(r["kind"], r["bucket"]) for r in graphed.graph_table() if r["status"] == "captured"}
        for kind in ("step", "step_lora1", "step_lora4"):
            assert {(kind, b) for b in (1, 2, 4)} <= captured
        sets = [(), (("style", 1.0),), (("ink", 0.5),), (("style", 0.5), ("ink", 1.0)), (("styles/sub", 2.0),)]
        requests = [graphed.make_request(PROMPT, num_inference_steps=STEPS, seed=40 + i, loras=sets[i % 5])
                    for i in range(10)]
        results = [f.result() for f in [graphed.submit(r) for r in requests]]
        for r, res in zip(requests, results):
            assert np.abs(_uint8(res.arrays) - _uint8(lora_engine.run(r).arrays)).max() <= 1, r.loras
        table = graphed.graph_table()
        assert all(r["on_demand"] == 0 and r["invalidations"] == 0 for r in table)
        assert {(r["kind"], r["bucket"]) for r in table if r["status"] == "captured"} == captured
        replays = {k: sum(r["replays"] for r in table if r["kind"] == k) for k in ("step", "step_lora1", "step_lora4")}
        assert all(replays.values()), replays
        assert graphed.stats["lora_loads"] >= 3


def test_finite_check_reads_half_precision_bits():
    from diffgraph.lora.manager import _finite

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        t = torch.tensor([0.0, -2.5, 65000.0 if dtype == torch.float16 else 1e30], dtype=dtype)
        assert _finite(t)
        for bad in (math.inf, -math.inf, math.nan):
            u = t.clone()
            u[1] = bad
            assert not _finite(u), (dtype, bad)
