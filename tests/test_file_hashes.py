"""AUTOMATIC1111's model hashes (diffgraph.models.file_hashes): hashed in the background so that nothing waits for
them, kept by file version (size, mtime, inode) in memory and in the cache folder, so a restart hashes nothing
again and a rewritten file is hashed anew."""

from __future__ import annotations

import hashlib
import json
import os
import threading

from diffgraph.models.file_hashes import FileHashes, sha256_of

BOUND_S = 20.0  # a failure bound, never a wait the test relies on


class GatedReader:
    """A hashing that waits for `gate` (a multi-GB file takes a minute) and counts its calls."""

    def __init__(self) -> None:
        self.gate, self.started, self.calls = threading.Event(), threading.Event(), []

    def __call__(self, path: str, st: os.stat_result) -> str:
        self.calls.append(path)
        self.started.set()
        assert self.gate.wait(BOUND_S)
        return sha256_of(path, st)


def _file(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_get_answers_before_the_hash_is_done_then_the_hash(tmp_path):
    path = _file(tmp_path / "m.safetensors", os.urandom(3 << 20) + b"tail")  # more than one 1 MiB chunk
    reader = GatedReader()
    hashes = FileHashes(str(tmp_path / "cache"), read=reader)
    assert hashes.get(path) is None  # answered while the hash has not even started, or is held at the gate
    assert reader.started.wait(BOUND_S)
    assert hashes.get(path) is None and hashes.short(path) is None  # still hashing: null, never a wait
    reader.gate.set()
    assert hashes.wait_idle(BOUND_S)
    expected = hashlib.sha256(open(path, "rb").read()).hexdigest()
    assert hashes.get(path) == expected and hashes.short(path) == expected[:10]
    assert reader.calls == [os.path.realpath(path)]  # queued once, though asked for three times


def test_the_cache_survives_a_restart_and_a_rewritten_file_is_hashed_again(tmp_path):
    path = _file(tmp_path / "m.safetensors", b"a" * 5000)
    cache = tmp_path / "cache"
    first = FileHashes(str(cache))
    assert first.compute(path) == hashlib.sha256(b"a" * 5000).hexdigest()
    stored = json.loads((cache / "hashes.json").read_text())
    assert stored[os.path.realpath(path)]["sha256"] == hashlib.sha256(b"a" * 5000).hexdigest()
    assert os.listdir(cache) == ["hashes.json"]  # no temporary file left behind

    reader = GatedReader()
    reader.gate.set()
    restarted = FileHashes(str(cache), read=reader)  # a new process: only the cache file is shared
    assert restarted.get(path) == hashlib.sha256(b"a" * 5000).hexdigest() and reader.calls == []

    st = os.stat(path)  # rewritten in place, same size: only its mtime moves
    _file(tmp_path / "m.safetensors", b"b" * 5000)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert restarted.get(path) is None  # the old version's hash is not this file's
    assert restarted.wait_idle(BOUND_S) and reader.calls == [os.path.realpath(path)]
    assert restarted.get(path) == hashlib.sha256(b"b" * 5000).hexdigest()
    _file(tmp_path / "m.safetensors", b"c" * 6000)  # another size
    assert restarted.compute(path) == hashlib.sha256(b"c" * 6000).hexdigest()
    assert FileHashes(str(cache)).get(path) == hashlib.sha256(b"c" * 6000).hexdigest()  # the file has the last one


def test_a_damaged_cache_is_ignored_and_rewritten(tmp_path):
    path = _file(tmp_path / "m.safetensors", b"x" * 100)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "hashes.json").write_text("{damaged")
    assert FileHashes(str(tmp_path / "cache")).compute(path) == hashlib.sha256(b"x" * 100).hexdigest()
    assert os.path.realpath(path) in json.loads((tmp_path / "cache" / "hashes.json").read_text())


def test_folders_missing_files_and_failed_hashes_have_no_hash(tmp_path):
    def failing(path: str, st: os.stat_result) -> str:
        calls.append(path)
        raise OSError("disk error")
    calls: list[str] = []
    hashes = FileHashes(str(tmp_path / "cache"), read=failing)
    assert hashes.get(str(tmp_path)) is None and hashes.compute(str(tmp_path)) is None  # A1111 hashes no folder
    assert hashes.get(str(tmp_path / "gone.safetensors")) is None
    path = _file(tmp_path / "m.safetensors", b"x")
    assert hashes.get(path) is None and hashes.wait_idle(BOUND_S)
    assert hashes.get(path) is None and hashes.wait_idle(BOUND_S)
    assert calls == [os.path.realpath(path)]  # a version that failed is not retried until the file changes


def _safetensors(path, metadata: dict | None = None, data: bytes = b"\x00\x01" * 64) -> bytes:
    header = {"w": {"dtype": "F16", "shape": [len(data) // 2], "data_offsets": [0, len(data)]}}
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return data


def test_infotext_hashes_as_automatic1111_reads_them(tmp_path):
    """`Model hash`: the checkpoint's short hash once hashed (a request never waits for it); `Lora hashes`: 12 hex
    digits of the sha256 after the safetensors header, or the file's own `sshs_model_hash`."""
    hashes = FileHashes(str(tmp_path / "cache"))
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"weights" * 100)
    hashes.compute(str(checkpoint))
    assert hashes.model(str(checkpoint)) == hashlib.sha256(b"weights" * 100).hexdigest()[:10]
    data = _safetensors(tmp_path / "ink.safetensors")
    assert hashes.lora(str(tmp_path / "ink.safetensors")) == hashlib.sha256(data).hexdigest()[:12]
    _safetensors(tmp_path / "given.safetensors", {"sshs_model_hash": "ABCDEF0123456789"})
    assert hashes.lora(str(tmp_path / "given.safetensors")) == "ABCDEF012345"
    for nothing in (str(tmp_path), str(tmp_path / "gone.safetensors"), "random:tiny", None):
        assert hashes.model(nothing) is None and hashes.lora(nothing) is None
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    assert hashes.lora(str(tmp_path / "bad.safetensors")) is None
