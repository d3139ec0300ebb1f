"""Prompt editing `[from:to:when]` and alternation `[a|b]` (prompt_syntax.prompt_schedule, engine/prompt_schedule.py)
against a reference written here from AUTOMATIC1111's rules (modules/prompt_parser.py
get_learned_conditioning_prompt_schedules, its lark grammar, and sd_samplers_cfg_denoiser.py's CFGDenoiser, which
picks the conditioning by its denoiser-call counter), and the engine's rows against diffusers' pipeline with its
prompt embeddings switched by hand at that step.

The reference reads characters (the module reads tokens into a tree): a bracket that its grammar can read whole
(`(x)`, `(x:y)`, `[x]`, `[x:N]`, `[x:y:N]`, `[x|y|...]`, its inside read the same way, no stray bracket or colon
inside) is that form, anywhere else a bracket or colon is text; a `|` outside an alternation or a backslash with no
character after it (a newline is none) leaves the whole prompt text. N is lark's SIGNED_NUMBER with spaces around it;
written with "." it is a fraction of the steps, else a step; `int()` of it, capped at the steps, is the last step of
`from`. The schedule's steps are the run's steps, every N of 1 or more, and every step where an alternation is.

Where a well-formed bracket is followed right after its close by a stray bracket or colon (`[a:b:3]:`), lark's
Earley parse of that grammar is ambiguous, and AUTOMATIC1111's answer depends on the process's hash seed (lark keeps
a node's derivations in a set: PYTHONHASHSEED 0 to 5 gave both readings); both readers here take the bracket's form.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from diffgraph.errors import ParamError
from diffgraph.prompt_syntax import MAX_SCHEDULED, prompt_schedule, schedule_a1111
from diffgraph.engine.prompt_schedule import switches
from diffgraph.engine.request_state import schedule_length
from diffgraph.text.prepared import prepare

NUMBER = re.compile(r"\s*[+-]?(\d+\.?\d*(e[+-]?\d+)?|\.\d+(e[+-]?\d+)?)\s*", re.IGNORECASE)


class _Text(Exception):
    """The grammar cannot read the prompt whole."""


def ref_schedule(prompt: str, steps: int, hires: int | None = None) -> list[str]:
    """The text AUTOMATIC1111 conditions on at each denoiser evaluation 0..steps (0-based, one past the last too)."""
    whens: list[list] = []   # [number text, last step of `from`] per edit
    alternates = [False]
    try:
        read = _read_top(prompt, whens, alternates)
    except _Text:
        return [prompt] * (steps + 1)
    points = {steps}
    for w in whens:
        value = float(w[0])
        if "." in w[0]:
            value = (value - (1.0 if hires else 0.0)) * steps
        else:
            value -= hires or 0
        w[1] = int(min(value, steps)) if value > -1 else -1
        if w[1] >= 1:
            points.add(w[1])
    if alternates[0]:
        points.update(range(1, steps + 1))
    entries = [(p, read(p)) for p in sorted(points)]
    return [next(t for end, t in entries if e <= end) for e in range(steps + 1)]


def _escape_end(text: str, i: int) -> int:
    if i + 1 >= len(text) or text[i + 1] == "\n":
        raise _Text
    return i + 2


def _read_top(text: str, whens: list, alternates: list):
    pieces, skip_to = [], 0
    for i, c in enumerate(text):
        if i < skip_to:
            continue
        found = _read_bracket(text, i, whens, alternates) if c in "([" else None
        if found is not None:
            pieces.append(found[0])
            skip_to = found[1]
        elif c == "\\":
            skip_to = _escape_end(text, i)
            pieces.append(text[i:skip_to])
        elif c == "|":
            raise _Text
        else:
            pieces.append(c)
    return lambda step: "".join(p if isinstance(p, str) else p(step) for p in pieces)


def _read_bracket(text: str, i: int, whens: list, alternates: list):
    """(reader of the bracket at i, index after it), or None where it is text."""
    close = ")" if text[i] == "(" else "]"
    groups: list[list] = [[]]
    seps: list[str] = []
    mark = (len(whens), alternates[0])
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            end = _escape_end(text, j)
            groups[-1].append(text[j:end])
            j = end
            continue
        if c in "([":
            found = _read_bracket(text, j, whens, alternates)
            if found is None:
                break
            groups[-1].append(found[0])
            j = found[1]
            continue
        if c in ":|":
            seps.append(c)
            groups.append([])
        elif c == close:
            form = _shape(text[i], groups, seps, whens, alternates)
            if form is not None:
                return form, j + 1
            break
        elif c in ")]":
            break
        else:
            groups[-1].append(c)
        j += 1
    del whens[mark[0]:]           # a bracket read as text edits nothing
    alternates[0] = mark[1]
    return None


def _join(group):
    return lambda step: "".join(p if isinstance(p, str) else p(step) for p in group)


def _shape(opening, groups, seps, whens, alternates):
    if opening == "(":
        if "|" in seps or len(seps) > 1:
            return None
        inner = [_join(g) for g in groups]
        return lambda step: "(" + ":".join(r(step) for r in inner) + ")"
    if not seps:
        inner = _join(groups[0])
        return lambda step: "[" + inner(step) + "]"
    if set(seps) == {"|"}:
        alternates[0] = True
        options = [_join(g) for g in groups]
        return lambda step: options[(step - 1) % len(options)](step)
    number = groups[-1]
    if "|" in seps or len(seps) > 2 or not all(isinstance(p, str) for p in number) or \
            NUMBER.fullmatch("".join(number)) is None:
        return None
    before = _join(groups[0]) if len(seps) == 2 else (lambda step: "")
    after = _join(groups[-2])
    when = ["".join(number).strip(), 0]
    whens.append(when)
    return lambda step: before(step) if step <= when[1] else after(step)


def per_evaluation(prompt: str, steps: int, hires: int | None = None) -> list[str]:
    entries = prompt_schedule(prompt, steps, hires=hires)
    assert entries[-1][0] == steps and all(a[0] < b[0] and a[1] != b[1] for a, b in zip(entries, entries[1:]))
    return [next(t for end, t in entries if e <= end) for e in range(steps + 1)]


# -- the schedule ----------------------------------------------------------------------------------------------

HAND = [  # (prompt, steps, [(last step, text), ...]) worked out by hand from the rules above
    ("a cat", 10, [(10, "a cat")]),
    ("a [cat:dog:0.5]", 10, [(5, "a cat"), (10, "a dog")]),
    ("a [cat:dog:3]", 10, [(3, "a cat"), (10, "a dog")]),
    ("a [dog:3]", 10, [(3, "a "), (10, "a dog")]),
    ("a [cat::0.3]", 10, [(3, "a cat"), (10, "a ")]),
    ("a [cat:dog: 4 ] b", 10, [(4, "a cat b"), (10, "a dog b")]),
    ("[a:[b:c:6]:2]", 10, [(2, "a"), (6, "b"), (10, "c")]),
    ("[(x:1.2):y:0.5]", 4, [(2, "(x:1.2)"), (4, "y")]),
    ("[cat|dog]", 4, [(1, "cat"), (2, "dog"), (3, "cat"), (4, "dog")]),
    ("[a|b|]c", 3, [(1, "ac"), (2, "bc"), (3, "c")]),
    ("[cat:dog:0]", 10, [(10, "dog")]),
    ("[cat:dog:-2]", 10, [(10, "dog")]),
    ("[cat:dog:50]", 10, [(10, "cat")]),
    ("[cat:dog:1e1]", 20, [(10, "cat"), (20, "dog")]),       # no "." : a step
    ("[cat:dog:2.5e-1]", 20, [(5, "cat"), (20, "dog")]),     # a "." : a fraction
    ("[cat:dog]", 10, [(10, "[cat:dog]")]),                  # no number: text (then emphasis)
    ("[cat:dog:x]", 10, [(10, "[cat:dog:x]")]),
    ("[a:b:c:0.5]", 10, [(10, "[a:b:c:0.5]")]),              # three colons: text
    ("[a) b:0.5]", 10, [(10, "[a) b:0.5]")]),                # a stray ")" inside: text
    (r"\[cat:dog:0.5\]", 10, [(10, r"\[cat:dog:0.5\]")]),    # escaped
    ("(a|b) [cat:dog:0.5]", 10, [(10, "(a|b) [cat:dog:0.5]")]),   # a "|" it cannot read: the whole prompt is text
    ("a | b [cat:dog:0.5]", 10, [(10, "a | b [cat:dog:0.5]")]),
    ("[cat:dog:0.5] \\", 10, [(10, "[cat:dog:0.5] \\")]),     # a lone backslash at the end: the same
    ("[x [a:b:2]", 10, [(2, "[x a"), (10, "[x b")]),         # an unclosed bracket is text, what follows is read
    ("((a][:b:c [d:3]", 10, [(3, "((a][:b:c "), (10, "((a][:b:c d")]),
]


@pytest.mark.parametrize("prompt,steps,want", HAND, ids=[p for p, _, _ in HAND])
def test_hand_worked_schedules(prompt, steps, want):
    assert list(prompt_schedule(prompt, steps)) == want
    assert per_evaluation(prompt, steps) == [next(t for end, t in want if e <= end) for e in range(steps + 1)]
    assert ref_schedule(prompt, steps) == per_evaluation(prompt, steps)


def test_hires_pass_counts_from_the_first_pass():
    """A hires fix's second pass: a step counts from the first pass's start, a fraction from 1.0 (AUTOMATIC1111);
    hires.second_pass marks its request with the first pass's steps."""
    from diffgraph.hires import HiresFix, second_pass
    from diffgraph.request import GenerationRequest, GenerationResult

    first = GenerationRequest.create("a [cat:dog:1.5]", prompt_syntax="a1111", width=64, height=64,
                                     num_inference_steps=10, seed=1, guidance_scale=5.0)
    result = GenerationResult(first.request_id, np.zeros((1, 64, 64, 3), np.float32), 1, {}, first)
    assert second_pass(first, result, HiresFix(128, 128, "Lanczos", 0.5, 6)).hires_of == 10
    assert list(prompt_schedule("[a:b:15]", 10, hires=10)) == [(5, "a"), (10, "b")]
    assert list(prompt_schedule("[a:b:1.5]", 10, hires=10)) == [(5, "a"), (10, "b")]
    assert list(prompt_schedule("[a:b:0.5]", 10, hires=10)) == [(10, "b")]   # over in the first pass
    assert list(prompt_schedule("[a:b:5]", 10, hires=10)) == [(10, "b")]


