"""Textual-inversion embeddings of an `--embeddings-dir` folder, for prompts that name them: which exist, what their
headers say, and their vectors checked against the model's text encoders. Hands `Embedding`s (float32 vectors on
the CPU, per encoder key) to the prompt encoding; it knows nothing of tokenizers or models beyond their widths.

Names and safety are every capability's named files' (features/slot_files.py `Folder`): each *.safetensors file
under the folder is an embedding named by its relative path without the suffix, "/" between folders; a name that is
absolute, holds "..", a backslash or a NUL, or resolves outside the folder (links included) is refused; pickles
(.pt/.bin/.ckpt/.pth) are never read, the listing reports them as ignored; an entry that is not a regular file is
refused by a stat, never opened; files above `MAX_EMBEDDING_BYTES` are refused (embeddings are kilobytes). Files are
read into memory by `safe_tensors` (streamed into the tensors, never a memory map), never by torch.load. The vectors
read are host copies in a `SlotFiles` without slots (`files`), as every capability's named files are: one per file
version, the most recent `CACHED` kept within `CACHED_BYTES`; a file rewritten on disk is a new version, read again
(rows in flight keep the vectors they began with), and one rewritten while it is read is located and read again.

File layouts, as diffusers' `load_textual_inversion` and AUTOMATIC1111 read them:
  - kohya / A1111 `emb_params`: one tensor [vectors, width];
  - A1111's `string_to_param` dict flattened into keys (`string_to_param.*`; `string_to_token.*` is ignored);
  - diffusers' learned embeds: one tensor named by its token, [width] or [vectors, width];
  - SDXL: `clip_l` [vectors, 768] and `clip_g` [vectors, 1280], one per text encoder.
A single-tensor file gives its vectors under the encoder key "default" (a one-encoder model); an SDXL file under
"clip_l" and "clip_g". `load` refuses a file whose widths are not the model's, naming both.
"""

from __future__ import annotations

import difflib
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..errors import ParamError
from ..features.slot_files import PICKLES, Folder, NameRefused, NameUnknown, NameUnusable, SlotFiles
from ..safe_files import FileChanged, FileStamp, SafetensorsHeader, TensorInfo, UnusableFile, check_regular, \
    read_header, stamp_of

if TYPE_CHECKING:  # the listing runs in the HTTP process, which never imports torch (only _read needs it)
    import torch

MAX_EMBEDDING_BYTES = 64 << 20   # a 75-vector SDXL embedding in fp32 is 0.6 MB
MAX_VECTORS = 75                 # what one 77-token CLIP window holds besides its start and end tokens
MAX_VALUE = 65504.0              # fp16's largest: text encoders may run in fp16
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
DEFAULT = "default"              # the encoder key of a one-encoder model
ENCODER_KEYS = ("clip_l", "clip_g")
CACHED = 256                     # embeddings kept in memory (least recently used leave first) ...
CACHED_BYTES = 64 << 20          # ... within these bytes of vectors (a 75-vector SDXL one is 0.6 MB)
READ_TRIES = 3                   # header reads of a file that changes while it is read (listings)
WIDTHS_HINT = "SD1.x embeddings are 768 wide, SD2.x ones 1024; SDXL ones pair clip_l 768 with clip_g 1280"
PICKLE_REASON = ("a pickle, which is never read (loading one can run code): convert it with `diffgraph convert "
                 "FILE NAME.safetensors` (it rebuilds the tensors and runs nothing in the file)")


class EmbeddingError(ValueError):
    """An embedding that cannot be used; the one-line message names it and says how to fix it."""


class UnknownEmbedding(EmbeddingError):
    """An allowed name that no .safetensors file in the folder has (the message lists close names)."""


class EmbeddingChanged(EmbeddingError):
    """The file changed while it was read, or since it was located: locate it and read it again."""


@dataclass(frozen=True)
class Embedding:
    name: str
    version: FileStamp                 # the file version it was read from (a replaced file has a new one)
    vectors: dict[str, torch.Tensor]   # encoder key ("default", or "clip_l" and "clip_g") -> [count, width] f32 CPU
    count: int                         # vectors per encoder (all equal)

    @property
    def dims(self) -> dict[str, int]:
        return {key: v.shape[1] for key, v in self.vectors.items()}

    @property
    def bytes(self) -> int:
        """Its vectors' bytes (what `CACHED_BYTES` bounds)."""
        return sum(v.numel() * v.element_size() for v in self.vectors.values())


