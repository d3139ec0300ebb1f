"""Adapter names and device slots (diffgraph.lora.catalog, toward issue 12): the adapter folder's names, what is
refused (paths, '..', backslashes, NUL, links out of the folder, pickles), close-name hints; LRU slots that never
evict a pinned adapter, wait when all are pinned, and keep a replaced file's versions apart."""

from __future__ import annotations

import os

import pytest

from diffgraph.lora.catalog import AdapterDir, AdapterNameError, SlotCache, SlotsBusy


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "styles").mkdir()
    for rel in ("ink.safetensors", "styles/watercolor.safetensors", "styles/old.ckpt", "notes.txt", "evil.bin"):
        (tmp_path / rel).write_bytes(b"x")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.safetensors"
    outside.write_bytes(b"x")
    os.symlink(outside, tmp_path / "escape.safetensors")
    return tmp_path


def test_names_listing_and_refusals(folder):
    d = AdapterDir(str(folder))
    listing = d.listing()
    assert list(listing.adapters) == ["ink", "styles/watercolor"]  # the link out of the folder is not an adapter
    assert listing.ignored == ["evil.bin", "styles/old.ckpt"]
    assert d.path("styles/watercolor") == str((folder / "styles" / "watercolor.safetensors").resolve())
    (folder / "later.safetensors").write_bytes(b"x")  # added while serving: found without a restart
    assert d.path("later").endswith("later.safetensors")
    for bad, needle in (("/etc/passwd", "not allowed"), ("../x", "not allowed"), ("styles/../ink", "not allowed"),
                        ("styles\\ink", "not allowed"), ("ink\x00", "not allowed"), ("", "non-empty"),
                        ("escape", "outside the adapter folder"), ("evil", "unknown"),
                        ("watercolour", "did you mean 'styles/watercolor'")):
        with pytest.raises(AdapterNameError, match=needle):
            d.path(bad)


def test_slots_lru_pins_waits_and_versions():
    cache = SlotCache(slots=2)
    a1, b1, c1 = ("a", (1, 1)), ("b", (1, 1)), ("c", (1, 1))
    sa, write = cache.acquire(a1)
    assert (sa, write) == (1, True)
    assert cache.acquire(a1) == (1, False)  # already there: no write, pinned twice
    sb, _ = cache.acquire(b1)
    with pytest.raises(SlotsBusy):  # both slots pinned: the request waits
        cache.acquire(c1)
    cache.release(sb)
    sc, write = cache.acquire(c1)  # b is unpinned and least recently used: evicted, a (pinned) never
    assert (sc, write) == (sb, True) and cache.slot_of(b1) is None and cache.slot_of(a1) == sa
    cache.release(sa)
    cache.release(sa)
    cache.release(sc)
    # a file replaced on disk while a request with the old version runs: the new version gets its own slot, the
    # old one stays for the rows in flight
    old, write = cache.acquire(a1)
    assert (old, write) == (sa, False)
    a2 = ("a", (2, 2))
    s2, write = cache.acquire(a2)
    assert write and s2 != old and cache.slot_of(a1) == old and cache.slot_of(a2) == s2
    cache.release(old)
    cache.release(s2)
    assert cache.drop("a") and cache.slot_of(a2) is None
    with pytest.raises(ValueError, match="not pinned"):
        cache.release(s2)
