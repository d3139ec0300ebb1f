"""The GGUF file format without torch: GGML's tensor types (`TYPES`: id -> name, values per block, bytes per block)
and a file's checked header, which the listing reads (split_files.py: the HTTP process never imports torch) and
gguf_files.py reads before any tensor.

`gguf_header(path)` reads the header only (GGUF versions 2 and 3, little-endian): the metadata key/values (as
`GgufHeader.metadata`; `architecture` is `general.architecture`), and each tensor's name, GGML type and shape, as
`GgufTensor`, so a caller detects the model from the names and types before any weight is read. Shapes are torch's
(GGUF lists dimensions innermost first; they are reversed). `GgufHeader.shapes()` are the shapes the model holds:
ComfyUI-GGUF's converter stores some tensors reshaped to rows of 256 values and their own shape in the metadata
(`comfy.gguf.orig_shape.<name>`, an array of ints), which the header checks (whole, same number of values) and
applies. Everything the header says is bounded before it is used: its size, the counts of keys, tensors and array
items, string lengths, dimensions, the alignment, each tensor's type (a GGML type id), rows whole blocks, data inside
the file and no two tensors overlapping. Anything else is `NotGguf`, one line after the file's name ending in how to
fix it. Standard library only.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Union

from ..safe_files import FILE_LIMIT, FileStamp, MAX_KEY_CHARS, MAX_TENSORS, OpenFile, UnusableFile, stamp_of

# GGML type id -> (name, values per block, bytes per block), as ggml.h and gguf's GGML_QUANT_SIZES list them
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
         7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
         12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
         16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
         20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
         24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
         29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
         39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18)}

HEADER_LIMIT = 64 << 20        # bytes of header (an LLM's, with its tokenizer, has a few MiB; a DiT's a few KiB)
MAX_KEYS = 1 << 16             # metadata keys (files have tens)
MAX_STRING = 16 << 20          # bytes of one metadata string
MAX_DIMS = 4                   # ggml's GGML_MAX_DIMS
MAX_ORIG_DIMS = 8              # of a shape in ComfyUI-GGUF's metadata (its converter keeps tensors of up to 4)
ORIG_SHAPE = "comfy.gguf.orig_shape."  # ComfyUI-GGUF's metadata prefix of a reshaped tensor's own shape
MAX_ALIGNMENT = 1 << 20
DEFAULT_ALIGNMENT = 32
KEPT_ITEMS = 1 << 16           # a longer metadata array (a tokenizer's vocabulary) is skipped, its length kept
BUFFER = 1 << 20               # header bytes read at a time
VERSIONS = (2, 3)              # version 1 counted in 32 bits; 2 and 3 share a layout
FIX = "copy or download it again"
# GGUF metadata value type -> struct format (8: string, 9: array)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9

MetaValue = Union[str, int, float, bool, tuple]


class NotGguf(UnusableFile):
    """A file that is not a whole, sane GGUF file (truncated, still being written, damaged, foreign, hostile)."""


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type_name: str             # the GGML type: "Q4_K", "F16", ... ("IQ2_XXS": listed, not read)
    shape: tuple[int, ...]     # torch order (outermost first)
    offset: int                # of its first byte in the file
    nbytes: int

@dataclass(frozen=True)
class GgufHeader:
    version: int
    metadata: dict[str, MetaValue]
    long_arrays: dict[str, int]        # metadata arrays of more than KEPT_ITEMS items: key -> length (not kept)
    tensors: dict[str, GgufTensor]     # in the header's order
    alignment: int
    data_start: int
    stamp: FileStamp
    orig_shapes: dict[str, tuple[int, ...]]  # ComfyUI-GGUF's shapes of the tensors it stored reshaped

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape as the model holds it (torch order): its original shape where the file stored it
        reshaped, else its own."""
        return {name: self.orig_shapes.get(name, t.shape) for name, t in self.tensors.items()}

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    def types(self) -> dict[str, int]:
        """How many tensors each GGML type holds (a file's quantisation at a glance)."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.type_name] = out.get(t.type_name, 0) + 1
        return out


def _malformed(what: str) -> NotGguf:
    return NotGguf(f"is not a readable GGUF file ({what}): it is damaged or was written wrongly; {FIX}")


def block_shape(type_name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGML type named as in `TYPES`."""
    return next((block, size) for name, block, size in TYPES.values() if name == type_name)


