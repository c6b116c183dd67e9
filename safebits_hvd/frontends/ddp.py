"""The PyTorch DDP front end: a communication hook over :class:`~.core.SafeBitsCore` (docs/DESIGN.md, "The life of
one step under DDP").

    from safebits_hvd import ddp as sbddp
    state = sbddp.SafeBitsState(model.named_parameters(), budget_bits=4.4)
    ddp_model.register_comm_hook(state, sbddp.safebits_hook)
    ...
    state.last_step        # the StepRecord of the last step, as with the Horovod front end

DDP calls the hook once per gradient bucket, in bucket order, identically on every rank. Each tensor of the bucket
has its own action, screen and residual; on the allgather path each :data:`CHUNK_BYTES` of the bucket's payloads
is one group of the step (``SafeBitsCore.send_group``), sent in one batched pass and one ``torch.distributed``
collective (:class:`~.transports.TorchDistributedTransport`) started as soon as it is packed, so it overlaps the
packing of the rest of the bucket and the rest of backward. The hook of the last bucket (``bucket.is_last()``) closes
the step: the core has then started the statistics exchange (one asynchronous ``all_reduce(MAX)``,
:class:`~.exchange.TorchDistributedExchange`); it waits for every bucket's collective, decodes the payloads in rank
order into each bucket's buffer (the mean over ranks, bitwise the same on every rank), finishes the step (record,
digest check) and completes every bucket's future. DDP waits for those futures only after backward.
"""

# No "from __future__ import annotations": DDP compares the hook's annotations with the real classes.
import os
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ..codec.actions import DEFAULT_MENU, Menu
from ..comm.exchange import DEFAULT_TIMEOUT, StatisticsExchange, wait_work
from ..comm.transports import PayloadTransport, over_process_group
from ..step.core import Grouping, Handle
from .shared import CoreView, build_core, check_transports, refuse_unsent

CHUNK_BYTES = 1 << 18
"""Payload bytes (at the allocated actions) after which a bucket's payloads start their allgather on the CPU, before
the rest of the bucket is packed: the last bucket's bytes, which nothing else overlaps, then travel while its later
tensors are still being packed (docs/RESULTS.md 5.3)."""

DEVICE_CHUNK_BYTES = 1 << 40
"""The same on a GPU: the whole bucket is one group (its send costs a fixed handful of launches and one read back
whatever its size, so cutting it would only add reads)."""


class _Piece(NamedTuple):
    """One tensor of a bucket: its parameter index and its range in the bucket's buffer."""

    index: int
    start: int
    stop: int
    target: torch.Tensor | None     # that range as a view when the buffer is float32: the mean is decoded into it


class _PendingBucket(NamedTuple):
    """A bucket whose reduction completes when the step closes."""

    future: torch.futures.Future[torch.Tensor]
    buffer: torch.Tensor
    pieces: list[_Piece]
    work: Any                   # dense path: the buffer's all_reduce


