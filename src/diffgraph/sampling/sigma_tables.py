"""AUTOMATIC1111's, Forge's and ComfyUI's other sigma schedules, as the sigmas a plan walks: `table_sigmas`.

Each is a function of the model's training sigmas (its range sigma_min = sigma(t=0), sigma_max = sigma(t=N-1), as
AUTOMATIC1111 passes them to its schedulers, not the spaced range diffusers' sigma options take) and the step count:

- `uniform`: AUTOMATIC1111's "Uniform", k-diffusion's DiscreteSchedule.get_sigmas (n timesteps evenly from N - 1 to
  0, the sigma between two training timesteps interpolated in log sigma);
- `polyexponential`: k-diffusion's get_sigmas_polyexponential with AUTOMATIC1111's rho 1;
- `kl_optimal`: "KL Optimal" (Sabour et al. 2024) as ComfyUI lays it, n sigmas tan((1 - i/(n-1)) atan(sigma_max) +
  i/(n-1) atan(sigma_min)) then 0 (AUTOMATIC1111's steps to sigma_min at its last step and stops there, undenoised);
- `align_your_steps` / `align_your_steps_sdxl`: NVIDIA's published 10-step lists for SD1.5 and SDXL, log-linearly
  interpolated to n steps as AUTOMATIC1111 does (the SDXL family maps the one label to its list);
- `turbo`: Forge's "Turbo" (SDXL Turbo's timesteps): round(k N / n - 1) for k = n..1, their training sigmas;
- `ddim_uniform`: AUTOMATIC1111's "DDIM" scheduler: every (N // n)-th training sigma from timestep 1 up. Where that
  lays more than n (30 steps: 31 from timestep 991 down), the plan walks the n highest, ending one step early at a
  larger sigma (AUTOMATIC1111 walks them all, a step more than asked).

The final 0 is the caller's, as for the other schedules (schedules.converted_sigmas).
"""

from __future__ import annotations

import numpy as np

TABLE_SCHEDULES = ("uniform", "polyexponential", "kl_optimal", "align_your_steps", "align_your_steps_sdxl", "turbo",
                   "ddim_uniform")
# https://research.nvidia.com/labs/toronto-ai/AlignYourSteps/howto.html
AYS_SIGMAS = {
    "align_your_steps": (14.615, 6.475, 3.861, 2.697, 1.886, 1.396, 0.963, 0.652, 0.399, 0.152, 0.029),
    "align_your_steps_sdxl": (14.615, 6.315, 3.771, 2.181, 1.342, 0.862, 0.555, 0.380, 0.234, 0.113, 0.029),
}


def table_sigmas(schedule: str, train: np.ndarray, n: int) -> np.ndarray:
    """The n sigmas (descending, without the final 0) of table schedule `schedule` on training sigmas `train`."""
    big_n = len(train)
    sigma_min, sigma_max = float(train[0]), float(train[-1])
    if schedule == "uniform":
        t = np.linspace(big_n - 1, 0, n)
        return np.exp(np.interp(t, np.arange(big_n), np.log(train)))
    if schedule == "polyexponential":
        ramp = np.linspace(1, 0, n)
        return np.exp(ramp * (np.log(sigma_max) - np.log(sigma_min)) + np.log(sigma_min))
    if schedule == "kl_optimal":
        if n == 1:
            return np.array([sigma_max])
        idx = np.arange(n) / (n - 1)
        return np.tan(idx * np.arctan(sigma_min) + (1 - idx) * np.arctan(sigma_max))
    if schedule in AYS_SIGMAS:
        sigmas = np.array(AYS_SIGMAS[schedule])
        if n == len(sigmas):
            return sigmas
        xs = np.linspace(0, 1, len(sigmas))
        return np.exp(np.interp(np.linspace(0, 1, n), xs, np.log(sigmas[::-1])))[::-1].copy()
    if schedule == "turbo":
        t = np.round(np.arange(1, n + 1) * (big_n / n) - 1)[::-1].clip(0, big_n - 1).astype(np.int64)
        return train[t]
    if schedule == "ddim_uniform":
        return train[_ddim_uniform_timesteps(big_n, n)]
    raise ValueError(f"schedule {schedule!r} is not a table schedule; use one of {', '.join(TABLE_SCHEDULES)}")


def _ddim_uniform_timesteps(big_n: int, n: int) -> np.ndarray:
    """Every (N // n)-th timestep from 1 up, descending; where that lays more than n (N // n does not divide N - 1
    into n), the n highest of them."""
    return np.arange(1, big_n, max(big_n // n, 1))[::-1][:n].copy()
