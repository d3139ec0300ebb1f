"""`Engine`: the public facade and the engine loop.

Requests are validated (request.py), queued in the scheduler and served by one loop thread:

    plan = scheduler.schedule()      # which group, who joins, this step's coefficient table
    self._execute(plan)              # worker: row moves, admission (encode, initial noise), one step
    finished = scheduler.update(plan)

Admission encodes prompts in one batch through an LRU cache of embeddings; each request draws its
initial and ancestral noise from its own CPU generator in diffusers' order, so its images do not
depend on what shares its batch. Finished rows are decoded in one batch; pixels reach the host and
are turned into PIL images (and PNG/JPEG/WebP bytes) on a thread pool, so the loop never waits.
An exception inside a step fails only that batch's requests; the loop keeps running.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from ..config import GraphConfig
from ..models.conditioning import PromptEmbeddings
from ..models.loader import DiffusionModel, load_model
from ..models.presets import DEFAULT_MODEL
from ..request import GenerationRequest, GenerationResult
from ..sampling.samplers import make_plan
from .scheduler import QueueFullError, RequestAborted, RequestState, Scheduler, SchedulerConfig, StepPlan
from .worker import Worker

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[str, int, int], None]  # (request_id, step done, total steps)


class EngineStepError(RuntimeError):
    """A denoising step failed; every request of that batch gets this error."""


def to_pil(arrays: np.ndarray) -> list[Image.Image]:
    """Float pixels [n, H, W, 3] in [0, 1] -> PIL images, rounding as diffusers' numpy_to_pil does."""
    return [Image.fromarray(a) for a in (arrays * 255).round().astype("uint8")]


