"""safe_tensors: a user's safetensors file streamed into tensors, checked, never mapped. Equal to safetensors' own
reader for every dtype; a file rewritten, cut or replaced between chunks refused; damaged headers and bad fp8 values
refused in one line with the fix; the bytes land in the tensors returned (no copy of the file), and with a device
one tensor at a time stays on the host. safe_files: a file that grows while read is refused, a header's nesting,
tensor count, dimensions and names and a folder's JSON depth are bounded before they are used, and the file pool
bounds each read in time."""

from __future__ import annotations

import json
import mmap
import os
import threading

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from safetensors.torch import load_file, save_file

from rewrite_util import rewrite, rewrite_on_read

from diffgraph.safe_files import FileChanged, NotSafetensors, OpenFile
from diffgraph.safe_tensors import BadWeights, TensorFile, read_safetensors


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    return {"f32": x, "f16": x.half(), "bf16": x.bfloat16(), "f64": x.double()[:2],
            "e4m3": x.to(torch.float8_e4m3fn), "e5m2": x.to(torch.float8_e5m2), "i64": torch.arange(7),
            "i8": torch.arange(-3, 4, dtype=torch.int8), "u8": torch.arange(9, dtype=torch.uint8),
            "bool": x[0] > 0, "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}


def _raw(path, header: dict, body: bytes) -> str:
    """A safetensors file written by hand: `header` as given (no checks), then `body`."""
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + body)
    return str(path)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("chunk", [7, 1 << 20], ids=["odd-chunks", "one-chunk"])
def test_equal_to_safetensors_own_reader_for_every_dtype(tmp_path, chunk):
    path = str(tmp_path / "w.safetensors")
    save_file(_state(), path)
    expected = load_file(path)
    with TensorFile(path, chunk=chunk) as f:
        got = f.read()
    assert got.keys() == expected.keys()
    for key, t in expected.items():
        assert (got[key].dtype, got[key].shape) == (t.dtype, t.shape), key
        assert torch.equal(_bits(got[key]), _bits(t)), key
    some = read_safetensors(path, keys=["bf16", "i64"], dtype=torch.float32)
    assert some.keys() == {"bf16", "i64"} and some["i64"].dtype == torch.int64  # only floating point converted
    assert torch.equal(some["bf16"], expected["bf16"].float())


@pytest.mark.parametrize("how, words", [("in place", "changed while it was read"),
                                        ("cut", "changed while it was read"),
                                        ("replaced", "was replaced while it was read")])
def test_a_file_rewritten_between_chunks_is_refused(tmp_path, monkeypatch, how, words):
    path = str(tmp_path / "w.safetensors")
    save_file({"a": torch.randn(64, 64), "b": torch.randn(64)}, path)
    calls = rewrite_on_read(monkeypatch, path, how)
    with pytest.raises(FileChanged) as e, TensorFile(path, chunk=1024) as f:
        f.read()
    assert str(e.value).endswith(words), e.value
    # found right after the chunk that saw it; a rename leaves the open file whole, so only the end's check sees it
    assert len(calls) == (17 if how == "replaced" else 2)


def test_a_rewritten_adapter_is_a_one_line_error_naming_it(tmp_path, monkeypatch):
    from diffgraph.lora.files import AdapterChanged, read_adapter

    path = str(tmp_path / "style.safetensors")
    save_file({"unet.down.lora_A.weight": torch.randn(4, 320)}, path)
    os.utime(path, ns=(0, 0))
    real = OpenFile.readinto
    monkeypatch.setattr(OpenFile, "readinto", lambda self, v, o: (real(self, v, o), rewrite(path, "in place")))
    with pytest.raises(AdapterChanged, match=r"^adapter 'style': style.safetensors changed while it was read$"):
        read_adapter(path, "StableDiffusionPipeline", "style")


def _f32(n: int) -> dict:
    return {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}


