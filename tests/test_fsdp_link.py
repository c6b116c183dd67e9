"""``bench.experiments.fsdp_link`` on two nodes of ``bench.netns.two_nodes`` (root: ``ip netns``, veth and ``tc``):
one short launch per rank layout, the real path end to end."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from bench.experiments import fsdp_link


def _rows(output: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in output.splitlines() if line.startswith("| ")
            and (cells := [c.strip() for c in line.strip("|").split("|")])[0] not in ("row", "---")}


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")
def test_two_nodes_carry_safebits_only_across_them(capsys: pytest.CaptureFixture[str]) -> None:
    """Two nodes of two ranks: FSDP's own HSDP and SafeBits on the hop across nodes both train; the bytes node 0
    sends across are FSDP's float32 all-reduce of its shards, and SafeBits' a seventh of them or less."""
    status = fsdp_link.main(["--nodes", "2", "--rate", "unlimited", "--rows", "hsdp", "hsdp-safebits@4.4",
                             "--steps", "1", "--warmup", "1", "--timeout", "300"])
    output = capsys.readouterr().out
    assert status == 0, output
    rows = _rows(output)
    assert set(rows) == {"hsdp", "hsdp-safebits@4.4"}, output
    across = {row: float(cells[2]) for row, cells in rows.items()}
    assert across["hsdp"] > 40 and across["hsdp-safebits@4.4"] < across["hsdp"] / 7, output
    assert re.search(r"2 nodes of 2 ranks", output), output
