"""The tensor-core (FlashAttention-2 class) CUDA kernel for float16 / bfloat16, and when it runs.

:func:`tc_kernel_source` returns the ``@cuda.jit`` source for a 16-bit type and a head dim D
(64 or 128, compile-time); its arguments are the scalar kernels' common ones
(``kernels.kernel_signature(..., kv_cache=False)``, built by ``_kernel_args.kernel_args``), so
every layout (padded or TND), GQA, the masks, pse, the lengths and the band reach it through
the same ``T_*`` offsets, ``L_*`` lengths and ``P_*`` / ``F_*`` slots. Its specification is the
NumPy warp model :func:`.warp_model.fa2_block`: the loop, the masking order and every lane map
(:mod:`.fragments`) are the model's.

One block: 4 warps x 16 query rows (64 rows) of one (batch, query head), 128 threads; the grid
is (B x query-row blocks, N), each batch's blocks in reverse row order (a causal band's longest
blocks first). The block's kv columns [jstart, jend) (``block_kv_range``:
tiles outside the band are never visited) go in tiles of 64 keys, staged by ``cp.async`` (rows
at or past jend zero-filled) into XOR-swizzled shared memory: one K and one V buffer, each
loaded while the other is in use (FA2's interleave: V(t) arrives during S = Q K(t)^T, K(t+1)
during O += P V(t)); two stages of each would need 64 KiB at D = 128, over the 48 KiB of static
shared memory. Q is staged through the K buffer once and held in registers as A fragments
(``ldmatrix``). Per tile and warp: S by ``mma.sync`` m16n8k16 (K by plain ldmatrix), the band
(``row_band`` per accumulator), pse and the float16 mask added in log2 units
(t = s * scale * log2 e + bias * log2 e), the user discard mask; the online softmax in registers
(exp2, quad ``shfl_xor``); P packed from S (``p_from_s``) to the input type; O += P V (V by
``ldmatrix.trans``). A warp skips a tile none of its rows keeps a column of. At the end: the
division, the rows of contract 'Empty rows' (``row_outcome``; ROW_MEAN rows average V from global
memory), lse, the output through ``T_O`` as float16 / bfloat16 bits (cvt.rn, as _core.f32_to_f16 /
_bf16 round).

Registers: D = 128 sits at the 255 limit with 0 spills (ptxas -v, tests/ptx/test_tc_kernel.py)
because nothing but fragments is held across the tile loop: offsets and lengths are re-read
where used, a per-tile zero keeps the ldmatrix / cp.async addresses from being hoisted, and the
mask / pse step (32 call sites written out, so accumulator indices stay constant) converts
halves with one ``cvt.f32.f16``.

Not this kernel (:func:`tensor_core_reason` says why; the scalar kernel runs them): other
dtypes and head dims, quantized outputs, fused_infer_attention_score's paged, prefixed and int8
kv caches, scale_value needing a second factor or a power of two,
rows or strides not 16-byte aligned, compute capability < 8.0, and a V holding inf or NaN (a
dropped column would reach the rows through 0 * inf in P V, see the warp model: a scan before
the kernel finds it on the device, and the kernel then leaves the call to the portable kernel
launched beside it, :func:`nonfinite_scan`).
"""
import numba
import numpy as np
from numba import cuda, float32, uint16, uint32

from .. import config
from .._band import ROW_MEAN, ROW_SOFTMAX, block_kv_range, row_band, row_outcome
from .._core import (CODE_BF16, CODE_F16, F16_MASK_SCALE, F32_NEG_INF, F32_ZERO,
                     MASK_ADD_F16, MASK_DISCARD, bf16_to_f32, f16_to_f32, f32_to_bf16,
                     f32_to_f16, lse_log2, max_nan, online_update_log2)
