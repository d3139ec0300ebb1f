"""`diffgraph serve`: flags (and a TOML file) -> ServerConfig -> the app under uvicorn, with a graceful drain.

    diffgraph serve --model digits --port 8000 --batch-buckets 1,2,4,8 --resolutions 512x512 --config serve.toml

The first SIGTERM (or Ctrl-C) drains: the server keeps listening but answers new generation requests and
/ready with 503, lets the requests in flight finish for up to --drain-timeout seconds (then aborts them),
and exits 0. A second signal exits at once.

Before anything loads, the port is bound (a port in use is one line naming --port, exit 2); connections are bounded
by connections.py's guard (--header-timeout, --body-deadline, --max-connections, --max-client-connections), the access log drops polls and redacts secrets (in
query strings, signed URLs' signatures, API keys in paths), and one INFO line says when the server is ready, where,
and how long start-up took.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from typing import Any, Callable
from urllib.parse import unquote_plus

from ..capability_settings import add_capability_flags, builtin_settings, capability_args
from ..settings import add_flags, declared
from ..api.config import ServerConfig, load_config, with_capability_settings

DRAIN_GRACE_S = 5.0  # after the drain timeout's aborts: how long requests may take to end before the process exits

LOOPBACK = ("127.0.0.1", "localhost", "::1")
_SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the folder holding diffgraph/


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `diffgraph serve`: every ServerConfig setting's (in its argument group; settings.py), and those
    that choose how to serve rather than set a setting. Every default is None so that a flag not given leaves the
    config file's value (or the built-in default shown in the help) in place."""
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML file with any of these settings, named like the flags (e.g. batch-buckets = [1, 2, 4]); "
                        "flags given on the command line override it")
    groups = add_flags(p, ServerConfig)
    # the built-in capabilities' settings (`--step-cache`), among the other capabilities' flags
    add_capability_flags(p, builtin_settings(), groups["capabilities"])
    replicas = groups["replicas"]
    replicas.add_argument("--data-parallel", default=None, metavar="N|all",
                          help="the same as --devices cuda:0,...,cuda:N-1 (all: every visible GPU); with --ray: the "
                               "number of engine replicas, or auto (autoscaled)")
    replicas.add_argument("--ray", action="store_true",
                          help="serve through Ray Serve (pip install 'diffgraph[ray]'): an ingress and --data-parallel "
                               "N engine replicas (auto: autoscaled), one GPU each (none with --device cpu)")
    replicas.add_argument("--ray-address", default=None, metavar="ADDR",
                          help="with --ray: the Ray cluster to join (default: RAY_ADDRESS, else a local Ray started "
                               "here)")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    overrides = {f.name: getattr(args, f.name, None) for f, _ in declared(ServerConfig)}
    dp = getattr(args, "data_parallel", None)
    if getattr(args, "ray", False):
        if overrides.get("devices"):
            raise ValueError("--devices is for one host without Ray; with --ray, --data-parallel N sets the engine "
                             "replicas (one GPU each)")
    elif dp is not None:
        if overrides.get("devices"):
            raise ValueError("give --devices or --data-parallel, not both")
        overrides["devices"] = data_parallel_devices(dp)
    # each capability's own flags, over --capability-settings and the file's
    return with_capability_settings(load_config(args.config, overrides), capability_args(args))


