"""The CPU backend: one ``@njit(parallel=True)`` tiled online-softmax kernel per storage type.

Work items are (batch, kv head, query-row block). A work item holds the rows ``[i0, i0 + r)``
of all G query heads that read one kv head, stacked into one ``(G*r, D)`` float32 block, so one
loaded K/V tile serves the whole GQA group and the tile products are large GEMMs:

    S = Q_block @ K_tile^T          (into a per-thread buffer)
    per row: pse, fp16 mask, band / user mask (-inf), running max m, p = exp(s - m), sum l
    acc = acc * exp(m_old - m_new);  acc += P @ V_tile   (accumulating in place)

and the division by l happens once, at the end (deferred normalisation). The products run on
the register-blocked AVX-512 kernels of ``_gemm`` (K packed into K^T panels as it is loaded)
or, on hosts without AVX-512, on SciPy's BLAS sgemm; bf16 and float16 storage run them on AMX
where the host has it (``_amx``; float16 as exact hi + lo bf16 parts). Per-thread tile buffers
start a cache line. Tiles that lie wholly outside the band or past kL are never visited; tiles
wholly inside the band (with no user mask or pse) touch no per-element mask. Q/K/V are read in
place through strided views of their memory (a flat read-only array plus element offsets),
fp16/bf16 as uint16 bits widened per tile, so a layout change never copies and only two
kernels are compiled (uint16 and float32 storage). Per-thread buffers are O(rows x kv tile);
no Sq x Skv matrix exists. Threads take work items as they free up; each item is computed by
one thread, the same way whichever thread takes it, so results do not depend on the thread
count or on which thread takes which item.
"""
import contextlib
import threading

import numba
import numpy as np
from numba import njit, prange

from . import config
from ._geometry import (P_BLAS, P_CODE, P_COLS, P_D, P_FLAGS, P_G, P_GEMM, P_IP, P_LSE, P_MASK,
                        P_OCODE, P_PSE, P_ROWS, P_SEG, P_SUB, P_THREADS, T_K, T_L, T_M, T_O, T_P,
                        T_Q, T_V, geometry, scale_factors)
from . import _amx, _gemm
from ._amx import BLOCK, gemm_bf16, padded, tile_config
from ._blas import gemm_rm, scratch, sgemm_address
from ._gemm import MR, PANEL, accumulate, padded_rows, panels, scores, vector_width
from ._vector import (aligned_empty, bf16_bits_hw, f16_bits_to_f32_hw, f32_to_f16_bits_hw,
                      host_has, prefetch, take_next, wide_vectors)
from ._plan import storage_code
from ._core import (BAND_INF, CODE_BF16, CODE_F16, CODE_F32, F16_MASK_SCALE, F32_NEG_INF, F32_ONE,
                    F32_POS_INF, F32_ZERO, MASK_ADD_F16, MASK_DISCARD, bf16_to_f32,
                    block_kv_range, exp_nonpos, exp_nonpos5, f16_to_f32, f32_as_i32, f32_as_u32,
                    f32_to_bf16, f32_to_f16, from_order_key, lse_value, max_nan, order_key,
                    quantize_output, rescale_factor, round_f16, round_half_even, row_band,
                    saturate_int8, store, tile_inside_band, u32_as_f32, widen)

_FM = set(config.CPU_FASTMATH)
#: The helpers called per row or per tile take arrays but allocate none, and are compiled
#: without Numba's reference counting (NRT off): each counted array argument costs an atomic
#: call on every entry (measured, the softmax step of one row: 0.70 -> 0.51 ns/score at 512
#: columns, 1.47 -> 0.74 at 128).
_LEAF = dict(fastmath=_FM, cache=True, _nrt=False)



# ---------------------------------------------------------------------------------------------
# row helpers (CPU-only: they loop over rows of per-thread buffers)
# ---------------------------------------------------------------------------------------------

#: float16 <-> float32 for the row loads and output rows: VCVTPH2PS / VCVTPS2PH where the CPU
#: has F16C (one instruction per 16 values against about 7 / 15 integer ones; both exact IEEE)
_f16_to_f32 = f16_bits_to_f32_hw if host_has("f16c") else f16_to_f32
_f32_to_f16 = f32_to_f16_bits_hw if host_has("f16c") else f32_to_f16


@njit(**_LEAF)
def _load_row(dst, r, src, off, stride, n, code, factor):
    """dst[r, :n] = widen(src[off + d*stride]) * factor, one loop per storage code so each
    vectorises. Rows are addressed by index and the source through unsigned indices: no
    array views (each costs reference counting) and no negative-index checks (which stop
    the vectoriser)."""
    wide_vectors()
    if stride == 1:
        base = np.uint64(off)
        if code == CODE_F16:
            for d in range(n):
                dst[r, d] = _f16_to_f32(src[base + np.uint64(d)]) * factor
        elif code == CODE_BF16:
            for d in range(n):
                dst[r, d] = bf16_to_f32(src[base + np.uint64(d)]) * factor
        else:
            for d in range(n):
                dst[r, d] = np.float32(src[base + np.uint64(d)]) * factor
    else:
        for d in range(n):
            dst[r, d] = widen(src[off + d * stride], code) * factor


@njit(cache=True, _nrt=False)    # no fast-math: a true division, not 1 / div estimated
def _store_row(dst, off, stride, row, r0, div, n, code):
    """dst[off + d*stride] = row[r0 + d] / div in the storage of ``code`` (rounded to nearest
    even), d < n; one loop per code for contiguous rows, so that each vectorises (see
    :func:`_load_row`)."""
    wide_vectors()
    if stride == 1:
        base = np.uint64(off)
        if code == CODE_F16:
            for d in range(n):
                dst[base + np.uint64(d)] = _f32_to_f16(row[r0 + d] / div)
        elif code == CODE_BF16:
            for d in range(n):
                dst[base + np.uint64(d)] = f32_to_bf16(row[r0 + d] / div)
        else:
            for d in range(n):
                dst[base + np.uint64(d)] = row[r0 + d] / div
    else:
        for d in range(n):
            store(dst, off + d * stride, row[r0 + d] / div, code)


@njit(**_LEAF)
def _all_finite(buf, n):
    """True when buf[:n] holds no inf or NaN (x * 0 is 0 only for finite x)."""
    wide_vectors()
    chk = F32_ZERO
    for i in range(n):
        chk += buf[i] * F32_ZERO
    return chk == F32_ZERO


@njit(**_LEAF)
def _row_max(s2, r, n, f):
    """max over c < n of the float32 products s2[r, c] * f, through order-preserving int keys
    (vectorises; -inf / NaN exact). Rounding is monotonic, so that is f times the largest raw
    score (f >= 0) or the smallest (f < 0, with a NaN anywhere giving NaN): the row need not be
    scaled first."""
    wide_vectors()
    hi = order_key(F32_NEG_INF)
    if f >= F32_ZERO:
        for c in range(n):
            kx = order_key(s2[r, c])
            hi = kx if kx > hi else hi
        return from_order_key(hi) * f
    lo = order_key(F32_POS_INF)
    for c in range(n):
        kx = order_key(s2[r, c])
        hi = kx if kx > hi else hi
        lo = kx if kx < lo else lo
    top = from_order_key(hi)
    return top if top != top else from_order_key(lo) * f


