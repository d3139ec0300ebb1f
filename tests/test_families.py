"""A second model family defined here, registered from the test, served without editing the engine.

`ToyFlowFamily` is a tiny flow-matching model (the shape of SD3 / Flux): its own conditioning (one pooled
vector per prompt, field "vec"), its own denoiser call (a velocity predictor that takes the guidance scale as an
input: embedded guidance, one branch, as Flux-dev), its own sampler names ("flow_euler") and size multiple (16, a 2x2
patched transformer over 8-pixel latent cells), its own schedule (sigmas from 1 to 0 with Flux's time shift, which
depends on the image's sequence length; x_next = x + (sigma_next - sigma) * v, written as per-row coefficients), its
own image-to-image noising ((1 - sigma) x0 + sigma * noise) and a VAE with a `shift_factor`. It is loaded from a
pipeline folder whose model_index.json names `ToyFlowPipeline`, through a registry that knows it, and generates
through Engine, the scheduler (batched with itself), CUDA-graph capture with verification (emulated) and the HTTP
server. The images are checked against a plain reference loop written below, so the engine cannot be running
anything else.
"""

import base64
import io
import json
import math
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from diffgraph import Engine, GenerationRequest, ParamError
from diffgraph.config import GraphConfig
from diffgraph.features.edit import EditRows
from diffgraph.features.embedded_guidance import EmbeddedGuidance
from diffgraph.models.families import FamilyAdapter, SDFamily, default_registry
from diffgraph.models.model import DiffusionModel
from diffgraph.models.tokenizer import preset_tokenizer
from diffgraph.sampling.names import SAMPLERS
from diffgraph.sampling.samplers import NUM_COEFS, Coef, SamplerPlan

VEC = 8
LATENT = 4
SCALE = 8  # pixels per latent cell
PATCH = 16  # pixels per token (2x2 latent cells): the family's size multiple
SCALING, SHIFT = 1.5, 0.25  # the toy VAE's scaling_factor and shift_factor
# Flux's time shift: mu linear in the token count between these two points, shift = exp(mu)
BASE_SEQ, MAX_SEQ, BASE_SHIFT, MAX_SHIFT = 16, 256, 0.5, 1.15


class ToyText(torch.nn.Module):
    """Token ids -> one vector per prompt (a squashed sum of token embeddings)."""

    def __init__(self, vocab: int, generator: torch.Generator):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, VEC, generator=generator))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.table[ids].sum(dim=1) / 8)


class ToyVelocity(torch.nn.Module):
    """v(x, t, vec, guidance): a 1x1 mix of the latent, a time gain and the conditioning vector per channel, scaled
    by the embedded guidance."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.mix = torch.nn.Parameter(torch.randn(LATENT, LATENT, generator=generator) * 0.3)
        self.cond = torch.nn.Parameter(torch.randn(VEC, LATENT, generator=generator))

    def forward(self, x: torch.Tensor, t: torch.Tensor, vec: torch.Tensor, guidance: torch.Tensor) -> torch.Tensor:
        mixed = torch.einsum("bchw,cd->bdhw", x, self.mix)
        target = (vec @ self.cond)[:, :, None, None] * (1 + 0.25 * guidance.view(-1, 1, 1, 1))
        return mixed * (t / 1000.0).view(-1, 1, 1, 1) + target - x


class ToyVAE(torch.nn.Module):
    """A VAE in diffusers' calling convention: 8x8 average pooling (mean, a fixed log variance) and tanh of nearest
    upsampling; `config` carries scaling_factor and shift_factor (SD3 / Flux VAEs have both)."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.tensor(1.2))
        self.config = SimpleNamespace(scaling_factor=SCALING, shift_factor=SHIFT)

    def encode(self, pixels: torch.Tensor, return_dict: bool = False):
        mean3 = torch.nn.functional.avg_pool2d(pixels, SCALE) / self.gain
        mean = torch.cat([mean3, mean3.mean(dim=1, keepdim=True)], dim=1)
        return (SimpleNamespace(parameters=torch.cat([mean, torch.full_like(mean, -6.0)], dim=1)),)

    def decode(self, latents: torch.Tensor, return_dict: bool = False):
        rgb = torch.tanh(latents[:, :3] * self.gain)
        return (rgb.repeat_interleave(SCALE, dim=2).repeat_interleave(SCALE, dim=3),)


