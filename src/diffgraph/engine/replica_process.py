"""What runs inside a replica process (replica.py holds the parent's side, `ReplicaClient`): `replica_main` builds
the engine, warms it up, then serves the pipe; the engine's threads only queue their messages and the output thread
(`_send_all`) sends them, so the GPU loop never waits for the pipe. The protocol is replica.py's docstring.

A replica exits at once when its parent dies (`watch_parent`), whatever it is doing (building, stepping, closing):
a killed server's replica must not hold the device memory the restarted server needs.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from . import replica_messages as M
from .held_models import HeldModels
from .remote_models import ModelSetSpec

PARENT_POLL_S = 0.2  # how often a replica looks whether its parent still lives


def watch_parent(parent_pid: int, poll_s: float = PARENT_POLL_S, exit: Callable[[int], Any] = os._exit) -> None:
    """Exits the process (`exit`, os._exit: no cleanup, the kernel frees the device) once `parent_pid` is no longer
    its parent: an orphan is re-parented (to init or a subreaper), so its parent pid changes. A thread polling
    getppid, not prctl(PR_SET_PDEATHSIG): that signal follows the parent *thread* that started the process, and a
    replica is restarted from a supervising thread that ends before it."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        exit(1)
    threading.Thread(target=watch, name="diffgraph-replica-parent-watch", daemon=True).start()


STEP_REPEATS = 3  # timed steps per size; their median is kept (one step slowed by a loaded machine moves nothing)


