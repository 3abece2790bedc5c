"""Attention sinks (``sinks``, gpt-oss's ``s_aux``): a logit a query head in every row's
softmax denominator without a value row. The reference against the formula written out, every
CPU float kernel against the reference, the SDPA drop-in's argument checks, and a tiny random
gpt-oss on the transformers integration against "eager"."""
import numpy as np
import pytest

from pfa_numba import reference, scaled_dot_product_attention
from _cases import assert_matches_reference
from test_softcap import DTYPES, PATHS, _qkv, _reference_kwargs, check_path


def test_reference_puts_the_sink_in_the_denominator():
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 1, 2, 2, 5, 7, 8, np.float32)
    sinks = np.array([0.5, 3.0])
    kw = _reference_kwargs(2, 2, 8, False, None)
    got, lse = reference.prompt_flash_attention(q, k, v, **kw, sinks=sinks,
                                                return_softmax_lse=True)
    s = np.einsum("bnid,bnjd->bnij", q.astype(np.float64), k.astype(np.float64)) * 8 ** -0.5
    logits = np.concatenate([s, np.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))],
                            axis=-1)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, p[..., :-1] @ v.astype(np.float64), rtol=1e-12, atol=1e-12)
    want_lse = np.log(np.exp(logits).sum(-1))[..., None]
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("path", list(PATHS))
def test_kernels_match_the_reference(path, dtype, monkeypatch):
    # sinks from below the scores to far above them (a head whose rows are nearly all sink)
    ref, plain = check_path(path, dtype, monkeypatch, 1.5,
                            lambda N: dict(sinks=np.linspace(-2.0, 12.0, N).astype(np.float32)))
    assert np.abs(plain - ref).max() > 0.05


def test_sinks_with_softcap_and_a_mask():
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 2, 4, 2, 9, 11, 16, np.float32)
    keep = rng.random((9, 11)) < 0.6
    keep[:, 0] = True
    sinks = np.array([1.0, -1.0, 2.0, 0.0], np.float32)
    got = scaled_dot_product_attention(q, k, v, keep, enable_gqa=True, softcap=3.0,
                                       sinks=sinks)
    kw = _reference_kwargs(4, 2, 16, False, 3.0)
    kw.update(attn_mask=~keep[None], sparse_mode=1, sinks=sinks)
    assert_matches_reference(got, (q, k, v), kw, np.float32)


@pytest.mark.parametrize("bad, error, match", [
    (np.zeros(3, np.float32), ValueError, r"shape \(2,\), got shape \(3,\)"),
    (np.zeros((2, 1), np.float32), ValueError, "one value a query head"),
    (np.array(["a", "b"]), TypeError, "real numbers"),
    ([0.0, 1.0], TypeError, "sinks must be a NumPy array"),
])
def test_bad_sinks_are_refused(bad, error, match):
    q = np.zeros((1, 2, 3, 8), np.float32)
    with pytest.raises(error, match=match):
        scaled_dot_product_attention(q, q, q, sinks=bad)


def test_gpt_oss_matches_eager():
    torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")
    transformers = pytest.importorskip("transformers")
    import pfa_numba.integrations.transformers as pfa_hf
    name = pfa_hf.register()
    config_ = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0, sliding_window=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_,
                                                          attn_implementation="eager").eval()
    with torch.no_grad():            # sinks of the scores' size, so that they shape the result
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
    ids = torch.randint(1, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    logits = {}
    for attn in ("eager", name):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            logits[attn] = model(input_ids=ids, attention_mask=mask).logits.float()
    real = mask.bool()
    assert (logits[name][real] - logits["eager"][real]).abs().max() <= 1e-4
