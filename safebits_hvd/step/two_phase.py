"""The two-phase collective (docs/DESIGN.md, "Compressed collectives"): packed scatter-reduce, a second hop of
error feedback, packed allgather.

Each tensor is cut into ``P`` segments at bucket boundaries (:func:`.collectives.segment_bounds`), each packed on
its own. The core registers each gradient (:meth:`TwoPhasePath.register`); when the step closes, one batched pass
sends every tensor registered (:func:`send_first_hop`: one read back for the check, the screen and
the choice, one for the packing of every segment), and :meth:`TwoPhasePath.close` sends
segment ``r`` of every tensor (index order) to rank ``r`` in ONE alltoall (alltoalls never fuse in Horovod).
:meth:`TwoPhasePath.finish`, at the first ``decompress`` of the step, sums the segment this rank owns over every
rank (rank order), re-encodes each sum ``s`` with a residual this rank owns (``v = s + e2``, ``e2 <- v - q2``: the
second hop's error feedback, as DeepSpeed's ``server_error``) through the first hop's escalation
(:func:`.sending.escalation_rounds`), and ONE allgather delivers every owner's payloads to every rank, which decodes
each tensor whole. Both collectives are submitted for every tensor at the same point of the step on every rank, so
none can wait on a collective another rank has not submitted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..codec import host, kernels, wire
from ..codec.actions import Action
from ..codec.rng import stream_key, stream_keys
from ..comm import collectives, transports
from ..comm.collectives import CollectivePath, packed_zeros
from ..comm.transports import PayloadTransport
from ..policy.budget import BudgetPolicy
from ..policy.screen import distortion_cosine
from .memory import ErrorFeedback
from .sending import Sender, escalation_rounds, packed_again


class TwoPhasePath(CollectivePath):
    """The two-phase collective of one core: segments, the step in flight, the second hop's residuals.

    Attributes:
        memory: the second hop's residuals, per tensor name, of the segment this rank owns (checkpointed).
        ranges: the element range of each residual in :attr:`memory` (checkpointed; the segment it was owned as).
        segments: per tensor, the ``P`` element ranges (set by :meth:`configure`).
    """

    name = "two_phase"
    batched = True          # its one alltoall starts when the step closes: nothing is lost by packing then

    def __init__(self, names: list[str], numels: np.ndarray, policy: BudgetPolicy, collective_name: str,
                 sender: Sender) -> None:
        super().__init__(policy.menu, policy.cost_order[:, 0])
        self.names = names
        self.numels = numels
        self.policy = policy
        self.collective_name = collective_name
        self.sender = sender              # the core's sending.Sender: the first hop in one batched pass
        self.segment_tables: kernels.GroupTables | None = None      # every segment's, row index * P + segment
        self.memory = ErrorFeedback()
        self.ranges: dict[str, tuple[int, int]] = {}
        self.segments: list[list[tuple[int, int]]] = []
        self.configured_for: PayloadTransport | None = None       # the transport the segments were cut for
        self.step_begun = -1
        self._registered: dict[int, torch.Tensor] = {}           # the step's gradients, until the step closes
        self._payloads: dict[int, list[torch.Tensor]] = {}       # the step's first-hop payloads, by tensor
        self._closed: tuple[int, dict[int, list[torch.Tensor]]] = (-1, {})   # (step, its payloads) once closed
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
        self.segments = [collectives.segment_bounds(int(n), self.menu.bucket_size, transport.size, index)
                         for index, n in enumerate(self.numels)]
        lengths = np.array([[stop - start for start, stop in bounds] for bounds in self.segments], dtype=np.int64)
        self.segment_tables = kernels.GroupTables(self.menu, lengths.reshape(-1),
                                                  np.repeat(self.policy.cost_order, transport.size, axis=0))
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

    def join_world(self, transport: PayloadTransport, first_hop: ErrorFeedback | None) -> None:
        if self.configured_for is None:
            self.configure(transport, first_hop)

    def leave_world(self) -> None:
        """Forget the transport and the segments (the world changed); :meth:`configure` runs again before use."""
        self.abort()
        self.configured_for = None
        self.segments = []

    def begin(self, step: int, transport: PayloadTransport) -> None:
        super().begin(step, transport)
        self.step_begun = step
        self._registered = {}

    def abort(self) -> None:
        """Drop the step in flight (its collectives failed)."""
        self._registered = {}
        self._payloads = {}
        self._pending = None
        self._done = None

    def load_state_dict(self, residuals: dict[str, torch.Tensor], ranges: dict[str, tuple[int, int]]) -> None:
        """Restore the residuals and their ranges (empty ranges: a state of format 3, see :meth:`configure`,
        which the caller runs again if the transport is known)."""
        self.memory.load_state_dict(residuals)
        self.ranges = dict(ranges)

    def complete(self, step: int) -> int:
        """The second phase of ``step`` done (run now if pending); returns the link bytes of its second hop."""
        if self.pending_step == step:
            self.finish()
        return self.second_hop_bytes[1] if self.second_hop_bytes[0] == step else 0

    @property
    def pending_step(self) -> int | None:
        """The step whose second phase has not run yet (None if none)."""
        return self._pending[0] if self._pending is not None else None

    # ------------------------------------------------------------------ the first hop
    def register(self, index: int, gradient: torch.Tensor, into: torch.Tensor | None) -> int | None:
        """Keep tensor ``index``'s flat gradient until the step closes (``into`` is not used: the sum comes from the
        second hop)."""
        self._registered[index] = gradient
        return None

    def flush(self) -> None:
        """Send every registered tensor in one batched pass (:func:`send_first_hop`)."""
        if not self._registered:
            return
        assert self.segment_tables is not None
        members = np.array(sorted(self._registered), dtype=np.int64)
        grads = [self._registered[i] for i in members.tolist()]
        self._registered = {}
        sent = send_first_hop(self.sender, members, grads, self.segments, self.segment_tables)
        for index, payloads in sent.items():
            self.wire_bytes += self.link_bytes(payloads)
            self._payloads[index] = payloads

    def payload(self, index: int, step: int) -> torch.Tensor:
        """This rank's first-hop payloads of tensor ``index`` at ``step``, back to back, once the step closed."""
        held, payloads = self._closed
        if held != step or index not in payloads:
            raise RuntimeError(f"the two-phase payloads of {self.names[index]!r} at step {step} are sent when the "
                               f"step closes and held until the next one begins")
        return torch.cat(payloads[index])

    def encode(self, index: int, g: torch.Tensor | None, e: torch.Tensor, action: Action, key: int,
               into: torch.Tensor | None) -> tuple[Any, np.ndarray]:
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

    def restore(self, index: int, sent: Any, e: torch.Tensor, name: str, action: int | None = None) -> None:
        for payload, (start, stop) in zip(sent, self.segments[index], strict=True):
            header = None if action is None else wire.header_of(self.menu[action], stop - start)
            kernels.decode_add(payload, e[start:stop], name=name, header=header)

    def zeros(self, index: int, n: int, device: torch.device) -> Any:
        action = self.menu[int(self.cheapest[index])]
        return [packed_zeros(action, stop - start, device) for start, stop in self.segments[index]]

    def link_bytes(self, sent: Any) -> int:
        return sum(p.numel() for r, p in enumerate(sent) if r != self.transport.rank)

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
        transports.launch(self.transport)         # the step's first hop moves now, wherever its transport queues
        self._pending = (step, handle, allocation.copy(), seed)
        self._closed = (step, self._payloads)
        self._payloads = {}

    # ------------------------------------------------------------------ the second hop
    def finish(self) -> None:
        """The second phase of the pending step (see the module docstring), batched over every tensor: the owned
        segments located in the alltoall's buffer (:func:`.kernels.locate_payloads`, one read back) and summed
        over ranks in rank order in one call; re-encoded in one pass (:meth:`_second_hop`); the owners' payloads
        located in the allgather's buffer and decoded in one call."""
        assert self._pending is not None and self.segment_tables is not None
        step, handle, allocation, seed = self._pending
        self._pending = None
        ranks, rank, tensors = self.transport.size, self.transport.rank, len(self.names)
        tables, segments = self.segment_tables, self.segments
        indices = np.arange(tensors, dtype=np.int64)
        names = list(self.names)
        received, _ = self.transport.wait(handle)
        mine = np.repeat((indices * ranks + rank)[:, None], ranks, axis=1)          # [tensor, source rank]
        first_hop, actions = kernels.locate_payloads(received, mine, allocation, tables, names,
                                                         f"{self.collective_name} step {step} alltoall")
        # Each sum starts from zeros and adds every rank in rank order (own = ranks: nothing written first).
        totals = [torch.zeros(stop - start, dtype=torch.float32, device=received.device)
                  for start, stop in (bounds[rank] for bounds in segments)]
        kernels.decode_group(first_hop, actions, totals, np.full(tensors, ranks), tables, mine[:, 0], names)
        owned = self._second_hop(step, seed, allocation, totals)
        mine_bytes = torch.cat(owned)
        self.second_hop_bytes = (step, mine_bytes.numel() * (ranks - 1))
        gathered = self.transport.wait(self.transport.start_allgather(f"{self.collective_name}.two_phase.allgather",
                                                                      mine_bytes))
        owners = indices[:, None] * ranks + np.arange(ranks)[None, :]              # [tensor, owner]
        second_hop, actions = kernels.locate_payloads(gathered, owners, allocation, tables, names,
                                                          f"{self.collective_name} step {step} allgather")
        results = [torch.zeros(int(n), dtype=torch.float32, device=gathered.device) for n in self.numels]
        # Every (tensor, owner) pair is a member of one rank: its segment of the result, added into zeros.
        pieces = [results[i][start:stop] for i in range(tensors) for start, stop in segments[i]]
        kernels.decode_group(kernels.Gathered(gathered, second_hop.offsets.reshape(-1, 1)), actions.reshape(-1, 1),
                             pieces, np.ones(tensors * ranks, dtype=np.int64), tables, owners.reshape(-1),
                             [name for name in names for _ in range(ranks)])
        self._done = (step, results)

    def reduced_sums(self, indices: list[int], step: int, outs: list[torch.Tensor | None],
                     divisor: float) -> list[torch.Tensor]:
        """Runs the second phase first if it is pending."""
        if self.pending_step == step:
            self.finish()
        if self._done is None or self._done[0] != step:
            if step >= self.step_begun:
                raise RuntimeError(f"the two-phase reduction of step {step} exists once every tensor of the step "
                                   f"has been compressed (its one alltoall starts then)")
            raise RuntimeError(f"the two-phase reduction of step {step} is no longer held (a later step began)")
        totals = []
        for index, out in zip(indices, outs, strict=True):
            total = self._done[1][index]
            total = total if out is None else out.copy_(total)
            totals.append(total.div_(divisor) if divisor != 1.0 else total)
        return totals

    def _second_hop(self, step: int, seed: int, allocation: np.ndarray,
                    totals: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every owned segment's sum re-encoded with error feedback, screened like the first hop: the allocated
        action if its exact statistics pass, else costlier ones, else lossless; one batched pass (one read back)
        over every tensor, then the first hop's rounds (:func:`.sending.escalation_rounds`) for those that failed and a
        lossless pass on a scratch residual for a non-finite sum (a rank propagated NaN/Inf: the sum is passed on,
        ``e2`` kept clean). Returns the payloads in tensor order."""
        policy, tables, ranks, rank = self.policy, self.segment_tables, self.transport.size, self.transport.rank
        assert tables is not None
        tensors = len(self.names)
        indices = np.arange(tensors, dtype=np.int64)
        rows = indices * ranks + rank
        device = totals[0].device if totals else torch.device("cpu")
        existed = [name in self.memory.residuals for name in self.names]
        residuals = [self.memory.residual(name, total.numel(), device) for name, total in zip(self.names, totals,
                                                                                             strict=True)]
        keys = np.array([collectives.segment_key(stream_key(seed, step, i), ranks + 1) for i in range(tensors)],
                        dtype=np.int64)
        sent = kernels.pack_group(kernels.PackRequest(rows, totals, residuals, [None] * tensors, [None] * tensors,
                                                    keys, allocation, True, False, False, policy.rule), tables)
        distortion, cosine = distortion_cosine(sent.stats)
        payloads: list[torch.Tensor] = []
        orders: dict[int, list[int]] = {}
        for index in range(tensors):
            name, allocated, total = self.names[index], int(allocation[index]), totals[index]
            if not sent.finite[index]:
                if not existed[index]:
                    self.memory.pop(name)             # no residual is made for a sum that was not encoded
                payloads.append(kernels.quantize_pack_ef(total, torch.zeros_like(total),
                                                         self.menu[policy.lossless_index], 0)[0])
                continue
            self.ranges[name] = self.segments[index][rank]
            payloads.append(sent.buffer[sent.offsets[index]:sent.offsets[index + 1]])
            if not policy.accepts(allocated, float(distortion[index]), float(cosine[index])):
                # No screen estimate of a sum: the costlier actions, by cost, then the lossless one.
                costlier = policy.costs[index] > policy.costs[index, allocated]
                costlier[allocated] = True
                orders[index] = policy.send_order(index, allocated, costlier)

        def repack(escalating: np.ndarray, actions: np.ndarray) -> np.ndarray:
            for index in escalating.tolist():
                kernels.decode_add(payloads[index], residuals[index], name=self.names[index])      # e <- e + q
            retry = packed_again(rows[escalating], [residuals[i] for i in escalating.tolist()],
                                 [None] * len(escalating), keys[escalating], actions, policy, tables)
            for j, index in enumerate(escalating.tolist()):
                payloads[index] = retry.buffer[retry.offsets[j]:retry.offsets[j + 1]]
            return retry.stats

        for _ in escalation_rounds(orders, repack, policy):
            pass                # nothing to record: a sum's statistics are not the step's (its first hop's are)
        return payloads


def send_first_hop(sender: Sender, members: np.ndarray, grads: list[torch.Tensor],
                   segments: list[list[tuple[int, int]]],
                   segment_tables: kernels.GroupTables) -> dict[int, list[torch.Tensor]]:
    """The two-phase first hop of ``members`` batched: one pass checks, screens and chooses per tensor
    (``GroupOutput.SCREEN``, one read back); one more packs every segment of every finite member at its tensor's choice
    under the segment's RNG key (:func:`.collectives.segment_key`; one read back), segment after segment, as
    ``TwoPhasePath.encode`` does one tensor; a tensor's exact statistics are its segments' added in segment
    order; escalation as :meth:`.sending.Sender.send_members`, each round repacking every segment of its members.
    Returns each tensor's payloads, one per segment. ``segment_tables``: the tables of every segment, row
    ``index * P + segment``."""
    with sender.member_tensors.of(members, grads[0].device) as (residuals, samples):
        return _send_first_hop(sender, members, grads, segments, segment_tables, residuals, samples)


def _send_first_hop(sender: Sender, members: np.ndarray, grads: list[torch.Tensor],
                    segments: list[list[tuple[int, int]]], segment_tables: kernels.GroupTables,
                    residuals: list[torch.Tensor],
                    samples: list[torch.Tensor | None]) -> dict[int, list[torch.Tensor]]:
    policy = sender.policy
    m = len(members)
    ranks = len(segments[int(members[0])])
    keys = stream_keys(sender.seed, sender.step, members)
    request = sender.group_request(members, grads, residuals, samples, [None] * m, keys, kernels.GroupOutput.SCREEN)
    result = kernels.pack_group(request, sender.tables)
    sender.take_screen(members, result)
    payloads: dict[int, Any] = {}
    segment_keys = np.array([[collectives.segment_key(int(key), r) for r in range(ranks)] for key in keys],
                            dtype=np.int64)

    def pack(rows: np.ndarray, actions: np.ndarray, first: bool) -> np.ndarray:
        # Segment r of every row, for r = 0, 1, ...: the statistics are then added in segment order.
        slots = [(k, r) for r in range(ranks) for k in rows.tolist()]
        bounds = [segments[int(members[k])][r] for k, r in slots]
        sent = kernels.pack_group(kernels.PackRequest(
            np.array([int(members[k]) * ranks + r for k, r in slots], dtype=np.int64),
            [grads[k][a:b] if first else None for (k, _), (a, b) in zip(slots, bounds, strict=True)],
            [residuals[k][a:b] for (k, _), (a, b) in zip(slots, bounds, strict=True)], [None] * len(slots),
            [None] * len(slots), np.array([segment_keys[k, r] for k, r in slots], dtype=np.int64),
            np.tile(actions, ranks), False, False, False, policy.rule),
            segment_tables)
        stats = np.zeros((len(rows), 4))
        for r in range(ranks):
            stats += sent.stats[r * len(rows):(r + 1) * len(rows)]
        for j, k in enumerate(rows.tolist()):
            slot = [r * len(rows) + j for r in range(ranks)]
            payloads[int(members[k])] = [sent.buffer[sent.offsets[i]:sent.offsets[i + 1]] for i in slot]
        return stats

    def repack(rows: np.ndarray, actions: np.ndarray) -> np.ndarray:
        for k in rows.tolist():
            index = int(members[k])
            for payload, (a, b) in zip(payloads[index], segments[index], strict=True):
                kernels.decode_add(payload, residuals[k][a:b], name=sender.names[index])    # e <- e + q
        return pack(rows, actions, False)

    finite = np.flatnonzero(result.finite)
    stats = np.zeros((m, 4))
    stats[finite] = pack(finite, result.chosen[finite], True)
    sender.escalate_group(members, result, stats, grads, [None] * m, payloads, repack)
    return payloads
