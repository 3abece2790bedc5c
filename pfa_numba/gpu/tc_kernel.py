"""The tensor-core (FlashAttention-2 class) CUDA kernel for float16 / bfloat16, and when it runs.

:func:`tc_kernel_source` returns the ``@cuda.jit`` source for a 16-bit type, a head dim D (64
or 128), whether scores are made per accumulator (``masked``: a user mask or pse to read, or
a softcap) and whether they are softcapped (``capped``), all compile-time; its arguments
are the scalar kernels' common ones (``kernels.kernel_signature(..., kv_cache=False)``, built by
``numerics.kernel_args.kernel_args``), so every layout (padded or TND), GQA, the masks, pse, the
lengths and the band reach it through the same ``T_*`` offsets, ``L_*`` lengths and ``P_*`` /
``F_*`` slots. Its specification is the NumPy warp model :func:`.warp_model.fa2_block`: the
masking and every lane map (:mod:`.fragments`) are the model's; the kernel visits the tiles in
another order (below), which moves results by float32 rounding only.

One block: 4 warps x 16 query rows (64 rows) of one (batch, query head), 128 threads; the grid
is (B x query-row blocks, N), each batch's blocks in reverse row order (a causal band's longest
blocks first). The block's kv columns [jstart, jend) (``block_kv_range``: tiles outside the
band are never visited) go in tiles of 64 keys, in two loops (FA2's unmasked and masked
steps): first the run of whole tiles inside every row's band (``numerics.band.interior_tiles``), with
no band test at all, then the tiles crossing it, tested per accumulator. The masked variant
tests every tile per accumulator (band, pse, mask, one predicated load each) in one loop.
Tiles are staged by ``cp.async`` (rows at or past jend zero-filled) into XOR-swizzled shared
memory: one K and one V buffer, each loaded while the other is in use (FA2's interleave: V(t)
arrives during S = Q K(t)^T, K(next) during O += P V(t)); two stages of each would need 64 KiB
at D = 128, over the 48 KiB of static shared memory. Q is staged through the K buffer once
and held in registers as A fragments (``ldmatrix``). Per tile and warp: S by ``mma.sync``
m16n8k16 (K by plain ldmatrix), what the tile needs of the band, pse and masks; the online
softmax in registers in log2 units, the scale folded into the weights
(p = exp2(fma(s, scale * log2 e, -m)), m the running max of the same products: a negative
scale negates Q instead, so the factor is >= 0 and the max of s gives the max); quad
``shfl_xor`` for the row maxima; P packed from S (``p_from_s``) to the input type; O += P V (V
by ``ldmatrix.trans``). A warp skips a tile none of its rows keeps a column of. At the end: the
head's sink logit joining a kept row's sum (``numerics.core.row_total_log2``), the division,
the rows of contract 'Empty rows' (``row_outcome``; ROW_MEAN rows average V from global
memory), lse, and the output rounded by cvt.rn (as numerics.core.f32_to_f16 / _bf16 round),
staged through the K buffer and written in coalesced 16-byte stores.

The instruction mix (``python -m pfa_numba cuda-ptx`` writes it; tests/ptx/test_tc_kernel.py
holds it): addresses are computed once per lane and reached by constants
(``fragments.swizzle_step`` for ldmatrix, 32-bit shared addresses, kv row offsets in 32 bits
on a 64-bit head base, advanced by adds), so the kv loops hold no 64-bit multiply-add; row
maxima by ``max.NaN``, weights by one ``ex2.approx.ftz`` (config.CUDA_EXP2_FTZ).

fused_infer_attention_score's paged and prefixed caches take the ``walk`` variant: each K
row's place is found through the kv sequence (``kernels.kv_block_of`` / ``kv_place_in``: a
shared prefix's rows, then the batch's own in the slots of its blocks), the V row of the same
place reuses its block-table column, and the offsets are 64-bit. An int8 cache takes the
``int8`` variant (walking): its rows are copied as int8 past each 16-bit tile and
dequantized into it by the threads that copied them (``dequant.make_dequant``), the guard
scanning its token planes' limits (``guard.antiquant_limits``).

Not this kernel (:func:`.tc_conditions.tensor_core_reason` says why; the scalar kernel runs
them): other
dtypes and head dims, quantized outputs, int8 kv caches whose channel planes could take a
dequantized value beyond the query's type,
scale_value 0 or needing a second factor or a power of two, rows or strides not
16-byte aligned, mask or pse columns not contiguous, a key or value head spanning 2^31
elements, compute capability < 8.0, and a V holding inf or NaN (a dropped column would reach
the rows through 0 * inf in P V, see the warp model: a scan before the kernel finds it on the
device, and the kernel then leaves the call to the portable kernel launched beside it,
``guard.nonfinite_scan``).
"""
import numba
import numpy as np
from numba import cuda, float32, int32, uint16, uint32

from .. import config
from ..numerics.band import ROW_MEAN, ROW_SOFTMAX, kv_tiles, row_band, row_outcome
from ..numerics.core import (CODE_BF16, CODE_F16, F16_MASK_SCALE, F32_NEG_INF, F32_ONE, F32_ZERO,
                             MASK_ADD_F16, MASK_DISCARD, bf16_to_f32, f16_to_f32, f32_to_bf16,
                             f32_to_f16, lse_log2, online_update_log2, sink_lse_log2)
