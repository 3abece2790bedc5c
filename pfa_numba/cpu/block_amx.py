"""bf16 and float16 work items on AMX: tile products in bf16 tile registers, the softmax of
``rows``; an item AMX could get wrong runs on the float32 block instead."""
import numpy as np
from numba import njit, prange
from ..numerics.core import CODE_F16, F32_NEG_INF, F32_ZERO
from ..numerics.kernel_args import F_SCALE, P_CODE, P_D, P_G, T_Q
from ._amx import BLOCK, gemm_bf16, padded, tile_config
from ._jit import FASTMATH, LEAF
from ._vector import aligned_empty, take_next
from .amx_pack import (F16_EXP, SUBNORMAL_LIMIT, TINY_V_LIMIT, amx_pack_k, amx_pack_rows,
                       amx_pack_v, bf16_scan)
from .block_f32 import (add_pv_exact, block, f32_buffers, f32_widths, finish, no_f32_buffers,
                        thread_state)
from .items import W_B, W_G, W_I0, W_JHI, W_JLO, item_rows, sizes
from .records import AmxBuffers, AmxProducts
from .rows import LAZY_V_LIMIT
from .tile import products, walk_tiles


@njit(fastmath=FASTMATH, cache=True)
def _block_amx(ins, outs, extras, geo, tuning, scales, item, bufs, tb, state):
    """One work item of a bf16 or float16 problem on AMX (the records as in
    :func:`~.block_f32.block`; bufs: :class:`.records.AmxBuffers`), through the tile loop of
    :mod:`.tile` with AMX products. Float16 values enter as bf16 hi + lo parts (exact), kept
    in the second halves of qh, kt and vv, and each product sums three bf16 products (all but
    lo . lo). Returns False, having written nothing, when an input of the item could be
    flushed by AMX (see SUBNORMAL_LIMIT) or, for float16, is not finite. It walks the kv
    sequence of :mod:`.kv` (a shared prefix, own rows, paged blocks) but dequantizes nothing
    (dispatch sends int8 key / value to the float32 kernel)."""
    params = geo.params
    b, g, i0 = item
    D = params[P_D]
    Dp = padded(D)
    f16 = params[P_CODE] == CODE_F16
    qh, kt, vv = bufs.qh, bufs.kt, bufs.vv
    # second operand parts (element offsets), -1: none
    kernel = AmxProducts(bufs, D, Dp, params[P_CODE], scales[F_SCALE],
                         qh.size // 2 if f16 else -1, kt.size // 2 if f16 else -1,
                         vv.size // 2 if f16 else -1, np.empty(0, np.int32))
    rows = item_rows(params, geo.lens, b, i0)
    i1, R, jstart, jend = rows
    if jstart < jend:
        if not _start_rows(ins.q, geo, kernel, item, i1, state):
            return False
        if not walk_tiles(kernel, ins, item, rows, BLOCK, extras, geo, tuning, state, bufs.acc,
                          Dp, (bufs.ro, bufs.rs)):
            return False
    finish(outs, ins, extras, geo, item, i1, bufs.acc, Dp, state, tb, jstart < jend)
    return True


@njit(**LEAF)
def _start_rows(q, geo, kernel, item, i1, state):
    """Pack the item's query rows as bf16 (parts), zero its sums and running state; False
    where AMX cannot take a query value exactly."""
    strides, boff, _, params = geo
    b, g, i0 = item
    G, D, Dp = params[P_G], kernel.D, kernel.Dp
    qh = kernel.bufs.qh
    for h in range(G):       # head h: rows h, h + G, ... (position-major)
        if not amx_pack_rows(qh[h * Dp:], kernel.q_lo, G * Dp, q,
                             boff[T_Q, b] + (g * G + h) * strides[T_Q, 0] + i0 * strides[T_Q, 1],
                             strides[T_Q, 1], strides[T_Q, 2], i1 - i0, D, Dp, kernel.code):
            return False
    R = G * (i1 - i0)
    state.m[:R] = F32_NEG_INF
    state.l[:R] = F32_ZERO
    kernel.bufs.acc[:padded(R) * Dp] = F32_ZERO
    return True


@njit(**LEAF)
def _amx_tile(kernel, ins, item, cols, prefix, sdk, sdv):
    """The AMX kernel's load_tile (:mod:`.tile`): K^T and V packed as bf16 (parts); refused
    where AMX could get the tile wrong. The tile: (its padded columns, whether every V value is
    finite (P then goes into bf16 parts for the product), whether the softmax may defer
    rescaling (rows.LAZY_V_LIMIT))."""
    bufs, D, Dp, code = kernel.bufs, kernel.D, kernel.Dp, kernel.code
    nc = cols[1]
    ncp = padded(nc)
    kt, vv, ro = bufs.kt, bufs.vv, bufs.ro
    ex = max(amx_pack_k(kt, kernel.k_lo, ins.kp if prefix else ins.k, ro[0], sdk, nc, ncp, D,
                        Dp, bufs.tmp, code),
             amx_pack_v(vv, kernel.v_lo, ins.vp if prefix else ins.v, ro[1], sdv, nc, ncp, D,
                        Dp, code))
    if code == CODE_F16:
        return ex != F16_EXP, (ncp, True, True)
    key_k, _ = bf16_scan(kt, ncp * Dp)
    key_v, ex = bf16_scan(vv, ncp * Dp)
    exact = key_k >= SUBNORMAL_LIMIT and key_v >= TINY_V_LIMIT
    return exact, (ncp, ex != np.uint32(0x7F80), ex < LAZY_V_LIMIT)


@njit(**LEAF)
def _amx_scores(kernel, tile, seg):
    """The AMX kernel's scores (:mod:`.tile`): S = Q K^T on AMX, scaled in the softmax pass,
    which writes P as bf16 hi and lo parts where V is finite."""
    ncp, v_finite, lazy = tile
    bufs, Dp = kernel.bufs, kernel.Dp
    r0, r1, c0, ns, _ = seg
    nrp, nsp = padded(r1 - r0), padded(ns)
    gemm_bf16(bufs.cfg, bufs.qh[r0 * Dp:], kernel.q_lo, Dp, bufs.kt[2 * c0:], kernel.k_lo,
              2 * ncp, bufs.sb, nsp, nrp, nsp, Dp, False)
    return (bufs.sb[:nrp * nsp].reshape(nrp, nsp), bufs.pp[:2 * nrp * nsp].reshape(nrp, 2, nsp),
            kernel.no_keys, v_finite, lazy, kernel.scale)


@njit(**LEAF)
def _amx_weighted_sum(kernel, tile, seg, s2, acc, ld, state):
    """The AMX kernel's weighted_sum (:mod:`.tile`): acc += P V on AMX, P as bf16 hi and lo
    parts interleaved per row (lda 2 nsp, lo at + nsp); column by column where V holds inf
    or NaN."""
    v_finite = tile[1]
    bufs, D, Dp = kernel.bufs, kernel.D, kernel.Dp
    r0, r1, c0, ns, _ = seg
    nsp = s2.shape[1]
    if v_finite:
        gemm_bf16(bufs.cfg, bufs.pp, nsp, 2 * nsp, bufs.vv[c0 * Dp:], kernel.v_lo, 2 * Dp, acc,
                  Dp, padded(r1 - r0), Dp, nsp, True)
    else:
        add_pv_exact(acc, Dp, r1 - r0, D, bufs.sb, nsp, ns, bufs.vv[c0 * Dp:], 2 * Dp, 2)


products(AmxProducts, _amx_tile, _amx_scores, _amx_weighted_sum)


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
        state, blas = thread_state(rows, tuning)
        fallback = no_f32_buffers(tb)
        w = take_next(taken)
        while w < n_items:
            item = (work[w, W_B], work[w, W_G], work[w, W_I0])
            if not _block_amx(ins, outs, extras, geo, tuning, scales, item, bufs, tb, state):
                if fallback.qb.size == 0:
                    fallback = f32_buffers(params, tuning.gemm, tb)
                i1, computed = block(ins, extras, geo, tuning, scales, item,
                                     (work[w, W_JLO], work[w, W_JHI]), fallback, state, blas)
                finish(outs, ins, extras, geo, item, i1, fallback.acc,
                       f32_widths(params, tuning.gemm)[0], state, tb, computed)
            w = take_next(taken)
