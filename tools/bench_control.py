"""The cost of ControlNet rows in a step (issue 32's targets): a bucket-16 step with no control rows, with 4 rows
using one ControlNet, and with all 16, in one process on one engine (graph tier, or the compile tier with
--compile), one denoiser row per image (guidance 1), each step's time from CUDA events (the engine's step_events),
rounds interleaved; beside it the same plain batch on an engine of the same model without ControlNets (what a step
costs without the feature). Then switching: one device slot, two ControlNets of one architecture taking turns,
with the graph captures counted before and after. The ControlNets are made from the preset's UNet
(`ControlNetModel.from_unet`), so they have a real ControlNet's architecture and cost.

With --image-prompts, also 4 and all 16 rows with an IP-Adapter "plus" image prompt (16 image tokens a row; random
weights of the true size, made as tests/test_ip_adapter.py makes its adapters): the issue's "<= 1.1x".

    python3 tools/bench_control.py --preset random:sd15 --steps 10 [--compile [--force-layout]] [--image-prompts]

(on the GPU host). --force-layout compiles the ControlNet with Inductor's channels-last layout forced
(engine/control_graphs.py `CONTROL_OPTIONS`), as the step and the VAE decoder are: run it beside a run without.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import numpy as np
import torch

from diffgraph import Engine, GraphConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="random:sd15")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", type=int, default=None)
    p.add_argument("--compile", action="store_true", help="the compile tier (Inductor's kernels in the graphs)")
    p.add_argument("--image-prompts", action="store_true", help="also rows with an IP-Adapter image prompt")
    p.add_argument("--force-layout", action="store_true",
                   help="with --compile: the ControlNet's compile forces Inductor's channels-last layout")
    p.add_argument("--cases", default="plain,0,4,16,ip4,ip16",
                   help="which to time (the ratios are to 'plain', else to '0': a step of this engine with no control "
                        "rows); 'ip' cases need --image-prompts")
    p.add_argument("--buckets", default="1,2,4,8,16",
                   help="graph buckets (the cases need 4 and 16; fewer buckets make the compile tier's start shorter)")
    args = p.parse_args()
    from diffusers import ControlNetModel
    size = args.size or (1024 if "xl" in args.preset else 512)
    from diffgraph.models.loader import load_model
    folder = tempfile.mkdtemp()
    cuda = args.device.startswith("cuda")
    model = load_model(args.preset, torch.device(args.device), "fp16" if cuda else "fp32")
    for name in ("net", "net2"):
        ControlNetModel.from_unet(model.unet).save_pretrained(f"{folder}/{name}", safe_serialization=True)
    graphs = GraphConfig(batch_buckets=tuple(int(b) for b in args.buckets.split(",")), resolutions=((size, size),)) if cuda else None
    ip_dir = None
    if args.image_prompts:  # the test's random "plus" adapter, at this UNet's size
        import pathlib
        import sys
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
        from test_ip_adapter import make_ip_adapter, make_plus_ip_adapter, picture
        ip_dir = pathlib.Path(folder) / "ip"
        ip_dir.mkdir()
        make_ip_adapter(model.unet, ip_dir, "base", seed=1)  # writes the image encoder folder too
        make_plus_ip_adapter(model.unet, ip_dir, "plus", seed=2)
        prompt_image = np.asarray(picture(1))
    names = args.cases.split(",")
    if args.force_layout and not args.compile:
        p.error("--force-layout needs --compile (it sets how the compile tier compiles the ControlNet)")
    if args.force_layout:
        from diffgraph.engine import control_graphs
        control_graphs.CONTROL_OPTIONS = {"force_layout_optimization": True}
    plain = Engine(model, graphs=graphs, compile=args.compile) if "plain" in names else None
    e = Engine(model, graphs=graphs, controlnet_dir=folder, compile=args.compile,
               ip_adapter_dir=str(ip_dir) if ip_dir else None)
    image = np.zeros((size, size, 3), np.uint8)
    image[size // 4: size // 2, size // 4:] = 255

    def batch(e: Engine, controlled: int, net: str = "net", prompted: int = 0) -> float:
        reqs = [e.make_request("a cat", seed=i, num_inference_steps=args.steps, guidance_scale=1.0,
                               controls=[dict(model=net, image=image)] if i < controlled else (),
                               image_prompts=dict(model="plus", images=[prompt_image]) if i < prompted else None)
                for i in range(16)]
        e.core.step_events = []
        futures: list = []
        e.core.call_between_steps(lambda: futures.extend(e.submit(r) for r in reqs)).result()
        for f in futures:
            f.result()
        if not cuda:  # no CUDA events off the GPU: a smoke run only
            return 1.0
        torch.cuda.synchronize()
        times = [s.elapsed_time(t) for s, t, _ in e.core.step_events]
        return statistics.median(times)

    cases = tuple(c if c in ("plain", "ip4", "ip16") else int(c) for c in names)
    cases = tuple(c for c in cases if args.image_prompts or c not in ("ip4", "ip16"))
    base = "plain" if "plain" in cases else 0
    run = {"plain": lambda: batch(plain, 0), 0: lambda: batch(e, 0), 4: lambda: batch(e, 4), 16: lambda: batch(e, 16),
           "ip4": lambda: batch(e, 0, prompted=4), "ip16": lambda: batch(e, 0, prompted=16)}
    for c in cases:  # warm every variant (captures and compiles happen here, not in the timed rounds)
        run[c]()
    rows = {c: [] for c in cases}
    for _ in range(args.rounds):
        for c in cases:
            rows[c].append(run[c]())
    med = {c: statistics.median(v) for c, v in rows.items()}
    print(json.dumps({"preset": args.preset, "size": size, "compile": args.compile, "force_layout": args.force_layout,
                      "step_ms": {str(k): v for k, v in rows.items()}, "graphs": [
                          (r["kind"], r["bucket"], r["replays"]) for r in e.runner.graph_table() if r["replays"]]}))
    if plain is not None:
        plain.close()
    e.close()
    print(f"{'bucket-16 step':34s} {'ms':>8s} {'ratio':>7s}")
    if "plain" in med:
        print(f"{'plain engine (no ControlNets)':34s} {med['plain']:8.2f} {1.0:7.3f}")
    for c, label in ((0, "no control rows"), (4, "4 rows with a ControlNet"), (16, "16 rows with a ControlNet"),
                     ("ip4", "4 rows with an image prompt"), ("ip16", "16 rows with an image prompt")):
        if c in med:
            print(f"{label:34s} {med[c]:8.2f} {med[c] / med[base]:7.3f}")
    # switching: one slot, two ControlNets of one architecture taking turns
    s = Engine(model, graphs=graphs, controlnet_dir=folder, compile=args.compile, max_controlnets=1)

    def captures() -> tuple[int, int, int]:
        table = [r for r in s.runner.graph_table() if r["kind"].startswith("control")]
        return (sum(r["status"] == "captured" for r in table), sum(r["on_demand"] + r["invalidations"] for r in table),
                sum(c.compiles for c in s.runner.compiled))

    batch(s, 4, "net")
    before = captures()
    for net in ("net2", "net", "net2"):
        batch(s, 4, net)
    after = captures()
    s.close()
    print(f"switching ControlNets in one slot: control graphs captured {before[0]} -> {after[0]}, "
          f"captured on demand or invalidated {before[1]} -> {after[1]}, compiled {before[2]} -> {after[2]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
