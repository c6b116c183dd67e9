"""bench.suites.check_regression: ratios regress beyond the tolerance, tiny ratios have a floor, merged baselines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.suites import check_regression


def write(path: Path, ratios: dict[str, dict[str, float]]) -> str:
    path.write_text(json.dumps({"benchmarks": [{"fullname": name, "extra_info": info}
                                               for name, info in ratios.items()]}))
    return str(path)


@pytest.mark.parametrize("value,regressed", [(1.9, False), (2.1, True)])
def test_time_ratio_regresses_past_the_tolerance(tmp_path: Path, value: float, regressed: bool) -> None:
    base = write(tmp_path / "base.json", {"a": {"x_vs_clone": 1.0, "compression_ratio": 8.0}})
    cur = write(tmp_path / "cur.json", {"a": {"x_vs_clone": value, "compression_ratio": 8.0}})
    assert check_regression.main([cur, base]) == int(regressed)


def test_tiny_ratios_are_judged_against_the_floor(tmp_path: Path) -> None:
    base = write(tmp_path / "base.json", {"a": {"step_vs_clone": 0.04}})
    assert check_regression.main([write(tmp_path / "ok.json", {"a": {"step_vs_clone": 0.2}}), base]) == 0
    assert check_regression.main([write(tmp_path / "bad.json", {"a": {"step_vs_clone": 1.2}}), base]) == 1


def test_compression_ratio_regresses_when_it_falls(tmp_path: Path) -> None:
    base = write(tmp_path / "base.json", {"a": {"compression_ratio": 8.0}})
    assert check_regression.main([write(tmp_path / "cur.json", {"a": {"compression_ratio": 6.0}}), base]) == 1


def test_update_with_merge_keeps_each_ratios_worst_value(tmp_path: Path) -> None:
    first = write(tmp_path / "r1.json", {"a": {"t_vs_reference": 1.0, "compression_ratio": 8.0, "note": 1}})
    second = write(tmp_path / "r2.json", {"a": {"t_vs_reference": 1.5, "compression_ratio": 7.5}})
    base = tmp_path / "base.json"
    assert check_regression.main([first, str(base), "--update", "--merge", second]) == 0
    info = json.loads(base.read_text())["benchmarks"][0]["extra_info"]
    assert info == {"t_vs_reference": 1.5, "compression_ratio": 7.5, "note": 1}
