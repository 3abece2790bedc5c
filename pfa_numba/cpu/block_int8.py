"""The int8 kernel (contract 'Quantization'): int8 query, key and value, one work item at a time:
pass 1 finds each row's max score, pass 2 quantizes the weights against it and accumulates
P8 . V exactly, the products on BLAS sgemm."""
import numpy as np
from numba import njit
from ..numerics.band import ROW_MEAN, ROW_SOFTMAX, tile_inside_band
from ..numerics.core import (CODE_F16, CODE_F32, F32_NAN, F32_NEG_INF, F32_ONE, F32_ZERO,
                             int8_out_f16, int8_score, int8_score_pse, int8_weight, lse_value,
                             max_nan, softmax_weight)
from ..numerics.kernel_args import (F_DEQ1, F_DEQ2, F_QS1, F_SCALE16, P_COLS, P_D, P_DV,
                                    P_FLAGS, P_G, P_LSE, P_MASK, P_PSE, T_K, T_V)
from ._blas import gemm_rm
from ._jit import LEAF, LEAF_EXACT, LEAF_INLINE
from ._vector import take_next
from .items import W_B, W_G, W_I0, item_rows
from .rows import (band_of, element_offsets, load_query_rows, load_row, mask_row, row_end,
                   row_max)


# ---------------------------------------------------------------------------------------------
# int8 query/key/value (contract 'Quantization')
# ---------------------------------------------------------------------------------------------
#: P.V runs as a float32 GEMM, exact while every partial sum stays below 2^24:
#: 127 * 128 * 1024 < 2^24, so an int8 tile has at most this many kv columns.
INT8_MAX_KV_COLS = 1024


@njit(**LEAF)
def _int8_scores(s2, r, nc, deq1, scale16, pse, where, has_pse):
    """s2[r, :nc] (exact integer products) -> the scores of contract 'Quantization', pse added where
    there is one (where: see rows.element_offsets)."""
    srow = s2[r]
    for c in range(nc):
        srow[c] = int8_score(srow[c], deq1, scale16)
    if has_pse:
        poff, psk = where[2], where[3]
        for c in range(nc):
            srow[c] = int8_score_pse(srow[c], pse[poff + c * psk])


@njit(**LEAF_EXACT)     # the CUDA kernel's weights and sums, in order
def _int8_weights(s2, r, nc, m, qs1, l):
    """The row's scores s2[r, :nc] -> their quantized softmax weights against the row max m;
    returns the running sum l with each exp(s - m) added in column order, as the CUDA kernel
    adds them (the exp and the quantization loops vectorise; the sum stays in order)."""
    srow = s2[r]
    for c in range(nc):
        srow[c] = softmax_weight(srow[c], m, 0)
    for c in range(nc):
        l = l + srow[c]
    for c in range(nc):
        srow[c] = int8_weight(srow[c], qs1)
    return l


@njit(**LEAF_INLINE)
def _block_int8(ins, outs, extras, geo, fparams, item, bufs, state, blas):
    """One work item of the int8 pipeline (the records as in :mod:`.float_tiles`;
    bufs = (qb, sb, tb, acc, kb, vb), state = (m, l)): pass 1 finds each row's max score,
    pass 2 quantizes E = exp(s - m) against it and accumulates P8 . V exactly."""
    q, k, v = ins.q, ins.k, ins.v
    strides, boff, lens, params = geo.strides, geo.boff, geo.lens, geo.params
    b, g, i0 = item
    qb, sb, tb, acc, kb, vb = bufs
    m, l = state
    G = params[P_G]
    D, Dv = params[P_D], params[P_DV]
    mask_kind = params[P_MASK]
    has_pse = params[P_PSE] != 0
    tk = params[P_COLS]
    deq1, scale16, qs1 = fparams[F_DEQ1], fparams[F_SCALE16], fparams[F_QS1]
    band = band_of(lens, b)
    i1, R, jstart, jend = item_rows(params, lens, b, i0)
    a2 = acc[:R * Dv].reshape(R, Dv)
    k_base = boff[T_K, b] + g * strides[T_K, 0]
    v_base = boff[T_V, b] + g * strides[T_V, 0]
    if jstart < jend:
        load_query_rows(qb[:R * D].reshape(R, D), q, geo, item, CODE_F32, F32_ONE)
        m[:R] = F32_NEG_INF
        l[:R] = F32_ZERO
        a2[:, :] = 0.0
        for step in range(2):
            for j0 in range(jstart, jend, tk):
                j1 = min(j0 + tk, jend)
                nc = j1 - j0
                _load_rows(kb, k, geo, T_K, k_base, j0, nc, D)
                s2 = sb[:R * nc].reshape(R, nc)
                gemm_rm(blas, R, nc, D, qb, 0, D, True, kb, 0, D, sb, 0, nc, F32_ZERO)
                inside = tile_inside_band(i0, i1, j0, j1, band[1], band[2])
                for rr in range(R):
                    i = i0 + rr // G
                    where = element_offsets(geo, b, g * G + rr % G, i, j0)
                    _int8_scores(s2, rr, nc, deq1, scale16, extras[2], where, has_pse)
                    if mask_kind != 0 or not inside:
                        mask_row(s2, rr, nc, j0, i, band, inside, extras, where,
                                  (mask_kind, False, CODE_F16, F32_ONE))
                    if step == 0:
                        m[rr] = max_nan(m[rr], row_max(s2, rr, nc, F32_ONE))
                    elif m[rr] == F32_NEG_INF:
                        s2[rr, :] = F32_ZERO
                    else:
                        l[rr] = _int8_weights(s2, rr, nc, m[rr], qs1, l[rr])
                if step == 1:
                    _load_rows(vb, v, geo, T_V, v_base, j0, nc, Dv)
                    t2 = tb[:R * Dv].reshape(R, Dv)
                    gemm_rm(blas, R, Dv, nc, sb, 0, nc, False, vb, 0, Dv, tb, 0, Dv, F32_ZERO)
                    for rr in range(R):
                        arow = a2[rr]
                        trow = t2[rr]
                        for d in range(Dv):
                            arow[d] += trow[d]
    _finish_int8(outs, v, geo, fparams, item, i1, a2, state, jstart < jend)


