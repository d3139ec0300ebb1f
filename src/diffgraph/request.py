"""Generation requests (validated once) and the models they are built for (`ModelInfo`); the capability inputs a
request carries are request_inputs.py's, what comes back (events, results, errors) results.py's: both re-exported here.

This is the one request object from validation to delivery: the HTTP edge, the CLI and the Python facade
build a `GenerationRequest` (`create(...)` draws a seed and applies the model's defaults; every construction,
`dataclasses.replace` included, is checked), the scheduler wraps it in its per-request state, and the result
carries it back. Every parameter error is a `ParamError(ValueError)` whose `param` names the parameter as
spelled here, so the HTTP layer maps it to its body field and the CLI to its flag without re-checking.
Everything here is plain picklable data (no tensors, no futures), so a request crosses a process boundary
unchanged (its inputs and its results too). Sizes are (height, width) inside; "WxH" strings exist only at the edges.
"""


from __future__ import annotations

import math
import re
import secrets
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ParamError
from .sampling.names import CFGPP_SAMPLERS, DEFAULT_SAMPLER, DEFAULT_SCHEDULE, SAMPLERS, SCHEDULES, TIMESTEP_SPACINGS
from .sampling.aliases import canonical, closest
from .sampling.schedules import MAX_STEPS
from .request_inputs import (CONTROL_FIELDS, CONTROL_MODES, CONTROL_PREPROCESSORS, EDIT_STEP_RULES,  # noqa: F401
                             MAX_CONTROL_PIXELS, MAX_CONTROL_SCALE, MAX_CONTROLS, MAX_EDIT_PIXELS,
                             MAX_IMAGE_PROMPT_SCALE, MAX_LORA_SCALE, MAX_LORAS, MAX_PROMPT_IMAGES, MAX_SEED, MAX_SIZE,
                             MIN_SIZE, PREVIEW_FORMATS, RESIZE_MODES, ControlInput, EditInput, ImagePromptInput,
                             PreviewSpec, Variation, check_controls, check_image_prompt, check_int, check_interval,
                             check_loras, make_preview, make_variation, shown)
from .results import (EngineClosed, EngineStepError, GenerationResult, ProgressEvent, QueueFullError,  # noqa: F401
                      RequestAborted)


Size = tuple[int, int]  # (height, width) in pixels: a request's image
# the group a request's rows run in (step buffers, steps, graphs), chosen by the model's family from the size: a pair
# of ints, the size itself for UNet families, (0, image tokens) for a transformer family's token bucket; a UNet's
# tiling rows (`GenerationRequest.tiling`) run in (height, width, TILING): their own group, graphs and decodes. The
# first two entries are the resolution the family reads and the graphs are addressed by (`key[:2]`)
GroupKey = tuple
TILING = "tiling"
DEFAULT_STEPS = 20       # the steps of a request that names none, on a model without a checkpoint default
SIZE_MULTIPLE = 8        # every request's sizes (an SD VAE's latent grid); a family may ask for more (size_multiple)
MAX_IMAGES = 16
MAX_GUIDANCE = 100.0
# the fields a request may leave to its model (`GenerationRequest.defaulted`), in `create`'s order
DEFAULTABLE = ("schedule", "num_inference_steps", "guidance_scale", "schedule_shift")
MAX_SHIFT = 100.0  # schedule_shift (SD3's and Flux's fixed shifts are 3; dynamic ones reach e^1.15)
OUTPUT_FORMATS = ("png", "jpeg", "webp")
PROMPT_SYNTAXES = ("plain", "a1111")  # diffusers' plain text (truncated at 77 tokens); AUTOMATIC1111's syntax
EMPHASES = ("original", "no_norm")    # AUTOMATIC1111's emphasis modes: weights then mean restored, or weights only
PRIORITIES = ("interactive", "batch")     # scheduling classes: people first, job items in what they leave free
MAX_CLIP_SKIP = 11                    # CLIP ViT-L has 12 layers (the model's own count is checked at submit)
MAX_PROMPT_CHARS = 20_000
_HASH = re.compile(r"[0-9a-fA-F]{1,64}")  # a file hash as an infotext shows it
MAX_PROMPT_CHUNKS = 4                 # the buffers hold lcm(1..max) windows per row: 12 at 4, 60 at 5 or 6


def _new_id() -> str:
    return f"req-{secrets.token_hex(8)}"


