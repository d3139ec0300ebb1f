"""The step-cache quality table (bench/step_cache_quality.py, tools/step_cache_quality.py): its computation on the
trained `digits` preset for one tiny setting, the FLOP-counted saving per branch, and the rule that picks "auto"."""

import numpy as np
import pytest

from diffgraph.bench.step_cache_quality import (QualityRow, choose_auto, format_table, grid, measure, side_by_side,
                                                skip_shares)
from diffgraph.models import presets
from diffgraph.models.families.unet_cache import DeepCache

pytest.importorskip("sklearn")
if presets.shipped_preset_folder("digits") is None:
    pytest.skip("trained assets missing (make them with tools/train_digits.py)", allow_module_level=True)

from diffgraph import Engine  # noqa: E402
from diffgraph.models.digits_oracle import train_oracle  # noqa: E402


def test_the_tables_computation_on_digits_is_sane():
    setting = DeepCache(interval=2, branch=3)
    with Engine(model="digits", device="cpu", mode="eager") as engine:
        shares = skip_shares(engine)
        rows = measure(engine, "digits", train_oracle(), ["off", setting], seeds=2, steps=4)
    uncached, again, cached = rows
    assert uncached.setting is None and (uncached.full, uncached.evaluations, uncached.cost) == (4, 4, 1.0)
    assert (again.mean_levels, again.max_levels) == (0.0, 0.0)  # uncached against itself, same seeds
    assert again.score == uncached.score and 0.0 <= uncached.score <= 1.0
    assert cached.setting == setting and (cached.full, cached.evaluations, cached.interval) == (2, 4, 2.0)
    assert cached.skip == shares[3] and cached.cost == pytest.approx(0.5 + 0.5 * (1 - shares[3]))
    assert 0.0 <= cached.score <= 1.0 and 0.0 < cached.mean_levels <= cached.max_levels <= 255
    # the deeper the branch, the less a cached evaluation skips; branch 0 keeps only conv_in, one up layer, conv_out
    assert sorted(shares) == [0, 1, 2, 3] and shares[0] > shares[1] > shares[2] > shares[3] > 0 and shares[0] > 0.7


def _row(interval, branch, score, mean, skip=0.5):
    return QualityRow(DeepCache(interval=interval, branch=branch), 20, -(-20 // interval), skip, score, mean, mean * 9)


def test_auto_is_the_cheapest_setting_within_the_score_and_pixel_bounds():
    uncached = QualityRow(None, 20, 20, 0.0, 0.9, 0.0, 0.0)
    mild, fast, lossy, misread = (_row(2, 1, 0.9, 1.5, 0.3), _row(3, 2, 0.89, 2.9, 0.4), _row(4, 0, 0.9, 3.5, 0.8),
                                  _row(5, 0, 0.85, 2.0, 0.8))
    assert fast.cost < mild.cost and lossy.cost < fast.cost
    assert choose_auto([uncached, mild, fast, lossy, misread]) is fast  # lossy: > 3 levels; misread: score -0.05
    assert choose_auto([uncached, lossy, misread]) is None
    table = format_table([uncached, mild, fast], fast)
    assert table.splitlines()[2].startswith("| off | 20 / 20 | 1.00 | 0% | 1.00 | 1.00x | 0.90 | 0.00 | 0 |")
    assert "| uniform interval 3, branch 2 **(auto)** | 7 / 20 | 2.86 | 40% | 0.74 | 1.35x | 0.89 | 2.90 |" in table
    assert len(grid(4)) == 32 and grid(4)[-1] == DeepCache(interval=5, branch=3, schedule="nonuniform")


def test_side_by_side_puts_each_seeds_uncached_image_left_of_its_cached_one():
    ref, cached = np.zeros((3, 8, 8, 3), np.uint8), np.full((3, 8, 8, 3), 255, np.uint8)
    sheet = np.asarray(side_by_side(ref, cached, per_row=2))
    assert sheet.shape == (8 + 4 + 8, (8 + 4 + 8) + 8 + (8 + 4 + 8), 3)  # two pairs a row, 4-pixel gaps, 8 between
    assert (sheet[:8, :8] == 0).all() and (sheet[:8, 12:20] == 255).all() and (sheet[:8, 8:12] == 128).all()
    assert (sheet[:8, 28:36] == 0).all() and (sheet[:8, 40:] == 255).all() and (sheet[8:12] == 128).all()
    assert (sheet[12:, :8] == 0).all() and (sheet[12:, 12:20] == 255).all() and (sheet[12:, 24:] == 128).all()


def test_the_tables_command_runs_on_the_cpu(monkeypatch, capsys):
    import runpy
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "step_cache_quality.py"
    monkeypatch.setattr("sys.argv", [str(tool), "--models", "digits", "--per-digit", "1", "--steps", "2",
                                     "--intervals", "2"])
    runpy.run_path(str(tool), run_name="__main__")
    out = capsys.readouterr().out
    assert "### digits: 2 evaluations (euler), 10 images a setting" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| setting")]
    assert len(rows) == 1 + 8 and rows[0].startswith("| off | 2 / 2 | 1.00 | 0% | 1.00 | 1.00x |")  # 4 branches x 2
    assert all(" 1 / 2 | 2.00 |" in row for row in rows[1:]) and "\nauto for digits: " in out


def test_compare_on_a_transformer_reports_its_setting_without_unet_counts():
    from diffgraph.bench.step_cache_quality import compare_step_cache

    setting = {"method": "taylorseer", "interval": 2}
    result = compare_step_cache("digits-zimage", setting, seeds=2, steps=4, device="cpu")
    text = result.format()
    assert text.startswith('digits-zimage: step cache {"method": "taylorseer", "interval": 2} against uncached on cpu, '
                           '2 seed(s), 4 evaluations, 64x64'), text
    assert "UNet" not in text and result.row.setting is None  # no DeepCache: no FLOPs counted
    assert 0 < result.row.mean_levels <= result.row.max_levels and 0 <= result.reference_score <= 1
    assert result.image.size == (2 * (64 + 4 + 64) + 8, 64)


def test_the_named_settings_command_counts_a_first_block_cache_s_full_evaluations(monkeypatch, capsys):
    import json
    import runpy
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "step_cache_quality.py"
    monkeypatch.setattr("sys.argv", [str(tool), "--model", "digits-zimage", "--per-digit", "1", "--settings",
                                     '{"method": "first_block", "threshold": 0}',
                                     '{"method": "first_block", "threshold": 1e9}'])
    runpy.run_path(str(tool), run_name="__main__")
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["full"] for r in rows] == [1.0, 1.0, 1 / 8]  # off; threshold 0: every evaluation; huge: the first
    assert rows[1]["mean_levels"] == 0 and rows[2]["mean_levels"] > 0 and all(r["images"] == 10 for r in rows)
