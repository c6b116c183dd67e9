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
(:class:`AllgatherPath`): consecutive tensors, in the order backward produces them, of up to ``fusion_bytes`` of
float32 gradient together (a larger tensor alone; by device, :func:`fusion_bytes_for`), one allgather per group
started as soon as its last member is sent. Horovod's own fusion did not help here: a rank's per-tensor allgathers
reach Horovod's cycle one by one, each waiting for the Python of the next tensor's send. Alltoalls never fuse, so
the two-phase path batches every tensor of the step into one alltoall and one allgather.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import numpy as np
import torch

from ..codec import host, kernels, wire
from ..codec.actions import Action, Menu
from ..codec.rng import stream_key
from . import transports
from .transports import LocalTransport, PayloadTransport

COLLECTIVES = ("auto", "allgather", "two_phase", "reduce_scatter", "dense")


def choose(collective: str, bits_per_parameter: float, world_size: int) -> str:
    """The collective of a step: ``collective`` unless it is ``"auto"`` (see the module docstring)."""
    if collective == "reduce_scatter":      # a sharded front end's: its 32 bits pass through its own reduce-scatter
        return "dense" if world_size <= 1 or bits_per_parameter >= 32.0 else collective
    if collective != "auto":
        return collective
    if world_size <= 1 or bits_per_parameter >= 32.0:
        return "dense"          # one process: nothing moves; 32 bits: float32 on a ring is as cheap
    return "allgather" if world_size == 2 else "two_phase"


# ---------------------------------------------------------------------------------------------- the paths
class Grouping(NamedTuple):
    """How a front end groups its step's tensors into the collectives it starts (:meth:`CollectivePath.chunks`),
    which every rank must do alike: compared before the step's first payload moves
    (:class:`~.transports.AllocationCheck`)."""

    word: int                   # a number every rank must agree on (DDP's chunk bytes, the node size), 0 if none
    described: str              # the word, for the error (``"chunk_bytes 262144"``)
    built_as: str               # what the user built, for the error (``"SafeBitsState"``)


