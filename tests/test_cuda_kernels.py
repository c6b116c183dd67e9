"""CUDA kernels: NVRTC compile test (no GPU needed) and GPU-vs-CPU equality tests (marked ``gpu``).

With ``SAFEBITS_REQUIRE_NVRTC=1`` a missing CuPy/NVRTC or a compile error FAILS instead of skipping.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import safebits_hvd as sb
from safebits_hvd.codec import actions as A
from safebits_hvd.codec import host, rng
from safebits_hvd.codec import kernels as K
from safebits_hvd.codec.kernels import cuda
from safebits_hvd.codec.wire import WireFormatError
from safebits_hvd.comm import collectives
from safebits_hvd.policy.budget import BudgetPolicy
from safebits_hvd.policy.screen import ScreenRule

from .helpers import need_nvrtc, random_grads
from .kernel_cases import bits, make
from .test_group_kernels import MENU, group_case
from .test_group_kernels import SIZES as GROUP_SIZES

KEY = rng.stream_key(5, 9, 2)
GROUP_KERNELS = ("sb_group_finite_kernel", "sb_group_screen_kernel", "sb_segment_sum_kernel", "sb_group_choose_kernel",
                 "sb_group_stage_kernel", "sb_group_pack_kernel", "sb_gather_kernel", "sb_group_locate_kernel",
                 "sb_group_decode_kernel")



def test_nvrtc_compiles_cuda_source():
    need_nvrtc()
    ptx = cuda.compile_nvrtc()
    for kernel in ("sb_quantize_ef_kernel", "sb_screen_kernel", "sb_quantize_pack_ef_kernel", "sb_decode_kernel",
                   "sb_check_topk_kernel", *GROUP_KERNELS):
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
ACTIONS = list(A.ACTIONS.values())   # every built-in action (the default menu is a subset)
# odd geometries: bit ranges of buckets that do not start on byte boundaries, trits across bytes
ODD_ACTIONS = [A.qsgd(3, bucket_size=100), A.ternary(bucket_size=7), A.topk(0.3, bucket_size=10),
               A.scaled_sign(bucket_size=13), A.qsgd(16, stochastic=False, bucket_size=77),
               A.lloyd_max(3, bucket_size=7), A.lloyd_max(8, bucket_size=100), A.lloyd_max(16, bucket_size=3),
               A.lloyd_max(64, bucket_size=45), A.qsgd(12, stochastic=False, bucket_size=21)]
SIZES = [1, 7, 511, 512, 513, 5000, 100_003, 1 << 20]


def _stats_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: both backends sum the statistics in one order (safebits_math.h, ``SB_STAT_PARTIALS``)."""
    return torch.equal(a.cpu().contiguous().view(torch.int64), b.cpu().contiguous().view(torch.int64))


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
    p_over, _ = K.quantize_pack_ef(g_over, e_over, action, KEY, into=g_over)   # ends do
    torch.cuda.synchronize()
    assert torch.equal(p_over.cpu(), p_cpu) and torch.equal(bits(e_over.cpu()), bits(e_cpu))
    assert torch.equal(bits(g_over.cpu()), bits(out_ref.cpu()))


@gpu
@needs_gpu
def test_decode_cuda_rejects_bad_topk_indices():
    g, e = make(5000)
    p, _ = K.quantize_pack_ef(g.cuda(), e.cuda(), A.ACTIONS["topk10"], KEY)
    p[-1] = 0xFF                                              # the last bucket's last index: out of range
    out = torch.zeros(5000, device="cuda")
    with pytest.raises(WireFormatError, match=r"grads\.w: top-k bucket 9"):
        K.decode_add(p, out, name="grads.w")
    assert not out.any()


# ------------------------------------------------------------------------------ the batched step (group kernels)
# cuda.pack_group / cuda.decode_group against the per-tensor CUDA kernels. Payloads, residuals, q and the choice are
# compared bitwise; the float64 sums only to 1e-12 relative (the group kernels reduce the per-bucket partials in a
# fixed order of their own, the per-tensor kernels with torch's part.sum(dim=0)).

GROUP_M = len(GROUP_SIZES)


