"""LoRA on Qwen-Image and Qwen-Image-Edit (lora/, features/lora.py, the family's `lora_layout`) against diffusers'
`load_lora_weights` on `QwenImagePipeline` / `QwenImageEditPlusPipeline`, on the tiny random models (fp32, CPU, within
one uint8 level).

One random rank-4 PEFT adapter on every layer the family's files train (both blocks), written in the layouts users
publish: Kohya's (`lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight` with alphas), ComfyUI's
(`diffusion_model.` keys) and lightx2v's (the Qwen-Image-Lightning releases: bare `transformer_blocks.` keys with
alphas). Its sidecar (`NAME.diffgraph.toml`: features/slot_files.py) declares the Lightning releases' schedule, steps and
guidance, which a request that leaves them unset runs; rows of such a LoRA, 3-step CFG rows without one on the base
model's shift, and on the Edit model edit rows, share steps and each equals its request alone.
"""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from diffgraph import Engine, GenerationRequest, ParamError
from diffgraph.lora.catalog import describe
from diffgraph.models.families.qwen_image import LIGHTNING, LORA_TARGETS

from loop_util import images_together
from test_qwen_image import folder, oracle  # noqa: F401 (the tiny folder and its pipeline, fixtures)
from test_qwen_image_edit import IMAGES, PROMPT, edit, oracle as edit_oracle, request as edit_request  # noqa: F401

RANK, ALPHA, SCALE = 4, 2.0, 0.8
SIDECAR = 'schedule = "lightning"\nsteps = 2\nguidance = 1.0\n'


def peft_lora(transformer, seed: int = 21) -> dict[str, torch.Tensor]:
    """A random rank-4 adapter on every LORA_TARGETS layer of the transformer's blocks, in PEFT's keys."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, linear in transformer.named_modules():
        if name.startswith("transformer_blocks.") and name.endswith(LORA_TARGETS):
            state[f"transformer.{name}.lora_A.weight"] = torch.randn((RANK, linear.in_features), generator=g) * 0.3
            state[f"transformer.{name}.lora_B.weight"] = torch.randn((linear.out_features, RANK), generator=g) * 0.3
    return state


def layout(state: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """`state` (PEFT keys) in a published layout, the same adapter: kohya and lightx2v keep B * rank / alpha with
    their alpha."""
    out = {}
    for key, t in state.items():
        module, part = key.removeprefix("transformer.").split(".lora_")
        if kind == "comfyui":
            out[f"diffusion_model.{module}.lora_{part}"] = t
            continue
        name = "lora_unet_" + module.replace(".", "_") if kind == "kohya" else module
        down = part.startswith("A")
        out[f"{name}.lora_{'down' if down else 'up'}.weight"] = t if down else t * (RANK / ALPHA)
        out[f"{name}.alpha"] = torch.tensor(ALPHA)
    return out


def with_lora(pipe, path: str, fn):
    """`fn()` with diffusers' load_lora_weights of `path` at SCALE on `pipe`, unloaded after."""
    pipe.load_lora_weights(path, adapter_name="a")
    pipe.set_adapters(["a"], [SCALE])
    try:
        return fn()
    finally:
        pipe.unload_lora_weights()


@pytest.fixture(scope="module")
def loras(folder, tmp_path_factory):  # noqa: F811
    """A lora dir: the adapter in each layout, and `lightning` (PEFT keys) with its sidecar."""
    root = tmp_path_factory.mktemp("qwen-loras")
    state = peft_lora(folder[1].transformer)
    for kind in ("kohya", "comfyui", "lightx2v"):
        save_file(layout(state, kind), str(root / f"{kind}.safetensors"))
    save_file(state, str(root / "lightning.safetensors"))
    (root / "lightning.diffgraph.toml").write_text(SIDECAR)
    return root


@pytest.fixture(scope="module")
def qwen_lora(folder, loras):  # noqa: F811
    with Engine(model=folder[0], device="cpu", lora_dir=str(loras)) as engine:
        yield engine


def test_kohya_comfyui_and_lightx2v_layouts_equal_diffusers(folder, loras, qwen_lora):  # noqa: F811
    """Each layout, one row each in one step, equals the pipeline with diffusers' load_lora_weights of that file."""
    pipe = folder[1]
    common = dict(prompt="a red fox", height=64, width=64, num_inference_steps=2, guidance_scale=1.0, seed=6)
    kinds = ("kohya", "comfyui", "lightx2v")
    got = images_together(qwen_lora, [dict(common, loras=[(k, SCALE)]) for k in kinds])
    plain = oracle(pipe, "a red fox", (64, 64), 2, 1.0, 6)
    for kind, image in zip(kinds, got):
        want = with_lora(pipe, str(loras / f"{kind}.safetensors"), lambda: oracle(pipe, "a red fox", (64, 64), 2,
                                                                                   1.0, 6))
        assert np.abs(image - want).max() <= 1, kind
        assert np.abs(want - plain).max() > 3, kind


