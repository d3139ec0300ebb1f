"""The settings inside every image diffgraph encodes, and reading them back.

PNG: two tEXt chunks. `parameters` holds AUTOMATIC1111's infotext, as its `create_infotext` writes it (the prompt,
`Negative prompt: ...` when there is one, then one line of `Key: value` pairs), so its "PNG info" tab, civitai and
the other tools that read that chunk show the settings; `diffgraph` holds the exact request as JSON (every field
needed to re-create it, the model's name and a format version). JPEG and WebP: the same infotext in EXIF
UserComment (0x9286, "UNICODE\\0" then UTF-16 big-endian, as AUTOMATIC1111 writes it through piexif), and the JSON
in EXIF MakerNote (0x927C, the field EXIF leaves to the writer's own data), prefixed b"diffgraph\\0".

`read_request` reads either back into `GenerationRequest.create` keyword arguments (plus "model"): the JSON where
there is one, else the infotext parsed. An edit's strength is kept; its input image is not embedded.
Pure Python and Pillow: the CLI reads images with it before torch is imported.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from .request import GenerationRequest

FORMAT_VERSION = 1
PNG_KEY, JSON_KEY = "parameters", "diffgraph"
EXIF_IFD, USER_COMMENT, MAKER_NOTE = 0x8769, 0x9286, 0x927C
MAKER_PREFIX = b"diffgraph\0"

# diffgraph's names -> AUTOMATIC1111's display names (sampling/names.py lists ours)
A1111_SAMPLERS = {"euler": "Euler", "euler_a": "Euler a", "dpmpp_2m": "DPM++ 2M", "ddim": "DDIM",
                  "dpmpp_2m_sde": "DPM++ 2M SDE", "dpmpp_3m_sde": "DPM++ 3M SDE", "dpmpp_sde": "DPM++ SDE", "heun": "Heun", "dpm2": "DPM2",
                  "dpm2_a": "DPM2 a", "lms": "LMS", "unipc": "UniPC", "lcm": "LCM", "plms": "PLMS",
                  "dpmpp_2s_a": "DPM++ 2S a", "dpmpp_2m_sde_heun": "DPM++ 2M SDE Heun", "restart": "Restart",
                  "dpm_fast": "DPM fast", "ddim_cfgpp": "DDIM CFG++"}
DDIM_ETA = ("ddim", "ddim_cfgpp")  # the samplers whose eta AUTOMATIC1111 writes as "Eta DDIM"
# "default" is the model's own sigma schedule: AUTOMATIC1111 (v1.9+) calls that scheduler "Automatic"
A1111_SCHEDULES = {"default": "Automatic", "karras": "Karras", "exponential": "Exponential", "beta": "Beta",
                   "sgm_uniform": "SGM Uniform", "simple": "Simple", "uniform": "Uniform",
                   "polyexponential": "Polyexponential", "kl_optimal": "KL Optimal",
                   "align_your_steps": "Align Your Steps", "turbo": "Turbo", "ddim_uniform": "DDIM"}
EMPHASIS_LABELS = {"original": "Original", "no_norm": "No norm"}
_NAME_SYMBOLS = str.maketrans("", "", ":,")  # what AUTOMATIC1111 drops from a LoRA's name in `Lora hashes`


class MetadataError(ValueError):
    """The image carries neither a `diffgraph` JSON nor an AUTOMATIC1111 `parameters` text (or it is unreadable)."""


def _split_loras(request: Any) -> tuple[tuple[tuple[str, float], ...], tuple[tuple[str, float], ...]]:
    """(the listed adapters, the prompt's `<lora:...>` tags): `GenerationRequest.create` appends an a1111-syntax
    prompt's tags after the listed ones, so re-creating from the prompt and the listed ones gives the same loras."""
    loras = tuple(request.loras)
    if request.prompt_syntax != "a1111":
        return loras, ()
    from .request import prompt_loras

    tagged = prompt_loras(request)
    if tagged and loras[len(loras) - len(tagged):] == tagged:
        return loras[:len(loras) - len(tagged)], tagged
    return loras, ()


def _number(value: float) -> str:
    """As AUTOMATIC1111's infotexts show numbers: 7 for 7.0, 7.5, 0.75."""
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


def _quote(value: Any) -> str:
    """AUTOMATIC1111's `infotext_utils.quote`: a value holding a comma, colon or newline is written as JSON."""
    text = str(value)
    if "," not in text and "\n" not in text and ":" not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def infotext(request: Any, model_name: str, extra: dict[str, Any] | None = None) -> str:
    """AUTOMATIC1111's infotext of `request`. `Model hash` and `Lora hashes` are the short hashes the request
    carries (`model_hash`, `lora_hashes`: the server fills them from the files, models/file_hashes.py), left out
    where it carries none (a folder model or a preset has no file to hash), as AUTOMATIC1111 leaves out values it
    has not; `Lora hashes` lists "name: hash" pairs, each name as the prompt names it, without ":" and ",". `extra`:
    more entries (AUTOMATIC1111's extra_generation_params, such as the hires fix's), numbers written as it writes
    them, after the request's own.
    LoRAs are written as AUTOMATIC1111 writes them, as `<lora:name:scale>` tags in the prompt (those that are not
    already tags there)."""
    listed, _ = _split_loras(request)
    prompt = request.prompt + "".join(f" <lora:{name}:{_number(scale)}>" for name, scale in listed)
    edit = getattr(request, "edit", None)
    strength = edit.strength if edit is not None else getattr(request, "strength", None)
    params: dict[str, Any] = {
        "Steps": request.num_inference_steps,
        "Sampler": A1111_SAMPLERS.get(request.sampler, request.sampler),
        "Schedule type": A1111_SCHEDULES.get(request.schedule, request.schedule),
        "CFG scale": _number(request.guidance_scale),
        "Seed": request.seed,
        "Size": f"{request.width}x{request.height}",
        "Model hash": getattr(request, "model_hash", None),
        "Model": model_name or None,
        **_variation_params(getattr(request, "variation", None)),
        "Denoising strength": None if strength is None else _number(strength),
        # AUTOMATIC1111 counts the last layer as 1 (diffusers' clip_skip + 1) and writes it from 2 on
        "Clip skip": None if not request.clip_skip else request.clip_skip + 1,
        "Tiling": "True" if getattr(request, "tiling", False) else None,  # AUTOMATIC1111's words
        "Lora hashes": ", ".join(f"{name.translate(_NAME_SYMBOLS)}: {digest}"
                                 for name, digest in getattr(request, "lora_hashes", ())) or None,
        "Emphasis": (EMPHASIS_LABELS[request.emphasis]
                     if request.prompt_syntax == "a1111" and request.emphasis != "original" else None),
        # AUTOMATIC1111 writes DDIM's (and DDIM CFG++'s) eta where it is not 0
        "Eta DDIM": _number(request.eta) if request.sampler in DDIM_ETA and getattr(request, "eta", None) else None,
        "ENSD": getattr(request, "noise_seed_delta", 0) or None,  # AUTOMATIC1111's eta_noise_seed_delta
        "Schedule shift": _number(shift) if (shift := getattr(request, "schedule_shift", None)) is not None else None,
    }
    # the capability parameters (their own names, "Step cache"; objects as JSON)
    params.update({name.replace("_", " ").capitalize(): v if isinstance(v, str) else json.dumps(v)
                   for name, v in plain_extras(request).items()})
    params.update({k: _number(v) if isinstance(v, float) else v for k, v in (extra or {}).items()})
    line = ", ".join(f"{k}: {_quote(v)}" for k, v in params.items() if v is not None)
    negative = f"\nNegative prompt: {request.negative_prompt}" if request.negative_prompt else ""
    return f"{prompt}{negative}\n{line}".strip()


def _variation_params(variation: Any) -> dict[str, Any]:
    """AUTOMATIC1111's infotext entries of a variation seed (None: left out)."""
    if variation is None:
        return {}
    size = variation.resize_from
    return {"Variation seed": variation.subseed if variation.strength else None,
            "Variation seed strength": _number(variation.strength) if variation.strength else None,
            "Seed resize from": None if size is None else f"{size[0]}x{size[1]}"}


def _parsed_variation(params: dict[str, str]) -> dict[str, Any] | None:
    """A `variation` (Variation's fields) from AUTOMATIC1111's infotext entries; None: it has none."""
    size = _SIZE.match(params.get("Seed resize from", ""))
    if "Variation seed strength" not in params and not size:
        return None
    strength = float(params.get("Variation seed strength", 0))
    subseed = int(params["Variation seed"]) if strength and "Variation seed" in params else 0
    return {"subseed": subseed, "strength": strength,
            "resize_from": (int(size.group(1)), int(size.group(2))) if size else None}


def parsed_hires(params: dict[str, str]) -> dict[str, Any] | None:
    """The hires fix of AUTOMATIC1111's infotext entries (hires.hires_params writes them): "scale" or "resize"
    (width, height), "steps", "upscaler" and "strength" (each None where absent); None: the text has no hires fix
    (neither "Hires upscale" nor "Hires resize"). MetadataError for an entry that is not a number."""
    resize = _SIZE.match(params.get("Hires resize", ""))
    if "Hires upscale" not in params and not resize:
        return None
    try:
        return {"scale": float(params["Hires upscale"]) if "Hires upscale" in params and not resize else None,
                "resize": (int(resize.group(1)), int(resize.group(2))) if resize else None,
                "steps": int(params["Hires steps"]) if "Hires steps" in params else None,
                "upscaler": params.get("Hires upscaler"),
                "strength": float(params["Denoising strength"]) if "Denoising strength" in params else None}
    except ValueError as e:
        raise MetadataError(f"its AUTOMATIC1111 Hires entries hold a value that is not a number: {e}") from None


def request_fields(request: Any, model_name: str) -> dict[str, Any]:
    """The request as plain JSON data: `GenerationRequest.create` keyword arguments, "model" and "version"."""
    listed, _ = _split_loras(request)
    fields = {"version": FORMAT_VERSION, "model": model_name, "prompt": request.prompt,
              "negative_prompt": request.negative_prompt, "width": request.width, "height": request.height,
              "num_inference_steps": request.num_inference_steps, "guidance_scale": request.guidance_scale,
              "sampler": request.sampler, "schedule": request.schedule, "seed": request.seed,
              "num_images": request.num_images, "loras": [[n, s] for n, s in listed],
              "guidance_interval": None if request.guidance_interval is None else list(request.guidance_interval),
              "guidance_rescale": request.guidance_rescale, "prompt_syntax": request.prompt_syntax,
              "clip_skip": request.clip_skip, "emphasis": request.emphasis}
    for name in ("timestep_spacing", "eta", "schedule_shift"):  # sampler options: written where a request gave them
        if getattr(request, name, None) is not None:
            fields[name] = getattr(request, name)
    if getattr(request, "tiling", False):  # written where set
        fields["tiling"] = True
    if getattr(request, "noise_seed_delta", 0):
        fields["noise_seed_delta"] = request.noise_seed_delta
    variation = getattr(request, "variation", None)
    if variation is not None:
        fields["variation"] = {"subseed": variation.subseed, "strength": variation.strength,
                               "resize_from": None if variation.resize_from is None else list(variation.resize_from)}
    if request.edit is not None:
        fields["strength"] = request.edit.strength  # the input image (and mask) are not embedded
        fields["inpaint"] = request.edit.inpaint
    extras = plain_extras(request)
    if extras:
        fields["extras"] = extras
    return fields


def plain_extras(request: Any) -> dict[str, Any]:
    """The request's capability parameters that are plain JSON data (`step_cache`; images are not embedded)."""
    out = {}
    for name, value in getattr(request, "extras", ()):
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            continue
        out[name] = value
    return out


def request_json(request: Any, model_name: str) -> str:
    return json.dumps(request_fields(request, model_name), ensure_ascii=False, separators=(",", ":"))


def save_options(fmt: str, request: Any, model_name: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Pillow `save` keyword arguments that embed the request in an image of format `fmt` (png, jpeg, webp);
    `extra`: more infotext entries (`infotext`'s)."""
    text, data = infotext(request, model_name, extra), request_json(request, model_name)
    if fmt == "png":
        from PIL.PngImagePlugin import PngInfo

        info = PngInfo()
        info.add_text(PNG_KEY, text)  # tEXt when Latin-1, else iTXt (Pillow's choice, as AUTOMATIC1111's)
        info.add_text(JSON_KEY, data)
        return {"pnginfo": info}
    from PIL import Image

    exif = Image.Exif()
    ifd = exif.get_ifd(EXIF_IFD)
    ifd[USER_COMMENT] = b"UNICODE\0" + text.encode("utf-16-be")
    ifd[MAKER_NOTE] = MAKER_PREFIX + data.encode("utf-8")
    return {"exif": exif.tobytes()}


def embed(fmt: str, image: Any, request: Any, model_name: str) -> bytes:
    """A PIL image encoded as `fmt` with the request inside."""
    buf = io.BytesIO()
    image.save(buf, format={"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt],
               **save_options(fmt, request, model_name))
    return buf.getvalue()


def _decode_user_comment(raw: Any) -> str | None:
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, bytes):
        return None
    head, body = raw[:8], raw[8:]
    if head == b"UNICODE\0":  # piexif writes UTF-16 big-endian; some writers little-endian with a BOM
        if body[:2] in (b"\xff\xfe", b"\xfe\xff"):
            return body.decode("utf-16", errors="replace")
        return body.decode("utf-16-be", errors="replace")
    if head == b"ASCII\0\0\0":
        return body.decode("ascii", errors="replace")
    return raw.decode("utf-8", errors="replace")


def read_texts(source: "str | Path | bytes | Any") -> tuple[str | None, str | None]:
    """(the infotext, the diffgraph JSON) an image carries, each None when absent. `source`: a path, the encoded
    bytes or a PIL image."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = source if isinstance(source, Image.Image) else Image.open(
            io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source)
    except (OSError, UnidentifiedImageError) as e:
        raise MetadataError(f"cannot be read as an image: {e}") from None
    info = getattr(image, "text", None) if image.format == "PNG" else None
    info = info if info is not None else image.info
    text, data = info.get(PNG_KEY), info.get(JSON_KEY)
    if text is None and data is None:
        ifd = image.getexif().get_ifd(EXIF_IFD)
        text = _decode_user_comment(ifd.get(USER_COMMENT))
        note = ifd.get(MAKER_NOTE)
        if isinstance(note, bytes) and note.startswith(MAKER_PREFIX):
            data = note[len(MAKER_PREFIX):].decode("utf-8", errors="replace")
    return (text if isinstance(text, str) else None), (data if isinstance(data, str) else None)


def read_request(source: "str | Path | bytes | Any") -> dict[str, Any]:
    """The request an image carries: `GenerationRequest.create` keyword arguments plus "model" (and "inpaint" for
    an edit), from the diffgraph JSON, else from AUTOMATIC1111's infotext. MetadataError when it has neither."""
    text, data = read_texts(source)
    if data is not None:
        try:
            fields = json.loads(data)
        except ValueError:
            fields = None
        if isinstance(fields, dict) and isinstance(fields.get("version"), int):
            if fields["version"] > FORMAT_VERSION:
                raise MetadataError(f"its diffgraph metadata is version {fields['version']}; this diffgraph reads "
                                    f"up to version {FORMAT_VERSION}: upgrade diffgraph")
            fields.pop("version")
            fields["loras"] = tuple((str(n), float(s)) for n, s in fields.get("loras") or ())
            if fields.get("guidance_interval") is not None:
                fields["guidance_interval"] = tuple(fields["guidance_interval"])
            hires = parsed_hires(infotext_parts(text)[2]) if text is not None else None
            if hires is not None:  # the JSON is the first pass's request; the second pass is in the infotext
                fields["hires"] = hires
            return fields
    if text is not None:
        return parse_infotext(text)
    raise MetadataError("it carries no generation settings (neither a `diffgraph` nor an AUTOMATIC1111 "
                        "`parameters` entry)")


# AUTOMATIC1111's `infotext_utils.re_param`, r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)' (`Key: value`
# or `Key: "json string"`, comma separated), read by `_params` in its pieces: that regex, run by findall, scans a
# key's run of characters again from each of its starts, quadratic in a line without a colon
_SPACES = re.compile(r"\s*")
_KEY = re.compile(r"\w[\w \-/]+")
_QUOTED = re.compile(r'"(?:\\.|[^\\"])+"')
_SIZE = re.compile(r"^(\d+)x(\d+)$")


def _params(line: str) -> list[tuple[str, str]]:
    """The (key, value) pairs `re_param.findall(line)` gives, in time linear in the line: a key that is not
    followed by a colon fails for every start inside its run too, so the scan moves past the run."""
    pairs: list[tuple[str, str]] = []
    pos, end = 0, len(line)
    while pos < end:
        start = _SPACES.match(line, pos).end()
        key = _KEY.match(line, start)
        if key is None:
            pos = start + 1
            continue
        if not line.startswith(":", key.end()):
            pos = key.end()
            continue
        at = _SPACES.match(line, key.end() + 1).end()
        quoted = _QUOTED.match(line, at)  # each value's scan ends at its closing quote: no scan is repeated
        if quoted is not None and (quoted.end() == end or line[quoted.end()] == ","):
            value, stop = quoted.group(0), quoted.end()
        else:
            stop = line.find(",", at)
            stop = end if stop < 0 else stop
            value = line[at:stop]
        pairs.append((key.group(0), value))
        pos = stop + 1
    return pairs


def infotext_parts(text: str) -> tuple[str, str | None, dict[str, str]]:
    """AUTOMATIC1111's infotext read as its parse_generation_parameters splits it: (the prompt, the negative prompt
    or None, each `Key: value` of the settings line, a quoted value unquoted), in time linear in the text."""
    *lines, last = text.strip().split("\n")
    pairs = _params(last)
    if len(pairs) < 3:  # as AUTOMATIC1111: a last line of fewer than 3 pairs is prompt text
        lines.append(last)
        pairs = []
    prompt, negative, in_negative = [], [], False
    for line in lines:
        if line.startswith("Negative prompt:"):
            in_negative, line = True, line[len("Negative prompt:"):].strip()
        (negative if in_negative else prompt).append(line)
    params: dict[str, str] = {}
    for key, value in pairs:
        value = value.strip()
        if len(value) > 1 and value[0] == '"' and value[-1] == '"':
            try:
                value = json.loads(value)
            except ValueError:
                pass
        params[key.strip()] = value
    return "\n".join(prompt).strip(), "\n".join(negative) or None, params


def parse_infotext(text: str) -> dict[str, Any]:
    """AUTOMATIC1111's infotext -> `GenerationRequest.create` keyword arguments (plus "model"): the prompt and
    negative prompt (read in its prompt syntax, "a1111", which carries `<lora:...>` tags), steps, sampler and
    schedule (its names mapped back; an old "DPM++ 2M Karras" sampler name split), CFG scale, seed, size, model,
    denoising strength (the hires fix's where the text has one: "hires", `parsed_hires`), clip skip, tiling, the
    variation seed, ENSD (eta_noise_seed_delta) and a flow schedule's shift ("Schedule shift"). Keys diffgraph has no setting for are ignored."""
    prompt, negative, params = infotext_parts(text)
    fields: dict[str, Any] = {"prompt": prompt, "negative_prompt": negative, "prompt_syntax": "a1111"}
    samplers = {v: k for k, v in A1111_SAMPLERS.items()}
    schedules = {v: k for k, v in A1111_SCHEDULES.items()}
    sampler = params.get("Sampler")
    if sampler is not None:
        for label, name in schedules.items():  # before v1.9 the schedule was part of the name: "DPM++ 2M Karras"
            if name != "default" and sampler.endswith(" " + label) and sampler not in samplers:
                sampler = sampler[:-len(label) - 1]
                fields["schedule"] = name
        fields["sampler"] = samplers.get(sampler, sampler)
    if "Schedule type" in params:
        fields["schedule"] = schedules.get(params["Schedule type"], params["Schedule type"])
    try:
        if "Steps" in params:
            fields["num_inference_steps"] = int(params["Steps"])
        if "CFG scale" in params:
            fields["guidance_scale"] = float(params["CFG scale"])
        if "Seed" in params:
            fields["seed"] = int(params["Seed"])
        if "Denoising strength" in params:
            fields["strength"] = float(params["Denoising strength"])
        if "Clip skip" in params:
            fields["clip_skip"] = int(params["Clip skip"]) - 1 or None  # AUTOMATIC1111's 1 = the last layer
        if "Eta DDIM" in params and fields.get("sampler") in DDIM_ETA:
            fields["eta"] = float(params["Eta DDIM"])
        if "ENSD" in params:
            fields["noise_seed_delta"] = int(params["ENSD"])
        if "Schedule shift" in params:
            fields["schedule_shift"] = float(params["Schedule shift"])
        variation = _parsed_variation(params)
        if variation is not None:
            fields["variation"] = variation
        hires = parsed_hires(params)
        if hires is not None:  # its "Denoising strength" is the second pass's
            fields["hires"] = hires
            fields.pop("strength", None)
    except ValueError as e:
        raise MetadataError(f"its AUTOMATIC1111 parameters hold a value that is not a number: {e}") from None
    size = _SIZE.match(params.get("Size", ""))
    if size:
        fields["width"], fields["height"] = int(size.group(1)), int(size.group(2))
    if "Model" in params:
        fields["model"] = params["Model"]
    if params.get("Tiling") == "True":
        fields["tiling"] = True
    if params.get("Emphasis") in EMPHASIS_LABELS.values():
        fields["emphasis"] = {v: k for k, v in EMPHASIS_LABELS.items()}[params["Emphasis"]]
    return fields


IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def encode_image(pixels: np.ndarray, fmt: str, request: GenerationRequest | None = None, model_name: str = "",
                 metadata: bool = True, extra: dict[str, Any] | None = None) -> bytes:
    """Float pixels [H, W, 3] in [0, 1] -> PNG / JPEG / WebP bytes (rounded as diffusers' numpy_to_pil); with a
    request and `metadata`, the settings that made it inside (image_metadata.py), `extra` infotext entries after
    the request's (a hires fix's)."""
    from PIL import Image

    options = save_options(fmt, request, model_name, extra) if metadata and request is not None else {}
    buf = io.BytesIO()
    Image.fromarray((pixels * 255).round().astype("uint8")).save(
        buf, format=IMAGE_FORMATS[fmt], **({"quality": _quality(request)} if fmt in ("jpeg", "webp") else {}),
        **options)
    return buf.getvalue()


def _quality(request: GenerationRequest | None) -> int:
    """The JPEG / WebP quality: OpenAI's `output_compression` (0..100, the compression) read as 100 - quality,
    else 95."""
    compression = None if request is None else request.output_compression
    return 95 if compression is None else max(1, 100 - compression)
