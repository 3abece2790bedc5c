"""The CPU kernel against pfa_numba.reference over a seeded case matrix.

Tiles are patched to small odd sizes (from ``config``) so every case crosses several query and
kv tile edges; a few cases run at the default tiles too. The case matrix runs on both float32
product paths (register blocks and BLAS; on the BLAS path bf16 leaves AMX for it too).
"""
import itertools
import math
import warnings

import numpy as np
import pytest

from pfa_numba import config, prompt_flash_attention
from _cases import DTYPES, assert_matches_reference, case_id, qkv

LAYOUTS = ("BSH", "BNSD", "BSND", "BNSD_BSND")
MODES = ("0", "0m", "1", "2", "3", "4")
TOKENS = {"0m": [(2147483647, 0), (5, 3), (-2, 6), (10, -3), (2147483647, 2147483647)],
          "4": [(8, 4), (-3, 9), (20, -2), (0, 0), (2147483647, 5)]}
SIZES = [(1, 1), (37, 53), (97, 61), (13, 113), (64, 64), (5, 200)]
HEADS = [(4, 4), (4, 2), (4, 1), (6, 3)]
D_FLOAT = (16, 40, 64, 72, 128)
D_BF16 = (16, 64, 128)


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(config, "CPU_Q_ROWS", 12)
    monkeypatch.setattr(config, "CPU_KV_COLS", 7)


def _matrix():
    cases = []
    for idx, (dt, layout, mode) in enumerate(itertools.product(DTYPES, LAYOUTS, MODES)):
        n, nkv = HEADS[idx % len(HEADS)]
        sq, skv = SIZES[idx % len(SIZES)]
        ds = D_BF16 if dt == "bf16" else D_FLOAT
        d = ds[idx % len(ds)]
        b = 2
        tok = TOKENS.get(mode, [(2147483647, 0)])[idx % len(TOKENS.get(mode, [0]))]
        lens = idx % 3  # 0: none, 1: actual lengths (one zero), 2: broadcast length-1
        cases.append(pytest.param(dt, layout, mode, b, n, nkv, sq, skv, d, tok, lens,
                                  id=case_id(DTYPES[dt], layout, mode, b, n, n // nkv, sq, skv,
                                             d, f"-len{lens}")))
    return cases


