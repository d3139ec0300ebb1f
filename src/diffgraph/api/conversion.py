"""A body of the images API -> the engine's `GenerationRequest` (the one validation), for the server's routes and
for batch jobs' items alike: the HTTP-only fields checked, the server's defaults (prompt syntax, clip skip) applied,
the uploads decoded, and a request's ParamError made the 400 that names the body field."""

from __future__ import annotations

import secrets

from ..errors import ParamError
from ..request import EditInput, GenerationRequest, ModelInfo, require_prompt
from .config import ServerConfig
from .protocol import APIError, ImageGenerationRequest, check_prompt_bytes, error_from_param_error
from .uploads import decode_controls, decode_image_prompt


def generation_request(info: ModelInfo, config: ServerConfig, params: ImageGenerationRequest,
                        edit: EditInput | None = None, controls: list | tuple = (),
                        image_prompts: dict | None = None, extras: dict | None = None) -> GenerationRequest:
    """Checks the HTTP-only fields of typed parameters, then builds the request (the one validation)."""
    if params.model is not None and params.model != info.name:
        raise APIError(400, f"model {params.model!r} is not served here; this server serves {info.name!r} "
                            "(GET /v1/models)", param="model", code="model_not_found")
    if params.response_format not in ("b64_json", "url"):
        raise APIError(400, f"response_format {params.response_format!r} is unknown; allowed: b64_json, url",
                       param="response_format")
    if params.controls and not controls:  # not decoded by the route (a batch job's item): its images are base64
        controls = decode_controls(params.controls, config.max_image_bytes, config.max_image_pixels)
    if params.image_prompts is not None and image_prompts is None:
        image_prompts = decode_image_prompt(params.image_prompts, config.max_image_bytes, config.max_image_pixels)
    kwargs = params.request_params()
    if kwargs["prompt_syntax"] is None:
        kwargs["prompt_syntax"] = config.prompt_syntax
    if kwargs["clip_skip"] is None:
        kwargs["clip_skip"] = config.clip_skip
    check_prompt_bytes(config.max_prompt_bytes, prompt=params.prompt, negative_prompt=kwargs["negative_prompt"])
    try:
        require_prompt(params.prompt, edit)  # OpenAI's API requires a prompt; an edit has its image to go on
        return GenerationRequest.create(params.prompt, request_id=f"img-{secrets.token_hex(8)}", model=info,
                                        image=edit, controls=controls, image_prompts=image_prompts, extras=extras,
                                        **kwargs)
    except ParamError as e:
        raise error_from_param_error(e, info.extension_params) from None
