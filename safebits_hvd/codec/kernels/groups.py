"""A group's send and receive as the backends take them (docs/DESIGN.md, "The batched step"): the tables that never
change between steps (:class:`GroupTables`), the request of one send (:class:`PackRequest`, with what it writes,
:class:`GroupOutput`, and the screen's rule it chooses by, :class:`ScreenRule`), its result (:class:`PackResult`), and a
gathered group's payloads (:class:`Gathered`). :func:`safebits_hvd.codec.kernels.pack_group` and ``decode_group``
dispatch them to a backend."""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from .. import host, wire
from ..actions import Menu


class GroupTables:
    """What never changes between steps for the tensors of one core: per tensor and action, the payload's bytes
    and its 16 header bytes (:mod:`safebits_hvd.codec.wire`); the cost order; the menu."""

    def __init__(self, menu: Menu, numels: np.ndarray, cost_order: np.ndarray) -> None:
        self.menu = menu
        self.actions = len(menu)
        self.numels = np.ascontiguousarray(numels, dtype=np.int64)
        self.headers = wire.header_table(menu, self.numels)                 # (tensors, actions, 16) uint8
        self.payload_bytes = wire.payload_table(menu, self.numels)          # (tensors, actions) int64
        self.largest_payload_bytes = self.payload_bytes.max(axis=1)
        self.cost_order = np.ascontiguousarray(cost_order, dtype=np.int64)
        self.lossless = np.array([a.lossless for a in menu], dtype=np.uint8)
        self.lossless_index = int(menu.lossless_index)
        # Header bytes -> action, per tensor: a payload that is not the allocated one is looked up here.
        self._action_of_header: dict[int, dict[bytes, int]] = {}
        # What a backend derives from these tables once (the C backend: their addresses), by backend.
        self.backend_arguments: dict[str, Any] = {}
        self._on_device: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def on_device(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """payload_bytes, headers, cost_order and lossless on ``device``: copied once (they never change)."""
        tables = self._on_device.get(device)
        if tables is None:
            tables = self._on_device[device] = tuple(host.to_device(a, device) for a in (
                self.payload_bytes, self.headers, self.cost_order, self.lossless))
        return tables

    def action_of_header(self, tensor: int, head: bytes) -> int:
        """The menu action whose header for ``tensor`` is ``head``, or -1."""
        table = self._action_of_header.get(tensor)
        if table is None:
            table = self._action_of_header[tensor] = {self.headers[tensor, a].tobytes(): a
                                                      for a in range(self.actions)}
        return table.get(head, -1)


class GroupOutput(IntEnum):
    """What :func:`pack_group` writes after the NaN/Inf check, the screen and the choice (``group.c`` takes the same
    numbers)."""

    SCREEN = 0      # nothing: no payload, no residual, no q (the two-phase first hop packs each segment apart)
    PAYLOAD = 1     # the packed payloads, the residuals, and q into the ``intos`` given (the packed paths)
    VALUES = 2      # q into ``intos`` (every one given) and the residuals, no payload (the dense path: Horovod or
                    # DDP all-reduces the values; a payload beside them would travel nowhere)


class ScreenRule(Protocol):
    """What the pass needs of the screen's rule (its one home: :class:`safebits_hvd.policy.screen.ScreenRule`):
    the thresholds, which the compiled backends' copy of the choice takes, and the choice itself, which the
    reference backend calls."""

    @property
    def max_distortion(self) -> float: ...

    @property
    def min_cosine(self) -> float: ...

    def first_candidates(self, screen_stats: np.ndarray, allocated: np.ndarray, cost_order: np.ndarray,
                         lossless: np.ndarray) -> np.ndarray: ...


class PackRequest(NamedTuple):
    """One group's send: per member (a row of the tables), its flat float32 gradient, residual, the tensor that
    receives ``q`` (or None), the screen's sample of buckets (None: all), RNG key and allocated action; ``output``:
    what the pass writes (:class:`GroupOutput`)."""

    members: np.ndarray
    grads: list[torch.Tensor]
    residuals: list[torch.Tensor]
    intos: list[torch.Tensor | None]
    samples: list[torch.Tensor | None]
    keys: np.ndarray
    allocated: np.ndarray
    check_finite: bool          # look for NaN/Inf in each gradient first
    do_screen: bool             # measure every action (the screen's statistics)
    screen_enabled: bool        # choose by the screen (else the allocated action)
    rule: ScreenRule            # chooses each member's first action (screen_enabled)
    output: GroupOutput = GroupOutput.PAYLOAD


class PackResult(NamedTuple):
    """What :func:`pack_group` did, per member: the payloads back to back (``offsets``: where each starts, and the
    end), whether its gradient was finite (a non-finite one was not sent: chosen -1, no bytes), the screen's
    statistics ``(members, actions, 4)``, the action sent, and the exact statistics of what was sent."""

    buffer: torch.Tensor
    finite: np.ndarray
    screen_stats: np.ndarray
    chosen: np.ndarray
    offsets: np.ndarray
    stats: np.ndarray


class Gathered(NamedTuple):
    """A gathered group's payloads where they arrived: member ``k``'s payload from rank ``r`` starts at byte
    ``offsets[k, r]`` of ``buffer`` (its length is its action's, :attr:`GroupTables.payload_bytes`)."""

    buffer: torch.Tensor
    offsets: np.ndarray

    def payloads(self, sizes: np.ndarray) -> list[list[torch.Tensor]]:
        """The payloads as views, ``[member][rank]``, given their sizes ``(members, ranks)``."""
        return [[self.buffer[int(o):int(o) + int(n)] for o, n in zip(row, size_row, strict=True)]
                for row, size_row in zip(self.offsets, sizes, strict=True)]
