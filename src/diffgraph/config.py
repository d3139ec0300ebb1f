"""Graph configuration: `GraphConfig` (which CUDA graphs exist: batch buckets, resolutions, prewarm
list, verification) and the parsers for its command-line / TOML forms. The scheduler's and the server's
configurations live beside the code that reads them (engine/scheduler.py, server/config.py).
"""

from __future__ import annotations

import math

import os
from dataclasses import dataclass
from typing import Any

from .request import MAX_LORAS, MAX_SIZE, MIN_SIZE

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)  # denoiser rows: a classifier-free guided image costs two
DTYPE_NAMES = ("fp32", "float32", "fp16", "float16", "bf16", "bfloat16")  # models/loader.py maps them to torch
MAX_BUCKET = 256  # rows of the largest batch bucket (the model runner's buffers are sized for it)


def default_cpu_threads(cpu_count: int | None = None) -> int:
    """torch intra-op threads for CPU work in diffgraph's own processes (the server, the CLI): one core fewer than
    the machine has, at least 1. The small models' CPU steps are launch-bound: every intra-op thread beyond that
    adds synchronisation, and spin-waits against the engine loop, the event loop and other processes (BENCHMARKS.md:
    CPU server under load). Library users keep torch's own setting."""
    return max(1, (cpu_count or os.cpu_count() or 1) - 1)


def smallest_bucket(buckets: tuple[int, ...], n: int) -> int | None:
    """The smallest of the (increasing) buckets that holds n rows, or None when n exceeds the largest."""
    return next((b for b in buckets if b >= n), None)


def bucket_table(buckets: tuple[int, ...]) -> tuple[int | None, ...]:
    """`smallest_bucket` for every n from 0 to the largest bucket, as a tuple indexed by n (what a step's dispatch
    reads: an index, not a call; n past its end fits no bucket)."""
    return tuple(smallest_bucket(buckets, n) for n in range(max(buckets, default=0) + 1))


