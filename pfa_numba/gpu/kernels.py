"""The CUDA kernels: a ``@cuda.jit`` tiled online-softmax kernel over the shared numerics.

One thread block computes ``CUDA_Q_ROWS`` query rows of one (batch, head); each thread owns one
row (its scaled query and its float32 accumulator live in local memory). The block walks the kv
tiles of its band only (tiles outside the band or past kL are skipped), staging each K and V
tile in shared memory with coalesced loads (consecutive threads read consecutive elements of a
row) widened to float32 by ``_core.widen``; then each thread runs the three online-softmax
steps of the CPU kernel on its row: scores (band, user mask, pse, fp16 mask), update m and l,
rescale acc and add P V. The band predicate, the online update, exp, finalize and every dtype
conversion are the ``_core`` functions the CPU kernel uses.

Arrays: NumPy inputs with ``device='cuda'`` are copied in (only the memory their views span) and
the result is copied out. CUDA arrays (Numba device arrays, CuPy, PyTorch; anything with
``__cuda_array_interface__``) are read in place, and the result is allocated by the query's
library (zero-copy). Kernels launch on the default stream and the call synchronises before it
returns; callers using other streams should synchronise their producers first.
"""

from numba import cuda, float32, int64

from .. import config
from .._band import block_kv_range, row_band
from .._core import (CODE_BF16, CODE_F16, CODE_I8, F16_MASK_SCALE, F32_NEG_INF, F32_ONE,
                     F32_POS_INF, F32_ZERO, MASK_ADD_F16, MASK_DISCARD, exp_nonpos, f16_to_f32,
                     f32_to_bf16, f32_to_f16, lse_value, max_nan, quantize_output, rescale_factor,
                     round_f16, round_half_even, saturate_int8, widen)

from .._geometry import (P_CODE, P_D, P_G, P_IP, P_LSE, P_MASK, P_OCODE, P_PSE, T_K, T_L, T_M,
                         T_O, T_P, T_Q, T_V)


def _pad_dim(d):
    """Compile-time head-dim capacity: the next power of two >= d (>= 32)."""
    p = 32
    while p < d:
        p *= 2
    return p


_KERNELS = {}


def kernel_for(dpad, bq, bkv, int8=False):
    """The kernel specialised for head dims <= ``dpad``, ``bq`` rows per block and ``bkv``
    kv columns per shared-memory tile (all compile-time constants); ``int8``: the int8
    query/key/value pipeline."""
    key = (dpad, bq, bkv, int8)
    if key not in _KERNELS:
        src = (kernel_source_int8 if int8 else kernel_source)(dpad, bq, bkv)
        _KERNELS[key] = cuda.jit(src, fastmath=set(config.CUDA_FASTMATH) or False)
    return _KERNELS[key]


def kernel_signature(storage, out_storage=None, int8=False):
    """The argument types of a kernel: ``storage`` of q/k/v (numba.types.uint16, float32, or
    int8 for the int8 kernel), ``out_storage`` of the output (default: ``storage``; int8 for
    quantized outputs; uint16 for the int8 kernel's float16 output)."""
    from numba import types
    flat = lambda t: types.Array(t, 1, "C")  # noqa: E731
    grid = types.Array(types.int64, 2, "C")
    out_storage = out_storage or (types.uint16 if int8 else storage)
    pse = types.uint16 if int8 else storage
    return (flat(storage), flat(storage), flat(storage), flat(out_storage), flat(types.float32),
            flat(types.uint8), flat(types.uint16), flat(pse), grid, grid, grid,
            flat(types.int64), types.int64, flat(types.float32), flat(types.float32),
            flat(types.float32))