def _call_args(rng, dt, layout, mode, b, n, nkv, sq, skv, d, tok, lens):
    dtype = DTYPES[dt]
    q, k, v = qkv(rng, layout, dtype, b, n, nkv, sq, skv, d)
    kw = dict(num_heads=n, num_key_value_heads=nkv if nkv != n else 0, input_layout=layout,
              scale_value=1.0 / np.sqrt(d), pre_tokens=tok[0], next_tokens=tok[1])
    mask = None
    if mode in ("0m", "1"):
        mask = rng.random((b, 1, sq, skv)) < 0.3
        mask[0, 0, sq // 2] = True          # a fully masked row
        kw["sparse_mode"] = 0 if mode == "0m" else 1
    elif mode in ("2", "3", "4"):
        mask = np.triu(np.ones((2048, 2048), dtype=bool), 1)
        kw["sparse_mode"] = int(mode)
    if lens == 1:
        kw["actual_seq_lengths"] = [max(sq - 3, 1), 0][:b]
        kw["actual_seq_lengths_kv"] = np.array([max(skv - 5, 0), skv // 2][:b])
    elif lens == 2:
        kw["actual_seq_lengths"] = (max(sq // 2, 1),)
        kw["actual_seq_lengths_kv"] = [max(skv - 1, 1)]
    return (q, k, v, mask), kw


@pytest.mark.parametrize("dt,layout,mode,b,n,nkv,sq,skv,d,tok,lens", _matrix())
def test_matrix_small_tiles(small_tiles, products, dt, layout, mode, b, n, nkv, sq, skv, d, tok,
                            lens):
    rng = np.random.default_rng(abs(hash((dt, layout, mode, sq, skv, d))) % 2 ** 32)
    args, kw = _call_args(rng, dt, layout, mode, b, n, nkv, sq, skv, d, tok, lens)
    copies = [None if a is None else a.copy() for a in args]
    out, lse = prompt_flash_attention(*args, **kw, return_softmax_lse=True)
    assert out.dtype == DTYPES[dt]
    assert_matches_reference(out, args, kw, DTYPES[dt], lse=lse)
    for a, c in zip(args, copies):      # inputs are never written
        if a is not None:
            assert np.array_equal(a.view(np.uint8), c.view(np.uint8))


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("mode", ["0", "2", "4"])
def test_default_tiles(dt, mode):
    """Default (large) tiles, problem bigger than one tile in both directions."""
    rng = np.random.default_rng(7)
    args, kw = _call_args(rng, dt, "BNSD", mode if mode != "4" else "4", 1, 4, 2, 300, 700, 64,
                          (100, 30), 0)
    out = prompt_flash_attention(*args, **kw)
    assert_matches_reference(out, args, kw, DTYPES[dt])


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("mode,tok,heads", [("0", (2147483647, 2147483647), (6, 2)),
                                            ("2", (2147483647, 0), (3, 1)),
                                            ("3", (2147483647, 0), (4, 2)),
                                            ("4", (40, 17), (6, 2)), ("0m", (-20, 90), (2, 2)),
                                            ("4", (0, 0), (1, 1))])
def test_tiles_cut_by_the_band_in_row_segments(monkeypatch, dt, mode, tok, heads):
    """Tiles the band cuts are computed in row segments, each over the columns its rows keep:
    segments of 32 rows that split the G heads of a query position, tiles of odd sizes; tiles
    inside the band in segments of 64 rows."""
    monkeypatch.setattr(config, "CPU_Q_ROWS", 150)
    monkeypatch.setattr(config, "CPU_KV_COLS", 97)
    monkeypatch.setattr(config, "CPU_SUB_ROWS", 1)       # rounded up to 32
    monkeypatch.setattr(config, "CPU_SEG_ROWS", 40)      # tiles inside the band: 64 rows
    monkeypatch.setattr(config, "CPU_AMX_SEG_ROWS", 33)
    monkeypatch.setattr(config, "CPU_BAND_TILE_MIN", 150)
    rng = np.random.default_rng(21)
    n, nkv = heads
    args, kw = _call_args(rng, dt, "BSND", mode, 2, n, nkv, 210, 260, 32, tok, 1)
    out, lse = prompt_flash_attention(*args, **kw, return_softmax_lse=True)
    assert_matches_reference(out, args, kw, DTYPES[dt], lse=lse)


def test_seed_example():
    q = k = v = np.ones((1, 16, 256, 16), dtype=np.float16)
    out = prompt_flash_attention(q, k, v, None, None, None, None, None, None, None, None, None,
                                 16, input_layout='BNSD')
    assert out.shape == (1, 16, 256, 16) and out.dtype == np.float16
    assert np.all(out == 1)
    # all-ones inputs give ones whichever columns a row keeps: the same shapes with random
    # inputs, where the band and the mask decide the output (default tiles). The README's
    # second call: Ascend's causal mask, sparse_mode 3 (Sq == Skv: row i keeps columns <= i).
    rng = np.random.default_rng(20)
    q, k, v = qkv(rng, "BNSD", np.float16, 1, 16, 16, 256, 256, 16)
    mask = np.triu(np.ones((2048, 2048), dtype=bool), 1)
    kw = dict(num_heads=16, input_layout="BNSD", sparse_mode=3, scale_value=0.25)
    out, lse = prompt_flash_attention(q, k, v, mask, **kw, return_softmax_lse=True)
    assert out.shape == (1, 16, 256, 16) and out.dtype == np.float16
    assert lse.shape == (1, 16, 256, 1) and lse.dtype == np.float32
    assert_matches_reference(out, (q, k, v, mask), kw, np.float16, lse=lse)
    assert np.array_equal(out[0, :, 0], v[0, :, 0])     # row 0 keeps column 0 alone
    # sparse_mode 0 with an explicit random bool mask and a band of pre 30, next 5 tokens
    user = rng.random((1, 1, 256, 256)) < 0.3
    kw = dict(num_heads=16, input_layout="BNSD", sparse_mode=0, scale_value=0.25,
              pre_tokens=30, next_tokens=5)
    out, lse = prompt_flash_attention(q, k, v, user, **kw, return_softmax_lse=True)
    assert_matches_reference(out, (q, k, v, user), kw, np.float16, lse=lse)


@pytest.mark.parametrize("shape", ["SqSkv", "BSqSkv", "1SqSkv", "B1SqSkv", "11SqSkv", "padded2",
                                   "padded4"])
@pytest.mark.parametrize("mdtype", [np.bool_, np.int8, np.uint8])
def test_mask_shapes_and_dtypes(small_tiles, shape, mdtype):
    rng = np.random.default_rng(3)
    b, n, sq, skv, d = 2, 2, 19, 23, 16
    q, k, v = qkv(rng, "BNSD", np.float32, b, n, n, sq, skv, d)
    base = rng.random((b, sq + 3, skv + 5)) < 0.4
    mask = {"SqSkv": base[0, :sq, :skv], "BSqSkv": base[:, :sq, :skv],
            "1SqSkv": base[:1, :sq, :skv], "B1SqSkv": base[:, None, :sq, :skv],
            "11SqSkv": base[:1, None, :sq, :skv], "padded2": base[0],
            "padded4": base[:, None]}[shape].astype(mdtype)
    kw = dict(num_heads=n, input_layout="BNSD", sparse_mode=1)
    out = prompt_flash_attention(q, k, v, mask, **kw)
    assert_matches_reference(out, (q, k, v, mask), kw, np.float32)


def test_float16_additive_mask(small_tiles):
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, "BSH", np.float16, 2, 2, 2, 11, 17, 16)
    mask = (rng.random((2, 11, 17)) < 0.3).astype(np.float16) * np.float16(0.5)
    kw = dict(num_heads=2, input_layout="BSH", sparse_mode=0, next_tokens=2147483647)
    with pytest.warns(DeprecationWarning):
        out, lse = prompt_flash_attention(q, k, v, mask, **kw, return_softmax_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert_matches_reference(out, (q, k, v, mask), kw, np.float16, lse=lse)


@pytest.mark.parametrize("batch_pse", [1, 2])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_pse_shift(small_tiles, batch_pse, dt):
    rng = np.random.default_rng(5)
    dtype = DTYPES[dt]
    q, k, v = qkv(rng, "BSND", dtype, 2, 4, 2, 21, 30, 16)
    pse = (rng.standard_normal((batch_pse, 4, 25, 33)) * 2).astype(np.float32)
    pse[0, 1, 3, :] = -np.inf               # a row whose every score is -inf: fully masked
    pse[0, 2, 4, 5] = -np.inf               # a single -inf score counts as masked
    pse = pse.astype(dtype)
    for ip in (0, 2):
        kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BSND", inner_precise=ip,
                  scale_value=0.3)
        out, lse = prompt_flash_attention(q, k, v, None, None, None, pse, **kw,
                                          return_softmax_lse=True)
        assert not np.isnan(out.astype(np.float32)).any()
        assert_matches_reference(out, (q, k, v, None, None, None, pse), kw, dtype, lse=lse)


@pytest.mark.parametrize("dt", list(DTYPES))
def test_inner_precise_fully_masked_rows(small_tiles, dt):
    rng = np.random.default_rng(6)
    dtype = DTYPES[dt]
    b, n, sq, skv, d = 2, 2, 9, 26, 16
    q, k, v = qkv(rng, "BNSD", dtype, b, n, n, sq, skv, d)
    mask = rng.random((b, sq, skv)) < 0.3
    mask[0, 2, :] = True      # fully masked row
    mask[1, 5, 3:20] = True   # fully masked within its band (band below covers [i-4, i+1])
    outs = {}
    for ip in range(4):
        kw = dict(num_heads=n, input_layout="BNSD", sparse_mode=0, pre_tokens=4, next_tokens=1,
                  inner_precise=ip)
        outs[ip], lse = prompt_flash_attention(q, k, v, mask, **kw, return_softmax_lse=True)
        assert_matches_reference(outs[ip], (q, k, v, mask), kw, dtype, lse=lse)
        assert np.isneginf(lse[0, :, 2, 0]).all()
    assert np.array_equal(outs[0].view(np.uint8), outs[1].view(np.uint8))
    assert np.array_equal(outs[2].view(np.uint8), outs[3].view(np.uint8))
    assert np.all(outs[2][0, :, 2].astype(np.float32) == 0)
    band_mean = v[0, :, 0:4].astype(np.float64).mean(axis=1)   # row 2: band = columns 0..3
    np.testing.assert_allclose(outs[0][0, :, 2].astype(np.float64), band_mean, rtol=1e-2,
                               atol=1e-2)


def test_rows_with_nothing_are_exact_zeros(small_tiles):
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, "BNSD", np.float16, 3, 2, 2, 10, 12, 16, spread=100.0)
    m = np.triu(np.ones((2048, 2048), bool), 1)
    # batch 0: qL = 4 (rows >= 4 zero); batch 1: kL = 0; batch 2: band empty for early rows
    out, lse = prompt_flash_attention(q, k, v, m, [4, 10, 10], [12, 0, 12], num_heads=2,
                                      input_layout="BNSD", sparse_mode=4, pre_tokens=1,
                                      next_tokens=-1 + 0, return_softmax_lse=True)
    o = out.astype(np.float32)
    assert np.all(o[0, :, 4:] == 0) and np.all(o[1] == 0)
    assert np.isneginf(lse[0, :, 4:]).all() and np.isneginf(lse[1]).all()
    assert not np.isnan(o).any()
    assert_matches_reference(out, (q, k, v, m, [4, 10, 10], [12, 0, 12]),
                             dict(num_heads=2, input_layout="BNSD", sparse_mode=4,
                                  pre_tokens=1, next_tokens=-1), np.float16)


def test_nan_in_masked_positions_does_not_leak(small_tiles):
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, "BNSD", np.float32, 1, 2, 2, 8, 20, 16)
    mask = np.zeros((8, 20), bool)
    mask[:, 13] = True
    k[0, :, 13] = np.nan
    v[0, :, 13] = np.inf
    kw = dict(num_heads=2, input_layout="BNSD", sparse_mode=1)
    out = prompt_flash_attention(q, k, v, mask, **kw)
    assert np.isfinite(out).all()
    assert_matches_reference(out, (q, k, v, mask), kw, np.float32)
    # beyond kL: never read
    k2, v2 = k.copy(), v.copy()
    k2[0, :, 13], v2[0, :, 13] = 0.5, 0.25
    k2[0, :, 15:] = np.nan
    v2[0, :, 15:] = np.nan
    out2 = prompt_flash_attention(q, k2, v2, None, None, [15], num_heads=2, input_layout="BNSD")
    assert np.isfinite(out2).all()


@pytest.mark.parametrize("dt", list(DTYPES))
def test_nan_scores_of_either_sign_reach_their_rows(products, dt):
    """Rows whose every score is NaN: from a NaN query row of either sign, and from inf * 0
    (the x86 default NaN has its sign bit set). Their output is NaN, not a masked row's."""
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, "BNSD", DTYPES[dt], 1, 2, 1, 9, 70, 16)
    q[0, 0, 1] = np.nan
    q[0, 0, 2] = -np.nan
    q[0, 1, 4, 0] = np.inf
    k[0, 0, :, 0] = 0
    kw = dict(num_heads=2, num_key_value_heads=1, input_layout="BNSD", scale_value=0.25)
    with np.errstate(invalid="ignore"):
        out = prompt_flash_attention(q, k, v, **kw)
    assert np.isnan(out[0, 0, 1:3]).all() and np.isnan(out[0, 1, 4]).all()
    assert_matches_reference(out, (q, k, v), kw, DTYPES[dt])


def test_nan_in_kept_position_reaches_only_its_rows(small_tiles):
    rng = np.random.default_rng(10)
    q, k, v = qkv(rng, "BNSD", np.float32, 1, 1, 1, 8, 20, 16)
    v[0, 0, 3, 0] = np.nan
    m = np.triu(np.ones((2048, 2048), bool), 1)
    kw = dict(num_heads=1, input_layout="BNSD", sparse_mode=2)   # row i keeps columns <= i
    out = prompt_flash_attention(q, k, v, m, **kw)
    assert np.isfinite(out[0, 0, :3]).all() and np.isnan(out[0, 0, 3:, 0]).all()
    assert np.isfinite(out[0, 0, :, 1:]).all()
    assert_matches_reference(out, (q, k, v, m), kw, np.float32)


@pytest.mark.parametrize("dt", list(DTYPES))
def test_strided_views_read_in_place(small_tiles, dt):
    """Sliced, strided and reversed views give bit-identical results to contiguous copies."""
    rng = np.random.default_rng(11)
    big = rng.standard_normal((2, 6, 40, 48)).astype(np.float32).astype(DTYPES[dt])
    q = big[:, ::3, 3:30, :32]                 # strided heads and rows, sliced D
    k = big[:, 1::3, ::-1, 16:48][:, :, :33]   # reversed rows
    v = np.asfortranarray(big[:, 2::3, 5:38, :32])
    kw = dict(num_heads=2, input_layout="BNSD")
    out = prompt_flash_attention(q, k, v, **kw)
    ref = prompt_flash_attention(*(np.ascontiguousarray(x) for x in (q, k, v)), **kw)
    assert np.array_equal(out.view(np.uint8), ref.view(np.uint8))
    assert_matches_reference(out, (q, k, v), kw, DTYPES[dt])


def test_flat_view_shares_memory():
    from pfa_numba.numerics.kernel_args import flat_view
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float16).reshape(2, 3, 4, 5)
    for view in (x, x[:, ::-1], x.transpose(0, 2, 1, 3), x[..., 1:4], x[:, :, ::-2]):
        flat, origin, strides = flat_view(view, np.uint16)
        assert np.shares_memory(flat, x) and not flat.flags.writeable
        idx = np.indices(view.shape).reshape(4, -1).T
        got = flat[origin + idx @ np.array(strides)].view(np.float16)
        assert np.array_equal(got, view.reshape(-1))


