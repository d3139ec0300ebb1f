"""What the fp8 tier costs one model, measured against its 16-bit engine (`diffgraph compare --quantize fp8`).

`compare_fp8` builds the fp8 engine and then the 16-bit engine of the same model, one after the other (quantising
rewrites the denoiser's layers in place, so the two cannot share weights): each makes the same images (same prompts,
seeds and settings, one request at a time, so no batch companion enters a row's numbers), and the fp8 engine's first
denoiser call is recorded and run again through the 16-bit denoiser. It hands back a `CompareResult`: the
quantisation report, the relative L2 error of that one step's output, the mean and max pixel difference of the final
images, and for the digits presets the digits oracle's score of both. Random weights say little about a trained
model's activation outliers: this runs on the user's own checkpoint.

`seed_prompts` and `pixel_difference` are the measures tests/test_fp8_engine.py asserts on (its images made as
`generate_images` makes them, but submitted together, to share steps).
Both engines run eagerly (a recorded denoiser call needs a real forward, not a graph replay; the graphs replay
what the eager step computes).
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import numpy as np
import torch

from ..config import LoadOptions
from ..engine.engine import Engine
from ..models.digits_oracle import PROMPTS as DIGIT_PROMPTS
from ..models.digits_oracle import digit_prompt, train_oracle
from ..quantize.fp8 import Fp8Config, Fp8Report, relative_error

FIRST_SEED = 700
# prompts for a model that is not a digits preset, taken in turn over the seeds
PROMPTS = ("a photograph of a lighthouse on a cliff at dusk", "a portrait of an old fisherman, studio lighting",
           "a bowl of fruit on a wooden table, oil painting", "a city street in the rain at night, neon signs",
           "a red fox in a snowy forest, telephoto")


def seed_prompts(model: str, seeds: int, prompt: str | None = None) -> list[tuple[str, int | None]]:
    """(prompt, digit asked) per seed: for a digits preset (`digits_oracle.PROMPTS`) its prompt for digit `i % 10`
    (two seeds per digit in 20), else `prompt` (or PROMPTS in turn) and None."""
    if model in DIGIT_PROMPTS and prompt is None:
        return [(digit_prompt(model, i % 10), i % 10) for i in range(seeds)]
    return [(prompt or PROMPTS[i % len(PROMPTS)], None) for i in range(seeds)]


def generate_images(engine: Engine, prompts: list[tuple[str, int | None]], steps: int,
                    size: tuple[int, int] | None = None, guidance: float | None = None,
                    first_seed: int = FIRST_SEED) -> np.ndarray:
    """The images [n, H, W, 3] (float, 0..1) of one request per prompt, seed `first_seed + i`, one at a time;
    `size` (width, height), None: the model's native size; `guidance` None: the model's default."""
    width, height = size or (None, None)
    return np.stack([np.asarray(engine.generate(text, num_inference_steps=steps, guidance_scale=guidance,
                                                seed=first_seed + i, width=width, height=height).arrays)[0]
                     for i, (text, _) in enumerate(prompts)])


def pixel_difference(reference: np.ndarray, output: np.ndarray) -> tuple[float, float]:
    """(mean, max) of |output - reference| over every pixel and channel, in 8-bit levels (0..255) of the float
    pixels."""
    diff = np.abs(np.asarray(output, dtype=np.float64) - np.asarray(reference, dtype=np.float64)) * 255
    return float(diff.mean()), float(diff.max())


@dataclasses.dataclass(frozen=True)
class CompareResult:
    """The figures `compare_fp8` measured. `oracle_reference` / `oracle_fp8`: the fraction of images the digits
    oracle reads as the asked digit (None for a model that is not a digits preset, or without scikit-learn;
    `oracle_note` says which)."""
    model: str
    device: str
    reference_dtype: str      # the 16-bit engine's dtype (float32 on the CPU, where 16 bits is slow and no more exact)
    seeds: int
    steps: int
    size: tuple[int, int]     # (width, height)
    report: Fp8Report
    step_error: float         # relative L2 error of one denoiser call's output against the reference's
    pixel_mean: float
    pixel_max: float
    oracle_reference: float | None = None
    oracle_fp8: float | None = None
    oracle_note: str | None = None

    def format(self) -> str:
        lines = [f"{self.model}: fp8 against {self.reference_dtype} on {self.device}, {self.seeds} seed(s), "
                 f"{self.steps} steps, {self.size[0]}x{self.size[1]}",
                 f"  {self.report.summary()}",
                 f"  one denoiser step, relative L2 error: {self.step_error:.4f}",
                 f"  final images, pixel difference (0-255 levels): mean {self.pixel_mean:.2f}, max "
                 f"{self.pixel_max:.1f}"]
        scores = None if self.oracle_fp8 is None else [(self.reference_dtype, self.oracle_reference),
                                                       ("fp8", self.oracle_fp8)]
        return "\n".join(lines + oracle_lines(scores, self.oracle_note))


def oracle_lines(scores: list[tuple[str, Any]] | None, note: str | None) -> list[str]:
    """A compare report's digits-oracle line: each (name, score), or the note why none was scored; none: []."""
    if scores is not None:
        return ["  digits oracle (images read as the asked digit): " +
                ", ".join(f"{name} {score:.2f}" for name, score in scores)]
    return [f"  digits oracle: {note}"] if note else []


