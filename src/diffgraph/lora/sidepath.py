"""Per-row LoRA side paths over fixed device slots.

The Punica / S-LoRA idea for diffusion steps: every targeted layer (an nn.Linear, or a 1x1 nn.Conv2d) keeps its
base weight and gains a low-rank side path whose weights live in fixed device tensors, one slot per loaded adapter,
zero-padded to a maximum rank:

    A [slots, rank, in]    B [slots, rank, out]    (slot 0: all zeros, "no adapter")

Each batch row reads which slots (up to `K` adapters, stacked) and scales apply to it from a `RowLoras` context (idx
[rows, K] int64, scale [rows, K]); so rows with different adapters, or none, share one forward (one graph replay):

    y = base(x) + sum_k scale[row, k] * (x @ A[idx[row, k]]^T) @ B[idx[row, k]]

The K adapters of a row are one adapter of rank K * rank; K is the context's stack depth (the engine captures a
variant per depth it runs: 1, and the largest). On a CUDA device in half precision a Linear layer runs the fused
Triton kernel (kernels.py: base product and side path in one GEMM, the activations read once); elsewhere (1x1
convolutions, the CPU) two batched matmuls over the gathered slots (scales folded into A).

Loading an adapter writes its A and B into a slot in place (`LoraSlots.write`): the tensors a captured graph reads
never move, so nothing is recaptured. With the context's `idx` unset the side path is skipped (the variant for
steps where no row uses an adapter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from . import kernels

MAX_STACK = 4  # adapters one request may stack


@dataclass
class RowLoras:
    """Which slots and scales each row of the current forward uses; `idx` None: no side path at all."""

    idx: torch.Tensor | None = None     # [rows, K] int64 slot numbers (0 = none)
    scale: torch.Tensor | None = None   # [rows, K] scales (0 where unused)

    def set(self, idx: torch.Tensor | None, scale: torch.Tensor | None) -> None:
        if (idx is None) != (scale is None) or (idx is not None and idx.shape != scale.shape):
            raise ValueError("idx and scale must both be given, with the same [rows, K] shape, or both be None")
        if idx is not None and idx.shape[1] > MAX_STACK:
            raise ValueError(f"{idx.shape[1]} stacked adapters per row; at most {MAX_STACK}")
        self.idx, self.scale = idx, scale


@dataclass
class _Slot:
    a: torch.Tensor  # [slots, rank, in]   (a view of the bank's flat buffer)
    b: torch.Tensor  # [slots, rank, out]
    offset: int = 0  # where the layer's A (then its B) starts in a slot's row of the flat buffer


@dataclass
class LoraSlots:
    """The device slots of every targeted layer: `slots` adapters (plus slot 0, empty) of rank <= `max_rank`. All
    layers of one slot are one row of `flat` [slots + 1, size] (each layer's A then B), so loading an adapter is one
    host-to-device copy (`write_flat`), not two per layer."""

    slots: int
    max_rank: int
    layers: dict[str, _Slot] = field(default_factory=dict)
    flat: torch.Tensor | None = None

    def host_row(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], pin: bool) -> torch.Tensor:
        """One slot's row on the host: `weights` (module -> A [r, in], B^T [r, out], scale folded in) zero-padded to
        max_rank in place, zeros for every other layer."""
        row = torch.zeros(self.flat.shape[1], dtype=self.flat.dtype, pin_memory=pin)
        for module, (a, b) in weights.items():
            layer = self.layers[module]
            n_a = self.max_rank * a.shape[1]
            row[layer.offset:layer.offset + n_a].view(self.max_rank, -1)[:a.shape[0]].copy_(a)
            row[layer.offset + n_a:layer.offset + n_a + self.max_rank * b.shape[1]].view(
                self.max_rank, -1)[:b.shape[0]].copy_(b)
        return row

    def write_flat(self, slot: int, row: torch.Tensor | None) -> None:
        """Loads a slot from a host row (host_row; None: the adapter has no layer here, zeros): one copy."""
        if self.flat is None:  # no targeted layer in this module
            return
        with torch.no_grad():
            if row is None:
                self.flat[slot].zero_()
            else:
                self.flat[slot].copy_(row, non_blocking=True)

    def write(self, slot: int, module: str, a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> None:
        """Copies one layer's adapter weights into `slot` in place, zero-padded to max_rank; `scale` (alpha / r)
        is folded into B. a: [r, in] (or [r, in, 1, 1]), b: [out, r] (or [out, r, 1, 1])."""
        if not 1 <= slot <= self.slots:
            raise ValueError(f"slot {slot} is out of range 1..{self.slots}")
        layer = self.layers.get(module)
        if layer is None:
            raise KeyError(f"{module!r} is not a targeted layer")
        a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        r = a.shape[0]
        if r > self.max_rank:
            raise ValueError(f"rank {r} at {module} is above the maximum rank {self.max_rank}")
        if a.shape[1] != layer.a.shape[2] or b.shape != (layer.b.shape[2], r):
            raise ValueError(f"{module}: adapter shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit the layer "
                             f"(in {layer.a.shape[2]}, out {layer.b.shape[2]})")
        with torch.no_grad():
            layer.a[slot].zero_()
            layer.b[slot].zero_()
            layer.a[slot, :r].copy_(a, non_blocking=True)
            layer.b[slot, :r].copy_(b.t() * scale if scale != 1.0 else b.t(), non_blocking=True)

    def clear(self, slot: int) -> None:
        if self.flat is not None:
            with torch.no_grad():
                self.flat[slot].zero_()


class LoraLayer(nn.Module):
    """A targeted layer with its per-row side path (wraps the base layer; its parameters stay the base's)."""

    def __init__(self, base: nn.Module, slot: _Slot, rows: RowLoras):
        super().__init__()
        self.base = base
        self._slot = slot
        self._rows = rows
        self._conv = isinstance(base, nn.Conv2d)
        self.fused = True  # use the fused kernel where it applies (probes switch it off to compare)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows
        if rows.idx is None:
            return self.base(x)
        if self.fused and kernels.available(x) and x.shape[0] == rows.idx.shape[0] \
                and rows.idx.shape[1] * self._slot.a.shape[1] <= kernels.max_fused_rank():
            base = self.base
            if self._conv:  # [N, C, H, W] read as [N, C, HW] in place
                y = kernels.lora_linear(x.flatten(2), base.weight, base.bias, self._slot.a, self._slot.b, rows.idx,
                                        rows.scale, channels_first=True)
                return y.view(x.shape[0], -1, *x.shape[2:])
            y = kernels.lora_linear(x.reshape(x.shape[0], -1, x.shape[-1]), base.weight, base.bias, self._slot.a,
                                    self._slot.b, rows.idx, rows.scale)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        y = self.base(x)
        n, k = rows.idx.shape
        slot = self._slot
        r = slot.a.shape[1]
        # the row's stack as one adapter of rank k * r: A with the row's scales folded in, B as it is
        a = (slot.a[rows.idx] * rows.scale.to(slot.a.dtype)[:, :, None, None]).reshape(n, k * r, -1)
        b = slot.b[rows.idx].reshape(n, k * r, -1)  # [N, K*R, out]
        if self._conv:  # [N, C, H, W] -> tokens [N, HW, C] (a view; bmm reads it transposed)
            h = x.flatten(2).transpose(1, 2)
            side = torch.bmm(torch.bmm(h.to(a.dtype), a.transpose(1, 2)), b)  # [N, HW, out]
            return y + side.transpose(1, 2).reshape(y.shape).to(y.dtype)
        h = x.reshape(n, -1, x.shape[-1])
        side = torch.baddbmm(y.reshape(n, -1, y.shape[-1]), torch.bmm(h.to(a.dtype), a.transpose(1, 2)), b)
        return side.reshape(y.shape)


def attach(root: nn.Module, targets: list[str], slots: int, max_rank: int, rows: RowLoras) -> LoraSlots:
    """Wraps each targeted layer of `root` (module paths; Linear or 1x1 Conv2d) with its side path over new zeroed
    slots on the layer's device and dtype; returns the slots. Other layer kinds are refused by name."""
    bank = LoraSlots(slots=slots, max_rank=max_rank)
    found = []
    for path in targets:
        parent_path, _, name = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        base = getattr(parent, name)
        if isinstance(base, nn.Linear):
            n_in, n_out = base.in_features, base.out_features
        elif isinstance(base, nn.Conv2d) and base.kernel_size == (1, 1) and base.groups == 1:
            n_in, n_out = base.in_channels, base.out_channels
        else:
            kind = f"a {base.kernel_size[0]}x{base.kernel_size[1]} convolution" if isinstance(base, nn.Conv2d) \
                else type(base).__name__
            raise ValueError(f"{path} is {kind}: LoRA side paths take Linear layers and 1x1 convolutions")
        found.append((path, parent, name, base, n_in, n_out))
    if not found:
        return bank
    w = found[0][3].weight
    size = sum(max_rank * (n_in + n_out) for *_, n_in, n_out in found)
    bank.flat = torch.zeros((slots + 1, size), dtype=w.dtype, device=w.device)
    offset = 0
    for path, parent, name, base, n_in, n_out in found:
        n_a, n_b = max_rank * n_in, max_rank * n_out
        a = bank.flat[:, offset:offset + n_a].unflatten(1, (max_rank, n_in))
        b = bank.flat[:, offset + n_a:offset + n_a + n_b].unflatten(1, (max_rank, n_out))
        slot = _Slot(a, b, offset)
        offset += n_a + n_b
        bank.layers[path] = slot
        setattr(parent, name, LoraLayer(base, slot, rows))
    return bank
