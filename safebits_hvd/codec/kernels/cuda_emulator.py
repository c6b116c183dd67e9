"""The CUDA kernels run on the CPU: the exact translation unit of the CUDA backend (:func:`.cuda.cuda_source`)
compiled as C++ behind ``cuda_emulator.h`` (blocks one after another, their threads as fibers that switch at
``__syncthreads``), and :class:`EmulatedRuntime`, a :class:`.cuda.Runtime` that launches them on CPU tensors.

With it the CUDA backend's whole orchestration and its kernels run without a GPU, bit for bit as on one (IEEE
arithmetic without contraction, as the NVRTC options ask), so CI checks them against the C backend
(``tests/test_cuda_emulated.py``). It is slow (a fiber switch per thread per barrier): small inputs only.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from . import cpu, cuda

HERE = Path(__file__).resolve().parent
CXXFLAGS = ("-std=c++17", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-shared", "-w")
"""No FMA contraction, IEEE arithmetic (no -ffast-math): the float results of cuda.NVRTC_OPTIONS."""

_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\(\w+\)\s*)?(\w+)\s*\(([^)]*)\)')
_CTYPES = {"int": ctypes.c_int, "unsigned int": ctypes.c_uint, "unsigned": ctypes.c_uint,
           "long long": ctypes.c_longlong, "float": ctypes.c_float, "double": ctypes.c_double}


def kernels() -> dict[str, list[tuple[str, str]]]:
    """Every kernel of ``cuda_kernels.cu``: its name and its parameters as (type, name), in order."""
    found = {}
    for name, params in _KERNEL.findall((HERE / "cuda_kernels.cu").read_text()):
        pairs = []
        for param in " ".join(params.split()).split(","):
            kind, _, pname = param.strip().rpartition(" ")
            if pname.startswith("*"):
                kind, pname = kind + " *", pname.lstrip("*")
            pairs.append((kind.strip(), pname))
        found[name] = pairs
    return found


def source() -> str:
    """The emulation header, the CUDA translation unit, and one ``emu_<kernel>(grid, arguments...)`` per kernel."""
    wrappers = []
    for name, params in kernels().items():
        declared = ", ".join(f"{kind} {pname}" for kind, pname in params)
        passed = ", ".join(pname for _, pname in params)
        wrappers.append(f'extern "C" void emu_{name}(long long grid, {declared}) '
                        f'{{ sb_emu_run(grid, [=]() {{ {name}({passed}); }}); }}\n')
    return (HERE / "cuda_emulator.h").read_text() + cuda.cuda_source() + "\n" + "".join(wrappers)


def _argtype(kind: str) -> type:
    return ctypes.c_void_p if kind.endswith("*") else _CTYPES[kind.replace("const ", "")]


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled emulation (cached by the hash of its source, beside the C backend's objects)."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (c++ or g++): the CUDA emulation needs one")
    target = cpu.build_cached(source(), compiler, CXXFLAGS, "safebits_cuda_emulated.cpp", "cuda-emulator-",
                              "the CUDA emulation")
    lib = ctypes.CDLL(str(target))
    for name, params in kernels().items():
        function = getattr(lib, f"emu_{name}")
        function.argtypes = [ctypes.c_longlong, *(_argtype(kind) for kind, _ in params)]
        function.restype = None
    return lib


class HostRuntime(cuda.Runtime):
    """A runtime whose "device" is the host: CPU tensors' addresses stand for device addresses."""

    def address(self, t: torch.Tensor) -> np.uint64:
        if t.device.type != "cpu":
            raise TypeError(f"this runtime takes CPU tensors, got one on {t.device}")
        return np.uint64(t.data_ptr())


class EmulatedRuntime(HostRuntime):
    """Launches the emulated kernels on CPU tensors; counts nothing itself (``cuda.py`` counts its launches through
    ``safebits_hvd.codec.host``)."""

    def __init__(self) -> None:
        self.lib = library()
        self.launches: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def launcher(self, device: torch.device) -> Iterator[cuda.Launch]:
        def launch(name: str, grid: int, args: tuple) -> None:
            self.launches.append((name, grid))
            getattr(self.lib, f"emu_{name}")(int(grid), *(a.item() if isinstance(a, np.generic) else a
                                                          for a in args))

        yield launch


@contextlib.contextmanager
def emulated() -> Iterator[EmulatedRuntime]:
    """Inside the block, ``safebits_hvd.codec.kernels.cuda``'s functions run their kernels emulated on CPU tensors."""
    runtime = EmulatedRuntime()
    with cuda.use_runtime(runtime):
        yield runtime


class EmulatedCuda:
    """A kernel backend (``kernels.use_backend``) named ``"cuda"``: ``safebits_hvd.codec.kernels.cuda``'s functions with
    their kernels emulated, on CPU tensors."""

    NAME, PACKS_GROUPS, ON_HOST, TAKES_ADDRESSES = cuda.NAME, cuda.PACKS_GROUPS, cuda.ON_HOST, cuda.TAKES_ADDRESSES

    def __init__(self) -> None:
        self.runtime = EmulatedRuntime()

    def __getattr__(self, name: str):
        function = getattr(cuda, name)
        if not callable(function):
            return function

        def emulated_call(*args, **kwargs):
            with cuda.use_runtime(self.runtime):
                return function(*args, **kwargs)

        return emulated_call


@contextlib.contextmanager
def as_backend() -> Iterator[EmulatedCuda]:
    """Inside the block, SafeBits' kernels run through the CUDA backend, emulated, on CPU tensors."""
    from . import use_backend

    backend = EmulatedCuda()
    with use_backend(backend):
        yield backend
