"""`Engine`: the public, thread-safe Python facade over one engine core and its model runner.

It builds the pieces (load the model, the model runner on its device, the engine core with its scheduler),
captures the prewarm graphs, starts the loop, and offers the blocking API: `generate`, `submit` (a Future),
`abort`, the graph table and the equivalent diffusers pipeline. Requests are validated once, by
`GenerationRequest.create` with this model's defaults. Nothing of the loop lives here (engine/core.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable

import torch

from ..config import DEFAULT_REQUEST_LORAS, CompileConfig, GraphConfig, LoadOptions, LoraConfig
from ..features.capability import Capabilities, Capability, builtin_capabilities
from ..features.lora import LoraCapability
from ..lora.manager import LoraManager
from ..models.families import FamilyRegistry
from ..models.loader import load_model
from ..models.model import DiffusionModel
from ..quantize.fp8 import Fp8Config, Fp8Report, named_linears, quantize_linears
from ..models.presets import DEFAULT_MODEL, builtin_control_folder, builtin_lora_folder
from ..text.embeddings import EmbeddingDir
from ..request import (EngineClosed, EngineStepError, GenerationRequest, GenerationResult, ModelInfo, ParamError,
                       ProgressEvent, QueueFullError, RequestAborted)
from .core import EngineCore
from .controlnets import ControlNets
from .ip_adapters import IPAdapters
from .device_loop import DeviceLoop
from .model_runner import ModelRunner
from .prompts import DEFAULT_CACHE_BYTES
from .scheduler import SchedulerConfig, StepPlan

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[str, int, int], None]  # (request_id, step done, total steps)
PreviewCallback = Callable[[ProgressEvent], None]   # a live preview (the event's `previews`: encoded images)


def parse_device(device: str) -> torch.device:
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ParamError("device", f"device {device!r} is not understood; use cpu, cuda or cuda:N") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ParamError("device", f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    if parsed.type == "cuda" and parsed.index is None:
        parsed = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return parsed


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class _FutureSink:
    """A request's answer as a concurrent Future, progress through an optional callback."""

    def __init__(self, on_progress: ProgressCallback | None, on_preview: PreviewCallback | None = None):
        self.future: Future = Future()
        self._on_progress, self._on_preview = on_progress, on_preview
        self._lock = threading.Lock()

    def progress(self, event: ProgressEvent) -> None:
        if event.previews:
            if self._on_preview is not None:
                self._on_preview(event)
        elif self._on_progress is not None:
            self._on_progress(event.request_id, event.step, event.total)

    def finish(self, result: GenerationResult | None, error: BaseException | None) -> None:
        with self._lock:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)


