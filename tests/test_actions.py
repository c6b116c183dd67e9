"""The action menu and its modeled-cost formulas."""

import itertools
import math

import pytest
import torch

import safebits_hvd as sb
from safebits_hvd.codec import kernels as K
from safebits_hvd.codec import rng
from safebits_hvd.codec.actions import (
    ACTIONS,
    LLOYD_MAX_LEVELS,
    TRIT_BITS,
    Action,
    ActionKind,
    lloyd_max,
    lloyd_max_levels,
    lloyd_max_thresholds,
    qsgd,
    quant_code_bits,
    scaled_sign,
    ternary,
    topk,
)


def pad8(bits: int) -> int:
    """Bits rounded up to whole bytes: every section of a payload body ends on a byte boundary."""
    return 8 * math.ceil(bits / 8)


@pytest.mark.parametrize("n", [0, 1, 3, 5, 7, 511, 512, 513, 100_000, 100_001])
def test_cost_formulas(n: int) -> None:
    buckets = math.ceil(n / 512)
    assert ACTIONS["fp32"].cost(n) == 32 * n
    assert ACTIONS["fp16"].cost(n) == 16 * n
    assert ACTIONS["bf16"].cost(n) == 16 * n
    assert ACTIONS["int8"].cost(n) == 8 * n + 32 * buckets
    assert ACTIONS["int4"].cost(n) == pad8(4 * n) + 32 * buckets
    assert ACTIONS["int2"].cost(n) == pad8(2 * n) + 32 * buckets
    assert ACTIONS["ternary"].cost(n) == 8 * math.ceil(n / 5) + 32 * buckets      # 5 trits per byte
    assert ACTIONS["sign"].cost(n) == pad8(n) + 32 * buckets
    assert ACTIONS["ternary_mse"].cost(n) == 8 * math.ceil(n / 5) + 32 * buckets  # Lloyd-Max: 5 trits per byte
    assert ACTIONS["int2_mse"].cost(n) == pad8(2 * n) + 32 * buckets
    assert ACTIONS["int3_mse"].cost(n) == pad8(3 * n) + 32 * buckets
    assert ACTIONS["int4_mse"].cost(n) == pad8(4 * n) + 32 * buckets
    # top-k 10%: 51 per full bucket, min(51, rest) in the last; a bf16 value each, then 9-bit indices.
    full, rest = divmod(n, 512)
    kept10, kept1 = 51 * full + min(51, rest), 5 * full + min(5, rest)
    assert ACTIONS["topk10"].cost(n) == 16 * kept10 + pad8(9 * kept10)
    assert ACTIONS["topk1"].cost(n) == 16 * kept1 + pad8(9 * kept1)
    for action in ACTIONS.values():
        assert action.cost(n) % 8 == 0, action.name


def test_bucket_size_changes_scale_overhead() -> None:
    assert qsgd(4, bucket_size=128).cost(1024) == 4 * 1024 + 32 * 8
    assert scaled_sign(bucket_size=64).cost(100) == pad8(100) + 32 * 2
    assert ternary(bucket_size=1024).cost(2048) == 8 * math.ceil(2048 / 5) + 64
    assert topk(0.5, bucket_size=16).cost(40) == 16 * (8 + 8 + 8) + pad8(4 * (8 + 8 + 8))


def test_quant_code_bits_follow_levels() -> None:
    assert [quant_code_bits(levels) for levels in (1, 3, 7, 127, 32767)] == [2, 3, 4, 8, 16]
    assert ternary().packs_trits and ternary().code_bits == TRIT_BITS
    assert not qsgd(2).packs_trits and qsgd(2).code_bits == 2
    with pytest.raises(ValueError, match="code_bits"):
        Action("int4_wrong", ActionKind.QUANT, 5, levels=7)
    with pytest.raises(ValueError, match="code_bits"):
        Action("trits_wrong", ActionKind.QUANT, TRIT_BITS, levels=3)


def test_qsgd_levels_and_names() -> None:
    assert qsgd(8).levels == 127 and qsgd(4).levels == 7 and qsgd(2).levels == 1
    assert qsgd(4, stochastic=False).name == "int4_nearest"
    assert ACTIONS["int4"].kind == ActionKind.QUANT and ACTIONS["int4"].stochastic


def test_default_menu_covers_the_field() -> None:
    """The field's actions are all built in; the default menu keeps every kind of them (QSGD's stochastic codes
    are dominated by the MSE-optimal and nearest ones: test_default_menu_is_a_ladder_without_gaps)."""
    for wanted in ["fp32", "fp16", "bf16", "int8", "int4", "int2", "ternary", "sign", "topk10"]:
        assert wanted in ACTIONS
    kinds = {a.kind for a in sb.DEFAULT_MENU}
    assert kinds == set(ActionKind) - {ActionKind.FLOAT16, ActionKind.BFLOAT16}    # dominated by int14_nearest
    assert sb.DEFAULT_MENU[sb.DEFAULT_MENU.lossless_index].name == "fp32"


