"""``budget_bits="auto"``: :class:`Auto` chooses each step's bits per parameter, no compression included, from the
telemetry SafeBits measures itself (docs/DESIGN.md, "budget_bits='auto'").

Three parts, in the order of the class docstring's steps: :class:`~.quality.QualityGate` (step 0, in
:mod:`.quality`) keeps the budgets whose compression error stays within a fraction of the gradient's sampling noise;
:class:`SpanModel` holds what was measured of each candidate budget and predicts the others (steps 1, 2 and 5:
measure, predict, follow the link); :class:`Auto` is the schedule, which probes and chooses among the budgets allowed
(steps 3 and 4).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from .quality import ERROR_TO_NOISE, Noise, QualityGate
from .schedules import positive_bits

PASS_THROUGH_BITS = 32.0
"""Bits per parameter at which a step needs no compression: every tensor fits uncompressed, and on the dense path
the core passes the gradients through (no screen, no packing: ``StepRecord.pass_through``)."""

AUTO_CANDIDATES = (2.0, 3.0, 4.4, 6.0, 8.0, 16.0, PASS_THROUGH_BITS)
"""The budgets :class:`Auto` chooses among (those within its bounds), bits per parameter; 32 is no compression."""

# The figures behind these constants (the step-to-step noise, hiccups, cold and warming steps of the machines
# measured) are in docs/DESIGN.md, "budget_bits='auto'", and docs/RESULTS.md 4.

AUTO_JUMP = 2.0
"""A span this many times smaller than its candidate's estimate, two in a row this many times larger, or one this
squared times larger, mean the link changed (5): beyond the step-to-step noise of shared machines, where a single
step may run several times slower (a hiccup), never two in a row."""

AUTO_HICCUP_S = 0.25
"""How long a hiccup of the machine may hold one step: a single span longer by less waits for the next to confirm a
change (5); confirming costs one step, short when the steps are (on short steps a hiccup is a time, not a ratio)."""

AUTO_WINDOW = 7
"""Spans :class:`Auto` keeps per candidate (their median is its estimate): enough to see through the step-to-step
noise of shared machines."""

AUTO_MEDIAN_OF = 3
"""Spans a compressed choice is measured over before :class:`Auto` probes another compressed budget from it: with
noise wider than the differences, one span often made the second-best look better, and it was kept for much of the
run (``tests/test_auto.py``, ``tight_timing`` at 1 Gbit/s)."""

AUTO_WARMUP = 2
"""The first steps of a run, whose spans :class:`Auto` does not keep (allocation, connection set-up)."""

AUTO_COLD = 2
"""The first steps a run compresses, whose spans :class:`Auto` does not keep either: the compressed path starts cold.
They touch memory the process has not used before (residuals, payload and decoding buffers), and a first touch costs
the kernel a page fault (``bench.experiments.cold_compressed_steps``); measured, a cold span made passing through look
faster than compressing. So a run's first compressed probe holds one step longer."""

AUTO_WARM_AFTER = 6
"""Steps after which a run is warm: the spans of the steps before, kept, still run slow, so a candidate measured
only before this step is measured again once the run is warm (:class:`Auto`, 3)."""

AUTO_WARM_SLOWDOWN = 2.0
"""How much slower than warm steps a run's first steps may be: a candidate measured only then and estimated slower
than the choice by more (and by :data:`AUTO_HICCUP_S` at least) is not measured again (3 (a) and (b)): on a slow link
an uncompressed step costs the time of several compressed ones."""

AUTO_WARM_COMPUTE = 1.0
"""A step whose own compute (its backward span less SafeBits' sends) took at most this times the choice's was warm
already, and its span is not measured again (3): a run's first steps are slow in their compute (the warm-up
multiplies it with the rest), while a warm pass-through computes faster than a compressed step."""

AUTO_FIRST_PROBE_BITS = 8.0
"""The fewest bits :class:`Auto` allows before its first compressed step has told the quality gate what each budget
would add (0), where its figures are fed, and the budget a run starts at: a run's first steps decide much of its
quality (docs/RESULTS.md 2.1b), 8 bits add next to nothing, and that one step predicts the error of every budget and
measures the link. Where no error is measured (one rank), the bound lifts once the first probe is measured."""

AUTO_WARM_START = 0
AUTO_WARM_START_S = 0.25
"""The warm start, off by default: for its first ``warm_start`` steps :class:`Auto` passes through while that costs
less than :data:`AUTO_WARM_START_S` a step, as PyTorch's PowerSGD hook starts uncompressed. The first probe's bound
(:data:`AUTO_FIRST_PROBE_BITS`) and the quality gate guard the first steps without it."""

AUTO_NOISE_BAND = 3.0
"""A span must be off its estimate by this many times the spans' relative spread (:meth:`SpanModel.spread`, a median
absolute deviation), and by ``change`` at least, to say the link changed (5): noise as wide as a fifth of a step
(most of it the wait for the other rank) otherwise reads as changes."""

AUTO_RATE_EXPOSED = 0.1
"""The share of a step its wait for the link (:func:`link_wait`) must reach for its bytes and link time to measure the
link's rate (1); a wait hidden under backward only says the link is at least that fast."""

AUTO_EXPOSED_SHARE = 0.25
"""The share of a step its wait for the link (:func:`link_wait`) must reach (now or before) for a single span to say
the link changed (5)."""

