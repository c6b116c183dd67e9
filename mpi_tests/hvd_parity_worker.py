"""Horovod worker: SafeBits used the way Horovod's own recipes use a compressor, one scenario after another.

Run as ``HOROVOD_DYNAMIC_PROCESS_SETS=1 horovodrun -np 2 --gloo python mpi_tests/hvd_parity_worker.py
--scenarios process_sets,gradscaler`` (``mpi_tests/test_parity.py`` launches it). Scenarios:

* ``process_sets`` (``HOROVOD_DYNAMIC_PROCESS_SETS=1``; np 4: sets [0, 1] and [2, 3], np 2: [0] and [1]): every set
  trains its own model at the same time with ``hvd.DistributedOptimizer(..., process_set=ps)`` and
  ``SafeBits(..., process_set=ps)``; it must finish, the parameters and every step's allocation digest must be
  equal within each set, the statistics exchange must span exactly the set, and each set's loss must fall.
* ``missing_process_set`` (np 2, alone in its launch): rank 0 trains on a set [0] with SafeBits built *without*
  ``process_set`` and ``timeout=3``; it must raise :class:`~safebits_hvd.SafeBitsTimeoutError` saying a rank never
  joined, within 10 s, instead of hanging. A Horovod op stays pending, so the ranks end with ``os._exit``.
* ``gradscaler``: Horovod's mixed-precision recipe on CPU (``torch.amp.GradScaler("cpu", init_scale=2**40)``,
  float16 autocast, ``opt.synchronize(); scaler.unscale_(opt); with opt.skip_synchronize(): scaler.step(opt)``),
  run with ``hvd.Compression.none`` and with SafeBits' defaults: the first steps overflow with both, the scale falls
  to (nearly) the same value, the loss falls, parameters are bitwise equal across ranks, and the SafeBits records
  list the non-finite tensors.
* ``diverging``: a generator and a discriminator trained alternately with two optimizers (two SafeBits), at a
  learning rate that overflows: with SafeBits nothing raises, and NaN/Inf reach ``p.grad`` on every rank from (about)
  the step they do with ``hvd.Compression.none``; the records list them.
* ``unnamed``: ``hvd.DistributedOptimizer(opt)`` without ``named_parameters`` and ``SafeBits(opt)`` (one and two
  parameter groups) or ``SafeBits(model.parameters())``: SafeBits names every parameter as Horovod does
  (``allreduce.noname.<group>.<index>``), parameters stay bitwise equal across ranks and the loss falls.
* ``memory``: 10,000 steps of a small model with SafeBits' defaults, reading ``last_step`` every step; the resident
  memory (``VmRSS``) after step 10,000 is within 5% of that after step 1,000 on every rank.

Outcomes are agreed across ranks (``hvd.allgather_object``); rank 0 prints ``PASS name (seconds, np) info`` or
``FAIL name ...`` per scenario and ``SUMMARY k/n scenarios passed``; the exit status is non-zero if any failed.
``--mutation NAME`` breaks one scenario's setup on purpose (see ``--help``), to check that its checks catch it.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import horovod.torch as hvd
import torch
from scenario_runner import ScenarioFailure, check, params_digest, run_scenarios
from torch import nn

import safebits_hvd as sb
from safebits_hvd.frontends.launch import exit_without_finalization

IN_FEATURES = 20
CLASSES = 4
BATCH = 64
STEPS = 30             # process_sets and unnamed: enough for the loss to fall by 15-20% at lr 1.0
TIMEOUT = 30.0          # SafeBits(timeout=): a hang becomes a SafeBitsTimeoutError, a FAIL line, not a dead launch


def mlp(hidden: int = 64) -> nn.Sequential:
    """The small classifier every scenario trains (6 tensors)."""
    return nn.Sequential(nn.Linear(IN_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, CLASSES))


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``seed``: labels from a fixed linear teacher."""
    x = torch.randn(BATCH, IN_FEATURES, generator=torch.Generator().manual_seed(seed))
    w = torch.randn(IN_FEATURES, CLASSES, generator=torch.Generator().manual_seed(12345))
    return x, (x @ w).argmax(dim=1)


def eval_loss(model: nn.Module, seed: int = 999_999) -> float:
    """Cross-entropy on a fixed batch (the same on every rank; no collective)."""
    x, y = batch(seed)
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x).float(), y))


