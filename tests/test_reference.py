"""Tests of pfa_numba.reference, the float64 meaning of prompt_flash_attention (docs/contract.md).

The reference is checked against numbers worked out by hand, ASCII pictures of the §4.1 band,
an independent row-by-row implementation with Python scalars, and identities that must hold
between calls (layouts, GQA, lse merging, inner_precise pairs).
"""

import math

import ml_dtypes
import numpy as np
import pytest

from pfa_numba.reference import keep_mask, prompt_flash_attention, trans_quant_param

INF = 2147483647
BF16 = ml_dtypes.bfloat16


def rng(seed=0):
    return np.random.default_rng(seed)


def randn(r, shape, dtype=np.float32):
    return r.standard_normal(shape).astype(dtype)


def bnsd(q, k, v, **kw):
    """Call the reference with BNSD arrays, N and Nkv taken from the shapes."""
    kw.setdefault("num_heads", q.shape[1])
    kw.setdefault("num_key_value_heads", k.shape[1])
    return prompt_flash_attention(q, k, v, input_layout="BNSD", **kw)


def picture(text):
    """ASCII picture -> bool array: 'x' kept, '.' dropped (one row per line)."""
    rows = [line.strip() for line in text.strip().splitlines()]
    return np.array([[c == "x" for c in row] for row in rows], dtype=bool)


def draw(mask):
    return "\n".join("".join("x" if c else "." for c in row) for row in mask)


def naive_row(q_row, k, v, scale, keep_row, bias_row=None):
    """One output row and its lse with Python scalars: an independent softmax formula.

    Returns (None, -inf) when nothing is kept.
    """
    cols = [j for j in range(k.shape[0]) if keep_row[j]]
    scores = {}
    for j in cols:
        s = scale * sum(float(a) * float(b) for a, b in zip(q_row, k[j]))
        if bias_row is not None:
            s += float(bias_row[j])
        if s != -math.inf:
            scores[j] = s
    if not scores:
        return None, -math.inf
    m = max(scores.values())
    w = {j: math.exp(s - m) for j, s in scores.items()}
    total = sum(w.values())
    out = [sum(w[j] * float(v[j, d]) for j in w) / total for d in range(v.shape[1])]
    return np.array(out), m + math.log(total)


# -----------------------------------------------------------------------------------------
# Tiny hand-computed cases
# -----------------------------------------------------------------------------------------

def test_two_columns_weights_quarter_three_quarters():
    # q = [1], k = [0], [1], scale = ln 3 -> scores [0, ln 3] -> exp [1, 3] -> weights [1/4, 3/4].
    # v = [4], [8] -> out = 4/4 + 8*3/4 = 7; lse = log(1 + 3) = ln 4.
    q = np.array([[[[1.0]]]], np.float32)
    k = np.array([[[[0.0], [1.0]]]], np.float32)
    v = np.array([[[[4.0], [8.0]]]], np.float32)
    out, lse = bnsd(q, k, v, scale_value=math.log(3), return_softmax_lse=True)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert out.shape == (1, 1, 1, 1) and lse.shape == (1, 1, 1, 1)
    np.testing.assert_allclose(out[0, 0, 0, 0], 7.0, rtol=1e-14)
    np.testing.assert_allclose(lse[0, 0, 0, 0], math.log(4), rtol=1e-14)


def _powers_of_two_case():
    # scale = ln 2, so exp(score) = 2 ** dot.
    # q0 = [1, 0]: dots with k = [0,0], [1,0], [2,1] are [0, 1, 2] -> weights [1, 2, 4] / 7
    # q1 = [0, 1]: dots [0, 0, 1] -> weights [1, 1, 2] / 4
    q = np.array([[[[1, 0], [0, 1]]]], np.float32)
    k = np.array([[[[0, 0], [1, 0], [2, 1]]]], np.float32)
    v = np.array([[[[7, 0], [0, 7], [7, 7]]]], np.float32)
    return q, k, v


def test_two_rows_three_columns_by_hand():
    q, k, v = _powers_of_two_case()
    out, lse = bnsd(q, k, v, scale_value=math.log(2), return_softmax_lse=True)
    # row 0: (1*[7,0] + 2*[0,7] + 4*[7,7]) / 7 = [35, 42] / 7 = [5, 6];  lse = log 7
    # row 1: (1*[7,0] + 1*[0,7] + 2*[7,7]) / 4 = [21, 21] / 4;           lse = log 4
    np.testing.assert_allclose(out[0, 0], [[5, 6], [5.25, 5.25]], rtol=1e-14)
    np.testing.assert_allclose(lse[0, 0, :, 0], [math.log(7), math.log(4)], rtol=1e-14)


def test_two_rows_causal_by_hand():
    q, k, v = _powers_of_two_case()
    mask = np.zeros((2048, 2048), bool)            # mode 2: content never read
    out, lse = bnsd(q, k, v, attn_mask=mask, sparse_mode=2, scale_value=math.log(2),
                    return_softmax_lse=True)
    # row 0 keeps column 0 only -> v0 = [7, 0], lse = score 0 = 0
    # row 1 keeps columns 0, 1 with weights 1, 1 -> [3.5, 3.5], lse = log 2
    np.testing.assert_allclose(out[0, 0], [[7, 0], [3.5, 3.5]], rtol=1e-14)
    np.testing.assert_allclose(lse[0, 0, :, 0], [0.0, math.log(2)], atol=1e-15)


def test_pse_added_after_scaling_by_hand():
    q, k, v = _powers_of_two_case()
    # pse = ln 2 * [[1, 0, -2], [0, 0, 0]]: row 0 exponents [0+1, 1, 2-2] -> weights [2, 2, 1]/5
    # -> (2*[7,0] + 2*[0,7] + [7,7]) / 5 = [21, 21] / 5.  Scaling by 2 must not touch pse:
    # scale 2 ln2 doubles dots, row 0 exponents [0+1, 2, 4-2] -> weights [2, 4, 4] / 10
    # -> (2*[7,0] + 4*[0,7] + 4*[7,7]) / 10 = [42, 56] / 10.
    pse = (math.log(2) * np.array([[[[1, 0, -2], [0, 0, 0]]]])).astype(np.float32)
    out = bnsd(q, k, v, pse_shift=pse, scale_value=math.log(2))
    np.testing.assert_allclose(out[0, 0, 0], [21 / 5, 21 / 5], rtol=1e-6)
    out = bnsd(q, k, v, pse_shift=pse, scale_value=2 * math.log(2))
    np.testing.assert_allclose(out[0, 0, 0], [4.2, 5.6], rtol=1e-6)


