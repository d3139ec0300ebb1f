"""GPU test (marker `gpu`): FLUX.2 klein (models/families/flux2.py) on CUDA, the tiny random preset, in graph mode
and the compile tier, fp32. Image-to-image rows at strengths 0.5 (no reference) and 0.75 (its image a reference too),
a row from noise with one reference, one with three and a plain row, submitted together: each equals the same request run alone
within one uint8 level (no row reads another's data); the plain row and the edit without references share the
graphed group (0 reference tokens, 256 image tokens); the rows with references replay their own group's graphs
(reference slot 256), captured on first use, and no step runs eagerly."""

import os

import pytest

from token_rows import images_and_graphs, picture as _picture, worst_levels

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")


def _requests() -> list[dict]:
    a, b = _picture(256, 256, 1), _picture(224, 288, 2)
    refs = lambda images: {"reference_images": images}  # noqa: E731
    return [dict(prompt="the same fox", image=a, strength=0.5, num_inference_steps=4, seed=1),
            dict(prompt="the same fox", image=b, strength=0.75, num_inference_steps=4, seed=2, extras=refs([b])),
            dict(prompt="the same fox, asleep", height=256, width=256, num_inference_steps=4, seed=3,
                 extras=refs([a])),
            dict(prompt="a red fox", height=288, width=224, num_inference_steps=3, seed=4),
            dict(prompt="the three of them", height=256, width=256, num_inference_steps=4, seed=5,
                 extras=refs([a, b, _picture(128, 192, 5)]))]


@pytest.mark.parametrize("compile", [False, True])
def test_edit_reference_and_plain_rows_together_equal_each_alone(compile):
    made, together, alone, table = images_and_graphs("random:flux2-klein-tiny", _requests(), DEVICE, "fp32", compile)
    assert [m.denoising_steps for m in made] == [2, 3, 4, 3, 4]
    steps = {(row["height"], row["width"]) for row in table if row["kind"] == "step" and row["replays"]}
    assert (0, 256) in steps, table  # the plain row and the edit without references: one group's graph
    assert (256, 256) in steps, table  # the rows with references: their slot's graphs
    assert not any(row["eager_fallbacks"] for row in table if row["kind"] == "step"), table
    worst = worst_levels(together, alone)
    print(f"FLUX.2 klein edit/reference/plain rows together vs alone, compile={compile}: {worst} levels")
    assert max(worst) <= 1, worst
