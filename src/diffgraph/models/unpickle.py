"""Reading pickle checkpoints without running them: a restricted unpickler that rebuilds tensors and nothing else.

`read_pickle_checkpoint(path)` returns what a `.ckpt` / `.pt` / `.pth` / `.bin` file pickled, with every tensor
rebuilt from its stored bytes and every other global replaced by a `Stub` that records its name. Only torch's
tensor-rebuild functions (`torch._utils._rebuild_tensor_v2` and kin, each answered by our own function here, never
torch's), its storage types and dtypes, `collections.OrderedDict` and `_codecs.encode` (how protocol 2 stores bytes)
are resolved; any other global (`os.system`, a Lightning callback, numpy) is a Stub class, so a REDUCE of it builds
an inert Stub and a malicious payload has no effect. Both of torch.save's formats are read: the zip archive
(`archive/data.pkl` beside `archive/data/<key>` storages) and the legacy stream (magic, protocol, system info,
the object, its storage keys, then the storages). Storages are bounded by the file's own size.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from typing import Any, Callable

import torch

from ..safe_files import check_regular

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_STORAGE_DTYPES = {"DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
                   "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                   "BoolStorage": torch.bool, "UntypedStorage": torch.uint8}
_DTYPES = {name: getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "double", "float", "half", "long", "int", "short")}


class Stub:
    """A global the checkpoint names but the reader does not rebuild: an inert object, whatever it is called with."""

    qualname = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> "Stub":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"<stub {self.qualname}>"


def _stub(module: str, name: str) -> type:
    return type("Stub", (Stub,), {"qualname": f"{module}.{name}"})


class _StorageType:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


class _Storage:
    """One storage's bytes, as a flat tensor of its dtype."""

    def __init__(self, data: bytes, dtype: torch.dtype):
        self.flat = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> torch.Tensor:
    if not isinstance(storage, _Storage):
        raise ValueError("a tensor refers to a storage the file does not hold")
    if not (isinstance(offset, int) and isinstance(size, tuple) and isinstance(stride, tuple)
            and len(size) == len(stride) and all(isinstance(x, int) and x >= 0 for x in (offset, *size, *stride))):
        raise ValueError("a tensor has a malformed size, stride or offset")
    extent = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else 0
    if extent > storage.flat.numel():
        raise ValueError("a tensor reaches past the end of its storage")
    return torch.as_strided(storage.flat, size, stride, offset).clone()


def _rebuild_tensor_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                       dtype: Any, *rest: Any) -> torch.Tensor:
    if not isinstance(storage, _Storage) or not isinstance(dtype, torch.dtype):
        raise ValueError("a tensor refers to a storage the file does not hold")
    typed = _Storage(b"", dtype)
    typed.flat = storage.flat.view(dtype)
    return _rebuild_tensor(typed, offset, size, stride)


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data  # a Parameter's tensor; requires_grad and hooks do not belong in a weights file


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    return func(*args) if func in _REBUILDERS.values() and isinstance(args, tuple) else Stub()


def _codecs_encode(text: Any, encoding: Any = "latin1") -> bytes:
    if not isinstance(text, str) or encoding != "latin1":
        raise ValueError("the pickle encodes bytes in an unexpected way")
    return text.encode("latin1")


_REBUILDERS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("collections", "OrderedDict"): OrderedDict,
    ("_codecs", "encode"): _codecs_encode,
}


class _Unpickler(pickle._Unpickler):  # the Python one: its BUILD can be narrowed (state dicts' pickles are small)
    def __init__(self, stream: Any, load_storage: Callable[[tuple], _Storage], scan: bool = False):
        super().__init__(stream)
        self._load_storage = load_storage
        self._scan = scan  # only the storages' ids are wanted: tensors are not rebuilt
        self.dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: _Unpickler._build}

    def _build(self) -> None:
        """BUILD sets an object's state: only a Stub takes it (and drops it); on a tensor or a dict it would run
        their __setstate__ or fill their __dict__, so there it is left out."""
        self.stack.pop()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _REBUILDERS:
            return _stub(module, name) if self._scan else _REBUILDERS[(module, name)]
        if module in ("torch", "torch.storage") and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        return _stub(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and isinstance(pid[4], int)):
            raise ValueError("the pickle refers to an object that is not a tensor storage")
        return self._load_storage(pid)


