"""Quantised denoisers: `fp8.py` runs a denoiser's transformer linears in float8_e4m3fn through
`torch._scaled_mm`, with static weight scales and per-token activation scales, inside our CUDA graphs."""

from .fp8 import (Fp8Config, Fp8Linear, Fp8Report, SkipReason, fp8_linear, fp8_mm, quantize_linears, quantize_rows,
                  quantize_weight, relative_error, transformer_linears, weight_count)

__all__ = ["Fp8Config", "Fp8Linear", "Fp8Report", "SkipReason", "fp8_linear", "fp8_mm", "quantize_linears",
           "quantize_rows", "quantize_weight", "relative_error", "transformer_linears", "weight_count"]
