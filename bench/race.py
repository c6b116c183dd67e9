"""The race: time to quality on a rate-limited link, every compressor side by side (``python -m bench.race``).

What it measures. Two ranks in a network namespace whose loopback ``tc`` limits (:mod:`bench.netns`)
train a real task from the same initial weights on the same data order, once per compressor, and a validation
loss is taken every few steps off the clock (:mod:`bench.race_worker`). Per compressor, link and seed:

* **time to target**: the training seconds until the validation loss first reaches the target, linearly
  interpolated between the two evaluations around the crossing (``never`` if it does not). The target of a task
  and seed is the loss the uncompressed run (``ddp:none``, else Horovod's ``none``) of the same task, seed and link
  reaches at ``--target-at`` (75%) of its steps, so every run can reach it and the uncompressed one does at 75% of
  its time;
* **final loss** after all steps, and the training seconds of all steps;
* the bytes the loopback carried, and for SafeBits' ``auto`` the budgets it ran at.

Tasks (``--tasks``): ``gpt2_text``, the GPT-2-shaped decoder at 4 layers of width 192 on CPython's sources (bytes;
``bench.tasks.TextGPT``), and ``make demo``'s two: ``digits_cnn``, the CNN on scikit-learn's digits, and
``bytes_lm``, the byte LM on CPython's sources (``bench.tasks.make_task``). DDP rows run under
``torchrun`` (Gloo), Horovod rows under ``horovodrun --gloo``; one launch per compressor, task, seed and link
(:func:`launches`); one thread per rank, Horovod's ranks bound to cores as ``bench.link`` binds them (unbound, its
steps run longer and more unevenly: docs/RESULTS.md 4.2), torchrun's unbound. Writes ``race.json``, ``race.md``
(the tables) and ``race.png`` (the validation loss against training seconds, per task and link, seed 0) in
``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from bench import specs
from bench.link_report import budget_runs
from bench.netns import configure_link, delete_namespace, in_namespace, parse_rate
from bench.protocol import PIN_ENV

WORKER = ("-m", "bench.race_worker")
TASKS = ("gpt2_text", "digits_cnn", "bytes_lm")
RATES = ["100mbit", "1gbit", "unlimited"]
DDP_COMPRESSORS = ["ddp:none", "ddp:fp16", "ddp:powersgd1", "ddp:powersgd4", "ddp:safebits@2", "ddp:safebits@4.4",
                   "ddp:safebits@8", "ddp:safebits@auto"]
HOROVOD_COMPRESSORS = ["none", "fp16", "qsgd4", "safebits@4.4", "safebits@auto"]
STEPS = {"gpt2_text": 200, "digits_cnn": 250, "bytes_lm": 160}
"""Steps per task: the demo's tasks train as long as in ``make demo``."""
EVAL_EVERY = {"gpt2_text": 10, "digits_cnn": 10, "bytes_lm": 10}
TARGET_AT = 0.75
REFERENCES = ("ddp:none", "none")
"""The uncompressed runs whose loss sets a task's target, in order of preference."""


def target_of(curve: Sequence[Sequence[float]], steps: int, at: float = TARGET_AT) -> float:
    """The validation loss of ``curve`` (``(step, seconds, loss)`` points) at the first evaluation at or after
    ``at`` of ``steps``."""
    for step, _, loss in curve:
        if step >= at * steps:
            return float(loss)
    raise ValueError(f"the curve ends before {at:.0%} of {steps} steps")


