"""The step clock: what SafeBits measures of each step on each rank (issue 30; docs/DESIGN.md, "Telemetry").

The core marks the points of a step it sees: each :meth:`~.core.SafeBitsCore.send` (a gradient handed over, and
how long SafeBits took with it), the close (the last gradient of the step sent), each reduced tensor handed back
(how long that took, and how much of it was spent waiting for a collective), and the end (the statistics exchange
finished). Waiting is read from :func:`.exchange.waited_seconds`, which every bounded wait for a SafeBits
collective (payloads, the exchange, DDP's bucket all_reduce) adds to. From those marks, per step:

==================  ==============================================================================================
``backward_s``      first to last gradient handed to SafeBits (the backward span, SafeBits' sends included)
``send_s``          time spent inside SafeBits' send calls (screen, packing, starting collectives)
``receive_s``       time spent inside SafeBits' receive calls, less the waiting in them (decoding, summing)
``exposed_s``       time the step waited for collectives after backward: from the close to the last reduced
                    tensor handed back, less the time spent inside SafeBits' receive calls (what is left is the front
                    end waiting: Horovod's ``synchronize()`` between two ``decompress`` calls, for its own allreduce
                    on the dense path), plus every SafeBits wait after the close (payload collectives, the
                    statistics exchange)
``link_s``          the span the step's collectives were in flight: first gradient to the end of the last wait in
                    a receive call or to the last reduced tensor handed back, whichever is later
``wire_bytes``      bytes this rank handed to the collectives (``StepRecord.wire_bytes``)
``span_s``          first gradient to the end of the step (the part of the step SafeBits' choice can change)
``least_exposed_s`` ``exposed_s`` of the rank that waited least (MIN over ranks, where the others are MAX): the rank
                    that closed last waited for the link alone, where the others also waited for it (the ranks'
                    skew, which on a fast link is most of ``exposed_s``)
==================  ==============================================================================================

A step's figures are complete once its last reduced tensor is taken (the step ends); they travel in that step's
statistics exchange, which starts then (MAX over ranks: the slowest rank's), and appear in its record
(``StepRecord.timing``, ``StepRecord.timing_step``). Unknown figures are -1 in the vector (so that a MAX over ranks
keeps a known one) and NaN in the record; the MIN figure travels negated (MAX(-x) = -MIN(x)), -inf where unknown.
"""

from __future__ import annotations

import math
import time

import numpy as np

from .exchange import waited_seconds

TIMING_FIELDS = ("backward_s", "send_s", "receive_s", "exposed_s", "link_s", "wire_bytes", "span_s", "least_exposed_s")
"""The figures of one step, in the order of the exchanged vector's ``timing`` field."""

NEGATED = TIMING_FIELDS.index("least_exposed_s")
"""The one figure reduced by MIN: it travels negated."""

UNKNOWN = -1.0


def unknown_timing() -> np.ndarray:
    """A timing vector with every figure unknown: -1, and -inf for the negated one (a MAX over ranks keeps any
    known value of either)."""
    values = np.full(len(TIMING_FIELDS), UNKNOWN)
    values[NEGATED] = -np.inf
    return values


class StepClock:
    """One rank's marks of the step in progress, and the figures of the last finished step (:attr:`last`)."""

    def __init__(self) -> None:
        self.last = unknown_timing()                   # the last finished step's figures (none yet)
        self.last_step = -1
        self._reset()

    def _reset(self) -> None:
        self._first_send = self._close = -1.0
        self._last_receive = -1.0                      # the end of the last receive call
        self._send = self._receive = self._in_receive = self._waited_at_close = 0.0
        self._last_wait_end = -1.0

    def sent(self, start: float, end: float) -> None:
        """A gradient handed over at ``start``; SafeBits returned at ``end``."""
        if self._first_send < 0:
            self._first_send = start
        self._send += end - start

    def closed(self) -> None:
        """The step's last gradient was sent."""
        self._close = time.perf_counter()
        self._waited_at_close = waited_seconds()

    def received(self, start: float, end: float, waited: float) -> None:
        """A reduced tensor was asked for at ``start`` and handed back at ``end``, ``waited`` of it waiting."""
        self._last_receive = end
        self._receive += end - start - waited
        self._in_receive += end - start
        if waited > 0:
            self._last_wait_end = end

    def finished(self, step: int, wire_bytes: int) -> None:
        """The step's exchange is done: its figures become :attr:`last`."""
        now = time.perf_counter()
        if self._first_send < 0 or self._close < 0:        # nothing sent on this rank (or a restored state)
            self._reset()
            return
        received = self._last_receive >= 0
        last_receive = self._last_receive if received else now
        waited = waited_seconds() - self._waited_at_close
        # After the close, whatever is not inside a receive call is the front end waiting for communication
        # (Horovod's synchronize() waits for its own allreduces between decompress calls); SafeBits' own waits,
        # inside receive calls or not (the DDP hook's bucket all_reduce on the dense path), are counted by
        # waited_seconds().
        front_end_waiting = max(0.0, last_receive - self._close - self._in_receive) if received else 0.0
        exposed = front_end_waiting + waited
        self.last = np.array([self._close - self._first_send, self._send, max(0.0, self._receive), exposed,
                              max(self._last_wait_end, last_receive) - self._first_send,
                              float(wire_bytes), now - self._first_send, -exposed])
        self.last_step = step
        self._reset()

    def abort(self) -> None:
        """The step in progress was dropped (a failed collective)."""
        self._reset()


def timing_record(values: np.ndarray) -> dict[str, float]:
    """The reduced ``timing`` field as a record's dict (unknown figures NaN)."""
    record = {name: (float(v) if v >= 0 else float("nan")) for name, v in zip(TIMING_FIELDS, values, strict=True)}
    least = float(values[NEGATED])
    record["least_exposed_s"] = -least if math.isfinite(least) else float("nan")
    return record
