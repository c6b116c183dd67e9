"""The per-step statistics vector every rank MAX-reduces (docs/DESIGN.md, "The exchanged statistics").

The layout is defined once, by :data:`FIELDS`: each field's shape as a function of (tensors, actions), its
initial value at the start of a step, and what it means. Sizes, offsets and the named views all derive from it,
so adding a field is one line here. One float64 array underneath: the exchange reduces it in place.

Conservative combination across ranks is the MAX; quantities whose conservative side is the minimum (a cosine)
are stored negated, and the allocation digest is sent twice (as is and negated) so that MAX and MIN of each word
agree exactly when every rank agrees.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .clock import TIMING_FIELDS

DIGEST_WORDS = 4
"""The 64-bit allocation digest as four 16-bit words: exact in float64, and MAX-reducible."""


class Field(NamedTuple):
    shape: Callable[[int, int], tuple[int, ...]]     # (tensors, actions) -> shape of the field
    initial: float | None                              # value at the start of a step (None: set per step)
    meaning: str


PER_TENSOR: Callable[[int, int], tuple[int, ...]] = lambda tensors, actions: (tensors,)  # noqa: E731

FIELDS: dict[str, Field] = {
    "screened": Field(lambda t, a: (t, a), None,
                      "normalized distortion of each action if this rank's screen admits it, else +inf "
                      "(a tensor never sent this step: lossless 0, others +inf)"),
    "v2": Field(PER_TENSOR, 0.0, "||v||^2 of the tensor (+inf if unknown)"),
    "sent_position": Field(PER_TENSOR, -1.0, "position in cost order of the action sent (-1: nothing sent)"),
    "escalated": Field(PER_TENSOR, 0.0, "1 if the action sent was not the allocated one"),
    "sent_distortion": Field(PER_TENSOR, 0.0, "normalized distortion of what was sent"),
    "neg_sent_cosine": Field(PER_TENSOR, -1.0, "minus the cosine of what was sent"),
    "nonfinite": Field(PER_TENSOR, 0.0, "1 if the gradient held NaN or Inf (sent unquantized, or zeros with 'skip')"),
    "digest": Field(lambda t, a: (DIGEST_WORDS,), None, "the allocation digest, four 16-bit words"),
    "neg_digest": Field(lambda t, a: (DIGEST_WORDS,), None, "the same words negated: MAX(-x) = -MIN(x)"),
    "timing": Field(lambda t, a: (len(TIMING_FIELDS),), None,
                    "this rank's telemetry of the step (clock.TIMING_FIELDS; -1 where unknown)"),
    "noise": Field(lambda t, a: (3,), -math.inf,
                   "this rank's ||g||^2, its negation and ||mean g||^2 of the last measured step, published once "
                   "(quality.noise_values; -inf where none)"),
}


class StepStatistics(NamedTuple):
    """Named views of one statistics vector (local before the exchange, reduced after); fields as :data:`FIELDS`."""

    screened: np.ndarray
    v2: np.ndarray
    sent_position: np.ndarray
    escalated: np.ndarray
    sent_distortion: np.ndarray
    neg_sent_cosine: np.ndarray
    nonfinite: np.ndarray
    digest: np.ndarray
    neg_digest: np.ndarray
    timing: np.ndarray
    noise: np.ndarray


assert tuple(FIELDS) == StepStatistics._fields, "FIELDS and StepStatistics must list the same fields in order"


class StatisticsLayout:
    """Sizes and offsets of :data:`FIELDS` for ``tensors`` tensors and ``actions`` menu actions."""

    def __init__(self, tensors: int, actions: int) -> None:
        self.shapes = {name: field.shape(tensors, actions) for name, field in FIELDS.items()}
        sizes = [math.prod(shape) for shape in self.shapes.values()]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
        self.length: int = self.offsets[-1]

    def views(self, vector: np.ndarray) -> StepStatistics:
        """The named fields of ``vector`` (views: writing them writes the vector)."""
        if vector.shape != (self.length,) or vector.dtype != np.float64:
            raise ValueError(f"a statistics vector is float64 of length {self.length}, got {vector.dtype} "
                             f"{vector.shape}")
        return StepStatistics(*(vector[start:stop].reshape(shape) for (start, stop), shape in
                                zip(zip(self.offsets[:-1], self.offsets[1:], strict=True), self.shapes.values(),
                                    strict=True)))

    def reset(self, fields: StepStatistics, lossless: np.ndarray, digest_words: np.ndarray) -> None:
        """Start-of-step values. A tensor never compressed keeps them: only its lossless action is known safe."""
        fields.screened[:] = np.where(lossless, 0.0, np.inf)
        for name, field in FIELDS.items():
            if field.initial is not None:
                getattr(fields, name)[:] = field.initial
        fields.digest[:] = digest_words
        fields.neg_digest[:] = -digest_words
