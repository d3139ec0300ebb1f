"""One HTTP request, traced: every call that crosses from one diffgraph module (file) into another, counted.

The server runs in process (TestClient) on random:tiny in mode "graph" with the emulated graph backend, so the
step is a `GraphRunner.replay` as on a GPU (only the step is graphed: the text encoder and the VAE run eagerly, so
the first replay is the step's). A profiler (threading.setprofile, set before the server's threads start: the event
loop, the engine build and loop threads, the image threads, the asyncio workers) sees every call. A crossing is a
call from a function of module A to a function of module B != A, both under src/diffgraph; each (caller, callee)
pair counts once; comprehensions count as their function. The caller is the nearest diffgraph frame on the stack,
and across an asyncio task or an executor's work item the diffgraph function that created it (`asyncio.ensure_future`
in requests.py, `ThreadPoolExecutor.submit` in core.py), so a hand-off between threads is counted where it is made.

Forward, "HTTP to the replay": from the route (`server/image_routes.py:generations`) on the event loop until the
server's call into the engine package returns the request's handle; on the engine's threads until the first call into
`graphs/runner.py:GraphRunner.replay` (that call included; what runs inside the replay is the step itself). Back,
"the replay's end to the response": the rest of the loop iteration that replayed, the image thread, and the event
loop from the handle to the route's return; a crossing already counted forward is not counted again.

The same request with the shipped digits model's `pencil` LoRA and `outline` ControlNet is traced the same way
(after one request like it, so that its adapters are read and the ControlNet's graph captured); its first replay is
the ControlNet's.

docs/ARCHITECTURE.md ("One HTTP request, traced") states the bounds the test holds both ways to: the modules visited
forward and back, and the thread sections. `python tests/test_trace.py` prints the measured crossings.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src" / "diffgraph") + os.sep
DOC = ROOT / "docs" / "ARCHITECTURE.md"
SECTION = "## One HTTP request, traced"
# ceilings on a plain request's way: the modules it visits forward (HTTP to the first replay) and back, and the
# threads it passes through (docs/ARCHITECTURE.md states the same numbers)
FORWARD_MODULES, BACK_MODULES, THREAD_SECTIONS = 26, 18, 8
# and with the shipped digits model's LoRA and ControlNet (its first replay is the ControlNet's, so the step, run
# after it, is on the way back)
ADAPTER_FORWARD_MODULES, ADAPTER_BACK_MODULES, ADAPTER_THREAD_SECTIONS = 36, 36, 8
ROUTE = ("server/image_routes.py", "generations")
REPLAY = ("graphs/runner.py", "GraphRunner.replay")
_COMPREHENSIONS = re.compile(r"\.<locals>\.<(listcomp|setcomp|dictcomp|genexpr)>$")
ROLES = {"fwd": ("event loop", "worker", "replica intake", "other", "engine loop"),
         "back": ("engine loop", "image thread", "pipe reader", "other", "event loop")}
THREAD_ROLES = (("diffgraph-images", "image thread"), ("diffgraph-replica-intake", "replica intake"),
                ("diffgraph-replica-reader", "pipe reader"),  # by thread name: each role one thread, so in order
                ("asyncio_", "worker"))  # the event loop's default executor (asyncio.to_thread): one item here
UNORDERED = ("pipe reader",)  # its messages (a step event, a result) come from two replica threads: in either order
# not on the request's way back: the replica's step event feeds the server's step metrics, and the pipe reader
# dispatches it before or after the response is out (measured both ways in CI), so it is left out of the lists
OFF_PATH = (("engine/replica.py:ReplicaClient._dispatch", "server/metrics.py:ServerMetrics.on_step"),)


def _module(code) -> str | None:
    name = code.co_filename
    return name[len(SRC):] if name.startswith(SRC) else None


def _function(code) -> str:
    qualname = code.co_qualname
    while _COMPREHENSIONS.search(qualname):
        qualname = _COMPREHENSIONS.sub("", qualname)
    return qualname.replace(".<locals>.", ".")


@dataclass
class Trace:
    """What the profiler saw: per phase and thread role, the crossings (caller, callee) in the order first made."""

    edges: dict[str, dict[str, list[tuple[str, str]]]] = field(
        default_factory=lambda: {p: {r: [] for r in roles} for p, roles in ROLES.items()})

    def phase(self, phase: str) -> list[tuple[str, str]]:
        return [e for role in ROLES[phase] for e in self.edges[phase][role]]


class Tracer:
    """The profile function (every thread). Inactive until `arm()`; then it waits for the route's call."""

    def __init__(self):
        self.events: list[tuple[str, int, tuple[str, str]]] = []  # (phase, thread, crossing) as they happen
        self.names: dict[int, str] = {}  # thread ident -> its name
        self.armed = False
        self.http = None            # the event loop's thread (the route's)
        self.http_forward = True    # until the engine hands the server the request's handle
        self.boundary = set()       # frames of calls from server/ into engine/ on the event loop
        self.replay_thread = None
        self.replay_frame = None    # the first replay, while it runs
        self.replayed = False       # the first replay returned
        self.iteration = None       # the replaying thread's loop iteration (its window ends with it)
        self.loop_done = threading.Event()
        self.route_done = threading.Event()
        self.route_frame = None
        self._pending: dict[int, str] = {}   # create_task / executor submit frames -> their diffgraph caller
        self._origins: dict[int, tuple[str, object]] = {}  # id(task or future) -> (creator, the object, kept alive)

    def arm(self) -> None:
        self.armed = True

    # -- who called ----------------------------------------------------------------------------
    def _caller(self, frame) -> str | None:
        f = frame.f_back
        while f is not None:
            code = f.f_code
            m = _module(code)
            if m is not None:
                return f"{m}:{_function(code)}"
            origin = self._origin_of(f)
            if origin is not None:
                return origin
            f = f.f_back
        return None

    def _origin_of(self, f) -> str | None:
        code = f.f_code
        if code.co_name == "_run" and code.co_filename.endswith(os.path.join("asyncio", "events.py")):
            callback = getattr(f.f_locals.get("self"), "_callback", None)  # a task's step or wake-up
            found = self._origins.get(id(getattr(callback, "__self__", None)))
            return found[0] if found else None
        if code.co_name == "run" and code.co_filename.endswith(os.path.join("concurrent", "futures", "thread.py")):
            found = self._origins.get(id(getattr(f.f_locals.get("self"), "future", None)))
            return found[0] if found else None
        return None

    # -- the profile function ------------------------------------------------------------------
    def __call__(self, frame, event, arg) -> None:
        if not self.armed or event not in ("call", "return"):
            return
        code = frame.f_code
        module = _module(code)
        if module is None:
            self._hand_off(frame, event, arg, code)
            return
        t = threading.get_ident()
        if event == "return":
            self._returned(frame, arg, t)
            return
        function = _function(code)
        if self.http is None:
            if (module, code.co_name) != ROUTE:
                return
            self.http, self.route_frame = t, frame
        if self.replay_frame is not None and t == self.replay_thread:
            return  # inside the replay: the step itself
        if (module, function) == REPLAY and self.replay_frame is None and not self.replayed:
            self.replay_thread, self.replay_frame = t, frame
            chain, f = [], frame
            while f is not None:
                if _module(f.f_code) is not None:
                    chain.append(f)
                f = f.f_back
            self.iteration = chain[-2] if len(chain) >= 2 else chain[-1]
            self.events.append(("fwd", t, (self._caller(frame), f"{module}:{function}")))
            return
        caller = self._caller(frame)
        if caller is None:
            return
        if t == self.http and caller.startswith("server/") and module.startswith("engine/") and self.http_forward:
            self.boundary.add(id(frame))
        if caller.split(":", 1)[0] == module:
            return
        self._record(t, (caller, f"{module}:{function}"))

    def _record(self, t: int, edge: tuple[str, str]) -> None:
        self.names.setdefault(t, threading.current_thread().name)
        if t == self.http:
            if not self.route_done.is_set():
                self.events.append(("fwd" if self.http_forward else "back", t, edge))
        elif self.replay_frame is None and not self.replayed:
            self.events.append(("fwd", t, edge))
        elif not (self.loop_done.is_set() if t == self.replay_thread else self.route_done.is_set()):
            self.events.append(("back", t, edge))

    def result(self) -> Trace:
        """The crossings by phase and thread role, each once (forward first), in the order each thread made them."""
        trace, seen = Trace(), set()
        for wanted in ("fwd", "back"):
            for phase, t, edge in self.events:
                if phase != wanted or edge in seen or edge in OFF_PATH:
                    continue
                seen.add(edge)
                role = "event loop" if t == self.http else "engine loop" if t == self.replay_thread else next(
                    (r for prefix, r in THREAD_ROLES if self.names.get(t, "").startswith(prefix)), "other")
                trace.edges[phase][role].append(edge)
        for roles in trace.edges.values():
            for role in UNORDERED:
                if role in roles:
                    roles[role].sort()
        return trace

    def _returned(self, frame, arg, t: int) -> None:
        if frame is self.replay_frame:
            self.replay_frame, self.replayed = None, True
        elif frame is self.iteration and self.replayed:
            self.loop_done.set()
        elif t == self.http:
            if id(frame) in self.boundary and self.http_forward and hasattr(arg, "request_id"):
                self.http_forward = False
            elif frame is self.route_frame and not _is_suspension(arg):
                self.route_done.set()

    def _hand_off(self, frame, event, arg, code) -> None:
        """Remembers which diffgraph function created an asyncio task or an executor work item."""
        name = code.co_name
        if name == "__init__" and event == "call" and frame.f_back is not None and \
                code.co_filename.endswith(os.path.join("concurrent", "futures", "thread.py")):
            # a work item, made inside submit: its future is known before a worker can run it (submit's return
            # comes after the item is queued, and an idle worker may have started it by then)
            caller, future = self._pending.get(id(frame.f_back)), frame.f_locals.get("future")
            if caller is not None and future is not None:
                self._origins[id(future)] = (caller, future)
            return
        if name == "create_task" and code.co_filename.endswith(os.path.join("asyncio", "base_events.py")) or \
                name == "submit" and code.co_filename.endswith(os.path.join("concurrent", "futures", "thread.py")):
            if event == "call":
                caller = self._caller(frame)
                if caller is not None:
                    self._pending[id(frame)] = caller
            elif id(frame) in self._pending:
                self._origins[id(arg)] = (self._pending.pop(id(frame)), arg)


