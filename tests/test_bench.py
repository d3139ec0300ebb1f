"""The benchmarks' CPU-side arithmetic: seeded traces and the saturation work measure."""

import numpy as np
import pytest

from diffgraph.bench.throughput import make_trace, work_fraction


def test_trace_is_seeded_and_follows_the_mix():
    a = make_trace(5.0, 20.0, 0, steps=(20, 50), sizes=((512, 512), (768, 512)), samplers=("euler",))
    b = make_trace(5.0, 20.0, 0, steps=(20, 50), sizes=((512, 512), (768, 512)), samplers=("euler",))
    assert a == b and a != make_trace(5.0, 20.0, 1)
    assert 60 < len(a) < 140  # Poisson, 5/s over 20 s
    assert all(0 < x.at <= 20 for x in a) and [x.at for x in a] == sorted(x.at for x in a)
    assert {x.steps for x in a} == {20, 50} and {x.size for x in a} == {(512, 512), (768, 512)}


def test_work_fraction_weighs_rows_by_their_full_bucket_cost():
    cost = {(512, 512): 93.0 / 16, (768, 512): 147.0 / 16}
    steps = [(0.5, (512, 512), 16), (1.0, (512, 512), 8), (1.5, (768, 512), 16), (3.0, (512, 512), 16)]
    # in [0, 2]: 16 + 8 rows at 512 and 16 at 768; the step at t=3 is outside
    assert work_fraction(steps, cost, 0.0, 2.0) == pytest.approx((24 * 93 / 16 + 147) / 2000)
    # back-to-back full steps fill the window exactly
    full = [(0.093 * i, (512, 512), 16) for i in range(1, 101)]
    assert work_fraction(full, cost, 0.0, 9.3) == pytest.approx(1.0)


def test_replay_answers_every_request_of_the_trace(tiny_engine):
    """The open-loop replay on the CPU: every request completes once, latencies and the work measure come out."""
    from diffgraph.bench.throughput import replay

    trace = make_trace(20.0, 0.5, 3, steps=(2, 3), sizes=((64, 64),), samplers=("euler", "dpmpp_2m"))
    assert len(trace) >= 3
    listeners = list(tiny_engine.step_listeners)
    r = replay(tiny_engine, trace, timeout=120, row_step_ms={(64, 64): 1.0})
    assert tiny_engine.step_listeners == listeners  # the replay's own listener is gone
    assert (r["requests"], r["completed"], r["unfinished"], r["errors"]) == (len(trace), len(trace), 0, [])
    assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] and r["mean_live_rows"] >= 1
    assert r["window_work_fraction"] >= 0 and r["images_per_s"] > 0


def test_latency_case_reports_cold_start_parts_and_every_graph():
    """`bench latency` on the CPU (emulated graphs): the cold-start parts are there and the per-graph line names
    every captured key."""
    from diffgraph.bench.latency import format_table, run_case

    case = run_case("random:tiny", 64, [1], steps=2, contenders=["diffgraph_eager", "diffgraph_graph"], repeats=1,
                    buckets=(1, 2), device="cpu")
    assert 0 < case["import_s"] <= case["load_s"] < case["cold_start_graph_s"]
    captured = [r for r in case["graph_table"] if r["status"] == "captured"]
    assert {(r["kind"], r["bucket"]) for r in captured} >= {("step", 1), ("step", 2), ("text", 1), ("vae", 1)}
    text = format_table([case])
    line = next(x for x in text.splitlines() if "per graph (capture / first warm-up ms): " in x)
    assert all(f"{r['kind']}{r['bucket']} " in line + " " for r in captured)
    res = case["results"][1]
    assert res["diffgraph_graph"]["e2e_ms"] > 0 and res["diffgraph_eager"]["step_ms"] > 0
    assert np.isnan(res["diffgraph_graph"]["loop_step_ms"])  # CUDA events only: NaN on the CPU, never made up


def test_replay_counts_each_request_once_when_the_drain_ends(tiny_engine, monkeypatch):
    """A request aborted at the deadline that still finishes (here: every one, the abort is a no-op) counts as
    done, never as both done and unfinished."""
    from diffgraph.bench.throughput import replay

    trace = make_trace(40.0, 0.3, 5, steps=(40, 60), sizes=((64, 64),), samplers=("euler",))
    monkeypatch.setattr(tiny_engine, "abort", lambda request_id: True)
    r = replay(tiny_engine, trace, timeout=0.0, row_step_ms={(64, 64): 1.0})
    assert (r["completed"], r["unfinished"], r["errors"]) == (len(trace), 0, [])


def test_replay_counts_aborted_requests_as_unfinished(tiny_engine):
    from diffgraph.bench.throughput import replay

    trace = make_trace(40.0, 0.3, 5, steps=(40, 60), sizes=((64, 64),), samplers=("euler",))
    r = replay(tiny_engine, trace, timeout=0.0, row_step_ms={(64, 64): 1.0})
    assert r["unfinished"] > 0 and set(r["errors"]) <= {"RequestAborted"}
    assert r["completed"] + r["unfinished"] == r["requests"] == len(trace)