def _fuzz(count: int, seed: int):
    rng = random.Random(seed)
    atoms = ["a", "cat", " ", ",", "(", ")", "[", "]", ":", "|", ":0.5", ":3", ": 2 ", ":.5]", "::0.3]", "\\",
             "\\[", "\\:", "\\|", "1", "1.5", "-2", "1e1", "\n", "[a|b]", "[x:y:0.5]", "(c:1.2)", "[d:2]",
             "[e::3]", "[|f]", "[g||]", " [h:i:1.5] "]
    for _ in range(count):
        yield ("".join(rng.choice(atoms) for _ in range(rng.randint(0, 12))), rng.choice([1, 2, 5, 10, 20]),
               rng.choice([None, None, 10]))


def test_schedules_equal_the_reference_on_random_prompts():
    differ = []
    for prompt, steps, hires in _fuzz(4000, seed=67):
        try:
            got = per_evaluation(prompt, steps, hires)
        except ParamError:
            continue
        if got != ref_schedule(prompt, steps, hires):
            differ.append((prompt, steps, hires))
    assert not differ, f"{len(differ)} differ, first: {differ[:3]}"


def test_more_than_the_bounded_distinct_texts_is_refused_by_field():
    options = "|".join(f"w{i}" for i in range(MAX_SCHEDULED + 1))
    with pytest.raises(ParamError, match=f"more than {MAX_SCHEDULED}") as info:
        prompt_schedule(f"[{options}]", 40, "negative_prompt")
    assert info.value.param == "negative_prompt" and "\n" not in str(info.value)
    assert len(prompt_schedule(f"[{options}]", MAX_SCHEDULED)) == MAX_SCHEDULED   # only the steps it runs count
    assert len({t for _, t in prompt_schedule("[a|b] " * 4000, 400)}) == 2       # long, many steps, two texts


