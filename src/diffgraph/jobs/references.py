"""What a job's items name, looked up when the job is submitted: LoRA adapters (listed, or `<lora:...>` tags), the
ControlNets of its controls, its IP-Adapter and the embeddings its a1111-syntax prompts name (`embedding:NAME`). A
job naming one this server cannot serve (unknown, a name that is not allowed, a file that is not what its folder
says, or a kind of model the server has no folder for) is refused whole, a 400 naming the item and the reference,
before anything of it is stored; the served model itself is checked by the images route's rules
(requests.generation_request).

Torch-free: the folders' own catalogs (lora/catalog.py, models/controlnet_dir.py, models/ip_adapter_dir.py,
text/embeddings.py: names, stats, headers), as the listings read them. Whether a file's weights fit the model (an
SDXL adapter on SD1.5) is still the engine's check, per candidate. `References.checker()` is one job's check: each
name is looked up once per job, however many items name it.
"""

from __future__ import annotations

import difflib
from typing import Callable

from ..config import LoraConfig
from ..errors import ParamError
from ..lora.catalog import AdapterDir, AdapterNameError, AdapterNotFound
from ..models.controlnet_dir import ControlNetDir
from ..models.ip_adapter_dir import IPAdapterDir
from ..models.presets import builtin_control_folder, builtin_lora_folder
from ..request import GenerationRequest
from ..api.config import ServerConfig
from ..text.embeddings import EmbeddingDir, EmbeddingError

RequestCheck = Callable[[GenerationRequest], None]  # raises ParamError naming the request field
Once = Callable[[str, str, Callable[[str], object]], None]  # (kind, name, look-up): a look-up made once per job


class References:
    """The folders of one server (`config`): what its requests may name."""

    def __init__(self, config: ServerConfig):
        builtin = builtin_lora_folder(config.model)
        self.lora_dirs = tuple(AdapterDir(d) for d in (config.lora_dir, builtin) if d)  # the lora dir shadows
        self.lora_slots = LoraConfig(config.lora_dir, config.max_loras, builtin_dir=builtin).slots
        self.max_request_loras = config.max_request_loras
        roots = tuple(r for r in (config.controlnet_dir, builtin_control_folder(config.model)) if r)
        self.controlnets = ControlNetDir(*roots) if roots else None
        self.max_controlnets = config.max_controlnets
        self.ip_adapters = IPAdapterDir(config.ip_adapter_dir) if config.ip_adapter_dir else None
        self.embeddings = EmbeddingDir(config.embeddings_dir) if config.embeddings_dir else None

    def checker(self) -> RequestCheck:
        """One job's check of a request's references (ParamError); a name found once is not looked up again."""
        found: set[tuple[str, str]] = set()

        def once(kind: str, name: str, look: Callable[[str], object]) -> None:
            if (kind, name) not in found:
                look(name)
                found.add((kind, name))

        def check(request: GenerationRequest) -> None:
            self._loras(request, once)
            self._controls(request, once)
            self._image_prompt(request, once)
            self._embeddings(request, once)
        return check

    def _loras(self, request: GenerationRequest, once: Once) -> None:
        if not request.loras:
            return
        if not self.lora_slots:
            raise ParamError("loras", f"adapter {request.loras[0][0]!r}: this server has no adapter slots; start it "
                                      "with --lora-dir DIR (or --max-loras N) to use LoRAs")
        if len(request.loras) > self.max_request_loras:
            raise ParamError("loras", f"{len(request.loras)} adapters in one item; this server takes at most "
                                      f"{self.max_request_loras} (--max-request-loras): send fewer")
        if len(request.loras) > self.lora_slots:
            raise ParamError("loras", f"{len(request.loras)} adapters in one item, but this server has "
                                      f"{self.lora_slots} adapter slots; use fewer or start it with a larger "
                                      "--max-loras")
        for name, _ in request.loras:
            once("lora", name, self._lora)

    def _lora(self, name: str) -> None:
        names: list[str] = []
        for folder in self.lora_dirs:
            try:
                folder.path(name)  # the name rules, links out of the folder, the entry's type and size by a stat
                return
            except AdapterNotFound:
                names += folder.listing().adapters
            except AdapterNameError as e:
                raise ParamError("loras", str(e)) from None
        known = sorted(set(names))
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)  # as the engine's LoraManager says it
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else \
            f"known: {', '.join(known[:10]) or 'none'} (GET /v1/loras lists them)"
        raise ParamError("loras", f"adapter {name!r} is unknown; {hint}")

    def _controls(self, request: GenerationRequest, once: Once) -> None:
        if not request.controls:
            return
        names = list(dict.fromkeys(c.model for c in request.controls))
        if self.controlnets is None:
            raise ParamError("controls", f"ControlNet {names[0]!r}: this server serves no ControlNets; start it with "
                                         "--controlnet-dir DIR")
        if len(names) > self.max_controlnets:
            raise ParamError("controls", f"this item names {len(names)} different ControlNets; this server holds at "
                                         f"most {self.max_controlnets} at once (--max-controlnets)")
        for name in names:
            once("controlnet", name, self.controlnets.folder)

    def _image_prompt(self, request: GenerationRequest, once: Once) -> None:
        if request.image_prompts is None:
            return
        name = request.image_prompts.model
        if self.ip_adapters is None:
            raise ParamError("image_prompts", f"IP-Adapter {name or '(the only one)'!r}: this server serves no "
                                              "IP-Adapters; start it with --ip-adapter-dir DIR")
        once("ip-adapter", name or "", self._ip_adapter)

    def _ip_adapter(self, name: str) -> None:
        catalog = self.ip_adapters
        catalog.encoder(catalog.file(name or catalog.only()))  # its file, what the file holds, its image encoder

    def _embeddings(self, request: GenerationRequest, once: Once) -> None:
        if request.prompt_syntax != "a1111":
            return
        from ..prompt_syntax import schedule_a1111  # pure Python

        for field in ("prompt", "negative_prompt"):
            text = getattr(request, field)
            entries = schedule_a1111(text, field, request.num_inference_steps) if text else ()
            for name in dict.fromkeys(n for _, _, parsed in entries for n in parsed.embeddings):
                if self.embeddings is None:
                    raise ParamError(field, f"{field} names embedding {name!r}, but no embeddings are served; start "
                                            "the server with --embeddings-dir DIR holding NAME.safetensors")
                once("embedding", name, lambda n, field=field: self._embedding(n, field))

    def _embedding(self, name: str, field: str) -> None:
        try:
            self.embeddings.stamp(name)  # the name rules, the file there, its type and size
        except EmbeddingError as e:
            raise ParamError(field, f"{field}: {e}") from None
