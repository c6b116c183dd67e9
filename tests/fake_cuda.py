"""A fake CUDA backend for CPU-only machines: the CUDA backend's own orchestration (``safebits_hvd.codec.kernels.cuda``)
runs on CPU tensors with its kernel launches recorded instead of run (``cuda.use_runtime``), and the C backend
computes the values. What ``safebits_hvd.codec.host`` counts under it (launches, uploads, reads) is what the CUDA
backend issues for the same step on a GPU; the values it computes there are checked bitwise against the C backend by the
GPU tests (``tests/test_cuda_kernels.py``, ``bench/gpu_check.sh``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from safebits_hvd.codec import kernels
from safebits_hvd.codec.kernels import cpu, cuda
from safebits_hvd.codec.kernels.cuda_emulator import HostRuntime


class RecordingRuntime(HostRuntime):
    """Records each launch's kernel name and grid on CPU tensors; runs nothing."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def launcher(self, device: torch.device) -> Iterator[cuda.Launch]:
        def launch(name: str, grid: int, args: tuple) -> None:
            self.launches.append((name, grid))

        yield launch


class FakeCuda:
    """A backend (``kernels.use_backend``) named ``"cuda"``: each call issues what the CUDA backend issues, then
    returns the C backend's values (which the CUDA backend's equal bitwise)."""

    NAME, PACKS_GROUPS, ON_HOST, TAKES_ADDRESSES = cuda.NAME, cuda.PACKS_GROUPS, cuda.ON_HOST, cuda.TAKES_ADDRESSES

    def __init__(self) -> None:
        self.runtime = RecordingRuntime()

    def __getattr__(self, name: str) -> Any:
        issued, computed = getattr(cuda, name), getattr(cpu, name)

        def call(*args: Any) -> Any:
            with cuda.use_runtime(self.runtime):
                issued(*args)
            return computed(*args)

        return call

    def receive_group(self, gathered: torch.Tensor, rows: Any, expected: Any, outs: list[torch.Tensor], own: Any,
                      tables: kernels.GroupTables, divisor: float, error: torch.Tensor) -> None:
        """Issued as the CUDA backend issues it; the values from the payloads located on the host (from the CPU
        tensor's own bytes: not a crossing) and decoded by the C backend."""
        with cuda.use_runtime(self.runtime):
            cuda.receive_group(gathered, rows, expected, outs, own, tables, divisor, error)
        names = [f"member {k}" for k in range(len(outs))]
        with kernels.use_backend(cpu):
            payloads, actions = kernels.locate_payloads(gathered, rows, expected, tables, names, "a group",
                                                        data=gathered.numpy())
            kernels.decode_group(payloads, actions, outs, own, tables, rows[:, 0], names, divisor)


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeCuda]:
    """SafeBits' kernels through :class:`FakeCuda` inside the block."""
    backend = FakeCuda()
    with kernels.use_backend(backend):
        yield backend
