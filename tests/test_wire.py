"""The packed wire format: payload sizes equal the modeled cost, payloads decode bitwise to what ``quantize_ef``
sends, the C backend equals the PyTorch reference byte for byte, and invalid payloads are refused by name."""

from __future__ import annotations

import struct

import pytest
import torch

from safebits_hvd.codec import actions as A
from safebits_hvd.codec import kernels as K
from safebits_hvd.codec import rng, wire
from safebits_hvd.codec.kernels import cpu
from safebits_hvd.codec.kernels import reference as R
from safebits_hvd.codec.wire import WireFormatError

from .kernel_cases import bits, make

KEY = rng.stream_key(3, 17, 5)
SIZES = [0, 1, 4, 5, 7, 511, 512, 513, 1000, 5000, 70_000, 1_000_003]
# odd geometries: bucket bit ranges that do not start on byte boundaries, trits across bytes, 16-bit codes
ODD_ACTIONS = [A.qsgd(3, bucket_size=100), A.ternary(bucket_size=7), A.topk(0.3, bucket_size=10),
               A.scaled_sign(bucket_size=13), A.qsgd(16, stochastic=False, bucket_size=77), A.topk(1.0, bucket_size=6),
               A.lloyd_max(3, bucket_size=7), A.lloyd_max(8, bucket_size=100), A.lloyd_max(4, bucket_size=13),
               A.lloyd_max(16, bucket_size=3), A.lloyd_max(32, bucket_size=9), A.lloyd_max(64, bucket_size=45),
               A.qsgd(12, stochastic=False, bucket_size=21)]
ALL_ACTIONS = [*A.ACTIONS.values(), *ODD_ACTIONS]
ODD_SIZES = [1, 7, 99, 1000, 70_001]

needs_c = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the CPU kernels")


def _ids(a: A.Action) -> str:
    return f"{a.name}-B{a.bucket_size}"


def _reference_pack(g, e, action, sent=None):
    """The reference payload (same header) and its statistics; ``e`` (and ``sent``, when given) are updated."""
    n = e.numel()
    payload = torch.zeros(wire.payload_nbytes(action, n), dtype=torch.uint8)
    payload[:wire.HEADER_BYTES] = torch.frombuffer(bytearray(wire.pack_header(wire.header_of(action, n))),
                                                   dtype=torch.uint8)
    return payload, R.quantize_pack_ef(g, e, payload, action, KEY, sent)


def _reference_decode(payload: torch.Tensor) -> torch.Tensor:
    header = wire.parse_header(payload)
    out = torch.empty(header.n)
    R.decode(payload, header, out, False, "tensor")
    return out


def _check_round_trip(action: A.Action, n: int, with_g: bool = True, reference: bool = True) -> None:
    g, e = make(n)
    if not with_g:
        g, e = None, g + e
    e_send, out = e.clone(), torch.full((n,), 7.0)
    s_send = K.quantize_ef(g, e_send, out, action, KEY)
    e_pack = e.clone()
    payload, s_pack = K.quantize_pack_ef(g, e_pack, action, KEY)
    assert payload.dtype == torch.uint8 and payload.numel() == 16 + action.cost(n) // 8
    assert torch.equal(bits(e_pack), bits(e_send))
    assert torch.equal(s_pack, s_send)                                  # bitwise: one summation order
    assert torch.equal(bits(K.decode(payload)), bits(out))
    if reference:
        e_ref = e.clone()
        payload_ref, s_ref = _reference_pack(g, e_ref, action)
        assert torch.equal(payload_ref, payload)
        assert torch.equal(bits(e_ref), bits(e_send))
        assert torch.allclose(s_ref, s_send, rtol=1e-12, atol=1e-300, equal_nan=True)
        assert torch.equal(bits(_reference_decode(payload)), bits(out))


@needs_c
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("action", A.ACTIONS.values(), ids=_ids)
def test_round_trip_menu_actions(action, n):
    # the slow reference is left out at 1M elements (it runs at every other size)
    _check_round_trip(action, n, reference=n <= 100_000)


@needs_c
@pytest.mark.parametrize("n", ODD_SIZES)
@pytest.mark.parametrize("action", ODD_ACTIONS, ids=_ids)
def test_round_trip_odd_geometries(action, n):
    _check_round_trip(action, n)


@needs_c
@pytest.mark.parametrize("action", [A.ACTIONS[a] for a in ("int4", "ternary", "sign", "topk10", "fp16", "int3_mse",
                                                           "ternary_mse")], ids=_ids)
