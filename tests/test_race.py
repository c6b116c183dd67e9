"""bench.race's figures from recorded curves (target, time to target, the tables), its arguments, and the race's
text task (no launch: ``ddp_tests`` runs the worker)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bench import race
from bench.tasks import TextGPT, model_facts


def curve(*losses: float, every: int = 10, seconds_per_step: float = 0.5) -> list[list[float]]:
    return [[k * every, k * every * seconds_per_step, loss] for k, loss in enumerate(losses)]


def case(compressor: str, losses: tuple[float, ...], seed: int = 0, rate: str = "1gbit",
         **extra: Any) -> dict[str, Any]:
    points = curve(*losses)
    return {"compressor": compressor, "task": "gpt2_text", "seed": seed, "rate": rate, "steps": points[-1][0],
            "curve": points, "final_loss": points[-1][2], "train_seconds": points[-1][1], "budgets": [],
            "parameters": 1000, "tensors": 4, **extra}


def test_the_target_is_the_reference_loss_at_three_quarters_of_its_steps() -> None:
    points = curve(5.0, 4.0, 3.0, 2.5, 2.0)        # steps 0, 10, 20, 30, 40
    assert race.target_of(points, 40) == 2.5        # the first evaluation at or after step 30
    assert race.target_of(points, 40, at=0.5) == 3.0
    with pytest.raises(ValueError):
        race.target_of(points, 80)


def test_time_to_target_interpolates_between_the_evaluations_around_the_crossing() -> None:
    points = curve(5.0, 4.0, 3.0, 2.0)              # seconds 0, 5, 10, 15
    assert race.time_to(points, 3.0) == 10.0
    assert race.time_to(points, 2.5) == pytest.approx(12.5)
    assert race.time_to(points, 6.0) == 0.0
    assert race.time_to(points, 1.9) is None
    assert race.time_to(curve(5.0, 3.0, 4.0, 2.9), 3.5) == pytest.approx(3.75)   # the first crossing counts


def test_every_case_is_timed_against_its_own_task_seed_and_link_reference() -> None:
    cases = [case("ddp:none", (5.0, 4.0, 3.0, 2.5, 2.0)), case("ddp:safebits@4.4", (5.0, 3.5, 2.5, 2.2, 2.1)),
             case("ddp:none", (5.0, 4.5, 4.0, 3.5, 3.0), seed=1), case("ddp:safebits@2", (5.0, 4.9, 4.8, 4.7, 4.6)),
             case("none", (9.0, 8.0, 7.0, 6.0, 5.0), rate="100mbit"),
             case("safebits@4.4", (9.0, 7.0, 6.0, 5.5, 5.0), rate="100mbit")]
    rows = race.summarize(cases)
    assert [row["target"] for row in rows] == [2.5, 2.5, 3.5, 2.5, 6.0, 6.0]
    assert rows[0]["time_to_target"] == 15.0 and rows[1]["time_to_target"] == 10.0
    assert rows[3]["time_to_target"] is None
    assert rows[5]["time_to_target"] == 10.0
    text = race.tables(rows)
    assert "| ddp:safebits@4.4 | **10** (10) | 2.1000 ± 0.0000 |" in text
    assert "| ddp:safebits@2 | never (never) |" in text


def test_ddp_none_is_the_reference_where_both_front_ends_ran() -> None:
    rows = race.summarize([case("none", (5.0, 4.0, 3.0, 2.0, 1.0)), case("ddp:none", (5.0, 4.5, 4.0, 3.5, 3.0))])
    assert [row["target"] for row in rows] == [3.5, 3.5]


def test_auto_s_budgets_are_listed_in_runs() -> None:
    assert race.budget_runs([32.0, 32.0, 4.4, 4.4, 4.4, 2.0]) == "32 x2, 4.4 x3, 2 x1"
    rows = race.summarize([case("ddp:none", (5.0, 4.0, 3.0, 2.5, 2.0)),
                           case("ddp:safebits@auto", (5.0, 4.0, 3.0, 2.5, 2.0), budgets=[32.0, 2.0, 2.0])])
    assert "`ddp:safebits@auto` at 1gbit: seed 0: 32 x1, 2 x2" in race.tables(rows)


def test_every_compressor_trains_in_a_launch_of_its_own() -> None:
    args = race.parse_args(["--ddp-compressors", "ddp:none", "ddp:safebits@auto", "--compressors", "none", "fp16"])
    assert race.launches(args) == [("ddp", "ddp:none"), ("ddp", "ddp:safebits@auto"), ("horovod", "none"),
                                   ("horovod", "fp16")]


def test_the_arguments_are_checked() -> None:
    assert race.parse_args([]).rates == race.RATES
    for wrong in (["--rates", "fast"], ["--ddp-compressors", "none"], ["--compressors", "ddp:none"],
                  ["--tasks", "resnet18"]):
        with pytest.raises((SystemExit, ValueError)):
            race.parse_args(wrong)


def test_the_text_task_is_the_issue_s_gpt_on_cpython_bytes() -> None:
    task = TextGPT(steps=100)
    model = task.model()
    assert model_facts(model) == {"parameters": 1_853_568, "tensors": 52}
    gen = torch.Generator().manual_seed(0)
    loss = task.batch_loss(model, gen)
    assert loss.shape == () and 5.0 < float(loss.detach()) < 6.0    # about ln 256 at initialization
    assert task.evaluate(model)[0] == pytest.approx(task.evaluate(model)[0])
    assert task.lr_at(0) == pytest.approx(task.lr / task.warmup) and task.lr_at(task.warmup - 1) == task.lr
    assert task.lr_at(99) < 0.01 * task.lr


def test_the_demo_s_tasks_race_as_make_demo_trains_them() -> None:
    from bench.race_worker import make_race_task
    from bench.tasks import make_task

    assert race.parse_args(["--tasks", "bytes_lm"]).lm_steps == 160 == race.STEPS["bytes_lm"]
    lm, demo = make_race_task("bytes_lm", 160), make_task("bytes_lm", 160)
    assert (lm.metric_name, lm.lr, lm.batch, lm.schedule) == (demo.metric_name, demo.lr, demo.batch, demo.schedule)
    assert make_race_task("digits_cnn", 250).metric_name == "val_accuracy"
    with pytest.raises(ValueError, match="unknown race task"):
        make_race_task("resnet18", 10)


def test_the_plot_has_a_panel_per_task_and_link(tmp_path: Any) -> None:
    rows = race.summarize([case("ddp:none", (5.0, 4.0, 3.0, 2.5, 2.0), rate=rate, task=task)
                           for task in ("gpt2_text", "bytes_lm") for rate in ("1gbit", "unlimited")])
    race.plot(rows, str(tmp_path / "race.png"))
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(str(tmp_path / "race.png")).shape
    assert (width, height) == (int(2 * 5.5 * 110), int(2 * 4.2 * 110))     # 2 x 2 panels at 110 dpi


def test_an_earlier_race_json_is_written_again_with_the_bytes_the_link_carried(tmp_path: Any) -> None:
    import json

    cases = [case("ddp:none", (5.0, 4.0, 3.0, 2.5, 2.0), loopback_bytes=8e6),
             case("ddp:safebits@auto", (5.0, 3.5, 2.5, 2.2, 2.1), loopback_bytes=1e6, budgets=[32.0, 4.4]),
             case("none", (5.0, 4.0, 3.0, 2.5, 2.0), loopback_bytes=None)]
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"command": "python -m bench.race", "seconds": 12.0, "cases": cases,
                                   "failed": []}))
    assert race.main(["--from-json", str(earlier), "--out-dir", str(tmp_path / "again")]) == 0
    assert not (tmp_path / "again" / "race.json").exists()        # the earlier one is not written again
    assert race.parse_args(["--from-json", str(earlier)]).out_dir == str(tmp_path)
    text = (tmp_path / "again" / "race.md").read_text()
    assert "| ddp:none | **15** (15) | 2.0000 ± 0.0000 | 20 | 8 |" in text
    assert "| ddp:safebits@auto | **10** (10) | 2.1000 ± 0.0000 | 20 | 1 |" in text
    assert "| none | **15** (15) | 2.0000 ± 0.0000 | 20 | - |" in text
    assert (tmp_path / "again" / "race.png").exists()


def test_rows_run_again_replace_the_earlier_race_s_rows(tmp_path: Any) -> None:
    import json

    first = [case("ddp:none", (5.0, 4.0, 3.0, 2.5, 2.0)), case("none", (5.0, 4.0, 3.0, 2.5, 2.0)),
             case("fp16", (5.0, 4.5, 4.0, 3.0, 2.5))]
    again = [case("fp16", (5.0, 4.0, 3.0, 2.5, 2.0))]
    again[0]["curve"] = curve(5.0, 4.0, 3.0, 2.5, 2.0, seconds_per_step=1.0)       # slower, reaches it sooner
    paths = []
    for name, cases, seconds in (("first", first, 100.0), ("again", again, 30.0)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"command": f"python -m bench.race {name}", "seconds": seconds,
                                         "cases": cases, "failed": []}))
    assert race.main(["--from-json", *map(str, paths), "--out-dir", str(tmp_path / "both")]) == 0
    both = json.loads((tmp_path / "both" / "race.json").read_text())
    assert [c["compressor"] for c in both["cases"]] == ["ddp:none", "none", "fp16"]
    assert both["cases"][2] == again[0] and both["seconds"] == 130.0
    assert both["command"] == "python -m bench.race first`; cases replaced by `python -m bench.race again"
    text = (tmp_path / "both" / "race.md").read_text()
    assert "| fp16 | **30** (30) |" in text                   # the second race's row, against ddp:none's target


def test_a_failed_launch_run_again_is_no_longer_listed_as_failed() -> None:
    earlier = {"cases": [case("none", (5.0, 4.0, 3.0, 2.5, 2.0))],
               "failed": [race.failed_prefix("gpt2_text", 0, "1gbit", "fp16") + "exit status 1",
                          race.failed_prefix("gpt2_text", 0, "1gbit", "qsgd4") + "exit status 1"]}
    again = {"cases": [case("fp16", (5.0, 4.0, 3.0, 2.5, 2.0))], "failed": []}
    assert race.merged([earlier, again])["failed"] == [earlier["failed"][1]]


def test_a_launch_that_wrote_its_results_before_failing_keeps_them(tmp_path: Any) -> None:
    import json

    raw = tmp_path / "raw.json"
    assert race.finished_cases(str(raw), "fp16") is None                  # nothing written: failed
    raw.write_text("{\"cases\": [")
    assert race.finished_cases(str(raw), "fp16") is None                  # cut short
    raw.write_text(json.dumps({"cases": [case("none", (5.0, 4.0))]}))
    assert race.finished_cases(str(raw), "fp16") is None                  # another launch's
    raw.write_text(json.dumps({"cases": [case("fp16", (5.0, 4.0))]}))
    assert [c["compressor"] for c in race.finished_cases(str(raw), "fp16") or []] == ["fp16"]


def test_a_failed_launch_stays_listed_when_only_an_earlier_race_ran_its_case() -> None:
    earlier = {"cases": [case("fp16", (5.0, 4.0, 3.0, 2.5, 2.0))], "failed": []}
    later = {"cases": [], "failed": [race.failed_prefix("gpt2_text", 0, "1gbit", "fp16") + "exit status 1"]}
    assert race.merged([earlier, later])["failed"] == later["failed"]
