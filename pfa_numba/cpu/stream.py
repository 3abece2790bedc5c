"""The tile products of a work item with few rows (decode: the G query heads of one position):
each K and V row is read once from the cache and used by every row of the item at once,
instead of being packed into tiles that few rows would then read. Contiguous rows go four at
a time: scores as 4 x 4 register blocks (four K rows converted inside the product against four
query rows: sixteen vector accumulators, each K value loaded once for four rows), P V as four
V rows converted inside the product and added to four accumulator rows in one pass (each V
value loaded once for four rows, each accumulator value once for four V rows). Other rows go
one at a time through a row buffer, as do blocks holding a zero weight (a zero weight never
meets V).

``kv`` = (src, offs, sd, code): the rows' array, element offsets and element stride (see
:mod:`.kv`) and their storage code. int8 rows are read as their integer values: the caller folds
their dequantization into the query rows and the weights (see
:func:`.block_f32._block_stream`), so the products only convert.
"""
import numpy as np
from numba import njit

from .._core import CODE_BF16, CODE_F16, CODE_F32, F32_ONE, F32_ZERO, bf16_to_f32
from ._jit import LEAF, LEAF_INLINE
from ._vector import wide_vectors
from .kv import KEY, VALUE
from .rows import _PF_ROWS, _f16_to_f32, _load_row, _prefetch_row


@njit(**LEAF)
def _row(buf, t, kv, c, nc):
    """Row c of the tile's nc, as float32, into buf[t, :D]; the row _PF_ROWS on is prefetched
    (paged rows jump from block to block, where the hardware prefetcher starts over)."""
    src, offs, sd, code = kv
    D = buf.shape[1]
    if c + _PF_ROWS < nc:
        _prefetch_row(src, offs[c + _PF_ROWS], D * sd)
    _load_row(buf, t, src, offs[c], sd, D, code, F32_ONE)


#: the register blocks: 4 K / V rows against 4 query rows (16 float32 vector accumulators)
BLOCK = 4


@njit(**LEAF_INLINE)
def _at(src, i, code):
    """Element i of a K / V row as float32; the callers pass code as a constant, so each loop
    below compiles to one conversion."""
    if code == CODE_F16:
        return _f16_to_f32(src[i])
    if code == CODE_BF16:
        return bf16_to_f32(src[i])
    return np.float32(src[i])


@njit(**LEAF_INLINE)
def _scores_block(s, lds, sc, q2, r0, nr, kv, c, code):
    """s[r * lds + sc + t] = q2[r0 + r] . K[c + t] for t < 4, r < nr: K rows read once from
    the cache (converted in the product, no row buffer), four query rows at a time."""
    src, offs = kv[0], kv[1]
    D = q2.shape[1]
    o0, o1, o2, o3 = (np.uint64(offs[c]), np.uint64(offs[c + 1]), np.uint64(offs[c + 2]),
                      np.uint64(offs[c + 3]))
    r = 0
    while r < nr:
        q0, q1, q2_, q3 = r0 + r, r0 + min(r + 1, nr - 1), r0 + min(r + 2, nr - 1), \
            r0 + min(r + 3, nr - 1)                  # fewer than 4 left: repeat the last
        a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = F32_ZERO
        a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = F32_ZERO
        for d in range(D):
            i = np.uint64(d)
            k0 = _at(src, o0 + i, code)
            k1 = _at(src, o1 + i, code)
            k2 = _at(src, o2 + i, code)
            k3 = _at(src, o3 + i, code)
            x = q2[q0, d]
            a00 += x * k0
            a01 += x * k1
            a02 += x * k2
            a03 += x * k3
            x = q2[q1, d]
            a10 += x * k0
            a11 += x * k1
            a12 += x * k2
            a13 += x * k3
            x = q2[q2_, d]
            a20 += x * k0
            a21 += x * k1
            a22 += x * k2
            a23 += x * k3
            x = q2[q3, d]
            a30 += x * k0
            a31 += x * k1
            a32 += x * k2
            a33 += x * k3
        _put4(s, r * lds + sc, a00, a01, a02, a03)
        if r + 1 < nr:
            _put4(s, (r + 1) * lds + sc, a10, a11, a12, a13)
        if r + 2 < nr:
            _put4(s, (r + 2) * lds + sc, a20, a21, a22, a23)
        if r + 3 < nr:
            _put4(s, (r + 3) * lds + sc, a30, a31, a32, a33)
        r += BLOCK


@njit(**LEAF_INLINE)
def _put4(s, at, x0, x1, x2, x3):
    s[at] = x0
    s[at + 1] = x1
    s[at + 2] = x2
    s[at + 3] = x3


