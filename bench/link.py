"""Link benchmark (``make bench-link``): training throughput of every compressor on a rate-limited link.

What it measures. Two Horovod ranks (``horovodrun -np 2 --gloo``) run inside a private network namespace whose
loopback is limited with a token-bucket filter (``tc qdisc ... tbf rate R``); Gloo talks TCP over that loopback,
so every byte of every collective crosses the limited link and nothing else on the machine is touched. Each rank
runs one thread; Horovod's ranks bind themselves to their own cores, as ``mpirun`` binds ranks (``--no-pin``:
unbound; :func:`bench.protocol.pin_rank`), torchrun's are left unbound, as torchrun leaves them. For each
link rate, ONE launch of ``bench.hvd_worker link`` runs every (model, compressor) case in sequence (with
``--interleave``, each model's cases side by side, their timed steps alternating: the fair comparison on a shared
machine whose speed drifts over the minutes between cases) and records:

* step time (median over the timed steps, rank 0) and throughput: samples/s (2 ranks x batch per rank / step
  time; images or sequences) and the model's own unit (images/s, tokens/s for ``gpt2_small``: samples/s x 128);
* link bytes per step: the delta of the namespace loopback's ``tx_bytes`` over the case's timed steps, divided by
  the steps (both ranks' traffic, TCP/IP headers and Horovod's coordination messages included);
* wire bytes per step: ``StepRecord.wire_bytes`` summed over both ranks, where the compressor's record carries it
  (null otherwise, e.g. while compressors still send float32);
* modeled bytes per step: ``StepRecord.modeled_bits_total`` (else ``used_bits_total``) / 8 per rank, summed over
  both ranks; 4 (``none``) or 2 (``fp16``) bytes per parameter per rank for Horovod's own compressors;
* for every ``@auto`` row, its throughput over the best fixed row of its front end and over ``none``, each with
  a 90% bootstrap interval (:func:`ratio_interval`: the timed steps resampled, step *i* of every row together,
  the best chosen again in each resample), and how many of its timed steps ran at the best fixed row's budget
  (:func:`fixed_budget`): whether it chose right, apart from how fast its instance ran;
* a link probe per launch: fp32 allreduces with no model (loopback bytes / their time), the rate the link gave;
* against the physical limit: step time / (``none`` step time on the unlimited link + modeled bytes / link rate),
  when ``unlimited`` was measured in the same invocation.

Models (``--models``; :mod:`bench.tasks`):

* ``resnet18``: a CIFAR-style ResNet-18 (3x3 stem, no max-pool; 11.2M parameters in 62 tensors) on synthetic
  3xSxS images, S = ``--image-size`` (32 by default; e.g. 224 for ImageNet-size inputs: the same gradient bytes,
  49 times the compute, since the CIFAR stem does not downsample); ``--cnn-batch`` images per rank; images/s.
* ``gpt2_small``: a GPT-2-shaped decoder built here (12 pre-LayerNorm layers, width 256, 4 heads, vocabulary
  8,192, context 128, learned positions, LM head tied to the token embedding; 11.6M parameters in 148 tensors)
  on synthetic token ids, next-token cross-entropy, causal ``scaled_dot_product_attention``, AdamW;
  ``--gpt-batch`` sequences of 128 tokens per rank; tokens/s. Not in the default ``--models``.
* ``bytes_lm``: the demo's byte-level transformer LM (``bench.tasks``), ``--lm-batch`` windows of 64
  bytes per rank, Horovod rows only; sequences/s.

Default ``--models``: ``resnet18 bytes_lm``. Compressors: ``none`` and ``fp16`` (Horovod's), ``qsgd4``,
``topk10_ef``, ``safebits@2``, ``safebits@4.4``, ``safebits@8``.

DDP rows (``resnet18`` and ``gpt2_small``, those of ``--models``; no launch when neither is selected): one
``torchrun`` launch of ``bench.ddp_worker`` per rate, on the same link, running every selected DDP model,
with PyTorch DDP and a communication hook: ``ddp:none`` (DDP's default allreduce), ``ddp:fp16``
(``fp16_compress_hook``), ``ddp:powersgd1`` and ``ddp:powersgd4`` (PowerSGD at rank 1 and 4), ``ddp:safebits@B``
(SafeBits' DDP hook). Their ``x none`` / ``x fp16`` columns compare with ``ddp:none`` / ``ddp:fp16``. With
``--quality-steps N`` every DDP compressor (plus ``--quality-extra``) also trains N steps of a fixed learnable task
on the unlimited link (ResNet-18 at 32x32, whatever ``--models`` and ``--image-size`` say), and the held-out loss
and link bytes go in a table of their own: the compressors' quality at their bytes.

Run it as root (it needs CAP_NET_ADMIN for ``ip netns`` and ``tc``; without it, it says so and exits 0)::

    make bench-link                                       # --rates 1gbit
    .venv/bin/python -m bench.link --rates 100mbit 1gbit 10gbit unlimited
    .venv/bin/python -m bench.link --quick                # smoke run: 1 rate, 2 steps, CNN, 3 + 3 compressors
    .venv/bin/python -m bench.link --quick --models gpt2_small --gpt-batch 4     # the same for the transformer
    .venv/bin/python -m bench.link --rates 1gbit unlimited --models resnet18 gpt2_small --image-size 224 \
        --cnn-batch 4 --gpt-batch 8                       # ImageNet-size images and the GPT-2-shaped decoder
    .venv/bin/python -m bench.link --rates 1gbit unlimited --models resnet18 --cnn-batch 16 --interleave \
        --compressors none fp16 safebits@2 safebits@4.4 safebits@8 safebits@auto \
        --ddp-compressors ddp:none ddp:fp16 ddp:safebits@2 ddp:safebits@4.4 ddp:safebits@8 ddp:safebits@auto
                                                          # auto against every fixed choice, step by step
    .venv/bin/python -m bench.link --rates 1gbit unlimited --models resnet18 --compressors none \
        --quality-steps 40                                # the DDP rows and their training run
    .venv/bin/python -m bench.link --from-json results/link.json   # an earlier launch's tables, derived again

Writes ``results/link.json`` (raw and derived figures, the command, rates, the image size and per-rank batches,
per model its parameter and tensor counts, throughput unit and input shape, the qdisc statistics),
``results/link.md`` (one table per model, headed by its parameters, tensors and per-rank batch with the image size
or sequence length) and ``results/link_throughput.png`` (throughput in each model's unit against link rate).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from bench import link_phases, specs
from bench.protocol import PIN_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HVD_WORKER = ("-m", "bench.hvd_worker")      # launched as modules from the repository root (the launchers' cwd)
DDP_WORKER = ("-m", "bench.ddp_worker")
RATES = ["100mbit", "1gbit", "10gbit", "unlimited"]
COMPRESSORS = ["none", "fp16", "qsgd4", "topk10_ef", "safebits@2", "safebits@4.4", "safebits@8"]
QUICK_COMPRESSORS = ["none", "fp16", "safebits@4.4"]
DDP_COMPRESSORS = ["ddp:none", "ddp:fp16", "ddp:powersgd1", "ddp:powersgd4", "ddp:safebits@2", "ddp:safebits@4.4",
                   "ddp:safebits@8"]
QUICK_DDP_COMPRESSORS = ["ddp:none", "ddp:fp16", "ddp:safebits@4.4"]
MODELS = ["resnet18", "bytes_lm", "gpt2_small"]
DEFAULT_MODELS = ["resnet18", "bytes_lm"]
DDP_MODELS = ["resnet18", "gpt2_small"]
"""The models the DDP worker runs; the others of ``--models`` get Horovod rows only."""
WORKLOAD_FIELDS = ("tensors", "batch_per_rank", "unit", "unit_per_sample", "image_size", "seq_len", "vocab")
"""Facts of a model's workload that the workers record per case and the rows and ``link.json`` carry along."""
LO_MTU = 65536
"""The loopback's MTU: a tbf bucket smaller than one full-size frame (plus its link header) drops that frame."""
MIN_BURST = 2 * LO_MTU
BURST_TIME_S = 1e-3
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


