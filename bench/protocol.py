"""The link benchmark's measurement protocol, one for both front ends (``bench.hvd_worker link`` and
``bench.ddp_worker``).

One case = one (model, compressor): build the model from :data:`SEED`, wrap it, run ``warmup`` untimed steps, a
barrier, then ``steps`` timed steps and a barrier; several cases may run side by side, their timed steps interleaved
(:func:`measure_cases`). Recorded: the wall time of every step, the bytes that crossed the namespace's loopback
during the case's timed steps (``/sys/class/net/lo/statistics/tx_bytes`` before and after each; both ranks talk
over that one ``lo``, so the delta covers both ranks' traffic, TCP/IP headers and the framework's own coordination
included), the bytes the compressor says it put on the wire (``StepRecord.wire_bytes``, summed over
steps and ranks) and the modeled bits per rank and step (``StepRecord.modeled_bits_total``; for compressors without
a record, their fixed width times the parameters).
"""

from __future__ import annotations

import gc
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

TX_BYTES = "/sys/class/net/lo/statistics/tx_bytes"
SEED = 0
PIN_ENV = "SAFEBITS_BENCH_PIN"
"""Set to 1 by ``bench.link`` for Horovod's ranks (unless ``--no-pin``): each binds itself to its own cores
(:func:`pin_rank`)."""


