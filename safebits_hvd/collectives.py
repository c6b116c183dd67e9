"""Payload collectives: how the packed payloads (:mod:`.wire`) travel between ranks and become the reduced gradient
(docs/DESIGN.md, "Compressed collectives").

* ``"allgather"``: every rank's payload of a tensor (uint8; lengths may differ, since ranks may escalate
  differently) reaches every rank; every rank decodes all of them and sums them **in rank order**, so the reduced
  gradient is bitwise identical everywhere. Per element a rank moves ``b (P - 1)`` bits for ``b``-bit payloads.
* ``"two_phase"`` (scatter-reduce then allgather, as CGX and DeepSpeed's compressed allreduce): each tensor is cut
  into ``P`` segments at bucket boundaries, each segment packed on its own; one alltoall per step sends segment
  ``r`` of every tensor to rank ``r``, which sums the ``P`` decoded payloads of its segment, re-encodes the sum with
  a second error-feedback residual it owns (screened like the first hop, with the same safe fallback), and one
  allgather per step delivers every owner's segment to every rank. About ``2 b (P - 1) / P`` bits per element.
* ``"dense"``: the float32 values through Horovod's allreduce (``2 * 32 (P - 1) / P`` bits per element on a ring);
  kept for comparison, for ``op=hvd.Adasum``, and where it moves fewer bytes.
* ``"auto"`` (default) picks, per step and identically on every rank, from the allocation's modeled bits per
  parameter ``b``: dense in one process or when ``b >= 32``; allgather on 2 ranks (the same bytes as two-phase,
  one quantization); two-phase from 3 ranks on.

Many small tensors must not each pay a collective's latency. The allgather path gathers tensors in fusion groups
(:class:`FusedAllgather`): consecutive tensors, in the order backward produces them, of up to
:data:`FUSION_ELEMENTS` elements together (a larger tensor alone), one allgather per group started as soon as its
last member is sent. Horovod's own fusion did not help here: a rank's per-tensor allgathers reach Horovod's cycle one
by one, each waiting for the Python of the next tensor's send. Alltoalls never fuse, so the two-phase path batches
every tensor of the step into one alltoall and one allgather.
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from . import host, kernels, wire
from .actions import Action
from .exchange import DEFAULT_TIMEOUT, check_member, horovod_if_initialized, torch_distributed_group, wait_bounded
from .rng import stream_key

COLLECTIVES = ("auto", "allgather", "two_phase", "dense")


def choose(collective: str, bits_per_parameter: float, world_size: int) -> str:
    """The collective of a step: ``collective`` unless it is ``"auto"`` (see the module docstring)."""
    if collective != "auto":
        return collective
    if world_size <= 1 or bits_per_parameter >= 32.0:
        return "dense"          # one process: nothing moves; 32 bits: float32 on a ring is as cheap
    return "allgather" if world_size == 2 else "two_phase"


def link_bytes(collective: str, payload_bytes: int, ranks: int) -> int:
    """Bytes one rank's payload costs the link: allgather delivers it to ``ranks - 1`` peers; a ring allreduce of
    dense values sends ``2 (P - 1) / P`` of them; ``two_phase`` counts its two hops itself."""
    if collective == "allgather":
        return payload_bytes * (ranks - 1)
    if collective == "dense":
        return (2 * payload_bytes * (ranks - 1)) // ranks
    raise ValueError(f"link_bytes is not defined for {collective!r}")


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
        lengths = torch.tensor([p.numel() for p in self.payloads], dtype=torch.int64)
        body = torch.cat([p.to(device) for p in self.payloads])
        self.payloads = []
        if expected is None:
            self.lengths = transport.gather_now(lengths.to(device), f"the sizes of {self.names[0]!r}...").numpy()
            longest = int(self.lengths.sum(axis=1).max())
            mine = torch.zeros(longest, dtype=torch.uint8, device=device)
            mine[:body.numel()] = body
        else:
            self.expected = expected
            head = min(body.numel(), expected)
            mine = torch.zeros(8 * count + expected, dtype=torch.uint8, device=device)
            mine[:8 * count] = lengths.view(torch.uint8).to(device)
            mine[8 * count:8 * count + head] = body[:head]
            self._rest = body[head:]
        self.received = [torch.empty_like(mine) for _ in range(transport.size)]
        self.work = transport.dist.all_gather(self.received, mine, group=transport.process_group, async_op=True)

    def complete(self, transport: TorchDistributedTransport, what: str) -> None:
        """Wait for the batch (and move the rests, if any rank has one); afterwards :meth:`result` works."""
        if self.work is None:
            return
        wait_bounded(self.work.is_completed, transport.timeout, what)
        self.work.wait()                            # raises the collective's own error, if any
        self.work = None
        if self.expected is not None:
            count, expected = len(self.names), self.expected
            self.lengths = np.stack([r[:8 * count].cpu().view(torch.int64).numpy() for r in self.received])
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
                wait_bounded(work.is_completed, transport.timeout, what)
                work.wait()
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
    """One alltoall queued by :class:`TorchDistributedTransport` until its next flush."""

    def __init__(self, name: str, buffer: torch.Tensor, splits: list[int]) -> None:
        self.names = [name]
        self.buffer = buffer
        self.splits = splits
        self.launched = False
        self.work: Any = None
        self.received = torch.empty(0, dtype=torch.uint8)
        self.received_splits: list[int] = []

    def launch(self, transport: TorchDistributedTransport, expected: int | None) -> None:
        # all_to_all_single needs the sizes this rank receives: every rank's splits first (small).
        self.launched = True
        device = transport.device
        splits = torch.tensor(self.splits, dtype=torch.int64, device=device)
        matrix = transport.gather_now(splits, f"the splits of {self.names[0]!r}").numpy()
        self.received_splits = [int(v) for v in matrix[:, transport.rank]]
        self.received = torch.empty(sum(self.received_splits), dtype=torch.uint8, device=device)
        self.work = transport.dist.all_to_all_single(self.received, self.buffer.to(device), self.received_splits,
                                                     self.splits, group=transport.process_group, async_op=True)

    def complete(self, transport: TorchDistributedTransport, what: str) -> None:
        if self.work is not None:
            wait_bounded(self.work.is_completed, transport.timeout, what)
            self.work.wait()                        # raises the collective's own error, if any
            self.work = None

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

    def flush(self, expected_bytes: int | None = None) -> None:
        """Launch every queued collective, in the order queued. ``expected_bytes``: what the queued allgathers'
        payloads should total on every rank (the same number on every rank), when exactly one batch is queued."""
        queue, self._queue = self._queue, []
        if expected_bytes is not None and len(queue) != 1:
            raise ValueError(f"flush(expected_bytes) needs exactly one queued batch of allgathers, not {len(queue)}")
        for operation in queue:
            operation.launch(self, expected_bytes)

    def wait(self, handle: Any) -> Any:
        operation, position = handle
        if not operation.launched:
            self.flush()
        operation.complete(self, f"SafeBits' payload collective {operation.names[0]!r} (torch.distributed)")
        return operation.result(position)

    def gather_now(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's ``values`` (same shape everywhere), stacked in rank order on the CPU (a bounded wait)."""
        pieces = [torch.empty_like(values) for _ in range(self.size)]
        work = self.dist.all_gather(pieces, values, group=self.process_group, async_op=True)
        wait_bounded(work.is_completed, self.timeout, f"SafeBits' exchange of {what} (torch.distributed)")
        work.wait()
        return torch.stack(pieces).cpu()


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


