"""Pure PyTorch reference of the SafeBits kernels: the test oracle.

Readable rather than fast: every quantizer works on a ``(buckets, B)`` matrix (the tensor viewed bucket by
bucket, the last bucket padded) and mirrors ``safebits_math.h`` operation by operation, so that ``out`` and
``e`` are bit-identical to the C and CUDA backends. Statistics are float64 sums (their summation order differs
from the compiled backends, so they agree to ~1e-12 relative, not bitwise).

The packed wire format (:mod:`safebits_hvd.codec.wire`): :func:`quantize_pack_ef` and :func:`decode` build and read
payloads from the same code/value split as ``safebits_math.h`` (``sb_quant_code``/``sb_quant_value``...).
"""

from __future__ import annotations

import torch

from .. import rng
from ..actions import (
    Action,
    ActionKind,
    Menu,
    index_bits,
    lloyd_max_levels,
    lloyd_max_scale_factors,
    lloyd_max_thresholds,
    quant_code_bits,
)
from ..wire import HEADER_BYTES, Header, WireFormatError

NAME = "reference"
"""The backend's name (:func:`safebits_hvd.codec.kernels.backend_name`)."""
PACKS_GROUPS = False
"""No multi-tensor passes: ``kernels.pack_group`` and ``decode_group`` loop over the per-tensor functions."""
ON_HOST = True
"""Results are host memory: nothing to read back."""
TAKES_ADDRESSES = False

_SIGN_BIT = -(2**31)

SUM_LANES = 8
"""Lanes of the float64 SIGN-scale sum (``SB_SUM_LANES`` in ``safebits_math.h``)."""


