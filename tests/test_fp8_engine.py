"""The fp8 tier through the engine (issue 33, `Engine(quantize=...)`), on the CPU where `torch._scaled_mm` runs too:
the shipped `digits` / `digits-xl` models with their transformer linears forced into fp8 (they are too small to be
faster: `min_features=64` takes the layers of 64 inputs and more) still draw the asked digit (the oracle of
tests/test_digits.py over 20 seeds), their pixels stay close to the 16-bit tier's (here fp32), mixed requests
submitted together equal each alone (per-token activation scales), the built-in LoRA's side path runs beside the
fp8 base, and bad settings are refused by name. The measures are bench/fp8_compare.py's, which `diffgraph compare`
prints for a user's own model."""

from __future__ import annotations

import numpy as np
import pytest

from diffgraph import Engine
from diffgraph.models.digits_oracle import DigitsOracle
from diffgraph.quantize import Fp8Config, Fp8Linear
from diffgraph.bench.fp8_compare import FIRST_SEED, pixel_difference, seed_prompts
from diffgraph.request import ParamError

from loop_util import together
from test_digits import oracle_and_heldout

FORCED = Fp8Config(min_features=64)
SEEDS = 20  # two per digit


def _images(engine, prompts) -> np.ndarray:
    """bench/fp8_compare.py's `generate_images` (seed FIRST_SEED + i per prompt, 20 steps, 64x64, guidance 5), its
    requests submitted together: they share steps (a third of the time one after another takes; measured: the
    same oracle scores, the pixel difference's mean within 0.1 level of theirs)."""
    return np.stack([np.asarray(r.arrays)[0] for r in together(engine, [
        engine.make_request(text, num_inference_steps=20, guidance_scale=5.0, seed=FIRST_SEED + i, width=64, height=64)
        for i, (text, _) in enumerate(prompts)])])


@pytest.mark.parametrize("model", ["digits", "digits-xl"])
def test_fp8_digits_pass_the_oracle_and_stay_close_to_16_bits(model):
    oracle = DigitsOracle(*oracle_and_heldout())  # trained once per test process
    prompts = seed_prompts(model, SEEDS)
    asked = np.array([d for _, d in prompts])
    with Engine(model, device="cpu") as plain, Engine(model, device="cpu", quantize=FORCED) as fp8:
        assert fp8.quantized is not None and len(fp8.quantized.quantized) >= 10
        assert sum(isinstance(m, Fp8Linear) for m in fp8.model.denoiser.modules()) == len(fp8.quantized.quantized)
        assert not any(isinstance(m, Fp8Linear) for m in plain.model.denoiser.modules())
        ref, out = _images(plain, prompts), _images(fp8, prompts)
    ref_score, score = oracle.score(asked, ref), oracle.score(asked, out)
    diff_mean, diff_max = pixel_difference(ref, out)
    print(f"{model}: oracle {score:.2f} (16 bits {ref_score:.2f}), pixel difference mean {diff_mean:.2f} "
          f"max {diff_max:.0f} levels")
    assert score >= 0.9 and score >= ref_score - 0.1, (score, ref_score)
    assert diff_mean <= 8.0, diff_mean  # measured about 1-3 levels; a wrong scale gives noise (tens of levels)
    assert 0 < diff_max  # fp8 really ran


def test_fp8_rows_together_equal_each_alone_and_a_lora_rides_beside():
    with Engine("digits", device="cpu", quantize=FORCED, max_loras=4) as e:
        reqs = [e.make_request("a handwritten digit three", num_inference_steps=6, seed=11),
                e.make_request("a handwritten digit seven", num_inference_steps=6, seed=12, guidance_scale=1.0),
                e.make_request("a handwritten digit three", num_inference_steps=6, seed=11, loras=[("pencil", 1.0)])]
        alone = [e.run(r).arrays for r in reqs]
        futures: list = []
        e.core.call_between_steps(lambda: futures.extend(e.submit(r) for r in reqs)).result()
        together = [f.result().arrays for f in futures]
    diffs = [np.abs(a - b) * 255 for a, b in zip(alone, together)]
    print("together vs alone, levels (mean, max):", [(round(float(d.mean()), 3), float(d.max())) for d in diffs])
    # the activation scales are per token, so no companion enters a row's numbers; but the CPU's matmuls and
    # convolutions change their last bits with the batch size, and fp8 rounding (3 mantissa bits) turns a last-bit
    # change near a rounding boundary into a step of 1/16: bounds measured, looser than the 16-bit tier's 1 level
    for d in diffs:
        assert d.mean() <= 5.0 and d.max() <= 40, (d.mean(), d.max())  # measured 3.2 and 18
    assert np.abs(alone[0] - alone[2]).max() * 255 > 5  # the adapter's 16-bit side path changed the image


def test_bad_quantize_settings_are_refused_by_name():
    with pytest.raises(ParamError, match="quantize 'int4' is unknown; allowed: fp8"):
        Engine("random:tiny", device="cpu", quantize="int4")
    with pytest.raises(ParamError, match="lower min_features"):
        Engine("random:tiny", device="cpu", quantize="fp8")  # its widths are all below 640
    with Engine("random:tiny", device="cpu") as plain:
        with pytest.raises(ParamError, match="not a loaded DiffusionModel"):
            Engine(plain.model, quantize=Fp8Config(min_features=16))
    with pytest.raises(ValueError, match="min_features 8 is below 16"):
        Fp8Config(min_features=8)


def test_the_fp8_step_precompiles_and_a_warm_start_loads_it(tmp_path):
    """Issue 33's warm start (<= 30 s) rests on this: the fp8 step (its quantisation and `_scaled_mm` op inside the
    traced code) is saved whole as a precompiled version, and a second engine on the cache folder loads it and
    compiles nothing (Inductor on the CPU), with the same images."""
    import torch

    from diffgraph.config import CompileConfig, GraphConfig
    from diffgraph.graphs.compiled import precompile_available

    if not precompile_available():
        pytest.skip("this torch has no torch.compiler.load_compiled_function (2.10+): no precompiled versions")
    torch._dynamo.reset()
    cfg = GraphConfig(batch_buckets=(1, 2), resolutions=((64, 64),), backend="emulated", capture_vae=False,
                      capture_text_encoder=False)
    images = []
    for run in ("cold", "warm"):
        with Engine("random:tiny", device="cpu", dtype="fp32", mode="graph", graphs=cfg,
                    quantize=Fp8Config(min_features=16), compile=CompileConfig(cache_dir=str(tmp_path))) as engine:
            step = next(c for c in engine.runner.compiled if c.name == "the whole step")
            assert len(engine.quantized.quantized) >= 10
            assert (step.compiles, step.loaded, step.fallbacks) == ((1, 0, 0) if run == "cold" else (0, 1, 0)), run
            images.append(engine.generate("a cat", seed=3, num_inference_steps=2).arrays)
    np.testing.assert_allclose(images[0], images[1], atol=1e-6)
