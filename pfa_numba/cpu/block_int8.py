"""The int8 work item (SPEC 8): pass 1 finds each row's max score, pass 2 quantizes the weights
against it and accumulates P8 . V exactly."""
import numpy as np
from numba import njit, prange
from .._band import block_kv_range, row_band, tile_inside_band
from .._core import (CODE_F16, CODE_F32, F32_NEG_INF, F32_ONE, F32_POS_INF, F32_ZERO, f16_to_f32,
                     f32_as_u32, f32_to_f16, lse_value, max_nan, round_f16, round_half_even,
                     saturate_int8, u32_as_f32)
from .._geometry import (P_BLAS, P_COLS, P_D, P_FLAGS, P_G, P_IP, P_LSE, P_MASK, P_PSE, P_ROWS, T_K,
                         T_L, T_M, T_O, T_P, T_Q, T_V)
from ._blas import gemm_rm, scratch
from ._vector import take_next
from .items import _sizes
from .rows import _exp_row, _load_row, _mask_row, _row_max
from ._jit import FASTMATH, LEAF


# ---------------------------------------------------------------------------------------------
# int8 query/key/value (SPEC 8)
# ---------------------------------------------------------------------------------------------
# qp (float32): deq_scale1, fp16(scale_value), quant_scale1, deq_scale2
Q_DEQ1, Q_SCALE, Q_QS1, Q_DEQ2 = range(4)
#: P.V runs as a float32 GEMM, exact while every partial sum stays below 2^24:
#: 127 * 128 * 1024 < 2^24, so an int8 tile has at most this many kv columns.
INT8_MAX_KV_COLS = 1024


@njit(**LEAF)
def _int8_scores(srow, nc, deq1, scale16, pse, poff, psk, has_pse):
    """s = fp16(fp16(A * deq1) * fp16(scale)) (+ pse, rounded to fp16), A exact integers."""
    for c in range(nc):
        srow[c] = round_f16(round_f16(srow[c] * deq1) * scale16)
    if has_pse:
        for c in range(nc):
            srow[c] = round_f16(srow[c] + f16_to_f32(pse[poff + c * psk]))


@njit(fastmath=FASTMATH, cache=True)
def _f64_to_f16(x):
    """float64 -> float16 bits with one rounding (round to odd into float32, then to even)."""
    x32 = np.float32(x)
    if np.float64(x32) != x and x32 == x32 and abs(x32) != F32_POS_INF:
        u = f32_as_u32(x32)
        if abs(np.float64(x32)) > abs(x):
            u = u - np.uint32(1)          # truncate toward zero
        x32 = u32_as_f32(u | np.uint32(1))  # sticky bit: round to odd
    return f32_to_f16(x32)


