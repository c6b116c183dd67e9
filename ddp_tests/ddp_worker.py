"""DDP worker: SafeBits' DDP front end (:mod:`safebits_hvd.ddp`) in many scenarios in one ``torchrun`` launch.

Run as ``torchrun --nproc_per_node 2 ddp_tests/ddp_worker.py [--scenarios a,b]`` (Gloo). Every training scenario
wraps a small MLP in ``DistributedDataParallel`` with ``register_comm_hook(state, safebits_hook)`` and checks,
after every step and across all ranks (``dist.all_gather_object``):

* the allocation digest, violation, escalations, modeled bits and actions of ``state.last_step`` are identical;
* the model parameters are bitwise identical (SHA-256 of every parameter's bytes);
* the reduced gradient DDP leaves in ``p.grad`` is bitwise the mean, summed in rank order, of every rank's decoded
  payload (recorded by a :class:`~safebits_hvd.comm.transports.TorchDistributedTransport` subclass, the ``transport=``
  seam); on the two-phase path, the second hop conserves what the ranks sent (sums over the run);

and per rank, after the run, error-feedback conservation: ``sum(sent) + residual == sum(what the hook saw)``.
DDP's features run as scenarios: ``no_sync()`` accumulation, ``find_unused_parameters=True``,
``static_graph=True``, tiny and default ``bucket_cap_mb``, ``gradient_as_bucket_view=True`` (every scenario crosses
DDP's bucket rebuild after the first iteration), non-finite gradients, checkpoint and restore, the same allocation
as the Horovod front end, and clear errors for a mismatched registration or budget.
"""

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi_tests"))
from scenario_runner import (
    CLASSES,
    IN_FEATURES,
    Net,
    TorchRanks,
    check,
    checkpoint_through_bytes,
    params_digest,
    restore_checkpoint,
    run_torch_worker,
)

import safebits_hvd as sb
from safebits_hvd import ddp as sbddp
from safebits_hvd.comm.collectives import decode_sequence, segment_bounds
from safebits_hvd.comm.exchange import TorchDistributedExchange
from safebits_hvd.comm.transports import TorchDistributedTransport
from safebits_hvd.frontends.launch import exit_without_finalization

BATCH = 64


RANKS = TorchRanks()


class RecordingTransport(TorchDistributedTransport):
    """The DDP transport, recording what this rank sends: each allgather payload (by tensor name) and each
    two-phase alltoall buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.payloads: dict[str, torch.Tensor] = {}
        self.alltoall_buffers: list[torch.Tensor] = []
        self.launches = 0                   # flushes that launched allgathers of payloads

    def flush(self, expected_bytes: int | None = None) -> None:
        self.launches += expected_bytes is not None
        super().flush(expected_bytes)

    def start_allgather(self, name: str, payload: torch.Tensor) -> Any:
        self.payloads[name] = payload.clone()
        return super().start_allgather(name, payload)

    def start_alltoall(self, name: str, buffer: torch.Tensor, splits: list[int]) -> Any:
        self.alltoall_buffers.append(buffer.clone())
        return super().start_alltoall(name, buffer, splits)


def shard(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for ``step``: different data per rank, labels from a fixed teacher."""
    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + 17 * step + micro)
    x = torch.randn(BATCH, IN_FEATURES, generator=gen)
    w = torch.randn(IN_FEATURES, CLASSES, generator=torch.Generator().manual_seed(12345))
    return x, (x @ w).argmax(dim=1)


def global_loss(model: nn.Module) -> float:
    """Cross-entropy on every rank's fixed evaluation batch, averaged over ranks."""
    x, y = shard(10_000)
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(x), y).reshape(1)
    dist.all_reduce(loss)
    return float(loss[0]) / dist.get_world_size()


def all_equal(values: list[Any]) -> bool:
    return all(v == values[0] for v in values[1:])