def test_lora_tags_inside_an_edit_apply_to_the_whole_prompt():
    entries = schedule_a1111("a [cat <lora:ink:0.5>:dog:0.5]", "prompt", 10)
    assert [(end, text) for end, text, _ in entries] == [(5, "a cat "), (10, "a dog")]
    assert all(parsed.loras == (("ink", 0.5),) for _, _, parsed in entries)
    assert entries[0][2].pieces == (("a cat ", 1.0),) and entries[1][2].pieces == (("a dog", 1.0),)


def test_evaluations_switch_as_the_cfg_denoiser_counts_them():
    """AUTOMATIC1111's schedule is over its sampler's total_steps (twice the steps for a sampler of two denoiser
    calls a step) and reads, at its call e (0-based), the first text whose last step is e or later."""
    from types import SimpleNamespace

    heun = SimpleNamespace(steps=4, step_index=np.array([0, 0, 1, 1, 2, 2, 3]))
    euler = SimpleNamespace(steps=4, step_index=np.arange(4))
    assert schedule_length(heun) == (8, None) and schedule_length(euler) == (4, None)
    # a hires fix's second pass running 3 of a 6-step schedule, after a 4-step first pass: its own 3, the first's 4
    second = SimpleNamespace(steps=6, step_index=np.arange(3, 6))
    assert schedule_length(second, hires_of=4) == (3, 4)
    p = SimpleNamespace(schedule=((2, "cat"), (4, "dog")))
    n = SimpleNamespace(schedule=())
    assert [(e, a) for e, a, _ in switches(p, n, 4)] == [(0, "cat"), (3, "dog")]


