"""AUTOMATIC1111's prompt syntax, read into weighted text pieces: the one parser of an "a1111" prompt.

`parse_a1111(prompt, field)` owns the reading of a prompt written for AUTOMATIC1111's web UI, in the order the
web UI applies it: extra-network tags (`<lora:NAME:SCALE>`, taken out of the text into `loras`), ComfyUI-style
`embedding:NAME` references (the prefix dropped, the name kept in the text for the token matcher of chunks.py,
recorded in `embeddings`), then emphasis as AUTOMATIC1111's `parse_prompt_attention`: `(x)` x1.1, `[x]` /1.1,
`(x:w)`, nesting multiplies, `\\(` `\\)` `\\[` `\\]` `\\\\` escapes, unbalanced open brackets weight the rest,
BREAK starts a new chunk. It hands a `ParsedPrompt` (plain data) to text/prepared.py, which tokenises the pieces
(chunks.py), and to request.py, which adds the tags to the request's adapters.

Prompt editing `[from:to:when]` and alternation `[a|b]` make a prompt a schedule of texts over the denoising:
`schedule_a1111(prompt, field, steps)` takes the tags out of the whole prompt, reads the schedule as AUTOMATIC1111's
`get_learned_conditioning_prompt_schedules` does (`prompt_schedule`; a recursive reader of its lark grammar, which
takes a well-formed bracket's form wherever lark's parse is ambiguous), and each text as `parse_a1111` reads a
prompt; `parse_a1111` itself reads one text and refuses editing there. What the web UI reads and diffgraph cannot
do (composable `AND`, separate text-encoder and UNet LoRA scales, other extra networks) is refused with a
`ParamError` naming the prompt's field and saying how to write it instead, never read silently as something else. Emphasis follows the web
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
    _refuse_editing(text, field)
    return ParsedPrompt(_attention(text, field), loras, embeddings)


def schedule_a1111(prompt: str, field: str, steps: int,
                   hires: int | None = None) -> tuple[tuple[int, str, ParsedPrompt], ...]:
    """`prompt` read as AUTOMATIC1111 reads it for `steps` denoiser evaluations: its extra-network tags taken out of
    the whole prompt once (a tag inside an edit applies for the whole run, as there), then its schedule
    (`prompt_schedule`; `hires`: the first pass's evaluations, for a hires fix's second pass), each text read as
    `parse_a1111` reads a prompt: (last evaluation, text, parsed) per text."""
    text, loras = _take_loras(prompt, field)
    out = []
    parsed: dict[str, ParsedPrompt] = {}  # each text read once (an alternation comes back to its texts)
    for end, part in prompt_schedule(text, steps, field, hires):
        if part not in parsed:
            part_text, embeddings, spans = _take_embeddings(part, field)
            _refuse_and(part_text, spans, field)
            parsed[part] = ParsedPrompt(_attention(part_text, field), loras, embeddings)
        out.append((end, part, parsed[part]))
    return tuple(out)


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


def _refuse_editing(text: str, field: str) -> None:
    """Prompt editing and alternation (`prompt_schedule`'s nodes) are refused where a prompt is read as one text
    (`schedule_a1111` reads them). Brackets AUTOMATIC1111's grammar reads as text stay text."""
    tree = _Scheduled.read(text, field)
    node = next(tree.walk(), None) if tree is not None else None
    if node is None:
        return
    escape = r"or escape the brackets as \[ \] to keep them as text"
    if node.options is not None:
        options = [o.render(1) for o in node.options]
        first = next((repr(o.strip()) for o in options if o.strip()), "the word you want")
        raise ParamError(field, f"{field} uses alternation {_show('[' + '|'.join(options) + ']')} (AUTOMATIC1111's "
                                f"[a|b], which swaps the words every step), read only over a request's steps: write "
                                f"one of them (e.g. {first}), {escape}")
    parts = ([node.before.render(1)] if node.before is not None else []) + [node.after.render(1)]
    texts = " or ".join(repr(t.strip()) for t in parts if t.strip()) or "the text you want"
    raise ParamError(field, f"{field} uses prompt editing {_show('[' + ':'.join(parts + [node.when]) + ']')} "
                            f"(AUTOMATIC1111's [from:to:when], which changes the text during sampling), read only "
                            f"over a request's steps: write the text for the whole run instead ({texts}), {escape}")


# -- prompt editing and alternation ---------------------------------------------------------------------

def prompt_schedule(text: str, steps: int, field: str = "prompt",
                    hires: int | None = None) -> tuple[tuple[int, str], ...]:
    """AUTOMATIC1111's prompt schedule of `text` (its extra-network tags already taken out) over `steps` denoiser
    evaluations: (last evaluation, text) pairs, the evaluation numbered from 1, neighbours of equal text merged, the
    last ending at `steps`. `[from:to:when]`, `[to:when]`, `[from::when]` (nested too) read `from` up to evaluation
    `when` and `to` after it, `when` a step number or, written with a ".", a fraction of `steps`; `[a|b|c]` cycles one
    option a step. `hires`: the first pass's evaluations, for a hires fix's second pass (`steps` its own): a number
    then counts from the first pass's start, a fraction from 1.0 (AUTOMATIC1111's rule). A prompt its grammar cannot
    read whole (a "|" outside an alternation, a lone backslash) and a malformed bracket stay text, as there. More
    than `MAX_SCHEDULED` distinct texts, or brackets nested past `MAX_OPEN`, is a ParamError naming `field`."""
    tree = _Scheduled.read(text, field)
    if tree is None:
        return ((steps, text),)
    int_offset, frac_offset = (0, 0.0) if hires is None else (hires, 1.0)
    points = {steps}
    for node in tree.walk():
        if node.options is not None:
            points.update(range(1, steps + 1))
            continue
        value = float(node.when)
        value = (value - frac_offset) * steps if "." in node.when else value - int_offset
        node.at = int(min(value, steps)) if value > -1 else -1   # int() truncates; an infinite number is the end
        if node.at >= 1:
            points.add(node.at)
    nodes = list(tree.walk())
    out: list[tuple[int, str]] = []
    seen: set[str] = set()
    texts: dict[tuple, str] = {}  # by the choice each node makes: a text is rendered once
    for point in sorted(points):
        choice = tuple((point - 1) % len(n.options) if n.options is not None else point <= n.at for n in nodes)
        now = texts.get(choice)
        if now is None:
            now = texts[choice] = tree.render(point)
        if out and out[-1][1] == now:
            out[-1] = (point, now)
            continue
        seen.add(now)
        if len(seen) > MAX_SCHEDULED:
            raise ParamError(field, f"{field} changes into more than {MAX_SCHEDULED} different prompts during "
                                    "sampling (prompt editing [a:b:when] and alternation [a|b]); use fewer")
        out.append((point, now))
    return tuple(out)


MAX_SCHEDULED = 16             # distinct texts one prompt's schedule may encode
_SCHEDULE_TOKENS = re.compile(r"\\.|[()\[\]:|]|[^\\()\[\]:|]+|\\", re.DOTALL)


class _Scheduled:
    """A node of AUTOMATIC1111's schedule grammar: a sequence (`items`: text and nodes), `[before:after:when]`
    (`before` None when left out) or `[a|b]` (`options`)."""
    __slots__ = ("after", "at", "before", "items", "options", "when")

    def __init__(self, items=None, before=None, after=None, when=None, options=None):
        self.items, self.before, self.after, self.when, self.options, self.at = items, before, after, when, options, 0

    @classmethod
    def read(cls, text: str, field: str) -> "_Scheduled | None":
        """The prompt's tree; None where the grammar fails on it (the whole prompt is then text)."""
        tokens = [m.group(0) for m in _SCHEDULE_TOKENS.finditer(text)]
        if any(t == "\\" or t.startswith("\\\n") for t in tokens):
            return None
        try:
            return cls(items=_top(tokens, 0, len(tokens), {}, field))
        except _Unreadable:
            return None

    def walk(self):
        for part in self._parts():
            if isinstance(part, _Scheduled):
                if part.items is None:
                    yield part
                yield from part.walk()

    def _parts(self):
        if self.items is not None:
            return self.items
        if self.options is not None:
            return [p for option in self.options for p in option.items]
        return (self.before.items if self.before is not None else []) + self.after.items

    def render(self, step: int) -> str:
        out: list[str] = []
        todo = [self]
        while todo:
            node = todo.pop()
            if isinstance(node, str):
                out.append(node)
            elif node.items is not None:
                todo.extend(reversed(node.items))
            elif node.options is not None:
                todo.append(node.options[(step - 1) % len(node.options)])
            elif step <= node.at:
                if node.before is not None:
                    todo.append(node.before)
            else:
                todo.append(node.after)
        return "".join(out)


class _Unreadable(Exception):
    """The grammar cannot read the prompt whole (a "|" left outside an alternation)."""


def _top(tokens: list[str], lo: int, hi: int, memo: dict, field: str) -> list:
    """tokens[lo:hi] read where the grammar allows stray brackets and colons (the prompt's top level): a well-formed
    bracket as its form, any other bracket or colon as text; a "|" there leaves the prompt unreadable."""
    out: list = []
    i = lo
    while i < hi:
        token = tokens[i]
        shape = _bracket(tokens, i, memo, 0, field) if token in ("(", "[") else None
        if shape is not None:
            out.extend(shape[0])
            i = shape[1]
            continue
        if token == "|":
            raise _Unreadable
        out.append(token)
        i += 1
    return out


def _bracket(tokens: list[str], start: int, memo: dict, depth: int, field: str) -> tuple | None:
    """The bracket opening at `tokens[start]` read whole by the grammar: (its items in the enclosing sequence, the
    token after it), or None where it is malformed (then its characters are text)."""
    if start in memo:
        return memo[start]
    opening = tokens[start]
    if depth >= MAX_OPEN:
        raise ParamError(field, f"{field} has more than {MAX_OPEN} {opening!r} open at once (brackets nested); "
                                f"close some, or escape them as \\{opening} to keep them as text")
    closing = ")" if opening == "(" else "]"
    parts: list[list] = [[]]
    seps: list[str] = []
    i, result = start + 1, None
    while i < len(tokens):
        token = tokens[i]
        if token in ("(", "["):
            found = _bracket(tokens, i, memo, depth + 1, field)
            if found is None:
                break
            parts[-1].extend(found[0])
            i = found[1]
            continue
        if token in (":", "|"):
            seps.append(token)
            parts.append([])
        elif token == closing:
            result = (_form(opening, parts, seps), i + 1)
            break
        elif token in (")", "]"):
            break
        else:
            parts[-1].append(token)
        i += 1
    if result is not None and result[0] is None:
        result = None
    memo[start] = result
    return result


def _form(opening: str, parts: list[list], seps: list[str]) -> list | None:
    """A well-formed bracket's items in its enclosing sequence: emphasis as its text, editing or alternation as a
    node; None where its separators fit no form."""
    if opening == "(":
        if "|" in seps or len(seps) > 1:
            return None
        return ["(", *parts[0], *([":", *parts[1]] if seps else []), ")"]
    if not seps:
        return ["[", *parts[0], "]"]
    if all(s == "|" for s in seps):
        return [_Scheduled(options=[_Scheduled(items=p) for p in parts])]
    number = parts[-1]
    if "|" in seps or len(seps) > 2 or not all(isinstance(p, str) for p in number):
        return None
    m = _SPACED_NUMBER.fullmatch("".join(number))
    if m is None:
        return None
    before = _Scheduled(items=parts[0]) if len(seps) == 2 else None
    return [_Scheduled(before=before, after=_Scheduled(items=parts[-2]), when="".join(number).strip())]


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
