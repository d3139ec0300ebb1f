"""A transformer family over packed latent tokens, defined and registered here, served without editing the engine.

`TinyDiTFamily` is the shape of Z-Image / Flux on a few hundred parameters: a single-stream DiT (text tokens and
image tokens in one sequence, adaLN time modulation, masked attention), reading 2x2 patches of a 4-channel latent as
tokens with their grid positions; an LLM text encoder (a two-layer Qwen3, its second-to-last hidden states, with its
attention mask) whose prompts keep their own lengths; flow matching (sampling/flow.py, dynamic time shift from each
row's token count) with classifier-free guidance; its own LoRA-style layer names. On `TokenFamily` (models/families/
tokens.py) its rows group by token bucket: 64x128 and 128x64 (32 tokens each) and 96x96 (36 tokens, padded) share
one group of 64 tokens, so they run in one step. The images are checked against a plain reference loop written
below (each request alone, unpadded, its own packing), so the engine cannot be running anything else.
"""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from diffgraph import Engine, GenerationRequest, ParamError
from diffgraph.lora.targets import DENOISER, LoraLayout
from diffgraph.models.families import default_registry
from diffgraph.models.families.tokens import TokenFamily
from diffgraph.models.model import DiffusionModel
from diffgraph.models.tokenizer import preset_tokenizer
from diffgraph.sampling.flow import FlowSchedule

from server_util import served

LATENT, SCALE, PATCH = 4, 8, 2
WIDTH, HEADS, TEXT_DIM, TEXT_TOKENS = 32, 2, 32, 64
SCHEDULER = {"use_dynamic_shifting": True, "base_image_seq_len": 16, "max_image_seq_len": 256, "base_shift": 0.5,
             "max_shift": 1.15}
