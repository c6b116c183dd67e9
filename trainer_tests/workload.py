"""What both trainer workers train and check: the digits data, the model, the loss and the parameter digest.

Imported by the workers as a sibling module: each worker runs as a script, so its folder is on ``sys.path``.
"""

from __future__ import annotations

import hashlib

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

STEPS = 20
BUDGET_BITS = 4.4


def digits() -> TensorDataset:
    """scikit-learn's bundled digits (no download), scaled to [0, 1]."""
    data = load_digits()
    return TensorDataset(torch.tensor(data.data / 16.0, dtype=torch.float32), torch.tensor(data.target))


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def full_loss(module: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return float(nn.functional.cross_entropy(module(x), y))


def params_digest(module: nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in registration order."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()