def pin_rank() -> list[int] | None:
    """Bind this process, and the threads it starts from now on (Horovod's background thread, Gloo's), to its local
    rank's share of the cores it may run on, as ``mpirun`` binds ranks to cores by default: unbound, two ranks on
    two cores migrate between them, and Horovod's steps run longer and more unevenly (docs/RESULTS.md 4.2, "Ranks
    bound to cores"). Only when :data:`PIN_ENV` is 1 and there are at least as many cores as local ranks;
    the local rank and count come from Horovod's or torchrun's environment. Returns the cores, or None."""
    if os.environ.get(PIN_ENV) != "1":
        return None
    local_rank = os.environ.get("HOROVOD_LOCAL_RANK", os.environ.get("LOCAL_RANK"))
    local_size = os.environ.get("HOROVOD_LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE"))
    cores = sorted(os.sched_getaffinity(0))
    if local_rank is None or local_size is None or len(cores) < int(local_size):
        return None
    rank, size = int(local_rank), int(local_size)
    mine = cores[rank * len(cores) // size:(rank + 1) * len(cores) // size]
    os.sched_setaffinity(0, mine)
    return mine


def read_tx_bytes() -> int:
    """Bytes sent over the loopback so far (the namespace's own ``lo`` inside the link benchmark)."""
    with open(TX_BYTES, encoding="ascii") as f:
        return int(f.read())


@dataclass
class Case:
    """What the protocol needs of one case: its training step, its compressor's records and its untimed steps."""

    step: Callable[[], None]
    """One training step (zero_grad, forward, backward, optimizer step)."""
    history: Callable[[], list[Any] | None]
    """The compressor's ``history`` (``StepRecord`` objects), or None when it keeps none."""
    fixed_bits: float | None
    """Bits per rank and step of a compressor without records (32 or 16 per parameter, PowerSGD's factors)."""
    warmup: int
    """Untimed steps before the timed ones."""


def measure_cases(cases: Sequence[Case], barrier: Callable[[], None], steps: int,
                  on_step: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Run cases under the protocol, their timed steps interleaved; per case its raw figures (meaningful on rank 0,
    the loopback's reader).

    Every case runs its warm-up, in turn; a barrier; then timed step ``i`` of every case, one case after another
    (in reversed order every other step, so no case always follows the same one), for ``i`` below ``steps``; a
    barrier. With several cases this measures them side by side: a shared machine's drift over the minutes of a
    launch falls on every case alike, step by step. A case's link bytes are the loopback's delta over its own steps.

    Args:
        cases: what to run (:class:`Case`).
        barrier: a collective every rank joins.
        steps: timed steps per case.
        on_step: called with -1 before the warm-up and with ``i`` before timed step ``i`` of the cases (the
            changing-link run tells the driver outside the ranks where the run is, through a file).

    The history is read once per case, after every timed step: reading a record waits for its step's statistics
    exchange, which otherwise runs during the next step's optimizer step and forward pass, so reading it after
    every step would take that wait out of the timed steps.

    Returns per case ``step_times_s``, ``elapsed_s`` (the timed steps' wall time, shared by interleaved cases),
    ``link_bytes``, ``wire_bytes`` (this rank's, summed over steps; None without records), ``modeled_bits_per_rank``
    and ``budget_bits_per_rank`` (per step; the budget is what ``budget_bits="auto"`` chose), ``pass_through`` (per
    step), ``timing`` (per step, the telemetry SafeBits measured of it, ``StepRecord.timing``, reduced over ranks;
    None where none arrived), ``collective`` and ``violations``.
    """
    tell = on_step or (lambda i: None)
    tell(-1)
    for case in cases:
        for _ in range(case.warmup):
            case.step()
    barrier()
    start = time.perf_counter()
    step_times: list[list[float]] = [[] for _ in cases]
    link_bytes = [0] * len(cases)
    for i in range(steps):
        tell(i)
        order = range(len(cases)) if i % 2 == 0 else reversed(range(len(cases)))
        for k in order:
            tx0, t0 = read_tx_bytes(), time.perf_counter()
            cases[k].step()
            step_times[k].append(time.perf_counter() - t0)
            link_bytes[k] += read_tx_bytes() - tx0
    barrier()
    elapsed = time.perf_counter() - start
    return [_figures(case.history(), case.fixed_bits, times, moved, elapsed)
            for case, times, moved in zip(cases, step_times, link_bytes, strict=True)]


def _figures(records: list[Any] | None, fixed_bits: float | None, step_times: list[float], link_bytes: int,
             elapsed: float) -> dict[str, Any]:
    """One case's raw figures from its timed steps and its compressor's records (the last ``len(step_times)``)."""
    steps = len(step_times)
    recorded = records is not None
    timed = records[-steps:] if records is not None and steps else []
    if recorded and len(timed) != steps:
        raise RuntimeError(f"{len(timed)} step records for {steps} timed steps: raise the compressor's max_history")
    return {"step_times_s": step_times, "elapsed_s": elapsed, "link_bytes": link_bytes,
            "wire_bytes": sum(float(r.wire_bytes) for r in timed) if recorded and steps else None,
            "modeled_bits_per_rank": ([float(r.modeled_bits_total) for r in timed] if recorded
                                      else [float(fixed_bits or 0.0)] * steps),
            "budget_bits_per_rank": [float(r.budget_bits_total) for r in timed] if recorded else [None] * steps,
            "pass_through": [bool(r.pass_through) for r in timed] if recorded else [False] * steps,
            "timing": [timing_json(r) for r in timed] if recorded else None,     # each record's own step's
            "collective": next((r.collective for r in reversed(timed) if r.collective), None),
            "violations": sum(int(bool(r.violation)) for r in timed)}


def timing_json(record: Any) -> dict[str, float | None] | None:
    """A ``StepRecord``'s ``timing`` (what SafeBits measured of its step ``timing_step``) for JSON: unknown figures
    null; None when the record carries none."""
    return {k: v if math.isfinite(v) else None for k, v in record.timing.items()} if record.timing else None


def run_model(model: str, compressors: Sequence[Any], rounds: int, interleave: bool, first_id: int,
              run_cases: Callable[[list[tuple[int, Any]]], list[dict[str, Any]]],
              report: bool) -> list[dict[str, Any]]:
    """A worker's cases of one model: ``rounds`` times every compressor (``bench.specs.Spec``), case ids from
    ``first_id``, each case alone in turn or (``interleave``) all of them side by side. ``run_cases`` runs a group
    of ``(case id, compressor)`` cases and returns their records; ``report``: print each case's line (rank 0)."""
    plan = list(enumerate(itertools.product(range(rounds), compressors), start=first_id))
    results: list[dict[str, Any]] = []
    for group in [plan] if interleave else [[one] for one in plan]:
        for (_, (round_index, spec)), result in zip(group, run_cases([(i, spec) for i, (_, spec) in group]),
                                                    strict=True):
            result["round"] = round_index
            results.append(result)
            if report:
                print(case_line(model, spec.text, result), flush=True)
        gc.collect()                  # the group's models, optimizers and compressors
    return results


def run_group(work: Any, cases: Sequence[tuple[int, Any, dict[str, Any], Case]], barrier: Callable[[], None],
              warmup: int, steps: int, on_step: Callable[[int], None] | None, ranks: int,
              sum_over_ranks: Callable[[float, int], float]) -> list[dict[str, Any]]:
    """Built cases of one workload (``bench.tasks.Workload``) under :func:`measure_cases`: each ``(case id,
    compressor spec, model facts, Case)``; their JSON records (:func:`case_result`; meaningful on rank 0). A case's
    wire bytes, this rank's, are summed over ranks by the front end's ``sum_over_ranks(bytes, case id)``."""
    measured = measure_cases([case for *_, case in cases], barrier, steps, on_step)
    results = []
    for (case_id, spec, facts, _), figures in zip(cases, measured, strict=True):
        wire = figures["wire_bytes"]
        results.append(case_result(work.name, spec.text, facts, work.facts(), work.batch, ranks, warmup, steps,
                                   figures, None if wire is None else sum_over_ranks(wire, case_id)))
    return results


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
    """``on_step`` for :func:`measure_cases`: rank 0 writes ``"<case_id> <step>"`` to ``path`` before every step
    (written whole, then renamed, so a reader never sees half a line); None without a path. Interleaved cases report
    as their group's first case."""
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
