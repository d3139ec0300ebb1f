"""Peak host (and device) memory of loading a split Z-Image transformer file (ComfyUI's layout: fused qkv under
`model.diffusion_model.`, bf16, random weights): the whole-dict path (`zimage_files.read_transformer`, a module built
with random weights on the device, `load_into`: what the families' load_split did before) against the streamed one
(`split_stream.load_transformer`: a module built on meta, each tensor read straight to the device and assigned), each
in a fresh subprocess. Host memory is sampled every 5 ms while it loads (bench_stream_load's RssAnon + RssFile +
shared memory); the figure is its peak minus its value before the load (imports and CUDA's start do not count),
beside the loaded module's size, the file's largest tensor and, on a GPU, torch.cuda.max_memory_allocated over the
load.

    PYTHONPATH=src python tools/bench_split_load.py [--file /tmp/diffgraph-bench-split/z_image_bench_bf16.safetensors]
        [--gb 1.5] [--dim 2048] [--device cpu] [--dtype bf16] [--only streamed]

The file (a ZImageTransformer2DModel of `--dim` wide layers, as many as make about `--gb` GiB in bf16) is written once
and reused (`--write-only` writes it and stops)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_stream_load import PeakSampler, _host_mib  # noqa: E402

PREFIX = "model.diffusion_model."
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def config(dim: int, layers: int) -> dict:
    head = 128 if dim >= 1024 else 32
    return dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=dim, n_layers=layers,
                n_refiner_layers=2, n_heads=dim // head, n_kv_heads=dim // head, cap_feat_dim=dim,
                axes_dims=[head // 4, head * 3 // 8, head * 3 // 8])


def _meta_state(dim: int, layers: int) -> dict[str, torch.Tensor]:
    from diffusers import ZImageTransformer2DModel

    with torch.device("meta"):
        return ZImageTransformer2DModel(**config(dim, layers)).state_dict()


def write(path: str, gb: float, dim: int) -> None:
    """A random transformer of about `gb` GiB in bf16, in ComfyUI's layout, tensor by tensor into one file."""
    from safetensors.torch import save_file

    one, two = (sum(t.numel() for t in _meta_state(dim, n).values()) * 2 for n in (1, 2))
    layers = max(1, round((gb * 2 ** 30 - one) / (two - one)) + 1)
    state, g = _meta_state(dim, layers), torch.Generator().manual_seed(0)
    out = {}
    for key, meta in state.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        shape = (meta.shape[0] * 3, *meta.shape[1:]) if ".attention.to_q." in key else tuple(meta.shape)
        key = key.replace(".to_q.", ".qkv.").replace("all_x_embedder.2-1.", "x_embedder.")
        key = key.replace("all_final_layer.2-1.", "final_layer.").replace(".to_out.0.", ".out.")
        key = key.replace(".norm_q.", ".q_norm.").replace(".norm_k.", ".k_norm.")
        out[PREFIX + key] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_file(out, path + ".part")
    os.replace(path + ".part", path)


def whole_dict(path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The load_split path before the streamed one, as it was."""
    from diffusers import ZImageTransformer2DModel

    from diffgraph.models import zimage_files as zf

    weights = zf.read_transformer(path, dtype, device=device)
    with torch.device(device):
        model = ZImageTransformer2DModel(**zf.transformer_config(weights.state, weights.fp8)).to(dtype)
    zf.load_into(model, weights)
    return model


def child(path: str, how: str, dtype: torch.dtype, device: torch.device) -> None:
    from diffusers import ZImageTransformer2DModel  # noqa: F401 (imported before the baseline)

    from diffgraph.models import split_stream
    from diffgraph.safe_tensors import TensorFile

    if device.type == "cuda":
        torch.zeros(1, device=device)
        torch.cuda.reset_peak_memory_stats(device)
    before, sampler = _host_mib(), PeakSampler()
    sampler.start()
    start = time.perf_counter()
    if how == "whole dict":
        model = whole_dict(path, dtype, device)
    else:
        model = split_stream.load_transformer(path, dtype, device)[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    peak = max(sampler.peak, _host_mib())
    with TensorFile(path) as f:
        largest = max(t.end - t.begin for t in f.header.tensors.values())
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(json.dumps({"how": how, "device": str(device), "peak_delta_mib": round(peak - before),
                      "module_mib": round(size / 2 ** 20, 1), "largest_tensor_mib": round(largest / 2 ** 20, 1),
                      "device_peak_mib": round(torch.cuda.max_memory_allocated(device) / 2 ** 20, 1)
                      if device.type == "cuda" else None, "seconds": round(seconds, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="/tmp/diffgraph-bench-split/z_image_bench_bf16.safetensors")
    ap.add_argument("--gb", type=float, default=1.5, help="size of the written file (bf16)")
    ap.add_argument("--dim", type=int, default=2048, help="the transformer's width")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="the dtype loaded to")
    ap.add_argument("--only", choices=("whole dict", "streamed"), help="one path only")
    ap.add_argument("--write-only", action="store_true")
    ap.add_argument("--child", choices=("whole dict", "streamed"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.file, args.child, DTYPES[args.dtype], torch.device(args.device))
    if not os.path.isfile(args.file):
        write(args.file, args.gb, args.dim)
    if args.write_only:
        return
    print(f"# {args.file}: {os.path.getsize(args.file) / 2 ** 30:.2f} GiB; loaded to {args.dtype} on {args.device}; "
          f"torch {torch.__version__}")
    for how in (args.only,) if args.only else ("whole dict", "streamed"):
        out = subprocess.run([sys.executable, __file__, "--file", args.file, "--dtype", args.dtype, "--device",
                              args.device, "--child", how], capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{how}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
