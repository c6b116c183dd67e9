"""The compressors SafeBits is compared with, as Horovod compressors with SafeBits' modeled-bits accounting.

Each baseline sends every gradient tensor with one fixed :class:`~safebits_hvd.actions.Action` (no screen, no
allocation), through the same fused kernel as SafeBits (:func:`safebits_hvd.kernels.quantize_ef`), and counts
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
=============  =========================================  ==========  =============================

Like SafeBits, a compressor matches a gradient to its parameter by identity (``p.grad is tensor``), and a step
is complete once every registered parameter has been compressed; it then records a
:class:`~safebits_hvd.telemetry.StepRecord` (``last_step``, ``history``) with ``violation=False`` and no
escalations (a fixed compressor has no budget to violate: ``budget_bits_total`` is what it used).

    compression = safebits_hvd.baselines.REGISTRY["qsgd4"](model.named_parameters(), seed=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import torch

from . import kernels
from .actions import FP16, FP32, Action, qsgd, scaled_sign, ternary, topk
from .compressor import Compressor, SafeBits
from .memory import ErrorFeedback
from .params import GradientIndex
from .rng import stream_key
from .screen import distortion_cosine
from .telemetry import StepRecord

__all__ = ["BUDGETED", "REGISTRY", "FixedActionCompressor", "make_compressor"]


class _Context(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype


class FixedActionCompressor(Compressor):
    """Send every gradient with one action, with or without error feedback; account modeled bits per step.

    Args:
        named_parameters: ``(name, parameter)`` pairs; gradients are matched to them by identity.
        action: the action every tensor is sent with.
        error_feedback: keep the residual ``e <- v - Q(v)`` per parameter (else ``Q(g)``, no memory).
        seed: seed of the counter-based stochastic-rounding RNG (key per seed, step, tensor index).
        wire_dtype: None: the kernel's float32 output is sent (dequantized values). ``torch.float16``:
            Horovod's FP16Compressor semantics (cast, allreduce in float16, cast back); fp16 action only.

    Attributes:
        bits_per_step: modeled bits of one step (sum over parameters of ``action.cost(numel)``).
        last_step, history: :class:`StepRecord` of the last / every completed step (distortion and cosine of
            what was sent per parameter; NaN for fp16, which is cast, not passed through the kernel).
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], action: Action, *,
                 error_feedback: bool, seed: int = 0, wire_dtype: torch.dtype | None = None) -> None:
        pairs = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not pairs:
            raise ValueError("named_parameters holds no parameter with requires_grad=True")
        if wire_dtype is not None and action.name != FP16.name:
            raise ValueError("wire_dtype=float16 is only meaningful with the fp16 action")
        self.names: list[str] = [n for n, _ in pairs]
        self._params: list[torch.nn.Parameter] = [p for _, p in pairs]
        self._index = GradientIndex(self._params)
        self.numels = np.array([p.numel() for p in self._params], dtype=np.int64)
        self.total_elements = int(self.numels.sum())
        self.action = action
        self.error_feedback = error_feedback
        self.seed = seed
        self.wire_dtype = wire_dtype
        self.bits_per_step = int(sum(action.cost(int(n)) for n in self.numels))
        self.memory = ErrorFeedback()
        self.history: list[StepRecord] = []
        self.last_step: StepRecord | None = None
        self._step = 0
        self._done = np.zeros(len(self._params), dtype=bool)
        self._distortion = np.zeros(len(self._params))
        self._cosine = np.ones(len(self._params))

    @property
    def step(self) -> int:
        """Index of the next step to be compressed."""
        return self._step

    @property
    def bits_per_element(self) -> float:
        """Modeled bits per parameter per step."""
        return self.bits_per_step / self.total_elements

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, _Context]:
        """Quantize one gradient; returns the wire tensor (flat) and the context for :meth:`decompress`."""
        index = self._index.find(tensor, ~self._done)
        if self._done[index]:       # a parameter came twice: close the previous (incomplete) step
            self._close_step()
        ctx = _Context(tensor.shape, tensor.dtype)
        g = tensor.detach().reshape(-1)
        if self.wire_dtype is None:
            g = g.to(torch.float32).contiguous()
        n = g.numel()
        if self.wire_dtype is not None:
            out = g.to(self.wire_dtype)          # Horovod's FP16Compressor: cast on the wire
            self._distortion[index], self._cosine[index] = math.nan, math.nan   # not measured (no kernel pass)
        elif self.action.lossless:
            out = g
            self._distortion[index], self._cosine[index] = 0.0, 1.0
        else:
            if self.error_feedback:
                e = self.memory.residual(self.names[index], n, g.device)
            else:
                e = torch.zeros(n, dtype=torch.float32, device=g.device)   # no memory: dropped after the call
            out = torch.empty(n, dtype=torch.float32, device=g.device)
            key = stream_key(self.seed, self._step, index)
            stats = kernels.quantize_ef(g, e, out, self.action, key).cpu().numpy()
            d, c = distortion_cosine(stats)
            self._distortion[index], self._cosine[index] = float(d), float(c)
        self._done[index] = True
        if self._done.all():
            self._close_step()
        return out, ctx

    def decompress(self, tensor: torch.Tensor, ctx: _Context) -> torch.Tensor:
        """The reduced wire tensor back in the gradient's shape and dtype."""
        if tensor.dtype != ctx.dtype:
            tensor = tensor.to(ctx.dtype)
        return tensor.view(ctx.shape)

    def _close_step(self) -> None:
        sent = np.flatnonzero(self._done)
        used = int(sum(self.action.cost(int(self.numels[i])) for i in sent))
        record = StepRecord(
            step=self._step, budget_bits_total=float(used), used_bits_total=used,
            compression_ratio=(32.0 * self.total_elements / used) if used else math.inf,
            violation=False, excess_bits=0.0, escalations=[],
            actions={self.names[i]: self.action.name for i in sent},
            distortion={self.names[i]: float(self._distortion[i]) for i in sent},
            cosine={self.names[i]: float(self._cosine[i]) for i in sent},
            allocation_digest="")
        self.last_step = record
        self.history.append(record)
        self._done[:] = False
        self._step += 1

    def state_dict(self) -> dict[str, Any]:
        """Step counter and error-feedback residuals (per rank)."""
        return {"step": self._step, "residuals": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self._step = int(state["step"])
        self.memory.load_state_dict(state["residuals"])


Factory = Callable[..., Compressor]


def _fixed(action: Action, error_feedback: bool, wire_dtype: torch.dtype | None = None) -> Factory:
    def factory(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], *, seed: int = 0,
                budget_bits: float | None = None, **_: Any) -> FixedActionCompressor:
        if budget_bits is not None:
            raise ValueError(f"{action.name}: a fixed baseline takes no budget_bits")
        return FixedActionCompressor(named_parameters, action, error_feedback=error_feedback, seed=seed,
                                     wire_dtype=wire_dtype)
    factory.__doc__ = f"Every tensor as {action.name!r}{' with error feedback' if error_feedback else ''}."
    return factory


def _safebits(screen: bool) -> Factory:
    def factory(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], *, seed: int = 0,
                budget_bits: float | None = None, **kwargs: Any) -> SafeBits:
        if budget_bits is None:
            raise ValueError("SafeBits needs budget_bits (bits per parameter per step)")
        return SafeBits(named_parameters, budget_bits=budget_bits, seed=seed, screen=screen, **kwargs)
    factory.__doc__ = ("SafeBits (screened)." if screen
                       else "Unscreened global budgeting: SafeBits(screen=False).")
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
}
"""Compressor name -> factory ``(named_parameters, *, seed=0, budget_bits=None, **kwargs)``."""

BUDGETED = frozenset({"unscreened", "safebits"})
"""Registry names that take ``budget_bits`` (bits per parameter per step); the others take none."""


def make_compressor(name: str, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], /, *, seed: int = 0,
                    budget_bits: float | None = None, **kwargs: Any) -> Compressor:
    """Build the registry's compressor ``name`` (see :data:`REGISTRY`)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; known: {sorted(REGISTRY)}")
    return REGISTRY[name](named_parameters, seed=seed, budget_bits=budget_bits, **kwargs)
