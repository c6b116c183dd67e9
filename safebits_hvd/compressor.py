"""The Horovod compressor: :class:`SafeBits`, the one state object of SCGB-EF.

From the Horovod hook to the wire, for each gradient ``g`` of parameter ``i`` at step ``t``:

1. ``compress(g)`` finds ``i`` by identity (``p.grad is g``), and on the first gradient of a step computes the
   step's allocation from the previous step's reduced statistics (:mod:`.allocator`).
2. ``kernels.screen`` measures every menu action on ``v = g + e`` over a sample of whole buckets
   (all buckets for small tensors); :mod:`.screen` turns that into the admissible set.
3. The allocated action is sent if admissible; otherwise the tensor *escalates* to its cheapest admissible action.
   ``kernels.quantize_ef`` writes ``q = Q(v)`` to a fresh float32 wire tensor and ``e <- v - q`` in one pass
   and returns the exact statistics of ``q``; if they fail the screen, the next cheapest candidate is tried, and
   the lossless action always passes. So every sent tensor satisfies the screen exactly, whatever the sample said.
4. When every parameter of the step has been compressed, the step's statistics are exchanged (:mod:`.sync`),
   finished at the first ``decompress``; every rank then holds the same :class:`~.telemetry.StepRecord` and
   will compute the same next allocation.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import torch

from . import kernels
from .actions import DEFAULT_MENU, Menu, make_menu
from .allocator import Allocation, allocate
from .errors import SafeBitsConsistencyError, SafeBitsNonFiniteError
from .memory import ErrorFeedback
from .params import GradientIndex
from .rng import stream_key
from .schedules import as_schedule
from .screen import ACCEPT_MARGIN, admissible, distortion_cosine
from .sync import LocalExchange, allocation_digest, digest_words, make_exchange
from .telemetry import JsonlWriter, RateLimitedWarning, StepRecord, logger

try:  # Subclass Horovod's interface when Horovod is there; the object also works without it.
    from horovod.torch.compression import Compressor
except ImportError:  # pragma: no cover - exercised only without Horovod
    class Compressor:  # type: ignore[no-redef]
        """Stand-in for ``horovod.torch.compression.Compressor``."""

STATE_FORMAT = 2


class _StepArrays(NamedTuple):
    """A finished step as the reduced arrays (per tensor, in registration order); see ``SafeBits._step_record``."""

    step: int
    budget_bits_total: float
    used_bits_total: int
    rank_sent: np.ndarray       # rank by cost of the action sent (max over ranks), -1 if skipped
    allocated: np.ndarray       # action index the allocation chose
    distortion: np.ndarray      # of what was sent, max over ranks
    cosine: np.ndarray          # of what was sent, min over ranks
    escalated: np.ndarray       # bool
    skipped: np.ndarray         # bool
    allocation_digest: str
    infeasible: bool


class _ExchangeFields(NamedTuple):
    """The per-step statistics vector, MAX-reduced across ranks, as named views (one float64 array underneath).
    Quantities whose conservative combination is the minimum are stored negated."""

    screened: np.ndarray         # (tensors, actions): normalized distortion if the screen admits it, else +inf
    v2: np.ndarray               # ||v||^2 per tensor (+inf if unknown)
    rank_sent: np.ndarray        # rank by cost of the action sent (-1: nothing sent)
    escalated: np.ndarray        # 1 if the action sent was not the allocated one
    sent_distortion: np.ndarray  # of what was sent
    neg_sent_cosine: np.ndarray  # minus the cosine of what was sent
    skipped: np.ndarray          # 1 if the gradient was non-finite and skipped
    digest: np.ndarray           # the allocation digest as four 16-bit words
    neg_digest: np.ndarray       # the same, negated: MAX(-x) = -MIN(x), so equal MIN and MAX prove agreement


class _Context(NamedTuple):
    step: int
    shape: torch.Size
    dtype: torch.dtype


def _number(name: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return float(value)


class SafeBits(Compressor):
    r"""Safety-Constrained Global Bit Budgeting with Error Feedback, as a Horovod compressor.

    Every step, every gradient tensor gets one action from ``menu`` (fp32, fp16, bf16, QSGD 8/4/2-bit,
    TernGrad, scaled sign, top-k) under one global budget of ``budget_bits`` bits per parameter:

    * **Error feedback**: the compressor quantizes ``v = g + e`` and keeps ``e <- v - sent``.
    * **Screen**: an action is admissible only if, on the values really sent, ``||q - v||^2 / ||v||^2 <=
      max_distortion`` and ``cos(q, v) >= min_cosine``; fp32 always is. This is the EF contraction with
      ``alpha = max_distortion`` that the convergence analysis needs, enforced exactly for what is sent.
    * **Global allocation**: a multiple-choice knapsack minimising the total squared error subject to the budget,
      computed from the previous step's statistics (Horovod sends each gradient as soon as it is ready, so the
      allocation cannot wait for all of them). At send time the current screen decides: an allocated action that is
      not admissible now *escalates* to the tensor's cheapest admissible action, and the step records it.
    * **Fallback**: when even the cheapest admissible action of every tensor exceeds the budget, that
      configuration is used and the step records a budget *violation* (safety is never traded for budget).
    * **Start policy** (step 0, no statistics yet): each tensor is allocated the costliest action whose modeled
      cost fits ``budget_bits`` per element (the cheapest action if none fits); the screen then applies as usual.

    Args:
        named_parameters: ``(name, parameter)`` pairs (``model.named_parameters()``); gradients are matched to
            parameters by identity. Parameters with ``requires_grad=False`` are ignored, as Horovod ignores them.
        budget_bits: average bits per parameter per step (32 = no compression; 4.4 is about 7.2x), or a schedule,
            any callable ``step -> bits`` (see :mod:`safebits_hvd.schedules`). Default 4.0.
        max_distortion: ``d_bar`` in (0, 1]. Default 0.5.
        min_cosine: ``c_min`` in [-1, 1]. Default 0.8.
        menu: a :class:`~safebits_hvd.actions.Menu` or action names. Default :data:`~safebits_hvd.DEFAULT_MENU`.
        seed: seed of the counter-based stochastic-rounding RNG. Default 0.
        log_path: JSON-lines telemetry, one :class:`StepRecord` per step. With several ranks only rank 0 writes,
            unless the path contains ``{rank}``. Default None (no file).
        sample_buckets: buckets per tensor on which the screen estimates every action (tensors with fewer buckets
            are screened exactly). Default 16 (8,192 elements at the default bucket size).
        consistency_check_every: compare allocation digests across ranks every this many steps and raise
            :class:`~safebits_hvd.SafeBitsConsistencyError` on a mismatch; 0 disables. Default 1 (it rides on the
            statistics exchange, so it costs 64 bytes).
        nonfinite: ``"raise"`` (default): a NaN/Inf gradient raises :class:`~safebits_hvd.SafeBitsNonFiniteError`;
            ``"skip"``: that tensor sends zeros for the step, its residual is kept, and the record lists it.
        screen: False switches the screen off (the unscreened global-budgeting ablation; no guarantee).
        name: Horovod tensor name of the statistics exchange (distinct per compressor object). Default "safebits".
        max_history: records kept in :attr:`history` (the last one is always in :attr:`last_step`). Default 10000.

    Attributes:
        last_step: the :class:`StepRecord` of the last completed step (None before the first).
        history: the last ``max_history`` :class:`StepRecord` objects, oldest first (a new list on each read).
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                 budget_bits: float | Callable[[int], float] = 4.0, max_distortion: float = 0.5,
                 min_cosine: float = 0.8, menu: Menu | Iterable[str] = DEFAULT_MENU, seed: int = 0,
                 log_path: str | os.PathLike[str] | None = None, *, sample_buckets: int = 16,
                 consistency_check_every: int = 1, nonfinite: str = "raise", screen: bool = True,
                 name: str = "safebits", max_history: int = 10000) -> None:
        if isinstance(named_parameters, torch.nn.Module):
            raise TypeError("pass model.named_parameters(), not the model")
        pairs = list(named_parameters)
        names, params = [], []
        seen_names: set[str] = set()
        seen_params: set[int] = set()
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                    and isinstance(pair[1], torch.Tensor)):
                raise TypeError("named_parameters must yield (name, parameter) pairs, as model.named_parameters()")
            pname, p = pair
            if pname in seen_names:
                raise ValueError(f"duplicate parameter name {pname!r} in named_parameters")
            if id(p) in seen_params:
                raise ValueError(f"parameter {pname!r} is registered twice under different names")
            seen_names.add(pname)
            seen_params.add(id(p))
            if p.requires_grad:
                names.append(pname)
                params.append(p)
        if not params:
            raise ValueError("named_parameters holds no parameter with requires_grad=True")
        self.names: list[str] = names
        self._params: list[torch.nn.Parameter] = params
        self.numels = np.array([p.numel() for p in params], dtype=np.int64)

        self.schedule = as_schedule(budget_bits)
        if not callable(budget_bits):
            self.schedule(0)    # a constant is checked now
        self.max_distortion = _number("max_distortion", max_distortion, 0.0, 1.0, low_open=True)
        self.min_cosine = _number("min_cosine", min_cosine, -1.0, 1.0)
        self.menu = make_menu(menu)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.seed = seed
        if isinstance(sample_buckets, bool) or not isinstance(sample_buckets, int) or sample_buckets < 1:
            raise ValueError(f"sample_buckets must be an int >= 1, got {sample_buckets!r}")
        self.sample_buckets = sample_buckets
        if (isinstance(consistency_check_every, bool) or not isinstance(consistency_check_every, int)
                or consistency_check_every < 0):
            raise ValueError(f"consistency_check_every must be an int >= 0, got {consistency_check_every!r}")
        self.consistency_check_every = consistency_check_every
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.screen_enabled = bool(screen)
        self.exchange_name = name
        if isinstance(max_history, bool) or not isinstance(max_history, int) or max_history < 0:
            raise ValueError(f"max_history must be an int >= 0, got {max_history!r}")
        self.max_history = max_history
        self.log_path = os.fspath(log_path) if log_path is not None else None

        menu_size = len(self.menu)
        tensors = len(params)
        self.costs = np.array([self.menu.costs(int(n)) for n in self.numels], dtype=np.int64).reshape(-1, menu_size)
        self.lossless = np.array([a.lossless for a in self.menu], dtype=bool)
        # Per tensor, menu indices in ascending (cost, menu order): escalation order and the exchange's encoding.
        self._by_cost = np.lexsort((np.broadcast_to(np.arange(menu_size), self.costs.shape), self.costs), axis=1)
        self._rank_of = np.argsort(self._by_cost, axis=1)
        # Costs in that order, plus a last column of 0 bits that rank -1 (nothing sent) reads.
        self._costs_by_rank = np.concatenate([np.take_along_axis(self.costs, self._by_cost, axis=1),
                                              np.zeros((len(params), 1), dtype=np.int64)], axis=1)
        self.total_elements = int(self.numels.sum())

        self.memory = ErrorFeedback()
        # Finished steps, built into StepRecords when read (see last_step / history); the last one also on its own,
        # since max_history may be 0.
        self._records: list[StepRecord | _StepArrays] = []
        self._last: StepRecord | _StepArrays | None = None
        self._built = 0          # self._records[:self._built] are all StepRecords
        self._step = 0
        # Reduced statistics of the last finished step: the allocator's input (None before the first step).
        self._prev_screened: np.ndarray | None = None
        self._prev_v2: np.ndarray | None = None
        self._in_step = False
        self._pending: tuple[int, Any, Any] | None = None
        self._exchange: Any = None
        self._writer: JsonlWriter | None = None
        self._index = GradientIndex(self._params)
        self._param_names = np.array(self.names, dtype=object)
        self._action_names = np.array([*self.menu.names, "skipped"], dtype=object)
        # The exchanged vector: (start, stop) of each _ExchangeFields field, then (0, total length).
        sizes = [tensors * menu_size] + [tensors] * 6 + [4, 4]
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        self._exchange_layout = [*itertools.pairwise(bounds), (0, bounds[-1])]
        # Per-step arrays allocated once: a fresh array of this size faults its pages in every step (see _allocate).
        self._stat_buffers = (np.empty(bounds[-1]), np.empty(bounds[-1]))
        self._stat_fields = tuple(self._fields(buffer) for buffer in self._stat_buffers)
        self._errors = np.empty((tensors, menu_size))
        self._lossless_columns = np.flatnonzero(self.lossless)
        self._rows = np.arange(tensors)
        self._samples: dict[int, torch.Tensor | None] = {}
        self._violation_warning = RateLimitedWarning("budget violations")
        self._escalation_warning = RateLimitedWarning("steps with escalations")

    # ------------------------------------------------------------------ Horovod's interface
    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, _Context]:
        """Quantize one gradient (with error feedback) for the wire.

        Returns a flat float32 tensor of ``tensor.numel()`` elements holding the dequantized values (the modeled
        wire format is what the budget counts), and the context :meth:`decompress` needs.
        """
        index = self._index.find(tensor, ~self._done if self._in_step else None)
        if self._in_step and self._done[index]:
            # A parameter came twice: the previous step never compressed some registered parameters.
            missing = [self.names[i] for i in np.flatnonzero(~self._done)]
            logger.warning("SafeBits step %d closed with %d registered parameters never compressed (e.g. %s); "
                           "pass SafeBits the same parameters as the optimizer", self._step, len(missing),
                           missing[:3])
            self._close_step()
        if not self._in_step:
            self._begin_step()
        out = self._send(index, tensor)
        self._done[index] = True
        self._remaining -= 1
        ctx = _Context(self._step, tensor.shape, tensor.dtype)
        if self._remaining == 0:
            self._close_step()
        return out, ctx

    def decompress(self, tensor: torch.Tensor, ctx: _Context) -> torch.Tensor:
        """The reduced wire tensor back in the gradient's shape and dtype (finishes the step's exchange)."""
        if self._pending is not None and self._pending[0] == ctx.step:
            self._finish_exchange()
        if tensor.dtype != ctx.dtype:
            tensor = tensor.to(ctx.dtype)
        return tensor.view(ctx.shape)

    # ------------------------------------------------------------------ one step
    def _budget_now(self) -> float:
        bits = self.schedule(self._step)
        if isinstance(bits, bool) or not isinstance(bits, int | float) or not math.isfinite(bits) or bits <= 0:
            raise ValueError(f"budget schedule {self.schedule!r} returned {bits!r} at step {self._step}; "
                             f"it must return a finite number of bits per parameter > 0")
        return float(bits)

    def _begin_step(self) -> None:
        if self._pending is not None:
            self._finish_exchange()
        bits_per_element = self._budget_now()
        self._budget_total = bits_per_element * self.total_elements
        self._allocation = self._allocate(bits_per_element, self._budget_total)
        self._digest = allocation_digest(self._step, self._budget_total, self._allocation.choice)
        tensors = self.costs.shape[0]
        self._done = np.zeros(tensors, dtype=bool)
        self._remaining = tensors
        # The step's statistics go straight into the vector _close_step will send and the exchange reduces in place.
        # Two vectors, by step parity: the allocation just made read the last step's, which must stay intact.
        # A tensor never compressed keeps these values: only its lossless action is known to be safe.
        self._stats = self._stat_buffers[self._step % 2]
        fields = self._stat_fields[self._step % 2]
        fields.screened[:] = np.where(self.lossless, 0.0, np.inf)
        fields.v2[:] = 0.0
        fields.rank_sent[:] = -1.0
        fields.escalated[:] = 0.0
        fields.sent_distortion[:] = 0.0
        fields.neg_sent_cosine[:] = -1.0
        fields.skipped[:] = 0.0
        fields.digest[:] = digest_words(self._digest)
        fields.neg_digest[:] = -fields.digest
        self._step_fields = fields
        self._in_step = True

    def _fields(self, vector: np.ndarray) -> _ExchangeFields:
        """Named views of an exchanged vector (local or reduced) by :attr:`_exchange_layout`."""
        views = [vector[start:stop] for start, stop in self._exchange_layout[:-1]]
        views[0] = views[0].reshape(self.costs.shape)
        return _ExchangeFields(*views)

    def _allocate(self, bits_per_element: float, budget_total: float) -> Allocation:
        rows = self._rows
        if self._prev_screened is None:
            # Start policy: the costliest action within budget_bits per element, else the cheapest.
            fits = self.costs <= bits_per_element * self.numels[:, None]
            ranked = np.where(fits, self._rank_of, -1)
            best_rank = ranked.max(axis=1)
            choice = np.where(best_rank >= 0, self._by_cost[rows, np.maximum(best_rank, 0)], self._by_cost[:, 0])
            cost = int(self.costs[rows, choice].sum())
            return Allocation(choice, cost, float("nan"), budget_total, cost, cost <= budget_total)
        # Squared error = normalized distortion * ||v||^2; +inf (screened out on some rank, or no statistics) stays
        # +inf: not admissible. Lossless always is, at zero error. v = 0 has zero error at any admissible action
        # (distortion 0), so weighting it by 1 changes nothing but keeps inf * 0 from making a NaN.
        weight = np.where(self._prev_v2 > 0, self._prev_v2, 1.0)
        errors = np.multiply(self._prev_screened, weight[:, None], out=self._errors)
        errors[:, self._lossless_columns] = 0.0
        return allocate(self.costs, errors, None, budget_total)

    def _sample_of(self, index: int, n: int, device: torch.device) -> torch.Tensor | None:
        if index not in self._samples:
            buckets = -(-n // self.menu.bucket_size)
            if buckets <= self.sample_buckets:
                sample = None
            else:   # evenly spaced whole buckets: unbiased for the per-bucket quantizers, same RNG draws
                sample = ((torch.arange(self.sample_buckets, dtype=torch.float64) + 0.5)
                          * (buckets / self.sample_buckets)).floor().to(torch.int64).to(device)
            self._samples[index] = sample
        return self._samples[index]

    def _send(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        name = self.names[index]
        if tensor.is_sparse:
            raise TypeError(f"SafeBits got a sparse gradient for {name!r}; use "
                            f"hvd.DistributedOptimizer(..., sparse_as_dense=True)")
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"gradient of {name!r} has dtype {tensor.dtype}; SafeBits compresses floating point")
        n = tensor.numel()
        if n != self.numels[index]:
            raise ValueError(f"gradient of {name!r} has {n} elements, its parameter {self.numels[index]}")
        g = tensor.detach().reshape(-1)
        if g.dtype != torch.float32:
            g = g.to(torch.float32)
        g = g.contiguous()
        e = self.memory.residual(name, n, g.device)
        out = torch.empty(n, dtype=torch.float32, device=g.device)
        if n and not math.isfinite(float(g.sum())) and not bool(torch.isfinite(g).all()):
            if self.nonfinite == "raise":
                raise SafeBitsNonFiniteError(f"gradient of {name!r} holds NaN or Inf at step {self._step}; "
                                             f"nothing was sent and its error-feedback residual is unchanged "
                                             f"(SafeBits(nonfinite='skip') sends zeros instead)")
            out.zero_()
            self._step_fields.skipped[index] = 1.0
            self._step_fields.v2[index] = math.inf
            return out

        key = stream_key(self.seed, self._step, index)
        estimate = kernels.screen(g, e, self.menu, key, self._sample_of(index, n, g.device)).cpu().numpy()
        distortion, cosine = distortion_cosine(estimate)
        allocated = int(self._allocation.choice[index])
        fields = self._step_fields
        if self.screen_enabled:
            ok = admissible(distortion, cosine, self.lossless, self.max_distortion, self.min_cosine)
            # What the allocator needs of an action is its distortion if the screen admits it, +inf if not; the
            # MAX over ranks then admits an action only if every rank's screen did, at the largest distortion.
            fields.screened[index] = np.where(ok, distortion, np.inf)
            by_cost = self._by_cost[index]
            candidates = [allocated] if ok[allocated] else []
            candidates += [int(a) for a in by_cost if ok[a] and a != allocated and not self.lossless[a]]
            candidates.append(int(self.menu.lossless_index))
        else:
            fields.screened[index] = distortion
            candidates = [allocated]

        source: torch.Tensor | None = g
        for attempt, action_index in enumerate(candidates):
            if attempt:
                e.add_(out)          # e held v - q: restore v (to float rounding) and quantize it again
                source = None
            stats = kernels.quantize_ef(source, e, out, self.menu[action_index], key).cpu().numpy()
            d, c = distortion_cosine(stats)
            if (not self.screen_enabled or self.lossless[action_index]
                    or admissible(d, c, False, self.max_distortion, self.min_cosine, ACCEPT_MARGIN)):
                break
        fields.rank_sent[index] = self._rank_of[index, action_index]
        fields.escalated[index] = action_index != allocated
        fields.sent_distortion[index] = d
        fields.neg_sent_cosine[index] = -c
        fields.screened[index, action_index] = d      # the exact figure beats the estimate (and passed the screen)
        v2 = float(stats[3])
        fields.v2[index] = v2 if math.isfinite(v2) else math.inf     # never NaN: NaN would poison the MAX
        return out

    def _close_step(self) -> None:
        """All of the step's gradients are on their way: start the statistics exchange."""
        if self._exchange is None:
            self._exchange = make_exchange(self.exchange_name)
        self._pending = (self._step, self._exchange.start(self._stats), self._budget_total)
        self._in_step = False
        self._step += 1
        if isinstance(self._exchange, LocalExchange):
            self._finish_exchange()

    def _finish_exchange(self) -> None:
        step, handle, budget_total = self._pending
        self._pending = None
        reduced_vector = self._exchange.wait(handle)      # in place: the step's own vector, now reduced
        if reduced_vector.__array_interface__["data"] != self._stat_buffers[step % 2].__array_interface__["data"]:
            self._stat_buffers[step % 2][:] = reduced_vector
        reduced = self._stat_fields[step % 2]
        rank_sent = reduced.rank_sent.astype(np.int64)
        # Column -1 of the cost-ordered costs is 0: a skipped tensor (rank -1) sent nothing.
        used = int(self._costs_by_rank[self._rows, rank_sent].sum())
        skipped = reduced.skipped > 0
        record = _StepArrays(step=step, budget_bits_total=budget_total, used_bits_total=used, rank_sent=rank_sent,
                             allocated=self._allocation.choice, distortion=reduced.sent_distortion.copy(),
                             cosine=-reduced.neg_sent_cosine, escalated=reduced.escalated > 0, skipped=skipped,
                             allocation_digest=self._digest, infeasible=not self._allocation.feasible)
        # The next allocation's input. A skipped tensor has no statistics: only the lossless action is known safe.
        screened = reduced.screened
        if skipped.any():
            screened[skipped] = np.where(self.lossless, 0.0, np.inf)
        v2 = reduced.v2
        self._prev_screened, self._prev_v2 = screened, np.where(np.isfinite(v2), v2, 0.0)
        self._record(record)
        if (self.consistency_check_every and step % self.consistency_check_every == 0
                and (reduced.digest + reduced.neg_digest).any()):       # MAX - MIN of each word: 0 if all agree
            raise SafeBitsConsistencyError(
                f"ranks disagree on the allocation of step {step} (this rank's digest {self._digest}); every rank "
                f"must build SafeBits with the same parameters, menu, budget and thresholds")

    def _step_record(self, arrays: _StepArrays) -> StepRecord:
        """The :class:`StepRecord` of a step's reduced arrays (built when first read: 1,000 tensors take ~0.3 ms,
        more than the exchange itself)."""
        used, budget = arrays.used_bits_total, arrays.budget_bits_total
        action_names = self._action_names           # index -1 (nothing sent) reads "skipped"
        rank_sent = arrays.rank_sent
        sent = np.where(rank_sent >= 0, self._by_cost[self._rows, np.maximum(rank_sent, 0)], -1)
        return StepRecord(
            step=arrays.step, budget_bits_total=budget, used_bits_total=used,
            compression_ratio=(32.0 * self.total_elements / used) if used else math.inf,
            violation=used > budget, excess_bits=max(0.0, used - budget),
            escalations=self._param_names[arrays.escalated].tolist(),
            actions=dict(zip(self.names, action_names[sent].tolist(), strict=True)),
            distortion=dict(zip(self.names, arrays.distortion.tolist(), strict=True)),
            cosine=dict(zip(self.names, arrays.cosine.tolist(), strict=True)),
            allocation_digest=arrays.allocation_digest,
            allocated=dict(zip(self.names, action_names[arrays.allocated].tolist(), strict=True)),
            skipped=self._param_names[arrays.skipped].tolist(),
            infeasible=arrays.infeasible)

    @property
    def last_step(self) -> StepRecord | None:
        """The :class:`StepRecord` of the last completed step (None before the first)."""
        if isinstance(self._last, _StepArrays):
            built = self._step_record(self._last)
            if self._records and self._records[-1] is self._last:
                self._records[-1] = built
            self._last = built
        return self._last

    @property
    def history(self) -> list[StepRecord]:
        """The last ``max_history`` :class:`StepRecord` objects, oldest first (a new list each time)."""
        records = self._records
        for i in range(self._built, len(records)):          # only records added since the last call
            if isinstance(records[i], _StepArrays):
                built = self._step_record(records[i])
                if records[i] is self._last:
                    self._last = built
                records[i] = built
        self._built = len(records)
        return list(records)

    def _record(self, arrays: _StepArrays) -> None:
        self._last = arrays
        self._records.append(arrays)
        excess = len(self._records) - self.max_history
        if excess > 0:
            del self._records[:excess]
            self._built = max(0, self._built - excess)
        if self.log_path is not None:
            if self._writer is None:
                rank = self._rank()
                if "{rank}" in self.log_path or rank == 0:
                    self._writer = JsonlWriter(self.log_path.format(rank=rank))
            if self._writer is not None:
                self._writer.write(self.last_step)
        observe = getattr(self.schedule, "observe", None)
        if observe is not None:
            observe(self.last_step)
        used, budget = arrays.used_bits_total, arrays.budget_bits_total
        if used > budget:
            self._violation_warning(
                "SafeBits step %d: budget violation, %d bits used for a budget of %.0f (excess %.0f)%s",
                arrays.step, used, budget, used - budget, ": no safe assignment fits" if arrays.infeasible else "")
        if arrays.escalated.any() and self._escalation_warning.tick():
            escalations = self._param_names[arrays.escalated]
            self._escalation_warning.log("SafeBits step %d: %d tensors escalated (e.g. %s)", arrays.step,
                                         len(escalations), escalations[:3].tolist())

    def _rank(self) -> int:
        exchange = self._exchange
        if exchange is None or isinstance(exchange, LocalExchange):
            return 0
        import horovod.torch as hvd

        return hvd.rank()

    def flush(self) -> None:
        """Finish a pending statistics exchange (``decompress`` does this; call it if you only ``compress``)."""
        if self._pending is not None:
            self._finish_exchange()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically, as plain tensors, numbers and strings.

        Call between optimizer steps. Under Horovod each rank saves its own (the residuals are per rank).
        """
        if self._in_step:
            raise RuntimeError("SafeBits.state_dict() called in the middle of a step; call it between steps")
        self.flush()
        schedule_state = getattr(self.schedule, "state_dict", None)
        prev = self._prev_screened is not None
        return {
            "format": STATE_FORMAT,
            "step": self._step,
            "seed": self.seed,
            "names": list(self.names),
            "numels": [int(n) for n in self.numels],
            "menu": self.menu.names,
            "residuals": self.memory.state_dict(),
            "prev_screened": torch.from_numpy(self._prev_screened.copy()) if prev else None,
            "prev_v2": torch.from_numpy(self._prev_v2.copy()) if prev else None,
            "schedule": schedule_state() if schedule_state is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises ``ValueError`` if it was saved for another model or menu."""
        if not isinstance(state, dict) or "format" not in state:
            raise ValueError(f"not a SafeBits state dict (format {STATE_FORMAT}): got "
                             + (f"keys {sorted(state)[:8]}" if isinstance(state, dict) else type(state).__name__))
        if state["format"] != STATE_FORMAT:
            raise ValueError(f"SafeBits state of format {state['format']!r}; this version reads format {STATE_FORMAT}")
        if state["names"] != self.names or state["numels"] != [int(n) for n in self.numels]:
            raise ValueError(f"this SafeBits state was saved for a different model: {len(state['names'])} "
                             f"parameters (first {state['names'][:3]}) vs {len(self.names)} here "
                             f"(first {self.names[:3]}), or different sizes")
        if state["menu"] != self.menu.names:
            raise ValueError(f"state saved with menu {state['menu']}, this object has {self.menu.names}")
        unknown = set(state["residuals"]) - set(self.names)
        if unknown:
            raise ValueError(f"state holds residuals of unknown parameters {sorted(unknown)[:3]}")
        if self._in_step or self._pending is not None:
            raise RuntimeError("load_state_dict() must be called between steps")
        self.memory.load_state_dict(state["residuals"])
        self._step = int(state["step"])
        self.seed = int(state["seed"])
        if state["prev_screened"] is None:
            self._prev_screened = self._prev_v2 = None
        else:
            self._prev_screened = state["prev_screened"].numpy().copy()
            self._prev_v2 = state["prev_v2"].numpy().copy()
        if state["schedule"] is not None and hasattr(self.schedule, "load_state_dict"):
            self.schedule.load_state_dict(state["schedule"])

    @property
    def step(self) -> int:
        """Index of the next step to be compressed (the number of steps begun and closed)."""
        return self._step
