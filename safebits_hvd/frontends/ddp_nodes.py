"""The DDP hook on the hop across nodes only: the node's own ranks reduce uncompressed, SafeBits carries each node's
sum to the other nodes (docs/DESIGN.md, "Across nodes only").

    from safebits_hvd import ddp as sbddp
    state = sbddp.AcrossNodesState(model.named_parameters(), node_size=8, budget_bits=4.4)
    ddp_model.register_comm_hook(state, sbddp.safebits_hook)

Inside a node the GPUs talk over NVLink, between nodes through a NIC a hundred times slower; CGX, ZeRO++ and
Bagua's ByteGrad compress only that hop. Every parameter has an owner among the ranks of a node (by size, the same
on every node); each rank's core holds the parameters it owns, with their actions, screens and residuals, and runs
its statistics exchange and payload collectives over the ranks that share its place in their nodes. Per bucket:

1. **Node sum**: ``all_reduce`` of DDP's bucket buffer inside the node, float32, uncompressed.
2. **Across nodes**: the rank's own parameters of the bucket, one group of its core's step on the allgather path
   (one batched pass; the step's allocation check before its first payload), their collective started at once.
3. **Close** (the last bucket): every owned parameter decoded in rank order into the buffer (the sum over nodes of
   the node sums, divided by the world size: the mean), the others zeroed, the core's step ended.
4. **Share**: ``all_reduce`` of each buffer inside the node again: each parameter's owner contributes its mean, the
   others zeros; every bucket's future completes.

Each rank of a node keeps its own core (records, budget, digest): its records are alike on the ranks that share
its place in their nodes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ..codec.actions import DEFAULT_MENU, Menu
from ..comm.exchange import DEFAULT_TIMEOUT
from ..comm.transports import over_process_group
from ..step.core import Grouping, Handle
from .shared import CoreView, build_core_over, refuse_unsent, registered_parameters


def node_groups(node_size: int) -> tuple[Any, Any]:
    """(the ranks of this rank's node, the ranks at this rank's place in every node) for nodes of ``node_size``
    consecutive ranks: every rank creates every group, in the same order, as ``dist.new_group`` requires."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1 or world % node_size:
        raise ValueError(f"node_size must be a positive int dividing the world size {world}, got {node_size!r}")
    intra = inter = None
    for node in range(world // node_size):
        group = dist.new_group(list(range(node * node_size, (node + 1) * node_size)))
        if rank // node_size == node:
            intra = group
    for place in range(node_size):
        group = dist.new_group(list(range(place, world, node_size)))
        if rank % node_size == place:
            inter = group
    return intra, inter


def owners(numels: list[int], ranks: int) -> list[int]:
    """The rank of a node that owns each parameter: the largest first, each to the rank owning the fewest
    elements so far (the lowest on a tie); the same on every rank."""
    load = [0] * ranks
    owner = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += numels[index]
    return owner


class _Bucket(NamedTuple):
    future: torch.futures.Future[torch.Tensor]
    buffer: torch.Tensor
    owned: list[int]                      # core indices of this rank's parameters in the bucket
    views: list[torch.Tensor]             # their ranges of the buffer
    others: list[torch.Tensor]            # the ranges of the parameters other ranks of the node own


class AcrossNodesState(CoreView):
    """SafeBits' DDP state for the hop across nodes only (see the module docstring); pass it with
    :func:`~safebits_hvd.ddp.safebits_hook` to ``register_comm_hook``.

    Args:
        named_parameters: as :class:`~safebits_hvd.ddp.SafeBitsState` (the model's, matched to DDP's buckets by
            identity).
        node_size: ranks per node, nodes of consecutive ranks (``torchrun --nproc_per_node``); or
        groups: ``(the node's group, the group of the ranks at this rank's place in every node)``.
        budget_bits and the other options: as :class:`~safebits_hvd.SafeBits`; a number of bits or a schedule.

    ``torch.distributed`` must be initialized first. A float32 bucket buffer only (DDP's with float32 parameters).
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | Any, node_size: int | None = None,
                 budget_bits: float | Callable[[int], float] = 4.4, max_distortion: float = 0.5,
                 min_cosine: float = 0.7, menu: Menu | Iterable[str] = DEFAULT_MENU, seed: int = 0,
                 log_path: str | os.PathLike[str] | None = None, *, groups: tuple[Any, Any] | None = None,
                 sample_buckets: int = 16, consistency_check_every: int = 1, nonfinite: str = "propagate",
                 screen: bool = True, name: str = "safebits.nodes", max_history: int = 1000,
                 timeout: float | None = DEFAULT_TIMEOUT) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("AcrossNodesState needs torch.distributed initialized (dist.init_process_group) first")
        if isinstance(budget_bits, str):
            raise ValueError(f"budget_bits={budget_bits!r}: AcrossNodesState takes a number of bits or a schedule")
        if (node_size is None) == (groups is None):
            raise ValueError("give AcrossNodesState node_size= or groups=(node group, across-nodes group), one of them")
        self.intra, self.inter = groups if groups is not None else node_groups(node_size)  # type: ignore[arg-type]
        self.place, self.node_size = dist.get_rank(self.intra), dist.get_world_size(self.intra)
        self.nodes = dist.get_world_size(self.inter)
        names, params = registered_parameters(named_parameters)
        owner = owners([p.numel() for p in params], self.node_size)
        mine = [i for i, o in enumerate(owner) if o == self.place]
        if not mine:
            raise ValueError(f"{len(params)} parameters for {self.node_size} ranks a node: rank {self.place} of each "
                             f"node would own none; use fewer ranks a node")
        links = over_process_group(self.inter)
        self.core = build_core_over(
            [names[i] for i in mine], np.array([params[i].numel() for i in mine], dtype=np.int64), budget_bits,
            max_distortion, min_cosine, menu, seed, log_path, sample_buckets=sample_buckets,
            consistency_check_every=consistency_check_every, nonfinite=nonfinite, screen=screen, name=name,
            max_history=max_history, collective="allgather", timeout=timeout,
            exchange=links.exchange, transport=links.transport, fusion_bytes=0)
        self.names = self.core.names
        slot = {i: k for k, i in enumerate(mine)}
        self._index = {id(p): slot.get(i, -1) for i, p in enumerate(params)}
        self._pending: list[_Bucket] = []
        self._handle: Handle | None = None

    def reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Steps 1 and 2 of the module docstring for one bucket, 3 and 4 at the last one; returns the bucket's
        future (completed at the last bucket)."""
        buffer = bucket.buffer()
        if buffer.dtype != torch.float32 or not buffer.is_contiguous():
            raise ValueError(f"AcrossNodesState reduces float32 buckets, got {buffer.dtype}")
        parameters = bucket.parameters()
        if any(id(p) not in self._index for p in parameters):
            raise ValueError("DDP reduces a parameter AcrossNodesState does not know; build it from the same "
                             "model's named_parameters() as DDP")
        views = list(buffer.split([p.numel() for p in parameters]))
        slots = [self._index[id(p)] for p in parameters]
        core = self.core
        if not self._pending:        # the step's first bucket (the core may close before DDP's last bucket)
            self._handle = core.begin(Grouping(self.node_size, f"node_size {self.node_size}", "AcrossNodesState"))
        # 1. Node sum.
        dist.all_reduce(buffer, group=self.intra)
        # 2. Across nodes: this rank's parameters of the bucket.
        owned = [s for s in slots if s >= 0]
        mine = [v for v, s in zip(views, slots, strict=True) if s >= 0]
        if owned:
            core.send_group(owned, mine, list(mine), close=False)
            core.close()
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        others = [v for v, s in zip(views, slots, strict=True) if s < 0]
        self._pending.append(_Bucket(future, buffer, owned, mine, others))
        if bucket.is_last():
            self._close_step()
        return future

    def _close_step(self) -> None:
        """Steps 3 and 4: the means of the owned parameters, shared inside the node; every future completed."""
        core, pending, self._pending = self.core, self._pending, []
        refuse_unsent(core, "AcrossNodesState")
        handle = self._handle
        assert handle is not None
        world = self.node_size * self.nodes
        for bucket in pending:
            if bucket.owned:
                core.reduced_sums(bucket.owned, handle, list(bucket.views), divisor=float(world))
            for view in bucket.others:
                view.zero_()
        core.end(handle.step)
        for bucket in pending:
            dist.all_reduce(bucket.buffer, group=self.intra)
            bucket.future.set_result(bucket.buffer)


__all__ = ["AcrossNodesState", "node_groups", "owners"]