@pytest.mark.parametrize("tiles", [(1, 1), (3, 2), (5, 11), (64, 3), (1000, 1000)])
def test_tile_sizes_do_not_change_the_meaning(monkeypatch, tiles):
    monkeypatch.setattr(config, "CPU_Q_ROWS", tiles[0])
    monkeypatch.setattr(config, "CPU_KV_COLS", tiles[1])
    rng = np.random.default_rng(12)
    args, kw = _call_args(rng, "fp16", "BSH", "0m", 2, 4, 2, 23, 31, 16, (6, 2), 1)
    out, lse = prompt_flash_attention(*args, **kw, return_softmax_lse=True)
    assert_matches_reference(out, args, kw, np.float16, lse=lse)


def test_scale_value_and_lse(small_tiles):
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng, "BNSD", np.float32, 1, 2, 2, 7, 9, 16)
    for scale in (0, 1, -0.5, np.float16(0.25), np.int32(2), 7.5):
        kw = dict(num_heads=2, input_layout="BNSD", scale_value=scale)
        out, lse = prompt_flash_attention(q, k, v, **kw, return_softmax_lse=True)
        assert_matches_reference(out, (q, k, v), kw, np.float32, lse=lse)


def test_empty_sizes():
    z = np.zeros((0, 2, 5, 16), np.float16)
    k = np.zeros((0, 2, 7, 16), np.float16)
    assert prompt_flash_attention(z, k, k, num_heads=2, input_layout="BNSD").shape == (0, 2, 5, 16)
    q = np.ones((1, 2, 0, 16), np.float32)
    k = np.ones((1, 2, 7, 16), np.float32)
    out, lse = prompt_flash_attention(q, k, k, num_heads=2, input_layout="BNSD_BSND",
                                      return_softmax_lse=True)
    assert out.shape == (1, 0, 2, 16) and lse.shape == (1, 2, 0, 1)
    q = np.ones((1, 3, 32), np.float32)
    k = np.ones((1, 0, 32), np.float32)
    out, lse = prompt_flash_attention(q, k, k, num_heads=2, return_softmax_lse=True)
    assert out.shape == (1, 3, 32) and np.all(out == 0) and np.isneginf(lse).all()


