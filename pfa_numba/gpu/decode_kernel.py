"""The split-kv decode kernel for float16 / bfloat16 (FlashDecoding's split of the kv range,
on tensor cores), and when it runs.

A decode step reads a long kv cache for one query row per head; so do the speculative
prefill calls of a few rows. Every query head of one kv head reads the same K/V rows, so one
block takes them all: its 16 query rows are the G heads x Sq rows of one kv head (row r is
head ``g * G + r // Sq``, query row ``r % Sq``; G x Sq <= 16, rows past G x Sq are idle), and
each K/V row is read once per group. An int8 cache takes the ``int8`` variant: its tiles
arrive as int8 rows and each warp dequantizes the 16 it reads into one 16-bit tile (a lane
pair a row). The grid is (B x splits, Nkv): the kv range of a batch (``block_kv_range`` of
its query rows) is cut into ``splits`` runs of whole 64-key tiles, as many as keep the GPU's
SMs busy (:func:`split_plan`).

One block: 4 warps, 128 threads. Tiles of 64 keys arrive by ``cp.async`` (16-byte chunks,
consecutive threads on consecutive chunks of a row: coalesced) into a ring of ``NBUF``
XOR-swizzled shared buffers, K(t) and V(t) in turn, ``NBUF - 1`` loads ahead of the warps (48
KiB of static shared memory: 3 buffers at D = 128, 6 at D = 64). Rows come through the kv
sequence of fused_infer_attention_score (``kernels._kv_source``: a shared prefix's rows, then
the batch's own, contiguous at its left-padding offset or in the slots of its paged blocks
through the block table); rows past the run's last column are zero-filled, never read. Warp w
takes keys 16w..16w+15 of each tile: S = Q K^T by ``mma.sync`` m16n8k16 (Q held in
registers as A fragments, K by ``ldmatrix``), the band per accumulator on a tile that crosses
some row's band, the online softmax in log2 units (``numerics.core.online_update_log2``, the scale
folded into the weights' fma as in the tensor-core kernel), P packed from S, O += P V (V by
``ldmatrix.trans``). The four warps' states are then merged in shared memory by the same rule
(each warp's sums rescaled by exp2 of ``online_update_log2``'s shift against the block's
max), and the block writes its piece (unnormalised O, m, l) to a workspace.

:func:`finish_kernel` merges a batch's pieces by that rule once more and finishes its rows as
every kernel does (``numerics.band.row_outcome``: contract 'Empty rows'; a head's sink logit
joins a kept row's sum once, after the merge, ``numerics.core.row_total_log2``; the division,
lse, output rounding). A user mask, pse or a softcap takes the ``masked`` variant (every tile
tested per accumulator by the tensor-core kernel's ``make_row_masks``). Calls whose rows may drop
different columns of a tile (Sq > 1, a mask or pse: :func:`needs_guard`) would let a dropped
column's inf or NaN in V reach a row through 0 * inf in P V: those calls take the tensor-core
kernel's guard (a scan of V on the device; the portable kernel computes the call where it
finds one).

Not this kernel (:func:`decode_reason` says why): more than 16 rows per kv head, TND, other
dtypes and head dims, int8 caches whose channel planes could take a dequantized value beyond
the query's type (``guard.antiquant_limits``), quantized outputs, a scale the
tensor-core kernel does not take, rows or strides not 16-byte aligned, mask or pse columns
not contiguous, compute capability below 8.0.
"""
import numpy as np
from numba import cuda, float32, int32, uint16, uint32

from .. import config
from ..numerics.band import ROW_MEAN, ROW_SOFTMAX, block_kv_range, kv_tiles, row_outcome
from ..numerics.core import (CODE_BF16, CODE_F16, F32_NEG_INF, F32_ONE, F32_ZERO, f32_as_u32, jit,
                             max_nan, online_update_log2, row_total_log2, u32_as_f32)
from ..numerics.kernel_args import (F_SCALE, L_KLEN, L_NEXT, L_PRE, L_QLEN, L_ROWS,
                                    P_D, P_G, P_IP, P_LSE, P_MASK, P_PSE, T_K, T_L, T_M, T_O, T_P,
                                    T_PK, T_PV, T_Q, T_V)
from . import fragments as F
from . import ptx as X
from .kernels import (array_function, device_function, head_sink, kv_places, kv_value,
                      thread_place)
