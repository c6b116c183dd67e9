"""The reduce-scatter path (docs/DESIGN.md, "Compressed collectives"): each tensor has an owner rank, and only its
owner receives its payloads.

A sharded front end (FSDP2's reduce-scatter: :mod:`safebits_hvd.fsdp`) gives each of its members an owner, the rank
whose shard the member is. A group it sends together is packed in one batched pass as on the allgather path
(:class:`~.collectives.AllgatherPath`: the screen, escalation and error feedback are the same), its members in
owner order, so the payloads for rank ``r`` lie back to back; ONE alltoall sends them to ``r``. The owner decodes
each of its members from every rank's payload in rank order (:func:`.kernels.receive_group`, the allgather path's
receiver over what arrived), so its sum is bitwise what the allgather path gives. A rank moves ``b (P - 1) / P``
bits an element where the allgather path moves ``b (P - 1)``: what makes sharded training scale (docs/RESULTS.md
8.2).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..codec import kernels
from . import transports
from .collectives import AllgatherPath


class ReduceScatterPath(AllgatherPath):
    """Every member's payload to its owner alone (module docstring). ``owners``: each tensor's owner rank."""

    name = "reduce_scatter"

    def __init__(self, names: list[str], numels: np.ndarray, tables: kernels.GroupTables, cheapest: np.ndarray,
                 sender: Any, collective_name: str, owners: np.ndarray) -> None:
        super().__init__(names, numels, tables, cheapest, sender, collective_name, fusion_bytes=0)
        self.owners = np.asarray(owners, dtype=np.int64)
        if self.owners.shape != (len(names),) or (self.owners < 0).any():
            raise ValueError(f"the reduce-scatter path needs an owner rank >= 0 for each of its {len(names)} tensors")

    def join_world(self, transport: Any, first_hop: Any) -> None:
        if int(self.owners.max(initial=0)) >= transport.size:
            raise ValueError(f"the reduce-scatter path's owners go up to rank {int(self.owners.max())}, but "
                             f"{transport.size} ranks take part")

    def link_bytes(self, sent: Any) -> int:
        raise RuntimeError("the reduce-scatter path counts its bytes by owner when a group starts")

    def launch(self, members: list[int] | np.ndarray) -> None:
        """Start the group's alltoall once the step's check is done, at the bytes its allocated actions take per
        owner (the same on every rank: no size exchange; only an escalated rest waits for the wait)."""
        self._check.finish()
        rows = np.asarray(members, dtype=np.int64)
        per_owner = np.bincount(self.owners[rows], weights=self.allocated_payload_bytes(rows),
                                minlength=self.transport.size)
        transports.launch(self.transport, [int(b) for b in per_owner])

    def start(self, group: int, buffer: torch.Tensor, offsets: np.ndarray, expected: np.ndarray,
              intos: dict[int, torch.Tensor | None], member_bytes: int) -> None:
        """As the allgather path's, keeping the allocated actions of the members this rank receives (its own)."""
        owned = self.owners[self._members[group]] == self.transport.rank
        super().start(group, buffer, offsets, np.asarray(expected)[owned], intos, member_bytes)

    def _start_collective(self, group: int, buffer: torch.Tensor, offsets: np.ndarray, member_bytes: int) -> Any:
        """The group's alltoall: the payloads of rank ``r``'s members (members in owner order) to rank ``r``."""
        owners = self.owners[self._members[group]]
        if (np.diff(owners) < 0).any():
            raise RuntimeError(f"the reduce-scatter path sends groups in owner order; the group of "
                               f"{self.names[self.groups[group][0]]!r} is not (send its members by owner)")
        cuts = np.searchsorted(owners, np.arange(self.transport.size + 1))
        splits = (np.asarray(offsets)[cuts[1:]] - np.asarray(offsets)[cuts[:-1]]).tolist()
        me = self.transport.rank
        self.wire_bytes += sum(size for rank, size in enumerate(splits) if rank != me)
        return self.transport.start_alltoall(f"{self.collective_name}.scatter.{self.groups[group][0]}", buffer,
                                             splits)

    def reduced_sums(self, indices: list[int], step: int, outs: list[torch.Tensor | None],
                     divisor: float) -> list[torch.Tensor]:
        """As the allgather path's, for the tensors this rank owns (only they are received here)."""
        foreign = [i for i in indices if int(self.owners[i]) != self.transport.rank]
        if foreign:
            raise ValueError(f"rank {self.transport.rank} receives only the tensors it owns on the reduce-scatter "
                             f"path; {self.names[foreign[0]]!r} is rank {int(self.owners[foreign[0]])}'s")
        return super().reduced_sums(indices, step, outs, divisor)

    def _wait(self, group: int) -> torch.Tensor:
        received, _ = self.transport.wait(self._handles.pop(group))
        return received

    def _receivers(self, group: int) -> np.ndarray:
        """The group's members this rank owns, in member order."""
        members = self._members[group]
        return members[self.owners[members] == self.transport.rank]