def test_round_trip_without_g(action):
    _check_round_trip(action, 70_000, with_g=False)


@needs_c
@pytest.mark.slow
@pytest.mark.parametrize("action", [A.ACTIONS[a] for a in ("int8", "ternary", "topk1")], ids=_ids)
def test_round_trip_4m(action):
    _check_round_trip(action, 4 << 20, reference=False)


@needs_c
def test_threads_do_not_change_the_payload():
    g, e = make(1_000_003, seed=4)
    old = torch.get_num_threads()
    try:
        for action in (A.qsgd(3, bucket_size=100), A.ternary(bucket_size=7), A.ACTIONS["topk10"],
                       A.lloyd_max(8, bucket_size=100), A.lloyd_max(3, bucket_size=7)):
            payloads = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                payloads.append(K.quantize_pack_ef(g, e.clone(), action, KEY)[0])
            assert torch.equal(payloads[0], payloads[1]), action.name
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("action", ALL_ACTIONS, ids=_ids)
def test_cost_is_the_body_size(action):
    for n in [*range(0, 40), 511, 512, 513, 2559, 2560, 2561, 100_003]:
        assert action.cost(n) % 8 == 0
        header = wire.header_of(action, n)
        assert wire.payload_nbytes(action, n) == header.payload_nbytes == 16 + action.cost(n) // 8
        assert wire.parse_header(wire.pack_header(header) + bytes(header.body_nbytes)) == header


def test_ternary_is_five_trits_per_byte():
    t = A.ACTIONS["ternary"]
    assert t.packs_trits and not A.ACTIONS["int2"].packs_trits
    assert t.cost(1000) == 8 * 200 + 32 * 2 and A.ACTIONS["int2"].cost(1000) == 2 * 1000 + 32 * 2
    # stochastic ternary of +-scale/2 values: digits 0, 1 (+) and 2 (-) only
    payload, _ = K.quantize_pack_ef(None, torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0]), t, KEY)
    byte = int(payload[-1])
    digits = [(byte // 3**i) % 3 for i in range(5)]
    assert digits[:2] == [1, 2] and digits[4] == 0 and byte < 243


def test_header_layout():
    header = wire.header_of(A.ACTIONS["topk10"], 70_000)
    raw = wire.pack_header(header)
    assert len(raw) == 16
    assert struct.unpack("<BBHHHQ", raw) == (1, int(A.ActionKind.TOPK), 0, 511, 50, 70_000)
    assert struct.unpack("<BBHHHQ", wire.pack_header(wire.header_of(A.ACTIONS["ternary"], 3)))[:5] == (1, 3, 1, 511, 1)
    assert struct.unpack("<BBHHHQ", wire.pack_header(wire.header_of(A.ACTIONS["int4"], 3)))[:5] == (1, 3, 7, 511, 0)
    assert struct.unpack("<BBHHHQ", wire.pack_header(wire.header_of(A.ACTIONS["int3_mse"], 3)))[:5] == (1, 6, 8, 511, 0)
    assert struct.unpack("<BBHHHQ", wire.pack_header(wire.header_of(A.ACTIONS["ternary_mse"], 3)))[:5] == (1, 6, 3, 511,
                                                                                                         1)


def test_edge_values_bitwise():
    """-0.0, subnormals, fp16 overflow and NaN: decode gives exactly the values quantize_ef sends."""
    v = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 6e-8, -2.98e-8, 65520.0, -1e30, 3.4e38, float("inf"),
                      float("-inf"), float("nan"), 1.0, -1.0, 2.0**-140, -(2.0**-140)])
    for action in ALL_ACTIONS:
        for sl in (slice(0, 11), slice(0, 16), slice(0, 2)):        # finite only, with inf/NaN, zeros only
            x = v[sl].clone()
            out = torch.empty_like(x)
            K.quantize_ef(None, x.clone(), out, action, KEY)
            payload, _ = K.quantize_pack_ef(None, x.clone(), action, KEY)
            assert torch.equal(bits(K.decode(payload)), bits(out)), (action.name, sl)
            assert torch.equal(bits(_reference_decode(payload)), bits(out)), (action.name, sl)


def test_topk_ties_keep_lowest_index():
    x = torch.tensor([3.0, -3.0, 1.0, 3.0, -3.0, 0.5])
    payload, _ = K.quantize_pack_ef(None, x.clone(), A.topk(0.5, bucket_size=6), KEY)
    assert torch.equal(K.decode(payload), torch.tensor([3.0, -3.0, 0.0, 3.0, 0.0, 0.0]))


