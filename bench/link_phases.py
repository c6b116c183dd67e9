"""The link benchmark's changing-link run (``python -m bench.link --phases unlimited:40 100mbit:40 1gbit:40``).

Every compressor trains ``sum(phase steps)`` timed steps in one case, and the link rate changes under it: a thread of
the driver, outside the ranks, reads the step rank 0 is about to run (``bench.protocol.step_reporter``'s file) and
sets the namespace's qdisc to the rate of that step's phase (the first phase's during the warm-up, and again at the
start of every case; with ``--interleave`` the compressors' steps alternate and the phases pass under all of them
at once). Reported per phase and compressor: the median step time, throughput and time spent; for
``auto`` (a budgeted compressor whose budget moves), the budget it chose at every step; and the oracle that knows
the phases: for each phase the fastest fixed compressor's time in that phase, summed.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

SETTLE_TOLERANCE = 0.10
"""A step has settled when it is within this fraction of the phase's best fixed median step time."""
SETTLE_RUN = 3
"""... for this many steps in a row."""


def parse_phase(text: str) -> tuple[str, int]:
    """``"100mbit:40"`` -> ``("100mbit", 40)``; ValueError on anything else."""
    rate, sep, steps = text.partition(":")
    if not sep or not steps.isdigit() or int(steps) < 1:
        raise ValueError(f"a phase is RATE:STEPS with STEPS >= 1 (e.g. 100mbit:40), got {text!r}")
    return rate, int(steps)


def phase_of(step: int, phases: Sequence[tuple[str, int]]) -> int:
    """The phase of timed step ``step`` (-1, the warm-up, is in the first)."""
    end = 0
    for index, (_, steps) in enumerate(phases):
        end += steps
        if step < end:
            return index
    return len(phases) - 1


class LinkChanger(threading.Thread):
    """Polls the step file and calls ``set_rate(rate)`` whenever the (case, phase) of the next step changes; keeps
    each change as ``(case, step, phase, seconds since start)``."""

    def __init__(self, step_file: str, phases: Sequence[tuple[str, int]], set_rate: Callable[[str], None],
                 poll_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.step_file, self.phases, self.set_rate, self.poll_s = step_file, list(phases), set_rate, poll_s
        self.changes: list[tuple[int, int, int, float]] = []
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=5)

    def run(self) -> None:
        current: tuple[int, int] | None = None
        start = time.perf_counter()
        while not self._stopping.is_set():
            try:
                with open(self.step_file, encoding="ascii") as f:
                    case, step = (int(x) for x in f.read().split())
            except (OSError, ValueError):
                time.sleep(self.poll_s)
                continue
            key = (case, phase_of(step, self.phases))
            if key != current:
                self.set_rate(self.phases[key[1]][0])
                self.changes.append((case, step, key[1], time.perf_counter() - start))
                current = key
            time.sleep(self.poll_s)


def settle_steps(times: Sequence[float], target: float) -> int | None:
    """Steps from the start of a phase until :data:`SETTLE_RUN` steps in a row are within
    :data:`SETTLE_TOLERANCE` of ``target``; None if that never happens."""
    run = 0
    for i, t in enumerate(times):
        run = run + 1 if t <= target * (1 + SETTLE_TOLERANCE) else 0
        if run == SETTLE_RUN:
            return i - SETTLE_RUN + 1
    return None


