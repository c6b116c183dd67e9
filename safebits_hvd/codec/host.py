"""The host seam: every point where SafeBits' step crosses between host and device goes through here, counted, on
every device, so a test on the CPU counts what a GPU step would pay (docs/DESIGN.md, "The batched step"):

* a **read** (device to host: the host waits for the device, a stream synchronization): :func:`to_host`, or
  :func:`count` for one made another way (a scalar, a flag);
* an **upload** (host to device): :func:`upload`, one non-blocking copy from pinned memory that is pinned once per
  device and reused, or :func:`to_device`, a pageable copy (on CUDA a synchronization too: kept off the hot path);
* a **late read** (:func:`copy_to_host`, then :func:`arrived`): a non-blocking copy to pinned memory, read once
  the device has made it (a later step): no wait, unless it has not (then counted as a read);
* a kernel **launch** (:func:`launched`, called by the kernel backends per launch).

:func:`traffic` is the running total and :func:`counting` the traffic of a block of code, the public seam the
counting tests and ``bench/gpu_check.sh`` read.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch


class Traffic(NamedTuple):
    """Host-device crossings (see the module docstring): counts since the process started, or of a block."""

    reads: int = 0
    launches: int = 0
    pinned_uploads: int = 0
    pageable_uploads: int = 0

    def __sub__(self, other: Any) -> Traffic:
        return Traffic(*(a - b for a, b in zip(self, other, strict=True)))


_counts = [0, 0, 0, 0]          # Traffic's fields, mutable


def traffic() -> Traffic:
    """The crossings SafeBits has made so far in this process."""
    return Traffic(*_counts)


def reads() -> int:
    """How many reads back to the host SafeBits has made so far in this process."""
    return _counts[0]


class Counted:
    """What :func:`counting` yields: the traffic of its block so far (:attr:`traffic`), final once it exits."""

    def __init__(self) -> None:
        self._start = traffic()
        self._end: Traffic | None = None

    @property
    def traffic(self) -> Traffic:
        return (self._end if self._end is not None else traffic()) - self._start


@contextlib.contextmanager
def counting() -> Iterator[Counted]:
    """``with host.counting() as counted: ...; counted.traffic`` — the crossings the block made."""
    counted = Counted()
    try:
        yield counted
    finally:
        counted._end = traffic()


def count(reads: int = 1) -> None:
    """Count reads made without :func:`to_host` (a scalar, a header)."""
    _counts[0] += reads


def launched(launches: int = 1) -> None:
    """Count kernel launches (the backends call it per launch)."""
    _counts[1] += launches


def to_host(t: torch.Tensor) -> np.ndarray:
    """``t`` as a NumPy array on the host (one counted read)."""
    _counts[0] += 1
    return t.detach().cpu().numpy()


class HostCopy:
    """A non-blocking copy of a device tensor on its way to the host (:func:`copy_to_host`)."""

    def __init__(self, t: torch.Tensor) -> None:
        cuda = t.device.type == "cuda"
        self.memory = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        self.memory.copy_(t.detach(), non_blocking=cuda)
        self.event: Any = None
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(t.device))


def copy_to_host(t: torch.Tensor) -> HostCopy:
    """Start copying ``t`` to the host without waiting for it (on the CPU the copy is made now); :func:`arrived`
    reads it later."""
    return HostCopy(t)


def arrived(copy: HostCopy) -> np.ndarray:
    """What :func:`copy_to_host` copied, as a NumPy array: no wait once the device has made the copy (a later step
    reads it); where it has not, a wait, counted as a read."""
    if copy.event is not None and not copy.event.query():
        _counts[0] += 1
        copy.event.synchronize()
    return copy.memory.numpy().copy()


def to_device(array: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` by a pageable copy (counted; on CUDA it waits for the copy). For what is copied
    once (tables built per layout); a step's changing values take :func:`upload`."""
    _counts[3] += 1
    t = torch.from_numpy(np.ascontiguousarray(array)) if isinstance(array, np.ndarray) else array
    return t.to(device)


class _PinnedSlot:
    """Pinned staging memory and the event of the copy last made from it (None: free)."""

    def __init__(self, elements: int) -> None:
        self.memory = torch.empty(elements, dtype=torch.int64, pin_memory=True)
        self.event: Any = None

    def is_free(self) -> bool:
        return self.event is None or self.event.query()


_PINNED_SLOTS = 8
"""Staging slots per device: an upload takes a slot whose last copy has been made (``query``, no wait); only when
all are in flight does it wait for the oldest (never, unless the host runs this far ahead of the device)."""

_pinned: dict[torch.device, list[_PinnedSlot]] = {}
_pinned_lock = threading.Lock()       # autograd may run hooks on more than one thread


def _pinned_slot(device: torch.device, elements: int) -> _PinnedSlot:
    slots = _pinned.setdefault(device, [])
    for k, slot in enumerate(slots):
        if slot.is_free():
            if slot.memory.numel() < elements:
                slots[k] = slot = _PinnedSlot(max(elements, 2 * slot.memory.numel()))
            slots.append(slots.pop(k))          # most recently used last: the oldest in flight comes first
            return slot
    if len(slots) < _PINNED_SLOTS:
        slots.append(_PinnedSlot(max(elements, 4096)))
        return slots[-1]
    slot = slots.pop(0)
    slot.event.synchronize()
    if slot.memory.numel() < elements:
        slot = _PinnedSlot(max(elements, 2 * slot.memory.numel()))
    slots.append(slot)
    return slot


def upload(device: torch.device, columns: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The int64 columns as views of ONE device tensor, by one counted non-blocking copy from pinned memory reused
    across steps (a pageable copy synchronizes; pinning per call costs an allocation). On the CPU the views share
    the columns' values and the copy is counted as it would be on a GPU."""
    flat = [np.asarray(c).astype(np.int64, copy=False).ravel() for c in columns.values()]
    total = sum(c.size for c in flat)
    _counts[2] += 1
    if device.type != "cuda":
        table = torch.from_numpy(np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64))
    else:
        with _pinned_lock:
            slot = _pinned_slot(device, total)
            host_view = slot.memory[:total].numpy()
            start = 0
            for column in flat:
                host_view[start:start + column.size] = column
                start += column.size
            table = slot.memory[:total].to(device, non_blocking=True)
            slot.event = torch.cuda.Event()
            slot.event.record(torch.cuda.current_stream(device))
    views, start = {}, 0
    for name, column in zip(columns, flat, strict=True):
        views[name] = table[start:start + column.size]
        start += column.size
    return views
