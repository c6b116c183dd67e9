"""The C CPU kernels against the PyTorch reference: bit-identical ``out``/``e``, statistics to ~1e-12."""

from __future__ import annotations

import pytest
import torch

from safebits_hvd.codec import actions as A
from safebits_hvd.codec import kernels as K
from safebits_hvd.codec import rng
from safebits_hvd.codec.kernels import cpu
from safebits_hvd.codec.kernels import reference as R

from .kernel_cases import bits, make

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the CPU kernels")

LLOYD_MAX = [A.lloyd_max(m) for m in sorted(A.LLOYD_MAX_LEVELS)]
ACTIONS = list(A.ACTIONS.values())   # every built-in action (the default menu is a subset)
SIZES = [1, 7, 511, 512, 513, 5000, 100_003]
KEY = rng.stream_key(7, 3, 11)


def assert_stats_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-300, equal_nan=True), (a, b)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: a.name)
@pytest.mark.parametrize("with_g", [True, False])
def test_quantize_ef_matches_reference(n, action, with_g):
    g, e = make(n)
    if not with_g:
        e = g + e
        g = None
    e1, e2 = e.clone(), e.clone()
    o1, o2 = torch.full((n,), 7.0), torch.full((n,), 7.0)
    s1 = K.quantize_ef(g, e1, o1, action, KEY)
    s2 = R.quantize_ef(g, e2, o2, action, KEY)
    assert torch.equal(bits(o1), bits(o2))
    assert torch.equal(bits(e1), bits(e2))
    assert s1.dtype == torch.float64 and s1.shape == (4,)
    assert_stats_close(s1, s2)


@pytest.mark.parametrize("n", SIZES)
def test_screen_matches_reference(n):
    g, e = make(n, seed=1)
    menu = A.make_menu(list(A.ACTIONS))                               # every built-in action
    nb = -(-n // menu.bucket_size)
    for buckets in (None, torch.arange(0, nb, 3), torch.tensor([nb - 1])):
        e0 = e.clone()
        s1 = K.screen(g, e, menu, KEY, buckets)
        assert torch.equal(bits(e), bits(e0))                       # the screen writes nothing
        s2 = R.screen(g, e, menu, KEY, buckets)
        assert s1.shape == (len(menu), 4)
        assert_stats_close(s1, s2)


def test_screen_all_buckets_equals_quantize_ef_stats():
    g, e = make(5000, seed=2)
    s = K.screen(g, e, A.DEFAULT_MENU, KEY)
    for i, a in enumerate(A.DEFAULT_MENU):
        st = K.quantize_ef(g, e.clone(), torch.empty(5000), a, KEY)
        assert_stats_close(s[i], st)


def test_rng_matches_reference():
    # stochastic int2 on constant 0.5*scale values: c = floor(0.5 + u) reveals u >= 0.5 element by element
    n = 4096
    v = torch.full((n,), 0.5)
    v[::512] = 1.0
    out = torch.empty(n)
    K.quantize_ef(None, v.clone(), out, A.ternary(), KEY)
    u = rng.uniform(KEY, torch.arange(n))
    expect = torch.where(u >= 0.5, 1.0, 0.0)
    expect[::512] = 1.0
    assert torch.equal(out, expect)


def test_deterministic_across_threads():
    g, e = make(100_003, seed=3)
    old = torch.get_num_threads()
    res = []
    try:
        for th in (1, 2):
            torch.set_num_threads(th)
            e1, o = e.clone(), torch.empty_like(e)
            st = K.quantize_ef(g, e1, o, A.ACTIONS["int4"], KEY)
            res.append((st, o, K.screen(g, e, A.DEFAULT_MENU, KEY)))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
    assert torch.equal(res[0][2], res[1][2])


def test_fp16_bf16_bit_exact_on_special_values():
    specials = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 6e-8, 2.98e-8, 2.99e-8, 1e-45,
                             6.1e-5, 6.103515625e-05, 3.4e38, -3.4e38, float("inf"), float("-inf"),
                             1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-8, 1.0 + 3 * 2**-8])
    n = specials.numel()
    for action, cast in ((A.FP16, torch.float16), (A.BF16, torch.bfloat16)):
        out = torch.empty(n)
        K.quantize_ef(None, specials.clone(), out, action, KEY)
        assert torch.equal(bits(out), bits(specials.to(cast).float())), action.name