def _cuda_group(allocated: np.ndarray, seed: int, nan_member: int | None):
    gradients, residuals, samples, keys, allocated = group_case(allocated, seed, nan_member)
    return ([g.cuda() for g in gradients], [e.cuda() for e in residuals],
            [None if s is None else s.cuda() for s in samples], keys, allocated)


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit (the statistics' shared order)."""
    a, b = np.ascontiguousarray(a, dtype=np.float64), np.ascontiguousarray(b, dtype=np.float64)
    return a.shape == b.shape and np.array_equal(a.view(np.int64), b.view(np.int64))


@gpu
@needs_gpu
@pytest.mark.parametrize("thresholds", [(0.5, 0.7), (0.02, 0.97)], ids=["loose", "tight"])
@pytest.mark.parametrize("allocation", ["each action", "mixed", "nan"])
def test_cuda_pack_group_is_bitwise_the_per_tensor_kernels(thresholds, allocation):
    max_distortion, min_cosine = thresholds
    tables = K.GroupTables(MENU, GROUP_SIZES, BudgetPolicy(MENU, GROUP_SIZES, max_distortion, min_cosine).cost_order)
    cases = ([np.full(GROUP_M, a) for a in range(len(MENU))] if allocation == "each action"
             else [np.random.RandomState(s).randint(0, len(MENU), GROUP_M) for s in range(4)])
    for seed, allocated in enumerate(cases):
        gradients, residuals, samples, keys, allocated = _cuda_group(allocated, seed,
                                                                     5 if allocation == "nan" else None)
        expected_residuals = [e.clone() for e in residuals]
        sents = [torch.empty_like(g) for g in gradients]
        result = K.pack_group(K.PackRequest(np.arange(GROUP_M), gradients, residuals, sents, samples, keys,
                                          allocated, True, True, True, ScreenRule(max_distortion, min_cosine)), tables)
        assert result.buffer.is_cuda and result.buffer.numel() == result.offsets[-1]
        # the device's choice is exactly first_candidates on the statistics it returned
        rule = ScreenRule(max_distortion, min_cosine)
        want_chosen = rule.first_candidates(result.screen_stats, allocated, tables.cost_order, tables.lossless)
        for k, (g, e) in enumerate(zip(gradients, expected_residuals, strict=True)):
            if g.numel() and not bool(torch.isfinite(g).all()):
                assert not result.finite[k] and result.chosen[k] == -1
                assert result.offsets[k + 1] == result.offsets[k] and not result.stats[k].any()
                continue
            assert result.finite[k] and result.chosen[k] == want_chosen[k]
            screen = K.screen(g, e, MENU, int(keys[k]), samples[k]).cpu().numpy()
            assert _close(result.screen_stats[k], screen), k
            assert result.chosen[k] == rule.first_candidates(screen[None], allocated[k:k + 1],
                                                             tables.cost_order[k:k + 1], tables.lossless)[0]
            sent = torch.empty_like(g)
            payload, stats = K.quantize_pack_ef(g, e, MENU[int(result.chosen[k])], int(keys[k]), into=sent)
            assert torch.equal(result.buffer[result.offsets[k]:result.offsets[k + 1]], payload), k
            assert _close(result.stats[k], stats.cpu().numpy()), k
            assert torch.equal(bits(sents[k]), bits(sent)), k
        for got, want in zip(residuals, expected_residuals, strict=True):
            assert torch.equal(bits(got), bits(want))


@gpu
@needs_gpu
@pytest.mark.parametrize("nan_member", [None, 5])
def test_cuda_pack_group_without_packing_screens_and_chooses_alike_and_writes_nothing(nan_member):
    """``GroupOutput.SCREEN`` (the two-phase first hop's screen) on the GPU: the verdicts, screen statistics and
    choices of the packing pass, no payload, no residual or q written, one read back."""
    tables = K.GroupTables(MENU, GROUP_SIZES, BudgetPolicy(MENU, GROUP_SIZES, 0.02, 0.97).cost_order)
    allocated = np.random.RandomState(3).randint(0, len(MENU), GROUP_M)
    gradients, residuals, samples, keys, allocated = _cuda_group(allocated, 7, nan_member)
    before = [e.clone() for e in residuals]
    sents = [torch.full_like(g, 5.0) for g in gradients]
    reads = host.reads()
    screened = K.pack_group(K.PackRequest(np.arange(GROUP_M), gradients, residuals, sents, samples, keys, allocated,
                                        True, True, True, ScreenRule(0.02, 0.97), K.GroupOutput.SCREEN), tables)
    assert host.reads() - reads == 1
    assert screened.buffer.numel() == 0 and not screened.offsets.any() and not screened.stats.any()
    for got, want, sent in zip(residuals, before, sents, strict=True):
        assert torch.equal(bits(got), bits(want)) and bool((sent == 5.0).all())
    packed = K.pack_group(K.PackRequest(np.arange(GROUP_M), gradients, residuals, sents, samples, keys, allocated,
                                      True, True, True, ScreenRule(0.02, 0.97)), tables)
    assert np.array_equal(screened.finite, packed.finite)
    assert np.array_equal(screened.chosen, packed.chosen)
    assert _close(screened.screen_stats, packed.screen_stats)


@gpu
@needs_gpu
@pytest.mark.parametrize("nan_member", [None, 5])
def test_cuda_pack_group_of_values_writes_q_and_residuals_as_the_packing_pass_and_no_payload(nan_member):
    """``GroupOutput.VALUES`` (the dense path) on the GPU: bitwise the packing pass's q and residuals, the same
    choices and statistics, no payload, one read back."""
    tables = K.GroupTables(MENU, GROUP_SIZES, BudgetPolicy(MENU, GROUP_SIZES, 0.02, 0.97).cost_order)
    allocated = np.random.RandomState(4).randint(0, len(MENU), GROUP_M)
    gradients, residuals, samples, keys, allocated = _cuda_group(allocated, 9, nan_member)
    packed_residuals = [e.clone() for e in residuals]
    value_sents = [torch.full_like(g, 5.0) for g in gradients]
    packed_sents = [torch.full_like(g, 5.0) for g in gradients]
    reads = host.reads()
    values = K.pack_group(K.PackRequest(np.arange(GROUP_M), gradients, residuals, value_sents, samples, keys,
                                      allocated, True, True, True, ScreenRule(0.02, 0.97), K.GroupOutput.VALUES),
                          tables)
    assert host.reads() - reads == 1
    packed = K.pack_group(K.PackRequest(np.arange(GROUP_M), gradients, packed_residuals, packed_sents, samples, keys,
                                      allocated, True, True, True, ScreenRule(0.02, 0.97)), tables)
    assert values.buffer.numel() == 0 and not values.offsets.any()
    assert np.array_equal(values.chosen, packed.chosen) and np.array_equal(values.stats, packed.stats)
    for k in range(GROUP_M):
        assert torch.equal(bits(residuals[k]), bits(packed_residuals[k])), k
        assert torch.equal(bits(value_sents[k]), bits(packed_sents[k])), k


@gpu
@needs_gpu
def test_cuda_pack_group_without_screen_sends_the_allocated_actions():
    tables = K.GroupTables(MENU, GROUP_SIZES, BudgetPolicy(MENU, GROUP_SIZES, 0.01, 0.99).cost_order)
    gradients, residuals, samples, keys, allocated = _cuda_group(np.full(GROUP_M, 4), 0, None)
    expected = [e.clone() for e in residuals]
    result = K.pack_group(K.PackRequest(np.arange(GROUP_M), gradients, residuals, [None] * GROUP_M, samples, keys,
                                      allocated, False, False, False, ScreenRule(0.01, 0.99)), tables)
    assert (result.chosen == 4).all() and not result.screen_stats.any() and result.finite.all()
    for k, (g, e) in enumerate(zip(gradients, expected, strict=True)):
        payload, _ = K.quantize_pack_ef(g, e, MENU[4], int(keys[k]))
        assert torch.equal(result.buffer[result.offsets[k]:result.offsets[k + 1]], payload)
        assert torch.equal(bits(residuals[k]), bits(e))


@gpu
@needs_gpu
def test_cuda_pack_group_reads_back_once():
    tables = K.GroupTables(MENU, GROUP_SIZES, BudgetPolicy(MENU, GROUP_SIZES, 0.5, 0.7).cost_order)
    gradients, residuals, samples, keys, allocated = _cuda_group(np.full(GROUP_M, 2), 0, 5)
    request = K.PackRequest(np.arange(GROUP_M), gradients, residuals, [None] * GROUP_M, samples, keys, allocated,
                          True, True, True, ScreenRule(0.5, 0.7))
    K.pack_group(request, tables)                         # warm: compile, device tables cached
    before = host.reads()
    K.pack_group(request, tables)
    assert host.reads() - before == 1


def _gathered_group(ranks: int, seed: int):
    """Payloads of every member from every rank (CUDA, misaligned as slices of a gathered buffer are), their actions
    (every menu action appears) and each rank's q."""
    actions = np.random.RandomState(seed).randint(0, len(MENU), (GROUP_M, ranks))
    actions[: min(len(MENU), GROUP_M), 0] = np.arange(min(len(MENU), GROUP_M))
    payloads, values = [], []
    for k, n in enumerate(GROUP_SIZES):
        member, member_values = [], []
        for r in range(ranks):
            g, e = make(int(n), 10 * k + r)
            sent = torch.empty(int(n), device="cuda")
            payload, _ = K.quantize_pack_ef(g.cuda(), e.cuda(), MENU[int(actions[k, r])], 7, into=sent)
            pad = torch.zeros(1 + r, dtype=torch.uint8, device="cuda")
            member.append(torch.cat([pad, payload])[1 + r:])
            member_values.append(sent)
        payloads.append(member)
        values.append(member_values)
    return payloads, actions, values


@gpu
@needs_gpu
@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0])
@pytest.mark.parametrize("ranks", [1, 3])
def test_cuda_decode_group_is_bitwise_decode_then_decode_add_in_rank_order(divisor, ranks):
    tables = K.GroupTables(MENU, GROUP_SIZES, BudgetPolicy(MENU, GROUP_SIZES, 0.5, 0.7).cost_order)
    payloads, actions, values = _gathered_group(ranks, 0)
    own = np.array([-1, 0, 1, -1, 0, 1, -1, 1, -1, 0]) if ranks > 1 else np.array([-1, 0] * (GROUP_M // 2))
    outs = [values[k][own[k]].clone() if own[k] >= 0 else torch.full((int(n),), 7.0, device="cuda")
            for k, n in enumerate(GROUP_SIZES)]
    K.decode_group(payloads, actions, outs, own, tables, np.arange(GROUP_M), [f"t{k}" for k in range(GROUP_M)],
                   divisor)
    for k in range(GROUP_M):
        if ranks == 1:        # nothing added: divided after, IEEE division (the CPU's; torch's CUDA div_ by a
            want = K.decode(payloads[k][0]).cpu()           # scalar multiplies by the reciprocal)
            want = want / divisor if divisor != 1.0 else want
        else:
            want = K.decode(payloads[k][0])
            for r in range(1, ranks):
                K.decode_add(payloads[k][r], want, divisor=divisor if r == ranks - 1 else 1.0)
        assert torch.equal(bits(outs[k].cpu()), bits(want.cpu())), k


@gpu
@needs_gpu
def test_cuda_decode_group_reads_back_once_and_names_an_invalid_topk_payload():
    topk = next(a for a, action in enumerate(MENU) if action.kind == A.ActionKind.TOPK)
    tables = K.GroupTables(MENU, GROUP_SIZES, BudgetPolicy(MENU, GROUP_SIZES, 0.5, 0.7).cost_order)
    names = [f"t{k}" for k in range(GROUP_M)]
    own = np.full(GROUP_M, -1)
    outs = [torch.empty(int(n), device="cuda") for n in GROUP_SIZES]
    actions = np.zeros((GROUP_M, 2), dtype=np.int64)     # MENU[0] only: no top-k payload, no read back
    payloads = [[K.quantize_pack_ef(*(t.cuda() for t in make(int(n), k)), MENU[0], 1)[0] for _ in range(2)]
                for k, n in enumerate(GROUP_SIZES)]
    before = host.reads()
    K.decode_group(payloads, actions, outs, own, tables, np.arange(GROUP_M), names)
    assert host.reads() == before
    g, e = make(5000)
    bad = K.quantize_pack_ef(g.cuda(), e.cuda(), MENU[topk], 1)[0]
    bad[-1] = 255                                          # local indices out of order
    k = int(np.flatnonzero(GROUP_SIZES == 5000)[0])
    payloads[k][1], actions[k, 1] = bad, topk
    before = host.reads()
    with pytest.raises(WireFormatError, match=rf"t{k} \(rank 1\)"):
        K.decode_group(payloads, actions, outs, own, tables, np.arange(GROUP_M), names)
    assert host.reads() - before == 1


@gpu
@needs_gpu
def test_cuda_receive_group_locates_and_decodes_without_a_read_and_names_what_is_wrong_at_close():
    """A gathered group with escalated payloads, received on the GPU (locate and decode kernels): bitwise the C
    backend's sums with no read back; a corrupt header: nothing decoded, the host's error from the verdict."""
    from .test_collectives import _gathered_group

    menu = sb.DEFAULT_MENU
    gen = np.random.default_rng(5)
    sizes = [int(n) for n in gen.integers(1, 5000, 40)]
    tables = K.GroupTables(menu, np.array(sizes), BudgetPolicy(menu, np.array(sizes), 0.5, 0.7).cost_order)
    expected = gen.integers(0, len(menu), len(sizes))
    sent = np.repeat(expected[:, None], 2, axis=1)
    sent[[3, 17, 30], [1, 0, 1]] = (sent[[3, 17, 30], [1, 0, 1]] + 1) % len(menu)
    gathered, offsets = _gathered_group(sizes, sent, 5)
    rows, names = np.repeat(np.arange(len(sizes))[:, None], 2, axis=1), [f"t{k}" for k in range(len(sizes))]
    own = np.full(len(sizes), -1)
    want = [torch.empty(n) for n in sizes]
    K.receive_group(gathered, rows, expected, want, own, tables, names, "g", 2.0, torch.empty(2, dtype=torch.int32))
    got = [torch.full((n,), 7.0, device="cuda") for n in sizes]
    verdict = torch.full((2,), K.NO_ERROR, dtype=torch.int32, device="cuda")
    before = host.reads()
    assert K.receive_group(gathered.cuda(), rows, expected, got, own, tables, names, "g", 2.0, verdict)
    assert host.reads() == before
    assert np.all(verdict.cpu().numpy() == K.NO_ERROR)
    for k in range(len(sizes)):
        assert torch.equal(bits(got[k].cpu()), bits(want[k])), k
    corrupt = gathered.clone()
    corrupt[int(offsets[21, 1]) + 3] ^= 0x40
    with pytest.raises(WireFormatError) as on_host:
        K.receive_group(corrupt, rows, expected, want, own, tables, names, "g", 2.0, torch.empty(2, dtype=torch.int32))
    got = [torch.full((n,), 7.0, device="cuda") for n in sizes]
    verdict.fill_(K.NO_ERROR)
    K.receive_group(corrupt.cuda(), rows, expected, got, own, tables, names, "g", 2.0, verdict)
    found = verdict.cpu().numpy()
    assert found[0] != K.NO_ERROR and all(bool(torch.all(t == 7.0)) for t in got)
    with pytest.raises(WireFormatError) as at_close:
        K.raise_received_error(found, corrupt.cuda(), rows, expected, tables, names, "g")
    assert str(at_close.value) == str(on_host.value)


def _compressor_steps(device: str, collective: str, steps: int = 3):
    """A SafeBits compressor in one process on ``device``: per step the values ``decompress`` returns (on the host)
    and the reads back of the step, with the step records."""
    sizes = (272, 16, 5000, 3) * 15 + (70_000,)
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n, device=device))) for i, n in enumerate(sizes)]
    host_params = [(name, torch.nn.Parameter(torch.zeros(p.shape))) for name, p in params]
    compressor = sb.SafeBits(params, budget_bits=3.0, collective=collective)
    outs, reads, records = [], [], []
    for step in range(steps):
        random_grads(host_params, step)                 # the same gradients on either device
        for (_, p), (_, h) in zip(params, host_params, strict=True):
            p.grad = h.grad.to(device)
        before = host.reads()
        pending = [compressor.compress(p.grad) for _, p in reversed(params)]
        received = [compressor.decompress(out, ctx) for out, ctx in pending]
        reads.append(host.reads() - before)
        outs.append([t.cpu() for t in received])
        records.append(compressor.last_step)
    return outs, reads, records, len(collectives.fusion_groups(np.array(sizes)))


@gpu
@needs_gpu
@pytest.mark.parametrize("collective", ["allgather", "dense"])
def test_cuda_compressor_step_is_bitwise_the_cpu_step_and_reads_back_per_group(collective):
    """The whole step on CUDA parameters (screen, choice, packing, error feedback, decoding) gives bitwise what
    the CPU gives, with the same actions, and reads back per group, escalation rounds included, not per tensor
    (dense: once per tensor, as on the CPU)."""
    cpu_outs, cpu_reads, cpu_records, groups = _compressor_steps("cpu", collective)
    gpu_outs, gpu_reads, gpu_records, _ = _compressor_steps("cuda", collective)
    for step, (want, got) in enumerate(zip(cpu_outs, gpu_outs, strict=True)):
        for k, (a, b) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(bits(a.contiguous()), bits(b.contiguous())), (step, k)
        assert cpu_records[step].actions == gpu_records[step].actions, step
    tensors = len(cpu_outs[0])
    assert max(gpu_reads) <= (2 * groups + 1 + groups * len(sb.DEFAULT_MENU) if collective == "allgather"
                              else tensors), (gpu_reads, cpu_reads)
