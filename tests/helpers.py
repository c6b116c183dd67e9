"""Shared helpers of the unit tests: a model of many tensors, a one-process driver of SafeBits, and the NVRTC gate."""

from __future__ import annotations

import os

import pytest
import torch

import safebits_hvd as sb


def many_tensor_params(seed: int = 0, sizes: tuple[int, ...] = (7, 300, 512, 1000, 5000, 70_000, 3)):
    """(name, parameter) pairs of assorted sizes, including partial buckets and multi-bucket tensors."""
    gen = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.nn.Parameter(torch.randn(n, generator=gen))) for i, n in enumerate(sizes)]


def random_grads(params, step: int, seed: int = 1, scale: float = 1.0) -> None:
    """Give every parameter a fresh heavy-ish tailed random gradient (a new tensor, as set_to_none does)."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    for i, (_, p) in enumerate(params):
        g = torch.randn(p.shape, generator=gen) * scale * (1 + i)
        g = g * torch.rand(p.shape, generator=gen).pow(3)            # heavier tails than Gaussian
        p.grad = g


def run_steps(compressor: sb.SafeBits, params, steps: int, seed: int = 1, capture: bool = False):
    """Compress every gradient for ``steps`` steps. With ``capture``, returns per step a list of
    (name, grad, v = grad + residual_before, sent) tuples."""
    log = []
    for step in range(steps):
        random_grads(params, step, seed)
        record = []
        for name, p in reversed(params):                             # backward order
            before = compressor.memory.residuals.get(name)
            before = before.clone() if before is not None else torch.zeros(p.numel())
            sent, ctx = compressor.compress(p.grad)
            if capture:
                record.append((name, p.grad.clone(), p.grad.reshape(-1) + before, sent.clone()))
            compressor.decompress(sent, ctx)
        log.append(record)
    return log


def need_nvrtc() -> None:
    """Skip the calling test when CuPy's NVRTC is not usable; with ``SAFEBITS_REQUIRE_NVRTC=1`` (``make test``, CI)
    fail it instead, so a missing compiler never passes silently."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception:
        if os.environ.get("SAFEBITS_REQUIRE_NVRTC") == "1":
            pytest.fail("SAFEBITS_REQUIRE_NVRTC=1 but CuPy/NVRTC is not usable "
                        "(pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12)")
        pytest.skip("CuPy/NVRTC not installed")