def _is_suspension(value) -> bool:
    """A coroutine's `return` event at an `await` that suspends carries what it yields (a future, or None)."""
    return value is None or hasattr(value, "add_done_callback")


# -- the traced request ----------------------------------------------------------------------------
def _graph_kwargs(model: str = "random:tiny") -> dict:
    from diffgraph.config import GraphConfig

    graphs = GraphConfig(batch_buckets=(1, 2), resolutions=((64, 64),), backend="emulated",
                         capture_text_encoder=False, capture_vae=False)
    return dict(model=model, dtype="fp32", mode="graph", graphs=graphs)


class _ThreadProcess(threading.Thread):
    """The replica "process" as a thread of this one (what `ReplicaClient` asks of a process)."""

    exitcode = None
    pid = None

    def kill(self) -> None:  # never called on the traced path (no heartbeat misses)
        raise AssertionError("the traced replica was to be killed")


def _served_engine(model: str = "random:tiny"):
    """The served path (`diffgraph serve`'s default engine factory: a Router over one ReplicaClient), its replica's
    `replica_main` on a thread instead of a spawned process: the same code over the same pipe (every message
    pickled), so one profiler sees the HTTP side, the pipe's threads and the engine's."""
    import multiprocessing

    from diffgraph.engine.replica import ReplicaClient
    from diffgraph.engine.replica_process import replica_main
    from diffgraph.engine.router import Router

    class ThreadReplica(ReplicaClient):
        def _start(self) -> None:
            parent, child = multiprocessing.Pipe(duplex=True)
            self._conn = parent
            self._process = _ThreadProcess(target=replica_main, daemon=True, name="diffgraph-replica-intake",
                                           args=(child, "cpu", self._kwargs, None, self.replica_timeout / 4))
            self._process.start()
            threading.Thread(target=self._read, args=(parent, self._process), daemon=True,
                             name="diffgraph-replica-reader").start()

    return Router([ThreadReplica("cpu", _graph_kwargs(model), replica_timeout=600.0)])


