"""GraphedUNet: bucketed CUDA-graph replays of a diffusers UNet, as a drop-in for diffusers users.

    pipe.unet = GraphedUNet(pipe.unet, batch_buckets=(1, 2, 4, 8, 16), resolutions=[(512, 512)])

Buckets count the UNet's own batch (classifier-free guidance doubles the images). A call whose
latent size is a captured resolution and whose batch fits a bucket is padded to the bucket, copied
into static inputs and replayed; anything else (another size, more rows, extra inputs such as
ControlNet residuals, a capture failure) runs the wrapped UNet eagerly. Outputs are sliced and
cloned, so they never alias a buffer that a later replay overwrites. Attribute access (config,
dtype, device, ...) falls through to the wrapped UNet, so pipelines keep working.

Never stale: a captured graph holds the weight pointers and every Python value (peft's LoRA scalings and active
adapters, attention processors) of its capture. Before each replay the wrapper compares a signature of the UNet
(its modules, their parameters' and buffers' storage, peft adapter state, attention processors) with the one its
graphs were captured under; when it changed (load_lora_weights, set_adapters, fuse_lora, unload_lora_weights, a
replaced parameter) the graphs are dropped and recaptured on their next use (counted: `recaptures`, and per key
`invalidations` in the graph table). An in-place update of a weight (`param.data.copy_(...)`) keeps the storage,
so the graphs read the new values with no recapture.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ..config import DEFAULT_BUCKETS, GraphConfig
from .runner import GraphRunner, StatelessGraphable

_PLAIN_KWARGS = ("class_labels", "timestep_cond", "attention_mask", "cross_attention_kwargs",
                 "down_block_additional_residuals", "mid_block_additional_residual",
                 "down_intrablock_additional_residuals", "encoder_attention_mask")


class _UNetGraph(StatelessGraphable):
    kind = "unet"

    def __init__(self, unet: torch.nn.Module, resolutions: tuple[tuple[int, int], ...], buckets: tuple[int, ...]):
        self.unet = unet
        self._resolutions = resolutions  # latent (h, w)
        self._buckets = buckets
        self.static: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def buckets(self) -> tuple[int, ...]:
        return self._buckets

    def resolutions(self) -> tuple[tuple[int, int], ...]:
        return self._resolutions

    def allocate(self, h: int, w: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Static inputs at the largest bucket, shaped after one real call's inputs."""
        if (h, w) not in self.static:
            rows = max(self._buckets)
            self.static[(h, w)] = {k: torch.zeros((rows, *v.shape[1:]), dtype=v.dtype, device=v.device)
                                   for k, v in like.items()}
        return self.static[(h, w)]

    def run(self, h: int, w: int, b: int) -> torch.Tensor:
        s = self.static[(h, w)]
        added = {"text_embeds": s["text_embeds"][:b], "time_ids": s["time_ids"][:b]} if "text_embeds" in s else None
        return self.unet(s["sample"][:b], s["timestep"][:b], encoder_hidden_states=s["encoder_hidden_states"][:b],
                         added_cond_kwargs=added, return_dict=False)[0]



