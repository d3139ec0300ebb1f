"""GroupNorm in a form Inductor compiles to bandwidth-bound kernels for channels-last activations (the compile tier).

Owns: `ChannelGroupNorm` (an `nn.GroupNorm` whose compiled forward is `group_norm_by_channel`) and
`use_channel_group_norms(module)`, which gives a module's GroupNorm layers that forward in place (same parameters,
same state dict). Eagerly, and so in the graph tier and wherever the module runs uncompiled (the VAE encoder,
previews), the forward is nn.GroupNorm's own: only what Dynamo traces changes.

Why (H200, SD1.5's VAE decoder at 512x512, bucket 4, compile tier with channels-last activations): Inductor lowered
the decoder's group norms over 4 channels x 512 x 512 of one group, strided in channels-last memory, to persistent
reductions that ran about 1 ms an image each (a memory-bound pass over one 67 MB activation should take well under
0.1 ms), together a third of the decode (`python3 tools/probe_vae_layout.py --kernels 4`). Reducing each channel over
its pixels first (an outer reduction, contiguous across channels in channels-last memory), then the few channels of a
group, gives the same statistics in float32 with a different summation order: the same image within rounding.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ChannelGroupNorm", "group_norm_by_channel", "use_channel_group_norms"]


def group_norm_by_channel(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                          eps: float) -> torch.Tensor:
    """F.group_norm(x, groups, weight, bias, eps) for x [N, C, *spatial], computed in float32 as per-channel means
    over the spatial axes, then per group over its channels (two passes: the mean, then the squared deviations),
    returned in x's dtype."""
    n, c = x.shape[0], x.shape[1]
    spatial = tuple(range(2, x.dim()))
    per_group = c // groups
    shape = (n, c) + (1,) * len(spatial)
    xf = x.float()

    def by_channel(group_values: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N, C, 1, ...]
        return group_values[:, :, None].expand(n, groups, per_group).reshape(shape)
    mean = by_channel(xf.mean(dim=spatial).view(n, groups, per_group).mean(dim=-1))
    centred = xf - mean
    var = centred.square().mean(dim=spatial).view(n, groups, per_group).mean(dim=-1)
    y = centred * by_channel(torch.rsqrt(var + eps))
    if weight is not None:
        y = y * weight.float().view(shape[1:]).unsqueeze(0)
    if bias is not None:
        y = y + bias.float().view(shape[1:]).unsqueeze(0)
    return y.to(x.dtype)


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
