"""The calling key's AUTOMATIC1111 requests in flight, and its options.

AUTOMATIC1111 runs one job at a time for everyone; here each API key (without keys: the server) has its own list of
/sdapi/v1/txt2img and /img2img requests, oldest first, each a list of one-image engine requests, the key's from
its first image in the engine (`JobBoard.submit`: AUTOMATIC1111's job begins there). `progress` is
GET /sdapi/v1/progress for the key (AUTOMATIC1111's fields: progress 0..1 with its 0.01 floor while running,
eta_relative, `state` with job_count = the images in flight and job_no = those done); `interrupt` aborts the images
of the key's oldest request that have not finished (its answer returns with the images that did); `skip` aborts the
current image of that request only (its first unfinished one). `current_image` is that image's latest live preview
(its requests ask for one every few steps: a1111_protocol.PREVIEW). `KeyOptions` are the defaults POST /sdapi/v1/options
sets for the key (the model, the clip skip, the web UI's own options). Everything here runs on the event loop: no locks.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Awaitable, Callable

from ..engine.client import RequestHandle
from ..request import GenerationRequest
from .a1111_protocol import ProgressResponse, ProgressState

Key = int | None  # the index of the caller's API key; None on a server without keys


@dataclass
class ImageRun:
    """One image of a request: its engine request and how far it is."""

    handle: RequestHandle
    total: int                 # its denoising steps
    step: int = 0
    finished: bool = False
    dropped: bool = False      # aborted by /interrupt or /skip: left out of the answer
    preview: bytes | None = None  # its latest live preview (encoded)


@dataclass
class Job:
    key: Key
    kind: str                  # "txt2img" | "img2img"
    images: list[ImageRun]
    started: float = field(default_factory=time.time)
    skipped: bool = False
    interrupted: bool = False

    def open(self) -> list[ImageRun]:
        return [r for r in self.images if not (r.finished or r.dropped)]


@dataclass
class KeyOptions:
    model: str | None = None   # sd_model_checkpoint: None is the server's default model
    clip_stop: int | None = None  # CLIP_stop_at_last_layers: None is the server's --clip-skip
    applied: dict[str, Any] = field(default_factory=dict)  # the request options set (a1111_protocol.REQUEST_OPTIONS)
    ui: dict[str, Any] = field(default_factory=dict)  # the web UI options set (a1111_protocol.UI_OPTIONS)


class JobBoard:
    def __init__(self, abort: Callable[[RequestHandle], None]):
        self._abort = abort
        self._jobs: dict[Key, list[Job]] = {}
        self._options: dict[Key, KeyOptions] = {}

    def options(self, key: Key) -> KeyOptions:
        return self._options.get(key, KeyOptions())

    def set_options(self, key: Key, options: KeyOptions) -> None:
        self._options[key] = options

    async def submit(self, key: Key, kind: str, requests: list[GenerationRequest],
                     submit_one: Callable[[GenerationRequest], Awaitable[RequestHandle]]) -> Job:
        """Submits a request's images in order and answers its job. The job begins (is the key's, for /progress,
        /interrupt and /skip) with its first image in the engine, AUTOMATIC1111's `state.begin`: an /interrupt
        before that stops the key's current job, not this one. An /interrupt while its other images are submitted
        stops those too, each aborted as it is queued. On a failure the images queued are aborted and the job
        ends."""
        job = Job(key, kind, [])
        try:
            for request in requests:
                run = ImageRun(await submit_one(request), request.denoising_steps)
                job.images.append(run)
                if len(job.images) == 1:
                    self._jobs.setdefault(key, []).append(job)
                elif job.interrupted:
                    run.dropped = True
                    self._abort(run.handle)
        except BaseException:
            for run in job.open():
                self._abort(run.handle)
            self.end(job)
            raise
        return job

    def end(self, job: Job) -> None:
        jobs = self._jobs.get(job.key, [])
        if job in jobs:
            jobs.remove(job)
        if not jobs:
            self._jobs.pop(job.key, None)

    def _current(self, key: Key) -> Job | None:
        return next(iter(self._jobs.get(key, ())), None)

    def interrupt(self, key: Key) -> None:
        job = self._current(key)
        if job is not None:
            job.interrupted = True
            for run in job.open():
                run.dropped = True
                self._abort(run.handle)

    def skip(self, key: Key) -> None:
        job = self._current(key)
        runs = job.open() if job is not None else []
        if runs:
            job.skipped = True
            runs[0].dropped = True
            self._abort(runs[0].handle)

    def progress(self, key: Key, with_image: bool = True) -> ProgressResponse:
        jobs = self._jobs.get(key, [])
        runs = [r for job in jobs for r in job.images]
        if not runs:
            return ProgressResponse(progress=0.0, eta_relative=0.0, state=ProgressState())
        current = jobs[0]
        done = sum(r.finished or r.dropped for r in runs)
        fraction = sum(1.0 if r.finished or r.dropped else min(r.step / max(r.total, 1), 1.0) for r in runs) / len(runs)
        progress = min(0.01 + fraction, 1.0)  # AUTOMATIC1111's floor: a running job never reads 0
        elapsed = time.time() - current.started
        now = next(iter(current.open()), current.images[-1])
        state = ProgressState(skipped=current.skipped, interrupted=current.interrupted, job=current.kind,
                              job_count=len(runs), job_no=done, sampling_step=now.step, sampling_steps=now.total,
                              job_timestamp=datetime.fromtimestamp(current.started).strftime("%Y%m%d%H%M%S"))
        image = base64.b64encode(now.preview).decode("ascii") if with_image and now.preview else None
        return ProgressResponse(progress=progress, eta_relative=max(elapsed / progress - elapsed, 0.0), state=state,
                                current_image=image)
