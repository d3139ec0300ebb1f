"""Job files: what a job is made of, read and checked before anything of it runs.

A job is a list of items. An item is an images request body (the fields of POST /v1/images/generations except
stream, response_format, partial_images, preview and user) and its candidates: `n` images of it, each with its own
seed: `seeds` (a list of n integers), or `seed` (seed, seed + 1, ..., as AUTOMATIC1111 numbers a batch), or neither
(drawn here, once, when the job is made, and stored with it: a restart makes the same images). Each candidate is
one engine request of one image: the request /v1/images/generations would take alone, with that seed.

    {"items": [{"prompt": "a fox", "n": 4}, ...], "name": "shots", "webhook": "https://hooks.example/done"}
    {"prompt": "a fox", "seeds": [1, 2]}                     JSONL: one item a line (name and webhook: query)
    {"prompt": "an owl", "size": "768x512"}
    {"grid": {"prompts": ["a fox", "an owl"], "seeds": [1, 2, 3],
              "vary": {"guidance_scale": [5, 7], "loras": [[["ink", 0.5]], [["ink", 1.0]]]},
              "base": {"num_inference_steps": 20}}}

The grid is AUTOMATIC1111's X/Y/Z plot: an item for each prompt and each combination of the values of one or two
varied fields (`vary`), in that order, every item with the grid's seeds as its candidates (`vary: {"seed": [...]}`
is the same as `seeds`; without seeds, n of them are drawn once for the whole grid, so its cells compare). LoRAs may
be written as [name, scale] pairs or {"name", "scale"} objects.

An item may also carry the served model's capability parameters (`ModelInfo.extension_params`, such as
`step_cache`), as an images body does beside its own fields; they are stored with the item, checked with it and
passed to the request as its `extras` (a grid's `base` and `vary` take them too).

Everything is refused before anything runs, with a SpecError (a 400 at the HTTP edge) whose one line names the line
or item and the field and says what to do: malformed JSON with its line number, unknown fields, values the images
API refuses (the item is checked as the images route checks a body, by `check`: the served model's own rules),
more items than the limit (--max-batch-items; counted before the items are read, so 1,000,001 lines are refused at
once), more candidate images than the limit (--max-job-candidates; a grid's are counted before it is expanded). Pure Python and the server's pydantic body model.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from pydantic import ValidationError

from ..request import MAX_SEED
from ..api.protocol import APIError, ImageGenerationRequest, error_from_validation

EXCLUDED = ("stream", "response_format", "partial_images", "preview", "user")  # no meaning for a stored image
REQUEST_FIELDS = tuple(f for f in ImageGenerationRequest.model_fields if f not in EXCLUDED + ("n", "seed"))
ITEM_FIELDS = REQUEST_FIELDS + ("n", "seed", "seeds")
JOB_FIELDS = ("items", "grid", "name", "webhook")
GRID_FIELDS = ("prompts", "seeds", "n", "vary", "base")
MAX_CANDIDATES = 64   # images of one item
MAX_VARIED = 2        # fields a grid varies (besides the prompt and the seeds)
MAX_NAME = 200
DRAWN_SEEDS = 2**31   # as GenerationRequest.create draws a seed

# (the item's images fields, its capability parameters) -> raises APIError naming the body field (the images rules)
ItemCheck = Callable[[ImageGenerationRequest, dict[str, Any]], object]


class SpecError(ValueError):
    """A job file refused: `message` names where (line, item, field) and says how to fix it; `param` the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class JobItem:
    """One item: its images request fields and capability parameters (JSON, without n and seeds; LoRAs as {"name",
    "scale"}) and one seed per candidate."""

    body: dict[str, Any]
    seeds: tuple[int, ...]
    drawn: bool = False  # the seeds were drawn here (none given): `diffgraph batch` keeps them for its re-runs

    @property
    def n(self) -> int:
        return len(self.seeds)


@dataclass(frozen=True)
class JobSpec:
    items: tuple[JobItem, ...]
    name: str | None = None
    webhook: str | None = None

    @property
    def candidates(self) -> int:
        return sum(item.n for item in self.items)


