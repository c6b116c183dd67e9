"""Horovod worker: many SafeBits integration scenarios in one ``horovodrun`` launch.

Run as ``horovodrun -np 2 --gloo python mpi_tests/hvd_worker.py [--scenarios a,b] [--expect-transport NAME]``.
Every scenario trains a small model with stock ``hvd.DistributedOptimizer`` and ``compression=SafeBits(...)``
and checks, after every step and across all ranks (``hvd.allgather_object``):

* the allocation digest, violation flag, excess bits, escalations, used bits and actions are identical;
* the model parameters are bitwise identical (SHA-256 of every parameter's bytes);
* the reduced gradient (``p.grad`` after ``step()``) is the Horovod op (Average / Sum) of what every rank's
  ``compress`` returned, and every wire tensor is float32 with ``p.grad``'s number of elements;

and per rank, after the run, error-feedback conservation: ``sum(sent) + residual == sum(gradients)``.
Scenario outcomes are agreed across ranks; rank 0 prints one line per scenario and the process exits non-zero
if any scenario failed on any rank.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch
from scenario_runner import (
    CLASSES,
    IN_FEATURES,
    Net,
    ScenarioFailure,
    check,
    checkpoint_through_bytes,
    params_digest,
    restore_checkpoint,
    run_scenarios,
)
from torch import nn

import safebits_hvd as sb

BATCH = 64


class TrackingSafeBits(sb.SafeBits):
    """SafeBits that records, per parameter, the sum of gradients and of what was sent (before Horovod reduces
    the wire tensor in place), and the wire tensors of the current step."""

    def __init__(self, named_parameters: list[tuple[str, nn.Parameter]], **kwargs: Any) -> None:
        super().__init__(named_parameters, **kwargs)
        self.tracked = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.grad_sum: dict[str, torch.Tensor] = {}
        self.sent_sum: dict[str, torch.Tensor] = {}
        self.abs_sum: dict[str, torch.Tensor] = {}
        self.step_sent: dict[str, torch.Tensor] = {}
        self.wire_problems: list[str] = []
        self.collectives: set[str] = set()
        self.packed: dict[tuple[int, int], tuple[str, torch.Tensor]] = {}   # (step, index) -> (name, gradient)

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        name = next((n for n, p in self.tracked if p.grad is tensor), None)
        grad = tensor.detach().reshape(-1).to(torch.float64).clone()
        out, ctx = super().compress(tensor)
        if name is None:     # super() accepted it (e.g. sparse_as_dense); nothing to track
            return out, ctx
        self.collectives.add(ctx.handle.collective)
        if ctx.handle.packed:       # Horovod reduces a one-element marker; the payloads travel beside it
            if out.numel() != 1:
                self.wire_problems.append(f"{name}: marker of {out.numel()}")
            # The payload exists once the tensor's group has been sent: read it in decompress.
            self.packed[(ctx.step, ctx.index)] = (name, grad)
            return out, ctx
        if out.dtype != torch.float32 or out.numel() != tensor.numel():
            self.wire_problems.append(f"{name}: wire {out.dtype} x {out.numel()} for grad of {tensor.numel()}")
        self._track(name, grad, out.detach().reshape(-1).to(torch.float64).clone())   # flat, or in its own shape
        return out, ctx

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        tracked = self.packed.pop((ctx.step, ctx.index), None)
        if tracked is not None:
            name, grad = tracked
            if ctx.wire.dtype != torch.uint8:
                self.wire_problems.append(f"{name}: payload {ctx.wire.dtype}")
            decoded = sb.comm.collectives.decode_sequence(ctx.wire, torch.zeros(grad.numel()), name)
            self._track(name, grad, decoded.to(torch.float64))
        return super().decompress(tensor, ctx)

    def _track(self, name: str, grad: torch.Tensor, sent: torch.Tensor) -> None:
        zeros = torch.zeros_like(grad)
        self.grad_sum[name] = self.grad_sum.get(name, zeros) + grad
        self.sent_sum[name] = self.sent_sum.get(name, zeros) + sent
        self.abs_sum[name] = self.abs_sum.get(name, zeros) + grad.abs() + sent.abs()
        self.step_sent[name] = sent


@dataclass
class Scenario:
    """One training configuration and the extra checks it needs."""

    name: str
    steps: int = 8
    op: Any = None                       # None: Horovod's default (Average)
    backward_passes_per_step: int = 1
    groups: Any = None                   # None, an int, or "list"
    gradient_predivide_factor: float = 1.0
    zero_grad: str = "optimizer"         # "optimizer" (set_to_none, PyTorch's default) or "model_keep"
    unused_param: bool = False           # aux head used only on even steps
    frozen: bool = False
    budget_bits: float | str = 4.0       # or "auto": then some steps pass through (dense), the others compress
    max_distortion: float = 0.5
    min_cosine: float = 0.8
    lr: float = 0.1
    loss_must_fall: bool = False
    expect_violation: bool = False
    expect_escalation: bool = False
    collective: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)


def shard(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for ``step``: different data per rank, labels from a fixed teacher."""
    gen = torch.Generator().manual_seed(1000 * hvd.rank() + 17 * step + micro)
    x = torch.randn(BATCH, IN_FEATURES, generator=gen)
    teacher = torch.Generator().manual_seed(12345)
    w = torch.randn(IN_FEATURES, CLASSES, generator=teacher)
    return x, (x @ w).argmax(dim=1)


