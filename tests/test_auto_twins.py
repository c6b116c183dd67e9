"""``bench.experiments.auto_twins``: auto against the fixed row of the budget it ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.experiments import auto_twins


def row(compressor: str, step: float, bits: list[float] | None = None, rate: str = "1gbit") -> dict:
    return {"rate": rate, "model": "cnn", "compressor": compressor, "step_time_s": step,
            "budget_bits_per_step": bits or []}


def test_auto_is_compared_with_the_fixed_row_of_its_own_budget_and_front_end() -> None:
    rows = [row("none", 2.0), row("safebits@2", 0.9), row("safebits@4.4", 0.8),
            row("safebits@auto", 1.0, [32.0] + [2.0] * 9),                      # 2 bits on 9 of 10: vs safebits@2
            row("ddp:none", 0.5), row("ddp:safebits@2", 0.3),
            row("ddp:safebits@auto", 0.6, [32.0] * 9 + [2.0]),                  # vs ddp:none, not none
            row("safebits@auto", 1.0, [32.0, 2.0, 2.0, 4.4], rate="unlimited"),  # no budget on 85%: left out
            row("none", 1.0, rate="unlimited")]
    found = auto_twins.twins(rows)
    assert [(f["front_end"], f["budget"]) for f in found] == [("hvd", 2.0), ("ddp", 32.0)]
    assert found[0]["ratio"] == pytest.approx(0.9) and found[0]["share"] == pytest.approx(0.9)
    assert found[1]["ratio"] == pytest.approx(0.5 / 0.6)
    summary = auto_twins.summary(found)
    assert summary["hvd", "compressing"]["below_0.95"] == 1 and summary["ddp", "pass-through"]["n"] == 1


def test_main_reads_link_json_files_and_says_when_there_is_nothing(tmp_path: Path, capsys) -> None:
    good = tmp_path / "link.json"
    good.write_text(json.dumps({"rows": [row("safebits@2", 1.0), row("safebits@auto", 1.0, [2.0] * 4)]}))
    auto_twins.main([str(good)])
    assert "hvd compressing  n=  1  median 1.000" in capsys.readouterr().out
    empty = tmp_path / "phases.json"
    empty.write_text(json.dumps({"phases": []}))
    with pytest.raises(SystemExit, match="no cell"):
        auto_twins.main([str(empty)])
