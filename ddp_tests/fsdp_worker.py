"""FSDP2 worker: SafeBits' FSDP front end (:mod:`safebits_hvd.fsdp`) in several scenarios in one ``torchrun``
launch (Gloo, CPU).

Every training scenario shards a small MLP with ``fully_shard`` (each linear layer, then the root), installs SafeBits
with ``sbfsdp.compress`` and checks across all ranks (``dist.all_gather_object``): the loss falls; after every step the
full parameters are bitwise identical on every rank; this rank's reduced shard is the mean over ranks of the gradients
within the compression's error (the exact mean taken beside it, through a reduce-scatter that wraps SafeBits': right
row, right divisor); one ``StepRecord`` per step with the digest identical on every rank. Also: steps without gradient
sync send nothing and the next one reduces the accumulated gradients; FSDP's ``reduce_dtype=bfloat16`` with SafeBits'
residuals in bfloat16 (half their bytes); the hop across replicas only (``replicate_group=``: at np 4, shards of 2 ranks
and 2 replicas; at np 2, 2 replicas of unsharded modules), each rank's shard against the exact mean over the replicas; a
checkpoint round trip; ``budget_bits=32`` passing through FSDP's own reduce-scatter (bitwise its output every step in
float32; in bf16 too, its bf16 reduce); ``budget_bits="auto"``, whose gradient noise, measured on each rank's shard
only, is that of the whole mean; and clear errors for a model never sharded, ``"auto"`` across replicas, a gradient
divide factor, native HSDP and ranks that allocate differently. The sharded scenarios run on the reduce-scatter path
(each row to its owner), the hop across replicas on the allgather path; each one's wire bytes are the model's (where no
rank escalated).
"""

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi_tests"))
from scenario_runner import TorchRanks, check, run_torch_worker, step_failures

from safebits_hvd import fsdp as sbfsdp
from safebits_hvd.codec import wire
from safebits_hvd.frontends.launch import exit_without_finalization

WIDTH, CLASSES, STEPS = 48, 5, 8


def sharded_model(reduce_dtype: torch.dtype | None = None, mesh: Any = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, 33), nn.ReLU(), nn.Linear(33, CLASSES))
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy, mesh=mesh)
    fully_shard(model, mp_policy=policy, mesh=mesh)
    return model


class ExactBeside:
    """Wraps each module's SafeBits reduce-scatter: takes the exact mean (an uncompressed reduce-scatter of a
    copy) first, and keeps both shards for the scenario to compare."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.norms: list[tuple[float, float]] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        local = float(input_tensor.double().square().sum())       # before SafeBits decodes into the buffer
        exact = torch.empty_like(output_tensor, dtype=torch.float32)
        dist.reduce_scatter_tensor(exact, input_tensor.float().clone(), op=op, group=group)
        self.inner(output_tensor, input_tensor, group, op)
        self.pairs.append((exact, output_tensor.float().clone()))
        self.last = self.pairs[-1]
        # ||g||² of this rank's whole buffer and ||mean||² of the shard it got: the noise meter's two sums
        self.norms.append((local, float(self.last[1].double().square().sum())))


def full_params_digest(model: nn.Module) -> list[float]:
    """Each parameter's full tensor (gathered from the shards), summed, in order: equal on every rank."""
    return [float(p.full_tensor().double().sum()) for p in model.parameters()]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(16, WIDTH, generator=gen)
    return x, (x[:, :CLASSES] > 0).long().argmax(dim=1)


class ExactAcross:
    """Wraps SafeBits' all-reduce hook of one module (the hop across replicas): the exact mean over the replicate
    group taken first, both shards kept."""

    def __init__(self, state: Any, module: Any, group: Any) -> None:
        self.state, self.module, self.group = state, module, group
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, shard: torch.Tensor) -> None:
        exact = shard.float().clone()
        dist.all_reduce(exact, group=self.group)
        exact /= dist.get_world_size(self.group)
        self.state.all_reduce(self.module, shard)
        self.pairs.append((exact, shard.float().clone()))


