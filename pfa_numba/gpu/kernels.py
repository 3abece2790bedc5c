"""The CUDA kernels: a ``@cuda.jit`` tiled online-softmax kernel over the shared numerics.

One thread block computes ``CUDA_Q_ROWS`` query rows of one (batch, head); each thread owns one
row (its scaled query and its float32 accumulator live in local memory). The block walks the kv
tiles of its band only (tiles outside the band or past kL are skipped), staging each K and V
tile in shared memory with coalesced loads (consecutive threads read consecutive elements of a
row) widened to float32 by ``numerics.core.widen``; the float kernel's rows come through
fused_infer_attention_score's kv sequence (:func:`_kv_source`: a shared prefix, contiguous or
paged rows, int8 ones dequantized by ``numerics.core.antiquant``). Then each thread runs the three
online-softmax steps of the CPU kernel on its row: scores (band, user mask, pse, fp16 mask),
update m and l, rescale acc and add P V. The band predicate and the row rule of contract
'Empty rows' (``numerics.band``),
the online update, exp, the int8 steps and every dtype conversion (``numerics.core``) are the functions the
CPU kernels use; the kernels read the arguments ``numerics.kernel_args`` builds for both targets.
"""

import numba
from numba import cuda, float32, int64, njit, uint16

from .. import config
from ..cache import CACHE
from ..numerics.band import ROW_MEAN, ROW_SOFTMAX, ROW_ZERO, block_kv_range, row_band, row_outcome
from ..numerics.core import (CODE_BF16, CODE_F16, CODE_F32, CODE_I8, F16_MASK_SCALE, F32_NAN,
                             F32_NEG_INF, F32_ONE, F32_ZERO, MASK_ADD_F16, MASK_DISCARD, antiquant,
                             f16_to_f32, f32_to_bf16, f32_to_f16, int8_out_f16, int8_score,
                             int8_score_pse, int8_weight, max_nan, online_update, quantize_output,
                             row_total, running_sum, softcapped, softmax_weight, times_pow2,
                             widen)
from ..numerics.kernel_args import (F_DEQ1, F_DEQ2, F_QS1, F_SCALE, F_SCALE16, F_SCALE2,
                                    F_SINKS, F_SOFTCAP, L_KLEN, L_NEXT, L_PRE, L_QLEN, L_ROWS,
                                    P_BLOCK, P_CODE, P_D, P_DEQUANT, P_G, P_IP, P_KTOK, P_KVCODE,
                                    P_LSE, P_MASK, P_OCODE, P_PREFIX, P_PSE, P_SCALE_EXP, P_VTOK,
                                    S_BLOCK, S_ELEM, S_HEAD, S_ROW, T_K, T_KT, T_L, T_M, T_O, T_P,
                                    T_PK, T_PV, T_Q, T_V, T_VT, row_offset)


def _pad_dim(d):
    """Compile-time head-dim capacity: the next power of two >= d (>= 32)."""
    p = 32
    while p < d:
        p *= 2
    return p


def array_function(fn):
    """A kernel helper taking arrays: inlined compiled code on a GPU, and under the CUDA
    simulator the Python function itself (the simulator's device arrays cannot enter compiled
    code)."""
    if numba.config.ENABLE_CUDASIM:
        return fn
    return njit(inline="always", cache=CACHE)(fn)


def device_function(fn):
    """A kernel's own device function: inlined into it on a GPU, plain Python under the
    simulator."""
    if numba.config.ENABLE_CUDASIM:
        return fn
    return cuda.jit(device=True, inline="always")(fn)


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


