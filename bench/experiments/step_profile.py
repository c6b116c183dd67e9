"""Where the time of one SafeBits step goes, on a model's gradients in one process (docs/RESULTS.md, section 5.4).

The step of ``bench/suites/bench_step.py`` (every gradient through ``compress``, then ``decompress``, allgather path,
4.4 bits) on the parameter shapes of ``--model`` (``bench.suites.model_shapes``), on the device of
``SAFEBITS_BENCH_DEVICE`` (``cpu`` or ``cuda``): after three warm steps, one timed step, then the Python functions
of ``--steps`` steps by their own time (``cProfile``) and, on CUDA, the kernels of one step by their device time
(``torch.profiler``).

``--times``: no profile; the median of 7 steps (after 3 warm) of ResNet-18's and GPT-2 small's gradients, of 1,000
tensors of 16 elements, and of a pass-through step of 1,000 tensors of 272, as one JSON line. Run by path from
another checkout's root (``PYTHONPATH=.``), it times that checkout's package: how section 5.4 compared commits on
one machine.

Usage: ``SAFEBITS_BENCH_DEVICE=cuda python -m bench.experiments.step_profile [--model resnet18] [--steps 3]
[--times LABEL]``
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

from bench.suites import bench_step, model_shapes


def model_sizes(model: str) -> list[int]:
    """The elements of each parameter of ``model`` (``bench.suites.model_shapes``, as old checkouts have it too)."""
    return [model_shapes.numel(shape) for _, shape in model_shapes.MODELS[model]()]


def median_step_ms(sizes: list[int], collective: str, budget_bits: float) -> float:
    """The median of 7 steps, after 3 warm ones, in milliseconds."""
    _, step, _ = bench_step.make_step(sizes, collective, budget_bits)
    for _ in range(3):
        step()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 1)


def step_times() -> dict[str, float]:
    """``--times``: the steps section 5.4 compares across commits."""
    times = {model: median_step_ms(model_sizes(model), "allgather", 4.4) for model in ("resnet18", "gpt2_small")}
    times["pass_through_1000x272"] = median_step_ms([272] * 1000, "dense", 32.0)
    times["step_1000x16"] = median_step_ms([16] * 1000, "allgather", 4.4)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18", choices=sorted(model_shapes.MODELS))
    parser.add_argument("--steps", type=int, default=3, help="steps under cProfile")
    parser.add_argument("--rows", type=int, default=25, help="rows of each table")
    parser.add_argument("--times", metavar="LABEL", default=None, help="print step times only, labelled")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.times is not None:
        print(args.times, json.dumps(step_times()), flush=True)
        return
    sizes = model_sizes(args.model)
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
