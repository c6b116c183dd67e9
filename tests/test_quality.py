"""``auto``'s quality rule (issue 56): the gradient's sampling noise measured across ranks, the compression error of
each budget, and the budgets :class:`~safebits_hvd.policy.quality.QualityGate` lets ``auto`` choose."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import safebits_hvd as sb
from safebits_hvd.codec import host
from safebits_hvd.policy.auto import AUTO_COLD, AUTO_FIRST_PROBE_BITS, PASS_THROUGH_BITS, Auto
from safebits_hvd.policy.quality import (
    ERROR_TO_NOISE,
    Noise,
    NoiseMeter,
    QualityGate,
    noise_values,
    sampling_noise,
)

from .helpers import many_tensor_params, random_grads
from .test_auto import simulated_timing
from .test_compressor import PairExchange

SLOW_LINK = 12.5e6      # bytes per second (100 Mbit/s): in simulated_timing the fewest bits make the fastest step


def test_the_noise_meter_publishes_a_measured_steps_norms_at_the_next_steps_end() -> None:
    meter = NoiseMeter(every=2)
    a, b = torch.arange(5.0), torch.ones(3, 4)
    meter.begin(0)
    meter.local([a])
    meter.local([b])
    meter.reduced([a, b])
    b.mul_(2)                                            # the reduced values are read at the step's end
    assert meter.publish() is None                       # the step's sums are on their way, none before them
    meter.begin(1)                                       # not measured: one step in two
    meter.local([a])
    meter.reduced([a])
    step, sums = meter.publish()
    assert step == 0
    np.testing.assert_allclose(sums, [30.0 + 12.0, 30.0 + 48.0])
    assert meter.publish() is None
    meter.begin(2)
    meter.local([a])
    meter.reduced([a])
    meter.reset()                                        # an aborted step: nothing of it
    assert meter.publish() is None
    idle = NoiseMeter(active=False)
    idle.begin(0)
    idle.local([a])
    idle.reduced([a])
    assert idle.publish() is None and idle.publish() is None


def test_the_sampling_noise_of_two_ranks_is_the_spread_of_their_gradients() -> None:
    g1, g2 = np.array([3.0, 1.0, 0.0]), np.array([1.0, -1.0, 2.0])
    mean = (g1 + g2) / 2

    def field(reduced_norm2: float) -> np.ndarray:
        one, two = noise_values(np.array([g1 @ g1, reduced_norm2])), noise_values(np.array([g2 @ g2, reduced_norm2]))
        return np.maximum(one, two)

    expected = float((g1 - g2) @ (g1 - g2)) / 4           # (M - G) / (P - 1) at two ranks
    noise = sampling_noise(field(mean @ mean), 2, 0.0)
    assert noise.sampling == pytest.approx(expected) and noise.local_norm2 == pytest.approx((g1 @ g1 + g2 @ g2) / 2)
    # Horovod's op=Sum hands back the sum: a reduced norm above every rank's is no mean, divided by P².
    assert sampling_noise(field((g1 + g2) @ (g1 + g2)), 2, 0.0).sampling == pytest.approx(expected)
    # The compression error the step added to the decoded mean is taken off its norm.
    assert sampling_noise(field(mean @ mean + 0.5), 2, 0.5).sampling == pytest.approx(expected)
    assert math.isnan(sampling_noise(field(mean @ mean), 1, 0.0).sampling)        # one rank: no spread
    assert math.isnan(sampling_noise(np.full(3, -math.inf), 2, 0.0).sampling)     # nothing measured


def _two_ranks(steps: int, budget_bits: object = "auto") -> list[list[sb.StepRecord]]:
    """Two SafeBits in one process as two ranks (PairExchange), each rank's gradients its own, and each handed back
    the true mean over both (as Horovod's allreduce would); returns both ranks' records."""
    exchange = PairExchange()
    ranks = []
    for _ in range(2):
        params = many_tensor_params()
        ranks.append((sb.SafeBits(params, budget_bits=budget_bits, exchange=exchange), params))
    for step in range(steps):
        sent = []
        for rank, (c, params) in enumerate(ranks):
            random_grads(params, step, seed=rank + 1)
            sent.append([c.compress(p.grad) for _, p in reversed(params)])
        for k in range(len(sent[0])):
            mean = (sent[0][k][0] + sent[1][k][0]) / 2
            for rank, (c, _) in enumerate(ranks):
                c.decompress(mean.clone(), sent[rank][k][1])
    return [c.history for c, _ in ranks]


def test_ranks_whose_gradients_differ_agree_on_the_noise_and_choose_alike() -> None:
    """The noise of one step in four (published with the next one's statistics) is the spread of the two ranks' own
    gradients, the same on both ranks, whose budgets and allocation digests agree every step."""
    a, b = _two_ranks(10)
    for ra, rb in zip(a, b, strict=True):
        assert ra.budget_bits_total == rb.budget_bits_total and ra.allocation_digest == rb.allocation_digest
        assert ra.noise_step == rb.noise_step
    assert [r.noise_step for r in a] == [-1, 0, -1, -1, -1, 4, -1, -1, -1, 8]
    for step in (1, 5, 9):
        ra, rb = a[step], b[step]
        assert ra.gradient_noise == rb.gradient_noise
        g1, g2 = ([], [])
        for seed, out in ((1, g1), (2, g2)):
            params = many_tensor_params()
            random_grads(params, step - 1, seed=seed)
            out.extend(p.grad.reshape(-1) for _, p in params)
        spread = sum(float(((x - y) ** 2).sum()) for x, y in zip(g1, g2, strict=True)) / 4
        # The decoded mean carries residuals (a pass-through flushes them once), whose cross terms with the mean
        # move G a little: least after the one 8-bit step that starts the run.
        assert ra.gradient_noise == pytest.approx(spread, rel=1e-3 if step == 1 else 2e-2)
    assert not a[0].pass_through and any(r.pass_through for r in a)      # the first probe (8 bits), then others
    assert math.isnan(a[0].gradient_noise) and math.isnan(a[2].gradient_noise)


def test_a_fixed_budget_measures_no_noise_but_records_its_error() -> None:
    a, _ = _two_ranks(3, budget_bits=2.0)
    assert all(r.noise_step == -1 and math.isnan(r.gradient_noise) and not r.budget_errors for r in a)
    assert all(r.compression_error > 0 for r in a)


def _relative_errors(scale: float) -> dict[float, float]:
    """ε² / M of each compressed budget, falling 4x a bit as quantization error does, times ``scale``."""
    return {bits: scale * 4.0 ** -bits for bits in (2.0, 3.0, 4.4, 6.0, 8.0, 16.0)}


def drive_with_quality(auto: Auto, steps: int, noise: float, errors: dict[float, float]) -> list[float]:
    """Run ``auto`` on the slow link of ``simulated_timing`` (fewest bits fastest), each step's telemetry and its
    quality figures arriving before the next budget is chosen, as SafeBits delivers them: ``noise`` is σ² / M, and
    a compressed step's screen predicts ``errors`` (ε² / M per budget; M = 1)."""
    chosen: list[float] = []
    for step in range(steps):
        if step >= 1:
            bits = chosen[step - 1]
            auto.observe_timing(step - 1, simulated_timing(bits, SLOW_LINK))
            measured = Noise(1.0, 1.0 - noise, noise) if step >= 2 else Noise(math.nan, math.nan, math.nan)
            auto.observe_quality(step - 1, measured, errors if bits < PASS_THROUGH_BITS else {})
        chosen.append(auto(step))
    return chosen


def test_noise_well_above_every_error_gets_the_fewest_bits() -> None:
    errors = _relative_errors(0.01)
    assert errors[2.0] / 0.5 < ERROR_TO_NOISE            # 2 bits add 0.1% of the noise
    chosen = drive_with_quality(Auto(), 60, noise=0.5, errors=errors)
    assert chosen[-20:].count(2.0) >= 18                  # a two-step probe every probe_every steps


@pytest.mark.parametrize(("error_to_noise", "fewest"),
                         [(0.2, 2.0), (0.1, 3.0), (0.01, 4.4), (1e-3, 6.0), (1e-4, 8.0), (1e-12, 32.0)])
def test_the_fewest_bits_whose_error_stays_within_kappa_of_the_noise(error_to_noise: float, fewest: float) -> None:
    """On a link where fewer bits are always faster, ``auto`` settles on the fewest bits the gate allows: ε²/σ² is
    0.125, 0.031, 0.0045, 0.0005, 0.00003 at 2, 3, 4.4, 6, 8 bits (noise 0.5); no compression when κ is below
    every one."""
    chosen = drive_with_quality(Auto(error_to_noise=error_to_noise), 80, noise=0.5, errors=_relative_errors(1.0))
    assert chosen[-20:].count(fewest) >= 19
    gate = QualityGate(error_to_noise)
    gate.observe(Noise(1.0, 0.5, 0.5), _relative_errors(1.0))
    assert [b for b in (2.0, 3.0, 4.4, 6.0, 8.0) if gate.allows(b)] == [b for b in (2.0, 3.0, 4.4, 6.0, 8.0)
                                                                       if b >= fewest]


def test_the_first_probe_runs_at_eight_bits_or_more_and_the_gate_decides_after_it() -> None:
    """No compressed step, no predicted error: the first probe runs at AUTO_FIRST_PROBE_BITS, not at the fewest
    bits (three 2-bit steps at steps 4-6 cost the demo's byte LM +0.014 bits per byte); its step predicts every budget's
    error, and then the gate lets the speed rule go down to 2 bits. Where no error comes (one rank), the bound
    lifts once the probe is measured."""
    chosen = drive_with_quality(Auto(), 40, noise=0.5, errors=_relative_errors(0.01))
    first = next(step for step, bits in enumerate(chosen) if bits < PASS_THROUGH_BITS)
    compressed_until_the_gate_knows = chosen[first:first + AUTO_COLD + 1]
    assert compressed_until_the_gate_knows == [AUTO_FIRST_PROBE_BITS] * (AUTO_COLD + 1), chosen
    assert chosen[-10:] == [2.0] * 10, chosen
    no_errors = drive_with_quality(Auto(), 40, noise=0.5, errors={})
    assert no_errors[first] == AUTO_FIRST_PROBE_BITS and no_errors[-10:] == [2.0] * 10, no_errors
    unknown = Noise(math.nan, math.nan, math.nan)
    for auto, before_the_probe in ((Auto(), [8.0, 16.0, 32.0]), (Auto(max_bits=4.4), [4.4])):
        assert auto.allowed() == auto.candidates          # no quality figures fed: the gate allows every budget
        auto.observe_quality(0, unknown, {})
        assert auto.allowed() == before_the_probe         # with max_bits 4.4 none reaches 8: the most bits there are
        restored = Auto(max_bits=auto.max_bits)
        restored.load_state_dict(json.loads(json.dumps(auto.state_dict())))
        assert restored.allowed() == before_the_probe     # a checkpoint taken before the probe keeps the bound


def test_error_above_the_noise_gets_more_bits_and_less_noise_more_still() -> None:
    quiet = drive_with_quality(Auto(), 80, noise=0.5, errors=_relative_errors(1.0))
    quieter = drive_with_quality(Auto(), 80, noise=0.05, errors=_relative_errors(1.0))
    assert min(quiet[-20:]) == 4.4 and min(quieter[-20:]) == 6.0


def test_the_gate_takes_medians_and_is_checkpointed() -> None:
    gate = QualityGate(0.01)
    for noise in (0.5, 0.5, 0.001, 0.5, 0.5):           # one step's outlier moves nothing
        gate.observe(Noise(1.0, 1.0 - noise, noise), {4.4: 0.004})
    assert gate.noise == 0.5 and gate.ratio(4.4) == pytest.approx(0.008) and gate.allows(4.4)
    gate.observe(Noise(1.0, 0.9, 0.1), {4.4: 0.004})
    gate.observe(Noise(1.0, 0.9, 0.1), {4.4: 0.004})     # three of seven at 0.1: the median is still 0.5
    assert gate.allows(4.4)
    for _ in range(2):
        gate.observe(Noise(1.0, 0.9, 0.1), {4.4: 0.004})
    assert gate.noise == 0.1 and not gate.allows(4.4)     # the noise fell for good: 4.4 bits add 4% of it
    again = QualityGate(0.01)
    again.load_state_dict(json.loads(json.dumps(gate.state_dict())))
    assert again.state_dict() == gate.state_dict() and again.ratio(4.4) == gate.ratio(4.4)
    with pytest.raises(ValueError, match="error_to_noise"):
        QualityGate(0.0)
    with pytest.raises(ValueError, match="error_to_noise"):
        Auto(error_to_noise=math.inf)


def test_measuring_the_noise_reads_nothing_back() -> None:
    """``auto`` held at 32 bits passes through, as 32 bits do: measuring the noise adds no read to those steps (it
    is copied to the host at a step's end and read at the next one's, :func:`safebits_hvd.codec.host.copy_to_host`)."""
    with host.counting() as fixed:
        _two_ranks(3, budget_bits=32.0)
    with host.counting() as auto:
        records = _two_ranks(3, budget_bits=sb.Auto(min_bits=32.0))      # one schedule, always 32: shared safely
    assert all(r.pass_through for r in records[0]) and auto.traffic.reads == fixed.traffic.reads
    assert records[0][1].noise_step == 0                                  # and the noise was measured
