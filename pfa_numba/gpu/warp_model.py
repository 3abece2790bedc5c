"""A NumPy model of one warp of the tensor-core (FA2) kernel: what it computes, register by
register, through the maps of :mod:`.fragments` that the kernel itself uses.

The specification of the tensor-core kernel, tested without a GPU (the kernel's own source
runs under the CUDA simulator too, through :mod:`.warp_sim`): every lane's registers are rows
of NumPy arrays ((32, 4) uint32 for an A fragment, (32, 2) for B, (32, 4) float32 for C/D),
and each instruction is modelled from its documented semantics:

* ``ldmatrix`` (:func:`ldmatrix_x4`): lane l's offset into a shared tile image supplies row
  ``ldsm_source(l)``; each lane receives the elements ``ldsm_element`` of the four matrices;
* ``mma.sync.m16n8k16`` (:func:`mma`): the lanes' registers are gathered into the 16x16 A,
  16x8 B and C matrices through ``mma_a``, ``mma_b``, ``mma_c``, multiplied (products exact,
  the sum rounded once to float32) and D scattered back;
* ``shfl.xor`` within a quad (:func:`quad_allreduce`): lane arrays indexed by ``lane ^ m``;
* ``cp.async`` into a swizzled image (:func:`stage`); K/V rows at or past the block's last
  column (``block_kv_range``'s jend <= kL) are zero-filled (src-size 0).

:func:`fa2_block` runs one warp's block of 16 query rows of one head over its kv tiles:
S = Q K^T (Q fragments loaded once, K by plain ldmatrix), the band predicate
(``numerics.band.row_band``) and a user discard mask per accumulator (row, column), the online softmax
in log2 units with the scale folded in (t = s * scale * log2 e, p = exp2(t - m); the step is
``numerics.core.online_update_log2`` and the lse ``numerics.core.lse_log2``, as in the kernel), P re-packed
from the S accumulators into A fragments (``p_from_s``: no shuffles) in the input's 16-bit
type, O += P V (V by ldmatrix.trans), l kept per lane and reduced over the quad at the end,
the division deferred to the end, and the rows of contract 'Empty rows' by ``numerics.band.row_outcome``.
:func:`attention` runs every block of one head. :func:`decode_group` models the split-kv
decode kernel (:mod:`.decode_kernel`) the same way: a kv head's 16 query rows, each warp
on its 16-key quarter of every tile (:func:`decode_warp`), the warps' and then the splits'
states merged by ``online_update_log2``'s rescale (:func:`_merge`), the rows finished by
``row_outcome``. ``maps`` (default :data:`MAPS`) lets the tests
swap in a wrong map and see a check fail.

What the model shows the kernel must also do: a V value that is inf or NaN in a column a row
drops still reaches that row (0 * inf = NaN in the product), where contract 'The computation' says
it contributes nothing; so the launch scans V on the device and such calls are computed by the
portable kernel (``guard.nonfinite_scan``).
"""
import functools
from typing import Callable, NamedTuple

import ml_dtypes
import numpy as np

from ..numerics.band import ROW_MEAN, ROW_SOFTMAX, band_edges, block_kv_range, row_band, row_outcome
from ..numerics.core import antiquant, lse_log2, max_nan, online_update_log2
from . import fragments as F

LOG2E = np.float32(1.4426950408889634)
DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
#: query rows of one warp (the m of the mma)
ROWS = F.MMA_M


class Maps(NamedTuple):
    """The lane maps the model goes through (:mod:`.fragments` by default)."""
    mma_a: Callable = F.mma_a
    mma_b: Callable = F.mma_b
    mma_c: Callable = F.mma_c
    ldsm_source: Callable = F.ldsm_source
    ldsm_element: Callable = F.ldsm_element
    ldsm_a_addr: Callable = F.ldsm_a_addr
    ldsm_b_addr: Callable = F.ldsm_b_addr
    p_from_s: Callable = F.p_from_s
    swizzle: Callable = F.swizzle


MAPS = Maps()
LANES = np.arange(F.WARP)


