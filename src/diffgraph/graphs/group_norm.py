"""GroupNorm in a form Inductor compiles to bandwidth-bound kernels for channels-last activations (the compile tier).

Owns: `ChannelGroupNorm` (an `nn.GroupNorm` whose compiled forward is `group_norm_by_channel`) and
`use_channel_group_norms(module)`, which gives a module's GroupNorm layers that forward in place (same parameters,
same state dict). Eagerly, and so in the graph tier and wherever the module runs uncompiled (the VAE encoder,
previews), the forward is nn.GroupNorm's own: only what Dynamo traces changes.

Why (SD1.5's VAE decoder at 512x512, compile tier with channels-last activations): Inductor lowered the decoder's
group norms over 4 channels x 512 x 512 of one group, strided in channels-last memory, to persistent reductions many
times slower than one memory-bound pass over the activation, together a large share of the decode (`python3
tools/probe_vae_layout.py --kernels 4`). Reducing each channel over
its pixels first (an outer reduction, contiguous across channels in channels-last memory), then the few channels of a
group, gives the same statistics in float32 with a different summation order: the same image within rounding. One
pass over the activation for the statistics (var_mean) rather than two (the mean, then the squared deviations) makes
the decode faster again (BENCHMARKS.md: the decoder's group norms in one pass).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ChannelGroupNorm", "group_norm_by_channel", "use_channel_group_norms"]


def group_norm_by_channel(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                          eps: float) -> torch.Tensor:
    """F.group_norm(x, groups, weight, bias, eps) for x [N, C, *spatial], computed in float32 from per-channel
    statistics: each channel's mean and variance over the spatial axes in one pass (var_mean, Welford), then per
    group the mean of its channels' means and, by the law of total variance (every channel counts the same pixels),
    the mean of their variances plus the variance of their means; applied as one per-channel scale and shift,
    returned in x's dtype."""
    n, c = x.shape[0], x.shape[1]
    spatial = tuple(range(2, x.dim()))
    per_group = c // groups
    xf = x.float()
    var_c, mean_c = torch.var_mean(xf, dim=spatial, correction=0)  # [N, C]
    var_c, mean_c = var_c.view(n, groups, per_group), mean_c.view(n, groups, per_group)
    mean = mean_c.mean(dim=-1, keepdim=True)  # [N, G, 1]
    inv_std = torch.rsqrt(var_c.mean(dim=-1, keepdim=True) + (mean_c - mean).square().mean(dim=-1, keepdim=True)
                          + eps)
    scale = inv_std.expand(n, groups, per_group).reshape(n, c)
    shift = (-mean * inv_std).expand(n, groups, per_group).reshape(n, c)
    if weight is not None:
        scale, shift = scale * weight.float(), shift * weight.float()
    if bias is not None:
        shift = shift + bias.float()
    shape = (n, c) + (1,) * len(spatial)
    return (xf * scale.view(shape) + shift.view(shape)).to(x.dtype)


class ChannelGroupNorm(nn.GroupNorm):
    """nn.GroupNorm whose traced (compiled) forward is `group_norm_by_channel`; eagerly nn.GroupNorm's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() or x.dim() < 3:
            return super().forward(x)
        return group_norm_by_channel(x, self.num_groups, self.weight, self.bias, self.eps)


def use_channel_group_norms(module: nn.Module) -> int:
    """Gives every plain nn.GroupNorm in `module` ChannelGroupNorm's forward (a class change: the parameters and
    hooks stay); returns how many changed. Idempotent."""
    changed = 0
    for m in module.modules():
        if type(m) is nn.GroupNorm:
            m.__class__ = ChannelGroupNorm
            changed += 1
    return changed
