"""SafeBits in one process: the screen invariant, conservation, budget, determinism, records, checkpoints."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import safebits_hvd as sb
from safebits_hvd.policy.telemetry import StepRecord

from .helpers import many_tensor_params, random_grads, run_steps

BUDGETS = [1.0, 2.0, 4.4, 8.0, 32.0]


@pytest.mark.parametrize("budget", BUDGETS)
def test_screen_invariant_on_what_is_sent(budget: float) -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params, budget_bits=budget, max_distortion=0.3, min_cosine=0.85)
    for step in run_steps(c, params, 6, capture=True):
        for name, _, v, sent in step:
            v, q = v.double(), sent.double()
            if torch.equal(q, v):
                continue                                    # lossless
            v2 = float((v * v).sum())
            distortion = float(((q - v) ** 2).sum()) / v2
            cosine = float((q * v).sum()) / math.sqrt(float((q * q).sum()) * v2)
            assert distortion <= 0.3, (name, distortion)
            assert cosine >= 0.85, (name, cosine)
            assert c.last_step is not None


@pytest.mark.parametrize("budget", BUDGETS)
def test_error_feedback_conserves_the_gradient_sum(budget: float) -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params, budget_bits=budget)
    total_grad = {name: torch.zeros(p.numel(), dtype=torch.float64) for name, p in params}
    total_sent = {name: torch.zeros(p.numel(), dtype=torch.float64) for name, p in params}
    for step in run_steps(c, params, 12, capture=True):
        for name, g, _, sent in step:
            total_grad[name] += g.reshape(-1).double()
            total_sent[name] += sent.double()
    for name, _ in params:
        residual = c.memory.residuals.get(name, torch.zeros(1)).double()    # none at 32 bits: a pass-through
        scale = float(total_grad[name].abs().max())
        assert torch.allclose(total_sent[name] + residual, total_grad[name], rtol=0, atol=1e-5 * scale), name


@pytest.mark.parametrize("budget", BUDGETS)
def test_budget_respected_or_violation_recorded(budget: float) -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params, budget_bits=budget)
    run_steps(c, params, 8)
    total = sum(p.numel() for _, p in params)
    assert len(c.history) == 8
    for record in c.history:
        assert record.budget_bits_total == pytest.approx(budget * total)
        assert record.violation == (record.modeled_bits_total > record.budget_bits_total)
        assert record.excess_bits == pytest.approx(max(0, record.modeled_bits_total - record.budget_bits_total))
        assert record.modeled_compression_ratio == pytest.approx(32 * total / record.modeled_bits_total)
    if budget >= 32:
        assert all(set(r.actions.values()) == {"fp32"} and not r.violation for r in c.history[1:])
    if budget >= 8:   # enough for int8 everywhere: after step 0 the allocation fits and is safe
        assert not any(r.violation for r in c.history[2:])


def test_tight_budget_falls_back_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params, budget_bits=0.3, max_distortion=0.1, min_cosine=0.95)
    with caplog.at_level("WARNING", logger="safebits_hvd"):
        run_steps(c, params, 4)
    assert all(r.violation and r.excess_bits > 0 for r in c.history)
    assert any(r.infeasible for r in c.history[1:])
    assert "budget violation" in caplog.text


def test_determinism_across_objects_with_the_same_seed() -> None:
    outs = []
    for _ in range(2):
        params = many_tensor_params()
        c = sb.SafeBits(params, budget_bits=3.0, seed=7)
        outs.append(([[s for *_, s in step] for step in run_steps(c, params, 5, capture=True)],
                     [r.allocation_digest for r in c.history]))
    (sent_a, digests_a), (sent_b, digests_b) = outs
    assert digests_a == digests_b
    for step_a, step_b in zip(sent_a, sent_b, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            assert torch.equal(a, b)


def test_seed_changes_stochastic_rounding() -> None:
    sent = []
    for seed in (0, 1):
        params = many_tensor_params()
        c = sb.SafeBits(params, budget_bits=4.4, seed=seed, menu=["fp32", "int4"])
        sent.append(run_steps(c, params, 1, capture=True)[0])
    assert any(not torch.equal(a[3], b[3]) for a, b in zip(sent[0], sent[1], strict=True))


def test_step_record_fields() -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params, budget_bits=4.4)
    run_steps(c, params, 2)
    record = c.last_step
    assert isinstance(record, StepRecord) and record.step == 1 and c.history[0].step == 0
    names = {name for name, _ in params}
    for field in ["step", "budget_bits_total", "modeled_bits_total", "modeled_compression_ratio", "violation",
                  "excess_bits", "escalations", "actions", "distortion", "cosine", "allocation_digest"]:
        assert hasattr(record, field)
    with pytest.warns(DeprecationWarning, match="modeled_bits_total"):      # the old names, for one release
        assert record.used_bits_total == record.modeled_bits_total
    with pytest.warns(DeprecationWarning, match="modeled_compression_ratio"):
        assert record.compression_ratio == record.modeled_compression_ratio
    assert set(record.actions) == set(record.distortion) == set(record.cosine) == names
    assert set(record.actions.values()) <= set(sb.DEFAULT_MENU.names)
    assert isinstance(record.escalations, list) and set(record.escalations) <= names
    assert len(record.allocation_digest) == 16
    expected_bits = sum(sb.ACTIONS[record.actions[n]].cost(p.numel()) for n, p in params)
    assert record.modeled_bits_total == expected_bits


def test_log_path_writes_one_json_line_per_step(tmp_path) -> None:
    params = many_tensor_params()
    path = tmp_path / "log" / "safebits.jsonl"
    c = sb.SafeBits(params, budget_bits=2.0, log_path=path)
    run_steps(c, params, 3)
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert first["step"] == 0 and first["allocation_digest"] == c.history[0].allocation_digest


def test_escalation_when_allocated_action_is_not_admissible() -> None:
    # Step 0 gives everything 'sign' (the costliest action within 1.1 bits); a sparse gradient makes sign inadmissible.
    p = torch.nn.Parameter(torch.zeros(4096))
    c = sb.SafeBits([("w", p)], budget_bits=1.1, menu=["fp32", "int8", "sign"])
    g = torch.zeros(4096)
    g[::97] = torch.arange(1, 44, dtype=torch.float32)
    p.grad = g
    sent, ctx = c.compress(g)
    c.decompress(sent, ctx)
    record = c.last_step
    assert record.allocated["w"] == "sign" and record.actions["w"] != "sign"
    assert record.escalations == ["w"] and record.violation


def test_checkpoint_restore_continues_bit_identically(tmp_path) -> None:
    def make():
        params = many_tensor_params()
        return params, sb.SafeBits(params, budget_bits=sb.ConvergenceRamp(1.5, 6.0, 10), seed=3)

    params, straight = make()
    full = run_steps(straight, params, 8, capture=True)
    params, first = make()
    run_steps(first, params, 4)
    torch.save(first.state_dict(), tmp_path / "sb.pt")
    params, resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "sb.pt", weights_only=True))
    assert resumed.step == 4
    rest = []
    for step in range(4, 8):                                # continue the same gradient stream
        random_grads(params, step)
        row = []
        for _, p in reversed(params):
            sent, ctx = resumed.compress(p.grad)
            row.append(sent.clone())
            resumed.decompress(sent, ctx)
        rest.append(row)
    for step_full, step_rest in zip(full[4:], rest, strict=True):
        for (_, _, _, a), b in zip(step_full, step_rest, strict=True):
            assert torch.equal(a, b)
    assert [r.allocation_digest for r in straight.history[4:]] == [r.allocation_digest for r in resumed.history]


def test_state_for_another_model_is_rejected() -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params)
    run_steps(c, params, 1)
    other = sb.SafeBits(many_tensor_params(sizes=(10, 20)))
    with pytest.raises(ValueError, match="different model"):
        other.load_state_dict(c.state_dict())
    with pytest.raises(ValueError, match="menu"):
        sb.SafeBits(many_tensor_params(), menu=["fp32", "int8"]).load_state_dict(c.state_dict())


def test_unregistered_tensor_is_a_clear_error() -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params)
    random_grads(params, 0)
    with pytest.raises(ValueError, match=r"not the \.grad of any registered parameter"):
        c.compress(params[0][1].grad.clone())


def test_frozen_parameters_are_ignored() -> None:
    params = many_tensor_params()
    params[1][1].requires_grad_(False)
    c = sb.SafeBits(params)
    assert "p1" not in c.names
    live = [pair for pair in params if pair[1].requires_grad]
    run_steps(c, live, 2)
    assert len(c.history) == 2 and "p1" not in c.last_step.actions


def test_decompress_restores_shape_and_dtype() -> None:
    p = torch.nn.Parameter(torch.zeros(3, 5, dtype=torch.float64))
    c = sb.SafeBits([("w", p)], budget_bits=32)
    p.grad = torch.randn(3, 5, dtype=torch.float64)
    sent, ctx = c.compress(p.grad)
    assert sent.dtype == torch.float32 and sent.shape == (15,)
    back = c.decompress(sent, ctx)
    assert back.shape == (3, 5) and back.dtype == torch.float64
    assert torch.allclose(back, p.grad, atol=1e-6)


def test_unscreened_ablation_sends_the_allocation() -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params, budget_bits=1.2, screen=False)
    run_steps(c, params, 4)
    assert all(not r.escalations for r in c.history)
    assert all(r.actions == r.allocated for r in c.history)
    assert np.mean([r.modeled_bits_total <= r.budget_bits_total for r in c.history[1:]]) == 1.0


def test_records_read_late_equal_records_read_at_once() -> None:
    """Step records are built when first read, from arrays of a statistics vector that is reused two steps later:
    reading them late must give what reading them at once gives."""
    params = many_tensor_params()
    eager, lazy = sb.SafeBits(params, budget_bits=2.0), sb.SafeBits(params, budget_bits=2.0)
    seen = []
    for step in range(5):
        random_grads(params, step)
        for c in (eager, lazy):
            for _, p in reversed(params):
                sent, ctx = c.compress(p.grad)
                c.decompress(sent, ctx)
        seen.append(_without_timing(eager.last_step))
    assert [_without_timing(r) for r in lazy.history] == seen
    assert eager.last_step is eager.history[-1]
    assert all(r.timing and r.timing_step == r.step for r in lazy.history)     # each step's own, from step 0


def _without_timing(record: sb.StepRecord) -> dict:
    """A record as a dict without its wall-clock telemetry (which differs between any two runs)."""
    data = json.loads(record.to_json())
    del data["timing"]
    return data


class PairExchange:
    """Two SafeBits objects in one process as two ranks: the element-wise MAX of both vectors, in place."""

    is_local = False
    rank = 0
    size = 2

    def __init__(self) -> None:
        self.pending: list[np.ndarray] = []

    def start(self, values: np.ndarray) -> None:
        self.pending.append(values)

    def wait(self, handle: None) -> None:
        if len(self.pending) == 2:          # the first rank to wait reduces for both
            first, second = self.pending
            np.maximum(first, second, out=first)
            second[:] = first
            self.pending = []


def test_an_action_one_rank_screens_out_is_allocated_to_no_rank() -> None:
    """The exchange carries each action's distortion where the rank's screen admits it and +inf where it does not;
    the MAX admits an action only if every rank did. Rank b's gradient of 'w' is sparse spikes (sign and int2
    fail its screen), rank a's is Gaussian (everything passes): the next allocation must avoid them on both."""
    menu = ["fp32", "int8", "int2", "sign"]
    ranks = []
    exchange = PairExchange()
    for _ in range(2):
        w, u = torch.nn.Parameter(torch.zeros(4096)), torch.nn.Parameter(torch.zeros(4096))
        c = sb.SafeBits([("w", w), ("u", u)], budget_bits=1.5, menu=menu, exchange=exchange)   # both "ranks"
        ranks.append((c, w, u))
    spikes = torch.zeros(4096)
    spikes[::97] = torch.arange(1, 44, dtype=torch.float32)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for rank, (_, w, u) in enumerate(ranks):
            w.grad = torch.randn(4096, generator=gen) if rank == 0 else spikes.clone()
            u.grad = torch.randn(4096, generator=gen)
        pending = [(c, c.compress(p.grad)) for c, w, u in ranks for p in (u, w)]
        for c, (sent, ctx) in pending:
            c.decompress(sent, ctx)
    a, b = ranks[0][0], ranks[1][0]
    assert [r.allocation_digest for r in a.history] == [r.allocation_digest for r in b.history]
    for ra, rb in zip(a.history, b.history, strict=True):
        assert ra.to_json() == rb.to_json()
    # Step 0 allocates by the start policy (sign fits 1.5 bits); from step 1 on, the lagged allocation has seen b.
    assert a.history[0].allocated["w"] == "sign" and "w" in a.history[0].escalations
    for record in a.history[1:]:
        assert record.allocated["w"] in ("fp32", "int8")
        assert record.allocated["u"] in ("int2", "sign", "int8")     # u passes on both ranks


