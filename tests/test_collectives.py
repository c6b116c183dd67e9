"""The packed collectives in one process: two SafeBits objects as two ranks, through the public seams
(``SafeBits(..., exchange=..., allgather=...)``), and the pieces of the allgather path."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import safebits_hvd as sb
from safebits_hvd import collectives, kernels, wire
from safebits_hvd.compressor import op_factor

from .helpers import many_tensor_params, random_grads


class Pair:
    """Shared state of two in-process "ranks": the MAX exchange of their statistics and the allgather of their
    payloads (concatenated in rank order, as Horovod's allgather delivers them)."""

    def __init__(self) -> None:
        self.vectors: list[np.ndarray] = []
        self.payloads: dict[str, dict[int, torch.Tensor]] = {}

    def rank(self, rank: int) -> tuple[Any, Any]:
        pair = self

        class Exchange:
            is_local = False
            size = 2

            def __init__(self) -> None:
                self.rank = rank

            def start(self, values: np.ndarray) -> None:
                pair.vectors.append(values)

            def wait(self, handle: None) -> None:
                if len(pair.vectors) == 2:
                    first, second = pair.vectors
                    np.maximum(first, second, out=first)
                    second[:] = first
                    pair.vectors = []

        class Allgather:
            size = 2

            def __init__(self) -> None:
                self.rank = rank

            def start(self, name: str, payload: torch.Tensor) -> str:
                pair.payloads.setdefault(name, {})[rank] = payload.clone()
                return name

            def wait(self, name: str) -> torch.Tensor:
                by_rank = pair.payloads[name]
                return torch.cat([by_rank[0], by_rank[1]])

        return Exchange(), Allgather()


def two_ranks(budget_bits: float, collective: str = "allgather", **kwargs: Any):
    pair = Pair()
    ranks = []
    for rank in range(2):
        params = many_tensor_params()
        exchange, allgather = pair.rank(rank)
        c = sb.SafeBits(params, budget_bits=budget_bits, collective=collective, exchange=exchange,
                        allgather=allgather, **kwargs)
        ranks.append((c, params))
    return ranks


def test_two_ranks_reduce_bitwise_identically_to_the_mean_of_decoded_payloads() -> None:
    ranks = two_ranks(2.0)
    captured: list[dict[str, torch.Tensor]] = [{}, {}]
    for step in range(3):
        pending = []
        for rank, (c, params) in enumerate(ranks):
            random_grads(params, step, seed=1 + rank)
            items = []
            for name, p in reversed(params):
                marker, ctx = c.compress(p.grad)
                captured[rank][name] = kernels.decode(ctx.wire, name=name)
                items.append((name, marker, ctx))
            pending.append(items)
        out = [{name: ranks[r][0].decompress(torch.ones(1), ctx) for name, _, ctx in pending[r]} for r in range(2)]
        for name in out[0]:
            a, b = out[0][name], out[1][name]
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name      # bitwise, -0.0 included
            expected = (captured[0][name].reshape(a.shape) + captured[1][name].reshape(a.shape)) / 2
            assert torch.equal(a, expected), name
    records = [c.last_step for c, _ in ranks]
    assert records[0].collective == records[1].collective == "allgather"
    assert records[0].allocation_digest == records[1].allocation_digest


def test_allgather_sends_what_dense_sends_and_counts_its_bytes() -> None:
    """One process: the decoded payloads are the dense values, the residuals are bitwise the same, and
    ``wire_bytes`` is the modeled bits / 8 plus one header per tensor."""
    results = {}
    for collective in ("dense", "allgather"):
        params = many_tensor_params()
        c = sb.SafeBits(params, budget_bits=2.0, collective=collective)
        outs = []
        for step in range(4):
            random_grads(params, step)
            pending = [c.compress(p.grad) for _, p in reversed(params)]
            outs += [c.decompress(w, ctx).clone() for w, ctx in pending]
        results[collective] = (outs, {k: v.clone() for k, v in c.memory.residuals.items()}, c.history)
    dense, packed = results["dense"], results["allgather"]
    assert all(torch.equal(a, b) for a, b in zip(dense[0], packed[0], strict=True))
    assert all(torch.equal(dense[1][k].view(torch.int32), packed[1][k].view(torch.int32)) for k in dense[1])
    for record_dense, record in zip(dense[2], packed[2], strict=True):
        assert record.collective == "allgather" and record_dense.collective == "dense"
        assert record.modeled_bits_total == record_dense.modeled_bits_total
        assert record.wire_bytes == record.modeled_bits_total // 8 + wire.HEADER_BYTES * len(record.actions)
        assert record_dense.wire_bytes == 4 * sum(p.numel() for _, p in many_tensor_params())


def test_op_sum_and_average_markers() -> None:
    ranks = two_ranks(4.4)
    for rank, (_, params) in enumerate(ranks):
        random_grads(params, 0, seed=1 + rank)
    sent = [[c.compress(p.grad) for _, p in reversed(params)] for c, params in ranks]
    (c0, _), (c1, _) = ranks
    summed = [c0.decompress(torch.full((1,), 2.0), ctx) for _, ctx in sent[0]]       # op=Sum: the marker is P
    averaged = [c1.decompress(torch.ones(1), ctx) for _, ctx in sent[1]]
    for s, a in zip(summed, averaged, strict=True):
        assert torch.allclose(s, 2 * a, rtol=0, atol=0)


def test_op_factor() -> None:
    assert op_factor(torch.ones(1), 4) == 1.0
    assert op_factor(torch.tensor([0.99999994]), 4) == 1.0       # a prescale/postscale pair's rounding
    assert op_factor(torch.tensor([4.0000005]), 4) == 4.0
    with pytest.raises(ValueError, match="Adasum"):
        op_factor(torch.zeros(1), 2)


@pytest.mark.parametrize(("bits", "ranks", "expected"), [
    (4.4, 1, "dense"), (4.4, 2, "allgather"), (4.4, 8, "allgather"), (4.4, 16, "dense"), (31.9, 2, "allgather"),
    (32.0, 2, "dense"), (15.9, 4, "allgather"), (16.0, 4, "dense")])
def test_auto_chooses_the_collective_that_moves_fewer_bytes(bits: float, ranks: int, expected: str) -> None:
    assert collectives.choose("auto", bits, ranks) == expected
    assert collectives.choose("dense", bits, ranks) == "dense"
    assert collectives.choose("allgather", bits, ranks) == "allgather"


def test_gathered_payloads_that_do_not_add_up_are_a_clear_error() -> None:
    e = torch.randn(1000)
    payload, _ = kernels.quantize_pack_ef(None, e.clone(), sb.ACTIONS["int4"], 7)
    gathered = torch.cat([payload, payload])
    out = torch.zeros(1000)
    collectives.sum_payloads(gathered, 2, out, "layer.weight")
    assert torch.equal(out, 2 * kernels.decode(payload))
    with pytest.raises(wire.WireFormatError, match=r"layer\.weight \(rank 1\): truncated"):
        collectives.sum_payloads(gathered[:-1], 2, torch.zeros(1000), "layer.weight")
    with pytest.raises(wire.WireFormatError, match=r"layer\.weight: 3 bytes after"):
        collectives.sum_payloads(torch.cat([gathered, gathered[:3]]), 2, torch.zeros(1000), "layer.weight")
    with pytest.raises(ValueError, match="collective"):
        sb.SafeBits(many_tensor_params(), collective="ring")
