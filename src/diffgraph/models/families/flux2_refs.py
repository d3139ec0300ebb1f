"""FLUX.2 klein's reference images: the `reference_images` capability (its request parameter, check and preparation)
and its row feature (the references' tokens written into a row's fields at admission).

As diffusers' `Flux2KleinPipeline(image=[...])` does:
  * on the submitting thread (`prepare`): each image checked as the pipeline's image processor checks it (each side at
    least 64 px, aspect ratio at most 8), resized (Lanczos) to at most 1024 x 1024 pixels of area where larger, its
    sides rounded down to multiples of 16 and centre-cropped to them (`Flux2ImageProcessor.preprocess`, "crop"),
    in -1..1;
  * at admission, on the engine loop (`ReferenceRows.rows`): encoded by the VAE deterministically (the posterior's
    mode), patchified 2x2 and normalised by the VAE's batch-norm statistics like the latents, one token per 16 px
    cell, row-major; reference i's tokens at positions (t, h, w, l) = (10 + 10 i, row, column, 0) (the pipeline's
    `_prepare_image_ids`). Encodings are cached by the pixels' content hash (an LRU of `CACHE` entries);
  * in the transformer the references' tokens follow the image's in the image stream: attending and attended, their
    outputs dropped (flux2.py `denoise`).

Rows group by their references' total token count rounded up to `token_bucket` (the group key's first element,
flux2.py `group_key`): rows with 0, 1 or 2 references of any sizes whose totals round to one bucket share a step, each
row's padding tokens masked out of attention.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import ParamError
from ...features.base import Admission, RowFeature
from ...features.capability import Capability, Param
from ...request import MAX_EDIT_PIXELS

NAME = "reference_images"
MAX_REFERENCES = 4
MAX_AREA = 1024 * 1024  # the pipeline's area cap of a reference
MULTIPLE = 16           # its sides' multiple: the VAE's 8 times the 2x2 patchify
TIME_SCALE = 10         # reference i sits at time 10 + 10 i (`_prepare_image_ids`' scale)
CACHE = 32              # encoded references kept by content hash


@dataclass(frozen=True, eq=False)
class Reference:
    """One preprocessed reference: pixels [1, 3, h, w] in -1..1 (h, w multiples of 16) and their content hash."""

    pixels: torch.Tensor
    digest: str

    @property
    def tokens(self) -> int:
        return (self.pixels.shape[2] // MULTIPLE) * (self.pixels.shape[3] // MULTIPLE)


def reference_bucket(references: tuple[Reference, ...], bucket: int) -> int:
    """The reference tokens a row's group holds: its references' total rounded up to `bucket` (0 without any)."""
    return math.ceil(sum(r.tokens for r in references) / bucket) * bucket


def _rgb(value: Any, index: int) -> Any:
    """Reference `index` as a PIL RGB image; ParamError naming the field otherwise."""
    from PIL import Image

    where = f"{NAME}[{index}]"
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim != 3 or value.shape[2] != 3:
            raise ParamError(NAME, f"{where} must be RGB pixels: a uint8 array of shape (height, width, 3), got "
                                   f"{value.dtype} {tuple(value.shape)}")
        value = Image.fromarray(value)
    if not isinstance(value, Image.Image):
        raise ParamError(NAME, f"{where} must be a PIL image or a uint8 RGB array, got {type(value).__name__}")
    w, h = value.size
    if w * h > MAX_EDIT_PIXELS:
        raise ParamError(NAME, f"{where} is {w}x{h}; a reference is at most {MAX_EDIT_PIXELS // 2**20} megapixels")
    return value.convert("RGB")


def checked(images: tuple[Any, ...]) -> list[Any]:
    """The references as PIL RGB images, each one the pipeline takes; ParamError naming the field otherwise."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    if len(images) > MAX_REFERENCES:
        raise ParamError(NAME, f"{len(images)} reference images; send at most {MAX_REFERENCES}")
    processor = Flux2ImageProcessor(vae_scale_factor=MULTIPLE)
    out = []
    for i, value in enumerate(images):
        out.append(_rgb(value, i))
        try:
            processor.check_image_input(out[-1])
        except ValueError as e:
            raise ParamError(NAME, f"{NAME}[{i}]: {e}") from None
    return out


