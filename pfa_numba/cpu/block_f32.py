"""The float32 work item: tile products on the AVX-512 register blocks of ``_gemm`` or on BLAS,
the softmax of ``rows``, the deferred division and contract 'Empty rows' in the finish."""
import numpy as np
from numba import njit, prange
from ..numerics.band import ROW_MEAN, ROW_SOFTMAX
from ..numerics.core import (CODE_BF16, CODE_F32, F32_NEG_INF, F32_ONE, F32_ZERO,
                             antiquant, order_key, row_total, sink_of, store, widen)
from ..numerics.kernel_args import (F_SCALE, F_SCALE2, P_CODE, P_COLS, P_D, P_DEQUANT, P_FLAGS, P_G,
                                    P_KVCODE, P_LSE, P_OCODE, P_ROWS, P_SCALE_EXP)
from ._blas import gemm_rm, scratch
from ._gemm import MR, PANEL, accumulate, padded_rows, panels, scores, vector_width
from ._jit import FASTMATH, LEAF, LEAF_INLINE
from ._vector import aligned_empty, take_next, wide_vectors
from .items import W_B, W_G, W_I0, W_JHI, W_JLO, W_SLOT, item_rows, sizes
from .kv import (KEY, VALUE, kv_key_rows, kv_tile_end, kv_tile_rows, kv_value_row,
                 load_dequant_row)
from ._simd import PF_ROWS
from .rows import (all_finite, has_user_terms, load_query_rows, load_row, pack_kt, prefetch_row,
                   row_end, scale_row, store_row)
from .records import F32Buffers, F32Products, RowState, RunBuffers, StreamProducts
from .tile import products, tile_step, walk_tiles
from .split_kv import G_B, G_G, G_I0, G_PIECES, G_SLOT, keep_piece, merge_rows
from .stream import fold_query, fold_weights, stream_pv, stream_scores, unfold_scores, unfold_values


@njit(fastmath=FASTMATH, cache=True)
def f32_widths(params, gemm):
    """(acc / V row length, rows to allocate per item, columns per kv tile to allocate) of the
    float32 kernel for ``params``: the register-blocked products (``gemm`` nonzero) read and
    write up to MR - 1 rows past a segment's last, 16-lane acc / V rows and whole K^T panels;
    BLAS touches exactly the data."""
    D = params[P_D]
    rows = params[P_G] * params[P_ROWS]
    tk = params[P_COLS]
    if gemm != 0:
        return vector_width(D), rows + MR, panels(tk) * PANEL
    return D, rows, tk


@njit(fastmath=FASTMATH, cache=True)
def block(ins, extras, geo, tuning, scales, item, span, bufs, state, blas):
    """One work item in float32: rows of positions [i0, i1) of the G query heads of kv head g
    in batch b (item = (b, g, i0), see :func:`.items.item_rows`), over the kv columns of its
    band inside span = [lo, hi) (a piece of a split item; (0, BAND_INF): all), through the
    tile loop of :mod:`.tile` with the products of the register-blocked kernels of _gemm
    (tuning.gemm) or of BLAS. Leaves the rows' unnormalised sums in acc and their (m, l) in
    state for :func:`finish` or split_kv.keep_piece; returns (i1, whether any kv column was
    visited).

    ins (:class:`.records.Inputs`, the kv cache's arrays as :mod:`.kv` walks them), extras,
    geo and tuning: the kernel arguments; bufs (:class:`.records.F32Buffers`, see
    :func:`f32_buffers`) and state (:class:`.records.RowState`): the thread's buffers."""
    params = geo.params
    i1, R, jstart, jend = item_rows(params, geo.lens, item[0], item[2])
    jstart, jend = max(jstart, span[0]), min(jend, span[1])
    if jstart < jend:
        start_rows(ins.q, geo, scales, item, R, bufs.qb, bufs.acc, state)
        own = tuning.gemm != 0
        ld = f32_widths(params, tuning.gemm)[0]          # row length of acc and of the V tile
        kernel = F32Products(bufs, blas, own, has_user_terms(params, extras),
                             np.empty((1, 2, 1), np.uint16), params[P_D], ld, params[P_KVCODE],
                             params[P_DEQUANT] != 0)
        walk_tiles(kernel, ins, item, (i1, R, jstart, jend), PANEL if own else 1, extras, geo,
                   tuning, state, bufs.acc, ld, (bufs.ro, bufs.rs))
    return i1, jstart < jend


