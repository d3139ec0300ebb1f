"""Writes `assets/qwen/qwen_splits.bin.gz`: the merge that builds each of Qwen's BPE tokens, from its ranks.

A tiktoken vocabulary holds ranks, not merges; the merge that makes a token is the last step of byte-pair encoding
the token's own bytes with the ranks below its own (tiktoken's `_educational.bpe` recovers merges this way, and
Qwen's merges.txt holds one merge per token in rank order). The file stores, for each rank, the length in bytes of
the merge's left part (0 for the 256 single bytes), so `diffgraph.models.qwen_tokenizer` rebuilds the merge list
without running this search at load time (about half a minute of pure Python).

    python tools/build_qwen_merges.py  # reads and writes src/diffgraph/assets/qwen/
"""

from __future__ import annotations

import gzip
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from diffgraph.models.qwen_tokenizer import ASSETS, read_ranks  # noqa: E402


def last_merge(ranks: dict[bytes, int], token: bytes) -> int:
    """The byte length of the left part of the last merge when `token` is encoded with the ranks below its own;
    0 when those ranks cannot build it in one final merge."""
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best:
                best, at = rank, i
        if at < 0:
            return 0
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return len(parts[0])


def main() -> None:
    tokens = read_ranks()
    ranks = {token: rank for rank, token in enumerate(tokens)}
    splits = bytearray(len(tokens))
    for rank, token in enumerate(tokens):
        if len(token) > 1:
            splits[rank] = last_merge(ranks, token)
    unbuilt = [rank for rank, token in enumerate(tokens) if len(token) > 1 and splits[rank] == 0]
    path = os.path.join(ASSETS, "qwen_splits.bin.gz")
    with open(path, "wb") as f:
        f.write(gzip.compress(bytes(splits), compresslevel=9, mtime=0))
    print(f"wrote {path}: {len(tokens)} ranks, {len(unbuilt)} tokens no merge builds: {unbuilt[:20]}")


if __name__ == "__main__":
    main()