def encode_image(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format={"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt],
               **({"quality": 95} if fmt in ("jpeg", "webp") else {}))
    return buf.getvalue()


def parse_device(device: str) -> torch.device:
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not understood; use cpu, cuda or cuda:N") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    return parsed


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class _Payload:
    """Engine-side state of a request: its future, generator, embeddings and timestamps."""

    __slots__ = ("request", "future", "on_progress", "generator", "cond", "uncond", "admitted_at")

    def __init__(self, request: GenerationRequest, on_progress: ProgressCallback | None):
        self.request = request
        self.future: Future = Future()
        self.on_progress = on_progress
        self.generator: torch.Generator | None = None
        self.cond: PromptEmbeddings | None = None
        self.uncond: PromptEmbeddings | None = None
        self.admitted_at = 0.0


class Engine:
    """Generates images with an SD1.x/SD2.x/SDXL model; thread-safe; requests share steps.

    >>> engine = Engine(device="cpu")                      # the shipped `digits` model
    >>> images = engine.generate("a handwritten digit seven", seed=1)
    """

    def __init__(self, model: "str | DiffusionModel" = DEFAULT_MODEL, device: str | None = None, dtype: str | None = None,
                 mode: str | None = None, graphs: GraphConfig | None = None, batching: str = "step",
                 max_wait_ms: float = 0.0, max_queue: int = 256, max_rows: int = 16,
                 prompt_cache_size: int = 512, image_threads: int = 2, grow_fill: float = 0.85,
                 grow_hold_ms: float = 2000.0):
        if isinstance(model, DiffusionModel):  # share already-loaded modules (benchmarks, several engines)
            device, dtype = str(model.device), model.dtype
        device = device or default_device()
        cuda = parse_device(device).type == "cuda"
        dtype = dtype or ("fp16" if cuda else "fp32")
        mode = mode or ("graph" if cuda else "eager")
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} is unknown; allowed: graph, eager")
        if mode == "graph" and not cuda and (graphs is None or graphs.backend != "emulated"):
            raise ValueError("mode 'graph' needs a CUDA device; use mode='eager' on the CPU")
        t0 = time.perf_counter()
        self.model: DiffusionModel = model if isinstance(model, DiffusionModel) else load_model(model, device, dtype)
        self.mode = mode
        self.worker = Worker(self.model, max_rows=max_rows, mode=mode, graphs=graphs)
        # in graph mode a step costs its bucket: the scheduler grows a group into a larger bucket only when it
        # fills it (grow_fill) or its queue head has waited grow_hold_ms
        runner = self.worker.runner
        self.scheduler = Scheduler(SchedulerConfig(
            batching=batching, max_rows=self.worker.max_rows, max_wait_ms=max_wait_ms, max_queue=max_queue,
            buckets=self.worker.graph_config.batch_buckets if runner is not None else (),
            padded=tuple(runner.kinds["step"].resolutions()) if runner is not None else (),
            grow_fill=grow_fill, grow_hold_ms=grow_hold_ms))
        self._cache: OrderedDict[tuple[str, Any], PromptEmbeddings] = OrderedDict()
        if prompt_cache_size < 0:
            raise ValueError(f"prompt_cache_size {prompt_cache_size} must be >= 0")
        self._cache_size = prompt_cache_size
        self._images = ThreadPoolExecutor(max_workers=image_threads, thread_name_prefix="diffgraph-images")
        self._cv = threading.Condition()
        self._stop = False
        self._closing = False  # close() was called (as opposed to the loop stopping on its own)
        self.stats = {"steps": 0, "rows_stepped": 0, "failed_steps": 0, "prompt_cache_hits": 0,
                      "prompt_cache_misses": 0}
        self.step_listeners: list[Callable[[StepPlan, float], None]] = []  # (plan, seconds) per step, e.g. metrics
        # set to [] to record (start event, end event, loop waited for work before it) per step (benchmarks)
        self.step_events: list[tuple[Any, Any, bool]] | None = None
        self._idle = False
        self._ready = False
        if mode == "graph" and self.worker.graph_config.prewarm:
            self.worker.prewarm()
        self.ready_s = time.perf_counter() - t0  # load to ready (prewarm graphs captured)
        self._thread = threading.Thread(target=self._loop, name="diffgraph-engine", daemon=True)
        self._thread.start()
        self._ready = True

    # -- public API ----------------------------------------------------------------------------
    def make_request(self, prompt: Any, *, negative_prompt: Any = None, width: Any = None, height: Any = None,
                     num_inference_steps: Any = 20, guidance_scale: Any = None, sampler: Any = "euler",
                     schedule: Any = "default", seed: Any = None, num_images: Any = 1,
                     output_format: Any = None, request_id: str | None = None) -> GenerationRequest:
        size = self.model.native_size
        request = GenerationRequest.create(
            prompt, negative_prompt=negative_prompt,
            width=size if width is None else width, height=size if height is None else height,
            num_inference_steps=num_inference_steps,
            guidance_scale=self.model.default_guidance if guidance_scale is None else guidance_scale,
            sampler=sampler, schedule=schedule, seed=seed, num_images=num_images,
            output_format=output_format, request_id=request_id)
        if request.num_images > self.worker.max_rows:
            raise ValueError(f"num_images {request.num_images} exceeds this engine's largest batch bucket "
                             f"{self.worker.max_rows}")
        self._plan(request)  # a step count this model's schedule cannot take fails here, as bad input
        return request

    def generate(self, prompt: Any, **params: Any) -> GenerationResult:
        """Generates `num_images` images for one prompt and waits for them. The result is a list-like of
        PIL images with `.seed`, `.timings` and `.arrays` (float pixels). Bad parameters raise ValueError."""
        return self.submit(self.make_request(prompt, **params)).result()

    def run(self, request: GenerationRequest) -> GenerationResult:
        return self.submit(request).result()

    def submit(self, request: GenerationRequest, on_progress: ProgressCallback | None = None) -> Future:
        """Queues a request; the future gives its GenerationResult. Raises QueueFullError when the queue is full.
        `on_progress(request_id, step, total)` runs on the engine's loop thread after each step: keep it short
        (hand anything slow to another thread), since every request waits for it."""
        plan = self._plan(request)
        payload = _Payload(request, on_progress)
        state = RequestState(request_id=request.request_id, key=(request.height, request.width),
                             rows=request.num_images, plan=plan, arrival=time.monotonic(), payload=payload)
        with self._cv:
            if self._stop or not self._thread.is_alive():
                raise RuntimeError("the engine is closed (or its loop stopped after an internal error; see the log)")
            self.scheduler.add(state)
            self._cv.notify()
        return payload.future

    def _plan(self, request: GenerationRequest):
        try:
            return make_plan(self.worker.noise_schedule, request.sampler, request.schedule,
                             request.num_inference_steps)
        except ValueError as e:
            raise ValueError(f"num_inference_steps {request.num_inference_steps} does not work with sampler "
                             f"{request.sampler!r} and schedule {request.schedule!r} on this model: {e}") from None

    @property
    def ready(self) -> bool:
        """Built (prewarm graphs captured) and its loop running: False once closed or after a loop failure."""
        return self._ready and not self._stop and self._thread.is_alive()

    def abort(self, request_id: str) -> bool:
        """Frees the request's rows at the next step boundary; its future fails with RequestAborted. True when
        the request was waiting or running; one that is in its last step then still completes with its result."""
        with self._cv:
            found = self.scheduler.abort(request_id)
            self._cv.notify()
        return found

    def reconfigure(self, **changes: Any) -> None:
        """Changes scheduler settings (batching, max_wait_ms, max_queue, grow_fill, grow_hold_ms, max_skips) of
        an idle engine (benchmarks compare modes on one set of graphs)."""
        allowed = {"batching", "max_wait_ms", "max_queue", "grow_fill", "grow_hold_ms", "max_skips"}
        if set(changes) - allowed:
            raise ValueError(f"reconfigure cannot change {sorted(set(changes) - allowed)}; allowed: {sorted(allowed)}")
        with self._cv:
            if self.scheduler.has_work():
                raise RuntimeError("reconfigure needs an idle engine; wait for running requests to finish")
            old = self.scheduler
            self.scheduler = Scheduler(dataclasses.replace(old.config, **changes))
            self.scheduler.growth_holds = old.growth_holds  # a counter: it never goes back

    def graph_table(self) -> list[dict[str, Any]]:
        """Per graph key: status, capture ms, pool MiB added, replays, eager fallbacks, verification diff."""
        return [] if self.worker.runner is None else self.worker.runner.table()

    def queue_depth(self) -> int:
        with self._cv:
            return self.scheduler.num_waiting

    def live_rows(self) -> dict[tuple[int, int], int]:
        """Live rows per (height, width): every graphed resolution (0 when idle), other sizes while they run."""
        runner = self.worker.runner
        rows = dict.fromkeys(runner.kinds["step"].resolutions(), 0) if runner is not None else {}
        with self._cv:
            rows.update({k: g.live_rows for k, g in self.scheduler.groups.items()})
        return rows

    def close(self, timeout: float | None = 10.0) -> None:
        with self._cv:
            self._closing = True
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)
        self._images.shutdown(wait=True)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the loop ------------------------------------------------------------------------------
    def _next_plan(self) -> tuple[StepPlan | None, list[RequestState]]:
        with self._cv:
            self._idle = False  # whether the loop had to wait for work (the GPU idles then, by design)
            while not self._stop:
                plan = self.scheduler.schedule()
                aborted = self.scheduler.take_aborted()
                if plan is not None or aborted:
                    return plan, aborted
                self._idle = True
                self._cv.wait(timeout=self.scheduler.next_deadline())
            return None, self.scheduler.take_aborted()

    def _loop(self) -> None:
        try:
            while self._iteration():
                pass
        except BaseException:  # a bug in the loop itself: answer everyone, refuse new work, keep the process
            logger.exception("the engine loop stopped after an internal error")
            with self._cv:
                self._stop = True
        self._fail_everything(RuntimeError("the engine was closed" if self._closing else
                                           "the engine loop stopped after an internal error (see the log)"))

    def _iteration(self) -> bool:
        """One pass: plan, execute, advance, report, retire. False once the engine is closed."""
        plan, aborted = self._next_plan()
        for s in aborted:
            _fail(s, RequestAborted(f"request {s.request_id} was aborted"))
        if plan is None:
            return not self._stop
        t0 = time.perf_counter()
        events = self.step_events
        if events is not None and self.worker.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        try:
            for src, dst, count in plan.moves:  # compaction first: admitted rows go after the packed ones
                self.worker.move_rows(plan.key, src, dst, count)
            if plan.admitted and not self._admit(plan.key, plan.admitted):
                return True  # some admissions failed and left: plan again without them
            self._execute(plan)
        except Exception as e:  # only this batch fails; the loop keeps serving
            logger.exception("step failed for group %s (%d rows)", plan.key, plan.n_rows)
            self.stats["failed_steps"] += 1
            with self._cv:
                failed = self.scheduler.fail(plan)
            err = EngineStepError(f"the denoising step failed for this batch: {type(e).__name__}: {e}")
            for s in failed:
                _fail(s, err)
            return True
        with self._cv:
            finished = self.scheduler.update(plan)
        for s in plan.live:  # progress first: a request's last progress event comes before its result
            if s.payload.on_progress is not None:
                _call_safely(s.payload.on_progress, s.request_id, s.step, s.steps)
        if finished:
            self._retire(plan.key, finished)
        if events is not None and self.worker.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events.append((start, end, self._idle))
        self.stats["steps"] += 1
        self.stats["rows_stepped"] += plan.n_rows
        for listener in self.step_listeners:
            _call_safely(listener, plan, time.perf_counter() - t0)
        self._release_if_idle(plan.key)
        return True

    def _release_if_idle(self, key: tuple[int, int]) -> None:
        """Frees the buffers of a resolution that has no work and no graphs (any multiple of 8 is a valid size,
        so keeping every size's buffers would let clients exhaust device memory)."""
        with self._cv:
            idle = self.scheduler.is_idle(key)
        if idle:
            self.worker.release_group(key)

    def _execute(self, plan: StepPlan) -> None:
        w = self.worker
        noise = []
        for s in plan.noise_requests:
            p = s.payload
            noise.append((s.first_row, torch.randn((s.rows, *w.latent_shape(plan.key)), generator=p.generator,
                                                   dtype=self.model.dtype)))
        w.step(plan.key, plan.n_rows, plan.coefs, noise)

    def _admit(self, key: tuple[int, int], states: list[RequestState]) -> bool:
        """Batched, cached prompt encoding and initial latents from each request's own
        generator. A request whose admission fails (e.g. a prompt its tokenizer rejects) fails alone and
        leaves the group; returns False when that happened (the plan is then stale)."""
        w = self.worker
        try:
            embeds = self._embed([k for s in states for k in _prompt_keys(s)])
        except Exception:  # find the culprit(s): encode each request alone
            embeds = {}
        ok = True
        now = time.monotonic()
        for s in states:
            p = s.payload
            r = p.request
            try:
                mine = {k: embeds[k] if k in embeds else self._embed([k])[k] for k in _prompt_keys(s)}
                p.generator = torch.Generator("cpu").manual_seed(r.seed)
                latents = torch.randn((s.rows, *w.latent_shape(key)), generator=p.generator, dtype=self.model.dtype)
                latents = latents.float() * s.plan.init_noise_sigma
                w.write_rows(key, s.first_row, latents, mine[("+", r.prompt)], mine[("-", r.negative_prompt)],
                             r.guidance_scale)
                p.admitted_at = now
            except Exception as e:
                logger.warning("admission failed for %s: %s: %s", s.request_id, type(e).__name__, e)
                with self._cv:
                    self.scheduler.remove(s)
                _fail(s, ValueError(f"request {s.request_id} could not be admitted: {type(e).__name__}: {e}"))
                ok = False
        return ok

    def _embed(self, keys: list[tuple[str, Any]]) -> dict[tuple[str, Any], PromptEmbeddings]:
        """Embeddings of every (sign, text), from the LRU cache or encoded (one batch per sign) and cached."""
        out = {}
        missing = []
        for k in dict.fromkeys(keys):
            if k in self._cache:
                self._cache.move_to_end(k)
                out[k] = self._cache[k]
            else:
                missing.append(k)
        self.stats["prompt_cache_hits"] += len(keys) - len(missing)
        self.stats["prompt_cache_misses"] += len(missing)
        pos = [t for sign, t in missing if sign == "+"]
        neg = [t for sign, t in missing if sign == "-"]
        if pos:
            enc = self.worker.encode(pos)
            out.update({("+", t): enc.select(i) for i, t in enumerate(pos)})
        if neg:
            enc = self.worker.encode_negative(neg)
            out.update({("-", t): enc.select(i) for i, t in enumerate(neg)})
        for k in missing:
            self._cache[k] = out[k]
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return out

    def _retire(self, key: tuple[int, int], finished: list[RequestState]) -> None:
        # the finished requests have left the scheduler: whatever fails here must answer them, here
        try:
            latents = torch.cat([self.worker.read_latents(key, s.first_row, s.rows) for s in finished])
            wait = self.worker.decode_async(key, latents)
        except Exception as e:
            logger.exception("decode failed for group %s", key)
            for s in finished:
                _fail(s, EngineStepError(f"decoding failed: {type(e).__name__}: {e}"))
            return
        done_at = time.monotonic()
        try:
            self._images.submit(self._deliver, finished, wait, done_at)
        except RuntimeError:  # the pool is shut down (close() timed out while this step ran): deliver here
            self._deliver(finished, wait, done_at)

    def _deliver(self, finished: list[RequestState], wait: Callable[[], np.ndarray], done_at: float) -> None:
        try:
            arrays = wait()
        except Exception as e:
            for s in finished:
                _fail(s, EngineStepError(f"decoding failed: {type(e).__name__}: {e}"))
            return
        row = 0
        for s in finished:
            p = s.payload
            r = p.request
            try:
                part = arrays[row:row + s.rows]
                images = to_pil(part)
                encoded = [encode_image(im, r.output_format) for im in images] if r.output_format else None
                now = time.monotonic()
                timings = {"queue_ms": (p.admitted_at - s.arrival) * 1e3,
                           "denoise_ms": (done_at - p.admitted_at) * 1e3,
                           "decode_ms": (now - done_at) * 1e3, "total_ms": (now - s.arrival) * 1e3}
                result = GenerationResult(request_id=r.request_id, images=images, arrays=part, seed=r.seed,
                                          timings=timings, request=r, encoded=encoded)
                if not p.future.done():
                    p.future.set_result(result)
            except Exception as e:
                _fail(s, e)
            row += s.rows

    def _fail_everything(self, error: Exception) -> None:
        with self._cv:
            for g in self.scheduler.groups.values():
                for s in list(g.waiting) + list(g.live):
                    _fail(s, error)
                g.waiting.clear()
                g.live.clear()

    # -- diffusers interop ---------------------------------------------------------------------
    def diffusers_pipeline(self, sampler: str | None = None, schedule: str = "default"):
        """The equivalent diffusers pipeline built on the same loaded modules (no copies).

        With `sampler`, its scheduler is the diffusers scheduler equivalent to (sampler, schedule);
        otherwise EulerDiscreteScheduler from the model's scheduler config."""
        from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

        from ..sampling.oracle import diffusers_scheduler

        m = self.model
        config = {k: v for k, v in m.scheduler_config.items() if not k.startswith("_")}
        scheduler = (diffusers_scheduler(config, sampler, schedule) if sampler
                     else EulerDiscreteScheduler.from_config(config))
        if m.family == "sdxl":
            pipe = StableDiffusionXLPipeline(
                vae=m.vae, text_encoder=m.text_encoders[0], text_encoder_2=m.text_encoders[1],
                tokenizer=m.tokenizers[0], tokenizer_2=m.tokenizers[1], unet=m.unet, scheduler=scheduler,
                force_zeros_for_empty_prompt=m.force_zeros_for_empty_prompt)
        else:
            pipe = StableDiffusionPipeline(
                vae=m.vae, text_encoder=m.text_encoders[0], tokenizer=m.tokenizers[0], unet=m.unet,
                scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        return pipe


def _prompt_keys(state: RequestState) -> tuple[tuple[str, Any], tuple[str, Any]]:
    r = state.payload.request
    return ("+", r.prompt), ("-", r.negative_prompt)


def _call_safely(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # a caller's callback must not stop the engine
        logger.exception("callback %r failed", fn)


def _fail(state: RequestState, error: BaseException) -> None:
    fut = state.payload.future
    if not fut.done():
        fut.set_exception(error)


__all__ = ["Engine", "EngineStepError", "QueueFullError", "RequestAborted"]
