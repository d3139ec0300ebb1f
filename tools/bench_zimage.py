"""Z-Image on the GPU: diffusers' ZImagePipeline (the baseline) and the engine on the same random-initialised
modules (`random:zimage-turbo`, bf16, 1024x1024, 8 forwards, no guidance), text encoder and decode included; then the
engine's mixed rows (prompt lengths, two aspect ratios of one token bucket, steps) against each alone. Each stage
writes its figures to OUT/zimage.json as it finishes (a stage that fails records its error and the rest go on).

    python3 tools/bench_zimage.py --out $OUT [--stages baseline,compiled,eager,graph,compile,compile_sat,fp8,fp8_sat,
                                              ceiling,mixed,gguf] [--steps 8]

`compile_sat` / `fp8_sat`: the compile tier (bf16 / fp8 linears) at saturation, 16 distinct prompts at once after a
warm-up burst of 4; `ceiling`: the compiled transformer's batch-4 forward and the images/s it allows.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import numpy as np
import torch

PROMPT = "a lighthouse on a cliff at dusk, long exposure, waves breaking below, cinematic light"


def timed(fn, repeat: int = 3) -> tuple[float, object]:
    """Median seconds of `repeat` calls (each synchronised), and the last result."""
    times, out = [], None
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="baseline,eager,graph,mixed,compiled,gguf")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": args.steps}
    path = os.path.join(args.out, "zimage.json")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    from diffgraph.models.loader import load_model
    t0 = time.perf_counter()
    model = load_model("random:zimage-turbo", "cuda", "bf16")
    torch.cuda.synchronize()
    results["init_s"] = time.perf_counter() - t0
    results["memory_gb_after_init"] = torch.cuda.memory_allocated() / 1e9
    save()
    steps = args.steps

    def stage(name, fn):
        if name not in args.stages.split(","):
            return
        t = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - the next stage still runs
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-3000:]}
        results[name + "_wall_s"] = time.perf_counter() - t
        save()
        print(name, json.dumps(results[name])[:600], flush=True)

    def pipeline():
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline
        return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(model.scheduler_config),
                              vae=model.vae, text_encoder=model.text_encoders[0], tokenizer=model.tokenizers[0],
                              transformer=model.denoiser)

    def baseline(compiled: bool):
        pipe = pipeline()
        if compiled:
            pipe.transformer = torch.compile(model.denoiser)
        gen = dict(prompt=PROMPT, height=1024, width=1024, num_inference_steps=steps, guidance_scale=0.0,
                   output_type="np")
        with torch.no_grad():
            t = time.perf_counter()
            pipe(**gen, generator=torch.Generator("cuda").manual_seed(0))
            first = time.perf_counter() - t
            end_to_end, _ = timed(lambda: pipe(**gen, generator=torch.Generator("cuda").manual_seed(0)))
            out = {"first_call_s": first, "end_to_end_s": end_to_end}
            if not compiled:
                out["text_encoder_s"], _ = timed(lambda: pipe.encode_prompt(PROMPT, device="cuda",
                                                                            do_classifier_free_guidance=False))
                latents = torch.randn((1, 16, 128, 128), device="cuda", dtype=torch.bfloat16)
                out["vae_decode_1024_s"], _ = timed(lambda: model.vae.decode(latents, return_dict=False))
        return out

    stage("baseline", lambda: baseline(False))

    def engine_figures(mode: str, compile: bool = False, burst: bool = True, quantize: str | None = None,
                       saturate: int = 0):
        """One image (median of 3) and, with `burst`, 8 distinct prompts at once; with `saturate` N, a warm-up burst
        of 4 (the batch-4 graphs compiled and captured) and then N distinct prompts at once: images/s at saturation.
        `quantize` "fp8": the engine loads its own copy (the fp8 tier changes the layers in place)."""
        from diffgraph import Engine, GenerationRequest, GraphConfig
        graphs = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((1024, 1024),), prewarm=False) \
            if mode == "graph" else None
        t = time.perf_counter()
        source = "random:zimage-turbo" if quantize else model
        with Engine(model=source, device="cuda", dtype="bf16", mode=mode, graphs=graphs, compile=compile,
                    quantize=quantize) as engine:
            ready = time.perf_counter() - t
            t = time.perf_counter()
            engine.generate(PROMPT, height=1024, width=1024, num_inference_steps=steps, seed=0)
            first = time.perf_counter() - t
            one, _ = timed(lambda: engine.generate(PROMPT, height=1024, width=1024, num_inference_steps=steps,
                                                   seed=0))
            out = {"ready_s": ready, "first_image_s": first, "one_image_s": one}
            if quantize:
                out["fp8_layers"] = len(engine.quantized.quantized)

            def run(n: int, tag: str) -> float:
                made = [GenerationRequest.create(prompt=f"{PROMPT} {tag} {i}", height=1024, width=1024,
                                                 num_inference_steps=steps, seed=i, model=engine.info)
                        for i in range(n)]
                t0 = time.perf_counter()
                for f in [engine.submit(r) for r in made]:
                    f.result()
                return time.perf_counter() - t0

            if saturate:
                out["warmup_burst4_s"] = run(4, "warm")
                wall = run(saturate, "sat")
                out.update({f"burst{saturate}_s": wall, "images_per_s": saturate / wall})
            elif burst:
                wall = run(8, "burst")
                out.update({"burst8_s": wall, "burst8_images_per_s": 8 / wall})
            return out

    def ceiling():
        """The compiled transformer's forward at batch 4 (diffusers' call on the same module): the saturation
        ceiling 4 / (steps x forward(4) + 4 x decode) that the issue compares images/s with."""
        transformer = torch.compile(model.denoiser)
        x = [torch.randn((16, 1, 128, 128), device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        caps = [torch.randn((64, model.denoiser.config.cap_feat_dim), device="cuda", dtype=torch.bfloat16)
                for _ in range(4)]
        t = torch.full((4,), 0.5, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            transformer(x, t, caps, return_dict=False)
            forward4, _ = timed(lambda: transformer(x, t, caps, return_dict=False), repeat=5)
            latents = torch.randn((1, 16, 128, 128), device="cuda", dtype=torch.bfloat16)
            decode, _ = timed(lambda: model.vae.decode(latents, return_dict=False))
        return {"forward_batch4_s": forward4, "decode_1024_s": decode,
                "ceiling_images_per_s": 4 / (steps * forward4 + 4 * decode)}

    stage("eager", lambda: engine_figures("eager"))
    stage("graph", lambda: engine_figures("graph"))
    stage("compile", lambda: engine_figures("graph", compile=True, burst=False))
    stage("compile_sat", lambda: engine_figures("graph", compile=True, saturate=16))
    stage("fp8", lambda: engine_figures("graph", compile=True, quantize="fp8", burst=False))
    stage("fp8_sat", lambda: engine_figures("graph", compile=True, quantize="fp8", saturate=16))
    stage("ceiling", ceiling)

    def mixed():
        """Prompts of ~5 and ~300 tokens, 1024x1024 and 896x1152 (one bucket of 4096 tokens), 8 and 9 steps, in one
        step vs each alone: the largest uint8 difference."""
        from diffgraph import Engine, GenerationRequest, GraphConfig
        graphs = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((1024, 1024),), prewarm=False)
        reqs = [dict(prompt="a red fox", height=1024, width=1024, num_inference_steps=8, seed=1),
                dict(prompt=", ".join([PROMPT] * 18), height=896, width=1152, num_inference_steps=9, seed=2),
                dict(prompt="ink drawing of a cat", height=1152, width=896, num_inference_steps=8, seed=3)]
        with Engine(model=model, mode="graph", graphs=graphs) as engine:
            alone = [engine.submit(GenerationRequest.create(model=engine.info, **r)).result().arrays[0]
                     for r in reqs]
            futures = []
            made = [GenerationRequest.create(model=engine.info, **r) for r in reqs]
            t = time.perf_counter()
            engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in made)).result()
            together = [f.result().arrays[0] for f in futures]
            wall = time.perf_counter() - t
            diffs = [int(np.abs((a * 255).round().astype(np.int16) - (b * 255).round().astype(np.int16)).max())
                     for a, b in zip(alone, together)]
            return {"max_uint8_diff_each": diffs, "together_wall_s": wall,
                    "prompt_tokens": [len(engine.model.tokenizers[0](r["prompt"]).input_ids) for r in reqs]}

    stage("mixed", mixed)
    stage("compiled", lambda: baseline(True))

    def gguf():
        from diffgraph.models.gguf_quants import time_dequantize
        r = time_dequantize("cuda")
        return {"timing": repr(r), "z_image_6b_q4k_load_s": r.load_seconds(6_150_000_000)}

    stage("gguf", gguf)


if __name__ == "__main__":
    main()
