"""Peak host memory of loading a full-size single-file checkpoint (original layout, fp16, ~2 GB for random:sd15) to
a device (`--device`: cuda where there is one, else cpu), under two source trees, each in a fresh subprocess: this
one and `--before-src` (e.g. the tree before a change). Host memory is sampled every 5 ms as tools/bench_stream_load.py
does (RssAnon + RssFile + the larger of RssShmem and the open memfds' bytes); the figure is its peak minus its value
before the load, beside the loaded modules' own size; on a GPU also the peak GPU allocation during the load. The CUDA
context and a few kernels are made before the first sample. `--device meta` is a stand-in destination that is not
the host, for a machine without a GPU: the tensors are read as for a GPU and dropped (their values are not checked).

    git archive 98686ab~1 src | tar -x -C /tmp/single-before
    PYTHONPATH=src python tools/bench_single_file_memory.py --before-src /tmp/single-before/src  # [--dtype fp32]
    PYTHONPATH=src python tools/bench_single_file_memory.py --device meta

The file (random fp16 values in random:sd15's original-layout key names and shapes, tests/original_layout.py) is
written once, tensor by tensor, and reused."""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from bench_stream_load import PeakSampler, _host_mib  # noqa: E402


def write(path: str, preset: str) -> None:
    """The checkpoint, one tensor in memory at a time: N(0, 0.02) floats, position ids 0..n-1."""
    import original_layout as O

    layout = O.full_size_layout(preset)
    header, offset = {}, 0
    for key, (dtype, shape) in layout.items():
        size = (8 if dtype == "I64" else 2) * (int(torch.Size(shape).numel()))
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    generator = torch.Generator().manual_seed(0)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key, (dtype, shape) in layout.items():
            if dtype == "I64":
                t = torch.arange(shape[-1], dtype=torch.int64).expand(shape).contiguous()
            else:
                t = torch.empty(shape, dtype=torch.float16).normal_(0, 0.02, generator=generator)
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    os.replace(path + ".tmp", path)


def child(path: str, dtype: str, device: str) -> None:
    from diffgraph.models.loader import load_model

    cuda = torch.device(device).type == "cuda"
    if device == "meta":  # (meta tensors hold no values to check)
        from diffgraph.models import single_file
        single_file._check_finite = lambda path, modules: None
    if cuda:  # the CUDA context and the copy, cast and check kernels, before the first sample
        x = torch.ones(1 << 20, dtype=torch.float16, device=device)
        bool(torch.isfinite(x.float()).all())
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    gpu_before = torch.cuda.memory_allocated(device) if cuda else 0
    before, sampler = _host_mib(), PeakSampler()
    sampler.start()
    start = time.perf_counter()
    model = load_model(path, device, dtype)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    peak = max(sampler.peak, _host_mib())
    modules = (model.denoiser, model.vae, *model.text_encoders)
    sizes = [sum(p.numel() * p.element_size() for p in m.parameters()) / 2 ** 20 for m in modules]
    out = {"peak_delta_mib": round(peak - before), "modules_mib": round(sum(sizes)),
           "largest_module_mib": round(max(sizes)), "seconds": round(seconds, 1)}
    if cuda:
        out["gpu_peak_mib"] = round((torch.cuda.max_memory_allocated(device) - gpu_before) / 2 ** 20)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="/tmp/diffgraph-bench-sd15.safetensors")
    ap.add_argument("--preset", default="random:sd15")
    ap.add_argument("--before-src", default=None, help="a src/ tree to measure beside this one")
    ap.add_argument("--dtype", choices=("fp16", "fp32"), default="fp16", help="the dtype loaded to")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="the device loaded to (default: cuda where there is one, else cpu; meta: a stand-in)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.file, args.dtype, args.device)
    if not os.path.isfile(args.file):
        write(args.file, args.preset)
    print(f"# {args.file}: {os.path.getsize(args.file) / 2 ** 30:.2f} GiB; loaded to {args.dtype} on {args.device}; "
          f"torch {torch.__version__}")
    src = os.path.join(os.path.dirname(HERE), "src")
    for name, tree in (("before", args.before_src), ("this tree", src)):
        if tree is None:
            continue
        # the tree first, then the rest of the path (where a GPU host keeps the carried wheels: diffusers)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.abspath(tree),
                                                                         os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, __file__, "--file", args.file, "--dtype", args.dtype, "--device", args.device,
                   "--child"]
        out = subprocess.run(command, capture_output=True, text=True, env=env)
        if out.returncode:
            sys.exit(f"{name}: the load failed:\n{out.stderr[-3000:]}")
        print(name, out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
