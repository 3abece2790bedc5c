"""Work items of the CPU kernels: which rows, kv tiles and row segments each computes, and the
order they are taken in."""
import numpy as np
from numba import njit
from .. import config
from ..numerics.band import BAND_INF, block_kv_range, tile_inside_band
from ..numerics.kernel_args import L_KLEN, L_NEXT, L_PRE, L_QLEN, P_G, P_ROWS
from ._amx import BLOCK
from ._gemm import PANEL
from ._jit import LEAF, LEAF_INLINE
from ._vector import host_is_zen

#: Columns of a row of the work array: batch, kv head, first query position; the kv columns
#: [lo, hi) it computes (all of its band: 0, BAND_INF); the slot of its partial result when
#: it is one piece of a split item (see :mod:`.split_kv`), else -1.
W_B, W_G, W_I0, W_JLO, W_JHI, W_SLOT = range(6)


@njit(**LEAF_INLINE)
def item_rows(params, lens, b, i0):
    """Geometry of work item (b, i0): (i1, R, jstart, jend). Its R = G * (i1 - i0) rows are
    stacked position-major: row rr is query position i0 + rr // G of query head g * G + rr % G;
    only kv columns [jstart, jend) can be kept by any of them."""
    G = params[P_G]
    i1 = min(i0 + params[P_ROWS], lens[L_QLEN, b])
    jstart, jend = block_kv_range(i0, i1, lens[L_PRE, b], lens[L_NEXT, b], lens[L_KLEN, b])
    return i1, G * (i1 - i0), jstart, jend


