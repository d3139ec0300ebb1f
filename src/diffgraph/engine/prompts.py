"""`PromptCache`: prompt conditioning, encoded in batches and kept in an LRU cache bounded by entries and by bytes.

A key is (sign, prompt, text adapters): sign "+" (prompt) or "-" (negative prompt), the prompt as its token ids
(text/prepared.py `PromptText`: text None = no negative prompt; its syntax, clip skip, emphasis weights and
embedding versions), and the LoRA adapters of the request that have text-encoder weights, as (adapter key (name,
file version), scale, slot). The cache keeps an entry under (sign, prompt, ((adapter key, scale), ...), text-encoder
weights version): the slot only says where the adapter is now, so it is not part of what was computed. Missing keys
are encoded in one batch per (sign, adapters): `encode(prompts, adapters)` (the runner's
`prompt_rows.PromptEncoder.encode_with`) does the device work
and returns one row per prompt in storage of its own (a cached row never keeps its batch alive).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from ..models.families.base import Conditioning
from ..text.prepared import PromptText

TextLoras = tuple[tuple[Any, float, int], ...]  # ((adapter key, scale, slot), ...)
PromptKey = tuple[str, PromptText, TextLoras]


DEFAULT_CACHE_BYTES = 256 << 20  # an LLM encoder's prompt row is megabytes: the cache is bounded by bytes too


class PromptCache:
    """At most `size` entries and `max_bytes` bytes of rows, least recently used out first; a row larger than
    `max_bytes` alone is not kept."""

    def __init__(self, size: int, max_bytes: int = DEFAULT_CACHE_BYTES):
        if size < 0:
            raise ValueError(f"prompt_cache_size {size} must be >= 0")
        if max_bytes < 0:
            raise ValueError(f"prompt_cache_bytes {max_bytes} must be >= 0")
        self.size, self.max_bytes = size, max_bytes
        self._cache: OrderedDict[tuple, Conditioning] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def nbytes(self) -> int:
        """The bytes its cached rows hold (each row owns its storage: prompt_rows.py copies it out of its batch)."""
        return self._bytes

    def _keep(self, key: tuple, row: Conditioning) -> None:
        size = _row_bytes(row)
        if not self.size or size > self.max_bytes:
            return
        old = self._cache.pop(key, None)
        self._bytes -= 0 if old is None else _row_bytes(old)
        self._cache[key] = row
        self._bytes += size
        while len(self._cache) > self.size or self._bytes > self.max_bytes:
            self._bytes -= _row_bytes(self._cache.popitem(last=False)[1])

    def embed(self, keys: list[PromptKey], version: int,
              encode: Callable[[list[PromptText], TextLoras], list[Conditioning]],
              negative: Callable[[Conditioning, list], Conditioning]) -> dict[PromptKey, Conditioning]:
        """Conditioning of every key: cached, or encoded (`negative(row, [text])` finishes negative prompts)."""
        out: dict[PromptKey, Conditioning] = {}
        missing: dict[tuple[str, TextLoras], list[PromptKey]] = {}
        unique = list(dict.fromkeys(keys))
        for k in unique:
            ck = _cache_key(k, version)
            if ck in self._cache:
                self._cache.move_to_end(ck)
                out[k] = self._cache[ck]
            else:
                missing.setdefault((k[0], k[2]), []).append(k)
        n_missing = sum(len(v) for v in missing.values())
        self.hits += len(keys) - n_missing
        self.misses += n_missing
        for (sign, loras), group in missing.items():
            rows = encode([k[1] for k in group], loras)
            for k, row in zip(group, rows):
                out[k] = row if sign == "+" else negative(row, [k[1].text])
                self._keep(_cache_key(k, version), out[k])
        return out


def _row_bytes(row: Conditioning) -> int:
    return sum(t.numel() * t.element_size() for t in row.values() if hasattr(t, "element_size"))


def _cache_key(key: PromptKey, version: int) -> tuple:
    sign, text, loras = key
    return sign, text, tuple((adapter, scale) for adapter, scale, _ in loras), version
