"""Batch jobs over HTTP, on `diffgraph serve --state-dir DIR`:

    POST   /v1/jobs                      a job: JSON {"items": [...]} or {"grid": {...}} (with "name", "webhook"), or
                                         JSONL (Content-Type application/x-ndjson or application/jsonl: one item a
                                         line; ?name=&webhook=); checked whole before it is stored (jobs/spec.py,
                                         what it names by jobs/references.py), within its key's limits (429, 507)
    GET    /v1/jobs                      the caller's jobs, newest first (?limit=)
    GET    /v1/jobs/{id}                 status (paused: its reason, a full disk or the key's --max-key-bytes),
                                         counts (done / failed / pending), images_per_s, eta_s
    GET    /v1/jobs/{id}/results         per item: status, seeds, image URLs, error (?offset=&limit=, pages of items)
    GET    /v1/jobs/{id}/images/{name}   a stored image, ITEM-K.png (candidate K of item ITEM), settings inside
    POST   /v1/jobs/{id}/cancel          stops it: its requests in flight are aborted at the next step
    DELETE /v1/jobs/{id}                 deletes it and its images (cancelling it first)

A job belongs to the API key that made it (a hash of it is stored); another key gets 404, as for a job that does
not exist. Jobs run on the served model (`--model`; an item naming another is refused). Without --state-dir every
/v1/jobs path answers 404 saying how to turn jobs on. `JobService` is what app.py starts and stops with the app: the
store (opened at start: a store that cannot be opened makes these routes answer 503 with why, and the images API
serves on) and the coordinator task (jobs/coordinator.py). OpenAI's Batch API front (/v1/files, /v1/batches) is
not here.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..jobs.backend import EngineBackend, item_request
from ..jobs.coordinator import Coordinator, CoordinatorSettings
from ..jobs.references import References
from ..jobs.spec import JobSpec, SpecError, SpecLimits, parse_job
from ..jobs.store import JobRow, JobStore, KeyLimits, QuotaError, StoreError, image_name, job_summary, owner_of
from ..jobs.webhook import WebhookRefused, WebhookSender, check_webhook, webhook_secret
from ..request import ModelInfo, ParamError
from .auth import caller_key
from .bodies import read_body
from .context import AppContext, error_response
from ..api.protocol import APIError, ImageGenerationRequest, error_from_param_error
from .requests import ServerState, submit

logger = logging.getLogger("diffgraph.jobs")

MAX_JOB_BYTES = 128 * 1024 * 1024  # a job body (100,000 items of about 1 KiB fit)
JSONL_TYPES = ("application/x-ndjson", "application/jsonl", "application/x-jsonlines", "application/jsonlines",
               "text/jsonl")
_JOB_ID = re.compile(r"^job_[0-9a-f]{24}$")
_IMAGE = re.compile(r"^([0-9]{1,9})-([0-9]{1,3})\.png$")
DISABLED = ("batch jobs are off on this server; start it with --state-dir DIR (the folder where jobs and their "
            "images are kept)")


class JobService:
    """The job store and the coordinator of one app; `start` and `stop` run in its lifespan."""

    def __init__(self, state: ServerState):
        self.state = state
        self.key_limits = KeyLimits(jobs=state.config.max_key_jobs, bytes=state.config.max_key_bytes)
        self.store: JobStore | None = None
        self.coordinator: Coordinator | None = None
        self.error: str | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        config, state = self.state.config, self.state
        if config.state_dir is None:
            return
        try:
            self.store = await asyncio.to_thread(JobStore, config.state_dir)
        except StoreError as e:
            self.error = str(e)
            logger.error("%s; /v1/jobs answers 503 until it is fixed", e)
            return
        backend = EngineBackend(
            config, info=lambda: state.info if state.ready else None,
            submit=lambda request: submit(state, request, progress=False),
            release=lambda handle: state.handles.pop(handle.request_id, None),
            replicas=lambda: len(state.engine.replicas) if state.engine is not None else 1)
        webhooks = (WebhookSender(config.webhook_allow, webhook_secret(config.webhook_secret, config.api_keys))
                    if config.webhook_allow else None)
        self.coordinator = Coordinator(self.store, backend, webhooks,
                                       CoordinatorSettings(inflight=config.batch_inflight,
                                                           retention_s=config.job_retention), self.key_limits)
        self._task = asyncio.create_task(self.coordinator.run())

    async def stop(self) -> None:
        """Stops the coordinator: its requests in flight are aborted, their candidates stay pending (resumed by the
        next start)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    def require(self) -> tuple[JobStore, Coordinator]:
        if self.store is None or self.coordinator is None:
            raise APIError(503, self.error or "the job store is opening; retry in a moment", code="jobs_unavailable")
        return self.store, self.coordinator


