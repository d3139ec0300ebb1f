"""Trains the built-in `pencil` LoRA of the shipped `digits` model: the same digits drawn in grey pencil (strokes
at PENCIL x the white of the base model), whatever the prompt.

Data: the training digits of tools/train_digits.py (scikit-learn's 8x8 digits, upscaled, augmented), their
brightness scaled by PENCIL, encoded by the model's own VAE. A rank-4 LoRA (peft) on the UNet's attention and
feed-forward projections learns them with the base model's objective (epsilon MSE, min-SNR-5, the SD
scaled_linear schedule) and the same captions, with caption dropout so guidance keeps working; everything else is
frozen. Saved with diffusers' StableDiffusionPipeline.save_lora_weights (the diffusers/PEFT layout), as
src/diffgraph/assets/loras/digits/pencil.safetensors, with a pencil.json of the run.

    python tools/train_digits_lora.py --device cpu      # about 4 minutes on 2 cores
    python tools/train_digits_lora.py --device cuda

The measure of the style (tests/test_digits_lora.py): the peak brightness of a generated image (its 99th
percentile), about 1 without the adapter and about PENCIL with it; the digit stays readable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import train_digits as base  # noqa: E402

PENCIL = 0.45
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
OUT = os.path.join(ROOT, "src", "diffgraph", "assets", "loras", "digits")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--copies", type=int, default=3, help="augmented copies of the data set (the first: as is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    gen = torch.Generator(device).manual_seed(args.seed)
    model, latents, ys, embeds, empty_embeds = base.adapter_data(device, gen, args.copies, brightness=PENCIL)
    unet = model.unet
    inject_adapter_in_model(LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS,
                                       init_lora_weights=True), unet)
    params = [q for n, q in unet.named_parameters() if "lora_" in n]
    for q in params:
        q.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    acp = base.alphas_cumprod().to(device)
    snr = acp / (1 - acp)
    weight = torch.clamp(snr, max=5.0) / snr
    unet.train()
    t0, recent = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = base.lr_at(step / args.steps, args.lr)
        idx = torch.randint(0, latents.shape[0], (args.batch,), generator=gen, device=device)
        x0, y = latents[idx], ys[idx]
        tmpl = torch.randint(0, len(base.TEMPLATES), (args.batch,), generator=gen, device=device)
        drop = torch.rand(args.batch, generator=gen, device=device) < 0.1
        cond = torch.where(drop[:, None, None], empty_embeds, embeds[tmpl, y])
        t = torch.randint(0, acp.numel(), (args.batch,), generator=gen, device=device)
        noise = torch.randn(x0.shape, generator=gen, device=device)
        a = acp[t][:, None, None, None]
        pred = unet(a.sqrt() * x0 + (1 - a).sqrt() * noise, t, encoder_hidden_states=cond).sample
        loss = (((pred - noise) ** 2).mean(dim=(1, 2, 3)) * weight[t]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        recent.append(loss.item())
        if step % 100 == 0 or step == 1:
            print(f"[train_digits_lora] step {step} loss {sum(recent[-100:]) / len(recent[-100:]):.4f} "
                  f"t {time.perf_counter() - t0:.0f}s", flush=True)
    unet.eval()
    os.makedirs(args.out, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in get_peft_model_state_dict(unet).items()}
    StableDiffusionPipeline.save_lora_weights(args.out, unet_lora_layers=state, weight_name="pencil.safetensors")
    info = dict(style=f"grey pencil strokes ({PENCIL} x white)", rank=args.rank, targets=TARGETS, steps=args.steps,
                batch=args.batch, lr=args.lr, seed=args.seed, final_loss=sum(recent[-100:]) / len(recent[-100:]),
                wall_s=round(time.perf_counter() - t0, 1), device=str(device), torch=torch.__version__)
    with open(os.path.join(args.out, "pencil.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"[train_digits_lora] wrote {os.path.join(args.out, 'pencil.safetensors')}: {info}")


if __name__ == "__main__":
    main()