def time_shift(key: tuple[int, int]) -> float:
    """Flux's shift for an image of (height, width): exp(mu), mu linear in its token count."""
    seq = (key[0] // PATCH) * (key[1] // PATCH)
    return math.exp(BASE_SHIFT + (MAX_SHIFT - BASE_SHIFT) * (seq - BASE_SEQ) / (MAX_SEQ - BASE_SEQ))


def flow_sigmas(steps: int, key: tuple[int, int]) -> np.ndarray:
    """sigma' = shift * sigma / (1 + (shift - 1) * sigma) over sigma from 1 to 0."""
    s, shift = np.linspace(1.0, 0.0, steps + 1), time_shift(key)
    return shift * s / (1 + (shift - 1) * s)


def flow_plan(sampler: str, schedule: str, steps: int, key: tuple[int, int]) -> SamplerPlan:
    """Euler on the flow-matching line x_sigma = (1 - sigma) x0 + sigma * noise, over the shifted sigmas."""
    sigmas = flow_sigmas(steps, key)
    coefs = np.zeros((steps, NUM_COEFS))
    for i in range(steps):
        s, s_next = sigmas[i], sigmas[i + 1]
        coefs[i, Coef.C_IN] = 1.0
        coefs[i, Coef.T] = s * 1000.0
        coefs[i, Coef.P], coefs[i, Coef.Q] = 1.0, -s            # D = x - sigma * v
        coefs[i, Coef.A], coefs[i, Coef.B] = s_next / s, 1 - s_next / s  # = x + (s_next - s) * v
        coefs[i, Coef.KNOWN], coefs[i, Coef.KNOWN_NOISE] = 1 - s_next, s_next  # the known region, next state
    return SamplerPlan(sampler, schedule, steps, coefs, 1.0, False, coefs[:, Coef.T].copy(), sigmas,
                       noise_steps=np.zeros(steps, bool), step_index=np.arange(steps), ve=False, steps=steps)


class ToyFlowFamily(FamilyAdapter):
    name = "toyflow"
    pipeline_classes = ("ToyFlowPipeline",)
    default_guidance = 3.0
    samplers = ("flow_euler",)
    schedules = ("default",)
    default_sampler = "flow_euler"
    default_schedule = "default"
    size_multiple = PATCH
    supports_edits = True
    plan_options = False  # its planner takes no timestep spacing or eta

    def load_folder(self, folder, index, device, dtype, name):
        g = torch.Generator().manual_seed(int(index["seed"]))
        tokenizer = preset_tokenizer()
        model = DiffusionModel(name=name, family=self.name, adapter=self, denoiser=ToyVelocity(g),
                               vae=ToyVAE(), text_encoders=[ToyText(len(tokenizer), g)], tokenizers=[tokenizer],
                               scheduler_config={}, device=device, dtype=dtype, native_size=64)
        return model

    def vae_scale_factor(self, model):
        return SCALE

    def latent_channels(self, model):
        return LATENT

    def extra_channels(self, model):
        return 0

    def planner(self, model):
        def plan(sampler, schedule, steps, key):
            self.check(sampler, schedule, key)
            return flow_plan(sampler, schedule, steps, key)
        return plan

    def noising(self, plan):
        s = float(plan.sigmas[0])
        return 1.0 - s, s

    def features(self, model, side_paths=None, **_):
        # embedded guidance instead of classifier-free guidance: one denoiser branch, the scale as an input
        guidance = EmbeddedGuidance("guidance", (1,), model.dtype, lambda g: torch.tensor([float(g)]))
        return (guidance, EditRows(0, model.dtype))

    def cond_spec(self, model):
        return {"vec": ((VEC,), model.dtype)}

    def encode_ids(self, model, ids):
        with torch.no_grad():
            return {"vec": model.text_encoders[0](ids[0]).to(model.dtype)}

    def denoise(self, model, x, t, cond, rows):
        return model.denoiser(x, t, cond["vec"], rows["guidance"])


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toyflow")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "ToyFlowPipeline", "seed": 7}))
    families = default_registry()
    families.register(ToyFlowFamily())
    return str(folder), families


@pytest.fixture(scope="module")
def engine(toy):
    folder, families = toy
    with Engine(model=folder, families=families, device="cpu") as e:
        yield e


def _source(seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((64, 64, 3)) * 255).astype(np.uint8))


