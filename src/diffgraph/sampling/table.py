"""The coefficient-table form every sampler plan takes, and its update: what a plan row means to the step.

A plan row is one denoiser evaluation (a two-evaluation sampler such as Heun is two rows per step). With `out` the
guided model output of the row, `x` its state, `P` its D of the previous row (`d_prev`, zero at the first) and
`H1..H3` its history slots (zero at the first row), the step computes

    model_input = C_IN * x                                   # fed to the denoiser with timestep T
    D           = P_ * x + Q * out                           # the denoised prediction x0 (columns P, Q)
    x_next      = A * x + B * D + C * P + D_ * noise + U * unguided + E1 * H1 + E2 * H2 + E3 * H3
    H_k'        = Hk_X * x + Hk_D * D + Hk_P * P + Hk_H1 * H1 + Hk_H2 * H2 + Hk_H3 * H3     (k = 1, 2, 3)
    P'          = D

all from the values before the row, with `unguided` the row's unguided model output (classifier-free guidance's
unconditional branch; the main output where the row runs one branch): column U is CFG++'s (its update steps along
the unconditional branch's noise, Chung et al. 2024), zero for every other sampler. The history slots are how a
sampler keeps what one slot of D cannot hold: a third-order multistep solver's older D, LMS's derivatives, UniPC's
corrected sample, a two-evaluation sampler's state before its first half. A sampler declares how many it uses
(`PlanParts.history`); the columns of slots it does not use are zero, so its rows share every replay with every
other sampler's. `noise` is standard normal, drawn at the rows `noise_steps` marks (from the row's own generator, in
the order its diffusers scheduler draws). `apply_step` and `apply_history` are the update itself, for numpy arrays
or torch tensors: the step (features/) runs them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from .schedules import NoiseSchedule

HISTORY_SLOTS = 3
HISTORY_SOURCES = ("X", "D", "P", "H1", "H2", "H3")


class Coef(IntEnum):
    """Columns of a plan's coefficient table."""

    C_IN = 0
    T = 1
    P = 2
    Q = 3
    A = 4
    B = 5
    C = 6
    D = 7
    KNOWN = 8        # inpainting: the known region at the next state = KNOWN * image latents + KNOWN_NOISE * noise
    KNOWN_NOISE = 9
    E1 = 10          # x_next += E1 * H1 + E2 * H2 + E3 * H3
    E2 = 11
    E3 = 12
    H1_X = 13        # H1' = H1_X * x + H1_D * D + H1_P * P + H1_H1 * H1 + H1_H2 * H2 + H1_H3 * H3
    H1_D = 14
    H1_P = 15
    H1_H1 = 16
    H1_H2 = 17
    H1_H3 = 18
    H2_X = 19
    H2_D = 20
    H2_P = 21
    H2_H1 = 22
    H2_H2 = 23
    H2_H3 = 24
    H3_X = 25
    H3_D = 26
    H3_P = 27
    H3_H1 = 28
    H3_H2 = 29
    H3_H3 = 30
    U = 31           # x_next += U * the unguided output (CFG++)


NUM_COEFS = len(Coef)
E_COLUMNS = (int(Coef.E1), int(Coef.E2), int(Coef.E3))


def hist_col(slot: int, source: str) -> int:
    """The column of source `source` (one of HISTORY_SOURCES) in the update of slot `slot` (1..3)."""
    if not 1 <= slot <= HISTORY_SLOTS or source not in HISTORY_SOURCES:
        raise ValueError(f"history slot {slot} / source {source!r}: slots are 1..{HISTORY_SLOTS}, sources "
                         f"{', '.join(HISTORY_SOURCES)}")
    return int(Coef[f"H{slot}_{source}"])


@dataclass(frozen=True)
class PlanParts:
    """What a sampler's plan function returns; `samplers.make_plan` adds the inpainting columns and checks it.

    Rows are denoiser evaluations: `timesteps[i]` the row's timestep (== coefs[i, T]), `sigmas[i]` the VE sigma of
    its state (rows + 1 entries, the last where x ends: diffusers' `scheduler.sigmas` for the k-diffusion
    schedulers), `step_index[i]` the step of the request's `num_inference_steps` the row belongs to (a two-evaluation
    sampler's two rows share one), `noise_steps[i]` whether the row draws a noise tensor. `ve`: the state is x0 +
    sigma * eps (Euler-like), else alpha * x0 + sigma_vp * eps (DPM-Solver, DDIM, LCM)."""

    timesteps: np.ndarray
    sigmas: np.ndarray
    coefs: np.ndarray
    init_noise_sigma: float
    ve: bool
    noise_steps: np.ndarray | None = None  # None: no row draws noise
    step_index: np.ndarray | None = None   # None: one row per step
    history: int = 0                       # history slots the sampler uses (0..HISTORY_SLOTS)
    # Brownian-tree noise (dpmpp_sde, sde.py): per row the (sigma_from, sigma_to) its increment spans, and the tree's
    # range; None: the noise rows draw standard normals from the request's generator
    brownian: np.ndarray | None = None
    brownian_range: tuple[float, float] | None = None


