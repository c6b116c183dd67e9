"""Horovod worker of ``bench/suites/bench_horovod.py``: SafeBits' per-step overhead and its statistics exchange.

Run as ``horovodrun -np 2 --gloo python -m bench.suites.horovod_overhead --parts step,exchange --out result.json``.

* ``step``: two identical models of several million parameters in tens of tensors, one trained through
  ``hvd.DistributedOptimizer(compression=SafeBits(...))``, the other through ``compression=hvd.Compression.none``;
  their training steps (forward, backward, allreduce, update) alternate, and the figure is the ratio of the median
  step times. The models are MLPs of ``--layers`` square layers, or with ``--model`` one of the link benchmark's
  (``resnet18``, ``gpt2_small``; ``--batch`` per rank): with ``--budget-bits 32``, SafeBits passing through against
  ``Compression.none`` step by step, free of the drift between the cases of a ``bench.link`` launch. With
  ``--against fixed`` the first is ``budget_bits="auto"`` held at ``--budget-bits``
  (``sb.Auto(min_bits=B, max_bits=B)``: its rule runs every step on the telemetry the statistics exchange carries,
  its choice cannot move) and the second SafeBits at that budget fixed: the ratio is what ``auto``'s telemetry
  costs (docs/RESULTS.md 4.3).
* ``exchange``: SafeBits over 1,000 tensors; per step, the time of starting the statistics exchange, finishing it
  (the MAX allreduce and the step record) and computing the next allocation. Per step the smallest figure over
  ranks is kept: the rank that arrives last at the exchange waits for nobody, so its time is the exchange's own
  cost, not the other ranks' lag. For scale, the same figure for a bare Horovod allreduce of a vector as long.

Rank 0 writes one JSON object to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch
from torch import nn

import safebits_hvd as sb
from bench.suites.step_timing import Loss, interleaved_times, make_model, mse_loss
from bench.tasks import Workload
from safebits_hvd.comm.exchange import TimedExchange, make_exchange


def same_batch_loss(workload: Workload, seed: int) -> Loss:
    """``workload``'s loss on one batch drawn from ``seed``, the same every step."""
    return lambda net: workload.loss(net, torch.Generator().manual_seed(seed))


def bench_step(width: int, layers: int, batch: int, steps: int, warmup: int, budget_bits: float,
               collective: str = "auto", against: str = "none", model: str = "mlp") -> dict[str, Any]:
    """Median step time with SafeBits and with ``hvd.Compression.none`` (``against="none"``), or with ``auto`` held
    at ``budget_bits`` and SafeBits at ``budget_bits`` fixed (``against="fixed"``), interleaved in one run.
    ``model``: ``"mlp"`` (``layers`` square layers of ``width``) or a :class:`~bench.tasks.Workload` name."""
    gen = torch.Generator().manual_seed(hvd.rank())
    workload = Workload(model, batch) if model != "mlp" else None

    def make() -> nn.Module:
        if workload is None:
            return make_model(width, layers)
        torch.manual_seed(0)
        return workload.model()

    loss = (mse_loss(torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen))
            if workload is None else same_batch_loss(workload, hvd.rank()))
    # "baseline" is hvd.Compression.none (against="none") or SafeBits at the budget fixed (against="fixed").
    models = {"safebits": make(), "baseline": make()}
    measured = sb.Auto(min_bits=budget_bits, max_bits=budget_bits) if against == "fixed" else budget_bits
    compression = sb.SafeBits(models["safebits"].named_parameters(), budget_bits=measured,
                              name="safebits.bench", collective=collective)
    baseline: Any = hvd.Compression.none
    if against == "fixed":
        baseline = sb.SafeBits(models["baseline"].named_parameters(), budget_bits=budget_bits, name="safebits.fixed",
                               collective=collective)
    optimizers = {}
    for label, net in models.items():
        named = [(f"{label}.{n}", p) for n, p in net.named_parameters()]
        base = torch.optim.SGD(net.parameters(), lr=1e-3)
        optimizers[label] = hvd.DistributedOptimizer(
            base, named_parameters=named, compression=compression if label == "safebits" else baseline)
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    times = interleaved_times(models, optimizers, loss, warmup, steps)
    medians = {label: statistics.median(t) for label, t in times.items()}
    # The step is as slow as its slowest rank.
    medians = {label: max(hvd.allgather_object(m, name=f"median.{label}")) for label, m in medians.items()}
    record = compression.last_step
    return {
        "model": model,
        "parameters": sum(p.numel() for p in models["safebits"].parameters()),
        "tensors": len(list(models["safebits"].parameters())),
        "batch_per_rank": batch, "steps": steps, "against": against,
        # against="fixed": "safebits" is auto held at the budget.
        "median_step_s_safebits": medians["safebits"], "median_step_s_baseline": medians["baseline"],
        "step_ratio": medians["safebits"] / medians["baseline"],
        "compression_ratio": record.modeled_compression_ratio if record else None,
        "transport": type(compression.exchange).__name__,
        "collective": record.collective if record else None,
        "wire_bytes_per_rank": record.wire_bytes if record else None,
    }