def fixed_eval_set() -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's evaluation batch (fixed across steps)."""
    return shard(10_000)


def global_loss(model: nn.Module) -> float:
    """Cross-entropy on every rank's evaluation batch, averaged over ranks."""
    x, y = fixed_eval_set()
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(x), y)
    return float(hvd.allreduce(loss.reshape(1), op=hvd.Average, name="eval.loss")[0])


def all_equal(values: list[Any]) -> bool:
    return all(v == values[0] for v in values[1:])


def run_training(sc: Scenario) -> dict[str, Any]:
    """Train ``sc.steps`` steps and run every per-step and per-run check of ``sc``."""
    torch.manual_seed(0)
    model = Net(frozen=sc.frozen)
    # Distinct names per scenario: a stale Horovod op of an earlier scenario can never match a later one.
    named = [(f"{sc.name}.{n}", p) for n, p in model.named_parameters()]
    compression = TrackingSafeBits(named, budget_bits=sc.budget_bits, max_distortion=sc.max_distortion,
                                   min_cosine=sc.min_cosine, name=f"safebits.{sc.name}", collective=sc.collective)
    base = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=sc.lr)
    kwargs: dict[str, Any] = {"backward_passes_per_step": sc.backward_passes_per_step,
                              "gradient_predivide_factor": sc.gradient_predivide_factor}
    if sc.op is not None:
        kwargs["op"] = sc.op
    if sc.groups == "list":
        kwargs["groups"] = [[model.fc1.weight, model.fc1.bias], [model.fc2.weight, model.head.weight]]
    elif sc.groups is not None:
        kwargs["groups"] = sc.groups
    opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=compression, **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    check(all_equal(hvd.allgather_object(params_digest(model), name=f"{sc.name}.init")),
          "parameters differ across ranks after broadcast")

    trainable = [(n, p) for n, p in named if p.requires_grad]
    two_phase_sums: dict[str, np.ndarray] = {}     # per parameter: [sum of reduced sums, sum of what ranks sent]
    frozen_before = {n: p.detach().clone() for n, p in named if not p.requires_grad}
    first_loss = global_loss(model)
    violations = escalations = 0
    for step in range(sc.steps):
        compression.step_sent = {}
        if sc.zero_grad == "optimizer":
            opt.zero_grad()
        else:
            model.zero_grad(set_to_none=False)
        use_aux = not sc.unused_param or step % 2 == 0
        for micro in range(sc.backward_passes_per_step):
            x, y = shard(step, micro)
            loss = nn.functional.cross_entropy(model(x, use_aux=use_aux), y)
            if sc.backward_passes_per_step > 1:
                loss = loss / sc.backward_passes_per_step
            loss.backward()
        opt.step()

        record = compression.last_step
        check(record is not None and record.step == step,
              f"step {step}: last_step is {None if record is None else record.step}")
        check(not compression.wire_problems, f"wire tensors: {compression.wire_problems[:3]}")
        check(set(compression.step_sent) == {n for n, _ in trainable},
              f"step {step}: compressed {sorted(compression.step_sent)} not every trainable parameter")
        violations += bool(record.violation)
        escalations += len(record.escalations)
        summary = (record.allocation_digest, record.violation, record.excess_bits, tuple(record.escalations),
                   record.modeled_bits_total, tuple(sorted(record.actions.items())), params_digest(model))
        gathered = hvd.allgather_object(summary, name=f"{sc.name}.summary.{step}")
        labels = ["allocation digest", "violation", "excess bits", "escalations", "used bits", "actions",
                  "parameters (bitwise)"]
        for k, label in enumerate(labels):
            check(all_equal([g[k] for g in gathered]),
                  f"step {step}: {label} differ across ranks: {[g[k] for g in gathered]}"[:600])

        # The reduced gradient is the Horovod op over every rank's wire tensor.
        sent_all = hvd.allgather_object({n: t.numpy() for n, t in compression.step_sent.items()},
                                        name=f"{sc.name}.sent.{step}")
        for n, p in trainable:
            stacked = np.stack([s[n] for s in sent_all])
            expected = stacked.sum(axis=0) if sc.op is hvd.Sum else stacked.mean(axis=0)
            got = p.grad.detach().reshape(-1).to(torch.float64).numpy()
            if compression.last_step.collective == "two_phase":
                # The second hop re-quantizes the sums with its own error feedback: conserved over the run (below).
                scale = 1.0 if sc.op is hvd.Sum else float(hvd.size())
                two_phase_sums[n] = two_phase_sums.get(n, 0) + np.stack([got * scale, stacked.sum(axis=0)])
                continue
            tol = 1e-6 * (np.abs(stacked).sum(axis=0) + 1e-30)
            check(bool(np.all(np.abs(got - expected) <= tol + 1e-12)),
                  f"step {step}: reduced gradient of {n} is not the op of the wire tensors "
                  f"(max err {np.abs(got - expected).max():.3g})")
    for n, p in named:
        if n in frozen_before:
            check(torch.equal(p.detach(), frozen_before[n]), f"frozen parameter {n} changed")
            check(n not in compression.names, f"frozen parameter {n} registered with SafeBits")

    # Two-phase, second hop: what the ranks sent = what the owners re-sent + the owners' second-hop residuals.
    if two_phase_sums:
        second = hvd.allgather_object({n: t.numpy() for n, t in compression.core.two_phase.memory.residuals.items()},
                                      name=f"{sc.name}.second_hop")
        for n, p in trainable:
            bounds = sb.comm.collectives.segment_bounds(p.numel(), compression.menu.bucket_size, hvd.size(),
                                                  compression.names.index(n))
            residual = np.concatenate([second[owner][n] for owner in range(hvd.size())]).astype(np.float64)
            check(len(residual) == p.numel() and [stop - start for start, stop in bounds] == [len(second[o][n])
                  for o in range(hvd.size())], f"second-hop residuals of {n} do not tile the tensor")
            resent, sent = two_phase_sums[n]
            err = np.abs(resent + residual - sent)
            check(bool(np.all(err <= 1e-4 * (np.abs(sent) + np.abs(resent)) + 1e-6)),
                  f"second-hop conservation fails for {n}: max error {err.max():.3g}")

    # Error-feedback conservation, per rank: sum(sent) + residual == sum(gradients).
    lossy = 0
    for n, _ in trainable:
        residual = compression.memory.residuals.get(n, torch.zeros(1)).to(torch.float64)   # none: passed through
        lhs = compression.sent_sum[n] + residual
        err = (lhs - compression.grad_sum[n]).abs()
        tol = 1e-5 * compression.abs_sum[n] + 1e-9
        check(bool((err <= tol).all()),
              f"EF conservation fails for {n} on rank {hvd.rank()}: max error {float(err.max()):.3g}")
        lossy += bool(residual.abs().max() > 0)
    auto = sc.budget_bits == "auto"
    check(lossy > 0 or auto, "no residual is non-zero: nothing lossy was sent, the EF check proves nothing")

    # 4 bits per parameter on a few ranks: "auto" moves packed payloads (collectives.choose).
    packed = sc.collective if sc.collective != "auto" else ("allgather" if hvd.size() == 2 else "two_phase")
    expected = {"dense"} if sc.collective == "dense" else {packed}
    if auto:                 # the pass-through steps (32 bits) are dense, the compressed budgets probed packed
        expected = {"dense", packed}
        check(any(r.pass_through for r in compression.history) and any(r.timing for r in compression.history),
              "budget_bits='auto' never passed through, or recorded no telemetry")
    check(compression.collectives == expected, f"collectives used {compression.collectives}, expected {expected}")
    check({r.collective for r in compression.history} == expected, "the records' collective differs")
    last_loss = global_loss(model)
    if sc.loss_must_fall:
        check(last_loss < 0.7 * first_loss, f"training loss did not fall: {first_loss:.4f} -> {last_loss:.4f}")
    if sc.expect_violation:
        check(violations > 0, "expected budget violations with this tight budget, got none")
    if sc.expect_escalation:
        check(escalations > 0, "expected escalations with these thresholds, got none")
    history_ratio = float(np.median([r.modeled_compression_ratio for r in compression.history]))
    return {"loss": f"{first_loss:.3f}->{last_loss:.3f}", "violations": violations, "escalations": escalations,
            "ratio": round(history_ratio, 2), "transport": type(compression.exchange).__name__,
            "collective": "+".join(sorted(compression.collectives))}


