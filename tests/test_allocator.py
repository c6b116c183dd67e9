"""The global allocator: feasibility, the fallback, determinism and optimality against the exact oracle."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from safebits_hvd.policy.allocator import (
    allocate,
    allocate_exact,
    cheapest_admissible,
    compiled_available,
    greedy_error_bound,
)

needs_c = pytest.mark.skipif(not compiled_available(), reason="no C compiler: only the NumPy allocator runs")
# Behavioural tests run on both implementations: kernels/allocator.c and the NumPy version.
IMPLEMENTATIONS = [pytest.param(True, id="compiled", marks=needs_c), pytest.param(False, id="numpy")]


def random_instance(rng: np.random.Generator, tensors: int, actions: int):
    sizes = rng.integers(1, 50, size=tensors)
    bits = np.sort(rng.choice(np.arange(1, 33), size=actions, replace=False))[::-1]
    costs = sizes[:, None] * bits[None, :]
    # Error falls with bits, with noise so hulls are not trivial.
    errors = sizes[:, None] * rng.random((tensors, actions)) * (32.0 / bits[None, :]) ** 2
    errors[:, 0] = 0.0                      # column 0: the lossless action
    admissible = rng.random((tensors, actions)) < 0.7
    admissible[:, 0] = True
    return costs, errors, admissible


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 7), st.integers(2, 5), st.floats(0.0, 1.2), st.booleans())
def test_greedy_is_feasible_and_near_optimal(seed: int, tensors: int, actions: int, budget_fraction: float,
                                             compiled: bool) -> None:
    if compiled and not compiled_available():
        compiled = False
    rng = np.random.default_rng(seed)
    costs, errors, admissible = random_instance(rng, tensors, actions)
    rows = np.arange(tensors)
    floor = costs[rows, cheapest_admissible(costs, errors, admissible)].sum()
    budget = floor + budget_fraction * (costs[:, 0].sum() - floor)
    greedy = allocate(costs, errors, admissible, budget, compiled=compiled)
    exact = allocate_exact(costs, errors, admissible, budget)
    assert greedy.feasible and exact.feasible
    assert greedy.cost_bits <= budget                       # never over budget when feasible
    assert admissible[rows, greedy.choice].all()            # only admissible actions
    assert exact.squared_error <= greedy.squared_error + 1e-9
    assert greedy.squared_error - exact.squared_error <= greedy_error_bound(costs, errors, admissible) + 1e-9


@pytest.mark.parametrize("compiled", IMPLEMENTATIONS)
def test_infeasible_falls_back_to_minimum_cost(compiled: bool) -> None:
    costs = np.array([[32, 4, 1], [32, 4, 1]])
    errors = np.array([[0.0, 1.0, 5.0], [0.0, 1.0, 5.0]])
    admissible = np.array([[True, True, False], [True, False, False]])
    result = allocate(costs, errors, admissible, budget_bits_total=10, compiled=compiled)
    assert not result.feasible
    assert result.choice.tolist() == [1, 0]                # cheapest admissible each
    assert result.min_cost_bits == result.cost_bits == 36


@pytest.mark.parametrize("compiled", IMPLEMENTATIONS)
def test_full_budget_gives_zero_error_and_tiny_budget_the_floor(compiled: bool) -> None:
    rng = np.random.default_rng(0)
    costs, errors, admissible = random_instance(rng, 20, 5)
    assert allocate(costs, errors, admissible, costs[:, 0].sum(), compiled=compiled).squared_error == 0.0
    assert allocate(costs, errors, admissible, float("inf"), compiled=compiled).squared_error == 0.0
    rows = np.arange(20)
    floor_choice = cheapest_admissible(costs, errors, admissible)
    at_floor = allocate(costs, errors, admissible, costs[rows, floor_choice].sum(), compiled=compiled)
    assert at_floor.choice.tolist() == floor_choice.tolist()


@pytest.mark.parametrize("compiled", IMPLEMENTATIONS)
def test_deterministic_tie_breaking(compiled: bool) -> None:
    costs = np.array([[32, 8, 8], [32, 8, 8]])
    errors = np.array([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    admissible = np.ones_like(costs, dtype=bool)
    first = allocate(costs, errors, admissible, 40, compiled=compiled)
    for _ in range(5):
        again = allocate(costs.copy(), errors.copy(), admissible.copy(), 40, compiled=compiled)
        assert again.choice.tolist() == first.choice.tolist()
    assert first.choice.tolist() == [0, 1]                  # equal gains: lower tensor index upgrades first


@pytest.mark.parametrize("compiled", IMPLEMENTATIONS)
def test_many_tensors_within_budget(compiled: bool) -> None:
    rng = np.random.default_rng(1)
    costs, errors, admissible = random_instance(rng, 10_000, 10)
    budget = 0.3 * costs[:, 0].sum()
    result = allocate(costs, errors, admissible, budget, compiled=compiled)
    assert result.cost_bits <= budget


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 60), st.integers(1, 9), st.floats(-0.1, 1.1))
def test_compiled_and_numpy_choose_the_same(seed: int, tensors: int, actions: int, budget_fraction: float) -> None:
    """Ranks may run either implementation, so they must agree exactly, ties and collinear hull points included:
    small integer costs and errors make equal slopes, equal costs and equal points common."""
    rng = np.random.default_rng(seed)
    costs = rng.integers(0, 5, size=(tensors, actions)) * rng.integers(1, 4, size=(tensors, 1))
    errors = rng.integers(0, 6, size=(tensors, actions)).astype(float) / rng.integers(1, 4, size=(tensors, 1))
    admissible = rng.random((tensors, actions)) < 0.75
    admissible[:, rng.integers(actions)] = True
    floor, top = costs.min(axis=1).sum(), costs.max(axis=1).sum()
    budget = floor + budget_fraction * (top - floor)
    c = allocate(costs, errors, admissible, budget, compiled=True)
    n = allocate(costs, errors, admissible, budget, compiled=False)
    assert c.choice.tolist() == n.choice.tolist()
    assert (c.cost_bits, c.min_cost_bits, c.feasible, c.squared_error) == (
        n.cost_bits, n.min_cost_bits, n.feasible, n.squared_error)
    if c.feasible:
        assert c.cost_bits <= budget


@needs_c
def test_compiled_matches_numpy_on_a_thousand_realistic_tensors() -> None:
    rng = np.random.default_rng(7)
    costs, errors, admissible = random_instance(rng, 1000, 10)
    for fraction in (0.0, 0.05, 0.3, 0.7, 1.0):
        budget = fraction * costs[:, 0].sum()
        c = allocate(costs, errors, admissible, budget, compiled=True)
        n = allocate(costs, errors, admissible, budget, compiled=False)
        assert c.choice.tolist() == n.choice.tolist()


@pytest.mark.parametrize("compiled", IMPLEMENTATIONS)
def test_input_validation(compiled: bool) -> None:
    ones = np.ones((2, 3))
    ok = np.ones((2, 3), dtype=bool)
    with pytest.raises(ValueError, match="shape"):
        allocate(ones, np.ones((2, 2)), ok, 10, compiled=compiled)
    with pytest.raises(ValueError, match="admissible"):
        allocate(np.ones((1, 2)), np.ones((1, 2)), np.zeros((1, 2), dtype=bool), 10, compiled=compiled)
    with pytest.raises(ValueError, match="costs must be >= 0"):
        allocate(-ones, ones, ok, 10, compiled=compiled)
    with pytest.raises(ValueError, match="negative or NaN"):
        allocate(ones, np.array([[0.0, np.nan, 1.0], [0.0, 1.0, 1.0]]), ok, 10, compiled=compiled)
    with pytest.raises(ValueError, match="negative or NaN"):
        allocate(ones, -ones, ok, 10, compiled=compiled)
    with pytest.raises(ValueError, match="budget_bits"):
        allocate(ones, ones, ok, float("nan"), compiled=compiled)
    # A NaN error where the action is inadmissible plays no part.
    result = allocate(ones, np.array([[0.0, np.nan, 1.0], [0.0, 1.0, 1.0]]), ~np.isnan(
        np.array([[0.0, np.nan, 1.0], [0.0, 1.0, 1.0]])), 10, compiled=compiled)
    assert result.feasible


@pytest.mark.parametrize("compiled", IMPLEMENTATIONS)
def test_no_tensors(compiled: bool) -> None:
    result = allocate(np.zeros((0, 3)), np.zeros((0, 3)), np.zeros((0, 3), dtype=bool), 10, compiled=compiled)
    assert result.choice.size == 0 and result.feasible


@pytest.mark.parametrize("compiled", IMPLEMENTATIONS)
def test_admissible_none_means_finite_errors(compiled: bool) -> None:
    rng = np.random.default_rng(3)
    costs, errors, admissible = random_instance(rng, 50, 6)
    folded = np.where(admissible, errors, np.inf)
    budget = 0.4 * costs[:, 0].sum()
    expected = allocate(costs, errors, admissible, budget, compiled=compiled)
    result = allocate(costs, folded, None, budget, compiled=compiled)
    assert result.choice.tolist() == expected.choice.tolist()
    assert result.squared_error == expected.squared_error
    with pytest.raises(ValueError, match="negative or NaN"):
        allocate(costs, np.where(admissible, errors, np.nan), None, budget, compiled=compiled)


@pytest.mark.parametrize("compiled", IMPLEMENTATIONS)
def test_costs_beyond_exact_float64_are_refused(compiled: bool) -> None:
    """Slopes are float64: costs must be exact in it (< 2^53 bits), and totals must fit int64 with room."""
    ok = np.ones((1, 2), dtype=bool)
    with pytest.raises(ValueError, match="below 2\\^53"):
        allocate(np.array([[2**53, 2**53 + 1]]), np.array([[1.0, 0.0]]), ok, 2**62, compiled=compiled)
    costs = np.tile(np.array([[0, 2**50]]), (5000, 1))
    with pytest.raises(ValueError, match="2\\^62"):
        allocate(costs, np.tile([[1.0, 0.0]], (5000, 1)), np.ones((5000, 2), dtype=bool), float("inf"),
                 compiled=compiled)


@pytest.mark.parametrize("compiled", IMPLEMENTATIONS)
@pytest.mark.parametrize("budget", [-(2**64) + 5, float("-inf"), -1.5, float("inf"), 2**70])
def test_extreme_budgets(compiled: bool, budget: float) -> None:
    costs, errors = np.array([[1, 2]]), np.array([[1.0, 0.0]])
    result = allocate(costs, errors, np.ones((1, 2), dtype=bool), budget, compiled=compiled)
    assert result.feasible == (budget > 0)
    assert result.choice.tolist() == ([1] if budget > 0 else [0])


@needs_c
def test_unlucky_pivots_stay_exact() -> None:
    """Errors that rise then fall with the tensor index defeat median-of-three pivots; the compiled selection then
    sorts what is left, and must still agree with the NumPy version."""
    tensors = 20_000
    costs = np.tile(np.array([[0, 1]]), (tensors, 1))
    rise_fall = np.concatenate([np.arange(tensors // 2), np.arange(tensors // 2, 0, -1)]).astype(float)
    errors = np.stack([rise_fall, np.zeros(tensors)], axis=1)
    admissible = np.ones((tensors, 2), dtype=bool)
    c = allocate(costs, errors, admissible, tensors // 3, compiled=True)
    n = allocate(costs, errors, admissible, tensors // 3, compiled=False)
    assert c.choice.tolist() == n.choice.tolist() and c.cost_bits == tensors // 3
