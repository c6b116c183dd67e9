"""SafeBits' DDP hook against default DDP: the per-step overhead on a model of many small tensors.

Run as ``python -m torch.distributed.run --standalone --nproc_per_node 2 -m bench.suites.ddp_overhead --out r.json``
(Gloo, CPU; set ``OMP_NUM_THREADS=1`` with 2 ranks on 2 cores). Two identical MLPs of ``--layers`` square layers
(``2 * layers`` tensors; default 500 layers of width 16: 1,000 tensors, 136,000 parameters, the model of
``bench.suites.horovod_overhead --width 16 --layers 500``), one wrapped in DDP with SafeBits' hook
(``safebits_hvd.ddp.safebits_hook``), the other in plain DDP (its default allreduce); their training steps
alternate, and the figure is the ratio of the median step times (each the slowest rank's). With ``--against fixed``
the first runs ``budget_bits="auto"`` held at ``--budget-bits`` (``sb.Auto(min_bits=B, max_bits=B)``: its telemetry
exchange and rule run every step, its choice cannot move) and the second SafeBits' hook at that budget fixed: the
ratio is what ``auto``'s telemetry costs. Rank 0 writes one JSON object to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.suites.step_timing import interleaved_times, make_model, mse_loss
from safebits_hvd import Auto
from safebits_hvd import ddp as sbddp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--layers", type=int, default=500)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--budget-bits", type=float, default=4.4)
    parser.add_argument("--against", choices=("ddp", "fixed"), default="ddp",
                        help="the baseline: default DDP, or SafeBits' hook at --budget-bits fixed (then the measured "
                             "model runs budget_bits='auto' held at that budget)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    models = {label: nn.parallel.DistributedDataParallel(make_model(args.width, args.layers))
              for label in ("safebits", "ddp")}
    fixed = args.against == "fixed"
    budget: float | Auto = Auto(min_bits=args.budget_bits, max_bits=args.budget_bits) if fixed else args.budget_bits
    state = sbddp.SafeBitsState(models["safebits"].named_parameters(), budget_bits=budget, name="safebits.bench")
    models["safebits"].register_comm_hook(state, sbddp.safebits_hook)
    if fixed:
        baseline = sbddp.SafeBitsState(models["ddp"].named_parameters(), budget_bits=args.budget_bits,
                                       name="safebits.fixed")
        models["ddp"].register_comm_hook(baseline, sbddp.safebits_hook)
    optimizers = {label: torch.optim.SGD(m.parameters(), lr=1e-3) for label, m in models.items()}
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    times = interleaved_times(models, optimizers, mse_loss(x, y), args.warmup, args.steps)
    medians: dict[str, float] = {}
    for label, values in times.items():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, statistics.median(values))
        medians[label] = max(gathered)                                   # the step is its slowest rank's
    record = state.last_step
    if dist.get_rank() == 0:
        result = {"parameters": sum(p.numel() for p in models["ddp"].parameters()),
                  "tensors": len(list(models["ddp"].parameters())), "batch_per_rank": args.batch,
                  # against="fixed": "safebits" is auto held at the budget, "ddp" the hook at the budget fixed.
                  "against": args.against,
                  "steps": args.steps, "median_step_s_safebits": medians["safebits"],
                  "median_step_s_ddp": medians["ddp"], "step_ratio": medians["safebits"] / medians["ddp"],
                  "collective": record.collective if record else None,
                  "wire_bytes_per_rank": record.wire_bytes if record else None}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f)
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
