"""The register-blocked float32 tile products (pfa_numba._gemm) and the CPU kernel on them.

On an AVX-512 host every float32 / float16 test of the suite runs on these products; here they
are checked against NumPy at the edges of their layout (rows that are not a multiple of the
block, partial K^T panels, row lengths with a 16, 32 or 48-lane tail, inner dimensions of one),
and the kernel is checked on both product paths (register blocks and BLAS) at head dims the
layout pads. Without AVX-512 the product tests are skipped, and say so.
"""
import numpy as np
import pytest
from numba import njit

from pfa_numba import config, prompt_flash_attention
from pfa_numba.cpu import _gemm
from _cases import DTYPES, assert_matches_reference, qkv


def order_key(x):
    """numerics.core.order_key on float32 arrays (NumPy)."""
    i = np.asarray(x, np.float32).view(np.int32)
    a = i & np.int32(0x7FFFFFFF)
    i = np.where(a > 0x7F800000, a, i)                 # NaN of either sign: the positive one
    return i ^ ((i >> 31) & np.int32(0x7FFFFFFF))


@njit
def _scores(*args):
    """_gemm.scores (a kernel function: callable from compiled code only)."""
    _gemm.scores(*args)


@njit
def _accumulate(*args):
    """_gemm.accumulate (a kernel function: callable from compiled code only)."""
    _gemm.accumulate(*args)


needs_avx512 = pytest.mark.skipif(not _gemm.available(),
                                  reason="this CPU has no AVX-512 (tested where it has)")
MR, P = _gemm.MR, _gemm.PANEL


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _bound(a, b, k):
    """float32 accumulation of k products, relative to the magnitudes summed."""
    return 2 * k * np.finfo(np.float32).eps * (np.abs(a.astype(np.float64))
                                               @ np.abs(b.astype(np.float64)))


@needs_avx512
@pytest.mark.parametrize("rows,d,n_panels", [(1, 1, 1), (5, 3, 2), (6, 16, 1), (7, 40, 3),
                                             (13, 128, 2), (64, 64, 1)])
@pytest.mark.parametrize("with_keys", [False, True])
def test_scores_against_numpy(rows, d, n_panels, with_keys):
    rng = np.random.default_rng(rows * 100 + d)
    ldq = d + 3                                        # rows of Q further apart than D
    q = _f32(rng, _gemm.padded_rows(rows), ldq)
    k = _f32(rng, n_panels * P, d)
    kt = np.ascontiguousarray(k.reshape(n_panels, P, d).transpose(0, 2, 1)).ravel()
    lds = n_panels * P + 16
    s = np.full((_gemm.padded_rows(rows) + 2, lds), 7.0, np.float32)
    q_off = 5
    qf = np.concatenate([np.zeros(q_off, np.float32), q.ravel()])
    kt_off = 11
    ktf = np.concatenate([np.zeros(kt_off, np.float32), kt])
    rp = _gemm.padded_rows(rows)
    keys = order_key(rng.standard_normal(rp + 1).astype(np.float32) * 8)  # some rows' above
    before = keys.copy()
    _scores(qf, q_off, ldq, ktf, kt_off, d, s.ravel(), lds, rows, n_panels,
                 keys if with_keys else None)
    want = q[:, :d].astype(np.float64) @ k.T.astype(np.float64)
    got = s[:rp, :n_panels * P]
    assert (np.abs(got - want) <= _bound(q[:, :d], k.T, d)).all()
    assert (s[:, n_panels * P:] == 7.0).all()          # columns past the panels untouched
    assert (s[rp:] == 7.0).all()                       # rows past the blocks untouched
    if with_keys:     # each row's max over the panels, as an order key, maxed into keys
        assert np.array_equal(keys[:rp], np.maximum(before[:rp], order_key(got).max(axis=1)))
    assert np.array_equal(keys[rp:], before[rp:])


@needs_avx512
def test_row_maxima_of_non_finite_scores():
    """Rows holding inf, -inf and NaN (of either sign) scores: the maxima are those of the
    order keys (-inf below every number, a NaN of either sign above +inf)."""
    rng = np.random.default_rng(3)
    d, rows = 8, 12
    q = _f32(rng, rows, d)
    k = _f32(rng, P, d)
    q[1, 2] = np.inf
    q[3, 0] = -np.inf
    q[5, :] = np.nan
    q[7, :] = -np.nan
    kt = np.ascontiguousarray(k.T).ravel()
    s = np.zeros((rows, P), np.float32)
    keys = np.full(rows, order_key(np.float32(-np.inf)), np.int32)
    with np.errstate(invalid="ignore"):
        _scores(q.ravel(), 0, d, kt, 0, d, s.ravel(), P, rows, 1, keys)
    assert np.isnan(s[5]).all() and np.isnan(s[7]).all() and np.isinf(s[1]).any()
    assert (s[7].view(np.int32) < 0).all()            # NaN with the sign bit
    assert np.array_equal(keys, order_key(s).max(axis=1))
    assert (keys[[5, 7]] == order_key(np.float32(np.nan))).all()


