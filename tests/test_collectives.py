"""The packed collectives in one process: SafeBits objects as ranks in threads, joined through the public seams
(``SafeBits(..., exchange=..., transport=...)``), and the pieces of the allgather and two-phase paths."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import safebits_hvd as sb
from safebits_hvd.codec import host, kernels, wire
from safebits_hvd.comm import collectives
from safebits_hvd.comm.exchange import LocalExchange
from safebits_hvd.comm.transports import LocalTransport
from safebits_hvd.frontends.horovod import op_factor
from safebits_hvd.step import two_phase

from .helpers import many_tensor_params, random_grads


class Group:
    """``ranks`` in-process ranks: a collective completes when every rank has started it under the same name.

    Names repeat every step (as Horovod's do), so a collective is keyed by its name and how many times this rank
    started that name before: a rank that runs a step ahead must not take the result of the step before, which
    a slower rank has not collected yet."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.cond = threading.Condition()
        self.started: dict[tuple[int, str], int] = {}
        self.pending: dict[tuple[str, int], dict[int, Any]] = {}
        self.results: dict[tuple[str, int], list[Any]] = {}     # key -> [result, ranks that have not taken it]

    def contribute(self, name: str, rank: int, item: Any, reduce: Callable[[list[Any]], Any]) -> tuple[str, int]:
        with self.cond:
            key = (name, self.started.get((rank, name), 0))
            self.started[(rank, name)] = key[1] + 1
            contributions = self.pending.setdefault(key, {})
            contributions[rank] = item
            if len(contributions) == self.ranks:
                self.results[key] = [reduce([contributions[r] for r in range(self.ranks)]), self.ranks]
                del self.pending[key]
                self.cond.notify_all()
        return key

    def result(self, key: tuple[str, int]) -> Any:
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.results, timeout=60), f"{key}: a rank never started it"
            entry = self.results[key]
            entry[1] -= 1
            if not entry[1]:
                del self.results[key]
            return entry[0]

    def member(self, rank: int) -> tuple[Any, Any]:
        group = self

        class Exchange:
            is_local = False
            size = group.ranks

            def __init__(self) -> None:
                self.rank = rank

            def start(self, values: np.ndarray) -> tuple[tuple[str, int], np.ndarray]:
                return group.contribute("exchange", rank, values.copy(), lambda vs: np.maximum.reduce(vs)), values

            def wait(self, handle: tuple[tuple[str, int], np.ndarray]) -> None:
                key, values = handle
                values[:] = group.result(key)

        class Transport:
            size = group.ranks

            def __init__(self) -> None:
                self.rank = rank

            def start_allgather(self, name: str, payload: torch.Tensor) -> Any:
                return ("ag", group.contribute(name + ".ag", rank, payload.clone(), torch.cat))

            def start_alltoall(self, name: str, buffer: torch.Tensor, splits: list[int]) -> Any:
                pieces = list(torch.split(buffer.clone(), splits))
                return ("a2a", group.contribute(name + ".a2a", rank, pieces, lambda all_pieces: all_pieces))

            def wait(self, handle: Any) -> Any:
                kind, key = handle
                result = group.result(key)
                if kind == "ag":
                    return result
                mine = [pieces[rank] for pieces in result]      # what every rank sent this one, in rank order
                return torch.cat(mine), torch.tensor([p.numel() for p in mine], dtype=torch.int32)

        return Exchange(), Transport()


