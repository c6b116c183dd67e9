"""Global bit allocation (docs/DESIGN.md, "The algorithm as implemented", step 1): a multiple-choice knapsack.

Choose one admissible action per tensor to minimise the total squared error ``sum_i err_i(a_i)`` subject to
``sum_i cost_i(a_i) <= budget`` (bits). :func:`allocate` is the production path, :func:`allocate_exact` the oracle.

Production path: **convex-hull greedy** (the Lagrangian relaxation made integral).

1. Start every tensor at its cheapest admissible action (ties: smaller error, then menu order).
   If that already exceeds the budget the problem is infeasible: return it (the fallback) with ``feasible=False``.
2. For each tensor, walk the lower convex hull of its admissible ``(cost, error)`` points upward; each hull edge
   is an upgrade with a gain per bit (slope). Slopes decrease along a hull, so upgrades of one tensor come in order.
3. Take upgrades in order of decreasing slope while they fit; an upgrade that does not fit blocks the rest of its
   tensor's chain (the remaining budget only shrinks), other tensors go on.

Bound (tested against the oracle): the result is never over budget when a feasible assignment exists, and its
error exceeds the optimum by at most the largest single hull-edge gain, ``max_i max_edge (err_from - err_to)``:
the LP relaxation is solved exactly by the hull prefix and differs from the integral greedy by one split edge.

Everything is deterministic and uses only its inputs (no rank, no randomness): upgrades with equal slopes go
by position along the hull, then tensor index; equal points by menu order.

Two implementations of steps 1-3, one arithmetic: ``kernels/allocator.c`` (the default: an order of magnitude
faster, docs/RESULTS.md, measured by ``bench/suites/bench_allocator.py``) and :func:`_hull_greedy` here in NumPy (used
without a C compiler; the C file's test oracle). They perform the same float64 operations with the same
tie-breaking and return the same choice bit for bit, so ranks agree whichever one they run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class Allocation:
    """The allocator's answer.

    Attributes:
        choice: action index (into the menu) per tensor, int64.
        cost_bits: modeled bits of ``choice``.
        squared_error: its total squared error (inf if it uses an inadmissible action, which never happens).
        budget_bits_total: the budget it was asked to fit (from :class:`~.budget.BudgetPolicy`: the step's whole
            budget, which its plan undershoots by the escalation reserve).
        min_cost_bits: bits of the cheapest admissible configuration.
        feasible: ``min_cost_bits <= budget_bits_total``; if False, ``choice`` is that cheapest configuration.
        reserve_bits: bits of the budget the escalation reserve left unplanned (:class:`~.budget.BudgetPolicy`).
        guard_bits: bits the escalation guard's re-plans left unplanned beyond the reserve.
    """

    choice: np.ndarray
    cost_bits: int
    squared_error: float
    budget_bits_total: float
    min_cost_bits: int
    feasible: bool
    reserve_bits: float = 0.0
    guard_bits: float = 0.0


def _check(costs: np.ndarray, errors: np.ndarray, admissible: np.ndarray | None,
           values_checked_later: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Validated ``(costs, err)``: C-contiguous int64 costs, float64 errors with +inf where inadmissible.

    ``values_checked_later``: only shapes here; the compiled allocator checks the values itself, as it reads them
    (every tensor has an admissible action, costs >= 0, errors >= 0 and not NaN), with the same messages."""
    costs = np.ascontiguousarray(costs, dtype=np.int64)
    errors = np.ascontiguousarray(errors, dtype=np.float64)
    admissible = None if admissible is None else np.asarray(admissible, dtype=bool)
    mask_shape = costs.shape if admissible is None else admissible.shape
    if costs.ndim != 2 or costs.shape != errors.shape or costs.shape != mask_shape:
        raise ValueError(f"costs, errors and admissible must share one (tensors, actions) shape, got "
                         f"{costs.shape}, {errors.shape}, {mask_shape}")
    # admissible=None: inadmissible actions are already +inf, no copy.
    err = errors if admissible is None else np.where(admissible, errors, np.inf)
    if values_checked_later:
        return costs, err
    if costs.shape[0] and not (err < np.inf).any(axis=1).all():
        raise ValueError("every tensor needs at least one admissible action (the lossless one)")
    if (costs < 0).any() or (costs >= 2**53).any():
        raise ValueError("costs must be >= 0 and below 2^53 bits")
    if costs.size and costs.max(axis=1).sum(dtype=np.float64) >= 2.0**62:
        raise ValueError("the tensors' largest costs add up to 2^62 bits or more")
    if not (err >= 0).all():
        raise ValueError("errors of admissible actions must be >= 0 (squared errors), not negative or NaN")
    return costs, err


def _integer_budget(bits: float) -> int:
    """Costs are whole bits, so ``sum <= budget`` is ``sum <= floor(budget)``. Totals stay below 2^62 bits (checked),
    so a budget beyond +-2^62 is as good as unlimited, or as impossible."""
    if isinstance(bits, bool) or not isinstance(bits, int | float | np.integer | np.floating) or math.isnan(bits):
        raise ValueError(f"budget_bits_total must be a number of bits, got {bits!r}")
    if isinstance(bits, int | np.integer):
        return min(max(int(bits), -(2**62)), 2**62)
    return math.floor(min(max(float(bits), -(2.0**62)), 2.0**62))