from .tc_conditions import reads_mask_or_pse, rows_reason, scale_reason, softcap_reason
from .tc_kernel import (FULL, HEAD_DIMS, KV_SOURCES, LOG2E, SIGNS, SIMULATOR, band32, banded,
                        capped_forms, kernel_ptx, make_mma_pair, make_online_step, make_row_masks,
                        softcap_terms, stage_walked, start_rows)
from .dequant import make_dequant, row_tokens
from .guard import antiquant_reason

#: query rows of a block (one mma tile) / warps / threads / keys per tile / keys per warp
ROWS, WARPS, BKV = F.MMA_M, 4, 64
THREADS, WARP_KEYS = F.WARP * WARPS, BKV // 4
#: the ring of tile buffers: static shared memory's 48 KiB
RING_BYTES = 48 * 1024
#: the (m, l) pair of a piece's row in the workspace
ML = 2


def ring_buffers(d, int8=False):
    """Tile buffers of the ring at head dim ``d``: each 64 keys x d 16-bit values, or, for an
    int8 cache, 64 x d bytes beside one 16-bit tile the warps dequantize their rows into."""
    if int8:
        return (RING_BYTES - BKV * d * 2) // (BKV * d)
    return RING_BYTES // (BKV * d * 2)


def decode_reason(p):
    """None when the decode kernel can run planned problem ``p`` as far as the problem goes
    beyond what ``dispatch`` declares of the kernel (dtypes, head dims, layouts, compute
    capability), else why not."""
    if p.G * p.Sq > ROWS:
        return (f"{p.G} query heads a kv head x {p.Sq} query rows > {ROWS}: the decode kernel "
                "holds one kv head's rows in one mma tile")
    if np.dtype(p.out_dtype) != np.dtype(p.dtype):
        return f"a {np.dtype(p.out_dtype).name} output (quantized): the scalar kernel writes it"
    return (scale_reason(p.scale) or softcap_reason(p.softcap) or antiquant_reason(p)
            or rows_reason(p))


