"""The byte-level BPE alphabet GPT-2 defined and CLIP and Qwen tokenizers share: each byte as a printable character."""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """CLIP's (and GPT-2's) reversible byte -> printable unicode map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))