@functools.lru_cache(maxsize=64)
def tables(maps):
    """Every lane map of ``maps`` as NumPy arrays (built once per maps)."""
    t = {"a": F.lane_table(maps.mma_a, F.A_REGS), "b": F.lane_table(maps.mma_b, F.B_REGS),
         "c": F.lane_table(maps.mma_c, F.C_REGS),
         "src": F.lane_table(lambda lane, _: maps.ldsm_source(lane), 1),
         "plain": F.lane_table(lambda lane, h: maps.ldsm_element(lane, h, False), 2),
         "trans": F.lane_table(lambda lane, h: maps.ldsm_element(lane, h, True), 2),
         "addr_a": F.lane_table(lambda lane, _: maps.ldsm_a_addr(lane), 1),
         "addr_b": F.lane_table(lambda lane, _: maps.ldsm_b_addr(lane), 1),
         "p": [maps.p_from_s(r) for r in range(F.A_REGS)]}
    rows = t["c"][0]
    # the softmax keeps one value per (lane, row half): c0, c1 share a row, so do c2, c3, and
    # the four lanes of a quad hold the same two rows (what the xor 1, 2 shuffles rely on)
    assert (rows[:, 0] == rows[:, 1]).all() and (rows[:, 2] == rows[:, 3]).all(), "C rows"
    for m in (1, 2):
        assert (rows == rows[LANES ^ m]).all(), "C rows differ within a quad"
    return t


# ---------------------------------------------------------------------------------------------
# registers
# ---------------------------------------------------------------------------------------------

def bits(x, dtype):
    """float32 values rounded to the 16-bit ``dtype`` (nearest, ties to even; overflow to
    inf, as cvt.rn does), as uint16."""
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(dtype).view(np.uint16)


def pack(lo, hi, dtype):
    """cvt.rn.{f16,bf16}x2.f32: two float32 in one uint32 register, ``lo`` in the low half."""
    return bits(lo, dtype).astype(np.uint32) | (bits(hi, dtype).astype(np.uint32) << 16)


def unpack(reg, dtype):
    """The two 16-bit values of uint32 registers as float64: (low half, high half)."""
    reg = np.asarray(reg, np.uint32)
    half = lambda h: h.astype(np.uint16).view(dtype).astype(np.float64)  # noqa: E731
    return half(reg & 0xFFFF), half(reg >> 16)


def _once(count, what):
    assert (count == 1).all(), f"{what}: the lane map does not cover the tile exactly once"


def gather(regs, table, shape, dtype, step):
    """The matrix held by one warp's fragment registers: register (lane, r) holds (row, col)
    of ``table`` in its low half and (row, col) + ``step`` in its high half (16-bit values of
    ``dtype``), or one float32 value when ``dtype`` is None."""
    rows, cols = table
    out = np.zeros(shape)
    seen = np.zeros(shape, np.int64)
    if dtype is None:
        np.add.at(seen, (rows, cols), 1)
        out[rows, cols] = regs
    else:
        lo, hi = unpack(regs, dtype)
        for value, (dr, dc) in ((lo, (0, 0)), (hi, step)):
            np.add.at(seen, (rows + dr, cols + dc), 1)
            out[rows + dr, cols + dc] = value
    _once(seen, "gather")
    return out


def mma(a, b, c, dtype, maps=MAPS):
    """mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32 on one warp: a (32, 4) and
    b (32, 2) uint32, c (32, 4) float32 -> d (32, 4) float32 = A B + C."""
    t = tables(maps)
    am = gather(a, t["a"], (F.MMA_M, F.MMA_K), dtype, (0, 1))
    bm = gather(b, t["b"], (F.MMA_K, F.MMA_N), dtype, (1, 0))
    cm = gather(c, t["c"], (F.MMA_M, F.MMA_N), None, None)
    with np.errstate(invalid="ignore", over="ignore"):       # inf and NaN as the hardware
        d = (am @ bm + cm).astype(np.float32)
    return d[t["c"]]


def ldmatrix_x4(smem, offsets, trans=False, maps=MAPS):
    """ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: ``smem`` a uint16 tile image,
    ``offsets`` (32,) the element offset each lane supplies -> (32, 4) uint32."""
    t = tables(maps)
    offsets = np.asarray(offsets, np.int64).reshape(F.WARP)
    assert (offsets % F.CHUNK == 0).all(), "ldmatrix rows must be 16-byte aligned"
    mat, row = (x[:, 0] for x in t["src"])
    m8 = np.zeros((4, 8, 8), np.uint16)
    seen = np.zeros((4, 8), np.int64)
    np.add.at(seen, (mat, row), 1)
    _once(seen, "ldmatrix sources")
    m8[mat, row] = smem[offsets[:, None] + np.arange(F.CHUNK)]
    er, ec = t["trans" if trans else "plain"]
    regs = [m8[i][er[:, 0], ec[:, 0]].astype(np.uint32)
            | (m8[i][er[:, 1], ec[:, 1]].astype(np.uint32) << 16) for i in range(4)]
    return np.stack(regs, axis=1)


