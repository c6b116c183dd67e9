"""The link benchmark's tables and plot (``bench.link``), from :func:`bench.link_stats.summarize`'s rows."""

from __future__ import annotations

import math
from typing import Any

from bench.link_stats import INTERVAL_LEVEL


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
