"""Trains the shipped `digits` (SD1.5 family) and `digits-xl` (SDXL family) presets from a seed.

Data: scikit-learn's bundled handwritten digits (1797 8x8 images), upscaled to 64x64 RGB, white digit
on black, with light random affine augmentation. Captions vary ("a handwritten digit seven",
"the number 7", "7", ...).

Stage 1 trains the AutoencoderKL (8x downsampling, 4x8x8 latents) on reconstruction + a small KL, and
sets its scaling_factor to 1/std of the latents. Stage 2 freezes it and trains the UNet and the text
encoder(s) jointly with epsilon-prediction MSE on the SD scaled_linear DDPM schedule (min-SNR-5
weighting, Hang et al. 2023), with caption dropout for classifier-free guidance: to "" for SD1.5, to
zero embeddings and zero pooled for SDXL (what StableDiffusionXLPipeline feeds the unconditional
branch when negative_prompt is None, force_zeros_for_empty_prompt=True). Both stages run for a fixed
number of steps (so a seed reproduces a model); a wall-time budget per stage is only a safety cap for
slow machines: if it ends a stage first, the learning-rate schedule follows whichever is further
along, so the cosine decay still finishes, and training.json says `stopped_by: time`.

The result is a diffusers folder per model (save_pretrained, fp16 safetensors) with a training.json.

    python tools/train_digits.py --model both --device cuda --out src/diffgraph/assets
    python tools/train_digits.py --model both --device cpu --max-steps 20 --vae-batch 8 --unet-batch 32 \
        --aug-copies 1 --out /tmp/digits-smoke      # CPU smoke test, about a minute

On an H200 each model takes about 4 minutes (see training.json); the two can run as two processes
side by side on one GPU, since models this small leave it mostly idle (the shipped assets were made
that way, about 10 UNet steps/s each).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from diffgraph.models import tokenizer as tok  # noqa: E402
from diffgraph.models.digits_oracle import augment, upscale  # noqa: E402,F401  (the oracle's own image pipeline)

SIZE = 64
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# {w}: the digit as a word, {d}: as a numeral. Tested prompts use the first two forms.
TEMPLATES = (
    "a handwritten digit {w}", "the number {d}", "{d}", "a handwritten digit {d}", "the number {w}",
    "{w}", "handwritten {w}", "the digit {d}", "digit {w}", "number {d}", "a drawing of the number {w}",
    "a {w}", "a picture of a handwritten {d}", "written {w}", "the handwritten number {d}",
)
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                        prediction_type="epsilon", timestep_spacing="leading", steps_offset=1)
SDXL_TIME_IDS = (SIZE, SIZE, 0, 0, SIZE, SIZE)  # original size, crop top-left, target size

VAE_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=4, sample_size=SIZE,
    block_out_channels=(32, 64, 64, 64), layers_per_block=1, norm_num_groups=16,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)
ARCH = {
    "digits": dict(
        unet=dict(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(64, 96),
            norm_num_groups=16, cross_attention_dim=64, attention_head_dim=4,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        ),
        text_encoders=(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            hidden_act="quick_gelu"),),
        pads=(tok.EOS,),
        vae_extra=dict(),
    ),
    "digits-xl": dict(
        unet=dict(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(64, 96),
            norm_num_groups=16, cross_attention_dim=96, attention_head_dim=(2, 4),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 1), use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=16,
            projection_class_embeddings_input_dim=48 + 6 * 16,
        ),
        # SDXL reads the penultimate hidden state of both encoders (3 layers, so 2 of them count) and
        # the projected pooled output of the second.
        text_encoders=(dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                            hidden_act="quick_gelu"),
                       dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                            hidden_act="gelu", projection_dim=48)),
        pads=(tok.EOS, "!"),
        vae_extra=dict(force_upcast=True),
    ),
}


def log(msg: str) -> None:
    print(f"[train_digits] {msg}", flush=True)


# -- data ----------------------------------------------------------------------------------------
def load_digits_arrays(path: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(images [N, 8, 8] float in 0..16, labels [N]) from an .npz (keys images, target) or sklearn."""
    if path:
        data = np.load(path)
        return data["images"].astype(np.float32), data["target"].astype(np.int64)
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.float32), d.target.astype(np.int64)


