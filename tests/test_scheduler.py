"""The scheduler alone, with a fake worker that tracks which request owns each row."""

import dataclasses

import numpy as np
import pytest

from diffgraph.engine.scheduler import QueueFullError, RequestState, Scheduler, SchedulerConfig
from diffgraph.errors import ParamError
from diffgraph.sampling.samplers import NUM_COEFS, make_plan
from diffgraph.sampling.schedules import NoiseSchedule

NOISE = NoiseSchedule.from_config({"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
                                   "timestep_spacing": "leading", "steps_offset": 1})
PLANS = {}


def plan(steps, sampler="euler"):
    if (steps, sampler) not in PLANS:
        PLANS[(steps, sampler)] = make_plan(NOISE, sampler, "default", steps)
    return PLANS[(steps, sampler)]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeWorker:
    """Rows hold the id of the request that owns them; moves copy them like the real buffers."""

    def __init__(self, rows=16):
        self.rows = {}

    def execute(self, plan):
        rows = self.rows.setdefault(plan.key, [None] * 16)
        for src, dst, count in plan.moves:
            rows[dst:dst + count] = rows[src:src + count]
        for s in plan.admitted:
            rows[s.first_row:s.first_row + s.rows] = [s.request_id] * s.rows
        # the live rows are contiguous, in order, and each row's coefficients belong to its owner's step
        expected = [s.request_id for s in plan.live for _ in range(s.rows)]
        assert rows[:plan.n_rows] == expected
        i = 0
        for s in plan.live:
            np.testing.assert_array_equal(plan.coefs[i:i + s.rows], np.broadcast_to(s.plan.coefs[s.step], (s.rows, NUM_COEFS)))
            i += s.rows


def state(rid, steps=4, rows=1, key=(64, 64), arrival=0.0, sampler="euler"):
    return RequestState(request_id=rid, key=key, rows=rows, plan=plan(steps, sampler), arrival=arrival)


def run(sched, worker, max_iters=1000):
    order, finished = [], []
    for _ in range(max_iters):
        p = sched.schedule()
        if p is None:
            if not sched.has_work():
                break
            continue
        worker.execute(p)
        order.append((p.key, p.n_rows))
        finished += [s.request_id for s in sched.update(p)]
    return order, finished


def test_rows_stay_contiguous_and_requests_join_and_leave():
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_rows=8), clock)
    w = FakeWorker()
    sched.add(state("a", steps=3, rows=2))
    sched.add(state("b", steps=6, rows=3))
    p = sched.schedule()
    assert [s.request_id for s in p.admitted] == ["a", "b"] and p.n_rows == 5
    w.execute(p)
    sched.update(p)
    sched.add(state("c", steps=2, rows=4))  # does not fit: 5 + 4 > 8, waits
    p = sched.schedule()
    assert p.admitted == [] and p.n_rows == 5
    w.execute(p)
    sched.update(p)
    p = sched.schedule()
    w.execute(p)
    assert [s.request_id for s in sched.update(p)] == ["a"]  # a leaves after 3 steps
    p = sched.schedule()  # b is compacted to rows 0..2, c joins at row 3
    assert p.moves == [(2, 0, 3)] and [(s.request_id, s.first_row) for s in p.live] == [("b", 0), ("c", 3)]
    w.execute(p)
    sched.update(p)
    order, finished = run(sched, w)
    assert finished == ["c", "b"]


def test_fifo_within_group_and_bucket_limit():
    sched = Scheduler(SchedulerConfig(max_rows=4), Clock())
    for i in range(6):
        sched.add(state(f"r{i}", steps=2, rows=1))
    p = sched.schedule()
    assert [s.request_id for s in p.admitted] == ["r0", "r1", "r2", "r3"] and p.n_rows == 4
    w = FakeWorker()
    w.execute(p)
    sched.update(p)
    order, finished = run(sched, w)
    assert max(n for _, n in order) <= 4
    assert finished[:4] == ["r0", "r1", "r2", "r3"] and sorted(finished[4:]) == ["r4", "r5"]


def guided(rid, steps=4, rows=1, branches=2, arrival=0.0):
    """A request whose rows run `branches` denoiser rows at every step (2: classifier-free guidance; an array: per
    step)."""
    p = plan(steps)
    per_step = np.broadcast_to(np.asarray(branches, dtype=np.int64), (steps,)).copy()
    return RequestState(request_id=rid, key=(64, 64), rows=rows, plan=dataclasses.replace(p, branches=per_step),
                        arrival=arrival)


