"""gguf_files: a user's GGUF file read through the safe file reader, its tensors dequantised with torch. The `gguf`
package is the oracle: files written by its GGUFWriter read back equal to `gguf.quants.dequantize` of the same
blocks, for every type read (quantised by gguf where it can, random blocks with finite scales where it cannot), and
the header equal to what its GGUFReader lists. Damaged, truncated and hostile headers are refused in one line; a
type not read is refused by name; a file rewritten while read is FileChanged; nothing maps the file."""

from __future__ import annotations

import mmap
import re
import struct
import weakref

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from rewrite_util import rewrite_on_read

from diffgraph.models import gguf_format
from diffgraph.models.gguf_files import GgufFile, NotGguf, UnreadableType, gguf_header, read_gguf
from diffgraph.models.gguf_quants import READABLE, random_blocks
from diffgraph.safe_files import FileChanged, UnusableFile


def _write(path, tensors: dict[str, tuple[np.ndarray, Q]], metadata=None) -> str:
    """A GGUF file written by gguf's own writer: each tensor's stored array (values for F32/F16, else uint8 blocks)
    as its type."""
    w = gguf.GGUFWriter(str(path), "flux")
    for key, value in (metadata or {}).items():
        w.add_array(key, value) if isinstance(value, list) else w.add_string(key, value)
    for name, (stored, qtype) in tensors.items():
        w.add_tensor(name, stored, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _stored(values: np.ndarray, qtype: Q) -> np.ndarray:
    """What a file holds for `values` as `qtype`: gguf's quantisation (F32/F16: the values)."""
    return values.astype(np.float16) if qtype == Q.F16 else gguf.quants.quantize(values, qtype)


def _expected(stored: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(stored, qtype)))


QUANTISED_BY_GGUF = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
RANDOM_BLOCKS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]


@pytest.mark.parametrize("qtype", QUANTISED_BY_GGUF, ids=lambda q: q.name)
def test_types_gguf_writes_read_back_equal_to_its_dequantize(tmp_path, qtype):
    rng = np.random.default_rng(0)
    shapes = {"blocks.0.attn.qkv.weight": (6, 64), "blocks.0.norm.scale": (64,), "mod.lin": (2, 3, 32)}
    stored = {name: _stored(rng.standard_normal(shape).astype(np.float32), qtype) for name, shape in shapes.items()}
    path = _write(tmp_path / "m.gguf", {name: (s, qtype) for name, s in stored.items()})
    got = read_gguf(path, dtype=torch.float32)
    assert list(got) == list(shapes)
    for name, shape in shapes.items():
        expected = _expected(stored[name], qtype)
        assert got[name].shape == shape == expected.shape, name
        assert torch.equal(got[name], expected), name
    as_bf16 = read_gguf(path, keys=["mod.lin"])  # the default dtype
    assert as_bf16["mod.lin"].dtype == torch.bfloat16 and torch.equal(as_bf16["mod.lin"], got["mod.lin"].bfloat16())