def to_rgb(x01: torch.Tensor) -> torch.Tensor:
    """[N, 1, H, W] in 0..1 -> [N, 3, H, W] in -1..1, the VAE's pixel range."""
    return (x01 * 2 - 1).expand(-1, 3, -1, -1)


def caption(template: int, digit: int) -> str:
    return TEMPLATES[template].format(w=WORDS[digit], d=digit)


# -- schedules -----------------------------------------------------------------------------------
class Progress:
    """Fraction done of a stage that ends at max_steps or after budget_s seconds, whichever first."""

    def __init__(self, max_steps: int, budget_s: float):
        self.max_steps, self.budget_s, self.t0 = max_steps, budget_s, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def frac(self, step: int) -> float:
        return max(step / self.max_steps, self.elapsed() / self.budget_s if self.budget_s > 0 else 0.0)

    def stopped_by(self, step: int) -> str:
        return "steps" if step >= self.max_steps else "time"


def lr_at(frac: float, peak: float, warmup: float = 0.03) -> float:
    if frac < warmup:
        return peak * frac / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - warmup) / (1 - warmup))))


def set_lr(opt: torch.optim.Optimizer, frac: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr_at(frac, group["peak_lr"])


def alphas_cumprod() -> torch.Tensor:
    betas = torch.linspace(SCHEDULER_CONFIG["beta_start"] ** 0.5, SCHEDULER_CONFIG["beta_end"] ** 0.5,
                           SCHEDULER_CONFIG["num_train_timesteps"], dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, 0).float()


def step_with_ema(opt: torch.optim.Optimizer, loss: torch.Tensor, params: list, ema: list, step: int,
                  ema_max: float) -> None:
    """One optimiser step on `loss` (gradients clipped to norm 1), then `ema` (copies of `params`) moved towards them
    with a decay warming up as (1 + step) / (10 + step) to `ema_max`."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    decay = min(ema_max, (1 + step) / (10 + step))
    with torch.no_grad():
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)


@torch.no_grad()
def finish_ema(params: list, ema: list, recent: list, prog: Progress, step: int) -> dict:
    """Copies `ema` into `params`; the stage's record (steps, mean loss of the last 100, wall time, what ended it)."""
    for p, e in zip(params, ema):
        p.copy_(e)
    return dict(steps=step, final_loss=torch.stack(recent[-100:]).mean().item(), wall_s=prog.elapsed(),
                stopped_by=prog.stopped_by(step))


# -- stage 1: VAE --------------------------------------------------------------------------------
def train_vae(images: torch.Tensor, args, device: torch.device, gen: torch.Generator, extra: dict) -> tuple:
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(**{**VAE_CONFIG, **extra}).to(device)  # extra may override (digits-zimage's 16 channels)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0, fused=device.type == "cuda")
    for g in opt.param_groups:
        g["peak_lr"] = args.vae_lr
    prog = Progress(args.vae_steps if args.max_steps is None else args.max_steps, args.vae_budget)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    step, recent = 0, []
    vae.train()
    while prog.frac(step) < 1:
        set_lr(opt, prog.frac(step))
        idx = torch.randint(0, images.shape[0], (args.vae_batch,), generator=gen, device=device)
        x = to_rgb(augment(images[idx], gen))
        with amp:
            post = vae.encode(x).latent_dist
            z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen, device=device)
            rec = vae.decode(z).sample.float()
        rec_loss = F.mse_loss(rec, x) + F.l1_loss(rec, x)
        kl = 0.5 * (post.mean.float() ** 2 + post.var.float() - 1 - post.logvar.float()).mean()
        loss = rec_loss + args.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        recent.append(rec_loss.detach())
        step += 1
        if step % 200 == 0 or step == 1:
            log(f"vae step {step} rec {rec_loss.item():.4f} kl {kl.item():.3f} t {prog.elapsed():.0f}s")
    final = torch.stack(recent[-50:]).mean().item()
    info = dict(steps=step, final_reconstruction_loss=final, wall_s=prog.elapsed(), stopped_by=prog.stopped_by(step))
    log(f"vae done: {info}")
    return vae.eval().requires_grad_(False), info


