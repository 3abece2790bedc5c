"""The tile products of a work item with few rows (decode: the G query heads of one position):
each K and V row is read once from the cache and used by every row of the item at once,
instead of being packed into tiles that few rows would then read. Rows go through the explicit
vector code of :mod:`._simd`, four query rows at a time; their elements are contiguous (the
caller widens strided rows into a buffer first, :func:`.streaming._tile`).

``kv`` = (src, offs, code): the rows' array, element offsets (see :mod:`.kv`) and their storage
code. int8 rows are read as their integer values: the caller folds
their dequantization into the query rows and the weights (see
:func:`.streaming._run`), so the products only convert.
"""
import numpy as np
from numba import njit

from ..numerics.core import CODE_BF16, CODE_F16, F32_ONE, F32_ZERO
from ._jit import LEAF, LEAF_INLINE
from ._simd import (PF_ROWS, scores_bf16, scores_f16, scores_native, weighted_sum_bf16,
                    weighted_sum_f16, weighted_sum_native)
from ._vector import own_unit, wide_vectors
from .kv import KEY, VALUE
from .rows import load_row, prefetch_row

#: query rows a vector product takes at once
BLOCK = 4


@njit(**LEAF)
def _row(buf, kv, c, nc):
    """Row c of the tile's nc, as float32, into buf[0, :D]; the row PF_ROWS on is prefetched
    (paged rows jump from block to block, where the hardware prefetcher starts over)."""
    src, offs, code = kv
    D = buf.shape[1]
    if c + PF_ROWS < nc:
        prefetch_row(src, offs[c + PF_ROWS], D)
    # np.int64: numbers, not the literals 0 and 1 (a call typed with those compiles anew)
    load_row(buf, np.int64(0), src, offs[c], np.int64(1), D, code, F32_ONE)


@njit(**LEAF)
def stream_scores(s, lds, q2, r0, nrow, kv, c0, nc, values):
    """s[r * lds + c] = q2[r0 + r] . K[c0 + c] for r < nrow, c < nc; the tile's V rows of
    ``values`` (kv's form) are prefetched into L2 on the way, so that the weighted sum that
    follows finds them there instead of waiting on memory row after row."""
    own_unit()
    src, offs, code = kv
    for r in range(0, nrow, BLOCK):
        n = min(BLOCK, nrow - r)
        nv = nc if r == 0 else 0
        at = s[r * lds:]
        if code == CODE_F16:
            scores_f16(at, lds, q2, r0 + r, n, src, offs, c0, nc, values[0], values[1], nv)
        elif code == CODE_BF16:
            scores_bf16(at, lds, q2, r0 + r, n, src, offs, c0, nc, values[0], values[1], nv)
        else:
            scores_native(at, lds, q2, r0 + r, n, src, offs, c0, nc, values[0], values[1], nv)


@njit(**LEAF)
def stream_pv(acc, ld, nrow, p, lds, kv, c0, nc, buf, next_keys):
    """acc[r * ld:][:D] += sum over c with p[r * lds + c] != 0 of p[r * lds + c] * V[c0 + c]
    (a zero weight never meets V: inf or NaN there reaches no row that dropped it): four rows
    at a time, their runs of columns without a zero weight in one vector pass, the other
    columns one at a time. The K rows the item reads next, next_keys = (src, offs, n; n = 0:
    none), are prefetched into L2 on the way (in the first four rows' pass), so that memory
    keeps working while the sums are computed."""
    own_unit()
    for r in range(0, nrow, BLOCK):
        n = min(BLOCK, nrow - r)
        a, w = acc[r * ld:], p[r * lds:]
        zeros = _any_zero(w, lds, n, nc)
        c = np.int64(0)      # not the literal 0 (a call typed with it compiles anew)
        while c < nc:
            e = _next_zero(w, lds, n, c, nc) if zeros else nc
            if e > c:
                nk = next_keys[2] - (c0 + c) if r == 0 else 0
                _weighted_sum(a, ld, n, w[c:], lds, kv, c0 + c, e - c, buf.shape[1],
                              (next_keys[0], next_keys[1], max(nk, 0)))
            if e < nc:
                _row(buf, kv, c0 + e, c0 + nc)
                _add_row(a, ld, n, w[e:], lds, buf)
            c = e + 1


@njit(**LEAF_INLINE)
def _weighted_sum(acc, ld, n, p, lds, kv, c0, nc, D, next_keys):
    src, offs, code = kv
    ks, ko, nk = next_keys
    if code == CODE_F16:
        weighted_sum_f16(acc, ld, n, D, p, lds, src, offs, c0, nc, ks, ko, nk)
    elif code == CODE_BF16:
        weighted_sum_bf16(acc, ld, n, D, p, lds, src, offs, c0, nc, ks, ko, nk)
    else:
        weighted_sum_native(acc, ld, n, D, p, lds, src, offs, c0, nc, ks, ko, nk)


