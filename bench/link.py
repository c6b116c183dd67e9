"""Link benchmark (``make bench-link``): training throughput of every compressor on a rate-limited link.

What it measures. Two Horovod ranks (``horovodrun -np 2 --gloo``) run inside a private network namespace whose
loopback is limited with a token-bucket filter (``tc qdisc ... tbf rate R``); Gloo talks TCP over that loopback,
so every byte of every collective crosses the limited link and nothing else on the machine is touched. Each rank
runs one thread; Horovod's ranks bind themselves to their own cores, as ``mpirun`` binds ranks (``--no-pin``:
unbound; :func:`bench.protocol.pin_rank`), torchrun's are left unbound, as torchrun leaves them. For each
link rate, ONE launch of ``bench.hvd_worker link`` runs every (model, compressor) case in sequence (with
``--interleave``, each model's cases side by side, their timed steps alternating: the fair comparison on a shared
machine whose speed drifts over the minutes between cases) and records:

* step time (median over the timed steps, rank 0) and throughput: samples/s (2 ranks x batch per rank / step
  time; images or sequences) and the model's own unit (images/s, tokens/s for ``gpt2_small``: samples/s x 128);
* link bytes per step: the delta of the namespace loopback's ``tx_bytes`` over the case's timed steps, divided by
  the steps (both ranks' traffic, TCP/IP headers and Horovod's coordination messages included);
* wire bytes per step: ``StepRecord.wire_bytes`` summed over both ranks, where the compressor's record carries it
  (null otherwise, e.g. while compressors still send float32);
* modeled bytes per step: ``StepRecord.modeled_bits_total`` (else ``used_bits_total``) / 8 per rank, summed over
  both ranks; 4 (``none``) or 2 (``fp16``) bytes per parameter per rank for Horovod's own compressors;
* for every ``@auto`` row, its throughput over the best fixed row of its front end and over ``none``, each with
  a 90% bootstrap interval (:func:`bench.link_stats.ratio_interval`: the timed steps resampled, step *i* of every
  row together, the best chosen again in each resample), and how many of its timed steps ran at the best fixed
  row's budget (:func:`bench.link_stats.fixed_budget`): whether it chose right, apart from how fast its instance ran;
* a link probe per launch: fp32 allreduces with no model (loopback bytes / their time), the rate the link gave;
* against the physical limit: step time / (``none`` step time on the unlimited link + modeled bytes / link rate),
  when ``unlimited`` was measured in the same invocation.

Models (``--models``; :mod:`bench.tasks`):

* ``resnet18``: a CIFAR-style ResNet-18 (3x3 stem, no max-pool; 11.2M parameters in 62 tensors) on synthetic
  3xSxS images, S = ``--image-size`` (32 by default; e.g. 224 for ImageNet-size inputs: the same gradient bytes,
  49 times the compute, since the CIFAR stem does not downsample); ``--cnn-batch`` images per rank; images/s.
* ``gpt2_small``: a GPT-2-shaped decoder built here (12 pre-LayerNorm layers, width 256, 4 heads, vocabulary
  8,192, context 128, learned positions, LM head tied to the token embedding; 11.6M parameters in 148 tensors)
  on synthetic token ids, next-token cross-entropy, causal ``scaled_dot_product_attention``, AdamW;
  ``--gpt-batch`` sequences of 128 tokens per rank; tokens/s. Not in the default ``--models``.
* ``bytes_lm``: the demo's byte-level transformer LM (``bench.tasks``), ``--lm-batch`` windows of 64
  bytes per rank, Horovod rows only; sequences/s.

Default ``--models``: ``resnet18 bytes_lm``. Compressors: ``none`` and ``fp16`` (Horovod's), ``qsgd4``,
``topk10_ef``, ``safebits@2``, ``safebits@4.4``, ``safebits@8``.

DDP rows (``resnet18`` and ``gpt2_small``, those of ``--models``; no launch when neither is selected): one
``torchrun`` launch of ``bench.ddp_worker`` per rate, on the same link, running every selected DDP model,
with PyTorch DDP and a communication hook: ``ddp:none`` (DDP's default allreduce), ``ddp:fp16``
(``fp16_compress_hook``), ``ddp:powersgd1`` and ``ddp:powersgd4`` (PowerSGD at rank 1 and 4), ``ddp:safebits@B``
(SafeBits' DDP hook). Their ``x none`` / ``x fp16`` columns compare with ``ddp:none`` / ``ddp:fp16``. With
``--quality-steps N`` every DDP compressor (plus ``--quality-extra``) also trains N steps of a fixed learnable task
on the unlimited link (ResNet-18 at 32x32, whatever ``--models`` and ``--image-size`` say), and the held-out loss
and link bytes go in a table of their own: the compressors' quality at their bytes.

The link is :mod:`bench.netns`'s; the derived figures are :mod:`bench.link_stats`', the tables and the plot
:mod:`bench.link_report`'s; this module parses the command line and launches the workers.

Run it as root (it needs CAP_NET_ADMIN for ``ip netns`` and ``tc``; without it, it says so and exits 0)::

    make bench-link                                       # --rates 1gbit
    .venv/bin/python -m bench.link --rates 100mbit 1gbit 10gbit unlimited
    .venv/bin/python -m bench.link --quick                # smoke run: 1 rate, 2 steps, CNN, 3 + 3 compressors
    .venv/bin/python -m bench.link --quick --models gpt2_small --gpt-batch 4     # the same for the transformer
    .venv/bin/python -m bench.link --rates 1gbit unlimited --models resnet18 gpt2_small --image-size 224 \
        --cnn-batch 4 --gpt-batch 8                       # ImageNet-size images and the GPT-2-shaped decoder
    .venv/bin/python -m bench.link --rates 1gbit unlimited --models resnet18 --cnn-batch 16 --interleave \
        --compressors none fp16 safebits@2 safebits@4.4 safebits@8 safebits@auto \
        --ddp-compressors ddp:none ddp:fp16 ddp:safebits@2 ddp:safebits@4.4 ddp:safebits@8 ddp:safebits@auto
                                                          # auto against every fixed choice, step by step
    .venv/bin/python -m bench.link --rates 1gbit unlimited --models resnet18 --compressors none \
        --quality-steps 40                                # the DDP rows and their training run
    .venv/bin/python -m bench.link --from-json results/link.json   # an earlier launch's tables, derived again

Writes ``results/link.json`` (raw and derived figures, the command, rates, the image size and per-rank batches,
per model its parameter and tensor counts, throughput unit and input shape, the qdisc statistics),
``results/link.md`` (one table per model, headed by its parameters, tensors and per-rank batch with the image size
or sequence length) and ``results/link_throughput.png`` (throughput in each model's unit against link rate).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Iterable
from typing import Any

from bench import link_phases, specs
from bench.link_report import plot, quality_table, report_tables
from bench.link_stats import model_facts, summarize
from bench.netns import (
    burst_bytes,
    configure_link,
    delete_namespace,
    in_namespace,
    parse_rate,
    qdisc_stats,
    run_command,
)
from bench.protocol import PIN_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HVD_WORKER = ("-m", "bench.hvd_worker")      # launched as modules from the repository root (the launchers' cwd)
DDP_WORKER = ("-m", "bench.ddp_worker")
RATES = ["100mbit", "1gbit", "10gbit", "unlimited"]
COMPRESSORS = ["none", "fp16", "qsgd4", "topk10_ef", "safebits@2", "safebits@4.4", "safebits@8"]
QUICK_COMPRESSORS = ["none", "fp16", "safebits@4.4"]
DDP_COMPRESSORS = ["ddp:none", "ddp:fp16", "ddp:powersgd1", "ddp:powersgd4", "ddp:safebits@2", "ddp:safebits@4.4",
                   "ddp:safebits@8"]
QUICK_DDP_COMPRESSORS = ["ddp:none", "ddp:fp16", "ddp:safebits@4.4"]
MODELS = ["resnet18", "bytes_lm", "gpt2_small"]
DEFAULT_MODELS = ["resnet18", "bytes_lm"]
DDP_MODELS = ["resnet18", "gpt2_small"]
"""The models the DDP worker runs; the others of ``--models`` get Horovod rows only."""


def worker_args(args: argparse.Namespace, out: str) -> list[str]:
    return ["--out", out, "--models", *args.models, "--compressors", *args.compressors,
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--rounds", str(args.rounds),
            "--cnn-batch", str(args.cnn_batch), "--lm-batch", str(args.lm_batch), "--gpt-batch", str(args.gpt_batch),
            "--image-size", str(args.image_size), *(["--interleave"] if args.interleave else [])]


def ddp_models(args: argparse.Namespace) -> list[str]:
    """The selected models that the DDP worker runs (:data:`DDP_MODELS`), in ``--models`` order."""
    return [m for m in args.models if m in DDP_MODELS]


def ddp_worker_args(args: argparse.Namespace, out: str, quality: bool = False) -> list[str]:
    """The DDP worker's arguments: the timed cases of :func:`ddp_models`, or (``quality``) the training run, which
    is ResNet-18 at 32x32 whatever ``--models`` says."""
    compressors = args.ddp_compressors + (args.quality_extra if quality else [])
    return ["--out", out, "--models", *(["resnet18"] if quality else ddp_models(args)), "--compressors",
            *compressors, "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--rounds", str(1 if quality else args.rounds), "--cnn-batch", str(args.cnn_batch),
            "--gpt-batch", str(args.gpt_batch), "--image-size", str(args.image_size),
            "--quality-steps", str(args.quality_steps if quality else 0),
            *(["--interleave"] if args.interleave and not quality else [])]


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="*", default=["1gbit"], choices=RATES,
                        help="link rates to time (none given: only the --quality-steps training run)")
    parser.add_argument("--compressors", nargs="*", default=COMPRESSORS,
                        help="none, fp16, or registry names of safebits_hvd.frontends.baselines (name@budget_bits); "
                             "none given: only the DDP rows")
    parser.add_argument("--models", nargs="+", default=None, choices=MODELS,
                        help=f"default {' '.join(DEFAULT_MODELS)} (--quick: resnet18); DDP rows for "
                             f"{' and '.join(DDP_MODELS)}")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the compressor list this many times in turn in each launch and pool each "
                             "compressor's steps (interleaving spreads a shared machine's drift over all of them)")
    parser.add_argument("--interleave", action="store_true",
                        help="run each model's compressors side by side in a launch, their timed steps alternating "
                             "(a shared machine's drift falls on all of them step by step; the cases' models are "
                             "all in memory at once)")
    parser.add_argument("--cnn-batch", type=int, default=16, help="ResNet-18 images per rank per step")
    parser.add_argument("--image-size", type=int, default=32,
                        help="ResNet-18 image side (synthetic 3xSxS images; e.g. 224 for ImageNet-size inputs)")
    parser.add_argument("--lm-batch", type=int, default=16, help="bytes_lm sequences (64 bytes) per rank per step")
    parser.add_argument("--gpt-batch", type=int, default=8,
                        help="gpt2_small sequences (128 tokens) per rank per step")
    parser.add_argument("--ddp-compressors", nargs="*", default=DDP_COMPRESSORS,
                        help="DDP rows (torchrun; for the models of --models among resnet18 and gpt2_small): "
                             "ddp:none, ddp:fp16, ddp:powersgdR, ddp:safebits@B; none to skip them")
    parser.add_argument("--quality-steps", type=int, default=0,
                        help="train every DDP compressor this many steps on the unlimited link (0: no training run)")
    parser.add_argument("--quality-extra", nargs="*", default=[],
                        help="DDP compressors of the training run only (e.g. ddp:safebits@0.3 at PowerSGD's bytes)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: first rate only, 1 warm-up and 2 timed steps, ResNet-18 unless --models "
                             "says otherwise, "
                             + ", ".join(QUICK_COMPRESSORS + QUICK_DDP_COMPRESSORS))
    parser.add_argument("--phases", nargs="+", default=None, metavar="RATE:STEPS",
                        help="the changing-link run instead of --rates: every compressor trains the phases' steps "
                             "in one case while the link changes under it (e.g. unlimited:40 100mbit:40 1gbit:40)")
    parser.add_argument("--from-json", default=None, metavar="LINK_JSON",
                        help="measure nothing: print the tables of an earlier launch's link.json again, derived "
                             "afresh from its raw cases (figures this version adds, such as the intervals, too)")
    parser.add_argument("--no-pin", action="store_true",
                        help="leave Horovod's ranks unbound (by default each binds itself to its own cores, as "
                             "mpirun binds ranks: bench.protocol.pin_rank; DDP's are never bound)")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "results"))
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per horovodrun launch")
    args = parser.parse_args(None if argv is None else list(argv))
    args.out_dir = os.path.abspath(args.out_dir)     # the workers run in the repository root
    if args.models is None:
        args.models = ["resnet18"] if args.quick else list(DEFAULT_MODELS)
    args.models = list(dict.fromkeys(args.models))
    if args.quick:
        args.rates, args.warmup, args.steps = args.rates[:1], 1, 2
        args.compressors = QUICK_COMPRESSORS
        args.ddp_compressors, args.quality_steps = QUICK_DDP_COMPRESSORS, 0
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0 or args.quality_steps < 0:
        parser.error("--steps and --rounds must be >= 1, --warmup and --quality-steps >= 0")
    if min(args.cnn_batch, args.lm_batch, args.gpt_batch, args.image_size) < 1:
        parser.error("--cnn-batch, --lm-batch, --gpt-batch and --image-size must be >= 1")
    if args.phases is not None:
        try:
            args.phases = [link_phases.parse_phase(text) for text in args.phases]
            for rate, _ in args.phases:
                parse_rate(rate)
        except ValueError as exc:
            parser.error(str(exc))
    for texts, ddp in ((args.compressors, False), (args.ddp_compressors + args.quality_extra, True)):
        for text in texts:
            try:
                spec = specs.parse(text)
            except ValueError as exc:
                parser.error(str(exc))
            if spec.ddp != ddp:
                parser.error(f"{text!r}: --compressors takes Horovod specs, --ddp-compressors and --quality-extra "
                             f"ddp: ones")
    return args


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        with open(args.from_json, encoding="utf-8") as f:
            print(report_tables(summarize(json.load(f)["raw"])))
        return 0
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        print(f"[link] {' and '.join(missing)} not found: install the Debian package iproute2 "
              f"(apt-get install iproute2); skipping the link benchmark.")
        return 0
    ns = f"sblink-{os.getpid()}"
    made = run_command(["ip", "netns", "add", ns], check=False)
    if made.returncode != 0:
        print(f"[link] cannot create a network namespace ({made.stderr.strip() or 'ip netns add failed'}): the link "
              f"benchmark needs root with CAP_NET_ADMIN (ip netns, tc); skipping it.")
        return 0

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return _bench(args, ns) if args.phases is None else _changing_link(args, ns)
    except KeyboardInterrupt:
        print("[link] interrupted", file=sys.stderr)
        return 130
    finally:
        delete_namespace(ns)
        signal.signal(signal.SIGTERM, previous)


def launch_env(args: argparse.Namespace, horovod: bool) -> dict[str, str]:
    """The ranks' environment: one thread each (two ranks share two cores: more threads slow every compressor).
    Horovod's ranks bind themselves to their own cores unless ``--no-pin``, as ``mpirun`` binds ranks; torchrun's
    are left unbound, as torchrun leaves them: bound, Horovod's steps ran faster and evener, DDP's ResNet-18 steps
    slower (docs/RESULTS.md 4.2, "Ranks bound to cores")."""
    return {"OMP_NUM_THREADS": "1", PIN_ENV: "1" if horovod and not args.no_pin else "0"}


def binding(args: argparse.Namespace) -> dict[str, bool]:
    """Whether each front end's ranks were bound to their own cores (:func:`launch_env`)."""
    return {"horovod": launch_env(args, True)[PIN_ENV] == "1", "ddp": launch_env(args, False)[PIN_ENV] == "1"}


