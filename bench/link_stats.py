"""The link benchmark's derived figures (``bench.link``): each compressor's rounds pooled, step time, throughput,
bytes per step, ratios to ``none`` and ``fp16`` and to the physical limit, and ``auto``'s ratios to the best fixed
row with their bootstrap intervals. Pure functions of the workers' raw cases.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import specs
from bench.netns import parse_rate

WORKLOAD_FIELDS = ("tensors", "batch_per_rank", "unit", "unit_per_sample", "image_size", "seq_len", "vocab")
"""Facts of a model's workload that the workers record per case and the rows and ``link.json`` carry along."""


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def merge_rounds(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One case per (model, compressor), in order of first appearance: with ``--rounds R`` the workers run the whole
    compressor list R times (in turn, or side by side with ``--interleave``: R instances of each), and the rounds
    of a compressor are pooled here: step times and the budgets of the steps concatenated, bytes and steps added,
    ``round_step_s`` the median step of each round (their spread is the launch's own noise)."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for case in cases:
        key = (case.get("model", "resnet18"), case["compressor"])
        if key not in merged:
            merged[key] = {**case, "step_times_s": list(case["step_times_s"]),
                           "round_step_s": [_median(case["step_times_s"])]}
            continue
        into = merged[key]
        earlier, steps = int(into["steps"]), int(case["steps"])
        into["step_times_s"] += case["step_times_s"]
        if into.get("budget_bits_per_rank") is not None and case.get("budget_bits_per_rank") is not None:
            into["budget_bits_per_rank"] = into["budget_bits_per_rank"] + case["budget_bits_per_rank"]
        into["round_step_s"].append(_median(case["step_times_s"]))
        into["modeled_bytes_per_step"] = ((into["modeled_bytes_per_step"] * earlier
                                           + case["modeled_bytes_per_step"] * steps) / max(1, earlier + steps))
        for field in ("steps", "link_bytes", "elapsed_s", "violations"):
            into[field] = into.get(field, 0) + case.get(field, 0)
        wire = case.get("wire_bytes_total")
        into["wire_bytes_total"] = None if wire is None or into.get("wire_bytes_total") is None \
            else into["wire_bytes_total"] + wire
    return list(merged.values())


INTERVAL_LEVEL = 0.9
"""The coverage of the intervals of ``auto``'s ratios (:func:`ratio_interval`)."""


def ratio_interval(times: Sequence[float], others: Sequence[Sequence[float]], level: float = INTERVAL_LEVEL,
                   resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap interval (percentile, ``level``) of a row's throughput over the fastest of ``others``: of
    ``min(median(o) for o in others) / median(times)``. The fastest is chosen again in every resample, so the
    interval carries the luck of picking the best of several noisy rows (the best of five looks better than it
    is). Steps of the same index are resampled together when every row has as many (side by side, step *i* of
    every row ran at the same time, so the machine's drift cancels), else each row on its own. Seeded: the same
    figures give the same interval."""
    rows = [np.asarray(times, dtype=float), *(np.asarray(o, dtype=float) for o in others)]
    rng = np.random.default_rng(0)
    paired = len({len(r) for r in rows}) == 1
    together = rng.integers(0, len(rows[0]), size=(resamples, len(rows[0])))
    medians = [np.median(r[together if paired else rng.integers(0, len(r), size=(resamples, len(r)))], axis=1)
               for r in rows]
    ratios = np.min(medians[1:], axis=0) / medians[0]
    tail = (1 - level) / 2
    low, high = np.quantile(ratios, [tail, 1 - tail])
    return float(low), float(high)


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Derived figures of every case: ``runs`` maps a rate label to the worker's raw cases at that rate (the rounds
    of a compressor pooled first, :func:`merge_rounds`).

    Adds step_time_s (median over every timed step of every round), rounds and round_step_s, samples_per_s
    (images or sequences), throughput_per_s in throughput_unit (``images/s``, ``tokens/s``: samples_per_s x the
    case's ``unit_per_sample``; ``samples/s`` for a case without a unit), the workload facts of
    :data:`WORKLOAD_FIELDS` (null where the case lacks them), link/wire/modeled bytes per step, ratio_to_none and
    ratio_to_fp16
    (samples/s over that of ``none`` / ``fp16`` on the same model and rate) and vs_limit: step time over the
    physical limit, ``none`` step time on the unlimited link + modeled bytes / link rate (null without an
    unlimited measurement of ``none``; on the unlimited link itself the transfer term is zero).
    """
    rows: list[dict[str, Any]] = []
    times: dict[tuple[str, str, str], list[float]] = {}         # each row's timed steps, for the intervals
    for rate, cases in runs.items():
        bps = parse_rate(rate)
        for case in merge_rounds(cases):
            times[rate, case["model"], case["compressor"]] = case["step_times_s"]
            step = _median(case["step_times_s"])
            steps = max(1, int(case["steps"]))
            wire = case.get("wire_bytes_total")
            samples_per_s = case["ranks"] * case["batch_per_rank"] / step if step > 0 else math.nan
            unit, per_sample = throughput_unit(case)
            rows.append({
                "rate": rate, "rate_bps": bps, "model": case["model"], "compressor": case["compressor"],
                "parameters": case["parameters"], **{field: case.get(field) for field in WORKLOAD_FIELDS},
                "step_time_s": step, "rounds": len(case["round_step_s"]),
                "round_step_s": case["round_step_s"], "samples_per_s": samples_per_s,
                "throughput_per_s": samples_per_s * per_sample, "throughput_unit": f"{unit}/s",
                "link_bytes_per_step": case["link_bytes"] / steps,
                "wire_bytes_per_step": None if wire is None else wire / steps,
                "modeled_bytes_per_step": case["modeled_bytes_per_step"],
                "collective": case.get("collective"), "violations": case.get("violations", 0),
                # The budget of each timed step, bits per parameter (what `auto` chose; null for Horovod's own).
                "budget_bits_per_step": [None if b is None else b / case["parameters"]
                                         for b in case.get("budget_bits_per_rank") or []],
            })
    index = {(r["rate"], r["model"], r["compressor"]): r for r in rows}
    # Each front end against its own references: Horovod's none / fp16, DDP's ddp:none / ddp:fp16.
    unlimited_none = {(r["model"], r["compressor"]): r["step_time_s"] for r in rows if r["rate"] == "unlimited"
                      and r["compressor"] in ("none", "ddp:none")}
    for r in rows:
        front = front_end_prefix(r["compressor"])
        for ref in ("none", "fp16"):
            other = index.get((r["rate"], r["model"], front + ref))
            r[f"ratio_to_{ref}"] = (r["samples_per_s"] / other["samples_per_s"]
                                    if other and other["samples_per_s"] > 0 else None)
        base = unlimited_none.get((r["model"], front + "none"))
        if base is None:
            r["vs_limit"] = None
        else:
            transfer = 0.0 if r["rate_bps"] is None else r["modeled_bytes_per_step"] * 8 / r["rate_bps"]
            r["vs_limit"] = r["step_time_s"] / (base + transfer)
    for r in rows:
        if r["compressor"].endswith("@auto"):
            front = front_end_prefix(r["compressor"])
            fixed = [o for o in rows if o["rate"] == r["rate"] and o["model"] == r["model"]
                     and front_end_prefix(o["compressor"]) == front and not o["compressor"].endswith("@auto")]
            best = max(fixed, key=lambda o: o["samples_per_s"], default=None)
            r["best_fixed"] = None if best is None else best["compressor"]
            r["ratio_to_best"] = (r["samples_per_s"] / best["samples_per_s"]
                                  if best is not None and best["samples_per_s"] > 0 else None)
            # Whether it chose right, apart from its instance's speed: two instances of one fixed row differ by up
            # to 10% here (dd535ed).
            target = None if best is None else fixed_budget(best["compressor"])
            bits = [b for b in r["budget_bits_per_step"] if b is not None]
            r["steps_at_best_budget"] = None if target is None or not bits else [
                sum(math.isclose(b, target, rel_tol=1e-3) for b in bits), len(bits)]
            # How far the launch's own noise leaves those ratios: the median of 20 steps that differ by a third
            # from one to the next is uncertain by about 5% (docs/RESULTS.md 4.2, "How sure is a cell").
            mine = times[r["rate"], r["model"], r["compressor"]]
            none = times.get((r["rate"], r["model"], front + "none"))
            for name, theirs in (("best", [times[o["rate"], o["model"], o["compressor"]] for o in fixed]),
                                 ("none", [none] if none else [])):
                r[f"ratio_to_{name}_interval"] = list(ratio_interval(mine, theirs)) if mine and theirs else None
    return rows


def throughput_unit(case: dict[str, Any]) -> tuple[str, int]:
    """What a case's throughput counts and how many per sample: ``("tokens", 128)`` for gpt2_small,
    ``("images", 1)`` for resnet18; ``("samples", 1)`` for a case that does not say."""
    return case.get("unit") or "samples", int(case.get("unit_per_sample") or 1)


def model_facts(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``link.json``'s ``models``: per model, its parameters and :data:`WORKLOAD_FIELDS` (from its first row)."""
    facts: dict[str, dict[str, Any]] = {}
    for r in rows:
        facts.setdefault(r["model"], {"parameters": r["parameters"],
                                      **{field: r.get(field) for field in WORKLOAD_FIELDS}})
    return facts


def front_end_prefix(compressor: str) -> str:
    """``"ddp:"`` for the DDP rows, ``""`` for Horovod's."""
    return "ddp:" if compressor.startswith("ddp:") else ""


def fixed_budget(compressor: str) -> float | None:
    """The bits per parameter a fixed row sends, as ``auto``'s budgets count them: ``none`` 32 (``auto``'s
    pass-through), ``safebits@B`` B; None for a row ``auto`` cannot choose (``fp16``)."""
    spec = specs.parse(compressor)
    if spec.name == "none":
        return 32.0
    return spec.budget_bits if spec.name == "safebits" and isinstance(spec.budget_bits, float) else None
