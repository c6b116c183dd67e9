"""``budget_bits="auto"`` on a link that changes, simulated (docs/RESULTS.md 4.1): the decision rule of
:class:`safebits_hvd.schedules.Auto` driven by the modeled telemetry of ``tests/test_auto.py`` (``simulated_timing``,
``drive``) through unlimited (10 GB/s, 100 steps), 100 Mbit/s (100 steps) and 1 Gbit/s (100 steps).

Usage (from the repository root): ``.venv/bin/python -m bench.experiments.auto_simulation``; prints the table
and the budget chosen at every step.
"""

from __future__ import annotations

from safebits_hvd.schedules import AUTO_CANDIDATES, Auto
from tests.test_auto import drive, simulated_timing

RATES = {0: 10e9, 100: 12.5e6, 200: 125e6}
PHASES = [(0, 100, "unlimited (10 GB/s)"), (100, 200, "100 Mbit/s"), (200, 300, "1 Gbit/s")]


def rate(step: int) -> float:
    return RATES[max(s for s in RATES if s <= step)]


def span(bits: float, step: int) -> float:
    return simulated_timing(bits, rate(step))["span_s"]


def main() -> None:
    chosen = drive(Auto(), rate, 300)
    candidates = [b for b in AUTO_CANDIDATES if b >= 2.0]
    print("| phase | fastest budget | auto's total | best fixed | ratio | steps to settle |")
    print("| --- | --- | --- | --- | --- | --- |")
    for start, stop, name in PHASES:
        total = sum(span(chosen[i], i) for i in range(start, stop))
        best = min(span(b, start) for b in candidates)
        fastest = max(b for b in candidates if span(b, start) <= 1.03 * best)

        # within 3% of the fastest, or a periodic probe
        near_best = [span(chosen[j], j) <= 1.03 * best or j % 50 in (0, 1) for j in range(start, stop)]
        settle = next(i for i in range(stop - start) if all(near_best[i:]))
        print(f"| {name} | {fastest:g} | {total:.2f} s | {(stop - start) * best:.2f} s | "
              f"{total / ((stop - start) * best):.2f}x | {settle} |")
    total = sum(span(b, i) for i, b in enumerate(chosen))
    oracle = sum(min(span(b, i) for b in candidates) for i in range(300))
    print(f"| all 300 steps | | {total:.2f} s | {oracle:.2f} s | {total / oracle:.2f}x | |")
    print("\nchosen:", " ".join(f"{b:g}" for b in chosen))


if __name__ == "__main__":
    main()
