"""Elastic Horovod (docs/DESIGN.md, "Elastic training"): SafeBits' state in ``hvd.elastic.TorchState``.

Importing :mod:`safebits_hvd` with Horovod installed registers :class:`SafeBitsStateHandler` with Horovod's
``TorchState``, so a SafeBits object passed to it takes part in the elastic protocol like the model and the
optimizer do::

    compression = SafeBits(model.named_parameters(), budget_bits=4.4)
    optimizer = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, compression=compression, batch=0)

The handler's three calls:

1. ``save`` (``state.commit()``): a copy of SafeBits' state dict (residuals, step, seed, the statistics the next
   allocation reads, the schedule's state).
2. ``restore`` (a collective failed, usually because a worker died): the step in progress is dropped and the copy
   loaded, so no residual keeps any part of the lost step, and the records of undone steps are forgotten.
3. ``sync`` (after Horovod re-initialized for the new world): the exchange and the collectives are rebuilt for it
   (the two-phase segments too), then rank 0's shared state (step, seed, statistics, schedule) is broadcast, so
   every rank, a new one included, makes the same allocation (the digest check verifies it). Each rank keeps its own
   residuals; a new rank starts with zeros.

What a departed rank held is lost with it: its first-hop residuals (the quantization error of its own gradients not
yet sent, at most ``max_distortion`` times their squared norm per step) and, on the two-phase path, the second-hop
residuals of the segments it owned. A surviving rank whose segments move adds its second-hop residuals back into
its first-hop residuals, so nothing a survivor holds is lost. When Horovod only removes workers it skips the sync;
SafeBits then notices the new world size at the next step and rebuilds itself (``CoreCompressor.compress``).
"""

from __future__ import annotations

from typing import Any

from ..step import checkpoint, world
from ..step.checkpoint import PER_RANK
from .horovod import CoreCompressor

try:
    from horovod.torch.elastic.state import StateHandler
except ImportError:  # pragma: no cover - exercised only without Horovod
    StateHandler = object  # type: ignore[assignment,misc]


class SafeBitsStateHandler(StateHandler):  # type: ignore[misc,valid-type]
    """``TorchState``'s handler of a SafeBits (or baseline) compressor: commit, restore and sync (see the module
    docstring for what each does)."""

    def __init__(self, compressor: CoreCompressor) -> None:
        self.value = compressor
        self.save()

    def save(self) -> None:
        """1. Commit: a copy of the state dict (between steps, where ``state.commit()`` is called)."""
        self._saved = self.value.state_dict()

    def restore(self) -> None:
        """2. Restore: drop the failed step, load the last commit."""
        world.abort_step(self.value.core)
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        """3. Sync: rebuild for the new world, then take rank 0's shared state and keep this rank's residuals."""
        import horovod.torch as hvd

        if self.value.process_set is not None:
            raise ValueError("SafeBits built with a process_set cannot follow an elastic world change; elastic "
                             "training runs on every rank (process_set=None)")
        core = self.value.core
        world.leave_world(core)
        state = checkpoint.save(core)
        shared = hvd.broadcast_object({key: value for key, value in state.items() if key not in PER_RANK},
                                      root_rank=0, name=f"{core.name}.elastic.sync")
        checkpoint.load(core, {**shared, **{key: state[key] for key in PER_RANK if key in state}})

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


def register() -> bool:
    """Put :class:`SafeBitsStateHandler` first in Horovod's ``TorchState`` handler registry (once). Returns
    whether Horovod's elastic module is there to register with."""
    try:
        from horovod.torch.elastic import state
    except ImportError:  # pragma: no cover - exercised only without Horovod
        return False
    registry = state.get_handler_registry()
    if not any(handler is SafeBitsStateHandler for _, handler in registry):
        state.set_handler_registry([(CoreCompressor, SafeBitsStateHandler), *registry])
    return True
