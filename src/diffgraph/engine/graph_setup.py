"""Which graphs a model runner captures, and with which callables: the step (and its LoRA side-path variants), the
text encoder(s), the VAE decoder and encoder, registered on a new `GraphRunner`. With a compile config, each kind
captures a `graphs.compiled.Compiled` of its function (the whole step: input scaling, denoiser, CFG and sampler
update in one compiled function) instead of the function itself, its batch dimension dynamic (one compile per kind
and resolution, which bucket 1 runs too where it is precompiled), saved whole in the cache folder where torch can
(precompiled versions, loaded by later starts without tracing); the runner's eager paths keep the plain ones. The
compile cache folder's saved artifacts are loaded first (`graphs.compiled.open_cache`).
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Callable, ContextManager

import torch

from ..config import CompileConfig
from ..graphs.compiled import Compiled, open_cache
from ..graphs.graphables import StepGraph, TextGraph, VaeEncodeGraph, VaeGraph
from ..graphs.runner import GraphRunner
from ..graphs.step import step_rows
from ..request import MAX_LORAS

# the compile tier's layout per family, measured with compile on (tools/probe_compile_layout.py; BENCHMARKS.md,
# session 8): (convolution weights channels-last, attention backend first in line). Compiled SD1.5 UNet at CFG
# batch 2 / 32: NCHW 7.47 / 72.29 ms, channels-last 6.47 / 69.18, channels-last + cuDNN attention 6.12 / 67.39.
# SDXL: NCHW 32.42 / 466.4, channels-last 31.55 / 468.0, + cuDNN attention 31.42 / 467.7 (within noise: PyTorch's).
# The engine's own step graphs (session 9, with STEP_OPTIONS), SD1.5 buckets 1 / 16: channels-last + cuDNN 5.99 /
# 65.03 ms, channels-last + PyTorch's attention 6.03 / 64.83, NCHW 6.71 / 65.33. cuDNN attention is not batch
# invariant: a row's image moved with the batch sizes it ran at, up to 0.0378 (pixels, `digits`, 20 mixed requests
# vs each alone: 5 of 29 bucket paths over the 2e-2 fp16 tolerance); with PyTorch's choice at most 0.0125 over 19
# paths, the graph tier 0.0107 (tools/probe_mixed_fidelity.py; session 10). So both families keep PyTorch's choice.
COMPILE_LAYOUT = {"sd": (True, "auto"), "sdxl": (True, "auto")}
# Inductor skips its layout optimisation (channels-last activations around convolutions) for dynamic shapes, so the
# one compile of buckets 2-16 kept NCHW activations between its kernels: forced on for the step, the compiled SD1.5
# step at bucket 16 (CFG batch 32) went 71.57 -> 65.03 ms with channels-last weights + cuDNN attention (NCHW:
# 69.44 -> 65.33), bucket 1 unchanged (6.05 / 5.99) (tools/probe_compile_layout.py engineforce; session 9)
STEP_OPTIONS = {"force_layout_optimization": True}
VAE_BUCKETS = (1, 2, 4)  # decode in chunks of at most 4: a 16-image fp32 decode at 1024^2 needs tens of GB
ENCODE_BUCKETS = (1, 2)  # an edit encodes its image (and an inpainting one its masked image too) once
STEP_STACKS = (0, 1, MAX_LORAS)  # the step variants with adapter slots: none, one adapter per row, a stack


def make_graphs(runner: Any, compile: CompileConfig | None = None) -> list[Compiled]:
    """Sets runner.graph_runner, text_graph, vae_graph and encode_graph; returns the compiled callables (none
    without `compile`)."""
    cfg, model, adapter = runner.graph_config, runner.model, runner.adapter
    resolutions = cfg.resolutions or ((model.native_size, model.native_size),)
    cfg.check_prewarm(resolutions)
    compiled: list[Compiled] = []
    tag, attention = _prepare_compile(runner, compile, resolutions) if compile is not None else ("", "auto")

    def maybe(fn: Any, name: str, batch_of: Any, options: dict | None = None) -> Any:
        if compile is None:
            return fn
        compiled.append(Compiled(fn, compile, name, batch_of, folder=runner.compile_folder, tag=tag, options=options))
        return compiled[-1]

    runner.graph_runner = graphs = GraphRunner(cfg, runner.device)
    step_fn = maybe(step_rows, "the whole step", lambda args: args[1].tensors().values(),
                    STEP_OPTIONS if runner.cuda else None)
    if attention != "auto":  # chosen when the step is traced (outside the traced code)
        step_fn = partial(_within, attention_first(attention), step_fn)
    loras = runner.loras and runner.loras.unet_rows
    for stack in STEP_STACKS if runner.lora_stack else (0,):
        graphs.register(StepGraph(runner.buffers, partial(adapter.denoise, model),
                                  lambda: runner.plan_for("dpmpp_2m", "karras", 10), resolutions, cfg.batch_buckets,
                                  loras, stack, step_fn))
    if cfg.capture_text_encoder and not adapter.needs_attention_mask(model):
        runner.text_graph = TextGraph(maybe(partial(adapter.encode_ids, model), "the text encoder",
                                                  lambda args: args[0]),
                                      adapter.token_lengths(model), runner.device, cfg.batch_buckets)
        graphs.register(runner.text_graph)
    if cfg.capture_vae:
        runner.vae_graph = VaeGraph(maybe(runner._decode_pixels, "the VAE decoder", lambda args: args[:1]),
                                    runner.latent_shape, model.vae_dtype, runner.device, resolutions,
                                    tuple(b for b in VAE_BUCKETS if b <= cfg.max_bucket))
        graphs.register(runner.vae_graph)
        if adapter.supports_edits:
            # not compiled: an edit encodes once per request, and its two compiles would lengthen every cold start
            runner.encode_graph = VaeEncodeGraph(runner._encode_pixels, lambda key: (3, *key),
                                                 model.vae_dtype, runner.device, resolutions, ENCODE_BUCKETS)
            graphs.register(runner.encode_graph)
    return compiled


def _prepare_compile(runner: Any, compile: CompileConfig, resolutions: tuple) -> tuple[str, str]:
    """Opens the cache folder, sets the family's layout (on CUDA) and Dynamo's recompile limit; returns the tag of
    what precompiled code depends on beyond its arguments, and the attention backend to put first."""
    model, cfg = runner.model, runner.graph_config
    runner.compile_folder = open_cache(compile, model, runner.device)
    channels_last, attention = layout(compile, model.family) if runner.cuda else (False, "auto")
    if channels_last:
        set_conv_layout(model.unet, channels_last=True)
    slots = runner.loras.config if runner.loras is not None and runner.loras.enabled else None
    tag = f"channels_last={channels_last} attention={attention} " + (
        f"loras={slots.slots}x{slots.max_lora_rank}" if slots is not None else "loras=0")  # side paths' shapes
    # Dynamo keeps at most `recompile_limit` compiled versions of one function and runs it uncompiled past that,
    # silently: the step function has one per step variant, resolution and batch kind (bucket 1, the rest)
    per_resolution = len(cfg.batch_buckets) if compile.per_bucket else 2
    needed = (len(STEP_STACKS) if runner.lora_stack else 1) * len(resolutions) * per_resolution
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, needed + 2)
    return tag, attention


def layout(compile: CompileConfig, family: str) -> tuple[bool, str]:
    """(channels-last convolution weights, attention backend) of the compile tier for `family`: the config's, else
    the family's measured default."""
    channels_last, attention = COMPILE_LAYOUT.get(family, (False, "auto"))
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
