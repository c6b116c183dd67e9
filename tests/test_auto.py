"""``budget_bits="auto"`` (issue 30): the decision rule on recorded telemetry, pass-through steps, and agreement
across ranks."""

from __future__ import annotations

import math

import pytest
import torch

import safebits_hvd as sb
from safebits_hvd.clock import TIMING_FIELDS
from safebits_hvd.schedules import PASS_THROUGH_BITS, Auto, as_schedule
from safebits_hvd.telemetry import StepRecord

from .helpers import many_tensor_params, random_grads
from .test_compressor import PairExchange

PARAMETERS = 10_000_000


def simulated_timing(bits: float, bytes_per_s: float) -> dict[str, float]:
    """A step of a model of 10M parameters whose backward takes 100 ms: SafeBits' own work costs 25 ms when it
    compresses (nothing when it passes through), and its bytes cross the link while backward runs."""
    backward, send, receive = 0.100, 0.020 if bits < PASS_THROUGH_BITS else 0.0, 0.005 if bits < 32 else 0.0
    wire = PARAMETERS * bits / 8
    link = wire / bytes_per_s
    span = max(backward + send, link) + receive
    return {"backward_s": backward + send, "send_s": send, "receive_s": receive,
            "exposed_s": max(0.0, link - backward - send), "link_s": link, "wire_bytes": wire, "span_s": span}


def drive(auto: Auto, rate_at, steps: int) -> list[float]:
    """Run ``auto`` for ``steps`` steps against :func:`simulated_timing` at link rate ``rate_at(step)`` (bytes/s),
    each step's telemetry arriving with the next step's record, as SafeBits delivers it."""
    chosen: list[float] = []
    for step in range(steps):
        bits = auto(step)
        chosen.append(bits)
        if step >= 1:
            timing = simulated_timing(chosen[step - 1], rate_at(step - 1))
            auto.observe(_record(step, timing, step - 1))
    return chosen


def _record(step: int, timing: dict[str, float], timing_step: int) -> StepRecord:
    return StepRecord(step=step, budget_bits_total=0.0, modeled_bits_total=0, modeled_compression_ratio=1.0,
                      violation=False, excess_bits=0.0, escalations=[], actions={}, distortion={}, cosine={},
                      allocation_digest="", timing=timing, timing_step=timing_step)


def test_a_fast_link_gets_no_compression() -> None:
    chosen = drive(Auto(), lambda step: 10e9, 60)          # 10 GB/s: even 32 bits hide behind backward
    assert chosen[0] == PASS_THROUGH_BITS                   # the costliest first, as PowerSGD's hook starts
    assert chosen[-20:].count(PASS_THROUGH_BITS) >= 18       # a two-step probe every probe_every steps


def test_a_slow_link_gets_the_most_bits_that_still_hide_communication() -> None:
    # 125 MB/s (1 Gbit/s): 32 bits take 320 ms on the link, 8 bits 80 ms, under backward's 120 ms with SafeBits
    chosen = drive(Auto(), lambda step: 125e6, 80)
    settled = chosen[-20:]
    assert settled.count(8.0) >= 19                          # 6 and below are no faster; 16 bits are exposed
    for bits in (32.0, 16.0, 8.0, 6.0):                      # that is the fastest, within the 3% tolerance
        assert simulated_timing(8.0, 125e6)["span_s"] <= simulated_timing(bits, 125e6)["span_s"] * 1.03


def test_a_link_that_changes_is_followed_within_twenty_steps() -> None:
    rates = {0: 10e9, 100: 12.5e6, 200: 125e6}              # unlimited -> 100 Mbit/s -> 1 Gbit/s

    def rate(step: int) -> float:
        return rates[max(s for s in rates if s <= step)]

    chosen = drive(Auto(), rate, 300)
    assert chosen[80:100].count(PASS_THROUGH_BITS) >= 18
    assert all(b <= 3.0 for b in chosen[120:200])           # settled within 20 steps of the change
    assert sum(b <= 2.0 for b in chosen[120:200]) >= 76     # 100 Mbit/s: 2 bits take 160 ms, 3 bits 240 ms
    assert chosen[220:300].count(8.0) >= 68                  # all but the two-step probes


