"""AUTOMATIC1111's prompt syntax (prompt_syntax.py) and its 75-token chunks (text/chunks.py), against a reference
written here from AUTOMATIC1111's rules (modules/prompt_parser.py parse_prompt_attention, modules/extra_networks.py,
modules/sd_hijack_clip.py tokenize_line, the wiki's "Attention/emphasis", "BREAK" and "Infinite prompt length").

The reference is built differently from a regex tokenizer: a character scanner whose pieces record the multipliers
that reach them (in the order AUTOMATIC1111 applies them: each closing bracket as it closes, innermost first, then
the unclosed round brackets from the outermost, then the unclosed square ones), and a chunker that packs a stream of
units (a token, a comma, a BREAK, an embedding block) into windows. Both are compared with the modules exactly
(floats included: equal-weight neighbours merge on exact equality, as AUTOMATIC1111's do), and a core subset of the
prompts also against outputs written by hand.

Rules the reference encodes (from AUTOMATIC1111's code):
  * `(x)` multiplies by 1.1, `[x]` by 1/1.1, `(x:w)` by w (`:\\s*[+-]?[.\\d]+\\s*)`; without an open round bracket
    that text is plain); round and square brackets pair only with their own kind, on two independent stacks, so a
    stray `)` or `]` is text and `[a (b] c)` overlaps; unclosed brackets weigh everything after them;
  * `\\(` `\\)` `\\[` `\\]` `\\\\` are the literal characters; any other backslash disappears;
  * `BREAK` (uppercase, a whole word, with the whitespace around it) splits a plain run; the parts around it stay,
    empty ones included (AUTOMATIC1111's output for "BREAK a" is ["", 1], ["BREAK", -1], ["a", 1]); inside brackets
    the marker is weighted like any piece ("(a BREAK b)" holds ["BREAK", -1.1]) and tokenize_line, which splits only
    on ["BREAK", -1], encodes it as the word;
  * `<lora:NAME>` / `<lora:NAME:SCALE>` / `<lora:NAME:S:S>` are removed from the text first (re.sub to "", the
    spaces around stay), other `<word:args>` extra networks, AND (`\\bAND\\b`), and prompt editing and alternation
    (a `[...]` that AUTOMATIC1111's lark grammar reads as `scheduled` or `alternate`) are refused by `parse_a1111`,
    which reads one text (a request's schedule of texts: `schedule_a1111`, tests/test_prompt_editing.py);
  * chunks: BOS + 75 tokens padded with EOS + EOS; BREAK closes the chunk (a chunk closed that way counts 75 tokens);
    a full chunk moves the tokens after its last comma to the next one when that comma is within the last 20; an
    embedding's vectors never straddle chunks; the last chunk counts its own tokens; an empty prompt is one chunk.
"""

from __future__ import annotations

import random
import re

import pytest

from diffgraph.request import ParamError

syntax = pytest.importorskip("diffgraph.prompt_syntax")
chunks_mod = pytest.importorskip("diffgraph.text.chunks")

parse_a1111 = syntax.parse_a1111
chunk_tokens = chunks_mod.chunk_tokens
EmbeddingMatcher = chunks_mod.EmbeddingMatcher
with_pad = chunks_mod.with_pad
pad_to = chunks_mod.pad_to

ROUND = 1.1
SQUARE = 1 / 1.1
H = ROUND          # shorthand for the hand-written tables
S = SQUARE


# ----------------------------------------------------------------------------------------------------------------
# the reference parser
# ----------------------------------------------------------------------------------------------------------------

class RefRefused(Exception):
    """The reference refuses the prompt (AUTOMATIC1111 syntax this engine does not run)."""


class RefUndefined(Exception):
    """AUTOMATIC1111 itself fails on this prompt (float('.') in `(a:.)`): no reference answer."""


def _is_word(c: str) -> bool:
    return c.isalnum() or c == "_"


def _ws(c: str) -> bool:
    return c.isspace()


def _number_at(text: str, i: int) -> int:
    """End of a lark SIGNED_NUMBER starting at i ([+-]? (digits [. digits?] | . digits) ([eE][+-]?digits)?), or -1."""
    n, j = len(text), i
    if j < n and text[j] in "+-":
        j += 1
    k = j
    while k < n and text[k].isdigit():
        k += 1
    digits = k - j
    if k < n and text[k] == ".":
        k += 1
        m = k
        while k < n and text[k].isdigit():
            k += 1
        digits += k - m
    if digits == 0:
        return -1
    if k < n and text[k] in "eE":
        m = k + 1
        if m < n and text[m] in "+-":
            m += 1
        e = m
        while e < n and text[e].isdigit():
            e += 1
        if e > m:
            k = e
    return k