class CollectivePath:
    """One way a step's tensors travel, a strategy the core picks per step (:func:`choose`; the same on every rank).

    Every path says what the send pass makes of one tensor (:meth:`encode`: ``v = g + e``, ``q = Q(v)``,
    ``e <- v - q``), how an escalation undoes it (:meth:`restore`: ``e <- e + q``), what a tensor never sent this
    step sends instead (:meth:`zeros`), what a sent tensor costs the link (:meth:`link_bytes`) and, on the packed
    paths, the reduced sums (:meth:`reduced_sums`). The core never asks which path it holds, only what it can do:
    ``packed`` (uint8 payloads through SafeBits' collectives, else float32 values through the front end's own
    allreduce), ``batched`` (tensors :meth:`register`-ed, then sent by the path in batches: a fusion group at a
    time, or the whole step when it closes) and ``sends_together`` (a front end may hand it several tensors at
    once, :meth:`send_together`: one batched pass, cut by :meth:`chunks`, each started by :meth:`launch`).
    """

    name = ""
    packed = True
    batched = False
    sends_together = False

    def __init__(self, menu: Menu, cheapest: np.ndarray) -> None:
        self.menu = menu
        self.cheapest = cheapest          # per tensor: its cheapest action, whose payload of zeros a skip sends
        self.transport: PayloadTransport = LocalTransport()
        self.wire_bytes = 0               # bytes this rank's payloads cost the link in the step (the record's)

    def begin(self, step: int, transport: PayloadTransport) -> None:
        """A new step on ``transport``."""
        self.transport = transport
        self.wire_bytes = 0

    def add(self, index: int, sent: Any) -> Any:
        """Tensor ``index`` was sent (one tensor at a time: the dense and two-phase paths): count its bytes; returns
        what the front end hands on (:attr:`.core.Handle.wire`)."""
        self.wire_bytes += self.link_bytes(sent)
        return sent

    def abort(self) -> None:
        """Drop the step in flight (one of its collectives failed)."""

    def join_world(self, transport: PayloadTransport, first_hop: Any) -> None:
        """The ranks are known (``transport``: the first step, or the first after :meth:`leave_world`): a path cut
        for them (the two-phase segments) prepares; ``first_hop``: the core's residuals (None without error
        feedback)."""

    def leave_world(self) -> None:
        """The world changed (elastic training): forget what was cut for the old one."""

    def add_unchanged(self, numels: np.ndarray) -> None:
        """Tensors of these sizes go on as they are (a pass-through step): only where the front end reduces them."""
        raise RuntimeError(f"the {self.name} path packs every tensor: none goes on unchanged")

    # -- batched paths: the send pass runs over many tensors at once
    def register(self, index: int, gradient: torch.Tensor, into: torch.Tensor | None) -> int | None:
        """Tensor ``index``'s flat gradient, to be sent with others; returns a group to send now, else None."""
        raise NotImplementedError

    def start_group(self, group: int) -> None:
        """Send a group :meth:`register` returned."""
        raise NotImplementedError

    def flush(self) -> None:
        """Send everything registered and not sent yet (the step closes)."""

    def send_together(self, members: list[int], gradients: list[torch.Tensor],
                      intos: list[torch.Tensor | None]) -> None:
        """Send these tensors (none sent yet this step) in one batched pass, each one's ``q`` into its ``intos``
        tensor (on the dense path every one must be given: the values the front end all-reduces)."""
        raise NotImplementedError

    def chunks(self, indices: list[int], chunk_bytes: int) -> list[tuple[int, int]]:
        """How a front end cuts its tensors (a DDP bucket) into the groups it sends together (:meth:`send_together`),
        as ``(start, stop)`` positions: here all of them at once."""
        return [(0, len(indices))] if indices else []

    def launch(self, members: list[int] | np.ndarray) -> None:
        """Start the collective of a group a front end sent together (the transport may hold it back): here none."""

    def start_check(self, grouping: Grouping | None, digest: str) -> None:
        """A step begins whose tensors a front end groups itself (``grouping``; None: the path groups them): where
        its transport needs it, start comparing every rank's allocation (``digest``) and grouping."""

    def finish_check(self) -> None:
        """Finish that comparison, if one is under way (before the step's first payload moves, or at its close)."""

    def payload(self, index: int, step: int) -> torch.Tensor:
        """This rank's packed payload(s) of tensor ``index`` at ``step``, back to back, once sent."""
        raise NotImplementedError

    def encode(self, index: int, g: torch.Tensor | None, e: torch.Tensor, action: Action, key: int,
               into: torch.Tensor | None) -> tuple[Any, np.ndarray]:
        """What travels of tensor ``index`` at ``action``, and the float64 statistics of all of ``q``; ``into``, if
        given, receives ``q`` (the dense path's values, the allgather path's own part of the sum)."""
        raise NotImplementedError

    def restore(self, index: int, sent: Any, e: torch.Tensor, name: str, action: int | None = None) -> None:
        """Undo :meth:`encode`'s residual update: ``e <- e + q`` (``e`` then holds ``v`` to float rounding);
        ``action``: the menu action ``sent`` was made at, when known (its header is then not read back)."""
        raise NotImplementedError

    def zeros(self, index: int, n: int, device: torch.device) -> Any:
        """What a tensor sends when it sends nothing: zeros (on a packed path, its cheapest action's payload of
        zeros, so every rank's layout stays the same)."""
        raise NotImplementedError

    def link_bytes(self, sent: Any) -> int:
        """Bytes this rank's ``sent`` costs the link."""
        raise NotImplementedError

    def close(self, step: int, allocation: np.ndarray, seed: int) -> None:
        """Every tensor of the step has been sent (the two-phase path starts its one alltoall here)."""

    def reduced_sums(self, indices: list[int], step: int, outs: list[torch.Tensor | None],
                     divisor: float) -> list[torch.Tensor]:
        """The sum over ranks of what every rank sent of each tensor ``indices[k]`` at ``step``, decoded in rank order
        (bitwise the same on every rank), divided by ``divisor``, into ``outs[k]`` if given (written over)."""
        raise RuntimeError(f"the {self.name} path has no reduced sum of its own: the front end's allreduce makes it")

    def expect_at_close(self, value: torch.Tensor, bits: int, what: str) -> None:
        """Raise ``ValueError(what)`` unless the float32 scalar ``value`` has the float32 bits ``bits`` (a signed
        int32): now, or, on a path that checks what it received once per step, then."""
        if int(host.to_host(value.reshape(1).view(torch.int32))[0]) != bits:
            raise ValueError(what)


