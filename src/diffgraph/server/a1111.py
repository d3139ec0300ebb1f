"""AUTOMATIC1111-compatible routes on `diffgraph serve`: the same port, keys, validation and
errors as the images API, AUTOMATIC1111's request and response shapes (v1.10; webuiapi and the tools built on it).

    POST /sdapi/v1/txt2img, /img2img   images: one engine request per image (seed + i), submitted together; with
                                       enable_hr, each image's second pass as its first ends (a1111_hires.py)
    GET  /sdapi/v1/sd-models           the models (--model, and --model-dir's), AUTOMATIC1111's titles
    GET  /sdapi/v1/samplers, /schedulers, /loras, /embeddings, /scripts
    GET  /sdapi/v1/options             the calling key's options (every AUTOMATIC1111 option); POST sets its model and
                                       clip skip, keeps the others' values (named in X-Diffgraph-Ignored-Fields)
    GET  /sdapi/v1/progress            the calling key's requests (a1111_jobs.py)
    ...  /sdapi/v1/png-info, /memory, /cmd-flags, /refresh-*, ...: a1111_info.py's router
    ...  /sdapi/v1/extra-single-image, /extra-batch-images, /upscalers: a1111_extras.py's router
    POST /sdapi/v1/interrupt, /skip    its oldest request: all of it, or its current image

A body is type-checked and read in diffgraph's words by a1111_protocol.py (unsupported values: a 400 naming the
field; an infotext and the prompts sized before they are parsed, on a worker thread), its images prepared by
a1111_inpaint.py on a worker thread, each image validated (on a worker thread too) by
`GenerationRequest.create` (the one validation) and submitted, watched and aborted through requests.py, on the model
`ModelRouting` answers (override_settings' sd_model_checkpoint, else the key's). Prompts are read in AUTOMATIC1111's
syntax (`(word:1.2)`, `<lora:name:w>`), after the styles the body names (--styles, read at start). Every request
ends in one outcome counted in the metrics. `a1111_router` builds the routes over one `A1111Server`, the state
they share; app.py includes it.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import inspect
import io
import json
import logging
import os
import secrets
import time
from typing import Any, Callable

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from ..image_metadata import JSON_KEY, PNG_KEY, encode_image, infotext, request_json
from ..lora.catalog import AdapterDir, AdapterNameError
from ..models.catalog import ModelNameError
from ..models.clip_vocab import default_cache_root
from ..models.controlnet_dir import ControlNetDir
from ..models.file_hashes import FileHashes
from ..models.presets import builtin_control_folder, builtin_lora_folder
from ..prompt_styles import read_styles
from ..upscaler_models import UpscalerModels
from ..upscalers import TileGrid, UpscalerError, combine_tiles
from ..request import MAX_CONTROLS, MAX_IMAGES, GenerationRequest, GenerationResult, ModelInfo, ParamError, ProgressEvent
from .a1111_controlnet import (controlnet_units, detected_maps, ignored_keys, module_list, saves_map,
                               units_to_controls)
from .a1111_detect import analysis_router
from .a1111_hires import HiresPlan, HiresRuns, first_passes, hires_image, hires_plan, hires_template
from .a1111_extras import extras_router
from .a1111_info import InfoSources, info_router
from .a1111_inpaint import PreparedEdit, flatten, mask_options, prepare
from .a1111_jobs import ImageRun, JobBoard, Key
from .a1111_scripts import SdUpscale, script_lists, sd_upscale, tile_seeds
from .a1111_protocol import (DEFAULT_OPTIONS, IGNORED_HEADER, MAX_IGNORED_NAMES, OPTIONS, Img2ImgBody, Plan,
                             TextToImageResponse, Txt2ImgBody, ProcessingBody, a1111_error, a1111_field, clip_stop,
                             fit_to_model, ignored_header, info_json, model_name, names_header, plan_body,
                             sampler_items, sampler_schedule, scheduler_items, request_option, REQUEST_OPTIONS,
                             UI_OPTIONS, ui_option, validate)
from .auth import caller_key
from .bodies import read_body
from .context import AppContext, error_response
from .models import Target
from .pages import embedding_listing, lora_listing
from ..api.protocol import APIError
from .requests import ClientGone, abort, outcome, results, submit
from ..api.protocol import decode_b64

MAX_INIT_IMAGES = 4
MODEL_FIELD = "override_settings.sd_model_checkpoint"

logger = logging.getLogger(__name__)


async def _answer(work: Callable[[], Any]) -> Response:
    """`work()`'s value (awaited when it is awaitable) as JSON, or its APIError."""
    try:
        value = work()
        return JSONResponse(await value if inspect.isawaitable(value) else value)
    except APIError as e:
        return error_response(e)


