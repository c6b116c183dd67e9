"""One rank of the time-to-quality race (``bench.race`` launches it inside its network namespace, under
``torchrun`` for the DDP rows and ``horovodrun`` for the Horovod rows). Not meant to be run by hand.

Every compressor of ``--compressors`` (:mod:`bench.specs`; one front end per launch) trains the task from the same
initial weights and the same data order (``--seed``) for ``--steps`` steps, one case after another. The clock runs
only around the training steps (forward, backward with its communication, optimizer step); every ``--eval-every``
steps, and after the last, the ranks meet at a barrier and evaluate the validation loss off the clock. Rank 0
writes, per case: the validation curve ``(step, training seconds, loss)``, the bytes the namespace's loopback
carried during the case, each step's training seconds, and for SafeBits the budget each step ran at (``auto``'s
choices) and what SafeBits measured of each step (``StepRecord.timing``, unknown figures null). Horovod's ranks bind
themselves to cores when ``bench.race`` asks (:func:`bench.protocol.pin_rank`), as ``bench.link``'s do.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from bench import specs
from bench.protocol import TX_BYTES, pin_rank, read_tx_bytes, timing_json
from bench.tasks import TextGPT, make_task, model_facts
from safebits_hvd.frontends.launch import exit_without_finalization

TASKS = ("gpt2_text", "digits_cnn", "bytes_lm")


def make_race_task(name: str, steps: int) -> Any:
    """The race's task ``name``: :class:`~bench.tasks.TextGPT`, or one of the demo's (:func:`make_task`)."""
    if name == "gpt2_text":
        return TextGPT(steps)
    if name in TASKS:
        return make_task(name, steps)
    raise ValueError(f"unknown race task {name!r}; known: {TASKS}")


class FrontEnd:
    """How a case's model is wrapped, and the barrier, for one front end (its process group already up)."""

    def __init__(self, ddp: bool) -> None:
        self.ddp = ddp
        if ddp:
            import torch.distributed as dist

            dist.init_process_group("gloo")
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
        else:
            import horovod.torch as hvd

            hvd.init()
            self.rank, self.size = hvd.rank(), hvd.size()

    def close(self) -> None:
        """Take the process group down; the rank then leaves without the interpreter's finalization
        (:func:`safebits_hvd.frontends.launch.exit_without_finalization`), in which Gloo's threads can abort
        (``terminate called without an active exception``) after the results are written.
        :func:`bench.race.finished_cases` keeps a launch's results whatever its exit status all the same."""
        if self.ddp:
            import torch.distributed as dist

            dist.destroy_process_group()

    def barrier(self, tag: str) -> None:
        if self.ddp:
            import torch.distributed as dist

            dist.all_reduce(torch.zeros(1))
        else:
            import horovod.torch as hvd

            hvd.allreduce(torch.zeros(1), name=f"race.barrier.{tag}")

    def wrap(self, spec: specs.Spec, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             case_id: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        """(what forward runs through, the optimizer to step, the SafeBits object or None)."""
        if self.ddp:
            from torch.nn.parallel import DistributedDataParallel

            from bench.ddp_worker import attach

            wrapped = DistributedDataParallel(model)
            state, _ = attach(spec, wrapped, model, case_id)
            return wrapped, optimizer, state
        import horovod.torch as hvd

        from bench.hvd_worker import build_compression

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        compression = build_compression(spec, model, case_id)
        named = [(f"case{case_id}.{n}", p) for n, p in model.named_parameters()]
        distributed = hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=compression)
        return model, distributed, compression if hasattr(compression, "history") else None


def run_case(front: FrontEnd, task: Any, spec: specs.Spec, case_id: int, seed: int, steps: int,
             eval_every: int) -> dict[str, Any]:
    """Train one compressor from the seed's initial weights; its curve and figures (rank 0's clock)."""
    torch.manual_seed(seed)
    model = task.model()
    forward, optimizer, safebits = front.wrap(spec, model, task.optimizer(model), case_id)
    gen = torch.Generator().manual_seed(seed * 7919 + front.rank)
    curve = [(0, 0.0, task.evaluate(model)[0])]
    has_tx = os.path.exists(TX_BYTES)
    front.barrier(f"{case_id}.start")
    tx_before, seconds, budgets, quality, timing = read_tx_bytes() if has_tx else 0, 0.0, [], {}, []
    step_seconds: list[float] = []
    for step in range(steps):
        task.set_lr(optimizer, step)
        start = time.perf_counter()
        optimizer.zero_grad()
        task.batch_loss(forward, gen).backward()
        optimizer.step()
        step_seconds.append(time.perf_counter() - start)
        seconds += step_seconds[-1]
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            front.barrier(f"{case_id}.{step}")
            curve.append((step + 1, seconds, task.evaluate(model)[0]))
    front.barrier(f"{case_id}.end")
    tx_bytes = read_tx_bytes() - tx_before if has_tx else None
    if safebits is not None:
        history, parameters = safebits.history, sum(p.numel() for p in model.parameters())
        budgets = [round(record.budget_bits_total / parameters, 3) for record in history]
        timing = [{"step": record.timing_step, **(timing_json(record) or {})} for record in history]
        # What auto weighed (docs/DESIGN.md, "Quality"): per step the sampling noise and the error sent, and the
        # errors the last compressed step predicted per budget.
        predicted = [record.budget_errors for record in history if record.budget_errors]
        quality = {"gradient_noise": [record.gradient_noise for record in history],
                   "compression_error": [record.compression_error for record in history],
                   "budget_errors": predicted[-1] if predicted else {}}
    return {"compressor": spec.text, "case": case_id, "seed": seed, "steps": steps, "train_seconds": seconds,
            "curve": curve, "final_loss": curve[-1][2], "loopback_bytes": tx_bytes, "budgets": budgets,
            "step_seconds": step_seconds, "timing": timing, "quality": quality, **model_facts(model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=TASKS, required=True)
    parser.add_argument("--compressors", nargs="+", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--eval-every", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    plan = [specs.parse(text) for text in args.compressors]
    if len({spec.ddp for spec in plan}) != 1:
        raise SystemExit("one front end per launch: all ddp: specs, or none")
    if not plan[0].ddp:
        pin_rank()             # before hvd.init(): its threads inherit the binding
    front = FrontEnd(plan[0].ddp)
    task = make_race_task(args.task, args.steps)
    cases = []
    for case_id, spec in enumerate(plan):
        cases.append(run_case(front, task, spec, case_id, args.seed, args.steps, args.eval_every))
        if front.rank == 0:
            print(f"[race] {args.task} seed {args.seed} {spec.text}: {cases[-1]['train_seconds']:.1f} s, "
                  f"final loss {cases[-1]['final_loss']:.4f}", flush=True)
    if front.rank == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"task": args.task, "seed": args.seed, "ranks": front.size, "cases": cases}, f)
    front.close()


if __name__ == "__main__":
    main()
    exit_without_finalization(0)