def run_ranks(ranks: int, body: Callable[[int, Any, Any], Any]) -> list[Any]:
    """Run ``body(rank, exchange, transport)`` in one thread per rank; return the results in rank order."""
    group = Group(ranks)
    results: list[Any] = [None] * ranks
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank, *group.member(rank))
        except BaseException as exc:   # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def train(collective: str, ranks: int, steps: int, budget_bits: float = 2.0, op_sum: bool = False,
          after_step: Callable[[sb.SafeBits], None] | None = None, **kwargs: Any):
    """Per rank: reduced gradients per step, what it sent (decoded) per step, and the compressor
    (``after_step(compressor)`` after each step's last ``decompress``)."""

    def body(rank: int, exchange: Any, transport: Any) -> dict[str, Any]:
        params = many_tensor_params()
        c = sb.SafeBits(params, budget_bits=budget_bits, collective=collective, exchange=exchange,
                        transport=transport, **kwargs)
        reduced, sent = [], []
        for step in range(steps):
            random_grads(params, step, seed=1 + rank)
            pending = [(name, p.grad.shape, *c.compress(p.grad)) for name, p in reversed(params)]
            sent.append({name: collectives.decode_sequence(ctx.wire, torch.zeros(shape.numel()), name)
                         if ctx.handle.packed else out.clone() for name, shape, out, ctx in pending})
            marker = torch.full((1,), float(ranks) if op_sum else 1.0)
            reduced.append({name: c.decompress(marker if ctx.handle.packed else out, ctx).clone()
                            for name, _, out, ctx in pending})
            if after_step is not None:
                after_step(c)
        return {"reduced": reduced, "sent": sent, "compressor": c}

    return run_ranks(ranks, body)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.int32), b.reshape(-1).view(torch.int32))


@pytest.mark.parametrize("ranks", [2, 3])
def test_allgather_reduces_bitwise_identically_to_the_mean_of_what_was_sent(ranks: int) -> None:
    """Ranks 0 and 1 start the sum from their own values, written by the send pass; rank 2 of 3 decodes every
    payload: all get bitwise the mean of what was sent, summed in rank order."""
    results = train("allgather", ranks=ranks, steps=3)
    for step in range(3):
        for name, a in results[0]["reduced"][step].items():
            total = results[0]["sent"][step][name].clone()
            for rank in range(1, ranks):
                assert bitwise(a, results[rank]["reduced"][step][name]), name
                total += results[rank]["sent"][step][name]
            assert torch.equal(a.reshape(-1), total / ranks), name
    records = [r["compressor"].last_step for r in results]
    assert {r.collective for r in records} == {"allgather"}
    assert len({r.allocation_digest for r in records}) == 1


@pytest.mark.parametrize("collective", ["allgather", "dense"])
def test_a_step_is_recorded_at_its_last_decompress(collective: str) -> None:
    """The statistics exchange is finished (and the step recorded) when the last tensor is taken, not the first:
    earlier tensors decode while later collectives are still in flight."""

    def body(rank: int, exchange: Any, transport: Any) -> list[Any]:
        params = many_tensor_params()
        c = sb.SafeBits(params, budget_bits=2.0, collective=collective, exchange=exchange, transport=transport)
        random_grads(params, 0, seed=1 + rank)
        pending = [c.compress(p.grad) for _, p in reversed(params)]
        records = []
        for out, ctx in pending:
            c.decompress(torch.ones(1) if collective != "dense" else out, ctx)
            records.append(c.last_step)
        return records

    for records in run_ranks(2, body):
        assert all(r is None for r in records[:-1])
        assert records[-1] is not None and records[-1].step == 0


@pytest.mark.parametrize("ranks", [2, 3])
def test_two_phase_is_bitwise_identical_and_conserves_the_second_hop(ranks: int) -> None:
    """Every rank gets the same bits; per owned segment, what every rank sent equals what the second hop sent plus
    the owner's second-hop residual (its error feedback), summed over the steps; and within the screen's bound."""
    steps = 4
    results = train("two_phase", ranks=ranks, steps=steps, op_sum=True)
    names = [name for name, _ in many_tensor_params()]
    for step in range(steps):
        for name in names:
            for r in range(1, ranks):
                assert bitwise(results[0]["reduced"][step][name], results[r]["reduced"][step][name]), name
    bucket = sb.DEFAULT_MENU.bucket_size
    for name, p in many_tensor_params():
        n = p.numel()
        first_hop = sum(results[r]["sent"][s][name] for r in range(ranks) for s in range(steps)).double()
        second_hop = sum(results[0]["reduced"][s][name].reshape(-1) for s in range(steps)).double()
        index = results[0]["compressor"].names.index(name)
        for owner, (start, stop) in enumerate(collectives.segment_bounds(n, bucket, ranks, index)):
            residual = results[owner]["compressor"].core.two_phase.memory.residuals[name].double()
            lhs = second_hop[start:stop] + residual
            scale = first_hop[start:stop].abs().sum() / max(1, stop - start) + 1e-12
            assert torch.allclose(lhs, first_hop[start:stop], rtol=1e-5, atol=1e-5 * float(scale)), (name, owner)
    record = results[0]["compressor"].last_step
    assert record.collective == "two_phase"
    state = results[0]["compressor"].state_dict()
    assert set(state["second_hop_residuals"]) == set(names)


