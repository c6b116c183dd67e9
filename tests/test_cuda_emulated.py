"""The CUDA backend without a GPU: ``kernels/cuda.py`` and the kernels of ``cuda_kernels.cu`` run on the CPU through
``safebits_hvd.codec.kernels.cuda_emulator`` (the same translation unit compiled as C++, blocks' threads as fibers), bit
for bit against the C backend: every action's packing pass, decoding and screen, the group send and decode of the
batched step, and whole compressor steps. The GPU itself runs the same checks in ``tests/test_cuda_kernels.py``."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import safebits_hvd as sb
from safebits_hvd.codec import actions as A
from safebits_hvd.codec import kernels as K
from safebits_hvd.codec import rng
from safebits_hvd.codec.kernels import cuda, cuda_emulator
from safebits_hvd.codec.wire import WireFormatError
from safebits_hvd.policy.budget import BudgetPolicy
from safebits_hvd.policy.screen import ScreenRule

from .helpers import random_grads
from .kernel_cases import bits, make
from .test_group_kernels import MENU

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler for the CUDA emulation")

KEY = rng.stream_key(5, 9, 2)
ACTIONS = list(A.ACTIONS.values())
ODD_ACTIONS = [A.qsgd(3, bucket_size=100), A.ternary(bucket_size=7), A.topk(0.3, bucket_size=10),
               A.scaled_sign(bucket_size=13), A.qsgd(16, stochastic=False, bucket_size=77),
               A.lloyd_max(3, bucket_size=7), A.lloyd_max(16, bucket_size=3), A.lloyd_max(64, bucket_size=45)]
SIZES = [1, 7, 513, 1300]
GROUP_SIZES = np.array([0, 1, 7, 300, 512, 1000, 1300, 3, 2100], dtype=np.int64)
GROUP_M = len(GROUP_SIZES)


def _same_bits(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor) -> bool:
    """float64 statistics equal bit for bit: both backends sum them in one order (safebits_math.h,
    ``SB_STAT_PARTIALS``)."""
    a, b = np.ascontiguousarray(a, dtype=np.float64), np.ascontiguousarray(b, dtype=np.float64)
    return a.shape == b.shape and np.array_equal(a.view(np.int64), b.view(np.int64))


def _payload_like(nbytes: int, header: torch.Tensor) -> torch.Tensor:
    payload = torch.zeros(-(-nbytes // 16) * 16, dtype=torch.uint8)[:nbytes]
    payload[:16] = header
    return payload


CASES = [(n, action) for n in SIZES for action in ACTIONS + ODD_ACTIONS] + [
    # buckets longer than the kernels' shared scratch (2,048 float terms): the lane sums go chunk by chunk
    (9100, A.lloyd_max(8, bucket_size=4500)), (5100, A.lloyd_max(3, bucket_size=2500)),
    (7000, A.topk(0.05, bucket_size=3000)), (7000, A.scaled_sign(bucket_size=3000))]


@pytest.mark.parametrize(("n", "action"), CASES, ids=lambda x: x.name + f"/{x.bucket_size}" if isinstance(
    x, A.Action) else str(x))
def test_every_action_packs_decodes_and_quantizes_as_the_c_backend(n: int, action: A.Action) -> None:
    g, e = make(n)
    e_c, sent_c, out_c = e.clone(), torch.empty(n), torch.empty(n)
    payload_c, stats_c = K.quantize_pack_ef(g, e_c, action, KEY, into=sent_c)
    q_stats_c = K.quantize_ef(g, e.clone(), out_c, action, KEY)
    decoded_c = K.decode_add(payload_c, torch.ones(n), divisor=3.0)
    with cuda_emulator.emulated():
        e_u, sent_u = e.clone(), torch.empty(n)
        payload_u = _payload_like(payload_c.numel(), payload_c[:16])
        stats_u = cuda.quantize_pack_ef(g, e_u, payload_u, action, KEY, sent_u)
        out_u, e_q = torch.empty(n), e.clone()
        q_stats_u = cuda.quantize_ef(g, e_q, out_u, action, KEY)
        decoded_u = torch.ones(n)
        header = sb.codec.wire.parse_header(payload_c)
        cuda.decode(payload_u, header, decoded_u, True, "t", 3.0)
        values_u = torch.empty(n)
        cuda.decode(payload_u, header, values_u, False, "t")
    assert torch.equal(payload_u, payload_c)
    assert torch.equal(bits(e_u), bits(e_c)) and torch.equal(bits(e_q), bits(e_c))
    assert torch.equal(bits(sent_u), bits(sent_c)) and torch.equal(bits(out_u), bits(out_c))
    assert torch.equal(bits(values_u), bits(out_c))
    assert torch.equal(bits(decoded_u), bits(decoded_c))
    assert _same_bits(stats_u, stats_c) and _same_bits(q_stats_u, q_stats_c)


@pytest.mark.parametrize("n", [513, 1300])
def test_the_screen_measures_every_action_as_the_c_backend(n: int) -> None:
    g, e = make(n, seed=1)
    for buckets in (None, torch.tensor([0, -(-n // 512) - 1])):
        want = K.screen(g, e, A.DEFAULT_MENU, KEY, buckets)
        with cuda_emulator.emulated():
            got = cuda.screen(g, e, A.DEFAULT_MENU, KEY, buckets)
        assert _same_bits(got, want)


def _send(request: K.PackRequest, tables: K.GroupTables, emulated: bool) -> K.PackResult:
    if not emulated:
        return K.pack_group(request, tables)
    with cuda_emulator.emulated(), recycled_memory():
        return cuda.pack_group(request, tables)


@contextlib.contextmanager
def recycled_memory() -> Iterator[None]:
    """``torch.empty`` returns memory full of 0xFF bytes (NaN as float64, -1 as integers), as a GPU's recycled
    memory may be: a kernel that reads a word nobody wrote then gives other results than the C backend."""
    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = real(*args, **kwargs)
        if t.is_contiguous() and t.numel():
            t.view(torch.uint8).fill_(0xFF)
        return t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


@pytest.mark.parametrize("output", list(K.GroupOutput), ids=lambda o: o.name)
@pytest.mark.parametrize("thresholds", [(0.5, 0.7), (0.02, 0.97)], ids=["loose", "tight"])
@pytest.mark.parametrize("nan_member", [None, 5])
def test_the_group_send_is_the_c_backends(output: K.GroupOutput, thresholds: tuple[float, float],
                                         nan_member: int | None) -> None:
    """One batched send (NaN/Inf check, screen, choice and layout, staging, packing, gather) through the CUDA
    backend's orchestration and kernels: payloads, residuals, q and choices bitwise the C backend's; the float64
    sums equal to rounding (their summation orders differ, docs/DESIGN.md)."""
    max_distortion, min_cosine = thresholds
    tables = K.GroupTables(MENU, GROUP_SIZES, BudgetPolicy(MENU, GROUP_SIZES, max_distortion, min_cosine).cost_order)
    allocated = np.random.RandomState(3).randint(0, len(MENU), GROUP_M)
    results = []
    for emulated in (False, True):
        gradients, residuals, keys = group_case_sized(11, nan_member)
        samples = [None if -(-int(n) // MENU.bucket_size) <= 2 else torch.tensor([0, 2]) for n in GROUP_SIZES]
        sents = [torch.full_like(g, 5.0) for g in gradients]
        result = _send(K.PackRequest(np.arange(GROUP_M), gradients, residuals, sents, samples, keys, allocated,
                                   True, True, True, ScreenRule(max_distortion, min_cosine), output), tables, emulated)
        results.append((result, residuals, sents))
    (want, want_e, want_q), (got, got_e, got_q) = results
    assert np.array_equal(got.finite, want.finite) and np.array_equal(got.chosen, want.chosen)
    assert np.array_equal(got.offsets, want.offsets) and torch.equal(got.buffer, want.buffer)
    assert _same_bits(got.screen_stats, want.screen_stats) and _same_bits(got.stats, want.stats)
    for k in range(GROUP_M):
        assert torch.equal(bits(got_e[k]), bits(want_e[k])), k
        assert torch.equal(bits(got_q[k]), bits(want_q[k])), k


def test_a_group_of_empty_members_sends_the_allocated_actions() -> None:
    """No member has an element: nothing is screened, and the choice is the allocation's (the C backend's), not
    what uninitialized sums would say."""
    sizes = np.array([0, 0, 0], dtype=np.int64)
    tables = K.GroupTables(MENU, sizes, BudgetPolicy(MENU, sizes, 0.5, 0.7).cost_order)
    allocated = np.array([0, 3, len(MENU) - 1])
    results = []
    for emulated in (False, True):
        empty = [torch.empty(0) for _ in sizes]
        request = K.PackRequest(np.arange(3), empty, [torch.empty(0) for _ in sizes], [None] * 3, [None] * 3,
                              np.arange(3, dtype=np.uint32), allocated, True, True, True, ScreenRule(0.5, 0.7))
        results.append(_send(request, tables, emulated))
    assert np.array_equal(results[1].chosen, results[0].chosen) and np.array_equal(results[0].chosen, allocated)
    assert np.array_equal(results[1].offsets, results[0].offsets) and torch.equal(results[1].buffer,
                                                                                   results[0].buffer)


def group_case_sized(seed: int, nan_member: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor], np.ndarray]:
    """Gradients, residuals and keys of a group at this file's sizes (small: the emulation is slow)."""
    gradients, residuals = zip(*(make(int(n), seed + k) for k, n in enumerate(GROUP_SIZES)), strict=True)
    gradients = [g.clone() for g in gradients]
    if nan_member is not None:
        gradients[nan_member][3] = float("nan")
    keys = np.array([rng.stream_key(seed, 1, k) for k in range(GROUP_M)], dtype=np.uint32)
    return gradients, [e.clone() for e in residuals], keys


