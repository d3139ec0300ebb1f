"""The whole denoising step over static per-row buffers: the row features' program around the family's denoiser.

`StepBuffers` holds every tensor one step reads or writes for the rows of one resolution group, allocated once at
the most rows a group may hold (the model runner owns them): the base fields (x, d_prev, noise, the coefficient
table `coefs`, the step's denoiser-row `index` table), the family's conditioning (`cond.*`) and per-resolution row
fields (`rows.*`), and whatever the family's row features declare (features/: `uncond.*` for guidance, `edit.*`,
`lora.*`, ...), each with its neutral value; a lazy field (`FieldSpec.lazy`: the step caches' kept values) only
at the first write of a row that uses it, so a group none of whose rows use it holds none of it. `whole_step(program, denoise, buffers, n, d, key)` runs image rows
[0, n) over denoiser rows [0, d) (a guiding row costs two) with the variant `key`, and writes x and d_prev in place;
`denoise(x, t, cond, inputs)` is the family's capturable denoiser call. The same function runs eagerly and under
CUDA-graph capture, so the two paths cannot drift apart, and its update is `sampling.samplers.apply_step`, the tested
reference itself. Rows carry their own coefficients, so rows at different steps, with different samplers, guidance
and features, share one call. Padding rows (coefficients all zero) produce x = 0 and stay finite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..features.base import FieldSpec
from ..features.program import Denoiser, StepProgram, VariantKey

__all__ = ["Denoiser", "StepBuffers", "step_rows", "whole_step", "write_tokens"]


@dataclass
class StepBuffers:
    """Per-row inputs and state of one resolution group: `fields` name -> [B, ...]; first dimension = rows. `x`,
    `d_prev`, `noise`, `coefs` and `index` are the base fields themselves (plain attributes: the step and the row
    writes read them without a call)."""

    fields: dict[str, torch.Tensor]
    specs: dict[str, FieldSpec]      # the features' fields (neutral values for rows that do not use them)
    cond_names: tuple[str, ...]      # the family's conditioning fields ("cond.<name>")
    row_names: tuple[str, ...]       # the family's per-resolution row fields ("rows.<name>", SDXL's time ids)
    dtype: torch.dtype               # the denoiser's input dtype
    sequence: tuple[str, ...] = ()   # fields whose second axis is the prompt's tokens (a step reads a prefix)

    def __post_init__(self) -> None:
        f = self.fields
        self.x, self.d_prev, self.noise, self.coefs, self.index = (f["x"], f["d_prev"], f["noise"], f["coefs"],
                                                                   f["index"])
        # the row state (what compaction moves and a preemption saves): every field but the per-step ones
        self.state = {k: v for k, v in f.items() if not (k in self.specs and self.specs[k].transient)}
        # what an admission writes (`write`): the conditioning, the per-resolution values and the features' fields
        self.writable = {*self.specs, *(f"cond.{k}" for k in self.cond_names), *(f"rows.{k}" for k in self.row_names)}
        # per row, the features' fields its request wrote: the others hold their neutral values (nothing in a step
        # writes them), so a preemption saves only these (a row without ControlNets beside rows with them saves
        # none of their embeddings: 10.5 MB a row and control at SDXL 1024x1024)
        # (buffers made of any tensors: every field may hold anything; `allocate` fills them neutral and clears it)
        self._written: list[frozenset[str]] = [frozenset(
            k for k, spec in self.specs.items() if not spec.transient and not spec.history_slot)] * self.x.shape[0]

    @classmethod
    def allocate(cls, rows: int, latent_shape: tuple[int, ...], program: StepProgram,
                 cond_spec: dict[str, tuple[tuple[int, ...], torch.dtype]], row_values: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device, sequence_fields: tuple[str, ...] = ()) -> "StepBuffers":
        def z(*shape, dt=torch.float32):
            return torch.zeros(shape, dtype=dt, device=device)
        fields = {"x": z(rows, *latent_shape), "d_prev": z(rows, *latent_shape), "noise": z(rows, *latent_shape),
                  "coefs": z(rows, program.num_columns), "index": z(rows, 4, dt=torch.int64)}
        fields.update({f"cond.{k}": z(rows, *shape, dt=dt) for k, (shape, dt) in cond_spec.items()})
        fields.update({f"rows.{k}": z(rows, *v.shape, dt=v.dtype) for k, v in row_values.items()})
        specs = program.fields(latent_shape)
        for name, spec in specs.items():
            fields[name] = z(0 if spec.lazy else rows, *spec.shape, dt=spec.dtype)  # lazy: at its first write
            spec.fill(fields[name])
        sequence = tuple(f"cond.{k}" for k in cond_spec if k in sequence_fields) + tuple(
            name for name, spec in specs.items() if spec.tokens)
        buf = cls(fields, specs, tuple(cond_spec), tuple(row_values), dtype, sequence)
        buf._written = [frozenset()] * rows  # every field neutral
        return buf

    def _materialise(self, names: Iterable[str]) -> None:
        """Allocates the lazy fields among `names` not allocated yet at every row, neutral (`FieldSpec.lazy`): on the
        group's buffers (a `head` view's would be its own)."""
        for name in names:
            spec = self.specs.get(name)
            if spec is not None and spec.lazy and self.fields[name].shape[0] != self.num_rows:
                t = self.fields[name].new_zeros((self.num_rows, *spec.shape))
                spec.fill(t)
                self.fields[name] = t
                if name in self.state:
                    self.state[name] = t

    def cond(self, name: str) -> torch.Tensor:
        return self.fields[f"cond.{name}"]

    @property
    def num_rows(self) -> int:
        return self.x.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every per-row tensor by its name (snapshots, compaction)."""
        return self.fields

    def head(self, n: int, tokens: int | None = None, without: Iterable[str] = ()) -> "StepBuffers":
        """The same buffers, rows [0, n) only, and with `tokens` the first `tokens` prompt tokens of the token-axis
        fields (views: writes reach the full buffers), the fields `without` left out (the lazy ones a step does not
        read: `StepProgram.unread`)."""
        out = frozenset(without)
        view = dataclasses.replace(self, fields={
            k: v[:n, :tokens] if tokens is not None and k in self.sequence else v[:n] for k, v in self.fields.items()
            if k not in out})
        view._written = self._written  # the same rows: one record
        return view

    def move_rows(self, src: int, dst: int, count: int) -> None:
        """Copies rows [src, src+count) to [dst, dst+count) in every buffer (compaction)."""
        if src == dst or count == 0:
            return
        with self._rewriting(dst, self._written[src:src + count]):
            for t in self.state.values():
                t[dst:dst + count] = t[src:src + count].clone()

    def save_rows(self, start: int, count: int, history: int) -> dict[str, torch.Tensor]:
        """A copy of rows [start, start+count) of every buffer a request's rows carry: a preempted row's whole state
        (latents, conditioning, the features' fields its request wrote, and the `history` sampler slots its sampler
        declares), for `restore_rows`."""
        written = frozenset().union(*self._written[start:start + count])
        return {k: t[start:start + count].clone() for k, t in self.state.items()
                if self._carried(k, history, written)}

    def restore_rows(self, start: int, saved: dict[str, torch.Tensor]) -> None:
        """Writes rows saved by `save_rows` back at rows [start, ...) (wherever the row resumes); the state fields it
        did not carry (features the request does not use, history slots its sampler does not use) take their
        neutral value there, the value they held."""
        count = next(iter(saved.values())).shape[0]
        self._materialise(saved)
        written = frozenset(k for k in saved if k in self.specs and not self.specs[k].history_slot)
        with self._rewriting(start, [written] * count):
            for k, t in self.state.items():
                if k in saved:
                    t[start:start + count] = saved[k]
                else:
                    self.specs[k].fill(t[start:start + count])

    def _carried(self, name: str, history: int, written: frozenset[str]) -> bool:
        spec = self.specs.get(name)
        if spec is None:  # the base fields, the conditioning, the per-resolution values
            return True
        if spec.lazy and self.fields[name].shape[0] != self.num_rows:  # never written in this group
            return False
        return spec.history_slot <= history if spec.history_slot else name in written

    def write(self, rows: slice, values: dict[str, torch.Tensor | float]) -> None:
        """Writes an admitted request's rows: its conditioning ("cond.<name>", token-axis fields repeated to the span:
        `write_tokens`), the per-resolution row values ("rows.<name>") and its feature fields, each one row
        broadcast or every row; the features' fields it leaves out take their neutral value (written only where the
        rows' record says a request before wrote them: a field no request wrote holds it since allocation)."""
        unknown = set(values) - self.writable
        if unknown:
            raise ValueError(f"row values for undeclared fields {sorted(unknown)}; declare them in a feature's fields()")
        self._materialise(values)
        first, stop, _ = rows.indices(self.num_rows)
        count = max(stop - first, 0)
        before = frozenset().union(*self._written[first:stop])  # what the rows' last requests wrote
        written = frozenset(n for n in values if n in self.specs and not self.specs[n].transient)
        with self._rewriting(first, [written] * count):
            for name, value in values.items():
                if name in self.specs and self.specs[name].transient:
                    continue
                if name in self.sequence:
                    write_tokens(self.fields[name][rows], value)
                else:
                    self.fields[name][rows] = value
            for name, spec in self.specs.items():  # the rest hold their neutral values already (history slots: any)
                if not spec.transient and name not in values and (spec.history_slot or name in before):
                    spec.fill(self.fields[name][rows])

    def update(self, rows: slice, values: dict[str, torch.Tensor]) -> None:
        """Rewrites the given fields of live rows (their conditioning for the next text of a prompt schedule), every
        other field kept."""
        unknown = set(values) - self.writable
        if unknown:
            raise ValueError(f"row values for undeclared fields {sorted(unknown)}; declare them in a feature's fields()")
        self._materialise(values)
        first, stop, _ = rows.indices(self.num_rows)
        added = frozenset(n for n in values if n in self.specs)
        with self._rewriting(first, [w | added for w in self._written[first:stop]]):
            for name, value in values.items():
                if name in self.sequence:
                    write_tokens(self.fields[name][rows], value)
                else:
                    self.fields[name][rows] = value

    @contextmanager
    def _rewriting(self, start: int, after: list[frozenset[str]]) -> Iterator[None]:
        """Rows [start, start + len(after)) are rewritten to hold the fields `after` records: while the copies run the
        record counts the union of old and new, so a copy that fails half-way never leaves a written value unrecorded
        (that row's next request would skip its neutral fill); once all are in, the record is `after`."""
        stop = start + len(after)
        self._written[start:stop] = [a | b for a, b in zip(self._written[start:stop], after)]
        yield
        self._written[start:stop] = after


