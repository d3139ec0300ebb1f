"""Reading a user's safetensors weights that someone else may rewrite while we read them: streamed, checked, never
mapped. Hands its callers (LoRA, embedding, ControlNet and IP-Adapter files, single-file VAEs, each component
of a single-file checkpoint) a dict of tensors that no writer of the file can touch.

`TensorFile` opens the file (`safe_files.OpenFile`: regular files only, within a byte limit) and reads its header
first (`safe_files.checked_header`: bounded, its data offsets tiling the data section exactly), so a caller checks
the header (dtypes, layout) before any tensor is read. `read` then makes each tensor's destination (`torch.empty` at
the file's dtype and shape, on the host or the device asked for) and reads its bytes into it in chunks
(`OpenFile.readinto`: preadv into a view of the tensor, or for a device into one host buffer of at most a chunk,
copied to the tensor's slice; no bytes object, no copy of the file). Between chunks and at the end the open
file's size and mtime are checked against the stat taken before it was opened, and at the end the path is checked
to still name the inode that was read: a file rewritten in place (`cp new old`, `rsync --inplace`), cut or replaced
while it is read raises `FileChanged`, never SIGBUS (nothing here maps the file: no mmap, no `safe_open`, no
`safetensors.torch.load_file`). The kernel stamps mtime at its clock's tick, so a same-size rewrite in the same tick
as the file's previous write is the one change that can go unseen.

Peak host memory while loading, beyond the tensors returned: nothing on the host at the file's dtype (bytes land in
the result); with `dtype`, one tensor at the file's dtype while it is converted; with a `device` off the host, one
buffer of at most `chunk` bytes (made once per open file: no host tensor per weight, so nothing for the allocator
to fragment), so a multi-GB file loads to a GPU with that much host memory, whatever its largest tensor; a
conversion to `dtype` runs on the device. fp8 checks run per chunk over the bytes read (temporaries of at most
`chunk` bytes).

fp8: every float8 tensor read is checked for NaN (e4m3fn) or infinity and NaN (e5m2) by its bit patterns; every
quantisation scale read (a key ending in `scale_weight`, `weight_scale`, `input_scale` or `.scale` whose layer holds
an fp8 tensor; a `.scale` of a layer without one, a norm's, is a weight) must be finite and above zero. A bad value
raises `BadWeights` naming the tensor. Errors are `safe_files`' classes, whose message is a phrase to follow the
file's name (callers name the file, as they name it to their users), ending in how to fix it, except FileChanged's:
a caller reads the file again, or reports it with `CHANGED_FIX`.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .safe_files import FILE_LIMIT, FileStamp, NotSafetensors, OpenFile, SafetensorsHeader, TensorInfo, \
    UnusableFile, checked_header, stamp_of

CHUNK = 64 << 20              # bytes per read between checks of the file's stamp (and per fp8 check temporary)
DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
          "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
          "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64,
          "C64": torch.complex64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
# fp8 bytes that are not finite: (mask, value) with byte & mask == value (e4m3fn: NaN only; e5m2: exponent all ones)
FP8_NONFINITE = {"F8_E4M3": (0x7F, 0x7F), "F8_E5M2": (0x7C, 0x7C)}
SCALE_SUFFIXES = ("scale_weight", "weight_scale", "input_scale", ".scale")
CHANGED_FIX = "wait until it is written completely, then load it again"  # what a caller reporting FileChanged adds


class BadWeights(UnusableFile):
    """A whole, readable file whose values cannot be used (fp8 NaN, a scale that is zero, negative or not finite)."""


class TensorFile:
    """An open safetensors file: its checked `header`, then `read` (any number of times) while it is open.

        with TensorFile(path, limit) as f:
            check(f.header)                                   # dtypes, layout: before any tensor is read
            state = f.read(keys=None, device=None, dtype=None)
            version = f.stamp                                 # the version read (for caches)

    Raises safe_files.UnusableFile (NotSafetensors, FileChanged, BadWeights), message a phrase after the name."""

    def __init__(self, path: str, max_bytes: int = FILE_LIMIT, chunk: int = CHUNK):
        self.path, self.chunk = path, chunk
        self._file = OpenFile(path, max_bytes)
        try:
            self.header: SafetensorsHeader = checked_header(self._file)
        except BaseException:
            self._file.close()
            raise
        self._scales = _quantisation_scales(self.header.tensors)
        self._staging: torch.Tensor | None = None

    @property
    def stamp(self) -> FileStamp:
        return stamp_of(self._file.st)

    def read(self, keys: Iterable[str] | None = None, device: torch.device | str | None = None,
             dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The tensors named by `keys` (default all), in file order, each checked, made on `device` (default the
        host) and converted to `dtype` (floating point ones only; fp8 scales are not applied) before the next one is
        read. Off the host, each chunk passes through one host buffer of at most `chunk` bytes."""
        tensors = self.header.tensors
        names = list(tensors) if keys is None else list(dict.fromkeys(keys))
        missing = next((k for k in names if k not in tensors), None)
        if missing is not None:
            raise UnusableFile(f"has no tensor {missing[:200]!r}: it is not the kind of file expected here")
        staging = self._buffer() if device is not None and torch.device(device).type != "cpu" else None
        out = {}
        for key in sorted(names, key=lambda k: tensors[k].begin):
            t = self._tensor(key, tensors[key], device, staging)
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)  # (on the device: the host never holds a whole tensor there)
            out[key] = t
        self._unchanged()
        return out

    def _tensor(self, key: str, info: TensorInfo, device: torch.device | str | None = None,
                staging: torch.Tensor | None = None) -> torch.Tensor:
        """One tensor's bytes read in chunks, checked as they come, straight into its memory on `device`, or with
        `staging` (a host buffer of at least one chunk's bytes or the tensor's) through it, chunk by chunk."""
        torch_dtype = DTYPES.get(info.dtype)
        if torch_dtype is None:
            raise NotSafetensors(f"holds tensor {key[:200]!r} as {info.dtype}, a dtype this reader does not know "
                                 f"(known: {', '.join(DTYPES)}); convert the file to F16, BF16 or F32")
        out = torch.empty(info.shape, dtype=torch_dtype, device=device)
        flat = out.reshape(-1).view(torch.uint8)
        start = self.header.data_start + info.begin
        for offset in range(0, flat.numel(), self.chunk):
            n = min(self.chunk, flat.numel() - offset)
            into = flat[offset:offset + n] if staging is None else staging[:n]
            self._file.readinto(memoryview(into.numpy()), start + offset)
            self._file.unchanged()  # a writer caught at the next chunk
            if info.dtype in FP8_NONFINITE:
                _check_fp8(key, info.dtype, into)
            if staging is not None:
                flat[offset:offset + n].copy_(into)  # (from pageable memory: the buffer is free again on return)
        if key in self._scales:
            _check_scale(key, out)
        return out

    def _buffer(self) -> torch.Tensor:
        """The host buffer reads to a device pass through: made at the first, kept until `close` (a caller that
        reads one tensor at a time reuses it), of a chunk's bytes or the file's largest tensor's if less."""
        if self._staging is None:
            largest = max((t.end - t.begin for t in self.header.tensors.values()), default=0)
            self._staging = torch.empty(min(self.chunk, largest), dtype=torch.uint8)
        return self._staging

    def _unchanged(self) -> None:
        self._file.unchanged_in_place()

    def close(self) -> None:
        self._staging = None
        self._file.close()

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_safetensors(path: str, max_bytes: int = FILE_LIMIT, *, keys: Iterable[str] | None = None,
                     device: torch.device | str | None = None, dtype: torch.dtype | None = None
                     ) -> dict[str, torch.Tensor]:
    """The safetensors file at `path` as a dict of tensors (`TensorFile.read`): streamed, checked, never mapped."""
    with TensorFile(path, max_bytes) as f:
        return f.read(keys, device, dtype)


