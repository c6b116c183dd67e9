"""``budget_bits="auto"`` replayed on measured telemetry (docs/RESULTS.md 4.3): the decision rule of
:class:`safebits_hvd.auto.Auto` driven, step by step, by the telemetry the fixed rows of interleaved link
benchmarks recorded (``bench.link --interleave``, ``results/issue30/*interleaved*.json``).

An interleaved launch runs every row's step *i* side by side, so at step *i* it holds what each fixed budget
measured at that moment of the machine's drifting speed: the replay hands the rule, at each step, the telemetry of
the row of the budget it chose (``safebits@B``; the pass-through from ``safebits@32`` where the launch has it, else
``none``'s step time with the auto row's median pass-through figures scaled to it), and charges that row's step
time. A rule change can so be judged on every recorded cell in seconds, with the machine's real noise, before a
launch of an hour confirms it. What it does not replay:

- budgets no row ran (3, 6 and 16 bits) are interpolated between their neighbours in log bits;
- the run's first :data:`COLD_STEPS` compressed steps cost :data:`COLD_FACTOR` times the row's (the compressed
  path starts cold: ``bench.experiments.cold_compressed_steps``), a switch out of compression
  :data:`FLUSH_FACTOR` (the residual flush);
- the rule's choices do not change the machine's later speed.

Per cell it prints the ratio the benchmark reports (the best fixed row's median step time over auto's, every row
including ``none`` and ``fp16``) and the same over totals, then the worst cell and how many reach 0.95x.

Usage (from the repository root): ``.venv/bin/python -m bench.experiments.auto_replay [LINK_JSON ...]
[--chosen]`` (default: every ``results/issue30/*interleaved*.json``).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
from dataclasses import dataclass
from typing import Any

from safebits_hvd.auto import PASS_THROUGH_BITS, Auto

COLD_STEPS = 2
COLD_FACTOR = 1.5
FLUSH_FACTOR = 1.1
TARGET = 0.95


@dataclass
class Trace:
    """One budget's measured steps in one cell: step times and telemetry, step by step."""

    step_s: list[float]
    timing: list[dict[str, float]]


def pass_through_trace(rows: dict[str, Any], prefix: str, auto: dict[str, Any]) -> Trace:
    """``safebits@32`` where the launch ran it, else ``none``'s step times with the auto row's pass-through
    figures (their medians, each as a share of its step time) scaled to each."""
    if f"{prefix}safebits@32" in rows:
        row = rows[f"{prefix}safebits@32"]
        return Trace(row["step_times_s"], row["timing"])
    none = rows[f"{prefix}none"]["step_times_s"]
    params = auto["parameters"]
    passed = [i for i, b in enumerate(auto["budget_bits_per_rank"]) if b / params >= PASS_THROUGH_BITS]
    if not passed:
        raise ValueError(f"{prefix}auto never passed through and the launch has no {prefix}safebits@32 row")
    share = {k: statistics.median(auto["timing"][i][k] / auto["step_times_s"][i] for i in passed)
             for k in auto["timing"][0] if k != "wire_bytes"}
    wire = auto["timing"][passed[0]]["wire_bytes"]
    return Trace(none, [{**{k: v * s for k, v in share.items()}, "wire_bytes": wire} for s in none])


def interpolate(low: tuple[float, Trace], high: tuple[float, Trace], bits: float) -> Trace:
    """A budget between two recorded ones, field by field in log bits (its wire bytes in proportion to bits)."""
    (b0, t0), (b1, t1) = low, high
    w = math.log(bits / b0) / math.log(b1 / b0)
    step_s = [a + w * (b - a) for a, b in zip(t0.step_s, t1.step_s, strict=True)]
    timing = [{k: (x[k] * bits / b0 if k == "wire_bytes" else x[k] + w * (y[k] - x[k])) for k in x}
              for x, y in zip(t0.timing, t1.timing, strict=True)]
    return Trace(step_s, timing)


