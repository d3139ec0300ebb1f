"""`Retirement`: finished requests from their last step to their answers. Used by the engine core on its loop thread.

Owns: the finished rows' latents copied out of the step buffers, the decodes (batch rows gathered for a few steps
first: decode_batches.py), the image thread pool that waits for the pixels and encodes them (PNG/JPEG/WebP), and
each request's `GenerationResult` with its timings. The loop never waits for a decode: the runner enqueues it and
an image thread waits for the pixels. Whatever fails here answers its requests: they have left the scheduler.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from ..image_metadata import encode_image
from ..request import EngineStepError, GenerationResult, GroupKey
from .decode_batches import DecodeBatches
from .model_runner import ModelRunner
from .previews import PreviewMaker
from .request_state import RequestState, call_safely, fail_request
from .staging import DecodedPixels

logger = logging.getLogger(__name__)
# the steps a finished batch row may wait for companions to decode with: beside interactive requests a job's rows
# finish scattered (about 0.8 a step at 16 live rows and 20 steps), so 4 steps flushed many replays of 1-3 rows
# (each image dearer than in a full replay); 8 fill most (tools/bench_jobs.py's window_decodes_*; BENCHMARKS.md:
# a 2,000-image job)
HOLD_STEPS = 8
# the decoded pixels (float32, pinned on a GPU) waiting for the image threads, in bytes, past which the loop waits
# for them before it decodes more: a GPU decodes a short guidance-free burst faster than two threads encode PNGs, so
# without a bound the backlog grew for as long as the burst lasted and every answer waited longer; with it, the
# work waits in the scheduler's bounded queue instead (429s when full)
MAX_BACKLOG_BYTES = 1 << 30


class Retirement:
    def __init__(self, runner: ModelRunner, previews: PreviewMaker, image_threads: int, metadata: bool,
                 device_failed: Callable[[Exception], None] = lambda e: None):
        self.runner, self.previews = runner, previews
        self.device_failed = device_failed  # told of a failed copy or decode on the loop thread (the failure policy)
        self._closed_by: Exception | None = None  # fail_held's error: later decodes answer with it, never run
        self.metadata = metadata  # encoded images carry their settings (image_metadata.py)
        self._image_threads: set[int] = set()  # their idents: close() may come from one (a result callback)
        self._images = ThreadPoolExecutor(max_workers=image_threads, thread_name_prefix="diffgraph-images",
                                          initializer=lambda: self._image_threads.add(threading.get_ident()))
        self._closing = False  # the engine is closing: the loop no longer waits for the image threads
        self.max_backlog = MAX_BACKLOG_BYTES
        self._backlog = 0  # bytes of decoded pixels handed to the image threads and not delivered yet
        self._drained = threading.Condition()  # notified as the image threads deliver
        self.backlog_waits = 0  # how often the loop waited for the image threads (warned once)
        self._batches = DecodeBatches(max(runner.decode_buckets), HOLD_STEPS)
        # [] records each decode as (rows, batch rows, (start, end) CUDA events or None off CUDA): benchmarks read
        # how finished rows were gathered and whose GPU time a decode is
        self.decode_log: list[tuple[int, int, tuple[torch.cuda.Event, torch.cuda.Event] | None]] | None = None

    def after_step(self, key: GroupKey | None, finished: list[RequestState], step: int, more_coming: bool) -> bool:
        """After engine step `step` of group `key` (None: the engine had nothing to step): its finished requests'
        latents are copied out, then the decodes that are due launch; `more_coming`: live batch rows are left in
        the group. Returns whether finished rows are held for companions (the loop must come back for them)."""
        try:
            latents = torch.cat([self.runner.read_latents(key, s.first_row, s.rows) for s in finished]) \
                if finished else None
            self._keep_latents(key, finished, latents)
        except Exception as e:
            self._failed(key, finished, e)
            return self._batches.holding
        for held in self._batches.due(key, finished, latents, step, more_coming):
            self._decode(*held)
        return self._batches.holding

    def _keep_latents(self, key: GroupKey | None, finished: list[RequestState], latents: torch.Tensor | None) -> None:
        """The host copy of the image latents of each finished request that asked for them (`return_latents`: a
        copy that waits for the device, for those requests only)."""
        row, runner = 0, self.runner
        for s in finished:
            if s.request.return_latents:
                rows = runner.adapter.unpack(runner.model, latents[row:row + s.rows], s.size, key)
                s.final_latents = rows.float().cpu().numpy()
            row += s.rows

    def stop(self) -> None:
        """The engine stops: every held row is decoded and answered now."""
        for held in self._batches.take_all():
            self._decode(*held)

    def fail_held(self, error: Exception) -> None:
        """The engine failed for good: every held row is answered with `error`, and so is every later decode
        (nothing more runs on the device)."""
        self._closed_by = error
        for _, states, _ in self._batches.take_all():
            for s in states:
                fail_request(s, error)

    def closing(self) -> None:
        """The engine is closing, maybe from an image thread (a result callback) that waits for the loop: from now on
        the loop decodes without waiting for the image threads' backlog (the last decodes: held rows, one step's)."""
        with self._drained:
            self._closing = True
            self._drained.notify_all()

    def shutdown(self) -> None:
        """Waits for the image threads to deliver what they have, unless called on one: it cannot join itself (the
        others, and this one once its callback returns, still deliver the rest)."""
        self._images.shutdown(wait=threading.get_ident() not in self._image_threads)

    def _decode(self, key: GroupKey, finished: list[RequestState], latents: list[torch.Tensor]) -> None:
        if self._closed_by is not None:
            for s in finished:
                fail_request(s, self._closed_by)
            return
        sizes = {s.size for s in finished}
        if len(sizes) > 1:  # a group of several image sizes (a transformer's token bucket): one decode per size
            rows = torch.cat(latents)
            starts = np.cumsum([0] + [s.rows for s in finished])
            for size in sizes:
                mine = [i for i, s in enumerate(finished) if s.size == size]
                self._decode(key, [finished[i] for i in mine], [rows[starts[i]:starts[i + 1]] for i in mine])
            return
        try:  # whatever fails here answers `finished`: they have left the scheduler and the decode batches
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
                if self.decode_log is not None and self.runner.cuda else None
            self._wait_for_images()
            if events is not None:
                events[0].record(torch.cuda.current_stream(self.runner.device))
            decoded = self.runner.decode_async(key, torch.cat(latents), finished[0].size)
            if events is not None:
                events[1].record(torch.cuda.current_stream(self.runner.device))
            if self.decode_log is not None:
                self.decode_log.append((sum(s.rows for s in finished), sum(s.rows for s in finished if s.batch),
                                        events))
        except Exception as e:
            return self._failed(key, finished, e)
        done_at, row = time.monotonic(), 0
        row_bytes = decoded.host[0].numel() * decoded.host.element_size()
        for s in finished:  # a task a request: the image threads share one decode's copies, checks and encodes
            with self._drained:
                self._backlog += s.rows * row_bytes
            try:
                self._images.submit(self._deliver, s, row, decoded, done_at, s.rows * row_bytes)
            except RuntimeError:  # the pool is shut down (close() timed out while this step ran): deliver here
                self._deliver(s, row, decoded, done_at, s.rows * row_bytes)
            row += s.rows

    def _wait_for_images(self) -> None:
        """Back-pressure on the loop thread: while the image threads' backlog is above `max_backlog`, the loop waits
        for them to deliver before it decodes more (one decode always goes when the backlog is below it)."""
        with self._drained:
            if self._backlog <= self.max_backlog or self._closing:
                return
            self.backlog_waits += 1
            if self.backlog_waits == 1:
                logger.warning("the image threads are behind the decodes (%d MiB of pixels waiting): the engine waits "
                               "for them; raise image_threads (--image-threads) or ask for jpeg output",
                               self._backlog >> 20)
            while self._backlog > self.max_backlog and not self._closing:
                self._drained.wait()

    def _failed(self, key: GroupKey | None, finished: list[RequestState], e: Exception) -> None:
        logger.exception("decode failed for group %s", key)
        for s in finished:
            fail_request(s, EngineStepError(f"decoding failed: {type(e).__name__}: {e}"))
        self.device_failed(e)

    def _deliver(self, s: RequestState, row: int, decoded: DecodedPixels, done_at: float, nbytes: int) -> None:
        """Answers request `s`, whose images are rows [row, row + s.rows) of `decoded` (on an image thread: it waits
        for the chunk holding its rows only, and takes its own copy of them); then its `nbytes` leave the backlog."""
        try:
            self._answer(s, row, decoded, done_at)
        finally:
            with self._drained:
                self._backlog -= nbytes
                self._drained.notify_all()

    def _answer(self, s: RequestState, row: int, decoded: DecodedPixels, done_at: float) -> None:
        try:
            pixels = decoded.rows(row, s.rows)
        except Exception as e:
            if s.preview_future is not None:  # its previews go first, as before a result
                self.previews.settle(s)
            fail_request(s, EngineStepError(f"decoding failed: {type(e).__name__}: {e}"))
            return
        r = s.request
        try:
            part = pixels.copy()  # its own memory: not the batch's pinned block
            if not np.isfinite(part).all():  # NaN pixels would cast to a black image: say so instead
                raise EngineStepError(
                    f"request {r.request_id} produced non-finite pixels (NaN or infinity): the model's numbers "
                    "overflowed its dtype; lower the LoRA scales or the guidance, or use a float32/bfloat16 model")
            encoded = ([encode_image(a, r.output_format, r, self.runner.model.name, self.metadata) for a in part]
                       if r.output_format else None)
            now = time.monotonic()
            timings = {"queue_ms": (s.admitted_at - s.arrival) * 1e3,
                       "denoise_ms": (done_at - s.admitted_at) * 1e3,
                       "decode_ms": (now - done_at) * 1e3, "total_ms": (now - s.arrival) * 1e3}
            result = GenerationResult(request_id=r.request_id, arrays=part, seed=r.seed, timings=timings,
                                      request=r, encoded=encoded, latents=s.final_latents)
            if s.preview_future is not None:  # its previews go first
                self.previews.settle(s)
            call_safely(s.sink.finish, result, None)
        except Exception as e:
            if s.preview_future is not None:
                self.previews.settle(s)
            fail_request(s, e)