# -- the engine's rows -----------------------------------------------------------------------------------------

KW = dict(num_inference_steps=4, seed=3, guidance_scale=5.0, prompt_syntax="a1111", negative_prompt="blurry",
          width=64, height=64)


def _embeds(engine, prompt):
    request = engine.make_request(prompt, **KW)
    pos, neg = prepare(engine.runner.text_setup, request)
    rows = engine.runner.embed([("+", pos, ()), ("-", neg, ())])
    return rows[("+", pos, ())]["embeds"], rows[("-", neg, ())]["embeds"]


def test_an_edit_equals_diffusers_with_its_embeddings_switched_by_hand(tiny_engine):
    """`a [cat:dog:0.25]` over 4 Euler steps: 'a cat' at evaluations 0-1 (last step 1, read while e <= 1), 'a dog' at
    2-3; diffusers' pipeline with the prompt embeddings replaced after its step 1 gives the same image."""
    ours = tiny_engine.generate("a [cat:dog:0.25]", **KW).arrays
    cat, neg = _embeds(tiny_engine, "a cat")
    dog, _ = _embeds(tiny_engine, "a dog")

    def swap(pipe, i, t, tensors):
        return {"prompt_embeds": torch.cat([neg, dog])} if i == 1 else {}

    pipe = tiny_engine.diffusers_pipeline("euler", "default")
    ref = pipe(prompt_embeds=cat, negative_prompt_embeds=neg, num_inference_steps=4, guidance_scale=5.0,
               height=64, width=64, generator=torch.Generator().manual_seed(3), output_type="np",
               callback_on_step_end=swap, callback_on_step_end_tensor_inputs=["prompt_embeds"]).images
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    plain = tiny_engine.generate("a cat", **KW).arrays
    assert np.abs(ours - plain).max() > 1e-3   # the last step read 'a dog'


