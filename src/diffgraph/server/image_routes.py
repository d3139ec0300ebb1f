"""The images routes: OpenAI's generations, edits and variations, and the images stored for their URLs.

    POST /v1/images/generations   JSON answer, or server-sent events with "stream": true
    POST /v1/images/edits         image-to-image and inpainting: OpenAI's multipart form (edits.py), same answers
    POST /v1/images/variations    image-to-image of an image without a prompt (edits.py), same answers
    GET  /v1/images/files/ID.EXT  an image stored for `response_format: "url"` (image_store.py), until --image-ttl

A generation request is type-checked (api/protocol.py), validated once (`GenerationRequest.create` with the model's
`ModelInfo`; its ParamError becomes a 400 naming the body field), submitted (requests.py: the engine's threads do
the work; the event loop only waits on the request's handle), and watched: a client that disconnects or a request
that outlives `request_timeout` is aborted, which frees its rows at the next step boundary. Every request ends in
one outcome counted in the metrics. `ImageRoutes` holds what the three POST routes share; `images_router` builds
them over one.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ..api.protocol import (APIError, ImageData, ImageGenerationRequest, ImageGenerationResponse, decode_controls,
                            decode_image_prompt, decode_images, error_from_validation, generation_request)
from ..engine.client import RequestHandle
from ..request import GenerationRequest, GenerationResult, ModelInfo, ProgressEvent
from . import stream as sse
from .auth import authorized
from .bodies import read_json
from .context import AppContext, error_response
from .edits import VARIATION_STRENGTH, ImageEditForm, edit_input, image_parts, read_form, variation_schema
from .image_store import ImageLinks
from .models import Target
from .requests import ClientGone, ServerState, abort, outcome, results, submit, syntax_warnings, warnings_header


def _response(result: GenerationResult, urls: Callable[[bytes, str], str] | None = None) -> dict[str, Any]:
    """The answer; with `urls` (response_format "url") each image is stored and named by its URL."""
    r = result.request
    fmt = r.output_format
    try:
        data = [ImageData(url=urls(b, fmt)) if urls else ImageData(b64_json=base64.b64encode(b).decode("ascii"))
                for b in result.encoded]
    except ValueError as e:  # the image store cannot take it (full, unwritable)
        raise APIError(507, str(e), code="image_store_full") from None
    return ImageGenerationResponse(
        created=int(time.time()), id=result.request_id, seed=result.seed, output_format=fmt, data=data,
        timings={k: round(v, 3) for k, v in result.timings.items()}).model_dump(exclude_none=True)


def _warned(build: Callable[..., GenerationRequest], *args: Any, **kwargs: Any) -> tuple[GenerationRequest, list[str]]:
    """`build(*args, **kwargs)`'s request and the warnings its prompts earn (a worker thread: text is read off the
    event loop)."""
    request = build(*args, **kwargs)
    return request, syntax_warnings(request)


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the response ends (sent, cancelled, or never started)."""

    def __init__(self, content: Any, on_close: Any, **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _leave(state: ServerState) -> None:
    state.inflight -= 1
    state.metrics.inflight.dec()


class _StreamEnd:
    """A stream's accounting, closed exactly once: by the generator, or by the response when the client
    left before the generator ever ran (then no `finally` of the generator would run)."""

    def __init__(self, state: ServerState, handle: RequestHandle, t0: float):
        self.state, self.handle, self.t0, self.outcome, self.closed = state, handle, t0, "aborted", False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.outcome == "aborted" and self.handle.request_id in self.state.handles:
            abort(self.state, self.handle)  # the client went away: free the rows
        self.state.metrics.observe_request(self.outcome, time.monotonic() - self.t0)
        _leave(self.state)


class ImageRoutes:
    """What the generations, edits and variations routes share: the server state, the model routing, the image
    links (response_format "url"), the JSON body limit and the body timeout."""

    def __init__(self, ctx: AppContext, links: ImageLinks, body_limit: int):
        self.state, self.routing, self.links, self.body_limit = ctx.state, ctx.routing, links, body_limit
        self.config = config = ctx.state.config
        self.read_timeout = min(config.body_timeout, config.request_timeout)
        self.read_flag = "--body-timeout" if config.body_timeout <= config.request_timeout else "--request-timeout"

    async def read_generation(self, http: Request) -> tuple[bool, bool, str | None, Callable[[ModelInfo], Any]]:
        config, state = self.config, self.state
        body = await read_json(http, self.body_limit)
        # the registered capabilities' parameters (features/capability.py) beside the images API's own fields
        known = state.info.extension_params if state.info is not None else ()
        extras = {k: body.pop(k) for k in known if k in body} if isinstance(body, dict) else {}
        try:
            params = ImageGenerationRequest.model_validate(body)
        except ValidationError as e:
            raise error_from_validation(e) from None

        async def finish(info: ModelInfo) -> tuple[GenerationRequest, list[str]]:
            controls = await asyncio.to_thread(decode_controls, params.controls, config.max_image_bytes,
                                               config.max_image_pixels) if params.controls else ()
            prompt = await asyncio.to_thread(decode_image_prompt, params.image_prompts, config.max_image_bytes,
                                             config.max_image_pixels) if params.image_prompts else None
            for name in set(info.extension_images) & set(extras):  # a capability's images, decoded off the loop
                extras[name] = await asyncio.to_thread(decode_images, name, extras[name], config.max_image_bytes,
                                                       config.max_image_pixels)
            return await asyncio.to_thread(_warned, generation_request, info, config, params, controls=controls,
                                           image_prompts=prompt, extras=extras)  # prompts read off the loop
        return params.stream, params.response_format == "url", params.model, finish

    async def read_edit(self, http: Request, variation: bool = False) -> tuple[bool, bool, str | None,
                                                                               Callable[[ModelInfo], Any]]:
        """An edit's form, or a variation's (`variation`: no prompt, no mask, `VARIATION_STRENGTH` by default)."""
        config = self.config
        form, files = await read_form(http, config.max_image_bytes, variation)

        async def finish(info: ModelInfo) -> tuple[GenerationRequest, list[str]]:
            if info.edit_images and not variation:  # the family reads every image part as one of its inputs
                images, start = await asyncio.to_thread(image_parts, files, info, form.strength,
                                                        config.max_image_bytes, config.max_image_pixels)
                return await asyncio.to_thread(_warned, generation_request, info, config, form.generation(), start,
                                               extras={info.edit_images: images})
            if not info.edits:
                raise APIError(400, f"model {info.name!r} takes no image inputs; use /v1/images/generations",
                               param="image")
            defaults = (VARIATION_STRENGTH,) * 2 if variation else info.edit_strength
            edit = await asyncio.to_thread(edit_input, files, form.strength, defaults, config.max_image_bytes,
                                           config.max_image_pixels, info.name, not variation)
            controls = await asyncio.to_thread(decode_controls, form.controls, config.max_image_bytes,
                                               config.max_image_pixels, files.parts)
            prompt = await asyncio.to_thread(decode_image_prompt, form.image_prompts, config.max_image_bytes,
                                             config.max_image_pixels, files.parts)
            return await asyncio.to_thread(_warned, generation_request, info, config, form.generation(), edit,
                                           controls=controls, image_prompts=prompt)
        return form.stream, form.response_format == "url", form.model, finish

    async def serve(self, http: Request, read: Callable[[Request], Any], kind: str) -> Response:
        """One generation request: read and validate it (`read`), submit, wait (or stream the route's `kind` of
        events), answer."""
        state, routing = self.state, self.routing
        t0 = time.monotonic()
        state.inflight += 1
        state.metrics.inflight.inc()
        streaming = False
        try:
            state.accepting()
            try:  # a body that never finishes arriving must not hold the request (or a drain) forever
                stream, by_url, model, finish = await asyncio.wait_for(read(http), self.read_timeout)
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.read_timeout:g} s "
                                    f"({self.read_flag}); send the whole body at once", code="body_timeout") from None
            deadline = t0 + self.config.request_timeout
            default = Target(state.client, state.info, None)
            target = await routing.target(model, deadline - time.monotonic(), default) if routing else default
            try:  # the target is held (never evicted) until its request is queued
                request, warnings = await finish(target.info)
                handle = await submit(state, request, progress=stream, client=target.client, deadline=deadline,
                                      http=http)
            finally:
                if target.hold is not None:  # another model's, held until its request is queued
                    target.release(routing)
            urls = self.links.maker(str(http.base_url)) if by_url else None
            headers = warnings_header(warnings)  # OpenAI's answer has no field for them
            if stream:
                streaming = True  # the stream ends the request's accounting
                end = _StreamEnd(state, handle, t0)
                return _ClosingStream(self.stream(handle, request, deadline, http, end, urls, kind), end.close,
                                      media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
            items = results(state, handle, deadline, http)
            try:
                async for item in items:
                    if isinstance(item, GenerationResult):
                        break
            finally:
                await items.aclose()
            body = await asyncio.to_thread(_response, item, urls)
            state.metrics.observe_request("success", time.monotonic() - t0)
            return JSONResponse(body, headers=headers)
        except APIError as e:
            state.metrics.observe_request(outcome(e))
            return error_response(e)
        except ClientGone:
            state.metrics.observe_request("aborted")
            return Response(status_code=499)
        except asyncio.CancelledError:  # the process is exiting under this request: it still gets one outcome
            state.metrics.observe_request("aborted")
            raise
        finally:
            if not streaming:
                _leave(state)

    async def stream(self, handle: RequestHandle, request: GenerationRequest, deadline: float, http: Request,
                     end: _StreamEnd, urls: Callable[[bytes, str], str] | None, kind: str) -> AsyncIterator[bytes]:
        """The request's events in OpenAI's image stream shape (stream.py)."""
        items, previews = results(self.state, handle, deadline, http), 0
        try:
            async for item in items:
                if isinstance(item, ProgressEvent):
                    if item.previews:
                        yield await asyncio.to_thread(sse.partials, item, previews, request, kind)
                        previews += 1
                    else:
                        yield sse.progress(item)
                    continue
                body = await asyncio.to_thread(_response, item, urls)
                end.outcome = "success"
                yield sse.completed(body, request, kind)
                return
        except APIError as e:
            end.outcome = outcome(e)
            yield sse.error(e.status, e.body())
        except ClientGone:
            pass
        finally:
            await items.aclose()
            end.close()


def images_router(ctx: AppContext, links: ImageLinks, body_limit: int) -> APIRouter:
    """The routes of the module doc; `body_limit` is a generations body's (its prompt and the images it may carry)."""
    routes = ImageRoutes(ctx, links, body_limit)
    router = APIRouter()

    @router.get("/v1/images/files/{name}")
    async def image_file(name: str, http: Request) -> Response:
        """A stored image, while it has not expired; with API keys, only by a signed URL or a key."""
        try:
            data, headers = await asyncio.to_thread(links.serve, name, http.query_params.get("exp", ""),
                                                    http.query_params.get("sig", ""), authorized(http.scope, ctx.keys))
        except LookupError as e:
            status, code = (401, "invalid_image_url") if isinstance(e, PermissionError) else (404, "image_not_found")
            return error_response(APIError(status, str(e), code=code))
        return Response(data, headers=headers)

    schema = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": ImageGenerationRequest.model_json_schema()}}}}

    @router.post("/v1/images/generations", openapi_extra=schema)
    async def generations(http: Request) -> Response:
        return await routes.serve(http, routes.read_generation, sse.GENERATION)

    edit_schema = {"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": ImageEditForm.model_json_schema()}}}}

    @router.post("/v1/images/edits", openapi_extra=edit_schema)
    async def edits(http: Request) -> Response:
        return await routes.serve(http, routes.read_edit, sse.EDIT)

    @router.post("/v1/images/variations", openapi_extra={"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": variation_schema()}}}})
    async def variations(http: Request) -> Response:
        return await routes.serve(http, lambda h: routes.read_edit(h, variation=True), sse.EDIT)

    return router
