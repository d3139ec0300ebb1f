"""AUTOMATIC1111's prompt syntax, read into weighted text pieces: the one parser of an "a1111" prompt.

`parse_a1111(prompt, field)` owns the reading of a prompt written for AUTOMATIC1111's web UI, in the order the
web UI applies it: extra-network tags (`<lora:NAME:SCALE>`, taken out of the text into `loras`), ComfyUI-style
`embedding:NAME` references (the prefix dropped, the name kept in the text for the token matcher of chunks.py,
recorded in `embeddings`), then emphasis as AUTOMATIC1111's `parse_prompt_attention`: `(x)` x1.1, `[x]` /1.1,
`(x:w)`, nesting multiplies, `\\(` `\\)` `\\[` `\\]` `\\\\` escapes, unbalanced open brackets weight the rest,
BREAK starts a new chunk. It hands a `ParsedPrompt` (plain data) to text/prepared.py, which tokenises the pieces
(chunks.py), and to request.py, which adds the tags to the request's adapters.

What the web UI reads and diffgraph cannot do (prompt editing `[a:b:0.5]`, alternation `[a|b]`, composable
`AND`, separate text-encoder and UNet LoRA scales, other extra networks) is refused with a `ParamError` naming the
prompt's field and saying how to write it instead, never read silently as something else. Emphasis follows the web
UI's code where it differs from its docstring, so that a prompt gives the web UI's tokens and weights: a lone
backslash disappears, and a BREAK inside brackets has its marker weighted with the text (`(a BREAK b)` holds
("BREAK", -1.1), which chunks.py, like tokenize_line, encodes as the word, not as a break).

Pure Python, no torch: it runs on the submitting thread and in the HTTP process.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass
from itertools import pairwise

from .errors import ParamError

BREAK = ("BREAK", -1.0)        # the piece that marks a BREAK (AUTOMATIC1111's marker)
ROUND = 1.1                    # (x)
SQUARE = 1 / 1.1               # [x]: the web UI multiplies by this constant (not a division: same floats)
MAX_OPEN = 100                 # brackets of one kind open at once: weight work is pieces x depth, keep it bounded
_SHOWN = 60                    # characters of a prompt quoted in an error

# Every pattern here runs in time linear in the prompt, whatever its text: no two neighbouring parts of a pattern
# may match the same run of characters (`\s*:?\s*`, `\d+\.?\d*`), and a search whose failure scans to the end is
# bounded so that it is not repeated from each start (`_take_loras`, `_split_breaks`). tools/bench_parsers.py.
# <name:args>: AUTOMATIC1111's extra-network tag (modules/extra_networks.py)
_EXTRA_NET = re.compile(r"<(\w+):([^>]+)>")
_LORA_LEFT = re.compile(r"<lora(?=\s*(?::|>|$))", re.IGNORECASE)  # what is left of a tag that did not close
_LORA_EMPTY = re.compile(r"<lora\s*(?::\s*)?>", re.IGNORECASE)
_EMBEDDING = re.compile(r"(?<!\w)embedding:([A-Za-z0-9_\-./]*)")
_AND = re.compile(r"\bAND\b")
_BREAK = re.compile(r"\bBREAK\b")  # with the spaces around it (_split_breaks)
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_SPACED_NUMBER = re.compile(rf"\s*{_NUMBER.pattern}\s*")  # matched in place: no copy of a bracket's text
# the token stream of parse_prompt_attention (its branches, in its order)
_ATTENTION = re.compile(r"""
    \\[\\()\[\]]                  # an escaped bracket or backslash: that character
  | \( | \[
  | :\s*([+-]?[.\d]+)\s*\)        # the end of (text:weight)
  | \) | ]
  | [^\\()\[\]:]+                 # plain text
  | : | \\                        # a colon: text; a lone backslash: dropped
