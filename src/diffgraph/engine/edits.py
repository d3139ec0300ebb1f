"""Image-to-image and inpainting rows: from a request's image (and mask) to its initial latents and per-row fields.

As diffusers' StableDiffusion(XL)Img2Img / Inpaint pipelines do for the same seed: at submit, on the submitting
thread, the image (and the mask) are preprocessed by diffusers' own VaeImageProcessor (resized to the request's size,
binarized mask); at admission they are encoded by the VAE encoder (its graph where it covers the size; image and masked image in one call), and sampled
from the request's generator in the pipelines' order: image posterior, then the initial noise, then (inpainting)
the masked image's posterior, drawn even where a 4-channel UNet does not use it, so ancestral samplers continue
from the same generator state (a family whose pipelines take the posterior's mode, `edit_samples_posterior` False:
FLUX.2, draws no posterior sample). Rows start at the step the strength implies (`ModelRunner.request_plan`) from the
image's latents noised to that step as the family noises (`FamilyAdapter.noising`: SD's samplers' add_noise, a flow
family's (1 - sigma) x0 + sigma * noise), or from pure noise for inpainting at strength 1.
An edit from latents (`EditInput.latents`: the hires fix's latent upscale) skips the encoder and is noised the same.

Per-row fields for the whole step (graphs/step.py): for a 4-channel UNet's inpainting, the mask at latent size,
the image latents and the initial noise (the step blends the known region back after each update); for a
9-channel inpainting UNet, its extra input channels (mask, masked-image latents) and no blend. Everything stays on
the device: no synchronisation with the GPU at admission.
"""

from __future__ import annotations

from typing import Any

import torch

from ..request import GenerationRequest, GroupKey
from ..sampling.samplers import SamplerPlan
from .variation import initial_noise


def preprocess_edit(request: GenerationRequest, vae_scale_factor: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(image [1, 3, h, w] in -1..1, binarized mask [1, 1, h, w] or None) of an edit request at its size, by diffusers'
    VaeImageProcessor: at submit, on the submitting thread (a resize of up to 16 MP never runs on the engine loop)."""
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    edit, (h, w), f = request.edit, request.key, vae_scale_factor
    if edit.latents is not None:  # the image's latents already (the hires fix's latent upscale)
        return torch.from_numpy(edit.latents)[None], None
    image = VaeImageProcessor(vae_scale_factor=f).preprocess(Image.fromarray(edit.image), height=h, width=w).float()
    mask = None
    if edit.inpaint:
        mask = VaeImageProcessor(vae_scale_factor=f, do_normalize=False, do_binarize=True,
                                 do_convert_grayscale=True).preprocess(Image.fromarray(edit.mask), height=h, width=w)
    return image, mask


def prepare_edit(runner: Any, request: GenerationRequest, key: GroupKey, generator: torch.Generator,
                 plan: SamplerPlan, rows: int, pixels: tuple[torch.Tensor, torch.Tensor | None]
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(initial latents as step rows (the image latents [rows, C, h, w] fp32, packed where the family packs), the edit row feature's fields: features/edit.py) of an edit request,
    from its preprocessed `pixels` (`preprocess_edit`)."""
    edit, model, adapter = request.edit, runner.model, runner.adapter
    if edit.latents is not None:
        return _from_latents(runner, request, key, generator, plan, rows, pixels[0])
    size = h, w = request.key
    f = model.vae_scale_factor
    image, mask = pixels
    batch = [image]
    if edit.inpaint:
        batch.append(image * (mask < 0.5))
    pure_noise = edit.inpaint and edit.strength == 1.0  # diffusers' is_strength_max
    # the image's own latents: image-to-image, a 4-channel inpainting UNet (the blend), or strength < 1
    need_image = not edit.inpaint or not runner.extra_channels or not pure_noise
    params = runner.encode_pixels(size, torch.cat(batch if need_image else batch[1:]), tiling=request.tiling)

    def sample(p: torch.Tensor) -> torch.Tensor:  # the posterior sample from the request's generator (or its mode)
        mean, logvar = p.float().chunk(2, dim=1)
        if not adapter.edit_samples_posterior:
            return adapter.image_latents(model, runner.encoder, mean)
        eps = torch.randn(mean.shape, generator=generator, dtype=p.dtype)
        latent = mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * runner.to_device(eps).float()
        return adapter.image_latents(model, runner.encoder, latent)

    image_latents = sample(params[:1]) if need_image else None
    noise = runner.to_device(initial_noise(request, generator, rows, adapter.image_latent_shape(model, size),
                                           model.dtype, size)).float()
    masked_latents = sample(params[-1:]) if edit.inpaint else None
    if pure_noise:
        latents = noise * plan.init_noise_sigma
    else:
        k, e = adapter.noising(plan)  # the family's: SD's add_noise, or a flow's (1 - sigma, sigma)
        latents = k * image_latents + e * noise
    fields: dict[str, torch.Tensor] = {}
    if edit.inpaint:
        small = runner.to_device(torch.nn.functional.interpolate(mask, size=(h // f, w // f)))
        if runner.extra_channels:
            fields["extra"] = torch.cat([small, masked_latents], dim=1).to(model.dtype)
        else:
            fields.update(mask=small, known=image_latents, noise0=noise)
    return adapter.pack(model, latents, size, key), fields


def _from_latents(runner: Any, request: GenerationRequest, key: GroupKey, generator: torch.Generator,
                  plan: SamplerPlan, rows: int, latents: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """An edit that starts from image latents [1, C, h, w] (`EditInput.latents`): noised as an image's encoded
    latents are, from the same draws of the request's generator (the posterior's sample drawn and unused first, so
    the noise is the one an image of the same seed gets)."""
    model, adapter = runner.model, runner.adapter
    shape = adapter.image_latent_shape(model, request.key)
    if adapter.edit_samples_posterior:  # an encoded image's posterior sample
        torch.randn((1, *shape), generator=generator, dtype=model.vae_dtype)
    noise = runner.to_device(initial_noise(request, generator, rows, shape, model.dtype, request.key)).float()
    k, e = adapter.noising(plan)
    start = k * runner.to_device(latents).float() + e * noise
    return adapter.pack(model, start, request.key, key), {}