@pytest.mark.parametrize("mode", [0, 2, 3, 4])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_tnd_packed_sequences(small_tiles, dt, mode):
    """Packed sequences (one empty, one with an empty kv range) against the reference."""
    rng = np.random.default_rng(14)
    dtype = DTYPES[dt]
    q_ends, kv_ends = [5, 5, 17, 40], [7, 7, 30, 31]
    q = rng.standard_normal((40, 4, 16)).astype(dtype)
    k = rng.standard_normal((31, 2, 16)).astype(dtype)
    v = rng.standard_normal((31, 2, 16)).astype(dtype)
    mask = None if mode == 0 else np.triu(np.ones((2048, 2048), bool), 1)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="TND", sparse_mode=mode,
              pre_tokens=3, next_tokens=1)
    out, lse = prompt_flash_attention(q, k, v, mask, q_ends, kv_ends, **kw,
                                      return_softmax_lse=True)
    assert out.shape == (40, 4, 16) and lse.shape == (40, 4, 1)
    assert_matches_reference(out, (q, k, v, mask, q_ends, kv_ends), kw, dtype, lse=lse)


# --------------------------------------------------------------------------------------------
# the band's last column (outside the case matrix): with every score equal (K = 0) and V one-hot
# per kv column (D = Skv), a row's output is 1 / |kept| at exactly its kept columns and 0
# elsewhere, so the output shows which columns were averaged
# --------------------------------------------------------------------------------------------
BIG = 2147483647        # pre/next_tokens at or above: +inf


