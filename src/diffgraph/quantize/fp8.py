"""fp8 (float8_e4m3fn) Linear layers for denoisers that run inside our own CUDA graphs.

Owns the op `diffgraph::fp8_mm` with `fp8_linear` around it, the module `Fp8Linear` that calls it, and
`quantize_linears`, which swaps the transformer linears of a denoiser (a diffusers UNet2DConditionModel's names) for
Fp8Linear in place and hands back an `Fp8Report`. `relative_error` is the accuracy measure the tests and
`diffgraph compare --quantize fp8` share.

Scales: the weight's are static (one per output channel, or one per tensor), computed once here; the activation's
are dynamic and per token (one per row of the flattened [tokens, in_features] input), so a batch row's numbers never
depend on its batch companions, and one request's outlier cannot cost the others their precision. Nothing here
syncs with the host (no `.item()`, no data-dependent shape), so a step that calls it is capturable in a CUDA graph.

Only the matmul is an opaque custom op (its fake gives torch.compile the output shape and dtype): Inductor never
tries to compile `torch._scaled_mm` itself (reported to hang under torchao's compile), while the per-token
quantisation before it and the cast after it are plain tensor ops, which the compile tier fuses with the layers
around them (eager, they stay a few elementwise kernels per layer).

CUDA constraints of `_scaled_mm` (H100/H200), met here: mat1 row-major, mat2 column-major (the row-major
[out, in] fp8 weight transposed with `.t()`), in and out features multiples of 16 (`from_linear` refuses others),
contiguous [M, 1] and [1, N] scales, and with row-wise scales a bfloat16 result: on CUDA the op computes in
bfloat16 and casts to the input's dtype; on the CPU it computes in the input's dtype.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import torch
from torch import nn

from ..config import FP8_MIN_FEATURES, GRANULARITIES, Fp8Config, check_granularity  # noqa: F401 (re-exports)

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
AMAX_FLOOR = 1e-12  # an all-zero row gets this amax: its scale stays finite and it quantises to zeros, not NaN
# diffusers' transformer-block linears (attention projections, feed-forward, and the Transformer2DModel's
# proj_in / proj_out where they are Linear); time, class and added embeddings are not among them
TRANSFORMER_LINEARS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out")


def quantize_weight(weight: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight [out, in], float32 scale [out] for "channel" or [1] for "tensor"), weight ~ q * scale."""
    check_granularity(granularity)
    w = weight.detach().float()
    amax = w.abs().amax(dim=1) if granularity == "channel" else w.abs().amax().reshape(1)
    scale = amax.clamp(min=AMAX_FLOOR) / E4M3_MAX
    q = (w / scale.reshape(-1, 1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn rows [M, K], float32 scales [M, 1]) of a [M, K] activation, one scale per row (token), so a
    row's numbers never depend on the other rows. Plain tensor ops: Inductor fuses them into one reduction and one
    pointwise kernel (and into the op that made `x2d`); eager, they are a few elementwise kernels."""
    # abs and amax are exact in x's dtype; the division promotes to float32 (one kernel, no separate upcast)
    scale = x2d.abs().amax(dim=1, keepdim=True).float().clamp(min=AMAX_FLOOR) / E4M3_MAX
    return (x2d / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


@torch.library.custom_op("diffgraph::fp8_mm", mutates_args=(),
                         schema="(Tensor qx, Tensor scale_x, Tensor weight, Tensor weight_scale, Tensor? bias) -> Tensor")
def fp8_mm(qx: torch.Tensor, scale_x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """`torch._scaled_mm` of e4m3 rows `qx` [M, K] (scales [M, 1]) by the fp8 weight [N, K] (scales [N] or [1]), plus
    `bias`: [M, N] in bfloat16 on CUDA (the row-wise kernels write bfloat16 only), in float32 on the CPU. Opaque to torch.compile (its fake gives the shape): Inductor never tries to compile _scaled_mm."""
    n = weight.shape[0]
    scale_w = weight_scale.reshape(1, -1).expand(1, n).contiguous()  # a tensor-wise scale as a [1, N] row
    out_dtype = _mm_dtype(qx)
    return torch._scaled_mm(qx, weight.t(), scale_a=scale_x, scale_b=scale_w,
                            bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype)


def _mm_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if t.is_cuda else torch.float32


@fp8_mm.register_fake
def _fp8_mm_shape(qx: torch.Tensor, scale_x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    return qx.new_empty((qx.shape[0], weight.shape[0]), dtype=_mm_dtype(qx))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ W^T + bias with x quantised per token to e4m3 (`quantize_rows`) and W the fp8 weight [out, in] times
    `weight_scale` ([out] or [1], float32), through the opaque `diffgraph::fp8_mm`. Returns x's dtype and shape
    [..., out]; the quantisation and the final cast are traceable, so the compile tier fuses them."""
    qx, scale_x = quantize_rows(x.reshape(-1, x.shape[-1]))
    y = torch.ops.diffgraph.fp8_mm(qx, scale_x, weight, weight_scale, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)


class Fp8Linear(nn.Module):
    """An nn.Linear whose weight is float8_e4m3fn (buffer `weight` [out, in], buffer `weight_scale` float32) and whose
    activations are quantised per token on each call. Inference only (the op has no backward)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 granularity: str):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.granularity = granularity
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        # kept in the matmul's output dtype (bfloat16 on CUDA), so no call casts it again
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(_mm_dtype(bias)), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight_granularity: str = "channel") -> Fp8Linear:
        """The fp8 copy of `linear` (on its device; the bias in the matmul's output dtype). Both dims must be multiples of
        16 (`_scaled_mm` on CUDA)."""
        if linear.in_features % 16 or linear.out_features % 16:
            raise ValueError(f"Linear [{linear.out_features}, {linear.in_features}] cannot run in fp8: in_features and "
                             f"out_features must be multiples of 16; leave this layer in 16-bit")
        q, scale = quantize_weight(linear.weight, weight_granularity)
        return cls(q, scale, linear.bias, weight_granularity)

    @torch.no_grad()
    def requantize(self, weight: torch.Tensor) -> None:
        """Rewrites `weight` and `weight_scale` in place from a new 16-bit (or fp32) weight [out, in], e.g. with an
        adapter fused in: a captured graph reads these tensors, so they must never move."""
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"requantize got a weight of shape {list(weight.shape)}; this layer needs "
                             f"[{self.out_features}, {self.in_features}]")
        q, scale = quantize_weight(weight.to(self.weight.device), self.granularity)
        self.weight.copy_(q)
        self.weight_scale.copy_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != torch.float8_e4m3fn:  # metadata only: no sync, nothing in the captured graph
            raise ValueError(f"Fp8Linear weight is {self.weight.dtype}, not float8_e4m3fn: the model was cast after "
                             f"quantize_linears; cast it first (model.to(dtype)), then quantise")
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight=float8_e4m3fn, weight_granularity={self.granularity}, activations=per-token")


class SkipReason(enum.Enum):
    NOT_SELECTED = "not selected"
    NOT_MULTIPLE_OF_16 = "dims not multiples of 16"
    BELOW_MIN_FEATURES = "in_features below min_features"


@dataclasses.dataclass(frozen=True)
class Fp8Report:
    """What `quantize_linears` did: the qualified names it quantised, every other nn.Linear with why it was skipped,
    and the weight bytes saved (16-bit or fp32 weights minus fp8 weights and their scales)."""
    quantized: tuple[str, ...]
    skipped: tuple[tuple[str, SkipReason], ...]
    bytes_saved: int

    def skipped_for(self, reason: SkipReason) -> tuple[str, ...]:
        return tuple(name for name, why in self.skipped if why is reason)

    def summary(self) -> str:
        counts = ", ".join(f"{len(self.skipped_for(r))} {r.value}" for r in SkipReason if self.skipped_for(r))
        return (f"fp8: {len(self.quantized)} linears quantised, {self.bytes_saved / 2**20:.1f} MiB of weights saved; "
                f"{len(self.skipped)} left as they were ({counts or 'none'})")


def transformer_linears(name: str, linear: nn.Linear) -> bool:
    """The default selection: the linears of diffusers' transformer blocks (TRANSFORMER_LINEARS), by qualified name
    (a LoRA side path's wrapped layer, `<name>.base`, by its layer's name: its side path stays 16-bit)."""
    return _named(TRANSFORMER_LINEARS, name)


def named_linears(names: tuple[str, ...]) -> Callable[[str, nn.Linear], bool]:
    """A selection by qualified-name suffixes (a family's blocks, e.g. Z-Image's `feed_forward.w1`): the linears
    named `s` or ending in `.s` for an `s` of `names`, as `transformer_linears` selects its own."""
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"fp8 layer names {names!r} must be a non-empty tuple of non-empty names")
    return lambda name, linear: _named(names, name)


def _named(names: tuple[str, ...], name: str) -> bool:
    name = name.removesuffix(".base")
    return any(name == s or name.endswith("." + s) for s in names)


def quantize_linears(module: nn.Module, *, min_features: int = FP8_MIN_FEATURES,
                     select: Callable[[str, nn.Linear], bool] | None = None,
                     weight_granularity: str = "channel") -> Fp8Report:
    """Replaces in place each nn.Linear of `module` (exactly nn.Linear: a subclass may have its own forward, or a
    parent that reads its weight) that `select(name, linear)` picks (default `transformer_linears`), whose dims are
    multiples of 16 and whose in_features >= min_features (fp8 pays on wide layers only, once the activations'
    quantisation is counted: `tools/probe_fp8.py widths --compile`; BENCHMARKS.md: fp8 linears in the compile tier).
    Quantise after the model's final `.to(device, dtype)`: a cast
    afterwards would turn the fp8 weights into floats. Quantising a module twice is refused (not a no-op)."""
    check_granularity(weight_granularity)
    done = sum(isinstance(m, Fp8Linear) for m in module.modules())
    if done:
        raise ValueError(f"the module already holds {done} Fp8Linear layers (quantize_linears ran on it); quantise "
                         f"a fresh copy of the model, or change weights with Fp8Linear.requantize")
    select = select or transformer_linears
    chosen: list[str] = []
    skipped: list[tuple[str, SkipReason]] = []
    for name, child in module.named_modules():
        if type(child) is not nn.Linear or not name:  # the root itself cannot be replaced in place
            continue
        if not select(name, child):
            skipped.append((name, SkipReason.NOT_SELECTED))
        elif child.in_features % 16 or child.out_features % 16:
            skipped.append((name, SkipReason.NOT_MULTIPLE_OF_16))
        elif child.in_features < min_features:
            skipped.append((name, SkipReason.BELOW_MIN_FEATURES))
        else:
            chosen.append(name)
    if not chosen:
        small = sum(why is SkipReason.BELOW_MIN_FEATURES for _, why in skipped)
        raise ValueError(f"no nn.Linear qualifies for fp8 ({len(skipped)} linears; {small} below min_features="
                         f"{min_features}); lower min_features or pass a wider select")
    saved = 0
    for name in chosen:
        linear = module.get_submodule(name)
        fp8 = Fp8Linear.from_linear(linear, weight_granularity)
        saved += linear.weight.nbytes - fp8.weight.nbytes - fp8.weight_scale.nbytes
        module.set_submodule(name, fp8)
    return Fp8Report(quantized=tuple(chosen), skipped=tuple(skipped), bytes_saved=saved)


def weight_count(module: nn.Module) -> int:
    """The module's weight count: its parameters and its fp8 layers' weights, which are buffers (`diffgraph info`
    would otherwise leave the quantised layers out)."""
    return (sum(p.numel() for p in module.parameters())
            + sum(m.weight.numel() for m in module.modules() if isinstance(m, Fp8Linear)))


def relative_error(reference: torch.Tensor, output: torch.Tensor) -> float:
    """||output - reference||_2 / ||reference||_2, in float64 (0.0 when both are zero)."""
    if reference.shape != output.shape:
        raise ValueError(f"relative_error needs tensors of one shape; got {list(reference.shape)} and "
                         f"{list(output.shape)}")
    ref = reference.detach().double()
    diff = float((output.detach().double() - ref).norm())
    norm = float(ref.norm())
    return diff / norm if norm else (0.0 if diff == 0 else float("inf"))
