"""The tile products of a work item with few rows (decode: the G query heads of one position):
each K and V row is read once from the cache and used by every row of the item at once,
instead of being packed into tiles that few rows would then read. Contiguous rows go four at
a time: scores as 4 x 4 register blocks (four K rows converted inside the product against four
query rows: sixteen vector accumulators, each K value loaded once for four rows), P V as four
V rows converted into a row buffer and added to each accumulator row in one pass (a quarter
of the accumulator traffic of one row at a time). Other rows go one at a time through the row
buffer, as do blocks holding a zero weight (a zero weight never meets V).

``kv`` = (src, offs, sd, code, dequant, cs, co, base, rs, which): the rows' array, element
offsets and element stride (see :mod:`.kv`), their storage code, and the dequantization of int8
rows (channel scales and offsets from element ``base``, token scalars rs[which], rs[which + 1]).
"""
import numpy as np
from numba import njit

from .._core import CODE_BF16, CODE_F16, CODE_F32, F32_ONE, F32_ZERO, antiquant, bf16_to_f32
from ._jit import LEAF
from ._vector import wide_vectors
from .kv import load_dequant_row
from .rows import _PF_ROWS, _f16_to_f32, _load_row, _prefetch_row


@njit(**LEAF)
def _row(buf, t, kv, c, nc):
    """Row c of the tile's nc, as float32, into buf[t, :D]; the row _PF_ROWS on is prefetched
    (paged rows jump from block to block, where the hardware prefetcher starts over)."""
    src, offs, sd, code, dequant, cs, co, base, rs, which = kv
    D = buf.shape[1]
    if c + _PF_ROWS < nc:
        _prefetch_row(src, offs[c + _PF_ROWS], D * sd)
    if dequant:
        load_dequant_row(buf, t, src, offs[c], sd, D, cs, co, base, rs[which, c],
                         rs[which + 1, c])
    else:
        _load_row(buf, t, src, offs[c], sd, D, code, F32_ONE)


#: the register blocks: 4 K / V rows against 4 query rows (16 float32 vector accumulators)
BLOCK = 4
_INLINE = dict(LEAF, inline="always")


@njit(**_INLINE)
def _at(src, i, code, dequant, cs, co, ch, scale, offset):
    """Element i of a K / V row as float32 (int8 dequantized with channel ch's pair and the
    row's token pair); the callers pass code and dequant as constants, so each loop below
    compiles to one conversion."""
    if code == CODE_F16:
        x = _f16_to_f32(src[i])
    elif code == CODE_BF16:
        x = bf16_to_f32(src[i])
    else:
        x = np.float32(src[i])
    if dequant:
        x = antiquant(x, cs[ch], co[ch], scale, offset)
    return x


@njit(**_INLINE)
def _scores_block(s, lds, sc, q2, r0, nr, kv, c, code, dequant):
    """s[r * lds + sc + t] = q2[r0 + r] . K[c + t] for t < 4, r < nr: K rows read once from
    the cache (converted in the product, no row buffer), four query rows at a time."""
    src, offs, _, _, _, cs, co, base, rs, which = kv
    D = q2.shape[1]
    o0, o1, o2, o3 = (np.uint64(offs[c]), np.uint64(offs[c + 1]), np.uint64(offs[c + 2]),
                      np.uint64(offs[c + 3]))
    s0, s1, s2, s3 = rs[which, c], rs[which, c + 1], rs[which, c + 2], rs[which, c + 3]
    f0, f1, f2, f3 = (rs[which + 1, c], rs[which + 1, c + 1], rs[which + 1, c + 2],
                      rs[which + 1, c + 3])
    b0 = np.uint64(base)
    r = 0
    while r < nr:
        q0, q1, q2_, q3 = r0 + r, r0 + min(r + 1, nr - 1), r0 + min(r + 2, nr - 1), \
            r0 + min(r + 3, nr - 1)                  # fewer than 4 left: repeat the last
        a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = F32_ZERO
        a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = F32_ZERO
        for d in range(D):
            i = np.uint64(d)
            k0 = _at(src, o0 + i, code, dequant, cs, co, b0 + i, s0, f0)
            k1 = _at(src, o1 + i, code, dequant, cs, co, b0 + i, s1, f1)
            k2 = _at(src, o2 + i, code, dequant, cs, co, b0 + i, s2, f2)
            k3 = _at(src, o3 + i, code, dequant, cs, co, b0 + i, s3, f3)
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