def test_random_against_independent_row_formula():
    r = rng(1)
    B, N, Sq, Skv, D = 2, 2, 5, 7, 3
    q, k, v = randn(r, (B, N, Sq, D)), randn(r, (B, N, Skv, D)), randn(r, (B, N, Skv, D))
    mask = r.random((B, 1, Sq, Skv)) < 0.3
    pse = randn(r, (1, N, Sq + 2, Skv + 1))
    out, lse = bnsd(q, k, v, attn_mask=mask, pse_shift=pse, scale_value=0.7, pre_tokens=3,
                    next_tokens=1, actual_seq_lengths=[5, 4], actual_seq_lengths_kv=[6, 7],
                    return_softmax_lse=True)
    for b in range(B):
        qL, kL = [5, 4][b], [6, 7][b]
        for n in range(N):
            for i in range(Sq):
                row = [(i < qL) and (j < kL) and (i - 3 <= j <= i + 1) and not mask[b, 0, i, j]
                       for j in range(Skv)]
                o, l = naive_row(q[b, n, i], k[b, n], v[b, n], 0.7, row, pse[0, n, i])
                if o is None:
                    continue
                np.testing.assert_allclose(out[b, n, i], o, rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(lse[b, n, i, 0], l, rtol=1e-12)


# -----------------------------------------------------------------------------------------
# keep_mask pictures (§4.1), each derived by hand from the table
# -----------------------------------------------------------------------------------------

MASK_CASES = [
    # (Sq, Skv, qL, kL, mode, pre, next, has_mask, picture)
    # mode 0 without mask: everything inside (qL, kL); pre/next ignored
    (3, 4, 3, 4, 0, 0, 0, False, """xxxx
                                    xxxx
                                    xxxx"""),
    (3, 4, 2, 3, 0, 1, -1, False, """xxx.
                                     xxx.
                                     ...."""),
    # mode 0 with mask, pre=1 next=0: i-1 <= j <= i
    (4, 4, 4, 4, 0, 1, 0, True, """x...
                                   xx..
                                   .xx.
                                   ..xx"""),
    # mode 0 default pre=+inf next=0 with a mask: causal j <= i (top-left anchored)
    (3, 5, 3, 5, 0, INF, 0, True, """x....
                                     xx...
                                     xxx.."""),
    # negative next: pre=2 next=-1: i-2 <= j <= i-1 (row 0 empty)
    (4, 4, 4, 4, 0, 2, -1, True, """....
                                    x...
                                    xx..
                                    .xx."""),
    # negative pre: pre=-1 next=2: i+1 <= j <= i+2
    (3, 5, 3, 5, 0, -1, 2, True, """.xx..
                                    ..xx.
                                    ...xx"""),
    # pre/next beyond 2147483647 are +inf
    (2, 3, 2, 3, 0, INF + 5, 2 ** 40, True, """xxx
                                              xxx"""),
    # mode 0 with mask, qL < Sq and kL < Skv, pre=0 next=1: i <= j <= i+1, i < 2, j < 2
    (3, 4, 2, 2, 0, 0, 1, True, """xx..
                                   .x..
                                   ...."""),
    # mode 1: whole (qL, kL) rectangle whatever pre/next
    (3, 4, 3, 4, 1, 0, 0, True, """xxxx
                                   xxxx
                                   xxxx"""),
    (4, 3, 2, 2, 1, -5, -5, True, """xx.
                                     xx.
                                     ...
                                     ..."""),
    # mode 2: j <= i, top-left, pre/next ignored
    (3, 5, 3, 5, 2, 0, 7, True, """x....
                                   xx...
                                   xxx.."""),
    (3, 5, 3, 2, 2, 0, 0, True, """x....
                                   xx...
                                   xx..."""),
    (5, 3, 5, 3, 2, 0, 0, True, """x..
                                   xx.
                                   xxx
                                   xxx
                                   xxx"""),
    # mode 3: j <= i + (kL - qL), bottom-right anchored
    (3, 5, 3, 5, 3, 0, 0, True, """xxx..
                                   xxxx.
                                   xxxxx"""),
    (5, 3, 5, 3, 3, 0, 0, True, """...
                                   ...
                                   x..
                                   xx.
                                   xxx"""),
    # Sq=4, Skv=6 padded, actual qL=3, kL=4: nextE = 1, j <= i+1, j < 4, i < 3
    (4, 6, 3, 4, 3, 0, 0, True, """xx....
                                   xxx...
                                   xxxx..
                                   ......"""),
    # mode 4, pre=1 next=1, kL-qL=2: preE=-1, nextE=3: i+1 <= j <= i+3
    (4, 6, 4, 6, 4, 1, 1, True, """.xxx..
                                   ..xxx.
                                   ...xxx
                                   ....xx"""),
    # mode 4 with padding: qL=2, kL=3, offset 1, pre=2 next=0: preE=1, nextE=1
    (4, 5, 2, 3, 4, 2, 0, True, """xx...
                                   xxx..
                                   .....
                                   ....."""),
    # mode 4 negative next: pre=3 next=-1, square: i-3 <= j <= i-1
    (4, 4, 4, 4, 4, 3, -1, True, """....
                                    x...
                                    xx..
                                    xxx."""),
    # mode 4 Sq > Skv: qL=4, kL=2, offset -2, pre=1 next=0: preE=3, nextE=-2: i-3 <= j <= i-2
    (4, 2, 4, 2, 4, 1, 0, True, """..
                                   ..
                                   x.
                                   xx"""),
    # mode 4 with pre=+inf, next=0 is mode 3
    (3, 5, 3, 5, 4, INF, 0, True, """xxx..
                                     xxxx.
                                     xxxxx"""),
    # kL = 0: nothing
    (2, 3, 2, 0, 0, INF, 0, False, """...
                                      ..."""),
]


@pytest.mark.parametrize("case", MASK_CASES, ids=[f"c{i}" for i in range(len(MASK_CASES))])
def test_keep_mask_pictures(case):
    Sq, Skv, qL, kL, mode, pre, nxt, has_mask, pic = case
    got = keep_mask(Sq, Skv, qL, kL, sparse_mode=mode, pre_tokens=pre, next_tokens=nxt,
                    has_mask=has_mask)
    want = picture(pic)
    assert got.dtype == bool and got.shape == (Sq, Skv)
    assert np.array_equal(got, want), f"got\n{draw(got)}\nwant\n{draw(want)}"


def test_keep_mask_with_user_mask():
    user = picture("""x..x.
                      .x...
                      .....""")                      # here 'x' = discard
    # mode 0, causal band (pre inf, next 0) minus the user mask
    got = keep_mask(3, 5, 3, 5, 0, INF, 0, user_mask=user)
    assert draw(got) == draw(picture(""".....
                                        x....
                                        xxx..""")), draw(got)
    # mode 1: full rectangle minus the user mask; padded user mask uses the window
    padded = np.ones((4, 7), bool)
    padded[:3, :5] = user
    got = keep_mask(3, 5, 3, 4, 1, user_mask=padded)
    assert draw(got) == draw(picture(""".xx..
                                        x.xx.
                                        xxxx.""")), draw(got)
    # modes 2/3/4 never read a mask
    for mode in (2, 3, 4):
        assert np.array_equal(keep_mask(3, 5, 3, 5, mode, INF, 0, True, user_mask=user),
                              keep_mask(3, 5, 3, 5, mode, INF, 0, True))


def test_keep_mask_used_by_operator_for_every_mode():
    # the operator's keep set (score finite, weights > 0) matches keep_mask, via lse
    r = rng(2)
    Sq, Skv, D = 4, 6, 2
    q, k, v = randn(r, (1, 1, Sq, D)), randn(r, (1, 1, Skv, D)), randn(r, (1, 1, Skv, D))
    big = np.zeros((2048, 2048), np.uint8)
    for mode, pre, nxt in [(2, 0, 0), (3, 0, 0), (4, 2, 1), (4, 1, -1)]:
        _, lse = bnsd(q, k, v, attn_mask=big, sparse_mode=mode, pre_tokens=pre,
                      next_tokens=nxt, actual_seq_lengths=[3], actual_seq_lengths_kv=[5],
                      return_softmax_lse=True)
        keep = keep_mask(Sq, Skv, 3, 5, mode, pre, nxt, True)
        for i in range(Sq):
            _, l = naive_row(q[0, 0, i], k[0, 0], v[0, 0], 1.0, keep[i])
            np.testing.assert_allclose(lse[0, 0, i, 0], l, rtol=1e-12)


# -----------------------------------------------------------------------------------------
# §5: rows with nothing to attend to
# -----------------------------------------------------------------------------------------

def test_rows_beyond_qL_are_zero_and_match_truncated_call():
    r = rng(3)
    q, k, v = randn(r, (2, 2, 5, 4)), randn(r, (2, 2, 6, 4)), randn(r, (2, 2, 6, 4))
    q[:, :, 3:] = np.nan                        # rows >= qL are never read
    k[1, :, 4:] = np.inf                        # kv rows >= kL are never read
    v[1, :, 4:] = np.nan
    out, lse = bnsd(q, k, v, actual_seq_lengths=[3], actual_seq_lengths_kv=[6, 4],
                    return_softmax_lse=True)
    assert np.all(out[:, :, 3:] == 0) and np.all(lse[:, :, 3:] == -np.inf)
    for b, kL in enumerate([6, 4]):
        o2, l2 = bnsd(q[b:b + 1, :, :3], k[b:b + 1, :, :kL], v[b:b + 1, :, :kL],
                      return_softmax_lse=True)
        np.testing.assert_allclose(out[b:b + 1, :, :3], o2, rtol=1e-13)
        np.testing.assert_allclose(lse[b:b + 1, :, :3], l2, rtol=1e-13)


def test_empty_band_rows_are_zero():
    r = rng(4)
    q, k, v = randn(r, (1, 1, 4, 2)), randn(r, (1, 1, 4, 2)), randn(r, (1, 1, 4, 2))
    mask = np.zeros((4, 4), bool)
    # pre=2, next=-1: row 0's band i-2 <= j <= -1 is empty
    for ip in range(4):
        out, lse = bnsd(q, k, v, attn_mask=mask, pre_tokens=2, next_tokens=-1,
                        inner_precise=ip, return_softmax_lse=True)
        assert np.all(out[0, 0, 0] == 0) and lse[0, 0, 0, 0] == -np.inf
        assert np.all(np.isfinite(lse[0, 0, 1:]))
    # mode 3 with Sq > Skv: rows i < qL - kL have an empty band
    big = np.ones((2048, 2048), bool)
    out, lse = bnsd(q, k[:, :, :2], v[:, :, :2], attn_mask=big, sparse_mode=3,
                    inner_precise=1, return_softmax_lse=True)
    assert np.all(out[0, 0, :2] == 0) and np.all(lse[0, 0, :2] == -np.inf)
    np.testing.assert_allclose(out[0, 0, 2], v[0, 0, 0], rtol=1e-7)   # single column


def test_kv_length_zero_and_empty_sizes():
    r = rng(5)
    q, k, v = randn(r, (2, 3, 8)), randn(r, (2, 4, 8)), randn(r, (2, 4, 8))
    out, lse = prompt_flash_attention(q, k, v, actual_seq_lengths_kv=[0, 4], num_heads=2,
                                      return_softmax_lse=True)
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)
    assert np.all(np.isfinite(out[1]))
    # Skv = 0
    out = prompt_flash_attention(q, k[:, :0], v[:, :0], num_heads=2)
    assert out.shape == (2, 3, 8) and np.all(out == 0)
    # B = 0, Sq = 0
    assert prompt_flash_attention(q[:0], k[:0], v[:0], num_heads=2).shape == (0, 3, 8)
    o, l = prompt_flash_attention(q[:, :0], k, v, num_heads=2, return_softmax_lse=True)
    assert o.shape == (2, 0, 8) and l.shape == (2, 2, 0, 1)


