"""What the horovodrun workers of the MPI tests share: the check that fails a scenario, the parameters' digest, and
the loop that runs scenarios on every rank, agrees on their outcomes and reports them (rank 0 prints one
``PASS``/``FAIL`` line per scenario and a ``SUMMARY`` line, which the pytest files read)."""

from __future__ import annotations

import hashlib
import time
import traceback
from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
from torch import nn


class ScenarioFailure(AssertionError):
    """A check of a scenario failed (the message says which, and on which step where it matters)."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`ScenarioFailure` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ScenarioFailure(message)


def params_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in registration order."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_scenarios(names: list[str], run: Callable[[str], Any]) -> int:
    """Run ``run(name)`` for every scenario on every rank; a scenario passes only if it passed on every rank (an
    exception fails it, and the ranks stay in step). Returns the number of scenarios that failed."""
    failed = 0
    for name in names:
        start = time.perf_counter()
        try:
            outcome: tuple[bool, Any] = (True, run(name))
        except Exception as exc:  # report every failure, keep the ranks in step
            outcome = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")
        outcomes = hvd.allgather_object(outcome, name=f"outcome.{name}")
        ok = all(o[0] for o in outcomes)
        failed += not ok
        if hvd.rank() == 0:
            took = time.perf_counter() - start
            if ok:
                print(f"PASS {name} ({took:.1f}s, np={hvd.size()}) {outcomes[0][1]}", flush=True)
            else:
                details = "; ".join(f"rank {r}: {o[1]}" for r, o in enumerate(outcomes) if not o[0])
                print(f"FAIL {name} ({took:.1f}s, np={hvd.size()}) {details}", flush=True)
    if hvd.rank() == 0:
        print(f"SUMMARY {len(names) - failed}/{len(names)} scenarios passed", flush=True)
    return failed
