"""The per-tensor cost of a SafeBits step in one process: 1,000 tensors through ``compress`` and ``decompress``.

The allgather path (``collective="allgather"``, the default on 2 ranks) in one process: every compress only
registers its tensor until its fusion group is complete, the group is sent in one batched pass, and the first
decompress of a group decodes the whole group (docs/DESIGN.md, "The batched step"). With 16-element tensors the
kernels' own work is small, so the figure is SafeBits' cost per tensor; with 272 elements (the 1,000-tensor model
of ``bench.suites.horovod_overhead``) it includes the kernels. ``test_thousand_tensor_dense_step``: the same step on
the dense path (each tensor a group of one, its values only), for comparison;
``test_thousand_tensor_pass_through_step``: a pass-through step (32 bits).
``test_sending_a_group_of_thousand_tensors``: the batched send pass of one such group alone (``kernels.pack_group``).
``test_locating_a_gathered_group``: where each payload of a gathered group of 1,000 members from 2 ranks starts
(``kernels.locate_payloads``), when every rank sent what was allocated and when some escalated.

``SAFEBITS_BENCH_DEVICE=cuda`` runs the step tests on a GPU (parameters, gradients and residuals on the device; every
timed call ends with ``torch.cuda.synchronize``).

``extra_info``: ``us_per_tensor`` (compress plus decompress, per tensor, median step), ``host_reads_per_step``
(reads back to the host, :mod:`safebits_hvd.codec.host`), ``step_vs_clone`` (the step over ``torch.clone`` of the same
1,000 gradients, the machine's speed of one small tensor operation; lower is better).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np
import pytest
import torch

import safebits_hvd as sb
from bench.suites import model_shapes
from safebits_hvd.codec import host, kernels
from safebits_hvd.comm.transports import LocalTransport
from safebits_hvd.policy.screen import ScreenRule

TENSORS = 1000
DEVICE = os.environ.get("SAFEBITS_BENCH_DEVICE", "cpu")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("SAFEBITS_BENCH_DEVICE=cuda but no CUDA device", allow_module_level=True)


def synchronized(fn: Any) -> Any:
    """``fn`` followed by waiting for the device, so that a timer around it measures the device's work too."""
    if DEVICE != "cuda":
        return fn

    def call() -> None:
        fn()
        torch.cuda.synchronize()

    call.__wrapped__ = fn         # type: ignore[attr-defined]
    return call


class MirrorTransport(LocalTransport):
    """One process standing for ``size`` ranks that all sent this rank's bytes: an allgather returns the payload
    ``size`` times, so every member is decoded from ``size`` payloads, in rank order, as on ``size`` ranks."""

    def __init__(self, size: int) -> None:
        self.size = size

    def start_allgather(self, name: str, payload: torch.Tensor) -> Any:
        return payload.repeat(self.size)


def make_step(sizes: list[int], collective: str = "allgather", budget_bits: float = 4.4,
              ranks: int = 1) -> tuple[Any, Any, list[torch.Tensor]]:
    """The step's compressor, the step (every compress in backward's order, then every decompress) and the
    gradients; ``ranks`` > 1: each allgather brings ``ranks`` copies of this rank's payloads (:class:`MirrorTransport`),
    all decoded."""
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n, device=DEVICE))) for i, n in enumerate(sizes)]
    compressor = sb.SafeBits(params, budget_bits=budget_bits, collective=collective,
                             transport=MirrorTransport(ranks) if ranks > 1 else None)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen).to(DEVICE) for n in sizes]

    def step() -> None:
        for (_, p), g in zip(params, grads, strict=True):
            p.grad = g.clone()           # what backward leaves (a new tensor each step, as set_to_none does)
        pending = [compressor.compress(p.grad) for _, p in reversed(params)]      # backward's order
        for out, ctx in pending:
            compressor.decompress(out, ctx)

    return compressor, synchronized(step), grads


