"""pfa_numba.scaled_dot_product_attention against torch's own, argument for argument."""
import math

import numpy as np
import pytest

from pfa_numba import reference, scaled_dot_product_attention
from _cases import assert_matches_reference

torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")
F = torch.nn.functional

CASES = {
    # name: (query shape, key shape, sdpa keywords)
    "mha": ((2, 4, 33, 32), (2, 4, 40, 32), {}),
    "gqa": ((2, 8, 33, 64), (2, 2, 47, 64), dict(enable_gqa=True)),
    "causal-L<S": ((2, 4, 33, 32), (2, 4, 40, 32), dict(is_causal=True)),
    "causal-L>S": ((1, 2, 50, 16), (1, 2, 21, 16), dict(is_causal=True)),
    "2d": ((33, 32), (40, 32), {}),
    "5d-scale": ((3, 2, 4, 17, 32), (3, 2, 4, 40, 32), dict(scale=0.3)),
}


def _inputs(case, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qs, ks, kw = CASES[case]
    q = torch.randn(qs, generator=g).to(dtype)
    k, v = (torch.randn(ks, generator=g).to(dtype) for _ in range(2))
    return q, k, v, kw


def _tol(dtype):
    return {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch(case, dtype):
    q, k, v, kw = _inputs(case, dtype)
    got = scaled_dot_product_attention(q, k, v, **kw)
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    assert isinstance(got, torch.Tensor) and got.dtype == dtype and got.shape == want.shape
    np.testing.assert_allclose(got.float().numpy(), want.float().numpy(), atol=_tol(dtype))


@pytest.mark.parametrize("kind", ["bool-LS", "bool-per-head", "bool-per-batch", "float-LS",
                                  "float-per-head", "bool-fully-masked-row"])
def test_masks_match_torch(kind):
    q, k, v, _ = _inputs("mha", torch.float32, seed=1)
    g = torch.Generator().manual_seed(2)
    shape = {"bool-LS": (33, 40), "bool-per-head": (2, 4, 33, 40), "bool-per-batch": (2, 1, 33, 40),
             "float-LS": (33, 40), "float-per-head": (2, 4, 33, 40),
             "bool-fully-masked-row": (2, 1, 33, 40)}[kind]
    mask = torch.rand(shape, generator=g) < 0.7 if kind.startswith("bool") else \
        torch.randn(shape, generator=g)
    if kind == "bool-fully-masked-row":
        mask[0, 0, 5] = False                     # a row with nothing to attend to: zeros
    got = scaled_dot_product_attention(q, k, v, mask)
    want = F.scaled_dot_product_attention(q, k, v, mask)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=2e-6)
    if kind == "bool-fully-masked-row":
        assert torch.all(got[0, :, 5] == 0)


def test_numpy_in_numpy_out_matches_the_reference():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in
               ((2, 4, 20, 32), (2, 4, 30, 32), (2, 4, 30, 32)))
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    kw = dict(num_heads=4, input_layout="BNSD", scale_value=1 / math.sqrt(32),
              sparse_mode=0, pre_tokens=2147483647, next_tokens=0, inner_precise=2)
    mask = np.zeros((20, 30), bool)               # the band j <= i comes from the tokens
    assert_matches_reference(out, (q, k, v, mask), kw, np.float32)
    np.testing.assert_allclose(out, reference.prompt_flash_attention(q, k, v, mask, **kw),
                               atol=2e-6)


@pytest.mark.parametrize("bad, error, match", [
    (dict(dropout_p=0.1), RuntimeError, "dropout_p must be 0.0"),
    (dict(is_causal=True, attn_mask="mask"), RuntimeError, "is_causal=True takes no attn_mask"),
    (dict(kv_heads=2), RuntimeError, "enable_gqa=True"),
    (dict(attn_mask="float64"), TypeError, "float attn_mask must have the query's dtype"),
    (dict(attn_mask="wrong shape"), RuntimeError, "does not broadcast"),
    (dict(scale="0.5"), TypeError, "scale must be a real number"),
    (dict(scale=float("inf")), ValueError, "scale must be finite"),
    (dict(head_dim=0), RuntimeError, "D"),
    (dict(dtype=torch.int8), TypeError, r"query dtype must be float16, bfloat16 or float32 "
                                        r"\(the SDPA drop-in's dtypes\), got int8"),
    (dict(dtype=torch.float64), TypeError, r"query dtype must be float16, bfloat16 or float32 "
                                           r"\(the SDPA drop-in's dtypes\), got float64"),
])
@pytest.mark.parametrize("kind", ["tensor", "ndarray"])
def test_refusals(bad, error, match, kind):
    bad = dict(bad)                   # the parameter's dict serves both kinds
    e = bad.pop("head_dim", 32)
    q = torch.randn(1, 4, 8, e).to(bad.pop("dtype", torch.float32))
    k = torch.randn(1, bad.pop("kv_heads", 4), 8, e).to(q.dtype)
    v = torch.randn(1, k.shape[1], 8, bad.pop("value_dim", e)).to(q.dtype)
    mask = {"mask": torch.ones(8, 8, dtype=torch.bool), "float64": torch.zeros(8, 8).double(),
            "wrong shape": torch.ones(3, 8, 8, dtype=torch.bool)}.get(bad.pop("attn_mask", None))
    if kind == "ndarray":
        q, k, v = (x.numpy() for x in (q, k, v))
        mask = None if mask is None else mask.numpy()
    with pytest.raises(error, match=match):
        scaled_dot_product_attention(q, k, v, mask, **bad)