def time_step_sizes(engine: Any, repeats: int = STEP_REPEATS,
                    step_seconds: Callable[[int, int], float] | None = None) -> tuple[tuple[int, float], ...]:
    """(pixels, seconds) of one warm denoising step at two sizes, each the median of `repeats` timed steps: the native
    square and, beside it, half its width (twice, for a model whose half would be under 64 pixels), so that the
    server can fit how the cost grows with size. A size the engine refuses (ParamError) is left out.
    `step_seconds(height, width)`: the timing (default: a one-step image on `engine`, its denoise time)."""
    from ..request import MIN_SIZE, ParamError

    if step_seconds is None:
        def step_seconds(height: int, width: int) -> float:
            result = engine.generate("warm-up", num_inference_steps=1, seed=0, height=height, width=width)
            return result.timings["denoise_ms"] / 1e3
    native = engine.info.native_size
    half = native // 2 // 8 * 8
    samples = []
    for height, width in ((native, native), (native, half if half >= MIN_SIZE else 2 * native)):
        try:
            times = sorted(step_seconds(height, width) for _ in range(repeats))
        except ParamError:
            continue
        samples.append((height * width, times[len(times) // 2]))
    return tuple(samples)


def replica_main(conn: Any, device: str | None, engine_kwargs: dict[str, Any], torch_threads: int | None,
                 beat_s: float = 1.0, log_level: int | None = None, measure_step: bool = True,
                 models: ModelSetSpec | None = None, parent_pid: int | None = None) -> None:
    """The replica process: build the engine, then serve the pipe until "close" or the parent goes away. With
    `log_level` (the parent's, when it configured logging) its records go to the inherited stderr as the parent's;
    `measure_step`: a CPU replica times a warm step at start-up (the server's --max-pixels default needs it);
    `models`: a `--model-dir` set (engine/model_set.py) lives here, its default model the replica's engine, the
    others loaded when the parent acquires them (remote_models.py); `parent_pid`: the process whose death ends this
    one at once (watch_parent)."""
    device = _prepare_process(device, torch_threads, log_level, parent_pid)
    from .async_engine import AsyncEngine
    from .engine import Engine

    outbox: queue.SimpleQueue = queue.SimpleQueue()
    send = outbox.put  # the engine's threads only queue their messages: the output thread sends them
    output = threading.Thread(target=_send_all, args=(conn, outbox), name="diffgraph-replica-output", daemon=True)
    output.start()

    def last(message: object) -> None:  # a final message: queued after everything else, sent before the exit
        outbox.put(message)
        outbox.put(None)
        output.join(30)

    def failed(reason: str) -> None:  # a failure policy tripped: its requests are answered; say why, exit
        last(M.Failed(reason))
        os._exit(3)  # the parent restarts it (with backoff); a poisoned device context is not worth a clean close

    def hook(client: Any) -> None:  # every model's engine here, the default and a set's others alike: its failure
        client.engine.core.on_failure.append(failed)  # ends the replica (they share the device), its steps are
        client.add_step_listener(lambda event: send(M.Step(event)))  # the parent's step metrics

    building = threading.Event()  # beats while the engine builds: a build stopped or stuck with the GIL is found
    threading.Thread(target=_beat_until, args=(building, send, beat_s), name="diffgraph-replica-build-beat",
                     daemon=True).start()
    try:
        if models is None:
            engine = Engine(device=device, **engine_kwargs)
            # one image end to end before it says ready: the first pass is slow (lazy kernels, allocator growth)
            # and a broken model fails here, not on a client's request
            engine.generate("warm-up", num_inference_steps=1, seed=0)
            held, client = None, AsyncEngine(engine)
            hook(client)
        else:
            held = HeldModels(models, device, engine_kwargs, hook)  # each build warms its engine up the same way
            engine, client = held.default, held.default_client
        # on the CPU warm steps are timed at two sizes (the server's --max-pixels default is fitted to them)
        step_s = time_step_sizes(engine) if measure_step and device.startswith("cpu") else None
    except Exception as e:
        building.set()
        return last(M.Failed(f"{type(e).__name__}: {e}"))
    building.set()
    send(M.Ready(engine.info, step_s))
    beating = _beat_while_serving(engine, send, beat_s)
    _serve_pipe(conn, send, engine, held, client)
    beating.set()
    engine.close() if held is None else held.close()
    outbox.put(None)  # the output thread ends after what is queued
    output.join(30)
    loop = engine.core.loop.thread
    if loop is not None and loop.is_alive():  # its step still runs past the close's timeout (a long step during a
        logging.shutdown()  # drain): end here, as tearing the interpreter down under a busy native op would abort
        os._exit(0)


def _prepare_process(device: str | None, torch_threads: int | None, log_level: int | None,
                     parent_pid: int | None) -> str:
    """The process's parent watch, logging and CPU thread pools; returns the device (the default one if None)."""
    if parent_pid is not None:
        watch_parent(parent_pid)
    if log_level is not None:
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    from .engine import default_device

    device = device or default_device()
    if torch_threads is not None and device.startswith("cpu"):
        _cpu_threads(torch_threads)
    return device


def _beat_while_serving(engine: Any, send: Callable[[object], None], beat_s: float) -> threading.Event:
    """Starts the serving beat: every beat_s, how long the loop's current pass has run; it stops when the event
    returned is set."""
    beating = threading.Event()

    def beat() -> None:  # its own thread: beats while the loop steps, and says how long the current pass runs
        while not beating.wait(beat_s):
            since = engine.core.loop.busy_since
            send(M.Beat(0.0 if since is None else time.monotonic() - since))
    threading.Thread(target=beat, name="diffgraph-replica-beat", daemon=True).start()
    return beating


def _serve_pipe(conn: Any, send: Callable[[object], None], engine: Any, held: HeldModels | None,
                client: Any) -> None:
    """Answers the parent's messages until "close" or the pipe ends: submissions (each outcome sent when done),
    aborts, model-set and listing questions (on threads of their own), stats."""
    def finished(request_id: str, future: Future) -> None:  # a request's outcome, to the parent
        send(M.Done(request_id, *_outcome(future)))

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if isinstance(message, M.Submit):
            request, progress, hold = message.request, message.progress, message.hold
            on_progress = (lambda rid, step, total: send(M.Progress(rid, step, total))) if progress else None
            on_preview = (lambda e: send(M.Progress(e.request_id, e.step, e.total, e.previews, e.preview_format))
                          ) if progress else None
            try:
                future = engine.submit(request, on_progress=on_progress, on_preview=on_preview) if held is None \
                    else held.submit(hold, request, on_progress=on_progress, on_preview=on_preview)
            except Exception as e:  # ParamError, QueueFullError, EngineClosed: the caller's answer
                send(M.Rejected(request.request_id, e))
                continue
            send(M.Accepted(request.request_id))
            future.add_done_callback(functools.partial(finished, request.request_id))
        elif isinstance(message, M.Abort):
            ((held.owner(message.request_id) if held is not None else None) or engine).abort(message.request_id)
        elif isinstance(message, M.Release) or (isinstance(message, M.Ask) and message.what in ("acquire", "models")):
            threading.Thread(target=_answer_models, args=(send, held, message), daemon=True,  # a set's: loads wait
                             name="diffgraph-replica-models").start()  # on a thread of their own
        elif isinstance(message, M.Ask) and message.what == "stats":
            send(M.Answer(message.token, client.stats()))
        elif isinstance(message, M.Ask) and message.what == "loras":  # reads adapter headers from disk: on a
            threading.Thread(target=_answer_listing, args=(send, message, engine, held), daemon=True,  # thread of
                             name="diffgraph-replica-listing").start()  # its own, never blocking the pipe
        elif isinstance(message, M.Close):
            break


def _answer_models(send: Callable[[object], None], held: HeldModels | None, message: "M.Ask | M.Release") -> None:
    if isinstance(message, M.Release):
        if held is not None:
            held.release(message.hold)
        return
    try:
        if held is None:
            raise RuntimeError("this replica serves one model (no --model-dir)")
        answer: Any = held.acquire(*message.args) if message.what == "acquire" else held.view()
    except Exception as e:  # ModelLoadError, TimeoutError (still loading), a closed set: the caller's answer
        answer = e
    send(M.Answer(message.token, answer))


def _beat_until(done: threading.Event, send: Callable[[object], None], beat_s: float) -> None:
    while not done.wait(beat_s):
        send(M.Beat(0.0))


def _cpu_threads(threads: int) -> None:
    """A CPU replica's torch pools: `threads` intra-op threads (the server's --torch-threads share) and one inter-op
    thread (the engine loop is the only caller)."""
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # inter-op work already ran in this process: keep what is there
        pass


def _answer_listing(send: Callable[[object], None], message: M.Ask, engine: Any, held: HeldModels | None) -> None:
    """Ask("loras", token[, (model,)]): the adapter listing of the replica's engine, or of a resident model of its
    set (None when that model is not resident here)."""
    token, model = message.token, message.args[0] if message.args else None
    try:
        target = engine if model is None or held is None else held.resident_engine(model)
        send(M.Answer(token, None if target is None else target.loras()))
    except Exception as e:  # an unreadable folder: the caller's error, with its reason
        send(M.Answer(token, RuntimeError(f"listing the adapters failed: {type(e).__name__}: {e}")))


def _send_all(conn: Any, outbox: queue.SimpleQueue) -> None:
    """The replica's output thread: what the engine's threads queued, in order; the small messages queued together
    (progress, steps, beats, acceptances) go as one `Batch` message, a result on its own. The GPU loop never waits
    for the pipe, however slowly the parent reads."""
    while True:
        message = outbox.get()
        small: list[object] = []
        while message is not None and not isinstance(message, M.Done) and len(small) < 256:
            small.append(message)
            try:
                message = outbox.get_nowait()
            except queue.Empty:
                message = ()
                break
        try:
            if small:
                conn.send(small[0] if len(small) == 1 else M.Batch(tuple(small)))
            if message:
                conn.send(message)
        except (OSError, ValueError):  # the parent is gone: nothing to answer
            return
        if message is None:
            return


def _outcome(future: Future) -> tuple[Any, BaseException | None]:
    error = future.exception()
    if error is not None:
        return None, error
    result = future.result()
    if result.encoded is not None:
        result.arrays = None  # the encoded bytes are what the caller sends on: do not move the pixels too
    result.request = None  # the parent has it (with an edit's input image): results do not carry inputs back
    return result, None
