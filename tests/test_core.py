"""The shared numerics of pfa_numba.numerics.core, checked exhaustively or against NumPy."""
import bisect
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from pfa_numba.numerics import core as C


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
    special = [np.inf, -np.inf, 65504, 65519.99, 65520, -65520, 1e-8, 2.9802322e-08, 0.0, -0.0,
               3.4e38, -3.4e38, 1e-40]
    # every bit pattern, NaN and inf included: the midpoints between them are NaN or inf there
    with np.errstate(invalid="ignore", over="ignore"):
        halves = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
        mid = (halves[:-1].astype(np.float64) + halves[1:]) / 2        # exact ties
        bf = np.arange(65536, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
        bmid = (bf[:-1] + bf[1:]) / 2
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


# ---------------------------------------------------------------------------------------------
# int8_out_f16: deq2 * A / l rounded once to float16, against exact rationals
# ---------------------------------------------------------------------------------------------

@njit
def _map_int8_out(a, deq2, l):
    out = np.empty(a.size, np.uint16)
    for i in range(a.size):
        out[i] = C.int8_out_f16(a[i], deq2[i], l[i])
    return out


_HALF_BITS = np.arange(0x7C00, dtype=np.uint16)                  # +0 ... 65504
_HALF_VALUES = [Fraction(float(x)) for x in _HALF_BITS.view(np.float16)] + [Fraction(65536)]


def _f16_exact(a, deq2, l):
    """float16 bits of deq2 * a / l rounded to nearest even: the two neighbouring halves as
    Fractions (65536 stands for +inf, an even significand), no floating-point arithmetic."""
    x = Fraction(float(np.float32(deq2))) * a / Fraction(float(np.float32(l)))
    sign = 0x8000 if x < 0 else 0
    ax = abs(x)
    if x == 0:
        return 0
    k = bisect.bisect_right(_HALF_VALUES, ax) - 1          # _HALF_VALUES[k] <= ax
    if k >= len(_HALF_VALUES) - 1:
        return sign | 0x7C00
    lo, hi = _HALF_VALUES[k], _HALF_VALUES[k + 1]
    if ax - lo < hi - ax or (ax - lo == hi - ax and k % 2 == 0):
        return sign | k
    return sign | (k + 1)


def _check_int8_out(cases):
    a = np.array([c[0] for c in cases], np.int64)
    d = np.array([c[1] for c in cases], np.float32)
    ll = np.array([c[2] for c in cases], np.float32)
    got = _map_int8_out(a, d, ll)
    want = np.array([_f16_exact(int(x), y, z) for x, y, z in zip(a, d, ll)], np.uint16)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(int(a[i]), float(d[i]), float(ll[i]), hex(got[i]), hex(want[i]))
                           for i in bad[:10]]


def _f32(x):
    return np.float32(x)


def test_int8_out_f16_random_against_exact_rationals():
    rng = np.random.default_rng(10)
    cases = []
    for _ in range(30000):
        a = int(rng.integers(1, 2 ** int(rng.integers(1, 63)), dtype=np.int64, endpoint=True))
        a = -a if rng.random() < 0.3 else a
        l = _f32(rng.uniform(1, 2 ** rng.uniform(0, 24)))
        if rng.random() < 0.1:
            l = _f32(2.0 ** rng.integers(-149, 40))           # powers of two, subnormals too
        target = 2.0 ** rng.uniform(-30, 17)                  # around float16's range
        d = _f32(target * float(l) / abs(a))
        if not np.isfinite(d) or d == 0:
            continue
        cases.append((a, d, l))
    assert len(cases) > 25000
    _check_int8_out(cases)


