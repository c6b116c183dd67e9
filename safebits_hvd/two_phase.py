"""The two-phase collective (docs/DESIGN.md, "Compressed collectives"): packed scatter-reduce, a second hop of
error feedback, packed allgather.

Each tensor is cut into ``P`` segments at bucket boundaries (:func:`.collectives.segment_bounds`), each packed on
its own by the send pass. When a step closes, :meth:`TwoPhaseReduction.start` sends segment ``r`` of every tensor
(index order) to rank ``r`` in ONE alltoall (alltoalls never fuse in Horovod). :meth:`TwoPhaseReduction.finish`,
at the first ``decompress`` of the step, sums the segment this rank owns over every rank (rank order), re-encodes
each sum ``s`` with a residual this rank owns (``v = s + e2``, ``e2 <- v - q2``: the second hop's error feedback,
as DeepSpeed's ``server_error``), screened like the first hop, and ONE allgather delivers every owner's payloads
to every rank, which decodes each tensor whole. Both collectives are submitted for every tensor at the same point
of the step on every rank, so none can wait on a collective another rank has not submitted.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from . import collectives, kernels
from .actions import Menu
from .collectives import PayloadTransport
from .memory import ErrorFeedback
from .policy import BudgetPolicy
from .rng import stream_key
from .screen import distortion_cosine_of


class TwoPhaseReduction:
    """The two-phase collective of one core: segments, the step in flight, the second hop's residuals.

    Attributes:
        memory: the second hop's residuals, per tensor name, of the segment this rank owns (checkpointed).
        ranges: the element range of each residual in :attr:`memory` (checkpointed; the segment it was owned as).
        segments: per tensor, the ``P`` element ranges (set by :meth:`configure`).
    """

    def __init__(self, names: list[str], numels: np.ndarray, menu: Menu, policy: BudgetPolicy, name: str) -> None:
        self.names = names
        self.numels = numels
        self.menu = menu
        self.policy = policy
        self.name = name
        self.memory = ErrorFeedback()
        self.ranges: dict[str, tuple[int, int]] = {}
        self.segments: list[list[tuple[int, int]]] = []
        self.transport: PayloadTransport | None = None
        self._payloads: dict[int, list[torch.Tensor]] = {}       # the step's first-hop payloads, by tensor
        self._pending: tuple[int, Any, np.ndarray, int] | None = None   # (step, alltoall handle, allocation, seed)
        self._done: tuple[int, list[torch.Tensor]] | None = None        # (step, reduced sum of every tensor)
        self.second_hop_bytes = (-1, 0)        # (step, link bytes of this rank's second hop)

    def configure(self, transport: PayloadTransport) -> list[tuple[str, int, torch.Tensor]]:
        """Segments for ``transport``'s world (when the transport is known, and again after the world changed).

        Returns the residuals this rank no longer owns as ``(name, start, residual)``, removed from :attr:`memory`:
        their segment moved (another world size or rank). The caller adds each back into the first-hop residual
        at ``start``, so the error they hold is sent later, not lost (docs/DESIGN.md, "Elastic training")."""
        self.transport = transport
        self.segments = [collectives.segment_bounds(int(n), self.menu.bucket_size, transport.size)
                         for n in self.numels]
        moved = []
        for index, name in enumerate(self.names):
            residual = self.memory.residuals.get(name)
            if residual is None:
                continue
            owned = self.segments[index][transport.rank]
            held = self.ranges.get(name)
            if held is None:      # a state of format 3 did not say: it can only be the segment it matches
                if residual.numel() != owned[1] - owned[0]:
                    raise ValueError(f"the second-hop residual of {name!r} was saved by an older SafeBits for "
                                     f"another world size; restore it on as many ranks as saved it")
                held = owned
            if held != owned:
                moved.append((name, held[0], self.memory.pop(name)))
                del self.ranges[name]
            else:
                self.ranges[name] = held
        return moved

    def leave_world(self) -> None:
        """Forget the transport and the segments (the world changed); :meth:`configure` runs again before use."""
        self.abort()
        self.transport = None
        self.segments = []

    def abort(self) -> None:
        """Drop the step in flight (its collectives failed)."""
        self._payloads = {}
        self._pending = None
        self._done = None

    def load_state_dict(self, residuals: dict[str, torch.Tensor], ranges: dict[str, tuple[int, int]]) -> None:
        """Restore the residuals and their ranges (empty ranges: a state of format 3, see :meth:`configure`,
        which the caller runs again if the transport is known)."""
        self.memory.load_state_dict(residuals)
        self.ranges = dict(ranges)

    @property
    def pending_step(self) -> int | None:
        """The step whose second phase has not run yet (None if none)."""
        return self._pending[0] if self._pending is not None else None

    def add(self, index: int, payloads: list[torch.Tensor]) -> None:
        """Tensor ``index``'s first-hop segment payloads for the step in progress."""
        self._payloads[index] = payloads

    def start(self, step: int, allocation: np.ndarray, seed: int, zeros: Any) -> None:
        """Close of a step: one alltoall of every tensor's segment ``r`` to rank ``r``. ``zeros(index, device)``
        gives the payloads of a tensor never sent this step (an incomplete step), so every rank's layout stays the
        same."""
        assert self.transport is not None
        device = next(iter(self._payloads.values()))[0].device if self._payloads else torch.device("cpu")
        for index in range(len(self.names)):
            if index not in self._payloads:
                self._payloads[index] = zeros(index, device)
        tensors = len(self.names)
        pieces = [[self._payloads[i][r] for i in range(tensors)] for r in range(self.transport.size)]
        buffer = torch.cat([p for piece in pieces for p in piece])
        handle = self.transport.start_alltoall(f"{self.name}.two_phase.alltoall", buffer,
                                               [sum(p.numel() for p in piece) for piece in pieces])
        self._pending = (step, handle, allocation.copy(), seed)
        self._payloads = {}

    def finish(self) -> None:
        """The second phase of the pending step (see the module docstring)."""
        assert self._pending is not None and self.transport is not None
        step, handle, allocation, seed = self._pending
        self._pending = None
        ranks, rank, tensors = self.transport.size, self.transport.rank, len(self.names)
        received, _ = self.transport.wait(handle)
        first_hop = collectives.split_payloads(received, ranks * tensors, f"{self.name} step {step} alltoall")
        owned = []
        for index in range(tensors):
            start, stop = self.segments[index][rank]
            total = torch.zeros(stop - start, dtype=torch.float32, device=received.device)
            for source in range(ranks):
                kernels.decode_add(first_hop[source * tensors + index], total, name=self.names[index])
            key = collectives.segment_key(stream_key(seed, step, index), ranks + 1)
            owned.append(self._second_hop(index, int(allocation[index]), total, key))
        mine = torch.cat(owned)
        self.second_hop_bytes = (step, collectives.link_bytes("allgather", mine.numel(), ranks))
        gathered = self.transport.wait(self.transport.start_allgather(f"{self.name}.two_phase.allgather", mine))
        second_hop = collectives.split_payloads(gathered, ranks * tensors, f"{self.name} step {step} allgather")
        results = []
        for index in range(tensors):
            out = torch.zeros(int(self.numels[index]), dtype=torch.float32, device=gathered.device)
            for owner, (start, stop) in enumerate(self.segments[index]):
                kernels.decode_add(second_hop[owner * tensors + index], out[start:stop], name=self.names[index])
            results.append(out)
        self._done = (step, results)

    def result(self, index: int, step: int) -> torch.Tensor:
        """Tensor ``index``'s reduced sum at ``step`` (runs the second phase first if it is pending)."""
        if self.pending_step == step:
            self.finish()
        if self._done is None or self._done[0] != step:
            raise RuntimeError(f"the two-phase reduction of step {step} is no longer held (a later step began)")
        return self._done[1][index]

    def _second_hop(self, index: int, allocated: int, total: torch.Tensor, key: int) -> torch.Tensor:
        """The owned segment's sum re-encoded with error feedback, screened like the first hop: the allocated
        action if its exact statistics pass, else costlier ones, else lossless. Returns the payload."""
        policy = self.policy
        finite = math.isfinite(float(total.sum())) or bool(torch.isfinite(total).all())   # the sum is cheap
        if not finite:                                # a rank propagated NaN/Inf: pass the sum on, keep e2 clean
            return kernels.quantize_pack_ef(total, torch.zeros_like(total), self.menu[policy.lossless_index], 0)[0]
        e2 = self.memory.residual(self.names[index], total.numel(), total.device)
        assert self.transport is not None
        self.ranges[self.names[index]] = self.segments[index][self.transport.rank]
        order = [allocated]
        if policy.screen_enabled:
            cost = policy.costs[index]
            order += [int(a) for a in policy.cost_order[index]
                      if cost[a] > cost[allocated] and not policy.lossless[a]] + [policy.lossless_index]
        source: torch.Tensor | None = total
        payload = total
        for attempt, action_index in enumerate(order):
            if attempt:              # e2 held v - q2: restore v and quantize it again
                kernels.decode_add(payload, e2, name=self.names[index])
                source = None
            payload, stats = kernels.quantize_pack_ef(source, e2, self.menu[action_index], key)
            d, c = distortion_cosine_of(stats.tolist())
            if policy.accepts(action_index, d, c):
                break
        return payload