def binding_text(args: argparse.Namespace) -> str:
    bound = binding(args)
    return "; ".join(f"{name} ranks {'bound to their own cores' if bound[key] else 'unbound'}"
                     for key, name in (("horovod", "Horovod"), ("ddp", "DDP")))


def _bench(args: argparse.Namespace, ns: str) -> int:
    from safebits_hvd.frontends.launch import LaunchError, horovodrun, torchrun

    os.makedirs(args.out_dir, exist_ok=True)
    command = " ".join(["python -m bench.link", *sys.argv[1:]])
    runs: dict[str, list[dict[str, Any]]] = {}
    meta: dict[str, dict[str, Any]] = {}
    failed = []
    start = time.perf_counter()
    for rate in args.rates:
        bps = parse_rate(rate)
        qdisc = configure_link(ns, bps)
        print(f"[link] rate {rate}: {qdisc}", flush=True)
        raw_path = os.path.join(args.out_dir, f".link_raw_{rate}.json")
        if os.path.exists(raw_path):
            os.remove(raw_path)
        t0, load_before = time.perf_counter(), os.getloadavg()
        try:
            raw: dict[str, Any] = {"cases": []}
            if args.compressors:
                horovodrun(2, *HVD_WORKER, "link", *worker_args(args, raw_path), prefix=in_namespace(ns),
                           env=launch_env(args, horovod=True), timeout=args.timeout, on_line=_progress)
                raw = read_raw(raw_path)
            if args.ddp_compressors and ddp_models(args):
                torchrun(2, *DDP_WORKER, *ddp_worker_args(args, raw_path), prefix=in_namespace(ns),
                         env=launch_env(args, horovod=False), timeout=args.timeout, on_line=_progress)
                raw["cases"] += read_raw(raw_path)["cases"]
        except LaunchError as exc:
            print(f"[link] rate {rate} failed: {exc}", file=sys.stderr)
            failed.append(rate)
            continue
        runs[rate] = raw.pop("cases")
        meta[rate] = {"rate_bps": bps, "burst_bytes": None if bps is None else burst_bytes(bps), "qdisc": qdisc,
                      "qdisc_stats": qdisc_stats(ns), "wall_s": time.perf_counter() - t0,
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg(), **raw}
    quality: list[dict[str, Any]] = []
    if args.quality_steps and args.ddp_compressors:
        configure_link(ns, None)
        raw_path = os.path.join(args.out_dir, ".link_raw_quality.json")
        try:
            torchrun(2, *DDP_WORKER, *ddp_worker_args(args, raw_path, quality=True), prefix=in_namespace(ns),
                     env=launch_env(args, horovod=False), timeout=args.timeout, on_line=_progress)
            quality = read_raw(raw_path)["cases"]
        except LaunchError as exc:
            print(f"[link] training run failed: {exc}", file=sys.stderr)
            failed.append("quality")
    if not runs and not quality:
        return 1
    rows = summarize(runs)
    models = model_facts(rows)
    md = report_tables(rows)
    total = time.perf_counter() - start
    with open(os.path.join(args.out_dir, "link.json"), "w", encoding="utf-8") as f:
        json.dump({"command": command, "rates": list(runs), "models": models, "compressors": args.compressors,
                   "ddp_compressors": args.ddp_compressors, "ddp_models": ddp_models(args),
                   "image_size": args.image_size, "batch_per_rank": {"resnet18": args.cnn_batch,
                                                                     "bytes_lm": args.lm_batch,
                                                                     "gpt2_small": args.gpt_batch},
                   "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
                   "interleave": args.interleave, "bound": binding(args), "launches": meta,
                   "rows": rows, "raw": runs,
                   "failed_rates": failed, "total_s": total, "quality_steps": args.quality_steps,
                   "quality": quality}, f, indent=1)
    with open(os.path.join(args.out_dir, "link.md"), "w", encoding="utf-8") as f:
        f.write(f"# Link benchmark\n\nCommand: `{command}`; 2 ranks (Gloo; Horovod rows under horovodrun, "
                f"ddp: rows under torchrun) in a network namespace whose loopback is limited by tbf; "
                f"{args.warmup} warm-up + {args.steps} timed steps per case, {args.rounds} round(s) of every "
                f"compressor {'side by side, their timed steps alternating' if args.interleave else 'in turn'} "
                f"per launch; {binding_text(args)}; total "
                f"{total:.0f} s.\n\n" + probe_line(meta) + "\n\n" + md
                + (f"\n### DDP training run ({args.quality_steps} steps, unlimited link)\n\n" + quality_table(quality)
                   if quality else ""))
    if rows:
        plot(rows, os.path.join(args.out_dir, "link_throughput.png"))
    print(md)
    if quality:
        print(quality_table(quality))
    print(probe_line(meta))
    print(f"[link] wrote link.json, link.md and link_throughput.png in {args.out_dir}; total {total:.0f} s",
          flush=True)
    return 1 if failed else 0


