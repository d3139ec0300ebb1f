"""Split diffusion models: a DiT file with its text encoder and VAE in files of their own, as ComfyUI keeps them.

ComfyUI's `models/` folder holds `checkpoints/` (whole checkpoints), `diffusion_models/` (or the older `unet/`: the
denoiser alone), `text_encoders/` (or `clip/`) and `vae/`. A file of a split folder (.safetensors, or a .gguf
quantisation of the denoiser: city96 / ComfyUI-GGUF's; of a text encoder: llama.cpp's) says what it is from its
header (`SPLIT_KINDS`: key markers and sizes, as checkpoint_kind.py reads SD checkpoints; a GGUF's shapes in torch
order, from gguf_format.py, a llama.cpp file's under transformers' names, gguf_llm.py), and so
which text encoder and VAE it needs (`TEXT_ENCODERS`, `VAES`, read from their headers alike). `choose(...)` picks its
companions: the files its sidecar names (`NAME.diffgraph.toml`: sidecar.py), checked to be of the kind it needs,
else the only file of that kind in the companion folders; else it raises `Incomplete`, one line saying what to add
or name. The result, `SplitFiles`, is what the catalog lists (catalog.py `ModelEntry.split`) and what the loader
hands to the family that reads it (`SplitFiles.family`: the kind's, None while no family reads it; families add
their kinds and set it).

One layout can hold checkpoints that different families read: Qwen-Image's transformer file is also Qwen-Image-Edit's
(2509's weights have the same names and shapes). Such a checkpoint is a `Variant` of the kind, and a file is read as
one (`SplitFiles.preset`, `preset_of`) when its sidecar's `preset` names it, else when its file name holds all of the
variant's words (lower case, '_' and ' ' read as '-': ComfyUI's `qwen_image_edit_2509_fp8_e4m3fn.safetensors`,
QuantStack's `Qwen-Image-Edit-2511-Q4_K_M.gguf`); never from weights that are the same. A file whose header holds a
marker only one checkpoint's files carry is a kind of its own (ComfyUI's Edit-2511 repack holds
`__index_timestep_zero__`). Headers are read once per file version (`PartFiles`). Standard library only (the HTTP
process lists these).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from ..safe_files import FileStamp, UnusableFile, check_regular, read_header, stamp_of
from .gguf_format import gguf_header
from .gguf_llm import model_shapes
from .sidecar import Sidecar, read_sidecar, sidecar_path

SPLIT_FOLDERS = ("diffusion_models", "unet")
Role = Literal["text_encoder", "vae"]
PART_FOLDERS: tuple[tuple[Role, tuple[str, ...]], ...] = (("text_encoder", ("text_encoders", "clip")),
                                                          ("vae", ("vae",)))
COMPANION_FOLDERS = tuple(f for _, folders in PART_FOLDERS for f in folders)
# ComfyUI's folders of other things (adapters, upscalers, vision encoders...): in its layout, never listed as models
OTHER_FOLDERS = ("loras", "controlnet", "embeddings", "upscale_models", "clip_vision", "vae_approx", "style_models",
                 "gligen", "hypernetworks", "photomaker", "model_patches", "audio_encoders", "latent_upscale_models",
                 "configs", "t2i_adapter", "ipadapter")
MAX_FILE_BYTES = 1 << 40
SUFFIX = ".safetensors"
GGUF_SUFFIX = ".gguf"  # a diffusion model's GGUF quantisation (city96 / ComfyUI-GGUF's) or a llama.cpp text encoder
ROLE_WORDS = {"text_encoder": "text encoder", "vae": "VAE"}


@dataclass(frozen=True)
class Signature:
    """What a header must hold: each marker inside some key, and the tensor of each dims entry (the first key that
    ends with its suffix) with that size on that axis."""

    markers: tuple[str, ...]
    dims: tuple[tuple[str, int, int], ...] = ()  # (key suffix, axis, size)

    def matches(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        if not all(any(m in k for k in shapes) for m in self.markers):
            return False
        for suffix, axis, size in self.dims:
            shape = next((s for k, s in shapes.items() if k.endswith(suffix)), None)
            if shape is None or len(shape) <= axis or shape[axis] != size:
                return False
        return True


@dataclass(frozen=True)
class PartKind:
    name: str
    label: str  # "a Qwen3-4B text encoder": how messages name it
    signature: Signature


@dataclass(frozen=True)
class Variant:
    """A published checkpoint whose files are of a split kind but read by another family, or with other defaults: its
    sidecar preset (a sidecar.SPLIT_PRESETS name of the kind), the family that reads it, and the words all of which
    its published file names hold."""

    preset: str
    family: str
    words: tuple[str, ...]


@dataclass(frozen=True)
class SplitKind:
    name: str
    label: str            # "Z-Image": a kind of diffusion model
    signature: Signature
    text_encoder: str     # a TEXT_ENCODERS name
    vae: str              # a VAES name
    family: str | None = None  # the family adapter that loads it; None while none does
    tokenizer: bool = False    # its tokenizer folder must be given (diffgraph ships none for its text encoder)
    variants: tuple[Variant, ...] = ()  # its checkpoints another family reads (the first that a file shows)


TEXT_ENCODERS = (
    PartKind("qwen3-4b", "a Qwen3-4B text encoder",
             Signature(("self_attn.q_norm.",), (("embed_tokens.weight", 0, 151936), ("embed_tokens.weight", 1, 2560)))),
    PartKind("qwen3-8b", "a Qwen3-8B text encoder",
             Signature(("self_attn.q_norm.",), (("embed_tokens.weight", 0, 151936), ("embed_tokens.weight", 1, 4096)))),
    PartKind("qwen2.5-vl-7b", "a Qwen2.5-VL-7B text encoder",
             Signature(("self_attn.q_proj.bias",), (("embed_tokens.weight", 0, 152064),
                                                    ("embed_tokens.weight", 1, 3584)))),
    PartKind("mistral-small-3", "a Mistral Small 3 text encoder",
             Signature(("embed_tokens.weight",), (("embed_tokens.weight", 0, 131072),
                                                  ("embed_tokens.weight", 1, 5120)))),
)
VAES = (
    PartKind("flux-vae", "a FLUX.1 VAE (16 latent channels)",
             Signature(("encoder.conv_in.",), (("decoder.conv_in.weight", 1, 16),))),
    PartKind("flux2-vae", "a FLUX.2 VAE (32 latent channels)",
             Signature(("encoder.conv_in.",), (("decoder.conv_in.weight", 1, 32),))),
    PartKind("qwen-image-vae", "a Qwen-Image / Wan 2.1 VAE (16 latent channels)",
             Signature(("decoder.middle.0.residual.",), (("decoder.conv1.weight", 1, 16),))),
    PartKind("sd-vae", "an SD VAE (4 latent channels)",
             Signature(("encoder.conv_in.",), (("decoder.conv_in.weight", 1, 4),))),
)
_QWEN_IMAGE = ("transformer_blocks.", "txt_norm.", ".img_mod.")
_QWEN_IMAGE_DIMS = (("img_in.weight", 1, 64), ("txt_in.weight", 1, 3584))
SPLIT_KINDS = (
    SplitKind("z-image", "Z-Image",
              Signature(("cap_embedder.", "context_refiner.", "noise_refiner."), (("cap_embedder.1.weight", 1, 2560),)),
              "qwen3-4b", "flux-vae", family="zimage"),
    SplitKind("flux2-dev", "FLUX.2 dev", Signature(("double_blocks.", "single_blocks."), (
        ("img_in.weight", 1, 128), ("txt_in.weight", 1, 15360))), "mistral-small-3", "flux2-vae", family="flux2-dev",
              tokenizer=True),
    SplitKind("flux2-klein-4b", "FLUX.2 klein 4B", Signature(("double_blocks.", "single_blocks."), (
        ("img_in.weight", 1, 128), ("txt_in.weight", 1, 7680))), "qwen3-4b", "flux2-vae", family="flux2"),
    SplitKind("flux2-klein-9b", "FLUX.2 klein 9B", Signature(("double_blocks.", "single_blocks."), (
        ("img_in.weight", 1, 128), ("txt_in.weight", 1, 12288))), "qwen3-8b", "flux2-vae", family="flux2"),
    # ComfyUI's Edit-2511 repack: Qwen-Image's layout with its reference-token modulation's marker (before Qwen-Image)
    SplitKind("qwen-image-edit-2511", "Qwen-Image-Edit-2511", Signature(_QWEN_IMAGE + ("__index_timestep_zero__",),
                                                                        _QWEN_IMAGE_DIMS),
              "qwen2.5-vl-7b", "qwen-image-vae", family="qwen-image-edit"),
    SplitKind("qwen-image", "Qwen-Image", Signature(_QWEN_IMAGE, _QWEN_IMAGE_DIMS), "qwen2.5-vl-7b", "qwen-image-vae",
              family="qwen-image", variants=(Variant("qwen-image-edit-2511", "qwen-image-edit", ("edit", "2511")),
                                             Variant("qwen-image-edit-2509", "qwen-image-edit", ("edit", "2509")),
                                             Variant("qwen-image-edit", "qwen-image-edit", ("edit",)))),
)
PARTS: dict[Role, tuple[PartKind, ...]] = {"text_encoder": TEXT_ENCODERS, "vae": VAES}


class Incomplete(ValueError):
    """A split diffusion model without a usable file of a kind it needs; the message says what to add or name."""


@dataclass(frozen=True)
class SplitFiles:
    """What a split diffusion model is loaded from: its own file and the companions chosen for it (absolute paths)."""

    kind: SplitKind
    diffusion_model: str
    text_encoder: str
    vae: str
    chosen_by: tuple[tuple[Role, Literal["sidecar", "only file", "flag"]], ...]  # how each companion was chosen
    preset: str | None = None  # the checkpoint its sidecar (sidecar.SPLIT_PRESETS) or its name names (`preset_of`)
    tokenizer: str | None = None  # the tokenizer folder given (--tokenizer, or its sidecar's), for a kind that needs it

    def files(self) -> dict[Role, str]:
        return {"text_encoder": self.text_encoder, "vae": self.vae}

    @property
    def family(self) -> str | None:
        """The family that reads it: its preset's variant's, else its kind's."""
        return next((v.family for v in self.kind.variants if v.preset == self.preset), self.kind.family)