""", re.VERBOSE)
# the lark grammar's view, for finding [from:to:when] and [a|b]: a backslash escapes any one character
_SCHEDULE = re.compile(r"\\.|[()\[\]:|]|[^\\()\[\]:|]+|\\", re.DOTALL)
# what marks a prompt written for AUTOMATIC1111 (`a1111_marks`): a LoRA tag, a weight; a failed match stops at the
# next "<" or bracket, so each character is scanned from one start only
_LORA_MARK = re.compile(r"<lora:[^<>]*>", re.IGNORECASE)
_WEIGHT_MARK = re.compile(rf"\([^()\\:]+:{_SPACED_NUMBER.pattern}\)")
MARKS = {"lora": "<lora:...> tags", "weight": "(word:1.3) weights"}


@dataclass(frozen=True)
class ParsedPrompt:
    """A prompt read with AUTOMATIC1111's syntax."""
    pieces: tuple[tuple[str, float], ...]  # parse_prompt_attention's (text, weight) runs; BREAK marks a BREAK
    loras: tuple[tuple[str, float], ...]   # <lora:NAME:SCALE> tags in order of appearance (scale 1.0 if omitted)
    embeddings: tuple[str, ...]            # names written as embedding:NAME, in order of first appearance


def parse_a1111(prompt: str, field: str = "prompt") -> ParsedPrompt:
    """`prompt` read as AUTOMATIC1111 reads it; a ParamError(field, ...) for what diffgraph does not support."""
    text, loras = _take_loras(prompt, field)
    text, embeddings, spans = _take_embeddings(text, field)
    _refuse_and(text, spans, field)
    _refuse_scheduling(text, field)
    return ParsedPrompt(_attention(text, field), loras, embeddings)


def a1111_marks(prompt: str) -> tuple[str, ...]:
    """Which of AUTOMATIC1111's marks (`MARKS`: LoRA tags, weights) a prompt holds: what a prompt read as plain text
    takes as words. Linear in the prompt."""
    return tuple(mark for mark, pattern in (("lora", _LORA_MARK), ("weight", _WEIGHT_MARK)) if pattern.search(prompt))


def _show(text: str) -> str:
    """`text` quoted for an error message, shortened."""
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "...")


# -- extra networks ------------------------------------------------------------------------------------

def _take_loras(prompt: str, field: str) -> tuple[str, tuple[tuple[str, float], ...]]:
    """The prompt without its extra-network tags (each replaced by nothing, as the web UI does) and the LoRA ones."""
    loras: list[tuple[str, float]] = []
    kept: list[str] = []
    end = 0
    # a '<' with no '>' after it opens no tag: searching only up to the last '>' keeps each '<' from scanning to the
    # end of the prompt (quadratic in a prompt of many '<a:')
    for m in _EXTRA_NET.finditer(prompt, 0, prompt.rfind(">") + 1):
        kept.append(prompt[end:m.start()])
        end = m.end()
        loras.append(_lora(m.group(0), m.group(1), m.group(2), field))
    kept.append(prompt[end:])
    text = "".join(kept)
    left = _LORA_LEFT.search(text)
    empty = _LORA_EMPTY.match(text, left.start()) if left is not None else None
    if empty is not None:
        raise ParamError(field, f"{field} has {_show(empty.group(0))}, which names no adapter; write "
                                "<lora:NAME:SCALE>, e.g. <lora:styles/ink:0.8>")
    if left is not None:
        raise ParamError(field, f"{field} has a LoRA tag that does not close: {_show(text[left.start():])}; write "
                                "<lora:NAME:SCALE> with a closing '>', e.g. <lora:styles/ink:0.8>")
    return text, tuple(loras)