class DensePath(CollectivePath):
    """The dequantized float32 values through the front end's allreduce (Horovod's, or DDP's bucket all_reduce):
    ``2 (P - 1) / P`` of them on a ring. ``bytes_per_element``: what the front end puts on the wire (4: float32);
    ``hops``: 2 for a ring allreduce, 1 for a sharded front end's reduce-scatter (its first hop)."""

    name = "dense"
    packed = False
    sends_together = True

    def __init__(self, menu: Menu, cheapest: np.ndarray, sender: Any, bytes_per_element: int = 4,
                 hops: int = 2) -> None:
        super().__init__(menu, cheapest)
        self.sender = sender              # the core's sending.Sender
        self.bytes_per_element, self.hops = bytes_per_element, hops

    def send_together(self, members: list[int], gradients: list[torch.Tensor],
                      intos: list[torch.Tensor | None]) -> None:
        """The DDP hook's bucket: every member's values into its ``intos`` tensor (the bucket's buffer, which DDP
        all-reduces), in one batched pass (:meth:`.sending.Sender.send_values`); a pass-through step passes each on."""
        sender, outs = self.sender, [into for into in intos if into is not None]
        if len(outs) != len(intos):
            raise ValueError("the dense path's send_together needs a tensor for every member's values")
        if sender.pass_through_step or not sender.error_feedback:
            sent = [sender.send(index, g, into) for index, g, into in zip(members, gradients, outs, strict=True)]
        else:
            sent = sender.send_values(np.asarray(members, dtype=np.int64), gradients, outs)
        for index, values, into in zip(members, sent, outs, strict=True):
            if values is not into:
                into.copy_(values)
            self.add(index, into)

    def add_unchanged(self, numels: np.ndarray) -> None:
        """Tensors of these sizes go on as they are (a pass-through step's bucket): count their bytes at once, as
        :meth:`add` would one by one."""
        self.wire_bytes += int(np.sum(self._ring_bytes(numels)))

    def encode(self, index: int, g: torch.Tensor | None, e: torch.Tensor, action: Action, key: int,
               into: torch.Tensor | None) -> tuple[Any, np.ndarray]:
        out = into if into is not None else torch.empty_like(e)
        return out, host.to_host(kernels.quantize_ef(g, e, out, action, key))

    def restore(self, index: int, sent: Any, e: torch.Tensor, name: str, action: int | None = None) -> None:
        e.add_(sent)

    def zeros(self, index: int, n: int, device: torch.device) -> Any:
        return torch.zeros(n, dtype=torch.float32, device=device)

    def link_bytes(self, sent: Any) -> int:
        return self._ring_bytes(sent.numel())

    def _ring_bytes(self, numel: Any) -> Any:
        """What a ring allreduce (or its reduce-scatter) of ``numel`` values (an int, or an array of them) costs one
        rank on the link."""
        ranks = self.transport.size
        return (self.hops * numel * self.bytes_per_element * (ranks - 1)) // ranks


# ---------------------------------------------------------------------------------------------- fused allgather
FUSION_ELEMENTS = 1 << 16
"""The fewest elements per fusion group of the allgather path on the CPU (about 32 KB of payload at 4 bits): a group
of small tensors pays one collective's latency, and groups stay small enough that most of them start while backward
still runs (with 1,000 small tensors, 2^16 gave the shortest step of 2^12, 2^14, 2^16 and 2^18: docs/RESULTS.md
5.3)."""

FUSION_GROUPS = 16
"""On the CPU a larger model is cut into about this many groups (up to :data:`FUSION_MAX_ELEMENTS` each): each group
costs its batched pass's fixed work and a collective, and sixteen still start while backward runs
(docs/RESULTS.md 3.3)."""

FUSION_MAX_ELEMENTS = 1 << 20
"""The most elements per fusion group the CPU default gives (4 MiB of float32 gradient)."""

DEVICE_FUSION_BYTES = 64 << 20
"""Float32 gradient bytes per fusion group on a GPU: a group's send is a fixed handful of launches and one read back
whatever its member count, so groups are large (their staging memory bounds them); ResNet-18's gradients are one
group, GPT-2 small's seven (docs/RESULTS.md 5.5)."""