def time_to(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """Training seconds until ``curve`` first reaches ``target``, interpolated linearly between the evaluation
    before the crossing and the one at it; None if it never does."""
    previous = None
    for point in curve:
        _, seconds, loss = point
        if loss <= target:
            if previous is None or previous[2] == loss:
                return float(seconds)
            fraction = (previous[2] - target) / (previous[2] - loss)
            return float(previous[1] + fraction * (seconds - previous[1]))
        previous = point
    return None


def summarize(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case, its target (from the same task, seed and link's uncompressed run) and time to it."""
    references: dict[tuple[str, int, str], dict[str, Any]] = {}
    for name in reversed(REFERENCES):
        for case in cases:
            if case["compressor"] == name:
                references[(case["task"], case["seed"], case["rate"])] = case
    rows = []
    for case in cases:
        reference = references.get((case["task"], case["seed"], case["rate"]))
        target = target_of(reference["curve"], reference["steps"]) if reference is not None else None
        rows.append({**case, "target": target,
                     "time_to_target": time_to(case["curve"], target) if target is not None else None})
    return rows


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def tables(rows: list[dict[str, Any]]) -> str:
    """One table per task: per compressor and link, time to target (mean over seeds, each seed's), final loss
    (mean, spread over seeds), training seconds, the megabytes the link carried (mean over seeds; ``-`` where the
    loopback's counter was not readable), and ``auto``'s budgets."""
    out = []
    rates = list(dict.fromkeys(row["rate"] for row in rows))
    for task in dict.fromkeys(row["task"] for row in rows):
        mine = [row for row in rows if row["task"] == task]
        targets = sorted({round(row["target"], 4) for row in mine if row["target"] is not None})
        out.append(f"### {task} ({mine[0]['parameters']:,} parameters in {mine[0]['tensors']} tensors; "
                   f"{mine[0]['steps']} steps; seeds {sorted({row['seed'] for row in mine})}; targets "
                   f"{', '.join(f'{t:.4f}' for t in targets)})\n")
        out.append("| compressor | " + " | ".join(f"{rate}: to target, s | final loss | all steps, s | link MB"
                                                   for rate in rates) + " |")
        out.append("| --- |" + " --- | --- | --- | --- |" * len(rates))
        notes = []
        for compressor in dict.fromkeys(row["compressor"] for row in mine):
            cells = []
            for rate in rates:
                runs = [row for row in mine if row["compressor"] == compressor and row["rate"] == rate]
                if not runs:
                    cells += ["-", "-", "-", "-"]
                    continue
                reached = [row["time_to_target"] for row in runs]
                each = ", ".join("never" if t is None else f"{t:.3g}" for t in reached)
                to_target = (f"**{_mean(reached):.3g}** ({each})" if all(t is not None for t in reached)
                             else f"never ({each})" if not any(t is not None for t in reached) else f"({each})")
                finals = [row["final_loss"] for row in runs]
                spread = (max(finals) - min(finals)) / 2
                carried = [row.get("loopback_bytes") for row in runs]
                cells += [to_target, f"{_mean(finals):.4f} ± {spread:.4f}",
                          f"{_mean([row['train_seconds'] for row in runs]):.3g}",
                          f"{_mean(carried) / 1e6:.4g}" if all(b is not None for b in carried) else "-"]
                if "@auto" in compressor:
                    notes.append(f"`{compressor}` at {rate}: " + "; ".join(
                        f"seed {row['seed']}: {budget_runs(row['budgets'])}" for row in runs))
            out.append(f"| {compressor} | " + " | ".join(cells) + " |")
        out.append("")
        out += [f"- {note}" for note in notes]
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Validation loss against training seconds, one panel per task (a row) and link (a column), seed 0's runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(row["task"] for row in rows))
    rates = list(dict.fromkeys(row["rate"] for row in rows))
    seed = min(row["seed"] for row in rows)
    fig, axes = plt.subplots(len(tasks), len(rates), figsize=(5.5 * len(rates), 4.2 * len(tasks)), squeeze=False)
    for ax, (task, rate) in zip(axes.flat, [(t, r) for t in tasks for r in rates], strict=True):
        target = None
        for row in rows:
            if row["task"] == task and row["rate"] == rate and row["seed"] == seed:
                seconds = [p[1] for p in row["curve"]]
                ax.plot(seconds, [p[2] for p in row["curve"]], label=row["compressor"], lw=1.2)
                target = row["target"]
        if target is not None:
            ax.axhline(target, color="grey", ls=":", lw=1)
        ax.set_title(f"{task}, {rate}")
        ax.set_xlabel("training seconds")
        ax.set_ylabel("validation loss (nats)")
        ax.set_xscale("log")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--rates", nargs="+", default=RATES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--ddp-compressors", nargs="*", default=DDP_COMPRESSORS)
    parser.add_argument("--compressors", nargs="*", default=HOROVOD_COMPRESSORS, help="Horovod rows")
    parser.add_argument("--gpt-steps", type=int, default=STEPS["gpt2_text"])
    parser.add_argument("--cnn-steps", type=int, default=STEPS["digits_cnn"])
    parser.add_argument("--lm-steps", type=int, default=STEPS["bytes_lm"])
    parser.add_argument("--out-dir", default=None, help="default results/race; with --from-json, its folder")
    parser.add_argument("--timeout", type=float, default=1500, help="seconds per launch")
    parser.add_argument("--from-json", nargs="+", help="no launch: print the tables of an earlier race.json and "
                        "write its race.md and race.png again (in --out-dir); with several, a later file's cases "
                        "replace the earlier ones' of the same task, seed, link and compressor, and the merged "
                        "race.json is written too")
    args = parser.parse_args(argv)
    for rate in args.rates:
        parse_rate(rate)
    for text in args.ddp_compressors:
        if not specs.parse(text).ddp:
            parser.error(f"--ddp-compressors takes ddp: specs, got {text!r}")
    for text in args.compressors:
        if specs.parse(text).ddp:
            parser.error(f"--compressors takes Horovod specs, got {text!r}")
    if args.out_dir is None:
        args.out_dir = os.path.dirname(os.path.abspath(args.from_json[0])) if args.from_json else "results/race"
    return args


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        earlier = merged([_read(path) for path in args.from_json])
        os.makedirs(args.out_dir, exist_ok=True)
        _write(args, earlier["command"], earlier["cases"], earlier["failed"], earlier["seconds"],
               with_json=len(args.from_json) > 1)
        print(tables(summarize(earlier["cases"])))
        return 0
    if shutil.which("ip") is None or shutil.which("tc") is None:
        print("[race] ip and tc not found: install iproute2; skipping the race.")
        return 0
    ns = f"sbrace-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True, check=False).returncode != 0:
        print("[race] cannot create a network namespace: the race needs root with CAP_NET_ADMIN; skipping it.")
        return 0

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return _race(args, ns)
    except KeyboardInterrupt:
        print("[race] interrupted", file=sys.stderr)
        return 130
    finally:
        delete_namespace(ns)
        signal.signal(signal.SIGTERM, previous)


def _read(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def case_key(case: dict[str, Any]) -> tuple[str, int, str, str]:
    return case["task"], case["seed"], case["rate"], case["compressor"]


def merged(races: list[dict[str, Any]]) -> dict[str, Any]:
    """Races' race.json contents as one: a later race's cases replace the earlier ones' with the same
    :func:`case_key` (rows run again), in the earlier order; their commands joined, their seconds added; a failed
    launch stays listed unless a later race ran its case."""
    cases: dict[tuple[str, int, str, str], dict[str, Any]] = {}
    failed: list[str] = []
    for race in races:
        for case in race["cases"]:
            cases[case_key(case)] = case
        ran = tuple(failed_prefix(*case_key(case)) for case in race["cases"])
        failed = [line for line in failed if not line.startswith(ran)] + race.get("failed", [])
    return {"command": "`; cases replaced by `".join(race.get("command", "python -m bench.race") for race in races),
            "seconds": sum(race.get("seconds", math.nan) for race in races), "cases": list(cases.values()),
            "failed": failed}


def finished_cases(raw: str, compressor: str) -> list[dict[str, Any]] | None:
    """The cases a launch of ``compressor`` wrote to ``raw`` once it had trained them all (rank 0 writes the file
    last), else None: a torchrun launch can still end with an error after that, when Gloo's threads abort in the
    interpreter's teardown (``terminate called without an active exception``), which changes none of its figures."""
    try:
        with open(raw, encoding="utf-8") as f:
            cases = json.load(f)["cases"]
    except (OSError, ValueError, KeyError):
        return None
    return cases if cases and all(case["compressor"] == compressor for case in cases) else None


def failed_prefix(task: str, seed: int, rate: str, compressor: str) -> str:
    """How a failed launch's line (in race.json's ``failed``) starts."""
    return f"{compressor} on {task} seed {seed} at {rate}: "


def launches(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(front end, compressor) per launch: every case in processes of its own. Cases that followed one another in
    one Horovod launch ran slower the later they came (the same ``none`` run 18% slower fourth than first), which
    favoured whichever ran first."""
    return [*(("ddp", c) for c in args.ddp_compressors), *(("horovod", c) for c in args.compressors)]


def _race(args: argparse.Namespace, ns: str) -> int:
    from safebits_hvd.frontends.launch import LaunchError, horovodrun, torchrun

    os.makedirs(args.out_dir, exist_ok=True)
    command = " ".join(["python -m bench.race", *sys.argv[1:]])
    cases: list[dict[str, Any]] = []
    failed: list[str] = []
    start = time.perf_counter()
    env = {"OMP_NUM_THREADS": "1", PIN_ENV: "1"}        # the worker binds Horovod's ranks only
    for rate in args.rates:
        print(f"[race] rate {rate}: {configure_link(ns, parse_rate(rate))}", flush=True)
        for task in args.tasks:
            steps = {"gpt2_text": args.gpt_steps, "digits_cnn": args.cnn_steps, "bytes_lm": args.lm_steps}[task]
            for seed in args.seeds:
                for front, compressor in launches(args):
                    raw = os.path.join(args.out_dir, f".race_{rate}_{task}_{seed}.json")
                    worker = [*WORKER, "--task", task, "--compressors", compressor, "--seed", str(seed),
                              "--steps", str(steps), "--eval-every", str(EVAL_EVERY[task]), "--out", raw]
                    launch = torchrun if front == "ddp" else horovodrun
                    if os.path.exists(raw):
                        os.remove(raw)                # a failed launch's: never read as this one's
                    error: LaunchError | None = None
                    try:
                        launch(2, *worker, prefix=in_namespace(ns), env=env, timeout=args.timeout,
                               on_line=_progress)
                    except LaunchError as raised:     # the other launches still run; the tables say what failed
                        error = raised
                    finished = finished_cases(raw, compressor)
                    if finished is None:
                        assert error is not None, raw     # a launch that exits 0 has written its results
                        print(f"[race] {compressor} on {task} seed {seed} at {rate} failed: {error}", flush=True)
                        failed.append(failed_prefix(task, seed, rate, compressor) + str(error).splitlines()[0])
                        continue
                    if error is not None:
                        print(f"[race] {compressor} on {task} seed {seed} at {rate}: its results were written, then "
                              f"the launch ended with an error (kept): {str(error).splitlines()[0]}", flush=True)
                    cases += [{**case, "task": task, "rate": rate, "front_end": front} for case in finished]
                    os.remove(raw)
                    _write(args, command, cases, failed, time.perf_counter() - start)    # what has run so far
    print(f"[race] wrote race.json, race.md and race.png in {args.out_dir}; total "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return 1 if failed else 0


def _write(args: argparse.Namespace, command: str, cases: list[dict[str, Any]], failed: list[str],
           seconds: float, with_json: bool = True) -> None:
    rows = summarize(cases)
    if with_json:
        with open(os.path.join(args.out_dir, "race.json"), "w", encoding="utf-8") as f:
            json.dump({"command": command, "seconds": seconds, "cases": cases, "failed": failed}, f)
    with open(os.path.join(args.out_dir, "race.md"), "w", encoding="utf-8") as f:
        f.write(f"# Race: time to quality\n\nCommand: `{command}`; 2 ranks in a network namespace whose loopback "
                f"tbf limits, one thread each; DDP rows under torchrun (Gloo), Horovod rows under horovodrun "
                f"--gloo; time to target: training seconds (evaluations excluded) until the validation loss "
                f"reaches the loss the uncompressed run reaches at {TARGET_AT:.0%} of its steps; link MB: the "
                f"bytes the namespace's loopback carried during the case (both ranks, the evaluations' barriers "
                f"included); {seconds:.0f} s so far.\n\n{tables(rows)}\n"
                + "".join(f"- failed: {line}\n" for line in failed))
    if rows and not any(math.isnan(row["final_loss"]) for row in rows):
        plot(rows, os.path.join(args.out_dir, "race.png"))


def _progress(line: str) -> None:
    if "[race]" in line or "Error" in line or "Traceback" in line:
        print(line.split("<stdout>:", 1)[-1].split("<stderr>:", 1)[-1], flush=True)


if __name__ == "__main__":
    sys.exit(main())