def test_nonfinite_gives_nonfinite_stats():
    g = torch.randn(1000)
    g[3] = float("nan")
    for a in A.DEFAULT_MENU:
        s = K.quantize_ef(g, torch.zeros(1000), torch.empty(1000), a, KEY)
        assert not torch.isfinite(s).all(), a.name


def test_empty_and_validation():
    e = torch.zeros(0)
    assert torch.equal(K.quantize_ef(None, e, torch.zeros(0), A.FP32, 0), torch.zeros(4, dtype=torch.float64))
    assert torch.equal(K.screen(None, e, A.DEFAULT_MENU, 0), torch.zeros(len(A.DEFAULT_MENU), 4,
                                                                         dtype=torch.float64))
    with pytest.raises(TypeError):
        K.quantize_ef(None, torch.zeros(4, dtype=torch.float64), torch.zeros(4), A.FP32, 0)
    with pytest.raises(ValueError):
        K.quantize_ef(None, torch.zeros(4), torch.zeros(5), A.FP32, 0)
    with pytest.raises(ValueError):
        K.quantize_ef(torch.zeros(3), torch.zeros(4), torch.zeros(4), A.FP32, 0)
    with pytest.raises(ValueError):
        K.quantize_ef(None, torch.zeros(4, 2)[:, 0], torch.zeros(4), A.FP32, 0)
    with pytest.raises(ValueError):
        K.screen(None, torch.zeros(1024), A.DEFAULT_MENU, 0, torch.tensor([2]))
    with pytest.raises(TypeError):
        K.screen(None, torch.zeros(1024), A.DEFAULT_MENU, 0, torch.tensor([0], dtype=torch.int32))


def test_cache_file_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("SAFEBITS_CACHE", str(tmp_path))
    p1 = cpu.build()
    mtime = p1.stat().st_mtime_ns
    assert cpu.build() == p1 and p1.stat().st_mtime_ns == mtime
    assert p1.parent == tmp_path / "kernels" and p1.suffix == ".so"
    assert [p.name for p in p1.parent.iterdir()] == [p1.name]       # no leftover temporary files


def _tie_heavy(n: int, seed: int) -> torch.Tensor:
    """Magnitudes from a few values (many exact ties, -0.0, signs), sometimes with a huge, tiny, inf or NaN key."""
    gen = torch.Generator().manual_seed(seed)
    levels = torch.tensor([0.0, 2.0**-140, 1e-30, 0.5, 1.0, 1.0 + 2**-23, 3.0, 1e30])
    pick = torch.randint(0, int(torch.randint(1, levels.numel() + 1, (1,), generator=gen)), (n,), generator=gen)
    x = levels[pick] * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    specials = torch.tensor([float("inf"), float("nan"), -float("inf"), 3.4e38])
    m = int(torch.randint(0, 3, (1,), generator=gen))
    x[torch.randint(0, n, (m,), generator=gen)] = specials[torch.randint(0, 4, (m,), generator=gen)]
    return x


