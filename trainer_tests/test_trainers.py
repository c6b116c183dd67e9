"""SafeBits' DDP hook through PyTorch Lightning and Hugging Face Accelerate: 2 Gloo ranks on CPU.

Each trainer test is one launch of a worker with a hard timeout (a hang fails instead of blocking): Lightning as a
user runs it (the script launches its second rank itself, ``devices=2``), Accelerate under ``torchrun``. Every rank
writes a JSON report; the tests check that the loss fell, the parameters are bitwise equal on both ranks, and
SafeBits really reduced every step (``state.last_step``, fewer bytes on the wire than float32). The tests skip
without the ``trainers`` extra. Run: ``.venv/bin/python -m pytest trainer_tests -q``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from workload import STEPS  # the workers' steps (trainer_tests/ is on sys.path: no __init__.py)

from safebits_hvd import ddp as sbddp
from safebits_hvd.frontends import launch

HERE = Path(__file__).resolve().parent
LIGHTNING_WORKER = HERE / "lightning_worker.py"
ACCELERATE_WORKER = HERE / "accelerate_worker.py"
RANKS = 2
TIMEOUT = 180         # seconds per launch; a run takes about 10 here
ENV = {"OMP_NUM_THREADS": "1"}


def collect_reports(out: Path, start: Callable[[], str]) -> list[dict[str, Any]]:
    """Run ``start`` (a launch writing into ``out``) and return both ranks' reports, or fail the test with the
    workers' output (exit status, timeout: a hang?, a missing report)."""
    try:
        output = start()
    except launch.LaunchError as exc:
        pytest.fail(f"{exc}\n{exc.output[-8000:]}")
    paths = [out / f"rank{r}.json" for r in range(RANKS)]
    missing = [p.name for p in paths if not p.exists()]
    assert not missing, f"no report from {missing}:\n{output[-8000:]}"
    return [json.loads(p.read_text()) for p in paths]


def lightning(out: Path, *args: str) -> list[dict[str, Any]]:
    """The Lightning worker as a user runs it: one process, which starts the second rank itself."""
    command = [sys.executable, str(LIGHTNING_WORKER), "--out", str(out), *args]
    return collect_reports(out, lambda: launch.run_launch(command, RANKS, TIMEOUT, ENV, None))


def accelerate(out: Path, *args: str) -> list[dict[str, Any]]:
    """The Accelerate worker under torchrun."""
    return collect_reports(out, lambda: launch.torchrun(RANKS, ACCELERATE_WORKER, "--out", str(out), *args,
                                                timeout=TIMEOUT, env=ENV))


def check_training(reports: list[dict[str, Any]]) -> None:
    """The loss fell, the ranks ended bitwise equal, and SafeBits reduced every step, compressed."""
    for rank, report in enumerate(reports):
        assert "error" not in report, (rank, report)
        assert report["world_size"] == RANKS, report
        assert report["loss_after"] < 0.7 * report["loss_before"], report
        assert report["safebits_steps"] == STEPS and report["records"] == STEPS, report
        record = report["last_step"]
        assert record is not None, f"rank {rank}: state.last_step is None: the hook never ran"
        assert record["step"] == STEPS - 1, record
        assert record["collective"] == "allgather", record          # two ranks: packed payloads
        assert 0 < record["wire_bytes"] < 4 * report["elements"], record     # less than float32
        assert record["modeled_compression_ratio"] > 1.0, record
    assert len({r["digest"] for r in reports}) == 1, [r["digest"] for r in reports]
    assert len({r["loss_after"] for r in reports}) == 1, reports


def test_state_before_process_group() -> None:
    """Without a process group (a trainer's strategy takes the state before it creates one) SafeBitsState is
    built, with no step yet, and its options are still checked at once."""
    if torch.distributed.is_initialized():
        pytest.skip("needs a process without a torch.distributed process group")
    model = torch.nn.Linear(4, 3)
    state = sbddp.SafeBitsState(model.named_parameters(), budget_bits=4.4)
    assert state.last_step is None and state.step == 0 and state.history == []
    assert state.names == ["weight", "bias"]
    with pytest.raises(ValueError, match="bits must be a finite number"):
        sbddp.SafeBitsState(model.named_parameters(), budget_bits=-1.0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        sbddp.SafeBitsState(model.named_parameters(), chunk_bytes=0)


def test_lightning_ddp_strategy(tmp_path: Path) -> None:
    """``lightning.Trainer(strategy=DDPStrategy(process_group_backend="gloo"), accelerator="cpu", devices=2)``
    with the state built before the trainer and the hook registered by a callback in ``on_fit_start``."""
    pytest.importorskip("lightning")
    pytest.importorskip("sklearn")
    results = lightning(tmp_path)
    check_training(results)
    assert all(r["global_step"] == STEPS for r in results), results


def test_lightning_state_of_another_model_fails_clearly(tmp_path: Path) -> None:
    """A state built from another module's parameters raises a clear ValueError on every rank at the first
    step (the lazily built state's parameter check), instead of training wrongly or hanging."""
    pytest.importorskip("lightning")
    pytest.importorskip("sklearn")
    results = lightning(tmp_path, "--wrong-model")
    for report in results:
        assert "SafeBitsState does not know" in report.get("error", ""), report


def test_accelerate_prepared_model(tmp_path: Path) -> None:
    """``Accelerator(cpu=True)`` under torchrun, ``prepare``, then ``register_comm_hook`` on the prepared model;
    afterwards the same state registered on a second prepared model fails clearly on every rank."""
    pytest.importorskip("accelerate")
    pytest.importorskip("sklearn")
    results = accelerate(tmp_path)
    check_training(results)
    for report in results:
        assert report["backend"] == "gloo", report
        assert "SafeBitsState does not know" in (report["second_model_error"] or ""), report