class _Cursor:
    """Reads the header forward, in buffered pieces of the open file, never past HEADER_LIMIT or the file's end."""

    def __init__(self, f: OpenFile):
        self.f, self.pos = f, 0
        self._buf, self._at = b"", 0

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if end > self.f.size:
            raise NotGguf(f"is not a readable GGUF file ({self.f.size} bytes; its header's {what} runs past the "
                          f"end): it is truncated or still being written; {FIX}")
        if end > HEADER_LIMIT:
            raise _malformed(f"its header runs past {HEADER_LIMIT >> 20} MiB at its {what}, far more than a model's")
        if end > self._at + len(self._buf):
            self._at = self.pos
            self._buf = self.f.read(min(max(n, BUFFER), self.f.size - self.pos, HEADER_LIMIT - self.pos), self.pos)
        start = self.pos - self._at
        self.pos = end
        return self._buf[start:start + n]

    def number(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def room(self) -> int:
        return min(self.f.size, HEADER_LIMIT) - self.pos

    def name(self, what: str) -> str:
        """A key or tensor name: UTF-8 of at most MAX_KEY_CHARS bytes."""
        n = self.number("<Q", f"{what}'s length")
        if n > MAX_KEY_CHARS:
            raise _malformed(f"a {what} of {n} bytes, above the limit of {MAX_KEY_CHARS}")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise _malformed(f"a {what} that is not UTF-8") from None


def gguf_header(path: str, max_bytes: int = FILE_LIMIT) -> GgufHeader:
    """The header of the GGUF file at `path`, checked against the file's size; no tensor is read. Raises NotGguf,
    or FileChanged when the file moved while its header was read."""
    with OpenFile(path, max_bytes) as f:
        header = checked_gguf_header(f)
        f.unchanged()
        return header


def checked_gguf_header(f: OpenFile) -> GgufHeader:
    """The GGUF header of the open file, checked against its size. Raises NotGguf, or FileChanged when the file moved
    while its header was read."""
    try:
        return _header(f)
    except NotGguf:
        f.unchanged()  # a file being written reads as a truncated one: FileChanged when it moved meanwhile
        raise


def _header(f: OpenFile) -> GgufHeader:
    c = _Cursor(f)
    magic = c.take(4, "magic")
    if magic != b"GGUF":
        raise NotGguf(f"is not a GGUF file (it starts with {magic!r}, not b'GGUF'); download the .gguf file again")
    version = c.number("<I", "version")
    if version not in VERSIONS:
        raise NotGguf(_version_refusal(version))
    n_tensors, n_keys = c.number("<Q", "tensor count"), c.number("<Q", "key count")
    if n_tensors > MAX_TENSORS or n_keys > MAX_KEYS:
        raise _malformed(f"its header counts {n_tensors} tensors and {n_keys} metadata keys, above the limits of "
                         f"{MAX_TENSORS} and {MAX_KEYS}")
    metadata: dict[str, MetaValue] = {}
    long_arrays: dict[str, int] = {}
    for _ in range(n_keys):
        key = c.name("metadata key")
        if key in metadata or key in long_arrays:
            raise _malformed(f"metadata key {key[:200]!r} appears twice")
        value = _value(c, c.number("<I", "value type"), key)
        if isinstance(value, _Long):
            long_arrays[key] = value.count
        else:
            metadata[key] = value
    alignment = _alignment(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    infos = [_tensor_info(c) for _ in range(n_tensors)]
    data_start = -(-c.pos // alignment) * alignment
    tensors = _placed(infos, data_start, alignment, f.size)
    return GgufHeader(version, metadata, long_arrays, tensors, alignment, data_start, stamp_of(f.st),
                      _orig_shapes(metadata, tensors))


def _version_refusal(version: int) -> str:
    if (version & 0xFFFF) == 0 and (version >> 24) in VERSIONS:
        return "is a big-endian GGUF file, which diffgraph does not read; use the little-endian file of the model"
    if version < min(VERSIONS):
        return (f"is a GGUF version {version} file, older than diffgraph reads ({', '.join(map(str, VERSIONS))}); "
                "convert it again with a current gguf, or download a newer file")
    return (f"is a GGUF version {version} file, newer than diffgraph reads ({', '.join(map(str, VERSIONS))}); "
            "download a version 3 file")


@dataclass(frozen=True)
class _Long:
    count: int


def _value(c: _Cursor, kind: int, key: str) -> MetaValue | _Long:
    what = f"metadata {key[:200]!r}"
    if kind in SCALARS:
        return c.number(SCALARS[kind], what)
    if kind == STRING:
        return _string(c, what)
    if kind != ARRAY:
        raise _malformed(f"{what} has value type {kind}, not a GGUF type")
    item, count = c.number("<I", f"{what}'s item type"), c.number("<Q", f"{what}'s length")
    if item not in SCALARS and item != STRING:
        raise _malformed(f"{what} is an array of {'arrays' if item == ARRAY else f'value type {item}'}, "
                         "which GGUF files do not hold")
    least = struct.calcsize(SCALARS[item]) if item in SCALARS else 8
    if count * least > c.room():
        raise _malformed(f"{what} is an array of {count} items, more than its header's {c.room()} bytes left hold")
    if item == STRING:
        items = [_string(c, what) for _ in range(count)]
    else:
        raw = c.take(count * least, what)
        items = [] if count > KEPT_ITEMS else list(struct.unpack(f"<{count}{SCALARS[item][1]}", raw))
    return _Long(count) if count > KEPT_ITEMS else tuple(items)


def _string(c: _Cursor, what: str) -> str:
    n = c.number("<Q", f"{what}'s length")
    if n > MAX_STRING:
        raise _malformed(f"{what} is a string of {n} bytes, above the limit of {MAX_STRING}")
    return c.take(n, what).decode("utf-8", errors="replace")


def _alignment(value: MetaValue) -> int:
    if type(value) is not int or not 1 <= value <= MAX_ALIGNMENT or value & (value - 1):
        raise _malformed(f"its general.alignment is {value!r}, not a power of two up to {MAX_ALIGNMENT}")
    return value


@dataclass(frozen=True)
class _Info:
    name: str
    type_name: str
    dims: tuple[int, ...]      # GGUF order (innermost first)
    offset: int                # in the data section


def _tensor_info(c: _Cursor) -> _Info:
    name = c.name("tensor name")
    what = f"tensor {name[:200]!r}"
    n_dims = c.number("<I", f"{what}'s dimension count")
    if n_dims > MAX_DIMS:
        raise _malformed(f"{what} has {n_dims} dimensions, above GGML's {MAX_DIMS}")
    dims = struct.unpack(f"<{n_dims}Q", c.take(8 * n_dims, f"{what}'s dimensions"))
    kind = c.number("<I", f"{what}'s type")
    if kind not in TYPES:
        raise _malformed(f"{what} has type {kind}, not a GGML type diffgraph knows; use a Q4_K, Q8_0 or F16 file")
    return _Info(name, TYPES[kind][0], dims, c.number("<Q", f"{what}'s offset"))


def _placed(infos: list[_Info], data_start: int, alignment: int, size: int) -> dict[str, GgufTensor]:
    """The tensors with their bytes checked: whole blocks per row, inside the file, aligned, none overlapping."""
    tensors: dict[str, GgufTensor] = {}
    for info in infos:
        what = f"tensor {info.name[:200]!r}"
        if info.name in tensors:
            raise _malformed(f"{what} appears twice")
        block, block_bytes = block_shape(info.type_name)
        row = info.dims[0] if info.dims else 1
        if row % block:
            raise _malformed(f"{what} has rows of {row} values, not whole {info.type_name} blocks of {block}")
        nbytes = math.prod(info.dims) // block * block_bytes
        if info.offset % alignment:
            raise _malformed(f"{what} starts at data offset {info.offset}, not a multiple of the alignment "
                             f"{alignment}")
        if data_start + info.offset + nbytes > size:
            raise NotGguf(f"is not a readable GGUF file ({what} of {list(reversed(info.dims))} ends at byte "
                          f"{data_start + info.offset + nbytes}, past the file's end at {size}): it is truncated "
                          f"or still being written; {FIX}")
        tensors[info.name] = GgufTensor(info.name, info.type_name, tuple(reversed(info.dims)),
                                        data_start + info.offset, nbytes)
    ordered = sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes))
    for before, after in zip(ordered, ordered[1:]):
        if after.offset < before.offset + before.nbytes:
            raise _malformed(f"tensor {after.name[:200]!r} overlaps tensor {before.name[:200]!r}")
    return tensors




def _orig_shapes(metadata: dict[str, MetaValue], tensors: dict[str, GgufTensor]) -> dict[str, tuple[int, ...]]:
    """ComfyUI-GGUF's `comfy.gguf.orig_shape.<name>` entries, each checked: a tensor of the file, positive ints of as
    many values as the tensor holds."""
    out = {}
    for key, value in metadata.items():
        if not key.startswith(ORIG_SHAPE):
            continue
        name = key[len(ORIG_SHAPE):]
        t = tensors.get(name)
        if t is None:
            raise _malformed(f"its metadata {key[:200]!r} gives the shape of a tensor it does not hold")
        if not (isinstance(value, tuple) and 0 < len(value) <= MAX_ORIG_DIMS
                and all(type(d) is int and d > 0 for d in value) and math.prod(value) == math.prod(t.shape)):
            raise _malformed(f"its metadata {key[:200]!r} is {str(value)[:100]}, not a shape of the tensor's "
                             f"{math.prod(t.shape)} values")
        out[name] = tuple(value)
    return out
