"""``bench.experiments.auto_replay``: the auto rule replayed on recorded telemetry of an interleaved launch."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.experiments.auto_replay import Trace, cells, interpolate, judge

PARAMETERS = 1_000_000
STEPS = 20


def row(compressor: str, step_s: float, span_s: float | None, bits: float) -> dict[str, Any]:
    """A fixed row of a link JSON's ``raw``: every step alike but for a small deterministic wobble."""
    wobble = [1 + 0.02 * math.sin(i) for i in range(STEPS)]
    timing = None if span_s is None else [
        {"backward_s": 0.6 * span_s * w, "send_s": 0.05 * w if bits < 32 else 0.0, "receive_s": 0.01 * w,
         "exposed_s": 0.3 * span_s * w, "link_s": span_s * w, "wire_bytes": PARAMETERS * bits / 8,
         "span_s": span_s * w} for w in wobble]
    return {"model": "resnet18", "compressor": compressor, "parameters": PARAMETERS, "batch_per_rank": 4,
            "step_times_s": [step_s * w for w in wobble], "timing": timing,
            "budget_bits_per_rank": [PARAMETERS * bits] * STEPS, "round": 0}


def launch(tmp_path: Path, step_s: dict[float, float]) -> str:
    """A link JSON with one cell: ``none``, ``fp16`` and SafeBits at each budget of ``step_s`` (32: pass-through),
    each step's span 0.2 s shorter than the step, and an auto row (the replay does not read its steps)."""
    raw = [row("none", step_s[32.0], None, 32.0), row("fp16", 2 * step_s[32.0], None, 16.0)]
    raw += [row(f"safebits@{b:g}", s, s - 0.2, b) for b, s in step_s.items()]
    raw.append(row("safebits@auto", 1.0, 0.8, 32.0))
    path = tmp_path / "link.json"
    path.write_text(json.dumps({"warmup": 2, "raw": {"1gbit": raw}}))
    return str(path)


@pytest.mark.parametrize("fastest", [2.0, 32.0])
def test_the_replayed_rule_settles_on_the_fastest_recorded_row(tmp_path: Path, fastest: float) -> None:
    step_s = {b: (0.5 if b == fastest else 1.0) for b in (2.0, 4.4, 8.0, 32.0)}
    [(label, rows, warmup)] = cells(launch(tmp_path, step_s))
    assert "1gbit resnet18 b4 hvd:r0" in label
    by_median, by_total, chosen = judge(rows, "", warmup)
    assert len(chosen) == STEPS
    assert chosen[-10:] == [fastest] * 10
    assert by_median == pytest.approx(1.0, abs=0.03)
    assert by_total < 1.0                       # the probe and the first pass-through steps cost something


def test_a_budget_no_row_ran_is_interpolated_in_log_bits() -> None:
    def trace(step_s: float, wire: float) -> Trace:
        return Trace([step_s], [{"span_s": step_s, "wire_bytes": wire}])

    middle = interpolate((2.0, trace(1.0, 100.0)), (8.0, trace(2.0, 400.0)), 4.0)
    assert middle.step_s == [pytest.approx(1.5)]
    assert middle.timing[0] == {"span_s": pytest.approx(1.5), "wire_bytes": pytest.approx(200.0)}