def _band_ends(mode, pre, nxt, ql, kl):
    """(preE, nextE) of the table of contract 'The band' for one batch (floats; inf: unlimited)."""
    def tokens(t):
        return math.inf if t >= BIG else float(t)
    if mode == 0:                           # with a mask
        return tokens(pre), tokens(nxt)
    if mode == 2:
        return math.inf, 0.0
    if mode == 3:
        return math.inf, float(kl - ql)
    assert mode == 4
    return tokens(pre) - (kl - ql), tokens(nxt) + (kl - ql)


def _spec_band(sq, skv, ql, kl, pre_e, next_e, right=0, clip=0):
    """band(i, j) of contract 'The band' over (Sq, Skv), rows i < qL: 0 <= j < kL and
    i - preE <= j <= i + nextE. ``right`` / ``clip`` move the band's right edge / the kL clip
    by that many columns (the off-by-one implementations this test must catch)."""
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    return (i < ql) & (j < kl + clip) & (i - pre_e <= j) & (j <= i + next_e + right)


# mode, Sq, Skv, actual_seq_lengths, actual_seq_lengths_kv, pre_tokens, next_tokens, (N, Nkv),
# clip: some row's i + nextE reaches past kL - 1 < Skv - 1 (the clip decides its last column)
BAND_EDGE_CASES = [
    (0, 37, 29, [37, 30], [29, 22], 5, 3, (2, 2), True),
    (0, 37, 29, [37, 30], [29, 22], BIG, 6, (2, 1), True),
    (0, 30, 35, [30, 25], [35, 28], -2, 9, (1, 1), True),  # the band right of the diagonal
    (0, 41, 33, [41, 40], [33, 27], 10, -3, (3, 1), True),  # ... and left of it
    (2, 37, 30, [37, 33], [30, 22], BIG, 0, (2, 1), True),
    (3, 23, 40, [23, 17], [40, 33], BIG, 0, (2, 2), False),  # nextE = kL - qL > 0
    (3, 40, 23, [40, 31], [23, 19], BIG, 0, (2, 1), False),  # nextE < 0: early rows empty
    (4, 31, 45, [31, 26], [45, 38], 7, 2, (2, 1), True),
    (4, 45, 31, [45, 33], [31, 20], 4, 9, (1, 1), True),
    (4, 33, 47, [33, 29], [47, 41], -3, 6, (3, 3), True),
    (4, 27, 29, [27, 27], [29, 28], BIG, 0, (2, 1), False),
]


