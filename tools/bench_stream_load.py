"""Peak host memory of loading a multi-GB diffusers folder: the private-copy path (`weights_view` + from_pretrained)
against the streamed one (`stream_load.load_part`), each in a fresh subprocess (ru_maxrss after the load minus
before it, so imports do not count).

    PYTHONPATH=src python tools/bench_stream_load.py [--folder /tmp/diffgraph-bench-2gb] [--gb 2] [--dtype fp32]

The folder (a ModelMixin of square Linear layers, 256 MiB each in fp32) is saved once and reused."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

WIDTH = 8192  # one 8192 x 8192 fp32 layer: 256 MiB


class Linears(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, layers: int = 8, width: int = WIDTH):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (KiB on Linux)


def child(path: str, how: str, dtype: torch.dtype) -> None:
    from diffgraph.models.stream_load import load_part
    from diffgraph.models.weights_view import weights_view

    before, start = _rss_mib(), time.perf_counter()
    if how == "private copy":
        with weights_view(path, "bench", ["."]) as view:
            model = Linears.from_pretrained(view, torch_dtype=dtype)
    else:
        model = load_part(Linears, path, "bench", dtype=dtype)
    seconds = time.perf_counter() - start
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
    print(json.dumps({"how": how, "peak_delta_mib": round(_rss_mib() - before), "module_mib": round(size),
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
