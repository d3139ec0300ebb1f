"""ControlNet rows as a row feature: per row, up to `MAX_CONTROLS` controls, each a loaded ControlNet's
slot, a control image and a scale per step; rows with different ControlNets, scales and windows, and rows without
control, share one step.

Fields per control k: `control.slot{k}` (the ControlNet's device slot, 0 = none), `control.mode{k}` (its control
mode: 0 balanced, 1 prompt, 2 control; request_inputs.py), `control.embed{k}` (the ControlNet's
`controlnet_cond_embedding` of the row's control image, [block_out_channels[0], h, w] at the latent size, computed
once at admission: diffusers computes it at every step; engine/controlnets.py). Modes "prompt" and "control" weight residual i of R by
diffusers' guess-mode scales (torch.logspace(-1, 0, R)); "control" reaches the conditional branch only, its ControlNet
not even run over the second branch's rows (diffusers' `guess_mode=True`). Columns: `control.scale{k}`,
the row's `scale` at the plan rows inside its window and 0 outside, as diffusers' `controlnet_keep`: plan row p of P
runs control when not (p / P < start or (p + 1) / P > end). The residual fields (`control.res{i}`, one per UNet
down-block residual and the mid block's) are per denoiser row and written anew every step (`transient`: never
compacted or saved).

The ControlNets run before the step (`prepass`, outside the step's graph): for each (control k, slot s) pair in use
this step, the ControlNet of slot s over only the denoiser rows whose control k is slot s, gathered (the UNet's own
scaled input, timestep and conditioning per branch, as diffusers' pipelines pass them without guess mode; the count
from the live requests' parts, so nothing waits for the device), its residuals times each row's scale added into
those rows of the residual fields. `run` is the engine's (engine/control_graphs.py: a CUDA graph per slot and
gathered bucket, or eager). The step's variant
part is only whether residuals are read ("on"), so every ControlNet mix shares one step graph, and a step without
control rows is today's step, residuals not even read.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

from ..request import MAX_CONTROLS, GenerationRequest
from .base import Admission, FieldSpec, RowFeature, StepView

CONTROL_ONLY = 2  # the control mode ("ControlNet is more important") whose residuals reach the conditional branch only
# (slot, x [D, C, h, w], t [D], conditioning per denoiser row, row inputs, control embedding [D, C0, h, w])
#   -> (down-block residuals, mid-block residual)
ControlCall = Callable[[int, torch.Tensor, torch.Tensor, dict, dict, torch.Tensor],
                       tuple[Sequence[torch.Tensor], torch.Tensor]]


class ControlSlots(Protocol):
    """What runs the loaded ControlNets by device slot (engine/control_graphs.py:ControlRunner)."""

    def run(self, slot: int, x: torch.Tensor, t: torch.Tensor, cond: dict, inputs: dict,
            image: torch.Tensor) -> tuple[Sequence[torch.Tensor], torch.Tensor]: ...


def residual_shapes(unet_config: Any, latent_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shapes of a ControlNet's residuals for this UNet at `latent_shape` (the UNet's down path: conv_in's output,
    each layer's, each downsampler's, then the mid block's)."""
    channels = list(unet_config.block_out_channels)
    layers = unet_config.layers_per_block
    layers = list(layers) if isinstance(layers, (list, tuple)) else [layers] * len(channels)
    h, w = latent_shape[1:]
    shapes = [(channels[0], h, w)]
    for i, c in enumerate(channels):
        shapes += [(c, h, w)] * layers[i]
        if i < len(channels) - 1:
            h, w = (h + 1) // 2, (w + 1) // 2
            shapes.append((c, h, w))
    return shapes + [(channels[-1], h, w)]


def keep_window(start: float, end: float, plan_rows: int) -> np.ndarray:
    """[plan rows] 1.0 where the control runs, as diffusers' `controlnet_keep`."""
    p = np.arange(plan_rows)
    return 1.0 - ((p / plan_rows < start) | ((p + 1) / plan_rows > end)).astype(np.float64)


