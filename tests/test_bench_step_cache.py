"""tools/bench_step_cache.py on the CPU (fp32, tiny presets, 2 steps, graph mode on the emulated backend): every mode
writes its JSON lines with the fields the GPU run is read by, and the counters of what ran while timed add up; the
figures themselves are GPU ones."""
import importlib.util
import json
import math
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "tools" / "bench_step_cache.py"
_SPEC = importlib.util.spec_from_file_location("bench_step_cache", _PATH)
bsc = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("bench_step_cache", bsc)  # its dataclass looks its module up there
_SPEC.loader.exec_module(bsc)


def positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.jsonl"
    got = bsc.main(["--device", "cpu", "--cases", "random:tiny@64,random:zimage-tiny@64", "--steps", "2",
                    "--warm-steps", "2", "--mode", "one,saturation,half", "--caches", "off,auto,deepcache:3",
                    "--burst", "2", "--repeats", "1", "--out", str(out)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == got  # a line per record, as it finished
    return got


def test_one_image_times_each_setting_and_names_what_auto_chose(records):
    one = [r for r in records if r["mode"] == "one" and r["case"] == "random:tiny@64"]
    assert [(r["cache"], r["setting"], r["interval"]) for r in one] == [
        ("off", "off", 1), ("auto", "deepcache interval 2, branch 0, uniform", 2),
        ("deepcache:3", "deepcache interval 3, branch 0, uniform", 3)]
    assert one[0]["speedup"] == 1.0 and all(positive(r["ms"]) and positive(r["speedup"]) for r in one)
    # the timed run: 1 repeat of 2 steps, each replayed or eager, every graph made by the warm-up runs
    assert all((len(r["warmup_ms"]), r["steps"], r["steps_run"], r["captures"], r["compiles"], r["compile"])
               == (2, 2, 2, 0, 0, False) for r in one)
    assert all(sum(r["replays"].values()) + r["eager_steps"] == 2 for r in one)
    assert (one[0]["replays"], one[0]["eager_steps"]) == ({"step": 2}, 0)
    assert one[0]["warmup_captures"] >= 1 and one[0]["warmup_capture_ms"] > 0  # the first use made the graphs


def test_saturation_compares_the_same_burst_cached_and_uncached(records):
    for case, setting in (("random:tiny@64", "deepcache interval 3, branch 0, uniform"),
                          ("random:zimage-tiny@64", "taylorseer interval 3, order 1")):
        plain, cached = [r for r in records if r["mode"] == "saturation" and r["case"] == case]
        assert (plain["setting"], cached["setting"], plain["images"], cached["images"]) == ("off", setting, 2, 2)
        assert positive(plain["images_per_s"]) and positive(cached["ratio"]) and positive(cached["warmup_s"])
        assert cached["ratio"] == pytest.approx(cached["images_per_s"] / plain["images_per_s"])
        assert 0 <= cached["mean_abs_diff_levels"] <= cached["max_abs_diff_levels"] <= 255
        assert (plain["replays"], plain["captures"], cached["captures"]) == ({"step": 2}, 0, 0)
    zimage = [r for r in records if r["mode"] == "saturation" and r["case"] == "random:zimage-tiny@64"][1]
    assert set(zimage["replays"]) <= {"step_step_cache_all", "step_step_cache_run0"}  # TaylorSeer's own graphs
    assert sum(zimage["replays"].values()) == 2 and zimage["eager_steps"] == 0


def test_half_cached_burst_against_its_halves_apart(records):
    for case in ("random:tiny@64", "random:zimage-tiny@64"):
        apart = [r for r in records if r["mode"] == "half_apart" and r["case"] == case]
        (mix,) = [r for r in records if r["mode"] == "half" and r["case"] == case]
        assert [r["images"] for r in apart] == [1, 1] and mix["images"] == 2
        assert [r["steps_run"] for r in apart] == [2, 2] and mix["steps_run"] == 2  # the mix's rows shared steps
        assert mix["ratio"] == pytest.approx(mix["apart_s"] / mix["wall_s"]) and positive(mix["ratio"])
        assert mix["mix_vs_apart_max_levels"] <= 1  # a row's image does not depend on its companions
    # a mode that fails records its error and the next runs: UNet settings on a DiT
    assert [(r["case"], r["mode"], r["error"]) for r in records if "error" in r] == [
        ("random:zimage-tiny@64", "one", "ParamError: step_cache method 'deepcache' is for UNet models; this "
                                         "transformer model takes: taylorseer, first_block")]
    assert [r["guidance"] for r in records if r["mode"] == "ready"] == [7.5, 1.0]  # the models' defaults


def test_a_spent_budget_skips_the_modes_and_says_so(tmp_path):
    got = bsc.main(["--device", "cpu", "--cases", "random:tiny@64", "--mode", "saturation", "--budget-s", "0",
                    "--out", str(tmp_path / "b.jsonl")])
    assert [r["mode"] for r in got] == ["run", "ready", "saturation"] and "--budget-s" in got[-1]["skipped"]
    with pytest.raises(SystemExit, match="--mode 'twice' is unknown; allowed: one, saturation, half"):
        bsc.main(["--device", "cpu", "--mode", "one,twice", "--out", str(tmp_path / "c.jsonl")])


def test_summarize_reads_a_run_back(records, tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:-3]))  # a run killed before its last records
    capsys.readouterr()
    assert bsc.main(["--summarize", str(path)]) == records[:-3]
    lines = capsys.readouterr().out.splitlines()
    results = [r for r in records[:-3] if "steps_run" in r or "error" in r]
    assert len(lines) == len(results) and "deepcache interval 2, branch 0, uniform" in lines[1]
    assert " ms  x" in lines[1] and "img/s  x" in lines[4] and "levels to uncached" in lines[4]
