"""Rewriting a file the way users' tools do, for the tests of readers that must notice it (`FileChanged`)."""

from __future__ import annotations

import os

from diffgraph.safe_files import OpenFile


def rewrite(path: str, how: str) -> None:
    """`in place`: same size, other bytes (cp new old, rsync --inplace); `cut`: half its size; `replaced`: a new file
    renamed over the old (the open file stays whole)."""
    data = open(path, "rb").read()
    if how == "in place":
        with open(path, "r+b") as f:
            f.seek(len(data) // 2)
            f.write(bytes(b ^ 0xFF for b in data[len(data) // 2:]))
    elif how == "cut":
        os.truncate(path, len(data) // 2)
    else:
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)


def rewrite_on_read(monkeypatch, path: str, how: str, after: int = 2) -> list[int]:
    """Patches `OpenFile.readinto` to rewrite the file at `path` (`rewrite`) right after its `after`-th read; the
    offsets read, in a list that grows as they are read. The file is first dated long ago, so the rewrite moves its
    mtime past the kernel's clock tick."""
    os.utime(path, ns=(0, 0))
    real, calls = OpenFile.readinto, []

    def rewriting(self, view, offset):
        real(self, view, offset)
        calls.append(offset)
        if len(calls) == after:
            rewrite(path, how)

    monkeypatch.setattr(OpenFile, "readinto", rewriting)
    return calls