class EmbeddingDir:
    """The embeddings of one folder; thread-safe (listings and loads may run on several submitting threads)."""

    def __init__(self, folder: str, keep: int = CACHED, max_bytes: int = CACHED_BYTES):
        if not os.path.isdir(folder):
            raise EmbeddingError(f"embeddings dir {folder!r} is not a folder; give --embeddings-dir a folder of "
                                 ".safetensors embeddings")
        self._dir = Folder(folder, what="embedding", label="embeddings dir", max_bytes=MAX_EMBEDDING_BYTES)
        self.root = self._dir.root
        self._lock = threading.Lock()
        # the vectors read, by (name, file version); a prompt's `PromptText.vectors` holds its own
        self.files = SlotFiles("embeddings", "prompt", self._locate, self._read, keep=keep, what="embedding",
                               weigh=lambda emb: emb.bytes, max_bytes=max_bytes, changed=EmbeddingChanged)
        self._described: dict[str, tuple[FileStamp | None, dict | EmbeddingError]] = {}  # name -> listing entry

    def names(self) -> list[str]:
        return list(self._dir.listing().files)

    def listing(self) -> dict[str, Any]:
        """{"embeddings": [{"name", "vectors", "dims", "bytes"}], "ignored": [{"name", "reason"}]}: from headers
        only, each file version read once. Ignored: pickles (by relative path) and unusable embeddings (by name)."""
        found = self._dir.listing()
        with self._lock:
            known = dict(self._described)
        described = {name: self._entry(name, path, known.get(name)) for name, path in found.files.items()}
        with self._lock:
            self._described = described  # removed files leave
        ignored = [{"name": rel, "reason": PICKLE_REASON} for rel in found.ignored]
        ignored += [{"name": name, "reason": str(e)} for name, (_, e) in described.items()
                    if isinstance(e, EmbeddingError)]
        return {"embeddings": [{**e, "dims": dict(e["dims"])} for _, e in described.values() if isinstance(e, dict)],
                "ignored": sorted(ignored, key=lambda e: e["name"])}

    def _entry(self, name: str, path: str, known: tuple[FileStamp | None, dict | EmbeddingError] | None) \
            -> tuple[FileStamp | None, dict | EmbeddingError]:
        """(version, listing entry or the error that makes the file unusable); `known` is reused when the file's
        version is the one it was made from."""
        try:
            stamp = stamp_of(check_regular(path, MAX_EMBEDDING_BYTES))
        except UnusableFile as e:
            return None, _unusable(name, path, e)
        if known is not None and known[0] == stamp:
            return known
        try:
            return self._describe(name, path)
        except EmbeddingError as e:
            return stamp, e

    def stamp(self, name: str) -> FileStamp:
        """The version of embedding `name` on disk now (a stat). Raises EmbeddingError."""
        return stamp_of(self._file(name)[1])

    def load(self, name: str, dims: Mapping[str, int]) -> Embedding:
        """Embedding `name` for a model whose encoders take `dims` ({"default": 768} for SD1.x, {"clip_l": 768,
        "clip_g": 1280} for SDXL); read once per file version (`files`). Raises EmbeddingError (UnknownEmbedding)."""
        try:
            emb = self.files.held(name).host
        except ParamError as e:  # (what `_read` raised, or a file that kept changing while it was read)
            raise EmbeddingError(str(e)) from None
        _fit(emb, dict(dims))
        return emb

    def suggest(self, name: str) -> list[str]:
        """Up to three names close to `name`, whole or by their last part ('ink' finds 'styles/ink')."""
        return _close(name, self.names())

    # -- one file ------------------------------------------------------------------------------
    def _file(self, name: str) -> tuple[str, os.stat_result]:
        """The path of embedding `name` and its stat, within the size limit. Raises EmbeddingError."""
        try:
            path = self._dir.path(name)  # the name rules, links out of the folder, the entry's type by a stat
        except NameUnknown:
            raise self._unknown(name) from None
        except NameUnusable:
            path = self._dir.listing().files.get(name)  # its reason comes from the stat below
            if path is None:  # removed meanwhile
                raise self._unknown(name) from None
        except NameRefused:
            raise EmbeddingError(f"embedding name {name!r} is not allowed: names are relative paths inside the "
                                 "embeddings folder, '/' between folders, without '..', backslashes or NUL, and "
                                 "no symbolic link out of the folder (the embeddings listing shows them)") from None
        try:
            return path, check_regular(path, MAX_EMBEDDING_BYTES)
        except UnusableFile as e:
            raise _unusable(name, path, e) from None

    def _unknown(self, name: str) -> EmbeddingError:
        found = self._dir.listing()
        pickles = [rel for rel in found.ignored
                   if rel == name or (rel.lower().endswith(PICKLES) and os.path.splitext(rel)[0] == name)]
        if pickles:
            return EmbeddingError(f"embedding {name!r} is {pickles[0]}, {PICKLE_REASON}")
        names = list(found.files)
        close = _close(name, names)
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else \
            f"known: {', '.join(names[:10]) or 'none'}"
        return UnknownEmbedding(f"unknown embedding {name!r}; {hint}")

    def _locate(self, name: str) -> tuple[tuple[str, FileStamp], FileStamp]:
        """((its file, its version), its version), for `files`. Raises EmbeddingError."""
        path, st = self._file(name)
        return (path, stamp_of(st)), stamp_of(st)

    def _describe(self, name: str, path: str) -> tuple[FileStamp, dict[str, Any]]:
        header, _ = _reading(read_header, name, path)
        layout, count = _layout(name, header)
        dims = {enc: header.tensors[key].shape[-1] for enc, key in layout.items()}
        return header.stamp, {"name": name, "vectors": count, "dims": dims, "bytes": header.stamp.size}

    def _read(self, name: str, located: tuple[str, FileStamp]) -> Embedding:
        """`files`' load: the vectors of embedding `name` from where `_locate` found it, checked. Raises ParamError
        naming the problem (EmbeddingChanged: the file changed while it was read, or since it was located)."""
        path, version = located
        try:
            emb = self._vectors(name, path)
        except EmbeddingChanged:
            raise
        except EmbeddingError as e:
            raise ParamError(self.files.param, str(e)) from None
        if emb.version != version:
            raise EmbeddingChanged(f"embedding {name!r}: {os.path.basename(path)} changed between its stat and its "
                                   "read")
        return emb

    def _vectors(self, name: str, path: str) -> Embedding:
        import torch

        from ..safe_tensors import TensorFile

        try:
            with TensorFile(path, MAX_EMBEDDING_BYTES) as f:
                layout, count = _layout(name, f.header)  # checked on the header before any tensor is read
                stamp, state = f.stamp, f.read(keys=layout.values())
        except FileChanged as e:
            raise EmbeddingChanged(f"embedding {name!r}: {os.path.basename(path)} {e}") from None
        except UnusableFile as e:
            raise _unusable(name, path, e) from None
        vectors = {}
        for enc, key in layout.items():
            t = state[key].to(torch.float32).reshape(count, -1).contiguous()
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise EmbeddingError(f"embedding {name!r}: tensor {key!r} has {bad} NaN or infinite values (a "
                                     "training run that diverged?); it cannot be used: retrain or export it again")
            peak = float(t.abs().max())
            if peak > MAX_VALUE:
                raise EmbeddingError(f"embedding {name!r}: tensor {key!r} holds {peak:.3g}, beyond fp16's range "
                                     f"(±{MAX_VALUE:g}); embedding values are small (|x| < 1 typically): retrain or "
                                     "export it again")
            vectors[enc] = t
        return Embedding(name, stamp, vectors, count)