@needs_avx512
@pytest.mark.parametrize("rows,k,ldv", [(1, 1, 16), (5, 7, 48), (6, 64, 64), (7, 33, 80),
                                        (12, 100, 128), (13, 512, 144)])
def test_accumulate_against_numpy(rows, k, ldv):
    rng = np.random.default_rng(rows * 1000 + k + ldv)
    rp = _gemm.padded_rows(rows)
    ldp = k + 5
    p = rng.random((rp, ldp)).astype(np.float32)
    v = _f32(rng, k + 2, ldv)
    ldacc = ldv + 16
    acc = _f32(rng, rp + 2, ldacc)
    before = acc.copy()
    v_off = 2 * ldv                                    # V starts at its third row
    _accumulate(p.ravel(), ldp, v.ravel(), v_off, ldv, acc.ravel(), ldacc, ldacc, rows, k)
    pk, vk = p[:, :k], v[2:2 + k]
    want = before[1:rp + 1, :ldv].astype(np.float64) + pk.astype(np.float64) @ vk.astype(
        np.float64)
    bound = _bound(pk, vk, k + 1) + 2 * np.finfo(np.float32).eps * np.abs(want)
    assert (np.abs(acc[1:rp + 1, :ldv] - want) <= bound).all()
    assert np.array_equal(acc[0], before[0])           # the row before acc_off untouched
    assert np.array_equal(acc[1:, ldv:], before[1:, ldv:])   # columns past ldv untouched
    assert np.array_equal(acc[rp + 1:], before[rp + 1:])     # rows past the blocks untouched


def _head_dim(dt, d):
    """bfloat16 needs D % 16 == 0: 1, 3, 17, 100, 200 -> 16, 48, 80, 112, 208 (row tails of
    1, 3, 1, 3, 1 vectors past whole 64-column blocks)."""
    return {1: 16, 3: 48, 17: 80, 100: 112, 200: 208}[d] if dt == "bf16" else d


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("d", [1, 3, 17, 100, 200])        # bf16 (D % 16 == 0): see _head_dim
@pytest.mark.parametrize("mode,tok", [("0", (2147483647, 2147483647)), ("4", (40, 17)),
                                      ("3", (2147483647, 0))])
def test_kernel_on_both_product_paths(products, monkeypatch, dt, d, mode, tok):
    """Head dims the register blocks pad (16-lane rows, D < 16), odd tiles, band-cut tiles in
    32-row segments, GQA with a ragged last work item."""
    monkeypatch.setattr(config, "CPU_Q_ROWS", 150)
    monkeypatch.setattr(config, "CPU_KV_COLS", 97)
    monkeypatch.setattr(config, "CPU_SUB_ROWS", 1)
    monkeypatch.setattr(config, "CPU_BAND_TILE_MIN", 150)
    d = _head_dim(dt, d)
    rng = np.random.default_rng(d * 7 + len(mode))
    n, nkv, sq, skv = 6, 2, 173, 230
    q, k, v = qkv(rng, "BNSD", DTYPES[dt], 1, n, nkv, sq, skv, d)
    mask = np.triu(np.ones((2048, 2048), bool), 1) if mode != "0" else None
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", sparse_mode=int(mode),
              scale_value=d ** -0.5, pre_tokens=tok[0], next_tokens=tok[1])
    out, lse = prompt_flash_attention(q, k, v, mask, **kw, return_softmax_lse=True)
    assert_matches_reference(out, (q, k, v, mask), kw, DTYPES[dt], lse=lse)


