"""The packed wire format (version 1): what one tensor quantized with one action looks like as bytes.

A payload is a 16-byte header and a body; the layout of both is specified once, in docs/DESIGN.md, "The wire
format". :meth:`Action.cost` is exactly ``8 * (payload bytes - 16)`` for every action and element count (so
:func:`payload_nbytes` is ``16 + cost / 8``); :func:`~safebits_hvd.codec.actions.body_bits` is the one size formula.
This module packs and validates headers and frames payloads; the kernels (:mod:`safebits_hvd.codec.kernels`, which
import this module, never the reverse) write and read bodies: ``kernels.quantize_pack_ef`` encodes, ``kernels.decode``
and ``kernels.decode_add`` decode.

Functions: :func:`payload_nbytes`, :func:`pack_header`, :func:`parse_header`, :func:`payload_length`,
:func:`header_table`, :func:`payload_table`.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from . import host
from .actions import LLOYD_MAX_LEVELS, Action, ActionKind, body_bits

__all__ = ["FORMAT_VERSION", "HEADER_BYTES", "Header", "WireFormatError", "header_of", "header_table", "pack_header",
           "parse_header", "payload_length", "payload_nbytes", "payload_table"]

FORMAT_VERSION = 1
HEADER_BYTES = 16
_HEADER = struct.Struct("<BBHHHQ")
_MAX_N = 2**62   # far above any tensor; keeps every size computation inside int64 in the kernels


class WireFormatError(ValueError):
    """A payload that is not a valid version-1 SafeBits payload for the tensor it is decoded into."""


@dataclass(frozen=True)
class Header:
    """The decoded 16-byte header."""

    kind: ActionKind
    n: int
    bucket_size: int
    levels: int = 0
    topk: int = 0
    trits: bool = False
    version: int = FORMAT_VERSION

    @functools.cached_property
    def body_nbytes(self) -> int:
        """Bytes of the body this header announces (the one size formula, :func:`actions.body_bits`)."""
        return body_bits(self.kind, self.n, self.bucket_size, self.levels, self.topk, self.trits) // 8

    @functools.cached_property
    def payload_nbytes(self) -> int:
        return HEADER_BYTES + self.body_nbytes


def header_of(action: Action, n: int) -> Header:
    """The header of ``n`` elements sent with ``action``."""
    has_levels = action.kind in (ActionKind.QUANT, ActionKind.LLOYD_MAX)
    return Header(ActionKind(action.kind), int(n), action.bucket_size, action.levels if has_levels else 0,
                  action.topk_per_bucket if action.kind == ActionKind.TOPK else 0, action.packs_trits)


def payload_nbytes(action: Action, n: int) -> int:
    """Bytes of the payload of ``n`` elements: ``16 + action.cost(n) // 8``."""
    return HEADER_BYTES + action.cost(n) // 8


def header_table(menu: Iterable[Action], numels: np.ndarray) -> np.ndarray:
    """The 16 header bytes of every tensor at every action, ``(tensors, actions, 16)`` uint8: what the batched step
    writes before each body, and what a receiver expects to find at the allocated actions."""
    actions = list(menu)
    table = np.empty((len(numels), len(actions), HEADER_BYTES), dtype=np.uint8)
    for t, n in enumerate(numels):
        for a, action in enumerate(actions):
            table[t, a] = np.frombuffer(pack_header(header_of(action, int(n))), dtype=np.uint8)
    return table


def payload_table(menu: Iterable[Action], numels: np.ndarray) -> np.ndarray:
    """Bytes of the payload of every tensor at every action, ``(tensors, actions)`` int64."""
    actions = list(menu)
    return np.array([[payload_nbytes(a, int(n)) for a in actions] for n in numels],
                    dtype=np.int64).reshape(len(numels), len(actions))


def pack_header(header: Header) -> bytes:
    """The 16 header bytes."""
    param = header.topk - 1 if header.kind == ActionKind.TOPK else int(header.trits)
    return _HEADER.pack(header.version, int(header.kind), header.levels, header.bucket_size - 1, param, header.n)


