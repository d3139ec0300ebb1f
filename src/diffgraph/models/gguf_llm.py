"""llama.cpp's GGUF language models (the text encoders users download as `.gguf`: unsloth's Qwen3-4B / 8B, Mistral
Small 3.1) in transformers' names, so that the families' text-encoder layouts read them as they read ComfyUI's
safetensors files. Standard library only: the split-folder listing (split_files.py) names a file's tensors with it.

A llama.cpp file (its tensors `token_embd.weight`, `blk.N.*`, `output_norm.weight`) is named as a causal LM's
checkpoint is (`model_names`: the model's name -> the file's): `token_embd` is `model.embed_tokens`, `blk.N.` is
`model.layers.N.` with `attn_norm` / `attn_q` / `attn_k` / `attn_v` / `attn_output` / `attn_q_norm` / `attn_k_norm`
/ `ffn_norm` / `ffn_gate` / `ffn_up` / `ffn_down` as `input_layernorm`, `self_attn.{q,k,v,o}_proj`,
`self_attn.{q,k}_norm`, `post_attention_layernorm` and `mlp.{gate,up,down}_proj` (the `gguf` package's
`TensorNameMap`, which llama.cpp's converter writes with, read backwards); `output_norm` is `model.norm` and
`output` is `lm_head`. A tensor of another name keeps it (the layout then names it as a stray). Any other file (a
DiT's) keeps its own names.

llama.cpp's converter permutes the query and key rows of the architectures it writes from its `LlamaModel` (GGML's
RoPE rotates adjacent pairs; transformers' rotates the two halves of a head): `llama` (Mistral Small 3.1's language
model is written as one) and `mistral3`; its Qwen converters do not (GGML runs Qwen's RoPE in the halves form).
`unpermuted` undoes it on one tensor, from the head counts in the file's metadata (`<arch>.attention.head_count`,
`head_count_kv`): exactly the inverse of the converter's `permute`, rows only, so it applies after dequantisation.
"""

from __future__ import annotations

import re
from typing import Any

from .gguf_format import GgufHeader, NotGguf

PERMUTED = ("llama", "mistral3")  # architectures llama.cpp's converter writes with q / k rows permuted
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
         "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TOP_KEY = re.compile(r"(\w+)\.(weight|bias)")


def is_llama_cpp(header: GgufHeader) -> bool:
    """Whether the file is a llama.cpp language model (its embeddings are `token_embd.weight`)."""
    return "token_embd.weight" in header.tensors


def model_name(key: str) -> str:
    """One llama.cpp tensor name in transformers' (a causal LM's checkpoint's) names; another name as it is."""
    block = _BLOCK_KEY.fullmatch(key)
    if block and block[2] in BLOCK:
        return f"model.layers.{block[1]}.{BLOCK[block[2]]}.{block[3]}"
    top = _TOP_KEY.fullmatch(key)
    return f"{TOP[top[1]]}.{top[2]}" if top and top[1] in TOP else key


def model_names(header: GgufHeader) -> dict[str, str]:
    """The model's name -> the file's, for each tensor (in the header's order): a llama.cpp file's in transformers'
    names, any other file's as they are."""
    if not is_llama_cpp(header):
        return {k: k for k in header.tensors}
    out: dict[str, str] = {}
    for key in header.tensors:
        name = model_name(key)
        if name in out:
            raise NotGguf(f"holds both {out[name]!r} and {key!r}, which are one tensor ({name!r}): it was written "
                          "wrongly; convert or download it again")
        out[name] = key
    return out


def model_shapes(header: GgufHeader) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape as the model holds it (`GgufHeader.shapes`) under the model's name (`model_names`)."""
    shapes = header.shapes()
    return {name: shapes[key] for name, key in model_names(header).items()}


def permuted_heads(header: GgufHeader, key: str) -> int | None:
    """The head count whose rows llama.cpp's converter permuted in the file's tensor `key` (a query or key projection
    of a `PERMUTED` architecture), else None. NotGguf (one line) where the metadata lacks the count or it does not
    divide the rows into pairs."""
    arch = header.architecture
    what = key.rsplit(".", 2)[-2] if key.count(".") >= 2 else ""
    if arch not in PERMUTED or what not in ("attn_q", "attn_k"):
        return None
    heads: Any = header.metadata.get(f"{arch}.attention.head_count")
    if what == "attn_k":
        heads = header.metadata.get(f"{arch}.attention.head_count_kv", heads)
    rows = header.shapes()[key][0]
    if type(heads) is not int or heads <= 0 or rows % (2 * heads):
        raise NotGguf(f"has {key!r} of {rows} rows but its metadata gives {heads!r} heads for it, not a count of "
                      f"whole heads: its {arch} attention cannot be read; convert or download it again")
    return heads


def unpermuted(tensor: Any, heads: int) -> Any:
    """A torch tensor's rows as transformers holds them, from llama.cpp's permuted ones for `heads` heads: the inverse
    of the converter's `permute` (rows split per head in (2, half), swapped to (half, 2))."""
    shape = tensor.shape
    return tensor.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)
