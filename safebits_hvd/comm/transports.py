"""Payload transports: how uint8 buffers move between ranks (GRACE's "communicator"), for the collective paths of
:mod:`.collectives`. ``start_*`` never blocks; ``wait`` returns the result, bounded by a timeout
(:func:`~.exchange.wait_bounded`). Horovod's front end uses :class:`HorovodTransport`, the DDP hook
:class:`TorchDistributedTransport`, one process :class:`LocalTransport`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from ..codec import host
from ..errors import SafeBitsConsistencyError
from .exchange import (
    DEFAULT_TIMEOUT,
    LocalExchange,
    StatisticsExchange,
    TorchDistributedExchange,
    check_member,
    horovod_if_initialized,
    torch_distributed_group,
    wait_bounded,
    wait_work,
)


@runtime_checkable
class PayloadTransport(Protocol):
    """Moves uint8 buffers between ranks; ``start_*`` must not block, ``wait`` returns the result:
    ``start_allgather``: every rank's buffer, concatenated in rank order; ``start_alltoall``: ``(received,
    received_splits)``, the pieces every rank sent this one, in rank order."""

    rank: int
    size: int

    def start_allgather(self, name: str, payload: torch.Tensor) -> Any:
        ...

    def start_alltoall(self, name: str, buffer: torch.Tensor, splits: list[int]) -> Any:
        ...

    def wait(self, handle: Any) -> Any:
        ...


class LocalTransport:
    """One process: every collective returns this rank's own buffer."""

    rank = 0
    size = 1

    def start_allgather(self, name: str, payload: torch.Tensor) -> Any:
        return payload

    def start_alltoall(self, name: str, buffer: torch.Tensor, splits: list[int]) -> Any:
        return buffer, torch.tensor(splits, dtype=torch.int32)

    def wait(self, handle: Any) -> Any:
        return handle


