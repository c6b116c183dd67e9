"""Where a Horovod training step's time goes, per compressor, on a rate-limited link (docs/RESULTS.md 3.3).

Two ranks under ``horovodrun --gloo`` in a network namespace whose loopback ``tc`` limits (:mod:`bench.netns`),
one thread each, bound to their own cores; the compressors' training steps interleaved in one launch, as
``bench.link --interleave`` runs them. Per compressor, the median over the timed steps (rank 0) of: forward;
backward, during which Horovod calls ``compress`` in each gradient's hook; the optimizer step, whose
``synchronize()`` calls ``decompress`` (waiting for the collectives) before the update; the whole step; the
seconds spent inside ``compress`` and inside ``decompress``, summed over the step's tensors (SafeBits rows only); and
the CPU time of the step on the training thread and on the rank's other threads (Horovod's background thread and its
Gloo threads). Each rank has one core, so where the two CPU columns add up to the step, the core was never idle:
the step is bound by CPU, not by the link.

Compressors: ``bench.specs`` names (``none``, ``fp16``, ``safebits@4.4`` ...); ``--fusion-bytes B ...`` adds a
SafeBits 4.4-bit row per size B (``fusion_bytes=B``; 0: each tensor alone), to compare fusion group sizes in one
launch.

Usage (root: it needs ``ip netns`` and ``tc``)::

    python -m bench.experiments.horovod_phases --rate 1gbit --model gpt2_small --compressors none fp16 safebits@4.4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

WORKER_FLAG = "--worker"
PHASES = ("forward", "backward", "optimizer step", "step", "in compress", "in decompress", "CPU, training thread",
          "CPU, other threads")


class Timed:
    """Seconds spent inside one method of every instance of a class, summed until :meth:`take`."""

    def __init__(self, cls: type, name: str) -> None:
        self.seconds = 0.0
        inner = getattr(cls, name)

        def timed(obj: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(obj, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(cls, name, timed)

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class RaceText:
    """The race's text task (:class:`bench.tasks.TextGPT`, its own batch) as a :class:`~bench.tasks.Workload`."""

    def __init__(self) -> None:
        from bench.race import STEPS
        from bench.race_worker import make_race_task

        self.task = make_race_task("gpt2_text", STEPS["gpt2_text"])

    def model(self) -> Any:
        return self.task.model()

    def optimizer(self, model: Any) -> Any:
        return self.task.optimizer(model)

    def loss(self, model: Any, gen: Any) -> Any:
        return self.task.batch_loss(model, gen)


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    import safebits_hvd as sb
    from bench import specs
    from bench.hvd_worker import build_compression
    from bench.protocol import SEED, pin_rank
    from bench.tasks import Workload
    from safebits_hvd.frontends.horovod import CoreCompressor

    torch.set_num_threads(1)
    pin_rank()
    hvd.init()
    compress, decompress = Timed(CoreCompressor, "compress"), Timed(CoreCompressor, "decompress")
    work = RaceText() if args.model == "gpt2_text" else Workload(args.model, args.batch)
    # (row label, fusion_bytes of a SafeBits 4.4-bit row, or None for a bench.specs compressor)
    rows = [*((name, None) for name in args.compressors),
            *((f"safebits@4.4 fusion {b}", b) for b in args.fusion_bytes)]
    cases: list[tuple[str, Callable[[], list[float]]]] = []
    for case_id, (row, fusion_bytes) in enumerate(rows):
        torch.manual_seed(SEED)
        model = work.model()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if fusion_bytes is not None:
            compression = sb.SafeBits(model.named_parameters(), budget_bits=4.4, name=f"phases.{case_id}",
                                      fusion_bytes=fusion_bytes)
        else:
            compression = build_compression(specs.parse(row), model, case_id)
        named = [(f"case{case_id}.{n}", p) for n, p in model.named_parameters()]
        opt = hvd.DistributedOptimizer(work.optimizer(model), named_parameters=named, compression=compression)
        gen = torch.Generator().manual_seed(SEED * 7919 + hvd.rank())

        def step(model: Any = model, opt: Any = opt, gen: Any = gen) -> list[float]:
            compress.take(), decompress.take()
            cpu0, thread0 = time.process_time(), time.thread_time()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = work.loss(model, gen)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            thread = time.thread_time() - thread0                # the process's CPU time counts every thread
            return [t1 - t0, t2 - t1, t3 - t2, t3 - t0, compress.take(), decompress.take(), thread,
                    time.process_time() - cpu0 - thread]

        cases.append((row, step))
    times: dict[str, list[list[float]]] = {row: [] for row, _ in cases}
    for i in range(args.warmup + args.steps):
        hvd.allreduce(torch.zeros(1), name=f"phases.barrier.{i}")
        for row, step in cases if i % 2 == 0 else reversed(cases):
            phases = step()
            if i >= args.warmup:
                times[row].append(phases)
    if hvd.rank() == 0:
        print(table(args, times), flush=True)


def table(args: argparse.Namespace, times: dict[str, list[list[float]]]) -> str:
    """The medians, in milliseconds, one row per compressor, and the mean step (what throughput goes by: a row that
    compresses now and then has slow steps that its median hides)."""
    batch = "the race's batch" if args.model == "gpt2_text" else f"batch {args.batch}"
    lines = [f"{args.model}, {batch} per rank, link {args.rate}, {args.steps} timed steps "
             f"(medians, ms, rank 0)", "", "| compressor | " + " | ".join(PHASES) + " | mean step |",
             "| --- |" + " --- |" * (len(PHASES) + 1)]
    for row, steps in times.items():
        columns = list(zip(*steps, strict=True))
        medians = [statistics.median(column) * 1e3 for column in columns]
        mean = statistics.fmean(columns[PHASES.index("step")]) * 1e3
        lines.append(f"| {row} | " + " | ".join(f"{m:.1f}" for m in [*medians, mean]) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="link rate (bench.netns.parse_rate's syntax) or 'unlimited'")
    parser.add_argument("--model", default="gpt2_small", help="a bench.tasks.Workload name, or gpt2_text: the "
                        "race's text task (bench.tasks.TextGPT, its own batch)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--compressors", nargs="*", default=["none", "fp16", "safebits@4.4"])
    parser.add_argument("--fusion-bytes", nargs="*", type=int, default=[])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def launch(prefix: list[str], argv: list[str], args: argparse.Namespace) -> None:
    from bench.protocol import PIN_ENV
    from safebits_hvd.frontends.launch import horovodrun

    horovodrun(2, "-m", "bench.experiments.horovod_phases", *argv, WORKER_FLAG, prefix=prefix,
               env={"OMP_NUM_THREADS": "1", PIN_ENV: "1"}, timeout=args.timeout,
               on_line=lambda line: print(line.split("<stdout>:", 1)[-1], flush=True) if "<stdout>" in line else None)


def main(argv: list[str] | None = None) -> int:
    from bench.netns import run_on_link

    return run_on_link("sbphases", argv, parse_args, worker, launch)


if __name__ == "__main__":
    sys.exit(main())
