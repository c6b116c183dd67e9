"""The global allocator: feasibility, the fallback, determinism and optimality against the exact oracle."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from safebits_hvd.allocator import allocate, allocate_exact, cheapest_admissible, greedy_error_bound


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
@given(st.integers(0, 2**32 - 1), st.integers(1, 7), st.integers(2, 5), st.floats(0.0, 1.2))
def test_greedy_is_feasible_and_near_optimal(seed: int, tensors: int, actions: int, budget_fraction: float) -> None:
    rng = np.random.default_rng(seed)
    costs, errors, admissible = random_instance(rng, tensors, actions)
    rows = np.arange(tensors)
    floor = costs[rows, cheapest_admissible(costs, errors, admissible)].sum()
    budget = floor + budget_fraction * (costs[:, 0].sum() - floor)
    greedy = allocate(costs, errors, admissible, budget)
    exact = allocate_exact(costs, errors, admissible, budget)
    assert greedy.feasible and exact.feasible
    assert greedy.cost_bits <= budget                       # never over budget when feasible
    assert admissible[rows, greedy.choice].all()            # only admissible actions
    assert exact.squared_error <= greedy.squared_error + 1e-9
    assert greedy.squared_error - exact.squared_error <= greedy_error_bound(costs, errors, admissible) + 1e-9


def test_infeasible_falls_back_to_minimum_cost() -> None:
    costs = np.array([[32, 4, 1], [32, 4, 1]])
    errors = np.array([[0.0, 1.0, 5.0], [0.0, 1.0, 5.0]])
    admissible = np.array([[True, True, False], [True, False, False]])
    result = allocate(costs, errors, admissible, budget_bits=10)
    assert not result.feasible
    assert result.choice.tolist() == [1, 0]                # cheapest admissible each
    assert result.min_cost_bits == result.cost_bits == 36


def test_full_budget_gives_zero_error_and_tiny_budget_the_floor() -> None:
    rng = np.random.default_rng(0)
    costs, errors, admissible = random_instance(rng, 20, 5)
    assert allocate(costs, errors, admissible, costs[:, 0].sum()).squared_error == 0.0
    rows = np.arange(20)
    floor_choice = cheapest_admissible(costs, errors, admissible)
    at_floor = allocate(costs, errors, admissible, costs[rows, floor_choice].sum())
    assert at_floor.choice.tolist() == floor_choice.tolist()


def test_deterministic_tie_breaking() -> None:
    costs = np.array([[32, 8, 8], [32, 8, 8]])
    errors = np.array([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    admissible = np.ones_like(costs, dtype=bool)
    first = allocate(costs, errors, admissible, 40)
    for _ in range(5):
        again = allocate(costs.copy(), errors.copy(), admissible.copy(), 40)
        assert again.choice.tolist() == first.choice.tolist()
    assert first.choice.tolist() == [0, 1]                  # equal gains: lower tensor index upgrades first


def test_many_tensors_is_fast_enough_and_within_budget() -> None:
    rng = np.random.default_rng(1)
    costs, errors, admissible = random_instance(rng, 10_000, 10)
    budget = 0.3 * costs[:, 0].sum()
    result = allocate(costs, errors, admissible, budget)
    assert result.cost_bits <= budget


def test_shape_validation() -> None:
    with pytest.raises(ValueError, match="shape"):
        allocate(np.ones((2, 3)), np.ones((2, 2)), np.ones((2, 3), dtype=bool), 10)
    with pytest.raises(ValueError, match="admissible"):
        allocate(np.ones((1, 2)), np.ones((1, 2)), np.zeros((1, 2), dtype=bool), 10)