@njit(**LEAF)
def _load_rows(dst, src, geo, t, base, j0, n_rows, D):
    """dst[r * D:][:D] = row j0 + r of the K or V head at ``base`` in src (tensor t of the
    geometry: T_K or T_V, rows of D values) as float32, r < n_rows (rows of int8 values)."""
    strides = geo.strides
    d2 = dst[:n_rows * D].reshape(n_rows, D)
    for r in range(n_rows):
        load_row(d2, r, src, base + (j0 + r) * strides[t, 1], strides[t, 2], D, CODE_F32,
                 F32_ONE)


@njit(**LEAF)
def _finish_int8(outs, v, geo, fparams, item, i1, a2, state, computed):
    """The int8 item's output rows: deq2 * A / l rounded once to float16 (A the exact sums
    P8 . V in a2, float64), softmax_lse, and the rows of contract 'Empty rows'."""
    out, lse, flags = outs
    strides, boff, params = geo.strides, geo.boff, geo.params
    b, g, i0 = item
    m, l = state
    D = params[P_DV]
    want_lse, want_flags = params[P_LSE] != 0, params[P_FLAGS] != 0
    qs1, deq2 = fparams[F_QS1], fparams[F_DEQ2]
    v_base = boff[T_V, b] + g * strides[T_V, 0]
    for rr in range(params[P_G] * (i1 - i0)):
        (_, o_off, osd, l_off), (outcome, lo, hi, divisor) = row_end(geo, item, rr, m, l,
                                                                     computed)
        arow = a2[rr]
        if outcome == ROW_SOFTMAX:
            lr = l[rr]
            for d in range(D):
                # arow holds exact integers, or NaN where a NaN weight reached the row
                ad = arow[d]
                if ad != ad:
                    out[o_off + d * osd] = int8_out_f16(0, deq2, F32_NAN)
                else:
                    out[o_off + d * osd] = int8_out_f16(np.int64(ad), deq2, lr)
            if want_lse:
                lse[l_off] = lse_value(m[rr], lr, 0)
            if want_flags:
                flags[l_off] = 1
        elif outcome == ROW_MEAN:
            # every band score equal: E = 1, P8 = int8_weight(1) on the band; A = P8 * sum of
            # V (exact), l = the count (exact in float32 up to 2^24); a NaN P8 (quant_scale1
            # NaN) makes the row NaN
            p8 = int8_weight(F32_ONE, qs1)
            arow[:] = 0.0
            for j in range(lo, hi + 1):
                off = v_base + j * strides[T_V, 1]
                for d in range(D):
                    arow[d] += np.float64(v[off + d * strides[T_V, 2]])
            cnt = divisor if p8 == p8 else F32_NAN
            w8 = np.int64(p8) if p8 == p8 else np.int64(0)
            for d in range(D):
                out[o_off + d * osd] = int8_out_f16(w8 * np.int64(arow[d]), deq2, cnt)
            if want_flags:
                flags[l_off] = 1


@njit(**LEAF)
def int8(t, args):
    """The int8 kernel's worker (thread t): each item it takes by :func:`_block_int8`."""
    ins, outs, extras, geo, tuning, items, scratch, parts = args[0]
    s = scratch
    bufs = (s.qb[t], s.sb[t], s.tb[t], s.acc[t], s.kb[t], s.vb[t])
    blas = (s.bi[t], s.bf[t], s.bc[t], tuning.blas)
    runs, work = items.runs, items.work
    x = take_next(items.taken)
    while x < runs.shape[0]:
        for w in range(runs[x, 0], runs[x, 1]):
            _block_int8(ins, outs, extras, geo, geo.fparams, (work[w, W_B], work[w, W_G],
                                                              work[w, W_I0]),
                        bufs, (s.m[t], s.l[t]), blas)
        x = take_next(items.taken)
