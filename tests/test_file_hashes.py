"""AUTOMATIC1111's hashes of the files a request uses (models/file_hashes.py): a checkpoint's short hash is the
first 10 hex digits of its sha256, a LoRA's the first 12 of the sha256 of what follows its safetensors header (or its
`sshs_model_hash`); each file version is read once, however many threads ask at once; folders and missing files have
none."""

from __future__ import annotations

import hashlib
import json
import threading

from diffgraph.models import catalog
from diffgraph.models.file_hashes import FileHashes


def _safetensors(path, metadata: dict | None = None, data: bytes = b"\x00\x01" * 64) -> bytes:
    header = {"w": {"dtype": "F16", "shape": [len(data) // 2], "data_offsets": [0, len(data)]}}
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return data


def test_checkpoint_and_lora_hashes_as_automatic1111_reads_them(tmp_path):
    hashes = FileHashes(str(tmp_path / "cache"))
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"weights" * 100)
    assert hashes.model(str(checkpoint)) == hashlib.sha256(b"weights" * 100).hexdigest()[:10]
    data = _safetensors(tmp_path / "ink.safetensors")
    assert hashes.lora(str(tmp_path / "ink.safetensors")) == hashlib.sha256(data).hexdigest()[:12]
    _safetensors(tmp_path / "given.safetensors", {"sshs_model_hash": "ABCDEF0123456789"})
    assert hashes.lora(str(tmp_path / "given.safetensors")) == "ABCDEF012345"
    for nothing in (str(tmp_path), str(tmp_path / "gone.safetensors"), "random:tiny", None):
        assert hashes.model(nothing) is None and hashes.lora(nothing) is None
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    assert hashes.lora(str(tmp_path / "bad.safetensors")) is None


def test_each_file_version_is_read_once(tmp_path, monkeypatch):
    reads = []
    sha256 = catalog._sha256
    monkeypatch.setattr(catalog, "_sha256", lambda *a: reads.append(a[0]) or sha256(*a))
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"a" * 5000)
    hashes = FileHashes(str(tmp_path / "cache"))
    threads = [threading.Thread(target=hashes.model, args=(str(checkpoint),)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hashes.model(str(checkpoint)) and len(reads) == 1
    checkpoint.write_bytes(b"b" * 5001)  # a new version under the same name
    assert hashes.model(str(checkpoint)) == hashlib.sha256(b"b" * 5001).hexdigest()[:10] and len(reads) == 2
    assert FileHashes(str(tmp_path / "cache")).model(str(checkpoint)) and len(reads) == 2  # the cache folder's