def _edits_per_image(count: int, body: ProcessingBody, edits: list[PreparedEdit]) -> list[PreparedEdit]:
    """The init image of each of `count` images: the one given, or the one at its place in the batch."""
    return [edits[index % (body.batch_size or 1) % len(edits)] for index in range(count)] if edits else []


class A1111Server:
    """What AUTOMATIC1111's routes share: the server state, the model routing, each key's requests and options
    (`JobBoard`), the body limits, the ControlNets units may name, the file hashes and the styles (--styles)."""

    def __init__(self, ctx: AppContext):
        self.state, self.routing, self.keys = ctx.state, ctx.routing, ctx.keys
        self.embedding_dir = ctx.embedding_dir
        self.config = config = ctx.state.config
        self.board = JobBoard(lambda handle: abort(ctx.state, handle))
        self.prompt_limit = 8 * config.max_prompt_bytes + 65536  # JSON may escape each byte as \u00XX
        self.image_limit = (MAX_INIT_IMAGES + 1) * 4 * (config.max_image_bytes // 3 + 2)
        roots = tuple(r for r in (config.controlnet_dir, builtin_control_folder(config.model)) if r)
        controlnets = ControlNetDir(*roots) if roots else None  # what ControlNet units may name (a1111_controlnet.py)
        self.served = (lambda: list(controlnets.listing())) if controlnets is not None else list
        self.unit_limit = MAX_CONTROLS * 4 * (config.max_image_bytes // 3 + 2) if controlnets is not None else 0
        self.read_timeout = min(config.body_timeout, config.request_timeout)
        # `Model hash`, `Lora hashes` (models/file_hashes.py): the model set's when there is one (one hashing thread)
        self.hashes = ctx.routing.hashes if ctx.routing is not None else FileHashes(default_cache_root())
        self.styles = read_styles(config.styles) if config.styles else None  # --styles: read once, at start
        # --upscaler-dir's models (extras, hr_upscaler, SD upscale): listed on each look-up, run on worker threads
        self.upscalers = UpscalerModels(config.upscaler_dir) if config.upscaler_dir else None
        default_file = self.checkpoint(None)
        if default_file is not None:  # queued for hashing while the model loads (a restart finds it in its cache)
            self.hashes.get(default_file)

    def checkpoint(self, name: str | None) -> str | None:
        """The checkpoint file of the model `name` (None: the default, --model): None for a folder or a preset."""
        path = self.config.model
        if name is not None and self.routing is not None:
            try:
                entry = self.routing.catalog.resolve(name)
            except ModelNameError:
                return None
            path = entry.path if entry.form == "file" else None
        return path if path and os.path.isfile(path) else None

    def lora_file(self, name: str, model: str) -> str | None:
        """The file of the adapter `name` as the model's engine finds it: --lora-dir's, then the model's built-in."""
        for root in (r for r in (self.config.lora_dir, builtin_lora_folder(model)) if r):
            try:
                return AdapterDir(root).path(name)
            except (AdapterNameError, ValueError):  # not in this folder (a bad name: the engine says why)
                continue
        return None

    def key_of(self, http: Request) -> Key:
        return caller_key(http.scope, self.keys) if self.keys else None

    async def read_json(self, http: Request, limit: int) -> Any:
        try:
            body = await asyncio.wait_for(read_body(http, limit), self.read_timeout)
            return await asyncio.to_thread(json.loads, body)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.read_timeout:g} s; send the whole "
                                "body at once", code="body_timeout") from None
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"the body is not valid JSON ({e}); send a JSON object such as "
                                "{\"prompt\": \"a red fox\"}", code="invalid_json") from None

    async def resolve(self, title: str | None, field: str = MODEL_FIELD) -> str | None:
        """The model a title names (its name; None for the default), or an APIError naming `field`."""
        name, default = model_name(title), self.state.info.name if self.state.info else self.config.model
        if name is None or name in (default, self.config.model):
            return None
        if self.routing is None:
            raise APIError(400, f"model {name!r} is not served here; this server serves {default!r} (GET "
                                "/sdapi/v1/sd-models)", param=field, code="model_not_found")
        try:
            return await self.routing.resolve(name)
        except APIError as e:  # else the model_name GET /sdapi/v1/sd-models lists ("sub_model": sub/model)
            listed = await self.titles() if e.status == 404 else []
            ids = [c["id"] for c in listed if c["id"] != name == c["id"].replace("/", "_")]
            if ids:
                return await self.resolve(ids[0], field)
            e.param = field
            raise

    async def target(self, title: str | None, seconds: float) -> tuple[Target, str | None]:
        """The model a title names, held, and its name (None: the default)."""
        default = Target(self.state.client, self.state.info, None)
        name = await self.resolve(title)
        if name is None or self.routing is None:
            return default, None
        try:
            return await self.routing.target(name, seconds, default), name
        except APIError as e:
            e.param = MODEL_FIELD
            raise

    async def titles(self) -> list[dict[str, Any]]:
        """The models GET /v1/models lists, titled as AUTOMATIC1111 does, but for files unservable as they are."""
        cards = (await asyncio.to_thread(self.routing.listing, self.state.created) if self.routing else
                 [{"id": self.state.info.name if self.state.info else self.config.model, "hash": None}])
        return [{**c, "title": c["id"] + (f" [{c['hash']}]" if c.get("hash") else "")} for c in cards
                if c.get("error_kind") != "file"]  # a model whose load failed stays: a request tries again

    def build(self, body: ProcessingBody, plan: Plan, info: ModelInfo, name: str | None, edits: list[PreparedEdit],
              controls: list[dict[str, Any]], extras: dict[str, Any] | None = None) -> list[GenerationRequest]:
        """One request per image: the first validated by `create` (the one validation; it parses the prompts, which
        plan_body held to --max-prompt-bytes, so this runs on a worker thread), with the short hashes of its model
        (`name`; None: the default) and adapters' files; the others its copies with their own seed and subseed (and
        init image: `edits` holds each image's, or none), checked again on construction."""
        sampler, schedule, eta = sampler_schedule(body, info)
        try:
            first = GenerationRequest.create(plan.prompt, model=info, seed=plan.seeds[0], sampler=sampler,
                                             schedule=schedule, eta=eta, image=edits[0].edit if edits else None,
                                             request_id=f"a1111-{secrets.token_hex(8)}", controls=controls,
                                             extras=extras or None, **plan.create)
            loras = ((n, self.hashes.lora(self.lora_file(n, name or self.config.model))) for n, _ in first.loras)
            first = dataclasses.replace(first, model_hash=self.hashes.model(self.checkpoint(name)),
                                        lora_hashes=tuple((n, h) for n, h in loras if h))
            out = [first]
            for i, seed in enumerate(plan.seeds[1:], 1):
                edit = edits[i] if edits else None
                variation = first.variation and dataclasses.replace(first.variation, subseed=plan.subseeds[i])
                out.append(dataclasses.replace(first, seed=seed, edit=edit.edit if edit else None, variation=variation,
                                               request_id=f"a1111-{secrets.token_hex(8)}"))
        except ParamError as e:
            raise a1111_error(e) from None
        return out

    def prepare_edits(self, body: Img2ImgBody, plan: Plan) -> list[PreparedEdit]:
        """Each image's init image (and the mask), decoded and prepared for the engine (a worker thread)."""
        config = self.config
        images = body.init_images or []
        if not images:
            raise APIError(400, "init_images is required: a list of base64 images (one is used for every image)",
                           param="init_images")
        if len(images) not in (1, body.batch_size or 1) or len(images) > MAX_INIT_IMAGES:
            raise APIError(400, f"init_images has {len(images)} images; send 1 (used for every image) or batch_size "
                                f"of them, at most {MAX_INIT_IMAGES}", param="init_images")
        limits = (config.max_image_bytes, config.max_image_pixels)
        mask = decode_b64("mask", body.mask, *limits) if body.mask else None
        strength = 0.75 if body.denoising_strength is None else body.denoising_strength
        options = mask_options(body)
        return _edits_per_image(len(plan.seeds), body, [
            prepare(decode_b64(f"init_images[{i}]", text, *limits), mask, options, plan.create["width"],
                    plan.create["height"], strength) for i, text in enumerate(images)])

    def prepare_references(self, body: Img2ImgBody, plan: Plan,
                           info: ModelInfo) -> tuple[Plan, list[Image.Image], list[PreparedEdit]]:
        """The init images of a model that reads them all as references (`ModelInfo.edit_images`), decoded (a worker
        thread), and the images' starts: with a denoising_strength below 1 (absent: 1) each image starts from the
        first init image noised to it, as the model's image-to-image pipeline does where the model takes edits, else
        the strength is ignored with a warning; a mask is a 400."""
        images = body.init_images or []
        if not images:
            raise APIError(400, "init_images is required: a list of base64 images (the reference images)",
                           param="init_images")
        if body.mask:
            raise APIError(400, f"model {info.name!r} reads init_images as {info.edit_images} and takes no mask; "
                                "leave mask out", param="mask")
        limits = (self.config.max_image_bytes, self.config.max_image_pixels)
        decoded = [flatten(decode_b64(f"init_images[{i}]", text, *limits)) for i, text in enumerate(images)]
        strength = body.denoising_strength
        if strength in (None, 1, 1.0):
            return plan, decoded, []
        if not info.edits:
            plan = dataclasses.replace(plan, warnings=plan.warnings + (
                f"denoising_strength {strength:g} ignored: model {info.name!r} reads init_images as "
                f"{info.edit_images} and starts from noise",))
            return plan, decoded, []
        start = prepare(decoded[0], None, mask_options(body), plan.create["width"], plan.create["height"], strength)
        return plan, decoded, _edits_per_image(len(plan.seeds), body, [start])

    def prepare_tiles(self, body: Img2ImgBody, plan: Plan,
                      script: SdUpscale) -> tuple[Plan, TileGrid, list[PreparedEdit]]:
        """The SD upscale script's work (a worker thread): its init image upscaled and cut into tiles, one image each
        per pass, with their seeds (a1111_scripts.py); sized before the work starts."""
        config = self.config
        images, width, height = body.init_images or [], plan.create["width"], plan.create["height"]
        if len(images) != 1 or body.mask:
            raise APIError(400, "sd upscale takes one image in init_images and no mask; send the image to upscale "
                                "alone", param="mask" if body.mask else "init_images")
        image = flatten(decode_b64("init_images[0]", images[0], config.max_image_bytes, config.max_image_pixels))
        w, h = script.size(*image.size)
        count = script.tiles(*image.size, width, height) * (body.n_iter or 1)
        if w * h > config.max_image_pixels or count > MAX_IMAGES:
            raise APIError(400, f"sd upscale would make {w}x{h} images of {count} tiles of {width}x{height}; the "
                                f"limits are {config.max_image_pixels} pixels (--max-image-pixels) and {MAX_IMAGES} "
                                "tiles a request: send a smaller scale (script_args[3]), a larger width and height or "
                                "a larger overlap", param="script_args")
        try:
            grid = script.grid(image, width, height, self.upscalers)
        except UpscalerError as e:  # a model upscaler whose file cannot be used
            raise APIError(400, f"script_args[2] (upscaler): {e}", param="script_args") from None
        strength = 0.75 if body.denoising_strength is None else body.denoising_strength
        options = dataclasses.replace(mask_options(body), resize_mode=0)
        tiles = [prepare(tile.image, None, options, width, height, strength) for tile in grid.flat()]
        seeds = tile_seeds(plan.seeds[0], len(tiles), body.batch_size or 1, body.n_iter or 1)
        return dataclasses.replace(plan, seeds=seeds), grid, tiles * (body.n_iter or 1)

    async def wait(self, run: ImageRun, deadline: float, http: Request) -> GenerationResult | None:
        """One image's result; None when /interrupt or /skip dropped it."""
        items = results(self.state, run.handle, deadline, http)
        try:
            async for item in items:
                if isinstance(item, ProgressEvent):
                    run.step, run.total = item.step, item.total
                    run.preview = item.previews[0] if item.previews else run.preview
                    continue
                run.finished = True
                return item
        except APIError as e:
            if run.dropped and e.code == "aborted":
                return None
            raise
        finally:
            await items.aclose()
        return None

    async def run_all(self, runs: list[ImageRun], deadline: float, http: Request,
                      hires: HiresRuns | None = None) -> list[GenerationResult | None]:
        """Each image's result (None: dropped by /interrupt or /skip); with `hires`, its second pass's."""
        tasks = [asyncio.ensure_future(hires.run(run) if hires is not None else self.wait(run, deadline, http))
                 for run in runs]
        try:
            return await asyncio.gather(*tasks)
        finally:  # one failed (or the client left): the others are aborted, not left running
            for task, run in zip(tasks, runs):
                if not task.done():
                    task.cancel()
                if not (run.finished or run.dropped):
                    abort(self.state, run.handle)
            await asyncio.gather(*tasks, return_exceptions=True)

    def upscaled(self, grid: TileGrid, script: SdUpscale, done: list[GenerationResult | None],
                 info: ModelInfo) -> tuple[list[bytes], list[str]]:
        """The SD upscale script's images, one a pass: its tiles' results pasted back (a tile stopped by /interrupt
        or /skip stays black, as AUTOMATIC1111 leaves it), each with its first tile's infotext and the script's
        entries."""
        count, out, texts = len(grid.flat()), [], []
        blank = Image.new("RGB", (grid.tile_w, grid.tile_h))
        for start in range(0, len(done), count):
            tiles = done[start:start + count]
            first = next((r for r in tiles if r is not None), None)
            if first is None:
                continue
            pictures = [Image.open(io.BytesIO(r.encoded[0])).convert("RGB") if r else blank for r in tiles]
            text = infotext(first.request, info.name) + "".join(f", {k}: {v}" for k, v in script.params().items())
            chunks = PngInfo()
            if self.config.metadata:
                chunks.add_text(PNG_KEY, text)
                chunks.add_text(JSON_KEY, request_json(first.request, info.name))
            buffer = io.BytesIO()
            combine_tiles(grid, pictures).save(buffer, format="PNG", pnginfo=chunks)
            out.append(buffer.getvalue())
            texts.append(text)
        return out, texts

    def respond(self, body: ProcessingBody, plan: Plan, info: ModelInfo, requests: list[GenerationRequest],
                done: list[GenerationResult | None], edits: list[PreparedEdit],
                tiled: tuple[SdUpscale, TileGrid] | None = None, hires: HiresPlan | None = None,
                saved: tuple[bool, ...] = ()) -> dict[str, Any]:
        """The answer (a worker thread): each image as the engine encoded it, or laid over its input (inpainting),
        or the SD upscale script's images pasted from their tiles (`tiled`), or the hires fix's second pass with its
        first pass's infotext (`hires`); then the detected maps of the ControlNet units that save theirs (`saved`,
        one flag a unit)."""
        pictures, texts = [], []
        warnings = list(plan.warnings) + sorted({e.warning for e in edits if e.warning})
        for i, result in enumerate(done if tiled is None else ()):
            if result is None:
                continue
            data = result.encoded[0]
            edit = edits[i] if edits else None
            if edit is not None and edit.base is not None:
                pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
                data = encode_image(edit.finish(pixels) / 255.0, "png", result.request, info.name,
                                    self.config.metadata)
            if hires is not None:
                data, text = hires_image(result, requests[i], hires, info.name, self.config.metadata)
            texts.append(text if hires is not None else infotext(result.request, info.name))
            pictures.append(data)
        if tiled is not None:
            pictures, texts = self.upscaled(tiled[1], tiled[0], done, info)
            plan = dataclasses.replace(plan, seeds=tuple(plan.seeds[0] + n for n in range(len(pictures))))
        images = [base64.b64encode(data).decode("ascii") for data in pictures] if body.send_images is not False else []
        if any(saved) and tiled is None and body.send_images is not False:
            sizes = [(hires.fix.width, hires.fix.height)] if hires is not None else []
            images += detected_maps(requests[0].controls, saved, sizes + [(requests[0].width, requests[0].height)])
        dropped = sum(r is None for r in done)
        if dropped:
            warnings.append(f"{dropped} of {len(done)} images were stopped by /sdapi/v1/interrupt or /skip and are "
                            "left out")
        extra: dict[str, Any] = tiled[0].params() if tiled is not None else dict(hires.params) if hires else {}
        if isinstance(body, Img2ImgBody):
            extra["Denoising strength"] = requests[0].edit.strength if requests[0].edit else None
            if body.mask:
                options = mask_options(body)
                extra.update({"Mask blur": max(options.blur_x, options.blur_y)} if options.blur_x or options.blur_y
                             else {})
                extra.update({"Inpaint area": "Only masked", "Masked area padding": options.padding}
                             if options.full_res else {})
        parameters = body.parameters() if isinstance(body, Img2ImgBody) else body.model_dump()
        response = TextToImageResponse(images=images, parameters=parameters, warnings=warnings or None,
                                       info=info_json(body, plan, requests[0], info.name, texts, extra))
        return response.model_dump(exclude=None if warnings else {"warnings"})

    async def images(self, http: Request, model: type[ProcessingBody], kind: str, t0: float,
                     headers: dict[str, str]) -> dict[str, Any]:
        """One txt2img / img2img answer: read, plan, validate every image, submit them, wait, answer (`headers`:
        the answer's own, filled here)."""
        config = self.config
        self.state.accepting()
        key = self.key_of(http)
        limit = self.prompt_limit + self.unit_limit + (self.image_limit if kind == "img2img" else 0)
        body = validate(await self.read_json(http, limit), model)
        units = controlnet_units(body.alwayson_scripts)
        headers.update(ignored_header(body, ignored_keys(units)))
        if headers:
            logger.info("%s: ignored unknown keys %s", http.url.path, headers[IGNORED_HEADER])
        options = self.board.options(key)
        # the infotext and the prompts are user text: sized, then parsed, on a worker thread
        plan = await asyncio.to_thread(plan_body, body, options.model, options.clip_stop, config.clip_skip,
                                       config.max_prompt_bytes, self.styles, options.applied)
        deadline = t0 + config.request_timeout
        chosen, name = await self.target(plan.model, deadline - time.monotonic())
        hires, runs, job = None, None, None
        try:  # the model is held (never evicted) until its requests are queued (with the hires fix: have run)
            plan = fit_to_model(plan, chosen.info)
            if isinstance(body, Txt2ImgBody) and body.enable_hr:
                hires, plan = await asyncio.to_thread(hires_plan, body, plan, chosen.info, self.state.max_pixels,
                                                      self.upscalers)
            references = chosen.info.edit_images if kind == "img2img" else None  # a family reading them all
            if not chosen.info.edits and kind == "img2img" and references is None:
                raise APIError(400, f"model {chosen.info.name!r} takes no image inputs; use /sdapi/v1/txt2img",
                               param="init_images")
            extras: dict[str, Any] = {}
            script = (await asyncio.to_thread(sd_upscale, body.script_name, body.script_args, plan.create["width"],
                                              plan.create["height"], self.upscalers)
                      if isinstance(body, Img2ImgBody) else None)
            tiled = None
            if script is not None:  # the SD upscale script: its tiles are the images
                plan, grid, edits = await asyncio.to_thread(self.prepare_tiles, body, plan, script)
                tiled = (script, grid)
            elif references is not None:  # every init image is a reference (FLUX.2 klein), the first the start
                plan, extras[references], edits = await asyncio.to_thread(self.prepare_references, body, plan,
                                                                          chosen.info)
            else:
                edits = await asyncio.to_thread(self.prepare_edits, body, plan) if kind == "img2img" else []
            init = (getattr(body, "init_images", None) or [None])[0]  # an img2img unit's image by default
            controls = await asyncio.to_thread(units_to_controls, units, self.served, config.max_image_bytes,
                                               config.max_image_pixels, init) if units else []
            requests = await asyncio.to_thread(self.build, body, plan, chosen.info, name, edits, controls, extras)

            async def submit_one(request: GenerationRequest) -> Any:
                try:
                    return await submit(self.state, request, progress=True, client=chosen.client, deadline=deadline,
                                        http=http)
                except APIError as e:  # the engine refused the request (its adapters, its steps): name our field
                    e.param = a1111_field(e.param)
                    raise
            if hires is not None:  # each image's second pass: submitted as its first pass ends (a1111_hires.py)
                template = await asyncio.to_thread(hires_template, lambda b, p: self.build(
                    b, p, chosen.info, name, [], controls, extras), body, plan)
                requests = first_passes(requests, hires)
                runs = HiresRuns(hires, template, submit_one, lambda run: self.wait(run, deadline, http),
                                 lambda handle: abort(self.state, handle), self.upscalers)
            job = await self.board.submit(key, kind, requests, submit_one)
        finally:
            if self.routing is not None and (hires is None or job is None):
                chosen.release(self.routing)
        try:
            done = await self.run_all(job.images, deadline, http, runs)
        finally:
            self.board.end(job)
            if self.routing is not None and hires is not None:
                chosen.release(self.routing)
        return await asyncio.to_thread(self.respond, body, plan, chosen.info, requests, done, edits, tiled, hires,
                                       tuple(saves_map(u) for u in units))

    async def generate(self, http: Request, model: type[ProcessingBody], kind: str) -> Response:
        """`images` with the request's accounting: in flight while it runs, then exactly one outcome."""
        t0 = time.monotonic()
        self.state.inflight += 1
        self.state.metrics.inflight.inc()
        ended = "aborted"  # also when the process exits under the request (cancelled)
        try:
            headers: dict[str, str] = {}
            response = JSONResponse(await self.images(http, model, kind, t0, headers), headers=headers)
            ended = "success"
            return response
        except APIError as e:
            ended = outcome(e)
            return error_response(e)
        except ClientGone:
            return Response(status_code=499)
        finally:
            self.state.metrics.observe_request(ended, time.monotonic() - t0)
            self.state.inflight -= 1
            self.state.metrics.inflight.dec()

    async def current_options(self, key: Key) -> dict[str, Any]:
        options = self.board.options(key)
        name = options.model or (self.state.info.name if self.state.info else self.config.model)
        title = next((c["title"] for c in await self.titles() if c["id"] == name), name)
        return {"sd_model_checkpoint": title, "sd_checkpoint_hash": "",
                "CLIP_stop_at_last_layers": clip_stop(options.clip_stop, "CLIP_stop_at_last_layers",
                                                      self.config.clip_skip),
                **DEFAULT_OPTIONS, **options.applied, **options.ui}

    async def set_options(self, http: Request) -> Response:
        """POST /sdapi/v1/options (its route's doc says what it sets)."""
        try:
            key = self.key_of(http)
            body = await self.read_json(http, self.prompt_limit)
            if not isinstance(body, dict):
                raise APIError(400, "the body must be a JSON object of options, e.g. {\"sd_model_checkpoint\": "
                                    "\"digits\"}")
            current = await self.current_options(key)
            changes = dataclasses.replace(self.board.options(key))
            ignored = []
            for name, value in body.items():
                if name == "sd_model_checkpoint":
                    if not isinstance(value, str):
                        raise APIError(400, "sd_model_checkpoint must be a model title (GET /sdapi/v1/sd-models)",
                                       param=name)
                    changes.model = await self.resolve(value, name)
                elif name == "CLIP_stop_at_last_layers":
                    changes.clip_stop = clip_stop(value, name)
                elif name in REQUEST_OPTIONS:
                    changes.applied = {**changes.applied, name: request_option(name, value, name)}
                elif name in UI_OPTIONS:
                    changes.ui = {**changes.ui, name: ui_option(name, value)}
                elif current.get(name, object()) != value:
                    ignored.append(name)
            self.board.set_options(key, changes)  # all or nothing: nothing is set when one value is refused
        except APIError as e:
            return error_response(e)
        if ignored:
            logger.info("POST /sdapi/v1/options: kept the values of %s (only %s and the web UI's own options can be "
                        "set here)", ", ".join(ignored[:MAX_IGNORED_NAMES]), ", ".join(OPTIONS))
        return JSONResponse(None, headers=names_header(ignored))


