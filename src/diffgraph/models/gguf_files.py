"""Reading a user's GGUF file of a diffusion model (the DiT quantisations that city96 / ComfyUI-GGUF publish for
FLUX, Z-Image, Qwen-Image ...): its checked header (gguf_format.py, which has no torch), then its tensors dequantised
on a device. Streamed, checked, never mapped, as `safe_tensors` reads safetensors.

`read_gguf(path, device, dtype, keys)` (or `GgufFile(path).read(...)` after a look at `.header`) reads each tensor's
raw blocks into a host uint8 tensor (`OpenFile.readinto`, in chunks, the file's stamp checked between chunks), moves
them to `device` and dequantises them there (`gguf_quants.dequantize`: torch ops), one tensor at a time, so the
host holds one tensor's blocks. Shapes are torch's, as the model holds them (`GgufHeader.shapes()`: ComfyUI-GGUF's
reshaped tensors get their original shape back), and names the model's (`GgufFile.shapes`, gguf_llm.py): a DiT
file's own, a llama.cpp language model's in transformers' names with the query and key rows its converter permuted
put back (`gguf_llm.unpermuted`, after dequantisation: it moves whole rows). A tensor of a type that
`gguf_quants.READABLE` lacks is refused by name (`UnreadableType`) before anything is read; a file rewritten, cut or
replaced while it is read raises `FileChanged`. No library reads the file: `gguf.GGUFReader` maps it, and a map of a
file that a writer cuts is a SIGBUS.

Load time: `gguf_quants.time_dequantize(device)` times the copy and dequantisation of one large Q4_K tensor, and
`.load_seconds(parameters)` scales it to a whole file (see that module's docstring for the command line).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..safe_files import OpenFile, UnusableFile
from ..safe_tensors import CHUNK, FILE_LIMIT
from .gguf_format import GgufHeader, GgufTensor, NotGguf, checked_gguf_header, gguf_header
from .gguf_llm import model_names, model_shapes, permuted_heads, unpermuted
from .gguf_quants import READABLE, dequantize

__all__ = ["GgufFile", "GgufHeader", "GgufTensor", "NotGguf", "UnreadableType", "gguf_header", "read_gguf"]


class UnreadableType(UnusableFile):
    """A GGUF tensor of a GGML type that diffgraph does not dequantise."""


class GgufFile:
    """An open GGUF file: its checked `header`, then `read` (any number of times) while it is open.

        with GgufFile(path) as f:
            check(f.header)                                   # names, types, architecture: before any weight
            state = f.read(keys=None, device="cuda", dtype=torch.bfloat16)

    Raises safe_files.UnusableFile (NotGguf, UnreadableType, FileChanged), message a phrase after the name."""

    def __init__(self, path: str, max_bytes: int = FILE_LIMIT, chunk: int = CHUNK):
        self.path, self.chunk = path, chunk
        self._file = OpenFile(path, max_bytes)
        try:
            self.header = checked_gguf_header(self._file)
            self.names = model_names(self.header)  # the model's name -> the file's
            self.shapes = model_shapes(self.header)  # the model's name -> its shape as the model holds it
            self._heads = {k: permuted_heads(self.header, k) for k in self.header.tensors}  # (checked before a read)
        except BaseException:
            self._file.close()
            raise

    def read(self, keys: Iterable[str] | None = None, device: torch.device | str | None = None,
             dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """The tensors named by `keys` (the model's names, `self.shapes`; default all), each read, moved to `device`
        (default the CPU) and dequantised there to `dtype` before the next is read; in the order asked (the
        header's by default)."""
        names = list(self.names) if keys is None else list(dict.fromkeys(keys))
        missing = next((k for k in names if k not in self.names), None)
        if missing is not None:
            raise UnusableFile(f"has no tensor {missing[:200]!r}: it is not the kind of file expected here")
        self.check_types(names)
        out = {}
        for key in names:
            t = self.header.tensors[self.names[key]]
            heads = self._heads[t.name]
            raw = self._raw(t)
            if device is not None:
                raw = raw.to(device)
            value = dequantize(raw, t.type_name, t.shape, dtype).reshape(self.shapes[key])
            out[key] = value if heads is None else unpermuted(value, heads)
            del raw, value  # (the host's copy goes before the next tensor is read)
        self._file.unchanged_in_place()
        return out

    def check_types(self, keys: Iterable[str]) -> None:
        """Refuses (`UnreadableType`) the first of the tensors named by `keys` (the model's names) whose GGML type
        diffgraph does not dequantise: from the header, before any tensor is read."""
        tensors = self.header.tensors
        refused = next((tensors[self.names[k]] for k in keys if tensors[self.names[k]].type_name not in READABLE),
                       None)
        if refused is not None:
            raise UnreadableType(f"has tensor {refused.name[:200]!r} in {refused.type_name}, which diffgraph does not "
                                 f"read; use a Q4_K, Q8_0 or F16 file")

    def _raw(self, t: GgufTensor) -> torch.Tensor:
        """One tensor's bytes read in chunks straight into a uint8 tensor, the file's stamp checked after each."""
        raw = torch.empty(t.nbytes, dtype=torch.uint8)
        view = memoryview(raw.numpy())
        for at in range(0, t.nbytes, self.chunk):
            n = min(self.chunk, t.nbytes - at)
            self._file.readinto(view[at:at + n], t.offset + at)
            self._file.unchanged()
        return raw

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "GgufFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_gguf(path: str, device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16,
              keys: Iterable[str] | None = None, max_bytes: int = FILE_LIMIT) -> dict[str, torch.Tensor]:
    """The GGUF file at `path` as a dict of dequantised tensors (`GgufFile.read`): streamed, checked, never mapped."""
    with GgufFile(path, max_bytes) as f:
        return f.read(keys, device, dtype)

