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

from .kernel_cases import bits, make

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
    for kernel in ("sb_quantize_ef_kernel", "sb_screen_kernel", "sb_quantize_pack_ef_kernel", "sb_decode_kernel",
                   "sb_check_topk_kernel"):
        assert kernel in ptx, kernel
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
ACTIONS = [*A.DEFAULT_MENU, A.ACTIONS["int8_nearest"], A.ACTIONS["int4_nearest"], A.ACTIONS["int2_nearest"],
           *(A.lloyd_max(m) for m in sorted(A.LLOYD_MAX_LEVELS) if A.lloyd_max(m).name not in A.DEFAULT_MENU.names)]
# odd geometries: bit ranges of buckets that do not start on byte boundaries, trits across bytes
ODD_ACTIONS = [A.qsgd(3, bucket_size=100), A.ternary(bucket_size=7), A.topk(0.3, bucket_size=10),
               A.scaled_sign(bucket_size=13), A.qsgd(16, stochastic=False, bucket_size=77),
               A.lloyd_max(3, bucket_size=7), A.lloyd_max(8, bucket_size=100), A.lloyd_max(16, bucket_size=3)]
SIZES = [1, 7, 511, 512, 513, 5000, 100_003, 1 << 20]


def _stats_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.cpu(), b.cpu(), rtol=1e-9, atol=1e-300, equal_nan=True)


@gpu
@needs_gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: a.name)
@pytest.mark.parametrize("with_g", [True, False])
def test_quantize_ef_cuda_matches_cpu(n, action, with_g):
    g, e = make(n)
    gc = g if with_g else None
    e_cpu, out_cpu = e.clone(), torch.empty(n)
    s_cpu = K.quantize_ef(gc, e_cpu, out_cpu, action, KEY)
    e_gpu, out_gpu = e.cuda(), torch.empty(n, device="cuda")
    s_gpu = K.quantize_ef(gc.cuda() if gc is not None else None, e_gpu, out_gpu, action, KEY)
    torch.cuda.synchronize()
    assert torch.equal(bits(out_gpu.cpu()), bits(out_cpu))
    assert torch.equal(bits(e_gpu.cpu()), bits(e_cpu))
    assert _stats_close(s_gpu, s_cpu), (s_gpu, s_cpu)


@gpu
@needs_gpu
@pytest.mark.parametrize("n", SIZES)
def test_screen_cuda_matches_cpu(n):
    g, e = make(n, seed=1)
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


@gpu
@needs_gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("action", [*ACTIONS, *ODD_ACTIONS], ids=lambda a: f"{a.name}-B{a.bucket_size}")
def test_quantize_pack_ef_cuda_matches_cpu(n, action):
    """The CUDA payload is byte-identical to the C one; e bitwise; decoding on the GPU gives the CPU's q."""
    g, e = make(n)
    e_cpu = e.clone()
    p_cpu, s_cpu = K.quantize_pack_ef(g, e_cpu, action, KEY)
    e_gpu = e.cuda()
    p_gpu, s_gpu = K.quantize_pack_ef(g.cuda(), e_gpu, action, KEY)
    torch.cuda.synchronize()
    assert torch.equal(p_gpu.cpu(), p_cpu)
    assert torch.equal(bits(e_gpu.cpu()), bits(e_cpu))
    assert _stats_close(s_gpu, s_cpu), (s_gpu, s_cpu)
    e_ref, out_ref = e.cuda(), torch.empty(n, device="cuda")
    s_ref = K.quantize_ef(g.cuda(), e_ref, out_ref, action, KEY)
    assert torch.equal(s_gpu, s_ref)                          # same kernel statistics, bitwise
    assert torch.equal(bits(K.decode(p_gpu)), bits(out_ref))
    acc = torch.randn(n, device="cuda")
    expect = acc + out_ref
    thirds = (acc.cpu() + out_ref.cpu()).div_(3)               # the CPU's division, bitwise
    assert torch.equal(bits(K.decode_add(p_gpu, acc.clone(), divisor=3).cpu()), bits(thirds))
    assert torch.equal(bits(K.decode_add(p_gpu, acc)), bits(expect))
    assert torch.equal(bits(K.decode(p_cpu.cuda()).cpu()), bits(K.decode(p_cpu)))
    g_over, e_over = g.cuda(), e.cuda()                       # q written over the gradient itself, as the front
    p_over, _ = K.quantize_pack_ef(g_over, e_over, action, KEY, sent=g_over)   # ends do
    torch.cuda.synchronize()
    assert torch.equal(p_over.cpu(), p_cpu) and torch.equal(bits(e_over.cpu()), bits(e_cpu))
    assert torch.equal(bits(g_over.cpu()), bits(out_ref.cpu()))


@gpu
@needs_gpu
def test_decode_cuda_rejects_bad_topk_indices():
    from safebits_hvd.wire import WireFormatError

    g, e = make(5000)
    p, _ = K.quantize_pack_ef(g.cuda(), e.cuda(), A.ACTIONS["topk10"], KEY)
    p[-1] = 0xFF                                              # the last bucket's last index: out of range
    out = torch.zeros(5000, device="cuda")
    with pytest.raises(WireFormatError, match=r"grads\.w: top-k bucket 9"):
        K.decode_add(p, out, name="grads.w")
    assert not out.any()