from ..numerics.kernel_args import (F_SCALE, F_SOFTCAP, L_KLEN, L_NEXT, L_PRE, L_QLEN, L_ROWS,
                                    P_G, P_IP, P_LSE, P_MASK, P_PSE, T_K, T_L, T_M, T_O, T_P, T_PK,
                                    T_PV, T_Q, T_V)
from . import HEAD_DIMS
from . import fragments as F
from . import ptx as X
from .dequant import make_dequant, row_tokens
from .kernels import (IN_PREFIX, PAST_END, array_function, device_function, head_sink,
                      kv_at, kv_block_of, kv_place_in, kv_places, kv_value, thread_place)

#: query rows per warp / warps per block / rows per block / threads per block / keys per tile
WARP_ROWS, WARPS = F.MMA_M, 4
ROWS, THREADS, BKV = WARP_ROWS * WARPS, F.WARP * WARPS, 64
#: head dims with a specialisation
FULL = 0xFFFFFFFF
SIGNS = np.uint32(0x80008000)      # the sign bits of two packed float16 / bfloat16 values
#: under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) the kernel runs as Python, its warp-level
#: instructions those of .warp_sim
SIMULATOR = numba.config.ENABLE_CUDASIM
LOG2E = np.float32(1.4426950408889634)
_device = device_function
BIAS_F16 = np.float32(F16_MASK_SCALE * LOG2E)       # the float16 mask's -10000, in log2 units


def make_mma_pair(kind):
    """``mma_pair(c, e, a, ka, b)``: c[e:e + 8] += A B on tensor cores (mma m16n8k16 of
    ``kind``, f16 or bf16), A the fragment a[ka:ka + 4], B two n-tiles of 8 columns whose
    fragments ``b`` = (b0, b1, b2, b3) one ldmatrix x4 gave: c[e:e + 4] takes the first,
    c[e + 4:e + 8] the second."""
    mma = X.mma_m16n8k16_f16 if kind == "f16" else X.mma_m16n8k16_bf16

    def mma_pair(c, e, a, ka, b):
        a0, a1, a2, a3 = a[ka], a[ka + 1], a[ka + 2], a[ka + 3]
        c[e], c[e + 1], c[e + 2], c[e + 3] = mma(a0, a1, a2, a3, b[0], b[1], c[e], c[e + 1],
                                                 c[e + 2], c[e + 3])
        c[e + 4], c[e + 5], c[e + 6], c[e + 7] = mma(a0, a1, a2, a3, b[2], b[3], c[e + 4],
                                                     c[e + 5], c[e + 6], c[e + 7])
    return device_function(mma_pair)


def make_online_step(ns, no):
    """``online_step(s, o, mr, lr, fold)``: the online-softmax step of a warp's scores s
    (``ns`` n-tiles of 8 keys, accumulators 4 nt + e of this lane's row g and 4 nt + 2 + e of
    row g + 8) against the running max mr and sum lr of those rows and their ``no`` n-tiles
    of output accumulators o: t = s * fold (log2 units), the rows' tile maxima over the lane
    quad, the new max and rescale factor, s = the weights exp2(t - m), lr gains their sum and
    o is rescaled. (fold >= 0, so the max of s * fold is fold times the max of s, rounded
    alike.)"""
    exp2 = X.exp2_approx_ftz if config.CUDA_EXP2_FTZ else X.exp2_approx

    def online_step(s, o, mr, lr, fold):
        tm0, tm1 = X.max_nan_f32(s[0], s[1]), X.max_nan_f32(s[2], s[3])
        for nt in range(1, ns):
            tm0 = X.max_nan_f32(tm0, X.max_nan_f32(s[4 * nt], s[4 * nt + 1]))
            tm1 = X.max_nan_f32(tm1, X.max_nan_f32(s[4 * nt + 2], s[4 * nt + 3]))
        for sh in (1, 2):
            tm0 = X.max_nan_f32(tm0, X.shfl_xor_sync(FULL, tm0, sh))
            tm1 = X.max_nan_f32(tm1, X.shfl_xor_sync(FULL, tm1, sh))
        for h in range(2):
            m_new, shift, m_sub = online_update_log2(mr[h], (tm0 if h == 0 else tm1) * fold)
            alpha = exp2(shift)
            part = F32_ZERO
            for nt in range(ns):
                for e in range(2):
                    x = 4 * nt + 2 * h + e
                    pv = exp2(X.fma_f32(s[x], fold, -m_sub))
                    s[x] = pv
                    part += pv
            lr[h] = lr[h] * alpha + part
            mr[h] = m_new
            for dt in range(no):
                o[4 * dt + 2 * h] *= alpha
                o[4 * dt + 2 * h + 1] *= alpha
    return device_function(online_step)


@array_function
def start_rows(mr, lr, o):
    """A block's rows before their first tile: running max -inf and sum 0 (this lane's two
    rows g, g + 8), output accumulators 0."""
    for h in range(2):
        mr[h], lr[h] = F32_NEG_INF, F32_ZERO
    for x in range(o.size):
        o[x] = F32_ZERO


