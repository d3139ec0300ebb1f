"""GGML's tensor types as torch ops: `dequantize` turns one tensor's raw blocks (a uint8 tensor, already on the device
that computes) into values of a torch dtype, on that device, for the types of gguf_format's table (`TYPES`: id ->
name, elements per block, bytes per block: every type a GGUF file may name). `gguf_files` reads the blocks and hands
them here; nothing here reads a file.

Read: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS. Each dequantiser
follows ggml's reference (`dequantize_row_*` in ggml-quants.c, as the `gguf` package's numpy port writes it), in
float32 with the same operations in the same order, so on the CPU it is bit-equal to `gguf.quants.dequantize`; the
result is cast to the caller's dtype once. Blocks are dequantised in slices of `SLICE_ELEMENTS` values, which bounds
the float32 temporaries on the device. The other types (IQ1/IQ2/IQ3, TQ, MXFP4, integer tensors ...) are named in
`TYPES` so a refusal can name them, and are not read.

`time_dequantize(device)` times one large Q4_K tensor's host-to-device copy and dequantisation (random blocks with
finite scales; the file read is not included), as `DequantTiming`; `DequantTiming.load_seconds(parameters)` scales
it to a whole file of that many weights, e.g. on a GPU:

    python -c "from diffgraph.models.gguf_quants import time_dequantize as t; r = t('cuda'); \\
               print(r, r.load_seconds(20_000_000_000))"
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .gguf_format import TYPES, block_shape

QK_K = 256                     # values per K-quant super-block
SLICE_ELEMENTS = 1 << 24       # values dequantised per slice (bounds the float32 temporaries: ~64 MiB each)
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl
# byte offsets of each block's fp16 scales (what `random_blocks` keeps finite)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...],
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The tensor of `shape` (torch order) whose GGML blocks are the uint8 tensor `raw`, as `dtype`, computed on
    raw's device. `type_name` is one of `READERS` or `PLAIN`; raw holds exactly the tensor's bytes."""
    if type_name in PLAIN:
        return raw.view(PLAIN[type_name]).to(dtype).reshape(shape)
    block, size = block_shape(type_name)
    blocks = raw.view(raw.numel() // size, size)
    out = torch.empty(blocks.shape[0], block, dtype=dtype, device=raw.device)
    step = max(1, SLICE_ELEMENTS // block)
    read = READERS[type_name]
    for start in range(0, blocks.shape[0], step):
        out[start:start + step] = read(blocks[start:start + step])
    return out.reshape(shape)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block, as float32 of shape (blocks, 1)."""
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _shifts(values: tuple[int, ...], shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=like.device).reshape(shape)


def _nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """Low then high nibbles of each group of `width` bytes: (blocks, groups, 2 * width), as uint8."""
    n = qs.shape[0]
    return ((qs.reshape(n, groups, 1, width) >> _shifts((0, 4), (1, 1, 2, 1), qs)) & 0x0F).reshape(n, groups, -1)


def _bits(masks: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """Bit j of byte i of each group of `width` bytes, for j in 0..7: (blocks, groups, 8, width), as uint8."""
    n = masks.shape[0]
    return (masks.reshape(n, groups, 1, width) >> _shifts(tuple(range(8)), (1, 1, 8, 1), masks)) & 1


def _crumbs(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """The four 2-bit fields of each group of `width` bytes, lowest first: (blocks, groups, 4, width), as uint8."""
    n = qs.shape[0]
    return (qs.reshape(n, groups, 1, width) >> _shifts((0, 2, 4, 6), (1, 1, 4, 1), qs)) & 3


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 1, 16).reshape(b.shape[0], 32).float() - 8
    return _f16(b, 0) * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:], 1, 16).reshape(b.shape[0], 32).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _q5(b: torch.Tensor, at: int) -> torch.Tensor:
    """Q5_0 / Q5_1's 5-bit values: 4 bytes of high bits at `at` (a little-endian uint32), then the nibbles."""
    n = b.shape[0]
    high = _bits(b[:, at:at + 4], 1, 4).permute(0, 1, 3, 2).reshape(n, 32)  # bit i of the uint32: byte i//8, bit i%8
    return (_nibbles(b[:, at + 4:], 1, 16).reshape(n, 32) | (high << 4)).float()


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_q5(b, 2) - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _q5(b, 4) + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float() * _f16(b, 0)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n, scales = b.shape[0], b[:, :16]
    dl = (_f16(b, 80) * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).reshape(n, 16, 1)
    q = _crumbs(b[:, 16:80], 2, 32).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n, scales = b.shape[0], b[:, 96:108]
    low = _nibbles(scales[:, :8], 1, 8).reshape(n, 16)
    high = _crumbs(scales[:, 8:], 1, 4).reshape(n, 16)
    sc = ((low | (high << 4)).float() - 32)
    dl = (_f16(b, 108) * sc).reshape(n, 16, 1)
    ql = _crumbs(b[:, 32:96], 2, 32).reshape(n, 16, 16)
    qh = _bits(b[:, :32], 1, 32).reshape(n, 16, 16) ^ 1  # a clear bit subtracts 4
    q = ql.float() - (qh << 2).float()
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's eight 6-bit scales and eight 6-bit mins, packed in 12 bytes, as (blocks, 8) uint8 each."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k4(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K's values from their (blocks, 8, 32) quants: d * scale * q - dmin * min, per 32 values."""
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn.float()).reshape(n, 8, 1)
    return (d * q.float() - dm).reshape(n, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k4(b, _nibbles(b[:, 16:], 4, 32).reshape(b.shape[0], 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    low = _nibbles(b[:, 48:], 4, 32).reshape(n, 8, 32)
    high = _bits(b[:, 16:48], 1, 32).reshape(n, 8, 32)
    return _k4(b, low | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(b[:, :128], 2, 64).reshape(n, 8, 32)
    high = _crumbs(b[:, 128:192], 2, 32).reshape(n, 8, 32)
    q = (low | (high << 4)).float() - 32
    return (d * q.reshape(n, 16, 16)).reshape(n, QK_K)


def _iq4(q: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=q.device)[q.long()]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _iq4(_nibbles(b[:, 2:], 1, 16).reshape(b.shape[0], 32))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    high = b[:, 2].int() | (b[:, 3].int() << 8)  # a little-endian uint16 of eight 2-bit high parts
    high = (high.reshape(n, 1) >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3
    low = _nibbles(b[:, 4:8], 4, 1).reshape(n, 8)  # byte i holds scales 2i (low nibble) and 2i+1
    dl = (_f16(b, 0) * ((low.int() | (high << 4)).float() - 32)).reshape(n, 8, 1)
    return (dl * _iq4(_nibbles(b[:, 8:], 8, 16))).reshape(n, QK_K)


READERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q2_K": _q2_k, "Q3_K": _q3_k,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
READABLE = frozenset(READERS) | frozenset(PLAIN)


def random_blocks(type_name: str, n_blocks: int, generator: torch.Generator) -> torch.Tensor:
    """`n_blocks` blocks of random bytes of a quantised type, their fp16 scales finite (within +-1/64), as uint8 of
    shape (n_blocks, bytes per block): data for tests and timings."""
    _, size = block_shape(type_name)
    out = torch.randint(0, 256, (n_blocks, size), dtype=torch.uint8, generator=generator)
    for at in F16_FIELDS[type_name]:
        scale = (torch.rand(n_blocks, 1, generator=generator) - 0.5) / 32
        out[:, at:at + 2] = scale.half().view(torch.uint8)
    return out


@dataclass(frozen=True)
class DequantTiming:
    type_name: str
    shape: tuple[int, ...]
    device: str
    nbytes: int                # the tensor's blocks
    copy_seconds: float        # host to device, median of the repeats
    dequant_seconds: float     # on the device, median of the repeats

    @property
    def values_per_second(self) -> float:
        return math.prod(self.shape) / (self.copy_seconds + self.dequant_seconds)

    def load_seconds(self, parameters: int) -> float:
        """Copy and dequantisation time of a file of `parameters` weights of this type (its read from disk apart)."""
        return parameters / self.values_per_second


def time_dequantize(device: torch.device | str, shape: tuple[int, int] = (3072, 12288), type_name: str = "Q4_K",
                    dtype: torch.dtype = torch.bfloat16, repeats: int = 5) -> DequantTiming:
    """The time to move one tensor's blocks (random, finite scales) to `device` and dequantise them there (the
    default shape: a 3072 x 12288 projection, as in FLUX-sized DiTs)."""
    block, _ = block_shape(type_name)
    host = random_blocks(type_name, math.prod(shape) // block, torch.Generator().manual_seed(0)).reshape(-1)
    host = host.pin_memory() if torch.device(device).type == "cuda" else host
    dequantize(host.to(device), type_name, shape, dtype)  # warm-up (kernels, allocator)
    copies, dequants = [], []
    for _ in range(repeats):
        start = _now(device)
        raw = host.to(device)
        moved = _now(device)
        dequantize(raw, type_name, shape, dtype)
        copies.append(moved - start)
        dequants.append(_now(device) - moved)
    return DequantTiming(type_name, shape, str(device), host.numel(), statistics.median(copies),
                         statistics.median(dequants))


def _now(device: torch.device | str) -> float:
    """perf_counter once the device's queued work is done."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
