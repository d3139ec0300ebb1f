"""`ControlNets`: the ControlNet models of a `--controlnet-dir` and which device slot holds which.

The folder's ControlNets are diffusers folders (a `config.json` whose `_class_name` is ControlNetModel and its
safetensors weights), each named by its path relative to the folder with "/" between folders; one added later is
found without a restart. Names follow `--lora-dir`'s rules: relative, no "..", backslashes or NUL, nothing resolving
outside the folder; pickled weights are never loaded (diffusers' `use_safetensors=True`).

A request's controls are resolved on the submitting thread (`resolve`): each name found, its weights read into a host
copy (streamed tensor by tensor, never a map of the user's file: `stream_load`; a file rewritten meanwhile is the
caller's 400, not a SIGBUS), its architecture checked against the UNet (a ControlNet of another family is the caller's
400), and its control image prepared as diffusers' ControlNet pipelines prepare it (`VaeImageProcessor` without
normalisation: resized to the output size, RGB in [0, 1]). The host copies, the admission gate over `slots` device
slots and the loads between steps are features/slot_files.py's `SlotFiles` (`files`); placing a ControlNet in its
slot (`_place`) copies it into the slot's module in place where it holds one of the same architecture (its CUDA graphs
stay valid: engine/control_graphs.py), else makes a new module.
`module(slot)` is what the step's ControlNet prepass runs (features/control.py, through control_graphs.py).
"""

from __future__ import annotations

import copy
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ParamError, relative_paths
from ..features.slot_files import SlotFiles, file_version
from ..models.controlnet_dir import CLASS_NAME, WEIGHTS, ControlNetDir
from ..models.stream_load import load_part
from ..models.weights_view import UnreadableWeights
from ..control_maps import control_map, fit_map
from ..request import CONTROL_MODES, GenerationRequest

# the UNet config fields a ControlNet must share with the UNet it steers (its residuals' shapes, its conditioning)
MATCHING = ("block_out_channels", "layers_per_block", "cross_attention_dim")


@dataclass(frozen=True, eq=False)
class ResolvedControl:
    key: tuple          # (name, version of its weights file)
    image: torch.Tensor  # [1, 3, H, W] float32 in [0, 1] at the request's size
    mode: int = 0       # its control mode's index in CONTROL_MODES (balanced, prompt, control)
    net: torch.nn.Module | None = None  # its host copy, held until the request is done (the cache may drop it)

    @property
    def host(self) -> torch.nn.Module | None:  # (slot_files.Held's)
        return self.net