@torch.no_grad()
def encode_bank(vae, images: torch.Tensor, labels: torch.Tensor, copies: int, gen: torch.Generator):
    """Latent means of `copies` augmented versions of every image (the first copy unaugmented)."""
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=images.device.type == "cuda")
    latents, ys = [], []
    for c in range(copies):
        for i in range(0, images.shape[0], 1024):
            x = images[i:i + 1024]
            x = x if c == 0 else augment(x, gen)
            with amp:
                latents.append(vae.encode(to_rgb(x)).latent_dist.mean.float())
            ys.append(labels[i:i + 1024])
    return torch.cat(latents), torch.cat(ys)


# -- stage 2: UNet + text encoders ---------------------------------------------------------------
def build_text(kind: str, device: torch.device):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    bos, eos = tok.special_ids()
    encoders, tokenizers = [], []
    for cfg, pad in zip(ARCH[kind]["text_encoders"], ARCH[kind]["pads"]):
        config = CLIPTextConfig(vocab_size=tok.vocab_size(), max_position_embeddings=77, bos_token_id=bos,
                                eos_token_id=eos, pad_token_id=eos, **cfg)
        cls = CLIPTextModelWithProjection if "projection_dim" in cfg else CLIPTextModel
        encoders.append(cls(config).to(device))
        folder = tempfile.mkdtemp(prefix="digits-tok-")
        tok.write_tokenizer(folder, pad)
        tokenizers.append(CLIPTokenizer.from_pretrained(folder, local_files_only=True))
    return encoders, tokenizers


