"""Compressor specs of the benchmarks: the one parser for ``fp32``, ``safebits@4.4``, ``safebits@auto``,
``ddp:safebits@4.4``, ``ddp:powersgd4`` and the like.

A spec names a compressor and, for the budgeted ones, its budget in bits per parameter per step (or ``auto``).
Horovod specs name Horovod's own ``none`` and ``fp16`` or any :data:`safebits_hvd.frontends.baselines.REGISTRY` name;
DDP specs (prefix ``ddp:``) name DDP's default allreduce (``ddp:none``), ``fp16_compress_hook`` (``ddp:fp16``),
``powerSGD_hook`` at rank R (``ddp:powersgdR``) or SafeBits' hook (``ddp:safebits@B``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from safebits_hvd.frontends.baselines import BUDGETED, REGISTRY

HOROVOD_BUILTIN = ("none", "fp16")
"""Horovod's own ``hvd.Compression`` members, by their names."""

DDP_PREFIX = "ddp:"


@dataclass(frozen=True)
class Spec:
    """One parsed compressor spec; :attr:`text` is the spec as given (the label in tables and JSON)."""

    text: str
    name: str                          # registry or built-in name, without the ``ddp:`` prefix and budget
    budget_bits: float | str | None    # a number, "auto", or None for a fixed compressor
    ddp: bool                          # a DDP communication hook (else a Horovod compressor)

    @property
    def budgeted(self) -> bool:
        return self.budget_bits is not None


def parse(text: str) -> Spec:
    """Parse ``text``; :class:`ValueError` saying what is wrong (unknown name, a budget where none is taken or none
    where one is needed, a budget that is not a positive number or ``auto``)."""
    ddp = text.startswith(DDP_PREFIX)
    body = text.removeprefix(DDP_PREFIX)
    name, at, budget = body.partition("@")
    bits: float | str | None = None
    if at:
        if budget == "auto":
            bits = "auto"
        else:
            try:
                bits = float(budget)
            except ValueError:
                raise ValueError(f"{text!r}: the budget after '@' must be a number of bits or 'auto'") from None
            if not bits > 0:
                raise ValueError(f"{text!r}: the budget must be > 0 bits per parameter")
    if ddp:
        fixed = name in HOROVOD_BUILTIN or (name.startswith("powersgd") and name.removeprefix("powersgd").isdigit()
                                             and int(name.removeprefix("powersgd")) > 0)
        if not fixed and name != "safebits":
            raise ValueError(f"unknown DDP compressor {text!r}; known: ddp:none, ddp:fp16, ddp:powersgdR, "
                             f"ddp:safebits@BITS")
        budgeted = name == "safebits"
    else:
        if name not in HOROVOD_BUILTIN and name not in REGISTRY:
            raise ValueError(f"unknown compressor {text!r}; known: {', '.join([*HOROVOD_BUILTIN, *sorted(REGISTRY)])}")
        budgeted = name in BUDGETED
    if budgeted and bits is None:
        raise ValueError(f"{text!r}: budgeted compressors ({', '.join(sorted(BUDGETED))}) take @BITS or @auto")
    if not budgeted and bits is not None:
        raise ValueError(f"{text!r}: fixed compressors take no @budget")
    return Spec(text, name, bits, ddp)


def argument(text: str) -> Spec:
    """:func:`parse` as an argparse ``type``: a bad spec is a usage error, not a traceback."""
    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
