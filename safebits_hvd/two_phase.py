"""The two-phase collective (docs/DESIGN.md, "Compressed collectives"): packed scatter-reduce, a second hop of
error feedback, packed allgather.

Each tensor is cut into ``P`` segments at bucket boundaries (:func:`.collectives.segment_bounds`), each packed on
its own by the send pass (:meth:`TwoPhasePath.encode`). When a step closes, :meth:`TwoPhasePath.close` sends
segment ``r`` of every tensor (index order) to rank ``r`` in ONE alltoall (alltoalls never fuse in Horovod).
:meth:`TwoPhasePath.finish`, at the first ``decompress`` of the step, sums the segment this rank owns over every
rank (rank order), re-encodes each sum ``s`` with a residual this rank owns (``v = s + e2``, ``e2 <- v - q2``: the
second hop's error feedback, as DeepSpeed's ``server_error``) through the first hop's screen-and-escalate loop
(:func:`.sending.escalate`), and ONE allgather delivers every owner's payloads to every rank, which decodes each
tensor whole. Both collectives are submitted for every tensor at the same point
of the step on every rank, so none can wait on a collective another rank has not submitted.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from . import collectives, host, kernels
from .actions import Action
from .collectives import CollectivePath, PackedCodec, packed_zeros
from .memory import ErrorFeedback
from .policy import BudgetPolicy
from .rng import stream_key
from .sending import escalate
from .transports import PayloadTransport


class TwoPhasePath(CollectivePath):
    """The two-phase collective of one core: segments, the step in flight, the second hop's residuals.

    Attributes:
        memory: the second hop's residuals, per tensor name, of the segment this rank owns (checkpointed).
        ranges: the element range of each residual in :attr:`memory` (checkpointed; the segment it was owned as).
        segments: per tensor, the ``P`` element ranges (set by :meth:`configure`).
    """

    name = "two_phase"

    def __init__(self, names: list[str], numels: np.ndarray, policy: BudgetPolicy, collective_name: str) -> None:
        super().__init__(policy.menu, policy.cost_order[:, 0])
        self.names = names
        self.numels = numels
        self.policy = policy
        self.collective_name = collective_name
        self.memory = ErrorFeedback()
        self.ranges: dict[str, tuple[int, int]] = {}
        self.segments: list[list[tuple[int, int]]] = []
        self.configured_for: PayloadTransport | None = None       # the transport the segments were cut for
        self.step_begun = -1
        self._codec = PackedCodec()
        self._payloads: dict[int, list[torch.Tensor]] = {}       # the step's first-hop payloads, by tensor
        self._pending: tuple[int, Any, np.ndarray, int] | None = None   # (step, alltoall handle, allocation, seed)
        self._done: tuple[int, list[torch.Tensor]] | None = None        # (step, reduced sum of every tensor)
        self.second_hop_bytes = (-1, 0)        # (step, link bytes of this rank's second hop)

    def configure(self, transport: PayloadTransport, first_hop: ErrorFeedback | None) -> None:
        """Segments for ``transport``'s world (when the transport is known, and again after the world changed).

        A second-hop residual whose segment this rank no longer owns (another world size or rank) is removed from
        :attr:`memory` and added back into ``first_hop``'s residual of the same elements (unless None: no error
        feedback), so the error it holds is sent later, not lost: the sum over ranks of what is not yet sent stays
        the same (docs/DESIGN.md, "Elastic training")."""
        self.transport = self.configured_for = transport
        self.segments = [collectives.segment_bounds(int(n), self.menu.bucket_size, transport.size)
                         for n in self.numels]
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
                moved = self.memory.pop(name)
                del self.ranges[name]
                if first_hop is not None:
                    e = first_hop.residual(name, int(self.numels[index]), moved.device)
                    e[held[0]:held[0] + moved.numel()].add_(moved)
            else:
                self.ranges[name] = held

    def leave_world(self) -> None:
        """Forget the transport and the segments (the world changed); :meth:`configure` runs again before use."""
        self.abort()
        self.configured_for = None
        self.segments = []

    def begin(self, step: int, transport: PayloadTransport) -> None:
        super().begin(step, transport)
        self.step_begun = step

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

    # ------------------------------------------------------------------ the first hop
    def encode(self, index: int, g: torch.Tensor | None, e: torch.Tensor, action: Action, key: int,
               own: torch.Tensor | None) -> tuple[Any, np.ndarray]:
        """One payload per segment; the statistics of all of ``q`` are the segments' sums added in segment order."""
        payloads, stats = [], []
        for segment, (start, stop) in enumerate(self.segments[index]):
            payload, segment_stats = kernels.quantize_pack_ef(None if g is None else g[start:stop], e[start:stop],
                                                              action, collectives.segment_key(key, segment))
            payloads.append(payload)
            stats.append(segment_stats)
        total = np.zeros(4)
        for row in host.to_host(torch.stack(stats)):
            total += row
        return payloads, total

    def restore(self, index: int, sent: Any, e: torch.Tensor, name: str) -> None:
        for payload, (start, stop) in zip(sent, self.segments[index], strict=True):
            kernels.decode_add(payload, e[start:stop], name=name)

    def zeros(self, index: int, n: int, device: torch.device) -> Any:
        action = self.menu[int(self.cheapest[index])]
        return [packed_zeros(action, stop - start, device) for start, stop in self.segments[index]]

    def link_bytes(self, sent: Any) -> int:
        return sum(p.numel() for r, p in enumerate(sent) if r != self.transport.rank)

    def add(self, index: int, sent: Any) -> Any:
        """Tensor ``index``'s first-hop segment payloads for the step in progress; the front end gets them back to
        back."""
        self.wire_bytes += self.link_bytes(sent)
        self._payloads[index] = sent
        return torch.cat(sent)

    def close(self, step: int, allocation: np.ndarray, seed: int) -> None:
        """Close of a step: one alltoall of every tensor's segment ``r`` to rank ``r``; a tensor never sent this
        step (an incomplete step) sends zeros, so every rank's layout stays the same."""
        device = next(iter(self._payloads.values()))[0].device if self._payloads else torch.device("cpu")
        for index in range(len(self.names)):
            if index not in self._payloads:
                self._payloads[index] = self.zeros(index, int(self.numels[index]), device)
        tensors = len(self.names)
        pieces = [[self._payloads[i][r] for i in range(tensors)] for r in range(self.transport.size)]
        buffer = torch.cat([p for piece in pieces for p in piece])
        handle = self.transport.start_alltoall(f"{self.collective_name}.two_phase.alltoall", buffer,
                                               [sum(p.numel() for p in piece) for piece in pieces])
        self._pending = (step, handle, allocation.copy(), seed)
        self._payloads = {}

    # ------------------------------------------------------------------ the second hop
    def finish(self) -> None:
        """The second phase of the pending step (see the module docstring)."""
        assert self._pending is not None
        step, handle, allocation, seed = self._pending
        self._pending = None
        ranks, rank, tensors = self.transport.size, self.transport.rank, len(self.names)
        received, _ = self.transport.wait(handle)
        first_hop = collectives.split_payloads(received, ranks * tensors,
                                               f"{self.collective_name} step {step} alltoall")
        owned = []
        for index in range(tensors):
            start, stop = self.segments[index][rank]
            total = torch.zeros(stop - start, dtype=torch.float32, device=received.device)
            for source in range(ranks):
                kernels.decode_add(first_hop[source * tensors + index], total, name=self.names[index])
            key = collectives.segment_key(stream_key(seed, step, index), ranks + 1)
            owned.append(self._second_hop(index, int(allocation[index]), total, key))
        mine = torch.cat(owned)
        self.second_hop_bytes = (step, mine.numel() * (ranks - 1))
        gathered = self.transport.wait(self.transport.start_allgather(f"{self.collective_name}.two_phase.allgather",
                                                                      mine))
        second_hop = collectives.split_payloads(gathered, ranks * tensors,
                                                f"{self.collective_name} step {step} allgather")
        results = []
        for index in range(tensors):
            out = torch.zeros(int(self.numels[index]), dtype=torch.float32, device=gathered.device)
            for owner, (start, stop) in enumerate(self.segments[index]):
                kernels.decode_add(second_hop[owner * tensors + index], out[start:stop], name=self.names[index])
            results.append(out)
        self._done = (step, results)

    def reduced_sum(self, index: int, step: int, out: torch.Tensor | None, divisor: float) -> torch.Tensor:
        """Runs the second phase first if it is pending."""
        if self.pending_step == step:
            self.finish()
        if self._done is None or self._done[0] != step:
            if step >= self.step_begun:
                raise RuntimeError(f"the two-phase reduction of step {step} exists once every tensor of the step "
                                   f"has been compressed (its one alltoall starts then)")
            raise RuntimeError(f"the two-phase reduction of step {step} is no longer held (a later step began)")
        total = self._done[1][index]
        total = total if out is None else out.copy_(total)
        return total.div_(divisor) if divisor != 1.0 else total

    def _second_hop(self, index: int, allocated: int, total: torch.Tensor, key: int) -> torch.Tensor:
        """The owned segment's sum re-encoded with error feedback, screened like the first hop: the allocated
        action if its exact statistics pass, else costlier ones, else lossless. Returns the payload."""
        policy = self.policy
        finite = math.isfinite(float(total.sum())) or bool(torch.isfinite(total).all())   # the sum is cheap
        if not finite:                                # a rank propagated NaN/Inf: pass the sum on, keep e2 clean
            return kernels.quantize_pack_ef(total, torch.zeros_like(total), self.menu[policy.lossless_index], 0)[0]
        e2 = self.memory.residual(self.names[index], total.numel(), total.device)
        self.ranges[self.names[index]] = self.segments[index][self.transport.rank]
        order = [allocated]
        if policy.screen_enabled:
            cost = policy.costs[index]
            order += [int(a) for a in policy.cost_order[index]
                      if cost[a] > cost[allocated] and not policy.lossless[a]] + [policy.lossless_index]
        return escalate(self._codec, self.menu, index, order, total, e2, key, None, policy.accepts,
                        self.names[index]).sent
