"""fused_infer_attention_score against its float64 reference: the decode and prefill branches
over contiguous, left-padded, paged and prefixed kv caches, and the errors of its contract."""
import numpy as np
import pytest

from pfa_numba import config, reference
from pfa_numba.fia import fused_infer_attention_score as fia
from _cases import BF16, _eps

B, N, NKV, D = 3, 8, 2, 32
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)


def _x(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _check(args, kw, dtype):
    """The kernel against the reference: within twice the reference's own error in the input
    dtype, plus one ulp; lse to 1e-4 or twice the reference's own lse error in the input dtype
    (an int8 cache's values rounded to it); the placeholder lse without the flag."""
    out, lse = fia(*args, **kw)
    ref, ref_lse = reference.fused_infer_attention_score(*args, **kw)
    low, low_lse = reference.fused_infer_attention_score(*args, **kw, compute_dtype=dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    got = out.astype(np.float64)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), fin)
    err = np.abs(got[fin] - ref[fin]).max(initial=0.0)
    bound = 2 * np.abs(low[fin] - ref[fin]).max(initial=0.0) + \
        (_eps(dtype) + 16 * _eps(np.float32)) * max(1.0, np.abs(ref[fin]).max(initial=0.0))
    assert err <= bound, (err, bound)
    if kw.get("softmax_lse_flag"):
        assert lse.dtype == np.float32 and lse.shape == ref_lse.shape
        assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        ok = np.isfinite(ref_lse)
        assert np.abs(lse[ok] - ref_lse[ok]).max(initial=0.0) <= max(
            1e-4 * max(1.0, np.abs(ref_lse[ok]).max(initial=0.0)),
            2 * np.abs(low_lse[ok] - ref_lse[ok]).max(initial=0.0))
    else:
        assert lse.shape == (1,) and lse.dtype == np.float32 and not lse.any()
    return out, lse


def _kw(layout="BNSD", **kw):
    return dict(dict(num_heads=N, num_key_value_heads=NKV, input_layout=layout,
                     scale=D ** -0.5, softmax_lse_flag=True), **kw)


def _qkv(rng, layout, dtype, sq, skv, b=B):
    shapes = {"BNSD": ((b, N, sq, D), (b, NKV, skv, D)), "BSND": ((b, sq, N, D), (b, skv, NKV, D)),
              "BSH": ((b, sq, N * D), (b, skv, NKV * D)),
              "BNSD_BSND": ((b, N, sq, D), (b, NKV, skv, D))}[layout]
    return _x(rng, shapes[0], dtype), _x(rng, shapes[1], dtype), _x(rng, shapes[1], dtype)


@pytest.fixture(params=["default tiles", "small tiles", "kv heads in one run"])
def tiles(request, monkeypatch):
    """Tilings; decode items prefetch the next K rows with one and not with another, whatever
    this host's default."""
    if request.param == "small tiles":
        monkeypatch.setattr(config, "CPU_Q_ROWS", 12)
        monkeypatch.setattr(config, "CPU_KV_COLS", 7)
        monkeypatch.setattr(config, "CPU_PREFETCH_NEXT_KEYS", False)
    if request.param == "kv heads in one run":     # decode items: every kv head together
        monkeypatch.setattr(config, "CPU_SPLIT_KV_ITEMS", 0)
        monkeypatch.setattr(config, "CPU_KV_COLS", 24)
        monkeypatch.setattr(config, "CPU_PREFETCH_NEXT_KEYS", True)
    return request.param


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "BNSD_BSND"])
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
def test_decode_contiguous(tiles, layout, dtype):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, layout, dtype, 1, 70)
    mask = rng.random((B, 70)) < 0.3
    mask[2] = True                                   # a batch that keeps nothing
    _check((q, k, v), _kw(layout, atten_mask=mask, actual_seq_lengths_kv=[70, 33, 50],
                          sparse_mode=3, pre_tokens=-4, actual_seq_lengths=[9, 9, 9]), dtype)


@pytest.mark.parametrize("mode, tokens", [(0, (2147483647, 2147483647)), (0, (5, 2)),
                                          (2, (0, 0)), (3, (0, 0)), (4, (6, 1))])
def test_prefill_is_prompt_flash_attention_with_fia_names(tiles, mode, tokens):
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, "BSH", F16, 37, 53)
    mask = rng.random((B, 1, 37, 53)) < 0.2 if mode == 0 else \
        np.triu(np.ones((2048, 2048), bool), 1)
    pse = _x(rng, (1, N, 37, 53), F16)
    _check((q, k, v), _kw("BSH", atten_mask=mask, pse_shift=pse, sparse_mode=mode,
                          pre_tokens=tokens[0], next_tokens=tokens[1],
                          actual_seq_lengths=[37, 20, 0], actual_seq_lengths_kv=[53, 41, 7]),
           F16)


