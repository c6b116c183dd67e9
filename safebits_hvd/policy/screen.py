"""The safety screen (docs/DESIGN.md, "The algorithm as implemented", step 2).

An action ``a`` is admissible for the EF-corrected update ``v`` when, on the values ``q = Q_a(v)`` that would
really be sent,

* normalized distortion ``||q - v||^2 / ||v||^2 <= max_distortion``, and
* cosine ``<q, v> / (||q|| ||v||) >= min_cosine``.

The lossless action is always admissible. A zero ``v`` is admissible at any action that sends zeros
(distortion 0, cosine 1). Non-finite statistics (an fp16 overflow, say) are never admissible.

Statistics arrive as the kernels' sums ``[sum (q-v)^2, sum q v, sum q^2, sum v^2]`` (float64).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

ACCEPT_MARGIN = 1e-4
"""Relative margin applied when a tensor is *sent*: the sent distortion must be <= max_distortion * (1 - margin)
and the cosine >= min_cosine + margin * (1 - min_cosine). The screen computes in float64; the margin keeps the
invariant true for anyone who recomputes it in float32."""


_SCALAR_ROWS = 16   # up to this many actions, distortion_cosine goes through distortion_cosine_of


def distortion_cosine(stats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Normalized distortion and cosine from ``(..., 4)`` sum statistics (zero-vector conventions above)."""
    stats = np.asarray(stats, dtype=np.float64)
    if stats.ndim >= 2 and stats.size <= 4 * _SCALAR_ROWS:
        # One tensor's menu (the dense path's group of one, once per tensor per step): Python floats beat NumPy's
        # per-call cost.
        pairs = [distortion_cosine_of(row) for row in stats.reshape(-1, 4).tolist()]
        return (np.array([p[0] for p in pairs], dtype=np.float64).reshape(stats.shape[:-1]),
                np.array([p[1] for p in pairs], dtype=np.float64).reshape(stats.shape[:-1]))
    err2, qv, q2, v2 = stats[..., 0], stats[..., 1], stats[..., 2], stats[..., 3]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        distortion = np.where(v2 > 0, err2 / v2, np.where(err2 == 0, 0.0, np.inf))
        denominator = np.sqrt(q2) * np.sqrt(v2)     # two square roots: q2 * v2 may overflow float64
        cosine = np.where(denominator > 0, qv / denominator, np.where((q2 == 0) & (v2 == 0), 1.0, 0.0))
    distortion = np.where(np.isfinite(distortion), distortion, np.inf)
    cosine = np.where(np.isfinite(cosine), cosine, -np.inf)
    return distortion, cosine


def distortion_cosine_of(stats: Sequence[float]) -> tuple[float, float]:
    """:func:`distortion_cosine` of one action's four sums, in Python floats: the send path checks one action per
    tensor, where NumPy's per-call cost would dominate (the results are the same, bit for bit)."""
    err2, qv, q2, v2 = (float(x) for x in stats)
    distortion = err2 / v2 if v2 > 0 else 0.0 if err2 == 0 else math.inf
    if not math.isfinite(distortion):
        distortion = math.inf
    denominator = (math.sqrt(q2) if q2 >= 0 else math.nan) * (math.sqrt(v2) if v2 >= 0 else math.nan)
    cosine = qv / denominator if denominator > 0 else 1.0 if q2 == 0 and v2 == 0 else 0.0
    return distortion, cosine if math.isfinite(cosine) else -math.inf


def passes(distortion: Any, cosine: Any, max_distortion: float, min_cosine: float, margin: float = 0.0) -> Any:
    """The screen's test, with ``margin`` to spare: on NumPy arrays (a mask) or on Python floats (a bool, without
    NumPy's per-call cost on the send path)."""
    return (distortion <= max_distortion * (1.0 - margin)) & (cosine >= min_cosine + margin * (1.0 - min_cosine))


def admissible(distortion: np.ndarray, cosine: np.ndarray, lossless: np.ndarray,
               max_distortion: float, min_cosine: float, margin: float = 0.0) -> np.ndarray:
    """Boolean mask of admissible actions; ``lossless`` marks the always-admissible action(s)."""
    return passes(distortion, cosine, max_distortion, min_cosine, margin) | np.asarray(lossless, dtype=bool)


class ScreenRule(NamedTuple):
    """The screen's rule with its two thresholds, the one definition the send follows: which actions are
    admissible, and which one each tensor of a batched pass tries first. The compiled backends take
    ``max_distortion`` and ``min_cosine`` and run a copy of :meth:`first_candidates` where the statistics are
    (``group.c``, ``cuda_kernels.cu``); tests/test_group_kernels.py holds them to this one."""

    max_distortion: float
    min_cosine: float

    def admissible(self, distortion: np.ndarray, cosine: np.ndarray, lossless: np.ndarray,
                   margin: float = 0.0) -> np.ndarray:
        """:func:`admissible` at these thresholds."""
        return admissible(distortion, cosine, lossless, self.max_distortion, self.min_cosine, margin)

    def passes(self, distortion: Any, cosine: Any, margin: float = 0.0) -> Any:
        """:func:`passes` at these thresholds."""
        return passes(distortion, cosine, self.max_distortion, self.min_cosine, margin)

    def first_candidates(self, screen_stats: np.ndarray, allocated: np.ndarray, cost_order: np.ndarray,
                         lossless: np.ndarray) -> np.ndarray:
        """The first action each member tries (the first of ``BudgetPolicy.send_order``), from the screen's
        statistics ``(members, actions, 4)``: the allocated one if the screen admits it, else the cheapest
        admissible lossy one, else the lossless one."""
        distortion, cosine = distortion_cosine(screen_stats)
        ok = self.admissible(distortion, cosine, lossless.astype(bool))
        rows = np.arange(len(allocated))
        lossy_ok_by_cost = (ok & ~lossless.astype(bool))[rows[:, None], cost_order]
        first = cost_order[rows, np.argmax(lossy_ok_by_cost, axis=1)]
        first = np.where(lossy_ok_by_cost.any(axis=1), first, int(np.flatnonzero(lossless)[0]))
        return np.where(ok[rows, allocated], allocated, first)
