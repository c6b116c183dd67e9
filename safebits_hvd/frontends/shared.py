"""What every front end shares (the Horovod compressor, :mod:`.compressor`; the DDP hook, :mod:`.ddp`; the
fixed-action baselines): the parameters registered, SafeBits' options checked and the core built over them
(:func:`build_core`), and what a front end exposes of its core (:class:`CoreView`)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from ..codec.actions import Menu, make_menu
from ..comm.exchange import StatisticsExchange
from ..comm.transports import PayloadTransport
from ..policy.auto import Auto
from ..policy.budget import BudgetPolicy
from ..policy.schedules import Constant
from ..policy.telemetry import StepLog, StepRecord
from ..step import checkpoint
from ..step.core import SafeBitsCore
from ..step.memory import ErrorFeedback

NONFINITE_MODES = ("propagate", "raise", "skip")


def as_schedule(budget_bits: float | str | Callable[[int], float]) -> Callable[[int], float]:
    """The ``budget_bits`` a user gave: a number becomes :class:`~.schedules.Constant`, ``"auto"``
    :class:`~.auto.Auto`; a callable is used as it is (its values are checked when read)."""
    if isinstance(budget_bits, str) and budget_bits == "auto":
        return Auto()
    if callable(budget_bits):
        return budget_bits
    if isinstance(budget_bits, bool) or not isinstance(budget_bits, int | float):
        raise TypeError(f"budget_bits must be a number of bits per parameter, 'auto' or a callable step -> bits, "
                        f"got {budget_bits!r}")
    return Constant(budget_bits)


def check_number(name: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    """``value`` as a float, or ``ValueError`` unless it is a finite number in ``[low, high]`` (``(low, high]``)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return float(value)