def _quantisation_scales(tensors: dict[str, TensorInfo]) -> set[str]:
    """The keys that are scales of fp8 layers: a scale suffix, and an fp8 tensor in the layer it names."""
    fp8_layers = set()
    for key, t in tensors.items():
        if t.dtype in FP8_NONFINITE:
            parts = key.split(".")
            fp8_layers.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    if not fp8_layers:
        return set()
    return {key for key in tensors for suffix in SCALE_SUFFIXES
            if key.endswith(suffix) and key[:-len(suffix)].rstrip(".") in fp8_layers}


def _check_fp8(key: str, dtype: str, raw: torch.Tensor) -> None:
    mask, value = FP8_NONFINITE[dtype]
    bad = int(((raw & mask) == value).sum())
    if bad:
        raise BadWeights(f"holds {bad} NaN or infinite values in fp8 tensor {key[:200]!r}: the file is damaged or was "
                         "quantised wrongly; quantise or download it again")


def _check_scale(key: str, scale: torch.Tensor) -> None:
    values = scale.to(torch.float32)
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        what = f"holds {int((~finite).sum())} NaN or infinite values"
    elif values.numel() and not bool((values > 0).all()):
        what = f"holds {values.min().item():g}, not above zero"
    else:
        return
    raise BadWeights(f"has fp8 scale {key[:200]!r} that {what}: the file is damaged or was quantised wrongly; "
                     "quantise or download it again")
