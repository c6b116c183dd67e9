"""A budget that holds (docs/DESIGN.md, "The algorithm as implemented", step 1): the escalation reserve."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import safebits_hvd as sb
from safebits_hvd.policy.budget import MIN_RESERVE, RESERVE_FACTOR, BudgetPolicy

from .helpers import many_tensor_params, random_grads, run_steps
from .test_compressor import PairExchange

MENU = ["fp32", "int8", "int4", "int2"]


def escalating_stream(policy: BudgetPolicy, steps: int, every: int) -> list[tuple[int, int, float]]:
    """Drive ``policy`` through a synthetic stream: 32 tensors of 1024 elements, each action's distortion fixed,
    and every ``every``-th step tensor 0's allocated action fails at send time and escalates to int8 (as a gradient
    that turns spiky does). Returns per step (allocated bits, modeled bits, budget)."""
    menu = policy.menu
    numels = policy.numels
    distortion = np.array([0.0, 1e-4, 0.02, 0.2])[None, :].repeat(len(numels), axis=0)
    distortion = distortion * (1.0 + np.arange(len(numels)))[:, None] / len(numels)
    v2 = np.ones(len(numels))
    int8 = menu.names.index("int8")
    budget = policy.budget_bits_total(3.0, int(numels.sum()))
    rows = []
    for step in range(steps):
        allocation = policy.allocate(3.0, budget, distortion, v2)
        modeled = allocation.cost_bits
        if step % every == every - 1 and policy.costs[0, allocation.choice[0]] < policy.costs[0, int8]:
            modeled += int(policy.costs[0, int8] - policy.costs[0, allocation.choice[0]])
        policy.observe(budget, allocation.cost_bits, modeled)
        rows.append((allocation.cost_bits, modeled, budget))
    return rows


def test_reserve_holds_a_budget_that_escalations_overran() -> None:
    numels = np.full(32, 1024)
    without = escalating_stream(BudgetPolicy(sb.make_menu(MENU), numels, 0.5, 0.8, reserve_window=0), 60, 4)
    with_reserve = escalating_stream(BudgetPolicy(sb.make_menu(MENU), numels, 0.5, 0.8, reserve_window=20), 60, 4)
    over_without = sum(modeled > budget for _, modeled, budget in without)
    over_with = sum(modeled > budget for _, modeled, budget in with_reserve)
    assert over_without == 15                     # every escalation overran the fully planned budget
    assert over_with == 0                         # the floor covers the first escalation, the reserve the rest
    # The reserve is only as large as the overshoots seen allow: the plan still uses most of the budget.
    assert all(allocated >= 0.8 * budget for allocated, _, budget in with_reserve)


def test_reserve_is_twice_the_record_and_returns_to_its_floor_after_a_quiet_window() -> None:
    numels = np.full(32, 1024)
    policy = BudgetPolicy(sb.make_menu(MENU), numels, 0.5, 0.8, reserve_window=5)
    assert policy.reserve_fraction == MIN_RESERVE > 0     # before any escalation: the floor
    policy.observe(1000.0, 900, 1100)
    assert policy.reserve_fraction == RESERVE_FACTOR * 0.2 > 0.2
    policy.observe(1000.0, 1000, 1000)
    assert policy.reserve_fraction == RESERVE_FACTOR * 0.2
    for _ in range(4):
        policy.observe(1000.0, 1000, 990)         # a cheaper send (a skipped tensor) is no overshoot
    assert policy.reserve_fraction == MIN_RESERVE
    assert BudgetPolicy(sb.make_menu(MENU), numels, 0.5, 0.8, reserve_window=0).reserve_fraction == 0.0   # off
    unscreened = BudgetPolicy(sb.make_menu(MENU), numels, 0.5, 0.8, screen=False)   # nothing escalates: no reserve
    unscreened.observe(1000.0, 900, 1100)
    assert unscreened.reserve_fraction == 0.0
    # The reserve shapes the plan only: feasibility is judged against the whole budget.
    policy.observe(1000.0, 0, 900)                  # a reserve of 90%: the plan can only be the cheapest one
    distortion = np.zeros((32, 4))
    allocation = policy.allocate(3.0, 3.0 * 32 * 1024, distortion, np.ones(32))
    assert allocation.feasible and allocation.budget_bits_total == 3.0 * 32 * 1024
    assert allocation.cost_bits == allocation.min_cost_bits == int(policy.costs[:, 3].sum())


def tight(params):
    """SafeBits whose tight screen escalates now and then on the helpers' heavy-tailed gradients."""
    return sb.SafeBits(params, budget_bits=4.4, max_distortion=0.12, min_cosine=0.9, seed=5)