from .._dtypes import F16, is_bf16
from .._kernel_args import (F_SCALE, L_KLEN, L_NEXT, L_PRE, L_QLEN, L_ROWS, P_G, P_IP, P_LSE,
                            P_MASK, P_PSE, T_K, T_L, T_M, T_O, T_P, T_Q, T_V, scale_factors)
from . import fragments as F
from . import ptx as X
from .kernels import array_function

#: query rows per warp / warps per block / rows per block / threads per block / keys per tile
WARP_ROWS, WARPS = F.MMA_M, 4
ROWS, THREADS, BKV = WARP_ROWS * WARPS, F.WARP * WARPS, 64
#: head dims with a specialisation
HEAD_DIMS = (64, 128)
FULL = 0xFFFFFFFF
#: under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) the kernel runs as Python, its warp-level
#: instructions those of .warp_sim
SIMULATOR = numba.config.ENABLE_CUDASIM
LOG2E = np.float32(1.4426950408889634)
BIAS_F16 = np.float32(F16_MASK_SCALE * LOG2E)       # the float16 mask's -10000, in log2 units


@array_function
def _score(sv, j, row, p_off, m_off, ex):
    """t of one S accumulator (key j): -inf outside the row's band (row = (i < qL, lo,
    hi)) or where the user mask discards; else s * scale * log2 e plus pse and the float16 mask
    in log2 units (ex = (scale * log2 e, has_pse, pse, pse column stride, mask kind, mask8,
    mask16, mask column stride, storage code)); the scalar kernel's order."""
    c2, has_pse, pse, ps2, mask_kind, mask8, mask16, ms2, code = ex
    if not (row[0] and j >= row[1] and j <= row[2]):
        return F32_NEG_INF
    tv = sv * c2
    if has_pse:
        raw = pse[p_off + j * ps2]
        tv += (X.cvt_f32_f16(raw) if code == CODE_F16 else bf16_to_f32(raw)) * LOG2E
    if mask_kind == MASK_ADD_F16:
        tv += BIAS_F16 * X.cvt_f32_f16(mask16[m_off + j * ms2])
    elif mask_kind == MASK_DISCARD:
        if mask8[m_off + j * ms2] != 0:
            tv = F32_NEG_INF
    return tv


@array_function
def _scores2(s0, s1, j, row, p_off, m_off, ex):
    """_score of the two accumulators of one row in one n-tile (keys j, j + 1)."""
    return _score(s0, j, row, p_off, m_off, ex), _score(s1, j + 1, row, p_off, m_off, ex)


@array_function
def _row(boff, strides, t, b, head, j):
    """Element offset of row j of head ``head`` of batch b of tensor t (a T_* row): read from
    the arrays where used, so that nothing of it is held in registers across the tile loop."""
    return boff[t, b] + head * strides[t, 0] + j * strides[t, 1]


@array_function
def _warp_busy(lens, b, wi, j0):
    """Whether any of the warp's rows [wi, wi + 16) keeps a column of the tile [j0, j0 + 64)
    (else the warp skips the tile: its scores would all be -inf)."""
    ql, kl, pre_e, next_e = lens[L_QLEN, b], lens[L_KLEN, b], lens[L_PRE, b], lens[L_NEXT, b]
    wlo, _ = row_band(wi, pre_e, next_e, kl)
    _, whi = row_band(min(wi + WARP_ROWS, ql) - 1, pre_e, next_e, kl)
    return wi < ql and j0 <= whi and j0 + BKV - 1 >= wlo