def _editing_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, kind) of each `[...]` that AUTOMATIC1111's lark grammar reads as prompt editing ("scheduled") or
    alternation ("alternate"), by a memoised recursive-descent recogniser of that grammar:

        prompt:      (emphasized | scheduled | alternate | plain)*
        emphasized:  "(" prompt ")" | "(" prompt ":" prompt ")" | "[" prompt "]"
        scheduled:   "[" [prompt ":"] prompt ":" [WHITESPACE] NUMBER "]"
        alternate:   "[" prompt ("|" prompt)+ "]"
        plain:       any character but \\ [ ] ( ) : |, or \\ and any character but a newline

    Only the bracket itself is recognised: where lark fails on the whole prompt (a "|" outside brackets, a trailing
    backslash) AUTOMATIC1111 would read an editing-shaped group as text, and refusing it is the safer reading."""
    n = len(text)
    memo_p: dict[int, frozenset] = {}
    memo_b: dict[int, frozenset] = {}

    def prompt_ends(i: int) -> frozenset:
        if i not in memo_p:
            ends, todo = {i}, [i]
            while todo:
                for e in element_ends(todo.pop()):
                    if e not in ends:
                        ends.add(e)
                        todo.append(e)
            memo_p[i] = frozenset(ends)
        return memo_p[i]

    def element_ends(k: int):
        if k >= n:
            return ()
        c = text[k]
        if c == "\\":
            return (k + 2,) if k + 1 < n and text[k + 1] != "\n" else ()
        if c in "([":
            return tuple(e for e, _ in bracket(k))
        if c in "]):|":
            return ()
        return (k + 1,)

    def number_then_close(j: int):
        while j < n and _ws(text[j]):
            j += 1
        e = _number_at(text, j)
        return e + 1 if e > 0 and e < n and text[e] == "]" else None

    def bracket(k: int) -> frozenset:
        if k in memo_b:
            return memo_b[k]
        out = set()
        for j in prompt_ends(k + 1):
            if j >= n:
                continue
            c = text[j]
            if text[k] == "(":
                if c == ")":
                    out.add((j + 1, "emphasized"))
                elif c == ":":
                    out.update((j2 + 1, "emphasized") for j2 in prompt_ends(j + 1) if j2 < n and text[j2] == ")")
                continue
            if c == "]":
                out.add((j + 1, "emphasized"))
            elif c == ":":
                end = number_then_close(j + 1)          # "[" prompt ":" NUMBER "]"
                if end is not None:
                    out.add((end, "scheduled"))
                for j2 in prompt_ends(j + 1):           # "[" prompt ":" prompt ":" NUMBER "]"
                    if j2 < n and text[j2] == ":":
                        end = number_then_close(j2 + 1)
                        if end is not None:
                            out.add((end, "scheduled"))
            elif c == "|":
                seen, todo = set(), [j]
                while todo:
                    bar = todo.pop()
                    for j2 in prompt_ends(bar + 1):
                        if j2 < n and text[j2] == "]":
                            out.add((j2 + 1, "alternate"))
                        elif j2 < n and text[j2] == "|" and j2 not in seen:
                            seen.add(j2)
                            todo.append(j2)
        memo_b[k] = frozenset(out)
        return memo_b[k]

    spans, i = [], 0
    while i < n:                         # every "[" the top level can start an element at (not an escaped one)
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == "[":
            spans.extend((i, e, kind) for e, kind in bracket(i) if kind != "emphasized")
        i += 1
    return spans


def _check_editing(text: str) -> None:
    """Prompt editing `[a:b:N]`, `[a:N]`, `[a::N]` and alternation `[a|b]` are refused."""
    spans = _editing_spans(text)
    if spans:
        raise RefRefused(spans[0][2])


def _loose_editing(text: str) -> bool:
    """A `[...]` group ending in ":" NUMBER "]" whatever its content (what a conservative refusal may catch)."""
    stack, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            stack.append(i)
        elif c == "]" and stack:
            start = stack.pop()
            k = text.rfind(":", start, i)
            if k > start:
                j = k + 1
                while j < i and _ws(text[j]):
                    j += 1
                if _number_at(text, j) == i:
                    return True
        i += 1
    return False


def _check_and(text: str) -> None:
    i = text.find("AND")
    while i >= 0:
        before = text[i - 1] if i else " "
        after = text[i + 3] if i + 3 < len(text) else " "
        if not _is_word(before) and not _is_word(after):
            raise RefRefused("AND")
        i = text.find("AND", i + 1)


def _extract_networks(text: str):
    """AUTOMATIC1111's re.sub(r"<(\\w+):([^>]+)>", "", prompt) by hand; returns (text, loras)."""
    out, loras, i, n = [], [], 0, len(text)
    while i < n:
        if text[i] == "<":
            j = i + 1
            while j < n and _is_word(text[j]):
                j += 1
            if j > i + 1 and j < n and text[j] == ":":
                close = text.find(">", j + 1)
                if close >= 0:
                    kind, args = text[i + 1:j], text[j + 1:close]
                    if kind != "lora":
                        raise RefRefused(f"extra network {kind}")
                    loras.append(_lora(args))
                    i = close + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out), loras


def _lora(args: str):
    parts = args.split(":")
    name = parts[0]
    if not name.strip() or len(parts) > 3:
        raise RefRefused("malformed lora")
    try:
        scales = [float(p) for p in parts[1:]]
    except ValueError:
        raise RefRefused("malformed lora") from None
    if len(scales) == 2 and scales[0] != scales[1]:
        raise RefRefused("te != unet")
    return name, (scales[0] if scales else 1.0)


EMBED_WORD = "embedding:"


def _replace_embeddings(text: str):
    names, out, i = [], [], 0
    while True:
        k = text.find(EMBED_WORD, i)
        if k < 0:
            out.append(text[i:])
            break
        if k and _is_word(text[k - 1]):  # "myembedding:x" is text
            out.append(text[i:k + len(EMBED_WORD)])
            i = k + len(EMBED_WORD)
            continue
        j = k + len(EMBED_WORD)
        while j < len(text) and (_is_word(text[j]) or text[j] in "-./"):
            j += 1
        while j > k + len(EMBED_WORD) and text[j - 1] in "./":  # a name ends on a word character
            j -= 1
        name = text[k + len(EMBED_WORD):j]
        out.append(text[i:k])
        if name:
            if name not in names:   # each name once, in order of first use
                names.append(name)
            out.append(name)
        else:
            out.append(EMBED_WORD)
        i = j
    return "".join(out), names


def _split_break(run: str) -> list[str]:
    """re.split(r"\\s*\\bBREAK\\b\\s*", run), by hand."""
    parts, last, i = [], 0, 0
    while True:
        k = run.find("BREAK", i)
        if k < 0:
            break
        ok_before = k == 0 or not _is_word(run[k - 1])
        ok_after = k + 5 == len(run) or not _is_word(run[k + 5])
        if not (ok_before and ok_after):
            i = k + 1
            continue
        start = k
        while start > last and _ws(run[start - 1]):
            start -= 1
        end = k + 5
        while end < len(run) and _ws(run[end]):
            end += 1
        parts.append(run[last:start])
        last = i = end
    parts.append(run[last:])
    return parts


class _Piece:
    __slots__ = ("text", "factors", "is_break")

    def __init__(self, text: str, is_break: bool = False):
        self.text, self.factors, self.is_break = text, [], is_break


