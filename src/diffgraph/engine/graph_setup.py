"""Which graphs a model runner captures, and with which callables: the step (every variant of its row features'
program: e.g. the LoRA side paths' stack depths), the
text encoder(s), the VAE decoder and encoder, registered on a new `GraphRunner`; at the first tiling row, the tiling
groups' twins of the step variants and the VAE kinds (`add_tiling_graphs`). With a compile config, each kind
captures a `graphs.compiled.Compiled` of its function (the whole step: input scaling, denoiser, CFG and sampler
update in one compiled function) instead of the function itself, its batch dimension dynamic (one compile per kind
and resolution, which bucket 1 runs too where it is precompiled), saved whole in the cache folder where torch can
(precompiled versions, loaded by later starts without tracing); the runner's eager paths keep the plain ones. The
compile cache folder's saved artifacts are loaded first (`graphs.compiled.open_cache`).
"""

from __future__ import annotations

import inspect
from functools import partial
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol

import torch

from ..config import CompileConfig, GraphConfig
from ..features.program import StepProgram
from ..graphs.compiled import Compiled, open_cache
from ..graphs.graphables import StepGraph, TextGraph, VaeEncodeGraph, VaeGraph
from ..graphs.group_norm import use_channel_group_norms
from ..graphs.runner import GraphRunner
from ..graphs.step import StepBuffers, step_rows
from ..models.circular import circular
from ..models.families.base import FamilyAdapter
from ..models.model import DiffusionModel
from ..request import TILING
from ..sampling.samplers import SamplerPlan

# Inductor skips its layout optimisation (channels-last activations around convolutions) for dynamic shapes, so the
# one compile of buckets 2-16 kept NCHW activations between its kernels: forced on for the step, the compiled SD1.5
# step at bucket 16 is faster and bucket 1 unchanged (tools/probe_compile_layout.py engineforce; BENCHMARKS.md: The
# compile tier's own step graphs per layout)
STEP_OPTIONS = {"force_layout_optimization": True}
# The same for the VAE decoder's one dynamic-batch compile: faster at every bucket; its weights in channels-last too
# gain nothing more (not kept) (tools/probe_vae_layout.py; BENCHMARKS.md: the compile tier's VAE decode in
# channels-last). A VAE upcast to fp32 (SDXL's) keeps Inductor's choice: not
# measured there
VAE_OPTIONS = {"force_layout_optimization": True}
VAE_BUCKETS = (1, 2, 4)  # decode in chunks of at most 4: a 16-image fp32 decode at 1024^2 needs tens of GB
# The text encoders run once a request, not once a step: under --compile-mode max-autotune-no-cudagraphs they keep
# Inductor's default code, since autotuning their matmuls took most of SD1.5's cold autotuned start for a call that is
# a few ms of a request (BENCHMARKS.md: a cold autotuned start takes more than 15 minutes)
TEXT_OPTIONS = {"max_autotune": False, "coordinate_descent_tuning": False}
ENCODE_BUCKETS = (1, 2)  # an edit encodes its image (and an inpainting one its masked image too) once


def vae_buckets(cfg: GraphConfig) -> tuple[int, ...]:
    """The VAE graphs' buckets under `cfg`: VAE_BUCKETS up to its largest batch bucket."""
    return tuple(b for b in VAE_BUCKETS if b <= cfg.max_bucket)


def decode_chunks(n: int, buckets: tuple[int, ...] = VAE_BUCKETS) -> list[int]:
    """A decode of n rows as VAE replays of whole `buckets`, largest first (7: [4, 2, 1]), so that no replay carries
    a padded row: a padded row costs what a decoded one does (3 rows as 2 + 1, not as 4)."""
    chunks = []
    while n > 0:
        chunks.append(next((b for b in reversed(buckets) if b <= n), n))
        n -= chunks[-1]
    return chunks


