"""A row's prompt schedule (AUTOMATIC1111's prompt editing `[a:b:when]` and alternation `[a|b]`) as conditioning
switched between steps.

text/prepared.py gives an a1111 prompt that edits or alternates its `schedule`: (last evaluation, PromptText) per
text, each prepared and encoded as a prompt of its own (the prompt cache keys them by text). AUTOMATIC1111 builds the
schedule over its sampler's `total_steps` (the steps, twice for a sampler of two denoiser evaluations a step:
request_state.py `schedule_length`) and reads, at its denoiser's evaluation e (0-based, counted from the pass's first evaluation, an
image-to-image pass's too), the first text whose last evaluation is e or later (`reconstruct_cond_batch`). A row's
plan rows are those evaluations, so `switches` lists the evaluations where the row's (prompt, negative prompt) pair
changes; the engine core writes that pair's conditioning into the row's fields just before the step that runs it
(`ModelRunner.update_rows`: device copies, no extra graph: rows with different schedules share every replay). Every
text of a row is padded to the row's longest (`windows`), so its step variant never changes.
"""

from __future__ import annotations

from ..text.prepared import PromptText


def at(prompt: PromptText, evaluation: int) -> PromptText:
    """The text read at `evaluation` (0-based): the first whose last evaluation is that one or later."""
    for end, text in prompt.schedule:
        if evaluation <= end:
            return text
    return prompt.schedule[-1][1] if prompt.schedule else prompt


def switches(prompt: PromptText, negative: PromptText, evaluations: int) -> list[tuple[int, PromptText, PromptText]]:
    """(evaluation, prompt text, negative prompt text) where the pair changes, the first at evaluation 0."""
    out: list[tuple[int, PromptText, PromptText]] = []
    for e in range(evaluations):
        pair = (at(prompt, e), at(negative, e))
        if not out or out[-1][1] is not pair[0] or out[-1][2] is not pair[1]:
            out.append((e, *pair))
    return out
