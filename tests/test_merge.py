"""merge_attention: results over disjoint kv ranges merge into the single call (contract
'softmax_lse and merging')."""
import ml_dtypes
import numpy as np
import pytest

from pfa_numba import config, merge_attention, prompt_flash_attention
from _cases import DTYPES, qkv

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(config, "CPU_Q_ROWS", 12)
    monkeypatch.setattr(config, "CPU_KV_COLS", 7)


def _cuts(skv, k, rng):
    """k uneven, non-empty-overall kv ranges covering [0, skv)."""
    inner = np.sort(rng.choice(np.arange(1, skv), size=k - 1, replace=False))
    return list(zip([0, *inner], [*inner, skv]))


def _kv_slice(x, layout, a, b):
    return x[:, a:b] if layout in ("BSH", "BSND") else x[:, :, a:b]


def _assert_merged_equals_single(merged, single, dtype):
    (mo, ml), (so, sl) = merged, single
    assert mo.dtype == so.dtype and mo.shape == so.shape and ml.shape == sl.shape
    assert np.array_equal(np.isneginf(ml), np.isneginf(sl))
    fin = np.isfinite(sl)
    np.testing.assert_allclose(ml[fin], sl[fin], rtol=1e-5, atol=1e-5)
    eps = float(ml_dtypes.finfo(dtype).eps)
    m64, s64 = mo.astype(np.float64), so.astype(np.float64)
    err = np.abs(m64 - s64).max()
    assert err <= 4 * eps * max(1.0, np.abs(s64).max()), f"merge differs by {err:.3e}"


@pytest.mark.parametrize("k", [2, 3, 7])
@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND", "BNSD_BSND"])
@pytest.mark.parametrize("mode", ["plain", "mask_band", "allmask"])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_split_and_merge(dt, mode, layout, k):
    rng = np.random.default_rng(k * 31 + len(layout))
    dtype = DTYPES[dt]
    b, n, nkv, sq, skv, d = 2, 4, 2, 13, 29, 16
    q, kk, v = qkv(rng, layout, dtype, b, n, nkv, sq, skv, d)
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout=layout, scale_value=0.3,
              inner_precise=2, return_softmax_lse=True)
    mask, pre, nxt = None, 2147483647, 0
    if mode == "mask_band":
        mask, pre, nxt = rng.random((b, sq, skv)) < 0.3, 6, 4
        kw["sparse_mode"] = 0
    elif mode == "allmask":
        mask = rng.random((sq, skv)) < 0.4
        mask[3] = True                                    # a row with nothing kept anywhere
        kw["sparse_mode"] = 1
    single = prompt_flash_attention(q, kk, v, mask, pre_tokens=pre, next_tokens=nxt, **kw)
    parts = []
    for a, e in _cuts(skv, k, rng):
        part_mask = None if mask is None else mask[..., a:e]
        # the band i - pre <= j <= i + next in part coordinates j' = j - a
        p_pre = pre if pre >= 2147483647 else pre + a
        parts.append(prompt_flash_attention(q, _kv_slice(kk, layout, a, e),
                                            _kv_slice(v, layout, a, e), part_mask,
                                            pre_tokens=p_pre, next_tokens=nxt - a
                                            if mask is not None and mode == "mask_band" else nxt,
                                            **kw))
    _assert_merged_equals_single(merge_attention(parts, input_layout=layout), single, dtype)


