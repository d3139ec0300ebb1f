"""POST /v1/images/edits: OpenAI's multipart form (image, optional mask, prompt, n, size, response_format, model)
plus the generations endpoint's extensions and `strength`, read into typed parameters and an `EditInput`; and
POST /v1/images/variations, the same form without a prompt (OpenAI's `images.create_variation`: image, n, size,
response_format, model, user): image-to-image of the image with an empty prompt at `VARIATION_STRENGTH`.

The image comes as the file part `image`, or as `image[]` (OpenAI's client sends a list of images as `image[]`
parts, one image too when it is given in a list). The SD families edit one image: a second is a 400 naming `image[]`.
A family that reads every image part as its own list (`ModelInfo.edit_images`: FLUX.2's references) takes them all;
with a `strength` below 1 the first is also the image-to-image start (`image_parts`).

Images are checked before their pixels are decoded: at most --max-image-bytes bytes, and at most
--max-image-pixels pixels read from the header (a decompression bomb is refused before it expands). Masks follow
OpenAI's convention when they have an alpha channel (fully transparent pixels = the region to repaint), and
diffusers' when they do not (white = repaint); without a mask, an image with transparent pixels is inpainted where
it is transparent (as OpenAI does) and an opaque image is an image-to-image request. 16-bit and float grayscale
images (PIL modes I;16, I, F) are scaled to 8 bits, not clipped (uploads.py: `decode_upload`, `eight_bit`).

The form's number fields are read as the JSON route reads its body: "2" is 2, "2.0" is 2.0 (so `n` refuses it, as
the JSON route does), "٢" is text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import numpy as np
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, Json, StrictFloat, StrictStr, ValidationError,
                      create_model)

from ..request import EditInput, ModelInfo, ParamError
from .bodies import FormLimits, read_multipart
from ..api.protocol import (APIError, ControlRef, ImageGenerationRequest, ImagePromptRef,
                       error_from_param_error, error_from_validation)
from ..api.protocol import CONTROL_FILES, PROMPT_FILES, decode_upload, eight_bit

FORM_CONTENT = "multipart/form-data"
FILES = ("image", "mask", *CONTROL_FILES, *PROMPT_FILES)
IMAGE_LIST = "image[]"   # OpenAI's client's name for each image of a list
MAX_IMAGES = 16          # image[] parts read (OpenAI's limit for its edits); a model takes its own number of them
VARIATION_STRENGTH = 0.6  # a variation's strength: the image's composition kept, its details drawn anew
# the edits form's fields that a variation does not take (OpenAI's variations have no prompt and do not stream)
NOT_VARIATION = ("prompt", "mask", "stream", "partial_images", "preview")
NOT_EDIT = ("style",)  # the generations body's fields that OpenAI's edits do not take
WITH_FILES = ("controls", "image_prompts")  # fields whose images may come as file parts (read with the files)
_NON_FINITE = ("nan", "inf", "infinity")


class FormControlRef(ControlRef):
    """A control in the edits form: its map as the file part control_image_<i> or as base64 in `image`."""

    image: StrictStr | None = None


class FormImagePromptRef(ImagePromptRef):
    """The image prompt in the edits form: its images as the file parts image_prompt_<i> or as base64."""

    images: list[StrictStr] | None = None


class EditOnlyFields(BaseModel):
    """The edits form's own fields beside the generations body's (declarations only: `ImageEditForm` reads them
    as it reads the body's): OpenAI's input_fidelity (no effect here), the edit's strength, and the body's controls
    and image prompt in their file-aware form."""

    input_fidelity: Literal["high", "low"] | None = None
    strength: StrictFloat | None = None
    # a JSON text field: [{"model": "edges", "scale": 0.8}], control i's map in the file part control_image_<i>
    # (or as base64 in its "image")
    controls: list[FormControlRef] | None = None
    # a JSON text field: {"model": "sd15/ip-adapter_sd15", "scale": 0.6}, its images the file parts image_prompt_<i>
    image_prompts: FormImagePromptRef | None = None


def _json_number(value: Any) -> Any:
    """A number's text as the JSON route parses it (then checked by the field's strict type), and nan / inf in any
    case (refused by the range checks, naming the range); other text is left as it came, to be refused naming the
    field."""
    if not isinstance(value, str):
        return value
    if value.strip().lower().lstrip("+-") in _NON_FINITE:
        return float(value)
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if isinstance(parsed, (int, float)) and not isinstance(parsed, bool) else value


def _text_annotation(annotation: Any) -> Any:
    """A body field's type as a form's text field reads it: numbers as JSON numbers (`_json_number`), booleans as
    pydantic's lax booleans ("true", "1"), lists, objects and models as a JSON text field; text as it is."""
    options = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    inner = [t for t in options if t is not type(None)]
    optional = len(inner) < len(options)
    kind = inner[0]
    leaf = get_args(kind)[0] if get_origin(kind) is Annotated else kind
    if len(inner) > 1 or leaf in (str, Any) or get_origin(leaf) is Literal:
        return annotation
    if leaf in (int, float):
        return Annotated[annotation, BeforeValidator(_json_number)]
    if leaf is bool:
        return bool | None if optional else bool
    structured = Json[kind]  # list, dict or a model: its JSON text
    return structured | None if optional else structured


