"""AUTOMATIC1111's web API at the HTTP edge: the pydantic models of the `/sdapi/v1/txt2img` and
`/img2img` bodies and of the answers, with AUTOMATIC1111's field names and defaults (v1.10's modules/api/models.py;
tests/fixtures/a1111_api_fields.json is the transcription a test holds them to), and a body read in diffgraph's
words (`plan_body`): the values diffgraph cannot honour refused with a 400 naming the field and what to send
instead, the prompts after the body's `styles` (--styles, prompt_styles.py), the seeds of its images
(AUTOMATIC1111's all_seeds: seed + i, each image its own request), the clip skip, the sampler and scheduler names
(sampling/aliases.py; "Automatic" is the sampler's own schedule, as AUTOMATIC1111 picks it) and `infotext`.

Values are read as AUTOMATIC1111's own models read them: coerced ("3" is 3), unknown keys ignored (named in the answer's
header, `ignored_header`); null is the field's default. Ranges are checked once, by `GenerationRequest.create`, whose ParamErrors `a1111_error` names in AUTOMATIC1111's fields. a1111.py serves these.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass
from datetime import datetime
from importlib.resources import files
from typing import Any, Sequence
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, JsonValue, PrivateAttr, ValidationError

from .. import __version__
from ..image_metadata import A1111_SAMPLERS, A1111_SCHEDULES, MetadataError, infotext_parts, parse_infotext
from ..prompt_styles import StyleBook, StyleError
from ..request import GUIDANCE_NEUTRAL, MAX_IMAGES, MAX_SEED, MAX_SIZE, GenerationRequest, ModelInfo, ParamError
from ..sampling.aliases import canonical
from ..sampling.samplers import ETA_SAMPLERS
from ..api.protocol import APIError, check_prompt_bytes, error_from_validation

A1111_VERSION = "v1.10"  # the AUTOMATIC1111 API these routes follow
MAX_RANDOM_SEED = 4294967294  # AUTOMATIC1111 draws seed -1 below this
SETTINGS_LINE_BYTES = 16384  # an infotext's settings line: AUTOMATIC1111's extensions add keys (hashes, units)
# diffgraph's sampler -> AUTOMATIC1111's aliases and options (its sd_samplers_kdiffusion / _timesteps tables); the
# option "scheduler" is what its "Automatic" scheduler means for the sampler
A1111_SAMPLER_ITEMS = {
    "dpmpp_2m": (["k_dpmpp_2m"], {"scheduler": "karras"}), "dpmpp_sde": (["k_dpmpp_sde"], {"scheduler": "karras"}),
    "dpmpp_2m_sde": (["k_dpmpp_2m_sde"], {"scheduler": "exponential"}),
    "dpmpp_3m_sde": (["k_dpmpp_3m_sde"], {"scheduler": "exponential"}),
    "euler_a": (["k_euler_a", "k_euler_ancestral"], {}), "euler": (["k_euler"], {}), "lms": (["k_lms"], {}),
    "heun": (["k_heun"], {}), "dpm2": (["k_dpm_2"], {}), "dpm2_a": (["k_dpm_2_a"], {}), "ddim": (["ddim"], {}),
    "unipc": (["unipc"], {}), "lcm": (["k_lcm"], {}), "plms": (["plms"], {}),
    "dpmpp_2s_a": (["k_dpmpp_2s_a"], {"scheduler": "karras", "uses_ensd": True, "second_order": True}),
    "dpmpp_2m_sde_heun": (["k_dpmpp_2m_sde_heun"], {"scheduler": "exponential", "solver_type": "heun"}),
    "restart": (["restart"], {"scheduler": "karras", "second_order": True}),
    "dpm_fast": (["k_dpm_fast"], {"uses_ensd": True}), "ddim_cfgpp": (["ddim_cfgpp"], {}),
}
# diffgraph's schedule -> AUTOMATIC1111's scheduler (name, aliases, default_rho, need_inner_model), sd_schedulers.py
A1111_SCHEDULER_ITEMS = {
    "default": ("automatic", None, -1.0, False), "karras": ("karras", None, 7.0, False),
    "exponential": ("exponential", None, -1.0, False), "sgm_uniform": ("sgm_uniform", ["SGMUniform"], -1.0, True),
    "simple": ("simple", None, -1.0, True), "beta": ("beta", None, -1.0, True),
    "uniform": ("uniform", None, -1.0, True), "polyexponential": ("polyexponential", None, 1.0, False),
    "kl_optimal": ("kl_optimal", None, -1.0, False), "align_your_steps": ("align_your_steps", None, -1.0, False),
    "turbo": ("turbo", None, -1.0, True), "ddim_uniform": ("ddim", None, -1.0, True),
}
_SAMPLER_ALIASES = {a.lower(): s for s, (aliases, _) in A1111_SAMPLER_ITEMS.items() for a in aliases}
_SCHEDULER_ALIASES = {a.lower(): s for s, (_, aliases, _, _) in A1111_SCHEDULER_ITEMS.items() for a in aliases or ()}
# eta is AUTOMATIC1111's noise amount of its ancestral and SDE samplers (1 by default: the only one they run here) and
# DDIM's and DDIM CFG++'s (0 by default; any in [0, 1] runs, as diffusers' DDIM eta); the other samplers ignore it
# there, and here
ETA = {"euler_a": 1.0, "dpm2_a": 1.0, "dpmpp_sde": 1.0, "dpmpp_2m_sde": 1.0, "dpmpp_3m_sde": 1.0,
       "dpmpp_2m_sde_heun": 1.0}
# the options a request may override (override_settings) or a key may set (POST /sdapi/v1/options)
# the options a request reads (AUTOMATIC1111's opts): set per key or in override_settings; a body's tiling null is
# the tiling option's
REQUEST_OPTIONS = ("tiling", "eta_noise_seed_delta")
OPTIONS = ("sd_model_checkpoint", "CLIP_stop_at_last_layers", *REQUEST_OPTIONS)
# the web UI's own options: they steer AUTOMATIC1111's browser pages, never what its API makes, so a key's value is
# kept and read back here as there (POST /sdapi/v1/options), with the type of AUTOMATIC1111's default
UI_OPTIONS = ("send_seed", "send_size", "js_modal_lightbox", "js_modal_lightbox_initially_zoomed",
              "js_modal_lightbox_gamepad", "js_modal_lightbox_gamepad_repeat", "show_progress_in_title",
              "samplers_in_dropdown", "dimensions_and_batch_together", "keyedit_precision_attention",
              "keyedit_precision_extra", "keyedit_delimiters", "keyedit_move", "quicksettings_list", "ui_tab_order",
              "hidden_tabs", "ui_reorder_list", "hires_fix_show_sampler", "hires_fix_show_prompts",
              "disable_token_counters", "gallery_height", "localization", "gradio_theme",
              "extra_networks_card_width", "extra_networks_card_height", "extra_networks_card_text_scale",
              "extra_networks_card_show_desc", "ui_extra_networks_tab_reorder", "img2img_editor_height",
              "img2img_sketch_default_brush_color", "img2img_inpaint_mask_brush_color",
              "img2img_inpaint_sketch_default_brush_color", "show_progressbar", "show_progress_grid",
              "do_not_show_images", "hide_samplers")
# /progress's current_image: a live preview every this many steps (AUTOMATIC1111's show_progress_every_n_steps
# default), a PNG at the latent resolution (its "Approx cheap" kind; engine/previews.py)
PREVIEW = {"every": 10, "format": "png"}
# what GET /sdapi/v1/options answers for the options a key has not set: AUTOMATIC1111's defaults
# (a1111_options.json, transcribed from its shared_options.py); the model and CLIP options are filled in by a1111.py
DEFAULT_OPTIONS = {name: value for name, value in
                   json.loads(files(__package__).joinpath("a1111_options.json").read_text("utf-8"))["defaults"].items()
                   if name not in ("sd_model_checkpoint", "CLIP_stop_at_last_layers", "sd_checkpoint_hash")}
# GenerationRequest parameter -> the AUTOMATIC1111 field that carries it
_ENGINE_TO_A1111 = {"sampler": "sampler_name", "schedule": "scheduler", "num_inference_steps": "steps",
                    "guidance_scale": "cfg_scale", "strength": "denoising_strength", "image": "init_images",
                    "num_images": "batch_size", "loras": "prompt",
                    "clip_skip": "override_settings.CLIP_stop_at_last_layers", "variation.subseed": "subseed",
                    "variation.strength": "subseed_strength", "variation.resize_from": "seed_resize_from_w"}


class ProcessingBody(BaseModel):
    """The fields txt2img and img2img share (AUTOMATIC1111's StableDiffusionProcessing and the API's additions)."""

    # AUTOMATIC1111's models (pydantic) ignore keys they do not know and coerce values ("3" for 3, 64.0 for 64,
    # false for 0): so do these; `validate` sets aside the ignored keys' names for the answer's header and the log
    model_config = ConfigDict(extra="allow")
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    prompt: str | None = ""
    negative_prompt: str | None = ""
    styles: list[str] | None = None
    seed: int | None = -1
    subseed: int | None = -1
    subseed_strength: float | None = 0.0
    seed_resize_from_h: int | None = -1
    seed_resize_from_w: int | None = -1
    sampler_name: str | None = None
    scheduler: str | None = None
    batch_size: int | None = 1
    n_iter: int | None = 1
    steps: int | None = 50        # left out: the model's checkpoint default where it has one (`given`)
    cfg_scale: float | None = 7.0  # (as steps)
    width: int | None = 512
    height: int | None = 512
    restore_faces: bool | None = None
    tiling: bool | None = None
    do_not_save_samples: bool | None = False
    do_not_save_grid: bool | None = False
    eta: float | None = None
    s_min_uncond: float | None = None
    s_churn: float | None = None
    s_tmax: float | None = None
    s_tmin: float | None = None
    s_noise: float | None = None
    override_settings: dict[str, JsonValue] | None = None
    override_settings_restore_afterwards: bool | None = True
    refiner_checkpoint: str | None = None
    refiner_switch_at: float | None = None
    disable_extra_networks: bool | None = False
    firstpass_image: str | None = None
    comments: dict[str, JsonValue] | None = None
    force_task_id: str | None = None
    sampler_index: str | None = "Euler"
    script_name: str | None = None
    script_args: list[JsonValue] | None = []
    send_images: bool | None = True
    save_images: bool | None = False
    alwayson_scripts: dict[str, JsonValue] | None = {}
    infotext: str | None = None


class Txt2ImgBody(ProcessingBody):
    """POST /sdapi/v1/txt2img."""

    denoising_strength: float | None = None  # only the hires fix's second pass reads it
    enable_hr: bool | None = False
    firstphase_width: int | None = 0
    firstphase_height: int | None = 0
    hr_scale: float | None = 2.0
    hr_upscaler: str | None = None
    hr_second_pass_steps: int | None = 0
    hr_resize_x: int | None = 0
    hr_resize_y: int | None = 0
    hr_checkpoint_name: str | None = None
    hr_sampler_name: str | None = None
    hr_scheduler: str | None = None
    hr_prompt: str | None = ""
    hr_negative_prompt: str | None = ""


class Img2ImgBody(ProcessingBody):
    """POST /sdapi/v1/img2img: image-to-image, and inpainting with `mask` (white or opaque = repaint)."""

    init_images: list[str] | None = None   # base64 images (a data: URL prefix is allowed)
    resize_mode: int | None = 0            # 0 resize, 1 crop and resize, 2 resize and fill
    denoising_strength: float | None = 0.75
    image_cfg_scale: float | None = None   # instruct-pix2pix models only (none are served here): ignored
    mask: str | None = None
    mask_blur_x: int | None = 4
    mask_blur_y: int | None = 4
    mask_blur: int | None = None           # both blurs at once
    mask_round: bool | None = True
    inpainting_fill: int | None = 0        # 0 fill, 1 original
    inpaint_full_res: bool | int | None = True  # "only masked": the mask's box at full resolution
    inpaint_full_res_padding: int | None = 0
    inpainting_mask_invert: int | None = 0
    initial_noise_multiplier: float | None = None
    latent_mask: str | None = None
    include_init_images: bool | None = False  # echo init_images and mask in `parameters`

    def parameters(self) -> dict[str, Any]:
        """The body as AUTOMATIC1111 echoes it: without include_init_images, and without the images unless asked."""
        out = self.model_dump(exclude={"include_init_images"})
        if not self.include_init_images:
            out["init_images"], out["mask"] = None, None
        return out


class TextToImageResponse(BaseModel):
    images: list[str]           # base64 PNG, with AUTOMATIC1111's `parameters` text chunk
    parameters: dict[str, Any]  # the body, defaults filled in
    info: str                   # JSON: AUTOMATIC1111's Processed.js() (seed, all_seeds, infotexts, ...)
    warnings: list[str] | None = None  # diffgraph's: what was accepted but ignored (left out when nothing was)


class ProgressState(BaseModel):
    skipped: bool = False
    interrupted: bool = False
    stopping_generation: bool = False
    job: str = ""
    job_count: int = 0
    job_timestamp: str = "0"
    job_no: int = 0
    sampling_step: int = 0
    sampling_steps: int = 0


class ProgressResponse(BaseModel):
    progress: float
    eta_relative: float
    state: ProgressState
    current_image: str | None = None  # the current image's latest live preview, base64 PNG (null before the first)
    textinfo: str | None = None


@dataclass(frozen=True)
class Plan:
    """A body in diffgraph's words: what its images share, and the seed of each (one image per request)."""

    model: str | None               # override_settings' sd_model_checkpoint; None: the calling key's default
    prompt: str                     # the prompts after the body's styles (AUTOMATIC1111's p.prompt)
    negative_prompt: str
    create: dict[str, Any]          # GenerationRequest.create keywords every image shares (no seed, no image)
    seeds: tuple[int, ...]          # AUTOMATIC1111's all_seeds
    subseeds: tuple[int, ...]       # its all_subseeds (reported: subseed_strength 0 leaves them unused)
    clip_stop: int                  # CLIP_stop_at_last_layers, AUTOMATIC1111's count (1 = the last layer)
    warnings: tuple[str, ...]       # what was accepted but ignored


