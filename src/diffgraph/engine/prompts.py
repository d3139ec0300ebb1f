"""`PromptCache`: prompt conditioning, encoded in batches and kept in an LRU cache.

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


class PromptCache:
    def __init__(self, size: int):
        if size < 0:
            raise ValueError(f"prompt_cache_size {size} must be >= 0")
        self.size = size
        self._cache: OrderedDict[tuple, Conditioning] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def nbytes(self) -> int:
        """The bytes its cached rows hold (each row owns its storage: prompt_rows.py copies it out of its batch)."""
        return sum(t.numel() * t.element_size() for row in list(self._cache.values()) for t in row.values()
                   if hasattr(t, "element_size"))

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
                if self.size:
                    self._cache[_cache_key(k, version)] = out[k]
        while len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return out


def _cache_key(key: PromptKey, version: int) -> tuple:
    sign, text, loras = key
    return sign, text, tuple((adapter, scale) for adapter, scale, _ in loras), version
