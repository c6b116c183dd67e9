"""Pure helpers of the demo and the threshold sweep: run labels, the collapse rule, seed statistics and tables.

No Horovod and no training here (``tests/test_demo_stats.py`` tests them directly).
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from bench.tasks import SCHEDULES
from safebits_hvd import SafeBits
from safebits_hvd.frontends.baselines import label as compressor_label

_DEFAULTS = inspect.signature(SafeBits.__init__).parameters
DEFAULT_THRESHOLDS = (float(_DEFAULTS["max_distortion"].default), float(_DEFAULTS["min_cosine"].default))
"""The library's ``(max_distortion, min_cosine)``."""


COLLAPSE_FACTOR = 0.9
"""A run has collapsed when its loss is non-finite or its final validation loss exceeds this multiple of the
validation loss of the initial weights: a run that did not end at least 10% below where it started has failed,
whether it diverged upward or trained and then fell back to chance level (which EF-free 2-bit quantizers and
scaled sign do on the CNN at this learning rate)."""


def collapsed(initial_loss: float, final_loss: float, nonfinite: bool, factor: float = COLLAPSE_FACTOR) -> bool:
    """The demo's collapse rule (see :data:`COLLAPSE_FACTOR`)."""
    return nonfinite or not math.isfinite(final_loss) or final_loss > factor * initial_loss


def run_label(run: dict[str, Any]) -> str:
    """``compressor@budget``, with ``[d=..,c=..]`` after ``safebits`` when its screen is not the default one."""
    name = run["compressor"]
    thresholds = (run.get("max_distortion"), run.get("min_cosine"))
    if name == "safebits" and thresholds[0] is not None and thresholds != DEFAULT_THRESHOLDS:
        name += f"[d={thresholds[0]:g},c={thresholds[1]:g}]"
    return compressor_label(name, run["budget_bits"])


def other_schedule(run: dict[str, Any]) -> str | None:
    """The run's learning-rate schedule when it is not the demo's, else None (records from before the schedule
    was recorded ran at the demo's)."""
    schedule = run.get("lr_schedule", SCHEDULES[0])
    return None if schedule == SCHEDULES[0] else schedule


def section(run: dict[str, Any]) -> str:
    """The table a run belongs to: its task, and its learning-rate schedule when that is not the demo's (runs at a
    constant rate are not comparable with decayed ones, docs/RESULTS.md section 2)."""
    schedule = other_schedule(run)
    return run["task"] if schedule is None else f"{run['task']}, {schedule} learning rate"


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; 0.0 for one value, NaN for none)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def paired_difference(a: Iterable[dict[str, Any]], b: Iterable[dict[str, Any]],
                      key: str = "final_metric") -> tuple[float, float, int]:
    """Mean and sample std over seeds of ``a[key] - b[key]`` for the seeds both have, and how many.

    Runs with the same seed share the initial weights and the data order, so the per-seed difference is the
    comparison; its std is the seeds' spread of the difference.
    """
    by_seed = {r["seed"]: r[key] for r in b}
    diffs = [r[key] - by_seed[r["seed"]] for r in a if r["seed"] in by_seed]
    mean, std = mean_std(diffs)
    return mean, std, len(diffs)


def higher_is_better(metric_name: str) -> bool:
    """Accuracy-like metrics: higher is better; losses and bits per byte: lower is."""
    return "accuracy" in metric_name