def test_int8_out_f16_exact_midpoints_and_their_neighbours():
    rng = np.random.default_rng(11)
    halves = _HALF_BITS.view(np.float16).astype(np.float64)
    cases = []
    for _ in range(6000):
        k = int(rng.integers(0, 0x7BFF))
        mid = (Fraction(halves[k]) + Fraction(halves[k + 1])) / 2    # c * 2^j, c odd
        # deq2 = md * 2^ed, l = md * 2^p * L: deq2 * A / l = mid for A = mid * 2^(p - ed) * L
        md = int(rng.integers(1, 2 ** 24)) | 1
        if rng.random() < 0.3:
            md = 1
        L = int(rng.integers(1, 2 ** 24 // md + 1))
        ed = int(rng.integers(-60, 20))
        p = int(rng.integers(-30, 30))
        d, l = Fraction(md) * Fraction(2) ** ed, Fraction(md * L) * Fraction(2) ** p
        A = mid * l / d
        if A.denominator != 1 or abs(A) >= 2 ** 62:
            continue
        if float(np.float32(float(d))) != d or float(np.float32(float(l))) != l:
            continue
        for delta in (0, 1, -1):
            for sgn in (1, -1):
                cases.append((sgn * (int(A) + delta), _f32(float(d)), _f32(float(l))))
    assert len(cases) > 15000
    _check_int8_out(cases)
    # the ties themselves go to even: 1 + 2^-11 -> 1, 1 + 3 * 2^-11 -> 1 + 2^-9
    got = _map_int8_out(np.array([2049, 2051, 2049 * 3], np.int64),
                        np.array([1, 1, 1], np.float32),
                        np.array([2048, 2048, 6144], np.float32))
    assert list(got) == [0x3C00, 0x3C02, 0x3C00]


def test_int8_out_f16_overflow_subnormals_zero_and_large_sums():
    cases = [(65504, 1, 1), (65519, 1, 1), (65520, 1, 1), (-65520, 1, 1), (196559, 1, 3),
             (196560, 1, 3), (196561, 1, 3), (2 ** 40, 1, 2 ** 24), (2 ** 40, 2 ** -20, 1),
             (2 ** 53 + 1, _f32(2.0 ** -40), _f32(3.0)), (2 ** 62 - 1, _f32(2.0 ** -47), _f32(1.5)),
             (-(2 ** 63 - 1), _f32(2.0 ** -48), _f32(1.0)), (-(2 ** 63), _f32(2.0 ** -48), 1),
             (2 ** 53 + 1, _f32(1 / 127), _f32(2 ** 24 - 1)), (5, 1, 2 ** 24 * 65504.0),
             (1, 2 ** -25, 1), (1, 2 ** -26, 1), (3, 2 ** -26, 1), (-1, 2 ** -25, 1),
             (2 ** 40 + 1, 2 ** -65, 1), (1, _f32(1e-45), _f32(1e-45)), (7, _f32(3e-45), 1),
             (1023, 2 ** -24, 1), (2047, 2 ** -25, 1), (2047, 2 ** -26, 1), (1, 3e38, 1e-30),
             (1, 1e-30, 3e38), (12345, _f32(1 / 127), _f32(37.25)), (0, 1, 1), (0, -1, 3),
             (10, 0, 1), (10, -0.0, 1)]
    for x in range(-64, 65):                             # every subnormal step near zero
        cases.append((x, 2 ** -26, 1))
    _check_int8_out(cases)
    zero = _map_int8_out(np.array([0, 0, 10], np.int64), np.array([1, -1, -0.0], np.float32),
                         np.ones(3, np.float32))
    assert list(zero) == [0, 0, 0]                       # an exact zero is +0
    assert _map_int8_out(np.array([-1], np.int64), np.array([2 ** -40], np.float32),
                         np.ones(1, np.float32))[0] == 0x8000   # underflow keeps the sign


def test_int8_out_f16_special_values():
    nan, inf = np.float32(np.nan), np.float32(np.inf)
    a = np.array([5, 5, 5, 0, 5, -5, 5, 0, 5, 5], np.int64)
    d = np.array([1, nan, inf, inf, -inf, -inf, 1, 1, 1, inf], np.float32)
    ll = np.array([nan, 1, 1, 1, 1, 1, 0, nan, inf, inf], np.float32)
    got = _map_int8_out(a, d, ll).view(np.float16)
    assert np.isnan(got[[0, 1, 3, 6, 7, 9]]).all()
    assert got[2] == np.inf and got[4] == -np.inf and got[5] == np.inf
    assert got.view(np.uint16)[8] == 0


def test_int8_out_f16_as_a_python_function():
    """The procedure's Python source (what a caller outside compiled code runs), on NumPy
    scalars: the same bits as the compiled function."""
    rng = np.random.default_rng(13)
    a = rng.integers(-2 ** 45, 2 ** 45, 300)
    a[:3] = (0, 2 ** 53 + 1, -(2 ** 62))
    d = (2.0 ** rng.uniform(-30, 0, a.size)).astype(np.float32)
    ll = rng.uniform(1, 5000, a.size).astype(np.float32)
    want = _map_int8_out(a, d, ll)
    got = [C.int8_out_f16.py_func(x, y, z) for x, y, z in zip(a, d, ll)]
    assert np.array_equal(np.array(got, np.uint16), want)
    _check_int8_out(list(zip(a.tolist(), d, ll)))


@settings(max_examples=300, deadline=None)
@given(i0=st.integers(0, 300), rows=st.integers(1, 80), jstart=st.integers(0, 200),
       cols=st.integers(0, 400), width=st.sampled_from([1, 8, 64]),
       pre_e=st.integers(-100, 400), next_e=st.integers(-100, 400))
def test_interior_tiles_are_exactly_the_whole_tiles_inside_the_band(i0, rows, jstart, cols,
                                                                    width, pre_e, next_e):
    from pfa_numba.numerics.band import interior_tiles, tile_inside_band
    jend = jstart + cols
    ntiles = -(-cols // width)
    inside = [jstart + (t + 1) * width <= jend
              and tile_inside_band(i0, i0 + rows, jstart + t * width, jstart + (t + 1) * width,
                                   pre_e, next_e) for t in range(ntiles)]
    ta, tb = interior_tiles(i0, i0 + rows, jstart, jend, width, pre_e, next_e)
    assert 0 <= ta <= tb <= ntiles
    assert inside == [ta <= t < tb for t in range(ntiles)]