AUTO_MAD_TO_SE = 1.4826 * 1.2533
"""A window's relative median absolute deviation, times this over the square root of its length, is the relative
standard error of its median (normal noise: MAD = 0.674 sigma; a median's error is 1.2533 times a mean's)."""


def far_slower(early: float, now: float) -> bool:
    """:class:`Auto` 3: whether a span measured while the run warmed up is too much slower than the choice's for the
    warm-up to explain it (:data:`AUTO_WARM_SLOWDOWN` times, and :data:`AUTO_HICCUP_S` at least)."""
    return early >= AUTO_WARM_SLOWDOWN * now and early - now >= AUTO_HICCUP_S


def pass_through_to_confirm(model: SpanModel, known: dict[float, tuple[float, float]], choice: float,
                            prune: float) -> int:
    """:class:`Auto` 3 (c): the further steps to pass through for before a compressed ``choice`` replaces a
    pass-through measured over fewer than :data:`AUTO_MEDIAN_OF` spans, one of which was within ``prune`` of the
    choice's estimate (0: none): its estimate is then a median that a hiccup of the machine cannot carry. Two spans,
    one of them a hiccup, kept a fast link's pass-through out for a hundred steps ((b) probes only a candidate
    predicted near the fastest); one measured slower throughout is not measured again."""
    spans = model.spans.get(PASS_THROUGH_BITS, [])
    if choice >= PASS_THROUGH_BITS or not spans or len(spans) >= AUTO_MEDIAN_OF:
        return 0
    return AUTO_MEDIAN_OF - len(spans) if min(spans) <= (1 + prune) * known[choice][0] else 0


def pick(tolerance: float, values: dict[float, tuple[float, float]]) -> float:
    """:class:`Auto` 4 on ``{bits: (span, relative standard error)}``: the most bits among those tied with the
    fastest."""
    best_bits = min(values, key=lambda b: (values[b][0], -b))
    best, best_error = values[best_bits]
    # Compressing must show it is faster: the pass-through is tied unless the noise cannot explain the difference;
    # between compressed budgets, unless the noise can.
    tied = [b for b, (span, error) in values.items()
            if span <= best * (1 + tolerance + (1 if b == PASS_THROUGH_BITS else -1) * math.hypot(error, best_error))]
    return max([best_bits, *tied])


def first_budget(unmeasured: list[float], pending: set[float], warm_start: bool) -> float:
    """:class:`Auto` 3: the budget while nothing predicts the others: one whose telemetry is on its way (the most
    bits); in the warm start, the pass-through; else the fewest bits from :data:`AUTO_FIRST_PROBE_BITS` up (8:
    next to nothing added, and its step predicts every budget's error and measures the link), else the most."""
    waiting = [b for b in unmeasured if b in pending]
    if waiting:
        return max(waiting)
    if warm_start and PASS_THROUGH_BITS in unmeasured:
        return PASS_THROUGH_BITS
    return min((b for b in unmeasured if b >= AUTO_FIRST_PROBE_BITS), default=max(unmeasured))


def link_wait(figures: dict[str, float]) -> float:
    """A step's wait for the link alone: the exposed wait of the rank that waited least (``least_exposed_s``); the
    others' also holds their wait for it (on a fast link, most of theirs). ``exposed_s`` where figures predate it."""
    least = figures.get("least_exposed_s", math.nan)
    return least if math.isfinite(least) else figures["exposed_s"]


def own_compute(figures: dict[str, float]) -> float:
    """A step's backward less SafeBits' sends in it: the compute SafeBits' choice does not change."""
    return figures["backward_s"] - figures["send_s"]