def _items(name: str, value: object, example: str) -> list:
    """A comma string or a list/tuple, as a list of items; anything else is refused."""
    if isinstance(value, str):
        return [v for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{name} {value!r} must be a comma-separated string or a list, e.g. {example}")


def parse_buckets(text: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4): positive, unique, sorted, at most MAX_BUCKET."""
    values = set()
    for v in _items("batch buckets", text, "1,2,4,8,16"):
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise ValueError(f"batch buckets {text!r} must be positive integers, e.g. 1,2,4,8,16; got {v!r}")
        try:
            values.add(int(v))
        except ValueError:
            raise ValueError(f"batch buckets {text!r} must be comma-separated positive integers, "
                             "e.g. 1,2,4,8,16") from None
    values = sorted(values)
    if not values or values[0] < 1:
        raise ValueError(f"batch buckets {text!r} must be positive integers, e.g. 1,2,4,8,16")
    if values[-1] > MAX_BUCKET:
        raise ValueError(f"batch bucket {values[-1]} is above {MAX_BUCKET}: every row's buffers are allocated for "
                         "the largest bucket; use smaller buckets")
    return tuple(values)


def parse_reference_slots(text: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """'4096,8192' -> (4096, 8192): reference-token slots, positive, unique, sorted (the family checks each is one
    of its slots when the graphs are made)."""
    values = set()
    for v in _items("reference slots", text, "4096,8192"):
        try:
            n = int(v) if isinstance(v, (int, str)) and not isinstance(v, bool) else 0
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"reference_slots {text!r} must be comma-separated positive token counts, "
                             "e.g. 4096,8192")
        values.add(n)
    return tuple(sorted(values))


def parse_prewarm(text: str) -> bool | tuple[tuple[int, int, int], ...]:
    """'all' | 'none' | 'WxH[@b1/b2...],...' -> GraphConfig.prewarm ('512x512@1/2/4' = those buckets; no @ = all
    buckets, returned with bucket 0 meaning "every bucket")."""
    if isinstance(text, (list, tuple)) and all(isinstance(v, str) for v in text):
        if not text:
            return False  # an empty list of keys: nothing to prewarm
        text = ",".join(text)  # TOML: prewarm = ["512x512@1/2", "768x512"]
    if not isinstance(text, str):
        raise ValueError(f"prewarm {text!r} must be 'all', 'none' or a list like '512x512@1/2/4,768x512'")
    text = text.strip().lower()
    if text in ("all", "true", ""):
        return True
    if text in ("none", "false"):
        return False
    keys = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        res, _, buckets = item.partition("@")
        (h, w), = parse_resolutions(res)
        for b in (buckets.split("/") if buckets else ["0"]):
            try:
                keys.append((h, w, int(b)))
            except ValueError:
                raise ValueError(f"prewarm item {item!r} must look like WxH or WxH@1/2/4") from None
    return tuple(keys)


def parse_resolutions(text: str | list) -> tuple[tuple[int, int], ...]:
    """'512x512,768x512' (WxH) -> ((512, 512), (512, 768)) as (height, width) pairs."""
    out = []
    for item in _items("resolutions", text, "512x512,768x512"):
        if isinstance(item, tuple) and len(item) == 2 and all(isinstance(v, int) for v in item):
            h, w = item
            name = f"{w}x{h}"
        elif isinstance(item, str):
            name = item.strip().lower()
            try:
                w, h = (int(v) for v in name.split("x"))
            except ValueError:
                raise ValueError(f"resolution {name!r} must look like WIDTHxHEIGHT, e.g. 512x512") from None
        else:
            raise ValueError(f"resolution {item!r} must look like WIDTHxHEIGHT, e.g. 512x512")
        if w % 8 or h % 8 or not (MIN_SIZE <= w <= MAX_SIZE and MIN_SIZE <= h <= MAX_SIZE):
            raise ValueError(f"resolution {name!r}: width and height must be multiples of 8 in {MIN_SIZE}..{MAX_SIZE}")
        out.append((h, w))
    return tuple(out)


@dataclass(frozen=True)
class GraphConfig:
    """Which CUDA graphs exist. resolutions are (height, width); empty means the model's native size."""

    batch_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    resolutions: tuple[tuple[int, int], ...] = ()
    # start-up captures: True = every (resolution, bucket); False = none; or (height, width, bucket) keys.
    # Keys not prewarmed are captured on first use.
    prewarm: bool | tuple[tuple[int, int, int], ...] = True
    capture_text_encoder: bool = True
    capture_vae: bool = True
    verify: bool = False            # replay vs eager max abs difference at capture, kept in the table
    warmup_iters: int = 3
    backend: str = "cuda"           # "emulated": replays re-run the function eagerly (CPU tests of the runner)
    # reference-token slots whose step groups are made with each graphed size's (a family reading reference images:
    # captured with them at start-up where prewarmed); other slots of a graphed size get graphs at first use
    reference_slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "reference_slots", parse_reference_slots(self.reference_slots))
        if isinstance(self.prewarm, str):  # "all" | "none" | "512x512@1/2,..." as on the command line
            object.__setattr__(self, "prewarm", parse_prewarm(self.prewarm))
        if isinstance(self.prewarm, bool):
            return
        if not isinstance(self.prewarm, (tuple, list)) or not all(
                isinstance(k, (tuple, list)) and len(k) == 3 and all(isinstance(v, int) for v in k)
                for k in self.prewarm):
            raise ValueError(f"prewarm {self.prewarm!r} must be True, False, a string like '512x512@1/2' or "
                             "(height, width, bucket) keys (bucket 0: every bucket)")
        object.__setattr__(self, "prewarm", tuple(tuple(k) for k in self.prewarm))
        for h, w, b in self.prewarm:
            if b and b not in self.batch_buckets:
                raise ValueError(f"prewarm {w}x{h}@{b}: bucket {b} is not a batch bucket "
                                 f"({','.join(map(str, self.batch_buckets))}); use one of those")
        if self.resolutions:
            self.check_prewarm(self.resolutions)

    def check_prewarm(self, resolutions: tuple[tuple[int, int], ...]) -> None:
        """Every prewarm key must be at one of the graphed resolutions (the model's native size when
        `resolutions` is empty: the model runner checks then)."""
        for h, w, _ in () if isinstance(self.prewarm, bool) else self.prewarm:
            if (h, w) not in resolutions:
                raise ValueError(f"prewarm {w}x{h} is not among the graphed resolutions "
                                 f"({','.join(f'{rw}x{rh}' for rh, rw in resolutions)}); add it to resolutions")

    @property
    def max_bucket(self) -> int:
        return max(self.batch_buckets)

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket >= n, or None when n exceeds the largest."""
        return smallest_bucket(self.batch_buckets, n)


MIN_LORA_SLOTS = 4
DEFAULT_LORA_SLOTS = 8
DEFAULT_REQUEST_LORAS = 8  # adapters one request may stack (--max-request-loras), at most request_inputs.MAX_LORAS


@dataclass(frozen=True)
class LoraConfig:
    """lora_dir: a folder of .safetensors adapters served by name; max_loras: device slots (None: 8 when there is a
    lora_dir or built-in adapters, else 0 = no side paths; adapters can still be fused); max_lora_rank: the slots' rank; fuse: (adapter
    name or .safetensors path, scale) pairs merged into the base weights at start-up."""

    lora_dir: str | None = None
    max_loras: int | None = None
    max_lora_rank: int = 64
    fuse: tuple[tuple[str, float], ...] = ()
    builtin_dir: str | None = None  # the model's built-in adapters (a shipped preset's), served by name too
    # side paths on the convolutions too (resnets, samplers, time embeddings: LoCon, LCM-LoRA, TCD, Hyper-SD): their
    # slots cost more than the attention ones (SD1.5 at rank 64: 77 MiB a slot) and every adapter step pays for them
    conv: bool = False
    # the prepared host copies (padded, pinned on a GPU) kept between requests, in bytes; queued requests hold only
    # names and file versions, and a copy dropped from here is read again at admission (off the loop)
    host_bytes: int = 2 * 2**30
    # adapters one request may stack (--max-request-loras); the step's deepest side path is this, or the slots
    max_per_request: int = DEFAULT_REQUEST_LORAS

    def __post_init__(self) -> None:
        if isinstance(self.max_per_request, bool) or not isinstance(self.max_per_request, int) \
                or not 1 <= self.max_per_request <= MAX_LORAS:
            raise ValueError(f"max-request-loras {self.max_per_request!r} is out of range; allowed: 1..{MAX_LORAS}")
        if self.host_bytes < 0:
            raise ValueError(f"lora host bytes {self.host_bytes} must be >= 0 (--lora-host-bytes)")
        if self.max_loras is not None and (self.max_loras < 0 or 0 < self.max_loras < MIN_LORA_SLOTS):
            raise ValueError(f"max_loras {self.max_loras}: give 0 (no adapter slots) or at least {MIN_LORA_SLOTS}")
        if not 1 <= self.max_lora_rank <= 1024:
            raise ValueError(f"max_lora_rank {self.max_lora_rank} is out of range; allowed: 1..1024")

    @property
    def slots(self) -> int:
        if self.max_loras is not None:
            return self.max_loras
        return DEFAULT_LORA_SLOTS if self.lora_dir or self.builtin_dir else 0

    @property
    def max_stack(self) -> int:
        """The most adapters one request may stack here: --max-request-loras, within the slots."""
        return min(self.max_per_request, self.slots) if self.slots else 0


def parse_name_scales(value: Any, flag: str) -> tuple[tuple[str, float], ...]:
    """--fuse-lora / --lora NAME[:SCALE] (repeated, or a list in TOML) -> ((name, scale), ...); scale 1 when left
    out."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{flag} must be NAME[:SCALE] or a list of them, got {value!r}")
    out = []
    for item in items:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            name, scale = item
        elif isinstance(item, str):
            name, _, scale = item.rpartition(":") if ":" in item else (item, "", "1")
        else:
            raise ValueError(f"{flag}: {item!r} is not NAME[:SCALE]")
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            raise ValueError(f"{flag}: the scale of {item!r} is not a number (NAME:0.8)") from None
        if not name or not math.isfinite(scale):
            raise ValueError(f"{flag}: {item!r} needs a name and a finite scale (NAME:0.8)")
        out.append((str(name), scale))
    return tuple(out)


