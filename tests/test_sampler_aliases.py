"""The sampler and schedule names people type (issue 31, point 3): AUTOMATIC1111's labels and ComfyUI's names map to
one canonical name and give the same images; names not supported yet and unknown ones are refused naming the field,
with the list (and the closest match)."""

from __future__ import annotations

import numpy as np
import pytest

from diffgraph.errors import ParamError
from diffgraph.request import GenerationRequest
from diffgraph.sampling.aliases import SAMPLER_ALIASES, SAMPLERS_NOT_YET, SAMPLERS_REFUSED, canonical, fold
from diffgraph.sampling.names import SAMPLERS, SCHEDULES


@pytest.mark.parametrize("sampler,schedule,expected", [
    ("Euler", None, ("euler", None)), ("Euler a", "Automatic", ("euler_a", "default")),
    ("euler_ancestral", "normal", ("euler_a", "default")), ("DPM++ 2M", "Karras", ("dpmpp_2m", "karras")),
    ("DPM++ 2M Karras", None, ("dpmpp_2m", "karras")), ("DPM++ 2M Karras", "automatic", ("dpmpp_2m", "karras")),
    ("dpmpp_2m", "karras", ("dpmpp_2m", "karras")), ("DDIM", "Normal", ("ddim", "default")),
    ("k_euler_a", None, ("euler_a", None)), (None, "Automatic", (None, "default")),
])
def test_labels_and_comfyui_names_map_to_one_canonical_name(sampler, schedule, expected):
    assert canonical(sampler, schedule, SAMPLERS, SCHEDULES) == expected


def test_every_alias_names_a_sampler_that_exists_and_folds_to_itself():
    for key, (name, implied) in SAMPLER_ALIASES.items():
        assert name in SAMPLERS and implied in (None, *SCHEDULES) and fold(key) == key
    assert not set(SAMPLER_ALIASES) & (set(SAMPLERS_NOT_YET) | set(SAMPLERS_REFUSED))


@pytest.mark.parametrize("sampler,schedule,expected", [
    ("DPM++ 2M SDE Karras", None, ("dpmpp_2m_sde", "karras")), ("DPM++ 3M SDE Exponential", None,
                                                                 ("dpmpp_3m_sde", "exponential")),
    ("dpmpp_2m_sde_gpu", "sgm_uniform", ("dpmpp_2m_sde", "sgm_uniform")), ("UniPC", None, ("unipc", None)),
    ("Heun", "Beta", ("heun", "beta")), ("LMS Karras", None, ("lms", "karras")), ("DPM2 a", "Simple", ("dpm2_a", "simple")),
    ("dpm_2_ancestral", "SGM Uniform", ("dpm2_a", "sgm_uniform")), ("LCM", None, ("lcm", None)),
    ("DPM++ SDE Karras", None, ("dpmpp_sde", "karras")),
])
def test_the_newer_samplers_and_schedules_have_their_labels(sampler, schedule, expected):
    assert canonical(sampler, schedule, SAMPLERS, SCHEDULES) == expected


ALLOWED = ", ".join(SAMPLERS)


@pytest.mark.parametrize("sampler,schedule,expected", [
    ("DPM++ 2S a", None, ("dpmpp_2s_a", None)), ("DPM++ 2S a Karras", None, ("dpmpp_2s_a", "karras")),
    ("dpmpp_2s_ancestral", "karras", ("dpmpp_2s_a", "karras")), ("k_dpmpp_2s_a", None, ("dpmpp_2s_a", None)),
    ("DPM++ 2M SDE Heun", "Exponential", ("dpmpp_2m_sde_heun", "exponential")),
    ("DPM++ 2M SDE Heun Karras", None, ("dpmpp_2m_sde_heun", "karras")),
    ("dpmpp_2m_sde_heun_gpu", None, ("dpmpp_2m_sde_heun", None)), ("Restart", "Karras", ("restart", "karras")),
    ("DPM fast", "Automatic", ("dpm_fast", "default")), ("k_dpm_fast", None, ("dpm_fast", None)),
    ("Euler", "Uniform", ("euler", "uniform")), ("Euler", "Polyexponential", ("euler", "polyexponential")),
    ("DPM++ 2M", "KL Optimal", ("dpmpp_2m", "kl_optimal")), ("Euler", "Align Your Steps", ("euler", "align_your_steps")),
    ("euler", "kl_optimal", ("euler", "kl_optimal")), ("euler", "ays", ("euler", "align_your_steps")),
    ("Euler a", "Turbo", ("euler_a", "turbo")), ("Euler", "DDIM", ("euler", "ddim_uniform")),
    ("euler", "ddim_uniform", ("euler", "ddim_uniform")),
    ("DDIM CFG++", None, ("ddim_cfgpp", None)), ("ddim_cfgpp", "Karras", ("ddim_cfgpp", "karras")),
    ("DDIM CFG++", "Automatic", ("ddim_cfgpp", "default")), ("ddim_cfg_pp", None, ("ddim_cfgpp", None)),
])
def test_automatic1111s_and_comfyuis_other_samplers_and_schedulers_have_their_labels(sampler, schedule, expected):
    assert canonical(sampler, schedule, SAMPLERS, SCHEDULES) == expected