@pytest.mark.parametrize("qtype", RANDOM_BLOCKS, ids=lambda q: q.name)
def test_types_gguf_cannot_write_read_back_equal_to_its_dequantize(tmp_path, qtype):
    g = torch.Generator().manual_seed(int(qtype))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = {"img_in.weight": (3, 2 * block), "txt_in.weight": (1, block)}
    stored = {name: random_blocks(qtype.name, r * c // block, g).numpy().reshape(r, c // block * size)
              for name, (r, c) in rows.items()}
    path = _write(tmp_path / "m.gguf", {name: (s, qtype) for name, s in stored.items()})
    got = read_gguf(path, dtype=torch.float32)
    for name, shape in rows.items():
        expected = _expected(stored[name], qtype)
        assert bool(torch.isfinite(expected).all()) and expected.abs().max() > 0, name
        assert got[name].shape == shape and torch.equal(got[name], expected), name


def test_the_header_lists_what_ggufs_reader_lists(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_format, "KEPT_ITEMS", 5)
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (2, 66), dtype=np.uint8)  # IQ2_XXS: listed, not read
    path = _write(tmp_path / "m.gguf", {
        "double_blocks.0.img_attn.qkv.weight": (_stored(rng.standard_normal((4, 256)).astype(np.float32), Q.Q8_0),
                                                Q.Q8_0),
        "final_layer.linear.bias": (rng.standard_normal(8).astype(np.float32), Q.F32),
        "odd.weight": (blocks, Q.IQ2_XXS)},
        metadata={"general.name": "tiny flux", "general.tags": ["a", "bb"], "tokenizer.ids": list(range(9))})
    header = gguf_header(path)
    reader = gguf.GGUFReader(path)  # (the oracle maps its own test file)
    assert header.version == 3 and header.architecture == "flux" and header.alignment == 32
    assert header.metadata["general.name"] == "tiny flux" and header.metadata["general.tags"] == ("a", "bb")
    assert header.long_arrays == {"tokenizer.ids": 9} and "tokenizer.ids" not in header.metadata
    assert [(t.name, t.type_name, t.shape, t.offset, t.nbytes) for t in header.tensors.values()] == [
        (t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), t.data_offset, t.n_bytes)
        for t in reader.tensors]
    assert header.types() == {"Q8_0": 1, "F32": 1, "IQ2_XXS": 1}
    assert [t.type_name in READABLE for t in header.tensors.values()] == [True, True, False]
    assert header.shapes() == {t.name: t.shape for t in header.tensors.values()} and header.orig_shapes == {}
    version_2 = tmp_path / "v2.gguf"  # the layout of version 3 (which only added big-endian files)
    version_2.write_bytes(open(path, "rb").read()[:4] + struct.pack("<I", 2) + open(path, "rb").read()[8:])
    assert gguf_header(str(version_2)).version == 2
    assert read_gguf(str(version_2), keys=["final_layer.linear.bias"], dtype=torch.float32)[
        "final_layer.linear.bias"].tolist() == reader.tensors[1].data.tolist()


def test_a_type_not_read_is_refused_by_name_before_anything_is_read(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    path = _write(tmp_path / "m.gguf", {"a.weight": (np.ones((2, 32), np.float32), Q.F32),
                                        "empty.weight": (np.zeros((0, 34), np.uint8), Q.Q8_0),
                                        "b.weight": (random_blocks("Q4_K", 2, g).numpy(), Q.Q4_K),
                                        "c.weight": (np.zeros((1, 66), np.uint8), Q.IQ2_XXS)})
    reads = []
    monkeypatch.setattr(GgufFile, "_raw", lambda self, t: reads.append(t.name))
    with pytest.raises(UnreadableType) as e:
        read_gguf(path)
    assert str(e.value) == ("has tensor 'c.weight' in IQ2_XXS, which diffgraph does not read; use a Q4_K, Q8_0 or "
                            "F16 file") and reads == []
    monkeypatch.undo()
    some = read_gguf(path, keys=["b.weight", "a.weight", "empty.weight"])
    assert list(some) == ["b.weight", "a.weight", "empty.weight"] and some["empty.weight"].shape == (0, 32)
    with pytest.raises(UnusableFile, match="^has no tensor 'd.weight': "):
        read_gguf(path, keys=["d.weight"])


def _valid(tmp_path) -> tuple[bytes, int, int]:
    """A file of two F32 tensors (`blocks.0.a` [2, 32], `blocks.0.b` [32]) and one metadata string, its bytes, and
    where the two tensor infos start."""
    path = _write(tmp_path / "v.gguf", {"blocks.0.a": (np.ones((2, 32), np.float32), Q.F32),
                                        "blocks.0.b": (np.ones(32, np.float32), Q.F32)},
                  metadata={"general.name": "x"})
    data = open(path, "rb").read()
    return data, data.index(b"blocks.0.a") + 10, data.index(b"blocks.0.b") + 10


def _patch(data: bytes, at: int, fmt: str, *values) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, *values)
    return bytes(out)