def ref_attention(text: str, *, keep_lone_backslash: bool = False,
                  unweighted_break: bool = False) -> list[tuple[str, float]]:
    """parse_prompt_attention, as a character scanner over pieces that collect their multipliers. The two flags
    are departures from AUTOMATIC1111 (a lone backslash kept as text; a BREAK inside brackets still -1.0), only to
    tell those known disagreements apart from others in the fuzz test."""
    pieces: list[_Piece] = []
    rounds: list[int] = []
    squares: list[int] = []

    def plain(run: str) -> None:
        for k, part in enumerate(_split_break(run)):
            if k:
                pieces.append(_Piece("BREAK", True))
            pieces.append(_Piece(part))

    def weigh(start: int, factor: float) -> None:
        for p in pieces[start:]:
            p.factors.append(factor)

    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            if i + 1 < n and text[i + 1] in "()[]\\":
                pieces.append(_Piece(text[i + 1]))
                i += 2
            else:
                # a lone backslash: AUTOMATIC1111 keeps text[1:] of the "\\" token, nothing
                pieces.append(_Piece("\\" if keep_lone_backslash else ""))
                i += 1
        elif c == "(":
            rounds.append(len(pieces))
            i += 1
        elif c == "[":
            squares.append(len(pieces))
            i += 1
        elif c == ")":
            if rounds:
                weigh(rounds.pop(), ROUND)
            else:
                plain(")")
            i += 1
        elif c == "]":
            if squares:
                weigh(squares.pop(), SQUARE)
            else:
                plain("]")
            i += 1
        elif c == ":":
            # ":" [ws] [+-]? [.digits]+ [ws] ")" closes a round bracket with that weight
            j = i + 1
            while j < n and _ws(text[j]):
                j += 1
            k = j + 1 if j < n and text[j] in "+-" else j
            m = k
            while m < n and (text[m] == "." or text[m].isdigit()):
                m += 1
            e = m
            while e < n and _ws(text[e]):
                e += 1
            if m > k and e < n and text[e] == ")":
                if rounds:
                    try:
                        w = float(text[j:m])
                    except ValueError:
                        raise RefUndefined(text) from None
                    weigh(rounds.pop(), w)
                else:
                    plain(text[i:e + 1])
                i = e + 1
            else:
                plain(":")
                i += 1
        else:
            j = i
            while j < n and text[j] not in "\\()[]:":
                j += 1
            plain(text[i:j])
            i = j
    for start in rounds:
        weigh(start, ROUND)
    for start in squares:
        weigh(start, SQUARE)

    out: list[list] = []
    for p in pieces:
        w = -1 if p.is_break else 1.0
        for f in ([] if p.is_break and unweighted_break else p.factors):
            w *= f
        if out and out[-1][1] == w:
            out[-1][0] += p.text
        else:
            out.append([p.text, w])
    return [(t, w) for t, w in out] or [("", 1.0)]


def ref_parse(prompt: str, **flags):
    """(pieces, loras, embeddings) or RefRefused."""
    text, loras = _extract_networks(prompt)
    _check_and(text)
    _check_editing(text)
    text, embeddings = _replace_embeddings(text)
    return tuple(ref_attention(text, **flags)), tuple(loras), tuple(embeddings)


# ----------------------------------------------------------------------------------------------------------------
# the reference chunker
# ----------------------------------------------------------------------------------------------------------------

class RefMatcher:
    """A1111's EmbeddingDatabase lookup: by the name's tokens, the longest name first."""

    def __init__(self, names: dict[str, int], tokenize):
        self.entries = sorted(((tuple(tokenize([n])[0]), n, v) for n, v in names.items()), key=lambda e: -len(e[0]))

    def find(self, tokens, position):
        for ids, name, vectors in self.entries:
            if ids and tuple(tokens[position:position + len(ids)]) == ids:
                return name, vectors, len(ids)
        return None


def ref_chunks(pieces, tokenize, *, bos, eos, comma, matcher=None, chunk_length=75, backtrack=20):
    """(ids, weights, embeddings [(name, chunk, offset, vectors)], token_count)."""
    # 1. the unit stream
    units = []   # ("break",) | ("tok", id, w) | ("emb", name, vectors, w)
    texts = [t for t, _ in pieces]
    token_lists = tokenize(texts)
    for (text, w), toks in zip(pieces, token_lists):
        if text == "BREAK" and w == -1:
            units.append(("break",))
            continue
        p = 0
        while p < len(toks):
            hit = matcher.find(toks, p) if matcher is not None else None
            if hit is not None:
                units.append(("emb", hit[0], hit[1], w))
                p += hit[2]
            else:
                units.append(("tok", toks[p], w))
                p += 1

    # 2. packing: a chunk is a list of (id, weight, embedding-start-name-or-None, vectors)
    done: list[list] = []
    counted = [0]
    cur: list = []
    comma_at = [None]

    def close(last=False):
        counted[0] += len(cur) if last else chunk_length
        done.append(list(cur))
        cur.clear()
        comma_at[0] = None

    for u in units:
        if u[0] == "break":
            close()
            continue
        is_comma = u[0] == "tok" and comma is not None and u[1] == comma
        if is_comma:
            comma_at[0] = len(cur)
        elif (backtrack and len(cur) == chunk_length and comma_at[0] is not None
              and len(cur) - comma_at[0] <= backtrack):
            keep = comma_at[0] + 1
            moved = cur[keep:]
            del cur[keep:]
            close()
            cur.extend(moved)
        if len(cur) == chunk_length:
            close()
        if u[0] == "tok":
            cur.append((u[1], u[2], None, 0))
        else:
            _, name, vectors, w = u
            if len(cur) + vectors > chunk_length:
                close()
            cur.append((0, w, name, vectors))
            cur.extend((0, w, None, 0) for _ in range(vectors - 1))
    if cur or not done:
        close(last=True)

    ids, weights, embs = [], [], []
    for c_index, c in enumerate(done):
        pad = chunk_length - len(c)
        ids.append((bos,) + tuple(t[0] for t in c) + (eos,) * (pad + 1))
        weights.append((1.0,) + tuple(t[1] for t in c) + (1.0,) * (pad + 1))
        for pos, t in enumerate(c):
            if t[2] is not None:
                embs.append((t[2], c_index, pos + 1, t[3]))
    return tuple(ids), tuple(weights), tuple(embs), counted[0]


# ----------------------------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    from diffgraph.models.tokenizer import preset_tokenizer
    return preset_tokenizer()


@pytest.fixture(scope="module")
def tokenize(tok):
    return lambda ts: tok(list(ts), add_special_tokens=False, truncation=False).input_ids


