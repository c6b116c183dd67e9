"""SafeBits' DDP front end under ``torchrun`` (Gloo): 2 and 4 ranks, plus the digits example.

Each test is one ``torchrun`` launch of :mod:`ddp_worker` (every scenario in one launch: a launch costs seconds)
with a hard timeout, so a hang fails instead of blocking. A non-zero exit, a timeout or a scenario that failed on
any rank fails the test with the workers' output. Run: ``.venv/bin/python -m pytest ddp_tests -q``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.train_step import HOOKS
from safebits_hvd.frontends import launch

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "ddp_tests" / "ddp_worker.py"
EXAMPLE = REPO / "examples" / "train_digits_ddp.py"
SCENARIOS = 21
# Scenarios of the 4-rank run (the machine has 2 cores: keep it short).
NP4_SCENARIOS = ("train,no_sync,find_unused,nonfinite,escalations,auto,checkpoint_restore,front_end_parity,"
                 "inconsistent")


def torchrun(ranks: int, script: Path, *args: str, timeout: float) -> str:
    """Run ``script`` on ``ranks`` ranks; return its output or fail the test (exit status, timeout: a hang?)."""
    try:
        return launch.torchrun(ranks, script, *args, timeout=timeout, env={"OMP_NUM_THREADS": "1"})
    except launch.LaunchError as exc:
        pytest.fail(f"{exc}\n{exc.output[-8000:]}")


@pytest.mark.parametrize("ranks", [2, 4], ids=["np2", "np4"])
def test_scenarios(ranks: int) -> None:
    """Every scenario of ``ddp_worker`` passes on every rank (bitwise parameters, reduced gradient = mean of the
    decoded payloads, EF conservation, DDP's features, checkpoints, parity with the Horovod front end, errors)."""
    scenarios = "all" if ranks == 2 else NP4_SCENARIOS
    output = torchrun(ranks, WORKER, "--scenarios", scenarios, timeout=150)
    lines = [m.group(1) for m in re.finditer(r"((?:PASS|FAIL|SUMMARY) [^\n]*)", output)]
    summary = [line for line in lines if line.startswith("SUMMARY")]
    assert summary, f"no summary line in the output:\n{output[-8000:]}"
    assert not [line for line in lines if line.startswith("FAIL")], "\n".join(lines)
    expected = SCENARIOS if scenarios == "all" else len(scenarios.split(","))
    assert summary[-1].startswith(f"SUMMARY {expected}/{expected}"), "\n".join(lines)
    collective = "allgather" if ranks == 2 else "two_phase"
    assert f"'collective': '{collective}'" in next(line for line in lines if line.startswith("PASS train ")), lines


def test_example_train_digits_ddp() -> None:
    """``examples/train_digits_ddp.py`` runs on 2 Gloo ranks and reports accuracy and SafeBits' figures."""
    output = torchrun(2, EXAMPLE, "--epochs", "3", timeout=120)
    epochs = re.findall(r"epoch (\d+).*?loss ([0-9.]+).*?accuracy ([0-9.]+).*?ratio ([0-9.]+)x", output)
    assert len(epochs) == 3, output[-4000:]
    assert float(epochs[-1][1]) < float(epochs[0][1]), output[-4000:]
    assert float(epochs[-1][2]) > 0.5, output[-4000:]
    assert all(float(e[3]) > 1.0 for e in epochs), output[-4000:]


def test_the_one_gpu_training_step_benchmark_runs_every_hook_on_the_cpu() -> None:
    """``bench/train_step.py`` (the real DDP step of ``bench/gpu_check.sh``) at world size 1 on Gloo with its tiny
    models: every hook trains, SafeBits' hook runs every step (the script checks it), and each row is printed."""
    done = subprocess.run([sys.executable, "-m", "bench.train_step", "--tiny", "--steps", "2", "--warmup", "1",
                           "--rounds", "1"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    for model in ("gpt2_small (tiny)", "resnet50 (tiny)"):
        for hook in HOOKS:
            assert re.search(rf"^\| {re.escape(model)} \| {re.escape(hook)} \| [\d.]+ \| [\d.]+ \|$", done.stdout,
                             re.M), (model, hook, done.stdout)


def test_the_race_worker_trains_every_ddp_hook_from_the_same_start_and_records_its_curve(tmp_path: Path) -> None:
    """``bench.race_worker`` (the race's rank) on 2 Gloo ranks, the demo's CNN for 12 steps: each hook's curve
    starts at the same validation loss (same initial weights), has an evaluation every 4 steps and ends lower
    (PowerSGD at rank 1 need not), and SafeBits records the budget of every step."""
    out = tmp_path / "race.json"
    compressors = ["ddp:none", "ddp:fp16", "ddp:powersgd1", "ddp:safebits@4.4", "ddp:safebits@auto"]
    launch.torchrun(2, "-m", "bench.race_worker", "--task", "digits_cnn", "--compressors", *compressors,
                    "--seed", "3", "--steps", "12", "--eval-every", "4", "--out", str(out), timeout=300,
                    env={"OMP_NUM_THREADS": "1"})
    cases = json.loads(out.read_text())["cases"]
    assert [c["compressor"] for c in cases] == compressors
    assert len({c["curve"][0][2] for c in cases}) == 1
    for c in cases:
        assert [p[0] for p in c["curve"]] == [0, 4, 8, 12] and c["train_seconds"] > 0
        assert c["curve"][-1][2] == c["final_loss"] and math.isfinite(c["final_loss"]), c
        if "powersgd" not in c["compressor"]:         # PowerSGD at rank 1 need not improve within 12 steps
            assert c["final_loss"] < c["curve"][0][2], c
        assert len(c["budgets"]) == (12 if "safebits" in c["compressor"] else 0), c
