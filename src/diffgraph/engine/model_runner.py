"""`ModelRunner`: everything one engine does on its device. The engine core decides; the runner executes.

Owns, for one model on one device: the per-group static row buffers, the pinned staging slots, the prompt
embedding cache, the graph runner and its graphs, and the weights versions. It encodes prompts (batched, cached
under (sign, prompt as token ids, text adapters, text-encoder weights version); prompt_rows.PromptEncoder), draws
each request's initial and step noise from its own CPU generator in diffusers' order (its images do not depend on
its batch companions), writes admitted rows, runs one whole step for rows [0, n) of a group, and decodes finished
rows to float pixels without making the caller wait. What a model means (conditioning fields, denoiser call, latent
shape, decode, sampler plan) comes from its family adapter; the runner knows no family.

All CUDA work runs on the runner's device: the engine core's loop thread calls `bind_thread()` first, start-up
work runs under `on_device()`, and events are recorded on that device's current stream. Per step the host
fills one pinned coefficient table (double-buffered, guarded by an event) and issues async copies: no allocation
on the device and no synchronisation on the replay path. In graph mode each kind (step, text, vae) replays a CUDA
graph where the runner covers the shape (rows padded to the bucket), eagerly otherwise, with identical results.
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Any, Sequence

import numpy as np
import torch

from ..config import CompileConfig, GraphConfig, bucket_table
from ..features.base import Admission
from ..features.capability import Capabilities, ModelCapabilities
from ..features.program import StepProgram, VariantKey, layout
from ..graphs.compiled import Compiled, open_cache, save_artifacts_if_new
from ..graphs.step import StepBuffers, whole_step
from ..models.families.base import Conditioning, concat
from ..models.model import DiffusionModel
from ..models.circular import circular
from ..request import MAX_PROMPT_CHUNKS, GenerationRequest, GroupKey, ParamError, Size, tiling_refusal
from ..sampling.samplers import PlanOptions, SamplerPlan, start_plan
from .control_graphs import ControlRunner
from .controlnets import ControlNets
from .ip_adapters import IPAdapters
from .graph_setup import (GraphSet, add_step_graph, add_step_group, add_tiling_graphs, decode_chunks, make_graphs,
                          tiling_kind, vae_buckets)
from ..text.embeddings import EmbeddingDir
from ..text.prepared import PromptInputs, PromptText, TextSetup, plain_ids
from .prompt_rows import PromptEncoder, pad_pair
from .prompts import DEFAULT_CACHE_BYTES, PromptCache, PromptKey
from .staging import DecodedPixels, StagingPair
from .variation import initial_noise

WEIGHT_KINDS = ("step", "text", "vae")  # the graph kinds, each bound to the weights of one part of the model


class ModelRunner:
    def __init__(self, model: DiffusionModel, mode: str = "eager", graphs: GraphConfig | None = None,
                 max_rows: int | None = None, prompt_cache_size: int = 512,
                 prompt_cache_bytes: int = DEFAULT_CACHE_BYTES, loras: Any = None,
                 compile: CompileConfig | None = None, max_prompt_chunks: int = 3, embeddings: EmbeddingDir | None = None,
                 controls: ControlNets | None = None, image_prompts: IPAdapters | None = None,
                 capabilities: ModelCapabilities | None = None):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} is unknown; allowed: graph, eager")
        self.model = model
        self.adapter = model.adapter
        self.cuda = model.device.type == "cuda"
        # an explicit index: the loop thread binds this device, and "cuda" alone would mean whatever is current
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.cuda and model.device.index is None else model.device)
        self.graph_config = _row_buckets(graphs or GraphConfig(), mode, max_rows)
        self.max_rows = max_rows or self.graph_config.max_bucket
        self._fits = bucket_table(self.graph_config.batch_buckets)  # a step's bucket by its denoiser rows
        self._planner = self.adapter.plans(model)  # the model's, shared with the family's features
        # the eager callable; the graphs capture their own (a compiled one may take its place there, never here)
        self.denoise_eager = partial(self.adapter.denoise, model)
        # a tiling group's calls (models/circular.py): the denoiser's and the VAE's convolutions padding circularly,
        # never compiled
        self.denoise_tiling = circular(self.denoise_eager, lambda: self.model.denoiser)
        self.decode_tiling = circular(self.decode_pixels, lambda: self.decoder)
        self.encode_tiling = circular(self.encode_pixels_eager, lambda: self.decoder)
        self.weights_version = dict.fromkeys(WEIGHT_KINDS, 0)
        self.groups: dict[GroupKey, StepBuffers] = {}
        self.staging: dict[GroupKey, StagingPair] = {}
        # the family's per-size row fields, on the device, by (group, size); (group, None): the allocation's
        self._row_values: dict[tuple[GroupKey, Size | None], dict[str, torch.Tensor]] = {}
        self._latent_shapes: dict[GroupKey, tuple[int, ...]] = {}  # tiny tuples, one per group ever asked for
        self._image_shapes: dict[Size, tuple[int, ...]] = {}  # and per image size
        self._packs = self.adapter.packs(model)  # step rows are packed image latents (several sizes to a group)
        self.prompts = PromptCache(prompt_cache_size, prompt_cache_bytes)
        self.loras, self.controls, self.image_prompts = loras, controls, image_prompts  # (LoRA, ControlNet, IP) or None
        slots = loras is not None and loras.enabled
        self.slot_shape = (loras.config.slots, loras.config.max_lora_rank, int(loras.config.conv)) if slots else None
        # the row features of this family's step (guidance, edits, LoRA rows, ...), composed
        if not 1 <= max_prompt_chunks <= MAX_PROMPT_CHUNKS:
            raise ValueError(f"max_prompt_chunks {max_prompt_chunks} is out of range; allowed: 1..{MAX_PROMPT_CHUNKS} "
                             "(75 tokens each)")
        self.max_chunks = self.adapter.max_chunks(model, max_prompt_chunks)
        self.text_setup = TextSetup(tuple(model.tokenizers), self.adapter.embedding_dims(model), self.max_chunks,
                                    self.adapter.encoder_layers(model), embeddings,
                                    lengths=tuple(self.adapter.token_lengths(model)),
                                    template=self.adapter.prompt_template(model),
                                    dropped=self.adapter.template_dropped)
        side_paths = loras.unet_rows if slots else None
        self.control_runner = ControlRunner(controls, partial(self.adapter.control, model)) if controls else None
        extra = {"max_chunks": self.max_chunks, "controls": self.control_runner, "image_prompts": image_prompts} \
            if self.max_chunks > 1 or controls or image_prompts else {}
        # the registered capabilities the model has (features/capability.py): their row features after the family's
        self.capabilities = capabilities if capabilities is not None else Capabilities().for_model(model, {})
        self.program = StepProgram(self.adapter.features(model, side_paths, **extra)
                                   + self.capabilities.features(model))
        self.extra_channels = self.adapter.extra_channels(model)  # 5 for a 9-channel inpainting UNet, else 0
        self._eager_step = whole_step   # graph mode's fallback never runs compiled code
        self.graphs: GraphSet | None = None
        self.decode_buckets = vae_buckets(self.graph_config)  # the VAE replays a decode is cut into (decode_chunks)
        self._graphed: tuple[GroupKey, ...] = ()  # the resolutions the step graphs cover
        self.text_encoder = PromptEncoder(model, self.device, self.graph_config.batch_buckets,
                                          loras.text_rows if slots else None, self.text_setup.lock)
        self._window = self.adapter.token_lengths(model)[0] if model.tokenizers else 0  # a prompt window's tokens
        self.compiled: list[Compiled] = []  # the compile tier's callables (compile=...)
        self.compile_folder: str | None = None  # and their cache folder
        with self.on_device():
            self.decoder = self.adapter.decoder(model)
            if mode == "graph":
                self.graphs = self.text_encoder.graphs = make_graphs(self, compile)
                self._graphed = tuple(self.graphs.runner.kinds["step"].resolutions())
                if self.control_runner is not None:  # with compile, its compiled ControlNet joins the set's
                    self.graphs.compiled += self.control_runner.attach(
                        self.graphs.runner, self._graphed, self.graph_config.batch_buckets, compile)
                self.compiled, self.compile_folder = self.graphs.compiled, self.graphs.compile_folder
            elif compile is not None:  # eager mode (the CPU): the step itself runs compiled, shapes as they come
                self.compile_folder = open_cache(compile, model, self.device)
                self._eager_step = Compiled(whole_step, compile, "the whole step", dynamic=None)
                self.compiled = [self._eager_step]

    # -- device, lifetime ------------------------------------------------------------------------
    def on_device(self):  # a context in which CUDA calls go to this runner's device (nothing happens on the CPU)
        return torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()

    def bind_thread(self) -> None:  # makes the runner's device the calling thread's current one (the engine loop's)
        if self.cuda:
            torch.cuda.set_device(self.device)

    def prewarm(self) -> None:
        if self.graph_runner is not None:
            with self.on_device():
                for key in self.graph_runner.kinds["step"].resolutions():
                    self.buffers(key)
                self.graph_runner.prewarm(self.group_keys)  # a listed size's step graphs are its groups'
                if self.compiled and self.graph_config.prewarm is not True:  # never compile while serving
                    self.graph_runner.warm_pending()
            # what a copy of the cache folder needs to start warm (precompiled versions are their own files)
            if any(c.compiles and c.precompile_dir is None for c in self.compiled):
                save_artifacts_if_new(self.compile_folder)

    def invalidate(self, kind: str | None = None) -> None:
        """The weights (or modules) of `kind` ("step" = the denoiser, "text", "vae"; None = all) were changed:
        bump their version (text: old prompt embeddings are no longer used) and drop their graphs. Between
        steps only (the engine core runs it on its loop thread)."""
        kinds = WEIGHT_KINDS if kind is None else (kind,)
        for k in kinds:
            if k not in self.weights_version:
                raise ValueError(f"weights kind {k!r} is unknown; allowed: {', '.join(WEIGHT_KINDS)}")
            self.weights_version[k] += 1
        if "vae" in kinds:
            with self.on_device():
                self.decoder = self.adapter.decoder(self.model)
            if self.graphs is not None and self.graphs.decoder_form is not None:
                self.graphs.decoder_form(self.decoder)
        if "step" in kinds and self.graphs is not None and self.graphs.denoiser_form is not None:
            self.graphs.denoiser_form(self.model.denoiser)  # a replaced UNet's (in place: idempotent)
        if self.graph_runner is not None:
            steps = [*self.program.variants()[1:], *self.graphs.added_keys]
            extra = (("vae_encode",) if "vae" in kinds else ()) + (
                tuple(self.program.kind(v) for v in steps) if "step" in kinds else ())
            dropped = kinds + extra
            dropped += tuple(tiling_kind(k) for k in dropped if tiling_kind(k) in self.graph_runner.kinds)
            for k in dropped:
                self.graph_runner.invalidate(k)

    @property
    def graph_runner(self):
        return None if self.graphs is None else self.graphs.runner

    @property
    def encoder(self) -> Any:  # the VAE module an edit's image is encoded with (the decoder, in the decode dtype)
        return self.decoder

    def graph_table(self) -> list[dict[str, Any]]:
        return [] if self.graph_runner is None else self.graph_runner.table()

    def graphed_resolutions(self) -> tuple[GroupKey, ...]:
        return self._graphed

    # -- shapes and buffers --------------------------------------------------------------------
    def group_key(self, size: Size, prompts: tuple[PromptText, ...] = (),
                  prepared: dict[str, Any] | None = None, tiling: bool = False) -> GroupKey:
        """The group rows of an image `size` with `prompts` (prepared) and its capabilities' preparations
        (`prepared`) run in: the family's (a transformer's token bucket and text slot) where its step rows pack
        image latents; else the size itself (unpacked latents of two sizes cannot share buffers), or with `tiling`
        the family's tiling group of the size."""
        if not self._packs and not tiling:
            return size
        tokens = max((len(window) for p in prompts for window in (p.ids[0] if p.ids else ())), default=0)
        tokens = max(tokens - self.adapter.template_dropped, 1) if tokens else 0  # the tokens a row holds
        # `tiling` only where asked: a family's own group_key written without it keeps working for every other row
        return self.adapter.group_key(self.model, size, tokens, prepared, **({"tiling": True} if tiling else {}))

    def group_keys(self, size: Size) -> tuple[GroupKey, ...]:
        """Every group rows of an image `size` may run in (the graphs' groups), and those of the graph config's
        reference slots (`reference_slots`: the family refuses them where it reads no references)."""
        keys = self.adapter.group_keys(self.model, size) if self._packs else (size,)
        slots = self.graph_config.reference_slots
        return keys + tuple(self.adapter.reference_group(k, s) for k in keys for s in slots)

    def image_latent_shape(self, size: Size) -> tuple[int, ...]:
        """The VAE's latents of one image of `size` (what the decoder reads)."""
        if (shape := self._image_shapes.get(size)) is None:
            shape = self._image_shapes[size] = self.adapter.image_latent_shape(self.model, size)
        return shape

    def image_latents(self, rows: torch.Tensor, key: GroupKey, size: Size) -> torch.Tensor:
        """Step rows of group `key` that are images of `size` -> their image latents (the family's `unpack`). Whether
        rows are packed is the family's (`packs`): a token group's key (reference tokens, image tokens) can equal a
        size in numbers."""
        return self.adapter.unpack(self.model, rows, size, key) if self._packs else rows

    def graphed_sizes(self) -> tuple[Size, ...]:
        """The image sizes the graphs are made for (the decoder's; the step's are their groups)."""
        return self.graph_config.resolutions or ((self.model.native_size, self.model.native_size),)

    def latent_shape(self, key: GroupKey) -> tuple[int, ...]:
        if (shape := self._latent_shapes.get(key)) is None:
            shape = self._latent_shapes[key] = self.adapter.latent_shape(self.model, key[:2])
        return shape

    def plan_for(self, sampler: str, schedule: str, steps: int, key: GroupKey,
                 options: PlanOptions | None = None) -> SamplerPlan:
        """The family's sampler plan at a resolution (its planner may depend on it: a flow model's time shift)."""
        if options is not None and not self.adapter.plan_options:
            raise ParamError("eta" if options.eta is not None else "timestep_spacing", f"model family "
                             f"{self.adapter.name!r} takes no eta or timestep_spacing; leave them out")
        return self._planner(sampler, schedule, steps, key, *(() if options is None else (options,)))

    def plan(self, sampler: str, schedule: str, steps: int, key: GroupKey, options: PlanOptions | None = None
             ) -> SamplerPlan:
        """The sampler plan of a request; a step count or sampler the model cannot take is a ParamError."""
        try:
            return self.plan_for(sampler, schedule, steps, key, options)
        except ParamError:  # the family named the parameter itself
            raise
        except ValueError as e:
            raise ParamError("num_inference_steps", f"num_inference_steps {steps} does not work with sampler "
                                                    f"{sampler!r} and schedule {schedule!r} on this model: {e}") from None

    def request_plan(self, request: GenerationRequest) -> SamplerPlan:
        """The plan a request's rows walk (all of it, or from the step an edit's strength starts at), with the row
        features' per-step columns in its coefficient table and its denoiser rows per step (`branches`)."""
        options = None if request.timestep_spacing is None and request.eta is None else \
            PlanOptions(request.timestep_spacing, request.eta)
        plan = self.plan(request.sampler, request.schedule, request.num_inference_steps, request.key, options)
        if request.schedule_shift is not None:  # (its names, steps and options checked by the plan above)
            plan = self._shifted_plan(request)
        start = self._start(request)
        if request.tiling:
            self._check_tiling()
        plan = start_plan(plan, start) if start else plan
        return self.program.request_plan(request, plan)

    def _shifted_plan(self, request: GenerationRequest) -> SamplerPlan:
        """The plan of a request with its own `schedule_shift` (a flow family's: `FamilyAdapter.shifted_plan`)."""
        try:
            return self.adapter.shifted_plan(self.model, request.sampler, request.schedule,
                                             request.num_inference_steps, request.key, request.schedule_shift)
        except ParamError:
            raise
        except ValueError as e:
            raise ParamError("num_inference_steps", f"num_inference_steps {request.num_inference_steps} does not "
                                                    f"work with schedule_shift on this model: {e}") from None

    def _check_tiling(self) -> None:
        """ParamError naming `tiling` where this engine cannot pad every convolution circularly."""
        if not self.adapter.supports_tiling:
            raise ParamError("tiling", tiling_refusal(self.adapter.name))
        if self.slot_shape is not None and self.slot_shape[2]:
            raise ParamError("tiling", "tiling is not supported with convolution LoRA side paths (the LoRA conv "
                                       "option pads them with zeros); start the engine without it, or send tiling false")

    def _start(self, request: GenerationRequest) -> int:
        """The step of the full schedule a request's rows start at (an edit's strength rule; else 0)."""
        if request.edit is None:
            return 0
        if not self.adapter.supports_edits:
            raise ParamError("image", f"model family {self.adapter.name!r} takes no image inputs; send a "
                                      "text-to-image request")
        if request.edit.inpaint and self.adapter.packs(self.model):  # its blend works on image latents
            raise ParamError("mask", f"model family {self.adapter.name!r} takes no inpainting mask; send the image "
                                     "alone (image-to-image)")
        latents = request.edit.latents
        if latents is not None and latents.shape != (shape := self.adapter.image_latent_shape(self.model, request.key)):
            raise ParamError("latents", f"latents of shape {latents.shape} do not fit a {request.width}x"
                                        f"{request.height} image on this model, whose latents are {shape}")
        return request.num_inference_steps - request.denoising_steps

    def buffers(self, key: GroupKey) -> StepBuffers:
        """The static buffers of a resolution group, allocated once at max_rows."""
        buf = self.groups.get(key)
        if buf is None:
            self._cover(key[:2])
            m = self.model
            buf = StepBuffers.allocate(self.max_rows, self.latent_shape(key), self.program,
                                       self.adapter.row_cond_spec(m, self.max_chunks), self._row_fields(key, None),
                                       m.dtype,
                                       self.device, self.adapter.sequence_fields)
            self.groups[key] = buf
        return buf

    def _cover(self, group: GroupKey) -> None:
        """Step graphs for a new group that the family puts under a graphed one (`graph_group`: a graphed size's
        reference slots), captured on first use; its buffers then live as the graphed groups' do."""
        if self.graphs is not None and group not in self._graphed and \
                (base := self.adapter.graph_group(group)) != group and base in self._graphed:
            add_step_group(self.graphs, group)
            self._graphed += (group,)

    def _row_fields(self, key: GroupKey, size: Size | None) -> dict[str, torch.Tensor]:
        """The family's per-size row fields (SDXL's time ids, a transformer's positions), made once per (group,
        size): building them is a host-to-device copy, which must not happen (and wait for the GPU) at every
        admission. `size` None: the allocation's (any size of the group)."""
        if (values := self._row_values.get((key, size))) is None:
            values = self._row_values[key, size] = self.adapter.row_spec(self.model, key[:2], size)
        return values

    def release_group(self, key: GroupKey) -> None:
        """Frees an idle group's buffers, unless graphs were captured over them (covered resolutions)."""
        if key[:2] in self.graphed_resolutions():  # a tiling group's too: its graphs are over its buffers
            return
        self.groups.pop(key, None)
        self.staging.pop(key, None)
        for k in [k for k in self._row_values if k[0] == key]:
            del self._row_values[k]

    def _record_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device from pinned memory, asynchronously (a pageable copy would wait for the GPU queue)."""
        return t if not self.cuda or t.is_cuda else t.pin_memory().to(self.device, non_blocking=True)

    # -- encode --------------------------------------------------------------------------------
    def prompt_inputs(self, prepared: dict[str, Any]) -> PromptInputs | None:
        """What the family's encoder reads beside a request's prompts, from its capabilities' preparations."""
        return self.adapter.prompt_inputs(self.model, prepared) if prepared else None

    def encode_texts(self, texts: list[str]) -> Conditioning:
        """Plain prompts (diffusers' reading) -> their conditioning as one batch (tools and tests)."""
        return concat(self.text_encoder.encode([PromptText(t, ids=plain_ids(self.text_setup, t)) for t in texts]))

    def row_conditioning(self, cond: Conditioning, uncond: Conditioning, empty: Conditioning | None,
                         windows: int = 0) -> tuple[Conditioning, Conditioning, int]:
        """A row's two conditionings at equal length ("pad conds"; at least `windows` windows), and the windows it
        uses (engine/prompt_rows.py; the buffers write them repeated: features/context.py)."""
        return pad_pair(self.adapter.sequence_fields, self._window, cond, uncond, empty, windows)

    def conditioning_values(self, key: GroupKey, cond: Conditioning, uncond: Conditioning,
                            empty: Conditioning | None, windows: int) -> dict[str, torch.Tensor]:
        """A row's conditioning fields for another text of its prompt schedule (`update_rows` writes them between
        steps): both conditionings at `windows` windows, the negative one where a feature reads it."""
        cond, uncond, _ = self.row_conditioning(cond, uncond, empty, windows)
        buf = self.buffers(key)
        values = {f"cond.{name}": cond[name] for name in buf.cond_names}
        values.update({f"uncond.{name}": v for name, v in uncond.items() if f"uncond.{name}" in buf.writable})
        return values

    def update_rows(self, key: GroupKey, start: int, count: int, values: dict[str, torch.Tensor]) -> None:
        """Rewrites some fields of live rows [start, start+count) between steps (device copies: no wait)."""
        self.buffers(key).update(slice(start, start + count), values)

    def embed(self, keys: list[PromptKey]) -> dict[PromptKey, Conditioning]:
        """Conditioning of every (sign, prompt, text adapters) (prompts.PromptCache), under the text encoders'
        weights version, encoded by engine/prompt_rows.py's `PromptEncoder`."""
        return self.prompts.embed(keys, self.weights_version["text"], self.text_encoder.encode_with,
                                  partial(self.adapter.negative, self.model))

    # -- rows ----------------------------------------------------------------------------------
    def draw(self, rows: int, key: GroupKey, size: Size, generator: torch.Generator) -> torch.Tensor:
        """Normal draws from a request's generator in its image latents' shape (diffusers' order), as step rows."""
        latents = torch.randn((rows, *self.image_latent_shape(size)), generator=generator, dtype=self.model.dtype)
        return self.adapter.pack(self.model, latents, size, key) if self._packs else latents

    def initial_latents(self, rows: int, key: GroupKey, generator: torch.Generator, sigma: float,
                        size: Size | None = None, request: GenerationRequest | None = None) -> torch.Tensor:
        """The first draw from a request's generator (diffusers' order), scaled to the plan's first sigma; a
        `request` with a variation seed varies it (engine/variation.py)."""
        size = key[:2] if size is None else size
        if request is None or request.variation is None:
            return self.draw(rows, key, size, generator).float() * sigma
        latents = initial_noise(request, generator, rows, self.image_latent_shape(size), self.model.dtype, size)
        return (self.adapter.pack(self.model, latents, size, key) if self._packs else latents).float() * sigma

    def write_rows(self, key: GroupKey, start: int, admission: Admission,
                   prompts: tuple[Conditioning, Conditioning, Conditioning | None],
                   latents: torch.Tensor | None = None, generator: torch.Generator | None = None,
                   sigma: float | None = None, size: Size | None = None, windows: int = 0) -> tuple:
        """Fills rows [start, start+k) of an admitted request: its initial latents (an edit's `latents`, else the
        first draw from its `generator` at its plan's first `sigma`), its prompt's conditioning (broadcast) and, by
        each row feature, its negative prompt's at the same length (`prompts`: both and the empty prompt that pads
        the shorter: `row_conditioning`), its image size's row values (`size`; None: the key is its size) and the
        rest of its fields (neutral where it does not use them); `windows`: the prompt windows its conditioning is
        written at, at least (a prompt schedule's longest); returns the request's parts of the step variant key."""
        if latents is None:
            if generator is None or sigma is None:
                raise ValueError("write_rows draws the first latents from the request's generator at its plan's "
                                 "first sigma: pass both, or the latents")
            latents = self.initial_latents(admission.rows, key, generator, sigma, size, admission.request)
        cond, uncond, chunks = self.row_conditioning(*prompts, windows)
        admission = dataclasses.replace(admission, uncond=uncond, chunks=chunks, group=key)
        buf = self.buffers(key)
        k = latents.shape[0]
        rows = slice(start, start + k)
        buf.x[rows] = self.to_device(latents.float())
        buf.d_prev[rows] = 0
        buf.noise[rows] = 0
        buf.coefs[rows] = 0
        values = {f"cond.{name}": cond[name] for name in buf.cond_names}
        values.update({f"rows.{name}": value for name, value in self._row_fields(key, size or key[:2]).items()})
        # the features' host tensors go through pinned memory, asynchronously (a pageable copy would wait for the GPU)
        values.update({n: self.to_device(v) if isinstance(v, torch.Tensor) else v
                       for n, v in self.program.rows(admission).items()})
        buf.write(rows, values)
        return self.program.parts(admission)

    def step(self, key: GroupKey, coefs: np.ndarray, rows: list[tuple[int, int, int]],
             noise: list[tuple[int, int, Any]] | None = None, variant: VariantKey | None = None,
             parts: Sequence[tuple] | None = None) -> int:
        """Runs one step. coefs: [n, columns] for image rows [0, n); rows: (first row, rows, denoiser rows per row
        this step) of each live request, packed from row 0; noise: (first row, rows, its generator or a callable
        giving its noise[, its image size]) of the requests whose row draws noise this step; variant: the step variant (None: the
        neutral one); parts: the live requests' variant parts (a prepass gathers rows by them). Returns the
        denoiser rows the step cost: its graph bucket when replayed, else its denoiser rows."""
        buf = self.buffers(key)
        n, d = coefs.shape[0], sum(k * b for _, k, b in rows)  # denoiser rows: a guiding row costs two
        variant = self.program.neutral() if variant is None else variant
        # host refinements of the key from this step's numbers (the step cache's deep rows per branch): a key the
        # graphs do not have yet gets its own, captured on first use; a part no graph can hold runs the step eagerly
        variant = self.program.step_key(variant, coefs, layout(rows, d), d)
        eager = self.program.eager(variant)
        kind = self.program.kinds.get(variant)
        if kind is None:
            kind = self.program.kind(variant) if self.graphs is None or eager else \
                add_step_graph(self, self.graphs, variant)
        tiling = len(key) > 2
        if tiling and self.graphs is not None:  # its own graphs, over its own buffers
            kind = self._tiling_graphs(kind)
        # the bucket a replay would take: its inputs are written first, since a graph captured on first use (in
        # GraphRunner.bucket) warms up on them, and stale denoiser-row indices would read past the rows
        graphed = self.graph_runner is not None and key[:2] in self.graphed_resolutions() and not eager
        planned = self._fits[d] if graphed and d < len(self._fits) else None
        size = planned or d
        pair = self.staging.get(key)
        if pair is None:
            pair = self.staging[key] = StagingPair(self.max_rows, self.program.num_columns, self.latent_shape(key),
                                                    pin=self.cuda)
        slot = pair.next()
        slot.coefs[:n].numpy()[:] = coefs
        slot.index[:size].numpy()[:] = layout(rows, size)
        if size > n:  # padding rows: zero state and coefficients keep them at x = 0, finite
            slot.coefs[n:size] = 0
            buf.x[n:size], buf.d_prev[n:size] = 0, 0
        image_rows = max(size, n)
        buf.coefs[:image_rows].copy_(slot.coefs[:image_rows], non_blocking=True)
        buf.index[:size].copy_(slot.index[:size], non_blocking=True)
        for first, k, source, *size in noise or ():  # a generator's normal draws, or a Brownian tree's increment
            slot.noise[first:first + k].copy_(source() if callable(source) else self.draw(
                k, key, size[0] if size else key[:2], source))
            buf.noise[first:first + k].copy_(slot.noise[first:first + k], non_blocking=True)
        bucket = self.graph_runner.bucket(kind, key[0], key[1], d) if self.graph_runner is not None and not eager \
            else None
        if self.cuda:
            slot.event = self._record_event()
        if self.controls is not None:  # the ControlNets' residuals (features/control.py), outside the step's graph
            self.program.prepass(buf.fields, buf.cond_names, buf.row_names, buf.dtype, n, bucket or d, variant,
                                 None if parts is None else [(k, b, p) for (_, k, b), p in zip(rows, parts)])
        if bucket is not None:
            self.graph_runner.replay(kind, key[0], key[1], bucket)
            return bucket
        with torch.no_grad():
            if tiling:
                whole_step(self.program, self.denoise_tiling, buf, n, d, variant)
            else:
                step_buf = buf.head(buf.num_rows, None, self.program.unread(variant))  # (what it compiles)
                (whole_step if eager else self._eager_step)(self.program, self.denoise_eager, step_buf, n, d, variant)
        return d

    def _tiling_graphs(self, kind: str) -> str:
        """The tiling graph kind of `kind`, its graphs registered at a tiling group's first use (graph_setup.py)."""
        add_tiling_graphs(self, self.graphs)
        return tiling_kind(kind)

    def read_latents(self, key: GroupKey, start: int, count: int) -> torch.Tensor:
        return self.buffers(key).x[start:start + count].clone()

    def move_rows(self, key: GroupKey, src: int, dst: int, count: int) -> None:
        self.buffers(key).move_rows(src, dst, count)

    # -- encode (edits) and decode -----------------------------------------------------------------
    def encode_pixels_eager(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.adapter.encode_pixels(self.model, self.decoder, pixels)

    @torch.no_grad()
    def encode_pixels(self, key: Size, pixels: torch.Tensor, tiling: bool = False) -> torch.Tensor:
        """Pixels [n, 3, H, W] in [-1, 1] (host) of an image size `key` -> the VAE posterior's parameters
        [n, 2C, h, w] on the device, through the encoder graph where it covers (resolution, n); without waiting for
        the GPU. `tiling`: its convolutions padding circularly (a tiling group's edit)."""
        pixels = self.to_device(pixels.to(self.model.vae_dtype))
        runner, n = self.graph_runner, pixels.shape[0]
        if tiling and self.graphs is not None:
            self._tiling_graphs("vae_encode")
        graph = None if self.graphs is None else self.graphs.encode_tiling if tiling else self.graphs.encode
        bucket = runner.bucket(graph.kind, key[0], key[1], n) if graph is not None else None
        if bucket is None:
            return (self.encode_tiling if tiling else self.encode_pixels_eager)(pixels)
        graph.write(key[0], key[1], pixels, bucket)
        return runner.replay(graph.kind, key[0], key[1], bucket)[:n].clone()

    def decode_pixels(self, latents: torch.Tensor) -> torch.Tensor:
        return self.adapter.decode(self.model, self.decoder, latents)

    @torch.no_grad()
    def decode_async(self, key: GroupKey, latents: torch.Tensor, size: Size | None = None) -> DecodedPixels:
        """Enqueues the decode of step rows of group `key` that are images of one `size` (None: the key is the size),
        chunk by chunk, each chunk's float32 pixels copied to pinned host memory after it;
        returns them as float pixels [n, H, W, 3] in [0, 1] (as diffusers' VaeImageProcessor, output_type='np')
        whose reader waits only for the chunks it reads. The engine loop does not wait: the image threads do."""
        tiling = len(key) > 2  # a tiling group: its own decoder graphs, its convolutions padding circularly
        if size is not None and self._packs:  # a family that packs: its rows back to image latents, then by size
            latents, key = self.image_latents(latents.to(self.device), key, size), size
        latents = latents.to(self.device)
        runner = self.graph_runner
        if tiling and runner is not None:
            self._tiling_graphs("vae")
        graph = None if runner is None else self.graphs.vae_tiling if tiling else self.graphs.vae
        n_total = latents.shape[0]
        chunks = decode_chunks(n_total, self.decode_buckets) if runner is not None else [n_total]  # none padded
        host, chunks_in, start = None, [], 0  # chunks_in: (end row, the event after its copy; None on the CPU)
        for n in chunks:
            part = latents[start:start + n]
            bucket = runner.bucket(graph.kind, key[0], key[1], n) if graph is not None else None
            if bucket is None:
                image = (self.decode_tiling if tiling else self.decode_pixels)(part)
            else:
                graph.write(key[0], key[1], part, bucket)
                image = runner.replay(graph.kind, key[0], key[1], bucket)[:n]
            image = image.permute(0, 2, 3, 1)  # on CUDA made float32 there: no CPU-wide conversion beside the loop
            image = image.to(torch.float32, memory_format=torch.contiguous_format) if self.cuda else image
            if host is None:
                host = torch.empty((n_total, *image.shape[1:]), dtype=torch.float32, pin_memory=self.cuda)
            host[start:start + n].copy_(image, non_blocking=self.cuda)  # consumed before any later replay
            start += n
            chunks_in.append((start, self._record_event() if self.cuda else None))
        return DecodedPixels(host, chunks_in, self.on_device)

    def decode(self, key: GroupKey, latents: torch.Tensor, size: Size | None = None) -> np.ndarray:
        """Latents -> float pixels [n, H, W, 3] in [0, 1], waiting for them."""
        return self.decode_async(key, latents, size)()


def _row_buckets(config: GraphConfig, mode: str, max_rows: int | None) -> GraphConfig:
    """The graph config whose buckets hold at most `max_rows`: the most live rows of a group are the largest batch
    bucket in graph mode (never more, so a step always fits a graph), max_rows (default: the same) in eager mode."""
    if mode != "graph" or max_rows is None or max_rows == config.max_bucket:
        return config
    if max_rows > config.max_bucket:
        raise ValueError(f"max_rows {max_rows} is above the largest batch bucket {config.max_bucket}; "
                         "add a larger bucket to batch_buckets instead")
    if max_rows not in config.batch_buckets:
        raise ValueError(f"max_rows {max_rows} is not a batch bucket "
                         f"({','.join(map(str, config.batch_buckets))}); use one, or leave it out")
    # the buffers hold max_rows rows: graphs of larger buckets could not run on them
    return dataclasses.replace(config, batch_buckets=tuple(b for b in config.batch_buckets if b <= max_rows))
