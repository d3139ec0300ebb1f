"""CLIP's real vocabulary (issue 29): the folders `diffgraph.models.clip_vocab` writes, read by transformers'
CLIPTokenizer, give the ids of an independent byte-pair encoder written here from OpenAI CLIP's simple_tokenizer
rules (ftfy and HTML clean-up, CLIP's regex, byte alphabet, lowest-rank merge first); the vendored file is the one
open_clip ships; folders are cached, built atomically, and refuse a damaged install."""

from __future__ import annotations

import gzip
import hashlib
import html
import importlib.util
import json
import os
import subprocess
import sys

import ftfy
import pytest
import regex
from transformers import CLIPTokenizer

from diffgraph.models import clip_vocab

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
PATTERN = regex.compile(
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""", regex.IGNORECASE)

# prompts ftfy leaves alone (beyond NFC), so transformers' tokenizer must match the reference on them as written
PROMPTS = [
    "a photo of a cat",
    "A Photo Of A CAT",
    "an astronaut riding a horse on the moon, highly detailed, 8k, trending on artstation",
    "masterpiece, best quality, (extremely detailed:1.2), [blurry], {sharp}",
    "   leading and trailing spaces   ",
    "repeated    spaces\tand\ttabs\nand\n\nnewlines",
    "it's a dog's life, they're here, we've won, I'm ok, you'll see, he'd go, don't",
    "IT'S LOUD, THEY'RE LOUD",
    "rock 'n' roll",
    "1234567890 and 3.14159 and 1,000,000 and 2024-01-31",
    "portrait at f/1.8, 85mm, iso 100, 1/250s",
    "café crème brûlée, naïve façade, Ångström, über",
    "cafe\u0301 with a combining accent",
    "Straße in München, ÆØÅ æøå",
    "Москва зимой, красная площадь",
    "Ελληνικά γράμματα αβγ",
    "東京の夜景、ネオンサイン",
    "一只可爱的猫",
    "한국어 문장입니다",
    "مرحبا بالعالم",
    "a cat 🐱 and a dog 🐶 with 🎉🎉🎉 and a flag 🇯🇵",
    "family 👨‍👩‍👧 emoji with joiners",
    "supercalifragilisticexpialidocious pneumonoultramicroscopicsilicovolcanoconiosis",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "hyper-realistic_render #trending @artist ~~~ !!! ??? ... --- ***",
    "email me at someone@example.com or visit https://example.com/path?q=1&r=2",
    "a cat <|endoftext|> a dog",
    "C++ and C# and node.js and $100 and 50% off",
    "",
    "x",
]

# prompts ftfy changes (curly quotes, HTML entities, mojibake, full-width letters, ligatures): transformers 5's
# CLIPTokenizer does not run ftfy, so these match CLIP only once cleaned as CLIP cleans them
FTFY_PROMPTS = [
    "it’s a “quoted” word",
    "salt &amp; pepper &lt;3",
    "cafÃ© au lait",
    "ＦＵＬＬ ｗｉｄｔｈ １２３",
    "ﬁne ﬂowers",
]


def _bytes_to_unicode() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


class ReferenceCLIP:
    """OpenAI CLIP's simple_tokenizer, rewritten from its rules and reading the gz file directly."""

    def __init__(self, path: str):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().split("\n")[1:49152 - 256 - 2 + 1]
        merges = [tuple(line.split()) for line in lines]
        self.byte_encoder = _bytes_to_unicode()
        alphabet = list(self.byte_encoder.values())  # printable bytes first, then the others, as CLIP orders them
        tokens = alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges] + [BOS, EOS]
        self.encoder = {t: i for i, t in enumerate(tokens)}
        self.ranks = {m: i for i, m in enumerate(merges)}

    @staticmethod
    def clean(text: str) -> str:
        text = html.unescape(html.unescape(ftfy.fix_text(text)))
        return regex.sub(r"\s+", " ", text).strip().lower()

    def bpe(self, token: str) -> list[str]:
        if token in (BOS, EOS):
            return [token]
        word = list(token[:-1]) + [token[-1] + "</w>"]
        while len(word) > 1:
            best = min(zip(word, word[1:]), key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def encode(self, text: str) -> list[int]:
        ids = [self.encoder[BOS]]
        for piece in PATTERN.findall(self.clean(text)):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids += [self.encoder[t] for t in self.bpe(mapped)]
        return ids + [self.encoder[EOS]]


@pytest.fixture(scope="module")
def reference() -> ReferenceCLIP:
    return ReferenceCLIP(clip_vocab.VOCAB_FILE)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("clip-cache"))