def a1111_router(ctx: AppContext) -> APIRouter:
    """The routes of the module doc, over one `A1111Server` (the state every route reads)."""
    server = A1111Server(ctx)
    router = APIRouter()
    _add_images(router, server)
    _add_listings(router, server)
    _add_options(router, server)
    # png-info, memory, prompt-styles, ... (a1111_info.py)
    router.include_router(info_router(InfoSources(ctx.state, ctx.routing, ctx.embedding_dir, server.styles,
                                                  server.upscalers)))
    # extra-single-image, extra-batch-images, upscalers
    router.include_router(extras_router(server.config, server.upscalers))
    router.include_router(analysis_router(server.config))  # /controlnet/detect, interrogate
    _add_progress(router, server)
    return router


def _add_images(router: APIRouter, server: A1111Server) -> None:
    """txt2img and img2img."""
    @router.post("/sdapi/v1/txt2img")
    async def txt2img(http: Request) -> Response:
        return await server.generate(http, Txt2ImgBody, "txt2img")

    @router.post("/sdapi/v1/img2img")
    async def img2img(http: Request) -> Response:
        return await server.generate(http, Img2ImgBody, "img2img")


def _add_listings(router: APIRouter, server: A1111Server) -> None:
    """The models, the ControlNet extension's lists, samplers, schedulers, LoRAs, embeddings and scripts."""
    state = server.state

    @router.get("/sdapi/v1/sd-models")
    async def sd_models() -> Response:
        async def work() -> list[dict[str, Any]]:
            # `filename` is the model's name, not a path on the server
            return [{"title": c["title"], "model_name": c["id"].replace("/", "_"), "hash": c.get("hash"),
                     "sha256": None, "filename": c["id"], "config": None} for c in await server.titles()]
        return await _answer(work)

    @router.get("/controlnet/model_list")
    async def controlnet_models() -> Response:
        """The ControlNet extension's model list: the ControlNets units may name."""
        return JSONResponse({"model_list": await asyncio.to_thread(server.served)})

    @router.get("/controlnet/module_list")
    async def controlnet_modules(alias_names: bool = False) -> Response:
        return JSONResponse(module_list(alias_names))

    @router.get("/controlnet/version")
    async def controlnet_version() -> Response:
        return JSONResponse({"version": 2})

    @router.get("/sdapi/v1/samplers")
    async def samplers() -> Response:
        return await _answer(lambda: sampler_items(state.require_engine().info))

    @router.get("/sdapi/v1/schedulers")
    async def schedulers() -> Response:
        return await _answer(lambda: scheduler_items(state.require_engine().info))

    @router.get("/sdapi/v1/loras")
    async def loras() -> Response:
        async def work() -> list[dict[str, Any]]:
            # the file relative to its folder (--lora-dir, or the model's built-in one): never a path on the server
            return [{"name": a["name"], "alias": a["name"], "metadata": {},
                     "path": a["name"] + ".safetensors" if a.get("source") in ("lora_dir", "builtin") else None}
                    for a in (await lora_listing(state))["data"]]
        return await _answer(work)

    @router.get("/sdapi/v1/embeddings")
    async def embeddings() -> Response:
        async def work() -> dict[str, Any]:
            found = (await embedding_listing(server.embedding_dir))["embeddings"]
            return {"loaded": {e["name"]: {"step": None, "sd_checkpoint": None, "sd_checkpoint_name": None,
                                           "shape": next(iter(e["dims"].values()), 0), "vectors": e["vectors"]}
                               for e in found}, "skipped": {}}
        return await _answer(work)

    @router.get("/sdapi/v1/scripts")
    async def scripts() -> dict[str, list[Any]]:
        return script_lists()