def preset_of(kind: SplitKind, model_file: str, side: Sidecar | None) -> str | None:
    """The checkpoint a split model's file is (see the module's docstring): its sidecar's preset (checked to be one of
    the kind's), else the first of the kind's variants whose words its file name holds, else None."""
    named = side.split_preset(kind.name, kind.label) if side else None
    if named is not None:
        return named
    name = os.path.basename(model_file).lower().replace("_", "-").replace(" ", "-")
    return next((v.preset for v in kind.variants if all(w in name for w in v.words)), None)


def comfy_layout(root: str) -> bool:
    """Whether `root` is laid out as ComfyUI's models folder (a checkpoints/ or split folder directly inside)."""
    return any(os.path.isdir(os.path.join(root, f)) for f in ("checkpoints", *SPLIT_FOLDERS))


def models_root(path: str) -> str | None:
    """The ComfyUI models folder of a file inside one of its split folders (at any depth), else None (a diffusers
    folder's unet/ is not one: its parent holds model_index.json)."""
    here = os.path.dirname(os.path.realpath(path))
    while os.path.dirname(here) != here:
        parent = os.path.dirname(here)
        if os.path.basename(here) in SPLIT_FOLDERS and not os.path.exists(os.path.join(parent, "model_index.json")):
            return parent
        here = parent
    return None


