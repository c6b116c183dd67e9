"""Step times of ``make demo``'s byte LM under Horovod on localhost, by budget (docs/RESULTS.md 2.1b and 4.1): the
telemetry that ``tests/test_auto.py::latency_bound_timing`` and ``LM_WARMUP`` are fitted to.

The demo's task (``bench.tasks.make_task``: ``bytes_lm``, 160 steps, or with ``--task digits_cnn`` the CNN, 250
steps; seed 0) with one compressor: ``none``
(``hvd.Compression.none``), ``pass`` (SafeBits passing every step through: ``sb.Auto(min_bits=32)``), a fixed
budget in bits per parameter, or ``auto``. Rank 0 prints the median wall time of steps 10-159, and for SafeBits the
medians of its telemetry (``StepRecord.timing``), the spans of the first steps over the median, the largest and
smallest span over the median, and the budget of every step (run-length).

Usage: ``OMP_NUM_THREADS=1 horovodrun -np 2 --gloo .venv/bin/python -m bench.experiments.demo_lm_spans
{none,pass,2,4.4,8,auto} [--task digits_cnn]``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import horovod.torch as hvd
import torch

import safebits_hvd as sb
from bench.tasks import make_task

STEPS = {"bytes_lm": 160, "digits_cnn": 250}        # make demo's
STEADY = 10          # steps before this one are the warm-up, left out of the medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", help="none, pass, a budget in bits per parameter, or auto")
    parser.add_argument("--task", choices=sorted(STEPS), default="bytes_lm")
    args = parser.parse_args()
    hvd.init()
    which, steps = args.which, STEPS[args.task]
    task = make_task(args.task, steps=steps)
    torch.manual_seed(0)
    model = task.model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression: type[hvd.Compression.none] | sb.SafeBits = hvd.Compression.none
    if which != "none":
        budget = sb.Auto(min_bits=32.0) if which == "pass" else which if which == "auto" else float(which)
        compression = sb.SafeBits(model.named_parameters(), budget_bits=budget)
    opt = hvd.DistributedOptimizer(task.optimizer(model), named_parameters=model.named_parameters(),
                                   compression=compression)
    gen = torch.Generator().manual_seed(7919 * hvd.rank())
    walls: list[float] = []
    timings: list[dict[str, float]] = []
    bits: list[float] = []
    parameters = sum(p.numel() for p in model.parameters())
    for step in range(steps):
        start = time.perf_counter()
        task.set_lr(opt, step)
        opt.zero_grad()
        task.batch_loss(model, gen).backward()
        opt.step()
        walls.append(time.perf_counter() - start)
    if isinstance(compression, sb.SafeBits):      # read after the loop: reading one waits for its step's exchange
        for record in compression.history[-steps:]:
            timings.append(record.timing)         # the step's own (StepRecord.timing_step == record.step)
            bits.append(round(record.budget_bits_total / parameters, 1))
    if hvd.rank() != 0:
        return
    print(f"{which}: wall {statistics.median(walls[STEADY:]) * 1000:.1f} ms per step (median of steps {STEADY}-"
          f"{steps - 1})")
    if which == "none":
        return
    steady = [t for t in timings[STEADY:] if t]
    medians = {k: statistics.median(t[k] for t in steady) for k in ("span_s", "backward_s", "send_s", "exposed_s",
                                                                     "link_s")}
    print("  telemetry medians (ms): " + ", ".join(f"{k} {v * 1000:.1f}" for k, v in medians.items()))
    spans = [t["span_s"] / medians["span_s"] for t in steady]
    first = [t["span_s"] / medians["span_s"] for t in timings[0:4] if t]
    print(f"  spans over the median: steps 0-3 {', '.join(f'{x:.1f}' for x in first)}; "
          f"steady max {max(spans):.2f}, min {min(spans):.2f}")
    print("  budgets: " + " ".join(f"{b:g} x{len(list(g))}" for b, g in itertools.groupby(bits)))


if __name__ == "__main__":
    main()