ATTENTION_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")


@dataclass(frozen=True)
class CompileConfig:
    """The compile tier: torch.compile `backend` ("inductor"; "aot_eager" and the like for tests), compiled artifacts
    under `cache_dir` (default: the user's cache folder, one sub-folder per model config, dtype, torch and triton
    versions and device). `per_bucket` False (the default): one compile per kind and resolution, the batch dimension
    symbolic, so five buckets cost one compile; True: one compile per bucket (static shapes). `precompile` True (the
    default; Inductor, torch with `torch.compiler.load_compiled_function`): each compiled version of a graph kind is
    saved whole (torch's AOT compile: graph, code and kernels) in the cache folder and a later start loads it without
    tracing; False, or an older torch: Dynamo traces at every start and Inductor's caches skip the compiling.
    `channels_last` (convolution weights in channels-last memory format, on CUDA) and `attention` (the denoiser's
    scaled-dot-product-attention backend: "flash", "efficient", "cudnn", "math", or "auto": PyTorch's choice; "cudnn" is
    barely faster per SD1.5 step and not batch invariant: a row's image then depends on its batch companions beyond the
    fp16 tolerance; BENCHMARKS.md: Layout and attention with compile on): None takes the family's measured default
    (`engine.graph_setup.COMPILE_LAYOUT`). Channels-last converts the given model's UNet weights in place (same
    parameters, new storage): graphs another engine captured on that model object earlier must not be replayed after it.
    `mode`: Inductor's mode, one of COMPILE_MODES: "default", or "max-autotune-no-cudagraphs" (Inductor benchmarks its
    GEMM / convolution templates and tunes its kernels' launch settings: a much longer cold compile, kept in the cache;
    its options join the cache key). torch's "max-autotune" and "reduce-overhead" turn Inductor's own CUDA graphs on,
    and the graphs here are ours, so they are refused."""

    backend: str = "inductor"
    cache_dir: str | None = None
    per_bucket: bool = False
    precompile: bool = True
    channels_last: bool | None = None
    attention: str | None = None
    mode: str = "default"

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"compile backend {self.backend!r} must be a torch.compile backend name, e.g. inductor")
        parse_compile_mode(self.mode, "compile mode")
        if self.attention not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"compile attention {self.attention!r} is not an attention backend; use one of "
                             f"{', '.join(ATTENTION_BACKENDS)} (or leave it out: the family's measured default)")

    def inductor_options(self) -> dict[str, Any]:
        """Inductor's options for `mode` (torch._inductor.list_mode_options), its own CUDA graphs always off."""
        import torch._inductor
        return {**torch._inductor.list_mode_options(self.mode), "triton.cudagraphs": False}


