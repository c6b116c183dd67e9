"""Baseline compressors: modeled bits, error feedback, parameter matching, Horovod's FP16 semantics."""

from __future__ import annotations

import math

import pytest
import torch

import safebits_hvd as sb
from safebits_hvd.codec.actions import FP16, FP32, qsgd, scaled_sign, ternary, topk
from safebits_hvd.frontends.baselines import (
    BUDGETED,
    MAX_SCALED_MENU,
    QUANTIZER_MENU,
    REGISTRY,
    FixedActionCompressor,
    make_compressor,
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))


def _backward(model: torch.nn.Module, seed: int = 1) -> None:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    model(torch.randn(8, 40)).square().sum().backward()


def _one_step(comp, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    sent = {}
    for name, p in model.named_parameters():
        wire, ctx = comp.compress(p.grad)
        sent[name] = comp.decompress(wire, ctx)
    return sent


@pytest.mark.parametrize("name,action", [
    ("fp32", FP32), ("fp16", FP16), ("qsgd8", qsgd(8)), ("qsgd4", qsgd(4)), ("qsgd2", qsgd(2)),
    ("terngrad", ternary()), ("signsgd_ef", scaled_sign()), ("topk10_ef", topk(0.1)),
    ("topk1_ef", topk(0.01)),
])
def test_modeled_bits_match_action_cost(name: str, action: sb.Action) -> None:
    model = _model()
    comp = make_compressor(name, model.named_parameters(), seed=3)
    _backward(model)
    sent = _one_step(comp, model)
    expected = sum(action.cost(p.numel()) for p in model.parameters())
    rec = comp.last_step
    assert rec is not None and rec.step == 0 and comp.step == 1
    assert rec.modeled_bits_total == expected == comp.bits_per_step
    n = sum(p.numel() for p in model.parameters())
    assert rec.modeled_compression_ratio == pytest.approx(32 * n / expected)
    assert rec.violation is False and rec.escalations == []
    for name_p, p in model.named_parameters():
        assert sent[name_p].shape == p.grad.shape and sent[name_p].dtype == p.grad.dtype
        assert rec.actions[name_p] == action.name


def test_fp32_is_identity_and_fp16_is_horovods() -> None:
    from horovod.torch.compression import Compression

    model = _model()
    _backward(model)
    fp32 = make_compressor("fp32", model.named_parameters())
    fp16 = make_compressor("fp16", model.named_parameters())
    for p in model.parameters():
        wire, ctx = fp32.compress(p.grad)
        assert torch.equal(fp32.decompress(wire, ctx), p.grad)
        wire, ctx = fp16.compress(p.grad)
        assert wire.dtype == torch.float16
        ref_wire, ref_ctx = Compression.fp16.compress(p.grad)
        assert torch.equal(fp16.decompress(wire, ctx), Compression.fp16.decompress(ref_wire, ref_ctx))


def test_no_ef_baseline_is_memoryless_and_matches_kernel() -> None:
    model = _model()
    comp = make_compressor("qsgd4", model.named_parameters(), seed=5)
    _backward(model)
    sent = _one_step(comp, model)
    assert comp.memory.residuals == {}
    from safebits_hvd.codec import kernels
    from safebits_hvd.codec.rng import stream_key

    for i, (name, p) in enumerate(model.named_parameters()):
        g = p.grad.reshape(-1).contiguous()
        out = torch.empty_like(g)
        kernels.quantize_ef(g, torch.zeros_like(g), out, qsgd(4), stream_key(5, 0, i))
        assert torch.equal(out.view_as(p.grad), sent[name])


def test_error_feedback_conserves_the_sum() -> None:
    """With EF, sum of what was sent plus the final residual equals the sum of the gradients."""
    model = _model()
    comp = make_compressor("topk1_ef", model.named_parameters())
    total_g = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    total_sent = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for step in range(4):
        _backward(model, seed=10 + step)
        for n, p in model.named_parameters():
            total_g[n] += p.grad
        for n, s in _one_step(comp, model).items():
            total_sent[n] += s
    assert comp.step == 4 and len(comp.history) == 4
    for n, p in model.named_parameters():
        residual = comp.memory.residuals[n].view_as(p)
        assert torch.allclose(total_sent[n] + residual, total_g[n], atol=1e-5)
        assert not torch.equal(total_sent[n], total_g[n])   # top-1% really dropped something


def test_grad_matched_by_identity_not_order() -> None:
    model = _model()
    comp = make_compressor("signsgd_ef", model.named_parameters())
    _backward(model)
    params = list(model.named_parameters())
    for _, p in reversed(params):              # backward order
        comp.compress(p.grad)
    assert comp.step == 1
    with pytest.raises(ValueError, match=r"not the \.grad"):
        comp.compress(params[0][1].grad.clone())


def test_registry_budgeted_entries_are_safebits() -> None:
    model = _model()
    assert {"safebits", "unscreened", "safebits_maxscaled", "unscreened_maxscaled", "safebits_quantizers",
            "unscreened_quantizers"} == BUDGETED
    unscreened = make_compressor("unscreened", model.named_parameters(), budget_bits=2.0)
    assert isinstance(unscreened, sb.SafeBits) and unscreened.screen_enabled is False
    assert QUANTIZER_MENU.names == [*MAX_SCALED_MENU.names, "sign"]
    for name, screened, menu in (("safebits_maxscaled", True, MAX_SCALED_MENU),
                                 ("unscreened_maxscaled", False, MAX_SCALED_MENU),
                                 ("safebits_quantizers", True, QUANTIZER_MENU),
                                 ("unscreened_quantizers", False, QUANTIZER_MENU)):
        comp = make_compressor(name, model.named_parameters(), budget_bits=2.0)
        assert comp.screen_enabled is screened and comp.menu == menu
        with pytest.raises(ValueError, match="fixes the menu"):
            make_compressor(name, model.named_parameters(), budget_bits=2.0, menu=["fp32", "int4"])
    assert make_compressor("safebits", model.named_parameters(), budget_bits=4.4).screen_enabled is True
    with pytest.raises(ValueError):
        make_compressor("safebits", model.named_parameters())
    with pytest.raises(ValueError):
        make_compressor("qsgd4", model.named_parameters(), budget_bits=4.0)
    with pytest.raises(ValueError, match="unknown compressor"):
        make_compressor("nope", model.named_parameters())
    from horovod.torch.compression import Compressor

    for name in set(REGISTRY) - BUDGETED:
        assert isinstance(make_compressor(name, model.named_parameters()), Compressor)


def test_state_dict_round_trip() -> None:
    model = _model()
    comp = FixedActionCompressor(model.named_parameters(), scaled_sign(), error_feedback=True, seed=1)
    _backward(model)
    _one_step(comp, model)
    other = FixedActionCompressor(model.named_parameters(), scaled_sign(), error_feedback=True, seed=1)
    other.load_state_dict(comp.state_dict())
    _backward(model, seed=2)
    a, b = _one_step(comp, model), _one_step(other, model)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert math.isclose(comp.bits_per_element, other.bits_per_element)
