"""Budget schedules: any callable ``step -> budget in bits per parameter`` works; these are the built-ins.

Each says what it reads. A schedule with an ``observe(record)`` method is shown every finished
:class:`~safebits_hvd.policy.telemetry.StepRecord` (the SNR-aware one uses that); one with ``observe_timing(step,
timing)`` each step's telemetry, reduced over ranks, before the next step's budget is read (:class:`.auto.Auto`);
``state_dict``/``load_state_dict`` methods, if present, are checkpointed with the compressor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .telemetry import StepRecord


def positive_bits(name: str, value: float) -> float:
    """``value`` as a float, checked: a finite number of bits per parameter > 0 (else ``ValueError``)."""
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 (bits per parameter), got {value!r}")
    return float(value)


class Constant:
    """``bits`` every step. Reads nothing."""

    def __init__(self, bits: float) -> None:
        self.bits = positive_bits("bits", bits)

    def __call__(self, step: int) -> float:
        return self.bits

    def __repr__(self) -> str:
        return f"Constant({self.bits})"


class ConvergenceRamp:
    """More bits as training proceeds: ``start_bits`` at step 0, linearly (or by ``shape='cosine'``) to
    ``end_bits`` at ``ramp_steps``, then constant. Reads only the step: late training, when updates are small
    and precise, gets the precision; early training, robust to noise, is compressed hardest."""

    def __init__(self, start_bits: float, end_bits: float, ramp_steps: int, shape: str = "linear") -> None:
        self.start_bits = positive_bits("start_bits", start_bits)
        self.end_bits = positive_bits("end_bits", end_bits)
        if not isinstance(ramp_steps, int) or ramp_steps < 1:
            raise ValueError(f"ramp_steps must be an int >= 1, got {ramp_steps!r}")
        if shape not in ("linear", "cosine"):
            raise ValueError(f"shape must be 'linear' or 'cosine', got {shape!r}")
        self.ramp_steps, self.shape = ramp_steps, shape

    def __call__(self, step: int) -> float:
        x = min(max(step, 0) / self.ramp_steps, 1.0)
        if self.shape == "cosine":
            x = 0.5 - 0.5 * math.cos(math.pi * x)
        return self.start_bits + (self.end_bits - self.start_bits) * x


class BandwidthAware:
    """Bits that fit a target communication time: ``bandwidth_bits_per_s * target_seconds / num_parameters``,
    clamped to ``[min_bits, max_bits]``. Reads ``bandwidth_bits_per_s``: a number, or a callable returning the
    current measured bandwidth (bits per second), called once per step."""

    def __init__(self, bandwidth_bits_per_s: float | Callable[[], float], target_seconds: float,
                 num_parameters: int, min_bits: float = 1.0, max_bits: float = 32.0) -> None:
        if not callable(bandwidth_bits_per_s):
            positive_bits("bandwidth_bits_per_s", bandwidth_bits_per_s)
        self.bandwidth = bandwidth_bits_per_s
        self.target_seconds = positive_bits("target_seconds", target_seconds)
        if not isinstance(num_parameters, int) or num_parameters < 1:
            raise ValueError(f"num_parameters must be an int >= 1, got {num_parameters!r}")
        self.num_parameters = num_parameters
        self.min_bits, self.max_bits = positive_bits("min_bits", min_bits), positive_bits("max_bits", max_bits)
        if self.min_bits > self.max_bits:
            raise ValueError(f"min_bits ({min_bits}) must be <= max_bits ({max_bits})")

    def __call__(self, step: int) -> float:
        bandwidth = self.bandwidth() if callable(self.bandwidth) else self.bandwidth
        bandwidth = positive_bits("measured bandwidth (bits/s)", bandwidth)
        bits = bandwidth * self.target_seconds / self.num_parameters
        return min(max(bits, self.min_bits), self.max_bits)


class SNRAware:
    """Bits from the gradient signal-to-noise ratio the compressor already measures.

    Reads, through :meth:`observe`, each step's per-tensor cosine between what was sent and the EF-corrected
    update and keeps an exponential moving average ``c`` of their mean. A noisy regime (gradients that change
    direction step to step, where EF tolerates coarse codes) shows a high cosine for cheap actions and needs
    fewer bits; a low cosine means the signal is being lost and bits are added::

        bits = min_bits + (max_bits - min_bits) * clamp((target_cosine - c) / target_cosine + 0.5, 0, 1)

    Until the first observation it returns ``initial_bits``.
    """

    def __init__(self, min_bits: float = 2.0, max_bits: float = 8.0, initial_bits: float = 4.0,
                 target_cosine: float = 0.9, smoothing: float = 0.9) -> None:
        self.min_bits, self.max_bits = positive_bits("min_bits", min_bits), positive_bits("max_bits", max_bits)
        self.initial_bits = positive_bits("initial_bits", initial_bits)
        if not 0 < target_cosine <= 1:
            raise ValueError(f"target_cosine must be in (0, 1], got {target_cosine}")
        if not 0 <= smoothing < 1:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.target_cosine, self.smoothing = target_cosine, smoothing
        self.mean_cosine: float | None = None

    def observe(self, record: StepRecord) -> None:
        values = [c for c in record.cosine.values() if math.isfinite(c)]
        if not values:
            return
        c = sum(values) / len(values)
        self.mean_cosine = c if self.mean_cosine is None else (
            self.smoothing * self.mean_cosine + (1 - self.smoothing) * c)

    def __call__(self, step: int) -> float:
        if self.mean_cosine is None:
            return self.initial_bits
        x = (self.target_cosine - self.mean_cosine) / self.target_cosine + 0.5
        return self.min_bits + (self.max_bits - self.min_bits) * min(max(x, 0.0), 1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"mean_cosine": self.mean_cosine}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean_cosine = state["mean_cosine"]



def budget_at(schedule: Callable[[int], float], step: int) -> float:
    """``schedule(step)``, checked: a finite number of bits per parameter > 0 (else ``ValueError``)."""
    bits = schedule(step)
    if isinstance(bits, bool) or not isinstance(bits, int | float) or not math.isfinite(bits) or bits <= 0:
        raise ValueError(f"budget schedule {schedule!r} returned {bits!r} at step {step}; "
                         f"it must return a finite number of bits per parameter > 0")
    return float(bits)