def _admitted_per_step(sched, w):
    """Each step's admitted request ids and its denoiser rows, until the scheduler has no work."""
    out = []
    while sched.has_work():
        p = sched.schedule()
        w.execute(p)
        out.append(([s.request_id for s in p.admitted], sum(s.cost for s in p.live)))
        sched.update(p)
    return out


def test_requests_behind_one_that_does_not_fit_fill_the_rows_it_cannot_use_without_delaying_it():
    """Guided (2 denoiser rows) and guidance-free (1) requests in a group of 4: the guided r2 does not fit beside
    r0 and r1's 3 rows, so the guidance-free r3 behind it fills the fourth row, which it leaves when that wave ends:
    r2 starts at the step it would have anyway, and two full waves run instead of 3 + 4 + 1 rows."""
    sched = Scheduler(SchedulerConfig(max_rows=4), Clock())
    for i, b in enumerate([2, 1, 2, 1, 1, 1]):
        sched.add(guided(f"r{i}", steps=3, branches=b))
    steps = _admitted_per_step(sched, FakeWorker())
    assert steps[0] == (["r0", "r1", "r3"], 4)  # r2 (2 rows) does not fit beside 3: r3 (1 row) fills the fourth
    assert steps[3] == (["r2", "r4", "r5"], 4) and len(steps) == 6  # strict FIFO: 9 steps, the last 3 at 1 row
    # a request behind the blocked head that would still hold rows when the head could start waits
    sched = Scheduler(SchedulerConfig(max_rows=4), Clock())
    for rid, steps_, rows, b in (("a", 3, 1, 2), ("b", 3, 1, 1), ("head", 3, 2, 2), ("long", 6, 1, 1),
                                 ("short", 3, 1, 1)):
        sched.add(guided(rid, steps=steps_, rows=rows, branches=b))
    steps = _admitted_per_step(sched, FakeWorker())  # "head" needs all 4 rows: "long" would delay it, it waits
    assert [a for a, _ in steps[:4]] == [["a", "b", "short"], [], [], ["head"]] and steps[0][1] == 4
    # every request passed over keeps its place, not only the first: "y" fits beside x1's reservation but not
    # beside x2's, so it waits (passing only x1 would start x2 at step 100 instead of 20)
    sched = Scheduler(SchedulerConfig(max_rows=8), Clock())
    for rid, steps_, rows in (("live", 10, 4), ("x1", 10, 6), ("x2", 10, 7), ("y", 100, 2), ("z", 10, 2)):
        sched.add(guided(rid, steps=steps_, rows=rows, branches=1))
    steps = _admitted_per_step(sched, FakeWorker())
    assert [(i, a) for i, (a, _) in enumerate(steps) if a] == [(0, ["live", "z"]), (10, ["x1"]), (20, ["x2"]),
                                                               (30, ["y"])]