# ---------------------------------------------------------------------------------------------- pure helpers
def parse_rate(text: str) -> int | None:
    """Link rate in bits per second from tc's notation (``100mbit``, ``1gbit``, ``2.5gbit``); None for
    ``unlimited``. tc's bit-rate units are decimal (1mbit = 10**6 bit/s)."""
    text = text.strip().lower()
    if text == "unlimited":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)", text)
    if not match:
        raise ValueError(f"not a link rate: {text!r} (expected e.g. 100mbit, 1gbit, 10gbit or unlimited)")
    bps = float(match.group(1)) * _UNITS[match.group(2)]
    if bps < 1:
        raise ValueError(f"link rate must be positive: {text!r}")
    return round(bps)


def burst_bytes(rate_bps: int) -> int:
    """tbf bucket size: one millisecond at the rate, and at least two full-size loopback frames."""
    if rate_bps <= 0:
        raise ValueError(f"rate must be positive, got {rate_bps}")
    return max(math.ceil(rate_bps / 8 * BURST_TIME_S), MIN_BURST)


def tbf_command(rate_bps: int, dev: str = "lo") -> list[str]:
    """``tc`` arguments that limit what ``dev`` sends (``lo``: the namespace's loopback) to ``rate_bps``."""
    return ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_bps}bit",
            "burst", str(burst_bytes(rate_bps)), "latency", "100ms"]


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


def workload_label(row: dict[str, Any]) -> str:
    """The per-rank batch of a row in words: ``batch 16 images of 3x224x224``, ``batch 8 sequences of 128
    tokens``, ``batch 16`` (a row without facts)."""
    unit, batch = row.get("unit"), row["batch_per_rank"]
    if unit == "images" and row.get("image_size"):
        return f"batch {batch} images of 3x{row['image_size']}x{row['image_size']}"
    if unit == "tokens" and row.get("seq_len"):
        return f"batch {batch} sequences of {row['seq_len']} tokens"
    return f"batch {batch} {unit}" if unit else f"batch {batch}"


