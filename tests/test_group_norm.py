"""graphs/group_norm.py: the compile tier's per-channel group norm equals nn.GroupNorm, eagerly it is nn.GroupNorm's
own, and compiled with a dynamic batch a row's output does not depend on its companions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diffgraph.graphs.group_norm import ChannelGroupNorm, group_norm_by_channel, use_channel_group_norms


@pytest.mark.parametrize("shape,groups", [((2, 64, 16, 16), 32), ((3, 128, 8, 8), 32), ((2, 512, 96), 32),
                                          ((1, 32, 5, 7), 8)])
def test_statistics_by_channel_equal_group_norm(shape, groups):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 3 + 1
    weight, bias = torch.randn(shape[1], generator=gen), torch.randn(shape[1], generator=gen)
    ref = F.group_norm(x, groups, weight, bias, 1e-6)
    assert (group_norm_by_channel(x, groups, weight, bias, 1e-6) - ref).abs().max() < 1e-5
    assert (group_norm_by_channel(x, groups, None, None, 1e-6) - F.group_norm(x, groups, eps=1e-6)).abs().max() < 1e-5
    half = group_norm_by_channel(x.half(), groups, weight.half(), bias.half(), 1e-6)
    assert half.dtype == torch.float16
    assert (half.float() - F.group_norm(x.half().float(), groups, weight.half().float(), bias.half().float(),
                                        1e-6)).abs().max() <= 8e-3  # one fp16 step at these magnitudes


@pytest.mark.parametrize("groups", [1, 8, 32])
def test_a_large_mean_keeps_its_digits(groups):
    """Activations far from zero (offsets of 1000, and per channel): the variance from per-channel var_mean and the
    law of total variance stays as close to a float64 reference as F.group_norm's own (E[x^2] - E[x]^2 in float32
    would be off by 0.02-0.2 here)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 64, 16, 16, generator=gen) + 1000 + torch.randn(1, 64, 1, 1, generator=gen) * 3
    weight, bias = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    exact = F.group_norm(x.double(), groups, weight.double(), bias.double(), 1e-6)
    theirs = (F.group_norm(x, groups, weight, bias, 1e-6).double() - exact).abs().max()
    ours = (group_norm_by_channel(x, groups, weight, bias, 1e-6).double() - exact).abs().max()
    assert ours <= max(6 * theirs, 1e-4), (ours, theirs)
    assert ours < 2e-3


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16, eps=1e-6), nn.SiLU(),
                         nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(8, 16)))


def test_the_class_change_keeps_parameters_and_the_eager_forward():
    block = _block()
    x = torch.randn(3, 8, 12, 12)
    before, state = block(x), {k: v.clone() for k, v in block.state_dict().items()}
    assert use_channel_group_norms(block) == 2 and use_channel_group_norms(block) == 0  # idempotent
    assert all(type(m) is ChannelGroupNorm for m in block.modules() if isinstance(m, nn.GroupNorm))
    assert torch.equal(block(x), before)  # uncompiled: nn.GroupNorm's own kernel, bit for bit
    assert all(torch.equal(v, state[k]) for k, v in block.state_dict().items())


def test_compiled_with_a_dynamic_batch_rows_do_not_depend_on_their_companions():
    block = _block()
    use_channel_group_norms(block)
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(1)).contiguous(
        memory_format=torch.channels_last)
    fn = torch.compile(block, dynamic=True)
    with torch.no_grad():
        four = fn(x)
        assert (four - block(x)).abs().max() < 1e-5  # the traced form equals nn.GroupNorm's
        assert torch.equal(four, torch.cat([fn(x[:2]), fn(x[2:])]))
        assert torch.equal(four[:3], fn(x[:3]))
