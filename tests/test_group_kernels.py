"""The multi-tensor kernels (kernels.pack_group, kernels.decode_group) against the per-tensor kernels, bit for bit,
and the batched step's count of reads back to the host (safebits_hvd.codec.host)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import safebits_hvd as sb
from safebits_hvd.codec import host, kernels
from safebits_hvd.codec.actions import DEFAULT_MENU, make_menu
from safebits_hvd.codec.rng import stream_key
from safebits_hvd.codec.wire import WireFormatError
from safebits_hvd.comm import collectives
from safebits_hvd.policy.budget import BudgetPolicy
from safebits_hvd.policy.screen import ScreenRule

from .helpers import random_grads
from .kernel_cases import bits, make

SIZES = np.array([0, 1, 7, 300, 512, 1000, 5000, 70_000, 3, 40_000], dtype=np.int64)
MENU = make_menu(DEFAULT_MENU)


def group_case(allocated: np.ndarray, seed: int, nan_member: int | None = None):
    gradients, residuals = zip(*(make(int(n), seed + k) for k, n in enumerate(SIZES)), strict=True)
    gradients = [g.clone() for g in gradients]
    if nan_member is not None:
        gradients[nan_member][3] = float("nan")
    samples = [None if -(-int(n) // MENU.bucket_size) <= 4 else torch.tensor([0, 2, 3]) for n in SIZES]
    keys = np.array([stream_key(seed, 1, k) for k in range(len(SIZES))], dtype=np.uint32)
    return list(gradients), list(residuals), samples, keys, allocated


def per_tensor(gradients, residuals, samples, keys, allocated, tables, max_distortion, min_cosine):
    """What one call per tensor of the public per-tensor kernels gives."""
    out = []
    for k, (g, e) in enumerate(zip(gradients, residuals, strict=True)):
        if g.numel() and not bool(torch.isfinite(g).all()):
            out.append(None)
            continue
        screen_stats = kernels.screen(g, e, MENU, int(keys[k]), samples[k]).numpy()
        chosen = int(ScreenRule(max_distortion, min_cosine).first_candidates(
            screen_stats[None], allocated[k:k + 1], tables.cost_order[k:k + 1], tables.lossless)[0])
        sent = torch.empty_like(g)
        payload, stats = kernels.quantize_pack_ef(g, e, MENU[chosen], int(keys[k]), into=sent)
        out.append((screen_stats, chosen, payload, stats.numpy(), sent))
    return out


@pytest.mark.parametrize("thresholds", [(0.5, 0.7), (0.02, 0.97)])
@pytest.mark.parametrize("allocation", ["each action", "mixed", "nan"])
def test_pack_group_is_bitwise_the_per_tensor_kernels(thresholds: tuple[float, float], allocation: str) -> None:
    max_distortion, min_cosine = thresholds
    policy = BudgetPolicy(MENU, SIZES, max_distortion, min_cosine)
    tables = kernels.GroupTables(MENU, SIZES, policy.cost_order)
    cases = ([np.full(len(SIZES), a) for a in range(len(MENU))] if allocation == "each action"
             else [np.random.RandomState(s).randint(0, len(MENU), len(SIZES)) for s in range(4)])
    for seed, allocated in enumerate(cases):
        gradients, residuals, samples, keys, allocated = group_case(allocated, seed,
                                                                    5 if allocation == "nan" else None)
        expected_residuals = [e.clone() for e in residuals]
        expected = per_tensor(gradients, expected_residuals, samples, keys, allocated, tables, max_distortion,
                              min_cosine)
        sents = [torch.empty_like(g) for g in gradients]
        result = kernels.pack_group(kernels.PackRequest(np.arange(len(SIZES)), gradients, residuals, sents, samples,
                                                      keys, allocated, True, True, True,
                                                      ScreenRule(max_distortion, min_cosine)), tables)
        for k, want in enumerate(expected):
            if want is None:
                assert not result.finite[k] and result.chosen[k] == -1
                assert result.offsets[k + 1] == result.offsets[k]
                continue
            screen_stats, chosen, payload, stats, sent = want
            assert result.finite[k]
            assert np.array_equal(result.screen_stats[k], screen_stats)
            assert result.chosen[k] == chosen
            assert torch.equal(result.buffer[result.offsets[k]:result.offsets[k + 1]], payload)
            assert np.array_equal(result.stats[k], stats)
            assert torch.equal(bits(sents[k]), bits(sent))
        for got, want in zip(residuals, expected_residuals, strict=True):
            assert torch.equal(bits(got), bits(want))


def test_pack_group_without_screen_sends_the_allocated_actions() -> None:
    policy = BudgetPolicy(MENU, SIZES, 0.01, 0.99)
    tables = kernels.GroupTables(MENU, SIZES, policy.cost_order)
    gradients, residuals, samples, keys, allocated = group_case(np.full(len(SIZES), 4), 0)
    result = kernels.pack_group(kernels.PackRequest(np.arange(len(SIZES)), gradients, residuals,
                                                  [None] * len(SIZES), samples, keys, allocated, False, False, False,
                                                  ScreenRule(0.01, 0.99)), tables)
    assert (result.chosen == 4).all() and not result.screen_stats.any()


@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0])
def test_decode_group_is_bitwise_decode_then_decode_add_in_rank_order(divisor: float) -> None:
    policy = BudgetPolicy(MENU, SIZES, 0.5, 0.7)
    tables = kernels.GroupTables(MENU, SIZES, policy.cost_order)
    ranks = 3
    rng = np.random.RandomState(0)
    actions = rng.randint(0, len(MENU), (len(SIZES), ranks))
    payloads, values = [], []
    for k, n in enumerate(SIZES):
        member, member_values = [], []
        for r in range(ranks):
            g, e = make(int(n), 10 * k + r)
            sent = torch.empty_like(g)
            payload, _ = kernels.quantize_pack_ef(g, e, MENU[int(actions[k, r])], 7, into=sent)
            member.append(torch.cat([torch.zeros(1 + r, dtype=torch.uint8), payload])[1 + r:])   # misaligned
            member_values.append(sent)
        payloads.append(member)
        values.append(member_values)
    own = np.array([-1, 0, 1, -1, 0, 1, -1, 1, -1, 0])     # a rank's own values first: ranks 0 and 1 only
    outs = [values[k][own[k]].clone() if own[k] >= 0 else torch.full((int(n),), 7.0) for k, n in enumerate(SIZES)]
    kernels.decode_group(payloads, actions, outs, own, tables, np.arange(len(SIZES)),
                         [f"t{k}" for k in range(len(SIZES))], divisor)
    for k in range(len(SIZES)):
        want = kernels.decode(payloads[k][0])
        for r in range(1, ranks):
            kernels.decode_add(payloads[k][r], want, divisor=divisor if r == ranks - 1 else 1.0)
        assert torch.equal(bits(outs[k]), bits(want)), k


def test_decode_group_names_the_tensor_of_an_invalid_topk_payload() -> None:
    topk = next(a for a, action in enumerate(MENU) if action.kind == sb.codec.actions.ActionKind.TOPK)
    sizes = np.array([1000], dtype=np.int64)
    tables = kernels.GroupTables(MENU, sizes, BudgetPolicy(MENU, sizes, 0.5, 0.7).cost_order)
    g, e = make(1000)
    payload, _ = kernels.quantize_pack_ef(g, e, MENU[topk], 1)
    payload[-1] = 255                       # local indices out of order
    with pytest.raises(WireFormatError):
        kernels.decode(payload)
    with pytest.raises(WireFormatError, match=r"layer\.weight"):
        kernels.decode_group([[payload]], np.array([[topk]]), [torch.empty(1000)], np.array([-1]), tables,
                             np.array([0]), ["layer.weight"])


class TightGroup:
    """Every member of :data:`SIZES` under the tight screen (0.02, 0.97), its allocation drawn from
    ``allocation_seed``: the case of :func:`group_case`, the residuals as they were, and ``sents`` filled with 5.0
    (what a pass leaves unwritten stays 5.0)."""

    def __init__(self, allocation_seed: int, seed: int, nan_member: int | None) -> None:
        self.tables = kernels.GroupTables(MENU, SIZES, BudgetPolicy(MENU, SIZES, 0.02, 0.97).cost_order)
        allocated = np.random.RandomState(allocation_seed).randint(0, len(MENU), len(SIZES))
        self.gradients, self.residuals, self.samples, self.keys, self.allocated = group_case(allocated, seed,
                                                                                             nan_member)
        self.before = [e.clone() for e in self.residuals]
        self.sents: list[torch.Tensor | None] = [torch.full_like(g, 5.0) for g in self.gradients]

    def send(self, residuals: list[torch.Tensor], sents: list[torch.Tensor | None],
             output: kernels.GroupOutput = kernels.GroupOutput.PAYLOAD) -> kernels.PackResult:
        return kernels.pack_group(kernels.PackRequest(np.arange(len(SIZES)), self.gradients, residuals, sents,
                                                    self.samples, self.keys, self.allocated, True, True, True,
                                                    ScreenRule(0.02, 0.97), output), self.tables)


@pytest.mark.parametrize("nan_member", [None, 5])
def test_pack_group_without_packing_screens_and_chooses_alike_and_writes_nothing(nan_member: int | None) -> None:
    """``GroupOutput.SCREEN`` (the two-phase first hop's screen): the same verdicts, screen statistics and choices
    as the packing pass, and no payload, residual or ``q`` written."""
    group = TightGroup(3, 7, nan_member)
    residuals, sents = group.residuals, group.sents
    screened = group.send(residuals, sents, kernels.GroupOutput.SCREEN)
    assert screened.buffer.numel() == 0 and not screened.offsets.any() and not screened.stats.any()
    for got, want, sent in zip(residuals, group.before, sents, strict=True):
        assert torch.equal(bits(got), bits(want)) and bool((sent == 5.0).all())
    packed = group.send(residuals, sents)
    assert np.array_equal(screened.finite, packed.finite)
    assert np.array_equal(screened.chosen, packed.chosen)
    assert np.array_equal(screened.screen_stats, packed.screen_stats)


@pytest.mark.parametrize("nan_member", [None, 5])
def test_pack_group_of_values_is_bitwise_the_per_tensor_quantize_ef_and_writes_no_payload(
        nan_member: int | None) -> None:
    """``GroupOutput.VALUES`` (the dense path): each finite member's q, residual and statistics bitwise what
    :func:`kernels.quantize_ef` gives at the action the pass chose, the same choices as the packing pass, no
    payload; a non-finite member's tensors untouched."""
    group = TightGroup(4, 9, nan_member)
    residuals, sents, before = group.residuals, group.sents, group.before
    values = group.send(residuals, sents, kernels.GroupOutput.VALUES)
    assert values.buffer.numel() == 0 and not values.offsets.any()
    packed = group.send([e.clone() for e in before], [None] * len(SIZES))
    assert np.array_equal(values.chosen, packed.chosen) and np.array_equal(values.finite, packed.finite)
    for k, g in enumerate(group.gradients):
        if not values.finite[k]:
            assert torch.equal(bits(residuals[k]), bits(before[k])) and bool((sents[k] == 5.0).all())
            continue
        e, out = before[k].clone(), torch.empty_like(g)
        stats = kernels.quantize_ef(g, e, out, MENU[int(values.chosen[k])], int(group.keys[k])).numpy()
        assert np.array_equal(values.stats[k], stats), k
        assert torch.equal(bits(residuals[k]), bits(e)) and torch.equal(bits(sents[k]), bits(out)), k
    with pytest.raises(ValueError, match="VALUES"):
        group.send(residuals, [None] * len(SIZES), kernels.GroupOutput.VALUES)


def reads_in_a_step(compressor: sb.SafeBits, params: list, step: int) -> int:
    """Reads back to the host in one step of fresh gradients through compress and decompress, in Horovod's order
    (every compress, in backward's order, then every decompress)."""
    random_grads(params, step)
    before = host.reads()
    pending = [compressor.compress(p.grad) for _, p in reversed(params)]
    for _, ctx in pending:
        compressor.decompress(torch.ones(1), ctx)
    return host.reads() - before


def test_an_allgather_step_reads_back_at_most_twice_per_group_and_once_more() -> None:
    """G groups: one read back when each is sent, one when each is received, one for the step's reduced
    marker; a per-tensor read (a screen result, a header, a NaN check) would break the bound."""
    sizes = (272, 16) * 300
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    compressor = sb.SafeBits(params, budget_bits=4.0, collective="allgather")
    groups = len(collectives.fusion_groups(np.array(sizes)))
    assert groups < len(sizes) / 10
    for step in range(4):
        reads = reads_in_a_step(compressor, params, step)
        assert compressor.last_step.collective == "allgather"
        assert reads <= 2 * groups + 1, (step, reads, groups)


def test_a_two_phase_step_reads_back_a_fixed_number_of_times_whatever_its_tensor_count() -> None:
    """The two-phase path sends the whole step when it closes: one read back for every tensor's check, screen and
    choice, one for the packing of every segment, one per escalation round (at most one per rung of the menu); its
    second hop one to locate the owned payloads, one for their re-encoding, one to locate the owners' payloads; and
    the step's reduced marker. Per-tensor kernels read back at least three times per tensor."""
    sizes = (272, 16) * 300
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    compressor = sb.SafeBits(params, budget_bits=4.0, collective="two_phase")
    for step in range(4):
        reads = reads_in_a_step(compressor, params, step)
        assert compressor.last_step.collective == "two_phase"
        assert reads <= 2 + 3 + 1 + len(sb.DEFAULT_MENU), (step, reads)


def test_the_dense_path_reads_back_once_per_tensor_and_once_per_group_alike() -> None:
    """The dense path (Horovod all-reduces the values ``compress`` returns): one read back per tensor, the screen,
    choice and statistics of a group of one together; a front end's group (the DDP hook's bucket, through
    ``SafeBitsCore.send_group``) one read back in all, its values bitwise those of one ``compress`` per tensor, its
    records the same. With NaN in one gradient (``nonfinite="skip"``: that tensor sends zeros)."""
    sizes = (272, 16, 0, 5000) * 25
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    per_tensor = sb.SafeBits(params, budget_bits=3.0, collective="dense", nonfinite="skip", name="dense.a")
    grouped = sb.SafeBits(params, budget_bits=3.0, collective="dense", nonfinite="skip", name="dense.b")
    order = list(reversed(range(len(sizes))))          # backward's order
    for step in range(4):
        random_grads(params, step)
        params[7][1].grad[3] = float("nan") if step == 2 else params[7][1].grad[3]
        grads = [params[i][1].grad.clone() for i in order]
        before = host.reads()
        sent = [per_tensor.compress(params[i][1].grad)[0].clone() for i in order]
        assert host.reads() - before <= len(sizes)
        outs = [g.clone() for g in grads]
        before = host.reads()
        grouped.core.send_group(order, grads, outs)
        assert host.reads() - before == 1
        for k, (want, got) in enumerate(zip(sent, outs, strict=True)):
            assert torch.equal(want.view(torch.int32), got.view(torch.int32)), (step, k)
        a, b = per_tensor.last_step, grouped.last_step
        assert a.collective == b.collective == "dense" and a.actions == b.actions
        assert a.escalations == b.escalations and a.modeled_bits_total == b.modeled_bits_total
        assert a.nonfinite == b.nonfinite and (step != 2 or a.nonfinite)


def test_members_that_escalate_together_cost_one_read_back_per_round_not_per_member() -> None:
    """Every tensor's gradient gets one huge element in a bucket the screen's one-bucket sample mostly misses: the
    sampled estimate passes, the exact statistics of what was sent fail, and the group re-encodes its failures in
    batched rounds, one read back each (at most one round per rung of the menu), where a per-member loop would read
    back once per escalating tensor and round."""
    sizes = (4096,) * 200
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    compressor = sb.SafeBits(params, budget_bits=2.0, collective="allgather", sample_buckets=1)
    groups = len(collectives.fusion_groups(np.array(sizes)))
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        for i, (_, p) in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen)
            if step == 5:
                p.grad[(i * 517) % 4096] = 1e3
        before = host.reads()
        pending = [compressor.compress(p.grad) for _, p in reversed(params)]
        for _, ctx in pending:
            compressor.decompress(torch.ones(1), ctx)
    assert len(compressor.last_step.escalations) == len(sizes)
    assert host.reads() - before <= 2 * groups + 1 + groups * len(sb.DEFAULT_MENU) < 2 * len(sizes)


def test_stream_keys_are_stream_key_of_each_tensor() -> None:
    """The batched step's keys (one NumPy pass per group) are the per-tensor path's keys, wrap-around included."""
    from safebits_hvd.codec import rng

    indices = np.arange(3000, dtype=np.int64)
    for seed, step in ((0, 0), (7, 123), (2**33 + 5, 2**40 + 3)):
        expected = np.array([rng.stream_key(seed, step, int(i)) for i in indices], dtype=np.uint32)
        assert np.array_equal(rng.stream_keys(seed, step, indices), expected)