def kernel_source(dpad, bq, bkv):
    """The float kernel's Python source for the given compile-time sizes (before cuda.jit).

    Arguments: q, k, v (flat storage), out, lse, mask8, mask16, pse, strides, boff, lens,
    params, qtiles, fparams (float32: scale_value as two factors), scale2, offset2 (float16-rounded output
    quantization scales, 1 or H values; read only when the output code is CODE_I8)."""
    DP, BQ, BKV = dpad, bq, bkv

    def attention(q, k, v, out, lse, mask8, mask16, pse, strides, boff, lens, params, qtiles,
                  fparams, scale2, offset2):
        ks = cuda.shared.array((BKV, DP), float32)
        vs = cuda.shared.array((BKV, DP), float32)
        qv = cuda.local.array(DP, float32)
        acc = cuda.local.array(DP, float32)
        sc = cuda.local.array(BKV, float32)
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x // qtiles
        i0 = (cuda.blockIdx.x - b * qtiles) * BQ
        n = cuda.blockIdx.y
        i = i0 + tid
        G = params[P_G]
        D = params[P_D]
        code = params[P_CODE]
        ocode = params[P_OCODE]
        mask_kind = params[P_MASK]
        has_pse = params[P_PSE] != 0
        inner_precise = params[P_IP]
        want_lse = params[P_LSE] != 0
        scale = fparams[0]
        scale_hi = fparams[1]      # 1, or the second factor of a scale beyond float32's range
        g = n // G
        ql = lens[0, b]
        kl = lens[1, b]
        pre_e = lens[2, b]
        next_e = lens[3, b]
        rows_b = lens[4, b]
        i1 = min(i0 + BQ, ql)
        active = i < ql
        # the kv columns any row of this block keeps: the same for every thread of the block,
        # so all threads run the same number of tiles (and reach every syncthreads)
        jstart, jend = block_kv_range(i0, i1, pre_e, next_e, kl)
        ntiles = (jend - jstart + BKV - 1) // BKV if jend > jstart else 0
        lo, hi = row_band(i, pre_e, next_e, kl)
        k_base = boff[T_K, b] + g * strides[T_K, 0]
        v_base = boff[T_V, b] + g * strides[T_V, 0]
        m = F32_NEG_INF
        l = F32_ZERO
        if active:
            q_off = boff[T_Q, b] + n * strides[T_Q, 0] + i * strides[T_Q, 1]
            for d in range(D):
                qv[d] = widen(q[q_off + d * strides[T_Q, 2]], code) * scale * scale_hi
                acc[d] = F32_ZERO
        for t in range(ntiles):
            j0 = jstart + t * BKV
            nc = min(BKV, jend - j0)
            e = tid
            while e < nc * D:                       # coalesced: consecutive threads, consecutive d
                c = e // D
                d = e - c * D
                ks[c, d] = widen(k[k_base + (j0 + c) * strides[T_K, 1] + d * strides[T_K, 2]], code)
                vs[c, d] = widen(v[v_base + (j0 + c) * strides[T_V, 1] + d * strides[T_V, 2]], code)
                e += BQ
            cuda.syncthreads()   # the whole K/V tile is in shared memory before anyone reads it
            if active:
                # step 1: scores of this row against the tile (dropped columns at -inf)
                tmax = F32_NEG_INF
                m_off = boff[T_M, b] + i * strides[T_M, 1]
                p_off = boff[T_P, b] + n * strides[T_P, 0] + i * strides[T_P, 1]
                for c in range(nc):
                    j = j0 + c
                    s = F32_NEG_INF
                    if j >= lo and j <= hi:
                        s = F32_ZERO
                        for d in range(D):
                            s += qv[d] * ks[c, d]
                        if has_pse:
                            s += widen(pse[p_off + j * strides[T_P, 2]], code)
                        if mask_kind == MASK_ADD_F16:
                            s += F16_MASK_SCALE * f16_to_f32(mask16[m_off + j * strides[T_M, 2]])
                        elif mask_kind == MASK_DISCARD:
                            if mask8[m_off + j * strides[T_M, 2]] != 0:
                                s = F32_NEG_INF
                    sc[c] = s
                    tmax = max_nan(tmax, s)
                # step 2: update m and l; step 3: rescale acc, add P V
                m_new = max_nan(m, tmax)
                if m_new != F32_NEG_INF:
                    a = rescale_factor(m, m_new)
                    if a != F32_ONE:
                        l = l * a
                        for d in range(D):
                            acc[d] = acc[d] * a
                    for c in range(nc):
                        p = exp_nonpos(sc[c] - m_new)
                        if p != F32_ZERO:            # a dropped column adds nothing, not 0 * inf
                            l += p
                            for d in range(D):
                                acc[d] += p * vs[c, d]
                    m = m_new
            cuda.syncthreads()   # every row is done with this tile before it is overwritten

        # finalize: every output row of the block is written (the output is not pre-zeroed)
        if i < rows_b:
            o_off = boff[T_O, b] + n * strides[T_O, 0] + i * strides[T_O, 1]
            osd = strides[T_O, 2]
            written = 0
            denom = F32_ONE
            if active and m != F32_NEG_INF:
                written = 1
                denom = l
            elif active and inner_precise < 2 and lo <= hi:
                # SPEC 5: band non-empty but every band column masked -> mean of V over the band
                for d in range(D):
                    acc[d] = F32_ZERO
                for j in range(lo, hi + 1):
                    off = v_base + j * strides[T_V, 1]
                    for d in range(D):
                        acc[d] += widen(v[off + d * strides[T_V, 2]], code)
                written = 1
                denom = float32(hi - lo + 1)
            for d in range(D):
                x = acc[d] / denom if written else F32_ZERO
                # _core.store, spelled out: device arrays cannot enter an njit function
                # under the CUDA simulator
                if ocode == CODE_F16:
                    out[o_off + d * osd] = f32_to_f16(x)
                elif ocode == CODE_BF16:
                    out[o_off + d * osd] = f32_to_bf16(x)
                elif ocode == CODE_I8:
                    ch = n * D + d if scale2.shape[0] > 1 else 0
                    y = quantize_output(x, scale2[ch], offset2[ch]) if written else F32_ZERO
                    out[o_off + d * osd] = y
                else:
                    out[o_off + d * osd] = x
            if want_lse:
                l_off = boff[T_L, b] + n * strides[T_L, 0] + i * strides[T_L, 1]
                lse[l_off] = lse_value(m, l) if active else F32_NEG_INF

    return attention


