"""The amx kernel: bf16 and float16 work items on AMX, tile products in bf16 tile registers,
the softmax of ``rows``. An item AMX could get wrong is left (its flag set, nothing written) to
the float32 tiles, which the launch runs over such items afterwards."""
import numpy as np
from numba import njit

from ..numerics.core import CODE_F16, F32_NEG_INF, F32_ZERO
from ..numerics.kernel_args import F_SCALE, P_CODE, P_D, P_G, T_Q
from ._amx import BLOCK, gemm_bf16, padded
from ._jit import LEAF, LEAF_INLINE
from ._vector import take_next
from .amx_pack import (F16_EXP, SUBNORMAL_LIMIT, TINY_V_LIMIT, amx_pack_k, amx_pack_rows,
                       amx_pack_v, bf16_scan)
from .items import W_B, W_G, W_I0, item_rows
from .records import AmxBuffers, AmxProducts, RowState
from .rows import LAZY_V_LIMIT
from .tile import add_pv_exact, finish, tile_loop


@njit(**LEAF)
def amx(t, args):
    """The amx kernel's worker (thread t): each item it takes is computed on AMX
    (:func:`_item`), or flagged in items.flags where AMX could get it wrong."""
    ins, outs, extras, geo, tuning, items, scratch, parts = args[0]
    s = scratch
    bufs = AmxBuffers(s.cfg[t], s.qh[t], s.kt[t], s.vv[t], s.tmp[t], s.sb[t], s.pp[t], s.acc[t],
                      s.ro[t], s.rs[t])
    state = RowState(s.m[t], s.l[t], s.alpha[t])
    runs, work = items.runs, items.work
    x = take_next(items.taken)
    while x < runs.shape[0]:
        for w in range(runs[x, 0], runs[x, 1]):
            item = (work[w, W_B], work[w, W_G], work[w, W_I0])
            if not _item(ins, outs, extras, geo, tuning, item, bufs, s.tb[t], state, s.kx[t][:0]):
                items.flags[w] = 1
        x = take_next(items.taken)


@njit(**LEAF)
def _item(ins, outs, extras, geo, tuning, item, bufs, tb, state, no_keys):
    """One work item of a bf16 or float16 problem on AMX (bufs: :class:`.records.AmxBuffers`;
    no_keys: an empty int32 array), through the tile loop of
    :mod:`.tile` with AMX products. Float16 values enter as bf16 hi + lo parts (exact), kept
    in the second halves of qh, kt and vv, and each product sums three bf16 products (all but
    lo . lo). Returns False, having written nothing, when an input of the item could be
    flushed by AMX (see SUBNORMAL_LIMIT) or, for float16, is not finite. It walks the kv
    sequence of :mod:`.kv` (a shared prefix, own rows, paged blocks) but dequantizes nothing
    (dispatch sends int8 key / value to the float32 tiles)."""
    params = geo.params
    b, g, i0 = item
    D = params[P_D]
    Dp = padded(D)
    f16 = params[P_CODE] == CODE_F16
    qh, kt, vv = bufs.qh, bufs.kt, bufs.vv
    # second operand parts (element offsets), -1: none
    kernel = AmxProducts(bufs, D, Dp, params[P_CODE], geo.fparams[F_SCALE],
                         qh.size // 2 if f16 else -1, kt.size // 2 if f16 else -1,
                         vv.size // 2 if f16 else -1, no_keys)
    rows = item_rows(params, geo.lens, b, i0)
    i1, R, jstart, jend = rows
    if jstart < jend:
        if not _start_rows(ins.q, geo, kernel, item, i1, state):
            return False
        if not _amx_walk(kernel, ins, item, rows, BLOCK, extras, geo, tuning, state, bufs.acc,
                          Dp, (bufs.ro, bufs.rs)):
            return False
    finish(outs, ins, extras, geo, item, i1, bufs.acc, Dp, state, tb, jstart < jend)
    return True


@njit(**LEAF)
def _start_rows(q, geo, kernel, item, i1, state):
    """Pack the item's query rows as bf16 (parts), zero its sums and running state; False
    where AMX cannot take a query value exactly."""
    strides, boff, params = geo.strides, geo.boff, geo.params
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


@njit(**LEAF_INLINE)
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


@njit(**LEAF_INLINE)
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


@njit(**LEAF_INLINE)
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


_amx_walk = tile_loop(_amx_tile, _amx_scores, _amx_weighted_sum)[1]
