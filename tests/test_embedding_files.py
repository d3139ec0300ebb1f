"""Textual-inversion embedding files (diffgraph.text.embeddings): each layout read to the vectors written (diffusers'
own state-dict reading as the oracle), the model's widths checked (SD1.x vs SD2.x vs SDXL), the LoRA folder's name
safety (.., absolute, links out, a FIFO refused without blocking, pickles ignored), a replaced file read again,
broken files (truncated, empty, NaN, integer, too many vectors, unknown layout) refused in one line."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from safetensors.torch import save, save_file

from diffgraph import safe_tensors
from diffgraph.text import embeddings as emb_mod
from diffgraph.text.embeddings import MAX_EMBEDDING_BYTES, EmbeddingDir, EmbeddingError, UnknownEmbedding

SD1 = {"default": 768}
SD2 = {"default": 1024}
SDXL = {"clip_l": 768, "clip_g": 1280}


def _vectors(count: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed)) * 0.1


def _save(folder, rel: str, tensors: dict[str, torch.Tensor]) -> str:
    path = os.path.join(folder, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, path)
    return path


def _refused(call, *needles: str) -> str:
    with pytest.raises(EmbeddingError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


def test_each_layout_reads_the_vectors_written(tmp_path):
    a1111, sd2, token, flat = _vectors(2, 768, 1), _vectors(4, 1024, 2), _vectors(1, 768, 3)[0], _vectors(3, 768, 4)
    clip_l, clip_g = _vectors(2, 768, 5), _vectors(2, 1280, 6)
    _save(tmp_path, "a1111.safetensors", {"emb_params": a1111})
    _save(tmp_path, "styles/sd2.safetensors", {"<sd2-style>": sd2.half()})
    _save(tmp_path, "token.safetensors", {"<cat-toy>": token})
    _save(tmp_path, "flat.safetensors", {"string_to_param.*": flat, "string_to_token.*": torch.tensor([265])})
    _save(tmp_path, "xl.safetensors", {"clip_l": clip_l, "clip_g": clip_g.to(torch.bfloat16)})
    d = EmbeddingDir(str(tmp_path))
    assert d.names() == ["a1111", "flat", "styles/sd2", "token", "xl"]

    got = d.load("a1111", SD1)
    assert (got.name, got.count, list(got.vectors)) == ("a1111", 2, ["default"])
    assert torch.equal(got.vectors["default"], a1111) and got.vectors["default"].dtype == torch.float32
    assert torch.equal(d.load("styles/sd2", SD2).vectors["default"], sd2.half().float())
    one = d.load("token", SD1)
    assert one.count == 1 and torch.equal(one.vectors["default"], token[None])
    assert torch.equal(d.load("flat", SD1).vectors["default"], flat)
    xl = d.load("xl", SDXL)
    assert xl.count == 2 and torch.equal(xl.vectors["clip_l"], clip_l)
    assert torch.equal(xl.vectors["clip_g"], clip_g.to(torch.bfloat16).float())
    assert xl.version == d.stamp("xl") == (os.stat(tmp_path / "xl.safetensors").st_size,
                                           os.stat(tmp_path / "xl.safetensors").st_mtime_ns,
                                           os.stat(tmp_path / "xl.safetensors").st_ino,
                                           os.stat(tmp_path / "xl.safetensors").st_dev)

    listing = d.listing()
    assert listing["ignored"] == []
    assert [(e["name"], e["vectors"], e["dims"]) for e in listing["embeddings"]] == [
        ("a1111", 2, {"default": 768}), ("flat", 3, {"default": 768}), ("styles/sd2", 4, {"default": 1024}),
        ("token", 1, {"default": 768}), ("xl", 2, {"clip_l": 768, "clip_g": 1280})]
    assert listing["embeddings"][0]["bytes"] == os.path.getsize(tmp_path / "a1111.safetensors")


def test_widths_must_be_the_models(tmp_path):
    _save(tmp_path, "sd1.safetensors", {"emb_params": _vectors(2, 768, 1)})
    _save(tmp_path, "xl.safetensors", {"clip_l": _vectors(1, 768, 2), "clip_g": _vectors(1, 1280, 3)})
    _save(tmp_path, "half_xl.safetensors", {"clip_l": _vectors(1, 768, 2)})
    d = EmbeddingDir(str(tmp_path))
    _refused(lambda: d.load("sd1", SDXL), "'sd1' has 768-wide vectors (one text encoder)",
             "this model takes clip_l 768 + clip_g 1280")
    _refused(lambda: d.load("sd1", SD2), "has 768-wide", "takes 1024-wide vectors (one text encoder)")
    _refused(lambda: d.load("xl", SD1), "has clip_l 768 + clip_g 1280", "takes 768-wide")
    _refused(lambda: d.load("half_xl", SDXL), "has clip_l 768;", "takes clip_l 768 + clip_g 1280")
    assert d.load("sd1", SD1).count == 2  # the refusals cached nothing wrong
    _save(tmp_path, "uneven.safetensors", {"clip_l": _vectors(2, 768, 2), "clip_g": _vectors(3, 1280, 3)})
    _refused(lambda: d.load("uneven", SDXL), "'uneven'", "as many vectors each")


def test_names_links_fifos_pickles_and_sizes_are_refused(tmp_path):
    folder = tmp_path / "emb"
    _save(folder, "easynegative.safetensors", {"emb_params": _vectors(1, 768, 1)})
    _save(folder, "styles/ink.safetensors", {"emb_params": _vectors(1, 768, 2)})
    outside = _save(tmp_path, "outside.safetensors", {"emb_params": _vectors(1, 768, 3)})
    os.symlink(outside, folder / "escape.safetensors")
    os.mkfifo(folder / "pipe.safetensors")
    (folder / "old.pt").write_bytes(b"\x80\x02 a pickle")
    with open(folder / "huge.safetensors", "wb") as f:
        f.truncate(MAX_EMBEDDING_BYTES + 1)  # sparse: refused by its size, never read
    d = EmbeddingDir(str(folder))

    done = []

    def attempts() -> None:  # none of these may open the FIFO (an open for reading blocks)
        _refused(lambda: d.load("pipe", SD1), "'pipe'", "FIFO", "not a regular file")
        _refused(lambda: d.stamp("pipe"), "FIFO")
        done.append(d.listing())

    worker = threading.Thread(target=attempts, daemon=True)
    worker.start()
    worker.join(5)
    assert done, "the FIFO blocked a load or a listing"
    listing = done[0]
    assert [e["name"] for e in listing["embeddings"]] == ["easynegative", "styles/ink"]  # the link out is not one
    reasons = {e["name"]: e["reason"] for e in listing["ignored"]}
    assert set(reasons) == {"huge", "old.pt", "pipe"}
    assert "diffgraph convert" in reasons["old.pt"] and "FIFO" in reasons["pipe"]
    assert "above the limit" in reasons["huge"]

    for bad in ("../outside", "/etc/passwd", str(folder / "easynegative"), "styles\\ink", "ink\x00", "", "escape",
                "styles/../easynegative"):
        _refused(lambda: d.load(bad, SD1), "not allowed")
    _refused(lambda: d.load("old", SD1), "'old'", "old.pt", "never read", "diffgraph convert")
    _refused(lambda: d.load("huge", SD1), "'huge'", "above the limit")
    with pytest.raises(UnknownEmbedding, match=r"unknown embedding 'easynegativ'; did you mean 'easynegative'\?"):
        d.load("easynegativ", SD1)
    assert d.suggest("easynegativ") == ["easynegative"] and d.suggest("ink") == ["styles/ink"]
    assert d.suggest("zzzzzzzz") == []
    assert d.load("styles/ink", SD1).count == 1
    _save(folder, "later.safetensors", {"emb_params": _vectors(1, 768, 4)})  # found without a restart
    assert "later" in d.names() and d.load("later", SD1).count == 1


def test_a_replaced_file_is_read_again_and_the_same_version_is_not(tmp_path, monkeypatch):
    first, second = _vectors(1, 768, 1), _vectors(3, 768, 2)
    path = _save(tmp_path, "style.safetensors", {"emb_params": first})
    d = EmbeddingDir(str(tmp_path))
    reads = []
    real = safe_tensors.TensorFile
    monkeypatch.setattr(safe_tensors, "TensorFile", lambda *a: reads.append(a[0]) or real(*a))
    one = d.load("style", SD1)
    assert d.load("style", SD1) is one and len(reads) == 1
    _save(tmp_path, "new.tmp", {"emb_params": second})
    os.replace(tmp_path / "new.tmp", path)  # how a careful writer replaces a file
    two = d.load("style", SD1)
    assert len(reads) == 2 and two.version != one.version and two.version == d.stamp("style")
    assert two.count == 3 and torch.equal(two.vectors["default"], second)
    assert torch.equal(one.vectors["default"], first)  # what rows in flight hold is unchanged
    assert d.listing()["embeddings"][0]["vectors"] == 3


def test_host_copies_are_slot_files_by_version_within_their_bytes(tmp_path, monkeypatch):
    """The vectors read are the folder's SlotFiles host copies, one per file version: a file rewritten in place (same
    inode, new bytes) is read again; past the byte budget the least recently used copy leaves (the newest stays),
    while a prompt that holds an evicted one keeps its vectors."""
    for i, name in enumerate("abc"):
        _save(tmp_path, f"{name}.safetensors", {"emb_params": _vectors(2, 768, i)})  # 6144 bytes of fp32 each
    d = EmbeddingDir(str(tmp_path), max_bytes=2 * 6144)
    reads = []
    real = safe_tensors.TensorFile
    monkeypatch.setattr(safe_tensors, "TensorFile", lambda *a: reads.append(os.path.basename(a[0])) or real(*a))
    a = d.load("a", SD1)
    d.load("b", SD1)
    assert d.load("a", SD1) is a and d.files.host_bytes() == 2 * 6144  # a is now the most recent
    d.load("c", SD1)  # over budget: b, the least recently used, leaves
    assert reads == ["a.safetensors", "b.safetensors", "c.safetensors"] and d.files.host_bytes() == 2 * 6144
    assert d.load("a", SD1) is a and len(reads) == 3
    c = d.load("c", SD1)
    d.load("b", SD1)  # read again, and a leaves
    assert reads[3:] == ["b.safetensors"] and d.files.peek(("c", c.version)) is c

    rewritten = _vectors(3, 768, 7)
    with open(tmp_path / "c.safetensors", "r+b") as f:  # rewritten in place: same inode, new size and mtime
        inode = os.fstat(f.fileno()).st_ino
        f.truncate(0)
        f.write(save({"emb_params": rewritten}))
    assert os.stat(tmp_path / "c.safetensors").st_ino == inode
    again = d.load("c", SD1)
    assert reads[4:] == ["c.safetensors"] and again.version == d.stamp("c") != c.version and again.count == 3
    assert torch.equal(again.vectors["default"], rewritten) and torch.equal(c.vectors["default"], _vectors(2, 768, 2))
    assert d.load("c", SD1) is again and len(reads) == 5
    assert d.files.peek(("a", a.version)) is None and d.load("a", SD1) is a and len(reads) == 5  # held: shared


def test_a_file_rewritten_while_it_is_read_is_read_again(tmp_path, monkeypatch):
    """Streamed (safe_tensors), never mapped: a file whose mtime moves between two reads is read again, and one that
    keeps changing is a one-line error naming it."""
    from diffgraph.safe_files import OpenFile

    path = _save(tmp_path, "style.safetensors", {"emb_params": _vectors(2, 768, 1)})
    real, reads, rewrites = OpenFile.readinto, [], []

    def rewriting(self, view, offset):
        real(self, view, offset)
        reads.append(offset)
        if len(rewrites) < want:
            rewrites.append(offset)
            os.utime(path, ns=(len(rewrites), len(rewrites)))  # a writer's new mtime (the bytes stay)

    monkeypatch.setattr(OpenFile, "readinto", rewriting)
    want = 1
    assert EmbeddingDir(str(tmp_path)).load("style", SD1).count == 2 and len(reads) == 2
    want = 100
    with pytest.raises(EmbeddingError, match=r"^embedding 'style': style.safetensors changed while it was read, "
                                             r"\d times; wait until it is written completely"):
        EmbeddingDir(str(tmp_path)).load("style", SD1)


def test_listings_read_headers_only_and_each_version_once(tmp_path, monkeypatch):
    _save(tmp_path, "a.safetensors", {"emb_params": _vectors(2, 768, 1)})
    _save(tmp_path, "b.safetensors", {"emb_params": torch.full((1, 768), float("nan"))})  # a header is fine
    d = EmbeddingDir(str(tmp_path))
    headers = []
    real = emb_mod.read_header
    monkeypatch.setattr(emb_mod, "read_header", lambda *a: headers.append(a[0]) or real(*a))
    monkeypatch.setattr(safe_tensors, "TensorFile", lambda *a: pytest.fail("a listing read tensors"))
    assert [e["vectors"] for e in d.listing()["embeddings"]] == [2, 1]
    assert [e["vectors"] for e in d.listing()["embeddings"]] == [2, 1] and len(headers) == 2


def test_broken_files_are_refused_in_one_line(tmp_path):
    good = _save(tmp_path, "whole.safetensors", {"emb_params": _vectors(2, 768, 1)})
    data = open(good, "rb").read()
    (tmp_path / "cut.safetensors").write_bytes(data[:-100])
    (tmp_path / "empty.safetensors").write_bytes(b"")
    nan, inf = _vectors(2, 768, 2), _vectors(2, 768, 3)
    nan[1, 5] = float("nan")
    inf[0, 0] = float("inf")
    huge = _vectors(1, 768, 4)
    huge[0, 1] = 1e6
    _save(tmp_path, "nan.safetensors", {"emb_params": nan})
    _save(tmp_path, "inf.safetensors", {"<tok>": inf.half()})
    _save(tmp_path, "huge.safetensors", {"emb_params": huge})
    _save(tmp_path, "ints.safetensors", {"emb_params": torch.ones(2, 768, dtype=torch.int64)})
    _save(tmp_path, "long.safetensors", {"emb_params": _vectors(76, 768, 5)})
    _save(tmp_path, "none.safetensors", {"emb_params": torch.zeros(0, 768)})
    _save(tmp_path, "hollow.safetensors", {"<tok>": torch.zeros(0)})
    _save(tmp_path, "cube.safetensors", {"emb_params": torch.zeros(1, 2, 768)})
    _save(tmp_path, "lora.safetensors", {"unet.down.lora_A.weight": torch.zeros(4, 320),
                                         "unet.down.lora_B.weight": torch.zeros(320, 4)})
    d = EmbeddingDir(str(tmp_path))
    _refused(lambda: d.load("cut", SD1), "'cut'", "truncated", "copy it again")
    _refused(lambda: d.load("empty", SD1), "'empty'", "0 bytes", "truncated")
    _refused(lambda: d.load("nan", SD1), "'nan'", "'emb_params' has 1 NaN or infinite values", "retrain")
    _refused(lambda: d.load("inf", SD1), "'<tok>' has 1 NaN or infinite")
    _refused(lambda: d.load("huge", SD1), "'huge'", "beyond fp16's range")
    _refused(lambda: d.load("ints", SD1), "'ints'", "I64 (integers)", "floating-point")
    _refused(lambda: d.load("long", SD1), "76 vectors, more than the 75")
    _refused(lambda: d.load("none", SD1), "0 vectors")
    _refused(lambda: d.load("hollow", SD1), "empty tensor")
    _refused(lambda: d.load("cube", SD1), "shape [1, 2, 768]")
    _refused(lambda: d.load("lora", SD1), "no known layout", "'unet.down.lora_A.weight' [4, 320]",
             "'unet.down.lora_B.weight' [320, 4]")
    assert d.load("whole", SD1).count == 2
    reasons = {e["name"]: e["reason"] for e in d.listing()["ignored"]}
    # from the header: everything but the values (NaN, inf and too large are load-time checks)
    assert set(reasons) == {"cut", "empty", "ints", "long", "none", "hollow", "cube", "lora"}
    assert all("\n" not in r for r in reasons.values())
    with pytest.raises(EmbeddingError, match="not a folder"):
        EmbeddingDir(str(tmp_path / "whole.safetensors"))


class _Tokenizer:
    """What diffusers' token checks ask of a tokenizer: an empty vocabulary."""

    added_tokens_encoder: dict = {}

    def get_vocab(self) -> dict:
        return {}


