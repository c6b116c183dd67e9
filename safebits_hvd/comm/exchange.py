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
* otherwise (Gloo): :class:`HorovodExchange`, Horovod's own in-place ``allreduce_async_`` with ``op=hvd.Max``;
* the DDP front end (:mod:`.ddp`): :class:`TorchDistributedExchange`, ``torch.distributed.all_reduce`` (MAX).

Why it cannot deadlock (docs/DESIGN.md, "Why the exchange cannot deadlock"): it is started once a rank has taken
every reduced gradient of the step back from Horovod, and finished at the next step's first ``compress``.

Length check: the very first exchange of a transport is preceded by one small blocking MAX allreduce of
``(length, -length)`` (``check_length``, which the core calls as its first step closes, before any payload is
decoded; a transport of one's own may offer it too). Ranks that registered different parameters or menus would
otherwise hand vectors of different lengths to one allreduce (Horovod fails with an unclear message, an MPI
``Iallreduce`` with mismatched counts may truncate or hang); with the check every rank raises
:class:`~.errors.SafeBitsConsistencyError`.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..codec import host
from ..errors import SafeBitsConsistencyError, SafeBitsTimeoutError

DEFAULT_TIMEOUT = 600.0
"""Seconds a rank waits for a SafeBits collective before :class:`SafeBitsTimeoutError` (``SafeBits(timeout=)``)."""


_waited_seconds = 0.0


def waited_seconds() -> float:
    """Seconds this process has spent in :func:`wait_bounded` so far: waiting for SafeBits' collectives (the step
    clock, :class:`~.clock.StepClock`, reads it before and after)."""
    return _waited_seconds


def wait_bounded(done: Any, timeout: float | None, what: str) -> None:
    """Return once ``done()`` is true; raise :class:`SafeBitsTimeoutError` naming ``what`` after ``timeout`` seconds
    (None: no limit). Yields the core between polls: a spinning wait starves Horovod's background thread and the
    other ranks where ranks share cores (docs/RESULTS.md, section 5.3). The time spent is added to
    :func:`waited_seconds`."""
    global _waited_seconds
    if done():
        return
    start = time.perf_counter()
    try:
        _wait(done, timeout, what, start)
    finally:
        _waited_seconds += time.perf_counter() - start


def wait_work(work: Any, timeout: float | None, what: str) -> None:
    """A ``torch.distributed`` collective's ``Work``: :func:`wait_bounded` on it, then its own ``wait()``, which
    raises the collective's own error, if any."""
    wait_bounded(work.is_completed, timeout, what)
    work.wait()


def _wait(done: Any, timeout: float | None, what: str, start: float) -> None:
    pause = 0.0
    while not done():
        waited = time.perf_counter() - start
        if timeout is not None and waited > timeout:
            raise SafeBitsTimeoutError(
                f"{what} did not complete within {timeout:g} s: some rank never joined it (a rank outside this "
                f"SafeBits' process set, a crashed or stalled rank, or a model registered differently on some "
                f"rank). Raise SafeBits(timeout=...) if a rank legitimately takes that long between steps")
        time.sleep(pause)
        pause = 0.0 if waited < 0.002 else 0.0002


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

    def check_length(self, length: int) -> None:
        """The length check, once (the core calls it when its first step closes, before any payload is decoded:
        payloads of ranks built differently would fail to decode with a less clear message)."""
        if self._checked:
            return
        longest, negated_shortest = self._max_now(np.array([length, -length], dtype=np.float64))
        if int(longest) != -int(negated_shortest):
            raise SafeBitsConsistencyError(
                f"ranks exchange statistics of different lengths ({-int(negated_shortest)} to {int(longest)} "
                f"values, this rank {length}): every rank must build SafeBits with the same parameters "
                f"(requires_grad) and menu")
        self._checked = True

    def start(self, values: np.ndarray) -> Any:
        """Starts reducing ``values`` (contiguous float64) in place; returns the handle :meth:`wait` takes.
        ``values`` must not be touched until :meth:`wait` returns it."""
        if values.dtype != np.float64 or values.ndim != 1 or not values.flags.c_contiguous:
            raise TypeError("the statistics vector must be a contiguous 1-D float64 array")
        self.check_length(len(values))
        return self._start(values)

    def _max_now(self, values: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _start(self, values: np.ndarray) -> Any:
        raise NotImplementedError


class HorovodExchange(_RankExchange):
    """MAX-allreduce through Horovod (works under Gloo and MPI), on a process set (default: every rank)."""

    def __init__(self, name: str, process_set: Any = None, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        import horovod.torch as hvd

        self._hvd = hvd
        self.name = name
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()
        self.timeout = timeout

    def _max_now(self, values: np.ndarray) -> np.ndarray:
        tensor = torch.from_numpy(values)          # shares the vector's memory: the in-place op writes into it
        handle = self._hvd.allreduce_async_(tensor, op=self._hvd.Max, name=f"{self.name}.length",
                                            process_set=self.process_set)
        wait_bounded(lambda: self._hvd.poll(handle), self.timeout, f"SafeBits' statistics exchange {self.name!r}")
        self._hvd.synchronize(handle)
        return values

    def _start(self, values: np.ndarray) -> Any:
        tensor = torch.from_numpy(values)          # shares the vector's memory: the in-place op writes into it
        # Horovod matches collectives by name: each vector the core exchanges (the statistics; the telemetry for
        # budget_bits="auto") is named by its length, which differs.
        return self._hvd.allreduce_async_(tensor, op=self._hvd.Max, name=f"{self.name}.{len(values)}",
                                          process_set=self.process_set), tensor

    def wait(self, handle: Any) -> None:
        horovod_handle, tensor = handle
        wait_bounded(lambda: self._hvd.poll(horovod_handle), self.timeout,
                     f"SafeBits' statistics exchange {self.name!r}")
        reduced = self._hvd.synchronize(horovod_handle)
        if reduced.data_ptr() != tensor.data_ptr():   # the contract is in place, whatever Horovod returned
            tensor.copy_(reduced)


class MPIExchange(_RankExchange):
    """MAX-allreduce through mpi4py's non-blocking ``Iallreduce`` on a private communicator."""

    def __init__(self, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.timeout = timeout
        self.comm = MPI.COMM_WORLD.Dup()        # collective: every rank creates it at the same first exchange
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def _max_now(self, values: np.ndarray) -> np.ndarray:
        request = self.comm.Iallreduce(self._mpi.IN_PLACE, values, op=self._mpi.MAX)
        wait_bounded(request.Test, self.timeout, "SafeBits' statistics exchange (MPI)")
        return values

    def _start(self, values: np.ndarray) -> Any:
        request = self.comm.Iallreduce(self._mpi.IN_PLACE, values, op=self._mpi.MAX)
        return request, values                # keeps the buffer alive until the request completes

    def wait(self, handle: Any) -> None:
        request, _ = handle
        # Not request.Wait(): Open MPI's Wait spins at full speed, and where ranks share cores it starves Horovod's
        # background thread and the other rank, which the exchange waits on (docs/RESULTS.md, section 5.3).
        wait_bounded(request.Test, self.timeout, "SafeBits' statistics exchange (MPI)")


def torch_distributed_group(process_group: Any) -> tuple[Any, int, int, torch.device]:
    """``(torch.distributed, rank, size, device)`` of a process group (None: the default group); the device is
    where its collectives need tensors: the current GPU under NCCL, else the CPU."""
    import torch.distributed as dist

    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(process_group) == "nccl" else torch.device("cpu"))
    return dist, dist.get_rank(process_group), dist.get_world_size(process_group), device


class TorchDistributedExchange(_RankExchange):
    """MAX-allreduce through ``torch.distributed`` (``all_reduce(..., op=MAX, async_op=True)``) on a process group
    (None: the default group), for the DDP front end (:mod:`.ddp`). Gloo reduces the vector in place; NCCL needs
    it on the GPU, so there it travels through a device copy and comes back at :meth:`wait`."""

    def __init__(self, process_group: Any = None, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        self._dist, self.rank, self.size, self.device = torch_distributed_group(process_group)
        self.process_group = process_group
        self.timeout = timeout

    def _reduce(self, values: np.ndarray) -> tuple[Any, torch.Tensor, np.ndarray]:
        if self.device.type == "cpu":
            tensor = torch.from_numpy(values)     # shares the vector's memory: reduced in place
        else:                                     # one pinned, non-blocking copy (the seam): float64 bits as int64
            tensor = host.upload(self.device, {"values": values.view(np.int64)})["values"].view(torch.float64)
        work = self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX, group=self.process_group, async_op=True)
        return work, tensor, values

    def _complete(self, handle: tuple[Any, torch.Tensor, np.ndarray]) -> None:
        work, tensor, values = handle
        wait_work(work, self.timeout, "SafeBits' statistics exchange (torch.distributed)")
        if self.device.type != "cpu":
            np.copyto(values, host.to_host(tensor))

    def _max_now(self, values: np.ndarray) -> np.ndarray:
        self._complete(self._reduce(values))
        return values

    def _start(self, values: np.ndarray) -> Any:
        return self._reduce(values)

    def wait(self, handle: Any) -> None:
        self._complete(handle)


def make_exchange(name: str, process_set: Any = None,
                  timeout: float | None = DEFAULT_TIMEOUT) -> LocalExchange | HorovodExchange | MPIExchange:
    """The transport for the current process (see the module docstring); ``process_set`` restricts it to a Horovod
    process set (None: every rank)."""
    hvd = horovod_if_initialized()
    if hvd is None:
        return LocalExchange()
    if process_set is not None and process_set != hvd.global_process_set:
        check_member(hvd, process_set)
        return LocalExchange() if process_set.size() == 1 else HorovodExchange(name, process_set, timeout)
    if hvd.size() == 1:
        return LocalExchange()
    if hvd.mpi_enabled():
        try:
            from mpi4py import MPI

            if MPI.Query_thread() >= MPI.THREAD_MULTIPLE and MPI.COMM_WORLD.Get_size() == hvd.size():
                return MPIExchange(timeout)
        except ImportError:
            pass
    return HorovodExchange(name, None, timeout)


def horovod_if_initialized() -> Any:
    """``horovod.torch`` when it is installed and initialized, else None."""
    try:
        import horovod.torch as hvd
    except ImportError:
        return None
    try:
        return hvd if hvd.is_initialized() else None
    except ValueError:                        # Horovod raises this when not initialized
        return None


def check_member(hvd: Any, process_set: Any) -> None:
    """``ValueError`` unless this rank belongs to ``process_set``: ranks outside it must not take part."""
    if not process_set.included():
        raise ValueError(f"rank {hvd.rank()} is not in the process set SafeBits was built for (ranks "
                         f"{process_set.ranks}); build and use SafeBits only on the ranks of its optimizer's "
                         f"process set")


def allocation_digest(step: int, budget_bits_total: float, choice: np.ndarray) -> str:
    """16 hex digits identifying one step's allocation (step, budget and every tensor's action)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.array([step], dtype=np.int64).tobytes())
    h.update(np.array([budget_bits_total], dtype=np.float64).tobytes())
    h.update(np.ascontiguousarray(choice, dtype=np.int64).tobytes())
    return h.hexdigest()


def check_agreement(reduced: Any, step: int, digest: str) -> None:
    """Raise :class:`SafeBitsConsistencyError` unless every rank allocated step ``step`` alike: the reduced
    statistics (``reduced.digest``, ``reduced.neg_digest``: the MAX and the MAX of the negation of each digest word)
    then give MAX - MIN = 0 for each word. ``digest``: this rank's, for the message."""
    if (reduced.digest + reduced.neg_digest).any():
        raise SafeBitsConsistencyError(
            f"ranks disagree on the allocation of step {step} (this rank's digest {digest}); every rank must build "
            f"SafeBits with the same parameters, menu, budget and thresholds")


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

    def check_length(self, length: int) -> None:
        check = getattr(self.inner, "check_length", None)
        if check is not None:
            check(length)

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