def _lora(tag: str, network: str, args: str, field: str) -> tuple[str, float]:
    """(name, scale) of one `<network:args>` tag (AUTOMATIC1111's Lora extension's argument rules)."""
    if network != "lora" and network.lower() == "lora":
        raise ParamError(field, f"{field} has {_show(tag)}; extra-network names are lowercase: write "
                                f"{_show(f'<lora:{args}>')}")
    if network != "lora":
        raise ParamError(field, f"{field} has the extra-network tag {_show(tag)} ({network!r}), which diffgraph "
                                "does not apply: only LoRA adapters, written <lora:NAME:SCALE>; remove the tag")
    if "<" in args:
        raise ParamError(field, f"{field} has a LoRA tag that does not close before the next '<': {_show(tag)}; "
                                "write <lora:NAME:SCALE> with a closing '>'")
    items = [item.strip() for item in args.split(":")]
    name, values = items[0], items[1:]
    if any("=" in item for item in items):
        raise ParamError(field, f"{field} has {_show(tag)} with named arguments (te=, unet=, dyn=); diffgraph "
                                "applies one scale to both the text encoder and the UNet: write <lora:NAME:SCALE>")
    if not name:
        raise ParamError(field, f"{field} has {_show(tag)}, which names no adapter; write <lora:NAME:SCALE>, "
                                "e.g. <lora:styles/ink:0.8>")
    if not name.isprintable():
        raise ParamError(field, f"{field} has {_show(tag)}, whose adapter name {name!r} holds a line break or "
                                "another control character; write the name on one line")
    if len(values) > 2:
        raise ParamError(field, f"{field} has {_show(tag)} with {len(values)} arguments after the name; diffgraph "
                                "reads <lora:NAME> or <lora:NAME:SCALE> (one scale for the text encoder and the "
                                "UNet; DyLoRA's dyn argument is not supported)")
    scales = [_lora_scale(tag, name, v, field) for v in values] or [1.0]
    if len(scales) == 2 and scales[0] != scales[1]:
        raise ParamError(field, f"{field} has {_show(tag)}: text-encoder scale {values[0]} and UNet scale "
                                f"{values[1]}; diffgraph applies one scale to both, so write <lora:{name}:SCALE> "
                                f"(e.g. <lora:{name}:{values[1]}>)")
    return name, scales[0]


def _lora_scale(tag: str, name: str, value: str, field: str) -> float:
    if _NUMBER.fullmatch(value) is None:
        raise ParamError(field, f"{field} has {_show(tag)}, whose scale {value!r} is not a number; write "
                                f"<lora:{name}:SCALE>, e.g. <lora:{name}:0.8>")
    scale = float(value)
    if not math.isfinite(scale):
        raise ParamError(field, f"{field} has {_show(tag)}, whose scale {value} is not finite; write a scale "
                                f"such as <lora:{name}:0.8>")
    return scale


# -- embeddings ----------------------------------------------------------------------------------------

def _take_embeddings(text: str, field: str) -> tuple[str, tuple[str, ...], list[tuple[int, int]]]:
    """The text with each `embedding:` prefix dropped (the name stays, for the token matcher), the names, and
    where the names now stand (so that an embedding called AND is not read as composable diffusion)."""
    names: list[str] = []
    spans: list[tuple[int, int]] = []
    kept: list[str] = []
    end = length = 0
    for m in _EMBEDDING.finditer(text):
        name = m.group(1).rstrip(".")  # a full stop after the name ends the sentence, not the name
        if not name:
            raise ParamError(field, f"{field} has 'embedding:' with no name after it ({_show(text[m.start():])}); "
                                    "write embedding:NAME (letters, digits, _ - . /), e.g. embedding:easynegative")
        if any(part in ("", ".", "..") for part in name.split("/")):
            raise ParamError(field, f"{field} names embedding {name!r}, which is not a name inside the embeddings "
                                    "folder; write embedding:NAME or embedding:folder/NAME (no empty, '.' or '..' "
                                    "parts)")
        kept.append(text[end:m.start()])
        length += m.start() - end
        spans.append((length, length + len(name)))
        end = m.start(1)
        if name not in names:
            names.append(name)
    kept.append(text[end:])
    return "".join(kept), tuple(names), spans


# -- what AUTOMATIC1111 reads and diffgraph does not ---------------------------------------------------

