"""Kernel benchmarks: time per action and tensor size as a ratio to ``torch.clone`` of the same tensor.

Run: ``.venv/bin/python -m pytest bench/suites/bench_kernels.py --benchmark-enable -q`` (add ``--device cuda`` via
``SAFEBITS_BENCH_DEVICE=cuda``). The ratio (kernel / clone, clone timed in the same process) is stored in
``benchmark.extra_info['ratio_to_clone']``.

The packed wire format: ``test_quantize_pack_ef`` (the fused packing pass into a reused payload) and
``test_decode_add`` (one payload added into a float32 tensor) on 16M floats; targets: pack <= 1.5x clone,
decode_add <= 1x clone (reported as ``pack_vs_clone`` / ``decode_add_vs_clone``, not asserted);
``test_quantize_pack_ef_sent``: the packing pass that also writes the dequantized values (``pack_sent_vs_clone``);
``test_quantize_pack_ef_warm``: the packing pass on 2.4M warm floats against a warm ``copy_`` (``pack_vs_warm_copy``).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from safebits_hvd.codec import actions as A
from safebits_hvd.codec import kernels as K
from safebits_hvd.codec import rng

DEVICE = os.environ.get("SAFEBITS_BENCH_DEVICE", "cpu")
SIZES = [1 << 16, 1 << 20, 1 << 24]
ACTIONS = ["fp32", "fp16", "bf16", "int8", "int4", "int2", "ternary", "sign", "topk10", "topk1"]
WIRE_N = 1 << 24
WIRE_ACTIONS = ["int4", "int8", "int3_mse", "ternary", "ternary_mse", "sign", "topk10"]
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


def _run(benchmark, fn, x, ratio_key: str | None = None):
    t_clone = clone_time(x)
    t_kernel = best_time(fn)
    benchmark.extra_info.update(device=DEVICE, n=x.numel(), clone_s=t_clone, kernel_s=t_kernel,
                                ratio_to_clone=t_kernel / t_clone)
    if ratio_key:
        benchmark.extra_info[ratio_key] = t_kernel / t_clone
    benchmark.pedantic(fn, rounds=5, iterations=1, warmup_rounds=1)


_wire_cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _wire_tensors(n: int = WIRE_N):
    """One set of 16M-element tensors shared by the wire benchmarks (built once: randn of 16M takes a while)."""
    if n not in _wire_cache:
        _wire_cache[n] = _tensors(n)
    return _wire_cache[n]


@pytest.mark.parametrize("name", WIRE_ACTIONS)
def test_quantize_pack_ef(benchmark, name):
    g, e, _ = _wire_tensors()
    action = A.ACTIONS[name]
    payload, _ = K.quantize_pack_ef(g, e, action, KEY)               # reused, as a Horovod send buffer would be

    def fn():
        K.quantize_pack_ef(g, e, action, KEY, payload)
        _sync()

    _run(benchmark, fn, g, "pack_vs_clone")
    benchmark.extra_info["payload_bytes"] = payload.numel()


@pytest.mark.parametrize("name", ["int8", "int3_mse"])
def test_quantize_pack_ef_sent(benchmark, name):
    """The packing pass that also writes ``q`` (``into=``), as the allgather path runs it: the price of the decode it
    saves this rank (ResNet-18 at 4.4 bits sends these two actions)."""
    g, e, out = _wire_tensors()
    action = A.ACTIONS[name]
    payload, _ = K.quantize_pack_ef(g, e, action, KEY)

    def fn():
        K.quantize_pack_ef(g, e, action, KEY, payload, into=out)
        _sync()

    _run(benchmark, fn, g, "pack_sent_vs_clone")


@pytest.mark.parametrize("name", WIRE_ACTIONS)
def test_quantize_pack_ef_warm(benchmark, name):
    """The packing pass on a tensor the size of ResNet-18's largest (2.4M floats) against a ``copy_`` into a tensor
    already written: both warm, so the ratio is the pass's arithmetic, not page faults (``pack_vs_warm_copy``)."""
    g, e, out = _tensors(2_359_296)
    action = A.ACTIONS[name]
    payload, _ = K.quantize_pack_ef(g, e, action, KEY)
    t_copy = best_time(lambda: (out.copy_(g), _sync()))

    def fn():
        K.quantize_pack_ef(g, e, action, KEY, payload)
        _sync()

    _run(benchmark, fn, g)
    benchmark.extra_info["pack_vs_warm_copy"] = benchmark.extra_info["kernel_s"] / t_copy


@pytest.mark.parametrize("name", WIRE_ACTIONS)
def test_decode_add(benchmark, name):
    g, e, out = _wire_tensors()
    payload, _ = K.quantize_pack_ef(g, e.clone(), A.ACTIONS[name], KEY)

    def fn():
        K.decode_add(payload, out)
        _sync()

    _run(benchmark, fn, g, "decode_add_vs_clone")


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
    """The per-tensor kernel work of one compress: screen 64 buckets x the default menu + one quantize_ef (SafeBits
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
    g, e, out = _tensors(WIRE_N)
    tc = clone_time(g)
    for name in WIRE_ACTIONS:
        a = A.ACTIONS[name]
        p, _ = K.quantize_pack_ef(g, e, a, KEY)
        tp = best_time(lambda a=a, p=p: (K.quantize_pack_ef(g, e, a, KEY, p), _sync()))
        td = best_time(lambda p=p: (K.decode_add(p, out), _sync()))
        print(f"wire n={WIRE_N} {name:8s} pack={tp / tc:.2f}x clone  decode_add={td / tc:.2f}x clone  "
              f"payload={p.numel()} B", flush=True)