def token_table(tokenizer, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [templates, 10, 77] of every caption, and [77] of the empty prompt."""
    def ids(texts):
        return tokenizer(texts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                         return_tensors="pt").input_ids
    table = torch.stack([ids([caption(t, d) for d in range(10)]) for t in range(len(TEMPLATES))])
    return table.to(device), ids([""])[0].to(device)


def encode_text(kind: str, encoders, ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt embeddings exactly as StableDiffusion(XL)Pipeline.encode_prompt computes them."""
    if kind == "digits":
        return encoders[0](ids[0])[0], None
    embeds, pooled = [], None
    for enc, x in zip(encoders, ids):
        out = enc(x, output_hidden_states=True)
        if out[0].ndim == 2:
            pooled = out[0]
        embeds.append(out.hidden_states[-2])
    return torch.cat(embeds, -1), pooled


def train_unet(kind: str, latents: torch.Tensor, labels: torch.Tensor, args, device: torch.device,
               gen: torch.Generator) -> tuple:
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(**ARCH[kind]["unet"]).to(device)
    encoders, tokenizers = build_text(kind, device)
    tables = [token_table(t, device) for t in tokenizers]
    modules = [unet, *encoders]
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW([
        dict(params=list(unet.parameters()), peak_lr=args.unet_lr),
        dict(params=[p for e in encoders for p in e.parameters()], peak_lr=args.text_lr),
    ], lr=args.unet_lr, weight_decay=1e-2, fused=device.type == "cuda")
    ema = [p.detach().clone() for p in params]
    acp = alphas_cumprod().to(device)
    snr = acp / (1 - acp)
    weight = torch.clamp(snr, max=5.0) / snr  # min-SNR-5 for epsilon prediction
    time_ids = torch.tensor([SDXL_TIME_IDS], dtype=torch.float32, device=device)
    prog = Progress(args.unet_steps if args.max_steps is None else args.max_steps, args.unet_budget)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    for m in modules:
        m.train()
    step, recent = 0, []
    b = args.unet_batch
    while prog.frac(step) < 1:
        set_lr(opt, prog.frac(step))
        idx = torch.randint(0, latents.shape[0], (b,), generator=gen, device=device)
        x0, y = latents[idx], labels[idx]
        tmpl = torch.randint(0, len(TEMPLATES), (b,), generator=gen, device=device)
        drop = torch.rand(b, generator=gen, device=device) < args.cond_drop
        ids = [table[tmpl, y] for table, _ in tables]
        if kind == "digits":  # SD1.5's unconditional branch encodes ""
            ids = [torch.where(drop[:, None], empty[None], i) for i, (_, empty) in zip(ids, tables)]
        t = torch.randint(0, acp.numel(), (b,), generator=gen, device=device)
        noise = torch.randn(x0.shape, generator=gen, device=device)
        a = acp[t][:, None, None, None]
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        with amp:
            embeds, pooled = encode_text(kind, encoders, ids)
            added = None
            if kind == "digits-xl":  # SDXL's unconditional branch is all zeros (force_zeros_for_empty_prompt)
                keep = (~drop).to(embeds.dtype)
                embeds = embeds * keep[:, None, None]
                added = dict(text_embeds=pooled * keep[:, None], time_ids=time_ids.expand(b, -1))
            pred = unet(xt, t, encoder_hidden_states=embeds, added_cond_kwargs=added).sample.float()
        loss = ((pred - noise) ** 2).mean(dim=(1, 2, 3))
        loss = (loss * weight[t]).mean()
        step += 1
        step_with_ema(opt, loss, params, ema, step, args.ema)
        recent.append(loss.detach())
        if step % 500 == 0 or step == 1:
            log(f"{kind} unet step {step} loss {loss.item():.4f} t {prog.elapsed():.0f}s")
    info = finish_ema(params, ema, recent, prog, step)
    log(f"{kind} unet done: {info}")
    return unet.eval(), [e.eval() for e in encoders], tokenizers, info


# -- saving --------------------------------------------------------------------------------------
def adapter_data(device: torch.device, gen: torch.Generator, copies: int, brightness: float = 1.0,
                 data: str | None = None) -> tuple:
    """What the adapter tools (train_digits_lora.py, train_digits_lcm.py) train on: the shipped `digits` model frozen,
    the training digits (brightness-scaled, `copies` augmented copies) as scaled latents with their labels, every
    caption's prompt embeddings [templates, 10, 77, dim] and the empty prompt's. Returns (model, latents, labels,
    embeds, empty_embeds)."""
    from diffgraph.models.loader import load_model

    model = load_model("digits", device, "fp32")
    vae, encoder, tokenizer = model.vae, model.text_encoders[0], model.tokenizers[0]
    for m in (model.unet, vae, encoder):
        m.requires_grad_(False)
    images8, labels = load_digits_arrays(data)
    images = upscale(torch.from_numpy(images8)).to(device) * brightness
    labels_t = torch.from_numpy(labels).to(device)
    with torch.no_grad():
        latents, ys = encode_bank(vae, images, labels_t, copies, gen)
        latents = latents * vae.config.scaling_factor
        table, empty = token_table(tokenizer, device)
        embeds = encoder(table.flatten(0, 1))[0].view(*table.shape[:2], *encoder(table[0, :1])[0].shape[1:])
        empty_embeds = encoder(empty[None])[0]
    return model, latents, ys, embeds, empty_embeds


def save_pipeline(kind: str, folder: str, unet, vae, encoders, tokenizers) -> None:
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    half = [m.to("cpu", torch.float16) for m in (unet, vae, *encoders)]
    unet, vae, encoders = half[0], half[1], half[2:]
    scheduler = EulerDiscreteScheduler(**SCHEDULER_CONFIG)
    if kind == "digits":
        pipe = StableDiffusionPipeline(vae=vae, text_encoder=encoders[0], tokenizer=tokenizers[0], unet=unet,
                                       scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
    else:
        pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=encoders[0], text_encoder_2=encoders[1],
                                         tokenizer=tokenizers[0], tokenizer_2=tokenizers[1], unet=unet,
                                         scheduler=scheduler, force_zeros_for_empty_prompt=True,
                                         add_watermarker=False)
    pipe.save_pretrained(folder, safe_serialization=True)
    # The deterministic tokenizer files, byte for byte what the presets use (and no tokenizer.json).
    for sub, pad in zip(("tokenizer", "tokenizer_2"), ARCH[kind]["pads"]):
        shutil.rmtree(os.path.join(folder, sub))
        tok.write_tokenizer(os.path.join(folder, sub), pad)


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)


