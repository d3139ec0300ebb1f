"""Trains the shipped `digits-zimage` preset (the Z-Image family: a DiT on Flux-style 16-channel latents with a Qwen3
text encoder) from a seed, on the data of tools/train_digits.py, and scores a trained folder with the digits oracle.

Data and captions are train_digits.py's (scikit-learn's 8x8 digits upscaled to 64x64, white on black, augmented;
its caption templates). Stage 1 is train_digits.py's VAE stage with Flux's VAE conventions (16 latent channels, 8x
down, no quant convs; so 16x8x8 latents, 16 image tokens of 2x2 patches), its `shift_factor` / `scaling_factor` set
from the latents' mean and std. Stage 2 freezes it and trains a tiny `ZImageTransformer2DModel` jointly with a tiny
`Qwen3Model` (vocab 151936: it reads the shipped Qwen3 tokenizer's ids) as diffusers' `ZImagePipeline` runs them:
prompts in Qwen3's chat template (thinking on), the encoder's second-to-last hidden states of the real tokens, the
transformer reading t = 1 - sigma and predicting the negative velocity (x0 - noise, for x_sigma = (1 - sigma) x0 +
sigma noise). Sigmas are the scheduler's shift (SHIFT, saved in scheduler/) applied to a logit-normal draw, the
distribution the shifted inference schedule walks. 10% of captions are "" (what a guided row's negative encodes), so
it serves with and without guidance. Step counts are fixed (a seed reproduces a model); a wall-time budget per
stage is only a safety cap, as in train_digits.py.

The result is a ZImagePipeline folder (fp16 safetensors, no tokenizer/: the loader reads such a folder with the
shipped Qwen3 tokenizer) with a training.json. Its defaults (steps, guidance) are zimage.py's `digits-zimage`
checkpoint.

    python tools/train_digits_zimage.py --device cuda --out /tmp/out/digits-zimage    # about 4 minutes on an H100
    python tools/train_digits_zimage.py --score /tmp/out/digits-zimage --device cuda  # the oracle's fraction
    python tools/train_digits_zimage.py --device cpu --max-steps 20 --vae-batch 8 --dit-batch 16 --aug-copies 1 \\
        --out /tmp/dz-smoke/digits-zimage                                             # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_digits as base  # noqa: E402  (puts src/ on the path)

from diffgraph.models.qwen_tokenizer import chat_prompt, qwen_tokenizer  # noqa: E402

SHIFT = 3.0  # the flow schedule's shift (Z-Image-Turbo's scheduler config)
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=SHIFT, use_dynamic_shifting=False)
VAE_EXTRA = dict(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False)  # Flux's conventions
TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=128, n_layers=4,
                   n_refiner_layers=1, n_heads=4, n_kv_heads=4, cap_feat_dim=16, axes_dims=[8, 12, 12],
                   axes_lens=[1024, 256, 256])
# Three layers so that two count (the pipeline reads the second-to-last hidden states); hidden 16 keeps the
# 151936-row embedding, most of the folder, at 4.9 MB in fp16.
TEXT_ENCODER = dict(vocab_size=151936, hidden_size=16, intermediate_size=64, num_hidden_layers=3,
                    num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024)
SEQ = 32  # the transformer pads caption and image tokens to multiples of this


def log(msg: str) -> None:
    print(f"[train_digits_zimage] {msg}", flush=True)


# -- stage 2: transformer + text encoder ---------------------------------------------------------
def token_table(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [templates, 10, L], lengths [templates, 10], empty ids [L], empty length []) of every caption in Qwen3's
    chat template with thinking on, as ZImageFamily.encode / ZImagePipeline tokenise prompts."""
    tokenizer = qwen_tokenizer("qwen3")
    texts = [base.caption(t, d) for t in range(len(base.TEMPLATES)) for d in range(10)] + [""]
    rows = [tokenizer(chat_prompt(text, "qwen3", enable_thinking=True)).input_ids for text in texts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows], device=device)
    lengths = torch.tensor([len(r) for r in rows], device=device)
    shape = (len(base.TEMPLATES), 10)
    return ids[:-1].view(*shape, width), lengths[:-1].view(shape), ids[-1], lengths[-1]