@njit(**LEAF)
def _f32_tile(kernel, ins, item, cols, prefix, sdk, sdv):
    """The float32 kernel's load_tile (:mod:`.tile`): K as K^T panels (register blocks) or
    rows (BLAS), V as rows of ld values, both dequantized where int8; the tile: whether every
    V value is finite."""
    bufs, own, D, ld, code, dequant = (kernel.bufs, kernel.own, kernel.D, kernel.ld,
                                       kernel.code, kernel.dequant)
    channel = ins.channel
    ks_ch, ko_ch, vs_ch, vo_ch = channel[KEY], channel[KEY + 1], channel[VALUE], channel[VALUE + 1]
    g = item[1]
    nc = cols[1]
    ro, rs, kb, vb = bufs.ro, bufs.rs, bufs.kb, bufs.vb
    ks = ins.kp if prefix else ins.k
    vs = ins.vp if prefix else ins.v
    v2 = vb[:nc * ld].reshape(nc, ld)
    k2 = kb[:nc * D].reshape(nc, D)
    if own:
        pack_kt(kb, ks, ro[0], sdk, nc, D, code, bufs.tb, (dequant, ks_ch, ko_ch, g * D, rs))
    for c in range(nc):
        if not own and dequant:
            load_dequant_row(k2, c, ks, ro[0, c], sdk, D, ks_ch, ko_ch, g * D, rs[KEY, c],
                             rs[KEY + 1, c])
        elif not own:
            load_row(k2, c, ks, ro[0, c], sdk, D, code, F32_ONE)
        if c + PF_ROWS < nc:
            prefetch_row(vs, ro[1, c + PF_ROWS], D * sdv)
        if dequant:
            load_dequant_row(v2, c, vs, ro[1, c], sdv, D, vs_ch, vo_ch, g * D, rs[VALUE, c],
                             rs[VALUE + 1, c])
        else:
            load_row(v2, c, vs, ro[1, c], sdv, D, code, F32_ONE)
        v2[c, D:] = F32_ZERO
    return True, all_finite(vb, nc * ld)


@njit(**LEAF)
def _f32_scores(kernel, v_finite, seg):
    """The float32 kernel's scores (:mod:`.tile`): S = Q K^T on the register blocks, which
    also take the row maxima where no column past ns and no mask or band touches them, or on
    BLAS."""
    bufs, D = kernel.bufs, kernel.D
    qb, kb, sb, kx = bufs.qb, bufs.kb, bufs.sb, bufs.kx
    r0, r1, c0, ns, inside = seg
    nrow = r1 - r0
    keys = kx[:0]
    if kernel.own:
        lds = panels(ns) * PANEL
        if inside and not kernel.any_user and ns == lds:
            keys = kx[:padded_rows(nrow)]
            keys[:] = order_key(F32_NEG_INF)
            scores(qb, r0 * D, D, kb, c0 * D, D, sb, lds, nrow, panels(ns), keys)
        else:
            scores(qb, r0 * D, D, kb, c0 * D, D, sb, lds, nrow, panels(ns), None)
    else:
        lds = ns
        gemm_rm(kernel.blas, nrow, ns, D, qb, r0 * D, D, True, kb, c0 * D, D, sb, 0, ns,
                F32_ZERO)
    return sb[:nrow * lds].reshape(nrow, lds), kernel.no_p3, keys, False, False, F32_ONE


@njit(**LEAF)
def _f32_weighted_sum(kernel, v_finite, seg, s2, acc, ld, state):
    """The float32 kernel's weighted_sum (:mod:`.tile`): acc += P V on the register blocks or
    BLAS, or column by column where V holds inf or NaN."""
    sb, vb = kernel.bufs.sb, kernel.bufs.vb
    r0, r1, c0, ns, _ = seg
    nrow, lds = r1 - r0, s2.shape[1]
    vo = c0 * ld
    if not v_finite:
        add_pv_exact(acc, ld, nrow, kernel.D, sb, lds, ns, vb[vo:], ld, 1)
    elif kernel.own:
        # the register blocks also add the padding rows' P (zero) to the rows below the
        # segment: + 0 changes nothing
        sb[nrow * lds:padded_rows(nrow) * lds] = F32_ZERO
        accumulate(sb, lds, vb, vo, ld, acc, 0, ld, nrow, ns)
    else:
        gemm_rm(kernel.blas, nrow, kernel.D, ns, sb, 0, lds, False, vb, vo, ld, acc, 0, ld,
                F32_ONE)


