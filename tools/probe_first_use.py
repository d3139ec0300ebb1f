"""Probe: where does the first forward of a new batch shape spend its time, and does it parallelise?

The cold-start breakdown of `bench latency` shows ~0.8 s for the first warm-up iteration of every SD1.5
step bucket (a step is 12-95 ms). This probe times the UNet's first and second forward per new batch
shape, lists the CPU-heaviest ops of one first forward (torch.profiler), and times first forwards of new
shapes run sequentially against the same number run concurrently from threads (each on its own stream).

    python3 tools/probe_first_use.py            # on the GPU host
"""

from __future__ import annotations

import threading
import time

import torch

from diffgraph.models.loader import load_model


def forward(unet, batch: int, lat: int, stream: torch.cuda.Stream | None = None) -> float:
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream), torch.no_grad():
        x = torch.randn(batch, 4, lat, lat, device="cuda", dtype=torch.float16)
        ctx = torch.randn(batch, 77, unet.config.cross_attention_dim, device="cuda", dtype=torch.float16)
        t = torch.full((batch,), 500.0, device="cuda")
        t0 = time.perf_counter()
        unet(x, t, encoder_hidden_states=ctx)
        stream.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
    m = load_model("random:sd15", device="cuda", dtype="fp16")
    unet, lat = m.unet, 64
    forward(unet, 2, lat)  # CUDA context, cuBLAS/cuDNN handles, first kernels
    for b in (4, 6):
        print(f"sequential new shape CFG batch {b}: first {forward(unet, b, lat):.0f} ms, "
              f"second {forward(unet, b, lat):.0f} ms")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        first = forward(unet, 10, lat)
    print(f"profiled first forward, CFG batch 10: {first:.0f} ms; CPU-heaviest ops:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=40))

    def seq(batches):
        t0 = time.perf_counter()
        for b in batches:
            forward(unet, b, lat)
        return (time.perf_counter() - t0) * 1e3

    def threaded(batches):
        streams = [torch.cuda.Stream() for _ in batches]
        threads = [threading.Thread(target=forward, args=(unet, b, lat, s)) for b, s in zip(batches, streams)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    a, b = (12, 14, 18, 20), (22, 24, 26, 28)
    print(f"4 new shapes sequential {a}: {seq(a):.0f} ms; again (cached) {seq(a):.0f} ms")
    print(f"4 new shapes in 4 threads {b}: {threaded(b):.0f} ms; then sequential (cached) {seq(b):.0f} ms")
    vae = m.vae
    for n in (1, 2):
        z = torch.randn(n, 4, lat, lat, device="cuda", dtype=torch.float16)
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            with torch.no_grad():
                vae.decode(z)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"VAE decode {n} image(s): first {times[0]:.0f} ms, second {times[1]:.0f} ms")


if __name__ == "__main__":
    main()
