"""One Horovod rank of the end-to-end harnesses: ``demo`` (launched by ``bench.demo`` and
``bench.experiments.threshold_sweep``) or ``link`` (launched by ``bench.link`` inside its network namespace).

``demo``: within the same processes it trains, one run after another, every compressor of its plan (registry
names of :data:`safebits_hvd.frontends.baselines.REGISTRY`; SafeBits and the unscreened ablation at several budgets, in
bits per parameter per step) on the tasks of :mod:`bench.tasks`, with the same seed, data order, initial weights
and learning-rate schedule (by default a cosine decay to 0 over the run) for every compressor. Rank 0 prints one
line per run and writes the raw per-step curves to ``--out`` (JSON); ``bench.demo`` turns them into
``results/demo.json``, ``results/demo.md`` and the plots.

``link``: for every (model, compressor spec) case, one after another in the same two processes (or with
``--interleave`` each model's cases side by side, their timed steps alternating), the figures of
:mod:`bench.protocol`. Compressors: ``none`` and ``fp16`` are ``hvd.Compression.none`` / ``hvd.Compression.fp16``;
any other name is a registry name, ``name@bits`` giving ``budget_bits`` (``safebits@4.4``, ``safebits@auto``).
Before the cases, a link probe times plain fp32 allreduces (no model, no compressor) and divides the loopback bytes
they moved by their time: the rate the link really gave. Rank 0 writes the raw figures to ``--out`` (JSON).

Not meant to be run by hand: ``python -m bench.demo`` and ``python -m bench.link`` launch it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import horovod.torch as hvd
import torch

from bench import specs
from bench.demo_stats import COLLAPSE_FACTOR, collapsed, run_label, section
from bench.protocol import SEED, Case, pin_rank, read_tx_bytes, run_group, run_model, step_reporter
from bench.tasks import (
    DEFAULT_IMAGE_SIZE,
    LM_SHAPES,
    SCHEDULES,
    TASK_NAMES,
    Task,
    Workload,
    corpus_files,
    make_task,
    model_facts,
)
from safebits_hvd.frontends.baselines import BUDGETED, make_compressor
from safebits_hvd.frontends.baselines import label as compressor_label

FIXED = ["fp32", "fp16", "qsgd8", "qsgd4", "qsgd2", "terngrad", "signsgd_ef", "topk10_ef", "topk1_ef"]
"""Fixed-action baselines of the demo's default plan, in table order."""

BUDGETS = [2.0, 4.4, 8.0]
"""Budgets (bits per parameter per step) of SafeBits and of unscreened global budgeting in the default plan."""

MAX_SCALED_BUDGET = 2.0
"""Budgets up to this also run SafeBits and unscreened budgeting on ``baselines.MAX_SCALED_MENU`` and
``baselines.QUANTIZER_MENU``: the tight regime in which those menus' only cheap actions do not contract
(docs/RESULTS.md, section 9)."""


def barrier(tag: str) -> None:
    hvd.allreduce(torch.zeros(1), name=f"barrier.{tag}")


