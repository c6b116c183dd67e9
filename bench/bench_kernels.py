"""Kernel benchmarks: time per action and tensor size as a ratio to ``torch.clone`` of the same tensor.

Run: ``.venv/bin/python -m pytest bench/bench_kernels.py --benchmark-enable -q`` (add ``--device cuda`` via
``SAFEBITS_BENCH_DEVICE=cuda``). The ratio (kernel / clone, clone timed in the same process) is stored in
``benchmark.extra_info['ratio_to_clone']``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from safebits_hvd import actions as A
from safebits_hvd import kernels as K
from safebits_hvd import rng

DEVICE = os.environ.get("SAFEBITS_BENCH_DEVICE", "cpu")
SIZES = [1 << 16, 1 << 20, 1 << 24]
ACTIONS = ["fp32", "fp16", "bf16", "int8", "int4", "int2", "ternary", "sign", "topk10", "topk1"]
KEY = rng.stream_key(0, 1, 2)

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("SAFEBITS_BENCH_DEVICE=cuda but no CUDA device", allow_module_level=True)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def best_time(fn, reps: int = 7) -> float:
    fn()
    _sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best


_clone_cache: dict[int, float] = {}


def clone_time(x: torch.Tensor) -> float:
    if x.numel() not in _clone_cache:
        _clone_cache[x.numel()] = best_time(lambda: x.clone())
    return _clone_cache[x.numel()]


def _tensors(n: int):
    gen = torch.Generator().manual_seed(n)
    g = torch.randn(n, generator=gen).to(DEVICE)
    e = (torch.randn(n, generator=gen) * 0.01).to(DEVICE)
    return g, e, torch.empty_like(g)


def _run(benchmark, fn, x):
    t_clone = clone_time(x)
    t_kernel = best_time(fn)
    benchmark.extra_info.update(device=DEVICE, n=x.numel(), clone_s=t_clone, kernel_s=t_kernel,
                                ratio_to_clone=t_kernel / t_clone)
    benchmark.pedantic(fn, rounds=5, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("name", ACTIONS)
def test_quantize_ef(benchmark, n, name):
    g, e, out = _tensors(n)
    action = A.ACTIONS[name]

    def fn():
        K.quantize_ef(g, e, out, action, KEY)
        _sync()

    _run(benchmark, fn, g)


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
def test_screen_64_buckets(benchmark, n):
    g, e, _ = _tensors(n)
    nb = -(-n // A.DEFAULT_MENU.bucket_size)
    buckets = torch.linspace(0, nb - 1, 64).long().unique().to(DEVICE)

    def fn():
        K.screen(g, e, A.DEFAULT_MENU, KEY, buckets)
        _sync()

    _run(benchmark, fn, g)


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("name", ["int4", "sign", "topk10"])
def test_compress_screen_plus_send(benchmark, n, name):
    """The per-tensor kernel work of one compress: screen 64 buckets x 10 actions + one quantize_ef (SafeBits
    samples 16 buckets by default; 64 is the conservative case)."""
    g, e, out = _tensors(n)
    nb = -(-n // A.DEFAULT_MENU.bucket_size)
    buckets = torch.linspace(0, nb - 1, 64).long().unique().to(DEVICE)
    action = A.ACTIONS[name]

    def fn():
        K.screen(g, e, A.DEFAULT_MENU, KEY, buckets)
        K.quantize_ef(g, e, out, action, KEY)
        _sync()

    _run(benchmark, fn, g)


if __name__ == "__main__":  # quick table without pytest-benchmark
    for n in SIZES:
        g, e, out = _tensors(n)
        tc = clone_time(g)
        nb = -(-n // 512)
        bk = torch.linspace(0, nb - 1, 64).long().unique().to(DEVICE)
        ts = best_time(lambda g=g, e=e, bk=bk: (K.screen(g, e, A.DEFAULT_MENU, KEY, bk), _sync()))
        cells = [f"n={n:>9} clone={tc * 1e3:8.3f}ms screen64={ts / tc:6.2f}x"]
        for name in ACTIONS:
            a = A.ACTIONS[name]
            tq = best_time(lambda a=a, g=g, e=e, out=out: (K.quantize_ef(g, e, out, a, KEY), _sync()))
            cells.append(f"{name}={tq / tc:.2f}")
        print(" ".join(cells), flush=True)
