"""What a few compressed steps cost ``make demo``'s byte LM, by when they come (docs/RESULTS.md 2.1b).

``budget_bits="auto"`` passes the byte LM through on localhost but probes 2 bits for two or three steps now and then,
the first probe right after its first four steps. Here the same task (160 steps, seeds 0-2, through
``bench.hvd_worker.run_one``, as ``make demo`` trains it) runs with fixed schedules: passing through every step, and
passing through except 2 bits at steps 4-6, at steps 40-42, or at all three of steps 4-6, 40-42 and 100-102. Rank 0
prints the final validation bits per byte of each seed and their mean.

Usage: ``OMP_NUM_THREADS=1 horovodrun -np 2 --gloo .venv/bin/python -m bench.experiments.early_probe_quality``.
"""

from __future__ import annotations

from collections.abc import Callable

import horovod.torch as hvd

from bench.hvd_worker import run_one
from bench.tasks import make_task

PROBES: dict[str, tuple[range, ...]] = {
    "passing through": (),
    "2 bits at steps 4-6": (range(4, 7),),
    "2 bits at steps 40-42": (range(40, 43),),
    "2 bits at steps 4-6, 40-42, 100-102": (range(4, 7), range(40, 43), range(100, 103)),
}


def schedule(probes: tuple[range, ...]) -> Callable[[int], float]:
    """32 bits (passing through) but 2 at the probes' steps."""
    return lambda step: 2.0 if any(step in probe for probe in probes) else 32.0


def main() -> None:
    hvd.init()
    task = make_task("bytes_lm", steps=160)
    run_id = 0
    for name, probes in PROBES.items():
        metrics = []
        for seed in (0, 1, 2):
            run_id += 1
            metrics.append(run_one(task, "safebits", schedule(probes), seed, run_id)["final_metric"])
        if hvd.rank() == 0:
            print(f"{name}: bits per byte {', '.join(f'{m:.4f}' for m in metrics)}; mean {sum(metrics) / 3:.4f}")


if __name__ == "__main__":
    main()
