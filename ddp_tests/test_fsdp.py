"""SafeBits' FSDP2 front end (:mod:`safebits_hvd.fsdp`) under ``torchrun`` (Gloo): 2 and 4 ranks.

One ``torchrun`` launch of :mod:`fsdp_worker` per rank count, every scenario in it, with a hard timeout (a hang
fails). Run: ``.venv/bin/python -m pytest ddp_tests/test_fsdp.py -q``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from safebits_hvd import launch

WORKER = Path(__file__).resolve().parent / "fsdp_worker.py"
SCENARIOS = 6


@pytest.mark.parametrize("ranks", [2, 4], ids=["np2", "np4"])
def test_fsdp_scenarios(ranks: int) -> None:
    """Every scenario of ``fsdp_worker`` passes on every rank: the loss falls, replicas hold equal parameters,
    each rank's shard is the mean over ranks within the compression's error, one record a step, accumulation steps
    send nothing, FSDP's bf16 reduce dtype, the hop across replicas only, the checkpoint round trip and the
    errors."""
    try:
        output = launch.torchrun(ranks, WORKER, timeout=150, env={"OMP_NUM_THREADS": "1"})
    except launch.LaunchError as exc:
        pytest.fail(f"{exc}\n{exc.output[-8000:]}")
    lines = [m.group(1) for m in re.finditer(r"((?:PASS|FAIL|SUMMARY) [^\n]*)", output)]
    assert not [line for line in lines if line.startswith("FAIL")], "\n".join(lines)
    assert any(line.startswith(f"SUMMARY {SCENARIOS}/{SCENARIOS}") for line in lines), "\n".join(lines)
    assert f"'members': {ranks * 6}" in next(line for line in lines if line.startswith("PASS train ")), lines
