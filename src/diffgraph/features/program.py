"""`StepProgram`: a family's row features composed into one whole step.

It owns the layout every feature shares: the buffer fields (the base fields x, d_prev, noise and the family's
conditioning, then each feature's), the coefficient table's columns (the sampler's `Coef` columns, then each
feature's), the per-request host inputs (`request_plan`: its columns and `branches`), the variant key (a tuple of the features'
parts: the neutral key shares one set of graphs) and the step itself (`run`): input scaling, the features' input
hooks, the denoiser over the step's denoiser rows (a row with one branch costs one denoiser row, a CFG row two),
the output combiner, the sampler update (`sampling.samplers.apply_step`, which reads the unguided output too: DDIM
CFG++'s column U) and the after-update hooks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..request import GenerationRequest
from ..sampling.samplers import NUM_COEFS, Coef, SamplerPlan, apply_step
from .base import Admission, FieldSpec, RowFeature, StepView

# (model input [D, C, h, w], timesteps [D], conditioning fields [D, ...], per-row inputs [D, ...]) -> output [D, ...]
Denoiser = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor]
VariantKey = tuple  # one part per feature, in the program's feature order


@dataclass(frozen=True)
class StepProgram:
    features: tuple[RowFeature, ...]

    def __post_init__(self) -> None:
        names = [f.name for f in self.features]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"row features need distinct non-empty names, got {names}")
        if sum(f.has_alt_branch() for f in self.features) > 1:
            raise ValueError("at most one row feature may run a second denoiser branch")
        # derived once (the step reads them every call): plain attributes, not dataclass fields, so the compile
        # tier's signature of the program (its fields) is the features alone
        names = [c for f in self.features for c in f.columns()]
        neutral = tuple(f.variants()[0] for f in self.features)
        shaping = [i for i, f in enumerate(self.features) if f.tokens(neutral[i]) is not None]
        if len(shaping) > 1:
            raise ValueError("at most one row feature may set the prompt tokens a step reads")
        variants = [neutral]
        for i, f in enumerate(self.features):
            if i not in shaping:
                variants += [neutral[:i] + (part,) + neutral[i + 1:] for part in f.variants()[1:]]
        for i in shaping:  # shapes only: every code variant at every token count
            variants = [v[:i] + (part,) + v[i + 1:] for v in variants for part in self.features[i].variants()]
        object.__setattr__(self, "_columns", {c: NUM_COEFS + i for i, c in enumerate(names)})
        object.__setattr__(self, "_alt", next((f for f in self.features if f.has_alt_branch()), None))
        object.__setattr__(self, "_neutral", neutral)
        object.__setattr__(self, "_variants", tuple(variants))
        object.__setattr__(self, "_shaping", shaping[0] if shaping else None)

        def overriding(hook: str) -> tuple[int, ...]:  # the features that override a host-side hook
            return tuple(i for i, f in enumerate(self.features) if getattr(type(f), hook) is not getattr(RowFeature, hook))
        object.__setattr__(self, "_overrides", {h: overriding(h) for h in ("plan_columns", "branches", "part",
                                                                            "variant", "rows", "prepass",
                                                                            "graph_part", "step_part",
                                                                            "before_denoise", "eager",
                                                                            "after_plan", "denoiser_inputs")})
        object.__setattr__(self, "_gated", any(f.asked_by is not None for f in self.features))
        object.__setattr__(self, "_transient", frozenset(
            name for f in self.features for name, spec in f.fields((4, 8, 8)).items() if spec.transient))
        object.__setattr__(self, "kinds", {v: self.kind(v) for v in variants})  # variant key -> graph kind

    # -- layout --------------------------------------------------------------------------------
    @property
    def columns(self) -> dict[str, int]:
        """Feature column name -> its index in the coefficient table (after the sampler's columns)."""
        return self._columns

    @property
    def num_columns(self) -> int:
        return NUM_COEFS + len(self.columns)

    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        out: dict[str, FieldSpec] = {}
        for f in self.features:
            for name, spec in f.fields(latent_shape).items():
                if name in out:
                    raise ValueError(f"row field {name!r} is declared twice (feature {f.name!r})")
                out[name] = spec
        return out

    @property
    def alt(self) -> RowFeature | None:
        """The feature whose rows may run a second denoiser branch (classifier-free guidance), or None."""
        return self._alt

    # -- per request (host) ----------------------------------------------------------------------
    def request_plan(self, request: GenerationRequest, plan: SamplerPlan) -> SamplerPlan:
        """The request's plan with the features' per-row columns in its coefficient table and its denoiser rows per
        image row at each plan row (`branches`)."""
        coefs, branches = self.request_coefs(request, plan.coefs, plan.step_index), self.branches(request,
                                                                                                 plan.step_index)
        for i in self._asked(request, "after_plan"):
            self.features[i].after_plan(coefs, self.columns, branches)
        return dataclasses.replace(plan, coefs=coefs, branches=branches)

    def request_coefs(self, request: GenerationRequest, sampler_coefs: np.ndarray, index: np.ndarray) -> np.ndarray:
        """The request's coefficient table: the sampler's columns, then each feature's per-row columns (`index`: the
        step of the request's steps each plan row belongs to, `SamplerPlan.step_index`)."""
        rows = sampler_coefs.shape[0]
        table = np.zeros((rows, self.num_columns), dtype=np.float64)
        table[:, :NUM_COEFS] = sampler_coefs
        cols = self.columns
        for i in self._asked(request, "plan_columns"):
            for name, values in self.features[i].plan_columns(request, index).items():
                table[:, cols[name]] = values
        return table

    def branches(self, request: GenerationRequest, index: np.ndarray) -> np.ndarray:
        """Denoiser rows per image row at each plan row of the request (1 or 2)."""
        out = np.ones(len(index), dtype=np.int64)
        for i in self._asked(request, "branches"):
            b = self.features[i].branches(request, index)
            if b is not None:
                out = np.maximum(out, b)
        return out

    # -- variants --------------------------------------------------------------------------------
    def variant(self, parts: Sequence[tuple]) -> VariantKey:
        """The step's variant from the live requests' parts (one tuple per request, in feature order)."""
        key = list(self._neutral)
        for i in self._overrides["variant"]:
            own = [p[i] for p in parts]
            if self.features[i].asked_by is None or any(part != self._neutral[i] for part in own):
                key[i] = self.features[i].variant(own)
        return tuple(key)

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        """Every feature's field values for an admitted request (`RowFeature.rows`)."""
        values: dict[str, torch.Tensor | float] = {}
        for i in self._asked(admission.request, "rows"):
            values.update(self.features[i].rows(admission))
        return values

    def parts(self, admission: Admission) -> tuple:
        """The request's parts (the neutral part for a feature that does not override `part`)."""
        out = list(self._neutral)
        for i in self._asked(admission.request, "part"):
            out[i] = self.features[i].part(admission)
        return tuple(out)

    def _asked(self, request: GenerationRequest, hook: str) -> tuple[int, ...]:
        """The features overriding `hook` that `request` may ask for something (`RowFeature.asked_by`)."""
        extras = dict(request.extras) if self._gated else {}

        def asks(feature: RowFeature) -> bool:
            if feature.asked_by is None:
                return True
            name, nothing = feature.asked_by
            return (extras[name] if name in extras else getattr(request, name, None)) not in nothing
        return tuple(i for i in self._overrides[hook] if asks(self.features[i]))

    def neutral(self) -> VariantKey:
        return self._neutral

    def variants(self) -> list[VariantKey]:
        """Every key captured at start-up: the neutral one, then each feature's other parts with the rest neutral,
        each at every part of the shape-only feature (the prompt context)."""
        return list(self._variants)

    def step_key(self, key: VariantKey, coefs: np.ndarray, index: np.ndarray, d: int) -> VariantKey:
        """The step's key with each part refined by its feature's `step_part` from the host's coefficient table and
        denoiser-row layout (the step caches' keys: how many rows go deeper, a graph variant of its own)."""
        if not self._overrides["step_part"]:
            return key
        row_state = any(key[i] != self._neutral[i] for i in self._overrides["before_denoise"])
        out = list(key)
        for i in self._overrides["step_part"]:
            if key[i] == self._neutral[i]:
                continue
            out[i] = self.features[i].step_part(key[i], coefs, self.columns, index, d, gather=not row_state)
        return tuple(out)

    def eager(self, key: VariantKey) -> bool:
        """Whether a step of `key` runs eagerly (a feature's part the step's graphs do not hold)."""
        return any(self.features[i].eager(key[i]) for i in self._overrides["eager"] if key[i] != self._neutral[i])

    def graph_key(self, key: VariantKey) -> VariantKey:
        """The key the step's graphs see: each part as its feature's `graph_part` (one of its `variants()`)."""
        if not self._overrides["graph_part"]:
            return key
        out = list(key)
        for i in self._overrides["graph_part"]:
            out[i] = self.features[i].graph_part(key[i])
        return tuple(out)

    def code_key(self, key: VariantKey) -> VariantKey:
        """The key the step's code depends on: the graph key with the shape-only part neutral (the compiled step,
        which sees the token count as a dynamic dimension, is the same for every count)."""
        key = self.graph_key(key)
        i = self._shaping
        return key if i is None else key[:i] + (self._neutral[i],) + key[i + 1:]

    def tokens(self, key: VariantKey) -> int | None:
        """The prompt tokens a step of `key` reads (None: all of the token-axis fields)."""
        i = self._shaping
        return None if i is None else self.features[i].tokens(key[i])

    def kind(self, key: VariantKey) -> str:
        """The graph kind of a variant: "step" for the neutral key, else "step_<feature><part>"."""
        key = self.graph_key(key)
        parts = [f"{f.name}{part}" for f, part, neutral in zip(self.features, key, self._neutral) if part != neutral]
        return "_".join(["step", *parts])

    # -- the step --------------------------------------------------------------------------------
    def _batch(self, fields: dict[str, torch.Tensor], cond_names: Sequence[str], row_names: Sequence[str],
               dtype: torch.dtype, n: int, d: int) -> tuple:
        """The step's view and its denoiser batch: (view, x_in [n] after the input hooks, x [D] the scaled latents
        before them, t [D], conditioning [D] per branch, the family's row inputs [D])."""
        co = fields["coefs"][:n]
        index = fields["index"]
        transient = self._transient
        view = StepView(fields={k: v[:d] if k in transient else v[:n] for k, v in fields.items()}, coefs=co,
                        columns=self.columns, n=n, den_row=index[:d, 0], den_alt=index[:d, 1], out_main=index[:n, 2],
                        out_alt=index[:n, 3], dtype=dtype)
        x = view.fields["x"]
        x_scaled = (x * co[:, int(Coef.C_IN)].view(n, *(1,) * (x.dim() - 1))).to(dtype)
        x_in = x_scaled
        for f in self.features:
            x_in = f.model_input(view, x_in)
        t_den = view.gather(co[:, int(Coef.T)])
        alt = self.alt
        cond = {}
        for name in cond_names:
            main = view.fields[f"cond.{name}"]
            if alt is None:
                cond[name] = view.gather(main)
            else:  # main branch rows [0, n), second branch rows [n, 2n)
                both = torch.cat([main, alt.alt_cond(view, name)])
                cond[name] = both.index_select(0, view.den_row + n * view.den_alt)
        inputs = {name: view.gather(view.fields[f"rows.{name}"]) for name in row_names}
        return view, x_in, x_scaled, t_den, cond, inputs

    def prepass(self, fields: dict[str, torch.Tensor], cond_names: Sequence[str], row_names: Sequence[str],
                dtype: torch.dtype, n: int, d: int, key: VariantKey,
                live: Sequence[tuple[int, int, tuple]] | None = None) -> None:
        """Before the step (outside its graph): the features' prepasses with the step's full key (ControlNets);
        `live`: (image rows, branches this step, variant parts) per live request, in row order, or None."""
        if not any(key[i] != self._neutral[i] for i in self._overrides["prepass"]):
            return
        with torch.no_grad():
            view, _, x_scaled, t_den, cond, inputs = self._batch(fields, cond_names, row_names, dtype, n, d)
            x_den = view.gather(x_scaled)
            for i in self._overrides["prepass"]:
                self.features[i].prepass(view, key[i], d, x_den, t_den, cond, inputs,
                                         None if live is None else [(k, b, parts[i]) for k, b, parts in live])

    def run(self, denoise: Denoiser, fields: dict[str, torch.Tensor], cond_names: Sequence[str],
            row_names: Sequence[str], dtype: torch.dtype, n: int, d: int, key: VariantKey) -> None:
        """One whole step for image rows [0, n) over denoiser rows [0, d): reads and writes `fields` in place."""
        view, x_in, _, t_den, cond, inputs = self._batch(fields, cond_names, row_names, dtype, n, d)
        co, x = view.coefs, view.fields["x"]
        x_den = view.gather(x_in)
        for i in self._overrides["denoiser_inputs"]:  # a capability's only where a row asks it something
            if self.features[i].asked_by is None or key[i] != self._neutral[i]:
                inputs.update(self.features[i].denoiser_inputs(view, key[i]))
        for f, part in zip(self.features, key):
            f.before_denoise(view, part)
        try:
            out = denoise(x_den, t_den, cond, inputs).float()
        finally:
            for f, part in zip(self.features, key):
                f.after_denoise(view, part)
        main_out = out.index_select(0, view.out_main)
        alt_out = out.index_select(0, view.out_alt)
        guided = main_out
        for f in self.features:
            guided = f.combine(view, guided, alt_out)
        x_next, denoised = apply_step(co, x, guided, view.fields["d_prev"], view.fields["noise"], alt_out)
        for f in self.features:
            x_next = f.after_update(view, x_next, denoised)
        x.copy_(x_next)
        view.fields["d_prev"].copy_(denoised)



def layout(rows: Sequence[tuple[int, int, int]], size: int) -> np.ndarray:
    """The step's index table [size, 4] (int64) for live requests (first row, rows, branches now), packed from row
    0: columns den_row, den_alt, out_main, out_alt. Main branches take denoiser rows [0, n), second branches the
    rows after them; padding rows point at row 0 (their outputs are never read by a live row)."""
    table = np.zeros((size, 4), dtype=np.int64)
    n = sum(k for _, k, _ in rows)
    table[:n, 0] = np.arange(n)
    table[:n, 2] = np.arange(n)
    table[:n, 3] = np.arange(n)
    d = n
    for first, k, branches in rows:
        if branches > 1:
            table[d:d + k, 0] = np.arange(first, first + k)
            table[d:d + k, 1] = 1
            table[first:first + k, 3] = np.arange(d, d + k)
            d += k
    return table