# (noise schedule, steps, schedule name, first step) -> the rows from that step on, as the diffusers scheduler runs
# them when a pipeline enters its timesteps there (an image-to-image strength: multistep solvers restart at first
# order there)
PlanFunction = Callable[["NoiseSchedule", int, str, int], PlanParts]


def cut(parts: PlanParts, start: int) -> PlanParts:
    """The rows of a one-row-per-step plan from step `start` on (samplers without history, whose rows do not depend
    on where the walk began)."""
    if start == 0:
        return parts
    return dataclasses.replace(parts, timesteps=parts.timesteps[start:], sigmas=parts.sigmas[start:],
                               coefs=parts.coefs[start:].copy(),
                               noise_steps=None if parts.noise_steps is None else parts.noise_steps[start:])


def table(t, c_in, p, q, a, b, c=0.0, d=0.0) -> np.ndarray:
    """A coefficient table [len(t), NUM_COEFS] with the base columns set (history columns zero)."""
    coefs = np.zeros((len(t), NUM_COEFS), dtype=np.float64)
    for k, v in ((Coef.C_IN, c_in), (Coef.T, t), (Coef.P, p), (Coef.Q, q), (Coef.A, a), (Coef.B, b),
                 (Coef.C, c), (Coef.D, d)):
        coefs[:, int(k)] = v
    return coefs


def denoiser(prediction_type: str, alpha: np.ndarray, sigma_vp: np.ndarray, ve: bool) -> tuple:
    """(p, q) with D = p * x + q * out, for x = alpha * x0 + sigma_vp * eps (VP), or that over alpha (VE)."""
    if prediction_type == "epsilon":
        p, q = 1 / alpha, -sigma_vp / alpha
    else:  # v_prediction: v = alpha * eps - sigma_vp * x0  (Salimans & Ho 2022)
        p, q = alpha, -sigma_vp
    return (p * alpha if ve else p), q


def apply_step(coefs: Any, x: Any, out: Any, d_prev: Any, noise: Any = None, unguided: Any = None) -> tuple[Any, Any]:
    """The base update for a batch: coefs [B, NUM_COEFS] (one row per batch row), x/out/d_prev [B, ...], `unguided`
    [B, ...] the unguided model output (None: `out`, a step without a second branch); returns (x_next without the
    history terms, D). Works on numpy arrays and torch tensors alike."""
    shape = (-1,) + (1,) * (x.ndim - 1)

    def col(k: Coef) -> Any:
        return coefs[:, int(k)].reshape(shape)

    denoised = col(Coef.P) * x + col(Coef.Q) * out
    x_next = col(Coef.A) * x + col(Coef.B) * denoised + col(Coef.C) * d_prev
    if noise is not None:
        x_next = x_next + col(Coef.D) * noise
    # (added last: a zero column leaves every other sampler's x_next bit for bit as it was)
    x_next = x_next + col(Coef.U) * (out if unguided is None else unguided)
    return x_next, denoised


def apply_history(coefs: Any, x: Any, denoised: Any, d_prev: Any, history: list) -> tuple[Any, list]:
    """The history terms of a batch's update: (E1 * H1 + E2 * H2 + E3 * H3, [H1', H2', H3']) from the values before
    the row (`history`: the HISTORY_SLOTS slot tensors). The sum is added to `apply_step`'s x_next."""
    shape = (-1,) + (1,) * (x.ndim - 1)

    def col(k: int) -> Any:
        return coefs[:, k].reshape(shape)

    sources = (x, denoised, d_prev, *history)
    extra = sum(col(e) * h for e, h in zip(E_COLUMNS, history))
    updated = [sum(col(hist_col(k, s)) * v for s, v in zip(HISTORY_SOURCES, sources)) for k in range(1, 1 + len(history))]
    return extra, updated
