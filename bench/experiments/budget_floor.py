"""Which tensors keep a tight budget infeasible: the cost of what each tensor sent on the steps where no admitted
configuration fitted the budget (docs/RESULTS.md, sections 9.2 and 9.3).

Trains one demo task (``bench.tasks``' model, data, optimizer and learning-rate schedule) with SafeBits at
``--budget`` bits per parameter and the default thresholds, through ``hvd.DistributedOptimizer``: in one process,
or under ``horovodrun -np P`` as the demo runs it (there the screen's statistics are the MAX over ranks, so an
action is admitted only where every rank admits it). On an infeasible step the allocator falls back to each
tensor's cheapest admitted action, so the bits a tensor sent there are its floor under the screen. Rank 0 prints,
per tensor: its size, the mean bits per element it sent on infeasible steps, its share of the budget there, and
the actions it sent over the run.

``--extra NAME ...`` adds actions to the default menu, to see whether a gap in the menu is what sets the floor: any
name of ``safebits_hvd.codec.actions.ACTIONS`` not already in it (``int4_mse``, ``int2_nearest``, ...), or ``topkP``
for a top-k keeping P percent of each bucket (``topk2``). ``int2_mse`` and ``topk5`` joined the default menu after this
script found the gaps they fill (docs/RESULTS.md, sections 9.2 and 9.3).

Usage::

    .venv/bin/python -m bench.experiments.budget_floor --task digits_cnn --budget 2 --steps 250
    horovodrun -np 2 --gloo .venv/bin/python -m bench.experiments.budget_floor --task bytes_lm --budget 2 --extra topk2
"""

from __future__ import annotations

import argparse
import collections
import logging
import re

import horovod.torch as hvd
import torch

from bench.tasks import SCHEDULES, TASK_NAMES, make_task
from safebits_hvd import DEFAULT_MENU, SafeBits, make_menu
from safebits_hvd.codec.actions import ACTIONS, Action, topk


def extra_action(name: str) -> Action:
    """A built-in action by name, or ``topkP``: top-k keeping P percent of each bucket."""
    if name in ACTIONS:
        return ACTIONS[name]
    match = re.fullmatch(r"topk(\d+(?:\.\d+)?)", name)
    if match and 0.0 < float(match.group(1)) <= 100.0:
        return topk(float(match.group(1)) / 100.0)
    raise argparse.ArgumentTypeError(f"unknown action {name!r}: a name of {sorted(ACTIONS)} or topkP, 0 < P <= 100")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=TASK_NAMES, default="digits_cnn")
    parser.add_argument("--budget", type=float, default=2.0, help="bits per parameter")
    parser.add_argument("--steps", type=int, default=None, help="default: the demo's (250 CNN, 160 LM)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr-schedule", choices=SCHEDULES, default=SCHEDULES[0], help="default: the demo's")
    parser.add_argument("--extra", type=extra_action, nargs="*", default=[], metavar="NAME",
                        help="actions added to the default menu (ACTIONS names, or topkP)")
    args = parser.parse_args()
    steps = args.steps if args.steps is not None else (250 if args.task == "digits_cnn" else 160)
    if steps < 1 or not args.budget > 0:
        parser.error("--steps must be >= 1 and --budget > 0")
    already = [a.name for a in args.extra if a.name in DEFAULT_MENU.names]
    if already:
        parser.error(f"--extra: {already} already in the default menu {DEFAULT_MENU.names}")

    torch.set_num_threads(1)
    logging.getLogger("safebits_hvd").setLevel(logging.ERROR)   # the violations are counted here
    hvd.init()
    task = make_task(args.task, steps, schedule=args.lr_schedule)
    torch.manual_seed(args.seed)
    model = task.model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    menu = make_menu([*DEFAULT_MENU, *args.extra])
    compression = SafeBits(model.named_parameters(), budget_bits=args.budget, menu=menu, seed=args.seed,
                           nonfinite="skip", name="safebits.budget_floor")
    optimizer = hvd.DistributedOptimizer(task.optimizer(model), named_parameters=model.named_parameters(),
                                         compression=compression)
    numels = {name: p.numel() for name, p in model.named_parameters()}
    total = sum(numels.values())
    cost = {action.name: action for action in compression.menu}
    floor_bits: collections.Counter[str] = collections.Counter()
    sent: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    violations = infeasible = modeled_bits = 0
    gen = torch.Generator().manual_seed(args.seed * 7919 + hvd.rank())
    for step in range(steps):
        task.set_lr(optimizer, step)
        optimizer.zero_grad()
        task.batch_loss(model, gen).backward()
        optimizer.step()
        record = compression.last_step
        assert record is not None
        violations += record.violation
        modeled_bits += record.modeled_bits_total
        for name, action in record.actions.items():
            sent[name][action] += 1
            if record.infeasible:
                floor_bits[name] += cost[action].cost(numels[name])
        infeasible += record.infeasible
    loss, value = task.evaluate(model)
    if hvd.rank() != 0:
        return
    print(f"{args.task}, {total:,} parameters, budget {args.budget:g} bits, {hvd.size()} rank(s), {steps} steps, "
          f"seed {args.seed}, menu {', '.join(a.name for a in compression.menu)}: {violations} steps over budget, "
          f"{infeasible} infeasible; modeled ratio {32 * total * steps / modeled_bits:.2f}x; final validation loss "
          f"{loss:.4f}, {task.metric_name} {value:.4f}\n")
    print("| tensor | elements | bits per element on infeasible steps | share of the budget there | actions sent |")
    print("| --- | --- | --- | --- | --- |")
    for name, n in numels.items():
        bits = floor_bits[name] / max(infeasible, 1) / n
        share = bits * n / (args.budget * total)
        actions = ", ".join(f"{a} {k}" for a, k in sent[name].most_common(3))
        print(f"| {name} | {n:,} | {bits:.2f} | {share:.3f} | {actions} |")


if __name__ == "__main__":
    main()
