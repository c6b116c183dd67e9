"""What compression costs in quality: the gradient's sampling noise against the error a budget adds
(docs/DESIGN.md, "budget_bits='auto'", "Quality: compression error against sampling noise").

Ranks see different batches, so the mean gradient ``ḡ`` they apply is itself a noisy estimate of the true one. Its
sampling variance, from the spread of the ranks' gradients around their mean (the gradient noise scale; its source
is in docs/DESIGN.md), is

    σ² = (M - G) / (P - 1),   M = mean over ranks of ||g_r||²,   G = ||ḡ||²,   P ranks.

Compression adds to ``ḡ`` the mean of the ranks' errors; stochastic rounding makes them independent across ranks, so
its expected squared norm is ``ε² = mean_r ||q_r - v_r||² / P``. An SGD step whose noise grows from ``σ²`` to
``σ² + ε²`` is worth at least ``1 / (1 + ε²/σ²)`` of an uncompressed one (the noise term of the step's expected
progress grows by that factor, the rest is unchanged), so a budget whose ``ε²`` stays within a fraction ``κ`` of
``σ²`` costs at most ``κ / (1 + κ)`` of a step's progress. That is :class:`QualityGate`'s rule.

The parts, in the order a step meets them:

* :class:`NoiseMeter`: this rank's ``||g_r||²`` as its gradients are handed over and ``||ḡ||²`` of the reduced ones
  at the step's end, on their device, one step in :data:`NOISE_EVERY`; published a step late, so that a GPU never
  waits for them.
* the exchange: each rank's ``M`` (as is and negated: the MAX gives the largest and the smallest) and its ``G`` in
  the statistics vector (:mod:`.statistics`, field ``noise``), agreed like everything else there.
* :func:`sampling_noise` and :func:`budget_errors`: ``σ²`` from the reduced figures, and the ``ε²`` of each
  candidate budget from the screen's reduced statistics (the allocation the budget would get, its squared error).
* :class:`QualityGate`: which budgets ``auto`` may choose (:class:`.auto.Auto`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from ..codec import host

ERROR_TO_NOISE = 0.01
"""``κ``, the default: a budget's compression error may reach this fraction of the gradient's sampling noise. The
bound of the module docstring would allow more; measured, error feedback's delayed updates cost more than noise of
the same size. On the race's transformer at 100 Mbit/s (``bench.race``, seed 0), a fixed 3 bits sent 1.5-6% of the
noise and ended 0.017 nats per byte above a fixed 4.4 bits, which sent 0.2-1% and ended as ``none`` does."""

NOISE_WINDOW = 9
"""Measured steps whose noise :class:`QualityGate` takes the median of: one step's ``M - G`` at two ranks is one
sample of the spread (``||g_1 - g_2||² / 4``), and the median of nine sees through single outliers."""

ERROR_WINDOW = 5
"""Compressed steps whose predicted errors :class:`QualityGate` takes the median of, per budget: one step's screen
estimates on a sample of buckets, and its residual may be a switch's."""

NOISE_EVERY = 4
"""The noise is measured on one step in this many: it changes slowly, and measuring costs a dot product per tensor
as it is handed over (Horovod's compress takes one at a time) and one pass over the reduced gradients at the end.
:class:`QualityGate`'s window of :data:`NOISE_WINDOW` measurements then spans 36 steps."""

UNKNOWN = -math.inf
"""The value of an unmeasured figure in the exchanged vector: MAX keeps any rank's measured one."""