@pytest.mark.parametrize("ranks", [1, 3])
def test_the_group_decode_is_the_c_backends_and_names_an_invalid_topk_payload(ranks: int) -> None:
    """Every member's payloads from every rank (misaligned, as slices of a gathered buffer), summed in rank order
    with a divisor, some members starting from this rank's own values: bitwise the C backend's sum."""
    tables = K.GroupTables(MENU, GROUP_SIZES, BudgetPolicy(MENU, GROUP_SIZES, 0.5, 0.7).cost_order)
    actions = np.random.RandomState(ranks).randint(0, len(MENU), (GROUP_M, ranks))
    actions[:GROUP_M, 0] = np.arange(GROUP_M) % len(MENU)
    payloads, values = [], []
    for k, n in enumerate(GROUP_SIZES):
        member, member_values = [], []
        for r in range(ranks):
            g, e = make(int(n), 10 * k + r)
            sent = torch.empty(int(n))
            payload, _ = K.quantize_pack_ef(g, e, MENU[int(actions[k, r])], 7, into=sent)
            member.append(torch.cat([torch.zeros(1 + r, dtype=torch.uint8), payload])[1 + r:])
            member_values.append(sent)
        payloads.append(member)
        values.append(member_values)
    own = np.array([(k % (ranks + 1)) - 1 for k in range(GROUP_M)])
    names = [f"t{k}" for k in range(GROUP_M)]
    outs = []
    for emulated in (False, True):
        out = [values[k][own[k]].clone() if own[k] >= 0 else torch.full((int(n),), 7.0)
               for k, n in enumerate(GROUP_SIZES)]
        context = cuda_emulator.as_backend() if emulated else _nothing()
        with context, recycled_memory() if emulated else _nothing():
            K.decode_group(payloads, actions, out, own, tables, np.arange(GROUP_M), names, 3.0)
        outs.append(out)
    for k in range(GROUP_M):
        assert torch.equal(bits(outs[1][k]), bits(outs[0][k])), k
    topk = next(a for a, action in enumerate(MENU) if action.kind == A.ActionKind.TOPK)
    k = int(np.flatnonzero(GROUP_SIZES == 2100)[0])
    bad = K.quantize_pack_ef(*make(2100), MENU[topk], 1)[0]
    bad[-1] = 255                                          # local indices out of order
    payloads[k][-1], actions[k, -1] = bad, topk
    with cuda_emulator.as_backend(), pytest.raises(WireFormatError, match=rf"t{k} \(rank {ranks - 1}\)"):
        K.decode_group(payloads, actions, [torch.empty(int(n)) for n in GROUP_SIZES], np.full(GROUP_M, -1), tables,
                       np.arange(GROUP_M), names)