def cheapest_admissible(costs: np.ndarray, errors: np.ndarray, admissible: np.ndarray) -> np.ndarray:
    """Per tensor, the admissible action of least cost (ties: least error, then menu order)."""
    costs, err = _check(costs, errors, admissible)
    return _cheapest(costs, err)


def _cheapest(costs: np.ndarray, err: np.ndarray) -> np.ndarray:
    if costs.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    return _cheapest_t(np.ascontiguousarray(costs.T), np.ascontiguousarray(err.T))


def _cheapest_t(costs_t: np.ndarray, err_t: np.ndarray) -> np.ndarray:
    """:func:`cheapest_admissible` on ``(actions, tensors)`` arrays (inadmissible = infinite error)."""
    masked_cost = np.where(np.isfinite(err_t), costs_t, np.iinfo(np.int64).max)
    at_min = masked_cost == masked_cost.min(axis=0)
    return np.argmin(np.where(at_min, err_t, np.inf), axis=0)    # argmin: first index among equal errors


_compiled: bool | None = None


def compiled_available() -> bool:
    """Whether :func:`allocate` runs the compiled greedy (``kernels/allocator.c``) by default."""
    global _compiled
    if _compiled is None:
        from ..codec import kernels

        _compiled = kernels.backend_name("cpu") == "c"
    return _compiled


def allocate(costs: np.ndarray, errors: np.ndarray, admissible: np.ndarray | None, budget_bits_total: float, *,
             compiled: bool | None = None) -> Allocation:
    """Convex-hull greedy allocation (see the module docstring). Arrays are ``(tensors, actions)``.

    Args:
        costs: modeled bits of every action for every tensor (integers >= 0).
        errors: squared error of every action (>= 0; ignored where inadmissible).
        admissible: the screen's verdict, or None when ``errors`` is already +inf exactly where inadmissible.
            Every tensor needs at least one admissible action.
        budget_bits_total: the budget in bits (the whole step, all tensors).
        compiled: True runs ``kernels/allocator.c``, False the NumPy version in this module, None (default) the
            compiled one when the C library is available. Both give the same choice, bit for bit.
    """
    if compiled is None:
        compiled = compiled_available()
    costs, err = _check(costs, errors, admissible, values_checked_later=compiled)
    budget = _integer_budget(budget_bits_total)
    tensors = costs.shape[0]
    if tensors == 0:
        return Allocation(np.zeros(0, dtype=np.int64), 0, 0.0, budget_bits_total, 0, budget >= 0)
    if compiled:
        from ..codec.kernels import cpu

        choice, min_cost, feasible = cpu.allocate(costs, err, budget)
    else:
        choice, min_cost, feasible = _hull_greedy(costs, err, budget)
    rows = np.arange(tensors)
    return Allocation(choice, int(costs[rows, choice].sum()), float(err[rows, choice].sum()), budget_bits_total,
                      min_cost, feasible)