# ---------------------------------------------------------------------------------------------- demo: one run
def run_one(task: Task, compressor: str, budget_bits: float | str | None, seed: int, run_id: int,
            thresholds: tuple[float, float] | None = None) -> dict[str, Any]:
    """Train ``task`` with one compressor under Horovod; returns the run's summary and per-step curves.

    ``thresholds``: SafeBits' ``(max_distortion, min_cosine)``; None: the library's defaults (and for every other
    compressor, which has no screen).
    """
    torch.manual_seed(seed)
    model = task.model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    kwargs: dict[str, Any] = {}
    if compressor in BUDGETED:
        kwargs = {"name": f"safebits.{run_id}", "nonfinite": "skip"}
    if compressor == "safebits" and thresholds is not None:
        kwargs.update(max_distortion=thresholds[0], min_cosine=thresholds[1])
    compression = make_compressor(compressor, model.named_parameters(), seed=seed, budget_bits=budget_bits,
                                  **kwargs)
    opt = hvd.DistributedOptimizer(task.optimizer(model), named_parameters=model.named_parameters(),
                                   compression=compression)
    gen = torch.Generator().manual_seed(seed * 7919 + hvd.rank())
    initial_loss, _ = task.evaluate(model)
    total_elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
    losses: list[float] = []
    bits: list[int] = []
    violations = escalations = infeasible = 0
    nonfinite = False
    barrier(f"{run_id}")
    start = time.perf_counter()
    for step in range(task.steps):
        task.set_lr(opt, step)
        opt.zero_grad()
        loss = task.batch_loss(model, gen)
        mean_loss = float(hvd.allreduce(loss.detach().reshape(1), name="train_loss"))
        if not math.isfinite(mean_loss):      # same decision on both ranks: stop before a NaN reaches the wire
            nonfinite = True
            break
        loss.backward()
        opt.step()
        record = compression.last_step
        losses.append(mean_loss)
        bits.append(int(record.modeled_bits_total))
        violations += int(record.violation)
        escalations += len(record.escalations)
        infeasible += int(record.infeasible)
    wall_s = time.perf_counter() - start
    final_loss, final_metric = task.evaluate(model)
    if not all(math.isfinite(float(p.detach().sum())) for p in model.parameters()):
        nonfinite = True
    used = sum(bits)
    screened = getattr(compression, "screen_enabled", False)
    return {
        "task": task.name, "compressor": compressor, "budget_bits": budget_bits, "seed": seed,
        "lr_schedule": task.schedule,
        "final_loss": final_loss, "final_metric": final_metric, "metric_name": task.metric_name,
        "compression_ratio": 32.0 * total_elements * len(bits) / used if used else None,
        "violations": violations, "escalations": escalations, "infeasible": infeasible,
        "collapsed": collapsed(initial_loss, final_loss, nonfinite),
        "wall_s": wall_s,
        "max_distortion": compression.max_distortion if screened else None,
        "min_cosine": compression.min_cosine if screened else None,
        "bits_per_param": used / (total_elements * len(bits)) if bits else None,
        "curves": {"initial_loss": initial_loss, "train_loss": losses, "bits": bits,
                   "parameters": total_elements, "steps_done": len(bits)},
    }


def parse_thresholds(text: str) -> tuple[float, float]:
    """``"0.5:0.8"`` -> ``(0.5, 0.8)``: SafeBits' ``(max_distortion, min_cosine)``."""
    try:
        distortion, cosine = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MAX_DISTORTION:MIN_COSINE, got {text!r}") from None
    return distortion, cosine


Plan = list[tuple[str, float | str | None, tuple[float, float] | None]]


def make_plan(budgets: list[float], thresholds: list[tuple[float, float] | None],
              compressors: list[str] | None = None) -> Plan:
    """Runs per task and seed, in table order: ``(compressor, budget_bits, thresholds)``.

    The fixed baselines, then per budget one SafeBits run per screen in ``thresholds`` (None: the library's
    defaults) and one unscreened run, and at budgets up to :data:`MAX_SCALED_BUDGET` the same pair on the
    max-scaled and the quantizer menus; ``compressors`` keeps only those registry names.
    """
    plan: Plan = [(c, None, None) for c in FIXED]
    for b in budgets:
        plan += [("safebits", b, t) for t in thresholds] + [("unscreened", b, None)]
        if b <= MAX_SCALED_BUDGET:
            for menu in ("maxscaled", "quantizers"):
                plan += [(f"safebits_{menu}", b, t) for t in thresholds] + [(f"unscreened_{menu}", b, None)]
    return [p for p in plan if not compressors or p[0] in compressors]


def parse_run(text: str) -> tuple[str, float | str | None, None]:
    """``"safebits@2"`` -> ``("safebits", 2.0, None)``, ``"safebits@auto"`` -> ``("safebits", "auto", None)``,
    ``"fp32"`` -> ``("fp32", None, None)``: one run of a plan (a :mod:`bench.specs` spec of the registry; Horovod's
    own ``none``/``fp16`` are ``fp32``/``fp16`` here). ``auto`` chooses its budgets from the demo's own link
    (localhost), as it would from any other."""
    spec = specs.argument(text)
    if spec.ddp or spec.name in specs.HOROVOD_BUILTIN:
        raise argparse.ArgumentTypeError(f"{text!r}: the demo runs registry compressors at a number of bits or auto")
    budget = spec.budget_bits
    return spec.name, budget if budget is None or budget == "auto" else float(budget), None


