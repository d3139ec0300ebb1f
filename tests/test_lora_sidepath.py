"""The per-row LoRA side path (diffgraph.lora.sidepath, toward issue 12): rows with different adapters, stacks and
scales in one UNet forward each equal a forward through the base UNet with that row's adapters merged into its
weights; slots are written in place; unsupported targets, ranks and shapes are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from diffgraph.lora.sidepath import RowLoras, attach


def _targets(unet: nn.Module) -> list[str]:
    ends = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2")
    return [n for n, m in unet.named_modules() if n.endswith(ends) and isinstance(m, (nn.Linear, nn.Conv2d))]


def _random_adapter(unet: nn.Module, targets: list[str], rank: int, seed: int) -> dict[str, tuple]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for path in targets:
        m = unet.get_submodule(path)
        n_in, n_out = (m.in_features, m.out_features) if isinstance(m, nn.Linear) else (m.in_channels, m.out_channels)
        out[path] = (torch.randn((rank, n_in), generator=gen) * 0.3, torch.randn((n_out, rank), generator=gen) * 0.3)
    return out


def _merged(unet: nn.Module, stack: list[tuple[dict, float]]) -> nn.Module:
    merged = copy.deepcopy(unet)
    with torch.no_grad():
        for adapter, scale in stack:
            for path, (a, b) in adapter.items():
                w = merged.get_submodule(path).weight
                w += (scale * (b @ a)).reshape(w.shape)
    return merged


@pytest.fixture(scope="module")
def unet(tiny_engine):
    return copy.deepcopy(tiny_engine.model.denoiser).eval()


def test_rows_with_different_adapters_equal_their_merged_weights(unet):
    targets = _targets(unet)
    assert any(isinstance(unet.get_submodule(t), nn.Conv2d) for t in targets)  # 1x1 convs are covered too
    first, second = _random_adapter(unet, targets, 4, 1), _random_adapter(unet, targets, 8, 2)
    wrapped, rows = copy.deepcopy(unet), RowLoras()
    bank = attach(wrapped, targets, slots=3, max_rank=8, rows=rows)
    for path in targets:
        bank.write(1, path, *first[path])
        bank.write(2, path, *second[path], scale=0.5)  # e.g. alpha / r folded in
    stacks = [[], [(first, 0.5)], [(second, 1.0 * 0.5)], [(first, 0.7), (second, -0.3 * 0.5)]]
    rows.set(torch.tensor([[0, 0], [1, 0], [2, 0], [1, 2]]), torch.tensor([[0, 0], [0.5, 0], [1.0, 0], [0.7, -0.3]]))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((4, 4, 8, 8), generator=gen)
    t = torch.tensor([900, 500, 300, 10])
    cond = torch.randn((4, 77, 32), generator=gen)
    with torch.no_grad():
        out = wrapped(x, t, encoder_hidden_states=cond, return_dict=False)[0]
        for i, stack in enumerate(stacks):
            ref = _merged(unet, stack)(x[i:i + 1], t[i:i + 1], encoder_hidden_states=cond[i:i + 1], return_dict=False)[0]
            assert torch.allclose(out[i:i + 1], ref, atol=1e-4, rtol=0), (i, float((out[i:i + 1] - ref).abs().max()))
        base = unet(x, t, encoder_hidden_states=cond, return_dict=False)[0]
        assert float((out[1:] - base[1:]).abs().max()) > 1e-2  # the adapters change the output
        rows.set(None, None)  # no side path: exactly the base model
        assert torch.equal(wrapped(x, t, encoder_hidden_states=cond, return_dict=False)[0], base)
        # a slot rewritten in place takes effect at the next forward (what a captured graph reads never moves)
        rows.set(torch.tensor([[1], [1], [1], [1]]), torch.ones((4, 1)))
        before = wrapped(x, t, encoder_hidden_states=cond, return_dict=False)[0]
        for path in targets:
            bank.write(1, path, *second[path])
        after = wrapped(x, t, encoder_hidden_states=cond, return_dict=False)[0]
        ref = _merged(unet, [(second, 1.0)])(x, t, encoder_hidden_states=cond, return_dict=False)[0]
        assert float((after - before).abs().max()) > 1e-2 and torch.allclose(after, ref, atol=1e-4, rtol=0)
        bank.clear(1)
        assert torch.allclose(wrapped(x, t, encoder_hidden_states=cond, return_dict=False)[0], base, atol=1e-6)


def test_unsupported_targets_ranks_and_shapes_are_refused(unet):
    rows = RowLoras()
    conv3 = next(n for n, m in unet.named_modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3))
    with pytest.raises(ValueError, match=r"is a 3x3 convolution: LoRA side paths take Linear layers and 1x1"):
        attach(copy.deepcopy(unet), [conv3], slots=2, max_rank=4, rows=rows)
    target = _targets(unet)[0]
    bank = attach(copy.deepcopy(unet), [target], slots=2, max_rank=4, rows=rows)
    n_in = bank.layers[target].a.shape[2]
    n_out = bank.layers[target].b.shape[1]
    with pytest.raises(ValueError, match="rank 8 .* is above the maximum rank 4"):
        bank.write(1, target, torch.zeros((8, n_in)), torch.zeros((n_out, 8)))
    with pytest.raises(ValueError, match="do not fit the layer"):
        bank.write(1, target, torch.zeros((2, n_in + 1)), torch.zeros((n_out, 2)))
    with pytest.raises(ValueError, match="slot 3 is out of range 1..2"):
        bank.write(3, target, torch.zeros((2, n_in)), torch.zeros((n_out, 2)))
    with pytest.raises(ValueError, match="at most 4"):
        rows.set(torch.zeros((1, 5), dtype=torch.long), torch.zeros((1, 5)))
