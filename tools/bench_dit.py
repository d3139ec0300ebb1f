"""The MMDiT families on the GPU (issues' targets): FLUX.2 klein 4B, Qwen-Image and Qwen-Image-Edit, their true
architectures with random weights made on the device in bf16, 1024x1024, text encoder and decode included. The baseline
is diffusers' pipeline on the same modules in the same process, its transformer `torch.compile`d. Each stage writes its
figures to OUT/<family>.json as it goes (a stage that fails records its error and the rest go on).

    python3 tools/bench_dit.py --family klein|qwen|edit --out $OUT [--stages ...] [--repeat 3]

Stages, in this order: `compile` (the engine's compile tier: one image, with a reference image, and N distinct
prompts at once after a warm-up burst); `lightning` and `mixed` (one engine with LoRA slots: for Qwen one 8-step row
with a Lightning-style LoRA at guidance 1; a burst of mixed rows against the same requests as uniform bursts, one per
kind: klein's rows with 0/1/2 references, 5- to 300-token prompts, 4 and 8 steps, some with a LoRA; Qwen-Image-Edit's
50-step CFG rows, 8-step Lightning rows and edit rows); `baseline` (diffusers, compiled: one image; with a reference /
input image where the family takes one); `ceiling` (the compiled transformer's forward at the largest batch the
engine serves, plus the decode: the images/s it allows); `fp8` (the loaded modules freed, the preset loaded again
with fp8 linears by the engine, `quantize="fp8"`: the compile stage's figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

PROMPT = "a lighthouse on a cliff at dusk, long exposure, waves breaking below, cinematic light"
SMOKE = {"klein": "random:flux2-klein-tiny", "qwen": "random:qwen-image-tiny", "edit": "random:qwen-image-edit-tiny"}


@dataclass(frozen=True)
class Family:
    preset: str
    steps: int
    guidance: float | None        # the engine request's guidance_scale (None: the model's default)
    pipeline: str                 # diffusers' class
    references: bool              # the family takes reference / input images
    batch: int                    # the largest batch bucket served (rows; a CFG image is two)
    per_image_rows: int           # rows a default image runs (2 for true CFG)
    call: dict = field(default_factory=dict)  # the pipeline call's own guidance arguments


FAMILIES = {
    "klein": Family("random:flux2-klein-4b", 4, None, "Flux2KleinPipeline", True, 4, 1, {"guidance_scale": 1.0}),
    "qwen": Family("random:qwen-image", 50, 4.0, "QwenImagePipeline", False, 2, 2,
                   {"negative_prompt": " ", "true_cfg_scale": 4.0}),
    "edit": Family("random:qwen-image-edit", 40, 4.0, "QwenImageEditPlusPipeline", True, 4, 2,
                   {"negative_prompt": " ", "true_cfg_scale": 4.0}),
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat: int) -> tuple[float, object]:
    """Median seconds of `repeat` calls (each synchronised), and the last result."""
    times, out = [], None
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def picture(size: int, seed: int) -> np.ndarray:
    """A smooth random RGB picture (uint8), `size` square."""
    g = torch.Generator().manual_seed(seed)
    small = torch.rand((1, 3, size // 16, size // 16), generator=g)
    big = torch.nn.functional.interpolate(small, size=(size, size), mode="bilinear")[0].permute(1, 2, 0)
    return (big.numpy() * 255).round().astype(np.uint8)


def write_lora(model, folder: str, name: str, rank: int, sidecar: str = "") -> None:
    """A random rank-`rank` PEFT adapter on every layer the family's LoRA files train, as `folder/name.safetensors`
    (with `sidecar` as its NAME.diffgraph.toml)."""
    from safetensors.torch import save_file
    targets = model.adapter.lora_layout(model).denoiser
    g = torch.Generator().manual_seed(len(name))
    state = {}
    for module_name, linear in model.denoiser.named_modules():
        if isinstance(linear, torch.nn.Linear) and "blocks." in module_name and module_name.endswith(targets):
            state[f"transformer.{module_name}.lora_A.weight"] = torch.randn(
                (rank, linear.in_features), generator=g, dtype=torch.bfloat16) * 0.01
            state[f"transformer.{module_name}.lora_B.weight"] = torch.randn(
                (linear.out_features, rank), generator=g, dtype=torch.bfloat16) * 0.01
    save_file(state, os.path.join(folder, f"{name}.safetensors"))
    if sidecar:
        with open(os.path.join(folder, f"{name}.diffgraph.toml"), "w") as f:
            f.write(sidecar)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", required=True, choices=sorted(FAMILIES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="baseline,ceiling,compile,fp8,mixed")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--saturate", type=int, default=16, help="images of the saturation burst (0: none)")
    ap.add_argument("--smoke", action="store_true", help="the script's own check on a CPU: the tiny preset, fp32, "
                    "256x256, nothing compiled")
    args = ap.parse_args()
    fam = FAMILIES[args.family]
    device, dtype, compile = ("cpu", torch.float32, False) if args.smoke else ("cuda", torch.bfloat16, True)
    size = 256 if args.smoke else 1024
    if args.smoke:
        fam = dataclasses.replace(fam, preset=SMOKE[args.family], steps=2)
    results: dict = {"device": torch.cuda.get_device_name() if compile else "cpu", "torch": torch.__version__, "family": fam.preset,
                     "steps": fam.steps, "size": size}
    path = os.path.join(args.out, f"{args.family}.json")
    stages = args.stages.split(",")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    import diffusers
    results["diffusers"] = diffusers.__version__
    from diffgraph.models.loader import load_model
    t0 = time.perf_counter()
    model = load_model(fam.preset, device, dtype)
    sync()
    results["init_s"] = time.perf_counter() - t0
    results["memory_gb_after_init"] = torch.cuda.memory_allocated() / 1e9 if compile else None
    results["denoiser_params_b"] = sum(p.numel() for p in model.denoiser.parameters()) / 1e9
    results["text_encoder_params_b"] = sum(p.numel() for p in model.text_encoders[0].parameters()) / 1e9
    save()
    loras = tempfile.mkdtemp(prefix="bench-loras-")

    def stage(name, fn):
        if name not in stages:
            return
        t = time.perf_counter()
        results[name] = {}
        try:
            fn(results[name])
        except Exception as e:  # noqa: BLE001 - the next stage still runs
            results[name]["error"] = f"{type(e).__name__}: {e}"[:2000]
            results[name]["trace"] = traceback.format_exc()[-3000:]
        results[name]["wall_s"] = time.perf_counter() - t
        save()
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "trace"})[:900], flush=True)

    def pipeline():
        from diffusers import FlowMatchEulerDiscreteScheduler
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(model.scheduler_config)
        if args.family == "klein":
            from diffusers import Flux2KleinPipeline
            return Flux2KleinPipeline(scheduler=scheduler, vae=model.vae, text_encoder=model.text_encoders[0],
                                      tokenizer=model.tokenizers[0], transformer=model.denoiser, is_distilled=True)
        return model.adapter.diffusers_pipeline(model, scheduler)

    compiled = {}

    def compiled_transformer():
        if "t" not in compiled:
            compiled["t"] = torch.compile(model.denoiser) if compile else model.denoiser
        return compiled["t"]

    def baseline(out):
        from PIL import Image
        pipe = pipeline()
        pipe.transformer = compiled_transformer()
        gen = dict(prompt=PROMPT, height=size, width=size, num_inference_steps=fam.steps, output_type="np",
                   **fam.call)
        calls = [] if args.family == "edit" else [("one_image", {})]
        if fam.references:
            calls.append(("one_reference", {"image": [Image.fromarray(picture(size, 7))]}))
        with torch.no_grad():
            for tag, extra in calls:
                t = time.perf_counter()
                pipe(**gen, **extra, generator=torch.Generator(device).manual_seed(0))
                out[f"{tag}_first_call_s"] = time.perf_counter() - t
                out[f"{tag}_s"], _ = timed(lambda: pipe(**gen, **extra, generator=torch.Generator(device).manual_seed(0)),
                                           args.repeat)
                save()
            out["text_encoder_s"], _ = timed(lambda: pipe.encode_prompt(PROMPT, device=device), args.repeat)
        pipe.transformer = model.denoiser


    def ceiling(out):
        """The compiled transformer's forward on the arguments diffusers gives it at the engine's largest batch (one
        CFG branch at `batch` images for Qwen, so its pair is a `batch`-row forward), and the decode."""
        pipe = pipeline()
        seen = {}

        def grab(module, a, kw):
            seen.setdefault("call", (a, kw))
        hook = model.denoiser.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.no_grad():
                call = {k: v for k, v in fam.call.items() if k != "negative_prompt"} | {"true_cfg_scale": 1.0} \
                    if args.family != "klein" else fam.call
                pipe(prompt=PROMPT, height=size, width=size, num_inference_steps=1, output_type="latent",
                     num_images_per_prompt=fam.batch, **call)
        finally:
            hook.remove()
        a, kw = seen["call"]
        transformer = compiled_transformer()
        with torch.no_grad():
            transformer(*a, **kw)
            forward, _ = timed(lambda: transformer(*a, **kw), 5)
            channels = getattr(model.vae.config, "latent_channels", None) or model.vae.config.z_dim
            latents = torch.randn((1, channels, size // 8, size // 8), device=device,
                                  dtype=dtype)
            if args.family != "klein":
                latents = latents[:, :, None]
            decode, _ = timed(lambda: model.vae.decode(latents, return_dict=False), 3)
        images = fam.batch // fam.per_image_rows
        out.update({f"forward_batch{fam.batch}_s": forward, "decode_s": decode,
                    "ceiling_images_per_s": images / (fam.steps * forward + images * decode)})


    def engine(lora_dir: str | None = None, fp8: bool = False):
        """The compile tier on the loaded modules; with `fp8`, on its own copy of the preset with fp8 linears (the
        product's path: `quantize="fp8"` changes the layers in place)."""
        from diffgraph import Engine, GraphConfig
        buckets = tuple(b for b in (1, 2, 4) if b <= fam.batch)
        graphs = GraphConfig(batch_buckets=buckets, resolutions=((size, size),), prewarm=False)
        extra = {"lora_dir": lora_dir} if lora_dir else {}
        if fp8:
            extra["quantize"] = "fp8"
        return Engine(model=fam.preset if fp8 else model, device=device, dtype="fp32" if args.smoke else "bf16",
                      mode="eager" if args.smoke else "graph", graphs=None if args.smoke else graphs,
                      compile=compile, **extra)

    def request(engine, prompt=PROMPT, seed=0, refs=None, **kw):
        from diffgraph import GenerationRequest
        params = dict(prompt=prompt, height=size, width=size, seed=seed, num_inference_steps=fam.steps,
                      guidance_scale=fam.guidance) | kw
        if refs is None and args.family == "edit":  # an edit row reads an input image
            refs = [picture(size, 9)]
        if refs:
            params["extras"] = {"reference_images": list(refs)}
        return GenerationRequest.create(model=engine.info, **params)

    def burst(engine, made) -> float:
        t0 = time.perf_counter()
        for f in [engine.submit(r) for r in made]:
            f.result()
        return time.perf_counter() - t0

    def tier(out, fp8: bool = False):
        t = time.perf_counter()
        with engine(fp8=fp8) as e:
            if fp8:
                out["fp8_summary"] = e.quantized.summary()
            out["ready_s"] = time.perf_counter() - t
            one = lambda **kw: e.submit(request(e, **kw)).result()  # noqa: E731
            t = time.perf_counter()
            one()
            out["first_image_s"] = time.perf_counter() - t
            out["one_image_s"], _ = timed(one, args.repeat)
            save()
            if fam.references and args.family != "edit":
                ref = picture(size, 7)
                t = time.perf_counter()
                one(refs=[ref])
                out["first_reference_image_s"] = time.perf_counter() - t
                out["one_reference_s"], _ = timed(lambda: one(refs=[ref]), args.repeat)
                save()
            rows = fam.batch // fam.per_image_rows
            if not args.saturate:
                return
            out[f"warmup_burst{rows}_s"] = burst(e, [request(e, f"{PROMPT} warm {i}", i) for i in range(rows)])
            n = args.saturate
            wall = burst(e, [request(e, f"{PROMPT} sat {i}", i) for i in range(n)])
            out.update({f"burst{n}_s": wall, "images_per_s": n / wall, "compile_fallbacks": e.stats["compile_fallbacks"]})


    def fp8(out):
        """The bf16 modules freed first (a second copy of Qwen-Image does not fit an 80 GB card beside the first)."""
        nonlocal model
        model = None
        compiled.clear()
        gc.collect()
        if compile:
            torch.cuda.empty_cache()
            out["memory_gb_before"] = torch.cuda.memory_allocated() / 1e9
        tier(out, fp8=True)

    def lightning(e, out):
        """One row of a Lightning-style LoRA (its sidecar: the Lightning schedule, 8 steps, guidance 1)."""
        one = lambda: e.submit(request(e, loras=[("lightning", 1.0)], num_inference_steps=None,  # noqa: E731
                                       guidance_scale=None)).result()
        t = time.perf_counter()
        r = one()
        out["lightning_first_image_s"] = time.perf_counter() - t
        out["lightning_request"] = [r.request.schedule, r.request.num_inference_steps, r.request.guidance_scale]
        out["lightning_one_image_s"], _ = timed(one, args.repeat)
        save()

    def mixed(out):
        """The same requests as one burst and as uniform bursts, one per kind, after a warm-up of both (every graph
        captured): images/s of the mixed burst over that of the uniform bursts together."""
        write_lora(model, loras, "style", 16)
        long = ", ".join([PROMPT] * 18)
        if args.family == "klein":
            small, big = picture(512, 3), picture(size, 4)
            kinds = {"plain4": [dict(prompt="a red fox", seed=1), dict(prompt=long, seed=2)],
                     "plain8": [dict(prompt="ink drawing of a cat", seed=3, num_inference_steps=8),
                                dict(prompt=long + " at night", seed=4, num_inference_steps=8)],
                     "references": [dict(prompt="the same fox, asleep", seed=5, refs=[small]),
                                    dict(prompt="the same fox in the snow", seed=6, refs=[small, big])],
                     "lora": [dict(prompt="a red fox, style", seed=7, loras=[("style", 0.8)]),
                              dict(prompt=long + ", style", seed=8, loras=[("style", 0.8)], num_inference_steps=8)]}
        else:
            write_lora(model, loras, "lightning", 64, 'schedule = "lightning"\nsteps = 8\nguidance = 1.0\n')
            picture_a, picture_b = picture(size, 3), picture(size, 4)
            kinds = {"cfg50": [dict(prompt="a red fox", seed=1, num_inference_steps=50, refs=[]),
                               dict(prompt=long, seed=2, num_inference_steps=50, refs=[])],
                     "lightning8": [dict(prompt="ink drawing of a cat", seed=3, loras=[("lightning", 1.0)],
                                         num_inference_steps=None, guidance_scale=None, refs=[]),
                                    dict(prompt=long, seed=4, loras=[("lightning", 1.0)], num_inference_steps=None,
                                         guidance_scale=None, refs=[])],
                     "edit": [dict(prompt="the same fox, asleep", seed=5, refs=[picture_a]),
                              dict(prompt="the same fox in the snow", seed=6, refs=[picture_b])]}
        with engine(loras) as e:
            if args.family != "klein":
                lightning(e, out)
            if "mixed" not in stages:
                return
            everything = [kw for rows in kinds.values() for kw in rows]
            t = time.perf_counter()
            burst(e, [request(e, **kw) for kw in everything])
            out["warmup_mixed_s"] = time.perf_counter() - t
            for rows in kinds.values():
                burst(e, [request(e, **kw) for kw in rows])
            save()
            uniform = {k: burst(e, [request(e, **kw) for kw in rows]) for k, rows in kinds.items()}
            together = burst(e, [request(e, **kw) for kw in everything])
            n = len(everything)
            out.update({"uniform_s": uniform, "mixed_s": together, "images": n,
                        "mixed_images_per_s": n / together, "uniform_images_per_s": n / sum(uniform.values()),
                        "ratio": sum(uniform.values()) / together})

    # the engine's stages first (the targets), then diffusers' (its compiles of the reference shape and of the
    # ceiling's batch take minutes), fp8 last: it frees the loaded modules
    stage("compile", tier)
    if "lightning" in stages and "mixed" not in stages:
        stage("lightning", mixed)
    stage("mixed", mixed)
    stage("baseline", baseline)
    if args.family != "edit":  # Edit's transformer is Qwen-Image's
        stage("ceiling", ceiling)
    stage("fp8", fp8)


if __name__ == "__main__":
    main()
