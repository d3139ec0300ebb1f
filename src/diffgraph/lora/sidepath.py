"""Per-row LoRA side paths over fixed device slots.

The Punica / S-LoRA idea for diffusion steps: every targeted layer (an nn.Linear, or an nn.Conv2d of any kernel
size with groups 1) keeps its base weight and gains a low-rank side path whose weights live in fixed device tensors,
one slot per loaded adapter, zero-padded to a maximum rank:

    A [slots, rank, in * kh * kw]    B [slots, rank, out]    (slot 0: all zeros, "no adapter")

(kh x kw the kernel of a convolution, 1 x 1 for a Linear layer). Each batch row reads which slots (up to `K`
adapters, stacked) and scales apply to it from a `RowLoras` context (idx [rows, K] int64, scale [rows, K]); so rows
with different adapters, or none, share one forward (one graph replay):

    y = base(x) + sum_k scale[row, k] * up_k(down_k(x))     down: A[idx[row, k]], up: B[idx[row, k]]

The K adapters of a row are one adapter of rank K * rank; K is the context's stack depth (the engine captures a
variant per depth it runs: 1, and the largest). Three kinds of layer:

- Linear layers: on a CUDA device in half precision the fused Triton kernel (kernels.py: base product and side
  path in one GEMM, the activations read once); elsewhere two batched matmuls over the gathered slots (scales
  folded into A).
- 1x1 convolutions (stride 1, no padding): the same, on [N, C, HW] read in place.
- k x k convolutions (LoCon: a ResNet block's conv1/conv2, the down- and upsamplers' convs, conv_in/conv_out; and
  any convolution with a stride, padding or dilation; groups 1): the down projection is a convolution with the base's
  kernel size, stride, padding, dilation and padding mode, the up projection a 1x1 one. Rows with different slots
  run as one grouped convolution: x viewed [1, N*C, H, W] against the rows' gathered down weights
  [N*K*r, C, kh, kw] with groups=N, then the up projection as one batched matmul [N, out, K*r] @ [N, K*r, HoWo]
  with the rows' scales folded into B (B is the smaller of the two). The grouped convolution is the custom op
  `diffgraph::lora_conv_down`, so that torch.compile sees its output shape and not groups=N (the compile tier's
  batch axis stays dynamic: no compile per batch size). No host sync and no data-dependent shape:
  capturable in a CUDA graph (on the H200: a replay after slots and rows changed in place equals the eager
  forward exactly; fp16 within 3e-3 of the fp32 merged-weight convolution). The gathered down weights are a
  temporary of N*K*r*C*kh*kw elements per layer (SD1.5's up-block conv1, 2560 channels, 32 rows, rank 64: 94 MB
  in fp16 at K=1); a channels-last input is copied once into the [1, N*C, H, W] view.

Memory: a layer's slot costs max_rank * (in * kh * kw + out) elements. Counted on the true-architecture presets
(random:sd15, random:sdxl built on the meta device), 8 slots plus the empty slot 0, max rank 64, fp16:

    bank                                            SD1.5                          SDXL
    attention, feed-forward, proj_in / proj_out     192 layers, 51.8 MiB a slot,   722 layers, 324.7 MiB a slot,
                                                    466 MiB                        2922 MiB
    ResNet and sampler layers (the LoRA manager's   88 layers, 76.9 MiB a slot,    68 layers, 51.0 MiB a slot,
    `conv` option: conv1, conv2, conv_shortcut,     692 MiB                        459 MiB
    time_emb_proj, the samplers' convs, conv_in,
    conv_out)

Step cost: the ResNet and sampler side paths make an adapter step much dearer than attention side paths alone
(BENCHMARKS.md: every sampler in one replay, "Conv side paths"). The grouped convolution is the cost: 320 -> 64 channels
at 64x64 over 32 groups takes over half the time of the base 320 -> 320 convolution (cuDNN, NCHW; cudnn.benchmark and a
loop over rows were no faster, NHWC only on the 16x16 layers once its layout copy is counted). For SD1.5 these banks
take 1.5x the memory of the attention ones (42% of its 1.6 GiB of fp16 UNet weights), and every adapter step pays them
at the full max rank for every row, whether or not its adapters touch a convolution: a graph's work is fixed by the
slots' shape, not by what is loaded. Most adapters (kohya / diffusers LoRAs of the attention layers) do not touch them.
So k x k convolutions get side paths only when the caller asks (`attach(..., convolutions=True)`; the LoRA manager's
`conv` option); without it they are refused by name.

Loading an adapter writes its A and B into a slot in place (`LoraSlots.write`): the tensors a captured graph reads
never move, so nothing is recaptured. With the context's `idx` unset the side path is skipped (the variant for
steps where no row uses an adapter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels

MAX_STACK = 4  # adapters a row may stack where its owner sets no other limit


@dataclass
class RowLoras:
    """Which slots and scales each row of the current forward uses; `idx` None: no side path at all."""

    idx: torch.Tensor | None = None     # [rows, K] int64 slot numbers (0 = none)
    scale: torch.Tensor | None = None   # [rows, K] scales (0 where unused)
    max_stack: int = MAX_STACK          # the most K (the LoRA manager's: its config's max_stack)

    def set(self, idx: torch.Tensor | None, scale: torch.Tensor | None) -> None:
        if (idx is None) != (scale is None) or (idx is not None and idx.shape != scale.shape):
            raise ValueError("idx and scale must both be given, with the same [rows, K] shape, or both be None")
        if idx is not None and idx.shape[1] > self.max_stack:
            raise ValueError(f"{idx.shape[1]} stacked adapters per row; at most {self.max_stack}")
        self.idx, self.scale = idx, scale


@dataclass
class _Slot:
    a: torch.Tensor  # [slots, rank, in * kh * kw]   (a view of the bank's flat buffer)
    b: torch.Tensor  # [slots, rank, out]
    offset: int = 0  # where the layer's A (then its B) starts in a slot's row of the flat buffer
    kernel: tuple[int, int] | None = None  # a convolution's (kh, kw); None for a Linear layer

    @property
    def n_in(self) -> int:
        """Input features (a Linear layer) or channels (a convolution)."""
        k = self.kernel or (1, 1)
        return self.a.shape[2] // (k[0] * k[1])

    @property
    def n_out(self) -> int:
        return self.b.shape[2]

    def describe(self) -> str:
        """What the layer takes, for messages: '320 -> 640 features' or '320 -> 640 channels, 3x3 kernel'."""
        if self.kernel is None:
            return f"{self.n_in} -> {self.n_out} features"
        return f"{self.n_in} -> {self.n_out} channels, {self.kernel[0]}x{self.kernel[1]} kernel"


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
        """One slot's row on the host: `weights` (module -> A [r, in * kh * kw], B^T [r, out], scale folded in)
        zero-padded to max_rank in place, zeros for every other layer."""
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
        is folded into B. a: [r, in] (a Linear layer) or [r, in, kh, kw] (a convolution; [r, in * kh * kw] too),
        b: [out, r] (or [out, r, 1, 1])."""
        if not 1 <= slot <= self.slots:
            raise ValueError(f"slot {slot} is out of range 1..{self.slots}")
        layer = self.layers.get(module)
        if layer is None:
            raise KeyError(f"{module!r} is not a targeted layer")
        if a.ndim == 4 and layer.kernel is not None and tuple(a.shape[2:]) != layer.kernel:
            raise ValueError(f"{module}: adapter down weight {tuple(a.shape)} has a {a.shape[2]}x{a.shape[3]} kernel, "
                             f"the layer a {layer.kernel[0]}x{layer.kernel[1]} one")
        if b.ndim == 4 and b.shape[2:] != (1, 1):
            raise ValueError(f"{module}: adapter up weight {tuple(b.shape)} is not 1x1; LoRA up weights are")
        a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        r = a.shape[0]
        if r > self.max_rank:
            raise ValueError(f"rank {r} at {module} is above the maximum rank {self.max_rank}")
        if a.shape[1] != layer.a.shape[2] or b.shape != (layer.b.shape[2], r):
            raise ValueError(f"{module}: adapter shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit the layer "
                             f"({layer.describe()})")
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
        # a convolution that is not a plain 1x1 (kernel, stride, padding or dilation): the grouped-convolution path
        self._spatial = self._conv and not _pointwise(base)
        if self._spatial:
            self._padding, self._pre_pad = _conv_padding(base)
        self.fused = True  # use the fused kernel where it applies (probes switch it off to compare)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows
        if rows.idx is None:
            return self.base(x)
        if self._spatial:
            return self._spatial_forward(x)
        # the fused kernel reads the base's weight: not for a base quantised after attach (quantize/fp8.py)
        if self.fused and isinstance(self.base, (nn.Linear, nn.Conv2d)) and kernels.available(x) \
                and x.shape[0] == rows.idx.shape[0] \
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

    def _spatial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """A k x k convolution's side path: every row's down convolution as one grouped convolution over the
        batch (groups = rows: `lora_conv_down`), then each row's 1x1 up projection as one batched matmul, its
        scales folded into B."""
        base, slot, rows = self.base, self._slot, self._rows
        y = base(x)
        n, k = rows.idx.shape
        r = slot.a.shape[1]
        down = slot.a[rows.idx].reshape(n, k * r, x.shape[1], *slot.kernel)  # [N, K*R, C, kh, kw]
        h = x.to(down.dtype)
        if self._pre_pad is not None:  # a padding mode other than zeros, or an uneven "same"
            h = F.pad(h, self._pre_pad[0], mode=self._pre_pad[1])
        low = lora_conv_down(h, down, base.stride, self._padding, base.dilation)  # [N, K*R, Ho, Wo]
        up = (slot.b[rows.idx] * rows.scale.to(slot.b.dtype)[:, :, None, None]).reshape(n, k * r, -1)
        side = torch.bmm(up.transpose(1, 2), low.flatten(2))  # [N, out, Ho*Wo]
        return y + side.view(y.shape).to(y.dtype)


