"""gguf_quants: GGML blocks dequantised with torch, equal to the `gguf` package's numpy reference however the
blocks are sliced; the timing helper's figures describe the tensor it timed. (Whole files, every type: see
test_gguf_files.py.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from diffgraph.models import gguf_quants
from diffgraph.models.gguf_quants import READABLE, READERS, TYPES, block_shape, dequantize, random_blocks, time_dequantize


def test_the_type_table_is_ggmls():
    known = {q.value: (q.name, *gguf.GGML_QUANT_SIZES[q]) for q in Q}
    shared = known.keys() & TYPES.keys()
    assert {i: TYPES[i] for i in shared} == {i: known[i] for i in shared}
    assert set(READABLE) <= {known[i][0] for i in shared} and len(shared) >= 30


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "IQ4_XS"])
def test_slices_of_blocks_give_the_whole_tensor(monkeypatch, name):
    block, size = block_shape(name)
    monkeypatch.setattr(gguf_quants, "SLICE_ELEMENTS", 2 * block)  # 2 blocks a slice: 5 blocks in 3 slices
    blocks = random_blocks(name, 5, torch.Generator().manual_seed(1))
    expected = gguf.quants.dequantize(blocks.numpy().reshape(1, -1), Q[name])
    got = dequantize(blocks.reshape(-1), name, (5 * block,), torch.float32)
    assert torch.equal(got, torch.from_numpy(expected).reshape(-1))


def test_random_blocks_have_finite_small_scales():
    for name in READERS:
        values = gguf.quants.dequantize(random_blocks(name, 64, torch.Generator().manual_seed(2)).numpy(), Q[name])
        # |d| <= 1/64, times at most 128 * 32 (Q6_K's scale and value)
        assert np.isfinite(values).all() and 0 < np.abs(values).max() <= 64, name


def test_the_timing_describes_the_tensor_it_timed():
    timing = time_dequantize("cpu", shape=(8, 1024), repeats=2)
    assert (timing.type_name, timing.shape, timing.device, timing.nbytes) == ("Q4_K", (8, 1024), "cpu", 32 * 144)
    assert timing.copy_seconds >= 0 and timing.dequant_seconds > 0
    assert timing.load_seconds(2 * 8 * 1024) == pytest.approx(2 * (timing.copy_seconds + timing.dequant_seconds))
