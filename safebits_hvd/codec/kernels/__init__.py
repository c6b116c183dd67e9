"""SafeBits quantization kernels: the screen (statistics of every action) and the fused sending pass.

Backends, chosen by the device of ``e``:

* CPU: the compiled C backend (``cpu.c`` + ``safebits_math.h``, OpenMP, cached shared object) when a C
  compiler is available, else the PyTorch reference (with one warning).
* CUDA: the CuPy backend (``cuda_kernels.cu`` + ``safebits_math.h`` through NVRTC).

All backends produce bit-identical ``out`` and ``e``; the C and CUDA backends' float64 statistics are
bit-identical too (one summation order, ``SB_STAT_PARTIALS`` in ``safebits_math.h``), the reference's agree
to float64 rounding.
Statistics columns: ``[sum (q-v)^2, sum q*v, sum q^2, sum v^2]`` (see :data:`STAT_COLUMNS`).

The packed wire format (:mod:`safebits_hvd.codec.wire`): :func:`quantize_pack_ef` is the sending pass that writes the
payload instead of float32 values (same ``e``, same statistics, bitwise), :func:`decode_add` adds a payload's
values into a float32 tensor, :func:`decode` returns them.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .. import host, wire
from ..actions import Action, Menu
from . import reference
from .groups import Gathered, GroupOutput, GroupTables, PackRequest, PackResult, ScreenRule
from .tensors import TensorList

__all__ = ["STAT_COLUMNS", "Gathered", "GroupOutput", "GroupTables", "PackRequest", "PackResult", "ScreenRule",
           "TensorList", "backend_name", "decode", "decode_add", "decode_group", "pack_group", "quantize_ef",
           "quantize_pack_ef", "receive_group", "screen"]

PAYLOAD_ALIGN = 16
"""Byte alignment the kernels need of a payload (its float32 and 16-bit sections are then naturally aligned)."""

STAT_COLUMNS = ("err2", "qv", "q2", "v2")

_log = logging.getLogger(__name__)
_cpu_module: Any = None        # the CPU backend once chosen (an import statement per call costs microseconds)
_override: Any = None          # a backend that serves every device (use_backend)


def _cpu_backend():
    global _cpu_module
    if _cpu_module is None:
        from . import cpu

        try:
            cpu.load()
            _cpu_module = cpu
        except (RuntimeError, OSError) as exc:
            _cpu_module = reference
            _log.warning("SafeBits: C kernels unavailable (%s); using the slow PyTorch reference", exc)
    return _cpu_module


def _backend(device: torch.device):
    if _override is not None:
        return _override
    if device.type == "cpu":
        return _cpu_backend()
    if device.type == "cuda":
        from . import cuda

        return cuda
    raise TypeError(f"SafeBits kernels support CPU and CUDA tensors, not {device.type!r}")


def backend_name(device: torch.device | str = "cpu") -> str:
    """``'c'``, ``'reference'`` or ``'cuda'``: the backend that serves tensors on ``device``."""
    return _backend(torch.device(device)).NAME


@contextlib.contextmanager
def use_backend(backend: Any) -> Iterator[None]:
    """Inside the block, ``backend`` serves tensors on every device: a module or object with this package's
    backend functions, a ``NAME`` (``"c"``, ``"reference"`` or ``"cuda"``) and what it can do (``PACKS_GROUPS``,
    ``ON_HOST``, ``TAKES_ADDRESSES``), as ``cpu``, ``reference`` and ``cuda`` have. The counting tests run the CUDA
    backend's orchestration on CPU tensors this way."""
    global _override
    previous, _override = _override, backend
    try:
        yield
    finally:
        _override = previous


