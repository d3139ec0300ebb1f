"""Weighted prompt pieces in 75-token chunks: AUTOMATIC1111's `tokenize_line`, as pure functions on token ids.

`chunk_tokens` owns the layout of an "a1111" prompt's tokens: it takes syntax.py's (text, weight) pieces and a
`tokenize` callable (texts -> ids without special tokens; the caller wraps its CLIP tokenizer) and hands
text/prepared.py a `TokenChunks`: per chunk BOS, 75 positions (tokens, then EOS padding), EOS, each position's
weight, and where textual-inversion embeddings go (`EmbeddingRef`, found by `EmbeddingMatcher` as the web UI's
`find_embedding_at_position` finds them). The rules are the web UI's (modules/sd_hijack_clip.py): BREAK closes the
chunk; a chunk that fills up while a comma stands within the last `backtrack` tokens moves the tokens after that
comma to the next chunk; an embedding that does not fit starts the next chunk and occupies `vectors` positions
(placeholder id 0) at its piece's weight; the token count is the web UI's (full chunks count 75, the last its own
tokens). One departure, a fix: an embedding moved with the tokens after a comma moves its reference too (the web
UI leaves it behind, pointing into the earlier chunk's padding). `with_pad` and `pad_to` are the two later steps of
the web UI's forward: pad ids for tokenizers that pad with another token, and empty chunks for the shorter prompt.

How many chunks a prompt may have is the caller's to check. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..prompt_syntax import BREAK

Tokenize = Callable[[list[str]], Sequence[Sequence[int]]]


@dataclass(frozen=True)
class EmbeddingRef:
    """Where a textual-inversion embedding's vectors go."""
    name: str
    chunk: int     # which chunk
    offset: int    # first position inside the chunk's ids (BOS is position 0, so >= 1)
    vectors: int


@dataclass(frozen=True)
class TokenChunks:
    """A prompt's tokens in chunks of chunk_length + 2 ids."""
    ids: tuple[tuple[int, ...], ...]        # per chunk: BOS, chunk_length tokens padded with EOS, EOS
    weights: tuple[tuple[float, ...], ...]  # per chunk, per position (1.0 at BOS, EOS and padding)
    embeddings: tuple[EmbeddingRef, ...]
    token_count: int                        # AUTOMATIC1111's token count (what its UI shows)


class EmbeddingMatcher:
    """Finds embedding names in a token stream, longest match first (the web UI's `ids_lookup`): each name is
    tokenised once, and candidates are looked up by their first token."""

    def __init__(self, names: dict[str, int], tokenize: Tokenize):
        """`names`: embedding name -> its vector count; `tokenize` as for `chunk_tokens`."""
        ordered = list(names.items())
        ids = tokenize([name for name, _ in ordered]) if ordered else []
        lookup: dict[int, list[tuple[tuple[int, ...], str, int]]] = {}
        for (name, vectors), tokens in zip(ordered, ids):
            if isinstance(vectors, bool) or not isinstance(vectors, int) or vectors < 1:
                raise ValueError(f"embedding {name!r} has {vectors!r} vectors; an embedding has at least one")
            if not tokens:
                raise ValueError(f"embedding name {name!r} gives no tokens, so no prompt can name it; rename its file")
            lookup.setdefault(tokens[0], []).append((tuple(tokens), name, vectors))
        for candidates in lookup.values():
            candidates.sort(key=lambda c: len(c[0]), reverse=True)  # stable: equal lengths keep the given order
        self._lookup = lookup

    def find(self, tokens: Sequence[int], position: int) -> tuple[str, int, int] | None:
        """(name, vectors, tokens matched) of the longest name starting at `tokens[position]`, or None."""
        for ids, name, vectors in self._lookup.get(tokens[position], ()):
            if tuple(tokens[position:position + len(ids)]) == ids:
                return name, vectors, len(ids)
        return None


