"""A prompt's encoded windows made into the conditioning rows a request writes (the model runner calls these).

`PromptEncoder` (the model runner's text side): prompts -> rows, through the text graphs or eagerly, with the
request's text adapters. `encode_prompts`: prompts -> rows, their windows batched by clip skip. `encode_eager`: the text encoders on token windows outside the graphs, with textual-inversion vectors spliced
into their input embeddings (the tokenizer and the embedding matrix stay as they are) and the request's clip skip.
`prompt_row`: one prompt's windows -> its row: AUTOMATIC1111's emphasis per window (text/emphasis.py) for
a1111-syntax prompts, the windows concatenated along the sequence fields' token axis, the other fields (SDXL's
pooled output) from the first window, in storage of its own. `pad_pair`: a row's prompt and negative prompt at
equal length (the shorter padded with the empty prompt's windows: AUTOMATIC1111's "pad conds"); the step buffers
write them repeated to their span (graphs/step.py `write_tokens`, features/context.py: no mask is needed).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from ..lora.sidepath import RowLoras
from ..models.families.base import Conditioning, concat, owned, spliced
from ..models.model import DiffusionModel
from ..text.embeddings import Embedding
from ..text.emphasis import emphasize
from ..text.prepared import PromptText, splice_rows
from .graph_setup import GraphSet

Splice = tuple[int, int, Embedding, int]  # (window row, offset, embedding, vectors)


def encode_prompts(model: DiffusionModel, prompts: list[PromptText],
                   encode_windows: Callable[[list[torch.Tensor], int | None, list[Splice]], Conditioning]
                   ) -> list[Conditioning]:
    """One conditioning row per prompt: the windows of prompts of equal clip skip (and with or without embeddings)
    encoded in one batch by `encode_windows(ids per tokenizer, clip_skip, splices)`, then made into rows."""
    out: list[Conditioning | None] = [None] * len(prompts)
    batches: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        batches.setdefault((p.clip_skip, bool(p.splices)), []).append(i)
    for (clip_skip, has_splices), index in batches.items():
        batch = [prompts[i] for i in index]
        ids = [torch.tensor([w for p in batch for w in p.ids[t]]) for t in range(len(model.tokenizers))]
        windows = encode_windows(ids, clip_skip, splice_rows(batch) if has_splices else [])
        first = 0
        for i, p in zip(index, batch):
            out[i] = prompt_row(model, p, {k: v[first:first + p.chunks] for k, v in windows.items()})
            first += p.chunks
    return out


def encode_eager(model: DiffusionModel, ids: list[torch.Tensor], clip_skip: int | None, splices: list[Splice],
                 to_device: Callable[[torch.Tensor], torch.Tensor]) -> Conditioning:
    """Token windows [w, 77] per tokenizer (on the device) -> the family's conditioning per window."""
    adapter = model.adapter
    mask, vectors = None, []
    if splices:
        n, tokens = ids[0].shape
        mask = torch.zeros(n, tokens, dtype=torch.bool)
        for key, encoder in zip(adapter.embedding_keys, model.text_encoders):
            v = torch.zeros(n, tokens, encoder.get_input_embeddings().embedding_dim)
            for row, offset, embedding, count in splices:
                v[row, offset:offset + count] = embedding.vectors[key][:count]
                mask[row, offset:offset + count] = True
            vectors.append(to_device(v))
        mask = to_device(mask)
    extra = () if clip_skip is None else (clip_skip,)
    if mask is None:
        return adapter.encode_ids(model, ids, *extra)
    with spliced(model.text_encoders, vectors, mask):
        return adapter.encode_ids(model, ids, *extra)


def prompt_row(model: DiffusionModel, prompt: PromptText, windows: Conditioning) -> Conditioning:
    adapter = model.adapter
    row = {}
    for k, v in windows.items():
        if k not in adapter.sequence_fields:
            row[k] = v[:1].clone()
            continue
        if prompt.weighted:
            v = emphasize(v, torch.tensor(prompt.weights), adapter.encoder_widths(model), prompt.emphasis)
        row[k] = v.reshape(1, -1, *v.shape[2:]).clone()
    return row