SD_UPSCALE = "sd upscale"  # the one script a body may name (img2img; a1111_scripts.py runs it)
IGNORED_HEADER = "X-Diffgraph-Ignored-Fields"  # the body's keys AUTOMATIC1111's models would ignore too
MAX_IGNORED_NAMES, MAX_IGNORED_NAME = 20, 64


def validate(body: Any, model: type[ProcessingBody]) -> ProcessingBody:
    """The body as AUTOMATIC1111 reads it: values coerced, unknown keys set aside (`ignored_header`)."""
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        raise error_from_validation(e, model) from None
    extra = parsed.__pydantic_extra__ or {}
    parsed._ignored = tuple(extra)
    extra.clear()  # neither read nor echoed in `parameters`
    return parsed


def ignored_header(body: ProcessingBody, more: Sequence[str] = ()) -> dict[str, str]:
    """The response header that names the keys the body's model ignored (and `more`: its scripts' ignored keys);
    none when every key was known."""
    return names_header([*body._ignored, *more])


def names_header(names: Sequence[str]) -> dict[str, str]:
    """The IGNORED_HEADER naming `names` (at most MAX_IGNORED_NAMES, each cut to MAX_IGNORED_NAME characters and
    percent-escaped); none for no names."""
    if not names:
        return {}
    shown = [quote(name[:MAX_IGNORED_NAME], safe="") for name in names[:MAX_IGNORED_NAMES]]
    more = len(names) - len(shown)
    return {IGNORED_HEADER: ", ".join(shown) + (f", (+{more} more)" if more else "")}


