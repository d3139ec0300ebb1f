"""Peak host memory of loading a multi-GB diffusers folder: the private-copy path (`weights_view` + from_pretrained)
against the streamed one (`stream_load.load_part`), each in a fresh subprocess. Host memory is sampled every 5 ms
while it loads: RssAnon + RssFile + the larger of RssShmem and the bytes of the process's open memfds (a private
copy lives in one: shared memory that is in no RSS until it is mapped); the figure is its peak minus its value
before the load (imports do not count), beside the loaded module's own size.

    PYTHONPATH=src python tools/bench_stream_load.py [--folder /tmp/diffgraph-bench-2gb] [--gb 2] [--dtype fp32]

The folder (a ModelMixin of square Linear layers, 256 MiB each in fp32) is saved once and reused."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

WIDTH = 8192  # one 8192 x 8192 fp32 layer: 256 MiB


class Linears(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, count: int = 8, width: int = WIDTH):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(count))


def _host_mib() -> float:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile", "RssShmem"):
                fields[name] = int(value.split()[0]) / 1024  # (kB)
    memfds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
                memfds += os.fstat(int(fd)).st_size / 2 ** 20
        except OSError:
            continue
    return fields["RssAnon"] + fields["RssFile"] + max(fields["RssShmem"], memfds)


class PeakSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.done = _host_mib(), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, _host_mib())


def child(path: str, how: str, dtype: torch.dtype) -> None:
    from diffgraph.models.stream_load import load_part
    from diffgraph.models.weights_view import weights_view

    before, sampler = _host_mib(), PeakSampler()
    sampler.start()
    start = time.perf_counter()
    if how == "private copy":
        with weights_view(path, "bench", ["."]) as view:
            model = Linears.from_pretrained(view, torch_dtype=dtype)
    else:
        model = load_part(Linears, path, "bench", dtype=dtype)
    seconds = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    peak = max(sampler.peak, _host_mib())
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
    print(json.dumps({"how": how, "peak_delta_mib": round(peak - before), "module_mib": round(size),
                      "seconds": round(seconds, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default="/tmp/diffgraph-bench-2gb")
    ap.add_argument("--gb", type=float, default=2.0, help="size of the saved weights (fp32)")
    ap.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32", help="the dtype loaded to")
    ap.add_argument("--child", choices=("private copy", "streamed"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    if args.child:
        return child(args.folder, args.child, dtype)
    if not os.path.isfile(os.path.join(args.folder, "diffusion_pytorch_model.safetensors")):
        layers = max(1, round(args.gb * 4))
        with torch.device("meta"):
            model = Linears(layers)
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        model.save_pretrained(args.folder, max_shard_size="100GB")
        del model
    file = os.path.join(args.folder, "diffusion_pytorch_model.safetensors")
    print(f"# {file}: {os.path.getsize(file) / 2 ** 30:.2f} GiB; loaded to {args.dtype}; torch {torch.__version__}")
    for how in ("private copy", "streamed"):
        out = subprocess.run([sys.executable, __file__, "--folder", args.folder, "--dtype", args.dtype,
                              "--child", how], capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