def test_history_is_a_snapshot_and_last_step_survives_max_history_zero(tmp_path) -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params, budget_bits=2.0, max_history=3)
    run_steps(c, params, 2)
    kept = c.history
    run_steps(c, params, 1)
    assert c.last_step.step == 2                            # built alone ...
    run_steps(c, params, 2)
    assert [r.step for r in kept] == [0, 1] and all(isinstance(r, StepRecord) for r in kept)
    history = c.history                                     # ... then the rest around it
    assert [r.step for r in history] == [2, 3, 4] and all(isinstance(r, StepRecord) for r in history)
    assert history[-1] is c.last_step
    history.clear()
    assert len(c.history) == 3                              # a copy: the caller cannot empty it

    none_kept = sb.SafeBits(params, budget_bits=2.0, max_history=0, log_path=tmp_path / "log.jsonl")
    run_steps(none_kept, params, 2)
    assert none_kept.history == [] and none_kept.last_step.step == 1
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 2
    with pytest.raises(ValueError, match="max_history"):
        sb.SafeBits(params, max_history=-1)


def test_unnamed_parameters_are_named_as_horovod_names_them() -> None:
    """``hvd.DistributedOptimizer(opt)`` names parameters ``allreduce.noname.<group>.<index>``; SafeBits built from
    the optimizer, its param_groups or model.parameters() uses the same names and matches gradients by identity."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}], lr=0.1)
    expected = ["allreduce.noname.0.0", "allreduce.noname.0.1", "allreduce.noname.1.0", "allreduce.noname.1.1"]
    assert sb.SafeBits(opt).names == expected
    assert sb.SafeBits(opt.param_groups).names == expected
    assert sb.SafeBits(model.parameters()).names == [f"allreduce.noname.0.{j}" for j in range(4)]
    c = sb.SafeBits(opt, budget_bits=8)
    model(torch.randn(16, 8)).square().sum().backward()
    for p in model.parameters():
        sent, ctx = c.compress(p.grad)
        c.decompress(sent, ctx)
    assert c.last_step is not None and set(c.last_step.actions) == set(expected)
    with pytest.raises(TypeError, match="not the model"):
        sb.SafeBits(model)
    with pytest.raises(TypeError, match="param_groups"):
        sb.SafeBits([{"lr": 0.1}])


def test_a_wait_that_never_completes_raises_a_timeout_naming_the_cause() -> None:
    import time

    from safebits_hvd.comm.exchange import wait_bounded

    start = time.perf_counter()
    with pytest.raises(sb.SafeBitsTimeoutError, match="never joined"):
        wait_bounded(lambda: False, 0.2, "SafeBits' statistics exchange 'x'")
    assert 0.2 <= time.perf_counter() - start < 5
    wait_bounded(lambda: True, 0.0, "done at once")
    with pytest.raises(ValueError, match="timeout"):
        sb.SafeBits(many_tensor_params(), timeout=0)
