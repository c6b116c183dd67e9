"""``budget_bits="auto"`` on a link that changes, simulated (docs/RESULTS.md 4.1): the decision rule of
:class:`safebits_hvd.policy.auto.Auto` driven by the modeled telemetry of ``tests/test_auto.py`` (``drive``, which
hands the schedule each step's telemetry before the next step's budget is chosen, as SafeBits does) in two scenarios:

- ``modeled``: ``simulated_timing`` (10M parameters, backward 100 ms) through unlimited (10 GB/s, 100 steps),
  100 Mbit/s (100 steps) and 1 Gbit/s (100 steps);
- ``resnet18``: ``resnet18_timing``, fitted to earlier link step times (RESULTS' history; ResNet-18, batch 4,
  2 ranks), through unlimited (30 steps), 100 Mbit/s (25) and 1 Gbit/s (30), as that run's phases;
- ``tight``: ``tight_timing``, ResNet-18 where compressing costs only 10-20% of a step on the unlimited link
  (results/link/link_b4.md), through unlimited (30), 1 Gbit/s (30) and 100 Mbit/s (25);
- ``demo_lm``: ``latency_bound_timing``, ``make demo``'s byte LM on localhost, where every transfer is a latency and
  passing through beats compressing by 15%, 160 steps whose first ones run slow (``LM_WARMUP``);
- ``slow_start``: ``resnet18_timing`` starting on the slow link: 100 Mbit/s (25 steps), then unlimited (30).

Per phase: auto's total against the best fixed budget's (the per-phase oracle), and the steps until auto settles
(its first of 3 steps in a row within 10% of the best fixed step time). The floor is
what the lag alone costs: a rule that knows every budget's step time but sees the link one step late. With
``--noise``, each step's telemetry is multiplied by ``exp(noise * z)`` and the totals (of the noise-free step times)
are the mean over ``--seeds`` runs, settling the median.

Usage (from the repository root): ``.venv/bin/python -m bench.experiments.auto_simulation [--noise 0.08]
[--seeds 20] [--chosen]``; prints one table per scenario (``--chosen``: and the budget of every step).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from safebits_hvd.policy.auto import AUTO_CANDIDATES, Auto
from tests.test_auto import (
    LM_WARMUP,
    RESNET18_RATES,
    Timing,
    drive,
    latency_bound_timing,
    resnet18_timing,
    simulated_timing,
    tight_timing,
)

SETTLED_WITHIN = 0.10          # within 10% of the phase's best fixed step time...
SETTLED_STEPS = 3              # ... for 3 steps in a row


@dataclass(frozen=True)
class Scenario:
    name: str
    timing: Timing
    phases: list[tuple[str, float, int]]       # (name, link bytes per second, steps)
    warmup: tuple[float, ...] = ()             # the first steps' slowdown (drive's ``warmup``)

    @property
    def steps(self) -> int:
        return sum(n for _, _, n in self.phases)

    def rate(self, step: int) -> float:
        start = 0
        for _, rate, n in self.phases:
            if step < start + n:
                return rate
            start += n
        return self.phases[-1][1]

    def span(self, bits: float, step: int) -> float:
        return self.timing(bits, self.rate(step))["span_s"]

    def best(self, step: int) -> float:
        """The fastest candidate's step time at this step's link."""
        return min(self.span(b, step) for b in AUTO_CANDIDATES)


SCENARIOS = [
    Scenario("modeled", simulated_timing, [("unlimited (10 GB/s)", 10e9, 100), ("100 Mbit/s", 12.5e6, 100),
                                           ("1 Gbit/s", 125e6, 100)]),
    Scenario("resnet18", resnet18_timing, [("unlimited", RESNET18_RATES["unlimited"], 30),
                                           ("100 Mbit/s", RESNET18_RATES["100 Mbit/s"], 25),
                                           ("1 Gbit/s", RESNET18_RATES["1 Gbit/s"], 30)]),
    Scenario("tight", tight_timing, [("unlimited", RESNET18_RATES["unlimited"], 30),
                                     ("1 Gbit/s", RESNET18_RATES["1 Gbit/s"], 30),
                                     ("100 Mbit/s", RESNET18_RATES["100 Mbit/s"], 25)]),
    Scenario("demo_lm", latency_bound_timing, [("localhost", 2e9, 160)], LM_WARMUP),
    Scenario("slow_start", resnet18_timing, [("100 Mbit/s", RESNET18_RATES["100 Mbit/s"], 25),
                                             ("unlimited", RESNET18_RATES["unlimited"], 30)]),
]


def lag_floor(scenario: Scenario) -> list[float]:
    """The budgets of a rule that knows every budget's step time but sees the link of step t only at t + 1."""
    def pick(step: int) -> float:
        spans = {b: scenario.span(b, max(0, step)) for b in AUTO_CANDIDATES}
        return min(spans, key=lambda b: (spans[b], -b))
    return [pick(step - 1) for step in range(scenario.steps)]