def quad_allreduce(x, op):
    """The value every lane of a quad agrees on after shfl.xor 1 and 2: x (32, ...)."""
    for m in (1, 2):
        x = op(x, x[LANES ^ m])
    return x


# ---------------------------------------------------------------------------------------------
# shared-memory tiles
# ---------------------------------------------------------------------------------------------

def stage(x, r0, nrows, valid, maps=MAPS):
    """The swizzled shared image (uint16, nrows x D) of rows [r0, r0 + nrows) of ``x``
    (16-bit, (S, D)), rows at or past ``valid`` zero-filled (cp.async with src-size 0)."""
    d = x.shape[1]
    img = np.zeros(nrows * d, np.uint16)
    rows = np.arange(nrows)[:, None]
    cols = np.arange(d)[None, :]
    offs = np.broadcast_to(maps.swizzle(rows, cols, d), (nrows, d))
    take = min(max(valid - r0, 0), nrows)
    img[offs[:take].ravel()] = x[r0:r0 + take].view(np.uint16).ravel()
    return img


def load_block(img, d, row0, col0, addr, trans, maps):
    """ldmatrix x4 of the 16x16 block at (row0, col0) of an image with ``d`` values per row,
    the lanes pointing as the ``addr`` table ("addr_a" or "addr_b") says."""
    r, c = (x[:, 0] for x in tables(maps)[addr])
    return ldmatrix_x4(img, maps.swizzle(row0 + r, col0 + c, d), trans, maps)


# ---------------------------------------------------------------------------------------------
# one warp: 16 query rows of one head
# ---------------------------------------------------------------------------------------------

