"""What `diffgraph batch` (cli_batch.py, cli_remote.py) works on: the job file read with the seeds a previous run
kept in DIR (`read_spec`), every candidate's request and path (`plan`), those already in DIR with their settings
(`already_there`), the count the progress line and the summary show (`Tally`), and the contact sheets
(`write_sheets`). Nothing heavy is imported at module level."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..cli_progress import Progress
    from ..request import GenerationRequest, ModelInfo
    from ..api.config import ServerConfig
    from .spec import JobSpec

MANIFEST = ".diffgraph-batch.json"
SHOWN_FAILURES = 20  # failures listed at the end (the rest counted)


@dataclass
class Work:
    """One candidate: item `item`'s image `k`, its request and where its image goes."""

    item: int
    k: int
    seed: int
    body: dict[str, Any]
    path: str
    request: GenerationRequest
    expected: dict[str, Any] | None
    ignore: tuple[str, ...] = ()


class Tally:
    """What the progress line and the summary say: items and images done, failed, already in DIR; images/s."""

    def __init__(self, spec: JobSpec, progress: Progress):
        self.spec = spec
        self.items, self.images = len(spec.items), spec.candidates
        self.left = {i: item.n for i, item in enumerate(spec.items)}
        self.made = self.kept = self.failed = 0
        self.failures: list[tuple[int, int, str]] = []
        self.progress, self.t0 = progress, time.monotonic()

    def done(self, item: int, made: bool = True) -> None:
        self.left[item] -= 1
        self.made, self.kept = self.made + made, self.kept + (not made)
        self.show()

    def fail(self, item: int, k: int, error: str) -> None:
        self.left[item] -= 1
        self.failed += 1
        self.failures.append((item, k, error))
        self.show()

    def rate(self) -> float:
        return self.made / max(1e-3, time.monotonic() - self.t0)

    def show(self) -> None:
        rate, pending = self.rate(), self.images - self.made - self.kept - self.failed
        eta = f"{pending / rate:.0f} s" if rate > 0 else "?"
        done_items = sum(1 for v in self.left.values() if v == 0)
        self.progress.phase(f"items {done_items}/{self.items}, images {self.images - pending}/{self.images}"
                            f"{f' ({self.failed} failed)' if self.failed else ''}, {rate:.2f} images/s, ETA {eta}; "
                            "last image")

    def summary(self, out: str) -> int:
        took = time.monotonic() - self.t0
        print(f"{out}: {self.made + self.kept} of {self.images} images ({self.made} made, {self.kept} already there), "
              f"{self.failed} failed, {took:.1f} s, {self.rate():.2f} images/s", file=sys.stderr)
        for item, k, error in self.failures[:SHOWN_FAILURES]:
            print(f"  item {item} candidate {k}: {error}", file=sys.stderr)
        if len(self.failures) > SHOWN_FAILURES:
            print(f"  ... and {len(self.failures) - SHOWN_FAILURES} more", file=sys.stderr)
        return 1 if self.failed else 0


def read_spec(args: argparse.Namespace, data: bytes, form: str, out: str, check: Callable[..., object] | None,
              extras: tuple[str, ...]) -> JobSpec:
    """The job file, its drawn seeds replaced by those a previous run kept in DIR (and the new ones kept). `check`
    and `extras`: parse_job's (the model's, once it is known)."""
    import dataclasses

    from .files import write_image
    from .spec import MAX_CANDIDATES, SpecError, SpecLimits, parse_job

    try:
        limits = SpecLimits(max_items=args.max_items, max_candidates=args.max_items * MAX_CANDIDATES)  # this machine's
        spec = parse_job(data, form, limits, check, extras=extras)
    except SpecError as e:
        raise ValueError(f"{args.file}: {e.message}") from None
    path = os.path.join(out, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        kept = manifest["seeds"]
        if not isinstance(kept, dict):
            raise ValueError("not a manifest")
    except (OSError, ValueError, KeyError, TypeError):
        manifest, kept = {}, {}
    items = list(spec.items)
    for i, item in enumerate(items):
        if item.drawn:
            seeds = kept.get(str(i))
            if isinstance(seeds, list) and len(seeds) == item.n and all(isinstance(s, int) for s in seeds):
                items[i] = dataclasses.replace(item, seeds=tuple(seeds))
            kept[str(i)] = list(items[i].seeds)
    manifest.update(file=os.path.abspath(args.file), seeds=kept)
    write_image(path, json.dumps(manifest).encode(), "--out")
    return dataclasses.replace(spec, items=tuple(items))


def plan(spec: JobSpec, config: ServerConfig, info: ModelInfo, out: str, ignore: Callable[[dict], tuple[str, ...]]
         ) -> list[Work]:
    """Every candidate's request and image path. An item's images (controls, image prompts) are decoded once, with
    its first candidate's request, and shared by the others: not one copy per seed held for the whole run."""
    from ..image_metadata import request_fields
    from .backend import CandidateError, build_request

    work = []
    for i, item in enumerate(spec.items):
        first = None
        for k, seed in enumerate(item.seeds):
            try:
                request = build_request(config, info, item.body, seed, "batch", like=first)
                first = first or request
            except CandidateError as e:
                raise ValueError(f"item {i}: {e.message}") from None
            work.append(Work(i, k, seed, item.body, os.path.join(out, f"{i:05d}-{k}.png"), request,
                             request_fields(request, info.name), ignore(item.body)))
    return work


def already_there(work: list[Work], tally: Tally) -> list[Work]:
    """The candidates still to make; those whose image is in DIR with their settings are counted as done."""
    from .files import matches

    todo = []
    for w in work:
        if os.path.exists(w.path) and matches(w.path, w.expected, w.ignore):
            tally.done(w.item, made=False)
        else:
            todo.append(w)
    return todo


# -- contact sheets ---------------------------------------------------------------------------------------------
def spec_sheets(spec: JobSpec, out: str) -> list[tuple[int, list[str], tuple[int, ...]]]:
    return [(i, [os.path.join(out, f"{i:05d}-{k}.png") for k in range(item.n)], item.seeds)
            for i, item in enumerate(spec.items)]


def write_sheets(items: list[tuple[int, list[str], tuple[int, ...]]], out: str) -> int:
    """DIR/IIIII-sheet.png for every item whose candidates are all in DIR: side by side, each labelled with its
    seed. Returns how many were written."""
    import io

    from PIL import Image, ImageDraw, ImageFont

    from .files import write_image

    font = ImageFont.load_default()
    written = 0
    for i, paths, seeds in items:
        try:
            images = [Image.open(p).convert("RGB") for p in paths]
        except OSError:  # a failed candidate: no sheet for this item
            continue
        labels = [f"seed {s}" for s in seeds]
        probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
        width = max([im.width for im in images] + [int(probe.textlength(t, font=font)) + 8 for t in labels])
        height, pad, label = max(im.height for im in images), 4, 16
        sheet = Image.new("RGB", (len(images) * (width + pad) + pad, height + label + 2 * pad), "white")
        draw = ImageDraw.Draw(sheet)
        for n, (im, text) in enumerate(zip(images, labels)):
            x = pad + n * (width + pad)
            sheet.paste(im, (x + (width - im.width) // 2, pad))
            draw.text((x + 4, pad + height + 2), text, fill="black", font=font)
        buf = io.BytesIO()
        sheet.save(buf, format="PNG")
        write_image(os.path.join(out, f"{i:05d}-sheet.png"), buf.getvalue(), "--out")
        written += 1
    return written
