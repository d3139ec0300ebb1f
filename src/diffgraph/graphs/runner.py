"""GraphRunner: capture and replay of bucketed CUDA graphs, one shared memory pool per device.

Keys are (kind, height, width, bucket): kind "step" is the whole denoising step of a resolution
group, "text" the text encoder(s) at 77 tokens (height = width = 0), "vae" the VAE decoder. Each kind
is a `Graphable`: a function over static buffers that the owner (the model runner) fills before a replay
and reads after it. The runner is the single source of truth for which keys exist:

    bucket = runner.bucket(kind, h, w, n)   # None -> run eagerly (uncovered, too large, or failed)
    runner.replay(kind, h, w, bucket)       # captures on first use

Capture rules: all graphs share one pool (torch.cuda.graph_pool_handle); warm-up iterations run on a
side stream before each capture; the prewarm list captures the largest bucket first. A capture
failure is logged with its key, the error and a hint, and that key runs eagerly from then on.
Optional verification compares one replay with one eager run on the same inputs (of the uncompiled function
where a graphable has `run_reference`).

Lifetime: a graph is bound to the tensors (weights included) that existed when it was captured. The owner
calls `invalidate(kind)` (between steps, never during a replay) when a kind's weights or modules were
replaced: its graphs are dropped (all of them: the pool too) and recaptured on next use. A key captured on
first use rather than at start-up stalls the step that needed it: that is logged with the stall and counted
(`on_demand` in the table). All CUDA work happens on the runner's own device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol

import torch

from ..config import GraphConfig, bucket_table

logger = logging.getLogger(__name__)

GraphKey = tuple[str, int, int, int]  # (kind, height, width, bucket)

_HINT = ("the engine keeps serving this shape eagerly; to capture it, free device memory (fewer or smaller "
         "batch buckets / resolutions) or report the operation that is not allowed during capture")


class Graphable(Protocol):
    """One kind of graph: a deterministic function over static buffers owned by the caller."""

    kind: str

    def buckets(self) -> tuple[int, ...]: ...

    def resolutions(self) -> tuple[tuple[int, int], ...]: ...

    def run(self, height: int, width: int, bucket: int) -> Any:
        """Runs once on the static buffers (eagerly, or while being captured); returns the outputs."""

    def snapshot(self, height: int, width: int, bucket: int) -> Any:
        """Copies of the state that `run` mutates in place, so warm-up and verification leave no trace."""

    def restore(self, height: int, width: int, bucket: int, snap: Any) -> None: ...

    def output(self, height: int, width: int, bucket: int, result: Any) -> torch.Tensor:
        """The tensor compared by verification."""


class StatelessGraphable:
    """Base for graphables whose run only writes outputs it returns: nothing to snapshot or restore."""

    def snapshot(self, height: int, width: int, bucket: int) -> Any:
        return None

    def restore(self, height: int, width: int, bucket: int, snap: Any) -> None:
        pass

    def output(self, height: int, width: int, bucket: int, result: Any) -> torch.Tensor:
        if isinstance(result, dict):
            return next(iter(result.values()))
        return result[0] if isinstance(result, tuple) else result


@dataclass
class GraphStats:
    kind: str
    height: int
    width: int
    bucket: int
    status: str = "pending"  # pending | captured | failed
    capture_ms: float = 0.0      # all of it: warm-up, capture, instantiation
    warmup_ms: float = 0.0       # of which the warm-up iterations
    warmup_first_ms: float = 0.0  # of which the first (per-shape first-use costs: cuDNN plans, kernel loading)
    pool_mib_added: float = 0.0
    replays: int = 0
    eager_fallbacks: int = 0
    verify_max_abs: float | None = None
    error: str | None = None
    on_demand: int = 0           # captures made on first use (a step waited for them), not at start-up
    invalidations: int = 0       # times this key's graph was dropped because its weights or modules changed


class EmulatedGraph:
    """Stands in for torch.cuda.CUDAGraph where there is no GPU (GraphConfig.backend='emulated'):
    a replay re-runs the captured function and writes its results into the captured outputs, so the
    dispatch, padding, fallback and bookkeeping paths run, and are tested, on the CPU."""

    def __init__(self, fn, outputs: Any):
        self.fn = fn
        self.outputs = outputs

    def replay(self) -> None:
        with torch.no_grad():  # as in a captured graph (and as captured: compiled code's guards hold)
            _copy_into(self.outputs, self.fn())


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for k, d in dst.items():
            _copy_into(d, src[k])
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


def _on_device(device: torch.device, emulated: bool):
    """The device's context (so nothing touches another GPU), or nothing on the CPU."""
    import contextlib
    return contextlib.nullcontext() if emulated else torch.cuda.device(device)