@pytest.mark.parametrize("ip", [0, 1, 2, 3])
def test_fully_masked_row(ip):
    r = rng(6)
    q, k, v = randn(r, (1, 1, 4, 3)), randn(r, (1, 1, 5, 3)), randn(r, (1, 1, 5, 3))
    mask = np.zeros((1, 4, 5), np.int8)
    mask[0, 2, :] = 1                            # row 2: every column discarded
    # default pre=+inf next=0 with a mask: band of row 2 is columns 0..2
    out, lse = bnsd(q, k, v, attn_mask=mask, inner_precise=ip, return_softmax_lse=True)
    assert lse[0, 0, 2, 0] == -np.inf
    if ip in (0, 1):
        np.testing.assert_allclose(out[0, 0, 2], v[0, 0, :3].astype(np.float64).mean(0),
                                   rtol=1e-14)
    else:
        assert np.all(out[0, 0, 2] == 0)
    # other rows: ordinary causal attention
    for i in (0, 1, 3):
        o, l = naive_row(q[0, 0, i], k[0, 0], v[0, 0], 1.0, [j <= i for j in range(5)])
        np.testing.assert_allclose(out[0, 0, i], o, rtol=1e-12)


def test_inner_precise_pairs_identical():
    r = rng(7)
    q, k, v = randn(r, (1, 2, 5, 4), np.float16), randn(r, (1, 2, 6, 4), np.float16), \
        randn(r, (1, 2, 6, 4), np.float16)
    mask = r.random((5, 6)) < 0.5
    mask[1] = True
    res = [bnsd(q, k, v, attn_mask=mask, inner_precise=ip, pre_tokens=3, next_tokens=2)
           for ip in range(4)]
    assert np.array_equal(res[0], res[1]) and np.array_equal(res[2], res[3])
    assert not np.array_equal(res[1], res[2])