@njit(fastmath=FASTMATH, cache=True)
def block_stream(ins, extras, geo, tuning, scales, run, span, heads, bufs):
    """:func:`block` for the items of a run (run = (b, g0, i0, nh): kv heads g0 .. g0 + nh - 1
    of one block, see items.kv_head_runs) of at most tuning.stream rows each (decode): each
    kv tile is taken for every head in turn, its products reading each K and V row once,
    straight from the cache (see :mod:`.stream`), instead of packing tiles that few rows would
    then read. int8 rows are read as integers, their dequantization folded into the query
    rows, the scores, the weights and the final sums (see :func:`.stream.fold_query`). Each
    head's rows, sums and state are its part of ``heads`` (:func:`_head`); returns (i1,
    whether any kv column was visited)."""
    q, channel = ins.q, ins.channel
    lens, params = geo.lens, geo.params
    b, g0, i0, nh = run
    D = params[P_D]
    ldv = f32_widths(params, tuning.gemm)[0]
    dequant = params[P_DEQUANT] != 0
    i1, R, jstart, jend = item_rows(params, lens, b, i0)
    jstart, jend = max(jstart, span[0]), min(jend, span[1])
    if jstart >= jend:
        return i1, False
    for hh in range(nh):
        q2, acc, state, fold = head(heads, hh, R, D, ldv)
        start_rows(q, geo, scales, (b, g0 + hh, i0), R, q2.reshape(-1), acc, state)
        if dequant:
            fold_query(q2, R, channel[KEY], channel[KEY + 1], (g0 + hh) * D, fold)
    no_p3 = np.empty((1, 2, 1), np.uint16)        # the in-place softmax writes no bf16 parts
    j1 = jstart
    while j1 < jend:
        j0 = j1
        j1 = kv_tile_end(params, j0, params[P_COLS], jend)
        j2 = kv_tile_end(params, j1, params[P_COLS], jend)
        for hh in range(nh):
            # the tile read next: the next head's of this kv span, or the first head's next
            then = (g0 + hh + 1, j0, j1) if hh + 1 < nh else (g0, j1, j2)
            _stream_tile(ins, extras, geo, tuning, (b, g0 + hh, i0), (i1, R, j0, j1), heads, hh,
                         bufs, no_p3, then)
    if dequant:
        for hh in range(nh):
            _, acc, _, fold = head(heads, hh, R, D, ldv)
            unfold_values(acc, ldv, R, D, channel[VALUE], channel[VALUE + 1], (g0 + hh) * D,
                          fold)
    return i1, True


@njit(**LEAF_INLINE)
def head(heads, hh, R, D, ldv):
    """Head hh's part of a run's buffers (:class:`.records.RunBuffers`) for items of R rows:
    (query rows (R, D), sums (R rows of ldv), its RowState, int8 sums (4, R))."""
    q, acc, m, l, alpha, fold = heads
    r = hh * R
    return (q[r * D:(r + R) * D].reshape(R, D), acc[r * ldv:(r + R) * ldv],
            RowState(m[r:r + R], l[r:r + R], alpha[r:r + R]), fold[:, r:r + R])


@njit(**LEAF)
def _stream_tile(ins, extras, geo, tuning, item, tile, heads, hh, bufs, no_p3, then):
    """Kv tile tile = (i1, R, j0, j1) of streaming item ``item`` (b, g, i0), head hh of the
    run's buffers: scores, softmax, P V (no_p3: the bf16 parts the in-place softmax does not
    write). Rows whose elements are not contiguous are widened to float32 rows first (in the
    K and V tile buffers), so that the products take every cache through the same vector code,
    in the same order of operations: a strided view gives the bits of its contiguous copy. The
    K rows of the tile read next, then = (kv head, j0, j1), are prefetched during P V where
    tuning.next_keys asks, unless they are one run of rows (which the hardware prefetcher
    follows by itself).
    Without reference counting: it runs once a tile and head."""
    k, v, kp, vp = ins.k, ins.v, ins.kp, ins.vp
    params = geo.params
    b, g, i0 = item
    _, _, j0, j1 = tile
    kb, vb, ro = bufs.kb, bufs.vb, bufs.ro
    D, kvcode = params[P_D], params[P_KVCODE]
    prefix, sdk, sdv = kv_tile_rows(ins, geo, b, g, j0, j1 - j0, ro, bufs.rs)
    n_next = then[2] - then[1] if sdk == 1 and tuning.next_keys != 0 else 0
    next_prefix = kv_key_rows(ins, geo, b, then[0], then[1], n_next, ro[3])
    if n_next and ro[3, n_next - 1] - ro[3, 0] == (n_next - 1) * D:
        n_next = 0              # one run of rows: the hardware prefetcher follows it
    next_keys = (kp if next_prefix else k, ro[3], n_next)
    if sdk == 1 and sdv == 1:
        _stream_segments(extras, geo, tuning, item, tile, heads, hh, bufs, no_p3,
                         (kp if prefix else k, ro[0], kvcode),
                         (vp if prefix else v, ro[1], kvcode), next_keys)
        return
    nc = j1 - j0
    _widen_rows(kb, kp if prefix else k, ro[0], nc, sdk, D, kvcode)
    _widen_rows(vb, vp if prefix else v, ro[1], nc, sdv, D, kvcode)
    _stream_segments(extras, geo, tuning, item, tile, heads, hh, bufs, no_p3,
                     (kb, ro[0], CODE_F32), (vb, ro[1], CODE_F32), next_keys)


