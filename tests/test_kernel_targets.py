"""Every target of the C kernels' runtime dispatch gives the same bits (kernels/cpu.c, ``SB_CLONES``).

The library holds each hot function for AVX2 and for the baseline x86-64, and picks one at load time by the CPU, so
the tests of the loaded library check only the one this machine picks. Here each target is built on its own
(``-DSB_NO_CLONES`` plus its ``-m`` flags), x86-64-v4 (AVX-512, what ``-march=native`` gives on recent CPUs)
included, and its packing pass compared, byte for byte, with the loaded one.
"""

from __future__ import annotations

import ctypes
import functools

import pytest
import torch

from safebits_hvd.codec import actions as A
from safebits_hvd.codec import kernels as K
from safebits_hvd.codec import rng, wire
from safebits_hvd.codec.kernels import cpu

from .kernel_cases import bits, make

KEY = rng.stream_key(3, 1, 4)
SIZES = [7, 513, 5000, 100_003]
ACTIONS = [*A.ACTIONS.values(), A.qsgd(3, bucket_size=100), A.ternary(bucket_size=7), A.topk(0.3, bucket_size=10)]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


TARGETS = {
    "baseline": ((), set()),
    "avx2": (("-mavx2",), {"avx2"}),
    "x86-64-v4": (("-march=x86-64-v4",), {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
}


@functools.cache
def _variant(target: str) -> ctypes.CDLL:
    flags, needs = TARGETS[target]
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU cannot run the {target} build")
    try:
        return cpu.bind(ctypes.CDLL(str(cpu.build(("-DSB_NO_CLONES", *flags)))))
    except RuntimeError as err:
        pytest.skip(f"no {target} build here: {err}")


pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("n", SIZES)
def test_every_dispatch_target_packs_the_same_bits(target: str, n: int) -> None:
    lib = _variant(target)
    g, e = make(n)
    for action in ACTIONS:
        e_loaded, sent_loaded = e.clone(), torch.empty(n)
        payload, stats = K.quantize_pack_ef(g, e_loaded, action, KEY, into=sent_loaded)
        e_target, sent_target, again = e.clone(), torch.empty(n), payload.clone()
        again[wire.HEADER_BYTES:] = 0                        # the header as the loaded build wrote it
        stats_target = cpu.quantize_pack_ef(g, e_target, again, action, KEY, sent_target, lib=lib)
        assert torch.equal(again, payload), action.name
        assert torch.equal(bits(e_target), bits(e_loaded)), action.name
        assert torch.equal(bits(sent_target), bits(sent_loaded)), action.name
        assert torch.equal(stats_target, stats), action.name
