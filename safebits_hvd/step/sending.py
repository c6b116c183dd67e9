"""Steps 2 and 3 of the life of a step (:mod:`.core`): the screen and the send, with error feedback.

:class:`Sender` sends every path's tensors through one batched pass, :meth:`Sender.send_members`
(docs/DESIGN.md, "The batched step"): a whole fusion group at a time on the allgather path
(:meth:`Sender.send_registered`), the whole step on the two-phase path (:func:`.two_phase.send_first_hop`), on the
dense path a tensor (Horovod allreduces the values ``compress`` returns) or a DDP bucket at a time, values only
(:meth:`Sender.send_values`). Members whose exact statistics fail the screen escalate together, a round at a time
(:func:`escalation_rounds`, which the two-phase second hop shares): each tries the next action of its order until what
it would send passes (the lossless action always does).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from ..codec import host, kernels
from ..codec.actions import ActionKind
from ..codec.rng import stream_keys
from ..comm.statistics import StepStatistics
from ..errors import SafeBitsNonFiniteError
from ..policy.allocator import Allocation
from ..policy.budget import BudgetPolicy
from ..policy.screen import ACCEPT_MARGIN, distortion_cosine
from .memory import ErrorFeedback


class EscalationRound(NamedTuple):
    """One round of :func:`escalation_rounds`: the rows repacked, the action each was repacked at, the exact
    statistics of what it now sends, their distortion and cosine, and which passed."""

    rows: np.ndarray
    actions: np.ndarray
    stats: np.ndarray
    distortion: np.ndarray
    cosine: np.ndarray
    passed: np.ndarray


def escalation_rounds(orders: dict[int, list[int]], repack: Callable[[np.ndarray, np.ndarray], np.ndarray],
                      policy: BudgetPolicy) -> Iterator[EscalationRound]:
    """3. Send, the escalation: every row of ``orders`` sent its order's first action, whose exact statistics
    failed; each round repacks all those still failing at the next action of their orders (``repack(rows,
    actions)``: restore each row's residual from what it sent, pack it again (:func:`packed_again`), return the
    exact statistics), until every one passes the ``policy``'s screen on what it sends (the last action of each
    order, the lossless one, always does). Both hops of every path escalate here: the first in
    :meth:`Sender.escalate_group`, the two-phase second in ``TwoPhasePath``."""
    escalating, attempt = list(orders), 0
    while escalating:
        attempt += 1
        rows = np.array(escalating, dtype=np.int64)
        actions = np.array([orders[k][attempt] for k in escalating], dtype=np.int64)
        stats = repack(rows, actions)
        distortion, cosine = distortion_cosine(stats)
        passed = policy.sent_passes(actions, distortion, cosine, ACCEPT_MARGIN)
        yield EscalationRound(rows, actions, stats, distortion, cosine, passed)
        escalating = [k for j, k in enumerate(escalating) if not passed[j]]


def packed_again(members: np.ndarray, residuals: list[torch.Tensor], intos: list[torch.Tensor | None],
                 keys: np.ndarray, actions: np.ndarray, policy: BudgetPolicy, tables: kernels.GroupTables,
                 output: kernels.GroupOutput = kernels.GroupOutput.PAYLOAD) -> kernels.PackResult:
    """``members`` (rows of ``tables``) packed again at ``actions`` from their residuals alone, which hold ``v``
    again after an escalation's restore: no gradient, no NaN/Inf check, no screen; one batched pass."""
    n = len(members)
    return kernels.pack_group(kernels.PackRequest(members, [None] * n, residuals, intos, [None] * n, keys, actions,
                                                  False, False, False, policy.rule, output), tables)


def holds_nonfinite(g: torch.Tensor) -> bool:
    """Whether ``g`` holds NaN or Inf: one read back of its sum, and a second, exact one only if the sum is not
    finite (a finite gradient's sum can overflow to Inf)."""
    if math.isfinite(float(host.to_host(g.sum()))):
        return False
    return not host.to_host(torch.isfinite(g).all())[()]


