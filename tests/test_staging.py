"""engine/staging.py `DecodedPixels`: a reader of a decode's rows waits for the chunk that holds the last of them,
not for the whole decode, and gets exactly its rows."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from diffgraph.engine.staging import DecodedPixels


class _Event:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(self.name)


def test_a_reader_waits_for_the_chunk_that_holds_its_last_row_only():
    log: list[str] = []
    host = torch.arange(9 * 2 * 2 * 3, dtype=torch.float32).reshape(9, 2, 2, 3)
    chunks = [(4, _Event(log, "first 4")), (8, _Event(log, "next 4")), (9, _Event(log, "last 1"))]
    pixels = DecodedPixels(host, chunks, contextlib.nullcontext)
    assert np.array_equal(pixels.rows(1, 2), host[1:3].numpy()) and log == ["first 4"]
    assert np.array_equal(pixels.rows(3, 2), host[3:5].numpy()) and log[-1] == "next 4"  # spans two: the later
    assert np.array_equal(pixels.rows(8, 1), host[8:9].numpy()) and log[-1] == "last 1"
    assert np.array_equal(pixels(), host.numpy()) and log[-1] == "last 1" and len(log) == 4


def test_on_the_cpu_the_rows_are_there_already():
    host = torch.rand(3, 4, 4, 3)
    pixels = DecodedPixels(host, [(2, None), (3, None)], contextlib.nullcontext)
    assert np.array_equal(pixels.rows(2, 1), host[2:].numpy()) and np.array_equal(pixels(), host.numpy())


def test_rows_outside_the_decode_are_refused_not_read_unsynchronised():
    pixels = DecodedPixels(torch.rand(3, 2, 2, 3), [(2, _Event([], "a")), (3, _Event([], "b"))], contextlib.nullcontext)
    for first, count in ((2, 2), (-1, 1), (0, 0)):
        with pytest.raises(IndexError, match="not in this decode's 3 rows"):
            pixels.rows(first, count)