def test_backfill_is_bounded_and_never_passes_a_preempted_request_or_the_growth_policy():
    sched = Scheduler(SchedulerConfig(max_rows=4), Clock())
    sched.add(guided("a", steps=3, branches=1, rows=3))
    for i in range(100):
        sched.add(guided(f"g{i}", steps=3, branches=2))  # none fits beside a's 3 rows
    sched.add(guided("late", steps=3, branches=1))  # more than BACKFILL_SCAN requests behind the head: not seen
    assert [s.request_id for s in sched.schedule().admitted] == ["a"]
    sched = Scheduler(SchedulerConfig(max_rows=4), Clock())
    sched.add(guided("a", steps=3, branches=1, rows=3))
    head = guided("head", steps=3, branches=2)
    head.preempted = True  # a preempted request resumes before any other joins
    sched.add(head)
    sched.add(guided("b", steps=3, branches=1))
    assert [s.request_id for s in sched.schedule().admitted] == ["a"]
    # nor past a preempted request further back (an interactive head passed over, a preempted batch row behind it)
    sched = Scheduler(SchedulerConfig(max_rows=4), Clock())
    sched.add(guided("a", steps=3, branches=1, rows=3))
    sched.add(guided("person", steps=3, branches=2))
    resumed = guided("resumed", steps=3, branches=2)
    resumed.preempted = True
    sched.add(resumed)
    sched.add(guided("b", steps=3, branches=1))
    assert [s.request_id for s in sched.schedule().admitted] == ["a"]
    # nor one that would take what the gates keep for a request passed over: "head" waits for rows, and the one
    # slot its adapter needs stays free for it; "c" needs no slot and joins
    sched = Scheduler(SchedulerConfig(max_rows=4), Clock())
    slot = CountingGate("slot", 1, lambda s: 0 if s.request_id in ("a", "c") else 1)
    sched.gates = (slot,)
    for rid, rows in (("a", 3), ("head", 2), ("b", 1), ("c", 1)):
        sched.add(guided(rid, steps=3, rows=rows, branches=1))
    assert [s.request_id for s in sched.schedule().admitted] == ["a", "c"]
    assert slot.free == 1 and slot.released == [("b", 1)]  # "b" took the slot and gave it back at once
    # the growth policy holding the queue back is not a request that does not fit: nothing is backfilled
    cfg = SchedulerConfig(max_rows=16, buckets=(1, 2, 4, 8, 16), grow_fill=0.9, grow_hold_ms=50_000)
    sched, w = Scheduler(cfg, Clock()), FakeWorker()
    sched.add(guided("a", steps=4, branches=1, rows=3))
    w.execute(p := sched.schedule())
    sched.update(p)
    sched.add(guided("b", steps=4, branches=1, rows=2))  # 3 + 2 = 5 (and 6 with c): bucket 8 under 0.9 full, held
    sched.add(guided("c", steps=4, branches=1))  # would stay within bucket 4, but it is behind the held one
    p = sched.schedule()
    assert p.admitted == [] and sched.growth_holds == 1


def test_first_fit_is_the_first_step_with_room_at_every_step_after():
    from diffgraph.engine.priority import first_fit
    profile = np.array([4, 4, 2, 4, 1, 1])
    assert first_fit(profile, np.array([2, 2]), 4) == 4  # step 2 has room, step 3 does not
    assert first_fit(profile, np.array([3]), 4) == 4
    assert first_fit(profile, np.array([1, 1, 1]), 4) == 4
    assert first_fit(np.array([4, 4]), np.array([4, 4, 4]), 4) == 2  # when the live rows have ended
    assert first_fit(np.array([1]), np.array([2]), 4) == 0
    assert first_fit(np.array([], dtype=np.int64), np.array([4, 4]), 4) == 0
    assert first_fit(np.array([3, 3, 3]), np.array([], dtype=np.int64), 4) == 0


def test_no_group_starves():
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_rows=4), clock)
    w = FakeWorker()
    # group A is kept full with a stream of long requests; group B's single request must still run
    for i in range(4):
        sched.add(state(f"a{i}", steps=50, key=(64, 64), arrival=0.0))
    sched.add(state("b", steps=3, key=(64, 96), arrival=0.1))
    served = []
    for it in range(20):
        clock.t = 1.0 + it
        p = sched.schedule()
        w.execute(p)
        served.append(p.key)
        sched.update(p)
        if it % 2 == 0:
            sched.add(state(f"a-late{it}", steps=50, key=(64, 64), arrival=clock.t))
    assert served.count((64, 96)) == 3  # b ran all of its steps
    # the bound: b (younger than a's requests) is passed over at most max_skips times in a row
    runs = [i for i, k in enumerate(served) if k == (64, 96)]
    gaps = [runs[0]] + [b - a - 1 for a, b in zip(runs, runs[1:])]
    assert max(gaps) <= sched.config.max_skips == 1  # one step of the other size at most (issue 28 point 4)


def test_oldest_request_first_across_groups():
    """Within the starvation bound the oldest request's group goes first (max_skips 4 here; the default of 1 lets
    no size wait more than one step of another)."""
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_rows=4, max_skips=4), clock)
    w = FakeWorker()
    sched.add(state("young", steps=10, key=(64, 96), arrival=0.5))
    sched.add(state("old", steps=3, key=(64, 64), arrival=0.1))
    clock.t = 1.0
    order = []
    for _ in range(4):
        p = sched.schedule()
        w.execute(p)
        order.append(p.key)
        sched.update(p)
    assert order == [(64, 64)] * 3 + [(64, 96)]  # the old request finishes first, then the young one runs