def _close(name: str, names: list[str]) -> list[str]:
    if not isinstance(name, str) or not name:
        return []
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    by_last: dict[str, list[str]] = {}
    for known in names:
        by_last.setdefault(known.rsplit("/", 1)[-1], []).append(known)
    for last in difflib.get_close_matches(name.rsplit("/", 1)[-1], list(by_last), n=3, cutoff=0.8):
        close += [known for known in by_last[last] if known not in close]
    return close[:3]


def _reading(reader: Callable[..., Any], name: str, path: str) -> Any:
    """reader(path, limit), read again while the file changes under it. Raises EmbeddingError."""
    for _ in range(READ_TRIES):
        try:
            return reader(path, MAX_EMBEDDING_BYTES)
        except FileChanged as e:
            changed = e
        except UnusableFile as e:
            raise _unusable(name, path, e) from None
    raise EmbeddingError(f"embedding {name!r}: {os.path.basename(path)} {changed}, {READ_TRIES} times; wait until "
                         "it is written completely, then use it")


def _unusable(name: str, path: str, error: UnusableFile) -> EmbeddingError:
    return EmbeddingError(f"embedding {name!r} is unusable: {os.path.basename(path)} {error}")


def _layout(name: str, header: SafetensorsHeader) -> tuple[dict[str, str], int]:
    """Which tensor holds each encoder's vectors ({encoder key: tensor key}) and how many vectors, from the header:
    each tensor's dtype and shape checked. Raises EmbeddingError."""
    tensors = header.tensors
    params = [k for k in tensors if k.startswith("string_to_param.")]
    if any(k in tensors for k in ENCODER_KEYS):
        layout = {k: k for k in ENCODER_KEYS if k in tensors}
    elif "emb_params" in tensors:
        layout = {DEFAULT: "emb_params"}
    elif len(params) == 1:
        layout = {DEFAULT: params[0]}
    elif len(tensors) == 1 and not params:
        layout = {DEFAULT: next(iter(tensors))}
    else:
        found = ", ".join(f"{k!r} {list(t.shape)}" for k, t in list(tensors.items())[:8]) or "none"
        more = f" and {len(tensors) - 8} more" if len(tensors) > 8 else ""
        raise EmbeddingError(f"embedding {name!r} has no known layout (tensors: {found}{more}); an embedding file "
                             "holds 'emb_params', one 'string_to_param.*', a single tensor named by its token, or "
                             "'clip_l' and 'clip_g' (SDXL): is it an embedding (not a LoRA or a model)?")
    counts = {key: _count(name, key, tensors[key]) for key in layout.values()}
    if len(set(counts.values())) > 1:
        raise EmbeddingError(f"embedding {name!r} has {counts} vectors per tensor; its encoders' tensors must hold "
                             "as many vectors each: export it again")
    return layout, next(iter(counts.values()))