def abs_key(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` as an ordered int32 key (the float bits without the sign; NaN above inf), as ``sb_abs_key``."""
    return x.view(torch.int32) & 0x7FFFFFFF


def bucket_matrix(v: torch.Tensor, bucket_size: int, buckets: torch.Tensor | None = None):
    """``(vp, j, lens)``: the listed buckets of ``v`` as a zero-padded ``(m, B)`` matrix, the global element
    index of every cell, and every bucket's length."""
    n = v.numel()
    nb = -(-n // bucket_size)
    if buckets is None:
        buckets = torch.arange(nb, dtype=torch.int64, device=v.device)
    buckets = buckets.to(device=v.device, dtype=torch.int64)
    j = buckets[:, None] * bucket_size + torch.arange(bucket_size, device=v.device)[None, :]
    valid = j < n
    vp = torch.where(valid, v[j.clamp(max=max(n - 1, 0))], torch.zeros((), dtype=v.dtype, device=v.device))
    lens = valid.sum(dim=1)
    return vp, j, lens


def quant_code(vp: torch.Tensor, j: torch.Tensor, action: Action,
               key: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QUANT codes of the bucket matrix, as ``sb_quant_code`` / ``sb_quant_sign``: ``(scale (m, 1), c, neg)``
    with magnitudes ``c`` (exact float32 integers) and the int32 sign bits ``neg`` of q. A zero bucket has
    ``scale`` 0 and codes 0 (it decodes to +0.0)."""
    f32 = torch.float32
    scale = abs_key(vp).amax(dim=1, keepdim=True).view(f32)  # max |v| (bit pattern max)
    s = torch.tensor(float(action.levels), dtype=f32, device=vp.device)
    u = rng.uniform(key, j) if action.stochastic else torch.full_like(vp, 0.5)
    bits = vp.view(torch.int32)
    r = ((bits & 0x7FFFFFFF).view(f32) / scale) * s               # |v| / scale * s
    t = r + u
    t = torch.where(t < s, t, s)                                 # min(., s); NaN -> s, as the C clamp
    c = torch.trunc(t)                                           # t >= 0: truncation is floor
    neg = bits & _SIGN_BIT                                       # the sign bit of v ...
    if action.packs_trits:
        neg = torch.where(c != 0, neg, 0)                        # ... but a trit has no -0
    zero_bucket = scale == 0
    return scale, torch.where(zero_bucket, 0.0, c), torch.where(zero_bucket, 0, neg)


def quant_value(c: torch.Tensor, neg: torch.Tensor, scale: torch.Tensor, levels: float) -> torch.Tensor:
    """``sb_quant_value``: ``c * (scale / s)`` carrying the sign bits ``neg``."""
    s = torch.tensor(levels, dtype=torch.float32, device=c.device)
    return ((c * (scale / s)).view(torch.int32) | neg).view(torch.float32)


def lane_sum(a: torch.Tensor) -> torch.Tensor:
    """Per bucket ``(m,)``: the lane-ordered sum, in ``a``'s dtype, of the ``(m, B)`` matrix ``a`` (padding cells
    zero), as ``sb_lane_sum`` in ``cpu.c``: element i to lane i % 8 in index order, then lanes 0, 1, ..., 7."""
    m, b = a.shape
    bp = -(-b // SUM_LANES) * SUM_LANES
    a = torch.nn.functional.pad(a, (0, bp - b)).view(m, bp // SUM_LANES, SUM_LANES)
    acc = torch.zeros((m, SUM_LANES), dtype=a.dtype, device=a.device)
    for step in range(bp // SUM_LANES):                         # each lane sums in element order
        acc = acc + a[:, step, :]
    total = acc[:, 0]
    for lane in range(1, SUM_LANES):                             # then lanes 0, 1, ..., 7
        total = total + acc[:, lane]
    return total


def sign_scale(vp: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """SIGN scale per bucket ``(m, 1)``: the lane-ordered float64 mean of ``|v|``, as in ``cpu.c``."""
    a = vp.double()
    return (lane_sum(torch.where(a < 0, -a, a)) / lens.double()).float()[:, None]


def lloyd_max_code(vp: torch.Tensor, lens: torch.Tensor,
                   action: Action) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LLOYD_MAX codes of the bucket matrix, as ``sb_lm_best_scale`` / ``sb_lm_code`` / ``sb_quant_sign``:
    ``(scale (m, 1), c, neg)``: the chosen multiple of the bucket's RMS, magnitude indices ``c`` (exact float32
    integers) and the int32 sign bits of q (none on a trit's 0)."""
    f32 = torch.float32
    vd = vp.double()
    bits = vp.view(torch.int32)
    rms = torch.sqrt(lane_sum(vd * vd) / lens.double()).float()[:, None]
    valid = torch.arange(vp.shape[1], device=vp.device)[None, :] < lens[:, None]
    scale = best_err = None
    for factor in lloyd_max_scale_factors():                      # the first least squared error wins
        candidate = rms * torch.tensor(factor, dtype=f32, device=vp.device)
        c, _ = _lloyd_max_code_at(vp, candidate, action)
        d = lloyd_max_value(c, torch.zeros_like(bits), candidate, action.levels) - (bits & 0x7FFFFFFF).view(f32)
        err = lane_sum(torch.where(valid, d * d, 0.0))[:, None]          # sb_lm_err2, float32 lanes
        if scale is None:
            scale, best_err = candidate, err
        else:
            better = err < best_err
            scale, best_err = torch.where(better, candidate, scale), torch.where(better, err, best_err)
    c, neg = _lloyd_max_code_at(vp, scale, action)
    return scale, c, neg


def _lloyd_max_code_at(vp: torch.Tensor, scale: torch.Tensor, action: Action) -> tuple[torch.Tensor, torch.Tensor]:
    """``sb_lm_code`` / ``sb_quant_sign`` at a given per-bucket scale ``(m, 1)``: ``(c, neg)``."""
    f32 = torch.float32
    thresholds = torch.tensor(lloyd_max_thresholds(action.levels), dtype=f32, device=vp.device)
    bits = vp.view(torch.int32)
    r = (bits & 0x7FFFFFFF).view(f32) * (1.0 / scale)            # the reciprocal, as sb_lm_code
    c = (r[..., None] >= thresholds).sum(dim=-1).to(f32)          # NaN compares false: c = 0
    neg = bits & _SIGN_BIT
    if action.packs_trits:
        neg = torch.where(c != 0, neg, 0)
    return c, neg


def lloyd_max_value(c: torch.Tensor, neg: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    """``sb_lm_value``: ``level[c] * scale`` carrying the sign bits ``neg``."""
    table = torch.tensor(lloyd_max_levels(levels), dtype=torch.float32, device=c.device)
    return ((table[c.long()] * scale).view(torch.int32) | neg).view(torch.float32)


def topk_kept(vp: torch.Tensor, j: torch.Tensor, lens: torch.Tensor, action: Action) -> torch.Tensor:
    """TOPK: the boolean mask of kept cells (the ``min(k, len)`` largest ``|v|``, ties lowest index first)."""
    m, b = vp.shape
    keys = abs_key(vp)
    valid = j < j[:, :1] + lens[:, None]
    keys = torch.where(valid, keys, torch.full_like(keys, -1))                   # padding never kept
    # stable descending sort: ties keep the lower index first
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(b, device=vp.device).expand(m, b).contiguous())
    return rank < lens.clamp(max=action.topk_per_bucket)[:, None]


def quantize_buckets(vp: torch.Tensor, j: torch.Tensor, lens: torch.Tensor, action: Action,
                     key: int) -> torch.Tensor:
    """``Q_action`` of the ``(m, B)`` bucket matrix ``vp``.

    Padding cells are zeros; their outputs are ignored.
    """
    kind = action.kind
    zero = torch.zeros((), dtype=torch.float32, device=vp.device)
    if kind == ActionKind.FLOAT32:
        return vp.clone()
    if kind == ActionKind.FLOAT16:
        return vp.half().float()
    if kind == ActionKind.BFLOAT16:
        return vp.bfloat16().float()
    if kind == ActionKind.QUANT:
        scale, c, neg = quant_code(vp, j, action, key)
        return quant_value(c, neg, scale, float(action.levels))
    if kind == ActionKind.SIGN:
        scale = sign_scale(vp, lens)
        return torch.where(vp >= 0, scale, -scale)
    if kind == ActionKind.LLOYD_MAX:
        scale, c, neg = lloyd_max_code(vp, lens, action)
        return lloyd_max_value(c, neg, scale, action.levels)
    if kind == ActionKind.TOPK:
        return torch.where(topk_kept(vp, j, lens, action), vp.bfloat16().float(), zero)
    raise ValueError(f"unknown action kind {kind!r}")


def _stats(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    qd, vd = q.double(), v.double()
    d = qd - vd
    per_bucket = torch.stack([d * d, qd * vd, qd * qd, vd * vd], dim=-1).sum(dim=1)  # (m, 4)
    return per_bucket.sum(dim=0) if per_bucket.numel() else torch.zeros(4, dtype=torch.float64)


def _v(g: torch.Tensor | None, e: torch.Tensor) -> torch.Tensor:
    return e.clone() if g is None else g + e


def screen(g: torch.Tensor | None, e: torch.Tensor, menu: Menu, key: int,
           buckets: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`safebits_hvd.codec.kernels.screen`."""
    v = _v(g, e)
    out = torch.zeros((len(menu), 4), dtype=torch.float64, device=e.device)
    if v.numel() == 0:
        return out
    vp, j, lens = bucket_matrix(v, menu.bucket_size, buckets)
    valid = (j < v.numel()).to(torch.float32)
    for i, action in enumerate(menu):
        q = quantize_buckets(vp, j, lens, action, key)
        q = torch.where(valid > 0, q, torch.zeros((), dtype=q.dtype, device=q.device))
        out[i] = _stats(q, vp)
    return out


def quantize_ef(g: torch.Tensor | None, e: torch.Tensor, out: torch.Tensor, action: Action,
                key: int) -> torch.Tensor:
    """Reference of :func:`safebits_hvd.codec.kernels.quantize_ef`."""
    n = e.numel()
    if n == 0:
        return torch.zeros(4, dtype=torch.float64, device=e.device)
    v = _v(g, e)
    vp, j, lens = bucket_matrix(v, action.bucket_size, None)
    q = quantize_buckets(vp, j, lens, action, key).reshape(-1)[:n]
    out.copy_(q)
    e.copy_(v - q)
    qb = torch.nn.functional.pad(q, (0, vp.numel() - n)).view_as(vp)
    return _stats(qb, vp)


_POW3 = (1, 3, 9, 27, 81)


def pack_bits(words: torch.Tensor, nbits: int) -> torch.Tensor:
    """LSB-first bitstream of ``nbits``-bit words, zero-padded to a whole byte (uint8)."""
    if words.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=words.device)
    shifts = torch.arange(nbits, device=words.device)
    bits = ((words.to(torch.int64)[:, None] >> shifts) & 1).reshape(-1)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8)).view(-1, 8)
    return (bits << torch.arange(8, device=words.device)).sum(dim=1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, count: int, nbits: int) -> torch.Tensor:
    """The first ``count`` words of ``nbits`` bits of an LSB-first bitstream (int64)."""
    bits = (data.to(torch.int64)[:, None] >> torch.arange(8, device=data.device)) & 1
    bits = bits.reshape(-1)[:count * nbits].view(count, nbits)
    return (bits << torch.arange(nbits, device=data.device)).sum(dim=1)


def pack_trits(digits: torch.Tensor) -> torch.Tensor:
    """5 base-3 digits per byte, digit i weighing 3^i (uint8)."""
    d = torch.nn.functional.pad(digits.to(torch.int64), (0, -digits.numel() % 5)).view(-1, 5)
    return (d * torch.tensor(_POW3, device=d.device)).sum(dim=1).to(torch.uint8)


def unpack_trits(data: torch.Tensor, count: int) -> torch.Tensor:
    d = (data.to(torch.int64)[:, None] // torch.tensor(_POW3, device=data.device)) % 3
    return d.reshape(-1)[:count]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def quantize_pack_ef(g: torch.Tensor | None, e: torch.Tensor, payload: torch.Tensor, action: Action,
                     key: int, into: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`safebits_hvd.codec.kernels.quantize_pack_ef` (the header is already in ``payload``)."""
    n = e.numel()
    if n == 0:
        return torch.zeros(4, dtype=torch.float64, device=e.device)
    v = _v(g, e)
    vp, j, lens = bucket_matrix(v, action.bucket_size, None)
    valid = j < n
    kind = action.kind
    if kind == ActionKind.FLOAT32:
        q = vp.clone()
        parts = [q[valid]]
    elif kind == ActionKind.FLOAT16:
        q = vp.half().float()
        parts = [q[valid].half()]                                   # exact: q is a half value
    elif kind == ActionKind.BFLOAT16:
        q = vp.bfloat16().float()
        parts = [(q[valid].view(torch.int32) >> 16).to(torch.int16)]
    elif kind == ActionKind.QUANT:
        scale, c, neg = quant_code(vp, j, action, key)
        q = quant_value(c, neg, scale, float(action.levels))
        negbit = (neg != 0).to(torch.int64)[valid]
        ci = c[valid].to(torch.int64)
        if action.packs_trits:
            codes = pack_trits(ci + negbit)
        else:
            codes = pack_bits(ci | (negbit << (quant_code_bits(action.levels) - 1)), quant_code_bits(action.levels))
        parts = [scale.reshape(-1), codes]
    elif kind == ActionKind.LLOYD_MAX:
        scale, c, neg = lloyd_max_code(vp, lens, action)
        q = lloyd_max_value(c, neg, scale, action.levels)
        negbit = (neg != 0).to(torch.int64)[valid]
        ci = c[valid].to(torch.int64)
        if action.packs_trits:
            codes = pack_trits(ci + negbit)
        else:
            cb = index_bits(action.levels)
            codes = pack_bits(ci | (negbit << (cb - 1)), cb)
        parts = [scale.reshape(-1), codes]
    elif kind == ActionKind.SIGN:
        scale = sign_scale(vp, lens)
        q = torch.where(vp >= 0, scale, -scale)
        parts = [scale.reshape(-1), pack_bits((~(vp >= 0)).to(torch.int64)[valid], 1)]
    elif kind == ActionKind.TOPK:
        kept = topk_kept(vp, j, lens, action)
        q = torch.where(kept, vp.bfloat16().float(), torch.zeros((), device=vp.device))
        local = torch.arange(action.bucket_size, device=vp.device).expand_as(vp)
        parts = [(q[kept].view(torch.int32) >> 16).to(torch.int16),       # row-major: bucket, then index
                 pack_bits(local[kept], index_bits(action.bucket_size))]
    else:
        raise ValueError(f"unknown action kind {kind!r}")
    body = torch.cat([_bytes(p) for p in parts])
    payload[HEADER_BYTES:].copy_(body)
    qf = q.reshape(-1)[:n]
    e.copy_(v - qf)
    if into is not None:
        into.copy_(qf)
    return _stats(torch.where(valid, q, torch.zeros((), device=q.device)), vp)


def decode(payload: torch.Tensor, header: Header, out: torch.Tensor, accumulate: bool, name: str,
           divisor: float = 1.0) -> None:
    """Reference of the decoder: ``out = decode``, or ``out = (out + decode) / divisor``, of a payload whose header
    was validated."""
    n, bsize = header.n, header.bucket_size
    if n == 0:
        return
    body = payload[HEADER_BYTES:].clone()           # aligned copy, so that dtype views are allowed
    nb = -(-n // bsize)
    bucket_of = torch.arange(n, device=out.device) // bsize
    if header.kind == ActionKind.FLOAT32:
        x = body.view(torch.float32)
    elif header.kind == ActionKind.FLOAT16:
        x = body.view(torch.float16).float()
    elif header.kind == ActionKind.BFLOAT16:
        x = (body.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    elif header.kind in (ActionKind.QUANT, ActionKind.SIGN, ActionKind.LLOYD_MAX):
        scale = body[:4 * nb].view(torch.float32)[bucket_of]
        codes = body[4 * nb:]
        if header.kind == ActionKind.SIGN:
            x = torch.where(unpack_bits(codes, n, 1) == 1, -scale, scale)
        elif header.kind == ActionKind.LLOYD_MAX:
            if header.trits:
                w = unpack_trits(codes, n)
                c, neg = (w != 0).float(), torch.where(w == 2, _SIGN_BIT, 0).to(torch.int32)
            else:
                cb = index_bits(header.levels)
                w = unpack_bits(codes, n, cb)
                c = (w & ((1 << (cb - 1)) - 1)).float()
                neg = torch.where((w >> (cb - 1)) & 1 == 1, _SIGN_BIT, 0).to(torch.int32)
            x = lloyd_max_value(c, neg, scale, header.levels)
        elif header.trits:
            w = unpack_trits(codes, n)
            x = quant_value((w != 0).float(), torch.where(w == 2, _SIGN_BIT, 0).to(torch.int32), scale,
                            float(header.levels))
        else:
            cb = quant_code_bits(header.levels)
            w = unpack_bits(codes, n, cb)
            neg = torch.where((w >> (cb - 1)) & 1 == 1, _SIGN_BIT, 0).to(torch.int32)
            x = quant_value((w & ((1 << (cb - 1)) - 1)).float(), neg, scale, float(header.levels))
    elif header.kind == ActionKind.TOPK:
        lens = torch.clamp(n - torch.arange(nb, device=out.device) * bsize, max=bsize)
        kk = lens.clamp(max=header.topk)
        total = int(kk.sum())
        values = (body[:2 * total].view(torch.int16).to(torch.int32) << 16).view(torch.float32)
        idx = unpack_bits(body[2 * total:], total, index_bits(bsize))
        owner = torch.repeat_interleave(torch.arange(nb, device=out.device), kk)
        first = torch.cumsum(kk, 0) - kk                            # each bucket's first entry
        ascending = torch.ones_like(idx, dtype=torch.bool)
        ascending[1:] = idx[1:] > idx[:-1]
        ascending[first[kk > 0]] = True                             # a bucket's first index has no predecessor
        bad = (idx >= lens[owner]) | ~ascending
        if bool(bad.any()):
            b = int(owner[bad.nonzero()[0, 0]])
            raise WireFormatError(f"{name}: top-k bucket {b} has local indices out of range or not ascending")
        x = torch.zeros(n, dtype=torch.float32, device=out.device)
        x[owner * bsize + idx] = values
    else:
        raise WireFormatError(f"{name}: unknown action kind {header.kind}")
    if accumulate:
        out.add_(x)
        if divisor != 1.0:
            out.div_(divisor)
    else:
        out.copy_(x)