def _same_bits_any_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that NaN payloads are not compared (torch's bfloat16() of a NaN gives 0xffff, the
    kernels' sb_bf16_rne +quiet NaN 0x7fc0, before and after this select; NaNs here test the order of keys)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(bits(a)[~nan], bits(b)[~nan])


@pytest.mark.parametrize("bucket", [6, 512, 5000])
def test_topk_selection_ties_match_reference(bucket):
    """The top-k select (cpu.c sb_select_kth_largest and the tie cut) against the reference's stable sort: keys
    with many exact ties at the k-th place, k from 1 to the bucket size, across many random buckets."""
    nb = 40 if bucket < 5000 else 6
    for seed in range(12):
        x = _tie_heavy(nb * bucket - seed % 3, seed)
        for frac in (1 / bucket, 0.01, 0.1, 0.5, (bucket - 1) / bucket, 1.0):
            action = A.topk(frac, bucket_size=bucket)
            o1, o2 = torch.empty_like(x), torch.empty_like(x)
            e1, e2 = x.clone(), x.clone()
            K.quantize_ef(None, e1, o1, action, KEY)
            R.quantize_ef(None, e2, o2, action, KEY)
            assert _same_bits_any_nan(o1, o2), (seed, frac)
            assert _same_bits_any_nan(e1, e2), (seed, frac)
            payload, _ = K.quantize_pack_ef(None, x.clone(), action, KEY)
            assert torch.equal(bits(K.decode(payload)), bits(o1)), (seed, frac)


def test_topk_selection_random_keys_match_reference():
    """Distinct keys over many decades (the early exits of the search) and a 65536-element bucket (the 16-bit
    counts in chunks), against the reference."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1 << 17, generator=gen) * torch.logspace(-20, 20, 1 << 17)[torch.randperm(1 << 17, generator=gen)]
    for action in (A.topk(0.1), A.topk(0.01), A.topk(0.001, bucket_size=65536), A.topk(0.7, bucket_size=65536)):
        o1, o2 = torch.empty_like(x), torch.empty_like(x)
        K.quantize_ef(None, x.clone(), o1, action, KEY)
        R.quantize_ef(None, x.clone(), o2, action, KEY)
        assert torch.equal(bits(o1), bits(o2)), action.name


def _lloyd_max_grid(action: A.Action) -> torch.Tensor:
    """Every level of the codebook in units of the scale, ascending (0 once)."""
    mags = torch.tensor(A.lloyd_max_levels(action.levels), dtype=torch.float64)
    return torch.cat([-mags.flip(0), mags]).unique()


@pytest.mark.parametrize("action", LLOYD_MAX, ids=lambda a: a.name)
def test_lloyd_max_rounds_to_the_nearest_level_at_the_best_scale(action):
    """Each bucket's scale (read from the payload) is the candidate multiple of its RMS with the least squared error,
    every element goes to the nearest of +-level * scale, and the Gaussian distortion is the Lloyd-Max quantizer's."""
    bucket = action.bucket_size
    gen = torch.Generator().manual_seed(8)
    v = torch.randn(64 * bucket, generator=gen)
    v[-bucket:] = torch.distributions.StudentT(1.5).sample((bucket,))        # a heavy-tailed bucket
    out = torch.empty_like(v)
    stats = K.quantize_ef(None, v.clone(), out, action, KEY)
    payload, _ = K.quantize_pack_ef(None, v.clone(), action, KEY)
    scale = payload[16:16 + 4 * 64].view(torch.float32).double()[:, None]
    vb = v.double().view(-1, bucket)
    rms = vb.pow(2).mean(dim=1, keepdim=True).sqrt()
    grid = _lloyd_max_grid(action)

    def err_at(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = grid[(vb / s)[..., None].sub(grid).abs().argmin(dim=-1)] * s
        return q, (q - vb).pow(2).sum(dim=1, keepdim=True)

    candidates = torch.cat([rms * f for f in A.LLOYD_MAX_SCALE_FACTORS], dim=1)
    chosen = (candidates - scale).abs().argmin(dim=1, keepdim=True)
    assert torch.allclose(candidates.gather(1, chosen), scale, rtol=1e-6, atol=0)
    errors = torch.cat([err_at(candidates[:, f:f + 1])[1] for f in range(candidates.shape[1])], dim=1)
    assert torch.all(errors.gather(1, chosen) <= errors.min(dim=1, keepdim=True).values * (1 + 1e-6))
    nearest, _ = err_at(scale)
    assert torch.allclose(out.double().view(-1, bucket), nearest, rtol=1e-6, atol=0)
    if action.levels in (3, 16):            # the heavy-tailed bucket needs a larger scale than its RMS
        assert int(chosen[-1]) > 0
    gaussian = float(stats[0] - (out[-bucket:].double() - v[-bucket:].double()).pow(2).sum()) / float(
        v[:-bucket].double().pow(2).sum())
    expected = {3: 0.1902, 4: 0.1175, 8: 0.03454, 16: 0.009497, 32: 0.002505, 64: 0.0006442}[action.levels]  # Lloyd-Max
    assert abs(gaussian - expected) < 0.1 * expected


def test_lloyd_max_zero_and_subnormal_buckets():
    """A zero bucket sends +0.0 (-0.0 keeps its sign on the codebooks without a 0 level); a bucket whose RMS
    underflows to 0 sends zeros and keeps everything in the residual. Decoding gives the same bits."""
    v = torch.tensor([0.0, -0.0, 0.0, 0.0, 1e-45, 0.0, 0.0, 0.0])
    for action in (A.lloyd_max(3, bucket_size=4), A.lloyd_max(4, bucket_size=4)):
        e, out = v.clone(), torch.empty(8)
        K.quantize_ef(None, e, out, action, KEY)
        assert not out.abs().any(), action.name
        assert torch.equal(bits(e[4:]), bits(v[4:])), action.name
        assert bool(torch.signbit(out[1])) == (action.levels == 4), action.name
        payload, _ = K.quantize_pack_ef(None, v.clone(), action, KEY)
        assert torch.equal(bits(K.decode(payload)), bits(out)), action.name
