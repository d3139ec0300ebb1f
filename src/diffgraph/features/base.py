"""The row-feature interface: one per-row capability (guidance, an edit's start and blend, LoRA rows, ...) in one
module.

A feature declares, for the rows of one resolution group:
  * its per-row fields (`fields`: name -> `FieldSpec` with shape, dtype and neutral value): the step buffers
    allocate, compact and snapshot them, and a row that does not use the feature holds the neutral value;
  * its per-step host inputs (`columns`, filled per request by `plan_columns`): extra columns of the row's
    coefficient table, so they reach the step with the sampler's numbers in one copy;
  * how many denoiser rows a row costs at each step (`branches`, CFG's two branches; default one);
  * its hooks inside the step, all pure tensor functions over a `StepView` (capturable): `model_input` (the
    denoiser's input), `denoiser_inputs` (per denoiser row inputs the family's denoiser reads), `before_denoise`
    and `after_denoise` (around the denoiser call, as a try/finally: torch.compile traces it), `combine` (the
    outputs of a row's branches -> one model output), `after_update` (x after the sampler's base update: the sampler's history terms, the inpainting blend);
  * its part of the graph variant key: a request's part (`part`, at admission, CPU data), the step's part from
    the live requests' parts (`variant`; the neutral part shares one set of graphs with every other neutral
    feature) and the parts that exist (`variants`: all captured at start-up). A feature whose part only sets how
    many prompt tokens the step reads (`tokens(part)`; the prompt context) changes shapes, never code: its parts
    combine with every other variant, and the compiled step sees them as a dynamic dimension.
Two host hooks read the step's own numbers: `after_plan` (its columns of a request's table adjusted once the plan's
denoiser rows per plan row are known) and `step_part` (its part refined from the step's host coefficient table and
denoiser-row layout, before the step: a refined part not among `variants()` gets graphs of its own, registered and
captured at its first use; `eager(part)`: no graph can hold it, so that step runs eagerly).
Admission (what a request writes into its rows) is the feature's `rows(...)`, called on the loop thread with the
request's prepared inputs; preparation that costs CPU happens on the submitting thread before.
A family adapter lists its features (`FamilyAdapter.features(model)`); `program.StepProgram` composes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ..request import GenerationRequest

Conditioning = dict[str, torch.Tensor]  # field name -> [rows, ...]


@dataclass(frozen=True)
class FieldSpec:
    """One per-row buffer field: its per-row shape, dtype and the value of a row that does not use the feature."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    neutral: float | tuple[float, ...] = 0.0  # a number, or one per leading channel
    tokens: bool = False  # its first per-row axis is the prompt's token axis (the step reads its first positions)
    # indexed by denoiser row and written anew every step (ControlNet residuals): no row state, never compacted,
    # saved or written at admission
    transient: bool = False
    # a sampler's history slot (1..HISTORY_SLOTS; 0: not one): row state only for the rows of a request whose sampler
    # declares at least this many slots (`SamplerPlan.history`); the others hold the neutral value, and a preemption
    # neither saves nor restores the slot for them (it is written neutral where they resume)
    history_slot: int = 0
    # allocated at the first write of a row that uses it (an admission or a restore that carries it): until then the
    # group holds no rows of it (a zero-row tensor), so a group whose rows never use the feature pays nothing. Only
    # for a field that no step reads unless a row of the step wrote it (a graph that reads it is captured after that)
    lazy: bool = False

    def fill(self, t: torch.Tensor) -> None:
        """Writes the neutral value into `t` ([rows, *shape])."""
        if isinstance(self.neutral, tuple):
            for c, v in enumerate(self.neutral):
                t[:, c] = v
        else:
            t.fill_(self.neutral)


