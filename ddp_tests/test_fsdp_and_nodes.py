"""SafeBits' FSDP2 front end (:mod:`safebits_hvd.fsdp`) and the DDP hook on the hop across nodes only
(:class:`safebits_hvd.ddp.AcrossNodesState`) under ``torchrun`` (Gloo): 2 and 4 ranks.

One ``torchrun`` launch of a worker per rank count, every scenario in it, with a hard timeout (a hang fails). Run:
``.venv/bin/python -m pytest ddp_tests/test_fsdp_and_nodes.py -q``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from safebits_hvd.frontends import launch

HERE = Path(__file__).resolve().parent
# worker, its scenario count, and the members its train scenario reports at 2 and 4 ranks
WORKERS = {"fsdp": ("fsdp_worker.py", 10, {2: 12, 4: 24}), "nodes": ("nodes_worker.py", 2, {2: 6, 4: 1})}


@pytest.mark.parametrize("ranks", [2, 4], ids=["np2", "np4"])
@pytest.mark.parametrize("worker", sorted(WORKERS))
def test_scenarios(worker: str, ranks: int) -> None:
    """Every scenario passes on every rank. FSDP2: the loss falls, replicas hold equal parameters, each rank's shard is
    the mean over ranks within the compression's error, one record a step, the residuals' bytes, accumulation steps send
    nothing, FSDP's bf16 reduce dtype with bfloat16 residuals, the hop across replicas only, 32 bits passing through
    FSDP's own reduce-scatter, ``auto`` and its noise, the checkpoint round trip and the errors. Across nodes: equal
    parameters, every bucket the mean over all ranks within the compression's error, records alike per place in the
    node, the errors."""
    script, scenarios, members = WORKERS[worker]
    try:
        output = launch.torchrun(ranks, HERE / script, timeout=150, env={"OMP_NUM_THREADS": "1"})
    except launch.LaunchError as exc:
        pytest.fail(f"{exc}\n{exc.output[-8000:]}")
    lines = [m.group(1) for m in re.finditer(r"((?:PASS|FAIL|SUMMARY) [^\n]*)", output)]
    assert not [line for line in lines if line.startswith("FAIL")], "\n".join(lines)
    assert any(line.startswith(f"SUMMARY {scenarios}/{scenarios}") for line in lines), "\n".join(lines)
    assert f"'members': {members[ranks]}" in next(line for line in lines if line.startswith("PASS train ")), lines