class Progress:
    """Which run is going, how many are done, and the time left: each remaining run is estimated at the mean wall
    time of the runs of its task done so far (of all runs done, before its task's first)."""

    def __init__(self, tasks: list[str]) -> None:
        self.tasks = tasks                       # the task of every run, in order
        self.walls: list[float] = []

    def done(self, wall_s: float) -> None:
        self.walls.append(wall_s)

    def seconds_left(self) -> float | None:
        if not self.walls:
            return None
        overall = sum(self.walls) / len(self.walls)
        by_task: dict[str, list[float]] = {}
        for task, wall in zip(self.tasks, self.walls, strict=False):
            by_task.setdefault(task, []).append(wall)
        return sum(sum(by_task[t]) / len(by_task[t]) if t in by_task else overall
                   for t in self.tasks[len(self.walls):])

    def line(self) -> str:
        done, total = len(self.walls), len(self.tasks)
        left = self.seconds_left()
        estimate = "time left unknown until the first run ends" if left is None else f"about {left:.0f} s left"
        return f"run {done + 1}/{total} ({done} done, {sum(self.walls):.0f} s so far, {estimate})"


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--cnn-steps", type=int, default=150)
    parser.add_argument("--lm-steps", type=int, default=150)
    parser.add_argument("--tasks", nargs="*", default=["digits_cnn", "bytes_lm"],
                        choices=["digits_cnn", *LM_SHAPES])
    parser.add_argument("--compressors", nargs="+", default=None, help="subset of registry names")
    parser.add_argument("--budgets", type=float, nargs="+", default=BUDGETS,
                        help="bits per parameter per step of SafeBits and unscreened budgeting")
    parser.add_argument("--plan", type=parse_run, nargs="+", default=None, metavar="NAME[@BITS]",
                        help="the runs of every task, in order (fp32 qsgd2 safebits@2 ...); instead of "
                             "--compressors, --budgets and --thresholds")
    parser.add_argument("--large-plan", type=parse_run, nargs="*", default=[], metavar="NAME[@BITS]",
                        help="also train bytes_lm_large, after the other tasks, with these runs only (fp32 "
                             "safebits@2 ...), --large-steps steps of --large-batch windows per rank")
    parser.add_argument("--large-steps", type=int, default=160)
    parser.add_argument("--large-batch", type=int, default=16)
    parser.add_argument("--lr-schedule", choices=SCHEDULES, default=SCHEDULES[0],
                        help="learning rate over each run's steps (cosine: from the task's rate to 0)")
    parser.add_argument("--constant-plan", type=parse_run, nargs="*", default=[], metavar="NAME[@BITS]",
                        help="also train digits_cnn at a constant learning rate, after the other tasks, with these "
                             "runs only (--cnn-steps steps): the tight regime where unscreened budgeting collapses "
                             "(docs/RESULTS.md 2.1)")
    parser.add_argument("--thresholds", type=parse_thresholds, nargs="+", default=[None],
                        help="SafeBits screens as MAX_DISTORTION:MIN_COSINE (one SafeBits run per budget and "
                             "pair); default: the library's")
def check_demo_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.large_plan and "bytes_lm_large" in args.tasks:     # else one of the two would be silently ignored
        parser.error("--large-plan trains bytes_lm_large itself: leave it out of --tasks")
    if args.constant_plan and args.lr_schedule == "constant":  # else both would land in one table
        parser.error("--constant-plan adds constant-rate runs to decayed ones: with --lr-schedule constant, "
                     "give them in --plan")