def data_parallel_devices(value: str, visible: int | None = None) -> str:
    """--data-parallel N | all -> "cuda:0,...,cuda:N-1" (N at most the visible GPUs)."""
    if visible is None:
        visible = _in_a_child("import torch; print(torch.cuda.device_count())")
    n = visible if value == "all" else int(value) if value.isdigit() else -1
    if n < 1 or n > visible:
        raise ValueError(f"--data-parallel {value!r}: this machine has {visible} visible GPU(s); give 1..{visible} "
                         "or all (for CPU replicas use --devices cpu,cpu)")
    return ",".join(f"cuda:{i}" for i in range(n))


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, except that the first SIGTERM / SIGINT drains (see the module docstring) instead of closing
        connections, and the signal is not re-raised afterwards, so a drained server exits 0."""

        def __init__(self, config: uvicorn.Config, state: Any, url: str, started: float):
            super().__init__(config)
            self.state = state
            self.url, self.started_at, self.announced = url, started, False
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
            if not self.announced and self.started and s.ready:
                self.announced = True
                info = s.engine.info
                logging.getLogger("diffgraph.server").info(
                    "ready: %s serves %s; start-up took %.1f s", self.url, info.name if info else s.config.model,
                    time.monotonic() - self.started_at)
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


# paths polled by load balancers and scrapers: never in the access log
QUIET_PATHS = ("/health", "/ready", "/metrics", "/status")


# query parameters whose values never reach the log: a name holding any of these (api_key, token, access_token ...),
# or one of the names: a key given as `k`, a signed image URL's signature
SECRET_PARAMS = ("key", "token", "secret", "password", "auth")
SECRET_NAMES = ("k", "sig")
REDACTED = "[redacted]"


def redact_query(path: str, keys: tuple[str, ...] = ()) -> str:
    """`path` with the values of secret-looking query parameters replaced (names are read percent-decoded), and each
    part of it that is one of `keys` (the API keys: a client that put its key in the path) replaced too."""
    if keys:
        path = re.sub(r"[^/?&=;]+", lambda m: REDACTED if unquote_plus(m.group()) in keys else m.group(), path)
    base, sep, query = path.partition("?")
    if not sep:
        return path
    parts = []
    for item in query.split("&"):
        name, eq, _ = item.partition("=")
        name_read = unquote_plus(name).lower()
        if name_read in SECRET_NAMES or any(word in name_read for word in SECRET_PARAMS):
            item = f"{name}{eq or '='}{REDACTED}"
        parts.append(item)
    return f"{base}?{'&'.join(parts)}"


class _QuietPolls(logging.Filter):
    """uvicorn's access log (the record's args: client, method, path, ...): drops the records of the polled paths,
    and redacts secrets from the others: query parameters that hold them, and the API `keys` wherever they stand."""

    def __init__(self, keys: tuple[str, ...] = ()):
        super().__init__()
        self.keys = frozenset(keys)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        path = str(args[2]) if len(args) > 2 else ""
        if path.split("?", 1)[0] in QUIET_PATHS:
            return False
        if "?" in path or self.keys:
            record.args = (*args[:2], redact_query(path, self.keys), *args[3:])
        return True


def quiet_access_log(config: ServerConfig) -> logging.Filter:
    """Puts the access log's filter (`_QuietPolls`, with the server's API keys) on uvicorn's access logger; returns
    it, for whoever removes it again."""
    quiet = _QuietPolls(tuple(config.api_keys))
    logging.getLogger("uvicorn.access").addFilter(quiet)
    return quiet


def open_server_warning(config: ServerConfig) -> str | None:
    """The warning for a server that listens beyond this machine without an API key, or None."""
    if config.host in LOOPBACK or config.api_keys:
        return None
    return (f"listening on {config.host} without an API key: anyone who can reach port {config.port} can use this "
            "server; set DIFFGRAPH_API_KEY or give --api-key-file FILE to require a key")


def key_file_warning(config: ServerConfig) -> str | None:
    """The warning for an API key file that other users may read, or None."""
    if config.api_key_file is None or os.name != "posix":
        return None
    try:
        mode = os.stat(config.api_key_file).st_mode
    except OSError:
        return None
    if not mode & 0o077:
        return None
    return f"api-key-file {config.api_key_file} may be read by other users; chmod 600 {config.api_key_file}"


def apply_thread_settings(config: ServerConfig, cpu_count: int | None = None) -> dict[str, Any]:
    """torch's thread pools for a server process that holds its engine (a factory's): on a CPU engine, intra-op threads
    from `resolved_torch_threads` and one inter-op thread (the engine loop is the only caller). Returns what was
    applied. On CUDA nothing changes (the host threads only launch work)."""
    import torch

    applied: dict[str, Any] = {"device": config.device or ("cuda" if torch.cuda.is_available() else "cpu")}
    if applied["device"].startswith("cuda"):
        return applied
    threads = config.resolved_torch_threads(cpu_count)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or inter-op work already ran in this process: keep what is there
        pass
    applied.update(torch_threads=torch.get_num_threads(), interop_threads=torch.get_num_interop_threads(),
                   image_threads=config.image_threads)
    return applied


def serve(config: ServerConfig, engine_factory: Callable[[], Any] | None = None) -> int:
    """Runs the server until drained; 0 after a clean drain, 1 when the engine could not be built, 2 when it cannot
    listen (one line on stderr). `engine_factory`: as create_app's (default: the engine of `config`)."""
    import uvicorn

    from .app import create_app
    from .connections import (ConnectionGuard, descriptor_limit, guarded_protocol, listen,
                              resolve_max_client_connections, resolve_max_connections)

    started = time.monotonic()
    log = logging.getLogger("diffgraph.server")
    try:
        max_connections = resolve_max_connections(config.max_connections, descriptor_limit())
        sockets = listen(config.host, config.port)
    except ValueError as e:
        print(f"diffgraph: error: {e}", file=sys.stderr)
        return 2
    host, port = sockets[0].getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    per_client = resolve_max_client_connections(config.max_client_connections, max_connections)
    log.info("listening on %s (at most %d connections, %d a client); loading %s", url, max_connections, per_client,
             config.model)
    for warning in (open_server_warning(config), key_file_warning(config)):
        if warning:
            log.warning("%s", warning)
    if engine_factory is not None:  # an engine in this process; else each replica process sets its own
        log.info("threads: %s", apply_thread_settings(config))
    app = create_app(config, engine_factory)
    state = app.state.server
    quiet_access_log(config)
    guard = ConnectionGuard(max_connections, config.header_timeout, max_client_connections=per_client,
                            body_deadline=config.body_deadline, min_body_rate=config.min_body_rate,
                            trusted_proxies=config.trusted_proxies)
    # no limit_concurrency: the guard bounds connections (uvicorn's bound counts idle sockets against requests)
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                        access_log=config.access_log, timeout_graceful_shutdown=5, lifespan="on",
                        http=guarded_protocol(guard), ws="none", timeout_keep_alive=config.header_timeout)
    server = _server_class()(uv, state, url, started)
    server.run(sockets=sockets)
    if state.error is not None:
        print(f"diffgraph: error: the engine could not be built: {state.error}", file=sys.stderr)
        return 1
    return 0


