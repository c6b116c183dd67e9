"""Step time of one compressor on a 2.1M-parameter MLP under Horovod (docs/RESULTS.md 4.2): 100 steps of batch 64,
the mean of steps 20-99 printed by rank 0; with ``auto``, also its estimate of each candidate budget.

Usage: ``OMP_NUM_THREADS=1 horovodrun -np 2 --gloo .venv/bin/python -m bench.experiments.auto_mlp {none,32,3,auto}``.
"""

from __future__ import annotations

import sys
import time

import horovod.torch as hvd
import torch

import safebits_hvd as sb


def main() -> None:
    hvd.init()
    torch.manual_seed(0)
    which = sys.argv[1]
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    compression = hvd.Compression.none if which == "none" else sb.SafeBits(
        model.named_parameters(), budget_bits="auto" if which == "auto" else float(which))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), 0)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    start = 0.0
    for step in range(100):
        if step == 20:
            start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    per_step = (time.perf_counter() - start) / 80
    if hvd.rank() == 0:
        extra = ""
        if which == "auto":
            auto = compression.core.schedule
            extra = "  estimates (ms): " + ", ".join(
                f"{b:g}: {e * 1000:.0f}" for b in auto.candidates if (e := auto.estimate(b)) is not None)
        print(f"{which}: {per_step * 1000:.1f} ms per step{extra}")


if __name__ == "__main__":
    main()