def model_heading(model: str, rows: list[dict[str, Any]]) -> str:
    """``### name (P parameters in T tensors; batch ... per rank)`` from the model's rows (several batch
    descriptions, if its rows disagree, joined by `` / ``)."""
    mine = [r for r in rows if r["model"] == model]
    params = f"{mine[0]['parameters']:,} parameters"
    if mine[0].get("tensors"):
        params += f" in {mine[0]['tensors']} tensors"
    batches = " / ".join(dict.fromkeys(workload_label(r) for r in mine))
    return f"### {model} ({params}; {batches} per rank)"


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


def quality_table(cases: list[dict[str, Any]]) -> str:
    """Markdown: per DDP compressor of the training run, link MB and modeled MB per step (both ranks), the loss
    at the start and over the last 5 steps, and the held-out loss and accuracy at the end."""
    lines = ["| compressor | link MB/step | modeled MB/step | first loss | last-5 loss | held-out loss | "
             "held-out accuracy |", "|" + " --- |" * 7]
    for c in cases:
        lines.append(f"| {c['compressor']} | {c['link_bytes'] / c['steps'] / 1e6:.2f} | "
                     f"{c['modeled_bytes_per_step'] / 1e6:.2f} | {c['train_loss_first']:.3f} | "
                     f"{c['train_loss_last5']:.3f} | {c['held_out_loss']:.3f} | {c['held_out_accuracy']:.3f} |")
    return "\n".join(lines) + "\n"


