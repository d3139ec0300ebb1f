"""`ServerConfig`: every setting of `diffgraph serve`, from defaults, a TOML file and flags (in that order).

A TOML file holds the same settings as the flags, named like them (`batch-buckets` or `batch_buckets`):

    model = "digits"
    port = 8000
    batch-buckets = [1, 2, 4, 8]        # or "1,2,4,8"
    resolutions = ["512x512", "768x512"] # WxH
    prewarm = "all"                      # "none" | "512x512@1/2/4,..."
    request-timeout = 120

examples/serve.toml lists every setting. `ServerConfig.engine_kwargs()` is what the app hands to `Engine(...)`;
nothing else reads the file. API keys also come from a file of keys (`api-key-file`, one a line, added to any given
as `api-key`), or from the environment variable DIFFGRAPH_API_KEY (comma-separated) when neither the file nor a flag
gives one: both keep keys out of `ps` and shell history, which a key on the command line is not. Keys are never
printed (the field is left out of the repr).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..config import (DEFAULT_BUCKETS, DTYPE_NAMES, CompileConfig, GraphConfig, LoadOptions, LoraConfig,
                      default_cpu_threads, parse_buckets, parse_compile_mode, parse_name_scales, parse_prewarm,
                      parse_quantize,
                      parse_resolutions, quantize_argument)
from ..engine.remote_models import ModelSetSpec
from ..engine.scheduler import SchedulerConfig
from ..request import MAX_CLIP_SKIP, MAX_EDIT_PIXELS, MAX_PROMPT_CHUNKS, PROMPT_SYNTAXES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # those logging and uvicorn both know

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None


def default_model() -> str:
    """The shipped `digits` preset when this install carries it, else `random:tiny` (noise, but no files)."""
    from ..models.presets import DEFAULT_MODEL
    return DEFAULT_MODEL


@dataclass(frozen=True)
class ServerConfig:
    model: str = field(default_factory=default_model)
    host: str = "127.0.0.1"
    port: int = 8000
    device: str | None = None            # None: cuda when available
    dtype: str | None = None             # None: fp16 on cuda, fp32 on cpu
    mode: str | None = None              # None: graph on cuda, eager on cpu
    batching: str = "step"
    batch_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    resolutions: tuple[tuple[int, int], ...] = ()   # (height, width); empty: the model's native size
    prewarm: bool | tuple[tuple[int, int, int], ...] = True
    max_queue: int = 256
    max_wait_ms: float = 0.0
    grow_fill: float = 0.85              # step batching: grow into a larger bucket only when filling this much of it
    grow_hold_ms: float = 2000.0         # ... or once the queue head has waited this long
    request_timeout: float = 600.0       # seconds a request may take, queue included; then 504 and abort
    max_prompt_bytes: int = 4096         # UTF-8 bytes of prompt / negative_prompt
    drain_timeout: float = 30.0          # after SIGTERM: seconds in-flight requests may still take
    header_timeout: float = 5.0          # seconds a connection may be idle or sending a request head; then closed
    body_timeout: float = 60.0           # seconds a request body may take to arrive; then 408
    max_connections: int | None = None   # open connections, past them 503; None: from the descriptor limit
    max_client_connections: int | None = None  # open connections from one client address; None: half the above
    trusted_proxies: tuple[str, ...] = ()  # proxies (addresses, networks) whose X-Forwarded-For names the client
    body_deadline: float = 10.0          # seconds a request body may take on its connection before it is closed ...
    min_body_rate: int = 4096            # ... plus one per this many bytes of it that arrived; 0: only body_timeout
    log_level: str = "info"
    access_log: bool = True              # one line per request; health, ready, status and metrics polls never
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # Bearer keys /v1/* requires; () = open
    api_key_file: str | None = field(default=None, repr=False)  # a file of keys (one a line), added to api_keys
    protect_metrics: bool = False        # also require a key for /metrics and /status
    playground: bool = True              # GET / serves the playground page
    torch_threads: int | None = None     # torch intra-op threads on the CPU; None: derived from the cores
    image_threads: int = 2               # threads that wait for decodes and encode images
    devices: tuple[str, ...] = ()        # one engine replica process per device (cpu,cpu / cuda:0,cuda:1); () = one
    min_ready: int = 1                   # with devices: /ready is 200 while at least this many replicas are ready
    max_image_bytes: int = 20 * 1024 * 1024   # /v1/images/edits: bytes of an uploaded image (or mask)
    max_image_pixels: int = 16 * 1024 * 1024  # /v1/images/edits: pixels of an image, read from its header
    lora_dir: str | None = None          # a folder of .safetensors LoRA adapters, served by name
    max_loras: int | None = None         # adapter device slots; None: 8 with a lora_dir, else none
    max_lora_rank: int = 64              # the slots' rank
    lora_conv: bool = False              # side paths on the convolutions too (LoCon, LCM-LoRA, TCD, Hyper-SD)
    fuse_loras: tuple[tuple[str, float], ...] = ()  # (name or path, scale) merged into the weights at start-up
    controlnet_dir: str | None = None    # a folder of ControlNets (diffusers folders, single files), by name
    max_controlnets: int = 2             # ControlNets resident on the device at once (LRU; one in use stays)
    ip_adapter_dir: str | None = None    # a folder of IP-Adapters (h94's layout) and their image encoders
    compile: bool = False                # the compile tier: step, text encoder and VAE compiled by Inductor
    compile_mode: str = "default"        # its Inductor mode (config.COMPILE_MODES): max-autotune-no-cudagraphs
    quantize: str = "none"               # "fp8": the denoiser's transformer linears in fp8 (config.QUANTIZE_CHOICES)
    quantize_min_features: int | None = None  # with fp8: only linears of at least this many inputs (None: 640)
    embeddings_dir: str | None = None    # a folder of .safetensors textual-inversion embeddings, named in prompts
    max_prompt_chunks: int = 3           # a1111-syntax prompts: 75-token chunks a row may hold (its context length)
    clip_skip: int | None = None         # the default clip skip of requests that give none (diffusers' numbering)
    prompt_syntax: str = "plain"         # the default prompt syntax of the images routes ("plain" or "a1111")
    compile_cache: str | None = None     # its compiled artifacts (default: the user's cache folder)
    metadata: bool = True                # the settings inside every image (image_metadata.py); False: bare images
    preview_decoder: str | None = None   # live previews from this tiny decoder (TAESD, an AutoencoderTiny folder)
    max_step_failures: int = 3           # consecutive failed steps that mark the engine failed (engine/failures.py)
    replica_timeout: float = 30.0        # --devices: a replica without a heartbeat this long is unresponsive
    lora_host_bytes: int = 2 * 2**30     # prepared adapter copies kept on the host (queued requests hold names)
    max_pixels: int | None = None        # the most pixels an image may have; None: measured on the CPU; 0: no limit
    image_ttl: float = 3600.0            # response_format "url": seconds a stored image is served
    image_store: str | None = None       # ... stored in this folder (shared by ingress replicas), else in memory
    image_store_bytes: int = 256 * 1024 * 1024  # ... the in-memory store's bound (the oldest images go first)
    public_url: str | None = None        # ... the base of the URLs (default: the request's own scheme and host)
    model_dir: str | None = None         # every checkpoint file and diffusers folder under it, by relative name
    max_models: int = 2                  # with model_dir: models resident at once (least recently used goes first)
    model_memory: float | None = None    # with model_dir: GiB of weights and graph pools the resident models may use
    preload: tuple[str, ...] = ()        # with model_dir: models loaded at start, beside the default
    vae: str | None = None               # a VAE (single file or diffusers folder) in place of the model's
    vae_upcast: bool | None = None       # fp32 decode of an fp16 model; None: the VAE config's (False: fp16-safe VAE)
    model_config: str | None = None      # a single-file checkpoint's diffusers config folder (else detected)
    prediction_type: str | None = None   # epsilon | v_prediction, over the model's (or the checkpoint's marks)
    zero_snr: bool | None = None         # zero terminal SNR betas (v-prediction fine-tunes), over the model's
    state_dir: str | None = None         # batch jobs (/v1/jobs): SQLite and images under it; None: no jobs
    job_retention: float = 7 * 86400.0   # seconds a finished job's rows and images are kept ("90m", "12h", "7d")
    max_batch_items: int = 100_000       # items one job may hold
    max_job_candidates: int = 100_000    # candidate images one job may hold (4,000 shots x 15 candidates fit)
    max_key_jobs: int = 16               # unfinished jobs one API key may have at once
    max_key_bytes: int = 256 * 2**30     # bytes one API key's jobs may keep (images and rows)
    batch_inflight: int | None = None    # job requests in the engine at once; None: 2 x the largest bucket per replica
    webhook_allow: tuple[str, ...] = ()  # hosts job webhooks may call ("host" or "host:port"); () = no webhooks
    webhook_secret: str | None = field(default=None, repr=False)  # signs webhook calls; None: derived from the keys

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a preset name, a local diffusers folder or a checkpoint file")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is out of range; allowed: 0..65535")
        if self.max_prompt_bytes < 1:
            raise ValueError(f"max_prompt_bytes {self.max_prompt_bytes} must be >= 1")
        if not self.request_timeout >= 1:  # NaN fails this too
            raise ValueError(f"request_timeout {self.request_timeout} must be >= 1 second")
        if self.max_pixels is not None and self.max_pixels < 0:
            raise ValueError(f"max-pixels {self.max_pixels} must be >= 0 (0: no limit)")
        if not self.replica_timeout > 0:
            raise ValueError(f"replica-timeout {self.replica_timeout} must be > 0 seconds")
        if self.lora_host_bytes < 0:
            raise ValueError(f"lora-host-bytes {self.lora_host_bytes} must be >= 0")
        if self.max_step_failures < 1:
            raise ValueError(f"max-step-failures {self.max_step_failures} must be >= 1 (1: the first failed step "
                             "fails the engine)")
        if not self.drain_timeout > 0:
            raise ValueError(f"drain_timeout {self.drain_timeout} must be > 0 seconds")
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device {self.device!r} is not understood; use cpu, cuda or cuda:N")
        if self.dtype is not None and self.dtype.lower() not in DTYPE_NAMES:
            raise ValueError(f"dtype {self.dtype!r} is unknown; allowed: {', '.join(DTYPE_NAMES)}")
        if self.mode is not None and self.mode not in ("graph", "eager"):
            raise ValueError(f"mode {self.mode!r} is unknown; allowed: graph, eager")
        # the scheduler's and the graphs' settings, checked by their own configs before anything loads
        SchedulerConfig(batching=self.batching, max_queue=self.max_queue, max_wait_ms=self.max_wait_ms,
                        grow_fill=self.grow_fill, grow_hold_ms=self.grow_hold_ms)
        self.graph_config()
        if not 0.1 <= self.header_timeout <= 3600:  # NaN fails this too
            raise ValueError(f"header-timeout {self.header_timeout} is out of range; allowed: 0.1..3600 seconds")
        if not self.body_timeout >= 1:
            raise ValueError(f"body-timeout {self.body_timeout} must be >= 1 second")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max-connections {self.max_connections} must be >= 1")
        if self.max_client_connections is not None and self.max_client_connections < 1:
            raise ValueError(f"max-client-connections {self.max_client_connections} must be >= 1")
        if not 0.1 <= self.body_deadline <= 3600:  # NaN fails this too
            raise ValueError(f"body-deadline {self.body_deadline} is out of range; allowed: 0.1..3600 seconds")
        if self.min_body_rate < 0:
            raise ValueError(f"min-body-rate {self.min_body_rate} must be >= 0 bytes a second (0: off)")
        from .connections import parse_networks
        parse_networks(self.trusted_proxies)
        if self.api_key_file is not None:  # its keys join the others (a frozen dataclass: set once, here)
            keys = self.api_keys + tuple(k for k in read_key_file(self.api_key_file) if k not in self.api_keys)
            object.__setattr__(self, "api_keys", keys)
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level {self.log_level!r} is unknown; allowed: {', '.join(LOG_LEVELS)}")
        for key in self.api_keys:
            if not isinstance(key, str) or not key.strip() or any(c.isspace() or c == "," for c in key):
                raise ValueError("api-key: each key must be a non-empty string without spaces or commas")
        if self.torch_threads is not None and not 1 <= self.torch_threads <= 1024:
            raise ValueError(f"torch-threads {self.torch_threads} is out of range; allowed: 1..1024")
        for d in self.devices:
            if not re.fullmatch(r"cpu|cuda(:\d+)?", d):
                raise ValueError(f"devices: {d!r} is not understood; use cpu, cuda:N, e.g. cuda:0,cuda:1")
        if self.devices and not 1 <= self.min_ready <= len(self.devices):
            raise ValueError(f"min-ready {self.min_ready} must be in 1..{len(self.devices)} (the number of devices)")
        if self.max_image_bytes < 1 or self.max_image_pixels < 64 * 64:
            raise ValueError("max-image-bytes must be >= 1 and max-image-pixels >= 4096 (a 64x64 image)")
        if self.max_image_pixels > MAX_EDIT_PIXELS:
            raise ValueError(f"max-image-pixels {self.max_image_pixels} is above what the engine takes "
                             f"({MAX_EDIT_PIXELS}, 16 megapixels)")
        if self.lora_dir is not None and not os.path.isdir(self.lora_dir):
            raise ValueError(f"lora-dir {self.lora_dir!r} is not a folder; give a folder of .safetensors adapters")
        LoraConfig(lora_dir=None, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank)  # checks the numbers
        if self.controlnet_dir is not None and not os.path.isdir(self.controlnet_dir):
            raise ValueError(f"controlnet-dir {self.controlnet_dir!r} is not a folder; give a folder of ControlNets "
                             "(diffusers folders or single .safetensors files)")
        if self.ip_adapter_dir is not None and not os.path.isdir(self.ip_adapter_dir):
            raise ValueError(f"ip-adapter-dir {self.ip_adapter_dir!r} is not a folder; give a folder of IP-Adapter "
                             ".safetensors files with their image_encoder folder")
        if not isinstance(self.max_controlnets, int) or self.max_controlnets < 1:
            raise ValueError(f"max-controlnets {self.max_controlnets!r} must be an integer >= 1")
        if self.embeddings_dir is not None and not os.path.isdir(self.embeddings_dir):
            raise ValueError(f"embeddings-dir {self.embeddings_dir!r} is not a folder; give a folder of .safetensors "
                             "textual-inversion embeddings")
        if not 1 <= self.max_prompt_chunks <= MAX_PROMPT_CHUNKS:
            raise ValueError(f"max-prompt-chunks {self.max_prompt_chunks} is out of range; allowed: "
                             f"1..{MAX_PROMPT_CHUNKS} (75 tokens each)")
        if self.clip_skip is not None and not 0 <= self.clip_skip <= MAX_CLIP_SKIP:
            raise ValueError(f"clip-skip {self.clip_skip} is out of range; allowed: 0..{MAX_CLIP_SKIP} (1 = the "
                             "penultimate layer)")
        parse_quantize(self.quantize, "quantize")
        quantize_argument(self.quantize, self.quantize_min_features, "quantize-min-features")
        parse_compile_mode(self.compile_mode, "compile-mode")
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"compile-mode {self.compile_mode!r} needs compile (it chooses how the compile tier "
                             "compiles): add --compile, or compile = true in the TOML")
        if self.prompt_syntax not in PROMPT_SYNTAXES:
            raise ValueError(f"prompt-syntax {self.prompt_syntax!r} is unknown; allowed: {', '.join(PROMPT_SYNTAXES)}")
        self.load_options()  # checks the paths and the prediction type
        if self.model_dir is not None:
            if not os.path.isdir(self.model_dir):
                raise ValueError(f"model-dir {self.model_dir!r} is not a folder; give a folder of checkpoint files "
                                 "and diffusers folders")
        if not 1 <= self.max_models <= 64:
            raise ValueError(f"max-models {self.max_models} is out of range; allowed: 1..64")
        if self.model_memory is not None and not self.model_memory > 0:
            raise ValueError(f"model-memory {self.model_memory} must be > 0 GiB")
        if self.preload and self.model_dir is None:
            raise ValueError("preload needs --model-dir (the models it names live there)")
        if not 1 <= self.image_ttl <= 7 * 86400:  # NaN fails this too
            raise ValueError(f"image-ttl {self.image_ttl} is out of range; allowed: 1..604800 seconds (7 days)")
        if self.image_store_bytes < 1 << 20:
            raise ValueError(f"image-store-bytes {self.image_store_bytes} must be >= 1048576 (1 MiB)")
        if self.image_store is not None and not os.path.isdir(self.image_store):
            raise ValueError(f"image-store {self.image_store!r} is not a folder; create it first")
        if self.public_url is not None and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", self.public_url):
            raise ValueError(f"public-url {self.public_url!r} must be an http(s) URL such as https://images.example.com")
        if not 1 <= self.image_threads <= 64:
            raise ValueError(f"image-threads {self.image_threads} is out of range; allowed: 1..64")
        self._check_jobs()

    def _check_jobs(self) -> None:
        if self.state_dir is not None:
            existing = os.path.abspath(self.state_dir)
            while not os.path.exists(existing):
                existing = os.path.dirname(existing)
            from ..cli_checks import can_create_in  # a file made and removed: os.access says yes to root anywhere

            if not os.path.isdir(existing) or not can_create_in(existing):
                raise ValueError(f"state-dir {self.state_dir!r} is not a writable folder (nor can it be made in one); "
                                 "give a folder on a local disk")
        if not 1 <= self.job_retention <= 10 * 365 * 86400:  # NaN fails this too
            raise ValueError(f"job-retention {self.job_retention:g} s is out of range; allowed: 1 s .. 10 years "
                             "(e.g. 3600, 12h, 7d)")
        if not 1 <= self.max_batch_items <= 10_000_000:
            raise ValueError(f"max-batch-items {self.max_batch_items} is out of range; allowed: 1..10000000")
        if not 1 <= self.max_job_candidates <= 100_000_000:
            raise ValueError(f"max-job-candidates {self.max_job_candidates} is out of range; allowed: 1..100000000")
        if not 1 <= self.max_key_jobs <= 100_000:
            raise ValueError(f"max-key-jobs {self.max_key_jobs} is out of range; allowed: 1..100000")
        if self.max_key_bytes < 1 << 20:
            raise ValueError(f"max-key-bytes {self.max_key_bytes} must be >= 1048576 (1 MiB)")
        if self.batch_inflight is not None and not 1 <= self.batch_inflight <= 4096:
            raise ValueError(f"batch-inflight {self.batch_inflight} is out of range; allowed: 1..4096")
        for host in self.webhook_allow:
            if not re.fullmatch(r"[a-z0-9.\-]+(:[0-9]{1,5})?|\[[0-9a-f:.]+\](:[0-9]{1,5})?", host):
                raise ValueError(f"webhook-allow: {host!r} is not a host name; give names or addresses such as "
                                 "hooks.example.com,10.0.0.5:8080 (lower case)")
        if self.webhook_allow and not (self.webhook_secret or self.api_keys):
            raise ValueError("webhook-allow needs a signing secret: give --webhook-secret (or API keys, from which "
                             "one is derived), so receivers can tell this server's calls from forged ones")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "ServerConfig":
        """Builds a config from raw values (TOML or flags): names with '-' or '_', lists or comma strings."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for raw_key, value in values.items():
            key = raw_key.replace("-", "_")
            key = {"api_key": "api_keys"}.get(key, key)  # `api-key` (flag, TOML) holds one key or several
            if key not in known:
                raise ValueError(f"unknown setting {raw_key!r}; allowed: {', '.join(n.replace('_', '-') for n in known)}")
            kwargs[key] = _parse(key, value)
        return cls(**kwargs)

    def graph_config(self) -> GraphConfig:
        return GraphConfig(batch_buckets=self.batch_buckets, resolutions=self.resolutions, prewarm=self.prewarm)

    def load_options(self) -> LoadOptions:
        return LoadOptions(model_config=self.model_config, prediction_type=self.prediction_type,
                           zero_snr=self.zero_snr, vae=self.vae, vae_upcast=self.vae_upcast)

    def model_set(self) -> ModelSetSpec | None:
        """What an engine process needs to hold the --model-dir set (None without one)."""
        if not self.model_dir:
            return None
        return ModelSetSpec(self.model_dir, self.model, self.max_models,
                            int(self.model_memory * 2**30) if self.model_memory else None, tuple(self.preload))

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `Engine(...)`: live rows never exceed the largest batch bucket."""
        return dict(model=self.model, device=self.device, dtype=self.dtype, mode=self.mode,
                    graphs=self.graph_config(),
                    batching=self.batching, max_wait_ms=self.max_wait_ms, max_queue=self.max_queue,
                    grow_fill=self.grow_fill, grow_hold_ms=self.grow_hold_ms, image_threads=self.image_threads,
                    lora_dir=self.lora_dir, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                    lora_conv=self.lora_conv,
                    fuse_loras=self.fuse_loras, max_prompt_chunks=self.max_prompt_chunks,
                    embeddings_dir=self.embeddings_dir, metadata=self.metadata, load=self.load_options(),
                    preview_decoder=self.preview_decoder, max_step_failures=self.max_step_failures,
                    lora_host_bytes=self.lora_host_bytes, controlnet_dir=self.controlnet_dir,
                    max_controlnets=self.max_controlnets, ip_adapter_dir=self.ip_adapter_dir,
                    compile=(CompileConfig(cache_dir=self.compile_cache, mode=self.compile_mode) if self.compile
                             else False),
                    quantize=quantize_argument(self.quantize, self.quantize_min_features, "quantize-min-features"))

    def resolved_torch_threads(self, cpu_count: int | None = None) -> int:
        """torch's intra-op threads for a CPU engine: the setting, else one core fewer than the machine has (at
        least 1), leaving a core to the event loop, the engine loop and the image threads. With every core in
        torch's pool, its threads spin-wait against those and against other processes (measured in
        BENCHMARKS.md: 8 requests over HTTP on a loaded 2-core machine)."""
        if self.torch_threads is not None:
            return self.torch_threads
        return default_cpu_threads(cpu_count)


def _parse(key: str, value: Any) -> Any:
    if key == "api_keys":
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(k, str) for k in items):
            raise ValueError("api-key must be a string or a list of strings")
        keys = tuple(k.strip() for k in items if k.strip())
        if items and not keys:  # given, but empty ("$KEY" of an unset variable): never start open by mistake
            raise ValueError("api-key is empty; give a key, or leave api-key (and DIFFGRAPH_API_KEY) out for an "
                             "open server")
        return keys
    if key in ("zero_snr", "vae_upcast") and value is None:
        return None
    if key in ("access_log", "protect_metrics", "playground", "compile", "metadata", "zero_snr", "lora_conv",
               "vae_upcast"):
        if not isinstance(value, bool):
            raise ValueError(f"{key.replace('_', '-')} must be true or false, got {value!r}")
        return value
    if key == "batch_buckets":
        return parse_buckets(value)
    if key == "resolutions":
        return parse_resolutions(value)
    if key == "prewarm":
        return value if isinstance(value, bool) else parse_prewarm(value)
    if key == "devices":
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(d, str) for d in items):
            raise ValueError("devices must be a comma-separated list like cuda:0,cuda:1 or cpu,cpu")
        return tuple(d.strip() for d in items if d.strip())
    if key == "preload":
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(d, str) for d in items):
            raise ValueError("preload must be a comma-separated list of model names, e.g. sdxl/juggernaut,dreamshaper")
        return tuple(d.strip() for d in items if d.strip())
    if key == "model_memory" and value is None:
        return None
    if key == "fuse_loras":
        return parse_name_scales(value, "fuse-lora")
    if key == "job_retention":
        return parse_duration(value, "job-retention")
    if key == "trusted_proxies":
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(h, str) for h in items):
            raise ValueError("trusted-proxies must be a comma-separated list of addresses, e.g. 10.0.0.5,10.1.0.0/16")
        return tuple(h.strip() for h in items if h.strip())
    if key == "webhook_allow":
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(h, str) for h in items):
            raise ValueError("webhook-allow must be a comma-separated list of hosts, e.g. hooks.example.com,127.0.0.1")
        return tuple(h.strip().lower() for h in items if h.strip())
    if key in ("torch_threads", "max_loras", "max_connections", "max_client_connections", "clip_skip", "max_pixels",
               "batch_inflight", "quantize_min_features") and value is None:
        return None
    if key in ("port", "max_queue", "max_prompt_bytes", "torch_threads", "image_threads", "min_ready",
               "max_image_bytes", "max_image_pixels", "max_loras", "max_lora_rank", "max_connections",
               "max_client_connections", "min_body_rate",
               "max_prompt_chunks", "clip_skip", "image_store_bytes", "max_models", "max_step_failures", "max_pixels",
               "max_batch_items", "max_job_candidates", "max_key_jobs", "max_key_bytes", "batch_inflight",
               "lora_host_bytes", "max_controlnets", "quantize_min_features"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"{key.replace('_', '-')} must be an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{key.replace('_', '-')} must be an integer, got {value!r}") from None
    if key in ("max_wait_ms", "grow_fill", "grow_hold_ms", "request_timeout", "drain_timeout", "replica_timeout",
               "header_timeout",
               "body_timeout", "body_deadline", "image_ttl", "model_memory"):
        if isinstance(value, bool):
            raise ValueError(f"{key.replace('_', '-')} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key.replace('_', '-')} must be a number, got {value!r}") from None
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key.replace('_', '-')} must be a string, got {value!r}")
    return value


_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: Any, name: str) -> float:
    """Seconds from a number or a string such as "90", "90s", "30m", "12h", "7d"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*", value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"{name} must be a duration: seconds, or a number with s, m, h or d (e.g. 12h, 7d), got "
                         f"{value!r}")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def read_key_file(path: str) -> tuple[str, ...]:
    """The API keys of a file: one a line (or comma-separated); blank lines and # comments are skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(65537)
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ValueError(f"api-key-file {path!r} cannot be read ({why}); give a text file holding one key a line")
    if len(text) > 65536:
        raise ValueError(f"api-key-file {path!r} is larger than 64 KiB; give a file holding one key a line")
    lines = [line.split("#", 1)[0] for line in text.splitlines()]
    keys = tuple(k for k in re.split(r"[\s,]+", " ".join(lines)) if k)
    if not keys:
        raise ValueError(f"api-key-file {path!r} holds no key; write one key a line (or leave the option out for an "
                         "open server)")
    return keys


def load_toml(path: str) -> dict[str, Any]:
    """The settings of a TOML file (top-level keys, or the keys of its [serve] table)."""
    if tomllib is None:
        raise ValueError("reading a TOML config on Python 3.10 needs the 'tomli' package: pip install tomli")
    if not os.path.isfile(path):
        raise ValueError(f"config file {path!r} does not exist")
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path!r} is not valid TOML: {e}") from None
    table = data.get("serve", data)
    if not isinstance(table, dict):
        raise ValueError(f"config file {path!r}: 'serve' must be a table ([serve]) of settings, got {table!r}")
    return dict(table)


def load_config(path: str | None = None, overrides: Mapping[str, Any] | None = None) -> ServerConfig:
    """Defaults, then the file's settings, then `overrides` (flags given on the command line; None = not given)."""
    values: dict[str, Any] = load_toml(path) if path else {}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    given = any(k.replace("-", "_") in ("api_key", "api_keys", "api_key_file") for k in values)
    if not given and os.environ.get("DIFFGRAPH_API_KEY"):
        values["api_keys"] = os.environ["DIFFGRAPH_API_KEY"]
    return ServerConfig.from_mapping(values)