def kernel_source_int8(dpad, bq, bkv):
    """The int8 kernel (SPEC 8) for the given compile-time sizes: pass 1 over the K tiles finds
    each row's max fp16 score, pass 2 quantizes E = exp(s - m) to P8 and accumulates P8 . V in
    int64 (exact). fparams (float32): deq_scale1, fp16(scale_value), quant_scale1, deq_scale2.
    Output: float16 bits (CODE_F16) or int8 (CODE_I8, quantized in the finalize)."""
    DP, BQ, BKV = dpad, bq, bkv

    def attention_int8(q, k, v, out, lse, mask8, mask16, pse, strides, boff, lens, params,
                       qtiles, fparams, scale2, offset2):
        ks = cuda.shared.array((BKV, DP), float32)
        vs = cuda.shared.array((BKV, DP), float32)
        qv = cuda.local.array(DP, float32)
        acc = cuda.local.array(DP, int64)
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x // qtiles
        i0 = (cuda.blockIdx.x - b * qtiles) * BQ
        n = cuda.blockIdx.y
        i = i0 + tid
        G = params[P_G]
        D = params[P_D]
        ocode = params[P_OCODE]
        mask_kind = params[P_MASK]
        has_pse = params[P_PSE] != 0
        inner_precise = params[P_IP]
        want_lse = params[P_LSE] != 0
        deq1 = fparams[0]
        scale16 = fparams[1]
        qs1 = fparams[2]
        deq2 = fparams[3]
        g = n // G
        ql = lens[0, b]
        kl = lens[1, b]
        pre_e = lens[2, b]
        next_e = lens[3, b]
        rows_b = lens[4, b]
        i1 = min(i0 + BQ, ql)
        active = i < ql
        jstart, jend = block_kv_range(i0, i1, pre_e, next_e, kl)
        ntiles = (jend - jstart + BKV - 1) // BKV if jend > jstart else 0
        lo, hi = row_band(i, pre_e, next_e, kl)
        k_base = boff[T_K, b] + g * strides[T_K, 0]
        v_base = boff[T_V, b] + g * strides[T_V, 0]
        m = F32_NEG_INF
        l = F32_ZERO
        nan_row = False
        if active:
            q_off = boff[T_Q, b] + n * strides[T_Q, 0] + i * strides[T_Q, 1]
            for d in range(D):
                qv[d] = float32(q[q_off + d * strides[T_Q, 2]])
                acc[d] = 0
        for step in range(2):
            for t in range(ntiles):
                j0 = jstart + t * BKV
                nc = min(BKV, jend - j0)
                e = tid
                while e < nc * D:
                    c = e // D
                    d = e - c * D
                    ks[c, d] = float32(k[k_base + (j0 + c) * strides[T_K, 1] + d * strides[T_K, 2]])
                    if step == 1:
                        vs[c, d] = float32(v[v_base + (j0 + c) * strides[T_V, 1] + d * strides[T_V, 2]])
                    e += BQ
                cuda.syncthreads()   # the tile is in shared memory before anyone reads it
                if active:
                    m_off = boff[T_M, b] + i * strides[T_M, 1]
                    p_off = boff[T_P, b] + n * strides[T_P, 0] + i * strides[T_P, 1]
                    for c in range(nc):
                        j = j0 + c
                        if j < lo or j > hi:
                            continue
                        if mask_kind == MASK_DISCARD:
                            if mask8[m_off + j * strides[T_M, 2]] != 0:
                                continue
                        a = F32_ZERO                 # exact: |sum| < 2^24 for D <= 512
                        for d in range(D):
                            a += qv[d] * ks[c, d]
                        s = round_f16(round_f16(a * deq1) * scale16)
                        if has_pse:
                            s = round_f16(s + f16_to_f32(pse[p_off + j * strides[T_P, 2]]))
                        if step == 0:
                            m = max_nan(m, s)
                        elif m != F32_NEG_INF and s != F32_NEG_INF:
                            p = exp_nonpos(s - m)
                            l += p
                            p8 = saturate_int8(round_half_even(p * qs1))
                            if p8 != p8:
                                nan_row = True
                            elif p8 != F32_ZERO:
                                w = int64(p8)
                                for d in range(D):
                                    acc[d] += w * int64(vs[c, d])
                cuda.syncthreads()   # every row is done with this tile before it is overwritten

        if i < rows_b:
            o_off = boff[T_O, b] + n * strides[T_O, 0] + i * strides[T_O, 1]
            osd = strides[T_O, 2]
            written = 0
            denom = F32_ONE
            if active and m != F32_NEG_INF:
                written = 1
                denom = l
            elif active and inner_precise < 2 and lo <= hi:
                # SPEC 5 for int8: every band score equal (E = 1 on the band)
                p8 = int64(saturate_int8(round_half_even(qs1)))
                for d in range(D):
                    acc[d] = 0
                for j in range(lo, hi + 1):
                    off = v_base + j * strides[T_V, 1]
                    for d in range(D):
                        acc[d] += p8 * int64(v[off + d * strides[T_V, 2]])
                written = 1
                denom = float32(hi - lo + 1)
            for d in range(D):
                x = deq2 * float32(acc[d]) / denom if written else F32_ZERO
                if nan_row:
                    x = x + (F32_POS_INF - F32_POS_INF)   # NaN
                if ocode == CODE_I8:
                    ch = n * D + d if scale2.shape[0] > 1 else 0
                    y = quantize_output(x, scale2[ch], offset2[ch]) if written else F32_ZERO
                    out[o_off + d * osd] = y
                else:
                    out[o_off + d * osd] = f32_to_f16(x)
            if want_lse:
                l_off = boff[T_L, b] + n * strides[T_L, 0] + i * strides[T_L, 1]
                lse[l_off] = lse_value(m, l) if active else F32_NEG_INF

    return attention_int8


def launch_config(p):
    """(dpad, rows per block, kv columns per tile) for problem ``p``."""
    dpad = _pad_dim(p.D)
    bq = int(config.CUDA_Q_ROWS)
    bkv = max(1, min(int(config.CUDA_KV_COLS), int(config.CUDA_TILE_ELEMS) // dpad))
    return dpad, bq, bkv
