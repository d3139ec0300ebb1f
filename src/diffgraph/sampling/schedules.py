"""Training noise schedules and the sigma / timestep sequences samplers walk along.

Owns `NoiseSchedule` (what a model was trained with, read from any diffusers scheduler config) and the
pure functions that turn it into inference timesteps and sigmas. `samplers.make_plan` consumes these.

Every function mirrors the arithmetic of the diffusers scheduler it stands in for, dtype casts included
(diffusers computes the training table in float32 and rounds sigmas to float32), so that a plan built here
drives the latents through the same values diffusers does, not merely values close to them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .names import SAMPLERS, SCHEDULES, TIMESTEP_SPACINGS  # noqa: F401 (re-exported: they live in a module without numpy or torch)

if TYPE_CHECKING:
    import torch

MAX_STEPS = 200  # the most denoising steps a request may ask for (the one bound; request.py and make_plan use it)

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
PREDICTION_TYPES = ("epsilon", "v_prediction")

# Scheduler classes whose `timestep_spacing` defaults to "leading"; the k-diffusion family
# (Euler, DPM-Solver, LMS, Heun, ...) defaults to "linspace".
_LEADING_BY_DEFAULT = ("DDPMScheduler", "DDIMScheduler", "PNDMScheduler", "LCMScheduler", "TCDScheduler")

# Config keys that would change the model's training process; we refuse the settings we do not implement.
# Keys that only choose a sampler (use_karras_sigmas, solver_order, interpolation_type, ...) are ignored:
# the (sampler, schedule) pair of the request decides those.
_UNSUPPORTED = (
    # key, value we support, why
    ("trained_betas", None, "explicit trained_betas are not supported; use beta_start/beta_end/beta_schedule"),
    ("clip_sample", False, "clip_sample=True is not supported; set clip_sample=False"),
    ("thresholding", False, "thresholding=True is not supported; set thresholding=False"),
    ("timestep_type", "discrete", "timestep_type must be 'discrete'"),
)


@dataclass(frozen=True)
class NoiseSchedule:
    """The discrete training schedule of a model plus how diffusers spaces inference timesteps on it."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    prediction_type: str = "epsilon"
    timestep_spacing: str = "linspace"
    steps_offset: int = 0
    set_alpha_to_one: bool = True  # DDIM only: the final step goes to alpha=1 (True) or to alphas_cumprod[0]
    # betas rescaled to zero terminal SNR (Lin et al. 2023), as diffusers' rescale_zero_terminal_snr; the
    # k-diffusion samplers then read the last alpha-bar as 2**-24 (diffusers': a finite first sigma)
    rescale_betas_zero_snr: bool = False

    def __post_init__(self) -> None:
        _check_choice("beta_schedule", self.beta_schedule, BETA_SCHEDULES)
        _check_choice("prediction_type", self.prediction_type, PREDICTION_TYPES)
        _check_choice("timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        if self.rescale_betas_zero_snr and self.prediction_type != "v_prediction":
            raise ValueError("a zero terminal SNR schedule (rescale_betas_zero_snr) needs prediction_type "
                             "'v_prediction' (an epsilon model cannot denoise pure noise); set both or neither")
        if self.num_train_timesteps < 2:
            raise ValueError(f"num_train_timesteps must be >= 2, got {self.num_train_timesteps}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> NoiseSchedule:
        """Read a diffusers scheduler config (any class; extra keys ignored).

        Missing keys take diffusers' defaults; `timestep_spacing` defaults per family of `_class_name`.
        """
        for key, supported, why in _UNSUPPORTED:
            value = config.get(key, supported)
            if (value is None) != (supported is None) or (value is not None and value != supported):
                raise ValueError(f"scheduler config {key}={value!r}: {why}")
        if config.get("variance_type") in ("learned", "learned_range"):
            raise ValueError(f"scheduler config variance_type={config['variance_type']!r}: learned variance is not supported")
        class_name = config.get("_class_name", "")
        spacing_default = "leading" if class_name in _LEADING_BY_DEFAULT else "linspace"
        return cls(
            num_train_timesteps=int(config.get("num_train_timesteps", 1000)),
            beta_start=float(config.get("beta_start", 0.0001)),
            beta_end=float(config.get("beta_end", 0.02)),
            beta_schedule=str(config.get("beta_schedule", "linear")),
            prediction_type=str(config.get("prediction_type", "epsilon")),
            timestep_spacing=str(config.get("timestep_spacing", spacing_default)),
            steps_offset=int(config.get("steps_offset", 0)),
            set_alpha_to_one=bool(config.get("set_alpha_to_one", True)),
            rescale_betas_zero_snr=bool(config.get("rescale_betas_zero_snr", False)),
        )

    def diffusers_kwargs(self) -> dict[str, Any]:
        """The fields as diffusers scheduler constructor arguments (used by the oracle)."""
        return {
            "num_train_timesteps": self.num_train_timesteps,
            "beta_start": self.beta_start,
            "beta_end": self.beta_end,
            "beta_schedule": self.beta_schedule,
            "trained_betas": None,
            "prediction_type": self.prediction_type,
            "timestep_spacing": self.timestep_spacing,
            "steps_offset": self.steps_offset,
            "rescale_betas_zero_snr": self.rescale_betas_zero_snr,
        }

    def alphas_cumprod(self) -> np.ndarray:
        """alpha-bar per training timestep, float64 holding diffusers' float32 values."""
        return self._alphas_cumprod_f32().numpy().astype(np.float64)

    def train_sigmas(self) -> np.ndarray:
        """VE sigma per training timestep, sqrt((1 - abar) / abar), float64 holding diffusers' float32 values."""
        ac = self._alphas_cumprod_f32()
        if self.rescale_betas_zero_snr:  # diffusers' Euler / DPM-Solver: close to 0 but a finite sigma
            ac[-1] = 2**-24
        return (((1 - ac) / ac) ** 0.5).numpy().astype(np.float64)

    def _alphas_cumprod_f32(self) -> torch.Tensor:
        return _alphas_cumprod(self.num_train_timesteps, self.beta_start, self.beta_end, self.beta_schedule,
                               self.rescale_betas_zero_snr)


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} {value!r} is not supported; use one of {', '.join(map(repr, allowed))}")


def _alphas_cumprod(n: int, beta_start: float, beta_end: float, beta_schedule: str,
                    zero_snr: bool = False) -> torch.Tensor:
    # Computed with torch in float32 exactly as diffusers does (torch's float32 linspace, cumprod and pow
    # differ from numpy's in the last bit, and the cumulative product drifts ~1e-6 from a float64 one).
    # torch is imported here, not at the top: the names above (SAMPLERS, MAX_STEPS) are read without it.
    import torch

    if beta_schedule == "linear":
        betas = torch.linspace(beta_start, beta_end, n, dtype=torch.float32)
    elif beta_schedule == "scaled_linear":
        betas = torch.linspace(beta_start**0.5, beta_end**0.5, n, dtype=torch.float32) ** 2
    else:  # squaredcos_cap_v2: Nichol & Dhariwal 2021 cosine schedule, betas capped at 0.999
        def alpha_bar(t: float) -> float:
            return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

        betas = torch.tensor(
            [min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), 0.999) for i in range(n)], dtype=torch.float32
        )
    if zero_snr:  # diffusers' rescale_zero_terminal_snr, in its float32 order of operations
        root = torch.cumprod(1.0 - betas, dim=0).sqrt()
        first, last = root[0].clone(), root[-1].clone()
        root = (root - last) * (first / (first - last))
        bars = root**2
        betas = 1 - torch.cat([bars[0:1], bars[1:] / bars[:-1]])
    return torch.cumprod(1.0 - betas, dim=0)


