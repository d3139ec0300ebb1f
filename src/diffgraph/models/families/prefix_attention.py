"""Attention over rows whose keys are a prefix: row i attends to its first `keys[i].sum()` tokens, the rest of its
slot (the group's slack: padding to the bucket) is never read. A token family lays each row's sequence out that way
so that one replay serves rows of any lengths without a row reading another's tokens or its own padding.

On a GPU in half precision this is flash attention over variable lengths (`torch.nn.attention.varlen.varlen_attn`):
each row's slot is two sequences, its prefix and its slack (which attends only to itself), so the flash kernel runs
without a mask, where a masked `scaled_dot_product_attention` cannot use it; elsewhere (the CPU, fp32, a torch
without it) it is `scaled_dot_product_attention` with the prefix as a key mask. Queries in the slack get some finite
value that the family drops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_HEAD_DIMS = 256  # flash attention's largest head dimension


def varlen_available() -> bool:
    """This torch has variable-length flash attention and a CUDA device."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor,
                     varlen: bool) -> torch.Tensor:
    """Attention of [n, L, heads, head dim] queries, keys and values where row i reads its keys where `keys[i]`
    ([n, L] bool, True on a prefix) holds; out [n, L, heads, head dim]. `varlen`: flash over variable lengths (the
    caller checked `varlen_available`, the device and dtype); else SDPA with a key mask."""
    n, length, heads, dim = query.shape
    if varlen and query.dtype in FLASH_DTYPES and dim <= FLASH_HEAD_DIMS:
        from torch.nn.attention.varlen import varlen_attn

        # sequence bounds [0, used_0, L, L + used_1, 2L, ..., nL]: row i's prefix, then its slack
        used = keys.sum(dim=1, dtype=torch.int32).clamp(min=1)  # (an unused row of a bucket: some finite value)
        rows = torch.arange(n, dtype=torch.int32, device=query.device) * length
        bounds = torch.stack([rows, rows + used], dim=1).reshape(-1)
        bounds = torch.cat([bounds, bounds.new_full((1,), n * length)])
        out = varlen_attn(query.reshape(n * length, heads, dim), key.reshape(n * length, heads, dim),
                          value.reshape(n * length, heads, dim), bounds, bounds, length, length)
        return out.reshape(n, length, heads, dim)
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                         attn_mask=keys[:, None, None, :])
    return out.transpose(1, 2)