def train(reduce_dtype: torch.dtype | None = None, replicas: bool = False,
          residual_dtype: torch.dtype = torch.float32, budget_bits: Any = 4.4,
          max_distortion: float = 0.5) -> dict[str, Any]:
    if replicas:      # the hop across replicas only: shard inside pairs of ranks (or not at all on 2), replicate across
        world = dist.get_world_size()
        shard = 2 if world >= 4 else 1
        mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        group = mesh["replicate"].get_group()
        model = sharded_model(reduce_dtype, mesh["shard"])
        state = sbfsdp.compress(model, budget_bits=4.4, replicate_group=group)
        wrappers: list[Any] = []
        for module in state.modules:
            wrappers.append(ExactAcross(state, module, group))
            module.module.set_all_reduce_hook(wrappers[-1])
    else:
        model = sharded_model(reduce_dtype)
        state = sbfsdp.compress(model, budget_bits=budget_bits, residual_dtype=residual_dtype,
                                max_distortion=max_distortion)
        wrappers = []
        for module in state.modules:
            wrappers.append(ExactBeside(sbfsdp.SafeBitsReduceScatter(state, module)))
            module.module.set_custom_reduce_scatter(wrappers[-1])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, failures = [], []      # checked after the loop: a rank that stopped early would leave the others waiting
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        pairs = [pair for wrapper in wrappers for pair in wrapper.pairs]
        for wrapper in wrappers:
            wrapper.pairs.clear()
        failures += step_failures(step, pairs, "this rank's shard is", str(full_params_digest(model)))
    check(not failures, "; ".join(failures[:3]))
    record = state.last_step
    # Sharded, each row goes to its owner alone (the reduce-scatter path); across replicas every replica needs it.
    # 32 bits (or auto's choice of them) pass through FSDP's own reduce-scatter: the dense path.
    collective = "allgather" if replicas else "reduce_scatter"
    allowed = {4.4: (collective,), 32.0: ("dense",), "auto": (collective, "dense")}[budget_bits]
    check(record is not None and record.collective in allowed, f"no {allowed} record: {record}")
    if budget_bits == 32.0:        # passing through: FSDP's own reduce-scatter, bitwise, every step
        passed = sum(r.pass_through and r.collective == "dense" for r in state.history)
        bitwise = reduce_dtype is not None or all(torch.equal(*w.last) for w in wrappers)    # bf16: in bf16
        check(passed == STEPS and bitwise, f"{passed} of {STEPS} passed through")
    if budget_bits == "auto":
        check_noise(state, [w.norms for w in wrappers])
    if max_distortion < 0.5:       # ranks escalated differently: longer payloads' rests took the second alltoall
        escalated = TorchRanks.allgather_object(sum(len(r.escalations) for r in state.history))
        check(len(set(escalated)) > 1 or min(escalated) > 0, f"escalations per rank: {escalated}")
    # One core per shard position: its records are alike on the ranks that hold that shard (every rank, unsharded).
    position = state.rank if replicas else 0
    records = TorchRanks.allgather_object((position, [(r.step, r.allocation_digest) for r in state.history]))
    check(all(r == q for p, r in records for p2, q in records if p == p2), "records differ across ranks")
    check(len(state.history) == STEPS, f"{len(state.history)} records for {STEPS} steps")
    if not record.escalations:      # the record's actions are every rank's costliest: this rank's where none escalated
        check_wire_bytes(state, record)
    check(sum(losses[-3:]) < sum(losses[:3]), f"the loss did not fall: {losses}")
    # Error feedback covers this rank's full local gradient: every member's residual, in the dtype asked for.
    size = torch.empty(0, dtype=residual_dtype).element_size()
    compressed = not state.history[-1].pass_through       # a step passing through sends the residuals and drops them
    check(state.memory.nbytes == compressed * size * state.core.total_elements
          and all(e.dtype == residual_dtype for e in state.memory.residuals.values()),
          f"residuals take {state.memory.nbytes} bytes for {state.core.total_elements} elements")
    return {"collective": record.collective, "ratio": round(record.modeled_compression_ratio, 2),
            "loss": (round(losses[0], 3), round(losses[-1], 3)), "members": len(state.names),
            "wire_bytes": record.wire_bytes}


