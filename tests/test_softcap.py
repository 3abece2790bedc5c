"""Score softcapping (``softcap``, Gemma 2's attention logit softcapping): the reference against
the formula written out, every CPU float kernel against the reference, the SDPA drop-in's
argument checks, and the transformers integration's keyword."""
import ml_dtypes
import numpy as np
import pytest

from pfa_numba import config, reference, scaled_dot_product_attention
from pfa_numba.cpu import _amx
from _cases import assert_matches_reference

INF = 2147483647
CAUSAL_MASK = np.triu(np.ones((2048, 2048), bool), 1)


def _qkv(rng, B, N, Nkv, Sq, Skv, D, dtype, spread=3.0):
    r = lambda *s: (rng.standard_normal(s) * spread).astype(np.float32).astype(dtype)
    return r(B, N, Sq, D), r(B, Nkv, Skv, D), r(B, Nkv, Skv, D) / spread


def _reference_kwargs(N, Nkv, D, causal, cap):
    kw = dict(num_heads=N, num_key_value_heads=Nkv, input_layout="BNSD", scale_value=D ** -0.5,
              inner_precise=2, softcap=cap)
    if causal:
        kw.update(attn_mask=CAUSAL_MASK, sparse_mode=2)
    else:
        kw.update(next_tokens=INF)
    return kw


def test_reference_caps_the_scaled_scores_before_the_softmax():
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 1, 2, 2, 5, 7, 8, np.float32)
    cap = 2.0
    got = reference.prompt_flash_attention(q, k, v, **_reference_kwargs(2, 2, 8, False, cap))
    s = np.einsum("bnid,bnjd->bnij", q.astype(np.float64), k.astype(np.float64)) * 8 ** -0.5
    s = cap * np.tanh(s / cap)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.abs(s).max() < cap


# name: (B, N, Nkv, Sq, Skv, D, causal, config overrides): each reaches one CPU kernel
PATHS = {
    "tiles": (2, 4, 2, 37, 53, 64, False, {}),
    "tiles-causal": (1, 4, 4, 70, 70, 32, True, {}),
    "blas": (2, 4, 2, 37, 53, 64, True, dict(CPU_AVX512_GEMM=False, CPU_AMX=False)),
    "stream": (3, 8, 2, 1, 300, 64, False, {}),
    "split-kv": (1, 4, 1, 1, 1500, 64, False, dict(CPU_SPLIT_KV_ITEMS=10 ** 6,
                                                    CPU_SPLIT_KV_MIN_COLS=64)),
}
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


def check_path(path, dtype, monkeypatch, spread, extension):
    """The SDPA drop-in with the keywords ``extension(N)`` (softcap=, sinks=) on the problem of
    ``path`` (its kernel) against the reference; returns the reference's result with and
    without them."""
    B, N, Nkv, Sq, Skv, D, causal, overrides = PATHS[path]
    for name, value in overrides.items():
        monkeypatch.setattr(config, name, value)
    q, k, v = _qkv(np.random.default_rng(1), B, N, Nkv, Sq, Skv, D, dtype, spread)
    extra = extension(N)
    got = scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=N != Nkv, **extra)
    kw = _reference_kwargs(N, Nkv, D, causal, None)
    ref = assert_matches_reference(got, (q, k, v), {**kw, **extra}, dtype)
    return ref, reference.prompt_flash_attention(q, k, v, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("path", list(PATHS))
def test_kernels_match_the_reference(path, dtype, monkeypatch):
    ref, plain = check_path(path, dtype, monkeypatch, 3.0, lambda N: dict(softcap=4.0))
    assert np.abs(plain - ref).max() > 0.05       # the scores reach well past the cap


@pytest.mark.skipif(not _amx.available(), reason="this CPU has no AMX (tested where it has)")
def test_amx_kernel_matches_the_reference():
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 1, 4, 2, 64, 96, 64, ml_dtypes.bfloat16)
    got = scaled_dot_product_attention(q, k, v, enable_gqa=True, softcap=3.0)
    assert_matches_reference(got, (q, k, v), _reference_kwargs(4, 2, 64, False, 3.0),
                             ml_dtypes.bfloat16)


def test_masks_apply_after_the_cap():
    """A float mask is added to the capped scores; a bool mask drops columns after the cap."""
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 1, 2, 2, 9, 11, 16, np.float32)
    bias = rng.standard_normal((9, 11)).astype(np.float32) * 5
    keep = rng.random((9, 11)) < 0.7
    keep[:, 0] = True
    for mask, kw in ((bias, dict(pse_shift=np.broadcast_to(bias, (1, 2, 9, 11)))),
                     (keep, dict(attn_mask=~keep[None], sparse_mode=1))):
        got = scaled_dot_product_attention(q, k, v, mask, softcap=2.5)
        ref_kw = _reference_kwargs(2, 2, 16, False, 2.5)
        ref_kw.update(kw)
        assert_matches_reference(got, (q, k, v), ref_kw, np.float32)


@pytest.mark.parametrize("bad, error", [(0.0, ValueError), (-1.0, ValueError),
                                        (float("inf"), ValueError), (float("nan"), ValueError),
                                        ("50", TypeError), (True, TypeError)])
def test_bad_softcap_is_refused(bad, error):
    q = np.zeros((1, 1, 2, 8), np.float32)
    with pytest.raises(error, match="softcap"):
        scaled_dot_product_attention(q, q, q, softcap=bad)


def test_none_is_no_cap():
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 1, 2, 2, 6, 6, 16, np.float32)
    np.testing.assert_array_equal(scaled_dot_product_attention(q, k, v, softcap=None),
                                  scaled_dot_product_attention(q, k, v))