def bench_exchange(tensors: int, numel: int, steps: int, warmup: int) -> dict[str, Any]:
    """Per-step exchange plus allocation time of SafeBits over ``tensors`` tensors, timed through the public seams:
    the exchange wrapped in :class:`~safebits_hvd.comm.exchange.TimedExchange` (its start), ``flush()`` (the wait and
    the step's record) and ``core.allocation_seconds`` (the next allocation)."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.zeros(numel)) for _ in range(tensors)]
    timed = TimedExchange(make_exchange("safebits.exchange"))
    compression = sb.SafeBits([(f"t{i}", p) for i, p in enumerate(params)], budget_bits=4.0, exchange=timed)
    gen = torch.Generator().manual_seed(hvd.rank())
    # For scale, each step also times a bare Horovod MAX allreduce of a vector as long as the exchanged one: the
    # floor that Horovod's background cycle (HOROVOD_CYCLE_TIME, 1 ms by default) sets for any Horovod collective.
    bare = torch.zeros(compression.core.layout.length, dtype=torch.float64)
    bare_seconds, per_step = [], []
    for _ in range(warmup + steps + 1):
        for p in params:
            p.grad = torch.randn(numel, generator=gen)
        allocation_seconds = None
        for i, p in enumerate(params):
            compression.compress(p.grad)
            if i == 0:
                allocation_seconds = compression.core.allocation_seconds
        start = time.perf_counter()
        compression.flush()
        finish_seconds = time.perf_counter() - start
        per_step.append((allocation_seconds, timed.start_seconds[-1] + finish_seconds))
        start = time.perf_counter()
        hvd.synchronize(hvd.allreduce_async_(bare, op=hvd.Max, name="exchange.bare"))
        bare_seconds.append(time.perf_counter() - start)
    # Step s: start + finish of step s's exchange, and the allocation of step s + 1 computed from it.
    per_step = [per_step[s][1] + per_step[s + 1][0] for s in range(warmup, warmup + steps)]
    gathered = hvd.allgather_object((per_step, bare_seconds[warmup:warmup + steps]), name="exchange.seconds")
    last_arrival = [min(rank[0][s] for rank in gathered) for s in range(steps)]
    slowest = [max(rank[0][s] for rank in gathered) for s in range(steps)]
    bare_last_arrival = [min(rank[1][s] for rank in gathered) for s in range(steps)]
    return {
        "tensors": tensors, "numel_per_tensor": numel, "steps": steps,
        "exchange_allocation_ms_median": 1e3 * statistics.median(last_arrival),
        "exchange_allocation_ms_p90": 1e3 * float(np.percentile(last_arrival, 90)),
        "exchange_allocation_ms_slowest_rank_median": 1e3 * statistics.median(slowest),
        "bare_horovod_allreduce_ms_median": 1e3 * statistics.median(bare_last_arrival),
        "exchanged_values": len(bare),
        "transport": type(timed.inner).__name__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="step,exchange")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="mlp", choices=("mlp", *Workload.DDP_NAMES),
                        help="the step part's model: the MLP of --width and --layers, or a link-benchmark model")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--budget-bits", type=float, default=4.0)
    parser.add_argument("--collective", default="auto", help="SafeBits(collective=...) of the step part")
    parser.add_argument("--against", choices=("none", "fixed"), default="none",
                        help="the step part's baseline: Compression.none, or SafeBits at --budget-bits fixed "
                             "(then the measured model runs budget_bits='auto' held at that budget)")
    parser.add_argument("--exchange-tensors", type=int, default=1000)
    parser.add_argument("--exchange-numel", type=int, default=256)
    parser.add_argument("--exchange-steps", type=int, default=30)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    result: dict[str, Any] = {"size": hvd.size(), "mpi": hvd.mpi_enabled()}
    parts = args.parts.split(",")
    if "exchange" in parts:
        result["exchange"] = bench_exchange(args.exchange_tensors, args.exchange_numel, args.exchange_steps,
                                            warmup=3)
    if "step" in parts:
        result["step"] = bench_step(args.width, args.layers, args.batch, args.steps, warmup=3,
                                    budget_bits=args.budget_bits, collective=args.collective, against=args.against,
                                    model=args.model)
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