class ControlRows(RowFeature):
    name = "control"

    def __init__(self, unet_config: Any, dtype: torch.dtype, run: ControlCall):
        self._unet, self._dtype, self._run = unet_config, dtype, run
        self._mode_weights: torch.Tensor | None = None

    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        h, w = latent_shape[1:]
        channels = int(self._unet.block_out_channels[0])  # the embedding's (a ControlNet mirrors its UNet)
        out = {}
        for k in range(MAX_CONTROLS):
            out[f"control.slot{k}"] = FieldSpec((1,), torch.float32)
            out[f"control.mode{k}"] = FieldSpec((1,), torch.float32)  # 0 balanced, 1 prompt, 2 control
            out[f"control.embed{k}"] = FieldSpec((channels, h, w), self._dtype)
        for i, shape in enumerate(residual_shapes(self._unet, latent_shape)):
            out[f"control.res{i}"] = FieldSpec(shape, self._dtype, transient=True)
        return out

    def columns(self) -> tuple[str, ...]:
        return tuple(f"control.scale{k}" for k in range(MAX_CONTROLS))

    def plan_columns(self, request: GenerationRequest, index: np.ndarray) -> dict[str, np.ndarray]:
        return {f"control.scale{k}": c.scale * keep_window(c.start, c.end, len(index))
                for k, c in enumerate(request.controls)}

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        out: dict[str, torch.Tensor | float] = {}
        for k, (slot, embed, mode) in enumerate(admission.controls):
            out[f"control.slot{k}"] = float(slot)
            out[f"control.mode{k}"] = float(mode)
            out[f"control.embed{k}"] = embed.to(self._dtype)
        return out

    # -- variants ----------------------------------------------------------------------------------
    def variants(self) -> Sequence[Any]:
        return (None, "on")

    def part(self, admission: Admission) -> Any:
        """(control, slot, conditional branch only) per control of the request."""
        return tuple((k, slot, mode == CONTROL_ONLY) for k, (slot, _, mode) in enumerate(admission.controls)) or None

    def variant(self, parts: Sequence[Any]) -> Any:
        """The (control, slot) pairs the live rows use (the prepass runs them); `graph_part` folds it to "on"."""
        pairs = sorted({(k, slot) for p in parts if p for k, slot, _ in p})
        return tuple(pairs) or None

    def graph_part(self, part: Any) -> Any:
        return "on" if part else None

    # -- the step ----------------------------------------------------------------------------------
    def prepass(self, view: StepView, part: Any, d: int, x: torch.Tensor, t: torch.Tensor, cond: dict,
                inputs: dict, live: Sequence[tuple[int, int, Any]] | None = None) -> None:
        res = [t for name, t in view.fields.items() if name.startswith("control.res")]  # [d, ...] each
        for r in res:
            r.zero_()
        weights = self._weights(len(res), res[0].device)
        for k, slot in part or ():
            mode = view.fields[f"control.mode{k}"][:, 0]
            # the rows with this pair: their conditional branch, and their second one unless mode "control"
            picked = view.gather((view.fields[f"control.slot{k}"][:, 0] == float(slot)).to(torch.int8))  # [d]
            picked = picked * ((view.gather(mode) != CONTROL_ONLY) | (view.den_alt == 0)).to(torch.int8)
            # counted on the host (no sync): the live requests whose part holds the pair
            count = (sum(rows * (1 if cond_only else branches) for rows, branches, p in live
                         for kk, ss, cond_only in p or () if (kk, ss) == (k, slot)) if live is not None
                     else int(picked.sum()))
            if count == 0:
                continue
            # the picked rows first, in order (a padding row points at row 0: after every live row); no sync
            rows = (1 - picked).argsort(stable=True)[:count]
            image_rows = view.den_row.index_select(0, rows)
            sub = {name: c.index_select(0, rows) for name, c in cond.items()}
            sub_inputs = {name: r.index_select(0, rows) for name, r in inputs.items()}
            embed = view.fields[f"control.embed{k}"].index_select(0, image_rows)
            downs, mid = self._run(slot, x.index_select(0, rows), t.index_select(0, rows), sub, sub_inputs, embed)
            scale = view.coefs[:, view.columns[f"control.scale{k}"]].index_select(0, image_rows)
            # [rows, residuals]: the row's scale times its control mode's weight per residual
            scale = scale[:, None] * weights.index_select(0, mode.index_select(0, image_rows).long())
            for i, (r, out) in enumerate(zip(res, [*downs, mid])):
                r.index_add_(0, rows, out[:count] * scale[:, i].to(out.dtype).view(-1, *([1] * (out.dim() - 1))))

    def _weights(self, residuals: int, device: torch.device) -> torch.Tensor:
        """[3, residuals] per control mode: balanced 1; prompt and control diffusers' guess-mode scales."""
        w = self._mode_weights
        if w is None or w.shape[1] != residuals or w.device != device:
            soft = torch.logspace(-1, 0, residuals)
            w = self._mode_weights = torch.stack([torch.ones(residuals), soft, soft]).to(device)
        return w

    def denoiser_inputs(self, view: StepView, part: Any = None) -> dict[str, torch.Tensor]:
        if part is None:
            return {}
        return {name: t for name, t in view.fields.items() if name.startswith("control.res")}


def residual_kwargs(inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The UNet's keyword arguments for the residuals among a step's denoiser inputs (none: no control this step)."""
    res = [inputs[f"control.res{i}"] for i in range(len(inputs)) if f"control.res{i}" in inputs]
    if not res:
        return {}
    return {"down_block_additional_residuals": res[:-1], "mid_block_additional_residual": res[-1]}
