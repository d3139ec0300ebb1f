"""Distils the shipped `digits` model into a 4-step student: the built-in `lcm` LoRA (latent consistency distillation,
Luo et al. 2023, "LCM-LoRA", as diffusers' examples/consistency_distillation/train_lcm_distill_lora_sd_wds.py does it).

Teacher: `digits` itself (frozen), with classifier-free guidance w (the pipeline's scale w + 1: 5.0 by default, the
model's own default guidance). Student: the same UNet with a LoRA on the attention and feed-forward projections
(peft), initialised at zero, so it starts as the teacher. Each training step takes data latents (the training
digits of tools/train_digits.py, augmented, encoded by the model's VAE), a DDIM timestep t_n of 50 (stride 20) and
the one 20 below it: the teacher's guided DDIM step from t_n to t_{n-1} gives x_prev, and the student is trained so
that its consistency output at (x_t, t_n) equals its own output (no gradient) at (x_prev, t_{n-1}); the consistency
output is c_skip(t) x + c_out(t) x0(x, t) with LCMScheduler's boundary scalings (timestep_scaling 10, sigma_data 0.5),
the loss a pseudo-Huber one (c = 0.001). At inference the LoRA runs with `sampler="lcm"`, 4 steps and guidance 1
(one branch: the guidance is distilled in).

    python tools/train_digits_lcm.py --device cuda      # about a minute on an H200
    python tools/train_digits_lcm.py --device cpu       # slower (2 cores: ~15 minutes)

The measure (tests/test_digits_lcm.py): 4-step images with the adapter read as the asked digit by the digits oracle
(tests/test_digits.py) at >= 90%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import train_digits as base  # noqa: E402

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
OUT = os.path.join(ROOT, "src", "diffgraph", "assets", "loras", "digits")
DDIM_STEPS, SKIP = 50, 20  # the teacher's DDIM grid (original_inference_steps 50) and its stride
SIGMA_DATA, TIMESTEP_SCALING, HUBER_C = 0.5, 10.0, 0.001


def scalings(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LCMScheduler.get_scalings_for_boundary_condition_discrete: (c_skip, c_out) at integer timesteps t."""
    scaled = t.float() * TIMESTEP_SCALING
    c_skip = SIGMA_DATA**2 / (scaled**2 + SIGMA_DATA**2)
    c_out = scaled / (scaled**2 + SIGMA_DATA**2) ** 0.5
    return c_skip[:, None, None, None], c_out[:, None, None, None]


def x0_of(x: torch.Tensor, eps: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return (x - (1 - a).sqrt() * eps) / a.sqrt()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--guidance", type=float, default=5.0, help="the teacher's classifier-free guidance scale")
    p.add_argument("--copies", type=int, default=4, help="augmented copies of the data set (the first: as is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=OUT)
    p.add_argument("--data", default=None, metavar="NPZ",
                   help="the digits as an .npz (keys images, target) where scikit-learn is not installed")
    args = p.parse_args(argv)
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig, get_peft_model_state_dict

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    gen = torch.Generator(device).manual_seed(args.seed)
    model, latents, ys, embeds, empty_embeds = base.adapter_data(device, gen, args.copies, data=args.data)
    unet = model.unet
    acp = base.alphas_cumprod().to(device)
    ddim_t = torch.from_numpy((np.arange(1, DDIM_STEPS + 1) * (1000 // DDIM_STEPS)).round() - 1).long().to(device)
    acp_prev = torch.cat([acp[:1], acp[ddim_t[:-1]]])  # the DDIM solver's alpha-bar one grid point down
    teacher_w = args.guidance - 1.0  # x = c + w (c - u): the pipeline's u + g (c - u)

    def eps(x, t, cond, lora: bool) -> torch.Tensor:
        (unet.enable_adapters if lora else unet.disable_adapters)()
        return unet(x, t, encoder_hidden_states=cond).sample

    unet.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS, init_lora_weights=True))
    params = [q for n, q in unet.named_parameters() if "lora_" in n]
    for q in params:
        q.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    unet.train()
    t0, recent = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = base.lr_at(step / args.steps, args.lr)
        idx = torch.randint(0, latents.shape[0], (args.batch,), generator=gen, device=device)
        x0, y = latents[idx], ys[idx]
        tmpl = torch.randint(0, len(base.TEMPLATES), (args.batch,), generator=gen, device=device)
        cond = embeds[tmpl, y]
        uncond = empty_embeds.expand_as(cond)
        n = torch.randint(0, DDIM_STEPS, (args.batch,), generator=gen, device=device)
        t_start, t_next = ddim_t[n], (ddim_t[n] - SKIP).clamp(min=0)
        a = acp[t_start][:, None, None, None]
        noise = torch.randn(x0.shape, generator=gen, device=device)
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
        c_skip, c_out = scalings(t_start)
        student = c_skip * x_t + c_out * x0_of(x_t, eps(x_t, t_start, cond, True), a)
        with torch.no_grad():  # the teacher's guided DDIM step, then the student's own target one grid point down
            e = eps(torch.cat([x_t, x_t]), torch.cat([t_start, t_start]), torch.cat([cond, uncond]), False)
            e_c, e_u = e.chunk(2)
            x0_c, x0_u = x0_of(x_t, e_c, a), x0_of(x_t, e_u, a)
            x0_g, e_g = x0_c + teacher_w * (x0_c - x0_u), e_c + teacher_w * (e_c - e_u)
            ap = acp_prev[n][:, None, None, None]
            x_prev = ap.sqrt() * x0_g + (1 - ap).sqrt() * e_g
            c_skip2, c_out2 = scalings(t_next)
            a2 = acp[t_next][:, None, None, None]
            target = c_skip2 * x_prev + c_out2 * x0_of(x_prev, eps(x_prev, t_next, cond, True), a2)
        loss = (((student.float() - target.float()) ** 2 + HUBER_C**2).sqrt() - HUBER_C).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        recent.append(loss.item())
        if step % 100 == 0 or step == 1:
            print(f"[train_digits_lcm] step {step} loss {sum(recent[-100:]) / len(recent[-100:]):.5f} "
                  f"t {time.perf_counter() - t0:.0f}s", flush=True)
    unet.eval()
    unet.enable_adapters()
    os.makedirs(args.out, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in get_peft_model_state_dict(unet).items()}
    StableDiffusionPipeline.save_lora_weights(args.out, unet_lora_layers=state, weight_name="lcm.safetensors")
    info = dict(kind="latent consistency distillation (LCM-LoRA)", teacher="digits", teacher_guidance=args.guidance,
                ddim_steps=DDIM_STEPS, skip=SKIP, rank=args.rank, targets=TARGETS, steps=args.steps, batch=args.batch,
                lr=args.lr, seed=args.seed, final_loss=sum(recent[-100:]) / len(recent[-100:]),
                wall_s=round(time.perf_counter() - t0, 1), device=str(device), torch=torch.__version__,
                use="sampler lcm, 4 steps, guidance_scale 1")
    with open(os.path.join(args.out, "lcm.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"[train_digits_lcm] wrote {os.path.join(args.out, 'lcm.safetensors')}: {info}")


if __name__ == "__main__":
    main()
