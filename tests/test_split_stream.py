"""Split DiT files streamed into meta-built modules (diffgraph.models.split_stream): each module equals, tensor for
tensor and bit for bit, the module the whole-dict path built (zimage_files' / flux2_files' readers, a module built
with random weights, `load_into`) for every layout and fp8 convention and for GGUF files; no module is ever built with
real parameters; every tensor is read straight to the device asked for, one at a time (an earlier tensor is gone, or
is the module's own, when the next is read); tensors the module has no use for are not read; a file that lacks a
tensor or holds one without a place is refused before any tensor is read, and one rewritten while it is read is
refused in one line."""

from __future__ import annotations

import json
import os
import weakref

import pytest
import torch
from safetensors.torch import save_file

from diffgraph.models import flux2_files, split_stream, zimage_files as zf
from diffgraph.models.families.flux2 import tiny_transformer as flux2_config
from diffgraph.models.gguf_files import GgufFile
from diffgraph.quantize.fp8 import Fp8Linear
from diffgraph.safe_tensors import TensorFile
from gguf_util import write_gguf
from test_zimage_files import (E4M3, PREFIX, _quantised, one_line_error, tiny_qwen3, tiny_transformer, tiny_vae,
                               to_original)


def whole_dict_transformer(path: str, dtype: torch.dtype, keep_fp8: bool = False):
    """What the Z-Image family's load_split built before: the whole file read, a module of random weights, load_into."""
    from diffusers import ZImageTransformer2DModel

    weights = zf.read_transformer(path, dtype, keep_fp8=keep_fp8, device="cpu")
    model = ZImageTransformer2DModel(**zf.transformer_config(weights.state, weights.fp8)).to(dtype)
    return model, zf.load_into(model, weights)


