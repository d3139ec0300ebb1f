"""An adapter file's sidecar (features/slot_files.py): what it declares, by request field, and its one-line refusals."""

import os

import pytest

from diffgraph.features.slot_files import SidecarError, read_recommended


def declared(tmp_path, text: str):
    (tmp_path / "a.diffgraph.toml").write_text(text)
    return read_recommended(str(tmp_path / "a.safetensors"))


def test_it_declares_the_request_fields_it_names(tmp_path):
    assert read_recommended(str(tmp_path / "a.safetensors")) is None
    found = declared(tmp_path, 'schedule = "lightning"\nsteps = 8\nguidance = 1\nschedule_shift = 3\n')
    assert found.values() == {"schedule": "lightning", "num_inference_steps": 8, "guidance_scale": 1.0,
                              "schedule_shift": 3.0}
    assert found.listing() == {"schedule": "lightning", "steps": 8, "guidance": 1.0, "schedule_shift": 3.0}
    assert declared(tmp_path, "steps = 4\n").values() == {"num_inference_steps": 4}
    os.symlink(tmp_path / "a.safetensors", tmp_path / "link.safetensors")  # a link's sidecar is its target's
    assert read_recommended(str(tmp_path / "link.safetensors")).steps == 4


@pytest.mark.parametrize("text,words", [("steps = 0\n", "steps must be a whole number in 1..200"),
                                        ("steps = 2.5\n", "steps must be a whole number"),
                                        ("guidance = true\n", "guidance must be a number"),
                                        ('schedule = ""\n', "schedule must be a non-empty string"),
                                        ("schedule_shift = 0\n", "schedule_shift must be a number in 0.01..100"),
                                        ("sampler = 'euler'\n", "unknown key 'sampler'; allowed: schedule, steps"),
                                        ("steps = \n", "is not TOML")])
def test_a_bad_sidecar_is_one_line_naming_it(tmp_path, text, words):
    with pytest.raises(SidecarError) as e:
        declared(tmp_path, text)
    assert str(e.value).startswith("sidecar a.diffgraph.toml") and words in str(e.value) and "\n" not in str(e.value)
