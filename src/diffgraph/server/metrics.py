"""Prometheus metrics of one server: its own `CollectorRegistry` (no global state, so apps and tests do
not share counters).

Two kinds of metric:
  * events, counted as they happen: requests by outcome and their latency (event loop), and per step
    the batch bucket and the step time (engine thread, through `engine.step_listeners`);
  * state, read from the engine at scrape time (`_EngineCollector`): queue depth, live rows per
    resolution group, graph captures / replays / eager fallbacks, device memory.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.client import StepEvent


# What happened to a generation request; every request ends in exactly one.
OUTCOMES = ("success", "bad_request", "queue_full", "unavailable", "timeout", "aborted", "error")

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


class _EngineCollector:
    """Reads the engine's state at each scrape; before the engine exists it reports what it can."""

    def __init__(self, get_engine: Callable[[], Any]):
        self._get_engine = get_engine

    def collect(self):
        engine = self._get_engine()
        stats = engine.stats() if engine is not None else None
        queue = GaugeMetricFamily("diffgraph_queue_depth", "Requests waiting for rows")
        rows = GaugeMetricFamily("diffgraph_live_rows", "Rows being denoised, per resolution group (WxH)",
                                 labels=["group"])
        memory = GaugeMetricFamily("diffgraph_device_memory_bytes",
                                   "torch.cuda.memory_allocated on CUDA, else the process RSS")
        memory.add_metric([], stats.device_memory_bytes if stats is not None else _process_rss())
        graph = {name: CounterMetricFamily(f"diffgraph_graph_{name}", help_, labels=["kind"])
                 for name, help_ in (("captures", "CUDA graphs captured"),
                                     ("replays", "CUDA graph replays"),
                                     ("eager_fallbacks", "Calls that ran eagerly for want of a graph"),
                                     ("captures_on_first_use",
                                      "Graphs captured on first use (the step waited) instead of at start-up"))}
        if stats is not None:
            queue.add_metric([], stats.queue_depth)
            for (h, w), n in sorted(stats.live_rows.items()):
                rows.add_metric([f"{w}x{h}"], n)
            totals: dict[str, list[int]] = {}
            for row in stats.graphs:
                t = totals.setdefault(row["kind"], [0, 0, 0, 0])
                t[0] += row["status"] == "captured"
                t[1] += row["replays"]
                t[2] += row["eager_fallbacks"]
                t[3] += row["on_demand"]
            for kind, (captured, replays, fallbacks, on_demand) in sorted(totals.items()):
                graph["captures"].add_metric([kind], captured)
                graph["replays"].add_metric([kind], replays)
                graph["eager_fallbacks"].add_metric([kind], fallbacks)
                graph["captures_on_first_use"].add_metric([kind], on_demand)
            steps = CounterMetricFamily("diffgraph_engine_steps", "Denoising steps run")
            steps.add_metric([], stats.steps)
            yield steps
            holds = CounterMetricFamily("diffgraph_growth_holds",
                                        "Admissions the bucket growth policy cut short (requests left waiting)")
            holds.add_metric([], stats.growth_holds)
            yield holds
            fallbacks = CounterMetricFamily("diffgraph_compile_fallbacks",
                                            "Compiled callables (compile tier) that fell back to uncompiled code")
            fallbacks.add_metric([], stats.compile_fallbacks)
            yield fallbacks
            if stats.replicas:
                yield from _replica_families(stats.replicas)
        if stats is not None and stats.memory:
            held = GaugeMetricFamily("diffgraph_engine_memory_bytes", "What the engine holds, by part: step "
                                     "buffers (device), pinned host bytes, the prompt cache, prepared adapter copies",
                                     labels=["part"])
            for name, value in sorted(stats.memory.items()):
                if name.endswith("_bytes"):
                    held.add_metric([name[:-len("_bytes")]], value)
            yield held
            groups = GaugeMetricFamily("diffgraph_buffer_groups", "Resolution groups holding step buffers")
            groups.add_metric([], stats.memory.get("buffer_groups", 0))
            yield groups
        yield from (queue, rows, memory, *graph.values())


