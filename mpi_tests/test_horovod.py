"""SafeBits under ``horovodrun``: Gloo and MPI, 2 ranks (and one 4-rank Gloo run), plus the digits example.

Each test is one ``horovodrun`` launch of :mod:`hvd_worker` (many scenarios per launch: each launch costs seconds)
with a hard timeout, so a hang (e.g. ranks that disagree and wait for each other) fails instead of blocking.
A non-zero exit or a timeout fails the test with the workers' output. Run: ``.venv/bin/python -m pytest mpi_tests -q``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "mpi_tests" / "hvd_worker.py"
EXAMPLE = REPO / "examples" / "train_digits.py"
BIN = Path(sys.executable).parent
HOROVODRUN = BIN / "horovodrun" if (BIN / "horovodrun").exists() else shutil.which("horovodrun")

# Scenarios of the 4-rank Gloo run (the machine has 2 cores: keep it short).
NP4_SCENARIOS = "train_average,op_sum,groups_int,unused_param,zero_grad_keep,inconsistent,inconsistent_menu"

pytestmark = pytest.mark.skipif(HOROVODRUN is None, reason="horovodrun not installed")


def launch_env() -> dict[str, str]:
    """Environment of a launch: run as root allowed, idle MPI ranks yield the (few) cores."""
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_mpi_yield_when_idle": "1", "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)})
    return env


def horovodrun(np_: int, transport: str, script: Path, *args: str, timeout: float) -> str:
    """Run ``horovodrun -np np_ --transport python script args``; return its output or fail the test."""
    command = [str(HOROVODRUN), "-np", str(np_), "-H", f"localhost:{np_}", f"--{transport}",
               sys.executable, str(script), *args]
    proc = subprocess.Popen(command, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)       # the launcher and every rank it started
        output, _ = proc.communicate()
        pytest.fail(f"timeout after {timeout:.0f}s (a hang?): {' '.join(command)}\n{output[-8000:]}")
    if proc.returncode != 0:
        pytest.fail(f"exit status {proc.returncode}: {' '.join(command)}\n{output[-8000:]}")
    return output


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
    expected = 14 if scenarios == "all" else len(scenarios.split(","))
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