def check_wire_bytes(state: Any, record: Any) -> None:
    """The record's wire bytes are the model's: on the reduce-scatter path the payloads of the rows other ranks own,
    each once; on the allgather path (across replicas) every payload to every other replica; passing through, FSDP's
    reduce-scatter of the float32 buffer, ``(P - 1) / P`` of it."""
    if record.collective == "dense":
        expected = 4 * state.core.total_elements * (state.ranks - 1) // state.ranks
    else:
        actions = {action.name: action for action in state.core.menu}
        sent = [wire.payload_nbytes(actions[record.actions[name]], int(n))
                for name, n in zip(state.names, state.core.numels, strict=True)]
        if record.collective == "reduce_scatter":      # members are named <parameter>#row<owner>
            owners = [int(name.rsplit("#row", 1)[1]) for name in state.names]
            expected = sum(b for b, owner in zip(sent, owners, strict=True) if owner != state.rank)
        else:
            expected = (state.group_size - 1) * sum(sent)
    check(record.wire_bytes == expected, f"{record.collective}: {record.wire_bytes} wire bytes, the model {expected}")


def check_noise(state: Any, norms: list[list[tuple[float, float]]]) -> None:
    """``auto``'s gradient noise, which each rank measures on its shard of the mean only, is that of the whole
    mean: ``(M - G) / (P - 1)``, ``M`` the midrange of the ranks' ``||g||²``, ``G`` the sum over ranks of their
    shards' ``||mean||²`` less the step's compression error (0 where it passed through)."""
    ranks, steps = dist.get_world_size(), len(norms[0])
    mine = [(sum(n[s][0] for n in norms), sum(n[s][1] for n in norms)) for s in range(steps)]
    every = TorchRanks.allgather_object(mine)
    errors = {r.step: r.compression_error for r in state.history}
    measured = [r for r in state.history if r.noise_step >= 0]
    check(measured, "no step's noise was measured")
    for record in measured:
        local = [every[r][record.noise_step][0] for r in range(ranks)]
        reduced = sum(every[r][record.noise_step][1] for r in range(ranks)) - errors[record.noise_step]
        expected = max(0.0, 0.5 * (max(local) + min(local)) - max(0.0, reduced)) / (ranks - 1)
        check(abs(record.gradient_noise - expected) <= 1e-4 * expected,
              f"step {record.noise_step}: noise {record.gradient_noise}, the shards' sums give {expected}")


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
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    try:
        sbfsdp.compress(sharded_model(mesh=mesh["shard"]), budget_bits="auto",
                        replicate_group=mesh["replicate"].get_group())
        raise AssertionError("budget_bits='auto' across replicas was accepted")
    except ValueError as exc:
        check("auto" in str(exc) and "replicate_group" in str(exc), str(exc))
    if dist.get_world_size() >= 4:
        try:
            sbfsdp.compress(sharded_model(mesh=init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                                                mesh_dim_names=("replicate", "shard"))))
            raise AssertionError("native HSDP was accepted")
        except ValueError as exc:
            check("replicate_group" in str(exc), str(exc))
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
    # Ranks that allocate differently are stopped before the alltoall (whose sizes come from the allocation).
    model = sharded_model()
    sbfsdp.compress(model, budget_bits=2.0 if dist.get_rank() == 1 else 4.4, timeout=30)
    x, y = batch(0)
    try:
        nn.functional.cross_entropy(model(x), y).backward()
        raise AssertionError("ranks that allocate differently were not stopped")
    except Exception as exc:        # whatever it is, it must say why, on every rank
        check("disagree" in str(exc), f"{type(exc).__name__}: {exc}")
    return "clear errors"


SCENARIOS = {"train": train, "bf16": lambda: train(torch.bfloat16, residual_dtype=torch.bfloat16),
             "replicas": lambda: train(replicas=True),
             "pass_through": lambda: train(budget_bits=32.0),
             "bf16_pass_through": lambda: train(torch.bfloat16, budget_bits=32.0),
             "auto": lambda: train(budget_bits="auto"),
             "escalated": lambda: train(max_distortion=0.05),
             "no_sync": no_sync, "checkpoint": checkpoint, "errors": errors}


def main() -> int:
    return run_torch_worker(__doc__.splitlines()[0], SCENARIOS)


if __name__ == "__main__":
    exit_without_finalization(main())
