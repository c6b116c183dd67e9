"""The link benchmark's measurement protocol, one for both front ends (``bench.hvd_worker link`` and
``bench.ddp_worker``).

One case = one (model, compressor): build the model from :data:`SEED`, wrap it, run ``warmup`` untimed steps, a
barrier, then ``steps`` timed steps and a barrier. Recorded: the wall time of every step, the bytes that crossed the
namespace's loopback during the timed steps (``/sys/class/net/lo/statistics/tx_bytes`` before and after; both ranks
talk over that one ``lo``, so the delta covers both ranks' traffic, TCP/IP headers and the framework's own
coordination included), the bytes the compressor says it put on the wire (``StepRecord.wire_bytes``, summed over
steps and ranks) and the modeled bits per rank and step (``StepRecord.modeled_bits_total``; for compressors without
a record, their fixed width times the parameters).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

TX_BYTES = "/sys/class/net/lo/statistics/tx_bytes"
SEED = 0


def read_tx_bytes() -> int:
    """Bytes sent over the loopback so far (the namespace's own ``lo`` inside the link benchmark)."""
    with open(TX_BYTES, encoding="ascii") as f:
        return int(f.read())


def measure(step: Callable[[], None], barrier: Callable[[], None], history: Callable[[], list[Any] | None],
            fixed_bits: float | None, warmup: int, steps: int,
            on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run one case's steps under the protocol; the raw figures (meaningful on rank 0, the loopback's reader).

    Args:
        step: one training step (zero_grad, forward, backward, optimizer step).
        barrier: a collective every rank joins.
        history: the compressor's ``history`` (``StepRecord`` objects), or None when it keeps none; read once,
            after the timed steps: reading a record waits for its step's statistics exchange, which otherwise runs
            during the next step's optimizer step and forward pass, so reading it after every step would take
            that wait out of the timed steps.
        fixed_bits: bits per rank and step of a compressor without records (32 or 16 per parameter, PowerSGD's
            factors); ignored when ``history`` returns records.
        warmup, steps: untimed and timed steps.
        on_step: called with -1 before the warm-up and with ``i`` before timed step ``i`` (the changing-link run
            tells the driver outside the ranks where the case is, through a file).

    Returns ``step_times_s``, ``elapsed_s``, ``link_bytes``, ``wire_bytes`` (this rank's, summed over steps; None
    without records), ``modeled_bits_per_rank`` and ``budget_bits_per_rank`` (per step; the budget is what
    ``budget_bits="auto"`` chose), ``pass_through`` (per step), ``timing`` (per step, the telemetry SafeBits measured
    of it, ``StepRecord.timing``, reduced over ranks; None where none arrived), ``collective`` and ``violations``.
    """
    tell = on_step or (lambda i: None)
    tell(-1)
    for _ in range(warmup):
        step()
    barrier()
    tx0 = read_tx_bytes()
    start = time.perf_counter()
    step_times: list[float] = []
    for i in range(steps):
        tell(i)
        t0 = time.perf_counter()
        step()
        step_times.append(time.perf_counter() - t0)
    barrier()
    elapsed = time.perf_counter() - start
    tx1 = read_tx_bytes()
    records = history()
    recorded = records is not None
    timed = records[-steps:] if records is not None and steps else []
    if recorded and len(timed) != steps:
        raise RuntimeError(f"{len(timed)} step records for {steps} timed steps: raise the compressor's max_history")
    return {"step_times_s": step_times, "elapsed_s": elapsed, "link_bytes": tx1 - tx0,
            "wire_bytes": sum(float(r.wire_bytes) for r in timed) if recorded and steps else None,
            "modeled_bits_per_rank": ([float(r.modeled_bits_total) for r in timed] if recorded
                                      else [float(fixed_bits or 0.0)] * steps),
            "budget_bits_per_rank": [float(r.budget_bits_total) for r in timed] if recorded else [None] * steps,
            "pass_through": [bool(r.pass_through) for r in timed] if recorded else [False] * steps,
            "timing": ([{k: v if math.isfinite(v) else None for k, v in r.timing.items()} if r.timing else None
                        for r in timed] if recorded else None),            # each record's own step's
            "collective": next((r.collective for r in reversed(timed) if r.collective), None),
            "violations": sum(int(bool(r.violation)) for r in timed)}


def case_result(model: str, compressor: str, facts: dict[str, Any], workload_facts: dict[str, Any], batch: int,
                ranks: int, warmup: int, steps: int, measured: dict[str, Any],
                wire_bytes_total: float | None) -> dict[str, Any]:
    """One case's JSON record, the same fields for both front ends (``bench.link`` reads them)."""
    return {
        "model": model, "compressor": compressor, **facts, **workload_facts, "batch_per_rank": batch,
        "ranks": ranks, "warmup": warmup, "steps": steps, "step_times_s": measured["step_times_s"],
        "elapsed_s": measured["elapsed_s"], "link_bytes": measured["link_bytes"],
        "wire_bytes_total": wire_bytes_total,
        # Every rank's record is identical (reduced across ranks): the total is ranks x one rank's.
        "modeled_bytes_per_step": ranks * statistics.fmean(measured["modeled_bits_per_rank"]) / 8,
        "modeled_bits_per_rank": measured["modeled_bits_per_rank"],
        "budget_bits_per_rank": measured["budget_bits_per_rank"], "pass_through": measured["pass_through"],
        "timing": measured["timing"],
        "collective": measured["collective"], "violations": measured["violations"],
    }


def step_reporter(path: str | None, case_id: int, rank: int) -> Callable[[int], None] | None:
    """``on_step`` for :func:`measure`: rank 0 writes ``"<case_id> <step>"`` to ``path`` before every step (written
    whole, then renamed, so a reader never sees half a line); None without a path."""
    if path is None or rank != 0:
        return None

    def report(step: int) -> None:
        partial = f"{path}.partial"
        with open(partial, "w", encoding="ascii") as f:
            f.write(f"{case_id} {step}\n")
        os.replace(partial, path)

    return report


def case_line(model: str, label: str, result: dict[str, Any]) -> str:
    """The progress line a worker prints after a case."""
    median = statistics.median(result["step_times_s"])
    rate = result["ranks"] * result["batch_per_rank"] * result["unit_per_sample"] / median
    return (f"[link] {model:10s} {label:17s} step {median * 1e3:8.1f} ms  {rate:9.2f} {result['unit']}/s  "
            f"link {result['link_bytes'] / result['steps'] / 1e6:8.2f} MB/step  "
            f"modeled {result['modeled_bytes_per_step'] / 1e6:8.2f} MB/step")
