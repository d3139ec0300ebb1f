"""GGUF files written in tests as users' files are made, with the `gguf` package's own writer and quantisers:
`write_gguf` as city96 / ComfyUI-GGUF's converter writes a DiT (names as they are), `write_llama_cpp` as llama.cpp's
converter writes a language model (the `gguf` package's TensorNameMap for the names, llama.cpp's `permute` of the
query and key rows for the architectures its LlamaModel writes)."""

from __future__ import annotations

import numpy as np
import torch


def write_gguf(path, original: dict[str, torch.Tensor], qtype, shape_fix: bool = False,
               arch: str = "lumina2") -> dict[str, torch.Tensor]:
    """`original` (ComfyUI's layout) written as city96's convert.py and llama.cpp's quantiser write it (architecture
    `arch`, names as they are): 1-D and small tensors F32, a bf16 model's others BF16, rows that are not whole
    blocks of `qtype` F16, the rest `qtype`; with `shape_fix` (convert.py's rule for UNets) a 2-D tensor whose rows
    are not multiples of 256 is stored as rows of 256 with `comfy.gguf.orig_shape`. Returns what each tensor holds
    once read: gguf's own dequantisation of the data written, float32."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    w = gguf.GGUFWriter(str(path), arch)
    held = {}
    for key, value in original.items():
        data = value.float().numpy()
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        kind = Q.F32 if data.ndim == 1 or data.size <= 1024 else qtype if data.shape[-1] % block == 0 else Q.F16
        if shape_fix and data.ndim > 1 and data.size % 256 == 0 and data.shape[-1] % 256:
            w.add_array(f"comfy.gguf.orig_shape.{key}", [int(d) for d in data.shape])
            data = data.reshape(-1, 256)
        stored = gguf.quants.quantize(data, kind)
        w.add_tensor(key, stored, raw_dtype=kind)
        held[key] = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(stored, kind))).reshape(value.shape)
    _finish(w)
    return held


def llama_cpp_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` (MIT), as it writes q (n_head, n_head) and k
    (n_head, n_kv_head) rows."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_llama_cpp(path, state: dict[str, torch.Tensor], arch: str, heads: int, kv_heads: int, qtype=None,
                    permute: bool | None = None) -> dict[str, str]:
    """A causal LM's `state` (transformers' names: `model.embed_tokens.weight`, `model.layers.N....`, `lm_head`)
    written as llama.cpp's converter writes it for `arch` ("qwen3", "llama"): names by the gguf package's
    TensorNameMap, q / k rows permuted as its LlamaModel does (`permute`: by default for "llama"), the head counts in
    the metadata, 1-D tensors F32 and the rest `qtype` (default F32). Returns the file's name of each tensor."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    qtype = qtype or Q.F32
    permute = arch == "llama" if permute is None else permute
    blocks = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], blocks)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(blocks)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    written = {}
    for key, value in state.items():
        if permute and key.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, heads, heads)
        elif permute and key.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, heads, kv_heads)
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        data = value.detach().float().numpy()
        kind = Q.F32 if data.ndim == 1 else qtype
        w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        written[key] = name
    _finish(w)
    return written


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