def digit_scores(prompts: list[tuple[str, int | None]], *images: np.ndarray) -> tuple[list[float] | None, str | None]:
    """The digits oracle's score of each image set ([n, H, W, 3] in 0..1) for `seed_prompts`' digit prompts: (scores,
    None); (None, why) without scikit-learn; (None, None) for prompts that ask no digit."""
    if prompts[0][1] is None:
        return None, None
    try:
        oracle = train_oracle()
    except ValueError as e:  # scikit-learn missing
        return None, f"not scored ({e})"
    asked = np.array([d for _, d in prompts])
    return [oracle.score(asked, x) for x in images], None


class _FirstCall:
    """Records a module's first forward call (its arguments and output, copied) through a forward hook."""

    def __init__(self, module: torch.nn.Module):
        self.args: tuple = ()
        self.kwargs: dict[str, Any] = {}
        self.output: torch.Tensor | None = None
        self._handle = module.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self.output is None:  # the buffers are rewritten by later steps: keep copies
            self.args, self.kwargs = _copied(args), _copied(kwargs)
            self.output = _sample(output).detach().clone()

    def close(self) -> None:
        self._handle.remove()


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


def _sample(output: Any) -> torch.Tensor:
    """A denoiser's prediction: `return_dict=False`'s first item, or the output's `sample`."""
    return output[0] if isinstance(output, (tuple, list)) else output.sample


def _release(device: str) -> None:
    """Frees what a closed engine held before the next one loads."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def compare_fp8(model: str, quantize: "str | Fp8Config" = "fp8", *, seeds: int = 20, steps: int = 20,
                size: tuple[int, int] | None = None, device: str | None = None, dtype: str | None = None,
                guidance: float | None = None, prompt: str | None = None,
                load: LoadOptions | None = None) -> CompareResult:
    """Measures the fp8 tier of `model` (a preset, a diffusers folder or a checkpoint file; `quantize` as
    `Engine(quantize=)` takes it: "fp8" or an Fp8Config) against its 16-bit engine over `seeds` images; `device`,
    `dtype` and `load` (how its files are read) as Engine's. Raises ParamError (a ValueError naming the setting) for
    a bad model or setting."""
    if seeds < 1 or steps < 1:
        raise ValueError(f"seeds {seeds} and steps {steps} must be >= 1")
    prompts = seed_prompts(model, seeds, prompt)
    settings = dict(device=device, dtype=dtype, mode="eager", load=load)
    with Engine(model, quantize=quantize, **settings) as fp8:
        report, place = fp8.quantized, str(fp8.model.device)
        native = fp8.model.native_size
        first = _FirstCall(fp8.model.denoiser)
        try:
            out = generate_images(fp8, prompts, steps, size, guidance)
        finally:
            first.close()
    del fp8
    _release(place)
    with Engine(model, **settings) as plain:
        with torch.inference_mode():
            reference_step = _sample(plain.model.denoiser(*first.args, **first.kwargs))
        ref = generate_images(plain, prompts, steps, size, guidance)
        reference_dtype = str(plain.model.dtype).removeprefix("torch.")
    del plain
    _release(place)
    mean, peak = pixel_difference(ref, out)
    scored, note = digit_scores(prompts, ref, out)
    scores: dict[str, Any] = {"oracle_note": note}
    if scored is not None:
        scores.update(oracle_reference=scored[0], oracle_fp8=scored[1])
    return CompareResult(model=model, device=place, reference_dtype=reference_dtype, seeds=seeds, steps=steps,
                         size=size or (native, native), report=report,
                         step_error=relative_error(reference_step.float(), first.output.float()),
                         pixel_mean=mean, pixel_max=peak, **scores)
