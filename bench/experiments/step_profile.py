"""Where the time of one SafeBits step goes, on a model's gradients in one process (docs/RESULTS.md, section 5.4).

The step of ``bench/suites/bench_step.py`` (every gradient through ``compress``, then ``decompress``, allgather path,
4.4 bits) on the parameter shapes of ``--model`` (``bench.suites.model_shapes``), on the device of
``SAFEBITS_BENCH_DEVICE`` (``cpu`` or ``cuda``): after three warm steps, one timed step, then the Python functions
of ``--steps`` steps by their own time (``cProfile``) and, on CUDA, the kernels of one step by their device time
(``torch.profiler``).

Usage: ``SAFEBITS_BENCH_DEVICE=cuda python -m bench.experiments.step_profile [--model resnet18] [--steps 3]``
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from bench.suites import bench_step, model_shapes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18", choices=["resnet18", "resnet50", "gpt2_small"])
    parser.add_argument("--steps", type=int, default=3, help="steps under cProfile")
    parser.add_argument("--rows", type=int, default=25, help="rows of each table")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [model_shapes.numel(shape) for _, shape in getattr(model_shapes, args.model)()]
    _, step, _ = bench_step.make_step(sizes, "allgather", 4.4)
    for _ in range(3):
        step()                                          # warm: compiled kernels, residuals, samples
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    print(f"{args.model} on {bench_step.DEVICE}: {len(sizes)} tensors, one step {1e3 * seconds:.1f} ms")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        step()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.rows)
    if bench_step.DEVICE == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kernels:
            step()
        print(kernels.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