def _add_options(router: APIRouter, server: A1111Server) -> None:
    """GET and POST /sdapi/v1/options: the calling key's."""
    @router.get("/sdapi/v1/options")
    async def get_options(http: Request) -> Response:
        return await _answer(lambda: server.current_options(server.key_of(http)))

    @router.post("/sdapi/v1/options")
    async def set_options(http: Request) -> Response:
        """Sets the calling key's default model and clip skip and its web UI options (UI_OPTIONS, kept and read back as
        AUTOMATIC1111 keeps them); any other option keeps its value (a change to it is
        accepted, as AUTOMATIC1111's clients send back the whole set, and named in the IGNORED_HEADER and the log)."""
        return await server.set_options(http)


def _add_progress(router: APIRouter, server: A1111Server) -> None:
    """The calling key's requests in flight: progress, interrupt, skip (a1111_jobs.py)."""
    @router.get("/sdapi/v1/progress")
    async def progress(http: Request, skip_current_image: bool = False) -> Response:
        return JSONResponse(server.board.progress(server.key_of(http), not skip_current_image).model_dump())

    @router.post("/sdapi/v1/interrupt")
    async def interrupt(http: Request) -> dict[str, Any]:
        server.board.interrupt(server.key_of(http))
        return {}

    @router.post("/sdapi/v1/skip")
    async def skip(http: Request) -> dict[str, Any]:
        server.board.skip(server.key_of(http))
        return {}