@pytest.mark.parametrize("k", [2, 3])
def test_split_and_merge_tnd(k):
    rng = np.random.default_rng(1)
    q_ends, kv_ends = np.array([5, 5, 17, 30]), np.array([9, 12, 20, 41])
    q = rng.standard_normal((30, 4, 16)).astype(np.float32)
    kk = rng.standard_normal((41, 2, 16)).astype(np.float32)
    v = rng.standard_normal((41, 2, 16)).astype(np.float32)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="TND", return_softmax_lse=True)
    single = prompt_flash_attention(q, kk, v, None, q_ends, kv_ends, **kw)
    starts = np.concatenate([[0], kv_ends[:-1]])
    parts = []
    for p in range(k):       # part p takes the p-th k-th of every sequence's kv rows
        idx, ends = [], []
        for s0, s1 in zip(starts, kv_ends):
            cut = np.linspace(s0, s1, k + 1).astype(int)
            idx.extend(range(cut[p], cut[p + 1]))
            ends.append(len(idx))
        parts.append(prompt_flash_attention(q, kk[idx], v[idx], None, q_ends, ends, **kw))
    _assert_merged_equals_single(merge_attention(parts, input_layout="TND"), single,
                                 np.float32)


def test_minus_inf_parts_weigh_zero_even_when_nan():
    o1 = np.full((1, 1, 2, 4), np.nan, np.float32)
    l1 = np.full((1, 1, 2, 1), -np.inf, np.float32)
    o2 = np.ones((1, 1, 2, 4), np.float32)
    l2 = np.array([[[[0.5], [-np.inf]]]], np.float32)
    out, lse = merge_attention([(o1, l1), (o2, l2)], input_layout="BNSD")
    assert np.array_equal(out[0, 0, 0], np.ones(4)) and lse[0, 0, 0, 0] == np.float32(0.5)
    assert np.array_equal(out[0, 0, 1], np.zeros(4)) and np.isneginf(lse[0, 0, 1, 0])


def test_bad_parts():
    with pytest.raises(ValueError, match="parts"):
        merge_attention([], input_layout="BNSD")
    o = np.zeros((1, 1, 2, 4), np.float32)
    l = np.zeros((1, 1, 2, 1), np.float32)
    with pytest.raises(ValueError, match="parts\\[1\\]"):
        merge_attention([(o, l), (o[..., :2], l)], input_layout="BNSD")
    with pytest.raises(ValueError, match="input_layout"):
        merge_attention([(o, l)], input_layout="XYZ")


@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_sinks_count_once_in_a_merge(dt, layout):
    """Parts computed without sinks, merged with them: the single call with sinks (the
    reference's), rows that keep nothing anywhere staying 0 with lse -inf."""
    from pfa_numba import reference
    rng = np.random.default_rng(5)
    dtype = DTYPES[dt]
    b, n, nkv, sq, skv, d = 2, 4, 2, 13, 29, 16
    q, kk, v = qkv(rng, layout, dtype, b, n, nkv, sq, skv, d)
    mask = rng.random((sq, skv)) < 0.4
    mask[3] = True
    sinks = np.array([-1.0, 0.5, 2.0, 6.0], np.float32)
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout=layout, scale_value=0.3,
              inner_precise=2, return_softmax_lse=True, sparse_mode=1)
    parts = [prompt_flash_attention(q, _kv_slice(kk, layout, a, e), _kv_slice(v, layout, a, e),
                                    mask[:, a:e], **kw) for a, e in _cuts(skv, 3, rng)]
    out, lse = merge_attention(parts, input_layout=layout, sinks=sinks)
    want, want_lse = reference.prompt_flash_attention(q, kk, v, mask, sinks=sinks, **kw)
    assert out.dtype == dtype and np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-5, atol=1e-5)
    eps = float(ml_dtypes.finfo(dtype).eps)
    assert np.abs(out.astype(np.float64) - want).max() <= 4 * eps * max(1.0, np.abs(want).max())
    plain, _ = merge_attention(parts, input_layout=layout)
    assert np.abs(plain.astype(np.float64) - out.astype(np.float64)).max() > 0.05


def test_merge_refuses_sinks_of_the_wrong_shape():
    o = np.zeros((1, 2, 3, 8), np.float32)
    lse = np.zeros((1, 2, 3, 1), np.float32)
    with pytest.raises(ValueError, match=r"one value a query head, shape \(2,\)"):
        merge_attention([(o, lse)], input_layout="BNSD", sinks=np.zeros(3, np.float32))