def _form(content_type: str) -> str:
    kind = content_type.split(";", 1)[0].strip().lower()
    return "jsonl" if kind in JSONL_TYPES else "json" if kind == "application/json" else "auto"


def _bounded(value: str | None, default: int, most: int, name: str) -> int:
    if value is None:
        return default
    if not re.fullmatch(r"[0-9]{1,12}", value) or int(value) > most:  # isdigit() takes "²", int() not
        raise APIError(400, f"{name} must be an integer in 0..{most}", param=name)
    return int(value)


async def _answer(work: Callable[[], Awaitable[Any]]) -> Response:
    try:
        value = await work()
        return value if isinstance(value, Response) else JSONResponse(value)
    except APIError as e:
        return error_response(e)
    except StoreError as e:  # damaged or locked: 503 with what to do; full: 507
        return JSONResponse(APIError(e.status, str(e), code=e.code).body(), status_code=e.status,
                            headers={"retry-after": "1"} if e.code == "job_store_busy" else None)


class JobRequests:
    """What the /v1/jobs routes share: the service, the API keys (whose hash owns a job), the limits a job is read
    within and the references its items' names are checked against."""

    def __init__(self, ctx: AppContext, service: JobService):
        config = ctx.state.config
        self.state, self.config, self.keys, self.service = ctx.state, config, ctx.keys, service
        self.limits = SpecLimits(max_items=config.max_batch_items, max_candidates=config.max_job_candidates)
        self.references = References(config)
        self.key_limits = service.key_limits  # checked when a job is made, and by the coordinator while it runs
        self.read_timeout = min(config.body_timeout, config.request_timeout)

    def owner(self, http: Request) -> str:
        keys = self.keys
        index = caller_key(http.scope, keys) if keys else None
        return owner_of(keys[index] if index is not None else None)

    async def owned(self, http: Request, job: str) -> tuple[JobStore, Coordinator, JobRow]:
        store, coordinator = self.service.require()
        row = await asyncio.to_thread(store.job, job) if _JOB_ID.match(job) else None
        if row is None or row.owner != self.owner(http):
            raise APIError(404, f"job {job[:40]!r} not found (GET /v1/jobs lists your jobs)", param="id",
                           code="job_not_found")
        return store, coordinator, row

    def check(self, info: ModelInfo) -> Callable[[ImageGenerationRequest, dict[str, Any]], object]:
        config, state = self.config, self.state
        named = self.references.checker()  # one job's: each LoRA, ControlNet, ... looked up once
        check = state.engine.check_extras if state.engine is not None else None

        def item(params: ImageGenerationRequest, extras: dict[str, Any]) -> object:
            # the images route's rules, its pixel limit, the names, the capability parameters' values
            request = item_request(config, info, params, extras, check)
            pixels = request.width * request.height
            if state.max_pixels is not None and pixels > state.max_pixels:
                raise APIError(400, f"size {request.width}x{request.height} is {pixels} pixels; this server takes at "
                                    f"most {state.max_pixels} pixels an image (--max-pixels)", param="size")
            try:
                named(request)
            except ParamError as e:
                raise error_from_param_error(e) from None
            return request
        return item

    async def read_spec(self, http: Request) -> JobSpec:
        read_timeout = self.read_timeout
        try:
            body = await asyncio.wait_for(read_body(http, MAX_JOB_BYTES), read_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"the job did not arrive within {read_timeout:g} s; send the whole body at once",
                           code="body_timeout") from None
        except APIError as e:
            if e.status == 413:
                e.message = f"{e.message}: split the job into several jobs"
            raise
        info = self.state.info
        try:
            spec = await asyncio.to_thread(parse_job, body, _form(http.headers.get("content-type", "")), self.limits,
                                           self.check(info), http.query_params.get("name"),
                                           http.query_params.get("webhook"), info.extension_params)
            if spec.webhook is not None:
                check_webhook(spec.webhook, self.config.webhook_allow)
        except SpecError as e:
            raise APIError(400, e.message, param=e.param, code="invalid_job") from None
        except WebhookRefused as e:
            raise APIError(400, str(e), param="webhook", code="invalid_job") from None
        return spec

    async def create(self, http: Request) -> Any:
        store, coordinator = self.service.require()
        self.state.accepting()  # the model's rules are needed to check the items: 503 while it loads
        try:
            await asyncio.to_thread(store.check_quota, self.owner(http), self.key_limits)  # before the body is read
            spec = await self.read_spec(http)
            row = await asyncio.to_thread(store.create, self.owner(http), spec, self.state.info.name, None,
                                          self.key_limits)
        except QuotaError as e:
            raise APIError(e.status, str(e), code="job_quota") from None
        coordinator.wake()
        return job_summary(row, None)

    async def results(self, http: Request, job: str) -> Any:
        store, _, row = await self.owned(http, job)
        offset = _bounded(http.query_params.get("offset"), 0, 10**9, "offset")
        limit = _bounded(http.query_params.get("limit"), 1000, 10_000, "limit")
        items = await asyncio.to_thread(store.results, job, offset, limit)
        base = (self.config.public_url or str(http.base_url)).rstrip("/") + f"/v1/jobs/{job}/images/"
        data = []
        for r in items:
            if all(s == "done" for s in r.statuses):
                status = "done"
            elif "pending" in r.statuses:
                status = "cancelled" if row.status == "cancelled" else "pending"
            else:
                status = "failed"
            data.append({"item": r.item, "status": status, "prompt": r.prompt, "seeds": list(r.seeds),
                         "images": [base + image_name(r.item, k) if s == "done" else None
                                    for k, s in enumerate(r.statuses)],
                         "error": next((e for e in r.errors if e), None)})
        return {"object": "list", "job": job, "status": row.status, "offset": offset, "total": row.items,
                "has_more": offset + len(data) < row.items, "data": data}

    async def image(self, http: Request, job: str, name: str) -> Any:
        store, _, row = await self.owned(http, job)
        m = _IMAGE.match(name)
        path = store.image_path(job, int(m.group(1)), int(m.group(2))) if m else None
        data = await asyncio.to_thread(_read, path) if path else None
        if data is None:
            raise APIError(404, f"image {name[:40]!r} of job {job} not found (GET /v1/jobs/{job}/results lists "
                                "its images)", code="image_not_found")
        return Response(data, media_type="image/png", headers={"Cache-Control": "private, max-age=86400"})


