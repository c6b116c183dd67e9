"""DDP worker: SafeBits on the hop across nodes only (:class:`safebits_hvd.ddp.AcrossNodesState`) in one
``torchrun`` launch (Gloo, CPU): nodes of 1 rank at np 2, of 2 ranks at np 4.

``train``: a small MLP under DDP (small buckets, so a step has several) with the hook; after every step the
parameters are bitwise identical on every rank, each bucket DDP gets back is the mean over all ranks within the
compression's error (the exact mean taken beside it), the loss falls, and the records are alike on the ranks that
share a place in their nodes. ``errors``: clear errors for a node size that does not divide the world, a missing
one, and ``budget_bits="auto"``.
"""

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi_tests"))
from scenario_runner import TorchRanks, check, params_digest, run_torch_worker, step_failures

from safebits_hvd import ddp as sbddp
from safebits_hvd.frontends.launch import exit_without_finalization

STEPS = 8


def node_size() -> int:
    return 2 if dist.get_world_size() >= 4 else 1


def train() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 5))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
    state = sbddp.AcrossNodesState(ddp.named_parameters(), node_size=node_size(), budget_bits=4.4)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        exact = bucket.buffer().clone()
        dist.all_reduce(exact)
        exact /= dist.get_world_size()

        def keep(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            pairs.append((exact, done.value().clone()))
            return done.value()

        return sbddp.safebits_hook(state, bucket).then(keep)

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses, failures = [], []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x = torch.randn(32, 32, generator=gen)
        y = (x[:, :5] > 0).long().argmax(dim=1)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        failures += step_failures(step, pairs, "the buckets are", params_digest(model))
    check(not failures, "; ".join(failures[:3]))
    records = TorchRanks.allgather_object((state.place, [(r.step, r.allocation_digest) for r in state.history]))
    check(all(r == q for p, r in records for p2, q in records if p == p2), "records differ across ranks")
    check(len(state.history) == STEPS, f"{len(state.history)} records for {STEPS} steps")
    check(sum(losses[-3:]) < sum(losses[:3]), f"the loss did not fall: {losses}")
    record = state.last_step
    return {"node_size": state.node_size, "nodes": state.nodes, "members": len(state.names),
            "ratio": round(record.modeled_compression_ratio, 2), "loss": (round(losses[0], 3), round(losses[-1], 3))}


def errors() -> str:
    model = nn.Linear(4, 4)
    for kwargs, words in (({"node_size": 3}, "dividing"), ({}, "one of them"),
                          ({"node_size": 1, "budget_bits": "auto"}, "auto")):
        if kwargs.get("node_size") == 3 and dist.get_world_size() % 3 == 0:
            continue
        try:
            sbddp.AcrossNodesState(model.named_parameters(), **kwargs)
            raise AssertionError(f"{kwargs} was accepted")
        except ValueError as exc:
            check(words in str(exc), str(exc))
    return "clear errors"


if __name__ == "__main__":
    exit_without_finalization(run_torch_worker(__doc__.splitlines()[0], {"train": train, "errors": errors}))
