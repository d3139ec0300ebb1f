"""Model upscalers from a folder (--upscaler-dir): ESRGAN-family super-resolution models (ESRGAN, Real-ESRGAN,
SwinIR, HAT, ... whatever `spandrel` recognises as one) in `.safetensors` files directly in the folder, named by
their file name without the suffix as AUTOMATIC1111 names its ESRGAN models. Files added later are found (the
folder is listed again on each look-up).

A file is read through `safe_tensors.TensorFile` (streamed, never memory-mapped), its state dict unwrapped where a
converted checkpoint keeps its parts under a prefix (`params_ema.`, `params.`, ...: Real-ESRGAN's .pth files
converted whole), and handed to spandrel's `ModelLoader().load_from_state_dict`, which finds the architecture and
its hyperparameters; a model other than a 3-channel super-resolution or restoration (1x) one is refused by name. Pickles (.pth .pt
.ckpt .bin) are never read: a request that names one is told to convert it with `diffgraph convert`. A loaded model
is kept for its file's version (`FileStamp`), several at most (`MAX_LOADED`).

A model runs on the CPU, in float32, on the caller's thread (the server's worker threads, never the event loop):
tile by tile (`TILE` pixels square, `TILE_OVERLAP` pixels of overlap, AUTOMATIC1111's ESRGAN tile defaults; an
image within one tile runs whole), the tiles pasted back with AUTOMATIC1111's combine_grid blend
(upscalers.combine_tiles), so the model's own memory stays bounded by the tile, whatever the image; a pass that would
make more than `MAX_PASS_PIXELS` pixels (a model's scale can overshoot the size asked for) is refused before it runs.

spandrel imports torchvision for two architectures that are no upscalers (LaMa inpainting, RestoreFormer faces).
Where torchvision is not installed (a CPU torch build whose matching torchvision cannot be installed), spandrel is
imported with a stand-in for the three torchvision functions those two use, which raise if called; the stand-in
is removed from `sys.modules` once spandrel is imported, so no other library sees a torchvision.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
from collections import OrderedDict
from typing import Any

import numpy as np
from PIL import Image

from .safe_files import FileChanged, FileStamp, UnusableFile, stamp_of
from .upscalers import UPSCALERS, Tile, TileGrid, UpscalerError, combine_tiles, split_tiles

SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin")
TILE = 192          # pixels a side of the tiles a model runs on (AUTOMATIC1111's ESRGAN_tile)
TILE_OVERLAP = 8    # their overlap (AUTOMATIC1111's ESRGAN_tile_overlap)
MAX_LOADED = 4      # models kept loaded, the most recently used
MAX_PASS_PIXELS = 64 << 20  # the most pixels one model pass may make (a pass may overshoot the size asked for)
MAX_FILE_BYTES = 4 << 30
# converted checkpoints' parts (spandrel's unwrap keys, flattened; "model." and "net." start real layouts' keys)
PURPOSES = ("SR", "Restoration")  # spandrel's purposes served: upscalers, and 1x models (run as AUTOMATIC1111 runs them)
WRAPPERS = ("params_ema.", "params-ema.", "params.", "model_state_dict.", "state_dict.")
_IMPORT_LOCK = threading.Lock()
_STAND_IN = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


def _needs_torchvision(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("this spandrel architecture needs torchvision; install the torchvision build that matches "
                       "torch (pip install torchvision)")


def _stand_in() -> dict[str, types.ModuleType]:
    """Modules standing in for the torchvision names spandrel's LaMa and RestoreFormer import."""
    modules = {}
    for name in _STAND_IN:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        modules[name] = module
    functional = modules["torchvision.transforms.functional"]
    functional.rotate = functional.normalize = _needs_torchvision
    functional.InterpolationMode = types.SimpleNamespace(BILINEAR="bilinear", NEAREST="nearest", BICUBIC="bicubic")
    modules["torchvision"].transforms = modules["torchvision.transforms"]
    modules["torchvision.transforms"].functional = functional
    return modules


