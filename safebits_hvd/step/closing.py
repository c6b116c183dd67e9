"""Steps 4 to 6 of the core's step (docs/DESIGN.md, "The life of one step"): :class:`StepClosing`.

4. **Close** (the step's last gradient sent): its statistics are complete; the step waits for its end.
5. **End** (the front end has taken the step's last reduced tensor): the step's own telemetry is complete too
   (:mod:`.clock`); it joins the statistics in one vector, and the vector's MAX over ranks starts, in place
   (:mod:`.exchange`). The reduction runs while the optimizer steps and the next forward pass runs.
6. **Finish** (at the next begin, or when a checkpoint or the front end asks): wait for it; the reduced statistics
   become the step's record (:mod:`.telemetry`), the next allocation's input and the check that every rank
   allocated alike (the digest); a schedule that reads telemetry (``budget_bits="auto"``) gets the step's figures,
   reduced, before it chooses the next step's budget.

One collective a step carries both, so that the telemetry costs no exchange of its own (docs/RESULTS.md, section
4.3). The core (:class:`~.core.SafeBitsCore`) decides when: it closes a step after its last tensor is sent, ends it
at the front end's last reduced tensor of that step, and finishes it at the next begin.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ..comm.clock import StepClock, timing_record
from ..comm.exchange import StatisticsExchange, check_agreement
from ..comm.statistics import StatisticsLayout, StepStatistics
from ..policy.allocator import Allocation
from ..policy.budget import BudgetPolicy
from ..policy.quality import Noise, NoiseMeter, budget_errors, noise_values, sampling_noise, sent_error
from ..policy.telemetry import StepLog


class ClosedStep(NamedTuple):
    """What a closed step's record needs once its statistics are reduced (kept while the exchange is in flight)."""

    step: int
    allocation: Allocation
    allocation_digest: str
    budget_bits_total: float
    wire_bytes: int             # this rank's payload bytes on the link (the two-phase second hop's added at 5)
    collective: str
    pass_through: bool


def call_factory(factory: Any) -> Any:
    """What a factory (a callable with no argument) makes."""
    assert callable(factory)
    return factory()


