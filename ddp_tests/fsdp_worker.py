"""FSDP2 worker: SafeBits' FSDP front end (:mod:`safebits_hvd.fsdp`) in several scenarios in one ``torchrun``
launch (Gloo, CPU).

Every training scenario shards a small MLP with ``fully_shard`` (each linear layer, then the root), installs
SafeBits with ``sbfsdp.compress`` and checks across all ranks (``dist.all_gather_object``): the loss falls; after
every step the full parameters are bitwise identical on every rank; this rank's reduced shard is the mean over
ranks of the gradients within the compression's error (the exact mean taken beside it, through a reduce-scatter
that wraps SafeBits': right row, right divisor); one ``StepRecord`` per step with the digest identical on every
rank. Also: steps without gradient sync send nothing and the next one reduces the accumulated gradients; FSDP's
``reduce_dtype=bfloat16``; a checkpoint round trip; and clear errors for a model never sharded,
``budget_bits="auto"`` and a gradient divide factor.
"""

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi_tests"))
from scenario_runner import TorchRanks, check, run_torch_worker

from safebits_hvd import fsdp as sbfsdp
from safebits_hvd.launch import exit_without_finalization

WIDTH, CLASSES, STEPS = 48, 5, 8


def sharded_model(reduce_dtype: torch.dtype | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, 33), nn.ReLU(), nn.Linear(33, CLASSES))
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


class ExactBeside:
    """Wraps each module's SafeBits reduce-scatter: takes the exact mean (an uncompressed reduce-scatter of a
    copy) first, and keeps both shards for the scenario to compare."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        exact = torch.empty_like(output_tensor, dtype=torch.float32)
        dist.reduce_scatter_tensor(exact, input_tensor.float().clone(), op=op, group=group)
        self.inner(output_tensor, input_tensor, group, op)
        self.pairs.append((exact, output_tensor.float().clone()))


def full_params_digest(model: nn.Module) -> list[float]:
    """Each parameter's full tensor (gathered from the shards), summed, in order: equal on every rank."""
    return [float(p.full_tensor().double().sum()) for p in model.parameters()]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(16, WIDTH, generator=gen)
    return x, (x[:, :CLASSES] > 0).long().argmax(dim=1)


def train(reduce_dtype: torch.dtype | None = None) -> dict[str, Any]:
    model = sharded_model(reduce_dtype)
    state = sbfsdp.compress(model, budget_bits=4.4)
    wrappers = []
    for module in state.modules:
        wrapper = ExactBeside(sbfsdp.SafeBitsReduceScatter(state, module))
        module.module.set_custom_reduce_scatter(wrapper)
        wrappers.append(wrapper)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, failures = [], []      # checked after the loop: a rank that stopped early would leave the others waiting
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        exact = torch.cat([e.flatten() for w in wrappers for e, _ in w.pairs])
        got = torch.cat([g.flatten() for w in wrappers for _, g in w.pairs])
        for wrapper in wrappers:
            wrapper.pairs.clear()
        cosine = float(torch.nn.functional.cosine_similarity(exact, got, dim=0))
        ratio = float(got.norm() / exact.norm().clamp_min(1e-12))
        if not (cosine > 0.8 and 0.7 < ratio < 1.4):
            failures.append(f"step {step}: this rank's shard is not the mean over ranks (cosine {cosine:.3f}, "
                            f"norm ratio {ratio:.3f})")
        digests = TorchRanks.allgather_object(full_params_digest(model))
        if not all(d == digests[0] for d in digests):
            failures.append(f"step {step}: parameters differ across ranks")
    check(not failures, "; ".join(failures[:3]))
    record = state.last_step
    check(record is not None and record.collective == "allgather", f"no allgather record: {record}")
    records = TorchRanks.allgather_object([(r.step, r.allocation_digest) for r in state.history])
    check(all(r == records[0] for r in records), "records differ across ranks")
    check(len(state.history) == STEPS, f"{len(state.history)} records for {STEPS} steps")
    check(sum(losses[-3:]) < sum(losses[:3]), f"the loss did not fall: {losses}")
    return {"collective": record.collective, "ratio": round(record.modeled_compression_ratio, 2),
            "loss": (round(losses[0], 3), round(losses[-1], 3)), "members": len(state.names)}


def no_sync() -> str:
    model = sharded_model()
    state = sbfsdp.compress(model, budget_bits=4.4)
    for step in range(3):
        sync = step != 1
        model.set_requires_gradient_sync(sync)
        x, y = batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        check(state.step == (1 if step < 2 else 2), f"step {step}: {state.step} SafeBits steps")
    return "an accumulation step sent nothing"


def checkpoint() -> str:
    model = sharded_model()
    state = sbfsdp.compress(model, budget_bits=4.4)
    for step in range(2):
        x, y = batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
    saved = state.state_dict()
    fresh = sbfsdp.compress(sharded_model(), budget_bits=4.4)
    fresh.load_state_dict(saved)
    mine, theirs = state.memory.residuals, fresh.memory.residuals
    check(sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine),
          "residuals differ after the round trip")
    check(fresh.step == state.step, "the step was not restored")
    return f"{len(mine)} residuals restored"


def errors() -> str:
    torch.manual_seed(0)
    try:
        sbfsdp.compress(nn.Linear(4, 4))
        raise AssertionError("an unsharded model was accepted")
    except ValueError as exc:
        check("fully_shard" in str(exc), str(exc))
    try:
        sbfsdp.compress(sharded_model(), budget_bits="auto")
        raise AssertionError("budget_bits='auto' was accepted")
    except ValueError as exc:
        check("auto" in str(exc), str(exc))
    model = sharded_model()
    sbfsdp.compress(model, budget_bits=4.4)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(3.0)
    x, y = batch(0)
    try:
        nn.functional.cross_entropy(model(x), y).backward()
        raise AssertionError("a gradient divide factor was accepted")
    except ValueError as exc:
        check("AVG and SUM" in str(exc), str(exc))
    return "clear errors"


SCENARIOS = {"train": train, "bf16_reduce": lambda: train(torch.bfloat16), "no_sync": no_sync,
             "checkpoint": checkpoint, "errors": errors}


def main() -> int:
    return run_torch_worker(__doc__.splitlines()[0], SCENARIOS)


if __name__ == "__main__":
    exit_without_finalization(main())
