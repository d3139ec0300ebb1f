"""The command line's checks made before any model loads, each failing with one line that names the fix: an output
folder that cannot be written, a CUDA device this torch cannot run, an adapter given as a file path, a mistyped name.

cli.py calls them (its `main` turns the ValueErrors into "diffgraph: error: ..." and exit 2); `cuda_device_error`
suits any entry point that takes a device. Only `cuda_device_error` imports torch, and only for a CUDA device.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tempfile
from typing import Iterable

SUFFIX = ".safetensors"


def can_create_in(folder: str) -> bool:
    """Whether a file can be created in `folder`, by creating (and removing) one: `os.access` says yes to root
    everywhere, /proc and read-only mounts included."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".diffgraph-", suffix=".probe")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """"; did you mean 'euler'?" for the known names nearest to a mistyped one, or ""."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def cuda_device_error(device: str | None) -> str | None:
    """Why `device` (cuda, cuda:N) cannot be used by this torch, with the fix, or None (also for cpu)."""
    if device is None or not device.strip().lower().startswith("cuda"):
        return None
    import torch

    if not torch.backends.cuda.is_built():
        return (f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build (pip install torch "
                "--index-url https://download.pytorch.org/whl/cu128; see https://pytorch.org/get-started/locally) "
                "or use --device cpu")
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU; check the NVIDIA driver and "
                "CUDA_VISIBLE_DEVICES, or use --device cpu")
    return None


def check_devices(args: argparse.Namespace) -> None:
    """Raises ValueError when --device or --devices names CUDA where this torch cannot run it."""
    for flag in ("--device", "--devices"):
        value = getattr(args, flag[2:], None)
        for device in (value or "").split(","):
            error = cuda_device_error(device)
            if error:
                raise ValueError(f"{flag} {value}: {error}")


def is_file_path(name: str) -> bool:
    """Whether an adapter name given to --lora is a file path (an adapter's name has no suffix and is relative)."""
    return name.lower().endswith(SUFFIX) or os.path.isabs(name) or name.startswith(("./", "../", "~"))


def lora_path_error(path: str, remote: bool, lora_dir: str | None) -> str:
    """--lora takes a name (its path under --lora-dir without the suffix), never a file path: the flags to give
    instead (`remote`: with --url, where the server's --lora-dir holds the adapters)."""
    if remote:
        return (f"--lora {path!r} is a file path; with --url give the name of an adapter in the server's --lora-dir "
                "(GET /v1/loras lists them)")
    stem = path[:-len(SUFFIX)] if path.lower().endswith(SUFFIX) else path
    if lora_dir is not None:
        inside = os.path.relpath(os.path.abspath(os.path.expanduser(stem)), os.path.abspath(lora_dir))
        if inside != os.pardir and not inside.startswith(os.pardir + os.sep):
            return (f"--lora {path!r} is a file path; --lora takes its name under --lora-dir: "
                    f"--lora {inside.replace(os.sep, '/')}")
    folder, name = os.path.split(stem)
    return (f"--lora {path!r} is a file path; --lora takes a name in --lora-dir: --lora-dir {folder or '.'} "
            f"--lora {name}")
