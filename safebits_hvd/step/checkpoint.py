"""Checkpoint state of the core: what continuing bit-identically needs, as plain tensors, numbers and strings.

A state holds the error-feedback residuals (per rank: under Horovod each rank saves its own; with the two-phase
collective also the second hop's residuals of the segments the rank owns), the step counter,
the seed, the last step's reduced statistics (the next allocation's input), the escalation overshoots the policy's
reserve is learned from and the schedule's state. It names the
parameters, their sizes and the menu, so a state saved for another model is refused with a clear error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from .core import SafeBitsCore

STATE_FORMAT = 5
"""Version of the state dict layout. Formats 2 (no second-hop residuals), 3 (no second-hop ranges) and 4 (no
overshoot history: read as empty, so the escalation reserve starts again from 0) are still read; others are refused."""
READABLE_FORMATS = (2, 3, 4, 5)
PER_RANK = ("residuals", "second_hop_residuals", "second_hop_ranges")
"""The entries each rank holds for itself; every other entry is the same on every rank (elastic sync sends them)."""


def make_state(*, step: int, seed: int, names: list[str], numels: np.ndarray, menu_names: list[str],
               residuals: dict[str, torch.Tensor], second_hop_residuals: dict[str, torch.Tensor],
               second_hop_ranges: dict[str, tuple[int, int]], screened: np.ndarray | None,
               v2: np.ndarray | None, overshoot_history: list[float], schedule_state: Any) -> dict[str, Any]:
    """The state dict (arrays copied: the caller may go on training)."""
    previous = screened is not None and v2 is not None
    return {
        "format": STATE_FORMAT,
        "step": step,
        "seed": seed,
        "names": list(names),
        "numels": [int(n) for n in numels],
        "menu": list(menu_names),
        "residuals": residuals,
        "second_hop_residuals": second_hop_residuals,
        # The element range of each second-hop residual: when the world size changes, a residual is added back into
        # the first-hop residual of the same range (docs/DESIGN.md, "Elastic training").
        "second_hop_ranges": {name: [int(start), int(stop)] for name, (start, stop) in second_hop_ranges.items()},
        "prev_screened": torch.from_numpy(screened.copy()) if previous else None,
        "prev_v2": torch.from_numpy(v2.copy()) if previous else None,
        "overshoot_history": [float(x) for x in overshoot_history],
        "schedule": schedule_state,
    }


def check_state(state: Any, names: list[str], numels: np.ndarray, menu_names: list[str]) -> None:
    """Raise ``ValueError`` unless ``state`` is a state dict of this format for these parameters and menu."""
    if not isinstance(state, dict) or "format" not in state:
        raise ValueError(f"not a SafeBits state dict (format {STATE_FORMAT}): got "
                         + (f"keys {sorted(state)[:8]}" if isinstance(state, dict) else type(state).__name__))
    if state["format"] not in READABLE_FORMATS:
        raise ValueError(f"SafeBits state of format {state['format']!r}; this version reads formats "
                         f"{READABLE_FORMATS}")
    if state["names"] != names or state["numels"] != [int(n) for n in numels]:
        raise ValueError(f"this SafeBits state was saved for a different model: {len(state['names'])} "
                         f"parameters (first {state['names'][:3]}) vs {len(names)} here "
                         f"(first {names[:3]}), or different sizes")
    if state["menu"] != menu_names:
        raise ValueError(f"state saved with menu {state['menu']}, this object has {menu_names}")
    unknown = (set(state["residuals"]) | set(state.get("second_hop_residuals", {}))) - set(names)
    if unknown:
        raise ValueError(f"state holds residuals of unknown parameters {sorted(unknown)[:3]}")
    for name, residual in state["residuals"].items():
        if isinstance(residual, torch.Tensor) and residual.numel() != int(numels[names.index(name)]):
            raise ValueError(f"residual of {name!r} has {residual.numel()} elements, its parameter "
                             f"{int(numels[names.index(name)])}")
    for name, (start, stop) in state.get("second_hop_ranges", {}).items():
        residual = state["second_hop_residuals"].get(name)
        n = int(numels[names.index(name)]) if name in names else -1
        if residual is None or not 0 <= start <= stop <= n or residual.numel() != stop - start:
            raise ValueError(f"second-hop residual of {name!r} does not match its range [{start}, {stop})")


def second_hop_ranges(state: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """The element range of each saved second-hop residual (empty before format 4: the ranges are unknown)."""
    return {name: (int(start), int(stop)) for name, (start, stop) in state.get("second_hop_ranges", {}).items()}


def previous_statistics(state: dict[str, Any]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The saved allocation input ``(screened, v2)``, as fresh arrays (None, None before the first step)."""
    if state["prev_screened"] is None:
        return None, None
    return state["prev_screened"].numpy().copy(), state["prev_v2"].numpy().copy()


def overshoot_history(state: dict[str, Any]) -> list[float]:
    """The saved overshoots of the escalation reserve, oldest first (empty before format 5: nothing learned)."""
    return [float(x) for x in state.get("overshoot_history", [])]


def save(core: SafeBitsCore) -> dict[str, Any]:
    """The state dict of ``core`` (between steps: a pending statistics exchange is finished first)."""
    if core.in_step:
        raise RuntimeError("SafeBits.state_dict() called in the middle of a step; call it between steps")
    core.finish()
    schedule_state = getattr(core.schedule, "state_dict", None)
    return make_state(step=core.step, seed=core.seed, names=core.names, numels=core.numels,
                      menu_names=core.menu.names, residuals=core.memory.state_dict(),
                      second_hop_residuals=core.two_phase.memory.state_dict(),
                      second_hop_ranges=core.two_phase.ranges, screened=core.closing.previous_screened,
                      v2=core.closing.previous_v2,
                      overshoot_history=core.policy.overshoot_history,
                      schedule_state=schedule_state() if schedule_state is not None else None)


def load(core: SafeBitsCore, state: dict[str, Any]) -> None:
    """Restore :func:`save`'s ``state`` into ``core`` (between steps); ``ValueError`` if it was saved for another
    model or menu."""
    check_state(state, core.names, core.numels, core.menu.names)
    if not core.between_steps:
        raise RuntimeError("load_state_dict() must be called between steps")
    core.finish()              # the last step's exchange, in flight until the next begin: its results are replaced
    core.memory.load_state_dict(state["residuals"])
    core.noise.reset()                  # the norms measured before belong to the steps undone
    core.two_phase.load_state_dict(state.get("second_hop_residuals", {}), second_hop_ranges(state))
    if core.two_phase.configured_for is not None:     # check the residuals against this world's segments now
        core.two_phase.configure(core.two_phase.configured_for, core.memory if core.error_feedback else None)
    core.step = int(state["step"])
    core.log.truncate(core.step)                 # records of later steps describe steps undone
    core.seed = int(state["seed"])
    core.closing.previous_screened, core.closing.previous_v2 = previous_statistics(state)
    core.policy.overshoot_history = overshoot_history(state)
    if state["schedule"] is not None and hasattr(core.schedule, "load_state_dict"):
        core.schedule.load_state_dict(state["schedule"])