def _trace(model: str, body: dict, warm: bool = False):
    """Yields (the TestClient, the trace of one request of `body`) on `model` served as `_served_engine` serves it.
    The profiler is set before the server's threads start. `warm`: the same request made once before (another
    seed), so that the traced one finds its adapters read and their graphs captured, as the server's warm-up leaves
    a plain request's."""
    from fastapi.testclient import TestClient

    from diffgraph.server.app import create_app
    from diffgraph.api.config import ServerConfig

    tracer = Tracer()
    threading.setprofile(tracer)
    try:
        app = create_app(ServerConfig(model=model, device="cpu", max_pixels=0),
                         engine_factory=lambda: _served_engine(model))
        with TestClient(app) as client:
            for _ in range(6000):  # the engine is built on a background thread (a failure bound, not a timing)
                if client.get("/ready").status_code == 200:
                    break
                time.sleep(0.05)
            if warm:
                r = client.post("/v1/images/generations", json={**body, "seed": body["seed"] + 1})
                assert r.status_code == 200, r.text
            tracer.arm()
            r = client.post("/v1/images/generations", json=body)
            assert r.status_code == 200, r.text
            assert tracer.route_done.wait(60) and tracer.loop_done.wait(60), "the trace did not end"
            tracer.armed = False
            yield client, tracer.result()
    finally:
        threading.setprofile(None)


