"""Pure PyTorch reference of the SafeBits kernels: the test oracle.

Readable rather than fast: every quantizer works on a ``(buckets, B)`` matrix (the tensor viewed bucket by
bucket, the last bucket padded) and mirrors ``safebits_math.h`` operation by operation, so that ``out`` and
``e`` are bit-identical to the C and CUDA backends. Statistics are float64 sums (their summation order differs
from the compiled backends, so they agree to ~1e-12 relative, not bitwise).
"""

from __future__ import annotations

import torch

from .. import rng
from ..actions import Action, ActionKind, Menu

_SIGN_BIT = -(2**31)

SUM_LANES = 8
"""Lanes of the float64 SIGN-scale sum (``SB_SUM_LANES`` in ``safebits_math.h``)."""


def abs_key(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` as an ordered int32 key (the float bits without the sign; NaN above inf), as ``sb_abs_key``."""
    return x.view(torch.int32) & 0x7FFFFFFF


def _buckets(v: torch.Tensor, bucket_size: int, buckets: torch.Tensor | None):
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


def quantize_buckets(vp: torch.Tensor, j: torch.Tensor, lens: torch.Tensor, action: Action,
                     key: int) -> torch.Tensor:
    """``Q_action`` of the ``(m, B)`` bucket matrix ``vp``.

    Padding cells are zeros; their outputs are ignored.
    """
    kind = action.kind
    f32 = torch.float32
    zero = torch.zeros((), dtype=f32, device=vp.device)
    if kind == ActionKind.FLOAT32:
        return vp.clone()
    if kind == ActionKind.FLOAT16:
        return vp.half().float()
    if kind == ActionKind.BFLOAT16:
        return vp.bfloat16().float()
    if kind == ActionKind.QUANT:
        scale = abs_key(vp).amax(dim=1, keepdim=True).view(f32)  # max |v| (bit pattern max)
        s = torch.tensor(float(action.levels), dtype=f32, device=vp.device)
        u = rng.uniform(key, j) if action.stochastic else torch.full_like(vp, 0.5)
        bits = vp.view(torch.int32)
        r = ((bits & 0x7FFFFFFF).view(f32) / scale) * s               # |v| / scale * s
        t = r + u
        t = torch.where(t < s, t, s)                                 # min(., s); NaN -> s, as the C clamp
        c = torch.trunc(t)                                           # t >= 0: truncation is floor
        m = c * (scale / s)
        q = (m.view(torch.int32) | (bits & _SIGN_BIT)).view(f32)     # the sign bit of v
        return torch.where(scale == 0, zero, q)
    if kind == ActionKind.SIGN:
        a = torch.where(vp < 0, -vp, vp).double()
        m, b = a.shape
        bp = -(-b // SUM_LANES) * SUM_LANES
        a = torch.nn.functional.pad(a, (0, bp - b)).view(m, bp // SUM_LANES, SUM_LANES)
        acc = torch.zeros((m, SUM_LANES), dtype=torch.float64, device=vp.device)
        for step in range(bp // SUM_LANES):                         # each lane sums in element order
            acc = acc + a[:, step, :]
        total = acc[:, 0]
        for lane in range(1, SUM_LANES):                             # then lanes 0, 1, ..., 7
            total = total + acc[:, lane]
        scale = (total / lens.double()).float()[:, None]
        return torch.where(vp >= 0, scale, -scale)
    if kind == ActionKind.TOPK:
        m, b = vp.shape
        keys = abs_key(vp)
        valid = j < j[:, :1] + lens[:, None]
        keys = torch.where(valid, keys, torch.full_like(keys, -1))                   # padding never kept
        # stable descending sort: ties keep the lower index first
        order = torch.sort(keys, dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(b, device=vp.device).expand(m, b).contiguous())
        kk = lens.clamp(max=action.topk_per_bucket)[:, None]
        return torch.where(rank < kk, vp.bfloat16().float(), zero)
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
    """Reference of :func:`safebits_hvd.kernels.screen`."""
    v = _v(g, e)
    out = torch.zeros((len(menu), 4), dtype=torch.float64, device=e.device)
    if v.numel() == 0:
        return out
    vp, j, lens = _buckets(v, menu.bucket_size, buckets)
    valid = (j < v.numel()).to(torch.float32)
    for i, action in enumerate(menu):
        q = quantize_buckets(vp, j, lens, action, key)
        q = torch.where(valid > 0, q, torch.zeros((), dtype=q.dtype, device=q.device))
        out[i] = _stats(q, vp)
    return out


def quantize_ef(g: torch.Tensor | None, e: torch.Tensor, out: torch.Tensor, action: Action,
                key: int) -> torch.Tensor:
    """Reference of :func:`safebits_hvd.kernels.quantize_ef`."""
    n = e.numel()
    if n == 0:
        return torch.zeros(4, dtype=torch.float64, device=e.device)
    v = _v(g, e)
    vp, j, lens = _buckets(v, action.bucket_size, None)
    q = quantize_buckets(vp, j, lens, action, key).reshape(-1)[:n]
    out.copy_(q)
    e.copy_(v - q)
    qb = torch.nn.functional.pad(q, (0, vp.numel() - n)).view_as(vp)
    return _stats(qb, vp)
