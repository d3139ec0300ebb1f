"""Flow matching: the sampling entry point of rectified-flow models, beside the SD noise schedule (schedules.py).

A flow-matching model (SD3, Flux, Z-Image, Qwen-Image) is trained on x_sigma = (1 - sigma) x0 + sigma * noise and
predicts the velocity v = noise - x0, so D = x - sigma * v. `FlowSchedule` is diffusers'
FlowMatchEulerDiscreteScheduler's reading of a scheduler config: sigmas from 1 towards 1 / steps, shifted either by
a fixed `shift` (sigma' = shift * sigma / (1 + (shift - 1) * sigma)) or, with dynamic shifting, by
exp(mu) where mu grows linearly with the image's token count (Flux's time shift), with `shift_terminal` stretched so
the last sigma before the final 0 is that value (Qwen-Image's 0.02; not a one-step plan's, where the scheduler
divides by zero), then a final 0; the denoiser's timestep is
sigma * 1000. `flow_plan` writes a sampler on that line as per-row coefficients, so flow rows share
replays with every other row of their group:
  * `flow_euler`: Euler, x_next = x + (sigma_next - sigma) * v (FlowMatchEulerDiscreteScheduler);
  * `flow_euler_a`: its stochastic form, x_next = (1 - sigma_next) D + sigma_next * fresh noise, one draw a step
    (FlowMatchEulerDiscreteScheduler with stochastic_sampling; AUTOMATIC1111's 'Euler a' on a flow model);
  * `flow_dpmpp_2m`: DPM-Solver++(2M) with alpha = 1 - sigma (DPMSolverMultistepScheduler with use_flow_sigmas and
    flow_prediction, its own spacing of the shifted sigmas; first order at the first and last step and where a walk
    begins later; AUTOMATIC1111's 'DPM++ 2M').
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .table import NUM_COEFS, Coef

FLOW_SAMPLERS = ("flow_euler", "flow_euler_a", "flow_dpmpp_2m")
FLOW_SCHEDULES = ("default",)


@dataclass(frozen=True)
class FlowSchedule:
    """The sigma schedule of a flow-matching model (diffusers' FlowMatchEulerDiscreteScheduler config keys)."""

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    shift_terminal: float = 0.0  # 0: off; else the last sigma before 0 (the scheduler's stretch_shift_to_terminal)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "FlowSchedule":
        """From a scheduler_config.json's values (keys it does not name keep their defaults)."""
        names = cls.__dataclass_fields__
        return cls(**{k: type(getattr(cls, k))(v) for k, v in config.items() if k in names and v is not None})

    def mu(self, image_tokens: int) -> float:
        """The dynamic shift's exponent for an image of `image_tokens` tokens (linear between the two points)."""
        slope = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        return self.base_shift + slope * (image_tokens - self.base_image_seq_len)

    def sigmas(self, steps: int, image_tokens: int, mu: float | None = None) -> np.ndarray:
        """steps + 1 sigmas from the first (1 shifted) to 0, as the scheduler's set_timesteps makes them; `mu`: the
        dynamic shift's exponent where the pipeline computes its own (FLUX.2's), else `self.mu(image_tokens)`."""
        if steps < 1:
            raise ValueError(f"a flow plan needs at least 1 step, got {steps}")
        s = np.linspace(1.0, 1.0 / steps, steps)
        if self.use_dynamic_shifting:
            m = math.exp(self.mu(image_tokens) if mu is None else mu)
            s = m / (m + (1.0 / s - 1.0))
        else:
            s = self.shift * s / (1.0 + (self.shift - 1.0) * s)
        if self.shift_terminal and s[-1] < 1.0:  # (one step's only sigma, 1, is left: the scheduler divides by 0)
            s = 1.0 - (1.0 - s) / ((1.0 - s[-1]) / (1.0 - self.shift_terminal))
        return np.append(s, 0.0)

    def solver_sigmas(self, steps: int, image_tokens: int, mu: float | None = None) -> np.ndarray:
        """steps + 1 sigmas as DPMSolverMultistepScheduler's use_flow_sigmas lays them (1 - linspace(1, 1 / train
        steps), shifted by `shift`, or by exp(mu) with dynamic shifting, the largest first), then a final 0."""
        if steps < 1:
            raise ValueError(f"a flow plan needs at least 1 step, got {steps}")
        shift = math.exp(self.mu(image_tokens) if mu is None else mu) if self.use_dynamic_shifting else self.shift
        s = 1.0 - np.linspace(1.0, 1.0 / self.num_train_timesteps, steps + 1)
        s = np.flip(shift * s / (1.0 + (shift - 1.0) * s))[:-1]
        return np.append(s, 0.0)


def flow_plan(sampler: str, schedule: str, flow: FlowSchedule, steps: int, image_tokens: int,
              mu: float | None = None) -> Any:
    """`sampler` on the flow line of `flow` (steps, the image's tokens, a pipeline's own `mu`) as a SamplerPlan:
    D = x - sigma * v; the inpainting columns give the known region at the next state,
    (1 - sigma_next) x0 + sigma_next * noise."""
    from .samplers import SamplerPlan  # (samplers imports this module's names for its table)

    if sampler not in FLOW_SAMPLERS:
        raise ValueError(f"sampler {sampler!r} is not a flow-matching sampler; allowed: {', '.join(FLOW_SAMPLERS)}")
    solver = sampler == "flow_dpmpp_2m"
    sigmas = (flow.solver_sigmas if solver else flow.sigmas)(steps, image_tokens, mu)
    s, s_next = sigmas[:-1], sigmas[1:]
    coefs = np.zeros((steps, NUM_COEFS))
    coefs[:, Coef.C_IN] = 1.0
    coefs[:, Coef.T] = s * 1000.0
    coefs[:, Coef.P], coefs[:, Coef.Q] = 1.0, -s
    coefs[:, Coef.KNOWN], coefs[:, Coef.KNOWN_NOISE] = 1.0 - s_next, s_next
    if sampler == "flow_euler":      # x + (s_next - s) v = (s_next / s) x + (1 - s_next / s) D
        coefs[:, Coef.A], coefs[:, Coef.B] = s_next / s, 1.0 - s_next / s
    elif sampler == "flow_euler_a":  # (1 - s_next) D + s_next * noise
        coefs[:, Coef.B], coefs[:, Coef.D] = 1.0 - s_next, s_next
    else:  # (its timesteps are whole numbers: the scheduler's int64 timesteps)
        coefs[:, Coef.A], coefs[:, Coef.B], coefs[:, Coef.C] = _dpmpp_2m(sigmas)
        coefs[:, Coef.T] = (s * flow.num_train_timesteps).astype(np.int64)
    return SamplerPlan(sampler, schedule, steps, coefs, 1.0, sampler == "flow_euler_a", coefs[:, Coef.T].copy(),
                       np.asarray(sigmas), noise_steps=np.full(steps, sampler == "flow_euler_a"),
                       step_index=np.arange(steps), ve=False, steps=steps)


def _dpmpp_2m(sigmas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A, B, C) of DPM-Solver++(2M) with alpha = 1 - sigma, lambda = log(alpha / sigma): first order
    x_next = (s_next / s) x + alpha_next (1 - exp(-h)) D; between the first and the last step second order, its
    D corrected by the previous one (B = B1 (1 + 1 / 2r), C = -B1 / 2r, r = h_prev / h)."""
    s, s_next = sigmas[:-1], sigmas[1:]
    alpha, alpha_next = 1.0 - s, 1.0 - s_next
    b1 = alpha_next - alpha * s_next / s        # alpha_next (1 - exp(-h)), exp(-h) = alpha s_next / (s alpha_next)
    b, c = b1.copy(), np.zeros(len(s))
    lam = np.log(alpha) - np.log(s)
    for i in range(1, len(s) - 1):
        r = (lam[i] - lam[i - 1]) / (np.log(alpha_next[i]) - np.log(s_next[i]) - lam[i])
        b[i], c[i] = b1[i] * (1 + 0.5 / r), -b1[i] * 0.5 / r
    return s_next / s, b, c


def flow_noising(sigma: float) -> tuple[float, float]:
    """(k, e): an image-to-image row at `sigma` starts at k * image latents + e * noise."""
    return 1.0 - sigma, sigma
