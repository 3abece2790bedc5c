"""The streaming kernel: work items of at most CPU_STREAM_ROWS rows (decode: the G query heads
of one position) read each K and V row once, straight from the cache (the products of
:mod:`.stream`), instead of packing tiles that few rows would then read; the items of a run
(:func:`.items.kv_head_runs`: kv heads g0 .. g0 + nh - 1 of one block) take each kv tile in
turn, so that the heads of a cache row, which lie side by side, are read together.

int8 rows are read as integers, their dequantization folded into the query rows, the scores,
the weights and the final sums (see :func:`.stream.fold_query`).
"""
from numba import njit

from ..numerics.core import F32_ONE
from ..numerics.kernel_args import P_COLS, P_D, P_DEQUANT, P_DV, P_KVCODE
from ._jit import LEAF, LEAF_INLINE
from ._vector import readonly, take_next
from .items import W_B, W_G, W_I0, W_JHI, W_JLO, item_rows
from .kv import KEY, VALUE, kv_key_rows, kv_tile_end, kv_tile_rows
from .records import RowState, RunBuffers, StreamBuffers, StreamProducts
from .stream import fold_query, fold_weights, stream_pv, stream_scores, unfold_scores, unfold_values
from .tile import done, start_rows, tile_loop


@njit(**LEAF)
def streaming(t, args):
    """The streaming kernel's worker (thread t): the runs of items it takes, each computed by
    :func:`_run` and its items finished (or kept as pieces, split-kv)."""
    ins, outs, extras, geo, tuning, items, scratch, parts = args[0]
    heads = RunBuffers(scratch.q[t], scratch.acc[t], scratch.m[t], scratch.l[t],
                       scratch.alpha[t], scratch.fold[t])
    bufs = StreamBuffers(scratch.sb[t], scratch.tb[t], scratch.kg[t], scratch.vg[t],
                         scratch.kx[t], scratch.ro[t], scratch.rs[t])
    work, runs, ld = items.work, items.runs, tuning.ld
    D = geo.params[P_D]
    x = take_next(items.taken)
    while x < runs.shape[0]:
        w, nh = runs[x, 0], runs[x, 1] - runs[x, 0]
        b, g, i0 = work[w, W_B], work[w, W_G], work[w, W_I0]
        R = item_rows(geo.params, geo.lens, b, i0)[1]
        i1, computed = _run(ins, extras, geo, tuning, (b, g, i0, nh),
                            (work[w, W_JLO], work[w, W_JHI]), heads, bufs, scratch.p3[t])
        for hh in range(nh):
            _, hacc, hstate, _ = head(heads, hh, R, D, ld)
            done(outs, ins, extras, geo, parts, work[w + hh], i1, hacc, ld, hstate, bufs.tb,
                 computed)
        x = take_next(items.taken)


@njit(**LEAF_INLINE)
def _run(ins, extras, geo, tuning, run, span, heads, bufs, no_p3):
    """The items of a run (run = (b, g0, i0, nh)) over the kv columns of their band inside
    span: each kv tile is taken for every head in turn (no_p3: the bf16 parts the in-place
    softmax does not write). Each head's rows, sums and state are its part of ``heads``
    (:func:`head`); returns (i1, whether any kv column was visited)."""
    q, channel = ins.q, ins.channel
    params = geo.params
    b, g0, i0, nh = run
    D, ld = params[P_D], tuning.ld
    dequant = params[P_DEQUANT] != 0
    i1, R, jstart, jend = item_rows(params, geo.lens, b, i0)
    jstart, jend = max(jstart, span[0]), min(jend, span[1])
    if jstart >= jend:
        return i1, False
    for hh in range(nh):
        q2, acc, state, fold = head(heads, hh, R, D, ld)
        start_rows(q, geo, (b, g0 + hh, i0), R, q2.reshape(-1), acc, state)
        if dequant:
            fold_query(q2, R, channel[KEY], channel[KEY + 1], (g0 + hh) * D, fold)
    j1 = jstart
    while j1 < jend:
        j0 = j1
        j1 = kv_tile_end(params, j0, params[P_COLS], jend)
        j2 = kv_tile_end(params, j1, params[P_COLS], jend)
        for hh in range(nh):
            # the tile read next: the next head's of this kv span, or the first head's next
            then = (g0 + hh + 1, j0, j1) if hh + 1 < nh else (g0, j1, j2)
            _tile(ins, extras, geo, tuning, (b, g0 + hh, i0), (i1, R, j0, j1), heads, hh,
                  bufs, no_p3, then)
    if dequant:
        for hh in range(nh):
            _, acc, _, fold = head(heads, hh, R, D, ld)
            Dv = params[P_DV]
            unfold_values(acc, ld, R, Dv, channel[VALUE], channel[VALUE + 1], (g0 + hh) * Dv,
                          fold)
    return i1, True


@njit(**LEAF_INLINE)
def head(heads, hh, R, D, ld):
    """Head hh's part of a run's buffers (:class:`.records.RunBuffers`) for items of R rows:
    (query rows (R, D), sums (R rows of ld), its RowState, int8 sums (4, R))."""
    q, acc, m, l, alpha, fold = heads
    r = hh * R
    return (q[r * D:(r + R) * D].reshape(R, D), acc[r * ld:(r + R) * ld],
            RowState(m[r:r + R], l[r:r + R], alpha[r:r + R]), fold[:, r:r + R])