@njit(**LEAF_INLINE)
def _add_row(acc, ld, n, p, lds, buf):
    """acc[r * ld:][:D] += p[r * lds] * buf[0] for the rows r < n whose weight is nonzero."""
    for r in range(n):
        pv = p[r * lds]
        if pv != F32_ZERO:
            base = np.uint64(r * ld)
            for d in range(buf.shape[1]):
                acc[base + np.uint64(d)] += pv * buf[0, d]


@njit(**LEAF)
def _any_zero(p, lds, nrow, nc):
    """Whether a weight p[r * lds + c], r < nrow, c < nc, is zero (one vector pass)."""
    wide_vectors()
    zeros = 0
    for r in range(nrow):
        for c in range(nc):
            zeros += p[r * lds + c] == F32_ZERO
    return zeros != 0


@njit(**LEAF)
def _next_zero(p, lds, nrow, c, nc):
    """The first column from c where a weight p[r * lds + col], r < nrow, is zero; nc if none."""
    while c < nc:
        for r in range(nrow):
            if p[r * lds + c] == F32_ZERO:
                return c
        c += 1
    return nc


# ---------------------------------------------------------------------------------------------
# int8 rows: dequantization folded out of the products
# ---------------------------------------------------------------------------------------------
# An int8 element x dequantizes to (x + co[d] + to) * cs[d] * ts (channel pair (cs, co) of
# element d, token pair (ts, to) of the row, :func:`numerics.core.antiquant`). So, with q' = q * cs,
#     q . dequant(K row) = ts * (q' . x + q' . co + to * sum(q')),
# and, with weights w = p * ts,
#     sum over rows of p * dequant(V row) = cs * (sum of w * x + co * sum(w) + sum(w * to)):
# the products read the int8 values as they are, the query rows are scaled once per item, each
# score and weight once, and the accumulator rows once at the item's end. fold[.., r] holds
# row r's sums: FOLD_QCO = q' . co, FOLD_QSUM = sum(q'), FOLD_W = sum(w), FOLD_WTO =
# sum(w * to) (the last two rescaled with the accumulator rows).
FOLD_QCO, FOLD_QSUM, FOLD_W, FOLD_WTO = range(4)


@njit(**LEAF)
def fold_query(q2, R, cs, co, base, fold):
    """q2[r] *= the key channel scales cs[base:base + D], and row r's sums in fold, r < R."""
    wide_vectors()
    D = q2.shape[1]
    b0 = np.uint64(base)
    for r in range(R):
        qco = qsum = F32_ZERO
        for d in range(D):
            i = b0 + np.uint64(d)
            x = q2[r, d] * cs[i]
            q2[r, d] = x
            qco += x * co[i]
            qsum += x
        fold[FOLD_QCO, r], fold[FOLD_QSUM, r] = qco, qsum
        fold[FOLD_W, r] = fold[FOLD_WTO, r] = F32_ZERO


@njit(**LEAF)
def unfold_scores(s, lds, nrow, r0, rs, c0, nc, fold):
    """s[r * lds + c], the products of the folded query rows r0 + r with int8 K rows c0 + c, to
    scores of the dequantized rows (token pairs rs[KEY], rs[KEY + 1])."""
    wide_vectors()
    for r in range(nrow):
        qco, qsum = fold[FOLD_QCO, r0 + r], fold[FOLD_QSUM, r0 + r]
        for c in range(nc):
            at, j = np.uint64(r * lds + c), np.uint64(c0 + c)
            s[at] = rs[KEY, j] * (s[at] + qco + rs[KEY + 1, j] * qsum)


@njit(**LEAF)
def fold_weights(p, lds, nrow, r0, rs, c0, nc, alpha, fold):
    """p[r * lds + c] *= the token scale of V row c0 + c (a zero weight stays zero), and the
    weight sums of rows r0 + r, rescaled by alpha like the accumulator rows, gain the tile's."""
    wide_vectors()
    for r in range(nrow):
        a = alpha[r0 + r]
        wsum, wto = fold[FOLD_W, r0 + r], fold[FOLD_WTO, r0 + r]
        if a != F32_ONE:
            wsum, wto = wsum * a, wto * a
        for c in range(nc):
            at, j = np.uint64(r * lds + c), np.uint64(c0 + c)
            w = p[at] * rs[VALUE, j] if p[at] != F32_ZERO else F32_ZERO
            p[at] = w
            wsum += w
            wto += w * rs[VALUE + 1, j]
        fold[FOLD_W, r0 + r], fold[FOLD_WTO, r0 + r] = wsum, wto


@njit(**LEAF)
def unfold_values(acc, ld, R, D, cs, co, base, fold):
    """acc[r * ld:][:D], sums of weights times int8 V rows, to sums of the dequantized rows
    (value channel pair cs, co from element base), r < R."""
    wide_vectors()
    b0 = np.uint64(base)
    for r in range(R):
        wsum, wto = fold[FOLD_W, r], fold[FOLD_WTO, r]
        at = np.uint64(r * ld)
        for d in range(D):
            i = b0 + np.uint64(d)
            acc[at + np.uint64(d)] = cs[i] * (acc[at + np.uint64(d)] + co[i] * wsum + wto)
