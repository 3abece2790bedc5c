"""The float32 tiles: work items of query rows x kv tiles, their products on the AVX-512
register blocks of ``_gemm`` (the avx512-tiles kernel) or on BLAS sgemm (blas-tiles), the
softmax of ``rows``, the deferred division and contract 'Empty rows' in the finish. Every float
storage (float16, bfloat16, float32, int8 key / value dequantized) is widened to float32 as it
loads.

Each kernel is one worker (:mod:`.launch`) over the records (ins, outs, extras, geo, tuning,
items, scratch, parts): a thread takes the next run of items (:func:`.items.kv_head_runs`) not
yet taken whenever it is free (runs are sorted by cost, most expensive first), so a thread that
runs slower, on a core shared with other work, takes fewer runs instead of holding the call up.
Pieces of split items (see :mod:`.split_kv`) leave their state in ``parts`` for the merge.
"""
from numba import njit

from ..numerics.core import F32_NEG_INF, F32_ONE, F32_ZERO, order_key
from ..numerics.kernel_args import P_D, P_DEQUANT, P_DV, P_KVCODE
from ._blas import gemm_rm
from ._gemm import PANEL, accumulate, padded_rows, panels
from ._gemm import scores as panel_scores
from ._jit import LEAF, LEAF_INLINE
from ._simd import PF_ROWS
from ._vector import take_next
from .items import W_B, W_G, W_I0, W_JHI, W_JLO, item_rows
from .kv import KEY, VALUE, load_dequant_row
from .records import BlasProducts, F32Buffers, RegisterProducts
from .rows import all_finite, has_user_terms, load_row, pack_kt, prefetch_row
from .tile import add_pv_exact, done, row_state, start_rows, tile_loop


def item_loop(walk_tiles):
    """The loop over the items a thread takes of a float32 tiles kernel whose tile loop is
    ``walk_tiles`` (:func:`.tile.tile_loop`): a LEAF_INLINE function."""

    @njit(**LEAF_INLINE)
    def item(kernel, align, ins, extras, geo, tuning, row, state):
        """One work item in float32 (``row`` of the work array): rows of positions [i0, i1)
        of the G query heads of kv head g in batch b (see :func:`.items.item_rows`), over the
        kv columns of its band inside [W_JLO, W_JHI) (a piece of a split item; (0, BAND_INF):
        all), through the tile loop with ``kernel``'s products. Leaves the rows' unnormalised
        sums in the buffers' acc and their (m, l) in state; returns (i1, whether any kv column
        was visited)."""
        params = geo.params
        b, g, i0 = row[W_B], row[W_G], row[W_I0]
        i1, R, jstart, jend = item_rows(params, geo.lens, b, i0)
        jstart, jend = max(jstart, row[W_JLO]), min(jend, row[W_JHI])
        if jstart < jend:
            bufs = kernel.bufs
            start_rows(ins.q, geo, (b, g, i0), R, bufs.qb, bufs.acc, state)
            walk_tiles(kernel, ins, (b, g, i0), (i1, R, jstart, jend), align, extras, geo,
                       tuning, state, bufs.acc, tuning.ld, (bufs.ro, bufs.rs))
        return i1, jstart < jend

    @njit(**LEAF_INLINE)
    def take_items(kernel, align, ins, outs, extras, geo, tuning, items, parts, state):
        """The runs of items this thread takes, each item computed and finished (or kept as
        a piece)."""
        bufs = kernel.bufs
        runs = items.runs
        x = take_next(items.taken)
        while x < runs.shape[0]:
            for w in range(runs[x, 0], runs[x, 1]):
                row = items.work[w]
                i1, computed = item(kernel, align, ins, extras, geo, tuning, row, state)
                done(outs, ins, extras, geo, parts, row, i1, bufs.acc, tuning.ld, state,
                     bufs.tb, computed)
            x = take_next(items.taken)

    return take_items




# ---------------------------------------------------------------------------------------------
# the products (see .tile)
# ---------------------------------------------------------------------------------------------

