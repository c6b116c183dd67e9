"""Compare a pytest-benchmark JSON with the stored baseline by RATIOS in ``extra_info``, never absolute times.

    python -m bench.suites.check_regression results/bench.json bench/suites/baseline.json [--time-tolerance 2.0]

* Time ratios (``extra_info`` keys ending in ``_vs_clone`` or ``_vs_reference``; lower is better) regress when
  ``current > time_tolerance x max(baseline, TIME_RATIO_FLOOR)`` (default 2x: wide, for a noisy shared 2-core
  machine; the floor, 0.5, because a ratio under half the reference, such as the fp32 pass-through against a
  47 MB clone, is mostly timer and page-fault noise: it ranged 0.04 to 0.2 between runs).
* ``compression_ratio`` (higher is better) regresses when ``current < baseline / ratio_tolerance`` (default
  1.25: modeled bits are nearly deterministic).
* Benchmarks of the baseline missing from the results, and new ones, are reported, not failed (the smoke run
  leaves out ``full`` cases; other suites come and go).

Refresh the baseline from real runs (keeps only what the check reads, plus the machine and commit). With several
runs (``--merge``), each time ratio is the largest and each compression ratio the smallest seen, so the baseline
is a slow-but-normal run rather than a lucky one:

    python -m bench.suites.check_regression results/bench.json bench/suites/baseline.json --update \
        --merge other-run.json

Exit status: 0 when nothing regressed, 1 on a regression, 2 when the results hold no benchmark at all.
"""

from __future__ import annotations

import argparse
import json
import sys

TIME_SUFFIXES = ("_vs_clone", "_vs_reference")
HIGHER_IS_BETTER = ("compression_ratio",)
TIME_RATIO_FLOOR = 0.5


def ratios(path: str) -> dict[str, dict[str, float]]:
    """Benchmark fullname -> {ratio key: value} for the ratio keys of its ``extra_info``."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    out: dict[str, dict[str, float]] = {}
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        out[bench["fullname"]] = {k: float(v) for k, v in info.items()
                                  if isinstance(v, int | float) and not isinstance(v, bool)
                                  and (k.endswith(TIME_SUFFIXES) or k in HIGHER_IS_BETTER)}
    return out


def compare(current: dict[str, dict[str, float]], baseline: dict[str, dict[str, float]],
            time_tolerance: float, ratio_tolerance: float) -> tuple[list[str], list[str], list[str], int]:
    """(regressions, missing, new, ratios compared), as human-readable lines."""
    regressions, compared = [], 0
    for name, base in sorted(baseline.items()):
        cur = current.get(name)
        if cur is None:
            continue
        for key, base_value in base.items():
            if key not in cur or base_value <= 0:
                continue
            compared += 1
            value = cur[key]
            if key.endswith(TIME_SUFFIXES) and value > time_tolerance * max(base_value, TIME_RATIO_FLOOR):
                regressions.append(f"{name}: {key} = {value:.3g}, baseline {base_value:.3g} "
                                   f"({value / base_value:.2f}x > {time_tolerance:g}x)")
            elif key in HIGHER_IS_BETTER and value < base_value / ratio_tolerance:
                regressions.append(f"{name}: {key} = {value:.3g}, baseline {base_value:.3g} "
                                   f"(fell below 1/{ratio_tolerance:g} of it)")
    missing = sorted(set(baseline) - set(current))
    new = sorted(set(current) - set(baseline))
    return regressions, missing, new, compared


def write_baseline(results: str, baseline: str, merge: list[str] | None = None) -> int:
    """Write ``baseline`` from ``results``: per benchmark its fullname and ``extra_info``; with ``merge``, the
    worst value of each checked ratio over all the runs."""
    with open(results, encoding="utf-8") as f:
        data = json.load(f)
    others = [ratios(path) for path in merge or []]
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        for key, value in list(info.items()):
            seen = [run[bench["fullname"]][key] for run in others if key in run.get(bench["fullname"], {})]
            if seen and key.endswith(TIME_SUFFIXES):
                info[key] = max([value, *seen])
            elif seen and key in HIGHER_IS_BETTER:
                info[key] = min([value, *seen])
    trimmed = {
        "note": "made by bench.suites.check_regression --update from a real `make bench-smoke` run",
        "datetime": data.get("datetime"),
        "machine_info": {k: data.get("machine_info", {}).get(k) for k in ("node", "processor", "cpu",
                                                                          "python_version")},
        "commit_info": {k: data.get("commit_info", {}).get(k) for k in ("id", "dirty", "branch")},
        "benchmarks": [{"fullname": b["fullname"], "extra_info": b.get("extra_info", {})}
                       for b in data.get("benchmarks", [])],
    }
    with open(baseline, "w", encoding="utf-8") as f:
        json.dump(trimmed, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"check_regression: wrote {len(trimmed['benchmarks'])} benchmarks to {baseline}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results")
    parser.add_argument("baseline")
    parser.add_argument("--time-tolerance", type=float, default=2.0)
    parser.add_argument("--ratio-tolerance", type=float, default=1.25)
    parser.add_argument("--update", action="store_true", help="write the baseline from the results and exit")
    parser.add_argument("--merge", action="append", default=[], metavar="RESULTS",
                        help="with --update: more runs; the baseline keeps each ratio's worst value")
    args = parser.parse_args(argv)
    if args.update:
        return write_baseline(args.results, args.baseline, args.merge)
    current, baseline = ratios(args.results), ratios(args.baseline)
    if not current:
        print(f"check_regression: {args.results} holds no benchmarks (was --benchmark-enable given?)")
        return 2
    regressions, missing, new, compared = compare(current, baseline, args.time_tolerance, args.ratio_tolerance)
    for line in missing:
        print(f"missing (in baseline, not in results): {line}")
    for line in new:
        print(f"new (not in baseline): {line}")
    for line in regressions:
        print(f"REGRESSION {line}")
    print(f"check_regression: {compared} ratios compared over {len(set(current) & set(baseline))} benchmarks, "
          f"{len(regressions)} regressions, {len(missing)} missing, {len(new)} new")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
