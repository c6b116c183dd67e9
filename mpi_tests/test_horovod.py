"""SafeBits under ``horovodrun``: Gloo and MPI, 2 ranks (and one 4-rank Gloo run), plus the digits example.

Each test is one ``horovodrun`` launch of :mod:`hvd_worker` (many scenarios per launch: each launch costs seconds)
with a hard timeout, so a hang (e.g. ranks that disagree and wait for each other) fails instead of blocking.
A non-zero exit or a timeout fails the test with the workers' output. Run: ``.venv/bin/python -m pytest mpi_tests -q``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from safebits_hvd.frontends import launch

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "mpi_tests" / "hvd_worker.py"
EXAMPLE = REPO / "examples" / "train_digits.py"

# Scenarios of the 4-rank Gloo run (the machine has 2 cores: keep it short).
NP4_SCENARIOS = ("train_average,dense_average,op_sum,groups_int,unused_param,zero_grad_keep,checkpoint_two_phase,"
                 "auto,inconsistent,inconsistent_menu")

pytestmark = pytest.mark.skipif(launch.horovodrun_path() is None, reason="horovodrun not installed")


def horovodrun(np_: int, transport: str, script: Path, *args: str, timeout: float) -> str:
    """Run ``script`` on ``np_`` ranks; return its output or fail the test (exit status, timeout: a hang?)."""
    try:
        return launch.horovodrun(np_, script, *args, transport=transport, timeout=timeout)
    except launch.LaunchError as exc:
        pytest.fail(str(exc))


def scenario_lines(output: str) -> list[str]:
    """The worker's PASS/FAIL/SUMMARY lines, without horovodrun's rank prefixes."""
    return [m.group(1) for m in re.finditer(r"((?:PASS|FAIL|SUMMARY) [^\n]*)", output)]


@pytest.mark.parametrize(("np_", "transport", "scenarios", "expect_transport"), [
    (2, "gloo", "all", "HorovodExchange"),
    (2, "mpi", "all", "MPIExchange"),
    (4, "gloo", NP4_SCENARIOS, "HorovodExchange"),
], ids=["np2-gloo", "np2-mpi", "np4-gloo"])
def test_scenarios(np_: int, transport: str, scenarios: str, expect_transport: str) -> None:
    """Every scenario of ``hvd_worker`` passes on every rank (digests, bitwise parameters, EF, options...)."""
    output = horovodrun(np_, transport, WORKER, "--scenarios", scenarios, "--expect-transport",
                        expect_transport, timeout=170)
    lines = scenario_lines(output)
    summary = [line for line in lines if line.startswith("SUMMARY")]
    assert summary, f"no summary line in the output:\n{output[-8000:]}"
    assert not [line for line in lines if line.startswith("FAIL")], "\n".join(lines)
    expected = 18 if scenarios == "all" else len(scenarios.split(","))
    assert summary[-1].startswith(f"SUMMARY {expected}/{expected}"), "\n".join(lines)


def test_example_train_digits() -> None:
    """``examples/train_digits.py`` runs on 2 Gloo ranks and reports accuracy and SafeBits' figures."""
    output = horovodrun(2, "gloo", EXAMPLE, "--epochs", "3", timeout=120)
    epochs = re.findall(r"epoch (\d+).*?loss ([0-9.]+).*?accuracy ([0-9.]+).*?ratio ([0-9.]+)x", output)
    assert len(epochs) == 3, output[-4000:]
    first_loss, last_loss = float(epochs[0][1]), float(epochs[-1][1])
    assert last_loss < first_loss, output[-4000:]
    assert float(epochs[-1][2]) > 0.5, output[-4000:]
    assert all(float(e[3]) > 1.0 for e in epochs), output[-4000:]
