"""A core in a changing world (elastic training: docs/DESIGN.md, "Elastic training"): a step dropped when one of its
collectives failed, and the links rebuilt for a new set of ranks."""

from __future__ import annotations

from .core import SafeBitsCore


def abort_step(core: SafeBitsCore) -> None:
    """Drop the step in progress and the pending exchange (a collective failed: a worker left); the residuals may
    hold part of that step, so load the last state next (elastic ``restore`` does)."""
    core.in_step, core.unsent_count = False, len(core.names)
    core.closing.drop()
    core.unsent[:] = True
    core.clock.abort()
    for path in core.paths.values():
        path.abort()


def leave_world(core: SafeBitsCore) -> None:
    """The world changed: the statistics exchange and the payload transport are rebuilt for the new one at the next
    step, and the two-phase segments with them. Exchanges and transports given as objects rather than factories
    cannot be rebuilt: ``ValueError``. Call between steps."""
    if not core.between_steps:
        raise RuntimeError("leave_world() must be called between steps (abort_step() first after a failure)")
    if not (core.closing.follows_worlds and callable(core.transport_source)):
        raise ValueError("SafeBits was given its exchange or transport as an object, which cannot follow a new "
                         "world; pass factories (or nothing) for elastic training")
    core.closing.leave_world()       # an exchange in flight is the old world's: dropped
    core.transport = None
    for path in core.paths.values():
        path.leave_world()