def _count(name: str, key: str, t: TensorInfo) -> int:
    """The number of vectors of tensor `key` ([width] is one). Raises EmbeddingError."""
    what = f"embedding {name!r}: tensor {key!r}"
    if t.dtype not in FLOAT_DTYPES:
        kind = "integers" if t.dtype[0] in "IU" else "not a usual float"
        raise EmbeddingError(f"{what} is {t.dtype} ({kind}); embedding vectors must be fp16, bf16, fp32 or fp64: "
                             "save it from a floating-point tensor")
    if len(t.shape) not in (1, 2):
        raise EmbeddingError(f"{what} has shape {list(t.shape)}; an embedding is [vectors, width] or [width]")
    count = t.shape[0] if len(t.shape) == 2 else 1
    if count == 0:
        raise EmbeddingError(f"{what} has 0 vectors (shape {list(t.shape)}); an embedding has at least one: "
                             "export it again")
    if t.shape[-1] == 0:
        raise EmbeddingError(f"{what} is an empty tensor (shape {list(t.shape)}): export it again")
    if count > MAX_VECTORS:
        raise EmbeddingError(f"{what} has {count} vectors, more than the {MAX_VECTORS} a prompt holds (77 tokens "
                             "less the start and end): use an embedding trained with fewer vectors")
    return count


def _fit(emb: Embedding, dims: dict[str, int]) -> None:
    """Refuses an embedding whose encoders or widths are not the model's, naming both."""
    if emb.dims == dims:
        return
    raise EmbeddingError(f"embedding {emb.name!r} has {_widths(emb.dims)}; this model takes {_widths(dims)}: use "
                         f"an embedding trained for this model ({WIDTHS_HINT})")


def _widths(dims: Mapping[str, int]) -> str:
    if set(dims) == {DEFAULT}:
        return f"{dims[DEFAULT]}-wide vectors (one text encoder)"
    return " + ".join(f"{key} {width}" for key, width in dims.items())