def fusion_bytes_for(device: torch.device, elements: int = 0) -> int:
    """The default float32 gradient bytes per fusion group of ``elements`` gradient elements on ``device``: on a GPU
    :data:`DEVICE_FUSION_BYTES`; on the CPU a :data:`FUSION_GROUPS`-th of them, within :data:`FUSION_ELEMENTS` and
    :data:`FUSION_MAX_ELEMENTS`."""
    if device.type == "cuda":
        return DEVICE_FUSION_BYTES
    return 4 * min(max(elements // FUSION_GROUPS, FUSION_ELEMENTS), FUSION_MAX_ELEMENTS)


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


class PackedCodec:
    """One packed payload per tensor: the pass (:func:`encode_packed`) and its undoing (``e <- e + q``); the
    allgather path's (an escalation restores through it: :meth:`.sending.Sender.send_members`)."""

    menu: Menu

    def encode(self, index: int, g: torch.Tensor | None, e: torch.Tensor, action: Action, key: int,
               into: torch.Tensor | None) -> tuple[Any, np.ndarray]:
        return encode_packed(g, e, action, key, into)

    def restore(self, index: int, sent: Any, e: torch.Tensor, name: str, action: int | None = None) -> None:
        header = None if action is None else wire.header_of(self.menu[action], e.numel())
        kernels.decode_add(sent, e, name=name, header=header)


class AllgatherPath(PackedCodec, CollectivePath):
    """Every rank's packed payloads to every rank, one allgather per fusion group (:func:`fusion_groups`).

    The core registers each member's gradient as it arrives (:meth:`register`); when the group is complete it sends
    the whole group in one batched pass (:meth:`.sending.Sender.send_registered`) and hands the payloads, back to back
    in member order, to :meth:`start`. A front end that batches itself (the DDP hook, per chunk of a bucket) makes
    its own groups for the step (:meth:`group_together`). On the receiving side the first member asked for decodes
    the whole group (:func:`.kernels.receive_group`): member ``k`` summed over the ``P`` gathered parts in rank
    order, so the sum is bitwise the same everywhere. The gathered headers are checked in one comparison against
    those of the allocated actions, which every rank knows; only when some rank sent another action (it
    escalated) are they read one by one. On a GPU this happens on the device, and what it found wrong is read
    back once for the whole step, when its last group has been decoded (:meth:`_check_received`).
    """

    name = "allgather"
    batched = True
    sends_together = True

    def __init__(self, names: list[str], numels: np.ndarray, tables: kernels.GroupTables, cheapest: np.ndarray,
                 sender: Any, collective_name: str, fusion_bytes: int | None = None) -> None:
        super().__init__(tables.menu, cheapest)
        self.names = names
        self.numels = numels
        self.tables = tables
        self.sender = sender              # the core's sending.Sender: sends a whole group in one batched pass
        self.collective_name = collective_name
        self.fusion_bytes = fusion_bytes  # None: by the device of the first gradient registered
        self.step = -1
        self._check = transports.AllocationCheck()      # start_check: a front end's grouping, compared
        self._fusion: list[list[int]] = []
        self._regroup()                   # no groups until fusion_bytes is known
        if fusion_bytes is not None:
            self._group_by(fusion_bytes)
        self._clear()

    def _group_by(self, fusion_bytes: int) -> None:
        self.fusion_bytes = fusion_bytes
        self._fusion = fusion_groups(self.numels, fusion_bytes // 4)
        self._regroup()

    def _regroup(self) -> None:
        """The fusion groups (a front end's own groups of the last step are dropped)."""
        self.groups = [list(members) for members in self._fusion]
        self.group_of = np.full(len(self.names), -1, dtype=np.int64)
        self.member_of = np.full(len(self.names), -1, dtype=np.int64)
        self._members: list[np.ndarray] = []
        for members in self.groups:
            self._index_group(members)
        self._fusion_group_of, self._fusion_member_of = self.group_of.copy(), self.member_of.copy()
        self._made = len(self._fusion)        # where the next group a front end makes this step goes

    def _index_group(self, members: list[int]) -> int:
        group = len(self._members)
        self.group_of[members] = group
        self.member_of[members] = np.arange(len(members))
        self._members.append(np.array(members, dtype=np.int64))
        return group

    def _drop_groups_from(self, first: int) -> None:
        """Drop the front end's groups ``first`` and after (made last step, not made alike this step): their members
        not regrouped since are back in their fusion groups."""
        for group in range(first, len(self._members)):
            members = self._members[group]
            members = members[self.group_of[members] == group]
            self.group_of[members] = self._fusion_group_of[members]
            self.member_of[members] = self._fusion_member_of[members]
        del self.groups[first:], self._members[first:]

    def _clear(self) -> None:
        # group -> member index -> (flat gradient, the tensor that receives q or None), until the group is sent
        self._registered: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._handles: dict[int, Any] = {}                          # group -> allgather in flight
        self._buffers: dict[int, tuple[torch.Tensor, np.ndarray]] = {} # group -> this rank's buffer and offsets
        self._expected: dict[int, np.ndarray] = {}                  # group -> the members' allocated actions
        # Member index -> the tensor the send pass wrote this rank's own q into: the sum starts from it instead of
        # decoding this rank's payload again (see reduced_sums).
        self._intos: dict[int, torch.Tensor] = {}
        # group -> (divisor, member index -> reduced sum, the gathered buffer)
        self._decoded: dict[int, tuple[float, dict[int, torch.Tensor], torch.Tensor]] = {}
        self._verdicts = ReceiveVerdicts()        # what the device decoded, checked at the step's end
        self._check.drop()

    def begin(self, step: int, transport: PayloadTransport) -> None:
        """A new step: collectives of the last one that nobody waited for are completed and dropped; what it decoded
        on the device is checked now if its last group never was (a front end left some group unasked)."""
        for handle in self._handles.values():
            self.transport.wait(handle)
        self._handles.clear()
        self._check_received()
        super().begin(step, transport)
        self.step = step
        # A front end's groups of the last step stay indexed: one that groups alike again reuses them.
        self._made = len(self._fusion)
        self._clear()

    def abort(self) -> None:
        self._clear()

    # -- the send side (encode and restore: PackedCodec's)
    def zeros(self, index: int, n: int, device: torch.device) -> Any:
        return packed_zeros(self.menu[int(self.cheapest[index])], n, device)

    def link_bytes(self, sent: Any) -> int:
        return sent.numel() * (self.transport.size - 1)

    def group_together(self, members: list[int]) -> int:
        """Make ``members`` (none registered yet this step) one group for the rest of the step, sent when the last
        of them is registered; every rank must make the same groups (the DDP hook's chunks of its buckets). The
        groups a front end makes in the same order as last step are reused as they are."""
        if self.fusion_bytes is None:
            self._group_by(0)           # a front end that groups itself: every other tensor alone
        if any(int(self.group_of[i]) in self._registered for i in members):
            raise RuntimeError("group_together: a member was already registered this step")
        group = self._made
        if group >= len(self.groups) or self.groups[group] != members:
            self._drop_groups_from(group)
            self.groups.append(list(members))
            self._index_group(list(members))
        self._made += 1
        return group

    def register(self, index: int, gradient: torch.Tensor, into: torch.Tensor | None) -> int | None:
        """Tensor ``index``'s flat gradient (``into``: where its ``q`` is to be written, or None); returns its group
        when this completes it (the caller sends the group then), else None."""
        if self.fusion_bytes is None:
            self._group_by(fusion_bytes_for(gradient.device, int(self.numels.sum())))
        group = int(self.group_of[index])
        members = self._registered.setdefault(group, {})
        members[index] = (gradient, into)
        return group if len(members) == len(self.groups[group]) else None

    def allocated_payload_bytes(self, indices: list[int] | np.ndarray) -> np.ndarray:
        """Bytes of each listed tensor's payload at the allocated action of the step in progress (or the last one
        begun): identical on every rank; a rank that escalates a tensor sends more."""
        rows = np.asarray(indices, dtype=np.int64)
        return self.tables.payload_bytes[rows, self.sender.allocation.choice[rows]]

    def chunks(self, indices: list[int], chunk_bytes: int) -> list[tuple[int, int]]:
        """Chunks of about ``chunk_bytes`` of payloads at the allocated actions (:func:`chunk_bounds`)."""
        return chunk_bounds(self.allocated_payload_bytes(indices).tolist(), chunk_bytes)

    def launch(self, members: list[int] | np.ndarray) -> None:
        """Start the allgather of a group sent together, once the step's check is done, at the bytes its allocated
        actions take (the same on every rank: no size exchange; only an escalated rest waits for the close)."""
        self._check.finish()
        transports.launch(self.transport, int(self.allocated_payload_bytes(members).sum()))

    def start_check(self, grouping: Grouping | None, digest: str) -> None:
        every = np.arange(len(self.names))
        self._check.start(self.transport, self.step, grouping, digest, len(self.names),
                          int(self.allocated_payload_bytes(every).sum()) if grouping is not None else 0)

    def finish_check(self) -> None:
        self._check.finish()

    def send_together(self, members: list[int], gradients: list[torch.Tensor],
                      intos: list[torch.Tensor | None]) -> None:
        """Make ``members`` one group (:meth:`group_together`), register them all and send the group: a front end's
        whole group at once (the DDP hook's chunk of a bucket)."""
        group = self.group_together(members)
        self._registered[group] = dict(zip(self.groups[group], zip(gradients, intos, strict=True), strict=True))
        self.start_group(group)

    def start_group(self, group: int) -> None:
        """Send the group in one batched pass (:meth:`.sending.Sender.send_registered`) and start its allgather."""
        members, registered = self.groups[group], self._registered.pop(group, {})
        buffer, offsets, member_bytes = self.sender.send_registered(members, registered)
        intos = {index: into for index, (_, into) in registered.items()}
        self.start(group, buffer, offsets, self.sender.allocation.choice[members], intos, member_bytes)

    def flush(self) -> None:
        """Send every group some member of which was registered but not all (zeros for the missing ones): the step
        closes, or a payload or reduced sum is wanted before the group is complete (the same on every rank)."""
        for group in list(self._registered):
            self.start_group(group)

    def start(self, group: int, buffer: torch.Tensor, offsets: np.ndarray, expected: np.ndarray,
              intos: dict[int, torch.Tensor | None], member_bytes: int) -> None:
        """Start the group's allgather of ``buffer`` (the members' payloads back to back, member ``k`` at
        ``offsets[k]:offsets[k + 1]``); ``expected``: the members' allocated actions (the same on every rank);
        ``member_bytes``: the bytes of the members' payloads that were sent (not of the zeros standing in for the
        missing ones), which the link carries to every other rank."""
        self._buffers[group] = (buffer, offsets)
        self._expected[group] = np.asarray(expected, dtype=np.int64)
        self._intos.update((index, into) for index, into in intos.items() if into is not None)
        self._handles[group] = self._start_collective(group, buffer, offsets, member_bytes)

    def _start_collective(self, group: int, buffer: torch.Tensor, offsets: np.ndarray, member_bytes: int) -> Any:
        """The group's collective started (its bytes on the link counted); returns its handle."""
        self.wire_bytes += member_bytes * (self.transport.size - 1)
        # Named by the group's first tensor: a group of one tensor is named by that tensor (disjoint groups: unique).
        first = self.groups[group][0]
        return self.transport.start_allgather(f"{self.collective_name}.payload.{first}", buffer)

    def payload(self, index: int, step: int) -> torch.Tensor:
        """This rank's packed payload of tensor ``index`` at ``step``, once its group has been sent: when its last
        member arrives, else now (the group is sent with zeros for its missing members, as when the step closes;
        so every rank must ask at the same point)."""
        if step != self.step:
            raise RuntimeError(f"the payloads of step {step} are no longer held (a later step began)")
        if int(self.group_of[index]) in self._registered:
            self.flush()
        group = int(self.group_of[index])
        if group not in self._buffers:
            raise RuntimeError(f"the payload of {self.names[index]!r} is not sent yet: its group is sent when its "
                               f"last member is compressed, or when the step closes")
        buffer, offsets = self._buffers[group]
        member = int(self.member_of[index])
        return buffer[int(offsets[member]):int(offsets[member + 1])]

    # -- the receive side
    def reduced_sums(self, indices: list[int], step: int, outs: list[torch.Tensor | None],
                     divisor: float) -> list[torch.Tensor]:
        """The first member of a group asked for decodes the whole group, into each member's ``into`` tensor when it
        has one; the others take their sum from it.

        When a member's ``into`` tensor holds this rank's values, this rank's payload is not decoded again on ranks
        0 and 1: each adds the other ranks' values to its own in rank order (float addition is commutative, so
        rank 1's ``(q1 + q0) + q2 ...`` is bitwise ``(q0 + q1) + q2 ...``); the other ranks decode every payload."""
        if step != self.step:
            raise RuntimeError(f"the allgather of step {step} is no longer held (a later step began)")
        if self._registered and any(int(self.group_of[index]) in self._registered for index in indices):
            self.flush()     # a step in which some registered tensors were never sent (on every rank)
        totals = []
        for index, out in zip(indices, outs, strict=True):
            group = int(self.group_of[index])
            if group < 0:        # nothing was registered this run: the groups are not even made
                raise RuntimeError(f"{self.names[index]!r} was not sent at step {self.step}")
            decoded = self._decoded.get(group)
            if decoded is None:
                decoded = self._decode(group, divisor)
            decoded_divisor, sums, gathered = decoded
            total = sums[index]
            if divisor != decoded_divisor:       # another op than the group's first member's: decode them again
                again = {i: torch.empty_like(t) for i, t in sums.items()}
                self._receive(group, gathered, list(again.values()), np.full(len(again), -1, dtype=np.int64), divisor)
                total = again[index]
            totals.append(total if out is None or out is total else out.copy_(total))
        return totals

    def _decode(self, group: int, divisor: float) -> tuple[float, dict[int, torch.Tensor], torch.Tensor]:
        """Wait for the group's allgather and decode every member's sum over ranks (see :meth:`reduced_sums`)."""
        if group not in self._handles:
            raise RuntimeError(f"the group of {self.names[self.groups[group][0]]!r} was not sent at step {self.step}")
        gathered = self._wait(group)
        me = self.transport.rank
        members = self._receivers(group)
        outs, own_rank = [], np.full(len(members), -1, dtype=np.int64)
        for k, member in enumerate(members.tolist()):
            target = self._intos.get(member)
            if target is not None and me <= 1:
                own_rank[k] = me
            outs.append(target if target is not None else
                        torch.empty(int(self.tables.numels[member]), dtype=torch.float32, device=gathered.device))
        self._receive(group, gathered, outs, own_rank, divisor)
        decoded = self._decoded[group] = (divisor, dict(zip(members.tolist(), outs, strict=True)), gathered)
        return decoded

    def _receive(self, group: int, gathered: torch.Tensor, outs: list[torch.Tensor], own_rank: np.ndarray,
                 divisor: float) -> None:
        rows, names, what = self._received_as(group)
        verdict = torch.full((2,), kernels.NO_ERROR, dtype=torch.int32, device=gathered.device)
        if kernels.receive_group(gathered, rows, self._expected[group], outs, own_rank, self.tables, names, what,
                                 divisor, verdict):
            self._verdicts.add(verdict, group)
        if not self._handles and not self._registered:      # the step's last group: every sum is made
            self._check_received()

    def _wait(self, group: int) -> torch.Tensor:
        """What the group's collective brought: every rank's payloads of the members this rank decodes, in rank
        order."""
        return self.transport.wait(self._handles.pop(group))

    def _receivers(self, group: int) -> np.ndarray:
        """The group's members this rank decodes: all of them here."""
        return self._members[group]

    def _received_as(self, group: int) -> tuple[np.ndarray, list[str], str]:
        """The received buffer's table rows ``[member, rank]``, the members' names, and what it is, for errors."""
        members = self._receivers(group)
        return (np.repeat(members[:, None], self.transport.size, axis=1), [self.names[i] for i in members.tolist()],
                f"{self.collective_name} group {group} step {self.step}")

    def expect_at_close(self, value: torch.Tensor, bits: int, what: str) -> None:
        self._verdicts.marker = (value, bits, what)       # checked by _check_received, in its one read back

    def _check_received(self) -> None:
        """Once the step's last group is decoded: the verdicts of every group decoded on the device (and the value
        of :meth:`expect_at_close`), read back at once; a group that was not what it should be raises
        :class:`~.wire.WireFormatError` naming the tensor and rank, as the host would have when decoding it."""
        failed = self._verdicts.failed_group()
        if failed is not None:
            group, verdict = failed
            rows, names, what = self._received_as(group)
            kernels.raise_received_error(verdict, self._decoded[group][2], rows, self._expected[group], self.tables,
                                         names, what)


class ReceiveVerdicts:
    """What a step decoded on the device without a read back (:func:`.kernels.receive_group`), checked in one read
    back once its last group is decoded: each group's verdict (two int32) and a front end's value
    (:meth:`CollectivePath.expect_at_close`: ``marker``)."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        self.verdicts: list[torch.Tensor] = []
        self.groups: list[int] = []
        self.marker: tuple[torch.Tensor, int, str] | None = None

    def add(self, verdict: torch.Tensor, group: int) -> None:
        self.verdicts.append(verdict)
        self.groups.append(group)

    def failed_group(self) -> tuple[int, np.ndarray] | None:
        """Every verdict and the marker read back at once, and forgotten: ``ValueError`` for a marker of other bits;
        the first group found wrong, with its verdict, or None."""
        if not self.verdicts and self.marker is None:
            return None
        checked = list(self.verdicts)
        if self.marker is not None:
            checked.append(self.marker[0].reshape(1).view(torch.int32))
        values = host.to_host(torch.cat(checked))
        groups, marker = self.groups, self.marker
        self.forget()
        if marker is not None and int(values[-1]) != marker[1]:
            raise ValueError(marker[2])
        return next(((group, values[2 * k:2 * k + 2]) for k, group in enumerate(groups)
                     if (values[2 * k:2 * k + 2] != kernels.NO_ERROR).any()), None)


def chunk_bounds(sizes: list[int], chunk_bytes: int) -> list[tuple[int, int]]:
    """Tensors of these payload ``sizes`` cut into chunks, as ``(start, stop)`` positions, each sent and started
    before the next is packed: a chunk ends once its sizes reach ``chunk_bytes`` (the same cut on every rank)."""
    bounds, first, queued = [], 0, 0
    for position, size in enumerate(sizes):
        queued += size
        if queued >= chunk_bytes or position == len(sizes) - 1:
            bounds.append((first, position + 1))
            first, queued = position + 1, 0
    return bounds


def segment_bounds(n: int, bucket_size: int, ranks: int, index: int) -> list[tuple[int, int]]:
    """Two-phase: ``ranks`` element ranges of tensor ``index`` of ``n`` elements, cut at bucket boundaries (some may
    be empty), so every segment quantizes exactly as the same buckets of the whole tensor would. Segments differ by at
    most one bucket; where the buckets do not divide evenly, tensor ``index`` gives its extra ones to the owners
    before ``P - 1 - index mod P``: a model's one-bucket tensors (biases, norms) spread over every owner instead of
    all landing on the last, whose larger payloads every rank's allgather would be padded to."""
    buckets = -(-n // bucket_size)
    shift = index % ranks
    cuts = [0, *(min(n, ((r * buckets + shift) // ranks) * bucket_size) for r in range(1, ranks)), n]
    return list(itertools.pairwise(cuts))


def segment_key(key: int, segment: int) -> int:
    """The RNG stream of one segment: segments restart element numbering at 0, so each needs its own draws."""
    return stream_key(key, segment + 1, 0)


def encode_packed(g: torch.Tensor | None, e: torch.Tensor, action: Action, key: int,
                  into: torch.Tensor | None) -> tuple[torch.Tensor, np.ndarray]:
    """One packed payload of ``v = g + e`` at ``action`` (``e <- v - q``, ``q`` into ``into`` if given) and the
    float64 statistics of ``q``, read back."""
    payload, stats = kernels.quantize_pack_ef(g, e, action, key, into=into)
    return payload, host.to_host(stats)


def packed_zeros(action: Action, n: int, device: torch.device) -> torch.Tensor:
    """``action``'s payload of ``n`` zeros (no residual is touched, nothing is read back)."""
    zeros = torch.zeros(n, dtype=torch.float32, device=device)
    return kernels.quantize_pack_ef(None, zeros, action, 0)[0]


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
