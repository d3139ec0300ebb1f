"""`diffgraph serve`: flags (and a TOML file) -> ServerConfig -> the app under uvicorn, with a graceful drain.

    diffgraph serve --model digits --port 8000 --batch-buckets 1,2,4,8 --resolutions 512x512 --config serve.toml

The first SIGTERM (or Ctrl-C) drains: the server keeps listening but answers new generation requests and
/ready with 503, lets the requests in flight finish for up to --drain-timeout seconds (then aborts them),
and exits 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from .config import ServerConfig, load_config

DRAIN_GRACE_S = 5.0  # after the drain timeout's aborts: how long requests may take to end before the process exits

# the ServerConfig fields a flag can set (flag --batch-buckets -> batch_buckets)
_FIELDS = ("model", "host", "port", "device", "dtype", "mode", "batching", "batch_buckets", "resolutions",
           "prewarm", "max_queue", "max_wait_ms", "grow_fill", "grow_hold_ms", "request_timeout", "max_prompt_bytes", "drain_timeout", "log_level")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `diffgraph serve`. Every default is None so that a flag not given leaves the config file's
    value (or the built-in default shown in the help) in place."""
    d = ServerConfig.__dataclass_fields__

    def default(name: str) -> Any:
        f = d[name]
        return f.default_factory() if callable(f.default_factory) else f.default

    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML file with any of these settings, named like the flags (e.g. batch-buckets = [1, 2, 4]); "
                        "flags given on the command line override it")
    p.add_argument("--model", default=None,
                   help=f"preset or local diffusers folder (default: {default('model')}; `diffgraph models` lists presets)")
    p.add_argument("--host", default=None, help=f"address to listen on (default: {default('host')})")
    p.add_argument("--port", type=int, default=None, help=f"port to listen on (default: {default('port')})")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="fp16, bf16 or fp32 (default: fp16 on cuda, fp32 on cpu)")
    p.add_argument("--mode", default=None, choices=("graph", "eager"),
                   help="graph: replay captured CUDA graphs; eager: plain PyTorch (default: graph on cuda, eager on cpu)")
    p.add_argument("--batching", default=None, choices=("step", "request", "off"),
                   help="step: requests join and leave between denoising steps; request: a batch runs to the end "
                        "together; off: one request at a time (default: step)")
    p.add_argument("--batch-buckets", default=None, metavar="LIST",
                   help="batch sizes that get a CUDA graph; the largest bounds live rows per resolution and n "
                        "(default: 1,2,4,8,16)")
    p.add_argument("--resolutions", default=None, metavar="WxH,...",
                   help="resolutions that get CUDA graphs, e.g. 512x512,768x512; other sizes run eagerly "
                        "(default: the model's native size)")
    p.add_argument("--prewarm", default=None, metavar="SPEC",
                   help="graphs captured before /ready answers 200: all, none, or WxH[@b1/b2...],... "
                        "(others are captured on first use; default: all)")
    p.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help=f"waiting requests before new ones get 429 (default: {default('max_queue')})")
    p.add_argument("--max-wait-ms", type=float, default=None, metavar="MS",
                   help="request batching: how long an empty batch waits for company (default: 0)")
    p.add_argument("--grow-fill", type=float, default=None, metavar="F",
                   help="step batching with graphs: a resolution group grows into a larger batch bucket only when "
                        f"the rows fill at least this fraction of it; 0 turns this off (default: {default('grow_fill')})")
    p.add_argument("--grow-hold-ms", type=float, default=None, metavar="MS",
                   help="...or once the oldest waiting request has waited this long "
                        f"(default: {default('grow_hold_ms'):g})")
    p.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help=f"seconds a request may take, queueing included, before it is aborted with 504 "
                        f"(default: {default('request_timeout'):g})")
    p.add_argument("--max-prompt-bytes", type=int, default=None, metavar="N",
                   help=f"longest prompt or negative prompt in UTF-8 bytes; longer ones get 400 "
                        f"(default: {default('max_prompt_bytes')})")
    p.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                   help=f"after SIGTERM, seconds in-flight requests may take before they are aborted "
                        f"(default: {default('drain_timeout'):g})")
    p.add_argument("--log-level", default=None, choices=("critical", "error", "warning", "info", "debug"),
                   help="log level (default: info)")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return load_config(args.config, {name: getattr(args, name, None) for name in _FIELDS})


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, except that the first SIGTERM / SIGINT drains (see the module docstring) instead of closing
        connections, and the signal is not re-raised afterwards, so a drained server exits 0."""

        def __init__(self, config: uvicorn.Config, state: Any):
            super().__init__(config)
            self.state = state
            self.drain_started: float | None = None
            self.aborted = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.drain_started is None:
                self.drain_started = time.monotonic()
                self.state.begin_drain()
            else:  # a second signal: stop now
                self.should_exit = True
                self.force_exit = True

        async def on_tick(self, counter: int) -> bool:
            s = self.state
            if s.error is not None:
                self.should_exit = True  # the engine could not be built: nothing to serve
            if self.drain_started is not None:
                if s.inflight == 0:
                    self.should_exit = True
                elif time.monotonic() - self.drain_started > s.config.drain_timeout and not self.aborted:
                    logging.getLogger("diffgraph.server").warning(
                        "drain timeout: aborting %d request(s) in flight", s.inflight)
                    self.aborted = True
                    s.abort_all()
                elif time.monotonic() - self.drain_started > s.config.drain_timeout + DRAIN_GRACE_S:
                    # what the aborts did not end (a client still sending its body, say) ends with the process
                    logging.getLogger("diffgraph.server").warning(
                        "%d request(s) still open %g s after the drain timeout; exiting", s.inflight, DRAIN_GRACE_S)
                    self.should_exit = True
            return await super().on_tick(counter)

    return DrainingServer


def serve(config: ServerConfig) -> int:
    """Runs the server until drained; 0 after a clean drain, 1 when the engine could not be built."""
    import uvicorn

    from .app import create_app

    app = create_app(config)
    state = app.state.server
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                        timeout_graceful_shutdown=5, lifespan="on")
    server = _server_class()(uv, state)
    server.run()
    if state.error is not None:
        print(f"diffgraph: error: the engine could not be built: {state.error}", file=sys.stderr)
        return 1
    return 0


def _check_model(model: str) -> None:
    """Fails fast, before the server starts, on a model name that cannot load."""
    import os

    from ..models.presets import RANDOM_PRESETS, SHIPPED_PRESETS, available_presets, shipped_preset_folder
    if model in RANDOM_PRESETS or os.path.isdir(model):
        return
    if model in SHIPPED_PRESETS and shipped_preset_folder(model):
        return
    raise ValueError(f"model {model!r} is neither a local diffusers folder nor a preset of this install; "
                     f"presets: {', '.join(available_presets())}")


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        _check_model(config.model)
    except ValueError as e:
        print(f"diffgraph: error: {e}", file=sys.stderr)
        return 2
    try:
        import fastapi, prometheus_client, uvicorn  # noqa: F401
    except ImportError as e:
        print(f"diffgraph: error: serving needs fastapi, uvicorn and prometheus_client ({e}); "
              "pip install fastapi uvicorn prometheus_client", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return serve(config)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="diffgraph serve", description=__doc__.split("\n\n")[0])
    add_serve_arguments(p)
    return run_serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