@njit(**LEAF_INLINE)
def _register_tile(kernel, ins, item, cols, prefix, sdk, sdv):
    """load_tile of avx512-tiles: K as K^T panels, V as rows of ld values; the tile: whether
    every V value is finite."""
    bufs, D = kernel.bufs, kernel.D
    channel = ins.channel
    pack_kt(bufs.kb, ins.kp if prefix else ins.k, bufs.ro[0], sdk, cols[1], D, kernel.code,
            bufs.tb, (kernel.dequant, channel[KEY], channel[KEY + 1], item[1] * D, bufs.rs))
    return True, _load_values(kernel, ins, item[1], cols[1], prefix, sdv)


@njit(**LEAF_INLINE)
def _blas_tile(kernel, ins, item, cols, prefix, sdk, sdv):
    """load_tile of blas-tiles: K and V as rows; the tile: whether every V value is
    finite."""
    bufs, D, nc, g = kernel.bufs, kernel.D, cols[1], item[1]
    ro, rs, channel = bufs.ro, bufs.rs, ins.channel
    ks = ins.kp if prefix else ins.k
    k2 = bufs.kb[:nc * D].reshape(nc, D)
    for c in range(nc):
        if kernel.dequant:
            load_dequant_row(k2, c, ks, ro[0, c], sdk, D, channel[KEY], channel[KEY + 1], g * D,
                             rs[KEY, c], rs[KEY + 1, c])
        else:
            load_row(k2, c, ks, ro[0, c], sdk, D, kernel.code, F32_ONE)
    return True, _load_values(kernel, ins, g, nc, prefix, sdv)


@njit(**LEAF_INLINE)
def _load_values(kernel, ins, g, nc, prefix, sdv):
    """The tile's nc V rows of kv head g into the buffers' vb, ld values a row (zeros past
    Dv), dequantized where int8; whether every value is finite."""
    bufs, D, ld = kernel.bufs, kernel.Dv, kernel.ld
    ro, rs, channel = bufs.ro, bufs.rs, ins.channel
    vs = ins.vp if prefix else ins.v
    v2 = bufs.vb[:nc * ld].reshape(nc, ld)
    for c in range(nc):
        if c + PF_ROWS < nc:
            prefetch_row(vs, ro[1, c + PF_ROWS], D * sdv)
        if kernel.dequant:
            load_dequant_row(v2, c, vs, ro[1, c], sdv, D, channel[VALUE], channel[VALUE + 1],
                             g * D, rs[VALUE, c], rs[VALUE + 1, c])
        else:
            load_row(v2, c, vs, ro[1, c], sdv, D, kernel.code, F32_ONE)
        v2[c, D:] = F32_ZERO
    return all_finite(bufs.vb, nc * ld)


@njit(**LEAF_INLINE)
def _register_scores(kernel, tile, seg):
    """scores of avx512-tiles: S = Q K^T on the register blocks, which also take the row maxima
    where no column past ns and no mask or band touches them."""
    bufs, D = kernel.bufs, kernel.D
    r0, r1, c0, ns, inside = seg
    nrow = r1 - r0
    lds = panels(ns) * PANEL
    keys = bufs.kx[:0]
    if inside and not kernel.any_user and ns == lds:
        keys = bufs.kx[:padded_rows(nrow)]
        keys[:] = order_key(F32_NEG_INF)
        panel_scores(bufs.qb, r0 * D, D, bufs.kb, c0 * D, D, bufs.sb, lds, nrow, panels(ns),
                     keys)
    else:
        panel_scores(bufs.qb, r0 * D, D, bufs.kb, c0 * D, D, bufs.sb, lds, nrow, panels(ns),
                     None)
    return bufs.sb[:nrow * lds].reshape(nrow, lds), kernel.no_p3, keys, False, False, F32_ONE


@njit(**LEAF_INLINE)
def _blas_scores(kernel, tile, seg):
    """scores of blas-tiles: S = Q K^T on BLAS sgemm."""
    bufs, D = kernel.bufs, kernel.D
    r0, r1, c0, ns, _ = seg
    nrow = r1 - r0
    gemm_rm(kernel.blas, nrow, ns, D, bufs.qb, r0 * D, D, True, bufs.kb, c0 * D, D, bufs.sb, 0,
            ns, F32_ZERO)
    return (bufs.sb[:nrow * ns].reshape(nrow, ns), kernel.no_p3, bufs.kx[:0], False, False,
            F32_ONE)