def _conv_padding(conv: nn.Conv2d) -> tuple[tuple[int, int], tuple[tuple[int, ...], str] | None]:
    """A convolution's padding as (the down convolution's symmetric zero padding, what F.pad does before it or
    None): a padding mode other than zeros, and a "same" padding that is uneven, pad first."""
    if conv.padding_mode != "zeros":
        return (0, 0), (tuple(conv._reversed_padding_repeated_twice), conv.padding_mode)
    if conv.padding == "valid":
        return (0, 0), None
    if conv.padding == "same":
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        if all(t % 2 == 0 for t in total):
            return (total[0] // 2, total[1] // 2), None
        return (0, 0), (tuple(conv._reversed_padding_repeated_twice), "constant")
    return tuple(conv.padding), None


@torch.library.custom_op("diffgraph::lora_conv_down", mutates_args=(),
                         schema="(Tensor x, Tensor down, int[] stride, int[] padding, int[] dilation) -> Tensor")
def lora_conv_down(x: torch.Tensor, down: torch.Tensor, stride: list[int], padding: list[int],
                   dilation: list[int]) -> torch.Tensor:
    """Each row's own down convolution: x [N, C, H, W], down [N, R, C, kh, kw] -> [N, R, Ho, Wo], as one grouped
    convolution (x viewed [1, N*C, H, W], groups=N). A custom op, so that torch.compile sees its output shape
    (the fake below) and not groups=N: the compile tier's batch axis stays dynamic instead of one compile per batch
    size."""
    n, r = down.shape[:2]
    low = F.conv2d(x.reshape(1, -1, *x.shape[2:]), down.reshape(n * r, *down.shape[2:]), None, stride, padding,
                   dilation, groups=n)
    return low.view(n, r, *low.shape[2:])


@lora_conv_down.register_fake
def _lora_conv_down_shape(x, down, stride, padding, dilation):
    size = [(x.shape[2 + i] + 2 * padding[i] - dilation[i] * (down.shape[3 + i] - 1) - 1) // stride[i] + 1
            for i in range(2)]
    return x.new_empty((x.shape[0], down.shape[1], *size))


def takes(module: nn.Module, convolutions: bool = False) -> bool:
    """Whether `attach` gives `module` a side path: a Linear layer, a 1x1 convolution (stride 1, no padding), and
    with `convolutions` any convolution with groups 1."""
    if isinstance(module, nn.Linear):
        return True
    return isinstance(module, nn.Conv2d) and module.groups == 1 and (convolutions or _pointwise(module))


def _pointwise(conv: nn.Conv2d) -> bool:
    """A 1x1 convolution that is a per-pixel Linear layer (stride 1, no padding): the Linear side path applies."""
    return conv.kernel_size == (1, 1) and conv.stride == (1, 1) and conv.dilation == (1, 1) \
        and conv.padding in ((0, 0), "valid")


def attach(root: nn.Module, targets: list[str], slots: int, max_rank: int, rows: RowLoras,
           convolutions: bool = False) -> LoraSlots:
    """Wraps each targeted layer of `root` (module paths) with its side path over new zeroed slots on the layer's
    device and dtype; returns the slots. Targets: Linear layers and 1x1 convolutions, and with `convolutions`
    convolutions of any kernel size, stride, padding and dilation (groups 1). Other layer kinds are refused by
    name."""
    bank = LoraSlots(slots=slots, max_rank=max_rank)
    found = []
    for path in targets:
        parent_path, _, name = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        base = getattr(parent, name)
        kernel = None
        if isinstance(base, nn.Linear):
            n_in, n_out = base.in_features, base.out_features
        elif isinstance(base, nn.Conv2d) and base.groups != 1:
            raise ValueError(f"{path} is a grouped convolution (groups={base.groups}): LoRA side paths take "
                             "convolutions with groups 1; leave it out of the targets")
        elif isinstance(base, nn.Conv2d) and (convolutions or _pointwise(base)):
            n_in, n_out, kernel = base.in_channels, base.out_channels, tuple(base.kernel_size)
        else:
            kind = f"a {base.kernel_size[0]}x{base.kernel_size[1]} convolution" if isinstance(base, nn.Conv2d) \
                else type(base).__name__
            if isinstance(base, nn.Conv2d) and base.kernel_size == (1, 1):
                kind += f" with stride {base.stride}, padding {base.padding}, dilation {base.dilation}"
            hint = "; k x k ones with attach(..., convolutions=True)" if isinstance(base, nn.Conv2d) else ""
            raise ValueError(f"{path} is {kind}: LoRA side paths take Linear layers and 1x1 convolutions{hint}")
        found.append((path, parent, name, base, n_in * (kernel[0] * kernel[1] if kernel else 1), n_out, kernel))
    if not found:
        return bank
    w = found[0][3].weight
    size = sum(max_rank * (n_in + n_out) for *_, n_in, n_out, _ in found)
    bank.flat = torch.zeros((slots + 1, size), dtype=w.dtype, device=w.device)
    offset = 0
    for path, parent, name, base, n_in, n_out, kernel in found:
        n_a, n_b = max_rank * n_in, max_rank * n_out
        a = bank.flat[:, offset:offset + n_a].unflatten(1, (max_rank, n_in))
        b = bank.flat[:, offset + n_a:offset + n_a + n_b].unflatten(1, (max_rank, n_out))
        slot = _Slot(a, b, offset, kernel)
        offset += n_a + n_b
        bank.layers[path] = slot
        setattr(parent, name, LoraLayer(base, slot, rows))
    return bank
