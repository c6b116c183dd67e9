"""The demo's and the threshold sweep's pure logic: collapse rule, seed statistics, labels, plan and tables."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import demo, tasks
from bench import demo_stats as stats
from bench import hvd_worker as worker
from bench.experiments import threshold_sweep as sweep

REPO = Path(__file__).resolve().parent.parent
WORKER = [sys.executable, "-m", "bench.hvd_worker", "demo"]   # run from the repository root, as the launchers do


def run(compressor: str, seed: int, metric: float, *, task: str = "t", budget: float | None = None,
        ratio: float = 1.0, collapsed: bool = False, thresholds: tuple[float, float] | None = None,
        metric_name: str = "val_accuracy") -> dict[str, Any]:
    if thresholds is None and compressor == "safebits":
        thresholds = stats.DEFAULT_THRESHOLDS
    return {"task": task, "compressor": compressor, "budget_bits": budget, "seed": seed, "final_loss": 1.0,
            "final_metric": metric, "metric_name": metric_name, "compression_ratio": ratio, "violations": 1,
            "escalations": 2, "collapsed": collapsed, "wall_s": 1.0,
            "max_distortion": thresholds[0] if thresholds else None,
            "min_cosine": thresholds[1] if thresholds else None, "bits_per_param": 32.0 / ratio}


def test_default_thresholds_are_the_library_defaults() -> None:
    assert stats.DEFAULT_THRESHOLDS == (0.5, 0.7)


@pytest.mark.parametrize("initial,final,nonfinite,expected", [
    (2.3, 0.1, False, False),      # trained
    (2.3, 2.3, False, True),       # back at chance level
    (2.3, 2.07, False, False),     # exactly 10% below: not collapsed
    (2.3, 2.08, False, True),      # less than 10% below
    (2.3, 9.0, False, True),       # diverged upward
    (2.3, math.nan, False, True),
    (2.3, math.inf, False, True),
    (2.3, 0.1, True, True),        # a non-finite training loss or parameter
])
def test_collapsed(initial: float, final: float, nonfinite: bool, expected: bool) -> None:
    assert stats.collapsed(initial, final, nonfinite) is expected


def test_mean_std() -> None:
    assert stats.mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert stats.mean_std([4.0]) == (4.0, 0.0)
    mean, std = stats.mean_std([])
    assert math.isnan(mean) and math.isnan(std)


def test_paired_difference_pairs_by_seed() -> None:
    a = [run("safebits", s, m, budget=2.0) for s, m in [(0, 0.9), (1, 0.8), (2, 0.7)]]
    b = [run("qsgd2", s, m) for s, m in [(2, 0.6), (0, 0.8), (5, 0.0)]]   # seed 1 missing, seed 5 extra
    mean, std, n = stats.paired_difference(a, b)
    assert n == 2 and mean == pytest.approx(0.1) and std == pytest.approx(0.0, abs=1e-12)


def test_run_label() -> None:
    assert stats.run_label(run("fp32", 0, 1.0)) == "fp32"
    assert stats.run_label(run("safebits", 0, 1.0, budget=4.4)) == "safebits@4.4"
    assert stats.run_label(run("safebits", 0, 1.0, budget=2.0, thresholds=(0.3, 0.9))) == "safebits[d=0.3,c=0.9]@2"
    assert stats.run_label(run("unscreened", 0, 1.0, budget=1.0)) == "unscreened@1"


def test_closest_fixed_by_log_ratio_skips_fp32_and_budgeted() -> None:
    groups = {"fp32": [run("fp32", 0, 1.0, ratio=1.0)],
              "qsgd4": [run("qsgd4", 0, 1.0, ratio=7.9)],
              "qsgd2": [run("qsgd2", 0, 1.0, ratio=15.4)],
              "unscreened@2": [run("unscreened", 0, 1.0, budget=2.0, ratio=16.0)]}
    assert stats.closest_fixed([run("safebits", 0, 1.0, budget=2.0, ratio=11.5)], groups) == "qsgd2"
    assert stats.closest_fixed([run("safebits", 0, 1.0, budget=2.0, ratio=10.5)], groups) == "qsgd4"
    assert stats.closest_fixed([run("safebits", 0, 1.0, budget=2.0, ratio=1.1)], groups) == "qsgd4"
    assert stats.closest_fixed([run("safebits", 0, 1.0, budget=2.0)], {"fp32": groups["fp32"]}) is None


def test_table_verdicts() -> None:
    runs = []
    for s in range(3):
        runs += [run("fp32", s, 0.97), run("qsgd2", s, 0.10 + 0.01 * s, ratio=15.4, collapsed=True),
                 run("safebits", s, 0.96 + 0.001 * s, budget=1.0, ratio=15.0),
                 run("unscreened", s, 0.10 + 0.01 * s + (0.2 if s == 1 else 0.0), budget=1.0, ratio=16.0)]
    md = stats.table(runs)
    assert "| qsgd2 | 3 |" in md and "| 3/3 |" in md
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if "x | qsgd2 |" in line}
    assert "better" in rows["safebits@1"] and "+0.8510 ± 0.0090" in rows["safebits@1"]
    assert rows["unscreened@1"].endswith("| no |")        # +0.067 mean, but the seeds' spread (0.115) is larger


def test_table_lower_is_better() -> None:
    runs = [run("qsgd4", s, 3.0, ratio=7.9, metric_name="val_bits_per_byte") for s in range(3)]
    runs += [run("safebits", s, 2.9 + 0.01 * s, budget=4.4, ratio=7.3, metric_name="val_bits_per_byte")
             for s in range(3)]
    md = stats.table(runs)
    line = next(x for x in md.splitlines() if x.startswith("| safebits@4.4 | 7.30x"))
    assert line.endswith("| better |")
    assert "| 2.9100 ± 0.0100 | - | 7.30x |" in md          # no fp32 run: no relative change


def test_sweep_table_rows_and_cells() -> None:
    runs = [run("safebits", s, 0.9, budget=b, thresholds=t, ratio=16.0) for s in range(3) for b in (1.0, 2.0)
            for t in [(0.5, 0.7), (0.3, 0.9)]]
    runs += [run("unscreened", s, 0.5, budget=1.0, ratio=32.0, collapsed=s == 0) for s in range(3)]
    md = sweep.sweep_table(runs)
    lines = md.splitlines()
    assert lines[2] == "| screen | budget 1 | budget 2 |"
    body = [x for x in lines if x.startswith("| d=") or x.startswith("| unscreened")]
    assert [x.split(" | ")[0] for x in body] == ["| d=0.3, c=0.9", "| d=0.5, c=0.7 (default)", "| unscreened"]
    assert "0.9000 ± 0.0000 / 2.00 b / 3 v / 0/3 c" in body[1]
    assert body[2].endswith("| 0.5000 ± 0.0000 / 1.00 b / 3 v / 1/3 c | - |")


def test_large_lm_task_has_a_million_parameters_and_a_larger_corpus() -> None:
    small = tasks.Task("bytes_lm", "val_bits_per_byte", steps=1, lr=3e-3)
    large = tasks.Task("bytes_lm_large", "val_bits_per_byte", steps=1, lr=1e-3)
    assert sum(p.numel() for p in small.model().parameters()) == 104_192
    assert sum(p.numel() for p in large.model().parameters()) == 1_202_432
    assert len(large.train_bytes) > 4 * len(small.train_bytes)
    assert large.val_windows.shape == small.val_windows.shape == (256, 65)


def test_worker_plan_and_thresholds() -> None:
    assert worker.parse_thresholds("0.3:0.9") == (0.3, 0.9)
    with pytest.raises(argparse.ArgumentTypeError):
        worker.parse_thresholds("0.3")
    plan = worker.make_plan([1.0, 2.0], [None, (0.3, 0.9)], ["fp32", "safebits", "unscreened"])
    assert plan == [("fp32", None, None), ("safebits", 1.0, None), ("safebits", 1.0, (0.3, 0.9)),
                    ("unscreened", 1.0, None), ("safebits", 2.0, None), ("safebits", 2.0, (0.3, 0.9)),
                    ("unscreened", 2.0, None)]
    assert len(worker.make_plan([4.4], [None])) == len(worker.FIXED) + 2
    # at tight budgets the max-scaled and quantizer-menu pairs run too (docs/RESULTS.md, section 2)
    assert worker.make_plan([2.0, 4.4], [None])[len(worker.FIXED):] == [
        ("safebits", 2.0, None), ("unscreened", 2.0, None), ("safebits_maxscaled", 2.0, None),
        ("unscreened_maxscaled", 2.0, None), ("safebits_quantizers", 2.0, None),
        ("unscreened_quantizers", 2.0, None), ("safebits", 4.4, None), ("unscreened", 4.4, None)]


def test_the_demo_tasks_decay_the_learning_rate_on_a_cosine_unless_asked_for_a_constant_one() -> None:
    task = tasks.make_task("digits_cnn", steps=100)
    assert task.schedule == "cosine"
    assert task.lr_at(0) == task.lr == tasks.CNN_LEARNING_RATE
    assert math.isclose(task.lr_at(50), task.lr / 2)
    assert 0 < task.lr_at(99) < 0.001 * task.lr             # nearly 0 at the last step, never negative
    model = task.model()
    optimizer = task.optimizer(model)
    task.set_lr(optimizer, 50)
    assert all(math.isclose(group["lr"], task.lr / 2) for group in optimizer.param_groups)
    constant = tasks.make_task("digits_cnn", steps=100, schedule="constant")
    assert {constant.lr_at(s) for s in range(100)} == {constant.lr}
    with pytest.raises(ValueError, match="schedule"):
        tasks.make_task("digits_cnn", steps=100, schedule="linear")


def test_the_worker_refuses_a_large_plan_for_a_task_it_already_trains() -> None:
    result = subprocess.run([*WORKER, "--out", "unused.json", "--tasks", "bytes_lm_large", "--large-plan", "fp32"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2 and "leave it out of --tasks" in result.stderr


def test_runs_at_a_constant_rate_get_their_own_table() -> None:
    decayed = [dict(run("fp32", s, 0.97), lr_schedule="cosine") for s in range(2)]
    decayed += [dict(run("unscreened", s, 0.96, budget=1.0, ratio=30.0), lr_schedule="cosine") for s in range(2)]
    constant = [dict(run("fp32", s, 0.95), lr_schedule="constant") for s in range(2)]
    constant += [dict(run("unscreened", s, 0.10, budget=1.0, ratio=30.0, collapsed=True), lr_schedule="constant")
                 for s in range(2)]
    md = stats.table(decayed + constant)
    heads = [line for line in md.splitlines() if line.startswith("### ")]
    assert heads == ["### t", "### t, constant learning rate"]
    first, second = md.split("### t, constant learning rate")
    assert "| unscreened@1 | 2 |" in first and "| 0/2 |" in first and "-1.0%" in first    # against its own fp32
    assert "| 2/2 |" in second and "-89.5%" in second
    assert stats.section({"task": "t"}) == "t"               # records from before the schedule was recorded


def test_the_demo_shows_the_constant_rate_regime_unless_the_runs_are_chosen() -> None:
    for full in (True, False):
        args = demo.worker_arguments(full, [])
        assert args[args.index("--constant-plan") + 1:][:len(demo.CONSTANT_PLAN)] == demo.CONSTANT_PLAN
        assert ("--large-plan" in args) == full                     # the larger LM only in --full
    chosen = demo.worker_arguments(True, ["--plan", "fp32"])
    assert "--constant-plan" not in chosen and "--large-plan" not in chosen and chosen[-2:] == ["--plan", "fp32"]
    for name, bits, _ in map(worker.parse_run, demo.CONSTANT_PLAN):    # every name is runnable
        assert name in ("fp32", "unscreened_quantizers", "safebits_quantizers") and bits in (None, 1.0)


def test_a_demo_run_may_be_auto_and_is_labelled_so() -> None:
    assert worker.parse_run("safebits@auto") == ("safebits", "auto", None)
    assert worker.parse_run("safebits@4.4") == ("safebits", 4.4, None)
    assert stats.run_label({"compressor": "safebits", "budget_bits": "auto"}) == "safebits@auto"
    for bad in ("none", "ddp:safebits@4.4"):
        with pytest.raises(argparse.ArgumentTypeError):
            worker.parse_run(bad)


def test_the_plots_take_auto_beside_numeric_budgets(tmp_path: Path) -> None:
    """``demo.plot`` shades SafeBits' runs by budget; ``"auto"`` (a string) sorts after the numbers."""
    curves = {"train_loss": [2.0, 1.5, 1.0], "bits": [100, 100, 100]}
    runs = [{"task": "t", "seed": 0, "compressor": name, "budget_bits": budget, "max_distortion": distortion,
             "min_cosine": 0.7 if distortion else None, "curves": curves}
            for name, budget, distortion in (("fp32", None, None), ("safebits", 4.4, 0.5), ("safebits", "auto", 0.5))]
    paths = demo.plot(runs, str(tmp_path))
    assert len(paths) == 2 and all(Path(p).stat().st_size > 0 for p in paths)


def test_the_progress_line_counts_runs_and_estimates_the_time_left_per_task() -> None:
    progress = worker.Progress(["cnn", "cnn", "lm", "lm"])
    assert progress.line().startswith("run 1/4 (0 done, 0 s so far, time left unknown")
    progress.done(2.0)
    assert progress.seconds_left() == 6.0                     # 1 cnn at 2 s, 2 lm at the overall mean (2 s)
    progress.done(4.0)
    progress.done(10.0)
    assert progress.seconds_left() == 10.0                    # the last lm at the lm mean
    assert progress.line() == "run 4/4 (3 done, 16 s so far, about 10 s left)"


def test_the_worker_refuses_constant_rate_runs_in_a_constant_rate_launch() -> None:
    result = subprocess.run([*WORKER, "--out", "unused.json", "--lr-schedule", "constant", "--constant-plan", "fp32"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2 and "give them in --plan" in result.stderr