@dataclass(frozen=True)
class SpecLimits:
    max_items: int = 100_000        # --max-batch-items
    max_candidates: int = 100_000   # --max-job-candidates


def parse_job(data: bytes, form: str, limits: SpecLimits, check: ItemCheck | None = None,
              name: str | None = None, webhook: str | None = None, extras: tuple[str, ...] = ()) -> JobSpec:
    """The job in `data`: `form` "json" ({"items"} or {"grid"}), "jsonl" (an item a line) or "auto" (a JSON object
    with items or grid is JSON, anything else JSONL). `name` and `webhook` are the JSONL form's (query parameters, or
    what the JSON body does not say). `extras`: the capability parameters an item may carry (the model's
    `extension_params`). Raises SpecError."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SpecError(f"the job is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    if form == "auto":
        form = "json" if _looks_like_json_job(text) else "jsonl"
    if form == "json":
        top, raw = _json_job(text, limits, extras)
        name, webhook = top.get("name", name), top.get("webhook", webhook)
    else:
        raw = _jsonl_items(text, limits)
    items, candidates = [], 0
    for where, fields, drawn in raw:
        items.append(_item(where, fields, check, drawn, extras))
        candidates += items[-1].n
        if candidates > limits.max_candidates:
            raise SpecError(f"the job has more than {limits.max_candidates} candidate images (at {where}); this "
                            f"server takes at most {limits.max_candidates} a job (--max-job-candidates): split it "
                            "into several jobs", "items")
    if not items:
        raise SpecError("the job has no items; give at least one item (a JSON object with a prompt)", "items")
    if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME):
        raise SpecError(f"name must be a string of at most {MAX_NAME} characters", "name")
    if name is not None:
        _check_text("name", name)
    if webhook is not None and not isinstance(webhook, str):
        raise SpecError("webhook must be a URL string such as \"https://hooks.example.com/done\"", "webhook")
    return JobSpec(tuple(items), name, webhook)


def _looks_like_json_job(text: str) -> bool:
    head = text.lstrip()
    if not head.startswith("{"):
        return False
    try:
        first, end = json.JSONDecoder().raw_decode(head)
    except (ValueError, RecursionError):
        return False
    return isinstance(first, dict) and ("items" in first or "grid" in first) and not head[end:].strip()


def _too_many(count: str, limits: SpecLimits) -> SpecError:
    return SpecError(f"the job has {count} items; this server takes at most {limits.max_items} a job "
                     "(--max-batch-items): split it into several jobs", "items")


# -- JSONL ------------------------------------------------------------------------------------------------------
_LINE = re.compile(r"\S[^\n]*")  # one match per non-blank line


def _jsonl_items(text: str, limits: SpecLimits) -> list[tuple[str, Any, bool]]:
    if text.count("\n") >= limits.max_items:  # it may be too long: count the lines first, stopping past the limit
        lines = sum(1 for _ in itertools.islice(_LINE.finditer(text), limits.max_items + 1))
        if lines > limits.max_items:
            raise _too_many(f"more than {limits.max_items}", limits)
    out = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise SpecError(f"line {number} is not valid JSON ({_why(e, False)}); write one JSON object per line, "
                            "such as {\"prompt\": \"a red fox\", \"n\": 4}", f"line {number}") from None
        if isinstance(value, dict) and ("items" in value or "grid" in value):
            raise SpecError(f"line {number} holds a whole job ({'items' if 'items' in value else 'grid'}); send it "
                            "as JSON (Content-Type: application/json), or write one item a line",
                            f"line {number}")
        out.append((f"line {number}", value, False))
    return out


# -- JSON -------------------------------------------------------------------------------------------------------
_WS = re.compile(r"[ \t\n\r]*")


def _why(e: Exception, lines: bool) -> str:
    """What is wrong with a JSON text: the decoder's message and where, too deep, or a number too long."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg}: line {e.lineno} column {e.colno}" if lines else f"{e.msg} at column {e.colno}"
    return "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]