def phase_figures(scenario: Scenario, chosen: list[float]) -> list[tuple[float, float, int | None]]:
    """Per phase: (total, oracle, steps to settle or None)."""
    rows, start = [], 0
    for _, _, n in scenario.phases:
        spans = [scenario.span(chosen[i], i) for i in range(start, start + n)]
        best = scenario.best(start)
        near = [s <= (1 + SETTLED_WITHIN) * best for s in spans]
        settle = next((i for i in range(n - SETTLED_STEPS + 1) if all(near[i:i + SETTLED_STEPS])), None)
        rows.append((sum(spans), n * best, settle))
        start += n
    return rows


def report(scenario: Scenario, runs: list[list[float]], show_chosen: bool) -> None:
    per_run = [phase_figures(scenario, chosen) for chosen in runs]
    floor = phase_figures(scenario, lag_floor(scenario))
    print(f"\n### {scenario.name}\n")
    print("| phase | steps | fastest budget | auto's total | oracle | ratio | lag floor | steps to settle |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    start = 0
    for p, (name, _, n) in enumerate(scenario.phases):
        total = statistics.mean(run[p][0] for run in per_run)
        oracle, floor_total = floor[p][1], floor[p][0]
        settles = [run[p][2] for run in per_run]
        settle = "never" if None in settles else f"{statistics.median(settles):g}"   # type: ignore[type-var]
        fastest = min(AUTO_CANDIDATES, key=lambda b: (scenario.span(b, start), -b))
        print(f"| {name} | {n} | {fastest:g} | {total:.2f} s | {oracle:.2f} s | {total / oracle:.2f}x | "
              f"{floor_total / oracle:.2f}x | {settle} |")
        start += n
    total = statistics.mean(sum(r[0] for r in run) for run in per_run)
    oracle, floor_total = sum(r[1] for r in floor), sum(r[0] for r in floor)
    print(f"| all | {scenario.steps} | | {total:.2f} s | {oracle:.2f} s | {total / oracle:.2f}x | "
          f"{floor_total / oracle:.2f}x | |")
    if show_chosen:
        print("\nchosen:", " ".join(f"{b:g}" for b in runs[0]))


def main(argv: list[str] | None = None, make_auto: Callable[[], Auto] = Auto) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--noise", type=float, default=0.0, help="log-normal spread of each step's telemetry")
    parser.add_argument("--seeds", type=int, default=20, help="runs to average when --noise > 0")
    parser.add_argument("--chosen", action="store_true", help="print the budget of every step (first run)")
    args = parser.parse_args(argv)
    seeds = range(args.seeds) if args.noise > 0 else range(1)
    for scenario in SCENARIOS:
        runs = [drive(make_auto(), scenario.rate, scenario.steps, scenario.timing, args.noise, seed, scenario.warmup)
                for seed in seeds]
        report(scenario, runs, args.chosen)


if __name__ == "__main__":
    main()