def run_unregistered() -> dict[str, Any]:
    """A tensor that is no registered parameter's gradient raises a clear ValueError (directly and in the hook)."""
    torch.manual_seed(0)
    model = Net()
    named = [(f"unreg.{n}", p) for n, p in model.named_parameters()]
    compression = sb.SafeBits(named, name="safebits.unreg")
    x, y = shard(0)
    nn.functional.cross_entropy(model(x, use_aux=True), y).backward()
    try:
        compression.compress(model.fc1.weight.grad.clone())
    except ValueError as exc:
        check("not the .grad of any registered parameter" in str(exc), f"unclear message: {exc}")
    else:
        raise ScenarioFailure("compress(copy of a gradient) did not raise ValueError")

    # Through Horovod: SafeBits knows only fc1, the optimizer updates everything.
    model2 = Net()
    named2 = [(f"unreg2.{n}", p) for n, p in model2.named_parameters()]
    partial = sb.SafeBits([(n, p) for n, p in named2 if ".fc1." in n], name="safebits.unreg2")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1), named_parameters=named2,
                                   compression=partial)
    try:
        nn.functional.cross_entropy(model2(x, use_aux=True), y).backward()
    except ValueError as exc:
        check("not the .grad of any registered parameter" in str(exc), f"unclear message: {exc}")
    else:
        opt.synchronize()
        raise ScenarioFailure("a gradient of an unregistered parameter did not raise ValueError")
    return {}


