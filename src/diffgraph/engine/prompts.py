"""`PromptCache`: prompt conditioning, encoded in batches and kept in an LRU cache.

A key is (sign, text, text adapters): sign "+" (prompt) or "-" (negative prompt, text None = none), and the LoRA
adapters of the request that have text-encoder weights, as (adapter key (name, file version), scale, slot). The
cache keeps an entry under (sign, text, ((adapter key, scale), ...), text-encoder weights version): the slot only
says where the adapter is now, so it is not part of what was computed. Missing keys are encoded in one batch per
(sign, adapters): the model runner's `encode(texts, adapters)` does the device work.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from ..models.families.base import Conditioning, select_row

TextLoras = tuple[tuple[Any, float, int], ...]  # ((adapter key, scale, slot), ...)
PromptKey = tuple[str, "str | None", TextLoras]


class PromptCache:
    def __init__(self, size: int):
        if size < 0:
            raise ValueError(f"prompt_cache_size {size} must be >= 0")
        self.size = size
        self._cache: OrderedDict[tuple, Conditioning] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def embed(self, keys: list[PromptKey], version: int, encode: Callable[[list[str], TextLoras], Conditioning],
              negative: Callable[[Conditioning, list], Conditioning]) -> dict[PromptKey, Conditioning]:
        """Conditioning of every key: cached, or encoded (`negative(encoded, texts)` finishes negative prompts)."""
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
            texts = [k[1] for k in group]
            if sign == "+":
                enc = encode(texts, loras)
            else:
                enc = negative(encode(["" if t is None else t for t in texts], loras), texts)
            for i, k in enumerate(group):
                out[k] = select_row(enc, i)
                if self.size:
                    self._cache[_cache_key(k, version)] = out[k]
        while len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return out


def _cache_key(key: PromptKey, version: int) -> tuple:
    sign, text, loras = key
    return sign, text, tuple((adapter, scale) for adapter, scale, _ in loras), version