def _structured_mask(kind, sq, skv, batch=2):
    """Masks whose True entries lie in a band: (batch, 1, sq, skv) bool, True = take part."""
    i = torch.arange(sq)[:, None] + (skv - sq)           # query positions at the end of the kv
    j = torch.arange(skv)[None, :]
    causal = j <= i
    pad = torch.zeros(batch, skv, dtype=torch.bool)      # left padding of batch 1: 7 tokens
    pad[1, :7] = True
    masks = {"causal": causal, "sliding": causal & (j > i - 9),
             "left-pad-causal": causal[None] & ~pad[:, None, :],
             "right-pad": (j < skv - 5).expand(sq, skv)}
    return masks[kind].reshape(-1, 1, sq, skv).expand(batch, 1, sq, skv).contiguous()


@pytest.mark.parametrize("sq, skv", [(33, 33), (1, 65), (7, 40), (70, 70)])
@pytest.mark.parametrize("kind", ["causal", "sliding", "left-pad-causal", "right-pad"])
def test_banded_bool_masks_match_torch(kind, sq, skv):
    g = torch.Generator().manual_seed(sq * skv)
    q = torch.randn(2, 4, sq, 32, generator=g)
    k, v = (torch.randn(2, 2, skv, 32, generator=g) for _ in range(2))
    mask = _structured_mask(kind, sq, skv)
    got = scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
    want = torch.where(mask.any(-1, keepdim=True), want, 0.0)      # fully masked rows: zeros
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=2e-6)


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_mask_band_is_the_narrowest_band_holding_every_true(library):
    """With NumPy's operations (host arrays) and with torch's (CUDA tensors' path: run here on
    CPU tensors)."""
    from pfa_numba.sdpa import _mask_band
    xp = torch if library == "torch" else np
    rng = np.random.default_rng(5)
    for trial in range(200):
        sq, skv = rng.integers(1, 12, size=2)
        mask = rng.random((2, sq, skv)) < rng.choice([0.05, 0.3, 0.9])
        band = _mask_band(torch.from_numpy(mask) if xp is torch else mask, sq, skv, xp)
        i, j = np.nonzero(mask.any(axis=0))
        if i.size == 0:
            assert band is None
            continue
        assert band == ((i - j).max(), (j - i).max())
        assert band[0] + band[1] >= 0


#: attn_mask forms for a query (2, 4, 5, 16) and a key (2, 4, 7, 16): (shape, dtype)
MASK_FORMS = {"2d-bool": ((5, 7), np.bool_), "batch-bool": ((2, 1, 5, 7), np.bool_),
              "per-head-bool": ((2, 4, 5, 7), np.bool_), "row-bool": ((7,), np.bool_),
              "float": ((1, 4, 1, 7), np.float16), "mismatch": ((3, 7), np.bool_)}


@pytest.mark.parametrize("form", list(MASK_FORMS))
def test_torch_operations_convert_the_mask_as_numpys_do(form):
    """The conversion CUDA tensors get (torch's operations, run here on CPU tensors) gives
    NumPy's (pse_shift, discard mask), and raises its error."""
    from pfa_numba.interop import torch_tensors
    from pfa_numba.sdpa import _mask
    shape, dtype = MASK_FORMS[form]
    rng = np.random.default_rng(6)
    mask = (rng.random(shape) < 0.5) if dtype == np.bool_ else \
        rng.standard_normal(shape).astype(dtype)
    q, k = np.ones((2, 4, 5, 16), np.float16), np.ones((2, 4, 7, 16), np.float16)
    results = []
    for xp, arrays in ((np, (mask, q, k)), (torch, [torch.from_numpy(x) for x in (mask, q, k)])):
        try:
            results.append(_mask(*arrays, xp))
        except RuntimeError as exc:
            results.append(str(exc))
    want, got = results
    if form == "mismatch":
        assert want == got and "does not broadcast" in want
        return
    for w, g in zip(want, got):
        assert (w is None and g is None) or (torch_tensors.numpy_dtype(g) == w.dtype and
                                             np.array_equal(g.numpy(), w))
    assert any(w is not None for w in want)


