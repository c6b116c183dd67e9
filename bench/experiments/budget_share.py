"""How much of the budget SafeBits spends, and where the rest goes (docs/RESULTS.md, section 7.1).

For each budget of ``--budgets`` (default 3, 4.4, 6, 8, 12 and 16 bits per parameter), SafeBits with its defaults
(the default menu, screen and escalation reserve) compresses the gradients of ``--steps`` steps in one process, and
the table gives the averages over the steps after the first (the start policy's):

* ``spent``: ``modeled_bits_total / budget_bits_total`` (``StepRecord.budget_share``);
* ``reserve`` and ``guard``: the shares the escalation reserve and guard kept out of the plan
  (``StepRecord.reserve_bits``, ``guard_bits``);
* ``unfilled``: the share the plan left that the menu's costs could not fill;
* ``escalated``: the share that escalations added beyond the plan (spent = plan + escalated);
* the most-sent action of the largest tensor.

Data sets: ``synthetic`` (24 tensors of 1,000 to 200,000 elements, fresh Gaussian gradients every step: every
quantizer of the menu passes the screen), ``one_large`` (the same with one tensor of 1,000,000 elements and two of
500: 99.9% of the parameters in one tensor, so the share is set by the menu's costs alone), ``mostly_one`` (six
tensors, 84% in one), and the gradients of ``bench.tasks``' ``digits_cnn`` and
``bytes_lm`` while they train (seed 0, the demo's optimizer; SafeBits' decompressed sum is the gradient the optimizer
applies, as under Horovod on one rank).

Usage: ``.venv/bin/python -m bench.experiments.budget_share [--steps 60]
[--data synthetic one_large digits_cnn bytes_lm]
[--menu NAME ...] [--out results/budget_share.json]``; prints the markdown table.
"""

from __future__ import annotations

import argparse
import collections
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

import safebits_hvd as sb
from bench.output import write_json

BUDGETS = [3.0, 4.4, 6.0, 8.0, 12.0, 16.0]
SYNTHETIC_SIZES = {"synthetic": [1000 + (200_000 - 1000) * i // 23 for i in range(24)],
                   "one_large": [500, 500, 1_000_000], "mostly_one": [1000, 2000, 5000, 10_000, 20_000, 200_000]}


def synthetic(sizes: list[int], steps: int) -> tuple[list[tuple[str, torch.nn.Parameter]], Iterator[None]]:
    """Parameters of ``sizes`` elements and an iterator that gives them fresh Gaussian gradients each step."""
    gen = torch.Generator().manual_seed(0)
    params = [(f"t{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]

    def grads() -> Iterator[None]:
        for _ in range(steps):
            for i, (_, p) in enumerate(params):
                p.grad = torch.randn(p.shape, generator=gen) * (1.0 + i)
            yield

    return params, grads()


def demo_task(name: str, steps: int) -> tuple[list[tuple[str, torch.nn.Parameter]],
                                                 Callable[[], Iterator[None]]]:
    """A demo task's parameters and an iterator over its training steps (gradients computed, optimizer stepped
    after the caller has replaced them with SafeBits' sum)."""
    from bench import tasks as W

    task = W.make_task(name, steps)
    torch.manual_seed(0)
    model = task.model()
    opt = task.optimizer(model)
    gen = torch.Generator().manual_seed(0)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def grads() -> Iterator[None]:
        for _ in range(steps):
            opt.zero_grad()
            task.batch_loss(model, gen).backward()
            yield
            opt.step()

    return params, grads


def measure(data: str, budget: float, steps: int, menu: list[str] | None) -> dict[str, Any]:
    """One run of SafeBits at ``budget`` on ``data`` (``menu``: action names, None for the default menu); the
    averages of its records after step 0."""
    if data in SYNTHETIC_SIZES:
        params, stream = synthetic(SYNTHETIC_SIZES[data], steps)
    else:
        params, make_stream = demo_task(data, steps)
        stream = make_stream()
    compressor = sb.SafeBits(params, budget_bits=budget, max_history=steps,
                             menu=sb.make_menu(menu) if menu else sb.DEFAULT_MENU)
    for _ in stream:
        for _, p in reversed(params):                  # backward order
            sent, ctx = compressor.compress(p.grad)
            p.grad = compressor.decompress(sent, ctx)
    records = compressor.history[1:]
    largest = max(params, key=lambda item: item[1].numel())[0]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return {
        "data": data, "budget_bits": budget, "steps": steps, "largest": largest,
        "spent": mean([r.budget_share for r in records]),
        "reserve": mean([r.reserve_bits / r.budget_bits_total for r in records]),
        "guard": mean([r.guard_bits / r.budget_bits_total for r in records]),
        "unfilled": mean([(r.budget_bits_total - r.reserve_bits - r.guard_bits - r.planned_bits_total)
                          / r.budget_bits_total for r in records]),
        "escalated": mean([(r.modeled_bits_total - r.planned_bits_total) / r.budget_bits_total for r in records]),
        "violations": sum(r.violation for r in records),
        "largest_action": collections.Counter(r.actions[largest] for r in records).most_common(1)[0][0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--budgets", type=float, nargs="+", default=BUDGETS)
    parser.add_argument("--data", nargs="+", default=["synthetic", "one_large", "digits_cnn", "bytes_lm"])
    parser.add_argument("--menu", nargs="+", help="action names (default: the default menu)")
    parser.add_argument("--out", default="results/budget_share.json")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    rows = [measure(data, budget, args.steps, args.menu) for data in args.data for budget in args.budgets]
    print("| data | budget (bits/param) | spent | reserve | guard | unfilled | escalated | violations "
          "| largest tensor sent as |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['data']} | {r['budget_bits']:g} | {r['spent']:.1%} | {r['reserve']:.1%} | {r['guard']:.1%} "
              f"| {r['unfilled']:.1%} | {r['escalated']:+.1%} | {r['violations']} | {r['largest_action']} "
              f"({r['largest']}) |")
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
