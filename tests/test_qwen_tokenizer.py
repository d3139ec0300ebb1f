"""Qwen's shipped tokenizer (`diffgraph.models.qwen_tokenizer`): llama.cpp's Qwen2 tokenizer test strings give their
published ids (tests/fixtures/ggml-vocab-qwen2.gguf.inp and .out, from ggml-org/llama.cpp's models/, MIT); an
independent rank-order byte-pair encoder written here (tiktoken's rule: merge the adjacent pair whose join has the
lowest rank) agrees with the recovered merges; transformers' own Qwen2Tokenizer over the same vocabulary pads,
truncates and masks alike; the control tokens have their ids; `chat_prompt` is what transformers'
apply_chat_template renders with the published templates (tests/fixtures/qwen_chat_templates.json, sources named
there); `check_chat_template` refuses any other template."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import unicodedata

import pytest
import regex
from transformers import Qwen2Tokenizer

from diffgraph.models import qwen_tokenizer as qt

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
CONTROL_IDS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
    "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658,
    "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663, "<|file_sep|>": 151664,
}
QWEN3_ONLY_IDS = {"<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}
PROMPTS = [
    "a photo of a cat",
    "Young Chinese woman in red Hanfu, intricate embroidery. Neon lightning-bolt lamp (⚡️), bright yellow glow, "
    "above extended left palm. Soft-lit outdoor night background, silhouetted tiered pagoda (西安大雁塔).",
    "Cafe\u0301 au lait, 1,000,000 années-lumière; naïve résumé — “quoted” ‘text’ … 3.14159",
    "code: def f(x):\n\treturn x ** 2  # squared\r\n\r\nend",
    "  leading, trailing and   repeated   spaces  ",
    "日本語のテキストと한국어 텍스트, and Ελληνικά, עברית, العربية",
]


def _llama_cpp_cases() -> list[tuple[str, list[int]]]:
    """llama.cpp's test strings (each followed by its separator line) and the ids its .out file lists for them."""
    with open(os.path.join(FIXTURES, "ggml-vocab-qwen2.gguf.inp"), encoding="utf-8", newline="") as f:
        texts = f.read().split("\n__ggml_vocab_test__\n")[:-1]
    with open(os.path.join(FIXTURES, "ggml-vocab-qwen2.gguf.out"), encoding="utf-8") as f:
        ids = [[int(i) for i in line.split()] for line in f.read().split("\n")[:-1]]
    assert len(texts) == len(ids) == 43
    return list(zip(texts, ids))


CASES = _llama_cpp_cases()


def _templates() -> dict[str, str]:
    with open(os.path.join(FIXTURES, "qwen_chat_templates.json"), encoding="utf-8") as f:
        return {name: entry["chat_template"] for name, entry in json.load(f).items() if name != "about"}


TEMPLATES = _templates()


@pytest.fixture(scope="module")
def tokenizers() -> qt.QwenTokenizers:
    return qt.QwenTokenizers()


@pytest.fixture(scope="module")
def bpe(tokenizers) -> qt.QwenBPE:
    return tokenizers.bpe()


