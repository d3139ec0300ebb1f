"""Peak memory and time of one image's decode by Z-Image's VAE (Flux's 16-channel AutoencoderKL, random weights):
whole at the native size and twice it, and through the engine's path at twice it (`FamilyAdapter.vae_decode`:
diffusers' tiles above the native area). Native 1024 (the VAE's): 1024x1024 and 2048x2048, the largest size the
server accepts; a smaller native size (the config's sample_size set to it) scales the same decode down for a CPU.

    PYTHONPATH=src python tools/tiled_decode_memory.py cuda          # bf16, native 1024
    PYTHONPATH=src python tools/tiled_decode_memory.py cpu 256       # fp32, native 256: 256x256 and 512x512

On CUDA the peak is torch's allocated bytes above the weights; on the CPU the process's peak resident memory
(weights and torch included), each decode in a fresh process (ru_maxrss only grows).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from types import SimpleNamespace

import torch


def decode(device: str, native: int, size: int, tiled: bool) -> dict:
    from diffusers import AutoencoderKL

    from diffgraph.models.families.zimage import FLUX_VAE, ZImageFamily

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    vae = AutoencoderKL(**{**FLUX_VAE, "sample_size": native}).to(device, dtype).eval()
    family, model = ZImageFamily(), SimpleNamespace(native_size=native, vae=vae)
    z = torch.randn(1, 16, size // 8, size // 8, device=device, dtype=dtype)
    with torch.no_grad():
        if device == "cuda":
            vae.decode(z[..., :16, :16], return_dict=False)  # the kernels' first use, outside the measure
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            image = family.vae_decode(model, vae, z) if tiled else vae.decode(z, return_dict=False)[0]
            if device == "cuda":
                torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError:
            return {"size": size, "tiled": tiled, "error": "out of memory"}
        seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    assert tuple(image.shape) == (1, 3, size, size)
    return {"size": size, "tiled": tiled, "peak_gib": round(peak / 2**30, 2), "seconds": round(seconds, 2)}


def main(argv: list[str]) -> int:
    if len(argv) == 5:  # a child: one decode
        print(json.dumps(decode(argv[1], int(argv[2]), int(argv[3]), argv[4] == "1")))
        return 0
    device = argv[1] if len(argv) > 1 else "cuda"
    native = int(argv[2]) if len(argv) > 2 else 1024
    for size in (native, 2 * native):
        for tiled in ((False,) if size == native else (False, True)):  # the native area decodes whole
            out = subprocess.run([sys.executable, __file__, device, str(native), str(size), "1" if tiled else "0"],
                                 capture_output=True, text=True)
            lines = out.stdout.strip().splitlines()
            print(lines[-1] if lines else json.dumps({"size": size, "tiled": tiled,
                                                      "error": out.stderr.strip().splitlines()[-1:]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