def _replica_families(replicas: list[dict[str, Any]]):
    """Per-replica series (label replica="cuda:1"), beside the totals above: state, restarts, queue, rows, steps,
    device memory, steps and their time per batch bucket. A replica that is down or not answering shows ready 0 and no engine figures."""
    ready = GaugeMetricFamily("diffgraph_replica_ready", "1 when the replica is ready", labels=["replica"])
    restarts = CounterMetricFamily("diffgraph_replica_restarts", "Replica restarts after a crash", labels=["replica"])
    queue = GaugeMetricFamily("diffgraph_replica_queue_depth", "Requests waiting for rows", labels=["replica"])
    rows = GaugeMetricFamily("diffgraph_replica_live_rows", "Rows being denoised per resolution group (WxH)",
                             labels=["replica", "group"])
    steps = CounterMetricFamily("diffgraph_replica_engine_steps", "Denoising steps run", labels=["replica"])
    memory = GaugeMetricFamily("diffgraph_replica_device_memory_bytes",
                               "torch.cuda.memory_allocated on CUDA, else the replica process's RSS", labels=["replica"])
    by_bucket = CounterMetricFamily("diffgraph_replica_bucket_steps", "Denoising steps per batch bucket (rows a "
                                    "step cost)", labels=["replica", "bucket"])
    bucket_time = CounterMetricFamily("diffgraph_replica_bucket_step_seconds", "Summed host wall time of those "
                                      "steps: divided by the steps, a replica's mean step time per bucket",
                                      labels=["replica", "bucket"])
    for r in replicas:
        name, s = r["replica"], r["stats"]
        ready.add_metric([name], float(r["state"] == "ready"))
        restarts.add_metric([name], r["restarts"])
        if s is None:
            continue
        queue.add_metric([name], s.queue_depth)
        for (h, w), n in sorted(s.live_rows.items()):
            rows.add_metric([name, f"{w}x{h}"], n)
        steps.add_metric([name], s.steps)
        memory.add_metric([name], s.device_memory_bytes)
        for b, (n, t) in sorted(s.step_seconds.items()):
            by_bucket.add_metric([name, str(b)], n)
            bucket_time.add_metric([name, str(b)], t)
    return ready, restarts, queue, rows, steps, memory, by_bucket, bucket_time


def _process_rss() -> int:
    """This process's resident set size (0 if unknown): the memory figure before an engine exists."""
    import os
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class ModelCollector:
    """Per model of a `--model-dir` server, read at scrape time from `residents()`: (name, resident
    bytes, requests in flight) of each resident model, and the names of the models being loaded."""

    def __init__(self, residents: Callable[[], list[tuple[str, int, int]]], loading: Callable[[], list[str]]):
        self._residents, self._loading = residents, loading

    def collect(self):
        resident = GaugeMetricFamily("diffgraph_model_resident", "1 for a resident model, 0 while it loads",
                                     labels=["model"])
        memory = GaugeMetricFamily("diffgraph_model_memory_bytes",
                                   "Bytes of weights and graph pools a resident model holds", labels=["model"])
        inflight = GaugeMetricFamily("diffgraph_model_inflight_requests",
                                     "Requests submitted to a model and not yet answered", labels=["model"])
        for name, nbytes, open_requests in self._residents():
            resident.add_metric([name], 1)
            memory.add_metric([name], nbytes)
            inflight.add_metric([name], open_requests)
        for name in self._loading():
            resident.add_metric([name], 0)
        yield resident
        yield memory
        yield inflight


class ServerMetrics:
    def __init__(self, get_engine: Callable[[], Any], batch_buckets: tuple[int, ...],
                 is_ready: Callable[[], bool] = lambda: False):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("diffgraph_requests", "Generation requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:  # every outcome shows, at 0, from the first scrape
            self.requests.labels(outcome)
        self.latency = Histogram("diffgraph_request_latency_seconds", "Latency of successful generation requests",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.bucket = Histogram("diffgraph_step_rows", "Rows each denoising step costs: its batch bucket (its live "
                                "rows where it ran eagerly)", buckets=tuple(float(b) for b in batch_buckets),
                                registry=r)
        self.step_time = Histogram("diffgraph_step_seconds", "Wall time of each denoising step (host view)",
                                   buckets=STEP_BUCKETS, registry=r)
        self.inflight = Gauge("diffgraph_inflight_requests", "Generation requests being served", registry=r)
        self.previews_dropped = Counter("diffgraph_previews_dropped", "Live previews a lagging reader (a slow stream "
                                        "client) never got: superseded by newer ones", registry=r)
        self.ready = Gauge("diffgraph_ready", "1 when the engine is built and accepting requests", registry=r)
        self.ready.set_function(lambda: float(is_ready()))  # read at scrape time: a dead engine loop shows at once
        r.register(_EngineCollector(get_engine))
        self._buckets = tuple(sorted(batch_buckets))
        self.recent_steps: deque[float] = deque(maxlen=64)  # seconds of the last steps (the /status page)

    def observe_request(self, outcome: str, seconds: float | None = None) -> None:
        self.requests.labels(outcome).inc()
        if outcome == "success" and seconds is not None:
            self.latency.observe(seconds)

    def on_step(self, event: StepEvent) -> None:
        """An engine step listener (engine thread): the bucket the step ran in, and its time."""
        self.bucket.observe(event.bucket)
        self.step_time.observe(event.seconds)
        self.recent_steps.append(event.seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