class ControlNets:
    name = "control"  # its admission gate's name (RequestState.admitted)

    def __init__(self, roots: tuple[str, ...], device: torch.device, dtype: torch.dtype, unet_config: Any, slots: int = 2,
                 vae_scale_factor: int = 8):
        self.catalog = ControlNetDir(*roots)
        self.root = self.catalog.root
        self.device, self.dtype, self._unet = device, dtype, unet_config
        self.files = SlotFiles(self.name, "controls", self._locate, self._read, slots=slots, place=self._place,
                               listing=lambda: self.catalog.listing(), held_of=lambda s: s.controls,
                               limit="--max-controlnets", what="ControlNet")
        self.slots = self.files.slots
        self.pixels_per_latent = vae_scale_factor
        self._modules: dict[int, torch.nn.Module] = {}
        self._stepping: dict[int, torch.nn.Module] = {}  # slot -> its module after the conditioning embedding
        self._lock = threading.Lock()  # the single files' config folders: submitting threads may ask at once
        self._config_dir: Any = None  # a TemporaryDirectory of single files' config folders, made on first use
        self._configs: dict[int, str] = {}

    # -- on the submitting thread ----------------------------------------------------------------------
    def resolve(self, request: GenerationRequest) -> tuple[ResolvedControl, ...]:
        """The request's controls found, read and checked, their images prepared. Raises ParamError("controls")."""
        held = {h.name: h for h in self.files.resolve([c.model for c in request.controls])}
        return tuple(ResolvedControl(held[c.model].key, self._prepare(control_map(c), request.width, request.height,
                                                                      c.resize_mode),
                                     list(CONTROL_MODES).index(c.control_mode), held[c.model].host)
                     for c in request.controls)

    def _locate(self, name: str) -> tuple[str, tuple]:
        folder = self.catalog.folder(name)  # a diffusers folder, or a single file
        return folder, file_version(folder if os.path.isfile(folder) else os.path.join(folder, WEIGHTS))

    def _read(self, name: str, folder: str) -> torch.nn.Module:
        from diffusers import ControlNetModel
        try:
            if os.path.isfile(folder):
                net = self._single_file(folder)
            else:  # streamed, checked: a folder rewritten in place meanwhile is an error, never SIGBUS
                net = load_part(ControlNetModel, folder, f"ControlNet {name!r}", dtype=self.dtype, pickle=False)
        except ParamError:
            raise
        except UnreadableWeights as e:
            raise ParamError("controls", relative_paths(str(e), *self.catalog.roots)) from None
        except Exception as e:
            why = relative_paths(str(e).splitlines()[0], *self.catalog.roots)  # (diffusers names whole paths)
            raise ParamError("controls", f"ControlNet {name!r} could not be read: {why}") from None
        wrong = [f for f in MATCHING if _norm(getattr(net.config, f, None)) != _norm(getattr(self._unet, f, None))]
        # it takes the latents (the UNet's output channels, an inpainting UNet's too) and an RGB control image
        wrong += [f for f, want in (("in_channels", getattr(self._unet, "out_channels", 4)),
                                    ("conditioning_channels", 3)) if getattr(net.config, f, want) != want]
        if wrong:
            raise ParamError("controls", f"ControlNet {name!r} is for another model family: its {', '.join(wrong)} "
                                         "differ from this model's UNet; use a ControlNet trained for this model")
        return net.eval().requires_grad_(False)

    def _single_file(self, path: str) -> torch.nn.Module:
        """An AUTOMATIC1111 / ComfyUI single-file ControlNet, through diffusers' single-file reader, offline: its
        config is this UNet's (a ControlNet mirrors the UNet it steers; its input channels from the file), written
        to a folder of this object's, and the file streamed into host tensors first (`safe_tensors`, never mapped: a
        file rewritten while it is read is refused, not a crash)."""
        from diffusers import ControlNetModel
        from diffusers.loaders.single_file_utils import convert_controlnet_checkpoint

        from ..safe_files import FileChanged, UnusableFile
        from ..safe_tensors import CHANGED_FIX, read_safetensors
        try:
            state = read_safetensors(path, 64 << 30)
        except UnusableFile as e:
            fix = f"; {CHANGED_FIX}" if isinstance(e, FileChanged) else ""
            raise ParamError("controls", f"ControlNet file {os.path.basename(path)!r} {e}{fix}") from None
        conv_in = next((state[k] for k in ("control_model.input_blocks.0.0.weight", "input_blocks.0.0.weight",
                                           "conv_in.weight") if k in state), None)
        config = ControlNetModel.load_config(self._config_folder(int(conv_in.shape[1]) if conv_in is not None else 4))
        converted = convert_controlnet_checkpoint(state, config)
        for p in ("control_model.", ""):  # SDXL's added embedding, which diffusers' converter leaves out
            for i, j in ((0, 1), (2, 2)):
                for leaf in ("weight", "bias"):
                    if f"{p}label_emb.0.{i}.{leaf}" in state:
                        converted.setdefault(f"add_embedding.linear_{j}.{leaf}", state[f"{p}label_emb.0.{i}.{leaf}"])
        with torch.device("meta"):
            net = ControlNetModel.from_config(config)
        try:
            net.load_state_dict(converted, strict=True, assign=True)
        except RuntimeError as e:
            raise ParamError("controls", f"ControlNet file {os.path.basename(path)!r} does not fit this model's "
                                         f"ControlNet (another model family?): {' '.join(str(e).split())[:240]}") from None
        return net.to(self.dtype)

    def _config_folder(self, in_channels: int) -> str:
        """A diffusers ControlNet config folder for this UNet (ControlNetModel.from_unet's fields)."""
        with self._lock:  # submitting threads may ask at once
            return self._configs.get(in_channels) or self._write_config(in_channels)

    def _write_config(self, in_channels: int) -> str:
        import inspect
        import json
        import tempfile

        from diffusers import ControlNetModel
        if self._config_dir is None:
            self._config_dir = tempfile.TemporaryDirectory(prefix="diffgraph-controlnet-config-")
        params = set(inspect.signature(ControlNetModel.__init__).parameters) - {"self"}
        config = {k: v for k, v in dict(self._unet).items() if k in params and not k.startswith("_")}
        config.update(_class_name=CLASS_NAME, in_channels=in_channels, conditioning_channels=3)
        folder = os.path.join(self._config_dir.name, str(in_channels))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        self._configs[in_channels] = folder
        return folder

    def _prepare(self, pixels: np.ndarray, width: int, height: int, resize_mode: str = "just_resize") -> torch.Tensor:
        """The control map as diffusers' ControlNet pipelines prepare it, after AUTOMATIC1111's resize mode."""
        from diffusers.image_processor import VaeImageProcessor
        from PIL import Image
        processor = VaeImageProcessor(vae_scale_factor=self.pixels_per_latent, do_convert_rgb=True, do_normalize=False)
        # fitted first (control_maps.py: what the playground shows), then diffusers' processor (its resize a no-op)
        return processor.preprocess(Image.fromarray(fit_map(pixels, width, height, resize_mode)), height=height,
                                    width=width).float()

    # -- the admission gate (the loop thread, under the scheduler's lock): the files' ---------------------
    def can_admit(self, state: Any) -> bool:
        return self.files.can_admit(state)

    def admit(self, state: Any) -> list[int] | None:
        """Pins a slot per distinct ControlNet of the request (all or none); None: it waits."""
        return self.files.admit(state)

    def release(self, state: Any, taken: list[int]) -> None:
        self.files.release(state, taken)

    def load_admitted(self) -> dict[int, str]:
        """Places the ControlNets admitted this step into their slots; returns slot -> reason for those that failed
        (a request resolved without its host copy: it fails alone)."""
        return self.files.load_admitted()

    def _place(self, slot: int, host: torch.nn.Module) -> None:
        current = self._modules.get(slot)
        if current is not None and same_architecture(current, host):  # in place: the slot's graphs stay valid
            with torch.no_grad():
                for dst, src in zip(current.state_dict().values(), host.state_dict().values()):
                    dst.copy_(src)
        else:
            self._modules.pop(slot, None)
            self._stepping.pop(slot, None)  # the old view holds the old weights too: free both first
            self._modules[slot] = copy.deepcopy(host).to(self.device)
            self._stepping[slot] = after_embedding(self._modules[slot])

    def admitted(self, state: Any, taken: list[int]) -> list[tuple[int, torch.Tensor, int]]:
        """(slot, control embedding, control mode) per control of an admitted request: the embedding is the slot's
        `controlnet_cond_embedding` of the control image ([1, block_out_channels[0], h, w] at the latent size, in the
        ControlNet's dtype), computed once here, as diffusers' forward computes it at every step (a bgr ControlNet's
        channels flipped first). The step then runs `module(slot)`, which takes it in place of the image."""
        slot_of = self.files.slot_map(state, taken)
        out = []
        for r in state.controls:
            slot = slot_of[r.key[0]]
            out.append((slot, control_embedding(self._modules[slot], r.image.to(self.device)), r.mode))
        return out

    def module(self, slot: int) -> torch.nn.Module:
        """Slot `slot`'s ControlNet after its conditioning embedding: its `controlnet_cond` is the embedding that
        `admitted` computed (`after_embedding`)."""
        return self._stepping[slot]