def test_plots_draw_each_mode_against_the_rate(tmp_path):
    from PIL import Image

    from diffgraph.bench.plots import plot_runs

    runs = [{"rate": r, "mode": m, "p50_ms": 100 * r + k, "p90_ms": 150 * r + k, "p99_ms": 200 * r + k,
             "images_per_s": r * (1 - k / 100)} for m, k in (("step", 0), ("request", 50)) for r in (2.0, 1.0, 3.0)]
    data = plot_runs(runs, str(tmp_path / "t.png"), "test")
    assert list(data) == ["step", "request"]
    assert data["step"]["rate"] == [1.0, 2.0, 3.0] and data["step"]["p99"] == [0.2, 0.4, 0.6]
    assert data["request"]["p50"] == [0.15, 0.25, 0.35] and data["request"]["images_per_s"] == [0.5, 1.0, 1.5]
    serve = plot_runs([{"rate": 4.0, "latency_s": {"p50": 0.1, "p90": 0.2, "p99": 0.3}, "images_per_s": 3.9}],
                      str(tmp_path / "s.png"))
    assert serve == {"serve": {"rate": [4.0], "p50": [0.1], "p90": [0.2], "p99": [0.3], "images_per_s": [3.9]}}
    assert Image.open(tmp_path / "t.png").size == (1210, 462)


def test_replay_with_random_adapters_over_fewer_slots():
    """bench throughput --loras: each request picks one of K random adapters (more than the slots); every request
    completes, each adapter was loaded into a slot, nothing was captured."""
    from diffgraph import Engine
    from diffgraph.bench.throughput import captures, random_adapter, replay, with_loras

    trace = make_trace(20.0, 0.6, 5, steps=(2,), sizes=((64, 64),), samplers=("euler",))
    with Engine("random:tiny", device="cpu", dtype="fp32", max_loras=4, max_lora_rank=8) as engine:
        for i in range(6):
            engine.add_lora(f"bench/{i}", random_adapter(engine, 4, i))
        picked = with_loras(trace, 6, 0)
        assert [i.at for i in picked] == [i.at for i in trace] and len({i.lora for i in picked}) > 4
        r = replay(engine, picked, timeout=300, row_step_ms={(64, 64): 1.0})
        assert (r["completed"], r["errors"]) == (len(trace), [])
        assert engine.stats["lora_loads"] >= len({i.lora for i in picked})
        assert captures(engine) == 0


def test_guidance_mix_steps_each_scenario_at_its_denoiser_rows(tiny_engine):
    """The guidance mix (issue 27's bench) on the CPU: each scenario's steps run at the denoiser rows its guidance
    gives (a guided row two, a guidance-free one one, an interval row two only inside [0.2, 0.8) of its steps), and
    the ratios compare the right scenarios. No CUDA: no replay times, no split."""
    from diffgraph.bench import guidance_mix

    report = guidance_mix.run(tiny_engine, 4, (64, 64), repeats=1)
    steps = {name: (r["steps"]["count"], r["steps"]["buckets"]) for name, r in report["scenarios"].items()}
    assert steps == {"4 steps, CFG 7.5": (4, [8]), "4 steps, guidance 0": (4, [4]),
                     "20 steps, CFG 7.5": (20, [8]), "20 steps, half guidance-free": (20, [6]),
                     "20 steps, CFG 7.5 in [0.2, 0.8]": (20, [4, 8])}
    assert all("split" not in r and r["images_per_s"] > 0 for r in report["scenarios"].values())
    ratio = report["ratios"]["4 steps, guidance 0 / 4 steps, CFG 7.5 (images_per_s)"]
    scenarios = report["scenarios"]
    assert ratio["ratio"] == pytest.approx(scenarios["4 steps, guidance 0"]["images_per_s"] /
                                           scenarios["4 steps, CFG 7.5"]["images_per_s"])
    assert ratio["target"] == 1.5 and len(report["ratios"]) == 4  # no steps-only ratio without replay times
    assert "span_ratios" not in report  # nor spans without CUDA


def test_guidance_mix_splits_a_burst_by_its_events():
    """`_split` over stand-ins for CUDA events (times in seconds): the lead up to the first step, the steps' spans,
    the decodes' GPU time, and the host's tail after the last GPU work."""
    from diffgraph.bench.guidance_mix import _split, span_rate

    class Event:
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, other):  # milliseconds, as torch.cuda.Event's
            return (other.t - self.t) * 1e3

    e = Event
    steps = [(e(0.05), e(0.15), False), (e(0.15), e(0.30), False)]
    decodes = [(e(0.12), e(0.14)), (e(0.30), e(0.36))]  # one inside a step's span, one after the last step
    split = _split(e(0.0), steps, decodes, seconds=0.40)
    assert split == pytest.approx({"lead": 0.05, "loop": 0.25, "decode": 0.08, "gpu_span": 0.36, "tail": 0.04})
    assert span_rate(62, split) == pytest.approx(200.0)  # 62 images over 0.31 s, the first step to the last decode


def test_guidance_mix_report_prints_the_split_and_the_span_ratios(capsys):
    from diffgraph.bench.guidance_mix import print_report

    burst = {"images_per_s": 155.0, "request_steps_per_s": 620.0, "seconds": 0.4, "steps_gpu_s": 0.2,
             "steps_only_request_steps_per_s": 1240.0, "steps": {"count": 2, "buckets": [32]}, "span_images_per_s": 200.0,
             "split": {"lead": 0.05, "loop": 0.25, "decode": 0.08, "gpu_span": 0.36, "tail": 0.04}}
    print_report({"requests": 62, "size": "512x512", "scenarios": {"4 steps, guidance 0": burst},
                  "ratios": {"4 steps, guidance 0 / 4 steps, CFG 7.5 (images_per_s)":
                             {"ratio": 1.45, "target": 1.5, "holds": False}},
                  "span_ratios": {"4 steps, guidance 0 / 4 steps, CFG 7.5": 1.52}})
    out = capsys.readouterr().out
    assert "beyond the replays 0.200 s: lead 0.050 s, decodes 0.080 s, tail 0.040 s, rest 0.030 s" in out
    assert "200.00 images/s over the GPU span" in out and "1.450x (target >= 1.5x: MISSED)" in out
    assert "CFG 7.5 (images/s over the GPU spans: a diagnostic)" in out and "1.520x" in out
