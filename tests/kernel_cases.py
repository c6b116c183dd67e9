"""The ONE input maker of the kernel tests (CPU, CUDA, wire format): gradients and residuals with the edge cases
every backend must reproduce bit for bit."""

from __future__ import annotations

import torch


def make(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, e)`` of ``n`` float32 elements: magnitudes over 8 decades, and (when long enough) an all-zero bucket,
    tiny values, fp16-overflowing values, ties (top-k), float32 subnormals, -0.0, zero last buckets (one
    partial) and fp16 subnormals."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen) * torch.logspace(-4, 4, n) if n > 1 else torch.randn(n, generator=gen)
    e = torch.randn(n, generator=gen) * 0.1
    if 8 < n <= 1200:
        g[1:3], e[1:3] = -0.0, -0.0                     # -0.0 in short tensors too
    if n > 1200:
        g[:512] = 0.0                                   # an exact zero bucket
        e[:512] = 0.0
        g[600:610], e[600:610] = 1e-30, 0.0             # tiny
        g[700:720], e[700:720] = 1e30, 0.0              # fp16 overflow
        g[800:900], e[800:900] = 3.0, 0.0               # ties
        g[1100:1200], e[1100:1200] = 2.0**-140, 0.0     # float32 subnormal
        g[1030:1034] = -0.0
        e[1030:1034] = -0.0
    if n > 5000:
        g[-700:], e[-700:] = 0.0, 0.0                   # zero last buckets (one partial)
        g[-513:-500] = 6e-8                             # fp16 subnormal range
    return g, e


def bits(t: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns (compare these: -0.0 and NaN payloads count)."""
    return t.view(torch.int32)