def spaced_timesteps(noise: NoiseSchedule, num_steps: int, *, points: int, round_linspace: bool) -> np.ndarray:
    """Inference timesteps, descending, per `noise.timestep_spacing` (Table 2 of Lin et al. 2023).

    `points` is how many points the grid has before the first `num_steps` are kept: diffusers' DPM-Solver
    lays `num_steps + 1` points for "leading"/"linspace" and drops the last; Euler and DDIM lay `num_steps`.
    Euler keeps "linspace" values fractional, the others round them.
    """
    n_train = noise.num_train_timesteps
    if noise.timestep_spacing == "linspace":
        t = np.linspace(0, n_train - 1, points)
        t = t.round() if round_linspace else t.astype(np.float32)
        t = t[::-1][:num_steps]
    elif noise.timestep_spacing == "leading":
        step_ratio = n_train // points
        t = (np.arange(0, points) * step_ratio).round()[::-1][:num_steps] + noise.steps_offset
    else:  # trailing
        t = _trailing(n_train, num_steps)
        if len(t) != num_steps:
            # diffusers' float arange yields one extra timestep (-1) here; refuse rather than diverge.
            near = list(itertools.islice((k for d in range(1, n_train) for k in (num_steps - d, num_steps + d)
                                          if 1 <= k <= n_train and len(_trailing(n_train, k)) == k), 2))
            raise ValueError(
                f"num_steps {num_steps} with timestep_spacing 'trailing' gives diffusers {len(t)} timesteps "
                f"(float rounding in its arange); use {' or '.join(map(str, sorted(near)))}"
            )
    return np.ascontiguousarray(t, dtype=np.float64)