@pytest.fixture(scope="module")
def traced():
    """(the TestClient, the trace of one plain 1-step request on random:tiny)."""
    yield from _trace("random:tiny", {"prompt": "a traced fox", "num_inference_steps": 1, "seed": 1})


def _outline() -> str:
    """A control map for digits' `outline` ControlNet: a white ring on black, 64x64, as a base64 PNG."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[:64, :64]
    ring = (np.abs(np.hypot(x - 32, y - 32) - 18) < 1.5).astype(np.uint8) * 255
    buf = io.BytesIO()
    Image.fromarray(np.repeat(ring[:, :, None], 3, 2)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def traced_adapters():
    """(the TestClient, the trace of one 1-step request on the shipped digits model with its shipped `pencil` LoRA
    and its `outline` ControlNet)."""
    from diffgraph.models import presets

    if presets.shipped_preset_folder("digits") is None or presets.builtin_lora_folder("digits") is None or \
            presets.builtin_control_folder("digits") is None:
        pytest.skip("the shipped digits model, its LoRA or its ControlNet is missing from the package")
    yield from _trace("digits", {"prompt": "a handwritten digit zero", "num_inference_steps": 1, "seed": 1,
                                 "loras": [{"name": "pencil", "scale": 1.0}],
                                 "controls": [{"model": "outline", "image": _outline()}]}, warm=True)


def module_counts(edges: list[tuple[str, str]]) -> tuple[int, int]:
    """(module pairs, modules) of a list of crossings: a path that visits M modules from the route crosses at least
    M - 1 times (each module but the route's is entered once at least), the floor behind issue 27's target."""
    pairs = {(a.split(":", 1)[0], b.split(":", 1)[0]) for a, b in edges}
    return len(pairs), len({m for pair in pairs for m in pair})


def render(trace: Trace) -> str:
    """The lists as docs/ARCHITECTURE.md writes them."""
    titles = {("fwd", "event loop"): "On the event loop, until the engine hands back the request's handle:",
              ("fwd", "engine loop"): "On the engine loop thread, until the first replay:",
              ("fwd", "worker"): "On a worker thread of the event loop (asyncio.to_thread: the request's text parsed off "
                                 "the loop):",
              ("fwd", "replica intake"): "On the replica's intake thread (it reads the pipe):",
              ("fwd", "other"): "On other threads:",
              ("back", "engine loop"): "On the engine loop thread, the rest of that iteration:",
              ("back", "image thread"): "On the image thread:",
              ("back", "pipe reader"): "On the server's pipe reader thread:",
              ("back", "other"): "On other threads:",
              ("back", "event loop"): "On the event loop, from the handle to the response:"}
    out = []
    for phase, head in (("fwd", "Forward, HTTP to the replay"), ("back", "Back, the replay's end to the response")):
        out.append(f"**{head}: {len(trace.phase(phase))} crossings.**\n")
        n = 0
        for role in ROLES[phase]:
            edges = trace.edges[phase][role]
            if not edges:
                continue
            out.append(titles[phase, role] + "\n")
            for caller, callee in edges:
                n += 1
                out.append(f"{n}. `{caller}` -> `{callee}`")
            out.append("")
    return "\n".join(out)


def thread_sections(trace: Trace) -> int:
    """The thread sections of the request's way: each (phase, thread role) whose crossings it makes; a hand-off from
    one thread to the next starts a section."""
    return sum(bool(edges) for roles in trace.edges.values() for edges in roles.values())


def _stated_bounds(way: str = "plain request's way") -> tuple[int, ...]:
    """The bounds docs/ARCHITECTURE.md states for the traced request's way (`way`: the words before them)."""
    text = DOC.read_text()
    section = " ".join(text[text.index(SECTION):].split())
    stated = re.search(re.escape(way) + r" to at most (\d+) modules forward and (\d+) back, in at most (\d+) thread "
                       r"sections", section)
    assert stated, f"docs/ARCHITECTURE.md's {SECTION!r} no longer states the bounds the test checks ({way})"
    return tuple(int(g) for g in stated.groups())


def test_the_request_path_stays_within_its_bounds(traced):
    """Bounds, not lists: a refactor that keeps the way as short passes without editing the map; one that adds
    modules or thread hand-offs to a plain request's way fails here and says which."""
    _, trace = traced
    forward, back = trace.phase("fwd"), trace.phase("back")
    measured = render(trace)
    print("\n" + measured)
    assert forward and back and (REPLAY[0] + ":" + REPLAY[1]) == forward[-1][1], measured
    assert _stated_bounds() == (FORWARD_MODULES, BACK_MODULES, THREAD_SECTIONS)
    assert module_counts(forward)[1] <= FORWARD_MODULES, measured
    assert module_counts(back)[1] <= BACK_MODULES, measured
    assert thread_sections(trace) <= THREAD_SECTIONS, measured
    # each crossing forward enters a module: a way through M modules crosses at least M - 1 times
    assert len(forward) >= module_counts(forward)[1] - 1


def test_the_path_with_a_lora_and_a_controlnet_stays_within_its_bounds(traced_adapters):
    """The same request with the shipped digits model's LoRA and ControlNet (made once before, so the adapters are
    read and the ControlNet's graph captured, as the warm-up leaves a plain request's): the adapters' modules (their
    lookups, slots, control maps, row features and the ControlNet's graph) on top of the plain way, within the bounds
    docs/ARCHITECTURE.md states."""
    _, trace = traced_adapters
    forward, back = trace.phase("fwd"), trace.phase("back")
    measured = render(trace)
    print("\n" + measured)
    print(f"modules forward {module_counts(forward)[1]}, back {module_counts(back)[1]}, thread sections "
          f"{thread_sections(trace)}")
    assert forward and back and forward[-1] == ("engine/control_graphs.py:ControlRunner.run",
                                                REPLAY[0] + ":" + REPLAY[1]), measured  # the ControlNet's replay
    callees = {callee.split(":", 1)[0] for _, callee in forward + back}
    assert {"lora/manager.py", "lora/sidepath.py", "features/lora.py", "engine/controlnets.py",
            "features/control.py"} <= callees, measured
    assert _stated_bounds("with a LoRA and a ControlNet") == (ADAPTER_FORWARD_MODULES, ADAPTER_BACK_MODULES,
                                                             ADAPTER_THREAD_SECTIONS)
    assert module_counts(forward)[1] <= ADAPTER_FORWARD_MODULES, measured
    assert module_counts(back)[1] <= ADAPTER_BACK_MODULES, measured
    assert thread_sections(trace) <= ADAPTER_THREAD_SECTIONS, measured


def test_guidance_interval_and_rescale_over_http(traced):
    client, _ = traced
    body = {"prompt": "a red fox", "num_inference_steps": 2, "seed": 2}
    plain = client.post("/v1/images/generations", json=body)
    r = client.post("/v1/images/generations", json={**body, "guidance_interval": [0.5, 1], "guidance_rescale": 0.7})
    assert plain.status_code == 200 and r.status_code == 200, r.text
    assert r.json()["data"][0]["b64_json"] != plain.json()["data"][0]["b64_json"]  # step 0 ran one branch
    for bad, field, words in (({"guidance_interval": [0.8, 0.2]}, "guidance_interval", "0 <= lo < hi <= 1"),
                              ({"guidance_interval": [0.2]}, "guidance_interval", "must be [lo, hi]"),
                              ({"guidance_interval": ["a", 1]}, "guidance_interval.0", "must be a number"),
                              ({"guidance_rescale": 1.5}, "guidance_rescale", "out of range"),
                              ({"guidance_rescale": "high"}, "guidance_rescale", "must be a number")):
        r = client.post("/v1/images/generations", json={**body, **bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == field and words in r.json()["error"]["message"], r.text


def test_the_family_default_sampler_when_none_is_sent(traced):
    client, _ = traced
    body = {"prompt": "a red fox", "num_inference_steps": 2, "seed": 3}
    r = client.post("/v1/images/generations", json=body)
    euler = client.post("/v1/images/generations", json={**body, "sampler": "euler", "schedule": "default"})
    assert r.status_code == 200 and euler.status_code == 200
    assert r.json()["data"][0]["b64_json"] == euler.json()["data"][0]["b64_json"]  # SD's defaults
    assert client.get("/info").json()["default_sampler"] == "euler"


def test_an_import_failure_while_building_is_reported(monkeypatch):
    """The build thread's imports fail like any build: the error is kept (/ready and the CLI report it)."""
    from diffgraph.server.app import create_app
    from diffgraph.api.config import ServerConfig

    state = create_app(ServerConfig(model="random:tiny", device="cpu")).state.server  # the default engine factory
    monkeypatch.setitem(sys.modules, "diffgraph.engine.replica", None)  # importing it raises ImportError
    state.start()
    state._thread.join(60)
    assert state.engine is None and state.error is not None and "diffgraph.engine.replica" in state.error, state.error


if __name__ == "__main__":  # prints the measured crossings
    sys.exit(pytest.main([__file__, "-q", "-s", "-k", "within_its_bounds", "-p", "no:cacheprovider"]))