def pad_pair(seq: tuple[str, ...], window: int, cond: Conditioning, uncond: Conditioning,
             empty: Conditioning | None, windows: int = 0) -> tuple[Conditioning, Conditioning, int]:
    """(cond, uncond, windows): both at the longer one's windows, or at `windows` where more (a prompt schedule's
    texts all at its longest's) (`seq`: the sequence fields; `window`: 77)."""
    if not seq:
        return cond, uncond, 1
    lengths = [c[seq[0]].shape[1] for c in (cond, uncond)]
    longest = max(*lengths, windows * window)
    rows = []
    for c, length in zip((cond, uncond), lengths):
        pad = (longest - length) // window
        rows.append({k: torch.cat([v] + [empty[k]] * pad, dim=1) if pad and k in seq else v for k, v in c.items()})
    return rows[0], rows[1], longest // window

class PromptEncoder:
    """The text side of one model runner: prompts -> conditioning rows, through the text-encoder graphs where they
    cover a batch (the family's usual layer, no embeddings, no text adapters), eagerly otherwise. It reads
    the runner's graph set (`graphs`, set once made); `text_rows`: the LoRA manager's text side-path rows (None
    without adapters)."""

    def __init__(self, model: DiffusionModel, device: torch.device, buckets: tuple[int, ...],
                 text_rows: RowLoras | None, tokenizer_lock: Any):
        self.model, self.device, self._chunk, self._text_rows = model, device, max(buckets), text_rows
        self.graphs: GraphSet | None = None  # the runner's, once made
        self._masked = model.adapter.needs_attention_mask(model)
        self._lock = tokenizer_lock  # the submitting threads tokenise with the same tokenizers (text/prepared.py)
        self._loras: tuple = ()      # the text adapters of the prompts being encoded ((key, scale, slot), ...)

    def encode(self, prompts: list[PromptText], graphs: bool = True) -> list[Conditioning]:
        """One conditioning row per prompt (windows of equal clip skip in one batch). Encoders whose config asks for
        the attention mask read plain prompts at the usual layer through the family's own (masked) encode, as
        diffusers' pipelines do; every other prompt goes by its token ids."""
        out: list[Conditioning | None] = [None] * len(prompts)
        masked = [i for i, p in enumerate(prompts) if self._masked and not p.weighted and p.clip_skip is None]
        if masked:
            with self._lock:
                blank = self.model.adapter.empty_negative  # a missing negative prompt's text
                enc = self.model.adapter.encode_with_inputs(
                    self.model, [blank if prompts[i].text is None else prompts[i].text for i in masked],
                    [prompts[i].inputs for i in masked])
            for j, i in enumerate(masked):
                out[i] = owned(enc, j)
        rest = [i for i in range(len(prompts)) if out[i] is None]
        if rest:
            rows = encode_prompts(self.model, [prompts[i] for i in rest], partial(self._windows, graphs=graphs))
            for i, row in zip(rest, rows):
                out[i] = row
        return out

    def encode_with(self, prompts: list[PromptText], loras: tuple) -> list[Conditioning]:
        """`encode`; with text adapters ((key, scale, slot), ...) eagerly, through the text side paths (their rows
        set per encoder batch: `_windows`)."""
        if not loras:
            return self.encode(prompts)
        self._loras = loras
        try:
            return self.encode(prompts, graphs=False)
        finally:
            self._loras = ()
            self._text_rows.set(None, None)

    def _windows(self, ids: list[torch.Tensor], clip_skip: int | None, splices: list[Splice],
                 graphs: bool) -> Conditioning:
        """Token windows [w, 77] per tokenizer -> the family's conditioning per window."""
        graph_set = self.graphs
        if self._loras:  # one side-path row per window of this batch
            n, loras = ids[0].shape[0], self._loras
            self._text_rows.set(self.to_device(torch.tensor([[slot for _, _, slot in loras]] * n)),
                                self.to_device(torch.tensor([[scale for _, scale, _ in loras]] * n)))
        if not graphs or clip_skip is not None or splices or graph_set is None or graph_set.text is None:
            return encode_eager(self.model, [self.to_device(i) for i in ids], clip_skip, splices, self.to_device)
        runner, parts = graph_set.runner, []
        for start in range(0, ids[0].shape[0], self._chunk):
            part = [self.to_device(i[start:start + self._chunk]) for i in ids]
            n = part[0].shape[0]
            bucket = runner.bucket("text", 0, 0, n)
            if bucket is None:
                parts.append(self.model.adapter.encode_ids(self.model, part))
                continue
            graph_set.text.write(part, bucket)
            out = runner.replay("text", 0, 0, bucket)
            parts.append({k: v[:n].clone() for k, v in out.items()})
        return concat(parts)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Token ids and side-path rows to the device, from pinned memory, asynchronously (as the runner's rows)."""
        return t if self.device.type != "cuda" or t.is_cuda else t.pin_memory().to(self.device, non_blocking=True)
