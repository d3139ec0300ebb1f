"""Convolution LoRA (LoCon) per request (diffgraph.lora, the manager's `conv` option): adapters with weights on
the SD and SDXL UNets' ResNet blocks (3x3 conv1 / conv2, time_emb_proj, 1x1 conv_shortcut), the down- and
upsamplers' strided and plain 3x3 convs and conv_in / conv_out, written with peft in diffusers/PEFT layout and
converted to kohya's, give the image diffusers' pipeline gives with `load_lora_weights` (fp32, <= 1 uint8 level);
rows without an adapter, with it, with an attention-only adapter, or with a stack of both, batched together equal
their solo runs; the side path of a k x k convolution honours the base's stride, padding, dilation and padding
mode, and compiles once for every batch size; a fused LoCon equals it at its scale; an engine without the option
refuses such adapters naming it; unsupported layouts and shapes are refused by name."""

from __future__ import annotations

import copy
import functools
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import diffgraph.engine.engine as engine_module
from diffgraph import Engine
from diffgraph.lora.files import AdapterError, read_adapter
from diffgraph.lora.manager import CONV_TARGETS, LoraManager
from diffgraph.lora.sidepath import RowLoras, attach
from diffgraph.request import ParamError
from lora_util import _peft_weights, _write_diffusers

PROMPT = "a photo of a red fox in the snow"
STEPS = 3
# what diffusers' LCM-LoRA distillation scripts target (examples/consistency_distillation); CONV_ONLY: the ResNet
# and sampler layers alone, with conv_in / conv_out
LCM_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1",
               "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv", "time_emb_proj"]
CONV_ONLY = ["conv1", "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv", "time_emb_proj",
             "conv_in", "conv_out"]


def _uint8(arrays: np.ndarray) -> np.ndarray:
    return (arrays * 255).round().astype(np.int16)


def _conv_weights(engine, targets, rank, seed, gain=0.5):
    """peft's LoRA state dict of the UNet's `targets` (random A and B, scaled by `gain`: a tiny random UNet)."""
    return {k: v * gain for k, v in _peft_weights(engine.model.denoiser, targets, rank, seed).items()}


def _kohya(weights: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """PEFT keys -> kohya LoCon keys (lora_unet_<module with _>.lora_down / lora_up, an alpha per module)."""
    out = {}
    for key, value in weights.items():
        module, _, kind = key.rpartition(".lora_")
        name = "lora_unet_" + module.replace(".", "_")
        out[f"{name}.lora_{'down' if kind.startswith('A') else 'up'}.weight"] = value.contiguous()
        out[f"{name}.alpha"] = torch.tensor(alpha)
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_engine):
    """`lcm` (PEFT layout, LCM-LoRA's targets), `locon` (kohya layout with alphas, convolutions only) and `attn`
    (attention layers only, the existing tests' kind)."""
    import diffusers

    root = tmp_path_factory.mktemp("conv-loras")
    diffusers.StableDiffusionPipeline.save_lora_weights(
        str(root), unet_lora_layers=_conv_weights(tiny_engine, LCM_TARGETS, 4, 0), weight_name="lcm.safetensors")
    save_file(_kohya(_conv_weights(tiny_engine, CONV_ONLY, 4, 1), alpha=2.0), str(root / "locon.safetensors"))
    _write_diffusers(tiny_engine, str(root / "attn.safetensors"), rank=4, seed=2)
    return str(root)


@pytest.fixture(scope="module")
def conv_engine(folder):
    # the `conv` option is the manager's (no Engine / CLI flag yet): the engine's manager is made with it
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "LoraManager", functools.partial(LoraManager, conv=True))
        engine = Engine("random:tiny", device="cpu", dtype="fp32", lora_dir=folder, max_loras=4, max_lora_rank=8)
    with engine:
        yield engine


def _diffusers_image(base: Engine, folder: str, stack: list[tuple[str, float]], seed: int) -> np.ndarray:
    pipe = copy.deepcopy(base.diffusers_pipeline())
    for name, _ in stack:
        pipe.load_lora_weights(os.path.join(folder, name + ".safetensors"), adapter_name=name)
    pipe.set_adapters([n for n, _ in stack], adapter_weights=[s for _, s in stack])
    return pipe(PROMPT, num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(seed),
                output_type="np").images


