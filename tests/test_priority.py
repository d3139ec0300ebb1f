"""Scheduling classes (engine/priority.py): interactive rows first, batch rows fair-shared between jobs, and batch
rows preempted at a step boundary for an interactive request, resuming from their saved state; the scheduler with a
fake worker, then the engine on the CPU (a preempted row's image equals the uninterrupted one)."""

import dataclasses

import numpy as np
import pytest

from diffgraph.engine.priority import admission_order
from diffgraph.engine.scheduler import _victims as victims
from diffgraph.engine.scheduler import Scheduler, SchedulerConfig
from loop_util import held_loop
from test_scheduler import Clock, FakeWorker, state


def batch(rid, job="j1", **kw):
    return dataclasses.replace(state(rid, **kw), batch=True, job=job)


def ids(states):
    return [s.request_id for s in states]


def test_admission_order_puts_people_first_then_resumed_then_jobs_round_robin():
    live = [batch("L1", job="A", rows=2)]  # job A already holds 2 rows here
    waiting = [batch("a1", job="A", arrival=0), batch("a2", job="A", arrival=1), batch("a3", job="A", arrival=2),
               batch("b1", job="B", arrival=3), batch("b2", job="B", arrival=4), state("i1", arrival=5),
               dataclasses.replace(batch("r1", job="B", arrival=6), preempted=True), state("i2", arrival=7)]
    # B holds no rows: it goes first until it catches up with A's 2, then they alternate (ties: the older head)
    assert ids(admission_order(waiting, live)) == ["i1", "i2", "r1", "b1", "b2", "a1", "a2", "a3"]
    assert ids(admission_order(waiting[:5], [])) == ["a1", "b1", "a2", "b2", "a3"]


def test_batch_rows_are_shared_by_key_first_then_by_the_keys_jobs():
    """Shared per job, one key's three jobs took three rows for each one of another key's single job."""
    def keyed(rid, share, job, arrival):
        return dataclasses.replace(batch(rid, job=job, arrival=arrival), share=share)
    waiting = [keyed("a1", "A", "j1", 0), keyed("a2", "A", "j2", 1), keyed("a3", "A", "j3", 2),
               keyed("b1", "B", "k1", 3), keyed("b2", "B", "k1", 4), keyed("b3", "B", "k1", 5),
               keyed("a4", "A", "j1", 6)]
    assert ids(admission_order(waiting, [])) == ["a1", "b1", "a2", "b2", "a3", "b3", "a4"]
    live = [keyed("L1", "A", "j1", 0), keyed("L2", "A", "j2", 0)]  # A holds 2 rows: B catches up first
    assert ids(admission_order(waiting, live)) == ["b1", "b2", "a3", "b3", "a1", "a2", "a4"]


def test_victims_are_the_fewest_batch_rows_with_the_most_steps_left():
    live = [state("i", steps=10, rows=2), batch("short", steps=3, rows=2), batch("long", steps=9, rows=2),
            batch("mid", steps=6, rows=2)]
    need = np.full(5, 4)  # 4 rows for 5 steps beside 8 live rows of a capacity of 10
    assert ids(victims(live, need, 10)) == ["long"]
    assert victims(live, np.full(5, 2), 10) == []          # fits already
    assert victims(live, np.full(5, 9), 10) is None        # not even without every batch row (the 2 interactive)


def test_an_interactive_request_takes_a_batch_row_at_the_next_step_and_the_row_resumes_where_it_stopped():
    sched = Scheduler(SchedulerConfig(max_rows=4), Clock())
    w = FakeWorker()
    for i in range(4):
        sched.add(batch(f"b{i}", steps=6 + i))
    p = sched.schedule()
    w.execute(p)
    sched.update(p)
    sched.add(state("person", steps=3))
    p = sched.schedule()  # the very next step: b3 (most steps left) gives way, its place is the person's
    assert [(s.request_id, row) for s, row in p.preempted] == [("b3", 3)]
    assert ids(p.admitted) == ["person"] and ids(p.live) == ["b0", "b1", "b2", "person"]
    victim = p.preempted[0][0]
    assert victim.preempted and victim.step == 1
    for s, _ in p.preempted:
        s.saved = "rows"  # what the engine core does before the step
    steps_of_person = 0
    while not any(s.request_id == "b3" for s in p.resumed):
        w.execute(p)
        done = ids(sched.update(p))
        steps_of_person += "person" in ids(p.live)
        p = sched.schedule()
    assert steps_of_person == 3  # it ran its 3 steps back to back
    assert victim.step == 1 and not victim.preempted and victim.first_row == 3  # resumes at its step, same rows
    assert "person" in done or steps_of_person == 3


