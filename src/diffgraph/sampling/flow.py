"""Flow matching: the sampling entry point of rectified-flow models, beside the SD noise schedule (schedules.py).

A flow-matching model (SD3, Flux, Z-Image, Qwen-Image) is trained on x_sigma = (1 - sigma) x0 + sigma * noise and
predicts the velocity v = noise - x0, so D = x - sigma * v. `FlowSchedule` is diffusers'
FlowMatchEulerDiscreteScheduler's reading of a scheduler config: sigmas from 1 towards 1 / steps, shifted either by
a fixed `shift` (sigma' = shift * sigma / (1 + (shift - 1) * sigma)) or, with dynamic shifting, by
exp(mu) where mu grows linearly with the image's token count (Flux's time shift), then a final 0; the denoiser's
timestep is sigma * 1000. `flow_plan` writes Euler on that line (x_next = x + (sigma_next - sigma) * v) as per-row
coefficients, so flow rows share replays with every other row of their group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .table import NUM_COEFS, Coef

FLOW_SAMPLERS = ("flow_euler",)
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
        return np.append(s, 0.0)


def flow_plan(sampler: str, schedule: str, sigmas: np.ndarray) -> Any:
    """Euler on the flow line over `sigmas` (steps + 1, ending at 0) as a SamplerPlan: D = x - sigma * v,
    x_next = (sigma_next / sigma) x + (1 - sigma_next / sigma) D; the inpainting columns give the known region at the
    next state, (1 - sigma_next) x0 + sigma_next * noise."""
    from .samplers import SamplerPlan  # (samplers imports this module's names for its table)

    if sampler not in FLOW_SAMPLERS:
        raise ValueError(f"sampler {sampler!r} is not a flow-matching sampler; allowed: {', '.join(FLOW_SAMPLERS)}")
    steps = len(sigmas) - 1
    coefs = np.zeros((steps, NUM_COEFS))
    for i in range(steps):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        coefs[i, Coef.C_IN] = 1.0
        coefs[i, Coef.T] = s * 1000.0
        coefs[i, Coef.P], coefs[i, Coef.Q] = 1.0, -s
        coefs[i, Coef.A], coefs[i, Coef.B] = s_next / s, 1.0 - s_next / s
        coefs[i, Coef.KNOWN], coefs[i, Coef.KNOWN_NOISE] = 1.0 - s_next, s_next
    return SamplerPlan(sampler, schedule, steps, coefs, 1.0, False, coefs[:, Coef.T].copy(), np.asarray(sigmas),
                       noise_steps=np.zeros(steps, bool), step_index=np.arange(steps), ve=False, steps=steps)


def flow_noising(sigma: float) -> tuple[float, float]:
    """(k, e): an image-to-image row at `sigma` starts at k * image latents + e * noise."""
    return 1.0 - sigma, sigma