def split_model(path: str, tokenizer: str | None = None) -> SplitFiles | None:
    """The files of `path` when it is a split folder's diffusion model (the loader's view, as the catalog lists it;
    `tokenizer`: a folder given in place of its sidecar's), None when it is not in a split folder. Raises ValueError
    (one line): an unknown kind, a bad sidecar, Incomplete."""
    root = models_root(path)
    if root is None:
        return None
    parts = PartFiles(root)
    rel = parts.shown(path)
    try:
        kind = split_kind(rel, header_shapes(os.path.realpath(path)))
    except UnusableFile as e:
        raise ValueError(f"{rel} {e}") from None
    return parts.choose(path, kind, read_sidecar(os.path.realpath(path)), tokenizer)


def header_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of a .safetensors file's header, or of a .gguf file's (torch order, as the model holds them:
    gguf_format.py). Raises UnusableFile (its message follows the file name)."""
    if path.endswith(GGUF_SUFFIX):
        return model_shapes(gguf_header(path, MAX_FILE_BYTES))
    if not path.endswith(SUFFIX):
        raise UnusableFile(f"is not a .safetensors or .gguf file; convert it first with `diffgraph convert {path} "
                           "OUT.safetensors`")
    header, _ = read_header(path, MAX_FILE_BYTES)
    return {k: t.shape for k, t in header.tensors.items()}


def split_kind(rel: str, shapes: dict[str, tuple[int, ...]]) -> SplitKind:
    """The kind of a split folder's file from its header; ValueError (one line, naming `rel`) for an unknown one."""
    kind = next((k for k in SPLIT_KINDS if k.signature.matches(shapes)), None)
    if kind is None:
        sample = ", ".join(sorted({k.split(".")[0] for k in shapes})[:5]) or "no tensors"
        raise ValueError(f"{rel} is not a split diffusion model diffgraph recognises (its keys start with {sample}); "
                         f"recognised: {', '.join(k.label for k in SPLIT_KINDS)}; whole checkpoints go in "
                         "checkpoints/")
    return kind


