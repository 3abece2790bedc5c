"""The backward of floating-point attention on the CPU: dQ, dK, dV (and the gradient of the
scores' additive terms) from the forward's output and softmax_lse, as FlashAttention-2's
backward computes them, one (query tile, kv tile) at a time, never holding a whole score
matrix.

For each tile the scores are formed again (scaled, softcapped, pse added, the band and the
user mask applied, as the forward took them), and with the row's lse::

    P  = exp(S - lse)                 (0 where the forward kept nothing)
    dP = dO V^T
    dS = P * (dP - delta),  delta = rowsum(dO * O)
    dV = P^T dO,  dK = scale * dS'^T Q,  dQ = scale * dS' K

where dS' is dS through the softcap (times 1 - tanh^2). A sink logit has no value row: it
enters only through lse, and its gradient, -sum over rows of exp(sink - lse) * delta, is the
host's (:func:`attention_gradients`).

No two threads write to one place: where a call has as many (batch, kv head)s as threads,
one pass over them, each item owning its kv head's dK, dV rows and its query heads' dQ rows
(and the dS tiles it writes for the pse gradient); else two passes, one over kv tiles (dK,
dV) and one over query tiles (dQ), both forming the tile's P and dS. The products are SciPy's
BLAS sgemm (:mod:`._blas`), in float32 whatever the inputs' dtype.
"""
import numpy as np
from numba import njit

from ..numerics.band import block_kv_range, row_band
from ..numerics.core import F32_NEG_INF, F32_ONE, F32_ZERO, MASK_DISCARD
from ._blas import gemm_rm, sgemm_address
from ._jit import LEAF, LEAF_INLINE
from ._vector import take_next
from .driver import parallel_region
from .threads import pool_size, threads_for
from .launch import Worker
from .launch import rows as launch_rows
from .records import (BackwardInputs, BackwardRows, BackwardScratch, BackwardTerms, Gradients,
                      Items)

#: query rows and kv columns of one tile
TILE_Q = 64
TILE_K = 64


@njit(**LEAF)
def _tile_weights(s, slope, nq, nk, i0, j0, b, h, p, lse):
    """The tile's softmax weights P = exp(S - lse) into ``s`` (which holds Q K^T), 0 where the
    forward kept nothing, with S the scores as the forward formed them; into ``slope`` each
    score's derivative by its Q K^T product (the scale, times 1 - tanh^2 under a softcap).
    ``p`` is the problem record of :func:`_problem_record`."""
    bias, mask, lens, scale, cap = p
    ql, kl, pre, nxt = lens[0, b], lens[1, b], lens[2, b], lens[3, b]
    bb = b if bias.shape[0] > 1 else 0
    bm = b if mask.shape[0] > 1 else 0
    for r in range(nq):
        i = i0 + r
        row_lse = lse[b, h, i]
        lo, hi = row_band(i, pre, nxt, kl)
        live = i < ql and row_lse != F32_NEG_INF
        for c in range(nk):
            j = j0 + c
            x = s[r * TILE_K + c] * scale
            dx = scale
            if cap != F32_ZERO:
                t = np.tanh(x / cap)
                x = cap * t
                dx = scale * (F32_ONE - t * t)
            if bias.shape[1]:
                x += bias[bb, h, i, j]
            kept = live and lo <= j and j <= hi and x != F32_NEG_INF
            if mask.shape[1] and mask[bm, i, j]:
                kept = False
            s[r * TILE_K + c] = np.exp(x - row_lse) if kept else F32_ZERO
            slope[r * TILE_K + c] = dx


@njit(**LEAF)
def _tile_score_gradients(s, slope, dp, nq, nk, i0, j0, b, h, grads, want_dbias):
    """``dp`` (which holds dO V^T) becomes the gradient of the Q K^T products, slope * dS with
    dS = P * (dP - delta) (P in ``s``); dS itself into grads' dbias where ``want_dbias``
    (``grads``: (delta, dbias))."""
    delta, dbias = grads
    for r in range(nq):
        row_delta = delta[b, h, i0 + r]
        for c in range(nk):
            at = r * TILE_K + c
            ds = s[at] * (dp[at] - row_delta)
            if want_dbias:
                dbias[b, h, i0 + r, j0 + c] = ds
            dp[at] = ds * slope[at]


