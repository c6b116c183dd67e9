"""The compressors SafeBits is compared with, as Horovod compressors with SafeBits' modeled-bits accounting.

Each baseline sends every gradient tensor with one fixed :class:`~safebits_hvd.codec.actions.Action` (no screen, no
allocation), through the same fused kernel as SafeBits (:func:`safebits_hvd.codec.kernels.quantize_ef`), and counts
the same modeled bits (:meth:`Action.cost`). With error feedback the residual ``e`` is kept per parameter;
without it a zero residual is passed and dropped, so the kernel computes plain ``Q(g)``.

=============  =========================================  ==========  =============================
registry name  what is sent                               EF          modeled bits (n elements)
=============  =========================================  ==========  =============================
fp32           the gradient (Horovod's NoneCompressor)    -           ``32 n``
fp16           float16 on the wire (Horovod's FP16)       -           ``16 n``
qsgd8/4/2      QSGD codes, stochastic, per-bucket scale   no          ``k n + 32 ceil(n/512)``
terngrad       stochastic ternary, per-bucket scale       no          ``log2(3) n + 32 ceil(n/512)``
signsgd_ef     scaled sign (mean abs per bucket)          yes         ``n + 32 ceil(n/512)``
topk10_ef      top 10% per bucket, bf16 values            yes         ``~0.1 n (9 + 16)``
topk1_ef       top 1% per bucket                          yes         ``~0.01 n (9 + 16)``
unscreened     ``SafeBits(..., screen=False)``            yes         the global budget
safebits       ``SafeBits(...)``                          yes         the global budget
*_maxscaled    the two above on :data:`MAX_SCALED_MENU`   yes         the global budget
*_quantizers   the two above on :data:`QUANTIZER_MENU`    yes         the global budget
=============  =========================================  ==========  =============================

Like SafeBits, a compressor matches a gradient to its parameter by identity (``p.grad is tensor``), and a step
is complete once every registered parameter has been compressed; it then records a
:class:`~safebits_hvd.policy.telemetry.StepRecord` (``last_step``, ``history``) with ``violation=False`` and no
escalations (a fixed compressor has no budget to violate: ``budget_bits_total`` is what it used).

    compression = safebits_hvd.frontends.baselines.REGISTRY["qsgd4"](model.named_parameters(), seed=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from ..codec.actions import FP16, FP32, Action, Menu, make_menu, qsgd, scaled_sign, ternary, topk
from ..comm.exchange import LocalExchange
from ..policy.budget import FixedActionPolicy
from ..step.core import SafeBitsCore
from .horovod import Compressor, Context, CoreCompressor, SafeBits
from .shared import registered_parameters

__all__ = ["BUDGETED", "MAX_SCALED_MENU", "QUANTIZER_MENU", "REGISTRY", "FixedActionCompressor", "label",
           "make_compressor"]

MAX_SCALED_MENU = make_menu(["fp32", "fp16", "int8", "int4", "int2", "ternary"])
"""The QSGD / TernGrad-style menu: every quantizer scales by its bucket's max |v| with stochastic rounding. Its
cheap actions do not contract (``int2`` and ``ternary``: normalized distortion about 1.6-1.8 on the demo's
gradients, docs/RESULTS.md 6.1), so under error feedback an unscreened allocation that leans on them at a tight
budget grows the residual instead of shrinking it: the regime in which the screen matters (docs/RESULTS.md 2.1)."""

QUANTIZER_MENU = make_menu(["fp32", "fp16", "int8", "int4", "int2", "ternary", "sign"])
"""The quantizers of the paper's menu without its sparsifier (top-k): :data:`MAX_SCALED_MENU` plus scaled sign. Its
cheapest configuration is scaled sign on every tensor (about 1.07 bits per parameter), which an unscreened
allocation picks at a 1-bit budget and which collapses the demo CNN; the screen refuses ``int2`` and ``ternary``,
and sign wherever its distortion exceeds 0.5 (docs/RESULTS.md 2.1, 9.2)."""


class FixedActionCompressor(CoreCompressor):
    """Send every gradient with one action, with or without error feedback; account modeled bits per step.

    The same core as SafeBits (:class:`~.core.SafeBitsCore`) with a fixed policy (:class:`~.policy.FixedActionPolicy`:
    no screen, no allocation), so parameter matching, step closing, records and checkpoints are SafeBits' own.
    Records are this rank's (no statistics exchange between ranks: there is nothing to agree on).

    Args:
        named_parameters: ``(name, parameter)`` pairs; gradients are matched to them by identity.
        action: the action every tensor is sent with.
        error_feedback: keep the residual ``e <- v - Q(v)`` per parameter (else ``Q(g)``, no memory).
        seed: seed of the counter-based stochastic-rounding RNG (key per seed, step, tensor index).
        wire_dtype: None: the kernel's float32 output is sent (dequantized values). ``torch.float16``:
            Horovod's FP16Compressor semantics (allreduce in float16, cast back); fp16 action only.
        max_history: records kept in :attr:`history`.
        collective: as :class:`~safebits_hvd.SafeBits`' (``"auto"``: packed payloads by allgather where they move
            fewer bytes than a float32 allreduce).

    Attributes:
        bits_per_step: modeled bits of one step (sum over parameters of ``action.cost(numel)``).
        last_step, history: :class:`StepRecord` of the last / last ``max_history`` completed steps.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], action: Action, *,
                 error_feedback: bool, seed: int = 0, wire_dtype: torch.dtype | None = None,
                 max_history: int = 10000, collective: str = "auto") -> None:
        if wire_dtype is not None and action.name != FP16.name:
            raise ValueError("wire_dtype=float16 is only meaningful with the fp16 action")
        names, params = registered_parameters(named_parameters)
        numels = np.array([p.numel() for p in params], dtype=np.int64)
        menu = make_menu([action] if action.lossless else [FP32, action])
        policy = FixedActionPolicy(menu, numels, menu.names.index(action.name))
        self.bits_per_step = policy.bits_per_step
        core = SafeBitsCore(names, numels, policy=policy, schedule=lambda step: self.bits_per_element, seed=seed,
                            exchange=LocalExchange(), error_feedback=error_feedback, nonfinite="propagate",
                            max_history=max_history,
                            # Horovod's fp16 compressor semantics need its allreduce of float16 values.
                            collective="dense" if wire_dtype is not None else collective,
                            dense_wire_bytes=2 if wire_dtype is not None else 4, name=f"baseline.{action.name}")
        self._attach(params, core)
        self.action = action
        self.error_feedback = error_feedback
        self.wire_dtype = wire_dtype

    @property
    def bits_per_element(self) -> float:
        """Modeled bits per parameter per step."""
        return self.bits_per_step / self.total_elements

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Context]:
        """Quantize one gradient; returns the wire tensor (flat) and the context for :meth:`decompress`."""
        out, ctx = super().compress(tensor)
        if self.wire_dtype is not None:
            out = out.to(self.wire_dtype)            # Horovod's FP16Compressor: float16 on the wire
        return out, ctx