@dataclass
class Admission:
    """What the engine resolved for one admitted request, handed to each feature's `rows` on the loop thread."""

    request: GenerationRequest
    rows: int
    group: tuple = ()  # the group key its rows run in (request.GroupKey)
    uncond: Conditioning | None = None  # the negative prompt's conditioning (the runner pads it to the prompt's)
    edit: dict[str, torch.Tensor] = field(default_factory=dict)  # engine/edits.py's per-row fields
    chunks: int = 1                                              # 77-token prompt windows of its conditioning
    # (ControlNet slot, image [1, 3, H, W], control mode: 0 balanced, 1 prompt, 2 control) per control
    controls: list[tuple[int, torch.Tensor, int]] = field(default_factory=list)
    image_prompts: dict[str, torch.Tensor] = field(default_factory=dict)  # engine/ip_adapters.py's row fields
    prepared: dict[str, Any] = field(default_factory=dict)  # registered capabilities' preparations, by name
    # the device slots of the registered capabilities' files (slot_files.py), by files' name: file name -> slot
    slots: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class StepView:
    """What the step hooks see: the group's fields (views of rows [0, n)), the denoiser-row layout, and the coefficient
    columns of every feature.

    Denoiser row j runs image row `den_row[j]`, in its main branch or (`den_alt[j]` = 1) its second branch; image
    row r's outputs are at denoiser rows `out_main[r]` and `out_alt[r]` (the same row for a row with one branch)."""

    fields: dict[str, torch.Tensor]
    coefs: torch.Tensor            # [n, columns] fp32
    columns: dict[str, int]        # feature column name -> index into coefs
    n: int
    den_row: torch.Tensor          # [D] int64
    den_alt: torch.Tensor          # [D] int64 (0 / 1)
    out_main: torch.Tensor         # [n] int64
    out_alt: torch.Tensor          # [n] int64
    dtype: torch.dtype             # the denoiser's input dtype

    def column(self, name: str) -> torch.Tensor:
        """A feature's coefficient column, [n, 1, ...] for broadcasting over latents (of any rank: [C, h, w] image
        latents, [tokens, C] packed ones)."""
        return self.coefs[:, self.columns[name]].view(self.n, *(1,) * (self.fields["x"].dim() - 1))

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """A per-image-row tensor, per denoiser row."""
        return t.index_select(0, self.den_row)

    def lazy(self, name: str) -> torch.Tensor:
        """A lazy field (`FieldSpec.lazy`); a RuntimeError where no row wrote it yet (a step reads one only where a
        row of the step uses it, so a graph never captures the storage it holds before its first write)."""
        t = self.fields[name]
        if t.shape[0] < self.n:
            raise RuntimeError(f"field {name!r} is read by a step before any row of its group wrote it; read a lazy "
                               "field only in a step with a row that uses it")
        return t


