"""AUTOMATIC1111's hires fix on POST /sdapi/v1/txt2img (`enable_hr`), over hires.py: the body's hr_* fields read
(`hires_plan`: a 400 naming the field for what cannot run, before anything is submitted), the second pass's template
request built with hr_prompt / hr_negative_prompt / hr_sampler_name / hr_scheduler (`hires_template`), each image's
second pass submitted to the same engine as soon as its first pass finishes (`HiresRuns`: it batches with whatever
else runs), and its image written with AUTOMATIC1111's infotext entries (`hires_image`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from ..api.protocol import APIError
from ..hires import (DEFAULT_STRENGTH, HIRES_UPSCALERS, HiresFix, builtin_upscaler, first_pass, hires_params,
                     hires_size, second_pass, second_pass_steps)
from ..image_metadata import JSON_KEY, PNG_KEY, infotext, request_json
from ..request import MAX_SIZE, MIN_SIZE, GenerationRequest, GenerationResult, ModelInfo, ParamError
from ..sampling.schedules import MAX_STEPS
from ..upscalers import ModelUpscalers, UpscalerError
from .a1111_jobs import ImageRun
from .a1111_protocol import Plan, Txt2ImgBody

SAME = ("", "use same sampler", "use same scheduler", "use same checkpoint")  # the web UI's "same as the first"
# the first pass's fields and the hires fix's, for the errors of its template request
HR_FIELDS = {"sampler_name": "hr_sampler_name", "scheduler": "hr_scheduler", "prompt": "hr_prompt",
             "negative_prompt": "hr_negative_prompt"}


@dataclass(frozen=True)
class HiresPlan:
    """A body's hires fix: the second pass's size and start (`fix`), its infotext entries, its family's edit rule."""

    fix: HiresFix
    params: dict[str, Any]
    rule: str


def _same(value: str | None) -> bool:
    return value is None or value.strip().lower() in SAME