@pytest.mark.parametrize("sq", [1, 19])
def test_left_padding(tiles, sq):
    """Windows at the end of the padded frame, masks and pse read in the frame; batch 2's
    window does not fit (zeros, lse -inf)."""
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, "BNSD", F32, sq, 60)
    mask = rng.random((B, 1, sq, 60)) < 0.25
    pse = _x(rng, (B, N, sq, 60), F32)
    kw = _kw(kv_padding_size=np.array([4], np.int64), actual_seq_lengths_kv=[30, 56, 57],
             atten_mask=mask if sq > 1 else mask[:, 0, 0], pse_shift=pse)
    if sq > 1:
        kw.update(query_padding_size=np.array([2]), actual_seq_lengths=[10, 17, 3])
    out, lse = _check((q, k, v), kw, F32)
    assert not out[2].any() and np.isneginf(lse[2]).all()


@pytest.mark.parametrize("pool", ["3-d", "4-d"])
@pytest.mark.parametrize("sq", [1, 13])
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
def test_paged(tiles, pool, sq, dtype):
    """Shuffled, shared and repeated blocks; NaN in every slot no used entry names."""
    rng = np.random.default_rng(4)
    bs, nb = 8, 30
    lens = [45, 8, 0]
    table = np.full((B, 6), -1, np.int32)
    table[0] = rng.permutation(nb)[:6]
    table[1, 0] = table[0, 2]                        # a block shared with batch 0
    keys = np.full((nb, NKV, bs, D), np.nan, np.float32)
    vals = np.full((nb, NKV, bs, D), np.nan, np.float32)
    for b, n in enumerate(lens):
        for t in range(n):
            blk, off = table[b, t // bs], t % bs
            if b == 1:                               # batch 1 reads batch 0's block as is
                continue
            keys[blk, :, off] = rng.standard_normal((NKV, D))
            vals[blk, :, off] = rng.standard_normal((NKV, D))
    keys, vals = keys.astype(dtype), vals.astype(dtype)
    q = _x(rng, (B, N, sq, D), dtype)
    if pool == "3-d":
        keys, vals = (x.transpose(0, 2, 1, 3).reshape(nb, bs, NKV * D) for x in (keys, vals))
        q = np.ascontiguousarray(q.transpose(0, 2, 1, 3).reshape(B, sq, N * D))
    layout = "BNSD" if pool == "4-d" else "BSH"
    mask = rng.random((B, 1, sq, 48)) < 0.2
    out, _ = _check((q, keys, vals), _kw(layout, block_table=table, block_size=bs,
                                         actual_seq_lengths_kv=lens,
                                         atten_mask=mask if sq > 1 else mask[:, :, 0]), dtype)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("sq, mode", [(1, 0), (21, 0), (21, 3)])
def test_shared_prefix(tiles, sq, mode):
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, "BNSD", F16, sq, 40)
    pk, pv = _x(rng, (1, NKV, 12, D), F16), _x(rng, (1, NKV, 12, D), F16)
    mask = rng.random((B, 1, sq, 9 + 40)) < 0.2
    kw = _kw(key_shared_prefix=pk, value_shared_prefix=pv, actual_shared_prefix_len=9,
             actual_seq_lengths_kv=[40, 17, 0], sparse_mode=mode,
             atten_mask=(mask if sq > 1 else mask[:, 0]) if mode == 0 else
             np.triu(np.ones((2048, 2048), bool), 1))
    _check((q, k, v), kw, F16)


@pytest.mark.parametrize("sq", [1, 11])
def test_key_value_lists(tiles, sq):
    """One tensor a batch, each of its own length (lengths from the tensors, or fewer)."""
    rng = np.random.default_rng(9)
    sizes = [17, 40, 3]
    q = _x(rng, (B, sq, N * D), BF16)
    k = [_x(rng, (1, s, NKV * D), BF16) for s in sizes]
    v = [_x(rng, (1, s, NKV * D), BF16) for s in sizes]
    _check((q, k, v), _kw("BSH"), BF16)
    _check((q, k, v), _kw("BSH", actual_seq_lengths_kv=[10, 40, 0]), BF16)


def test_lse_placeholder_and_torch_tensors():
    torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, "BNSD", F32, 1, 20)
    out, lse = _check((q, k, v), _kw(softmax_lse_flag=False), F32)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    tout, tlse = fia(tq, tk, tv, **_kw(softmax_lse_flag=False))
    assert isinstance(tout, torch.Tensor) and np.array_equal(tout.numpy(), out)