def test_groups_with_interactive_work_run_before_batch_only_groups():
    sched = Scheduler(SchedulerConfig(max_rows=4, max_skips=1), Clock())
    w = FakeWorker()
    sched.add(batch("b", steps=8, key=(64, 64)))
    p = sched.schedule()
    w.execute(p)
    sched.update(p)
    sched.add(state("person", steps=3, key=(32, 32)))
    keys = []
    for _ in range(3):
        p = sched.schedule()
        w.execute(p)
        sched.update(p)
        keys.append(p.key)
    assert keys == [(32, 32)] * 3  # the batch group's older rows and max_skips do not delay the person
    p = sched.schedule()
    assert p.key == (64, 64)


class SlotGate:
    name = "lora"

    def __init__(self, slots):
        self.free = slots

    def can_admit(self, s):
        return self.free > 0

    def admit(self, s):
        if self.free == 0:
            return None
        self.free -= 1
        return [0]

    def release(self, s, taken):
        self.free += 1


def test_a_preempted_request_keeps_its_gates_until_it_is_aborted_or_done():
    sched = Scheduler(SchedulerConfig(max_rows=2), Clock())
    gate = SlotGate(3)
    sched.gates = (gate,)
    w = FakeWorker()
    sched.add(batch("b0", steps=5))
    sched.add(batch("b1", steps=6))
    p = sched.schedule()
    w.execute(p)
    sched.update(p)
    assert gate.free == 1
    sched.add(state("person", steps=2))
    p = sched.schedule()
    assert ids(s for s, _ in p.preempted) == ["b1"] and gate.free == 0  # b1 kept its slot, the person took one
    assert sched.abort("b1") and gate.free == 1  # aborted while preempted: its slot comes back


def test_a_failed_step_fails_the_rows_it_preempted_before_they_were_saved():
    sched = Scheduler(SchedulerConfig(max_rows=1), Clock())
    w = FakeWorker()
    sched.add(batch("b", steps=5))
    p = sched.schedule()
    w.execute(p)
    sched.update(p)
    sched.add(state("person", steps=2))
    p = sched.schedule()
    assert ids(s for s, _ in p.preempted) == ["b"]
    assert sorted(ids(sched.fail(p))) == ["b", "person"] and not sched.has_work()


# D_prev, noise drawn every step, three history slots (LMS), a two-evaluation sampler's slot (Heun), a step cache's
# kept features (models/families/unet_cache.py)
@pytest.mark.parametrize("sampler, slots, cache", [("dpmpp_2m", 0, None), ("euler_a", 0, None), ("lms", 3, None),
                                                   ("heun", 1, None),
                                                   ("euler", 0, {"method": "deepcache", "interval": 3})])
