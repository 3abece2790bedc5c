"""The tile loop every float kernel of the CPU shares, made for each kernel's products; the start
and the finish of a work item's rows.

The float32 tiles (register blocks or BLAS), the AMX kernel and the streaming decode kernel
differ only in their products: how a kv tile is loaded, how S = Q K^T is formed and how
acc += P V is added. The rest is one rule, here: the row segments of a tile (a band cuts
them, :func:`.items.segment`), the masked online-softmax step (:func:`.rows.softmax_rows`) and
the rescale of the running sums; the finish is :func:`finish` for all of them.

:func:`tile_loop` makes a kernel's loop of its products: LEAF_INLINE functions, so that the loop,
its products and the kernel's worker are one compiled unit (products resolved any later, by
type or as run-time values, would each be a unit of its own, which every caller recompiles, or
a value Numba's cache cannot store). What the products take and give:

* ``load_tile(kernel, ins, item, cols, prefix, sdk, sdv)`` -> (ok, tile): the K and V rows of
  the tile of cols = (j0, nc) columns (their places in ``kernel``'s buffers, from
  :func:`.kv.next_tile`); ``tile``: what the products need to know of it; ok False: this
  kernel cannot take the tile exactly (the caller falls back to another, nothing written);
* ``scores(kernel, tile, seg)`` -> (s2, p3, keys, split, lazy, scale): the segment's scores
  and the other arguments of :func:`.rows.softmax_rows`;
* ``weighted_sum(kernel, tile, seg, s2, acc, ld, state)``: acc (the segment's first row) +=
  P V.

``kernel``: the record of what the products read (:mod:`.records`); seg = (r0, r1, c0, ns,
inside): rows [r0, r1) of the item over the ns columns from tile column c0, ``inside`` the band.
"""
import numpy as np
from numba import njit

from ..numerics.band import ROW_MEAN, ROW_SOFTMAX
from ..numerics.core import (CODE_BF16, CODE_F32, F32_NEG_INF, F32_ONE, F32_ZERO, antiquant,
                             row_total, sink_of, store, widen)
from ..numerics.kernel_args import (F_SCALE, F_SCALE2, P_CODE, P_COLS, P_D, P_DEQUANT, P_DV,
                                    P_FLAGS, P_G, P_KVCODE, P_LSE, P_OCODE, P_SCALE_EXP)
from ._jit import LEAF, LEAF_INLINE
from ._vector import take_next, wide_vectors
from .items import W_B, W_G, W_I0, W_SLOT, item_rows, segment
from .kv import VALUE, kv_value_row, next_tile
from .records import RowState
from .rows import load_query_rows, rescale_rows, row_end, scale_row, softmax_rows, store_row
from .split_kv import G_B, G_G, G_I0, G_PIECES, G_SLOT, keep_piece, merge_rows

def tile_loop(load_tile, scores, weighted_sum):
    """(tile_step, walk_tiles) of the kernel whose products these are (LEAF_INLINE functions;
    load_tile None for a kernel that walks its tiles itself)."""

    @njit(**LEAF_INLINE)
    def tile_step(kernel, tile, item, rows, align, extras, geo, tuning, state, acc, ld):
        """One kv tile [j0, j1) of an item (rows = (i1, R, j0, j1), see
        :func:`.items.item_rows`; ``tile``: what load_tile gave), segment by segment
        (``align``: the products' column granularity): S by the scores product, the masked
        online-softmax step, acc *= alpha, acc += P V by the weighted_sum product (acc: rows
        of ld values)."""
        b, _, i0 = item
        i1, R, j0, j1 = rows
        params = geo.params
        r0 = np.int64(0)         # not the literal 0: a call typed with it would compile again
        while r0 < R:
            r1, cl, ch, inside = segment(params, tuning, geo.lens, b, i0, i1, j0, j1, r0, R,
                                         align)
            if ch > cl:
                seg = (r0, r1, cl - j0, ch - cl, inside)
                s2, p3, keys, split, lazy, scale = scores(kernel, tile, seg)
                softmax_rows(s2, p3, keys, (r0, r1, ch - cl, cl, inside, split, lazy), item,
                             extras, geo, state, scale)
                rescale_rows(acc[r0 * ld:], ld, r1 - r0, params[P_DV], state.alpha[r0:])
                weighted_sum(kernel, tile, seg, s2, acc[r0 * ld:], ld, state)
            r0 = r1

    @njit(**LEAF_INLINE)
    def walk_tiles(kernel, ins, item, rows, align, extras, geo, tuning, state, acc, ld, places):
        """Every kv tile of an item's rows = (i1, R, jstart, jend) in the kv sequence of
        :mod:`.kv` (places = (ro, rs): next_tile's row buffers), loaded by the load_tile
        product and taken by tile_step. Returns False as soon as a load refuses its tile."""
        b, g, _ = item
        i1, R, jstart, jend = rows
        ro, rs = places
        j0 = jstart
        while j0 < jend:
            j1, nc, prefix, sdk, sdv = next_tile(ins, geo, b, g, j0, geo.params[P_COLS], jend,
                                                 ro, rs)
            ok, tile = load_tile(kernel, ins, item, (j0, nc), prefix, sdk, sdv)
            if not ok:
                return False
            tile_step(kernel, tile, item, (i1, R, j0, j1), align, extras, geo, tuning, state,
                      acc, ld)
            j0 = j1
        return True

    return tile_step, walk_tiles


