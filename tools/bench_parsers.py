"""The user-text parsers on hostile input: time at 1x, 2x and 4x a size, the patterns they used to run against the
parsers as they are. A quadratic step takes ~4x the time per doubling (~16x from 1x to 4x), a linear one ~2x (~4x).

    PYTHONPATH=src python tools/bench_parsers.py [--base 4000] [--limit-base 24576] [--repeat 3]

"old" times the one step that was quadratic, with its former pattern (AUTOMATIC1111's infotext `re_param` findall,
the extra-network tag search, the BREAK split, the number and empty-tag matches), at `--base` characters and twice
and four times that; "new" times the whole parser (`parse_infotext`, `parse_a1111`) on the same text, then at
`--limit-base` (the A1111 route's infotext limit at the default --max-prompt-bytes; a prompt is held to
MAX_PROMPT_CHARS) and twice and four times that. Pure Python, one CPU thread; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Callable

from diffgraph.errors import ParamError
from diffgraph.image_metadata import parse_infotext
from diffgraph.prompt_syntax import parse_a1111

# the former patterns, as they were
OLD_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
OLD_EXTRA_NET = re.compile(r"<(\w+):([^>]+)>")
OLD_BREAK = re.compile(r"\s*\bBREAK\b\s*")
OLD_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
OLD_LORA_EMPTY = re.compile(r"<lora\s*:?\s*>", re.IGNORECASE)


def _prompt(text: str) -> None:
    try:
        parse_a1111(text)
    except ParamError:  # refused (an unknown extra network, a scale that is not a number): read to the end first
        pass


# name -> (hostile text of about n characters, the old quadratic step, the new parser)
CASES: dict[str, tuple[Callable[[int], str], Callable[[str], object], Callable[[str], object]]] = {
    "infotext: a word run, no ':'": (lambda n: "a" * n, OLD_PARAM.findall, parse_infotext),
    "infotext: 'a ' words, no ':'": (lambda n: "a " * (n // 2), OLD_PARAM.findall, parse_infotext),
    "infotext: spaces then '!'": (lambda n: "x\n" + " " * n + "!", lambda t: OLD_PARAM.findall(t.split("\n")[-1]),
                                  parse_infotext),
    "prompt: '<a:' repeated": (lambda n: "<a:" * (n // 3), lambda t: list(OLD_EXTRA_NET.finditer(t)), _prompt),
    "prompt: spaces then 'x'": (lambda n: " " * n + "x", OLD_BREAK.split, _prompt),
    "prompt: <lora:a:111...x>": (lambda n: "<lora:a:" + "1" * n + "x>",
                                 lambda t: OLD_NUMBER.fullmatch(t[8:-1]), _prompt),
    "prompt: '<lora' then spaces": (lambda n: "x <lora" + " " * n, lambda t: OLD_LORA_EMPTY.match(t, 2), _prompt),
    "prompt: '[a:' nested": (lambda n: "[a:" * (n // 4) + "]" * (n // 4), None, _prompt),
    "prompt: 'embedding:AND ' repeated": (lambda n: "embedding:AND " * (n // 14), None, _prompt),
}


def best(fn: Callable[[str], object], text: str, repeat: int) -> float:
    """The fastest of `repeat` runs, in seconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(text)
        times.append(time.perf_counter() - t0)
    return min(times)


def _row(name: str, fn: Callable[[str], object] | None, make: Callable[[int], str], base: int, repeat: int) -> str:
    if fn is None:
        return " — | — | — | —"
    times = [best(fn, make(base * k), repeat) for k in (1, 2, 4)]
    return " " + " | ".join(f"{t * 1e3:.2f}" for t in times) + f" | {times[2] / max(times[0], 1e-9):.1f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=int, default=4000, help="characters of the 1x text, old vs new")
    parser.add_argument("--limit-base", type=int, default=24576, help="characters of the 1x text, new at the limit")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (the fastest is shown)")
    args = parser.parse_args()
    b, lb = args.base, args.limit_base
    print(f"| input | old {b} / {2 * b} / {4 * b} chars (ms) | 4x/1x | new {b} / {2 * b} / {4 * b} (ms) | 4x/1x "
          f"| new {lb} / {2 * lb} / {4 * lb} (ms) | 4x/1x |")
    print("|---|---|---|---|---|---|---|")
    for name, (make, old, new) in CASES.items():
        old_cells = _row(name, old, make, b, 1).rsplit(" | ", 1)  # one run: the old steps take seconds
        new_cells = _row(name, new, make, b, args.repeat).rsplit(" | ", 1)
        limit_cells = _row(name, new, make, lb, args.repeat).rsplit(" | ", 1)
        cells = [c.strip().replace(" | ", " / ") for c in (*old_cells, *new_cells, *limit_cells)]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