def flat_gradient(name: str, tensor: torch.Tensor, numel: int) -> torch.Tensor:
    """The gradient as a flat contiguous float32 tensor, after checking it fits its parameter."""
    if tensor.is_sparse:
        raise TypeError(f"SafeBits got a sparse gradient for {name!r}; use "
                        f"hvd.DistributedOptimizer(..., sparse_as_dense=True)")
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"gradient of {name!r} has dtype {tensor.dtype}; SafeBits compresses floating point")
    check_numel(name, tensor, numel)
    if tensor.dim() == 1 and tensor.dtype == torch.float32 and not tensor.requires_grad and tensor.is_contiguous():
        return tensor       # already flat (the Horovod front end's view): every torch call costs microseconds
    g = tensor.detach().reshape(-1)
    if g.dtype != torch.float32:
        g = g.to(torch.float32)
    return g.contiguous()


def check_numel(name: str, tensor: torch.Tensor, numel: int) -> None:
    """``ValueError`` unless the gradient has its parameter's ``numel`` elements."""
    if tensor.numel() != numel:
        raise ValueError(f"gradient of {name!r} has {tensor.numel()} elements, its parameter {numel}")


def checked_into(name: str, g: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor | None:
    """``into``, the tensor that receives a gradient's ``q`` (:meth:`.core.SafeBitsCore.send`), checked to be flat
    contiguous float32 of ``g``'s size on its device (or ``g`` itself, or None)."""
    if into is not None and into is not g and (
            into.dtype != torch.float32 or into.dim() != 1 or not into.is_contiguous()
            or into.numel() != g.numel() or into.device != g.device):
        raise ValueError(f"into ({name!r}) must be a flat contiguous float32 tensor of {g.numel()} elements on "
                         f"{g.device}")
    return into


class MemberTensors:
    """The residuals of a group's members and the screen's samples of their buckets (None: all buckets, or no
    screen), as :class:`~.kernels.TensorList` (addresses taken once), kept per group while the residuals stay where
    they are (:attr:`.memory.ErrorFeedback.version`): the same groups come every step, and a lookup per member per
    step costs more than packing a small one (docs/RESULTS.md 5.1)."""

    LIMIT = 4096
    """Groups kept: a front end whose groups change every step starts the cache again."""

    def __init__(self, sender: Sender) -> None:
        self.sender = sender
        self._made: dict[tuple[bytes, torch.device], tuple[int, kernels.TensorList, kernels.TensorList,
                                                           kernels.TensorList | None]] = {}

    @contextlib.contextmanager
    def of(self, members: np.ndarray, device: torch.device) -> Iterator[tuple[list[torch.Tensor],
                                                                             list[torch.Tensor | None]]]:
        """(residuals, samples) of ``members`` on ``device`` while the block runs, the residuals as float32 tensors
        that the passes update in place. Residuals stored as bfloat16 (:attr:`.memory.ErrorFeedback.stages`) are
        copied into the memory's float32 staging buffer first and rounded back into their storage when the block
        ends, however it ends (unchanged ones come back bitwise: bfloat16 to float32 and back is exact)."""
        sender, memory = self.sender, self.sender.memory
        if not sender.error_feedback:        # a new zero residual each call: nothing to keep
            rows = members.tolist()
            yield [sender.residual(i, int(sender.numels[i]), device) for i in rows], self._samples(rows, device)
            return
        key = (members.tobytes(), device)
        made = self._made.get(key)
        if made is None or made[0] != memory.version:
            rows = members.tolist()
            residuals = kernels.TensorList(sender.residual(i, int(sender.numels[i]), device) for i in rows)
            staged = None
            if memory.stages:
                sizes = [e.numel() for e in residuals]
                total = sum(sizes)
                staged = kernels.TensorList(memory.staging(total, device)[:total].split(sizes))
            samples = kernels.TensorList(self._samples(rows, device))
            if len(self._made) >= self.LIMIT:
                self._made.clear()
            made = self._made[key] = (memory.version, residuals, samples, staged)   # the version once all exist
        _, residuals, samples, staged = made
        if staged is None:
            yield residuals, samples
            return
        torch._foreach_copy_(staged, residuals)
        try:
            yield staged, samples
        finally:
            torch._foreach_copy_(residuals, staged)

    def _samples(self, rows: list[int], device: torch.device) -> list[torch.Tensor | None]:
        sender = self.sender
        screening = sender.policy.allocates_from_statistics
        return [sender.sample_of(i, int(sender.numels[i]), device) if screening else None for i in rows]


class Sender:
    """The screen and the send of one core's tensors (steps 2 and 3), given each step's allocation and statistics
    vector by :meth:`begin`. It owns nothing checkpointed but reads and updates the core's residuals."""

    def __init__(self, names: list[str], numels: np.ndarray, policy: BudgetPolicy, memory: ErrorFeedback, *,
                 error_feedback: bool, nonfinite: str, sample_buckets: int, tables: kernels.GroupTables) -> None:
        self.names = names
        self.numels = numels
        self.policy = policy
        self.menu = policy.menu
        self.memory = memory
        self.error_feedback = error_feedback
        self.nonfinite = nonfinite
        self.sample_buckets = sample_buckets
        self.tables = tables
        # Each tensor's lossless action's position in its cost order (what a pass-through step records as sent).
        self.lossless_position = policy.position_in_cost_order[:, policy.lossless_index].copy()
        # Without error feedback there is no residual to protect: NaN/Inf go through the quantizer as they would
        # through Horovod's own compressors (the baselines), and the check's extra pass is saved.
        self.checks_finite = error_feedback or nonfinite != "propagate"
        self._samples: dict[int, torch.Tensor | None] = {}       # per tensor: the screen's buckets (None: all)
        self.member_tensors = MemberTensors(self)
        # The step in progress (begin).
        self.step, self.seed = 0, 0
        self.allocation: Allocation | None = None
        self.statistics: StepStatistics | None = None
        self.path: Any = None
        self.pass_through_step = False

    def begin(self, step: int, seed: int, allocation: Allocation, statistics: StepStatistics, path: Any,
              pass_through_step: bool = False) -> None:
        self.step, self.seed, self.allocation, self.statistics, self.path = step, seed, allocation, statistics, path
        self.pass_through_step = pass_through_step

    # ------------------------------------------------------------------ one tensor
    def send(self, index: int, g: torch.Tensor, into: torch.Tensor | None) -> Any:
        """Screen and send tensor ``index`` (flat float32 ``g``) on the step's path; returns what travels."""
        assert self.allocation is not None and self.statistics is not None
        if self.pass_through_step:            # before the residual is looked up: a missing one is not made
            return self.pass_through(index, g, into)
        statistics, policy, path = self.statistics, self.policy, self.path
        allocated = int(self.allocation.choice[index])
        action = self.menu[allocated]
        if not self.error_feedback and not path.packed and action.kind in (ActionKind.FLOAT32, ActionKind.FLOAT16):
            # Horovod's NoneCompressor and FP16Compressor (the fp32 and fp16 baselines): no memory, at most a cast
            # on the wire, nothing measured (the fp16 cast's distortion is recorded as NaN).
            statistics.sent_position[index] = policy.position_in_cost_order[index, allocated]
            statistics.sent_distortion[index] = 0.0 if action.lossless else math.nan
            statistics.neg_sent_cosine[index] = -1.0 if action.lossless else math.nan
            return g if action.lossless else g.to(torch.float16)
        # Dense (the packed paths are batched: the core only registers their tensors): Horovod allreduces the
        # values compress returns, so each tensor is a group of one.
        out = into if into is not None else torch.empty_like(g)
        return self.send_values(np.array([index], dtype=np.int64), [g], [out])[0]

    def send_values(self, members: np.ndarray, grads: list[torch.Tensor], outs: list[torch.Tensor]) -> list[Any]:
        """The dense path's batched pass (:meth:`send_members`, ``GroupOutput.VALUES``: one read back, no payload):
        each member's ``q`` into its ``outs`` tensor (which may be its gradient). Returns what travels of each:
        ``outs[k]``, or what replaced it (a NaN/Inf gradient, as ``nonfinite`` says)."""
        _, replaced = self.send_members(members, grads, list(outs), kernels.GroupOutput.VALUES)
        return [replaced.get(int(index), out) for index, out in zip(members, outs, strict=True)]

    def pass_through(self, index: int, g: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        """A pass-through step (the budget fits every tensor uncompressed, on the dense path): the gradient as it
        is, as ``Compression.none`` sends it, with no screen and no pass over it; a residual left from earlier
        steps is added once and dropped (lossless: nothing is lost, only sent late). The NaN/Inf check runs only
        where ``nonfinite`` asks for more than passing them on. ``g`` may keep its own shape (contiguous) when
        ``into`` is None (:meth:`.core.SafeBitsCore.pass_through`); what is returned then is ``g``, or flat."""
        statistics = self.statistics
        assert statistics is not None
        if self.nonfinite != "propagate" and g.numel() and holds_nonfinite(g):
            return self.send_nonfinite(index, g.view(-1), into)
        self.record_pass_through(index)
        e = self.memory.pop(self.names[index]) if self.error_feedback and self.memory.residuals else None
        if e is None:
            return g
        out = into if into is not None else torch.empty_like(e, dtype=torch.float32)     # a bfloat16 residual too
        return torch.add(g.view(-1), e.to(g.device), out=out)

    def pass_through_is_unchanged(self) -> bool:
        """Whether a pass-through step's tensors go on exactly as they are: nothing to check for NaN/Inf and no
        residual left to flush (:meth:`pass_through` would return each gradient itself)."""
        return self.pass_through_step and self.nonfinite == "propagate" and not (self.error_feedback
                                                                            and self.memory.residuals)

    def record_pass_through(self, rows: Any) -> None:
        """The step's statistics of tensors passed through (one index or an array): the lossless action sent."""
        statistics = self.statistics
        assert statistics is not None
        statistics.sent_position[rows] = self.lossless_position[rows]
        statistics.sent_distortion[rows] = 0.0
        statistics.neg_sent_cosine[rows] = -1.0

    def record_sent(self, rows: Any, actions: Any, distortion: Any, cosine: Any, plannable: Any, v2: Any) -> None:
        """The step's statistics of what was sent: of one tensor (Python numbers) or of many (arrays)."""
        statistics = self.statistics
        assert statistics is not None and self.allocation is not None
        statistics.sent_position[rows] = self.policy.position_in_cost_order[rows, actions]
        statistics.escalated[rows] = actions != self.allocation.choice[rows]
        statistics.sent_distortion[rows] = distortion
        statistics.neg_sent_cosine[rows] = -cosine
        # The exact figure beats the estimate (it passed the screen; planning may need it to pass by more).
        statistics.screened[rows, actions] = np.where(plannable, distortion, np.inf)
        statistics.v2[rows] = np.where(np.isfinite(v2), v2, np.inf)     # never NaN: NaN would poison the MAX

    def send_nonfinite(self, index: int, g: torch.Tensor, into: torch.Tensor | None) -> Any:
        """A gradient holding NaN or Inf, by ``nonfinite``: raise, send zeros, or send it unquantized."""
        statistics, path = self.statistics, self.path
        assert statistics is not None
        if self.nonfinite == "raise":
            raise SafeBitsNonFiniteError(f"gradient of {self.names[index]!r} holds NaN or Inf at step {self.step}; "
                                         f"nothing was sent and its error-feedback residual is unchanged "
                                         f"(SafeBits(nonfinite='propagate') passes it on, 'skip' sends zeros)")
        # No statistics this step: the next allocation knows only the lossless action is safe for it.
        statistics.nonfinite[index] = 1.0
        statistics.v2[index] = math.inf
        if self.nonfinite == "skip":
            if into is not None:
                into.zero_()
            return path.zeros(index, g.numel(), g.device)
        statistics.sent_position[index] = self.policy.position_in_cost_order[index, self.policy.lossless_index]
        if into is not None and into.data_ptr() != g.data_ptr():
            into.copy_(g)
        # "propagate": the gradient itself, lossless, so NaN and Inf reach the reduced gradient as with an
        # uncompressed allreduce; the residual is not touched (a scratch zero residual takes its place).
        lossless = self.menu[self.policy.lossless_index]
        return path.encode(index, g, torch.zeros_like(g), lossless, 0, None)[0]

    # ------------------------------------------------------------------ a group (the batched step)
    def send_registered(self, members: list[int],
                   registered: dict[int, tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, np.ndarray,
                                                                                              int]:
        """The batched step of one group on a packed path (docs/DESIGN.md, "The batched step"):
        :meth:`send_members` of every member registered; members never registered (an incomplete step) send
        zeros. Returns the payloads back to back, where each member's starts (and the end), and the bytes of the
        registered members' payloads."""
        sent_members = np.array([i for i in members if i in registered], dtype=np.int64)
        buffer: torch.Tensor | None = None
        offsets = np.zeros(1, dtype=np.int64)
        payloads: dict[int, torch.Tensor] = {}
        device = torch.device("cpu")
        if len(sent_members):
            grads = [registered[i][0] for i in sent_members]
            device = grads[0].device
            result, payloads = self.send_members(sent_members, grads, [registered[i][1] for i in sent_members])
            buffer, offsets = result.buffer, result.offsets
        sizes = np.diff(offsets)
        for k, index in enumerate(sent_members.tolist()):
            if index in payloads:
                sizes[k] = payloads[index].numel()
        if len(payloads) or len(sent_members) != len(members):
            position = {int(i): k for k, i in enumerate(sent_members)}
            parts = []
            for index in members:
                if index in payloads:
                    parts.append(payloads[index])
                elif index in position:
                    k = position[index]
                    assert buffer is not None
                    parts.append(buffer[offsets[k]:offsets[k + 1]])
                else:
                    parts.append(self.path.zeros(index, int(self.numels[index]), device))
            buffer = torch.cat(parts)
            offsets = np.concatenate([[0], np.cumsum([p.numel() for p in parts])]).astype(np.int64)
        assert buffer is not None
        return buffer, offsets, int(sizes.sum())

    def send_members(self, members: np.ndarray, grads: list[torch.Tensor], intos: list[torch.Tensor | None],
                     output: kernels.GroupOutput = kernels.GroupOutput.PAYLOAD) -> tuple[kernels.PackResult,
                                                                                          dict[int, Any]]:
        """One pass screens, chooses and packs every member (:func:`.kernels.pack_group`, one read back), ``q``
        into its ``intos`` tensor if any (``GroupOutput.VALUES``: only there, the dense path's values); a NaN/Inf
        gradient then takes :meth:`send_nonfinite`, and members whose exact statistics fail the screen escalate
        together, one batched pass (one read back) per round (:meth:`escalate_group`). Returns the pass's result
        and, by tensor, what replaced a member's payload (or values) in it (escalated or non-finite)."""
        with self.member_tensors.of(members, grads[0].device) as (residuals, samples):
            return self._send_members(members, grads, intos, output, residuals, samples)

    def _send_members(self, members: np.ndarray, grads: list[torch.Tensor], intos: list[torch.Tensor | None],
                      output: kernels.GroupOutput, residuals: list[torch.Tensor],
                      samples: list[torch.Tensor | None]) -> tuple[kernels.PackResult, dict[int, Any]]:
        policy = self.policy
        keys = stream_keys(self.seed, self.step, members)
        result = kernels.pack_group(self.group_request(members, grads, residuals, samples, intos, keys, output),
                                    self.tables)
        self.take_screen(members, result)
        payloads: dict[int, Any] = {}
        values = output == kernels.GroupOutput.VALUES
        sent_at = result.chosen.copy()          # the action each member's payload in hand was made at

        def repack(rows: np.ndarray, actions: np.ndarray) -> np.ndarray:
            for k in rows.tolist():
                index = int(members[k])
                sent = payloads.get(index, intos[k] if values
                                    else result.buffer[result.offsets[k]:result.offsets[k + 1]])
                self.path.restore(index, sent, residuals[k], self.names[index], int(sent_at[k]))     # e <- e + q
            sent_at[rows] = actions
            retry = packed_again(members[rows], [residuals[k] for k in rows], [intos[k] for k in rows], keys[rows],
                                 actions, policy, self.tables, output)
            for j, k in enumerate(rows.tolist()):
                index = int(members[k])
                payloads[index] = intos[k] if values else retry.buffer[retry.offsets[j]:retry.offsets[j + 1]]
            return retry.stats

        self.escalate_group(members, result, result.stats, grads, intos, payloads, repack)
        return result, payloads

    def group_request(self, members: np.ndarray, grads: list[torch.Tensor], residuals: list[torch.Tensor],
                      samples: list[torch.Tensor | None], intos: list[torch.Tensor | None], keys: np.ndarray,
                      output: kernels.GroupOutput = kernels.GroupOutput.PAYLOAD) -> kernels.PackRequest:
        """The batched pass's request for ``members`` (their residuals and samples: :attr:`member_tensors`): the
        NaN/Inf check, the screen on each member's sampled buckets, the choice from the allocation, and what
        ``output`` says to write."""
        policy = self.policy
        assert self.allocation is not None
        return kernels.PackRequest(members, grads, residuals, intos, samples, keys, self.allocation.choice[members],
                                 self.checks_finite, policy.allocates_from_statistics, policy.screen_enabled,
                                 policy.rule, output)

    def take_screen(self, members: np.ndarray, result: kernels.PackResult) -> None:
        """Record what the screen of a batched pass estimated, for the next allocation."""
        policy, statistics = self.policy, self.statistics
        assert statistics is not None
        finite = result.finite
        if policy.allocates_from_statistics:
            estimated, estimated_cosine = distortion_cosine(result.screen_stats[finite])
            statistics.screened[members[finite]] = np.where(
                policy.plannable(estimated, estimated_cosine), estimated, np.inf)

    def escalate_group(self, members: np.ndarray, result: kernels.PackResult, stats: np.ndarray,
                       grads: list[torch.Tensor], intos: list[torch.Tensor | None], payloads: dict[int, Any],
                       repack: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        """3. Send, batched: record the members whose exact statistics (``stats``, of what the pass sent at
        ``result.chosen``) pass the screen; send the non-finite ones as ``nonfinite`` says (their ``payloads``
        entry); escalate the rest together, one ``repack(rows, actions)`` per round (it restores those members'
        residuals from what they sent, packs each at its action, one read back, and returns the exact
        statistics), in each member's ``send_order``, until every one passes (the lossless action always does):
        the rounds of :func:`escalation_rounds`."""
        policy, statistics = self.policy, self.statistics
        assert statistics is not None and self.allocation is not None
        finite, chosen = result.finite, result.chosen
        allocated = self.allocation.choice[members]
        screening = policy.allocates_from_statistics
        distortion, cosine = distortion_cosine(stats)
        accepted = finite & policy.sent_passes(np.maximum(chosen, 0), distortion, cosine, ACCEPT_MARGIN)
        actions = chosen[accepted]
        self.record_sent(members[accepted], actions, distortion[accepted], cosine[accepted],
                         policy.sent_passes(actions, distortion[accepted], cosine[accepted],
                                            policy.planning_margin), stats[accepted, 3])
        orders: dict[int, list[int]] = {}
        for k in np.flatnonzero(~accepted).tolist():
            index = int(members[k])
            if not finite[k]:
                payloads[index] = self.send_nonfinite(index, grads[k], intos[k])
                continue
            ok = (policy.screen(*distortion_cosine(result.screen_stats[k])) if screening
                  else np.ones(len(self.menu), dtype=bool))
            orders[k] = policy.send_order(index, int(allocated[k]), ok)
        tried = {k: 0 for k in orders}          # the position in its order of the action each row last failed
        for r in escalation_rounds(orders, repack, policy):
            for k in r.rows.tolist():
                statistics.screened[int(members[k]), orders[k][tried[k]]] = math.inf
                tried[k] += 1
            passed = r.passed
            self.record_sent(members[r.rows[passed]], r.actions[passed], r.distortion[passed], r.cosine[passed],
                             policy.sent_passes(r.actions[passed], r.distortion[passed], r.cosine[passed],
                                                policy.planning_margin), r.stats[passed, 3])

    # ------------------------------------------------------------------ per-tensor state
    def sample_of(self, index: int, n: int, device: torch.device) -> torch.Tensor | None:
        """The whole buckets the screen estimates on (None: all of them)."""
        if index not in self._samples:
            buckets = -(-n // self.menu.bucket_size)
            if buckets <= self.sample_buckets:
                sample = None
            else:   # evenly spaced whole buckets: unbiased for the per-bucket quantizers, same RNG draws
                sample = ((torch.arange(self.sample_buckets, dtype=torch.float64) + 0.5)
                          * (buckets / self.sample_buckets)).floor().to(torch.int64).to(device)
            self._samples[index] = sample
        return self._samples[index]

    def residual(self, index: int, n: int, device: torch.device) -> torch.Tensor:
        if self.error_feedback:
            return self.memory.residual(self.names[index], n, device)
        return torch.zeros(n, dtype=torch.float32, device=device)   # no memory: dropped after the call
