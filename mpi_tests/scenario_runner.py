"""What the workers of the MPI and DDP tests share: the check that fails a scenario, the parameters' digest, and
the loop that runs scenarios on every rank, agrees on their outcomes and reports them (rank 0 prints one
``PASS``/``FAIL`` line per scenario and a ``SUMMARY`` line, which the pytest files read). The ranks are Horovod's
by default; the DDP worker (ddp_tests/) passes its torch.distributed ones."""

from __future__ import annotations

import hashlib
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

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


class Ranks(Protocol):
    """The ranks a worker runs on: ``horovod.torch`` itself, or an adapter with the same three calls."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def allgather_object(self, obj: Any, name: str | None = None) -> list[Any]: ...


def run_scenarios(names: list[str], run: Callable[[str], Any], ranks: Ranks | None = None) -> int:
    """Run ``run(name)`` for every scenario on every rank; a scenario passes only if it passed on every rank (an
    exception fails it, and the ranks stay in step). Returns the number of scenarios that failed."""
    if ranks is None:
        import horovod.torch as hvd

        ranks = hvd
    failed = 0
    for name in names:
        start = time.perf_counter()
        try:
            outcome: tuple[bool, Any] = (True, run(name))
        except Exception as exc:  # report every failure, keep the ranks in step
            outcome = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")
        outcomes = ranks.allgather_object(outcome, name=f"outcome.{name}")
        ok = all(o[0] for o in outcomes)
        failed += not ok
        if ranks.rank() == 0:
            took = time.perf_counter() - start
            if ok:
                print(f"PASS {name} ({took:.1f}s, np={ranks.size()}) {outcomes[0][1]}", flush=True)
            else:
                details = "; ".join(f"rank {r}: {o[1]}" for r, o in enumerate(outcomes) if not o[0])
                print(f"FAIL {name} ({took:.1f}s, np={ranks.size()}) {details}", flush=True)
    if ranks.rank() == 0:
        print(f"SUMMARY {len(names) - failed}/{len(names)} scenarios passed", flush=True)
    return failed