def median_seconds(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@pytest.mark.parametrize("numel", [16, 272])
def test_thousand_tensor_step(benchmark: Any, numel: int) -> None:
    compressor, reads = measure_step(benchmark, numel, "allgather")
    groups = len(sb.comm.collectives.fusion_groups(compressor.numels))
    assert reads <= 2 * groups + 1, (reads, groups)


@pytest.mark.parametrize("numel", [16, 272])
def test_thousand_tensor_dense_step(benchmark: Any, numel: int) -> None:
    """The dense path (``collective="dense"``: Horovod allreduces the values ``compress`` returns, so each tensor
    is sent alone, a group of one): one read back per tensor."""
    _, reads = measure_step(benchmark, numel, "dense")
    assert reads <= TENSORS, reads


@pytest.mark.full
@pytest.mark.parametrize("model", ["resnet18", "resnet50", "gpt2_small"])
def test_model_step(benchmark: Any, model: str) -> None:
    """One step of a model's gradients (its parameter shapes, ``bench.suites.model_shapes``) at 4.4 bits on the
    allgather path, as on 2 ranks (a second rank's payloads decoded too: :class:`MirrorTransport`);
    ``fp16_vs_clone``: the casts ``Compression.fp16`` makes of the same gradients (to float16 and back), for
    scale."""
    sizes = [model_shapes.numel(shape) for _, shape in model_shapes.MODELS[model]()]
    compressor, reads = measure_step(benchmark, sizes, "allgather", ranks=2)
    grads = [torch.randn(n).to(DEVICE) for n in sizes]
    fp16 = median_seconds(synchronized(lambda: [g.half().float() for g in grads]), 5)
    clone = median_seconds(synchronized(lambda: [g.clone() for g in grads]), 5)
    benchmark.extra_info.update({"model": model, "fp16_vs_clone": round(fp16 / clone, 3)})
    assert reads <= 2 * len(sb.comm.collectives.fusion_groups(compressor.numels)) + 1, reads


def test_thousand_tensor_pass_through_step(benchmark: Any) -> None:
    """A pass-through step (32 bits on the dense path: what ``budget_bits="auto"`` runs where compression does not
    pay): after the step's first tensor, ``compress`` hands on the gradient itself, with no read back."""
    compressor, reads = measure_step(benchmark, 272, "dense", budget_bits=32.0)
    assert compressor.last_step.pass_through and reads == 0, reads


@pytest.mark.parametrize("escalated", [0, 14, 200])
def test_locating_a_gathered_group(benchmark: Any, escalated: int) -> None:
    """``locate_payloads`` of 1,000 members of 272 elements from 2 ranks, ``escalated`` of the 2,000 payloads at
    another action than allocated (the 1,000-tensor step of ``bench.suites.ddp_overhead`` escalates about 14 a
    step). ``us_per_payload``: the median call over the payloads."""
    menu = sb.DEFAULT_MENU
    rng = np.random.default_rng(0)
    sizes = np.full(TENSORS, 272)
    tables = kernels.GroupTables(menu, sizes, sb.policy.budget.BudgetPolicy(menu, sizes, 0.5, 0.7).cost_order)
    expected = rng.integers(0, len(menu), TENSORS)
    sent = np.repeat(expected[:, None], 2, axis=1)
    slots = rng.choice(sent.size, escalated, replace=False)
    sent.reshape(-1)[slots] = (sent.reshape(-1)[slots] + rng.integers(1, len(menu), escalated)) % len(menu)
    values = torch.randn(272, generator=torch.Generator().manual_seed(0))
    payloads = {a: kernels.quantize_pack_ef(None, values.clone(), menu[a], 1)[0] for a in np.unique(sent).tolist()}
    gathered = torch.cat([payloads[int(a)] for a in sent.T.reshape(-1)])
    rows = np.repeat(np.arange(TENSORS)[:, None], 2, axis=1)
    names = [f"p{k}" for k in range(TENSORS)]
    located = benchmark.pedantic(kernels.locate_payloads, args=(gathered, rows, expected, tables, names, "group"),
                                 rounds=20, iterations=1, warmup_rounds=1)
    assert np.array_equal(located[1], sent)
    benchmark.extra_info.update({"payloads": sent.size, "escalated": escalated,
                                 "us_per_payload": round(1e6 * benchmark.stats.stats.median / sent.size, 3)})


@pytest.mark.parametrize("numel", [1, 272])
def test_sending_a_group_of_thousand_tensors(benchmark: Any, numel: int) -> None:
    """``kernels.pack_group`` of one group of 1,000 members of ``numel`` elements: the NaN/Inf check, the screen of
    the default menu on every bucket and the packing at int4_nearest, one thread. With one element a member, the
    figure is the pass's fixed cost per member (``us_per_member``)."""
    torch.set_num_threads(1)
    menu = sb.DEFAULT_MENU
    sizes = np.full(TENSORS, numel)
    tables = kernels.GroupTables(menu, sizes, sb.policy.budget.BudgetPolicy(menu, sizes, 0.5, 0.7).cost_order)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(numel, generator=gen) for _ in range(TENSORS)]
    request = kernels.PackRequest(np.arange(TENSORS), grads, [torch.zeros(numel) for _ in grads],
                                [torch.empty(numel) for _ in grads], [None] * TENSORS,
                                np.arange(TENSORS, dtype=np.uint32), np.full(TENSORS, menu.names.index("int4_nearest")),
                                True, True, True, ScreenRule(0.5, 0.7))
    sent = benchmark.pedantic(kernels.pack_group, args=(request, tables), rounds=20, iterations=1, warmup_rounds=2)
    assert sent.finite.all() and len(sent.offsets) == TENSORS + 1
    benchmark.extra_info.update({"members": TENSORS, "numel": numel,
                                 "us_per_member": round(1e6 * benchmark.stats.stats.median / TENSORS, 3)})