def _weights64(q, k, keep, scale, softcap, sinks):
    """softmax over the kept (capped, scaled) scores and a sink, float64; rows keeping nothing
    are zeros."""
    k = np.repeat(k.astype(np.float64), q.shape[1] // k.shape[1], axis=1)
    s = scale * (q.astype(np.float64) @ k.transpose(0, 1, 3, 2))
    s = softcap * np.tanh(s / softcap)
    s = np.where(keep, s, -np.inf)
    m = np.maximum(s.max(-1, keepdims=True), sinks[None, :, None, None])
    e = np.where(keep, np.exp(s - m), 0.0)
    total = e.sum(-1, keepdims=True) + np.exp(sinks[None, :, None, None] - m)
    return np.where(keep.any(-1, keepdims=True), e / total, 0.0)


def test_attention_with_weights_gives_the_softmax_weights():
    """The slow path of output_attentions: the output equals the plain call's, the weights are
    the softmax of the capped, masked scores with the sink in the denominator (its own weight
    left out), zeros for a row that keeps nothing; in grad mode only the output has a
    gradient."""
    from pfa_numba.sdpa import attention_with_weights
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 70, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 90, 16)).astype(np.float32) for _ in range(2))
    keep = rng.random((2, 1, 70, 90)) < 0.5
    keep[:, :, 3] = False
    sinks = np.array([0.0, 1.0, -2.0, 3.0], np.float32)
    kw = dict(enable_gqa=True, softcap=2.0, sinks=sinks)
    out, weights = attention_with_weights(q, k, v, keep, **kw)
    assert np.array_equal(out, scaled_dot_product_attention(q, k, v, keep, **kw))
    want = _weights64(q, k, keep, 0.25, 2.0, sinks.astype(np.float64))
    assert weights.dtype == np.float32 and weights.shape == (2, 4, 70, 90)
    assert np.abs(weights - want).max() <= 8 * np.finfo(np.float32).eps
    assert np.all(weights[:, :, 3] == 0)
    qt = torch.tensor(q, requires_grad=True)
    out_t, weights_t = attention_with_weights(qt, torch.tensor(k), torch.tensor(v),
                                              torch.tensor(keep),
                                              **dict(kw, sinks=torch.tensor(sinks)))
    assert out_t.requires_grad and not weights_t.requires_grad
    assert torch.equal(weights_t, torch.from_numpy(weights))


@pytest.mark.parametrize("lengths", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("kind", ["float", "bool", "bool per head"])
def test_empty_lengths_with_a_mask(lengths, kind):
    """No query rows or no kv rows, with a mask of each kind: an empty result, or zeros (as
    rows that keep nothing are)."""
    sq, skv = lengths
    q = torch.randn(2, 2, sq, 16)
    k = v = torch.randn(2, 2, skv, 16)
    mask = {"float": torch.randn(2, 1, sq, skv), "bool": torch.ones(1, 1, sq, skv, dtype=bool),
            "bool per head": torch.ones(2, 2, sq, skv, dtype=bool)}[kind]
    out = scaled_dot_product_attention(q, k, v, mask)
    assert out.shape == (2, 2, sq, 16) and torch.all(out == 0)


def test_torch_tensors_run_where_they_live():
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="device='cuda' but the tensors live on cpu"):
        scaled_dot_product_attention(q, q, q, device="cuda")
    assert torch.equal(scaled_dot_product_attention(q, q, q, device="cpu"),
                       scaled_dot_product_attention(q, q, q))


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_a_mask_expanded_along_the_heads_is_one_heads_mask(library):
    """A bool mask broadcast along the heads (stride 0) is dropped as one discard mask, not
    made into a bias for every head."""
    from pfa_numba.sdpa import _mask
    keep = np.random.default_rng(7).random((2, 1, 5, 7)) < 0.5
    q, k = np.ones((2, 4, 5, 16), np.float16), np.ones((2, 4, 7, 16), np.float16)
    if library == "torch":
        keep, q, k = (torch.from_numpy(x) for x in (keep, q, k))
        expanded = keep.expand(2, 4, 5, 7)
        xp = torch
    else:
        expanded, xp = np.broadcast_to(keep, (2, 4, 5, 7)), np
    pse, discard = _mask(expanded, q, k, xp)
    assert pse is None and np.array_equal(np.asarray(discard), ~np.asarray(keep)[:, 0])
