"""`diffgraph batch FILE --out DIR`: a job file (jobs/spec.py: JSONL, {"items"} or {"grid"})
made on a local engine, or with --url on a running server, which gets the job and is followed until it ends, its
images downloaded as they are made (cli_remote.py).

    diffgraph batch shots.jsonl --out shots/ --model digits             # on this machine
    diffgraph batch shots.jsonl --out shots/ --url http://gpu-host:8000  # on a server (--api-key or DIFFGRAPH_API_KEY)
    diffgraph batch plot.json --out plot/ --grid                        # and a contact sheet per item

Candidate K of item I is DIR/IIIII-K.png (I zero-padded to 5 digits), with its settings inside. Re-running the same
command resumes: a candidate whose image is in DIR carrying the settings it would be made with (read back from the
PNG: image_metadata.py) is not made again; the seeds drawn for items that give none are kept in
DIR/.diffgraph-batch.json, so a re-run draws the same. A change to an item (its negative prompt, a LoRA, its size)
makes its images again. --grid writes DIR/IIIII-sheet.png per item: its candidates side by side, each labelled with
its seed. On a terminal a progress line (items, images/s, ETA). Exit status 0 when every image is in DIR, 1 when
some failed (each listed), 2 for bad input (one line naming the line or item and the field, before anything runs).
Nothing heavy is imported to build the flags; the local engine is built as `diffgraph serve` builds it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from ..capability_settings import add_capability_flags, builtin_params, builtin_settings, capability_args, flag_of
from ..cli_flags import add_checkpoint_arguments
from .batch_work import Tally, Work, already_there, plan, read_spec, spec_sheets, write_sheets

if TYPE_CHECKING:
    from ..cli_progress import Progress
    from ..engine.client import EngineClient
    from ..api.config import ServerConfig
    from .spec import JobSpec

MAX_ATTEMPTS = 12    # submissions of an image answered "retry", then it fails


def add_batch_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("file", metavar="FILE", help="the job: JSONL (one item a line), or JSON {\"items\": [...]} or "
                                                "{\"grid\": {...}}")
    b.add_argument("--out", required=True, metavar="DIR", help="where the images go (DIR/ITEM-K.png); re-running "
                                                               "with the same DIR resumes")
    b.add_argument("--grid", action="store_true",
                   help="also write a contact sheet per item (DIR/ITEM-sheet.png): its candidates side by side, each "
                        "labelled with its seed")
    b.add_argument("--model", default=None, help="preset, local diffusers folder or checkpoint file (default: the "
                                                 "shipped digits model)")
    add_checkpoint_arguments(b)
    b.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    b.add_argument("--dtype", default=None, help="fp32, fp16 or bf16 (default: fp16 on cuda, fp32 on cpu)")
    b.add_argument("--lora-dir", default=None, metavar="DIR", help="the adapters items name in `loras`")
    b.add_argument("--lora-conv", action="store_true", help="side paths on convolutions too (LoCon, LCM-LoRA)")
    b.add_argument("--controlnet-dir", default=None, metavar="DIR", help="the ControlNets items name in `controls`")
    b.add_argument("--ip-adapter-dir", default=None, metavar="DIR",
                   help="the IP-Adapters items name in `image_prompts`")
    b.add_argument("--embeddings-dir", default=None, metavar="DIR",
                   help="the textual-inversion embeddings a1111-syntax prompts name")
    b.add_argument("--prompt-syntax", default=None, choices=("plain", "a1111"),
                   help="how prompts that do not say are read (default: plain)")
    b.add_argument("--inflight", type=int, default=None, metavar="N",
                   help="images in the engine at once (default: twice the largest batch bucket's rows)")
    b.add_argument("--max-items", type=int, default=100_000, metavar="N", help="the most items a job may hold")
    b.add_argument("--url", default=None, help="make the job on a running `diffgraph serve --state-dir DIR` at "
                                               "this URL, and follow it")
    b.add_argument("--api-key", default=None, help="with --url: the server's API key (default: $DIFFGRAPH_API_KEY)")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    add_capability_flags(b, builtin_settings())  # the built-in capabilities' settings (--step-cache: items naming none)


def run_batch(args: argparse.Namespace) -> int:
    from ..cli_checks import can_create_in, check_devices
    from ..cli_progress import progress_for
    from .files import make_folder

    remote = [f for f, v in (("--model", args.model), ("--device", args.device), ("--dtype", args.dtype),
                             ("--lora-dir", args.lora_dir), ("--embeddings-dir", args.embeddings_dir),
                             ("--vae", args.vae), ("--model-config", args.model_config),
                             ("--controlnet-dir", args.controlnet_dir), ("--ip-adapter-dir", args.ip_adapter_dir))
              if v is not None]
    remote += [flag_of(name, f) for name, fields in capability_args(args).items() for f in fields]
    if args.url is not None and remote:
        raise ValueError(f"{' and '.join(remote)} cannot be used with --url: the server serves its own model with "
                         "its own settings (GET /info)")
    if args.inflight is not None and not 1 <= args.inflight <= 4096:
        raise ValueError(f"--inflight {args.inflight} is out of range; allowed: 1..4096")
    try:
        with open(args.file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{args.file} cannot be read: {e.strerror or e}") from None
    out = os.path.abspath(args.out)
    try:
        make_folder(out)
    except OSError as e:
        raise ValueError(f"--out {args.out}: the folder cannot be made ({e.strerror or e}); choose another") from None
    if not can_create_in(out):
        raise ValueError(f"--out {args.out} is not a writable folder; choose another")
    form = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json"}.get(os.path.splitext(args.file)[1].lower(), "auto")

    def read(check: Callable[..., object] | None, extras: tuple[str, ...] | None = None) -> JobSpec:
        return read_spec(args, data, form, out, check, builtin_params() if extras is None else extras)

    read(None)  # its form first, before a model loads (the built-in capabilities' parameters let through)
    with progress_for(args) as progress:
        if args.url is not None:
            from .cli_remote import run_remote
            tally = run_remote(args, read, out, progress)
        else:
            check_devices(args)
            tally = run_local(args, read, out, progress)
    if tally is None:
        return 130
    if args.grid:
        write_sheets(spec_sheets(tally.spec, out), out)
    return tally.summary(args.out)


def run_local(args: argparse.Namespace, read: Callable[..., JobSpec], out: str, progress: Progress) -> Tally:
    from ..api.config import ServerConfig, with_capability_settings

    model = args.model
    if model is None:
        from ..models.presets import DEFAULT_MODEL
        model = DEFAULT_MODEL
    progress.phase(f"loading {os.path.basename(model.rstrip(os.sep)) or model}")
    config = ServerConfig(model=model, device=args.device, dtype=args.dtype, lora_dir=args.lora_dir,
                          lora_conv=args.lora_conv, embeddings_dir=args.embeddings_dir,
                          prompt_syntax=args.prompt_syntax or "plain", vae=args.vae, model_config=args.model_config,
                          prediction_type=args.prediction_type, zero_snr=args.zero_snr,
                          controlnet_dir=args.controlnet_dir, ip_adapter_dir=args.ip_adapter_dir)
    config = with_capability_settings(config, capability_args(args))
    import torch

    from ..config import default_cpu_threads
    from ..engine.async_engine import AsyncEngine
    from ..engine.engine import Engine, default_device
    from .backend import item_request

    if (args.device or default_device()).startswith("cpu"):
        torch.set_num_threads(default_cpu_threads())  # as the server does
    engine = Engine(**config.engine_kwargs())
    try:
        info, client = engine.info, AsyncEngine(engine)
        # the model's rules (the server's check of a job), before any image
        spec = read(partial(item_request, config, info, check_extras=client.check_extras), info.extension_params)
        tally = Tally(spec, progress)
        todo = already_there(plan(spec, config, info, out, lambda body: ()), tally)
        asyncio.run(_make_all(client, config, todo, args.inflight or 2 * info.max_rows, tally))
    finally:
        engine.close()
    return tally


async def _make_all(client: EngineClient, config: ServerConfig, todo: list[Work], inflight: int, tally: Tally) -> None:
    """Makes every candidate of `todo`, `inflight` at a time in order, retrying those answered "retry"."""
    from .backend import CandidateError, EngineBackend
    from .files import ImageWriteError, write_image

    backend = EngineBackend(config, info=lambda: client.info, submit=client.submit)
    queue = deque(todo)

    async def worker() -> None:
        while queue:
            w = queue.popleft()
            for attempt in range(1, MAX_ATTEMPTS + 1):
                try:
                    data = await backend.generate(w.request)
                    await asyncio.to_thread(write_image, w.path, data, "--out")
                    tally.done(w.item)
                    break
                except CandidateError as e:
                    if e.retryable and attempt < MAX_ATTEMPTS:
                        await asyncio.sleep(min(30.0, 0.25 * 2 ** (attempt - 1)))
                        continue
                    tally.fail(w.item, w.k, e.message)
                    break
                except ImageWriteError as e:
                    tally.fail(w.item, w.k, str(e))
                    break

    await asyncio.gather(*(worker() for _ in range(min(inflight, len(todo)))))


