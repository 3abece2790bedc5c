"""Row steps of the CPU kernels: one row of a per-thread buffer at a time (load and widen, store and
round, max, exp, band / user mask, the online-softmax step, K^T packing). Compiled without
reference counting (``LEAF``): they take arrays but allocate none."""
import numpy as np
from numba import njit
from ..numerics.band import row_band, row_outcome
from ..numerics.core import (CODE_BF16, CODE_F16, F16_MASK_SCALE, F32_NEG_INF, F32_ONE, F32_POS_INF,
                             F32_ZERO, MASK_ADD_F16, MASK_DISCARD, bf16_to_f32, exp_nonpos,
                             exp_nonpos5, f16_to_f32, f32_as_i32, f32_as_u32, f32_to_bf16,
                             f32_to_f16, from_order_key, online_update, order_key, running_sum,
                             softcapped, softmax_weight, store, times_pow2, u32_as_f32, widen)
from ..numerics.kernel_args import (L_KLEN, L_NEXT, L_PRE, P_CODE, P_G, P_IP, P_MASK, P_PSE,
                                    P_SCALE_EXP, T_L, T_M, T_O, T_P, T_Q)
from ._gemm import PANEL
from ._jit import LEAF, LEAF_EXACT, LEAF_INLINE
from ._simd import PF_ROWS
from ._vector import (bf16_bits_hw, f16_bits_to_f32_hw, f32_to_f16_bits_hw, host_has, prefetch,
                      wide_vectors)
from .kv import KEY, load_dequant_row


# ---------------------------------------------------------------------------------------------
# row helpers (CPU-only: they loop over rows of per-thread buffers)
# ---------------------------------------------------------------------------------------------

#: float16 <-> float32 for the row loads and output rows: VCVTPH2PS / VCVTPS2PH where the CPU
#: has F16C (one instruction per 16 values against about 7 / 15 integer ones; both exact IEEE)
widen_f16 = f16_bits_to_f32_hw if host_has("f16c") else f16_to_f32
_f32_to_f16 = f32_to_f16_bits_hw if host_has("f16c") else f32_to_f16


@njit(**LEAF_INLINE)
def as_u32(x):
    """x as uint32 (Numba widens uint32 arithmetic to 64 bits, which halves the vector lanes:
    each step below is cast back)."""
    return np.uint32(x)


@njit(**LEAF)
def load_row(dst, r, src, off, stride, n, code, factor):
    """dst[r, :n] = widen(src[off + d*stride]) * factor, one loop per storage code so each
    vectorises. Rows are addressed by index and the source through unsigned indices: no
    array views (each costs reference counting) and no negative-index checks (which stop
    the vectoriser)."""
    wide_vectors()
    if stride != 1:
        for d in range(n):
            dst[r, d] = widen(src[off + d * stride], code) * factor
        return
    base = np.uint64(off)
    if code == CODE_F16:
        for d in range(n):
            dst[r, d] = widen_f16(src[base + np.uint64(d)]) * factor
    elif code == CODE_BF16:
        for d in range(n):
            dst[r, d] = bf16_to_f32(src[base + np.uint64(d)]) * factor
    else:
        for d in range(n):
            dst[r, d] = np.float32(src[base + np.uint64(d)]) * factor