def replay(traces: dict[float, Trace], warmup: int) -> tuple[list[float], list[float]]:
    """Drive a fresh :class:`Auto` through the recorded steps; its budgets and charged step times."""
    auto = Auto()
    steps = len(next(iter(traces.values())).step_s)
    unknown = {k: math.nan for k in next(iter(traces.values())).timing[0]}
    chosen: list[float] = []
    charged: list[float] = []
    compressed = 0
    previous = PASS_THROUGH_BITS
    for step in range(warmup + steps):
        bits = auto(step)
        i = step - warmup
        factor = 1.0
        if bits < PASS_THROUGH_BITS:
            compressed += 1
            factor = COLD_FACTOR if compressed <= COLD_STEPS else 1.0
        elif previous < PASS_THROUGH_BITS:
            factor = FLUSH_FACTOR
        previous = bits
        trace = traces.get(bits)
        if trace is None:
            below = max((b for b in traces if b < bits), default=min(traces))
            above = min((b for b in traces if b > bits), default=max(traces))
            trace = traces[bits] = interpolate((below, traces[below]), (above, traces[above]), bits)
        if i < 0:
            auto.observe_timing(step, unknown)
            continue
        figures = {k: v if k == "wire_bytes" else v * factor for k, v in trace.timing[i].items()}
        auto.observe_timing(step, figures)
        chosen.append(bits)
        charged.append(trace.step_s[i] * factor)
    return chosen, charged


def cells(path: str) -> list[tuple[str, dict[str, Any], int]]:
    """Every auto row of a link JSON: (label, that launch's rows of its cell and round, warmup)."""
    with open(path) as f:
        data = json.load(f)
    found = []
    for rate, raw in data["raw"].items():
        groups: dict[tuple[str, str, int], dict[str, Any]] = {}
        for row in raw:
            prefix = "ddp:" if row["compressor"].startswith("ddp:") else ""
            groups.setdefault((row["model"], prefix, row.get("round", 0)), {})[row["compressor"]] = row
        for (model, prefix, round_), rows in groups.items():
            if f"{prefix}safebits@auto" in rows:
                batch = rows[f"{prefix}safebits@auto"]["batch_per_rank"]
                label = f"{path.split('/')[-1]} {rate} {model} b{batch} {prefix or 'hvd:'}r{round_}"
                found.append((label, rows, data["warmup"]))
    return found


def judge(rows: dict[str, Any], prefix: str, warmup: int) -> tuple[float, float, list[float]]:
    """The replayed auto's (median ratio, total ratio) to the best fixed row, and its budgets."""
    traces = {PASS_THROUGH_BITS: pass_through_trace(rows, prefix, rows[f"{prefix}safebits@auto"])}
    for name, row in rows.items():
        budget = name.removeprefix(prefix).removeprefix("safebits@")
        if name.startswith(prefix + "safebits@") and budget not in ("auto", "32"):
            traces[float(budget)] = Trace(row["step_times_s"], row["timing"])
    chosen, charged = replay(traces, warmup)
    fixed = [r["step_times_s"] for n, r in rows.items() if not n.endswith("@auto")]
    best_median = min(statistics.median(s) for s in fixed)
    best_total = min(sum(s) for s in fixed)
    return best_median / statistics.median(charged), best_total / sum(charged), chosen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="link JSONs of interleaved launches")
    parser.add_argument("--chosen", action="store_true", help="print each cell's budgets")
    args = parser.parse_args(argv)
    paths = args.paths or [p for p in sorted(glob.glob("results/issue30/*interleaved*.json")) if "phases" not in p]
    ratios = []
    print("| cell | x best (medians) | x best (totals) |")
    print("| --- | --- | --- |")
    for path in paths:
        for label, rows, warmup in cells(path):
            prefix = "ddp:" if " ddp:" in label else ""
            by_median, by_total, chosen = judge(rows, prefix, warmup)
            ratios.append(by_median)
            print(f"| {label} | {by_median:.2f}x | {by_total:.2f}x |")
            if args.chosen:
                print("|", " ".join(f"{b:g}" for b in chosen), "| | |")
    print(f"\n{len(ratios)} cells: worst {min(ratios):.2f}x, {sum(r >= TARGET for r in ratios)} at {TARGET}x or more, "
          f"geometric mean {math.exp(statistics.mean(math.log(r) for r in ratios)):.3f}x")


if __name__ == "__main__":
    main()