@pytest.mark.parametrize("action", [A.ACTIONS[a] for a in ("fp32", "fp16", "int4", "ternary", "sign", "topk10")],
                         ids=_ids)
def test_decode_add_accumulates(action):
    g, e = make(5000, seed=2)
    payload, _ = K.quantize_pack_ef(g, e, action, KEY)
    acc = torch.randn(5000)
    acc[:3] = -0.0                                                      # -0.0 + +0.0 is +0.0: a real add
    acc_ref = acc.clone()
    expect = acc + K.decode(payload)
    assert K.decode_add(payload, acc) is acc
    assert torch.equal(bits(acc), bits(expect))
    R.decode(payload, wire.parse_header(payload), acc_ref, True, "x")
    assert torch.equal(bits(acc_ref), bits(expect))


@needs_c
@pytest.mark.parametrize("action", ALL_ACTIONS, ids=_ids)
def test_sent_holds_the_decoded_payload(action):
    """``quantize_pack_ef(..., into=)`` writes q, bitwise what decoding the payload gives, also over ``g`` itself
    (the front ends pass the gradient's storage), C and reference alike; payload, e and statistics unchanged."""
    for n in (0, 1, 513, 5000, 70_001):
        g, e = make(n, seed=5)
        e_plain = e.clone()
        payload, stats = K.quantize_pack_ef(g, e_plain, action, KEY)
        decoded = K.decode(payload)
        sent, e_sent = torch.full((n,), 7.0), e.clone()
        payload_sent, stats_sent = K.quantize_pack_ef(g, e_sent, action, KEY, into=sent)
        g_over, e_over = g.clone(), e.clone()
        payload_over, _ = K.quantize_pack_ef(g_over, e_over, action, KEY, into=g_over)
        for p, q, e_after in ((payload_sent, sent, e_sent), (payload_over, g_over, e_over)):
            assert torch.equal(p, payload) and torch.equal(bits(e_after), bits(e_plain))
            assert torch.equal(bits(q), bits(decoded)), (action.name, n)
        assert torch.equal(stats_sent, stats)
        if n <= 5000:
            ref_sent = torch.full((n,), 7.0)
            _reference_pack(g, e.clone(), action, sent=ref_sent)
            assert torch.equal(bits(ref_sent), bits(decoded))


def test_sent_must_not_be_the_residual():
    g, e = make(100)
    with pytest.raises(ValueError, match="sent must not be e"):
        K.quantize_pack_ef(g, e, A.ACTIONS["int4"], KEY, into=e)
    with pytest.raises(ValueError, match="sent has 99 elements"):
        K.quantize_pack_ef(g, e, A.ACTIONS["int4"], KEY, into=torch.zeros(99))


@pytest.mark.parametrize("divisor", [2, 3, 7.5])
@pytest.mark.parametrize("action", [A.ACTIONS[a] for a in ("fp32", "int4", "ternary_mse", "topk10")], ids=_ids)
def test_decode_add_divides_in_the_same_pass(action, divisor):
    """``decode_add(..., divisor=d)`` is bitwise the add followed by ``div_(d)`` (the mean over ranks), C and
    reference; a divisor that is not a finite number > 0 is refused before anything is written."""
    g, e = make(5000, seed=3)
    payload, _ = K.quantize_pack_ef(g, e, action, KEY)
    acc = torch.randn(5000)
    acc[:3] = -0.0
    expect = (acc + K.decode(payload)).div_(divisor)
    acc_ref = acc.clone()
    assert torch.equal(bits(K.decode_add(payload, acc, divisor=divisor)), bits(expect))
    R.decode(payload, wire.parse_header(payload), acc_ref, True, "x", float(divisor))
    assert torch.equal(bits(acc_ref), bits(expect))
    before = acc.clone()
    for bad in (0, -2.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="divisor must be a finite number > 0"):
            K.decode_add(payload, acc, divisor=bad)
    assert torch.equal(acc, before)


def test_unaligned_payload_slice_decodes():
    g, e = make(1000)
    payload, _ = K.quantize_pack_ef(g, e, A.ACTIONS["int4"], KEY)
    buffer = torch.zeros(payload.numel() + 3, dtype=torch.uint8)
    buffer[3:] = payload
    assert torch.equal(bits(K.decode(buffer[3:])), bits(K.decode(payload)))


