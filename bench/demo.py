"""The main job (``make demo``): compressors end to end, on 2 Horovod ranks on localhost, 3 seeds.

Launches ONE ``horovodrun -np 2 --gloo`` of ``bench.hvd_worker demo``, which trains, one run after another in the
same two processes, fixed baselines of :mod:`safebits_hvd.frontends.baselines` and SafeBits / unscreened global
budgeting on a small CNN (scikit-learn digits), a byte-level transformer LM (CPython standard-library sources) and the
same LM at 1.2M parameters, with the same initialization and data order for every compressor of a seed.

Writes ``results/demo.json`` (one record per run: task, compressor, budget_bits, seed, final_loss, final_metric,
metric_name, compression_ratio, violations, escalations, infeasible, collapsed, wall_s, and max_distortion, min_cosine,
bits_per_param, lr_schedule), ``results/demo.md`` (per task: mean ± std over seeds, and every budgeted run against the
closest fixed baseline at equal bytes, paired by seed) and per task ``results/demo_<task>_loss_vs_step.png`` and
``results/demo_<task>_loss_vs_bytes.png`` (seed 0).

Default (:data:`DEFAULT_PLAN`, :data:`CONSTANT_PLAN`): seeds 0, 1, 2; on the digits CNN and the small LM fp32, QSGD
4 and 2, and SafeBits at 2, 4.25 (QSGD-4's bytes) and 4.4 bits, 250 CNN and 160 LM steps, the
learning rate decaying to 0 on a cosine (``--lr-schedule constant``: a constant rate, docs/RESULTS.md section 2);
then the tight regime where unscreened budgeting collapses and SafeBits does not: fp32 and both on the
quantizer menu at 1 bit, on the CNN at a constant learning rate. 45 runs, under 10 minutes on 2 cores
(docs/RESULTS.md, "make demo"). Each run's start prints a progress line (runs done, time so far, an estimate of the
time left).
``--full``: every registry compressor, budgets 1 (the tight regime of docs/RESULTS.md 2.1), 2, 4.4, 8 (SafeBits and
unscreened budgeting on the max-scaled and quantizer menus at 1 and 2 only), 500 / 320 steps, the larger LM
(:data:`LARGE_PLAN`), and :data:`CONSTANT_PLAN` on the CNN.
Worker options given here override the defaults (``--seeds 0``); one that chooses the runs (``--plan``,
``--compressors``, ``--budgets``, ``--thresholds``, ``--tasks``, ``--large-plan``, ``--constant-plan``) replaces the
default plan, the larger LM and the constant-rate runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from bench.demo_stats import other_schedule, run_label, section, table
from safebits_hvd.frontends import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HVD_WORKER = ("-m", "bench.hvd_worker", "demo")   # a module, run from the repository root (the launcher's cwd)
FIELDS = ["task", "compressor", "budget_bits", "seed", "final_loss", "final_metric", "metric_name",
          "compression_ratio", "violations", "escalations", "infeasible", "collapsed", "wall_s", "max_distortion",
          "min_cosine", "bits_per_param", "lr_schedule"]

DEFAULT_PLAN = ["fp32", "qsgd4", "qsgd2", "safebits@2", "safebits@4.25", "safebits@4.4"]
"""``make demo``'s runs on the digits CNN and the small LM: fp32 and the fixed baselines nearest in bytes to SafeBits
at 2 and 4.4 bits per parameter (about 7.2x), and SafeBits at 4.25 bits, which sends no more than QSGD-4 (95% of
4.25 is 4.04 bits; QSGD-4 sends 4.06). Unscreened budgeting is shown where it fails, in
:data:`CONSTANT_PLAN`; the rest is in ``--full``."""
LARGE_PLAN = ["fp32", "qsgd2", "safebits@2"]
"""``--full``'s runs on the larger LM (``bytes_lm_large``, 1.2M parameters), 120 steps of 8 windows per rank: the
small LM's comparison at 2 bits on a model 12x larger."""
LARGE_ARGS = ["--large-plan", *LARGE_PLAN, "--large-steps", "120", "--large-batch", "8"]
CONSTANT_PLAN = ["fp32", "unscreened_quantizers@1", "safebits_quantizers@1"]
"""The runs on the digits CNN at a constant learning rate: the tight regime where unscreened budgeting collapses
and SafeBits does not (docs/RESULTS.md 2.1). Under the demo's decay it degrades without collapsing (section 2.1),
so it keeps the rate at which it was found."""
PLAN_OPTIONS = ("--plan", "--compressors", "--budgets", "--thresholds", "--tasks", "--large-plan", "--constant-plan")
"""Worker options that choose the runs: given to ``demo.py``, they replace its default plan, the larger LM and
``--full``'s constant-rate runs."""
FULL_BUDGETS = [1.0, 2.0, 4.4, 8.0]