def split_kind_of(path: str) -> SplitKind | None:
    """The split kind of a diffusion-model file anywhere (its header's signature), None for any other file (a whole
    checkpoint). Raises ValueError (one line, naming the file) when its header cannot be read."""
    try:
        shapes = header_shapes(os.path.realpath(path))
    except UnusableFile as e:
        raise ValueError(f"{os.path.basename(path)} {e}") from None
    return next((k for k in SPLIT_KINDS if k.signature.matches(shapes)), None)


def checked_part(path: str, role: Role, kind: SplitKind) -> str:
    """`path` (given on the command line as a split model's `role` file), checked to be the kind `kind` needs; its
    real path. ValueError (one line) naming the file and what it needs otherwise."""
    need = next(k for k in PARTS[role] if k.name == getattr(kind, role))
    try:
        shapes = header_shapes(os.path.realpath(path))
    except UnusableFile as e:
        raise ValueError(f"{os.path.basename(path)} {e}") from None
    found = next((k for kinds in PARTS.values() for k in kinds if k.signature.matches(shapes)), None)
    if found is None or found.name != need.name:
        what = found.label if found else f"not a {ROLE_WORDS[role]} diffgraph recognises"
        raise ValueError(f"--{role.replace('_', '-')} {os.path.basename(path)} is {what}; {kind.label} needs "
                         f"{need.label}")
    return os.path.realpath(path)


