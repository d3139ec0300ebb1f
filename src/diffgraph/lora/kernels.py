"""A fused LoRA linear for CUDA (Triton): y = x @ W^T + bias + sum_k scale[n, k] * (x @ A[idx[n, k]]^T) @ B[idx[n, k]]
for every batch row n, in one GEMM.

Why: at diffusion activation sizes (4096 tokens x 320 channels per row, 32 rows at batch bucket 16) a side path as
separate kernels reads the activations again for the down projection and reads and writes the output again to add
the up projection: a third more memory traffic on every targeted layer (BENCHMARKS.md: Step cost with adapters).
Here each output tile computes its rows' low-rank activations in the same loop over the input channels that computes
the base product (the input tile is loaded once for both), then adds low @ B before the single store.

Layout: x [N, L, in] (contiguous last dim), W [out, in], A slots [S, R, in], B slots [S, R, out], idx [N, K] int64,
scale [N, K]. The K adapters of a row are one adapter of rank K * R. Tile sizes are fixed by shape (no autotuning:
nothing may benchmark or compile inside a CUDA-graph capture; the warm-up before each capture compiles the kernel).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU installs): callers use the unfused path
    triton = None


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


if triton is not None:
    @triton.jit
    def _lora_linear(x_ptr, w_ptr, bias_ptr, a_ptr, b_ptr, idx_ptr, scale_ptr, y_ptr,
                     L, IN, OUT, stride_xn, stride_xl, stride_xk, stride_yn, stride_yl, stride_yo, stride_as,
                     stride_bs,
                     K: tl.constexpr, R: tl.constexpr, KR: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        n = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        kr = tl.arange(0, KR)
        stack = kr // R
        live = stack < K  # KR may be padded above K * R (tl.dot needs >= 16)
        slot = tl.load(idx_ptr + n * K + stack, mask=live, other=0)
        row_of_slot = slot * stride_as + (kr % R) * IN
        x_rows = x_ptr + n * stride_xn + offs_m[:, None] * stride_xl
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        low = tl.zeros((BLOCK_M, KR), dtype=tl.float32)
        for k0 in range(0, IN, BLOCK_K):
            ks = k0 + offs_k
            x = tl.load(x_rows + ks[None, :] * stride_xk, mask=(offs_m[:, None] < L) & (ks[None, :] < IN), other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * IN + ks[:, None], mask=(offs_n[None, :] < OUT) & (ks[:, None] < IN),
                        other=0.0)
            a = tl.load(a_ptr + row_of_slot[None, :] + ks[:, None], mask=live[None, :] & (ks[:, None] < IN),
                        other=0.0)
            acc += tl.dot(x, w)
            low += tl.dot(x, a)
        scale = tl.load(scale_ptr + n * K + stack, mask=live, other=0.0).to(tl.float32)
        low = (low * scale[None, :]).to(y_ptr.dtype.element_ty)
        b = tl.load(b_ptr + slot[:, None] * stride_bs + (kr % R)[:, None] * OUT + offs_n[None, :],
                    mask=live[:, None] & (offs_n[None, :] < OUT), other=0.0)
        acc += tl.dot(low, b)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < OUT, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + n * stride_yn + offs_m[:, None] * stride_yl + offs_n[None, :] * stride_yo,
                 acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < L) & (offs_n[None, :] < OUT))


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
                idx: torch.Tensor, scale: torch.Tensor, channels_first: bool = False,
                config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """The base linear plus each row's adapters, fused (see the module docstring). x [N, L, in] -> [N, L, out], or
    with `channels_first` (a 1x1 convolution's [N, in, HW]) -> [N, out, HW]. `config`: (BLOCK_M, BLOCK_N,
    BLOCK_K, num_stages, num_warps), else chosen by shape, through the custom op `diffgraph::lora_linear` (opaque to
    torch.compile: the compile tier's Inductor code calls the kernel as it is)."""
    if config is None:
        return torch.ops.diffgraph.lora_linear(x, weight, bias, a, b, idx, scale, channels_first)
    return _launch(x, weight, bias, a, b, idx, scale, channels_first, config)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
            idx: torch.Tensor, scale: torch.Tensor, channels_first: bool,
            config: tuple[int, int, int, int, int] | None) -> torch.Tensor:
    if channels_first:
        n, n_in, length = x.shape
        sxl, sxk = x.stride(2), x.stride(1)
    else:
        n, length, n_in = x.shape
        sxl, sxk = x.stride(1), x.stride(2)
    n_out = weight.shape[0]
    weight = weight.reshape(n_out, -1)
    k, r = idx.shape[1], a.shape[1]
    if channels_first:
        y = torch.empty((n, n_out, length), dtype=x.dtype, device=x.device)
        syl, syo = y.stride(2), y.stride(1)
    else:
        y = torch.empty((n, length, n_out), dtype=x.dtype, device=x.device)
        syl, syo = y.stride(1), y.stride(2)
    kr = max(16, triton.next_power_of_2(k * r))
    block_m, block_n, block_k, stages, warps = config or default_config(n_out, kr)
    grid = (triton.cdiv(length, block_m), triton.cdiv(n_out, block_n), n)
    _lora_linear[grid](x, weight, bias if bias is not None else weight, a, b, idx, scale, y,
                       length, n_in, n_out, x.stride(0), sxl, sxk, y.stride(0), syl, syo,
                       a.stride(0), b.stride(0), K=k, R=r, KR=kr, HAS_BIAS=bias is not None,
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


def default_config(n_out: int, kr: int) -> tuple[int, int, int, int, int]:
    """Tiles by shape, from a sweep over SD1.5's layer shapes at bucket 16 on the H200 (tools/probe_lora_sidepath.py;
    BENCHMARKS.md: Step cost with adapters): 128 x 128 x 64, 3 stages, 8 warps was the best or close to it
    everywhere (even where 128 does not divide the width: 320 = 2.5 tiles); a smaller M tile for wide stacks."""
    if kr <= 64:
        return 128, 128, 64, 3, 8
    return 64, 128, 64, 3, 4


def max_fused_rank() -> int:
    """The widest stack (K * rank) the fused kernel runs; wider ones are faster as two batched matmuls
    (BENCHMARKS.md: Step cost with adapters)."""
    return 64


if triton is not None:
    _op = torch.library.custom_op(
        "diffgraph::lora_linear", mutates_args=(),
        schema="(Tensor x, Tensor weight, Tensor? bias, Tensor a, Tensor b, Tensor idx, Tensor scale, "
               "bool channels_first) -> Tensor")(
        lambda x, weight, bias, a, b, idx, scale, channels_first:
        _launch(x, weight, bias, a, b, idx, scale, channels_first, None))

    @_op.register_fake
    def _lora_linear_shape(x, weight, bias, a, b, idx, scale, channels_first):
        if channels_first:
            return x.new_empty((x.shape[0], weight.shape[0], x.shape[2]))
        return x.new_empty((x.shape[0], x.shape[1], weight.shape[0]))