@njit(**LEAF_INLINE)
def _pv_block(acc, ld, nr, p, lds, pc, kv, c, D, code):
    """acc[r * ld:][:D] += sum over t < 4 of p[r * lds + pc + t] * V[c + t] for r < nr (every
    weight nonzero): four accumulator rows at a time take the four V rows in one pass over d,
    each V element converted once for the four (their sixteen weights held in registers)."""
    src, offs = kv[0], kv[1]
    o0, o1, o2, o3 = (np.uint64(offs[c]), np.uint64(offs[c + 1]), np.uint64(offs[c + 2]),
                      np.uint64(offs[c + 3]))
    r = 0
    while r + BLOCK <= nr:
        w00, w01, w02, w03 = _weights(p, r * lds + pc)
        w10, w11, w12, w13 = _weights(p, (r + 1) * lds + pc)
        w20, w21, w22, w23 = _weights(p, (r + 2) * lds + pc)
        w30, w31, w32, w33 = _weights(p, (r + 3) * lds + pc)
        a0, a1, a2, a3 = (np.uint64(r * ld), np.uint64((r + 1) * ld), np.uint64((r + 2) * ld),
                          np.uint64((r + 3) * ld))
        for d in range(D):
            i = np.uint64(d)
            v0, v1, v2, v3 = (_at(src, o0 + i, code), _at(src, o1 + i, code),
                              _at(src, o2 + i, code), _at(src, o3 + i, code))
            acc[a0 + i] += w00 * v0 + w01 * v1 + w02 * v2 + w03 * v3
            acc[a1 + i] += w10 * v0 + w11 * v1 + w12 * v2 + w13 * v3
            acc[a2 + i] += w20 * v0 + w21 * v1 + w22 * v2 + w23 * v3
            acc[a3 + i] += w30 * v0 + w31 * v1 + w32 * v2 + w33 * v3
        r += BLOCK
    while r < nr:
        w0, w1, w2, w3 = _weights(p, r * lds + pc)
        a0 = np.uint64(r * ld)
        for d in range(D):
            i = np.uint64(d)
            acc[a0 + i] += (w0 * _at(src, o0 + i, code) + w1 * _at(src, o1 + i, code)
                            + w2 * _at(src, o2 + i, code) + w3 * _at(src, o3 + i, code))
        r += 1


@njit(**LEAF_INLINE)
def _weights(p, at):
    return p[at], p[at + 1], p[at + 2], p[at + 3]


@njit(**LEAF_INLINE)
def _nonzero(p, lds, nr, c):
    """Whether the weights of columns c .. c + 3 are nonzero in every row."""
    for r in range(nr):
        for t in range(BLOCK):
            if p[r * lds + c + t] == F32_ZERO:
                return False
    return True


@njit(**LEAF_INLINE)
def _prefetch_block(kv, c, nc, D):
    """Prefetch the rows _PF_ROWS ahead of block c (paged rows jump from block to block, where
    the hardware prefetcher starts over)."""
    src, offs, sd = kv[0], kv[1], kv[2]
    for t in range(BLOCK):
        if c + _PF_ROWS + t < nc:
            _prefetch_row(src, offs[c + _PF_ROWS + t], D * sd)


@njit(**LEAF)
def stream_scores(s, lds, q2, r0, nrow, kv, c0, nc, buf):
    """s[r * lds + c] = q2[r0 + r] . K[c0 + c] for r < nrow, c < nc: blocks of 4 K rows
    against 4 query rows where the rows are contiguous, one row at a time otherwise."""
    wide_vectors()
    code = kv[3]
    D = buf.shape[1]
    c = 0
    if kv[2] == 1:
        while c + BLOCK <= nc:
            _prefetch_block(kv, c0 + c, c0 + nc, D)
            if code == CODE_F16:
                _scores_block(s, lds, c, q2, r0, nrow, kv, c0 + c, CODE_F16)
            elif code == CODE_BF16:
                _scores_block(s, lds, c, q2, r0, nrow, kv, c0 + c, CODE_BF16)
            else:
                _scores_block(s, lds, c, q2, r0, nrow, kv, c0 + c, CODE_F32)
            c += BLOCK
    while c < nc:
        _row(buf, 0, kv, c0 + c, c0 + nc)
        for r in range(nrow):
            acc = F32_ZERO
            for d in range(D):
                acc += q2[r0 + r, d] * buf[0, d]
            s[r * lds + c] = acc
        c += 1


@njit(**LEAF)
def stream_pv(acc, ld, nrow, p, lds, kv, c0, nc, buf):
    """acc[r * ld:][:D] += sum over c with p[r * lds + c] != 0 of p[r * lds + c] * V[c0 + c]
    (a zero weight never meets V: inf or NaN there reaches no row that dropped it): blocks of
    4 V rows where the rows are contiguous and every weight is nonzero, one row at a time
    otherwise."""
    wide_vectors()
    code = kv[3]
    D = buf.shape[1]
    c = 0
    while c < nc:
        if kv[2] == 1 and c + BLOCK <= nc and _nonzero(p, lds, nrow, c):
            _prefetch_block(kv, c0 + c, c0 + nc, D)
            if code == CODE_F16:
                _pv_block(acc, ld, nrow, p, lds, c, kv, c0 + c, D, CODE_F16)
            elif code == CODE_BF16:
                _pv_block(acc, ld, nrow, p, lds, c, kv, c0 + c, D, CODE_BF16)
            else:
                _pv_block(acc, ld, nrow, p, lds, c, kv, c0 + c, D, CODE_F32)
            c += BLOCK
            continue
        _row(buf, 0, kv, c0 + c, c0 + nc)
        for r in range(nrow):
            pv = p[r * lds + c]
            if pv != F32_ZERO:
                base = np.uint64(r * ld)
                for d in range(D):
                    acc[base + np.uint64(d)] += pv * buf[0, d]
        c += 1


# ---------------------------------------------------------------------------------------------
# int8 rows: dequantization folded out of the products
# ---------------------------------------------------------------------------------------------
# An int8 element x dequantizes to (x + co[d] + to) * cs[d] * ts (channel pair (cs, co) of
# element d, token pair (ts, to) of the row, :func:`.._core.antiquant`). So, with q' = q * cs,
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