def _damaged(data: bytes, a: int, b: int, how: str) -> bytes:
    """`a`, `b`: the offsets just past each tensor's name (its dimension count)."""
    key = data.index(b"general.architecture") - 8
    return {"magic": b"GGML" + data[4:],
            "empty": b"",
            "cut-header": data[:a],
            "cut-data": data[:-8],
            "version-1": _patch(data, 4, "<I", 1),
            "version-4": _patch(data, 4, "<I", 4),
            "big-endian": _patch(data, 4, ">I", 3),
            "tensor-count": _patch(data, 8, "<Q", 1 << 60),
            "key-count": _patch(data, 16, "<Q", 1 << 40),
            "key-length": _patch(data, key, "<Q", 1 << 40),
            "value-type": _patch(data, key + 8 + 20, "<I", 77),
            "dims": _patch(data, a, "<I", 9),
            "huge-dim": _patch(data, a + 4, "<Q", 1 << 62),
            "type": _patch(data, a + 4 + 16, "<I", 99),
            "misaligned": _patch(data, b + 4 + 8 + 4, "<Q", 4),
            "overlap": _patch(data, b + 4 + 8 + 4, "<Q", 128),
            "duplicate": data.replace(b"blocks.0.b", b"blocks.0.a"),
            "block-rows": _patch(_patch(data, a + 4 + 16, "<I", 8), a + 4, "<Q", 48),
            }[how]


@pytest.mark.parametrize("how, words", [
    ("magic", "is not a GGUF file (it starts with b'GGML', not b'GGUF')"),
    ("empty", "0 bytes; its header's magic runs past the end"),
    ("cut-header", "its header's tensor 'blocks.0.a''s dimension count runs past the end): it is truncated"),
    ("cut-data", "tensor 'blocks.0.b' of [32] ends at byte"),
    ("version-1", "GGUF version 1 file, older than diffgraph reads (2, 3)"),
    ("version-4", "GGUF version 4 file, newer than diffgraph reads"),
    ("big-endian", "is a big-endian GGUF file"),
    ("tensor-count", f"counts {1 << 60} tensors"),
    ("key-count", f"{1 << 40} metadata keys, above the limits"),
    ("key-length", f"a metadata key of {1 << 40} bytes, above the limit"),
    ("value-type", "metadata 'general.architecture' has value type 77, not a GGUF type"),
    ("dims", "tensor 'blocks.0.a' has 9 dimensions, above GGML's 4"),
    ("huge-dim", f"tensor 'blocks.0.a' of [2, {1 << 62}] ends at byte"),
    ("type", "tensor 'blocks.0.a' has type 99, not a GGML type diffgraph knows"),
    ("misaligned", "tensor 'blocks.0.b' starts at data offset 4, not a multiple of the alignment 32"),
    ("overlap", "tensor 'blocks.0.b' overlaps tensor 'blocks.0.a'"),
    ("duplicate", "tensor 'blocks.0.a' appears twice"),
    ("block-rows", "tensor 'blocks.0.a' has rows of 48 values, not whole Q8_0 blocks of 32"),
])
def test_damaged_or_hostile_files_are_refused_in_one_line(tmp_path, how, words):
    path = tmp_path / "bad.gguf"
    path.write_bytes(_damaged(*_valid(tmp_path), how))
    for read in (gguf_header, read_gguf):
        with pytest.raises(NotGguf) as e:
            read(str(path))
        message = str(e.value)
        assert words in message and "\n" not in message, message
        assert any(fix in message for fix in ("again", "use the", "download a")), message


def test_a_hostile_alignment_or_array_is_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "flux")
    w.add_uint32("general.alignment", 24)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(NotGguf, match=r"its general.alignment is 24, not a power of two up to 1048576\)"):
        gguf_header(str(tmp_path / "a.gguf"))
    data = open(tmp_path / "a.gguf", "rb").read()
    at = data.index(b"general.alignment") + len("general.alignment")  # value type 4, then the value
    array = struct.pack("<IIQ", 9, 9, 3)  # an array of arrays
    (tmp_path / "b.gguf").write_bytes(data[:at] + array + data[at + 8:])
    with pytest.raises(NotGguf, match="'general.alignment' is an array of arrays, which GGUF files do not hold"):
        gguf_header(str(tmp_path / "b.gguf"))
    (tmp_path / "c.gguf").write_bytes(data[:at] + struct.pack("<IIQ", 9, 4, 1 << 50) + data[at + 8:])
    with pytest.raises(NotGguf, match=f"is an array of {1 << 50} items, more than its header's .* bytes left hold"):
        gguf_header(str(tmp_path / "c.gguf"))


