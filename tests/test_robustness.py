"""Bad gradients, bad configuration, and property tests over shapes, dtypes, magnitudes, budgets and menus."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safebits_hvd as sb


def one(n_or_shape, dtype=torch.float32, **kwargs):
    p = torch.nn.Parameter(torch.zeros(n_or_shape, dtype=dtype))
    return p, sb.SafeBits([("w", p)], **kwargs)


def send(c: sb.SafeBits, p: torch.nn.Parameter, g: torch.Tensor) -> torch.Tensor:
    p.grad = g
    sent, ctx = c.compress(g)
    out = c.decompress(sent.clone(), ctx)
    return out


# ----------------------------------------------------------------------------- non-finite gradients
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_raises_naming_parameter_and_step(bad: float) -> None:
    p, c = one(1000, nonfinite="raise")
    send(c, p, torch.randn(1000))
    residual = c.memory.residuals["w"].clone()
    g = torch.randn(1000)
    g[123] = bad
    p.grad = g
    with pytest.raises(sb.SafeBitsNonFiniteError, match=r"'w'.*step 1"):
        c.compress(g)
    assert torch.equal(c.memory.residuals["w"], residual)        # nothing reached the residual


def test_nonfinite_gradient_skip_sends_zeros_and_keeps_residual() -> None:
    p, c = one(1000, nonfinite="skip")
    send(c, p, torch.randn(1000))
    residual = c.memory.residuals["w"].clone()
    g = torch.full((1000,), float("nan"))
    out = send(c, p, g)
    assert torch.equal(out, torch.zeros(1000))
    assert torch.equal(c.memory.residuals["w"], residual)
    assert c.last_step.nonfinite == ["w"] and c.last_step.actions["w"] == "skipped"
    with pytest.warns(DeprecationWarning, match="nonfinite"):
        assert c.last_step.skipped == ["w"]
    out = send(c, p, torch.randn(1000))                          # and it carries on
    assert torch.isfinite(out).all() and c.last_step.nonfinite == []


@pytest.mark.parametrize("collective", ["dense", "allgather", "two_phase"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_propagates_by_default(collective: str, bad: float) -> None:
    """The default: the gradient goes out unquantized, so the reduced gradient holds the same NaN/Inf (what
    GradScaler looks for), the residual absorbs nothing, the record lists it, and the next step is normal."""
    p, c = one(5000, collective=collective)
    send(c, p, torch.randn(5000))
    residual = c.memory.residuals["w"].clone()
    g = torch.randn(5000)
    g[[7, 4321]] = bad
    out = send(c, p, g.clone())
    assert torch.equal(out.isnan(), g.isnan()) and torch.equal(out.isinf(), g.isinf())
    finite = torch.isfinite(g)
    assert torch.equal(out[finite], g[finite])                   # unquantized
    assert torch.equal(c.memory.residuals["w"], residual)
    assert c.last_step.nonfinite == ["w"] and c.last_step.actions["w"] == "fp32"
    out = send(c, p, torch.randn(5000))
    assert torch.isfinite(out).all() and c.last_step.nonfinite == []
    assert c.last_step.allocated["w"] == "fp32"                  # only lossless was known safe after it


def test_overflowing_sum_is_not_mistaken_for_nonfinite() -> None:
    p, c = one(100_000)
    out = send(c, p, torch.full((100_000,), 3e37))                # g.sum() overflows float32; values are fine
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------- odd tensors
def test_all_zero_gradient_takes_the_cheapest_action() -> None:
    p, c = one(5000, budget_bits=4.0)
    for _ in range(3):
        out = send(c, p, torch.zeros(5000))
        assert torch.equal(out, torch.zeros(5000))
    record = c.last_step
    assert record.distortion["w"] == 0.0 and record.cosine["w"] == 1.0
    cheapest = min(sb.DEFAULT_MENU, key=lambda a: a.cost(5000)).name
    assert record.actions["w"] == cheapest and not record.violation


def test_empty_and_one_element_tensors() -> None:
    empty = torch.nn.Parameter(torch.zeros(0))
    single = torch.nn.Parameter(torch.zeros(1))
    big = torch.nn.Parameter(torch.zeros(2000))
    c = sb.SafeBits([("empty", empty), ("single", single), ("big", big)], budget_bits=2.0)
    for _ in range(3):
        for p, g in ((empty, torch.zeros(0)), (single, torch.tensor([0.7])), (big, torch.randn(2000))):
            out = send(c, p, g)
            assert out.shape == g.shape and torch.isfinite(out).all()
    assert set(c.last_step.actions) == {"empty", "single", "big"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_gradients(dtype: torch.dtype) -> None:
    p, c = one((40, 50), dtype=dtype, budget_bits=8.0)
    for _ in range(3):
        g = torch.randn(40, 50).to(dtype)
        out = send(c, p, g)
        assert out.dtype == dtype and out.shape == (40, 50)
        assert torch.isfinite(out).all()
        cos = torch.nn.functional.cosine_similarity(out.double().flatten(), g.double().flatten(), dim=0)
        assert cos > 0.5


def test_non_contiguous_gradient() -> None:
    p, c = one((30, 20), budget_bits=32.0)
    g = torch.randn(20, 30).t()                                   # a transposed view
    assert not g.is_contiguous()
    out = send(c, p, g)
    assert torch.allclose(out, g)


def test_sparse_gradient_is_a_clear_error() -> None:
    p, c = one((10, 4))
    g = torch.zeros(10, 4)
    g[3] = 1.0
    g = g.to_sparse()
    p.grad = g
    with pytest.raises(TypeError, match="sparse_as_dense"):
        c.compress(g)


def test_sparse_as_dense_is_matched_to_its_parameter() -> None:
    p, c = one((10, 4), budget_bits=32.0)
    dense = torch.zeros(10, 4)
    dense[3] = 1.0
    p.grad = dense.to_sparse()
    sent, ctx = c.compress(p.grad.to_dense())                     # what Horovod's sparse_as_dense hands over
    assert torch.allclose(c.decompress(sent, ctx), dense)


@pytest.mark.parametrize("magnitude", [1e-30, 1e-38, 1e30, 1e37])
def test_extreme_magnitudes_do_not_overflow_or_underflow(magnitude: float) -> None:
    p, c = one(4096, budget_bits=2.0)
    for _ in range(3):
        g = torch.randn(4096) * magnitude
        residual = c.memory.residuals.get("w")
        v = g.double() + (residual.double() if residual is not None else 0.0)
        out = send(c, p, g)
        assert torch.isfinite(out).all()
        cos = float((out.double() * v).sum() / (out.double().norm() * v.norm()))
        assert cos >= c.min_cosine - 1e-6


# ----------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"budget_bits": 0}, "budget|bits"),
    ({"budget_bits": -1.0}, "bits"),
    ({"budget_bits": float("nan")}, "bits"),
    ({"budget_bits": "4"}, "budget_bits"),
    ({"max_distortion": 0.0}, r"max_distortion must be in \(0, 1\]"),
    ({"max_distortion": 1.5}, r"max_distortion must be in \(0, 1\]"),
    ({"max_distortion": float("nan")}, "max_distortion"),
    ({"min_cosine": -1.5}, r"min_cosine must be in \[-1, 1\]"),
    ({"min_cosine": 2}, r"min_cosine must be in \[-1, 1\]"),
    ({"menu": []}, "empty"),
    ({"menu": ["int4", "sign"]}, "lossless"),
    ({"nonfinite": "ignore"}, "nonfinite"),
    ({"sample_buckets": 0}, "sample_buckets"),
    ({"consistency_check_every": -1}, "consistency_check_every"),
])
def test_invalid_configuration_fails_at_construction(kwargs, message) -> None:
    p = torch.nn.Parameter(torch.zeros(10))
    with pytest.raises((ValueError, TypeError), match=message):
        sb.SafeBits([("w", p)], **kwargs)


def test_duplicate_parameter_names_and_empty_parameters() -> None:
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="duplicate parameter name 'w'"):
        sb.SafeBits([("w", a), ("w", b)])
    with pytest.raises(ValueError, match="requires_grad"):
        sb.SafeBits([])
    with pytest.raises(TypeError, match="named_parameters"):
        sb.SafeBits(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan"), float("inf"), None])
def test_schedule_returning_a_bad_value_is_reported_when_read(bad) -> None:
    p, c = one(100, budget_bits=lambda step: 4.0 if step == 0 else bad)
    send(c, p, torch.randn(100))
    p.grad = torch.randn(100)
    with pytest.raises(ValueError, match=r"returned .* at step 1"):
        c.compress(p.grad)


# ----------------------------------------------------------------------------- properties
MENUS = [sb.DEFAULT_MENU, sb.make_menu(["fp32", "int8", "int4"]), sb.make_menu(["fp32", "sign", "topk10"]),
         sb.make_menu(["fp32", "fp16", "ternary", "int2_nearest"], bucket_size=64)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       log_magnitude=st.integers(-30, 30), budget=st.floats(0.5, 33.0), menu=st.sampled_from(MENUS),
       max_distortion=st.floats(0.05, 1.0), min_cosine=st.floats(-1.0, 0.99), seed=st.integers(0, 2**31))
def test_properties(sizes, dtype, log_magnitude, budget, menu, max_distortion, min_cosine, seed) -> None:
    magnitude = 10.0 ** log_magnitude
    if dtype in (torch.float16,):
        magnitude = min(max(magnitude, 1e-3), 1e3)
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n, dtype=dtype))) for i, n in enumerate(sizes)]
    runs = []
    for _ in range(2):                                           # two objects, same seed: same outputs
        c = sb.SafeBits(params, budget_bits=budget, max_distortion=max_distortion, min_cosine=min_cosine,
                        menu=menu, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        sums = {name: torch.zeros(p.numel(), dtype=torch.float64) for name, p in params}
        sent_sums = {name: torch.zeros(p.numel(), dtype=torch.float64) for name, p in params}
        outputs = []
        for _step in range(3):
            for name, p in params:
                g = (torch.randn(p.shape, generator=gen) * magnitude).to(dtype)
                g32 = g.to(torch.float32).double()
                before = c.memory.residuals.get(name)
                v = g32 + (before.double() if before is not None else 0.0)
                p.grad = g
                sent, ctx = c.compress(g)
                q = sent.double()
                assert torch.isfinite(sent).all()                 # finite in, finite out
                if not torch.equal(q, v.float().double()) and float((v * v).sum()) > 0:
                    v2 = float((v * v).sum())
                    distortion = float(((q - v) ** 2).sum()) / v2
                    qn = math.sqrt(float((q * q).sum()))
                    cosine = float((q * v).sum()) / (qn * math.sqrt(v2)) if qn > 0 else 0.0
                    assert distortion <= max_distortion * (1 + 1e-5) + 1e-12
                    assert cosine >= min_cosine - 1e-5
                sums[name] += g32
                sent_sums[name] += q
                outputs.append(sent.clone())
                c.decompress(sent, ctx)
        for name, p in params:
            if p.numel():
                residual = c.memory.residuals.get(name, torch.zeros(1)).double()  # none after a pass-through
                scale = float(sums[name].abs().max()) + 1e-300
                assert float((sent_sums[name] + residual - sums[name]).abs().max()) <= 1e-5 * scale
        runs.append(outputs)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.integers(2, 6))
def test_allocator_property_vs_oracle(seed: int, tensors: int, actions: int) -> None:
    from safebits_hvd.policy.allocator import allocate, allocate_exact, greedy_error_bound

    rng = np.random.default_rng(seed)
    costs = rng.integers(1, 100, size=(tensors, actions))
    costs[:, 0] = 200
    errors = rng.random((tensors, actions)) * 10
    errors[:, 0] = 0
    ok = rng.random((tensors, actions)) < 0.6
    ok[:, 0] = True
    budget = float(rng.integers(0, 200 * tensors + 1))
    greedy, exact = allocate(costs, errors, ok, budget), allocate_exact(costs, errors, ok, budget)
    assert greedy.feasible == exact.feasible
    if greedy.feasible:
        assert greedy.cost_bits <= budget
        assert greedy.squared_error <= exact.squared_error + greedy_error_bound(costs, errors, ok) + 1e-9


_EDGES = st.sampled_from([0.0, 1.0, 2.5, 1e-300, 1e300, 1e308, 5e-324, math.inf, math.nan, -1.0])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(_EDGES, st.floats(allow_nan=True, allow_infinity=True)), min_size=4, max_size=4))
def test_scalar_screen_statistics_equal_the_vector_ones(stats: list[float]) -> None:
    """The send path's one-action ``distortion_cosine_of`` gives bitwise the vectorised figures (zero, overflow,
    NaN and infinite sums included), so the screen's verdict does not depend on which one ran."""
    from safebits_hvd.policy.screen import distortion_cosine, distortion_cosine_of

    with np.errstate(all="ignore"):
        vector = distortion_cosine(np.array(stats))
    scalar = distortion_cosine_of(stats)
    for a, b in zip((float(vector[0]), float(vector[1])), scalar, strict=True):
        assert a == b or (math.isnan(a) and math.isnan(b)), (stats, vector, scalar)
