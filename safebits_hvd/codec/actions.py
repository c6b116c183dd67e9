"""The action menu: what a tensor may be sent as, and what that costs in modeled bits.

An :class:`Action` is a small immutable value: a quantizer *kind* (which the kernels implement), its
parameters, and :meth:`Action.cost`, the number of bits of the packed wire payload body for ``n`` elements
(``safebits_hvd.codec.wire``: ``payload bytes = 16 + cost(n) / 8`` exactly, byte padding included). Each section of a
payload is padded to a whole byte, so every cost is a multiple of 8.

Cost model (``n`` elements, ``B`` = bucket size in elements, ``nb = ceil(n / B)`` buckets,
``pad8(x) = 8 ceil(x / 8)``):

=============  =====================================  =============================================
kind           what the packed format carries         bits (= 8 x body bytes)
=============  =====================================  =============================================
FLOAT32        the values                             ``32 n``
FLOAT16/BF16   the values cast to 16 bits             ``16 n``
QUANT          one fp32 scale (max ``|v|``) per       ``32 nb + pad8(cb n)``; ``cb = 1 + ceil(log2(s+1))``
               bucket, then sign-magnitude codes in   (int8: s=127, cb=8; int4: s=7, cb=4; int2: s=1,
               ``[-s, s]`` at ``cb`` bits each        cb=2)
QUANT ternary  one fp32 scale per bucket, then 5      ``32 nb + 8 ceil(n / 5)`` (1.6 bits per element;
               trits per byte (``code_bits == 1.6``)  the action built by :func:`ternary`)
SIGN           one fp32 scale (mean ``|v|``) per      ``32 nb + pad8(n)``
               bucket, then one sign bit per element
TOPK           per bucket the ``k`` largest ``|v|``:   ``16 K + pad8(ceil(log2 B) K)``, ``K = sum_b
               a bf16 value and a local index         min(k, len_b)``, ``k = max(1, round(fraction * B))``
LLOYD_MAX      one fp32 scale (a multiple of the      ``32 nb + pad8(log2(m) n)`` for ``m`` = 4 ... 64
               bucket's RMS) per bucket, then the     levels; ``32 nb + 8 ceil(n / 5)`` for ``m = 3``
               index of the nearest of ``m`` fixed    (5 trits per byte)
               levels (sign-magnitude words; trits
               for ``m = 3``)
=============  =====================================  =============================================

Every quantizer works within buckets, so one fused pass over the tensor computes it exactly and a sample of
whole buckets estimates its statistics without bias.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

DEFAULT_BUCKET_SIZE = 512
"""Elements per bucket: one fp32 scale per bucket for QUANT and SIGN, the top-k selection unit for TOPK."""

SCALE_BITS = 32
"""Bits of one per-bucket scale (an fp32)."""

TOPK_VALUE_BITS = 16
"""Bits of one top-k value (bf16: the float32 range, so no overflow for any finite gradient)."""


TRIT_BITS = 1.6
"""``code_bits`` of an action packed 5 trits per byte: QUANT with ``levels == 1`` (:func:`ternary`), LLOYD_MAX with
3 levels (:func:`lloyd_max`)."""


class ActionKind(IntEnum):
    """Quantizer kinds. The integer values are the kernels' ``kind`` argument (see ``kernels/safebits_math.h``)."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    QUANT = 3
    SIGN = 4
    TOPK = 5
    LLOYD_MAX = 6


