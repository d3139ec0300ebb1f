"""`ServerConfig`: every setting of `diffgraph serve`, from defaults, a TOML file and flags (in that order).

A TOML file holds the same settings as the flags, named like them (`batch-buckets` or `batch_buckets`):

    model = "digits"
    port = 8000
    batch-buckets = [1, 2, 4, 8]        # or "1,2,4,8"
    resolutions = ["512x512", "768x512"] # WxH
    prewarm = "all"                      # "none" | "512x512@1/2/4,..."
    request-timeout = 120

Each setting is declared once, by its field (settings.py: help, argument group, how a value is read, the `Engine`
keyword it feeds); `diffgraph serve`'s flags, these TOML keys and `ServerConfig.engine_kwargs()`, what the app hands
to `Engine(...)`, come from the declarations. examples/serve.toml lists every setting; nothing else reads the file. API keys also come from a file of keys (`api-key-file`, one a line, added to any given
as `api-key`), or from the environment variable DIFFGRAPH_API_KEY (comma-separated) when neither the file nor a flag
gives one: both keep keys out of `ps` and shell history, which a key on the command line is not. Keys are never
printed (the field is left out of the repr).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..config import (DEFAULT_BUCKETS, DEFAULT_REQUEST_LORAS, DTYPE_NAMES, CompileConfig, GraphConfig, LoadOptions,
                      LoraConfig,
                      default_cpu_threads, parse_buckets, parse_compile_mode, parse_name_scales, parse_prewarm,
                      parse_quantize,
                      parse_reference_slots, parse_resolutions, quantize_argument)
from ..capability_settings import builtin_settings, toml_settings
from ..cli_flags import CHECKPOINT_SETTINGS, COMPILE_MODE, QUANTIZE, QUANTIZE_MIN_FEATURES
from ..engine.remote_models import ModelSetSpec
from ..engine.scheduler import SchedulerConfig
from ..prompt_styles import read_styles
from ..request import MAX_CLIP_SKIP, MAX_EDIT_PIXELS, MAX_PROMPT_CHUNKS, PROMPT_SYNTAXES
from ..settings import comma_list, declared, read, setting

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


def _api_keys(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(k, str) for k in items):
        raise ValueError("api-key must be a string or a list of strings")
    keys = tuple(k.strip() for k in items if k.strip())
    if items and not keys:  # given, but empty ("$KEY" of an unset variable): never start open by mistake
        raise ValueError("api-key is empty; give a key, or leave api-key (and DIFFGRAPH_API_KEY) out for an open "
                         "server")
    return keys


def _prewarm(value: Any) -> Any:
    return value if isinstance(value, bool) else parse_prewarm(value)


def _capability_settings(value: Any) -> tuple:
    """{capability: {field: value}} (a TOML table, or JSON) -> ((capability, ((field, value), ...)), ...)."""
    if isinstance(value, tuple):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"capability-settings is not JSON: {e}") from None
    if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
        raise ValueError("capability-settings must be a table of tables: {capability: {field: value}}")
    return tuple((str(name), tuple((str(k), v) for k, v in fields.items())) for name, fields in value.items())


def _fuse_loras(value: Any) -> tuple[tuple[str, float], ...]:
    return parse_name_scales(value, "fuse-lora")


def _check_upscaler_dir(path: str) -> None:
    """--upscaler-dir: a folder, and spandrel installed to read it."""
    from .. import upscaler_models

    if not os.path.isdir(path):
        raise ValueError(f"upscaler-dir {path!r} is not a folder; give a folder of .safetensors upscaler models")
    if not upscaler_models.spandrel_installed():
        raise ValueError("upscaler-dir needs the spandrel package, which reads upscaler models: pip install "
                         "\"diffgraph[upscale]\"")


def _job_retention(value: Any) -> float:
    return parse_duration(value, "job-retention")


_devices = comma_list("devices must be a comma-separated list like cuda:0,cuda:1 or cpu,cpu")
_preload = comma_list("preload must be a comma-separated list of model names, e.g. sdxl/juggernaut,dreamshaper")
_trusted_proxies = comma_list("trusted-proxies must be a comma-separated list of addresses, e.g. 10.0.0.5,10.1.0.0/16")
_webhook_allow = comma_list("webhook-allow must be a comma-separated list of hosts, e.g. hooks.example.com,127.0.0.1",
                            lower=True)


@dataclass(frozen=True)
class ServerConfig:
    """Every setting, each declared once by its field: its type, default and `setting(help, group, ...)` (settings.py),
    from which `diffgraph serve`'s flags, the TOML keys and `engine_kwargs()` come."""

    model: str = field(default_factory=default_model, metadata=setting(
        "preset, local diffusers folder or checkpoint file (.safetensors: SD1.x, SD2.x, SDXL) (default: {default}; "
        "`diffgraph models` lists presets)", "model", engine="model"))
    host: str = field(default="127.0.0.1", metadata=setting("address to listen on (default: {default})", "server"))
    port: int = field(default=8000, metadata=setting("port to listen on (default: {default})", "server"))
    device: str | None = field(default=None, metadata=setting(
        "cuda or cpu (default: cuda when available)", "model", engine="device"))
    dtype: str | None = field(default=None, metadata=setting(
        "fp16, bf16 or fp32 (default: fp16 on cuda, fp32 on cpu)", "model", engine="dtype"))
    mode: str | None = field(default=None, metadata=setting(
        "graph: replay captured CUDA graphs; eager: plain PyTorch (default: graph on cuda, eager on cpu)",
        "graphs", engine="mode", choices=("graph", "eager")))
    batching: str = field(default="step", metadata=setting(
        "step: requests join and leave between denoising steps; request: a batch runs to the end together; off: one "
        "request at a time (default: step)", "graphs", engine="batching", choices=("step", "request", "off")))
    batch_buckets: tuple[int, ...] = field(default=DEFAULT_BUCKETS, metadata=setting(
        "batch sizes that get a CUDA graph; the largest bounds live rows per resolution and n (default: "
        "1,2,4,8,16,32: denoiser rows, a guided image costs two)",
        "graphs", engine="graphs", parse=parse_buckets, metavar="LIST"))
    resolutions: tuple[tuple[int, int], ...] = field(default=(), metadata=setting(
        "resolutions that get CUDA graphs, e.g. 512x512,768x512; other sizes run eagerly (default: the model's native "
        "size)", "graphs", engine="graphs", parse=parse_resolutions, metavar="WxH,..."))
    reference_slots: tuple[int, ...] = field(default=(), metadata=setting(
        "reference-token slots whose step graphs are made with each graphed resolution's, on models that read "
        "reference images (FLUX.2, Qwen-Image-Edit), e.g. 4096,8192 for one or two 1024x1024 references; prewarmed "
        "with them, compiled at start in the compile tier; other slots get graphs on first use (default: none)",
        "graphs", engine="graphs", parse=parse_reference_slots, metavar="LIST"))
    prewarm: bool | tuple[tuple[int, int, int], ...] = field(default=True, metadata=setting(
        "graphs captured before /ready answers 200: all, none, or WxH[@b1/b2...],... (others are captured on first "
        "use; default: all)", "graphs", engine="graphs", parse=_prewarm, metavar="SPEC"))
    max_queue: int = field(default=256, metadata=setting(
        "waiting requests before new ones get 429 (default: {default})", "limits", engine="max_queue", metavar="N"))
    max_wait_ms: float = field(default=0.0, metadata=setting(
        "request batching: how long an empty batch waits for company (default: 0)",
        "graphs", engine="max_wait_ms", metavar="MS"))
    grow_fill: float = field(default=0.85, metadata=setting(
        "step batching with graphs: a resolution group grows into a larger batch bucket only when the rows fill at "
        "least this fraction of it; 0 turns this off (default: {default})", "graphs", engine="grow_fill", metavar="F"))
    grow_hold_ms: float = field(default=2000.0, metadata=setting(
        "...or once the oldest waiting request has waited this long (default: {default:g})",
        "graphs", engine="grow_hold_ms", metavar="MS"))
    request_timeout: float = field(default=600.0, metadata=setting(
        "seconds a request may take, queueing included, before it is aborted with 504 (default: {default:g})",
        "limits", metavar="S"))
    max_prompt_bytes: int = field(default=4096, metadata=setting(
        "longest prompt or negative prompt in UTF-8 bytes; longer ones get 400 (default: {default})",
        "limits", metavar="N"))
    drain_timeout: float = field(default=30.0, metadata=setting(
        "after SIGTERM, seconds in-flight requests may take before they are aborted (default: {default:g})",
        "server", metavar="S"))
    header_timeout: float = field(default=5.0, metadata=setting(
        "seconds a connection may sit without a request (idle, or still sending its request head) before it is closed "
        "(default: {default:g})", "limits", metavar="S"))
    body_timeout: float = field(default=60.0, metadata=setting(
        "seconds a request body may take to arrive before the request gets 408 (default: {default:g})",
        "limits", metavar="S"))
    max_connections: int | None = field(default=None, metadata=setting(
        "open connections at most: a newcomer closes the connection idle longest, and gets 503 when all are busy "
        "(default: 1000, fewer under a low `ulimit -n`)", "limits", metavar="N"))
    max_client_connections: int | None = field(default=None, metadata=setting(
        "open connections from one client address at most, so that one client cannot take every slot: its newcomer "
        "closes its own connection idle longest, else gets 503 (default: half of --max-connections)",
        "limits", metavar="N"))
    trusted_proxies: tuple[str, ...] = field(default=(), metadata=setting(
        "comma-separated proxy addresses or networks (10.0.0.5,10.1.0.0/16) whose X-Forwarded-For names the client "
        "that --max-client-connections counts; never read from others (default: none)",
        "limits", parse=_trusted_proxies, metavar="ADDRS"))
    body_deadline: float = field(default=10.0, metadata=setting(
        "seconds a request body may take on its connection before the connection is closed, one more for every "
        "--min-body-rate bytes that arrived: a trickled body gives its slot back early (default: {default:g})",
        "limits", metavar="S"))
    min_body_rate: int = field(default=4096, metadata=setting(
        "bytes a second that keep a body's --body-deadline moving; 0: no such deadline, only --body-timeout (default: "
        "{default})", "limits", metavar="BYTES"))
    log_level: str = field(default="info", metadata=setting("log level (default: info)", "server", choices=LOG_LEVELS))
    access_log: bool = field(default=True, metadata=setting(
        "log one line per request; health, ready, status and metrics polls are never logged (default: on)", "server"))
    api_keys: tuple[str, ...] = field(default=(), repr=False, metadata=setting(
        "require `Authorization: Bearer KEY` on every /v1/* route (repeat for several keys; default: the "
        "comma-separated keys in $DIFFGRAPH_API_KEY, else open); a key given here shows in `ps`: prefer "
        "DIFFGRAPH_API_KEY or --api-key-file",
        "limits", parse=_api_keys, flags=("--api-key",), metavar="KEY", action="append"))
    api_key_file: str | None = field(default=None, repr=False, metadata=setting(
        "require the keys in FILE (one a line; # comments), as --api-key does, without putting them on the command "
        "line", "limits", metavar="FILE"))
    protect_metrics: bool = field(default=False, metadata=setting(
        "also require a key for /metrics and /status (default: off; /health and /ready stay open)", "limits"))
    playground: bool = field(default=True, metadata=setting(
        "serve the playground page at / (default: on; --no-playground turns it off)", "server"))
    torch_threads: int | None = field(default=None, metadata=setting(
        "torch intra-op threads of a CPU engine (default: the cores minus one, at least 1)", "server", metavar="N"))
    image_threads: int = field(default=2, metadata=setting(
        "threads that encode finished images (default: {default})", "server", engine="image_threads", metavar="N"))
    devices: tuple[str, ...] = field(default=(), metadata=setting(
        "one engine replica process per device, e.g. cuda:0,cuda:1 or cpu,cpu; requests go to the replica with the "
        "least outstanding work (default: one engine in this process)", "replicas", parse=_devices, metavar="LIST"))
    min_ready: int = field(default=1, metadata=setting(
        "with several replicas: /ready answers 200 while at least K are ready (default: 1)", "replicas", metavar="K"))
    max_image_bytes: int = field(default=20 * 1024 * 1024, metadata=setting(
        "/v1/images/edits: the most bytes of an uploaded image or mask (default: 20 MiB)", "limits", metavar="N"))
    max_image_pixels: int = field(default=16 * 1024 * 1024, metadata=setting(
        "/v1/images/edits: the most pixels of an image, read from its header before decoding (default and most: 16 "
        "megapixels)", "limits", metavar="N"))
    lora_dir: str | None = field(default=None, metadata=setting(
        "a folder of .safetensors LoRA adapters; requests name them by their path under DIR without the suffix "
        "(styles/ink); files added later are found without a restart",
        "capabilities", engine="lora_dir", metavar="DIR"))
    max_loras: int | None = field(default=None, metadata=setting(
        "device slots for adapters in flight (default: 8 with --lora-dir; at least 4); more distinct adapters in "
        "flight make requests wait", "capabilities", engine="max_loras", metavar="N"))
    max_request_loras: int = field(default=DEFAULT_REQUEST_LORAS, metadata=setting(
        "adapters one request may stack, 1-16 (default: {default}); each request pays a side path as deep as its "
        "stack (rounded up to 1, 4 or this), and one over it is a 400 naming loras",
        "capabilities", engine="max_request_loras", metavar="N"))
    max_lora_rank: int = field(default=64, metadata=setting(
        "the largest adapter rank the slots take (default: 64); a smaller one makes steps cheaper",
        "capabilities", engine="max_lora_rank", metavar="R"))
    lora_conv: bool = field(default=False, metadata=setting(
        "side paths on the convolutions too, for adapters that touch them (LoCon, LCM-LoRA, TCD, Hyper-SD); costs "
        "slot memory (SD1.5 rank 64: 77 MiB a slot) and step time with adapters",
        "capabilities", engine="lora_conv", action="store_true"))
    fuse_loras: tuple[tuple[str, float], ...] = field(default=(), metadata=setting(
        "merge an adapter (a name in --lora-dir, or a .safetensors path) into the weights at start-up, at no cost per "
        "step; repeatable",
        "capabilities", engine="fuse_loras", parse=_fuse_loras, flags=("--fuse-lora",), metavar="NAME[:SCALE]",
        action="append"))
    controlnet_dir: str | None = field(default=None, metadata=setting(
        "a folder of ControlNets (diffusers folders, or single .safetensors files as AUTOMATIC1111 and ComfyUI keep "
        "them); requests name them by their path under DIR (controls: [{model, image, scale, start, end}]); ones "
        "added later are found", "capabilities", engine="controlnet_dir", metavar="DIR"))
    max_controlnets: int = field(default=2, metadata=setting(
        "ControlNets resident on the device at once (default: 2); more distinct ones in flight make requests wait",
        "capabilities", engine="max_controlnets", metavar="N"))
    ip_adapter_dir: str | None = field(default=None, metadata=setting(
        "a folder of IP-Adapters (h94's .safetensors layout, their CLIP vision model in an image_encoder folder "
        "beside or above them); requests name them by their path without the suffix (image_prompts: {model, images, "
        "scale})", "capabilities", engine="ip_adapter_dir", metavar="DIR"))
    upscaler_dir: str | None = field(default=None, metadata=setting(
        "a folder of ESRGAN-family upscaler models (.safetensors, read by spandrel; pickles: `diffgraph convert` "
        "them) that the AUTOMATIC1111 routes name by file name without the suffix (extras, hr_upscaler, SD upscale; "
        "GET /sdapi/v1/upscalers); files added later are found", "capabilities", metavar="DIR"))
    compile: bool = field(default=False, metadata=setting(
        "the compile tier: the whole step, the text encoder(s) and the VAE compiled by Inductor, then captured in the "
        "graphs as usual (slow start on an empty cache; see --compile-cache)",
        "graphs", engine="compile", action="store_true"))
    compile_mode: str = field(default="default", metadata={"setting": COMPILE_MODE})
    quantize: str = field(default="none", metadata={"setting": QUANTIZE})
    quantize_min_features: int | None = field(default=None, metadata={"setting": QUANTIZE_MIN_FEATURES})
    embeddings_dir: str | None = field(default=None, metadata=setting(
        "a folder of .safetensors textual-inversion embeddings; a1111-syntax prompts use them by name (easynegative, "
        "or embedding:easynegative); files added later are found without a restart",
        "capabilities", engine="embeddings_dir", metavar="DIR"))
    max_prompt_chunks: int = field(default=3, metadata=setting(
        "a1111-syntax prompts: the 75-token chunks one prompt may use, 1-4 (default: 3, 225 tokens)",
        "capabilities", engine="max_prompt_chunks", metavar="N"))
    clip_skip: int | None = field(default=None, metadata=setting(
        "the clip skip of requests that give none, in diffusers' numbering (1 = the penultimate layer, "
        "AUTOMATIC1111's 'CLIP skip 2'; default: none)", "capabilities", metavar="N"))
    prompt_syntax: str = field(default="plain", metadata=setting(
        "how the images routes read prompts that do not say (default: plain, diffusers' reading)",
        "capabilities", choices=("plain", "a1111")))
    styles: str | None = field(default=None, metadata=setting(
        "AUTOMATIC1111's styles.csv (a header row name,prompt,negative_prompt; at most 1 MiB, read at start): the "
        "AUTOMATIC1111 routes apply the styles a request names in `styles`, in order (a style's {prompt} takes the "
        "request's prompt, else its text is appended after a comma), and GET /sdapi/v1/prompt-styles lists them",
        "capabilities", metavar="FILE"))
    compile_cache: str | None = field(default=None, metadata=setting(
        "with --compile: where compiled artifacts are kept (default: ~/.cache/diffgraph/compile); `diffgraph compile` "
        "fills one ahead of time", "graphs", engine="compile", metavar="DIR"))
    metadata: bool = field(default=True, metadata=setting(
        "write the settings into every image (AUTOMATIC1111's PNG `parameters` text and the request as JSON; EXIF in "
        "JPEG/WebP) (default: on; --no-metadata turns it off)", "capabilities", engine="metadata"))
    preview_decoder: str | None = field(default=None, metadata=setting(
        "live previews at full resolution from this tiny decoder: TAESD (SD1.x/SD2.x) or TAESDXL, a diffusers "
        "AutoencoderTiny folder (default: AUTOMATIC1111's cheap latent-to-RGB approximation)",
        "capabilities", engine="preview_decoder", metavar="DIR"))
    max_step_failures: int = field(default=3, metadata=setting(
        "consecutive failed denoising steps that mark the engine failed: /ready answers 503 with the reason, routers "
        "and Ray route around it, a replica process restarts; an error that leaves the GPU unusable trips it at once "
        "(default: {default})", "replicas", engine="max_step_failures", metavar="K"))
    replica_timeout: float = field(default=30.0, metadata=setting(
        "--devices: a replica process that sends no heartbeat for S seconds (stopped, wedged in a driver call) is "
        "routed around and its requests answered 503; killed and restarted after 4 S (default: {default:g})",
        "replicas", metavar="S"))
    lora_host_bytes: int = field(default=2 * 2**30, metadata=setting(
        "bytes of prepared adapter copies kept on the host between requests (queued requests hold names and file "
        "versions; a copy dropped is read again at admission; default: 2 GiB)",
        "capabilities", engine="lora_host_bytes", metavar="N"))
    max_pixels: int | None = field(default=None, metadata=setting(
        "the most pixels (width x height) an image may have, else a 400 naming size (default: on the CPU, measured at "
        "start-up so that a 20-step image takes at most a quarter of the request timeout; on a GPU no limit beyond "
        "2048x2048; 0: no limit)", "limits", metavar="N"))
    image_ttl: float = field(default=3600.0, metadata=setting(
        "response_format url: seconds a stored image is served at /v1/images/files/ (default: 3600)",
        "server", metavar="S"))
    image_store: str | None = field(default=None, metadata=setting(
        "response_format url: store images in this folder (every ingress replica mounting it serves them) instead of "
        "in memory", "server", metavar="DIR"))
    image_store_bytes: int = field(default=256 * 1024 * 1024, metadata=setting(
        "response_format url: the in-memory store's size; the oldest images go first (default: 256 MiB)",
        "server", metavar="N"))
    public_url: str | None = field(default=None, metadata=setting(
        "response_format url: the base of image URLs, e.g. https://images.example.com (default: the request's own "
        "scheme and host)", "server", metavar="URL"))
    model_dir: str | None = field(default=None, metadata=setting(
        "also serve every checkpoint file and diffusers folder under DIR, by its relative name (requests pick one "
        "with `model`; `diffgraph models --dir DIR` lists them); --model is the default", "model", metavar="DIR"))
    max_models: int = field(default=2, metadata=setting(
        "with --model-dir: models resident at once, the least recently used going first (default: 2)",
        "model", metavar="N"))
    model_memory: float | None = field(default=None, metadata=setting(
        "with --model-dir: GiB of weights and graph pools the resident models may hold (default: no bound but "
        "--max-models)", "model", metavar="GIB"))
    preload: tuple[str, ...] = field(default=(), metadata=setting(
        "with --model-dir: models loaded at start beside the default, comma-separated",
        "model", parse=_preload, metavar="NAMES"))
    vae: str | None = field(default=None, metadata={"setting": CHECKPOINT_SETTINGS["vae"]})
    vae_upcast: bool | None = field(default=None, metadata={"setting": CHECKPOINT_SETTINGS["vae_upcast"]})
    text_encoder: str | None = field(default=None, metadata={"setting": CHECKPOINT_SETTINGS["text_encoder"]})
    tokenizer: str | None = field(default=None, metadata={"setting": CHECKPOINT_SETTINGS["tokenizer"]})
    model_config: str | None = field(default=None, metadata={"setting": CHECKPOINT_SETTINGS["model_config"]})
    prediction_type: str | None = field(default=None, metadata={"setting": CHECKPOINT_SETTINGS["prediction_type"]})
    zero_snr: bool | None = field(default=None, metadata={"setting": CHECKPOINT_SETTINGS["zero_snr"]})
    state_dir: str | None = field(default=None, metadata=setting(
        "batch jobs (/v1/jobs, `diffgraph batch --url`): keep jobs in DIR/jobs.sqlite3 and their images in "
        "DIR/images, so they survive restarts; servers sharing DIR on one host share the jobs (default: no jobs)",
        "jobs", metavar="DIR"))
    job_retention: float = field(default=7 * 86400.0, metadata=setting(
        "how long a finished job and its images are kept: seconds, or 90m, 12h, 7d (default: 7d)",
        "jobs", parse=_job_retention, metavar="TIME"))
    max_batch_items: int = field(default=100_000, metadata=setting(
        "the most items one job may hold (default: 100000)", "jobs", metavar="N"))
    max_job_candidates: int = field(default=100_000, metadata=setting(
        "the most candidate images one job may hold, all its items' together (a grid's is counted before it is "
        "expanded; default: 100000)", "jobs", metavar="N"))
    max_key_jobs: int = field(default=16, metadata=setting(
        "unfinished jobs one API key may have at once; more are refused with 429 until one ends (default: 16)",
        "jobs", metavar="N"))
    max_key_bytes: int = field(default=256 * 2**30, metadata=setting(
        "bytes one API key's jobs may keep (their images and rows); past it new jobs are refused with 507 and running "
        "jobs pause (status paused, with the reason) until jobs are deleted or expire (default: 274877906944, 256 GiB)",
        "jobs", metavar="BYTES"))
    batch_inflight: int | None = field(default=None, metadata=setting(
        "job requests in the engine at once, shared fairly by the API keys, then by their jobs (default: twice the "
        "largest batch bucket's rows per replica)", "jobs", metavar="N"))
    webhook_allow: tuple[str, ...] = field(default=(), metadata=setting(
        "hosts job webhooks may call, comma-separated (host or host:port); without it a job naming a webhook is "
        "refused", "jobs", parse=_webhook_allow, metavar="HOSTS"))
    webhook_secret: str | None = field(default=None, repr=False, metadata=setting(
        "the HMAC-SHA256 key of the webhooks' X-Diffgraph-Signature header (default: derived from the API keys)",
        "jobs", metavar="SECRET"))
    # ((capability, ((field, value), ...)), ...): each capability's own flags (capability_settings.py: `--step-cache`)
    # set it too, over this
    capability_settings: tuple = field(default=(), metadata=setting(
        "the registered capabilities' settings, as {capability: {field: value}} (a TOML table; JSON here); their own "
        "flags, such as --step-cache, set them too", "capabilities", engine="capability_settings",
        parse=_capability_settings, metavar="JSON"))

    def __post_init__(self) -> None:
        self._check_engine()
        self._check_http()
        self._check_devices()
        self._check_capabilities()
        self._check_compile_and_prompts()
        self._check_models()
        self._check_image_output()
        self._check_jobs()

    def _check_engine(self) -> None:
        """The model, the port, the request limits and timeouts, the device, dtype and mode, and the scheduler's and
        graphs' settings (checked by their own configs before anything loads)."""
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

    def _check_http(self) -> None:
        """The HTTP edge: header and body timeouts, connection limits, trusted proxies, the API keys (those of
        --api-key-file joined to the others) and the log level."""
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
        parse_networks(self.trusted_proxies)
        if self.api_key_file is not None:  # its keys join the others (a frozen dataclass: set once, here)
            keys = self.api_keys + tuple(k for k in read_key_file(self.api_key_file) if k not in self.api_keys)
            object.__setattr__(self, "api_keys", keys)
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level {self.log_level!r} is unknown; allowed: {', '.join(LOG_LEVELS)}")
        for key in self.api_keys:
            if not isinstance(key, str) or not key.strip() or any(c.isspace() or c == "," for c in key):
                raise ValueError("api-key: each key must be a non-empty string without spaces or commas")

    def _check_devices(self) -> None:
        """Torch threads, the replicas' devices and how many must be ready."""
        if self.torch_threads is not None and not 1 <= self.torch_threads <= 1024:
            raise ValueError(f"torch-threads {self.torch_threads} is out of range; allowed: 1..1024")
        for d in self.devices:
            if not re.fullmatch(r"cpu|cuda(:\d+)?", d):
                raise ValueError(f"devices: {d!r} is not understood; use cpu, cuda:N, e.g. cuda:0,cuda:1")
        if self.devices and not 1 <= self.min_ready <= len(self.devices):
            raise ValueError(f"min-ready {self.min_ready} must be in 1..{len(self.devices)} (the number of devices)")

    def _check_capabilities(self) -> None:
        """Input image limits, the adapter, ControlNet, IP-Adapter and embedding folders, prompt chunks, clip skip."""
        if self.max_image_bytes < 1 or self.max_image_pixels < 64 * 64:
            raise ValueError("max-image-bytes must be >= 1 and max-image-pixels >= 4096 (a 64x64 image)")
        if self.max_image_pixels > MAX_EDIT_PIXELS:
            raise ValueError(f"max-image-pixels {self.max_image_pixels} is above what the engine takes "
                             f"({MAX_EDIT_PIXELS}, 16 megapixels)")
        if self.lora_dir is not None and not os.path.isdir(self.lora_dir):
            raise ValueError(f"lora-dir {self.lora_dir!r} is not a folder; give a folder of .safetensors adapters")
        LoraConfig(lora_dir=None, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                   max_per_request=self.max_request_loras)  # checks the numbers
        if self.controlnet_dir is not None and not os.path.isdir(self.controlnet_dir):
            raise ValueError(f"controlnet-dir {self.controlnet_dir!r} is not a folder; give a folder of ControlNets "
                             "(diffusers folders or single .safetensors files)")
        if self.ip_adapter_dir is not None and not os.path.isdir(self.ip_adapter_dir):
            raise ValueError(f"ip-adapter-dir {self.ip_adapter_dir!r} is not a folder; give a folder of IP-Adapter "
                             ".safetensors files with their image_encoder folder")
        if self.upscaler_dir is not None:
            _check_upscaler_dir(self.upscaler_dir)
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

    def _check_compile_and_prompts(self) -> None:
        """The quantize and compile-mode settings, then how prompts are read (their syntax, the styles file)."""
        parse_quantize(self.quantize, "quantize")
        quantize_argument(self.quantize, self.quantize_min_features, "quantize-min-features")
        parse_compile_mode(self.compile_mode, "compile-mode")
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"compile-mode {self.compile_mode!r} needs compile (it chooses how the compile tier "
                             "compiles): add --compile, or compile = true in the TOML")
        if self.prompt_syntax not in PROMPT_SYNTAXES:
            raise ValueError(f"prompt-syntax {self.prompt_syntax!r} is unknown; allowed: {', '.join(PROMPT_SYNTAXES)}")
        if self.styles is not None:
            read_styles(self.styles)  # a malformed file is refused at start, naming its line

    def _check_models(self) -> None:
        """The checkpoint's parts and the model set: --model-dir, --max-models, --model-memory, --preload."""
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

    def _check_image_output(self) -> None:
        """Where response images are kept and served from, and the image encoding threads."""
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
        """Builds a config from raw values (TOML or flags): names with '-' or '_' (or a setting's flag name, such as
        `api-key`), lists or comma strings; each value read as its declaration says (settings.read)."""
        hints = typing.get_type_hints(cls)
        known = {f.name: s for f, s in declared(cls)}
        aliases = {flag[2:].replace("-", "_"): name for name, s in known.items() for flag in s.flags}
        kwargs: dict[str, Any] = {}
        for raw_key, value in values.items():
            key = raw_key.replace("-", "_")
            key = aliases.get(key, key)
            if key not in known:
                allowed = ", ".join(n.replace("_", "-") for n in known)
                raise ValueError(f"unknown setting {raw_key!r}; allowed: {allowed}")
            kwargs[key] = read(key, hints[key], known[key], value)
        return cls(**kwargs)

    def capability_options(self) -> dict[str, dict[str, Any]] | None:
        """`Engine(capability_settings=...)`: {capability: {field: value}}, None when none is given."""
        return {name: dict(fields) for name, fields in self.capability_settings} or None

    def graph_config(self) -> GraphConfig:
        return GraphConfig(batch_buckets=self.batch_buckets, resolutions=self.resolutions, prewarm=self.prewarm,
                           reference_slots=self.reference_slots)

    def load_options(self) -> LoadOptions:
        return LoadOptions(model_config=self.model_config, prediction_type=self.prediction_type,
                           zero_snr=self.zero_snr, vae=self.vae, vae_upcast=self.vae_upcast,
                           text_encoder=self.text_encoder, tokenizer=self.tokenizer)

    def model_set(self) -> ModelSetSpec | None:
        """What an engine process needs to hold the --model-dir set (None without one)."""
        if not self.model_dir:
            return None
        return ModelSetSpec(self.model_dir, self.model, self.max_models,
                            int(self.model_memory * 2**30) if self.model_memory else None, tuple(self.preload))

    def compile_option(self) -> CompileConfig | bool:
        return CompileConfig(cache_dir=self.compile_cache, mode=self.compile_mode) if self.compile else False

    def quantize_option(self) -> Any:
        return quantize_argument(self.quantize, self.quantize_min_features, "quantize-min-features")

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `Engine(...)`: each setting's `engine` keyword, its value, or for a keyword that
        several settings feed, the value ENGINE_PARTS builds from them. Live rows never exceed the largest bucket."""
        out: dict[str, Any] = {}
        for f, s in declared(type(self)):
            if s.engine is not None:
                build = ENGINE_PARTS.get(s.engine)
                out[s.engine] = build(self) if build is not None else getattr(self, f.name)
        return out

    def resolved_torch_threads(self, cpu_count: int | None = None) -> int:
        """torch's intra-op threads for a CPU engine: the setting, else one core fewer than the machine has (at
        least 1), leaving a core to the event loop, the engine loop and the image threads. With every core in
        torch's pool, its threads spin-wait against those and against other processes (BENCHMARKS.md: CPU server
        under load)."""
        if self.torch_threads is not None:
            return self.torch_threads
        return default_cpu_threads(cpu_count)


# the Engine keywords that several settings feed, each built by one method
ENGINE_PARTS = {"graphs": ServerConfig.graph_config, "load": ServerConfig.load_options,
                "compile": ServerConfig.compile_option, "quantize": ServerConfig.quantize_option,
                "capability_settings": ServerConfig.capability_options}


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
    # the built-in capabilities' settings are keys of the file too, named as their flags (`step-cache = "auto"`)
    values, capabilities = toml_settings(load_toml(path) if path else {}, builtin_settings())
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    given = any(k.replace("-", "_") in ("api_key", "api_keys", "api_key_file") for k in values)
    if not given and os.environ.get("DIFFGRAPH_API_KEY"):
        values["api_keys"] = os.environ["DIFFGRAPH_API_KEY"]
    return with_capability_settings(ServerConfig.from_mapping(values), capabilities)


def with_capability_settings(config: ServerConfig, given: Mapping[str, Mapping[str, Any]]) -> ServerConfig:
    """`config` with `given` ({capability: {field: value}}) over its `capability_settings`, field by field."""
    if not given:
        return config
    merged = {name: dict(fields) for name, fields in config.capability_settings}
    for name, fields in given.items():
        merged.setdefault(name, {}).update(fields)
    return dataclasses.replace(config, capability_settings=tuple(
        (name, tuple(fields.items())) for name, fields in merged.items()))


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(items: tuple[str, ...], name: str = "trusted-proxies") -> tuple[Network, ...]:
    """Addresses or networks (10.0.0.5, 10.0.0.0/8, ::1). Raises ValueError naming the one not understood."""
    networks = []
    for item in items:
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{name}: {item!r} is not an address or network; give addresses such as "
                             "127.0.0.1,10.0.0.0/8") from None
    return tuple(networks)
