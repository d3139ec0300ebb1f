"""The models of a `--model-dir` folder: what each entry is, read without torch.

`ModelDir(root).listing()`: each `*.safetensors` file under the folder is a model named by its relative path, "/"
between folders, without the suffix (`sdxl/juggernaut`); each folder holding `model_index.json` is a diffusers model
named by its relative path (not descended into: its files are its parts). Pickles (.ckpt/.pt/.pth/.bin/.pkl) are
listed under their full name with the conversion hint as their error, never opened. What resolves outside the folder
(links) is left out; a file's sidecar (`NAME.diffgraph.toml`: sidecar.py) names its config folder or preset,
and a bad one makes the file unservable with its reason; links to folders are not followed; a FIFO, device or dangling link is refused by a stat, never
opened; one removed between the walk and its stat is not listed. Headers are inspected
(`checkpoint_kind.inspect_checkpoint`) once per file version (`safe_files.FileStamp`); folders' three small JSON
files are read each listing, their nesting bounded (`safe_files.parse_json`), and every other JSON file of a folder
(tokenizers, configs) once per version (`safe_files.bad_json_file`: one the loader would refuse makes the folder
unservable, naming it); an entry whose reading fails in a way
no reader foresaw is listed as unservable with a one-line reason, never failing the listing. `resolve(name)` maps a
request's model name to its entry (listing again: a model added later is found without a restart). AUTOMATIC1111's
model hashes are file_hashes.py's.
`model_path(--model)`: the path that tells which entry is the default model. A folder laid out as ComfyUI's
`models/` (split_files.py `comfy_layout`) lists `checkpoints/` as any file, a `diffusion_models/` or `unet/` file as a
split diffusion model with the companions chosen for it (`ModelEntry.split`) or why it has none (a `.gguf`
quantisation there too, named with its suffix), and never the
companion folders or ComfyUI's folders of other things. Standard library only (the HTTP process and
`diffgraph models --dir DIR` use this).
"""
from __future__ import annotations

import contextlib
import difflib
import logging
import os
import stat
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, TextIO

from ..safe_files import FileStamp, UnusableFile, bad_json_file, check_regular, read_header, read_json, stamp_of
from .checkpoint_configs import DESCRIPTIONS, KINDS, folder_files
from .checkpoint_kind import PICKLE_EXTENSIONS, inspect_checkpoint, refuse_pickle
from .clip_vocab import default_cache_root
from .file_hashes import SHORT, FileHashes
from .presets import RANDOM_PRESETS, SHIPPED_PRESETS
from .sidecar import read_sidecar, sidecar_path
from .split_files import (COMPANION_FOLDERS, GGUF_SUFFIX, OTHER_FOLDERS, SPLIT_FOLDERS, SPLIT_KINDS, PartFiles,
                          SplitFiles, comfy_layout, header_shapes, split_kind)
from .weights_view import weights_read

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
INDEX = "model_index.json"
MAX_MODEL_BYTES = 1 << 40
MAX_JSON_BYTES = 16 << 20
# The diffusers pipeline classes of each built-in family (models/families/: `pipeline_classes`), kept here as
# (class name prefix, family name, the variants between prefix and "Pipeline") because the adapters import torch;
# longest prefix first.
PIPELINE_VARIANTS = ("", "Img2Img", "Inpaint")
FAMILY_PIPELINES = (("StableDiffusionXL", "sdxl", PIPELINE_VARIANTS), ("StableDiffusion", "sd", PIPELINE_VARIANTS),
                    ("ZImage", "zimage", PIPELINE_VARIANTS), ("Flux2Klein", "flux2", ("",)),
                    ("Flux2", "flux2-dev", ("",)),
                    ("QwenImageEditPlus", "qwen-image-edit", ("",)), ("QwenImage", "qwen-image", ("",)))


class ModelNameError(ValueError):
    """A model name that is not allowed or not served (HTTP 400); the message says why."""


class ModelNotFound(ModelNameError):
    """An allowed name that no entry of the folder has; the message lists close or known names."""


class ModelUnusable(ModelNameError):
    """A name whose entry cannot be served (a LoRA, a pickle, a truncated file, a FIFO); the message says why."""