def preprocess(images: tuple[Any, ...]) -> tuple[Reference, ...]:
    """The pipeline's reference preprocessing (see the module's docstring), on the submitting thread."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    processor = Flux2ImageProcessor(vae_scale_factor=MULTIPLE)
    out = []
    for img in checked(images):
        if img.size[0] * img.size[1] > MAX_AREA:
            img = processor._resize_to_target_area(img, MAX_AREA)
        w, h = (img.size[0] // MULTIPLE) * MULTIPLE, (img.size[1] // MULTIPLE) * MULTIPLE
        pixels = processor.preprocess(img, height=h, width=w, resize_mode="crop").float()
        digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest() + f":{h}x{w}"
        out.append(Reference(pixels, digest))
    return tuple(out)


class ReferenceImages(Capability):
    """`reference_images`: up to 4 images (PIL or uint8 RGB arrays) a row's image is conditioned on."""

    name = NAME
    params = (Param(NAME, (), tuple, f"up to {MAX_REFERENCES} reference images (PIL or uint8 RGB arrays; base64 over "
                                     "HTTP)", images=True),)

    def __init__(self, bucket: int):
        self.bucket = bucket

    def check(self, values: dict[str, Any], settings: Any) -> None:
        checked(tuple(values[NAME]))

    def prepare(self, values: dict[str, Any], settings: Any) -> tuple[Reference, ...]:
        return preprocess(tuple(values[NAME]))

    def feature(self, model: Any, settings: Any) -> RowFeature:
        return ReferenceRows(model, self.bucket)


def rotary(net: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., head_dim] of image-stream positions [..., 3] as (time, row, column) (padding at -1: read at
    0), the transformer's fourth axis (the text's) at 0: what its `pos_embed` gives them."""
    ids = ids.clamp(min=0)
    cos, sin = net.pos_embed(torch.cat([ids, torch.zeros_like(ids[..., :1])], dim=-1).reshape(-1, 4))
    return cos.reshape(*ids.shape[:-1], cos.shape[-1]), sin.reshape(*ids.shape[:-1], sin.shape[-1])


def encode(model: Any, pixels: torch.Tensor) -> torch.Tensor:
    """A reference's pixels [1, 3, h, w] -> its tokens [h/16 * w/16, 128] as the pipeline's `_encode_vae_image`: the
    posterior's mode, patchified 2x2, normalised by the VAE's batch-norm statistics, row-major. Above the native
    area in the VAE's tiles, as the family's other encodes (`FamilyAdapter.encode_pixels`)."""
    vae = model.vae
    with torch.no_grad():
        moments = model.adapter.encode_pixels(model, vae, pixels.to(model.device, vae.dtype))
        latents = normalised(vae, moments[:, : moments.shape[1] // 2])  # the posterior's mode: its mean
    return latents.reshape(latents.shape[1], -1).T.to(model.dtype)


def normalised(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """The VAE's latents [n, 32, h, w] -> [n, 128, h/2, w/2]: patchified 2x2 (channel, patch row, patch column) and
    normalised by the VAE's batch-norm statistics (the pipelines' `_patchify_latents`, then their bn step)."""
    n, c, h, w = latents.shape
    latents = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(n, c * 4, h // 2, w // 2)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                         latents.dtype)
    return (latents - mean) / std


class ReferenceRows(RowFeature):
    """Writes a request's reference tokens, their positions, RoPE tables and mask into its rows' `rows.ref_*` fields
    (the family declares them in `row_spec`, neutral: no reference) at admission, on the engine loop."""

    name = NAME

    def __init__(self, model: Any, bucket: int):
        self.model = model
        self.bucket = bucket
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def _tokens(self, ref: Reference) -> torch.Tensor:
        cached = self._cache.get(ref.digest)
        if cached is None:
            cached = self._cache[ref.digest] = encode(self.model, ref.pixels)
            while len(self._cache) > CACHE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(ref.digest)
        return cached

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        refs = admission.prepared.get(NAME, ())
        if not refs:
            return {}
        total = reference_bucket(refs, self.bucket)
        device = self.model.device
        tokens = torch.zeros((1, total, self.model.latent_channels), dtype=self.model.dtype, device=device)
        ids = torch.full((1, total, 3), -1, dtype=torch.int64)
        mask = torch.zeros((1, total), dtype=torch.bool)
        start = 0
        for i, ref in enumerate(refs):
            h, w = ref.pixels.shape[2] // MULTIPLE, ref.pixels.shape[3] // MULTIPLE
            stop = start + h * w
            tokens[0, start:stop] = self._tokens(ref)
            r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            ids[0, start:stop] = torch.stack([torch.full((h * w,), TIME_SCALE * (i + 1)), r.reshape(-1),
                                              c.reshape(-1)], dim=1)
            mask[0, start:stop] = True
            start = stop
        ids = ids.to(device)
        cos, sin = rotary(self.model.denoiser, ids)  # the references' RoPE tables, made once for the row's life
        return {"rows.ref_tokens": tokens, "rows.ref_ids": ids, "rows.ref_mask": mask.to(device),
                "rows.ref_cos": cos, "rows.ref_sin": sin}
