"""Finished batch rows wait a few steps for companions before their decode (engine/decode_batches.py, retirement.py):
the rules on their own, then the engine's decodes and images with batch and interactive requests finishing at
different steps."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diffgraph.config import GraphConfig
from diffgraph.engine.decode_batches import DecodeBatches
from diffgraph.engine.graph_setup import decode_chunks
from diffgraph.engine.model_runner import ModelRunner

A, B = (64, 64), (80, 80)


def _row(batch=True, rows=1):
    return SimpleNamespace(batch=batch, rows=rows)


def _lat(n):
    return torch.zeros(n, 4, 8, 8)


def _sizes(out):
    return [(k, sum(s.rows for s in states), sum(int(p.shape[0]) for p in parts)) for k, states, parts in out]


def test_batch_rows_wait_for_a_full_decode_then_go_together():
    d = DecodeBatches(size=4, hold_steps=4)
    assert d.due(A, [_row()], _lat(1), step=1, more_coming=True) == []
    assert d.due(A, [_row(rows=2)], _lat(2), step=2, more_coming=True) == []
    assert d.holding
    assert _sizes(d.due(A, [_row()], _lat(1), step=3, more_coming=True)) == [(A, 4, 4)]
    assert not d.holding


def test_an_interactive_row_goes_at_once_and_takes_held_rows_only_to_fill_its_replay():
    d = DecodeBatches(size=4, hold_steps=4)
    assert d.due(A, [_row(), _row()], _lat(2), step=1, more_coming=True) == []
    out = d.due(A, [_row(batch=False)], _lat(1), step=2, more_coming=True)  # 2 held: they wait for a full replay
    assert _sizes(out) == [(A, 1, 1)] and [s.batch for s in out[0][1]] == [False] and d.holding
    assert d.due(A, [_row()], _lat(1), step=3, more_coming=True) == []
    people = [_row(batch=False), _row()]  # an interactive and a batch row finish together: 4 held, 3 go with it
    out = d.due(A, people, torch.arange(2.0).view(2, 1, 1, 1).expand(2, 4, 8, 8), step=4, more_coming=True)
    assert _sizes(out) == [(A, 4, 4)] and [s.batch for s in out[0][1]] == [False, True, True, True]
    assert torch.cat(out[0][2])[:, 0, 0, 0].tolist() == [0, 0, 0, 0] and d.holding  # the oldest went, the newest waits
    out = d.due(A, [_row(), _row(), _row(rows=2)], _lat(4), step=5, more_coming=True)  # 5 rows: they go
    assert _sizes(out) == [(A, 5, 5)] and torch.cat(out[0][2])[0, 0, 0, 0] == 1 and not d.holding
    held = [_row(), _row()]
    d.due(A, held, _lat(2), step=6, more_coming=True)
    out = d.due(A, [_row(batch=False, rows=2)], _lat(2), step=7, more_coming=True)  # 2 + the 2 held fill 4
    assert _sizes(out) == [(A, 4, 4)] and [s.batch for s in out[0][1]] == [False, True, True] and not d.holding
    d.due(A, [_row(rows=2)], _lat(2), step=8, more_coming=True)
    out = d.due(A, [_row(batch=False)], _lat(1), step=9, more_coming=True)  # 3 needed, a 2-row request held: none
    assert _sizes(out) == [(A, 1, 1)] and d.holding


def test_held_rows_go_after_hold_steps_when_their_group_runs_out_of_batch_rows_and_when_nothing_steps():
    d = DecodeBatches(size=4, hold_steps=4)
    d.due(A, [_row()], _lat(1), step=1, more_coming=True)
    assert d.due(A, [], None, step=4, more_coming=True) == []
    assert _sizes(d.due(A, [], None, step=5, more_coming=True)) == [(A, 1, 1)]  # waited 4 steps
    d.due(A, [_row()], _lat(1), step=6, more_coming=True)
    d.due(B, [_row()], _lat(1), step=7, more_coming=True)
    assert _sizes(d.due(B, [], None, step=8, more_coming=False)) == [(B, 1, 1)]  # B has no batch rows left; A waits
    assert _sizes(d.due(None, [], None, step=8, more_coming=False)) == [(A, 1, 1)]  # the engine has nothing to step
    d.due(A, [_row()], _lat(1), step=9, more_coming=True)
    assert _sizes(d.take_all()) == [(A, 1, 1)] and not d.holding


def test_rows_left_after_an_interactive_decode_took_the_oldest_wait_from_their_own_step():
    d = DecodeBatches(size=4, hold_steps=4)
    d.due(A, [_row()], _lat(1), step=1, more_coming=True)
    d.due(A, [_row(), _row()], _lat(2), step=3, more_coming=True)
    d.due(A, [_row()], _lat(1), step=4, more_coming=True)  # 4 held: they go together
    d.due(A, [_row()], _lat(1), step=6, more_coming=True)
    d.due(A, [_row(), _row()], _lat(2), step=7, more_coming=True)
    out = d.due(A, [_row(batch=False)], _lat(1), step=8, more_coming=True)  # takes the 3 held: none left
    assert _sizes(out) == [(A, 4, 4)] and not d.holding
    d.due(A, [_row()], _lat(1), step=9, more_coming=True)
    d.due(A, [_row(), _row()], _lat(2), step=10, more_coming=True)
    out = d.due(A, [_row(batch=False), _row()], _lat(2), step=11, more_coming=True)  # 1 + 2 oldest; step 11's waits
    assert _sizes(out) == [(A, 4, 4)] and d.holding
    assert d.due(A, [], None, step=14, more_coming=True) == []  # held at 11: 3 steps, it waits on (not from 9)
    assert _sizes(d.due(A, [], None, step=15, more_coming=True)) == [(A, 1, 1)]


def test_a_full_group_sends_its_oldest_rows_in_whole_replays_and_the_rest_wait_from_their_own_steps():
    d = DecodeBatches(size=4, hold_steps=4)
    d.due(A, [_row(), _row(), _row()], torch.arange(3.0).view(3, 1, 1, 1).expand(3, 4, 8, 8), step=1,
          more_coming=True)
    rows = torch.arange(3.0, 6.0).view(3, 1, 1, 1).expand(3, 4, 8, 8)
    out = d.due(A, [_row(), _row(), _row()], rows, step=2, more_coming=True)  # 6 held: the oldest 4 go
    assert _sizes(out) == [(A, 4, 4)] and torch.cat(out[0][2])[:, 0, 0, 0].tolist() == [0, 1, 2, 3] and d.holding
    assert d.due(A, [], None, step=5, more_coming=True) == []  # held at 2: 3 steps
    out = d.due(A, [], None, step=6, more_coming=True)
    assert _sizes(out) == [(A, 2, 2)] and torch.cat(out[0][2])[:, 0, 0, 0].tolist() == [4, 5] and not d.holding
    d.due(A, [_row(rows=3)], _lat(3), step=7, more_coming=True)
    out = d.due(A, [_row(rows=2)], _lat(2), step=8, more_coming=True)  # 3 + 2: no prefix fills 4, both go
    assert _sizes(out) == [(A, 5, 5)] and not d.holding
    d.due(A, [_row(), _row()], _lat(2), step=9, more_coming=True)
    out = d.due(A, [_row(), _row()], _lat(2), step=10, more_coming=True)  # exactly 4: all go, nothing held
    assert _sizes(out) == [(A, 4, 4)] and not d.holding
    out = d.due(A, [_row(rows=5)], _lat(5), step=11, more_coming=True)  # one request of more than a replay
    assert _sizes(out) == [(A, 5, 5)] and not d.holding
    d.due(A, [_row(), _row(), _row()], _lat(3), step=12, more_coming=True)
    out = d.due(A, [_row(), _row(rows=5)], _lat(6), step=13, more_coming=True)  # 4 go, the 5-row one waits
    assert _sizes(out) == [(A, 4, 4)] and d.holding
    out = d.due(A, [_row()], _lat(1), step=14, more_coming=True)  # 5 + 1: no prefix fills whole replays: all go
    assert _sizes(out) == [(A, 6, 6)] and not d.holding


def test_a_decode_is_split_into_whole_buckets_largest_first():
    assert [decode_chunks(n) for n in range(1, 10)] == [[1], [2], [2, 1], [4], [4, 1], [4, 2], [4, 2, 1], [4, 4],
                                                         [4, 4, 1]]
    assert decode_chunks(0) == []


def test_decodes_follow_the_vae_graphs_buckets_when_the_batch_buckets_stop_below_four(tiny_engine):
    """With batch buckets (1, 2) the VAE graphs stop at 2: 4 held rows decode as two replays of 2 (not one uncovered,
    eager decode of 4), and a job's rows are held for 2 companions, not 4."""
    from diffgraph.engine.previews import PreviewMaker
    from diffgraph.engine.retirement import Retirement
    cfg = GraphConfig(batch_buckets=(1, 2), resolutions=((64, 64),), backend="emulated")
    runner, key = ModelRunner(tiny_engine.model, mode="graph", graphs=cfg), (64, 64)
    runner.decode(key, torch.randn((4, *runner.latent_shape(key))))
    vae = {k[-1]: s.replays for k, s in runner.graph_runner.stats.items() if k[0] == "vae"}
    assert runner.decode_buckets == (1, 2) and vae == {1: 0, 2: 2} and not runner.graph_runner.uncovered
    assert Retirement(runner, PreviewMaker(runner, None), 1, False)._batches.size == 2


