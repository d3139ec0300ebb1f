"""`ControlRunner`: how the step's ControlNet prepass runs a loaded ControlNet over its gathered rows.

Each device slot's ControlNet is its own graph kind, `control<slot>`, per (resolution, gathered bucket): the rows of
the step that use it are gathered (features/control.py), copied into static inputs shared by every slot (one set
per resolution, at the largest bucket: replays never overlap), and the slot's graph replays over the smallest
bucket that holds them; its residuals (in the graph pool) are read right after, before any other replay. So a
ControlNet costs the rows that use it, whatever the step's batch, and the step graph itself has one variant for
every ControlNet mix.

Capture: a slot's graphs are captured, every bucket at once, before the first prepass that runs a new module
object in that slot (the first ControlNet loaded into it, or one of another architecture). A ControlNet of the same
architecture is copied into the slot's module in place (engine/controlnets.py), so switching between loaded
ControlNets never captures. Where a call does not fit the static inputs (a step with longer prompt windows than the
first one seen: another token count) or no graph covers it, the ControlNet runs eagerly on the gathered rows.

In the compile tier the graphs capture the ControlNet compiled by Inductor (one `Compiled` for every slot: the batch
is dynamic, so one compile serves the buckets above 1 of a resolution, and ControlNets of one architecture share
it, the weights being graph inputs); the eager paths run the plain call.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol, Sequence

import torch

from ..config import CompileConfig
from ..graphs.compiled import Compiled
from ..graphs.runner import GraphRunner, StatelessGraphable

# Inductor options of the ControlNet's compile beyond its mode's: none. Its batch is dynamic, so Inductor skips its
# channels-last layout optimisation, which the step and the 16-bit VAE decoder force (engine/graph_setup.py); not
# measured for the ControlNet yet (`tools/bench_control.py --compile --force-layout` sets this to measure it)
CONTROL_OPTIONS: dict[str, Any] = {}

logger = logging.getLogger(__name__)

# (net, x, t, conditioning, row inputs, control embedding) -> (down-block residuals, mid-block residual): the family's
NetCall = Callable[[Any, torch.Tensor, torch.Tensor, dict, dict, torch.Tensor],
                   tuple[Sequence[torch.Tensor], torch.Tensor]]


def _batch_tensors(args: tuple) -> list[torch.Tensor]:
    """The tensors of a `NetCall`'s arguments whose first dimension is the gathered rows (all of them)."""
    _net, x, t, cond, inputs, image = args
    return [x, t, image, *cond.values(), *inputs.values()]


class SlotModules(Protocol):
    """The loaded ControlNets by device slot (engine/controlnets.py:ControlNets)."""

    pixels_per_latent: int

    def module(self, slot: int) -> torch.nn.Module: ...


class _Statics:
    """The gathered inputs of one resolution, [largest bucket, ...] per tensor, allocated on first use from that
    call's per-row shapes."""

    def __init__(self, rows: int, inputs: dict[str, torch.Tensor]):
        self.shapes = {name: tuple(t.shape[1:]) for name, t in inputs.items()}
        self.tensors = {name: torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
                        for name, t in inputs.items()}

    def fits(self, inputs: dict[str, torch.Tensor]) -> bool:
        return self.shapes == {name: tuple(t.shape[1:]) for name, t in inputs.items()} and all(
            self.tensors[name].dtype == t.dtype for name, t in inputs.items())

    def write(self, inputs: dict[str, torch.Tensor], bucket: int) -> None:
        for name, t in inputs.items():
            static = self.tensors[name]
            static[:t.shape[0]].copy_(t)
            static[t.shape[0]:bucket] = static[0]  # padding rows: a copy of a real row, always a valid input


def _flat(x: torch.Tensor, t: torch.Tensor, cond: dict, inputs: dict, image: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"x": x, "t": t, "image": image, **{f"cond.{k}": v for k, v in cond.items()},
            **{f"rows.{k}": v for k, v in inputs.items()}}


def _unflat(tensors: dict[str, torch.Tensor], b: int) -> tuple:
    cond = {k[5:]: v[:b] for k, v in tensors.items() if k.startswith("cond.")}
    rows = {k[5:]: v[:b] for k, v in tensors.items() if k.startswith("rows.")}
    return tensors["x"][:b], tensors["t"][:b], cond, rows, tensors["image"][:b]


class ControlGraph(StatelessGraphable):
    """One slot's ControlNet over the shared static inputs of a resolution."""

    def __init__(self, slot: int, call: Callable[[int, tuple], tuple], statics: dict[tuple[int, int], _Statics],
                 resolutions: tuple[tuple[int, int], ...], buckets: tuple[int, ...]):
        self.kind = f"control{slot}"
        self.slot = slot
        self._call, self._statics = call, statics
        self._resolutions, self._buckets = resolutions, buckets

    def buckets(self) -> tuple[int, ...]:
        return self._buckets

    def resolutions(self) -> tuple[tuple[int, int], ...]:
        return self._resolutions

    def run(self, h: int, w: int, b: int) -> Any:
        downs, mid = self._call(self.slot, _unflat(self._statics[(h, w)].tensors, b))
        return (*downs, mid)