@dataclass
class Scenario:
    """One DDP configuration and the extra checks it needs."""

    name: str
    steps: int = 8
    collective: str = "auto"
    budget_bits: float | str = 4.0       # or "auto": then some steps pass through (dense), the others compress
    bucket_cap_mb: float = 0.01          # several buckets per step
    find_unused_parameters: bool = False
    unused_param: bool = False           # aux head used only on even steps
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    accumulate: int = 1                  # micro-batches per step, all but the last under no_sync()
    wrapped_names: bool = False          # SafeBitsState from ddp_model.named_parameters()
    frozen: bool = False
    nonfinite_step: int = -1             # rank 1 (or 0 alone) sees NaN in fc2.weight's gradient at this step
    lr: float = 0.5
    loss_must_fall: bool = False
    max_distortion: float = 0.5
    min_cosine: float = 0.8
    expect_escalation: bool = False      # escalated payloads outgrow the bucket's allocated size (a second hop)
    chunk_bytes: int | None = None       # SafeBitsState(chunk_bytes=): several allgathers per bucket


Hook = Callable[[sbddp.SafeBitsState, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def build(sc: Scenario, hook: Hook = sbddp.safebits_hook, tag: str = "", **state_kwargs: Any,
          ) -> tuple[nn.Module, DistributedDataParallel, sbddp.SafeBitsState, RecordingTransport,
                     torch.optim.Optimizer]:
    """The scenario's model (seed 0), its DDP wrapper with SafeBits' hook (or ``hook``), the state, its recording
    transport and an SGD optimizer with momentum."""
    torch.manual_seed(0)
    model = Net(frozen=sc.frozen, aux_by_default=True)
    ddp_model = DistributedDataParallel(model, bucket_cap_mb=sc.bucket_cap_mb,
                                        find_unused_parameters=sc.find_unused_parameters,
                                        static_graph=sc.static_graph,
                                        gradient_as_bucket_view=sc.gradient_as_bucket_view)
    transport = RecordingTransport()
    named = ddp_model.named_parameters() if sc.wrapped_names else model.named_parameters()
    kwargs = {"budget_bits": sc.budget_bits, "collective": sc.collective, "name": f"safebits.{sc.name}{tag}",
              "transport": transport, "max_distortion": sc.max_distortion, "min_cosine": sc.min_cosine,
              **({} if sc.chunk_bytes is None else {"chunk_bytes": sc.chunk_bytes}), **state_kwargs}
    state = sbddp.SafeBitsState(named, **kwargs)
    ddp_model.register_comm_hook(state, hook)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=sc.lr, momentum=0.5)
    return model, ddp_model, state, transport, opt


def decoded_sends(state: sbddp.SafeBitsState, transport: RecordingTransport, collective: str,
                  numels: dict[str, int]) -> dict[str, torch.Tensor]:
    """What this rank sent of every tensor in the step, decoded (float32): on the allgather path each tensor's
    payload in its group's buffer (``AllgatherPath.payload``); on the two-phase path from the recorded alltoall
    buffer."""
    sent: dict[str, torch.Tensor] = {}
    if collective == "allgather":
        step = state.step - 1
        for index, name in enumerate(state.names):
            payload = state.core.allgather.payload(index, step)
            sent[name] = decode_sequence(payload, torch.zeros(numels[name]), name)
        return sent
    # two-phase: the step's alltoall buffer holds segment r of every tensor (index order), for r = 0..P-1
    ranks, tensors = dist.get_world_size(), len(state.names)
    payloads = sb.comm.collectives.split_payloads(transport.alltoall_buffers[-1], ranks * tensors, "alltoall")
    for index, name in enumerate(state.names):
        out = torch.zeros(numels[name])
        bounds = segment_bounds(numels[name], state.core.menu.bucket_size, ranks, index)
        for segment, (start, stop) in enumerate(bounds):
            sb.codec.kernels.decode_add(payloads[segment * tensors + index], out[start:stop], name=name)
        sent[name] = out
    return sent


def run_training(sc: Scenario) -> dict[str, Any]:
    """Train ``sc.steps`` steps through DDP and SafeBits' hook; every per-step and per-run check of the module."""
    ranks, rank = dist.get_world_size(), dist.get_rank()
    seen: dict[str, torch.Tensor] = {}              # what the hook saw in the step, per tensor
    reduced: dict[str, torch.Tensor] = {}           # what the hook's futures returned, per tensor
    current = {"step": 0}
    by_id: dict[int, str] = {}
    nan_rank = 1 if ranks > 1 else 0

    def recording_hook(hook_state: sbddp.SafeBitsState,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        current["buckets"] += 1
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            name = by_id[id(p)]
            if current["step"] == sc.nonfinite_step and name.endswith("fc2.weight") and rank == nan_rank:
                g.view(-1)[3] = float("nan")
            seen[name] = g.detach().reshape(-1).to(torch.float64).clone()
        names = [by_id[id(p)] for p in bucket.parameters()]
        sizes = [g.numel() for g in bucket.gradients()]

        def keep(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            value = future.value()
            for name, piece in zip(names, value.split(sizes), strict=True):
                reduced[name] = piece.detach().clone()
            return value

        return sbddp.safebits_hook(hook_state, bucket).then(keep)

    model, ddp_model, state, transport, opt = build(sc, recording_hook)
    named = ddp_model.named_parameters() if sc.wrapped_names else model.named_parameters()
    trainable = {n: p for n, p in named if p.requires_grad}
    check(list(trainable) == state.names, f"state registered {state.names}, expected {list(trainable)}")
    by_id.update({id(p): n for n, p in trainable.items()})
    numels = {n: p.numel() for n, p in trainable.items()}
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    check(all_equal(RANKS.allgather_object(params_digest(model))), "parameters differ across ranks at the start")

    grad_sum = {n: torch.zeros(k, dtype=torch.float64) for n, k in numels.items()}
    sent_sum = {n: torch.zeros(k, dtype=torch.float64) for n, k in numels.items()}
    abs_sum = {n: torch.zeros(k, dtype=torch.float64) for n, k in numels.items()}
    two_phase_sums = {n: torch.zeros(2, k, dtype=torch.float64) for n, k in numels.items()}
    collectives: set[str] = set()
    first_loss = global_loss(model)
    skipped = escalations = 0
    passed_before = False
    for step in range(sc.steps):
        current["step"] = step
        seen.clear()
        reduced.clear()
        transport.payloads.clear()
        transport.alltoall_buffers.clear()
        transport.launches = 0
        current["buckets"] = 0
        opt.zero_grad()
        use_aux = not sc.unused_param or step % 2 == 0
        for micro in range(sc.accumulate):
            synced = micro == sc.accumulate - 1
            x, y = shard(step, micro)
            with (ddp_model.no_sync() if not synced else torch.enable_grad()):
                loss = nn.functional.cross_entropy(ddp_model(x, use_aux=use_aux), y) / sc.accumulate
                loss.backward()
            if not synced:
                check(not seen, f"step {step}: the hook ran under no_sync()")
        record = state.last_step
        check(record is not None and record.step == step and state.step == step + 1,
              f"step {step}: last_step is {None if record is None else record.step}, state.step {state.step}")
        check(set(seen) == set(trainable), f"step {step}: the hook saw {sorted(seen)}")
        collectives.add(record.collective)
        escalations += len(record.escalations)
        check(record.wire_bytes > 0 if ranks > 1 else record.wire_bytes == 0,
              f"step {step}: wire_bytes {record.wire_bytes}")
        if record.collective == "allgather":
            # One launch per bucket at least; with a small chunk_bytes, a bucket's payloads in several.
            buckets = current["buckets"]
            check(transport.launches > buckets if sc.chunk_bytes is not None else transport.launches >= buckets,
                  f"step {step}: {transport.launches} allgather launches for {buckets} buckets")

        if record.pass_through and passed_before:
            # Passing through with no residual left to flush: DDP's own mean of the gradients as the hook saw them.
            raw = RANKS.allgather_object({n: seen[n].numpy() for n in trainable})
            for n in trainable:
                mean = sum(torch.from_numpy(raw[r][n]) for r in range(ranks)) / ranks
                scale = sum(torch.from_numpy(raw[r][n]).abs() for r in range(ranks)) / ranks    # float32 rounding
                err = (reduced[n].to(torch.float64) - mean).abs()
                check(bool((err <= 1e-6 * scale + 1e-12).all()),
                      f"step {step}: passing through, the reduced gradient of {n} is not the mean of the gradients "
                      f"(max error {float(err.max()):.3g})")
        passed_before = record.pass_through

        # The reduced gradient: the mean, in rank order, of every rank's decoded payload.
        sent = decoded_sends(state, transport, record.collective, numels) if record.collective != "dense" else {}
        gathered = RANKS.allgather_object({n: t.numpy() for n, t in sent.items()})
        for n, p in trainable.items():
            if n in sent and bool(torch.isfinite(seen[n]).all()):
                grad_sum[n] += seen[n]
                sent_sum[n] += sent[n].to(torch.float64)
                abs_sum[n] += seen[n].abs() + sent[n].abs().to(torch.float64)
            got = reduced[n]
            if p.grad is None:
                # find_unused_parameters: DDP does not write the gradient of a parameter no rank used.
                check(sc.find_unused_parameters and not use_aux and ".aux." in f".{n}",
                      f"step {step}: {n} has no gradient")
            else:
                check(np.array_equal(p.grad.reshape(-1).numpy(), got.numpy(), equal_nan=True),
                      f"step {step}: p.grad of {n} is not what the hook returned")
            if record.collective == "allgather":
                expected = torch.zeros(numels[n])
                for r in range(ranks):
                    expected += torch.from_numpy(gathered[r][n])
                expected /= ranks
                check(torch.equal(got, expected) or (np.array_equal(got.numpy(), expected.numpy(), equal_nan=True)),
                      f"step {step}: reduced gradient of {n} is not the mean of the decoded payloads "
                      f"(max err {float((got - expected).abs().max()):.3g})")
            elif record.collective == "two_phase":
                stacked = sum(torch.from_numpy(gathered[r][n]).to(torch.float64) for r in range(ranks))
                # A non-finite sum passes the second hop unquantized and leaves its residual alone.
                both = torch.stack([got.to(torch.float64) * ranks, stacked])
                two_phase_sums[n] += torch.where(torch.isfinite(stacked), both, 0.0)

        finite = all(bool(torch.isfinite(p.grad).all()) for p in trainable.values() if p.grad is not None)
        if step == sc.nonfinite_step:
            bad = next(n for n in trainable if n.endswith("fc2.weight"))
            check(not finite and bool(torch.isnan(trainable[bad].grad).any()),
                  f"step {step}: the NaN did not reach the reduced gradient of {bad}")
            check(record.nonfinite == [bad], f"step {step}: record.nonfinite is {record.nonfinite}")
            check(all(bool(torch.isfinite(e).all()) for e in state.memory.residuals.values()),
                  "a residual absorbed the NaN")
        else:
            check(finite, f"step {step}: non-finite reduced gradient")
        if finite:
            opt.step()                       # as torch.amp.GradScaler: a step with NaN/Inf is skipped
        else:
            skipped += 1

        summary = (record.allocation_digest, record.violation, tuple(record.escalations), record.modeled_bits_total,
                   tuple(sorted(record.actions.items())), params_digest(model))
        everyone = RANKS.allgather_object(summary)
        labels = ["allocation digest", "violation", "escalations", "modeled bits", "actions", "parameters (bitwise)"]
        for k, label in enumerate(labels):
            check(all_equal([g[k] for g in everyone]),
                  f"step {step}: {label} differ across ranks: {[g[k] for g in everyone]}"[:600])

    for n, p in model.named_parameters():
        if n in frozen_before:
            check(torch.equal(p.detach(), frozen_before[n]), f"frozen parameter {n} changed")

    # Two-phase, second hop: what the ranks sent = what the owners re-sent + the owners' second-hop residuals.
    if "two_phase" in collectives:
        second = RANKS.allgather_object({n: t.numpy() for n, t in state.core.two_phase.memory.residuals.items()})
        for n in trainable:
            residual = torch.from_numpy(np.concatenate([second[o][n] for o in range(ranks)])).to(torch.float64)
            resent, total = two_phase_sums[n]
            err = (resent + residual - total).abs()
            check(bool((err <= 1e-4 * (total.abs() + resent.abs()) + 1e-6).all()),
                  f"second-hop conservation fails for {n}: max error {float(err.max()):.3g}")

    # Error-feedback conservation, per rank: sum(sent) + residual == sum(what the hook saw).
    lossy = 0
    if "dense" not in collectives:
        for n in trainable:
            residual = state.memory.residuals[n].to(torch.float64)
            err = (sent_sum[n] + residual - grad_sum[n]).abs()
            check(bool((err <= 1e-5 * abs_sum[n] + 1e-9).all()),
                  f"EF conservation fails for {n} on rank {rank}: max error {float(err.max()):.3g}")
            lossy += bool(residual.abs().max() > 0)
        check(lossy > 0, "no residual is non-zero: nothing lossy was sent, the EF check proves nothing")

    packed = sc.collective if sc.collective != "auto" else ("allgather" if ranks == 2 else "two_phase")
    expected = {"dense"} if sc.collective == "dense" or ranks == 1 else {packed}
    if sc.budget_bits == "auto" and ranks > 1:
        expected = {"dense", packed}              # pass-through steps (32 bits), and the compressed budgets probed
        check(any(r.pass_through for r in state.history) and any(r.timing for r in state.history),
              "budget_bits='auto' never passed through, or recorded no telemetry")
    check(collectives == expected, f"collectives used {collectives}, expected {expected}")
    last_loss = global_loss(model)
    if sc.loss_must_fall:
        check(last_loss < 0.7 * first_loss, f"training loss did not fall: {first_loss:.4f} -> {last_loss:.4f}")
    if sc.expect_escalation:
        check(escalations > 0, "expected escalations with these thresholds, got none")
    ratio = float(np.median([r.modeled_compression_ratio for r in state.history]))
    return {"loss": f"{first_loss:.3f}->{last_loss:.3f}", "ratio": round(ratio, 2), "skipped": skipped,
            "escalations": escalations,
            "collective": "+".join(sorted(collectives)), "exchange": type(state.exchange).__name__}


def train_plain(ddp_model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        x, y = shard(step)
        nn.functional.cross_entropy(ddp_model(x), y).backward()
        opt.step()


def run_checkpoint_restore() -> dict[str, Any]:
    """Stop at step 3, save model, optimizer and SafeBits state per rank, rebuild everything (a new DDP wrapper,
    new buckets), restore and go on: the parameters after step 6 are bitwise those of an uninterrupted run."""
    sc = Scenario("ckpt", budget_bits=3.0)
    model, ddp_model, _, _, opt = build(sc, tag=".straight")
    train_plain(ddp_model, opt, range(6))
    straight = params_digest(model)

    model, ddp_model, state, _, opt = build(sc, tag=".first")
    train_plain(ddp_model, opt, range(3))
    saved = checkpoint_through_bytes(model, opt, state)
    model, ddp_model, state, _, opt = build(sc, tag=".resumed")
    restore_checkpoint(saved, model, opt, state)
    check(state.step == 3, f"restored step {state.step}, expected 3")
    train_plain(ddp_model, opt, range(3, 6))
    resumed = params_digest(model)
    check(resumed == straight, "parameters after stop/restore differ from the uninterrupted run")
    check(all_equal(RANKS.allgather_object(resumed)), "ranks differ after restore")
    check(state.last_step.collective != "dense", "checkpoint run on the dense path")
    return {"digest": resumed[:12], "collective": state.last_step.collective}


def run_front_end_parity() -> dict[str, Any]:
    """The same model, seed and gradients through the DDP hook and through the Horovod front end (``SafeBits``'s
    compress/decompress, driven by hand over the same torch.distributed transports): the same allocation, the same
    records and bitwise the same parameters, every step."""
    sc = Scenario("parity", budget_bits=4.4, lr=0.3)
    model, ddp_model, state, _, opt = build(sc)
    torch.manual_seed(0)
    twin = Net(aux_by_default=True)
    named = list(twin.named_parameters())
    compressor = sb.SafeBits(named, budget_bits=4.4, name="safebits.parity.hvd",
                             exchange=TorchDistributedExchange(), transport=TorchDistributedTransport())
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.3, momentum=0.5)
    for step in range(6):
        opt.zero_grad()
        twin_opt.zero_grad()
        x, y = shard(step)
        nn.functional.cross_entropy(ddp_model(x), y).backward()
        nn.functional.cross_entropy(twin(x), y).backward()
        contexts = [(p, *compressor.compress(p.grad)) for _, p in reversed(named)]   # backward order
        for p, wire, ctx in contexts:
            # Horovod would average the marker (1 on the packed paths) or the dense values over ranks.
            if not ctx.handle.packed:
                wire = wire.clone()
                dist.all_reduce(wire)
                wire /= dist.get_world_size()
            p.grad = compressor.decompress(torch.ones(1) if ctx.handle.packed else wire, ctx)
        opt.step()
        twin_opt.step()
        a, b = state.last_step, compressor.last_step
        check(a.allocation_digest == b.allocation_digest and a.actions == b.actions,
              f"step {step}: allocations differ: DDP {a.actions} vs Horovod front end {b.actions}")
        check(a.modeled_bits_total == b.modeled_bits_total and a.wire_bytes == b.wire_bytes
              and a.escalations == b.escalations,
              f"step {step}: records differ (bits {a.modeled_bits_total}/{b.modeled_bits_total}, wire "
              f"{a.wire_bytes}/{b.wire_bytes})")
        check(params_digest(model) == params_digest(twin), f"step {step}: parameters differ between front ends")
    return {"digest": state.last_step.allocation_digest, "collective": state.last_step.collective}


def expect_error(sc: Scenario, text: str, error: type[BaseException] = Exception,
                 named: Callable[[nn.Module], Any] | None = None, **rank1_kwargs: Any) -> dict[str, Any]:
    """Training must raise ``error`` whose message holds ``text`` on every rank (the launcher's timeout proves
    that no rank hangs)."""
    raised = ""
    try:
        torch.manual_seed(0)
        model = Net(aux_by_default=True)
        ddp_model = DistributedDataParallel(model, bucket_cap_mb=sc.bucket_cap_mb)
        kwargs = rank1_kwargs if dist.get_rank() == 1 else {}
        state = sbddp.SafeBitsState(named(model) if named is not None else model.named_parameters(),
                                    name=f"safebits.{sc.name}", timeout=30, **kwargs)
        ddp_model.register_comm_hook(state, sbddp.safebits_hook)
        train_plain(ddp_model, torch.optim.SGD(model.parameters(), lr=0.1), range(3))
    except error as exc:
        raised = str(exc)
    flags = RANKS.allgather_object(text in raised)
    check(all(flags), f"expected {text!r} on every rank, got {flags}; this rank: {raised[:300]!r}")
    return {"message": raised.strip().splitlines()[-1][:80] if raised else ""}


def scenarios() -> dict[str, Callable[[], dict[str, Any]]]:
    """Every scenario by name, in the order they run (the failing ones last)."""
    configs = [
        Scenario("train", steps=20, lr=0.5, loss_must_fall=True),
        Scenario("allgather", collective="allgather"),
        Scenario("two_phase", collective="two_phase"),
        Scenario("dense", collective="dense"),
        Scenario("no_sync", accumulate=3),
        Scenario("find_unused", find_unused_parameters=True, unused_param=True),
        Scenario("static_graph", static_graph=True),
        Scenario("one_bucket", bucket_cap_mb=25),
        Scenario("chunks", bucket_cap_mb=25, chunk_bytes=64, collective="allgather"),
        Scenario("chunk_escalations", chunk_bytes=200, collective="allgather", budget_bits=1.0, max_distortion=0.05,
                 min_cosine=0.97, expect_escalation=True),
        Scenario("bucket_view", gradient_as_bucket_view=True, wrapped_names=True),
        Scenario("frozen", frozen=True),
        Scenario("nonfinite", nonfinite_step=2),
        Scenario("escalations", budget_bits=1.0, max_distortion=0.05, min_cosine=0.97, expect_escalation=True),
        Scenario("auto", steps=40, budget_bits="auto", lr=0.5, loss_must_fall=True),   # past the warm start
    ]
    table: dict[str, Callable[[], dict[str, Any]]] = {c.name: (lambda c=c: run_training(c)) for c in configs}
    table["checkpoint_restore"] = run_checkpoint_restore
    table["front_end_parity"] = run_front_end_parity
    table["unregistered"] = lambda: expect_error(
        Scenario("unregistered"), "does not know", named=lambda m: [(n, p) for n, p in m.named_parameters()
                                                                    if n.startswith("fc1")])
    table["inconsistent"] = lambda: expect_error(Scenario("inconsistent"), "disagree", budget_bits=2.0)
    table["inconsistent_chunks"] = lambda: expect_error(Scenario("inconsistent_chunks"), "disagree", chunk_bytes=64)
    table["inconsistent_menu"] = lambda: expect_error(Scenario("inconsistent_menu"), "disagree",
                                                      menu=["fp32", "fp16", "int8"])
    return table


def main() -> int:
    return run_torch_worker(__doc__.splitlines()[0], scenarios())


if __name__ == "__main__":
    exit_without_finalization(main())