def test_given_payload_is_filled():
    g, e = make(5000)
    action = A.ACTIONS["sign"]
    fresh, _ = K.quantize_pack_ef(g, e.clone(), action, KEY)
    given = torch.full((wire.payload_nbytes(action, 5000),), 0xAB, dtype=torch.uint8)
    payload, _ = K.quantize_pack_ef(g, e.clone(), action, KEY, payload=given)
    assert payload is given and torch.equal(given, fresh)
    with pytest.raises(ValueError, match="payload must be"):
        K.quantize_pack_ef(g, e.clone(), action, KEY, payload=given[:-1])


def _corrupt(payload: torch.Tensor, offset: int, fmt: str, value: int) -> torch.Tensor:
    raw = bytearray(payload.numpy().tobytes())
    struct.pack_into(fmt, raw, offset, value)
    return torch.frombuffer(raw, dtype=torch.uint8)


@pytest.mark.parametrize("decoder", ["c", "reference"])
def test_invalid_payloads_are_refused_by_name(decoder, monkeypatch):
    if decoder == "reference":
        monkeypatch.setattr(K, "_backend", lambda device: R)
    elif not cpu.available():
        pytest.skip("no C compiler")
    g, e = make(5000)
    good, _ = K.quantize_pack_ef(g, e.clone(), A.ACTIONS["int4"], KEY)
    topk, _ = K.quantize_pack_ef(g, e.clone(), A.ACTIONS["topk10"], KEY)
    lloyd, _ = K.quantize_pack_ef(g, e.clone(), A.ACTIONS["int2_mse"], KEY)
    n = 5000
    cases = [
        (good[:-1], rf"truncated payload: got {good.numel() - 1} bytes, expected {good.numel()}"),
        (torch.cat([good, torch.zeros(1, dtype=torch.uint8)]), "1 extra bytes in payload"),
        (good[:10], "truncated payload: got 10 bytes"),
        (_corrupt(good, 0, "<B", 2), "format version 2 unsupported"),
        (_corrupt(good, 0, "<B", 7), "format version 7 unsupported"),
        (_corrupt(good, 1, "<B", 99), "unknown action kind 99"),
        (_corrupt(good, 8, "<Q", n + 1), "truncated payload|payload holds"),
        (_corrupt(good, 2, "<H", 0), "levels 0 outside"),
        (_corrupt(good, 6, "<H", 1), "code packing 1 invalid"),
        (_corrupt(topk, 6, "<H", 600), "top-k keeps 601 per bucket of 512"),
        (_corrupt(lloyd, 2, "<H", 5), "LLOYD_MAX levels 5 not one of"),
        (_corrupt(lloyd, 6, "<H", 1), "LLOYD_MAX code packing 1 invalid"),
        (_corrupt(lloyd, 2, "<H", 8), "truncated payload"),                 # 3-bit codes announced, 2-bit sent
        (_corrupt(topk, topk.numel() - 1, "<B", 0xFF), "top-k bucket 9 has local indices"),
        # the first index becomes 511 (nine 1-bits), so the second cannot be above it
        (_corrupt(topk, topk.numel() - 574, "<H", 0xFFFF), "top-k bucket 0 has local indices"),
        (good.float(), "1-D uint8"),
    ]
    for payload, message in cases:
        out = torch.ones(n)
        with pytest.raises(WireFormatError, match=f"layer3.weight: .*({message})"):
            K.decode_add(payload, out, name="layer3.weight")
        assert torch.equal(out, torch.ones(n)), message                   # nothing was added
    with pytest.raises(WireFormatError, match=r"layer3\.weight: payload holds 5000 elements, the tensor has 4999"):
        K.decode_add(good, torch.zeros(n - 1), name="layer3.weight")
    with pytest.raises(WireFormatError, match="w: unknown action kind 9"):
        K.decode(_corrupt(good, 1, "<B", 9), name="w")
    assert isinstance(WireFormatError("x"), ValueError)


@needs_c
@pytest.mark.parametrize("bucket", [5, 7, 512, 513])
def test_trit_decode_every_byte_offset(bucket):
    """Trit buckets starting at every offset inside a byte (the decoder's partial first/last bytes), C against
    the reference, decode and decode_add."""
    g, e = make(5 * bucket + 3, seed=9)
    action = A.ternary(bucket_size=bucket)
    payload, _ = K.quantize_pack_ef(g, e.clone(), action, KEY)
    expect = _reference_decode(payload)
    assert torch.equal(bits(K.decode(payload)), bits(expect))
    base = torch.randn(expect.numel())
    assert torch.equal(bits(K.decode_add(payload, base.clone())), bits(base + expect))
