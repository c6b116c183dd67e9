"""What the step-overhead workers share (``horovod_overhead.py`` under Horovod, ``ddp_overhead.py`` under DDP): the
model of many square layers, one timed training step, and the interleaved timing of several models."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn


def make_model(width: int, layers: int) -> nn.Sequential:
    """An MLP of ``layers`` square layers (``2 * layers`` tensors, about ``layers * width**2`` parameters)."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


Loss = Callable[[nn.Module], torch.Tensor]
"""The loss of one batch through a model (the same batch every step: the figure is time, not learning)."""


def mse_loss(x: torch.Tensor, y: torch.Tensor) -> Loss:
    """The square-layer models' loss: mean squared error of ``model(x)`` against ``y``."""
    return lambda model: nn.functional.mse_loss(model(x), y)


def timed_step(model: nn.Module, opt: torch.optim.Optimizer, loss: Loss) -> float:
    """Seconds of one training step (forward, backward with the front end's collectives, update)."""
    start = time.perf_counter()
    opt.zero_grad()
    loss(model).backward()
    opt.step()
    return time.perf_counter() - start


def interleaved_times(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer], loss: Loss,
                      warmup: int, steps: int) -> dict[str, list[float]]:
    """Per model, the seconds of its ``steps`` timed steps after ``warmup`` untimed ones; the models' steps
    alternate, in reversed order every other step (no order bias)."""
    times: dict[str, list[float]] = {label: [] for label in models}
    for step in range(warmup + steps):
        order = list(models) if step % 2 == 0 else list(models)[::-1]
        for label in order:
            seconds = timed_step(models[label], optimizers[label], loss)
            if step >= warmup:
                times[label].append(seconds)
    return times
