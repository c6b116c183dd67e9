"""Budget schedules: values, validation, and that SafeBits reads them per step."""

import pytest
import torch

import safebits_hvd as sb

from .helpers import many_tensor_params, run_steps


def test_constant_and_ramp() -> None:
    assert sb.Constant(3.0)(0) == sb.Constant(3.0)(10**6) == 3.0
    ramp = sb.ConvergenceRamp(2.0, 8.0, ramp_steps=10)
    assert ramp(0) == 2.0 and ramp(5) == pytest.approx(5.0) and ramp(10) == ramp(1000) == 8.0
    cosine = sb.ConvergenceRamp(2.0, 8.0, ramp_steps=10, shape="cosine")
    assert cosine(0) == 2.0 and cosine(5) == pytest.approx(5.0) and cosine(10) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="ramp_steps"):
        sb.ConvergenceRamp(2.0, 8.0, ramp_steps=0)


def test_bandwidth_aware_reads_a_number_or_a_callback() -> None:
    fixed = sb.BandwidthAware(bandwidth_bits_per_s=1e9, target_seconds=0.004, num_parameters=1_000_000)
    assert fixed(0) == pytest.approx(4.0)
    measured = iter([1e9, 5e8, 1e12])
    live = sb.BandwidthAware(lambda: next(measured), target_seconds=0.004, num_parameters=1_000_000)
    assert [live(0), live(1), live(2)] == [pytest.approx(4.0), pytest.approx(2.0), 32.0]   # clamped
    broken = sb.BandwidthAware(lambda: -1.0, target_seconds=1.0, num_parameters=10)
    with pytest.raises(ValueError, match="bandwidth"):
        broken(0)


def test_snr_aware_observes_records_and_moves_bits() -> None:
    schedule = sb.SNRAware(min_bits=2.0, max_bits=8.0, initial_bits=4.0, target_cosine=0.9, smoothing=0.0)
    assert schedule(0) == 4.0
    record = sb.StepRecord(0, 1.0, 1, 32.0, False, 0.0, [], {}, {}, {"a": 0.99, "b": 0.99}, "0" * 16)
    schedule.observe(record)
    high_cos_bits = schedule(1)
    record.cosine = {"a": 0.5, "b": 0.5}
    schedule.observe(record)
    assert schedule(2) > high_cos_bits
    restored = sb.SNRAware(smoothing=0.0)
    restored.load_state_dict(schedule.state_dict())
    assert restored.mean_cosine == schedule.mean_cosine


def test_safebits_reads_the_schedule_each_step() -> None:
    params = many_tensor_params()
    schedule = sb.ConvergenceRamp(1.0, 9.0, ramp_steps=4)
    c = sb.SafeBits(params, budget_bits=schedule)
    run_steps(c, params, 5)
    total = sum(p.numel() for _, p in params)
    assert [r.budget_bits_total for r in c.history] == [pytest.approx(schedule(s) * total) for s in range(5)]


def test_snr_schedule_inside_safebits_is_checkpointed() -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params, budget_bits=sb.SNRAware())
    run_steps(c, params, 3)
    state = c.state_dict()
    assert state["schedule"]["mean_cosine"] is not None
    fresh = sb.SafeBits(params, budget_bits=sb.SNRAware())
    fresh.load_state_dict(state)
    assert fresh.schedule.mean_cosine == c.schedule.mean_cosine
    assert isinstance(state["residuals"]["p0"], torch.Tensor)