def kernel_signature(storage, out_storage=None, int8=False, kv_storage=None, kv_cache=None):
    """The argument types of a kernel: ``storage`` of the query (numba.types.uint16, float32,
    or int8 for the int8 kernel), ``out_storage`` of the output (default: ``storage``; int8 for
    quantized outputs; uint16 for the int8 kernel's float16 output), ``kv_storage`` of key and
    value (default: ``storage``; int8 for a kv cache dequantized as it loads). ``kv_cache``
    (default: the float kernel's) adds the kv cache's arrays (kp, vp, table, channel and the
    four token planes: kts, kto, vts, vto); the int8 and tensor-core kernels take the common
    arguments only."""
    from numba import types
    flat = lambda t: types.Array(t, 1, "C")  # noqa: E731
    grid = types.Array(types.int64, 2, "C")
    out_storage = out_storage or (types.uint16 if int8 else storage)
    kv_storage = kv_storage or storage
    pse = types.uint16 if int8 else storage
    common = (flat(storage), flat(kv_storage), flat(kv_storage), flat(out_storage),
              flat(types.float32), flat(types.uint8), flat(types.uint16), flat(pse), grid, grid,
              grid, flat(types.int64), types.int64, flat(types.float32), flat(types.float32),
              flat(types.float32), flat(types.int64), types.int64)
    if kv_cache is None:
        kv_cache = not int8
    if not kv_cache:
        return common
    return common + (flat(kv_storage), flat(kv_storage), grid,
                     types.Array(types.float32, 2, "C")) + (flat(types.float32),) * 4


@array_function
def kv_places(strides, boff, params, t, tp, b, gh):
    """Where kv head gh's rows of batch b lie in tensor t (T_K or T_V) and its shared prefix
    tp: (prefix rows P, block size (0: contiguous), first element, row stride, block stride,
    the prefix's first element, its row stride), for :func:`kv_at`."""
    return (params[P_PREFIX], params[P_BLOCK], boff[t, b] + gh * strides[t, S_HEAD],
            strides[t, S_ROW], strides[t, S_BLOCK], boff[tp, b] + gh * strides[tp, S_HEAD],
            strides[tp, S_ROW])


#: a kv place's block for a shared prefix's row (its index is the prefix row) / a row past
#: the run's end (zero-filled)
IN_PREFIX, PAST_END = -1, -2


@array_function
def kv_block_of(P, block, j):
    """The block-table column of logical kv row j (IN_PREFIX for a shared prefix's row, 0 for
    contiguous rows): the division of the walk, which K and V of one row share."""
    if j < P:
        return IN_PREFIX
    return (j - P) // block if block != 0 else 0


@array_function
def kv_place_in(P, block, table, b, j, n):
    """(block, index) of logical kv row j of batch b whose block-table column is ``n``
    (:func:`kv_block_of`): (IN_PREFIX, j) for a shared prefix's row, else the pool block and
    its slot, or block 0 and the row itself for contiguous rows (``numerics.kernel_args.row_offset``'s
    walk)."""
    if n == IN_PREFIX:
        return IN_PREFIX, j
    j -= P
    if block == 0:
        return 0, j
    return table[b, n], j - n * block


@array_function
def kv_place(P, block, table, b, j):
    """:func:`kv_place_in` of logical kv row j."""
    return kv_place_in(P, block, table, b, j, kv_block_of(P, block, j))


@array_function
def kv_at(rows, where, idx):
    """Element offset of the row at place (where, idx) (:func:`kv_place`) in the tensor whose
    places :func:`kv_places` gives: in the prefix's array for IN_PREFIX."""
    _, _, base, row, block_stride, p_base, p_row = rows
    if where == IN_PREFIX:
        return p_base + idx * p_row
    return base + where * block_stride + idx * row