def test_conv_adapters_match_diffusers(conv_engine, tiny_engine, folder):
    """PEFT layout (LCM-LoRA's targets) and a kohya LoCon, alone and stacked with an attention adapter."""
    bank = conv_engine.runner.loras.banks["unet"]
    kinds = {tuple(bank.layers[p].kernel or ()) for p in bank.layers}
    assert {(3, 3), (1, 1), ()} <= kinds  # 3x3 convolutions, 1x1 ones and Linear layers have side paths
    assert any(p.endswith("downsamplers.0.conv") for p in bank.layers)  # the strided one
    seed = 5
    plain = conv_engine.generate(PROMPT, num_inference_steps=STEPS, seed=seed).arrays
    np.testing.assert_allclose(plain, tiny_engine.generate(PROMPT, num_inference_steps=STEPS, seed=seed).arrays,
                               atol=1e-5)
    adapters = {a["name"]: a for a in conv_engine.loras()["data"]}
    assert {"lcm", "locon", "attn"} <= set(adapters)
    assert adapters["locon"]["targets"] == {"unet": len([p for p in bank.layers if p.endswith(tuple(CONV_TARGETS))])}
    for stack in ([("lcm", 1.0)], [("locon", 1.0)], [("locon", 0.7), ("attn", 1.0)]):
        ours = conv_engine.generate(PROMPT, num_inference_steps=STEPS, seed=seed, loras=stack).arrays
        ref = _diffusers_image(tiny_engine, folder, stack, seed)
        diff = np.abs(_uint8(ours) - _uint8(ref)).max()
        assert diff <= 1, (stack, diff)
        assert np.abs(_uint8(ours) - _uint8(plain)).max() > 8, f"{stack} did not change the image"