def _json_error(e: Exception) -> SpecError:
    return SpecError(f"the job is not valid JSON ({_why(e, True)}); send {{\"items\": [...]}}, {{\"grid\": {{...}}}} "
                     "or one JSON item a line (Content-Type: application/x-ndjson)")


def _json_job(text: str, limits: SpecLimits,
              extras: tuple[str, ...]) -> tuple[dict[str, Any], list[tuple[str, Any, bool]]]:
    """The top-level fields and the items of a JSON job. The items array is read one item at a time and stops past
    the limit, so an oversized job is refused without building every item."""
    dec = json.JSONDecoder()
    top: dict[str, Any] = {}
    items: list[tuple[str, Any, bool]] | None = None
    try:
        pos = _WS.match(text, 0).end()
        if text[pos:pos + 1] != "{":
            raise SpecError("a JSON job is an object: {\"items\": [{\"prompt\": \"a red fox\"}]} or {\"grid\": "
                            "{...}}; for one item a line send Content-Type: application/x-ndjson")
        pos = _WS.match(text, pos + 1).end()
        while text[pos:pos + 1] != "}":
            key, pos = dec.raw_decode(text, pos)
            pos = _WS.match(text, pos).end()
            if not isinstance(key, str) or text[pos:pos + 1] != ":":
                raise json.JSONDecodeError("Expecting ':' delimiter", text, pos)
            pos = _WS.match(text, pos + 1).end()
            if key == "items" and text[pos:pos + 1] == "[":
                items, pos = _json_items(text, pos, dec, limits)
            else:
                top[key], pos = dec.raw_decode(text, pos)
            pos = _WS.match(text, pos).end()
            if text[pos:pos + 1] == ",":
                pos = _WS.match(text, pos + 1).end()
            elif text[pos:pos + 1] != "}":
                raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
        if text[pos + 1:].strip():
            raise json.JSONDecodeError("Extra data", text, pos + 1)
    except SpecError:
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError, or an integer too long to read
        raise _json_error(e) from None
    unknown = [k for k in top if k not in JOB_FIELDS]
    if unknown:
        raise SpecError(f"unknown job field {unknown[0]!r}; a job takes {', '.join(JOB_FIELDS)}", unknown[0])
    if "items" in top:
        raise SpecError("items must be a list of items, e.g. [{\"prompt\": \"a red fox\", \"n\": 4}]", "items")
    if (items is None) == ("grid" not in top):
        raise SpecError("give items (a list) or grid (prompts x seeds x varied fields), one of them", "items")
    return top, items if items is not None else list(_grid(top["grid"], limits, extras))


def _json_items(text: str, pos: int, dec: json.JSONDecoder,
                limits: SpecLimits) -> tuple[list[tuple[str, Any, bool]], int]:
    out: list[tuple[str, Any, bool]] = []
    pos = _WS.match(text, pos + 1).end()
    while text[pos:pos + 1] != "]":
        if len(out) == limits.max_items:
            raise _too_many(f"more than {limits.max_items}", limits)
        value, pos = dec.raw_decode(text, pos)
        out.append((f"items[{len(out)}]", value, False))
        pos = _WS.match(text, pos).end()
        if text[pos:pos + 1] == ",":
            pos = _WS.match(text, pos + 1).end()
        elif text[pos:pos + 1] != "]":
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
    return out, pos + 1