def form_fields(body: type[BaseModel] = ImageGenerationRequest) -> dict[str, Any]:
    """The form's fields (`create_model`'s definitions): the generations body's (in its order, less NOT_EDIT) with
    the edit's own (`EditOnlyFields`, replacing the body's of the same name), each typed for form text."""
    declared = {k: v for k, v in body.model_fields.items() if k not in NOT_EDIT}
    declared.update(EditOnlyFields.model_fields)
    return {name: (_text_annotation(info.rebuild_annotation()),
                   ... if info.is_required() else Field(default=info.default, default_factory=info.default_factory))
            for name, info in declared.items()}


class EditForm(BaseModel):
    """The form's text fields: the generations request's fields (form values are text: "20" is the integer 20
    here, read as JSON) and the edit's own (`EditOnlyFields`)."""

    model_config = ConfigDict(extra="forbid")

    def generation(self) -> ImageGenerationRequest:
        """The same fields as a generations request (for the shared checks and request building), those the form
        gave still marked as given (a missing num_inference_steps is the model's default); the controls and image
        prompt are read with the form's files (`decode_controls`, `decode_image_prompt`), not here."""
        names = set(ImageGenerationRequest.model_fields) & set(type(self).model_fields) - set(WITH_FILES)
        return ImageGenerationRequest.model_construct(self.model_fields_set & names,
                                                      **{name: getattr(self, name) for name in names})


# the edits form: EditForm with the body's fields read as text, so a field added to the body is a form field
ImageEditForm = create_model("ImageEditForm", __base__=EditForm, __module__=__name__, __doc__=EditForm.__doc__,
                             **form_fields())


@dataclass
class FormFiles:
    """The form's file parts: the images to edit in order (`image` or `image[]` parts) and the others by name."""

    images: list[bytes] = field(default_factory=list)
    parts: dict[str, bytes] = field(default_factory=dict)
    listed: bool = False  # the images came as image[] parts

    @property
    def image_name(self) -> str:
        """The field the images came in, as errors name it."""
        return IMAGE_LIST if self.listed else "image"


def variation_schema() -> dict[str, Any]:
    """The variations form's JSON schema (the OpenAPI page's): the edits form's without its NOT_VARIATION fields."""
    schema = ImageEditForm.model_json_schema()
    schema["properties"] = {k: v for k, v in schema["properties"].items() if k not in NOT_VARIATION}
    schema["required"] = [k for k in schema.get("required", []) if k not in NOT_VARIATION]
    return schema


async def read_form(http: Any, max_image_bytes: int, variation: bool = False) -> tuple[EditForm, FormFiles]:
    """The parsed form: its text fields (typed) and the bytes of its files, read within their limits as they
    arrive (bodies.py). With `variation`, the variations route's form: no prompt (an empty one), mask or stream.
    Raises APIError (400 / 413)."""
    route = "variations" if variation else "edits"
    content_type = http.headers.get("content-type", "")
    if not content_type.lower().startswith(FORM_CONTENT):
        raise APIError(400, f"this endpoint takes {FORM_CONTENT} (OpenAI's images.{route}: the image as a file part "
                            f"'image', an optional 'mask', and the text fields), not {content_type or 'no body type'}; "
                            "for text-to-image, POST JSON to /v1/images/generations", code="invalid_content_type")
    # the body: the images and a mask at the limit, and the text fields
    names = (*FILES, *(IMAGE_LIST,) * MAX_IMAGES)
    limits = FormLimits(body_bytes=len(names) * max_image_bytes + 1_048_576, file_names=names,
                        file_bytes=max_image_bytes, flag="--max-image-bytes")
    fields: dict[str, Any] = {"prompt": ""} if variation else {}
    files = FormFiles()
    for name, value in await read_multipart(http, limits):
        if variation and name in NOT_VARIATION:
            raise APIError(400, f"{name} is not a field of /v1/images/variations (a variation has no prompt, mask or "
                                f"stream); use /v1/images/edits for it", param=name)
        if name in files.parts or name in fields:
            raise APIError(400, f"{name} is given more than once; send one", param=name)
        if isinstance(value, bytes):  # an upload
            if name not in FILES and name != IMAGE_LIST:
                raise APIError(400, f"unexpected file part {name!r}; files: {', '.join(FILES)}, {IMAGE_LIST}",
                               param=name)
            if name in ("image", IMAGE_LIST):
                files.images.append(value)
                files.listed = files.listed or name == IMAGE_LIST
            if name != IMAGE_LIST:
                files.parts[name] = value
        elif name in FILES or name == IMAGE_LIST:
            raise APIError(400, f"{name} must be a file part (an uploaded image), not a text field", param=name)
        else:
            fields[name] = value
    try:
        return ImageEditForm.model_validate(fields), files
    except ValidationError as e:
        raise error_from_validation(e, ImageEditForm) from None


