"""A second model family defined here, registered from the test, served without editing the engine.

`ToyFlowFamily` is a tiny flow-matching model (the shape of SD3 / Flux): its own conditioning (one pooled
vector per prompt, field "vec"), its own denoiser call (a velocity predictor), its own schedule (sigmas from 1
to 0, x_next = x + (sigma_next - sigma) * v, written as per-row coefficients), its own decode (no VAE). It is
loaded from a pipeline folder whose model_index.json names `ToyFlowPipeline`, through a registry that knows
it, and generates through Engine, the scheduler (batched with itself) and the HTTP server. The images are
checked against a plain reference loop written below, so the engine cannot be running anything else.
"""

import base64
import io
import json
import time

import numpy as np
import pytest
import torch
from PIL import Image

from diffgraph import Engine, ParamError
from diffgraph.models.families import FamilyAdapter, default_registry
from diffgraph.models.model import DiffusionModel
from diffgraph.models.tokenizer import preset_tokenizer
from diffgraph.sampling.samplers import NUM_COEFS, Coef, SamplerPlan

VEC = 8
LATENT = 4
SCALE = 8  # pixels per latent cell


class ToyText(torch.nn.Module):
    """Token ids -> one vector per prompt (a squashed sum of token embeddings)."""

    def __init__(self, vocab: int, generator: torch.Generator):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, VEC, generator=generator))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.table[ids].sum(dim=1) / 8)