ALLOWED = ", ".join(SAMPLERS)


@pytest.mark.parametrize("sampler,schedule,param,words", [
    ("DPM adaptive", None, "sampler", "sampler 'DPM adaptive' is not supported: its step count adapts to the image, "
                                      "which a plan made before the first step cannot follow; use 'dpm_fast'"),
    ("k_dpm_ad", None, "sampler", "use 'dpm_fast' (the same DPM-Solver at a fixed count) or 'dpmpp_2m'"),
    ("Euler CFG++", None, "sampler", f"sampler 'Euler CFG++' is not supported here; allowed: {ALLOWED}"),
    ("eulr", None, "sampler", f"is unknown; allowed: {ALLOWED}; did you mean 'euler'?"),
    ("Euler", "Linear Quadratic", "schedule", "'Linear Quadratic' is not supported yet; allowed: "
                                              f"{', '.join(SCHEDULES)}"),
    ("euler", "karas", "schedule", f"allowed: {', '.join(SCHEDULES)}; did you mean 'karras'?"),
    ("DPM++ 2M Karras", "default", "schedule", "names schedule 'karras' but schedule 'default' was given"),
])
def test_names_not_there_are_refused_naming_the_field(sampler, schedule, param, words):
    with pytest.raises(ParamError) as e:
        GenerationRequest.create("x", width=64, height=64, guidance_scale=5.0, sampler=sampler, schedule=schedule)
    assert e.value.param == param and words in str(e.value) and "\n" not in str(e.value)


def test_a_sampler_refuses_the_schedules_its_diffusers_scheduler_lacks(tiny_engine):
    with pytest.raises(ParamError, match="^sampler 'ddim' takes the schedules default, karras, sgm_uniform, simple, "
                                         "not 'exponential'; pick one of those$") as e:
        tiny_engine.generate("x", sampler="DDIM", schedule="Exponential", num_inference_steps=2)
    assert e.value.param == "schedule"


def test_an_alias_gives_the_canonical_names_image(tiny_engine):
    def image(**names):
        return np.asarray(tiny_engine.generate("a red fox", seed=3, num_inference_steps=4, **names)[0])
    assert np.array_equal(image(sampler="DPM++ 2M Karras"), image(sampler="dpmpp_2m", schedule="karras"))
    assert np.array_equal(image(sampler="Euler a", schedule="Automatic"), image(sampler="euler_a"))
    r = tiny_engine.make_request("x", sampler="euler_ancestral", schedule="normal")
    assert (r.sampler, r.schedule) == ("euler_a", "default")  # stored (and written into images) canonically


def test_ddim_cfgpp_on_a_flow_matching_family_is_refused_in_one_line_with_what_to_use():
    from diffgraph.sampling.flow import FLOW_SAMPLERS, FLOW_SCHEDULES

    for name in ("DDIM CFG++", "ddim_cfgpp"):
        with pytest.raises(ParamError) as e:
            canonical(name, None, FLOW_SAMPLERS, FLOW_SCHEDULES)
        also = " (ddim_cfgpp)" if name != "ddim_cfgpp" else ""
        assert str(e.value) == (f"sampler {name!r}{also} is DDIM on the SD noise schedule, which this model's family "
                                f"does not walk; use one of {', '.join(FLOW_SAMPLERS)}") and e.value.param == "sampler"