def test_three_rows_decode_as_replays_of_two_and_one_and_equal_each_row_decoded_alone(tiny_engine):
    """No replay carries a padded row (it would cost a decoded one): 3 rows replay the VAE's buckets 2 and 1."""
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), backend="emulated")
    runner, key = ModelRunner(tiny_engine.model, mode="graph", graphs=cfg), (64, 64)
    latents = torch.randn((3, *runner.latent_shape(key)), generator=torch.Generator().manual_seed(0))
    replays, replay = [], runner.graph_runner.replay

    def recording(kind, *args):
        replays.append((kind, args[-1]))
        return replay(kind, *args)
    runner.graph_runner.replay = recording
    pixels = runner.decode(key, latents)
    assert [b for kind, b in replays if kind == "vae"] == [2, 1]
    alone = np.concatenate([runner.decode_pixels(latents[i:i + 1]).permute(0, 2, 3, 1).float().numpy()
                            for i in range(3)])
    np.testing.assert_allclose(pixels, alone, atol=1e-5)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="size >= 1"):
        DecodeBatches(size=0, hold_steps=4)


# -- the engine ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_engine):
    """The tiny model's engine with the growth policy off (grow_fill 0): requests queued together are admitted at one
    step whatever the wall clock says (the policy's hold is in milliseconds), so the steps the tests count are fixed."""
    from diffgraph import Engine
    with Engine(model=tiny_engine.model, grow_fill=0.0) as e:
        yield e


