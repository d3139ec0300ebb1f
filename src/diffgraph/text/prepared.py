"""What the text encoders read for one prompt (`PromptText`), prepared on the submitting thread.

`prepare(setup, request)` turns a request's prompt and negative prompt into token ids, before the engine loop sees
the request (tokenising and parsing cost CPU; the loop only encodes ids, and the prompt cache keys on them):
  * "plain" syntax: diffusers' pipelines' tokenisation (one 77-token window, truncated with a warning); the
    request's `clip_skip` applies to the prompt only, as diffusers' pipelines apply it;
  * "a1111" syntax: AUTOMATIC1111's prompt (prompt_syntax.py), in 75-token chunks (text/chunks.py) with each token's
    emphasis weight, textual-inversion embeddings found by name (text/embeddings.py), and `clip_skip` for both
    prompts, as AUTOMATIC1111 applies its "CLIP skip"; an empty or missing negative prompt is text None (SDXL
    zeroes it, as AUTOMATIC1111's `force_zero_negative_prompt`; SD1.x/SD2.x encode the empty prompt), and the
    shorter of the two is padded with empty-prompt windows at admission ("pad conds": `empty_prompt`); a prompt
    that edits or alternates (`[a:b:when]`, `[a|b]`) is a `PromptText` per text of its schedule over the request's
    denoiser evaluations (`PromptText.schedule`; engine/prompt_schedule.py switches them between steps).
Every tokenizer call holds `TextSetup.lock`: transformers' fast tokenizers keep their padding setting on the shared
object, so two threads tokenising at once could give each other's lengths. Token ids are kept (`TokenCache`, by
text): a prompt sent again with other seeds (a shot's candidates), the same negative prompt under every request and
AUTOMATIC1111's repeated pieces ("masterpiece, best quality") skip the tokenizer.
A prompt of more than `max_chunks` chunks is a ParamError naming it.
A vision-language encoder reads images beside a prompt (Qwen-Image-Edit's input images): the family makes them a
`PromptInputs` at submit (`FamilyAdapter.prompt_inputs`), whose text (the images' placeholders, one token per vision
embedding) goes before the prompt inside the template and counts against the encoder's tokens; they are part of the
prompt (`PromptText.inputs`), so the prompt cache keys on the images' content beside the text.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..request import GenerationRequest, ParamError
from .chunks import EmbeddingMatcher, TokenChunks, chunk_tokens, with_pad
from .embeddings import Embedding, EmbeddingDir, EmbeddingError
from ..prompt_syntax import ParsedPrompt, parse_a1111, schedule_a1111

logger = logging.getLogger(__name__)

CHUNK_TOKENS = 75


@dataclass(frozen=True, eq=False)
class VisionImage:
    """One image as a vision tower reads it: its patches [patches, patch features] (float32) and its patch grid
    (frames, rows, columns)."""

    pixels: np.ndarray
    grid: tuple[int, int, int]


@dataclass(frozen=True)
class PromptInputs:
    """What an encoder reads beside a prompt's text: `text`, placed before the prompt inside the template (the
    images' placeholders), and `images`, compared by `key` (their content hashes): equal inputs encode equally."""

    text: str
    key: str
    images: tuple[VisionImage, ...] = field(compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class PromptText:
    """One prompt as the text encoders read it; equal values encode equally (the prompt cache's key)."""

    text: str | None                                    # as written (None: no negative prompt)
    syntax: str = "plain"
    clip_skip: int | None = None
    emphasis: str = "original"
    ids: tuple[tuple[tuple[int, ...], ...], ...] = ()   # per tokenizer, per 77-token window
    weights: tuple[tuple[float, ...], ...] = ()         # a1111: per window, each token's emphasis
    splices: tuple[tuple[str, Any, int, int, int], ...] = ()  # (embedding, file version, window, offset, vectors)
    vectors: tuple[Embedding, ...] = field(default=(), compare=False, hash=False, repr=False)
    # a1111 prompt editing and alternation: (last evaluation, that text's PromptText) per text, this one first; ()
    # for a prompt read the same at every evaluation (`schedule_a1111`)
    schedule: tuple[tuple[int, "PromptText"], ...] = field(default=(), compare=False, hash=False, repr=False)
    inputs: PromptInputs | None = None                  # what the encoder reads beside the text (images)
    # derived (plain attributes: the loop reads them per request without a call)
    chunks: int = field(init=False, compare=False, repr=False)     # its 77-token windows
    weighted: bool = field(init=False, compare=False, repr=False)  # AUTOMATIC1111's emphasis applies
    texts: tuple["PromptText", ...] = field(init=False, compare=False, repr=False)  # every text read while sampling

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", len(self.ids[0]) if self.ids else 1)
        object.__setattr__(self, "weighted", self.syntax == "a1111")
        object.__setattr__(self, "texts", tuple(p for _, p in self.schedule) if self.schedule else (self,))


@dataclass(frozen=True)
class TextSetup:
    """What preparing a prompt needs from the model and the engine (the model runner builds it once)."""

    tokenizers: tuple[Any, ...]            # the model's tokenizers, in encoder order
    embedding_dims: dict[str, int]         # textual-inversion key -> vector width (FamilyAdapter.embedding_dims)
    max_chunks: int = 3
    max_clip_skip: int = 11
    embeddings: EmbeddingDir | None = None
    matchers: MatcherCache = field(default_factory=lambda: MatcherCache(), compare=False, repr=False)
    tokens: TokenCache = field(default_factory=lambda: TokenCache(), compare=False, repr=False)
    lock: Any = field(default_factory=threading.Lock, compare=False, repr=False)  # around every tokenizer call
    lengths: tuple[int, ...] = ()          # the tokens each encoder reads (the family's); () its model_max_length
    # a family whose encoder reads its prompt in a template (an LLM's chat template) and refuses a longer one rather
    # than truncating it: the text around the prompt (FamilyAdapter.prompt_template); None: CLIP's truncation
    template: tuple[str, str] | None = None
    dropped: int = 0                       # the template's leading tokens the rows do not hold (not counted)


def prepare(setup: TextSetup, request: GenerationRequest, evaluations: int | None = None,
            hires: int | None = None, inputs: PromptInputs | None = None) -> tuple[PromptText, PromptText]:
    """(prompt, negative prompt) of a request, tokenised; ParamError naming the prompt that cannot be read.
    `evaluations`: the length of an a1111 prompt's schedule (AUTOMATIC1111's: its steps times its sampler's denoiser
    evaluations per step); None refuses prompt editing and alternation. `hires`: a hires fix's second pass's first
    pass's evaluations (`evaluations` then the second pass's own). `inputs`: what the encoder reads beside both
    prompts (a family with a template; plain syntax)."""
    if request.clip_skip is not None and request.clip_skip > setup.max_clip_skip:
        raise ParamError("clip_skip", f"clip_skip {request.clip_skip} is beyond this model's text encoder; allowed: "
                                      f"0..{setup.max_clip_skip} (1 = the penultimate layer)")
    if request.prompt_syntax == "plain":
        return (PromptText(request.prompt, clip_skip=request.clip_skip, ids=plain_ids(setup, request.prompt,
                                                                                       inputs=inputs), inputs=inputs),
                PromptText(request.negative_prompt, ids=plain_ids(setup, request.negative_prompt or "",
                                                                  "negative_prompt", inputs), inputs=inputs))
    return (_scheduled(setup, request.prompt, "prompt", request, evaluations, hires),
            _scheduled(setup, request.negative_prompt or "", "negative_prompt", request, evaluations, hires))


def _scheduled(setup: TextSetup, text: str, name: str, request: GenerationRequest, evaluations: int | None,
               hires: int | None) -> PromptText:
    """An a1111 prompt, with its schedule where it edits or alternates (each text prepared as a prompt of its own;
    a negative prompt's blank text is None: no negative prompt)."""
    blank = _blank if name == "negative_prompt" else (lambda prompt: prompt)
    if evaluations is None:
        return blank(_a1111(setup, text, name, request))
    entries = schedule_a1111(text, name, evaluations, hires)
    if len(entries) == 1:
        return blank(_a1111(setup, text, name, request, entries[0][2]))
    prepared: dict[str, PromptText] = {}  # one PromptText a text (an alternation comes back to its texts)
    for _, part, parsed in entries:
        if part not in prepared:
            prepared[part] = blank(_a1111(setup, part, name, request, parsed))
    schedule = tuple((end, prepared[part]) for end, part, _ in entries)
    return dataclasses.replace(schedule[0][1], schedule=schedule)


def _blank(prompt: PromptText) -> PromptText:
    """A negative prompt of blank text as no negative prompt (text None)."""
    if prompt.text is None or prompt.text.strip():
        return prompt
    return dataclasses.replace(prompt, text=None)


def empty_prompt(setup: TextSetup, like: PromptText) -> PromptText:
    """AUTOMATIC1111's empty prompt with `like`'s settings: the chunk that pads the shorter conditioning."""
    ids = tuple(((_bos(t),) + (_eos(t),) + (_pad(t),) * (CHUNK_TOKENS),) for t in setup.tokenizers)
    return PromptText("", "a1111", like.clip_skip, like.emphasis, ids, ((1.0,) * (CHUNK_TOKENS + 2),))


def plain_ids(setup: TextSetup, text: str, field: str = "prompt",
              inputs: PromptInputs | None = None) -> tuple[tuple[tuple[int, ...], ...], ...]:
    if setup.template is not None:
        return _templated_ids(setup, text, field, inputs)
    if inputs is not None:
        raise ValueError("a family without a prompt template reads no inputs beside the prompt")
    out = []
    for i, tokenizer in enumerate(setup.tokenizers):
        length = setup.lengths[i] if setup.lengths else tokenizer.model_max_length
        with setup.lock:
            ids = setup.tokens.get(("plain", i), [text], lambda texts: tokenizer(
                texts, padding="max_length", max_length=length, truncation=False).input_ids)[0]
        if len(ids) > length:
            # counts only: prompt text never goes to a log (the request id is not known here)
            logger.warning("prompt truncated: the text encoder reads %d tokens, the prompt has %d, %d dropped%s",
                           length, len(ids), len(ids) - length,
                           "; prompt_syntax \"a1111\" reads long prompts in chunks" if setup.max_chunks > 1 else "")
            ids = ids[:length - 1] + (tokenizer.eos_token_id,)
        out.append((ids,))
    return tuple(out)


def _templated_ids(setup: TextSetup, text: str, field: str,
                   inputs: PromptInputs | None = None) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The prompt's ids in the family's template (after `inputs`' text), every one (the encoder reads them at their
    own length); ParamError naming `field` when they are more than the encoder reads."""
    before, after = setup.template
    if inputs is not None:
        before += inputs.text
    length = setup.lengths[0] if setup.lengths else setup.tokenizers[0].model_max_length
    tokenizer = setup.tokenizers[0]
    with setup.lock:
        ids = setup.tokens.get(("templated", 0), [before + text + after], lambda texts: tokenizer(
            texts, truncation=False).input_ids)[0]
    if len(ids) - setup.dropped > length:
        images = f" and its {len(inputs.images)} input images" if inputs is not None and inputs.images else ""
        raise ParamError(field, f"{field} is {len(ids) - setup.dropped} tokens with the model's template{images}; "
                                f"this model reads at most {length}: shorten it" +
                                (" or send fewer images" if images else ""))
    return ((tuple(ids),),)


class TokenCache:
    """Token ids by (what the tokenizer was asked, text), the most recent kept: at most `size` texts and `max_ids` ids
    in all (a plain prompt keeps every id, truncated or not: a few long prompts must not hold hundreds of MB). A
    tokenizer call is not free on the submitting thread's CPU (transformers' wrapper more than the Rust tokenizer;
    BENCHMARKS.md: the host's share of a burst); the engine loop waits for it when requests are submitted between
    its steps. The caller holds `TextSetup.lock`."""

    def __init__(self, size: int = 4096, max_ids: int = 500_000):
        self.size, self.max_ids = size, max_ids
        self._ids: OrderedDict[tuple[Any, str], tuple[int, ...]] = OrderedDict()
        self._held = 0  # ids kept

    def get(self, kind: Any, texts: list[str], tokenize: Any) -> list[tuple[int, ...]]:
        """The ids of each text: kept, or from one `tokenize(missing texts)` call (texts -> lists of ids)."""
        out: list[tuple[int, ...] | None] = []
        missing: list[int] = []
        for i, text in enumerate(texts):
            ids = self._ids.get((kind, text))
            if ids is None:
                missing.append(i)
            else:
                self._ids.move_to_end((kind, text))
            out.append(ids)
        if missing:
            for i, ids in zip(missing, tokenize([texts[i] for i in missing])):
                out[i] = tuple(ids)
                if (kind, texts[i]) not in self._ids and len(out[i]) <= self.max_ids:  # (a text twice in one call
                    # is kept once; one longer than the whole bound is not kept)
                    self._ids[(kind, texts[i])] = out[i]
                    self._held += len(out[i])
            while self._ids and (len(self._ids) > self.size or self._held > self.max_ids):
                self._held -= len(self._ids.popitem(last=False)[1])
        return out


class _Stale(Exception):
    """An embedding's file no longer has the vector count the listing said (rewritten in place)."""


def _a1111(setup: TextSetup, text: str, name: str, request: GenerationRequest,
           parsed: ParsedPrompt | None = None) -> PromptText:
    try:
        return _a1111_once(setup, text, name, request, parsed)
    except _Stale:  # list the folder again, once
        setup.matchers.forget()
    try:
        return _a1111_once(setup, text, name, request, parsed)
    except _Stale as e:
        raise ParamError(name, f"embedding {e.args[0]!r} keeps changing while the prompt is read; send it again "
                               "once the file is written") from None


def _a1111_once(setup: TextSetup, text: str, name: str, request: GenerationRequest,
                parsed: ParsedPrompt | None) -> PromptText:
    parsed = parse_a1111(text, name) if parsed is None else parsed
    first = setup.tokenizers[0]

    def tokenize(texts: list[str]) -> list[tuple[int, ...]]:
        with setup.lock:
            return setup.tokens.get("pieces", texts, lambda missing: first(
                missing, add_special_tokens=False, truncation=False, verbose=False).input_ids)

    matcher, found = None, {}
    if setup.embeddings is not None:
        matcher, found = setup.matchers.get(setup.embeddings, setup.embedding_dims, tokenize)
    for wanted in parsed.embeddings:  # written embedding:NAME, so it must be one
        if wanted in found:
            continue
        if setup.embeddings is None:
            raise ParamError(name, f"{name} names embedding {wanted!r}, but no embeddings are served; start the "
                                   "server with --embeddings-dir DIR holding NAME.safetensors")
        try:  # why it is not usable: unknown (with close names), a pickle, a broken file, another model's
            setup.embeddings.load(wanted, setup.embedding_dims)
        except EmbeddingError as e:
            raise ParamError(name, f"{name}: {e}") from None
        raise ParamError(name, f"{name} names embedding {wanted!r}, which changed while the prompt was read; send "
                               "it again")
    with setup.lock:
        comma = first.convert_tokens_to_ids(",</w>")
    chunks = chunk_tokens(parsed.pieces, tokenize, bos=_bos(first), eos=_eos(first),
                          comma=comma if comma != first.unk_token_id else None, matcher=matcher,
                          chunk_length=CHUNK_TOKENS)
    if len(chunks.ids) > setup.max_chunks:
        raise ParamError(name, f"{name} has {chunks.token_count} tokens, {len(chunks.ids)} chunks of "
                               f"{CHUNK_TOKENS}; at most {setup.max_chunks} ({setup.max_chunks * CHUNK_TOKENS} tokens):"
                               " shorten it, or start the server with a larger --max-prompt-chunks")
    ids = tuple(with_pad(chunks, _eos(t), _pad(t)) for t in setup.tokenizers)
    vectors, splices = _splices(setup, chunks, found, name)
    return PromptText(text, "a1111", request.clip_skip, request.emphasis, ids, chunks.weights, splices, vectors)


class MatcherCache:
    """The embeddings folder's names and vector counts and their matcher, rebuilt only when the folder changes: its
    folders' modification times (a file added, removed or renamed into place) are the key, one stat per folder.
    Listing reads every file's header and tokenises every name, a cost per embedding that a full folder would add to
    every prompt (BENCHMARKS.md: prompts as people write them). A file rewritten in place (no folder change) is
    caught when it is read: its vector count differs, and `forget()` makes the next prompt list again."""

    def __init__(self):
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._value: tuple[EmbeddingMatcher | None, dict[str, int]] = (None, {})

    def get(self, folder: EmbeddingDir, dims: dict[str, int],
            tokenize) -> tuple[EmbeddingMatcher | None, dict[str, str]]:
        """(the matcher, the names prompts may write -> the embedding each means). Only embeddings for this model's
        encoders (`dims`) count: another model's keep their name as text, as AUTOMATIC1111 skips them. An embedding
        in a folder is also found by its file name (`neg/easynegative` as `easynegative`) where that is unique, as
        AUTOMATIC1111 names them; a name that tokenises to nothing is left out."""
        key = _folder_times(folder.root)
        with self._lock:
            if key != self._key:
                usable = {e["name"]: int(e["vectors"]) for e in folder.listing()["embeddings"] if e["dims"] == dims}
                names = {n: n for n in usable}
                bases: dict[str, list[str]] = {}
                for n in usable:
                    bases.setdefault(n.rsplit("/", 1)[-1], []).append(n)
                names.update({b: full[0] for b, full in bases.items() if len(full) == 1 and b not in names})
                counts = {n: usable[full] for n, full in names.items() if tokenize([n])[0]}
                names = {n: names[n] for n in counts}
                self._value = (EmbeddingMatcher(counts, tokenize) if counts else None, names)
                self._key = key
            return self._value

    def forget(self) -> None:
        with self._lock:
            self._key = None


def _folder_times(root: str) -> tuple:
    out = []
    for dirpath, _, _ in os.walk(root):
        try:
            out.append((dirpath, os.stat(dirpath).st_mtime_ns))
        except OSError:
            out.append((dirpath, None))
    return tuple(out)


def _splices(setup: TextSetup, chunks: TokenChunks, found: dict[str, str],
             name: str) -> tuple[tuple[Embedding, ...], tuple[tuple[str, Any, int, int, int], ...]]:
    """The embeddings the chunks place (`found`: the name written -> the embedding's own name), read by version."""
    loaded: dict[str, Embedding] = {}
    splices = []
    for ref in chunks.embeddings:
        real = found.get(ref.name, ref.name)
        if real not in loaded:
            try:
                loaded[real] = setup.embeddings.load(real, setup.embedding_dims)
            except EmbeddingError as e:
                raise ParamError(name, str(e)) from None
        emb = loaded[real]
        if emb.count != ref.vectors:  # rewritten in place since it was listed
            raise _Stale(real)
        splices.append((real, emb.version, ref.chunk, ref.offset, ref.vectors))
    return tuple(loaded.values()), tuple(splices)


def _bos(t: Any) -> int:
    return int(t.bos_token_id)


def _eos(t: Any) -> int:
    return int(t.eos_token_id)


def _pad(t: Any) -> int:
    return int(t.pad_token_id if t.pad_token_id is not None else t.eos_token_id)


def splice_rows(prompts: Sequence[PromptText]) -> list[tuple[int, int, Embedding, int]]:
    """(flat window row, offset, embedding, vectors) of every splice, windows numbered across `prompts` in order."""
    out, base = [], 0
    for p in prompts:
        by_name = {e.name: e for e in p.vectors}
        for emb_name, _, chunk, offset, count in p.splices:
            out.append((base + chunk, offset, by_name[emb_name], count))
        base += p.chunks
    return out