@njit(fastmath=FASTMATH, cache=True)
def _block_int8(q, k, v, out, lse, flags, mask8, pse, strides, boff, lens, params, qp, b, g, i0,
                qb, sb, tb, acc, kb, vb, m, l, blas):
    """One work item of the int8 pipeline: pass 1 finds each row's max score, pass 2
    quantizes E = exp(s - m) against it and accumulates P8 . V exactly."""
    G = params[P_G]
    D = params[P_D]
    mask_kind = params[P_MASK]
    has_pse = params[P_PSE] != 0
    inner_precise = params[P_IP]
    want_lse = params[P_LSE] != 0
    want_flags = params[P_FLAGS] != 0
    rph = params[P_ROWS]
    tk = params[P_COLS]
    deq1, scale16, qs1, deq2 = qp[Q_DEQ1], qp[Q_SCALE], qp[Q_QS1], qp[Q_DEQ2]
    ql = lens[0, b]
    kl = lens[1, b]
    pre_e = lens[2, b]
    next_e = lens[3, b]
    i1 = min(i0 + rph, ql)
    nr = i1 - i0
    R = G * nr
    jstart, jend = block_kv_range(i0, i1, pre_e, next_e, kl)
    a2 = acc[:R * D].reshape(R, D)
    k_base = boff[T_K, b] + g * strides[T_K, 0]
    v_base = boff[T_V, b] + g * strides[T_V, 0]
    if jstart < jend:
        q2 = qb[:R * D].reshape(R, D)
        for rr in range(R):
            h = rr // nr
            off = boff[T_Q, b] + (g * G + h) * strides[T_Q, 0] + (i0 + rr - h * nr) * strides[T_Q, 1]
            _load_row(q2, rr, q, off, strides[T_Q, 2], D, CODE_F32, F32_ONE)
            m[rr] = F32_NEG_INF
            l[rr] = F32_ZERO
        a2[:, :] = 0.0
        for step in range(2):
            for j0 in range(jstart, jend, tk):
                j1 = min(j0 + tk, jend)
                nc = j1 - j0
                k2 = kb[:nc * D].reshape(nc, D)
                for c in range(nc):
                    _load_row(k2, c, k, k_base + (j0 + c) * strides[T_K, 1], strides[T_K, 2],
                              D, CODE_F32, F32_ONE)
                s2 = sb[:R * nc].reshape(R, nc)
                gemm_rm(blas, R, nc, D, qb, 0, D, True, kb, 0, D, sb, 0, nc,
                        F32_ZERO)
                inside = tile_inside_band(i0, i1, j0, j1, pre_e, next_e)
                for rr in range(R):
                    h = rr // nr
                    i = i0 + rr - h * nr
                    n = g * G + h
                    srow = s2[rr]
                    _int8_scores(srow, nc, deq1, scale16, pse,
                                 boff[T_P, b] + n * strides[T_P, 0] + i * strides[T_P, 1] + j0 * strides[T_P, 2],
                                 strides[T_P, 2], has_pse)
                    if mask_kind != 0 or not inside:
                        _mask_row(s2, rr, nc, j0, i, kl, pre_e, next_e, inside, mask8, mask8,
                                  boff[T_M, b] + i * strides[T_M, 1] + j0 * strides[T_M, 2],
                                  strides[T_M, 2], mask_kind, pse, 0, 0, False, CODE_F16)
                    if step == 0:
                        m[rr] = max_nan(m[rr], _row_max(s2, rr, nc, F32_ONE))
                        continue
                    mr = m[rr]
                    if mr == F32_NEG_INF:
                        srow[:] = F32_ZERO
                        continue
                    l[rr] += _exp_row(s2, rr, nc, mr, F32_ONE)
                    for c in range(nc):
                        srow[c] = saturate_int8(round_half_even(srow[c] * qs1))
                if step == 1:
                    v2 = vb[:nc * D].reshape(nc, D)
                    for c in range(nc):
                        _load_row(v2, c, v, v_base + (j0 + c) * strides[T_V, 1],
                                  strides[T_V, 2], D, CODE_F32, F32_ONE)
                    t2 = tb[:R * D].reshape(R, D)
                    gemm_rm(blas, R, D, nc, sb, 0, nc, False, vb, 0, D, tb, 0, D,
                            F32_ZERO)
                    for rr in range(R):
                        arow = a2[rr]
                        trow = t2[rr]
                        for d in range(D):
                            arow[d] += trow[d]

    for rr in range(R):
        h = rr // nr
        i = i0 + rr - h * nr
        n = g * G + h
        o_off = boff[T_O, b] + n * strides[T_O, 0] + i * strides[T_O, 1]
        osd = strides[T_O, 2]
        l_off = boff[T_L, b] + n * strides[T_L, 0] + i * strides[T_L, 1]
        mm = m[rr] if jstart < jend else F32_NEG_INF
        if mm != F32_NEG_INF:
            lr = np.float64(l[rr])
            arow = a2[rr]
            for d in range(D):
                out[o_off + d * osd] = _f64_to_f16(np.float64(deq2) * arow[d] / lr)
            if want_lse:
                lse[l_off] = lse_value(mm, l[rr])
            if want_flags:
                flags[l_off] = 1
        elif inner_precise < 2:
            # SPEC 5 for int8: every band score equal, E = 1 on the band
            lo, hi = row_band(i, pre_e, next_e, kl)
            if lo <= hi:
                p8 = np.float64(saturate_int8(round_half_even(qs1)))
                arow = a2[rr]
                arow[:] = 0.0
                for j in range(lo, hi + 1):
                    off = v_base + j * strides[T_V, 1]
                    for d in range(D):
                        arow[d] += np.float64(v[off + d * strides[T_V, 2]])
                cnt = np.float64(np.float32(hi - lo + 1))
                for d in range(D):
                    out[o_off + d * osd] = _f64_to_f16(np.float64(deq2) * (p8 * arow[d]) / cnt)
                if want_flags:
                    flags[l_off] = 1


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _attention_int8(q, k, v, out, lse, flags, mask8, pse, strides, boff, lens, work, params, qp):
    """The int8 kernel: same work items and scheduling as :func:`_attention`."""
    D, rows, tk, nthr, n_items = _sizes(params, work)
    taken = np.zeros(1, np.int64)
    for t in prange(nthr):
        qb = np.empty(rows * D, np.float32)
        sb = np.empty(rows * tk, np.float32)
        tb = np.empty(max(rows, 1) * D, np.float32)
        acc = np.empty(rows * D, np.float64)
        kb = np.empty(tk * D, np.float32)
        vb = np.empty(tk * D, np.float32)
        m = np.empty(rows, np.float32)
        l = np.empty(rows, np.float32)
        blas = scratch(params[P_BLAS])
        w = take_next(taken)
        while w < n_items:
            _block_int8(q, k, v, out, lse, flags, mask8, pse, strides, boff, lens, params, qp,
                        work[w, 0], work[w, 1], work[w, 2], qb, sb, tb, acc, kb, vb, m, l,
                        blas)
            w = take_next(taken)
