"""The shared numerics of pfa_numba._core, checked exhaustively or against NumPy."""
import ml_dtypes
import numpy as np
import pytest
from numba import njit

from pfa_numba import _core as C


@njit
def _map_f16_to_f32(a):
    out = np.empty(a.size, np.float32)
    for i in range(a.size):
        out[i] = C.f16_to_f32(a[i])
    return out


@njit
def _map_narrow(a, code):
    out = np.empty(a.size, np.uint16)
    for i in range(a.size):
        C.store(out, i, a[i], code)
    return out


@njit
def _map_exp(a):
    out = np.empty(a.size, np.float32)
    for i in range(a.size):
        out[i] = C.exp_f32(a[i])
    return out


@njit
def _max_by_keys(a):
    mk = C.order_key(np.float32(-np.inf))
    for i in range(a.size):
        kx = C.order_key(a[i])
        mk = kx if kx > mk else mk
    return C.from_order_key(mk)


def _interesting_f32(rng):
    x = rng.standard_normal(200_000).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-9, 6, x.size).astype(np.float32)
    halves = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    mid = (halves[:-1].astype(np.float64) + halves[1:]) / 2        # exact ties
    bf = np.arange(65536, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    bmid = (bf[:-1] + bf[1:]) / 2
    special = [np.inf, -np.inf, 65504, 65519.99, 65520, -65520, 1e-8, 2.9802322e-08, 0.0, -0.0,
               3.4e38, -3.4e38, 1e-40]
    with np.errstate(invalid="ignore", over="ignore"):
        return np.concatenate([x, mid[np.isfinite(mid)], bmid[np.isfinite(bmid)],
                               special]).astype(np.float32)


def test_f16_to_f32_is_exact_for_every_half():
    bits = np.arange(65536, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    got = _map_f16_to_f32(bits)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_f32_to_f16_rounds_to_nearest_even():
    x = _interesting_f32(np.random.default_rng(0))
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    got = _map_narrow(x, C.CODE_F16)
    assert np.array_equal(got, want)
    assert got[x == np.float32(65520)][0] == 0x7C00            # overflow is +inf
    nan = _map_narrow(np.array([np.nan, -np.nan], np.float32), C.CODE_F16)
    assert np.isnan(nan.view(np.float16)).all()


def test_f32_to_bf16_rounds_to_nearest_even():
    x = _interesting_f32(np.random.default_rng(1))
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    got = _map_narrow(x, C.CODE_BF16)
    assert np.array_equal(got, want)
    nan = _map_narrow(np.array([np.nan], np.float32), C.CODE_BF16)
    assert np.isnan(nan.view(ml_dtypes.bfloat16).astype(np.float32)).all()


def test_exp_f32_accuracy_and_specials():
    x = np.linspace(-87, 88.7, 2_000_001).astype(np.float32)
    got = _map_exp(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    rel = np.abs(got / want - 1).max()
    assert rel < 2e-7, rel
    sp = _map_exp(np.array([-np.inf, np.inf, np.nan, 0.0, -1000.0, 1000.0], np.float32))
    assert sp[0] == 0 and sp[1] == np.inf and np.isnan(sp[2]) and sp[3] == 1
    assert sp[4] == 0 and sp[5] == np.inf


def test_order_key_max():
    rng = np.random.default_rng(2)
    a = rng.standard_normal(1001).astype(np.float32)
    a[3] = -np.inf
    assert _max_by_keys(a) == a.max()
    assert _max_by_keys(np.full(5, -np.inf, np.float32)) == -np.inf
    assert _max_by_keys(np.array([-0.0, -1.0], np.float32)) == 0
    assert np.isnan(_max_by_keys(np.array([1.0, np.nan, 3.0], np.float32)))


@njit
def _map_exp_nonpos(a, short):
    out = np.empty(a.size, np.float32)
    for i in range(a.size):
        out[i] = C.exp_nonpos5(a[i]) if short else C.exp_nonpos(a[i])
    return out


@pytest.mark.parametrize("short", [False, True])
def test_exp_nonpos_accuracy_and_specials(short):
    # exp_nonpos5 also serves the lazy softmax step, up to LAZY_MARGIN above the max: to 88
    x = np.linspace(-87, 88, 3_500_001) if short else np.linspace(-87, 0, 2_000_001)
    x = x.astype(np.float32)
    got = _map_exp_nonpos(x, short).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    if short:
        ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
        assert (np.abs(got - want) / ulp).max() <= 2.5
        assert abs(np.mean((got - want) / want)) < 3e-8     # no bias to pile up in a row sum
    else:
        assert np.abs(got / want - 1).max() < 2e-7
    sp = _map_exp_nonpos(np.array([-np.inf, np.nan, 0.0, -0.0, -1000.0, -87.5], np.float32),
                         short)
    assert sp[0] == 0 and np.isnan(sp[1]) and sp[2] == 1 and sp[3] == 1 and sp[4] == 0
    assert sp[5] == 0