def test_inputs_are_never_written():
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, "BNSD", F16, 5, 20)
    copies = [x.copy() for x in (q, k, v)]
    fia(q, k, v, **_kw())
    assert all(np.array_equal(a, c) for a, c in zip((q, k, v), copies))


@pytest.mark.parametrize("sq", [1, 9])
@pytest.mark.parametrize("out_int8", [False, True])
def test_int8_query_with_left_padding(sq, out_int8):
    """Full quantization (prompt_flash_attention's int8 pipeline, FIA's dequant_scale names)
    on a left-padded contiguous cache."""
    rng = np.random.default_rng(8)
    q = rng.integers(-20, 20, (B, N, sq, D)).astype(np.int8)
    k, v = (rng.integers(-20, 20, (B, NKV, 30, D)).astype(np.int8) for _ in range(2))
    kw = _kw(dequant_scale1=np.array([0.02], np.float32), quant_scale1=np.array([50.0], np.float32),
             dequant_scale2=np.array([0.01], np.float32), kv_padding_size=np.array([3]),
             actual_seq_lengths_kv=[20, 27, 5])
    if out_int8:
        kw["quant_scale2"] = np.array([30.0], np.float32)
    out, lse = fia(q, k, v, **kw)
    ref, ref_lse = reference.fused_infer_attention_score(q, k, v, **kw)
    assert out.dtype == (np.int8 if out_int8 else np.float16)
    # the int8 pipeline is modelled exactly; fp16 outputs within one fp16 rounding of it
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=1e-3, atol=1 if out_int8 else 1e-3)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)


def _int8(rng, shape):
    return rng.integers(-128, 128, shape).astype(np.int8)


def _antiquant_args(rng, form, S, nb=0, bs=0, b=B, nkv=NKV, d=D):
    """The antiquant keywords of each form (scales of a few 1e-2, offsets of a few units), for
    batch b, nkv kv heads of head dim d and S kv rows (paged: nb blocks of bs)."""
    def f16(*shape):
        return (rng.random(shape) * 0.02 + 0.005).astype(np.float16)

    def f32(*shape):
        return (rng.random(shape) * 0.02 + 0.005).astype(np.float32)
    off = lambda x: (rng.standard_normal(x.shape) * 3).astype(x.dtype)      # noqa: E731
    if form == "merged per-tensor":
        s = f16(2)
        return dict(antiquant_scale=s, antiquant_offset=off(s))
    if form == "merged per-channel":
        s = f16(2, nkv * d)
        return dict(antiquant_scale=s, antiquant_offset=off(s))
    if form == "merged per-token":
        return dict(antiquant_scale=f32(2, b, S + 3), antiquant_mode=1)
    if form == "per-channel key, per-token value":
        return dict(key_antiquant_scale=f16(nkv, 1, d), key_antiquant_mode=0,
                    value_antiquant_scale=f32(b, S), value_antiquant_mode=1)
    if form == "per-head":
        ks, vs = f16(nkv), f16(nkv)
        return dict(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=off(ks),
                    value_antiquant_offset=off(vs), key_antiquant_mode=2, value_antiquant_mode=2)
    if form == "per-token-head":
        ks, vs = f32(b, nkv, S), f32(b, nkv, S)
        return dict(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=off(ks),
                    value_antiquant_offset=off(vs), key_antiquant_mode=3, value_antiquant_mode=3)
    if form == "paged per-token":
        return dict(key_antiquant_scale=f32(nb, bs), value_antiquant_scale=f32(nb, bs),
                    key_antiquant_mode=4, value_antiquant_mode=4)
    ks, vs = f32(nb, nkv, bs), f32(nb, nkv, bs)                    # paged per-token-head
    return dict(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=off(ks),
                value_antiquant_offset=off(vs), key_antiquant_mode=5, value_antiquant_mode=5)


CONTIGUOUS_FORMS = ["merged per-tensor", "merged per-channel", "merged per-token",
                    "per-channel key, per-token value", "per-head", "per-token-head"]


@pytest.mark.parametrize("form", CONTIGUOUS_FORMS)
@pytest.mark.parametrize("sq, dtype", [(1, F16), (9, BF16), (1, F32)], ids=["decode-fp16",
                                                                           "prefill-bf16",
                                                                           "decode-fp32"])
