"""The compressed path starts cold (``safebits_hvd.policy.auto.AUTO_COLD``, docs/RESULTS.md 4.3): per step, the wall
time, the backward, and the CPU time the kernel spent for the process (page faults: first touches of memory) around a
short compressed probe.

A run of ``bench.tasks.Workload`` (``resnet18`` or ``gpt2_small``) under Horovod on localhost passes through for
steps 0-5, sends 2 bits for steps 6-8 (the probe ``budget_bits="auto"`` makes) and passes through again to step 23.
Rank 0 prints, per step, its wall and backward milliseconds, its system and user CPU milliseconds and its minor page
faults (``resource.getrusage``), then the medians of the pass-through steps before and after the probe.

Usage: ``OMP_NUM_THREADS=1 horovodrun -np 2 --gloo .venv/bin/python -m bench.experiments.cold_compressed_steps
[--model resnet18|gpt2_small] [--batch 16]``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import horovod.torch as hvd
import torch

import safebits_hvd as sb
from bench.tasks import Workload

STEPS = 24
PROBE = range(6, 9)        # the compressed steps


def probe_schedule(step: int) -> float:
    return 2.0 if step in PROBE else 32.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=Workload.DDP_NAMES, default="resnet18")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    workload = Workload(args.model, args.batch)
    torch.manual_seed(0)
    model = workload.model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = sb.SafeBits(model.named_parameters(), budget_bits=probe_schedule)
    opt = hvd.DistributedOptimizer(workload.optimizer(model), named_parameters=model.named_parameters(),
                                   compression=compression)
    gen = torch.Generator().manual_seed(1 + hvd.rank())
    rows = []
    for _ in range(STEPS):
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        opt.zero_grad()
        loss = workload.loss(model, gen)
        backward_start = time.perf_counter()
        loss.backward()
        backward = time.perf_counter() - backward_start
        opt.step()
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        rows.append((wall, backward, after.ru_stime - before.ru_stime, after.ru_utime - before.ru_utime,
                     after.ru_minflt - before.ru_minflt))
    if hvd.rank() != 0:
        return
    print(f"{args.model}, batch {args.batch} per rank, 2 ranks; 2 bits at steps {PROBE.start}-{PROBE.stop - 1}")
    print("step  bits   wall ms  backward ms  system ms  user ms  minor faults")
    for step, (wall, backward, system, user, faults) in enumerate(rows):
        print(f"{step:4d} {probe_schedule(step):5g} {wall * 1e3:9.0f} {backward * 1e3:12.0f} {system * 1e3:10.0f} "
              f"{user * 1e3:8.0f} {faults:13d}")

    def median(column: int, steps: range) -> float:
        return statistics.median(rows[s][column] for s in steps) * 1e3

    for label, steps in (("passing through before the probe", range(2, PROBE.start)),
                         ("the probe", PROBE), ("passing through after it", range(PROBE.stop + 2, STEPS))):
        print(f"{label} (steps {steps.start}-{steps.stop - 1}): wall {median(0, steps):.0f} ms, "
              f"system {median(2, steps):.0f} ms, user {median(3, steps):.0f} ms a step (medians)")


if __name__ == "__main__":
    main()