def _check_model(model: str) -> None:
    """Fails fast, before the server starts, on a model name that cannot load."""
    import os

    from ..cli_checks import did_you_mean
    from ..models.presets import RANDOM_PRESETS, SHIPPED_PRESETS, available_presets, shipped_preset_folder
    presets = available_presets()
    # a family's own random presets (random:zimage-turbo, ...) are the family's to check, in the engine's process
    # (the families import torch, which this process never does): its loader refuses an unknown one naming them
    if model in RANDOM_PRESETS or model.startswith("random:") or os.path.isdir(model):
        return
    if model in SHIPPED_PRESETS and shipped_preset_folder(model):
        return
    if os.path.exists(model):  # a checkpoint file: what its header says it holds, or one line why not
        from ..models.split_files import split_kind_of
        if model.endswith((".safetensors", ".gguf")) and split_kind_of(model) is not None:
            return  # a split diffusion model: its companions are checked where it loads
        from ..models.checkpoint_kind import inspect_checkpoint
        inspect_checkpoint(model)
        return
    raise ValueError(f"model {model!r} is neither a local diffusers folder nor a preset of this install, and no "
                     f"checkpoint file has that path; presets: {', '.join(presets)}{did_you_mean(model, presets)}")


def _in_a_child(code: str, *args: str) -> Any:
    """The JSON that `code` prints, run in a short child process with `args` as sys.argv[1:]: what needs torch (a
    CUDA check, the visible GPUs) is asked there, since the server's own process never imports torch (its engines
    live in replica processes)."""
    import json
    import subprocess

    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_SRC, os.environ.get(
                             "PYTHONPATH")]))})
    if run.returncode != 0:
        last = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit code {run.returncode}"
        raise ValueError(f"asking torch about the devices failed ({last}); check the torch install")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _cuda_device_error(devices: tuple[str | None, ...]) -> str | None:
    """`cli_checks.cuda_device_error` for the devices that name CUDA (None when none does)."""
    cuda = [d for d in devices if d and d.strip().lower().startswith("cuda")]
    return _in_a_child("import json, sys; from diffgraph.cli_checks import cuda_device_error as e; "
                       "print(json.dumps(next(filter(None, map(e, sys.argv[1:])), None)))", *cuda) if cuda else None


# (config, --data-parallel, --ray-address) -> exit code: Ray Serve's launcher, which the command line above this
# package hands in (ray.py imports the server, so the server cannot import it)
RayServer = Callable[[ServerConfig, "int | None", "str | None"], int]


def run_serve(args: argparse.Namespace, ray_server: RayServer | None = None) -> int:
    try:
        config = config_from_args(args)
        # the CUDA check of `diffgraph serve`'s flags, for a device the TOML file sets too (or under `python -m
        # diffgraph.server.cli`): one line naming the fix, not a traceback from the engine's start
        for flag, devices in (("--device", (config.device,)), ("--devices", config.devices)):
            error = _cuda_device_error(devices)
            if error:
                raise ValueError(f"{flag} {','.join(d for d in devices if d)}: {error}")
        _check_model(config.model)
        if config.preview_decoder and not os.path.isfile(os.path.join(config.preview_decoder, "config.json")):
            raise ValueError(f"--preview-decoder {config.preview_decoder}: no config.json there; give a diffusers "
                             "AutoencoderTiny folder (TAESD for SD1.x/SD2.x, TAESDXL for SDXL)")
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
    if getattr(args, "ray", False):
        if ray_server is None:
            print("diffgraph: error: --ray is served by `diffgraph serve --ray`", file=sys.stderr)
            return 2
        return ray_server(config, args.data_parallel, args.ray_address)
    return _exit(serve(config))


def _exit(code: int) -> int:
    """`code`, or, while an engine step still runs (a drain that outlasted its timeout during a long step), the
    process ends here with `code` without the interpreter's teardown, which would abort under the busy native op
    ("terminate called without an active exception", SIGABRT) instead of exiting as drained."""
    from ..engine.device_loop import loops_running
    busy = loops_running()
    if busy:
        logging.getLogger("diffgraph.server").warning("exiting while a step still runs (%s)", ", ".join(busy))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="diffgraph serve", description=__doc__.split("\n\n")[0])
    add_serve_arguments(p)
    return run_serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