def _run_together(engine, requests):
    """Submits the requests while the loop is held between two steps, so they are admitted at one step; returns
    their results and the decodes launched meanwhile (the images in each, the engine step it followed, counted from
    the held loop's)."""
    runner, decodes = engine.runner, []
    decode_async = runner.decode_async

    def recording(key, latents, size=None):
        decodes.append((int(latents.shape[0]), engine.core.scheduler.steps_run))
        return decode_async(key, latents, size)

    entered, gate, base = threading.Event(), threading.Event(), []

    def hold():  # on the loop thread, between two steps: no step runs until the gate opens
        base.append(engine.core.scheduler.steps_run)
        entered.set()
        gate.wait(60)
    runner.decode_async = recording
    try:
        held = engine.core.call_between_steps(hold)
        assert entered.wait(60)  # submitted only once the loop waits: one poll sees them all
        futures = [engine.submit(r) for r in requests]
        gate.set()
        held.result(60)
        results = [f.result(120) for f in futures]
    finally:
        del runner.decode_async
    return results, [(n, step - base[0]) for n, step in decodes]


def _request(engine, steps, seed, priority="batch"):
    r = engine.make_request("a red circle", num_inference_steps=steps, seed=seed, width=64, height=64,
                            guidance_scale=1.0, sampler="euler")
    return dataclasses.replace(r, priority=priority, job="j" if priority == "batch" else None)