@njit(**_INLINE)
def _put4(s, at, x0, x1, x2, x3):
    s[at] = x0
    s[at + 1] = x1
    s[at + 2] = x2
    s[at + 3] = x3


@njit(**_INLINE)
def _pv_block(acc, ld, nr, p, lds, pc, kv, c, buf, code, dequant):
    """acc[r * ld:][:D] += sum over t < 4 of p[r * lds + pc + t] * V[c + t] for r < nr (every
    weight nonzero): the four V rows converted once into buf[:4], then one pass over each
    accumulator row (no calls: each row's conversion is one loop of ``code``)."""
    src, offs, _, _, _, cs, co, base, rs, which = kv
    D = buf.shape[1]
    b0 = np.uint64(base)
    for t in range(BLOCK):
        o, scale, offset = np.uint64(offs[c + t]), rs[which, c + t], rs[which + 1, c + t]
        for d in range(D):
            i = np.uint64(d)
            buf[t, d] = _at(src, o + i, code, dequant, cs, co, b0 + i, scale, offset)
    for r in range(nr):
        p0, p1, p2, p3 = _weights(p, r * lds + pc)
        at = np.uint64(r * ld)
        for d in range(D):
            acc[at + np.uint64(d)] += (p0 * buf[0, d] + p1 * buf[1, d] + p2 * buf[2, d]
                                       + p3 * buf[3, d])


@njit(**_INLINE)
def _weights(p, at):
    return p[at], p[at + 1], p[at + 2], p[at + 3]


@njit(**_INLINE)
def _nonzero(p, lds, nr, c):
    """Whether the weights of columns c .. c + 3 are nonzero in every row."""
    for r in range(nr):
        for t in range(BLOCK):
            if p[r * lds + c + t] == F32_ZERO:
                return False
    return True


@njit(**_INLINE)
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
    code, dequant = kv[3], kv[4]
    D = buf.shape[1]
    c = 0
    if kv[2] == 1:
        while c + BLOCK <= nc:
            _prefetch_block(kv, c0 + c, c0 + nc, D)
            if dequant:
                _scores_block(s, lds, c, q2, r0, nrow, kv, c0 + c, CODE_F32, True)
            elif code == CODE_F16:
                _scores_block(s, lds, c, q2, r0, nrow, kv, c0 + c, CODE_F16, False)
            elif code == CODE_BF16:
                _scores_block(s, lds, c, q2, r0, nrow, kv, c0 + c, CODE_BF16, False)
            else:
                _scores_block(s, lds, c, q2, r0, nrow, kv, c0 + c, CODE_F32, False)
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
    code, dequant = kv[3], kv[4]
    D = buf.shape[1]
    c = 0
    while c < nc:
        if kv[2] == 1 and c + BLOCK <= nc and _nonzero(p, lds, nrow, c):
            _prefetch_block(kv, c0 + c, c0 + nc, D)
            if dequant:
                _pv_block(acc, ld, nrow, p, lds, c, kv, c0 + c, buf, CODE_F32, True)
            elif code == CODE_F16:
                _pv_block(acc, ld, nrow, p, lds, c, kv, c0 + c, buf, CODE_F16, False)
            elif code == CODE_BF16:
                _pv_block(acc, ld, nrow, p, lds, c, kv, c0 + c, buf, CODE_BF16, False)
            else:
                _pv_block(acc, ld, nrow, p, lds, c, kv, c0 + c, buf, CODE_F32, False)
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
