"""The tensor-core kernel's maps and its NumPy warp model (no GPU needed).

* the fragment maps of pfa_numba.gpu.fragments equal the PTX ISA's layouts (stated again here,
  element by element, as the ISA writes them) and cover their tiles exactly once;
* the shared-memory swizzle is a permutation within each row and keeps every ldmatrix 8x8
  matrix (and every 8-lane phase of a cp.async store) on 8 different 16-byte bank groups;
* the modelled ldmatrix and mma give the ISA's fragments and A @ B + C;
* the modelled FA2 block equals pfa_numba.reference within the project's tolerance, for float16
  and bfloat16, head dims 64 and 128, kv tails, causal modes, user masks with fully masked rows;
* each check fails on a wrong map (test_a_wrong_map_fails_a_check).
"""
import subprocess
import sys

import numpy as np
import pytest

from _cases import BF16, assert_matches_reference
from pfa_numba.gpu import fragments as F
from pfa_numba.gpu import warp_model as W

DTYPES = {"fp16": np.dtype(np.float16), "bf16": BF16}


# ---------------------------------------------------------------------------------------------
# the PTX ISA's layouts, element by element (g = groupID, t = threadID_in_group)
# ---------------------------------------------------------------------------------------------

def isa_a(lane, e):
    """A (16x16) element a_e, e = 0..7 (register e // 2, half e % 2)."""
    g, t = divmod(lane, 4)
    row = g if e < 2 or 4 <= e < 6 else g + 8
    return row, t * 2 + (e & 1) + (8 if e >= 4 else 0)


def isa_b(lane, e):
    """B (16x8, K x N) element b_e, e = 0..3: (k, n)."""
    g, t = divmod(lane, 4)
    return t * 2 + (e & 1) + (8 if e >= 2 else 0), g


def isa_c(lane, e):
    """C / D (16x8) element c_e, e = 0..3."""
    g, t = divmod(lane, 4)
    return (g if e < 2 else g + 8), t * 2 + (e & 1)


def isa_ldsm(lane, e, trans):
    """ldmatrix: element e (0, 1) of each destination register of ``lane`` in its 8x8 matrix."""
    row, col = lane // 4, (lane % 4) * 2 + e
    return (col, row) if trans else (row, col)


