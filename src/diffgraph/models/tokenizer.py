"""Deterministic CLIP tokenizer files for the presets.

The random and trained presets must never download anything, so their tokenizer is built here from
code: CLIP's byte-level alphabet (every byte, alone and word-final) plus a fixed list of merges that
spell common English words and digits whole. The same call always writes the same files, and
`CLIPTokenizer.from_pretrained` reads them with any transformers version. Real models bring their
own tokenizer folders; this module is only for presets.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING

from ..text.byte_level import bytes_to_unicode

if TYPE_CHECKING:
    from transformers import CLIPTokenizer

BOS = "<|startoftext|>"
EOS = "<|endoftext|>"

# Words that become single tokens. Order is the merge rank; never reorder (it changes token ids).
_WORDS = (
    "a an the of and with in on at to for by from is are this that it its as or not no "
    "photo picture image painting drawing sketch render portrait landscape close up view "
    "handwritten digit number written hand black white red green blue yellow orange purple pink "
    "brown gray grey dark light bright small large big tiny old new young beautiful detailed "
    "zero one two three four five six seven eight nine ten "
    "cat dog bird horse fish tree flower house city street car road mountain river sea sky sun "
    "moon star night day forest field lake snow rain cloud man woman child person face people "
    "high quality best blurry low bad ugly lowres worst style art digital oil watercolor "
    "astronaut riding space castle robot dragon"
).split()


def build_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """The vocabulary (token -> id, specials last as in CLIP) and the merge list."""
    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + [c + "</w>" for c in alphabet]
    merges: list[str] = []
    seen = set(tokens)
    for word in _WORDS + [str(d) for d in range(10)]:
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        while len(symbols) > 1:
            pair = f"{symbols[0]} {symbols[1]}"
            merged = symbols[0] + symbols[1]
            if merged not in seen:
                merges.append(pair)
                tokens.append(merged)
                seen.add(merged)
            symbols = [merged] + symbols[2:]
    tokens += [BOS, EOS]
    return {tok: i for i, tok in enumerate(tokens)}, merges


def vocab_size() -> int:
    return len(build_vocab_and_merges()[0])


def special_ids() -> tuple[int, int]:
    """(bos_token_id, eos_token_id): the last two ids, as in CLIP."""
    n = vocab_size()
    return n - 2, n - 1


def write_tokenizer(folder: str, pad_token: str = EOS) -> None:
    """Writes a CLIP tokenizer folder. SD1.x's tokenizer pads with the end token, SD2/SDXL's second one with '!'."""
    vocab, merges = build_vocab_and_merges()
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": 77,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": EOS,
        "pad_token": pad_token,
        "do_lower_case": True,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(folder, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump({k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}, f, indent=2)


def preset_tokenizer(pad_token: str = EOS) -> CLIPTokenizer:
    """A fresh CLIPTokenizer over the deterministic preset vocabulary. Its files are written to a temporary
    folder that is removed once the tokenizer has read them (it keeps everything in memory)."""
    # transformers is imported here, not at the top: the presets read the vocabulary size at import, and
    # `diffgraph models` / `--help` list them without loading transformers
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory(prefix="diffgraph-tokenizer-") as folder:
        write_tokenizer(folder, pad_token)
        return CLIPTokenizer.from_pretrained(folder, local_files_only=True)
