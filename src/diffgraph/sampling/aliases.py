"""The sampler and schedule names people type: AUTOMATIC1111's labels ("DPM++ 2M Karras",
"Euler a", and its scheduler "Automatic" that webuiapi sends by default) and ComfyUI's names (`euler_ancestral`,
`dpmpp_2m`, schedule `normal`), mapped to one canonical name of sampling/names.py. Plain data, no numpy or torch.

Names are matched folded (case, spaces, underscores and dashes ignored). A label that names a schedule too ("DPM++
2M Karras") gives it, unless the request names another one (then it is refused as a contradiction). The labels of
samplers and schedules diffgraph does not have ("DPM adaptive", "Euler CFG++", "Linear Quadratic", ...) get a
one-line error that says which one it is and what is there instead; an unknown name gets
the list and the closest match, and DDIM CFG++ on a family without it (a flow-matching model) a line that says why.
A family's own names (FamilyAdapter.samplers) are taken as they are.
"""

from __future__ import annotations

import difflib
import re

from ..errors import ParamError
from .names import CFGPP_SAMPLERS

# folded name -> (canonical sampler, the schedule its label implies or None)
SAMPLER_ALIASES: dict[str, tuple[str, str | None]] = {
    "euler": ("euler", None), "k euler": ("euler", None),
    "euler a": ("euler_a", None), "euler ancestral": ("euler_a", None), "k euler a": ("euler_a", None),
    "k euler ancestral": ("euler_a", None),
    "dpm++ 2m": ("dpmpp_2m", None), "dpmpp 2m": ("dpmpp_2m", None), "k dpmpp 2m": ("dpmpp_2m", None),
    "dpm++ 2m karras": ("dpmpp_2m", "karras"), "dpmpp 2m karras": ("dpmpp_2m", "karras"),
    "dpmsolvermultistep": ("dpmpp_2m", None), "dpm solver++": ("dpmpp_2m", None),
    "ddim": ("ddim", None),
    "dpm++ 2m sde": ("dpmpp_2m_sde", None), "dpmpp 2m sde": ("dpmpp_2m_sde", None),
    "dpmpp 2m sde gpu": ("dpmpp_2m_sde", None), "k dpmpp 2m sde": ("dpmpp_2m_sde", None),
    "dpm++ 2m sde karras": ("dpmpp_2m_sde", "karras"), "dpm++ 2m sde exponential": ("dpmpp_2m_sde", "exponential"),
    "dpm++ 3m sde": ("dpmpp_3m_sde", None), "dpmpp 3m sde": ("dpmpp_3m_sde", None),
    "dpmpp 3m sde gpu": ("dpmpp_3m_sde", None),
    "dpm++ 3m sde karras": ("dpmpp_3m_sde", "karras"), "dpm++ 3m sde exponential": ("dpmpp_3m_sde", "exponential"),
    "dpm++ sde": ("dpmpp_sde", None), "dpmpp sde": ("dpmpp_sde", None), "dpmpp sde gpu": ("dpmpp_sde", None),
    "dpm++ sde karras": ("dpmpp_sde", "karras"), "k dpmpp sde": ("dpmpp_sde", None),
    "heun": ("heun", None), "k heun": ("heun", None),
    "lms": ("lms", None), "k lms": ("lms", None), "lms karras": ("lms", "karras"),
    "dpm2": ("dpm2", None), "dpm 2": ("dpm2", None), "k dpm 2": ("dpm2", None), "dpm2 karras": ("dpm2", "karras"),
    "dpm2 a": ("dpm2_a", None), "dpm 2 ancestral": ("dpm2_a", None), "k dpm 2 ancestral": ("dpm2_a", None),
    "dpm2 a karras": ("dpm2_a", "karras"),
    # UniPC's bh2 variant (AUTOMATIC1111's and ComfyUI's "uni_pc" default to bh1, which is not built)
    "unipc": ("unipc", None), "uni pc": ("unipc", None), "uni pc bh2": ("unipc", None), "unipcmultistep": ("unipc", None),
    "lcm": ("lcm", None), "tcd": ("tcd", None), "plms": ("plms", None), "pndm": ("plms", None),
}
# k-diffusion's and AUTOMATIC1111's samplers without a diffusers scheduler (sampling/kdiffusion.py)
SAMPLER_ALIASES |= {
    "dpm++ 2s a": ("dpmpp_2s_a", None), "dpmpp 2s a": ("dpmpp_2s_a", None), "dpmpp 2s ancestral": ("dpmpp_2s_a", None),
    "k dpmpp 2s a": ("dpmpp_2s_a", None), "dpm++ 2s a karras": ("dpmpp_2s_a", "karras"),
    "dpm++ 2m sde heun": ("dpmpp_2m_sde_heun", None), "dpmpp 2m sde heun": ("dpmpp_2m_sde_heun", None),
    "dpmpp 2m sde heun gpu": ("dpmpp_2m_sde_heun", None), "k dpmpp 2m sde heun": ("dpmpp_2m_sde_heun", None),
    "dpm++ 2m sde heun karras": ("dpmpp_2m_sde_heun", "karras"),
    "dpm++ 2m sde heun exponential": ("dpmpp_2m_sde_heun", "exponential"),
    "restart": ("restart", None), "dpm fast": ("dpm_fast", None), "k dpm fast": ("dpm_fast", None),
    # AUTOMATIC1111's "DDIM CFG++" (alias ddim_cfgpp); ComfyUI has no DDIM CFG++ of its own
    "ddim cfg++": ("ddim_cfgpp", None), "ddim cfgpp": ("ddim_cfgpp", None), "ddim cfg pp": ("ddim_cfgpp", None),
}
# AUTOMATIC1111's and ComfyUI's other samplers (folded) -> the name it will have here ("": none is planned)
SAMPLERS_NOT_YET: dict[str, str] = {
    "heunpp2": "heunpp2",
    **{k: "" for k in ("ipndm", "deis", "ddpm", "euler cfg++", "euler ancestral cfg++", "res multistep")},
}
# samplers refused for what they are, each with the nearest one here
SAMPLERS_REFUSED: dict[str, str] = {
    **{k: "its step count adapts to the image, which a plan made before the first step cannot follow; use "
          "'dpm_fast' (the same DPM-Solver at a fixed count) or 'dpmpp_2m'" for k in ("dpm adaptive", "k dpm ad")},
}
SCHEDULE_ALIASES: dict[str, str] = {"default": "default", "automatic": "default", "normal": "default",
                                    "karras": "karras", "exponential": "exponential", "beta": "beta",
                                    "sgm uniform": "sgm_uniform", "sgmuniform": "sgm_uniform", "simple": "simple",
                                    "uniform": "uniform", "polyexponential": "polyexponential",
                                    "kl optimal": "kl_optimal", "align your steps": "align_your_steps",
                                    "ays": "align_your_steps", "turbo": "turbo", "ddim uniform": "ddim_uniform",
                                    "ddim": "ddim_uniform"}