def check_isa(maps):
    for lane in range(32):
        for e in range(8):
            row, col = maps.mma_a(lane, e // 2)
            assert (row, col + e % 2) == isa_a(lane, e), ("A", lane, e)
        for e in range(4):
            k, n = maps.mma_b(lane, e // 2)
            assert (k + e % 2, n) == isa_b(lane, e), ("B", lane, e)
            assert tuple(maps.mma_c(lane, e)) == isa_c(lane, e), ("C", lane, e)
        assert tuple(maps.ldsm_source(lane)) == divmod(lane, 8), ("ldmatrix source", lane)
        for e in range(2):
            for trans in (False, True):
                assert tuple(maps.ldsm_element(lane, e, trans)) == isa_ldsm(lane, e, trans)


def _covered(pairs, shape):
    count = np.zeros(shape, np.int64)
    for rc in pairs:
        count[rc] += 1
    return (count == 1).all()


def check_bijections(maps):
    lanes = range(32)
    assert _covered([(r, c + h) for ln in lanes for g in range(4)
                     for r, c in [maps.mma_a(ln, g)] for h in (0, 1)], (16, 16))
    assert _covered([(k + h, n) for ln in lanes for g in range(2)
                     for k, n in [maps.mma_b(ln, g)] for h in (0, 1)], (16, 8))
    assert _covered([tuple(maps.mma_c(ln, i)) for ln in lanes for i in range(4)], (16, 8))
    assert _covered([tuple(maps.ldsm_source(ln)) for ln in lanes], (4, 8))
    for trans in (False, True):
        assert _covered([tuple(maps.ldsm_element(ln, h, trans)) for ln in lanes
                         for h in (0, 1)], (8, 8))
    for addr in (maps.ldsm_a_addr, maps.ldsm_b_addr):
        assert _covered([(r, c + x) for ln in lanes for r, c in [addr(ln)]
                         for x in range(8)], (16, 16))


def test_fragment_maps_match_the_ptx_isa():
    check_isa(W.MAPS)


def test_fragment_maps_are_bijections():
    check_bijections(W.MAPS)


# ---------------------------------------------------------------------------------------------
# the swizzle
# ---------------------------------------------------------------------------------------------

def check_swizzle_permutation(maps, d, nrows=64):
    rows, cols = np.arange(nrows)[:, None], np.arange(d)[None, :]
    off = np.broadcast_to(maps.swizzle(rows, cols, d), (nrows, d))
    assert np.array_equal(np.sort(off, axis=1), rows * d + cols), "not a permutation of a row"
    chunks = off.reshape(nrows, d // 8, 8)
    assert (np.diff(chunks, axis=2) == 1).all() and (chunks[:, :, 0] % 8 == 0).all()


def check_conflict_free(maps, d, nrows=64):
    for addr in (maps.ldsm_a_addr, maps.ldsm_b_addr):
        for row0 in range(0, nrows, 16):
            for col0 in range(0, d, 16):
                groups = {}
                for lane in range(32):
                    r, c = addr(lane)
                    m, _ = maps.ldsm_source(lane)
                    off = int(maps.swizzle(row0 + r, col0 + c, d))
                    groups.setdefault(m, []).append(F.bank_group(off))
                for m, g in groups.items():
                    assert len(set(g)) == 8, f"ldmatrix bank conflict: matrix {m}, groups {g}"
    n_chunks = nrows * d // 8
    for first in range(0, n_chunks, 8):               # a 16-byte store: 8 lanes per phase
        g = {F.bank_group(int(maps.swizzle(*F.tile_chunk(i, d), d)))
             for i in range(first, first + 8)}
        assert len(g) == 8, f"cp.async store conflict at chunk {first}"


@pytest.mark.parametrize("d", [64, 128, 256])
def test_swizzle_is_a_permutation_of_each_row(d):
    check_swizzle_permutation(W.MAPS, d)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_swizzle_step_moves_by_constants(d):
    """What the kernel relies on to compute one address per lane: every (row, column) of a
    tile reached from the lane's base in the first 8 x 16 block by swizzle_step."""
    for row in range(8):
        for col in range(16):
            base = F.swizzle(row, col, d)
            for row_step in range(0, 64, 8):
                for col_step in range(0, d, 16):
                    assert (F.swizzle_step(base, row_step, col_step, d)
                            == F.swizzle(row + row_step, col + col_step, d))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_swizzle_has_no_bank_conflicts(d):
    check_conflict_free(W.MAPS, d)


# ---------------------------------------------------------------------------------------------
# ldmatrix and mma
# ---------------------------------------------------------------------------------------------

def _regs(mat, isa, nregs, dtype):
    """Registers of a fragment of ``mat`` laid out by the ISA function ``isa``."""
    regs = np.zeros((32, nregs), np.uint32)
    for lane in range(32):
        for r in range(nregs):
            regs[lane, r] = W.pack(mat[isa(lane, 2 * r)], mat[isa(lane, 2 * r + 1)], dtype)
    return regs


def check_mma(maps, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((16, 16)).astype(np.float32).astype(dtype)
    b = rng.standard_normal((16, 8)).astype(np.float32).astype(dtype)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    c_regs = np.array([[c[isa_c(ln, e)] for e in range(4)] for ln in range(32)], np.float32)
    d = W.mma(_regs(a, isa_a, 4, dtype), _regs(b, isa_b, 2, dtype), c_regs, dtype, maps)
    want = a.astype(np.float32) @ b.astype(np.float32) + c
    got = np.zeros((16, 8), np.float32)
    for ln in range(32):
        for e in range(4):
            got[isa_c(ln, e)] = d[ln, e]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dt", list(DTYPES))
def test_mma_model_is_a_times_b_plus_c(dt):
    check_mma(W.MAPS, DTYPES[dt])


def check_ldmatrix(maps, d=64, seed=1):
    """Blocks of a swizzled tile loaded as the kernel loads them give the ISA's fragments:
    Q (plain, A order) -> A; K (plain, B order) -> B of K^T for two n-tiles; V (.trans, A
    order) -> B of V for two n-tiles."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((32, d)).astype(np.float16)
    img = W.stage(x, 0, 32, 32, maps)
    for row0, col0 in [(0, 0), (16, 16), (16, d - 16)]:
        blk = x[row0:row0 + 16, col0:col0 + 16]
        got = W.load_block(img, d, row0, col0, "addr_a", False, maps)
        assert np.array_equal(got, _regs(blk, isa_a, 4, np.float16)), "Q -> A fragment"
        got = W.load_block(img, d, row0, col0, "addr_b", False, maps)
        for nt in (0, 1):
            kt = blk[8 * nt:8 * nt + 8].T                    # B[k, n] = K[n, k]
            assert np.array_equal(got[:, 2 * nt:2 * nt + 2], _regs(kt, isa_b, 2, np.float16))
        got = W.load_block(img, d, row0, col0, "addr_a", True, maps)
        for nt in (0, 1):
            vb = blk[:, 8 * nt:8 * nt + 8]                   # B[k, n] = V[k, n]
            assert np.array_equal(got[:, 2 * nt:2 * nt + 2], _regs(vb, isa_b, 2, np.float16))


def test_ldmatrix_model_gives_the_isa_fragments():
    check_ldmatrix(W.MAPS)


def test_pack_rounds_to_nearest_even_and_keeps_specials():
    x = np.array([1 + 2 ** -11, 1 + 3 * 2 ** -11, np.inf, -np.inf, np.nan, 65520.0], np.float32)
    lo, hi = W.unpack(W.pack(x, -x, np.float16), np.float16)
    assert lo[0] == 1.0 and lo[1] == 1 + 2 ** -9 and lo[2] == np.inf and np.isnan(lo[4])
    assert hi[3] == np.inf and lo[5] == np.inf and hi[0] == -1.0
    lo, _ = W.unpack(W.pack(np.float32([1 + 2 ** -8, 1 + 3 * 2 ** -8]), 0, BF16), BF16)
    assert lo[0] == 1.0 and lo[1] == 1 + 2 ** -6


# ---------------------------------------------------------------------------------------------
# the FA2 block against the reference
# ---------------------------------------------------------------------------------------------

def _mask(sq, skv, seed):
    rng = np.random.default_rng(seed)
    m = rng.random((sq, skv)) < 0.3
    m[5, :] = True                                    # a fully masked row
    m[9, 3:36] = True          # fully masked inside its band [5, 34] (mask-* cases), not outside
    return m


#: (Sq, Skv, extra reference kwargs, mask kind, bkv)
CASES = {
    "dense-tail": (16, 77, dict(), None, 32),
    "blocks": (37, 50, dict(), None, 64),
    "causal-right-down": (16, 45, dict(sparse_mode=3), "causal", 32),
    "causal-left-up": (16, 77, dict(sparse_mode=2), "causal", 32),
    "band": (16, 61, dict(sparse_mode=4, pre_tokens=20, next_tokens=3), "causal", 16),
    "lengths": (16, 77, dict(actual_seq_lengths=[13], actual_seq_lengths_kv=[50]), None, 32),
    "mask-ip0": (16, 40, dict(pre_tokens=4, next_tokens=25, inner_precise=0), "user", 32),
    "mask-ip2": (16, 40, dict(pre_tokens=4, next_tokens=25, inner_precise=2), "user", 32),
}


def run_case(name, dtype, d, maps=W.MAPS, seed=7):
    sq, skv, extra, mask_kind, bkv = CASES[name]
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 1, s, d)).astype(np.float32).astype(dtype)
               for s in (sq, skv, skv))
    mask = {"causal": np.triu(np.ones((2048, 2048), bool), 1), "user": _mask(sq, skv, seed),
            None: None}[mask_kind]
    scale = 1.0 / np.sqrt(d)
    extra = dict(extra)
    extra.setdefault("next_tokens", 2147483647)
    ql = extra.pop("actual_seq_lengths", [None])[0]
    kl = extra.pop("actual_seq_lengths_kv", [None])[0]
    out, lse = W.attention(q[0, 0], k[0, 0], v[0, 0], scale, attn_mask=mask, q_len=ql,
                           kv_len=kl, bkv=bkv, maps=maps, **extra)
    args = (q, k, v, mask, None if ql is None else [ql], None if kl is None else [kl])
    kw = dict(num_heads=1, input_layout="BNSD", scale_value=scale, **extra)
    assert_matches_reference(out[None, None], args, kw, dtype, lse=lse[None, None, :, None])
    return out, lse


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_fa2_block_matches_the_reference(dt, d, name):
    out, lse = run_case(name, DTYPES[dt], d)
    if name.startswith("mask"):
        assert np.isneginf(lse[5]) and np.isneginf(lse[9])
        if name == "mask-ip2":
            assert (out[[5, 9]].astype(np.float32) == 0).all()


def test_model_shows_nonfinite_v_needs_a_guard():
    """contract 'The computation': a dropped column contributes nothing, even an inf in V. Through
    the tensor cores it meets P = 0 (0 * inf = NaN), so the kernel must keep such V away from the
    mma."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((s, 64)).astype(np.float16) for s in (16, 16, 32))
    causal = np.triu(np.ones((2048, 2048), bool), 1)
    v[20, 0] = np.inf            # past the block's last kept column (15): staged as zeros
    out, _ = W.attention(q, k, v, 0.125, sparse_mode=2, attn_mask=causal)
    assert np.isfinite(out.astype(np.float32)).all()
    v[10, 0] = np.inf            # kept by rows >= 10, dropped by rows < 10
    out, _ = W.attention(q, k, v, 0.125, sparse_mode=2, attn_mask=causal)
    assert np.isnan(out[:10, 0].astype(np.float32)).all()   # the hazard, in rows 0..9


#: the decode kernel's model: (G heads, Sq rows a head, Skv, extra reference kwargs, splits)
DECODE_CASES = {
    "gqa": (4, 1, 200, dict(), 3),
    "lengths": (8, 1, 150, dict(actual_seq_lengths_kv=[70]), 2),
    "speculative-causal": (4, 4, 130, dict(sparse_mode=3), 2),
    "band": (2, 3, 100, dict(sparse_mode=4, pre_tokens=20, next_tokens=0), 2),
    "sliding-window-past-the-cache": (2, 2, 90, dict(sparse_mode=4, pre_tokens=300,
                                                     next_tokens=-200), 1),
    "no-kv": (4, 1, 64, dict(actual_seq_lengths_kv=[0]), 1),
}


def run_decode_case(name, dtype, d, maps=W.MAPS, seed=11):
    from pfa_numba.numerics.band import band_edges
    g, sq, skv, extra, splits = DECODE_CASES[name]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, g, sq, d)).astype(np.float32).astype(dtype)
    k, v = (rng.standard_normal((1, 1, skv, d)).astype(np.float32).astype(dtype)
            for _ in range(2))
    extra = dict(extra)
    extra.setdefault("next_tokens", 2147483647)
    mode = extra.get("sparse_mode", 0)
    mask = np.triu(np.ones((2048, 2048), bool), 1) if mode in (2, 3, 4) else None
    kl = extra.pop("actual_seq_lengths_kv", [skv])[0]
    pre_e, next_e = (int(e[0]) for e in band_edges(mode, mask is not None,
                                                   extra.get("pre_tokens", 2147483647),
                                                   extra["next_tokens"], np.array([sq]),
                                                   np.array([kl])))
    rows = np.array([r % sq if r < g * sq else sq for r in range(16)])
    q16 = np.zeros((16, d), dtype)
    q16[:g * sq] = q[0].reshape(g * sq, d)
    scale = 1.0 / np.sqrt(d)
    out, lse = W.decode_group(q16, k[0, 0], v[0, 0], rows, sq, kl, pre_e, next_e, scale,
                              splits, maps=maps)
    out = out[:g * sq].reshape(1, g, sq, d).astype(dtype)
    args = (q, k, v, mask, None, [kl])
    kw = dict(num_heads=g, num_key_value_heads=1, input_layout="BNSD", scale_value=scale,
              **extra)
    assert_matches_reference(out, args, kw, dtype, lse=lse[:g * sq].reshape(1, g, sq, 1))
    return out, lse


@pytest.mark.parametrize("name", list(DECODE_CASES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_decode_group_matches_the_reference(dt, d, name):
    """The decode kernel's warp-level steps (4 warps on a 16-key quarter of each tile, their
    states merged, then the splits merged) against the reference."""
    run_decode_case(name, DTYPES[dt], d)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_decode_group_over_an_int8_cache_matches_the_reference(dt, d):
    """An int8 cache (key: channel scales and offsets; value: token scales and offsets)
    staged as the int8 variants do (W.dequantize: float32, rounded to the query's type), then
    the decode kernel's warp steps, against fused_infer_attention_score's float64 reference:
    within twice the error of the reference computed in the query's type, plus an ulp."""
    from pfa_numba import reference
    dtype, g, skv, splits = DTYPES[dt], 4, 200, 3
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, g, 1, d)).astype(np.float32).astype(dtype)
    k8, v8 = (rng.integers(-128, 128, (1, 1, skv, d)).astype(np.int8) for _ in range(2))
    cs = (rng.random((1, 1, d)) * 0.02 + 0.005).astype(dtype)
    co = (rng.standard_normal((1, 1, d)) * 3).astype(dtype)
    vs = (rng.random((1, skv)) * 0.02 + 0.005).astype(np.float32)
    vo = (rng.standard_normal((1, skv)) * 3).astype(np.float32)
    kd = W.dequantize(k8[0, 0], cs.reshape(-1), co.reshape(-1), 1, 0, dtype)
    vd = W.dequantize(v8[0, 0], np.ones(d), np.zeros(d), vs[0], vo[0], dtype)
    rows = np.array([0 if r < g else 1 for r in range(16)])
    q16 = np.zeros((16, d), dtype)
    q16[:g] = q[0, :, 0]
    scale = 1.0 / np.sqrt(d)
    from pfa_numba.numerics.band import band_edges
    pre_e, next_e = (int(e[0]) for e in band_edges(0, False, 2147483647, 2147483647,
                                                   np.array([1]), np.array([skv])))
    out, lse = W.decode_group(q16, kd, vd, rows, 1, skv, pre_e, next_e, scale, splits)
    kw = dict(num_heads=g, num_key_value_heads=1, input_layout="BNSD", scale=scale,
              softmax_lse_flag=True, key_antiquant_mode=0, value_antiquant_mode=1,
              key_antiquant_scale=cs, key_antiquant_offset=co, value_antiquant_scale=vs,
              value_antiquant_offset=vo)
    ref, ref_lse = reference.fused_infer_attention_score(q, k8, v8, **kw)
    low, _ = reference.fused_infer_attention_score(q, k8, v8, **kw, compute_dtype=dtype)
    got = out[:g].astype(dtype).astype(np.float64).reshape(ref.shape)
    eps = float(np.finfo(np.float16).eps) if dtype == np.float16 else 2.0 ** -7
    bound = 2 * np.abs(low - ref).max() + (eps + 16 * 2.0 ** -23) * max(1.0, np.abs(ref).max())
    assert np.abs(got - ref).max() <= bound
    assert np.abs(lse[:g] - ref_lse.reshape(-1)).max() <= 1e-3 * max(1.0, np.abs(ref_lse).max())


# ---------------------------------------------------------------------------------------------
# every check can fail
# ---------------------------------------------------------------------------------------------

def _fa2(maps):
    run_case("mask-ip0", np.dtype(np.float16), 64, maps)


def _decode(maps):
    run_decode_case("speculative-causal", np.dtype(np.float16), 64, maps)


MUTATIONS = {
    "A a1<->a2": (dict(mma_a=lambda ln, r: F.mma_a(ln, (0, 2, 1, 3)[r])),
                  [check_isa, lambda m: check_mma(m, np.float16), _fa2]),
    "B b0<->b1": (dict(mma_b=lambda ln, r: F.mma_b(ln, 1 - r)),
                  [check_isa, lambda m: check_mma(m, BF16), _fa2]),
    "C c1<->c2": (dict(mma_c=lambda ln, i: F.mma_c(ln, (0, 2, 1, 3)[i])), [check_isa, _fa2]),
    "ldmatrix rows reversed": (dict(ldsm_source=lambda ln: (ln >> 3, 7 - (ln & 7))),
                               [check_isa, check_ldmatrix, _fa2]),
    "ldmatrix plain/trans swapped": (
        dict(ldsm_element=lambda ln, h, tr: F.ldsm_element(ln, h, not tr)),
        [check_isa, check_ldmatrix, _fa2]),
    "K loaded in A order": (dict(ldsm_b_addr=F.ldsm_a_addr), [check_ldmatrix, _fa2, _decode]),
    "V loaded in B order": (dict(ldsm_a_addr=F.ldsm_b_addr), [check_ldmatrix, _fa2, _decode]),
    "P from swapped S tiles": (dict(p_from_s=lambda r: (r & 1, 2 * (r >> 1))),
                               [_fa2, _decode]),
    "half of the A tile twice": (dict(mma_a=lambda ln, r: F.mma_a(ln, r & 1)),
                                 [check_bijections, check_isa]),
    "no swizzle": (dict(swizzle=lambda row, col, n: row * n + col),
                   [lambda m: check_conflict_free(m, 64)]),
    "swizzle by row % 4": (
        dict(swizzle=lambda row, col, n: row * n + ((((col >> 3) ^ (row & 3)) << 3) | (col & 7))),
        [lambda m: check_conflict_free(m, 128)]),
    "swizzle leaving the row": (
        dict(swizzle=lambda row, col, n: row * n + ((((col >> 3) ^ row) << 3) | (col & 7))),
        [lambda m: check_swizzle_permutation(m, 64), _fa2]),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_a_wrong_map_fails_a_check(name):
    change, checks = MUTATIONS[name]
    maps = W.MAPS._replace(**change)
    for check in checks:
        with pytest.raises((AssertionError, IndexError)):
            check(maps)


def test_importing_the_package_imports_no_ptx_and_no_numba_cuda():
    code = ("import sys, pfa_numba, pfa_numba.gpu.warp_model; "
            "assert 'pfa_numba.gpu.ptx' not in sys.modules; "
            "assert not any(m.startswith('numba.cuda') for m in sys.modules), 'numba.cuda'")
    subprocess.run([sys.executable, "-c", code], check=True)