@njit(**LEAF)
def _widen_rows(dst, src, offs, nc, sd, D, code):
    """dst[c * D:][:D] = kv row c of a tile (element offsets offs, element stride sd) as
    float32 (exact), and offs[c] = c * D, c < nc."""
    rows = dst[:nc * D].reshape(nc, D)
    for c in range(nc):
        load_row(rows, c, src, offs[c], sd, D, code, F32_ONE)
        offs[c] = c * D


@njit(**LEAF)
def _stream_segments(extras, geo, tuning, item, tile, heads, hh, bufs, no_p3, keys, values,
                     next_keys):
    """The tile step (:mod:`.tile`) of :func:`_stream_tile`'s tile with the streaming
    products: keys, values = (rows' array, element offsets, storage code) of contiguous
    rows."""
    params = geo.params
    D = params[P_D]
    ldv = f32_widths(params, tuning.gemm)[0]
    q2, acc, state, fold = head(heads, hh, tile[1], D, ldv)
    kernel = StreamProducts(q2, keys, values, next_keys, bufs.sb, bufs.rs, fold,
                            bufs.tb[:D].reshape(1, D), params[P_DEQUANT] != 0, no_p3,
                            bufs.kx[:0])
    tile_step(kernel, None, item, tile, 1, extras, geo, tuning, state, acc, ldv)


@njit(**LEAF)
def _stream_scores(kernel, tile, seg):
    """The streaming scores (:mod:`.tile`): each K row read once for every row of the segment
    (:func:`.stream.stream_scores`), int8 products unfolded to the dequantized rows' scores."""
    r0, r1, c0, ns, _ = seg
    nrow = r1 - r0
    sb = kernel.sb
    stream_scores(sb, ns, kernel.q2, r0, nrow, kernel.k_rows, c0, ns, kernel.v_rows)
    if kernel.dequant:
        unfold_scores(sb, ns, nrow, r0, kernel.rs, c0, ns, kernel.fold)
    return sb[:nrow * ns].reshape(nrow, ns), kernel.no_p3, kernel.no_keys, False, False, F32_ONE


@njit(**LEAF)
def _stream_weighted_sum(kernel, tile, seg, s2, acc, ld, state):
    """The streaming weighted sum (:mod:`.tile`): each V row read once for every row of the
    segment (:func:`.stream.stream_pv`; kernel.buf: a V row taken on its own), int8 weights
    folded first; the first segment prefetches the K rows read next."""
    r0, r1, c0, ns, _ = seg
    sb, next_keys = kernel.sb, kernel.next_keys
    if kernel.dequant:
        fold_weights(sb, ns, r1 - r0, r0, kernel.rs, c0, ns, state.alpha, kernel.fold)
    stream_pv(acc, ld, r1 - r0, sb, ns, kernel.v_rows, c0, ns, kernel.buf,
              next_keys if r0 == 0 else (next_keys[0], next_keys[1], 0))


products(F32Products, _f32_tile, _f32_scores, _f32_weighted_sum)
products(StreamProducts, None, _stream_scores, _stream_weighted_sum)