def encode(encoder, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(second-to-last hidden states [b, L, dim], mask [b, L] of the real tokens): ZImagePipeline's `prompt_embeds`
    are each row's real tokens."""
    mask = torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None]
    return encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2], mask


def forward(net, x: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ZImageTransformer2DModel's forward (its output: -velocity) on 8x8 latents x [b, 16, 8, 8] at t = 1 - sigma [b],
    for captions `embeds` [b, L, dim] whose real tokens `mask` [b, L] marks (first). Batched: every row is the same
    64 tokens (16 image tokens and 16 image pad tokens, then the caption padded to 32, captions being at most 32
    tokens), so no attention mask is needed, where diffusers' forward loops over rows (a few hundred small ops each,
    which would bound training on a GPU). `check_forward` holds it to diffusers'."""
    b, c, height, width = x.shape
    rows, cols = height // 2, width // 2
    image = x.view(b, c, rows, 2, cols, 2).permute(0, 2, 4, 3, 5, 1).reshape(b, rows * cols, 4 * c)  # channels last
    slot = -(-rows * cols // SEQ) * SEQ
    adaln = net.t_embedder(t * net.t_scale)
    h = net.all_x_embedder["2-1"](image)
    h = torch.cat([h, net.x_pad_token.to(h.dtype).expand(b, slot - rows * cols, -1)], dim=1)
    assert embeds.shape[1] <= SEQ, "captions longer than 32 tokens need masks"
    cap = net.cap_embedder(torch.cat([embeds, embeds.new_zeros(b, SEQ - embeds.shape[1], embeds.shape[2])], dim=1))
    real = torch.cat([mask, mask.new_zeros(b, SEQ - mask.shape[1])], dim=1)
    cap = torch.where(real.unsqueeze(-1), cap, net.cap_pad_token.to(cap.dtype))
    # positions: caption token k at (1 + k, 0, 0); image token (r, c) at (33, r, c); image pad tokens at (0, 0, 0)
    k = torch.arange(SEQ, device=x.device)
    text_ids = torch.stack([1 + k, 0 * k, 0 * k], dim=-1)
    r, q = torch.meshgrid(torch.arange(rows, device=x.device), torch.arange(cols, device=x.device), indexing="ij")
    image_ids = torch.stack([torch.full_like(r, SEQ + 1), r, q], dim=-1).view(-1, 3)
    image_ids = torch.cat([image_ids, image_ids.new_zeros(slot - rows * cols, 3)])
    image_freqs, text_freqs = (net.rope_embedder(ids).unsqueeze(0).expand(b, -1, -1) for ids in (image_ids, text_ids))
    for layer in net.noise_refiner:
        h = layer(h, None, image_freqs, adaln)
    for layer in net.context_refiner:
        cap = layer(cap, None, text_freqs)
    u, freqs = torch.cat([h, cap], dim=1), torch.cat([image_freqs, text_freqs], dim=1)
    for layer in net.layers:
        u = layer(u, None, freqs, adaln)
    out = net.all_final_layer["2-1"](u[:, :rows * cols], c=adaln)
    return out.view(b, rows, cols, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, height, width)


@torch.no_grad()
def check_forward(net, encoder, ids: torch.Tensor, lengths: torch.Tensor) -> float:
    """The largest difference between `forward` and diffusers' forward on a few rows (fp32, TF32 off); a ValueError
    above 1e-3 of the output's scale (a layout mistake is of its order)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return _forward_error(net, encoder, ids, lengths)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _forward_error(net, encoder, ids: torch.Tensor, lengths: torch.Tensor) -> float:
    gen = torch.Generator(ids.device).manual_seed(0)
    x = torch.randn((ids.shape[0], 16, 8, 8), generator=gen, device=ids.device)
    t = torch.rand(ids.shape[0], generator=gen, device=ids.device)
    embeds, mask = encode(encoder, ids, lengths)
    ours = forward(net, x, t, embeds, mask)
    caps = [e[m] for e, m in zip(embeds, mask)]
    theirs = torch.stack(net(list(x.unsqueeze(2)), t, caps, return_dict=False)[0]).squeeze(2)
    err = (ours - theirs).abs().max().item()
    if not err <= 1e-3 * max(1.0, theirs.abs().max().item()):
        raise ValueError(f"the batched forward differs from diffusers' ZImageTransformer2DModel by {err:.2e}")
    return err


def velocity_target(x0: torch.Tensor, gen: torch.Generator, logit_std: float) -> tuple:
    """(x_sigma, 1 - sigma, the model's target x0 - noise) for sigmas shifted as the scheduler shifts them."""
    u = torch.sigmoid(torch.randn(x0.shape[0], generator=gen, device=x0.device) * logit_std)
    sigma = SHIFT * u / (1 + (SHIFT - 1) * u)
    noise = torch.randn(x0.shape, generator=gen, device=x0.device)
    s = sigma[:, None, None, None]
    return (1 - s) * x0 + s * noise, 1 - sigma, x0 - noise


def train_dit(latents: torch.Tensor, labels: torch.Tensor, args, device: torch.device, gen: torch.Generator):
    from diffusers import ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    transformer = ZImageTransformer2DModel(**TRANSFORMER).to(device)
    encoder = Qwen3Model(Qwen3Config(**TEXT_ENCODER)).to(device)
    table, lengths, empty, empty_len = token_table(device)
    log(f"batched forward = diffusers' within {check_forward(transformer, encoder, table[:, 0], lengths[:, 0]):.1e}")
    params = [*transformer.parameters(), *encoder.parameters()]
    opt = torch.optim.AdamW([dict(params=list(transformer.parameters()), peak_lr=args.dit_lr),
                             dict(params=list(encoder.parameters()), peak_lr=args.text_lr)],
                            lr=args.dit_lr, weight_decay=1e-2, fused=device.type == "cuda")
    ema = [p.detach().clone() for p in params]
    prog = base.Progress(args.dit_steps if args.max_steps is None else args.max_steps, args.dit_budget)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    transformer.train()
    encoder.train()
    step, recent, b = 0, [], args.dit_batch
    while prog.frac(step) < 1:
        base.set_lr(opt, prog.frac(step))
        idx = torch.randint(0, latents.shape[0], (b,), generator=gen, device=device)
        x0, y = latents[idx], labels[idx]
        tmpl = torch.randint(0, len(base.TEMPLATES), (b,), generator=gen, device=device)
        drop = (torch.rand(b, generator=gen, device=device) < args.cond_drop)[:, None]
        ids = torch.where(drop, empty[None], table[tmpl, y])
        n = torch.where(drop[:, 0], empty_len, lengths[tmpl, y])
        xt, t, target = velocity_target(x0, gen, args.logit_std)
        with amp:
            pred = forward(transformer, xt, t, *encode(encoder, ids, n)).float()
        loss = ((pred - target) ** 2).mean()
        step += 1
        base.step_with_ema(opt, loss, params, ema, step, args.ema)
        recent.append(loss.detach())
        if step % 250 == 0 or step == 1:
            log(f"dit step {step} loss {loss.item():.4f} t {prog.elapsed():.0f}s")
    info = base.finish_ema(params, ema, recent, prog, step)
    log(f"dit done: {info}")
    return transformer.eval(), encoder.eval(), info


# -- saving --------------------------------------------------------------------------------------
def save_pipeline(folder: str, transformer, vae, encoder) -> None:
    """A ZImagePipeline folder in fp16, without tokenizer/ (the shipped Qwen3 tokenizer reads its prompts)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    transformer, vae, encoder = (m.to("cpu", torch.float16) for m in (transformer, vae, encoder))
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae,
                          text_encoder=encoder, tokenizer=None, transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)


def train(args, device: torch.device) -> dict:
    t0 = time.perf_counter()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    gen = torch.Generator(device).manual_seed(args.seed)
    images8, labels_np = base.load_digits_arrays(args.data)
    images = base.upscale(torch.from_numpy(images8).to(device))
    labels = torch.from_numpy(labels_np).to(device)
    vae, vae_info = base.train_vae(images, args, device, gen, VAE_EXTRA)
    latents, ys = base.encode_bank(vae, images, labels, args.aug_copies, gen)
    shift, std = latents.mean().item(), latents.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=1.0 / std)
    latents = (latents - shift) / std
    log(f"{latents.shape[0]} latents, shift_factor {shift:.4f}, scaling_factor {1 / std:.4f}")
    transformer, encoder, dit_info = train_dit(latents, ys, args, device, gen)
    save_pipeline(args.out, transformer, vae, encoder)
    info = dict(
        model="digits-zimage", seed=args.seed, device=str(device), torch=torch.__version__,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        vae=vae_info, transformer=dit_info, final_loss=dit_info["final_loss"], shift_factor=shift,
        scaling_factor=1.0 / std, scheduler=SCHEDULER_CONFIG, logit_std=args.logit_std,
        train_wall_s=time.perf_counter() - t0, batch=dict(vae=args.vae_batch, transformer=args.dit_batch),
        aug_copies=args.aug_copies, cond_drop=args.cond_drop, ema=args.ema, polarity="white digit on black",
        tokenizer="the shipped Qwen3 tokenizer (diffgraph.models.qwen_tokenizer), chat template, thinking on",
        params={name: sum(p.numel() for p in m.parameters())
                for name, m in (("transformer", transformer), ("vae", vae), ("text_encoder", encoder))},
    )
    info["folder_bytes"] = base.folder_bytes(args.out)
    with open(os.path.join(args.out, "training.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)
    log(f"final loss {info['final_loss']:.4f}, wall {info['train_wall_s']:.0f}s, "
        f"{info['folder_bytes'] / 1e6:.1f} MB -> {args.out}")
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="the folder to write (e.g. .../digits-zimage)")
    p.add_argument("--score", metavar="MODEL", help="score a trained folder (or preset) instead of training")
    p.add_argument("--per-digit", type=int, default=5, help="images per digit when scoring")
    p.add_argument("--guidance", type=float, nargs="*", default=None,
                   help="guidance scales to score besides the default (e.g. 1 3 4)")
    base.common_arguments(p, vae_budget=60.0)
    p.add_argument("--dit-steps", type=int, default=2400)
    p.add_argument("--dit-budget", type=float, default=150.0, help="seconds, a safety cap")
    p.add_argument("--dit-batch", type=int, default=512)
    p.add_argument("--dit-lr", type=float, default=5e-4)
    p.add_argument("--text-lr", type=float, default=5e-4)
    p.add_argument("--logit-std", type=float, default=1.0, help="spread of the logit-normal sigma draw")
    p.add_argument("--cond-drop", type=float, default=0.1)
    args = p.parse_args(argv)
    if args.score:
        from diffgraph import Engine
        from diffgraph.models.digits_oracle import engine_score, train_oracle

        engine, oracle = Engine(model=args.score, device=args.device), train_oracle()
        rate, wrong = engine_score(engine, "digits-zimage", oracle, args.per_digit)
        print(f"{args.score}: default steps and guidance: {rate:.0%} of {10 * args.per_digit} read as the asked "
              f"digit; misread (asked: read) {wrong}")
        for g in args.guidance or ():
            r, w = engine_score(engine, "digits-zimage", oracle, args.per_digit, guidance_scale=g)
            print(f"{args.score}: guidance {g:g}: {r:.0%}; misread {w}")
        return 0 if rate >= 0.9 else 1
    if not args.out:
        p.error("--out is required to train")
    device = base.training_device(args.device)
    train(args, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
