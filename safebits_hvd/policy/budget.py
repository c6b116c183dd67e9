"""The per-step decisions of SCGB-EF (docs/DESIGN.md, "The algorithm as implemented"): what each tensor is
allocated, which actions the screen admits, the order in which a tensor escalates, and the modeled bits sent.

Everything here is deterministic and depends only on its inputs, never on the rank: every rank holds the same
reduced statistics after the exchange, so every rank makes the same decisions.

* **Start policy** (no statistics yet): each tensor gets the costliest action whose modeled cost fits the
  per-parameter budget (the cheapest action if none fits); the screen then applies as usual.
* **Allocation** (:mod:`.allocator`): minimise the total squared error, ``distortion * ||v||^2`` from the last
  step's reduced statistics, subject to the step's budget less the **escalation reserve**; actions not
  *plannable* (below) carry +inf. When even the cheapest plannable configuration exceeds the budget, that
  configuration is the **fallback** (``Allocation.feasible`` is False and the step records a violation).
* **Screen**: admissible iff ``distortion <= max_distortion`` and ``cosine >= min_cosine``; lossless always is.
  **Plannable**: admitted with :data:`PLANNING_MARGIN` to spare (what the exchanged ``screened`` statistics carry).
* **Escalation reserve**: :data:`RESERVE_FACTOR` times the largest overshoot (bits sent beyond the allocation, a
  fraction of the budget) of the last :data:`RESERVE_WINDOW` steps, learned from the reduced records by
  :meth:`BudgetPolicy.observe`, and never less than :data:`MIN_RESERVE` (none when the budget fits every tensor
  lossless).
* **Escalation guard**: the budget the plan leaves unspent must also cover one escalation of any tensor whose
  plan is at risk, and the escalations of all those likely to fail (:meth:`BudgetPolicy.escalation_guard`); if
  not, the plan is made again on a smaller budget. The reserve learns from escalations already seen; the guard
  covers the first one of a large tensor, which can move a step by more than the reserve's floor.
* **Escalation**: the allocated action if the current screen admits it, then the other admissible actions by
  ascending cost, then the lossless action; the first whose *exact* statistics pass (with
  :data:`~.screen.ACCEPT_MARGIN`) is sent.

"Position in cost order" is an action's index among a tensor's actions sorted by (modeled cost, menu order); the
exchange carries the position of the action sent, and its MAX over ranks is the costliest one any rank sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..codec.actions import Menu
from ..comm.statistics import StepStatistics
from .allocator import Allocation, allocate
from .screen import ACCEPT_MARGIN, ScreenRule
from .telemetry import StepArrays

PLANNING_MARGIN = 0.05
"""Default relative margin of the planning screen (:meth:`BudgetPolicy.plannable`), in the form of
:data:`~.screen.ACCEPT_MARGIN`: the allocation plans only with actions whose screen passed by this much."""

RESERVE_WINDOW = 100
"""Default number of past steps whose largest escalation overshoot sets the escalation reserve
(:meth:`BudgetPolicy.observe`); 0 turns the reserve off."""

RESERVE_FACTOR = 2.0
"""The reserve is this multiple of the window's largest overshoot. With the largest overshoot alone, every new
record of a heavy-tailed sequence of overshoots is a step over budget, and records keep coming (about ln n in n
steps); twice the record is rarely beaten (docs/RESULTS.md, section 9.2)."""

MIN_RESERVE = 0.05
"""The least reserve, as a fraction of the budget: before the first escalation has been seen the window is all
zeros, and that first escalation (a few steps in, as error feedback fills the residuals) would go over budget."""

GUARD_RISK_MARGIN = 0.5
"""The escalation guard (:meth:`BudgetPolicy.escalation_guard`) counts a tensor whose planned action's last
reduced distortion is above ``(1 - GUARD_RISK_MARGIN) * max_distortion``. A top-k plan's distortion can nearly
double in one step (0.29 to over 0.5 on the digits CNN's ``fc1.weight``), so 0.25 missed plans that failed; 1
(every tensor) left a 4.4-bit budget a quarter unspent (docs/RESULTS.md, section 9.3)."""

GUARD_LIKELY_MARGIN = 0.1
"""Plans whose last reduced distortion is above ``(1 - GUARD_LIKELY_MARGIN) * max_distortion`` are *likely* to
fail, and together: in the first steps, as error feedback fills the residuals, several ``sign`` plans at
0.43-0.46 failed in one step on the larger LM. The guard covers all of them escalating at once."""

GUARD_ROUNDS = 4
"""Re-plans at most this many times to leave room for the escalation guard (each on a smaller budget)."""


class BudgetPolicy:
    """Allocation, screening and escalation for ``len(numels)`` tensors over one menu.

    Attributes:
        costs: ``(tensors, actions)`` modeled bits of every action for every tensor, int64.
        lossless: per action, True for the always-admissible lossless action.
        cost_order: per tensor, menu indices in ascending (cost, menu order).
        position_in_cost_order: its inverse: per tensor and menu index, the position in ``cost_order``.
    """

    allocates_from_statistics = True
    """The allocation reads the last step's statistics, so every send measures the menu (``kernels.screen``)."""

    def __init__(self, menu: Menu, numels: np.ndarray, max_distortion: float, min_cosine: float,
                 screen: bool = True, planning_margin: float = PLANNING_MARGIN,
                 reserve_window: int = RESERVE_WINDOW) -> None:
        self.menu = menu
        self.numels = numels
        self.rule = ScreenRule(max_distortion, min_cosine)
        self.screen_enabled = screen
        self.planning_margin = planning_margin
        self.reserve_window = reserve_window
        # Learned across steps (checkpointed): the escalation overshoots of the last reserve_window steps, oldest
        # first, as fractions of their budgets (docs/DESIGN.md, "The algorithm as implemented").
        self.overshoot_history: list[float] = []
        actions = len(menu)
        tensors = len(numels)
        self.costs = np.array([menu.costs(int(n)) for n in numels], dtype=np.int64).reshape(tensors, actions)
        self.lossless = np.array([a.lossless for a in menu], dtype=bool)
        self.lossless_index = int(menu.lossless_index)
        self.cost_order = np.lexsort((np.broadcast_to(np.arange(actions), self.costs.shape), self.costs), axis=1)
        self.position_in_cost_order = np.argsort(self.cost_order, axis=1)
        # Costs by position, plus a last column of 0 bits that position -1 (nothing sent) reads.
        self._costs_by_position = np.concatenate([np.take_along_axis(self.costs, self.cost_order, axis=1),
                                                  np.zeros((tensors, 1), dtype=np.int64)], axis=1)
        self._rows = np.arange(tensors)
        self._lossless_columns = np.flatnonzero(self.lossless)
        self._lossless_bits = int(self.costs[:, self.lossless_index].sum())
        self._errors = np.empty((tensors, actions))   # reused every step: a fresh array faults its pages in

    @property
    def max_distortion(self) -> float:
        return self.rule.max_distortion

    @property
    def min_cosine(self) -> float:
        return self.rule.min_cosine

    @property
    def lossless_bits(self) -> int:
        """Modeled bits of every tensor sent lossless: a budget this large needs no compression."""
        return self._lossless_bits

    def fits_pass_through(self, budget_bits_total: float, packed: bool) -> bool:
        """Whether a step passes its gradients through (no screen, no packing): its budget fits every tensor
        uncompressed, on the dense path (``packed``: a path of SafeBits' own collectives), under a policy that
        allocates from statistics (not a fixed baseline's)."""
        return self.allocates_from_statistics and not packed and budget_bits_total >= self._lossless_bits

    def lossless_allocation(self, budget_bits_total: float) -> Allocation:
        """Every tensor at the lossless action (a pass-through step)."""
        choice = np.full(len(self.numels), self.lossless_index, dtype=np.int64)
        return Allocation(choice, self._lossless_bits, 0.0, budget_bits_total, self._lossless_bits,
                          self._lossless_bits <= budget_bits_total)

    # ------------------------------------------------------------------ allocation
    def allocate(self, bits_per_parameter: float, budget_bits_total: float,
                 screened: np.ndarray | None, v2: np.ndarray | None) -> Allocation:
        """The step's allocation from the last step's reduced ``screened`` distortions and ``v2`` (None before
        the first step: the start policy)."""
        if screened is None or v2 is None:
            return self.start_allocation(bits_per_parameter, budget_bits_total)
        # Squared error = normalized distortion * ||v||^2; +inf (screened out on some rank, or no statistics) stays
        # +inf: not admissible. Lossless always is, at zero error. v = 0 has zero error at any admissible action
        # (distortion 0), so weighting it by 1 changes nothing but keeps inf * 0 from making a NaN.
        weight = np.where(v2 > 0, v2, 1.0)
        errors = np.multiply(screened, weight[:, None], out=self._errors)
        errors[:, self._lossless_columns] = 0.0
        # No reserve when the budget fits every tensor lossless: then nothing can escalate past it.
        if budget_bits_total >= self._lossless_bits:
            planned, reserve, guard = allocate(self.costs, errors, None, budget_bits_total), 0.0, 0.0
        else:
            planned, reserve, guard = self._plan_with_reserve(errors, screened, budget_bits_total)
        # Feasibility is judged against the step's whole budget: the reserve only shapes the plan. When the reserve
        # leaves too little, the plan is the cheapest admissible configuration, which still fits the budget.
        return Allocation(planned.choice, planned.cost_bits, planned.squared_error, budget_bits_total,
                          planned.min_cost_bits, planned.min_cost_bits <= budget_bits_total, reserve, guard)

    def _plan_with_reserve(self, errors: np.ndarray, screened: np.ndarray,
                           budget_bits_total: float) -> tuple[Allocation, float, float]:
        """The plan within the budget less the escalation reserve, re-planned (at most :data:`GUARD_ROUNDS` times,
        on a smaller budget each time) until the budget left over also covers the plan's escalation guard; with
        the bits the reserve and the guard held back from the plan's budget."""
        reserve = budget_bits_total * self.reserve_fraction
        plan_budget = budget_bits_total - reserve
        planned = allocate(self.costs, errors, None, plan_budget)
        for _ in range(GUARD_ROUNDS):
            guard = self.escalation_guard(planned.choice, screened)
            if budget_bits_total - planned.cost_bits >= guard or planned.cost_bits <= planned.min_cost_bits:
                break
            plan_budget = min(plan_budget, budget_bits_total - guard) - 1   # strictly smaller: each round changes
            planned = allocate(self.costs, errors, None, plan_budget)
        return planned, reserve, budget_bits_total - reserve - plan_budget

    def escalation_guard(self, choice: np.ndarray, screened: np.ndarray) -> int:
        """Bits the escalations of the plan ``choice`` can add: the larger of one escalation of any tensor whose
        planned action is *at risk* (its last reduced distortion above ``(1 - GUARD_RISK_MARGIN) *
        max_distortion``) and all the escalations of those *likely* to fail (above ``(1 - GUARD_LIKELY_MARGIN) *
        max_distortion``). A tensor's escalation is the step from its planned action to the cheapest plannable
        action that costs more (the lossless one if none does): where it goes when its plan fails at send time.
        0 with the screen off."""
        if not self.screen_enabled:
            return 0
        rows = self._rows
        planned_cost = self.costs[rows, choice]
        planned_distortion = screened[rows, choice]
        at_risk = ~self.lossless[choice] & (planned_distortion > (1.0 - GUARD_RISK_MARGIN) * self.max_distortion)
        if not at_risk.any():
            return 0
        costs = self.costs[at_risk]
        above = np.isfinite(screened[at_risk]) & (costs > planned_cost[at_risk, None])
        next_cost = np.where(above, costs, np.iinfo(np.int64).max).min(axis=1)
        next_cost = np.minimum(next_cost, costs[:, self.lossless_index])     # the lossless action always passes
        steps = np.maximum(next_cost - planned_cost[at_risk], 0)
        likely = planned_distortion[at_risk] > (1.0 - GUARD_LIKELY_MARGIN) * self.max_distortion
        return int(max(steps.max(), steps[likely].sum()))

    @property
    def reserve_fraction(self) -> float:
        """The escalation reserve: the fraction of the budget that the allocation leaves unplanned,
        :data:`RESERVE_FACTOR` times the largest overshoot of the last ``reserve_window`` steps, at least
        :data:`MIN_RESERVE` and at most 1 (0 when ``reserve_window`` is 0, or with the screen off: nothing
        escalates then)."""
        if self.reserve_window <= 0 or not self.screen_enabled:
            return 0.0
        return min(1.0, max(MIN_RESERVE, RESERVE_FACTOR * max(self.overshoot_history, default=0.0)))

    def observe(self, budget_bits_total: float, allocated_bits: int, modeled_bits: int) -> None:
        """Learn from a finished step (the same reduced figures on every rank): its overshoot is the bits its
        escalations added beyond the allocation, as a fraction of its budget."""
        if self.reserve_window <= 0:
            return
        overshoot = max(0, modeled_bits - allocated_bits) / budget_bits_total if budget_bits_total > 0 else 0.0
        self.overshoot_history.append(overshoot)
        del self.overshoot_history[:-self.reserve_window]

    def start_allocation(self, bits_per_parameter: float, budget_bits_total: float) -> Allocation:
        """Start policy: the costliest action within ``bits_per_parameter`` per element, else the cheapest."""
        fits = self.costs <= bits_per_parameter * self.numels[:, None]
        positions = np.where(fits, self.position_in_cost_order, -1)
        best = positions.max(axis=1)
        choice = np.where(best >= 0, self.cost_order[self._rows, np.maximum(best, 0)], self.cost_order[:, 0])
        cost = int(self.costs[self._rows, choice].sum())
        return Allocation(choice, cost, float("nan"), budget_bits_total, cost, cost <= budget_bits_total)

    def budget_bits_total(self, bits_per_parameter: float, total_elements: int) -> float:
        """The step's budget in bits, all tensors."""
        return bits_per_parameter * total_elements

    # ------------------------------------------------------------------ screening and escalation
    def screen(self, distortion: np.ndarray, cosine: np.ndarray) -> np.ndarray:
        """Admissible actions of one tensor from the screen's estimates (every action admissible when off)."""
        if not self.screen_enabled:
            return np.ones(len(self.menu), dtype=bool)
        return self.rule.admissible(distortion, cosine, self.lossless)

    def plannable(self, distortion: np.ndarray, cosine: np.ndarray) -> np.ndarray:
        """Actions the next allocation may plan with: those the screen admits with ``planning_margin`` to spare
        (all of them when the screen is off)."""
        if not self.screen_enabled:
            return np.ones(len(self.menu), dtype=bool)
        return self.rule.admissible(distortion, cosine, self.lossless, self.planning_margin)

    def sent_passes(self, actions: Any, distortion: Any, cosine: Any, margin: float) -> Any:
        """Whether the exact statistics of what is sent pass the screen with ``margin`` (lossless and unscreened
        always do): per tensor on Python floats, or on NumPy arrays for a group (the same float64 arithmetic as
        :func:`~.screen.admissible`, through :func:`~.screen.passes`)."""
        return ((not self.screen_enabled) | self.lossless[actions]
                | self.rule.passes(distortion, cosine, margin))

    def send_order(self, index: int, allocated: int, ok: np.ndarray) -> list[int]:
        """Actions to try for tensor ``index``, in order: the allocated one if admissible, the other admissible
        ones by cost, the lossless one last (unscreened: only the allocated one)."""
        if not self.screen_enabled:
            return [allocated]
        order = [allocated] if ok[allocated] else []
        order += [int(a) for a in self.cost_order[index] if ok[a] and a != allocated and not self.lossless[a]]
        order.append(self.lossless_index)
        return order

    def accepts(self, action_index: int, distortion: float, cosine: float) -> bool:
        """Whether the exact statistics of what would be sent pass (:meth:`sent_passes` with
        :data:`~.screen.ACCEPT_MARGIN`)."""
        return bool(self.sent_passes(action_index, distortion, cosine, ACCEPT_MARGIN))

    # ------------------------------------------------------------------ accounting
    def modeled_bits(self, sent_position: np.ndarray) -> int:
        """Modeled bits of a step from each tensor's position in cost order of the action sent (-1: nothing)."""
        return int(self._costs_by_position[self._rows, sent_position].sum())

    def actions_sent(self, sent_position: np.ndarray) -> np.ndarray:
        """Menu index of the action sent per tensor (-1 where nothing was sent)."""
        return np.where(sent_position >= 0, self.cost_order[self._rows, np.maximum(sent_position, 0)], -1)

    def take_reduced(self, reduced: StepStatistics, allocation: Allocation, **record: Any) -> tuple[
            StepArrays, np.ndarray, np.ndarray]:
        """A finished step's reduced statistics as its record (``record``: the fields that are not statistics) and
        the next allocation's input ``(screened, v2)``; learns the step's overshoot (:meth:`observe`)."""
        sent_position = reduced.sent_position.astype(np.int64)
        nonfinite = reduced.nonfinite > 0
        arrays = StepArrays(modeled_bits_total=self.modeled_bits(sent_position),
                            planned_bits_total=allocation.cost_bits, reserve_bits=allocation.reserve_bits,
                            guard_bits=allocation.guard_bits,
                            sent=self.actions_sent(sent_position), allocated=allocation.choice,
                            distortion=reduced.sent_distortion.copy(), cosine=-reduced.neg_sent_cosine,
                            escalated=reduced.escalated > 0, nonfinite=nonfinite,
                            infeasible=not allocation.feasible, **record)
        # A non-finite tensor has no statistics: only the lossless action is known safe.
        screened = reduced.screened
        if nonfinite.any():
            screened[nonfinite] = np.where(self.lossless, 0.0, np.inf)
        v2 = reduced.v2
        self.observe(arrays.budget_bits_total, allocation.cost_bits, arrays.modeled_bits_total)
        return arrays, screened, np.where(np.isfinite(v2), v2, 0.0)


class FixedActionPolicy(BudgetPolicy):
    """Every tensor allocated one fixed action, no screen: the fixed-action baselines (:mod:`.baselines`)."""

    def __init__(self, menu: Menu, numels: np.ndarray, action_index: int) -> None:
        super().__init__(menu, numels, max_distortion=1.0, min_cosine=-1.0, screen=False)
        self.allocates_from_statistics = False
        self.action_index = action_index
        self.bits_per_step = int(self.costs[:, action_index].sum())

    def allocate(self, bits_per_parameter: float, budget_bits_total: float,
                 screened: np.ndarray | None, v2: np.ndarray | None) -> Allocation:
        choice = np.full(len(self.numels), self.action_index, dtype=np.int64)
        # The budget is what the fixed action costs (budget_bits_total): no violation is possible.
        return Allocation(choice, self.bits_per_step, float("nan"), budget_bits_total, self.bits_per_step, True)

    def budget_bits_total(self, bits_per_parameter: float, total_elements: int) -> float:
        return float(self.bits_per_step)     # exact: bits_per_parameter * total_elements may round

    def observe(self, budget_bits_total: float, allocated_bits: int, modeled_bits: int) -> None:
        """Nothing to learn: the fixed action is sent whatever happens."""
