"""``auto`` against its twin: in each cell of recorded link launches (``bench.link``'s ``link.json``), ``auto``'s
median step against that of the fixed row of the budget it ran on most of its timed steps (``none`` for no
compression, ``safebits@B`` for B bits; each front end's own rows), where that budget ran on :data:`MIN_SHARE` of
them or more (docs/RESULTS.md 4.3).

Such a cell's ratio to the best fixed row is this ratio, plus the luck of picking the best of several rows: so the
spread of these ratios over launches is how far a cell moves from launch to launch whatever ``auto`` chooses, and
their median is what ``auto`` costs beside the same budget fixed (its first steps and probes in the window).

Usage (from the repository root): ``.venv/bin/python -m bench.experiments.auto_twins [LINK_JSON ...]`` (default:
every ``results/issue30/*.json`` that holds link rows).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import statistics
from typing import Any

from bench.link import fixed_budget, front_end_prefix

MIN_SHARE = 0.85
"""The share of ``auto``'s timed steps its most frequent budget must have for the cell to count."""


def twins(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per ``@auto`` row of one launch whose most frequent budget ran :data:`MIN_SHARE` of its steps and has a fixed
    row of that budget: rate, model, front end (``hvd``/``ddp``), budget, share and ``ratio`` (the twin's median
    step over auto's: below 1, auto was slower)."""
    found = []
    for auto in rows:
        if not auto.get("compressor", "").endswith("@auto"):
            continue
        bits = [round(b, 3) for b in auto.get("budget_bits_per_step") or [] if b is not None]
        if not bits:
            continue
        budget, count = collections.Counter(bits).most_common(1)[0]
        prefix = front_end_prefix(auto["compressor"])
        twin = next((r for r in rows if r["rate"] == auto["rate"] and r["model"] == auto["model"]
                     and front_end_prefix(r["compressor"]) == prefix and fixed_budget(r["compressor"]) == budget),
                    None)
        if twin is None or count / len(bits) < MIN_SHARE or not auto["step_time_s"] > 0:
            continue
        found.append({"rate": auto["rate"], "model": auto["model"], "front_end": "ddp" if prefix else "hvd",
                      "budget": budget, "share": count / len(bits), "ratio": twin["step_time_s"] / auto["step_time_s"]})
    return found


def summary(found: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (front end, ``pass-through`` or ``compressing``): n, median, sd, min, max and how many below 0.95."""
    groups: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for f in found:
        groups[f["front_end"], "pass-through" if f["budget"] >= 32 else "compressing"].append(f["ratio"])
    return {key: {"n": len(v), "median": statistics.median(v), "sd": statistics.pstdev(v), "min": min(v),
                  "max": max(v), "below_0.95": sum(r < 0.95 for r in v)} for key, v in sorted(groups.items())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="link.json files (default: results/issue30/*.json)")
    args = parser.parse_args(argv)
    found = []
    for path in args.paths or sorted(glob.glob("results/issue30/*.json")):
        with open(path, encoding="utf-8") as f:
            rows = json.load(f).get("rows")
        if isinstance(rows, list) and all(isinstance(r, dict) and "step_time_s" in r for r in rows):
            found += twins(rows)
    if not found:
        raise SystemExit("no cell where auto ran one budget on most steps beside a fixed row of it")
    for (front, kind), s in summary(found).items():
        print(f"{front} {kind:12s} n={s['n']:3d}  median {s['median']:.3f}  sd {s['sd']:.3f}  "
              f"min {s['min']:.3f}  max {s['max']:.3f}  below 0.95: {s['below_0.95']}")


if __name__ == "__main__":
    main()