class Engine:
    """Generates images with an SD1.x/SD2.x/SDXL model; thread-safe; requests share steps.

    >>> engine = Engine(device="cpu")                      # the shipped `digits` model
    >>> engine = Engine("models/dreamshaper_8.safetensors")  # a checkpoint file (SD1.x, SD2.x, SDXL), offline
    >>> images = engine.generate("a handwritten digit seven", seed=1)
    """

    def __init__(self, model: "str | DiffusionModel" = DEFAULT_MODEL, device: str | None = None, dtype: str | None = None,
                 mode: str | None = None, graphs: GraphConfig | None = None, batching: str = "step",
                 max_wait_ms: float = 0.0, max_queue: int = 256, max_rows: int | None = None,
                 prompt_cache_size: int = 512, prompt_cache_bytes: int = DEFAULT_CACHE_BYTES, image_threads: int = 2,
                 grow_fill: float = 0.85,
                 grow_hold_ms: float = 2000.0, families: FamilyRegistry | None = None, lora_dir: str | None = None,
                 max_loras: int | None = None, max_lora_rank: int = 64, lora_conv: bool = False,
                 max_request_loras: int = DEFAULT_REQUEST_LORAS,
                 fuse_loras: "list[tuple[str, float]] | tuple" = (), compile: "bool | CompileConfig" = False,
                 max_prompt_chunks: int = 3, embeddings_dir: str | None = None, metadata: bool = True,
                 load: LoadOptions | None = None, loop: DeviceLoop | None = None, name: str | None = None,
                 preview_decoder: str | None = None, max_step_failures: int = 3,
                 lora_host_bytes: int = 2 * 2**30, controlnet_dir: str | None = None, max_controlnets: int = 2,
                 ip_adapter_dir: str | None = None, quantize: "str | Fp8Config | None" = None,
                 capabilities: Capabilities | None = None, capability_settings: "dict[str, Any] | None" = None):
        device, cuda, dtype, mode = self._placement(model, device, dtype, mode, graphs)
        t0 = time.perf_counter()
        place = parse_device(device)
        # every CUDA call of the build (load, buffers, prewarm captures) goes to the engine's own device
        with torch.cuda.device(place) if place.type == "cuda" else contextlib.nullcontext():
            self.model: DiffusionModel = (model if isinstance(model, DiffusionModel)
                                          else load_model(model, place, dtype, families=families, options=load))
            if name:  # the name requests, images and listings use (a model folder's entry, not its path)
                self.model.name = name
            self.mode = mode
            loras = self._lora_manager(lora_dir, max_loras, max_lora_rank, fuse_loras, lora_conv, lora_host_bytes,
                                       max_request_loras)
            # after the adapters' fusing and side paths: fused weights are quantised, side paths stay 16-bit
            self.quantized = _quantize(self.model, quantize, shared=isinstance(model, DiffusionModel))
            if self.quantized is not None and not compile and cuda:
                logger.warning("quantize fp8 without the compile tier runs its per-token quantisation as eager kernels: "
                               "SDXL's step was 1.7x slower than 16 bits on the H200 (BENCHMARKS.md); add --compile")
            if not isinstance(compile, (bool, CompileConfig)):
                raise ParamError("compile", f"compile must be True, False or a CompileConfig, got {compile!r}")
            roots = tuple(r for r in (controlnet_dir, builtin_control_folder(self.model.name)) if r)
            controls = _controlnets(self.model, roots, max_controlnets) if roots else None
            image_prompts = _ip_adapters(self.model, ip_adapter_dir) if ip_adapter_dir else None
            self._prepared = self._modules()  # the modules the engine prepared (invalidate: a replaced one)
            present = self._present_capabilities(capabilities, capability_settings, LoraCapability(loras))
            self.runner = ModelRunner(self.model, mode=mode, graphs=graphs, max_rows=max_rows,
                                      prompt_cache_size=prompt_cache_size,
                                      prompt_cache_bytes=prompt_cache_bytes, loras=loras, controls=controls,
                                      image_prompts=image_prompts,
                                      compile=CompileConfig() if compile is True else compile or None,
                                      max_prompt_chunks=max_prompt_chunks,
                                      embeddings=EmbeddingDir(embeddings_dir) if embeddings_dir else None,
                                      capabilities=present)
            # in graph mode a step costs its bucket: the scheduler grows a group into a larger bucket only when it
            # fills it (grow_fill) or its queue head has waited grow_hold_ms
            graphed = mode == "graph"
            self.core = EngineCore(self.runner, SchedulerConfig(
                batching=batching, max_rows=self.runner.max_rows, max_wait_ms=max_wait_ms, max_queue=max_queue,
                buckets=self.runner.graph_config.batch_buckets if graphed else (),
                padded=self.runner.graphed_resolutions(), grow_fill=grow_fill, grow_hold_ms=grow_hold_ms),
                image_threads=image_threads, metadata=bool(metadata), loop=loop, max_step_failures=max_step_failures)
            if preview_decoder:  # live previews from a tiny decoder (TAESD), its graphs captured with the others
                try:
                    self.core.previews.use_decoder(preview_decoder)
                except ValueError as e:
                    raise ParamError("preview_decoder", str(e)) from None
            self._ready = False
            loaded_s = time.perf_counter() - t0
            logger.info("model %s loaded in %.1f s (%s, %s)", self.model.name, loaded_s, place, dtype)
            if graphed and self.runner.graph_config.prewarm:
                self.runner.prewarm()
                logger.info("graphs of %s captured in %.1f s (%d graphs)", self.model.name,
                            time.perf_counter() - t0 - loaded_s, len(self.runner.graph_table()))
        self.ready_s = time.perf_counter() - t0  # load to ready (prewarm graphs captured)
        self.core.start()
        # an engine never closed is closed when it is dropped or, at the latest, when the interpreter exits (its
        # atexit call): its loop finishes the step it runs first, where the teardown would abort the process under
        # a native op ("terminate called without an active exception")
        self._closer = weakref.finalize(self, self.core.close)
        self._ready = True
        self.info = self._model_info()

    @staticmethod
    def _placement(model: "str | DiffusionModel", device: str | None, dtype: Any, mode: str | None,
                   graphs: GraphConfig | None) -> tuple[str, bool, Any, str]:
        """The device, whether it is a CUDA one, the dtype and the mode: a loaded model's own device and dtype, else
        the given ones or the defaults; refuses a mode the device cannot run, warns of half precision on the CPU."""
        if isinstance(model, DiffusionModel):  # share already-loaded modules (benchmarks, several engines)
            device, dtype = str(model.device), model.dtype
        device = device or default_device()
        cuda = parse_device(device).type == "cuda"
        dtype = dtype or ("fp16" if cuda else "fp32")
        mode = mode or ("graph" if cuda else "eager")
        if mode not in ("graph", "eager"):
            raise ParamError("mode", f"mode {mode!r} is unknown; allowed: graph, eager")
        if mode == "graph" and not cuda and (graphs is None or graphs.backend != "emulated"):
            raise ParamError("mode", "mode 'graph' needs a CUDA device; on the CPU the engine runs in mode 'eager'")
        if not cuda and str(dtype).lower() in ("fp16", "float16", "bf16", "bfloat16"):
            logger.warning("dtype %s on the CPU is several times slower than fp32 (no fast half-precision kernels "
                           "there) and no more exact; use fp32 on the CPU", dtype)
        return device, cuda, dtype, mode

    def _present_capabilities(self, capabilities: Capabilities | None,
                              capability_settings: "dict[str, Any] | None", *made: Capability) -> Any:
        """The registered capabilities (features/capability.py) this model has, with their settings: the given
        registry (default: every built-in one), the family's own beside it, and those the engine `made` from its
        keywords (LoRA's)."""
        registry = capabilities if capabilities is not None else builtin_capabilities()
        own = (*self.model.adapter.capabilities(), *made)  # the family's (its guidance options), beside the engine's
        if own:
            registry = Capabilities((*registry, *(c for c in own if c.name not in {r.name for r in registry})))
        try:  # registered capabilities (features/capability.py): the ones this model has, with their settings
            return registry.for_model(self.model, registry.settings(capability_settings))
        except (TypeError, ValueError) as e:
            raise ParamError("capability_settings", str(e)) from None

    def _model_info(self) -> ModelInfo:
        """What requests may ask of this engine's model and its family (checked by GenerationRequest.create)."""
        adapter = self.model.adapter
        return ModelInfo(name=self.model.name, family=self.model.family, native_size=self.model.native_size,
                         default_guidance=self.model.default_guidance, max_rows=self.runner.max_rows,
                         mode=self.mode, device=str(self.model.device), ready_s=self.ready_s,
                         edit_strength=adapter.edit_strength, edits=adapter.supports_edits,
                         samplers=tuple(adapter.samplers), schedules=tuple(adapter.schedules),
                         default_sampler=adapter.default_sampler, default_schedule=adapter.default_schedule,
                         size_multiple=int(adapter.size_multiple), guidance=adapter.guidance(self.model),
                         prompt_syntaxes=tuple(adapter.prompt_syntaxes),
                         extensions=self.runner.capabilities.names(),
                         extension_params=self.runner.capabilities.params(),
                         extension_images=self.runner.capabilities.image_params(),
                         image_limits=self.runner.capabilities.image_limits(),
                         extension_defaults=self.runner.capabilities.defaults(),
                         edit_images=adapter.edit_images, edit_images_area=adapter.edit_images_area,
                         default_steps=self.model.default_steps, edit_steps_rule=adapter.edit_steps_rule,
                         tiling=adapter.supports_tiling)

    def _lora_manager(self, lora_dir: str | None, max_loras: int | None, max_lora_rank: int,
                      fuse_loras: Any, conv: bool = False, host_bytes: int = 2 * 2**30,
                      per_request: int = DEFAULT_REQUEST_LORAS) -> LoraManager | None:
        """Adapter slots and side paths (with a lora_dir or max_loras > 0), adapters fused into the weights;
        `per_request` adapters at most in one request."""
        try:
            config = LoraConfig(lora_dir=lora_dir, max_loras=max_loras, max_lora_rank=max_lora_rank,
                                fuse=tuple((str(n), float(s)) for n, s in fuse_loras),
                                builtin_dir=builtin_lora_folder(self.model.name), conv=bool(conv),
                                host_bytes=int(host_bytes), max_per_request=per_request)
            if not config.slots and not config.fuse:
                return None
            return LoraManager(self.model, config)
        except ValueError as e:  # AdapterError, AdapterNameError, a bad setting
            raise ParamError("loras", str(e)) from None

    # -- LoRA adapters -------------------------------------------------------------------------
    def add_lora(self, name: str, source: "str | dict[str, torch.Tensor]") -> dict[str, Any]:
        """Registers adapter `name` from a .safetensors file or a state dict (diffusers/PEFT or kohya keys), checked
        now; requests then name it in `loras=[(name, scale)]`. Adding a name again replaces it for new requests
        (rows in flight finish with the version they began with). Raises ParamError naming the problem."""
        manager = self._loras_or_raise()
        try:
            return manager.add(name, source)
        except ValueError as e:
            raise ParamError("loras", str(e)) from None

    def remove_lora(self, name: str) -> None:
        """Forgets an adapter added with add_lora; its slots are cleared once no live row uses them."""
        manager = self._loras_or_raise()

        def remove() -> None:  # on the loop thread: the slot bookkeeping is the scheduler's gate
            for slot in manager.remove(name):
                manager.clear(slot)
        try:
            self.core.call_between_steps(remove).result()
        except ValueError as e:
            raise ParamError("loras", str(e)) from None

    def loras(self) -> dict[str, Any]:
        """The adapters this engine serves: {"data": [{name, rank, targets, family, loaded, source}], "unusable":
        [{name, error}], "ignored": [files that are not adapters], "max_loras", "max_lora_rank"}."""
        manager = self.runner.loras
        if manager is None or not manager.enabled:
            return {"data": [], "unusable": [], "ignored": [], "max_loras": 0, "max_lora_rank": 0}
        return manager.listing()

    def _loras_or_raise(self) -> LoraManager:
        manager = self.runner.loras
        if manager is None or not manager.enabled:
            raise ParamError("loras", "this engine has no adapter slots; create it with lora_dir=DIR or "
                                      "max_loras=N (diffgraph serve --lora-dir / --max-loras)")
        return manager

    # -- public API ----------------------------------------------------------------------------
    def make_request(self, prompt: Any, **params: Any) -> GenerationRequest:
        """A checked request with this model's defaults (native size, guidance, sampler, schedule), its sampler,
        schedule and size checked against the model's family. Raises ParamError."""
        request = GenerationRequest.create(prompt, model=self.info, **params)
        self.runner.request_plan(request)  # the model's steps; edits on a family that takes images
        return request

    def generate(self, prompt: Any, **params: Any) -> GenerationResult:
        """Generates `num_images` images for one prompt and waits for them. The result is a list-like of
        PIL images with `.seed`, `.timings` and `.arrays` (float pixels). Bad parameters raise ParamError.
        `image=` (PIL image) makes it image-to-image, with `mask_image=` (white = repaint) inpainting; `strength=`
        sets how much of the schedule they run (diffusers' defaults). `loras=[("name", 0.8), ...]` applies up to
        max_request_loras (8) LoRA adapters to this request alone (an engine with lora_dir= or max_loras=)."""
        return self.submit(self.make_request(prompt, **params)).result()

    def run(self, request: GenerationRequest) -> GenerationResult:
        return self.submit(request).result()

    def submit(self, request: GenerationRequest, on_progress: ProgressCallback | None = None,
               on_preview: PreviewCallback | None = None) -> Future:
        """Queues a request; the future gives its GenerationResult. Raises QueueFullError when the queue is full.
        `on_progress(request_id, step, total)` runs on the engine's loop thread after each step: keep it short
        (hand anything slow to another thread), since every request waits for it. `on_preview(event)` gets a
        request's live previews (its `preview`), on the preview thread, all before the result."""
        self.info.check_request(request)  # a request built without this model's info
        sink = _FutureSink(on_progress, on_preview)
        self.core.submit(request, sink)
        return sink.future

    @property
    def ready(self) -> bool:
        """Built (prewarm graphs captured) and its loop running: False once closed or after a loop failure."""
        return self._ready and self.core.ready

    def abort(self, request_id: str) -> bool:
        """Frees the request's rows at the next step boundary; its future fails with RequestAborted. True when
        the request was waiting or running; one that is in its last step then still completes with its result."""
        return self.core.abort(request_id)

    def invalidate(self, kind: str | None = None) -> None:
        """Tells the engine that weights or modules of `kind` ("step" = the denoiser, "text", "vae"; None = all)
        changed: between two steps their graphs are dropped (recaptured on next use) and prompt embeddings of old
        text-encoder weights are no longer used. Waits until that is done. A replaced `model.denoiser` is refused where
        the engine gave the one it was built with something the new one lacks (LoRA slots or fused adapters, fp8
        linears, IP-Adapter processors): its requests would run without them. So is a replaced text encoder where
        the engine gave the old one LoRA adapters' text side paths."""
        loras = ["LoRA adapters (slots or fused)"] if self.runner.loras is not None else []
        given = {"step": loras + [what for what, there in (("fp8 linears", self.quantized is not None), (
            "IP-Adapter processors", self.runner.image_prompts is not None)) if there], "text": loras}
        for k, now in self._modules().items():
            if kind in (None, k) and [id(m) for m in now] != [id(m) for m in self._prepared[k]]:
                if given[k]:
                    where = "unet" if k == "step" else "text_encoders" + "".join(
                        f"[{i}]" for i, m in enumerate(now) if m not in self._prepared[k])  # (modules: by identity)
                    raise ValueError(f"model.{where} was replaced, but this engine gave the module it was built with "
                                     f"{' and '.join(given[k])}, which the new one lacks; build a new Engine with the "
                                     "new module (in-place weight updates, param.copy_, need no new engine)")
                self._prepared[k] = now
        self.core.call_between_steps(lambda: self.runner.invalidate(kind)).result()

    def _modules(self) -> dict[str, tuple[torch.nn.Module, ...]]:
        return {"step": (self.model.denoiser,), "text": tuple(self.model.text_encoders)}

    def reconfigure(self, **changes: Any) -> None:
        """Changes scheduler settings (batching, max_wait_ms, max_queue, grow_fill, grow_hold_ms, max_skips) of
        an idle engine (benchmarks compare modes on one set of graphs)."""
        self.core.reconfigure(**changes)

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def step_listeners(self) -> list[Callable[[StepPlan, float], None]]:
        return self.core.step_listeners

    @property
    def stats(self) -> dict[str, int]:
        return {**self.core.stats, "prompt_cache_hits": self.runner.prompts.hits,
                "prompt_cache_misses": self.runner.prompts.misses,
                "lora_loads": self.runner.loras.loads if self.runner.loras is not None else 0,
                "compile_fallbacks": sum(c.fallbacks for c in self.runner.compiled),
                "compiles": sum(c.compiles for c in self.runner.compiled),
                "compile_s": round(sum(c.compile_s for c in self.runner.compiled), 2),
                "compile_loaded": sum(c.loaded for c in self.runner.compiled),
                "compile_load_s": round(sum(c.load_s for c in self.runner.compiled), 2)}

    def graph_table(self) -> list[dict[str, Any]]:
        """Per graph key: status, capture ms, pool MiB added, replays, eager fallbacks, verification diff."""
        return self.runner.graph_table()

    def queue_depth(self) -> int:
        return self.core.queue_depth()

    def live_rows(self) -> dict[tuple[int, int], int]:
        """Live rows per (height, width): every graphed resolution (0 when idle), other sizes while they run."""
        return self.core.live_rows()

    def memory(self) -> dict[str, int]:
        """What the engine holds now, in bytes (EngineStats.memory: /metrics' diffgraph_engine_memory_bytes)."""
        r = self.runner
        buffers = list(r.groups.values())
        loras = r.loras.host_bytes() if r.loras is not None and r.loras.enabled else 0
        pinned = sum(p.nbytes() for p in list(r.staging.values())) if r.cuda else 0
        return {"buffer_groups": len(buffers), "prompt_cache_bytes": r.prompts.nbytes(), "lora_host_bytes": loras,
                "buffer_bytes": sum(t.numel() * t.element_size() for b in buffers for t in b.fields.values()),
                "pinned_bytes": pinned + (loras if r.cuda else 0)}

    def close(self, timeout: float | None = 10.0) -> None:
        closer = getattr(self, "_closer", None)  # (none when the engine failed while starting)
        if closer is not None:
            closer.detach()
        self.core.close(timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- diffusers interop ---------------------------------------------------------------------
    def diffusers_pipeline(self, sampler: str | None = None, schedule: str = "default", task: str = "text"):
        """The equivalent diffusers pipeline built on the same loaded modules (no copies); task "text",
        "img2img" or "inpaint".

        With `sampler`, its scheduler is the diffusers scheduler equivalent to (sampler, schedule);
        otherwise EulerDiscreteScheduler from the model's scheduler config (a flow-matching family's, or
        "flow_euler": FlowMatchEulerDiscreteScheduler)."""
        from ..models.quiet import quiet_known_warnings
        from ..sampling.flow import FLOW_SAMPLERS
        from ..sampling.oracle import diffusers_scheduler

        quiet_known_warnings()
        from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

        m = self.model
        config = {k: v for k, v in m.scheduler_config.items() if not k.startswith("_")}
        if sampler == "flow_euler" or (sampler is None and m.adapter.default_sampler in FLOW_SAMPLERS):
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        else:
            scheduler = (diffusers_scheduler(config, sampler, schedule) if sampler
                         else EulerDiscreteScheduler.from_config(config))
        pipe = m.adapter.diffusers_pipeline(m, scheduler, task)
        pipe.set_progress_bar_config(disable=True)
        return pipe


__all__ = ["Engine", "EngineClosed", "EngineStepError", "QueueFullError", "RequestAborted"]


def _ip_adapters(model: DiffusionModel, root: str) -> IPAdapters:
    """The IP-Adapters of `--ip-adapter-dir` (the family's UNet must have cross-attention layers to extend)."""
    if "ip_adapter" not in model.adapter.side_paths:
        raise ParamError("ip_adapter_dir", f"the {model.adapter.name} family takes no IP-Adapter; leave "
                                           "--ip-adapter-dir out for this model")
    try:
        return IPAdapters(root, model.denoiser, model.device, model.dtype)
    except ValueError as e:
        raise ParamError("ip_adapter_dir", str(e)) from None


def _quantize(model: DiffusionModel, quantize: "str | Fp8Config | None", shared: bool) -> Fp8Report | None:
    """The denoiser's linears in fp8 (`quantize` "fp8" or an Fp8Config), in place; None for 16 bits."""
    if quantize is None:
        return None
    if isinstance(quantize, str):
        if quantize != "fp8":
            raise ParamError("quantize", f"quantize {quantize!r} is unknown; allowed: fp8 (or leave it unset for 16 "
                                         "bits)")
        quantize = Fp8Config()
    if shared:
        raise ParamError("quantize", "quantize changes the model's layers in place: give the engine a model name or "
                                     "path (it loads its own copy), not a loaded DiffusionModel")
    try:
        names = model.adapter.fp8_linears
        report = quantize_linears(model.denoiser, min_features=quantize.min_features,
                                  select=named_linears(names) if names is not None else None,
                                  weight_granularity=quantize.weight_granularity)
    except ValueError as e:
        raise ParamError("quantize", str(e)) from None
    logger.info("%s: %s", model.name, report.summary())
    return report


def _controlnets(model: DiffusionModel, roots: tuple[str, ...], slots: int) -> ControlNets:
    """The ControlNets of `--controlnet-dir` and the model's built-in ones (its family must take residuals)."""
    if "controlnet" not in model.adapter.side_paths:
        raise ParamError("controlnet_dir", f"the {model.adapter.name} family takes no ControlNet; leave "
                                           "--controlnet-dir out for this model")
    if not isinstance(slots, int) or slots < 1:
        raise ParamError("max_controlnets", f"max-controlnets {slots!r} must be an integer >= 1")
    try:
        return ControlNets(roots, model.device, model.dtype, model.denoiser.config, slots, model.vae_scale_factor)
    except ValueError as e:
        raise ParamError("controlnet_dir", str(e)) from None