def expect_consistency_error(tag: str, expected_text: str, **rank1_kwargs: Any) -> dict[str, Any]:
    """Rank 1 builds SafeBits with ``rank1_kwargs`` (the others with the defaults): every rank must raise
    SafeBitsConsistencyError whose message holds ``expected_text`` (the launcher's timeout proves no hang)."""
    torch.manual_seed(0)
    model = Net()
    named = [(f"{tag}.{n}", p) for n, p in model.named_parameters()]
    kwargs = rank1_kwargs if hvd.rank() == 1 else {}
    compression = sb.SafeBits(named, name=f"safebits.{tag}", **kwargs)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named,
                                   compression=compression)
    raised = ""
    try:
        for step in range(3):
            opt.zero_grad()
            x, y = shard(step)
            nn.functional.cross_entropy(model(x, use_aux=True), y).backward()
            opt.step()
    except sb.SafeBitsConsistencyError as exc:
        raised = str(exc)
    flags = hvd.allgather_object(bool(raised), name=f"{tag}.flags")
    check(all(flags), f"SafeBitsConsistencyError raised on ranks {flags} (expected every rank)")
    check(expected_text in raised, f"unclear message: {raised}")
    return {"message": raised[:80]}


def run_inconsistent() -> dict[str, Any]:
    """Rank 1 uses another budget: the allocation digests differ."""
    return expect_consistency_error("incons", "disagree", budget_bits=2.0)