def has_nonfinite(params: Iterable[torch.Tensor]) -> bool:
    """Whether any ``p.grad`` holds NaN or Inf."""
    return any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in params)


def prefixed(tag: str, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``model.named_parameters()`` under distinct names per scenario (no stale Horovod op can match a later one)."""
    return [(f"{tag}.{n}", p) for n, p in model.named_parameters()]


# ------------------------------------------------------------------------------------------ process sets
def run_process_sets(mutation: str = "") -> dict[str, Any]:
    """Two process sets train two models at once, each with its own optimizer and SafeBits on its set."""
    check(os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1", "needs HOROVOD_DYNAMIC_PROCESS_SETS=1")
    size, rank = hvd.size(), hvd.rank()
    check(size in (2, 4), f"process_sets runs on 2 or 4 ranks, not {size}")
    half = size // 2
    groups = [list(range(half)), list(range(half, size))]
    sets = [hvd.add_process_set(g) for g in groups]        # collective: every rank adds both, in the same order
    mine = rank // half
    ps = sets[mine]
    torch.manual_seed(100 + mine)          # each set its own model, the same on the set's ranks (no broadcast)
    model = mlp()
    named = prefixed(f"ps{mine}", model)
    compression = sb.SafeBits(named, process_set=None if mutation == "no_process_set" else ps,
                              name=f"safebits.set{mine}", timeout=TIMEOUT)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=named,
                                   compression=compression, process_set=ps)
    first = eval_loss(model, 5000 + mine)
    digests = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(10_000 * mine + 100 * ps.rank() + step)     # per set and per rank within the set
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        record = compression.last_step
        check(record is not None and record.step == step, f"step {step}: no record")
        digests.append(record.allocation_digest)
    exchange = compression.exchange
    mine_info = (mine, params_digest(model), digests, first, eval_loss(model, 5000 + mine),
                 type(exchange).__name__, getattr(exchange, "size", None), compression.last_step.collective)
    everyone = hvd.allgather_object(mine_info, name="ps.results")
    for k in range(2):
        members = [r for r in everyone if r[0] == k]
        check(len({r[1] for r in members}) == 1, f"set {k}: parameters differ across its ranks")
        check(len({tuple(r[2]) for r in members}) == 1, f"set {k}: allocation digests differ across its ranks")
        check(all(r[6] == len(groups[k]) for r in members),
              f"set {k}: the statistics exchange spans {[r[6] for r in members]} ranks, the set {len(groups[k])}")
        check(members[0][4] < 0.85 * members[0][3],
              f"set {k}: loss did not fall: {members[0][3]:.3f} -> {members[0][4]:.3f}")
    check(everyone[0][1] != everyone[-1][1], "the two sets ended with the same parameters")
    for s in sets:
        hvd.remove_process_set(s)
    return {f"set{r[0]}": f"loss {r[3]:.3f}->{r[4]:.3f} {r[5]}({r[6]}) {r[7]}" for r in everyone[::half]}


def run_missing_process_set(mutation: str = "") -> dict[str, Any]:
    """Rank 0 trains on a set [0], SafeBits on every rank (no ``process_set``), ``timeout=3``: rank 0 must get a
    SafeBitsTimeoutError saying a rank never joined, within 10 s. Rank 1 idles. Leaves a Horovod op pending."""
    check(hvd.size() == 2, "missing_process_set runs on 2 ranks")
    ps = hvd.add_process_set([0])
    if hvd.rank() != 0:
        return {}
    torch.manual_seed(0)
    model = mlp()
    named = prefixed("missing", model)
    timeout = None if mutation == "no_timeout" else 3.0
    compression = sb.SafeBits(named, name="safebits.missing", timeout=timeout)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named,
                                   compression=compression, process_set=ps)
    start = time.perf_counter()
    try:
        for step in range(3):
            opt.zero_grad()
            x, y = batch(step)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    except sb.SafeBitsTimeoutError as exc:
        took = time.perf_counter() - start
        check("never joined" in str(exc), f"unclear message: {exc}")
        check(took < 10.0, f"SafeBitsTimeoutError after {took:.1f} s, expected within 10 s")
        return {"after_s": round(took, 1), "message": str(exc)[:110]}
    raise ScenarioFailure("training on a set [0] with SafeBits on every rank did not raise SafeBitsTimeoutError")


# ------------------------------------------------------------------------------------------ gradscaler
Factory = Callable[[list[tuple[str, nn.Parameter]], str], Any]


def none_factory(named: list[tuple[str, nn.Parameter]], tag: str) -> Any:
    """``hvd.Compression.none`` (the reference every SafeBits run is compared with)."""
    return hvd.Compression.none


def safebits_factory(**kwargs: Any) -> Factory:
    """SafeBits with its defaults (plus ``kwargs``), a distinct exchange name per optimizer."""
    def make(named: list[tuple[str, nn.Parameter]], tag: str) -> sb.SafeBits:
        return sb.SafeBits(named, name=f"safebits.{tag}", timeout=TIMEOUT, **kwargs)
    return make


def train_amp(tag: str, factory: Factory, steps: int = 40) -> dict[str, Any]:
    """Horovod's mixed-precision recipe on CPU (float16 autocast, ``GradScaler`` starting at 2**40)."""
    torch.manual_seed(0)
    model = mlp()
    named = prefixed(tag, model)
    compression = factory(named, tag)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), named_parameters=named,
                                   compression=compression)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    first = eval_loss(model)
    overflowed: list[int] = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(1000 * hvd.rank() + step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        opt.synchronize()
        if has_nonfinite(model.parameters()):       # the reduced gradients, before unscaling
            overflowed.append(step)
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    return {"scale": scaler.get_scale(), "first": first, "last": eval_loss(model), "overflowed": overflowed,
            "digest": params_digest(model), "compression": compression}


def run_gradscaler(mutation: str = "") -> dict[str, Any]:
    """GradScaler with Compression.none, then with SafeBits' defaults: the same overflow handling."""
    none = train_amp("amp.none", none_factory)
    check(none["overflowed"][:1] == [0], f"with Compression.none step 0 did not overflow ({none['overflowed'][:5]})")
    kwargs = {"nonfinite": "skip"} if mutation == "skip" else {}
    run = train_amp("amp.sb", safebits_factory(**kwargs))
    records = run["compression"].history
    nonfinite_steps = [r.step for r in records if r.nonfinite]
    digests = hvd.allgather_object(run["digest"], name="amp.digests")
    check(len(set(digests)) == 1, "parameters differ across ranks")
    check(run["scale"] <= 2.0**30, f"the scale did not fall: {run['scale']:.3g}")
    check(0.25 <= run["scale"] / none["scale"] <= 4.0,
          f"final scale {run['scale']:.3g}, with Compression.none {none['scale']:.3g}")
    check(run["last"] < 0.9 * run["first"], f"loss did not fall: {run['first']:.3f} -> {run['last']:.3f}")
    check(bool(nonfinite_steps), "no SafeBits record lists a non-finite tensor")
    check(nonfinite_steps == run["overflowed"],
          f"records list non-finite tensors at steps {nonfinite_steps}, p.grad held them at {run['overflowed']}")
    return {"scale": f"{run['scale']:.4g} (none {none['scale']:.4g})",
            "overflow_steps": f"{len(run['overflowed'])} (none {len(none['overflowed'])})",
            "loss": f"{run['first']:.3f}->{run['last']:.3f} (none {none['first']:.3f}->{none['last']:.3f})"}


# ------------------------------------------------------------------------------------------ diverging
def train_gan(tag: str, factory: Factory, steps: int = 10, lr: float = 0.5) -> dict[str, Any]:
    """A least-squares GAN: discriminator step, then generator step (discriminator frozen), with two
    DistributedOptimizers; at this learning rate the squared losses overflow by step 2 or 3. Per step,
    whether ``p.grad`` (the reduced gradient) holds NaN/Inf, for the discriminator and for the generator."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    disc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    g_named, d_named = prefixed(f"{tag}.G", gen), prefixed(f"{tag}.D", disc)
    g_comp, d_comp = factory(g_named, f"{tag}.G"), factory(d_named, f"{tag}.D")
    opt_g = hvd.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=lr), named_parameters=g_named,
                                     compression=g_comp)
    opt_d = hvd.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=lr), named_parameters=d_named,
                                     compression=d_comp)
    mse = nn.functional.mse_loss
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
    d_bad: list[int] = []
    g_bad: list[int] = []
    for step in range(steps):
        draw = torch.Generator().manual_seed(1000 * hvd.rank() + step)
        real = torch.randn(32, 16, generator=draw) * 0.5 + 2.0
        z = torch.randn(32, 8, generator=draw)
        opt_d.zero_grad()
        (mse(disc(real), ones) + mse(disc(gen(z).detach()), zeros)).backward()
        opt_d.step()
        if has_nonfinite(disc.parameters()):
            d_bad.append(step)
        disc.requires_grad_(False)
        opt_g.zero_grad()
        mse(disc(gen(z)), ones).backward()
        opt_g.step()
        disc.requires_grad_(True)
        if has_nonfinite(gen.parameters()):
            g_bad.append(step)
    return {"d_bad": d_bad, "g_bad": g_bad, "g_comp": g_comp, "d_comp": d_comp}


def run_diverging(mutation: str = "") -> dict[str, Any]:
    """A GAN that overflows: SafeBits passes NaN/Inf on to p.grad as Compression.none does, and records them."""
    none = train_gan("gan.none", none_factory)
    check(bool(none["d_bad"]) and bool(none["g_bad"]),
          f"with Compression.none no NaN/Inf reached p.grad (D {none['d_bad']}, G {none['g_bad']}): no test")
    kwargs = {"nonfinite": "skip"} if mutation == "skip" else {}
    run = train_gan("gan.sb", safebits_factory(**kwargs))
    flags = hvd.allgather_object((run["d_bad"], run["g_bad"]), name="gan.flags")
    check(all(f == flags[0] for f in flags), f"ranks saw NaN/Inf in p.grad at different steps: {flags}")
    for who in ("d", "g"):
        bad, ref = run[f"{who}_bad"], none[f"{who}_bad"]
        check(bool(bad), f"{who.upper()}: no NaN/Inf reached p.grad with SafeBits (Compression.none: steps {ref})")
        check(abs(bad[0] - ref[0]) <= 2, f"{who.upper()}: NaN/Inf from step {bad[0]} with SafeBits, {ref[0]} with "
                                         f"Compression.none")
        listed = [r.step for r in run[f"{who}_comp"].history if r.nonfinite]
        check(listed == bad, f"{who.upper()}: records list non-finite tensors at steps {listed}, p.grad held "
                             f"them at {bad}")
    return {"safebits": f"D {run['d_bad']} G {run['g_bad']}", "none": f"D {none['d_bad']} G {none['g_bad']}"}


# ------------------------------------------------------------------------------------------ unnamed
def run_unnamed(mutation: str = "") -> dict[str, Any]:
    """``hvd.DistributedOptimizer(opt)`` without named_parameters: SafeBits(opt) (one and two parameter groups) and
    SafeBits(model.parameters()) name parameters as Horovod does and train like any other."""
    info: dict[str, Any] = {}
    for case in ("optimizer", "two_groups", "parameters"):
        torch.manual_seed(0)
        model = mlp()
        if case == "two_groups":
            base = torch.optim.SGD([{"params": [p for p in model.parameters() if p.dim() > 1]},
                                    {"params": [p for p in model.parameters() if p.dim() == 1]}], lr=1.0)
        elif mutation == "reversed":       # the optimizer's order differs from model.parameters()
            base = torch.optim.SGD(list(model.parameters())[::-1], lr=1.0)
        else:
            base = torch.optim.SGD(model.parameters(), lr=1.0)
        source = model.parameters() if case == "parameters" else base
        compression = sb.SafeBits(source, name=f"safebits.unnamed.{case}", timeout=TIMEOUT)
        opt = hvd.DistributedOptimizer(base, compression=compression)
        registered = (list(model.parameters()) if case == "parameters"
                      else [p for group in base.param_groups for p in group["params"]])   # SafeBits' order
        horovod_names = [opt._parameter_names[p] for p in registered]   # Horovod's own naming, the reference
        check(list(compression.names) == horovod_names,
              f"{case}: SafeBits names {list(compression.names)}, Horovod's {horovod_names}")
        if case != "two_groups":
            expected = [f"allreduce.noname.0.{j}" for j in range(len(list(model.parameters())))]
            check(list(compression.names) == expected, f"{case}: names {list(compression.names)}")
        first = eval_loss(model)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(1000 * hvd.rank() + step)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        digests = hvd.allgather_object(params_digest(model), name=f"unnamed.{case}.digests")
        check(len(set(digests)) == 1, f"{case}: parameters differ across ranks")
        check(compression.last_step is not None and compression.last_step.step == STEPS - 1,
              f"{case}: no record of the last step")
        last = eval_loss(model)
        check(last < 0.8 * first, f"{case}: loss did not fall: {first:.3f} -> {last:.3f}")
        info[case] = f"{first:.3f}->{last:.3f}"
    return info


# ------------------------------------------------------------------------------------------ memory
def vmrss_kib() -> int:
    """This process's resident memory (``VmRSS`` of /proc/self/status), KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def run_memory(mutation: str = "", steps: int = 10_000, first_at: int = 1_000) -> dict[str, Any]:
    """10,000 steps with SafeBits' defaults, reading ``last_step`` every step as a logger would: the resident
    memory after the last step is within 5% of that after step 1,000, on every rank."""
    torch.manual_seed(0)
    model = mlp(hidden=48)            # 3,556 parameters in 6 tensors
    named = prefixed("memory", model)
    kwargs = {"max_history": 100_000} if mutation == "history" else {}
    compression = sb.SafeBits(named, name="safebits.memory", timeout=TIMEOUT, **kwargs)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=named,
                                   compression=compression)
    batches = [batch(1000 * hvd.rank() + k) for k in range(16)]
    rss_first = 0
    start = time.perf_counter()
    for step in range(1, steps + 1):
        opt.zero_grad()
        x, y = batches[step % len(batches)]
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        record = compression.last_step
        check(record is not None and record.step == step - 1, f"step {step}: no record")
        if step == first_at:
            gc.collect()
            rss_first = vmrss_kib()
    gc.collect()
    rss_last = vmrss_kib()
    per_step_ms = 1000 * (time.perf_counter() - start) / steps
    everyone = hvd.allgather_object((hvd.rank(), rss_first, rss_last), name="memory.rss")
    shown = {f"rank{r}": f"{a / 1024:.1f}->{b / 1024:.1f} MiB" for r, a, b in everyone}
    for r, a, b in everyone:
        check(abs(b - a) <= 0.05 * a, f"rank {r}: VmRSS {a / 1024:.1f} MiB after step {first_at}, "
                                      f"{b / 1024:.1f} MiB after step {steps} (more than 5% apart)")
    return {**shown, "ms_per_step": round(per_step_ms, 2), "history": len(compression.history)}


