"""Timing helpers shared by the benchmark suites: ratios to a reference operation, never absolute times."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def min_seconds(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Smallest wall time of ``repeats`` calls of ``fn`` (seconds): the least noisy figure on a shared machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measured_min(benchmark: Any, fn: Callable[[], Any], repeats: int = 5) -> float:
    """``benchmark(fn)``, then the minimum time per call in seconds: pytest-benchmark's own statistic when
    benchmarking is enabled, else (``--benchmark-disable``) a minimum over ``repeats`` direct calls."""
    benchmark(fn)
    stats = getattr(benchmark, "stats", None)
    if stats is not None and getattr(stats, "stats", None) is not None and stats.stats.rounds:
        return float(stats.stats.min)
    return min_seconds(fn, repeats)