@array_function
def _kv_source(strides, boff, table, params, t, t_prefix, t_token, mode, scales, offsets, b, g,
               j):
    """Where kv row j (logical: a shared prefix's rows first) of kv head g of batch b lies in
    tensor t (T_K or T_V): (whether in the prefix's array, the element offset of its first
    value, its element stride, its token scale and offset, (1, 0) without token planes of
    ``mode`` 1 by row or 2 by paged slot: scales at geometry row t_token, offsets at the next).
    The CPU's cpu.kv walks the same rows."""
    places = kv_places(strides, boff, params, t, t_prefix, b, g)
    where, idx = kv_place(places[0], places[1], table, b, j)
    off = kv_at(places, where, idx)
    if where == IN_PREFIX:
        return True, off, strides[t_prefix, S_ELEM], F32_ONE, F32_ZERO
    scale, offset = F32_ONE, F32_ZERO
    if mode != 0:
        tblock, own = (places[1] if mode == 2 else 0), j - places[0]
        ts, to = t_token, t_token + 1
        scale = scales[row_offset(boff[ts, b], strides[ts, S_ROW], strides[ts, S_BLOCK], tblock,
                                  where, own) + g * strides[ts, S_HEAD]]
        offset = offsets[row_offset(boff[to, b], strides[to, S_ROW], strides[to, S_BLOCK],
                                    tblock, where, own) + g * strides[to, S_HEAD]]
    return False, off, strides[t, S_ELEM], scale, offset


@cuda.jit
def fill_kernel(x, value):
    """x[:] = value (results of a left-padded call: its rows before the windows)."""
    for e in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        x[e] = value