@pytest.fixture(scope="module")
def tokenizer(cache_root) -> CLIPTokenizer:
    return CLIPTokenizer.from_pretrained(clip_vocab.clip_tokenizer_folder(cache_root), local_files_only=True)


@pytest.fixture(scope="module")
def tokenizer_bang(cache_root) -> CLIPTokenizer:
    return CLIPTokenizer.from_pretrained(clip_vocab.clip_tokenizer_folder(cache_root, "!"), local_files_only=True)


def test_reference_ids_for_a_photo_of_a_cat(tokenizer, reference):
    assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert reference.encode("a photo of a cat") == [49406, 320, 1125, 539, 320, 2368, 49407]


def test_vocab_and_specials(tokenizer, reference, cache_root):
    assert len(tokenizer) == 49408
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == (BOS, 49406)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == (EOS, 49407)
    assert tokenizer.model_max_length == 77
    vocab, merges = clip_vocab.build_vocab_and_merges()
    assert vocab == reference.encoder
    assert len(merges) == 48894 and merges[0] == "i n" and vocab["in"] == 512
    folder = clip_vocab.clip_tokenizer_folder(cache_root)
    with open(os.path.join(folder, "vocab.json"), encoding="utf-8") as f:
        assert json.load(f) == reference.encoder
    with open(os.path.join(folder, "merges.txt"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert lines[0] == "#version: 0.2" and [tuple(m.split()) for m in lines[1:]] == list(reference.ranks)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_transformers_matches_the_reference(tokenizer, reference, prompt):
    assert tokenizer(prompt).input_ids == reference.encode(prompt)


@pytest.mark.parametrize("prompt", FTFY_PROMPTS)
def test_prompts_ftfy_changes_match_once_cleaned(tokenizer, reference, prompt):
    assert ReferenceCLIP.clean(prompt) != prompt.lower()  # the case this covers: ftfy (or HTML) changes the text
    assert tokenizer(ReferenceCLIP.clean(prompt)).input_ids == reference.encode(prompt)


def test_pad_tokens(tokenizer, tokenizer_bang):
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == (EOS, 49407)
    assert (tokenizer_bang.pad_token, tokenizer_bang.pad_token_id) == ("!", 0)
    body = [49406, 320, 1125, 539, 320, 2368, 49407]
    for tok, pad in ((tokenizer, 49407), (tokenizer_bang, 0)):
        out = tok("a photo of a cat", padding="max_length", max_length=77, truncation=True)
        assert out.input_ids == body + [pad] * 70
        assert out.attention_mask == [1] * 7 + [0] * 70
        long = tok(" ".join(["cat"] * 100), padding="max_length", max_length=77, truncation=True).input_ids
        assert long == [49406] + [2368] * 75 + [49407]
    with pytest.raises(ValueError, match="not in CLIP's vocabulary"):
        clip_vocab.write_clip_tokenizer("unused", pad_token="<pad>")


def test_special_tokens_files_as_the_hub_ships_them(cache_root):
    folder = clip_vocab.clip_tokenizer_folder(cache_root, "!")
    with open(os.path.join(folder, "special_tokens_map.json"), encoding="utf-8") as f:
        assert json.load(f) == {"bos_token": BOS, "eos_token": EOS, "unk_token": EOS, "pad_token": "!"}
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert {k: config[k] for k in ("model_max_length", "do_lower_case", "errors", "tokenizer_class", "pad_token")} \
        == {"model_max_length": 77, "do_lower_case": True, "errors": "replace", "tokenizer_class": "CLIPTokenizer",
            "pad_token": "!"}


def test_vendored_file_is_open_clips():
    with open(clip_vocab.VOCAB_FILE, "rb") as f:
        ours = f.read()
    assert hashlib.sha256(ours).hexdigest() == clip_vocab.VOCAB_SHA256
    assert clip_vocab.VOCAB_SHA256 == "924691ac288e54409236115652ad4aa250f48203de50a9e4722a6ecd48d6804a"
    spec = importlib.util.find_spec("open_clip")  # located, not imported: open_clip imports torchvision
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("open_clip is not installed: the byte comparison with its copy is skipped (the hash is checked)")
    with open(os.path.join(spec.submodule_search_locations[0], "bpe_simple_vocab_16e6.txt.gz"), "rb") as f:
        assert f.read() == ours


def test_damaged_install_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "bpe_simple_vocab_16e6.txt.gz"
    data = bytearray(open(clip_vocab.VOCAB_FILE, "rb").read())
    data[-1] ^= 1
    bad.write_bytes(bytes(data))
    monkeypatch.setattr(clip_vocab, "VOCAB_FILE", str(bad))
    with pytest.raises(ValueError, match="damaged: reinstall"):
        clip_vocab.build_vocab_and_merges()
    monkeypatch.setattr(clip_vocab, "VOCAB_FILE", str(tmp_path / "missing.gz"))
    with pytest.raises(ValueError, match="damaged: reinstall"):
        clip_vocab.build_vocab_and_merges()


def test_folder_is_cached(tmp_path):
    root = str(tmp_path)
    first = clip_vocab.clip_tokenizer_folder(root)
    stamps = {n: os.stat(os.path.join(first, n)).st_mtime_ns for n in os.listdir(first)}
    assert sorted(stamps) == ["merges.txt", "special_tokens_map.json", "tokenizer_config.json", "vocab.json"]
    os.utime(os.path.join(first, "vocab.json"), ns=(1, 1))  # a rewrite would change this back to now
    stamps["vocab.json"] = 1
    assert clip_vocab.clip_tokenizer_folder(root) == first
    assert {n: os.stat(os.path.join(first, n)).st_mtime_ns for n in os.listdir(first)} == stamps
    bang = clip_vocab.clip_tokenizer_folder(root, "!")
    assert bang != first
    name = os.path.basename(first)
    assert "pad-eos" in name and clip_vocab.VOCAB_SHA256[:12] in name and "pad-bang" in os.path.basename(bang)
    assert sorted(os.listdir(root)) == sorted([name, os.path.basename(bang)])  # no temporary folders left


def test_losing_a_race_uses_the_winners_folder(tmp_path, monkeypatch):
    name = os.path.basename(clip_vocab.clip_tokenizer_folder(str(tmp_path / "elsewhere")))
    root = tmp_path / "root"
    real = clip_vocab.write_clip_tokenizer

    def another_process_finishes_first(folder: str, pad_token: str) -> None:
        real(folder, pad_token)
        real(str(root / name), pad_token)
        (root / name / "winner").write_text("")

    monkeypatch.setattr(clip_vocab, "write_clip_tokenizer", another_process_finishes_first)
    assert clip_vocab.clip_tokenizer_folder(str(root)) == str(root / name)
    assert os.listdir(root) == [name] and (root / name / "winner").exists()


def test_default_cache_root(monkeypatch):
    monkeypatch.setenv("DIFFGRAPH_CACHE", "/somewhere/dg")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert clip_vocab.default_cache_root() == "/somewhere/dg"
    monkeypatch.delenv("DIFFGRAPH_CACHE")
    assert clip_vocab.default_cache_root() == os.path.join("/xdg", "diffgraph")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/someone")
    assert clip_vocab.default_cache_root() == os.path.join("/home/someone", ".cache", "diffgraph")


def test_module_imports_without_torch_or_transformers():
    code = ("import sys, diffgraph.models.clip_vocab; "
            "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def fails(folder: str, pad_token: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(clip_vocab, "write_clip_tokenizer", fails)
    with pytest.raises(OSError, match="disk full"):
        clip_vocab.clip_tokenizer_folder(str(tmp_path))
    assert os.listdir(tmp_path) == []