def test_a_lightning_sidecar_row_beside_a_cfg_row_equals_each_alone_and_diffusers(folder, loras, qwen_lora):  # noqa
    """A request naming `lightning` and nothing else runs its sidecar's schedule, 2 steps, guidance 1 (its result's
    request says so); beside a 3-step true-CFG row without a LoRA on the model's shift, each equals its request alone,
    and the LoRA row equals the pipeline with the Lightning scheduler and load_lora_weights."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = folder[1]
    fast = dict(prompt="a red fox", height=64, width=64, seed=8, loras=[("lightning", SCALE)])
    cfg = dict(prompt="a red fox", height=64, width=96, num_inference_steps=3, guidance_scale=3.0, seed=9)
    result = qwen_lora.submit(GenerationRequest.create(model=qwen_lora.info, **fast)).result()
    r = result.request
    assert (r.schedule, r.num_inference_steps, r.guidance_scale, r.defaulted) == ("lightning", 2, 1.0, ("schedule_shift",))
    together = images_together(qwen_lora, [fast, cfg])
    for request, image in zip((fast, cfg), together):
        assert np.abs(image - images_together(qwen_lora, [request])[0]).max() <= 1
    own = pipe.scheduler
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(**LIGHTNING)
    try:
        want = with_lora(pipe, str(loras / "lightning.safetensors"),
                         lambda: oracle(pipe, "a red fox", (64, 64), 2, 1.0, 8))
    finally:
        pipe.scheduler = own
    assert np.abs(together[0] - want).max() <= 1
    assert np.abs(together[1] - oracle(pipe, "a red fox", (64, 96), 3, 3.0, 9)).max() <= 1


def test_a_request_s_own_values_win_over_the_sidecar_s_and_listings_show_it(loras, qwen_lora):
    """Explicit schedule, steps and guidance are kept; GET /v1/loras (the engine's listing and the header-only one of
    the HTTP process) shows what the sidecar declares."""
    runner = qwen_lora.core.runner
    made = GenerationRequest.create(model=qwen_lora.info, prompt="x", loras=[("lightning", 1.0)], schedule="default",
                                    num_inference_steps=3)
    ran = runner.capabilities.recommended(made, qwen_lora.core.resolve_files(made))
    assert (ran.schedule, ran.num_inference_steps, ran.guidance_scale, ran.defaulted) == ("default", 3, 1.0, ("schedule_shift",))
    entry = {e["name"]: e for e in qwen_lora.loras()["data"]}
    assert {k: entry["lightning"][k] for k in ("schedule", "steps", "guidance")} == \
        {"schedule": "lightning", "steps": 2, "guidance": 1.0}
    assert "schedule" not in entry["kohya"]
    assert describe(str(loras / "lightning.safetensors"))["schedule"] == "lightning"


def test_bad_sidecars_conflicts_and_sd_loras_are_one_line_400s_naming_loras(folder, tmp_path):  # noqa: F811
    """A sidecar schedule the family lacks names the adapter and the family's schedules; two adapters declaring
    different steps name both; an unknown sidecar key names the allowed ones; an SD LoRA names why."""
    state = peft_lora(folder[1].transformer)
    for name, sidecar in (("karras", 'schedule = "karras"\n'), ("eight", "steps = 8\n"), ("four", "steps = 4\n"),
                          ("typo", "step = 4\n")):
        save_file(state, str(tmp_path / f"{name}.safetensors"))
        (tmp_path / f"{name}.diffgraph.toml").write_text(sidecar)
    sd = "lora_unet_down_blocks_0_attentions_0_proj_in"
    save_file({f"{sd}.lora_down.weight": torch.ones(4, 320), f"{sd}.lora_up.weight": torch.ones(320, 4)},
              str(tmp_path / "sd_style.safetensors"))
    with Engine(model=folder[0], device="cpu", lora_dir=str(tmp_path)) as engine:
        def refusal(loras) -> str:
            made = GenerationRequest.create(model=engine.info, prompt="x", loras=loras)
            with pytest.raises(ParamError) as e:
                engine.submit(made).result()
            assert e.value.param == "loras" and "\n" not in str(e.value)
            return str(e.value)
        assert "'karras'" in (m := refusal([("karras", 1.0)])) and "schedules: default, lightning" in m
        assert "'eight'" in (m := refusal([("eight", 1.0), ("four", 1.0)])) and "'four'" in m
        assert "allowed: schedule, steps, guidance" in refusal([("typo", 1.0)])
        assert "sd_style" in (m := refusal([("sd_style", 1.0)])) and "Stable Diffusion UNet" in m
        assert {e["name"] for e in engine.loras()["unusable"]} == {"karras", "typo", "sd_style"}


def test_edit_rows_with_a_lightning_lora_equal_diffusers_and_each_alone(edit, tmp_path):  # noqa: F811
    """On the Edit model: a one-input edit row with the Lightning LoRA (its sidecar: 2 steps, guidance 1, the
    Lightning schedule) equals QwenImageEditPlusPipeline with load_lora_weights and that scheduler; beside a 3-step
    CFG text row and a CFG edit row without LoRA, each equals its request alone."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    base, pipe = edit
    save_file(peft_lora(pipe.transformer, seed=5), str(tmp_path / "lightning.safetensors"))
    (tmp_path / "lightning.diffgraph.toml").write_text(SIDECAR)
    with Engine(model="random:qwen-image-edit-tiny", device="cpu", lora_dir=str(tmp_path)) as engine:
        with torch.no_grad():  # as the `edit` fixture's engine (the oracle's modules)
            for p in engine.model.denoiser.parameters():
                if p.ndim == 2:
                    p.mul_(3.0)
        fast = dict(edit_request(IMAGES[:1], seed=4), loras=[("lightning", SCALE)])
        for field in ("num_inference_steps", "guidance_scale"):
            del fast[field]
        requests = [fast, edit_request([], size=(64, 96), steps=3, seed=5), edit_request(IMAGES, seed=6)]
        together = images_together(engine, requests)
        for r, image in zip(requests, together):
            assert np.abs(image - images_together(engine, [r])[0]).max() <= 1
    own = pipe.scheduler
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(**LIGHTNING)
    try:
        want = with_lora(pipe, str(tmp_path / "lightning.safetensors"),
                         lambda: edit_oracle(pipe, PROMPT, IMAGES[:1], (64, 64), 2, 1.0, 4))
    finally:
        pipe.scheduler = own
    assert np.abs(together[0] - want).max() <= 1
    assert np.abs(want - edit_oracle(pipe, PROMPT, IMAGES[:1], (64, 64), 2, 1.0, 4)).max() > 3