def tc_kernel_source(kind, d):
    """The kernel's Python source (before ``cuda.jit``) for ``kind`` ("f16" or "bf16") and head
    dim ``d`` (64 or 128)."""
    assert kind in ("f16", "bf16") and d in HEAD_DIMS
    D = d
    KT = D // 16                       # k-steps of S = Q K^T; pairs of 8-column n-tiles of O
    NO = D // 8                        # n-tiles of O (8 head dims each)
    NS = BKV // 8                      # n-tiles of S (8 keys each)
    QREGS, OACC, SACC, PREGS = KT * 4, NO * 4, NS * 4, BKV // 4
    TILE = BKV * D                     # 16-bit values of one K or V tile (= the Q block's)
    CPT = TILE // F.CHUNK // THREADS   # 16-byte chunks each thread copies per tile
    mma = X.mma_m16n8k16_f16 if kind == "f16" else X.mma_m16n8k16_bf16
    pack = X.pack_f16x2 if kind == "f16" else X.pack_bf16x2
    to_f32 = f16_to_f32 if kind == "f16" else bf16_to_f32
    to_bits = f32_to_f16 if kind == "f16" else f32_to_bf16
    CODE = CODE_F16 if kind == "f16" else CODE_BF16
    assert NS == 8                     # _scores2 is called per n-tile and row, written out
    ALIGN = None if SIMULATOR else 16  # the simulator's shared arrays take no alignment

    def attention_tc(q, k, v, out, lse, mask8, mask16, pse, strides, boff, lens, params, qtiles,
                     fparams, scale2, offset2, guard, guard_id):
        if guard[0] == guard_id:       # V holds inf or NaN: the portable kernel runs the call
            return
        ks = cuda.shared.array(TILE, uint16, alignment=ALIGN)
        vs = cuda.shared.array(TILE, uint16, alignment=ALIGN)
        qa = cuda.local.array(QREGS, uint32)
        o = cuda.local.array(OACC, float32)
        s = cuda.local.array(SACC, float32)
        pa = cuda.local.array(PREGS, uint32)        # P as A fragments, 4 per k-step of 16 keys
        mr = cuda.local.array(2, float32)          # running max of the lane's rows g, g + 8
        lr = cuda.local.array(2, float32)          # this lane's part of their sums
        tid = cuda.threadIdx.x
        lane, w = tid & 31, tid >> 5
        g4, t4 = lane >> 2, lane & 3
        b = cuda.blockIdx.x // qtiles
        # the last query rows first: under a causal band they have the most tiles, so the
        # longest blocks start in the first wave and the grid ends without a long tail
        i0 = (qtiles - 1 - (cuda.blockIdx.x - b * qtiles)) * ROWS
        n = cuda.blockIdx.y
        gh = n // params[P_G]
        ql, kl, pre_e, next_e = lens[L_QLEN, b], lens[L_KLEN, b], lens[L_PRE, b], lens[L_NEXT, b]
        jstart, jend = block_kv_range(i0, min(i0 + ROWS, ql), pre_e, next_e, kl)
        ntiles = (jend - jstart + BKV - 1) // BKV if jend > jstart and i0 < ql else 0
        wi = i0 + w * WARP_ROWS                             # the warp's first row
        q_base = boff[T_Q, b] + n * strides[T_Q, 0]
        qs1 = strides[T_Q, 1]
        for h in range(2):
            mr[h], lr[h] = F32_NEG_INF, F32_ZERO
        for x in range(OACC):
            o[x] = F32_ZERO
        ar, ac = F.ldsm_a_addr(lane)
        br, bc = F.ldsm_b_addr(lane)
        if ntiles > 0:
            # Q: through the K buffer into registers, once
            for it in range(CPT):
                r, c = F.tile_chunk(tid + it * THREADS, D)
                ok = i0 + r < ql
                X.cp_async_16_zfill(ks, F.swizzle(r, c, D), q,
                                    q_base + (i0 + r if ok else i0) * qs1 + c, 16 if ok else 0)
            X.cp_async_commit()
            X.cp_async_wait(0)
            cuda.syncthreads()
            for kk in range(KT):
                a0, a1, a2, a3 = X.ldmatrix_x4(ks, F.swizzle(w * WARP_ROWS + ar, 16 * kk + ac, D))
                qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2], qa[4 * kk + 3] = a0, a1, a2, a3
            cuda.syncthreads()              # every warp has its Q before K(0) overwrites it
            for it in range(CPT):
                r, c = F.tile_chunk(tid + it * THREADS, D)
                ok = jstart + r < jend
                src = _row(boff, strides, T_K, b, gh, jstart + r if ok else jstart) + c
                X.cp_async_16_zfill(ks, F.swizzle(r, c, D), k, src, 16 if ok else 0)
            X.cp_async_commit()
        for tile in range(ntiles):
            j0 = jstart + tile * BKV
            X.cp_async_wait(0)
            cuda.syncthreads()              # K(tile) landed; every warp is done with V(tile-1)
            # z: 0 (query's D stride is 1), read once per tile, so that the 64 ldmatrix and the
            # cp.async addresses are computed where used, not hoisted out of the tile loop and
            # held in registers (which spilled at D = 128)
            z = strides[T_Q, 2] - 1
            for it in range(CPT):
                r, c = F.tile_chunk(tid + it * THREADS + z, D)
                ok = j0 + r < jend
                X.cp_async_16_zfill(vs, F.swizzle(r, c, D), v,
                                    _row(boff, strides, T_V, b, gh, j0 + r if ok else jstart) + c,
                                    16 if ok else 0)
            X.cp_async_commit()
            busy = _warp_busy(lens, b, wi, j0)
            if busy:
                # S = Q K^T: n-tiles of 8 keys in pairs (one ldmatrix x4 gives both B fragments)
                for x in range(SACC):
                    s[x] = F32_ZERO
                for pair in range(NS // 2):
                    for kk in range(KT):
                        b0, b1, b2, b3 = X.ldmatrix_x4(
                            ks, F.swizzle(16 * pair + br + z, 16 * kk + bc, D))
                        e = 8 * pair
                        s[e], s[e + 1], s[e + 2], s[e + 3] = mma(
                            qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2], qa[4 * kk + 3], b0, b1,
                            s[e], s[e + 1], s[e + 2], s[e + 3])
                        s[e + 4], s[e + 5], s[e + 6], s[e + 7] = mma(
                            qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2], qa[4 * kk + 3], b2, b3,
                            s[e + 4], s[e + 5], s[e + 6], s[e + 7])
                # the band, the length and the masks per accumulator; scores to log2 units
                # (row a's n-tiles, then row b's, so each row's offsets live only for its half)
                # (what only this step needs is read here, not held in registers across tiles)
                ia, ib = wi + g4, wi + g4 + 8
                jc = j0 + 2 * t4
                ps1, ms1 = strides[T_P, 1], strides[T_M, 1]
                p_row, m_row = boff[T_P, b] + n * strides[T_P, 0], boff[T_M, b]
                pa_, pb_ = p_row + ia * ps1, p_row + ib * ps1
                ma_, mb_ = m_row + ia * ms1, m_row + ib * ms1
                lo_a, hi_a = row_band(ia, lens[L_PRE, b], lens[L_NEXT, b], lens[L_KLEN, b])
                lo_b, hi_b = row_band(ib, lens[L_PRE, b], lens[L_NEXT, b], lens[L_KLEN, b])
                qln = lens[L_QLEN, b]
                ra, rb = (ia < qln, lo_a, hi_a), (ib < qln, lo_b, hi_b)
                ex = (fparams[F_SCALE] * LOG2E, params[P_PSE] != 0, pse, strides[T_P, 2],
                      params[P_MASK], mask8, mask16, strides[T_M, 2], CODE)
                for nt in range(NS):
                    s[4 * nt], s[4 * nt + 1] = _scores2(s[4 * nt], s[4 * nt + 1], jc + 8 * nt, ra,
                                                        pa_, ma_, ex)
                for nt in range(NS):
                    s[4 * nt + 2], s[4 * nt + 3] = _scores2(s[4 * nt + 2], s[4 * nt + 3],
                                                            jc + 8 * nt, rb, pb_, mb_, ex)
                tm0, tm1 = F32_NEG_INF, F32_NEG_INF
                for nt in range(NS):
                    tm0 = max_nan(tm0, max_nan(s[4 * nt], s[4 * nt + 1]))
                    tm1 = max_nan(tm1, max_nan(s[4 * nt + 2], s[4 * nt + 3]))
                for sh in (1, 2):
                    tm0 = max_nan(tm0, X.shfl_xor_sync(FULL, tm0, sh))
                    tm1 = max_nan(tm1, X.shfl_xor_sync(FULL, tm1, sh))
                # the online step, per row half: new max, rescale factor, weights, sums
                for h in range(2):
                    m_new, shift, m_sub = online_update_log2(mr[h], tm0 if h == 0 else tm1)
                    alpha = X.exp2_approx(shift)
                    part = F32_ZERO
                    for nt in range(NS):
                        for e in range(2):
                            pv = X.exp2_approx(s[4 * nt + 2 * h + e] - m_sub)
                            s[4 * nt + 2 * h + e] = pv
                            part += pv
                    lr[h] = lr[h] * alpha + part
                    mr[h] = m_new
                    for dt in range(NO):
                        o[4 * dt + 2 * h] *= alpha
                        o[4 * dt + 2 * h + 1] *= alpha
                # P's A fragments from the S accumulators, packed now (16 registers, not 32)
                for kk in range(BKV // 16):
                    for reg in range(4):
                        nt2, x = F.p_from_s(reg)
                        e = 4 * (2 * kk + nt2) + x
                        pa[4 * kk + reg] = pack(s[e], s[e + 1])
            X.cp_async_wait(0)
            cuda.syncthreads()              # V(tile) landed; every warp is done with K(tile)
            if tile + 1 < ntiles:
                jn = j0 + BKV
                for it in range(CPT):
                    r, c = F.tile_chunk(tid + it * THREADS + z, D)
                    ok = jn + r < jend
                    src = _row(boff, strides, T_K, b, gh, jn + r if ok else jstart) + c
                    X.cp_async_16_zfill(ks, F.swizzle(r, c, D), k, src, 16 if ok else 0)
                X.cp_async_commit()
            if busy:
                # O += P V, V by ldmatrix.trans
                for kk in range(BKV // 16):
                    p0, p1, p2, p3 = pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]
                    for dp in range(KT):
                        v0, v1, v2, v3 = X.ldmatrix_x4_trans(
                            vs, F.swizzle(16 * kk + ar + z, 16 * dp + ac, D))
                        e = 8 * dp
                        o[e], o[e + 1], o[e + 2], o[e + 3] = mma(
                            p0, p1, p2, p3, v0, v1, o[e], o[e + 1], o[e + 2], o[e + 3])
                        o[e + 4], o[e + 5], o[e + 6], o[e + 7] = mma(
                            p0, p1, p2, p3, v2, v3,
                            o[e + 4], o[e + 5], o[e + 6], o[e + 7])

        # finish: the row sums over the quad, the division, the rows of contract 'Empty rows',
        # lse, the output
        for h in range(2):
            for sh in (1, 2):
                lr[h] += X.shfl_xor_sync(FULL, lr[h], sh)
        rows_b, sv2 = lens[L_ROWS, b], strides[T_V, 2]
        # (re-read, not held in registers through the tile loop)
        ql, kl, pre_e, next_e = lens[L_QLEN, b], lens[L_KLEN, b], lens[L_PRE, b], lens[L_NEXT, b]
        for h in range(2):
            i = wi + g4 + 8 * h
            if i < rows_b:
                outcome, mlo, mhi, denom = row_outcome(i < ql, mr[h], lr[h], params[P_IP], i,
                                                       pre_e, next_e, kl)
                o_off = boff[T_O, b] + n * strides[T_O, 0] + i * strides[T_O, 1]
                osd = strides[T_O, 2]
                # contract 'Empty rows': the mean of V over the band
                if outcome == ROW_MEAN:
                    for col in range(2 * t4, D, 8):
                        for e in range(2):
                            y = F32_ZERO
                            for j in range(mlo, mhi + 1):
                                y += to_f32(v[_row(boff, strides, T_V, b, gh, j) + (col + e) * sv2])
                            out[o_off + (col + e) * osd] = to_bits(y / denom)
                else:       # a separate loop, rounded by cvt.rn (pack): o stays in registers
                    for dt in range(NO):
                        y0, y1 = F32_ZERO, F32_ZERO      # ROW_ZERO (its denom may be 0)
                        if outcome == ROW_SOFTMAX:
                            y0, y1 = o[4 * dt + 2 * h] / denom, o[4 * dt + 2 * h + 1] / denom
                        r2 = pack(y0, y1)
                        col = o_off + (8 * dt + 2 * t4) * osd
                        out[col] = uint16(r2 & 0xFFFF)
                        out[col + osd] = uint16(r2 >> 16)
                if params[P_LSE] != 0 and t4 == 0:
                    val = F32_NEG_INF
                    if outcome == ROW_SOFTMAX:
                        val = lse_log2(mr[h], lr[h])
                    lse[boff[T_L, b] + n * strides[T_L, 0] + i * strides[T_L, 1]] = val

    return attention_tc


_KERNELS = {}


def tc_kernel_for(kind, d):
    """The compiled (lazily, on first launch) tensor-core kernel for ``kind`` and ``d``."""
    if (kind, d) not in _KERNELS:
        bounds = {} if SIMULATOR else {"launch_bounds": (THREADS,)}
        _KERNELS[kind, d] = cuda.jit(tc_kernel_source(kind, d), fastmath=False, **bounds)
    return _KERNELS[kind, d]


#: the compute capabilities the PTX files are written for (``python -m pfa_numba cuda-ptx``)
PTX_ARCHS = ((8, 0), (9, 0))


def tc_ptx(kind, d, cc):
    """The PTX of the tensor-core kernel for ``kind``, ``d`` and compute capability ``cc``
    (compiled without a GPU)."""
    from numba import types
    from .kernels import kernel_signature
    signature = kernel_signature(types.uint16, kv_cache=False)
    ptx, _ = cuda.compile_ptx(tc_kernel_source(kind, d), signature, cc=cc, fastmath=False,
                              launch_bounds=(THREADS,))
    return ptx


def ptx_names():
    """{file name: (kind, head dim, compute capability)} of every specialisation, e.g.
    ``tc_bf16_d128_sm90.ptx``: masks, pse, lse and the band are runtime data, not variants."""
    return {f"tc_{kind}_d{d}_sm{cc[0]}{cc[1]}.ptx": (kind, d, cc)
            for kind in ("f16", "bf16") for d in HEAD_DIMS for cc in PTX_ARCHS}


def write_ptx(out_dir, name_filter=""):
    """Write the PTX of every specialisation whose file name contains ``name_filter`` into
    ``out_dir`` and, where the SASS tools' wheels are installed (:mod:`.sass`), its SASS summary
    beside it (``tc_f16_d128_sm90.sass.txt``); returns the paths written."""
    import os

    from . import sass
    os.makedirs(out_dir, exist_ok=True)
    with_sass = not sass.missing_tools()
    paths = []
    for name, spec in ptx_names().items():
        if name_filter in name:
            path = os.path.join(out_dir, name)
            ptx = tc_ptx(*spec)
            with open(path, "w") as f:
                f.write(ptx)
            paths.append(path)
            if with_sass:
                path = os.path.join(out_dir, name[:-len(".ptx")] + ".sass.txt")
                with open(path, "w") as f:
                    f.write(sass.format_summary(name, sass.of_ptx(ptx, spec[2])))
                paths.append(path)
    return paths


def kind_of(dtype):
    """"f16" / "bf16" for float16 / bfloat16, else None."""
    return "f16" if np.dtype(dtype) == F16 else "bf16" if is_bf16(dtype) else None


def _strides_aligned(x):
    """Rows of 16-bit values contiguous along D, every other used stride a multiple of 16
    bytes (axes of length 1 are never stepped along)."""
    if x.strides[-1] != x.itemsize:
        return False
    return all(st % 16 == 0 for n, st in zip(x.shape[:-1], x.strides[:-1]) if n > 1)


def tensor_core_reason(p, cc=None):
    """None when the tensor-core kernel can run planned problem ``p`` (on a device of compute
    capability ``cc``, when given), else why not. (Device pointers' alignment is checked by
    the launch, ``launch.Launch.aligned``; V's finiteness on the device, :func:`nonfinite_scan`.)"""
    kind = kind_of(p.dtype)
    if kind is None:
        return f"{np.dtype(p.dtype).name} inputs: the tensor-core kernel takes float16 and bfloat16"
    if np.dtype(p.out_dtype) != np.dtype(p.dtype):
        return f"a {np.dtype(p.out_dtype).name} output (quantized): the scalar kernel writes it"
    if p.D not in HEAD_DIMS:
        return f"head dim {p.D}: the tensor-core kernel has D in {HEAD_DIMS}"
    if cc is not None and tuple(cc) < (8, 0):
        return f"compute capability {cc[0]}.{cc[1]}: mma.bf16 / cp.async need 8.0 or newer"
    cache = p.cache
    if cache is not None and (cache.block_table is not None or cache.P or cache.antiquant):
        return ("a paged, prefixed or int8 kv cache: the tensor-core kernel reads contiguous "
                "rows of the query's dtype")
    _, s2, e = scale_factors(p.scale)
    if s2 != np.float32(1.0) or e != 0:
        return f"scale_value {p.scale!r} is outside float32's plain range (two factors)"
    for name, x in (("query", p.q), ("key", p.k), ("value", p.v)):
        if not _strides_aligned(x):
            return f"{name} rows are not contiguous 16-byte-aligned runs (strides {x.strides})"
    return None


def selection_note(cc=None):
    """What CUDA kernel float16 / bfloat16 problems get, and why (for ``info``)."""
    if not config.CUDA_TENSOR_CORES:
        return "portable kernel: config.CUDA_TENSOR_CORES is False"
    if cc is not None and tuple(cc) < (8, 0):
        return f"portable kernel: compute capability {cc[0]}.{cc[1]} < 8.0"
    return (f"tensor-core kernel (mma.sync m16n8k16) for D in {HEAD_DIMS}, contiguous "
            "16-byte-aligned rows, plain scale, no paged / prefixed / int8 kv cache, finite V "
            "(decided on the device); the portable kernel otherwise (the pfa_numba.cuda log "
            "says which a call gets and why)")


def _scan_source(exp_mask):
    mask = np.uint16(exp_mask)

    def nonfinite(x, guard, guard_id):
        for e in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
            if (x[e] & mask) == mask:
                guard[0] = guard_id
    return nonfinite


_SCANS = {}

#: the scan's grid: blocks and threads (a grid-stride loop: any grid covers V; the simulator
#: runs each thread as a Python thread)
SCAN_GRID = (1, 32) if SIMULATOR else (256, 256)


def nonfinite_scan(kind):
    """The kernel that writes its guard_id to guard[0] where a 16-bit value of its flat V span
    is inf or NaN (all exponent bits set). A dropped column of such a V would reach its rows
    through 0 * inf in P V, so the call is then the portable kernel's: the tensor-core kernel
    and the portable one are launched behind the scan, and each reads guard[0] on the device
    (:func:`.kernels.runs_here`): no host round trip decides."""
    if kind not in _SCANS:
        _SCANS[kind] = cuda.jit(_scan_source(0x7C00 if kind == "f16" else 0x7F80))
    return _SCANS[kind]