# ---------------------------------------------------------------------------------------------- fused allgather
FUSION_ELEMENTS = 1 << 16
"""Elements per fusion group of the allgather path (about 32 KB of payload at 4 bits): a group of small tensors pays
one collective's latency, and groups stay small enough that most of them start while backward still runs (with
1,000 small tensors, 2^16 gave the shortest step of 2^12, 2^14, 2^16 and 2^18: docs/RESULTS.md 3.4)."""


def fusion_groups(numels: np.ndarray, max_elements: int = FUSION_ELEMENTS) -> list[list[int]]:
    """Tensor indices in groups of consecutive tensors, last registered first (backward's order), each of at most
    ``max_elements`` elements unless one tensor alone has more; every member's index ascending within a group."""
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in reversed(range(len(numels))):
        n = int(numels[index])
        if current and size + n > max_elements:
            groups.append(sorted(current))
            current, size = [], 0
        current.append(index)
        size += n
    if current:
        groups.append(sorted(current))
    return groups


class FusedAllgather:
    """The allgather path of one core, one collective per fusion group (:func:`fusion_groups`).

    The core registers each member's gradient as it arrives (:meth:`register`); when the group is complete it sends
    the whole group in one batched pass (``SafeBitsCore._send_group``) and hands the payloads, back to back in index
    order, to :meth:`start`. On the receiving side the first member asked for decodes the whole group
    (:func:`.kernels.decode_group`): member ``k`` summed over the ``P`` gathered parts in rank order, so the sum is
    bitwise the same everywhere. The gathered headers are checked in one comparison against those of the allocated
    actions, which every rank knows (:meth:`_split`); only when some rank sent another action (it escalated) are
    they read one by one.
    """

    def __init__(self, names: list[str], numels: np.ndarray, name: str,
                 max_elements: int = FUSION_ELEMENTS) -> None:
        self.names = names
        self.name = name
        self.groups = fusion_groups(numels, max_elements)
        self.group_of = np.empty(len(numels), dtype=np.int64)
        self.member_of = np.empty(len(numels), dtype=np.int64)
        for group, members in enumerate(self.groups):
            self.group_of[members] = group
            self.member_of[members] = np.arange(len(members))
        self._members = [np.array(members, dtype=np.int64) for members in self.groups]
        self.step = -1
        self._clear()

    def _clear(self) -> None:
        # group -> member index -> (flat gradient, the tensor that receives q or None), until the group is sent
        self._registered: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._handles: dict[int, Any] = {}                          # group -> allgather in flight
        self._sent: dict[int, tuple[torch.Tensor, np.ndarray]] = {} # group -> this rank's buffer and offsets
        self._expected: dict[int, np.ndarray] = {}                  # group -> the members' allocated actions
        # Member index -> the tensor the send pass wrote this rank's own q into: the sum starts from it instead of
        # decoding this rank's payload again (see reduced_sum).
        self._own: dict[int, torch.Tensor] = {}
        # group -> (divisor, member index -> reduced sum, the gathered payloads [member][rank], their actions)
        self._decoded: dict[int, tuple[float, dict[int, torch.Tensor], list[list[torch.Tensor]], np.ndarray]] = {}

    def begin(self, step: int, transport: PayloadTransport) -> None:
        """A new step: collectives of the last one that nobody waited for are completed and dropped."""
        for handle in self._handles.values():
            transport.wait(handle)
        self.step = step
        self._clear()

    def abort(self) -> None:
        """Drop the step in flight without waiting (its collectives failed)."""
        self._clear()

    def register(self, index: int, gradient: torch.Tensor, own: torch.Tensor | None) -> int | None:
        """Tensor ``index``'s flat gradient (``own``: where its ``q`` is to be written, or None); returns its group
        when this completes it (the caller sends the group then), else None."""
        group = int(self.group_of[index])
        members = self._registered.setdefault(group, {})
        members[index] = (gradient, own)
        return group if len(members) == len(self.groups[group]) else None

    def take(self, group: int) -> tuple[list[int], dict[int, tuple[torch.Tensor, torch.Tensor | None]]]:
        """The group's members and what was registered of them (removed: the group is being sent)."""
        return self.groups[group], self._registered.pop(group, {})

    def incomplete_groups(self) -> list[int]:
        """Groups some member of which was registered, not yet sent."""
        return list(self._registered)

    def has_unsent(self, index: int) -> bool:
        """Whether tensor ``index``'s group has registered members not yet sent."""
        return int(self.group_of[index]) in self._registered

    def start(self, transport: PayloadTransport, group: int, buffer: torch.Tensor, offsets: np.ndarray,
              expected: np.ndarray, owns: dict[int, torch.Tensor | None]) -> None:
        """Start the group's allgather of ``buffer`` (the members' payloads back to back, member ``k`` at
        ``offsets[k]:offsets[k + 1]``); ``expected``: the members' allocated actions (the same on every rank)."""
        self._sent[group] = (buffer, offsets)
        self._expected[group] = np.asarray(expected, dtype=np.int64)
        self._own.update((index, own) for index, own in owns.items() if own is not None)
        # Named by the group's first tensor: a group of one tensor is named by that tensor (disjoint groups: unique).
        first = self.groups[group][0]
        self._handles[group] = transport.start_allgather(f"{self.name}.payload.{first}", buffer)

    def payload(self, index: int) -> torch.Tensor:
        """This rank's payload of tensor ``index`` (its group must have been sent)."""
        group = int(self.group_of[index])
        if group not in self._sent:
            raise RuntimeError(f"the payload of {self.names[index]!r} is not sent yet: its group is sent when its "
                               f"last member is compressed, or when the step closes")
        buffer, offsets = self._sent[group]
        member = int(self.member_of[index])
        return buffer[int(offsets[member]):int(offsets[member + 1])]

    def _split(self, gathered: torch.Tensor, group: int, ranks: int,
               tables: kernels.GroupTables) -> tuple[list[list[torch.Tensor]], np.ndarray]:
        """The gathered payloads ``[member][rank]`` and their menu actions. Fast path: if every rank sent the
        allocated actions, the buffer has exactly their length and their headers at the offsets they imply; one
        comparison of all those headers proves it (by induction over payloads: each header fixes where the next
        payload starts). Else every payload is parsed in turn (a rank escalated, or the buffer is corrupt)."""
        members, expected = self._members[group], self._expected[group]
        m = len(members)
        sizes = tables.payload_bytes[members, expected]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        part = int(sizes.sum())
        if gathered.numel() == ranks * part:
            positions = ((np.arange(ranks, dtype=np.int64)[:, None, None] * part + starts[None, :, None])
                         + np.arange(wire.HEADER_BYTES)[None, None, :]).reshape(-1)
            heads = gathered[torch.from_numpy(positions).to(gathered.device)].view(ranks, m, wire.HEADER_BYTES)
            want = torch.from_numpy(tables.headers[members, expected]).to(gathered.device)
            host.count()
            if bool((heads == want).all()):
                payloads = [[gathered[r * part + int(starts[k]):r * part + int(starts[k]) + int(sizes[k])]
                             for r in range(ranks)] for k in range(m)]
                return payloads, np.repeat(expected[:, None], ranks, axis=1)
        # Each payload's header must be one of its tensor's menu actions (which fixes its length); read in turn.
        data = host.to_host(gathered)
        payloads = [[gathered] * ranks for _ in range(m)]
        actions = np.empty((m, ranks), dtype=np.int64)
        offset = 0
        for r in range(ranks):
            for k in range(m):
                member = int(members[k])
                if data.size - offset < wire.HEADER_BYTES:
                    raise wire.WireFormatError(f"{self.names[member]} (rank {r}): truncated payload: "
                                               f"{data.size - offset} bytes left, a header alone is "
                                               f"{wire.HEADER_BYTES}")
                action = tables.action_of_header(member, data[offset:offset + wire.HEADER_BYTES].tobytes())
                if action < 0:
                    wire.parse_header(gathered[offset:offset + wire.HEADER_BYTES], f"{self.names[member]} (rank {r})",
                                      check_length=False)     # names what is wrong, if the header itself is
                    raise wire.WireFormatError(f"{self.names[member]} (rank {r}): the payload is not one of this "
                                               f"tensor's menu actions")
                size = int(tables.payload_bytes[member, action])
                if data.size - offset < size:
                    raise wire.WireFormatError(f"{self.names[member]} (rank {r}): truncated payload: "
                                               f"{data.size - offset} bytes left, expected {size}")
                payloads[k][r] = gathered[offset:offset + size]
                actions[k, r] = action
                offset += size
        if offset != data.size:
            raise wire.WireFormatError(f"{self.name} group {group} step {self.step}: {data.size - offset} bytes "
                                       f"after {ranks * m} payloads")
        return payloads, actions

    def reduced_sum(self, transport: PayloadTransport, index: int, step: int, out: torch.Tensor | None,
                    divisor: float, tables: kernels.GroupTables) -> torch.Tensor:
        """The sum of every rank's payload of tensor ``index`` at ``step``, in rank order, divided by ``divisor``,
        in ``out`` if given (written over), else in a new tensor. The first member of a group asked for decodes the
        whole group, into each member's ``own`` tensor when it has one.

        When a member's ``own`` tensor holds this rank's values, this rank's payload is not decoded again on ranks
        0 and 1: each adds the other ranks' values to its own in rank order (float addition is commutative, so
        rank 1's ``(q1 + q0) + q2 ...`` is bitwise ``(q0 + q1) + q2 ...``); the other ranks decode every payload."""
        if step != self.step:
            raise RuntimeError(f"the allgather of step {step} is no longer held (a later step began)")
        group = int(self.group_of[index])
        if group not in self._decoded:
            if group not in self._handles:
                raise RuntimeError(f"the group of {self.names[index]!r} was not sent at step {step}")
            gathered = transport.wait(self._handles.pop(group))
            ranks, me = transport.size, transport.rank
            payloads, actions = self._split(gathered, group, ranks, tables)
            members = self._members[group]
            outs, own = [], np.full(len(members), -1, dtype=np.int64)
            for k, member in enumerate(members.tolist()):
                target = self._own.get(member)
                if target is not None and me <= 1:
                    own[k] = me
                outs.append(target if target is not None else
                            torch.empty(int(tables.numels[member]), dtype=torch.float32, device=gathered.device))
            names = [self.names[i] for i in members.tolist()]
            kernels.decode_group(payloads, actions, outs, own, tables, members, names, divisor)
            self._decoded[group] = (divisor, dict(zip(members.tolist(), outs, strict=True)), payloads, actions)
        decoded_divisor, sums, payloads, actions = self._decoded[group]
        total = sums[index]
        if divisor != decoded_divisor:       # another op than the group's first member's: decode this one again
            member = int(self.member_of[index])
            total = torch.empty_like(total)
            kernels.decode_group([payloads[member]], actions[member:member + 1], [total], np.array([-1]), tables,
                                 self._members[group][member:member + 1], [self.names[index]], divisor)
        if out is None:
            return total
        return total if out is total else out.copy_(total)