# -- the grid ---------------------------------------------------------------------------------------------------
def _grid(grid: Any, limits: SpecLimits, extras: tuple[str, ...]) -> Iterator[tuple[str, Any, bool]]:
    if not isinstance(grid, dict):
        raise SpecError("grid must be an object: {\"prompts\": [...], \"seeds\": [...], \"vary\": {...}, \"base\": "
                        "{...}}", "grid")
    unknown = [k for k in grid if k not in GRID_FIELDS]
    if unknown:
        raise SpecError(f"unknown field grid.{unknown[0]}; a grid takes {', '.join(GRID_FIELDS)}", f"grid.{unknown[0]}")
    prompts = grid.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise SpecError("grid.prompts must be a non-empty list of prompts (strings)", "grid.prompts")
    base = grid.get("base", {})
    if not isinstance(base, dict):
        raise SpecError("grid.base must be an object of item fields, e.g. {\"num_inference_steps\": 20}", "grid.base")
    if "prompt" in base:
        raise SpecError("grid.base.prompt: the grid's prompts come from grid.prompts; leave it out", "grid.base.prompt")
    if not isinstance(grid.get("vary", {}), dict):
        raise SpecError("grid.vary must be an object of fields and their values, e.g. {\"guidance_scale\": [5, 7]}",
                        "grid.vary")
    vary = dict(grid.get("vary") or {})
    candidates = {k: base[k] for k in ("n", "seed", "seeds") if k in base}
    candidates.update({k: grid[k] for k in ("n", "seeds") if k in grid})
    for key in ("seed", "seeds"):  # vary's seeds are the candidates
        if key in vary:
            if "seeds" in grid or "seeds" in base:
                raise SpecError(f"grid.vary.{key} and grid.seeds both give the seeds; give one", f"grid.vary.{key}")
            candidates.pop("seed", None)
            candidates["seeds"] = vary.pop(key)
    variable = tuple(f for f in REQUEST_FIELDS + extras if f != "prompt")
    for field, values in vary.items():
        if field not in variable:
            raise SpecError(f"grid.vary.{field} cannot be varied; vary one or two of "
                            f"{', '.join(variable)} (the prompts come from "
                            "grid.prompts, the seeds from grid.seeds)", f"grid.vary.{field}")
        if not isinstance(values, list) or not values:
            raise SpecError(f"grid.vary.{field} must be a non-empty list of values", f"grid.vary.{field}")
    if len(vary) > MAX_VARIED:
        raise SpecError(f"grid.vary has {len(vary)} fields; a grid varies at most {MAX_VARIED} (with the prompts and "
                        "the seeds: AUTOMATIC1111's X/Y/Z plot)", "grid.vary")
    count = len(prompts) * math.prod(len(v) for v in vary.values())
    if count > limits.max_items:
        raise _too_many(str(count), limits)
    _, seeds, drawn = _candidates("grid", candidates)  # drawn once: every cell of the grid has the same seeds
    if count * len(seeds) > limits.max_candidates:  # counted, never expanded
        sizes = " x ".join([f"{len(prompts)} prompts"] + [f"{len(v)} {k} values" for k, v in vary.items()] +
                           [f"{len(seeds)} seeds"])
        raise SpecError(f"the grid is {sizes} = {count * len(seeds)} candidate images; this server takes at most "
                        f"{limits.max_candidates} a job (--max-job-candidates): vary fewer values or split it into "
                        "several jobs", "grid")
    template = {**{k: v for k, v in base.items() if k not in ("n", "seed", "seeds")}, "seeds": list(seeds)}
    names = list(vary)
    index = 0
    for p, prompt in enumerate(prompts):
        for combo in itertools.product(*(list(enumerate(vary[name])) for name in names)):
            where = ", ".join([f"prompts[{p}]"] + [f"vary.{name}[{i}]" for name, (i, _) in zip(names, combo)])
            yield (f"grid item {index} ({where})",
                   {**template, "prompt": prompt, **{name: value for name, (_, value) in zip(names, combo)}}, drawn)
            index += 1


