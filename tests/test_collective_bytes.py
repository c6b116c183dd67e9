"""The pure parts of bench.experiments.collective_bytes: the per-rank bits of each collective, the auto column, the
header note, the markdown and the check of measured records."""

from __future__ import annotations

from typing import Any

import pytest

from bench.experiments import collective_bytes as cb
from safebits_hvd.codec.wire import HEADER_BYTES
from safebits_hvd.comm import collectives

RANKS = cb.RANKS
BITS = cb.PAYLOAD_BITS


@pytest.mark.parametrize("b", BITS)
def test_two_ranks_allgather_equals_two_phase(b: float) -> None:
    assert cb.allgather_bits(b, 2) == pytest.approx(cb.two_phase_bits(b, 2)) == pytest.approx(b)


@pytest.mark.parametrize("b", BITS)
@pytest.mark.parametrize("p", [p for p in RANKS if p > 2])
def test_two_phase_beats_allgather_beyond_two_ranks(b: float, p: int) -> None:
    assert cb.two_phase_bits(b, p) < cb.allgather_bits(b, p)
    assert cb.two_phase_bits(b, p) < 2 * b          # bounded in P, allgather is not
    assert cb.allgather_bits(b, p) == pytest.approx(b * (p - 1))


@pytest.mark.parametrize("p", RANKS)
def test_ring_rows(p: int) -> None:
    rows = dict(cb.table_rows())
    i = RANKS.index(p)
    assert rows["fp32 ring allreduce (dense)"][i] == pytest.approx(64 * (p - 1) / p)
    assert rows["fp16 ring allreduce"][i] == pytest.approx(32 * (p - 1) / p)
    assert cb.relative_to_fp32(rows["fp32 ring allreduce (dense)"][i], p) == pytest.approx(1.0)
    assert cb.relative_to_fp32(rows["fp16 ring allreduce"][i], p) == pytest.approx(0.5)


def test_table_rows_cover_every_b_and_collective() -> None:
    rows = cb.table_rows()
    assert len(rows) == 2 * len(BITS) + 2
    assert all(len(values) == len(RANKS) for _, values in rows)
    by_label = dict(rows)
    assert by_label["allgather, b=1.6"][-1] == pytest.approx(1.6 * 1023)
    assert by_label["two-phase, b=4.4"][-1] == pytest.approx(2 * 4.4 * 1023 / 1024)
    # two-phase relative to the fp32 ring is b / 32 at every P
    for b in BITS:
        for p in RANKS:
            assert cb.relative_to_fp32(cb.two_phase_bits(b, p), p) == pytest.approx(b / 32)


def test_auto_column_is_choose() -> None:
    for b, picks in cb.auto_rows():
        assert picks == [collectives.choose("auto", b, p) for p in RANKS]
        assert set(picks) <= set(collectives.COLLECTIVES) - {"auto"}


def test_auto_never_picks_more_bits_than_dense() -> None:
    bits = {"allgather": cb.allgather_bits, "two_phase": cb.two_phase_bits,
            "dense": lambda b, p: cb.ring_allreduce_bits(32, p)}
    for b, picks in cb.auto_rows(payload_bits=(*BITS, 0.5, 16.0, 24.0, 31.9)):
        for p, pick in zip(RANKS, picks, strict=True):
            assert bits[pick](b, p) <= cb.ring_allreduce_bits(32, p) + 1e-9, (b, p, pick)


def test_auto_at_two_ranks_is_allgather_for_lossy_payloads() -> None:
    assert all(cb.auto_choice(b, 2) == "allgather" for b in BITS)


@pytest.mark.parametrize("p", RANKS)
def test_header_bits(p: int) -> None:
    n = 1_000_000
    assert cb.header_bits_per_element("allgather", p, n) == pytest.approx(HEADER_BYTES * 8 * (p - 1) / n)
    assert cb.header_bits_per_element("two-phase", p, n) == pytest.approx(2 * HEADER_BYTES * 8 * (p - 1) / n)
    assert cb.header_bits_per_element("dense", p, n) == 0


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        cb.allgather_bits(4, 0)
    with pytest.raises(ValueError):
        cb.two_phase_bits(0, 4)
    with pytest.raises(ValueError):
        cb.ring_allreduce_bits(32, True)
    with pytest.raises(ValueError):
        cb.header_bits_per_element("alltoall", 4, 10)
    with pytest.raises(ValueError):
        cb.header_bits_per_element("allgather", 4, 0)


def test_table_markdown() -> None:
    text = cb.table_markdown(elements=1_000_000)
    table_lines = [line for line in text.splitlines() if line.startswith("| ")]
    # bits table: header + rule + 14 rows; auto table: header + rule + 6; header note: header + rule + 10
    assert len(table_lines) == (2 + 2 * len(BITS) + 2) + (2 + len(BITS)) + (2 + len(RANKS))
    assert "| fp32 ring allreduce (dense) | 32 (1x) | 48 (1x) |" in text
    assert "| allgather, b=1 | 1 (0.0312x) |" in text
    assert f"{HEADER_BYTES}-byte header" in text
    b8 = next(line for line in table_lines if line.startswith("| b=8 |"))
    assert b8.strip("| ").split(" | ")[1:] == [collectives.choose("auto", 8.0, p) for p in RANKS]


def _result(collective: str, modeled_bits: int, wire: list[int], ranks: int = 2) -> dict[str, Any]:
    steps = [{"budget": 4.4, "step": s, "collective": collective, "modeled_bits_total": modeled_bits,
              "wire_bytes": wire} for s in range(2)]
    return {"ranks": ranks, "parameters": 1000, "tensors": 3, "budgets": [4.4], "steps": steps}


def test_check_steps() -> None:
    good = _result(collectives.choose("auto", 4.4, 2), 4400, [598, 598])
    assert cb.check_steps(good["steps"], 2, 1000) == []
    bad = _result("dense", 4400, [4000, 4000]) if collectives.choose("auto", 4.4, 2) != "dense" else \
        _result("allgather", 4400, [598, 598])
    problems = cb.check_steps(bad["steps"], 2, 1000)
    assert len(problems) == 2 and "budget 4.4" in problems[0]


def test_measured_markdown() -> None:
    text = cb.measured_markdown([_result("allgather", 4400, [598, 598], ranks=4)])
    row = next(line for line in text.splitlines() if line.startswith("| 4 |"))
    cells = row.strip("| ").split(" | ")
    assert cells[:2] == ["4", "4.4"] and cells[4] == "allgather" and cells[5] == "allgather 2"
    assert cells[6] == "598" and cells[7] == "550" and cells[8] == "48" and cells[9] == "48"
    assert cells[10] == "1,794"          # 598 bytes to each of 3 peers
    uneven = cb.measured_markdown([_result("dense", 32000, [4000, 4000])])
    assert "| 2 | 4.4 | 32.000 |" in uneven and "| - | 4,000 |" in uneven