@pytest.mark.parametrize("escalated", [0, 3, 40])
def test_a_gathered_group_is_located_and_decoded_on_the_device_and_what_is_wrong_named_at_close(
        escalated: int) -> None:
    """``receive_group`` on the device (the locate and decode kernels, no read back) against the host's: with any
    number of payloads escalated, the same sums bitwise; with a corrupt header, a buffer cut short or too long, or
    invalid top-k indices, nothing decoded (top-k: the step fails) and, from the verdict read at the step's
    close, the very error the host raises when it decodes."""
    from .test_collectives import _gathered_group

    menu = sb.DEFAULT_MENU
    gen = np.random.default_rng(escalated)
    sizes = [int(n) for n in gen.integers(1, 1500, 30)]
    tables = K.GroupTables(menu, np.array(sizes), BudgetPolicy(menu, np.array(sizes), 0.5, 0.7).cost_order)
    topk = next(a for a, action in enumerate(menu) if action.kind == A.ActionKind.TOPK)
    expected = gen.integers(0, len(menu), len(sizes))
    expected[7] = topk
    sent = np.repeat(expected[:, None], 2, axis=1)
    slots = gen.choice(np.flatnonzero(np.arange(sent.size) // 2 != 7), escalated, replace=False)
    sent.reshape(-1)[slots] = (sent.reshape(-1)[slots] + gen.integers(1, len(menu), escalated)) % len(menu)
    gathered, offsets = _gathered_group(sizes, sent, escalated)
    rows = np.repeat(np.arange(len(sizes))[:, None], 2, axis=1)
    names, own = [f"t{k}" for k in range(len(sizes))], np.array([k % 3 - 1 for k in range(len(sizes))])

    def receive(buffer: torch.Tensor, emulated: bool) -> tuple[list[torch.Tensor], torch.Tensor, bool]:
        outs = [torch.full((n,), 7.0) for n in sizes]
        verdict = torch.full((2,), K.NO_ERROR, dtype=torch.int32)
        with cuda_emulator.as_backend() if emulated else _nothing():
            deferred = K.receive_group(buffer, rows, expected, outs, own, tables, names, "group 0", 2.0, verdict)
        return outs, verdict, deferred

    (on_host, _, deferred), (on_device, verdict, deferred_there) = receive(gathered, False), receive(gathered, True)
    assert not deferred and deferred_there and np.all(verdict.numpy() == K.NO_ERROR)
    for k, (a, b) in enumerate(zip(on_host, on_device, strict=True)):
        assert torch.equal(bits(a), bits(b)), k
    header = gathered.clone()
    header[int(offsets[21, 1]) + 3] ^= 0x40
    topk_codes = gathered.clone()
    topk_codes[int(offsets[7, 1] + tables.payload_bytes[7, topk]) - 1] = 255    # local indices out of order
    for name, buffer in {"header": header, "cut short": gathered[:-1], "too long": torch.cat([gathered, gathered[:5]]),
                         "top-k": topk_codes}.items():
        with pytest.raises(WireFormatError) as when_decoded:
            receive(buffer, False)
        outs, verdict, _ = receive(buffer, True)
        found = verdict.numpy()
        assert np.any(found != K.NO_ERROR), name
        if found[0] != K.NO_ERROR:
            assert all(torch.all(out == 7.0) for out in outs), name        # not located: nothing decoded
        with pytest.raises(WireFormatError) as at_close:
            K.raise_received_error(found, buffer, rows, expected, tables, names, "group 0")
        assert str(at_close.value) == str(when_decoded.value), name


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("collective", ["allgather", "dense", "two_phase"])
def test_a_compressor_step_through_the_cuda_backend_is_the_c_backends(collective: str) -> None:
    """The whole step (Horovod's order, one process) with every kernel on the emulated CUDA backend: what
    ``decompress`` returns is bitwise what the C backend's step returns, with the same actions."""
    sizes = (272, 16, 1300, 3, 600)
    results = []
    for emulated in (False, True):
        params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
        compressor = sb.SafeBits(params, budget_bits=3.0, collective=collective)
        steps = []
        context = cuda_emulator.as_backend() if emulated else _nothing()
        with context, recycled_memory() if emulated else _nothing():
            for step in range(3):
                random_grads(params, step)
                pending = [compressor.compress(p.grad) for _, p in reversed(params)]
                received = [compressor.decompress(out, ctx).clone() for out, ctx in pending]
                steps.append((received, compressor.last_step.actions))
        results.append(steps)
    for step, ((want, want_actions), (got, got_actions)) in enumerate(zip(*results, strict=True)):
        assert got_actions == want_actions, step
        for k, (a, b) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(bits(a.contiguous()), bits(b.contiguous())), (step, k)