def reference(engine: Engine, prompt: str, steps: int, guidance: float, seed: int, key=(64, 64),
              image: Image.Image | None = None, strength: float = 0.6, shifted: bool = True,
              flow_noising: bool = True) -> np.ndarray:
    """The toy model's sampling loop written out plainly (embedded guidance, flow Euler on the shifted sigmas; an
    image's latents noised the flow way), from the same seeded draws, decoded with the VAE's scale and shift."""
    m = engine.model
    h, w = key[0] // SCALE, key[1] // SCALE
    gen = torch.Generator().manual_seed(seed)
    s = np.linspace(1.0, 0.0, steps + 1)
    if shifted:
        mu = BASE_SHIFT + (MAX_SHIFT - BASE_SHIFT) * ((key[0] // 16) * (key[1] // 16) - 16) / (256 - 16)
        s = math.exp(mu) * s / (1 + (math.exp(mu) - 1) * s)
    start = 0
    with torch.no_grad():
        if image is None:
            x = torch.randn((1, LATENT, h, w), generator=gen, dtype=m.dtype).float()
        else:  # diffusers' order: the image posterior's draw, then the noise
            pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float() / 255 * 2 - 1
            mean, logvar = m.vae.encode(pixels)[0].parameters.chunk(2, dim=1)
            latent = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=gen)
            x0 = (latent - SHIFT) * SCALING
            noise = torch.randn((1, LATENT, h, w), generator=gen, dtype=m.dtype).float()
            start = steps - int(steps * strength)
            k, e = (1 - s[start], s[start]) if flow_noising else (1.0, s[start])
            x = k * x0 + e * noise
        ids = m.tokenizers[0]([prompt], padding="max_length", max_length=77, truncation=True,
                              return_tensors="pt").input_ids
        vec = m.text_encoders[0](ids)
        g = torch.tensor([[guidance]])
        for s_now, s_next in zip(s[start:-1], s[start + 1:]):
            v = m.denoiser(x, torch.tensor([s_now * 1000.0], dtype=torch.float32), vec, g)
            x = x + (s_next - s_now) * v
        rgb = m.vae.decode(x / SCALING + SHIFT)[0] * 0.5 + 0.5
    return rgb.clamp(0, 1).permute(0, 2, 3, 1).numpy()


def test_a_registered_family_generates_through_the_engine(engine):
    assert engine.model.family == "toyflow" and engine.info.default_guidance == 3.0
    result = engine.generate("a red cat", num_inference_steps=6, seed=3)  # its default sampler: flow_euler
    assert result.request.sampler == "flow_euler"
    assert result.arrays.shape == (1, 64, 64, 3)
    np.testing.assert_allclose(result.arrays, reference(engine, "a red cat", 6, 3.0, 3), atol=1e-5, rtol=0)
    other = engine.generate("a blue dog", num_inference_steps=6, seed=3)
    assert np.abs(other.arrays - result.arrays).max() > 0.05  # the conditioning reaches the image
    # batched by the scheduler with each other, each with its own guidance: each equals its reference
    cases = (("a red cat", 6, 3, 3.0), ("a blue dog", 4, 5, 1.0), ("a tree", 9, 1, 6.5))
    futures = [engine.submit(engine.make_request(p, num_inference_steps=n, seed=s, guidance_scale=g))
               for p, n, s, g in cases]
    together = [f.result().arrays for f in futures]
    np.testing.assert_allclose(together[0], result.arrays, atol=1e-6, rtol=0)
    for (p, n, s, g), arrays in zip(cases[1:], together[1:]):
        np.testing.assert_allclose(arrays, reference(engine, p, n, g, s), atol=1e-5, rtol=0)


def test_embedded_guidance_is_one_branch_fed_to_the_denoiser(engine):
    request = engine.make_request("a red cat", num_inference_steps=5, seed=2, guidance_scale=7.0)
    plan = engine.runner.request_plan(request)
    assert engine.runner.program.alt is None  # no classifier-free guidance feature at all
    assert engine.runner.program.branches(request, plan.step_index).tolist() == [1] * 5  # one denoiser row per image row
    strong, weak = engine.run(request).arrays, engine.generate("a red cat", num_inference_steps=5, seed=2,
                                                                guidance_scale=1.0).arrays
    np.testing.assert_allclose(strong, reference(engine, "a red cat", 5, 7.0, 2), atol=1e-5, rtol=0)
    assert np.abs(strong - weak).max() > 0.02  # the value reaches the denoiser


def test_sampler_names_belong_to_the_family(engine, tiny_engine):
    assert engine.info.samplers == ("flow_euler",) and engine.info.schedules == ("default",)
    assert (engine.info.default_sampler, engine.info.default_schedule) == ("flow_euler", "default")
    with pytest.raises(ParamError, match=r"sampler 'dpmpp_2m' is unknown; allowed: flow_euler \(the samplers of "
                                         r"model family 'toyflow'\)") as e:
        engine.make_request("a cat", sampler="dpmpp_2m")
    assert e.value.param == "sampler"
    with pytest.raises(ParamError, match=r"^sampler 'DDIM CFG\+\+' \(ddim_cfgpp\) is DDIM on the SD noise schedule, "
                                         r"which this model's family does not walk; use one of flow_euler$") as e:
        engine.make_request("a cat", sampler="DDIM CFG++")
    assert e.value.param == "sampler"
    with pytest.raises(ParamError, match="schedule 'karras' is unknown; allowed: default") as e:
        engine.make_request("a cat", schedule="karras")
    assert e.value.param == "schedule"
    # SD's names are SD's: the toy's sampler is refused there, naming SD's samplers
    assert tiny_engine.make_request("a cat", num_inference_steps=2).sampler == "euler"  # SD's default, as before
    with pytest.raises(ParamError, match=re.escape(f"sampler 'flow_euler' is unknown; allowed: {', '.join(SAMPLERS)} "
                                                   "(the samplers of model family 'sd')")) as e:
        tiny_engine.make_request("a cat", sampler="flow_euler")
    assert e.value.param == "sampler"
    with pytest.raises(ParamError, match=re.escape(f"allowed: {', '.join(SAMPLERS)}")):
        SDFamily().check("flow_euler", "default", (64, 64))
    # a request built without the model is checked where its plan is made (the engine core's submit)
    bare = dict(prompt="a cat", negative_prompt=None, width=64, height=64, num_inference_steps=4, guidance_scale=3.0,
                schedule="default", seed=1, num_images=1)
    with pytest.raises(ParamError, match="allowed: flow_euler") as e:
        engine.submit(GenerationRequest(sampler="euler", **bare))
    assert e.value.param == "sampler"
    with pytest.raises(ParamError, match="width 72 is not a multiple of 16") as e:
        engine.submit(GenerationRequest(sampler="flow_euler", **{**bare, "width": 72}))
    assert e.value.param == "width"


def test_sizes_are_multiples_of_the_family_s(engine):
    with pytest.raises(ParamError, match=r"width 72 is not a multiple of 16; use 64 or 80"):
        engine.make_request("a cat", width=72, height=72)
    with pytest.raises(ParamError, match="height 88 is not a multiple of 16") as e:
        engine.make_request("a cat", width=64, height=88)
    assert e.value.param == "height"
    assert engine.info.size_multiple == 16 and engine.make_request("a cat", width=80, height=96).key == (96, 80)


def test_the_plan_shifts_with_the_resolution(engine):
    small, large = (engine.runner.plan_for("flow_euler", "default", 8, k) for k in ((64, 64), (128, 128)))
    mid = np.linspace(1, 0, 9)[4]
    for plan, tokens in ((small, 16), (large, 64)):
        shift = math.exp(0.5 + 0.65 * (tokens - 16) / 240)
        assert plan.sigmas[4] == pytest.approx(shift * mid / (1 + (shift - 1) * mid), abs=1e-12)
    assert large.sigmas[4] > small.sigmas[4] + 0.01  # more tokens: more time at high noise
    result = engine.generate("a red cat", width=128, height=96, num_inference_steps=6, seed=3)
    np.testing.assert_allclose(result.arrays, reference(engine, "a red cat", 6, 3.0, 3, key=(96, 128)), atol=1e-5,
                               rtol=0)
    unshifted = reference(engine, "a red cat", 6, 3.0, 3, key=(96, 128), shifted=False)
    assert np.abs(result.arrays - unshifted).max() > 1e-3  # the check above would see a missing shift


def test_the_vae_shift_factor_is_honoured():
    vae = SimpleNamespace(config=SimpleNamespace(scaling_factor=2.0, shift_factor=0.5))
    model = SimpleNamespace(dtype=torch.float32)
    sample = torch.tensor([[[[1.0]]]])
    assert SDFamily().image_latents(model, vae, sample).item() == (1.0 - 0.5) * 2.0
    vae.decode = lambda latents, return_dict=False: (latents,)
    assert SDFamily().decode(model, vae, torch.tensor([[[[0.4]]]])).item() == pytest.approx((0.4 / 2 + 0.5) / 2 + 0.5)
    vae.config.shift_factor = None  # an SD VAE's config: no shift
    assert SDFamily().image_latents(model, vae, sample).item() == 2.0


def test_verify_captures_every_graph_of_the_family(toy):
    folder, families = toy
    cfg = GraphConfig(batch_buckets=(1, 2), resolutions=((64, 64),), backend="emulated", verify=True)
    with Engine(model=folder, families=families, device="cpu", mode="graph", graphs=cfg) as engine:
        table = engine.graph_table()
        assert {r["kind"] for r in table} >= {"step", "text", "vae", "vae_encode"}
        for row in table:
            assert row["status"] == "captured" and row["verify_max_abs"] == 0.0, row
        result = engine.generate("a red cat", num_inference_steps=6, seed=3)
        np.testing.assert_allclose(result.arrays, reference(engine, "a red cat", 6, 3.0, 3), atol=1e-5, rtol=0)
        assert any(r["kind"] == "step" and r["replays"] > 0 for r in engine.graph_table())


def test_the_default_registry_does_not_know_it(toy):
    folder, _ = toy
    with pytest.raises(ValueError, match="holds a ToyFlowPipeline, which is not supported"):
        Engine(model=folder, device="cpu")


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _image(response) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))).astype(int)