def summarize(cases: list[dict[str, Any]], phases: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """Per compressor and phase: median step time, throughput, total time; auto's choices; the oracle."""
    bounds, start = [], 0
    for _, steps in phases:
        bounds.append((start, start + steps))
        start += steps
    rows = []
    for case in cases:
        per_phase = []
        for (lo, hi), (rate, _) in zip(bounds, phases, strict=True):
            times = case["step_times_s"][lo:hi]
            median = statistics.median(times)
            per_phase.append({"rate": rate, "median_step_s": median, "total_s": sum(times),
                              "throughput_per_s": case["ranks"] * case["batch_per_rank"] * case["unit_per_sample"]
                              / median, "times": times,
                              "budget_bits": [None if b is None else b / case["parameters"]
                                              for b in case["budget_bits_per_rank"][lo:hi]],
                              "pass_through": case["pass_through"][lo:hi]})
        rows.append({"model": case["model"], "compressor": case["compressor"], "phases": per_phase,
                     "total_s": sum(p["total_s"] for p in per_phase),
                     "adaptive": case["compressor"].endswith("@auto")})
    summary: dict[str, Any] = {"rows": rows, "oracle": {}}
    for model in dict.fromkeys(r["model"] for r in rows):
        for front in ("hvd", "ddp"):
            mine = [r for r in rows if r["model"] == model and r["compressor"].startswith("ddp:") == (front == "ddp")]
            fixed = [r for r in mine if not r["adaptive"]]
            if not fixed:
                continue
            best = [min(fixed, key=lambda r, k=k: r["phases"][k]["total_s"]) for k in range(len(phases))]
            oracle = {"total_s": sum(b["phases"][k]["total_s"] for k, b in enumerate(best)),
                      "choice": [b["compressor"] for b in best]}
            for row in mine:
                if row["adaptive"]:
                    row["vs_oracle"] = row["total_s"] / oracle["total_s"]
                    row["settle_steps"] = [settle_steps(p["times"], best[k]["phases"][k]["median_step_s"])
                                           for k, p in enumerate(row["phases"])]
            summary["oracle"][f"{model}/{front}"] = oracle
    return summary


def table(summary: dict[str, Any], phases: Sequence[tuple[str, int]]) -> str:
    """The markdown of :func:`summarize`: throughput per phase, total time, and auto against the oracle."""
    heads = [f"{rate} ({steps} steps)" for rate, steps in phases]
    lines = ["| model | compressor | " + " | ".join(heads) + " | total s | vs oracle | settled after (steps) |",
             "| --- | --- | " + " | ".join("---" for _ in heads) + " | --- | --- | --- |"]
    for r in summary["rows"]:
        cells = [f"{p['throughput_per_s']:.2f}/s" for p in r["phases"]]
        settle = r.get("settle_steps")
        lines.append(f"| {r['model']} | {r['compressor']} | " + " | ".join(cells) + f" | {r['total_s']:.1f} | "
                     + (f"{r['vs_oracle']:.2f}x" if "vs_oracle" in r else "") + " | "
                     + (", ".join("never" if s is None else str(s) for s in settle) if settle else "") + " |")
    lines.append("")
    for key, oracle in summary["oracle"].items():
        lines.append(f"Oracle {key}: {oracle['total_s']:.1f} s, per phase {', '.join(oracle['choice'])}.")
    for r in summary["rows"]:
        if r["adaptive"]:
            chosen = ["pass" if t else ("-" if b is None else f"{b:g}") for p in r["phases"]
                      for b, t in zip(p["budget_bits"], p["pass_through"], strict=True)]
            lines.append(f"\n`{r['compressor']}` chose ({r['model']}, per step; pass: no compression): "
                         + " ".join(chosen))
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], phases: Sequence[tuple[str, int]], path: str) -> None:
    """Step time against step for every compressor, and auto's chosen bits, with the phase changes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in summary["rows"]:
        times = [t for p in r["phases"] for t in p["times"]]
        top.plot(range(len(times)), times, "-" if r["adaptive"] else "--", label=f"{r['model']} {r['compressor']}")
        if r["adaptive"]:
            bits = [32.0 if t else (math.nan if b is None else b) for p in r["phases"]
                    for b, t in zip(p["budget_bits"], p["pass_through"], strict=True)]
            bottom.step(range(len(bits)), bits, where="post", label=f"{r['model']} {r['compressor']}")
    edge = 0
    for rate, steps in phases:
        for ax in (top, bottom):
            ax.axvline(edge, color="grey", alpha=0.4)
        top.text(edge + 0.5, top.get_ylim()[1] * 0.95 if top.get_ylim()[1] > 0 else 1, rate, fontsize=8, va="top")
        edge += steps
    top.set_ylabel("step time (s)")
    top.set_yscale("log")
    top.legend(fontsize=7)
    top.set_title("changing link: step time per compressor")
    bottom.set_ylabel("auto: bits per parameter (32: pass-through)")
    bottom.set_yscale("log", base=2)
    bottom.set_xlabel("timed step")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
