"""Load time of a single-file checkpoint against the same weights as a diffusers folder (issue 29's target: an SDXL
single file, fp16, warm page cache, min of 3, within 1.5x of the folder), to modules on the device.

    python tools/bench_single_file.py --presets random:sdxl,random:sd15 --work /tmp/ckpt   # on the GPU host

Writes each full-size random preset as a diffusers folder (fp16) and as one original-layout .safetensors file
(tests/original_layout.py inverts diffusers' key conversion), reads both files once to warm the page cache, then
times `load_model(path, "cuda", "fp16")` (the file's kind detected from its keys, its config written offline) and
`load_model(folder, ...)` alternately, each followed by a synchronize. Prints a table; --json writes the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import original_layout as O  # noqa: E402

from diffgraph.models.loader import load_model  # noqa: E402

LAYOUT = {"random:sd15": "sd1", "random:sdxl": "sdxl"}


def _warm(path: str) -> None:
    for here, _dirs, files in os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [],
                                                                         [os.path.basename(path)])]:
        for name in files:
            with open(os.path.join(here, name), "rb") as f:
                while f.read(1 << 26):
                    pass


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(h, f)) for h, _d, fs in os.walk(path) for f in fs)


def _timed(source: str, device: str) -> float:
    t0 = time.perf_counter()
    model = load_model(source, device, "fp16")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    assert next(model.unet.parameters()).device.type == torch.device(device).type
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="random:sdxl")
    p.add_argument("--work", default="/tmp/ckpt")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    rows = []
    for preset in args.presets.split(","):
        folder = os.path.join(args.work, preset.replace(":", "-"))
        path = folder + ".safetensors"
        t0 = time.perf_counter()
        O.write_folder(load_model(preset, args.device, "fp16"), folder)
        O.write_single_file(folder, path, LAYOUT[preset], dtype=torch.float16)
        written = time.perf_counter() - t0
        _warm(folder)
        _warm(path)
        _timed(path, args.device)  # the first load writes the config folder and imports the loaders
        times: dict[str, list[float]] = {"file": [], "folder": []}
        for _ in range(args.rounds):
            times["file"].append(_timed(path, args.device))
            times["folder"].append(_timed(folder, args.device))
        row = {"preset": preset, "file_gb": _size(path) / 1e9, "folder_gb": _size(folder) / 1e9,
               "file_s": min(times["file"]), "folder_s": min(times["folder"]), "all": times, "write_s": written}
        row["ratio"] = row["file_s"] / row["folder_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'preset':14s} {'file GB':>8s} {'folder GB':>9s} {'file s':>8s} {'folder s':>9s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['preset']:14s} {r['file_gb']:8.2f} {r['folder_gb']:9.2f} {r['file_s']:8.2f} {r['folder_s']:9.2f} "
              f"{r['ratio']:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