@pytest.fixture(scope="module")
def ids(tok):
    """bos, eos, comma, and single-token words."""
    bos, eos = len(tok) - 2, len(tok) - 1
    assert (tok.bos_token_id, tok.eos_token_id) == (bos, eos)
    comma = tok.convert_tokens_to_ids(",</w>")
    one = lambda w: tok(w, add_special_tokens=False).input_ids
    assert len(one("x")) == 1 and len(one("red")) == 1 and one("x, x") == one("x") + [comma] + one("x")
    return {"bos": bos, "eos": eos, "comma": comma, "x": one("x")[0], "red": one("red")[0]}


def _parsed(p):
    return tuple(p.pieces), tuple(p.loras), tuple(p.embeddings)


# ----------------------------------------------------------------------------------------------------------------
# the parser: hand-written expectations (and the reference agrees with them)
# ----------------------------------------------------------------------------------------------------------------

HAND = [
    # prompt, pieces, loras, embeddings
    ("a photo of a cat", [("a photo of a cat", 1.0)], [], []),
    ("", [("", 1.0)], [], []),
    ("(cat)", [("cat", H)], [], []),
    ("((cat))", [("cat", H * H)], [], []),
    ("(((cat)))", [("cat", H * H * H)], [], []),
    ("[cat]", [("cat", S)], [], []),
    ("[[cat]]", [("cat", S * S)], [], []),
    ("(cat:1.5)", [("cat", 1.5)], [], []),
    ("(cat:0)", [("cat", 0.0)], [], []),
    ("(cat:-1)", [("cat", -1.0)], [], []),
    ("(cat:.5)", [("cat", 0.5)], [], []),
    ("(cat : 1.5 )", [("cat ", 1.5)], [], []),
    ("a (cat) b", [("a ", 1.0), ("cat", H), (" b", 1.0)], [], []),
    ("((a:1.2) b)", [("a", 1.2 * H), (" b", H)], [], []),
    ("[a] (b)", [("a", S), (" ", 1.0), ("b", H)], [], []),
    ("([a])", [("a", S * H)], [], []),
    ("(a)(b)", [("ab", H)], [], []),
    ("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
     [("a ", 1.0), ("house", 1.3 * H * H), (" ", H), ("on", S * H), (" a ", H), ("hill", 0.5 * H),
      (", sun, ", H), ("sky", H ** 4), (".", H)], [], []),
    (r"\(literal\]", [("(literal]", 1.0)], [], []),
    (r"\(a\) \[b\] \\", [("(a) [b] \\", 1.0)], [], []),
    (r"(\(a\))", [("(a)", H)], [], []),
    (r"\(a:1.5\)", [("(a:1.5)", 1.0)], [], []),
    (r"a \ b", [("a  b", 1.0)], [], []),           # a lone backslash disappears
    ("cat\\", [("cat", 1.0)], [], []),
    ("(a b", [("a b", H)], [], []),
    ("a ) b", [("a ) b", 1.0)], [], []),
    ("[a", [("a", S)], [], []),
    ("a ]", [("a ]", 1.0)], [], []),
    ("(a]", [("a]", H)], [], []),
    ("a:1.5)", [("a:1.5)", 1.0)], [], []),          # a weight without an open round bracket is text
    ("(a:1.5", [("a:1.5", H)], [], []),
    ("[a:b]", [("a:b", S)], [], []),                # a colon without a number is no prompt editing
    ("()", [("", 1.0)], [], []),
    ("BREAK a", [("", 1.0), ("BREAK", -1.0), ("a", 1.0)], [], []),
    ("a BREAK b", [("a", 1.0), ("BREAK", -1.0), ("b", 1.0)], [], []),
    ("a BREAK", [("a", 1.0), ("BREAK", -1.0), ("", 1.0)], [], []),
    ("a\nBREAK\tb", [("a", 1.0), ("BREAK", -1.0), ("b", 1.0)], [], []),
    ("a BREAK BREAK b", [("a", 1.0), ("BREAK", -1.0), ("", 1.0), ("BREAK", -1.0), ("b", 1.0)], [], []),
    ("(a) BREAK (b)", [("a", H), ("", 1.0), ("BREAK", -1.0), ("", 1.0), ("b", H)], [], []),
    ("a break b", [("a break b", 1.0)], [], []),
    ("aBREAK BREAKING", [("aBREAK BREAKING", 1.0)], [], []),
    ("<lora:foo:0.8>", [("", 1.0)], [("foo", 0.8)], []),
    ("<lora:foo:0.8><lora:bar>", [("", 1.0)], [("foo", 0.8), ("bar", 1.0)], []),
    ("a <lora:foo> cat", [("a  cat", 1.0)], [("foo", 1.0)], []),
    ("<lora:foo:0.5:0.5> x", [(" x", 1.0)], [("foo", 0.5)], []),
    ("x <lora:my-lora_v2.1:-0.25>", [("x ", 1.0)], [("my-lora_v2.1", -0.25)], []),
    ("(cat <lora:foo:0.7>:1.3)", [("cat ", 1.3)], [("foo", 0.7)], []),
    ("[<lora:foo:2>dog]", [("dog", S)], [("foo", 2.0)], []),
    ("embedding:easyneg, cat", [("easyneg, cat", 1.0)], [], ["easyneg"]),
    ("a (embedding:easyneg:1.2)", [("a ", 1.0), ("easyneg", 1.2)], [], ["easyneg"]),
    ("(猫 héllo:1.2) ünïcode ✨", [("猫 héllo", 1.2), (" ünïcode ✨", 1.0)], [], []),
    ("  a   b  ", [("  a   b  ", 1.0)], [], []),
    ("a, (b, c:0.8), d", [("a, ", 1.0), ("b, c", 0.8), (", d", 1.0)], [], []),
    ("android and BRAND", [("android and BRAND", 1.0)], [], []),
]


@pytest.mark.parametrize("prompt,pieces,loras,embeddings", HAND, ids=[repr(h[0]) for h in HAND])
def test_parser_hand_written(prompt, pieces, loras, embeddings):
    for label, got in (("reference", ref_parse(prompt)), ("module", _parsed(parse_a1111(prompt)))):
        got_pieces, got_loras, got_embs = got
        assert [t for t, _ in got_pieces] == [t for t, _ in pieces], label
        assert [w for _, w in got_pieces] == pytest.approx([w for _, w in pieces], rel=1e-12, abs=0), label
        assert [n for n, _ in got_loras] == [n for n, _ in loras], label
        assert [s for _, s in got_loras] == pytest.approx([s for _, s in loras]), label
        assert list(got_embs) == embeddings, label


