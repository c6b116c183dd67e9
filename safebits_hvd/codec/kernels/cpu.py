"""CPU backend: compiles ``cpu.c`` (with ``safebits_math.h``) once per source version and calls it via ctypes.

The same shared object carries ``pack.c`` (the packed wire format: the fused packing pass and the decoder, see
:mod:`safebits_hvd.codec.wire`) and ``allocator.c``, the compiled convex-hull greedy of
:mod:`safebits_hvd.policy.allocator`.

The shared object lives in ``${SAFEBITS_CACHE:-~/.cache/safebits}/kernels/<sha256>.so``, where the hash covers
the full source text (RNG defines + header + cpu.c), the compiler path and the flags. It is built under a
temporary name and moved into place with :func:`os.replace`, so concurrent processes (two Horovod ranks) never
load a half-written file. Needs a C compiler with OpenMP: ``$CC``, else ``cc``, else ``gcc``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..actions import Action, ActionKind, Menu
from ..wire import HEADER_BYTES, Header, WireFormatError
from .groups import GroupOutput, PackResult
from .source import translation_unit
from .tensors import addresses, element_counts

NAME = "c"
"""The backend's name (:func:`safebits_hvd.codec.kernels.backend_name`)."""
PACKS_GROUPS = True
"""``pack_group`` and ``decode_group`` pass over every member of a group in one call (``group.c``)."""
ON_HOST = True
"""Results are host memory; ``kernels.pack_group`` counts the one read a device backend would make."""
TAKES_ADDRESSES = True
"""``decode_group`` takes each payload's address (no tensor view made per payload)."""

HERE = Path(__file__).resolve().parent
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def compiler() -> str | None:
    """The C compiler to use, or None when there is none."""
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return shutil.which(cc)
    for name in ("cc", "gcc"):
        path = shutil.which(name)
        if path:
            return path
    return None


def source() -> str:
    """The exact C translation unit: shared constants, ``safebits_math.h``, ``cpu.c``, ``pack.c``, ``group.c``,
    ``allocator.c``."""
    return translation_unit("cpu.c") + "".join(f'\n#line 1 "{name}"\n' + (HERE / name).read_text()
                                               for name in ("pack.c", "group.c", "allocator.c"))