@njit(**_LEAF)
def _exp_row(s2, r, n, m, f):
    """s2[r, :n] = exp(s2[r, :n] * f - m) in place; returns the sum."""
    wide_vectors()
    s = F32_ZERO
    for c in range(n):
        p = exp_nonpos(s2[r, c] * f - m)
        s2[r, c] = p
        s += p
    return s


@njit(**_LEAF)
def _mask_row(s2, r, nc, j0, i, kl, pre_e, next_e, inside, mask8, mask16, moff, msk, mask_kind,
              pse, poff, psk, has_pse, code):
    """Scores s2[r] of one row of one tile -> pse added, fp16 mask added, dropped columns at
    -inf."""
    wide_vectors()
    srow = s2[r]
    if has_pse:
        for c in range(nc):
            srow[c] += widen(pse[poff + c * psk], code)
    if mask_kind == MASK_ADD_F16:
        for c in range(nc):
            srow[c] += F16_MASK_SCALE * f16_to_f32(mask16[moff + c * msk])
    lo = 0
    hi = nc - 1
    if not inside:
        blo, bhi = row_band(i, pre_e, next_e, kl)
        lo = max(blo - j0, 0)
        hi = min(bhi - j0, nc - 1)
        for c in range(min(lo, nc)):
            srow[c] = F32_NEG_INF
        for c in range(max(hi + 1, 0), nc):
            srow[c] = F32_NEG_INF
    if mask_kind == MASK_DISCARD:
        for c in range(lo, hi + 1):
            if mask8[moff + c * msk] != 0:
                srow[c] = F32_NEG_INF


@njit(**_LEAF)
def _prepare_row(s2, r, nc, i, n, b, j0, inside, kl, pre_e, next_e, mask8, mask16, pse,
                 strides, boff, mask_kind, has_pse, code):
    """Scores s2[r] of position i (query head n) of one tile, in place: pse and fp16 mask
    added, columns outside the band or masked set to -inf."""
    _mask_row(s2, r, nc, j0, i, kl, pre_e, next_e, inside,
              mask8, mask16, boff[T_M, b] + i * strides[T_M, 1] + j0 * strides[T_M, 2],
              strides[T_M, 2], mask_kind, pse,
              boff[T_P, b] + n * strides[T_P, 0] + i * strides[T_P, 1] + j0 * strides[T_P, 2],
              strides[T_P, 2], has_pse, code)


@njit(**_LEAF)
def _online_row(s2, r, nc, rr, m, l, alpha, p3, split, lazy, keys, f):
    """Online-softmax step of the scores s2[r, :nc] * f (query row rr): update m and l, set
    alpha (the acc rescale factor) and turn the scores into p = exp(s * f - m): in place, or
    (``split``) into bf16 hi / lo parts p3[r, 0] and p3[r, 1]. The row's max is
    from_order_key(keys[r]) where the product computed it (``keys`` not empty; f is 1 then),
    else taken here.

    ``lazy`` (split rows only): a row with a finite running max first tries one pass that
    takes p = exp(s * f - m_old) against the old max and keeps it when no score exceeds that
    by more than LAZY_MARGIN (p <= e^LAZY_MARGIN: m, acc and l stay as they are, softmax and
    lse unchanged); otherwise the max pass and a second exp pass run as usual. After a row's
    first tile its max seldom grows by that much, so most tiles take one pass instead of two."""
    m_old = m[rr]
    if lazy and keys.size == 0 and F32_NEG_INF < m_old < F32_POS_INF:
        s, over = _exp_row_split(s2, r, nc, m_old, p3, f)
        if not over:
            l[rr] = l[rr] + s
            alpha[rr] = F32_ONE
            return
    mx = from_order_key(keys[r]) if keys.size else _row_max(s2, r, nc, f)
    m_new = max_nan(m_old, mx)
    if m_new == F32_NEG_INF:
        if split:
            p3[r, :, :] = 0
        else:
            s2[r, :nc] = F32_ZERO
        alpha[rr] = F32_ONE
        return
    a = rescale_factor(m_old, m_new)
    if split:
        s, _ = _exp_row_split(s2, r, nc, m_new, p3, f)
    else:
        s = _exp_row(s2, r, nc, m_new, f)
    l[rr] = l[rr] * a + s
    m[rr] = m_new
    alpha[rr] = a


@njit(**_LEAF)
def _rescale_rows(acc, ld, R, D, alpha):
    """acc[rr, :D] *= alpha[rr] (acc rows of ld values) for the rows whose running max moved."""
    wide_vectors()
    a2 = acc[:R * ld].reshape(R, ld)
    for rr in range(R):
        a = alpha[rr]
        if a != F32_ONE:
            for d in range(D):
                a2[rr, d] = a2[rr, d] * a


@njit(**_LEAF)
def _item(params, lens, b, i0):
    """Geometry of work item (b, i0): (i1, R, jstart, jend). Its R = G * (i1 - i0) rows are
    stacked position-major: row rr is query position i0 + rr // G of query head g * G + rr % G;
    only kv columns [jstart, jend) can be kept by any of them."""
    G = params[P_G]
    i1 = min(i0 + params[P_ROWS], lens[0, b])
    jstart, jend = block_kv_range(i0, i1, lens[2, b], lens[3, b], lens[1, b])
    return i1, G * (i1 - i0), jstart, jend


