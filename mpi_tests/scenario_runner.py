"""What the workers of the MPI and DDP tests share: the check that fails a scenario, the parameters' digest, and
the loop that runs scenarios on every rank, agrees on their outcomes and reports them (rank 0 prints one
``PASS``/``FAIL`` line per scenario and a ``SUMMARY`` line, which the pytest files read). The ranks are Horovod's
by default; the DDP worker (ddp_tests/) passes its torch.distributed ones."""

from __future__ import annotations

import hashlib
import io
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

IN_FEATURES = 20
CLASSES = 4


class Net(nn.Module):
    """The small MLP both workers train: ``aux`` is an extra head used on some steps only (an unused parameter on
    the others; ``aux_by_default``: whether ``forward`` uses it unless told), ``frozen`` an optional frozen layer."""

    def __init__(self, frozen: bool = False, aux_by_default: bool = False) -> None:
        super().__init__()
        self.aux_by_default = aux_by_default
        self.frozen = nn.Linear(IN_FEATURES, IN_FEATURES) if frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(IN_FEATURES, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, CLASSES)
        self.aux = nn.Linear(64, CLASSES)

    def forward(self, x: torch.Tensor, use_aux: bool | None = None) -> torch.Tensor:
        if self.frozen is not None:
            x = x + self.frozen(x)
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        out = self.head(h)
        if self.aux_by_default if use_aux is None else use_aux:
            out = out + self.aux(h)
        return out


def checkpoint_through_bytes(model: nn.Module, opt: torch.optim.Optimizer, compressor: Any) -> dict[str, Any]:
    """The README's checkpoint recipe through a byte buffer: model, optimizer and SafeBits state saved with
    ``torch.save`` and loaded back with ``weights_only=True``."""
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "safebits": compressor.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def restore_checkpoint(saved: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer, compressor: Any) -> None:
    """Load :func:`checkpoint_through_bytes`'s dict into a freshly built model, optimizer and SafeBits."""
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    compressor.load_state_dict(saved["safebits"])


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


def step_failures(step: int, pairs: list[tuple[torch.Tensor, torch.Tensor]], what: str, digest: str) -> list[str]:
    """One step's checks of a torchrun worker that takes the exact mean beside SafeBits': what this rank got
    (``pairs`` of (exact, got), emptied here) is the mean within the compression's error (cosine above 0.8, norm
    ratio 0.7-1.4), and ``digest`` (of the parameters) is the same on every rank. Returns what failed; collected,
    not raised, so that every rank makes the same collectives whatever fails on one."""
    exact = torch.cat([e.flatten() for e, _ in pairs])
    got = torch.cat([g.flatten() for _, g in pairs])
    pairs.clear()
    failures = []
    cosine = float(torch.nn.functional.cosine_similarity(exact, got, dim=0))
    ratio = float(got.norm() / exact.norm().clamp_min(1e-12))
    if not (cosine > 0.8 and 0.7 < ratio < 1.4):
        failures.append(f"step {step}: {what} not the mean over ranks (cosine {cosine:.3f}, norm ratio {ratio:.3f})")
    if len(set(TorchRanks.allgather_object(digest))) != 1:
        failures.append(f"step {step}: parameters differ across ranks")
    return failures


class TorchRanks:
    """The ranks of ``torch.distributed``'s default process group, in the shape :func:`run_scenarios` takes (the
    DDP and FSDP workers)."""

    @staticmethod
    def rank() -> int:
        import torch.distributed as dist

        return dist.get_rank()

    @staticmethod
    def size() -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    @staticmethod
    def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out


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


def run_torch_worker(description: str, table: dict[str, Callable[[], Any]]) -> int:
    """A ``torchrun`` worker's main: ``--scenarios a,b`` (or ``all``) of ``table`` on the default Gloo group, one
    thread per rank; the exit status (2: an unknown scenario)."""
    import argparse
    import sys

    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--scenarios", default="all", help="comma-separated names, or 'all'")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    names = list(table) if args.scenarios == "all" else args.scenarios.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"unknown scenarios {unknown}; known: {list(table)}", file=sys.stderr)
        return 2
    failed = run_scenarios(names, lambda name: table[name](), TorchRanks())
    dist.destroy_process_group()
    return 1 if failed else 0
