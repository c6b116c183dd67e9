"""Rank synchronisation without a coordinator (DESIGN section 3).

Once per step every rank contributes one float64 vector of statistics to one element-wise MAX allreduce, done in
place: the vector is overwritten with the reduction (no array is allocated per step: fresh pages fault in at
several microseconds each, which at 1,000 tensors would cost more than the exchange). Its layout is
``compressor._ExchangeFields``. The screening statistics are conservative by construction: per tensor and action,
the distortion where the rank's screen (max distortion *and* min cosine) admits the action and +inf where it
does not, so the MAX is the largest distortion if every rank admits the action and +inf if any rank rejects it,
exactly what the allocator needs of the (max distortion, min cosine) pair, in half the values. Quantities whose
conservative side is the minimum (the cosine of what was sent) are sent negated. After the reduction every rank
holds identical inputs and runs the same deterministic allocator, so all ranks choose the same actions without
anyone deciding for them.

Transport, chosen when the first exchange starts (``hvd.init()`` may come after the compressor is built):

* one process, or Horovod not initialized: nothing is sent;
* Horovod on MPI (``hvd.mpi_enabled()``) and an MPI with ``MPI_THREAD_MULTIPLE``: mpi4py's non-blocking
  ``Iallreduce`` on a duplicate of ``COMM_WORLD`` (its own context, so it never matches Horovod's messages);
* otherwise (Gloo): Horovod's own in-place ``allreduce_async_`` with ``op=hvd.Max`` under a fixed name.

Where in the step (see ``compressor.SafeBits``): the exchange is *started* without blocking when a rank has
compressed every parameter of the step, i.e. after it has handed every gradient to Horovod, and *finished* at
the first ``decompress`` of that step (or the next step's first ``compress``, or ``flush()``). Starting needs
nothing from other ranks, so it cannot deadlock; it never delays a gradient's allreduce, so Horovod's overlap of
communication with backward is untouched; and it has the whole gradient allreduce to complete in.

Length check: the very first exchange of a compressor object is preceded by one small blocking MAX allreduce of
``(length, -length)`` of the statistics vector. Ranks that registered different parameters or menus would
otherwise hand vectors of different lengths to one allreduce (Horovod fails with an unclear message, an MPI
``Iallreduce`` with mismatched counts may truncate or hang); with the check every rank raises
:class:`~.errors.SafeBitsConsistencyError` instead. It happens once, where the first exchange starts, so it
cannot deadlock for the same reason the exchange cannot.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np
import torch

from .errors import SafeBitsConsistencyError


class LocalExchange:
    """One process: the reduction of one vector is the vector."""

    size = 1

    def start(self, values: np.ndarray) -> Any:
        """Starts reducing ``values`` (contiguous float64) in place; returns the handle :meth:`wait` takes."""
        return values

    def wait(self, handle: Any) -> np.ndarray:
        return handle


class _RankExchange:
    """A MAX-allreduce between ranks. The first exchange is preceded by one small blocking MAX-allreduce of
    ``(length, -length)``: ranks built with different parameters or menus would otherwise send vectors of
    different lengths (an unclear Horovod error, or an MPI hang); instead every rank raises
    :class:`SafeBitsConsistencyError`. It runs once, at the same point on every rank, so it cannot deadlock."""

    _checked = False

    def start(self, values: np.ndarray) -> Any:
        """Starts reducing ``values`` (contiguous float64) in place; returns the handle :meth:`wait` takes.
        ``values`` must not be touched until :meth:`wait` returns it."""
        if values.dtype != np.float64 or values.ndim != 1 or not values.flags.c_contiguous:
            raise TypeError("the statistics vector must be a contiguous 1-D float64 array")
        if not self._checked:
            length = len(values)
            longest, negated_shortest = self._max_now(np.array([length, -length], dtype=np.float64))
            if int(longest) != -int(negated_shortest):
                raise SafeBitsConsistencyError(
                    f"ranks exchange statistics of different lengths ({-int(negated_shortest)} to {int(longest)} "
                    f"values, this rank {length}): every rank must build SafeBits with the same parameters "
                    f"(requires_grad) and menu")
            self._checked = True
        return self._start(values)

    def _max_now(self, values: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _start(self, values: np.ndarray) -> Any:
        raise NotImplementedError


class HorovodExchange(_RankExchange):
    """MAX-allreduce through Horovod (works under Gloo and MPI)."""

    def __init__(self, name: str) -> None:
        import horovod.torch as hvd

        self._hvd = hvd
        self.name = name
        self.size = hvd.size()

    def _max_now(self, values: np.ndarray) -> np.ndarray:
        return self._hvd.allreduce(torch.from_numpy(values), op=self._hvd.Max, name=f"{self.name}.length").numpy()

    def _start(self, values: np.ndarray) -> Any:
        return self._hvd.allreduce_async_(torch.from_numpy(values), op=self._hvd.Max, name=self.name)

    def wait(self, handle: Any) -> np.ndarray:
        return self._hvd.synchronize(handle).numpy()


class MPIExchange(_RankExchange):
    """MAX-allreduce through mpi4py's non-blocking ``Iallreduce`` on a private communicator."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = MPI.COMM_WORLD.Dup()        # collective: every rank creates it at the same first exchange
        self.size = self.comm.Get_size()

    def _max_now(self, values: np.ndarray) -> np.ndarray:
        reduced = np.empty_like(values)
        self.comm.Allreduce(values, reduced, op=self._mpi.MAX)
        return reduced

    def _start(self, values: np.ndarray) -> Any:
        request = self.comm.Iallreduce(self._mpi.IN_PLACE, values, op=self._mpi.MAX)
        return request, values                # keeps the buffer alive until the request completes

    def wait(self, handle: Any) -> np.ndarray:
        request, values = handle
        # Not request.Wait(): Open MPI's Wait spins at full speed, and where ranks share cores it starves Horovod's
        # background thread and the other rank, which the exchange waits on (2 ranks on 2 cores: median 3.3 ms with
        # a tail to 10 ms, against 0.8 ms testing and yielding the core between tests).
        while not request.Test():
            time.sleep(0)
        return values


def make_exchange(name: str) -> LocalExchange | HorovodExchange | MPIExchange:
    """The transport for the current process (see the module docstring)."""
    try:
        import horovod.torch as hvd
    except ImportError:
        return LocalExchange()
    try:
        if not hvd.is_initialized() or hvd.size() == 1:
            return LocalExchange()
    except ValueError:                        # Horovod raises this when not initialized
        return LocalExchange()
    if hvd.mpi_enabled():
        try:
            from mpi4py import MPI

            if MPI.Query_thread() >= MPI.THREAD_MULTIPLE and MPI.COMM_WORLD.Get_size() == hvd.size():
                return MPIExchange()
        except ImportError:
            pass
    return HorovodExchange(name)


def allocation_digest(step: int, budget_bits_total: float, choice: np.ndarray) -> str:
    """16 hex digits identifying one step's allocation (step, budget and every tensor's action)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.array([step], dtype=np.int64).tobytes())
    h.update(np.array([budget_bits_total], dtype=np.float64).tobytes())
    h.update(np.ascontiguousarray(choice, dtype=np.int64).tobytes())
    return h.hexdigest()


def digest_words(digest: str) -> np.ndarray:
    """The digest as four 16-bit integers in float64 (exact), for the MAX exchange."""
    value = int(digest, 16)
    return np.array([(value >> (16 * k)) & 0xFFFF for k in range(4)], dtype=np.float64)