def test_vectors_match_diffusers_reading(tmp_path):
    ti = pytest.importorskip("diffusers.loaders.textual_inversion")
    mixin = ti.TextualInversionLoaderMixin
    if not all(hasattr(mixin, f) for f in ("_retrieve_tokens_and_embeddings", "_extend_tokens_and_embeddings")) \
            or not hasattr(ti, "load_textual_inversion_state_dicts"):
        pytest.skip("this diffusers lacks the textual-inversion state-dict readers")
    files = {"learned": {"<cat-toy>": _vectors(1, 768, 1)[0]}, "multi": {"<style>": _vectors(3, 768, 2)},
             "a1111": {"emb_params": _vectors(2, 768, 3)}}
    for name, tensors in files.items():
        _save(tmp_path, f"{name}.safetensors", tensors)
    d = EmbeddingDir(str(tmp_path))
    for name in files:
        states = ti.load_textual_inversion_state_dicts([str(tmp_path / f"{name}.safetensors")], use_safetensors=True)
        tokens, embeddings = mixin._retrieve_tokens_and_embeddings([None], states, _Tokenizer())
        tokens, embeddings = mixin._extend_tokens_and_embeddings(tokens, embeddings, _Tokenizer())
        theirs = torch.stack(embeddings).float()
        ours = d.load(name, SD1)
        assert ours.count == len(tokens) and torch.equal(ours.vectors["default"], theirs), name