def test_schedule_shift_runs_a_fixed_shift_per_row_and_round_trips_through_metadata(folder, qwen_lora, tiny_engine):  # noqa
    """`schedule_shift` 3 (a fixed shift at every size, the terminal kept) on a 3-step unguided row, beside a row of
    the model's own dynamic shift, equals the pipeline with that fixed-shift scheduler; its infotext and JSON carry it
    back (--from-image); an SD model refuses it in one line naming it."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffgraph.image_metadata import infotext, parse_infotext, request_fields
    from diffgraph.models.families.qwen_image import SCHEDULER

    pipe = folder[1]
    shifted = dict(prompt="a red fox", height=64, width=96, num_inference_steps=3, guidance_scale=1.0, seed=3,
                   schedule_shift=3.0)
    got = images_together(qwen_lora, [shifted, dict(shifted, schedule_shift=None, height=96, width=64)])
    own = pipe.scheduler
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(**{**SCHEDULER, "use_dynamic_shifting": False, "shift": 3.0})
    try:
        want = oracle(pipe, "a red fox", (64, 96), 3, 1.0, 3)
    finally:
        pipe.scheduler = own
    assert np.abs(got[0] - want).max() <= 1
    assert np.abs(want - oracle(pipe, "a red fox", (64, 96), 3, 1.0, 3)).max() > 3  # the shifts differ
    assert np.abs(got[1] - oracle(pipe, "a red fox", (96, 64), 3, 1.0, 3)).max() <= 1
    made = GenerationRequest.create(model=qwen_lora.info, **shifted)
    assert parse_infotext(infotext(made, "m"))["schedule_shift"] == 3.0
    assert request_fields(made, "m")["schedule_shift"] == 3.0
    with pytest.raises(ParamError) as e:
        tiny_engine.submit(GenerationRequest.create(model=tiny_engine.info, prompt="x", num_inference_steps=2,
                                                    schedule_shift=3.0)).result()
    assert e.value.param == "schedule_shift" and "\n" not in str(e.value)
