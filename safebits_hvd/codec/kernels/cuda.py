"""CUDA backend: ``cuda_kernels.cu`` + ``safebits_math.h`` compiled by NVRTC through CuPy.

:func:`cuda_source` is the exact translation unit; :func:`compile_nvrtc` compiles it to PTX with CuPy's NVRTC
bindings without needing a GPU (used by the tests to catch CUDA compile errors on CPU-only machines).
Kernels get the tensors' device addresses and run on PyTorch's current stream.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import host
from ..actions import Action, ActionKind, Menu
from ..wire import HEADER_BYTES, Header, WireFormatError
from .groups import GroupOutput, PackResult
from .source import translation_unit
from .tensors import TensorList, addresses

NAME = "cuda"
"""The backend's name (:func:`safebits_hvd.codec.kernels.backend_name`)."""
PACKS_GROUPS = True
"""``pack_group``, ``decode_group`` and ``receive_group`` launch one set of kernels per group."""
ON_HOST = False
"""Results are device memory: reads back go through the host seam, counted here; a gathered group is located and
decoded on the device (``receive_group``)."""
TAKES_ADDRESSES = False

THREADS = 256
GATHER_CHUNK = 4096
"""Bytes per block of ``sb_gather_kernel`` (its ``chunk`` argument)."""
NVRTC_OPTIONS = ("--std=c++14", "--fmad=false", "--ftz=false", "--prec-div=true",
                 "--prec-sqrt=true")
"""No FMA contraction, IEEE division, no flush-to-zero: float results bit-identical to the C backend."""


def cuda_source() -> str:
    """The exact CUDA source: shared constants, ``safebits_math.h``, ``cuda_kernels.cu``."""
    return translation_unit("cuda_kernels.cu")


@contextlib.contextmanager
def nvrtc_compiled(*options: str) -> Iterator[Any]:
    """:func:`cuda_source` compiled by NVRTC (no GPU needed) with :data:`NVRTC_OPTIONS` and ``options``: the NVRTC
    program, alive until the block ends. Raises ImportError when CuPy/NVRTC is not installed and RuntimeError (with
    the NVRTC log) on a compile error."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(cuda_source(), "safebits_cuda_kernels.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*NVRTC_OPTIONS, *options])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed to compile the SafeBits CUDA kernels: {exc}\n{log}") from exc
        yield prog
    finally:
        nvrtc.destroyProgram(prog)


def compile_nvrtc(arch: str = "compute_80") -> str:
    """:func:`cuda_source` compiled to PTX for ``arch`` (:func:`nvrtc_compiled`)."""
    from cupy_backends.cuda.libs import nvrtc

    with nvrtc_compiled(f"--gpu-architecture={arch}") as prog:
        ptx = nvrtc.getPTX(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


class _Stream(NamedTuple):
    """A CUDA stream as CuPy's kernel launch takes it (it reads ``ptr`` only): PyTorch's current stream."""

    ptr: int


@functools.cache
def _module(device_index: int) -> Any:
    """The kernels of :func:`cuda_source`, compiled once per device for its architecture and loaded in its
    context. Compiled here rather than by ``cupy.RawModule``, which appends ``-ftz=true`` after the caller's
    options and would flush float32 subnormals to zero (the C backend keeps them)."""
    from cupy.cuda import Device, function

    major, minor = torch.cuda.get_device_capability(device_index)
    try:
        ptx = compile_nvrtc(f"compute_{major}{minor}")
    except RuntimeError:          # an NVRTC older than the device: PTX of an older architecture, JIT-compiled on load
        ptx = compile_nvrtc()
    module = function.Module()
    with Device(device_index):
        module.load(ptx.encode())
    return module


@functools.cache
def _function(name: str, device_index: int) -> Any:
    return _module(device_index).get_function(name)


Launch = Callable[[str, int, tuple], None]
"""``launch(kernel name, blocks, arguments)``: one kernel launch."""


class Runtime:
    """Where this backend's kernels run: CuPy's launch of the NVRTC-compiled kernels on PyTorch's current stream.
    :func:`use_runtime` swaps it, so that a test can drive this module's orchestration (its launches, uploads and
    reads, counted by :mod:`safebits_hvd.codec.host`) on CPU tensors without a GPU."""

    def address(self, t: torch.Tensor) -> np.uint64:
        """A tensor as a kernel argument: its device address. A DLPack exchange per argument instead took more
        host time than the kernels of the step on a GPU (docs/RESULTS.md, "On a GPU")."""
        if not t.is_cuda:
            raise TypeError(f"the CUDA kernels take CUDA tensors, got one on {t.device}")
        return np.uint64(t.data_ptr())

    @contextlib.contextmanager
    def launcher(self, device: torch.device) -> Iterator[Launch]:
        """Launches on ``device``, on PyTorch's current stream there. The device is entered and the stream looked
        up once per group of tensors: a lookup per launch was host time the kernels did not need."""
        from cupy.cuda import Device

        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = _Stream(torch.cuda.current_stream(index).cuda_stream)

        def launch(name: str, grid: int, args: tuple) -> None:
            _function(name, index)((grid,), (THREADS,), args, stream=stream)

        with Device(index):
            yield launch


_runtime = Runtime()


@contextlib.contextmanager
def use_runtime(runtime: Runtime) -> Iterator[None]:
    """Run this module's kernels through ``runtime`` inside the block (see :class:`Runtime`)."""
    global _runtime
    previous, _runtime = _runtime, runtime
    try:
        yield
    finally:
        _runtime = previous