def assert_same_module(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Every parameter and buffer (persistent or not) equal in name, dtype, shape and bits; the same module types."""
    assert [type(m) for m in got.modules()] == [type(m) for m in want.modules()]
    for kind in ("named_parameters", "named_buffers"):
        mine, theirs = dict(getattr(got, kind)()), dict(getattr(want, kind)())
        assert sorted(mine) == sorted(theirs), kind
        for name, value in theirs.items():
            assert not mine[name].is_meta, name
            assert mine[name].dtype == value.dtype and torch.equal(mine[name], value), name


def _fp8_file(tmp_path, convention: str, per_row: bool) -> str:
    """The tiny transformer in ComfyUI's layout with every 2-D weight in e4m3 (`_quantised`), in `convention`."""
    tensors, layers = to_original(tiny_transformer().state_dict()), {}
    for key, (q, scale) in _quantised(dict(tensors), per_row)[0].items():
        layer = key.removesuffix(".weight")
        tensors[key] = q
        if convention == "scaled_fp8":
            tensors[layer + ".scale_weight"], tensors[layer + ".scale_input"] = scale, torch.tensor(1.0)
        else:
            tensors[layer + ".weight_scale"], tensors[layer + ".input_scale"] = scale, torch.tensor(0.5)
            layers[layer] = {"format": "float8_e4m3fn"}
    metadata = None
    if convention == "scaled_fp8":
        tensors[PREFIX + "scaled_fp8"] = torch.empty(0, dtype=E4M3)
    else:
        metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    path = str(tmp_path / f"z_image_{convention}.safetensors")
    save_file(tensors, path, metadata=metadata)
    return path


@pytest.mark.parametrize("layout", ["comfy", "bare", "diffusers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformer_equals_the_whole_dict_path(tmp_path, layout, dtype):
    state = tiny_transformer().state_dict()
    tensors = {PREFIX + k: v.contiguous() for k, v in state.items()} if layout == "diffusers" else \
        to_original(state, PREFIX if layout == "comfy" else "")
    path = str(tmp_path / "z_image_turbo.safetensors")
    save_file(tensors, path)
    got, installed = split_stream.load_transformer(path, dtype, torch.device("cpu"))
    want, _ = whole_dict_transformer(path, dtype)
    assert installed == ()
    assert_same_module(got, want)
    assert got.layers[0].attention.to_q.weight.is_contiguous()
    assert got.layers[0].attention.to_k.weight.untyped_storage().nbytes() == \
        got.layers[0].attention.to_k.weight.nbytes  # its own memory, not a third of the fused tensor's


@pytest.mark.parametrize("convention,per_row,keep", [("scaled_fp8", False, False), ("scaled_fp8", False, True),
                                                     ("quantization_metadata", True, False),
                                                     ("quantization_metadata", True, True)])
def test_fp8_transformer_equals_the_whole_dict_path(tmp_path, convention, per_row, keep):
    path = _fp8_file(tmp_path, convention, per_row)
    got, installed = split_stream.load_transformer(path, torch.float32, "cpu", keep_fp8=keep)
    want, want_installed = whole_dict_transformer(path, torch.float32, keep)
    assert installed == want_installed
    assert bool(installed) == keep and (not keep or "layers.0.attention.to_k" in installed)
    assert_same_module(got, want)
    if keep:
        fp8 = got.get_submodule("layers.0.attention.to_k")
        assert isinstance(fp8, Fp8Linear) and fp8.weight.dtype == E4M3 and fp8.weight.is_contiguous()
        assert fp8.weight_scale.numel() == (fp8.out_features if per_row else 1)


@pytest.mark.parametrize("qtype", ["BF16", "Q8_0"])
def test_gguf_transformer_equals_the_whole_dict_path(tmp_path, qtype):
    import gguf

    path = str(tmp_path / f"z_image_turbo-{qtype}.gguf")
    write_gguf(path, to_original(tiny_transformer().state_dict(), ""), gguf.GGMLQuantizationType[qtype])
    reads = spy_reads(GgufFile)
    try:
        got, _ = split_stream.load_transformer(path, torch.bfloat16, torch.device("cpu"))
    finally:
        reads.undo()
    want, _ = whole_dict_transformer(path, torch.bfloat16)
    assert_same_module(got, want)
    with GgufFile(path) as f:
        file_keys = list(f.header.tensors)
    assert reads.devices == {torch.device("cpu")}
    assert sorted(reads.keys) == sorted(k for k in file_keys if k != "norm_final.weight")  # each once, one by one
    assert reads.count == len(reads.keys)


def test_text_encoder_and_vae_equal_the_whole_dict_path(tmp_path):
    from diffusers import AutoencoderKL
    from transformers import Qwen3Config, Qwen3Model

    from diffgraph.models.original_layout import vae_original

    encoder = tiny_qwen3()
    path = str(tmp_path / "qwen_3.safetensors")
    save_file({**{f"model.{k}": v.contiguous() for k, v in encoder.state_dict().items()},
               "lm_head.weight": encoder.embed_tokens.weight.detach().clone()}, path)
    reads = spy_reads(TensorFile)
    got, _ = split_stream.load_text_encoder(path, torch.bfloat16, "cpu")
    assert "lm_head.weight" not in reads.keys  # a tensor the module has no use for is not read
    reads.undo()
    weights = zf.read_text_encoder(path, torch.bfloat16)
    want = Qwen3Model(Qwen3Config(**zf.qwen3_config(weights.state))).to(torch.bfloat16)
    zf.load_into(want, weights)
    assert_same_module(got, want)

    vae_path = str(tmp_path / "ae.safetensors")
    save_file({k: v.contiguous() for k, v in vae_original(tiny_vae().state_dict(), 2).items()}, vae_path)
    config = zf.vae_config(vae_path, {"latent_channels": 16, "norm_num_groups": 32, "use_quant_conv": False,
                                      "use_post_quant_conv": False})
    got = split_stream.load_vae(AutoencoderKL, config, lambda c: zf.read_vae(vae_path, c, torch.bfloat16),
                                torch.bfloat16, "cpu")
    want = AutoencoderKL(**config).to(torch.bfloat16)
    zf.load_into(want, zf.read_vae(vae_path, want.config, torch.bfloat16))
    assert_same_module(got, want)


@pytest.mark.parametrize("fp8", [False, True])
def test_flux2_transformer_equals_the_whole_dict_path(tmp_path, fp8):
    """BFL's layout (fused qkv chunked, the final modulation's shift and scale swapped: a tensor the conversion
    computes, from that one tensor), plain or with every 2-D weight in ComfyUI's scaled fp8, per row, or as a Q8_0
    GGUF."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(3)
    model = Flux2Transformer2DModel(**flux2_config(text_width=16))
    tensors = {k: v.contiguous() for k, v in flux2_files.transformer_to_original(model.state_dict()).items()}
    if fp8:
        for key, (q, scale) in _quantised(dict(tensors), True)[0].items():
            tensors[key], tensors[key.removesuffix(".weight") + ".weight_scale"] = q, scale
        tensors[PREFIX + "scaled_fp8"] = torch.empty(0, dtype=E4M3)
    path = str(tmp_path / "flux-2-klein-tiny.safetensors")
    save_file(tensors, path)
    got = split_stream.load_flux2_transformer(path, torch.bfloat16, torch.device("cpu"))
    weights = flux2_files.read_transformer(path, torch.bfloat16)
    want = Flux2Transformer2DModel(**flux2_files.transformer_config(weights.state)).to(torch.bfloat16)
    zf.load_into(want, weights)
    assert_same_module(got, want)
    if not fp8:  # its GGUF quantisation (BFL's names without the prefix) streams as the whole dict reads it
        import gguf

        path = str(tmp_path / "flux-2-klein-tiny-Q8_0.gguf")
        write_gguf(path, flux2_files.transformer_to_original(model.state_dict(), ""), gguf.GGMLQuantizationType.Q8_0,
                   arch="flux")
        weights = flux2_files.read_transformer(path, torch.bfloat16)
        assert weights.quantisation == "gguf"
        want = Flux2Transformer2DModel(**flux2_files.transformer_config(weights.state)).to(torch.bfloat16)
        zf.load_into(want, weights)
        assert_same_module(split_stream.load_flux2_transformer(path, torch.bfloat16, torch.device("cpu")), want)


class spy_reads:
    """Wraps `cls.read` (TensorFile or GgufFile): the devices asked for, the keys read, the tensors' data pointers,
    and, at each read, the tensors of the previous read still alive (by weak reference)."""

    def __init__(self, cls: type):
        self.cls, self.original = cls, cls.read
        self.devices, self.keys, self.count, self.alive_at_next, self.pointers = set(), [], 0, [], []
        self.refs: list[weakref.ref] = []
        spy = self

        def read(f, keys=None, device=None, dtype=None):
            spy.alive_at_next.extend(t for t in (r() for r in spy.refs) if t is not None)
            spy.refs = []
            out = spy.original(f, keys, device, dtype) if dtype is not None else spy.original(f, keys, device)
            if out and not all(k.endswith(split_stream.AUX) or k == "scaled_fp8" for k in out):
                spy.count += 1
                spy.devices.add(torch.device(device) if device is not None else None)
                spy.keys.extend(out)
                spy.refs = [weakref.ref(t) for t in out.values()]
                spy.pointers.extend(t.data_ptr() for t in out.values())
            return out
        cls.read = read

    def undo(self) -> None:
        self.cls.read = self.original


@pytest.fixture
def z_files(tmp_path):
    """A Z-Image transformer in ComfyUI's layout (with Lumina 2's unused norm_final), float32."""
    path = str(tmp_path / "z_image_turbo.safetensors")
    save_file(to_original(tiny_transformer().state_dict()), path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_tensor_at_a_time_straight_to_the_device(z_files, dtype):
    reads = spy_reads(TensorFile)
    try:
        model, _ = split_stream.load_transformer(z_files, dtype, torch.device("cpu"))
    finally:
        reads.undo()
    assert reads.devices == {torch.device("cpu")}  # every read asked for the device (the host holds no state dict)
    with TensorFile(z_files) as f:  # each tensor once, one read each (a fused qkv once for its three parameters)
        assert reads.count == len(reads.keys) == len(f.header.tensors) - 1
    assert PREFIX + "norm_final.weight" not in reads.keys  # no place in the module: not read
    assert reads.alive_at_next == []  # no tensor read is alive when the next is read (the module holds its own)
    if dtype == torch.float32:  # at the file's dtype the module's tensors are the ones read, not copies, but a fused
        read = set(reads.pointers)  # qkv's parts are clones (so the fused tensor goes)
        for name, p in model.named_parameters():
            assert (p.data_ptr() in read) == (".to_q." not in name and ".to_k." not in name and ".to_v." not in name)


def test_no_module_is_built_with_real_parameters(tmp_path, z_files, monkeypatch):
    """The load_split of three files: every parameter of the three modules is a meta tensor until its tensor is
    assigned, no initialiser touches a real tensor, and the modules are complete."""
    from diffusers import AutoencoderKL

    from diffgraph.models.families import default_registry
    from diffgraph.models.families.zimage import FLUX_VAE
    from diffgraph.models.original_layout import vae_original
    from diffgraph.models.split_files import SPLIT_KINDS, SplitFiles

    paths = [z_files, str(tmp_path / "qwen_3.safetensors"), str(tmp_path / "ae.safetensors")]
    save_file({f"model.{k}": v.contiguous() for k, v in tiny_qwen3().state_dict().items()}, paths[1])
    vae = AutoencoderKL(**{**FLUX_VAE, "block_out_channels": (32, 32, 32, 32), "layers_per_block": 1})
    save_file({k: v.contiguous() for k, v in vae_original(vae.state_dict(), 4).items()}, paths[2])

    assigned, real_inits = [], []
    original_assign = split_stream.assign

    def assign(model, name, tensor):
        owner, _, leaf = name.rpartition(".")
        old = getattr(model.get_submodule(owner), leaf)
        assigned.append((name, isinstance(old, torch.nn.Parameter), old.is_meta))
        original_assign(model, name, tensor)
    monkeypatch.setattr(split_stream, "assign", assign)
    for init in ("uniform_", "normal_", "kaiming_uniform_", "xavier_uniform_", "trunc_normal_", "constant_",
                 "zeros_", "ones_"):
        def spy(tensor, *args, _original=getattr(torch.nn.init, init), **kwargs):
            if not tensor.is_meta:
                real_inits.append(tuple(tensor.shape))
            return _original(tensor, *args, **kwargs)
        monkeypatch.setattr(torch.nn.init, init, spy)

    files = SplitFiles(next(k for k in SPLIT_KINDS if k.family == "zimage"), *paths, ())
    model = default_registry().by_name("zimage").load_split(files, torch.device("cpu"), torch.float32, paths[0])
    modules = (model.denoiser, model.text_encoders[0], model.vae)
    params = [n for m in modules for n, _ in m.named_parameters()]
    assert real_inits == []
    assert all(meta for _, is_param, meta in assigned if is_param)  # each parameter was meta until assigned
    assert len([a for a in assigned if a[1]]) == len(params)         # ... and every one was assigned
    assert all(not p.is_meta for m in modules for p in m.parameters())
    assert all(not b.is_meta for m in modules for b in m.buffers())


def test_a_file_that_does_not_fit_is_refused_before_any_tensor_is_read(tmp_path, z_files):
    from safetensors.torch import load_file

    tensors = load_file(z_files)
    lacking = str(tmp_path / "lacking.safetensors")
    save_file({k: v for k, v in tensors.items() if k != PREFIX + "layers.1.feed_forward.w2.weight"}, lacking)
    extra = str(tmp_path / "extra.safetensors")
    save_file({**tensors, PREFIX + "layers.1.adapter.weight": torch.zeros(4, 4)}, extra)
    partial = str(tmp_path / "partial.safetensors")
    save_file({k: v for k, v in tensors.items() if "cap_embedder.1." not in k}, partial)
    reads = spy_reads(TensorFile)
    try:
        one_line_error(lambda: split_stream.load_transformer(lacking, torch.float32, "cpu"), lacking,
                       "lacks 'layers.1.feed_forward.w2.weight'", "use the file made for this model")
        one_line_error(lambda: split_stream.load_transformer(extra, torch.float32, "cpu"), extra,
                       "holds 'layers.1.adapter.weight'", "no place for")
        one_line_error(lambda: split_stream.load_transformer(partial, torch.float32, "cpu"), partial,
                       "lacks the tensor 'cap_embedder.1.weight'", "not a complete file of a Z-Image transformer")
    finally:
        reads.undo()
    assert reads.count == 0


def test_a_file_rewritten_while_it_is_read_is_refused_in_one_line(z_files, monkeypatch):
    original, calls = TensorFile.read, []

    def read(f, keys=None, device=None, dtype=None):
        calls.append(1)
        if len(calls) == 6:
            with open(z_files, "ab") as out:
                out.write(b"\0" * 64)
        return original(f, keys, device, dtype)
    monkeypatch.setattr(TensorFile, "read", read)
    one_line_error(lambda: split_stream.load_transformer(z_files, torch.float32, "cpu"), z_files,
                   "wait until it is written completely")
    assert os.path.getsize(z_files) > 0


def _companion_files(tmp_path) -> dict[str, tuple[str, object]]:
    """The split families' companion files (a Qwen3 text encoder under `model.`, a Z-Image (Flux) VAE and a FLUX.2 VAE
    in their original layouts), each with its streamed loader."""
    from diffusers import AutoencoderKL, AutoencoderKLFlux2

    from diffgraph.models.families.flux2 import FLUX2_VAE, tiny_vae as flux2_vae
    from diffgraph.models.families.zimage import FLUX_VAE
    from diffgraph.models.original_layout import vae_original

    encoder, vae = str(tmp_path / "qwen_3.safetensors"), str(tmp_path / "ae.safetensors")
    save_file({f"model.{k}": v.contiguous() for k, v in tiny_qwen3().state_dict().items()}, encoder)
    torch.manual_seed(0)
    z_vae = AutoencoderKL(**{**FLUX_VAE, "block_out_channels": (32,) * 4, "layers_per_block": 1})
    save_file({k: v.contiguous() for k, v in vae_original(z_vae.state_dict(), 4).items()}, vae)
    f_vae, flux2 = AutoencoderKLFlux2(**{**flux2_vae(), "block_out_channels": (32,) * 4, "norm_num_groups": 32}), \
        str(tmp_path / "flux2-vae.safetensors")
    state = f_vae.state_dict()
    coders = vae_original({k: v for k, v in state.items() if not k.startswith("bn.")}, 4)
    save_file({k: v.contiguous() for k, v in flux2_files.vae_to_original(state, coders).items()}, flux2)
    f32 = torch.float32
    return {
        "text encoder": (encoder, lambda: split_stream.load_text_encoder(encoder, f32, "cpu")[0]),
        "Z-Image VAE": (vae, lambda: split_stream.load_vae(AutoencoderKL, zf.vae_config(vae, FLUX_VAE),
                                                           lambda c: zf.read_vae(vae, c, f32), f32, "cpu")),
        "FLUX.2 VAE": (flux2, lambda: split_stream.load_vae(AutoencoderKLFlux2, zf.vae_config(flux2, FLUX2_VAE),
                                                            lambda c: flux2_files.read_vae(flux2, c, f32), f32, "cpu"))}


@pytest.mark.parametrize("how", ["in place", "cut"])
def test_a_companion_file_rewritten_while_it_is_read_is_refused_in_one_line(tmp_path, monkeypatch, how):
    """The text encoder and VAE files of Z-Image and FLUX.2 (the transformer's: the test above) rewritten in place or
    cut while they are read: a one-line ValueError naming the file and saying to wait; once whole again, the file
    loads as before."""
    from rewrite_util import rewrite_on_read

    for what, (path, load) in _companion_files(tmp_path).items():
        want, whole = load(), open(path, "rb").read()
        calls = rewrite_on_read(monkeypatch, path, how)
        message = one_line_error(load, path, "changed while it was read; wait until it is written completely")
        monkeypatch.undo()
        assert len(calls) == 2 and message.startswith(path), (what, message)
        with open(path, "wb") as f:
            f.write(whole)
        assert_same_module(load(), want)
