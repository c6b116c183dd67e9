"""Thresholds from evidence: SafeBits' screen ``(max_distortion, min_cosine)`` x budget on the demo tasks
(docs/RESULTS.md, section 9.1).

Launches ONE ``horovodrun -np 2 --gloo`` of ``bench.hvd_worker demo`` (the demo's tasks, models, data order and
collapse rule) with ``--compressors safebits unscreened``, one SafeBits run per budget, screen and seed, and the
unscreened ablation per budget and seed as the reference. Writes ``<out-dir>/threshold_sweep.json`` (the demo's
per-run fields plus ``max_distortion``, ``min_cosine``, ``bits_per_param``) and ``<out-dir>/threshold_sweep.md``:
per task, one row per screen, and per budget the metric's mean ± std over seeds, the bits per parameter actually
sent, the steps over budget (violations) and the collapses.

    .venv/bin/python -m bench.experiments.threshold_sweep --lr-schedule constant  # docs/RESULTS.md, section 9
    .venv/bin/python -m bench.experiments.threshold_sweep --distortions 0.5 --cosines 0.7 0.8 --budgets 2 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

from bench.demo_stats import DEFAULT_THRESHOLDS, higher_is_better, mean_std
from bench.tasks import SCHEDULES
from safebits_hvd.frontends import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIELDS = ["task", "compressor", "budget_bits", "seed", "final_loss", "final_metric", "metric_name",
          "compression_ratio", "violations", "escalations", "collapsed", "wall_s", "max_distortion", "min_cosine",
          "bits_per_param"]


def screen_key(run: dict[str, Any]) -> str:
    """Row name: ``d=0.5, c=0.8`` (``(default)`` appended for the library's), or ``unscreened``."""
    if run["compressor"] != "safebits":
        return "unscreened"
    key = f"d={run['max_distortion']:g}, c={run['min_cosine']:g}"
    return key + (" (default)" if (run["max_distortion"], run["min_cosine"]) == DEFAULT_THRESHOLDS else "")


def sweep_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: per task, rows = screens (then unscreened), columns = budgets; each cell
    ``metric mean ± std / bits per parameter / violating steps / collapses``."""
    cells: dict[tuple[str, str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        cells[(r["task"], screen_key(r), r["budget_bits"])].append(r)
    lines: list[str] = []
    for task in dict.fromkeys(r["task"] for r in runs):
        task_runs = [r for r in runs if r["task"] == task]
        metric = task_runs[0]["metric_name"]
        budgets = sorted({r["budget_bits"] for r in task_runs})
        rows = sorted({screen_key(r) for r in task_runs}, key=lambda k: (k == "unscreened", k))
        lines += [f"### {task} ({metric}, {'higher' if higher_is_better(metric) else 'lower'} is better)", "",
                  "| screen | " + " | ".join(f"budget {b:g}" for b in budgets) + " |",
                  "| --- |" + " --- |" * len(budgets)]
        for row in rows:
            out = []
            for b in budgets:
                rs = cells.get((task, row, b), [])
                if not rs:
                    out.append("-")
                    continue
                mean, std = mean_std([r["final_metric"] for r in rs])
                bpp = mean_std([r["bits_per_param"] or 0.0 for r in rs])[0]
                out.append(f"{mean:.4f} ± {std:.4f} / {bpp:.2f} b / {sum(r['violations'] for r in rs)} v / "
                           f"{sum(r['collapsed'] for r in rs)}/{len(rs)} c")
            lines.append(f"| {row} | " + " | ".join(out) + " |")
        lines.append("")
    lines.append("Cell: metric mean ± sample std over seeds / modeled bits per parameter per step actually sent "
                 "(mean) / steps over budget summed over seeds (violations) / collapsed runs of all. Collapse: the "
                 "demo's rule (bench/demo_stats.py).")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--distortions", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    parser.add_argument("--cosines", type=float, nargs="+", default=[0.7, 0.8, 0.9])
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 2.0, 4.4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--cnn-steps", type=int, default=120)
    parser.add_argument("--lm-steps", type=int, default=80)
    parser.add_argument("--tasks", nargs="+", default=["digits_cnn", "bytes_lm"])
    parser.add_argument("--no-unscreened", action="store_true", help="SafeBits runs only")
    parser.add_argument("--lr-schedule", choices=SCHEDULES, default=SCHEDULES[0],
                        help="the worker's learning-rate schedule (default: the demo's); the grid of "
                             "docs/RESULTS.md section 9.1 says which")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "results"))
    args = parser.parse_args()
    args.out_dir = os.path.abspath(args.out_dir)     # the workers run in the repository root
    os.makedirs(args.out_dir, exist_ok=True)
    raw_path = os.path.join(args.out_dir, "threshold_sweep_raw.json")
    if os.path.exists(raw_path):
        os.remove(raw_path)
    thresholds = [f"{d:g}:{c:g}" for d in args.distortions for c in args.cosines]
    worker_args = ["--out", raw_path, "--seeds", *map(str, args.seeds), "--cnn-steps", str(args.cnn_steps),
                   "--lm-steps", str(args.lm_steps), "--tasks", *args.tasks, "--budgets", *map(str, args.budgets),
                   "--thresholds", *thresholds, "--lr-schedule", args.lr_schedule, "--compressors", "safebits",
                   *([] if args.no_unscreened else ["unscreened"])]
    print("[sweep] bench.hvd_worker demo " + " ".join(worker_args), flush=True)
    start = time.perf_counter()
    try:
        launch.horovodrun(2, "-m", "bench.hvd_worker", "demo", *worker_args, timeout=4 * 3600,
                          env={"OMP_NUM_THREADS": "1"},
                          on_line=lambda line: print(line.split("<stdout>:", 1)[-1], flush=True)
                          if "[demo]" in line or "Error" in line or "Traceback" in line else None)
    except launch.LaunchError as exc:
        print(f"[sweep] {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    with open(raw_path, encoding="utf-8") as f:
        runs = json.load(f)["runs"]
    total_s = time.perf_counter() - start
    with open(os.path.join(args.out_dir, "threshold_sweep.json"), "w", encoding="utf-8") as f:
        json.dump({"runs": [{k: r[k] for k in FIELDS} for r in runs], "total_wall_s": total_s}, f, indent=1)
    command = " ".join(["python -m bench.experiments.threshold_sweep", *sys.argv[1:]])
    md = (f"# SafeBits threshold sweep\n\nCommand: `{command}`"
          f"; {len(runs)} runs; total wall time {total_s:.0f} s.\n\n" + sweep_table(runs))
    with open(os.path.join(args.out_dir, "threshold_sweep.md"), "w", encoding="utf-8") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
