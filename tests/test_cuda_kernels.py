"""CUDA kernels: NVRTC compile test (no GPU needed) and GPU-vs-CPU equality tests (marked ``gpu``).

With ``SAFEBITS_REQUIRE_NVRTC=1`` a missing CuPy/NVRTC or a compile error FAILS instead of skipping.
"""

from __future__ import annotations

import os

import pytest
import torch

from safebits_hvd import actions as A
from safebits_hvd import kernels as K
from safebits_hvd import rng
from safebits_hvd.kernels import cuda

REQUIRE_NVRTC = os.environ.get("SAFEBITS_REQUIRE_NVRTC") == "1"
KEY = rng.stream_key(5, 9, 2)


def _nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception:
        return False
    return True


def test_nvrtc_compiles_cuda_source():
    if not _nvrtc_available():
        if REQUIRE_NVRTC:
            pytest.fail("SAFEBITS_REQUIRE_NVRTC=1 but CuPy/NVRTC is not usable "
                        "(pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12)")
        pytest.skip("CuPy/NVRTC not installed")
    ptx = cuda.compile_nvrtc()
    assert "sb_quantize_ef_kernel" in ptx and "sb_screen_kernel" in ptx
    assert "fma." not in ptx  # --fmad=false: no contraction, bit-identical to the C backend


def test_cuda_source_contains_shared_header_once():
    src = cuda.cuda_source()
    assert src.count("#define SAFEBITS_MATH_H") == 1
    assert src.count("#define SB_WEYL") == 1      # the RNG constants come from rng.c_defines() only


def _gpu_available() -> bool:
    if torch.cuda.is_available():
        return True
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to PyTorch")
ACTIONS = [*A.DEFAULT_MENU, A.ACTIONS["int8_nearest"], A.ACTIONS["int4_nearest"], A.ACTIONS["int2_nearest"]]
SIZES = [1, 7, 511, 512, 513, 5000, 100_003, 1 << 20]


def _make(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen) * torch.logspace(-4, 4, n) if n > 1 else torch.randn(n, generator=gen)
    e = torch.randn(n, generator=gen) * 0.1
    if n > 1200:
        g[:512], e[:512] = 0.0, 0.0
        g[600:610], e[600:610] = 1e-30, 0.0
        g[700:720], e[700:720] = 1e30, 0.0
        g[800:900], e[800:900] = 3.0, 0.0
        g[1100:1200], e[1100:1200] = 2.0**-140, 0.0
    return g, e


def _stats_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.cpu(), b.cpu(), rtol=1e-9, atol=1e-300, equal_nan=True)


@gpu
@needs_gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: a.name)
@pytest.mark.parametrize("with_g", [True, False])
def test_quantize_ef_cuda_matches_cpu(n, action, with_g):
    g, e = _make(n)
    gc = g if with_g else None
    e_cpu, out_cpu = e.clone(), torch.empty(n)
    s_cpu = K.quantize_ef(gc, e_cpu, out_cpu, action, KEY)
    e_gpu, out_gpu = e.cuda(), torch.empty(n, device="cuda")
    s_gpu = K.quantize_ef(gc.cuda() if gc is not None else None, e_gpu, out_gpu, action, KEY)
    torch.cuda.synchronize()
    assert torch.equal(out_gpu.cpu().view(torch.int32), out_cpu.view(torch.int32))
    assert torch.equal(e_gpu.cpu().view(torch.int32), e_cpu.view(torch.int32))
    assert _stats_close(s_gpu, s_cpu), (s_gpu, s_cpu)


@gpu
@needs_gpu
@pytest.mark.parametrize("n", SIZES)
def test_screen_cuda_matches_cpu(n):
    g, e = _make(n, seed=1)
    nb = -(-n // 512)
    for buckets in (None, torch.arange(0, nb, 3)):
        s_cpu = K.screen(g, e, A.DEFAULT_MENU, KEY, buckets)
        s_gpu = K.screen(g.cuda(), e.cuda(), A.DEFAULT_MENU, KEY, None if buckets is None else buckets.cuda())
        assert s_gpu.shape == (len(A.DEFAULT_MENU), 4)
        assert _stats_close(s_gpu, s_cpu), (s_gpu, s_cpu)


@gpu
def test_gpu_visible_when_expected():
    if not _gpu_available():
        pytest.skip("no GPU: neither PyTorch nor CuPy sees a CUDA device")
    if not torch.cuda.is_available():
        pytest.skip("CuPy sees a GPU but this PyTorch build has no CUDA")
    assert K.backend_name("cuda") == "cuda"
