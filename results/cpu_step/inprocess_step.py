"""The Horovod transformer's SafeBits step in one process, on real gradients (docs/RESULTS.md 3.3's model).

Ad hoc measurement kept for the closing note of issue 55: ``bench.tasks.GPT2``'s 148 gradients from three real
batches, every compress in backward's order then every decompress, allgather path as on 2 ranks
(``bench.suites.bench_step.MirrorTransport(2)``: the second rank's payloads decoded too), one compressor per
``bench.specs`` registry name at 4.4 bits; the compressors' steps interleaved, medians of 15 steps after 3 warm.
The gradients are copied into fixed tensors before each step (the copy is timed with the step; ``copy`` reports it).

Usage, from the repository root: ``OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python results/cpu_step/inprocess_step.py
[NAME ...] [--loop SECONDS]`` (default: the three of ``NAMES``); ``--loop``: then step the first name for that long, so
that ``perf record`` of the run shows where its step's time goes.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from bench import tasks
from bench.suites import bench_step
from safebits_hvd.frontends import baselines

NAMES = ("safebits", "safebits_maxscaled", "signsgd_ef")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", default=list(NAMES))
    parser.add_argument("--loop", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tasks.GPT2()
    gen = torch.Generator().manual_seed(0)
    gradient_sets = []
    for _ in range(3):
        model.zero_grad()
        tasks.next_token_loss(model, tasks.token_batch(4, gen)).backward()
        gradient_sets.append([p.grad.detach().clone().reshape(-1) for p in model.parameters()])
    sizes = [g.numel() for g in gradient_sets[0]]
    steps = {}
    for name in args.names:
        params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
        bits = 4.4 if name in baselines.BUDGETED else None
        compressor = baselines.REGISTRY[name](params, seed=0, budget_bits=bits,
                                              transport=bench_step.MirrorTransport(2))
        outs = [torch.empty(n) for n in sizes]
        counter = itertools.count()

        def step(params=params, compressor=compressor, outs=outs, count=counter) -> None:
            grads = gradient_sets[next(count) % 3]
            for (_, p), g, o in zip(params, grads, outs, strict=True):
                p.grad = o.copy_(g)
            pending = [compressor.compress(p.grad) for _, p in reversed(params)]
            for out, ctx in pending:
                compressor.decompress(out, ctx)

        steps[name] = step
    outs = [torch.empty(n) for n in sizes]
    steps["copy"] = lambda: [o.copy_(g) for o, g in zip(outs, gradient_sets[0], strict=True)]
    for step in steps.values():
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(15):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    for name, seconds in times.items():
        print(f"{name}: {1e3 * statistics.median(seconds):.1f} ms")
    end = time.perf_counter() + args.loop
    while time.perf_counter() < end:
        steps[args.names[0]]()


if __name__ == "__main__":
    main()