class GraphHost(Protocol):
    """What the graph set is built from: the model runner's shapes, buffers and callables (engine/model_runner.py)."""

    graph_config: GraphConfig
    model: DiffusionModel
    adapter: FamilyAdapter
    device: torch.device
    cuda: bool
    program: StepProgram
    slot_shape: tuple[int, int, int] | None  # LoRA slots (count, max rank, conv side paths 0/1), or None
    decoder: torch.nn.Module  # the VAE module decode_pixels runs (in the decode dtype)

    def buffers(self, key: tuple) -> StepBuffers: ...  # a group key: (h, w), or (h, w, TILING)

    def plan_for(self, sampler: str, schedule: str, steps: int, key: tuple[int, int]) -> SamplerPlan: ...

    def decode_pixels(self, latents: torch.Tensor) -> torch.Tensor: ...

    def encode_pixels_eager(self, pixels: torch.Tensor) -> torch.Tensor: ...

    def latent_shape(self, key: tuple[int, int]) -> tuple[int, ...]: ...

    def group_keys(self, size: tuple[int, int]) -> tuple[tuple[int, int], ...]: ...

    def graphed_sizes(self) -> tuple[tuple[int, int], ...]: ...

    max_chunks: int  # the prompt windows a row may hold (the conditioning buffers' layout)


@dataclass
class GraphSet:
    """The graphs of one model runner (it owns them): the graph runner and the graphables it fills and reads."""

    runner: GraphRunner
    text: TextGraph | None = None
    vae: VaeGraph | None = None
    encode: VaeEncodeGraph | None = None
    compiled: list[Compiled] = field(default_factory=list)
    compile_folder: str | None = None
    # the tiling groups' own graphs (`add_tiling_graphs`): registered at the first tiling row
    tiling: bool = False
    vae_tiling: VaeGraph | None = None
    encode_tiling: VaeEncodeGraph | None = None
    # what the compiled decoder's module and the denoiser were given (per-channel group norms; channels-last
    # convolution weights), for the runner to give a VAE or UNet that replaces them (`ModelRunner.invalidate`); None
    # where they run as loaded
    decoder_form: Callable[[torch.nn.Module], object] | None = None
    denoiser_form: Callable[[torch.nn.Module], object] | None = None
    # a step variant's graph (`StepGraph` of a key, over the groups of `make_graphs`), and the keys registered after
    # start-up (`add_step_graph`: a row feature's step part met at its first use, the step cache's `CacheKey`s)
    step_graph: Callable[..., StepGraph] | None = None
    added_keys: list = field(default_factory=list)
    recompiles_per_kind: int = 0  # the compiled step's versions a new step kind adds (0: not compiled)
    recompiles_per_group: int = 0  # and those a new group adds to each step kind
    # the groups the step graphs cover (one list every step graph reads): the graphed sizes' groups, then those added
    # while serving (`add_step_group`)
    groups: list = field(default_factory=list)


def make_graphs(host: GraphHost, compile: CompileConfig | None = None) -> GraphSet:
    """The graph set of `host`: every step variant of its row features' program, the text encoder(s), the VAE
    decoder and encoder, with compiled callables under a compile config."""
    cfg, model, adapter = host.graph_config, host.model, host.adapter
    resolutions = host.graphed_sizes()
    cfg.check_prewarm(resolutions)
    out = GraphSet(GraphRunner(cfg, host.device))
    out.groups[:] = dict.fromkeys(k for size in resolutions for k in host.group_keys(size))  # the step's: per group
    tag, attention = _prepare_compile(host, out, compile, len(out.groups)) if compile is not None else ("", "auto")

    def maybe(fn: Any, name: str, batch_of: Any, options: dict | None = None, tokens_of: Any = None,
              form: str = "") -> Any:
        if compile is None:
            return fn
        out.compiled.append(Compiled(fn, compile, name, batch_of, folder=out.compile_folder, tag=tag + form,
                                     options=options, tokens_of=tokens_of))
        return out.compiled[-1]

    graphs = out.runner
    # the batch is dynamic (one compile for the buckets above 1), and so are the prompt tokens (one for every length)
    step_fn = maybe(step_rows, "the whole step", lambda args: args[1].tensors().values(),
                    STEP_OPTIONS if host.cuda else None, lambda args: [args[1].fields[n] for n in args[1].sequence])
    if attention != "auto":  # chosen when the step is traced (outside the traced code)
        step_fn = partial(_within, attention_first(attention), step_fn)
    sampler, schedule = adapter.default_sampler, adapter.default_schedule
    out.step_graph = partial(StepGraph, host.buffers, host.program, partial(adapter.denoise, model),
                             verify_plan=lambda: host.plan_for(sampler, schedule, 10, resolutions[0]),
                             resolutions=out.groups, buckets=cfg.batch_buckets, step_fn=step_fn)
    for key in host.program.variants():
        graphs.register(out.step_graph(key))
    if cfg.capture_text_encoder and not adapter.needs_attention_mask(model):
        if compile is not None:
            _install_output_hooks(host)
        out.text = TextGraph(maybe(partial(adapter.encode_ids, model), "the text encoder", lambda args: args[0],
                                     TEXT_OPTIONS if compile is not None and compile.mode != "default" else None),
                             adapter.token_lengths(model), host.device, cfg.batch_buckets)
        graphs.register(out.text)
    if cfg.capture_vae:
        # a size the family decodes in tiles (above its native area) decodes eagerly: no VAE graph of it
        untiled = tuple(r for r in resolutions if not adapter.tiles(model, r))
        channels_last_vae = host.cuda and model.vae_dtype != torch.float32  # (an fp32 decoder: Inductor's layout)
        if compile is not None and channels_last_vae:  # its group norms traced per channel first: group_norm.py
            out.decoder_form = use_channel_group_norms
            out.decoder_form(host.decoder)
        out.vae = VaeGraph(maybe(host.decode_pixels, "the VAE decoder", lambda args: args[:1],
                                 VAE_OPTIONS if channels_last_vae else None,
                                 form=" group_norm=channel" if channels_last_vae else ""),
                           partial(adapter.image_latent_shape, model), model.vae_dtype, host.device, untiled,
                           vae_buckets(cfg))
        graphs.register(out.vae)
        if adapter.supports_edits:
            # not compiled: an edit encodes once per request, and its two compiles would lengthen every cold start
            out.encode = VaeEncodeGraph(host.encode_pixels_eager, lambda key: (3, *key), model.vae_dtype,
                                        host.device, untiled, ENCODE_BUCKETS)
            graphs.register(out.encode)
    return out