def _distortion(action: Action, v: torch.Tensor) -> float:
    stats = K.quantize_ef(None, v.clone(), torch.empty_like(v), action, rng.stream_key(5, 0, 0)).tolist()
    return stats[0] / stats[3]


@pytest.mark.parametrize("data", ["gaussian", "laplace", "student_t3"])
def test_default_menu_is_a_ladder_without_gaps(data: str) -> None:
    """Between 1 and 16 bits per element, the admissible quantizers of the default menu (distortion <= 0.5) leave
    no neighbouring costs more than 1.6x apart, and none is dominated: no cheaper one has less distortion."""
    n = 1 << 16
    with torch.random.fork_rng():       # the distributions sample from the global generator: seed it here
        torch.manual_seed(3)
        v = {"gaussian": lambda: torch.randn(n),
             "laplace": lambda: torch.distributions.Laplace(0.0, 1.0).sample((n,)),
             "student_t3": lambda: torch.distributions.StudentT(3.0).sample((n,))}[data]()
    rows = sorted((a.cost(n) / n, _distortion(a, v), a.name) for a in sb.DEFAULT_MENU if a.kind != ActionKind.TOPK)
    admissible = [r for r in rows if r[1] <= 0.5 and 1.0 <= r[0] <= 16.0]
    costs = sorted({round(bits, 6) for bits, _, _ in admissible})
    assert costs[0] <= 2.1 and costs[-1] >= 14
    gaps = [b / a for a, b in itertools.pairwise(costs)]
    assert max(gaps) <= 1.6, list(zip(costs, gaps, strict=False))
    for bits, distortion, name in admissible:
        cheaper = [(b, d, m) for b, d, m in admissible if b < bits - 1e-9 and d <= distortion]
        assert not cheaper, f"{name} ({bits:.2f} bits, distortion {distortion:.2e}) is dominated by {cheaper}"


def test_make_menu_validates() -> None:
    with pytest.raises(ValueError, match="empty"):
        sb.make_menu([])
    with pytest.raises(ValueError, match="lossless"):
        sb.make_menu(["int4", "sign"])
    with pytest.raises(ValueError, match="unknown action"):
        sb.make_menu(["fp32", "int5"])
    with pytest.raises(ValueError, match="duplicate"):
        sb.make_menu(["fp32", "fp32"])
    with pytest.raises(ValueError, match="bucket_size"):
        sb.make_menu([sb.FP32, qsgd(4, bucket_size=128), qsgd(8, bucket_size=256)])
    with pytest.raises(TypeError):
        sb.make_menu("fp32")
    menu = sb.make_menu(["fp32", "int4"], bucket_size=256)
    assert menu.bucket_size == 256 and menu[1].cost(512) == 4 * 512 + 64


def test_action_validation() -> None:
    with pytest.raises(ValueError, match="topk_fraction"):
        topk(0.0)
    with pytest.raises(ValueError, match="bits"):
        qsgd(1)
    with pytest.raises(ValueError, match="bucket_size"):
        qsgd(4, bucket_size=1)
    with pytest.raises(ValueError):
        ACTIONS["fp32"].cost(-1)


def test_lloyd_max_actions() -> None:
    assert [lloyd_max(m).name for m in (3, 4, 8, 16)] == ["ternary_mse", "int2_mse", "int3_mse", "int4_mse"]
    assert lloyd_max(3).packs_trits and lloyd_max(3).code_bits == TRIT_BITS
    assert not lloyd_max(4).packs_trits and [lloyd_max(m).code_bits for m in (4, 8, 16)] == [2, 3, 4]
    assert all(not lloyd_max(m).stochastic and lloyd_max(m).kind == ActionKind.LLOYD_MAX for m in LLOYD_MAX_LEVELS)
    # nearest rounding: the thresholds are the midpoints of ascending magnitudes (one 0 level for 3 levels)
    for m in LLOYD_MAX_LEVELS:
        mags, cuts = lloyd_max_levels(m), lloyd_max_thresholds(m)
        assert len(mags) == (m + 1) // 2 and len(cuts) == len(mags) - 1 and list(mags) == sorted(mags)
        assert all(a < t < b for a, b, t in zip(mags, mags[1:], cuts, strict=False))
    assert lloyd_max_thresholds(4) == pytest.approx((0.9816,)) and lloyd_max_thresholds(3) == pytest.approx((0.612,))
    with pytest.raises(ValueError, match="levels must be one of"):
        lloyd_max(5)
    with pytest.raises(ValueError, match="levels must be one of"):
        Action("lm5", ActionKind.LLOYD_MAX, 3, levels=5)
    with pytest.raises(ValueError, match="code_bits"):
        Action("lm8_wrong", ActionKind.LLOYD_MAX, 4, levels=8)
    with pytest.raises(ValueError, match="stochastic"):
        Action("lm4_stochastic", ActionKind.LLOYD_MAX, 2, levels=4, stochastic=True)