def format_value(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def build_tables(rows: list[dict[str, Any]]) -> str:
    """Markdown: one table per model (headed by its parameters, tensors and per-rank batch), rows = compressors,
    for each rate: throughput (images/s, tokens/s, ...: the rows' throughput_unit; one decimal, 3 significant
    digits below 10), ratio to none and to fp16,
    link / wire / modeled MB per step (10**6 bytes, both ranks), step time over the physical limit."""
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    lines: list[str] = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = {(r["rate"], r["compressor"]): r for r in rows if r["model"] == model}
        unit = next(r.get("throughput_unit") or "samples/s" for r in rows if r["model"] == model)
        header = ["compressor"]
        for rate in rates:
            header += [f"{rate} {unit}", "x none", "x fp16", "link MB", "wire MB", "modeled MB", "vs limit"]
        lines += [model_heading(model, rows), "", "| " + " | ".join(header) + " |",
                  "|" + " --- |" * len(header)]
        for compressor in dict.fromkeys(c for _, c in mine):
            cells = [compressor]
            for rate in rates:
                r = mine.get((rate, compressor))
                if r is None:
                    cells += ["-"] * 7
                    continue
                wire = r["wire_bytes_per_step"]
                throughput = r.get("throughput_per_s", r["samples_per_s"])
                cells += [format_value(throughput, ".1f" if throughput >= 10 else "#.3g"),
                          format_value(r["ratio_to_none"], ".2f", "x"),
                          format_value(r["ratio_to_fp16"], ".2f", "x"),
                          format_value(r["link_bytes_per_step"] / 1e6, ".2f"),
                          format_value(None if wire is None else wire / 1e6, ".2f"),
                          format_value(r["modeled_bytes_per_step"] / 1e6, ".2f"), format_value(r["vs_limit"], ".2f")]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("Throughput: images/s (resnet18), tokens/s (gpt2_small, 128 per sequence), sequences/s (bytes_lm, "
                 "64-byte windows): 2 ranks x batch per rank (x tokens per sequence) / median step time. "
                 "`x none`, `x fp16`: throughput relative to that compressor on the same model and link. MB per "
                 "step, both ranks together (10^6 bytes): `link` = loopback tx_bytes delta (TCP/IP headers and "
                 "Horovod coordination included), `wire` = the compressors' own wire_bytes (`-`: not reported), "
                 "`modeled` = modeled bits / 8. `vs limit`: step time / (none's step time on the unlimited link + "
                 "modeled bytes / link rate); `-` without an unlimited run. `ddp:` rows: PyTorch DDP with that "
                 "communication hook, compared with `ddp:none` and `ddp:fp16`.")
    return "\n".join(lines) + "\n"


def budget_runs(bits: list[float | None]) -> str:
    """A step-by-step budget list in runs: ``[32, 32, 2, 2, 2]`` -> ``"32 x2, 2 x3"``."""
    runs: list[list[Any]] = []
    for b in bits:
        label = "-" if b is None else f"{b:.3g}"
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    return ", ".join(f"{label} x{count}" for label, count in runs)


def report_tables(rows: list[dict[str, Any]]) -> str:
    """Markdown of a launch's rows: :func:`build_tables`, then :func:`auto_table` under its heading if any."""
    autos = auto_table(rows)
    return build_tables(rows) + ("\n### `auto` against the best fixed choice of each cell\n\n" + autos
                                 if autos else "")


def auto_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: every ``@auto`` row against the best fixed compressor of its front end on the same model and rate
    (the throughput of each, ``x best``, ``x none``, each with its interval: :func:`ratio_interval`) and the
    budget ``auto`` chose at each timed step (bits per parameter, in runs, each round's apart; 32 is no
    compression) and how many ran at the best fixed row's budget. Empty without ``@auto`` rows."""
    autos = [r for r in rows if r["compressor"].endswith("@auto")]
    if not autos:
        return ""

    def ratio(r: dict[str, Any], name: str) -> str:
        interval = r.get(f"ratio_to_{name}_interval")
        text = format_value(r[f"ratio_to_{name}"], ".2f", "x")
        return text if interval is None else f"{text} ({interval[0]:.2f}-{interval[1]:.2f})"

    def per_round(r: dict[str, Any]) -> str:
        bits, rounds = r["budget_bits_per_step"], max(1, r.get("rounds", 1))
        size = len(bits) // rounds if len(bits) % rounds == 0 else len(bits)
        return " / ".join(budget_runs(bits[i:i + size]) for i in range(0, len(bits), max(1, size)))

    level = f"{INTERVAL_LEVEL:.0%}"
    lines = [f"| model | rate | auto | best fixed | best's throughput | auto's throughput | x best ({level}) | "
             f"x none ({level}) | steps at the best's budget | budgets of the timed steps |", "|" + " --- |" * 10]
    for r in autos:
        at_best = r.get("steps_at_best_budget")
        best = next((o for o in rows if o["rate"] == r["rate"] and o["model"] == r["model"]
                     and o["compressor"] == r["best_fixed"]), None)
        lines.append(f"| {r['model']} | {r['rate']} | {r['compressor']} | {r['best_fixed'] or '-'} | "
                     f"{format_value(None if best is None else best['throughput_per_s'], '.1f')} | "
                     f"{format_value(r['throughput_per_s'], '.1f')} | {ratio(r, 'best')} | {ratio(r, 'none')} | "
                     f"{'-' if at_best is None else f'{at_best[0]}/{at_best[1]}'} | {per_round(r)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Throughput (each model's unit: images/s, tokens/s, samples/s) against link rate (log x; ``unlimited`` one
    decade past the fastest finite rate), one line per compressor, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = sorted({r["rate_bps"] for r in rows if r["rate_bps"] is not None})
    unlimited_x = (finite[-1] * 10) if finite else 1e11

    def x_of(r: dict[str, Any]) -> float:
        return unlimited_x if r["rate_bps"] is None else r["rate_bps"]

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        for compressor in dict.fromkeys(r["compressor"] for r in mine):
            pts = sorted((x_of(r), r.get("throughput_per_s", r["samples_per_s"])) for r in mine
                         if r["compressor"] == compressor)
            style = "-" if compressor.startswith("safebits") else "--"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=compressor)
        ticks = sorted({x_of(r) for r in mine})
        ax.set_xscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels(["unlimited" if t == unlimited_x else _rate_label(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("link rate (namespace loopback, tbf)")
        ax.set_ylabel(f"{mine[0].get('throughput_unit') or 'samples/s'} (2 ranks)")
        ax.set_title(f"{model}: throughput vs link rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _rate_label(bps: float) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


# ---------------------------------------------------------------------------------------------- namespace
def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check)


def in_namespace(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


def delete_namespace(ns: str) -> None:
    """Kill whatever still runs in the namespace (by pid: only processes this benchmark started there), delete it."""
    pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _run(["ip", "netns", "del", ns], check=False)


def configure_link(ns: str, rate_bps: int | None) -> str:
    """Loopback up; tbf at ``rate_bps`` or no qdisc at all (unlimited). Returns ``tc qdisc show`` of ``lo``."""
    _run(in_namespace(ns, "ip", "link", "set", "lo", "up"))
    if rate_bps is None:
        _run(in_namespace(ns, "tc", "qdisc", "del", "dev", "lo", "root"), check=False)   # none there is fine
    else:
        _run(in_namespace(ns, *tbf_command(rate_bps)))
    return _run(in_namespace(ns, "tc", "qdisc", "show", "dev", "lo")).stdout.strip()


@contextlib.contextmanager
def limited_namespace(name: str, rate: str) -> Iterator[list[str] | None]:
    """A network namespace of its own (``name`` and this process's id) whose loopback runs at ``rate`` (this
    module's syntax, or ``unlimited``); yields the command prefix that runs a launcher in it, or None where none can
    be made (not root, no iproute2), and deletes it afterwards with whatever still runs in it."""
    ns = f"{name}-{os.getpid()}"
    if os.system(f"ip netns add {ns} 2>/dev/null") != 0:
        yield None
        return
    try:
        configure_link(ns, parse_rate(rate))
        yield in_namespace(ns)
    finally:
        delete_namespace(ns)


TWO_NODE_ADDRESSES = ("10.213.0.1", "10.213.0.2")


@contextlib.contextmanager
def two_nodes(name: str, rate: str) -> Iterator[list[tuple[list[str], str]] | None]:
    """Two network namespaces, "nodes", joined by a veth pair whose ends each send at most ``rate`` (``tc``); inside
    a node ranks talk over its loopback, unlimited (an address of the node's own never leaves it). Yields per node
    the command prefix that runs in it and its veth's name (for ``GLOO_SOCKET_IFNAME``; the first node's address,
    :data:`TWO_NODE_ADDRESSES`, is the rendezvous), or None where namespaces cannot be made; deletes both after."""
    tag = f"{os.getpid() % 100000}"
    nodes = [(f"{name}{k}-{tag}", f"sbv{tag}{k}") for k in range(2)]
    if os.system(f"ip netns add {nodes[0][0]} 2>/dev/null") != 0:
        yield None
        return
    try:
        _run(["ip", "netns", "add", nodes[1][0]])
        _run(["ip", "link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1]])
        rate_bps = parse_rate(rate)
        for (ns, dev), address in zip(nodes, TWO_NODE_ADDRESSES, strict=True):
            _run(["ip", "link", "set", dev, "netns", ns])
            _run(in_namespace(ns, "ip", "addr", "add", f"{address}/24", "dev", dev))
            for link in (dev, "lo"):
                _run(in_namespace(ns, "ip", "link", "set", link, "up"))
            if rate_bps is not None:
                _run(in_namespace(ns, *tbf_command(rate_bps, dev)))
        yield [(in_namespace(ns), dev) for ns, dev in nodes]
    finally:
        for ns, _ in nodes:
            delete_namespace(ns)      # the veth pair goes with its namespaces


def torchrun_two_nodes(nodes: list[tuple[list[str], str]], ranks_per_node: int, module: str, args: list[str],
                       timeout: float) -> str:
    """``python -m module args`` on ``ranks_per_node`` ranks in each of :func:`two_nodes`' nodes (one ``torchrun``
    per node, a static rendezvous at the first node's address); the first node's output. Both launches are killed
    after ``timeout`` seconds; a non-zero exit raises :class:`~safebits_hvd.launch.LaunchError`."""
    from safebits_hvd.launch import REPO, LaunchError, launch_env

    port = str(29500 + os.getpid() % 1000)
    procs = []
    for rank, (prefix, dev) in enumerate(nodes):
        command = [*prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank),
                   "--nproc_per_node", str(ranks_per_node), "--master_addr", TWO_NODE_ADDRESSES[0],
                   "--master_port", port, "-m", module, *args]
        env = launch_env(ranks_per_node, {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": dev})
        procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired as exc:
        raise LaunchError(f"two-node launch of {module} timed out after {timeout:g} s", "".join(outputs)) from exc
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    if any(proc.returncode for proc in procs):
        raise LaunchError(f"two-node launch of {module} failed ({[p.returncode for p in procs]})", "\n".join(outputs))
    return outputs[0]


def run_on_link(name: str, argv: list[str] | None, parse_args: Callable[[list[str]], argparse.Namespace],
                worker: Callable[[argparse.Namespace], None],
                launch: Callable[[Any, list[str], argparse.Namespace], None]) -> int:
    """An experiment that launches itself on a limited link: with ``--worker`` (``args.worker``) this process is a
    rank and runs ``worker(args)``; else ``launch(link, argv, args)`` starts the ranks at ``args.rate``: ``link`` is
    the command prefix of a namespace of their own (:func:`limited_namespace`), or with ``args.nodes == 2`` the two
    nodes of :func:`two_nodes`. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    with (two_nodes(name, args.rate) if getattr(args, "nodes", 1) == 2 else limited_namespace(name, args.rate)) as link:
        if link is None:
            print(f"[{name}] cannot create a network namespace: run as root with ip and tc (iproute2)")
            return 1
        launch(link, argv, args)
    return 0


def qdisc_stats(ns: str) -> str:
    return _run(in_namespace(ns, "tc", "-s", "qdisc", "show", "dev", "lo"), check=False).stdout.strip()


# ---------------------------------------------------------------------------------------------- main
def worker_args(args: argparse.Namespace, out: str) -> list[str]:
    return ["--out", out, "--models", *args.models, "--compressors", *args.compressors,
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--rounds", str(args.rounds),
            "--cnn-batch", str(args.cnn_batch), "--lm-batch", str(args.lm_batch), "--gpt-batch", str(args.gpt_batch),
            "--image-size", str(args.image_size), *(["--interleave"] if args.interleave else [])]


def ddp_models(args: argparse.Namespace) -> list[str]:
    """The selected models that the DDP worker runs (:data:`DDP_MODELS`), in ``--models`` order."""
    return [m for m in args.models if m in DDP_MODELS]


def ddp_worker_args(args: argparse.Namespace, out: str, quality: bool = False) -> list[str]:
    """The DDP worker's arguments: the timed cases of :func:`ddp_models`, or (``quality``) the training run, which
    is ResNet-18 at 32x32 whatever ``--models`` says."""
    compressors = args.ddp_compressors + (args.quality_extra if quality else [])
    return ["--out", out, "--models", *(["resnet18"] if quality else ddp_models(args)), "--compressors",
            *compressors, "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--rounds", str(1 if quality else args.rounds), "--cnn-batch", str(args.cnn_batch),
            "--gpt-batch", str(args.gpt_batch), "--image-size", str(args.image_size),
            "--quality-steps", str(args.quality_steps if quality else 0),
            *(["--interleave"] if args.interleave and not quality else [])]


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="*", default=["1gbit"], choices=RATES,
                        help="link rates to time (none given: only the --quality-steps training run)")
    parser.add_argument("--compressors", nargs="*", default=COMPRESSORS,
                        help="none, fp16, or registry names of safebits_hvd.baselines (name@budget_bits); none "
                             "given: only the DDP rows")
    parser.add_argument("--models", nargs="+", default=None, choices=MODELS,
                        help=f"default {' '.join(DEFAULT_MODELS)} (--quick: resnet18); DDP rows for "
                             f"{' and '.join(DDP_MODELS)}")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the compressor list this many times in turn in each launch and pool each "
                             "compressor's steps (interleaving spreads a shared machine's drift over all of them)")
    parser.add_argument("--interleave", action="store_true",
                        help="run each model's compressors side by side in a launch, their timed steps alternating "
                             "(a shared machine's drift falls on all of them step by step; the cases' models are "
                             "all in memory at once)")
    parser.add_argument("--cnn-batch", type=int, default=16, help="ResNet-18 images per rank per step")
    parser.add_argument("--image-size", type=int, default=32,
                        help="ResNet-18 image side (synthetic 3xSxS images; e.g. 224 for ImageNet-size inputs)")
    parser.add_argument("--lm-batch", type=int, default=16, help="bytes_lm sequences (64 bytes) per rank per step")
    parser.add_argument("--gpt-batch", type=int, default=8,
                        help="gpt2_small sequences (128 tokens) per rank per step")
    parser.add_argument("--ddp-compressors", nargs="*", default=DDP_COMPRESSORS,
                        help="DDP rows (torchrun; for the models of --models among resnet18 and gpt2_small): "
                             "ddp:none, ddp:fp16, ddp:powersgdR, ddp:safebits@B; none to skip them")
    parser.add_argument("--quality-steps", type=int, default=0,
                        help="train every DDP compressor this many steps on the unlimited link (0: no training run)")
    parser.add_argument("--quality-extra", nargs="*", default=[],
                        help="DDP compressors of the training run only (e.g. ddp:safebits@0.3 at PowerSGD's bytes)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: first rate only, 1 warm-up and 2 timed steps, ResNet-18 unless --models "
                             "says otherwise, "
                             + ", ".join(QUICK_COMPRESSORS + QUICK_DDP_COMPRESSORS))
    parser.add_argument("--phases", nargs="+", default=None, metavar="RATE:STEPS",
                        help="the changing-link run instead of --rates: every compressor trains the phases' steps "
                             "in one case while the link changes under it (e.g. unlimited:40 100mbit:40 1gbit:40)")
    parser.add_argument("--from-json", default=None, metavar="LINK_JSON",
                        help="measure nothing: print the tables of an earlier launch's link.json again, derived "
                             "afresh from its raw cases (figures this version adds, such as the intervals, too)")
    parser.add_argument("--no-pin", action="store_true",
                        help="leave Horovod's ranks unbound (by default each binds itself to its own cores, as "
                             "mpirun binds ranks: bench.protocol.pin_rank; DDP's are never bound)")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "results"))
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per horovodrun launch")
    args = parser.parse_args(None if argv is None else list(argv))
    args.out_dir = os.path.abspath(args.out_dir)     # the workers run in the repository root
    if args.models is None:
        args.models = ["resnet18"] if args.quick else list(DEFAULT_MODELS)
    args.models = list(dict.fromkeys(args.models))
    if args.quick:
        args.rates, args.warmup, args.steps = args.rates[:1], 1, 2
        args.compressors = QUICK_COMPRESSORS
        args.ddp_compressors, args.quality_steps = QUICK_DDP_COMPRESSORS, 0
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0 or args.quality_steps < 0:
        parser.error("--steps and --rounds must be >= 1, --warmup and --quality-steps >= 0")
    if min(args.cnn_batch, args.lm_batch, args.gpt_batch, args.image_size) < 1:
        parser.error("--cnn-batch, --lm-batch, --gpt-batch and --image-size must be >= 1")
    if args.phases is not None:
        try:
            args.phases = [link_phases.parse_phase(text) for text in args.phases]
            for rate, _ in args.phases:
                parse_rate(rate)
        except ValueError as exc:
            parser.error(str(exc))
    for texts, ddp in ((args.compressors, False), (args.ddp_compressors + args.quality_extra, True)):
        for text in texts:
            try:
                spec = specs.parse(text)
            except ValueError as exc:
                parser.error(str(exc))
            if spec.ddp != ddp:
                parser.error(f"{text!r}: --compressors takes Horovod specs, --ddp-compressors and --quality-extra "
                             f"ddp: ones")
    return args


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        with open(args.from_json, encoding="utf-8") as f:
            print(report_tables(summarize(json.load(f)["raw"])))
        return 0
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        print(f"[link] {' and '.join(missing)} not found: install the Debian package iproute2 "
              f"(apt-get install iproute2); skipping the link benchmark.")
        return 0
    ns = f"sblink-{os.getpid()}"
    made = _run(["ip", "netns", "add", ns], check=False)
    if made.returncode != 0:
        print(f"[link] cannot create a network namespace ({made.stderr.strip() or 'ip netns add failed'}): the link "
              f"benchmark needs root with CAP_NET_ADMIN (ip netns, tc); skipping it.")
        return 0

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return _bench(args, ns) if args.phases is None else _changing_link(args, ns)
    except KeyboardInterrupt:
        print("[link] interrupted", file=sys.stderr)
        return 130
    finally:
        delete_namespace(ns)
        signal.signal(signal.SIGTERM, previous)


def launch_env(args: argparse.Namespace, horovod: bool) -> dict[str, str]:
    """The ranks' environment: one thread each (two ranks share two cores: more threads slow every compressor).
    Horovod's ranks bind themselves to their own cores unless ``--no-pin``, as ``mpirun`` binds ranks; torchrun's
    are left unbound, as torchrun leaves them: bound, Horovod's steps ran faster and evener, DDP's ResNet-18 steps
    slower (docs/RESULTS.md 4.2, "Ranks bound to cores")."""
    return {"OMP_NUM_THREADS": "1", PIN_ENV: "1" if horovod and not args.no_pin else "0"}


def binding(args: argparse.Namespace) -> dict[str, bool]:
    """Whether each front end's ranks were bound to their own cores (:func:`launch_env`)."""
    return {"horovod": launch_env(args, True)[PIN_ENV] == "1", "ddp": launch_env(args, False)[PIN_ENV] == "1"}


def binding_text(args: argparse.Namespace) -> str:
    bound = binding(args)
    return "; ".join(f"{name} ranks {'bound to their own cores' if bound[key] else 'unbound'}"
                     for key, name in (("horovod", "Horovod"), ("ddp", "DDP")))


def _bench(args: argparse.Namespace, ns: str) -> int:
    from safebits_hvd.launch import LaunchError, horovodrun, torchrun

    os.makedirs(args.out_dir, exist_ok=True)
    command = " ".join(["python -m bench.link", *sys.argv[1:]])
    runs: dict[str, list[dict[str, Any]]] = {}
    meta: dict[str, dict[str, Any]] = {}
    failed = []
    start = time.perf_counter()
    for rate in args.rates:
        bps = parse_rate(rate)
        qdisc = configure_link(ns, bps)
        print(f"[link] rate {rate}: {qdisc}", flush=True)
        raw_path = os.path.join(args.out_dir, f".link_raw_{rate}.json")
        if os.path.exists(raw_path):
            os.remove(raw_path)
        t0, load_before = time.perf_counter(), os.getloadavg()
        try:
            raw: dict[str, Any] = {"cases": []}
            if args.compressors:
                horovodrun(2, *HVD_WORKER, "link", *worker_args(args, raw_path), prefix=in_namespace(ns),
                           env=launch_env(args, horovod=True), timeout=args.timeout, on_line=_progress)
                raw = read_raw(raw_path)
            if args.ddp_compressors and ddp_models(args):
                torchrun(2, *DDP_WORKER, *ddp_worker_args(args, raw_path), prefix=in_namespace(ns),
                         env=launch_env(args, horovod=False), timeout=args.timeout, on_line=_progress)
                raw["cases"] += read_raw(raw_path)["cases"]
        except LaunchError as exc:
            print(f"[link] rate {rate} failed: {exc}", file=sys.stderr)
            failed.append(rate)
            continue
        runs[rate] = raw.pop("cases")
        meta[rate] = {"rate_bps": bps, "burst_bytes": None if bps is None else burst_bytes(bps), "qdisc": qdisc,
                      "qdisc_stats": qdisc_stats(ns), "wall_s": time.perf_counter() - t0,
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg(), **raw}
    quality: list[dict[str, Any]] = []
    if args.quality_steps and args.ddp_compressors:
        configure_link(ns, None)
        raw_path = os.path.join(args.out_dir, ".link_raw_quality.json")
        try:
            torchrun(2, *DDP_WORKER, *ddp_worker_args(args, raw_path, quality=True), prefix=in_namespace(ns),
                     env=launch_env(args, horovod=False), timeout=args.timeout, on_line=_progress)
            quality = read_raw(raw_path)["cases"]
        except LaunchError as exc:
            print(f"[link] training run failed: {exc}", file=sys.stderr)
            failed.append("quality")
    if not runs and not quality:
        return 1
    rows = summarize(runs)
    models = model_facts(rows)
    md = report_tables(rows)
    total = time.perf_counter() - start
    with open(os.path.join(args.out_dir, "link.json"), "w", encoding="utf-8") as f:
        json.dump({"command": command, "rates": list(runs), "models": models, "compressors": args.compressors,
                   "ddp_compressors": args.ddp_compressors, "ddp_models": ddp_models(args),
                   "image_size": args.image_size, "batch_per_rank": {"resnet18": args.cnn_batch,
                                                                     "bytes_lm": args.lm_batch,
                                                                     "gpt2_small": args.gpt_batch},
                   "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
                   "interleave": args.interleave, "bound": binding(args), "launches": meta,
                   "rows": rows, "raw": runs,
                   "failed_rates": failed, "total_s": total, "quality_steps": args.quality_steps,
                   "quality": quality}, f, indent=1)
    with open(os.path.join(args.out_dir, "link.md"), "w", encoding="utf-8") as f:
        f.write(f"# Link benchmark\n\nCommand: `{command}`; 2 ranks (Gloo; Horovod rows under horovodrun, "
                f"ddp: rows under torchrun) in a network namespace whose loopback is limited by tbf; "
                f"{args.warmup} warm-up + {args.steps} timed steps per case, {args.rounds} round(s) of every "
                f"compressor {'side by side, their timed steps alternating' if args.interleave else 'in turn'} "
                f"per launch; {binding_text(args)}; total "
                f"{total:.0f} s.\n\n" + probe_line(meta) + "\n\n" + md
                + (f"\n### DDP training run ({args.quality_steps} steps, unlimited link)\n\n" + quality_table(quality)
                   if quality else ""))
    if rows:
        plot(rows, os.path.join(args.out_dir, "link_throughput.png"))
    print(md)
    if quality:
        print(quality_table(quality))
    print(probe_line(meta))
    print(f"[link] wrote link.json, link.md and link_throughput.png in {args.out_dir}; total {total:.0f} s",
          flush=True)
    return 1 if failed else 0


def _changing_link(args: argparse.Namespace, ns: str) -> int:
    """The changing-link run (:mod:`bench.link_phases`): one launch per front end, every compressor one case of
    all the phases' steps, the qdisc changed from here as rank 0 reports its steps."""
    from safebits_hvd.launch import LaunchError, horovodrun, torchrun

    os.makedirs(args.out_dir, exist_ok=True)
    command = " ".join(["python -m bench.link", *sys.argv[1:]])
    phases = args.phases
    args.steps = sum(steps for _, steps in phases)
    step_file = os.path.join(args.out_dir, ".link_step")
    cases: list[dict[str, Any]] = []
    changes: list[tuple[int, int, int, float]] = []
    launches: list[tuple[Any, tuple[str, ...], Any]] = []       # (launcher, worker module, its arguments for a path)
    if args.compressors:
        launches.append((horovodrun, (*HVD_WORKER, "link"), lambda out: worker_args(args, out)))
    if args.ddp_compressors and ddp_models(args):
        launches.append((torchrun, DDP_WORKER, lambda out: ddp_worker_args(args, out)))
    start = time.perf_counter()
    for index, (runner, module, arguments) in enumerate(launches):
        raw_path = os.path.join(args.out_dir, f".link_phases_raw_{index}.json")
        for path in (raw_path, step_file):
            if os.path.exists(path):
                os.remove(path)
        configure_link(ns, parse_rate(phases[0][0]))
        changer = link_phases.LinkChanger(step_file, phases, lambda rate: configure_link(ns, parse_rate(rate)))
        changer.start()
        try:
            runner(2, *module, *arguments(raw_path), "--step-file", step_file,
                   prefix=in_namespace(ns), env=launch_env(args, horovod=runner is horovodrun), timeout=args.timeout,
                   on_line=_progress)
        except LaunchError as exc:
            print(f"[link] changing-link launch failed: {exc}", file=sys.stderr)
            return 1
        finally:
            changer.stop()
        cases += read_raw(raw_path)["cases"]
        changes += changer.changes
    summary = link_phases.summarize(cases, phases)
    md = link_phases.table(summary, phases)
    total = time.perf_counter() - start
    with open(os.path.join(args.out_dir, "link_phases.json"), "w", encoding="utf-8") as f:
        json.dump({"command": command, "phases": phases, "summary": summary, "changes": changes, "raw": cases,
                   "bound": binding(args), "total_s": total}, f, indent=1)
    with open(os.path.join(args.out_dir, "link_phases.md"), "w", encoding="utf-8") as f:
        f.write(f"# Changing link\n\nCommand: `{command}`; {binding_text(args)}; {total:.0f} s.\n\n" + md)
    link_phases.plot(summary, phases, os.path.join(args.out_dir, "link_phases.png"))
    print(md)
    print(f"[link] wrote link_phases.json, link_phases.md and link_phases.png in {args.out_dir}; total {total:.0f} s",
          flush=True)
    return 0


def read_raw(path: str) -> dict[str, Any]:
    """A worker's raw JSON (then removed, so a later launch cannot be mistaken for it)."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    os.remove(path)
    return raw


def probe_line(meta: dict[str, dict[str, Any]]) -> str:
    """One sentence: per rate, the rate the link probe (plain fp32 allreduces) achieved on the loopback."""
    parts = []
    for rate, info in meta.items():
        probe = info.get("probe") or {}
        bps = probe.get("achieved_bits_per_s")
        if bps:
            parts.append(f"{rate}: {bps / 1e9:.2f} Gbit/s ({statistics.median(probe['times_s']):.3f} s for "
                         f"{statistics.median(probe['link_bytes']) / 1e6:.1f} MB)")
    return ("Link probe (fp32 allreduce of " + f"{next(iter(meta.values()))['probe']['elements']:,}" +
            " values, no model; loopback bytes / median time): " + "; ".join(parts) + ".") if parts else ""


def _progress(line: str) -> None:
    if "[link]" in line or "Error" in line or "Traceback" in line:
        print(line.split("<stdout>:", 1)[-1].split("<stderr>:", 1)[-1], flush=True)


if __name__ == "__main__":
    sys.exit(main())