class RowFeature:
    """Neutral defaults for every hook: a feature overrides what it does."""

    name: str = ""
    # the request parameter (a `GenerationRequest.extras` key, else a request attribute of that name) through which a
    # request asks this feature for anything, with the values that ask nothing: a request without another value skips every per-request hook and its part
    # stays neutral (so a plain request never calls into a capability it does not use); None: every request may ask
    asked_by: tuple[str, tuple[Any, ...]] | None = None

    # -- declarations ----------------------------------------------------------------------------
    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        return {}

    def columns(self) -> tuple[str, ...]:
        return ()

    def plan_columns(self, request: GenerationRequest, index: np.ndarray) -> dict[str, np.ndarray]:
        """Per-row values of this feature's columns for the plan rows a request runs: `index[i]` is the step of its
        `num_inference_steps` row i belongs to (an edit starts later; a two-evaluation sampler's two rows share a
        step)."""
        return {}

    def after_plan(self, table: np.ndarray, columns: dict[str, int], branches: np.ndarray) -> None:
        """Adjusts this feature's columns of a request's coefficient table (in place) once its denoiser rows per
        plan row (`branches`, every feature's) are known."""

    def branches(self, request: GenerationRequest, index: np.ndarray) -> np.ndarray | None:
        """Denoiser rows per image row at each plan row (1 or 2), or None (one everywhere); `index` as above."""
        return None

    def has_alt_branch(self) -> bool:
        """True for the feature whose rows may run a second denoiser branch (CFG's unconditional one)."""
        return False

    def alt_cond(self, view: StepView, name: str) -> torch.Tensor:
        """The second branch's conditioning field `name` (image rows)."""
        raise NotImplementedError

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        """Values of this feature's fields for an admitted request's rows (a tensor of one row or of every row, or
        a number); fields left out take their neutral value."""
        return {}

    # -- the step's hooks (capturable tensor functions) ----------------------------------------------
    def model_input(self, view: StepView, x_in: torch.Tensor) -> torch.Tensor:
        return x_in

    def denoiser_inputs(self, view: StepView, part: Any = None) -> dict[str, torch.Tensor]:
        """Per denoiser row inputs of the family's denoiser (`part`: this step's part, as the graphs see it)."""
        return {}

    def prepass(self, view: StepView, part: Any, d: int, x: torch.Tensor, t: torch.Tensor,
                cond: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor],
                live: Sequence[tuple[int, int, Any]] | None = None) -> None:
        """Before the step, outside its graph, with the step's full part: work the step reads (the ControlNets'
        residuals into transient fields). `x`, `t`, `cond`, `inputs`: the denoiser's batch over denoiser rows [0, d);
        `live`: (image rows, branches this step, this feature's part) per live request, in row order (None: not
        known)."""

    def before_denoise(self, view: StepView, part: Any) -> None:
        """Called just before the denoiser with this step's variant part (e.g. sets the LoRA side paths' rows)."""

    def after_denoise(self, view: StepView, part: Any) -> None:
        """Called after the denoiser, also when it raised."""

    def combine(self, view: StepView, main: torch.Tensor, alt: torch.Tensor) -> torch.Tensor:
        return main

    def after_update(self, view: StepView, x_next: torch.Tensor, denoised: torch.Tensor) -> torch.Tensor:
        """x_next after the sampler's base update (`denoised`: the row's D this step; `view.fields` still hold the
        values before the step: x, d_prev, history)."""
        return x_next

    # -- variants ----------------------------------------------------------------------------------
    def variants(self) -> Sequence[Any]:
        """The parts of the variant key this feature can take, the neutral one first."""
        return (None,)

    def part(self, admission: Admission) -> Any:
        """This request's part of the variant key (kept with the request while its rows live)."""
        return self.variants()[0]

    def variant(self, parts: Sequence[Any]) -> Any:
        """The step's part, from the live requests' parts: one of `variants()` that runs all of them."""
        return self.variants()[0]

    def step_part(self, part: Any, coefs: np.ndarray, columns: dict[str, int], index: np.ndarray, d: int,
                  gather: bool = True) -> Any:
        """The step's part refined on the host from the step's own numbers (no device sync): `coefs` its coefficient
        table [n, columns] (feature columns at `columns`), `index` its denoiser-row layout (program.layout: den_row,
        den_alt, ...) over denoiser rows [0, d); `gather` False when another feature of the step sets per-row state
        the denoiser reads (LoRA rows, image prompts): a part may then not run the denoiser over a subset of rows.
        Called for a part other than the neutral one only. Default: `part`."""
        return part

    def eager(self, part: Any) -> bool:
        """Whether a step with this (refined) part runs eagerly, without the step's graphs (asked of a part other than
        the neutral one only)."""
        return False

    def graph_part(self, part: Any) -> Any:
        """The part the step's code and graphs see (one of `variants()`): `part` itself, unless the feature's step
        part says more than the code needs (the ControlNet pairs a prepass runs)."""
        return part

    def tokens(self, part: Any) -> int | None:
        """For a feature whose parts only change shapes: the prompt tokens a step with `part` reads (the token-axis
        fields' first positions); None for every other feature."""
        return None