class SafeBitsState(CoreView):
    """SafeBits' state for one DDP model: pass it with :func:`safebits_hook` to ``register_comm_hook``.

    Args:
        named_parameters: ``model.named_parameters()`` of the wrapped (``DistributedDataParallel``) or the
            unwrapped model: parameters are matched to DDP's buckets by identity. Parameters with
            ``requires_grad=False`` are ignored, as DDP ignores them. Every parameter DDP reduces must be here.
        process_group: the DDP model's process group (``DistributedDataParallel(..., process_group=)``); None:
            the default group.
        budget_bits, max_distortion, min_cosine, menu, seed, log_path, sample_buckets, consistency_check_every,
        nonfinite, screen, name, max_history, collective, timeout, residual_dtype: as
        :class:`~safebits_hvd.SafeBits`. With
        ``collective="auto"`` two ranks use ``"allgather"`` and more use ``"two_phase"`` (an ``all_to_all``, which
        Gloo and NCCL both have); ``"dense"`` all-reduces the dequantized float32 values.
        chunk_bytes: on the allgather path, the payload bytes (at the allocated actions) after which a bucket's
            payloads start their collective while the rest of the bucket is still being packed; None (default): by
            the bucket's device, :data:`CHUNK_BYTES` on the CPU, :data:`DEVICE_CHUNK_BYTES` (the whole bucket) on a
            GPU.
        exchange, transport: the statistics and payload transports; default None: ``torch.distributed`` on
            ``process_group`` when it has several ranks, else local.

    The state may be built before ``torch.distributed`` is initialized, because a trainer takes it before it
    creates the process group (Lightning's ``DDPStrategy(ddp_comm_state=state, ...)``; the launched ranks build
    their trainer, then ``fit`` initializes the group and wraps the model). Pass the unwrapped module's
    ``named_parameters()``: wrapping in DDP and moving the module keep each parameter's identity. The options and
    parameters are checked at construction either way; the process-group checks run at construction when the
    group exists, else at the first hook call, and the transports are chosen at the first step. A parameter DDP
    reduces that the state was not built from (another model, parameters created after the state, as in
    Lightning's ``configure_model``), or one the state has that DDP does not reduce, raises ``ValueError`` at the
    first step on every rank.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | Any,
                 budget_bits: float | str | Callable[[int], float] = 4.0, max_distortion: float = 0.5,
                 min_cosine: float = 0.7, menu: Menu | Iterable[str] = DEFAULT_MENU, seed: int = 0,
                 log_path: str | os.PathLike[str] | None = None, *, process_group: Any = None,
                 sample_buckets: int = 16, consistency_check_every: int = 1, nonfinite: str = "propagate",
                 screen: bool = True, name: str = "safebits", max_history: int = 1000, collective: str = "auto",
                 timeout: float | None = DEFAULT_TIMEOUT, chunk_bytes: int | None = None,
                 exchange: StatisticsExchange | None = None, transport: PayloadTransport | None = None,
                 residual_dtype: torch.dtype = torch.float32) -> None:
        self.process_group = process_group
        self._group_checked = False
        if not dist.is_available() or dist.is_initialized():
            self._check_group()         # else at the first hook call: a trainer builds the state before the group
        check_transports(exchange, transport)
        if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int)
                                        or chunk_bytes < 1):
            raise ValueError(f"chunk_bytes must be a positive int or None, got {chunk_bytes!r}")
        self.chunk_bytes = chunk_bytes
        links = over_process_group(process_group)      # made at the first step, when the group exists
        params, core = build_core(
            named_parameters, budget_bits, max_distortion, min_cosine, menu, seed, log_path,
            sample_buckets=sample_buckets, consistency_check_every=consistency_check_every, nonfinite=nonfinite,
            screen=screen, name=name, max_history=max_history, collective=collective, timeout=timeout,
            exchange=exchange if exchange is not None else links.exchange,
            transport=transport if transport is not None else links.transport,
            fusion_bytes=0,       # the hook batches a bucket's payloads itself (CHUNK_BYTES, the transport's flush)
            residual_dtype=residual_dtype)
        self.core = core
        self.names = core.names
        self.timeout = timeout
        self._index_by_id = {id(p): i for i, p in enumerate(params)}
        self._numels: list[int] = core.numels.tolist()
        self._params = params
        self._pending: list[_PendingBucket] = []

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def _check_group(self) -> None:
        """torch.distributed is initialized and this rank is in ``process_group``."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("SafeBitsState needs torch.distributed initialized (dist.init_process_group) first")
        if dist.get_rank(self.process_group) < 0:
            raise ValueError(f"rank {dist.get_rank()} is not in the process group SafeBitsState was given; build "
                             f"it only on the ranks of its DDP model's group")
        self._group_checked = True

    # ------------------------------------------------------------------ one bucket
    def _index_of(self, parameter: torch.Tensor) -> int:
        index = self._index_by_id.get(id(parameter))
        if index is None or self._params[index] is not parameter:
            raise ValueError(f"DDP reduces a parameter of shape {tuple(parameter.shape)} that SafeBitsState does not "
                             f"know; build SafeBitsState from the same model's named_parameters() as DDP")
        return index

    def reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Send every tensor of ``bucket`` through the core, start the bucket's collective, and return the future
        of its mean over ranks (completed when the last bucket of the step is reduced)."""
        if not self._group_checked:
            self._check_group()         # the state was built before the process group
        core = self.core
        buffer = bucket.buffer()
        if self.chunk_bytes is None:
            self.chunk_bytes = DEVICE_CHUNK_BYTES if buffer.device.type == "cuda" else CHUNK_BYTES
        indices = [self._index_of(p) for p in bucket.parameters()]     # every one known before anything is sent
        numels = [self._numels[i] for i in indices]
        if sum(numels) != buffer.numel():
            raise RuntimeError(f"DDP bucket {bucket.index()} holds {buffer.numel()} elements, its parameters "
                               f"{sum(numels)}")
        in_place = buffer.dtype == torch.float32      # decode straight into DDP's buffer
        began = not core.in_step
        if began:
            self._pending = []       # buckets of a step that an error interrupted: DDP never waits for them
        handle = core.begin(Grouping(self.chunk_bytes, f"chunk_bytes {self.chunk_bytes}", "SafeBitsState"))
        pieces: list[_Piece] = []     # passing through, none: DDP all-reduces the bucket as its default hook does
        if not (in_place and core.pass_through_unchanged(indices, buffer)):
            pieces = self._send(handle, buffer, bucket, indices, numels, in_place)
        work = None
        if not handle.packed and self.world_size > 1:        # the values: DDP's own all_reduce of the bucket
            work = dist.all_reduce(buffer, group=self.process_group, async_op=True)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._pending.append(_PendingBucket(future, buffer, pieces, work))
        if bucket.is_last():
            self._close_step(handle)
        return future

    def _send(self, handle: Handle, buffer: torch.Tensor, bucket: dist.GradBucket, indices: list[int],
              numels: list[int], in_place: bool) -> list[_Piece]:
        """Send the bucket's tensors through the core on the step's path; returns their pieces of the buffer."""
        core = self.core
        # What DDP reduces is the buffer: its ranges are the gradients (bucket.gradients() would make the same
        # views one at a time); a buffer of another dtype is converted per tensor by the core.
        grads = list(buffer.split(numels)) if in_place else bucket.gradients()
        starts = np.concatenate([[0], np.cumsum(numels)]).tolist()
        targets = grads if in_place else [None] * len(indices)
        pieces = [_Piece(index, starts[k], starts[k + 1], targets[k]) for k, index in enumerate(indices)]
        if handle.packed:
            # Each chunk of the bucket (on the allgather path about chunk_bytes of payloads) sent in one batched
            # pass, its collective started before the rest of the bucket is packed.
            for start, stop in core.chunks(indices, self.chunk_bytes):
                core.send_group(indices[start:stop], grads[start:stop], targets[start:stop], close=False)
            # Closing starts the statistics exchange: only after the allocation check and the payloads' launch,
            # so every rank issues its collectives in the same order even when the check fails.
            core.close()
        elif in_place:
            # The dequantized values replace the gradients in the buffer (one batched pass), which DDP all-reduces.
            core.send_group(indices, grads, targets)
        else:
            for k, index in enumerate(indices):
                sent = core.send(index, grads[k], into=targets[k])
                if sent.wire is not targets[k]:
                    buffer[starts[k]:starts[k + 1]].copy_(sent.wire)     # the values, into the buffer
        return pieces

    def _close_step(self, handle: Handle) -> None:
        """The last bucket: every bucket's mean into its buffer, the step finished, every future completed."""
        core = self.core
        pending, self._pending = self._pending, []
        refuse_unsent(core, "SafeBitsState")
        ranks = self.world_size
        for bucket in pending:
            if not handle.packed:
                if bucket.work is not None:
                    wait_work(bucket.work, self.timeout, "the DDP bucket's all_reduce")
                    bucket.buffer.div_(ranks)
                core.noise.reduced([bucket.buffer])
                continue
            pieces = bucket.pieces
            totals = core.reduced_sums([p.index for p in pieces], handle, [p.target for p in pieces],
                                       divisor=ranks)
            for piece, total in zip(pieces, totals, strict=True):
                if piece.target is None:
                    bucket.buffer[piece.start:piece.stop].copy_(total)
        core.end(handle.step)                   # its statistics exchange runs until the next step begins
        for bucket in pending:
            bucket.future.set_result(bucket.buffer)


def safebits_hook(state: SafeBitsState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``ddp_model.register_comm_hook(state, safebits_hook)``."""
    return state.reduce_bucket(bucket)


from .ddp_nodes import AcrossNodesState  # noqa: E402  (the hop across nodes only: the same hook)

__all__ = ["AcrossNodesState", "SafeBitsState", "safebits_hook"]
