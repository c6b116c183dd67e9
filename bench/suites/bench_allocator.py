"""The global allocator (``safebits_hvd.policy.allocator.allocate``) for 100 to 10,000 tensors and the default menu,
compiled (``kernels/allocator.c``, the default) and in NumPy (the fallback).

Inputs are realistic: costs from ``Action.cost`` of the default menu for log-uniform tensor sizes
(64 .. 4M elements), errors = distortion x ||v||^2 measured by the real screen kernel on Gaussian data for
the distortions, a budget of 4 bits per parameter. ``extra_info['allocate_vs_reference']`` is the time over
that of ``numpy.argsort`` of the (tensors x actions) error matrix (a size-matched reference operation).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import safebits_hvd as sb
from bench.suites.timing import measured_min, min_seconds
from safebits_hvd.codec import kernels
from safebits_hvd.policy.allocator import allocate, compiled_available
from safebits_hvd.policy.screen import admissible, distortion_cosine


def _problem(tensors: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(costs bits, errors, admissible, budget bits) for ``tensors`` tensors of the default menu."""
    rng = np.random.default_rng(seed)
    menu = sb.DEFAULT_MENU
    numels = np.exp(rng.uniform(np.log(64), np.log(4 * 2**20), tensors)).astype(np.int64)
    costs = np.array([menu.costs(int(n)) for n in numels], dtype=np.int64)
    # Distortion/cosine per action from the real screen on a few Gaussian samples with varied tails.
    profiles = []
    for k in range(8):
        g = torch.from_numpy(rng.standard_t(df=2 + k, size=8192).astype(np.float32))
        stats = kernels.screen(g, torch.zeros_like(g), menu, key=k).numpy()
        profiles.append(distortion_cosine(stats))
    pick = rng.integers(0, len(profiles), tensors)
    distortion = np.stack([profiles[p][0] for p in pick])
    cosine = np.stack([profiles[p][1] for p in pick])
    v2 = rng.lognormal(0.0, 2.0, tensors) * numels
    ok = admissible(distortion, cosine, np.array([a.lossless for a in menu]), 0.5, 0.8)
    errors = np.where(np.isfinite(distortion), distortion, 0.0) * v2[:, None]
    return costs, errors, ok, 4.0 * float(numels.sum())


@pytest.mark.parametrize("implementation", ["compiled", "numpy"])
@pytest.mark.parametrize("tensors", [100, 1000, 10_000])
def test_allocate(benchmark, tensors: int, implementation: str) -> None:
    compiled = implementation == "compiled"
    if compiled and not compiled_available():
        pytest.skip("no C compiler: the compiled allocator is not built")
    costs, errors, ok, budget = _problem(tensors)
    result = allocate(costs, errors, ok, budget, compiled=compiled)
    seconds = measured_min(benchmark, lambda: allocate(costs, errors, ok, budget, compiled=compiled))
    reference = min_seconds(lambda: np.argsort(errors, axis=1), repeats=9)
    benchmark.extra_info.update({
        "tensors": tensors, "actions": costs.shape[1], "implementation": implementation,
        "allocate_vs_reference": seconds / reference,
        "allocate_ms": seconds * 1e3, "us_per_tensor": seconds * 1e6 / tensors,
        "feasible": bool(result.feasible), "bits_per_parameter": result.cost_bits / (budget / 4.0),
    })
    assert result.feasible and result.cost_bits <= budget