def test_rows_with_schedules_and_plain_rows_together_equal_each_alone(tiny_engine):
    """Rows of different schedules (an edit, an alternation in the negative prompt, texts of different lengths),
    and plain rows, submitted together, share the steps and each equals its image alone."""
    long = ", ".join(["a detailed painting of a small red house in the dark forest at night"] * 5)  # 2 windows
    prompts = [dict(prompt="a cat"), dict(prompt="a [cat:dog:0.5]"),
               dict(prompt="a dog", negative_prompt="[blurry|grainy]"),
               dict(prompt=f"[a fox:{long}:2]", num_inference_steps=3), dict(prompt="a [red|blue] bird"),
               dict(prompt="a [red|blue] [cat:dog:0.5]", sampler="heun", num_inference_steps=3)]
    alone = [tiny_engine.generate(**{**KW, **p}).arrays for p in prompts]
    steps = tiny_engine.core.stats["steps"]
    handles = [tiny_engine.submit(tiny_engine.make_request(**{**KW, **p})) for p in prompts]
    together = [h.result().arrays for h in handles]
    for a, t in zip(alone, together):
        np.testing.assert_allclose(t, a, atol=1 / 255, rtol=0)
    assert tiny_engine.core.stats["steps"] - steps < sum(p.get("num_inference_steps", 4) for p in prompts)
    assert len({round(float(a.mean()), 5) for a in alone}) == len(alone)


def test_sdxl_rows_switch_both_conditionings(tiny_xl_engine):
    """SDXL's conditioning has a pooled field beside the token embeddings: an edit switches both (alone equal to
    batched with a plain row, and unlike either of its texts alone)."""
    kw = {**KW, "num_inference_steps": 3}
    prompts = ["a [cat:dog:0.5]", "a cat"]
    alone = [tiny_xl_engine.generate(p, **kw).arrays for p in prompts]
    handles = [tiny_xl_engine.submit(tiny_xl_engine.make_request(p, **kw)) for p in prompts]
    for a, h in zip(alone, handles):
        np.testing.assert_allclose(h.result().arrays, a, atol=1 / 255, rtol=0)
    dog = tiny_xl_engine.generate("a dog", **kw).arrays
    assert min(np.abs(alone[0] - alone[1]).max(), np.abs(alone[0] - dog).max()) > 1e-4


def test_a_hires_pass_reads_an_edit_over_in_the_first_pass_as_its_last_text(tiny_engine):
    """`[cat:dog:0.5]` ends within the first pass; AUTOMATIC1111's hires pass then reads 'dog' throughout, and
    `[cat:dog:1.5]` (a fraction from 1.0) switches halfway through the hires pass's own steps."""
    from diffgraph.hires import HiresFix, generate_hires

    kw = {**KW, "num_inference_steps": 3}
    first = tiny_engine.make_request("a cat", **kw)
    fix = HiresFix(96, 96, "Latent", 0.6, 4)   # 4 hires steps: 1.5 -> cat at evaluations 0-2, dog at 3

    def hires(prompt):
        return generate_hires(tiny_engine, first, fix, tiny_engine.make_request(prompt, **kw))[0].arrays

    np.testing.assert_allclose(hires("a [cat:dog:0.5]"), hires("a dog"), atol=1e-6, rtol=0)
    halfway = hires("a [cat:dog:1.5]")
    assert min(np.abs(halfway - hires("a dog")).max(), np.abs(halfway - hires("a cat")).max()) > 1e-4