@njit(fastmath=FASTMATH, cache=True)
def start_rows(q, geo, scales, item, R, qb, acc, state):
    """Load the item's R query rows into qb (scaled), and zero its sums and running state."""
    D = geo.params[P_D]
    q2 = qb[:R * D].reshape(R, D)
    load_query_rows(q2, q, geo, item, geo.params[P_CODE], scales[F_SCALE])
    if scales[F_SCALE2] != F32_ONE:      # a scale_value below float32's range
        for rr in range(R):
            scale_row(q2, rr, D, scales[F_SCALE2])
    state.m[:R] = F32_NEG_INF
    state.l[:R] = F32_ZERO
    acc[:] = F32_ZERO


@njit(**LEAF)
def add_pv_exact(acc, ld, R, D, p, ldp, nc, vb, ldv, pair):
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


@njit(**LEAF)
def finish(outs, ins, extras, geo, item, i1, acc, ld, state, tb, computed):
    """Deferred division, rounding to the output storage and softmax_lse of one work item
    (acc row rr at acc[rr * ld:]); the query heads' sink logits (extras.sinks) join the
    denominators; rows with nothing kept follow contract 'Empty rows'."""
    out, lse, flags = outs
    v, vp, channel = ins.v, ins.vp, ins.channel
    strides, boff, lens, params = geo
    b, g, i0 = item
    m, l, _ = state
    D, code, ocode = params[P_D], params[P_KVCODE], params[P_OCODE]
    want_lse, want_flags = params[P_LSE] != 0, params[P_FLAGS] != 0
    sinks, post_e = extras.sinks, params[P_SCALE_EXP]
    for rr in range(params[P_G] * (i1 - i0)):
        (n, o_off, osd, l_off), (outcome, lo, hi, divisor) = row_end(geo, item, rr, m, l,
                                                                     computed)
        if outcome == ROW_SOFTMAX:
            total, row_lse = row_total(m[rr], l[rr], sink_of(sinks, n), post_e)
            store_row(out, o_off, osd, acc, rr * ld, total, D, ocode)
            if want_lse:
                lse[l_off] = row_lse
            if want_flags:
                flags[l_off] = 1
        elif outcome == ROW_MEAN:
            trow = tb[:D]
            trow[:] = F32_ZERO
            for j in range(lo, hi + 1):
                prefix, off, sd, scale, offset = kv_value_row(ins, geo, b, g, j)
                vs = vp if prefix else v
                for d in range(D):
                    x = widen(vs[off + d * sd], code)
                    if params[P_DEQUANT] != 0:
                        x = antiquant(x, channel[VALUE, g * D + d],
                                      channel[VALUE + 1, g * D + d], scale, offset)
                    trow[d] += x
            for d in range(D):
                store(out, o_off + d * osd, trow[d] / divisor, ocode)
            if want_flags:
                flags[l_off] = 1


@njit(fastmath=FASTMATH, cache=True)
def f32_buffers(params, gemm, tb):
    """A thread's :class:`.records.F32Buffers` for :func:`block`, around its scratch rows
    ``tb``."""
    D = params[P_D]
    ldv, rows, tkp = f32_widths(params, gemm)
    qb = aligned_empty(rows * D, np.float32)
    qb[:] = F32_ZERO                         # rows past a work item's stay finite
    return F32Buffers(qb, aligned_empty(rows * tkp, np.float32), tb,
                      aligned_empty(rows * ldv, np.float32), aligned_empty(tkp * D, np.float32),
                      aligned_empty(tkp * ldv, np.float32), aligned_empty(rows, np.int32),
                      aligned_empty(4 * tkp, np.int64).reshape(4, tkp),
                      aligned_empty(4 * tkp, np.float32).reshape(4, tkp))


@njit(fastmath=FASTMATH, cache=True)
def no_f32_buffers(tb):
    """F32Buffers of no size (of f32_buffers' types): the AMX kernel's until a work item
    falls back to :func:`block`."""
    none = np.empty(0, np.float32)
    return F32Buffers(none, none, tb, none, none, none, np.empty(0, np.int32),
                      np.empty((4, 0), np.int64), np.empty((4, 0), np.float32))


@njit(fastmath=FASTMATH, cache=True)
def row_state(rows):
    """A :class:`.records.RowState` of ``rows`` rows."""
    return RowState(np.empty(rows, np.float32), np.empty(rows, np.float32),
                    np.empty(rows, np.float32))


