"""The framework-free core of SCGB-EF: :class:`SafeBitsCore`, one state object per set of parameters.

A front end (the Horovod compressor in :mod:`.compressor`, the fixed-action baselines in :mod:`.baselines`) matches
each gradient to a parameter index and drives the core through three calls:

* :meth:`SafeBitsCore.send` (tensor *i*): quantize it for the wire, with error feedback. The first send of a step
  begins the step; the last one (every registered tensor sent once) closes it and starts the statistics exchange.
* :meth:`SafeBitsCore.finish` (step *t*): wait for that step's exchange, if it is still pending, and take in the
  reduced statistics: the step's record and the next allocation's input.
* :meth:`SafeBitsCore.state_dict` / :meth:`~SafeBitsCore.load_state_dict`: checkpointing.

The life of one step (numbers reappear in the code; docs/DESIGN.md, "The life of one step"):

1. **Begin**: finish the previous step's exchange if still pending; take the step's budget from the schedule; the
   policy allocates an action per tensor from the previous step's reduced statistics (:mod:`.policy`); digest it.
2. **Screen**: ``kernels.screen`` measures every menu action on ``v = g + e`` over a sample of whole buckets (all
   buckets for small tensors); the policy turns that into the admissible set.
3. **Send** (on the allgather path a whole fusion group at a time, docs/DESIGN.md, "The batched step"): the
   allocated action if admissible, else the tensor *escalates*: ``kernels.quantize_ef`` writes
   ``q = Q(v)`` and ``e <- v - q`` in one pass and returns the exact statistics of ``q``; if they fail the screen,
   the next candidate is tried, and the lossless action always passes. Every sent tensor satisfies the screen.
4. **Close**: when every tensor has been sent, start the statistics exchange (:mod:`.exchange`; layout:
   :mod:`.statistics`). Starting needs nothing from other ranks, so it cannot deadlock.
5. **Finish**: wait for the exchange; record the step (:mod:`.telemetry`); keep the reduced statistics for the next
   allocation; check that every rank allocated the same way (the digest).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from . import checkpoint, collectives, host, kernels, wire
from .actions import ActionKind, Menu
from .allocator import Allocation
from .collectives import PayloadTransport
from .errors import SafeBitsConsistencyError, SafeBitsNonFiniteError
from .exchange import StatisticsExchange, allocation_digest, digest_words
from .memory import ErrorFeedback
from .policy import BudgetPolicy
from .rng import stream_key
from .screen import ACCEPT_MARGIN, distortion_cosine, distortion_cosine_of
from .statistics import StatisticsLayout, StepStatistics
from .telemetry import StepArrays, StepLog, StepRecord, logger
from .two_phase import TwoPhaseReduction

NONFINITE_MODES = ("propagate", "raise", "skip")


class Sent(NamedTuple):
    """What :meth:`SafeBitsCore.send` hands the front end for one tensor."""

    wire: torch.Tensor | None   # dense: the dequantized float32 values; two_phase: its segments' payloads back to
    #                             back (collectives.decode_sequence); allgather: None, the group is sent later
    #                             (SafeBitsCore.payload)
    step: int                   # the step it belongs to (for finish)
    collective: str             # "dense", "allgather" or "two_phase" (the step's choice, identical on every rank)


def check_number(name: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    """``value`` as a float, or ``ValueError`` unless it is a finite number in ``[low, high]`` (``(low, high]``)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return float(value)


