"""Modeled bytes per step for the parameter shapes of ResNet-18, ResNet-50 and GPT-2 small (``model_shapes``).

For every compressor of :data:`safebits_hvd.frontends.baselines.REGISTRY` (SafeBits and unscreened global budgeting at
2.0, 4.4 and 8.0 bits per parameter), one benchmark call is one real step: ``compress`` of every gradient of
the model (synthetic Gaussian gradients scaled 1/sqrt(fan-in), a fixed seed), after one warm-up step so that
SafeBits allocates from statistics. ``extra_info``: modeled bytes per step (one rank's upload), compression ratio
(32 bits / modeled bits per parameter), and the step time over ``torch.clone`` of all gradients
(``step_vs_clone``). ResNet-18 is in the smoke run; ResNet-50 and GPT-2 small are ``full``.
"""

from __future__ import annotations

import math

import pytest
import torch

from bench.suites.model_shapes import MODELS, PARAMETER_COUNTS, numel
from bench.suites.timing import measured_min, min_seconds
from safebits_hvd.frontends.baselines import BUDGETED, REGISTRY, make_compressor
from safebits_hvd.frontends.baselines import label as compressor_label

BUDGETS = [2.0, 4.4, 8.0]
CASES = [(c, None) for c in REGISTRY if c not in BUDGETED] + [(c, b) for c in sorted(BUDGETED) for b in BUDGETS]

_PARAMS: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}


def _parameters(model: str) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters of ``model``'s shapes with deterministic synthetic gradients (cached per model)."""
    if model not in _PARAMS:
        gen = torch.Generator().manual_seed(0)
        pairs = []
        for name, shape in MODELS[model]():
            p = torch.nn.Parameter(torch.empty(shape), requires_grad=True)
            fan_in = numel(shape[1:]) if len(shape) > 1 else shape[0]
            p.grad = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
            pairs.append((name, p))
        _PARAMS[model] = pairs
    return _PARAMS[model]


def _cases():
    for model in MODELS:
        for compressor, budget in CASES:
            slow = model != "resnet18"
            label = compressor_label(compressor, budget)
            yield pytest.param(model, compressor, budget, marks=[pytest.mark.full] if slow else [],
                               id=f"{model}-{label}")


@pytest.mark.parametrize("model,compressor,budget", list(_cases()))
def test_modeled_bytes_per_step(benchmark, model: str, compressor: str, budget: float | None) -> None:
    pairs = _parameters(model)
    total = sum(p.numel() for _, p in pairs)
    assert total == PARAMETER_COUNTS[model]
    comp = make_compressor(compressor, pairs, seed=0, budget_bits=budget,
                           **({"name": f"bench.{model}.{compressor}.{budget}"} if budget is not None else {}))
    grads = [p.grad for _, p in pairs]

    def one_step() -> None:
        for g in reversed(grads):        # backward order
            wire, ctx = comp.compress(g)
            comp.decompress(wire, ctx)

    one_step()                            # warm-up: SafeBits' step 0 uses its start policy
    step_s = measured_min(benchmark, one_step, repeats=2)
    clone_s = min_seconds(lambda: [torch.clone(g) for g in grads], repeats=3)
    record = comp.last_step
    benchmark.extra_info.update({
        "model": model, "compressor": compressor, "budget_bits": budget, "parameters": total,
        "tensors": len(pairs), "modeled_bytes": record.modeled_bits_total / 8,
        "fp32_bytes": 4 * total, "compression_ratio": record.modeled_compression_ratio,
        "bits_per_parameter": record.modeled_bits_total / total, "violation": bool(record.violation),
        "escalations": len(record.escalations), "step_vs_clone": step_s / clone_s,
    })
    if budget is not None and not record.violation:
        assert record.modeled_bits_total <= budget * total