@njit(**LEAF_INLINE)
def _tile(ins, extras, geo, tuning, item, tile, heads, hh, bufs, no_p3, then):
    """Kv tile tile = (i1, R, j0, j1) of streaming item ``item`` (b, g, i0), head hh of the
    run's buffers: scores, softmax, P V. Rows whose elements are not contiguous are gathered
    first (into kg, vg: the cache's own storage), so that the products take every cache
    through the same vector code, in the same order of operations (a strided view gives the
    bits of its contiguous copy), one specialisation a storage. The K rows of the tile read
    next, then = (kv head, j0, j1), are prefetched during P V where tuning.next_keys asks,
    unless they are one run of rows (which the hardware prefetcher follows by itself)."""
    k, v, kp, vp = ins.k, ins.v, ins.kp, ins.vp
    params = geo.params
    b, g, i0 = item
    _, _, j0, j1 = tile
    kg, vg, ro = bufs.kg, bufs.vg, bufs.ro
    D, kvcode = params[P_D], params[P_KVCODE]
    prefix, sdk, sdv = kv_tile_rows(ins, geo, b, g, j0, j1 - j0, ro, bufs.rs)
    n_next = then[2] - then[1] if sdk == 1 and tuning.next_keys != 0 else 0
    next_prefix = kv_key_rows(ins, geo, b, then[0], then[1], n_next, ro[3])
    if n_next and ro[3, n_next - 1] - ro[3, 0] == (n_next - 1) * D:
        n_next = 0              # one run of rows: the hardware prefetcher follows it
    next_keys = (kp if next_prefix else k, ro[3], n_next)
    keys, values = (kp, vp) if prefix else (k, v)
    if sdk != 1 or sdv != 1:
        _gather_rows(kg, keys, ro[0], j1 - j0, sdk, D)
        _gather_rows(vg, values, ro[1], j1 - j0, sdv, params[P_DV])
        keys, values = readonly(kg), readonly(vg)
    _segments(extras, geo, tuning, item, tile, heads, hh, bufs, no_p3, (keys, ro[0], kvcode),
              (values, ro[1], kvcode), next_keys)


@njit(**LEAF_INLINE)
def _gather_rows(dst, src, offs, nc, sd, D):
    """dst[c * D:][:D] = kv row c of a tile (element offsets offs, element stride sd), and
    offs[c] = c * D, c < nc: strided rows made contiguous, in their own storage."""
    for c in range(nc):
        base = offs[c]
        for d in range(D):
            dst[c * D + d] = src[base + d * sd]
        offs[c] = c * D


@njit(**LEAF_INLINE)
def _segments(extras, geo, tuning, item, tile, heads, hh, bufs, no_p3, keys, values,
              next_keys):
    """The tile step (:mod:`.tile`) of :func:`_tile`'s tile with the streaming products: keys,
    values = (rows' array, element offsets, storage code) of contiguous rows."""
    params = geo.params
    D, Dv, ld = params[P_D], params[P_DV], tuning.ld
    q2, acc, state, fold = head(heads, hh, tile[1], D, ld)
    kernel = StreamProducts(q2, keys, values, next_keys, bufs.sb, bufs.rs, fold,
                            bufs.tb[:Dv].reshape(1, Dv), params[P_DEQUANT] != 0, no_p3,
                            bufs.kx[:0])
    _stream_step(kernel, None, item, tile, 1, extras, geo, tuning, state, acc, ld)


@njit(**LEAF_INLINE)
def _stream_scores(kernel, tile, seg):
    """scores of the streaming kernel: each K row read once for every row of the segment
    (:func:`.stream.stream_scores`), int8 products unfolded to the dequantized rows'
    scores."""
    r0, r1, c0, ns, _ = seg
    nrow = r1 - r0
    sb = kernel.sb
    stream_scores(sb, ns, kernel.q2, r0, nrow, kernel.k_rows, c0, ns, kernel.v_rows)
    if kernel.dequant:
        unfold_scores(sb, ns, nrow, r0, kernel.rs, c0, ns, kernel.fold)
    return sb[:nrow * ns].reshape(nrow, ns), kernel.no_p3, kernel.no_keys, False, False, F32_ONE


@njit(**LEAF_INLINE)
def _stream_weighted_sum(kernel, tile, seg, s2, acc, ld, state):
    """weighted_sum of the streaming kernel: each V row read once for every row of the segment
    (:func:`.stream.stream_pv`; kernel.buf: a V row taken on its own), int8 weights folded
    first; the first segment prefetches the K rows read next."""
    r0, r1, c0, ns, _ = seg
    sb, next_keys = kernel.sb, kernel.next_keys
    if kernel.dequant:
        fold_weights(sb, ns, r1 - r0, r0, kernel.rs, c0, ns, state.alpha, kernel.fold)
    stream_pv(acc, ld, r1 - r0, sb, ns, kernel.v_rows, c0, ns, kernel.buf,
              next_keys if r0 == 0 else (next_keys[0], next_keys[1], 0))


_stream_step = tile_loop(None, _stream_scores, _stream_weighted_sum)[0]