def test_bounds_and_checkpoint() -> None:
    auto = Auto(min_bits=4.4, max_bits=8.0)
    assert auto.candidates == [4.4, 6.0, 8.0]
    chosen = drive(auto, lambda step: 10e9, 30)
    assert set(chosen) <= {4.4, 6.0, 8.0} and chosen[-1] == 8.0
    again = Auto(min_bits=4.4, max_bits=8.0)
    again.load_state_dict(auto.state_dict())
    assert [again(s) for s in range(30, 40)] == [auto(s) for s in range(30, 40)]
    with pytest.raises(ValueError, match="max_bits"):
        Auto(max_bits=64)
    with pytest.raises(TypeError, match="'auto'"):
        as_schedule("fast")
    assert isinstance(as_schedule("auto"), Auto)


def test_pass_through_sends_the_gradient_and_flushes_the_residual_once() -> None:
    params = many_tensor_params()
    budgets = iter([2.0, 2.0, 32.0, 32.0, 2.0])
    c = sb.SafeBits(params, budget_bits=lambda step: next(budgets))
    sums = {name: torch.zeros(p.numel(), dtype=torch.float64) for name, p in params}
    grads = {name: torch.zeros(p.numel(), dtype=torch.float64) for name, p in params}
    for step in range(5):
        random_grads(params, step)
        for name, p in reversed(params):
            grads[name] += p.grad.reshape(-1).double()
            g = p.grad.clone()
            sent, ctx = c.compress(p.grad)
            out = c.decompress(sent, ctx).reshape(-1)
            sums[name] += out.double()
            if step == 3:                                    # the second pass-through: the gradient itself
                assert torch.equal(out, g.reshape(-1))
        if step in (2, 3):
            assert c.last_step.pass_through and set(c.last_step.actions.values()) == {"fp32"}
            assert c.last_step.modeled_bits_total == 32 * sum(p.numel() for _, p in params)
        if step == 3:      # after the flush nothing is owed: every gradient so far arrived exactly
            for name, _ in params:
                assert torch.allclose(sums[name], grads[name], rtol=0, atol=1e-5 * float(grads[name].abs().max()))
    assert not c.last_step.pass_through                     # compressed again, from the start policy


def test_every_rank_chooses_alike_from_disagreeing_local_timings() -> None:
    """Two ranks in one process (PairExchange) measure different wall times (rank 1 sleeps in its backward), but
    decide from the MAX-reduced telemetry: the same budget every step, and the allocation digests agree (a
    disagreement would raise SafeBitsConsistencyError)."""
    import time

    exchange = PairExchange()
    ranks = []
    for _ in range(2):
        params = many_tensor_params()
        ranks.append((sb.SafeBits(params, budget_bits="auto", exchange=exchange), params))
    for step in range(12):
        for rank, (_, params) in enumerate(ranks):
            random_grads(params, step, seed=rank + 1)
        pending = []
        for rank, (c, params) in enumerate(ranks):
            for i, (_, p) in enumerate(reversed(params)):
                if rank == 1 and i == 3:
                    time.sleep(0.002 * (step % 3))
                pending.append((c, c.compress(p.grad)))
        for c, (sent, ctx) in pending:
            c.decompress(sent, ctx)
        a, b = (c.last_step for c, _ in ranks)
        assert a.budget_bits_total == b.budget_bits_total and a.allocation_digest == b.allocation_digest
        if step >= 1:
            assert a.timing == b.timing and a.timing_step == step - 1
            assert set(a.timing) == set(TIMING_FIELDS)
            assert all(math.isfinite(v) and v >= 0 for v in a.timing.values())