def fill_grid(n):
    """fill_kernel's grid (blocks, threads) for ``n`` elements: a thread an element up to 256
    blocks of 256 threads (the grid-stride loop covers the rest), so a small result is not
    filled by 65536 threads (a thread each is what the CUDA simulator runs)."""
    threads = 256
    return min(256, max(1, -(-n // threads))), threads


@array_function
def runs_here(guard, guard_id):
    """Whether a portable kernel computes this call: always for guard_id 0; else only where
    the scan before it (gpu.tc_kernel) found V not finite and wrote guard_id to guard[0] (the
    tensor-core kernel launched beside it computes the call otherwise). The choice is made on
    the device, in stream order: no host read."""
    return guard_id == 0 or guard[0] == guard_id


@array_function
def _block_rows(lens, b, i0, i, bq, bkv, runs):
    """The set-up both kernels share for row i of the block of rows [i0, i0 + bq) of batch b,
    from its lengths (qL, kL), band edges (preE, nextE) and output rows rows_b: (kL, preE,
    nextE, rows_b, whether row i is computed, the kv columns [jstart, jend) any row of the
    block keeps, their number of tiles, row i's band [lo, hi]). Every thread of the block gets
    the same tiles, so all reach every syncthreads. A block of a call that another kernel
    computes (``runs`` False: :func:`runs_here`) has no rows to compute or write and no tiles."""
    ql, kl, pre_e, next_e = lens[L_QLEN, b], lens[L_KLEN, b], lens[L_PRE, b], lens[L_NEXT, b]
    rows_b = lens[L_ROWS, b] if runs else 0
    jstart, jend = block_kv_range(i0, min(i0 + bq, ql), pre_e, next_e, kl)
    ntiles = (jend - jstart + bkv - 1) // bkv if jend > jstart and runs else 0
    lo, hi = row_band(i, pre_e, next_e, kl)
    return kl, pre_e, next_e, rows_b, i < ql and runs, jstart, jend, ntiles, lo, hi


@njit(inline="always", cache=CACHE)
def _block_place(bx, by, tid, qtiles, bq, G):
    """(batch, first query row of the block, query head, this thread's row, the query head's kv
    head) of thread tid of block (bx, by): the grid is (B x query-row blocks, N)."""
    b = bx // qtiles
    i0 = (bx - b * qtiles) * bq
    return b, i0, by, i0 + tid, by // G


@njit(inline="always", cache=CACHE)
def _tile(t, jstart, jend, bkv):
    """(first column, columns) of kv tile t of the columns [jstart, jend)."""
    j0 = jstart + t * bkv
    return j0, min(bkv, jend - j0)


@njit(inline="always", cache=CACHE)
def _tile_element(e, D, base, row_stride, sd):
    """Element e of a tile of rows of D values, as (row, column, index in the source): the
    block's threads take consecutive elements, so consecutive threads read consecutive
    elements of a row."""
    c = e // D
    d = e - c * D
    return c, d, base + c * row_stride + d * sd


@cuda.jit(device=True, inline="always")   # a device function under the simulator too
def thread_place():
    """(tid, lane, warp, g4, t4) of this thread: its index in the block, its lane and warp, and
    the lane's group of four in the warp (g4: the mma fragments' rows g4, g4 + 8) and place in
    that group (t4)."""
    tid = cuda.threadIdx.x
    lane = tid & 31
    return tid, lane, tid >> 5, lane >> 2, lane & 3


@cuda.jit(device=True, inline="always")   # a device function under the simulator too
def _thread_place(params, qtiles, bq):
    """(thread index, batch, first query row of the block, query head, the thread's row, its kv
    head): :func:`_block_place` of this thread."""
    tid = cuda.threadIdx.x
    return (tid,) + _block_place(cuda.blockIdx.x, cuda.blockIdx.y, tid, qtiles, bq,
                                 params[P_G])


@array_function
def _row_places(strides, boff, b, n, i):
    """(output offset, output element stride, softmax_lse offset) of query row i of head n in
    batch b."""
    return (boff[T_O, b] + n * strides[T_O, 0] + i * strides[T_O, 1], strides[T_O, 2],
            boff[T_L, b] + n * strides[T_L, 0] + i * strides[T_L, 1])


@array_function
def _row_end(lse, state, band, strides, boff, b, n):
    """What becomes of query row i of head n in batch b at the end (state = (whether it was
    computed, its m, its l, inner_precise, whether softmax_lse is wanted, the scale's post_e,
    the head's sink logit or -inf), band = (i, preE, nextE, kL)): row_outcome's (outcome, band
    columns lo, hi, divisor: a kept row's with its sink, numerics.core.row_total) and the
    output row's (offset, element stride). Writes the row's softmax_lse where wanted."""
    active, m, l, inner_precise, want_lse, post_e, sink = state
    i, pre_e, next_e, kl = band
    o_off, osd, l_off = _row_places(strides, boff, b, n, i)
    outcome, lo, hi, divisor = row_outcome(active, m, l, inner_precise, i, pre_e, next_e, kl)
    row_lse = F32_NEG_INF
    if outcome == ROW_SOFTMAX:
        divisor, row_lse = row_total(m, l, sink, post_e)
    if want_lse:
        lse[l_off] = row_lse
    return outcome, lo, hi, divisor, o_off, osd


@array_function
def head_sink(fparams, n):
    """Query head n's sink logit, -inf without sinks (numerics.kernel_args: F_SINKS)."""
    return fparams[F_SINKS + n] if fparams.size > F_SINKS else F32_NEG_INF


@array_function
def _finish_row(out, lse, acc, v, vp, table, strides, boff, params, sources, quant, state,
                band, b, n, g):
    """The float kernel's end of query row band[0] of head n (kv head g) in batch b: the output
    row (not pre-zeroed) from the accumulator, the mean of the band's V rows or zeros (contract
    'Empty rows'), in the output's storage; its softmax_lse (:func:`_row_end`; sources =
    (channel, kts, kto, vts, vto) of the kv sequence, quant = (scale2, offset2))."""
    D, ocode, kv_code, dequant = params[P_D], params[P_OCODE], params[P_KVCODE], \
        params[P_DEQUANT] != 0
    channel, kts, kto, vts, vto = sources
    outcome, mlo, mhi, denom, o_off, osd = _row_end(lse, state, band, strides, boff, b, n)
    if outcome == ROW_MEAN:
        for d in range(D):
            acc[d] = F32_ZERO
        for j in range(mlo, mhi + 1):
            in_prefix, off, sd, ts, to = kv_row(strides, boff, table, params, 1, kts, kto, vts,
                                                vto, b, g, j)
            for d in range(D):
                acc[d] += _kv_element(v, vp, in_prefix, off + d * sd, kv_code, dequant, channel,
                                      1, g * D + d, ts, to)
    for d in range(D):
        x = acc[d] / denom if outcome != ROW_ZERO else F32_ZERO
        # numerics.core.store, spelled out: device arrays cannot enter an njit function under
        # the CUDA simulator
        if ocode == CODE_F16:
            out[o_off + d * osd] = f32_to_f16(x)
        elif ocode == CODE_BF16:
            out[o_off + d * osd] = f32_to_bf16(x)
        elif ocode == CODE_I8:
            out[o_off + d * osd] = _quantized(x, outcome, quant[0], quant[1], n * D + d)
        else:
            out[o_off + d * osd] = x


@array_function
def _finish_row_int8(out, lse, acc, v, v_base, strides, boff, params, fparams, quant, state,
                     band, b, n, nan_row):
    """The int8 kernel's end of query row band[0] of head n in batch b (as
    :func:`_finish_row`; v_base: where the kv head's V rows start; ``nan_row``: a weight of the
    row quantized to NaN)."""
    D, ocode = params[P_D], params[P_OCODE]
    qs1, deq2 = fparams[F_QS1], fparams[F_DEQ2]
    outcome, mlo, mhi, denom, o_off, osd = _row_end(lse, state, band, strides, boff, b, n)
    if outcome == ROW_MEAN:
        # contract 'Empty rows' for int8: every band score equal (E = 1 on the band)
        p8f = int8_weight(F32_ONE, qs1)
        nan_row = p8f != p8f                      # quant_scale1 NaN: a NaN row
        p8 = int64(0) if nan_row else int64(p8f)
        for d in range(D):
            acc[d] = 0
        for j in range(mlo, mhi + 1):
            off = v_base + j * strides[T_V, 1]
            for d in range(D):
                acc[d] += p8 * int64(v[off + d * strides[T_V, 2]])
    if nan_row:
        denom = F32_NAN                           # int8_out_f16's NaN-row flag
    for d in range(D):
        # deq2 * acc / denom rounded once to float16 (exact), the CPU's procedure; rows with
        # nothing written are +0 (contract 'Empty rows')
        h = int8_out_f16(acc[d], deq2, denom) if outcome != ROW_ZERO else uint16(0)
        if ocode == CODE_I8:       # quantized from the stored float16, as on the CPU
            out[o_off + d * osd] = _quantized(f16_to_f32(h), outcome, quant[0], quant[1],
                                              n * D + d)
        else:
            out[o_off + d * osd] = h


@array_function
def _user_rows(strides, boff, b, n, i):
    """(mask row offset, pse row offset) of query row i of head n in batch b."""
    return (boff[T_M, b] + i * strides[T_M, 1],
            boff[T_P, b] + n * strides[T_P, 0] + i * strides[T_P, 1])


@array_function
def _start_row(qv, acc, q, strides, boff, row, D, code, factors):
    """qv = query row row = (b, n, i) widened from ``code`` times both factors (in turn, as
    the CPU scales), acc = 0."""
    b, n, i = row
    q_off = boff[T_Q, b] + n * strides[T_Q, 0] + i * strides[T_Q, 1]
    for d in range(D):
        qv[d] = widen(q[q_off + d * strides[T_Q, 2]], code) * factors[0] * factors[1]
        acc[d] = 0


@array_function
def _quantized(x, outcome, scale2, offset2, ch):
    """numerics.core.quantize_output of output element x of channel ch (channel 0 where one
    scale serves all); 0 in a row of structural zeros."""
    c = ch if scale2.shape[0] > 1 else 0
    return quantize_output(x, scale2[c], offset2[c]) if outcome != ROW_ZERO else F32_ZERO


@array_function
def _place_rows(places, tokens, strides, boff, table, params, kts, kto, vts, vto, b, g, j0,
                c):
    """Stage where kv row j0 + c of the tile lies (:func:`_kv_source`), for K (r = 0) and V
    (r = 1): places[3r] whether in the prefix, [3r + 1] offset, [3r + 2] element stride;
    tokens[2r], [2r + 1] its token scale and offset."""
    for r in range(2):
        in_prefix, off, sd, scale, offset = kv_row(strides, boff, table, params, r, kts, kto,
                                                   vts, vto, b, g, j0 + c)
        places[3 * r, c] = 1 if in_prefix else 0
        places[3 * r + 1, c] = off
        places[3 * r + 2, c] = sd
        tokens[2 * r, c] = scale
        tokens[2 * r + 1, c] = offset


@array_function
def kv_row(strides, boff, table, params, r, kts, kto, vts, vto, b, g, j):
    """:func:`_kv_source` of kv row j of kv head g of batch b in K (r = 0) or V (r = 1), with
    that tensor's token planes."""
    t, tp, tt = (T_K, T_PK, T_KT) if r == 0 else (T_V, T_PV, T_VT)
    mode, ts, to = (params[P_KTOK], kts, kto) if r == 0 else (params[P_VTOK], vts, vto)
    return _kv_source(strides, boff, table, params, t, tp, tt, mode, ts, to, b, g, j)


@array_function
def kv_value(own, prefix, table, strides, boff, params, channel, kts, kto, vts, vto, r, b, g,
             j, col):
    """Element ``col`` of kv row j of kv head g of batch b in K (r = 0) or V (r = 1) as
    float32, through the kv sequence and int8 dequantized (:func:`_kv_element`): what the
    tensor-core kernels' rows of contract 'Empty rows' average."""
    in_prefix, off, sd, scale, offset = kv_row(strides, boff, table, params, r, kts, kto, vts,
                                               vto, b, g, j)
    return _kv_element(own, prefix, in_prefix, off + col * sd, params[P_KVCODE],
                       params[P_DEQUANT] != 0, channel, r, g * params[P_D] + col, scale, offset)


@array_function
def _kv_element(own, prefix, in_prefix, x, code, dequant, channel, r, ch, scale, offset):
    """Element x of a K (r = 0) or V (r = 1) row as float32: widened from ``own`` or the
    prefix's array, int8 dequantized with channel ``ch`` and the row's token pair."""
    value = widen(prefix[x] if in_prefix else own[x], code)
    if dequant:
        value = antiquant(value, channel[2 * r, ch], channel[2 * r + 1, ch], scale, offset)
    return value


def kernel_source(dpad, bq, bkv):
    """The float kernel's Python source for the given compile-time sizes (before cuda.jit).

    Arguments: q, k, v (flat storage), out, lse, mask8, mask16, pse, strides, boff, lens,
    params, qtiles, fparams, scale2, offset2, guard, guard_id, kp, vp, table, channel, kts,
    kto, vts, vto (see numerics.kernel_args.KernelArgs; scale2 and offset2 are read only when the
    output code is CODE_I8; a guard_id other than 0 runs the call only where guard[0] holds it:
    :func:`runs_here`).
    K/V rows come through the kv sequence (:func:`_kv_source`): a shared prefix, contiguous or
    paged own rows, int8 ones dequantized as they load."""
    DP, BQ, BKV = dpad, bq, bkv

    def attention(q, k, v, out, lse, mask8, mask16, pse, strides, boff, lens, params, qtiles,
                  fparams, scale2, offset2, guard, guard_id, kp, vp, table, channel, kts, kto,
                  vts, vto):
        ks = cuda.shared.array((BKV, DP), float32)
        vs = cuda.shared.array((BKV, DP), float32)
        places = cuda.shared.array((6, BKV), int64)
        tokens = cuda.shared.array((4, BKV), float32)
        qv = cuda.local.array(DP, float32)
        acc = cuda.local.array(DP, float32)
        sc = cuda.local.array(BKV, float32)
        tid, b, i0, n, i, g = _thread_place(params, qtiles, BQ)
        D, code = params[P_D], params[P_CODE]
        mask_kind, has_pse = params[P_MASK], params[P_PSE] != 0
        inner_precise, want_lse = params[P_IP], params[P_LSE] != 0
        scale = fparams[F_SCALE]
        scale2_q = fparams[F_SCALE2]     # 1, or the second factor of a scale below float32's
        post_e = params[P_SCALE_EXP]     # 0, or the exponent of a scale beyond float32's range
        added_f = times_pow2(F32_ONE, -post_e)          # pse and the fp16 mask at that scale
        mask_scale = F16_MASK_SCALE * added_f
        cap = fparams[F_SOFTCAP] * added_f              # the softcap at that scale (0: none)
        kl, pre_e, next_e, rows_b, active, jstart, jend, ntiles, lo, hi = _block_rows(
            lens, b, i0, i, BQ, BKV, runs_here(guard, guard_id))
        kv_code, dequant = params[P_KVCODE], params[P_DEQUANT] != 0
        m, l = F32_NEG_INF, F32_ZERO                 # the row's running max and sum
        if active:
            _start_row(qv, acc, q, strides, boff, (b, n, i), D, code, (scale, scale2_q))
        for t in range(ntiles):
            j0, nc = _tile(t, jstart, jend, BKV)
            for c in range(tid, nc, BQ):
                _place_rows(places, tokens, strides, boff, table, params, kts, kto, vts, vto, b,
                            g, j0, c)
            cuda.syncthreads()   # the tile's row places are staged before its loads use them
            for e in range(tid, nc * D, BQ):
                c = e // D       # consecutive threads read consecutive elements of a row
                d = e - c * D
                ks[c, d] = _kv_element(k, kp, places[0, c] != 0, places[1, c] + d * places[2, c],
                                       kv_code, dequant, channel, 0, g * D + d, tokens[0, c],
                                       tokens[1, c])
                vs[c, d] = _kv_element(v, vp, places[3, c] != 0, places[4, c] + d * places[5, c],
                                       kv_code, dequant, channel, 1, g * D + d, tokens[2, c],
                                       tokens[3, c])
            cuda.syncthreads()   # the whole K/V tile is in shared memory before anyone reads it
            if active:
                # step 1: scores of this row against the tile (dropped columns at -inf)
                tmax = F32_NEG_INF
                m_off, p_off = _user_rows(strides, boff, b, n, i)
                for c in range(nc):
                    j = j0 + c
                    s = F32_NEG_INF
                    if j >= lo and j <= hi:
                        s = F32_ZERO
                        for d in range(D):
                            s += qv[d] * ks[c, d]
                        if cap != F32_ZERO:
                            s = softcapped(s, cap)
                        if has_pse:
                            s += widen(pse[p_off + j * strides[T_P, 2]], code) * added_f
                        if mask_kind == MASK_ADD_F16:
                            s += mask_scale * f16_to_f32(mask16[m_off + j * strides[T_M, 2]])
                        elif mask_kind == MASK_DISCARD:
                            if mask8[m_off + j * strides[T_M, 2]] != 0:
                                s = F32_NEG_INF
                    sc[c] = s
                    tmax = max_nan(tmax, s)
                # step 2: update m and l; step 3: rescale acc, add P V
                m_new, a = online_update(m, tmax, post_e)
                if m_new != F32_NEG_INF:
                    if a != F32_ONE:
                        for d in range(D):
                            acc[d] = acc[d] * a
                    tile_sum = F32_ZERO
                    for c in range(nc):
                        p = softmax_weight(sc[c], m_new, post_e)
                        if p != F32_ZERO:            # a dropped column adds nothing, not 0 * inf
                            tile_sum += p
                            for d in range(D):
                                acc[d] += p * vs[c, d]
                    l = running_sum(l, a, tile_sum)
                    m = m_new
            cuda.syncthreads()   # every row is done with this tile before it is overwritten

        if i < rows_b:     # every output row of the block is written (it is not pre-zeroed)
            _finish_row(out, lse, acc, v, vp, table, strides, boff, params,
                        (channel, kts, kto, vts, vto), (scale2, offset2),
                        (active, m, l, inner_precise, want_lse, post_e,
                         head_sink(fparams, n)),
                        (i, pre_e, next_e, kl), b, n, g)

    return attention


def kernel_source_int8(dpad, bq, bkv):
    """The int8 kernel (contract 'Quantization') for the given compile-time sizes: pass 1 over the K
    tiles finds each row's max fp16 score, pass 2 quantizes E = exp(s - m) to P8 and accumulates P8
    . V in int64 (exact); fparams holds the int8 scales (F_DEQ1 ... F_DEQ2).
    Output: float16 bits (CODE_F16) or int8 (CODE_I8, quantized in the finalize)."""
    DP, BQ, BKV = dpad, bq, bkv

    def attention_int8(q, k, v, out, lse, mask8, mask16, pse, strides, boff, lens, params,
                       qtiles, fparams, scale2, offset2, guard, guard_id):
        ks = cuda.shared.array((BKV, DP), float32)
        vs = cuda.shared.array((BKV, DP), float32)
        qv = cuda.local.array(DP, float32)
        acc = cuda.local.array(DP, int64)
        tid, b, i0, n, i, g = _thread_place(params, qtiles, BQ)
        D, inner_precise = params[P_D], params[P_IP]
        mask_kind, has_pse, want_lse = params[P_MASK], params[P_PSE] != 0, params[P_LSE] != 0
        deq1, scale16 = fparams[F_DEQ1], fparams[F_SCALE16]
        qs1 = fparams[F_QS1]
        kl, pre_e, next_e, rows_b, active, jstart, jend, ntiles, lo, hi = _block_rows(
            lens, b, i0, i, BQ, BKV, runs_here(guard, guard_id))
        k_base, v_base = boff[T_K, b] + g * strides[T_K, 0], boff[T_V, b] + g * strides[T_V, 0]
        m, l = F32_NEG_INF, F32_ZERO                 # the row's running max and sum
        nan_row = False
        if active:
            _start_row(qv, acc, q, strides, boff, (b, n, i), D, CODE_F32, (F32_ONE, F32_ONE))
        for step in range(2):
            for t in range(ntiles):
                j0, nc = _tile(t, jstart, jend, BKV)
                for e in range(tid, nc * D, BQ):
                    c, d, xv = _tile_element(e, D, v_base + j0 * strides[T_V, 1], strides[T_V, 1],
                                             strides[T_V, 2])
                    ks[c, d] = float32(k[k_base + (j0 + c) * strides[T_K, 1] + d * strides[T_K, 2]])
                    if step == 1:
                        vs[c, d] = float32(v[xv])
                cuda.syncthreads()   # the tile is in shared memory before anyone reads it
                if active:
                    m_off, p_off = _user_rows(strides, boff, b, n, i)
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
                        s = int8_score(a, deq1, scale16)
                        if has_pse:
                            s = int8_score_pse(s, pse[p_off + j * strides[T_P, 2]])
                        if step == 0:
                            m = max_nan(m, s)
                        elif m != F32_NEG_INF and s != F32_NEG_INF:
                            p = softmax_weight(s, m, 0)
                            l += p
                            p8 = int8_weight(p, qs1)
                            if p8 != p8:
                                nan_row = True
                            elif p8 != F32_ZERO:
                                w = int64(p8)
                                for d in range(D):
                                    acc[d] += w * int64(vs[c, d])
                cuda.syncthreads()   # every row is done with this tile before it is overwritten

        if i < rows_b:
            _finish_row_int8(out, lse, acc, v, v_base, strides, boff, params, fparams,
                             (scale2, offset2),
                             (active, m, l, inner_precise, want_lse, 0, F32_NEG_INF),
                             (i, pre_e, next_e, kl), b, n, nan_row)

    return attention_int8


def launch_config(p):
    """(dpad, rows per block, kv columns per tile) for problem ``p``."""
    dpad = _pad_dim(p.D)
    bq = int(config.CUDA_Q_ROWS)
    bkv = max(1, min(int(config.CUDA_KV_COLS), int(config.CUDA_TILE_ELEMS) // dpad))
    return dpad, bq, bkv