@njit(**LEAF)
def _transpose(dst, src, nq, nk):
    """dst (nk, TILE_Q) = src (nq, TILE_K)^T, row-major flat buffers."""
    for r in range(nq):
        for c in range(nk):
            dst[c * TILE_Q + r] = src[r * TILE_K + c]


@njit(**LEAF)
def _in_band(lens, tile):
    """Whether any active row of the tile (b, h, i0, nq, j0, nk) may keep one of its
    columns."""
    b, _, i0, nq, j0, nk = tile
    i1 = min(i0 + nq, lens[0, b])
    if i1 <= i0:
        return False
    jstart, jend = block_kv_range(i0, i1, lens[2, b], lens[3, b], lens[1, b])
    return j0 < jend and j0 + nk > jstart


@njit(**LEAF)
def _offsets(dims, tile, width):
    """Flat offsets of the tile's first query-side row and first kv-side row in arrays of rows
    of ``width`` values: Q and K (D), or dO and V (Dv)."""
    _, N, Nkv, Sq, Skv, _, _ = dims
    b, h, i0, _, j0, _ = tile
    return ((b * N + h) * Sq + i0) * width, ((b * Nkv + h // (N // Nkv)) * Skv + j0) * width


@njit(**LEAF)
def _query_tile(item, dims):
    """(b, h, i0, nq) of work item ``item`` of a pass over query tiles."""
    _, N, _, Sq, _, _, _ = dims
    tiles = (Sq + TILE_Q - 1) // TILE_Q
    i0 = item % tiles * TILE_Q
    return item // (N * tiles), item // tiles % N, i0, min(TILE_Q, Sq - i0)


@njit(**LEAF)
def _row_products(blas, rows, cols, width, dims, tile, dst):
    """dst (the tile, row-major, TILE_K apart) = the tile's query rows of ``rows`` (Q or dO)
    times its kv rows of ``cols`` (K or V), transposed; rows of ``width`` values."""
    q_off, k_off = _offsets(dims, tile, width)
    gemm_rm(blas, tile[3], tile[5], width, rows, q_off, width, True, cols, k_off, width, dst, 0,
            TILE_K, F32_ZERO)


@njit(**LEAF)
def _probabilities(blas, bufs, qkv, dims, tile, p, lse):
    """The tile's P into bufs[0] and its slopes into bufs[1] (:func:`_tile_weights`)."""
    b, h, i0, nq, j0, nk = tile
    _row_products(blas, qkv.q, qkv.k, dims[5], dims, tile, bufs[0])
    _tile_weights(bufs[0], bufs[1], nq, nk, i0, j0, b, h, p, lse)


@njit(**LEAF)
def _score_gradients(blas, bufs, qkv, dims, tile, rows, grads, want_dbias):
    """After :func:`_probabilities`: the gradient of the tile's Q K^T products into bufs[2]
    (:func:`_tile_score_gradients`)."""
    b, h, i0, nq, j0, nk = tile
    _row_products(blas, qkv.do, qkv.v, dims[6], dims, tile, bufs[2])
    _tile_score_gradients(bufs[0], bufs[1], bufs[2], nq, nk, i0, j0, b, h,
                          (rows.delta, grads.dbias), want_dbias)


@njit(**LEAF)
def kv_pass(t, args):
    """The backward's kv pass worker (thread t): dK and dV, one item a (batch, kv head, kv
    tile), or (switches[0], dQ added here) one item a (batch, kv head), which then owns its
    query heads' dQ rows too and adds into them; the pse gradient's dS tiles (switches[1])."""
    qkv, dims, p, rows, grads, switches, items, scratch = args[0]
    B, N, Nkv, Sq, Skv, _, _ = dims
    tiles = (Skv + TILE_K - 1) // TILE_K
    whole_heads, want_dbias = switches[0] != 0, switches[1] != 0
    per_item = tiles if whole_heads else 1
    bufs = _tile_buffers(scratch, t)
    blas = (scratch.bi[t], scratch.bf[t], scratch.bc[t], switches[2])
    item = take_next(items.taken)
    while item < B * Nkv * tiles // per_item:
        for jt in range(item * per_item, item * per_item + per_item):
            b, hk, j0 = jt // (Nkv * tiles), jt // tiles % Nkv, jt % tiles * TILE_K
            _kv_tile(qkv, dims, p, rows, grads, blas, bufs, whole_heads, want_dbias, b, hk, j0)
        item = take_next(items.taken)


@njit(**LEAF_INLINE)
def _tile_buffers(scratch, t):
    """Thread t's four tile buffers of TILE_Q x TILE_K float32."""
    return scratch.t0[t], scratch.t1[t], scratch.t2[t], scratch.t3[t]


@njit(**LEAF)
def _kv_tile(qkv, dims, p, rows, grads, blas, bufs, with_dq, want_dbias, b, hk, j0):
    """dK and dV rows of kv tile j0.. of kv head hk in batch b, from every query tile of its
    group's heads (adding into dQ where ``with_dq``)."""
    q, do = qkv.q, qkv.do
    dk, dv = grads.dk, grads.dv
    B, N, Nkv, Sq, Skv, D, Dv = dims
    G = N // Nkv
    nk = min(TILE_K, Skv - j0)
    tr = bufs[3]
    for h in range(hk * G, hk * G + G):
        for i0 in range(0, Sq, TILE_Q):
            tile = (b, h, i0, min(TILE_Q, Sq - i0), j0, nk)
            if not _in_band(p.lens, tile):
                continue
            _probabilities(blas, bufs, qkv, dims, tile, p, rows.lse)
            _score_gradients(blas, bufs, qkv, dims, tile, rows, grads, want_dbias)
            nq = tile[3]
            (o_off, v_off), (q_off, k_off) = _offsets(dims, tile, Dv), _offsets(dims, tile, D)
            _transpose(tr, bufs[0], nq, nk)
            gemm_rm(blas, nk, Dv, nq, tr, 0, TILE_Q, False, do, o_off, Dv, dv, v_off, Dv,
                    F32_ONE)
            _transpose(tr, bufs[2], nq, nk)
            gemm_rm(blas, nk, D, nq, tr, 0, TILE_Q, False, q, q_off, D, dk, k_off, D, F32_ONE)
            if with_dq:
                _add_query_gradient(blas, bufs, qkv, dims, tile, grads.dq)


@njit(**LEAF)
def query_pass(t, args):
    """The backward's query pass worker (thread t): one item a (batch, query head, query tile):
    with switches[0], the softmax weights P (B, N, Sq, Skv) into grads.weights (it holds
    zeros, which the tiles outside the band keep); else dQ."""
    qkv, dims, p, rows, grads, switches, items, scratch = args[0]
    B, N, Nkv, Sq, Skv, _, _ = dims
    want_weights = switches[0] != 0
    bufs = _tile_buffers(scratch, t)
    blas = (scratch.bi[t], scratch.bf[t], scratch.bc[t], switches[2])
    item = take_next(items.taken)
    while item < B * N * ((Sq + TILE_Q - 1) // TILE_Q):
        b, h, i0, nq = _query_tile(item, dims)
        for j0 in range(0, Skv, TILE_K):
            tile = (b, h, i0, nq, j0, min(TILE_K, Skv - j0))
            if not _in_band(p.lens, tile):
                continue
            _probabilities(blas, bufs, qkv, dims, tile, p, rows.lse)
            if want_weights:
                _store_weights(bufs[0], tile, grads.weights)
            else:
                _score_gradients(blas, bufs, qkv, dims, tile, rows, grads, False)
                _add_query_gradient(blas, bufs, qkv, dims, tile, grads.dq)
        item = take_next(items.taken)


@njit(**LEAF)
def _store_weights(probabilities, tile, weights):
    """weights[b, h] at the tile's rows and columns = its P (row-major, TILE_K apart)."""
    b, h, i0, nq, j0, nk = tile
    for r in range(nq):
        for c in range(nk):
            weights[b, h, i0 + r, j0 + c] = probabilities[r * TILE_K + c]


@njit(**LEAF)
def _add_query_gradient(blas, bufs, qkv, dims, tile, dq):
    """dQ of the tile's query rows += its Q K^T products' gradient (bufs[2]) times its K rows
    (``dq`` flat, zeros before the first tile)."""
    D = dims[5]
    q_off, k_off = _offsets(dims, tile, D)
    gemm_rm(blas, tile[3], D, tile[5], bufs[2], 0, TILE_K, False, qkv.k, k_off, D, dq, q_off,
            D, F32_ONE)


def _float32(x):
    return np.ascontiguousarray(x, dtype=np.float32)


def unsupported(p):
    """Why the backward cannot take planned problem ``p``: it takes floating-point BNSD problems
    with a discard mask (what scaled_dot_product_attention plans)."""
    reasons = []
    if p.layout != "BNSD":
        reasons.append(f"layout {p.layout} (it takes BNSD)")
    if p.cache is not None:
        reasons.append("a kv cache (it reads contiguous key / value)")
    if p.quant is not None:
        reasons.append("quantization (it takes floating-point calls)")
    if p.mask is not None and p.mask_kind != MASK_DISCARD:
        reasons.append("an additive float16 attn_mask (it takes a discard mask)")
    return reasons


def owns_whole_heads(p):
    """Whether the kv pass's items can be whole (batch, kv head)s, each adding into its query
    heads' dQ rows too (five tile products a tile, not seven): where there are as many as the
    threads. Either way each dQ row sums its kv tiles in the same order, so the gradients are
    the same bits."""
    return p.B * p.Nkv >= pool_size()


def _problem_record(p):
    """What the kernels read of planned problem ``p`` beside the arrays: (bias (Bp, N, Sq,
    Skv) float32, discard mask (Bm, Sq, Skv) bool, lens (4, B) int64 of (qL, kL, preE,
    nextE), scale, softcap), an empty bias / mask where there is none."""
    bias = _float32(p.pse) if p.pse is not None else np.zeros((1, 0, 0, 0), np.float32)
    mask = np.ascontiguousarray(p.mask != 0) if p.mask is not None \
        else np.zeros((1, 0, 0), np.bool_)
    lens = np.ascontiguousarray(np.stack([p.qlen, p.klen, p.pre_e, p.next_e]).astype(np.int64))
    return BackwardTerms(bias, mask, lens, np.float32(p.scale), np.float32(p.softcap))


def attention_gradients(p, out, dout, lse, want_dbias, whole_heads):
    """The gradients of planned problem ``p`` (BNSD, floating point) given its output ``out``
    and softmax_lse ``lse`` ((B, N, Sq) or (B, N, Sq, 1)) from the forward and the output's
    gradient ``dout`` (B, N, Sq, Dv): (dq, dk, dv, dbias, dsinks) as float32 arrays in the
    shapes of p.q, p.k, p.v, (B, N, Sq, Skv) (None unless ``want_dbias``: the gradient of the
    scores' additive terms, per batch) and (N,) (None without sinks). ``whole_heads``: the kv
    pass takes whole (batch, kv head)s and adds dQ too (:func:`owns_whole_heads`; the
    backward-heads kernel), else a kv pass and a query pass (backward-tiles)."""
    terms = _problem_record(p)
    q, k, v, dout = (_float32(x) for x in (p.q, p.k, p.v, dout))
    delta = np.einsum("bnsd,bnsd->bns", dout, _float32(out), dtype=np.float64)
    delta = delta.astype(np.float32)
    lse = _float32(lse).reshape(p.B, p.N, p.Sq)
    dbias = np.zeros((p.B, p.N, p.Sq, p.Skv) if want_dbias else (1, 1, 1, 1), np.float32)
    dq, dk, dv = (np.zeros(x.shape, np.float32) for x in (q, k, v))
    if p.Sq and p.Skv and p.D:
        qkv = BackwardInputs(*(x.reshape(-1) for x in (q, k, v, dout)))
        grads = Gradients(dq.reshape(-1), dk.reshape(-1), dv.reshape(-1), dbias,
                          np.zeros((1, 1, 1, 1), np.float32))
        rows = BackwardRows(lse, delta)
        with parallel_region(blas=True):
            _run(p, "kv_pass", p.B * p.Nkv * (1 if whole_heads else -(-p.Skv // TILE_K)),
                 (qkv, terms, rows, grads, (whole_heads, want_dbias)))
            if not whole_heads:
                _run(p, "query_pass", p.B * p.N * -(-p.Sq // TILE_Q),
                     (qkv, terms, rows, grads, (False, False)))
    return dq, dk, dv, (dbias if want_dbias else None), _sink_gradient(p, lse, delta)


def attention_weights(p, lse):
    """The softmax weights (B, N, Sq, Skv) float32 of planned problem ``p`` (BNSD, floating
    point) from its softmax_lse ``lse``: what each row's output is the weighted sum of V by
    (zeros where the forward kept nothing)."""
    terms = _problem_record(p)
    weights = np.zeros((p.B, p.N, p.Sq, p.Skv), np.float32)
    if p.Sq and p.Skv and p.D:
        q, k = (_float32(x).reshape(-1) for x in (p.q, p.k))
        nothing = np.zeros(1, np.float32)
        lse = _float32(lse).reshape(p.B, p.N, p.Sq)
        rows = BackwardRows(lse, np.zeros((1, 1, 1), np.float32))
        grads = Gradients(nothing, nothing, nothing, np.zeros((1, 1, 1, 1), np.float32),
                          weights)
        with parallel_region(blas=True):
            _run(p, "query_pass", p.B * p.N * -(-p.Sq // TILE_Q),
                 (BackwardInputs(q, k, nothing, nothing), terms, rows, grads, (True, False)))
    return weights


#: the backward's workers: the kv pass and the query pass
_WORKERS = {}


def _run(p, name, items, records):
    """Run the backward's worker ``name`` over ``items`` work items: records = (qkv, terms,
    rows, grads, (switch, want_dbias))."""
    from ..cache import Compiling
    qkv, terms, rows_, grads, (switch, want_dbias) = records
    if name not in _WORKERS:
        _WORKERS[name] = Worker(globals()[name])
    threads = threads_for(items)
    size = TILE_Q * TILE_K
    chars = launch_rows(threads, (2,), np.uint8)
    chars[:, :2] = (ord("N"), ord("T"))
    scratch = BackwardScratch(*(launch_rows(threads, (size,), np.float32) for _ in range(4)),
                              launch_rows(threads, (6,), np.int32),
                              launch_rows(threads, (2,), np.float32), chars)
    items_ = Items(np.zeros((1, 6), np.int64), np.zeros((1, 2), np.int64),
                   np.zeros(1, np.int64), np.zeros(1, np.uint8))
    switches = np.array([switch, want_dbias, sgemm_address()], np.int64)
    _WORKERS[name].run(threads, (qkv, tuple(int(x) for x in _dims(p)), terms, rows_, grads,
                                 switches, items_, scratch),
                       Compiling("CPU", f"backward-{name.replace('_', '-')}",
                                 "float32 gradients", p.layout))


def _dims(p):
    return p.B, p.N, p.Nkv, p.Sq, p.Skv, p.D, p.Dv


def _sink_gradient(p, lse, delta):
    """d loss / d sink of each head: -sum over the rows that kept a score of the sink's
    softmax weight exp(sink - lse) times the row's delta."""
    if p.sinks is None:
        return None
    sinks = np.asarray(p.sinks, np.float64)[None, :, None]
    live = lse != -np.inf
    with np.errstate(over="ignore", invalid="ignore"):
        weight = np.where(live, np.exp(sinks - np.where(live, lse, 0.0)), 0.0)
    return -(weight * delta).sum(axis=(0, 2)).astype(np.float32)