def split_plan(p, lens, sms):
    """(splits, tiles a split) for planned problem ``p`` with kernel lengths ``lens`` on a GPU
    of ``sms`` multiprocessors: enough blocks for config.CUDA_DECODE_BLOCKS_PER_SM a
    multiprocessor, each split at least config.CUDA_DECODE_MIN_TILES tiles of 64 keys."""
    tiles = 1
    for b in range(p.B):
        jstart, jend = block_kv_range(0, lens[L_QLEN, b], lens[L_PRE, b], lens[L_NEXT, b],
                                      lens[L_KLEN, b])
        tiles = max(tiles, -(-(jend - jstart) // BKV))
    blocks = max(1, p.B * p.Nkv)
    want = -(-int(config.CUDA_DECODE_BLOCKS_PER_SM) * sms // blocks)
    splits = max(1, min(want, tiles // max(1, int(config.CUDA_DECODE_MIN_TILES))))
    per_split = -(-tiles // splits)
    return -(-tiles // per_split), per_split


def workspace_floats(p, splits):
    """float32 values of the workspace: each piece's 16 rows of D sums, then their (m, l)."""
    pieces = p.B * p.Nkv * splits
    return pieces * ROWS * (p.D + ML)


@jit
def _f32_bits(x):
    """The 32 bits of float32 ``x``."""
    return f32_as_u32(np.float32(x))


@jit
def _f32_of(lo, hi):
    """The float32 whose bits are the 16-bit halves ``lo`` and ``hi``."""
    return u32_as_f32(np.uint32(lo) | (np.uint32(hi) << np.uint32(16)))


@jit
def _row_place(gh, r, G, sq):
    """(query head, query row, whether the block computes it) of row r of the block of kv head
    gh of batch b: the G heads' sq rows in order, rows past G x sq idle."""
    n, i = gh * G + r // sq, r % sq
    return n, i, r < G * sq


def decode_kernel_source(kind, d, walk=False, masked=False, int8=False, capped=False):
    """The split kernel's Python source (before ``cuda.jit``) for ``kind`` ("f16" or "bf16"),
    head dim ``d`` (64 or 128) and ``walk``: whether kv rows are found through a shared
    prefix or a paged pool's block table (else each batch's own contiguous rows: a multiply
    and an add a row); ``masked``: whether scores are made per accumulator (a user mask or
    pse to read, or a softcap: every tile is then tested per accumulator, by the tensor-core
    kernel's ``make_row_masks``); ``int8``
    (walking): an int8 cache, its tiles copied as int8 rows into the ring and each warp's
    rows dequantized into one 16-bit tile before its ``ldmatrix`` (``make_dequant``);
    ``capped`` (masked): a softcap on every score (``tc_kernel.make_softcap_log2``).

    Arguments: q, k, v, kp, vp, mask8, mask16, pse, table, strides, boff, lens, params,
    fparams (the ``numerics.kernel_args`` arrays), ws (the float32 workspace), sq (query rows a head),
    per_split (tiles a split), splits, guard, guard_id (a guard_id other than 0 returns where
    guard[0] holds it: the portable kernel computes the call), channel, kts, kto, vts, vto
    (an int8 cache's planes)."""
    assert kind in ("f16", "bf16") and d in HEAD_DIMS and (walk or not int8)
    assert masked or not capped
    D = d
    KT, NO = D // 16, D // 8          # k-steps of S = Q K^T (and 16-dim pairs of O), O n-tiles
    QREGS, OACC = KT * 4, NO * 4
    TILE = BKV * D
    INT8 = bool(int8)
    NBUF = ring_buffers(D, INT8)
    # a ring buffer's 16-bit words, a staged row's, the 16-byte chunks each thread copies and
    # the rows between them; an int8 cache's warps dequantize into the tile at STAGE_AT
    ROW_U16 = D // 2 if INT8 else D
    RAW_TILE = BKV * ROW_U16
    KV_CPT = RAW_TILE // 8 // THREADS
    KV_RSTEP = THREADS // (ROW_U16 // 8)
    STAGE_AT = NBUF * RAW_TILE
    RING = STAGE_AT + TILE if INT8 else STAGE_AT
    RAW_CHUNKS = D // 16              # an int8 row's 16-byte chunks

    def raw_chunk(row, k):
        """Where chunk k of row ``row`` of an int8 tile lies (16-bit words): XOR swizzled by
        the row as the 16-bit tiles are, so that the lane pairs reading 16 rows at once hit
        different banks."""
        return row * ROW_U16 + ((k ^ (row & (RAW_CHUNKS - 1))) << 3)

    raw_chunk = device_function(raw_chunk)
    MAX_AT = 2 * WARPS * ROWS * D      # the warps' row maxima after their sums, then sums
    SUM_AT = MAX_AT + 2 * WARPS * ROWS
    AHEAD = NBUF - 2                   # loads still in flight when one is consumed
    mma_pair = make_mma_pair(kind)
    online_step = make_online_step(2, NO)
    pack = X.pack_f16x2 if kind == "f16" else X.pack_bf16x2
    exp2 = X.exp2_approx_ftz if config.CUDA_EXP2_FTZ else X.exp2_approx
    ALIGN = None if SIMULATOR else 16
    WALK, MASKED, CAPPED = bool(walk), bool(masked), bool(capped)
    row_masks = make_row_masks(2, CODE_F16 if kind == "f16" else CODE_BF16, capped)
    dequant_chunk = make_dequant(kind, D)

    def stage(ring, dst, u, t0, nt, jstart, jend, at):
        """Copy load ``u`` of the run (K of its tile u // 2 for even u, V for odd) into ring
        buffer ``dst``: this thread's CPT chunks, rows at or past jend zero-filled; then
        close the group (an empty one past the run's last load keeps the counting even)."""
        k, v, kp, vp, table, b, crow, ccol, c_at, k_rows, v_rows, columns = at
        if u < 2 * nt:
            is_v = u & 1
            rows = v_rows if is_v else k_rows
            j = jstart + (t0 + (u >> 1)) * BKV + crow
            for c in range(KV_CPT):
                to = dst + c_at + c * KV_RSTEP * ROW_U16
                if not WALK:
                    if j < jend:
                        X.cp_async_16_zfill(ring, to, v if is_v else k,
                                            rows[2] + j * rows[3] + ccol, 16)
                    else:
                        X.cp_async_16_zfill(ring, to, k, 0, 0)
                else:           # K(t) divides, V(t) (the next load) reuses its columns
                    stage_walked(ring, to, is_v, j, jend, columns, c, rows, table, b,
                                  (k, v, kp, vp), ccol)
                j += KV_RSTEP
        X.cp_async_commit()

    def dequantize(ring, raw, r, j0, jend, w, lane, dq):
        """The int8 variant: warp w's rows 16w .. 16w + 15 of the K (r = 0) or V (r = 1) tile
        at ring offset ``raw``, key j0 first, dequantized into the tile at STAGE_AT: a row
        a lane pair (one token pair a lane), half its chunks each."""
        row = WARP_KEYS * w + (lane >> 1)
        j = j0 + row
        scale, offset = row_tokens(r, j, jend, dq)
        for it in range(RAW_CHUNKS // 2):
            k = (lane & 1) * (RAW_CHUNKS // 2) + it
            dequant_chunk(ring, raw + raw_chunk(row, k), ring,
                          STAGE_AT + F.swizzle(row, 16 * k, D),
                          STAGE_AT + F.swizzle(row, 16 * k + 8, D), r, 16 * k, j < jend, scale,
                          offset, dq)

    # One tile is four phases the kernel calls one after another, not one function: Numba
    # inlines a device function by copying its IR whole at each call site, at a cost of its
    # blocks times its variables, so one function holding the four would cost the front end
    # several times what the four cost apart.
    def landed(ring, u, r, t0, nt, jstart, jend, j0, at, lane_at, dq):
        """K (r = 0: load ``u`` of the run) or V (r = 1: load u + 1) of the tile at key j0
        landed and every warp done with the buffer the next load fills: that load staged;
        the buffer the tile is read from (the int8 variant: the warp's rows dequantized into
        it). (The buffers' indices as two expressions, not one of u + r: the modulo of a sum
        costs the kv loop instructions.)"""
        X.cp_async_wait(AHEAD)
        cuda.syncthreads()
        fill, here = ((u + NBUF - 1) % NBUF, u % NBUF) if r == 0 else (u % NBUF, (u + 1) % NBUF)
        stage(ring, fill * RAW_TILE, u + NBUF - 1 + r, t0, nt, jstart, jend, at)
        if INT8:
            X.syncwarp()                 # the warp's lanes are past their reads of the tile
            w, lane = lane_at[4], lane_at[2] * 4 + lane_at[3]
            dequantize(ring, here * RAW_TILE, r, j0, jend, w, lane, dq)
            X.syncwarp()
            return STAGE_AT
        return here * TILE

    def make_tile_softmax(band):
        """The tile's weights from K in ``kbuf``: S = Q K^T, the band (``band``: the tile
        crosses some row's band; the masked variant: the band, pse and masks made per
        accumulator), the online softmax and P packed as A fragments."""
        def tile_softmax(ring, kbuf, j0, frag, lane_at, rows, fold, ex):
            qa, o, s, pa, mr, lr = frag
            b_at, t4, w = lane_at[1], lane_at[3], lane_at[4]
            for x in range(8):
                s[x] = F32_ZERO
            for kk in range(KT):
                mma_pair(s, 0, qa, 4 * kk, X.ldmatrix_x4(
                    ring, kbuf + F.swizzle_step(b_at, WARP_KEYS * w, 16 * kk, D)))
            if band:
                jc = j0 + WARP_KEYS * w + 2 * t4           # the lane's first key
                for h in range(2):
                    lo, hi = band32(rows[h], rows[2], jc, rows[4], rows[5], rows[3])
                    if MASKED:      # t = s * fold, softcapped, with the band, pse and masks
                        row_masks(s, h, fold, lo, hi, ex[5][h] + jc, ex[6][h] + jc, ex)
                    else:
                        for nt8 in range(2):
                            for e in range(2):
                                x = 4 * nt8 + 2 * h + e
                                s[x] = banded(s[x], np.int32(8 * nt8 + e), lo, hi)
            if MASKED:
                fold = F32_ONE                  # the scores are in log2 units already
            online_step(s, o, mr, lr, fold)
            for reg in range(4):
                nt2, x = F.p_from_s(reg)
                pa[reg] = pack(s[4 * nt2 + x], s[4 * nt2 + x + 1])
        return device_function(tile_softmax)

    def tile_values(ring, vbuf, frag, lane_at):
        """O += P V from V in ``vbuf``."""
        pa, o, a_at, w = frag[3], frag[1], lane_at[0], lane_at[4]
        for dp in range(KT):
            mma_pair(o, 8 * dp, pa, 0, X.ldmatrix_x4_trans(
                ring, vbuf + F.swizzle_step(a_at, WARP_KEYS * w, 16 * dp, D)))

    stage = device_function(stage)
    dequantize = device_function(dequantize)
    landed, tile_values = device_function(landed), device_function(tile_values)
    softmax_inside, softmax_edge = make_tile_softmax(False), make_tile_softmax(True)

    def load_q(qa, q, boff, strides, b, gh, G, sq, ql, lane):
        """Q's A fragments (rows g, g + 8 of the lane; idle rows and rows at or past qL
        zero) from global memory: once a block, so plain 16-bit loads."""
        for reg in range(4):
            r, c = F.mma_a(lane, reg)
            n, i, used = _row_place(gh, r, G, sq)
            at = boff[T_Q, b] + n * strides[T_Q, 0] + i * strides[T_Q, 1]
            sd = strides[T_Q, 2]
            for kk in range(KT):
                lo_bits, hi_bits = uint32(0), uint32(0)
                if used and i < ql:
                    lo_bits = uint32(q[at + (16 * kk + c) * sd])
                    hi_bits = uint32(q[at + (16 * kk + c + 1) * sd])
                qa[4 * kk + reg] = lo_bits | (hi_bits << uint32(16))

    load_q = device_function(load_q)

    def shared_f32(ring, at):
        """The float32 stored at 16-bit offset ``at`` of the ring."""
        return _f32_of(ring[at], ring[at + 1])

    shared_f32 = device_function(shared_f32)

    def block_max(ring, r):
        """Row r's maximum over the warps' maxima in the ring."""
        top = F32_NEG_INF
        for x in range(WARPS):
            top = max_nan(top, shared_f32(ring, MAX_AT + 2 * (x * ROWS + r)))
        return top

    block_max = device_function(block_max)

    def decode_split(q, k, v, kp, vp, mask8, mask16, pse, table, strides, boff, lens, params,
                     fparams, ws, sq, per_split, splits, guard, guard_id, channel, kts, kto, vts,
                     vto):
        if guard_id != 0 and guard[0] == guard_id:
            return                      # V holds inf or NaN: the portable kernel runs the call
        ring = cuda.shared.array(RING, uint16, alignment=ALIGN)
        qa = cuda.local.array(QREGS, uint32)
        o = cuda.local.array(OACC, float32)
        s = cuda.local.array(8, float32)
        pa = cuda.local.array(4, uint32)
        mr = cuda.local.array(2, float32)
        lr = cuda.local.array(2, float32)
        tid, lane, w, g4, t4 = thread_place()
        b = cuda.blockIdx.x // splits
        split = cuda.blockIdx.x - b * splits
        gh = cuda.blockIdx.y
        G = params[P_G]
        ql, kl, pre_e, next_e = lens[L_QLEN, b], lens[L_KLEN, b], lens[L_PRE, b], lens[L_NEXT, b]
        jstart, jend, ntiles, ta, tb = kv_tiles(0, ql, kl, pre_e, next_e, BKV)
        t0 = min(split * per_split, ntiles)
        nt = min(t0 + per_split, ntiles) - t0
        if MASKED:                       # every tile tested per accumulator
            ta, tb = 0, 0
        start_rows(mr, lr, o)
        lane_at = F.lane_addresses(lane, D) + (g4, t4, w)
        if INT8:                         # 16 int8 values a chunk
            crow, ccol = tid // RAW_CHUNKS, tid % RAW_CHUNKS * 16
            c_at = raw_chunk(crow, ccol >> 4)
        else:
            crow, ccol = F.tile_chunk(tid, D)
            c_at = F.swizzle(crow, ccol, D)
        at = (k, v, kp, vp, table, b, crow, ccol, c_at,
              kv_places(strides, boff, params, T_K, T_PK, b, gh),
              kv_places(strides, boff, params, T_V, T_PV, b, gh),
              cuda.local.array(KV_CPT, int32))
        dq = (channel, kts, kto, vts, vto, strides, boff, params, table, b, gh)
        c2 = fparams[F_SCALE] * LOG2E
        # the lane's two rows as query rows (rows a block does not compute: past qL)
        n0, i0, used0 = _row_place(gh, g4, G, sq)
        n1, i1, used1 = _row_place(gh, g4 + 8, G, sq)
        rows = (i0 if used0 else ql, i1 if used1 else ql, ql, kl, pre_e, next_e)
        fold = abs(c2)
        frag = (qa, o, s, pa, mr, lr)
        # the masked variant's pse and mask rows of the lane's two rows, its softcap
        p_base, m_base = boff[T_P, b], boff[T_M, b]
        ex = (pse, mask8, mask16, params[P_PSE] != 0, params[P_MASK],
              (p_base + n0 * strides[T_P, 0] + i0 * strides[T_P, 1],
               p_base + n1 * strides[T_P, 0] + i1 * strides[T_P, 1]),
              (m_base + i0 * strides[T_M, 1], m_base + i1 * strides[T_M, 1]),
              softcap_terms(fparams) if CAPPED else (F32_ZERO, F32_ZERO))
        if nt > 0:
            load_q(qa, q, boff, strides, b, gh, G, sq, ql, lane)
            if c2 < F32_ZERO:
                for x in range(QREGS):
                    qa[x] ^= SIGNS
            for u in range(NBUF - 1):
                stage(ring, u * RAW_TILE, u, t0, nt, jstart, jend, at)
            # the run's tiles before the band's interior, inside it (no band test), after it
            a = min(max(ta - t0, 0), nt)
            z = min(max(tb - t0, a), nt)
            # a tile: K(t) landed, the softmax, V(t) landed, O += P V (the edges' softmax
            # with the band)
            for idx in range(a):
                j0 = jstart + (t0 + idx) * BKV
                kbuf = landed(ring, 2 * idx, 0, t0, nt, jstart, jend, j0, at, lane_at, dq)
                softmax_edge(ring, kbuf, j0, frag, lane_at, rows, fold, ex)
                vbuf = landed(ring, 2 * idx, 1, t0, nt, jstart, jend, j0, at, lane_at, dq)
                tile_values(ring, vbuf, frag, lane_at)
            if not MASKED:
                for idx in range(a, z):
                    j0 = jstart + (t0 + idx) * BKV
                    kbuf = landed(ring, 2 * idx, 0, t0, nt, jstart, jend, j0, at, lane_at, dq)
                    softmax_inside(ring, kbuf, j0, frag, lane_at, rows, fold, ex)
                    vbuf = landed(ring, 2 * idx, 1, t0, nt, jstart, jend, j0, at, lane_at, dq)
                    tile_values(ring, vbuf, frag, lane_at)
            for idx in range(z, nt):
                j0 = jstart + (t0 + idx) * BKV
                kbuf = landed(ring, 2 * idx, 0, t0, nt, jstart, jend, j0, at, lane_at, dq)
                softmax_edge(ring, kbuf, j0, frag, lane_at, rows, fold, ex)
                vbuf = landed(ring, 2 * idx, 1, t0, nt, jstart, jend, j0, at, lane_at, dq)
                tile_values(ring, vbuf, frag, lane_at)
        # the warps' states merged: each warp's sums over its keys, rescaled to the block's max
        for h in range(2):
            for sh in (1, 2):
                lr[h] += X.shfl_xor_sync(FULL, lr[h], sh)
        X.cp_async_wait(0)
        cuda.syncthreads()               # every warp is past its last read of the ring
        # the ring then holds WARPS x ROWS x D float32 sums, then each warp's row maxima and
        # sums (32-bit values at even 16-bit offsets)
        if t4 == 0:
            for h in range(2):
                r = g4 + 8 * h
                X.st_shared_u32(ring, MAX_AT + 2 * (w * ROWS + r), _f32_bits(mr[h]))
                X.st_shared_u32(ring, SUM_AT + 2 * (w * ROWS + r), _f32_bits(lr[h]))
        cuda.syncthreads()
        for h in range(2):
            f = exp2(online_update_log2(mr[h], block_max(ring, g4 + 8 * h))[1])
            for dt in range(NO):
                for e in range(2):
                    at_sum = 2 * ((w * ROWS + g4 + 8 * h) * D + 8 * dt + 2 * t4 + e)
                    X.st_shared_u32(ring, at_sum, _f32_bits(o[4 * dt + 2 * h + e] * f))
        cuda.syncthreads()
        piece = (b * cuda.gridDim.y + gh) * splits + split
        for e in range(tid, ROWS * D, THREADS):
            y = F32_ZERO
            for x in range(WARPS):
                y += shared_f32(ring, 2 * (x * ROWS * D + e))
            ws[piece * ROWS * D + e] = y
        if tid < ROWS:
            top = block_max(ring, tid)
            total = F32_ZERO
            for x in range(WARPS):
                m_w = shared_f32(ring, MAX_AT + 2 * (x * ROWS + tid))
                total += shared_f32(ring, SUM_AT + 2 * (x * ROWS + tid)) * \
                    exp2(online_update_log2(m_w, top)[1])
            at_ml = ml_offset(cuda.gridDim.x * cuda.gridDim.y, D) + ML * (piece * ROWS + tid)
            ws[at_ml], ws[at_ml + 1] = top, total

    return decode_split


@array_function
def ml_offset(pieces, d):
    """Where the workspace's (m, l) pairs start, after ``pieces`` pieces of 16 x d sums."""
    return pieces * ROWS * d


def finish_source(kind):
    """The kernel that merges a batch's pieces and finishes its rows (grid (B, Nkv), 128
    threads: 8 a row, each on every 8th head dim). Arguments: ws, out, lse, v, vp, table,
    strides, boff, lens, params, fparams, sq, splits, guard, guard_id, channel, kts, kto, vts,
    vto."""
    exp2 = X.exp2_approx_ftz if config.CUDA_EXP2_FTZ else X.exp2_approx
    from ..numerics.core import f32_to_bf16, f32_to_f16
    to_bits = f32_to_f16 if kind == "f16" else f32_to_bf16
    LANES = THREADS // ROWS

    def decode_finish(ws, out, lse, v, vp, table, strides, boff, lens, params, fparams, sq, splits,
                      guard, guard_id, channel, kts, kto, vts, vto):
        if guard_id != 0 and guard[0] == guard_id:
            return
        b, gh = cuda.blockIdx.x, cuda.blockIdx.y
        r, c = cuda.threadIdx.x // LANES, cuda.threadIdx.x % LANES
        D, G = params[P_D], params[P_G]
        n, i, used = _row_place(gh, r, G, sq)
        ql, kl, pre_e, next_e = lens[L_QLEN, b], lens[L_KLEN, b], lens[L_PRE, b], lens[L_NEXT, b]
        if not used or i >= lens[L_ROWS, b]:
            return
        first = (b * cuda.gridDim.y + gh) * splits
        ml_at = ml_offset(cuda.gridDim.x * cuda.gridDim.y * splits, D)
        top = F32_NEG_INF
        for x in range(splits):
            top = max_nan(top, ws[ml_at + ML * ((first + x) * ROWS + r)])
        total = F32_ZERO
        for x in range(splits):
            at = ml_at + ML * ((first + x) * ROWS + r)
            total += ws[at + 1] * exp2(online_update_log2(ws[at], top)[1])
        outcome, mlo, mhi, denom = row_outcome(i < ql, top, total, params[P_IP], i, pre_e,
                                               next_e, kl)
        row_lse = F32_NEG_INF
        if outcome == ROW_SOFTMAX:     # a row that kept a score: its head's sink joins the sum
            sink = head_sink(fparams, n)
            denom, row_lse = row_total_log2(top, total, sink, exp2(X.fma_f32(sink, LOG2E, -top)))
        o_at = boff[T_O, b] + n * strides[T_O, 0] + i * strides[T_O, 1]
        for d in range(c, D, LANES):
            y = F32_ZERO                  # ROW_ZERO
            if outcome == ROW_SOFTMAX:
                for x in range(splits):
                    f = exp2(online_update_log2(ws[ml_at + ML * ((first + x) * ROWS + r)],
                                                top)[1])
                    y += ws[((first + x) * ROWS + r) * D + d] * f
                y = y / denom
            elif outcome == ROW_MEAN:     # contract 'Empty rows': the mean of V over the band
                for j in range(mlo, mhi + 1):
                    y += kv_value(v, vp, table, strides, boff, params, channel, kts, kto, vts,
                                  vto, 1, b, gh, j, d)
                y = y / denom
            out[o_at + d * strides[T_O, 2]] = to_bits(y)
        if c == 0 and params[P_LSE] != 0:
            lse[boff[T_L, b] + n * strides[T_L, 0] + i * strides[T_L, 1]] = row_lse

    return decode_finish


_KERNELS = {}


def needs_guard(p):
    """Whether the rows of a block of planned problem ``p`` may drop different columns of a
    tile (several query rows a head, a user mask or pse), so that a dropped column's inf or
    NaN in V would reach a row through 0 * inf: the call then takes the V guard."""
    return p.Sq > 1 or reads_mask_or_pse(p)


def decode_kernels_for(kind, d, walk, masked, int8=False, capped=False):
    """The compiled (lazily, at first launch) split and finish kernels for ``kind``, ``d``,
    ``walk``, ``masked``, ``int8`` and ``capped``."""
    key = kind, d, bool(walk), bool(masked), bool(int8), bool(capped)
    if key not in _KERNELS:
        bounds = {} if SIMULATOR else {"launch_bounds": (THREADS,)}
        _KERNELS[key] = (cuda.jit(decode_kernel_source(*key), fastmath=False, **bounds),
                         cuda.jit(finish_source(kind), fastmath=False))
    return _KERNELS[key]


def decode_signature(int8=False):
    """The split kernel's argument types (key and value int8 for the ``int8`` variant)."""
    from numba import types
    flat = lambda t: types.Array(t, 1, "C")  # noqa: E731
    grid = types.Array(types.int64, 2, "C")
    u16, f32 = flat(types.uint16), flat(types.float32)
    kv = flat(types.int8) if int8 else u16
    return (u16, kv, kv, kv, kv, flat(types.uint8), u16, u16, grid, grid, grid, grid,
            flat(types.int64), f32, f32, types.int64, types.int64, types.int64,
            flat(types.int64), types.int64, types.Array(types.float32, 2, "C"), f32, f32, f32,
            f32)


def decode_ptx(kind, d, cc, walk=False, masked=False, int8=False, capped=False):
    """The split kernel's PTX for ``kind``, ``d``, compute capability ``cc``, ``walk``,
    ``masked``, ``int8`` and ``capped``."""
    return kernel_ptx(decode_kernel_source(kind, d, walk, masked, int8, capped),
                      decode_signature(int8), cc, THREADS)


#: the compute capabilities the PTX files are written for
PTX_ARCHS = ((8, 0), (9, 0))


def ptx_names():
    """{file name: (kind, head dim, compute capability, walk, masked, int8, capped)} of every
    specialisation written, e.g. ``decode_f16_d128_sm90.ptx``, ``decode_f16_d128_walk_sm90.ptx``
    (kv rows through a prefix or a block table), ``decode_f16_d128_int8_sm90.ptx`` (an int8
    cache, walked), ``decode_f16_d128_masked_sm90.ptx`` (a user mask or pse),
    ``decode_f16_d128_masked_capped_sm90.ptx`` (and a softcap on every score)."""
    return {f"decode_{kind}_d{d}{suffix}{'_masked' if masked else ''}"
            f"{'_capped' if capped else ''}_sm{cc[0]}{cc[1]}.ptx":
            (kind, d, cc, walk, masked, int8, capped)
            for kind in ("f16", "bf16") for d in HEAD_DIMS
            for (walk, int8), suffix in KV_SOURCES.items() for masked in (False, True)
            for capped in capped_forms(masked, walk) for cc in PTX_ARCHS}


def loop_names(walk, masked=False, int8=False, capped=False):
    """What each kv loop of a specialisation's SASS is, in code order (``capped`` adds no
    loop)."""
    rows = ("int8 rows through the kv sequence" if int8 else
            "rows through the kv sequence" if walk else "contiguous rows")
    if masked:
        return (f"kv loop, tiles before the band's interior ({rows})",
                f"kv loop, every tile ({rows}; mask and pse per accumulator)")
    return tuple(f"kv loop, tiles {where} ({rows})"
                 for where in ("before the band's interior", "inside the band",
                               "after the band's interior"))


def grids(p, splits):
    """((grid, block) of the split kernel, (grid, block) of the finish kernel)."""
    return ((p.B * splits, p.Nkv), THREADS), ((p.B, p.Nkv), THREADS)