def model_name(title: str | None) -> str | None:
    """A model name from AUTOMATIC1111's title ("name.safetensors [0123456789]"), name or file name."""
    if title is None:
        return None
    name = title.strip()
    if name.endswith("]") and " [" in name:
        name = name[:name.rindex(" [")]
    return name[:-len(".safetensors")] if name.endswith(".safetensors") else name


def a1111_field(name: str | None) -> str | None:
    """The AUTOMATIC1111 field that carries a GenerationRequest parameter (or an images API field)."""
    return _ENGINE_TO_A1111.get(name or "", {"n": "batch_size", "size": "width"}.get(name or "", name))


def a1111_error(e: ParamError) -> APIError:
    """A request's ParamError as a 400 naming the AUTOMATIC1111 field that carries the parameter."""
    name = e.param or ""
    field = a1111_field(name) or None
    message = str(e)
    if name in _ENGINE_TO_A1111 and message.startswith(name):
        message = field + message[len(name):]
    return APIError(400, message, param=field)


def _refuse(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", param=field, code="unsupported_parameter")


def _enabled(args: Any) -> bool:
    """Whether an alwayson script's args ask it to run (AUTOMATIC1111's scripts take a leading `False`, or units
    with `"enabled": false`, to stay off)."""
    if not isinstance(args, list) or not args or args[0] is False:
        return False
    return any(not (isinstance(a, dict) and a.get("enabled") is False) for a in args)


def check_supported(body: ProcessingBody) -> None:
    """A 400 for each value diffgraph cannot honour (the first found), naming the field and the value that works."""
    get = body.__dict__.get
    off = {"restore_faces": "face restoration (GFPGAN, CodeFormer) is out of scope for diffgraph; send false",
           "disable_extra_networks": "send false, and leave <lora:...> tags out of the prompt instead"}
    for field, why in off.items():
        if get(field):
            raise _refuse(field, why)
    if get("s_churn") or get("s_min_uncond"):
        raise _refuse("s_churn" if get("s_churn") else "s_min_uncond", "not supported; send 0 or null")
    for field, neutral in (("s_noise", 1.0), ("initial_noise_multiplier", 1.0)):
        if get(field) is not None and get(field) != neutral:
            raise _refuse(field, f"only {neutral:g} (the default) is supported; send {neutral:g} or null")
    if get("refiner_checkpoint") not in (None, "", "None"):
        raise _refuse("refiner_checkpoint", "refiners are not supported; send null")
    for field in ("firstpass_image", "latent_mask"):
        if get(field):
            raise _refuse(field, "not supported; send null")
    script = (get("script_name") or "").strip().lower()
    if script and not (script == SD_UPSCALE and isinstance(body, Img2ImgBody)):
        raise _refuse("script_name", f"script {get('script_name')!r} is not available on this route; the scripts here "
                                     "are GET /sdapi/v1/scripts' (img2img: \"sd upscale\"), or send null")
    for name, script in (get("alwayson_scripts") or {}).items():
        args = script.get("args") if isinstance(script, dict) else script
        if _enabled(args) and name.lower() != "controlnet":  # ControlNet units: a1111_controlnet.py
            raise _refuse(f"alwayson_scripts.{name}", f"the {name!r} script is not supported here; leave it out")
    if get("mask_round") is False:
        raise _refuse("mask_round", "masks are rounded to 0 / 1 at the latent size here; send true")
    if get("inpainting_fill") not in (None, 0, 1):
        raise _refuse("inpainting_fill", f"{get('inpainting_fill')} (latent noise / latent nothing) is not supported "
                                         "yet; send 0 (fill) or 1 (original), or denoising_strength 1 to start the "
                                         "masked area from noise")
    if get("resize_mode") not in (None, 0, 1, 2):
        raise _refuse("resize_mode", "allowed: 0 (resize), 1 (crop and resize), 2 (resize and fill)")


def _options(body: ProcessingBody, key_model: str | None, key_clip_stop: int | None,
             clip_skip: int | None) -> tuple[str | None, int]:
    """(the model, CLIP_stop_at_last_layers): override_settings, else the key's options, else the server's."""
    overrides = body.override_settings or {}
    for name, value in overrides.items():
        if name not in OPTIONS and value != DEFAULT_OPTIONS.get(name, object()):
            raise _refuse(f"override_settings.{name}", f"this option cannot be overridden here; the options that "
                                                      f"can: {', '.join(OPTIONS)}")
    model = overrides.get("sd_model_checkpoint", key_model)
    if model is not None and not isinstance(model, str):
        raise APIError(400, "override_settings.sd_model_checkpoint must be a model title (GET /sdapi/v1/sd-models)",
                       param="override_settings.sd_model_checkpoint")
    stop = overrides.get("CLIP_stop_at_last_layers", key_clip_stop)
    return model, clip_stop(stop, "override_settings.CLIP_stop_at_last_layers", clip_skip)


def ui_option(name: str, value: Any) -> Any:
    """A value for the web UI option `name` (UI_OPTIONS) of its default's JSON type (an integer for a number), or an
    APIError naming the option and the type to send."""
    default = DEFAULT_OPTIONS[name]
    kind = type(default)
    fits = (isinstance(value, bool) if kind is bool else
            isinstance(value, (int, float)) and not isinstance(value, bool) if kind in (int, float) else
            isinstance(value, kind))
    if not fits:
        names = {bool: "true or false", int: "a number", float: "a number", str: "a string", list: "a list"}
        raise APIError(400, f"{name} must be {names.get(kind, kind.__name__)} (AUTOMATIC1111's default is "
                            f"{json.dumps(default)}), got {json.dumps(value)[:64]}", param=name)
    return value


def clip_stop(value: Any, field: str, clip_skip: int | None = None) -> int:
    """A CLIP_stop_at_last_layers value (1 = the last layer, 12 = the first); None: the server's --clip-skip."""
    if value is None:
        return 1 + (clip_skip or 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or not 1 <= value <= 12:
        raise APIError(400, f"{field} must be an integer in 1..12 (1 = the last CLIP layer, 2 = the one before), got "
                            f"{value!r}", param=field)
    return int(value)


def infotext_limit(max_prompt_bytes: int) -> int:
    """The most UTF-8 bytes an `infotext` field may hold: its prompt and negative prompt (each within
    --max-prompt-bytes) and its settings line."""
    return 2 * max_prompt_bytes + SETTINGS_LINE_BYTES


def _apply_infotext(body: ProcessingBody, max_prompt_bytes: int | None) -> None:
    """AUTOMATIC1111's `infotext` field: the settings it holds fill the fields the body does not set. Its size is
    checked before it is read."""
    text = body.infotext or ""
    if max_prompt_bytes is not None:
        size, limit = len(text.encode("utf-8", errors="surrogatepass")), infotext_limit(max_prompt_bytes)
        if size > limit:
            raise APIError(400, f"infotext has {size} bytes (UTF-8); the limit is {limit} (twice --max-prompt-bytes, "
                                f"for its prompt and negative prompt, and {SETTINGS_LINE_BYTES} for its settings "
                                "line): send a shorter infotext, or its settings as the body's fields",
                           param="infotext")
    try:
        fields = parse_infotext(text)
    except MetadataError as e:
        raise APIError(400, f"infotext: {e}", param="infotext") from None
    names = {"prompt": "prompt", "negative_prompt": "negative_prompt", "sampler": "sampler_name",
             "schedule": "scheduler", "num_inference_steps": "steps", "guidance_scale": "cfg_scale", "seed": "seed",
             "width": "width", "height": "height", "strength": "denoising_strength", "eta": "eta", "tiling": "tiling"}
    if fields.get("hires") and fields["hires"]["strength"] is not None:  # the hires pass's denoising_strength
        fields["strength"] = fields["hires"]["strength"]
    for ours, field in names.items():
        if fields.get(ours) is not None and field not in body.model_fields_set and field in type(body).model_fields:
            setattr(body, field, fields[ours])
    _apply_variation(body, fields.get("variation"))
    if fields.get("clip_skip") and "CLIP_stop_at_last_layers" not in (body.override_settings or {}):
        body.override_settings = {**(body.override_settings or {}), "CLIP_stop_at_last_layers": fields["clip_skip"] + 1}
    if fields.get("noise_seed_delta") and "eta_noise_seed_delta" not in (body.override_settings or {}):
        body.override_settings = {**(body.override_settings or {}), "eta_noise_seed_delta": fields["noise_seed_delta"]}
    if isinstance(body, Txt2ImgBody):
        _apply_hires(body, infotext_parts(text)[2])


def _apply_variation(body: ProcessingBody, variation: dict[str, Any] | None) -> None:
    """An infotext's variation seed entries fill subseed, subseed_strength and seed_resize_from_w/h where the body
    does not set them."""
    if not variation:
        return
    width, height = variation["resize_from"] or (None, None)
    values = {"subseed": variation["subseed"] if variation["strength"] else None,
              "subseed_strength": variation["strength"], "seed_resize_from_w": width, "seed_resize_from_h": height}
    for field, value in values.items():
        if value is not None and field not in body.model_fields_set:
            setattr(body, field, value)


# the hires fix's infotext entries (a1111_hires.py writes them) -> the txt2img fields they fill
HIRES_ENTRIES = {"Hires upscale": ("hr_scale", float), "Hires steps": ("hr_second_pass_steps", int),
                 "Hires upscaler": ("hr_upscaler", str), "Hires sampler": ("hr_sampler_name", str),
                 "Hires schedule type": ("hr_scheduler", str),
                 "Hires prompt": ("hr_prompt", str), "Hires negative prompt": ("hr_negative_prompt", str)}


def _apply_hires(body: Txt2ImgBody, params: dict[str, str]) -> None:
    """An infotext's hires entries (AUTOMATIC1111 pastes them the same way): enable_hr where it has "Hires upscale"
    or "Hires resize", and the hr_* fields the body does not set."""
    values: dict[str, Any] = {}
    try:
        for entry, (field, kind) in HIRES_ENTRIES.items():
            if entry in params:
                values[field] = kind(params[entry])
        if "Hires resize" in params:
            values["hr_resize_x"], values["hr_resize_y"] = (int(v) for v in params["Hires resize"].split("x", 1))
    except ValueError:
        raise APIError(400, "infotext: its Hires entries hold a value that is not a number; send the hr_* fields "
                            "instead", param="infotext") from None
    if "Hires upscale" in params or "Hires resize" in params:
        values["enable_hr"] = True
    for field, value in values.items():
        if field not in body.model_fields_set:
            setattr(body, field, value)


def _styled(body: ProcessingBody, styles: StyleBook | None,
            max_prompt_bytes: int | None) -> tuple[str, str, list[str]]:
    """(prompt, negative prompt, warnings) after the body's styles, applied in order from `styles` (--styles); a name
    not there is skipped with a warning, as AUTOMATIC1111 skips it."""
    prompt, negative = body.prompt or "", body.negative_prompt or ""
    if not body.styles:
        return prompt, negative, []
    if styles is None:
        return prompt, negative, [f"styles {body.styles} were ignored: this server has no styles file (--styles)"]
    try:
        prompt, negative, unknown = styles.apply(prompt, negative, body.styles, max_prompt_bytes)
    except StyleError as e:
        raise APIError(400, str(e), param="styles") from None
    return prompt, negative, [f"styles {list(unknown)} were ignored: not in the styles file (GET "
                              "/sdapi/v1/prompt-styles lists its styles)"] if unknown else []


def request_option(name: str, value: Any, field: str) -> Any:
    """A value for the request option `name` (REQUEST_OPTIONS): tiling true or false, eta_noise_seed_delta an
    integer 0..MAX_SEED (a whole float read as one); an APIError naming `field` otherwise."""
    if name == "tiling":
        if not isinstance(value, bool):
            raise APIError(400, f"{field} must be true or false, got {json.dumps(value)[:64]}", param=field)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) \
            or not 0 <= value <= MAX_SEED:
        raise APIError(400, f"{field} must be an integer in 0..{MAX_SEED} (0: off), got {json.dumps(value)[:64]}",
                       param=field)
    return int(value)


def _request_options(body: ProcessingBody, key_options: dict[str, Any] | None) -> dict[str, Any]:
    """The request options' values: override_settings', else the key's (`key_options`), else the defaults."""
    values = {**{name: DEFAULT_OPTIONS[name] for name in REQUEST_OPTIONS}, **(key_options or {})}
    for name, value in (body.override_settings or {}).items():
        if name in REQUEST_OPTIONS:
            values[name] = request_option(name, value, f"override_settings.{name}")
    return values


def plan_body(body: ProcessingBody, key_model: str | None, key_clip_stop: int | None, clip_skip: int | None,
              max_prompt_bytes: int | None = None, styles: StyleBook | None = None,
              key_options: dict[str, Any] | None = None) -> Plan:
    """The body's plan (APIError 400 for what cannot be honoured; ranges are GenerationRequest.create's); a `tiling`
    null and the ENSD are the options' (`_request_options`; `key_options`: the key's), as AUTOMATIC1111's. With
    `max_prompt_bytes` (--max-prompt-bytes) the infotext and the prompts are held to it before they are parsed, and so
    are the prompts the body's styles (`styles`, --styles) make of them, which every later reader takes. Pure CPU work
    on user text: the routes call it on a worker thread."""
    if body.infotext:
        _apply_infotext(body, max_prompt_bytes)
    if max_prompt_bytes is not None:
        check_prompt_bytes(max_prompt_bytes, prompt=body.prompt, negative_prompt=body.negative_prompt)
    check_supported(body)
    prompt, negative, warnings = _styled(body, styles, max_prompt_bytes)
    if body.save_images:
        warnings.append("save_images was ignored: this server does not keep images; save the ones it returns")
    batch_size = 1 if body.batch_size is None else body.batch_size
    n_iter = 1 if body.n_iter is None else body.n_iter
    for field, value in (("batch_size", batch_size), ("n_iter", n_iter)):
        if value < 1:
            raise APIError(400, f"{field} {value} is out of range; it must be at least 1", param=field)
    count = batch_size * n_iter
    if count > MAX_IMAGES:
        raise APIError(400, f"batch_size x n_iter is {count} images; at most {MAX_IMAGES} per request here: send "
                            "several requests", param="n_iter")
    seed = -1 if body.seed is None else body.seed
    if seed < -1 or seed + count - 1 > MAX_SEED:
        raise APIError(400, f"seed {seed} is out of range; allowed: -1 (random) or 0..{MAX_SEED - count + 1}",
                       param="seed")
    seed = secrets.randbelow(MAX_RANDOM_SEED) if seed == -1 else seed
    subseed = -1 if body.subseed is None else body.subseed
    subseed = secrets.randbelow(MAX_RANDOM_SEED) if subseed == -1 else subseed
    model, stop = _options(body, key_model, key_clip_stop, clip_skip)
    variation = _variation(body, subseed)
    options = _request_options(body, key_options)
    tiling = body.tiling if body.tiling is not None else options["tiling"]
    create = dict(negative_prompt=negative or None,
                  width=512 if body.width is None else body.width, height=512 if body.height is None else body.height,
                  num_inference_steps=given(body, "steps"), guidance_scale=given(body, "cfg_scale"), num_images=1,
                  output_format="png", prompt_syntax="a1111", clip_skip=stop - 1 or None, preview=dict(PREVIEW),
                  **({"variation": variation} if variation else {}), **({"tiling": True} if tiling else {}),
                  **({"noise_seed_delta": options["eta_noise_seed_delta"]} if options["eta_noise_seed_delta"] else {}))
    return Plan(model=model, prompt=prompt, negative_prompt=negative, create=create,
                seeds=tuple(seed + i for i in range(count)), subseeds=tuple(subseed + i for i in range(count)),
                clip_stop=stop, warnings=tuple(warnings))


def _variation(body: ProcessingBody, subseed: int) -> dict[str, Any] | None:
    """The first image's variation seed (GenerationRequest.create's `variation`) from subseed_strength and
    seed_resize_from_w/h (each image's subseed: `Plan.subseeds`); None: the seed's noise alone. -1 and 0 leave the
    noise's size alone, as in AUTOMATIC1111, which resizes only where both are above 0."""
    strength = 0.0 if body.subseed_strength is None else body.subseed_strength
    if not 0 <= strength <= 1:  # NaN fails this too
        raise APIError(400, f"subseed_strength {strength} is out of range; allowed: a number in [0, 1] (0: the seed "
                            "alone makes the image)", param="subseed_strength")
    sides = {}
    for field in ("seed_resize_from_w", "seed_resize_from_h"):
        value = -1 if getattr(body, field) is None else getattr(body, field)
        if value < -1 or value > MAX_SIZE:
            raise APIError(400, f"{field} {value} is out of range; allowed: -1 or 0 (no resize) or 1..{MAX_SIZE}",
                           param=field)
        sides[field] = value
    resize = (sides["seed_resize_from_w"], sides["seed_resize_from_h"]) if min(sides.values()) > 0 else None
    if strength == 0 and resize is None:
        return None
    if not 0 <= subseed <= MAX_SEED:
        raise APIError(400, f"subseed {subseed} is out of range; allowed: -1 (random) or 0..{MAX_SEED}",
                       param="subseed")
    return {"subseed": subseed, "strength": strength, "resize_from": resize}


def given(body: ProcessingBody, name: str) -> Any:
    """The body's value of field `name` where the client sent one (not null), else None (the model decides)."""
    value = getattr(body, name)
    return value if name in body.model_fields_set and value is not None else None


def fit_to_model(plan: Plan, info: ModelInfo) -> Plan:
    """The plan without what the model cannot honour, each named in a warning: AUTOMATIC1111 and Forge ignore the
    parameters of classifier-free guidance on a model that runs none, and cfg_scale on one that runs no guidance at
    all (step-distilled; the images API refuses them). Steps and cfg_scale the body left out: the model's checkpoint
    defaults where it has them, else AUTOMATIC1111's 50 and 7."""
    checkpoint = info.default_steps is not None
    plan = dataclasses.replace(plan, create={
        **plan.create,
        "num_inference_steps": plan.create["num_inference_steps"] if plan.create["num_inference_steps"] is not None
        else (info.default_steps if checkpoint else 50),
        "guidance_scale": plan.create["guidance_scale"] if plan.create["guidance_scale"] is not None else (
            info.default_guidance if checkpoint else 7.0)})
    if plan.create.get("prompt_syntax", "plain") not in info.prompt_syntaxes:  # AUTOMATIC1111's syntax: CLIP's
        plan = dataclasses.replace(plan, create={**plan.create, "prompt_syntax": "plain"}, warnings=plan.warnings + (
            f"the prompt is read as plain text: model {info.name!r} does not read AUTOMATIC1111's prompt syntax",))
    if not (unused := info.unread_guidance(plan.create)):
        return plan
    return dataclasses.replace(plan, create={**plan.create, **{name: GUIDANCE_NEUTRAL[name] for name in unused}},
                               warnings=plan.warnings + tuple(
                                   f"{'cfg_scale' if name == 'guidance_scale' else name} was ignored: model "
                                   f"{info.name!r} runs no classifier-free guidance ({info.guidance} guidance)"
                                   for name in unused))


def sampler_schedule(body: ProcessingBody, info: ModelInfo) -> tuple[str, str | None, float | None]:
    """(sampler, schedule, eta) in the model family's names: sampler_name (else the deprecated sampler_index, else
    Euler) and scheduler, where "Automatic" (or none) is the sampler's own schedule as AUTOMATIC1111 picks it
    (DPM++ 2M: Karras) and otherwise the model's; DDIM's eta (None: 0). Raises APIError naming the field."""
    label = body.sampler_name or body.sampler_index or "Euler"
    label = _SAMPLER_ALIASES.get(label.strip().lower(), label)  # the aliases GET /sdapi/v1/samplers lists
    automatic = not (body.scheduler or "").strip() or body.scheduler.strip().lower() == "automatic"  # "": as A1111
    scheduler = _SCHEDULER_ALIASES.get((body.scheduler or "").strip().lower(), body.scheduler)
    try:  # a label may name its schedule ("DPM++ 2M Karras"); else "Automatic" is the sampler's own default
        sampler, schedule = canonical(label, None if automatic else scheduler, info.samplers, info.schedules)
    except ParamError as e:
        raise a1111_error(e) from None
    if automatic and schedule is None:
        picked = A1111_SAMPLER_ITEMS.get(sampler, ([], {}))[1].get("scheduler")
        schedule = picked if picked in info.schedules else None
    eta = ETA.get(sampler)
    if body.eta is not None and eta is not None and body.eta != eta and sampler not in ETA_SAMPLERS:
        label = A1111_SAMPLERS.get(sampler, sampler)
        raise _refuse("eta", f"{label} runs with eta {eta:g} here (AUTOMATIC1111's default for it); send eta "
                             f"{eta:g} or null")
    return sampler, schedule, body.eta if sampler in ETA_SAMPLERS else None


def sampler_items(info: ModelInfo) -> list[dict[str, Any]]:
    """GET /sdapi/v1/samplers: the family's samplers by AUTOMATIC1111's labels (its own name where it has none)."""
    return [{"name": A1111_SAMPLERS.get(s, s), "aliases": A1111_SAMPLER_ITEMS.get(s, ([s], {}))[0],
             "options": A1111_SAMPLER_ITEMS.get(s, ([], {}))[1]} for s in info.samplers]


def scheduler_items(info: ModelInfo) -> list[dict[str, Any]]:
    """GET /sdapi/v1/schedulers: the family's schedules by AUTOMATIC1111's names and labels."""
    out = []
    for s in info.schedules:
        name, aliases, rho, inner = A1111_SCHEDULER_ITEMS.get(s, (s, None, -1.0, False))
        out.append({"name": name, "label": A1111_SCHEDULES.get(s, s), "aliases": aliases, "default_rho": rho,
                    "need_inner_model": inner})
    return out


def info_json(body: ProcessingBody, plan: Plan, first: GenerationRequest, model: str, texts: list[str],
          extra: dict[str, Any]) -> str:
    """AUTOMATIC1111's `info`: its Processed.js() fields, as JSON text."""
    count = len(plan.seeds)
    return json.dumps({
        "prompt": first.prompt, "all_prompts": [first.prompt] * count, "negative_prompt": plan.negative_prompt,
        "all_negative_prompts": [plan.negative_prompt] * count, "seed": plan.seeds[0],
        "all_seeds": list(plan.seeds), "subseed": plan.subseeds[0], "all_subseeds": list(plan.subseeds),
        "subseed_strength": body.subseed_strength or 0, "width": first.width, "height": first.height,
        "sampler_name": A1111_SAMPLERS.get(first.sampler, first.sampler), "cfg_scale": first.guidance_scale,
        "steps": first.num_inference_steps, "batch_size": body.batch_size or 1,
        "restore_faces": bool(body.restore_faces),  # AUTOMATIC1111's: null is its option's value, false here
        "face_restoration_model": None, "sd_model_name": model, "sd_model_hash": first.model_hash, "sd_vae_name": None,
        "sd_vae_hash": None, "seed_resize_from_w": body.seed_resize_from_w,
        "seed_resize_from_h": body.seed_resize_from_h,
        "denoising_strength": body.denoising_strength, "extra_generation_params": extra, "index_of_first_image": 0,
        "infotexts": texts, "styles": body.styles or [], "job_timestamp": datetime.now().strftime("%Y%m%d%H%M%S"),
        "clip_skip": plan.clip_stop, "is_using_inpainting_conditioning": False, "version": f"diffgraph {__version__}"})
