"""Where a job's candidate becomes an engine request, and its image: the one place both the server's coordinator
and `diffgraph batch` turn an item into a `GenerationRequest` and run it.

`EngineBackend.build` reads the item's images request fields as the images route reads a body (protocol.py, then
requests.generation_request against the served model's ModelInfo: the same validation, the same defaults, so the
image equals the one /v1/images/generations makes alone with that seed) and marks it a batch row of its job
(`priority="batch"`, `job=ID`, `share=` its owner: the scheduler fills what interactive rows leave free, shared
fairly by key, then by job).
`generate` submits it and waits for its PNG; every way it can end is a `CandidateError`, retryable (the queue was
full, the engine closed or restarts, the request was aborted under it) or not (the request itself is refused, a
step failed), with the engine's message. Cancelling `generate` aborts the request (its rows are freed at the next
step boundary).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Awaitable, Callable

from pydantic import ValidationError

from ..engine.client import RequestHandle
from ..image_metadata import request_fields
from ..request import (EngineClosed, EngineStepError, GenerationRequest, ModelInfo, ParamError, QueueFullError,
                       RequestAborted)
from ..api.config import ServerConfig
from ..api.protocol import (APIError, ImageGenerationRequest, decode_images, error_from_param_error,
                            error_from_validation, generation_request)
from .spec import extras_of, fields_of
from .store import Candidate

RETRYABLE_STATUS = (429, 503)


class CandidateError(Exception):
    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.message, self.retryable = message, retryable


class EngineBackend:
    """`info()`: the served model (None while the engine is not ready: nothing is submitted then); `submit`: queues a
    request (the server's requests.submit, or an engine client's); `release`: forgets a finished handle (the server's
    table of requests in flight); `replicas()`: engine replicas behind the client (the default in-flight bound
    grows with them)."""

    def __init__(self, config: ServerConfig, info: Callable[[], ModelInfo | None],
                 submit: Callable[[GenerationRequest], Awaitable[RequestHandle]],
                 release: Callable[[RequestHandle], None] = lambda handle: None,
                 replicas: Callable[[], int] = lambda: 1):
        self.config = config
        self.info = info
        self._submit, self._release, self._replicas = submit, release, replicas

    def capacity(self, inflight: int | None) -> int | None:
        """How many candidates may be in the engine at once: `inflight` (--batch-inflight), else two of the largest
        bucket's rows per replica (enough to fill the buckets, far below the waiting queue's bound); None while the
        engine is not ready."""
        info = self.info()
        if info is None:
            return None
        return inflight or 2 * info.max_rows * max(1, self._replicas())

    def build(self, c: Candidate, share: str | None = None) -> GenerationRequest:
        """The candidate's engine request, its rows shared fairly with other keys' by `share` (its job's owner; None:
        one share). CandidateError, not retryable, when the model refuses it."""
        info = self.info()
        if info is None:
            raise CandidateError("the engine is not ready", retryable=True)
        return build_request(self.config, info, c.body, c.seed, c.job, share=share)

    def expected(self, request: GenerationRequest) -> dict[str, Any] | None:
        """The settings a stored image of `request` carries (None when images are written without them)."""
        info = self.info()
        return request_fields(request, info.name) if self.config.metadata and info is not None else None

    async def generate(self, request: GenerationRequest) -> bytes:
        """The request's PNG. Raises CandidateError; cancelling aborts the request."""
        return await self.result(await self.submit(request))

    async def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queues the request (CandidateError when the engine refuses it, retryable or not). Cancelled while the
        engine has the request but has not yet answered (a job cancelled then), the submission still completes
        and its request is aborted at once: cancelling the wait would not take the request back from the engine,
        which would make the candidate's image for nobody."""
        submission = asyncio.ensure_future(self._submit(request))
        try:
            return await asyncio.shield(submission)
        except asyncio.CancelledError:
            submission.add_done_callback(self._abandoned)
            raise
        except APIError as e:
            raise CandidateError(e.message, e.status in RETRYABLE_STATUS) from None
        except (QueueFullError, EngineClosed) as e:
            raise CandidateError(str(e) or type(e).__name__, retryable=True) from None
        except ParamError as e:
            raise CandidateError(error_from_param_error(e).message, retryable=False) from None

    def _abandoned(self, submission: asyncio.Future) -> None:
        """A submission whose caller was cancelled: its request, once queued, is aborted and forgotten."""
        if submission.cancelled() or submission.exception() is not None:
            return  # refused or never queued: nothing runs
        handle = submission.result()
        handle.abort()
        self._release(handle)

    async def result(self, handle: RequestHandle) -> bytes:
        """The PNG of a submitted request (CandidateError); cancelling aborts it."""
        try:
            result = await handle.result()
        except asyncio.CancelledError:
            handle.abort()
            raise
        except (EngineClosed, RequestAborted) as e:
            raise CandidateError(str(e) or "the request was aborted", retryable=True) from None
        except ParamError as e:
            raise CandidateError(error_from_param_error(e).message, retryable=False) from None
        except EngineStepError as e:
            raise CandidateError(f"the engine failed to make the image: {e}", retryable=False) from None
        finally:
            self._release(handle)
        if not result.encoded:
            raise CandidateError("the engine answered without an encoded image", retryable=False)
        return result.encoded[0]


def build_request(config: ServerConfig, info: ModelInfo, body: dict[str, Any], seed: int,
                  job: str, like: GenerationRequest | None = None, share: str | None = None) -> GenerationRequest:
    """An item's images request fields and capability parameters with one seed -> the validated batch-class request
    of one image. `like`: a request built from the same body (another seed), whose decoded images (controls, image
    prompts, a capability's images) this one shares rather than decoding its own copies."""
    try:
        params = ImageGenerationRequest.model_validate({**fields_of(body), "n": 1, "seed": seed})
        shared = {} if like is None else {"controls": like.controls, "image_prompts": like.image_prompts}
        extras = extension_values(config, info, extras_of(body), like)
        request = generation_request(info, config, params, extras=extras, **shared)
    except ValidationError as e:
        raise CandidateError(error_from_validation(e).message, retryable=False) from None
    except APIError as e:
        raise CandidateError(e.message, retryable=False) from None
    return dataclasses.replace(request, priority="batch", job=job, share=share)


def extension_values(config: ServerConfig, info: ModelInfo, extras: dict[str, Any],
                     like: GenerationRequest | None = None) -> dict[str, Any]:
    """An item's capability parameters as a request's `extras`: the base64 images of those that take images
    (`ModelInfo.extension_images`) decoded, as the images route decodes them, or `like`'s already decoded. APIError
    naming the field."""
    out = dict(extras)
    decoded = dict(like.extras) if like is not None else {}
    for name in set(info.extension_images) & set(out):
        out[name] = decoded[name] if name in decoded else decode_images(name, out[name], config.max_image_bytes,
                                                                        config.max_image_pixels)
    return out


def item_request(config: ServerConfig, info: ModelInfo, params: ImageGenerationRequest, extras: dict[str, Any],
                 check_extras: Callable[[GenerationRequest], None] | None = None) -> GenerationRequest:
    """A job item's request checked as the images route checks a body (`generation_request`), its capability
    parameters' values too when `check_extras` (an in-process engine's, `AsyncEngine.check_extras`) is given: what a
    job is checked by before it is stored. APIError naming the field."""
    request = generation_request(info, config, params, extras=extension_values(config, info, extras))
    if check_extras is not None:
        try:
            check_extras(request)
        except ParamError as e:
            raise error_from_param_error(e, info.extension_params) from None
    return request
