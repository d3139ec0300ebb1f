"""gguf_llm: llama.cpp's GGUF language models read in transformers' names. The oracle for the names is the `gguf`
package's TensorNameMap (what llama.cpp's converter writes with) and for the rows llama.cpp's own `permute`: tiny
Qwen3 and Mistral models written as llama.cpp writes them stream into their modules (split_stream) with every tensor
equal and the same hidden states; left permuted, Mistral's RoPE pairs the wrong dimensions, which shows."""

from __future__ import annotations

import pytest
import torch

from diffgraph.models import gguf_llm, split_files, split_stream
from diffgraph.models.gguf_files import gguf_header
from gguf_util import llama_cpp_permute, write_llama_cpp


def tiny_mistral():
    """31 layers (FLUX.2 dev reads 30), RoPE theta and norm epsilon as the published encoder's (what a file's config
    assumes)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(3)
    return MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=31,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            rope_theta=1000000000.0, rms_norm_eps=1e-5,
                                            sliding_window=None)).eval()


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(4)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        rope_theta=1000000.0, tie_word_embeddings=False)).eval()


def _randomised(model):
    with torch.no_grad():  # the norms start at ones, which would hide a swapped or unpermuted norm
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return model


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_names_are_ggufs_tensor_name_map_backwards(tmp_path, arch):
    model = _randomised(tiny_qwen3() if arch == "qwen3" else tiny_mistral())
    state = model.state_dict()
    written = write_llama_cpp(tmp_path / "m.gguf", state, arch, 4, 2)
    assert written["model.layers.1.self_attn.o_proj.weight"] == "blk.1.attn_output.weight"
    header = gguf_header(str(tmp_path / "m.gguf"))
    assert gguf_llm.model_names(header) == {k: written[k] for k in state}
    assert gguf_llm.model_shapes(header) == {k: tuple(v.shape) for k, v in state.items()}
    assert split_files.header_shapes(str(tmp_path / "m.gguf")) == gguf_llm.model_shapes(header)  # (the listing's)


def test_a_split_folder_lists_gguf_text_encoders(tmp_path, monkeypatch):
    """The companion folders' `.gguf` files are candidates, each kind from its header in transformers' names: a
    llama.cpp Qwen3 matches a Qwen3 text encoder's signature (here a tiny one's: the published sizes' files are
    gigabytes), and a DiT's GGUF is no text encoder."""
    import gguf

    from gguf_util import write_gguf

    tiny = split_files.PartKind("qwen3-tiny", "a tiny Qwen3 text encoder", split_files.Signature(
        ("self_attn.q_norm.",), (("embed_tokens.weight", 0, 64), ("embed_tokens.weight", 1, 32))))
    monkeypatch.setitem(split_files.PARTS, "text_encoder", (tiny,))
    folder = tmp_path / "text_encoders"
    folder.mkdir()
    (tmp_path / "diffusion_models").mkdir()
    write_llama_cpp(folder / "Qwen3-tiny-F32.gguf", tiny_qwen3().state_dict(), "qwen3", 4, 2)
    write_gguf(folder / "flux-2-klein-4b-F16.gguf", {"double_blocks.0.img_attn.norm.query_norm.scale": torch.ones(8)},
               gguf.GGMLQuantizationType.F16, arch="flux")
    parts = split_files.PartFiles(str(tmp_path))
    found = parts.present("text_encoder")
    assert [p.rsplit("/", 1)[1] for p in found] == ["Qwen3-tiny-F32.gguf", "flux-2-klein-4b-F16.gguf"]
    assert [parts.kind_of(p, "text_encoder") for p in found] == [tiny, None]


def test_unpermuted_is_the_inverse_of_llama_cpps_permute():
    rows = torch.arange(8 * 3 * 5, dtype=torch.float32).reshape(24, 5)
    for heads, kv in ((3, 3), (6, 3), (6, 1)):
        used = kv if heads != kv else heads
        permuted = llama_cpp_permute(rows, heads, kv)
        assert not torch.equal(permuted, rows)
        assert torch.equal(gguf_llm.unpermuted(permuted, used), rows)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_llama_cpp_file_streams_into_its_module_with_the_same_hidden_states(tmp_path, arch):
    """Qwen3 (not permuted by the converter) through the Qwen3 layout, Mistral (written as `llama`, permuted) through
    FLUX.2 dev's: every tensor equal to the model's, and the hidden states the same to float32's last bits."""
    from diffgraph.models.flux2_files import MISTRAL_READ

    model = _randomised(tiny_qwen3() if arch == "qwen3" else tiny_mistral())
    path = str(tmp_path / f"{arch}-F32.gguf")
    write_llama_cpp(path, model.state_dict(), arch, 4, 2)
    if arch == "qwen3":
        got = split_stream.load_text_encoder(path, torch.float32, "cpu")[0]
    else:
        got = split_stream.load_mistral_text_encoder(path, torch.float32, "cpu", head=8)
        assert len(got.layers) == MISTRAL_READ and isinstance(got.norm, torch.nn.Identity)
    want = model.model.state_dict()
    for key, value in got.state_dict().items():
        assert torch.equal(value, want[key]), key
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = got(input_ids=ids, output_hidden_states=True).hidden_states
        theirs = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    read = len(got.layers)  # (the states before the last: both models' last go through their own final norm)
    assert max((a - b).abs().max().item() for a, b in zip(mine[:read], theirs[:read])) <= 1e-6
    if arch == "llama":  # the rows left as the file holds them: RoPE rotates other pairs, and the states move
        header = gguf_header(path)
        assert [gguf_llm.permuted_heads(header, f"blk.0.attn_{x}.weight") for x in "qkv"] == [4, 2, None]
        with torch.no_grad():
            for layer in got.layers:
                for proj, heads in ((layer.self_attn.q_proj, 4), (layer.self_attn.k_proj, 2)):
                    proj.weight.copy_(llama_cpp_permute(proj.weight, 4, heads))
            left = got(input_ids=ids, output_hidden_states=True).hidden_states
        assert (left[2] - theirs[2]).abs().max().item() > 1e-2


def test_a_file_whose_head_count_does_not_fit_its_rows_is_refused_in_one_line(tmp_path):
    model = _randomised(tiny_mistral())
    path = str(tmp_path / "mistral.gguf")
    write_llama_cpp(path, model.state_dict(), "llama", 3, 2, permute=False)  # 32 query rows: not pairs of 3 heads
    with pytest.raises(ValueError) as e:
        split_stream.load_mistral_text_encoder(path, torch.float32, "cpu", head=8)
    assert str(e.value).startswith(path) and "'blk.0.attn_q.weight' of 32 rows" in str(e.value)
    assert "3 heads" in str(e.value) and "\n" not in str(e.value)