def tiling_kind(kind: str) -> str:
    """The graph kind of a tiling group's `kind` ("step_lora1" -> "step_lora1_tiling", "vae" -> "vae_tiling")."""
    return f"{kind}_{TILING}"


def add_tiling_graphs(host: GraphHost, out: GraphSet) -> None:
    """The graphs of the tiling groups (AUTOMATIC1111's tiling: models/circular.py), registered once, at the first
    tiling row, so they are captured on first use and never at start-up: each step variant over the buffers of the
    tiling group of its resolution, the VAE decoder and encoder, each the plain callable (never compiled: the
    compiled code is traced with zero padding) run with the denoiser's or the VAE's convolutions padding
    circularly."""
    if out.tiling:
        return
    out.tiling = True
    runner = out.runner
    for key in [*host.program.variants(), *out.added_keys]:
        runner.register(_tiling_step(host, out, key))
    for name, kind, fn in (("vae", "vae", host.decode_pixels), ("encode", "vae_encode", host.encode_pixels_eager)):
        plain = getattr(out, name)
        if plain is not None:
            graph = plain.like(circular(fn, lambda: host.decoder), tiling_kind(kind))
            setattr(out, f"{name}_tiling", graph)
            runner.register(graph)


def _tiling_step(host: GraphHost, out: GraphSet, key: tuple) -> StepGraph:
    """The step variant `key` over the tiling groups' buffers, its denoiser's convolutions padding circularly."""
    model, adapter, step = host.model, host.adapter, out.runner.kinds["step"]
    denoise = circular(partial(adapter.denoise, model), lambda: model.denoiser)
    verify = partial(host.plan_for, adapter.default_sampler, adapter.default_schedule, 10, step.resolutions()[0])
    return StepGraph(lambda res: host.buffers((*res, TILING)), host.program, denoise, key, verify,
                     out.groups, step.buckets(), kind=tiling_kind(host.program.kind(key)))


def add_step_graph(host: GraphHost, out: GraphSet, key: tuple) -> str:
    """Registers the graphs of a step variant that is not among the program's `variants()` (a row feature's step part
    met while serving: the step cache's `CacheKey`), captured on first use like any key not prewarmed, and its
    tiling twin once the tiling graphs exist; returns its kind. (With a compile config the compiled step gets room
    for its versions: Dynamo would otherwise run it uncompiled past its recompile limit.)"""
    kind = host.program.kind(key)
    if kind in out.runner.kinds:
        return kind
    out.runner.register(out.step_graph(key))
    out.added_keys.append(key)
    if out.recompiles_per_kind:
        torch._dynamo.config.recompile_limit += out.recompiles_per_kind
    if out.tiling:
        out.runner.register(_tiling_step(host, out, key))
    return kind