@pytest.mark.parametrize("dt", list(DTYPES))
def test_non_finite_values_stay_in_their_rows(products, dt):
    """inf in V (only rows that keep its column see it) and NaN in Q (only its own row), on
    both product paths."""
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, "BNSD", DTYPES[dt], 1, 2, 2, 70, 90, 32)
    v[0, 0, 40, 3] = np.inf
    q[0, 1, 10, 5] = np.nan
    mask = np.triu(np.ones((2048, 2048), bool), 1)
    kw = dict(num_heads=2, input_layout="BNSD", sparse_mode=3, scale_value=0.2)
    out = prompt_flash_attention(q, k, v, mask, **kw)
    assert_matches_reference(out, (q, k, v, mask), kw, DTYPES[dt])


@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.int64, np.uint8])
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (1000,), (4, 33), (1, 2, 1)])
def test_scratch_rows_start_a_cache_line(dtype, shape):
    """Each thread's row of a kernel buffer starts a 64-byte line (a vector load or AMX tile row
    never straddles two) and holds its shape (the last length rounded up to whole lines); the
    array is C-contiguous (its rows are typed as such)."""
    from pfa_numba.cpu.launch import rows
    from pfa_numba.cpu._vector import LINE
    for threads in (1, 3):
        for _ in range(4):                  # the allocator's offsets vary from call to call
            a = rows(threads, shape, dtype)
            a[...] = 1
            assert a.dtype == dtype and a.flags.c_contiguous and (a == 1).all()
            assert a.shape[:-1] == (threads,) + shape[:-1] and a.shape[-1] >= shape[-1]
            for t in range(threads):
                assert a[t].ctypes.data % LINE == 0


def test_kernel_buffers_start_a_cache_line():
    from pfa_numba.cpu import driver
    from pfa_numba.cpu.records import Tuning
    from pfa_numba.cpu._vector import LINE
    p = type("P", (), dict(D=72, Dv=72, G=2, code=0))()
    tuning = Tuning(64, 512, 80, 86, 128, 0, 16, 0)
    scratch = driver.f32_scratch(3, p, tuning)
    for name, buf in scratch._asdict().items():
        for t in range(3):
            assert buf[t].size and buf[t].ctypes.data % LINE == 0, name


@pytest.mark.skipif(not __import__("pfa_numba.cpu._vector").cpu._vector.host_has("f16c"),
                    reason="this CPU has no F16C")
def test_hardware_f16_widening_is_exact():
    """f16_bits_to_f32_hw (VCVTPH2PS) widens every binary16 value as numerics.core.f16_to_f32 does."""
    from numba import njit
    from pfa_numba.numerics.core import f16_to_f32
    from pfa_numba.cpu._vector import f16_bits_to_f32_hw

    @njit
    def both(h, hw, sw):
        for i in range(h.size):
            hw[i] = f16_bits_to_f32_hw(h[i])
            sw[i] = f16_to_f32(h[i])

    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    hw, sw = np.empty(h.size, np.float32), np.empty(h.size, np.float32)
    both(h, hw, sw)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(hw), nan) and np.array_equal(np.isnan(sw), nan)
    assert np.array_equal(hw[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.array_equal(sw[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.skipif(not __import__("pfa_numba.cpu._vector").cpu._vector.host_has("f16c"),
                    reason="this CPU has no F16C")
def test_hardware_f16_rounding_is_ieee():
    """f32_to_f16_bits_hw (VCVTPS2PH) rounds as NumPy's float16 cast, subnormal, overflowing
    and tied results included (and so as numerics.core.f32_to_f16)."""
    from numba import njit
    from pfa_numba.numerics.core import f32_to_f16
    from pfa_numba.cpu._vector import f32_to_f16_bits_hw

    @njit
    def both(x, hw, sw):
        for i in range(x.size):
            hw[i] = f32_to_f16_bits_hw(x[i])
            sw[i] = f32_to_f16(x[i])

    rng = np.random.default_rng(9)
    n = 400_000
    e = rng.integers(127 - 30, 127 + 17, n).astype(np.uint32)        # 2^-30 .. 2^17
    m = rng.integers(0, 1 << 23, n).astype(np.uint32)
    m[::3] = (m[::3] & ~np.uint32(0x1FFF)) | np.uint32(0x1000)         # ties
    x = ((e << 23) | m | (rng.integers(0, 2, n).astype(np.uint32) << 31)).view(np.float32)
    x = np.concatenate([x, np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65520, 2.0 ** -24,
                                     2.0 ** -25, 3 * 2.0 ** -26], np.float32)])
    hw, sw = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
    both(x, hw, sw)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(hw, want) and np.array_equal(sw, want)
    nan = np.array([np.nan], np.float32)
    both(nan, hw[:1], sw[:1])
    assert np.isnan(hw[:1].view(np.float16)).all()