def test_a_preempted_row_gives_the_image_it_would_have_given_uninterrupted(tiny_engine, sampler, slots, cache):
    from diffgraph import GenerationRequest
    eng = tiny_engine
    size = eng.info.native_size
    per = eng.core.scheduler.config.max_rows // 4 // 2  # 4 requests of guided rows (2 denoiser rows each) fill it

    def make(i, priority, steps):
        r = GenerationRequest.create("a cat" if i % 2 else "a dog", width=size, height=size, seed=10 + i,
                                     num_inference_steps=steps, sampler=sampler, guidance_scale=5.0,
                                     num_images=per if priority == "batch" else 1, model=eng.info,
                                     request_id=f"{priority}-{i}-{sampler}-{bool(cache)}",
                                     extras=None if cache is None else {"step_cache": cache})
        return dataclasses.replace(r, priority=priority, job="j" if priority == "batch" else None)

    jobs = [make(i, "batch", 6) for i in range(4)]
    alone = [eng.run(dataclasses.replace(r, request_id=r.request_id + "-alone")).arrays for r in jobs]
    person = make(99, "interactive", 3)
    person_alone = eng.run(dataclasses.replace(person, request_id="alone")).arrays
    plans, futures, saved = [], [], []

    mine = {r.request_id for r in jobs}

    def listener(plan, _):  # on the loop thread, between steps (the last step of the runs above may still report)
        if not mine.intersection(s.request_id for s in plan.live):
            return
        plans.append(([s.request_id for s in plan.live], [s.request_id for s, _ in plan.preempted]))
        saved.extend(sorted(s.saved) for s, _ in plan.preempted)
        if len(plans) == 2:  # the group is full of batch rows and has stepped twice: a person arrives
            futures.append(eng.submit(person))

    eng.core.step_listeners.append(listener)
    try:
        with held_loop(eng):  # every batch request queued before the loop plans a step
            batch_futures = [eng.submit(r) for r in jobs]
        results = [f.result() for f in batch_futures]
        person_result = futures[0].result()
    finally:
        eng.core.step_listeners.remove(listener)
    assert len(plans[0][0]) == 4 and not plans[0][1]
    live, preempted = plans[2]
    assert person.request_id in live and preempted  # the next step: the person runs, a batch request gave way
    # its saved state: the history slots its sampler declares and no others; its guidance's fields, and none of the
    # features it does not use (an image-to-image row's: they hold their neutral values, written back on resume)
    assert saved and all([k for k in names if k.startswith("hist.")] == [f"hist.h{k}" for k in range(1, slots + 1)]
                         for names in saved)
    assert all(any(k.startswith("uncond.") for k in names) and not any(k.startswith("edit.") for k in names)
               for names in saved), saved
    assert all(("cache.deep" in names) == (cache is not None) for names in saved)
    for res, ref in zip(results, alone):  # within the isolation tolerance (batch shapes change the float sums)
        np.testing.assert_allclose(res.arrays, ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(person_result.arrays, person_alone, atol=1e-4, rtol=0)


def test_a_preemption_saves_only_the_feature_fields_its_request_wrote(tiny_engine):
    """StepBuffers keeps, per row, the features' fields its admission wrote: `save_rows` copies those (and the base
    fields, the conditioning, the sampler's slots), not the fields of features the request does not use, which hold
    their neutral values; compaction moves the record with the rows, and a restore writes the rest back neutral."""
    import torch

    from diffgraph.graphs.step import StepBuffers

    size = tiny_engine.info.native_size
    live = tiny_engine.runner.buffers((size, size))
    buf = StepBuffers({k: v.clone() for k, v in live.fields.items()}, live.specs, live.cond_names, live.row_names,
                      live.dtype, live.sequence)
    assert buf.num_rows >= 8
    shape = buf.fields["edit.known"].shape[1:]
    edit = {"edit.known", "edit.noise0"}

    def edits(saved):
        return {k for k in saved if k.startswith("edit.")}

    buf.write(slice(0, 2), {"edit.known": torch.full(shape, 3.0), "edit.noise0": torch.ones(shape)})
    buf.write(slice(2, 3), {})
    assert edits(buf.save_rows(2, 1, 0)) == set() and "x" in buf.save_rows(2, 1, 0)
    saved = buf.save_rows(0, 2, 0)
    assert edits(saved) == edit
    buf.move_rows(0, 4, 2)  # compaction carries the record with the rows
    assert edits(buf.save_rows(4, 2, 0)) == edit
    buf.write(slice(0, 2), {})  # another request takes rows 0-1
    assert edits(buf.save_rows(0, 2, 0)) == set()
    # rows 6-7 last held an inpainting request's mask and a sampler's history slot
    buf.write(slice(6, 8), {"edit.mask": torch.zeros(buf.fields["edit.mask"].shape[1:])})
    buf.fields["hist.h1"][6:8] = 5.0
    buf.restore_rows(6, saved)
    torch.testing.assert_close(buf.fields["edit.known"][6:8], torch.full((2, *shape), 3.0))
    assert float(buf.fields["edit.mask"][6:8].min()) == 1.0  # not carried: written back as its neutral value
    assert float(buf.fields["hist.h1"][6:8].abs().max()) == 0.0  # a slot its sampler does not use: neutral too
    assert edits(buf.save_rows(6, 2, 0)) == edit
    view = buf.head(8)  # the step's view of the first rows shares the record
    assert edits(view.save_rows(6, 2, 0)) == edit


def test_an_admission_writes_neutral_values_only_where_a_request_wrote_before(tiny_engine):
    """A field the rows' last requests did not write holds its neutral value, so an admission that leaves it out
    writes nothing there (an SDXL row without ControlNets skips three 10.5 MB fills); where one wrote it, it is
    written back neutral. Buffers built from arbitrary tensors count every field as written."""
    import torch

    from diffgraph.graphs.step import StepBuffers

    size = tiny_engine.info.native_size
    live = tiny_engine.runner.buffers((size, size))
    fields = {k: v.clone() for k, v in live.fields.items()}
    fields["edit.mask"][:] = 0.0  # not its neutral 1.0
    buf = StepBuffers(fields, live.specs, live.cond_names, live.row_names, live.dtype, live.sequence)
    mask = buf.fields["edit.mask"]
    buf.write(slice(0, 2), {})
    assert float(mask[0:2].min()) == 1.0 and float(mask[2:4].max()) == 0.0  # unknown content: written neutral
    mask[0:2] = 0.0  # a stray value no admission recorded: the next admission does not look at it
    buf.write(slice(0, 2), {})
    assert float(mask[0:2].max()) == 0.0
    buf.write(slice(0, 2), {"edit.mask": torch.full(mask.shape[1:], 0.5)})
    buf.write(slice(0, 2), {})  # its last request wrote the mask: back to neutral
    assert float(mask[0:2].min()) == 1.0
    with pytest.raises(RuntimeError):  # an admission that fails half-way: the mask written, a bad value after it
        buf.write(slice(0, 2), {"edit.mask": torch.full(mask.shape[1:], 0.5), "edit.known": torch.ones(7)})
    buf.write(slice(0, 2), {})  # the rows' next request: the mask counts as written, so it is filled
    assert float(mask[0:2].min()) == 1.0
    buf.write(slice(0, 2), {"edit.mask": torch.full(mask.shape[1:], 0.5),
                            "edit.known": torch.ones(buf.fields["edit.known"].shape[1:])})
    saved = buf.save_rows(0, 2, 0)
    saved["edit.known"] = torch.ones(7)  # a restore that fails after the mask went in
    buf.write(slice(4, 6), {})
    with pytest.raises(RuntimeError):
        buf.restore_rows(4, saved)
    assert float(mask[4:6].max()) == 0.5
    buf.write(slice(4, 6), {})
    assert float(mask[4:6].min()) == 1.0
    fresh = StepBuffers.allocate(3, tuple(buf.x.shape[1:]), tiny_engine.runner.program,
                                 {}, {}, live.dtype, live.x.device)
    assert float(fresh.fields["edit.mask"].min()) == 1.0 and fresh.save_rows(0, 3, 0).keys().isdisjoint(
        {"edit.mask", "edit.known", "edit.noise0"})



def test_a_lazy_field_is_allocated_at_its_first_write_and_a_preemption_carries_it_to_another_group(tiny_engine):
    """DeepCache's kept features (`cache.deep`, `FieldSpec.lazy`): a group holds no rows of them until a row writes
    them, then every row's (the others neutral); a row saved there resumes in a group that never held them. A step
    that does not read them is handed its buffers without them, so what it compiles (`signature`) is the same before
    and after."""
    from diffgraph.graphs.compiled import signature
    from diffgraph.graphs.step import StepBuffers

    live = tiny_engine.runner.buffers((tiny_engine.info.native_size,) * 2)
    groups = [StepBuffers.allocate(4, tuple(live.x.shape[1:]), tiny_engine.runner.program, {}, {}, live.dtype,
                                   live.x.device) for _ in range(2)]
    first, second = groups
    assert first.specs["cache.deep"].lazy and all(g.fields["cache.deep"].numel() == 0 for g in groups)
    first.write(slice(0, 1), {})
    first.move_rows(0, 2, 1)
    assert first.fields["cache.deep"].numel() == 0 and "cache.deep" not in first.save_rows(2, 1, 0)
    program = tiny_engine.runner.program
    neutral = program.neutral()
    cached = tuple(object() if f.name == "step_cache" else part  # the cache feature's part not neutral
                   for part, f in zip(neutral, program.features))
    assert program.unread(neutral) == ("cache.deep",) and program.unread(cached) == ()
    plain_step = signature(first.head(4, None, program.unread(neutral)), set())
    whole = signature(first.head(4), set())
    first.write(slice(1, 2), {"cache.deep": 2.0})
    assert signature(first.head(4, None, program.unread(neutral)), set()) == plain_step
    assert signature(first.head(4), set()) != whole
    deep = first.fields["cache.deep"]
    assert deep.shape[0] == 4 and first.state["cache.deep"] is deep
    assert float(deep[1].min()) == 2.0 and float(deep[[0, 2, 3]].abs().max()) == 0.0
    saved = first.save_rows(1, 1, 0)
    second.restore_rows(3, saved)
    assert second.fields["cache.deep"].shape[0] == 4 and float(second.fields["cache.deep"][3].min()) == 2.0
    assert float(second.fields["cache.deep"][:3].abs().max()) == 0.0