def add_step_group(out: GraphSet, group: tuple) -> None:
    """Makes every step graph cover `group` too (a group the family puts under a graphed one: `FamilyAdapter.
    graph_group`, the reference slots of a graphed size), captured on first use; the tiling graphs' groups follow.
    (With a compile config the compiled step gets room for the group's versions.)"""
    out.groups.append(group)
    steps = [g for g in out.runner.kinds.values() if isinstance(g, StepGraph)]
    for graph in steps:
        out.runner.register(graph)  # its covers and table rows, from the shared groups
    if out.recompiles_per_group:
        torch._dynamo.config.recompile_limit += out.recompiles_per_group * len(steps)


def _install_output_hooks(host: GraphHost) -> None:
    """One eager call of the text encoders that asks for their hidden states, before they are compiled: transformers
    installs its output-capturing hooks at a model's first such call, under a threading lock Dynamo cannot trace
    ("Unsupported context manager"), which made the precompile of SDXL's encoders fail, so every start traced them
    again. Installed here, the compiled call finds them in place."""
    ids = [torch.zeros(1, n, dtype=torch.long, device=host.device) for n in host.adapter.token_lengths(host.model)]
    host.adapter.encode_ids(host.model, ids, clip_skip=1)


def _prepare_compile(host: GraphHost, out: GraphSet, compile: CompileConfig, groups: int) -> tuple[str, str]:
    """Opens the cache folder, sets the family's layout (on CUDA) and Dynamo's recompile limit; returns the tag of
    what precompiled code depends on beyond its arguments, and the attention backend to put first."""
    model, cfg = host.model, host.graph_config
    out.compile_folder = open_cache(compile, model, host.device)
    channels_last, attention = layout(compile, host.adapter) if host.cuda else (False, "auto")
    if channels_last:
        out.denoiser_form = partial(set_conv_layout, channels_last=True)
        out.denoiser_form(model.denoiser)
    slots = host.slot_shape
    tag = f"channels_last={channels_last} attention={attention} " + (
        f"loras={slots[0]}x{slots[1]}" + (" lora_conv" if slots[2] else "") if slots is not None else "loras=0") + (
        f" prompt_windows={host.max_chunks}")  # 1: contiguous conditioning; more: strided prefixes of longer rows
    # Dynamo keeps at most `recompile_limit` compiled versions of one function and runs it uncompiled past that,
    # silently: the step function has one per step variant, group (a size, or a token family's slots of one) and batch
    # kind (bucket 1, the rest)
    per_resolution = len(cfg.batch_buckets) if compile.per_bucket else 2
    out.recompiles_per_kind = groups * per_resolution
    out.recompiles_per_group = per_resolution
    needed = len(host.program.variants()) * out.recompiles_per_kind
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, needed + 2)
    return tag, attention


def layout(compile: CompileConfig, adapter: FamilyAdapter) -> tuple[bool, str]:
    """(channels-last convolution weights, attention backend) of the compile tier for a family: the config's, else
    the family's measured default (`FamilyAdapter.compile_layout`)."""
    channels_last, attention = adapter.compile_layout
    return (channels_last if compile.channels_last is None else compile.channels_last,
            attention if compile.attention is None else compile.attention)


def set_conv_layout(module: torch.nn.Module, channels_last: bool) -> None:
    """Every convolution weight of `module` in channels-last (or the default) memory format: the parameter objects
    stay (adapter slots, fused adapters and a user's copy_ still reach them) but their storage is new, so graphs
    captured before on these weights (another engine on the same model object) must not be replayed after this."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for m in module.modules():
        if isinstance(m, torch.nn.Conv2d) and m.weight.dim() == 4 and not m.weight.is_contiguous(memory_format=fmt):
            m.weight.data = m.weight.data.contiguous(memory_format=fmt)


def attention_first(backend: str) -> Callable[[], ContextManager]:
    """A context factory that puts `backend` first among the attention backends; where it cannot run the inputs (a
    GPU or head size it does not support) PyTorch takes the next (set_priority, torch 2.6+; before, `backend` alone)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    order = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    chosen = order.pop(backend)
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        return partial(sdpa_kernel, [chosen, *order.values()], set_priority=True)
    return partial(sdpa_kernel, chosen)


def _within(context: Callable[[], ContextManager], fn: Any, *args: Any) -> Any:
    with context():
        return fn(*args)