# -- one item ---------------------------------------------------------------------------------------------------
def _item(where: str, fields: Any, check: ItemCheck | None, drawn: bool, extras: tuple[str, ...]) -> JobItem:
    if not isinstance(fields, dict):
        raise SpecError(f"{where}: an item is a JSON object such as {{\"prompt\": \"a red fox\", \"n\": 4}}, got "
                        f"{type(fields).__name__}", where)
    for key in fields:
        if key in EXCLUDED:
            raise SpecError(f"{where}: {key} has no meaning in a job (its images are stored and served at "
                            "/v1/jobs/ID/images/NAME); leave it out", f"{where}.{key}")
        if key not in ITEM_FIELDS + extras:
            raise SpecError(f"{where}: unknown field {key!r}; an item takes {', '.join(ITEM_FIELDS + extras)}",
                            f"{where}.{key}")
    _, seeds, drawn_here = _candidates(where, fields)
    body = {k: v for k, v in fields.items() if k not in ("n", "seed", "seeds") and v is not None}
    if "loras" in body:
        body["loras"] = _loras(where, body["loras"])
    _check_text(where, body)
    if body.get("output_format", "png") != "png":
        raise SpecError(f"{where}: output_format {body['output_format']!r}: a job stores PNG images (with their "
                        "settings inside); leave output_format out", f"{where}.output_format")
    try:
        params = ImageGenerationRequest.model_validate({**fields_of(body), "n": 1, "seed": seeds[0]})
        if check is not None:
            check(params, extras_of(body))
    except ValidationError as e:
        err = error_from_validation(e)
        raise SpecError(f"{where}: {err.message}", f"{where}.{err.param}") from None
    except APIError as e:
        raise SpecError(f"{where}: {e.message}", f"{where}.{e.param}" if e.param else where) from None
    return JobItem(body, seeds, drawn or drawn_here)


def fields_of(body: dict[str, Any]) -> dict[str, Any]:
    """An item's images request fields (what ImageGenerationRequest reads)."""
    return {k: v for k, v in body.items() if k in REQUEST_FIELDS}


def extras_of(body: dict[str, Any]) -> dict[str, Any]:
    """An item's capability parameters (the request's `extras`): its fields that are not the images API's."""
    return {k: v for k, v in body.items() if k not in ITEM_FIELDS}


def _check_text(where: str, value: Any) -> None:
    """SpecError when `value` holds a string with an unpaired surrogate (JSON's "\\ud800"): not text SQLite stores."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise SpecError(f"{where} holds text with an unpaired surrogate (a \\ud800-\\udfff escape without its "
                        "pair); send valid UTF-8 text", where) from None


def _candidates(where: str, fields: dict[str, Any]) -> tuple[int, tuple[int, ...], bool]:
    """(n, the seeds, whether they were drawn) of an item: `seeds` as given, `seed` counted up, or n drawn."""
    n, seeds, seed = fields.get("n"), fields.get("seeds"), fields.get("seed")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CANDIDATES):
        raise SpecError(f"{where}: n {n!r} is out of range; allowed: 1..{MAX_CANDIDATES} candidate images an item",
                        f"{where}.n")
    if seeds is not None and seed is not None:
        raise SpecError(f"{where}: give seeds (one per candidate) or seed (counted up), not both", f"{where}.seeds")
    if seeds is not None:
        if not isinstance(seeds, list) or not seeds or len(seeds) > MAX_CANDIDATES:
            raise SpecError(f"{where}: seeds must be a list of 1..{MAX_CANDIDATES} integers, one per candidate",
                            f"{where}.seeds")
        for s in seeds:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED:
                raise SpecError(f"{where}: seed {s!r} in seeds is not an integer in 0..{MAX_SEED}", f"{where}.seeds")
        if n is not None and n != len(seeds):
            raise SpecError(f"{where}: n is {n} but seeds lists {len(seeds)}; give one seed per candidate (or leave "
                            "n out)", f"{where}.n")
        return len(seeds), tuple(seeds), False
    n = 1 if n is None else n
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED - n + 1:
            raise SpecError(f"{where}: seed {seed!r} is not an integer in 0..{MAX_SEED - n + 1}", f"{where}.seed")
        return n, tuple(range(seed, seed + n)), False
    return n, tuple(secrets.randbelow(DRAWN_SEEDS) for _ in range(n)), True


def _loras(where: str, value: Any) -> Any:
    """[name, scale] pairs as {"name", "scale"} objects (the images body's form); anything else is left to its check."""
    if not isinstance(value, list):
        return value
    return [{"name": v[0], "scale": v[1]} if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) else v
            for v in value]
