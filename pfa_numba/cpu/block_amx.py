"""bf16 and float16 work items on AMX: tile products in bf16 tile registers, the softmax of
``rows``; an item AMX could get wrong runs on the float32 block instead."""
import numpy as np
from numba import njit, prange
from ..numerics.core import CODE_F16, F32_NEG_INF, F32_ZERO
from ..numerics.kernel_args import F_SCALE, P_CODE, P_COLS, P_D, P_G, T_Q
from ._amx import BLOCK, gemm_bf16, padded, tile_config
from ._blas import scratch
from ._jit import FASTMATH
from ._vector import aligned_empty, take_next
from .amx_pack import (F16_EXP, SUBNORMAL_LIMIT, TINY_V_LIMIT, amx_pack_k, amx_pack_rows,
                       amx_pack_v, bf16_scan)
from .block_f32 import (add_pv_exact, block, f32_buffers, f32_widths, finish, no_f32_buffers,
                        row_state)
from .items import W_B, W_G, W_I0, W_JHI, W_JLO, item_rows, segment, sizes
from .kv import next_tile
from .records import AmxBuffers
from .rows import LAZY_V_LIMIT, rescale_rows, softmax_rows


@njit(fastmath=FASTMATH, cache=True)
def _block_amx(ins, outs, extras, geo, tuning, scales, item, bufs, tb, state):
    """One work item of a bf16 or float16 problem on AMX (the records as in
    :func:`~.block_f32.block`; bufs: :class:`.records.AmxBuffers`). Float16
    values enter as bf16 hi + lo parts (exact), kept in the second halves of qh, kt and vv, and
    each product sums three bf16 products (all but lo . lo). Returns False, having written nothing,
    when an input of the item could be flushed by AMX (see SUBNORMAL_LIMIT) or, for float16,
    is not finite. It walks the kv sequence of :mod:`.kv` (a shared prefix, own rows,
    paged blocks) but dequantizes nothing (dispatch sends int8 key / value to the float32
    kernel); (ro, rs) are its kv_tile_rows buffers."""
    q, k, v, kp, vp = ins.q, ins.k, ins.v, ins.kp, ins.vp
    strides, boff, lens, params = geo
    b, g, i0 = item
    cfg, qh, kt, vv, tmp, sb, pp, acc, ro, rs = bufs
    m, l, alpha = state
    G = params[P_G]
    D = params[P_D]
    tk = params[P_COLS]
    code = params[P_CODE]
    f16 = code == CODE_F16
    Dp = padded(D)
    # second operand parts (element offsets), -1: none
    q_lo = qh.size // 2 if f16 else -1
    k_lo = kt.size // 2 if f16 else -1
    v_lo = vv.size // 2 if f16 else -1
    i1, R, jstart, jend = item_rows(params, lens, b, i0)
    no_keys = np.empty(0, np.int32)            # the row maxima are taken in the softmax pass
    if jstart < jend:
        for h in range(G):       # head h: rows h, h + G, ... (position-major)
            if not amx_pack_rows(qh[h * Dp:], q_lo, G * Dp, q,
                                  boff[T_Q, b] + (g * G + h) * strides[T_Q, 0]
                                  + i0 * strides[T_Q, 1],
                                  strides[T_Q, 1], strides[T_Q, 2], i1 - i0, D, Dp, code):
                return False
        for rr in range(R):
            m[rr] = F32_NEG_INF
            l[rr] = F32_ZERO
        acc[:padded(R) * Dp] = F32_ZERO
        j0 = jstart
        while j0 < jend:
            j1, nc, prefix, sdk, sdv = next_tile(ins, geo, b, g, j0, tk, jend, ro, rs)
            ncp = padded(nc)
            ex = max(amx_pack_k(kt, k_lo, kp if prefix else k, ro[0], sdk, nc, ncp, D, Dp,
                                 tmp, code),
                     amx_pack_v(vv, v_lo, vp if prefix else v, ro[1], sdv, nc, ncp, D, Dp,
                                 code))
            if f16:
                if ex == F16_EXP:
                    return False
                v_finite = lazy = True
            else:
                key_k, _ = bf16_scan(kt, ncp * Dp)
                key_v, ex = bf16_scan(vv, ncp * Dp)
                if key_k < SUBNORMAL_LIMIT or key_v < TINY_V_LIMIT:
                    return False
                v_finite = ex != np.uint32(0x7F80)
                lazy = ex < LAZY_V_LIMIT
            r0 = 0
            while r0 < R:
                r1, cl, ch, inside = segment(params, tuning, lens, b, i0, i1, j0, j1, r0, R,
                                             BLOCK)
                ns = ch - cl
                if ns > 0:
                    nrow = r1 - r0
                    nrp = padded(nrow)
                    nsp = padded(ns)
                    c0 = cl - j0
                    # S = Q K^T on AMX, scaled in the softmax pass
                    gemm_bf16(cfg, qh[r0 * Dp:], q_lo, Dp, kt[2 * c0:], k_lo, 2 * ncp, sb, nsp,
                              nrp, nsp, Dp, False)
                    s2 = sb[:nrp * nsp].reshape(nrp, nsp)
                    p3 = pp[:2 * nrp * nsp].reshape(nrp, 2, nsp)
                    softmax_rows(s2, p3, no_keys, (r0, r1, ns, cl, inside, v_finite, lazy), item,
                                  extras, geo, state, scales[F_SCALE])
                    rescale_rows(acc[r0 * Dp:], Dp, nrow, D, alpha[r0:])
                    if v_finite:
                        # P as bf16 hi and lo parts, interleaved per row: lda 2 nsp, lo at + nsp
                        gemm_bf16(cfg, pp, nsp, 2 * nsp, vv[c0 * Dp:], v_lo, 2 * Dp,
                                  acc[r0 * Dp:], Dp, nrp, Dp, nsp, True)
                    else:
                        add_pv_exact(acc[r0 * Dp:], Dp, nrow, D, sb, nsp, ns, vv[c0 * Dp:],
                                     2 * Dp, 2)
                r0 = r1
            j0 = j1
    finish(outs, ins, geo, item, i1, acc, Dp, state, tb, jstart < jend)
    return True


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def attention_amx(ins, outs, extras, geo, tuning, work, scales):
    """:func:`~.block_f32.attention` for bf16 and float16 storage on AMX; a work item AMX
    could get wrong (see :func:`_block_amx`) is computed by :func:`~.block_f32.block`
    instead."""
    params = geo.params
    D, rows, tk, nthr, n_items = sizes(params, tuning, work)
    Rp = padded(rows)
    Cp = padded(tk)
    Dp = padded(D)
    parts = 2 if params[P_CODE] == CODE_F16 else 1      # float16: bf16 hi and lo parts
    taken = np.zeros(1, np.int64)
    for t in prange(nthr):
        tb = aligned_empty(16 * D, np.float32)   # also pack_kt's 16 rows (fallback)
        bufs = AmxBuffers(tile_config(), aligned_empty(parts * Rp * Dp, np.uint16),
                          aligned_empty(parts * Cp * Dp, np.uint16),
                          aligned_empty(parts * Cp * Dp, np.uint16),
                          aligned_empty(16 * Dp, np.uint32), aligned_empty(Rp * Cp, np.float32),
                          aligned_empty(2 * Rp * Cp, np.uint16),
                          aligned_empty(Rp * Dp, np.float32),
                          aligned_empty(3 * tk, np.int64).reshape(3, tk),
                          aligned_empty(4 * tk, np.float32).reshape(4, tk))
        state = row_state(rows)
        fallback = no_f32_buffers(tb)
        blas = scratch(tuning.blas)
        w = take_next(taken)
        while w < n_items:
            item = (work[w, W_B], work[w, W_G], work[w, W_I0])
            if not _block_amx(ins, outs, extras, geo, tuning, scales, item, bufs, tb, state):
                if fallback.qb.size == 0:
                    fallback = f32_buffers(params, tuning.gemm, tb)
                i1, computed = block(ins, extras, geo, tuning, scales, item,
                                     (work[w, W_JLO], work[w, W_JHI]), fallback, state, blas)
                finish(outs, ins, geo, item, i1, fallback.acc,
                       f32_widths(params, tuning.gemm)[0], state, tb, computed)
            w = take_next(taken)