def run_inconsistent_menu() -> dict[str, Any]:
    """Rank 1 uses another menu: its statistics vector has another length."""
    return expect_consistency_error("incmenu", "different lengths", menu=["fp32", "fp16", "int8"])


def run_checkpoint_restore(collective: str = "auto") -> dict[str, Any]:
    """Stop at step 3, save model, optimizer and SafeBits state per rank, rebuild everything, restore and go on:
    the parameters after step 6 are bitwise those of an uninterrupted run, on every rank (with the two-phase
    collective that needs the second hop's residuals too)."""
    def build(tag: str) -> tuple[nn.Module, Any, sb.SafeBits]:
        torch.manual_seed(0)
        model = Net()
        named = [(f"ckpt.{n}", p) for n, p in model.named_parameters()]
        compression = sb.SafeBits(named, budget_bits=3.0, name=f"safebits.ckpt.{collective}.{tag}",
                                  collective=collective)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=named, compression=compression)
        return model, opt, compression

    def train(model: nn.Module, opt: Any, steps: range) -> None:
        for step in steps:
            opt.zero_grad()
            x, y = shard(step)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    model, opt, _ = build("straight")
    train(model, opt, range(6))
    straight = params_digest(model)

    model, opt, compression = build("first")
    train(model, opt, range(3))
    saved = checkpoint_through_bytes(model, opt, compression)
    model, opt, compression = build("resumed")
    restore_checkpoint(saved, model, opt, compression)
    check(compression.step == 3, f"restored step {compression.step}, expected 3")
    train(model, opt, range(3, 6))
    resumed = params_digest(model)
    check(resumed == straight, "parameters after stop/restore differ from the uninterrupted run")
    digests = hvd.allgather_object(resumed, name=f"ckpt.{collective}.digests")
    check(len(set(digests)) == 1, f"ranks differ after restore: {digests}")
    check(compression.last_step.collective in ("allgather", "two_phase"), "checkpoint run on the dense path")
    return {"digest": resumed[:12], "collective": compression.last_step.collective}


def scenarios() -> dict[str, Callable[[], dict[str, Any]]]:
    """Every scenario by name, in the order they run (the inconsistent rank last)."""
    configs = [
        Scenario("train_average", steps=40, lr=0.5, loss_must_fall=True),
        Scenario("dense_average", steps=20, lr=0.5, loss_must_fall=True, collective="dense"),
        Scenario("two_phase", steps=20, lr=0.5, loss_must_fall=True, collective="two_phase"),
        Scenario("op_sum", op=hvd.Sum, lr=0.05),
        Scenario("bpps2", backward_passes_per_step=2),
        Scenario("groups_int", groups=2),
        Scenario("groups_list", groups="list"),
        Scenario("predivide", gradient_predivide_factor=2.0),
        Scenario("zero_grad_keep", zero_grad="model_keep", unused_param=True),
        Scenario("unused_param", unused_param=True),
        Scenario("frozen", frozen=True),
        Scenario("tight_budget", budget_bits=1.0, max_distortion=0.05, min_cosine=0.97,
                 expect_violation=True, expect_escalation=True),
        Scenario("auto", steps=40, budget_bits="auto", lr=0.5, loss_must_fall=True),   # past the warm start
    ]
    table: dict[str, Callable[[], dict[str, Any]]] = {c.name: (lambda c=c: run_training(c)) for c in configs}
    table["unregistered"] = run_unregistered
    table["checkpoint_restore"] = run_checkpoint_restore
    table["checkpoint_two_phase"] = lambda: run_checkpoint_restore("two_phase")
    table["inconsistent"] = run_inconsistent
    table["inconsistent_menu"] = run_inconsistent_menu
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="all", help="comma-separated names, or 'all'")
    parser.add_argument("--expect-transport", default="",
                        help="class name of the statistics exchange every training scenario must use")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    table = scenarios()
    names = list(table) if args.scenarios == "all" else args.scenarios.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"unknown scenarios {unknown}; known: {list(table)}", file=sys.stderr)
        return 2
    def run(name: str) -> Any:
        info = table[name]()
        if args.expect_transport and "transport" in info:
            check(info["transport"] == args.expect_transport,
                  f"statistics exchange is {info['transport']}, expected {args.expect_transport}")
        return info

    failed = run_scenarios(names, run)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
