"""Step records: what each step did, kept in a bounded history, written as JSON lines, warned about.

:class:`StepRecord` is the public record. The core hands each finished step over as :class:`StepArrays` (the
reduced per-tensor arrays); :class:`StepLog` keeps them and builds a :class:`StepRecord` only when one is read
(building dicts of 1,000 tensors costs more than the exchange itself), writes the JSON-lines log and logs
rate-limited warnings for violations and escalations.

"Modeled" bits are what a packed wire format carries for the actions sent (:meth:`.actions.Action.cost`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..comm.clock import timing_record

logger = logging.getLogger("safebits_hvd")


def warn_never_sent(step: int, missing: list[str]) -> None:
    """A step closed before these registered tensors were handed to SafeBits (the next step began)."""
    logger.warning("SafeBits step %d closed with %d registered parameters never compressed (e.g. %s); pass SafeBits "
                   "the same parameters as the optimizer", step, len(missing), missing[:3])


@dataclass
class StepRecord:
    """What SafeBits did in one optimizer step. Identical on every rank (reduced across ranks).

    Attributes:
        step: optimizer step index (0-based).
        budget_bits_total: the budget ``B`` of this step in bits, all tensors (``budget_bits`` per parameter times
            the number of parameters).
        modeled_bits_total: modeled bits sent, all tensors (per tensor, the costliest action any rank sent).
        modeled_compression_ratio: ``32 * total elements / modeled_bits_total``.
        violation: ``modeled_bits_total > budget_bits_total`` (no safe assignment fitted, or escalations overran).
        excess_bits: ``max(0, modeled_bits_total - budget_bits_total)``.
        escalations: parameters whose allocated action was not admissible at send time on some rank.
        actions: parameter name -> action sent.
        distortion: parameter name -> normalized distortion of what was sent (max over ranks).
        cosine: parameter name -> cosine of what was sent with the EF-corrected update (min over ranks).
        allocation_digest: hex digest of (step, budget, allocation); equal on every rank.
        allocated: parameter name -> action the global allocation chose for this step.
        nonfinite: parameters whose gradient held NaN or Inf on some rank (sent unquantized with
            ``nonfinite='propagate'``, as zeros with ``'skip'``).
        infeasible: the allocator found no safe assignment within the budget and fell back to minimum cost.
        wire_bytes: bytes this rank handed to the collectives for the step (packed payloads with their headers, or
            the dense values): the one field that may differ between ranks.
        collective: how the step's gradients travelled: ``"allgather"`` (packed payloads) or ``"dense"``.
        planned_bits_total: modeled bits of the allocation (what the step sends if nothing escalates).
        reserve_bits: bits of the budget the escalation reserve kept out of the plan (docs/DESIGN.md, "Where the
            budget goes").
        guard_bits: bits the escalation guard kept out of the plan beyond the reserve. The rest of the budget the
            plan leaves, ``budget_bits_total - reserve_bits - guard_bits - planned_bits_total``, is what the menu's
            costs could not fill.
        timing: what SafeBits measured of this step, MAX over ranks: ``backward_s``, ``send_s``, ``receive_s``,
            ``exposed_s``, ``link_s``, ``wire_bytes``, ``span_s``; and MIN over ranks, ``least_exposed_s``
            (:mod:`.clock`; NaN where unknown, empty where no rank measured the step).
        timing_step: the step ``timing`` describes: ``step`` (-1: none).
        pass_through: the step sent every gradient as it is (its budget fit them all uncompressed: no screen, no
            packing, as ``Compression.none``; a residual left from earlier steps was added once).
        compression_error: ``ε²``, what compression added to the step's mean gradient: the squared error of what
            was sent (normalized distortion times ``||v||²``, summed over tensors, largest over ranks) over the
            rank count (:mod:`.quality`); 0 for a pass-through.
        gradient_noise: ``σ²``, the sampling variance of the mean gradient of step ``noise_step`` (the spread of
            the ranks' gradients around their mean, :mod:`.quality`); NaN where not measured (only
            ``budget_bits="auto"`` measures it, from two ranks on).
        noise_step: the step ``gradient_noise`` describes, -1: none (the noise is measured on one step in four and
            published with the next step's statistics, :mod:`.quality`).
        budget_errors: ``ε²`` the screen's statistics of this step predict per candidate budget of
            ``budget_bits="auto"`` (bits per parameter, as text, to ``ε²``); empty otherwise.

    ``used_bits_total`` and ``compression_ratio`` are deprecated aliases of the ``modeled_`` fields, ``skipped`` of
    ``nonfinite`` (one release).
    """

    step: int
    budget_bits_total: float
    modeled_bits_total: int
    modeled_compression_ratio: float
    violation: bool
    excess_bits: float
    escalations: list[str]
    actions: dict[str, str]
    distortion: dict[str, float]
    cosine: dict[str, float]
    allocation_digest: str
    allocated: dict[str, str] = field(default_factory=dict)
    nonfinite: list[str] = field(default_factory=list)
    infeasible: bool = False
    wire_bytes: int = 0
    collective: str = "dense"
    planned_bits_total: int = 0
    reserve_bits: float = 0.0
    guard_bits: float = 0.0
    timing: dict[str, float] = field(default_factory=dict)
    timing_step: int = -1
    pass_through: bool = False
    compression_error: float = 0.0
    gradient_noise: float = math.nan
    noise_step: int = -1
    budget_errors: dict[str, float] = field(default_factory=dict)

    @property
    def budget_share(self) -> float:
        """``modeled_bits_total / budget_bits_total``: the share of the budget spent (inf for a zero budget)."""
        return self.modeled_bits_total / self.budget_bits_total if self.budget_bits_total > 0 else math.inf

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, allow_nan=True)

    @property
    def used_bits_total(self) -> int:
        """Deprecated: :attr:`modeled_bits_total`."""
        warnings.warn("StepRecord.used_bits_total is deprecated; use modeled_bits_total", DeprecationWarning,
                      stacklevel=2)
        return self.modeled_bits_total

    @property
    def skipped(self) -> list[str]:
        """Deprecated: :attr:`nonfinite`."""
        warnings.warn("StepRecord.skipped is deprecated; use nonfinite", DeprecationWarning, stacklevel=2)
        return self.nonfinite

    @property
    def compression_ratio(self) -> float:
        """Deprecated: :attr:`modeled_compression_ratio`."""
        warnings.warn("StepRecord.compression_ratio is deprecated; use modeled_compression_ratio",
                      DeprecationWarning, stacklevel=2)
        return self.modeled_compression_ratio


class JsonlWriter:
    """Appends one JSON object per line; flushes each line so a crash loses at most the current step."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run

    def write(self, record: StepRecord) -> None:
        self._file.write(record.to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class RateLimitedWarning:
    """Logs the 1st, 10th, 100th, ... occurrence of a condition (with the running count), nothing in between."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self._next = 1

    def tick(self) -> bool:
        """Counts one occurrence; True if this one is to be logged (then log it with :meth:`log`)."""
        self.count += 1
        if self.count < self._next:
            return False
        self._next *= 10
        return True

    def log(self, message: str, *args: Any) -> None:
        logger.warning(f"{message} [{self.what}: {self.count} so far]", *args)

    def __call__(self, message: str, *args: Any) -> None:
        """Counts one occurrence and logs it if it is the 1st, 10th, 100th, ..."""
        if self.tick():
            self.log(message, *args)


class StepArrays(NamedTuple):
    """A finished step as reduced per-tensor arrays (registration order), turned into a :class:`StepRecord` when
    read."""

    step: int
    budget_bits_total: float
    modeled_bits_total: int
    planned_bits_total: int
    reserve_bits: float
    guard_bits: float
    timing: np.ndarray          # the reduced telemetry of step timing_step (clock.TIMING_FIELDS)
    timing_step: int
    pass_through: bool
    compression_error: float
    gradient_noise: float
    noise_step: int
    budget_errors: dict[float, float]
    sent: np.ndarray            # menu index of the action sent (the costliest over ranks), -1 if nothing
    allocated: np.ndarray       # menu index the allocation chose
    distortion: np.ndarray      # of what was sent, max over ranks
    cosine: np.ndarray          # of what was sent, min over ranks
    escalated: np.ndarray       # bool
    nonfinite: np.ndarray       # bool
    allocation_digest: str
    infeasible: bool
    wire_bytes: int
    collective: str


class StepLog:
    """The last ``max_history`` steps, the last one always, the JSON-lines log and the warnings.

    Args:
        names: parameter names, in registration order.
        action_names: menu action names, in menu order.
        total_elements: parameters' total element count (for the compression ratio).
        max_history: records kept in :attr:`history`.
        log_path: JSON-lines file, or None. With several ranks only rank 0 writes, unless it contains ``{rank}``.
    """

    def __init__(self, names: list[str], action_names: list[str], total_elements: int, max_history: int,
                 log_path: str | None) -> None:
        self.names = names
        self._name_array = np.array(names, dtype=object)
        self._action_names = np.array([*action_names, "skipped"], dtype=object)    # index -1 reads "skipped"
        self.total_elements = total_elements
        self.max_history = max_history
        self.log_path = log_path
        self._records: list[StepRecord | StepArrays] = []
        self._last: StepRecord | StepArrays | None = None
        self._built = 0          # self._records[:self._built] are all StepRecords
        self._writer: JsonlWriter | None = None
        self._violation_warning = RateLimitedWarning("budget violations")
        self._escalation_warning = RateLimitedWarning("steps with escalations")

    def add(self, arrays: StepArrays, rank: int) -> None:
        """Keep a finished step, log it (``rank``: this process's rank, for the log path) and warn."""
        self._last = arrays
        self._records.append(arrays)
        excess = len(self._records) - self.max_history
        if excess > 0:
            del self._records[:excess]
            self._built = max(0, self._built - excess)
        if self.log_path is not None:
            if self._writer is None and ("{rank}" in self.log_path or rank == 0):
                self._writer = JsonlWriter(self.log_path.format(rank=rank))
            if self._writer is not None:
                self._writer.write(self.last)
        used, budget = arrays.modeled_bits_total, arrays.budget_bits_total
        if used > budget:
            self._violation_warning(
                "SafeBits step %d: budget violation, %d bits used for a budget of %.0f (excess %.0f)%s",
                arrays.step, used, budget, used - budget, ": no safe assignment fits" if arrays.infeasible else "")
        if arrays.escalated.any() and self._escalation_warning.tick():
            escalations = self._name_array[arrays.escalated]
            self._escalation_warning.log("SafeBits step %d: %d tensors escalated (e.g. %s)", arrays.step,
                                         len(escalations), escalations[:3].tolist())

    def truncate(self, step: int) -> None:
        """Forget the records of ``step`` and later (a state of an earlier step was loaded: they were undone).
        The JSON-lines log keeps them: it says what ran."""
        kept = [r for r in self._records if r.step < step]
        self._built = min(self._built, len(kept))
        self._records = kept
        if self._last is not None and self._last.step >= step:
            self._last = kept[-1] if kept else None

    def record(self, arrays: StepArrays) -> StepRecord:
        """The :class:`StepRecord` of a step's arrays."""
        used, budget = arrays.modeled_bits_total, arrays.budget_bits_total
        names, action_names = self.names, self._action_names
        return StepRecord(
            step=arrays.step, budget_bits_total=budget, modeled_bits_total=used,
            modeled_compression_ratio=(32.0 * self.total_elements / used) if used else math.inf,
            violation=used > budget, excess_bits=max(0.0, used - budget),
            escalations=self._name_array[arrays.escalated].tolist(),
            actions=dict(zip(names, action_names[arrays.sent].tolist(), strict=True)),
            distortion=dict(zip(names, arrays.distortion.tolist(), strict=True)),
            cosine=dict(zip(names, arrays.cosine.tolist(), strict=True)),
            allocation_digest=arrays.allocation_digest,
            allocated=dict(zip(names, action_names[arrays.allocated].tolist(), strict=True)),
            nonfinite=self._name_array[arrays.nonfinite].tolist(),
            infeasible=arrays.infeasible, wire_bytes=arrays.wire_bytes, collective=arrays.collective,
            planned_bits_total=arrays.planned_bits_total, reserve_bits=arrays.reserve_bits,
            guard_bits=arrays.guard_bits,
            timing=timing_record(arrays.timing) if arrays.timing_step >= 0 else {},
            timing_step=arrays.timing_step, pass_through=arrays.pass_through,
            compression_error=arrays.compression_error, gradient_noise=arrays.gradient_noise,
            noise_step=arrays.noise_step, budget_errors={f"{b:g}": e for b, e in arrays.budget_errors.items()})

    @property
    def last(self) -> StepRecord | None:
        """The last finished step's record (None before the first)."""
        if isinstance(self._last, StepArrays):
            built = self.record(self._last)
            if self._records and self._records[-1] is self._last:
                self._records[-1] = built
            self._last = built
        return self._last

    @property
    def history(self) -> list[StepRecord]:
        """The last ``max_history`` records, oldest first (a new list each time)."""
        records = self._records
        for i in range(self._built, len(records)):          # only records added since the last call
            if isinstance(records[i], StepArrays):
                built = self.record(records[i])
                if records[i] is self._last:
                    self._last = built
                records[i] = built
        self._built = len(records)
        return list(records)