def read_pickle_checkpoint(path: str, max_bytes: int = 1 << 40) -> Any:
    """The object `path` pickled (torch.save's zip or legacy format), tensors rebuilt, other globals stubbed. A file
    that is neither, or is damaged, is a one-line ValueError."""
    size = check_regular(path, max_bytes).st_size
    try:
        if zipfile.is_zipfile(path):
            return _read_zip(path, size)
        with open(path, "rb") as f:
            return _read_legacy(f, size)
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, struct.error, TypeError, AttributeError,
            IndexError, KeyError, RuntimeError) as e:
        raise ValueError(f"{path!r} is not a readable torch checkpoint ({type(e).__name__}: {str(e)[:120]}); "
                         "check that the download is complete, or convert it where it was made") from None


def _read_zip(path: str, size: int) -> Any:
    with zipfile.ZipFile(path) as z:
        pickles = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise ValueError(f"{path!r} is a zip but not a torch.save archive (no single <name>/data.pkl); give a "
                             "checkpoint written by torch.save")
        root = pickles[0][: -len("data.pkl")]
        if root + "byteorder" in z.namelist() and z.read(root + "byteorder").strip() != b"little":
            raise ValueError(f"{path!r} was saved on a big-endian machine; convert it there")
        storages: dict[str, _Storage] = {}

        def load(pid: tuple) -> _Storage:
            key = pid[2]
            if key not in storages:
                info = z.getinfo(f"{root}data/{key}")
                if info.file_size > size * 1100 or info.file_size % pid[1].dtype.itemsize:  # compressed: bounded
                    raise ValueError(f"{path!r} holds a storage of an impossible size; the file is damaged")
                storages[key] = _Storage(z.read(info), pid[1].dtype)
            return storages[key]

        return _Unpickler(io.BytesIO(z.read(pickles[0])), load).load()


def _read_legacy(f: Any, size: int) -> Any:
    """torch's pre-1.6 format: the storages follow the pickled object, each as an int64 element count and bytes."""
    def header() -> Any:
        return _Unpickler(f, lambda pid: (_ for _ in ()).throw(ValueError("a storage in a header"))).load()

    if header() != LEGACY_MAGIC:
        raise ValueError(f"{f.name!r} is neither a torch.save zip nor a legacy torch checkpoint (no magic number); "
                         "give a .ckpt/.pt/.pth/.bin written by torch.save")
    header()  # the protocol version
    header()  # system info
    pending: dict[str, tuple[torch.dtype, _Storage]] = {}

    def load(pid: tuple) -> _Storage:
        if pid[2] not in pending:
            pending[pid[2]] = (pid[1].dtype, _Storage(b"", pid[1].dtype))
        if pending[pid[2]][0] != pid[1].dtype:
            raise ValueError("one storage is read as two dtypes; the file is damaged")
        return pending[pid[2]][1]

    # the storages follow the object: a first pass collects their ids, a second rebuilds the tensors
    marker = f.tell()
    _Unpickler(f, load, scan=True).load()
    keys = header()
    if not isinstance(keys, list) or set(keys) != set(pending):
        raise ValueError(f"{f.name!r} lists storages its object does not use; the file is damaged")
    for key in keys:
        dtype = pending[key][0]
        count = struct.unpack("<q", f.read(8))[0]
        nbytes = count * dtype.itemsize
        if not 0 <= nbytes <= size:
            raise ValueError(f"{f.name!r} holds a storage of an impossible size; the file is damaged")
        data = f.read(nbytes)
        if len(data) != nbytes:
            raise ValueError(f"{f.name!r} ends inside a storage; the download is incomplete")
        pending[key][1].flat = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
    end = f.tell()
    f.seek(marker)
    obj = _Unpickler(f, lambda pid: pending[pid[2]][1]).load()  # now every storage holds its bytes
    f.seek(end)
    return obj