def _refuse_and(text: str, names: list[tuple[int, int]], field: str) -> None:
    starts = [a for a, _ in names]  # in order, not overlapping
    for m in _AND.finditer(text):
        at = bisect.bisect_right(starts, m.start()) - 1
        if at < 0 or m.start() >= names[at][1]:
            raise ParamError(field, f"{field} uses 'AND' ({_show(text[max(0, m.start() - 20):m.end() + 20])}): "
                                    "AUTOMATIC1111's composable diffusion, which diffgraph does not support; send "
                                    "one prompt, or write 'and' in lowercase to keep the word")


def _refuse_scheduling(text: str, field: str) -> None:
    """Refuses each `[...]` that the web UI's lark grammar reads as prompt editing or alternation: a bracket whose
    content is well formed (nested brackets balanced and themselves well formed, no stray `)` or `]`) with bars
    (`alternate`), or with one or two colons and a number after the last (`scheduled`). Colons and bars count at
    the bracket's own level only (not inside a nested `(x:1.2)`); a backslash and the character after it are text."""
    stack: list[_Open] = []
    spoilt = 0   # stack[:spoilt] hold a stray closing bracket: not well formed (an index, not a loop per stray)
    squares = 0  # how many of the open brackets are "["
    for m in _SCHEDULE.finditer(text):
        token = m.group(0)
        if token in ("(", "["):
            stack.append(_Open(token, m.start()))
            squares += token == "["
        elif token in (")", "]") and stack and stack[-1].bracket == ("(" if token == ")" else "["):
            frame = stack.pop()
            squares -= token == "]"
            frame.well_formed &= len(stack) >= spoilt
            spoilt = min(spoilt, len(stack))
            _close(stack, frame, m.start(), text, field)
        elif token in (")", "]"):
            # a closing bracket with no partner on top: text inside every open bracket, which it spoils
            spoilt = len(stack)
            if token == "]" and squares:
                while stack.pop().bracket != "[":  # the brackets it closes over are gone with it
                    pass
                squares -= 1
                spoilt = len(stack)
        elif token in (":", "|") and stack:
            (stack[-1].colons if token == ":" else stack[-1].bars).append(m.start())


class _Open:
    """An open bracket while `_refuse_scheduling` reads (working state)."""
    __slots__ = ("bars", "bracket", "colons", "start", "well_formed")

    def __init__(self, bracket: str, start: int):
        self.bracket, self.start = bracket, start
        self.colons: list[int] = []
        self.bars: list[int] = []
        self.well_formed = True


def _close(stack: list[_Open], frame: _Open, end: int, text: str, field: str) -> None:
    """`frame` closes at `end`: refused if it is editing or alternation; its parent learns whether it was well
    formed (emphasis: `(a)`, `(a:w)`, `[a]`)."""
    if frame.well_formed and frame.bracket == "[":
        _check_square(text, frame.start, end, frame.colons, frame.bars, field)
    emphasis = not frame.bars and len(frame.colons) <= (1 if frame.bracket == "(" else 0)
    if stack and not (frame.well_formed and emphasis):
        stack[-1].well_formed = False


def _check_square(text: str, start: int, end: int, colons: list[int], bars: list[int], field: str) -> None:
    """`text[start:end + 1]` is a well-formed `[...]` with these top-level colons and bars."""
    if not bars and (len(colons) not in (1, 2) or _SPACED_NUMBER.fullmatch(text, colons[-1] + 1, end) is None):
        return  # emphasis or text: nothing is copied, so nested brackets cost nothing more
    shown = _show(text[start:end + 1])
    escape = r"or escape the brackets as \[ \] to keep them as text"
    if bars and not colons:
        cuts = [start, *bars, end]
        options = [text[a + 1:b].strip() for a, b in pairwise(cuts)]
        first = next((repr(o) for o in options if o), "the word you want")
        raise ParamError(field, f"{field} uses alternation {shown} (AUTOMATIC1111's [a|b], which swaps the words "
                                f"every step); diffgraph does not support it: write one of them (e.g. {first}), "
                                f"{escape}")
    if bars:
        return
    cuts = [start, *colons, end]
    parts = [text[a + 1:b] for a, b in pairwise(cuts)][:-1]
    texts = " or ".join(repr(p.strip()) for p in parts if p.strip()) or "the text you want"
    raise ParamError(field, f"{field} uses prompt editing {shown} (AUTOMATIC1111's [from:to:when], which changes "
                            f"the text during sampling); diffgraph does not support it: write the text for the whole "
                            f"run instead ({texts}), {escape}")