def _check(name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if like is not None:
        if t.numel() != like.numel():
            raise ValueError(f"{name} has {t.numel()} elements, e has {like.numel()}")
        if t.device != like.device:
            raise ValueError(f"{name} is on {t.device}, e is on {like.device}")


def screen(g: torch.Tensor | None, e: torch.Tensor, menu: Menu, key: int,
           buckets: torch.Tensor | None = None) -> torch.Tensor:
    """Statistics of every action of ``menu`` on ``v = g + e``, restricted to the listed buckets.

    Args:
        g: gradient (1-D contiguous float32) or None (then ``v = e``).
        e: error-feedback residual, same shape/device. Nothing is written.
        menu: the actions (one shared bucket size).
        key: ``safebits_hvd.codec.rng.stream_key(seed, step, tensor_index)``.
        buckets: int64 1-D ascending bucket indices, or None for all buckets.

    Returns:
        float64 tensor ``(len(menu), 4)``: ``[sum (q-v)^2, sum q*v, sum q^2, sum v^2]`` per action.
    """
    _check("e", e)
    if g is not None:
        _check("g", g, e)
    if not isinstance(menu, Menu):
        raise TypeError(f"menu must be a safebits_hvd.codec.actions.Menu, got {type(menu).__name__}")
    if buckets is not None:
        if not isinstance(buckets, torch.Tensor) or buckets.dtype != torch.int64 or buckets.dim() != 1:
            raise TypeError("buckets must be a 1-D int64 tensor of bucket indices (or None)")
        nb = -(-e.numel() // menu.bucket_size)
        buckets = buckets.to(e.device).contiguous()
        if buckets.numel():
            low, high = host.to_host(torch.stack((buckets.min(), buckets.max()))).tolist()
            if low < 0 or high >= nb:
                raise ValueError(f"bucket indices must be in [0, {nb}), got range [{low}, {high}]")
    return _backend(e.device).screen(g, e, menu, int(key), buckets)


def quantize_ef(g: torch.Tensor | None, e: torch.Tensor, out: torch.Tensor, action: Action,
                key: int) -> torch.Tensor:
    """The fused sending pass: ``v = g + e``; ``out = Q_action(v)``; ``e = v - out`` (in place).

    Returns float64 ``(4,)`` statistics ``[sum (q-v)^2, sum q*v, sum q^2, sum v^2]`` over all elements.
    """
    _check("e", e)
    _check("out", out, e)
    if g is not None:
        _check("g", g, e)
    if not isinstance(action, Action):
        raise TypeError(f"action must be a safebits_hvd.codec.actions.Action, got {type(action).__name__}")
    return _backend(e.device).quantize_ef(g, e, out, action, int(key))


def quantize_pack_ef(g: torch.Tensor | None, e: torch.Tensor, action: Action, key: int,
                     payload: torch.Tensor | None = None,
                     into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused packing pass: ``v = g + e``; the packed payload of ``q = Q_action(v)``; ``e = v - q`` (in place);
    and ``q`` itself into ``into`` when given.

    ``e`` and the statistics are bitwise those of :func:`quantize_ef` on the same inputs, and decoding the payload
    gives bitwise its ``out`` (and ``into``): a rank that needs its own ``q`` (to start the sum over ranks) gets it
    here instead of decoding its own payload again.

    Args:
        g: gradient (1-D contiguous float32) or None (then ``v = e``).
        e: error-feedback residual, updated in place.
        action: the quantizer.
        key: ``safebits_hvd.codec.rng.stream_key(seed, step, tensor_index)``.
        payload: optional 1-D uint8 tensor of exactly ``wire.payload_nbytes(action, n)`` bytes on ``e``'s device,
            16-byte aligned, to write into; a new one when None.
        sent: optional 1-D contiguous float32 tensor of ``e``'s size and device that receives ``q``; it may be
            ``g`` itself (each bucket is read before it is written), never ``e``.

    Returns:
        ``(payload, stats)``: the uint8 payload (header + body) and float64 ``(4,)`` statistics
        ``[sum (q-v)^2, sum q*v, sum q^2, sum v^2]``.
    """
    _check("e", e)
    if g is not None:
        _check("g", g, e)
    if into is not None:
        _check("sent", into, e)
        if into.numel() and into.data_ptr() == e.data_ptr():
            raise ValueError("sent must not be e (the residual is written in the same pass)")
    if not isinstance(action, Action):
        raise TypeError(f"action must be a safebits_hvd.codec.actions.Action, got {type(action).__name__}")
    header = wire.header_of(action, e.numel())
    nbytes = header.payload_nbytes
    if payload is None:
        # rounded up so that word-wide device writes of the last bytes stay inside the allocation
        payload = torch.empty(-(-nbytes // PAYLOAD_ALIGN) * PAYLOAD_ALIGN, dtype=torch.uint8, device=e.device)
        payload = payload[:nbytes]
    elif not (isinstance(payload, torch.Tensor) and payload.dtype == torch.uint8 and payload.dim() == 1
              and payload.is_contiguous() and payload.numel() == nbytes and payload.device == e.device):
        raise ValueError(f"payload must be a contiguous 1-D uint8 tensor of {nbytes} bytes on {e.device}")
    elif payload.data_ptr() % PAYLOAD_ALIGN:
        raise ValueError(f"payload must be {PAYLOAD_ALIGN}-byte aligned")
    # The header through the seam: on a GPU a pageable copy would wait for the device.
    head = np.frombuffer(wire.pack_header(header), dtype=np.int64)
    payload[:wire.HEADER_BYTES].copy_(host.upload(payload.device, {"header": head})["header"].view(torch.uint8))
    stats = _backend(e.device).quantize_pack_ef(g, e, payload, action, int(key), into)
    return payload, stats


def _decode(payload: torch.Tensor, out: torch.Tensor, accumulate: bool, name: str, divisor: float = 1.0,
            header: wire.Header | None = None) -> None:
    if not isinstance(payload, torch.Tensor):
        raise wire.WireFormatError(f"{name}: a payload is a uint8 tensor, got {type(payload).__name__}")
    if header is None:
        header = wire.parse_header(payload, name)
    elif payload.numel() != header.payload_nbytes:
        raise wire.WireFormatError(f"{name}: payload has {payload.numel()} bytes, its header says "
                                   f"{header.payload_nbytes}")
    if header.n != out.numel():
        raise wire.WireFormatError(f"{name}: payload holds {header.n} elements, the tensor has {out.numel()}")
    if payload.device != out.device:
        raise ValueError(f"{name}: payload is on {payload.device}, out on {out.device}")
    if not payload.is_contiguous() or payload.data_ptr() % PAYLOAD_ALIGN:
        payload = payload.clone()            # e.g. a slice of a gathered buffer: realign once
    _backend(out.device).decode(payload, header, out, accumulate, name, divisor)


def decode_add(payload: torch.Tensor, out: torch.Tensor, *, name: str = "tensor", divisor: float = 1.0,
               header: wire.Header | None = None) -> torch.Tensor:
    """``out += decode(payload)`` in place (elementwise float32 add), then ``out /= divisor`` in the same pass
    unless ``divisor`` is 1 (bitwise the add followed by ``out.div_(divisor)`` on the CPU); returns ``out``.

    ``out``: 1-D contiguous float32 with the payload's element count. An invalid payload (truncated or extra
    bytes, unknown version or kind, wrong element count, insane fields, top-k indices out of range) raises
    :class:`safebits_hvd.codec.wire.WireFormatError` naming ``name``; nothing is added then. ``header``: the payload's
    header when the caller made the payload and knows it (:func:`~safebits_hvd.codec.wire.header_of`): it is then not
    read back from the device, only the payload's length is checked against it.
    """
    _check("out", out)
    if isinstance(divisor, bool) or not isinstance(divisor, int | float) or not 0 < divisor < math.inf:
        raise ValueError(f"divisor must be a finite number > 0, got {divisor!r}")
    _decode(payload, out, True, name, float(divisor), header)
    return out


def decode(payload: torch.Tensor, *, name: str = "tensor", out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 values of ``payload`` (bitwise the ``out`` of :func:`quantize_ef`, -0.0 included), written over
    ``out`` when given (1-D contiguous float32 of the payload's element count: no zero-fill pass, unlike
    :func:`decode_add` into zeros)."""
    if out is None:
        header = wire.parse_header(payload, name) if isinstance(payload, torch.Tensor) else None
        if header is None:
            raise wire.WireFormatError(f"{name}: a payload is a uint8 tensor, got {type(payload).__name__}")
        out = torch.empty(header.n, dtype=torch.float32, device=payload.device)
    else:
        _check("out", out)
    _decode(payload, out, False, name)
    return out


# ---------------------------------------------------------------------------------------------- groups of tensors
# The batched step (docs/DESIGN.md, "The batched step"): one call sends every member of a group, one call decodes
# every member of a gathered group. The C backend runs each as one multi-tensor call (group.c); the others loop
# over their per-tensor kernels, with the same results.

def pack_group(request: PackRequest, tables: GroupTables) -> PackResult:
    """Send every member of a group in one pass: NaN/Inf check, screen, the choice of the first action to try,
    and the packing pass (``v = g + e``, payload of ``q``, ``e <- v - q``, ``q`` into ``intos``), each member
    bitwise as :func:`screen` and :func:`quantize_pack_ef` (:func:`quantize_ef` for ``GroupOutput.VALUES``) would.
    The results are read back once."""
    if request.output == GroupOutput.VALUES and any(s is None for s in request.intos):
        raise ValueError("send_group: GroupOutput.VALUES writes q into every member's sents tensor; one is None")
    device = request.residuals[0].device if request.residuals else torch.device("cpu")
    backend = _backend(device)
    if not backend.PACKS_GROUPS:
        return _pack_group_loop(request, tables, device)
    if backend.ON_HOST:
        host.count()        # the read a device backend makes (the CUDA one counts its own, host.to_host)
    return backend.pack_group(request, tables)


def _pack_group_loop(request: PackRequest, tables: GroupTables, device: torch.device) -> PackResult:
    """:func:`pack_group` through the per-tensor kernels (the reference backend)."""
    m, nact = len(request.members), tables.actions
    finite = np.ones(m, dtype=bool)
    screen_stats = np.zeros((m, nact, 4))
    chosen = np.asarray(request.allocated, dtype=np.int64).copy()
    stats = np.zeros((m, 4))
    payloads: list[torch.Tensor] = []
    for k, index in enumerate(request.members):
        g, e = request.grads[k], request.residuals[k]
        if request.check_finite and g.numel() and not bool(host.to_host(torch.isfinite(g).all())):
            finite[k], chosen[k] = False, -1
            continue
        if request.do_screen:
            screen_stats[k] = host.to_host(screen(g, e, tables.menu, int(request.keys[k]), request.samples[k]))
            if request.screen_enabled:
                chosen[k] = request.rule.first_candidates(screen_stats[k:k + 1], chosen[k:k + 1],
                                                          tables.cost_order[index:index + 1], tables.lossless)[0]
        if request.output == GroupOutput.SCREEN:
            continue
        action, key, into = tables.menu[int(chosen[k])], int(request.keys[k]), request.intos[k]
        if request.output == GroupOutput.VALUES:
            assert into is not None
            member_stats = quantize_ef(g, e, into, action, key)
        else:
            payload, member_stats = quantize_pack_ef(g, e, action, key, into=into)
            payloads.append(payload)
        stats[k] = host.to_host(member_stats)
    sizes = [0 if c < 0 or request.output != GroupOutput.PAYLOAD else int(tables.payload_bytes[i, c])
             for i, c in zip(request.members, chosen, strict=True)]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    buffer = torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8, device=device)
    return PackResult(buffer, finite, screen_stats, chosen, offsets, stats)


def decode_group(payloads: list[list[torch.Tensor]] | Gathered, actions: np.ndarray, outs: list[torch.Tensor],
                 own: np.ndarray, tables: GroupTables, members: np.ndarray, names: list[str],
                 divisor: float = 1.0) -> None:
    """The sum over ranks of every member of a gathered group, in rank order, divided by ``divisor``:
    ``payloads[k][r]`` (or :class:`Gathered`) is member ``k``'s payload from rank ``r`` (its header already
    checked) at menu action ``actions[k, r]``; ``own[k] = r`` when ``outs[k]`` already holds rank ``r``'s values
    (else -1: it is written over). Bitwise :func:`decode` of rank 0 then :func:`decode_add` of each later rank. A
    payload whose top-k indices are invalid raises :class:`~safebits_hvd.codec.wire.WireFormatError` naming the
    tensor."""
    if not outs:
        return
    ranks = actions.shape[1]
    sizes = tables.payload_bytes[np.repeat(members, ranks), actions.reshape(-1)]
    backend = _backend(outs[0].device)
    flat: Any = None
    if isinstance(payloads, Gathered):
        if backend.TAKES_ADDRESSES:       # no view made per payload
            flat = payloads.buffer.data_ptr() + payloads.offsets.reshape(-1).astype(np.int64)
        else:
            payloads = payloads.payloads(sizes.reshape(len(outs), ranks))
    if flat is None:
        flat = [p for member in payloads for p in member]
    if backend.PACKS_GROUPS:      # cuda: same arguments, its top-k read back counted there
        body_bytes = sizes - wire.HEADER_BYTES
        bad = backend.decode_group(flat, body_bytes, actions.reshape(-1), outs, tables.numels[members], own, ranks,
                                   tables.menu, float(divisor))
        if bad >= 0:
            _raise_invalid_topk(bad, ranks, names)
        return
    for k, out in enumerate(outs):
        added = [r for r in range(ranks) if r != own[k]] if own[k] >= 0 else list(range(1, ranks))
        if own[k] < 0:
            decode(payloads[k][0], name=f"{names[k]} (rank 0)", out=out)
        for r in added:
            decode_add(payloads[k][r], out, name=f"{names[k]} (rank {r})", divisor=divisor if r == added[-1] else 1.0)
        if not added and divisor != 1.0:
            out.div_(divisor)

def receive_group(gathered: torch.Tensor, rows: np.ndarray, expected: np.ndarray, outs: list[torch.Tensor],
                  own: np.ndarray, tables: GroupTables, names: list[str], what: str, divisor: float,
                  error: torch.Tensor) -> bool:
    """A gathered group's payloads located (:func:`locate_payloads`: ``rows``, ``expected``, ``names``, ``what``
    as there) and decoded into ``outs`` (:func:`decode_group`: ``own``, ``divisor``). On the CPU backends the
    payloads are located on the host and a bad buffer raises :class:`~.wire.WireFormatError` now; returns False.
    On CUDA both happen on the device without a read back, the verdicts written into ``error`` (two int32 filled
    with ``2**31 - 1``: ``error[0]`` not located, ``error[1]`` the lowest ``member * ranks + rank`` with invalid
    top-k indices); returns True, and the caller reads ``error`` when the step closes
    (:func:`raise_received_error`)."""
    backend = _backend(gathered.device)
    if not backend.ON_HOST:
        backend.receive_group(gathered, rows, expected, outs, own, tables, float(divisor), error)
        return True
    payloads, actions = locate_payloads(gathered, rows, expected, tables, names, what)
    decode_group(payloads, actions, outs, own, tables, rows[:, 0], names, divisor)
    return False


NO_ERROR = 2**31 - 1
"""What :func:`receive_group`'s ``error`` holds where nothing was wrong."""


def raise_received_error(verdict: np.ndarray, gathered: torch.Tensor, rows: np.ndarray, expected: np.ndarray,
                         tables: GroupTables, names: list[str], what: str) -> None:
    """Raise what :func:`receive_group` found wrong on the device (``verdict``: its ``error``, read back), named as
    the host names it: a group not located is located again on the host, which says where and why."""
    if verdict[0] != NO_ERROR:
        locate_payloads(gathered, rows, expected, tables, names, what)
        raise wire.WireFormatError(f"{what}: the payloads could not be located on the device")
    if verdict[1] != NO_ERROR:
        _raise_invalid_topk(int(verdict[1]), rows.shape[1], names)


def _raise_invalid_topk(slot: int, ranks: int, names: list[str]) -> None:
    k, r = divmod(slot, ranks)
    raise wire.WireFormatError(f"{names[k]} (rank {r}): top-k indices out of range or not ascending")


def locate_payloads(gathered: torch.Tensor, rows: np.ndarray, expected: np.ndarray, tables: GroupTables,
                    names: list[str], what: str, data: np.ndarray | None = None) -> tuple[Gathered, np.ndarray]:
    """Where each payload of a gathered buffer starts ``[member, rank]``, and its menu action: rank ``r``'s part
    holds, member after member, the payload of table row ``rows[k, r]`` (``names[k]``), expected at action
    ``expected[k]`` (what every rank allocated). Fast path: if every rank sent the expected actions, the buffer
    has exactly their length and their headers at the offsets they imply; one comparison of all those headers
    proves it (by induction over payloads: each header fixes where the next payload starts), one read back. Else
    the buffer is read back once and the same comparison finds, in buffer order, the first payload that is not at
    its assumed action (a rank escalated it, or the buffer is corrupt); its header says its action (one of its
    row's menu actions, else :class:`~.wire.WireFormatError` names what is wrong), which moves every later
    payload, and the comparison goes on from there (on the CPU at once: the buffer is the host's). ``data``: the
    buffer's bytes, when the host has them already (nothing is read back then)."""
    m, ranks = rows.shape
    sizes = tables.payload_bytes[rows, expected[:, None]]                       # [member, rank]
    starts = np.zeros_like(sizes)
    starts[1:] = np.cumsum(sizes[:-1], axis=0)
    parts = sizes.sum(axis=0)
    part_start = np.concatenate([[0], np.cumsum(parts)[:-1]]).astype(np.int64)
    offsets = starts + part_start[None, :]
    if data is None and gathered.device.type != "cpu" and gathered.numel() == int(parts.sum()):
        # Where each header is and which table header it must be: one upload; the tables are on the device once.
        t = host.upload(gathered.device, {"start": offsets.T, "header": rows.T * tables.actions + expected[None, :]})
        headers = tables.on_device(gathered.device)[1].view(-1, wire.HEADER_BYTES)
        heads = gathered[t["start"][:, None] + torch.arange(wire.HEADER_BYTES, device=gathered.device)]
        if host.to_host((heads == headers[t["header"]]).all())[()]:
            return Gathered(gathered, offsets), np.repeat(expected[:, None], ranks, axis=1)
    if data is None:
        data = host.to_host(gathered)
    # In buffer order (rank after rank, member after member): the row, the action assumed, the payload's size, and
    # where it starts if no payload before it differs (the fast path's offsets; the bytes the payloads that did
    # differ add: `shift`).
    order_rows = np.ascontiguousarray(rows.T).reshape(-1)
    order_actions = np.repeat(expected[None, :], ranks, axis=0).reshape(-1)
    order_sizes = np.ascontiguousarray(sizes.T).reshape(-1)
    assumed = np.ascontiguousarray(offsets.T).reshape(-1)
    total, shift, proven, window, differed = order_rows.size, 0, 0, 64, 0
    if data.size == int(parts.sum()) and _first_mismatch(data, order_rows, order_actions, assumed, tables) == total:
        # Every payload where the allocation puts it (the usual step): one comparison of all the headers.
        return Gathered(gathered, offsets), np.repeat(expected[:, None], ranks, axis=1)

    def read_header(slot: int, offset: int) -> int:
        """The action of payload ``slot`` from its header at ``offset`` (every payload before it is proven)."""
        k, r = slot % m, slot // m
        if data.size - offset < wire.HEADER_BYTES:
            if slot > 0 and offset > data.size:           # the payload before it runs past the end
                _truncated(data.size, offset - int(order_sizes[slot - 1]), slot - 1, order_sizes, m, names)
            raise wire.WireFormatError(f"{names[k]} (rank {r}): truncated payload: {data.size - offset} bytes "
                                       f"left, a header alone is {wire.HEADER_BYTES}")
        action = tables.action_of_header(int(order_rows[slot]), data[offset:offset + wire.HEADER_BYTES].tobytes())
        if action < 0:
            wire.parse_header(gathered[offset:offset + wire.HEADER_BYTES], f"{names[k]} (rank {r})",
                              check_length=False)     # names what is wrong, if the header itself is
            raise wire.WireFormatError(f"{names[k]} (rank {r}): the payload is not one of this tensor's menu "
                                       f"actions")
        return action

    while proven < total:      # the payloads before `proven` are where and what they are taken to be
        if differed * 16 > proven + 64:
            # One payload in 16 differs: reading each header in turn costs less than a window's comparison per
            # payload that differs.
            offset, lookup, payload_bytes = int(assumed[proven]) + shift, tables.action_of_header, tables.payload_bytes
            for slot, row in enumerate(order_rows[proven:].tolist(), proven):
                action = lookup(row, data[offset:offset + wire.HEADER_BYTES].tobytes())
                if action < 0 or offset + wire.HEADER_BYTES > data.size:
                    action = read_header(slot, offset)        # raises the error that says what is wrong
                order_actions[slot] = action
                order_sizes[slot] = size = int(payload_bytes[row, action])
                offset += size
            break
        # A window of payloads at a time, doubling while all match.
        stop = min(proven + window, total)
        slot = proven + _first_mismatch(data, order_rows[proven:stop], order_actions[proven:stop],
                                        assumed[proven:stop] + shift, tables)
        if slot == stop:
            proven, window = stop, 2 * window
            continue
        action = read_header(slot, int(assumed[slot]) + shift)
        size = int(tables.payload_bytes[order_rows[slot], action])
        shift += size - int(order_sizes[slot])
        differed += 1
        order_actions[slot], order_sizes[slot] = action, size
        proven, window = slot + 1, 64
    offsets = np.concatenate([[0], np.cumsum(order_sizes)[:-1]]).astype(np.int64)
    end = int(offsets[-1] + order_sizes[-1]) if total else 0
    if end > data.size:                       # every header fits: only the last payload can run past the end
        _truncated(data.size, int(offsets[-1]), total - 1, order_sizes, m, names)
    if end != data.size:
        raise wire.WireFormatError(f"{what}: {data.size - end} bytes after {ranks * m} payloads")
    return (Gathered(gathered, np.ascontiguousarray(offsets.reshape(ranks, m).T)),
            np.ascontiguousarray(order_actions.reshape(ranks, m).T))


def _truncated(length: int, offset: int, slot: int, sizes: np.ndarray, m: int, names: list[str]) -> None:
    """Raise the error of the payload ``slot`` (buffer order; at ``offset``) that runs past the end of a gathered
    buffer of ``length`` bytes."""
    raise wire.WireFormatError(f"{names[slot % m]} (rank {slot // m}): truncated payload: {length - offset} bytes "
                               f"left, expected {int(sizes[slot])}")


def _first_mismatch(data: np.ndarray, rows: np.ndarray, actions: np.ndarray, offsets: np.ndarray,
                    tables: GroupTables) -> int:
    """How many of the payloads assumed at ``offsets`` (buffer order) have, one after the other, their assumed
    action's header there: the index of the first that does not (or whose header would not fit), else their
    count."""
    fits = offsets + wire.HEADER_BYTES <= data.size
    count = int(fits.size if fits.all() else np.argmin(fits))
    if count == 0:
        return 0
    heads = data[offsets[:count, None] + np.arange(wire.HEADER_BYTES)[None, :]]
    same = (heads == tables.headers[rows[:count], actions[:count]]).all(axis=1)
    return int(count if same.all() else np.argmin(same))


# ---------------------------------------------------------------------------------------------- encoding