def _trailing(n_train: int, num_steps: int) -> np.ndarray:
    """diffusers' trailing timesteps, float arange and all."""
    return np.arange(n_train, 0, -n_train / num_steps).round() - 1


def karras_sigmas(sigma_min: float, sigma_max: float, num_steps: int, rho: float = 7.0) -> np.ndarray:
    """Karras et al. 2022 (EDM) sigmas, descending from sigma_max to sigma_min, without the final zero."""
    ramp = np.linspace(0, 1, num_steps)
    min_inv_rho = sigma_min ** (1 / rho)
    max_inv_rho = sigma_max ** (1 / rho)
    return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho


def converted_sigmas(schedule: str, sigma_min: float, sigma_max: float, num_steps: int,
                     train: np.ndarray | None = None) -> np.ndarray:
    """The sigmas of a sigma schedule (`karras`, `exponential`, `beta`) from sigma_max down to sigma_min, without the
    final zero: diffusers' `_convert_to_karras` / `_convert_to_exponential` / `_convert_to_beta` (alpha = beta = 0.6,
    "Beta Sampling is All You Need", Lee et al. 2024; scipy's beta quantiles, as diffusers). A table schedule
    (sigma_tables.py) takes the training sigmas `train` instead of the range, as AUTOMATIC1111's schedulers do."""
    from .sigma_tables import TABLE_SCHEDULES, table_sigmas
    if schedule in TABLE_SCHEDULES:
        if train is None:
            raise ValueError(f"schedule {schedule!r} needs the model's training sigmas")
        return table_sigmas(schedule, train, num_steps)
    if schedule == "karras":
        return karras_sigmas(sigma_min, sigma_max, num_steps)
    if schedule == "exponential":
        return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), num_steps))
    if schedule == "beta":
        try:
            from scipy.stats import beta as beta_dist
        except ImportError:
            raise ValueError("schedule 'beta' needs scipy (pip install scipy); use 'karras' or 'exponential'") from None
        ppf = [beta_dist.ppf(t, 0.6, 0.6) for t in 1 - np.linspace(0, 1, num_steps)]
        return np.array([sigma_min + q * (sigma_max - sigma_min) for q in ppf])
    raise ValueError(f"schedule {schedule!r} is not a sigma schedule; use 'karras', 'exponential' or 'beta'")