@array_function
def banded(t, j, lo, hi):
    """t where key j is inside the row's band [lo, hi], else -inf."""
    return t if j >= lo and j <= hi else F32_NEG_INF


@array_function
def band32(i, ql, jc, pre_e, next_e, kl):
    """Row i's kept columns [lo, hi] relative to key jc, in 32 bits (so that a tile's tests
    compare with constants); an empty range for a row at or past qL."""
    lo, hi = row_band(i, pre_e, next_e, kl)
    if i >= ql:
        return np.int32(1), np.int32(0)
    return np.int32(lo - jc), np.int32(hi - jc)


@array_function
def _row(boff, strides, t, b, head, j):
    """Element offset of row j of head ``head`` of batch b of tensor t (a T_* row)."""
    return boff[t, b] + head * strides[t, 0] + j * strides[t, 1]


@array_function
def _stage(smem, dst, src, base, row, stride, rows_left, chunks, row_step, row_elems):
    """cp.async this thread's ``chunks`` 16-byte chunks of a tile into ``smem``: its first at
    shared offset ``dst`` from row ``row`` of ``src`` past element ``base`` (rows ``stride``
    elements apart), each next ``row_step`` rows below. The row offsets are 32-bit (the span a
    tensor_core_reason bounds) and advanced by an add: no multiply per chunk. Chunks of rows at
    or past ``rows_left`` are zero-filled (read from ``base``, a valid address, for 0 bytes)."""
    off, step = np.int32(np.int32(row) * np.int32(stride)), np.int32(row_step * stride)
    rows_left = np.int32(rows_left)
    for c in range(chunks):
        ok = np.int32(c * row_step) < rows_left
        X.cp_async_16_zfill(smem, dst + c * row_step * row_elems, src,
                            base + (off if ok else np.int32(0)), 16 if ok else 0)
        off = np.int32(off + step)


@_device
def stage_walked(smem, to, is_v, j, jend, columns, c, places, table, b, kv, ccol):
    """cp.async the 16-byte chunk at head dim ``ccol`` of kv row j, found through the kv
    sequence (``kv``: the cache's K, V and the prefix's K, V), to shared offset ``to`` (zero-
    filled for a row at or past jend). K divides to find the row's block-table column, kept
    in ``columns[c]``; V, staged next over the same rows, reuses it."""
    if not is_v:
        columns[c] = PAST_END
        if j < jend:
            columns[c] = kv_block_of(places[0], places[1], j)
    if columns[c] == PAST_END:
        X.cp_async_16_zfill(smem, to, kv[0], 0, 0)
    else:
        where, idx = kv_place_in(places[0], places[1], table, b, j, columns[c])
        prefix = where == IN_PREFIX
        src = (kv[3] if prefix else kv[1]) if is_v else (kv[2] if prefix else kv[0])
        X.cp_async_16_zfill(smem, to, src, kv_at(places, where, idx) + ccol, 16)


@array_function
def _tile_order(idx, ta, tb):
    """The tile a block visits idx-th: the run [ta, tb) inside the band first (no per-element
    band test), then the tiles before it, then those after."""
    inside = tb - ta
    if idx < inside:
        return ta + idx
    e = idx - inside
    return e if e < ta else e + inside


@array_function
def _warp_busy(lens, b, wi, j0):
    """Whether any of the warp's rows [wi, wi + 16) keeps a column of the tile [j0, j0 + 64)
    (else the warp skips the tile: its scores would all be -inf)."""
    ql, kl, pre_e, next_e = lens[L_QLEN, b], lens[L_KLEN, b], lens[L_PRE, b], lens[L_NEXT, b]
    wlo, _ = row_band(wi, pre_e, next_e, kl)
    _, whi = row_band(min(wi + WARP_ROWS, ql) - 1, pre_e, next_e, kl)
    return wi < ql and j0 <= whi and j0 + BKV - 1 >= wlo


@array_function
def softcap_terms(fparams):
    """(cap2, k) of the call's softcap for :func:`make_softcap_log2`: the cap in log2 units
    and 2 log2 e / cap2."""
    cap2 = fparams[F_SOFTCAP] * LOG2E
    return cap2, (LOG2E + LOG2E) / cap2


def make_softcap_log2():
    """``softcap_log2(t, cap)``: ``numerics.core.softcapped`` of a score t in log2 units,
    cap = (cap2, k) of :func:`softcap_terms`: cap2 tanh(t / cap2), written as
    cap2 - 2 cap2 / (1 + 2^(t k)) on the SFU (one ex2, one rcp: libdevice's tanh in every
    accumulator's step would not leave the fragments in registers). Its error is a few
    float32 ulp of cap2 (the 1 - 2 / (1 + e) cancels near 0): below the 16-bit rounding of P
    for the caps of :data:`SOFTCAP_RANGE` (:func:`softcap_reason` leaves others to the
    portable kernel); +-inf give +-cap2 and NaN stays NaN, as tanh."""
    exp2 = X.exp2_approx_ftz if config.CUDA_EXP2_FTZ else X.exp2_approx

    def softcap_log2(t, cap):
        cap2, k = cap
        return X.fma_f32(X.rcp_approx_ftz(F32_ONE + exp2(t * k)), -(cap2 + cap2), cap2)
    return _device(softcap_log2)