class ToyVelocity(torch.nn.Module):
    """v(x, t, vec): a 1x1 mix of the latent, a time gain and the conditioning vector per channel."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.mix = torch.nn.Parameter(torch.randn(LATENT, LATENT, generator=generator) * 0.3)
        self.cond = torch.nn.Parameter(torch.randn(VEC, LATENT, generator=generator))

    def forward(self, x: torch.Tensor, t: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        mixed = torch.einsum("bchw,cd->bdhw", x, self.mix)
        target = (vec @ self.cond)[:, :, None, None]
        return mixed * (t / 1000.0).view(-1, 1, 1, 1) + target - x


def flow_plan(sampler: str, schedule: str, steps: int, key: tuple[int, int] = (64, 64)) -> SamplerPlan:
    """Euler on the flow-matching line x_sigma = (1 - sigma) x0 + sigma * noise, sigma from 1 to 0."""
    if sampler != "euler" or schedule != "default":
        raise ParamError("sampler", f"sampler {sampler!r} with schedule {schedule!r} is not available for the toy "
                                    "flow family; use euler with the default schedule")
    sigmas = np.linspace(1.0, 0.0, steps + 1)
    coefs = np.zeros((steps, NUM_COEFS))
    for i in range(steps):
        s, s_next = sigmas[i], sigmas[i + 1]
        coefs[i, Coef.C_IN] = 1.0
        coefs[i, Coef.T] = s * 1000.0
        coefs[i, Coef.P], coefs[i, Coef.Q] = 1.0, -s            # D = x - sigma * v
        coefs[i, Coef.A], coefs[i, Coef.B] = s_next / s, 1 - s_next / s  # = x + (s_next - s) * v
    return SamplerPlan(sampler, schedule, steps, coefs, 1.0, False, coefs[:, Coef.T].copy(), sigmas)


class ToyFlowFamily(FamilyAdapter):
    name = "toyflow"
    pipeline_classes = ("ToyFlowPipeline",)
    default_guidance = 3.0

    def load_folder(self, folder, index, device, dtype, name):
        g = torch.Generator().manual_seed(int(index["seed"]))
        tokenizer = preset_tokenizer()
        model = DiffusionModel(name=name, family=self.name, adapter=self, unet=ToyVelocity(g),
                               vae=None, text_encoders=[ToyText(len(tokenizer), g)], tokenizers=[tokenizer],
                               scheduler_config={}, device=device, dtype=dtype, native_size=64)
        return model

    def vae_scale_factor(self, model):
        return SCALE

    def latent_channels(self, model):
        return LATENT

    def planner(self, model):
        return flow_plan

    def cond_spec(self, model):
        return {"vec": ((VEC,), model.dtype)}

    def encode_ids(self, model, ids):
        with torch.no_grad():
            return {"vec": model.text_encoders[0](ids[0]).to(model.dtype)}

    def denoise(self, model, x, t, cond, rows):
        return model.unet(x, t, cond["vec"])

    def decoder(self, model):
        return None

    def decode(self, model, decoder, latents):
        rgb = torch.sigmoid(latents[:, :3].float())
        return rgb.repeat_interleave(SCALE, dim=2).repeat_interleave(SCALE, dim=3)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toyflow")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "ToyFlowPipeline", "seed": 7}))
    families = default_registry()
    families.register(ToyFlowFamily())
    return str(folder), families


def reference(engine: Engine, prompt: str, negative: str, steps: int, guidance: float, seed: int) -> np.ndarray:
    """The toy model's sampling loop written out plainly (CFG, flow Euler), from the same seeded noise."""
    m = engine.model
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((1, LATENT, 8, 8), generator=gen, dtype=m.dtype).float()
    ids = [m.tokenizers[0]([p], padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
           for p in (prompt, negative)]
    with torch.no_grad():
        vec, neg = (m.text_encoders[0](i) for i in ids)
        sigmas = np.linspace(1.0, 0.0, steps + 1)
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            t = torch.tensor([s * 1000.0], dtype=torch.float32)
            v_c, v_u = m.unet(x, t, vec), m.unet(x, t, neg)
            v = v_u + guidance * (v_c - v_u)
            x = x + (s_next - s) * v
    pixels = torch.sigmoid(x[:, :3]).repeat_interleave(SCALE, 2).repeat_interleave(SCALE, 3)
    return pixels.permute(0, 2, 3, 1).numpy()


def test_a_registered_family_generates_through_the_engine(toy):
    folder, families = toy
    with Engine(model=folder, families=families, device="cpu") as engine:
        assert engine.model.family == "toyflow" and engine.info.default_guidance == 3.0
        result = engine.generate("a red cat", negative_prompt="blurry", num_inference_steps=6, seed=3)
        expected = reference(engine, "a red cat", "blurry", 6, 3.0, 3)
        assert result.arrays.shape == (1, 64, 64, 3)
        np.testing.assert_allclose(result.arrays, expected, atol=1e-5, rtol=0)
        other = engine.generate("a blue dog", negative_prompt="blurry", num_inference_steps=6, seed=3)
        assert np.abs(other.arrays - result.arrays).max() > 0.05  # the conditioning reaches the image
        # batched by the scheduler with each other: each equals its solo run
        futures = [engine.submit(engine.make_request(p, negative_prompt="blurry", num_inference_steps=n, seed=s))
                   for p, n, s in (("a red cat", 6, 3), ("a blue dog", 4, 5), ("a tree", 9, 1))]
        together = [f.result().arrays for f in futures]
        np.testing.assert_allclose(together[0], result.arrays, atol=1e-6, rtol=0)
        np.testing.assert_allclose(together[1], reference(engine, "a blue dog", "blurry", 4, 3.0, 5), atol=1e-5, rtol=0)
        np.testing.assert_allclose(together[2], reference(engine, "a tree", "blurry", 9, 3.0, 1), atol=1e-5, rtol=0)
        with pytest.raises(ParamError, match="not available for the toy flow family") as e:
            engine.make_request("a cat", sampler="dpmpp_2m")
        assert e.value.param == "sampler"
        # a family without edits (supports_edits False by default) refuses an image, naming the parameter
        assert not engine.info.edits
        with pytest.raises(ParamError, match="takes no image inputs") as e:
            engine.make_request("a cat", image=np.zeros((64, 64, 3), np.uint8))
        assert e.value.param == "image"


def test_the_default_registry_does_not_know_it(toy):
    folder, _ = toy
    with pytest.raises(ValueError, match="holds a ToyFlowPipeline, which is not supported"):
        Engine(model=folder, device="cpu")


def test_a_registered_family_serves_http(toy):
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
        r = client.post("/v1/images/generations", json={"prompt": "a red cat", "negative_prompt": "blurry",
                                                        "num_inference_steps": 6, "seed": 3})
        assert r.status_code == 200, r.text
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
        engine = Engine(model=folder, families=families, device="cpu")
        expected = (reference(engine, "a red cat", "blurry", 6, 3.0, 3)[0] * 255).round().astype(np.uint8)
        engine.close()
        assert image.shape == (64, 64, 3) and np.abs(image.astype(int) - expected).max() <= 1
        bad = client.post("/v1/images/generations", json={"prompt": "a cat", "sampler": "ddim"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampler"