class ControlRunner:
    """Runs slot `s`'s ControlNet over gathered rows: `run(slot, x, t, cond, inputs, image)` (what
    features/control.py's ControlRows calls), graphed where `attach` gave it a graph runner."""

    def __init__(self, nets: SlotModules, call: NetCall):
        self._nets, self._net_call = nets, call
        self._graphed_call: NetCall = call  # what the graphs capture: `call`, or it compiled (compile tier)
        self._graphs: GraphRunner | None = None
        self._resolutions: tuple[tuple[int, int], ...] = ()
        self._buckets: tuple[int, ...] = ()
        self._statics: dict[tuple[int, int], _Statics] = {}
        # (slot, resolution) -> the module its graphs were captured on
        self._captured: dict[tuple[int, tuple[int, int]], torch.nn.Module] = {}

    def attach(self, graphs: GraphRunner, resolutions: tuple[tuple[int, int], ...], buckets: tuple[int, ...],
               compile: CompileConfig | None = None) -> list[Compiled]:
        """Graph the ControlNets at these resolutions and gathered buckets (the step graphs' own); with `compile`,
        the graphs hold the ControlNet compiled, and the list returned has its `Compiled` (the engine's compile
        stats count it)."""
        self._graphs, self._resolutions, self._buckets = graphs, resolutions, buckets
        if compile is None:
            return []
        compiled = Compiled(self._net_call, compile, "the ControlNet", _batch_tensors, options=CONTROL_OPTIONS)
        self._graphed_call = compiled
        return [compiled]

    def _call(self, slot: int, args: tuple) -> tuple:
        return self._graphed_call(self._nets.module(slot), *args)

    def run(self, slot: int, x: torch.Tensor, t: torch.Tensor, cond: dict, inputs: dict,
            image: torch.Tensor) -> tuple[Sequence[torch.Tensor], torch.Tensor]:
        """The residuals of slot `slot`'s ControlNet for these rows ([rows, ...] each; graphed ones are the pool's,
        valid until the next replay of any graph: read them at once)."""
        scale = self._nets.pixels_per_latent  # `image` is the control embedding, at the latent size
        key = (x.shape[-2] * scale, x.shape[-1] * scale)  # the output size in pixels, as the step graphs' resolutions
        graphs = self._graphs
        if graphs is None or key not in self._resolutions:
            return self._net_call(self._nets.module(slot), x, t, cond, inputs, image)
        flat = _flat(x, t, cond, inputs, image)
        statics = self._statics.get(key)
        if statics is None:
            statics = self._statics[key] = _Statics(max(self._buckets), flat)
        if not statics.fits(flat):
            return self._net_call(self._nets.module(slot), x, t, cond, inputs, image)
        rows = x.shape[0]
        self._ensure(slot, key, statics, flat)
        bucket = graphs.bucket(f"control{slot}", key[0], key[1], rows)
        if bucket is None:
            return self._net_call(self._nets.module(slot), x, t, cond, inputs, image)
        statics.write(flat, bucket)
        out = graphs.replay(f"control{slot}", key[0], key[1], bucket)
        return [o[:rows] for o in out[:-1]], out[-1][:rows]

    def _ensure(self, slot: int, key: tuple[int, int], statics: _Statics, flat: dict[str, torch.Tensor]) -> None:
        """Captures slot `slot`'s graphs at this resolution, every bucket, when the slot's module is new here."""
        module = self._nets.module(slot)
        if self._captured.get((slot, key)) is module:
            return
        graphs = self._graphs
        kind = f"control{slot}"
        if kind not in graphs.kinds:
            graphs.register(ControlGraph(slot, self._call, self._statics, self._resolutions, self._buckets))
        if any(m is not module for (s, _), m in self._captured.items() if s == slot):  # another architecture
            graphs.invalidate(kind)
            self._captured = {k: m for k, m in self._captured.items() if k[0] != slot}
        statics.write(flat, max(self._buckets))
        captured = sum(graphs.capture((kind, *key, b)) for b in sorted(self._buckets, reverse=True)
                       if graphs.stats[(kind, *key, b)].status == "pending")
        self._captured[(slot, key)] = module
        logger.info("captured %d graph(s) of ControlNet slot %d at %dx%d (a new module in it; a ControlNet of the "
                    "same architecture is copied in place and captures nothing)", captured, slot, key[1], key[0])
