"""Error feedback's residuals stored as bfloat16 (``residual_dtype=torch.bfloat16``): the same sends as float32
residuals rounded to bfloat16 after every step, bitwise, on every collective path; half the memory; checkpoints and
bad input."""

from __future__ import annotations

import pytest
import torch

import safebits_hvd as sb
from safebits_hvd.step.memory import ErrorFeedback

from .helpers import many_tensor_params, random_grads, run_steps
from .test_collectives import train


def round_residuals(c: sb.SafeBits) -> None:
    """Float32 residuals rounded to bfloat16 (and kept as float32): what bfloat16 storage should amount to."""
    for e in c.memory.residuals.values():
        e.copy_(e.bfloat16())


@pytest.mark.parametrize("collective,ranks", [("allgather", 2), ("two_phase", 3), ("dense", 1)])
def test_bfloat16_residuals_send_what_float32_ones_rounded_each_step_send(collective: str, ranks: int) -> None:
    steps = 6
    stored = train(collective, ranks, steps, residual_dtype=torch.bfloat16)
    rounded = train(collective, ranks, steps, after_step=round_residuals)
    escalated = 0
    for bf16_rank, f32_rank in zip(stored, rounded, strict=True):
        got, c_bf16 = bf16_rank["reduced"], bf16_rank["compressor"]
        want, c_f32 = f32_rank["reduced"], f32_rank["compressor"]
        for step in range(steps):
            for name, total in want[step].items():
                assert torch.equal(got[step][name], total), (collective, step, name)
        assert c_bf16.memory.residuals.keys() == c_f32.memory.residuals.keys()
        for name, e in c_f32.memory.residuals.items():
            kept = c_bf16.memory.residuals[name]
            assert kept.dtype == torch.bfloat16
            assert torch.equal(kept, e.bfloat16()), name
        assert c_bf16.memory.nbytes * 2 == c_f32.memory.nbytes > 0
        assert [r.actions for r in c_bf16.history] == [r.actions for r in c_f32.history]
        escalated += sum(len(r.escalations) for r in c_bf16.history)
    if collective != "dense":
        assert escalated, "no escalation: the staged residuals' restore (e <- e + q) went untested"


def test_bfloat16_residuals_lose_only_their_rounding() -> None:
    """Nothing is lost but the residual's rounding: over the steps, what was sent plus what is kept is what the
    gradients were, within half a bfloat16 unit of each step's residual."""
    params = many_tensor_params()
    c = sb.SafeBits(params, budget_bits=2.0, collective="dense", residual_dtype=torch.bfloat16)
    log = run_steps(c, params, 5, capture=True)
    for k, (name, _) in enumerate(reversed(params)):
        sent = sum(step[k][3].double().reshape(-1) for step in log)
        given = sum(step[k][1].double().reshape(-1) for step in log)
        kept = c.memory.residuals[name].double()
        # Each step rounds a residual no larger than max|v|: at most 2^-9 of it.
        bound = sum(step[k][2].abs().max().double() for step in log) * 2.0**-9 + 1e-5
        assert float((sent + kept - given).abs().max()) <= float(bound), name


def test_a_raise_leaves_bfloat16_residuals_bitwise_unchanged() -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params, budget_bits=2.0, nonfinite="raise", residual_dtype=torch.bfloat16)
    random_grads(params, 0)
    for _, p in reversed(params):
        c.decompress(*c.compress(p.grad))
    before = {name: e.clone() for name, e in c.memory.residuals.items()}
    random_grads(params, 1)
    params[3][1].grad[5] = float("nan")
    with pytest.raises(sb.SafeBitsNonFiniteError):
        for _, p in reversed(params):
            c.decompress(*c.compress(p.grad))
    for name in ("p3", "p2", "p1", "p0"):       # the one that raised, and those backward had not reached
        assert torch.equal(c.memory.residuals[name], before[name]), name


def test_bfloat16_residuals_round_trip_a_checkpoint_and_take_a_float32_one() -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params, budget_bits=2.0, residual_dtype=torch.bfloat16)
    for step in range(2):
        random_grads(params, step)
        for _, p in reversed(params):
            c.decompress(*c.compress(p.grad))
    state = c.state_dict()
    assert all(e.dtype == torch.bfloat16 for e in state["residuals"].values())
    again = sb.SafeBits(many_tensor_params(), budget_bits=2.0, residual_dtype=torch.bfloat16)
    again.load_state_dict(state)
    for name, e in c.memory.residuals.items():
        assert torch.equal(again.memory.residuals[name], e)
    as_float32 = sb.SafeBits(many_tensor_params(), budget_bits=2.0)
    as_float32.load_state_dict(state)            # a bfloat16 state read by float32 residuals: exact
    assert all(e.dtype == torch.float32 for e in as_float32.memory.residuals.values())
    memory = ErrorFeedback(torch.bfloat16)
    memory.load_state_dict({"w": torch.tensor([1.0 + 2.0**-12, -3.0])})     # float32 in: rounded to bfloat16
    assert memory.residuals["w"].dtype == torch.bfloat16 and memory.residuals["w"].tolist() == [1.0, -3.0]


def test_a_residual_dtype_other_than_float32_or_bfloat16_is_refused() -> None:
    with pytest.raises(ValueError, match="residual_dtype"):
        sb.SafeBits(many_tensor_params(), residual_dtype=torch.float16)
    with pytest.raises(ValueError, match="flat float32 or bfloat16"):
        ErrorFeedback().load_state_dict({"w": torch.zeros(3, dtype=torch.float64)})


def test_a_pass_through_adds_a_bfloat16_residual_in_float32() -> None:
    """A step that passes through sends the gradient plus what the residual held, in float32 (not rounded to the
    residual's bfloat16), also for a gradient it cannot reuse (not contiguous)."""
    p = torch.nn.Parameter(torch.zeros(64, 48))
    c = sb.SafeBits([("w", p)], budget_bits=lambda step: 2.0 if step == 0 else 32.0, residual_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    p.grad = torch.randn(64, 48, generator=gen)
    c.decompress(*c.compress(p.grad))
    kept = c.memory.residuals["w"].float().clone()
    assert kept.abs().max() > 0
    p.grad = torch.randn(48, 64, generator=gen).t()           # not contiguous: compress cannot reuse it
    g = p.grad.clone()
    out = c.decompress(*c.compress(p.grad))
    assert c.last_step is not None and out.dtype == torch.float32
    assert torch.equal(out.reshape(-1), g.reshape(-1) + kept)
    assert "w" not in c.memory.residuals                        # added once and dropped