@pytest.fixture(scope="module")
def reference(bpe) -> Qwen2Tokenizer:
    """transformers' Qwen2Tokenizer over the same vocabulary and merges, with Qwen3's added tokens as its
    tokenizer_config.json lists them."""
    from tokenizers import AddedToken
    controls = qt.control_tokens("qwen3")
    vocab = dict(bpe.vocab, **{t.content: t.id for t in controls})  # as tokenizer.json's added tokens hold them
    tok = Qwen2Tokenizer(vocab=vocab, merges=list(bpe.merges), eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", unk_token=None)
    tok.add_tokens([AddedToken(t.content, special=t.special, normalized=False) for t in controls])
    assert [tok.convert_tokens_to_ids(t.content) for t in controls] == [t.id for t in controls]
    return tok


class RankBPE:
    """Byte-pair encoding from ranks alone (tiktoken's rule), with Qwen2's split regex after NFC."""

    def __init__(self, tokens: list[bytes]):
        self.ranks = {token: rank for rank, token in enumerate(tokens)}
        self.pattern = regex.compile(qt.SPLIT_REGEX)

    def piece(self, data: bytes) -> list[int]:
        parts = [data[i:i + 1] for i in range(len(data))]
        while len(parts) > 1:
            joins = [self.ranks.get(parts[i] + parts[i + 1]) for i in range(len(parts) - 1)]
            best = min((r, i) for i, r in enumerate(joins) if r is not None) if any(
                r is not None for r in joins) else None
            if best is None:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return [self.ranks[p] for p in parts]

    def encode(self, text: str) -> list[int]:
        text = unicodedata.normalize("NFC", text)
        return [i for piece in self.pattern.findall(text) for i in self.piece(piece.encode("utf-8"))]


@pytest.mark.parametrize("kind", qt.KINDS)
def test_llama_cpp_strings_give_their_published_ids(tokenizers, kind):
    tok = tokenizers.get(kind)
    got = [tok.encode(text, add_special_tokens=False) for text, _ in CASES]
    assert got == [ids for _, ids in CASES]
    assert tok("Hello world")["input_ids"] == [9707, 1879]  # no BOS or EOS added


def test_recovered_merges_agree_with_rank_order_encoding(tokenizers, bpe):
    ranks = RankBPE(qt.read_ranks())
    tok = tokenizers.get("qwen3")
    texts = [text for text, _ in CASES] + PROMPTS
    assert [tok.encode(t, add_special_tokens=False) for t in texts] == [ranks.encode(t) for t in texts]
    assert [ranks.encode(text) for text, _ in CASES] == [ids for _, ids in CASES]
    # one merge per token past the 256 bytes, in rank order, each joining two tokens of lower rank
    assert len(bpe.merges) == qt.N_RANKS - 256
    assert all(bpe.vocab[a] < bpe.vocab[a + b] and bpe.vocab[b] < bpe.vocab[a + b] for a, b in bpe.merges)
    assert [bpe.vocab[a + b] for a, b in bpe.merges] == list(range(256, qt.N_RANKS))


def test_vocabulary_is_qwens(bpe):
    assert len(bpe.vocab) == qt.N_RANKS
    # ids from llama.cpp's .out file and the first line of qwen.tiktoken ("IQ== 0")
    assert bpe.vocab["Hello"] == 9707 and bpe.vocab["ĠHello"] == 21927 and bpe.vocab["!"] == 0
    assert bpe.vocab["Ġ"] == 220 and bpe.vocab["Ċ"] == 198  # " " and "\n" in the byte-level alphabet
    assert bpe.merges[0] == ("Ġ", "Ġ") and bpe.vocab["ĠĠ"] == 256


@pytest.mark.parametrize("kind", qt.KINDS)
def test_control_tokens_have_their_ids(tokenizers, kind):
    expected = dict(CONTROL_IDS, **(QWEN3_ONLY_IDS if kind == "qwen3" else {}))
    assert {t.content: t.id for t in qt.control_tokens(kind)} == expected
    assert len(qt.control_tokens(kind)) == (26 if kind == "qwen3" else 22)
    tok = tokenizers.get(kind)
    assert {c: tok.convert_tokens_to_ids(c) for c in expected} == expected
    assert len(tok) == 151643 + len(expected)
    assert tok.encode("<|im_start|>user\nHello<|im_end|>") == [151644, 872, 198, 9707, 151645]
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
    assert tok.bos_token is None
    # skip_special_tokens drops the special control tokens only (tool and FIM tags are not special)
    ids = tok.encode("<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|><tool_call>")
    assert tok.decode(ids, skip_special_tokens=True) == "hi<tool_call>"


def test_think_tags_are_tokens_only_for_qwen3(tokenizers):
    assert tokenizers.get("qwen3").encode("<think>\n\n</think>") == [151667, 271, 151668]
    plain = tokenizers.get("qwen2.5").encode("<think>")
    assert len(plain) > 1 and max(plain) < 151643 and plain == RankBPE(qt.read_ranks()).encode("<think>")
    ids = tokenizers.get("qwen3").encode("<|im_start|>assistant\n<think>\nok</think>")
    # <think> is not special in tokenizer_config.json: decoding without specials keeps it
    assert tokenizers.get("qwen3").decode(ids, skip_special_tokens=True) == "assistant\n<think>\nok</think>"


@pytest.mark.parametrize("text", [text for text, _ in CASES] + PROMPTS)
def test_decode_gives_the_nfc_text_back(tokenizers, text):
    tok = tokenizers.get("qwen3")
    assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_same_ids_as_transformers_qwen2_tokenizer(tokenizers, reference):
    tok = tokenizers.get("qwen3")
    texts = [text for text, _ in CASES] + PROMPTS + [qt.chat_prompt(p, "qwen3", True) for p in PROMPTS]
    assert [tok.encode(t) for t in texts] == [reference.encode(t) for t in texts]


def test_padding_truncation_and_masks_as_zimage_uses_them(tokenizers, reference):
    """ZImagePipeline: chat prompts, then `tokenizer(prompts, padding="max_length", max_length=512,
    truncation=True, return_tensors="pt")`; right padding with <|endoftext|>, a mask of ones over the prompt."""
    tok = tokenizers.get("qwen3")
    prompts = [qt.chat_prompt(p, "qwen3", enable_thinking=True) for p in ["a cat", PROMPTS[1], "word " * 700]]
    out = tok(prompts, padding="max_length", max_length=512, truncation=True, return_tensors="pt")
    ref = reference(prompts, padding="max_length", max_length=512, truncation=True, return_tensors="pt")
    assert out["input_ids"].shape == (3, 512) and out["input_ids"].dtype == ref["input_ids"].dtype
    assert out["input_ids"].tolist() == ref["input_ids"].tolist()
    assert out["attention_mask"].tolist() == ref["attention_mask"].tolist()
    short = tok.encode(prompts[0])
    assert short == [151644, 872, 198, 64, 8251, 151645, 198, 151644, 77091, 198]
    assert out["input_ids"][0].tolist() == short + [151643] * (512 - len(short))
    assert out["attention_mask"][0].tolist() == [1] * len(short) + [0] * (512 - len(short))
    assert out["input_ids"][2].tolist() == tok.encode(prompts[2])[:512]  # truncated on the right
    assert out["attention_mask"][2].sum().item() == 512


def test_longest_padding_and_no_tensors(tokenizers):
    tok = tokenizers.get("qwen2.5")
    out = tok(["Hello world", "Hello"], padding=True)
    assert out["input_ids"] == [[9707, 1879], [9707, 151643]]
    assert out["attention_mask"] == [[1, 1], [1, 0]]


@pytest.mark.parametrize("name", ["qwen3", "qwen3_first"])
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_qwen3_chat_prompt_is_what_the_template_renders(tokenizers, name, enable_thinking):
    tok = tokenizers.get("qwen3")
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=enable_thinking, chat_template=TEMPLATES[name])
        assert qt.chat_prompt(prompt, "qwen3", enable_thinking=enable_thinking) == rendered
    assert qt.chat_prompt("a cat", "qwen3", enable_thinking=True) == (
        "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n")
    assert qt.chat_prompt("a cat", "qwen3", enable_thinking=False) == (
        "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen25_chat_prompt_is_what_the_template_renders(tokenizers):
    tok = tokenizers.get("qwen2.5")
    for prompt in PROMPTS:
        rendered = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True, chat_template=TEMPLATES["qwen2.5_vl"])
        assert qt.chat_prompt(prompt, "qwen2.5", enable_thinking=False) == rendered
        assert qt.chat_prompt(prompt, "qwen2.5", enable_thinking=True) == rendered  # no thinking switch
    assert qt.chat_prompt("a cat", "qwen2.5", enable_thinking=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\na cat<|im_end|>\n"
        "<|im_start|>assistant\n")


