"""`EngineCore`: the engine loop and its bookkeeping. It owns the scheduler and the loop thread.

    plan = scheduler.schedule()        # CPU: which group runs, who joins, this step's coefficient table
    runner.execute(...)                # device: row moves, admission (encode, initial noise), one step
    finished = scheduler.update(plan)  # CPU: advance rows, retire finished requests

Owns: admission bookkeeping, abort, progress events (and live previews: previews.py), the per-request answer
channels (`RequestSink`), weight invalidations (run between steps on the loop thread), step listeners and counters.
It touches the device only through its `ModelRunner`, only from the loop thread; finished requests go to
`Retirement` (retirement.py: their decodes, batch rows gathered first, and results), so the loop never waits for a
decode. A failed step fails only its requests; a bug in the loop itself fails the engine (failures.py) and every
request.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable, Iterable

import numpy as np
import torch

from ..request import (EngineClosed, EngineStepError, GenerationRequest, GroupKey, ProgressEvent,
                       RequestAborted)
from ..features.base import Admission
from ..sampling.sde import BrownianNoise
from ..text.prepared import empty_prompt, prepare
from .controlnets import resolve_controls
from .ip_adapters import resolve_image_prompt
from .device_loop import STOPPED, DeviceLoop
from .edits import prepare_edit, preprocess_edit
from .failures import FailurePolicy
from .model_runner import ModelRunner
from .previews import PreviewMaker
from .prompts import PromptKey
from .prompt_schedule import switches
from .retirement import Retirement
from .request_state import RequestSink, call_safely, fail_request, schedule_length
from .scheduler import RequestState, Scheduler, SchedulerConfig, StepPlan

logger = logging.getLogger(__name__)

class EngineCore:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig, image_threads: int = 2, metadata: bool = True,
                 loop: DeviceLoop | None = None, max_step_failures: int = 3):
        self.runner = runner
        self.scheduler = Scheduler(config)
        self.previews = PreviewMaker.of(runner)  # live previews of the requests that ask (previews.py)
        self.retirement = Retirement(runner, self.previews, image_threads, metadata,  # finished rows to answers
                                     self._decode_failed)
        self._holding = False  # finished batch rows wait for companions (Retirement.after_step): come back for them
        self.failures = FailurePolicy(max_step_failures)  # when failing steps fail the engine (failures.py)
        self.on_failure: list[Callable[[str], None]] = []  # called once, on the loop thread, when it trips
        self.loop = loop or DeviceLoop()  # shared by the cores of several models on one device (a ModelSet)
        self._cv = self.loop.cv
        self._finished = threading.Event()
        self._bound = self._started = self._stop = self._idle = False
        self._closing = False  # close() was called (as opposed to the loop stopping on its own)
        self._pending: list[tuple[Callable[[], Any], Future]] = []  # work for the loop thread between steps
        self.stats = {"steps": 0, "rows_stepped": 0, "failed_steps": 0}
        self.step_listeners: list[Callable[[StepPlan, float], None]] = []  # (plan, seconds) per step, e.g. metrics
        self.step_events: list[tuple[Any, Any, bool]] | None = None  # [] records (start, end, waited) per step
        # requests wait for the registered capabilities' file slots, never fail
        self._files = runner.capabilities.gates()
        self.scheduler.gates = self._files
        for files in self._files:
            files.wake = self.loop.wake  # a host copy was read again for a waiting request: plan again
        if runner.controls is not None:  # and for ControlNet slots (controlnets.py)
            self.scheduler.gates += (runner.controls,)

    def start(self) -> None:
        self.loop.attach(self)
        self._started = True

    @property
    def _thread(self) -> threading.Thread | None:
        """The loop's thread (tests join it after a loop failure)."""
        return self.loop.thread

    def _live(self) -> bool:
        """Started, not closed, its loop's thread alive (read under the loop's lock: attributes, no calls)."""
        return (self._started and not self._stop and self.failures.reason is None and self.loop.thread is not None
                and self.loop.thread.is_alive())

    # -- requests ------------------------------------------------------------------------------
    def asks_files(self, request: GenerationRequest) -> bool:
        """Whether the request names files in its own fields that `resolve_files` reads (e.g. adapters)."""
        return any(getattr(request, f) for f in self.runner.capabilities.request_fields)

    def resolve_files(self, request: GenerationRequest) -> dict:
        """The files the request names in its own fields, read and checked (`ModelCapabilities.resolve`; files are
        read on the caller's thread, never on the loop). Raises ParamError naming the field."""
        return self.runner.capabilities.resolve(request) if self.asks_files(request) else {}

    def submit(self, request: GenerationRequest, sink: RequestSink, files: dict | None = None) -> None:
        """Queues a request. Raises ParamError (its step count on this model, its adapters), QueueFullError,
        EngineClosed. `files`: what `resolve_files` gave for it already (else they are resolved here). The request
        runs with what its files recommend for the fields it left to the model (`ModelCapabilities.recommended`: a
        LoRA sidecar's schedule, steps, guidance), and its result carries that request."""
        files = self.resolve_files(request) if files is None else files
        request = self.runner.capabilities.recommended(request, files) if files else request
        plan = self.runner.request_plan(request)
        # registered capabilities' parameters (none: every capability is neutral), before the group: it may read them
        prepared = self.runner.capabilities.prepare(dict(request.extras), self.runner.model.name) \
            if request.extras else {}
        # parsed and tokenised here, on the submitting thread (a prompt schedule's texts each), with what the encoder
        # reads beside them (a vision-language encoder's images, from the capabilities' preparations)
        prompts = prepare(self.runner.text_setup, request, *schedule_length(plan, request.hires_of),
                          inputs=self.runner.prompt_inputs(prepared))
        state = RequestState.of(request, plan, time.monotonic(), sink, prompts,
                                self.runner.group_key(request.key, prompts, prepared, request.tiling))
        state.prepared = {**prepared, **files}
        state.edit_pixels = preprocess_edit(request, self.runner.model.vae_scale_factor) if request.edit else None
        if len({p.chunks for p in _read(state)}) > 1:
            state.empty_prompt = empty_prompt(self.runner.text_setup, prompts[0])
        state.controls = resolve_controls(self.runner.controls, request) if request.controls else ()  # 400s here
        if request.image_prompts:  # its adapter's weights and image embeddings reach the device: on the loop thread
            # on a GPU, whose graph captures (first use of a shape) forbid another thread's device work meanwhile
            resolve = partial(resolve_image_prompt, self.runner.image_prompts, request)
            state.image_prompts = self.call_between_steps(resolve).result() if self.runner.cuda else resolve()
        with self._cv:
            if not self._live():
                raise EngineClosed(f"the engine failed: {self.failures.reason}" if self.failures.reason else
                                   "the engine is closed (or its loop stopped after an internal error; see the log)")
            self.scheduler.add(state)
            self._cv.notify()

    def abort(self, request_id: str, sink: RequestSink | None = None) -> bool:
        """Frees the request's rows at the next step boundary; it fails with RequestAborted. True when the request
        was waiting or running; one that is in its last step then still completes with its result. With `sink`,
        only the request answering to that sink (a finished request's id may be in use again by a new one)."""
        with self._cv:
            found = self.scheduler.abort(request_id, owner=sink)
            self._cv.notify()
        return found

    def call_between_steps(self, fn: Callable[[], Any]) -> Future:
        """Runs `fn` on the loop thread between two steps (e.g. `runner.invalidate`); the future gives its result.
        Called on the loop thread itself (a step listener, a progress callback), it runs at once: that is between
        steps already, and waiting for the loop there would wait forever."""
        future: Future = Future()
        if threading.current_thread() is self.loop.thread:
            self._run_pending([(fn, future)], [])
            return future
        with self._cv:
            if not self._live():
                raise EngineClosed("the engine is closed")
            self._pending.append((fn, future))
            self._cv.notify()
        return future

    @property
    def ready(self) -> bool:
        return self._live()

    def reconfigure(self, **changes: Any) -> None:
        """Changes scheduler settings of an idle engine (benchmarks compare modes on one set of graphs)."""
        allowed = {"batching", "max_wait_ms", "max_queue", "grow_fill", "grow_hold_ms", "max_skips"}
        if set(changes) - allowed:
            raise ValueError(f"reconfigure cannot change {sorted(set(changes) - allowed)}; allowed: {sorted(allowed)}")
        with self._cv:
            if self.scheduler.has_work():
                raise RuntimeError("reconfigure needs an idle engine; wait for running requests to finish")
            old = self.scheduler
            self.scheduler = Scheduler(dataclasses.replace(old.config, **changes))
            self.scheduler.growth_holds = old.growth_holds  # a counter: it never goes back
            self.scheduler.gates = old.gates

    def has_work(self) -> bool:  # requests waiting or running (a ModelSet never evicts such an engine)
        with self._cv:
            return self.scheduler.has_work()

    def queue_depth(self) -> int:
        with self._cv:
            return self.scheduler.num_waiting

    def live_rows(self) -> dict[GroupKey, int]:
        """Live rows per (height, width): every graphed resolution (0 when idle), other sizes while they run; a
        resolution's tiling group counted with it."""
        rows = dict.fromkeys(self.runner.graphed_resolutions(), 0)
        with self._cv:
            # a group that just emptied stays in the scheduler until its next schedule(): not running, not listed
            busy = [(k[:2], g.live_rows) for k, g in self.scheduler.groups.items() if g.live or g.waiting]
        rows.update(dict.fromkeys((k for k, _ in busy), 0))
        for resolution, n in busy:
            rows[resolution] += n
        return rows

    def close(self, timeout: float | None = 10.0) -> None:
        with self._cv:
            self._closing = self._stop = True
            self._cv.notify_all()
        self.retirement.closing()  # (called on an image thread, the loop's last decodes must not wait for it)
        if self._started and threading.current_thread() is not self.loop.thread:
            self._finished.wait(timeout)
        self.retirement.shutdown()
        self.previews.close()

    # -- the loop (device_loop.py runs these on its thread) ---------------------------------------
    def next_deadline(self) -> float | None:
        return self.scheduler.next_deadline()

    def poll(self) -> tuple[StepPlan | None, list[RequestState], list] | str | None:
        """Under the loop's lock: the between-step work, the next plan and the aborted ones; None (idle); STOPPED."""
        if self._stop:
            return STOPPED
        pending, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        aborted = self.scheduler.take_aborted()
        held = self._holding  # nothing to step: held decodes go now (run)
        return (plan, aborted, pending) if plan is not None or aborted or pending or held else None

    def finish(self, error: BaseException | None) -> None:
        """On the loop thread, once: the last between-step work, then every request answered."""
        with self._cv:
            self._stop = True
            pending, self._pending = self._pending, []
            aborted = self.scheduler.take_aborted()
        self._run_pending(pending if error is None else [], aborted)  # the aborted are answered either way
        if error is None:
            pending = []
        if error is not None and self.failures.loop_failed(error):  # failed, as a tripped policy (on_failure)
            self._trip()  # held rows too: nothing more runs on the device
        try:
            self.retirement.stop()  # finished rows waiting for companions: decoded, answered
        except Exception:  # (each decode answers its own failures: this is a bug's last guard)
            logger.exception("retiring the held rows failed")
        self._holding = False
        for _, future in pending:
            future.set_exception(EngineClosed("the engine loop stopped after an internal error (see the log)"))
        self._fail_everything(EngineClosed("the engine was closed" if self._closing and error is None else
                                           "the engine loop stopped after an internal error (see the log)"))
        self._finished.set()

    def _run_pending(self, pending: list, aborted: list[RequestState]) -> None:
        for fn, future in pending:  # before the plan runs: nothing of the old weights is in flight on the host
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)
        for s in aborted:
            fail_request(s, RequestAborted(f"request {s.request_id} was aborted"))

    def run(self, work: tuple[StepPlan | None, list[RequestState], list], waited: bool) -> None:
        """One pass: between-step work, then the plan: execute, advance, report, retire."""
        if not self._bound:
            self.runner.bind_thread()
            self._bound = True
        plan, aborted, pending = work
        self._idle = waited  # whether the loop had to wait for work (the GPU idles then, by design)
        self._run_pending(pending, aborted)
        if aborted:  # an abort may have emptied a size
            self._release_idle({s.key for s in aborted})
        if plan is not None:
            self._step(plan)
        elif self._holding:
            self._holding = self.retirement.after_step(None, [], self.scheduler.steps_run, False)

    def _step(self, plan: StepPlan) -> None:
        t0 = time.perf_counter()
        events = self.step_events if self.runner.cuda else None  # a bench may drop the list while this step runs
        if events is not None:
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.runner.device))
        try:
            for s, row in plan.preempted:  # batch rows giving way: their whole state, saved where they were
                s.saved = self.runner.buffers(plan.key).save_rows(row, s.rows, s.plan.history)
            for src, dst, count in plan.moves:  # compaction first: admitted rows go after the packed ones
                self.runner.move_rows(plan.key, src, dst, count)
            for s in plan.resumed:  # preempted rows back where they stopped: nothing is drawn or encoded again
                self.runner.buffers(plan.key).restore_rows(s.first_row, s.saved)
                s.saved = None
            if plan.admitted and not self._admit(plan.key, plan.admitted):
                return self._release_idle((plan.key,))  # some admissions failed and left: plan again without them
            for s in plan.live:  # a prompt schedule's next text, written before the step that reads it
                if s.switches and (values := s.switches.get(s.step)) is not None:
                    self.runner.update_rows(plan.key, s.first_row, s.rows, values)
            variant = self.runner.program.variant([s.variant_parts for s in plan.live])
            plan.cost_rows = self.runner.step(
                plan.key, plan.coefs, [(s.first_row, s.rows, s.branches_now) for s in plan.live],
                [(s.first_row, s.rows, s.generator if s.noise is None else partial(s.noise.draw, s.step), s.size)
                 for s in plan.noise_requests], variant, [s.variant_parts for s in plan.live])
        except Exception as e:  # only this batch fails; the loop keeps serving
            logger.exception("step failed for group %s (%d rows)", plan.key, plan.n_rows)
            self.stats["failed_steps"] += 1
            with self._cv:
                failed = self.scheduler.fail(plan)
            err = EngineStepError(f"the denoising step failed for this batch: {type(e).__name__}: {e}")
            for s in failed:
                fail_request(s, err)
            if self.failures.step_failed(e):
                self._trip()
            return self._release_idle((plan.key,))
        self.failures.streak = 0
        with self._cv:
            finished = self.scheduler.update(plan)
        for s in plan.live:  # progress first: a request's last progress event comes before its result
            call_safely(s.sink.progress, ProgressEvent(s.request_id, s.step, s.steps))
        if any(s.request.preview for s in plan.live):  # before the rows retire: their D is still in the buffers
            self.previews.capture(plan.key, plan.live)
        self._holding = self.retirement.after_step(plan.key, finished, self.scheduler.steps_run,
                                                   any(s.batch and not s.done for s in plan.live))
        if events is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.runner.device))
            events.append((start, end, self._idle))
        self.stats["steps"] += 1
        self.stats["rows_stepped"] += plan.n_rows
        for listener in self.step_listeners:
            call_safely(listener, plan, time.perf_counter() - t0)
        self._release_idle((plan.key,))

    def _decode_failed(self, error: Exception) -> None:  # (the loop thread: Retirement.after_step, finish)
        if self.failures.decode_failed(error):
            self._trip()

    def _trip(self) -> None:
        """The failure policy tripped: not ready from now on, every request held ends retryable elsewhere."""
        logger.error("engine failed: %s", self.failures.reason)
        error = EngineClosed(f"the engine failed ({self.failures.reason}); retry this request on another replica")
        self.retirement.fail_held(error)  # finished rows held for companions: not decoded on a failed device
        self._holding = False
        self._fail_everything(error)
        for fn in self.on_failure:
            call_safely(fn, self.failures.reason)

    def _release_idle(self, keys: Iterable[GroupKey]) -> None:
        """Frees the buffers of sizes in `keys` left with no work and no graphs (any size is valid: none piles up)."""
        with self._cv:
            idle = [k for k in keys if self.scheduler.is_idle(k)]
        for key in idle:
            self.runner.release_group(key)

    def _admit(self, key: GroupKey, states: list[RequestState]) -> bool:
        """Batched, cached prompt encoding and initial latents from each request's own generator. A request whose
        admission fails (e.g. a prompt its tokenizer rejects) fails alone and leaves the group; returns False when
        that happened (the plan is then stale)."""
        runner = self.runner
        broken_nets = runner.controls.load_admitted() if runner.controls is not None else {}
        files = self._files  # the registered capabilities' files admitted this step, placed
        broken_files = {f.name: f.load_admitted() for f in files}
        for s in states:  # what the text encoders run with for its prompts (part of their keys)
            s.text_adapters = runner.capabilities.text_adapters(s) if s.prepared else ()
        keys = [k for s in states for k in _prompt_keys(s) + _schedule_keys(s)]
        try:
            embeds = runner.embed(keys)
        except Exception:  # find the culprit(s): encode each request alone
            embeds = {}
        ok = True
        now = time.monotonic()
        for s in states:
            r = s.request
            try:
                if broken_nets.keys() & set(s.admitted.get("control", [])):
                    raise RuntimeError(next(broken_nets[k] for k in s.admitted["control"] if k in broken_nets))
                slots = runner.capabilities.slots(s) if any(s.admitted.values()) else {}
                why = [broken_files[n][k] for n, taken in slots.items() for k in taken.values() if k in broken_files[n]]
                if why:
                    raise RuntimeError(why[0])
                mine = {k: embeds[k] if k in embeds else runner.embed([k])[k]
                        for k in _prompt_keys(s) + _schedule_keys(s)}
                s.generator = torch.Generator("cpu").manual_seed(r.seed)
                if s.plan.brownian is not None:  # dpmpp_sde: one Brownian tree per request, seeded by its seed
                    s.noise = BrownianNoise(s.plan.brownian, s.plan.brownian_range, r.seed,
                                            (s.rows, *runner.latent_shape(key)))
                latents, edit = (None, {}) if r.edit is None else \
                    prepare_edit(runner, r, key, s.generator, s.plan, s.rows, s.take_edit_pixels())
                pos, neg, *empty = _prompt_keys(s)
                admission = Admission(r, s.rows, edit=edit,
                    controls=runner.controls.admitted(s, s.admitted["control"]) if s.controls else [],
                    image_prompts=s.image_prompts, prepared=s.prepared, slots=slots)
                # a schedule's texts all at its longest's windows (else: the pair's own, as pad_pair pads them)
                windows = max(p.chunks for p in _read(s)) if any(p.schedule for p in s.prompts) else 0
                s.variant_parts = runner.write_rows(key, s.first_row, admission, (
                    mine[pos], mine[neg], mine[empty[0]] if empty else None), latents, s.generator,
                    s.plan.init_noise_sigma, s.size, windows)  # latents None: drawn from its generator there
                if r.noise_seed_delta:  # AUTOMATIC1111's ENSD: the steps' noise from seed + delta
                    s.generator = torch.Generator("cpu").manual_seed(r.seed + r.noise_seed_delta)
                s.switches = _switches(runner, key, s, mine, windows)
                s.admitted_at = now
            except Exception as e:
                logger.warning("admission failed for %s: %s: %s", s.request_id, type(e).__name__, e)
                with self._cv:
                    self.scheduler.remove(s)
                fail_request(s, ValueError(f"request {s.request_id} could not be admitted: {type(e).__name__}: {e}"))
                ok = False
        return ok

    def _fail_everything(self, error: Exception) -> None:
        with self._cv:
            for s in self.scheduler.take_aborted():  # aborted while waiting, not yet answered
                fail_request(s, RequestAborted(f"request {s.request_id} was aborted"))
            for s in self.scheduler.drain():
                fail_request(s, error)
            pending, self._pending = self._pending, []
        for _, future in pending:
            future.set_exception(error)