def check_count(name: str, value: Any, minimum: int) -> int:
    """``value`` unless it is not an int >= ``minimum`` (``ValueError``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def registered_parameters(parameters: Any) -> tuple[list[str], list[torch.nn.Parameter]]:
    """Names and parameters with ``requires_grad`` (as Horovod registers them), after checking them.

    ``parameters`` is ``model.named_parameters()`` (``(name, parameter)`` pairs), or, for
    ``hvd.DistributedOptimizer(opt)`` without ``named_parameters``, the optimizer, its ``param_groups`` or
    ``model.parameters()``: those are named as Horovod names them, ``allreduce.noname.<group>.<index>``.
    """
    if isinstance(parameters, torch.nn.Module):
        raise TypeError("pass model.named_parameters() (or model.parameters(), or the optimizer), not the model")
    if isinstance(parameters, torch.optim.Optimizer):
        parameters = parameters.param_groups
    items = list(parameters)
    if items and all(isinstance(item, torch.Tensor) for item in items):
        items = [{"params": items}]
    if items and all(isinstance(item, dict) for item in items):
        if not all("params" in group for group in items):
            raise TypeError("parameter groups must be dicts with a 'params' list, as optimizer.param_groups")
        items = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(items)
                 for j, p in enumerate(group["params"])]
    names: list[str] = []
    params: list[torch.nn.Parameter] = []
    seen_names: set[str] = set()
    seen_params: set[int] = set()
    for pair in items:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise TypeError("SafeBits takes model.named_parameters() ((name, parameter) pairs), model.parameters(), "
                            "or the optimizer / its param_groups")
        name, p = pair
        if name in seen_names:
            raise ValueError(f"duplicate parameter name {name!r} in named_parameters")
        if id(p) in seen_params:
            raise ValueError(f"parameter {name!r} is registered twice under different names")
        seen_names.add(name)
        seen_params.add(id(p))
        if p.requires_grad:
            names.append(name)
            params.append(p)
    if not params:
        raise ValueError("named_parameters holds no parameter with requires_grad=True")
    return names, params


def build_core(named_parameters: Any, budget_bits: float | Callable[[int], float], max_distortion: float,
               min_cosine: float, menu: Menu | Iterable[str], seed: int, log_path: str | os.PathLike[str] | None,
               *, sample_buckets: int, consistency_check_every: int, nonfinite: str, screen: bool, name: str,
               max_history: int, collective: str, timeout: float | None,
               exchange: StatisticsExchange | Callable[[float | None], StatisticsExchange],
               transport: PayloadTransport | Callable[[float | None], PayloadTransport],
               fusion_bytes: int | None = None,
               residual_dtype: torch.dtype = torch.float32) -> tuple[list[torch.nn.Parameter], SafeBitsCore]:
    """Check SafeBits' options (every front end takes the same ones) and build the core over the parameters with
    ``requires_grad``. ``exchange`` and ``transport`` are the front end's, or callables of the checked ``timeout``
    that make them when the first step needs them; ``fusion_bytes``: see :class:`~.core.SafeBitsCore`."""
    names, params = registered_parameters(named_parameters)
    core = build_core_over(
        names, np.array([p.numel() for p in params], dtype=np.int64), budget_bits, max_distortion, min_cosine, menu,
        seed, log_path, sample_buckets=sample_buckets, consistency_check_every=consistency_check_every,
        nonfinite=nonfinite, screen=screen, name=name, max_history=max_history, collective=collective,
        timeout=timeout, exchange=exchange, transport=transport, fusion_bytes=fusion_bytes,
        residual_dtype=residual_dtype)
    return params, core


def build_core_over(names: list[str], numels: np.ndarray, budget_bits: float | Callable[[int], float],
                    max_distortion: float, min_cosine: float, menu: Menu | Iterable[str], seed: int,
                    log_path: str | os.PathLike[str] | None, *, sample_buckets: int, consistency_check_every: int,
                    nonfinite: str, screen: bool, name: str, max_history: int, collective: str,
                    timeout: float | None,
                    exchange: StatisticsExchange | Callable[[float | None], StatisticsExchange],
                    transport: PayloadTransport | Callable[[float | None], PayloadTransport],
                    fusion_bytes: int | None = None, residual_dtype: torch.dtype = torch.float32,
                    owners: np.ndarray | None = None) -> SafeBitsCore:
    """:func:`build_core` over tensors given by name and size (a front end whose members are not parameters: the
    FSDP front end's rows of a parameter's reduce-scatter buffer); ``owners``: each one's owner rank, for
    ``collective="reduce_scatter"``."""
    schedule = as_schedule(budget_bits)
    if isinstance(schedule, Constant):
        schedule(0)    # a constant is checked now
    max_distortion = check_number("max_distortion", max_distortion, 0.0, 1.0, low_open=True)
    min_cosine = check_number("min_cosine", min_cosine, -1.0, 1.0)
    menu = make_menu(menu)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
    if timeout is not None:
        timeout = check_number("timeout", timeout, 0.0, math.inf, low_open=True)
    if not (callable(exchange) or isinstance(exchange, StatisticsExchange)):
        raise TypeError(f"exchange must implement safebits_hvd.comm.exchange.StatisticsExchange (start, wait, "
                        f"is_local, rank, size), got {type(exchange).__name__}")
    if fusion_bytes is not None:
        fusion_bytes = check_count("fusion_bytes", fusion_bytes, 0)
    policy = BudgetPolicy(menu, numels, max_distortion, min_cosine, screen=bool(screen))
    core = SafeBitsCore(
        names, numels, policy=policy, schedule=schedule, seed=seed,
        exchange=exchange if isinstance(exchange, StatisticsExchange) else (lambda: exchange(timeout)),
        nonfinite=nonfinite, sample_buckets=check_count("sample_buckets", sample_buckets, 1),
        consistency_check_every=check_count("consistency_check_every", consistency_check_every, 0),
        max_history=check_count("max_history", max_history, 0), log_path=log_path, collective=collective,
        transport=transport if isinstance(transport, PayloadTransport) else (lambda: transport(timeout)),
        name=name, fusion_bytes=fusion_bytes, residual_dtype=residual_dtype, owners=owners)
    return core


def refuse_unsent(core: SafeBitsCore, what: str) -> None:
    """At a DDP step's last bucket: ``ValueError`` if the core still waits for tensors DDP never reduced (the
    state was built from other parameters than DDP's), after finishing the step's exchange."""
    if core.in_step:
        missing = [core.names[i] for i, unsent in enumerate(core.unsent) if unsent]
        core.finish()
        raise ValueError(f"{what} registered parameters DDP does not reduce (e.g. {missing[:3]}); build it from the "
                         f"same model's named_parameters() as DDP")


def check_transports(exchange: Any, transport: Any) -> None:
    """``TypeError`` unless ``exchange`` and ``transport`` are None or implement their protocols."""
    if exchange is not None and not isinstance(exchange, StatisticsExchange):
        raise TypeError(f"exchange must implement safebits_hvd.comm.exchange.StatisticsExchange (start, wait, "
                        f"is_local, rank, size), got {type(exchange).__name__}")
    if transport is not None and not isinstance(transport, PayloadTransport):
        raise TypeError(f"transport must implement safebits_hvd.comm.transports.PayloadTransport (start_allgather, "
                        f"start_alltoall, wait, rank, size), got {type(transport).__name__}")


class CoreView:
    """What every front end exposes of its :class:`~.core.SafeBitsCore`: records, step, residuals, checkpoints."""

    core: SafeBitsCore

    @property
    def last_step(self) -> StepRecord | None:
        """The :class:`StepRecord` of the last completed step (None before the first). A step is complete once the
        front end has taken its last reduced tensor; its statistics exchange then runs until the next step begins,
        and reading a record waits for it."""
        return self._complete_log().last

    @property
    def history(self) -> list[StepRecord]:
        """The last ``max_history`` :class:`StepRecord` objects, oldest first (a new list each time; as
        :attr:`last_step`, it waits for the last complete step's exchange)."""
        return self._complete_log().history

    def _complete_log(self) -> StepLog:
        """The core's records, the last ended step's included (its exchange finished first)."""
        if self.core.closing.ended:
            self.core.finish()
        return self.core.log

    @property
    def step(self) -> int:
        """Index of the next step to be compressed (the number of steps begun and closed)."""
        return self.core.step

    @property
    def exchange(self) -> StatisticsExchange | None:
        """The statistics transport (None until the first step closes, when it is chosen)."""
        return self.core.exchange

    @property
    def memory(self) -> ErrorFeedback:
        """The error-feedback residuals (per parameter name)."""
        return self.core.memory

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically, as plain tensors, numbers and strings.

        Call between optimizer steps. With several ranks each rank saves its own (the residuals are per rank).
        """
        return checkpoint.save(self.core)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises ``ValueError`` if it was saved for another model or menu."""
        checkpoint.load(self.core, state)