def test_a_request_above_the_largest_bucket_is_refused_with_a_fix_that_exists():
    """With guidance a one-image request needs 2 denoiser rows: where the largest bucket is 1 no num_images fits, so
    the error names the bucket to add (it used to say `use num_images <= 0`)."""
    with pytest.raises(ParamError, match=r"num_images 2 exceeds the largest batch bucket 2 \(4 denoiser rows: "
                                         r"classifier-free guidance costs 2 per image; use num_images <= 1\)"):
        Scheduler(SchedulerConfig(max_rows=2), Clock()).add(guided("a", rows=2))
    with pytest.raises(ParamError, match=r"costs 2 per image; start the engine with a batch bucket of at least 2"):
        Scheduler(SchedulerConfig(max_rows=1), Clock()).add(guided("a"))
    Scheduler(SchedulerConfig(max_rows=1), Clock()).add(guided("b", branches=1))  # one branch: one row fits


def test_queue_full_rejects():
    sched = Scheduler(SchedulerConfig(max_queue=2), Clock())
    sched.add(state("a"))
    sched.add(state("b"))
    with pytest.raises(QueueFullError, match="queue is full"):
        sched.add(state("c"))


def test_a_request_id_in_flight_is_refused_waiting_or_live():
    sched = Scheduler(SchedulerConfig(max_rows=4), Clock())
    sched.add(state("a", key=(64, 64)))
    with pytest.raises(ValueError, match="request_id 'a' is already in flight"):
        sched.add(state("a", key=(96, 64)))  # another group: ids are unique across groups
    assert sched.schedule().admitted[0].request_id == "a"  # now live
    with pytest.raises(ValueError, match="request_id 'a' is already in flight"):
        sched.add(state("a"))
    assert sched.num_waiting == 0


def test_a_request_id_is_free_again_once_its_request_leaves_and_the_index_keeps_nothing():
    """add and abort find a request by its id without scanning the queue (a job's thousands of waiting requests):
    the id is free again after each way out (finished, aborted waiting, aborted live, a failed step), an aborted
    live request's late release leaves the newer request of its id alone, and nothing stays indexed once idle."""
    sched = Scheduler(SchedulerConfig(max_rows=4), Clock())
    w = FakeWorker()
    sched.add(state("done", steps=1))
    run(sched, w)
    sched.add(state("done", steps=1))  # finished: its id is free
    sched.add(state("w", steps=3))
    assert sched.abort("w") and not sched.abort("w")  # aborted while waiting: gone at once
    assert [s.request_id for s in sched.take_aborted()] == ["w"]
    sched.add(state("w", steps=3))
    p = sched.schedule()
    w.execute(p)
    sched.update(p)
    assert sched.abort("w")  # live: its rows are freed at the next boundary, but its id is free now
    newer = state("w", steps=2)
    sched.add(newer)
    assert not sched.abort("w", owner=object())  # not that sink's
    p = sched.schedule()  # drops the aborted one: its release must not forget the newer "w"
    assert [s.request_id for s in sched.take_aborted()] == ["w"]
    with pytest.raises(ValueError, match="request_id 'w' is already in flight"):
        sched.add(state("w"))
    assert [s.request_id for s in sched.fail(p)] == ["w"]  # a failed step: the newer "w" leaves
    sched.add(state("w", steps=1))
    run(sched, w)
    assert sched.schedule() is None and sched._ids == {}
    for rid in ("done", "w"):
        sched.add(state(rid, steps=1))


def test_groups_without_work_are_forgotten():
    """Every size a client asks for makes a group; once it has no work it is dropped (made again on demand)."""
    sched = Scheduler(SchedulerConfig(max_rows=4), Clock())
    w = FakeWorker()
    for i in range(12):
        sched.add(state(f"r{i}", key=(64, 64 + 8 * i), steps=2))
    run(sched, w)
    assert sched.schedule() is None and sched.groups == {}
    sched.add(state("again", key=(64, 72), steps=2))
    _, finished = run(sched, w)
    assert finished == ["again"] and sched.schedule() is None and sched.groups == {}