def jobs_router(ctx: AppContext) -> tuple[APIRouter, JobService]:
    """The /v1/jobs routes (see the module doc), and the service app.py starts and stops with the app."""
    service = JobService(ctx.state)
    router = APIRouter()
    if ctx.state.config.state_dir is None:
        @router.api_route("/v1/jobs", methods=["GET", "POST"], include_in_schema=False)
        @router.api_route("/v1/jobs/{rest:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
        async def jobs_off(http: Request) -> Response:
            return JSONResponse(APIError(404, DISABLED, code="jobs_disabled").body(), status_code=404)
        return router, service
    jobs = JobRequests(ctx, service)
    _add_reads(router, jobs)
    _add_writes(router, jobs)
    return router, service


def _add_reads(router: APIRouter, jobs: JobRequests) -> None:
    """The GET routes: the caller's jobs, one job, its results and its images."""
    @router.get("/v1/jobs")
    async def list_jobs(http: Request) -> Response:
        async def work() -> Any:
            store, _ = jobs.service.require()
            rows = await asyncio.to_thread(store.jobs, jobs.owner(http),
                                           _bounded(http.query_params.get("limit"), 100, 1000, "limit"))
            rates = await asyncio.to_thread(lambda: [store.rate(r) for r in rows])
            return {"object": "list", "data": [job_summary(r, rate) for r, rate in zip(rows, rates)]}
        return await _answer(work)

    @router.get("/v1/jobs/{job}")
    async def get_job(job: str, http: Request) -> Response:
        async def work() -> Any:
            store, _, row = await jobs.owned(http, job)
            return job_summary(row, await asyncio.to_thread(store.rate, row))
        return await _answer(work)

    @router.get("/v1/jobs/{job}/results")
    async def job_results(job: str, http: Request) -> Response:
        return await _answer(lambda: jobs.results(http, job))

    @router.get("/v1/jobs/{job}/images/{name}")
    async def job_image(job: str, name: str, http: Request) -> Response:
        return await _answer(lambda: jobs.image(http, job, name))


def _add_writes(router: APIRouter, jobs: JobRequests) -> None:
    """The routes that create, cancel and delete a job."""
    @router.post("/v1/jobs")
    async def create_job(http: Request) -> Response:
        return await _answer(lambda: jobs.create(http))

    @router.post("/v1/jobs/{job}/cancel")
    async def cancel_job(job: str, http: Request) -> Response:
        async def work() -> Any:
            store, coordinator, row = await jobs.owned(http, job)
            if row.unfinished:
                row = await asyncio.to_thread(store.cancel, job) or row
                coordinator.drop(job)
            return job_summary(row, await asyncio.to_thread(store.rate, row))
        return await _answer(work)

    @router.delete("/v1/jobs/{job}")
    async def delete_job(job: str, http: Request) -> Response:
        async def work() -> Any:
            store, coordinator, _ = await jobs.owned(http, job)
            coordinator.drop(job)
            await asyncio.to_thread(store.delete, job)
            return {"id": job, "object": "job", "deleted": True}
        return await _answer(work)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # not stored (yet), or unreadable: not found
        return None
