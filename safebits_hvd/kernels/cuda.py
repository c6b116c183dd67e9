"""CUDA backend: ``cuda_kernels.cu`` + ``safebits_math.h`` compiled by NVRTC through CuPy.

:func:`cuda_source` is the exact translation unit; :func:`compile_nvrtc` compiles it to PTX with CuPy's NVRTC
bindings without needing a GPU (used by the tests to catch CUDA compile errors on CPU-only machines).
Tensors are shared with CuPy via DLPack and kernels run on PyTorch's current stream.
"""

from __future__ import annotations

import functools

import torch

from ..actions import Action, ActionKind, Menu
from ..wire import HEADER_BYTES, Header, WireFormatError
from .source import translation_unit

THREADS = 256
NVRTC_OPTIONS = ("--std=c++14", "--fmad=false", "--ftz=false", "--prec-div=true",
                 "--prec-sqrt=true")
"""No FMA contraction, IEEE division, no flush-to-zero: float results bit-identical to the C backend."""


def cuda_source() -> str:
    """The exact CUDA source: shared constants, ``safebits_math.h``, ``cuda_kernels.cu``."""
    return translation_unit("cuda_kernels.cu")


def compile_nvrtc(arch: str = "compute_80") -> str:
    """Compile :func:`cuda_source` with NVRTC (no GPU needed) and return the PTX.

    Raises ImportError when CuPy/NVRTC is not installed and RuntimeError (with the NVRTC log) on a
    compile error.
    """
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(cuda_source(), "safebits_cuda_kernels.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*NVRTC_OPTIONS, f"--gpu-architecture={arch}"])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed to compile the SafeBits CUDA kernels: {exc}\n{log}") from exc
        ptx = nvrtc.getPTX(prog)
        return ptx.decode() if isinstance(ptx, bytes) else ptx
    finally:
        nvrtc.destroyProgram(prog)


@functools.cache
def _module():
    import cupy

    return cupy.RawModule(code=cuda_source(), options=NVRTC_OPTIONS)


def _cp(t: torch.Tensor):
    import cupy

    return cupy.from_dlpack(t.detach())


def _launch(name: str, grid: int, args: tuple, device: torch.device) -> None:
    import cupy

    kernel = _module().get_function(name)
    with cupy.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        with stream:
            kernel((grid,), (THREADS,), args)


def _ints(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def quantize_ef(g: torch.Tensor | None, e: torch.Tensor, out: torch.Tensor, action: Action,
                key: int) -> torch.Tensor:
    import numpy as np

    n = e.numel()
    if n == 0:
        return torch.zeros(4, dtype=torch.float64, device=e.device)
    nb = -(-n // action.bucket_size)
    part = torch.empty((nb, 4), dtype=torch.float64, device=e.device)
    args = (_cp(g if g is not None else e), _cp(e), _cp(out), np.int32(g is not None), np.int64(n),
            np.int32(action.bucket_size), *_action_args(action), np.uint32(key & 0xFFFFFFFF), _cp(part))
    _launch("sb_quantize_ef_kernel", nb, args, e.device)
    return part.sum(dim=0)


def _action_args(action: Action) -> tuple:
    """kind, levels, stochastic, topk per bucket, trits: the kernels' per-action arguments (as in cpu.py)."""
    import numpy as np

    topk = action.topk_per_bucket if action.kind == ActionKind.TOPK else 0
    return (np.int32(action.kind), np.int32(action.levels), np.int32(action.stochastic), np.int32(topk),
            np.int32(action.packs_trits))


def quantize_pack_ef(g: torch.Tensor | None, e: torch.Tensor, payload: torch.Tensor, action: Action,
                     key: int, sent: torch.Tensor | None) -> torch.Tensor:
    """The fused packing pass into ``payload`` (header written, 16-byte aligned), and ``q`` into ``sent`` unless
    None; returns the statistics."""
    import numpy as np

    n = e.numel()
    if n == 0:
        return torch.zeros(4, dtype=torch.float64, device=e.device)
    payload[HEADER_BYTES:].zero_()              # the kernel ORs / adds the packed codes into zeroed words
    nb = -(-n // action.bucket_size)
    part = torch.empty((nb, 4), dtype=torch.float64, device=e.device)
    args = (_cp(g if g is not None else e), _cp(e), _cp(payload), _cp(sent if sent is not None else e),
            np.int32(g is not None), np.int32(sent is not None), np.int64(n),
            np.int32(action.bucket_size), *_action_args(action), np.uint32(key & 0xFFFFFFFF), _cp(part))
    _launch("sb_quantize_pack_ef_kernel", nb, args, e.device)
    return part.sum(dim=0)


def decode(payload: torch.Tensor, header: Header, out: torch.Tensor, accumulate: bool, name: str,
           divisor: float = 1.0) -> None:
    """``out = decode``, or ``out = (out + decode) / divisor``, of a payload whose header was validated (16-byte
    aligned)."""
    import numpy as np

    n = header.n
    if n == 0:
        return
    nb = -(-n // header.bucket_size)
    if header.kind == ActionKind.TOPK:          # check the indices first: a corrupt payload writes nothing
        bad = torch.full((1,), 2**31 - 1, dtype=torch.int32, device=out.device)
        _launch("sb_check_topk_kernel", -(-nb // THREADS),
                (_cp(payload), np.int64(n), np.int32(header.bucket_size), np.int32(header.topk), _cp(bad)),
                out.device)
        first_bad = int(bad.item())
        if first_bad != 2**31 - 1:
            raise WireFormatError(f"{name}: top-k bucket {first_bad} has local indices out of range or not "
                                  "ascending")
    args = (_cp(payload), _cp(out), np.int64(n), np.int32(header.bucket_size), np.int32(header.kind),
            np.int32(header.levels), np.int32(header.topk), np.int32(header.trits), np.int32(accumulate),
            np.float32(divisor))
    _launch("sb_decode_kernel", nb, args, out.device)


def screen(g: torch.Tensor | None, e: torch.Tensor, menu: Menu, key: int,
           buckets: torch.Tensor | None = None) -> torch.Tensor:
    import numpy as np

    n = e.numel()
    if n == 0:
        return torch.zeros((len(menu), 4), dtype=torch.float64, device=e.device)
    if buckets is None:
        buckets = torch.arange(-(-n // menu.bucket_size), dtype=torch.int64, device=e.device)
    buckets = buckets.to(device=e.device, dtype=torch.int64).contiguous()
    m = buckets.numel()
    if m == 0:
        return torch.zeros((len(menu), 4), dtype=torch.float64, device=e.device)
    part = torch.empty((m, len(menu), 4), dtype=torch.float64, device=e.device)
    kinds = _ints([int(a.kind) for a in menu], e.device)
    levels = _ints([a.levels for a in menu], e.device)
    stoch = _ints([int(a.stochastic) for a in menu], e.device)
    topks = _ints([a.topk_per_bucket if a.kind == ActionKind.TOPK else 0 for a in menu], e.device)
    trits = _ints([int(a.packs_trits) for a in menu], e.device)
    args = (_cp(g if g is not None else e), _cp(e), np.int32(g is not None), np.int64(n),
            np.int32(menu.bucket_size), _cp(buckets), np.int32(len(menu)), _cp(kinds), _cp(levels),
            _cp(stoch), _cp(topks), _cp(trits), np.uint32(key & 0xFFFFFFFF), _cp(part))
    _launch("sb_screen_kernel", m, args, e.device)
    return part.sum(dim=0)