def train_model(kind: str, args, device: torch.device, images8: np.ndarray, labels_np: np.ndarray) -> dict:
    t0 = time.perf_counter()
    seed = args.seed + (0 if kind == "digits" else 1)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    gen = torch.Generator(device).manual_seed(seed)
    images = upscale(torch.from_numpy(images8).to(device))
    labels = torch.from_numpy(labels_np).to(device)
    vae, vae_info = train_vae(images, args, device, gen, ARCH[kind]["vae_extra"])
    latents, ys = encode_bank(vae, images, labels, args.aug_copies, gen)
    std = latents.std().item()
    vae.register_to_config(scaling_factor=1.0 / std)
    latents = latents / std
    log(f"{kind}: {latents.shape[0]} latents, mean {latents.mean().item():.3f}, scaling_factor {1 / std:.4f}")
    unet, encoders, tokenizers, unet_info = train_unet(kind, latents, ys, args, device, gen)
    folder = os.path.join(args.out, kind)
    save_pipeline(kind, folder, unet, vae, encoders, tokenizers)
    info = dict(
        model=kind, seed=seed, device=str(device), torch=torch.__version__,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        vae=vae_info, unet=unet_info, final_loss=unet_info["final_loss"],
        scaling_factor=1.0 / std, train_wall_s=time.perf_counter() - t0,
        batch=dict(vae=args.vae_batch, unet=args.unet_batch), aug_copies=args.aug_copies,
        cond_drop=args.cond_drop, ema=args.ema, polarity="white digit on black",
        params={name: sum(p.numel() for p in m.parameters())
                for name, m in [("unet", unet), ("vae", vae)] + [(f"text_encoder{i}", e) for i, e in enumerate(encoders)]},
    )
    info["folder_bytes"] = folder_bytes(folder)
    with open(os.path.join(folder, "training.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)
    log(f"{kind}: final loss {info['final_loss']:.4f}, wall {info['train_wall_s']:.0f}s, "
        f"{info['folder_bytes'] / 1e6:.1f} MB -> {folder}")
    return info


def common_arguments(p: argparse.ArgumentParser, vae_budget: float) -> None:
    """The options every digits model's training shares: seed, device, data, the VAE stage, EMA, augmentation."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data", default=None, help=".npz with images [N,8,8] (0..16) and target; default: sklearn")
    p.add_argument("--max-steps", type=int, default=None, help="caps both stages (smoke tests)")
    p.add_argument("--vae-steps", type=int, default=900)
    p.add_argument("--vae-budget", type=float, default=vae_budget, help="seconds, a safety cap")
    p.add_argument("--vae-batch", type=int, default=128)
    p.add_argument("--vae-lr", type=float, default=1e-3)
    p.add_argument("--kl-weight", type=float, default=1e-3)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--aug-copies", type=int, default=24, help="augmented latent copies of each image")


def training_device(name: str) -> torch.device:
    """The device, with TF32 matmuls and cuDNN autotuning on a GPU."""
    device = torch.device(name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    return device


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("digits", "digits-xl", "both"), default="both")
    p.add_argument("--out", required=True, help="folder that receives digits/ and/or digits-xl/")
    common_arguments(p, vae_budget=120.0)
    p.add_argument("--unet-steps", type=int, default=1800)
    p.add_argument("--unet-budget", type=float, default=400.0, help="seconds, a safety cap")
    p.add_argument("--unet-batch", type=int, default=512)
    p.add_argument("--unet-lr", type=float, default=6e-4)
    p.add_argument("--text-lr", type=float, default=3e-4)
    p.add_argument("--cond-drop", type=float, default=0.15)
    args = p.parse_args(argv)
    device = training_device(args.device)
    images8, labels = load_digits_arrays(args.data)
    kinds = ("digits", "digits-xl") if args.model == "both" else (args.model,)
    os.makedirs(args.out, exist_ok=True)
    for kind in kinds:
        train_model(kind, args, device, images8, labels)


if __name__ == "__main__":
    main()