def control_embedding(net: torch.nn.Module, image: torch.Tensor) -> torch.Tensor:
    """What diffusers' ControlNetModel.forward makes of `controlnet_cond` before adding it to its input: the image
    ([b, 3, H, W]) in the net's channel order, through its `controlnet_cond_embedding`."""
    image = image.to(net.dtype)
    if net.config.controlnet_conditioning_channel_order == "bgr":
        image = torch.flip(image, dims=[1])
    with torch.no_grad():
        return net.controlnet_cond_embedding(image)


def after_embedding(net: torch.nn.Module) -> torch.nn.Module:
    """A view of diffusers' ControlNetModel `net` whose `controlnet_cond` is the output of its
    `controlnet_cond_embedding`, not the control image: the embedding an identity, the channel order rgb (the flip
    belongs before the embedding). It shares every parameter and buffer with `net`, so weights copied into `net` in
    place are its weights too."""
    view = copy.copy(net)
    view._modules = dict(net._modules)
    view._modules["controlnet_cond_embedding"] = torch.nn.Identity()
    view._internal_dict = type(net.config)({**net.config, "controlnet_conditioning_channel_order": "rgb"})
    return view


def same_architecture(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether `b`'s weights can be copied into `a` in place: the same config and the same tensors, in order."""
    if {k: v for k, v in a.config.items() if not k.startswith("_")} != {
            k: v for k, v in b.config.items() if not k.startswith("_")}:
        return False
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(sa[k].shape == sb[k].shape and sa[k].dtype == sb[k].dtype for k in sa)


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def resolve_controls(controls: ControlNets | None, request: GenerationRequest) -> tuple[ResolvedControl, ...]:
    """A request's controls resolved on the submitting thread. Raises ParamError("controls")."""
    if not request.controls:
        return ()
    if controls is None:
        raise ParamError("controls", "this engine serves no ControlNets; start it with --controlnet-dir DIR "
                                     "(Engine(controlnet_dir=...))")
    return controls.resolve(request)