def group(runs: Iterable[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Runs by ``(section, run_label)`` (see :func:`section`), in first-seen order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        groups[(section(r), run_label(r))].append(r)
    return groups


def closest_fixed(target: list[dict[str, Any]], candidates: dict[str, list[dict[str, Any]]]) -> str | None:
    """Label of the fixed (unbudgeted, not fp32) baseline whose mean modeled ratio is nearest to ``target``'s, in
    log ratio (equal bytes)."""
    def ratio(rs: list[dict[str, Any]]) -> float:
        return mean_std([r["compression_ratio"] or 1.0 for r in rs])[0]

    own = ratio(target)
    options = [(abs(math.log(ratio(rs) / own)), name) for name, rs in candidates.items()
               if rs[0]["budget_bits"] is None and rs[0]["compressor"] != "fp32"]
    return min(options)[1] if options else None


def fmt(mean: float, std: float, digits: int = 4) -> str:
    """``mean ± std``."""
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def table(runs: list[dict[str, Any]], collapse_factor: float = COLLAPSE_FACTOR) -> str:
    """Markdown tables per task and schedule (:func:`section`): mean ± std over seeds, collapses counted, and for
    every budgeted run the paired difference to the closest fixed baseline at equal bytes."""
    groups = group(runs)
    lines: list[str] = []
    for title in dict.fromkeys(section(r) for r in runs):
        task_groups = {name: rs for (t, name), rs in groups.items() if t == title}
        metric = next(iter(task_groups.values()))[0]["metric_name"]
        fp32 = task_groups.get("fp32", [])
        ref = mean_std([r["final_metric"] for r in fp32])[0]
        lines += [f"### {title}", "",
                  f"| compressor | seeds | final val loss | {metric} | vs fp32 | modeled ratio | bits/param | "
                  f"violations | escalations | collapsed | wall s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, rs in task_groups.items():
            n = len(rs)
            loss = mean_std([r["final_loss"] for r in rs])
            value = mean_std([r["final_metric"] for r in rs])
            ratio = mean_std([r["compression_ratio"] or 0.0 for r in rs])[0]
            rel = f"{(value[0] - ref) / ref * 100:+.1f}%" if fp32 and ref else "-"
            wall = mean_std([r["wall_s"] for r in rs])[0]
            bpp = 32.0 / ratio if ratio else math.nan
            lines.append(f"| {name} | {n} | {fmt(*loss)} | {fmt(*value)} | {rel} | {ratio:.2f}x | "
                         f"{bpp:.2f} | {sum(r['violations'] for r in rs)} | {sum(r['escalations'] for r in rs)} | "
                         f"{sum(r['collapsed'] for r in rs)}/{n} | {wall:.1f} |")
        lines.append("")
        pairs = [(name, rs) for name, rs in task_groups.items() if rs[0]["budget_bits"] is not None]
        if pairs and any(rs[0]["budget_bits"] is None and rs[0]["compressor"] != "fp32"
                         for rs in task_groups.values()):
            better = "higher" if higher_is_better(metric) else "lower"
            lines += [f"Against the closest fixed baseline at equal bytes ({metric}, {better} is better; "
                      f"difference = budgeted - baseline, mean ± std of the per-seed differences):", "",
                      "| budgeted run | ratio | closest fixed | ratio | difference | seeds | beyond spread |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            for name, rs in pairs:
                base = closest_fixed(rs, task_groups)
                assert base is not None
                diff, spread, n = paired_difference(rs, task_groups[base])
                wins = (diff > 0) == higher_is_better(metric)
                verdict = ("better" if wins else "worse") if abs(diff) > spread and n > 1 else "no"
                lines.append(f"| {name} | {mean_std([r['compression_ratio'] or 0.0 for r in rs])[0]:.2f}x | "
                             f"{base} | {mean_std([r['compression_ratio'] or 0.0 for r in task_groups[base]])[0]:.2f}x"
                             f" | {diff:+.4f} ± {spread:.4f} | {n} | {verdict} |")
            lines.append("")
    lines.append(f"Mean ± sample std over seeds. `collapsed`: non-finite loss, or final validation loss > "
                 f"{collapse_factor}x the validation loss of the initial weights. `vs fp32`: relative difference of "
                 f"the metric's mean to fp32's (accuracy: higher is better; bits per byte: lower is better). "
                 f"`modeled ratio`: 32 x parameters x steps / modeled bits sent; `bits/param` = 32 / ratio. "
                 f"Violations and escalations are summed over steps and seeds. `beyond spread`: |mean difference| > "
                 f"its std over seeds.")
    return "\n".join(lines) + "\n"
