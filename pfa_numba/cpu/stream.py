"""The tile products of a work item with few rows (decode: the G query heads of one position):
each K and V row is read once from the cache, converted (or dequantized) into one row buffer
and used by every row of the item at once, instead of being packed into tiles that few rows
would then read.

``kv`` = (src, offs, sd, code, dequant, cs, co, base, rs, which): the rows' array, element
offsets and element stride (see :mod:`.kv`), their storage code, and the dequantization of int8
rows (channel scales and offsets from element ``base``, token scalars rs[which], rs[which + 1]).
"""
import numpy as np
from numba import njit

from .._core import F32_ONE, F32_ZERO
from ._jit import LEAF
from ._vector import wide_vectors
from .kv import load_dequant_row
from .rows import _PF_ROWS, _load_row, _prefetch_row


@njit(**LEAF)
def _row(buf, kv, c, nc):
    """Row c of the tile's nc, as float32, into buf[0, :D]; the row _PF_ROWS on is prefetched
    (paged rows jump from block to block, where the hardware prefetcher starts over)."""
    src, offs, sd, code, dequant, cs, co, base, rs, which = kv
    D = buf.shape[1]
    if c + _PF_ROWS < nc:
        _prefetch_row(src, offs[c + _PF_ROWS], D * sd)
    if dequant:
        load_dequant_row(buf, 0, src, offs[c], sd, D, cs, co, base, rs[which, c],
                         rs[which + 1, c])
    else:
        _load_row(buf, 0, src, offs[c], sd, D, code, F32_ONE)


@njit(**LEAF)
def stream_scores(s, lds, q2, r0, nrow, kv, c0, nc, buf):
    """s[r * lds + c] = q2[r0 + r] . K[c0 + c] for r < nrow, c < nc."""
    wide_vectors()
    D = buf.shape[1]
    for c in range(nc):
        _row(buf, kv, c0 + c, c0 + nc)
        for r in range(nrow):
            acc = F32_ZERO
            for d in range(D):
                acc += q2[r0 + r, d] * buf[0, d]
            s[r * lds + c] = acc


@njit(**LEAF)
def stream_pv(acc, ld, nrow, p, lds, kv, c0, nc, buf):
    """acc[r * ld:][:D] += sum over c with p[r * lds + c] != 0 of p[r * lds + c] * V[c0 + c]
    (a zero weight never meets V: inf or NaN there reaches no row that dropped it)."""
    wide_vectors()
    D = buf.shape[1]
    for c in range(nc):
        _row(buf, kv, c0 + c, c0 + nc)
        for r in range(nrow):
            pv = p[r * lds + c]
            if pv != F32_ZERO:
                base = np.uint64(r * ld)
                for d in range(D):
                    acc[base + np.uint64(d)] += pv * buf[0, d]