@njit(fastmath=FASTMATH, cache=True)
def thread_state(rows, tuning):
    """A thread's RowState of ``rows`` rows and its BLAS scratch."""
    return row_state(rows), scratch(tuning.blas)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def attention(ins, outs, extras, geo, tuning, work, scales, parts, runs):
    """Run every work item. Each of the threads takes the next run of items
    (items.kv_head_runs) not yet taken whenever it is free (runs are sorted by cost, most
    expensive first), so a thread that runs slower, on a core shared with other work, takes
    fewer runs instead of holding the call up. Pieces of split items (see split_kv) leave their
    state in ``parts`` for :func:`merge_split`."""
    params = geo.params
    D, rows, tk, nthr, _ = sizes(params, tuning, work)
    ldv = f32_widths(params, tuning.gemm)[0]
    n_runs = runs.shape[0] - 1
    taken = np.zeros(1, np.int64)
    for t in prange(nthr):
        tb = aligned_empty(16 * D, np.float32)   # pack_kt's 16 rows, finish's one
        bufs = f32_buffers(params, tuning.gemm, tb)
        heads = _run_buffers(params, tuning, runs)
        state, blas = thread_state(rows, tuning)
        x = take_next(taken)
        while x < n_runs:
            w, nh = runs[x], runs[x + 1] - runs[x]
            b, g, i0 = work[w, W_B], work[w, W_G], work[w, W_I0]
            span = (work[w, W_JLO], work[w, W_JHI])
            R = item_rows(params, geo.lens, b, i0)[1]
            if R <= tuning.stream:
                i1, computed = block_stream(ins, extras, geo, tuning, scales, (b, g, i0, nh),
                                            span, heads, bufs)
                for hh in range(nh):
                    _, hacc, hstate, _ = head(heads, hh, R, D, ldv)
                    _done(outs, ins, extras, geo, parts, work[w + hh], i1, hacc, ldv, hstate, tb,
                          computed)
            else:
                for y in range(w, w + nh):        # items of many rows: one after another
                    row = work[y]
                    i1, computed = block(ins, extras, geo, tuning, scales, (b, row[W_G], i0),
                                         (row[W_JLO], row[W_JHI]), bufs, state, blas)
                    _done(outs, ins, extras, geo, parts, row, i1, bufs.acc, ldv, state, tb,
                          computed)
            x = take_next(taken)


@njit(fastmath=FASTMATH, cache=True)
def _done(outs, ins, extras, geo, parts, row, i1, acc, ldv, state, tb, computed):
    """A computed work item (``row`` of the work array): finished, or its piece kept."""
    item = (row[W_B], row[W_G], row[W_I0])
    if row[W_SLOT] < 0:
        finish(outs, ins, extras, geo, item, i1, acc, ldv, state, tb, computed)
    else:
        keep_piece(parts, row[W_SLOT], acc, ldv, state, geo.params[P_G] * (i1 - item[2]),
                   computed)


@njit(fastmath=FASTMATH, cache=True)
def _run_buffers(params, tuning, runs):
    """A thread's :class:`.records.RunBuffers` of :func:`block_stream` for the longest run,
    each head's part of at most tuning.stream rows."""
    longest = 1
    for x in range(runs.shape[0] - 1):
        longest = max(longest, runs[x + 1] - runs[x])
    rows = longest * max(1, min(tuning.stream, params[P_G] * params[P_ROWS]))
    return RunBuffers(aligned_empty(rows * params[P_D], np.float32),
                      aligned_empty(rows * f32_widths(params, tuning.gemm)[0], np.float32),
                      np.empty(rows, np.float32), np.empty(rows, np.float32),
                      np.empty(rows, np.float32), np.empty((4, rows), np.float32))


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def merge_split(ins, outs, extras, geo, tuning, groups, parts):
    """Merge the pieces of every split item (split_kv.merge_rows) and finish its rows as
    :func:`finish` finishes a whole item."""
    params, lens = geo.params, geo.lens
    D, rows = params[P_D], params[P_G] * params[P_ROWS]
    ldv = f32_widths(params, tuning.gemm)[0]
    for w in prange(groups.shape[0]):
        b, g, i0 = groups[w, G_B], groups[w, G_G], groups[w, G_I0]
        i1, R, _, _ = item_rows(params, lens, b, i0)
        acc = aligned_empty(rows * ldv, np.float32)
        state = row_state(rows)
        merge_rows(parts, groups[w, G_SLOT], groups[w, G_PIECES], R, D, ldv, acc, state,
                   params[P_SCALE_EXP])
        finish(outs, ins, extras, geo, (b, g, i0), i1, acc, ldv, state,
               aligned_empty(D, np.float32), True)