def check_count(name: str, value: Any, minimum: int) -> int:
    """``value`` unless it is not an int >= ``minimum`` (``ValueError``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class SafeBitsCore:
    """SCGB-EF for ``len(names)`` tensors: allocation, screen, escalation, error feedback, exchange, records.

    Args:
        names: parameter names (unique), in registration order; tensor *i* is ``names[i]``.
        numels: element count of each tensor.
        policy: the per-step decisions (:class:`~.policy.BudgetPolicy`; the baselines pass a fixed one).
        schedule: ``step -> bits per parameter``.
        seed: seed of the counter-based stochastic-rounding RNG.
        exchange: the statistics transport, or a callable that makes it when the first step closes (Horovod may be
            initialized after the front end is built).
        error_feedback: keep the residual ``e <- v - q`` per tensor (else ``e = 0`` every step).
        nonfinite: ``"propagate"``, ``"raise"`` or ``"skip"`` (see :class:`~.compressor.SafeBits`).
        sample_buckets: buckets per tensor the screen estimates on.
        consistency_check_every: compare allocation digests every this many steps (0: never).
        max_history, log_path: see :class:`~.telemetry.StepLog`.
        collective: ``"auto"``, ``"allgather"``, ``"two_phase"`` or ``"dense"`` (:mod:`.collectives`).
        transport: the payload transport, or a callable that makes it when the first step begins.
        dense_wire_bytes: bytes per element the front end puts on the wire on the dense path (4: float32).
        name: prefix of the payload collectives' names (distinct per object).
        fusion_elements: elements per fusion group of the allgather path (:func:`.collectives.fusion_groups`); 0:
            every tensor alone (a front end that batches itself, as the DDP hook does per bucket).
    """

    def __init__(self, names: list[str], numels: np.ndarray, *, policy: BudgetPolicy,
                 schedule: Callable[[int], float], seed: int,
                 exchange: StatisticsExchange | Callable[[], StatisticsExchange], error_feedback: bool = True,
                 nonfinite: str = "propagate", sample_buckets: int = 16, consistency_check_every: int = 1,
                 max_history: int = 10000, log_path: str | os.PathLike[str] | None = None,
                 collective: str = "dense",
                 transport: PayloadTransport | Callable[[], PayloadTransport] = collectives.make_transport,
                 dense_wire_bytes: int = 4, name: str = "safebits",
                 fusion_elements: int = collectives.FUSION_ELEMENTS) -> None:
        # -- what is being compressed, and how decisions are made
        self.names = names
        self.numels = numels
        self.total_elements = int(numels.sum())
        self.policy = policy
        self.menu: Menu = policy.menu
        self.schedule = schedule
        self.seed = seed
        self.error_feedback = error_feedback
        self.nonfinite = nonfinite
        self.sample_buckets = sample_buckets
        self.consistency_check_every = consistency_check_every
        self._exchange_or_factory = exchange
        self.exchange: StatisticsExchange | None = exchange if isinstance(exchange, StatisticsExchange) else None
        if collective not in collectives.COLLECTIVES:
            raise ValueError(f"collective must be one of {collectives.COLLECTIVES}, got {collective!r}")
        self.collective_setting = collective
        self._transport_or_factory = transport
        self.transport: PayloadTransport | None = transport if isinstance(transport, PayloadTransport) else None
        self.dense_wire_bytes = dense_wire_bytes
        self.name = name

        # -- state carried across steps (all of it checkpointed, see state_dict)
        self.memory = ErrorFeedback()                  # per-tensor residuals e, per rank
        # Two-phase: segments, the step in flight, and the second hop's residuals (of the segments this rank owns).
        self.two_phase = TwoPhaseReduction(names, numels, policy.menu, policy, name)
        # Allgather: the step's fusion groups in flight (one collective per group of small tensors), each sent in
        # one batched pass (kernels.send_group) over the per-tensor and per-action tables built here once.
        self.allgather = collectives.FusedAllgather(names, numels, name, fusion_elements)
        self.group_tables = kernels.GroupTables(policy.menu, numels, policy.cost_order)
        self.step = 0                                  # index of the next step to begin
        # The last finished step's reduced statistics: the next allocation's input (None before the first step).
        self._previous_screened: np.ndarray | None = None
        self._previous_v2: np.ndarray | None = None

        # -- the step in progress
        tensors, actions = len(names), len(self.menu)
        self.unsent = np.ones(tensors, dtype=bool)     # tensors not sent yet in the step in progress
        self._unsent_count = tensors                   # how many (numpy's any() per tensor costs microseconds)
        self.in_step = False
        self._allocation: Allocation | None = None
        self._budget_bits_total = 0.0
        self._digest = ""
        self.collective = "dense"                      # the step's collective (collectives.choose)
        self._wire_bytes = 0                           # bytes this rank's payloads cost the link in the step
        self._device = torch.device("cpu")             # the step's gradients' device (reduced sums go there)
        # The statistics go straight into the vector the exchange reduces in place. Two vectors, by step parity:
        # the allocation made at the start of step t reads step t-1's reduced vector, which must stay intact.
        self.layout = StatisticsLayout(tensors, actions)
        self._vectors = (np.empty(self.layout.length), np.empty(self.layout.length))
        self._views = tuple(self.layout.views(v) for v in self._vectors)
        self._fields: StepStatistics = self._views[0]
        # The exchange in flight: (step, handle, budget of that step), finished by finish() or the next begin, or
        # by taken() once the front end has taken every tensor that step sent (how many, and how many so far).
        self._pending: tuple[int, Any, float, int, str] | None = None
        self._pending_sent = self._taken = 0
        self._samples: dict[int, torch.Tensor | None] = {}
        self.allocation_seconds = 0.0                  # wall time of the last allocation (overhead telemetry)

        # -- records
        self.log = StepLog(names, self.menu.names, self.total_elements, max_history,
                           os.fspath(log_path) if log_path is not None else None)

    # ------------------------------------------------------------------ the three calls
    def send(self, index: int, grad: torch.Tensor, into: torch.Tensor | None = None) -> Sent:
        """Quantize tensor ``index``'s gradient for the wire (and start its payload collective, if any).

        ``into``: the flat float32 tensor the front end will pass :meth:`reduced_sum` as ``out`` (it may share
        ``grad``'s storage, whose values are consumed here). On the allgather path the send pass writes this
        rank's dequantized values into it, so that the sum over ranks starts from them instead of decoding this
        rank's own payload again."""
        if self.in_step and not self.unsent[index]:
            # A tensor came twice: the previous step never sent some registered tensors.
            missing = [self.names[i] for i in np.flatnonzero(self.unsent)]
            logger.warning("SafeBits step %d closed with %d registered parameters never compressed (e.g. %s); "
                           "pass SafeBits the same parameters as the optimizer", self.step, len(missing),
                           missing[:3])
            self._close()
        if not self.in_step:
            self._begin()
        step, collective = self.step, self.collective
        own = into if collective == "allgather" else None
        if own is not None and (own.dtype != torch.float32 or own.dim() != 1 or not own.is_contiguous()
                                or own.numel() != self.numels[index] or own.device != grad.device):
            raise ValueError(f"into must be a flat contiguous float32 tensor of {self.numels[index]} elements on "
                             f"{grad.device}")
        assert self.transport is not None
        if collective == "allgather":
            # Only registered: the group's members are sent together when its last one arrives (_send_group).
            group = self.allgather.register(index, self._flat_gradient(index, grad), own)
            self.unsent[index] = False
            self._unsent_count -= 1
            if group is not None:
                self._send_group(group)
            if not self._unsent_count:
                self._close()
            return Sent(None, step, collective)
        sent = self._send(index, grad, own)
        ranks = self.transport.size
        if collective == "two_phase":
            self.two_phase.add(index, sent)
            self._wire_bytes += sum(p.numel() for r, p in enumerate(sent) if r != self.transport.rank)
            sent = torch.cat(sent)
        else:
            self._wire_bytes += collectives.link_bytes(collective, sent.numel() * self.dense_wire_bytes, ranks)
        self.unsent[index] = False
        self._unsent_count -= 1
        if not self._unsent_count:
            self._close()
        return Sent(sent, step, collective)

    def reduced_sum(self, index: int, step: int, collective: str, out: torch.Tensor | None = None,
                    divisor: float = 1.0) -> torch.Tensor:
        """The sum over ranks of what every rank sent of tensor ``index`` at ``step`` on a packed path, decoded in
        rank order (bitwise the same on every rank) and divided by ``divisor`` (the rank count, for a mean), as a
        flat float32 tensor (``out`` if given: written over). Waits for the collective."""
        assert self.transport is not None
        if collective == "allgather":
            if step == self.allgather.step and self.allgather.has_unsent(index):
                self._flush_groups()     # a step in which some registered tensors were never sent (on every rank)
            return self.allgather.reduced_sum(self.transport, index, step, out, divisor, self.group_tables)
        total = self.two_phase.result(index, step)
        total = total if out is None else out.copy_(total)
        return total.div_(divisor) if divisor != 1.0 else total

    @property
    def allocation_digest(self) -> str:
        """The digest of the step in progress's allocation (or the last one begun); "" before the first."""
        return self._digest

    def allocated_payload_bytes(self, index: int) -> int:
        """Bytes of tensor ``index``'s packed payload at the allocated action of the step in progress (or the last
        one begun): identical on every rank; a rank that escalates the tensor sends more."""
        assert self._allocation is not None
        action = self.menu[int(self._allocation.choice[index])]
        return wire.HEADER_BYTES + action.cost(int(self.numels[index])) // 8

    def payload(self, index: int, step: int) -> torch.Tensor:
        """This rank's packed payload of tensor ``index`` at ``step`` on the allgather path, once its group has been
        sent: when its last member arrives, else now (the group is sent with zeros for its missing members, as
        when the step closes; so every rank must ask at the same point)."""
        if step != self.allgather.step:
            raise RuntimeError(f"the payloads of step {step} are no longer held (a later step began)")
        if self.allgather.has_unsent(index):
            self._flush_groups()
        return self.allgather.payload(index)

    def finish(self, step: int | None = None) -> None:
        """Finish the pending exchange (only if it is ``step``'s, when given)."""
        if self._pending is not None and (step is None or self._pending[0] == step):
            self._finish()

    def taken(self, step: int) -> None:
        """The front end has taken one reduced tensor of ``step``; after the last tensor the step sent, finish the
        step's exchange. Not at the first: the exchange is the step's last collective, and waiting for it there
        would hold every tensor's decoding until all of the step's collectives are done, instead of letting each
        decode while later ones are still in flight."""
        if self._pending is None or self._pending[0] != step:
            return
        self._taken += 1
        if self._taken >= self._pending_sent:
            self._finish()

    @property
    def last_step(self) -> StepRecord | None:
        return self.log.last

    @property
    def history(self) -> list[StepRecord]:
        return self.log.history

    # ------------------------------------------------------------------ 1. begin
    def _budget_now(self) -> float:
        bits = self.schedule(self.step)
        if isinstance(bits, bool) or not isinstance(bits, int | float) or not math.isfinite(bits) or bits <= 0:
            raise ValueError(f"budget schedule {self.schedule!r} returned {bits!r} at step {self.step}; "
                             f"it must return a finite number of bits per parameter > 0")
        return float(bits)

    def _begin(self) -> None:
        self.finish()
        bits_per_parameter = self._budget_now()
        self._budget_bits_total = self.policy.budget_bits_total(bits_per_parameter, self.total_elements)
        start = time.perf_counter()
        self._allocation = self.policy.allocate(bits_per_parameter, self._budget_bits_total,
                                                self._previous_screened, self._previous_v2)
        self.allocation_seconds = time.perf_counter() - start
        self._digest = allocation_digest(self.step, self._budget_bits_total, self._allocation.choice)
        if self.transport is None:
            factory = self._transport_or_factory
            assert callable(factory)
            self.transport = factory()
        if self.two_phase.transport is None:
            self._configure_two_phase()
        self.collective = collectives.choose(self.collective_setting,
                                             self._allocation.cost_bits / max(1, self.total_elements),
                                             self.transport.size)
        self.allgather.begin(self.step, self.transport)
        self._wire_bytes = 0
        self.unsent[:] = True
        self._unsent_count = len(self.names)
        self._fields = self._views[self.step % 2]
        self.layout.reset(self._fields, self.policy.lossless, digest_words(self._digest))
        self.in_step = True

    def _configure_two_phase(self) -> None:
        """Segments for the transport's world; a second-hop residual whose segment this rank no longer owns goes
        back into this rank's first-hop residual of the same elements, to be sent later (the sum over ranks of
        what is not yet sent stays the same)."""
        assert self.transport is not None
        for name, start, residual in self.two_phase.configure(self.transport):
            if self.error_feedback:
                index = self.names.index(name)
                e = self.memory.residual(name, int(self.numels[index]), residual.device)
                e[start:start + residual.numel()].add_(residual)

    # ------------------------------------------------------------------ 2. screen, 3. send
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

    def _residual(self, index: int, n: int, device: torch.device) -> torch.Tensor:
        if self.error_feedback:
            return self.memory.residual(self.names[index], n, device)
        return torch.zeros(n, dtype=torch.float32, device=device)   # no memory: dropped after the call

    def _flat_gradient(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """The gradient as a flat contiguous float32 tensor, after checking it fits parameter ``index``."""
        name = self.names[index]
        if tensor.is_sparse:
            raise TypeError(f"SafeBits got a sparse gradient for {name!r}; use "
                            f"hvd.DistributedOptimizer(..., sparse_as_dense=True)")
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"gradient of {name!r} has dtype {tensor.dtype}; SafeBits compresses floating point")
        n = tensor.numel()
        if n != self.numels[index]:
            raise ValueError(f"gradient of {name!r} has {n} elements, its parameter {self.numels[index]}")
        if tensor.dim() == 1 and tensor.dtype == torch.float32 and not tensor.requires_grad \
                and tensor.is_contiguous():
            g = tensor          # already flat (the Horovod front end's view): every torch call costs microseconds
        else:
            g = tensor.detach().reshape(-1)
            if g.dtype != torch.float32:
                g = g.to(torch.float32)
            g = g.contiguous()
        self._device = g.device
        return g

    def _send(self, index: int, tensor: torch.Tensor, own: torch.Tensor | None) -> torch.Tensor:
        g = self._flat_gradient(index, tensor)
        n = g.numel()
        e = self._residual(index, n, g.device)
        collective = self.collective
        fields = self._fields
        assert self._allocation is not None
        allocated = int(self._allocation.choice[index])
        action = self.menu[allocated]
        if not self.error_feedback and collective == "dense" and action.kind in (ActionKind.FLOAT32,
                                                                                  ActionKind.FLOAT16):
            # Horovod's NoneCompressor and FP16Compressor (the fp32 and fp16 baselines): no memory, at most a cast
            # on the wire, nothing measured (the fp16 cast's distortion is recorded as NaN).
            fields.sent_position[index] = self.policy.position_in_cost_order[index, allocated]
            fields.sent_distortion[index] = 0.0 if action.lossless else math.nan
            fields.neg_sent_cosine[index] = -1.0 if action.lossless else math.nan
            return g if action.lossless else g.to(torch.float16)
        if own is not None:
            out = own               # allgather: q goes here too (FusedAllgather.reduced_sum starts from it)
        else:
            out = torch.empty(n if collective == "dense" else 0, dtype=torch.float32, device=g.device)
        # Without error feedback there is no residual to protect: NaN/Inf go through the quantizer as they would
        # through Horovod's own compressors (the baselines), and the check's extra pass is saved.
        if self._checks_finite and n:
            host.count()
            if not math.isfinite(float(g.sum())):
                host.count()
                if not bool(torch.isfinite(g).all()):
                    return self._send_nonfinite(index, g, own)

        key = stream_key(self.seed, self.step, index)
        policy = self.policy
        if policy.allocates_from_statistics:
            estimate = host.to_host(kernels.screen(g, e, self.menu, key, self._sample_of(index, n, g.device)))
            distortion, cosine = distortion_cosine(estimate)
            ok = policy.screen(distortion, cosine)
            # What the allocator needs of an action is its distortion if it may plan with it (the screen admits it
            # with the planning margin), +inf if not; the MAX over ranks then admits an action only if every rank
            # did, at the largest distortion.
            fields.screened[index] = np.where(policy.plannable(distortion, cosine), distortion, np.inf)
        else:
            ok = np.ones(len(self.menu), dtype=bool)
        return self._send_in_order(index, policy.send_order(index, allocated, ok), g, e, key, out)

    @property
    def _checks_finite(self) -> bool:
        return self.error_feedback or self.nonfinite != "propagate"

    def _send_in_order(self, index: int, order: list[int], g: torch.Tensor | None, e: torch.Tensor, key: int,
                       out: torch.Tensor, first: tuple[Any, np.ndarray] | None = None) -> Any:
        """3. Send: try the actions of ``order`` until the exact statistics of one pass; record it. ``first``: the
        first action's pass, already made (the batched step), as ``(sent, statistics)``."""
        collective, segments, name = self.collective, self.two_phase.segments[index], self.names[index]
        fields, policy = self._fields, self.policy
        source: torch.Tensor | None = g
        sent: Any = None
        for attempt, action_index in enumerate(order):
            if attempt:              # e held v - q: restore v (to float rounding) and quantize it again
                collectives.restore(collective, sent, e, segments, name)
                source = None
            if attempt == 0 and first is not None:
                sent, stats = first
            else:
                sent, stats = collectives.encode(collective, source, e, self.menu[action_index], key, segments, out)
            d, c = distortion_cosine_of(stats.tolist())
            if policy.accepts(action_index, d, c):
                break
            # It failed on the values it would have sent: the next allocation must not plan it from the estimate.
            fields.screened[index, action_index] = math.inf
        self._record_sent(index, action_index, d, c, policy.plannable_one(action_index, d, c), float(stats[3]))
        return sent

    def _record_sent(self, rows: Any, actions: Any, distortion: Any, cosine: Any, plannable: Any, v2: Any) -> None:
        """The step's statistics of what was sent: of one tensor (Python numbers) or of many (arrays)."""
        fields = self._fields
        assert self._allocation is not None
        fields.sent_position[rows] = self.policy.position_in_cost_order[rows, actions]
        fields.escalated[rows] = actions != self._allocation.choice[rows]
        fields.sent_distortion[rows] = distortion
        fields.neg_sent_cosine[rows] = -cosine
        # The exact figure beats the estimate (it passed the screen; planning may need it to pass by more).
        fields.screened[rows, actions] = np.where(plannable, distortion, np.inf)
        fields.v2[rows] = np.where(np.isfinite(v2), v2, np.inf)     # never NaN: NaN would poison the MAX

    def _send_nonfinite(self, index: int, g: torch.Tensor, own: torch.Tensor | None) -> Any:
        """A gradient holding NaN or Inf, by ``nonfinite``: raise, send zeros, or send it unquantized."""
        collective, fields = self.collective, self._fields
        if self.nonfinite == "raise":
            raise SafeBitsNonFiniteError(f"gradient of {self.names[index]!r} holds NaN or Inf at step {self.step}; "
                                         f"nothing was sent and its error-feedback residual is unchanged "
                                         f"(SafeBits(nonfinite='propagate') passes it on, 'skip' sends zeros)")
        # No statistics this step: the next allocation knows only the lossless action is safe for it.
        fields.nonfinite[index] = 1.0
        fields.v2[index] = math.inf
        if self.nonfinite == "skip":
            if own is not None:
                own.zero_()
            return self._zeros(index, collective, g.device)
        fields.sent_position[index] = self.policy.position_in_cost_order[index, self.policy.lossless_index]
        if own is not None and own.data_ptr() != g.data_ptr():
            own.copy_(g)
        return self._unquantized(index, collective, g)

    def _send_group(self, group: int) -> None:
        """The batched step of one allgather group (docs/DESIGN.md, "The batched step"): one pass screens, chooses
        and packs every member sent (:func:`.kernels.send_group`, one read back); the rare members that need more
        (a NaN/Inf gradient, exact statistics that fail the screen) then take the per-tensor path; members never
        sent (an incomplete step) send zeros. The group's allgather starts at once."""
        assert self._allocation is not None and self.transport is not None
        members, registered = self.allgather.take(group)
        sent_members = np.array([i for i in members if i in registered], dtype=np.int64)
        policy, fields = self.policy, self._fields
        payloads: dict[int, torch.Tensor] = {}
        buffer: torch.Tensor | None = None
        offsets = np.zeros(1, dtype=np.int64)
        if len(sent_members):
            grads = [registered[i][0] for i in sent_members]
            owns = [registered[i][1] for i in sent_members]
            device = grads[0].device
            residuals = [self._residual(int(i), int(self.numels[i]), device) for i in sent_members]
            screening = policy.allocates_from_statistics
            samples = [self._sample_of(int(i), int(self.numels[i]), device) if screening else None
                       for i in sent_members]
            keys = np.array([stream_key(self.seed, self.step, int(i)) for i in sent_members], dtype=np.uint32)
            allocated = self._allocation.choice[sent_members]
            result = kernels.send_group(kernels.GroupSend(
                sent_members, grads, residuals, owns, samples, keys, allocated, self._checks_finite, screening,
                policy.screen_enabled, policy.max_distortion, policy.min_cosine), self.group_tables)
            buffer, offsets = result.buffer, result.offsets
            finite, chosen = result.finite, result.chosen
            distortion, cosine = distortion_cosine(result.stats)
            if screening:
                estimated, estimated_cosine = distortion_cosine(result.screen_stats[finite])
                fields.screened[sent_members[finite]] = np.where(
                    policy.plannable(estimated, estimated_cosine), estimated, np.inf)
            accepted = finite & policy.sent_passes(np.maximum(chosen, 0), distortion, cosine, ACCEPT_MARGIN)
            actions = chosen[accepted]
            self._record_sent(sent_members[accepted], actions, distortion[accepted], cosine[accepted],
                              policy.sent_passes(actions, distortion[accepted], cosine[accepted],
                                                 policy.planning_margin), result.stats[accepted, 3])
            for k in np.flatnonzero(~accepted):
                index = int(sent_members[k])
                if not finite[k]:
                    payloads[index] = self._send_nonfinite(index, grads[k], owns[k])
                    continue
                # Failed on what it sent: escalate from there, as the per-tensor path does.
                ok = (policy.screen(*distortion_cosine(result.screen_stats[k])) if screening
                      else np.ones(len(self.menu), dtype=bool))
                order = policy.send_order(index, int(allocated[k]), ok)
                first = (buffer[offsets[k]:offsets[k + 1]], result.stats[k])
                out = owns[k] if owns[k] is not None else torch.empty(0, device=device)
                payloads[index] = self._send_in_order(index, order, grads[k], residuals[k], int(keys[k]), out,
                                                      first)
        # Bytes this rank sends of the tensors it sent (not of the zeros standing in for the missing ones).
        sizes = np.diff(offsets)
        for k, index in enumerate(sent_members.tolist()):
            if index in payloads:
                sizes[k] = payloads[index].numel()
        self._wire_bytes += collectives.link_bytes("allgather", int(sizes.sum()), self.transport.size)
        if len(payloads) or len(sent_members) != len(members):
            position = {int(i): k for k, i in enumerate(sent_members)}
            device = buffer.device if buffer is not None else self._device
            parts = []
            for index in members:
                if index in payloads:
                    parts.append(payloads[index])
                elif index in position:
                    k = position[index]
                    assert buffer is not None
                    parts.append(buffer[offsets[k]:offsets[k + 1]])
                else:
                    parts.append(self._zeros(index, "allgather", device))
            buffer = torch.cat(parts)
            offsets = np.concatenate([[0], np.cumsum([p.numel() for p in parts])]).astype(np.int64)
        assert buffer is not None
        owns_by_index = {int(i): registered[int(i)][1] for i in sent_members}
        self.allgather.start(self.transport, group, buffer, offsets, self._allocation.choice[members],
                             owns_by_index)

    def _flush_groups(self) -> None:
        """Send every group some member of which was registered but not all (zeros for the missing ones)."""
        for group in self.allgather.incomplete_groups():
            self._send_group(group)

    def _unquantized(self, index: int, collective: str, g: torch.Tensor) -> Any:
        """``nonfinite="propagate"``: the gradient itself, lossless, so NaN and Inf reach the reduced gradient as
        with an uncompressed allreduce; the residual is not touched (a scratch zero residual takes its place)."""
        scratch = torch.zeros_like(g)
        lossless = self.menu[self.policy.lossless_index]
        out = torch.empty_like(g) if collective == "dense" else torch.empty(0, device=g.device)
        return collectives.encode(collective, g, scratch, lossless, 0, self.two_phase.segments[index], out)[0]

    def _zeros(self, index: int, collective: str, device: torch.device) -> Any:
        """What a skipped tensor sends: zeros (the cheapest action's payload of zeros); no residual is touched."""
        n = int(self.numels[index])
        zeros = torch.zeros(n, dtype=torch.float32, device=device)
        cheapest = self.menu[int(self.policy.cost_order[index, 0])]
        if collective == "dense":
            return zeros
        return collectives.encode(collective, None, zeros, cheapest, 0, self.two_phase.segments[index],
                                  torch.empty(0, device=device))[0]

    # ------------------------------------------------------------------ 4. close
    def _close(self) -> None:
        """Every tensor of the step is on its way: start the statistics exchange."""
        if self.exchange is None:
            factory = self._exchange_or_factory
            assert callable(factory)
            self.exchange = factory()
        if self.collective == "allgather":
            self._flush_groups()
        if self.collective == "two_phase":
            assert self._allocation is not None
            self.two_phase.start(self.step, self._allocation.choice, self.seed,
                                 lambda index, device: self._zeros(index, "two_phase", device))
        vector = self._vectors[self.step % 2]
        self._pending = (self.step, self.exchange.start(vector), self._budget_bits_total, self._wire_bytes,
                         self.collective)
        self._pending_sent, self._taken = int((~self.unsent).sum()), 0
        self.in_step = False
        self.step += 1
        if self.exchange.is_local:
            self._finish()

    # ------------------------------------------------------------------ 5. finish
    def _finish(self) -> None:
        assert self._pending is not None and self.exchange is not None and self._allocation is not None
        step, handle, budget_total, wire_bytes, collective = self._pending
        if self.two_phase.pending_step == step:
            self.two_phase.finish()                    # before the record: it counts the second hop's bytes
        if self.two_phase.second_hop_bytes[0] == step:
            wire_bytes += self.two_phase.second_hop_bytes[1]
        self._pending = None
        self.exchange.wait(handle)                     # the step's own vector now holds the MAX over ranks
        reduced = self._views[step % 2]
        sent_position = reduced.sent_position.astype(np.int64)
        nonfinite = reduced.nonfinite > 0
        arrays = StepArrays(step=step, budget_bits_total=budget_total,
                            modeled_bits_total=self.policy.modeled_bits(sent_position),
                            sent=self.policy.actions_sent(sent_position), allocated=self._allocation.choice,
                            distortion=reduced.sent_distortion.copy(), cosine=-reduced.neg_sent_cosine,
                            escalated=reduced.escalated > 0, nonfinite=nonfinite, allocation_digest=self._digest,
                            infeasible=not self._allocation.feasible, wire_bytes=wire_bytes,
                            collective=collective)
        # The next allocation's input. A non-finite tensor has no statistics: only the lossless action is known safe.
        screened = reduced.screened
        if nonfinite.any():
            screened[nonfinite] = np.where(self.policy.lossless, 0.0, np.inf)
        v2 = reduced.v2
        self._previous_screened, self._previous_v2 = screened, np.where(np.isfinite(v2), v2, 0.0)
        self.policy.observe(budget_total, self._allocation.cost_bits, arrays.modeled_bits_total)
        self.log.add(arrays, self.exchange.rank)
        observe = getattr(self.schedule, "observe", None)
        if observe is not None:
            observe(self.log.last)
        if (self.consistency_check_every and step % self.consistency_check_every == 0
                and (reduced.digest + reduced.neg_digest).any()):       # MAX - MIN of each word: 0 if all agree
            raise SafeBitsConsistencyError(
                f"ranks disagree on the allocation of step {step} (this rank's digest {self._digest}); every rank "
                f"must build SafeBits with the same parameters, menu, budget and thresholds")

    # ------------------------------------------------------------------ elastic training
    def abort_step(self) -> None:
        """Drop the step in progress and the pending exchange: one of their collectives failed (a worker left).
        The residuals may hold part of that step: load the last state next (elastic ``restore`` does)."""
        self.in_step = False
        self.unsent[:] = True
        self._unsent_count = len(self.names)
        self._pending = None
        self.two_phase.abort()
        self.allgather.abort()

    def leave_world(self) -> None:
        """The world changed (elastic training): the statistics exchange and the payload transport are rebuilt for
        the new one at the next step, and the two-phase segments with them. Exchanges and transports given as
        objects rather than factories cannot be rebuilt: ``ValueError``. Call between steps."""
        if self.in_step or self._pending is not None:
            raise RuntimeError("leave_world() must be called between steps (abort_step() first after a failure)")
        if not (callable(self._exchange_or_factory) and callable(self._transport_or_factory)):
            raise ValueError("SafeBits was given its exchange or transport as an object, which cannot follow a new "
                             "world; pass factories (or nothing) for elastic training")
        self.exchange = None
        self.transport = None
        self.two_phase.leave_world()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically (see :mod:`.checkpoint`). Call between steps."""
        if self.in_step:
            raise RuntimeError("SafeBits.state_dict() called in the middle of a step; call it between steps")
        self.finish()
        schedule_state = getattr(self.schedule, "state_dict", None)
        return checkpoint.make_state(step=self.step, seed=self.seed, names=self.names, numels=self.numels,
                                     menu_names=self.menu.names, residuals=self.memory.state_dict(),
                                     second_hop_residuals=self.two_phase.memory.state_dict(),
                                     second_hop_ranges=self.two_phase.ranges,
                                     screened=self._previous_screened, v2=self._previous_v2,
                                     overshoot_history=self.policy.overshoot_history,
                                     schedule_state=schedule_state() if schedule_state is not None else None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` if it was saved for another model or menu."""
        checkpoint.check_state(state, self.names, self.numels, self.menu.names)
        if self.in_step or self._pending is not None:
            raise RuntimeError("load_state_dict() must be called between steps")
        self.memory.load_state_dict(state["residuals"])
        self.two_phase.load_state_dict(state.get("second_hop_residuals", {}), checkpoint.second_hop_ranges(state))
        if self.two_phase.transport is not None:     # check the residuals against this world's segments now
            self._configure_two_phase()
        self.step = int(state["step"])
        self.log.truncate(self.step)                 # records of later steps describe steps undone
        self.seed = int(state["seed"])
        self._previous_screened, self._previous_v2 = checkpoint.previous_statistics(state)
        self.policy.overshoot_history = checkpoint.overshoot_history(state)
        if state["schedule"] is not None and hasattr(self.schedule, "load_state_dict"):
            self.schedule.load_state_dict(state["schedule"])