def chunk_tokens(pieces: Sequence[tuple[str, float]], tokenize: Tokenize, *, bos: int, eos: int, comma: int | None,
                 matcher: EmbeddingMatcher | None = None, chunk_length: int = 75, backtrack: int = 20) -> TokenChunks:
    """The pieces' tokens in chunks (AUTOMATIC1111's tokenize_line). `comma`: the tokenizer's ',</w>' id (None:
    no comma rule); `backtrack` 0 turns the comma rule off, as the web UI's comma_padding_backtrack does."""
    if chunk_length < 1:
        raise ValueError(f"chunk_length is {chunk_length}; a chunk holds at least one token")
    texts = [text for text, weight in pieces if (text, weight) != BREAK]
    tokenized = iter(tokenize(texts) if texts else [])
    out = _Chunks(bos, eos, chunk_length)
    for text, weight in pieces:
        if (text, weight) == BREAK:
            out.close()
            continue
        tokens = list(next(tokenized))
        position = 0
        while position < len(tokens):
            token = tokens[position]
            if token == comma:
                out.last_comma = len(out.tokens)
            elif backtrack and out.full() and out.last_comma != -1 and len(out.tokens) - out.last_comma <= backtrack:
                out.close_after_comma()
            if out.full():
                out.close()
            found = matcher.find(tokens, position) if matcher is not None else None
            if found is None:
                out.add(token, weight)
                position += 1
                continue
            name, vectors, matched = found
            if vectors > chunk_length:
                raise ValueError(f"embedding {name!r} has {vectors} vectors; a chunk holds {chunk_length} tokens, "
                                 "so it cannot stand in a prompt")
            if len(out.tokens) + vectors > chunk_length:
                out.close()
            out.refs.append((name, len(out.tokens), vectors))
            for _ in range(vectors):
                out.add(0, weight)
            position += matched
    if out.tokens or not out.ids:
        out.close(last=True)
    return TokenChunks(tuple(out.ids), tuple(out.weights), tuple(out.embeddings), out.token_count)


class _Chunks:
    """The chunks closed so far and the one being filled (chunk_tokens' working state)."""

    def __init__(self, bos: int, eos: int, length: int):
        self.bos, self.eos, self.length = bos, eos, length
        self.ids: list[tuple[int, ...]] = []
        self.weights: list[tuple[float, ...]] = []
        self.embeddings: list[EmbeddingRef] = []
        self.token_count = 0
        self.tokens: list[int] = []                  # the open chunk, without BOS / EOS
        self.multipliers: list[float] = []
        self.refs: list[tuple[str, int, int]] = []   # (name, index in self.tokens, vectors)
        self.last_comma = -1                         # index in self.tokens of the last comma, -1: none

    def full(self) -> bool:
        return len(self.tokens) == self.length

    def add(self, token: int, weight: float) -> None:
        self.tokens.append(token)
        self.multipliers.append(weight)

    def close(self, last: bool = False) -> None:
        """Pads the open chunk with EOS, frames it with BOS / EOS and starts an empty one."""
        self.token_count += len(self.tokens) if last else self.length
        pad = self.length - len(self.tokens)
        self.ids.append((self.bos, *self.tokens, *[self.eos] * pad, self.eos))
        self.weights.append((1.0, *self.multipliers, *[1.0] * pad, 1.0))
        chunk = len(self.ids) - 1
        self.embeddings += [EmbeddingRef(name, chunk, at + 1, vectors) for name, at, vectors in self.refs]
        self.tokens, self.multipliers, self.refs, self.last_comma = [], [], [], -1

    def close_after_comma(self) -> None:
        """Closes the open chunk after its last comma; the tokens after it (and their embeddings) open the next."""
        cut = self.last_comma + 1
        tokens, multipliers = self.tokens[cut:], self.multipliers[cut:]
        moved = [(name, at - cut, vectors) for name, at, vectors in self.refs if at >= cut]
        self.tokens, self.multipliers = self.tokens[:cut], self.multipliers[:cut]
        self.refs = [ref for ref in self.refs if ref[1] < cut]
        self.close()
        self.tokens, self.multipliers, self.refs = tokens, multipliers, moved


def with_pad(chunks: TokenChunks, eos: int, pad: int) -> tuple[tuple[int, ...], ...]:
    """The chunks' ids with every position after each chunk's first EOS set to `pad` (SD2's and SDXL's second
    tokenizer pad with '!'); unchanged where `pad == eos`."""
    if pad == eos:
        return chunks.ids
    out = []
    for ids in chunks.ids:
        end = ids.index(eos) + 1 if eos in ids else len(ids)
        out.append(ids[:end] + (pad,) * (len(ids) - end))
    return tuple(out)


def pad_to(chunks: TokenChunks, count: int, bos: int, eos: int) -> TokenChunks:
    """`chunks` with empty chunks (BOS, then EOS, weights 1) appended up to `count` chunks: the web UI's padding of
    the shorter of a prompt and its negative prompt. A prompt of `count` chunks or more is returned as it is."""
    missing = count - len(chunks.ids)
    if missing <= 0:
        return chunks
    size = len(chunks.ids[0])
    empty = (bos,) + (eos,) * (size - 1)
    return replace(chunks, ids=chunks.ids + (empty,) * missing, weights=chunks.weights + ((1.0,) * size,) * missing)
