"""Matching a gradient to its parameter (docs/DESIGN.md, "Matching a gradient to its parameter").

Horovod's ``compress(tensor)`` is not told which parameter ``tensor`` belongs to, and with
``zero_grad(set_to_none=True)`` (PyTorch's default) ``p.grad`` is a new tensor every step, so neither
``data_ptr()`` nor call order is a safe key. The match is by identity, ``p.grad is tensor``: a cache by ``id``
(validated, since ids are reused) and, on a miss, a look at the neighbours of the last hit (backward visits
parameters in reverse registration order) before a full scan.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch


class GradientIndex:
    """Finds the index of the registered parameter whose ``.grad`` is a given tensor."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self._by_id: dict[int, int] = {}
        self._cursor = 0
        self._successor: dict[int, int] = {}     # index -> the index found after it the last time

    def find(self, tensor: torch.Tensor, pending: np.ndarray | None = None) -> int:
        """Index of ``tensor``'s parameter. ``pending`` (bool per parameter) marks those not yet compressed this
        step: Horovod's ``sparse_as_dense`` hands over ``grad.to_dense()``, a new tensor, which is matched to the
        single pending parameter with a sparse gradient of that shape. Raises ``ValueError`` on no match."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"compress takes a gradient tensor, got {type(tensor).__name__}")
        previous = self._cursor
        index = self._by_id.get(id(tensor))
        if index is None or self.params[index].grad is not tensor:
            # A new tensor (zero_grad(set_to_none=True) makes one every step): most often the one found after the
            # last hit the step before.
            index = self._successor.get(previous, previous)
            if self.params[index].grad is not tensor:
                index = self._search(tensor, previous)
        if index is not None:
            self._by_id[id(tensor)] = index
            self._successor[previous] = index
            self._cursor = index
            return index
        return self._sparse_match(tensor, pending)

    def _search(self, tensor: torch.Tensor, previous: int) -> int | None:
        """The parameter that followed the last hit last time first (backward's order repeats every step), then the
        neighbours of the last hit (backward goes down the registration order, synchronize() up), then all."""
        count = len(self.params)
        for j in itertools.chain((self._successor.get(previous, previous), (previous - 1) % count,
                                  (previous + 1) % count), range(count)):
            if self.params[j].grad is tensor:
                return j
        return None

    def _sparse_match(self, tensor: torch.Tensor, pending: np.ndarray | None) -> int:
        count = len(self.params)
        candidates = np.flatnonzero(pending) if pending is not None else range(count)
        sparse = [int(j) for j in candidates if self.params[j].grad is not None and self.params[j].grad.is_sparse
                  and self.params[j].shape == tensor.shape]
        if len(sparse) == 1:
            return sparse[0]
        raise ValueError(
            f"compress got a tensor of shape {tuple(tensor.shape)} that is not the .grad of any registered "
            f"parameter. Pass the compressor the same model.named_parameters() as hvd.DistributedOptimizer, "
            f"and call compress(p.grad) with the gradient tensor itself, not a copy.")