class NoiseMeter:
    """This rank's gradient norms over a step, every :data:`NOISE_EVERY` steps (:meth:`begin`): ``||g||²`` of what
    it hands over (:meth:`local`) and ``||ḡ||²`` of the reduced values it gets back (:meth:`reduced`), on their
    device. :meth:`publish`, at a step's end, starts copying the step's two sums to the host and returns the last
    measured step's, which have arrived by then: a GPU step never waits for them (where they have not, the wait is
    counted as a read, :mod:`.host`). Inactive (``active`` False: no schedule reads the noise), it measures nothing.
    """

    def __init__(self, active: bool = True, every: int = NOISE_EVERY) -> None:
        self.active, self.every = active, every
        self.measuring = False                           # the step in progress is measured
        self._step = -1
        self._local: list[torch.Tensor] = []             # ||g||² of each gradient handed over (0-d, on its device)
        self._reduced: list[torch.Tensor] = []           # the reduced gradients, read at the end (sharded: ||.||²)
        self._copy: tuple[int, host.HostCopy] | None = None     # a measured step's sums, on their way to the host
        # A sharded front end's SUM over ranks: each rank gets back only its shard of the mean, whose ||.||² add up
        # to ||ḡ||² (run at every measured step's end on every rank, whatever it holds). Its shards are views of
        # its buffers: kept to the step's end they would hold every module's unsharded gradient, so their norms are
        # taken as they come back.
        self.sum_over_shards: Callable[[torch.Tensor], torch.Tensor] | None = None

    def begin(self, step: int) -> None:
        """Step ``step`` begins: measured if it is one of every :data:`NOISE_EVERY`."""
        self._step, self._local, self._reduced = step, [], []
        self.measuring = self.active and step % self.every == 0

    def local(self, tensors: list[torch.Tensor]) -> None:
        """This rank's gradients as handed over: measured now, since a front end may reduce one in place later
        (Horovod allreduces a gradient passed through where it is)."""
        if not self.measuring or not tensors:
            return
        if len(tensors) == 1:          # Horovod's compress, one at a time: one small op
            flat = tensors[0].reshape(-1)
            flat = flat if flat.dtype == torch.float32 else flat.float()
            self._local.append(torch.dot(flat, flat))
        else:                          # a group: one pass over all of them
            self._local.append(torch.stack(torch._foreach_norm(tensors)).double().square().sum())
        if tensors[0].device.type == "cuda":
            host.launched(1 if len(tensors) == 1 else 5)

    def reduced(self, tensors: list[torch.Tensor]) -> None:
        """Reduced gradients as the front end gets them back (their mean over ranks): kept, and read at the step's
        end, when every one is there (one pass over all of them)."""
        if not self.measuring:
            return
        if self.sum_over_shards is None:
            self._reduced.extend(t for t in tensors if t.numel())
        elif any(t.numel() for t in tensors):      # a sharded front end's: measured now (see __init__)
            self._reduced.append(squared_norm([t for t in tensors if t.numel()]))

    def publish(self) -> tuple[int, np.ndarray] | None:
        """The end of a step: a measured step's sums start for the host; returns the last measured step's, with its
        index, if they have not been returned yet (else None)."""
        previous = None
        if self._copy is not None:
            step, copy = self._copy
            previous, self._copy = (step, host.arrived(copy)), None
        if self.measuring and (self._reduced or self.sum_over_shards is not None):
            if self.sum_over_shards is not None:      # the shards' ||ḡ_r||², each taken when it came back
                device = self._local[0].device if self._local else None
                reduced = self.sum_over_shards(torch.stack(self._reduced).sum() if self._reduced else
                                               torch.zeros((), dtype=torch.float64, device=device))
            else:
                reduced = squared_norm(self._reduced)
            if self._local:
                sums = torch.stack([torch.stack(self._local).double().sum(), reduced])
                self._copy = (self._step, host.copy_to_host(sums))
                if sums.device.type == "cuda":
                    host.launched(10)    # the stacks, casts and sums, the norms, the copy
        self.measuring, self._local, self._reduced = False, [], []
        return previous

    def reset(self) -> None:
        """Forget the step in progress and any measured one not published (a step was aborted; a state was
        loaded)."""
        self.measuring, self._local, self._reduced, self._copy = False, [], [], None


def noise_values(published: np.ndarray | None) -> np.ndarray:
    """What a rank puts in the exchanged ``noise`` field: ``(M_r, -M_r, G_r)`` of the sums :meth:`NoiseMeter.publish`
    returned, or :data:`UNKNOWN` where it returned none (or a non-finite gradient made them so)."""
    if published is None or not np.isfinite(published).all():
        return np.full(3, UNKNOWN)
    local, reduced = float(published[0]), float(published[1])
    return np.array([local, -local, reduced])


class Noise(NamedTuple):
    """The sampling noise of one step, from the reduced ``noise`` field (NaN where unknown)."""

    local_norm2: float          # M, the mean over ranks of ||g_r||² (exact at two ranks, the midrange at more)
    reduced_norm2: float        # G, ||ḡ||², less the compression error the step added to it
    sampling: float             # σ² = (M - G) / (P - 1), at least 0


def sampling_noise(reduced: np.ndarray, ranks: int, compression_error: float) -> Noise:
    """``σ²`` from the reduced ``noise`` field (:func:`noise_values`, MAX over ranks) of a step of ``ranks`` ranks
    whose compression added ``compression_error`` (``ε²``) to its mean.

    ``M`` is the midrange of the ranks' ``||g_r||²`` (the MAX gives only the largest and the smallest): their mean
    at two ranks, and within their spread, small against their size, at more. A reduced norm far above every
    rank's is no mean (``||ḡ|| <= max_r ||g_r||``, give or take a decoded mean's residuals) but a sum (Horovod's
    ``op=Sum``), whose square is ``P`` (pure noise) to ``P²`` times the ranks' mean: above ``(1 + P) / 2`` times
    the largest rank's, ``G`` is divided by ``P²``. The decoded mean carries the step's compression error, which is
    taken off ``G``."""
    nan = Noise(math.nan, math.nan, math.nan)
    if ranks < 2 or not np.isfinite(reduced).all():
        return nan
    largest, smallest, mean_norm2 = float(reduced[0]), -float(reduced[1]), float(reduced[2])
    if not largest > 0:
        return nan
    if mean_norm2 > largest * (1 + ranks) / 2:
        mean_norm2 /= ranks * ranks
    local = 0.5 * (largest + smallest)
    mean_norm2 = max(0.0, mean_norm2 - (compression_error if math.isfinite(compression_error) else 0.0))
    return Noise(local, mean_norm2, max(0.0, local - mean_norm2) / (ranks - 1))


def squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the tensors' ``||t||²``, in float64 (each norm taken in its tensor's dtype): a 0-d tensor."""
    return torch.stack(torch._foreach_norm(tensors)).double().square().sum()


def sent_error(distortion: np.ndarray, v2: np.ndarray, ranks: int) -> float:
    """``ε²`` of what a step sent: the sum over tensors of the normalized distortion sent times ``||v||²`` (both the
    largest over ranks), over ``P`` (module docstring); non-finite tensors (sent as they are) count 0."""
    errors = distortion * v2
    return float(errors[np.isfinite(errors)].sum()) / max(1, ranks)


def budget_errors(policy: Any, budgets: list[float], screened: np.ndarray, v2: np.ndarray, total_elements: int,
                  ranks: int) -> dict[float, float]:
    """``ε²`` of each compressed budget in ``budgets`` (bits per parameter) had it run on these reduced screen
    statistics: the squared error of the allocation :class:`~.budget.BudgetPolicy` would make, over ``P``."""
    return {bits: policy.allocate(bits, policy.budget_bits_total(bits, total_elements), screened,
                                  v2).squared_error / max(1, ranks)
            for bits in budgets}


class QualityGate:
    """Which budgets ``auto`` may choose: those whose compression error stays within ``error_to_noise`` (``κ``) of
    the gradient's sampling noise (module docstring). Reads, per finished step (:meth:`observe`), the noise and the
    error every budget would have added at that step (the screen's prediction, :func:`budget_errors`), both
    relative to ``M``, and takes the median of the last :data:`NOISE_WINDOW` noises and of the last
    :data:`ERROR_WINDOW` predictions per budget. A pass-through step predicts nothing: the predictions of the last
    compressed steps stand (a budget's relative error changes slowly). The predictions are made on the values the
    step compressed, error feedback's residual included: the residual of the budget running, which a budget with
    fewer bits lets grow once it runs, and then predicts higher. Decided from reduced figures only, so every rank
    agrees; checkpointed."""

    def __init__(self, error_to_noise: float = ERROR_TO_NOISE) -> None:
        if not (isinstance(error_to_noise, int | float) and math.isfinite(error_to_noise) and error_to_noise > 0):
            raise ValueError(f"error_to_noise must be a finite number > 0, got {error_to_noise!r}")
        self.error_to_noise = float(error_to_noise)
        self.noises: list[float] = []                  # σ² / M of the last steps measured, oldest first
        self.errors: dict[float, list[float]] = {}     # ε² / M per budget, of the last compressed steps
        self.local_norm2 = 0.0                         # the last M measured (0: none yet)
        self.fed = False                               # whether any step's figures came (not on simulated telemetry)

    def observe(self, noise: Noise, predicted: dict[float, float]) -> None:
        """A finished step's noise (NaN: not measured; it describes the step before) and the error its screen
        predicts per budget (empty: none)."""
        self.fed = True
        if noise.local_norm2 > 0 and math.isfinite(noise.sampling):
            self.local_norm2 = noise.local_norm2
            self.noises = [*self.noises, noise.sampling / noise.local_norm2][-NOISE_WINDOW:]
        if self.local_norm2 > 0:
            for bits, error in predicted.items():
                self.errors[bits] = [*self.errors.get(bits, []), error / self.local_norm2][-ERROR_WINDOW:]

    def error(self, bits: float) -> float | None:
        """``ε² / M`` of ``bits``, the median of its last predictions (None while none)."""
        return statistics.median(self.errors[bits]) if self.errors.get(bits) else None

    @property
    def noise(self) -> float | None:
        """``σ² / M``, the median over the window (None before a step is measured)."""
        return statistics.median(self.noises) if self.noises else None

    def ratio(self, bits: float) -> float | None:
        """``ε² / σ²`` predicted for ``bits`` (None while either is unknown)."""
        noise, error = self.noise, self.error(bits)
        if noise is None or error is None:
            return None
        return error / noise if noise > 0 else (math.inf if error > 0 else 0.0)

    def allows(self, bits: float) -> bool:
        """Whether ``bits`` may be chosen: its ratio at most ``κ``, or unknown (no noise measured, one rank, or
        no compressed step yet: a first compressed step is what measures it)."""
        ratio = self.ratio(bits)
        return ratio is None or ratio <= self.error_to_noise

    def state_dict(self) -> dict[str, Any]:
        return {"noises": list(self.noises), "errors": {str(b): list(e) for b, e in self.errors.items()},
                "local_norm2": self.local_norm2, "fed": self.fed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.noises = [float(x) for x in state.get("noises", [])]
        self.errors = {float(b): [float(x) for x in e] for b, e in state.get("errors", {}).items()}
        self.local_norm2 = float(state.get("local_norm2", 0.0))
        self.fed = bool(state.get("fed", self.noises or self.errors))