class SpanModel:
    """What :class:`Auto` has measured of each candidate budget, and the span it predicts for the others: steps 1,
    2 and 5 of :class:`Auto`'s docstring (measure, predict, follow the link). Decided from reduced telemetry only,
    so every rank's model is the same."""

    def __init__(self, candidates: list[float], change: float) -> None:
        self.candidates, self.change = candidates, change
        # Learned (checkpointed): per candidate, its last spans (oldest first) and their waits for the link
        # (link_wait), the step of the last, its last telemetry and the link rate then; the link rate now, and the
        # budget of the step it was measured on.
        self.spans: dict[float, list[float]] = {b: [] for b in candidates}
        self.waits: dict[float, list[float]] = {b: [] for b in candidates}
        self.measured_at: dict[float, int] = {}
        self.figures: dict[float, dict[str, float]] = {}
        self.rate_at: dict[float, float] = {}
        self.rate = 0.0
        self.rate_bits = PASS_THROUGH_BITS

    # ------------------------------------------------------------------ 1 and 5: measure, follow the link
    def observe(self, step: int, bits: float, previous: float, timing: dict[str, float]) -> None:
        """Step ``step``'s telemetry, a step at ``bits`` after one at ``previous`` (:data:`.clock.TIMING_FIELDS`,
        reduced over ranks; NaN where unknown)."""
        span = timing.get("span_s", math.nan)
        if not math.isfinite(span) or step < AUTO_WARMUP:
            return
        switched = previous != bits and PASS_THROUGH_BITS in (bits, previous)
        if switched and not self._fell_during_switch(bits, span):
            return                                               # it paid for the switch (1)
        if timing["link_s"] > 0 and timing["wire_bytes"] > 0:
            measured = timing["wire_bytes"] / timing["link_s"]
            # Exposed communication measures the link; hidden, it only says the link is at least this fast.
            if link_wait(timing) > AUTO_RATE_EXPOSED * span or measured > self.rate:
                self.rate, self.rate_bits = measured, bits
        estimate = self.estimate(bits)
        if (len(self.spans[bits]) >= 3 and estimate is not None and span > AUTO_JUMP ** 2 * estimate
                and span - estimate < AUTO_HICCUP_S):
            return                                               # a hiccup of the machine: not the link (5)
        history = self.spans[bits] = (self.spans[bits] + [span])[-AUTO_WINDOW:]
        waits = self.waits[bits] = (self.waits[bits] + [link_wait(timing)])[-AUTO_WINDOW:]
        kept = [span] if switched else self._changed(bits, history, timing)
        if kept is not None:
            # The link (or the load) changed: what was measured before no longer holds. Slower: the figures go too,
            # else an uncompressed step measured on the faster link would invite a costly probe.
            slower = statistics.median(kept) > statistics.median(history[:-len(kept)])
            for b in self.candidates:
                self.drop(b, forget=slower)
            self.spans[bits], self.waits[bits] = kept, waits[-len(kept):]
        self.measured_at[bits] = step
        self.figures[bits] = dict(timing)
        self.rate_at[bits] = self.rate

    def _fell_during_switch(self, bits: float, span: float) -> bool:
        """Whether a step that switched into pass-through took as long as a link that fell (5: its estimate's
        :data:`AUTO_JUMP` squared, and :data:`AUTO_HICCUP_S` more), far beyond what the switch costs (a residual
        added once): then it is measured, else the next step would pass through on the slow link too."""
        estimate = self.estimate(bits) if bits == PASS_THROUGH_BITS else None
        return estimate is not None and span > AUTO_JUMP ** 2 * estimate and span - estimate > AUTO_HICCUP_S

    def drop(self, bits: float, forget: bool = False) -> None:
        """Forget a candidate's spans; its last figures, scaled to its estimate, still predict it (2), unless
        ``forget``."""
        if forget:
            self.figures.pop(bits, None)
        elif bits in self.figures:
            self.figures[bits] = self.scaled(bits)
        self.spans[bits], self.waits[bits] = [], []

    def _changed(self, bits: float, history: list[float], timing: dict[str, float]) -> list[float] | None:
        """The spans to keep when the last span(s) say the link changed (5), else None."""
        if len(history) < 3:                                     # two before it at least: one may be noise
            return None
        span = history[-1]
        estimate = statistics.median(history[:-1])
        if span < estimate / AUTO_JUMP or (span > estimate * AUTO_JUMP ** 2 and span - estimate > AUTO_HICCUP_S):
            return [span]
        earlier = statistics.median(history[:-2])
        if min(history[-2:]) > max(AUTO_JUMP * earlier, earlier + AUTO_HICCUP_S):
            return history[-2:]                                  # two in a row: a single one may be a hiccup
        waited, waited_before = link_wait(timing), link_wait(self.figures[bits]) if bits in self.figures else math.nan
        moved = span - estimate
        band = max(self.change, AUTO_NOISE_BAND * self.spread())     # beyond the step-to-step noise too
        # The wait for the link shortened the span (off a median of three at least; a longer one may be a hiccup),
        # and the link was a real part of the step.
        if (len(history) > 3 and -moved > band * estimate and (waited - waited_before) * moved > 0.5 * moved ** 2
                and max(waited, waited_before) > AUTO_EXPOSED_SHARE * span):
            return [span]                                        # the wait for the link moved the span
        before = history[:-3]
        if len(before) >= 2:
            estimate = statistics.median(before)
            if ((all(x > (1 + band) * estimate for x in history[-3:])
                    or all(x < (1 - band) * estimate for x in history[-3:])) and self._link_moved(bits)):
                return history[-3:]
        return None

    def _link_moved(self, bits: float) -> bool:
        """Whether the last three spans moved from those before because the link did: their waits for it
        (:func:`link_wait`) moved the same way, by half as much at least. A machine that computes slower or faster
        for a while (shared machines do) moves the spans alone, and its compute's drift read as the link's made a
        fast link's pass-through give way to compressed probes."""
        spans, waits = self.spans[bits], self.waits[bits]
        moved = statistics.median(spans[-3:]) - statistics.median(spans[:-3])
        waited = statistics.median(waits[-3:]) - statistics.median(waits[:-3])
        return waited * moved >= 0.5 * moved ** 2

    def estimate(self, bits: float) -> float | None:
        """The candidate's measured span (the median of its last spans), None if it has none."""
        history = self.spans[bits]
        return statistics.median(history) if history else None

    def spread(self) -> float:
        """The relative step-to-step spread of the spans: the median over candidates with three spans or more of
        their median absolute deviation over their median (0 while none has three)."""
        deviations = []
        for history in self.spans.values():
            if len(history) >= 3:
                middle = statistics.median(history)
                deviations.append(statistics.median(abs(x - middle) for x in history) / middle)
        return statistics.median(deviations) if deviations else 0.0

    # ------------------------------------------------------------------ 2. predict
    def predict(self, bits: float, rate: float | None = None, allowance: float = 0.0) -> float | None:
        """The span predicted for ``bits`` (see :class:`Auto`'s docstring, 2); None when nothing fits: nothing measured
        or no link rate measured yet. ``rate``: the link's bytes per second (default: the current estimate).
        ``allowance``: the model's relative error on what it did not measure at ``bits`` (the transfer, and
        SafeBits' own time unless bracketed), taken off them: a lower bound."""
        rate = self.rate if rate is None else rate
        compressed = bits < PASS_THROUGH_BITS
        measured = [b for b in self.candidates if b in self.figures and (b < PASS_THROUGH_BITS) == compressed]
        if not measured:
            measured = [b for b in self.candidates if b in self.figures]
        if not measured or rate <= 0:
            return None

        def nearest(options: list[float]) -> float:
            return min(options, key=lambda b: (abs(math.log(b / bits)), -b))

        near = nearest(measured)
        f = self.scaled(near)
        send, receive = self.own_time(bits, allowance) if compressed else (0.0, 0.0)
        backward = own_compute(f)
        current = [b for b in measured if self.spans[b] and (b < PASS_THROUGH_BITS) == compressed]
        below = max((b for b in current if b < bits), default=None) if compressed else None
        above = min((b for b in current if b > bits), default=None) if compressed else None
        if below is not None and above is not None:
            # Bracketed by two compressed budgets measured on this link: their collectives' ends, interpolated in
            # the bytes (proportional to the bits), carry the link's rate without the start latency that a rate
            # read from one step's bytes and time includes.
            low, high = self.scaled(below), self.scaled(above)
            link = low["link_s"] + (high["link_s"] - low["link_s"]) * (bits - below) / (above - below)
        elif current:
            # One of the same kind measured on this link: the collectives start as its did (compressed ones late,
            # once their group is packed) and end later (sooner) by the bytes added (taken away) at the link rate.
            same = nearest(current)
            g = self.scaled(same)
            moved = g["wire_bytes"] * (bits / same - 1) / rate
            link = g["link_s"] + (moved / (1 + allowance) if moved > 0 else moved * (1 + allowance))
        elif near == bits and not compressed and self.rate_bits < PASS_THROUGH_BITS:
            # A rate read through compressed payloads (their start latency, the ranks' skew) does not say how fast
            # a pass-through's allreduce is (see _choose): it keeps its own last link time.
            link = f["link_s"] / (1 + allowance)
        else:
            link = f["wire_bytes"] * bits / near / rate / (1 + allowance)    # from the first gradient on
        return max(backward + send, link) + receive

    def scaled(self, bits: float) -> dict[str, float]:
        """A measured candidate's last step's figures, scaled to its estimate: one step's noise would otherwise move
        every prediction made from it."""
        f, estimate = self.figures[bits], self.estimate(bits)
        if estimate is None or f["span_s"] <= 0:
            return f
        return {k: v if k == "wire_bytes" else v * estimate / f["span_s"] for k, v in f.items()}

    def own_time(self, bits: float, allowance: float) -> tuple[float, float]:
        """SafeBits' own (send, receive) seconds at a compressed ``bits``: interpolated in log bits between the
        nearest measured budgets on either side; else the nearest one's, less ``allowance`` (it grows with the bits,
        but not strictly); none while no compressed step is measured (a lower bound)."""
        measured = [b for b in self.candidates if b in self.figures and b < PASS_THROUGH_BITS]
        below = max((b for b in measured if b <= bits), default=None)
        above = min((b for b in measured if b >= bits), default=None)
        if below is not None and above is not None:
            low, high = self.scaled(below), self.scaled(above)
            weight = math.log(bits / below) / math.log(above / below) if above > below else 0.0
            send, receive = (low[k] + weight * (high[k] - low[k]) for k in ("send_s", "receive_s"))
            return send, receive
        near = below if below is not None else above
        if near is None:
            return 0.0, 0.0
        f = self.scaled(near)
        return f["send_s"] / (1 + allowance), f["receive_s"] / (1 + allowance)


    def rules_out_pass_through(self, fastest: float, guess: float | None) -> bool:
        """:class:`Auto` 3: whether the compressed steps measured put the pass-through far slower than ``fastest``
        (:func:`far_slower`). Only if one of them, measured at a link rate not :data:`AUTO_JUMP` times slower than
        now, waited for its collectives after backward (:data:`AUTO_RATE_EXPOSED`; else they only say the link is at
        least that fast, and the rate rises to the highest of those bounds: on noisy steps 15-20% above what an
        exposed step measured, which within ``change`` let the pass-through be probed at 100 Mbit/s), and if
        ``guess``, its prediction at the link rate, says so. A rate read from one step's bytes and time includes the
        collectives' start latency, so where two budgets measured on this link (their spans kept) end their
        collectives later with more bytes, those ends extrapolated in the bytes to 32 bits must say so too: they
        carry the rate without it (they can clear the pass-through, never condemn it: a slope between budgets a few
        bits apart, extrapolated, carries their noise many times over)."""
        compressed = [b for b in self.figures if b < PASS_THROUGH_BITS]
        if not any(self.wait_share(b) > AUTO_RATE_EXPOSED and self.rate_at.get(b, 0.0) * AUTO_JUMP >= self.rate
                   for b in compressed):
            return False
        if guess is None or not far_slower(guess, fastest):
            return False
        current = sorted(b for b in compressed if self.spans[b])
        if len(current) >= 2:
            low, high = self.scaled(current[0]), self.scaled(current[-1])
            per_bit = (high["link_s"] - low["link_s"]) / (current[-1] - current[0])
            if per_bit > 0:
                link = high["link_s"] + per_bit * (PASS_THROUGH_BITS - current[-1])
                return far_slower(max(own_compute(high), link), fastest)
        return True

    def wait_share(self, bits: float) -> float:
        """The share of its step a measured candidate waited for the link (:func:`link_wait`): the median of its
        waits over its estimate, as its estimate is a median (one step's wait may be noise, and the pass-through
        costs a slow link's costliest steps); its last step's where it has no spans."""
        waits, estimate = [w for w in self.waits[bits] if math.isfinite(w)], self.estimate(bits)
        if not waits or not estimate:
            f = self.figures[bits]
            return link_wait(f) / f["span_s"] if f["span_s"] > 0 else 0.0
        return statistics.median(waits) / estimate

    def state_dict(self) -> dict[str, Any]:
        return {"spans": {str(b): list(v) for b, v in self.spans.items()},
                "waits": {str(b): list(v) for b, v in self.waits.items()},
                "measured_at": {str(b): s for b, s in self.measured_at.items()},
                "figures": {str(b): dict(f) for b, f in self.figures.items()},
                "rate_at": {str(b): r for b, r in self.rate_at.items()}, "rate": self.rate,
                "rate_bits": self.rate_bits}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.spans = {b: [float(x) for x in state["spans"].get(str(b), [])] for b in self.candidates}
        waits = state.get("waits", {})              # absent from checkpoints before them: unknown (NaN)
        self.waits = {b: [float(x) for x in waits.get(str(b), [math.nan] * len(self.spans[b]))]
                      for b in self.candidates}
        self.measured_at = {float(b): int(s) for b, s in state["measured_at"].items()}
        self.figures = {float(b): {k: float(v) for k, v in f.items()} for b, f in state["figures"].items()}
        self.rate_at = {float(b): float(r) for b, r in state["rate_at"].items()}
        self.rate = float(state["rate"])
        self.rate_bits = float(state.get("rate_bits", PASS_THROUGH_BITS))