@dataclass(frozen=True)
class ModelEntry:
    name: str                        # relative to the folder, "/" between folders, no suffix for .safetensors
    path: str                        # absolute: the file (links resolved) or the folder
    form: Literal["file", "folder"]
    size_bytes: int                  # the file, or every regular file of the folder
    stamp: FileStamp | None          # the file's version, or the folder's model_index.json's; None: no stat
    kind: str | None = None          # a checkpoint_configs.KINDS key (files), the pipeline `_class_name` (folders)
    family: str | None = None        # a family adapter's name ("sd", "sdxl"); None when unknown or unservable
    native_size: int | None = None   # pixels (512 / 768 / 1024 ...); None when the configs do not say
    error: str | None = None         # why it cannot be served (one line), None when it can
    split: SplitFiles | None = None  # a split diffusion model's files, once its companions are chosen

    @property
    def description(self) -> str:
        split = next((k.label + " (split)" for k in SPLIT_KINDS if k.name == self.kind), None)
        return DESCRIPTIONS.get(self.kind or "", split or self.kind or "-")


def pipeline_family(class_name: str | None) -> str | None:
    """The family name of a diffusers pipeline class, or None for one no built-in family reads."""
    return next((f for prefix, f, variants in FAMILY_PIPELINES for v in variants
                 if class_name == prefix + v + "Pipeline"), None)


def supported_pipelines() -> list[str]:
    return [prefix + v + "Pipeline" for prefix, _, variants in FAMILY_PIPELINES for v in variants]


def native_size_of(unet_config: Any, vae_config: Any) -> int | None:
    """The image size a UNet was trained at, as diffusers' pipelines default it: sample_size * vae scale factor."""
    sample = unet_config.get("sample_size") if isinstance(unet_config, dict) else None
    if type(sample) is not int or sample <= 0:
        return None
    blocks = vae_config.get("block_out_channels") if isinstance(vae_config, dict) else None
    return sample * (2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else 8)


def model_path(model: str) -> str | None:
    """The real path of a `--model` that names a file or folder, None for a preset (the loader reads a preset's name
    first): a folder entry with this path is that model, served and listed under the `--model` name only."""
    if model in RANDOM_PRESETS or model in SHIPPED_PRESETS or not os.path.exists(model):
        return None
    return os.path.realpath(model)