def test_abort_waiting_and_live():
    sched = Scheduler(SchedulerConfig(max_rows=4), Clock())
    w = FakeWorker()
    sched.add(state("a", steps=5, rows=2))
    sched.add(state("b", steps=5, rows=2))
    sched.add(state("c", steps=5, rows=1))  # waits: no room
    p = sched.schedule()
    w.execute(p)
    sched.update(p)
    assert sched.abort("c") and [s.request_id for s in sched.take_aborted()] == ["c"]
    assert sched.abort("a")
    p = sched.schedule()  # a's rows are freed at this boundary, b moves down
    assert [s.request_id for s in sched.take_aborted()] == ["a"]
    assert p.moves == [(2, 0, 2)] and p.n_rows == 2
    w.execute(p)
    assert not sched.abort("zzz")


def test_request_mode_batches_same_steps_and_runs_to_end():
    clock = Clock()
    sched = Scheduler(SchedulerConfig(batching="request", max_rows=4, max_wait_ms=10), clock)
    w = FakeWorker()
    sched.add(state("a", steps=3, arrival=0.0))
    assert sched.schedule() is None  # waits for company up to max_wait_ms
    sched.add(state("b", steps=5, arrival=0.001))
    sched.add(state("c", steps=3, arrival=0.002))
    clock.t = 0.011
    p = sched.schedule()
    assert [s.request_id for s in p.admitted] == ["a", "c"]  # b has another step count
    w.execute(p)
    sched.update(p)
    sched.add(state("d", steps=3, arrival=clock.t))
    for _ in range(2):
        p = sched.schedule()
        assert p.admitted == []  # nobody joins a running batch
        w.execute(p)
        sched.update(p)
    clock.t = 1.0
    p = sched.schedule()
    assert [s.request_id for s in p.admitted] == ["b"]  # oldest first; d (3 steps) waits
    assert [s.request_id for s in p.live] == ["b"]


def test_full_batch_starts_without_waiting():
    clock = Clock()
    sched = Scheduler(SchedulerConfig(batching="request", max_rows=2, max_wait_ms=1000), clock)
    sched.add(state("a", steps=3))
    assert sched.schedule() is None
    sched.add(state("b", steps=3))
    assert sched.schedule().n_rows == 2


def test_off_mode_runs_one_request_at_a_time():
    sched = Scheduler(SchedulerConfig(batching="off", max_rows=8), Clock())
    w = FakeWorker()
    sched.add(state("a", steps=2, key=(64, 64), arrival=0.0))
    sched.add(state("b", steps=2, key=(64, 96), arrival=0.1))
    sched.add(state("c", steps=2, key=(64, 64), arrival=0.2))
    order, finished = run(sched, w)
    assert finished == ["a", "b", "c"] and all(n == 1 for _, n in order)


def test_fail_empties_the_batch_only():
    sched = Scheduler(SchedulerConfig(max_rows=2), Clock())
    sched.add(state("a"))
    sched.add(state("b"))
    sched.add(state("c"))
    p = sched.schedule()
    assert sorted(s.request_id for s in sched.fail(p)) == ["a", "b"]
    p = sched.schedule()
    assert [s.request_id for s in p.live] == ["c"] and p.moves == []


def test_scheduler_does_not_import_torch_cuda():
    import ast
    import inspect

    import diffgraph.engine.scheduler as mod
    tree = ast.parse(inspect.getsource(mod))
    names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "torch" not in names and not any(m and m.startswith("torch") for m in mods)


def test_pending_abort_counts_as_work():
    """reconfigure() swaps schedulers only when idle: an abort not yet answered must count as work."""
    sched = Scheduler(SchedulerConfig(), Clock())
    sched.add(state("a"))
    assert sched.abort("a") and sched.has_work()
    assert [s.request_id for s in sched.take_aborted()] == ["a"] and not sched.has_work()


def test_growth_into_a_larger_bucket_waits_for_fill_or_hold():
    clock = Clock()
    cfg = SchedulerConfig(max_rows=16, buckets=(1, 2, 4, 8, 16), grow_fill=0.75, grow_hold_ms=500)
    assert [cfg.bucket_for(n) for n in (1, 3, 5, 9, 16, 17)] == [1, 4, 8, 16, 16, 17]
    sched = Scheduler(cfg, clock)
    w = FakeWorker()
    for i in range(7):  # an empty group admits everyone: 7 rows on bucket 8
        sched.add(state(f"a{i}", steps=50))
    p = sched.schedule()
    assert p.n_rows == 7
    w.execute(p)
    sched.update(p)
    for i in range(3):  # 10 rows would pay bucket 16 at 62% fill: only the free row of bucket 8 is taken
        sched.add(state(f"b{i}", steps=50, arrival=clock.t))
    p = sched.schedule()
    assert [s.request_id for s in p.admitted] == ["b0"] and p.n_rows == 8
    w.execute(p)
    sched.update(p)
    for i in range(3, 6):  # 8 live + 5 waiting = 13 of 16 (81%): the group grows, FIFO order kept
        sched.add(state(f"b{i}", steps=50, arrival=clock.t))
    p = sched.schedule()
    assert [s.request_id for s in p.admitted] == ["b1", "b2", "b3", "b4", "b5"] and p.n_rows == 13
    w.execute(p)
    sched.update(p)