def _changing_link(args: argparse.Namespace, ns: str) -> int:
    """The changing-link run (:mod:`bench.link_phases`): one launch per front end, every compressor one case of
    all the phases' steps, the qdisc changed from here as rank 0 reports its steps."""
    from safebits_hvd.frontends.launch import LaunchError, horovodrun, torchrun

    os.makedirs(args.out_dir, exist_ok=True)
    command = " ".join(["python -m bench.link", *sys.argv[1:]])
    phases = args.phases
    args.steps = sum(steps for _, steps in phases)
    step_file = os.path.join(args.out_dir, ".link_step")
    cases: list[dict[str, Any]] = []
    changes: list[tuple[int, int, int, float]] = []
    launches: list[tuple[Any, tuple[str, ...], Any]] = []       # (launcher, worker module, its arguments for a path)
    if args.compressors:
        launches.append((horovodrun, (*HVD_WORKER, "link"), lambda out: worker_args(args, out)))
    if args.ddp_compressors and ddp_models(args):
        launches.append((torchrun, DDP_WORKER, lambda out: ddp_worker_args(args, out)))
    start = time.perf_counter()
    for index, (runner, module, arguments) in enumerate(launches):
        raw_path = os.path.join(args.out_dir, f".link_phases_raw_{index}.json")
        for path in (raw_path, step_file):
            if os.path.exists(path):
                os.remove(path)
        configure_link(ns, parse_rate(phases[0][0]))
        changer = link_phases.LinkChanger(step_file, phases, lambda rate: configure_link(ns, parse_rate(rate)))
        changer.start()
        try:
            runner(2, *module, *arguments(raw_path), "--step-file", step_file,
                   prefix=in_namespace(ns), env=launch_env(args, horovod=runner is horovodrun), timeout=args.timeout,
                   on_line=_progress)
        except LaunchError as exc:
            print(f"[link] changing-link launch failed: {exc}", file=sys.stderr)
            return 1
        finally:
            changer.stop()
        cases += read_raw(raw_path)["cases"]
        changes += changer.changes
    summary = link_phases.summarize(cases, phases)
    md = link_phases.table(summary, phases)
    total = time.perf_counter() - start
    with open(os.path.join(args.out_dir, "link_phases.json"), "w", encoding="utf-8") as f:
        json.dump({"command": command, "phases": phases, "summary": summary, "changes": changes, "raw": cases,
                   "bound": binding(args), "total_s": total}, f, indent=1)
    with open(os.path.join(args.out_dir, "link_phases.md"), "w", encoding="utf-8") as f:
        f.write(f"# Changing link\n\nCommand: `{command}`; {binding_text(args)}; {total:.0f} s.\n\n" + md)
    link_phases.plot(summary, phases, os.path.join(args.out_dir, "link_phases.png"))
    print(md)
    print(f"[link] wrote link_phases.json, link_phases.md and link_phases.png in {args.out_dir}; total {total:.0f} s",
          flush=True)
    return 0


def read_raw(path: str) -> dict[str, Any]:
    """A worker's raw JSON (then removed, so a later launch cannot be mistaken for it)."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    os.remove(path)
    return raw


def probe_line(meta: dict[str, dict[str, Any]]) -> str:
    """One sentence: per rate, the rate the link probe (plain fp32 allreduces) achieved on the loopback."""
    parts = []
    for rate, info in meta.items():
        probe = info.get("probe") or {}
        bps = probe.get("achieved_bits_per_s")
        if bps:
            parts.append(f"{rate}: {bps / 1e9:.2f} Gbit/s ({statistics.median(probe['times_s']):.3f} s for "
                         f"{statistics.median(probe['link_bytes']) / 1e6:.1f} MB)")
    return ("Link probe (fp32 allreduce of " + f"{next(iter(meta.values()))['probe']['elements']:,}" +
            " values, no model; loopback bytes / median time): " + "; ".join(parts) + ".") if parts else ""


def _progress(line: str) -> None:
    if "[link]" in line or "Error" in line or "Traceback" in line:
        print(line.split("<stdout>:", 1)[-1].split("<stderr>:", 1)[-1], flush=True)


if __name__ == "__main__":
    sys.exit(main())