def spandrel_installed() -> bool:
    """Whether spandrel can be imported (diffgraph[upscale]); nothing is imported."""
    return importlib.util.find_spec("spandrel") is not None


def import_spandrel() -> Any:
    """The spandrel module (module doc: the torchvision stand-in where torchvision is not installed)."""
    with _IMPORT_LOCK:
        if "spandrel" in sys.modules or importlib.util.find_spec("torchvision") is not None:
            import spandrel
            return spandrel
        stand_in = _stand_in()
        sys.modules.update(stand_in)
        try:
            import spandrel
            return spandrel
        finally:
            for name, module in stand_in.items():
                if sys.modules.get(name) is module:
                    del sys.modules[name]


def unwrap(state: dict[str, Any]) -> dict[str, Any]:
    """A converted checkpoint's model weights: the keys under the first wrapper prefix (WRAPPERS, in spandrel's
    order) where every key is under one, else the state as it is."""
    if not all(key.startswith(WRAPPERS) for key in state):
        return state
    for prefix in WRAPPERS:
        part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if part:
            return part
    return state


class UpscalerModels:
    """The model upscalers of one folder (module doc): `names`, `find`, `enlarge` (upscalers.ModelUpscalers)."""

    def __init__(self, root: str, tile: int = TILE, overlap: int = TILE_OVERLAP):
        if not os.path.isdir(root):
            raise ValueError(f"upscaler-dir {root!r} is not a folder; give a folder of .safetensors upscaler models")
        if not 0 <= overlap < tile:
            raise ValueError(f"upscaler tile overlap {overlap} must be in 0..{tile - 1}")
        self.root, self.tile, self.overlap = os.path.abspath(root), tile, overlap
        self._lock = threading.Lock()
        self._loaded: OrderedDict[str, tuple[FileStamp, Any]] = OrderedDict()

    def _files(self) -> dict[str, str]:
        """Each model file and pickle by the name a request uses (its file name without the suffix), sorted."""
        out: dict[str, str] = {}
        for entry in sorted(os.scandir(self.root), key=lambda e: e.name.lower()):
            stem, suffix = os.path.splitext(entry.name)
            if entry.is_file() and suffix.lower() in (SUFFIX, *PICKLE_SUFFIXES) and stem not in UPSCALERS:
                out.setdefault(stem, entry.path)  # a .safetensors before a pickle of the same name
        return out

    def names(self) -> list[str]:
        """The models' names, as AUTOMATIC1111 sorts them (by name, case-insensitively); pickles left out."""
        return [name for name, path in self._files().items() if path.endswith(SUFFIX)]

    def entries(self) -> list[dict[str, Any]]:
        """GET /sdapi/v1/upscalers' items of the models (AUTOMATIC1111's UpscalerItem; its ESRGAN models' scale)."""
        return [{"name": name, "model_name": "ESRGAN", "model_path": os.path.relpath(path, self.root),
                 "model_url": None, "scale": 4.0} for name, path in self._files().items() if path.endswith(SUFFIX)]

    def find(self, name: str, field: str) -> str | None:
        """`name` as the folder spells it (case-insensitive), None where the folder has no such model; an
        UpscalerError naming `field` for a pickle."""
        files = self._files()
        match = next((n for n in files if n.lower() == name.lower()), None)
        if match is None:
            return None
        if not files[match].endswith(SUFFIX):
            file = os.path.basename(files[match])
            raise UpscalerError(f"{field}: upscaler {name!r} is a pickle ({file}), which diffgraph never loads; "
                                f"convert it: diffgraph convert {file} {match}.safetensors (--key params_ema for "
                                "Real-ESRGAN files), then remove the pickle")
        return match

    def model(self, name: str) -> Any:
        """The spandrel model descriptor of `name`, loaded (or kept) for its file's current version; UpscalerError
        where the file is not an upscaler spandrel reads."""
        found = self.find(name, "upscaler")
        if found is None:
            raise UpscalerError(f"upscaler {name!r} is no longer in --upscaler-dir; send one of GET "
                                "/sdapi/v1/upscalers")
        name, path = found, os.path.join(self.root, found + SUFFIX)
        try:
            stamp = stamp_of(os.stat(path))
        except OSError as e:
            raise UpscalerError(f"upscaler {name!r}: {os.path.basename(path)} cannot be read ({e.strerror})") from None
        with self._lock:
            kept = self._loaded.get(name)
            if kept is not None and kept[0] == stamp:
                self._loaded.move_to_end(name)
                return kept[1]
        descriptor = self._load(name, path)
        with self._lock:
            self._loaded[name] = (stamp, descriptor)
            self._loaded.move_to_end(name)
            while len(self._loaded) > MAX_LOADED:
                self._loaded.popitem(last=False)
        return descriptor

    def _load(self, name: str, path: str) -> Any:
        from .safe_tensors import CHANGED_FIX, TensorFile

        spandrel = import_spandrel()
        where = f"upscaler {name!r} ({os.path.basename(path)})"
        try:
            with TensorFile(path, MAX_FILE_BYTES) as f:
                state = f.read()
        except FileChanged as e:  # rewritten while it was read (cp new old): the next request reads it again
            raise UpscalerError(f"{where} {e}; {CHANGED_FIX}") from None
        except UnusableFile as e:
            raise UpscalerError(f"{where} {e}") from None
        try:
            descriptor = spandrel.ModelLoader("cpu").load_from_state_dict(
                spandrel.canonicalize_state_dict(unwrap(state)))
        except Exception as e:  # spandrel's UnsupportedModelError, or a layout its architecture cannot take
            detail = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise UpscalerError(f"{where} is not an upscaler model spandrel reads ({detail}); give an ESRGAN-family "
                                ".safetensors file") from None
        if not isinstance(descriptor, spandrel.ImageModelDescriptor) or descriptor.purpose not in PURPOSES \
                or descriptor.input_channels != 3 or descriptor.output_channels != 3:
            raise UpscalerError(f"{where} is a {descriptor.architecture.name} {descriptor.purpose} model; "
                                "--upscaler-dir takes 3-channel super-resolution (or 1x restoration) models")
        return descriptor.eval().float()

    def enlarge(self, image: Image.Image, name: str) -> Image.Image:
        """`image` (RGB) through the model `name` once, tile by tile (module doc); its size times the model's scale."""
        model = self.model(name)
        width, height = image.width * model.scale, image.height * model.scale
        if width * height > MAX_PASS_PIXELS:
            raise UpscalerError(f"upscaler {name!r} would make a {width}x{height} image ({width * height} pixels) in "
                                f"one pass, above {MAX_PASS_PIXELS}; send a smaller image or scale")
        image = image.convert("RGB")
        if image.width <= self.tile and image.height <= self.tile:
            return run(model, image)
        tile_w, tile_h = min(self.tile, image.width), min(self.tile, image.height)
        grid = split_tiles(image, tile_w, tile_h, min(self.overlap, tile_w - 1, tile_h - 1))
        scale = model.scale
        outputs = [run(model, tile.image) for tile in grid.flat()]
        big = TileGrid(tuple(tuple(Tile(t.x * scale, t.y * scale, t.image) for t in row) for row in grid.tiles),
                       grid.tile_w * scale, grid.tile_h * scale, grid.width * scale, grid.height * scale,
                       grid.overlap * scale)
        return combine_tiles(big, outputs)


def run(model: Any, image: Image.Image) -> Image.Image:
    """One RGB image through a spandrel model descriptor, whole: float32 in [0, 1], rounded back to 8 bits."""
    import torch

    pixels = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
    with torch.inference_mode():
        out = model(pixels)[0].clamp(0, 1)
    return Image.fromarray((out.permute(1, 2, 0).numpy() * 255.0).round().astype(np.uint8), "RGB")