def test_the_second_hop_escalates_through_the_first_hops_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tight screen (``max_distortion=0.05``): sums whose allocated action fails its exact statistics escalate
    through :func:`~safebits_hvd.step.sending.escalation_rounds`, and what the second hop sends of the first step
    (no residual before it) passes the screen on every owned segment. Skipping the rounds fails the bound."""
    escalated: list[int] = []
    rounds = two_phase.escalation_rounds

    def counted(orders: dict[int, list[int]], *rest: Any) -> Any:
        escalated.append(len(orders))
        return rounds(orders, *rest)

    monkeypatch.setattr(two_phase, "escalation_rounds", counted)
    ranks, max_distortion = 3, 0.05
    results = train("two_phase", ranks=ranks, steps=1, op_sum=True, max_distortion=max_distortion)
    assert sum(escalated) >= 10, escalated
    bucket = sb.DEFAULT_MENU.bucket_size
    for name, p in many_tensor_params():
        index = results[0]["compressor"].names.index(name)
        summed = sum(results[r]["sent"][0][name] for r in range(ranks)).double()
        sent = results[0]["reduced"][0][name].reshape(-1).double()
        for start, stop in collectives.segment_bounds(p.numel(), bucket, ranks, index):
            v, q = summed[start:stop], sent[start:stop]
            if float(v.norm()) > 0:
                assert float((q - v).norm() ** 2 / v.norm() ** 2) <= max_distortion, (name, start)


def test_allgather_fuses_small_tensors_and_survives_an_incomplete_step() -> None:
    """81 tensors travel in 3 allgathers per step (their fusion groups), and the sums are still bitwise the mean of
    what was sent. In a step where one tensor is never compressed, its group goes out when first asked for, with
    zeros for it, on every rank alike."""
    sizes = (3,) * 40 + (300_000,) + (5,) * 40
    groups = collectives.fusion_groups(np.array(sizes))
    assert [len(g) for g in groups] == [40, 1, 40]

    def body(rank: int, exchange: Any, transport: Any) -> list[tuple[dict, dict]]:
        started = []

        class Counting:               # the rank's transport, counting the allgathers started
            rank, size = transport.rank, transport.size
            start_alltoall, wait = transport.start_alltoall, transport.wait

            def start_allgather(self, name: str, payload: torch.Tensor) -> Any:
                started.append(name)
                return transport.start_allgather(name, payload)

        counting = Counting()
        gen = torch.Generator().manual_seed(rank)
        params = [(f"p{i}", torch.nn.Parameter(torch.randn(n, generator=gen))) for i, n in enumerate(sizes)]
        c = sb.SafeBits(params, budget_bits=4.4, collective="allgather", exchange=exchange, transport=counting)
        steps = []
        for step in range(3):
            for _, p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            skipped = {"p0"} if step == 1 else set()
            pending = [(name, c.compress(p.grad)) for name, p in reversed(params) if name not in skipped]
            sent = {name: collectives.decode_sequence(ctx.wire, torch.zeros(ctx.shape.numel()), name)
                    for name, (_, ctx) in pending}
            reduced = {name: c.decompress(torch.ones(1), ctx).reshape(-1).clone() for name, (_, ctx) in pending}
            steps.append((sent, reduced, len(started)))
            started.clear()
        return steps

    results = run_ranks(2, body)
    for step in range(3):
        assert results[0][step][2] == results[1][step][2] == len(groups), step
        for name, a in results[0][step][1].items():
            assert bitwise(a, results[1][step][1][name]), (step, name)
            assert torch.equal(a, (results[0][step][0][name] + results[1][step][0][name]) / 2), (step, name)


def test_allgather_sends_what_dense_sends() -> None:
    """One process: the decoded payloads are the dense values and the residuals are bitwise the same."""
    results = {}
    for collective in ("dense", "allgather", "two_phase"):
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
    assert all(bitwise(dense[1][k], packed[1][k]) for k in dense[1])
    for record in packed[2]:
        assert record.collective == "allgather" and record.wire_bytes == 0     # one process: nothing crosses a link
    # One rank owns the single segment: the second hop re-encodes the first hop's decoded values.
    assert all(r.collective == "two_phase" for r in results["two_phase"][2])


def test_wire_bytes_count_what_crosses_the_link() -> None:
    results = train("allgather", ranks=2, steps=2)
    for r in results:
        record = r["compressor"].last_step
        assert record.wire_bytes == record.modeled_bits_total // 8 + wire.HEADER_BYTES * len(record.actions)
    dense = train("dense", ranks=2, steps=1)
    total = sum(p.numel() for _, p in many_tensor_params())
    assert dense[0]["compressor"].last_step.wire_bytes == 4 * total      # a ring allreduce at P = 2


def test_op_sum_and_average_markers() -> None:
    summed = train("allgather", ranks=2, steps=1, budget_bits=4.4, op_sum=True)
    averaged = train("allgather", ranks=2, steps=1, budget_bits=4.4)
    for name, s in summed[0]["reduced"][0].items():
        assert torch.equal(s, 2 * averaged[0]["reduced"][0][name]), name


def test_op_factor() -> None:
    assert op_factor(torch.ones(1), 4) == 1.0
    assert op_factor(torch.tensor([0.99999994]), 4) == 1.0       # a prescale/postscale pair's rounding
    assert op_factor(torch.tensor([4.0000005]), 4) == 4.0
    with pytest.raises(ValueError, match="Adasum"):
        op_factor(torch.zeros(1), 2)


def test_the_op_is_read_once_and_a_marker_that_comes_back_changed_fails_its_step() -> None:
    """Horovod's reduced marker is read at the first step only; a later step whose marker has other bits (another
    op) fails when its last group is decoded, in the read of what was received, before the optimizer steps."""
    params = many_tensor_params()
    compressor = sb.SafeBits(params, budget_bits=4.4, collective="allgather")
    for step in range(3):
        random_grads(params, step)
        pending = [compressor.compress(p.grad) for _, p in reversed(params)]
        before = host.reads()
        marker = torch.full((1,), 2.0) if step == 2 else torch.ones(1)
        if step < 2:
            for _, ctx in pending:
                compressor.decompress(marker, ctx)
            groups = len(collectives.fusion_groups(compressor.numels))
            # On the CPU a header check per group, and the marker: read at the first step, checked in one read after.
            assert host.reads() - before == groups + 1, step
            continue
        with pytest.raises(ValueError, match="another op than earlier steps'"):
            for _, ctx in pending:
                compressor.decompress(marker, ctx)


@pytest.mark.parametrize(("bits", "ranks", "expected"), [
    (4.4, 1, "dense"), (4.4, 2, "allgather"), (31.9, 2, "allgather"), (32.0, 2, "dense"), (4.4, 3, "two_phase"),
    (4.4, 1024, "two_phase"), (32.0, 8, "dense")])
def test_auto_chooses_the_collective_that_moves_fewer_bytes(bits: float, ranks: int, expected: str) -> None:
    assert collectives.choose("auto", bits, ranks) == expected
    for fixed in ("dense", "allgather", "two_phase"):
        assert collectives.choose(fixed, bits, ranks) == fixed


@pytest.mark.parametrize("index", [0, 1, 5])
@pytest.mark.parametrize(("n", "ranks"), [(0, 2), (7, 3), (512, 2), (513, 2), (5000, 4), (70_000, 3)])
def test_segments_cover_the_tensor_at_bucket_boundaries(n: int, ranks: int, index: int) -> None:
    bounds = collectives.segment_bounds(n, 512, ranks, index)
    assert len(bounds) == ranks and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert all(start % 512 == 0 or start == n for start, _ in bounds)
    buckets = [-(-(stop - start) // 512) for start, stop in bounds]
    assert max(buckets) - min(buckets) <= 1


def test_one_bucket_tensors_spread_over_every_owner() -> None:
    """Biases and norms (one bucket each) go to a different owner each, so no owner's second-hop payloads (which
    torch.distributed's all_gather pads every rank's to) grow with the model's count of small tensors."""
    ranks = 8
    owners = [next(r for r, (start, stop) in enumerate(collectives.segment_bounds(300, 512, ranks, index))
                   if stop > start) for index in range(2 * ranks)]
    assert sorted(owners) == sorted(list(range(ranks)) * 2)
    per_owner = np.zeros(ranks, dtype=np.int64)
    for index, n in enumerate([262_144, 512] * 4 + [1000] * 6):
        for owner, (start, stop) in enumerate(collectives.segment_bounds(n, 512, ranks, index)):
            per_owner[owner] += stop - start
    assert per_owner.max() - per_owner.min() <= 2 * 512