# --compile-mode (TOML `compile-mode`): Inductor's modes whose code our graphs can capture
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def parse_compile_mode(value: Any, name: str = "--compile-mode") -> str:
    """An Inductor mode of COMPILE_MODES; anything else is refused naming `name` (the flag or TOML key)."""
    if value in COMPILE_MODES:
        return value
    why = (" turns Inductor's own CUDA graphs on, and diffgraph captures its own; use max-autotune-no-cudagraphs"
           if value in ("max-autotune", "reduce-overhead") else " is unknown")
    raise ValueError(f"{name} {value!r}{why} (allowed: {', '.join(COMPILE_MODES)})")


# --quantize (TOML `quantize`): none, 16 bits (the model's dtype); fp8, the denoiser's transformer linears in
# float8_e4m3fn (quantize/fp8.py; `diffgraph compare --quantize fp8` measures what it costs a model)
QUANTIZE_CHOICES = ("none", "fp8")


def parse_quantize(value: Any, name: str = "--quantize") -> str:
    """A quantize setting, one of QUANTIZE_CHOICES; anything else is refused naming `name` (the flag or TOML key)."""
    if value not in QUANTIZE_CHOICES:
        raise ValueError(f"{name} {value!r} is unknown; allowed: {', '.join(QUANTIZE_CHOICES)} (none: 16 bits; fp8: "
                         "the denoiser's transformer linears in fp8)")
    return value