class HorovodTransport:
    """Horovod's ``allgather_async`` and ``alltoall_async`` of uint8 buffers under fixed names, on a process set
    (default: every rank); waits are bounded by ``timeout`` seconds (:func:`~.exchange.wait_bounded`)."""

    def __init__(self, process_set: Any = None, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        import horovod.torch as hvd

        self._hvd = hvd
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()
        self.timeout = timeout

    def start_allgather(self, name: str, payload: torch.Tensor) -> Any:
        return self._hvd.allgather_async(payload, name=name, process_set=self.process_set), name

    def start_alltoall(self, name: str, buffer: torch.Tensor, splits: list[int]) -> Any:
        return self._hvd.alltoall_async(buffer, splits=torch.tensor(splits, dtype=torch.int32), name=name,
                                        process_set=self.process_set), name

    def wait(self, handle: Any) -> Any:
        horovod_handle, name = handle
        wait_bounded(lambda: self._hvd.poll(horovod_handle), self.timeout, f"SafeBits' payload collective {name!r}")
        return self._hvd.synchronize(horovod_handle)


class _QueuedAllgather:
    """Allgathers queued by :class:`TorchDistributedTransport` until its next flush: launched as ONE collective.

    torch's all_gather moves equal sizes. With ``expected`` (bytes every rank expects the batch to total,
    identical on every rank) nothing waits at launch: each rank sends its payloads' lengths and the first
    ``expected`` bytes of its payloads; a rank whose payloads are longer (it escalated) sends the rest in a second
    all_gather that every rank starts at :meth:`complete`, having read from the lengths who has a rest. Without
    it, every rank's lengths are exchanged first (blocking), then the payloads, padded to the longest rank's.
    """

    def __init__(self) -> None:
        self.payloads: list[torch.Tensor] = []
        self.names: list[str] = []
        self.launched = False
        self.work: Any = None
        self.expected: int | None = None
        self.received: list[torch.Tensor] = []          # per rank: every byte of its payloads, once complete
        self.lengths = np.zeros((0, 0), dtype=np.int64)  # [rank, payload] bytes
        self.offsets = np.zeros((0, 0), dtype=np.int64)
        self._rest = torch.empty(0, dtype=torch.uint8)

    def launch(self, transport: TorchDistributedTransport, expected: int | None) -> None:
        self.launched = True
        device = transport.device
        count = len(self.payloads)
        lengths = np.array([p.numel() for p in self.payloads], dtype=np.int64)
        body = torch.cat([p.to(device) for p in self.payloads])     # a no-op where payloads are on the group's device
        self.payloads = []
        if expected is None:
            self.lengths = transport.gather_now(host.upload(device, {"lengths": lengths})["lengths"],
                                                f"the sizes of {self.names[0]!r}...")
            longest = int(self.lengths.sum(axis=1).max())
            mine = torch.zeros(longest, dtype=torch.uint8, device=device)
            mine[:body.numel()] = body
        else:
            self.expected = expected
            head = min(body.numel(), expected)
            mine = torch.zeros(8 * count + expected, dtype=torch.uint8, device=device)
            mine[:8 * count] = host.upload(device, {"lengths": lengths})["lengths"].view(torch.uint8)
            mine[8 * count:8 * count + head] = body[:head]
            self._rest = body[head:]
        self.received = [torch.empty_like(mine) for _ in range(transport.size)]
        self.work = transport.dist.all_gather(self.received, mine, group=transport.process_group, async_op=True)

    def complete(self, transport: TorchDistributedTransport, what: str) -> None:
        """Wait for the batch (and move the rests, if any rank has one); afterwards :meth:`result` works."""
        if self.work is None:
            return
        wait_work(self.work, transport.timeout, what)
        self.work = None
        if self.expected is not None:
            count, expected = len(self.names), self.expected
            self.lengths = host.to_host(torch.stack([r[:8 * count] for r in self.received])).view(np.int64)
            totals = self.lengths.sum(axis=1)
            rests = np.maximum(totals - expected, 0)
            heads = [r[8 * count:8 * count + int(t) - int(rest)] for r, t, rest in zip(self.received, totals, rests,
                                                                                       strict=True)]
            if rests.any():      # every rank read the same lengths: every rank starts this second collective
                longest = int(rests.max())
                mine = torch.zeros(longest, dtype=torch.uint8, device=transport.device)
                mine[:self._rest.numel()] = self._rest
                pieces = [torch.empty_like(mine) for _ in range(transport.size)]
                work = transport.dist.all_gather(pieces, mine, group=transport.process_group, async_op=True)
                wait_work(work, transport.timeout, what)
                heads = [torch.cat([h, p[:int(rest)]]) for h, p, rest in zip(heads, pieces, rests, strict=True)]
            self.received = heads
            self._rest = torch.empty(0, dtype=torch.uint8)
        self.offsets = np.cumsum(self.lengths, axis=1) - self.lengths

    def result(self, position: int) -> torch.Tensor:
        """Every rank's payload ``position`` of the batch, concatenated in rank order."""
        return torch.cat([self.received[r][int(self.offsets[r, position]):
                                           int(self.offsets[r, position] + self.lengths[r, position])]
                          for r in range(len(self.received))])


class _QueuedAlltoall:
    """One alltoall queued by :class:`TorchDistributedTransport` until its next flush.

    ``all_to_all_single`` needs the sizes each rank receives. With ``expected`` (per destination ``d``, the bytes
    every rank expects to send ``d``: the same list on every rank) nothing waits at launch: each split carries this
    rank's split lengths (one int64 per destination) and its first ``expected[d]`` bytes, zero-padded; at
    :meth:`complete` one read of the lengths tells every rank every split's length, and the rests of longer splits
    (a rank escalated) move in a second alltoall that every rank starts alike. Without it, every rank's splits are
    exchanged first (blocking), then the payloads."""

    def __init__(self, name: str, buffer: torch.Tensor, splits: list[int]) -> None:
        self.names = [name]
        self.buffer = buffer
        self.splits = splits
        self.launched = False
        self.work: Any = None
        self.expected: list[int] | None = None
        self._rests: list[torch.Tensor] = []     # with expected: what of each split did not fit its expected bytes
        self.received = torch.empty(0, dtype=torch.uint8)
        self.received_splits: list[int] = []

    def launch(self, transport: TorchDistributedTransport, expected: list[int] | None) -> None:
        self.launched = True
        device, ranks = transport.device, transport.size
        buffer = self.buffer.to(device)
        if expected is None:       # every rank's splits first (small, blocking)
            splits = host.upload(device, {"splits": np.array(self.splits, dtype=np.int64)})["splits"]
            matrix = transport.gather_now(splits, f"the splits of {self.names[0]!r}")
            self.received_splits = [int(v) for v in matrix[:, transport.rank]]
            self.received = torch.empty(sum(self.received_splits), dtype=torch.uint8, device=device)
            self.work = transport.dist.all_to_all_single(self.received, buffer, self.received_splits, self.splits,
                                                         group=transport.process_group, async_op=True)
            return
        if len(expected) != ranks:
            raise ValueError(f"an alltoall's expected sizes are one per rank ({ranks}), got {len(expected)}")
        self.expected = [int(e) for e in expected]
        lengths = host.upload(device, {"lengths": np.array(self.splits, dtype=np.int64)})["lengths"].view(torch.uint8)
        starts = np.concatenate([[0], np.cumsum(self.splits)]).astype(np.int64)
        send = [8 * ranks + e for e in self.expected]
        mine = torch.zeros(sum(send), dtype=torch.uint8, device=device)
        rests, at = [], 0
        for d, e in enumerate(self.expected):
            head = min(self.splits[d], e)
            mine[at:at + 8 * ranks] = lengths
            mine[at + 8 * ranks:at + 8 * ranks + head] = buffer[int(starts[d]):int(starts[d]) + head]
            rests.append(buffer[int(starts[d]) + head:int(starts[d + 1])])
            at += send[d]
        self._rests = rests
        self.received = torch.empty(ranks * send[transport.rank], dtype=torch.uint8, device=device)
        self.work = transport.dist.all_to_all_single(self.received, mine, [send[transport.rank]] * ranks, send,
                                                     group=transport.process_group, async_op=True)

    def complete(self, transport: TorchDistributedTransport, what: str) -> None:
        if self.work is None:
            return
        wait_work(self.work, transport.timeout, what)
        self.work = None
        if self.expected is None:
            return
        ranks, me, expected = transport.size, transport.rank, self.expected
        parts = self.received.view(ranks, -1)
        lengths = host.to_host(parts[:, :8 * ranks].contiguous()).view(np.int64)     # [source, destination]
        rests = np.maximum(lengths - np.array(expected, dtype=np.int64)[None, :], 0)
        heads = [parts[s, 8 * ranks:8 * ranks + int(lengths[s, me] - rests[s, me])] for s in range(ranks)]
        if rests.any():      # every rank read the same lengths: every rank starts this second alltoall
            out = torch.empty(int(rests[:, me].sum()), dtype=torch.uint8, device=transport.device)
            work = transport.dist.all_to_all_single(out, torch.cat(self._rests), rests[:, me].tolist(),
                                                    rests[me].tolist(), group=transport.process_group,
                                                    async_op=True)
            wait_work(work, transport.timeout, what)
            tails = out.split(rests[:, me].tolist())
            heads = [torch.cat([h, t]) for h, t in zip(heads, tails, strict=True)]
        self._rests = []
        self.received_splits = lengths[:, me].tolist()
        self.received = torch.cat(heads)

    def result(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.received, torch.tensor(self.received_splits, dtype=torch.int32)


class TorchDistributedTransport:
    """``torch.distributed`` collectives of uint8 buffers on a process group (None: the default group), for the DDP
    front end (:mod:`.ddp`); Gloo on CPU, NCCL on GPU.

    ``start_allgather`` and ``start_alltoall`` only queue (they never block); :meth:`flush` launches everything
    queued, in order, and consecutive allgathers as ONE collective: the DDP hook flushes after every
    ``chunk_bytes`` of a bucket's payloads and at the bucket's end, so they travel in a few collectives. torch's
    collectives need every rank's sizes up front: the DDP hook passes the bytes the queued payloads' allocated
    actions take (identical on every rank), so nothing waits at launch and only
    an escalated rest moves in a second collective when the step closes (:class:`_QueuedAllgather`); otherwise
    each launch is preceded by one small blocking all_gather of the sizes. Every rank flushes and waits at the
    same points (the same bucket sequence), so none can deadlock. ``wait`` flushes first if its collective is
    still queued; every wait is bounded by ``timeout`` seconds (:func:`~.exchange.wait_bounded`).
    """

    def __init__(self, process_group: Any = None, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        self.dist, self.rank, self.size, self.device = torch_distributed_group(process_group)
        self.process_group = process_group
        self.timeout = timeout
        self._queue: list[_QueuedAllgather | _QueuedAlltoall] = []

    def start_allgather(self, name: str, payload: torch.Tensor) -> Any:
        if not self._queue or not isinstance(self._queue[-1], _QueuedAllgather):
            self._queue.append(_QueuedAllgather())
        batch = self._queue[-1]
        assert isinstance(batch, _QueuedAllgather)
        batch.payloads.append(payload)
        batch.names.append(name)
        return batch, len(batch.payloads) - 1

    def start_alltoall(self, name: str, buffer: torch.Tensor, splits: list[int]) -> Any:
        operation = _QueuedAlltoall(name, buffer, splits)
        self._queue.append(operation)
        return operation, 0

    def flush(self, expected_bytes: int | list[int] | None = None) -> None:
        """Launch every queued collective, in the order queued. ``expected_bytes``, when exactly one is queued: what
        a batch of allgathers' payloads should total on every rank, or what every rank should send each rank in an
        alltoall (the same on every rank)."""
        queue, self._queue = self._queue, []
        if expected_bytes is not None:
            wanted = _QueuedAlltoall if isinstance(expected_bytes, list) else _QueuedAllgather
            if len(queue) != 1 or not isinstance(queue[0], wanted):
                raise ValueError(f"flush(expected_bytes) needs exactly one queued {wanted.__name__[7:].lower()}, "
                                 f"not {[type(q).__name__ for q in queue]}")
        for operation in queue:
            operation.launch(self, expected_bytes)  # type: ignore[arg-type]

    def wait(self, handle: Any) -> Any:
        operation, position = handle
        if not operation.launched:
            self.flush()
        operation.complete(self, f"SafeBits' payload collective {operation.names[0]!r} (torch.distributed)")
        return operation.result(position)

    def start_gather(self, values: torch.Tensor) -> Any:
        """Start gathering every rank's ``values`` (same shape everywhere); :meth:`finish_gather` waits for them."""
        pieces = [torch.empty_like(values) for _ in range(self.size)]
        return pieces, self.dist.all_gather(pieces, values, group=self.process_group, async_op=True)

    def finish_gather(self, handle: Any, what: str) -> np.ndarray:
        """The values of :meth:`start_gather`, stacked in rank order, on the host (a bounded wait, one read)."""
        pieces, work = handle
        wait_work(work, self.timeout, f"SafeBits' exchange of {what} (torch.distributed)")
        return host.to_host(torch.stack(pieces))

    def gather_now(self, values: torch.Tensor, what: str) -> np.ndarray:
        """Every rank's ``values`` (same shape everywhere), in rank order, on the host (a bounded wait, one read)."""
        return self.finish_gather(self.start_gather(values), what)


def launch(transport: PayloadTransport, expected_bytes: int | list[int] | None = None) -> None:
    """Start the collectives ``transport`` holds back: :class:`TorchDistributedTransport` queues them until a flush
    (``expected_bytes``: what one queued batch of allgathers totals on every rank, or per rank what one queued
    alltoall sends it from every rank); every other transport started them already."""
    if isinstance(transport, TorchDistributedTransport):
        transport.flush(expected_bytes)


class AllocationCheck:
    """Before a step's first payload moves through ``torch.distributed``: every rank allocated alike and groups its
    payloads alike (else the collectives' sizes or counts differ, and Gloo or NCCL fails inside, or hangs).
    :meth:`start`, at the step's begin, launches one small all_gather of the allocation digest, the tensor count,
    the step's payload bytes at the allocated actions and the front end's ``grouping`` word; :meth:`finish` compares
    them before the first payload moves (the round trip overlaps the first packing). A mismatch raises
    :class:`~safebits_hvd.errors.SafeBitsConsistencyError` on every rank. Other transports: nothing to compare."""

    def __init__(self) -> None:
        # (step, transport, the gather in flight, the grouping, the digest), until finished
        self._pending: tuple[int, TorchDistributedTransport, Any, Any, str] | None = None

    def start(self, transport: PayloadTransport, step: int, grouping: Any, digest: str, tensors: int,
              payload_bytes: int) -> None:
        """``grouping``: the front end's (:class:`~.collectives.Grouping`), None where the path groups the tensors
        itself (nothing to compare)."""
        self._pending = None
        if grouping is None or not isinstance(transport, TorchDistributedTransport):
            return              # one rank, or another transport: nothing to compare
        value = int(digest, 16)
        words = host.upload(transport.device, {"words": np.array(
            [*((value >> (16 * k)) & 0xFFFF for k in range(4)), tensors, payload_bytes, grouping.word])})["words"]
        self._pending = (step, transport, transport.start_gather(words), grouping, digest)

    def finish(self) -> None:
        """Wait for the check :meth:`start` started, if any."""
        if self._pending is None:
            return
        (step, transport, handle, grouping, digest), self._pending = self._pending, None
        everyone = transport.finish_gather(handle, f"the allocation digest of step {step}")
        if not np.all(everyone == everyone[0]):
            raise SafeBitsConsistencyError(
                f"ranks disagree on the allocation of step {step} (this rank's digest {digest}, "
                f"{grouping.described}); every rank must build {grouping.built_as} with the same parameters, menu, "
                f"budget, thresholds and options")

    def drop(self) -> None:
        self._pending = None


def make_transport(process_set: Any = None,
                   timeout: float | None = DEFAULT_TIMEOUT) -> LocalTransport | HorovodTransport:
    """The payload transport of the current process: Horovod's on ``process_set`` (None: every rank) when Horovod
    is initialized and the set has several ranks, else local."""
    hvd = horovod_if_initialized()
    if hvd is None:
        return LocalTransport()
    if process_set is not None and process_set != hvd.global_process_set:
        check_member(hvd, process_set)
        return LocalTransport() if process_set.size() == 1 else HorovodTransport(process_set, timeout)
    return LocalTransport() if hvd.size() == 1 else HorovodTransport(None, timeout)


class Links(NamedTuple):
    """A front end's statistics exchange and payload transport, as factories of the timeout that the core calls at
    its first step (a trainer may build the front end before the process group exists)."""

    exchange: Callable[[float | None], StatisticsExchange]
    transport: Callable[[float | None], PayloadTransport]


def over_process_group(process_group: Any = None) -> Links:
    """The links over a ``torch.distributed`` process group (None: the default one): local where the group has one
    rank."""
    import torch.distributed as dist

    def several() -> bool:
        return dist.get_world_size(process_group) > 1

    return Links(lambda timeout: TorchDistributedExchange(process_group, timeout) if several() else LocalExchange(),
                 lambda timeout: (TorchDistributedTransport(process_group, timeout) if several()
                                  else LocalTransport()))
