"""Would fp8 attention or fp8 convolutions pay on the GPU (issue 33, point 1)? The UNet's own calls, timed one shape at
a time in CUDA graphs, 16-bit against fp8, summed per step.

torch (2.11 on the GPU host, 2.13 here) has no fp8 attention and no fp8 convolution: `scaled_dot_product_attention`
and `conv2d` refuse float8 inputs, and cuDNN's fp8 attention reached PyTorch only upstream after 2.11 (a
forward-only `_scaled_dot_product_attention_quantized`). So the fp8 side is measured with what can be built here:

  attention: a flash-attention forward kernel in Triton (online softmax, one program per BLOCK_M queries of one
             head), the same code in fp16 and in fp8 (e4m3 Q, K, V with per-tensor scales, P cast to e4m3 before the
             second product, as FlashAttention-3's fp8 path does), beside PyTorch's own `scaled_dot_product_attention`
             in fp16 (cuDNN / flash, what the engine runs). The fp8 kernel's time excludes quantising Q, K and V
             (a fused producer would do it): a bound in fp8's favour.
  conv:      each convolution's GEMM (M = rows x output pixels, K = in channels x kernel, N = out channels) in fp8
             (`torch._scaled_mm`, row-wise scales, a bfloat16 result as its row-wise kernels write) on an im2col
             matrix made ahead (K and N padded to multiples of 16, as `_scaled_mm` needs), against cuDNN's fp16
             convolution (channels-last and NCHW, the faster): an implicit-GEMM fp8 convolution cannot beat its own bare GEMM,
             so if that GEMM does not beat cuDNN by much, no fp8 convolution kernel will.

The shapes are recorded from one eager call of the preset's UNet at `--rows` rows (`--rows 16`: bucket 16, 8 images
with CFG), each shape counted as often as the UNet calls it; a step's total is the sum over calls.

    python3 tools/probe_fp8_kernels.py --preset random:sdxl --rows 16 [--parts attention,conv]   # on the GPU host
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from probe_layout import graph_ms  # noqa: E402  (the probes' timer: one capture, replays)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def record_calls(preset: str, rows: int, size: int | None) -> tuple[collections.Counter, collections.Counter, int]:
    """One eager fp16 call of the preset's UNet at `rows` rows: (attention shapes (B, H, Nq, Nk, D) -> calls,
    convolutions (x shape, w shape, stride, padding, groups) -> calls, the size)."""
    from diffgraph import Engine
    attention: collections.Counter = collections.Counter()
    convs: collections.Counter = collections.Counter()
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, *a, **kw):
        attention[(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3])] += 1
        return real(q, k, v, *a, **kw)

    def conv_hook(module, inputs):
        x = inputs[0]
        convs[(tuple(x.shape), tuple(module.weight.shape), module.stride, module.padding, module.groups)] += 1

    with Engine(preset, device="cuda", dtype="fp16", mode="eager") as e:
        unet = e.model.denoiser
        size = size or e.info.native_size
        hooks = [m.register_forward_pre_hook(conv_hook) for m in unet.modules() if isinstance(m, torch.nn.Conv2d)]
        x = torch.zeros(rows, unet.config.in_channels, size // 8, size // 8, dtype=torch.float16, device="cuda")
        ctx = torch.zeros(rows, 77, unet.config.cross_attention_dim, dtype=torch.float16, device="cuda")
        kw = {}
        if unet.config.addition_embed_type == "text_time":
            kw["added_cond_kwargs"] = {"text_embeds": torch.zeros(rows, 1280, dtype=torch.float16, device="cuda"),
                                       "time_ids": torch.zeros(rows, 6, dtype=torch.float16, device="cuda")}
        F.scaled_dot_product_attention = sdpa
        try:
            unet(x, torch.full((rows,), 500.0, device="cuda"), encoder_hidden_states=ctx, **kw)
        finally:
            F.scaled_dot_product_attention = real
            for h in hooks:
                h.remove()
    return attention, convs, size


# -- attention -----------------------------------------------------------------------------------------------------
def _attention_kernel():
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
               for m, n, w, s in ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4),
                                  (128, 64, 8, 4), (64, 128, 4, 3), (128, 128, 8, 2))]

    @triton.autotune(configs=configs, key=["Nq", "Nk", "BLOCK_D", "IS_FP8"])
    @triton.jit
    def attn_fwd(Q, K, V, O, qk_scale, out_scale, Nq, Nk, D, H,
                 sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, svd, sob, soh, son,
                 BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        start_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :],
                    mask=(offs_m[:, None] < Nq) & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = K + b * skb + h * skh
        v_base = V + b * svb + h * svh
        for start_n in tl.range(0, Nk, BLOCK_N):
            n = start_n + offs_n
            n_ok = n < Nk
            kt = tl.load(k_base + n[None, :] * skn + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            qk = tl.dot(q, kt) * qk_scale
            qk = tl.where(n_ok[None, :], qk, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = tl.load(v_base + n[:, None] * svn + offs_d[None, :] * svd, mask=n_ok[:, None] & d_ok[None, :],
                        other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_ij
        acc = acc / l_i[:, None] * out_scale
        tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], acc.to(O.dtype.element_ty),
                 mask=(offs_m[:, None] < Nq) & d_ok[None, :])

    return attn_fwd


def triton_attention(kernel, q, k, v, out, q_scale=1.0, k_scale=1.0, v_scale=1.0):
    """out = softmax(q k^T / sqrt(D)) v over [B, H, N, D] tensors (q, k contiguous; v contiguous in fp16, or for fp8
    stored [B, H, D, N] and viewed back, the layout Hopper's fp8 products want)."""
    import triton
    b, h, nq, d = q.shape
    nk = k.shape[2]
    block_d = max(32, triton.next_power_of_2(d))
    grid = lambda meta: (triton.cdiv(nq, meta["BLOCK_M"]), b * h)  # noqa: E731
    kernel[grid](q, k, v, out, (d ** -0.5) * 1.4426950408889634 * q_scale * k_scale, v_scale, nq, nk, d, h,
                 q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                 v.stride(0), v.stride(1), v.stride(2), v.stride(3), out.stride(0), out.stride(1), out.stride(2),
                 BLOCK_D=block_d, IS_FP8=q.dtype == FP8)
    return out


def per_tensor_fp8(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    scale = float(t.abs().amax().clamp_min(1e-12)) / FP8_MAX
    return (t / scale).to(FP8), scale


def attention_part(calls: collections.Counter) -> None:
    kernel = _attention_kernel()
    print("attention (B, H, Nq, Nk, D) x calls: ms per call, SDPA fp16 | Triton fp16 | Triton fp8; rel. error vs SDPA")
    totals = [0.0, 0.0, 0.0]
    for (b, h, nq, nk, d), n in sorted(calls.items(), key=lambda kv: -kv[0][2] * kv[0][3] * kv[1]):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, m, d, device="cuda", generator=g, dtype=torch.float16) for m in (nq, nk, nk))
        ref = F.scaled_dot_product_attention(q, k, v)
        out16 = torch.empty_like(q)
        (q8, sq), (k8, sk), (v8, sv) = per_tensor_fp8(q), per_tensor_fp8(k), per_tensor_fp8(v)
        v8t = v8.transpose(2, 3).contiguous().transpose(2, 3)  # [B, H, N, D] view of a [B, H, D, N] tensor
        out8 = torch.empty_like(q)
        ms = [graph_ms(lambda: F.scaled_dot_product_attention(q, k, v)),
              graph_ms(lambda: triton_attention(kernel, q, k, v, out16)),
              graph_ms(lambda: triton_attention(kernel, q8, k8, v8t, out8, sq, sk, sv))]
        err = [float((o.float() - ref.float()).norm() / ref.float().norm()) for o in (out16, out8)]
        for i in range(3):
            totals[i] += ms[i] * n
        print(f"  ({b}, {h}, {nq}, {nk}, {d}) x{n}: {ms[0]:.3f} | {ms[1]:.3f} | {ms[2]:.3f} ms; "
              f"errors {err[0]:.4f} | {err[1]:.4f}")
    print(f"attention per step: SDPA fp16 {totals[0]:.2f} ms | Triton fp16 {totals[1]:.2f} ms | Triton fp8 "
          f"{totals[2]:.2f} ms (fp8 / SDPA {totals[2] / totals[0]:.3f}, fp8 / Triton fp16 {totals[2] / totals[1]:.3f})")