def test_gathered_payloads_that_do_not_add_up_are_a_clear_error() -> None:
    e = torch.randn(1000)
    payload, _ = kernels.quantize_pack_ef(None, e.clone(), sb.ACTIONS["int4"], 7)
    gathered = torch.cat([payload, payload])
    parts = collectives.split_payloads(gathered, 2, "layer.weight")
    assert all(torch.equal(part, payload) for part in parts)
    with pytest.raises(wire.WireFormatError, match=r"layer\.weight \(payload 1\): truncated"):
        collectives.split_payloads(gathered[:-1], 2, "layer.weight")
    with pytest.raises(wire.WireFormatError, match=r"layer\.weight: 3 bytes after 2 payloads"):
        collectives.split_payloads(torch.cat([gathered, gathered[:3]]), 2, "layer.weight")
    with pytest.raises(wire.WireFormatError, match="hold 1000 elements, the tensor 1001"):
        collectives.decode_sequence(payload, torch.zeros(1001), "layer.weight")
    with pytest.raises(wire.WireFormatError, match="more than the 999 elements"):
        collectives.decode_sequence(payload, torch.zeros(999), "layer.weight")
    with pytest.raises(ValueError, match="collective"):
        sb.SafeBits(many_tensor_params(), collective="ring")


def _gathered_group(sizes: list[int], sent: np.ndarray, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """A gathered buffer as a rank's allgather delivers it: rank after rank, member after member, member ``k`` of
    rank ``r`` packed at menu action ``sent[k, r]``; and where each payload starts ``[member, rank]``."""
    menu = sb.DEFAULT_MENU
    parts, offsets, offset = [], np.zeros(sent.shape, dtype=np.int64), 0
    for r in range(sent.shape[1]):
        for k, n in enumerate(sizes):
            gen = torch.Generator().manual_seed(seed + 31 * k + r)
            payload, _ = kernels.quantize_pack_ef(None, torch.randn(n, generator=gen), menu[int(sent[k, r])], 3)
            parts.append(payload)
            offsets[k, r] = offset
            offset += payload.numel()
    return torch.cat(parts), offsets


@pytest.mark.parametrize("escalated", [0, 1, 3, 40, 120])
def test_payloads_are_located_whichever_members_escalated_on_whichever_rank(escalated: int) -> None:
    """``locate_payloads`` against where the payloads really are, with any number of them sent at another action
    than allocated (a rank escalated them): 60 members on 2 ranks, and one read back when none did."""
    menu = sb.DEFAULT_MENU
    rng = np.random.default_rng(escalated)
    sizes = [int(n) for n in rng.integers(1, 3000, 60)]
    tables = kernels.GroupTables(menu, np.array(sizes), sb.policy.budget.BudgetPolicy(menu, np.array(sizes), 0.5,
                                                                                 0.7).cost_order)
    expected = rng.integers(0, len(menu), len(sizes))
    sent = np.repeat(expected[:, None], 2, axis=1)
    slots = rng.choice(sent.size, escalated, replace=False)
    sent.reshape(-1)[slots] = (sent.reshape(-1)[slots] + rng.integers(1, len(menu), escalated)) % len(menu)
    gathered, offsets = _gathered_group(sizes, sent, escalated)
    rows = np.repeat(np.arange(len(sizes))[:, None], 2, axis=1)
    names = [f"t{k}" for k in range(len(sizes))]
    reads = host.reads()
    located, actions = kernels.locate_payloads(gathered, rows, expected, tables, names, "group 0")
    assert np.array_equal(located.offsets, offsets) and np.array_equal(actions, sent)
    assert host.reads() - reads == 1 if escalated == 0 else host.reads() - reads <= 2
    # A corrupt header after the escalated ones is named; so is a buffer cut short, or one with bytes left over.
    corrupt = gathered.clone()
    corrupt[int(offsets[37, 1]) + 3] ^= 0x40
    with pytest.raises(wire.WireFormatError, match=r"t37 \(rank 1\)"):
        kernels.locate_payloads(corrupt, rows, expected, tables, names, "group 0")
    with pytest.raises(wire.WireFormatError, match=r"t59 \(rank 1\): truncated payload: \d+ bytes left, expected"):
        kernels.locate_payloads(gathered[:-1], rows, expected, tables, names, "group 0")
    with pytest.raises(wire.WireFormatError, match=r"t59 \(rank 1\): truncated payload: 4 bytes left, a header"):
        kernels.locate_payloads(gathered[:int(offsets[59, 1]) + 4], rows, expected, tables, names, "group 0")
    with pytest.raises(wire.WireFormatError, match="group 0: 5 bytes after 120 payloads"):
        kernels.locate_payloads(torch.cat([gathered, gathered[:5]]), rows, expected, tables, names, "group 0")


def rows_core(names: list[str], numels: np.ndarray, exchange: Any, transport: Any,
              owners: np.ndarray | None = None) -> Any:
    """A core over ``names`` at 3 bits, as the FSDP front end builds one: on the reduce-scatter path with
    ``owners``, else the allgather path."""
    from safebits_hvd.frontends.shared import build_core_over

    extra = {"collective": "reduce_scatter", "owners": owners} if owners is not None else {"collective": "allgather"}
    return build_core_over(names, numels, 3.0, 0.5, 0.7, sb.DEFAULT_MENU, 0, None, sample_buckets=16,
                           consistency_check_every=1, nonfinite="propagate", screen=True, name="rows",
                           max_history=10, timeout=60.0, exchange=exchange, transport=transport, fusion_bytes=0,
                           **extra)


def sharded_step(collective: str, ranks: int, steps: int = 3) -> list[dict[str, Any]]:
    """Per rank, a core over 5 tensors per rank's row (as the FSDP front end's members), each row owned by its
    rank: every step one group of every row, in owner order; the sums this rank gets of its own row, and what the
    records say."""
    sizes = [700, 3, 1500, 64, 257]
    names = [f"t{j}#row{r}" for r in range(ranks) for j in range(len(sizes))]
    numels = np.array(sizes * ranks, dtype=np.int64)
    owners = np.repeat(np.arange(ranks), len(sizes))

    def body(rank: int, exchange: Any, transport: Any) -> dict[str, Any]:
        core = rows_core(names, numels, exchange, transport, owners if collective == "reduce_scatter" else None)
        gen = torch.Generator().manual_seed(7 + rank)
        sums = []
        for _ in range(steps):
            grads = [torch.randn(int(n), generator=gen) for n in numels]
            handle = core.begin(collectives.Grouping(0, "rows", "test"))
            core.send_group(list(range(len(names))), grads, [g.clone() for g in grads], close=False)
            core.close()
            mine = [i for i in range(len(names)) if owners[i] == rank]
            sums.append([t.clone() for t in core.reduced_sums(mine, handle, [None] * len(mine), divisor=ranks)])
            core.end(handle.step)
            core.finish()
        return {"sums": sums, "core": core}

    return run_ranks(ranks, body)


@pytest.mark.parametrize("ranks", [2, 3])
def test_reduce_scatter_gives_each_owner_the_allgather_sums_bitwise(ranks: int) -> None:
    """The reduce-scatter path (FSDP's rows): each rank gets bitwise the sums the allgather path gives of the rows
    it owns, and its payloads cross the link to their owner only: ``(P - 1) / P`` of the allgather's bytes at
    the same actions."""
    scattered, gathered = sharded_step("reduce_scatter", ranks), sharded_step("allgather", ranks)
    for rank in range(ranks):
        for step in range(3):
            for a, b in zip(scattered[rank]["sums"][step], gathered[rank]["sums"][step], strict=True):
                assert bitwise(a, b)
        rs, ag = scattered[rank]["core"].log.history[-1], gathered[rank]["core"].log.history[-1]
        assert (rs.collective, ag.collective) == ("reduce_scatter", "allgather")
        assert rs.allocation_digest == ag.allocation_digest
        # Equal actions everywhere (no escalation at 3 bits here): the bytes are each rank's payloads once, (P-1)/P.
        assert not rs.escalations and not ag.escalations
        assert rs.wire_bytes * (ranks - 1) == pytest.approx(ag.wire_bytes * (ranks - 1) / ranks, rel=0.05)


def test_reduce_scatter_refuses_what_it_cannot_do() -> None:
    """Only the owner gets a tensor's sum; a group must be in owner order; the path needs its owners; 32 bits pass
    through the front end's own reduce-scatter."""
    with pytest.raises(ValueError, match="receives only the tensors it owns"):
        def body(rank: int, exchange: Any, transport: Any) -> None:
            core = rows_core(["a", "b"], np.array([600, 600]), exchange, transport, np.array([0, 1]))
            handle = core.begin(collectives.Grouping(0, "rows", "test"))
            core.send_group([0, 1], [torch.ones(600), torch.ones(600)], [None, None], close=False)
            core.close()
            core.reduced_sums([1 - rank], handle, [None], divisor=2)
        run_ranks(2, body)
    with pytest.raises(RuntimeError, match="in owner order"):
        def unordered(rank: int, exchange: Any, transport: Any) -> None:
            core = rows_core(["a", "b"], np.array([600, 600]), exchange, transport, np.array([1, 0]))
            core.begin(collectives.Grouping(0, "rows", "test"))
            core.send_group([0, 1], [torch.ones(600), torch.ones(600)], [None, None], close=False)
        run_ranks(2, unordered)
    with pytest.raises(ValueError, match="reduce_scatter"):
        from safebits_hvd.frontends.shared import build_core_over

        build_core_over(["a"], np.array([10]), 3.0, 0.5, 0.7, sb.DEFAULT_MENU, 0, None, sample_buckets=16,
                        consistency_check_every=1, nonfinite="propagate", screen=True, name="rows", max_history=10,
                        collective="reduce_scatter", timeout=60.0, exchange=LocalExchange(),
                        transport=LocalTransport())     # no owners
    assert collectives.choose("reduce_scatter", 32.0, 4) == "dense"
    assert collectives.choose("reduce_scatter", 4.4, 4) == "reduce_scatter"


@pytest.mark.parametrize("extra", [-5, 0, 7], ids=["shorter", "as_allocated", "escalated"])
def test_torch_alltoall_at_expected_sizes_reads_nothing_before_the_payloads_move(extra: int) -> None:
    """``torch.distributed``'s alltoall given the bytes every rank expects (the reduce-scatter path's allocated
    sizes): no read back before it launches; a split longer than expected sends its rest in a second alltoall, a
    shorter one is padded; what arrives is the buffer itself (one rank on Gloo). Without expected sizes, the splits
    are exchanged first: one read before anything moves."""
    import torch.distributed as dist

    from safebits_hvd.comm import transports

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        transport = transports.TorchDistributedTransport(timeout=30.0)
        buffer = (torch.arange(40 + extra) % 251).to(torch.uint8)
        for expected, reads_at_launch in (([40], 0), (None, 1)):
            with host.counting() as launched:
                handle = transport.start_alltoall("t", buffer, [buffer.numel()])
                transports.launch(transport, expected)
            received, splits = transport.wait(handle)
            assert launched.traffic.reads == reads_at_launch
            assert torch.equal(received, buffer) and splits.tolist() == [buffer.numel()]
        transport.start_alltoall("t", buffer, [buffer.numel()])
        with pytest.raises(ValueError, match="one queued"):
            transports.launch(transport, 40)          # an allgather's expected bytes for an alltoall
    finally:
        dist.destroy_process_group()
