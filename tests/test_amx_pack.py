"""The packing of Q rows for the AMX tile products (pfa_numba.cpu.amx_pack): plain Numba code, so
tested on every CPU, against a NumPy statement of what it must produce: bf16 bits as they are,
float16 split into bf16 hi (rounded to nearest even) and lo parts, padding columns zero, and
the verdict whether AMX computes the rows exactly (no bf16 subnormal, no non-finite
float16)."""
import ml_dtypes
import numpy as np
import pytest
from numba import njit

from pfa_numba.cpu import amx_pack
from pfa_numba.numerics.core import CODE_BF16, CODE_F16

ROWS, D, DP, LD = 5, 19, 32, 40


@njit
def amx_pack_rows(*args):
    """amx_pack.amx_pack_rows (a kernel function: callable from compiled code only)."""
    return amx_pack.amx_pack_rows(*args)


def _bf16_bits(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _expected(rows, code):
    """(hi parts, lo parts, exact) of (ROWS, D) uint16 bits, each part padded to DP columns."""
    hi, lo = np.zeros((ROWS, DP), np.uint16), np.zeros((ROWS, DP), np.uint16)
    if code == CODE_BF16:
        hi[:, :D] = rows
        subnormal = ((rows & 0x7F80) == 0) & ((rows & 0x7FFF) != 0)
        return hi, None, not subnormal.any()
    values = rows.view(np.float16).astype(np.float32)
    hi[:, :D] = _bf16_bits(values)
    with np.errstate(invalid="ignore"):
        rest = values - (hi[:, :D].astype(np.uint32) << 16).view(np.float32)
    lo[:, :D] = _bf16_bits(rest)
    return hi, lo, bool(np.isfinite(values).all())


def _source(rows, strided):
    """rows inside a flat buffer: (buffer, base, row stride, element stride)."""
    sd = 3 if strided else 1
    buf = np.full(7 + ROWS * D * sd + 5, 0x5555, np.uint16)
    base, row_stride = 7, D * sd
    for r in range(ROWS):
        buf[base + r * row_stride:base + (r + 1) * row_stride:sd] = rows[r]
    return buf, base, row_stride, sd


def _rows(rng, code, special):
    if code == CODE_BF16:
        rows = _bf16_bits(rng.standard_normal((ROWS, D)))
        if special:
            rows[2, 4] = 0x0003                     # a bf16 subnormal: AMX would read 0
        return rows
    rows = (rng.standard_normal((ROWS, D)) * 3).astype(np.float16).view(np.uint16)
    if special:
        rows[3, 7] = 0x7C00                         # +inf: the float32 path takes the rows
    rows[1, 2] = 0x0001                             # the smallest float16 subnormal (exact)
    return rows


@pytest.mark.parametrize("code", [CODE_BF16, CODE_F16])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("special", [False, True])
def test_pack_rows_against_numpy(code, strided, special):
    rows = _rows(np.random.default_rng(7), code, special)
    src, base, row_stride, sd = _source(rows, strided)
    lo_at = ROWS * LD + 8
    dst = np.full(2 * lo_at, 0xFFFF, np.uint16)          # stale values the packing must clear
    exact = amx_pack_rows(dst, lo_at, LD, src, base, row_stride, sd, ROWS, D, DP, code)
    hi, lo, want_exact = _expected(rows, code)
    assert exact == want_exact
    if not want_exact and code == CODE_F16:
        return                   # the caller discards these rows (their lo parts are not defined)
    got_hi = np.stack([dst[r * LD:r * LD + DP] for r in range(ROWS)])
    assert np.array_equal(got_hi, hi)
    if lo is not None:
        got_lo = np.stack([dst[lo_at + r * LD:lo_at + r * LD + DP] for r in range(ROWS)])
        assert np.array_equal(got_lo, lo)
