"""The band of contract 'The band': what each sparse_mode keeps, in one place.

Every row i of a batch with actual lengths (qL, kL) keeps the kv columns j with::

    0 <= j < kL   and   i - preE <= j <= i + nextE

and ``sparse_mode`` only decides the two edges (preE, nextE), per batch:

=========================  =======================  ===========================
sparse_mode                preE                     nextE
=========================  =======================  ===========================
0, no attn_mask            +inf                     +inf
0, with attn_mask          pre_tokens               next_tokens
1 (allMask)                +inf                     +inf
2 (leftUpCausal)           +inf                     0
3 (rightDownCausal)        +inf                     kL - qL
4 (band)                   pre_tokens - (kL - qL)   next_tokens + (kL - qL)
=========================  =======================  ===========================

pre/next tokens >= 2147483647 (:data:`TOKENS_INF`) are +inf. Modes 3 and 4 anchor the band at
the bottom-right corner of each batch's (qL, kL); modes 2-4 take the band from this table and
never read their (2048, 2048) attn_mask; modes 0 (with a mask) and 1 then drop the columns the
user mask discards.

Host side: :func:`band_edges` builds the per-batch edges for the kernels; :func:`shifted_edges`
and :func:`tokens_for_edges` give the tokens that keep the same band over a kv range of a split
problem. Kernel side (inlined into the CPU and CUDA kernels alike): :func:`row_band` (from
:func:`band_lo` and :func:`band_hi`), the tile tests :func:`block_kv_range` and
:func:`tile_inside_band`, and the rule of contract 'Empty rows' for a row that kept nothing,
:func:`fully_masked_band` and :func:`row_outcome`.
"""
import numpy as np

from .core import F32_NEG_INF, jit

#: pre/next tokens >= this value mean "no limit".
TOKENS_INF = 2147483647
#: The kernels' representation of an unlimited band side: far beyond any length, and adding
#: or subtracting a length never overflows int64.
BAND_INF = 1 << 62


def tokens_to_band(value):
    """pre/next tokens >= TOKENS_INF mean +inf (None here)."""
    return None if value >= TOKENS_INF else value


def reads_user_mask(sparse_mode, has_mask):
    """Whether the mode drops what a user attn_mask discards: 1, and 0 with a mask."""
    return sparse_mode == 1 or (sparse_mode == 0 and has_mask)


def band_edges(sparse_mode, has_mask, pre_tokens, next_tokens, qlen, klen):
    """Per-batch int64 (preE, nextE) of the table above; BAND_INF stands for +inf."""
    b = qlen.shape[0]
    inf = np.full(b, BAND_INF, dtype=np.int64)

    def tok(t):
        t = tokens_to_band(t)
        return BAND_INF if t is None else max(t, -BAND_INF)

    pre, nxt = tok(pre_tokens), tok(next_tokens)
    if sparse_mode == 0:
        if not has_mask:
            return inf, inf.copy()
        return np.full(b, pre, np.int64), np.full(b, nxt, np.int64)
    if sparse_mode == 1:
        return inf, inf.copy()
    if sparse_mode == 2:
        return inf, np.zeros(b, np.int64)
    shift = klen - qlen
    if sparse_mode == 3:
        return inf, shift
    # sparse_mode 4: the band anchored at the bottom-right corner of (qL, kL)
    pre_e = inf if pre == BAND_INF else pre - shift
    next_e = inf.copy() if nxt == BAND_INF else nxt + shift
    return np.asarray(pre_e, np.int64), np.asarray(next_e, np.int64)


def shifted_edges(pre_e, next_e, offset):
    """The edges of the same band with kv columns counted from ``offset`` (j' = j - offset):
    i - (preE + offset) <= j' <= i + (nextE - offset); unlimited edges stay unlimited."""
    return (pre_e if pre_e >= BAND_INF else pre_e + offset,
            next_e if next_e >= BAND_INF else next_e - offset)


def tokens_for_edges(pre_e, next_e, shift):
    """(pre_tokens, next_tokens) whose band has the edges (preE, nextE) where the mode anchors
    it at ``shift`` = kL - qL: the inverse of :func:`band_edges` for mode 4 (shift 0: mode 0
    with a mask). Unlimited edges give TOKENS_INF."""
    return (TOKENS_INF if pre_e >= BAND_INF else int(pre_e + shift),
            TOKENS_INF if next_e >= BAND_INF else int(next_e - shift))


# ---------------------------------------------------------------------------------------------
# the band predicate in the kernels
# ---------------------------------------------------------------------------------------------