def start_group(sched, worker, n, steps=50):
    """n one-row requests admitted together and stepped once; returns that step's plan."""
    for i in range(n):
        sched.add(state(f"a{i}", steps=steps))
    p = sched.schedule()
    worker.execute(p)
    sched.update(p)
    return p


def test_growth_hold_is_bounded_by_grow_hold_ms():
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_rows=16, buckets=(1, 2, 4, 8, 16), grow_fill=0.75, grow_hold_ms=500), clock)
    w = FakeWorker()
    start_group(sched, w, 8)
    sched.add(state("late", steps=50, arrival=clock.t))
    for _ in range(3):  # held while younger than 500 ms
        clock.t += 0.1
        p = sched.schedule()
        assert p.admitted == [] and p.n_rows == 8
        w.execute(p)
        sched.update(p)
    clock.t += 0.25  # 550 ms: admitted, the group grows to bucket 16 with 9 rows
    p = sched.schedule()
    assert [s.request_id for s in p.admitted] == ["late"] and p.n_rows == 9


def test_growth_policy_off_without_buckets_or_fill():
    for cfg in (SchedulerConfig(max_rows=16), SchedulerConfig(max_rows=16, buckets=(1, 2, 4, 8, 16), grow_fill=0)):
        sched = Scheduler(cfg, Clock())
        start_group(sched, FakeWorker(), 8, steps=5)
        sched.add(state("late", steps=5))
        assert [s.request_id for s in sched.schedule().admitted] == ["late"]


def test_growth_admits_the_longest_fifo_prefix_that_fills_its_bucket():
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_rows=16, buckets=(1, 2, 4, 8, 16), grow_fill=0.85, grow_hold_ms=2000), clock)
    w = FakeWorker()
    start_group(sched, w, 4)
    for i in range(5):  # 4 live: taking all 5 gives 9 rows on bucket 16 (56%); the first 4 fill bucket 8 exactly
        sched.add(state(f"b{i}", steps=50, arrival=clock.t))
    p = sched.schedule()
    assert [s.request_id for s in p.admitted] == ["b0", "b1", "b2", "b3"] and p.n_rows == 8
    assert sched.growth_holds == 1
    w.execute(p)
    sched.update(p)
    sched.add(state("c", steps=50, rows=4, arrival=clock.t))  # multi-row requests count their rows, FIFO kept
    sched.add(state("d", steps=50, rows=2, arrival=clock.t))
    p = sched.schedule()  # 8 live + b4 + c + d = 15 of 16 (94%): all join
    assert [s.request_id for s in p.admitted] == ["b4", "c", "d"] and p.n_rows == 15


@pytest.mark.parametrize("kw", [{"grow_fill": 1.5}, {"grow_fill": float("nan")}, {"grow_hold_ms": -1},
                                {"grow_hold_ms": float("nan")}, {"grow_hold_ms": float("inf")},
                                {"max_wait_ms": float("nan")}, {"buckets": (4, 2)}, {"buckets": (0, 2)},
                                {"max_wait_ms": 1e13}, {"grow_hold_ms": 60_001}])
def test_growth_config_is_validated(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):  # the message names the setting
        SchedulerConfig(**kw)