LLOYD_MAX_LEVELS: dict[int, tuple[float, ...]] = {
    3: (0.0, 1.224),
    4: (0.4528, 1.5104),
    8: (0.2451, 0.7560, 1.3439, 2.1520),
    16: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326),
    32: (0.0659, 0.1981, 0.3314, 0.4667, 0.6049, 0.7471, 0.8946, 1.0488, 1.2118, 1.3863, 1.5762, 1.7872, 2.0287,
         2.3177, 2.6911, 3.2607),
    64: (0.0334, 0.1003, 0.1673, 0.2346, 0.3022, 0.3703, 0.4389, 0.5083, 0.5785, 0.6497, 0.7219, 0.7955, 0.8705,
         0.9472, 1.0257, 1.1065, 1.1897, 1.2758, 1.3651, 1.4583, 1.5558, 1.6586, 1.7675, 1.8840, 2.0096, 2.1468,
         2.2990, 2.4713, 2.6723, 2.9174, 3.2404, 3.7441),
}
"""Non-negative magnitudes of the Lloyd-Max (MSE-optimal) quantizers of a unit Gaussian with 3, 4, 8 and 16 levels
(the levels are ``+-`` these, one 0 for 3 levels), and with 32 and 64 (5 and 6 bits; Lloyd's iteration on the
Gaussian density: ``python -m bench.experiments.action_frontier --lloyd-max``), in units of the bucket's scale.
The kernels round to the nearest level: the thresholds are the midpoints (:func:`lloyd_max_thresholds`); the
tables reach the C and CUDA code as float32 constants from here (``kernels/source.py``). Why this scale:
docs/DESIGN.md, "Why LLOYD_MAX"."""

LLOYD_MAX_SCALE_FACTORS: tuple[float, ...] = (1.0, math.sqrt(2.0), 2.0)
"""Candidate scales of a LLOYD_MAX bucket, as multiples of its RMS: the encoder keeps the one with the least squared
error on the bucket (the first on a tie). The Gaussian optimum is 1; gradients' heavy-tailed buckets need more
(docs/RESULTS.md, section 6)."""


def lloyd_max_scale_factors() -> tuple[float, ...]:
    """:data:`LLOYD_MAX_SCALE_FACTORS` as float32 values."""
    return tuple(_float32(x) for x in LLOYD_MAX_SCALE_FACTORS)


def _float32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def lloyd_max_levels(levels: int) -> tuple[float, ...]:
    """The magnitudes of the ``levels``-level Lloyd-Max quantizer as float32 values (ascending)."""
    return tuple(_float32(x) for x in LLOYD_MAX_LEVELS[levels])


def lloyd_max_thresholds(levels: int) -> tuple[float, ...]:
    """Decision thresholds of nearest rounding between consecutive magnitudes (float32, ascending): ``|v| / scale
    >= thresholds[k]`` selects magnitude ``k + 1`` or above."""
    mags = LLOYD_MAX_LEVELS[levels]
    return tuple(_float32((a + b) / 2) for a, b in itertools.pairwise(mags))


def lloyd_max_code_bits(levels: int) -> float:
    """Bits per element of a Lloyd-Max code: :data:`TRIT_BITS` for 3 levels (5 trits per byte), else ``log2``."""
    return TRIT_BITS if levels == 3 else math.log2(levels)




def quant_code_bits(levels: int) -> int:
    """Bits of one sign-magnitude QUANT code with magnitudes ``0..levels``: a sign bit plus the magnitude."""
    return 1 + math.ceil(math.log2(levels + 1))


def index_bits(bucket_size: int) -> int:
    """Bits of one top-k local index within a bucket of ``bucket_size`` elements."""
    return math.ceil(math.log2(bucket_size))