def write_tokens(dst: torch.Tensor, value: torch.Tensor) -> None:
    """dst[...] = value for a token-axis field: a value of fewer tokens (a prompt of fewer windows than the buffers
    span) is written repeated along that axis up to the span, lcm(1..max windows) windows (features/context.py); the
    spare token after the span stays zero (never read)."""
    length, size = value.shape[1], dst.shape[1]
    if length == size:
        dst[...] = value
        return
    reps = size // length
    if size - reps * length > 1:
        raise ValueError(f"a prompt of {length} tokens does not divide the buffers' span of {size - 1}")
    dst[:, :reps * length] = value.repeat(1, reps, *([1] * (value.dim() - 2)))
    dst[:, reps * length:] = 0


def whole_step(program: StepProgram, denoise: Denoiser, buf: StepBuffers, n: int, d: int, key: VariantKey) -> None:
    """One denoising step for image rows [0, n) over denoiser rows [0, d) with the step variant `key` (see
    features/program.py): D <- p*x + q*out, x <- a*x + b*D + c*D_prev + d*noise, then the features' after-update
    hooks (the inpainting blend). The key's prompt tokens (the context feature) select the sequence fields' prefix."""
    tokens = program.tokens(key)
    fields = buf.fields if tokens is None else buf.head(buf.num_rows, tokens).fields
    program.run(denoise, fields, buf.cond_names, buf.row_names, buf.dtype, n, d, program.code_key(key))


def step_rows(denoise: Denoiser, buf: StepBuffers, program: StepProgram, key: VariantKey) -> None:
    """`whole_step` over every row of `buf` (a `StepBuffers.head` view: as many image rows as denoiser rows, the
    bucket, and the prompt tokens the step reads: `head(bucket, tokens)`) with the key's code part
    (`StepProgram.code_key`): what the step graphs capture. The row count is the buffers' first dimension, not a
    Python int, so the compile tier compiles one step for every bucket above 1 of a resolution (that dimension marked
    dynamic), and the token count likewise one for every prompt length."""
    rows = buf.x.shape[0]
    program.run(denoise, buf.fields, buf.cond_names, buf.row_names, buf.dtype, rows, rows, key)