# -- convolutions --------------------------------------------------------------------------------------------------
def conv_part(calls: collections.Counter) -> None:
    print("convolution (x, w, stride, padding) x calls: ms per call, cuDNN fp16 (best layout) | its GEMM fp16 | "
          "its GEMM fp8 (im2col not counted)")
    totals = [0.0, 0.0, 0.0]
    for (xs, ws, stride, padding, groups), n in sorted(calls.items(), key=lambda kv: -kv[1]):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(xs, device="cuda", generator=g, dtype=torch.float16)
        w = torch.randn(ws, device="cuda", generator=g, dtype=torch.float16) * ws[1] ** -0.5
        x_cl, w_cl = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
        cudnn = min(graph_ms(lambda: F.conv2d(x, w, None, stride, padding, 1, groups)),
                    graph_ms(lambda: F.conv2d(x_cl, w_cl, None, stride, padding, 1, groups)))
        out = F.conv2d(x, w, None, stride, padding, 1, groups)
        m = out.shape[0] * out.shape[2] * out.shape[3]
        kdim, ndim = -(-ws[1] * ws[2] * ws[3] // 16) * 16, -(-ws[0] // 16) * 16  # _scaled_mm: multiples of 16
        a = torch.randn(m, kdim, device="cuda", generator=g, dtype=torch.float16)
        bmat = torch.randn(ndim, kdim, device="cuda", generator=g, dtype=torch.float16) * kdim ** -0.5
        a8, b8 = a.to(FP8), bmat.to(FP8)  # b8.t(): column-major, as _scaled_mm wants
        sa = torch.ones(m, 1, device="cuda", dtype=torch.float32)
        sb = torch.ones(1, ndim, device="cuda", dtype=torch.float32)
        gemm16 = graph_ms(lambda: a @ bmat.t())
        gemm8 = graph_ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
        for i, t in enumerate((cudnn, gemm16, gemm8)):
            totals[i] += t * n
        print(f"  x{tuple(xs)} w{tuple(ws)} s{stride[0]} x{n}: {cudnn:.3f} | {gemm16:.3f} | {gemm8:.3f} ms")
    print(f"convolutions per step: cuDNN fp16 {totals[0]:.2f} ms | as GEMMs fp16 {totals[1]:.2f} ms | as GEMMs fp8 "
          f"{totals[2]:.2f} ms (fp8 GEMMs / cuDNN {totals[2] / totals[0]:.3f})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="random:sdxl")
    p.add_argument("--rows", type=int, default=16, help="denoiser rows (bucket 16: 8 images with CFG)")
    p.add_argument("--size", type=int, default=None, help="pixels a side (default: the preset's native size)")
    p.add_argument("--parts", default="attention,conv")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_fp8_kernels: needs a CUDA device (Hopper or newer for fp8)")
        return 2
    with torch.no_grad():
        attention, convs, size = record_calls(args.preset, args.rows, args.size)
        print(f"{args.preset} {size}x{size}, {args.rows} rows, {torch.cuda.get_device_name()}, torch "
              f"{torch.__version__}: {sum(attention.values())} attention calls ({len(attention)} shapes), "
              f"{sum(convs.values())} convolutions ({len(convs)} shapes)")
        parts = args.parts.split(",")
        if "attention" in parts:
            attention_part(attention)
        if "conv" in parts:
            conv_part(convs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