def test_the_reserve_is_checkpointed_and_resumes_bit_identically(tmp_path) -> None:
    params = many_tensor_params()
    straight = tight(params)
    run_steps(straight, params, 10)
    params = many_tensor_params()
    first = tight(params)
    run_steps(first, params, 6)
    state = first.state_dict()
    assert max(state["overshoot_history"]) > 0          # the stream escalated: there is something to restore
    torch.save(state, tmp_path / "sb.pt")
    resumed = tight(params)
    resumed.load_state_dict(torch.load(tmp_path / "sb.pt", weights_only=True))
    assert resumed.core.policy.overshoot_history == first.core.policy.overshoot_history
    for step in range(6, 10):
        random_grads(params, step)
        for _, p in reversed(params):
            sent, ctx = resumed.compress(p.grad)
            resumed.decompress(sent, ctx)
    assert [r.allocation_digest for r in straight.history[6:]] == [r.allocation_digest for r in resumed.history]
    assert [r.modeled_bits_total for r in straight.history[6:]] == [r.modeled_bits_total for r in resumed.history]


def test_a_state_of_format_4_loads_with_an_empty_reserve() -> None:
    params = many_tensor_params()
    c = tight(params)
    run_steps(c, params, 6)
    state = c.state_dict()
    del state["overshoot_history"]
    state["format"] = 4
    other = tight(many_tensor_params())
    other.load_state_dict(state)
    assert other.step == 6 and other.core.policy.overshoot_history == []
    assert other.core.policy.reserve_fraction == MIN_RESERVE


def test_every_rank_learns_the_same_reserve_from_the_reduced_records() -> None:
    """Only rank b's gradient of 'w' turns spiky (its allocated action escalates there alone): the overshoot comes
    from the MAX over ranks, so both ranks learn the same reserve and keep allocating alike."""
    exchange = PairExchange()
    ranks = []
    for _ in range(2):
        w, u = torch.nn.Parameter(torch.zeros(4096)), torch.nn.Parameter(torch.zeros(16384))
        ranks.append((sb.SafeBits([("w", w), ("u", u)], budget_bits=3.0, menu=["fp32", "int8", "int4", "int2"],
                                  exchange=exchange), w, u))
    spikes = torch.zeros(4096)
    spikes[::97] = torch.arange(1, 44, dtype=torch.float32)
    for step in range(12):
        gen = torch.Generator().manual_seed(step)
        for rank, (_, w, u) in enumerate(ranks):
            w.grad = spikes.clone() if rank == 1 and step % 3 == 2 else torch.randn(4096, generator=gen)
            u.grad = torch.randn(16384, generator=gen)
        pending = [(c, c.compress(p.grad)) for c, w, u in ranks for p in (u, w)]
        for c, (sent, ctx) in pending:
            c.decompress(sent, ctx)
    a, b = ranks[0][0], ranks[1][0]
    assert any(r.escalations for r in a.history)
    assert [r.to_json() for r in a.history] == [r.to_json() for r in b.history]
    assert a.core.policy.overshoot_history == b.core.policy.overshoot_history
    assert a.core.policy.reserve_fraction > 0


