"""Reference images as row inputs, shared by the families that read them (FLUX.2 klein's references: flux2_refs.py;
Qwen-Image-Edit's input images: qwen_image_edit.py): the request's `reference_images` parameter, its check, and the
row feature that writes a request's references into its rows at admission.

The request side: `reference_images` is a list of PIL images or uint8 RGB arrays (base64 strings over HTTP: the JSON
route decodes every `Param.images` parameter; the edits route's image parts and AUTOMATIC1111's `init_images` fill it
where the family says `edit_images`), at most the parameter's `limit` (/info's `image_limits`), each checked
(`checked`) and preprocessed on the submitting thread into a `Reference`: pixels in -1..1 whose sides are multiples
of 16 (one token per 16 px cell in both families) and their content hash.

The row side (`ReferenceRows`): at admission each reference is encoded by the family (`encode`: its VAE's tokens,
cached by content hash, an LRU of `CACHE` entries), laid out one after another in the row's `ref_tokens` field with
their positions (`positions`: the family's per-reference grid ids) and a mask over the group's slack; the family turns
the ids into its rotary tables (`tables`). The group holds `reference_bucket` reference tokens: the rows' totals
in the family's token buckets rounded up to a ladder of slots (1, 2, 3, 4, 6, 8, 12, ... buckets), so rows with
different numbers of references share a step where their totals round alike, each row's padding masked, and a graphed
group of image tokens gets a bounded number of reference slots (the family's `graph_group`: their graphs are captured
on first use).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ...errors import ParamError
from ...features.base import Admission, RowFeature
from ...features.capability import Param
from ...request import MAX_EDIT_PIXELS

NAME = "reference_images"
CELL = 16      # pixels per reference token side (the VAE's 8 times the 2x2 patchify, in both families)
CACHE = 32     # encoded references kept by content hash


@dataclass(frozen=True, eq=False)
class Reference:
    """One preprocessed reference: pixels [1, 3, h, w] in -1..1 (h, w multiples of 16) and their content hash."""

    pixels: torch.Tensor
    digest: str

    @property
    def grid(self) -> tuple[int, int]:
        """Its tokens per column and per row."""
        return self.pixels.shape[2] // CELL, self.pixels.shape[3] // CELL

    @property
    def tokens(self) -> int:
        h, w = self.grid
        return h * w


def reference(pixels: torch.Tensor) -> Reference:
    """A `Reference` of preprocessed pixels [1, 3, h, w], hashed by content and size."""
    pixels = pixels.float()
    digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest() + f":{pixels.shape[2]}x{pixels.shape[3]}"
    return Reference(pixels, digest)


def reference_bucket(references: tuple[Reference, ...], bucket: int) -> int:
    """The reference tokens a row's group holds: its references' total in `bucket`s rounded up to the ladder 1, 2, 3,
    4, 6, 8, 12, 16, ... (the powers of two and three times them: at most 1.5 times the total, and a dozen slots up to
    64 buckets, so a graphed group has a bounded number of reference slots), times `bucket` (0 without any)."""
    return _ladder(math.ceil(sum(r.tokens for r in references) / bucket)) * bucket


def _ladder(units: int) -> int:
    """The smallest of 0, 1, 2, 3, 4, 6, 8, 12, 16, ... of at least `units`."""
    if units <= 2:
        return units
    power = 1 << (units - 1).bit_length()  # the smallest power of two of at least `units`
    return power * 3 // 4 if units <= power * 3 // 4 else power


def checked_slot(tokens: int, bucket: int) -> int:
    """`tokens` where it is a reference slot of `bucket`s (`reference_bucket`'s ladder); a ValueError naming the
    setting and the nearest slots otherwise."""
    if tokens > 0 and tokens % bucket == 0 and _ladder(tokens // bucket) == tokens // bucket:
        return tokens
    up = _ladder(math.ceil(max(tokens, 1) / bucket)) * bucket
    raise ValueError(f"reference_slots {tokens} is not a reference slot of this model (its references' tokens round "
                     f"up to 1, 2, 3, 4, 6, 8, 12, ... x {bucket}); use {up}")


def param(limit: int, what: str) -> Param:
    """The `reference_images` request parameter of a family that reads up to `limit` of them."""
    return Param(NAME, (), tuple, f"up to {limit} {what} (PIL or uint8 RGB arrays; base64 over HTTP)", images=True,
                 limit=limit, items=what)


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


def checked(images: tuple[Any, ...], spec: Param, check: Callable[[Any], None]) -> list[Any]:
    """The references as PIL RGB images, at most the parameter's `limit`, each passing the family's `check` (a
    ValueError saying why not); ParamError naming the field otherwise (the playground words the count's alike:
    controls.js `tooMany`)."""
    if len(images) > spec.limit:
        raise ParamError(NAME, f"{len(images)} {spec.items}; send at most {spec.limit}")
    out = []
    for i, value in enumerate(images):
        out.append(_rgb(value, i))
        try:
            check(out[-1])
        except ValueError as e:
            raise ParamError(NAME, f"{NAME}[{i}]: {e}") from None
    return out


class ReferenceRows(RowFeature):
    """Writes a request's reference tokens, their positions and mask into its rows' `rows.ref_tokens`, `rows.ref_ids`
    and `rows.ref_mask` fields (the family declares them in `row_spec`, neutral: no reference), and the family's
    tables of them (`tables`), at admission, on the engine loop. A family subclasses it with `encode` (a reference ->
    its tokens [tokens, channels]), `positions` (reference i's grid ids) and `tables`."""

    name = NAME

    def __init__(self, model: Any, bucket: int, channels: int):
        self.model = model
        self.bucket = bucket
        self.channels = channels
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def encode(self, ref: Reference) -> torch.Tensor:
        raise NotImplementedError

    def positions(self, index: int, ref: Reference) -> torch.Tensor:
        """Reference `index`'s token ids [tokens, 3], row-major."""
        raise NotImplementedError

    def tables(self, admission: Admission, refs: tuple[Reference, ...],
               ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The family's row fields made from the references' ids [1, total, 3] (padding at -1): its rotary tables."""
        return {}

    def _tokens(self, ref: Reference) -> torch.Tensor:
        cached = self._cache.get(ref.digest)
        if cached is None:
            cached = self._cache[ref.digest] = self.encode(ref)
            while len(self._cache) > CACHE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(ref.digest)
        return cached

    def references(self, admission: Admission) -> tuple[Reference, ...]:
        """The request's references (its preparation's)."""
        return admission.prepared.get(NAME, ())

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        refs = self.references(admission)
        if not refs:
            return {}
        total = reference_bucket(refs, self.bucket)
        device = self.model.device
        tokens = torch.zeros((1, total, self.channels), dtype=self.model.dtype, device=device)
        ids = torch.full((1, total, 3), -1, dtype=torch.int64)
        mask = torch.zeros((1, total), dtype=torch.bool)
        start = 0
        for i, ref in enumerate(refs):
            stop = start + ref.tokens
            tokens[0, start:stop] = self._tokens(ref)
            ids[0, start:stop] = self.positions(i, ref)
            mask[0, start:stop] = True
            start = stop
        ids = ids.to(device)
        return {"rows.ref_tokens": tokens, "rows.ref_ids": ids, "rows.ref_mask": mask.to(device),
                **self.tables(admission, refs, ids)}


def grid_ids(ref: Reference, frame: int, row0: int = 0, col0: int = 0) -> torch.Tensor:
    """Token ids [tokens, 3] of a reference's grid as (frame, row0 + row, col0 + column), row-major."""
    h, w = ref.grid
    r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([torch.full((h * w,), frame), r.reshape(-1) + row0, c.reshape(-1) + col0], dim=1)