class PartFiles:
    """The companion files of a models folder and what each is, read from headers once per file version."""

    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        self._kinds: dict[str, tuple[FileStamp, str | None]] = {}  # real path -> version, PartKind name or None

    def kind_of(self, path: str, role: Role) -> PartKind | None:
        """The kind of `role` that file `path` is, None when it is none of them (or cannot be read)."""
        real = os.path.realpath(path)
        try:
            stamp = stamp_of(check_regular(real, MAX_FILE_BYTES))
        except UnusableFile:
            return None
        seen = self._kinds.get(real)
        if seen is None or seen[0] != stamp:
            try:
                shapes = header_shapes(real)
            except (UnusableFile, OSError):
                shapes = {}
            found = next((k.name for kinds in PARTS.values() for k in kinds if k.signature.matches(shapes)), None)
            seen = self._kinds[real] = (stamp, found)
        return next((k for k in PARTS[role] if k.name == seen[1]), None)

    def present(self, role: Role) -> list[str]:
        """The .safetensors and .gguf files of the role's folders (real paths inside the root, sorted)."""
        out = []
        for name in dict(PART_FOLDERS)[role]:
            for here, dirs, files in os.walk(os.path.join(self.root, name), followlinks=False):
                dirs.sort()
                for f in sorted(files):
                    real = os.path.realpath(os.path.join(here, f))
                    if f.endswith((SUFFIX, GGUF_SUFFIX)) and os.path.commonpath([real, self.root]) == self.root:
                        out.append(real)
        return out

    def shown(self, path: str) -> str:
        real = os.path.realpath(path)
        inside = os.path.commonpath([real, self.root]) == self.root
        return os.path.relpath(real, self.root).replace(os.sep, "/") if inside else os.path.basename(real)

    def choose(self, model_file: str, kind: SplitKind, side: Sidecar | None,
               tokenizer: str | None = None) -> SplitFiles:
        """The companions of `model_file` (a `kind` diffusion model): its sidecar's, else the only compatible file of
        each role, the checkpoint preset its sidecar names and the tokenizer folder (`tokenizer`, else its sidecar's).
        Raises Incomplete with one line per role that has none (joined by '; '), a ValueError for a preset of another
        kind."""
        preset = preset_of(kind, model_file, side)
        chosen: dict[Role, str] = {}
        how: list[tuple[Role, Literal["sidecar", "only file"]]] = []
        problems = []
        for role, _ in PART_FOLDERS:
            try:
                chosen[role], by = self._one(model_file, role, kind, getattr(side, role) if side else None)
                how.append((role, by))
            except Incomplete as e:
                problems.append(str(e))
        tokenizer = tokenizer or (side.tokenizer if side else None)
        if kind.tokenizer and tokenizer is None:
            problems.append(missing_tokenizer(kind, model_file))
        if problems:
            raise Incomplete(f"{self.shown(model_file)}: " + "; ".join(problems))
        return SplitFiles(kind, os.path.realpath(model_file), chosen["text_encoder"], chosen["vae"], tuple(how), preset,
                          os.path.realpath(tokenizer) if tokenizer and kind.tokenizer else None)

    def _one(self, model_file: str, role: Role, kind: SplitKind,
             named: str | None) -> tuple[str, Literal["sidecar", "only file"]]:
        need = next(k for k in PARTS[role] if k.name == getattr(kind, role))
        word, sidecar = ROLE_WORDS[role], _sidecar_name(model_file)
        if named is not None:
            found = self.kind_of(named, role)
            if found is None or found.name != need.name:
                what = found.label if found else f"not a {word} diffgraph recognises"
                raise Incomplete(f"the {word} its sidecar names, {self.shown(named)}, is {what}; {kind.label} needs "
                                 f"{need.label}")
            return os.path.realpath(named), "sidecar"
        fits = [p for p in self.present(role) if self.kind_of(p, role) == need]
        folder = dict(PART_FOLDERS)[role][0]
        if not fits:
            raise Incomplete(f"{kind.label} needs {need.label}: add its {word} to {folder}/ or name it in {sidecar}")
        if len(fits) > 1:
            raise Incomplete(f"{len(fits)} files fit as its {word} ({', '.join(self.shown(p) for p in fits[:4])}); "
                             f"name one in {sidecar}")
        return fits[0], "only file"


def missing_tokenizer(kind: SplitKind, model_file: str) -> str:
    """The one line that asks for a split model's tokenizer folder."""
    return (f"{kind.label} needs its checkpoint's tokenizer folder (tokenizer.json and its config; diffgraph ships "
            f"none): pass --tokenizer DIR or name it in {_sidecar_name(model_file)} (tokenizer = \"DIR\")")


def _sidecar_name(model_file: str) -> str:
    return os.path.basename(sidecar_path(model_file))
