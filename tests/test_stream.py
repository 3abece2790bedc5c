"""The decode products (pfa_numba.cpu.stream on the vector code of pfa_numba.cpu._simd) against
float64 NumPy: K and V rows at scattered offsets in every storage the kernels read (float16,
bfloat16 and float32 bits, int8 values), query-row counts around the four a vector product
takes, column counts around its blocks of four and the prefetch distance, head dims with a
masked tail and with a partial slice of accumulator vectors; weights with zeros next to an inf
in V (a zero weight never meets V); the weighted sum prefetches the next K rows as it goes. The
tests name the storage and the shape; the whole decode path is covered again by
tests/test_fia.py, and rows of strided elements (widened before the products) by
tests/test_determinism.py.
"""
import ml_dtypes
import numpy as np
import pytest
from numba import njit

from pfa_numba.numerics.core import CODE_BF16, CODE_F16, CODE_F32
from pfa_numba.cpu import stream

STORAGES = {"f16": (np.float16, CODE_F16), "bf16": (ml_dtypes.bfloat16, CODE_BF16),
            "f32": (np.float32, CODE_F32), "int8": (np.int8, CODE_F32)}
LDS, N_STORED = 50, 48                   # score row length, rows stored in the cache


@njit
def stream_scores(*args):
    """stream.stream_scores (a kernel function: callable from compiled code only)."""
    stream.stream_scores(*args)


@njit
def stream_pv(*args):
    """stream.stream_pv (a kernel function: callable from compiled code only)."""
    stream.stream_pv(*args)


def every_shape(test):
    """The test over every storage, head dim D, query-row count and column count."""
    for name, values in (("storage", list(STORAGES)), ("D", [128, 80, 17]),
                         ("nrow", [1, 3, 4, 5, 8]), ("nc", [1, 13, 40])):
        test = pytest.mark.parametrize(name, values)(test)
    return test


def _cache(rng, storage, D):
    """A cache of N_STORED rows in ``storage``, its flat bits, shuffled row offsets and its
    storage code (the products' kv tuple)."""
    dtype, code = STORAGES[storage]
    if storage == "int8":
        rows = rng.integers(-127, 128, (N_STORED, D)).astype(np.int8)
    else:
        rows = rng.standard_normal((N_STORED, D)).astype(dtype)
    bits = rows.view(np.uint16) if rows.dtype.itemsize == 2 else rows
    offs = rng.permutation(N_STORED).astype(np.int64) * D
    return rows, (bits.reshape(-1), offs, code)


def _row(rows, kv, c, D):
    """Row c of the kv tuple as float64."""
    flat = rows.astype(np.float64).reshape(-1)
    return flat[kv[1][c]:kv[1][c] + D]


def _tol(a, b):
    """float32 accumulation of the products a_i b_i (sum of magnitudes times a few eps)."""
    return 4 * len(a) * np.finfo(np.float32).eps * (np.abs(a) @ np.abs(b)) + 1e-30


@every_shape
def test_scores_against_numpy(storage, D, nrow, nc):
    rng = np.random.default_rng([D, nrow, nc])
    rows, kv = _cache(rng, storage, D)
    q = rng.standard_normal((nrow + 2, D)).astype(np.float32)
    r0, c0 = 1, 3
    nc = min(nc, N_STORED - c0)
    s = np.full(nrow * LDS, np.nan, np.float32)
    stream_scores(s, LDS, q, r0, nrow, kv, c0, nc, kv)
    got = s.reshape(nrow, LDS)
    for r in range(nrow):
        for c in range(nc):
            k = _row(rows, kv, c0 + c, D)
            want = q[r0 + r].astype(np.float64) @ k
            assert abs(got[r, c] - want) <= _tol(q[r0 + r].astype(np.float64), k), (r, c)
    assert np.isnan(got[:, nc:]).all(), "columns past nc were written"


@every_shape
def test_weighted_sum_against_numpy(storage, D, nrow, nc):
    rng = np.random.default_rng([D, nrow, nc, 1])
    rows, kv = _cache(rng, storage, D)
    c0 = 3
    nc = min(nc, N_STORED - c0)
    if storage != "int8":
        inf_row = kv[1][c0 + nc - 1] // D
        rows[inf_row, 0] = np.inf                    # weight 0 in every row below
    p = rng.random((nrow, LDS)).astype(np.float32) + np.float32(0.01)
    p[:, nc - 1] = 0
    p[0, nc // 2] = 0                                # a zero in one row only
    ld = D + 3
    acc = rng.standard_normal(nrow * ld + 5).astype(np.float32)
    before = acc.copy()
    next_keys = (kv[0], kv[1], N_STORED)           # prefetched on the way: reads nothing
    stream_pv(acc, ld, nrow, p.reshape(-1), LDS, kv, c0, nc, np.zeros((1, D), np.float32),
              next_keys)
    for r in range(nrow):
        want = before[r * ld:r * ld + D].astype(np.float64)
        scale = np.abs(want)
        for c in range(nc):
            if p[r, c] != 0:
                v = _row(rows, kv, c0 + c, D)
                want = want + p[r, c] * v
                scale = scale + np.abs(p[r, c] * v)
        got = acc[r * ld:r * ld + D]
        assert np.isfinite(got).all(), f"row {r}: a zero weight met inf"
        assert (np.abs(got - want) <= 4 * (nc + 1) * np.finfo(np.float32).eps * scale
                + 1e-30).all(), f"row {r}"
        assert (acc[r * ld + D:(r + 1) * ld] == before[r * ld + D:(r + 1) * ld]).all(), \
            f"row {r}: the padding past D was written"
    assert (acc[nrow * ld:] == before[nrow * ld:]).all(), "rows past nrow were written"
