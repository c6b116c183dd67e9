"""The Horovod front end: :class:`SafeBits`, a ``horovod.torch`` compressor over :class:`~.core.SafeBitsCore`.

Horovod calls ``compress(p.grad)`` in each parameter's gradient hook and ``decompress(reduced, ctx)`` in
``synchronize()``. This adapter matches the gradient to its parameter (:mod:`.params`), hands it to the core, and
finishes the step's statistics exchange at the last ``decompress`` of that step (docs/DESIGN.md, "The life of one
step under Horovod"). Everything else (policy, kernels, error feedback, exchange, records, checkpoints) is the core's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import torch

from ..codec import host
from ..codec.actions import DEFAULT_MENU, Menu
from ..comm.exchange import DEFAULT_TIMEOUT, StatisticsExchange, horovod_if_initialized, make_exchange
from ..comm.transports import PayloadTransport, make_transport
from ..step import world
from ..step.core import Handle, SafeBitsCore
from .params import GradientIndex
from .shared import CoreView, build_core, check_transports

try:  # Subclass Horovod's interface when Horovod is there; the object also works without it.
    from horovod.torch.compression import Compressor
except ImportError:  # pragma: no cover - exercised only without Horovod
    class Compressor:  # type: ignore[no-redef]
        """Stand-in for ``horovod.torch.compression.Compressor``."""


class Context(NamedTuple):
    """What ``decompress`` needs of a ``compress``."""

    shape: torch.Size
    dtype: torch.dtype
    index: int                  # the parameter
    handle: Handle               # the core's handle on what this rank sent (its step, whether packed)
    core: SafeBitsCore          # which holds what was sent (read it as ``wire``)
    # Packed paths: the gradient's own flat storage, which the reduced sum is decoded into (compress has consumed
    # its values; Horovod's uncompressed allreduce overwrites it too), so a step allocates no new gradients; on the
    # allgather path compress leaves this rank's dequantized values there, where the sum starts. None when it is
    # not contiguous float32 (a fresh tensor is decoded into then).
    gradient: torch.Tensor | None = None
    original: torch.Tensor | None = None        # the gradient as compress got it (returned when the sum is in it)

    @property
    def step(self) -> int:
        return self.handle.step

    @property
    def wire(self) -> torch.Tensor:
        """What this rank sent: the packed payload (uint8) or the dense float32 values. On the allgather path the
        payload exists once the tensor's group has been sent: when its last member was compressed, at the latest
        when the step closes."""
        return self.core.payload(self.handle, self.index)


def op_factor(reduced_marker: torch.Tensor, ranks: int) -> float:
    """What Horovod's reduction did to the marker ``compress`` returned on the allgather path (a float32 1): 1 after
    ``op=Average`` (with or without ``gradient_predivide_factor``), ``ranks`` after ``op=Sum``. The reduced
    gradient is the sum of the decoded payloads times ``factor / ranks``. A pre/postscale pair leaves a float
    rounding of the exact factor, so a value within 1e-4 of an integer is taken as that integer."""
    value = float(reduced_marker.reshape(-1)[0])
    nearest = round(value)
    if nearest >= 1 and abs(value - nearest) <= 1e-4 * nearest:
        return float(nearest)
    if not value > 0:
        raise ValueError(f"the allgather path's marker came back from Horovod's reduction as {value}; SafeBits' "
                         f"packed collectives support op=Average and op=Sum (use collective='dense' for Adasum)")
    return value


class CoreCompressor(CoreView, Compressor):
    """A Horovod compressor over a :class:`~.core.SafeBitsCore`: ``compress`` sends through the core,
    ``decompress`` finishes the step's exchange. Shared by :class:`SafeBits` and the fixed-action baselines."""

    core: SafeBitsCore
    process_set: Any = None        # the Horovod process set of SafeBits' collectives (None: every rank)

    def _attach(self, params: list[torch.nn.Parameter], core: SafeBitsCore) -> None:
        self.core = core
        self.names = core.names
        self.numels = core.numels
        self.total_elements = core.total_elements
        self._index = GradientIndex(params)
        self._op_factor = (-1, 1.0)      # (step, what Horovod's op did to the marker at that step)
        self._known_factor: tuple[int, float, int] | None = None     # (ranks, factor, the marker's float32 bits)
        # The packed paths' markers: one float32 element per tensor, views of one buffer per device made once and
        # refilled with 1 by one call per step (a new tensor per compress costs microseconds). Horovod reduces each
        # view in place, and every marker of a step is reduced before the next step's first compress.
        self._markers: dict[torch.device, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Context]:
        """Quantize one gradient (with error feedback) for the wire; returns what Horovod is to allreduce and the
        context :meth:`decompress` needs.

        On the allgather path the packed payload's allgather is started here, and Horovod allreduces a one-element
        marker whose reduced value tells :meth:`decompress` whether the op averaged or summed; :meth:`decompress`
        then writes the reduced gradient over ``tensor`` when it is contiguous float32 (as Horovod's uncompressed
        allreduce does in place). On the dense path Horovod allreduces the flat float32 dequantized values.
        """
        core = self.core
        began = not core.in_step
        if began:
            self._follow_world()
        index = self._index.find(tensor, None if began else core.unsent)
        reusable = tensor.dtype == torch.float32 and tensor.is_contiguous() and not tensor.requires_grad
        if reusable and core.in_pass_through(index):
            # Passing through, after the step's first tensor: Horovod allreduces the gradient itself, as with
            # Compression.none.
            sent = core.pass_through(index, tensor)
            return sent.wire, Context(tensor.shape, tensor.dtype, index, sent, core)
        flat = (tensor if tensor.dim() == 1 else tensor.view(-1)) if reusable else None
        sent = core.send(index, tensor if flat is None else flat, into=flat)
        if not sent.packed:
            return sent.wire, Context(tensor.shape, tensor.dtype, index, sent, core)
        ctx = Context(tensor.shape, tensor.dtype, index, sent, core, flat, tensor)
        return self._marker(index, tensor.device, began), ctx

    def _reduction_factor(self, marker: torch.Tensor, ranks: int, ctx: Context) -> float:
        """:func:`op_factor` of the step's first reduced marker. Horovod reduces every tensor of an optimizer with
        the same op, so the marker is read back only at the first step of a world; later steps take the factor
        then found, the path checking that their marker has the same bits when the step closes (on a GPU within
        the step's one read back of what it received)."""
        known = self._known_factor
        if known is None or known[0] != ranks:
            value = host.to_host(marker.reshape(-1)[:1])
            known = self._known_factor = (ranks, op_factor(torch.from_numpy(value), ranks),
                                          int(value.view(np.int32)[0]))
        else:
            self.core.expect_at_close(
                ctx.handle, marker, known[2], f"Horovod reduced step {ctx.step}'s tensors with another op "
                f"than earlier steps' (its marker came back with other bits); SafeBits' packed collectives take one op "
                f"per optimizer (collective='dense' mixes them)")
        return known[1]

    def _marker(self, index: int, device: torch.device, refill: bool) -> torch.Tensor:
        """Tensor ``index``'s marker (a float32 1) on ``device``; ``refill``: the step's first compress."""
        markers = self._markers.get(device)
        if markers is None:
            buffer = torch.ones(len(self.names), dtype=torch.float32, device=device)
            markers = self._markers[device] = (buffer, list(buffer.split(1)))
        elif refill:
            markers[0].fill_(1.0)
        return markers[1][index]

    def decompress(self, tensor: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The reduced gradient in its shape and dtype (the step's last one also finishes its statistics
        exchange)."""
        core = self.core
        if ctx.handle.packed:
            ranks = core.ranks or 1
            if self._op_factor[0] != ctx.step:
                self._op_factor = (ctx.step, self._reduction_factor(tensor, ranks, ctx))
            factor = self._op_factor[1]
            # Average (factor 1): the division by the rank count rides on the last payload's decode.
            total = core.reduced_sums([ctx.index], ctx.handle, [ctx.gradient],
                                      divisor=ranks if factor == 1.0 else 1.0)[0]
            if factor not in (1.0, ranks):
                total.mul_(factor / ranks)
            core.reduced_taken(ctx.step)
            if total is ctx.gradient and ctx.original is not None:
                return ctx.original          # the sum is in the gradient's own storage, in its shape and dtype
            tensor = total
        else:
            core.noise.reduced([tensor])
            core.reduced_taken(ctx.step)
        if tensor.dtype != ctx.dtype:
            tensor = tensor.to(ctx.dtype)
        return tensor if tensor.shape == ctx.shape else tensor.view(ctx.shape)

    def _follow_world(self) -> None:
        """Between steps: when elastic Horovod removed workers it re-initializes without a state sync
        (``hvd.elastic.run``), so the new world is noticed here, by its size, and SafeBits rebuilt for it."""
        ranks = self.core.ranks
        if ranks is None or self.process_set is not None:
            return
        hvd = horovod_if_initialized()
        if hvd is not None and hvd.size() != ranks:
            world.leave_world(self.core)

    def flush(self) -> None:
        """Finish a pending statistics exchange (``decompress`` does this; call it if you only ``compress``)."""
        self.core.finish()


class SafeBits(CoreCompressor):
    r"""Safety-Constrained Global Bit Budgeting with Error Feedback, as a Horovod compressor.

    Every step, every gradient tensor gets one action from ``menu`` (by default fp32, max-abs codes of 14 to 4 bits,
    Lloyd-Max codes of 5 to 2 bits, ternary, scaled sign and top-k: :data:`~safebits_hvd.codec.actions.DEFAULT_MENU`)
    under one global budget of ``budget_bits`` bits per parameter:

    * **Error feedback**: the compressor quantizes ``v = g + e`` and keeps ``e <- v - sent``.
    * **Screen**: an action is admissible only if, on the values really sent, ``||q - v||^2 / ||v||^2 <=
      max_distortion`` and ``cos(q, v) >= min_cosine``; fp32 always is. This is the EF contraction with
      ``alpha = max_distortion`` that the convergence analysis needs, enforced exactly for what is sent.
    * **Global allocation**: a multiple-choice knapsack minimising the total squared error subject to the budget,
      computed from the previous step's statistics (Horovod sends each gradient as soon as it is ready, so the
      allocation cannot wait for all of them). At send time the current screen decides: an allocated action that is
      not admissible now *escalates* to the tensor's cheapest admissible action, and the step records it. So that
      escalations rarely push a step over budget, the allocation plans only with actions that passed the screen
      with a 5% margin and leaves unplanned an *escalation reserve*, the largest fraction of the budget that
      escalations overran in the last 100 steps (docs/DESIGN.md, "The algorithm as implemented").
    * **Fallback**: when even the cheapest admissible action of every tensor exceeds the budget, that
      configuration is used and the step records a budget *violation* (safety is never traded for budget).
    * **Start policy** (step 0, no statistics yet): each tensor is allocated the costliest action whose modeled
      cost fits ``budget_bits`` per element (the cheapest action if none fits); the screen then applies as usual.

    Args:
        named_parameters: ``(name, parameter)`` pairs (``model.named_parameters()``); gradients are matched to
            parameters by identity. Parameters with ``requires_grad=False`` are ignored, as Horovod ignores them.
            For ``hvd.DistributedOptimizer(opt)`` without ``named_parameters``, pass ``opt`` (or
            ``model.parameters()``): parameters are then named as Horovod names them.
        budget_bits: average bits per parameter per step (32 = no compression; 4.4 sends 32 / 4.4, about 7.3x,
            fewer bits), or a schedule, any callable ``step -> bits`` (see :mod:`safebits_hvd.policy.schedules`), or
            ``"auto"`` (:class:`~safebits_hvd.policy.auto.Auto`: the budget, or no compression, that makes the step
            fastest, from the telemetry SafeBits measures). Default 4.0.
        max_distortion: ``d_bar`` in (0, 1]. Default 0.5.
        min_cosine: ``c_min`` in [-1, 1]. Default 0.7. Why these defaults (docs/RESULTS.md sections 9.1 and
            9.2): ``max_distortion=0.5`` is the contraction error feedback needs. For an action whose scale
            minimizes the squared error (every ``*_mse`` action, scaled sign) ``cos^2 = 1 - distortion``, so
            ``min_cosine=0.7`` (about ``sqrt(1 - 0.5)``) asks the same of those and binds only on the unbiased,
            max-scaled ones. The stricter 0.8 of earlier releases left a 2-bit budget infeasible on half the
            demo CNN's steps; with 0.7 and the default menu every step at 2 bits has an admitted configuration
            within the budget on both demo tasks, and a sweep of {0.3, 0.5, 0.7} x {0.7, 0.8, 0.9} collapsed
            nowhere.
        menu: a :class:`~safebits_hvd.codec.actions.Menu` or action names. Default :data:`~safebits_hvd.DEFAULT_MENU`.
        seed: seed of the counter-based stochastic-rounding RNG. Default 0.
        log_path: JSON-lines telemetry, one :class:`StepRecord` per step. With several ranks only rank 0 writes,
            unless the path contains ``{rank}``. Default None (no file).
        sample_buckets: buckets per tensor on which the screen estimates every action (tensors with fewer buckets
            are screened exactly). Default 16 (8,192 elements at the default bucket size).
        consistency_check_every: compare allocation digests across ranks every this many steps and raise
            :class:`~safebits_hvd.SafeBitsConsistencyError` on a mismatch; 0 disables. Default 1 (it rides on the
            statistics exchange, so it costs 64 bytes).
        nonfinite: what a gradient holding NaN or Inf does. ``"propagate"`` (default): it is sent unquantized, so
            its non-finite values reach every rank's reduced gradient as with ``hvd.Compression.none``, its residual
            absorbs nothing, and the record lists it: right for mixed precision (``torch.amp.GradScaler`` must see
            the overflow to skip the step and lower its scale) and for any code that checks gradients itself.
            ``"raise"``: :class:`~safebits_hvd.SafeBitsNonFiniteError`, when a non-finite gradient is a bug.
            ``"skip"``: the tensor sends zeros for the step, its residual is kept, the record lists it, when a rare
            bad batch should not stop training and nothing downstream checks.
        screen: False switches the screen off (the unscreened global-budgeting ablation; no guarantee).
        name: Horovod tensor name of the statistics exchange (distinct per compressor object). Default "safebits".
        max_history: records kept in :attr:`history` (the last one is always in :attr:`last_step`). Default 1000.
        collective: how gradients travel (:mod:`safebits_hvd.comm.collectives`): ``"allgather"`` (every rank's packed
            payload to every rank), ``"two_phase"`` (packed scatter-reduce then allgather, with a second error
            feedback), ``"dense"`` (dequantized float32 through Horovod's allreduce: no fewer bytes; for
            ``op=hvd.Adasum``), or ``"auto"`` (default: per step, the one that moves fewer bytes; dense in one
            process).
        process_set: the Horovod process set of the optimizer (``hvd.DistributedOptimizer(..., process_set=)``);
            SafeBits' own collectives run on it, and ranks outside it must not build or use this object. Default
            None: every rank.
        timeout: seconds a rank waits for one of SafeBits' collectives before
            :class:`~safebits_hvd.SafeBitsTimeoutError` names the cause (a rank that never joins); None: no
            limit. Default 600.
        exchange: the statistics transport (:class:`~safebits_hvd.comm.exchange.StatisticsExchange`). Default None:
            chosen when the first step closes (Horovod's MPI or Gloo, or none for one process). Tests and
            benchmarks pass their own here.
        transport: the payload transport (:class:`~safebits_hvd.comm.transports.PayloadTransport`). Default None:
            Horovod's allgather and alltoall when Horovod runs several ranks, else none.
        fusion_bytes: on the allgather path, the float32 gradient bytes of consecutive tensors sent in one batched
            pass and one allgather (a larger tensor goes alone); 0: every tensor alone. Default None: by the
            gradients' device: on the CPU a sixteenth of the model's, within 256 KiB and 4 MiB (groups start while
            backward runs), and 64 MiB on a GPU (a group costs a fixed handful of kernel launches and one read back
            whatever its member count).
        residual_dtype: how the error-feedback residuals (:attr:`memory`, a gradient's worth per rank) are stored:
            ``torch.float32`` (default) or ``torch.bfloat16``, half the memory (``memory.nbytes``); the passes
            still compute in float32, and each step's new residual is rounded to bfloat16 when stored (its quality:
            docs/RESULTS.md 3.4).

    Attributes:
        last_step: the :class:`StepRecord` of the last completed step (None before the first).
        history: the last ``max_history`` :class:`StepRecord` objects, oldest first (a new list on each read).
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | Iterable[torch.Tensor] | Any,
                 budget_bits: float | str | Callable[[int], float] = 4.0, max_distortion: float = 0.5,
                 min_cosine: float = 0.7, menu: Menu | Iterable[str] = DEFAULT_MENU, seed: int = 0,
                 log_path: str | os.PathLike[str] | None = None, *, sample_buckets: int = 16,
                 consistency_check_every: int = 1, nonfinite: str = "propagate", screen: bool = True,
                 name: str = "safebits", max_history: int = 1000, collective: str = "auto",
                 process_set: Any = None, timeout: float | None = DEFAULT_TIMEOUT,
                 exchange: StatisticsExchange | None = None, transport: PayloadTransport | None = None,
                 fusion_bytes: int | None = None, residual_dtype: torch.dtype = torch.float32) -> None:
        check_transports(exchange, transport)
        params, core = build_core(
            named_parameters, budget_bits, max_distortion, min_cosine, menu, seed, log_path,
            sample_buckets=sample_buckets, consistency_check_every=consistency_check_every, nonfinite=nonfinite,
            screen=screen, name=name, max_history=max_history, collective=collective, timeout=timeout,
            exchange=exchange if exchange is not None else (lambda t: make_exchange(name, process_set, t)),
            transport=transport if transport is not None else (lambda t: make_transport(process_set, t)),
            fusion_bytes=fusion_bytes, residual_dtype=residual_dtype)
        self._attach(params, core)
        self.menu = core.menu
        self.schedule = core.schedule
        self.max_distortion = core.policy.max_distortion
        self.min_cosine = core.policy.min_cosine
        self.screen_enabled = core.policy.screen_enabled
        self.exchange_name = name
        self.process_set = process_set

    @property
    def seed(self) -> int:
        return self.core.seed
