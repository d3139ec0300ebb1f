"""`IPAdapters`: the IP-Adapters of an `--ip-adapter-dir` and a request's image prompt made into row fields (the
row feature is features/image_prompt.py).

On the submitting thread (`resolve`): the adapter's file streamed into host tensors (`safe_tensors`, never mapped)
and converted with diffusers' own IP-Adapter readers (the image projection by `UNet2DConditionModel._convert_ip_adapter_image_proj_to_
diffusers`, the per-layer `to_k_ip` / `to_v_ip` weights by the state dict's layer numbering, `{1 + 2j}` for the
UNet's j-th cross-attention layer) and checked (every weight finite, on the host; `_check`: the projection takes
its encoder's output, its tokens fit those layers), so a broken file is a ParamError naming it, never a 500 or NaN
images; kept for the most recent `cache` adapters; the image encoder (the adapter's `image_encoder` folder,
transformers' CLIPVisionModelWithProjection with diffusers' default CLIPImageProcessor at its image size) loaded
once, streamed tensor by tensor (`stream_load`); each image embedded once (cached by its pixels' hash), as diffusers' pipelines embed it (the image
embedding for the base adapters, the penultimate hidden states for "plus" ones; the negative: zeros, or the
encoder's hidden states of a black image); then projected to tokens and every layer's keys and values computed, for
both guidance branches. Those are the row fields the request's rows take at admission: nothing about an
adapter stays on the device between requests and no admission gate is needed. The adapters' cache is
features/slot_files.py's `SlotFiles` without slots (`files`).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ParamError, relative_paths
from ..features.image_prompt import MAX_TOKENS, ImagePromptRows, cross_attention_layers, install
from ..features.slot_files import SlotFiles, file_version
from ..models.ip_adapter_dir import IPAdapterDir
from ..models.stream_load import load_part
from ..models.weights_view import UnreadableWeights
from ..request import MAX_CONTROL_PIXELS, GenerationRequest
from ..safe_files import FileChanged, UnusableFile
from ..safe_tensors import CHANGED_FIX, read_safetensors


@dataclass(eq=False)
class _Adapter:
    proj: torch.nn.Module                 # the image projection (diffusers' ImageProjection, IPAdapterPlus..., ...)
    keys: list[torch.Tensor]              # per cross-attention layer: to_k_ip's weight [dim, cross]
    values: list[torch.Tensor]
    hidden_states: bool                   # "plus": the encoder's penultimate hidden states, not its embedding
    encoder: str                          # its image encoder folder


class IPAdapters:
    def __init__(self, root: str, unet: Any, device: torch.device, dtype: torch.dtype, cache: int = 2):
        self.catalog = IPAdapterDir(root)
        self.device, self.dtype, self._unet = device, dtype, unet
        self.context = install(unet)
        layers = cross_attention_layers(unet)
        self._dims = [attn.inner_kv_dim for _, attn in layers]  # to_k's width (a LoRA side path may wrap it)
        self._heads = [attn.heads for _, attn in layers]
        self.files = SlotFiles("image_prompts", "image_prompts", self._locate, self._read, keep=cache,
                               listing=lambda: self.catalog.listing(), what="IP-Adapter")
        self._encoders: dict[str, tuple[Any, Any]] = {}
        self._embeds: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def feature(self) -> ImagePromptRows:
        return ImagePromptRows(self.context, self._dims, self._heads, self.dtype)

    # -- on the submitting thread ------------------------------------------------------------------------
    def resolve(self, request: GenerationRequest) -> dict[str, torch.Tensor]:
        """The request's image-prompt row fields ([1, ...] each, on the device). Raises ParamError("image_prompts")."""
        prompt = request.image_prompts
        name = prompt.model if prompt.model is not None else self.catalog.only()
        with self._lock, torch.no_grad():
            adapter = self.files.held(name).host
            embeds, negative = self._embed(adapter, prompt.images)
            proj_dtype = next(adapter.proj.parameters()).dtype
            tokens = adapter.proj(embeds.to(proj_dtype)).flatten(0, 1)      # [images * T, cross]
            neg_tokens = adapter.proj(negative.to(proj_dtype)).flatten(0, 1)
            n = tokens.shape[0]
            if n > MAX_TOKENS:
                raise ParamError("image_prompts", f"this IP-Adapter makes {n} image tokens for {len(prompt.images)} "
                                                 f"image(s); at most {MAX_TOKENS} per request: send fewer images")
            out = {"ip.mask": torch.zeros((1, MAX_TOKENS), dtype=self.dtype, device=self.device)}
            out["ip.mask"][0, :n] = 1
            for j, (wk, wv) in enumerate(zip(adapter.keys, adapter.values)):
                for name, w, t in (("k", wk, tokens), ("v", wv, tokens),
                                   ("nk", wk, neg_tokens), ("nv", wv, neg_tokens)):
                    field = torch.zeros((1, MAX_TOKENS, w.shape[0]), dtype=self.dtype, device=self.device)
                    field[0, :n] = torch.nn.functional.linear(t.to(w.dtype), w).to(self.dtype)
                    out[f"ip.{name}{j}"] = field
        return out

    def _locate(self, name: str) -> tuple[str, tuple]:
        path = self.catalog.file(name)
        return path, file_version(path)

    def _read(self, name: str, path: str) -> _Adapter:
        try:
            state = read_safetensors(path, 16 << 30)
        except UnusableFile as e:
            fix = f"; {CHANGED_FIX}" if isinstance(e, FileChanged) else ""
            raise ParamError("image_prompts", f"IP-Adapter {name!r}: its file {e}{fix}") from None
        # on the host, before anything reaches the device: a check there would sync the device, which another
        # thread's graph capture forbids (cudaErrorStreamCaptureUnsupported broke that capture on the GPU)
        bad = next((k for k, v in state.items() if not bool(torch.isfinite(v.to(self.dtype)).all())), None)
        if bad is not None:
            raise ParamError("image_prompts", f"IP-Adapter {name!r} has non-finite weights (NaN or infinity, or past "
                                             f"this model's dtype) in {bad}: the file is damaged; use an intact copy")
        proj_state = {k[len("image_proj."):]: v for k, v in state.items() if k.startswith("image_proj.")}
        ip_state = {k[len("ip_adapter."):]: v for k, v in state.items() if k.startswith("ip_adapter.")}
        keys, values = [], []
        for j, dim in enumerate(self._dims):
            k, v = ip_state.get(f"{1 + 2 * j}.to_k_ip.weight"), ip_state.get(f"{1 + 2 * j}.to_v_ip.weight")
            if k is None or v is None or k.shape[0] != dim or v.shape[0] != dim or k.shape[1] != v.shape[1]:
                raise ParamError("image_prompts", f"IP-Adapter {name!r} does not fit this model's UNet (its layer "
                                                 f"{1 + 2 * j} is missing or has other sizes): use one made for it")
            keys.append(k.to(self.device, self.dtype))
            values.append(v.to(self.device, self.dtype))
        if len(ip_state) != 2 * len(self._dims):
            raise ParamError("image_prompts", f"IP-Adapter {name!r} has {len(ip_state) // 2} layers, this model's "
                                             f"UNet {len(self._dims)}: use one made for it")
        try:
            proj = self._unet._convert_ip_adapter_image_proj_to_diffusers(proj_state, low_cpu_mem_usage=False)
        except Exception as e:  # a projection diffusers does not know
            raise ParamError("image_prompts", f"IP-Adapter {name!r}: its image projection could not be read "
                                             f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
        from diffusers.models.embeddings import ImageProjection
        adapter = _Adapter(proj.eval().requires_grad_(False), keys, values, not isinstance(proj, ImageProjection),
                           self.catalog.encoder(path))
        self._check(name, adapter)  # on the host, before the projection moves to the device
        adapter.proj.to(self.device, self.dtype)
        return adapter

    def _check(self, name: str, adapter: _Adapter) -> None:
        """At load, what would fail a request later (a RuntimeError inside the projection, a 500, or NaN images):
        the projection (still on the host: nothing here touches the device, which another thread may be capturing)
        takes its image encoder's output and its tokens fit the to_k_ip / to_v_ip layers. Its weights were checked
        finite on the host (`_adapter`)."""
        config = self._encoder(adapter.encoder)[0].config
        what, width = ("penultimate hidden states", config.hidden_size) if adapter.hidden_states else \
            ("image embeddings", config.projection_dim)
        shape = (1, 1, width) if adapter.hidden_states else (1, width)
        weight = next(adapter.proj.parameters(), None)
        probe = torch.zeros(shape, dtype=weight.dtype if weight is not None else torch.float32)
        try:
            tokens = adapter.proj(probe).shape[-1]
        except Exception as e:  # a shape mismatch inside the projection (torch's RuntimeError, or another)
            raise ParamError("image_prompts", f"IP-Adapter {name!r}: its image projection does not take its image "
                                             f"encoder's {what} ({width} wide): use the image_encoder it was made "
                                             f"with ({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
        taken = sorted({k.shape[1] for k in adapter.keys + adapter.values})
        if taken != [tokens]:
            raise ParamError("image_prompts", f"IP-Adapter {name!r}: its image projection makes {tokens}-wide tokens "
                                             f"but its to_k_ip / to_v_ip layers take {'/'.join(map(str, taken))}-wide "
                                             "ones: the file is inconsistent; use an intact copy")

    def _encoder(self, folder: str) -> tuple[Any, Any]:
        got = self._encoders.get(folder)
        if got is None:
            from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection
            try:  # streamed, checked: a folder rewritten in place meanwhile is an error, never SIGBUS
                model = load_part(CLIPVisionModelWithProjection, folder, f"the image encoder in {folder!r}",
                                  dtype=self.dtype, device=self.device, pickle=False)
            except UnreadableWeights as e:
                raise ParamError("image_prompts", relative_paths(str(e), self.catalog.root)) from None
            except Exception as e:
                why = relative_paths(f"the image encoder in {folder!r} could not be read ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0][:160]})", self.catalog.root)
                raise ParamError("image_prompts", why) from None
            size = model.config.image_size  # diffusers' load_ip_adapter's processor when the pipeline has none
            got = self._encoders[folder] = (model.to(self.device).eval(), CLIPImageProcessor(size=size, crop_size=size))
        return got

    def _embed(self, adapter: _Adapter, images: tuple[np.ndarray, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(image embeddings, negative ones) [images, ...] as diffusers' `encode_image` makes them."""
        digest = hashlib.sha256()
        for img in images:
            digest.update(str(img.shape).encode())
            digest.update(np.ascontiguousarray(img).tobytes())
        key = (adapter.encoder, adapter.hidden_states, digest.hexdigest())
        got = self._embeds.get(key)
        if got is not None:
            self._embeds.move_to_end(key)
            return got
        model, processor = self._encoder(adapter.encoder)
        side = int(processor.size.get("shortest_edge", 0))  # its shortest side resized to this, aspect kept
        for img in images:
            h, w = img.shape[:2]
            if side * side * max(h, w) / min(h, w) > MAX_CONTROL_PIXELS:  # that resized whole would be huge
                raise ParamError("image_prompts", f"an image prompt's image {w}x{h} is too long and narrow for the "
                                                 f"image encoder; crop it to an aspect of at most "
                                                 f"{MAX_CONTROL_PIXELS // side ** 2}:1")
        from PIL import Image
        pixels = processor([Image.fromarray(i) for i in images], return_tensors="pt").pixel_values
        pixels = pixels.to(self.device, model.dtype)
        if adapter.hidden_states:
            embeds = model(pixels, output_hidden_states=True).hidden_states[-2]
            negative = model(torch.zeros_like(pixels), output_hidden_states=True).hidden_states[-2]
        else:
            embeds = model(pixels).image_embeds
            negative = torch.zeros_like(embeds)
        got = self._embeds[key] = (embeds, negative)
        while len(self._embeds) > 64:
            self._embeds.popitem(last=False)
        return got


def resolve_image_prompt(prompts: IPAdapters | None, request: GenerationRequest) -> dict[str, torch.Tensor]:
    """A request's image-prompt fields, resolved on the submitting thread. Raises ParamError("image_prompts")."""
    if request.image_prompts is None:
        return {}
    if prompts is None:
        raise ParamError("image_prompts", "this engine serves no IP-Adapters; start it with --ip-adapter-dir DIR "
                                         "(Engine(ip_adapter_dir=...))")
    return prompts.resolve(request)