def test_the_plan_avoids_actions_that_pass_the_screen_narrowly() -> None:
    policy = BudgetPolicy(sb.make_menu(MENU), np.full(2, 1024), 0.5, 0.8)
    distortion = np.array([0.0, 1e-4, 0.2, 0.49])          # int2 passes the screen by 2%
    cosine = np.array([1.0, 1.0, 0.9, 0.9])
    assert policy.screen(distortion, cosine).tolist() == [True, True, True, True]
    assert policy.plannable(distortion, cosine).tolist() == [True, True, True, False]
    assert not policy.sent_passes(3, 0.49, 0.9, policy.planning_margin) and policy.accepts(3, 0.49, 0.9)
    cosine[2] = 0.805                                        # int4's cosine passes by 2.5% of the way to 1
    assert not policy.plannable(distortion, cosine)[2] and policy.screen(distortion, cosine)[2]


def guarded_case() -> tuple[BudgetPolicy, np.ndarray, np.ndarray, float]:
    """One large tensor (60% of the elements) whose int2 plan is at risk (distortion 0.45 of 0.5) and 31 small ones
    that are not: the CNN's ``fc1.weight`` in miniature. Returns the policy, distortions, ``v2`` and the budget."""
    numels = np.array([31 * 1024 * 3 // 2] + [1024] * 31)
    policy = BudgetPolicy(sb.make_menu(MENU), numels, 0.5, 0.8)
    distortion = np.array([0.0, 1e-4, 0.02, 0.1])[None, :].repeat(len(numels), axis=0)
    distortion[0] = [0.0, 1e-4, 0.05, 0.45]
    return policy, distortion, np.ones(len(numels)), policy.budget_bits_total(3.4, int(numels.sum()))


def test_guard_leaves_room_for_one_escalation_of_a_tensor_at_risk() -> None:
    policy, distortion, v2, budget = guarded_case()
    allocation = policy.allocate(3.4, budget, distortion, v2)
    int2, int4 = policy.menu.names.index("int2"), policy.menu.names.index("int4")
    assert allocation.choice[0] == int2
    escalation = int(policy.costs[0, int4] - policy.costs[0, int2])
    assert escalation > MIN_RESERVE * budget            # the reserve's floor alone would not cover it
    assert policy.escalation_guard(allocation.choice, distortion) == escalation
    assert allocation.cost_bits + escalation <= budget  # the escalation of tensor 0 fits the budget
    assert allocation.feasible


def test_guard_ignores_plans_that_are_not_at_risk_and_is_off_without_the_screen() -> None:
    policy, distortion, v2, budget = guarded_case()
    distortion[0, 3] = 0.2                              # now well inside the screen
    allocation = policy.allocate(3.4, budget, distortion, v2)
    assert policy.escalation_guard(allocation.choice, distortion) == 0
    assert allocation.cost_bits >= 0.9 * budget       # only the reserve's floor is held back
    unscreened = BudgetPolicy(policy.menu, policy.numels, 0.5, 0.8, screen=False)
    assert unscreened.escalation_guard(allocation.choice, distortion) == 0


def test_an_action_that_failed_at_send_time_is_not_planned_again_from_the_estimate() -> None:
    """The screen estimates on 16 evenly spaced buckets of 64, here one spike each (top-k keeps it all); the other
    48 buckets are flat, so the exact top-10% distortion is about 0.7: the plan from the estimate fails at send
    time. The next allocation must take the exact verdict, not plan top-k from the sample again."""
    buckets, size, sample = 64, 512, 16
    flat = torch.ones(buckets, size)
    sampled = ((torch.arange(sample, dtype=torch.float64) + 0.5) * (buckets / sample)).floor().long()
    flat[sampled] = 0.0
    flat[sampled, 0] = size ** 0.5                      # the same energy as a flat bucket, in one element
    w = torch.nn.Parameter(torch.zeros(buckets * size))
    compressor = sb.SafeBits([("w", w)], budget_bits=8.0, menu=["fp32", "fp16", "topk10"], seed=3)
    allocated, escalated = [], []
    for _ in range(2):
        w.grad = flat.reshape(-1).clone()
        sent, ctx = compressor.compress(w.grad)
        compressor.decompress(sent, ctx)
        record = compressor.last_step
        allocated.append(record.allocated["w"])
        escalated.append(record.escalations)
    assert allocated[0] == "topk10" and escalated[0] == ["w"]      # the estimate admitted it; the send did not
    assert allocated[1] != "topk10" and escalated[1] == []


def test_guard_covers_every_plan_likely_to_fail_escalating_together() -> None:
    """Four equal tensors planned at int2 at distortion 0.47 (likely to fail) and 0.3 (at risk only): the guard is
    the sum of the likely ones' escalations, and the largest single one when none is likely."""
    numels = np.full(4, 8192)
    policy = BudgetPolicy(sb.make_menu(MENU), numels, 0.5, 0.8)
    int2, int4 = policy.menu.names.index("int2"), policy.menu.names.index("int4")
    distortion = np.array([[0.0, 1e-4, 0.05, 0.47]] * 4)
    choice = np.full(4, int2)
    step = int(policy.costs[0, int4] - policy.costs[0, int2])
    assert policy.escalation_guard(choice, distortion) == 4 * step
    distortion[:, 3] = 0.3
    assert policy.escalation_guard(choice, distortion) == step
    distortion[:2, 3] = 0.47
    assert policy.escalation_guard(choice, distortion) == 2 * step


def _mean_share(sizes: list[int], budget: float, menu: sb.Menu, steps: int = 8) -> tuple[float, list]:
    """Mean ``StepRecord.budget_share`` after the start step of SafeBits on fresh Gaussian gradients (which every
    quantizer of the default menu passes), and the records."""
    gen = torch.Generator().manual_seed(4)
    params = [(f"t{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    compressor = sb.SafeBits(params, budget_bits=budget, menu=menu)
    for _ in range(steps):
        for _, p in reversed(params):
            p.grad = torch.randn(p.shape, generator=gen)
            compressor.decompress(*compressor.compress(p.grad))
    records = compressor.history[1:]
    return sum(r.budget_share for r in records) / len(records), records


PRE_LADDER_MENU = sb.make_menu(["fp32", "fp16", "bf16", "int8", "int4", "int3_mse", "int2", "ternary", "ternary_mse",
                                "sign", "topk10", "topk1", "int2_mse", "topk5"])
"""The default menu before the ladder of 5- to 14-bit rungs: 3 bits (int3_mse) was the most it sent below 8."""


@pytest.mark.parametrize("budget", [4.4, 8.0])
def test_the_budget_is_spent_even_when_one_tensor_holds_nearly_every_parameter(budget: float) -> None:
    sizes = [500, 500, 200_000]
    share, records = _mean_share(sizes, budget, sb.DEFAULT_MENU)
    assert 0.85 <= share <= 1.0
    for r in records:      # where the rest went: the reserve's floor, nothing to the guard, the menu's granularity
        assert r.reserve_bits == pytest.approx(MIN_RESERVE * r.budget_bits_total)
        assert r.guard_bits == 0.0
        assert 0 < r.planned_bits_total <= r.budget_bits_total - r.reserve_bits
        assert r.modeled_bits_total == r.planned_bits_total and not r.escalations
    old_share, _ = _mean_share(sizes, budget, PRE_LADDER_MENU)
    assert old_share < 0.75                       # the gap this test guards against (70% and 39% of the budget)


@pytest.mark.parametrize("budget", [4.4, 8.0])
def test_the_budget_is_spent_on_many_tensors(budget: float) -> None:
    share, _ = _mean_share([1000 + 7000 * i for i in range(12)], budget, sb.DEFAULT_MENU)
    assert 0.9 <= share <= 1.0
