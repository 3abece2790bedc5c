"""Split-kv: a problem with fewer runs of work items (:func:`.items.kv_head_runs`) than threads
to keep busy (decode: one query row per head against a long kv cache, at a small batch) has
each run's kv range cut into pieces, computed in parallel as separate runs, then merged exactly.

A piece leaves the online-softmax state of its rows, (unnormalised sums acc, running max m,
running sum l) over its kv columns, in a slot of the partial buffers; :func:`merge_rows`
combines the slots of an item with the online-softmax step itself (:func:`numerics.core.rescale_factor`,
as between two tiles of one item); the merge worker (:func:`.tile.merge`) then finishes the rows as a
whole item would (contract 'Empty rows', lse, output rounding), so a split changes nothing but the
order of float32 additions. The float32 tiles and the streaming kernel take pieces.
"""
import numpy as np
from numba import njit
from .. import config
from ..numerics.band import block_kv_range
from ..numerics.core import F32_NEG_INF, F32_ZERO, max_nan, rescale_factor
from ._jit import LEAF
from .items import W_B, W_G, W_I0, W_JHI, W_JLO, W_SLOT
from .records import Parts

#: Columns of a row of the groups array: batch, kv head, first query position of a split
#: item, its first slot and its number of pieces.
G_B, G_G, G_I0, G_SLOT, G_PIECES = range(5)
#: kv columns of a piece are a multiple of this (whole register-block panels).
_PIECE_ALIGN = 64


def runs_wanted(nthreads):
    """The fewest runs that keep ``nthreads`` threads busy without a split
    (config.CPU_SPLIT_KV_ITEMS a thread; 0: never split)."""
    return int(config.CPU_SPLIT_KV_ITEMS) * nthreads


def split_work(p, work, runs, rows_per_head, nthreads):
    """(work, groups, runs): ``work`` with each run of items (:func:`.items.kv_head_runs`) cut
    into pieces where it has fewer than config.CPU_SPLIT_KV_ITEMS runs per thread and a long
    enough kv range (pieces of at least config.CPU_SPLIT_KV_MIN_COLS columns), the groups of
    pieces to merge (none: no split) and the runs of the result: one run a piece, of the
    pieces of the run's items over the same kv columns."""
    want = runs_wanted(nthreads)
    n = runs.shape[0]
    no_groups = np.zeros((0, 5), np.int64)
    if n == 0 or n >= want:
        return work, no_groups, runs
    min_cols = max(1, int(config.CPU_SPLIT_KV_MIN_COLS))
    rows, groups, new_runs = [], [], []
    slots = 0
    for a, z in runs:
        items = work[a:z]
        lo, hi = _item_columns(p, items[0], rows_per_head)
        pieces = min(-(-want // n), (hi - lo) // min_cols)
        if pieces < 2:
            new_runs.append((len(rows), len(rows) + len(items)))
            rows.extend(items)
            continue
        per_piece = -(-(hi - lo) // pieces)
        step = -(-per_piece // _PIECE_ALIGN) * _PIECE_ALIGN         # whole panels
        bounds = list(range(lo, hi, step)) + [hi]
        count = len(bounds) - 1
        for h, item in enumerate(items):
            groups.append((item[W_B], item[W_G], item[W_I0], slots + h * count, count))
        for k, (j0, j1) in enumerate(zip(bounds[:-1], bounds[1:])):
            new_runs.append((len(rows), len(rows) + len(items)))
            for h, item in enumerate(items):
                piece = item.copy()
                piece[W_JLO], piece[W_JHI], piece[W_SLOT] = j0, j1, slots + h * count + k
                rows.append(piece)
        slots += len(items) * count
    if not groups:
        return work, no_groups, runs
    return (np.array(rows, np.int64), np.array(groups, np.int64),
            np.array(new_runs, np.int64).reshape(-1, 2))


def _item_columns(p, item, rows_per_head):
    """The kv columns [lo, hi) any row of whole work item ``item`` may keep."""
    b, i0 = int(item[W_B]), int(item[W_I0])
    i1 = min(i0 + rows_per_head, int(p.qlen[b]))
    lo, hi = block_kv_range.py_func(i0, i1, int(p.pre_e[b]), int(p.next_e[b]), int(p.klen[b]))
    return int(lo), int(max(hi, lo))


def partial_buffers(groups, rows, ld):
    """The :class:`.records.Parts` of ``groups``: per slot, ``rows`` rows of ``ld`` sums and
    (m, l); empty without groups."""
    slots = int(groups[:, G_PIECES].sum())
    return Parts(np.zeros((slots, rows * ld), np.float32), np.zeros((slots, rows, 2), np.float32))


@njit(**LEAF)
def keep_piece(parts, slot, acc, ld, state, R, computed):
    """Store the state of a piece's R rows (acc rows of ``ld``) in ``slot``; a piece that kept
    nothing (``computed`` False, or m = -inf) is marked by m = -inf and its acc is not read."""
    pacc, pml = parts
    m, l, _ = state
    for rr in range(R):
        pml[slot, rr, 0] = m[rr] if computed else F32_NEG_INF
        pml[slot, rr, 1] = l[rr] if computed else F32_ZERO
    if computed:
        for x in range(R * ld):
            pacc[slot, x] = acc[x]


@njit(**LEAF)
def merge_rows(parts, slot0, pieces, R, D, ld, acc, state, post_e):
    """The state of the whole item from its pieces' slots, into acc and state (m, l)."""
    pacc, pml = parts
    m, l, _ = state
    for rr in range(R):
        mx = F32_NEG_INF
        for s in range(slot0, slot0 + pieces):
            if pml[s, rr, 0] != F32_NEG_INF:
                mx = max_nan(mx, pml[s, rr, 0])
        total = F32_ZERO
        row = acc[rr * ld:rr * ld + D]
        row[:] = F32_ZERO
        for s in range(slot0, slot0 + pieces):
            if pml[s, rr, 0] == F32_NEG_INF:
                continue
            f = rescale_factor(pml[s, rr, 0], mx, post_e)
            total += f * pml[s, rr, 1]
            piece = pacc[s, rr * ld:rr * ld + D]
            for d in range(D):
                row[d] += f * piece[d]
        m[rr] = mx
        l[rr] = total