class GraphedUNet(torch.nn.Module):
    def __init__(self, unet: torch.nn.Module, batch_buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 resolutions: list[tuple[int, int]] | None = None, vae_scale_factor: int = 8,
                 config: GraphConfig | None = None):
        """resolutions: image (height, width) pairs; default the UNet's native sample size."""
        super().__init__()
        self.unet = unet
        if resolutions is None:
            n = int(unet.config.sample_size) * vae_scale_factor
            resolutions = [(n, n)]
        latent_res = tuple((h // vae_scale_factor, w // vae_scale_factor) for h, w in resolutions)
        cfg = config or GraphConfig(batch_buckets=tuple(sorted(batch_buckets)))
        if cfg.backend == "cuda" and torch.device(unet.device).type != "cuda":
            raise ValueError(f"GraphedUNet needs a UNet on a CUDA device (this one is on {unet.device}); move the "
                             "pipeline to the GPU first (pipe.to('cuda')), or keep the plain UNet on the CPU")
        self.runner = GraphRunner(cfg, unet.device)
        self.graph = _UNetGraph(unet, latent_res, cfg.batch_buckets)
        self.runner.register(self.graph)
        self.recaptures = 0  # times the graphs were dropped because the UNet changed
        self._signature = unet_signature(unet)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["unet"], name)

    def graph_table(self) -> list[dict[str, Any]]:
        return self.runner.table()

    def _graphable(self, kwargs: dict[str, Any]) -> bool:
        if any(kwargs.get(k) is not None for k in _PLAIN_KWARGS):
            return False
        added = kwargs.get("added_cond_kwargs")
        return added is None or set(added) == {"text_embeds", "time_ids"}

    def forward(self, sample: torch.Tensor, timestep: Any, encoder_hidden_states: torch.Tensor, *args: Any,
                return_dict: bool = True, **kwargs: Any) -> Any:
        n, _, h, w = sample.shape
        out = None
        if not args and self._graphable(kwargs) and not torch.is_grad_enabled():
            out = self._replay(sample, timestep, encoder_hidden_states, kwargs.get("added_cond_kwargs"))
        if out is None:
            return self.unet(sample, timestep, encoder_hidden_states, *args, return_dict=return_dict, **kwargs)
        return SimpleNamespace(sample=out) if return_dict else (out,)

    def _replay(self, sample: torch.Tensor, timestep: Any, encoder_hidden_states: torch.Tensor,
                added: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        """Pads the call to its bucket and replays; None when no graph covers it (the caller runs eagerly)."""
        n, _, h, w = sample.shape
        if (h, w) not in self.graph.resolutions() or n > max(self.graph.buckets()):
            self.runner.bucket("unet", h, w, n)  # counts the uncovered call
            return None
        t = torch.as_tensor(timestep, device=sample.device).float().reshape(-1).expand(n)
        inputs = {"sample": sample, "timestep": t, "encoder_hidden_states": encoder_hidden_states}
        if added is not None:
            inputs["text_embeds"] = added["text_embeds"]
            inputs["time_ids"] = added["time_ids"]
        signature = unet_signature(self.unet)
        if signature != self._signature:  # weights replaced or modules / adapter state changed since capture
            if self.runner.invalidate("unet"):
                self.recaptures += 1
            self._signature = signature
        static = self.graph.allocate(h, w, inputs)
        if set(static) != set(inputs) or any(static[k].shape[1:] != v.shape[1:] or static[k].dtype != v.dtype
                                             for k, v in inputs.items()):
            return None  # another prompt length, dtype or conditioning than the graphs were built for
        # inputs go in before the bucket is chosen: a first-use capture warms up on this real batch
        for k, v in inputs.items():
            static[k][:n].copy_(v)
        bucket = self.runner.bucket("unet", h, w, n)
        if bucket is None:
            return None
        for v in static.values():
            if bucket > n:
                v[n:bucket].copy_(v[:1].expand(bucket - n, *v.shape[1:]))  # padding rows: copies of a live row
        return self.runner.replay("unet", h, w, bucket)[:n].clone()


def unet_signature(unet: torch.nn.Module) -> tuple:
    """What a captured graph depends on beyond tensor values: every module, the storage of every parameter and
    buffer, peft's per-layer adapter state (scalings are Python floats a capture freezes; active, merged and disabled
    adapters), and attention processors."""
    parts: list[Any] = []
    for module in unet.modules():
        parts.append(id(module))
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            parts.append(None if tensor is None else tensor.data_ptr())
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict):  # a peft LoRA layer
            parts.append((tuple(sorted(scaling.items())), tuple(getattr(module, "active_adapters", ()) or ()),
                          tuple(getattr(module, "merged_adapters", ()) or ()),
                          bool(getattr(module, "disable_adapters", False))))
        processor = module.__dict__.get("processor")
        if processor is not None:
            parts.append(id(processor))
    return tuple(parts)