class ModelDir:
    def __init__(self, root: str):
        if not os.path.isdir(root):
            raise ValueError(f"model dir {root!r} is not a folder; give a folder of .safetensors checkpoints and "
                             "diffusers folders")
        if os.path.isfile(os.path.join(root, INDEX)):
            raise ValueError(f"model dir {root!r} is itself a diffusers model (it holds {INDEX}); give it as "
                             "--model, or its parent folder as --model-dir")
        self.root = os.path.realpath(root)
        self.comfy = comfy_layout(self.root)  # ComfyUI's models folder: split folders and companion folders
        self._parts = PartFiles(self.root)
        # path under root -> the version inspected (the file's, its sidecar's) and its entry
        self._files: dict[str, tuple[tuple[FileStamp, FileStamp | None], ModelEntry]] = {}
        self._json: dict[str, tuple[FileStamp, UnusableFile | None]] = {}  # folders' JSON files parsed, by version

    def _inside(self, path: str) -> bool:
        return os.path.commonpath([os.path.realpath(path), self.root]) == self.root

    def listing(self) -> list[ModelEntry]:
        """Every entry, sorted by name; two entries of one name (a file and a folder) are both unservable."""
        entries: list[ModelEntry] = []
        files_seen: set[str] = set()
        for folder, dirs, files in os.walk(self.root, followlinks=False):
            rel_dir = os.path.relpath(folder, self.root).replace(os.sep, "/")
            if folder == self.root and self.comfy:  # companions and other things: never models themselves
                dirs[:] = [d for d in dirs if d not in OTHER_FOLDERS + COMPANION_FOLDERS]
            if folder != self.root and INDEX in files:
                dirs[:] = []
                if self._inside(os.path.join(folder, INDEX)):
                    folder_entry = _contained(rel_dir, folder, "folder",
                                              lambda: _folder_entry(rel_dir, folder, self._json))
                    if os.path.lexists(os.path.join(folder, INDEX)):  # else removed since the walk: not listed
                        entries.append(folder_entry)
                continue
            quantised_dits = self.comfy and rel_dir.split("/")[0] in SPLIT_FOLDERS  # .gguf files are listed here
            for f in files:
                full = os.path.join(folder, f)
                if (f.endswith(SUFFIX) or f.lower().endswith(PICKLE_EXTENSIONS) or
                        (quantised_dits and f.endswith(GGUF_SUFFIX))) and self._inside(full):
                    rel = f if rel_dir == "." else f"{rel_dir}/{f}"
                    entry = _contained(rel, full, "file", lambda: self._file_entry(rel, full))
                    if entry is not None:
                        entries.append(entry)
                        files_seen.add(full)
        for gone in self._files.keys() - files_seen:  # removed files: their versions are not kept
            self._files.pop(gone, None)
        twice = {name for name, n in Counter(e.name for e in entries).items() if n > 1}
        entries = [replace(e, error=f"{e.name!r} names both a .safetensors file and a diffusers folder; rename one")
                   if e.name in twice else e for e in entries]
        return sorted(entries, key=lambda e: (e.name, e.form))

    def _file_entry(self, rel: str, full: str) -> ModelEntry | None:
        """The entry of file `full` (`rel` under the folder), None when it was removed (or renamed) since the walk."""
        name = rel[: -len(SUFFIX)] if rel.endswith(SUFFIX) else rel
        real = os.path.realpath(full)
        path = real if os.path.lexists(real) else full  # a dangling link stays a link, so that its error says so
        try:
            st = check_regular(path, MAX_MODEL_BYTES)
        except UnusableFile as e:
            return ModelEntry(name, path, "file", 0, None, error=f"{rel} {e}") if os.path.lexists(full) else None
        stamp = stamp_of(st)
        version = (stamp, _sidecar_stamp(path))
        split = self.comfy and rel.split("/")[0] in SPLIT_FOLDERS
        seen = self._files.get(full)
        if seen is not None and seen[0] == version and seen[1].path == path:
            entry = seen[1]
        else:
            entry = _read_file_entry(ModelEntry(name, path, "file", st.st_size, stamp), rel, split)
            self._files[full] = (version, entry)
        return self._with_parts(entry) if split and entry.error is None else entry

    def _with_parts(self, entry: ModelEntry) -> ModelEntry:
        """A split diffusion model's entry with its companions chosen now (files come and go in their folders)."""
        kind = next(k for k in SPLIT_KINDS if k.name == entry.kind)
        try:
            files = self._parts.choose(entry.path, kind, read_sidecar(entry.path))
        except ValueError as e:  # Incomplete, or a sidecar changed since it was read
            return replace(entry, error=str(e))
        if files.family is None:
            names = f"{self._parts.shown(files.text_encoder)} and {self._parts.shown(files.vae)}"
            return replace(entry, split=files, error=f"{entry.name} is a {kind.label} diffusion model (with {names}); "
                           "no model family loads split files of it yet")
        return replace(entry, split=files, family=files.family)

    def resolve(self, name: str) -> ModelEntry:
        """The entry that `name` names (with or without ".safetensors"). Raises ModelNameError for a name that is
        not allowed, ModelNotFound, or ModelUnusable with the entry's error."""
        if not isinstance(name, str) or not name:
            raise ModelNameError("a model name must be a non-empty string, e.g. 'sdxl/juggernaut'")
        parts = name.split("/")
        if "\x00" in name or "\\" in name or os.path.isabs(name) or any(p in ("", ".", "..") for p in parts):
            raise ModelNameError(f"model name {name!r} is not allowed: names are relative, with '/' between folders, "
                                 "without '.', '..', empty parts, backslashes or NUL (the model listing names them)")
        entries = {e.name: e for e in self.listing()}
        stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
        entry = entries.get(name) or entries.get(stem)
        if entry is not None:
            if entry.error:
                raise ModelUnusable(f"model {name!r} cannot be served: {entry.error}")
            return entry
        for candidate in (os.path.join(self.root, *parts), os.path.join(self.root, *stem.split("/")) + SUFFIX):
            if os.path.lexists(candidate) and not self._inside(candidate):
                raise ModelNotFound(f"model {name!r} resolves outside the model folder (a symbolic link?); it is "
                                    "not served")
        close = difflib.get_close_matches(stem, list(entries), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else \
            f"known: {', '.join(list(entries)[:10]) or 'none'}"
        raise ModelNotFound(f"model {name!r} is not in the model folder; {hint}")


def _read_file_entry(entry: ModelEntry, rel: str, split: bool) -> ModelEntry:
    """A file's kind, family and native size from its header and sidecar; in a split folder its split kind only."""
    try:
        refuse_pickle(entry.path)
        side = read_sidecar(entry.path)
        if split:
            try:
                return replace(entry, kind=split_kind(rel, header_shapes(entry.path)).name)
            except UnusableFile as e:
                raise ValueError(f"{rel} {e}") from None
        info = inspect_checkpoint(entry.path, MAX_MODEL_BYTES)
        kind = (side.checkpoint_preset() if side else None) or info.kind
        return _file_kind(entry, kind, side.config if side else None)
    except ValueError as e:
        return replace(entry, error=str(e))


def _sidecar_stamp(path: str) -> FileStamp | None:
    try:
        return stamp_of(os.stat(sidecar_path(path)))  # a stat never opens: read_sidecar refuses what is odd
    except OSError:
        return None


def _file_kind(entry: ModelEntry, kind: str, config: str | None) -> ModelEntry:
    """A checkpoint's kind, family and native size: from its kind's configs, or from the config folder its sidecar
    names (whose pipeline decides the family)."""
    if config is None:
        configs = folder_files(kind)
        return replace(entry, kind=kind, family=pipeline_family(KINDS[kind][1]),
                       native_size=native_size_of(configs["unet/config.json"], configs["vae/config.json"]))
    folder = _folder_entry(os.path.basename(config), config)
    error = f"its sidecar's config folder: {folder.error}" if folder.error else None
    return replace(entry, kind=kind, family=folder.family, native_size=folder.native_size, error=error)


def _contained(rel: str, path: str, form: Literal["file", "folder"],
               read: Callable[[], ModelEntry | None]) -> ModelEntry | None:
    """read(): an entry; should it fail in a way no reader foresaw, an unservable entry saying so, so that one odd
    file costs its own entry only, never the listing (and every other model with it)."""
    try:
        return read()
    except Exception as e:
        logger.warning("model dir entry %s cannot be read: %r", path, e)
        name = rel[: -len(SUFFIX)] if rel.endswith(SUFFIX) else rel
        return ModelEntry(name, path, form, 0, None, error=f"{rel} cannot be read ({type(e).__name__}): check or "
                          "replace it; the server's log has the details")


def _folder_entry(name: str, folder: str,
                  json_cache: dict[str, tuple[FileStamp, UnusableFile | None]] | None = None) -> ModelEntry:
    """A diffusers folder's entry: its pipeline class and native size from its configs, and why it cannot be served
    (a JSON file of it that the loader would refuse, too: `json_cache` keeps what was parsed, by version)."""
    def config(rel: str) -> tuple[Any, FileStamp]:
        return read_json(os.path.join(folder, rel), MAX_JSON_BYTES)

    size = _folder_bytes(folder)
    try:
        index, stamp = config(INDEX)
    except UnusableFile as e:
        return ModelEntry(name, folder, "folder", size, None, error=f"{name}/{INDEX} {e}")
    cls = index.get("_class_name") if isinstance(index, dict) else None
    if not isinstance(cls, str):
        return ModelEntry(name, folder, "folder", size, stamp,
                          error=f"{name}/{INDEX} names no pipeline (_class_name); copy the folder again")
    bad = bad_json_file(folder, json_cache)  # (tokenizers, configs: the loader refuses the folder for one)
    if bad is not None:
        return ModelEntry(name, folder, "folder", size, stamp, cls, error=f"{name}/{bad[0]} {bad[1]}")
    unet = vae = None
    try:
        unet = config("unet/config.json")[0]
        vae = config("vae/config.json")[0]
    except UnusableFile:
        pass  # the loader names the missing part; the listing shows an unknown size
    family_name = pipeline_family(cls)
    error = None if family_name else f"{name} is a {cls} folder; supported: {', '.join(supported_pipelines())}"
    return ModelEntry(name, folder, "folder", size, stamp, cls, family_name, native_size_of(unet, vae), error)


FLOAT_TENSORS = ("F64", "F32", "F16", "BF16")  # safetensors' dtypes a load converts to its float dtype
UNLOADED_PARTS = ("safety_checker", "feature_extractor")  # folders of a pipeline that no family loads


def weights_bytes(entry: ModelEntry, float_bytes: int) -> int:
    """About how many bytes the weights of `entry` take once loaded with floats of `float_bytes` bytes (2: fp16 or
    bf16, 4: fp32): a folder's weights files that from_pretrained reads, a split model's three files, else the file.
    In a safetensors file the floating-point tensors count at that size (a 16-bit load of an fp32 file halves them),
    the others (fp8, integers) as stored; a pickle counts as an fp32 file, a GGUF file its size. It errs low, never
    high: a file that cannot be read counts nothing."""
    if entry.form == "folder":
        with contextlib.suppress(OSError):
            parts = [d for d in sorted(os.listdir(entry.path)) if d not in UNLOADED_PARTS
                     and os.path.isdir(os.path.join(entry.path, d))]
            return sum(_file_weights(os.path.join(entry.path, rel), float_bytes)
                       for rel in weights_read(entry.path, parts)[0])
        return 0
    paths = [entry.split.diffusion_model, entry.split.text_encoder, entry.split.vae] if entry.split else [entry.path]
    return sum(_file_weights(path, float_bytes) for path in paths)


def _file_weights(path: str, float_bytes: int) -> int:
    try:
        if path.endswith(SUFFIX):
            header, _ = read_header(path, MAX_MODEL_BYTES)
            return sum(t.numel * float_bytes if t.dtype in FLOAT_TENSORS else t.end - t.begin
                       for t in header.tensors.values())
        size = os.stat(path).st_size
    except (OSError, UnusableFile):
        return 0
    return size if path.endswith(GGUF_SUFFIX) else size * float_bytes // 4


def _folder_bytes(folder: str) -> int:
    total = 0
    for here, _, files in os.walk(folder, followlinks=False):
        for f in files:
            with contextlib.suppress(OSError):  # (gone meanwhile, a dangling link: nothing to count)
                st = os.stat(os.path.join(here, f))  # a stat never opens: a FIFO counts as nothing
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def print_model_dir(root: str, out: TextIO, hashes: bool = False, cache_root: str | None = None) -> int:
    """`diffgraph models --dir DIR`: one line per entry (name, form, kind and description, family, native size,
    size in GB, the short hash with `hashes`, the error). Hashes read whole files (minutes for a 7 GB checkpoint
    the first time), hence off by default. Raises ValueError when `root` is not a folder; returns 0."""
    entries = ModelDir(root).listing()
    hasher = FileHashes(cache_root or default_cache_root())
    width = max([len(e.name) for e in entries] + [4])
    for e in entries:
        kind = f"{e.kind}  {e.description}" if e.form == "file" and e.kind else e.kind or "-"
        line = f"{e.name:{width}s}  {e.form:6s}  {kind:38s}  {e.family or '-':5s}  " \
               f"{f'{e.native_size}px' if e.native_size else '-':7s}  {e.size_bytes / 1e9:6.2f} GB"
        if hashes:
            digest = None
            with contextlib.suppress(UnusableFile):  # (a file written meanwhile: no hash this time)
                digest = hasher.compute(e.path) if e.form == "file" and not e.error else None
            line += f"  {digest[:SHORT] if digest else '-':10s}"
        out.write((line + (f"  error: {e.error}" if e.error else "")).rstrip() + "\n")
    if not entries:
        out.write(f"no models in {root} (*.safetensors checkpoints and diffusers folders are listed)\n")
    return 0