# ---------------------------------------------------------------------------------------------- encoding
def segment_bounds(n: int, bucket_size: int, ranks: int) -> list[tuple[int, int]]:
    """Two-phase: ``ranks`` element ranges of a tensor of ``n`` elements, cut at bucket boundaries (some may be
    empty), so every segment quantizes exactly as the same buckets of the whole tensor would."""
    buckets = -(-n // bucket_size)
    cuts = [min(n, (r * buckets // ranks) * bucket_size) for r in range(ranks)] + [n]
    return list(itertools.pairwise(cuts))


def segment_key(key: int, segment: int) -> int:
    """The RNG stream of one segment: segments restart element numbering at 0, so each needs its own draws."""
    return stream_key(key, segment + 1, 0)


def encode(collective: str, g: torch.Tensor | None, e: torch.Tensor, action: Action, key: int,
           segments: list[tuple[int, int]], out: torch.Tensor) -> tuple[Any, np.ndarray]:
    """One send pass for ``collective``: ``v = g + e``, ``q = Q(v)``, ``e <- v - q``; returns what travels (dense:
    ``out`` filled with ``q``; allgather: a payload, and ``q`` in ``out`` unless it is empty; two-phase: one payload
    per segment) and the float64 statistics of all of ``q`` (the segments' sums added in segment order)."""
    if collective == "dense":
        return out, kernels.quantize_ef(g, e, out, action, key).cpu().numpy()
    if collective == "allgather":      # out, when it has the tensor's size, receives q (FusedAllgather's "own")
        payload, stats = kernels.quantize_pack_ef(g, e, action, key, sent=out if out.numel() else None)
        return payload, stats.cpu().numpy()
    payloads, total = [], np.zeros(4)
    for segment, (start, stop) in enumerate(segments):
        payload, stats = kernels.quantize_pack_ef(None if g is None else g[start:stop], e[start:stop], action,
                                                  segment_key(key, segment))
        payloads.append(payload)
        total += stats.cpu().numpy()
    return payloads, total


def restore(collective: str, sent: Any, e: torch.Tensor, segments: list[tuple[int, int]], name: str) -> None:
    """Undo :func:`encode`'s residual update: ``e <- e + q`` (``e`` then holds ``v`` to float rounding)."""
    if collective == "dense":
        e.add_(sent)
    elif collective == "allgather":
        kernels.decode_add(sent, e, name=name)
    else:
        for payload, (start, stop) in zip(sent, segments, strict=True):
            kernels.decode_add(payload, e[start:stop], name=name)


def decode_sequence(buffer: torch.Tensor, out: torch.Tensor, name: str) -> torch.Tensor:
    """Decode payloads lying back to back in ``buffer`` into consecutive ranges of ``out`` (added), e.g. what one
    rank sent of a tensor on any packed path: one payload, or its segments in order. Returns ``out``."""
    offset = position = 0
    while offset < buffer.numel():
        length = wire.payload_length(buffer, offset, name=name)
        count = wire.parse_header(buffer[offset:offset + length], name).n
        if position + count > out.numel():
            raise wire.WireFormatError(f"{name}: payloads hold more than the {out.numel()} elements of the tensor")
        kernels.decode_add(buffer[offset:offset + length], out[position:position + count], name=name)
        offset += length
        position += count
    if position != out.numel():
        raise wire.WireFormatError(f"{name}: payloads hold {position} elements, the tensor {out.numel()}")
    return out


def split_payloads(buffer: torch.Tensor, count: int, name: str) -> list[torch.Tensor]:
    """The ``count`` payloads lying back to back in ``buffer`` (which must hold exactly them)."""
    views, offset = [], 0
    for k in range(count):
        length = wire.payload_length(buffer, offset, name=f"{name} (payload {k})")
        views.append(buffer[offset:offset + length])
        offset += length
    if offset != buffer.numel():
        raise wire.WireFormatError(f"{name}: {buffer.numel() - offset} bytes after {count} payloads")
    return views