def make_row_masks(ns, code, capped=False):
    """The masked kernels' step for one row half of a tile's ``ns`` S n-tiles (``code``: the
    inputs' CODE_F16 / CODE_BF16; ``capped``: the call has a softcap):
    ``row_masks(s, h, c2, lo, hi, p_at, m_at, ex)`` makes the accumulators of row half h
    t = s * c2 (the scale in log2 units), softcapped where ``capped``, inside the row's band
    [lo, hi] (relative to the lane's first key) and -inf outside, then adds pse and the
    float16 mask and drops the discard mask's columns, read by predicated loads at constant
    offsets from the row's pse and mask at the lane's first key (``p_at``, ``m_at``: their
    columns contiguous). ``ex``: (pse, mask8, mask16, has pse, mask kind, the rows' pse and
    mask offsets, the softcap's :func:`softcap_terms`)."""
    softcap_log2 = make_softcap_log2()
    def add_terms(s, h, src, at, lo, hi, weight, is_f16):
        """s of row half h += weight * the 16-bit terms of ``src`` at the lane's columns from
        ``at`` (read inside the band only)."""
        for nt in range(ns):
            for e in range(2):
                c = np.int32(8 * nt + e)
                raw = X.load_u16_if(src, at + c, c >= lo and c <= hi)
                s[4 * nt + 2 * h + e] += weight * (X.cvt_f32_f16(raw) if is_f16
                                                   else bf16_to_f32(raw))

    terms = _device(add_terms)

    def row_masks(s, h, c2, lo, hi, p_at, m_at, ex):
        pse, mask8, mask16, has_pse, mask_kind = ex[0], ex[1], ex[2], ex[3], ex[4]
        for nt in range(ns):
            for e in range(2):
                x = 4 * nt + 2 * h + e
                t = s[x] * c2
                if capped:
                    t = softcap_log2(t, ex[7])
                s[x] = banded(t, np.int32(8 * nt + e), lo, hi)
        if has_pse:
            terms(s, h, pse, p_at, lo, hi, LOG2E, code == CODE_F16)
        if mask_kind == MASK_ADD_F16:
            terms(s, h, mask16, m_at, lo, hi, BIAS_F16, True)
        elif mask_kind == MASK_DISCARD:
            for nt in range(ns):
                for e in range(2):
                    c = np.int32(8 * nt + e)
                    if X.load_u8_if(mask8, m_at + c, c >= lo and c <= hi) != 0:
                        s[4 * nt + 2 * h + e] = F32_NEG_INF
    return _device(row_masks)