@pytest.mark.parametrize("kind", qt.KINDS)
def test_the_tokenizer_carries_its_shipped_template(tokenizers, kind):
    tok = tokenizers.get(kind)
    assert tok.chat_template == qt.chat_template(kind)
    ids = tok.apply_chat_template([{"role": "user", "content": "a cat"}], tokenize=True, add_generation_prompt=True,
                                  enable_thinking=False, return_dict=False)
    assert ids == tok.encode(qt.chat_prompt("a cat", kind, enable_thinking=False))


def test_shipped_templates_are_the_published_ones():
    assert qt.chat_template("qwen3") == TEMPLATES["qwen3"]
    assert qt.chat_template("qwen2.5") == TEMPLATES["qwen2.5_vl"]
    for name in ("qwen3", "qwen3_first"):
        qt.check_chat_template(TEMPLATES[name], "qwen3")
    qt.check_chat_template(TEMPLATES["qwen2.5_vl"], "qwen2.5")


@pytest.mark.parametrize("folder_template, kind", [
    (TEMPLATES["qwen2.5_vl"], "qwen3"),
    (TEMPLATES["qwen3"], "qwen2.5"),
    (TEMPLATES["qwen3"].replace("'<think>\\n\\n</think>\\n\\n'", "'<think>\\n</think>\\n'"), "qwen3"),
    (TEMPLATES["qwen3"] + "\n", "qwen3"),
])
def test_check_chat_template_refuses_other_templates(folder_template, kind):
    with pytest.raises(ValueError, match=f"not {kind}'s as shipped") as info:
        qt.check_chat_template(folder_template, kind)
    assert "\n" not in str(info.value)


def test_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown Qwen tokenizer kind 'qwen2'; use one of qwen2\.5, qwen3"):
        qt.chat_prompt("a cat", "qwen2", enable_thinking=True)
    with pytest.raises(ValueError, match="unknown Qwen tokenizer kind"):
        qt.QwenTokenizers().get("qwen4")


def test_tokenizers_holder_builds_each_kind_once(tokenizers):
    assert tokenizers.get("qwen3") is tokenizers.get("qwen3")
    assert tokenizers.get("qwen2.5") is not tokenizers.get("qwen3")


def test_a_damaged_install_is_refused(tmp_path, monkeypatch):
    shipped, folder = qt.ASSETS, tmp_path / "qwen"
    shutil.copytree(shipped, folder)
    monkeypatch.setattr(qt, "ASSETS", str(folder))
    data = bytearray(gzip.decompress((folder / qt.RANKS_FILE).read_bytes()))
    data[10] ^= 1
    (folder / qt.RANKS_FILE).write_bytes(gzip.compress(bytes(data)))
    with pytest.raises(ValueError, match="sha256 .* expected b2b1b8df.*reinstall it") as info:
        qt.read_ranks()
    assert "\n" not in str(info.value)
    shutil.copy(os.path.join(shipped, qt.RANKS_FILE), folder / qt.RANKS_FILE)
    (folder / qt.SPLITS_FILE).write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="cannot be read .*reinstall it"):
        qt.QwenBPE.load()
    (folder / "qwen3_chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="chat template .* cannot be read"):
        qt.chat_template("qwen3")