def demo_main(args: argparse.Namespace) -> None:
    rank0 = hvd.rank() == 0
    plan = args.plan or make_plan(args.budgets, args.thresholds, args.compressors)
    tasks = {name: make_task(name, args.cnn_steps if name == "digits_cnn" else args.lm_steps,
                             schedule=args.lr_schedule)
             for name in TASK_NAMES if name == "digits_cnn" or name in args.tasks}
    jobs: list[tuple[Task, Plan]] = [(tasks[name], plan) for name in args.tasks]
    if args.large_plan:
        tasks["bytes_lm_large"] = make_task("bytes_lm_large", args.large_steps, args.large_batch,
                                            args.lr_schedule)
        jobs.append((tasks["bytes_lm_large"], args.large_plan))
    if args.constant_plan:
        jobs.append((make_task("digits_cnn", args.cnn_steps, schedule="constant"), args.constant_plan))
    runs = []
    for name in LM_SHAPES:
        if rank0 and name in tasks:
            files = tasks[name].corpus_files
            print(f"[demo] {name} corpus: {len(files)} stdlib files, {sum(map(os.path.getsize, files))} bytes, "
                  f"{os.path.basename(files[0])} .. {os.path.basename(files[-1])}", flush=True)
    run_id = 0
    progress = Progress([task.name for task, task_plan in jobs for _ in args.seeds for _ in task_plan])
    for task, task_plan in jobs:
        for seed in args.seeds:
            for compressor, budget, thresholds in task_plan:
                if rank0:
                    print(f"[demo] {progress.line()}: {task.name} seed={seed} {compressor_label(compressor, budget)}",
                          flush=True)
                result = run_one(task, compressor, budget, seed, run_id, thresholds)
                progress.done(result["wall_s"])
                run_id += 1
                runs.append(result)
                if rank0:
                    label = run_label(result)
                    print(f"[demo] {section(result):10s} seed={seed} {label:16s} "
                          f"loss {result['curves']['initial_loss']:.3f} -> {result['final_loss']:.3f}"
                          f"  {task.metric_name}={result['final_metric']:.4f}"
                          f"  ratio={result['compression_ratio'] or float('nan'):6.2f}x"
                          f"  viol={result['violations']} esc={result['escalations']}"
                          f"{'  COLLAPSED' if result['collapsed'] else ''}  {result['wall_s']:.1f}s", flush=True)
    if rank0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"runs": runs, "collapse_factor": COLLAPSE_FACTOR,
                       "corpus_files": [os.path.basename(p) for p in (tasks["bytes_lm"].corpus_files
                                                                       if "bytes_lm" in tasks else corpus_files())],
                       **({"large_corpus_files": [os.path.basename(p) for p in tasks["bytes_lm_large"].corpus_files]}
                          if "bytes_lm_large" in tasks else {})}, f)


# ---------------------------------------------------------------------------------------------- link: one case
def build_compression(spec: specs.Spec, model: torch.nn.Module, case_id: int) -> Any:
    """Horovod's ``none`` / ``fp16`` or a registry compressor at its budget."""
    if spec.name == "none":
        return hvd.Compression.none
    if spec.name == "fp16":
        return hvd.Compression.fp16
    kwargs: dict[str, Any] = {"name": f"safebits.link.{case_id}"} if spec.budgeted else {}
    return make_compressor(spec.name, model.named_parameters(), seed=SEED, budget_bits=spec.budget_bits, **kwargs)


def training_step(work: Workload, model: torch.nn.Module, opt: torch.optim.Optimizer,
                  gen: torch.Generator) -> Callable[[], None]:
    """One training step of ``model`` on ``work``'s next synthetic batch."""
    def step() -> None:
        opt.zero_grad()
        work.loss(model, gen).backward()
        opt.step()

    return step


def run_cases(work: Workload, plan: Sequence[tuple[int, specs.Spec]], warmup: int, steps: int,
              step_file: str | None = None) -> list[dict[str, Any]]:
    """The (case id, compressor) cases of ``plan`` on ``work`` under :func:`bench.protocol.run_group`, their
    timed steps interleaved when there are several; their JSON records (meaningful on rank 0)."""
    built: list[tuple[int, specs.Spec, dict[str, Any], Case]] = []
    for case_id, spec in plan:
        torch.manual_seed(SEED)
        model = work.model()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        facts = model_facts(model)
        compression = build_compression(spec, model, case_id)
        # Each case's own collective names: interleaved cases' tensors never share an entry of Horovod's cache.
        named = [(f"case{case_id}.{n}", p) for n, p in model.named_parameters()]
        opt = hvd.DistributedOptimizer(work.optimizer(model), named_parameters=named, compression=compression)
        gen = torch.Generator().manual_seed(SEED * 7919 + hvd.rank())
        built.append((case_id, spec, facts,
                      Case(training_step(work, model, opt, gen), partial(getattr, compression, "history", None),
                           (16 if spec.name == "fp16" else 32) * facts["parameters"], warmup)))
    group = plan[0][0]
    return run_group(work, built, lambda: barrier(f"{group}"), warmup, steps,
                     step_reporter(step_file, group, hvd.rank()), hvd.size(), sum_over_ranks)