# ----------------------------------------------------------------------------------------------------------------
# the parser: a wider table against the reference, exactly
# ----------------------------------------------------------------------------------------------------------------

MORE = [h[0] for h in HAND] + [
    "[a (b] c)",                      # the two stacks overlap
    "((a [b) c]",
    "((((((((((deep))))))))))",
    "[[[[[[[shallow]]]]]]]",
    "([(a (b:1.3) c)] d [e])",
    "([a (b:1.3)",                    # unclosed: rounds first, then squares
    "[(a (b:1.3)",
    "(a:1.1)(b)",                     # equal weights merge
    "(a:1.21)((b))",                  # 1.21 != 1.1 * 1.1 exactly
    "(a:+2) (b:-0.5) (c:3.)",
    "a: b : c",
    "(a: b :0.7)",
    "((a:2):3)",
    "(a:1e2)",                        # [.\d]+ only: "1e2" is text, (a:1e2) weighs 1.1
    r"\\(a)",                         # an escaped backslash, then a real bracket
    r"\\\(a\\\)",
    r"a\:b",
    "x, y, z, (w, v), [u]",
    "BREAK",
    "BREAK BREAK",
    "(a)BREAK[b]",
    "a,BREAK,b",
    "  BREAK  ",
    "\n\n",
    "(\n)",
    "embedding:one and embedding:two",
    "embedding:sub/dir_name-2 x",
    "<lora:a:1><lora:b:0.5:0.5> (x) <lora:c>",
    "text <b> with < angle > brackets",
    "a|b",                            # "|" outside square brackets: AUTOMATIC1111 reads the prompt as text
    "[a:b]c:d]",
    "(a:1.5)) extra",
    "a (b [c (d [e]) f] g) h",
]


@pytest.mark.parametrize("prompt", MORE, ids=[repr(p) for p in MORE])
def test_parser_matches_reference(prompt):
    got = _parsed(parse_a1111(prompt))
    assert got == ref_parse(prompt)


def test_parser_table_size():
    assert len(set(MORE)) >= 80


def _fuzz_prompts(count: int, seed: int):
    rng = random.Random(seed)
    atoms = ["a", "cat", " ", "  ", ",", "(", ")", "[", "]", ":", ":1.2", ":0.5)", ":-1)", "\\", "\\(", "\\)",
             "\\[", "\\]", "\\\\", "BREAK", " BREAK ", "x", "é", "猫", ".", "1", "\n"]
    for _ in range(count):
        yield "".join(rng.choice(atoms) for _ in range(rng.randint(0, 14)))


def test_parser_fuzz_matches_reference():
    """Random compositions of the syntax's atoms (no tags, no AND, no alternation): same pieces, same refusals."""
    mismatches = []
    for prompt in _fuzz_prompts(3000, seed=1111):
        try:
            want = ref_parse(prompt)
            if want != ref_parse(prompt, keep_lone_backslash=True, unweighted_break=True):
                continue   # a lone backslash or a BREAK in brackets: their own tests below
        except RefUndefined:
            continue
        except RefRefused:
            want = "refused"
        try:
            got = _parsed(parse_a1111(prompt))
        except ParamError:
            got = "refused"
            if want != got and _loose_editing(prompt):
                continue   # an editing look-alike that lark would not read as editing: test_editing_lookalikes
        if got != want:
            mismatches.append((prompt, got, want))
    assert not mismatches, f"{len(mismatches)} differ, first: {mismatches[:3]}"


def test_parsed_prompt_shape():
    p = parse_a1111("(a:1.5) b <lora:x:0.5> embedding:e")
    assert isinstance(p.pieces, tuple) and all(isinstance(x, tuple) and len(x) == 2 for x in p.pieces)
    assert isinstance(p.loras, tuple) and isinstance(p.embeddings, tuple)
    assert all(isinstance(w, float) for _, w in p.pieces) and all(isinstance(s, float) for _, s in p.loras)
    with pytest.raises(Exception):
        p.pieces = ()   # frozen


# ----------------------------------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------------------------------

REFUSED = [
    "a [cat:dog:0.5] b",
    "[cat:dog:10]",
    "[cat:0.5]",
    "[cat: 3]",
    "[cat::0.5]",
    "a [[big]:dog:0.25]",
    "(a [cat:dog:0.5] b)",
    "[cat:(dog:1.2):0.5]",
    "[cat|dog]",
    "a [cat|dog|bird] b",
    "[(a:1.1)|b]",
    "cat AND dog",
    "cat AND dog:1.2",
    "cat\nAND\ndog",
    "<lora:x:0.5:0.8>",
    "a <lora:x:1:0>",
    "<hypernet:foo:1>",
    "<hypernet:foo>",
    "a <lyco:foo:0.5> b",
    "<lora:>",
    "<lora:x:abc>",
    "<lora:x:>",
    "<lora::0.5>",
]


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
@pytest.mark.parametrize("prompt", REFUSED, ids=[repr(p) for p in REFUSED])
def test_refusals(prompt, field):
    with pytest.raises(ParamError) as info:
        parse_a1111(prompt, field)
    err = info.value
    assert getattr(err, "field", err.param) == field and err.param == field
    message = str(err)
    assert message and "\n" not in message and "\r" not in message
    if prompt != "<lora:>":   # AUTOMATIC1111's re_extra_net needs an argument; refusing "<lora:>" is this API's rule
        with pytest.raises(RefRefused):
            ref_parse(prompt)


NOT_REFUSED = [
    r"\[a:b:0.5\]",
    r"\[cat|dog\]",
    "(cat:0.5)",
    "[cat]",
    "[cat:dog]",
    "android, BRAND, and, ANDes",
    "a_AND_b",
    "(a) [b] (c:1.2)",
    "<lora:x:0.7:0.7>",
]


@pytest.mark.parametrize("prompt", NOT_REFUSED, ids=[repr(p) for p in NOT_REFUSED])
def test_not_refused(prompt):
    assert _parsed(parse_a1111(prompt, "negative_prompt")) == ref_parse(prompt)