def test_minus_inf_pse_counts_as_masked():
    r = rng(8)
    q, k, v = randn(r, (1, 2, 3, 4)), randn(r, (1, 2, 5, 4)), randn(r, (1, 2, 5, 4))
    discard = np.zeros((3, 5), bool)
    discard[0, [1, 3]] = True
    discard[2, :] = True                         # fully masked row
    pse = np.where(discard, -np.inf, 0).astype(np.float32)[None, None].repeat(2, axis=1)
    for ip in range(4):
        a, la = bnsd(q, k, v, pse_shift=pse, inner_precise=ip, return_softmax_lse=True)
        b, lb = bnsd(q, k, v, attn_mask=discard, pre_tokens=INF, next_tokens=INF,
                     inner_precise=ip, return_softmax_lse=True)
        np.testing.assert_allclose(a, b, rtol=1e-14)
        assert np.array_equal(la, lb)
        assert la[0, 0, 2, 0] == -np.inf
    # fully -inf row under inner_precise 1 is the mean of V over the band (all columns here)
    a = bnsd(q, k, v, pse_shift=pse, inner_precise=1)
    np.testing.assert_allclose(a[0, :, 2], v[0].astype(np.float64).mean(1), rtol=1e-14)


def test_nan_in_masked_v_does_not_leak():
    r = rng(9)
    q, k, v = randn(r, (1, 1, 3, 2)), randn(r, (1, 1, 4, 2)), randn(r, (1, 1, 4, 2))
    v[0, 0, 3] = np.nan
    k[0, 0, 3] = np.inf
    mask = np.zeros((3, 4), bool)
    mask[0, 3] = mask[1, 3] = True               # column 3 kept only by row 2
    out = bnsd(q, k, v, attn_mask=mask, next_tokens=INF)
    for i in (0, 1):
        o, _ = naive_row(q[0, 0, i], k[0, 0], v[0, 0], 1.0, [True, True, True, False])
        np.testing.assert_allclose(out[0, 0, i], o, rtol=1e-12)
    assert np.all(np.isnan(out[0, 0, 2]))
    # a fully masked row under inner_precise 1 reads V on its band: NaN reaches it (contract 'Empty
    # rows')
    mask[1] = True
    out = bnsd(q, k, v, attn_mask=mask, next_tokens=INF, inner_precise=1)
    assert np.all(np.isnan(out[0, 0, 1])) and np.all(np.isfinite(out[0, 0, 0]))
    out = bnsd(q, k, v, attn_mask=mask, next_tokens=INF, inner_precise=2)
    assert np.all(out[0, 0, 1] == 0)


def test_plus_inf_or_nan_kept_score_makes_row_nan():
    q = np.ones((1, 1, 2, 1), np.float32)
    k = np.ones((1, 1, 3, 1), np.float32)
    v = np.ones((1, 1, 3, 1), np.float32)
    pse = np.zeros((1, 1, 2, 3), np.float32)
    pse[0, 0, 0, 1] = np.inf
    pse[0, 0, 1, 2] = np.nan
    out, lse = bnsd(q, k, v, pse_shift=pse, return_softmax_lse=True)
    assert np.isnan(out).all() and np.isnan(lse).all()
    # masked away, the same scores are harmless
    mask = np.zeros((2, 3), bool)
    mask[0, 1] = mask[1, 2] = True
    out = bnsd(q, k, v, pse_shift=pse, attn_mask=mask, next_tokens=INF)
    np.testing.assert_allclose(out, 1.0, rtol=1e-15)


# -----------------------------------------------------------------------------------------
# fp16 additive mask (§4.2)
# -----------------------------------------------------------------------------------------

def test_float16_mask_is_additive():
    r = rng(10)
    q, k, v = randn(r, (1, 1, 3, 4), np.float16), randn(r, (1, 1, 4, 4), np.float16), \
        randn(r, (1, 1, 4, 4), np.float16)
    mask = np.array([[0, 0.001, 0, 0.0003], [1, 1, 1, 1], [0, 1, 0, 0]], np.float16)
    out, lse = bnsd(q, k, v, attn_mask=mask, next_tokens=INF, return_softmax_lse=True)
    for i in range(3):
        bias = [float(np.float32(-10000.0) * np.float32(m)) for m in mask[i]]
        o, l = naive_row(q[0, 0, i], k[0, 0], v[0, 0], 1.0, [True] * 4, bias)
        np.testing.assert_allclose(out[0, 0, i], o, rtol=1e-9)
        np.testing.assert_allclose(lse[0, 0, i, 0], l, rtol=1e-12)
    # a row of ones shifts every score equally: same output as no mask (nothing removed)
    plain = bnsd(q, k, v)
    np.testing.assert_allclose(out[0, 0, 1], plain[0, 0, 1], rtol=1e-9)


# -----------------------------------------------------------------------------------------
# softmax_lse and merging (§9)
# -----------------------------------------------------------------------------------------

def merge(parts):
    """§9 merge of (o, lse) parts over disjoint kv ranges."""
    lses = [l for _, l in parts]
    lse = lses[0]
    for l in lses[1:]:
        lse = np.logaddexp(lse, l)
    o = np.zeros_like(parts[0][0])
    for op, lp in parts:
        with np.errstate(invalid="ignore"):
            w = np.where(lp == -np.inf, 0.0, np.exp(lp - np.where(lse == -np.inf, 0, lse)))
        o = o + np.where(w > 0, op * w, 0.0)
    return o, lse


