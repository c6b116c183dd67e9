"""The action menu: what a tensor may be sent as, and what that costs in modeled bits.

An :class:`Action` is a small immutable value: a quantizer *kind* (which the kernels implement), its
parameters, and :meth:`Action.cost`, the number of bits a packed wire format would carry for ``n`` elements.
The modeled bits are what SafeBits budgets; on the Horovod wire every action travels as float32 values
(dequantized), so that ranks which escalate differently still exchange tensors of one dtype and shape.

Cost model (``n`` elements, ``B`` = bucket size in elements, ``nb = ceil(n / B)`` buckets):

=============  =====================================  =============================================
kind           what a packed format carries           modeled bits
=============  =====================================  =============================================
FLOAT32        the values                             ``32 n``
FLOAT16/BF16   the values cast to 16 bits             ``16 n``
QUANT          signed codes in ``[-s, s]`` plus one   ``ceil(code_bits * n) + 32 nb``; ``code_bits`` is
               fp32 scale (max ``|v|``) per bucket    ``1 + ceil(log2(s + 1))`` (int8: s=127, int4: s=7,
                                                      int2: s=1) or ``log2(3)`` for packed ternary
SIGN           one sign bit per element plus one fp32 ``n + 32 nb``
               scale (mean ``|v|``) per bucket
TOPK           per bucket the ``k`` largest ``|v|``:   ``sum_b min(k, len_b) * (ceil(log2 B) + 16)``
               a local index and a bf16 value         with ``k = max(1, round(fraction * B))``
=============  =====================================  =============================================

Every quantizer works within buckets, so one fused pass over the tensor computes it exactly and a sample of
whole buckets estimates its statistics without bias.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

DEFAULT_BUCKET_SIZE = 512
"""Elements per bucket: one fp32 scale per bucket for QUANT and SIGN, the top-k selection unit for TOPK."""

SCALE_BITS = 32
"""Bits of one per-bucket scale (an fp32)."""

TOPK_VALUE_BITS = 16
"""Bits of one top-k value (bf16: the float32 range, so no overflow for any finite gradient)."""


class ActionKind(IntEnum):
    """Quantizer kinds. The integer values are the kernels' ``kind`` argument (see ``kernels/safebits_math.h``)."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    QUANT = 3
    SIGN = 4
    TOPK = 5


@dataclass(frozen=True)
class Action:
    """One entry of the menu.

    Attributes:
        name: unique name, used in telemetry and ``StepRecord.actions``.
        kind: the quantizer.
        code_bits: modeled bits per element of the codes (32, 16, k, log2(3), 1; unused for TOPK).
        levels: QUANT only: magnitudes are rounded to ``{0, 1, ..., levels} * scale / levels``.
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
        if self.kind == ActionKind.TOPK and not 0.0 < self.topk_fraction <= 1.0:
            raise ValueError(f"action {self.name!r}: topk_fraction must be in (0, 1], got {self.topk_fraction}")

    @property
    def lossless(self) -> bool:
        """True for the action that sends the float32 values unchanged (always admissible)."""
        return self.kind == ActionKind.FLOAT32

    @property
    def topk_per_bucket(self) -> int:
        """TOPK only: elements kept per full bucket."""
        return max(1, round(self.topk_fraction * self.bucket_size))

    def cost(self, n: int) -> int:
        """Modeled bits to send ``n`` elements with this action (see the module docstring)."""
        if n < 0:
            raise ValueError(f"element count must be >= 0, got {n}")
        buckets = -(-n // self.bucket_size)
        if self.kind in (ActionKind.FLOAT32, ActionKind.FLOAT16, ActionKind.BFLOAT16):
            return int(self.code_bits) * n
        if self.kind in (ActionKind.QUANT, ActionKind.SIGN):
            return math.ceil(self.code_bits * n) + SCALE_BITS * buckets
        # TOPK: full buckets keep k each, the last (partial) bucket keeps min(k, its length).
        k = self.topk_per_bucket
        full, rest = divmod(n, self.bucket_size)
        kept = full * min(k, self.bucket_size) + min(k, rest)
        return kept * (math.ceil(math.log2(self.bucket_size)) + TOPK_VALUE_BITS)

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
    """TernGrad: stochastic ``{-1, 0, +1} * max|v|`` per bucket, packed at log2(3) bits per element."""
    return Action("ternary", ActionKind.QUANT, math.log2(3), levels=1, stochastic=True, bucket_size=bucket_size)


def scaled_sign(*, bucket_size: int = DEFAULT_BUCKET_SIZE) -> Action:
    """EF-SignSGD: ``sign(v) * mean|v|`` per bucket (``sign(0) = +1``: one bit cannot carry a zero)."""
    return Action("sign", ActionKind.SIGN, 1, bucket_size=bucket_size)


def topk(fraction: float, *, bucket_size: int = DEFAULT_BUCKET_SIZE) -> Action:
    """Top-k per bucket: the ``round(fraction * bucket_size)`` largest magnitudes, as bf16 values."""
    return Action(f"topk{fraction * 100:g}", ActionKind.TOPK, 0, topk_fraction=fraction, bucket_size=bucket_size)


FP32 = Action("fp32", ActionKind.FLOAT32, 32)
FP16 = Action("fp16", ActionKind.FLOAT16, 16)
BF16 = Action("bf16", ActionKind.BFLOAT16, 16)


def _registry(bucket_size: int = DEFAULT_BUCKET_SIZE) -> dict[str, Action]:
    actions = [FP32, FP16, BF16,
               *(qsgd(b, stochastic=s, bucket_size=bucket_size) for b in (8, 4, 2) for s in (True, False)),
               ternary(bucket_size=bucket_size), scaled_sign(bucket_size=bucket_size),
               topk(0.1, bucket_size=bucket_size), topk(0.01, bucket_size=bucket_size)]
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


DEFAULT_MENU = make_menu(["fp32", "fp16", "bf16", "int8", "int4", "int2", "ternary", "sign", "topk10", "topk1"])
"""The default menu: full and half precision, QSGD 8/4/2-bit, TernGrad, EF-SignSGD and top-k at 10% and 1%."""