class GraphRunner:
    def __init__(self, config: GraphConfig, device: torch.device):
        self.emulated = config.backend == "emulated"
        if config.backend not in ("cuda", "emulated"):
            raise ValueError(f"graph backend {config.backend!r} is unknown; allowed: cuda, emulated")
        if not self.emulated and torch.device(device).type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}; run eagerly on the CPU (Engine mode "
                             "'eager', the default there)")
        self.config = config
        self.device = torch.device(device)
        with _on_device(self.device, self.emulated):
            self.pool = None if self.emulated else torch.cuda.graph_pool_handle()
        # One capture stream for every graph: the allocator reuses a pool's free blocks only on the stream
        # that freed them, so a stream per capture would give each graph memory of its own.
        self.stream = None if self.emulated else torch.cuda.Stream(self.device)
        self.kinds: dict[str, Graphable] = {}
        self._covers: dict[str, tuple[frozenset, tuple[int | None, ...]]] = {}  # kind -> (resolutions, bucket_table)
        self.graphs: dict[GraphKey, Any] = {}  # torch.cuda.CUDAGraph (or EmulatedGraph)
        self.outputs: dict[GraphKey, Any] = {}
        self.stats: dict[GraphKey, GraphStats] = {}
        # eager runs of shapes no graph covers (too many rows, another resolution), per (kind, h, w)
        self.uncovered: dict[tuple[str, int, int], int] = {}

    def register(self, graphable: Graphable) -> None:
        self.kinds[graphable.kind] = graphable
        # what dispatch reads per call, kept as plain data (a graphable's sizes and buckets never change)
        self._covers[graphable.kind] = (frozenset(graphable.resolutions()), bucket_table(tuple(graphable.buckets())))
        for (h, w) in graphable.resolutions():
            for b in graphable.buckets():
                key = (graphable.kind, h, w, b)
                self.stats.setdefault(key, GraphStats(graphable.kind, h, w, b))

    # -- dispatch ------------------------------------------------------------------------------
    def bucket(self, kind: str, height: int, width: int, n: int) -> int | None:
        """The bucket whose graph runs n rows, or None: run eagerly (and that is counted)."""
        covers = self._covers.get(kind)
        bucket = None
        if covers is not None and (height, width) in covers[0] and n < len(covers[1]):
            bucket = covers[1][n]
        if bucket is None:
            self.uncovered[(kind, height, width)] = self.uncovered.get((kind, height, width), 0) + 1
            return None
        key = (kind, height, width, bucket)
        stats = self.stats[key]
        if stats.status == "pending":
            t0 = time.perf_counter()
            self.capture(key)
            stats.on_demand += 1
            logger.warning("graph %s captured on first use: that step waited %.0f ms (add it to the prewarm list "
                           "to capture it at start-up)", key, (time.perf_counter() - t0) * 1e3)
        if stats.status != "captured":
            stats.eager_fallbacks += 1
            return None
        return bucket

    def replay(self, kind: str, height: int, width: int, bucket: int) -> Any:
        """Replays a captured graph; returns its static outputs (valid until the next replay of any graph)."""
        key = (kind, height, width, bucket)
        self.graphs[key].replay()
        self.stats[key].replays += 1
        return self.outputs[key]

    def invalidate(self, kind: str | None = None) -> int:
        """Drops the graphs of `kind` (every kind when None): they are recaptured on next use. Call between
        steps only. Returns how many graphs were dropped. Dropping every graph also starts a new pool."""
        dropped = 0
        for key in [k for k in self.graphs if kind is None or k[0] == kind]:
            del self.graphs[key]
            self.outputs.pop(key, None)
            stats = self.stats[key]
            stats.status = "pending"
            stats.invalidations += 1
            dropped += 1
        for key, stats in self.stats.items():  # a failed capture may succeed with new modules: try again
            if (kind is None or key[0] == kind) and stats.status == "failed":
                stats.status, stats.error = "pending", None
        if not self.emulated and not self.graphs:
            with torch.cuda.device(self.device):
                torch.cuda.synchronize(self.device)
                self.pool = torch.cuda.graph_pool_handle()
        if dropped:
            logger.info("dropped %d graph(s) of %s: recaptured on next use", dropped, kind or "every kind")
        return dropped

    # -- capture -------------------------------------------------------------------------------
    def prewarm(self, groups: Callable[[tuple[int, int]], tuple[tuple, ...]] | None = None) -> None:
        """Captures the prewarm list, largest bucket first. `config.prewarm` True means every key; a list of
        (height, width, bucket) step keys (bucket 0: all buckets) also brings the text and VAE graphs of
        those buckets (the VAE's at that resolution); `groups`: the step groups of an image size where they are not
        the size itself (a token family's text slots and token bucket)."""
        wanted = self.config.prewarm
        if wanted is False:
            return
        sizes = {} if wanted is True else {(wh, ww): {(wh, ww), *(groups((wh, ww)) if groups else ())}
                                           for wh, ww, _ in wanted}
        for kind, g in self.kinds.items():
            for (h, w) in g.resolutions():
                for b in sorted(g.buckets(), reverse=True):
                    if wanted is not True and not any(
                            (kind == "text" or (h, w) in sizes[wh, ww]) and wb in (0, b) for wh, ww, wb in wanted):
                        continue
                    if self.stats[(kind, h, w, b)].status == "pending":
                        self.capture((kind, h, w, b))

    def warm_pending(self) -> int:
        """Runs each graph not captured by the prewarm once, eagerly (the buffers restored after), so that whatever
        it compiles (the compile tier: one version per kind and resolution, bucket 1 its own) compiles now, before
        the engine is ready, and a capture on first use while serving costs a capture, not a compile. Returns how
        many it ran."""
        ran = 0
        for key, stats in list(self.stats.items()):
            if stats.status != "pending":
                continue
            kind, h, w, b = key
            g = self.kinds[kind]
            with torch.no_grad(), _on_device(self.device, self.emulated):
                snap = g.snapshot(h, w, b)
                try:
                    g.run(h, w, b)
                finally:
                    g.restore(h, w, b, snap)
            ran += 1
        return ran

    def capture(self, key: GraphKey) -> bool:
        kind, h, w, b = key
        g = self.kinds[kind]
        stats = self.stats[key]
        snap = None
        t0 = time.perf_counter()
        try:
            with torch.no_grad(), _on_device(self.device, self.emulated):
                snap = g.snapshot(h, w, b)
                graph, out = (self._capture_emulated if self.emulated else self._capture_cuda)(g, key, stats)
            self.graphs[key] = graph
            self.outputs[key] = out
            stats.status = "captured"
            stats.capture_ms = (time.perf_counter() - t0) * 1e3
            if self.config.verify:
                stats.verify_max_abs = self._verify(key)
            g.restore(h, w, b, snap)
            logger.info("captured graph %s in %.0f ms, pool +%.1f MiB%s", key, stats.capture_ms,
                        stats.pool_mib_added,
                        "" if stats.verify_max_abs is None else f", replay vs eager max abs {stats.verify_max_abs:.3g}")
            return True
        except Exception as e:  # any failure: this key runs eagerly from now on, the engine keeps serving
            stats.status = "failed"
            stats.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            self.graphs.pop(key, None)
            self.outputs.pop(key, None)
            if not self.emulated:
                self._recover_after_failed_capture()
            if snap is not None:
                g.restore(h, w, b, snap)
            logger.warning("graph capture failed for %s: %s; %s", key, stats.error, _HINT)
            return False

    def _capture_cuda(self, g: Graphable, key: GraphKey, stats: GraphStats) -> tuple[Any, Any]:
        kind, h, w, b = key
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        snap = g.snapshot(h, w, b)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):  # warm-up on a side stream: lazy inits and autotuning happen here
            for i in range(self.config.warmup_iters):
                g.run(h, w, b)
                if i == 0:
                    stream.synchronize()
                    stats.warmup_first_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        stats.warmup_ms = (time.perf_counter() - t0) * 1e3
        g.restore(h, w, b, snap)
        # torch.cuda.graph empties the cache on entry: empty it first so the baseline is comparable
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = g.run(h, w, b)
        torch.cuda.synchronize(self.device)
        stats.pool_mib_added = (torch.cuda.memory_reserved(self.device) - reserved) / 2**20
        return graph, out

    def _recover_after_failed_capture(self) -> None:
        # A capture that breaks inside cudaStreamEndCapture leaves the allocator recording into our pool
        # ("beginAllocateToPool: already recording"): end that, so later captures can use the pool.
        try:
            torch.cuda.synchronize(self.device)
        except Exception:  # a broken capture can leave an error to collect
            pass
        try:
            torch._C._cuda_endAllocateToPool(self.device.index or 0, self.pool)
        except Exception:  # it was not recording (the failure came before or after): nothing to end
            pass
        # Later graphs go to a fresh pool (shared among them): the broken capture may have left the old
        # one marked as recording, which would fail every later capture. Graphs already captured keep theirs.
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)

    def _capture_emulated(self, g: Graphable, key: GraphKey, stats: GraphStats) -> tuple[Any, Any]:
        kind, h, w, b = key
        snap = g.snapshot(h, w, b)
        out = g.run(h, w, b)
        g.restore(h, w, b, snap)
        return EmulatedGraph(lambda: g.run(h, w, b), out), out

    def _verify(self, key: GraphKey) -> float:
        kind, h, w, b = key
        g = self.kinds[kind]
        with torch.no_grad():
            snap = g.snapshot(h, w, b)
            if hasattr(g, "verify_inputs"):  # representative data instead of whatever the buffers hold
                g.verify_inputs(h, w, b)
                snap_inputs = g.snapshot(h, w, b)
            else:
                snap_inputs = snap
            # the uncompiled function where the graph holds a compiled one (the compile tier's fidelity figure)
            eager = g.output(h, w, b, getattr(g, "run_reference", g.run)(h, w, b)).float().clone()
            g.restore(h, w, b, snap_inputs)
            self.graphs[key].replay()
            graphed = g.output(h, w, b, self.outputs[key]).float().clone()
            g.restore(h, w, b, snap)
        return float((eager - graphed).abs().max())

    # -- introspection -------------------------------------------------------------------------
    def table(self) -> list[dict[str, Any]]:
        # copies first: the loop thread may add keys while a scrape (another thread) reads the table
        rows = [asdict(s) for s in list(self.stats.values())]
        for (kind, h, w), count in list(self.uncovered.items()):
            rows.append(asdict(GraphStats(kind, h, w, 0, status="uncovered", eager_fallbacks=count)))
        return rows

    def pool_mib(self) -> float:
        return sum(s.pool_mib_added for s in self.stats.values())