# -- emphasis ------------------------------------------------------------------------------------------

def _attention(text: str, field: str) -> tuple[tuple[str, float], ...]:
    """AUTOMATIC1111's parse_prompt_attention: (text, weight) runs, equal neighbours merged."""
    res: list[list] = []  # [text, weight]; a BREAK's marker is weighted like any piece, as the web UI does
    rounds: list[int] = []
    squares: list[int] = []

    def multiply(start: int, by: float) -> None:
        for piece in res[start:]:
            piece[1] *= by

    for m in _ATTENTION.finditer(text):
        token, weight = m.group(0), m.group(1)
        if token.startswith("\\"):
            res.append([token[1:], 1.0])  # a lone backslash gives "": the web UI drops it
        elif token in ("(", "["):
            opened = rounds if token == "(" else squares
            if len(opened) == MAX_OPEN:
                raise ParamError(field, f"{field} has more than {MAX_OPEN} {token!r} open at once (at character "
                                        f"{m.start()}); close some, or escape them as \\{token} to keep them as text")
            opened.append(len(res))
        elif weight is not None and rounds:
            multiply(rounds.pop(), _weight(weight, text, m.start(), field))
        elif token == ")" and rounds:
            multiply(rounds.pop(), ROUND)
        elif token == "]" and squares:
            multiply(squares.pop(), SQUARE)
        else:
            for i, part in enumerate(_split_breaks(token)):
                if i:
                    res.append(list(BREAK))
                res.append([part, 1.0])
    for start in rounds:
        multiply(start, ROUND)
    for start in squares:
        multiply(start, SQUARE)
    for piece_text, w in res:
        if not math.isfinite(w):
            raise ParamError(field, f"{field} gives {_show(piece_text)} the weight {w} (the nested weights multiply "
                                    "past a float's range); use smaller weights, e.g. (text:1.5)")
    merged: list[tuple[list[str], float]] = []  # texts joined once: `+=` on each piece copies the run again
    for piece_text, w in res or [["", 1.0]]:
        if merged and merged[-1][1] == w:
            merged[-1][0].append(piece_text)
        else:
            merged.append(([piece_text], w))
    return tuple(("".join(t), float(w)) for t, w in merged)


def _split_breaks(text: str) -> list[str]:
    """`re.split(r"\\s*\\bBREAK\\b\\s*", text)`: the text between BREAKs, without the spaces next to them. That
    pattern's leading `\\s*` scans a run of spaces again from each of its starts; this is linear."""
    parts, start = [], 0
    for m in _BREAK.finditer(text):
        parts.append(text[start:m.start()])
        start = m.end()
    parts.append(text[start:])
    if len(parts) == 1:
        return parts
    return [parts[0].rstrip()] + [p.strip() for p in parts[1:-1]] + [parts[-1].lstrip()]


def _weight(value: str, text: str, at: int, field: str) -> float:
    """The w of `(x:w)`: AUTOMATIC1111's `[+-]?[.\\d]+`, which also matches '.' and '1.2.3'."""
    try:
        weight = float(value)
    except ValueError:
        raise ParamError(field, f"{field} has the weight {value!r} in {_show(text[max(0, at - 20):at + 20])}, "
                                "which is not a number; write (text:1.2)") from None
    if not math.isfinite(weight):
        raise ParamError(field, f"{field} has the weight {_show(value)}, which is past a float's range; write a "
                                "weight such as (text:1.2)")
    return weight
