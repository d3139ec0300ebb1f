"""Sampling: training noise schedules and per-request sampler coefficient tables (pure, CPU, float64).

`make_plan(NoiseSchedule.from_config(cfg), sampler, schedule, steps)` gives a `SamplerPlan` whose rows drive
one batched update per step (see samplers.py). The diffusers oracle lives in `sampling.oracle` and is not
imported here, so the engine does not pull in diffusers' schedulers.

The names are plain data (names.py); everything else loads on first access (PEP 562), so that reading
`SAMPLERS` (the command line's `--help` does) imports neither numpy nor torch.
"""

from typing import Any

from .names import SAMPLERS, SCHEDULES

__all__ = [
    "NUM_COEFS",
    "SAMPLERS",
    "SCHEDULES",
    "Coef",
    "NoiseSchedule",
    "SamplerPlan",
    "apply_step",
    "check_sampler",
    "make_plan",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(".schedules" if name == "NoiseSchedule" else ".samplers", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