def _nearest_multiples(value: int, base: int = SIZE_MULTIPLE) -> str:
    """The valid sizes next to `value`: multiples of `base` inside MIN_SIZE..MAX_SIZE."""
    low = min(max((value // base) * base, MIN_SIZE), MAX_SIZE)
    high = min(low + base, MAX_SIZE)
    return f"{low} or {high}" if MIN_SIZE <= value <= MAX_SIZE and high != low else f"{low}"


def area_size(area: int, ratio: float, multiple: int = 32) -> tuple[int, int]:
    """(width, height) of about `area` pixels at aspect ratio `ratio` (width / height), each side rounded to
    `multiple` (the Qwen-Image-Edit pipelines' `calculate_dimensions`)."""
    width = math.sqrt(area * ratio)
    return round(width / multiple) * multiple, round(width / ratio / multiple) * multiple


def _size_of_inputs(model: "ModelInfo", extras: Any) -> tuple[int | None, int | None]:
    """The size of an output that names none on a model that sizes it from the last of its input images
    (`ModelInfo.edit_images_area`): that image's aspect ratio at the area, within MAX_SIZE; (None, None) without one
    (a value the capability refuses stays for it to refuse)."""
    images = extras.get(model.edit_images) if isinstance(extras, dict) and model.edit_images_area else None
    last = images[-1] if isinstance(images, (list, tuple)) and images else None
    shape = getattr(last, "size", None) if not isinstance(last, np.ndarray) else last.shape[1::-1]
    if not isinstance(shape, tuple) or len(shape) != 2 or not all(isinstance(v, (int, np.integer)) and v > 0
                                                                  for v in shape):
        return None, None
    width, height = area_size(model.edit_images_area, shape[0] / shape[1])
    scale = min(1.0, MAX_SIZE / max(width, height))  # a wide image's output at the largest size that keeps it
    fit = (lambda v: max(MIN_SIZE, int(v * scale) // 32 * 32)) if scale < 1 else (lambda v: max(MIN_SIZE, v))
    return fit(width), fit(height)


def _check_size(name: str, value: Any, base: int = SIZE_MULTIPLE) -> int:
    """A width or height: an integer in MIN_SIZE..MAX_SIZE, a multiple of `base` (a family's size multiple)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ParamError(name, f"{name} must be an integer number of pixels, got {shown(value)}")
    value = int(value)
    if not MIN_SIZE - base < value < MAX_SIZE + base:
        raise ParamError(name, f"{name} {shown(value)} is outside the supported range {MIN_SIZE}..{MAX_SIZE} "
                               f"(multiples of {base})")
    if value % base:
        raise ParamError(name, f"{name} {value} is not a multiple of {base}; use {_nearest_multiples(value, base)}")
    if not MIN_SIZE <= value <= MAX_SIZE:
        raise ParamError(name, f"{name} {value} is outside the supported range {MIN_SIZE}..{MAX_SIZE} "
                               f"(multiples of {base})")
    return value


def check_family_params(sampler: str, schedule: str, key: GroupKey, samplers: tuple[str, ...] = SAMPLERS,
                        schedules: tuple[str, ...] = SCHEDULES, size_multiple: int = SIZE_MULTIPLE,
                        family: str | None = None) -> None:
    """What a model family takes: one of its samplers and schedules, sizes in multiples of its size multiple.
    A ParamError names the parameter and lists what the family allows. The family adapter checks with its own
    lists (`FamilyAdapter.check`), a request built for a model with its `ModelInfo`'s, and one built without a model
    with the built-in families' (sampling/names.py)."""
    whose = f" (the {{}} of model family {family!r})" if family else ""
    if sampler not in samplers:
        raise ParamError("sampler", f"sampler {shown(sampler)} is unknown; allowed: {', '.join(samplers)}"
                                    + whose.format("samplers") + closest(sampler, samplers))
    if schedule not in schedules:
        raise ParamError("schedule", f"schedule {shown(schedule)} is unknown; allowed: {', '.join(schedules)}"
                                     + whose.format("schedules") + closest(schedule, schedules))
    for name, value in (("width", key[1]), ("height", key[0])):
        _check_size(name, value, size_multiple)


def require_prompt(prompt: str, image: Any = None) -> None:
    """ParamError for an empty prompt without an input `image` (an EditInput, or its pixels), where the caller asks for one (OpenAI's generations
    route, the CLI). A request itself takes an empty prompt, as AUTOMATIC1111 and diffusers do: the image of the empty
    prompt's conditioning."""
    if not prompt.strip() and image is None:
        raise ParamError("prompt", "prompt is empty; describe the image to generate")


def tiling_refusal(family: str) -> str:
    """Why a family without convolutions to pad refuses `tiling` (one line)."""
    return (f"tiling is not supported by model family {family!r}: its denoiser is a transformer over latent tokens, "
            "with no convolutions to pad circularly; send tiling false")


@dataclass(frozen=True)
class GenerationRequest:
    """One user request: `num_images` rows that share prompt, size, sampler and one seeded generator. Its prompt may
    be empty (`require_prompt` is for the callers that ask for one)."""

    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    sampler: str
    schedule: str
    seed: int
    num_images: int
    output_format: str | None = None  # "png" | "jpeg" | "webp": also return encoded bytes
    request_id: str = field(default_factory=_new_id)
    edit: EditInput | None = None     # image-to-image / inpainting input; None: text-to-image
    loras: tuple[tuple[str, float], ...] = ()  # (adapter name, scale) pairs, at most MAX_LORAS
    # classifier-free guidance only for steps i of N with lo <= i / N < hi (Kynkaanniemi et al., 2024); None: all
    guidance_interval: tuple[float, float] | None = None
    guidance_rescale: float = 0.0  # diffusers' rescaled CFG (zero-SNR / v-prediction models), 0 = off
    # how the prompts are read: "plain" (diffusers: 77 tokens, no weights) or "a1111" (AUTOMATIC1111's emphasis,
    # 75-token chunks, BREAK, embeddings by name, <lora:name:scale> tags: text/)
    prompt_syntax: str = "plain"
    clip_skip: int | None = None   # diffusers' numbering: None = the last layer, 1 = the penultimate
    emphasis: str = "original"     # a1111 syntax: "original" restores the chunk's mean after weighting, "no_norm" not
    # the sampler's timestep spacing ("leading", "linspace", "trailing"); None: the model's scheduler config's
    timestep_spacing: str | None = None
    eta: float | None = None       # TCD's gamma or DDIM's eta (stochasticity, 0..1); None: 0.3 / 0, the defaults
    # a flow-matching family's time shift in place of its schedule's own at every size (sigma' = s sigma / (1 + (s - 1)
    # sigma), exp(mu) of a dynamic shift: 3 is the Lightning LoRAs' mu = log 3); None: the schedule's own
    schedule_shift: float | None = None
    preview: PreviewSpec | None = None  # live previews in its progress events (None: none)
    # the scheduling class: "interactive" rows go first and may take batch rows' slots at a step boundary; "batch"
    # rows (a job's items) fill what interactive rows leave free, shared fairly by `share` (a job's API key), then by
    # `job` within a share
    priority: str = "interactive"
    job: str | None = None
    share: str | None = None
    controls: tuple[ControlInput, ...] = ()  # ControlNet controls (ControlInput), at most MAX_CONTROLS
    image_prompts: ImagePromptInput | None = None  # an IP-Adapter image prompt
    # JPEG / WebP compression, OpenAI's `output_compression`: 0..100 (100: the least), None: the encoder's 95 quality
    output_compression: int | None = None
    # the registered capabilities' parameters (features/capability.py), (name, value) pairs: the engine checks them
    extras: tuple[tuple[str, Any], ...] = ()
    # AUTOMATIC1111's short hashes of the files it uses, written into its images' infotext (`Model hash`, `Lora
    # hashes`): the server fills them where it resolves the files (models/file_hashes.py); None / (): not written
    model_hash: str | None = None
    lora_hashes: tuple[tuple[str, str], ...] = ()  # (an adapter's name as the prompt names it, its short hash)
    # its result also carries its final latents (`GenerationResult.latents`: the hires fix's latent upscale reads them)
    return_latents: bool = False
    # a hires fix's second pass: the first pass's steps, from which its a1111 prompt schedules count (AUTOMATIC1111's
    # rule: a step number counts from the first pass's start, a fraction from 1.0); None: not a second pass
    hires_of: int | None = None
    # AUTOMATIC1111's variation seed (Variation): changes only the initial noise; None: the seed's noise alone
    variation: Variation | None = None
    # AUTOMATIC1111's tiling: every convolution of the denoiser and the VAE pads circularly, so the image wraps
    # around its edges (a seamless texture); its rows run in a group of their own (`TILING` in the group key)
    tiling: bool = False
    # AUTOMATIC1111's eta_noise_seed_delta (ENSD): the noise a sampler draws after the initial noise comes from a
    # generator seeded with seed + this (0: the seed's own generator goes on)
    noise_seed_delta: int = 0
    # the fields `create` filled from the model's defaults (of DEFAULTABLE): the engine may fill them from what the
    # request's files recommend instead (a LoRA's sidecar: its schedule, steps, guidance), before it plans the request
    defaulted: tuple[str, ...] = ()
    # its image size, (height, width): derived, a plain attribute (read on every hop); the engine groups rows by the
    # family's key for it (`FamilyAdapter.group_key`)
    key: Size = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Every construction is checked (also `dataclasses.replace` and direct calls), and the numbers are
        stored as plain Python ints and floats."""
        self._check_prompts()
        self._check_sampler_options()
        self._check_handling()
        guidance = self._checked_guidance()
        self._check_names_and_output()
        self._store_checked_numbers(guidance)
        self._check_conditioning()
        self._check_edit()

    def _check_prompts(self) -> None:
        """The prompts (strings of valid text, not too long), how they are read, and the clip skip."""
        prompt, negative_prompt = self.prompt, self.negative_prompt
        if not isinstance(prompt, str):
            raise ParamError("prompt", f"prompt must be a string, got {type(prompt).__name__}")
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            raise ParamError("negative_prompt",
                             f"negative_prompt must be a string or None, got {type(negative_prompt).__name__}")
        for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt or "")):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ParamError(name, f"{name} is not valid text: it holds an unpaired surrogate at character "
                                       f"{e.start}; send UTF-8 text") from None
        for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt or "")):
            if len(text) > MAX_PROMPT_CHARS:
                raise ParamError(name, f"{name} has {len(text)} characters; at most {MAX_PROMPT_CHARS}")
        if self.prompt_syntax not in PROMPT_SYNTAXES:
            raise ParamError("prompt_syntax", f"prompt_syntax {shown(self.prompt_syntax)} is unknown; allowed: "
                                              f"{', '.join(PROMPT_SYNTAXES)}")
        if self.emphasis not in EMPHASES:
            raise ParamError("emphasis", f"emphasis {shown(self.emphasis)} is unknown; allowed: {', '.join(EMPHASES)}")
        if self.clip_skip is not None:
            object.__setattr__(self, "clip_skip", check_int("clip_skip", self.clip_skip, 0, MAX_CLIP_SKIP))

    def _check_sampler_options(self) -> None:
        """The sampler's timestep spacing, noise amount (eta) and a flow schedule's shift."""
        if self.timestep_spacing is not None and self.timestep_spacing not in TIMESTEP_SPACINGS:
            raise ParamError("timestep_spacing", f"timestep_spacing {shown(self.timestep_spacing)} is unknown; allowed: "
                                                 f"{', '.join(TIMESTEP_SPACINGS)} (or leave it out: the model's own)")
        if self.eta is not None:
            eta = self.eta
            if isinstance(eta, bool) or not isinstance(eta, (int, float, np.floating, np.integer)) \
                    or not 0 <= float(eta) <= 1:  # NaN fails this too
                raise ParamError("eta", f"eta {shown(eta)} is out of range; allowed: a number in [0, 1] (TCD's gamma, "
                                        "DDIM's eta)")
            object.__setattr__(self, "eta", float(eta))
        shift = self.schedule_shift
        if shift is not None:
            if isinstance(shift, bool) or not isinstance(shift, (int, float, np.floating, np.integer)) \
                    or not 0 < float(shift) <= MAX_SHIFT:  # NaN fails this too
                raise ParamError("schedule_shift", f"schedule_shift {shown(shift)} is out of range; allowed: a number "
                                                   f"above 0, at most {MAX_SHIFT:g} (or leave it out: the schedule's)")
            object.__setattr__(self, "schedule_shift", float(shift))

    def _check_handling(self) -> None:
        """How the request is handled: returned latents, priority, its job and share, previews."""
        if not isinstance(self.return_latents, bool):
            raise ParamError("return_latents", f"return_latents must be true or false, got {shown(self.return_latents)}")
        if not isinstance(self.tiling, bool):
            raise ParamError("tiling", f"tiling must be true or false, got {shown(self.tiling)}")
        if not isinstance(self.defaulted, tuple) or not set(self.defaulted) <= set(DEFAULTABLE):
            raise ParamError("defaulted", f"defaulted must be a tuple of {', '.join(DEFAULTABLE)}, got "
                                          f"{shown(self.defaulted)}")
        object.__setattr__(self, "noise_seed_delta", check_int("noise_seed_delta", self.noise_seed_delta, 0,
                                                                MAX_SEED))
        if self.hires_of is not None and (isinstance(self.hires_of, bool) or not isinstance(self.hires_of, int)
                                          or not 1 <= self.hires_of <= 10_000):
            raise ParamError("hires_of", f"hires_of {shown(self.hires_of)} must be the first pass's steps (1 or more)")
        if self.priority not in PRIORITIES:
            raise ParamError("priority", f"priority {shown(self.priority)} is unknown; allowed: {', '.join(PRIORITIES)}")
        if self.job is not None and (not isinstance(self.job, str) or not self.job):
            raise ParamError("job", f"job must be a non-empty string (a job id) or None, got {shown(self.job)}")
        if self.share is not None and (not isinstance(self.share, str) or not self.share):
            raise ParamError("share", f"share must be a non-empty string (who the job is for) or None, got "
                                      f"{shown(self.share)}")
        if self.preview is not None and not isinstance(self.preview, PreviewSpec):
            raise ParamError("preview", f"preview must be a PreviewSpec, got {type(self.preview).__name__}")

    def _checked_guidance(self) -> float:
        """The guidance scale as a float, refused unless a number in 0..MAX_GUIDANCE."""
        guidance_scale = self.guidance_scale
        if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float, np.floating, np.integer)):
            raise ParamError("guidance_scale", f"guidance_scale must be a number >= 0, got {shown(guidance_scale)}")
        try:
            guidance = float(guidance_scale)
        except OverflowError:  # an int too large for a float
            guidance = math.inf
        if not (0 <= guidance <= MAX_GUIDANCE):  # NaN fails this too
            raise ParamError("guidance_scale",
                             f"guidance_scale {shown(guidance_scale)} is out of range; allowed: 0..{MAX_GUIDANCE:g}")
        return guidance

    def _check_names_and_output(self) -> None:
        """The sampler and schedule names, the output format and compression, the request id."""
        for name in ("sampler", "schedule"):  # which names exist is the model family's to say (create, the planner)
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ParamError(name, f"{name} must be a {name} name, got {shown(getattr(self, name))}")
        if self.output_compression is not None:
            object.__setattr__(self, "output_compression", check_int("output_compression", self.output_compression,
                                                                      0, 100))
        if self.output_format is not None and self.output_format not in OUTPUT_FORMATS:
            raise ParamError("output_format", f"output_format {shown(self.output_format)} is unknown; allowed: "
                                              f"{', '.join(OUTPUT_FORMATS)}")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ParamError("request_id", f"request_id must be a non-empty string, got {self.request_id!r}")

    def _store_checked_numbers(self, guidance: float) -> None:
        """The size, steps, guidance, seed and image count stored as checked plain numbers, and the size key."""
        checked = {"width": _check_size("width", self.width), "height": _check_size("height", self.height),
                   "num_inference_steps": check_int("num_inference_steps", self.num_inference_steps, 1, MAX_STEPS),
                   "guidance_scale": guidance, "seed": check_int("seed", self.seed, 0, MAX_SEED),
                   "num_images": check_int("num_images", self.num_images, 1, MAX_IMAGES)}
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "key", (self.height, self.width))

    def _check_conditioning(self) -> None:
        """The adapters, controls, image prompts, guidance interval, file hashes and guidance rescale."""
        object.__setattr__(self, "loras", check_loras(self.loras))
        object.__setattr__(self, "controls", check_controls(self.controls))
        object.__setattr__(self, "image_prompts", check_image_prompt(self.image_prompts))
        object.__setattr__(self, "guidance_interval", check_interval(self.guidance_interval))
        _check_hashes(self.model_hash, self.lora_hashes)
        if self.variation is not None and not isinstance(self.variation, Variation):
            raise ParamError("variation", f"variation must be a Variation, got {type(self.variation).__name__}")
        rescale = self.guidance_rescale
        if isinstance(rescale, bool) or not isinstance(rescale, (int, float, np.floating, np.integer)) \
                or not 0 <= float(rescale) <= 1:  # NaN fails this too
            raise ParamError("guidance_rescale", f"guidance_rescale {shown(rescale)} is out of range; allowed: a "
                                                 "number in [0, 1] (0.7 is diffusers' suggestion for zero-SNR models)")
        object.__setattr__(self, "guidance_rescale", float(rescale))

    def _check_edit(self) -> None:
        """An edit's input, and that its strength leaves at least one denoising step."""
        if self.edit is not None:
            if not isinstance(self.edit, EditInput):
                raise ParamError("image", f"edit must be an EditInput, got {type(self.edit).__name__}")
            steps, strength = self.num_inference_steps, self.edit.strength
            if self.edit.denoising_steps(steps) < 1:  # diffusers' rule: the steps the strength leaves
                raise ParamError("strength", f"strength {strength:g} with num_inference_steps {steps} leaves no "
                                             f"denoising step (int({steps} * {strength:g}) = 0); raise strength or "
                                             "num_inference_steps")

    @property
    def denoising_steps(self) -> int:
        """The steps this request runs: all of them, or an edit's share (diffusers' strength rule)."""
        if self.edit is None:
            return self.num_inference_steps
        return self.edit.denoising_steps(self.num_inference_steps)

    @classmethod
    def create(cls, prompt: Any, *, negative_prompt: Any = None, width: Any = None, height: Any = None,
               num_inference_steps: Any = None, guidance_scale: Any = None, sampler: Any = None,
               schedule: Any = None, seed: Any = None, num_images: Any = 1, output_format: Any = None,
               request_id: str | None = None, model: "ModelInfo | None" = None, image: Any = None,
               mask_image: Any = None, strength: Any = None, loras: Any = (), guidance_interval: Any = None,
               guidance_rescale: Any = 0.0, prompt_syntax: Any = "plain", clip_skip: Any = None,
               emphasis: Any = "original", timestep_spacing: Any = None, eta: Any = None,
               preview: Any = None, controls: Any = (), image_prompts: Any = None,
               output_compression: Any = None, extras: Any = None,
               return_latents: Any = False, variation: Any = None, tiling: Any = False,
               noise_seed_delta: Any = 0, schedule_shift: Any = None) -> "GenerationRequest":
        """A request from user parameters: a random seed when none is given, the model's native size, guidance,
        sampler and schedule where those are not given, every value checked (the sampler, schedule and size against
        the model's family, `num_images` against the engine's rows; without a model, against the built-in
        families'). With `image` (PIL image or uint8 RGB array) it is an image-to-image request, with `mask_image`
        too an inpainting one; without width/height the output takes the image's size rounded down to the family's
        size multiple (diffusers' rule), and strength defaults to the model's (diffusers' pipelines: 0.8 / 0.3 for
        SDXL image-to-image, 1.0 / 0.9999 for SDXL inpainting). With `prompt_syntax="a1111"`, the prompts'
        `<lora:name:scale>` tags join `loras` (after the listed ones). `preview`: a PreviewSpec, a dict of its
        fields ({"every": 2, "format": "jpeg"}) or None. `extras`: the registered capabilities' parameters by
        name (a dict; the engine checks and prepares them at submit). `return_latents`: the result carries the final
        latents too (`GenerationResult.latents`); an `EditInput` with `latents` (and width, height) starts from
        such latents (the hires fix: hires.py). `variation`: a Variation or a dict of its fields. `tiling`: circular
        padding in the denoiser's and the VAE's convolutions (a UNet family's; AUTOMATIC1111's tiling).
        `noise_seed_delta`: AUTOMATIC1111's eta_noise_seed_delta (the sampler's later noise from seed + it).
        `schedule_shift`: a flow-matching model's time shift at every size in place of its schedule's. The
        schedule, steps, guidance and shift left out are listed in `defaulted`: the engine runs what the request's
        LoRA sidecars declare for them, else the model's defaults written here."""
        multiple = model.size_multiple if model is not None else SIZE_MULTIPLE
        edit, width, height = _edit_of(image, mask_image, strength, model, width, height, multiple)
        if model is None and (width is None or height is None or guidance_scale is None):
            raise ParamError(None, "width, height and guidance_scale are needed when no model gives defaults")
        if seed is None:
            seed = secrets.randbelow(2**31)
        kwargs = {} if request_id is None else {"request_id": str(request_id)}
        if width is None and height is None and model is not None:  # sized from its input images, where the family is
            width, height = _size_of_inputs(model, extras)
        width = model.native_size if width is None else width
        height = model.native_size if height is None else height
        for name, value in (("width", width), ("height", height)):  # the family's words first (its multiple)
            _check_size(name, value, multiple)
        sampler, schedule = _canonical_names(model, sampler, schedule)
        defaulted = tuple(f for f, v in zip(DEFAULTABLE, (schedule, num_inference_steps, guidance_scale,
                                                          schedule_shift)) if v is None)
        sampler, schedule, num_inference_steps = _sampling_defaults(model, sampler, schedule, num_inference_steps)
        request = cls(prompt=prompt, negative_prompt=negative_prompt, width=width, height=height,
                      num_inference_steps=num_inference_steps,
                      guidance_scale=model.default_guidance if guidance_scale is None else guidance_scale,
                      sampler=sampler, schedule=schedule, seed=seed, num_images=num_images,
                      output_format=output_format, edit=edit, loras=loras, guidance_interval=guidance_interval,
                      guidance_rescale=guidance_rescale, prompt_syntax=prompt_syntax, clip_skip=clip_skip,
                      emphasis=emphasis, timestep_spacing=timestep_spacing, eta=eta,
                      preview=make_preview(preview), controls=controls, image_prompts=image_prompts,
                      output_compression=output_compression, extras=_extras(extras, model),
                      return_latents=return_latents, variation=make_variation(variation), tiling=tiling,
                      noise_seed_delta=noise_seed_delta, schedule_shift=schedule_shift, defaulted=defaulted,
                      **kwargs)
        if request.prompt_syntax == "a1111":
            tagged = prompt_loras(request)
            if tagged:
                try:
                    request = dataclasses.replace(request, loras=request.loras + tagged)
                except ParamError as e:  # the tags' adapters, checked with the listed ones: name what was written
                    if e.param != "loras":
                        raise
                    raise ParamError("prompt", f"the prompt's <lora:...> tags: {e}") from None
        if model is None:
            check_family_params(request.sampler, request.schedule, request.key)
        else:
            model.check(request.sampler, request.schedule, request.key)
            model.check_request(request)
            if request.num_images > model.max_rows:
                raise ParamError("num_images", f"num_images {request.num_images} exceeds this engine's largest "
                                               f"batch bucket {model.max_rows}")
        return request


def _canonical_names(model: "ModelInfo | None", sampler: Any, schedule: Any) -> tuple[Any, Any]:
    """The names people type (AUTOMATIC1111's labels, ComfyUI's) as the family's own names (a label's schedule)."""
    names = (model.samplers, model.schedules) if model is not None else (SAMPLERS, SCHEDULES)
    if (sampler is not None and sampler not in names[0]) or (schedule is not None and schedule not in names[1]):
        return canonical(sampler, schedule, *names)
    return sampler, schedule


def _sampling_defaults(model: "ModelInfo | None", sampler: Any, schedule: Any, steps: Any) -> tuple[Any, Any, Any]:
    """(sampler, schedule, steps) with the model's defaults (else the built-in ones) where they are None."""
    if sampler is None:
        sampler = model.default_sampler if model is not None else DEFAULT_SAMPLER
    if schedule is None:
        schedule = model.default_schedule if model is not None else DEFAULT_SCHEDULE
    if steps is None:
        steps = model.default_steps if model is not None and model.default_steps else DEFAULT_STEPS
    return sampler, schedule, steps


def _edit_of(image: Any, mask_image: Any, strength: Any, model: "ModelInfo | None", width: Any, height: Any,
             multiple: int) -> tuple[EditInput | None, Any, Any]:
    """(the EditInput of `create`'s image arguments or None, width, height): without width/height, the image's size
    rounded down to `multiple`; an edit from latents must give them."""
    edit = None
    if isinstance(image, EditInput):  # already checked (the HTTP edge builds it from the form)
        edit = image
    elif image is not None:
        edit = make_edit(image, mask_image, strength, model)
    if edit is None:
        if mask_image is not None or strength is not None:
            raise ParamError("image", "mask_image and strength need an image: give image= (image-to-image) or "
                                      "image= and mask_image= (inpainting)")
        return None, width, height
    if model is not None and edit.steps_rule != model.edit_steps_rule:
        edit = dataclasses.replace(edit, steps_rule=model.edit_steps_rule)
    if edit.latents is not None and (width is None or height is None):
        raise ParamError("width", "an edit from latents needs width and height: the size they decode to")
    h, w = edit.image.shape[:2] if edit.latents is None else (height, width)
    return edit, w - w % multiple if width is None else width, h - h % multiple if height is None else height


def _check_hashes(model_hash: Any, lora_hashes: Any) -> None:
    if model_hash is not None and not (isinstance(model_hash, str) and _HASH.fullmatch(model_hash)):
        raise ParamError("model_hash", f"model_hash must be hex digits or None, got {shown(model_hash)}")
    if not isinstance(lora_hashes, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], str)
            and _HASH.fullmatch(p[1]) for p in lora_hashes):
        raise ParamError("lora_hashes", "lora_hashes must be a tuple of (adapter name, hex digits) pairs")


def prompt_loras(request: GenerationRequest) -> tuple[tuple[str, float], ...]:
    """The `<lora:name:scale>` tags of an a1111-syntax request's prompt and negative prompt (ParamError naming the
    prompt whose syntax is wrong, in any text of its schedule: prompt editing, alternation)."""
    from .prompt_syntax import schedule_a1111  # pure Python, and only a1111-syntax requests need it

    steps = request.num_inference_steps
    tags = schedule_a1111(request.prompt, "prompt", steps)[0][2].loras
    if request.negative_prompt is not None:
        tags += schedule_a1111(request.negative_prompt, "negative_prompt", steps)[0][2].loras
    return tags


def _pixels(value: Any, name: str, mode: str) -> np.ndarray:
    """A PIL image or a uint8 array as a uint8 array in `mode` (RGB: [H, W, 3], L: [H, W])."""
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8:
            raise ParamError(name, f"{name} must hold uint8 pixels (0..255), got an array of {value.dtype}")
        if mode == "L" and value.ndim == 3 and value.shape[2] in (1, 3):
            value = value[..., 0] if value.shape[2] == 1 else np.asarray(_pil(value).convert("L"))
        return np.ascontiguousarray(value)
    if hasattr(value, "convert") and hasattr(value, "size"):  # a PIL image: converted as diffusers' processor does
        return np.asarray(value.convert(mode))
    raise ParamError(name, f"{name} must be a PIL image or a uint8 numpy array, got {type(value).__name__}")


def _pil(array: np.ndarray) -> Any:
    from PIL import Image
    return Image.fromarray(array)


def make_edit(image: Any, mask_image: Any = None, strength: Any = None, model: "ModelInfo | None" = None) -> EditInput:
    """The EditInput of user arguments; strength defaults to the model's for the task."""
    if strength is None:
        defaults = model.edit_strength if model is not None else (0.8, 1.0)
        strength = defaults[1] if mask_image is not None else defaults[0]
    mask = None if mask_image is None else _pixels(mask_image, "mask", "L")
    return EditInput(image=_pixels(image, "image", "RGB"), mask=mask, strength=strength)


@dataclass(frozen=True)
class ModelInfo:
    """What an engine client tells about the model it serves (the defaults requests are built with)."""

    name: str
    family: str
    native_size: int
    default_guidance: float
    max_rows: int        # the largest batch bucket: the most images one request may ask for
    mode: str            # "graph" | "eager"
    device: str
    ready_s: float = 0.0  # load to ready (prewarm graphs captured), seconds
    edit_strength: tuple[float, float] = (0.8, 1.0)  # default strength: (image-to-image, inpainting)
    edits: bool = True   # takes image-to-image and inpainting requests
    # the family's names and sizes (FamilyAdapter: samplers, schedules, defaults, size multiple)
    samplers: tuple[str, ...] = SAMPLERS
    schedules: tuple[str, ...] = SCHEDULES
    default_sampler: str = DEFAULT_SAMPLER
    default_schedule: str = DEFAULT_SCHEDULE
    size_multiple: int = SIZE_MULTIPLE
    # how the model guides: "cfg" (a second denoiser branch for the negative prompt), "embedded" (the value goes
    # into the denoiser: guidance-distilled models) or "none"
    guidance: str = "cfg"
    prompt_syntaxes: tuple[str, ...] = PROMPT_SYNTAXES  # the prompt syntaxes its text side reads
    # the registered capabilities (features/capability.py) this model has, and every registered capability's
    # parameter names (the server passes them on; the engine refuses those of capabilities the model lacks)
    extensions: tuple[str, ...] = ()
    extension_params: tuple[str, ...] = ()
    extension_images: tuple[str, ...] = ()  # those of its capabilities that take a list of images (`Param.images`)
    # (name, most items, what they are called) of those with a limit (`Param.limit`)
    image_limits: tuple[tuple[str, int, str], ...] = ()
    # the values its capabilities give a request that names none (a server default such as `--step-cache auto`)
    extension_defaults: tuple[tuple[str, Any], ...] = ()
    edit_images: str | None = None  # the one the edits route's image parts fill (None: the first is the edit's start)
    # an output that names no size: the aspect ratio of the last of its `edit_images` at this many pixels of area
    # (Qwen-Image-Edit's pipelines: 1024 x 1024); 0: the native size
    edit_images_area: int = 0
    # the steps a request that names none runs (its checkpoint's model card); None: each route's own default
    default_steps: int | None = None
    edit_steps_rule: str = "sd"  # EDIT_STEP_RULES: how an edit's strength picks its steps (its family's pipelines)
    tiling: bool = True  # takes tiling requests (circular padding: a UNet family's convolutions)

    @property
    def capabilities(self) -> tuple[str, ...]:
        """What requests may ask of this model beyond a prompt, as `GET /v1/models` lists it."""
        guidance = {"cfg": ("classifier_free_guidance",), "embedded": ("embedded_guidance",)}.get(self.guidance, ())
        return guidance + (("edits",) if self.edits else ()) + self.extensions

    def check(self, sampler: str, schedule: str, key: GroupKey) -> None:
        """ParamError unless the model's family takes this sampler, schedule and size."""
        check_family_params(sampler, schedule, key, self.samplers, self.schedules, self.size_multiple, self.family)

    def check_request(self, request: "GenerationRequest") -> None:
        """ParamError naming the first parameter this model cannot honour (beyond its sampler and size: `check`)."""
        self.check_guidance(request)
        if request.sampler in CFGPP_SAMPLERS and self.guidance != "cfg":
            raise ParamError("sampler", f"sampler {request.sampler!r} steps along classifier-free guidance's "
                                        f"unconditional branch, which model {self.name!r} does not run "
                                        f"({self.guidance} guidance); use 'ddim'")
        if request.tiling and not self.tiling:
            raise ParamError("tiling", tiling_refusal(self.family))
        if request.prompt_syntax not in self.prompt_syntaxes:
            raise ParamError("prompt_syntax", f"prompt_syntax {request.prompt_syntax!r} is not read by model "
                                              f"{self.name!r}; allowed: {', '.join(self.prompt_syntaxes)}")

    def check_guidance(self, request: "GenerationRequest") -> None:
        """ParamError naming the first parameter this model's guidance does not read (`unread_guidance`)."""
        for name in self.unread_guidance(request):
            if name == "guidance_scale":
                raise ParamError(name, f"guidance_scale {request.guidance_scale:g} is not read: model {self.name!r} "
                                       "is step-distilled and runs no guidance; leave guidance_scale out (or 1)")
            raise ParamError(name, f"{name} needs classifier-free guidance, which model {self.name!r} does not run "
                                   f"({self.guidance} guidance); leave {name} out")

    def unread_guidance(self, params: "GenerationRequest | dict[str, Any]") -> tuple[str, ...]:
        """The parameters (of a request, or `create` keywords) off their neutral values (`GUIDANCE_NEUTRAL`) that this
        model's guidance does not read: classifier-free guidance's on a model without it (an empty negative prompt,
        no interval and rescale 0 are neutral), and a guidance_scale other than 1 on one that runs none."""
        unread = () if self.guidance == "cfg" else cfg_params_used(params)
        scale = params.get("guidance_scale") if isinstance(params, dict) else params.guidance_scale
        if self.guidance == "none" and scale is not None and scale != GUIDANCE_NEUTRAL["guidance_scale"]:
            unread += ("guidance_scale",)
        return unread


def _extras(extras: Any, model: "ModelInfo | None") -> tuple[tuple[str, Any], ...]:
    """A request's capability parameters as (name, value) pairs, the model's defaults (`extension_defaults`) for
    those it names none of (None names none); a name no registered capability has is a ParamError naming it (the
    values are the engine's to check)."""
    defaults = dict(model.extension_defaults) if model is not None else {}
    if not extras:
        return tuple(sorted(defaults.items()))
    if not isinstance(extras, dict) or not all(isinstance(k, str) for k in extras):
        raise ParamError("extras", "extras must be a dict of capability parameters by name")
    known = model.extension_params if model is not None else ()
    for name in extras:
        if model is not None and name not in known:
            raise ParamError(name, f"{name} is not a parameter of model {model.name!r}; leave it out")
    return tuple(sorted({**defaults, **{k: v for k, v in extras.items() if v is not None}}.items()))


# the parameters only classifier-free guidance reads, with their neutral values (accepted on any model)
CFG_NEUTRAL: dict[str, Any] = {"negative_prompt": None, "guidance_interval": None, "guidance_rescale": 0.0}
# and guidance_scale's, the only one a model that runs no guidance accepts
GUIDANCE_NEUTRAL: dict[str, Any] = {**CFG_NEUTRAL, "guidance_scale": 1.0}


def cfg_params_used(params: "GenerationRequest | dict[str, Any]") -> tuple[str, ...]:
    """The parameters (of a request, or `create` keywords) off their neutral values that only classifier-free
    guidance reads (a blank negative prompt is neutral)."""
    def value(name: str) -> Any:
        got = params.get(name, CFG_NEUTRAL[name]) if isinstance(params, dict) else getattr(params, name)
        return None if name == "negative_prompt" and not (got or "").strip() else got
    return tuple(name for name, neutral in CFG_NEUTRAL.items() if value(name) != neutral)