def measure_step(benchmark: Any, numel: int | list[int], collective: str,
                 budget_bits: float = 4.4, ranks: int = 1) -> tuple[Any, int]:
    """Time the step of 1,000 tensors of ``numel`` elements (or of tensors of the sizes listed) on ``collective``
    (``ranks``: see :func:`make_step`); returns the compressor and the reads back of one step. ``host_ms``: the
    step's calls until they return, without waiting for the device at the end (the rest of ``step_ms`` is device
    work the host did not wait for inside the step)."""
    torch.set_num_threads(1)
    sizes = numel if isinstance(numel, list) else [numel] * TENSORS
    compressor, step, grads = make_step(sizes, collective, budget_bits, ranks)
    unsynchronized = getattr(step, "__wrapped__", step)
    for _ in range(3):
        step()                            # warm: index cache, residuals, samples
    with host.counting() as counted:
        step()
    reads = counted.traffic.reads
    benchmark.pedantic(step, rounds=5, iterations=1)
    seconds = benchmark.stats.stats.median
    host_seconds = []
    for _ in range(5):
        start = time.perf_counter()
        unsynchronized()
        host_seconds.append(time.perf_counter() - start)
        synchronized(lambda: None)()
    clone = median_seconds(synchronized(lambda: [g.clone() for g in grads]), 5)
    # What the step itself does beyond setting the gradients (a clone each, timed alongside).
    benchmark.extra_info.update({
        "tensors": len(sizes), "numel": sum(sizes), "device": DEVICE, "ranks": ranks,
        "step_ms": round(1e3 * seconds, 3), "host_ms": round(1e3 * statistics.median(host_seconds), 3),
        "us_per_tensor": round(1e6 * max(seconds - clone, 0.0) / len(sizes), 2),
        "step_vs_clone": round(seconds / clone, 3),
        "host_reads_per_step": reads, "launches_per_step": counted.traffic.launches,
        "pinned_uploads_per_step": counted.traffic.pinned_uploads,
        "pageable_uploads_per_step": counted.traffic.pageable_uploads,
    })
    record = compressor.last_step
    assert record is not None and len(record.actions) == len(sizes) and record.collective == collective
    return compressor, reads
