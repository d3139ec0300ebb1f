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

from ..cli_flags import add_checkpoint_arguments, add_compile_mode_argument, add_quantize_arguments
from ..jobs.flags import JOB_FIELDS, add_job_arguments
from .config import ServerConfig, load_config

DRAIN_GRACE_S = 5.0  # after the drain timeout's aborts: how long requests may take to end before the process exits

# the ServerConfig fields a flag can set (flag --batch-buckets -> batch_buckets)
_FIELDS = ("model", "host", "port", "device", "dtype", "mode", "batching", "batch_buckets", "resolutions", "prewarm",
           "max_queue", "max_wait_ms", "grow_fill", "grow_hold_ms", "request_timeout", "max_prompt_bytes",
           "drain_timeout", "log_level", "access_log", "api_keys", "protect_metrics", "playground", "torch_threads",
           "image_threads", "devices", "min_ready", "max_image_bytes", "max_image_pixels", "lora_dir", "max_loras",
           "max_lora_rank", "lora_conv", "fuse_loras", "compile", "compile_mode", "quantize",
           "quantize_min_features", "compile_cache",
           "header_timeout", "body_timeout", "max_connections", "max_client_connections", "trusted_proxies",
           "body_deadline", "min_body_rate", "api_key_file", "embeddings_dir", "max_prompt_chunks",
           "clip_skip", "prompt_syntax", "metadata", "vae", "vae_upcast", "model_config", "prediction_type", "zero_snr",
           "image_ttl", "image_store", "image_store_bytes", "public_url", "model_dir", "max_models", "model_memory",
           "preload", "preview_decoder", "max_step_failures", "max_pixels", "replica_timeout", "lora_host_bytes",
           "controlnet_dir", "max_controlnets", "ip_adapter_dir") + JOB_FIELDS
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the folder holding diffgraph/


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
                   help=f"preset, local diffusers folder or checkpoint file (.safetensors: SD1.x, SD2.x, SDXL) "
                        f"(default: {default('model')}; `diffgraph models` lists presets)")
    add_checkpoint_arguments(p)
    p.add_argument("--model-dir", default=None, metavar="DIR",
                   help="also serve every checkpoint file and diffusers folder under DIR, by its relative name "
                        "(requests pick one with `model`; `diffgraph models --dir DIR` lists them); --model is the "
                        "default")
    p.add_argument("--max-models", type=int, default=None, metavar="N",
                   help="with --model-dir: models resident at once, the least recently used going first (default: 2)")
    p.add_argument("--model-memory", type=float, default=None, metavar="GIB",
                   help="with --model-dir: GiB of weights and graph pools the resident models may hold (default: "
                        "no bound but --max-models)")
    p.add_argument("--preload", default=None, metavar="NAMES",
                   help="with --model-dir: models loaded at start beside the default, comma-separated")
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
                        "(default: 1,2,4,8,16,32: denoiser rows, a guided image costs two)")
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
    p.add_argument("--max-pixels", type=int, default=None, metavar="N",
                   help="the most pixels (width x height) an image may have, else a 400 naming size (default: on "
                        "the CPU, measured at start-up so that a 20-step image takes at most a quarter of the request "
                        "timeout; on a GPU no limit beyond 2048x2048; 0: no limit)")
    p.add_argument("--max-step-failures", type=int, default=None, metavar="K",
                   help="consecutive failed denoising steps that mark the engine failed: /ready answers 503 with the "
                        "reason, routers and Ray route around it, a replica process restarts; an error that leaves "
                        f"the GPU unusable trips it at once (default: {default('max_step_failures')})")
    p.add_argument("--replica-timeout", type=float, default=None, metavar="S",
                   help="--devices: a replica process that sends no heartbeat for S seconds (stopped, wedged in a "
                        "driver call) is routed around and its requests answered 503; killed and restarted after 4 S "
                        f"(default: {default('replica_timeout'):g})")
    p.add_argument("--max-prompt-bytes", type=int, default=None, metavar="N",
                   help=f"longest prompt or negative prompt in UTF-8 bytes; longer ones get 400 "
                        f"(default: {default('max_prompt_bytes')})")
    p.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                   help=f"after SIGTERM, seconds in-flight requests may take before they are aborted "
                        f"(default: {default('drain_timeout'):g})")
    p.add_argument("--header-timeout", type=float, default=None, metavar="S",
                   help="seconds a connection may sit without a request (idle, or still sending its request head) "
                        f"before it is closed (default: {default('header_timeout'):g})")
    p.add_argument("--body-timeout", type=float, default=None, metavar="S",
                   help="seconds a request body may take to arrive before the request gets 408 "
                        f"(default: {default('body_timeout'):g})")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open connections at most: a newcomer closes the connection idle longest, and gets 503 when "
                        "all are busy (default: 1000, fewer under a low `ulimit -n`)")
    p.add_argument("--max-client-connections", type=int, default=None, metavar="N",
                   help="open connections from one client address at most, so that one client cannot take every "
                        "slot: its newcomer closes its own connection idle longest, else gets 503 (default: half of "
                        "--max-connections)")
    p.add_argument("--trusted-proxies", default=None, metavar="ADDRS",
                   help="comma-separated proxy addresses or networks (10.0.0.5,10.1.0.0/16) whose X-Forwarded-For "
                        "names the client that --max-client-connections counts; never read from others "
                        "(default: none)")
    p.add_argument("--body-deadline", type=float, default=None, metavar="S",
                   help="seconds a request body may take on its connection before the connection is closed, one "
                        "more for every --min-body-rate bytes that arrived: a trickled body gives its slot back early "
                        f"(default: {default('body_deadline'):g})")
    p.add_argument("--min-body-rate", type=int, default=None, metavar="BYTES",
                   help="bytes a second that keep a body's --body-deadline moving; 0: no such deadline, only "
                        f"--body-timeout (default: {default('min_body_rate')})")
    p.add_argument("--log-level", default=None, choices=("critical", "error", "warning", "info", "debug"),
                   help="log level (default: info)")
    p.add_argument("--access-log", default=None, action=argparse.BooleanOptionalAction,
                   help="log one line per request; health, ready, status and metrics polls are never logged "
                        "(default: on)")
    p.add_argument("--api-key", dest="api_keys", action="append", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every /v1/* route (repeat for several keys; "
                        "default: the comma-separated keys in $DIFFGRAPH_API_KEY, else open); a key given here shows "
                        "in `ps`: prefer DIFFGRAPH_API_KEY or --api-key-file")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="require the keys in FILE (one a line; # comments), as --api-key does, without putting them "
                        "on the command line")
    p.add_argument("--protect-metrics", default=None, action=argparse.BooleanOptionalAction,
                   help="also require a key for /metrics and /status (default: off; /health and /ready stay open)")
    p.add_argument("--playground", default=None, action=argparse.BooleanOptionalAction,
                   help="serve the playground page at / (default: on; --no-playground turns it off)")
    p.add_argument("--metadata", default=None, action=argparse.BooleanOptionalAction,
                   help="write the settings into every image (AUTOMATIC1111's PNG `parameters` text and the request "
                        "as JSON; EXIF in JPEG/WebP) (default: on; --no-metadata turns it off)")
    p.add_argument("--preview-decoder", default=None, metavar="DIR",
                   help="live previews at full resolution from this tiny decoder: TAESD (SD1.x/SD2.x) or TAESDXL, a "
                        "diffusers AutoencoderTiny folder (default: AUTOMATIC1111's cheap latent-to-RGB approximation)")
    p.add_argument("--image-ttl", type=float, default=None, metavar="S",
                   help="response_format url: seconds a stored image is served at /v1/images/files/ (default: 3600)")
    p.add_argument("--image-store", default=None, metavar="DIR",
                   help="response_format url: store images in this folder (every ingress replica mounting it serves "
                        "them) instead of in memory")
    p.add_argument("--image-store-bytes", type=int, default=None, metavar="N",
                   help="response_format url: the in-memory store's size; the oldest images go first (default: 256 MiB)")
    p.add_argument("--public-url", default=None, metavar="URL",
                   help="response_format url: the base of image URLs, e.g. https://images.example.com (default: the "
                        "request's own scheme and host)")
    p.add_argument("--torch-threads", type=int, default=None, metavar="N",
                   help="torch intra-op threads of a CPU engine (default: the cores minus one, at least 1)")
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="one engine replica process per device, e.g. cuda:0,cuda:1 or cpu,cpu; requests go to the "
                        "replica with the least outstanding work (default: one engine in this process)")
    p.add_argument("--data-parallel", default=None, metavar="N|all",
                   help="the same as --devices cuda:0,...,cuda:N-1 (all: every visible GPU); with --ray: the number "
                        "of engine replicas, or auto (autoscaled)")
    p.add_argument("--min-ready", type=int, default=None, metavar="K",
                   help="with several replicas: /ready answers 200 while at least K are ready (default: 1)")
    p.add_argument("--max-image-bytes", type=int, default=None, metavar="N",
                   help="/v1/images/edits: the most bytes of an uploaded image or mask (default: 20 MiB)")
    p.add_argument("--max-image-pixels", type=int, default=None, metavar="N",
                   help="/v1/images/edits: the most pixels of an image, read from its header before decoding "
                        "(default and most: 16 megapixels)")
    p.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve (pip install 'diffgraph[ray]'): an ingress and --data-parallel N "
                        "engine replicas (auto: autoscaled), one GPU each (none with --device cpu)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --ray: the Ray cluster to join (default: RAY_ADDRESS, else a local Ray started here)")
    p.add_argument("--image-threads", type=int, default=None, metavar="N",
                   help=f"threads that encode finished images (default: {default('image_threads')})")
    add_lora_arguments(p)
    add_controlnet_arguments(p)
    add_prompt_arguments(p)
    add_job_arguments(p)
    p.add_argument("--compile", action="store_true", default=None,
                   help="the compile tier: the whole step, the text encoder(s) and the VAE compiled by Inductor, then "
                        "captured in the graphs as usual (slow start on an empty cache; see --compile-cache)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="with --compile: where compiled artifacts are kept (default: ~/.cache/diffgraph/compile); "
                        "`diffgraph compile` fills one ahead of time")
    add_compile_mode_argument(p)
    add_quantize_arguments(p)


def add_prompt_arguments(p: argparse.ArgumentParser) -> None:
    """The prompt flags of `diffgraph serve` (text/: AUTOMATIC1111's syntax, embeddings, clip skip)."""
    p.add_argument("--embeddings-dir", default=None, metavar="DIR",
                   help="a folder of .safetensors textual-inversion embeddings; a1111-syntax prompts use them by name "
                        "(easynegative, or embedding:easynegative); files added later are found without a restart")
    p.add_argument("--max-prompt-chunks", type=int, default=None, metavar="N",
                   help="a1111-syntax prompts: the 75-token chunks one prompt may use, 1-4 (default: 3, 225 tokens)")
    p.add_argument("--clip-skip", type=int, default=None, metavar="N",
                   help="the clip skip of requests that give none, in diffusers' numbering (1 = the penultimate "
                        "layer, AUTOMATIC1111's 'CLIP skip 2'; default: none)")
    p.add_argument("--prompt-syntax", default=None, choices=("plain", "a1111"),
                   help="how the images routes read prompts that do not say (default: plain, diffusers' reading)")


def add_controlnet_arguments(p: argparse.ArgumentParser) -> None:
    """The ControlNet flags shared by serve and generate."""
    p.add_argument("--controlnet-dir", default=None, metavar="DIR",
                   help="a folder of ControlNets (diffusers folders, or single .safetensors files as "
                        "AUTOMATIC1111 and ComfyUI keep them); requests name them by their path under DIR "
                        "(controls: [{model, image, scale, start, end}]); ones added later are found")
    p.add_argument("--max-controlnets", type=int, default=None, metavar="N",
                   help="ControlNets resident on the device at once (default: 2); more distinct ones in flight "
                        "make requests wait")
    p.add_argument("--ip-adapter-dir", default=None, metavar="DIR",
                   help="a folder of IP-Adapters (h94's .safetensors layout, their CLIP vision model in an "
                        "image_encoder folder beside or above them); requests name them by their path without the "
                        "suffix (image_prompts: {model, images, scale})")


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    """The LoRA adapter flags shared by serve and generate."""
    p.add_argument("--lora-dir", default=None, metavar="DIR",
                   help="a folder of .safetensors LoRA adapters; requests name them by their path under DIR without "
                        "the suffix (styles/ink); files added later are found without a restart")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="device slots for adapters in flight (default: 8 with --lora-dir; at least 4); more "
                        "distinct adapters in flight make requests wait")
    p.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help="the largest adapter rank the slots take (default: 64); a smaller one makes steps cheaper")
    p.add_argument("--lora-host-bytes", type=int, default=None, metavar="N",
                   help="bytes of prepared adapter copies kept on the host between requests (queued requests hold "
                        "names and file versions; a copy dropped is read again at admission; default: "
                        "2 GiB)")
    p.add_argument("--lora-conv", action="store_true", default=None,
                   help="side paths on the convolutions too, for adapters that touch them (LoCon, LCM-LoRA, TCD, "
                        "Hyper-SD); costs slot memory (SD1.5 rank 64: 77 MiB a slot) and step time with adapters")
    p.add_argument("--fuse-lora", action="append", default=None, metavar="NAME[:SCALE]",
                   help="merge an adapter (a name in --lora-dir, or a .safetensors path) into the weights at "
                        "start-up, at no cost per step; repeatable")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    overrides = {name: getattr(args, name, None) for name in _FIELDS}
    overrides["fuse_loras"] = getattr(args, "fuse_lora", None)
    dp = getattr(args, "data_parallel", None)
    if getattr(args, "ray", False):
        if overrides.get("devices"):
            raise ValueError("--devices is for one host without Ray; with --ray, --data-parallel N sets the engine "
                             "replicas (one GPU each)")
    elif dp is not None:
        if overrides.get("devices"):
            raise ValueError("give --devices or --data-parallel, not both")
        overrides["devices"] = data_parallel_devices(dp)
    return load_config(args.config, overrides)


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
    if model in RANDOM_PRESETS or os.path.isdir(model):
        return
    if model in SHIPPED_PRESETS and shipped_preset_folder(model):
        return
    if os.path.exists(model):  # a checkpoint file: what its header says it holds, or one line why not
        from ..models.checkpoint_kind import inspect_checkpoint
        inspect_checkpoint(model)
        return
    raise ValueError(f"model {model!r} is neither a local diffusers folder nor a preset of this install, and no "
                     "checkpoint file has that path; "
                     f"presets: {', '.join(available_presets())}{did_you_mean(model, available_presets())}")


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
