"""Lists of tensors as the compiled backends take them: each tensor's address and element count, as int64 arrays
(0 for a missing one). Made once per call from a plain list, or once for good by :class:`TensorList`: a group's
residuals and the screen's bucket samples are the same tensors every step, and one ``data_ptr`` per tensor per step
costs more than packing a small one (the 1,000-tensor step, docs/RESULTS.md 5.1)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch


class TensorList(list):
    """A list of tensors (or None) that keeps their addresses and element counts, taken when it is made. Its tensors
    must keep their storage while it is used (updated in place only); it is not to be changed."""

    def __init__(self, tensors: Iterable[torch.Tensor | None]) -> None:
        super().__init__(tensors)
        self.addresses = _addresses(self)
        self.element_counts = _numels(self)


def addresses(tensors: Sequence[torch.Tensor | None]) -> np.ndarray:
    """Each tensor's ``data_ptr`` (0 for None), int64."""
    return tensors.addresses if isinstance(tensors, TensorList) else _addresses(tensors)


def element_counts(tensors: Sequence[torch.Tensor | None]) -> np.ndarray:
    """Each tensor's element count (0 for None), int64."""
    return tensors.element_counts if isinstance(tensors, TensorList) else _numels(tensors)


def _addresses(tensors: Sequence[torch.Tensor | None]) -> np.ndarray:
    return np.fromiter((0 if t is None else t.data_ptr() for t in tensors), dtype=np.int64, count=len(tensors))


def _numels(tensors: Sequence[torch.Tensor | None]) -> np.ndarray:
    return np.fromiter((0 if t is None else t.numel() for t in tensors), dtype=np.int64, count=len(tensors))