def _bytes_bits(bits: int) -> int:
    """``bits`` rounded up to whole bytes (every payload section ends on a byte boundary)."""
    return -(-bits // 8) * 8


def body_bits(kind: ActionKind, n: int, bucket_size: int, levels: int = 0, topk: int = 0,
              trits: bool = False) -> int:
    """Bits of the packed payload body (``safebits_hvd.codec.wire``) of ``n`` elements: the ONE size formula, used by
    :meth:`Action.cost` and by the wire decoder's length check (from header fields).

    ``levels``: QUANT magnitudes, LLOYD_MAX levels; ``topk``: TOPK elements kept per full bucket; ``trits``: codes
    packed 5 trits per byte (QUANT with ``levels == 1``, LLOYD_MAX with 3 levels).
    """
    if n < 0:
        raise ValueError(f"element count must be >= 0, got {n}")
    buckets = -(-n // bucket_size)
    if kind == ActionKind.FLOAT32:
        return 32 * n
    if kind in (ActionKind.FLOAT16, ActionKind.BFLOAT16):
        return 16 * n
    if kind == ActionKind.QUANT:
        codes = 8 * -(-n // 5) if trits else _bytes_bits(quant_code_bits(levels) * n)
        return SCALE_BITS * buckets + codes
    if kind == ActionKind.LLOYD_MAX:
        codes = 8 * -(-n // 5) if trits else _bytes_bits(index_bits(levels) * n)
        return SCALE_BITS * buckets + codes
    if kind == ActionKind.SIGN:
        return SCALE_BITS * buckets + _bytes_bits(n)
    if kind == ActionKind.TOPK:
        # full buckets keep k each, the last (partial) bucket keeps min(k, its length)
        full, rest = divmod(n, bucket_size)
        kept = full * min(topk, bucket_size) + min(topk, rest)
        return TOPK_VALUE_BITS * kept + _bytes_bits(index_bits(bucket_size) * kept)
    raise ValueError(f"unknown action kind {kind!r}")


@dataclass(frozen=True)
class Action:
    """One entry of the menu.

    Attributes:
        name: unique name, used in telemetry and ``StepRecord.actions``.
        kind: the quantizer.
        code_bits: bits per element of the codes (32, 16, ``quant_code_bits(levels)``, :data:`TRIT_BITS` for
            packed ternary, 1; unused for TOPK). For QUANT and LLOYD_MAX it must match the wire format (checked).
        levels: QUANT: magnitudes are rounded to ``{0, 1, ..., levels} * scale / levels``; LLOYD_MAX: the number
            of levels (a key of :data:`LLOYD_MAX_LEVELS`).
        stochastic: QUANT only: stochastic (unbiased) rounding with the counter-based RNG, else nearest.
        topk_fraction: TOPK only: fraction of each bucket that is kept.
        bucket_size: elements per bucket.
    """

    name: str
    kind: ActionKind
    code_bits: float
    levels: int = 0
    stochastic: bool = False
    topk_fraction: float = 0.0
    bucket_size: int = DEFAULT_BUCKET_SIZE

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an action needs a non-empty name")
        if self.bucket_size < 2 or self.bucket_size > 65536:
            raise ValueError(f"action {self.name!r}: bucket_size must be in [2, 65536], got {self.bucket_size}")
        if self.kind == ActionKind.QUANT and not 1 <= self.levels <= 2**15 - 1:
            raise ValueError(f"action {self.name!r}: levels must be in [1, 32767], got {self.levels}")
        if self.kind == ActionKind.QUANT and self.code_bits != quant_code_bits(self.levels) and not self.packs_trits:
            raise ValueError(f"action {self.name!r}: QUANT with levels={self.levels} packs codes at "
                             f"{quant_code_bits(self.levels)} bits (or {TRIT_BITS} for levels=1 trits), "
                             f"got code_bits={self.code_bits}")
        if self.kind == ActionKind.LLOYD_MAX:
            if self.levels not in LLOYD_MAX_LEVELS:
                raise ValueError(f"action {self.name!r}: LLOYD_MAX levels must be one of {sorted(LLOYD_MAX_LEVELS)}, "
                                 f"got {self.levels}")
            if self.code_bits != lloyd_max_code_bits(self.levels):
                raise ValueError(f"action {self.name!r}: LLOYD_MAX with {self.levels} levels packs codes at "
                                 f"{lloyd_max_code_bits(self.levels)} bits, got code_bits={self.code_bits}")
            if self.stochastic:
                raise ValueError(f"action {self.name!r}: LLOYD_MAX rounds to the nearest level (no stochastic mode)")
        if self.kind == ActionKind.TOPK and not 0.0 < self.topk_fraction <= 1.0:
            raise ValueError(f"action {self.name!r}: topk_fraction must be in (0, 1], got {self.topk_fraction}")

    @property
    def lossless(self) -> bool:
        """True for the action that sends the float32 values unchanged (always admissible)."""
        return self.kind == ActionKind.FLOAT32

    @property
    def packs_trits(self) -> bool:
        """Codes packed 5 trits per byte (no -0.0): QUANT with ``levels == 1`` and ``code_bits == TRIT_BITS``, and
        LLOYD_MAX with 3 levels."""
        if self.kind == ActionKind.LLOYD_MAX:
            return self.levels == 3
        return self.kind == ActionKind.QUANT and self.levels == 1 and self.code_bits == TRIT_BITS

    @property
    def topk_per_bucket(self) -> int:
        """TOPK only: elements kept per full bucket."""
        return max(1, round(self.topk_fraction * self.bucket_size))

    def cost(self, n: int) -> int:
        """Bits of the packed payload body for ``n`` elements (see the module docstring and :func:`body_bits`)."""
        topk = self.topk_per_bucket if self.kind == ActionKind.TOPK else 0
        return body_bits(self.kind, n, self.bucket_size, self.levels, topk, self.packs_trits)

    def with_bucket_size(self, bucket_size: int) -> Action:
        """The same action with another bucket size."""
        return Action(self.name, self.kind, self.code_bits, self.levels, self.stochastic,
                      self.topk_fraction, bucket_size)


def qsgd(bits: int, *, stochastic: bool = True, bucket_size: int = DEFAULT_BUCKET_SIZE) -> Action:
    """QSGD-style signed ``bits``-bit codes (``levels = 2**(bits-1) - 1``) with one max-abs scale per bucket."""
    if not 2 <= bits <= 16:
        raise ValueError(f"qsgd bits must be in [2, 16], got {bits}")
    name = f"int{bits}" if stochastic else f"int{bits}_nearest"
    return Action(name, ActionKind.QUANT, bits, levels=2 ** (bits - 1) - 1, stochastic=stochastic,
                  bucket_size=bucket_size)


def ternary(*, bucket_size: int = DEFAULT_BUCKET_SIZE) -> Action:
    """TernGrad: stochastic ``{-1, 0, +1} * max|v|`` per bucket, packed 5 trits per byte (1.6 bits each)."""
    return Action("ternary", ActionKind.QUANT, TRIT_BITS, levels=1, stochastic=True, bucket_size=bucket_size)


def scaled_sign(*, bucket_size: int = DEFAULT_BUCKET_SIZE) -> Action:
    """EF-SignSGD: ``sign(v) * mean|v|`` per bucket (``sign(0) = +1``: one bit cannot carry a zero)."""
    return Action("sign", ActionKind.SIGN, 1, bucket_size=bucket_size)


def lloyd_max(levels: int, *, bucket_size: int = DEFAULT_BUCKET_SIZE) -> Action:
    """MSE-optimal quantizer: the nearest of the ``levels``-level Lloyd-Max levels of a unit Gaussian
    (:data:`LLOYD_MAX_LEVELS`) times the bucket's RMS. Biased (nearest rounding): safe through error feedback.

    Names: ``ternary_mse`` (3 levels, 1.6 bits), ``int2_mse`` (4), ``int3_mse`` (8), ``int4_mse`` (16), ``int5_mse``
    (32), ``int6_mse`` (64)."""
    if levels not in LLOYD_MAX_LEVELS:
        raise ValueError(f"Lloyd-Max levels must be one of {sorted(LLOYD_MAX_LEVELS)}, got {levels}")
    name = "ternary_mse" if levels == 3 else f"int{index_bits(levels)}_mse"
    return Action(name, ActionKind.LLOYD_MAX, lloyd_max_code_bits(levels), levels=levels, bucket_size=bucket_size)


def topk(fraction: float, *, bucket_size: int = DEFAULT_BUCKET_SIZE) -> Action:
    """Top-k per bucket: the ``round(fraction * bucket_size)`` largest magnitudes, as bf16 values."""
    return Action(f"topk{fraction * 100:g}", ActionKind.TOPK, 0, topk_fraction=fraction, bucket_size=bucket_size)


FP32 = Action("fp32", ActionKind.FLOAT32, 32)
FP16 = Action("fp16", ActionKind.FLOAT16, 16)
BF16 = Action("bf16", ActionKind.BFLOAT16, 16)


def _registry(bucket_size: int = DEFAULT_BUCKET_SIZE) -> dict[str, Action]:
    actions = [FP32, FP16, BF16,
               *(qsgd(b, stochastic=False, bucket_size=bucket_size) for b in (14, 12, 11, 7, 6, 5, 3)),
               *(qsgd(b, stochastic=s, bucket_size=bucket_size) for b in (8, 4, 2) for s in (True, False)),
               ternary(bucket_size=bucket_size), scaled_sign(bucket_size=bucket_size),
               *(lloyd_max(m, bucket_size=bucket_size) for m in (64, 32, 16, 8, 4, 3)),
               topk(0.1, bucket_size=bucket_size), topk(0.05, bucket_size=bucket_size),
               topk(0.01, bucket_size=bucket_size)]
    return {a.name: a for a in actions}


ACTIONS: dict[str, Action] = _registry()
"""Every built-in action by name (default bucket size)."""


@dataclass(frozen=True)
class Menu:
    """An ordered, validated tuple of actions sharing one bucket size.

    The order is the deterministic tie-break everywhere (allocator, escalation): on equal cost and equal error
    the earlier action wins.
    """

    actions: tuple[Action, ...]
    bucket_size: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.actions:
            raise ValueError("the menu is empty: it needs at least the lossless action 'fp32'")
        names = [a.name for a in self.actions]
        if len(set(names)) != len(names):
            raise ValueError(f"menu has duplicate action names: {names}")
        if not any(a.lossless for a in self.actions):
            raise ValueError(f"menu {names} has no lossless action: add 'fp32' (sb.FP32), the screen's fallback")
        sizes = {a.bucket_size for a in self.actions}
        if len(sizes) != 1:
            raise ValueError(f"all actions of a menu must share one bucket_size, got {sorted(sizes)}")
        object.__setattr__(self, "bucket_size", sizes.pop())

    def __len__(self) -> int:
        return len(self.actions)

    def __iter__(self):
        return iter(self.actions)

    def __getitem__(self, i: int) -> Action:
        return self.actions[i]

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.actions]

    @property
    def lossless_index(self) -> int:
        return next(i for i, a in enumerate(self.actions) if a.lossless)

    def costs(self, n: int) -> list[int]:
        """Modeled bits of every action for ``n`` elements, in menu order."""
        return [a.cost(n) for a in self.actions]


def make_menu(actions: Iterable[str | Action] | Menu, *, bucket_size: int | None = None) -> Menu:
    """Build a :class:`Menu` from action names (keys of :data:`ACTIONS`) and/or :class:`Action` objects.

    ``bucket_size`` (elements) rebuilds every action with that bucket size.
    """
    if isinstance(actions, Menu):
        items: Sequence[str | Action] = actions.actions
    elif isinstance(actions, str):
        raise TypeError("make_menu takes a list of action names, not one string")
    else:
        items = list(actions)
    resolved = []
    for item in items:
        if isinstance(item, Action):
            resolved.append(item)
        elif isinstance(item, str):
            if item not in ACTIONS:
                raise ValueError(f"unknown action {item!r}; known actions: {sorted(ACTIONS)}")
            resolved.append(ACTIONS[item])
        else:
            raise TypeError(f"menu entries must be action names or Action objects, got {type(item).__name__}")
    if bucket_size is not None:
        resolved = [a.with_bucket_size(bucket_size) for a in resolved]
    return Menu(tuple(resolved))


DEFAULT_MENU = make_menu(["fp32", "int14_nearest", "int11_nearest", "int8_nearest", "int7_nearest",
                          "int6_nearest", "int5_nearest", "int5_mse",
                          "int4_nearest", "int4_mse", "int3_mse", "int2_mse", "ternary_mse",
                          "sign", "topk10", "topk5", "topk1"])
"""The default menu: a ladder without gaps from 1 to 16 bits, no neighbouring rungs more than 1.6x apart and no
action dominated (more bits and more distortion) by a cheaper one on Gaussian, Laplace or Student-t(3) data
(docs/RESULTS.md, "The action frontier"):

* fp32, the lossless fallback;
* max-abs-scaled uniform codes with nearest rounding at 14, 11, 8, 7, 6, 5 and 4 bits (the least distortion on
  heavy-tailed gradients);
* the MSE-optimal (Lloyd-Max) 5-, 4-, 3-, 2-bit and ternary codes (the least on Gaussian-like ones);
* EF-SignSGD, and top-k at 10%, 5% and 1%.

fp16 and bf16 are not in it: ``int14_nearest`` sends less distortion in fewer bits, and with an fp32 scale per
bucket it cannot overflow. Where two actions cost the same, the screen's statistics pick the less distorting one per
tensor. The rungs above 4 bits sit so that a budget of 4.4, 8, 12 or 16 bits per parameter is 85% spent even when
one tensor holds nearly all the parameters (docs/RESULTS.md, "The budget spent"). The order is only the tie-break."""