class Auto:
    """``budget_bits="auto"``: each step's bits per parameter, no compression included, chosen from the telemetry
    SafeBits measures itself (:mod:`.clock`, docs/DESIGN.md, "budget_bits='auto'").

    Reads, through :meth:`observe_timing`, each step's telemetry, reduced over ranks, before the next step's budget
    is chosen (the core exchanges it as the step finishes): the span from its first gradient
    to its end (``span_s``, the part of a step the choice can change), its backward span, SafeBits' own send and
    receive time, the bytes it moved, how long its collectives were in flight and how long the step waited for
    them. And, through :meth:`observe_quality`, each step's gradient noise and the compression error its screen
    predicts per budget (:mod:`.quality`). Then, per candidate budget (:data:`AUTO_CANDIDATES` within
    ``[min_bits, max_bits]``):

    0. **Allow** only the candidates whose compression error stays within ``error_to_noise`` of the gradient's
       sampling noise (:class:`~.quality.QualityGate`; default :data:`~.quality.ERROR_TO_NOISE`), the pass-through
       always, the most bits where none does; the steps below choose among those. Before the first compressed step
       has predicted every budget's error, only :data:`AUTO_FIRST_PROBE_BITS` or more: that step measures them.
    1. **Measure**: a candidate's estimate is the median of its last :data:`AUTO_WINDOW` spans, none from the first
       :data:`AUTO_WARMUP` steps of a run, nor from its first :data:`AUTO_COLD` compressed steps (the compressed
       path starts cold), nor from a step that switched into or out of pass-through (it pays for the
       switch: the start policy, the residual flush), unless a switch into pass-through took as long as a link that
       fell (5): the link may fall on any step; a switch between two compressed budgets is measured, so a
       compressed probe costs one step.
    2. **Predict** one never measured (or measured at another link rate) from the nearest measured one of the same kind,
       compressed or not (its last step's figures scaled to its estimate): ``max(backward + send, link) + receive``.
       SafeBits' own time (send, receive) is none without compression, interpolated in log bits between the nearest
       compressed budgets measured on either side, else the nearest one's, and none while no compressed step is measured
       (a lower bound). ``link``, when the collectives end: between two compressed budgets measured on this link on
       either side, their ends interpolated in the bytes; else from one of the same kind measured on this link, its end
       moved by the bytes added (or taken away) at the link rate (compressed collectives start late, once their group is
       packed, so only the same kind tells when); else the bytes at the link rate from the first gradient on. The link
       rate comes from the steps that waited for the link (:func:`link_wait`). A rate read through compressed
       payloads (small, so mostly their start latency) does not say how fast an allreduce of every gradient is: a
       pass-through measured before keeps its own link time.
    3. **Probe** the candidate the rule of 4 would choose if every unmeasured candidate took a lower bound, when that is
       an unmeasured one: so only candidates that could win are probed, the predicted fastest first, and a link seen
       slower jumps straight to it. The lower bound takes the model's error allowance ``prune`` off what was not
       measured at that budget (the transfer; SafeBits' own time unless bracketed); below the fewest compressed bits
       measured on this link, where nothing bounds a budget from below, off its whole span, and there only the fewest
       bits allowed are probed (they bound the rest: the least to send, the least own work) and nothing else until their
       telemetry is in. One whose telemetry is still on its way (a step not observed yet) is held, not probed again.
       From a compressed choice, no other compressed budget is probed before the choice has :data:`AUTO_MEDIAN_OF`
       spans. Before the first measurement the first probe's budget is held (:func:`first_budget`), and through the warm
       start, if asked for (the first ``warm_start`` steps, :data:`AUTO_WARM_START_S`), the pass-through while its step
       is short. The pass-through, never measured, is probed next unless :meth:`SpanModel.rules_out_pass_through`.

       Measured again: (a) **after the warm-up**: a run's first steps run slow. Once a compressed budget is the choice
       with three spans, a candidate measured only before step :data:`AUTO_WARM_AFTER` is measured again for three steps
       after the switch (its early spans dropped; one span cannot tell a warm run's 15% from its noise), unless its step
       computed no slower than the choice's do (:data:`AUTO_WARM_COMPUTE`: it was warm already), or its span divided by
       its compute's slowdown over the choice's is still slower than the choice by more than ``prune`` (its
       communication made it slow, which a warm run does not change; (b) measures it later), or it is estimated
       :data:`AUTO_WARM_SLOWDOWN` times slower than the choice and :data:`AUTO_HICCUP_S` or more (the first steps'
       excess is a time more than a ratio, largest against the shortest steps); before any other budget
       is probed, since a span from the slow first steps makes every other budget look closer than it is. (b) **Now and
       then**: every ``probe_every`` steps the one measured longest ago (two steps into or out of pass-through), unless
       predicted above ``1 + prune`` times the fastest estimate; the pass-through measured only before step
       :data:`AUTO_WARM_AFTER` whatever it predicts (an early step can be slow in its communication too, which (a) does
       not test), unless it is far slower than the choice as in (a). (c) **Confirmed**: a pass-through measured over
       fewer spans than :data:`AUTO_MEDIAN_OF`, one within ``prune`` of a compressed choice's estimate, before that
       choice replaces it (:func:`pass_through_to_confirm`).
    4. **Choose**, among the candidates tied with the fastest estimate, the most bits: more bits are never worse for
       quality. Tied is within ``tolerance`` less the standard error of the difference, from the spread of the spans
       measured (:data:`AUTO_MAD_TO_SE`): a difference the noise cannot tell from one beyond ``tolerance`` is no tie.
       The pass-through is tied within ``tolerance`` plus that error: compressing must show it is faster (it loses bits,
       and the target is never to be slower than no compression).
    5. **Follow the link**. The link (or the load) changed when the last spans of the candidate just measured
       are, against its estimate before them:

       - one :data:`AUTO_JUMP` times shorter; one its square longer, or two in a row :data:`AUTO_JUMP` times
         longer, and by :data:`AUTO_HICCUP_S` or more (a single one, or a shorter excess, may be a hiccup of the
         machine; short steps wait for the third test). A single span its square longer by less is a hiccup,
         not kept;
       - one shorter by more than the band, off a median of three spans or more, with the wait for the link
         (:func:`link_wait`) falling by at least half the difference and a quarter of the step
         (:data:`AUTO_EXPOSED_SHARE`);
       - three in a row off by more than the band, on the same side, their waits for the link moving with them.

       The band is ``change``, or :data:`AUTO_NOISE_BAND` times the spans' spread where that is wider. That
       candidate keeps only the spans since; every other estimate is dropped, its figures scaled to it still
       predicting it, unless the link got slower (then an uncompressed step measured on the faster link would
       invite a costly probe). An estimate measured at another link rate is dropped when the model says the new
       rate moves it by more than ``change``, except the pass-through's when the rate was seen through a
       compressed step (2). Dropped ones are probed again (3).

    Every rank sees the same reduced telemetry, so every rank chooses alike; the choice enters the allocation digest
    like any budget. Its state is checkpointed (:meth:`state_dict`)."""

    def __init__(self, min_bits: float = 2.0, max_bits: float = PASS_THROUGH_BITS, tolerance: float = 0.03,
                 probe_every: int = 50, change: float = 0.15, prune: float = 0.1,
                 warm_start: int = AUTO_WARM_START, error_to_noise: float = ERROR_TO_NOISE) -> None:
        self.min_bits, self.max_bits = positive_bits("min_bits", min_bits), positive_bits("max_bits", max_bits)
        if self.min_bits > self.max_bits:
            raise ValueError(f"min_bits ({min_bits}) must be <= max_bits ({max_bits})")
        if self.max_bits > PASS_THROUGH_BITS:
            raise ValueError(f"max_bits must be <= {PASS_THROUGH_BITS:g} (no compression), got {max_bits}")
        if not 0 <= tolerance < 1 or not change > 0 or not prune >= 0:
            raise ValueError("tolerance must be in [0, 1), change > 0 and prune >= 0")
        if not isinstance(probe_every, int) or probe_every < 1:
            raise ValueError(f"probe_every must be an int >= 1, got {probe_every!r}")
        if not isinstance(warm_start, int) or warm_start < 0:
            raise ValueError(f"warm_start must be an int >= 0, got {warm_start!r}")
        self.warm_start = warm_start
        candidates = [b for b in AUTO_CANDIDATES if self.min_bits <= b <= self.max_bits]
        self.candidates = sorted({self.min_bits, self.max_bits, *candidates})
        self.tolerance, self.probe_every, self.change, self.prune = tolerance, probe_every, change, prune
        self.model = SpanModel(self.candidates, change)      # steps 1, 2 and 5 (checkpointed)
        self.quality = QualityGate(error_to_noise)           # step 0: the budgets quality allows (checkpointed)
        # Also checkpointed: the budget of each recent step (its telemetry arrives after it) and the last step whose
        # telemetry arrived; the hold in progress (budget, steps left).
        self.chosen: dict[int, float] = {}
        self.observed = -1
        self.probe: tuple[float, int] | None = None
        self.compressing_since: int | None = None            # the run's first compressed step (AUTO_COLD)

    def observe_timing(self, step: int, timing: dict[str, float]) -> None:
        """Step ``step``'s telemetry (:data:`.clock.TIMING_FIELDS`, reduced over ranks; NaN where unknown)."""
        self.observed = max(self.observed, step)
        bits, previous = self.chosen.get(step), self.chosen.get(step - 1)
        for old in [s for s in self.chosen if s < step - 1]:
            del self.chosen[old]
        if bits is not None and previous is not None and not self._cold(step, bits):
            self.model.observe(step, bits, previous, timing)

    def observe_quality(self, step: int, noise: Noise, predicted: dict[float, float]) -> None:
        """Step ``step``'s quality figures (:mod:`.quality`, reduced over ranks): the sampling noise of the step
        before (NaN where not measured) and the compression error its screen predicts per candidate budget (empty
        after a pass-through)."""
        self.quality.observe(noise, predicted)

    def allowed(self) -> list[float]:
        """0. The candidates whose compression error stays within ``error_to_noise`` of the sampling noise
        (:class:`~.quality.QualityGate`), before the first probe only :data:`AUTO_FIRST_PROBE_BITS` or more; the
        most bits if none does."""
        allowed = [b for b in self.candidates if self.quality.allows(b)]
        probed = self.compressing_since is not None and self.observed >= self.compressing_since + AUTO_COLD
        if self.quality.fed and not self.quality.errors and not probed:
            allowed = [b for b in allowed if b >= AUTO_FIRST_PROBE_BITS]
        return allowed or [max(self.candidates)]

    def estimate(self, bits: float) -> float | None:
        """The candidate's measured span (the median of its last spans), None if it has none."""
        return self.model.estimate(bits)

    # ------------------------------------------------------------------ 3 and 4: probe, choose
    def __call__(self, step: int) -> float:
        if self.probe is not None:
            bits, left = self.probe
            self.probe = (bits, left - 1) if left > 1 else None
        else:
            bits = self._choose(step)
            if bits < PASS_THROUGH_BITS and self.compressing_since is None:
                self.compressing_since = step
            previous = self.chosen.get(step - 1)
            switched = previous != bits and PASS_THROUGH_BITS in (bits, previous)
            if self.estimate(bits) is None and self.probe is None:
                if self._cold(step, bits):                       # the cold steps measure nothing: hold past them
                    assert self.compressing_since is not None
                    self.probe = (bits, self.compressing_since + AUTO_COLD - step)
                elif step < AUTO_WARMUP or switched:
                    self.probe = (bits, 1)                       # its first step measures nothing (1): hold it
        self.chosen[step] = bits
        return bits

    def _cold(self, step: int, bits: float) -> bool:
        """Whether step ``step`` at ``bits`` is one of the run's first :data:`AUTO_COLD` compressed steps (1)."""
        return (bits < PASS_THROUGH_BITS and self.compressing_since is not None
                and step < self.compressing_since + AUTO_COLD)

    def _choose(self, step: int) -> float:
        model = self.model
        allowed = self.allowed()
        for bits in self.candidates:
            # Measured at another link rate: if the model says the rate moves its span by more than ``change``,
            # the measurement no longer holds; but not an uncompressed step's on a rate seen through compressed
            # payloads (a few MB, their start latency and the ranks' skew included), which the change detector
            # (5) still drops when the link changes.
            if bits == PASS_THROUGH_BITS and model.rate_bits < PASS_THROUGH_BITS:
                continue
            then = model.predict(bits, model.rate_at.get(bits, 0.0)) if model.spans[bits] else None
            now = model.predict(bits)
            if then is not None and now is not None and abs(now - then) > self.change * then:
                model.drop(bits)
        spread = model.spread()
        known = {b: (e, AUTO_MAD_TO_SE * spread / math.sqrt(len(model.spans[b])))
                 for b in allowed if (e := model.estimate(b)) is not None}
        pending = {b for s, b in self.chosen.items() if self.observed < s < step}      # telemetry not in yet
        unmeasured = [b for b in allowed if b not in known]
        predicted = {b: model.predict(b) for b in unmeasured}
        if any(p is None for p in predicted.values()):           # nothing to predict from yet
            return first_budget(unmeasured, pending, step < self.warm_start)
        if step < self.warm_start and known.get(PASS_THROUGH_BITS, (math.inf, 0.0))[0] < AUTO_WARM_START_S:
            return PASS_THROUGH_BITS                             # the warm start (3): early steps decide quality
        # Probe what could win if the model erred by ``prune``: on what it did not measure at that budget (the
        # transfer; SafeBits' own time unless bracketed), and on the whole span below every measured compressed
        # budget, where nothing bounds it from below (while none is measured, the prediction leaves SafeBits' own
        # time out: a lower bound as it is). Hold one whose telemetry is on its way only if it wins even then.
        floor = min((b for b in known if b < PASS_THROUGH_BITS), default=PASS_THROUGH_BITS)
        own_time_known = any(b < PASS_THROUGH_BITS for b in model.figures)
        # Below that floor the fewest bits bound the rest (the least to send, the least own work): probe them
        # first, and no other one there while their telemetry is on its way.
        unbounded = sorted(b for b in predicted if b < floor)
        probeable_below = unbounded[:1] if not any(b in pending for b in unbounded[1:]) else []
        hoped: dict[float, tuple[float, float]] = {}
        for b, p in predicted.items():
            if (b < floor and b not in probeable_below) or p is None:
                continue
            if b in pending:
                hoped[b] = (p * (1 + self.prune), 0.0)
            elif b < floor:
                hoped[b] = (p / (1 + self.prune) if own_time_known else p, 0.0)
            else:
                bound = model.predict(b, allowance=self.prune)
                assert bound is not None                # the same figures and rate predicted it above
                hoped[b] = (bound, 0.0)
        # A pass-through measured only while the run warmed up is measured again before any other budget is probed:
        # a span from those slow steps makes every compressed budget look closer than it is.
        again = self._measure_again(known, pending, allowed)
        if again is not None:
            return again
        confirm = pass_through_to_confirm(model, known, pick(self.tolerance, known), self.prune) if known else 0
        if confirm and PASS_THROUGH_BITS not in pending:
            self.probe = (PASS_THROUGH_BITS, confirm)            # the switch measures nothing (1), then its spans
            return PASS_THROUGH_BITS
        if (known and PASS_THROUGH_BITS in predicted.keys() - model.figures.keys() - pending and not
                model.rules_out_pass_through(min(e for e, _ in known.values()), predicted[PASS_THROUGH_BITS])):
            return PASS_THROUGH_BITS                 # 3: never measured, and compressed steps cannot rule it out
        if hoped:
            bits = pick(self.tolerance, {**known, **hoped})
            if bits in hoped:
                current = self.chosen.get(step - 1, PASS_THROUGH_BITS)
                # A compressed choice measured over fewer spans is no estimate to leave for another compressed budget.
                young = current in known and len(model.spans[current]) < AUTO_MEDIAN_OF
                return current if young and max(bits, current) < PASS_THROUGH_BITS else bits
        choice = pick(self.tolerance, known)
        if step % self.probe_every == 0 and len(known) > 1:      # now and then, the one measured longest ago
            stalest = min(known, key=lambda b: model.measured_at.get(b, -1))
            guess = model.predict(stalest)
            fastest = min(e for e, _ in known.values())
            # A pass-through measured only while the run warmed up is probed whatever it predicts: an early step slow
            # in its communication (the compute test of 3 (a) cannot see that) would otherwise keep it out for good.
            # Not one far slower than the choice, as in 3 (a): no warm-up explains that, and a slow link's
            # uncompressed steps are the costliest of the run.
            early = (stalest == PASS_THROUGH_BITS and model.measured_at.get(stalest, -1) < AUTO_WARM_AFTER
                     and not far_slower(known[stalest][0], known[choice][0]))
            if stalest not in pending and guess is not None and (early or guess <= (1 + self.prune) * fastest):
                if early:
                    model.drop(stalest)                          # its early spans go, as in (a)
                if PASS_THROUGH_BITS in (stalest, self.chosen.get(step - 1)):
                    self.probe = (stalest, 1)                    # the switch measures nothing (1): one more step
                return stalest
        return choice

    def _measure_again(self, known: dict[float, tuple[float, float]], pending: set[float],
                       allowed: list[float]) -> float | None:
        """3 (a): once a compressed budget is the choice with three spans, a candidate measured only while the run
        warmed up, unless its step was warm already, its slow compute does not explain its loss, or it is estimated far
        slower than the choice; None if there is none."""
        model = self.model
        choice = pick(self.tolerance, known) if known else PASS_THROUGH_BITS
        if choice >= PASS_THROUGH_BITS or len(model.spans[choice]) < 3:
            return None
        now = known[choice][0]
        compute_now = own_compute(model.scaled(choice))
        for b in sorted(model.figures, reverse=True):
            if model.measured_at[b] >= AUTO_WARM_AFTER or b in pending or b not in allowed:
                continue
            figures = model.scaled(b)
            early = figures["span_s"]
            slowdown = own_compute(figures) / compute_now if compute_now > 0 else math.inf
            warm = slowdown <= AUTO_WARM_COMPUTE
            # The warm-up multiplies the whole step: divided by its compute's slowdown, is it still slower than
            # the choice? Then its communication made it slow (a link as slow as measured, or an early wait),
            # which a warmer run does not change; (b) probes it later.
            explained = early / max(slowdown, 1.0) <= (1 + self.prune) * now
            if not warm and explained and not far_slower(early, now):
                model.drop(b)
                self.probe = (b, 3)                              # the switch, then three spans: a median
                return b
        return None

    def state_dict(self) -> dict[str, Any]:
        return {**self.model.state_dict(), "chosen": {str(s): b for s, b in self.chosen.items()},
                "observed": self.observed, "probe": list(self.probe or []),
                "compressing_since": self.compressing_since, "quality": self.quality.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)
        self.chosen = {int(s): float(b) for s, b in state["chosen"].items()}
        self.observed = int(state.get("observed", max(self.chosen, default=0) - 2))
        self.probe = (float(state["probe"][0]), int(state["probe"][1])) if state["probe"] else None
        since = state.get("compressing_since")            # absent from checkpoints before AUTO_COLD: warm by then
        self.compressing_since = None if since is None else int(since)
        self.quality.load_state_dict(state.get("quality", {}))      # absent before the quality gate: none known

    def __repr__(self) -> str:
        return f"Auto(min_bits={self.min_bits:g}, max_bits={self.max_bits:g})"
