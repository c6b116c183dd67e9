"""Steps 4 and 5 of the core's step (docs/DESIGN.md, "The life of one step"): :class:`StepClosing`.

4. **Close**: the closed step's statistics vector is reduced by MAX over ranks, in place (:mod:`.exchange`).
5. **Finish**: its reduced statistics become the step's record (:mod:`.telemetry`), the next allocation's input
   and the check that every rank allocated alike (the digest); for a schedule that reads telemetry
   (``budget_bits="auto"``), the step's own figures start their own small exchange, taken at the next begin, so
   that the budget follows the last step rather than the one before it.

The core (:class:`~.core.SafeBitsCore`) decides when: it closes a step after its last tensor is sent, and finishes
it at the front end's last reduced tensor of that step, or at the next begin.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .allocator import Allocation
from .clock import StepClock, timing_record
from .exchange import StatisticsExchange, check_agreement
from .policy import BudgetPolicy
from .statistics import StatisticsLayout, StepStatistics
from .telemetry import StepLog


class ClosedStep(NamedTuple):
    """What a closed step's record needs once its statistics are reduced (kept while the exchange is in flight)."""

    step: int
    allocation: Allocation
    allocation_digest: str
    budget_bits_total: float
    wire_bytes: int             # this rank's payload bytes on the link (the two-phase second hop's added at 5)
    collective: str
    timing_step: int            # the step whose telemetry the vector carries (the one before)
    pass_through: bool


def factory_made(factory: Any) -> Any:
    """What a factory (a callable with no argument) makes."""
    assert callable(factory)
    return factory()


class StepClosing:
    """Steps 4 and 5 for one core: each closed step's statistics exchange and what its reduced statistics become.

    Two statistics vectors, by step parity: the allocation made at the start of step t reads step t-1's reduced
    vector, which must stay intact while step t's is filled. The transport is made when the first step closes
    (Horovod may be initialized after the front end is built), and again after :meth:`leave_world`."""

    def __init__(self, layout: StatisticsLayout, exchange: StatisticsExchange | Callable[[], StatisticsExchange],
                 *, policy: BudgetPolicy, schedule: Callable[[int], float], log: StepLog, clock: StepClock,
                 consistency_check_every: int, complete_second_hop: Callable[[int], int]) -> None:
        self._exchange_or_factory = exchange
        self.exchange: StatisticsExchange | None = exchange if isinstance(exchange, StatisticsExchange) else None
        self.policy, self.schedule, self.log, self.clock = policy, schedule, log, clock
        self.consistency_check_every = consistency_check_every
        self.complete_second_hop = complete_second_hop     # waits for a step's two-phase second hop: its bytes
        self.observe_timing: Callable[[int, dict[str, float]], None] | None = getattr(schedule, "observe_timing",
                                                                                      None)
        self._vectors = (np.empty(layout.length), np.empty(layout.length))
        self._views = tuple(layout.views(v) for v in self._vectors)
        # The last finished step's reduced statistics: the next allocation's input (None before the first step,
        # and after a pass-through step, which measured nothing). Checkpointed.
        self.previous_screened: np.ndarray | None = None
        self.previous_v2: np.ndarray | None = None
        # In flight: the closed step and its exchange's handle, and how many of the tensors it sent the front end
        # has taken (the exchange is finished after the last one); the telemetry's exchange (step, handle, vector).
        self.pending: ClosedStep | None = None
        self._handle: Any = None
        self._sent = self._taken = 0
        self._telemetry: tuple[int, Any, np.ndarray] | None = None

    def fields(self, step: int) -> StepStatistics:
        """Step ``step``'s statistics vector, as the layout's views."""
        return self._views[step % 2]

    # ------------------------------------------------------------------ 4. close
    def start(self, closed: ClosedStep, sent: int) -> StatisticsExchange:
        """Start reducing step ``closed.step``'s vector; ``sent``: how many tensors the step sent. Returns the
        transport (made now if it was not yet)."""
        if self.exchange is None:
            self.exchange = factory_made(self._exchange_or_factory)
        self._handle = self.exchange.start(self._vectors[closed.step % 2])
        self.pending, self._sent, self._taken = closed, sent, 0
        return self.exchange

    def taken(self) -> bool:
        """The front end took one more reduced tensor of the pending step; whether that was its last."""
        self._taken += 1
        return self._taken >= self._sent

    # ------------------------------------------------------------------ 5. finish
    def finish(self) -> None:
        """Wait for the pending exchange and take in the reduced statistics."""
        closed, exchange = self.pending, self.exchange
        assert closed is not None and exchange is not None
        step = closed.step
        wire_bytes = closed.wire_bytes + self.complete_second_hop(step)     # before the record: it counts them
        self.pending, handle, self._handle = None, self._handle, None
        exchange.wait(handle)                          # the step's own vector now holds the MAX over ranks
        reduced = self._views[step % 2]
        self.clock.finished(step, wire_bytes)
        arrays, self.previous_screened, self.previous_v2 = self.policy.take_reduced(
            reduced, closed.allocation, step=step, budget_bits_total=closed.budget_bits_total,
            allocation_digest=closed.allocation_digest, wire_bytes=wire_bytes, collective=closed.collective,
            timing=reduced.timing.copy(), timing_step=closed.timing_step if reduced.timing.max() >= 0 else -1,
            pass_through=closed.pass_through)
        if closed.pass_through:      # it measured nothing: the next allocation starts afresh (the start policy)
            self.previous_screened = self.previous_v2 = None
        self.log.add(arrays, exchange.rank)
        observe = getattr(self.schedule, "observe", None)
        if observe is not None:
            observe(self.log.last)
        if self.consistency_check_every and step % self.consistency_check_every == 0:
            check_agreement(reduced, step, closed.allocation_digest)
        if self.observe_timing is not None:
            # This step's figures (UNKNOWN where none: the MAX keeps a known one).
            figures = self.clock.last.copy()
            self._telemetry = (step, exchange.start(figures), figures)

    def hand_telemetry(self) -> None:
        """Hand the schedule the telemetry in flight, reduced over ranks (at the next begin)."""
        if self._telemetry is None:
            return
        assert self.exchange is not None and self.observe_timing is not None
        (step, handle, figures), self._telemetry = self._telemetry, None
        self.exchange.wait(handle)
        self.observe_timing(step, timing_record(figures))

    # ------------------------------------------------------------------ elastic training
    def drop(self) -> None:
        """Forget what is in flight (a collective failed)."""
        self.pending = self._handle = self._telemetry = None

    @property
    def follows_worlds(self) -> bool:
        """Whether the transport can be made again for a new world (it was given as a factory)."""
        return callable(self._exchange_or_factory)

    def leave_world(self) -> None:
        """Make the transport again at the next close; the telemetry in flight is the old world's: dropped."""
        self.exchange, self._telemetry = None, None