def test_comfyui_ggufs_reshaped_tensors_read_in_their_original_shape(tmp_path):
    rng = np.random.default_rng(2)
    conv = rng.standard_normal((8, 4, 4, 4)).astype(np.float32)  # stored as rows of 256 values, as its converter does
    stored = _stored(conv.reshape(2, 256), Q.Q8_0)
    path = _write(tmp_path / "m.gguf", {"conv.weight": (stored, Q.Q8_0), "b": (np.ones(4, np.float32), Q.F32)},
                  metadata={"comfy.gguf.orig_shape.conv.weight": [8, 4, 4, 4]})
    header = gguf_header(path)
    assert header.tensors["conv.weight"].shape == (2, 256) and header.orig_shapes == {"conv.weight": (8, 4, 4, 4)}
    assert header.shapes() == {"conv.weight": (8, 4, 4, 4), "b": (4,)}
    got = read_gguf(path, dtype=torch.float32)["conv.weight"]
    assert torch.equal(got, _expected(stored, Q.Q8_0).reshape(8, 4, 4, 4))
    for name, shape, words in [("conv.weight", [8, 4, 4], "is (8, 4, 4), not a shape of the tensor's 512 values"),
                               ("gone", [4], "gives the shape of a tensor it does not hold")]:
        bad = _write(tmp_path / "bad.gguf", {"conv.weight": (stored, Q.Q8_0)},
                     metadata={f"comfy.gguf.orig_shape.{name}": shape})
        with pytest.raises(NotGguf, match=f"its metadata 'comfy.gguf.orig_shape.{name}' {re.escape(words)}"):
            gguf_header(bad)


@pytest.mark.parametrize("how, words", [("in place", "changed while it was read"),
                                        ("cut", "while it was read"),
                                        ("replaced", "was replaced while it was read")])
def test_a_file_rewritten_while_read_is_refused(tmp_path, monkeypatch, how, words):
    path = _write(tmp_path / "m.gguf", {"a": (np.ones((64, 64), np.float32), Q.F32),
                                        "b": (np.ones(64, np.float32), Q.F32)})
    calls = rewrite_on_read(monkeypatch, path, how)
    with pytest.raises(FileChanged) as e, GgufFile(path, chunk=1024) as f:
        f.read()
    assert str(e.value).endswith(words) and "\n" not in str(e.value), e.value
    assert len(calls) == (17 if how == "replaced" else 2)  # a rename leaves the open file whole: seen at the end


def test_nothing_maps_the_file(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a user's file was mapped")

    stored = _stored(np.linspace(-1, 1, 256, dtype=np.float32).reshape(4, 64), Q.Q8_0)
    path = _write(tmp_path / "m.gguf", {"w": (stored, Q.Q8_0)})
    for module, name in ((mmap, "mmap"), (np, "memmap"), (gguf, "GGUFReader"), (torch, "from_file"),
                         (torch.UntypedStorage, "from_file")):
        monkeypatch.setattr(module, name, refuse)
    assert torch.equal(read_gguf(path, dtype=torch.float32)["w"], _expected(stored, Q.Q8_0))


def test_with_a_device_the_host_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    """Each tensor's blocks are read, moved and dequantised on the device before the next is read (the meta device
    stands in for a GPU: moving there frees the host tensor)."""
    g = torch.Generator().manual_seed(0)
    path = _write(tmp_path / "m.gguf", {f"t{i}": (random_blocks("Q4_K", 4, g).numpy(), Q.Q4_K) for i in range(5)})
    real, made = GgufFile._raw, []

    def tracked(self, t):
        assert all(ref() is None for ref in made), "an earlier host tensor is still alive"
        raw = real(self, t)
        made.append(weakref.ref(raw))
        return raw

    monkeypatch.setattr(GgufFile, "_raw", tracked)
    got = read_gguf(path, device="meta", dtype=torch.float16)
    assert len(made) == 5
    assert all(t.device.type == "meta" and t.dtype == torch.float16 and t.shape == (4, 256) for t in got.values())