def _hull_greedy(costs: np.ndarray, err: np.ndarray, budget: int) -> tuple[np.ndarray, int, bool]:
    """The NumPy version of ``kernels/allocator.c``: ``(choice, min_cost_bits, feasible)`` for an integer budget.

    Vectorised over tensors; the C version does the same arithmetic tensor by tensor."""
    # Actions admissible for no tensor play no part: drop their columns (often half the menu under a strict screen).
    used_columns = np.flatnonzero(np.isfinite(err).any(axis=0))
    if used_columns.size < costs.shape[1]:
        choice, min_cost, feasible = _hull_greedy(np.ascontiguousarray(costs[:, used_columns]),
                                                  np.ascontiguousarray(err[:, used_columns]), budget)
        return used_columns[choice], min_cost, feasible
    tensors = costs.shape[0]
    rows = np.arange(tensors)
    # Arrays are (actions, tensors) from here: reductions over the few actions run along the long axis.
    costs_t, err_t = np.ascontiguousarray(costs.T), np.ascontiguousarray(err.T)
    choice = _cheapest_t(costs_t, err_t)
    min_cost = int(costs[rows, choice].sum())
    if min_cost > budget:
        return choice, min_cost, False

    # Hull edges by gift wrapping from the cheapest point, for all tensors at once: each round moves every tensor
    # whose hull goes on to its steepest next point (most error saved per extra bit; the farthest of collinear
    # points); tensors whose hull is complete drop out, so later rounds touch only the few with long hulls.
    edge_t, edge_to, edge_slope = [], [], []
    live, cur = rows, choice
    live_cost, live_err = costs_t.astype(np.float64), err_t
    prev_slope = np.full(tensors, np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        for _ in range(costs.shape[1]):
            cur_cost = np.take_along_axis(live_cost, cur[None, :], axis=0)
            cur_err = np.take_along_axis(live_err, cur[None, :], axis=0)
            slope = (cur_err - live_err) / (live_cost - cur_cost)
            slope[(live_err >= cur_err) | (live_cost <= cur_cost)] = -np.inf
            best_slope = slope.max(axis=0)
            has = best_slope > -np.inf
            if not has.all():
                if not has.any():
                    break
                live, slope, best_slope, live_cost, live_err, prev_slope = (
                    live[has], slope[:, has], best_slope[has], live_cost[:, has], live_err[:, has], prev_slope[has])
            cur = np.argmax(np.where(slope == best_slope, live_cost, -np.inf), axis=0)
            # Slopes fall strictly along a hull; clamping keeps that true under rounding, so that any sort by
            # slope keeps each tensor's upgrades in chain order.
            prev_slope = np.minimum(best_slope, np.nextafter(prev_slope, -np.inf))
            edge_t.append(live)
            edge_to.append(cur)
            edge_slope.append(prev_slope)
    if not edge_t:
        return choice, min_cost, True
    t = np.concatenate(edge_t)
    to = np.concatenate(edge_to)
    # Stable sort of (round-major, tensor-minor) edges: ties in slope go by position along the hull, then tensor.
    order = np.argsort(-np.concatenate(edge_slope), kind="stable")
    t, to = t[order], to[order]
    # Chain position of each edge (round index) follows from the order of rounds: count per tensor.
    seq = np.concatenate([np.full(e.size, k) for k, e in enumerate(edge_t)])[order]
    hull_to = np.empty((tensors, costs.shape[1]), dtype=np.int64)
    hull_to[t, seq] = to
    frm = np.where(seq > 0, hull_to[t, np.maximum(seq - 1, 0)], choice[t])
    dcost = costs[t, to] - costs[t, frm]

    remaining = budget - min_cost
    # The longest prefix that fits is taken at once (it respects every chain: slopes fall along a hull) ...
    taken = int(np.searchsorted(np.cumsum(dcost), remaining, side="right"))
    remaining -= int(dcost[:taken].sum())
    next_seq = np.zeros(tensors, dtype=np.int64)        # edges taken so far, per tensor
    np.add.at(next_seq, t[:taken], 1)
    moved = next_seq > 0
    choice[moved] = hull_to[moved, next_seq[moved] - 1]
    # ... then the rest one by one, skipping any edge whose predecessor on its chain was not taken.
    for k in np.flatnonzero(dcost[taken:] <= remaining) + taken:
        tk = t[k]
        if seq[k] == next_seq[tk] and dcost[k] <= remaining:
            choice[tk] = to[k]
            remaining -= int(dcost[k])
            next_seq[tk] += 1
        elif seq[k] == next_seq[tk]:
            next_seq[tk] = -1     # blocked: this edge no longer fits, so none after it may be taken
    return choice, min_cost, True


def greedy_error_bound(costs: np.ndarray, errors: np.ndarray, admissible: np.ndarray) -> float:
    """The largest single-tensor error range over admissible actions: an upper bound on ``allocate``'s gap to
    the optimum (looser than the largest hull edge, and cheap to compute)."""
    _, err = _check(costs, errors, admissible)
    if err.shape[0] == 0:
        return 0.0
    finite = np.where(np.isfinite(err), err, np.nan)
    return float(np.nanmax(np.nanmax(finite, axis=1) - np.nanmin(finite, axis=1)))


def allocate_exact(costs: np.ndarray, errors: np.ndarray, admissible: np.ndarray,
                   budget_bits_total: float) -> Allocation:
    """Exact multiple-choice knapsack by dynamic programming over Pareto frontiers (the test oracle).

    Exponential in the worst case; meant for small instances (tens of tensors, a handful of actions).
    """
    costs, err = _check(costs, errors, admissible)
    tensors = costs.shape[0]
    rows = np.arange(tensors)
    floor_choice = cheapest_admissible(costs, err, np.isfinite(err))
    min_cost = int(costs[rows, floor_choice].sum())
    if min_cost > budget_bits_total or tensors == 0:
        return Allocation(floor_choice, min_cost, float(err[rows, floor_choice].sum()), budget_bits_total,
                          min_cost, feasible=min_cost <= budget_bits_total)
    # frontier: list of (cost, error, choices) with strictly decreasing error as cost grows.
    frontier: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]
    for i in range(tensors):
        candidates = []
        for c0, e0, ch in frontier:
            for a in np.flatnonzero(np.isfinite(err[i])):
                c = c0 + int(costs[i, a])
                if c <= budget_bits_total:
                    candidates.append((c, e0 + float(err[i, a]), (*ch, int(a))))
        candidates.sort(key=lambda x: (x[0], x[1]))
        frontier = []
        for cand in candidates:
            if not frontier or cand[1] < frontier[-1][1]:
                frontier.append(cand)
    best = min(frontier, key=lambda x: (x[1], x[0]))
    choice = np.array(best[2], dtype=np.int64)
    return Allocation(choice, best[0], best[1], budget_bits_total, min_cost, True)