Factory = Callable[..., Compressor]


def _fixed(action: Action, error_feedback: bool, wire_dtype: torch.dtype | None = None) -> Factory:
    def factory(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], *, seed: int = 0,
                budget_bits: float | None = None, collective: str = "auto", **_: Any) -> FixedActionCompressor:
        if budget_bits is not None:
            raise ValueError(f"{action.name}: a fixed baseline takes no budget_bits")
        return FixedActionCompressor(named_parameters, action, error_feedback=error_feedback, seed=seed,
                                     wire_dtype=wire_dtype, collective=collective)
    factory.__doc__ = f"Every tensor as {action.name!r}{' with error feedback' if error_feedback else ''}."
    return factory


def _safebits(screen: bool, menu: Menu | None = None, menu_name: str = "") -> Factory:
    def factory(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], *, seed: int = 0,
                budget_bits: float | str | None = None, **kwargs: Any) -> SafeBits:
        if budget_bits is None:
            raise ValueError("SafeBits needs budget_bits (bits per parameter per step)")
        if menu is not None:
            if "menu" in kwargs:
                raise ValueError(f"this registry entry fixes the menu ({menu_name}); use 'safebits' or "
                                 f"'unscreened' with menu=... instead")
            kwargs["menu"] = menu
        return SafeBits(named_parameters, budget_bits=budget_bits, seed=seed, screen=screen, **kwargs)
    what = "SafeBits (screened)" if screen else "Unscreened global budgeting: SafeBits(screen=False)"
    factory.__doc__ = what + (f" on {menu_name}." if menu is not None else ".")
    return factory


REGISTRY: dict[str, Factory] = {
    "fp32": _fixed(FP32, error_feedback=False),
    "fp16": _fixed(FP16, error_feedback=False, wire_dtype=torch.float16),
    "qsgd8": _fixed(qsgd(8), error_feedback=False),
    "qsgd4": _fixed(qsgd(4), error_feedback=False),
    "qsgd2": _fixed(qsgd(2), error_feedback=False),
    "terngrad": _fixed(ternary(), error_feedback=False),
    "signsgd_ef": _fixed(scaled_sign(), error_feedback=True),
    "topk10_ef": _fixed(topk(0.1), error_feedback=True),
    "topk1_ef": _fixed(topk(0.01), error_feedback=True),
    "unscreened": _safebits(screen=False),
    "safebits": _safebits(screen=True),
    "unscreened_maxscaled": _safebits(screen=False, menu=MAX_SCALED_MENU, menu_name="MAX_SCALED_MENU"),
    "safebits_maxscaled": _safebits(screen=True, menu=MAX_SCALED_MENU, menu_name="MAX_SCALED_MENU"),
    "unscreened_quantizers": _safebits(screen=False, menu=QUANTIZER_MENU, menu_name="QUANTIZER_MENU"),
    "safebits_quantizers": _safebits(screen=True, menu=QUANTIZER_MENU, menu_name="QUANTIZER_MENU"),
}
"""Compressor name -> factory ``(named_parameters, *, seed=0, budget_bits=None, **kwargs)``."""

BUDGETED = frozenset({"unscreened", "safebits", "unscreened_maxscaled", "safebits_maxscaled", "unscreened_quantizers",
                      "safebits_quantizers"})
"""Registry names that take ``budget_bits`` (bits per parameter per step); the others take none."""


def make_compressor(name: str, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], /, *, seed: int = 0,
                    budget_bits: float | str | None = None, **kwargs: Any) -> Compressor:
    """Build the registry's compressor ``name`` (see :data:`REGISTRY`)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; known: {sorted(REGISTRY)}")
    return REGISTRY[name](named_parameters, seed=seed, budget_bits=budget_bits, **kwargs)


def label(name: str, budget_bits: float | str | None = None) -> str:
    """How reports name a run: ``name`` or ``name@budget`` (``safebits@4.4``, ``safebits@auto``)."""
    if budget_bits is None:
        return name
    return f"{name}@{budget_bits}" if isinstance(budget_bits, str) else f"{name}@{budget_bits:g}"
