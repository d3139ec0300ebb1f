"""The sampler and schedule names people type (issue 31, point 3): AUTOMATIC1111's labels and ComfyUI's names map to
one canonical name and give the same images; names not supported yet and unknown ones are refused naming the field,
with the list (and the closest match)."""

from __future__ import annotations

import numpy as np
import pytest

from diffgraph.errors import ParamError
from diffgraph.request import GenerationRequest
from diffgraph.sampling.aliases import SAMPLER_ALIASES, SAMPLERS_NOT_YET, canonical, fold
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
    assert not set(SAMPLER_ALIASES) & set(SAMPLERS_NOT_YET)


@pytest.mark.parametrize("sampler,schedule,param,words", [
    ("DPM++ 2M SDE Karras", None, "sampler", "'DPM++ 2M SDE Karras' (dpmpp_2m_sde) is not supported yet; allowed: "
                                             "euler, euler_a, dpmpp_2m, ddim"),
    ("UniPC", None, "sampler", "(unipc) is not supported yet"), ("Heun", None, "sampler", "'Heun' (heun) is not supported"), ("heun", None, "sampler", "'heun' is not supported"),
    ("eulr", None, "sampler", "is unknown; allowed: euler, euler_a, dpmpp_2m, ddim; did you mean 'euler'?"),
    ("Euler", "exponential", "schedule", "'exponential' is not supported yet; allowed: default, karras"),
    ("Euler", "sgm_uniform", "schedule", "not supported yet"),
    ("euler", "karas", "schedule", "allowed: default, karras; did you mean 'karras'?"),
    ("DPM++ 2M Karras", "default", "schedule", "names schedule 'karras' but schedule 'default' was given"),
])
def test_names_not_there_are_refused_naming_the_field(sampler, schedule, param, words):
    with pytest.raises(ParamError) as e:
        GenerationRequest.create("x", width=64, height=64, guidance_scale=5.0, sampler=sampler, schedule=schedule)
    assert e.value.param == param and words in str(e.value) and "\n" not in str(e.value)


def test_an_alias_gives_the_canonical_names_image(tiny_engine):
    def image(**names):
        return np.asarray(tiny_engine.generate("a red fox", seed=3, num_inference_steps=4, **names)[0])
    assert np.array_equal(image(sampler="DPM++ 2M Karras"), image(sampler="dpmpp_2m", schedule="karras"))
    assert np.array_equal(image(sampler="Euler a", schedule="Automatic"), image(sampler="euler_a"))
    r = tiny_engine.make_request("x", sampler="euler_ancestral", schedule="normal")
    assert (r.sampler, r.schedule) == ("euler_a", "default")  # stored (and written into images) canonically