def sum_over_ranks(value: float, case_id: int) -> float:
    """``value`` summed over the ranks (Horovod's allreduce, named after the case)."""
    return float(hvd.allreduce(torch.tensor([value], dtype=torch.float64), op=hvd.Sum, name=f"link.wire.{case_id}"))


def link_probe(elements: int = 4 * 2**20, repeats: int = 3) -> dict[str, Any]:
    """Communication alone: fp32 allreduces of ``elements`` values (no model, no compressor). The loopback bytes
    they move over their median time is the rate the link really gave, a check that the limit is in place."""
    x = torch.ones(elements)
    hvd.allreduce(x, name="link.probe.warm")
    times, moved = [], []
    for k in range(repeats):
        barrier(f"probe.{k}")
        tx0, t0 = read_tx_bytes(), time.perf_counter()
        hvd.allreduce(x, name="link.probe")
        times.append(time.perf_counter() - t0)
        moved.append(read_tx_bytes() - tx0)
    median = statistics.median(times)
    return {"elements": elements, "times_s": times, "link_bytes": moved,
            "achieved_bits_per_s": statistics.median(moved) * 8 / median if median > 0 else None}


def batch_for(name: str, args: argparse.Namespace) -> int:
    """The per-rank batch of ``name``: ``--cnn-batch``, ``--gpt-batch`` or ``--lm-batch``."""
    return {"resnet18": args.cnn_batch, "gpt2_small": args.gpt_batch}.get(name, args.lm_batch)


def link_main(args: argparse.Namespace) -> None:
    rank0 = hvd.rank() == 0
    probe = link_probe()
    if rank0:
        print(f"[link] probe: fp32 allreduce of {probe['elements']:,} values moved "
              f"{statistics.median(probe['link_bytes']) / 1e6:.1f} MB in {statistics.median(probe['times_s']):.3f} s "
              f"= {probe['achieved_bits_per_s'] / 1e9:.2f} Gbit/s on the link", flush=True)
    cases = []
    for name in args.models:
        work = Workload(name, batch_for(name, args), args.image_size)
        cases += run_model(name, args.compressors, args.rounds, args.interleave, len(cases),
                           partial(run_cases, work, warmup=args.warmup, steps=args.steps, step_file=args.step_file),
                           rank0)
    if rank0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"cases": cases, "probe": probe, "torch": torch.__version__,
                       "horovod": importlib.metadata.version("horovod"), "threads": torch.get_num_threads(),
                       "python": platform.python_version()}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train the demo's tasks with every compressor of a plan")
    demo.add_argument("--out", required=True, help="raw results JSON (written by rank 0)")
    add_demo_arguments(demo)
    link = commands.add_parser("link", help="time every (model, compressor) case on the link")
    link.add_argument("--out", required=True, help="raw results JSON (written by rank 0)")
    link.add_argument("--models", nargs="+", default=["resnet18", "bytes_lm"], choices=Workload.NAMES)
    link.add_argument("--compressors", nargs="+", required=True, type=specs.argument, metavar="SPEC")
    link.add_argument("--warmup", type=int, default=2)
    link.add_argument("--steps", type=int, default=6)
    link.add_argument("--rounds", type=int, default=1, help="times the compressor list runs, in turn")
    link.add_argument("--interleave", action="store_true",
                      help="run each model's cases side by side, their timed steps alternating")
    link.add_argument("--cnn-batch", type=int, default=16)
    link.add_argument("--lm-batch", type=int, default=16, help="bytes_lm sequences per rank")
    link.add_argument("--gpt-batch", type=int, default=8, help="gpt2_small sequences (128 tokens) per rank")
    link.add_argument("--image-size", type=int, default=DEFAULT_IMAGE_SIZE, help="ResNet-18 image side")
    link.add_argument("--step-file", default=None,
                      help="rank 0 writes '<case> <step>' here before every step (the changing-link run)")
    args = parser.parse_args()
    if args.command == "demo":
        check_demo_arguments(demo, args)
    elif any(spec.ddp for spec in args.compressors):
        link.error("ddp: specs run under bench.ddp_worker")

    torch.set_num_threads(1)
    logging.getLogger("safebits_hvd").setLevel(logging.ERROR)   # violations/escalations are counted per run
    pin_rank()                 # before hvd.init(): its threads inherit the binding
    hvd.init()
    (demo_main if args.command == "demo" else link_main)(args)


if __name__ == "__main__":
    main()