def tc_kernel_source(kind, d, masked=False, walk=False, int8=False, capped=False, sinks=False):
    """The kernel's Python source (before ``cuda.jit``) for ``kind`` ("f16" or "bf16"), head
    dim ``d`` (64 or 128), ``masked``: whether it reads a user mask and pse (the variant
    without them has no per-element loads in its kv loop), ``walk``: whether K/V rows are
    found through fused_infer_attention_score's kv sequence (a shared prefix, a paged pool's
    block table: ``kernels.kv_place``), else each batch's own contiguous rows, and ``int8``
    (walking): an int8 cache, each tile staged as int8 rows and dequantized into the tile by
    the threads that copied them (``dequant.make_dequant``); ``capped`` (masked): a softcap on
    every score (:func:`make_softcap_log2`); ``sinks``: each head's sink logit joins its kept
    rows' sums (compiled only for calls with sinks: its few instructions at the finish made
    the walking D 128 variants spill; sinks come from the SDPA drop-in, whose kv rows are
    contiguous, so no walking variant has them)."""
    assert kind in ("f16", "bf16") and d in HEAD_DIMS and (walk or not int8)
    assert (masked or not capped) and not (walk and sinks)
    D = d
    KT = D // 16                       # k-steps of S = Q K^T; pairs of 8-column n-tiles of O
    NO = D // 8                        # n-tiles of O (8 head dims each)
    NS = BKV // 8                      # n-tiles of S (8 keys each)
    QREGS, OACC, SACC, PREGS = KT * 4, NO * 4, NS * 4, BKV // 4
    TILE = BKV * D                     # 16-bit values of one K or V tile (= the Q block's)
    CPT = TILE // F.CHUNK // THREADS   # 16-byte chunks each thread copies per tile
    RSTEP = THREADS // (D // F.CHUNK)  # rows between a thread's chunks of a tile
    OUT_CHUNKS = WARP_ROWS * D // F.CHUNK // F.WARP   # 16-byte output stores per lane
    mma_pair = make_mma_pair(kind)
    online_step = make_online_step(NS, NO)
    exp2 = X.exp2_approx_ftz if config.CUDA_EXP2_FTZ else X.exp2_approx
    pack = X.pack_f16x2 if kind == "f16" else X.pack_bf16x2
    to_f32 = f16_to_f32 if kind == "f16" else bf16_to_f32
    to_bits = f32_to_f16 if kind == "f16" else f32_to_bf16
    CODE = CODE_F16 if kind == "f16" else CODE_BF16
    MASKED, WALK, INT8, CAPPED = bool(masked), bool(walk), bool(int8), bool(capped)
    SINKS = bool(sinks)
    ALIGN = None if SIMULATOR else 16  # the simulator's shared arrays take no alignment
    # a staged kv row: 16-bit words in shared memory, 16-byte chunks each thread copies a
    # tile, rows between them; int8 rows are staged past each tile (at RAW_AT), unswizzled
    ROW_U16 = D // 2 if INT8 else D
    KV_CPT = BKV * ROW_U16 // 8 // THREADS
    KV_RSTEP = THREADS // (ROW_U16 // 8)
    RAW_AT = TILE if INT8 else 0
    SMEM = RAW_AT + BKV * ROW_U16 if INT8 else TILE     # 16-bit words of the K or V buffer
    dequant_chunk = make_dequant(kind, D)

    def stage_kv(smem, is_v, j_row, rows_left, kv):
        """Stage this thread's chunks of a K (``is_v`` False) or V tile whose rows start at
        ``j_row`` for this thread (rows at or past ``rows_left`` of them, or past the block's
        jend when walking, zero-filled). Walking, K finds each row's place through the kv
        sequence (the division a row) and the V tile of the same rows, staged next, reuses its
        block-table columns."""
        k, v, k_base, v_base, ks1, vs1, c_at, crow, jend, wk = kv
        if not WALK:
            if is_v:
                _stage(smem, c_at, v, v_base, j_row, vs1, rows_left, CPT, RSTEP, D)
            else:
                _stage(smem, c_at, k, k_base, j_row, ks1, rows_left, CPT, RSTEP, D)
            return
        kp, vp, table, b, gh, ccol, geometry, k_places, columns = wk
        strides, boff, params = geometry     # V's places, read per tile: registers are short
        places = kv_places(strides, boff, params, T_V, T_PV, b, gh) if is_v else k_places
        j = j_row
        for c in range(KV_CPT):
            stage_walked(smem, RAW_AT + c_at + c * KV_RSTEP * ROW_U16, is_v, j, jend, columns,
                          c, places, table, b, (k, v, kp, vp), ccol)
            j += KV_RSTEP

    stage_kv = _device(stage_kv)

    def dequantize(tile, r, j0, kv, dq):
        """The int8 variant: this thread's staged chunks of K (r = 0) or V (r = 1) tile j0,
        landed (its own copies: no barrier before), dequantized into ``tile``."""
        c_at, crow, jend, ccol = kv[6], kv[7], kv[8], kv[9][5]
        at0, at1 = F.swizzle(crow, ccol, D), F.swizzle(crow, ccol + 8, D)
        for c in range(KV_CPT):
            j = j0 + crow + c * KV_RSTEP
            scale, offset = row_tokens(r, j, jend, dq)
            dequant_chunk(tile, RAW_AT + c_at + c * KV_RSTEP * ROW_U16, tile,
                          at0 + c * KV_RSTEP * D, at1 + c * KV_RSTEP * D, r, ccol, j < jend,
                          scale, offset, dq)

    dequantize = _device(dequantize)

    def landed(tile, r, j0, kv, dq):
        """Wait for this thread's copies of K (r = 0) or V (r = 1) tile j0 (the int8 variant:
        and dequantize them), then for every thread's."""
        X.cp_async_wait(0)
        if INT8:
            dequantize(tile, r, j0, kv, dq)
        cuda.syncthreads()

    landed = _device(landed)

    def v_value(v, vp, table, strides, boff, params, dq, b, gh, j, col):
        """V[j, col] of kv head gh of batch b as float32: row j of the kv sequence, int8
        dequantized (``kernels.kv_value``) when walking, else of the batch's own rows."""
        if WALK:
            return kv_value(v, vp, table, strides, boff, params, dq[0], dq[1], dq[2], dq[3],
                            dq[4], 1, b, gh, j, col)
        return to_f32(v[_row(boff, strides, T_V, b, gh, j) + col * strides[T_V, 2]])

    v_value = _device(v_value)

    def scores(s, j0, band, lane_at, rows, ex):
        """What the tile's scores need before the softmax: the masked variant's t = s * scale *
        log2 e with the band, pse and masks per accumulator; else s as it is (the scale is
        folded into the weights' fma) with the band per accumulator only on a tile that
        crosses it (``band``)."""
        a_at, b_at, g4, t4, wi = lane_at
        lens, b, ql, kl, pre_e, next_e, c2 = rows
        ia, jc = wi + g4, j0 + 2 * t4            # the lane's first row and key
        if MASKED:
            p_rows, m_rows = ex[5], ex[6]
            for h in range(2):
                lo, hi = band32(ia + 8 * h, ql, jc, pre_e, next_e, kl)
                row_masks(s, h, c2, lo, hi, p_rows[h] + jc, m_rows[h] + jc, ex)
            return
        if band:
            for h in range(2):
                lo, hi = band32(ia + 8 * h, ql, jc, pre_e, next_e, kl)
                for nt in range(NS):
                    for e in range(2):
                        x = 4 * nt + 2 * h + e
                        s[x] = banded(s[x], np.int32(8 * nt + e), lo, hi)

    def make_tile_step(band):
        """One tile of the kv loop (``band``: the tile crosses the band of some row)."""
        def tile_step(j0, jn, smem, kv, frag, lane_at, rows, ex, dq):
            ks, vs = smem
            crow, jend = kv[7], kv[8]
            qa, o, s, pa, mr, lr = frag
            a_at, b_at, g4, t4, wi = lane_at
            landed(ks, 0, j0, kv, dq)      # K(j0) landed; every warp is done with V(before)
            # (a tile inside the band is whole: its rows need no zero-fill test)
            stage_kv(vs, True, j0 + crow, jend - j0 - crow if band else BKV, kv)
            X.cp_async_commit()
            # (inside the band, a warp with a row below qL keeps every column of the tile)
            busy = _warp_busy(rows[0], rows[1], wi, j0) if band else wi < rows[2]
            if busy:
                # S = Q K^T: n-tiles of 8 keys in pairs (one ldmatrix x4 gives both B fragments)
                for x in range(SACC):
                    s[x] = F32_ZERO
                for pair in range(NS // 2):
                    for kk in range(KT):
                        mma_pair(s, 8 * pair, qa, 4 * kk,
                                 X.ldmatrix_x4(ks, F.swizzle_step(b_at, 16 * pair, 16 * kk, D)))
                scores(s, j0, band, lane_at, rows, ex)
                # t = s * fold, in log2 units
                online_step(s, o, mr, lr, F32_ONE if MASKED else rows[6])
                # P's A fragments from the S accumulators, packed now (16 registers, not 32)
                for kk in range(BKV // 16):
                    for reg in range(4):
                        nt2, x = F.p_from_s(reg)
                        e = 4 * (2 * kk + nt2) + x
                        pa[4 * kk + reg] = pack(s[e], s[e + 1])
            landed(vs, 1, j0, kv, dq)      # V(j0) landed; every warp is done with K(j0)
            if jn >= 0:                     # the next tile's K, during O += P V
                stage_kv(ks, False, jn + crow, jend - jn - crow, kv)
                X.cp_async_commit()
            if busy:
                # O += P V, V by ldmatrix.trans
                for kk in range(BKV // 16):
                    for dp in range(KT):
                        mma_pair(o, 8 * dp, pa, 4 * kk, X.ldmatrix_x4_trans(
                            vs, F.swizzle_step(a_at, 16 * kk, 16 * dp, D)))
        return _device(tile_step)

    row_masks = make_row_masks(NS, CODE, CAPPED)
    scores = _device(scores)
    tile_inside, tile_edge = make_tile_step(False), make_tile_step(True)

    def attention_tc(q, k, v, out, lse, mask8, mask16, pse, strides, boff, lens, params, qtiles,
                     fparams, scale2, offset2, guard, guard_id, kp, vp, table, channel, kts, kto,
                     vts, vto):
        if guard_id != 0 and guard[0] == guard_id:     # the guard found what the portable
            return                                      # kernel computes: it runs the call
        ks = cuda.shared.array(SMEM, uint16, alignment=ALIGN)
        vs = cuda.shared.array(SMEM, uint16, alignment=ALIGN)
        qa = cuda.local.array(QREGS, uint32)
        o = cuda.local.array(OACC, float32)
        s = cuda.local.array(SACC, float32)
        pa = cuda.local.array(PREGS, uint32)        # P as A fragments, 4 per k-step of 16 keys
        mr = cuda.local.array(2, float32)          # running max of the lane's rows g, g + 8
        lr = cuda.local.array(2, float32)          # this lane's part of their sums
        tid, lane, w, g4, t4 = thread_place()
        b = cuda.blockIdx.x // qtiles
        # the last query rows first: under a causal band they have the most tiles, so the
        # longest blocks start in the first wave and the grid ends without a long tail
        i0 = (qtiles - 1 - (cuda.blockIdx.x - b * qtiles)) * ROWS
        n = cuda.blockIdx.y
        gh = n // params[P_G]
        ql, kl, pre_e, next_e = lens[L_QLEN, b], lens[L_KLEN, b], lens[L_PRE, b], lens[L_NEXT, b]
        i1 = min(i0 + ROWS, ql)
        jstart, jend, ntiles, ta, tb = kv_tiles(i0, i1, kl, pre_e, next_e, BKV)
        if MASKED:                          # every tile is tested per element: one loop
            ta, tb = 0, 0
        wi = i0 + w * WARP_ROWS                             # the warp's first row
        start_rows(mr, lr, o)
        lane_at = F.lane_addresses(lane, D) + (g4, t4, wi)
        # this thread's first chunk of a tile: its row, its shared offset, its column
        crow, ccol = F.tile_chunk(tid, D)
        c_at = F.swizzle(crow, ccol, D)
        # (an int8 tile's chunks: 16 values, rows unswizzled)
        krow, kcol = (tid // (D // 16), tid % (D // 16) * 16) if INT8 else (crow, ccol)
        k_at = krow * ROW_U16 + kcol // 2 if INT8 else c_at
        wk = (kp, vp, table, b, gh, kcol, (strides, boff, params),
              kv_places(strides, boff, params, T_K, T_PK, b, gh), cuda.local.array(KV_CPT, int32))
        kv = (k, v, _row(boff, strides, T_K, b, gh, 0) + ccol,
              _row(boff, strides, T_V, b, gh, 0) + ccol, strides[T_K, 1], strides[T_V, 1], k_at,
              krow, jend, wk)
        dq = (channel, kts, kto, vts, vto, strides, boff, params, table, b, gh)
        # the scale in log2 units, made >= 0 (a negative one negates Q instead: exact, and
        # it keeps the max of the scores the max of the weights' exponents)
        c2 = fparams[F_SCALE] * LOG2E
        rows = (lens, b, ql, kl, pre_e, next_e, abs(c2))
        # the masked variant's pse and mask rows of the lane's two query rows, its softcap
        ia = wi + g4
        p_row, m_row = boff[T_P, b] + n * strides[T_P, 0], boff[T_M, b]
        ex = (pse, mask8, mask16, params[P_PSE] != 0, params[P_MASK],
              (p_row + ia * strides[T_P, 1], p_row + (ia + 8) * strides[T_P, 1]),
              (m_row + ia * strides[T_M, 1], m_row + (ia + 8) * strides[T_M, 1]),
              softcap_terms(fparams) if CAPPED else (F32_ZERO, F32_ZERO))
        smem, frag = (ks, vs), (qa, o, s, pa, mr, lr)
        if ntiles > 0:
            # Q: through the K buffer into registers, once
            _stage(ks, c_at, q, _row(boff, strides, T_Q, b, n, i0) + ccol, crow,
                   strides[T_Q, 1], ql - i0 - crow, CPT, RSTEP, D)
            X.cp_async_commit()
            X.cp_async_wait(0)
            cuda.syncthreads()
            for kk in range(KT):
                a0, a1, a2, a3 = X.ldmatrix_x4(
                    ks, F.swizzle_step(lane_at[0], w * WARP_ROWS, 16 * kk, D))
                qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2], qa[4 * kk + 3] = a0, a1, a2, a3
            if c2 < F32_ZERO:
                for x in range(QREGS):
                    qa[x] ^= SIGNS
            cuda.syncthreads()              # every warp has its Q before the first K overwrites it
            j = jstart + _tile_order(0, ta, tb) * BKV
            stage_kv(ks, False, j + krow, jend - j - krow, kv)
            X.cp_async_commit()
        # the tiles inside the band, then those crossing it (FA2's unmasked and masked steps):
        # two loops, so that the first has no band test at all
        j_edge = jstart + _tile_order(tb - ta, ta, tb) * BKV if tb - ta < ntiles else -1
        for idx in range(tb - ta):
            j0 = jstart + (ta + idx) * BKV
            tile_inside(j0, j0 + BKV if idx + 1 < tb - ta else j_edge, smem, kv, frag, lane_at,
                        rows, ex, dq)
        for idx in range(tb - ta, ntiles):
            j0 = jstart + _tile_order(idx, ta, tb) * BKV
            jn = jstart + _tile_order(idx + 1, ta, tb) * BKV if idx + 1 < ntiles else -1
            tile_edge(j0, jn, smem, kv, frag, lane_at, rows, ex, dq)

        # finish: the row sums over the quad, the head's sink, the division, the rows of
        # contract 'Empty rows', lse; the output staged in the K buffer (free: no copy into it
        # is pending and every warp is past its last read), then written 16 bytes at a time
        sink = head_sink(fparams, n) if SINKS else F32_NEG_INF
        for h in range(2):
            for sh in (1, 2):
                lr[h] += X.shfl_xor_sync(FULL, lr[h], sh)
            if SINKS and mr[h] != F32_NEG_INF:     # a kept row: its sink joins the sum
                lr[h] += exp2(X.fma_f32(sink, LOG2E, -mr[h]))     # (numerics.core.row_total_log2)
        rows_b = lens[L_ROWS, b]
        for h in range(2):
            i = wi + g4 + 8 * h
            rs = w * WARP_ROWS + g4 + 8 * h                 # its row in the staging tile
            outcome, mlo, mhi, denom = row_outcome(i < ql, mr[h], lr[h], params[P_IP], i,
                                                   pre_e, next_e, kl)
            # contract 'Empty rows': the mean of V over the band
            if outcome == ROW_MEAN:
                for col in range(2 * t4, D, 8):
                    for e in range(2):
                        y = F32_ZERO
                        for j in range(mlo, mhi + 1):
                            y += v_value(v, vp, table, strides, boff, params, dq, b, gh, j,
                                         col + e)
                        ks[F.swizzle(rs, col + e, D)] = to_bits(y / denom)
            else:       # rounded by cvt.rn (pack): o stays in registers
                for dt in range(NO):
                    y0, y1 = F32_ZERO, F32_ZERO          # ROW_ZERO (its denom may be 0)
                    if outcome == ROW_SOFTMAX:
                        y0, y1 = o[4 * dt + 2 * h] / denom, o[4 * dt + 2 * h + 1] / denom
                    X.st_shared_u32(ks, F.swizzle(rs, 8 * dt + 2 * t4, D), pack(y0, y1))
            if params[P_LSE] != 0 and t4 == 0 and i < rows_b:
                val = F32_NEG_INF
                if outcome == ROW_SOFTMAX:
                    val = sink_lse_log2(mr[h], lr[h], sink) if SINKS else lse_log2(mr[h], lr[h])
                lse[boff[T_L, b] + n * strides[T_L, 0] + i * strides[T_L, 1]] = val
        X.syncwarp()
        o_at = _row(boff, strides, T_O, b, n, wi)
        for it in range(OUT_CHUNKS):
            r, c = F.tile_chunk(lane + F.WARP * it, D)
            if wi + r < rows_b:
                X.copy_16_shared_to_global(out, o_at + r * strides[T_O, 1] + c, ks,
                                           F.swizzle(w * WARP_ROWS + r, c, D))

    return attention_tc


_KERNELS = {}


def tc_kernel_for(kind, d, masked, walk=False, int8=False, capped=False, sinks=False):
    """The compiled (lazily, on first launch) tensor-core kernel for ``kind``, ``d``,
    ``masked`` (scores per accumulator: ``tc_conditions.masked_variant``), ``walk`` (kv rows
    through the kv sequence), ``int8`` (an int8 cache), ``capped`` (a softcap) and ``sinks``
    (sink logits)."""
    key = kind, d, bool(masked), bool(walk), bool(int8), bool(capped), bool(sinks)
    if key not in _KERNELS:
        bounds = {} if SIMULATOR else {"launch_bounds": (THREADS,)}
        _KERNELS[key] = cuda.jit(tc_kernel_source(*key), fastmath=False, **bounds)
    return _KERNELS[key]


#: the compute capabilities the PTX files are written for (``python -m pfa_numba cuda-ptx``)
PTX_ARCHS = ((8, 0), (9, 0))


def tc_signature(int8=False):
    """The kernel's argument types: the float kernel's (``kernels.kernel_signature``: the
    common ones, then a shared prefix's key and value, the block table, the int8 cache's
    channel and token planes), key and value int8 for the ``int8`` variant."""
    from numba import types
    from .kernels import kernel_signature
    return kernel_signature(types.uint16, kv_storage=types.int8 if int8 else None,
                            kv_cache=True)


def kernel_ptx(source, signature, cc, threads):
    """The PTX of kernel ``source`` with argument types ``signature`` for compute capability
    ``cc``, launched with ``threads`` threads a block (compiled without a GPU)."""
    ptx, _ = cuda.compile_ptx(source, signature, cc=cc, fastmath=False,
                              launch_bounds=(threads,))
    return ptx


def tc_ptx(kind, d, cc, masked=False, walk=False, int8=False, capped=False, sinks=False):
    """The PTX of the tensor-core kernel for ``kind``, ``d``, compute capability ``cc``,
    ``masked``, ``walk``, ``int8``, ``capped`` and ``sinks``."""
    return kernel_ptx(tc_kernel_source(kind, d, masked, walk, int8, capped, sinks),
                      tc_signature(int8), cc, THREADS)


#: the kv sources of the variants: (walk, int8) and their name suffixes
KV_SOURCES = {(False, False): "", (True, False): "_walk", (True, True): "_int8"}


def capped_forms(masked, walk):
    """The ``capped`` values whose PTX files are written for a ``masked`` and ``walk``
    specialisation: a softcap's variant of the masked contiguous ones (the others compile
    alike, on first use)."""
    return (False, True) if masked and not walk else (False,)


def ptx_names():
    """{file name: (kind, head dim, compute capability, masked, walk, int8, capped)} of every
    specialisation written, e.g. ``tc_bf16_d128_sm90.ptx``, ``tc_bf16_d128_masked_sm90.ptx``
    (a user mask or pse read per element), ``tc_bf16_d128_masked_capped_sm90.ptx`` (and a
    softcap on every score), ``tc_bf16_d128_walk_sm90.ptx`` (K/V rows through a shared prefix
    or a block table) and ``tc_bf16_d128_int8_sm90.ptx`` (an int8 cache, walked); the band,
    the lengths, the sinks and lse are runtime data, not variants."""
    return {f"tc_{kind}_d{d}{'_masked' if masked else ''}{'_capped' if capped else ''}{suffix}"
            f"_sm{cc[0]}{cc[1]}.ptx": (kind, d, cc, masked, walk, int8, capped)
            for kind in ("f16", "bf16") for d in HEAD_DIMS for masked in (False, True)
            for (walk, int8), suffix in KV_SOURCES.items()
            for capped in capped_forms(masked, walk) for cc in PTX_ARCHS}


def loop_names(masked):
    """What each kv loop of a specialisation's SASS is, in code order."""
    if masked:
        return ("kv loop (every tile; band, pse and mask per element)",)
    return ("kv loop, tiles inside the band", "kv loop, tiles crossing the band")