def test_int8_kv_cache_dequantized_as_it_loads(tiles, form, sq, dtype):
    """int8 key/value with a float query, every scale form, on a left-padded cache."""
    rng = np.random.default_rng(10)
    S = 45
    q = _x(rng, (B, N, sq, D), dtype)
    k, v = _int8(rng, (B, NKV, S, D)), _int8(rng, (B, NKV, S, D))
    kw = _kw(kv_padding_size=np.array([2]), actual_seq_lengths_kv=[40, 11, 0],
             **_antiquant_args(rng, form, S))
    if dtype != F16:      # per-tensor / per-channel / per-head scales take the query's dtype
        kw = {n: (x.astype(dtype) if isinstance(x, np.ndarray) and x.dtype == F16 else x)
              for n, x in kw.items()}
    _check((q, k, v), kw, dtype)


#: learnable_sink: one logit a query head, large enough to take much of each row's weight
SINKS = np.linspace(-2.0, 4.0, N).astype(np.float32)


@pytest.mark.parametrize("sinks", [None, SINKS.astype(F16)], ids=["", "learnable-sink"])
@pytest.mark.parametrize("form", ["paged per-token", "paged per-token-head", "per-head"])
def test_int8_paged_cache(tiles, form, sinks):
    rng = np.random.default_rng(11)
    nb, bs = 12, 8
    table = rng.permutation(nb)[:B * 4].reshape(B, 4).astype(np.int32)
    k, v = _int8(rng, (nb, NKV, bs, D)), _int8(rng, (nb, NKV, bs, D))
    q = _x(rng, (B, N, 1, D), F16)
    _check((q, k, v), _kw(block_table=table, block_size=bs, actual_seq_lengths_kv=[32, 9, 17],
                          learnable_sink=sinks, **_antiquant_args(rng, form, 32, nb, bs)), F16)


def test_int8_kv_with_a_shared_prefix():
    rng = np.random.default_rng(12)
    q = _x(rng, (B, N, 7, D), F16)
    k, v = _int8(rng, (B, NKV, 20, D)), _int8(rng, (B, NKV, 20, D))
    pk, pv = _int8(rng, (1, NKV, 6, D)), _int8(rng, (1, NKV, 6, D))
    _check((q, k, v), _kw(key_shared_prefix=pk, value_shared_prefix=pv,
                          **_antiquant_args(rng, "merged per-channel", 20)), F16)


@pytest.mark.parametrize("sq, mode", [(1, 0), (21, 3)], ids=["decode", "prefill-causal"])
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
def test_learnable_sink_on_a_contiguous_cache(tiles, sq, mode, dtype):
    """Each head's sink logit joins the softmax denominators and softmax_lse; an empty kv
    (batch 2) keeps nothing: zeros and lse -inf, the sink taking no row of its own."""
    rng = np.random.default_rng(12)
    q, k, v = _qkv(rng, "BNSD", dtype, sq, 40)
    causal = np.triu(np.ones((2048, 2048), bool), 1) if mode == 3 else None
    kw = _kw(sparse_mode=mode, atten_mask=causal, actual_seq_lengths_kv=[40, 17, 0],
             learnable_sink=SINKS)
    out, lse = _check((q, k, v), kw, dtype)
    plain, _ = fia(q, k, v, **dict(kw, learnable_sink=None))
    assert not np.array_equal(out, plain)
    assert not out[2].any() and np.isneginf(lse[2]).all()


def test_learnable_sink_refusals_and_plans():
    """A sink a head (ValueError), real numbers (TypeError), float queries only
    (RuntimeError); a plan keeps the sinks it was made with."""
    from pfa_numba import FiaPlan
    rng = np.random.default_rng(14)
    q, k, v = _qkv(rng, "BNSD", F16, 1, 30)
    with pytest.raises(ValueError, match=r"learnable_sink must have one value a query head, "
                                         r"shape \(8,\), got shape \(2,\)"):
        fia(q, k, v, **_kw(learnable_sink=np.zeros(2, np.float32)))
    with pytest.raises(TypeError, match="learnable_sink must hold real numbers"):
        fia(q, k, v, **_kw(learnable_sink=np.zeros(N, bool)))
    q8, k8 = (rng.integers(-5, 5, x.shape).astype(np.int8) for x in (q, k))
    with pytest.raises(RuntimeError, match="learnable_sink takes a float query"):
        fia(q8, k8, k8, **_kw(learnable_sink=SINKS, dequant_scale1=np.ones(1, np.float32),
                              quant_scale1=np.ones(1, np.float32),
                              dequant_scale2=np.ones(1, np.float32)))
    plan = FiaPlan(q, k, v, **_kw(learnable_sink=SINKS))
    np.testing.assert_array_equal(plan(q, k, v)[0], fia(q, k, v, **_kw(learnable_sink=SINKS))[0])