@njit(**LEAF)
def start_rows(q, geo, item, R, qb, acc, state):
    """Load the item's R query rows into qb (scaled), and zero its sums and running state."""
    params, scales = geo.params, geo.fparams
    D = params[P_D]
    q2 = qb[:R * D].reshape(R, D)
    load_query_rows(q2, q, geo, item, params[P_CODE], scales[F_SCALE])
    if scales[F_SCALE2] != F32_ONE:      # a scale_value below float32's range
        for rr in range(R):
            scale_row(q2, rr, D, scales[F_SCALE2])
    state.m[:R] = F32_NEG_INF
    state.l[:R] = F32_ZERO
    acc[:] = F32_ZERO


@njit(**LEAF)
def add_pv_exact(acc, ld, R, D, p, ldp, nc, vb, ldv, pair):
    """acc[rr] += sum over the columns c with p[rr, c] != 0 of p[rr, c] * V[c] (V holding inf
    or NaN: BLAS would turn 0 * inf into NaN for rows that do not read that column).
    V[c, d] is vb[(c // pair) * ldv + d * pair + c % pair] (pair 1: row-major; 2: VNNI bf16)."""
    wide_vectors()
    for rr in range(R):
        arow = acc[rr * ld:rr * ld + D]
        for c in range(nc):
            pv = p[rr * ldp + c]
            if pv != F32_ZERO:
                base = (c // pair) * ldv + c % pair
                for d in range(D):
                    arow[d] += pv * widen(vb[base + d * pair], CODE_BF16 if pair == 2 else CODE_F32)


@njit(**LEAF)
def finish(outs, ins, extras, geo, item, i1, acc, ld, state, tb, computed):
    """Deferred division, rounding to the output storage and softmax_lse of one work item
    (acc row rr at acc[rr * ld:]); the query heads' sink logits (extras.sinks) join the
    denominators; rows with nothing kept follow contract 'Empty rows'."""
    out, lse, flags = outs
    params = geo.params
    m, l, _ = state
    Dv, ocode = params[P_DV], params[P_OCODE]
    want_lse, want_flags = params[P_LSE] != 0, params[P_FLAGS] != 0
    sinks, post_e = extras.sinks, params[P_SCALE_EXP]
    for rr in range(params[P_G] * (i1 - item[2])):
        (n, o_off, osd, l_off), (outcome, lo, hi, divisor) = row_end(geo, item, rr, m, l,
                                                                     computed)
        if outcome == ROW_SOFTMAX:
            total, row_lse = row_total(m[rr], l[rr], sink_of(sinks, n), post_e)
            store_row(out, o_off, osd, acc, rr * ld, total, Dv, ocode)
            if want_lse:
                lse[l_off] = row_lse
            if want_flags:
                flags[l_off] = 1
        elif outcome == ROW_MEAN:
            _mean_row(out, ins, geo, item, (o_off, osd), (lo, hi, divisor), tb)
            if want_flags:
                flags[l_off] = 1


@njit(**LEAF_INLINE)
def _mean_row(out, ins, geo, item, place, band, tb):
    """Contract 'Empty rows': the mean of the V rows of the band [lo, hi] (dequantized where
    int8), rounded to the output storage at place = (offset, element stride)."""
    params, channel = geo.params, ins.channel
    b, g, _ = item
    lo, hi, divisor = band
    Dv, code = params[P_DV], params[P_KVCODE]
    trow = tb[:Dv]
    trow[:] = F32_ZERO
    for j in range(lo, hi + 1):
        prefix, off, sd, scale, offset = kv_value_row(ins, geo, b, g, j)
        vs = ins.vp if prefix else ins.v
        for d in range(Dv):
            x = widen(vs[off + d * sd], code)
            if params[P_DEQUANT] != 0:
                x = antiquant(x, channel[VALUE, g * Dv + d], channel[VALUE + 1, g * Dv + d],
                              scale, offset)
            trow[d] += x
    for d in range(Dv):
        store(out, place[0] + d * place[1], trow[d] / divisor, params[P_OCODE])


@njit(**LEAF_INLINE)
def done(outs, ins, extras, geo, parts, row, i1, acc, ld, state, tb, computed):
    """A computed work item (``row`` of the work array): finished, or its piece kept
    (split-kv)."""
    item = (row[W_B], row[W_G], row[W_I0])
    if row[W_SLOT] < 0:
        finish(outs, ins, extras, geo, item, i1, acc, ld, state, tb, computed)
    else:
        keep_piece(parts, row[W_SLOT], acc, ld, state, geo.params[P_G] * (i1 - item[2]),
                   computed)


@njit(**LEAF_INLINE)
def row_state(m, l, alpha, t):
    """Thread t's RowState, from the rows of a scratch record's state arrays."""
    return RowState(m[t], l[t], alpha[t])


@njit(**LEAF)
def merge(t, args):
    """split-kv's merge worker (thread t): the groups of pieces it takes (items.work: rows of
    split_kv's G_* columns) merged into whole items (:func:`.split_kv.merge_rows`) and
    finished as :func:`finish` finishes a whole item."""
    ins, outs, extras, geo, tuning, items, scratch, parts = args[0]
    params, groups, ld = geo.params, items.work, tuning.ld
    acc, tb = scratch.acc[t], scratch.tb[t]
    state = RowState(scratch.m[t], scratch.l[t], scratch.alpha[t])
    x = take_next(items.taken)
    while x < groups.shape[0]:
        b, g, i0 = groups[x, G_B], groups[x, G_G], groups[x, G_I0]
        i1, R, _, _ = item_rows(params, geo.lens, b, i0)
        merge_rows(parts, groups[x, G_SLOT], groups[x, G_PIECES], R, params[P_DV], ld, acc,
                   state, params[P_SCALE_EXP])
        finish(outs, ins, extras, geo, (b, g, i0), i1, acc, ld, state, tb, True)
        x = take_next(items.taken)