@pytest.fixture(params=["small tiles", "row segments"])
def band_tiles(request, small_tiles, monkeypatch):
    """Tiles of 12 query rows x 7 kv columns; or 7 columns with every query row in one work
    item, a tile the band cuts taken 32 rows at a time (row segments, each over the columns its
    rows keep)."""
    if request.param == "row segments":
        monkeypatch.setattr(config, "CPU_Q_ROWS", 150)
        monkeypatch.setattr(config, "CPU_SUB_ROWS", 1)       # rounded up to 32
        monkeypatch.setattr(config, "CPU_SEG_ROWS", 1)
        monkeypatch.setattr(config, "CPU_AMX_SEG_ROWS", 1)
    return request.param


@pytest.mark.parametrize("dt", ["fp32", "fp16"])
@pytest.mark.parametrize("mode,sq,skv,qlens,kvlens,pre,nxt,heads,clip", BAND_EDGE_CASES,
                         ids=[f"sm{c[0]}-Sq{c[1]}Skv{c[2]}-kL{c[4][1]}-pre{c[5]}-next{c[6]}"
                              .replace(str(BIG), "inf") for c in BAND_EDGE_CASES])
def test_band_last_column(band_tiles, dt, mode, sq, skv, qlens, kvlens, pre, nxt, heads,
                          clip):
    """A row's last kept column is hi = min(i + nextE, kL - 1) (contract 'The band'), whatever the
    tiles: the kept columns, read off the output, are the contract's, and not those of a band one
    column wider or narrower at its right edge, or clipped at kL instead of kL - 1."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng(sq * 100 + skv)
    b, (n, nkv), d = len(qlens), heads, skv
    q = rng.integers(-3, 4, (b, n, sq, d)).astype(dtype)          # any q: K = 0
    k = np.zeros((b, nkv, skv, d), dtype)                          # every score 0
    v = np.broadcast_to(np.eye(skv, dtype=dtype), (b, nkv, skv, d)).copy()   # V[j] = e_j
    keep = np.zeros((b, sq, skv), bool)
    more, fewer, at_kl = ("one column more at the right edge",
                          "one column fewer at the right edge", "the clip at kL, not kL - 1")
    wrong = {more: np.zeros_like(keep), fewer: np.zeros_like(keep), at_kl: np.zeros_like(keep)}
    if mode == 0:
        mask = rng.random((b, 1, sq, skv)) < 0.25
    else:
        mask = np.triu(np.ones((2048, 2048), bool), 1)
    for bb in range(b):
        ql, kl = qlens[bb], kvlens[bb]
        pre_e, next_e = _band_ends(mode, pre, nxt, ql, kl)
        band = _spec_band(sq, skv, ql, kl, pre_e, next_e)
        for i in range(ql):
            hi = min(i + next_e, kl - 1)
            lo = max(i - pre_e, 0)
            # an empty band (contract 'Empty rows')
            if hi < lo:
                assert not band[i].any()
                continue
            hi, lo = int(hi), int(lo)
            assert band[i].nonzero()[0].max() == hi and band[i].nonzero()[0].min() == lo
            if mode == 0:       # the user mask leaves both edges of the band (and beyond) kept
                mask[bb, 0, i, max(lo - 1, 0):lo + 1] = False
                mask[bb, 0, i, hi:hi + 2] = False
        user = ~mask[bb, 0] if mode == 0 else True
        keep[bb] = band & user
        wrong[more][bb] = _spec_band(sq, skv, ql, kl, pre_e, next_e, right=1) & user
        wrong[fewer][bb] = _spec_band(sq, skv, ql, kl, pre_e, next_e, right=-1) & user
        wrong[at_kl][bb] = _spec_band(sq, skv, ql, kl, pre_e, next_e, clip=1) & user
    # the case tells the contract's band from the wrong ones (the clip only where ``clip`` says)
    assert (wrong[more] != keep).any() and (wrong[fewer] != keep).any()
    assert (wrong[at_kl] != keep).any() == clip
    wrong = {what: w for what, w in wrong.items() if (w != keep).any()}

    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", sparse_mode=mode,
              pre_tokens=pre, next_tokens=nxt)
    args = (q, k, v, mask, qlens, kvlens)
    out, lse = prompt_flash_attention(*args, **kw, return_softmax_lse=True)
    ref = assert_matches_reference(out, args, kw, dtype, lse=lse)
    o = out.astype(np.float64)
    count = keep.sum(axis=-1)                                      # (B, Sq)
    want = np.where(count[..., None] > 0, keep / np.maximum(count, 1)[..., None], 0.0)
    for g in range(n):
        kept = o[:, g] > 0
        for what, w in wrong.items():
            assert not np.array_equal(kept, w), \
                f"head {g}: the kernel's band is the contract's with {what}"
        bad = np.argwhere((kept != keep).any(axis=-1))
        assert not bad.size, (f"head {g}: (b, i) = {bad[:3].tolist()} keep columns "
                              f"{[np.flatnonzero(kept[tuple(x)]).tolist() for x in bad[:3]]}, "
                              f"contract {[np.flatnonzero(keep[tuple(x)]).tolist() for x in bad[:3]]}")
        np.testing.assert_allclose(o[:, g], want, rtol=2e-3 if dt == "fp16" else 1e-6, atol=0)
        assert np.array_equal(ref[:, g] > 0, keep)                 # the reference agrees
        with np.errstate(divide="ignore"):
            np.testing.assert_allclose(lse[:, g, :, 0], np.log(count), rtol=1e-5, atol=1e-6)