@njit(**LEAF)
def segment(params, tuning, lens, b, i0, i1, j0, j1, r0, R, align):
    """The next row segment [r0, r1) of a kv tile [j0, j1), and its columns [cl, ch).

    A tile wholly inside the band is one segment of all R rows. A tile the band cuts is taken
    CPU_SUB_ROWS rows at a time (a multiple of ``align``), each over only the columns its rows
    can keep (cl a multiple of ``align`` from j0): on a causal diagonal or a band edge this
    skips most of the cut-off triangle. Returns (r1, cl, ch, inside); cl >= ch: nothing kept.
    """
    G = params[P_G]
    pre_e = lens[L_PRE, b]
    next_e = lens[L_NEXT, b]
    if tile_inside_band(i0, i1, j0, j1, pre_e, next_e):
        return min(R, r0 + tuning.seg), j0, j1, True
    r1 = min(R, r0 + tuning.sub)
    p0 = i0 + r0 // G
    p1 = i0 + (r1 - 1) // G + 1
    lo, hi = block_kv_range(p0, p1, pre_e, next_e, lens[L_KLEN, b])
    cl = j0 + (max(lo - j0, 0) // align) * align
    ch = min(j1, hi)
    return r1, cl, ch, tile_inside_band(p0, p1, cl, ch, pre_e, next_e)


def work_items(p, rows_per_head):
    """The work array (columns W_*) of whole items, one for every (b, kv head, i0) block with
    rows to compute, most expensive first (a block's estimated cost: its band columns times
    its rows; ties in (b, i0) order)."""
    counts = -(-p.qlen // rows_per_head)
    b = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    i0 = (np.arange(b.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) \
        * rows_per_head
    i1 = np.minimum(i0 + rows_per_head, p.qlen[b])
    lo, hi = block_kv_range.py_func(i0, i1, p.pre_e[b], p.next_e[b], p.klen[b])
    order = np.argsort(-np.maximum(hi - lo, 0) * (i1 - i0), kind="stable")
    work = np.empty((b.size, p.Nkv, 6), np.int64)
    work[:, :, W_B], work[:, :, W_I0] = b[order, None], i0[order, None]
    work[:, :, W_G] = np.arange(p.Nkv)
    work[:, :, W_JLO], work[:, :, W_JHI], work[:, :, W_SLOT] = 0, BAND_INF, -1
    return work.reshape(-1, 6)


def item_row_counts(work, qlen, G, rows_per_head):
    """The rows (over the G heads) of each item of the work array."""
    i0 = work[:, W_I0]
    return G * (np.minimum(i0 + rows_per_head, qlen[work[:, W_B]]) - i0)


def kv_head_runs(work, qlen, G, rows_per_head, stream_rows, max_heads):
    """The runs of the work array: (n, 2) int64 [start, end) of the consecutive items taken
    together. Streaming items (at most ``stream_rows`` rows: decode) of one block and kv span
    run their kv heads together, up to ``max_heads`` a run, so that a kv tile's rows are read
    for several heads at once: the heads of a row lie side by side in BSH / BSND and paged
    caches, and one head at a time would read them in short runs far apart. Every other item
    is a run of its own."""
    n = work.shape[0]
    if n == 0:
        return np.zeros((0, 2), np.int64)
    streams = item_row_counts(work, qlen, G, rows_per_head) <= stream_rows
    cols = [W_B, W_I0, W_JLO, W_JHI]
    joins = np.zeros(n, bool)
    joins[1:] = streams[1:] & streams[:-1] & (work[1:, cols] == work[:-1, cols]).all(axis=1)
    index = np.arange(n, dtype=np.int64)
    chain_start = np.maximum.accumulate(np.where(joins, 0, index))
    starts = index[(index - chain_start) % max(1, max_heads) == 0]
    return np.stack([starts, np.append(starts[1:], n)], axis=1)


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
    # no larger than the problem (kv columns in whole register-block panels): the kernels'
    # buffers are sized by the tiles, and a decode step (one query row) would otherwise fill a
    # prefill-sized buffer every call
    if p.B:
        q_rows = min(q_rows, p.G * max(1, int(p.qlen.max())))
        kv_cols = min(kv_cols, -(-max(1, int(p.klen.max())) // PANEL) * PANEL)
        if streams(p, max(1, q_rows // p.G)) and p.kv_rows_hold_heads:
            kv_cols = min(kv_cols, _interleaved_stream_cols(p))
    return q_rows, kv_cols


def stream_rows():
    """Rows of the largest work item that streams its K / V rows (config.CPU_STREAM_ROWS)."""
    return max(0, int(config.CPU_STREAM_ROWS))


def prefetch_next_keys():
    """Whether streaming items prefetch the K rows they read next (config.CPU_PREFETCH_NEXT_KEYS;
    None: on AMD Zen hosts)."""
    choice = config.CPU_PREFETCH_NEXT_KEYS
    return host_is_zen() if choice is None else bool(choice)


def streams(p, rows_per_head):
    """Whether the items of ``p`` (``rows_per_head`` query positions) stream their K / V rows:
    at most stream_rows() rows over the G heads of a kv head."""
    return p.G * min(rows_per_head, int(p.qlen.max(initial=0))) <= stream_rows()


def _interleaved_stream_cols(p):
    """Kv columns of a streaming tile whose rows hold every kv head: the heads of a run take a
    tile in turn, and a tile of CPU_STREAM_TILE_BYTES keeps in L2 the lines that one head's
    reads bring in for the next (whole panels, at least one)."""
    row_bytes = 2 * p.Nkv * p.D * p.k.itemsize             # a K and a V row of every head
    return max(1, int(config.CPU_STREAM_TILE_BYTES) // row_bytes // PANEL) * PANEL


def sub_rows():
    """Rows per segment of a tile the band cuts (config.CPU_SUB_ROWS, a multiple of 32)."""
    return max(1, -(-int(config.CPU_SUB_ROWS) // BLOCK)) * BLOCK


def seg_rows(amx):
    """Rows per segment of a tile inside the band (config.CPU_SEG_ROWS, or CPU_AMX_SEG_ROWS
    for the AMX kernel; a multiple of 32)."""
    rows = config.CPU_AMX_SEG_ROWS if amx else config.CPU_SEG_ROWS
    return max(1, -(-int(rows) // BLOCK)) * BLOCK