def fa2_block(q, k, v, i0, ql, kl, pre_e, next_e, scale, discard=None, inner_precise=1,
              bkv=64, maps=MAPS):
    """Query rows [i0, i0 + 16) of one head as the tensor-core kernel computes them.

    q (Sq, D), k and v (Skv, D): float16 or bfloat16, D a multiple of 64; (ql, kl) the actual
    lengths, (pre_e, next_e) the band edges of ``numerics.band.band_edges``; ``discard`` an (Sq, Skv)
    bool user mask (True drops) or None; ``bkv`` kv columns per tile (a multiple of 16).
    Returns (out (16, D) float32 before the final rounding, lse (16,) float32)."""
    dtype, d = q.dtype, q.shape[1]
    assert dtype in DTYPES and d % 64 == 0 and bkv % 16 == 0
    t = tables(maps)
    crow, ccol = t["c"]
    qi = i0 + crow                                         # (32, 4) query row of each acc
    bands = [row_band(i0 + r, pre_e, next_e, kl) for r in range(ROWS)]
    lo, hi = (np.array([b[x] for b in bands], np.int64)[crow] for x in (0, 1))
    active = qi < ql
    c2 = np.float32(np.float32(scale) * LOG2E)             # the scale folded into exp2

    qimg = stage(q, i0, ROWS, q.shape[0], maps)
    qa = [load_block(qimg, d, 0, 16 * kk, "addr_a", False, maps) for kk in range(d // 16)]
    m = np.full((F.WARP, 2), -np.inf, np.float32)          # running max, per (lane, row half)
    l = np.zeros((F.WARP, 2), np.float32)                   # this lane's part of the row sum
    o = [np.zeros((F.WARP, 4), np.float32) for _ in range(d // 8)]
    jstart, jend = block_kv_range(i0, min(i0 + ROWS, ql), pre_e, next_e, kl)
    ntiles = -(-(jend - jstart) // bkv) if jend > jstart and i0 < ql else 0
    for tile in range(ntiles):
        j0 = jstart + tile * bkv
        kimg, vimg = stage(k, j0, bkv, jend, maps), stage(v, j0, bkv, jend, maps)
        # S = Q K^T, n-tiles of 8 keys in pairs (one ldmatrix x4 gives both B fragments)
        s = []
        for pair in range(bkv // 16):
            s0, s1 = np.zeros((F.WARP, 4), np.float32), np.zeros((F.WARP, 4), np.float32)
            for kk in range(d // 16):
                kb = load_block(kimg, d, 16 * pair, 16 * kk, "addr_b", False, maps)
                s0 = mma(qa[kk], kb[:, 0:2], s0, dtype, maps)
                s1 = mma(qa[kk], kb[:, 2:4], s1, dtype, maps)
            s += [s0, s1]
        # the band, the length and the user mask per accumulator; scores to log2 units
        tl = []
        for nt, sv in enumerate(s):
            j = j0 + 8 * nt + ccol
            keep = active & (j >= lo) & (j <= hi)
            if discard is not None:
                keep &= ~discard[np.minimum(qi, discard.shape[0] - 1),
                                 np.minimum(j, discard.shape[1] - 1)]
            with np.errstate(invalid="ignore", over="ignore"):
                tl.append(np.where(keep, sv * c2, np.float32(-np.inf)))
        p, m, l, o = _softmax_step(tl, m, l, o)
        # O += P V: P's A fragment from the S accumulators, V by ldmatrix.trans
        for kk in range(bkv // 16):
            pa = np.stack([pack(p[2 * kk + nt][:, i], p[2 * kk + nt][:, i + 1], dtype)
                           for nt, i in t["p"]], axis=1)
            for dp in range(d // 16):
                vb = load_block(vimg, d, 16 * kk, 16 * dp, "addr_a", True, maps)
                o[2 * dp] = mma(pa, vb[:, 0:2], o[2 * dp], dtype, maps)
                o[2 * dp + 1] = mma(pa, vb[:, 2:4], o[2 * dp + 1], dtype, maps)
    return _finish(o, m, quad_allreduce(l, np.add), v, i0, ql, kl, pre_e, next_e,
                   inner_precise, maps)


def _softmax_step(tl, m, l, o):
    """One tile's online softmax in a warp, from its scores in log2 units ``tl`` ((32, 4) an
    n-tile): the row maxima over the quad, the step of ``numerics.core.online_update_log2``, the
    weights exp2(t - m) and the rescaled sums and accumulators. Returns (p, m, l, o)."""
    half = np.array([0, 0, 1, 1])                          # row half of accumulator i (c rows)
    tmax = np.full((F.WARP, 2), -np.inf, np.float32)
    for tv in tl:
        for h in (0, 1):
            tmax[:, h] = np.maximum(tmax[:, h], np.maximum(tv[:, 2 * h], tv[:, 2 * h + 1]))
    m_new, shift, m_sub = _online_update(m, quad_allreduce(tmax, np.maximum))
    with np.errstate(invalid="ignore", over="ignore"):
        alpha = np.exp2(shift)
        p = [np.exp2(tv - m_sub[:, half]).astype(np.float32) for tv in tl]
    return p, m_new, _rescaled_sum(l, alpha, p), [ov * alpha[:, half] for ov in o]


def _online_update(m, tile_max):
    """numerics.core.online_update_log2, the kernel's online step, per lane and row half: (new max,
    rescale exponent, the value the weights subtract), each (32, 2)."""
    steps = [online_update_log2(a, b) for a, b in zip(m.ravel(), tile_max.ravel())]
    return tuple(np.array(x, np.float32).reshape(m.shape) for x in zip(*steps))


def _rescaled_sum(l, alpha, p):
    """l * alpha plus this lane's weights of the tile, per row half (c0 + c1, c2 + c3)."""
    part = np.zeros_like(l)
    for pv in p:
        part[:, 0] += pv[:, 0] + pv[:, 1]
        part[:, 1] += pv[:, 2] + pv[:, 3]
    return (l * alpha + part).astype(np.float32)


def _finish(o, m, l, v, i0, ql, kl, pre_e, next_e, inner_precise, maps):
    """The deferred division, the rows of contract 'Empty rows' and softmax_lse, each lane for its
    two rows (as the kernel does): (out (16, D), lse (16,))."""
    crow, ccol = tables(maps)["c"]
    out = np.zeros((ROWS, v.shape[1]), np.float32)
    lse = np.full(ROWS, -np.inf, np.float32)
    keep = np.zeros((F.WARP, 2), bool)                 # the lane's row is a softmax row
    denom = np.ones((F.WARP, 2), np.float32)
    for lane in range(F.WARP):
        for h in (0, 1):
            r = int(crow[lane, 2 * h])
            i = i0 + r
            outcome, mlo, mhi, dv = row_outcome(i < ql, m[lane, h], l[lane, h], inner_precise,
                                                i, pre_e, next_e, kl)
            keep[lane, h], denom[lane, h] = outcome == ROW_SOFTMAX, dv
            if outcome == ROW_SOFTMAX:
                lse[r] = lse_log2(m[lane, h], l[lane, h])
            elif outcome == ROW_MEAN:
                out[r] = v[mlo:mhi + 1].astype(np.float32).sum(axis=0) / np.float32(dv)
    for dt, ov in enumerate(o):
        for i in range(4):
            h = i >> 1
            sel = keep[:, h]
            out[crow[sel, i], 8 * dt + ccol[sel, i]] = ov[sel, i] / denom[sel, h]
    return out, lse


def attention(q, k, v, scale, sparse_mode=0, pre_tokens=2147483647, next_tokens=0,
              attn_mask=None, inner_precise=1, q_len=None, kv_len=None, bkv=64, maps=MAPS):
    """One head, every block of 16 rows: q (Sq, D), k and v (Skv, D) of float16 / bfloat16.
    ``attn_mask`` a bool discard mask of at least (Sq, Skv) (read by sparse modes 0 and 1
    only, as contract 'The user mask' says); the other arguments and defaults are the API's.
    Returns (out (Sq, D) in the input dtype, lse (Sq,) float32)."""
    sq, skv = q.shape[0], k.shape[0]
    ql, kl = (sq if q_len is None else q_len), (skv if kv_len is None else kv_len)
    pre_e, next_e = (int(e[0]) for e in band_edges(sparse_mode, attn_mask is not None,
                                                   pre_tokens, next_tokens,
                                                   np.array([ql]), np.array([kl])))
    discard = None
    if attn_mask is not None and sparse_mode in (0, 1):
        discard = np.asarray(attn_mask, bool)[:sq, :skv]
    out = np.zeros((sq, q.shape[1]), np.float32)
    lse = np.full(sq, -np.inf, np.float32)
    for i0 in range(0, sq, ROWS):
        o, ls = fa2_block(q, k, v, i0, ql, kl, pre_e, next_e, scale, discard, inner_precise,
                          bkv, maps)
        n = min(ROWS, sq - i0)
        out[i0:i0 + n], lse[i0:i0 + n] = o[:n], ls[:n]
    with np.errstate(under="ignore", over="ignore"):          # the kernel's final rounding
        return out.astype(q.dtype), lse


# ---------------------------------------------------------------------------------------------
# the split-kv decode kernel: one block of 4 warps a kv head, its 16 rows one mma tile
# ---------------------------------------------------------------------------------------------

def _per_row(x, maps):
    """A (32, 2) per-(lane, row half) value as (16,): the value of each C row (the four lanes
    of a quad agree, as the quad reductions leave them)."""
    crow = tables(maps)["c"][0]
    out = np.zeros(ROWS, np.float32)
    out[crow[:, 0]], out[crow[:, 2]] = x[:, 0], x[:, 1]
    return out


def _merge(ms, ls, accs):
    """The decode kernel's merge of states (m, l, acc) of the same rows over disjoint keys,
    each m (16,) in log2 units: every state rescaled by exp2 of ``online_update_log2``'s shift
    against the rows' max (0 for a state that kept nothing, NaN where the max is NaN)."""
    top = np.full(ROWS, -np.inf, np.float32)
    for m in ms:
        top = np.array([max_nan(a, b) for a, b in zip(top, m)], np.float32)
    l, acc = np.zeros(ROWS, np.float32), np.zeros_like(accs[0])
    for m, lv, av in zip(ms, ls, accs):
        with np.errstate(invalid="ignore", over="ignore"):
            f = np.exp2(np.array([online_update_log2(a, b)[1] for a, b in zip(m, top)],
                                 np.float32))
            l = (l + lv * f).astype(np.float32)
            acc = (acc + av * f[:, None]).astype(np.float32)
    return top, l, acc


def dequantize(x, channel_scale, channel_offset, token_scale, token_offset, dtype):
    """int8 kv rows x (L, D) as the kernels' int8 variants stage them: ``numerics.core.antiquant``
    in float32 with the channel pairs (D,) and the token pairs (L,), rounded to ``dtype``."""
    f32 = np.float32
    with np.errstate(over="ignore"):
        return antiquant(x.astype(f32), np.asarray(channel_scale, f32)[None],
                         np.asarray(channel_offset, f32)[None],
                         np.asarray(token_scale, f32).reshape(-1, 1),
                         np.asarray(token_offset, f32).reshape(-1, 1)).astype(dtype)


def decode_warp(q, k, v, lo, hi, j_tiles, w, c2, maps=MAPS):
    """Warp w of a decode block over the 64-key tiles starting at ``j_tiles``: its keys
    16w..16w+15 of each, S = Q K^T (K by plain ldmatrix), the band [lo, hi] per row (16,)
    per accumulator, the online softmax in log2 units, O += P V. q (16, D) and k, v (L, D) of
    one 16-bit dtype; ``c2`` the scale times log2 e. Returns the warp's (m, l, acc) per row."""
    dtype, d = q.dtype, q.shape[1]
    t = tables(maps)
    crow, ccol = t["c"]
    qa = [load_block(stage(q, 0, ROWS, ROWS, maps), d, 0, 16 * kk, "addr_a", False, maps)
          for kk in range(d // 16)]
    m = np.full((F.WARP, 2), -np.inf, np.float32)
    l = np.zeros((F.WARP, 2), np.float32)
    o = [np.zeros((F.WARP, 4), np.float32) for _ in range(d // 8)]
    for j0 in j_tiles:
        kimg = stage(k, j0, 64, k.shape[0], maps)
        vimg = stage(v, j0, 64, v.shape[0], maps)
        s = [np.zeros((F.WARP, 4), np.float32) for _ in range(2)]
        for kk in range(d // 16):
            kb = load_block(kimg, d, 16 * w, 16 * kk, "addr_b", False, maps)
            s = [mma(qa[kk], kb[:, 2 * n:2 * n + 2], s[n], dtype, maps) for n in range(2)]
        tl = []
        for n, sv in enumerate(s):
            j = j0 + 16 * w + 8 * n + ccol
            with np.errstate(invalid="ignore", over="ignore"):
                tl.append(np.where((j >= lo[crow]) & (j <= hi[crow]), sv * c2,
                                   np.float32(-np.inf)))
        p, m, l, o = _softmax_step(tl, m, l, o)
        pa = np.stack([pack(p[nt][:, i], p[nt][:, i + 1], dtype) for nt, i in t["p"]], axis=1)
        for dp in range(d // 16):
            vb = load_block(vimg, d, 16 * w, 16 * dp, "addr_a", True, maps)
            o[2 * dp] = mma(pa, vb[:, 0:2], o[2 * dp], dtype, maps)
            o[2 * dp + 1] = mma(pa, vb[:, 2:4], o[2 * dp + 1], dtype, maps)
    acc = np.zeros((ROWS, d), np.float32)
    for dt, ov in enumerate(o):
        acc[crow, 8 * dt + ccol] = ov
    return _per_row(m, maps), _per_row(quad_allreduce(l, np.add), maps), acc


def decode_group(q, k, v, rows, ql, kl, pre_e, next_e, scale, splits, inner_precise=1,
                 maps=MAPS):
    """One kv head's query rows as the decode kernel computes them: q (16, D) its rows
    (``rows`` (16,) their query row, or ql for idle rows), k and v (Skv, D) the kv sequence;
    the batch's kv range cut into ``splits`` runs of whole 64-key tiles, each run's four
    warps merged, then the runs merged and the rows finished (contract 'Empty rows').
    Returns (out (16, D) float32 before the final rounding, lse (16,) float32)."""
    c2 = np.float32(np.float32(scale) * LOG2E)
    bands = [row_band(i, pre_e, next_e, kl) if i < ql else (1, 0) for i in rows]
    lo, hi = (np.array([b[x] for b in bands], np.int64) for x in (0, 1))
    jstart, jend = block_kv_range(0, ql, pre_e, next_e, kl)
    ntiles = -(-(jend - jstart) // 64) if jend > jstart and ql > 0 else 0
    per = -(-ntiles // splits) if ntiles else 1
    k, v = k[:jend], v[:jend]                            # rows past the run: zero-filled
    pieces = []
    for sp in range(splits):
        tiles = [jstart + 64 * t for t in range(sp * per, min((sp + 1) * per, ntiles))]
        pieces.append(_merge(*zip(*[decode_warp(q, k, v, lo, hi, tiles, w, c2, maps)
                                    for w in range(4)])))
    m, l, acc = _merge(*zip(*pieces))
    out = np.zeros_like(acc)
    lse = np.full(ROWS, -np.inf, np.float32)
    for r, i in enumerate(rows):
        outcome, mlo, mhi, denom = row_outcome(i < ql, m[r], l[r], inner_precise, i, pre_e,
                                               next_e, kl)
        if outcome == ROW_SOFTMAX:
            out[r], lse[r] = acc[r] / denom, lse_log2(m[r], l[r])
        elif outcome == ROW_MEAN:
            out[r] = v[mlo:mhi + 1].astype(np.float32).sum(axis=0) / np.float32(denom)
    return out, lse