SIZES = [(64, 128), (128, 64), (96, 96)]  # 32, 32 and 36 image tokens: one bucket of 64
MODEL_SEED = 3


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def position_embedding(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """(row, column) per token -> [.., dim]: half the width each, sinusoidal."""
    rows = timestep_embedding(positions[..., 0].reshape(-1), dim // 2)
    cols = timestep_embedding(positions[..., 1].reshape(-1), dim // 2)
    return torch.cat([rows, cols], dim=-1).reshape(*positions.shape[:-1], dim)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(WIDTH, elementwise_affine=False)
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.to_out = torch.nn.Linear(WIDTH, WIDTH)
        self.norm2 = torch.nn.LayerNorm(WIDTH, elementwise_affine=False)
        self.ff_in, self.ff_out = torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH)
        self.modulation = torch.nn.Linear(WIDTH, 4 * WIDTH)

    def forward(self, h: torch.Tensor, temb: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        shift1, scale1, shift2, scale2 = self.modulation(temb)[:, None].chunk(4, dim=-1)
        a = self.norm1(h) * (1 + scale1) + shift1
        b, n, _ = a.shape

        def heads(t):
            return t.reshape(b, n, HEADS, WIDTH // HEADS).transpose(1, 2)
        attn = torch.nn.functional.scaled_dot_product_attention(
            heads(self.to_q(a)), heads(self.to_k(a)), heads(self.to_v(a)), attn_mask=keys[:, None, None, :])
        h = h + self.to_out(attn.transpose(1, 2).reshape(b, n, WIDTH))
        f = self.norm2(h) * (1 + scale2) + shift2
        return h + self.ff_out(torch.nn.functional.gelu(self.ff_in(f)))


class TinyDiT(torch.nn.Module):
    """v(tokens, t, text, text mask, positions, image mask): the image tokens' velocity, 0 on padding tokens."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.x_in = torch.nn.Linear(LATENT * PATCH * PATCH, WIDTH)
        self.text_in = torch.nn.Linear(TEXT_DIM, WIDTH)
        self.t_in = torch.nn.Linear(WIDTH, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.out = torch.nn.Linear(WIDTH, LATENT * PATCH * PATCH)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)

    def forward(self, x, t, text, text_mask, positions, image_mask):
        image = self.x_in(x) + position_embedding(positions.clamp(min=0), WIDTH)
        h = torch.cat([self.text_in(text), image], dim=1)
        keys = torch.cat([text_mask, image_mask], dim=1)
        temb = torch.nn.functional.silu(self.t_in(timestep_embedding(t, WIDTH)))
        for block in self.blocks:
            h = block(h, temb, keys)
        return self.out(h[:, text.shape[1]:]) * image_mask[..., None]


class TinyVAE(torch.nn.Module):
    """8x8 average pooling to 4 channels, and back by nearest upsampling."""

    def __init__(self):
        super().__init__()
        from types import SimpleNamespace
        self.config = SimpleNamespace(scaling_factor=1.0)

    def encode(self, pixels, return_dict=False):
        raise NotImplementedError

    def decode(self, latents, return_dict=False):
        rgb = torch.tanh(latents[:, :3] + 0.25 * latents[:, 3:])
        return (rgb.repeat_interleave(SCALE, dim=2).repeat_interleave(SCALE, dim=3),)


def text_encoder(vocab: int, seed: int):
    from transformers import Qwen3Config, Qwen3Model
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
    return Qwen3Model(config).eval()


def encode_text(model: DiffusionModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Z-Image's reading of a Qwen3 encoder: the second-to-last hidden states."""
    out = model.text_encoders[0](input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return out.hidden_states[-2]


class TinyDiTFamily(TokenFamily):
    name = "tinydit"
    pipeline_classes = ("TinyDiTPipeline",)
    default_guidance = 3.0
    token_bucket = 64
    text_tokens = TEXT_TOKENS
    size_multiple = SCALE * PATCH

    def load_folder(self, folder, index, device, dtype, name):
        seed = int(index["seed"])
        tokenizer = preset_tokenizer()
        return DiffusionModel(name=name, family=self.name, adapter=self,
                              denoiser=TinyDiT(torch.Generator().manual_seed(seed)), vae=TinyVAE(),
                              text_encoders=[text_encoder(len(tokenizer), seed)], tokenizers=[tokenizer],
                              scheduler_config=dict(SCHEDULER), device=device, dtype=dtype, native_size=64)

    def vae_scale_factor(self, model):
        return SCALE

    def latent_channels(self, model):
        return LATENT

    def cond_spec(self, model):
        return {"embeds": ((TEXT_TOKENS, TEXT_DIM), model.dtype), "mask": ((TEXT_TOKENS,), torch.bool)}

    def encode(self, model, prompts):
        ids, mask = self.tokenize_padded(model, prompts)
        with torch.no_grad():
            return self.pad_tokens(model, encode_text(model, ids, mask), mask)

    def denoise(self, model, x, t, cond, rows):
        return model.denoiser(x, t, cond["embeds"], cond["mask"], rows["positions"], rows["image_mask"])

    def random_presets(self):
        return {"random:tinydit": "the test DiT family's tiny model (two blocks, a two-layer Qwen3), random weights"}

    def build_random(self, name, device, dtype):
        return self.load_folder(None, {"seed": MODEL_SEED}, device, dtype, name)

    def lora_layout(self, model):  # its files name `transformer.<module>` in PEFT's layout; attention and MLP layers
        return LoraLayout(((("transformer", DENOISER),)), LORA_TARGETS)


LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out", "ff_in", "ff_out")
LORA_RANK = 4


def lora_weights(seed: int = 11) -> dict[str, torch.Tensor]:
    """A rank-4 adapter on every targeted layer of both blocks, in PEFT's keys."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for block in range(2):
        for name in LORA_TARGETS:
            rows, cols = {"ff_in": (2 * WIDTH, WIDTH), "ff_out": (WIDTH, 2 * WIDTH)}.get(name, (WIDTH, WIDTH))
            key = f"transformer.blocks.{block}.{name}"
            out[f"{key}.lora_A.weight"] = torch.randn((LORA_RANK, cols), generator=g) * 0.3
            out[f"{key}.lora_B.weight"] = torch.randn((rows, LORA_RANK), generator=g) * 0.3
    return out


def merged(seed: int, scale: float) -> torch.nn.Module:
    """The model's denoiser made anew from its seed (the engine's carries side paths now) with the adapter merged into
    its weights (W + scale * B A): the reference for its rows."""
    out = TinyDiT(torch.Generator().manual_seed(seed))
    weights = lora_weights()
    with torch.no_grad():
        for name, module in out.named_modules():
            a = weights.get(f"transformer.{name}.lora_A.weight")
            if a is not None:
                module.weight += scale * weights[f"transformer.{name}.lora_B.weight"] @ a
    return out


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tinydit")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "TinyDiTPipeline", "seed": MODEL_SEED}))
    families = default_registry()
    families.register(TinyDiTFamily())
    return str(folder), families


@pytest.fixture(scope="module")
def engine(dit, tmp_path_factory):
    from safetensors.torch import save_file

    folder, families = dit
    loras = tmp_path_factory.mktemp("dit-loras")
    save_file(lora_weights(), str(loras / "ink.safetensors"))
    with Engine(model=folder, families=families, device="cpu", lora_dir=str(loras)) as e:
        yield e


def reference(engine: Engine, prompt: str, negative: str, size: tuple[int, int], steps: int, guidance: float,
              seed: int, denoiser: torch.nn.Module | None = None) -> np.ndarray:
    """The model's sampling loop for one request written out plainly: noise drawn in the image latents' shape, packed
    2x2 by hand (no padding), each prompt encoded alone at its own length, flow Euler on the dynamically shifted
    sigmas with classifier-free guidance, unpacked and decoded."""
    m = engine.model
    net = denoiser or m.denoiser
    h, w = size[0] // SCALE, size[1] // SCALE
    gh, gw = h // PATCH, w // PATCH
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn((1, LATENT, h, w), generator=gen)
    x = torch.stack([noise[0, :, r * 2:r * 2 + 2, c * 2:c * 2 + 2].reshape(-1)
                     for r in range(gh) for c in range(gw)])[None]
    positions = torch.tensor([[r, c] for r in range(gh) for c in range(gw)])[None]
    image_mask = torch.ones((1, gh * gw), dtype=torch.bool)
    tokenizer = m.tokenizers[0]

    def text(p):
        ids = torch.tensor([tokenizer(p).input_ids[:TEXT_TOKENS]])
        mask = torch.ones_like(ids)
        return encode_text(m, ids, mask), mask.bool()
    seq = gh * gw
    mu = 0.5 + (1.15 - 0.5) / (256 - 16) * (seq - 16)
    s = np.linspace(1.0, 1.0 / steps, steps)
    s = np.append(math.exp(mu) / (math.exp(mu) + (1 / s - 1)), 0.0)
    with torch.no_grad():
        (cond, cmask), (uncond, umask) = text(prompt), text(negative)
        for s_now, s_next in zip(s[:-1], s[1:]):
            t = torch.tensor([s_now * 1000.0])
            vc = net(x, t, cond, cmask, positions, image_mask)
            vu = net(x, t, uncond, umask, positions, image_mask)
            x = x + (s_next - s_now) * (vu + guidance * (vc - vu))
        latents = torch.zeros((1, LATENT, h, w))
        for i, (r, c) in enumerate((r, c) for r in range(gh) for c in range(gw)):
            latents[0, :, r * 2:r * 2 + 2, c * 2:c * 2 + 2] = x[0, i].reshape(LATENT, 2, 2)
        rgb = m.vae.decode(latents)[0] * 0.5 + 0.5
    return rgb.clamp(0, 1).permute(0, 2, 3, 1).numpy()[0]


def _uint8(pixels: np.ndarray) -> np.ndarray:
    return (pixels * 255).round().astype(np.int16)


REQUESTS = [  # three sizes of one token bucket, prompts of different lengths, different steps and guidance
    dict(prompt="a red fox", negative_prompt="", size=SIZES[0], steps=4, guidance=3.0, seed=1),
    dict(prompt="a lighthouse on a cliff at dusk, long exposure, waves breaking below", negative_prompt="blurry",
         size=SIZES[1], steps=3, guidance=5.0, seed=2),
    dict(prompt="ink", negative_prompt="", size=SIZES[2], steps=4, guidance=1.0, seed=3),
]


def _request(engine, r):
    return GenerationRequest.create(prompt=r["prompt"], negative_prompt=r["negative_prompt"] or None,
                                    height=r["size"][0], width=r["size"][1], num_inference_steps=r["steps"],
                                    guidance_scale=r["guidance"], seed=r["seed"], model=engine.info)


def test_sizes_of_one_token_bucket_share_a_group(engine):
    family, model = engine.model.adapter, engine.model
    keys = {family.group_key(model, size) for size in SIZES}
    assert keys == {(0, 64)}
    assert family.group_key(model, (128, 128)) == (0, 64) and family.group_key(model, (160, 128)) == (0, 128)
    assert engine.runner.latent_shape((0, 64)) == (64, LATENT * PATCH * PATCH)


def test_pack_and_unpack_are_inverse_and_pad_with_zeros(engine):
    family, model = engine.model.adapter, engine.model
    latents = torch.randn((2, LATENT, 12, 12))
    rows = family.pack(model, latents, (96, 96), (0, 64))
    assert rows.shape == (2, 64, 16) and torch.equal(rows[:, 36:], torch.zeros(2, 28, 16))
    assert torch.equal(rows[0, 1], latents[0, :, 0:2, 2:4].reshape(-1))  # token (0, 1): Flux's channel-first order
    assert torch.equal(family.unpack(model, rows, (96, 96), (0, 64)), latents)
    spec = family.row_spec(model, (0, 64), (64, 128))
    assert spec["positions"][:32].tolist() == [[r, c] for r in range(4) for c in range(8)]
    assert spec["positions"][32:].eq(-1).all() and spec["image_mask"].sum() == 32


def test_rows_of_three_sizes_and_prompt_lengths_share_steps_and_equal_each_alone(engine):
    """Submitted together, the three requests are admitted at one step and run in the same steps of one group;
    each image equals the plain reference of its request alone, within one uint8 level."""
    steps_seen, futures = [], []
    step = engine.runner.step

    def recording(key, coefs, rows, *args, **kwargs):
        steps_seen.append((key, len(rows)))
        return step(key, coefs, rows, *args, **kwargs)
    engine.runner.step = recording
    try:
        engine.core.call_between_steps(lambda: futures.extend(engine.submit(_request(engine, r))
                                                              for r in REQUESTS)).result()
        results = [f.result(timeout=600) for f in futures]
    finally:
        del engine.runner.step
    assert steps_seen[0] == ((0, 64), 3), steps_seen  # one group, all three rows in the first step
    for r, result in zip(REQUESTS, results):
        got = result.arrays[0]
        assert got.shape == (*r["size"], 3)
        want = reference(engine, r["prompt"], r["negative_prompt"], r["size"], r["steps"], r["guidance"], r["seed"])
        assert np.abs(_uint8(got) - _uint8(want)).max() <= 1, r
    assert np.abs(_uint8(results[0].arrays[0]) - _uint8(results[1].arrays[0].transpose(1, 0, 2))).max() > 3


def test_the_family_declares_what_it_reads(engine):
    with pytest.raises(ParamError) as e:
        GenerationRequest.create(prompt="(fox:1.2)", prompt_syntax="a1111", height=64, width=64,
                                 model=engine.info)
    assert e.value.param == "prompt_syntax" and "plain" in str(e.value)
    with pytest.raises(ParamError) as e:
        GenerationRequest.create(prompt="fox", height=64, width=72, model=engine.info)
    assert e.value.param == "width" and "16" in str(e.value)
    with pytest.raises(ParamError) as e:
        GenerationRequest.create(prompt="fox", sampler="dpmpp_sde", height=64, width=64, model=engine.info)
    assert e.value.param == "sampler" and "flow_euler" in str(e.value)
    for label, flow in (("euler", "flow_euler"), ("Euler", "flow_euler"), ("k_euler", "flow_euler"),
                        ("dpmpp_2m", "flow_dpmpp_2m"), ("Euler a", "flow_euler_a")):  # an SD sampler's flow one
        assert GenerationRequest.create(prompt="fox", sampler=label, height=64, width=64,
                                        model=engine.info).sampler == flow
    assert engine.info.samplers == ("flow_euler", "flow_euler_a", "flow_dpmpp_2m") and "classifier_free_guidance" in engine.info.capabilities


def test_the_family_builds_its_own_random_preset(dit, engine):
    from diffgraph.models.loader import load_model

    _, families = dit
    model = load_model("random:tinydit", "cpu", "fp32", families=families)
    assert model.is_random and model.family == "tinydit" and isinstance(model.denoiser, TinyDiT)
    for a, b in zip(model.denoiser.state_dict().values(), TinyDiT(torch.Generator().manual_seed(MODEL_SEED))
                    .state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="did you mean 'random:tinydit'"):
        load_model("random:tinydt", "cpu", "fp32", families=families)


def test_the_flow_schedule_is_diffusers(engine):
    """`FlowSchedule`'s sigmas equal diffusers' FlowMatchEulerDiscreteScheduler given Flux's sigmas and mu."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = FlowSchedule.from_config(SCHEDULER)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    for steps, tokens in ((4, 32), (9, 200)):
        scheduler.set_timesteps(sigmas=list(np.linspace(1.0, 1 / steps, steps)), mu=config.mu(tokens))
        np.testing.assert_allclose(config.sigmas(steps, tokens), scheduler.sigmas.numpy(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(config.sigmas(steps, tokens)[:-1] * 1000, scheduler.timesteps.numpy(), rtol=1e-5)


def test_its_own_lora_targets_run_per_row(engine):
    """An adapter file in the family's own layout (`transformer.blocks.N.to_q`, ...) runs as side paths on the rows
    that ask for it, beside a plain row in the same step: each equals the reference with the adapter merged (or not)."""
    assert engine.runner.loras.banks["transformer"].layers  # the family's layers wrapped, no UNet names
    futures = []
    with_lora = GenerationRequest.create(prompt="a red fox", height=64, width=128, num_inference_steps=3, seed=4,
                                         guidance_scale=2.0, loras=[("ink", 0.7)], model=engine.info)
    plain = GenerationRequest.create(prompt="a red fox", height=128, width=64, num_inference_steps=3, seed=4,
                                     guidance_scale=2.0, model=engine.info)
    engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in (with_lora, plain))).result()
    got = [f.result(timeout=600).arrays[0] for f in futures]
    want = reference(engine, "a red fox", "", (64, 128), 3, 2.0, 4, denoiser=merged(MODEL_SEED, 0.7))
    assert np.abs(_uint8(got[0]) - _uint8(want)).max() <= 1
    assert np.abs(_uint8(got[1]) - _uint8(reference(engine, "a red fox", "", (128, 64), 3, 2.0, 4))).max() <= 1
    unmerged = reference(engine, "a red fox", "", (64, 128), 3, 2.0, 4)
    assert np.abs(_uint8(got[0]) - _uint8(unmerged)).max() > 3  # the adapter counts



def test_graph_mode_captures_the_bucket_s_step_graphs(dit):
    """In graph mode (the CPU's emulated graphs, verified against eager at capture) the step graphs are the group
    key's, (0, 64), and rows of the three sizes replay them together; the decoder's are by image size; each image
    equals its reference."""
    from diffgraph import GraphConfig

    folder, families = dit
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=tuple(SIZES), prewarm=False, verify=True,
                      backend="emulated", capture_text_encoder=False)
    with Engine(model=folder, families=families, device="cpu", mode="graph", graphs=cfg) as graphed:
        assert graphed.runner.graphed_resolutions() == ((0, 64),)
        futures = []
        graphed.core.call_between_steps(lambda: futures.extend(
            graphed.submit(_request(graphed, r)) for r in REQUESTS)).result()
        got = [f.result(timeout=600).arrays[0] for f in futures]
        table = graphed.runner.graph_table()
    steps = [row for row in table if row["kind"] == "step" and row["replays"]]
    assert steps and {(row["height"], row["width"]) for row in steps} == {(0, 64)}, table
    assert all(row["verify_max_abs"] is not None and row["verify_max_abs"] < 1e-4 for row in steps)
    decodes = {(row["height"], row["width"]) for row in table if row["kind"] == "vae" and row["replays"]}
    assert decodes == set(SIZES), table  # the decoder's graphs are the images' sizes, after unpacking
    for r, image in zip(REQUESTS, got):
        want = reference(graphed, r["prompt"], r["negative_prompt"], r["size"], r["steps"], r["guidance"], r["seed"])
        assert np.abs(_uint8(image) - _uint8(want)).max() <= 1


def test_served_over_http_with_rows_sharing_steps(dit, engine):
    """(Last: the app closes the engine it serves.) The OpenAI route serves the family: three sizes of one bucket at once, each image its reference; a
    prompt_syntax it does not read is a 400 naming it; the AUTOMATIC1111 route reads the prompt as plain text with
    a warning."""
    import concurrent.futures
    import base64
    import io

    from diffgraph.server import ServerConfig

    with served(engine, ServerConfig(model=dit[0], device="cpu")) as client:
        def generate(r):
            return client.post("/v1/images/generations", json={
                "prompt": r["prompt"], "negative_prompt": r["negative_prompt"] or None,
                "size": f"{r['size'][1]}x{r['size'][0]}", "num_inference_steps": r["steps"],
                "guidance_scale": r["guidance"], "seed": r["seed"], "response_format": "b64_json"})
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(generate, REQUESTS))
        for r, answer in zip(REQUESTS, answers):
            assert answer.status_code == 200, answer.text
            image = np.array(Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"]))))
            want = reference(engine, r["prompt"], r["negative_prompt"], r["size"], r["steps"], r["guidance"],
                             r["seed"])
            assert image.shape == (*r["size"], 3)
            assert np.abs(image.astype(np.int16) - _uint8(want)).max() <= 1
        bad = client.post("/v1/images/generations", json={"prompt": "fox", "size": "64x64",
                                                          "prompt_syntax": "a1111"})
        assert bad.status_code == 400 and "prompt_syntax" in bad.text
        a1111 = client.post("/sdapi/v1/txt2img", json={"prompt": "(fox:1.2)", "width": 64, "height": 64,
                                                       "steps": 2, "sampler_name": "flow_euler"})
        assert a1111.status_code == 200, a1111.text
        assert "plain text" in json.dumps(a1111.json())