@njit(**_LEAF)
def _segment(params, lens, b, i0, i1, j0, j1, r0, R, align):
    """The next row segment [r0, r1) of a kv tile [j0, j1), and its columns [cl, ch).

    A tile wholly inside the band is one segment of all R rows. A tile the band cuts is taken
    CPU_SUB_ROWS rows at a time (a multiple of ``align``), each over only the columns its rows
    can keep (cl a multiple of ``align`` from j0): on a causal diagonal or a band edge this
    skips most of the cut-off triangle. Returns (r1, cl, ch, inside); cl >= ch: nothing kept.
    """
    G = params[P_G]
    pre_e = lens[2, b]
    next_e = lens[3, b]
    if tile_inside_band(i0, i1, j0, j1, pre_e, next_e):
        return min(R, r0 + params[P_SEG]), j0, j1, True
    r1 = min(R, r0 + params[P_SUB])
    p0 = i0 + r0 // G
    p1 = i0 + (r1 - 1) // G + 1
    lo, hi = block_kv_range(p0, p1, pre_e, next_e, lens[1, b])
    cl = j0 + (max(lo - j0, 0) // align) * align
    ch = min(j1, hi)
    return r1, cl, ch, tile_inside_band(p0, p1, cl, ch, pre_e, next_e)


@njit(**_LEAF)
def _softmax_rows(s2, r0, r1, nc, p3, split, lazy, inside, i0, g, b, cl, mask8, mask16, pse,
                  params, strides, boff, lens, scale, m, l, alpha, keys):
    """Rows [r0, r1) of a segment's scores s2[rr - r0, :nc] (columns from cl), times ``scale``:
    masked where needed, then the online-softmax step; p goes in place or (``split``) into
    p3[rr - r0] as bf16 hi / lo parts. Rows that need no mask are scaled inside the max and exp
    passes; the others are scaled first. ``keys`` (empty: none): the order keys of the row
    maxima of unmasked scores (scale 1), from the product."""
    G = params[P_G]
    mask_kind = params[P_MASK]
    has_pse = params[P_PSE] != 0
    any_user = mask_kind != 0 or has_pse
    for rr in range(r0, r1):
        r = rr - r0
        f = scale
        if any_user or not inside:
            if scale != F32_ONE:
                _scale_row(s2, r, nc, scale)
            f = F32_ONE
            _prepare_row(s2, r, nc, i0 + rr // G, g * G + rr % G, b, cl, inside, lens[1, b],
                         lens[2, b], lens[3, b], mask8, mask16, pse, strides, boff, mask_kind,
                         has_pse, params[P_CODE])
        _online_row(s2, r, nc, rr, m, l, alpha, p3, split, lazy, keys, f)


_PF_ROWS = 8          # K / V rows are prefetched this many rows ahead of their load


@njit(**_LEAF)
def _prefetch_row(src, off, n):
    """Prefetch the cache lines of src[off:off + n] (a K or V row: rows of one head lie N * D
    apart in BSH / BSND inputs, too far for the hardware prefetcher)."""
    for x in range(0, n, 64 // src.itemsize):
        prefetch(src, off + x)
    prefetch(src, off + n - 1)


@njit(**_LEAF)
def _pack_kt(kt, src, base, row_stride, sd, nc, D, code, tb):
    """K tile (nc rows from src, widened) as K^T panels for _gemm.scores: kt[p * PANEL * D +
    d * PANEL + c] = K[p * PANEL + c, d]; the last panel's columns past nc are zero. Rows are
    widened 16 at a time into ``tb`` (16 * D values; vectorised) and then transposed."""
    wide_vectors()
    tmp = tb[:16 * D].reshape(16, D)
    for c0 in range(0, nc, 16):
        cn = min(16, nc - c0)
        for cc in range(cn):
            off = base + (c0 + cc) * row_stride
            if c0 + cc + _PF_ROWS < nc:
                _prefetch_row(src, off + _PF_ROWS * row_stride, D * sd)
            _load_row(tmp, cc, src, off, sd, D, code, F32_ONE)
        dst = (c0 // PANEL) * PANEL * D + c0 % PANEL      # the 16 columns share a panel
        for d in range(D):
            col = kt[dst + d * PANEL:dst + d * PANEL + cn]
            for cc in range(cn):
                col[cc] = tmp[cc, d]
    last = (nc // PANEL) * PANEL * D
    for c in range(nc % PANEL, PANEL if nc % PANEL else 0):
        for d in range(D):
            kt[last + d * PANEL + c] = F32_ZERO


@njit(fastmath=_FM, cache=True)
def f32_widths(params):
    """(acc / V row length, rows to allocate per item, columns per kv tile to allocate) of the
    float32 kernel for ``params``: the register-blocked products (P_GEMM) read and write up to
    MR - 1 rows past a segment's last, 16-lane acc / V rows and whole K^T panels; BLAS touches
    exactly the data."""
    D = params[P_D]
    rows = params[P_G] * params[P_ROWS]
    tk = params[P_COLS]
    if params[P_GEMM] != 0:
        return vector_width(D), rows + MR, panels(tk) * PANEL
    return D, rows, tk


@njit(fastmath=_FM, cache=True)
def _block(q, k, v, out, lse, flags, mask8, mask16, pse, strides, boff, lens, params, scales,
           b, g, i0, qb, sb, tb, acc, kb, vb, kx, m, l, alpha, blas):
    """One work item in float32: rows of positions [i0, i1) of the G query heads of kv head g
    in batch b (see :func:`_item`). The tile products run on the register-blocked kernels of
    _gemm (params[P_GEMM]) or on BLAS."""
    G = params[P_G]
    D = params[P_D]
    code = params[P_CODE]
    tk = params[P_COLS]
    own = params[P_GEMM] != 0
    any_user = params[P_MASK] != 0 or params[P_PSE] != 0
    ldv = f32_widths(params)[0]          # row length of acc and of the V tile
    i1, R, jstart, jend = _item(params, lens, b, i0)
    no_p3 = np.empty((1, 2, 1), np.uint16)        # the in-place softmax writes no bf16 parts
    if jstart < jend:
        q2 = qb[:R * D].reshape(R, D)
        for rr in range(R):
            off = (boff[T_Q, b] + (g * G + rr % G) * strides[T_Q, 0]
                   + (i0 + rr // G) * strides[T_Q, 1])
            _load_row(q2, rr, q, off, strides[T_Q, 2], D, code, scales[0])
            if scales[1] != F32_ONE:      # a scale_value beyond float32's range, in two factors
                _scale_row(q2, rr, D, scales[1])
            m[rr] = F32_NEG_INF
            l[rr] = F32_ZERO
        acc[:] = F32_ZERO
        k_base = boff[T_K, b] + g * strides[T_K, 0]
        v_base = boff[T_V, b] + g * strides[T_V, 0]
        for j0 in range(jstart, jend, tk):
            j1 = min(j0 + tk, jend)
            nc = j1 - j0
            v2 = vb[:nc * ldv].reshape(nc, ldv)
            if own:
                _pack_kt(kb, k, k_base + j0 * strides[T_K, 1], strides[T_K, 1], strides[T_K, 2],
                         nc, D, code, tb)
            else:
                k2 = kb[:nc * D].reshape(nc, D)
            for c in range(nc):
                if not own:
                    _load_row(k2, c, k, k_base + (j0 + c) * strides[T_K, 1], strides[T_K, 2], D,
                              code, F32_ONE)
                if c + _PF_ROWS < nc:
                    _prefetch_row(v, v_base + (j0 + c + _PF_ROWS) * strides[T_V, 1],
                                  D * strides[T_V, 2])
                _load_row(v2, c, v, v_base + (j0 + c) * strides[T_V, 1], strides[T_V, 2], D,
                          code, F32_ONE)
                v2[c, D:] = F32_ZERO
            v_finite = _all_finite(vb, nc * ldv)
            r0 = 0
            while r0 < R:
                r1, cl, ch, inside = _segment(params, lens, b, i0, i1, j0, j1, r0, R,
                                              PANEL if own else 1)
                ns = ch - cl
                if ns > 0:
                    nrow = r1 - r0
                    # S = Q K^T; softmax; acc = acc * alpha + P V
                    keys = kx[:0]
                    if own:
                        lds = panels(ns) * PANEL
                        if inside and not any_user and ns == lds:
                            # the product also takes the row maxima (no column past ns)
                            keys = kx[:padded_rows(nrow)]
                            keys[:] = order_key(F32_NEG_INF)
                            scores(qb, r0 * D, D, kb, (cl - j0) * D, D, sb, lds, nrow, panels(ns),
                                   keys)
                        else:
                            scores(qb, r0 * D, D, kb, (cl - j0) * D, D, sb, lds, nrow, panels(ns),
                                   None)
                    else:
                        lds = ns
                        gemm_rm(blas, nrow, ns, D, qb, r0 * D, D, True, kb,
                                (cl - j0) * D, D, sb, 0, ns, F32_ZERO)
                    s2 = sb[:nrow * lds].reshape(nrow, lds)
                    _softmax_rows(s2, r0, r1, ns, no_p3, False, False, inside, i0, g, b, cl,
                                  mask8, mask16, pse, params, strides, boff, lens, F32_ONE, m, l,
                                  alpha, keys)
                    _rescale_rows(acc[r0 * ldv:], ldv, nrow, D, alpha[r0:])
                    vo = (cl - j0) * ldv
                    if not v_finite:
                        _add_pv_exact(acc[r0 * ldv:], ldv, nrow, D, sb, lds, ns, vb[vo:], ldv, 1)
                    elif own:
                        # the register blocks also add the padding rows' P (zero) to the rows
                        # below the segment: + 0 changes nothing
                        sb[nrow * lds:padded_rows(nrow) * lds] = F32_ZERO
                        accumulate(sb, lds, vb, vo, ldv, acc, r0 * ldv, ldv, nrow, ns)
                    else:
                        gemm_rm(blas, nrow, D, ns, sb, 0, lds, False, vb, vo, ldv,
                                acc, r0 * ldv, ldv, F32_ONE)
                r0 = r1
    _finish(out, lse, flags, v, params, strides, boff, lens, b, g, i0, i1, acc, ldv, m, l, tb,
            jstart < jend)


@njit(**_LEAF)
def _add_pv_exact(acc, ld, R, D, p, ldp, nc, vb, ldv, pair):
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


@njit(**_LEAF)
def _finish(out, lse, flags, v, params, strides, boff, lens, b, g, i0, i1, acc, ld, m, l, tb,
            computed):
    """Deferred division, rounding to the output storage and softmax_lse of one work item
    (acc row rr at acc[rr * ld:]); rows with nothing kept follow SPEC 5."""
    G = params[P_G]
    D = params[P_D]
    code = params[P_CODE]
    inner_precise = params[P_IP]
    want_lse = params[P_LSE] != 0
    want_flags = params[P_FLAGS] != 0
    ocode = params[P_OCODE]
    kl = lens[1, b]
    pre_e = lens[2, b]
    next_e = lens[3, b]
    for rr in range(G * (i1 - i0)):
        i = i0 + rr // G
        n = g * G + rr % G
        o_off = boff[T_O, b] + n * strides[T_O, 0] + i * strides[T_O, 1]
        osd = strides[T_O, 2]
        l_off = boff[T_L, b] + n * strides[T_L, 0] + i * strides[T_L, 1]
        mm = m[rr] if computed else F32_NEG_INF
        if mm != F32_NEG_INF:
            _store_row(out, o_off, osd, acc, rr * ld, l[rr], D, ocode)
            if want_lse:
                lse[l_off] = lse_value(mm, l[rr])
            if want_flags:
                flags[l_off] = 1
        elif inner_precise < 2:
            # SPEC 5: band non-empty but every band column masked -> mean of V over the band
            lo, hi = row_band(i, pre_e, next_e, kl)
            if lo <= hi:
                trow = tb[:D]
                trow[:] = F32_ZERO
                for j in range(lo, hi + 1):
                    off = boff[T_V, b] + g * strides[T_V, 0] + j * strides[T_V, 1]
                    for d in range(D):
                        trow[d] += widen(v[off + d * strides[T_V, 2]], code)
                cnt = np.float32(hi - lo + 1)
                for d in range(D):
                    store(out, o_off + d * osd, trow[d] / cnt, ocode)
                if want_flags:
                    flags[l_off] = 1


# ---------------------------------------------------------------------------------------------
# bf16 and float16 on AMX: tile products in bf16 tile registers, the softmax as above
# ---------------------------------------------------------------------------------------------

@njit(inline="always")
def _subnormal_key(u):
    """< 0x7F exactly when the bf16 bits u are a nonzero subnormal (AMX reads those as 0)."""
    return (np.uint32(u) & np.uint32(0x7FFF)) - np.uint32(1)


@njit(**_LEAF)
def _u32(x):
    """x as uint32 (Numba widens uint32 arithmetic to 64 bits, which halves the vector lanes:
    each step below is cast back)."""
    return np.uint32(x)


@njit(**_LEAF)
def _pair(a, b):
    """Two 16-bit values as one uint32: a in the low half."""
    return _u32(_u32(a) | _u32(_u32(b) << _u32(16)))


@njit(**_LEAF)
def _f16_exp(u):
    """The exponent field of float16 bits u (all ones: inf or NaN)."""
    return _u32(_u32(u) & _F16_EXP)


@njit(**_LEAF)
def _split_f16(u):
    """float16 bits -> (hi, lo) bf16 bits with hi + lo equal to the value: hi is it rounded to 8
    significant bits (to nearest even), lo the remaining 3 (exact; never a bf16 subnormal).
    f32_to_bf16's rounding without its NaN branch (the caller rejects non-finite values, whose
    lo would be NaN), in 32-bit integer steps: in a split loop, about 2x faster per value than
    calling f32_to_bf16 or VCVTNEPS2BF16 (whose loop does not fill 512-bit vectors)."""
    x = _f16_to_f32(u)
    b = f32_as_u32(x)
    hi = _u32(_u32(_u32(b + _u32(0x7FFF)) + _u32(_u32(b >> _u32(16)) & _u32(1))) >> _u32(16))
    lo = _u32(f32_as_u32(x - u32_as_f32(_u32(hi << _u32(16)))) >> _u32(16))
    return np.uint16(hi), np.uint16(lo)


@njit(**_LEAF)
def _amx_pack_rows(dst, lo, ld, src, base, row_stride, sd, n_rows, D, Dp, code):
    """dst[r * ld + d] = src[base + r * row_stride + d * sd], columns D..Dp zero: bf16 bits as
    they are; float16 as bf16 hi parts, with the lo parts at dst[lo + r * ld + d]. Returns
    True when AMX computes these rows exactly (no bf16 subnormal, no non-finite float16)."""
    wide_vectors()
    key = np.uint32(0xFFFFFFFF)
    ex = np.uint32(0)
    for r in range(n_rows):
        drow = dst[r * ld:r * ld + Dp]
        off = base + r * row_stride
        if code == CODE_F16:
            lrow = dst[lo + r * ld:lo + r * ld + Dp]
            if sd == 1:
                seg = src[off:off + D]
                for d in range(D):
                    u = seg[d]
                    ex = max(ex, _f16_exp(u))
                    drow[d], lrow[d] = _split_f16(u)
            else:
                for d in range(D):
                    u = src[off + d * sd]
                    ex = max(ex, _f16_exp(u))
                    drow[d], lrow[d] = _split_f16(u)
            lrow[D:] = 0
        elif sd == 1:
            seg = src[off:off + D]
            for d in range(D):
                u = seg[d]
                drow[d] = u
                key = min(key, _subnormal_key(u))
        else:
            for d in range(D):
                u = src[off + d * sd]
                drow[d] = u
                key = min(key, _subnormal_key(u))
        drow[D:] = 0
    return key >= _SUBNORMAL_LIMIT and ex != _F16_EXP


@njit(**_LEAF)
def _bf16_scan(buf, n):
    """(smallest subnormal key, largest exponent field) of the bf16 bits buf[:n]: a nonzero
    subnormal makes the key < 0x7F, an inf or NaN makes the exponent 0x7F80."""
    wide_vectors()
    key = np.uint32(0xFFFFFFFF)
    ex = np.uint32(0)
    for i in range(n):
        u = np.uint32(buf[i])
        key = min(key, (u & np.uint32(0x7FFF)) - np.uint32(1))
        ex = max(ex, u & np.uint32(0x7F80))
    return key, ex


@njit(**_LEAF)
def _split_pair(u0, u1):
    """Two float16 bits -> (hi pair word, lo pair word, exponent bits of either)."""
    h0, l0 = _split_f16(u0)
    h1, l1 = _split_f16(u1)
    return _pair(h0, h1), _pair(l0, l1), max(_f16_exp(u0), _f16_exp(u1))


@njit(**_LEAF)
def _single_word(u, code):
    """A value whose pair partner is zero (an odd D's last K pair, an odd tile's last V row):
    (hi word, lo word, exponent bits) as in :func:`_split_pair` for float16; bf16 as it is."""
    if code == CODE_F16:
        h, l = _split_f16(u)
        return np.uint32(h), np.uint32(l), _f16_exp(u)
    return np.uint32(u), np.uint32(0), np.uint32(0)


@njit(**_LEAF)
def _pair_words(src, a, b, step, n, t, tl, code):
    """t[p] = src[a + p * step] | src[b + p * step] << 16 (two bf16 as one uint32), p < n;
    float16: the pairs of hi parts, and of lo parts in tl. Returns the largest float16
    exponent field seen (0 for bf16). One loop per case, so that each vectorises."""
    ex = np.uint32(0)
    if step == 1:                              # the same column of two contiguous rows
        r0 = src[a:a + n]
        r1 = src[b:b + n]
        if code == CODE_F16:
            for p in range(n):
                t[p], tl[p], e = _split_pair(r0[p], r1[p])
                ex = max(ex, e)
        else:
            for p in range(n):
                t[p] = _pair(r0[p], r1[p])
    elif step == 2 and b == a + 1:             # neighbours in one contiguous row
        seg = src[a:a + 2 * n]
        if code == CODE_F16:
            for p in range(n):
                t[p], tl[p], e = _split_pair(seg[2 * p], seg[2 * p + 1])
                ex = max(ex, e)
        else:
            for p in range(n):
                t[p] = _pair(seg[2 * p], seg[2 * p + 1])
    elif code == CODE_F16:
        for p in range(n):
            t[p], tl[p], e = _split_pair(src[a + p * step], src[b + p * step])
            ex = max(ex, e)
    else:
        for p in range(n):
            t[p] = _pair(src[a + p * step], src[b + p * step])
    return ex


@njit(**_LEAF)
def _amx_pack_k(kt, lo, src, base, row_stride, sd, nc, ncp, D, Dp, tmp, code):
    """K tile (nc rows from src) as the VNNI B operand of S = Q K^T: as uint32 pairs,
    kt[p, c] = (K[c, 2p], K[c, 2p + 1]) with ld ncp, zero-padded to ncp columns and Dp / 2
    pairs (float16: bf16 hi parts, lo parts at kt[lo:]). Transposed through ``tmp`` (2 x 16 x
    Dp / 2 uint32) in blocks of 16 rows. Returns the largest float16 exponent field seen."""
    wide_vectors()
    half = (D + 1) // 2            # an odd D's last pair holds a zero
    ex = np.uint32(0)
    for c0 in range(0, nc, 16):
        cn = min(16, nc - c0)
        for cc in range(cn):
            off = base + (c0 + cc) * row_stride
            t = tmp[cc * half:]
            tl = tmp[(16 + cc) * half:]
            ex = max(ex, _pair_words(src, off, off + sd, 2 * sd, D // 2, t, tl, code))
            if D % 2:
                t[half - 1], tl[half - 1], e = _single_word(src[off + (D - 1) * sd], code)
                ex = max(ex, e)
        for part in range(2 if code == CODE_F16 else 1):
            kt32 = kt[part * lo:part * lo + ncp * Dp].view(np.uint32)
            t = tmp[part * 16 * half:]
            for p in range(half):
                dst = kt32[p * ncp + c0:p * ncp + c0 + cn]
                for cc in range(cn):
                    dst[cc] = t[cc * half + p]
    for part in range(2 if code == CODE_F16 else 1):
        kt32 = kt[part * lo:part * lo + ncp * Dp].view(np.uint32)
        for p in range(half):
            kt32[p * ncp + nc:(p + 1) * ncp] = 0
        kt32[half * ncp:(Dp // 2) * ncp] = 0
    return ex


@njit(**_LEAF)
def _amx_pack_v(vv, lo, src, base, row_stride, sd, nc, ncp, D, Dp, code):
    """V tile as the VNNI B operand of P V: as uint32 pairs, vv[c // 2, d] = (V[c, d],
    V[c + 1, d]) with ld Dp; rows nc..ncp and columns D..Dp zero (float16: bf16 hi parts, lo
    parts at vv[lo:]). Returns the largest float16 exponent field seen."""
    wide_vectors()
    ex = np.uint32(0)
    parts = 2 if code == CODE_F16 else 1
    for c in range(0, nc, 2):
        a = base + c * row_stride
        dst = vv[(c // 2) * 2 * Dp:(c // 2) * 2 * Dp + 2 * Dp].view(np.uint32)
        dlo = vv[lo + (c // 2) * 2 * Dp:lo + (c // 2) * 2 * Dp + 2 * Dp].view(np.uint32) \
            if parts == 2 else dst
        if c + 1 == nc:      # the last odd row pairs with zeros
            for d in range(D):
                h, w, e = _single_word(src[a + d * sd], code)
                dst[d] = h
                if parts == 2:
                    dlo[d] = w
                ex = max(ex, e)
        else:
            ex = max(ex, _pair_words(src, a, a + row_stride, sd, D, dst, dlo, code))
        for part in range(parts):
            vv[part * lo + (c // 2) * 2 * Dp + 2 * D:part * lo + (c // 2 + 1) * 2 * Dp] = 0
    for part in range(parts):
        vv[part * lo + ((nc + 1) // 2) * 2 * Dp:part * lo + (ncp // 2) * 2 * Dp] = 0
    return ex


#: The lazy softmax step (see _online_row) keeps p = exp(s - m_old) up to e^LAZY_MARGIN, so acc
#: may grow that much more than with p <= 1: it runs only where |V| < 2^64 (bf16: exponent
#: field below _LAZY_V_LIMIT; float16 always).
LAZY_MARGIN = np.float32(8.0)
_LAZY_V_LIMIT = np.uint32((127 + 64) << 7)
_LAZY_MARGIN_BITS = LAZY_MARGIN.view(np.int32)


@njit(**_LEAF)
def _exp_row_split(s2, r, n, m, p3, f):
    """p = exp(s2[r, :n] * f - m) as two bf16 parts: hi (p truncated) in p3[r, 0], lo (the
    rest, rounded to nearest even) in p3[r, 1]; hi + lo is p to a relative 2^-16 (with
    AVX512-BF16, lo is 0 where it would be below 2^-126), columns past n are zero. Returns
    (the float32 sum of p, whether some s * f - m exceeds LAZY_MARGIN, +inf and NaN included):
    m may be a max up to LAZY_MARGIN too small (see _online_row); past that, p3 and the sum are
    to be discarded. NaN scores give NaN p (a quiet NaN, which truncation keeps).

    The test takes the largest x as an int32: positive floats order as their bits, negative
    ones fall below every positive one (an integer max vectorises; a float max does not
    without the no-NaN flag)."""
    wide_vectors()
    s = F32_ZERO
    top = np.int32(-2147483647)
    for c in range(n):
        x = s2[r, c] * f - m
        kx = f32_as_i32(x)
        top = kx if kx > top else top
        p = exp_nonpos5(x)
        s += p
        u = f32_as_u32(p)
        p3[r, 0, c] = np.uint16(_u32(u >> _u32(16)))
        p3[r, 1, c] = _bf16_bits(p - u32_as_f32(_u32(u & _u32(0xFFFF0000))))
    p3[r, :, n:] = 0
    return s, top > _LAZY_MARGIN_BITS


#: float32 -> bf16 bits, round to nearest even, for the low parts of p (finite, below 2^-7)
_bf16_bits = bf16_bits_hw if host_has("avx512bf16") else f32_to_bf16


@njit(fastmath=_FM, cache=True)
def _block_amx(q, k, v, out, lse, flags, mask8, mask16, pse, strides, boff, lens, params, scales,
               b, g, i0, cfg, qh, kt, vv, tmp, sb, pp, acc, tb, m, l, alpha):
    """One work item of a bf16 or float16 problem on AMX (see :func:`_block`). Float16 values
    enter as bf16 hi + lo parts (exact), kept in the second halves of qh, kt and vv, and each
    product sums three bf16 products (all but lo . lo). Returns False, having written nothing,
    when an input of the item could be flushed by AMX (see _SUBNORMAL_LIMIT) or, for float16,
    is not finite."""
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
    i1, R, jstart, jend = _item(params, lens, b, i0)
    no_keys = np.empty(0, np.int32)            # the row maxima are taken in the softmax pass
    if jstart < jend:
        for h in range(G):       # head h: rows h, h + G, ... (position-major)
            if not _amx_pack_rows(qh[h * Dp:], q_lo, G * Dp, q,
                                  boff[T_Q, b] + (g * G + h) * strides[T_Q, 0]
                                  + i0 * strides[T_Q, 1],
                                  strides[T_Q, 1], strides[T_Q, 2], i1 - i0, D, Dp, code):
                return False
        for rr in range(R):
            m[rr] = F32_NEG_INF
            l[rr] = F32_ZERO
        acc[:padded(R) * Dp] = F32_ZERO
        k_base = boff[T_K, b] + g * strides[T_K, 0]
        v_base = boff[T_V, b] + g * strides[T_V, 0]
        for j0 in range(jstart, jend, tk):
            j1 = min(j0 + tk, jend)
            nc = j1 - j0
            ncp = padded(nc)
            ex = max(_amx_pack_k(kt, k_lo, k, k_base + j0 * strides[T_K, 1], strides[T_K, 1],
                                 strides[T_K, 2], nc, ncp, D, Dp, tmp, code),
                     _amx_pack_v(vv, v_lo, v, v_base + j0 * strides[T_V, 1], strides[T_V, 1],
                                 strides[T_V, 2], nc, ncp, D, Dp, code))
            if f16:
                if ex == _F16_EXP:
                    return False
                v_finite = lazy = True
            else:
                key_k, _ = _bf16_scan(kt, ncp * Dp)
                key_v, ex = _bf16_scan(vv, ncp * Dp)
                if key_k < _SUBNORMAL_LIMIT or key_v < _TINY_V_LIMIT:
                    return False
                v_finite = ex != np.uint32(0x7F80)
                lazy = ex < _LAZY_V_LIMIT
            r0 = 0
            while r0 < R:
                r1, cl, ch, inside = _segment(params, lens, b, i0, i1, j0, j1, r0, R, BLOCK)
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
                    _softmax_rows(s2, r0, r1, ns, p3, v_finite, lazy, inside, i0, g, b, cl, mask8,
                                  mask16, pse, params, strides, boff, lens, scales[0], m, l, alpha,
                                  no_keys)
                    _rescale_rows(acc[r0 * Dp:], Dp, nrow, D, alpha[r0:])
                    if v_finite:
                        # P as bf16 hi and lo parts, interleaved per row: lda 2 nsp, lo at + nsp
                        gemm_bf16(cfg, pp, nsp, 2 * nsp, vv[c0 * Dp:], v_lo, 2 * Dp,
                                  acc[r0 * Dp:], Dp, nrp, Dp, nsp, True)
                    else:
                        _add_pv_exact(acc[r0 * Dp:], Dp, nrow, D, sb, nsp, ns, vv[c0 * Dp:],
                                      2 * Dp, 2)
                r0 = r1
    _finish(out, lse, flags, v, params, strides, boff, lens, b, g, i0, i1, acc, Dp, m, l, tb,
            jstart < jend)
    return True


@njit(**_LEAF)
def _scale_row(s2, r, n, f):
    wide_vectors()
    for c in range(n):
        s2[r, c] = s2[r, c] * f


#: AMX reads bf16 subnormals as zero and flushes products below float32's normal range (2^-126)
#: to zero. Work items whose Q or K hold a subnormal, or whose V holds a nonzero value below
#: 2^-100 (so that p * v with p >= 2^-26 could be flushed), take the float32 path. Scores are
#: scaled after the product, so a scale beyond 2^64 (lost products could matter) does too.
_SUBNORMAL_LIMIT = np.uint32(0x7F)               # key (bits & 0x7FFF) - 1 below: subnormal
_F16_EXP = np.uint32(0x7C00)                     # float16 exponent field; all ones: inf / NaN
_TINY_V_LIMIT = np.uint32((127 - 100) << 7) - np.uint32(1)
AMX_MAX_SCALE = 2.0 ** 64


@njit(cache=True)
def _sizes(params, work):
    """(D, rows per work item over the G heads, kv columns per tile, threads, work items)."""
    return (params[P_D], params[P_G] * params[P_ROWS], params[P_COLS], params[P_THREADS],
            work.shape[0])


@njit(fastmath=_FM, cache=True)
def _f32_buffers(params):
    """Per-thread buffers of :func:`_block`: (qb, sb, acc, kb, vb, kx)."""
    D = params[P_D]
    ldv, rows, tkp = f32_widths(params)
    qb = aligned_empty(rows * D, np.float32)
    qb[:] = F32_ZERO                         # rows past a work item's stay finite
    return (qb, aligned_empty(rows * tkp, np.float32), aligned_empty(rows * ldv, np.float32),
            aligned_empty(tkp * D, np.float32), aligned_empty(tkp * ldv, np.float32),
            aligned_empty(rows, np.int32))


@njit(parallel=True, fastmath=_FM, cache=True)
def _attention(q, k, v, out, lse, flags, mask8, mask16, pse, strides, boff, lens, work, params,
               scales):
    """Run every work item. Each of the nthr threads takes the next item not yet taken whenever
    it is free (items are sorted by cost, most expensive first), so a thread that runs slower,
    on a core shared with other work, takes fewer items instead of holding the call up."""
    D, rows, tk, nthr, n_items = _sizes(params, work)
    taken = np.zeros(1, np.int64)
    for t in prange(nthr):
        qb, sb, acc, kb, vb, kx = _f32_buffers(params)
        tb = aligned_empty(16 * D, np.float32)   # _pack_kt's 16 rows, _finish's one
        m = np.empty(rows, np.float32)
        l = np.empty(rows, np.float32)
        alpha = np.empty(rows, np.float32)
        blas = scratch(params[P_BLAS])
        w = take_next(taken)
        while w < n_items:
            _block(q, k, v, out, lse, flags, mask8, mask16, pse, strides, boff, lens, params,
                   scales, work[w, 0], work[w, 1], work[w, 2], qb, sb, tb, acc, kb, vb, kx, m,
                   l, alpha, blas)
            w = take_next(taken)


@njit(parallel=True, fastmath=_FM, cache=True)
def _attention_amx(q, k, v, out, lse, flags, mask8, mask16, pse, strides, boff, lens, work,
                   params, scales):
    """:func:`_attention` for bf16 and float16 storage on AMX; a work item AMX could get wrong
    (see :func:`_block_amx`) is computed by :func:`_block` instead."""
    D, rows, tk, nthr, n_items = _sizes(params, work)
    Rp = padded(rows)
    Cp = padded(tk)
    Dp = padded(D)
    parts = 2 if params[P_CODE] == CODE_F16 else 1      # float16: bf16 hi and lo parts
    taken = np.zeros(1, np.int64)
    for t in prange(nthr):
        cfg = tile_config()
        qh = aligned_empty(parts * Rp * Dp, np.uint16)
        kt = aligned_empty(parts * Cp * Dp, np.uint16)
        vv = aligned_empty(parts * Cp * Dp, np.uint16)
        tmp = aligned_empty(16 * Dp, np.uint32)
        pp = aligned_empty(2 * Rp * Cp, np.uint16)
        sb = aligned_empty(Rp * Cp, np.float32)
        acc = aligned_empty(Rp * Dp, np.float32)
        tb = aligned_empty(16 * D, np.float32)   # also _pack_kt's 16 rows (fallback)
        m = np.empty(rows, np.float32)
        l = np.empty(rows, np.float32)
        alpha = np.empty(rows, np.float32)
        qb = sb2 = acc2 = kb = vb = np.empty(0, np.float32)
        kx = np.empty(0, np.int32)
        blas = scratch(params[P_BLAS])
        w = take_next(taken)
        while w < n_items:
            if not _block_amx(q, k, v, out, lse, flags, mask8, mask16, pse, strides, boff, lens,
                              params, scales, work[w, 0], work[w, 1], work[w, 2], cfg, qh, kt,
                              vv, tmp, sb, pp, acc, tb, m, l, alpha):
                if qb.size == 0:
                    qb, sb2, acc2, kb, vb, kx = _f32_buffers(params)
                _block(q, k, v, out, lse, flags, mask8, mask16, pse, strides, boff, lens,
                       params, scales, work[w, 0], work[w, 1], work[w, 2], qb, sb2, tb, acc2, kb,
                       vb, kx, m, l, alpha, blas)
            w = take_next(taken)


# ---------------------------------------------------------------------------------------------
# int8 query/key/value (SPEC 8)
# ---------------------------------------------------------------------------------------------
# qp (float32): deq_scale1, fp16(scale_value), quant_scale1, deq_scale2
Q_DEQ1, Q_SCALE, Q_QS1, Q_DEQ2 = range(4)
#: P.V runs as a float32 GEMM, exact while every partial sum stays below 2^24:
#: 127 * 128 * 1024 < 2^24, so an int8 tile has at most this many kv columns.
INT8_MAX_KV_COLS = 1024


@njit(**_LEAF)
def _int8_scores(srow, nc, deq1, scale16, pse, poff, psk, has_pse):
    """s = fp16(fp16(A * deq1) * fp16(scale)) (+ pse, rounded to fp16), A exact integers."""
    for c in range(nc):
        srow[c] = round_f16(round_f16(srow[c] * deq1) * scale16)
    if has_pse:
        for c in range(nc):
            srow[c] = round_f16(srow[c] + f16_to_f32(pse[poff + c * psk]))


@njit(fastmath=_FM, cache=True)
def _f64_to_f16(x):
    """float64 -> float16 bits with one rounding (round to odd into float32, then to even)."""
    x32 = np.float32(x)
    if np.float64(x32) != x and x32 == x32 and abs(x32) != F32_POS_INF:
        u = f32_as_u32(x32)
        if abs(np.float64(x32)) > abs(x):
            u = u - np.uint32(1)          # truncate toward zero
        x32 = u32_as_f32(u | np.uint32(1))  # sticky bit: round to odd
    return f32_to_f16(x32)


@njit(fastmath=_FM, cache=True)
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


@njit(parallel=True, fastmath=_FM, cache=True)
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


def _work_items(p, rows_per_head):
    """(b, kv head, i0) for every block with rows to compute, most expensive first."""
    tiles = -(-p.qlen // rows_per_head)
    b = np.repeat(np.arange(p.B, dtype=np.int64), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    i0 = (np.arange(b.size, dtype=np.int64) - first) * rows_per_head
    # estimated cost: band columns of the block
    i1 = np.minimum(i0 + rows_per_head, p.qlen[b])
    lo = np.maximum(i0 - p.pre_e[b], 0)
    hi = np.minimum(i1 - 1 + p.next_e[b] + 1, p.klen[b])
    cost = np.maximum(hi - lo, 0) * (i1 - i0)
    order = np.argsort(-cost, kind="stable")
    b, i0 = b[order], i0[order]
    g = np.arange(p.Nkv, dtype=np.int64)
    work = np.empty((b.size * p.Nkv, 3), np.int64)
    work[:, 0] = np.repeat(b, p.Nkv)
    work[:, 1] = np.tile(g, b.size)
    work[:, 2] = np.repeat(i0, p.Nkv)
    return work


class _OneCallAtATime:
    """Serialises kernel calls (Numba's parallel runtime and BLAS limits are process-wide) and,
    for a call that uses BLAS, holds the BLAS libraries to one thread while the parallel kernel
    runs (cheap, cached)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._controller = None

    @contextlib.contextmanager
    def __call__(self, blas):
        with self._lock:
            if not blas:
                yield
                return
            if self._controller is None:
                from threadpoolctl import ThreadpoolController
                self._controller = ThreadpoolController()
            limit = self._controller.limit(limits=1, user_api="blas")
            try:
                yield
            finally:
                limit.restore_original_limits()


_one_call_at_a_time = _OneCallAtATime()


def tile_shape(p):
    """(query rows per work item, kv columns per tile) for problem ``p``.

    Large tiles make large GEMMs; a narrow band (sparse_mode 4, or mode 0 with small pre/next)
    wants tiles that follow its width so that few computed scores fall outside it.
    """
    q_rows, kv_cols = max(1, int(config.CPU_Q_ROWS)), max(1, int(config.CPU_KV_COLS))
    if p.B and (p.pre_e < BAND_INF).all() and (p.next_e < BAND_INF).all():
        width = int((p.pre_e + p.next_e + 1).max())
        band_tile = max(int(config.CPU_BAND_TILE_MIN), width // int(config.CPU_BAND_TILE_DIV))
        q_rows = min(q_rows, band_tile * max(1, int(config.CPU_BAND_Q_TILES)))
        kv_cols = min(kv_cols, band_tile)
    return q_rows, kv_cols


def sub_rows():
    """Rows per segment of a tile the band cuts (config.CPU_SUB_ROWS, a multiple of 32)."""
    return max(1, -(-int(config.CPU_SUB_ROWS) // BLOCK)) * BLOCK


def seg_rows(amx):
    """Rows per segment of a tile inside the band (config.CPU_SEG_ROWS, or CPU_AMX_SEG_ROWS
    for the AMX kernel; a multiple of 32)."""
    rows = config.CPU_AMX_SEG_ROWS if amx else config.CPU_SEG_ROWS
    return max(1, -(-int(rows) // BLOCK)) * BLOCK


def use_register_blocks():
    """The float32 tile products run on _gemm's register blocks where the host has AVX-512
    (config.CPU_AVX512_GEMM), else on BLAS."""
    return bool(config.CPU_AVX512_GEMM) and _gemm.available()


def use_amx(p):
    """bf16 and float16 problems run their tile products on AMX where this process can
    (config.CPU_AMX)."""
    return (p.code in (CODE_BF16, CODE_F16) and bool(config.CPU_AMX)
            and abs(p.scale) <= AMX_MAX_SCALE and _amx.available())


def run(p):
    """Compute a planned problem on the CPU; returns (out, lse or None) as NumPy arrays."""
    quant = p.quant
    int8_out = quant is not None and quant.out_dtype == np.int8
    # int8 output is quantized from the float16 (or float32) result in a second pass
    direct_dtype = np.float16 if (p.dtype == np.int8 or (int8_out and p.dtype != np.float32)) \
        else p.dtype
    out = np.zeros(p.out_shape, dtype=direct_dtype)
    lse = np.full(p.lse_shape, -np.inf, dtype=np.float32)
    flags = np.zeros(p.lse_shape, dtype=np.uint8) if int8_out else np.zeros(1, np.uint8)
    q_rows, kv_cols = tile_shape(p)
    if p.dtype == np.int8:
        kv_cols = min(kv_cols, INT8_MAX_KV_COLS)
    rows_per_head = max(1, q_rows // p.G)
    work = _work_items(p, rows_per_head) if out.size and p.B else np.zeros((0, 3), np.int64)
    if work.shape[0]:
        nthreads = config.CPU_THREADS or numba.get_num_threads()
        nthreads = max(1, min(int(nthreads), work.shape[0]))
        ocode = CODE_F16 if direct_dtype == np.float16 else storage_code(np.dtype(direct_dtype))
        amx = p.dtype != np.int8 and use_amx(p)
        own = use_register_blocks()
        blas = p.dtype == np.int8 or not own          # the int8 kernel's products are BLAS
        params = np.array([p.N, p.G, p.D, p.code, p.mask_kind, p.pse is not None,
                           p.inner_precise, p.want_lse or int8_out, rows_per_head, kv_cols,
                           nthreads, ocode, int8_out, sub_rows(), seg_rows(amx), own,
                           sgemm_address() if blas else 0], dtype=np.int64)
        lens = np.stack([p.qlen, p.klen, p.pre_e, p.next_e]).astype(np.int64)
        qf, kf, vf, o_flat, mask8, mask16, pse, strides, boff = geometry(p, out, lse)
        l_flat, f_flat = lse.reshape(-1), flags.reshape(-1)
        with _one_call_at_a_time(blas):
            if p.dtype == np.int8:
                qp = np.array([quant.deq1, np.float16(p.scale), quant.quant1, quant.deq2],
                              dtype=np.float32)
                _attention_int8(qf, kf, vf, o_flat, l_flat, f_flat, mask8, pse, strides, boff,
                                lens, work, params, qp)
            else:
                kernel = _attention_amx if amx else _attention
                kernel(qf, kf, vf, o_flat, l_flat, f_flat, mask8, mask16, pse, strides, boff,
                       lens, work, params, scale_factors(p.scale))
    if int8_out:
        out = quantize_int8_output(p, out, flags)
    return out, (lse if p.want_lse else None)


@njit(parallel=True, cache=True)
def _quantize_rows(o, code, flags, scale2, offset2, y):
    """y[b, n, i, :] = _core.quantize_output of the rows computed (flags 1); the others stay 0.
    o, y: (B, N, Sq, D) views; scale2/offset2: float16-rounded, 1 or N*D values."""
    B, N, S, D = o.shape
    per_channel = scale2.size > 1
    for b in prange(B):
        for n in range(N):
            for i in range(S):
                if flags[b, n, i, 0] == 0:
                    continue
                for d in range(D):
                    c = n * D + d if per_channel else 0
                    y[b, n, i, d] = np.int8(quantize_output(widen(o[b, n, i, d], code),
                                                            scale2[c], offset2[c]))


def quantize_int8_output(p, o, flags):
    """SPEC 8 output quantization of the float result ``o`` (float16 or float32, in the output
    layout) into a new int8 array; rows that are structural zeros (flags 0) stay 0."""
    q = p.quant
    s2 = q.scale2.astype(np.float16).astype(np.float32)
    o2 = q.offset2.astype(np.float16).astype(np.float32)
    code = CODE_F16 if o.dtype == np.float16 else CODE_F32
    y = np.zeros(p.out_shape, dtype=np.int8)
    _quantize_rows(p.out_view(o).view(np.uint16 if code == CODE_F16 else np.float32), code,
                   flags, s2, o2, p.out_view(y))
    return y