class StepClosing:
    """Steps 4 to 6 for one core: each closed step's statistics exchange and what its reduced statistics become.

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
        # A schedule that weighs quality (budget_bits="auto") reads the gradient's sampling noise, from the norms
        # of each rank's gradients and of the reduced ones (``noise``, which the core feeds), and the error each of
        # its candidate budgets would add (quality.py).
        self.observe_quality: Callable[[int, Noise, dict[float, float]], None] | None = getattr(
            schedule, "observe_quality", None)
        self.noise = NoiseMeter(active=self.observe_quality is not None)
        self.total_elements = int(policy.numels.sum())
        self._sent_errors: dict[int, float] = {}        # ε² of the last steps sent (the noise arrives a step late)
        self._noise_step = -1                           # the step whose norms the pending step carries (-1: none)
        self._vectors = (np.empty(layout.length), np.empty(layout.length))
        self._views = tuple(layout.views(v) for v in self._vectors)
        # The last finished step's reduced statistics: the next allocation's input (None before the first step,
        # and after a pass-through step, which measured nothing). Checkpointed.
        self.previous_screened: np.ndarray | None = None
        self.previous_v2: np.ndarray | None = None
        # The closed step not finished yet; how many tensors it sent and how many of them the front end has taken
        # (it ends after the last one); once it has ended, its exchange's handle and its link bytes (None before).
        self.pending: ClosedStep | None = None
        self._to_take = self._taken = 0
        self._handle: Any = None
        self._wire_bytes: int | None = None

    def statistics_of(self, step: int) -> StepStatistics:
        """Step ``step``'s statistics vector, as the layout's views."""
        return self._views[step % 2]

    # ------------------------------------------------------------------ 4. close
    def close(self, closed: ClosedStep, sent: int) -> StatisticsExchange:
        """Step ``closed.step`` sent its last gradient (``sent`` tensors in all). Returns the transport (made now
        if it was not yet)."""
        if self.exchange is None:
            self.exchange = call_factory(self._exchange_or_factory)
        check_length = getattr(self.exchange, "check_length", None)
        if check_length is not None:   # ranks built differently fail here, clearly, before a payload is decoded
            check_length(len(self._vectors[0]))
        self.pending, self._to_take, self._taken, self._wire_bytes = closed, sent, 0, None
        return self.exchange

    def reduced_taken(self) -> bool:
        """The front end took one more reduced tensor of the pending step; whether that was its last."""
        self._taken += 1
        return self._taken >= self._to_take

    # ------------------------------------------------------------------ 5. end
    @property
    def ended(self) -> bool:
        """Whether a pending step has ended: its exchange has started."""
        return self.pending is not None and self._wire_bytes is not None

    def ending(self, step: int) -> bool:
        """Whether ``step`` is the pending step and has not ended yet."""
        return self.pending is not None and self.pending.step == step and self._wire_bytes is None

    def end(self) -> None:
        """The pending step's receive side is done: its figures join its statistics, whose reduction starts."""
        closed, exchange = self.pending, self.exchange
        assert closed is not None and exchange is not None and self._wire_bytes is None
        wire_bytes = closed.wire_bytes + self.complete_second_hop(closed.step)
        self.clock.finished(closed.step, wire_bytes)
        self.statistics_of(closed.step).timing[:] = self.clock.last      # UNKNOWN where none: the MAX keeps a known one
        if self.noise.active:                                     # an earlier step's: they have reached the host
            published = self.noise.publish()
            self._noise_step = published[0] if published is not None else -1
            self.statistics_of(closed.step).noise[:] = noise_values(published[1] if published is not None else None)
        self._handle, self._wire_bytes = exchange.start(self._vectors[closed.step % 2]), wire_bytes

    # ------------------------------------------------------------------ 6. finish
    def finish(self) -> None:
        """Wait for the pending step's exchange (started now if the step has not ended) and take in the reduced
        statistics and telemetry."""
        if self._wire_bytes is None:
            self.end()
        closed, exchange, wire_bytes = self.pending, self.exchange, self._wire_bytes
        assert closed is not None and exchange is not None and wire_bytes is not None
        step = closed.step
        self.pending, handle, self._handle, self._wire_bytes = None, self._handle, None, None
        exchange.wait(handle)                          # the step's own vector now holds the MAX over ranks
        reduced = self._views[step % 2]
        timing = reduced.timing.copy()
        known = bool(timing.max() >= 0)
        ranks = exchange.size
        error = 0.0 if closed.pass_through else sent_error(reduced.sent_distortion, reduced.v2, ranks)
        self._sent_errors = {s: e for s, e in self._sent_errors.items() if s > step - 2 * self.noise.every}
        self._sent_errors[step] = error
        noise = sampling_noise(reduced.noise, ranks, self._sent_errors.get(self._noise_step, math.nan))
        noise_step = self._noise_step if math.isfinite(noise.sampling) else -1
        arrays, self.previous_screened, self.previous_v2 = self.policy.take_reduced(
            reduced, closed.allocation, step=step, budget_bits_total=closed.budget_bits_total,
            allocation_digest=closed.allocation_digest, wire_bytes=wire_bytes, collective=closed.collective,
            timing=timing, timing_step=step if known else -1, pass_through=closed.pass_through,
            compression_error=error, gradient_noise=noise.sampling, noise_step=noise_step, budget_errors={})
        if closed.pass_through:      # it measured nothing: the next allocation starts afresh (the start policy)
            self.previous_screened = self.previous_v2 = None
        if self.observe_quality is not None:
            arrays = arrays._replace(budget_errors=self._budget_errors(ranks))
        self.log.add(arrays, exchange.rank)
        observe = getattr(self.schedule, "observe", None)
        if observe is not None:
            observe(self.log.last)
        if self.consistency_check_every and step % self.consistency_check_every == 0:
            check_agreement(reduced, step, closed.allocation_digest)
        if self.observe_timing is not None:
            self.observe_timing(step, timing_record(timing))
        if self.observe_quality is not None:
            self.observe_quality(step, noise, arrays.budget_errors)

    def _budget_errors(self, ranks: int) -> dict[float, float]:
        """``ε²`` per candidate budget of a schedule that weighs quality, from a compressed step's screen (the
        reduced statistics just taken in as the next allocation's input); empty after a pass-through."""
        if self.previous_screened is None or self.previous_v2 is None:
            return {}
        budgets = [b for b in getattr(self.schedule, "candidates", ()) if b * self.total_elements
                   < self.policy.lossless_bits]
        return budget_errors(self.policy, budgets, self.previous_screened, self.previous_v2, self.total_elements,
                             ranks)

    # ------------------------------------------------------------------ elastic training
    def drop(self) -> None:
        """Forget what is in flight (a collective failed)."""
        self.pending = self._handle = self._wire_bytes = None
        self.noise.reset()

    @property
    def follows_worlds(self) -> bool:
        """Whether the transport can be made again for a new world (it was given as a factory)."""
        return callable(self._exchange_or_factory)

    def leave_world(self) -> None:
        """Make the transport again at the next close; a step's exchange still in flight is the old world's:
        dropped, with its record (the next allocation reads the step before's statistics, alike on every rank)."""
        self.drop()
        self.exchange = None