def parse_header(payload: torch.Tensor | bytes, name: str = "tensor", *, check_length: bool = True) -> Header:
    """Parse and validate the header of ``payload`` (a uint8 tensor or bytes), including that its length is the
    one the header announces. Raises :class:`WireFormatError` naming ``name`` and what is wrong."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise WireFormatError(f"{name}: a payload is a 1-D uint8 tensor, got {payload.dtype} of shape "
                                  f"{tuple(payload.shape)}")
        size = payload.numel()
        head = host.to_host(payload[:HEADER_BYTES]).tobytes() if size >= HEADER_BYTES else b""
    else:
        size, head = len(payload), bytes(payload[:HEADER_BYTES])
    if size < HEADER_BYTES:
        raise WireFormatError(f"{name}: truncated payload: got {size} bytes, a header alone is {HEADER_BYTES}")
    try:
        header = _header_of_bytes(head)
    except _HeaderFieldError as exc:
        raise WireFormatError(f"{name}: {exc}") from None
    expected = header.payload_nbytes
    if check_length and size != expected:
        what = "truncated payload" if size < expected else f"{size - expected} extra bytes in payload"
        raise WireFormatError(f"{name}: {what}: got {size} bytes, expected {expected} ({header.kind.name}, "
                              f"n={header.n})")
    return header


class _HeaderFieldError(ValueError):
    """A header field is invalid (:func:`parse_header` adds the tensor's name)."""


@functools.lru_cache(maxsize=4096)
def _header_of_bytes(head: bytes) -> Header:
    """The validated header of 16 header bytes. Cached: every step decodes the same few hundred headers, and
    validating each again costs more than decoding a small tensor (only valid headers are cached)."""
    version, kind, levels, bucket_m1, param, n = _HEADER.unpack(head)
    if version != FORMAT_VERSION:
        raise _HeaderFieldError(f"payload format version {version} unsupported (this build reads version "
                                f"{FORMAT_VERSION})")
    if kind not in ActionKind._value2member_map_:
        raise _HeaderFieldError(f"unknown action kind {kind} (known: "
                                f"{', '.join(f'{k.value} {k.name}' for k in ActionKind)})")
    kind = ActionKind(kind)
    bucket = bucket_m1 + 1
    if bucket < 2:
        raise _HeaderFieldError(f"bucket size {bucket} is below 2")
    if n > _MAX_N:
        raise _HeaderFieldError(f"element count {n} is not plausible")
    topk, trits = 0, False
    if kind == ActionKind.QUANT:
        if not 1 <= levels <= 2**15 - 1:
            raise _HeaderFieldError(f"QUANT levels {levels} outside [1, 32767]")
        if param > 1 or (param == 1 and levels != 1):
            raise _HeaderFieldError(f"QUANT code packing {param} invalid (0: bitstream, 1: trits with levels 1; "
                                    f"levels is {levels})")
        trits = param == 1
    elif kind == ActionKind.LLOYD_MAX:
        if levels not in LLOYD_MAX_LEVELS:
            raise _HeaderFieldError(f"LLOYD_MAX levels {levels} not one of {sorted(LLOYD_MAX_LEVELS)}")
        if param != int(levels == 3):
            raise _HeaderFieldError(f"LLOYD_MAX code packing {param} invalid (1: trits for 3 levels, else 0; "
                                    f"levels is {levels})")
        trits = param == 1
    elif levels != 0:
        raise _HeaderFieldError(f"levels field is {levels}, must be 0 for {kind.name}")
    if kind == ActionKind.TOPK:
        topk = param + 1
        if topk > bucket:
            raise _HeaderFieldError(f"top-k keeps {topk} per bucket of {bucket}")
    elif kind not in (ActionKind.QUANT, ActionKind.LLOYD_MAX) and param != 0:
        raise _HeaderFieldError(f"parameter field is {param}, must be 0 for {kind.name}")
    return Header(kind, n, bucket, levels, topk, trits, version)


def payload_length(buffer: torch.Tensor, offset: int = 0, name: str = "tensor") -> int:
    """Bytes of the payload that starts at ``offset`` of ``buffer`` (uint8, payloads back to back, as an allgather
    delivers them): its header is validated and the buffer must hold all of it, else :class:`WireFormatError`."""
    available = buffer.numel() - offset
    if available < HEADER_BYTES:
        raise WireFormatError(f"{name}: truncated payload: {available} bytes left, a header alone is {HEADER_BYTES}")
    header = parse_header(buffer[offset:offset + HEADER_BYTES], name, check_length=False)
    if available < header.payload_nbytes:
        raise WireFormatError(f"{name}: truncated payload: {available} bytes left, expected "
                              f"{header.payload_nbytes} ({header.kind.name}, n={header.n})")
    return header.payload_nbytes