def test_lse_merge_over_disjoint_kv_ranges_equals_single_call():
    r = rng(11)
    B, N, Sq, Skv, D = 2, 2, 6, 9, 4
    q, k, v = randn(r, (B, N, Sq, D)), randn(r, (B, N, Skv, D)), randn(r, (B, N, Skv, D))
    mask = r.random((B, 1, Sq, Skv)) < 0.4
    mask[0, 0, 1, :4] = True                     # row kept only in the second part
    mask[0, 0, 2, 4:] = True                     # row kept only in the first part
    mask[1, 0, 3, :] = True                      # row kept nowhere
    pse = randn(r, (B, N, Sq, Skv))
    kw = dict(sparse_mode=1, scale_value=0.5, return_softmax_lse=True)
    full_o, full_l = bnsd(q, k, v, attn_mask=mask, pse_shift=pse, **kw)
    parts = [bnsd(q, k[:, :, a:b], v[:, :, a:b], attn_mask=mask[..., a:b],
                  pse_shift=np.ascontiguousarray(pse[..., a:b]), **kw)
             for a, b in [(0, 4), (4, Skv)]]
    assert parts[0][1][0, 0, 1, 0] == -np.inf and parts[1][1][0, 0, 2, 0] == -np.inf
    o, l = merge(parts)
    has_mass = np.isfinite(full_l)[..., 0]
    assert not has_mass[1, 0, 3]
    np.testing.assert_allclose(l, full_l, rtol=1e-13)
    np.testing.assert_allclose(o[has_mass], full_o[has_mass], rtol=1e-12, atol=1e-13)
    assert np.all(o[~has_mass] == 0)


def test_lse_matches_log_sum_exp():
    r = rng(12)
    q, k, v = randn(r, (1, 3, 4, 5)), randn(r, (1, 3, 6, 5)), randn(r, (1, 3, 6, 5))
    _, lse = bnsd(q, k, v, scale_value=0.3, return_softmax_lse=True)
    s = 0.3 * np.einsum("bnid,bnjd->bnij", q.astype(np.float64), k.astype(np.float64))
    np.testing.assert_allclose(lse[..., 0], np.log(np.exp(s).sum(-1)), rtol=1e-13)


# -----------------------------------------------------------------------------------------
# Layouts and GQA (§3)
# -----------------------------------------------------------------------------------------

def test_layouts_agree():
    r = rng(13)
    B, N, Nkv, Sq, Skv, D = 2, 4, 2, 5, 6, 3
    q, k, v = randn(r, (B, N, Sq, D)), randn(r, (B, Nkv, Skv, D)), randn(r, (B, Nkv, Skv, D))
    mask = r.random((Sq, Skv)) < 0.3
    kw = dict(attn_mask=mask, num_heads=N, num_key_value_heads=Nkv, scale_value=0.4,
              pre_tokens=2, next_tokens=1, actual_seq_lengths=[5, 3],
              return_softmax_lse=True)
    o_bnsd, l_ref = prompt_flash_attention(q, k, v, input_layout="BNSD", **kw)
    assert o_bnsd.shape == (B, N, Sq, D)
    want = o_bnsd.transpose(0, 2, 1, 3)          # (B, Sq, N, D)

    bsnd = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
    o, l = prompt_flash_attention(*bsnd, input_layout="BSND", **kw)
    np.testing.assert_array_equal(o, want)
    np.testing.assert_array_equal(l, l_ref)

    bsh = [x.reshape(x.shape[0], x.shape[1], -1) for x in bsnd]
    o, l = prompt_flash_attention(*bsh, input_layout="BSH", **kw)
    np.testing.assert_array_equal(o, want.reshape(B, Sq, N * D))
    np.testing.assert_array_equal(l, l_ref)

    o, l = prompt_flash_attention(q, k, v, input_layout="BNSD_BSND", **kw)
    np.testing.assert_array_equal(o, want)
    np.testing.assert_array_equal(l, l_ref)


def test_tnd_matches_padded_batch():
    r = rng(14)
    N, D = 2, 4
    q_lens, kv_lens = [3, 0, 5], [4, 2, 3]
    T, Tkv, Sq, Skv = sum(q_lens), sum(kv_lens), max(q_lens), max(kv_lens)
    qt, kt, vt = randn(r, (T, N, D)), randn(r, (Tkv, N, D)), randn(r, (Tkv, N, D))
    q_ends, kv_ends = np.cumsum(q_lens).tolist(), np.cumsum(kv_lens).tolist()
    # the same data padded into BNSD with actual lengths
    qp, kp, vp = (np.zeros((3, N, S, D), np.float32) for S in (Sq, Skv, Skv))
    for b in range(3):
        q0, k0 = q_ends[b] - q_lens[b], kv_ends[b] - kv_lens[b]
        qp[b, :, :q_lens[b]] = qt[q0:q_ends[b]].transpose(1, 0, 2)
        kp[b, :, :kv_lens[b]] = kt[k0:kv_ends[b]].transpose(1, 0, 2)
        vp[b, :, :kv_lens[b]] = vt[k0:kv_ends[b]].transpose(1, 0, 2)
    big = np.ones((2048, 2048), bool)
    for mode, mask in [(0, None), (2, big), (3, big), (4, big)]:
        kw = dict(sparse_mode=mode, attn_mask=mask, pre_tokens=1, next_tokens=1,
                  num_heads=N, return_softmax_lse=True)
        o, l = prompt_flash_attention(qt, kt, vt, input_layout="TND", actual_seq_lengths=q_ends,
                                      actual_seq_lengths_kv=kv_ends, **kw)
        assert o.shape == (T, N, D) and l.shape == (T, N, 1)
        op, lp = prompt_flash_attention(qp, kp, vp, input_layout="BNSD",
                                        actual_seq_lengths=q_lens,
                                        actual_seq_lengths_kv=kv_lens, **kw)
        for b in range(3):
            q0 = q_ends[b] - q_lens[b]
            np.testing.assert_array_equal(o[q0:q_ends[b]],
                                          op[b, :, :q_lens[b]].transpose(1, 0, 2))
            np.testing.assert_array_equal(l[q0:q_ends[b]],
                                          lp[b, :, :q_lens[b]].transpose(1, 0, 2))
    # empty TND
    o = prompt_flash_attention(qt[:0], kt[:0], vt[:0], input_layout="TND", num_heads=N,
                               actual_seq_lengths=[], actual_seq_lengths_kv=[])
    assert o.shape == (0, N, D)


