"""One Horovod rank of the end-to-end comparison (launched by ``bench/demo.py`` under ``horovodrun -np 2``).

Within the same processes it trains, one run after another, every compressor of
:data:`safebits_hvd.baselines.REGISTRY` (SafeBits and the unscreened ablation at several budgets, in bits per
parameter per step) on two tasks, with the same seed, data order, initial weights and learning-rate schedule (by
default a cosine decay to 0 over the run) for every compressor:

* ``digits_cnn``: a small CNN on scikit-learn's bundled 8x8 digits (SGD with momentum); metric: validation
  accuracy.
* ``bytes_lm``: a byte-level causal transformer on CPython standard-library sources found on this machine
  (Adam); metric: validation bits per byte.
* ``bytes_lm_large`` (only when asked for with ``--tasks``): the same LM at width 256 (1.2M parameters) on about
  2 MB of the same sources.

Rank 0 prints one line per run and writes the raw per-step curves to ``--out`` (JSON); ``demo.py`` turns them
into ``results/demo.json``, ``results/demo.md`` and the plots.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from demo_stats import COLLAPSE_FACTOR, SCHEDULES, collapsed, run_label, section

from safebits_hvd.baselines import BUDGETED, REGISTRY, make_compressor

FIXED = ["fp32", "fp16", "qsgd8", "qsgd4", "qsgd2", "terngrad", "signsgd_ef", "topk10_ef", "topk1_ef"]
"""Fixed-action baselines, in table order."""

BUDGETS = [2.0, 4.4, 8.0]
"""Budgets (bits per parameter per step) of SafeBits and of unscreened global budgeting."""

MAX_SCALED_BUDGET = 2.0
"""Budgets up to this also run SafeBits and unscreened budgeting on ``baselines.MAX_SCALED_MENU`` and
``baselines.QUANTIZER_MENU``: the tight regime in which those menus' only cheap actions do not contract
(docs/RESULTS.md 6.6)."""


# ---------------------------------------------------------------------------------------------- tasks
class DigitsCNN(torch.nn.Module):
    """Two 3x3 conv layers (16, 32 channels) with 2x2 max-pooling, then a 64-unit MLP head: 13,706 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 2 * 2, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class ByteLM(torch.nn.Module):
    """Pre-norm causal transformer over bytes: vocabulary 256, ``width`` channels, ``layers`` blocks."""

    def __init__(self, context: int, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        block = torch.nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.position[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


LM_SHAPES = {"bytes_lm": (64, 400_000, 3e-3), "bytes_lm_large": (256, 2_000_000, 1e-3)}
"""LM task -> (width, corpus bytes, Adam learning rate): the demo's LM (104,192 parameters) and a larger one
(1,202,432 parameters; 2 layers and 4 heads both). At width 256, 1e-3 ended 160 steps of fp32 training slightly
lower than 3e-3 (3.221 against 3.230 validation bits per byte, one process, batch 32)."""


@dataclass
class Task:
    """Data, model factory, optimizer, learning-rate schedule and metric of one task."""

    name: str
    metric_name: str
    steps: int
    lr: float
    batch: int = 0          # examples (CNN) or 64-byte windows (LM) per rank and step; 0: the task's default
    # The learning rate over the steps (one of SCHEDULES): "cosine" decays from lr towards 0 at the last step, so
    # the final evaluation reads a settled model, not the last noisy iterate of a constant rate, where one seed's
    # validation loss of a near-lossless compressor strayed 30% from fp32's (docs/RESULTS.md, section 6.13).
    schedule: str = SCHEDULES[0]

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {self.schedule!r}; known: {SCHEDULES}")
        if self.name == "digits_cnn":
            from sklearn.datasets import load_digits

            digits = load_digits()
            x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
            y = torch.tensor(digits.target, dtype=torch.int64)
            order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
            x, y = x[order], y[order]
            self.train_x, self.train_y = x[300:], y[300:]
            self.val_x, self.val_y = x[:300], y[:300]
            self.batch = self.batch or 32
        else:
            self.context = 64
            self.batch = self.batch or 16
            self.width, corpus_bytes, _ = LM_SHAPES[self.name]
            self.corpus_files = corpus_files(corpus_bytes)
            data = load_corpus(self.corpus_files)
            split = int(len(data) * 0.9)
            self.train_bytes, self.val_bytes = data[:split], data[split:]
            starts = torch.linspace(0, len(self.val_bytes) - self.context - 2, 256).long()
            self.val_windows = torch.stack([self.val_bytes[s:s + self.context + 1] for s in starts])

    def model(self) -> torch.nn.Module:
        return DigitsCNN() if self.name == "digits_cnn" else ByteLM(self.context, self.width)

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if self.name == "digits_cnn":
            return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.Adam(model.parameters(), lr=self.lr)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based, of :attr:`steps`) under :attr:`schedule`."""
        if self.schedule == "cosine":
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * step / self.steps))
        return self.lr

    def set_lr(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Give every parameter group of ``optimizer`` the learning rate of step ``step``."""
        for group in optimizer.param_groups:
            group["lr"] = self.lr_at(step)

    def batch_loss(self, model: torch.nn.Module, gen: torch.Generator) -> torch.Tensor:
        if self.name == "digits_cnn":
            idx = torch.randint(len(self.train_y), (self.batch,), generator=gen)
            return F.cross_entropy(model(self.train_x[idx]), self.train_y[idx])
        starts = torch.randint(len(self.train_bytes) - self.context - 1, (self.batch,), generator=gen)
        windows = torch.stack([self.train_bytes[s:s + self.context + 1] for s in starts])
        logits = model(windows[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> tuple[float, float]:
        """(validation loss in nats, metric): accuracy for the CNN, bits per byte for the LM."""
        model.eval()
        try:
            if self.name == "digits_cnn":
                logits = model(self.val_x)
                loss = float(F.cross_entropy(logits, self.val_y))
                return loss, float((logits.argmax(1) == self.val_y).float().mean())
            logits = model(self.val_windows[:, :-1])
            loss = float(F.cross_entropy(logits.reshape(-1, 256), self.val_windows[:, 1:].reshape(-1)))
            return loss, loss / math.log(2)
        finally:
            model.train()


TASK_NAMES = ("digits_cnn", *LM_SHAPES)
CNN_LEARNING_RATE = 0.1     # SGD with momentum 0.9 (the LMs' Adam rates are in LM_SHAPES)


def make_task(name: str, steps: int, batch: int = 0, schedule: str = SCHEDULES[0]) -> Task:
    """Task ``name`` (one of :data:`TASK_NAMES`) with the demo's metric, learning rate and schedule (``batch`` 0:
    the task's default, 32 digits or 16 windows per rank)."""
    if name == "digits_cnn":
        return Task(name, "val_accuracy", steps, lr=CNN_LEARNING_RATE, batch=batch, schedule=schedule)
    if name in LM_SHAPES:
        return Task(name, "val_bits_per_byte", steps, lr=LM_SHAPES[name][2], batch=batch, schedule=schedule)
    raise ValueError(f"unknown task {name!r}; known: {TASK_NAMES}")


def corpus_files(target_bytes: int = LM_SHAPES["bytes_lm"][1]) -> list[str]:
    """CPython standard-library ``.py`` files of this interpreter, in sorted name order, until ``target_bytes``."""
    stdlib = sysconfig.get_paths()["stdlib"]
    chosen, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        size = os.path.getsize(path)
        if size < 2_000 or size > 120_000:   # skip stubs and the very largest modules
            continue
        chosen.append(path)
        total += size
        if total >= target_bytes:
            break
    return chosen


def load_corpus(files: list[str]) -> torch.Tensor:
    """The corpus (``files``, from :func:`corpus_files`) as a uint8 -> int64 tensor of bytes."""
    raw = b"".join(open(p, "rb").read() for p in files)  # noqa: SIM115 - read-and-close
    return torch.tensor(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))


# ---------------------------------------------------------------------------------------------- one run
def run_one(task: Task, compressor: str, budget_bits: float | None, seed: int, run_id: int,
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
    hvd.allreduce(torch.zeros(1), name=f"barrier.{run_id}")
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


Plan = list[tuple[str, float | None, tuple[float, float] | None]]


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


def parse_run(text: str) -> tuple[str, float | None, None]:
    """``"safebits@2"`` -> ``("safebits", 2.0, None)``, ``"fp32"`` -> ``("fp32", None, None)``: one run of a plan."""
    name, _, budget = text.partition("@")
    try:
        bits = float(budget) if budget else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME or NAME@BITS, got {text!r}") from None
    if name not in REGISTRY:
        raise argparse.ArgumentTypeError(f"unknown compressor {name!r}; known: {sorted(REGISTRY)}")
    if (bits is None) == (name in BUDGETED) or (bits is not None and not bits > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: budgeted compressors ({', '.join(sorted(BUDGETED))}) take "
                                         f"@BITS > 0, the fixed ones none")
    return name, bits, None


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="raw results JSON (written by rank 0)")
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
                             "(docs/RESULTS.md 6.6)")
    parser.add_argument("--thresholds", type=parse_thresholds, nargs="+", default=[None],
                        help="SafeBits screens as MAX_DISTORTION:MIN_COSINE (one SafeBits run per budget and "
                             "pair); default: the library's")
    args = parser.parse_args()
    if args.large_plan and "bytes_lm_large" in args.tasks:     # else one of the two would be silently ignored
        parser.error("--large-plan trains bytes_lm_large itself: leave it out of --tasks")
    if args.constant_plan and args.lr_schedule == "constant":  # else both would land in one table
        parser.error("--constant-plan adds constant-rate runs to decayed ones: with --lr-schedule constant, "
                     "give them in --plan")

    torch.set_num_threads(1)
    logging.getLogger("safebits_hvd").setLevel(logging.ERROR)   # violations/escalations are counted per run
    hvd.init()
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
                    print(f"[demo] {progress.line()}: {task.name} seed={seed} "
                          f"{compressor}{'' if budget is None else f'@{budget:g}'}", flush=True)
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


if __name__ == "__main__":
    main()