@njit(**LEAF)
def load_query_rows(q2, q, geo, item, code, factor):
    """q2[rr] = query row rr of work item (b, g, i0) (rows stacked position-major, see
    items.item_rows) as float32, times factor, for every row of q2."""
    strides, boff, params = geo.strides, geo.boff, geo.params
    b, g, i0 = item
    G = params[P_G]
    for rr in range(q2.shape[0]):
        off = (boff[T_Q, b] + (g * G + rr % G) * strides[T_Q, 0]
               + (i0 + rr // G) * strides[T_Q, 1])
        load_row(q2, rr, q, off, strides[T_Q, 2], q2.shape[1], code, factor)


@njit(**LEAF_EXACT)    # a true division, not 1 / div estimated
def store_row(dst, off, stride, row, r0, div, n, code):
    """dst[off + d*stride] = row[r0 + d] / div in the storage of ``code`` (rounded to nearest
    even), d < n; one loop per code for contiguous rows, so that each vectorises (see
    :func:`load_row`)."""
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


@njit(**LEAF)
def all_finite(buf, n):
    """True when buf[:n] holds no inf or NaN (x * 0 is 0 only for finite x)."""
    wide_vectors()
    chk = F32_ZERO
    for i in range(n):
        chk += buf[i] * F32_ZERO
    return chk == F32_ZERO


@njit(**LEAF)
def row_max(s2, r, n, f):
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


@njit(**LEAF)
def _exp_row(s2, r, n, m, f, post_e):
    """s2[r, :n] = exp((s2[r, :n] * f - m) * 2^post_e) in place; returns the sum."""
    wide_vectors()
    s = F32_ZERO
    if post_e != 0:
        for c in range(n):
            p = softmax_weight(s2[r, c] * f, m, post_e)
            s2[r, c] = p
            s += p
        return s
    for c in range(n):
        p = exp_nonpos(s2[r, c] * f - m)
        s2[r, c] = p
        s += p
    return s


@njit(**LEAF)
def mask_row(s2, r, nc, j0, i, band, inside, extras, where, kinds):
    """Scores s2[r] of query row i over the tile's columns j0 .. j0 + nc - 1 -> pse added,
    fp16 mask added, dropped columns at -inf. band = (kL, preE, nextE); extras = (mask8,
    mask16, pse); where = (mask offset, mask column stride, pse offset, pse column stride) at
    column j0; kinds = (mask kind, whether to add pse, storage code of pse, the factor of what
    is added: 1, or 2^-e for scores kept 2^e times too small, see numerics.kernel_args.scale_factors)."""
    wide_vectors()
    kl, pre_e, next_e = band
    mask8, mask16, pse = extras.mask8, extras.mask16, extras.pse
    moff, msk, poff, psk = where
    mask_kind, has_pse, code, factor = kinds
    srow = s2[r]
    if has_pse:
        for c in range(nc):
            srow[c] += widen(pse[poff + c * psk], code) * factor
    if mask_kind == MASK_ADD_F16:
        mask_scale = F16_MASK_SCALE * factor
        for c in range(nc):
            srow[c] += mask_scale * f16_to_f32(mask16[moff + c * msk])
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


@njit(**LEAF_INLINE)
def element_offsets(geo, b, n, i, j0):
    """(mask offset, mask column stride, pse offset, pse column stride) of query row i of head
    n in batch b at kv column j0 (geo: the :class:`.records.Geometry`)."""
    strides, boff = geo.strides, geo.boff
    return (boff[T_M, b] + i * strides[T_M, 1] + j0 * strides[T_M, 2], strides[T_M, 2],
            boff[T_P, b] + n * strides[T_P, 0] + i * strides[T_P, 1] + j0 * strides[T_P, 2],
            strides[T_P, 2])


@njit(**LEAF_INLINE)
def row_place(geo, item, rr):
    """Where row rr of work item (b, g, i0) goes (rows stacked position-major, see
    items.item_rows): (query position i, query head n, output offset, output element stride,
    softmax_lse offset)."""
    strides, boff, params = geo.strides, geo.boff, geo.params
    b, g, i0 = item
    G = params[P_G]
    i = i0 + rr // G
    n = g * G + rr % G
    return (i, n, boff[T_O, b] + n * strides[T_O, 0] + i * strides[T_O, 1], strides[T_O, 2],
            boff[T_L, b] + n * strides[T_L, 0] + i * strides[T_L, 1])


@njit(**LEAF_INLINE)
def row_end(geo, item, rr, m, l, computed):
    """What becomes of row rr of a finished work item (contract 'Empty rows'): its places
    (:func:`row_place`: query head, output offset, element stride, lse offset) and
    numerics.band.row_outcome's (outcome, band lo, hi, divisor) of its running max and sum
    in m, l (computed False: the item visited no kv column)."""
    i, n, o_off, osd, l_off = row_place(geo, item, rr)
    kl, pre_e, next_e = band_of(geo.lens, item[0])
    return (n, o_off, osd, l_off), row_outcome(True, m[rr] if computed else F32_NEG_INF, l[rr],
                                            geo.params[P_IP], i, pre_e, next_e, kl)


@njit(**LEAF_INLINE)
def band_of(lens, b):
    """(kL, preE, nextE) of batch b."""
    return lens[L_KLEN, b], lens[L_PRE, b], lens[L_NEXT, b]


@njit(**LEAF)
def _prepare_row(s2, r, nc, i, n, b, j0, inside, extras, geo):
    """Scores s2[r] of position i (query head n, batch b) of the tile from column j0, in
    place: softcapped, pse and fp16 mask added, columns outside the band or masked set to
    -inf. extras, geo: the :class:`.records.Extras` and Geometry."""
    params = geo.params
    factor = times_pow2(F32_ONE, -params[P_SCALE_EXP])   # scores kept 2^-e times their value
    if extras.softcap[0] != F32_ZERO:
        _softcap_row(s2[r], nc, extras.softcap[0] * factor)
    mask_row(s2, r, nc, j0, i, band_of(geo.lens, b), inside, extras,
              element_offsets(geo, b, n, i, j0),
              (params[P_MASK], params[P_PSE] != 0, params[P_CODE], factor))


@njit(**LEAF_INLINE)
def has_user_terms(params, extras):
    """Whether the scores take a user's terms (a mask, pse, a softcap) before the softmax."""
    return params[P_MASK] != 0 or params[P_PSE] != 0 or extras.softcap[0] != F32_ZERO


@njit(**LEAF)
def _softcap_row(srow, nc, cap):
    """srow[:nc] = cap * tanh(srow / cap): the scores softcapped (cap in the scores' units)."""
    for c in range(nc):
        srow[c] = softcapped(srow[c], cap)


@njit(**LEAF)
def _online_row(s2, r, nc, rr, state, p3, split, lazy, keys, f, post_e):
    """Online-softmax step of the scores s2[r, :nc] * f (query row rr; state = (m, l, alpha)):
    update m and l, set alpha (the acc rescale factor) and turn the scores into
    p = exp((s * f - m) * 2^post_e): in place, or (``split``) into bf16 hi / lo parts p3[r, 0]
    and p3[r, 1]. The row's max is from_order_key(keys[r]) where the product computed it
    (``keys`` not empty; f is 1 then), else taken here.

    ``lazy`` (split rows only): a row with a finite running max first tries one pass that
    takes p = exp(s * f - m_old) against the old max and keeps it when no score exceeds that
    by more than LAZY_MARGIN (p <= e^LAZY_MARGIN: m, acc and l stay as they are, softmax and
    lse unchanged); otherwise the max pass and a second exp pass run as usual. After a row's
    first tile its max seldom grows by that much, so most tiles take one pass instead of two.
    Split rows are the AMX kernel's, which never has a post_e (driver.amx_reasons)."""
    m, l, alpha = state
    m_old = m[rr]
    if lazy and keys.size == 0 and F32_NEG_INF < m_old < F32_POS_INF:
        s, over = _exp_row_split(s2, r, nc, m_old, p3, f)
        if not over:
            l[rr] = l[rr] + s
            alpha[rr] = F32_ONE
            return
    mx = from_order_key(keys[r]) if keys.size else row_max(s2, r, nc, f)
    m_new, a = online_update(m_old, mx, post_e)
    if m_new == F32_NEG_INF:
        if split:
            p3[r, :, :] = 0
        else:
            s2[r, :nc] = F32_ZERO
        alpha[rr] = F32_ONE
        return
    if split:
        s, _ = _exp_row_split(s2, r, nc, m_new, p3, f)
    else:
        s = _exp_row(s2, r, nc, m_new, f, post_e)
    l[rr] = running_sum(l[rr], a, s)
    m[rr] = m_new
    alpha[rr] = a


@njit(**LEAF)
def rescale_rows(acc, ld, R, D, alpha):
    """acc[rr, :D] *= alpha[rr] (acc rows of ld values) for the rows whose running max moved."""
    wide_vectors()
    a2 = acc[:R * ld].reshape(R, ld)
    for rr in range(R):
        a = alpha[rr]
        if a != F32_ONE:
            for d in range(D):
                a2[rr, d] = a2[rr, d] * a


@njit(**LEAF)
def softmax_rows(s2, p3, keys, seg, item, extras, geo, state, scale):
    """Rows [r0, r1) of a segment's scores s2[rr - r0, :nc] (columns from cl), times ``scale``:
    masked where needed, then the online-softmax step; p goes in place or (``split``) into
    p3[rr - r0] as bf16 hi / lo parts. Rows that need no mask are scaled inside the max and exp
    passes; the others are scaled first. ``keys`` (empty: none): the order keys of the row
    maxima of unmasked scores (scale 1), from the product.
    seg = (r0, r1, nc, cl, inside, split, lazy); item = (b, g, i0) (see items.item_rows)."""
    r0, r1, nc, cl, inside, split, lazy = seg
    b, g, i0 = item
    params = geo.params
    G = params[P_G]
    any_user = has_user_terms(params, extras)
    post_e = params[P_SCALE_EXP]
    for rr in range(r0, r1):
        r = rr - r0
        f = scale
        if any_user or not inside:
            if scale != F32_ONE:
                scale_row(s2, r, nc, scale)
            f = F32_ONE
            _prepare_row(s2, r, nc, i0 + rr // G, g * G + rr % G, b, cl, inside, extras, geo)
        _online_row(s2, r, nc, rr, state, p3, split, lazy, keys, f, post_e)


@njit(**LEAF_INLINE)
def prefetch_row(src, off, n):
    """Prefetch the cache lines of src[off:off + n] (a K or V row: rows of one head lie N * D
    apart in BSH / BSND inputs, too far for the hardware prefetcher)."""
    for x in range(0, n, 64 // src.itemsize):
        prefetch(src, off + x)
    prefetch(src, off + n - 1)


@njit(**LEAF)
def pack_kt(kt, src, offs, sd, nc, D, code, tb, dq):
    """K tile (nc rows from src at element offsets offs[c], widened) as K^T panels for
    _gemm.scores: kt[p * PANEL * D + d * PANEL + c] = K[p * PANEL + c, d]; the last panel's
    columns past nc are zero. Rows are widened 16 at a time into ``tb`` (16 * D values;
    vectorised), dequantized where dq = (on, key scales, key offsets, g * D, rs) says (see
    kv.dequant_row), and then transposed."""
    dequant, cs, co, base, rs = dq
    wide_vectors()
    tmp = tb[:16 * D].reshape(16, D)
    for c0 in range(0, nc, 16):
        cn = min(16, nc - c0)
        for cc in range(cn):
            if c0 + cc + PF_ROWS < nc:
                prefetch_row(src, offs[c0 + cc + PF_ROWS], D * sd)
            if dequant:
                load_dequant_row(tmp, cc, src, offs[c0 + cc], sd, D, cs, co, base,
                                 rs[KEY, c0 + cc], rs[KEY + 1, c0 + cc])
            else:
                load_row(tmp, cc, src, offs[c0 + cc], sd, D, code, F32_ONE)
        dst = (c0 // PANEL) * PANEL * D + c0 % PANEL      # the 16 columns share a panel
        for d in range(D):
            col = kt[dst + d * PANEL:dst + d * PANEL + cn]
            for cc in range(cn):
                col[cc] = tmp[cc, d]
    last = (nc // PANEL) * PANEL * D
    for c in range(nc % PANEL, PANEL if nc % PANEL else 0):
        for d in range(D):
            kt[last + d * PANEL + c] = F32_ZERO


#: The lazy softmax step (see _online_row) keeps p = exp(s - m_old) up to e^LAZY_MARGIN, so acc
#: may grow that much more than with p <= 1: it runs only where |V| < 2^64 (bf16: exponent
#: field below LAZY_V_LIMIT; float16 always).
LAZY_MARGIN = np.float32(8.0)
LAZY_V_LIMIT = np.uint32((127 + 64) << 7)
_LAZY_MARGIN_BITS = LAZY_MARGIN.view(np.int32)


@njit(**LEAF)
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
        p3[r, 0, c] = np.uint16(as_u32(u >> as_u32(16)))
        p3[r, 1, c] = _bf16_bits(p - u32_as_f32(as_u32(u & as_u32(0xFFFF0000))))
    p3[r, :, n:] = 0
    return s, top > _LAZY_MARGIN_BITS


#: float32 -> bf16 bits, round to nearest even, for the low parts of p (finite, below 2^-7)
_bf16_bits = bf16_bits_hw if host_has("avx512bf16") else f32_to_bf16


@njit(**LEAF)
def scale_row(s2, r, n, f):
    wide_vectors()
    for c in range(n):
        s2[r, c] = s2[r, c] * f
