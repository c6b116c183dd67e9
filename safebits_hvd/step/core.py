"""The framework-free core of SCGB-EF: :class:`SafeBitsCore`, one state object per set of parameters.

A front end (the Horovod compressor, the fixed-action baselines, the DDP and FSDP front ends:
:mod:`safebits_hvd.frontends`) matches each gradient to a parameter index and drives the core through three calls:

* :meth:`SafeBitsCore.send` (tensor *i*): quantize it for the wire, with error feedback. The first send of a step
  begins the step; the last one (every registered tensor sent once) closes it.
* :meth:`SafeBitsCore.reduced_taken` / :meth:`SafeBitsCore.end` (step *t*): the front end has the step's reduced
  tensors; the step's statistics and telemetry start their exchange.
* :meth:`SafeBitsCore.finish`: wait for that exchange, if it is still pending (the next begin does), and take in
  the reduced statistics: the step's record, the next allocation's input and, for ``budget_bits="auto"``, the
  next budget's telemetry.
* checkpointing: :func:`.checkpoint.save` / :func:`.checkpoint.load` (between steps).

The life of one step (numbers reappear in the code; steps 4 to 6 in :mod:`.closing`; docs/DESIGN.md, "The life of
one step"):

1. **Begin**: finish the previous step's exchange (6) if still pending, which hands a schedule that reads telemetry
   (``observe_timing``: ``budget_bits="auto"``) the previous step's, reduced; take the step's budget from the
   schedule; the policy allocates an action per tensor from the previous step's reduced statistics
   (:mod:`.policy`); digest it.
2. **Screen** (:class:`.sending.Sender`, one batched pass over many tensors on the packed paths: docs/DESIGN.md,
   "The batched step"): the kernels measure every menu action on ``v = g + e`` over a sample of whole buckets (all
   buckets for small tensors); the policy turns that into the admissible set. A group is a fusion group on the
   allgather path, the whole step on the two-phase path (sent when it closes); the dense path goes tensor by tensor.
3. **Send** (the same pass): the allocated action if admissible, else the tensor *escalates*: the pass writes
   ``q = Q(v)`` and ``e <- v - q`` and returns the exact statistics of ``q``; if they fail the screen, the next
   candidate is tried, a round for all such tensors at once, and the lossless action always passes. Every sent
   tensor satisfies the screen. What travels is the step's collective path's (:class:`.collectives.CollectivePath`).
4. **Close**: every tensor has been sent; the step's statistics are complete.
5. **End**: the front end has taken every reduced tensor of the step; the step's telemetry (:mod:`.clock`) is
   complete too and joins the statistics in one vector, whose exchange starts (:mod:`.exchange`; layout:
   :mod:`.statistics`). Starting needs nothing from other ranks, so it cannot deadlock; it runs during the optimizer
   step and the next forward pass.
6. **Finish** (at the next begin): wait for the exchange; record the step (:mod:`.telemetry`); keep the reduced
   statistics for the next allocation; check that every rank allocated the same way (the digest); hand a schedule
   that reads telemetry the step's figures.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from ..codec import kernels
from ..comm import collectives
from ..comm.clock import StepClock
from ..comm.collectives import AllgatherPath, CollectivePath, DensePath, Grouping
from ..comm.exchange import StatisticsExchange, allocation_digest, digest_words, waited_seconds
from ..comm.reduce_scatter import ReduceScatterPath
from ..comm.statistics import StatisticsLayout, StepStatistics
from ..comm.transports import PayloadTransport, make_transport
from ..policy.allocator import Allocation
from ..policy.budget import BudgetPolicy
from ..policy.quality import NoiseMeter
from ..policy.schedules import budget_at
from ..policy.telemetry import StepLog, warn_never_sent
from .closing import ClosedStep, StepClosing, call_factory
from .memory import ErrorFeedback
from .sending import Sender, check_numel, checked_into, flat_gradient
from .two_phase import TwoPhasePath


class Handle(NamedTuple):
    """A front end's handle on a step: what :meth:`SafeBitsCore.send` returns for one tensor (and
    :meth:`SafeBitsCore.begin` for the step), handed back to :meth:`SafeBitsCore.reduced_sums` and
    :meth:`SafeBitsCore.payload`."""

    wire: torch.Tensor | None   # dense: the dequantized float32 values; the packed paths: None, the tensor is sent
    #                             later, with its group or the step (CollectivePath.payload)
    step: int                   # the step it belongs to (for finish)
    collective: str             # "dense", "allgather" or "two_phase" (the step's choice, identical on every rank)

    @property
    def packed(self) -> bool:
        """Whether the step's tensors travel as packed payloads in SafeBits' collectives (else as float32 values in
        the front end's allreduce: ``wire``)."""
        return self.collective != "dense"


class SafeBitsCore:
    """SCGB-EF for ``len(names)`` tensors: allocation, screen, escalation, error feedback, exchange, records.

    Args:
        names: parameter names (unique), in registration order; tensor *i* is ``names[i]``.
        numels: element count of each tensor.
        policy: the per-step decisions (:class:`~safebits_hvd.policy.budget.BudgetPolicy`; the baselines pass a
            fixed one).
        schedule: ``step -> bits per parameter``.
        seed: seed of the counter-based stochastic-rounding RNG.
        exchange, transport: the statistics and the payload transports, or callables that make them when first
            needed (Horovod may be initialized after the front end is built).
        error_feedback: keep the residual ``e <- v - q`` per tensor (else ``e = 0`` every step).
        nonfinite: ``"propagate"``, ``"raise"`` or ``"skip"`` (see :class:`~safebits_hvd.SafeBits`).
        sample_buckets: buckets per tensor the screen estimates on.
        consistency_check_every: compare allocation digests every this many steps (0: never).
        max_history, log_path: see :class:`~.telemetry.StepLog`.
        collective: ``"auto"``, ``"allgather"``, ``"two_phase"``, ``"dense"`` (:mod:`.collectives`), or
            ``"reduce_scatter"`` with ``owners``, each tensor's owner rank (:mod:`.reduce_scatter`).
        dense_wire_bytes: bytes per element the front end puts on the wire on the dense path (4: float32).
        name: prefix of the payload collectives' names (distinct per object).
        fusion_bytes: float32 gradient bytes per allgather fusion group (:func:`.collectives.fusion_groups`);
            None: by device (:func:`.collectives.fusion_bytes_for`); 0: each tensor alone (the DDP hook's groups).
        residual_dtype: how the residuals are stored (:data:`.memory.RESIDUAL_DTYPES`).
    """

    def __init__(self, names: list[str], numels: np.ndarray, *, policy: BudgetPolicy,
                 schedule: Callable[[int], float], seed: int,
                 exchange: StatisticsExchange | Callable[[], StatisticsExchange], error_feedback: bool = True,
                 nonfinite: str = "propagate", sample_buckets: int = 16, consistency_check_every: int = 1,
                 max_history: int = 10000, log_path: str | os.PathLike[str] | None = None, collective: str = "dense",
                 transport: PayloadTransport | Callable[[], PayloadTransport] = make_transport,
                 dense_wire_bytes: int = 4, name: str = "safebits", fusion_bytes: int | None = None,
                 residual_dtype: torch.dtype = torch.float32, owners: np.ndarray | None = None) -> None:
        # -- what is being compressed, and how decisions are made
        self.names, self.numels, self.total_elements = names, numels, int(numels.sum())
        self._numels: list[int] = numels.tolist()      # as Python ints (a NumPy scalar per send costs time)
        self.policy, self.menu = policy, policy.menu
        self.schedule, self.seed, self.error_feedback = schedule, seed, error_feedback
        if collective not in collectives.COLLECTIVES or (collective == "reduce_scatter") != (owners is not None):
            raise ValueError(f"collective must be one of {collectives.COLLECTIVES}, 'reduce_scatter' with owners "
                             f"(and only it), got {collective!r}")
        self.collective_setting = collective
        self.transport_source = transport
        self.transport: PayloadTransport | None = transport if isinstance(transport, PayloadTransport) else None
        self.name = name

        # -- state carried across steps (all of it checkpointed, see state_dict)
        self.memory = ErrorFeedback(residual_dtype)     # per-tensor residuals e, per rank
        # The collective paths, one chosen per step (collectives.choose): two-phase holds segments, its step in
        # flight and its second hop's residuals; allgather its fusion groups in flight and tables built once.
        cheapest = policy.cost_order[:, 0]
        tables = kernels.GroupTables(policy.menu, numels, policy.cost_order)
        # Steps 2 and 3: the screen and the send.
        self.sender = Sender(names, numels, policy, self.memory, error_feedback=error_feedback, nonfinite=nonfinite,
                             sample_buckets=sample_buckets, tables=tables)
        self.two_phase = TwoPhasePath(names, numels, policy, name, self.sender)
        self.allgather = AllgatherPath(names, numels, tables, cheapest, self.sender, name, fusion_bytes)
        self.path: CollectivePath = DensePath(policy.menu, cheapest, self.sender, dense_wire_bytes,
                                              hops=1 if owners is not None else 2)    # FSDP's own: a reduce-scatter
        self.paths: dict[str, CollectivePath] = {"dense": self.path, "allgather": self.allgather,
                                                 "two_phase": self.two_phase}
        if owners is not None:
            self.paths["reduce_scatter"] = ReduceScatterPath(names, numels, tables, cheapest, self.sender, name, owners)
        self.step = 0                                  # index of the next step to begin

        # -- the step in progress
        tensors, actions = len(names), len(self.menu)
        self.unsent = np.ones(tensors, dtype=bool)     # tensors not sent yet in the step in progress
        self.unsent_count = tensors                   # how many (numpy's any() per tensor costs microseconds)
        self.in_step = False
        self._allocation: Allocation | None = None
        self._budget_bits_total = 0.0
        self.allocation_digest = ""                    # of the step in progress (or the last begun)
        self.allocation_seconds = 0.0                  # wall time of the last allocation (overhead telemetry)
        # A step whose budget fits every tensor uncompressed on the dense path passes the gradients through: no
        # screen, no packing (and the next allocation, with no statistics from it, uses the start policy).
        self.pass_through_step = False
        self.clock = StepClock()                       # this rank's telemetry (clock.py), exchanged at the step's end

        # -- steps 4 to 6 (closing.py): the statistics and telemetry go into the vector the exchange reduces in
        # place, started by reduced_taken() or end(), finished by the next begin or finish(): the records, the
        # next input.
        self.layout = StatisticsLayout(tensors, actions)
        self.log = StepLog(names, self.menu.names, self.total_elements, max_history,
                           os.fspath(log_path) if log_path is not None else None)
        self.closing = StepClosing(self.layout, exchange, policy=policy, schedule=schedule, log=self.log,
                                   clock=self.clock, consistency_check_every=consistency_check_every,
                                   complete_second_hop=self.two_phase.complete)
        self._statistics: StepStatistics = self.closing.statistics_of(0)
        self.noise: NoiseMeter = self.closing.noise    # fed here (the dense path's reduced: by the front end)

    # ------------------------------------------------------------------ 2 and 3: screen and send
    def send(self, index: int, grad: torch.Tensor, into: torch.Tensor | None = None) -> Handle:
        """Quantize tensor ``index``'s gradient for the wire (and start its payload collective, if any). ``into``:
        the flat float32 tensor the front end will pass :meth:`reduced_sums` as ``out`` (it may share ``grad``'s
        storage, whose values are consumed here); on the allgather path the send pass writes this rank's ``q``
        into it, so that the sum over ranks starts from them instead of decoding this rank's payload again."""
        start = time.perf_counter()
        self._begin_for(index)
        path = self.path
        g = flat_gradient(self.names[index], grad, self._numels[index])
        self.noise.local([g])
        into = checked_into(self.names[index], g, into) if path.batched else None
        if path.batched:
            # Only registered: the group's members are sent together when its last one arrives.
            group = path.register(index, g, into)
            wire = None
        else:
            wire = path.add(index, self.sender.send(index, g, into))
        if path.batched and group is not None:
            path.start_group(group)
        return self._mark_sent(index, 1, Handle(wire, self.step, path.name), start)

    def in_pass_through(self, index: int) -> bool:
        """Whether tensor ``index`` is one of a pass-through step begun already and not sent yet (:meth:`pass_through`
        takes it)."""
        return self.in_step and self.pass_through_step and bool(self.unsent[index])

    def pass_through(self, index: int, grad: torch.Tensor) -> Handle:
        """:meth:`send` where :meth:`in_pass_through`: a float32 contiguous gradient in its own shape, handed on as it
        is (or with a residual of an earlier step added, flat): no flattening, no torch call, so that passing
        through costs about what ``Compression.none`` costs."""
        start = time.perf_counter()
        check_numel(self.names[index], grad, self._numels[index])
        self.noise.local([grad])
        wire = self.path.add(index, self.sender.pass_through(index, grad, None))
        return self._mark_sent(index, 1, Handle(wire, self.step, self.path.name), start)

    def pass_through_unchanged(self, indices: list[int], values: torch.Tensor) -> bool:
        """:meth:`send_group` of tensors the front end's allreduce takes where they are (``values``: DDP's bucket),
        in a pass-through step where they go on unchanged (:meth:`.sending.Sender.pass_through_is_unchanged`): marked
        sent at once, no Python per tensor. False, with nothing sent, where :meth:`send_group` must run instead."""
        start = time.perf_counter()
        self._begin_for(indices)
        if not self.sender.pass_through_is_unchanged():
            return False
        self.noise.local([values])
        rows, path = np.asarray(indices, dtype=np.int64), self.path
        self.sender.record_pass_through(rows)
        path.add_unchanged(self.numels[rows].astype(np.int64))
        self._mark_sent(rows, len(rows), Handle(None, self.step, path.name), start)
        return True

    def send_group(self, indices: list[int], grads: list[torch.Tensor], intos: list[torch.Tensor | None], *,
                   close: bool = True) -> Handle:
        """:meth:`send` of several tensors at once: on the allgather path one group of the step, one batched pass
        and one collective (the DDP hook's chunks of a bucket; every rank must group alike); on the dense path one
        batched pass, the values written into ``intos`` (every one given: the bucket DDP all-reduces); else each in
        turn. On the allgather path the group's collective starts at once, after the step's allocation check (a
        :class:`Grouping` given to :meth:`begin`). ``close=False``: the front end closes the step (:meth:`close`)
        once its own collectives are started."""
        start = time.perf_counter()
        self._begin_for(indices)
        rows, path = np.asarray(indices, dtype=np.int64), self.path
        if not (path.sends_together and len(rows) and len(set(indices)) == len(rows)
                and (path.packed or all(into is not None for into in intos))):
            handles = [self.send(index, grad, into) for index, grad, into in zip(indices, grads, intos, strict=True)]
            return handles[-1] if handles else Handle(None, self.step, self.path.name)
        # The whole group at once, with one clock reading: the Python of one send per member is what this saves.
        flats = [flat_gradient(self.names[i], g, self._numels[i]) for i, g in zip(indices, grads, strict=True)]
        self.noise.local(flats)
        intos = [checked_into(self.names[i], g, into) for i, g, into in zip(indices, flats, intos, strict=True)]
        path.send_together(indices, flats, intos)
        path.launch(rows)
        return self._mark_sent(rows, len(rows), Handle(None, self.step, path.name), start, close)

    def chunks(self, indices: list[int], chunk_bytes: int) -> list[tuple[int, int]]:
        """:meth:`.collectives.CollectivePath.chunks` of the step's path: how to cut a DDP bucket for send_group."""
        return self.path.chunks(indices, chunk_bytes)

    @property
    def ranks(self) -> int | None:
        """How many ranks the payloads travel between (None until the first step makes the transport)."""
        return self.transport.size if self.transport is not None else None

    def payload(self, handle: Handle, index: int) -> torch.Tensor:
        """What this rank sent of tensor ``index``: the values, or its payload(s) once sent (at the latest at close)."""
        return self.paths[handle.collective].payload(index, handle.step) if handle.packed else handle.wire

    def expect_at_close(self, handle: Handle, value: torch.Tensor, bits: int, what: str) -> None:
        """:meth:`.collectives.CollectivePath.expect_at_close` of the handle's step: a front end's check of a value."""
        self.paths[handle.collective].expect_at_close(value, bits, what)

    def _mark_sent(self, rows: int | np.ndarray, count: int, sent: Handle, start: float, close: bool = True) -> Handle:
        """These ``count`` tensors are on their way (handed over at ``start``); the step closes after its last."""
        self.unsent[rows] = False
        self.unsent_count -= count
        self.clock.sent(start, time.perf_counter())
        if close:
            self.close()
        return sent

    def _begin_for(self, indices: int | list[int]) -> None:
        """Begin a step for these tensors; one of them sent already: the last step missed some, it closes first."""
        if self.in_step and not (self.unsent[indices] if isinstance(indices, int) else self.unsent[indices].all()):
            warn_never_sent(self.step, [self.names[i] for i in np.flatnonzero(self.unsent)])
            self._close()
        self.begin()

    def close(self) -> None:
        """4. Close the step if every tensor of it has been sent (else nothing)."""
        if self.in_step and not self.unsent_count:
            self._close()

    def reduced_sums(self, indices: list[int], handle: Handle, outs: list[torch.Tensor | None],
                     divisor: float = 1.0) -> list[torch.Tensor]:
        """The sum over ranks of what every rank sent of each tensor at the ``handle``'s step on a packed path,
        decoded in rank order (bitwise the same on every rank) and divided by ``divisor`` (the rank count, for a
        mean), as flat float32 tensors (``outs[k]`` if given: written over); waits for the collectives. On the
        allgather path each group is decoded once, into the ``into`` tensors its members were sent with."""
        start, waited = time.perf_counter(), waited_seconds()
        totals = self.paths[handle.collective].reduced_sums(indices, handle.step, outs, divisor)
        self.noise.reduced(totals)
        self.clock.received(start, time.perf_counter(), waited_seconds() - waited)
        return totals

    @property
    def exchange(self) -> StatisticsExchange | None:
        """The statistics transport (None until the first step closes, when it is made)."""
        return self.closing.exchange

    @property
    def between_steps(self) -> bool:
        """Whether no step is under way: none begun, or the last one ended (its exchange may still be in flight)."""
        return not self.in_step and (self.closing.pending is None or self.closing.ended)

    def finish(self) -> None:
        """6. Finish the pending exchange, if any (started now if its step has not ended)."""
        if self.closing.pending is not None:
            self.closing.finish()

    def end(self, step: int) -> None:
        """5. The front end has every reduced tensor of ``step``: start its exchange (finished at the next begin)."""
        if self.closing.ending(step):
            self.closing.end()

    def reduced_taken(self, step: int) -> None:
        """The front end has taken one reduced tensor of ``step``; after the step's last one, the step ends (5)."""
        if not self.closing.ending(step):
            return
        now = time.perf_counter()
        self.clock.received(now, now, 0.0)          # on the dense path, the first reduced tensor back
        if self.closing.reduced_taken():
            self.closing.end()

    # ------------------------------------------------------------------ 1. begin
    def begin(self, grouping: Grouping | None = None) -> Handle:
        """Begin a step unless one is in progress (the first :meth:`send` does; the DDP and FSDP front ends, which
        need the step's path first, call it themselves). ``grouping``: how the front end groups its tensors itself;
        on the allgather path every rank's allocation and grouping are then compared before the first payload
        moves. Returns the step's :class:`Handle`."""
        if self.in_step:
            return Handle(None, self.step, self.path.name)
        self.finish()
        bits_per_parameter = budget_at(self.schedule, self.step)
        self._budget_bits_total = self.policy.budget_bits_total(bits_per_parameter, self.total_elements)
        start = time.perf_counter()
        self._allocation = self.policy.allocate(bits_per_parameter, self._budget_bits_total,
                                                self.closing.previous_screened, self.closing.previous_v2)
        if self.transport is None:
            self.transport = call_factory(self.transport_source)
        for path in self.paths.values():
            path.join_world(self.transport, self.memory if self.error_feedback else None)
        self.path = self.paths[collectives.choose(self.collective_setting,
                                                  self._allocation.cost_bits / max(1, self.total_elements),
                                                  self.transport.size)]
        self.pass_through_step = self.policy.fits_pass_through(self._budget_bits_total, self.path.packed)
        if self.pass_through_step:
            self._allocation = self.policy.lossless_allocation(self._budget_bits_total)
        self.allocation_seconds = time.perf_counter() - start
        self.allocation_digest = allocation_digest(self.step, self._budget_bits_total, self._allocation.choice)
        for path in self.paths.values():      # each drops what is left of the last step
            path.begin(self.step, self.transport)
        self.unsent[:] = True
        self.unsent_count = len(self.names)
        self._statistics = self.closing.statistics_of(self.step)
        self.layout.reset(self._statistics, self.policy.lossless, digest_words(self.allocation_digest))
        self.sender.begin(self.step, self.seed, self._allocation, self._statistics, self.path, self.pass_through_step)
        self.noise.begin(self.step)
        self.in_step = True
        self.path.start_check(grouping, self.allocation_digest)
        return Handle(None, self.step, self.path.name)

    # ------------------------------------------------------------------ 4. close
    def _close(self) -> None:
        """4. Every tensor of the step is on its way (one process: the step ends and finishes now)."""
        assert self._allocation is not None
        self.path.finish_check()        # where no payload of the step moved before its close
        if self.path.batched:
            self.path.flush()
        self.path.close(self.step, self._allocation.choice, self.seed)
        self.clock.closed()
        closed = ClosedStep(self.step, self._allocation, self.allocation_digest, self._budget_bits_total,
                            self.path.wire_bytes, self.path.name, self.pass_through_step)
        exchange = self.closing.close(closed, sent=int((~self.unsent).sum()))
        self.in_step = False
        self.step += 1
        if exchange.is_local:
            self.closing.finish()