def _uint8(pixels: np.ndarray) -> np.ndarray:
    return (pixels[0] * 255).round().astype(int)


def test_a_registered_family_serves_http(toy, engine):
    from fastapi.testclient import TestClient

    from diffgraph.server import ServerConfig, create_app

    folder, families = toy
    app = create_app(ServerConfig(model=folder, device="cpu"),
                     engine_factory=lambda: Engine(model=folder, families=families, device="cpu"))
    with TestClient(app) as client:
        for _ in range(600):  # the engine is built on a background thread; it is tiny
            if client.get("/ready").status_code == 200:
                break
            time.sleep(0.05)
        assert client.get("/ready").json()["model"] == folder
        info = client.get("/info").json()
        assert (info["samplers"], info["schedules"], info["default_sampler"], info["size_multiple"]) == (
            ["flow_euler"], ["default"], "flow_euler", 16)
        body = {"prompt": "a red cat", "num_inference_steps": 6, "seed": 3}  # the family's sampler by default
        r = client.post("/v1/images/generations", json=body)
        assert r.status_code == 200, r.text
        image = _image(r)
        assert image.shape == (64, 64, 3)
        assert np.abs(image - _uint8(reference(engine, "a red cat", 6, 3.0, 3))).max() <= 1
        bad = client.post("/v1/images/generations", json={"prompt": "a cat", "sampler": "ddim"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampler"
        assert "allowed: flow_euler" in bad.json()["error"]["message"]
        bad = client.post("/v1/images/generations", json={**body, "size": "72x72"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "size"
        assert "not a multiple of 16; use 64 or 80" in bad.json()["error"]["message"]
        # image-to-image, noised the flow way: (1 - sigma) x0 + sigma * noise at the strength's first step
        src = _source()
        r = client.post("/v1/images/edits", files={"image": ("f.png", _png(src), "image/png")},
                        data={"prompt": "a red cat", "num_inference_steps": "6", "seed": "4", "strength": "0.6"})
        assert r.status_code == 200, r.text
        edited = _image(r)
        expected = _uint8(reference(engine, "a red cat", 6, 3.0, 4, image=src, strength=0.6))
        assert np.abs(edited - expected).max() <= 1
        sd_noised = _uint8(reference(engine, "a red cat", 6, 3.0, 4, image=src, strength=0.6, flow_noising=False))
        assert np.abs(edited - sd_noised).max() > 3  # SD's noising (x0 + sigma * noise) would show
        assert np.abs(edited - _uint8(reference(engine, "a red cat", 6, 3.0, 4))).max() > 3  # the image counts