def cache_dir() -> Path:
    root = os.environ.get("SAFEBITS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "safebits")
    return Path(root) / "kernels"


def build(extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile (if not cached) and return the path of the shared object. Raises RuntimeError on failure.
    ``extra_flags``: added to :data:`CFLAGS` (the tests build each target of the runtime dispatch this way)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC or install cc/gcc)")
    return build_cached(source(), cc, (*CFLAGS, *extra_flags), "safebits_cpu.c", "", "the SafeBits CPU kernels")


def build_cached(src: str, cc: str, flags: tuple[str, ...], filename: str, prefix: str, what: str) -> Path:
    """``src`` (written to ``filename``) compiled by ``cc`` with ``flags`` into a shared object in :func:`cache_dir`,
    named ``prefix`` and the hash of all three, unless it is there already; RuntimeError with the compiler's
    message on failure. Built in a temporary folder and moved in whole, so a concurrent build never sees half."""
    digest = hashlib.sha256("\0".join([src, cc, *flags]).encode()).hexdigest()
    out_dir = cache_dir()
    target = out_dir / f"{prefix}{digest}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        path = Path(tmp) / filename
        path.write_text(src)
        built = Path(tmp) / target.name
        proc = subprocess.run([cc, *flags, "-o", str(built), str(path)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {what} with {cc} failed:\n{proc.stderr[-4000:]}")
        os.replace(built, target)
    return target


def load() -> ctypes.CDLL:
    """The loaded library (built on first use)."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = bind(ctypes.CDLL(str(build())))
        return _lib


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the argument and return types of a built library's functions; returns it."""
    p, i64, i32, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32
    lib.sb_quantize_ef.argtypes = [p, p, p, i64, i64, i32, i32, i32, i32, i32, u32, p, i32]
    lib.sb_quantize_ef.restype = i32
    lib.sb_quantize_pack_ef.argtypes = [p, p, p, p, i64, i64, i32, i32, i32, i32, i32, u32, p, i32]
    lib.sb_quantize_pack_ef.restype = i32
    lib.sb_decode.argtypes = [p, p, i64, i64, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    lib.sb_decode.restype = i32
    lib.sb_screen.argtypes = [p, p, i64, i64, p, i64, i32, p, p, p, p, p, u32, p, i32]
    lib.sb_screen.restype = i32
    lib.sb_pack_group.argtypes = [i32, p, p, p, p, p, p, p, p, i64, i32, p, p, p, p, p, p, p, p, i32, i32, i32,
                                  i32, ctypes.c_double, ctypes.c_double, p, p, p, i64, p, p, p, p, p, i32,
                                  i32]
    lib.sb_pack_group.restype = i32
    lib.sb_decode_group.argtypes = [i32, i32, p, p, p, p, p, p, i64, p, p, p, p, ctypes.c_float, i32]
    lib.sb_decode_group.restype = i32
    lib.sb_allocate.argtypes = [p, p, i64, i32, i64, p, p, p]
    lib.sb_allocate.restype = i32
    lib.sb_allocate_workspace_bytes.argtypes = [i64, i32]
    lib.sb_allocate_workspace_bytes.restype = i64
    return lib


def available() -> bool:
    try:
        load()
    except (RuntimeError, OSError):
        return False
    return True


_workspace = threading.local()

# sb_allocate's return codes (allocator.c) that are errors, and what they mean for the caller.
_ALLOCATE_ERRORS = {
    -1: "too many tensors x actions for the compiled allocator (over 2^30 hull edges)",
    -2: "every tensor needs at least one admissible action (the lossless one)",
    -3: "costs must be >= 0 and below 2^53 bits",
    -4: "errors of admissible actions must be >= 0 (squared errors), not negative or NaN",
    -5: "the tensors' largest costs add up to 2^62 bits or more",
}


def allocate(costs: np.ndarray, err: np.ndarray, budget_bits: int) -> tuple[np.ndarray, int, bool]:
    """``allocator.c``: the convex-hull greedy on C-contiguous int64 ``costs`` and float64 ``err`` (+inf marks an
    inadmissible action), ``(tensors, actions)``, for an integer budget in bits. Raises ``ValueError`` on bad input.

    Returns ``(choice, min_cost_bits, feasible)``."""
    lib = load()
    if not (costs.flags.c_contiguous and err.flags.c_contiguous and costs.dtype == np.int64
            and err.dtype == np.float64 and costs.ndim == 2 and costs.shape == err.shape):
        raise ValueError("sb_allocate needs C-contiguous int64 costs and float64 errors of one 2-D shape")
    tensors, actions = costs.shape
    need = lib.sb_allocate_workspace_bytes(tensors, actions)
    work = getattr(_workspace, "buffer", None)
    if work is None or work.nbytes < need:      # one per thread, grown when needed, reused every step
        work = _workspace.buffer = np.empty(-(-need // 8), dtype=np.int64)
    out = np.empty(tensors + 1, dtype=np.int64)          # choice, then the minimum cost
    address = out.__array_interface__["data"][0]
    rc = lib.sb_allocate(costs.__array_interface__["data"][0], err.__array_interface__["data"][0], tensors,
                         actions, budget_bits, address, address + 8 * tensors, work.__array_interface__["data"][0])
    if rc < 0:
        raise ValueError(_ALLOCATE_ERRORS.get(rc, f"sb_allocate failed with code {rc}"))
    return out[:tensors], int(out[tensors]), rc == 0


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _action_args(a: Action) -> tuple[int, int, int, int, int]:
    """The kernels' per-action arguments: kind, levels, stochastic, topk per bucket, trits."""
    topk = a.topk_per_bucket if a.kind == ActionKind.TOPK else 0
    return int(a.kind), int(a.levels), int(bool(a.stochastic)), int(topk), int(a.packs_trits)


@functools.lru_cache(maxsize=64)
def _menu_args(menu: Menu) -> tuple[torch.Tensor, ...]:
    """Per-action kernel arguments of a menu as five int32 arrays (see :func:`_action_args`); built once."""
    args = [_action_args(a) for a in menu]
    return tuple(torch.tensor([x[c] for x in args], dtype=torch.int32) for c in range(5))


def quantize_ef(g: torch.Tensor | None, e: torch.Tensor, out: torch.Tensor, action: Action,
                key: int) -> torch.Tensor:
    lib = load()
    stats = torch.empty(4, dtype=torch.float64)           # the C code zeroes it
    rc = lib.sb_quantize_ef(_ptr(g), e.data_ptr(), out.data_ptr(), e.numel(), action.bucket_size,
                            *_action_args(action), key & 0xFFFFFFFF, stats.data_ptr(),
                            torch.get_num_threads())
    if rc != 0:
        raise MemoryError("sb_quantize_ef: out of memory")
    return stats


def quantize_pack_ef(g: torch.Tensor | None, e: torch.Tensor, payload: torch.Tensor, action: Action,
                     key: int, into: torch.Tensor | None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``pack.c``'s fused packing pass into ``payload`` (header already written), and ``q`` into ``into`` unless
    None; returns the statistics. ``lib``: another build of the kernels (:func:`build`, :func:`bind`)."""
    lib = lib or load()
    stats = torch.empty(4, dtype=torch.float64)           # the C code zeroes it
    rc = lib.sb_quantize_pack_ef(_ptr(g), e.data_ptr(), payload.data_ptr() + HEADER_BYTES, _ptr(into), e.numel(),
                                 action.bucket_size, *_action_args(action), key & 0xFFFFFFFF, stats.data_ptr(),
                                 torch.get_num_threads())
    if rc != 0:
        raise MemoryError("sb_quantize_pack_ef: out of memory")
    return stats


def decode(payload: torch.Tensor, header: Header, out: torch.Tensor, accumulate: bool, name: str,
           divisor: float = 1.0) -> None:
    """``pack.c``'s decoder: ``out = decode``, or ``out = (out + decode) / divisor``, of a payload whose header was
    validated."""
    lib = load()
    rc = lib.sb_decode(payload.data_ptr() + HEADER_BYTES, out.data_ptr(), header.n, header.bucket_size,
                       int(header.kind), header.levels, header.topk, int(header.trits), int(accumulate), divisor,
                       torch.get_num_threads())
    if rc == -1:
        raise MemoryError("sb_decode: out of memory")
    if rc <= -2:
        raise WireFormatError(f"{name}: top-k bucket {-2 - rc} has local indices out of range or not ascending")


def screen(g: torch.Tensor | None, e: torch.Tensor, menu: Menu, key: int,
           buckets: torch.Tensor | None = None) -> torch.Tensor:
    lib = load()
    arrays = _menu_args(menu)
    stats = torch.empty((len(menu), 4), dtype=torch.float64)    # the C code zeroes it
    nsel = 0 if buckets is None else buckets.numel()
    rc = lib.sb_screen(_ptr(g), e.data_ptr(), e.numel(), menu.bucket_size, _ptr(buckets), nsel, len(menu),
                       *(a.data_ptr() for a in arrays), key & 0xFFFFFFFF, stats.data_ptr(),
                       torch.get_num_threads())
    if rc != 0:
        raise MemoryError("sb_screen: out of memory")
    return stats


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def pack_group(request: Any, tables: Any) -> Any:
    """``group.c``'s ``sb_pack_group`` over the members of ``request``
    (:class:`~safebits_hvd.codec.kernels.PackRequest`); returns a :class:`~safebits_hvd.codec.kernels.PackResult`."""
    lib = load()
    members = np.ascontiguousarray(request.members, dtype=np.int64)
    m, nact = len(members), tables.actions
    samples = request.samples
    nsel = element_counts(samples)
    numels = np.ascontiguousarray(tables.numels[members])
    keys = np.ascontiguousarray(request.keys, dtype=np.uint32)
    allocated = np.ascontiguousarray(request.allocated, dtype=np.int32)
    capacity = int(tables.largest_payload_bytes[members].sum()) if request.output == GroupOutput.PAYLOAD else 0
    buffer = torch.empty(capacity, dtype=torch.uint8)
    finite = np.empty(m, dtype=np.uint8)
    screen_stats = np.zeros((m, nact, 4))
    chosen = np.empty(m, dtype=np.int32)
    offsets = np.empty(m + 1, dtype=np.int64)
    stats = np.empty((m, 4))
    tables_arguments = _tables_arguments(tables)
    # Every array must outlive the call: an address alone does not keep its array alive.
    grads, residuals, intos = addresses(request.grads), addresses(request.residuals), addresses(request.intos)
    sample_pointers = addresses(samples)
    rc = lib.sb_pack_group(
        m, _address(members), _address(grads), _address(residuals), _address(intos), _address(numels),
        _address(sample_pointers), _address(nsel), _address(keys), tables.menu.bucket_size, nact,
        *tables_arguments[:5], _address(allocated), *tables_arguments[5:7], tables.lossless_index,
        int(request.check_finite), int(request.do_screen), int(request.screen_enabled), request.rule.max_distortion,
        request.rule.min_cosine, *tables_arguments[7:], buffer.data_ptr(), capacity, _address(finite),
        _address(screen_stats), _address(chosen), _address(offsets), _address(stats), int(request.output),
        torch.get_num_threads())
    if rc == -1:
        raise MemoryError("sb_pack_group: out of memory")
    if rc != 0:
        raise RuntimeError(f"sb_pack_group failed with code {rc}")
    return PackResult(buffer[:int(offsets[-1])], finite.astype(bool), screen_stats, chosen.astype(np.int64),
                     offsets, stats)


def _tables_arguments(tables: Any) -> tuple[int, ...]:
    """The addresses ``sb_pack_group`` takes of a core's :class:`~safebits_hvd.codec.kernels.GroupTables` (the menu's
    five per-action arrays, the cost order, the lossless flags, the payload bytes and the headers), made once."""
    made = tables.backend_arguments.get("c")
    if made is None:
        arrays = _menu_args(tables.menu)      # kept with the addresses: the cache may drop its own reference
        made = tables.backend_arguments["c"] = (arrays, (
            *(a.data_ptr() for a in arrays), _address(tables.cost_order), _address(tables.lossless),
            _address(tables.payload_bytes), _address(tables.headers)))
    return made[1]


def decode_group(bodies: list[torch.Tensor] | np.ndarray, body_bytes: np.ndarray, actions: np.ndarray,
                 outs: list[torch.Tensor], numels: np.ndarray, own: np.ndarray, ranks: int, menu: Menu,
                 divisor: float) -> int:
    """``group.c``'s ``sb_decode_group``; ``bodies``: the payloads, or their addresses (int64); returns -1 or the
    first slot (member * ranks + rank) whose top-k indices are invalid."""
    lib = load()
    arrays = _menu_args(menu)
    body_pointers = (bodies if isinstance(bodies, np.ndarray) else addresses(bodies)) + HEADER_BYTES
    body_bytes = np.ascontiguousarray(body_bytes, dtype=np.int64)
    actions = np.ascontiguousarray(actions, dtype=np.int32)
    numels = np.ascontiguousarray(numels, dtype=np.int64)
    own = np.ascontiguousarray(own, dtype=np.int32)
    outs_pointers = addresses(outs)
    rc = lib.sb_decode_group(len(outs), ranks, _address(body_pointers), _address(body_bytes), _address(actions),
                             _address(outs_pointers), _address(numels), _address(own), menu.bucket_size,
                             arrays[0].data_ptr(), arrays[1].data_ptr(), arrays[3].data_ptr(), arrays[4].data_ptr(),
                             divisor, torch.get_num_threads())
    if rc == -1:
        raise MemoryError("sb_decode_group: out of memory")
    return -1 if rc == 0 else -2 - rc