# Not prompt editing by AUTOMATIC1111's grammar (the lark parse has no `scheduled` node in them, so AUTOMATIC1111
# weighs them as text): "\:" is an escaped colon inside `plain`; a `scheduled` prompt holds no stray ")" and no third
# ":". (Whitespace after NUMBER: AUTOMATIC1111's grammar since 28bd8e1 allows it before "]", so "[a:b:0.5 ]" is
# prompt editing there, and refused here: test_editing_with_a_space_before_the_bracket_is_refused.)
LOOKALIKES = [
    (r"[cat\:0.5]", (("cat:0.5", S),)),
    ("[a) b:0.5]", (("a) b:0.5", S),)),
    ("[a:b:c:0.5]", (("a:b:c:0.5", S),)),
]


def test_editing_with_a_space_before_the_bracket_is_refused():
    with pytest.raises(ParamError) as err:
        parse_a1111("[a:b:0.5 ]")
    assert err.value.param == "prompt" and "editing" in str(err.value)


@pytest.mark.parametrize("prompt,pieces", LOOKALIKES, ids=[repr(p) for p, _ in LOOKALIKES])
def test_editing_lookalikes_are_text(prompt, pieces):
    assert ref_parse(prompt) == (pieces, (), ())
    assert _parsed(parse_a1111(prompt)) == (pieces, (), ())


@pytest.mark.parametrize("prompt", ["(a:.)", "(a:1.2.3)", "(a:..5)"])
def test_weights_automatic1111_cannot_read_are_refused(prompt):
    """AUTOMATIC1111 raises float()'s ValueError on these; the one sensible answer is a ParamError."""
    with pytest.raises(RefUndefined):
        ref_parse(prompt)
    with pytest.raises(ParamError) as info:
        parse_a1111(prompt, "negative_prompt")
    assert info.value.param == "negative_prompt" and "\n" not in str(info.value)


LONGEST = 20_000  # request.MAX_PROMPT_CHARS: the longest prompt any caller can hand the parser


