"""FLUX.2 klein's reference images: the `reference_images` capability (its request parameter, check and preparation)
and its row feature (the references' tokens written into a row's fields at admission), on the shared reference machinery
(references.py).

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

Rows group by their references' total token count rounded up to a slot of `token_bucket`s (the group key's first
element, flux2.py `group_key`; references.py `reference_bucket`): rows with 1 or 2 references of any sizes whose
totals round to one slot share a step, each row's padding tokens masked out of attention.
"""

from __future__ import annotations

from typing import Any

import torch

from ...features.base import Admission, RowFeature
from ...features.capability import Capability
from .references import NAME, Reference, ReferenceRows, checked as checked_images, grid_ids, param, reference

MAX_REFERENCES = 4
MAX_AREA = 1024 * 1024  # the pipeline's area cap of a reference
MULTIPLE = 16           # its sides' multiple: the VAE's 8 times the 2x2 patchify
TIME_SCALE = 10         # reference i sits at time 10 + 10 i (`_prepare_image_ids`' scale)
PARAM = param(MAX_REFERENCES, "reference images")


def checked(images: tuple[Any, ...]) -> list[Any]:
    """The references as PIL RGB images, each one the pipeline takes; ParamError naming the field otherwise."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    return checked_images(images, PARAM, Flux2ImageProcessor(vae_scale_factor=MULTIPLE).check_image_input)


def preprocess(images: tuple[Any, ...]) -> tuple[Reference, ...]:
    """The pipeline's reference preprocessing (see the module's docstring), on the submitting thread."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    processor = Flux2ImageProcessor(vae_scale_factor=MULTIPLE)
    out = []
    for img in checked(images):
        if img.size[0] * img.size[1] > MAX_AREA:
            img = processor._resize_to_target_area(img, MAX_AREA)
        w, h = (img.size[0] // MULTIPLE) * MULTIPLE, (img.size[1] // MULTIPLE) * MULTIPLE
        out.append(reference(processor.preprocess(img, height=h, width=w, resize_mode="crop")))
    return tuple(out)


class ReferenceImages(Capability):
    """`reference_images`: up to 4 images (PIL or uint8 RGB arrays) a row's image is conditioned on."""

    name = NAME
    params = (PARAM,)

    def __init__(self, bucket: int):
        self.bucket = bucket

    def check(self, values: dict[str, Any], settings: Any) -> None:
        checked(tuple(values[NAME]))

    def prepare(self, values: dict[str, Any], settings: Any) -> tuple[Reference, ...]:
        return preprocess(tuple(values[NAME]))

    def feature(self, model: Any, settings: Any) -> RowFeature:
        return Flux2ReferenceRows(model, self.bucket, model.latent_channels)


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


class Flux2ReferenceRows(ReferenceRows):
    """FLUX.2's references in its rows (references.py `ReferenceRows`): its VAE's normalised tokens (`encode`),
    reference i at (10 + 10 i, row, column), their RoPE tables `rows.ref_cos` / `rows.ref_sin` made once for the
    row's life."""

    def encode(self, ref: Reference) -> torch.Tensor:
        return encode(self.model, ref.pixels)

    def positions(self, index: int, ref: Reference) -> torch.Tensor:
        return grid_ids(ref, TIME_SCALE * (index + 1))

    def tables(self, admission: Admission, refs: tuple[Reference, ...],
               ids: torch.Tensor) -> dict[str, torch.Tensor]:
        cos, sin = rotary(self.model.denoiser, ids)
        return {"rows.ref_cos": cos, "rows.ref_sin": sin}