def _alpha(image: Any) -> np.ndarray | None:
    """The alpha channel (uint8 [H, W]) of an image that has one (a PNG's tRNS colour of an L or RGB image too: an
    optimizer's form of a mask whose alpha is 0 or 255), else None."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode in ("P", "L", "RGB") and "transparency" in image.info):
        return np.asarray(image.convert("RGBA"))[..., 3]
    return None


def edit_arrays(image: Any, mask: Any = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(RGB pixels, mask or None) of PIL images under the conventions in the module doc (the CLI uses it too)."""
    if mask is not None:
        alpha = _alpha(mask)
        mask_array = (np.where(alpha == 0, 255, 0).astype(np.uint8) if alpha is not None
                      else np.asarray(eight_bit(mask).convert("L")))
    else:
        alpha = _alpha(image)
        mask_array = None
        if alpha is not None and (alpha == 0).any():  # transparent pixels: inpaint them (OpenAI)
            mask_array = np.where(alpha == 0, 255, 0).astype(np.uint8)
    return np.asarray(eight_bit(image).convert("RGB")), mask_array


def image_parts(files: FormFiles, info: ModelInfo, strength: float | None, max_bytes: int,
                max_pixels: int) -> tuple[list, EditInput | None]:
    """(The form's image parts as RGB images, the image-to-image start or None) for a family that reads them all as
    one capability's list (`ModelInfo.edit_images`): with a `strength` below 1 on a model that takes edits, the first
    image is also the start, noised to that strength; a mask, or a strength on a model without edits, is a 400."""
    for name, given in (("mask", "mask" in files.parts), ("strength", strength is not None and not info.edits)):
        if given:
            raise APIError(400, f"model {info.name!r} reads its images as {info.edit_images} and takes no {name}; "
                                f"leave {name} out", param=name)
    if not files.images:
        raise APIError(400, "image is required: upload the images as file parts 'image[]'", param="image")
    images = [eight_bit(decode_upload(f"{files.image_name}[{i}]" if files.listed else files.image_name, data,
                                      max_bytes, max_pixels)).convert("RGB") for i, data in enumerate(files.images)]
    if strength is None or strength == 1:
        return images, None
    try:
        return images, EditInput(image=np.asarray(images[0]), strength=strength)
    except ParamError as e:
        raise error_from_param_error(e) from None


def edit_input(files: FormFiles, strength: float | None, defaults: tuple[float, float], max_bytes: int,
               max_pixels: int, model: str = "", inpaint: bool = True) -> EditInput:
    """The EditInput of the form's files (see the module doc for the mask conventions); `model` names the model in
    the refusal of several images; without `inpaint` (a variation) transparent pixels are not a mask."""
    if not files.images:
        raise APIError(400, "image is required: upload the image to edit as the file part 'image' (or 'image[]')",
                       param="image")
    if len(files.images) > 1:  # the SD families edit one image; several mean something only to other families
        raise APIError(400, f"image[] has {len(files.images)} images; model {model or 'this model'!r} takes one "
                            "image: send one image (as 'image' or one 'image[]' part)", param=IMAGE_LIST)
    image = decode_upload(files.image_name, files.images[0], max_bytes, max_pixels)
    mask = decode_upload("mask", files.parts["mask"], max_bytes, max_pixels) if "mask" in files.parts else None
    rgb, mask_array = edit_arrays(image, mask)
    mask_array = mask_array if inpaint else None
    if strength is None:
        strength = defaults[1] if mask_array is not None else defaults[0]
    try:
        return EditInput(image=rgb, mask=mask_array, strength=strength)
    except ParamError as e:
        raise error_from_param_error(e) from None