SCHEDULES_NOT_YET = ("linear quadratic", "karras exponential", "align your steps 11", "align your steps 32",
                     "align your steps gits")


def fold(name: str) -> str:
    return re.sub(r"[\s_\-]+", " ", name.strip().lower())


def canonical(sampler: str, schedule: str | None, samplers: tuple[str, ...],
              schedules: tuple[str, ...]) -> tuple[str, str | None]:
    """(sampler, schedule) in the family's own names: its names as they are, aliases mapped, the schedule a label
    implies filled in (schedule None: not given, or AUTOMATIC1111's "Automatic"). Raises ParamError naming the field."""
    implied, label = None, sampler
    if isinstance(sampler, str) and sampler not in samplers:
        key = fold(sampler)
        base = SAMPLER_ALIASES.get(key, (key, None))[0]
        if key in SAMPLER_ALIASES and SAMPLER_ALIASES[key][0] in samplers:
            sampler, implied = SAMPLER_ALIASES[key]
        elif f"flow_{base}" in samplers:  # a flow-matching family's counterpart ('Euler' -> flow_euler)
            sampler = f"flow_{base}"
        elif base in CFGPP_SAMPLERS:  # (the SD families have it)
            also = f" ({base})" if base != sampler else ""
            raise ParamError("sampler", f"sampler {sampler!r}{also} is DDIM on the SD noise schedule, which this "
                                        f"model's family does not walk; use one of {', '.join(samplers)}")
        elif key in SAMPLERS_REFUSED:
            raise ParamError("sampler", f"sampler {sampler!r} is not supported: {SAMPLERS_REFUSED[key]}")
        elif key in SAMPLERS_NOT_YET:
            planned = SAMPLERS_NOT_YET[key]
            also = f" ({planned})" if planned and planned != sampler else ""
            raise ParamError("sampler", f"sampler {sampler!r}{also} is not supported {'yet' if planned else 'here'}; "
                                        f"allowed: {', '.join(samplers)} (or their AUTOMATIC1111 / ComfyUI names)")
        # else: unknown here; the family's check refuses it with its list and the closest name (`closest`)
    automatic = isinstance(schedule, str) and fold(schedule) == "automatic"
    if isinstance(schedule, str) and schedule not in schedules:
        key = fold(schedule)
        if key in SCHEDULE_ALIASES and SCHEDULE_ALIASES[key] in schedules:
            schedule = SCHEDULE_ALIASES[key]
        elif key in SCHEDULES_NOT_YET:
            raise ParamError("schedule", f"schedule {schedule!r} is not supported yet; allowed: {', '.join(schedules)}"
                                         " (AUTOMATIC1111's Automatic and ComfyUI's normal are 'default')")
    if implied is not None:
        if schedule is not None and not automatic and schedule != implied:
            raise ParamError("schedule", f"sampler {label!r} names schedule {implied!r} but schedule "
                                         f"{schedule!r} was given; give one of them")
        schedule = implied
    return sampler, schedule


def closest(name: str, names: tuple[str, ...]) -> str:
    """"; did you mean 'x'?" for the name (or alias of one of `names`) nearest to `name`, or ""."""
    canon = set(names)
    known = {fold(n): n for n in names} | {k: v[0] for k, v in SAMPLER_ALIASES.items() if v[0] in canon} | {
        k: v for k, v in SCHEDULE_ALIASES.items() if v in canon}
    close = difflib.get_close_matches(fold(name), list(known), n=1, cutoff=0.75) if isinstance(name, str) else []
    return f"; did you mean {known[close[0]]!r}?" if close else ""