def sigma_to_t(sigmas: np.ndarray, train_sigmas: np.ndarray) -> np.ndarray:
    """Fractional training timestep of each sigma, interpolating log-sigma linearly (as diffusers)."""
    # diffusers takes the log of the float32 training sigmas and mixes float32 and float64 below.
    log_sigmas = np.log(train_sigmas.astype(np.float32))
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma - log_sigmas[:, np.newaxis]
    low_idx = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    high_idx = low_idx + 1
    low, high = log_sigmas[low_idx], log_sigmas[high_idx]
    w = np.clip((low - log_sigma) / (low - high), 0, 1)
    return ((1 - w) * low_idx + w * high_idx).astype(np.float64)


def interp_sigmas(timesteps: np.ndarray, train_sigmas: np.ndarray) -> np.ndarray:
    """Sigma at (possibly fractional) timesteps, linear in t."""
    return np.interp(timesteps, np.arange(len(train_sigmas)), train_sigmas.astype(np.float32))


def to_f32(values: np.ndarray) -> np.ndarray:
    """Round to float32 and back: diffusers stores sigmas and timesteps as float32 tensors."""
    return np.asarray(values, dtype=np.float32).astype(np.float64)


def euler_sigmas(noise: NoiseSchedule, n: int, schedule: str) -> tuple[np.ndarray, np.ndarray]:
    """(timesteps, sigmas + final 0) as diffusers' k-diffusion schedulers lay them (EulerDiscreteScheduler; Heun,
    KDPM2, LMS alike): the spaced timesteps' sigmas, or for a sigma schedule (karras, exponential, beta) that
    schedule over the spaced sigmas' own range with fractional timesteps; float32 values."""
    train = noise.train_sigmas()
    t = to_f32(spaced_timesteps(noise, n, points=n, round_linspace=False))
    s = interp_sigmas(t, train)
    if schedule != "default":
        s = converted_sigmas(schedule, float(s[-1]), float(s[0]), n, train)
        t = to_f32(sigma_to_t(s, train))
    return t, to_f32(np.append(s, 0.0))


def euler_init_sigma(noise: NoiseSchedule, sigmas: np.ndarray) -> float:
    """init_noise_sigma of the k-diffusion schedulers: the largest sigma (linspace, trailing) or sqrt(max^2 + 1)
    (leading), on a float32 tensor as diffusers computes it."""
    smax = np.float32(sigmas.max())
    return float(smax if noise.timestep_spacing in ("linspace", "trailing") else np.sqrt(smax * smax + np.float32(1)))


def dpm_sigmas(noise: NoiseSchedule, n: int, schedule: str, sampler: str) -> tuple[np.ndarray, np.ndarray]:
    """(timesteps, sigmas + final 0) as DPMSolverMultistepScheduler (and UniPC, DPM-SDE) lays them: `points` n + 1
    spaced timesteps (rounded), or a sigma schedule over the whole training range, its timesteps integers (diffusers'
    int64 timesteps)."""
    train = noise.train_sigmas()
    if schedule == "default":
        t = spaced_timesteps(noise, n, points=n + 1, round_linspace=True)
        s = interp_sigmas(t, train)
    else:
        s = converted_sigmas(schedule, float(train[0]), float(train[-1]), n, train)
        t = sigma_to_t(s, train)
        # Karras' are rounded (except for the cosine schedule); every one is then truncated on the cast to int64
        t = np.floor(t.round() if schedule == "karras" and noise.beta_schedule != "squaredcos_cap_v2" else t)
        if n > 1 and t[0] == t[1] and sampler != "ddim":  # (DDIM steps through a repeat: it counts steps)
            # diffusers finds its first step by timestep and would start at step 1 of a repeated one.
            raise ValueError(f"{sampler} with {schedule} sigmas on this schedule repeats its first timestep at "
                             f"num_steps {n}; use fewer steps or schedule 'default'")
    return np.asarray(t, np.float64), to_f32(np.append(s, 0.0))