@njit(**LEAF_INLINE)
def _register_weighted_sum(kernel, tile, seg, s2, acc, ld, state):
    """weighted_sum of avx512-tiles: acc += P V on the register blocks, or column by column
    where V holds inf or NaN (``tile`` False)."""
    bufs = kernel.bufs
    r0, r1, c0, ns, _ = seg
    nrow, lds = r1 - r0, s2.shape[1]
    if not tile:
        add_pv_exact(acc, ld, nrow, kernel.Dv, bufs.sb, lds, ns, bufs.vb[c0 * ld:], ld, 1)
        return
    # the register blocks also add the padding rows' P (zero) to the rows below the segment:
    # + 0 changes nothing
    bufs.sb[nrow * lds:padded_rows(nrow) * lds] = F32_ZERO
    accumulate(bufs.sb, lds, bufs.vb, c0 * ld, ld, acc, 0, ld, nrow, ns)


@njit(**LEAF_INLINE)
def _blas_weighted_sum(kernel, tile, seg, s2, acc, ld, state):
    """weighted_sum of blas-tiles: acc += P V on BLAS sgemm, or column by column where V
    holds inf or NaN (``tile`` False)."""
    bufs = kernel.bufs
    r0, r1, c0, ns, _ = seg
    nrow, lds = r1 - r0, s2.shape[1]
    if not tile:
        add_pv_exact(acc, ld, nrow, kernel.Dv, bufs.sb, lds, ns, bufs.vb[c0 * ld:], ld, 1)
        return
    gemm_rm(kernel.blas, nrow, kernel.Dv, ns, bufs.sb, 0, lds, False, bufs.vb, c0 * ld, ld, acc,
            0, ld, F32_ONE)


_register_walk = tile_loop(_register_tile, _register_scores, _register_weighted_sum)[1]
_blas_walk = tile_loop(_blas_tile, _blas_scores, _blas_weighted_sum)[1]
_register_items = item_loop(_register_walk)
_blas_items = item_loop(_blas_walk)


@njit(**LEAF)
def avx512_tiles(t, args):
    """The avx512-tiles kernel's worker (thread t): products on the register blocks."""
    ins, outs, extras, geo, tuning, items, scratch, parts = args[0]
    bufs = thread_buffers(scratch, t)
    params = geo.params
    kernel = RegisterProducts(bufs, has_user_terms(params, extras), scratch.p3[t], params[P_D],
                              params[P_DV], tuning.ld, params[P_KVCODE], params[P_DEQUANT] != 0)
    _register_items(kernel, PANEL, ins, outs, extras, geo, tuning, items, parts,
               row_state(scratch.m, scratch.l, scratch.alpha, t))


@njit(**LEAF)
def blas_tiles(t, args):
    """The blas-tiles kernel's worker (thread t): products on BLAS sgemm."""
    ins, outs, extras, geo, tuning, items, scratch, parts = args[0]
    bufs = thread_buffers(scratch, t)
    params = geo.params
    kernel = BlasProducts(bufs, (scratch.bi[t], scratch.bf[t], scratch.bc[t], tuning.blas),
                          scratch.p3[t], params[P_D], params[P_DV], tuning.ld,
                          params[P_KVCODE], params[P_DEQUANT] != 0)
    _blas_items(kernel, 1, ins, outs, extras, geo, tuning, items, parts,
               row_state(scratch.m, scratch.l, scratch.alpha, t))


@njit(**LEAF_INLINE)
def thread_buffers(scratch, t):
    """Thread t's :class:`.records.F32Buffers` (its rows of the F32Scratch record)."""
    return F32Buffers(scratch.qb[t], scratch.sb[t], scratch.tb[t], scratch.acc[t],
                      scratch.kb[t], scratch.vb[t], scratch.kx[t], scratch.ro[t], scratch.rs[t])