@pytest.mark.parametrize("header, body, words", [
    ({"a": _f32(4)}, b"\0" * 10, "tensor 'a' ends at byte"),                                  # truncated
    ({"a": _f32(2), "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlaps tensor 'a'"),
    ({"a": _f32(2), "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}}, b"\0" * 16, "starts 4 bytes after"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "[3] is 12 bytes, its offsets span 8"),
    ({"a": _f32(1)}, b"\0" * 12, "its header describes"),                                     # bytes after the last
    ({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", "a dtype this reader does not know"),
], ids=["truncated", "overlap", "gap", "byte-count", "trailing", "unknown-dtype"])
def test_damaged_files_are_refused_in_one_line_with_the_fix(tmp_path, header, body, words):
    path = _raw(tmp_path / "bad.safetensors", header, body)
    with pytest.raises(NotSafetensors) as e:
        read_safetensors(path)
    message = str(e.value)
    assert words in message and "\n" not in message, message
    assert any(fix in message for fix in ("copy it again", "download it again", "convert the file")), message


def test_a_cut_file_read_by_a_reader_names_the_file(tmp_path):
    from diffgraph.lora.files import AdapterError, read_adapter

    path = str(tmp_path / "cut.safetensors")
    save_file({"unet.down.lora_A.weight": torch.randn(4, 320)}, path)
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(AdapterError, match=r"^adapter 'cut': cut.safetensors is not a readable safetensors file "
                                           r"\(tensor 'unet.down.lora_A.weight' ends at byte \d+, past"):
        read_adapter(path, "StableDiffusionPipeline", "cut")


def _fp8_layer(weight: torch.Tensor, **scales: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"blocks.0.attn.weight": weight.to(torch.float8_e4m3fn), "blocks.0.attn.bias": torch.zeros(4),
            **{f"blocks.0.attn.{k}": v for k, v in scales.items()}}


@pytest.mark.parametrize("state, words", [
    (_fp8_layer(torch.ones(4, 4), scale_weight=torch.tensor([float("nan")])), "'blocks.0.attn.scale_weight' that holds "
                                                                              "1 NaN or infinite"),
    (_fp8_layer(torch.ones(4, 4), weight_scale=torch.zeros(4)), "'blocks.0.attn.weight_scale' that holds 0, not above"),
    (_fp8_layer(torch.ones(4, 4), input_scale=torch.tensor(-1.0)), "'blocks.0.attn.input_scale' that holds -1, not"),
    (_fp8_layer(torch.ones(4, 4), scale=torch.tensor(float("inf"))), "'blocks.0.attn.scale' that holds 1 NaN"),
    (_fp8_layer(torch.full((4, 4), float("nan")), scale_weight=torch.ones(1)), "holds 16 NaN or infinite values in "
                                                                              "fp8 tensor 'blocks.0.attn.weight'"),
], ids=["scale-nan", "scale-zero", "input-scale-negative", "dot-scale-inf", "weight-nan"])
def test_bad_fp8_values_are_refused_naming_the_tensor(tmp_path, state, words):
    path = str(tmp_path / "q.safetensors")
    save_file(state, path)
    with pytest.raises(BadWeights) as e:
        read_safetensors(path)
    assert words in str(e.value) and "quantise or download it again" in str(e.value), str(e.value)


def test_good_fp8_files_and_norm_scales_are_read(tmp_path):
    path = str(tmp_path / "q.safetensors")
    e5m2 = torch.tensor([1.0, -2.0, 448.0]).to(torch.float8_e5m2)
    state = {**_fp8_layer(torch.randn(4, 4), scale_weight=torch.tensor([0.02]), input_scale=torch.tensor(1.0)),
             "blocks.0.norm.scale": torch.tensor([-0.5, 0.0]),  # a norm's weight (its layer holds no fp8): any value
             "blocks.1.e5m2": e5m2}
    save_file(state, path)
    got = read_safetensors(path, dtype=torch.float32)
    assert torch.equal(got["blocks.0.attn.weight"], state["blocks.0.attn.weight"].float())
    assert torch.equal(got["blocks.0.norm.scale"], state["blocks.0.norm.scale"])
    assert torch.equal(got["blocks.1.e5m2"], e5m2.float())
    save_file({"blocks.1.e5m2": torch.tensor([float("inf")]).to(torch.float8_e5m2)}, path)
    with pytest.raises(BadWeights, match="1 NaN or infinite values in fp8 tensor 'blocks.1.e5m2'"):
        read_safetensors(path)


def test_no_memory_map_and_no_safetensors_reader_is_used(tmp_path, monkeypatch):
    from diffgraph.lora.files import read_adapter

    def refuse(*args, **kwargs):
        raise AssertionError("a user's file was mapped or read by safetensors")

    path = str(tmp_path / "w.safetensors")
    save_file(_state(), path)
    expected = {k: _bits(t).clone() for k, t in load_file(path).items()}
    adapter = str(tmp_path / "lora.safetensors")
    save_file({"unet.down_blocks.0.attentions.0.proj_in.lora_A.weight": torch.randn(4, 320),
               "unet.down_blocks.0.attentions.0.proj_in.lora_B.weight": torch.randn(320, 4)}, adapter)
    read_adapter(adapter, "StableDiffusionPipeline", "lora")  # (imports diffusers first: no module keeps a patch)
    for module, name in ((mmap, "mmap"), (safetensors, "safe_open"), (safetensors.torch, "safe_open"),
                         (safetensors.torch, "load_file"), (safetensors.torch, "load"), (torch, "from_file"),
                         (torch.UntypedStorage, "from_file"), (np, "memmap")):
        monkeypatch.setattr(module, name, refuse)
    got = read_safetensors(path)
    assert all(torch.equal(_bits(got[k]), bits) for k, bits in expected.items())
    assert read_adapter(adapter, "StableDiffusionPipeline", "lora").layers


def test_the_bytes_land_in_the_tensors_returned(tmp_path, monkeypatch):
    """No copy of the file: every read of the body writes into the memory of a tensor that is returned, and the
    body is read once."""
    path = str(tmp_path / "w.safetensors")
    save_file(_state(), path)
    real, reads = OpenFile.readinto, []

    def recording(self, view, offset):
        reads.append((np.frombuffer(view, dtype=np.uint8).ctypes.data, len(view)))
        real(self, view, offset)

    monkeypatch.setattr(OpenFile, "readinto", recording)
    got = TensorFile(path, chunk=16).read()
    spans = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in got.values()]
    assert all(any(lo <= at and at + n <= hi for lo, hi in spans) for at, n in reads)
    assert sum(n for _, n in reads) == sum(t.nbytes for t in got.values())


def test_with_a_device_the_host_holds_one_chunk_buffer(tmp_path, monkeypatch):
    """The host peak of a load to a device: every chunk is read into one host buffer of at most a chunk's bytes (one
    per open file), then copied to its tensor's slice on the device, and no tensor is made on the host (the meta device stands in
    for a GPU here)."""
    path = str(tmp_path / "w.safetensors")
    save_file({f"t{i}": torch.randn(32, 32) for i in range(6)}, path)
    real, into = OpenFile.readinto, []

    def spy(self, view, offset):
        into.append((np.frombuffer(view, dtype=np.uint8).ctypes.data, len(view)))
        return real(self, view, offset)

    made = []
    empty = torch.empty

    def tracked(*args, **kwargs):
        t = empty(*args, **kwargs)
        made.append((t.device.type, t.nbytes))
        return t

    monkeypatch.setattr(OpenFile, "readinto", spy)
    monkeypatch.setattr(torch, "empty", tracked)
    with TensorFile(path, chunk=1000) as f:  # (a caller reading one tensor at a time reuses the buffer too)
        got = f.read(["t0", "t1", "t2"], device="meta", dtype=torch.float16)
        for key in ("t3", "t4", "t5"):
            got.update(f.read([key], device="meta", dtype=torch.float16))
    monkeypatch.undo()
    assert all(t.device.type == "meta" and t.dtype == torch.float16 and t.shape == (32, 32) for t in got.values())
    assert len({address for address, _ in into}) == 1 and max(n for _, n in into) == 1000
    assert sum(n for _, n in into) == 6 * 32 * 32 * 4
    assert [m for m in made if m[0] == "cpu"] == [("cpu", 1000)]  # the one buffer


def test_a_read_through_the_host_buffer_gives_the_files_values(tmp_path):
    """The chunk-by-chunk copy off the host buffer (as to a GPU; here from the host to the host) lands every byte:
    tensors over several chunks, one shorter than a chunk, an fp8 tensor checked as it passes, and int64."""
    path = str(tmp_path / "w.safetensors")
    tensors = {"a": torch.randn(37, 11), "b": torch.arange(5, dtype=torch.int64), "c": torch.randn(3).half(),
               "d": torch.randn(40).to(torch.float8_e4m3fn)}
    save_file(tensors, path)
    with TensorFile(path, chunk=64) as f:
        staging = torch.empty(64, dtype=torch.uint8)
        got = {k: f._tensor(k, f.header.tensors[k], "cpu", staging) for k in tensors}
    assert all(got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))
               for k, v in tensors.items())


def test_the_chunk_bounds_each_read(tmp_path, monkeypatch):
    path = str(tmp_path / "w.safetensors")
    save_file({"a": torch.randn(1000)}, path)
    real, sizes = OpenFile.readinto, []
    monkeypatch.setattr(OpenFile, "readinto", lambda self, v, o: (sizes.append(len(v)), real(self, v, o)))
    TensorFile(path, chunk=1000).read()
    assert sizes == [1000] * 4


# -- files that grow while read, headers and JSON bounded before use, the file pool bounded in time --------------
BOUND_S = 300  # on a hang, never a timing assumption


def test_a_file_that_grows_while_read_is_refused():
    """safe_tensors: a file appended to while it is read raises FileChanged (or reads as not safetensors)."""
    import tempfile

    from diffgraph.safe_files import FileChanged, NotSafetensors
    from diffgraph.safe_tensors import read_safetensors

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "grow.safetensors")
        save_file({"x": torch.zeros(1 << 18)}, path)
        stop = threading.Event()

        def grow():
            with open(path, "ab") as f:
                while not stop.is_set():
                    f.write(b"\0" * 4096)
                    f.flush()

        size = os.path.getsize(path)
        t = threading.Thread(target=grow, daemon=True)
        t.start()
        try:
            for _ in range(BOUND_S * 100):  # until it has begun to grow
                if os.path.getsize(path) > size:
                    break
                threading.Event().wait(0.01)
            for _ in range(5):
                with pytest.raises((FileChanged, NotSafetensors)):
                    read_safetensors(path, 1 << 30)
        finally:
            stop.set()
            t.join(BOUND_S)


@pytest.mark.parametrize("header, words", [
    (b'{"x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "its header nests JSON deeper than 3 levels"),
    (b'{"x": {"dtype": "F32", "shape": [[[1]]], "data_offsets": [0, 4]}}', "its header nests JSON deeper than 3"),
    (b'{"x": {"dtype": "F32", "shape": [' + b"1, " * 16 + b'1], "data_offsets": [0, 4]}}', "at most 16 dimensions"),
    (b'{"' + b"x" * 5000 + b'": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "at most 4096 characters"),
    (b'{"x": {"dtype": "' + b"F" * 5000 + b'", "shape": [1], "data_offsets": [0, 4]}}', "at most 4096 characters"),
    (b"{" + b", ".join(b'"t%d": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}' % i for i in range(9)) + b"}",
     "lists 9 tensors, above the limit of 8"),
], ids=["200000-brackets", "nested-shape", "17-dims", "long-name", "long-dtype", "9-tensors"])
def test_safetensors_headers_are_bounded_before_they_are_used(tmp_path, monkeypatch, header, words):
    """safe_files: a header's nesting, tensor count, dimensions and names are bounded; each is a NotSafetensors
    naming the bound (a header of 200,000 brackets was a RecursionError out of every listing that read it)."""
    from diffgraph import safe_files

    monkeypatch.setattr(safe_files, "MAX_TENSORS", 8)
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(safe_files.NotSafetensors, match=words):
        safe_files.read_header(str(path), 1 << 30)


def test_json_from_a_folder_is_parsed_with_a_depth_limit(tmp_path):
    from diffgraph.safe_files import NotJson, parse_json, read_json

    assert parse_json(b'{"a": [1, {"b": 2}]}', max_depth=3) == {"a": [1, {"b": 2}]}
    for text, words in (("[" * 200_000 + "]" * 200_000, "deeper than 64 levels"),
                        ("[" * 65 + "]" * 65, "deeper than 64"), ("{not json", "is not valid JSON")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(NotJson, match=words):
            read_json(str(tmp_path / "config.json"), 1 << 30)
    assert parse_json("[" * 64 + "]" * 64)  # the limit itself is allowed


def test_the_file_pool_bounds_each_read_in_time():
    from diffgraph.safe_files import FileReader, ReadTimeout

    release = threading.Event()
    reader = FileReader(workers=1, timeout=0.05)
    try:
        with pytest.raises(ReadTimeout, match="stalled"):  # a read stuck on a dead disk
            reader.call(release.wait, BOUND_S, what="reading x")
        with pytest.raises(ReadTimeout):  # queued behind it on the bounded pool: also bounded
            reader.call(lambda: 1)
    finally:
        release.set()
    assert FileReader(workers=1, timeout=BOUND_S).call(lambda: 7) == 7