@jit
def band_lo(i, pre_e):
    """First kv column kept by the band for query row ``i`` (before clipping to 0)."""
    return i - pre_e


@jit
def band_hi(i, next_e, kl):
    """Last kv column (inclusive) kept for row ``i``: ``min(i + nextE, kL - 1)``."""
    hi = i + next_e
    if hi > kl - 1:
        hi = kl - 1
    return hi


@jit
def row_band(i, pre_e, next_e, kl):
    """The kept column range [lo, hi] of row ``i``; empty when lo > hi."""
    lo = band_lo(i, pre_e)
    if lo < 0:
        lo = 0
    return lo, band_hi(i, next_e, kl)


#: what a finished row holds (:func:`row_outcome`)
ROW_ZERO, ROW_SOFTMAX, ROW_MEAN = 0, 1, 2


@jit
def row_outcome(active, m, l, inner_precise, i, pre_e, next_e, kl):
    """What query row i holds when it is finished, with running max m and sum l: ROW_ZERO for
    a row that is not active (i >= qL); ROW_SOFTMAX when it kept a score; else ROW_MEAN of V
    over its band or ROW_ZERO, by the rule of contract 'Empty rows' in :func:`fully_masked_band`.
    Returns (outcome, lo, hi, divisor): [lo, hi] the band of a ROW_MEAN row, and what the row's sums
    are divided by (l, or the band's column count)."""
    lo, hi = fully_masked_band(inner_precise, i, pre_e, next_e, kl)
    if not active:
        return ROW_ZERO, lo, hi, np.float32(1.0)
    if m != F32_NEG_INF:
        return ROW_SOFTMAX, lo, hi, np.float32(l)
    return (ROW_MEAN if lo <= hi else ROW_ZERO), lo, hi, np.float32(hi - lo + 1)


@jit
def fully_masked_band(inner_precise, i, pre_e, next_e, kl):
    """contract 'Empty rows', for a row that kept nothing: the band columns [lo, hi] whose V rows it
    averages. Empty (zeros) with inner_precise 2 or 3, and when the band itself is empty
    (rows of Ascend's fully masked band take the mean of V over it with 0 or 1)."""
    lo, hi = row_band(i, pre_e, next_e, kl)
    if inner_precise >= 2:
        return lo, lo - 1
    return lo, hi


@jit
def block_kv_range(i0, i1, pre_e, next_e, kl):
    """The kv columns [jstart, jend) that any row of [i0, i1) may keep; tiles outside them
    (wholly outside the band, or past kL) are never visited. (NumPy's maximum and minimum: its
    ``py_func`` takes arrays of blocks.)"""
    return np.maximum(i0 - pre_e, 0), np.minimum(i1 - 1 + next_e + 1, kl)


@jit
def tile_inside_band(i0, i1, j0, j1, pre_e, next_e):
    """True when every (row, column) of rows [i0, i1) x columns [j0, j1) is inside the band:
    such a tile needs no per-element band mask."""
    return (i1 - 1) - pre_e <= j0 and j1 - 1 <= i0 + next_e


@jit
def kv_tiles(i0, i1, kl, pre_e, next_e, width):
    """The kv tiles of a block of query rows [i0, i1): (jstart, jend) of
    :func:`block_kv_range`, the number of tiles of ``width`` columns from jstart (none for no
    rows), and their interior run [ta, tb) (:func:`interior_tiles`)."""
    jstart, jend = block_kv_range(i0, i1, pre_e, next_e, kl)
    ntiles = (jend - jstart + width - 1) // width if jend > jstart and i1 > i0 else 0
    ta, tb = interior_tiles(i0, i1, jstart, jend, width, pre_e, next_e)
    return jstart, jend, ntiles, ta, tb


@jit
def interior_tiles(i0, i1, jstart, jend, width, pre_e, next_e):
    """The tiles [ta, tb) of the columns [jstart, jend) cut in tiles of ``width`` (tile t:
    columns jstart + t * width ..) that are whole (they end at or before jend) and inside the
    band of every row of [i0, i1) (:func:`tile_inside_band`): a contiguous run, since a tile
    is inside when it starts at or after (i1 - 1) - pre_e and ends at or before i0 + next_e.
    The other tiles need the per-element band test; tb == ta when there is no such tile."""
    ntiles = (jend - jstart + width - 1) // width if jend > jstart else 0
    first = (i1 - 1) - pre_e - jstart                      # tile t needs t * width >= first
    last = min(i0 + next_e + 1, jend) - jstart             # and t * width + width <= last
    ta = min(ntiles, max(0, -(-first // width)))
    return ta, max(ta, min(ntiles, last // width))