def worker_arguments(full: bool, extra: list[str]) -> list[str]:
    """``bench.hvd_worker demo``'s arguments: the default run or ``--full``'s, then ``extra`` (the worker options
    given to ``bench.demo``; later options win in argparse). One that chooses the runs (:data:`PLAN_OPTIONS`)
    replaces the default plan, the larger LM and the constant-rate runs."""
    chosen = any(arg.split("=")[0] in PLAN_OPTIONS for arg in extra)
    if full:
        args = ["--seeds", "0", "1", "2", "--cnn-steps", "500", "--lm-steps", "320", "--budgets",
                *map(str, FULL_BUDGETS)]
    else:
        args = ["--seeds", "0", "1", "2", "--cnn-steps", "250", "--lm-steps", "160",
                *([] if chosen else ["--plan", *DEFAULT_PLAN])]
    if not chosen:
        args += (LARGE_ARGS if full else []) + ["--constant-plan", *CONSTANT_PLAN]
    return args + extra


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` steps (training losses are noisy mini-batch losses)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(runs: list[dict[str, Any]], out_dir: str) -> list[str]:
    """Loss vs step and loss vs cumulative modeled bytes per rank, one line per compressor, per task and schedule
    (:func:`demo_stats.section`; the lowest seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task in sorted({section(r) for r in runs}):
        task_runs = [r for r in runs if section(r) == task and r["seed"] == min(x["seed"] for x in runs)]
        schedule = other_schedule(task_runs[0])
        slug = task_runs[0]["task"] + (f"_{schedule}_lr" if schedule else "")     # digits_cnn_constant_lr
        for kind in ("step", "bytes"):
            fig, ax = plt.subplots(figsize=(9, 5.5))
            baseline_colors = iter(plt.get_cmap("tab10").colors)
            # A shade per budget, "auto" (a string) after the numbers.
            budgets = sorted({r["budget_bits"] for r in task_runs if r["budget_bits"] is not None},
                             key=lambda b: (isinstance(b, str), b if not isinstance(b, str) else 0.0))
            for run in task_runs:
                curves = run["curves"]
                loss = smooth(curves["train_loss"], 10)
                if kind == "step":
                    x = list(range(1, len(loss) + 1))
                else:
                    total, x = 0, []
                    for b in curves["bits"]:
                        total += b
                        x.append(total / 8 / 2**20)
                if run["budget_bits"] is None:      # fixed baselines: dotted (fp32 solid black)
                    color, style, width = ((0, 0, 0), "-", 2.0) if run["compressor"] == "fp32" else (
                        next(baseline_colors), ":", 1.4)
                else:                               # SafeBits solid reds, unscreened dashed blues
                    shade = 0.45 + 0.5 * budgets.index(run["budget_bits"]) / max(1, len(budgets) - 1)
                    screened = run["max_distortion"] is not None     # SafeBits on any menu records its screen
                    color = plt.get_cmap("Reds" if screened else "Blues")(shade)
                    style, width = ("-", 1.8) if screened else ("--", 1.6)
                ax.plot(x, loss, style, color=color, lw=width, label=run_label(run))
            ax.set_ylabel("training loss (nats, 10-step moving average, mean of 2 ranks)")
            if kind == "step":
                ax.set_xlabel("optimizer step")
                ax.set_title(f"{task}: training loss vs step, one line per compressor (2 ranks, seed "
                             f"{task_runs[0]['seed']})")
            else:
                ax.set_xscale("log")
                ax.set_xlabel("cumulative modeled bytes sent per rank (MiB, log scale)")
                ax.set_title(f"{task}: training loss vs cumulative modeled bytes, one line per compressor")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
            fig.tight_layout()
            path = os.path.join(out_dir, f"demo_{slug}_loss_vs_{kind}.png")
            fig.savefig(path, dpi=90)
            plt.close(fig)
            paths.append(path)
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="every compressor, budgets 1-8, twice the steps")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "results"))
    parser.add_argument("--mpi", action="store_true", help="horovodrun --mpi instead of --gloo")
    args, extra = parser.parse_known_args()
    args.out_dir = os.path.abspath(args.out_dir)     # the workers run in the repository root
    os.makedirs(args.out_dir, exist_ok=True)
    raw_path = os.path.join(args.out_dir, "demo_raw.json")
    worker_args = worker_arguments(args.full, extra)
    command = ["horovodrun", "-np", "2", "--mpi" if args.mpi else "--gloo", "python", *HVD_WORKER, "--out",
               raw_path, *worker_args]
    print("[demo] " + " ".join(command), flush=True)
    start = time.perf_counter()
    if os.path.exists(raw_path):
        os.remove(raw_path)

    def progress(line: str) -> None:     # the worker's one line per run (and any error)
        if "[demo]" in line or "Error" in line or "Traceback" in line:
            print(line.split("<stdout>:", 1)[-1], flush=True)

    try:
        launch.horovodrun(2, *HVD_WORKER, "--out", raw_path, *worker_args,
                          transport="mpi" if args.mpi else "gloo", timeout=7200, env={"OMP_NUM_THREADS": "1"},
                          on_line=progress)
    except launch.LaunchError as exc:
        print(f"[demo] {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    if not os.path.exists(raw_path):
        print("[demo] the worker wrote no results", file=sys.stderr)
        return 1
    with open(raw_path, encoding="utf-8") as f:
        raw = json.load(f)
    runs = raw["runs"]
    with open(os.path.join(args.out_dir, "demo.json"), "w", encoding="utf-8") as f:
        json.dump({"runs": [{k: r[k] for k in FIELDS} for r in runs]}, f, indent=1)
    total_s = time.perf_counter() - start
    md = table(runs, raw["collapse_factor"])
    header = (f"# SafeBits demo results\n\nCommand: `{' '.join(['python -m bench.demo', *sys.argv[1:]])}`; "
              f"{len(runs)} runs on 2 Horovod ranks; learning rate: "
              f"{'/'.join(sorted({r['lr_schedule'] for r in runs}))}; "
              f"LM corpus: {len(raw['corpus_files'])} CPython stdlib files "
              f"({raw['corpus_files'][0]} .. {raw['corpus_files'][-1]}); total wall time {total_s:.0f} s "
              f"(horovodrun startup included).\n\n")
    with open(os.path.join(args.out_dir, "demo.md"), "w", encoding="utf-8") as f:
        f.write(header + md)
    paths = plot(runs, args.out_dir)
    print(md)
    print(f"[demo] wrote demo.json, demo.md and {len(paths)} plots in {args.out_dir}; total {total_s:.0f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