GRANULARITIES = ("channel", "tensor")  # an fp8 weight's scales: one per output channel, or one per tensor
# the least input width of an fp8 layer by default (BENCHMARKS.md: fp8 linears in the compile tier)
FP8_MIN_FEATURES = 640


def check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"weight_granularity {granularity!r} is not known; use one of {', '.join(GRANULARITIES)}")


@dataclass(frozen=True)
class Fp8Config:
    """The fp8 tier's settings (`Engine(quantize=Fp8Config(...))`; `quantize="fp8"` is the default config):
    quantize/fp8.py's `quantize_linears`' `min_features` and `weight_granularity`. Here, torch-free, so the HTTP
    process builds it for its engine processes."""
    min_features: int = FP8_MIN_FEATURES
    weight_granularity: str = "channel"

    def __post_init__(self) -> None:
        check_granularity(self.weight_granularity)
        if not isinstance(self.min_features, int) or isinstance(self.min_features, bool):
            raise ValueError(f"min_features {self.min_features!r} must be an integer (the least input width of an fp8 "
                             f"layer), e.g. 640")
        if self.min_features < 16:
            raise ValueError(f"min_features {self.min_features} is below 16, the smallest width fp8 runs at; use 16 "
                             f"or more")


def quantize_argument(quantize: str, min_features: int | None = None,
                      flag: str = "--quantize-min-features") -> "str | Fp8Config | None":
    """`Engine(quantize=)` for a parsed setting: None (16 bits), "fp8" (Fp8Config's defaults), or an Fp8Config with
    `min_features`, the fp8 layers' least input width."""
    if min_features is None:
        return None if quantize == "none" else quantize
    if quantize == "none":
        needs = "--quantize fp8" if flag.startswith("--") else 'quantize fp8 (--quantize fp8, or quantize = "fp8")'
        raise ValueError(f"{flag} needs {needs} (it sets which layers run in fp8)")
    try:
        return Fp8Config(min_features=min_features)
    except ValueError as e:
        raise ValueError(str(e).replace("min_features", flag, 1)) from None


PREDICTION_TYPES = ("epsilon", "v_prediction")


@dataclass(frozen=True)
class LoadOptions:
    """How a model's files are read: for a single-file checkpoint, the diffusers config folder to read it
    with (else detected from its keys); for any model, a prediction type or zero-SNR override and a VAE (a single
    file or a diffusers folder) in place of the model's own."""

    model_config: str | None = None
    prediction_type: str | None = None   # "epsilon" | "v_prediction"; None: the model's (or detected)
    zero_snr: bool | None = None         # rescaled betas to zero terminal SNR; None: the model's (or detected)
    vae: str | None = None
    vae_upcast: bool | None = None       # decode in fp32 when the model is fp16 (False: an fp16-safe VAE, such as
                                         # sdxl-vae-fp16-fix as a single file); None: the VAE config's force_upcast
    cache_dir: str | None = None         # where generated config folders are kept; None: the user's cache folder
    text_encoder: str | None = None      # a split diffusion model's text-encoder file (in place of its companion)
    tokenizer: str | None = None         # a split diffusion model's tokenizer folder (in place of its sidecar's)

    def __post_init__(self) -> None:
        if self.prediction_type is not None and self.prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"prediction-type {self.prediction_type!r} is unknown; allowed: "
                             f"{', '.join(PREDICTION_TYPES)}")
        for name in ("model_config", "vae", "text_encoder", "tokenizer"):
            path = getattr(self, name)
            if path is not None and not os.path.exists(path):
                raise ValueError(f"{name.replace('_', '-')} {path!r} does not exist; give a local file or folder")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise ValueError(f"tokenizer {self.tokenizer!r} is not a folder; give the checkpoint's tokenizer folder "
                             "(tokenizer.json and its config)")
        if self.model_config is not None and not os.path.isfile(os.path.join(self.model_config, "model_index.json")):
            raise ValueError(f"model-config {self.model_config!r} is not a diffusers folder (no model_index.json); "
                             "give the folder of a diffusers pipeline of the checkpoint's architecture")