def _prompt_keys(state: RequestState) -> tuple[PromptKey, ...]:
    """The request's prompt and negative prompt (as token ids), with its text-encoder adapters ((key, scale, slot),
    ...), and the empty prompt that pads the shorter of the two when their lengths differ."""
    text = state.text_adapters
    pos, neg = state.prompts
    if not _second_branch(state):  # the negative prompt is never read: not encoded
        keys = (("+", pos, text), ("+", pos, text))
    else:
        keys = (("+", pos, text), ("-", neg, text))
    if state.empty_prompt is not None:  # the texts' windows differ
        keys += (("+", state.empty_prompt, text),)
    return keys



def _schedule_keys(state: RequestState) -> tuple[PromptKey, ...]:
    """The prompt cache keys of a prompt schedule's other texts (engine/prompt_schedule.py)."""
    pos, neg = state.prompts
    text = state.text_adapters
    keys = tuple(("+", p, text) for p in pos.texts[1:])
    return keys + tuple(("-", p, text) for p in neg.texts[1:]) if _second_branch(state) else keys


def _read(state: RequestState) -> tuple:
    """Every PromptText the request's rows read: its prompt's texts, and its negative prompt's where read."""
    pos, neg = state.prompts
    return pos.texts + (neg.texts if _second_branch(state) else ())


def _switches(runner: ModelRunner, key: GroupKey, state: RequestState, mine: dict, windows: int) -> dict:
    """A prompt schedule's conditioning values by the evaluation they start at (none without a schedule)."""
    pos, neg = state.prompts
    if not pos.schedule and not (neg.schedule and _second_branch(state)):
        return {}
    second = _second_branch(state)
    text = state.text_adapters
    empty = mine.get(("+", state.empty_prompt, text)) if state.empty_prompt is not None else None
    out, values = {}, {}  # one set of values a (prompt, negative prompt) pair: an alternation comes back to its pairs
    for e, p, n in switches(pos, neg if second else pos, state.steps)[1:]:
        if (id(p), id(n)) not in values:
            values[id(p), id(n)] = runner.conditioning_values(
                key, mine[("+", p, text)], mine[("-", n, text) if second else ("+", n, text)], empty, windows)
        out[e] = values[id(p), id(n)]
    return out


def _second_branch(state: RequestState) -> bool:
    """Whether a row feature runs the request's second denoiser branch (its negative prompt) at any step."""
    return state.branches is not None and bool((np.asarray(state.branches) > 1).any())
