"""Reads of results back to the host, counted: the points where a GPU step waits for the device (a device-to-host
synchronization). Every module that moves a kernel's result, a header or a reduced marker to the host goes through
here, on every device, so a test on the CPU counts what a GPU step would pay (docs/DESIGN.md, "The batched step")."""

from __future__ import annotations

import numpy as np
import torch

_reads = 0


def reads() -> int:
    """How many reads back to the host SafeBits has made so far in this process."""
    return _reads


def count(reads: int = 1) -> None:
    """Count reads made without :func:`to_host` (a scalar, a header)."""
    global _reads
    _reads += reads


def to_host(t: torch.Tensor) -> np.ndarray:
    """``t`` as a NumPy array on the host (one counted read)."""
    global _reads
    _reads += 1
    return t.detach().cpu().numpy()
