"""tools/autotune_gain.py: autotune tables read, each op's calls counted on the meta device, the saving summed."""
import collections
import importlib.util
import pathlib
import sys

import pytest

from diffgraph.models.presets import RANDOM_PRESETS

_PATH = pathlib.Path(__file__).resolve().parents[1] / "tools" / "autotune_gain.py"
_SPEC = importlib.util.spec_from_file_location("autotune_gain", _PATH)
ag = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("autotune_gain", ag)  # its dataclasses look their module up there
_SPEC.loader.exec_module(ag)

# three tables as torch 2.11's Inductor prints them (choices cut to a few): ATen wins; Triton wins with ATen shown;
# Triton wins with no ATen choice among those printed
LOG = """\
Autotune Choices Stats:
{"num_choices": 20, "num_triton_choices": 18, "best_kernel": "bias_addmm", "best_time": 0.0816001, "best_triton_pos": 1}
AUTOTUNE addmm(512x320, 512x320, 320x320)
strides: [0, 1], [320, 1], [1, 320]
dtypes: torch.float16, torch.float16, torch.float16
  bias_addmm 0.0816 ms 100.0% 
  triton_mm_77 0.1028 ms 79.4% ACC_TYPE='tl.float32', ALLOW_TF32=False
  addmm 0.1100 ms 74.2% 
SingleProcess AUTOTUNE benchmarking takes 3.8806 seconds and 0.0002 seconds precompiling for 20 choices
Autotune Choices Stats:
{"num_choices": 13, "num_triton_choices": 12, "best_kernel": "triton_convolution2d_9", "best_time": 0.065568}
AUTOTUNE convolution(2x4x8x8, 320x4x3x3)
strides: [16384, 1, 256, 4], [36, 1, 12, 4]
dtypes: torch.float16, torch.float16
  triton_convolution2d_9 0.0656 ms 100.0% ALLOW_TF32=False, BLOCK_K=16
  convolution 0.0711 ms 92.2% 
Autotune Choices Stats:
{"num_choices": 22, "num_triton_choices": 21, "best_kernel": "triton_mm_701", "best_time": 0.0456}
AUTOTUNE addmm(128x640, 128x320, 320x640)
strides: [0, 1], [320, 1], [1, 320]
dtypes: torch.float16, torch.float16, torch.float16
  triton_mm_701 0.0456 ms 100.0% ACC_TYPE='tl.float32'
  triton_mm_700 0.0508 ms 89.9% ACC_TYPE='tl.float32'
  triton_mm_695 0.0624 ms 73.1% ACC_TYPE='tl.float32'
"""


def test_the_tables_are_read_with_the_best_aten_choice_or_a_lower_bound():
    tuned = ag.parse_log(LOG)
    assert [(t.op, t.key, t.chosen) for t in tuned] == [
        ("addmm", (512, 320, 320), "bias_addmm"),
        ("convolution", (2, 4, 8, 8, 320, 4, 3, 3), "triton_convolution2d_9"),
        ("addmm", (128, 320, 640), "triton_mm_701")]
    assert [(t.chosen_ms, t.aten_ms, t.aten_shown) for t in tuned] == [
        (0.0816, 0.0816, True), (0.0656, 0.0711, True), (0.0456, 0.0624, False)]


def test_the_saving_weights_each_op_by_its_calls_and_names_what_no_table_covers():
    counter = collections.Counter({("mm", 512, 320, 320): 10, ("convolution", 2, 4, 8, 8, 320, 4, 3, 3): 1,
                                   ("addmm", 128, 320, 640): 2, ("bmm", 16, 64, 40, 64): 5})
    g = ag.gain(ag.parse_log(LOG), counter)
    # the linear traced as mm matches its addmm table; the 1 + 2 Triton calls save 0.0055 + 2 * 0.0168 ms
    assert g.shapes == 3 and g.bound and g.untuned == {"bmm": 5}
    assert g.aten_ms == pytest.approx(10 * 0.0816 + 0.0711 + 2 * 0.0624)
    assert g.aten_ms - g.chosen_ms == pytest.approx(0.0055 + 2 * 0.0168)
    assert [(t.chosen, calls) for t, calls in g.triton] == [("triton_convolution2d_9", 1), ("triton_mm_701", 2)]


def test_the_tiny_unet_and_decoder_are_counted_on_the_meta_device():
    counts = ag.count_ops("random:tiny", rows=2, decode=1)
    step, decode = counts["step"], counts["decode"]
    unet = RANDOM_PRESETS["random:tiny"].unet
    side, width = unet["sample_size"], unet["block_out_channels"][0]
    # conv_in: 4 latent channels to the first block's 32, 3x3, once per call, at the rows and the latent side
    assert step[("convolution", 2, 4, side, side, width, 4, 3, 3)] == 1
    assert step[("convolution", 2, width, side, side, 4, width, 3, 3)] == 1  # conv_out
    assert sum(n for k, n in step.items() if k[0] in ("mm", "addmm")) > 0
    assert decode[("addmm", side * side, 4, 4)] == 1  # post_quant_conv, a 1x1 convolution, counted as its GEMM


def test_the_tiny_xl_unet_is_counted_with_its_own_pooled_width():
    """SDXL's added conditioning: the pooled text width comes from the preset (the tiny one's is not 1280)."""
    unet = RANDOM_PRESETS["random:tiny-xl"].unet
    side, width = unet["sample_size"], unet["block_out_channels"][0]
    step = ag.count_ops("random:tiny-xl", rows=2, decode=1)["step"]
    assert step[("convolution", 2, 4, side, side, width, 4, 3, 3)] == 1