def test_sdxl_conv_adapters_match_diffusers(tiny_xl_engine, tmp_path):
    """SDXL's UNet (its ResNet, sampler and added-embedding layers differ in count and width): both layouts."""
    import diffusers

    diffusers.StableDiffusionXLPipeline.save_lora_weights(
        str(tmp_path), unet_lora_layers=_conv_weights(tiny_xl_engine, LCM_TARGETS, 4, 3), weight_name="lcm.safetensors")
    save_file(_kohya(_conv_weights(tiny_xl_engine, CONV_ONLY, 4, 4), alpha=2.0), str(tmp_path / "locon.safetensors"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "LoraManager", functools.partial(LoraManager, conv=True))
        engine = Engine("random:tiny-xl", device="cpu", dtype="fp32", lora_dir=str(tmp_path), max_loras=4,
                        max_lora_rank=8)
    with engine:
        plain = engine.generate(PROMPT, num_inference_steps=STEPS, seed=6).arrays
        for stack in ([("lcm", 1.0)], [("locon", 1.0)]):
            ours = engine.generate(PROMPT, num_inference_steps=STEPS, seed=6, loras=stack).arrays
            ref = _diffusers_image(tiny_xl_engine, str(tmp_path), stack, 6)
            diff = np.abs(_uint8(ours) - _uint8(ref)).max()
            assert diff <= 1, (stack, diff)
            assert np.abs(_uint8(ours) - _uint8(plain)).max() > 8, f"{stack} did not change the image"


def test_rows_with_other_adapters_or_none_equal_their_solo_runs(conv_engine):
    sets = [(), (("lcm", 1.0),), (("attn", 1.0),), (("locon", 0.7), ("attn", 1.0)), (("locon", -0.5),)]
    requests = [conv_engine.make_request(PROMPT, num_inference_steps=STEPS, seed=20 + i, loras=sets[i % 5])
                for i in range(10)]
    solo = [conv_engine.run(r).arrays for r in requests]
    together = [f.result() for f in [conv_engine.submit(r) for r in requests]]
    for r, s, t in zip(requests, solo, together):
        assert np.abs(_uint8(t.arrays) - _uint8(s)).max() <= 1, r.loras
    assert len({tuple(s.flatten()[:64]) for s in solo[:5]}) == 5  # five sets, five images


def test_fused_locon_equals_the_side_path(conv_engine, folder):
    path = os.path.join(folder, "locon.safetensors")
    with Engine("random:tiny", device="cpu", dtype="fp32", fuse_loras=[(path, 0.5)]) as fused:
        ours = fused.generate(PROMPT, num_inference_steps=STEPS, seed=11).arrays
    side = conv_engine.generate(PROMPT, num_inference_steps=STEPS, seed=11, loras=[("locon", 0.5)]).arrays
    assert np.abs(_uint8(ours) - _uint8(side)).max() <= 1


class _Convs(nn.Module):
    """Convolutions of every geometry the side path must honour, in a chain."""

    def __init__(self):
        super().__init__()
        self.strided = nn.Conv2d(6, 8, 3, stride=2, padding=1)
        self.dilated = nn.Conv2d(8, 8, (3, 5), padding=(2, 3), dilation=(2, 1))
        self.reflect = nn.Conv2d(8, 5, 3, padding=1, padding_mode="reflect", bias=False)
        self.unpadded = nn.Conv2d(5, 7, 3)
        self.same = nn.Conv2d(7, 7, (4, 3), padding="same")  # uneven: padded one more on the right
        self.pointwise_strided = nn.Conv2d(7, 4, 1, stride=2)

    def forward(self, x):
        for m in self.children():
            x = torch.tanh(m(x))
        return x


@pytest.mark.filterwarnings("ignore:Using padding='same'")  # (torch's note on the uneven padding, from the base)
def test_conv_side_path_honours_the_convolutions_geometry():
    torch.manual_seed(0)
    net = _Convs().eval()
    targets = [n for n, _ in net.named_children()]
    wrapped, rows = copy.deepcopy(net), RowLoras()
    bank = attach(wrapped, targets, slots=3, max_rank=4, rows=rows, convolutions=True)
    gen = torch.Generator().manual_seed(1)
    adapters = []
    for rank in (3, 4):
        adapter = {}
        for name in targets:
            m = net.get_submodule(name)
            adapter[name] = (torch.randn((rank, m.in_channels, *m.kernel_size), generator=gen) * 0.2,
                             torch.randn((m.out_channels, rank, 1, 1), generator=gen) * 0.2)
        adapters.append(adapter)
    for slot, adapter in enumerate(adapters, 1):
        for name, (a, b) in adapter.items():
            bank.write(slot, name, a, b, scale=0.5 * slot)
    stacks = [[], [(0, 0.5 * 1.3)], [(1, 1.0 * 0.6)], [(0, 0.5 * 1.0), (1, 1.0 * -0.8)]]
    rows.set(torch.tensor([[0, 0], [1, 0], [2, 0], [1, 2]]), torch.tensor([[0, 0], [1.3, 0], [0.6, 0], [1.0, -0.8]]))
    x = torch.randn((4, 6, 13, 11), generator=gen)
    with torch.no_grad():
        out = wrapped(x)
        for i, stack in enumerate(stacks):
            merged = copy.deepcopy(net)
            for which, scale in stack:
                for name, (a, b) in adapters[which].items():
                    w = merged.get_submodule(name).weight
                    w += scale * (b.flatten(1) @ a.flatten(1)).reshape(w.shape)
            ref = merged(x[i:i + 1])
            assert torch.allclose(out[i:i + 1], ref, atol=1e-5, rtol=0), (i, float((out[i:i + 1] - ref).abs().max()))
        assert float((out[1:] - net(x)[1:]).abs().max()) > 1e-2
        rows.set(None, None)
        assert torch.equal(wrapped(x), net(x))


def test_conv_adapters_need_the_option_and_bad_layouts_are_refused(folder, tmp_path):
    with Engine("random:tiny", device="cpu", dtype="fp32", lora_dir=folder, max_loras=4, max_lora_rank=8) as plain:
        needle = r"targets unet\.\S+, a 3x3 convolution, whose side path is off .* --lora-conv"
        with pytest.raises(ParamError, match=needle):
            plain.generate(PROMPT, num_inference_steps=1, loras=[("locon", 1.0)])
        unusable = {a["name"]: a["error"] for a in plain.loras()["unusable"]}
        assert "--lora-conv" in unusable["lcm"] and "attn" in {a["name"] for a in plain.loras()["data"]}
        assert plain.generate(PROMPT, num_inference_steps=1, loras=[("attn", 1.0)]).arrays.std() > 1e-3
    cls = "StableDiffusionPipeline"
    conv1 = "unet.down_blocks.0.resnets.0.conv1"
    cases = {
        "up": ({f"{conv1}.lora_A.weight": torch.zeros(4, 32, 3, 3), f"{conv1}.lora_B.weight": torch.zeros(32, 4, 3, 3)},
               "3x3 up weight"),
        "loha": ({"lora_unet_down_blocks_0_resnets_0_conv1.hada_w1_a": torch.zeros(4, 4)}, "is LoHa"),
        "lokr": ({"lora_unet_down_blocks_0_resnets_0_conv1.lokr_w1": torch.zeros(4, 4)}, "is LoKr"),
        "dora": ({f"{conv1}.lora_A.weight": torch.zeros(4, 32, 3, 3),
                  f"{conv1}.lora_B.weight": torch.zeros(32, 4, 1, 1),
                  f"{conv1}.lora_magnitude_vector": torch.zeros(32)}, "is DoRA"),
        "tucker": ({"lora_unet_down_blocks_0_resnets_0_conv1.lora_mid.weight": torch.zeros(4, 4, 3, 3)},
                   "Tucker mid weight"),
    }
    for name, (state, needle) in cases.items():
        path = str(tmp_path / f"{name}.safetensors")
        save_file(state, path)
        with pytest.raises(AdapterError, match=needle):
            read_adapter(path, cls, name, convolutions=True)
    grouped = nn.Sequential(nn.Conv2d(8, 8, 3, groups=2))
    with pytest.raises(ValueError, match="is a grouped convolution .groups=2."):
        attach(grouped, ["0"], slots=2, max_rank=4, rows=RowLoras(), convolutions=True)


def test_conv_adapter_shapes_are_checked_against_the_model(conv_engine):
    conv1 = "unet.down_blocks.0.resnets.0.conv1"  # 32 -> 32 channels, 3x3
    bad = {
        "flat": ({f"{conv1}.lora_A.weight": torch.zeros(4, 32 * 9), f"{conv1}.lora_B.weight": torch.zeros(32, 4)},
                 r"takes 32 -> 32 channels, 3x3 kernel, the adapter 288 -> 32 features"),
        "kernel": ({f"{conv1}.lora_A.weight": torch.zeros(4, 32, 5, 5),
                    f"{conv1}.lora_B.weight": torch.zeros(32, 4, 1, 1)},
                   r"takes 32 -> 32 channels, 3x3 kernel, the adapter 32 -> 32 channels, 5x5 kernel"),
        "width": ({f"{conv1}.lora_A.weight": torch.zeros(4, 64, 3, 3),
                   f"{conv1}.lora_B.weight": torch.zeros(32, 4, 1, 1)}, r"the adapter 64 -> 32 channels"),
    }
    for name, (state, needle) in bad.items():
        with pytest.raises(ParamError, match=needle):
            conv_engine.add_lora(name, state)


def test_conv_side_path_compiles_once_for_every_batch_size():
    """torch.compile with a dynamic batch: the grouped convolution (groups = rows) is a custom op whose output shape
    Dynamo sees, so new batch sizes reuse the one graph instead of compiling again."""
    net = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.Conv2d(6, 6, 3, stride=2, padding=1))
    rows = RowLoras()
    bank = attach(net, ["0", "1"], slots=2, max_rank=3, rows=rows, convolutions=True)
    gen = torch.Generator().manual_seed(0)
    for layer in bank.layers.values():
        layer.a[1:].copy_(torch.randn(layer.a[1:].shape, generator=gen))
        layer.b[1:].copy_(torch.randn(layer.b[1:].shape, generator=gen))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(net, backend=backend, dynamic=True)
    with torch.no_grad():
        for n in (2, 4, 7):  # (sizes unlike the other dimensions: Dynamo's duck sizing would tie them)
            rows.set(torch.randint(0, 3, (n, 1), generator=gen), torch.rand((n, 1), generator=gen))
            x = torch.randn((n, 4, 10, 10), generator=gen)
            assert torch.allclose(compiled(x), net(x), atol=1e-5, rtol=0)
    rows.set(None, None)
    assert len(graphs) == 1, f"{len(graphs)} graphs for 3 batch sizes"