def test_gqa_equals_mha_with_repeated_kv():
    r = rng(15)
    B, N, Nkv, Sq, Skv, D = 1, 6, 2, 3, 4, 2
    q, k, v = randn(r, (B, N, Sq, D)), randn(r, (B, Nkv, Skv, D)), randn(r, (B, Nkv, Skv, D))
    pse = randn(r, (B, N, Sq, Skv))
    G = N // Nkv
    heads = [n // G for n in range(N)]           # query head n reads kv head n // G
    kf, vf = k[:, heads], v[:, heads]
    a = bnsd(q, k, v, pse_shift=pse)
    b = bnsd(q, kf, vf, pse_shift=pse)
    np.testing.assert_array_equal(a, b)
    # BSH with num_key_value_heads
    bsh = [x.transpose(0, 2, 1, 3).reshape(B, x.shape[2], -1) for x in (q, k, v)]
    c = prompt_flash_attention(*bsh, num_heads=N, num_key_value_heads=Nkv, pse_shift=pse)
    np.testing.assert_array_equal(c, a.transpose(0, 2, 1, 3).reshape(B, Sq, N * D))


def test_mindspore_positional_call():
    r = rng(16)
    q, k, v = randn(r, (1, 2, 3, 4), np.float16), randn(r, (1, 2, 3, 4), np.float16), \
        randn(r, (1, 2, 3, 4), np.float16)
    out = prompt_flash_attention(q, k, v, None, None, None, None, None, None, None, None, None,
                                 2, input_layout='BNSD')
    np.testing.assert_array_equal(out, bnsd(q, k, v))


def test_mask_shapes_and_padding():
    r = rng(17)
    B, Sq, Skv = 2, 3, 4
    q, k, v = randn(r, (B, 1, Sq, 2)), randn(r, (B, 1, Skv, 2)), randn(r, (B, 1, Skv, 2))
    m = r.random((B, 1, Sq, Skv)) < 0.4
    want = bnsd(q, k, v, attn_mask=m, sparse_mode=1)
    pad = np.ones((B, 1, Sq + 2, Skv + 3), np.uint8)
    pad[:, :, :Sq, :Skv] = m
    for mask in [m[:, 0], pad, pad[:, 0]]:
        np.testing.assert_array_equal(bnsd(q, k, v, attn_mask=mask, sparse_mode=1), want)
    # a 2-D / batch-1 mask applies to every batch
    one = bnsd(q, k, v, attn_mask=m[0, 0], sparse_mode=1)
    np.testing.assert_array_equal(bnsd(q, k, v, attn_mask=m[:1], sparse_mode=1), one)
    np.testing.assert_array_equal(bnsd(q, k, v, attn_mask=m[:1, :, :, :].astype(np.int8),
                                       sparse_mode=1), one)


def test_bfloat16_inputs():
    r = rng(18)
    q, k, v = (randn(r, (1, 1, 3, 16)).astype(BF16) for _ in range(3))
    out = bnsd(q, k, v, scale_value=0.25)
    o32 = bnsd(*(x.astype(np.float32) for x in (q, k, v)), scale_value=0.25)
    np.testing.assert_array_equal(out, o32)


# -----------------------------------------------------------------------------------------
# compute_dtype
# -----------------------------------------------------------------------------------------

def test_compute_dtype_error_sizes():
    r = rng(19)
    q, k, v = (randn(r, (2, 2, 16, 32), np.float16) for _ in range(3))
    kw = dict(scale_value=1 / math.sqrt(32), pre_tokens=7, next_tokens=0,
              attn_mask=np.zeros((16, 16), bool))
    exact = bnsd(q, k, v, **kw)
    scale = np.abs(exact).max()
    err = {dt: np.abs(bnsd(q, k, v, compute_dtype=dt, **kw) - exact).max() / scale
           for dt in (np.float16, np.float32, BF16)}
    assert 0 < err[np.float16] < 1e-2
    assert 0 < err[np.float32] < 1e-5
    assert err[np.float32] < err[np.float16] / 100
    assert err[np.float16] < err[BF16] < 5e-2
    # rounded values are representable in the dtype
    o16 = bnsd(q, k, v, compute_dtype=np.float16, **kw)
    np.testing.assert_array_equal(o16, o16.astype(np.float16).astype(np.float64))


def test_compute_dtype_keeps_special_rows():
    r = rng(20)
    q, k, v = (randn(r, (1, 1, 4, 4), np.float16) for _ in range(3))
    mask = np.zeros((4, 4), bool)
    mask[2] = True
    a, la = bnsd(q, k, v, attn_mask=mask, actual_seq_lengths=[3], compute_dtype=np.float16,
                 return_softmax_lse=True)
    assert np.all(a[0, 0, 3] == 0) and la[0, 0, 3, 0] == -np.inf and la[0, 0, 2, 0] == -np.inf
    np.testing.assert_allclose(a[0, 0, 2], v[0, 0, :3].astype(np.float64).mean(0), rtol=1e-3)


# -----------------------------------------------------------------------------------------
# Quantization (§8)
# -----------------------------------------------------------------------------------------

def test_trans_quant_param_bits():
    got = trans_quant_param([1.0, 0.1, -2.0, 0.0])
    assert got.dtype == np.uint64
    # 1.0 = 0x3F800000; 0.1f = 0x3DCCCCCD -> low 13 bits dropped 0x3DCCC000;
    # -2.0 = 0xC0000000; 0.0 = 0
    want = [0x3F800000, 0x3DCCC000, 0xC0000000, 0]
    assert got.tolist() == [w | (1 << 46) for w in want]
    assert trans_quant_param(np.ones((2, 3), np.float32)).shape == (2, 3)
    assert int(trans_quant_param(np.float32(0.5))) == 0x3F000000 | (1 << 46)


def int8_model_row(q_row, k, v, deq1, qs1, deq2, scale, keep_row, pse_row=None):
    """contract 'Quantization' transcribed with Python scalars for one row; returns fp16 values
    (floats).

    None when nothing is kept.
    """
    s = {}
    for j in range(k.shape[0]):
        if not keep_row[j]:
            continue
        a = sum(int(x) * int(y) for x, y in zip(q_row, k[j]))           # exact integer
        sj = float(np.float16(float(np.float16(a * deq1)) * float(np.float16(scale))))
        if pse_row is not None:
            sj = float(np.float16(sj + float(pse_row[j])))
        if sj != -math.inf:
            s[j] = sj
    if not s:
        return None
    m = max(s.values())
    E = {j: float(np.float32(math.exp(sj - m))) for j, sj in s.items()}
    l = float(np.float32(sum(E.values())))
    P8 = {j: max(-128, min(127, round(e * qs1))) for j, e in E.items()}   # round(): half even
    out = []
    for d in range(v.shape[1]):
        acc = sum(P8[j] * int(v[j, d]) for j in P8)
        out.append(float(np.float16(deq2 * acc / l)))
    return out


def quantize_out(o, s2, o2):
    """Output quantization of contract 'Quantization' with Python scalars."""
    y = float(np.float16(float(np.float16(float(np.float16(o)) * float(np.float16(s2))))
                         + float(np.float16(o2))))
    if math.isnan(y):
        return 0
    return max(-128, min(127, round(y))) if math.isfinite(y) else (127 if y > 0 else -128)


def test_int8_to_fp16_by_hand():
    # q = [1, 2], k = [[3, 4], [1, 0]] -> A = [11, 1]; deq1 = 0.5 -> [5.5, 0.5], scale 1
    # m = 5.5; E = [1, exp(-5) = 0.006737947] (float32); l = 1.006737947
    # quant_scale1 = 100: E * 100 = [100, 0.6738] -> P8 = [100, 1]
    # v = [[2, -1], [10, 5]]: sum P8 * v = [200 + 10, -100 + 5] = [210, -95]
    # deq2 = 0.01f: O = fp16([2.1, -0.95] / 1.006737947) = fp16([2.08594.., -0.94364..])
    q = np.array([[[[1, 2]]]], np.int8)
    k = np.array([[[[3, 4], [1, 0]]]], np.int8)
    v = np.array([[[[2, -1], [10, 5]]]], np.int8)
    deq1 = np.array([0.5], np.float32)
    deq2 = np.array([0.01], np.float32)
    qs1 = np.array([100.0], np.float32)
    out = bnsd(q, k, v, deq_scale1=deq1, quant_scale1=qs1, deq_scale2=deq2)
    l = float(np.float32(1 + float(np.float32(math.exp(-5)))))
    d2 = float(np.float32(0.01))
    want = [float(np.float16(d2 * 210 / l)), float(np.float16(d2 * -95 / l))]
    np.testing.assert_array_equal(out[0, 0, 0], want)
    np.testing.assert_allclose(want, [2.0859, -0.9434], atol=2e-3)   # fp16 spacing 2^-9, 2^-11
    assert out[0, 0, 0].tolist() == int8_model_row(q[0, 0, 0], k[0, 0], v[0, 0], 0.5, 100.0,
                                                   d2, 1.0, [True, True])
    # int8 output: quant_scale2 = 3, offset 1: fp16(fp16(2.0859*3) + 1) = 7.258 -> 7;
    # fp16(-0.9434*3) + 1 = -1.83 -> -2
    out8 = bnsd(q, k, v, deq_scale1=deq1, quant_scale1=qs1, deq_scale2=deq2,
                quant_scale2=np.array([3.0], np.float32),
                quant_offset2=np.array([1.0], np.float32))
    assert out8[0, 0, 0].tolist() == [7.0, -2.0]


def test_int8_random_against_transcription():
    r = rng(21)
    B, N, Sq, Skv, D = 2, 2, 4, 6, 8
    q = r.integers(-128, 128, (B, N, Sq, D)).astype(np.int8)
    k = r.integers(-128, 128, (B, N, Skv, D)).astype(np.int8)
    v = r.integers(-128, 128, (B, N, Skv, D)).astype(np.int8)
    mask = r.random((B, 1, Sq, Skv)) < 0.3
    pse = randn(r, (1, N, Sq, Skv), np.float16)
    deq1 = trans_quant_param([1.0 / 1024])
    deq2 = trans_quant_param([0.003])
    d1 = float(np.float32(1.0 / 1024))
    # 0.003f = 0x3B449BA6; the packed form keeps 0x3B448000 (13 low mantissa bits dropped)
    d2 = float(np.array(0x3B448000, np.uint32).view(np.float32))
    assert d2 == float(np.array(int(deq2[0]) & 0xFFFFE000, np.uint32).view(np.float32))
    qs1 = np.array([127.0], np.float32)
    kw = dict(attn_mask=mask, pse_shift=pse, deq_scale1=deq1, quant_scale1=qs1,
              deq_scale2=deq2, scale_value=0.125, pre_tokens=INF, next_tokens=INF,
              actual_seq_lengths_kv=[6, 5])
    out = bnsd(q, k, v, **kw)
    s2 = (r.random(N * D) * 4 + 0.5).astype(np.float32)
    o2 = r.integers(-3, 4, N * D).astype(np.float32)
    out8 = bnsd(q, k, v, quant_scale2=s2.reshape(1, N, 1, D), quant_offset2=o2.reshape(N, D),
                **kw)
    for b in range(B):
        kL = [6, 5][b]
        for n in range(N):
            for i in range(Sq):
                row = [j < kL and not mask[b, 0, i, j] for j in range(Skv)]
                want = int8_model_row(q[b, n, i], k[b, n], v[b, n], d1, 127.0, d2, 0.125, row,
                                      pse[0, n, i])
                if want is None:
                    continue
                assert out[b, n, i].tolist() == want
                assert out8[b, n, i].tolist() == [quantize_out(o, s2[n * D + d], o2[n * D + d])
                                                   for d, o in enumerate(want)]


def test_deq_scale_uint64_equals_truncated_float32():
    r = rng(22)
    q, k, v = (r.integers(-20, 20, (1, 1, 3, 4)).astype(np.int8) for _ in range(3))
    qs1 = np.array([64.0], np.float32)
    packed = bnsd(q, k, v, deq_scale1=trans_quant_param([0.1]), quant_scale1=qs1,
                  deq_scale2=trans_quant_param([0.37]))
    trunc = [np.array(np.array(x, np.float32).view(np.uint32) & 0xFFFFE000, np.uint32)
             .view(np.float32).reshape(1) for x in (0.1, 0.37)]
    plain = bnsd(q, k, v, deq_scale1=trunc[0], quant_scale1=qs1, deq_scale2=trunc[1])
    np.testing.assert_array_equal(packed, plain)
    # hand-packed uint64 whose 13 low mantissa bits are set: they are dropped on decoding.
    # One kv column, E = 1, P8 = 127, v = 127: O = fp16(deq2 * 16129).  deq2 bits 0x3F801FFF
    # (1 + 8191 * 2**-23) would give fp16(16144.75) = 16144; dropped to 1.0: fp16(16129) = 16128.
    ones = np.ones((1, 1, 1, 1), np.int8)
    raw = np.array([0x3F801FFF | (1 << 46)], np.uint64)
    out = bnsd(ones, ones, 127 * ones, deq_scale1=raw, quant_scale1=np.array([127.0], np.float32),
               deq_scale2=raw)
    assert out[0, 0, 0, 0] == 16128.0
    out = bnsd(ones, ones, 127 * ones, deq_scale1=np.array([1.0], np.float32),
               quant_scale1=np.array([127.0], np.float32),
               deq_scale2=np.array(0x3F801FFF, np.uint32).view(np.float32).reshape(1))
    assert out[0, 0, 0, 0] == 16144.0                               # float32 used as is
    # float32 scales are used as is: 0.37f is not the truncated value, output differs
    untrunc = bnsd(q, k, v, deq_scale1=trunc[0], quant_scale1=qs1,
                   deq_scale2=np.array([0.37], np.float32))
    assert not np.array_equal(untrunc, plain)


def test_int8_fully_masked_and_zero_rows():
    q = np.array([[[[1, 1], [2, 0], [0, 3]]]], np.int8)            # Sq = 3
    k = np.array([[[[1, 0], [0, 1], [5, 5]]]], np.int8)
    v = np.array([[[[10, 20], [30, 40], [50, 60]]]], np.int8)
    mask = np.zeros((3, 3), bool)
    mask[1] = True                                                  # row 1 fully masked
    scales = dict(deq_scale1=np.array([1.0], np.float32), quant_scale1=np.array([50.0],
                  np.float32), deq_scale2=np.array([0.02], np.float32))
    # band with pre=+inf, next=0: row 1 sees columns 0, 1.  inner_precise 1: E = 1 on the band,
    # l = 2, P8 = 50 -> O = fp16(0.02f * 50 * ([10, 20] + [30, 40]) / 2) = fp16([20, 30])
    d2 = float(np.float32(0.02))
    want = [float(np.float16(d2 * 50 * 40 / 2)), float(np.float16(d2 * 50 * 60 / 2))]
    out = bnsd(q, k, v, attn_mask=mask, inner_precise=1, actual_seq_lengths=[2], **scales)
    assert out[0, 0, 1].tolist() == want
    np.testing.assert_allclose(want, [20, 30], rtol=1e-3)
    assert np.all(out[0, 0, 2] == 0)                                # row >= qL
    out = bnsd(q, k, v, attn_mask=mask, inner_precise=3, actual_seq_lengths=[2], **scales)
    assert np.all(out[0, 0, 1] == 0)
    # int8 output with offset 5: structural zero rows stay 0, the rest are quantized
    q8 = dict(quant_scale2=np.array([0.5], np.float32), quant_offset2=np.array([5.0],
              np.float32))
    out = bnsd(q, k, v, attn_mask=mask, inner_precise=3, actual_seq_lengths=[2], **scales,
               **q8)
    assert np.all(out[0, 0, 1:] == 0)
    assert np.all(out[0, 0, 0] != 0)
    out = bnsd(q, k, v, attn_mask=mask, inner_precise=1, actual_seq_lengths=[2], **scales,
               **q8)
    assert out[0, 0, 1].tolist() == [quantize_out(o, 0.5, 5.0) for o in want] == [15, 20]


def test_float_to_int8_round_half_even_and_saturation():
    # one kv column: the weight is exactly 1, O = v.  quant_scale2 = 1, no offset.
    vals = [2.5, 3.5, -2.5, 0.5, 1.5, -0.5, 200.0, -300.0, 126.6, -127.6, 70000.0, -0.4]
    want = [2, 4, -2, 0, 2, 0, 127, -128, 127, -128, 127, 0]
    D = len(vals)
    q = np.ones((1, 1, 2, D), np.float32)
    k = np.ones((1, 1, 1, D), np.float32)
    v = np.array(vals, np.float32).reshape(1, 1, 1, D)
    out = bnsd(q, k, v, quant_scale2=np.array([1.0], np.float32))
    assert out[0, 0, 0].tolist() == want and out[0, 0, 1].tolist() == want
    # offset: 2.5 + 0.5 = 3.0 -> 3; -2.5 + 0.5 = -2.0 -> -2; with offset 1.0: 3.5 -> 4, -1.5 -> -2
    out = bnsd(q, k, v, quant_scale2=np.array([1.0], np.float32),
               quant_offset2=np.array([1.0], np.float32))
    assert out[0, 0, 0, :3].tolist() == [4, 4, -2]     # 3.5 -> 4, 4.5 -> 4, -1.5 -> -2
    # NaN output (V NaN at a kept column) becomes 0; rows >= qL stay 0 despite the offset
    v2 = v.copy()
    v2[0, 0, 0, 0] = np.nan
    out = bnsd(q, k, v2, quant_scale2=np.array([1.0], np.float32),
               quant_offset2=np.array([9.0], np.float32), actual_seq_lengths=[1])
    assert out[0, 0, 0, 0] == 0 and out[0, 0, 0, 1] == 12 and np.all(out[0, 0, 1] == 0)


def test_float_to_int8_per_channel_layouts():
    r = rng(23)
    N, D = 2, 32
    q, k, v = (randn(r, (1, 3, N * D), np.float16) for _ in range(3))
    s2 = (r.random(N * D) * 30 + 1).astype(np.float32)
    o2 = r.integers(-4, 5, N * D).astype(np.float32)
    exact = prompt_flash_attention(q, k, v, num_heads=N)                # (1, 3, H)
    want = np.array([[[quantize_out(exact[0, i, c], s2[c], o2[c]) for c in range(N * D)]
                      for i in range(3)]], np.float64)
    for shape in [(N * D,), (1, 1, N * D), (1, N, 1, D), (N, D), (1, 1, N, D)]:
        out = prompt_flash_attention(q, k, v, num_heads=N, quant_scale2=s2.reshape(shape),
                                     quant_offset2=o2.reshape(shape))
        np.testing.assert_array_equal(out, want)
    assert len(np.unique(want)) > 10


def test_bf16_query_with_bf16_quant_scale():
    r = rng(24)
    q, k, v = (randn(r, (1, 1, 2, 16)).astype(BF16) for _ in range(3))
    s2 = np.array([20.0], BF16)
    out = bnsd(q, k, v, quant_scale2=s2)
    exact = bnsd(q, k, v)
    want = [[quantize_out(o, 20.0, 0.0) for o in row] for row in exact[0, 0]]
    assert out[0, 0].tolist() == want
