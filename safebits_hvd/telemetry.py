"""Step records, JSON-lines telemetry and rate-limited warnings."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger("safebits_hvd")


@dataclass
class StepRecord:
    """What SafeBits did in one optimizer step. Identical on every rank (reduced across ranks).

    Attributes:
        step: optimizer step index (0-based).
        budget_bits_total: the budget ``B`` of this step in bits (``budget_bits * total elements``).
        used_bits_total: modeled bits actually sent (per tensor, the costliest action any rank sent).
        compression_ratio: ``32 * total elements / used_bits_total``.
        violation: ``used_bits_total > budget_bits_total`` (no safe assignment fitted, or escalations overran).
        excess_bits: ``max(0, used_bits_total - budget_bits_total)``.
        escalations: parameters whose allocated action was not admissible at send time on some rank.
        actions: parameter name -> action sent.
        distortion: parameter name -> normalized distortion of what was sent (max over ranks).
        cosine: parameter name -> cosine of what was sent with the EF-corrected update (min over ranks).
        allocation_digest: hex digest of (step, budget, allocation); equal on every rank.
        allocated: parameter name -> action the global allocation chose for this step.
        skipped: parameters whose gradient was non-finite and skipped (``nonfinite='skip'``).
        infeasible: the allocator found no safe assignment within the budget and fell back to minimum cost.
    """

    step: int
    budget_bits_total: float
    used_bits_total: int
    compression_ratio: float
    violation: bool
    excess_bits: float
    escalations: list[str]
    actions: dict[str, str]
    distortion: dict[str, float]
    cosine: dict[str, float]
    allocation_digest: str
    allocated: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    infeasible: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, allow_nan=True)


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