@pytest.mark.parametrize("prompt,pieces,embeddings", [
    ("<a:" * (LONGEST // 3), (("<a:" * (LONGEST // 3), 1.0),), ()),     # a tag that never closes, many times
    (" " * (LONGEST - 1) + "x", ((" " * (LONGEST - 1) + "x", 1.0),), ()),  # a run of spaces with no BREAK
    ("a" + " " * 10_000 + "BREAK" + " " * 9_000 + "b", (("a", 1.0), syntax.BREAK, ("b", 1.0)), ()),
    ("embedding:AND " * (LONGEST // 14), (("AND " * (LONGEST // 14), 1.0),), ("AND",)),
    ("embedding:" * (LONGEST // 10), (("embedding:" * (LONGEST // 20), 1.0),), ("embedding",)),  # name, prefix, ...
    ("[a:b]" * (LONGEST // 5), (("a:b" * (LONGEST // 5), syntax.SQUARE),), ()),  # each read for editing
], ids=["open tags", "spaces", "spaced BREAK", "embeddings named AND", "embedding prefixes", "square brackets"])
def test_hostile_prompts_of_the_longest_length_are_read(prompt, pieces, embeddings):
    """Prompts that each took one of the patterns quadratic time (a '<' scanning to the end for a '>', a BREAK split
    rescanning spaces, a copy of every nested bracket's text): read as AUTOMATIC1111 reads them."""
    parsed = parse_a1111(prompt)
    assert (parsed.pieces, parsed.loras, parsed.embeddings) == (pieces, (), embeddings)


@pytest.mark.parametrize("prompt,needle", [
    ("<lora:a:" + "1" * (LONGEST - 10) + "x>", "is not a number"),
    ("x <lora" + " " * (LONGEST - 7), "does not close"),
    ("x <lora" + " " * (LONGEST - 8) + ">", "names no adapter"),
    ("(" * LONGEST, "more than 100 '(' open at once"),
    ("embedding: " * (LONGEST // 11), "'embedding:' with no name"),
    ("[a:" * (LONGEST // 8) + "]" * (LONGEST // 8), "more than 100 '[' open at once"),  # each level's text copied
], ids=["long scale", "spaces after <lora", "spaced empty tag", "open brackets", "embedding prefixes", "nested"])
def test_hostile_prompts_of_the_longest_length_are_refused_by_name(prompt, needle):
    with pytest.raises(ParamError, match=re.escape(needle)) as info:
        parse_a1111(prompt)
    assert info.value.param == "prompt"


def test_break_inside_brackets_is_weighted_text():
    """AUTOMATIC1111 multiplies the BREAK marker's -1 like any piece, so "(a BREAK b)" holds ("BREAK", -1.1); its
    tokenize_line splits only on ("BREAK", -1) and encodes this one as the word BREAK at weight -1.1."""
    want = (("a", H), ("BREAK", -1 * H), ("b", H))
    assert ref_parse("(a BREAK b)")[0] == want
    assert parse_a1111("(a BREAK b)").pieces == want
    assert ref_parse("[a BREAK]")[0] == (("a", S), ("BREAK", -1 * S), ("", S))
    assert parse_a1111("[a BREAK]").pieces == (("a", S), ("BREAK", -1 * S), ("", S))


def test_escaped_editing_is_text():
    p = parse_a1111(r"\[a:b:0.5\]")
    assert p.pieces == (("[a:b:0.5]", 1.0),)


# ----------------------------------------------------------------------------------------------------------------
# chunks
# ----------------------------------------------------------------------------------------------------------------

def _both(pieces, tokenize, ids, matcher_names=None, **kw):
    """The module's TokenChunks and the reference's, checked equal; returns the module's."""
    pieces = tuple(pieces)
    matcher = EmbeddingMatcher(matcher_names, tokenize) if matcher_names else None
    ref_matcher = RefMatcher(matcher_names, tokenize) if matcher_names else None
    got = chunk_tokens(pieces, tokenize, bos=ids["bos"], eos=ids["eos"], comma=ids["comma"], matcher=matcher, **kw)
    want = ref_chunks(pieces, tokenize, bos=ids["bos"], eos=ids["eos"], comma=ids["comma"], matcher=ref_matcher,
                      **kw)
    assert tuple(map(tuple, got.ids)) == want[0]
    assert tuple(map(tuple, got.weights)) == want[1]
    assert tuple((e.name, e.chunk, e.offset, e.vectors) for e in got.embeddings) == want[2]
    assert got.token_count == want[3]
    for c_ids, c_w in zip(got.ids, got.weights):
        assert len(c_ids) == len(c_w) == kw.get("chunk_length", 75) + 2
    return got


def _xs(n: int) -> str:
    return " ".join(["x"] * n)


def test_short_prompt(tokenize, ids):
    got = _both(parse_a1111("a cat").pieces, tokenize, ids)
    words = tokenize(["a cat"])[0]
    assert got.ids == ((ids["bos"], *words, *[ids["eos"]] * (76 - len(words))),)
    assert got.weights == ((1.0,) * 77,)
    assert got.token_count == len(words) and got.embeddings == ()


def test_empty_prompt_is_one_chunk(tokenize, ids):
    got = _both((("", 1.0),), tokenize, ids)
    assert got.ids == ((ids["bos"],) + (ids["eos"],) * 76,) and got.token_count == 0


def test_exactly_75_tokens(tokenize, ids):
    got = _both([(_xs(75), 1.0)], tokenize, ids)
    assert got.ids == ((ids["bos"],) + (ids["x"],) * 75 + (ids["eos"],),)
    assert got.token_count == 75


def test_76_tokens(tokenize, ids):
    got = _both([(_xs(76), 1.0)], tokenize, ids)
    x, b, e = ids["x"], ids["bos"], ids["eos"]
    assert got.ids == ((b,) + (x,) * 75 + (e,), (b, x) + (e,) * 75)
    assert got.token_count == 76


def test_comma_backtrack(tokenize, ids):
    # 120 tokens: 65 x, a comma at index 65 (10 before the boundary), 54 x
    text = _xs(65) + ", " + _xs(54)
    assert len(tokenize([text])[0]) == 120
    got = _both([(text, 1.0)], tokenize, ids)
    x, b, e, c = ids["x"], ids["bos"], ids["eos"], ids["comma"]
    assert got.ids[0] == (b,) + (x,) * 65 + (c,) + (e,) * 10
    assert got.ids[1] == (b,) + (x,) * 54 + (e,) * 22
    assert got.token_count == 75 + 54


def test_comma_too_far_for_backtrack(tokenize, ids):
    text = _xs(45) + ", " + _xs(74)   # the comma 30 tokens before the boundary
    got = _both([(text, 1.0)], tokenize, ids)
    x, b, e, c = ids["x"], ids["bos"], ids["eos"], ids["comma"]
    assert got.ids[0] == (b,) + (x,) * 45 + (c,) + (x,) * 29 + (e,)
    assert got.ids[1] == (b,) + (x,) * 45 + (e,) * 31
    assert got.token_count == 120


@pytest.mark.parametrize("before", [0, 1, 19, 20, 21, 74])
def test_backtrack_edges(tokenize, ids, before):
    """A comma `before` tokens before the boundary, at index 75 - before; backtrack when before <= 20."""
    at = 75 - before
    text = (_xs(at) + ", " if at else ", ") + _xs(100)
    got = _both([(text, 1.0)], tokenize, ids)
    first_len = at + 1 if 0 < before <= 20 else 75
    assert got.ids[0][1:].index(ids["eos"]) == first_len


def test_backtrack_off_and_no_comma(tokenize, ids):
    text = _xs(65) + ", " + _xs(54)
    _both([(text, 1.0)], tokenize, ids, backtrack=0)
    got = chunk_tokens(((text, 1.0),), tokenize, bos=ids["bos"], eos=ids["eos"], comma=None)
    assert got.ids[0][1:76].count(ids["eos"]) == 0   # no comma id known: a plain 75-token split


def test_backtrack_moves_weights(tokenize, ids):
    pieces = [(_xs(70) + ", ", 1.0), (_xs(3), 1.5), (" " + _xs(10), 0.5)]
    got = _both(pieces, tokenize, ids)
    assert got.weights[0][1:72] == (1.0,) * 71 and got.weights[0][72:] == (1.0,) * 5
    assert got.weights[1][1:14] == (1.5,) * 3 + (0.5,) * 10


def test_break(tokenize, ids):
    got = _both(parse_a1111("red BREAK x x").pieces, tokenize, ids)
    b, e, x, r = ids["bos"], ids["eos"], ids["x"], ids["red"]
    assert got.ids == ((b, r) + (e,) * 75, (b, x, x) + (e,) * 74)
    assert got.token_count == 75 + 2


@pytest.mark.parametrize("prompt,chunks,count", [
    ("BREAK red", 2, 76),        # an empty first chunk
    ("red BREAK", 1, 75),        # nothing after the last BREAK: no empty chunk, but 75 counted
    ("BREAK", 1, 75),
    ("red BREAK BREAK red", 3, 151),
])
def test_break_edges(tokenize, ids, prompt, chunks, count):
    got = _both(parse_a1111(prompt).pieces, tokenize, ids)
    assert len(got.ids) == chunks and got.token_count == count


def test_only_minus_one_break_splits(tokenize, ids):
    got = _both([("x", H), ("BREAK", -1 * H), ("x", H)], tokenize, ids)
    word = tokenize(["BREAK"])[0]
    assert len(got.ids) == 1 and got.ids[0][1:3 + len(word)] == (ids["x"], *word, ids["x"])
    assert got.weights[0][2:2 + len(word)] == (-1 * H,) * len(word)


def test_break_in_a_full_chunk(tokenize, ids):
    got = _both([(_xs(75), 1.0), ("BREAK", -1.0), ("x", 1.0)], tokenize, ids)
    assert len(got.ids) == 2   # the full chunk closes at BREAK, no empty chunk between


def test_weights_in_place(tokenize, ids):
    p = parse_a1111("x (x:1.5) [x] ((x)) x")
    got = _both(p.pieces, tokenize, ids)
    assert got.weights[0][:7] == (1.0, 1.0, 1.5, SQUARE, ROUND * ROUND, 1.0, 1.0)
    assert got.ids[0][:7] == (ids["bos"],) + (ids["x"],) * 5 + (ids["eos"],)


def test_weights_across_chunks(tokenize, ids):
    got = _both([(_xs(70), 1.0), (" " + _xs(10), 1.3)], tokenize, ids)
    assert got.weights[0] == (1.0,) * 71 + (1.3,) * 5 + (1.0,)
    assert got.weights[1] == (1.0,) + (1.3,) * 5 + (1.0,) * 71


def test_embedding_matcher(tokenize):
    m = EmbeddingMatcher({"easyneg": 3, "easy": 2}, tokenize)
    toks = tokenize(["x easyneg easy x"])[0]
    n_long, n_short = len(tokenize(["easyneg"])[0]), len(tokenize(["easy"])[0])
    assert m.find(toks, 0) is None
    assert tuple(m.find(toks, 1)) == ("easyneg", 3, n_long)   # the longest name wins
    assert tuple(m.find(toks, 1 + n_long)) == ("easy", 2, n_short)


def test_embedding_in_one_chunk(tokenize, ids):
    got = _both([("x easyneg x", 1.2)], tokenize, ids, {"easyneg": 3})
    assert got.ids[0][:7] == (ids["bos"], ids["x"], 0, 0, 0, ids["x"], ids["eos"])
    assert got.weights[0][:7] == (1.0, 1.2, 1.2, 1.2, 1.2, 1.2, 1.0)
    (ref,) = got.embeddings
    assert (ref.name, ref.chunk, ref.offset, ref.vectors) == ("easyneg", 0, 2, 3)
    assert got.token_count == 5


def test_embedding_across_a_boundary(tokenize, ids):
    # 73 tokens, then 3 vectors: 76 > 75, so the embedding starts chunk 1
    got = _both([(_xs(73) + " easyneg x x", 1.0)], tokenize, ids, {"easyneg": 3})
    b, e, x = ids["bos"], ids["eos"], ids["x"]
    assert got.ids[0] == (b,) + (x,) * 73 + (e,) * 3
    assert got.ids[1] == (b, 0, 0, 0, x, x) + (e,) * 71
    (ref,) = got.embeddings
    assert (ref.chunk, ref.offset, ref.vectors) == (1, 1, 3)
    assert got.token_count == 75 + 5


def test_embedding_filling_a_chunk(tokenize, ids):
    got = _both([(_xs(72) + " easyneg x", 1.0)], tokenize, ids, {"easyneg": 3})
    assert got.ids[0][73:] == (0, 0, 0, ids["eos"]) and len(got.ids) == 2
    assert [(r.chunk, r.offset) for r in got.embeddings] == [(0, 73)]


def test_embedding_from_a_parsed_prompt(tokenize, ids):
    p = parse_a1111("(embedding:easyneg:1.4), x")
    assert p.embeddings == ("easyneg",)
    got = _both(p.pieces, tokenize, ids, {"easyneg": 2})
    assert got.ids[0][:5] == (ids["bos"], 0, 0, ids["comma"], ids["x"])
    assert got.weights[0][:5] == (1.0, 1.4, 1.4, 1.0, 1.0)


def test_chunks_fuzz_match_reference(tokenize, ids):
    """Random prompts of single-token words, commas, BREAKs, weights and embeddings, long enough for 1-4 chunks."""
    rng = random.Random(75)
    names = {"easyneg": 3, "badhand": 8, "red": 1}
    for _ in range(150):
        words = []
        for _ in range(rng.randint(0, 240)):
            r = rng.random()
            words.append("," if r < 0.12 else "BREAK" if r < 0.14 else "easyneg" if r < 0.17 else
                         "badhand" if r < 0.19 else "red" if r < 0.22 else "x")
        text = " ".join(words)
        if rng.random() < 0.5:   # some weights
            text = re.sub(r"x x", lambda m: rng.choice(["(x x)", "[x x]", "(x x:1.3)", "x x"]), text)
        p = parse_a1111(text)
        _both(p.pieces, tokenize, ids, names)
        _both(p.pieces, tokenize, ids, names, backtrack=5)


def test_embedding_refs_point_at_their_placeholders(tokenize, ids):
    """Invariant: after any backtrack, every EmbeddingRef's positions hold the placeholder ids (0)."""
    rng = random.Random(3)
    for _ in range(100):
        words = [rng.choice(["x", "x", "x", ",", "easyneg"]) for _ in range(rng.randint(60, 200))]
        got = chunk_tokens(((" ".join(words), 1.0),), tokenize, bos=ids["bos"], eos=ids["eos"], comma=ids["comma"],
                           matcher=EmbeddingMatcher({"easyneg": 4}, tokenize))
        for ref in got.embeddings:
            assert got.ids[ref.chunk][ref.offset:ref.offset + ref.vectors] == (0,) * ref.vectors


def test_with_pad(tokenize, ids):
    got = _both([(_xs(76), 1.0)], tokenize, ids)
    padded = with_pad(got, ids["eos"], 7)
    b, e, x = ids["bos"], ids["eos"], ids["x"]
    assert tuple(map(tuple, padded)) == ((b,) + (x,) * 75 + (e,), (b, x, e) + (7,) * 74)
    assert tuple(map(tuple, with_pad(got, e, e))) == tuple(map(tuple, got.ids))   # SD1: pad is the end token


def test_with_pad_after_an_embedding(tokenize, ids):
    got = _both([("x easyneg", 1.0)], tokenize, ids, {"easyneg": 3})
    padded = tuple(map(tuple, with_pad(got, ids["eos"], 7)))
    assert padded == ((ids["bos"], ids["x"], 0, 0, 0, ids["eos"]) + (7,) * 71,)


def test_pad_to(tokenize, ids):
    got = _both([("x easyneg", 1.0)], tokenize, ids, {"easyneg": 3})
    b, e = ids["bos"], ids["eos"]
    padded = pad_to(got, 3, b, e)
    assert tuple(map(tuple, padded.ids)) == tuple(map(tuple, got.ids)) + ((b,) + (e,) * 76,) * 2
    assert tuple(map(tuple, padded.weights)) == tuple(map(tuple, got.weights)) + ((1.0,) * 77,) * 2
    assert padded.embeddings == got.embeddings
    assert padded.token_count == got.token_count
    same = pad_to(got, 1, b, e)
    assert tuple(map(tuple, same.ids)) == tuple(map(tuple, got.ids))


def test_chunk_length_parameter(tokenize, ids):
    got = _both([(_xs(25), 1.0)], tokenize, ids, chunk_length=10, backtrack=3)
    assert len(got.ids) == 3 and all(len(c) == 12 for c in got.ids)