def _ptr(t: torch.Tensor) -> np.uint64:
    return _runtime.address(t)


@contextlib.contextmanager
def _launcher(device: torch.device) -> Iterator[Launch]:
    """The runtime's launches on ``device``, each counted (:func:`safebits_hvd.codec.host.launched`)."""
    with _runtime.launcher(device) as launch:
        def counted(name: str, grid: int, args: tuple) -> None:
            host.launched()
            launch(name, grid, args)

        yield counted


def _launch(name: str, grid: int, args: tuple, device: torch.device) -> None:
    """One launch on its own (the per-tensor kernels)."""
    with _launcher(device) as launch:
        launch(name, grid, args)


def quantize_ef(g: torch.Tensor | None, e: torch.Tensor, out: torch.Tensor, action: Action,
                key: int) -> torch.Tensor:
    n = e.numel()
    if n == 0:
        return torch.zeros(4, dtype=torch.float64, device=e.device)
    nb = -(-n // action.bucket_size)
    part = torch.empty((nb, 4), dtype=torch.float64, device=e.device)
    args = (_ptr(g if g is not None else e), _ptr(e), _ptr(out), np.int32(g is not None), np.int64(n),
            np.int32(action.bucket_size), *_action_args(action), np.uint32(key & 0xFFFFFFFF), _ptr(part))
    _launch("sb_quantize_ef_kernel", nb, args, e.device)
    return _summed(part)[0]


def _action_args(action: Action) -> tuple:
    """kind, levels, stochastic, topk per bucket, trits: the kernels' per-action arguments (as in cpu.py)."""
    topk = action.topk_per_bucket if action.kind == ActionKind.TOPK else 0
    return (np.int32(action.kind), np.int32(action.levels), np.int32(action.stochastic), np.int32(topk),
            np.int32(action.packs_trits))


def quantize_pack_ef(g: torch.Tensor | None, e: torch.Tensor, payload: torch.Tensor, action: Action,
                     key: int, into: torch.Tensor | None) -> torch.Tensor:
    """The fused packing pass into ``payload`` (header written, 16-byte aligned), and ``q`` into ``into`` unless
    None; returns the statistics."""
    n = e.numel()
    if n == 0:
        return torch.zeros(4, dtype=torch.float64, device=e.device)
    payload[HEADER_BYTES:].zero_()              # the kernel ORs / adds the packed codes into zeroed words
    nb = -(-n // action.bucket_size)
    part = torch.empty((nb, 4), dtype=torch.float64, device=e.device)
    args = (_ptr(g if g is not None else e), _ptr(e), _ptr(payload), _ptr(into if into is not None else e),
            np.int32(g is not None), np.int32(into is not None), np.int64(n),
            np.int32(action.bucket_size), *_action_args(action), np.uint32(key & 0xFFFFFFFF), _ptr(part))
    _launch("sb_quantize_pack_ef_kernel", nb, args, e.device)
    return _summed(part)[0]


def decode(payload: torch.Tensor, header: Header, out: torch.Tensor, accumulate: bool, name: str,
           divisor: float = 1.0) -> None:
    """``out = decode``, or ``out = (out + decode) / divisor``, of a payload whose header was validated (16-byte
    aligned)."""
    n = header.n
    if n == 0:
        return
    nb = -(-n // header.bucket_size)
    if header.kind == ActionKind.TOPK:          # check the indices first: a corrupt payload writes nothing
        bad = torch.full((1,), 2**31 - 1, dtype=torch.int32, device=out.device)
        _launch("sb_check_topk_kernel", -(-nb // THREADS),
                (_ptr(payload), np.int64(n), np.int32(header.bucket_size), np.int32(header.topk), _ptr(bad)),
                out.device)
        first_bad = int(host.to_host(bad)[0])
        if first_bad != 2**31 - 1:
            raise WireFormatError(f"{name}: top-k bucket {first_bad} has local indices out of range or not "
                                  "ascending")
    args = (_ptr(payload), _ptr(out), np.int64(n), np.int32(header.bucket_size), np.int32(header.kind),
            np.int32(header.levels), np.int32(header.topk), np.int32(header.trits), np.int32(accumulate),
            np.float32(divisor))
    _launch("sb_decode_kernel", nb, args, out.device)


def screen(g: torch.Tensor | None, e: torch.Tensor, menu: Menu, key: int,
           buckets: torch.Tensor | None = None) -> torch.Tensor:
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
    args = (_ptr(g if g is not None else e), _ptr(e), np.int32(g is not None), np.int64(n),
            np.int32(menu.bucket_size), _ptr(buckets), np.int32(len(menu)),
            *(_ptr(a) for a in _menu_arrays(menu, e.device)), np.uint32(key & 0xFFFFFFFF), _ptr(part))
    _launch("sb_screen_kernel", m * len(menu), args, e.device)
    return _summed(part)


def _summed(part: torch.Tensor) -> torch.Tensor:
    """``part`` (rows, width, 4 float64) summed over its rows in the statistics' shared order
    (``sb_segment_sum_kernel`` over one range; safebits_math.h, ``SB_STAT_PARTIALS``): bitwise the C backend's."""
    rows, width = part.shape[0], part.numel() // (4 * part.shape[0])
    out = torch.empty((width, 4), dtype=torch.float64, device=part.device)
    _launch("sb_segment_sum_kernel", width, (_ptr(part), np.uint64(0), np.int64(rows), np.int32(width), _ptr(out)),
            part.device)
    return out


# ---------------------------------------------------------------------------------------------- groups of tensors
# The batched step on the GPU (cuda_kernels.cu, "groups of tensors"): every pass is one launch over all members of
# a group, on PyTorch's current stream, and the results come back with ONE read (safebits_hvd.codec.host).

_INT_MAX = 2**31 - 1


@functools.lru_cache(maxsize=64)
def _menu_arrays(menu: Menu, device: torch.device) -> tuple[torch.Tensor, ...]:
    """kinds, levels, stochastic, topks, trits of every action (int32 on ``device``): copied once per menu."""
    args = np.array([[int(x) for x in _action_args(a)] for a in menu], dtype=np.int32)
    return tuple(host.to_device(np.ascontiguousarray(args[:, c]), device) for c in range(5))


def _prefix(sizes: np.ndarray) -> np.ndarray:
    """``[0, s0, s0 + s1, ...]`` (int64): the ranges the group kernels' blocks search."""
    out = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=out[1:])
    return out


def _split(flat: Any, spans: dict[str, int]) -> dict[str, Any]:
    """Consecutive slices of ``flat`` (a tensor or an array), one per name, of the sizes ``spans`` lists."""
    bounds = _prefix(np.fromiter(spans.values(), dtype=np.int64, count=len(spans)))
    return {name: flat[int(lo):int(hi)] for name, lo, hi in zip(spans, bounds[:-1], bounds[1:], strict=True)}


def _grid(threads: int) -> int:
    return -(-threads // THREADS)


class _Plan(NamedTuple):
    """What a group's send needs that changes only with its layout (its members, their residuals and samples, what
    it writes), built once and kept (docs/DESIGN.md, "Host and device"): the layout's host arrays, the staging
    memory, and the layout's columns on the device. ``held``: the residual and sample lists whose identity keys the
    plan (kept alive, so that no other list takes their ``id``)."""

    held: tuple
    bucket_off: np.ndarray
    pair_off: np.ndarray
    largest: np.ndarray
    capacity: int
    stage_off: np.ndarray
    gather_off: np.ndarray
    stage: torch.Tensor
    layout: dict[str, torch.Tensor]


_PLANS = 64
"""Plans kept: each holds its group's staging memory on the device."""
_plans: dict[tuple, _Plan] = {}


def _plan_of(request: Any, tables: Any, members: np.ndarray, device: torch.device) -> _Plan:
    """The plan of ``request``'s layout: kept when its residuals and samples are the core's lists of the group
    (``kernels.TensorList``, the same objects step after step while the residuals stay where they are), else made
    for this call. The staging memory is reused step after step on one stream, so the stream is part of the key."""
    key = None
    if isinstance(request.residuals, TensorList) and isinstance(request.samples, TensorList):
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (id(tables), id(request.residuals), id(request.samples), device, stream, int(request.output),
               bool(request.do_screen), members.tobytes())
        plan = _plans.get(key)
        if plan is not None:
            return plan
    bucket = tables.menu.bucket_size
    numels = tables.numels[members]
    bucket_off = _prefix(-(-numels // bucket))
    # The core keeps its samples on the device (a host one would be copied here, synchronously).
    samples = [None if s is None else s.to(device=device, dtype=torch.int64).contiguous() for s in request.samples]
    pairs = np.array([0 if not request.do_screen else -(-int(n) // bucket) if s is None else s.numel()
                      for n, s in zip(numels, samples, strict=True)], dtype=np.int64)
    pair_off = _prefix(pairs)
    # SCREEN: nothing staged. VALUES packs into the stage as PAYLOAD does and drops it there (the q it writes is
    # the same; one kernel serves both), so only PAYLOAD has a buffer.
    largest = tables.largest_payload_bytes[members] * (request.output != GroupOutput.SCREEN)
    capacity = int(largest.sum()) if request.output == GroupOutput.PAYLOAD else 0
    # Each member packs into a 16-byte-aligned staging payload (the kernels' word-wide writes need it), then one
    # gather lays the payloads out back to back.
    stage_off = _prefix(-(-largest // 16) * 16)
    gather_off = _prefix(-(-largest // GATHER_CHUNK) * (request.output == GroupOutput.PAYLOAD))
    stage = torch.empty(int(stage_off[-1]), dtype=torch.uint8, device=device)
    layout = host.upload(device, dict(
        e=addresses(request.residuals), sample=addresses(samples), n=numels, tensor=members, bucket_off=bucket_off,
        pair_off=pair_off, stage_off=stage_off, stage_addr=stage.data_ptr() + stage_off[:-1], gather_off=gather_off))
    plan = _Plan((request.residuals, request.samples, samples), bucket_off, pair_off, largest, capacity, stage_off,
                 gather_off, stage, layout)
    if key is not None:
        if len(_plans) >= _PLANS:
            del _plans[next(iter(_plans))]         # the oldest
        _plans[key] = plan
    return plan


def pack_group(request: Any, tables: Any) -> Any:
    """:func:`safebits_hvd.codec.kernels.pack_group` on the GPU: the NaN/Inf check, the screen, the choice of the first
    action, the layout and the packing pass of every member, one launch each with no synchronization in between,
    then ONE read back (``host.to_host``) of the verdicts, choices, offsets and statistics.

    Payloads and residuals are bitwise those of the per-tensor kernels (the same per-bucket device functions, keys
    and arguments), and so are the float64 sums, reduced per member in the statistics' shared order
    (``sb_segment_sum_kernel``), bitwise the C backend's."""
    device = request.residuals[0].device
    members = np.ascontiguousarray(request.members, dtype=np.int64)
    m, nact, bucket = len(members), tables.actions, tables.menu.bucket_size
    if m == 0:
        return PackResult(torch.empty(0, dtype=torch.uint8, device=device), np.ones(0, dtype=bool),
                         np.zeros((0, nact, 4)), np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64),
                         np.zeros((0, 4)))
    plan = _plan_of(request, tables, members, device)
    capacity, stage_off, gather_off = plan.capacity, plan.stage_off, plan.gather_off
    bucket_off, pair_off = plan.bucket_off, plan.pair_off
    buffer = torch.empty(capacity, dtype=torch.uint8, device=device)
    # One upload of what changes per step (gradients and where q goes, keys, the allocation) and m zeros, the NaN/Inf
    # flags the check sets (so no launch zeroes them); the layout is the plan's, on the device since it was made.
    t = dict(plan.layout)
    t.update(host.upload(device, dict(
        g=addresses(request.grads), into=addresses(request.intos), key=np.asarray(request.keys, dtype=np.uint32),
        allocated=np.asarray(request.allocated), bad=np.zeros(m, dtype=np.int64))))
    # Everything read back, in one int64 tensor: chosen (-1: NaN/Inf), offsets, then the float64 sums; every word
    # is written by a kernel below, or not read (the sums of a pass that did not run are zeros on the host).
    spans = {"chosen": m, "offsets": m + 1, "screen": m * nact * 4, "stats": m * 4}
    results = torch.empty(sum(spans.values()), dtype=torch.int64, device=device)
    r = _split(results, spans)
    screen_stats, stats = r["screen"].view(torch.float64), r["stats"].view(torch.float64)
    payload_bytes, headers, cost_order, lossless = tables.on_device(device)
    menu_args = [_ptr(a) for a in _menu_arrays(tables.menu, device)]
    buckets = int(bucket_off[-1])
    screened = bool(request.do_screen and pair_off[-1])
    packed = request.output != GroupOutput.SCREEN and buckets > 0
    with _launcher(device) as launch:             # at most 8 launches, whatever the member count
        if request.check_finite and buckets:
            launch("sb_group_finite_kernel", buckets, (np.int32(m), _ptr(t["bucket_off"]), _ptr(t["g"]), _ptr(t["n"]),
                                                       np.int32(bucket), _ptr(t["bad"])))
        if screened:
            part = torch.empty((int(pair_off[-1]), nact, 4), dtype=torch.float64, device=device)
            launch("sb_group_screen_kernel", int(pair_off[-1]) * nact,
                   (np.int32(m), _ptr(t["pair_off"]), _ptr(t["g"]), _ptr(t["e"]), _ptr(t["n"]), _ptr(t["sample"]),
                    _ptr(t["key"]), _ptr(t["bad"]), np.int32(bucket), np.int32(nact), *menu_args, _ptr(part)))
            launch("sb_segment_sum_kernel", m * nact, (_ptr(part), _ptr(t["pair_off"]), np.int64(0), np.int32(nact),
                                                       _ptr(screen_stats)))
        # The choice and the layout (offsets: a prefix sum of the chosen payloads' bytes), one block. It chooses by
        # the screen only when the screen ran (a group of empty members has no sums: the allocated actions, as C).
        launch("sb_group_choose_kernel", 1,
               (np.int32(m), _ptr(t["tensor"]), _ptr(t["allocated"]), _ptr(t["bad"]), _ptr(screen_stats),
                np.int32(screened and request.screen_enabled), np.int32(nact), _ptr(cost_order),
                _ptr(lossless), np.int32(tables.lossless_index), np.float64(request.rule.max_distortion),
                np.float64(request.rule.min_cosine), _ptr(payload_bytes),
                np.int32(request.output == GroupOutput.PAYLOAD), _ptr(r["chosen"]), _ptr(r["offsets"])))
        if request.output != GroupOutput.SCREEN:
            launch("sb_group_stage_kernel", _grid(int(stage_off[-1]) // 16),
                   (np.int32(m), _ptr(t["stage_off"]), _ptr(t["tensor"]), _ptr(r["chosen"]), np.int32(nact),
                    _ptr(payload_bytes), _ptr(headers), _ptr(plan.stage)))
            if buckets:
                part = torch.empty((buckets, 4), dtype=torch.float64, device=device)
                launch("sb_group_pack_kernel", buckets,
                       (np.int32(m), _ptr(t["bucket_off"]), _ptr(t["g"]), _ptr(t["e"]), _ptr(t["into"]), _ptr(t["n"]),
                        _ptr(t["key"]), _ptr(r["chosen"]), _ptr(t["stage_addr"]), np.int32(bucket), *menu_args,
                        _ptr(part)))
                launch("sb_segment_sum_kernel", m, (_ptr(part), _ptr(t["bucket_off"]), np.int64(0), np.int32(1),
                                                    _ptr(stats)))
            if request.output == GroupOutput.PAYLOAD and gather_off[-1]:
                launch("sb_gather_kernel", int(gather_off[-1]),
                       (np.int32(m), _ptr(t["gather_off"]), np.int64(GATHER_CHUNK), _ptr(r["offsets"]),
                        _ptr(r["offsets"]), np.int32(0), _ptr(t["stage_addr"]), _ptr(buffer)))
    values = _split(host.to_host(results), spans)         # the group's one device-to-host synchronization
    chosen = values["chosen"].copy()
    offsets = values["offsets"].copy() if request.output == GroupOutput.PAYLOAD else np.zeros(m + 1, dtype=np.int64)
    screen_host = values["screen"].view(np.float64).reshape(m, nact, 4) if screened else np.zeros((m, nact, 4))
    stats_host = values["stats"].view(np.float64).reshape(m, 4) if packed else np.zeros((m, 4))
    return PackResult(buffer[:int(offsets[-1])], chosen >= 0, screen_host, chosen, offsets, stats_host)


def decode_group(bodies: list[torch.Tensor], body_bytes: np.ndarray, actions: np.ndarray, outs: list[torch.Tensor],
                 numels: np.ndarray, own: np.ndarray, ranks: int, menu: Menu, divisor: float) -> int:
    """:func:`safebits_hvd.codec.kernels.decode_group` on the GPU (the arguments of ``cpu.decode_group``; ``bodies`` are
    the whole payloads, header included, at any alignment): one upload and one launch decode every bucket of
    every member, each block summing the ranks in rank order, bitwise the per-tensor ``decode`` then
    ``decode_add`` sequence. With top-k payloads, ONE read back of the decode's verdict; returns -1 or the lowest
    slot (member * ranks + rank) whose top-k indices are invalid (what was decoded is then not to be used)."""
    actions = np.ascontiguousarray(actions, dtype=np.int64).reshape(-1)
    device = outs[0].device
    error = torch.full((2,), _INT_MAX, dtype=torch.int32, device=device)
    columns = _decode_columns(outs, numels, own, menu)
    t = host.upload(device, dict(addr=addresses(bodies), actions=actions, **columns))
    _decode_launch(t, t["addr"], t["actions"], columns, ranks, menu, divisor, error)
    if not any(menu[int(a)].kind == ActionKind.TOPK for a in np.unique(actions)):
        return -1
    first_bad = int(host.to_host(error)[1])          # the group's one read back (only with top-k payloads)
    return -1 if first_bad == _INT_MAX else first_bad


def receive_group(gathered: torch.Tensor, rows: np.ndarray, expected: np.ndarray, outs: list[torch.Tensor],
                  own: np.ndarray, tables: Any, divisor: float, error: torch.Tensor) -> None:
    """:func:`safebits_hvd.codec.kernels.receive_group` on the GPU: the payloads located in ``gathered`` on the device
    (``sb_group_locate_kernel``, as :func:`~safebits_hvd.codec.kernels.locate_payloads` on the host) and decoded
    (``sb_group_decode_kernel``): one pinned upload, two launches and no read back. ``error`` (two int32, filled
    with INT_MAX) receives the verdicts the host reads when the step closes: ``error[0]`` the group was not
    located (nothing was decoded), ``error[1]`` the lowest slot with invalid top-k indices."""
    m, ranks = rows.shape
    if m == 0:
        return
    device = gathered.device
    payload_bytes, headers, _, _ = tables.on_device(device)
    order_rows = np.ascontiguousarray(rows.T).reshape(-1)             # buffer order: rank after rank
    order_expected = np.tile(np.asarray(expected, dtype=np.int64), ranks)
    assumed = _prefix(tables.payload_bytes[order_rows, order_expected])[:-1]
    columns = _decode_columns(outs, tables.numels[rows[:, 0]], own, tables.menu)
    t = host.upload(device, dict(row=order_rows, expected=order_expected, assumed=assumed, **columns))
    located = torch.empty(2 * m * ranks, dtype=torch.int64, device=device)       # addresses, then actions
    addr, actions = located[:m * ranks], located[m * ranks:]
    with _launcher(device) as launch:
        launch("sb_group_locate_kernel", 1,
               (_ptr(gathered), np.int64(gathered.numel()), np.int32(m), np.int32(ranks), _ptr(t["row"]),
                _ptr(t["expected"]), _ptr(t["assumed"]), np.int32(tables.actions), _ptr(payload_bytes),
                _ptr(headers), _ptr(addr), _ptr(actions), _ptr(error)))
    _decode_launch(t, addr, actions, columns, ranks, tables.menu, divisor, error)


def _decode_columns(outs: list[torch.Tensor], numels: np.ndarray, own: np.ndarray, menu: Menu) -> dict[str, Any]:
    """What ``sb_group_decode_kernel`` reads of the members (uploaded with the caller's columns, in one copy)."""
    numels = np.ascontiguousarray(numels, dtype=np.int64)
    return dict(bucket_off=_prefix(-(-numels // menu.bucket_size)), outs=addresses(outs), n=numels,
                own=np.ascontiguousarray(own, dtype=np.int64))


def _decode_launch(t: dict[str, torch.Tensor], addr: torch.Tensor, actions: torch.Tensor, columns: dict[str, Any],
                   ranks: int, menu: Menu, divisor: float, error: torch.Tensor) -> None:
    """``sb_group_decode_kernel`` over every bucket of the members of ``columns`` (:func:`_decode_columns`; ``t``:
    them uploaded); ``addr`` and ``actions`` on the device, member-major."""
    buckets, m = int(columns["bucket_off"][-1]), len(columns["n"])
    if not buckets:
        return
    kinds, levels, _, topks, trits = (_ptr(a) for a in _menu_arrays(menu, addr.device))
    with _launcher(addr.device) as launch:
        launch("sb_group_decode_kernel", buckets,
               (np.int32(m), np.int32(ranks), _ptr(t["bucket_off"]), _ptr(t["outs"]), _ptr(t["n"]), _ptr(t["own"]),
                _ptr(addr), _ptr(actions), np.int32(menu.bucket_size), kinds, levels, topks, trits,
                np.float32(divisor), _ptr(error)))
