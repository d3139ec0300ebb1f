"""fp8 linears (diffgraph.quantize.fp8): the op against a dequantise-then-fp32 reference written here, the error
against the unquantised layer and UNet, batch invariance of the per-token scales, in-place requantisation, tracing by
torch.compile, and which layers of the tiny UNet preset quantize_linears picks and why it skips the others."""

import copy

import pytest
import torch
from torch import nn

from diffgraph.models.loader import load_model
from diffgraph.quantize import Fp8Linear, SkipReason, quantize_linears, quantize_rows, relative_error, weight_count

E4M3 = torch.float8_e4m3fn


def _linear(in_features: int, out_features: int, bias: bool = True, seed: int = 0,
            dtype: torch.dtype = torch.float32) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)
    linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5)
    if bias:
        linear.bias.copy_(torch.randn(out_features, generator=gen))
    return linear.to(dtype)


def _randn(*shape: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _reference(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """Per-token e4m3 quantisation of x, then everything dequantised to fp32 and one fp32 matmul."""
    x2d = x.reshape(-1, x.shape[-1]).float()
    scale = x2d.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    qx = (x2d / scale).clamp(-448.0, 448.0).to(E4M3)
    w = layer.weight.float() * layer.weight_scale.reshape(-1, 1)
    y = (qx.float() * scale) @ w.t()
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.reshape(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(24, 64), (3, 10, 64)])
def test_fp8_linear_equals_the_dequantised_reference(granularity, bias, shape):
    linear = _linear(64, 48, bias)
    layer = Fp8Linear.from_linear(linear, granularity)
    assert layer.weight.dtype == E4M3 and layer.weight.shape == (48, 64)
    amax = linear.weight.abs().amax(dim=1) if granularity == "channel" else linear.weight.abs().amax().reshape(1)
    assert torch.equal(layer.weight_scale, amax / 448.0)
    x = _randn(*shape)
    y = layer(x)
    assert y.shape == (*shape[:-1], 48) and y.dtype == torch.float32
    torch.testing.assert_close(y, _reference(layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_layer_answers_in_its_dtype(dtype):
    layer = Fp8Linear.from_linear(_linear(64, 32, dtype=dtype))
    assert layer.bias.dtype == torch.float32  # kept in the matmul's output dtype (bfloat16 on CUDA): never cast per call
    x = _randn(2, 5, 64, dtype=dtype)
    y = layer(x)
    assert y.dtype == dtype
    assert relative_error(_reference(layer, x), y.float()) < 4e-3  # the 16-bit output's rounding, measured ~1e-3


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_fp8_is_close_to_the_fp32_linear(granularity):
    linear = _linear(256, 128)
    x = _randn(4, 77, 256)
    err = relative_error(linear(x), Fp8Linear.from_linear(linear, granularity)(x))
    assert 0.01 < err < 0.05  # measured 0.035 (e4m3 keeps 3 mantissa bits); above 0.01: it did quantise


def test_a_rows_result_does_not_depend_on_its_batch_companions():
    layer = Fp8Linear.from_linear(_linear(64, 48))
    x = _randn(4, 9, 64)
    y = layer(x)
    loud = x.clone()
    loud[1] *= 1000.0  # a per-tensor scale would crush the other rows' precision
    loud[3] = _randn(9, 64, seed=7)
    y_loud = layer(loud)
    for i in (0, 2):  # one batch size (one captured graph), other companions: bit for bit the same
        assert torch.equal(y_loud[i], y[i])
    # Alone, to fp32 rounding only: this CPU's fp32 GEMM itself (plain `a @ w.t()` too) gives a 9-row slice other
    # last bits alone than inside 36 rows, since its kernel depends on the row count; the scales are per row
    for i in range(4):
        torch.testing.assert_close(layer(loud[i:i + 1]), y_loud[i:i + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_an_all_zero_row_gives_the_bias(bias):
    layer = Fp8Linear.from_linear(_linear(32, 16, bias))
    x = _randn(3, 32)
    x[1] = 0.0
    y = layer(x)
    assert torch.isfinite(y).all()
    assert torch.equal(y[1], layer.bias if bias else torch.zeros(16))


def test_requantize_rewrites_the_weights_in_place():
    layer = Fp8Linear.from_linear(_linear(64, 32, seed=0))
    weight, scale = layer.weight, layer.weight_scale
    pointers = (weight.data_ptr(), scale.data_ptr())
    other = _linear(64, 32, seed=5)
    other.bias.copy_(layer.bias)
    layer.requantize(other.weight)
    fresh = Fp8Linear.from_linear(other)
    assert layer.weight is weight and layer.weight_scale is scale
    assert (layer.weight.data_ptr(), layer.weight_scale.data_ptr()) == pointers
    assert torch.equal(layer.weight.view(torch.uint8), fresh.weight.view(torch.uint8))
    assert torch.equal(layer.weight_scale, fresh.weight_scale)
    x = _randn(6, 64)
    assert torch.equal(layer(x), fresh(x))
    with pytest.raises(ValueError, match=r"needs \[32, 64\]"):
        layer.requantize(torch.zeros(64, 32))


def test_the_op_traces_under_torch_compile():
    x = _randn(2, 7, 64)
    layer = Fp8Linear.from_linear(_linear(64, 32))
    # opcheck's test_schema multiplies the inputs, which torch cannot do on float8 tensors: the other checks run
    qx, scale_x = quantize_rows(x.reshape(-1, 64))
    torch.library.opcheck(torch.ops.diffgraph.fp8_mm.default, (qx, scale_x, layer.weight, layer.weight_scale, layer.bias),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration"))
    model = nn.Sequential(layer, nn.GELU(), Fp8Linear.from_linear(_linear(32, 16, bias=False), "tensor"))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), model(x))


@pytest.fixture(scope="module")
def tiny_unet() -> nn.Module:
    return load_model("random:tiny", torch.device("cpu"), "fp32").denoiser


def _unet_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _randn(2, 4, 8, 8, seed=1), torch.tensor([500.0, 20.0]), _randn(2, 77, 32, seed=2)


def test_quantize_linears_picks_the_tiny_unets_wide_transformer_linears(tiny_unet):
    unet = copy.deepcopy(tiny_unet)
    report = quantize_linears(unet, min_features=64)
    mid = "mid_block.attentions.0.transformer_blocks.0."
    expected = [mid + n for n in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q",
                                  "attn2.to_out.0", "ff.net.0.proj", "ff.net.2")]
    expected += [f"{b}.transformer_blocks.0.ff.net.2" for b in
                 ("down_blocks.0.attentions.0", "up_blocks.1.attentions.0", "up_blocks.1.attentions.1")]
    assert sorted(report.quantized) == sorted(expected)
    assert all(isinstance(unet.get_submodule(n), Fp8Linear) for n in expected)
    not_selected = report.skipped_for(SkipReason.NOT_SELECTED)
    assert len(not_selected) == 10 and {"time_embedding.linear_1", "time_embedding.linear_2",
                                        "down_blocks.0.resnets.0.time_emb_proj"} <= set(not_selected)
    below = report.skipped_for(SkipReason.BELOW_MIN_FEATURES)
    assert len(below) == 29 and mid + "attn2.to_k" in below  # in_features 32: the text embedding's width
    assert "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q" in below
    assert report.skipped_for(SkipReason.NOT_MULTIPLE_OF_16) == ()
    time = unet.time_embedding.linear_1
    assert type(time) is nn.Linear and torch.equal(time.weight, tiny_unet.time_embedding.linear_1.weight)
    sizes = [(m.out_features, m.in_features) for m in map(tiny_unet.get_submodule, expected)]
    assert report.bytes_saved == sum(o * i * 3 - 4 * o for o, i in sizes)  # fp32 -> fp8, plus a scale per row


def test_a_quantised_unet_stays_close_to_the_original(tiny_unet):
    unet = copy.deepcopy(tiny_unet)
    report = quantize_linears(unet, min_features=16)
    assert len(report.quantized) == 40
    err = relative_error(tiny_unet(*_unet_inputs()).sample, unet(*_unet_inputs()).sample)
    assert 1e-3 < err < 0.03  # measured 0.015 with every transformer linear in fp8
    # `diffgraph info`'s count: the fp8 weights are buffers, counted as the linears' weights were
    plain = sum(p.numel() for p in tiny_unet.parameters())
    assert weight_count(unet) == weight_count(tiny_unet) == plain > sum(p.numel() for p in unet.parameters())


def test_dims_off_16_are_skipped_and_refused():
    module = nn.ModuleDict({"odd": _linear(48, 30), "even": _linear(64, 64)})
    report = quantize_linears(module, min_features=16, select=lambda name, linear: True)
    assert report.quantized == ("even",)
    assert report.skipped == (("odd", SkipReason.NOT_MULTIPLE_OF_16),)
    assert type(module["odd"]) is nn.Linear
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Linear.from_linear(_linear(48, 30))


def test_no_qualifying_linear_says_what_to_change():
    module = nn.ModuleDict({"to_q": _linear(320, 320)})
    with pytest.raises(ValueError, match=r"1 below min_features=640\); lower min_features"):
        quantize_linears(module)
    assert type(module["to_q"]) is nn.Linear


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="weight_granularity 'row' is not known; use one of channel, tensor"):
        Fp8Linear.from_linear(_linear(32, 32), "row")
    module = nn.ModuleDict({"to_q": _linear(32, 32)})
    with pytest.raises(ValueError, match="weight_granularity 'block'"):
        quantize_linears(module, min_features=16, weight_granularity="block")
    quantize_linears(module, min_features=16)
    with pytest.raises(ValueError, match="already holds 1 Fp8Linear"):
        quantize_linears(module, min_features=16)
    module.to(torch.float16)  # a cast after quantising turns the fp8 weight into floats
    with pytest.raises(ValueError, match="cast it first"):
        module["to_q"](_randn(2, 32, dtype=torch.float16))


def test_relative_error():
    ref = torch.tensor([3.0, 4.0])
    assert relative_error(ref, ref) == 0.0
    assert relative_error(ref, torch.tensor([3.0, 5.0])) == pytest.approx(0.2)
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    with pytest.raises(ValueError, match="one shape"):
        relative_error(ref, torch.zeros(3))


def test_a_familys_fp8_names_take_its_blocks_linears_and_leave_the_rest_in_16_bits():
    """FLUX.2 klein's blocks (double: attention with its text projections, both feed-forwards; single: the fused
    qkv-mlp projection and its output) in fp8; the embedders, the modulation layers and the final projection not."""
    from diffusers import Flux2Transformer2DModel

    from diffgraph.models.families.flux2 import Flux2KleinFamily
    from diffgraph.models.families.flux2 import tiny_transformer
    from diffgraph.quantize.fp8 import named_linears

    module = Flux2Transformer2DModel(**tiny_transformer(text_width=16))
    report = quantize_linears(module, min_features=16, select=named_linears(Flux2KleinFamily.fp8_linears))
    blocks = {n.split(".", 2)[2] for n in report.quantized}
    assert blocks == {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                      "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                      "ff_context.linear_out", "attn.to_qkv_mlp_proj", "attn.to_out"}
    assert {n.split(".")[0] for n in report.quantized} == {"transformer_blocks", "single_transformer_blocks"}
    left = {n for n, why in report.skipped if why is SkipReason.NOT_SELECTED}
    assert {"x_embedder", "context_embedder", "proj_out"} <= left
    assert any("modulation" in n for n in left)
    with pytest.raises(ValueError, match="non-empty tuple"):
        named_linears(())
