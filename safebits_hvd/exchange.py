"""The statistics exchange: how ranks agree without a coordinator (docs/DESIGN.md, "No coordinator").

Once per step every rank contributes one float64 vector of statistics (layout: :mod:`.statistics`) to one
element-wise MAX allreduce, done **in place**: the vector is overwritten with the reduction (no array is allocated
per step: fresh pages fault in at several microseconds each, which at 1,000 tensors would cost more than the
exchange). Quantities whose conservative side is the minimum are sent negated. After the reduction every rank
holds identical inputs and runs the same deterministic allocator, so all ranks choose the same actions.

The contract (:class:`StatisticsExchange`) is what the core relies on, and the seam through which tests and
benchmarks plug in their own transport (``SafeBits(..., exchange=...)``):

* ``start(values)`` begins reducing ``values`` (contiguous 1-D float64) in place and returns a handle; it needs
  nothing from other ranks, so it never blocks on them;
* ``wait(handle)`` returns when ``values`` holds the element-wise MAX over every rank's vector;
* ``is_local`` (one process: nothing to send), ``rank`` and ``size``.

Transports, chosen when the first exchange starts (``hvd.init()`` may come after the compressor is built):

* one process, or Horovod not initialized: :class:`LocalExchange`;
* Horovod on MPI (``hvd.mpi_enabled()``) and an MPI with ``MPI_THREAD_MULTIPLE``: :class:`MPIExchange`, mpi4py's
  non-blocking ``Iallreduce`` on a duplicate of ``COMM_WORLD`` (its own context, never matching Horovod's messages);
* otherwise (Gloo): :class:`HorovodExchange`, Horovod's own in-place ``allreduce_async_`` with ``op=hvd.Max``.

Why it cannot deadlock (docs/DESIGN.md, "Why the exchange cannot deadlock"): it is started once a rank has handed
every gradient of the step to Horovod, and finished at the first ``decompress`` of that step.

Length check: the very first exchange of a transport is preceded by one small blocking MAX allreduce of
``(length, -length)``. Ranks that registered different parameters or menus would otherwise hand vectors of
different lengths to one allreduce (Horovod fails with an unclear message, an MPI ``Iallreduce`` with mismatched
counts may truncate or hang); with the check every rank raises :class:`~.errors.SafeBitsConsistencyError`.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from .errors import SafeBitsConsistencyError


@runtime_checkable
class StatisticsExchange(Protocol):
    """An element-wise MAX allreduce of one float64 vector, in place (see the module docstring)."""

    is_local: bool
    rank: int
    size: int

    def start(self, values: np.ndarray) -> Any:
        """Begin reducing ``values`` in place; must not wait for other ranks. Returns the handle for :meth:`wait`."""
        ...

    def wait(self, handle: Any) -> None:
        """Return once the vector given to :meth:`start` holds the MAX over all ranks."""
        ...


class LocalExchange:
    """One process: the reduction of one vector is the vector."""

    is_local = True
    rank = 0
    size = 1

    def start(self, values: np.ndarray) -> Any:
        return None

    def wait(self, handle: Any) -> None:
        return None


class _RankExchange:
    """A MAX-allreduce between ranks. The first exchange is preceded by one small blocking MAX-allreduce of
    ``(length, -length)``: ranks built with different parameters or menus would otherwise send vectors of
    different lengths (an unclear Horovod error, or an MPI hang); instead every rank raises
    :class:`SafeBitsConsistencyError`. It runs once, at the same point on every rank, so it cannot deadlock."""

    is_local = False
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
        self.rank = hvd.rank()
        self.size = hvd.size()

    def _max_now(self, values: np.ndarray) -> np.ndarray:
        return self._hvd.allreduce(torch.from_numpy(values), op=self._hvd.Max, name=f"{self.name}.length").numpy()

    def _start(self, values: np.ndarray) -> Any:
        tensor = torch.from_numpy(values)          # shares the vector's memory: the in-place op writes into it
        return self._hvd.allreduce_async_(tensor, op=self._hvd.Max, name=self.name), tensor

    def wait(self, handle: Any) -> None:
        horovod_handle, tensor = handle
        reduced = self._hvd.synchronize(horovod_handle)
        if reduced.data_ptr() != tensor.data_ptr():   # the contract is in place, whatever Horovod returned
            tensor.copy_(reduced)


class MPIExchange(_RankExchange):
    """MAX-allreduce through mpi4py's non-blocking ``Iallreduce`` on a private communicator."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = MPI.COMM_WORLD.Dup()        # collective: every rank creates it at the same first exchange
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def _max_now(self, values: np.ndarray) -> np.ndarray:
        reduced = np.empty_like(values)
        self.comm.Allreduce(values, reduced, op=self._mpi.MAX)
        return reduced

    def _start(self, values: np.ndarray) -> Any:
        request = self.comm.Iallreduce(self._mpi.IN_PLACE, values, op=self._mpi.MAX)
        return request, values                # keeps the buffer alive until the request completes

    def wait(self, handle: Any) -> None:
        request, _ = handle
        # Not request.Wait(): Open MPI's Wait spins at full speed, and where ranks share cores it starves Horovod's
        # background thread and the other rank, which the exchange waits on (docs/RESULTS.md, section 3.4).
        while not request.Test():
            time.sleep(0)


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


class TimedExchange:
    """Wraps another exchange and records the seconds spent in its ``start`` and in its ``wait``, one entry per
    exchange in order (the benchmarks' timing hook: it goes through the same seam as any transport)."""

    def __init__(self, inner: StatisticsExchange) -> None:
        self.inner = inner
        self.is_local = inner.is_local
        self.rank = inner.rank
        self.size = inner.size
        self.start_seconds: list[float] = []
        self.wait_seconds: list[float] = []

    def start(self, values: np.ndarray) -> Any:
        begin = time.perf_counter()
        handle = self.inner.start(values)
        self.start_seconds.append(time.perf_counter() - begin)
        self.wait_seconds.append(0.0)
        return len(self.start_seconds) - 1, handle

    def wait(self, handle: Any) -> None:
        index, inner_handle = handle
        begin = time.perf_counter()
        self.inner.wait(inner_handle)
        self.wait_seconds[index] += time.perf_counter() - begin