def test_growth_policy_only_where_steps_pad_to_buckets():
    """A resolution without graphs runs its live rows eagerly: nothing is wasted by growing, so nobody waits."""
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_rows=16, buckets=(1, 2, 4, 8, 16), padded=((64, 64),), grow_fill=1.0,
                                      grow_hold_ms=10_000), clock)
    w = FakeWorker()
    for key in ((64, 64), (96, 64)):
        for i in range(8):
            sched.add(state(f"{key}-a{i}", steps=50, key=key))
    while not all(sched.groups[k].live for k in ((64, 64), (96, 64))):  # both groups hold 8 live rows
        p = sched.schedule()
        w.execute(p)
        sched.update(p)
    for key in ((64, 64), (96, 64)):
        sched.add(state(f"{key}-late", steps=50, key=key))
    admitted = {(64, 64): [], (96, 64): []}
    for _ in range(8):  # both groups run within the skip bound
        p = sched.schedule()
        admitted[p.key] += [s.request_id for s in p.admitted if s.request_id.endswith("late")]
        w.execute(p)
        sched.update(p)
    assert admitted == {(64, 64): [], (96, 64): ["(96, 64)-late"]}


class CountingGate:
    """A gate with `free` units: a request takes `need(state)` of them, all or none."""

    def __init__(self, name, free, need):
        self.name, self.free, self.need, self.released = name, free, need, []

    def can_admit(self, s):
        return self.need(s) <= self.free

    def admit(self, s):
        n = self.need(s)
        if n > self.free:
            return None
        self.free -= n
        return n

    def release(self, s, taken):
        self.free += taken
        self.released.append((s.request_id, taken))


def test_gates_compose_all_or_nothing_and_get_back_what_they_gave():
    sched = Scheduler(SchedulerConfig(max_rows=8))
    slots = CountingGate("slots", 2, lambda s: 1)
    memory = CountingGate("memory", 3, lambda s: 2 if s.request_id == "big" else 1)
    sched.gates = (slots, memory)
    for rid in ("a", "big", "c"):
        sched.add(state(rid, steps=2))
    p = sched.schedule()
    assert [s.request_id for s in p.admitted] == ["a", "big"]  # "c" finds no slot left: it waits
    live = {s.request_id: s for s in p.live}
    assert live["a"].admitted == {"slots": 1, "memory": 1} and live["big"].admitted == {"slots": 1, "memory": 2}
    assert slots.free == 0 and memory.free == 0 and sched.num_waiting == 1
    sched.update(p)
    finished = sched.update(sched.schedule())
    assert {s.request_id for s in finished} == {"a", "big"}
    assert sorted(slots.released) == [("a", 1), ("big", 1)] and sorted(memory.released) == [("a", 1), ("big", 2)]
    assert live["a"].admitted == {}  # handed back to the gates
    p = sched.schedule()
    assert [s.request_id for s in p.admitted] == ["c"]


class OptimisticGate(CountingGate):
    """Says yes to can_admit but refuses at admit (its resource went between the two calls)."""

    def can_admit(self, s):
        return True


def test_a_gate_that_refuses_makes_the_others_give_back():
    sched = Scheduler(SchedulerConfig(max_rows=8))
    slots = CountingGate("slots", 4, lambda s: 1)
    refusing = OptimisticGate("memory", 0, lambda s: 1)
    sched.gates = (slots, refusing)
    sched.add(state("a"))
    assert sched.schedule() is None
    # the slot taken for "a" went back inside the attempt; "a" still waits with nothing held
    assert slots.free == 4 and slots.released == [("a", 1)] and sched.num_waiting == 1


def test_a_request_that_backfill_gives_its_gate_units_back_stays_indexed_and_drain_forgets_everything():
    """Backfill can take a request's gate units and give them back while it keeps waiting (the gates must keep
    admitting a request passed over): it is still in flight, so its id stays refused and abort still finds it.
    `drain` (the engine closing or failing for good) takes every request out and forgets every id."""
    sched = Scheduler(SchedulerConfig(max_rows=4), Clock())
    gate = CountingGate("lora", 2, lambda r: 1)
    sched.gates = (gate,)
    for rid, rows in (("a", 3), ("head", 2), ("x", 1)):
        sched.add(state(rid, steps=3, rows=rows))
    p = sched.schedule()
    assert [s.request_id for s in p.admitted] == ["a"] and ("x", 1) in gate.released  # x took a unit, gave it back
    with pytest.raises(ValueError, match="request_id 'x' is already in flight"):
        sched.add(state("x", steps=3))
    assert sched.abort("x") and [s.request_id for s in sched.take_aborted()] == ["x"]
    assert sorted(s.request_id for s in sched.drain()) == ["a", "head"]
    assert sched._ids == {} and not sched.has_work()
    sched.add(state("a"))
