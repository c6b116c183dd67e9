"""Payload collectives: how the packed payloads (:mod:`.wire`) travel between ranks and become the reduced gradient
(docs/DESIGN.md, "Compressed collectives").

* ``"allgather"``: every rank's payload of a tensor (uint8; lengths may differ, since ranks may escalate
  differently) reaches every rank; every rank decodes all of them and sums them **in rank order**, so the reduced
  gradient is bitwise identical everywhere. Per element a rank moves ``b (P - 1)`` bits for ``b``-bit payloads.
* ``"dense"``: today's float32 values through Horovod's allreduce (``2 * 32 (P - 1) / P`` bits per element on a
  ring); kept for comparison, for ``op=hvd.Adasum``, and where it moves fewer bytes.
* ``"auto"`` (default) picks, per step and identically on every rank, the one that moves fewer bytes for the
  step's allocation: allgather when ``b (P - 1) < 64 (P - 1) / P``, i.e. ``b < 64 / P`` bits per parameter.

Many small tensors must not each pay a collective's latency: each tensor's allgather is submitted asynchronously
under its own fixed name, and Horovod fuses allgathers of one dtype submitted in the same cycle into one.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from . import kernels, wire

COLLECTIVES = ("auto", "allgather", "dense")


def choose(collective: str, bits_per_parameter: float, world_size: int) -> str:
    """The collective of a step: ``collective`` unless it is ``"auto"`` (see the module docstring)."""
    if collective != "auto":
        return collective
    if world_size <= 1:
        return "dense"          # one process: nothing moves; the float32 values are the answer
    return "allgather" if bits_per_parameter < 64.0 / world_size else "dense"


@runtime_checkable
class PayloadAllgather(Protocol):
    """Gathers one uint8 payload per rank, concatenated in rank order. ``start`` must not block."""

    rank: int
    size: int

    def start(self, name: str, payload: torch.Tensor) -> Any:
        ...

    def wait(self, handle: Any) -> torch.Tensor:
        ...


class LocalAllgather:
    """One process: the gathered payloads are this rank's."""

    rank = 0
    size = 1

    def start(self, name: str, payload: torch.Tensor) -> Any:
        return payload

    def wait(self, handle: Any) -> torch.Tensor:
        return handle


class HorovodAllgather:
    """``hvd.allgather_async`` of uint8 payloads under fixed per-tensor names (fused by Horovod)."""

    def __init__(self) -> None:
        import horovod.torch as hvd

        self._hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()

    def start(self, name: str, payload: torch.Tensor) -> Any:
        return self._hvd.allgather_async(payload, name=name)

    def wait(self, handle: Any) -> torch.Tensor:
        return self._hvd.synchronize(handle)


def make_allgather() -> LocalAllgather | HorovodAllgather:
    """The payload transport of the current process (Horovod when it is initialized with several ranks)."""
    try:
        import horovod.torch as hvd
    except ImportError:
        return LocalAllgather()
    try:
        if not hvd.is_initialized() or hvd.size() == 1:
            return LocalAllgather()
    except ValueError:
        return LocalAllgather()
    return HorovodAllgather()


def sum_payloads(gathered: torch.Tensor, ranks: int, out: torch.Tensor, name: str) -> torch.Tensor:
    """Decode ``ranks`` concatenated payloads and add them, in rank order, into ``out`` (float32, zeroed by the
    caller). Raises :class:`~.wire.WireFormatError` naming ``name`` if the buffer does not hold exactly that."""
    offset = 0
    total = gathered.numel()
    for rank in range(ranks):
        length = wire.payload_length(gathered, offset, name=f"{name} (rank {rank})")
        kernels.decode_add(gathered[offset:offset + length], out, name=f"{name} (rank {rank})")
        offset += length
    if offset != total:
        raise wire.WireFormatError(f"{name}: {total - offset} bytes after the {ranks} ranks' payloads")
    return out
