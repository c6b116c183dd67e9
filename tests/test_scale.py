"""bench.experiments.scale: the byte and time model of SafeBits' collectives from 2 to 1,024 ranks."""

from __future__ import annotations

import math

import pytest

from bench.experiments import scale

INPUTS = scale.Inputs("synthetic", 10_000_000, 4.4, 0.5, 1.0, 0.5, "given")


def test_a_ring_puts_the_same_bytes_through_a_nic_at_any_size_and_bf16_half_of_fp32() -> None:
    n = INPUTS.parameters
    for p in (16, 64, 1024):
        fp32 = scale.traffic("fp32 ring", p, 8, INPUTS)
        assert fp32.nic_bytes == pytest.approx(2 * (p - 1) / p * 4 * n)
        assert scale.traffic("bf16 ring", p, 8, INPUTS).nic_bytes == pytest.approx(fp32.nic_bytes / 2)
    assert scale.traffic("fp32 ring", 8, 8, INPUTS).nic_bytes == 0       # one node: NVLink only


def test_the_allgather_grows_with_the_ranks_and_the_two_phase_all_to_all_with_the_node() -> None:
    payload = INPUTS.parameters * INPUTS.payload_bits / 8
    assert scale.traffic("allgather", 64, 8, INPUTS).nic_bytes == pytest.approx(63 * payload)
    assert scale.traffic("allgather", 64, 8, INPUTS).decoded == 63 * INPUTS.parameters
    two = scale.traffic("two-phase", 64, 8, INPUTS)
    assert two.nic_bytes == pytest.approx(8 * 56 / 64 * payload + 63 / 64 * payload)
    hier = scale.traffic("hierarchical", 64, 8, INPUTS)          # 8 nodes: two-phase across them
    assert hier.nic_bytes == pytest.approx(2 * 7 / 8 * payload)
    assert scale.traffic("hierarchical", 16, 8, INPUTS).nic_bytes == pytest.approx(payload)   # 2 nodes: allgather
    by_node = scale.traffic("sharded, by node", 64, 8, INPUTS)
    assert by_node.nic_bytes == pytest.approx(7 / 8 * payload)


def test_partial_nodes_and_unknown_paths_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fill nodes"):
        scale.nodes_of(12, 8)
    with pytest.raises(ValueError, match="unknown path"):
        scale.traffic("ring of fire", 16, 8, INPUTS)


def test_crossovers_and_break_even_from_the_link_time() -> None:
    rows = scale.grid(INPUTS, ranks=(2, 8, 16, 64, 1024), nic_gbit=(100,))
    crossing = scale.crossovers(rows)
    # 4.4 bits on every edge P - 1 times: more than bf16's 2 (P - 1) / P x 16 bits from 8 ranks on
    assert crossing[(100, "allgather")] == 8
    assert crossing[(100, "hierarchical")] is None and crossing[(100, "sharded, by node")] is None
    at = {(r["ranks"], r["path"]): r for r in rows}
    hier, bf16 = at[(64, "hierarchical")], at[(64, "bf16 ring")]
    ns = scale.break_even_ns(hier, bf16)
    assert ns is not None and hier["link_seconds"] + ns * 1e-9 * hier["work"] == pytest.approx(bf16["seconds"])
    assert scale.break_even_ns(at[(1024, "allgather")], at[(1024, "bf16 ring")]) is None
    autos = [r for r in rows if r["path"] == "auto"]
    assert all(r["chose"] in ("allgather", "two-phase", "fp32 ring") for r in autos)
    assert all(r["seconds"] <= at[(r["ranks"], "fp32 ring")]["seconds"] for r in autos)


def test_powersgd_bits_count_factors_of_matrices_and_vectors_whole() -> None:
    bits = scale.powersgd_bits([(100, 200), (100,)], rank=4)
    assert bits == pytest.approx(32 * (4 * 300 + 100) / (20_000 + 100))
    assert scale.powersgd_bits([(2, 2)], rank=4) == 32.0        # a factor never costs more than the matrix


def test_the_check_table_and_the_ddp_byte_model() -> None:
    assert scale.modelled_ddp_bytes(4, 1000, 3) == 3 * 4 * 2 * 3 / 4 * 1000 * 4
    text = scale.check_markdown([{"ranks": 4, "case": "ddp", "steps": 2, "measured_bytes": 2.2e6,
                                  "modelled_bytes": 2e6}])
    assert "| 4 | ddp | 1.100 | 1.000 | 1.1000 |" in text
    assert math.isclose(scale.mlp_parameters(), 4 * (512 * 512 + 512))