def _equal_each_alone(engine, requests, results):
    for request, result in zip(requests, results):
        alone = engine.submit(_request(engine, request.num_inference_steps, request.seed, "interactive")).result(120)
        np.testing.assert_allclose(result.arrays, alone.arrays, atol=1e-5)


def test_batch_rows_finishing_one_a_step_decode_as_one_batch_and_give_the_images_made_alone(engine):
    requests = [_request(engine, steps, seed) for seed, steps in enumerate((2, 3, 4, 5, 6))]
    results, decodes = _run_together(engine, requests)
    assert decodes == [(4, 5), (1, 6)]
    _equal_each_alone(engine, requests, results)


def test_an_interactive_request_decodes_at_its_last_step_with_held_batch_rows_that_fill_its_replay(engine):
    requests = [_request(engine, 2, 0), _request(engine, 3, 1, "interactive"), _request(engine, 9, 2)]
    _, decodes = _run_together(engine, requests)
    assert decodes == [(1, 3), (2, 9)]  # the held row waits for the last
    requests = [_request(engine, 2, seed) for seed in range(3)]
    requests += [_request(engine, 3, 3, "interactive"), _request(engine, 9, 4)]
    results, decodes = _run_together(engine, requests)
    assert decodes == [(4, 3), (1, 9)]
    _equal_each_alone(engine, requests, results)


def test_a_held_row_is_answered_when_the_rest_of_its_group_is_aborted(engine):
    requests = [_request(engine, 2, 0), _request(engine, 200, 1)]
    base = engine.core.scheduler.steps_run
    reached, proceed = threading.Event(), threading.Event()

    def listener(plan, _):  # on the loop thread: the loop waits at the end of the third step
        if engine.core.scheduler.steps_run - base == 3:
            reached.set()
            proceed.wait(60)
    engine.step_listeners.append(listener)
    try:
        gate = threading.Event()
        held = engine.core.call_between_steps(lambda: gate.wait(60))
        futures = [engine.submit(r) for r in requests]
        gate.set()
        held.result(60)
        assert reached.wait(60)
        assert not futures[0].done()  # finished at step 2, held: a batch row of its group is live
        engine.abort(requests[1].request_id)
        proceed.set()
        assert futures[0].result(120).arrays.shape == (1, 64, 64, 3)
        assert engine.core.scheduler.steps_run - base == 3  # no step ran: decoded once there was none to run
    finally:
        proceed.set()
        engine.step_listeners.remove(listener)


def test_once_the_held_rows_are_failed_a_later_decode_answers_with_that_error_and_runs_nothing(tiny_engine):
    """After the failure policy trips (Retirement.fail_held), decodes already due in the same pass are answered with
    the trip's error (retryable), and nothing reaches the device."""
    from diffgraph.engine.previews import PreviewMaker
    from diffgraph.engine.retirement import Retirement
    from diffgraph.request import EngineClosed
    runner = ModelRunner(tiny_engine.model, mode="eager")
    retirement, answers = Retirement(runner, PreviewMaker(runner, None), 1, False), []
    runner.decode_async = lambda *a: pytest.fail("decoded after the trip")
    row = SimpleNamespace(rows=1, batch=True, request_id="r",
                          sink=SimpleNamespace(finish=lambda result, error: answers.append((result, error))))
    error = EngineClosed("the engine failed (a test); retry this request on another replica")
    retirement.fail_held(error)
    retirement._decode(A, [row], [_lat(1)])
    assert answers == [(None, error)]
    retirement.shutdown()