# ------------------------------------------------------------------------------------------ main
def scenarios() -> dict[str, Callable[[str], dict[str, Any]]]:
    """Every scenario by name (``missing_process_set`` must run alone in its launch)."""
    return {"process_sets": run_process_sets, "missing_process_set": run_missing_process_set,
            "gradscaler": run_gradscaler, "diverging": run_diverging, "unnamed": run_unnamed, "memory": run_memory}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="process_sets,gradscaler,diverging,unnamed",
                        help="comma-separated names (default: the quick ones that share a launch)")
    parser.add_argument("--mutation", default="",
                        help="break the setup on purpose to check that a scenario fails: no_process_set "
                             "(process_sets), no_timeout (missing_process_set), skip (gradscaler, diverging), "
                             "reversed (unnamed), history (memory)")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    table = scenarios()
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in table]
    if unknown or ("missing_process_set" in names and len(names) > 1):
        print(f"unknown scenarios {unknown} (known: {list(table)}), or missing_process_set not alone",
              file=sys.stderr)
        return 2
    failed = run_scenarios(names, lambda name: table[name](args.mutation))
    code = 1 if failed else 0
    if "missing_process_set" in names:
        # Rank 0 leaves Horovod ops pending that rank 1 never joins. Shut Horovod down on both ranks together (its
        # shutdown is coordinated; a rank that simply exits makes the other's Gloo background thread abort on the
        # reset connection), bounded in case the pending ops hold it, then leave without the interpreter's exit
        # handlers.
        rank = hvd.rank()
        closer = threading.Thread(target=hvd.shutdown, daemon=True)
        closer.start()
        closer.join(20.0)
        if closer.is_alive():
            print(f"rank {rank}: hvd.shutdown() did not return within 20 s", flush=True)
        exit_without_finalization(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