def _refuse(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", param=field, code="unsupported_parameter")


def _check_model(body: Txt2ImgBody, info: ModelInfo) -> None:
    """A 400 naming enable_hr (or the field) where this model or body cannot run a second pass."""
    if not info.edits or info.edit_images is not None:
        how = f"reads init images as {info.edit_images}" if info.edit_images else "takes no image inputs"
        raise _refuse("enable_hr", f"model {info.name!r} {how}, and the hires fix's second pass starts from the "
                                   "first pass's image; send enable_hr false (and upscale with "
                                   "/sdapi/v1/extra-single-image)")
    if body.firstphase_width or body.firstphase_height:
        field = "firstphase_width" if body.firstphase_width else "firstphase_height"
        raise _refuse(field, "the old hires API is not supported; send 0, with width and height the first pass's "
                             "size and hr_scale or hr_resize_x / hr_resize_y the second's")
    if not _same(body.hr_checkpoint_name):
        raise _refuse("hr_checkpoint_name", "a second checkpoint for the hires pass is not supported; send null")


def _upscaler(name: str | None, models: ModelUpscalers | None) -> str:
    """The hires upscaler `name` names: a latent mode, a built-in or one of `models` (looked up in its folder)."""
    known = builtin_upscaler(name)
    if known is not None:
        return known
    try:
        found = models.find((name or "").strip(), "hr_upscaler") if models is not None else None
    except UpscalerError as e:  # a pickle
        raise APIError(400, str(e), param="hr_upscaler") from None
    if found is not None:
        return found
    names = HIRES_UPSCALERS + (tuple(models.names()) if models is not None else ())
    raise _refuse("hr_upscaler", f"upscaler {name!r} is not available here; send one of "
                                 f"{', '.join(names)} (GET /sdapi/v1/latent-upscale-modes, /upscalers)")


def _strength(body: Txt2ImgBody) -> tuple[float, list[str]]:
    """(the second pass's denoising strength, warnings): null is AUTOMATIC1111's hires default, 0.7; 0 (a first
    pass's value, sent by clients that send every field) is read as that too, with a warning."""
    value = body.denoising_strength
    if value is None:
        return DEFAULT_STRENGTH, []
    if value == 0:
        return DEFAULT_STRENGTH, [f"denoising_strength 0 was read as {DEFAULT_STRENGTH:g}: the hires fix's second "
                                  "pass needs a strength in (0, 1]"]
    if not 0 < value <= 1:
        raise APIError(400, f"denoising_strength {value:g} is out of range; the hires fix's second pass takes a "
                            "number in (0, 1]", param="denoising_strength")
    return float(value), []


def _size(body: Txt2ImgBody, plan: Plan, info: ModelInfo,
          max_pixels: int | None) -> tuple[tuple[int, int], tuple[int, int], str]:
    """(the second pass's size, the size it is resized to before its cut, the field that set it)."""
    rx, ry, scale = body.hr_resize_x or 0, body.hr_resize_y or 0, 2.0 if body.hr_scale is None else body.hr_scale
    field = "hr_resize_x" if rx else "hr_resize_y" if ry else "hr_scale"
    if rx < 0 or ry < 0:
        raise APIError(400, f"{field} {min(rx, ry)} is out of range; send a size in pixels, or 0 to scale by "
                            "hr_scale", param=field)
    if field == "hr_scale" and not scale > 1:
        raise APIError(400, f"hr_scale {scale:g} does not enlarge the image; send a scale above 1, or "
                            "hr_resize_x / hr_resize_y", param="hr_scale")
    width, height = plan.create["width"], plan.create["height"]
    size, cover = hires_size(width, height, scale, rx, ry, info.size_multiple)
    biggest = max(*size, *cover)
    if min(size) < MIN_SIZE or biggest > MAX_SIZE or (max_pixels is not None and cover[0] * cover[1] > max_pixels):
        limit = f", at most {max_pixels} pixels an image" if max_pixels is not None else ""
        raise APIError(400, f"{field} makes a {size[0]}x{size[1]} second pass (resized from {cover[0]}x{cover[1]}); "
                            f"this server takes sides of {MIN_SIZE}..{MAX_SIZE} pixels{limit}: send a smaller "
                            f"{field}", param=field)
    return size, cover, field


def hires_plan(body: Txt2ImgBody, plan: Plan, info: ModelInfo, max_pixels: int | None,
               models: ModelUpscalers | None = None) -> tuple[HiresPlan, Plan]:
    """The body's hires fix (its fields checked: a 400 naming the field; `models`: the model upscalers hr_upscaler
    may name, looked up in their folder: a worker thread) and the plan with its warnings."""
    _check_model(body, info)
    upscaler = _upscaler(body.hr_upscaler, models)
    strength, warnings = _strength(body)
    steps = body.hr_second_pass_steps or 0
    if not 0 <= steps <= MAX_STEPS:
        raise APIError(400, f"hr_second_pass_steps {steps} is out of range; allowed: 0 (the first pass's steps) .. "
                            f"{MAX_STEPS}", param="hr_second_pass_steps")
    try:
        second_pass_steps(steps or plan.create["num_inference_steps"], strength, info.edit_steps_rule)
    except ParamError as e:
        raise APIError(400, str(e), param=e.param) from None
    size, cover, field = _size(body, plan, info, max_pixels)
    fix = HiresFix(size[0], size[1], upscaler, strength, steps, cover)
    resize = (body.hr_resize_x or 0, body.hr_resize_y or 0) if field != "hr_scale" else None
    params = hires_params(fix, 2.0 if body.hr_scale is None else body.hr_scale, resize, steps, body.hr_upscaler)
    if not _same(body.hr_sampler_name) and body.hr_sampler_name != body.sampler_name:
        params["Hires sampler"] = body.hr_sampler_name
    if not _same(body.hr_scheduler) and body.hr_scheduler != body.scheduler:
        params["Hires schedule type"] = body.hr_scheduler
    for name, label in (("hr_prompt", "Hires prompt"), ("hr_negative_prompt", "Hires negative prompt")):
        if getattr(body, name) and getattr(body, name) != getattr(body, name[3:]):
            params[label] = getattr(body, name)
    return HiresPlan(fix, params, info.edit_steps_rule), dataclasses.replace(plan, warnings=plan.warnings + tuple(
        warnings))


def hires_template(build: Callable[[Txt2ImgBody, Plan], list[GenerationRequest]], body: Txt2ImgBody,
                   plan: Plan) -> GenerationRequest:
    """The second pass's template request (`build`: the route's, on a worker thread): the first pass's but for
    hr_prompt, hr_negative_prompt, hr_sampler_name and hr_scheduler where given; a 400 names the hr field."""
    changes = {}
    if not _same(body.hr_sampler_name):
        changes.update(sampler_name=body.hr_sampler_name, sampler_index=None)
    if not _same(body.hr_scheduler):
        changes["scheduler"] = body.hr_scheduler
    hr_body = body.model_copy(update=changes)
    negative = body.hr_negative_prompt or plan.negative_prompt
    hr_plan = dataclasses.replace(plan, prompt=body.hr_prompt or plan.prompt, negative_prompt=negative,
                                  seeds=plan.seeds[:1], create={**plan.create, "negative_prompt": negative or None})
    try:
        return build(hr_body, hr_plan)[0]
    except APIError as e:
        if e.param in HR_FIELDS and (changes or body.hr_prompt or body.hr_negative_prompt):
            first, e.param = e.param, HR_FIELDS[e.param]
            e.message = e.param + e.message[len(first):] if e.message.startswith(first) else f"{e.param}: {e.message}"
        raise


def first_passes(requests: list[GenerationRequest], hires: HiresPlan) -> list[GenerationRequest]:
    return [first_pass(r, hires.fix) for r in requests]


class HiresRuns:
    """Each image's two passes: its first pass's result awaited (`wait`), its second pass built (a worker thread)
    and submitted (`submit`) into the same `ImageRun` (so /progress, /interrupt and /skip follow it), then awaited."""

    def __init__(self, hires: HiresPlan, template: GenerationRequest,
                 submit: Callable[[GenerationRequest], Awaitable[Any]],
                 wait: Callable[[ImageRun], Awaitable[GenerationResult | None]], abort: Callable[[Any], None],
                 models: ModelUpscalers | None = None):
        self.hires, self.template, self.submit, self.wait, self.abort = hires, template, submit, wait, abort
        self.models = models  # the model upscalers the fix may name

    async def run(self, run: ImageRun) -> GenerationResult | None:
        first = await self.wait(run)
        if first is None:
            return None
        run.finished = False  # open again, for /interrupt and /skip, until its second pass ends
        template = dataclasses.replace(self.template, seed=first.request.seed)
        try:
            request = await asyncio.to_thread(second_pass, template, first, self.hires.fix, 0, self.hires.rule,
                                              self.models)
        except ParamError as e:
            raise APIError(400, f"the hires pass: {e}", param=e.param if e.param == "hr_upscaler" else
                           "enable_hr") from None
        if run.dropped:
            return None
        handle = await self.submit(request)
        run.handle, run.step, run.total, run.preview = handle, 0, request.denoising_steps, None
        if run.dropped:  # interrupted while it was submitted
            self.abort(handle)
            return None
        return await self.wait(run)


def hires_image(result: GenerationResult, first: GenerationRequest, hires: HiresPlan, model: str,
                metadata: bool) -> tuple[bytes, str]:
    """(the second pass's PNG with the first pass's infotext and the hires entries as its parameters, that text)."""
    text = infotext(first, model, hires.params)
    data = result.encoded[0]
    if not metadata:
        return data, text
    chunks = PngInfo()
    chunks.add_text(PNG_KEY, text)
    chunks.add_text(JSON_KEY, request_json(first, model))
    out = io.BytesIO()
    Image.open(io.BytesIO(data)).save(out, format="PNG", pnginfo=chunks)
    return out.getvalue(), text
