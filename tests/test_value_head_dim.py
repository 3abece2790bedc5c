"""A value head dim of its own (Dv != D, an extension: multi-head latent attention's query /
key head dim nope + rope beside its value head dim): prompt_flash_attention in every layout,
fused_infer_attention_score over every cache form, the SDPA drop-in and its gradients, against
the reference (float64, written from the contract) with data-derived tolerances; and the
errors and refusals that name both head dims."""
import numpy as np
import pytest

from pfa_numba import (FiaPlan, PfaPlan, config, explain, fused_infer_attention_score,
                       merge_attention, prompt_flash_attention, reference)
from _cases import BF16, assert_matches_reference, to_layout
from test_quant import assert_fp16_close, assert_int8_close

#: (D, Dv): value narrower and wider than query / key; multiples of 16 for bfloat16
DIMS = [(32, 16), (16, 48)]
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32)]
IDS = ["fp16", "bf16", "fp32"]
CAUSAL = np.triu(np.ones((2048, 2048), bool), 1)


def _qkv(rng, layout, dtype, shape, d, dv):
    """q, k, v in ``layout``: shape = (B, N, Nkv, Sq, Skv); q and k of head dim d, v of dv."""
    B, N, Nkv, Sq, Skv = shape

    def r(*s):
        return rng.standard_normal(s).astype(np.float32).astype(dtype)
    return (to_layout(r(B, N, Sq, d), layout), to_layout(r(B, Nkv, Skv, d), layout),
            to_layout(r(B, Nkv, Skv, dv), layout))


@pytest.fixture(params=["default tiles", "small tiles", "split kv"])
def tiles(request, monkeypatch):
    """Tilings that cut the head dims' rows differently, and split-kv's pieces and merge."""
    if request.param == "small tiles":
        monkeypatch.setattr(config, "CPU_Q_ROWS", 12)
        monkeypatch.setattr(config, "CPU_KV_COLS", 7)
    if request.param == "split kv":
        monkeypatch.setattr(config, "CPU_SPLIT_KV_MIN_COLS", 16)
        monkeypatch.setattr(config, "CPU_SPLIT_KV_ITEMS", 4)
    return request.param


@pytest.mark.parametrize("d, dv", DIMS, ids=[f"D{d}-Dv{dv}" for d, dv in DIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("layout", ["BNSD", "BSH", "BSND", "BNSD_BSND"])
@pytest.mark.parametrize("sq", [1, 37])
def test_prompt_flash_attention_in_every_layout(tiles, layout, dtype, d, dv, sq):
    """GQA, Sq != Skv, the causal band and per-batch lengths (batch 1 keeps 9 kv columns)."""
    rng = np.random.default_rng(d + dv + sq)
    args = _qkv(rng, layout, dtype, (2, 4, 2, sq, 90), d, dv)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout=layout, scale_value=d ** -0.5,
              sparse_mode=3 if sq > 1 else 0, actual_seq_lengths_kv=[90, 9])
    mask = CAUSAL if sq > 1 else None
    out, lse = prompt_flash_attention(*args, mask, **kw, return_softmax_lse=True)
    assert out.shape == reference.from_bnsd(np.zeros((2, 4, sq, dv)), layout).shape
    assert_matches_reference(out, (*args, mask), kw, dtype, lse=lse)


@pytest.mark.parametrize("inner_precise", [0, 2])
def test_rows_that_keep_nothing(inner_precise):
    """A user mask that drops whole rows: the mean of V's Dv columns (inner_precise 0) or
    zeros (2), as with Dv = D."""
    rng = np.random.default_rng(3)
    args = _qkv(rng, "BNSD", np.float32, (1, 2, 2, 20, 30), 24, 40)
    mask = rng.random((20, 30)) < 0.3
    mask[[2, 7]] = True
    kw = dict(num_heads=2, input_layout="BNSD", inner_precise=inner_precise)
    out, lse = prompt_flash_attention(*args, mask, **kw, return_softmax_lse=True)
    assert np.isneginf(lse[0, :, [2, 7]]).all()
    assert_matches_reference(out, (*args, mask), kw, np.float32, lse=lse)


def test_packed_tnd():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((30, n, d)).astype(np.float16)
               for n, d in ((4, 32), (2, 32), (2, 16)))
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="TND", sparse_mode=3,
              actual_seq_lengths=[12, 30], actual_seq_lengths_kv=[12, 30])
    out = prompt_flash_attention(q, k, v, CAUSAL, **kw)
    assert out.shape == (30, 4, 16)
    assert_matches_reference(out, (q, k, v, CAUSAL), kw, np.float16)


def test_an_int8_result_quantizes_the_value_head_dims_channels():
    """quant_scale2 per channel: N * Dv values."""
    rng = np.random.default_rng(5)
    args = _qkv(rng, "BSH", np.float16, (1, 2, 2, 16, 40), 64, 32)
    scale2 = (rng.random(2 * 32) * 20 + 10).astype(np.float32)
    kw = dict(num_heads=2, input_layout="BSH", scale_value=0.125, quant_scale2=scale2)
    out = prompt_flash_attention(*args, **kw)
    want = reference.prompt_flash_attention(*args, **kw)
    assert out.dtype == np.int8 and out.shape == (1, 16, 64)
    assert np.abs(out.astype(np.int32) - want).max() <= 1        # one step of rounding


def test_merged_halves_equal_the_whole_and_plans_equal_calls():
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, "BNSD", np.float32, (1, 4, 2, 7, 60), 24, 40)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", return_softmax_lse=True)
    whole = prompt_flash_attention(q, k, v, **kw)
    halves = [prompt_flash_attention(q, k[:, :, s], v[:, :, s], **kw)
              for s in (slice(0, 25), slice(25, 60))]
    out, lse = merge_attention(halves, "BNSD")
    np.testing.assert_allclose(out, whole[0], atol=1e-6)
    np.testing.assert_allclose(lse, whole[1], atol=1e-5)
    plan = PfaPlan(q, k, v, **kw)
    np.testing.assert_array_equal(plan(q, k, v)[0], whole[0])


def _fia_check(args, kw, dtype):
    out, lse = fused_infer_attention_score(*args, **kw)
    want, want_lse = reference.fused_infer_attention_score(*args, **kw)
    low, _ = reference.fused_infer_attention_score(*args, **kw, compute_dtype=dtype)
    assert out.shape == want.shape and out.dtype == dtype
    fin = np.isfinite(want)
    err = np.abs(out.astype(np.float64)[fin] - want[fin]).max(initial=0.0)
    eps = float(np.finfo(np.float16).eps if dtype == np.float16 else 2.0 ** -23)
    assert err <= 2 * np.abs(low[fin] - want[fin]).max(initial=0.0) + 2 * eps * max(
        1.0, np.abs(want[fin]).max(initial=0.0))
    ok = np.isfinite(want_lse)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    assert np.abs(lse[ok] - want_lse[ok]).max(initial=0.0) <= 1e-4 * max(
        1.0, np.abs(want_lse[ok]).max(initial=0.0))
    return out


@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
@pytest.mark.parametrize("form", ["contiguous", "paged", "prefix", "lists", "int8 per channel",
                                  "int8 paged per token"])
def test_fused_infer_attention_score_over_every_cache_form(tiles, layout, form):
    """Decode against a contiguous, paged, prefixed, listed and int8 cache whose value rows
    have their own head dim (a batch of an empty cache: zeros, lse -inf)."""
    rng = np.random.default_rng(7)
    B, N, NKV, D, DV, S, bs, nb = 3, 8, 2, 32, 16, 40, 8, 20
    lay = lambda x: to_layout(x, layout)                                # noqa: E731
    q = lay(rng.standard_normal((B, N, 1, D)).astype(np.float16))
    k = rng.standard_normal((B, NKV, S, D)).astype(np.float16)
    v = rng.standard_normal((B, NKV, S, DV)).astype(np.float16)
    kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout=layout, scale=D ** -0.5,
              softmax_lse_flag=True, actual_seq_lengths_kv=[40, 13, 0])
    if form in ("paged", "int8 paged per token"):
        table = rng.permutation(nb)[:B * 5].reshape(B, 5).astype(np.int32)
        pools = [rng.standard_normal((nb, NKV, bs, d)).astype(np.float16) for d in (D, DV)]
        if layout == "BSH":
            pools = [x.transpose(0, 2, 1, 3).reshape(nb, bs, -1) for x in pools]
        kw.update(block_table=table, block_size=bs)
        k, v = pools
        if form == "int8 paged per token":
            k, v = (np.clip(np.round(x * 30), -127, 127).astype(np.int8) for x in pools)
            kw.update(key_antiquant_mode=4, value_antiquant_mode=4,
                      key_antiquant_scale=(rng.random((nb, bs)) * 0.05).astype(np.float32),
                      value_antiquant_scale=(rng.random((nb, bs)) * 0.05).astype(np.float32))
        args = (q, k, v)
    elif form == "prefix":
        kw.update(key_shared_prefix=lay(k[:1, :, :6]), value_shared_prefix=lay(v[:1, :, :6]))
        args = (q, lay(k), lay(v))
    elif form == "lists":
        kw.pop("actual_seq_lengths_kv")
        args = (q, [lay(k[b:b + 1, :, :n]) for b, n in enumerate((40, 13, 1))],
                [lay(v[b:b + 1, :, :n]) for b, n in enumerate((40, 13, 1))])
    elif form == "int8 per channel":
        k8, v8 = (np.clip(np.round(x * 30), -127, 127).astype(np.int8) for x in (k, v))
        kw.update(key_antiquant_scale=(rng.random((NKV, D)) * 0.05).astype(np.float16),
                  value_antiquant_scale=(rng.random((NKV, DV)) * 0.05).astype(np.float16),
                  key_antiquant_offset=rng.random((NKV, D)).astype(np.float16),
                  value_antiquant_offset=rng.random((NKV, DV)).astype(np.float16))
        args = (q, lay(k8), lay(v8))
    else:
        args = (q, lay(k), lay(v))
    out = _fia_check(args, kw, np.float16)
    if form not in ("lists", "prefix"):
        assert not out[2].any()
    plan = FiaPlan(*args, **kw)
    np.testing.assert_array_equal(plan(*args)[0], out)


@pytest.mark.parametrize("call, error, words", [
    (dict(value=(1, 4, 2 * 13 + 1)), RuntimeError,
     r"value hidden size Hkv \(27\) must be divisible by num_key_value_heads \(2\)"),
    (dict(value=(1, 4, 2 * 513)), RuntimeError, r"value's head dim Dv must be <= 512, got 513"),
    (dict(value=(1, 4, 0)), RuntimeError, r"value's head dim Dv must be > 0, got 0"),
    (dict(key=(1, 4, 2 * 24)), RuntimeError, r"head dim D differs between query \(32\) and key "
                                             r"\(24 = 48 / 2 heads\)"),
])
def test_shape_errors_name_both_head_dims(call, error, words):
    shapes = dict(dict(query=(1, 3, 4 * 32), key=(1, 4, 2 * 32), value=(1, 4, 2 * 16)), **call)
    q, k, v = (np.zeros(shapes[n], np.float16) for n in ("query", "key", "value"))
    with pytest.raises(error, match=words):
        prompt_flash_attention(q, k, v, num_heads=4, num_key_value_heads=2, input_layout="BSH")


@pytest.mark.parametrize("d, dv", [(32, 16), (16, 64)])
@pytest.mark.parametrize("out_int8", [False, True], ids=["fp16-out", "int8-out"])
def test_the_int8_pipeline(d, dv, out_int8):
    """int8 query, key and value: the exact integer model of contract 'Quantization' over
    value's own head dim, float16 or int8 out (a fully masked row among them)."""
    from pfa_numba import trans_quant_param
    rng = np.random.default_rng(d + dv)
    q8, k8 = (rng.integers(-100, 100, (2, 2, s, d)).astype(np.int8) for s in (9, 30))
    v8 = rng.integers(-100, 100, (2, 2, 30, dv)).astype(np.int8)
    mask = rng.random((2, 1, 9, 30)) < 0.3
    mask[1, 0, 4] = True
    kw = dict(deq_scale1=trans_quant_param(np.array([1e-4], np.float32)),
              deq_scale2=trans_quant_param(np.array([1e-3], np.float32)),
              quant_scale1=np.array([100.0], np.float32), num_heads=2, input_layout="BNSD")
    if out_int8:
        kw["quant_scale2"] = np.array([3.0], np.float32)
    out = prompt_flash_attention(q8, k8, v8, mask, **kw)
    want = reference.prompt_flash_attention(q8, k8, v8, mask, **kw)
    assert out.shape == (2, 2, 9, dv)
    if out_int8:
        assert_int8_close(out, want)
    else:        # the model's P8 roundings: the tolerance of the int8 pipeline's own tests
        assert_fp16_close(out, want, 1e-3, v8)


def test_the_cuda_kernels_refuse_it_by_name():
    """For now every CUDA kernel takes Dv = D only (explain for a described GPU); the CPU's
    float32 tiles take the call."""
    pytest.importorskip("numba_cuda", reason="the cuda extra")
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, "BNSD", np.float16, (1, 8, 8, 128, 128), 192, 128)
    with pytest.raises(RuntimeError, match="portable: value head dim Dv = 128 with head dim "
                                           "D = 192"):
        explain(q, k, v, num_heads=8, input_layout="BNSD", device="cuda",
                compute_capability=(9, 0), sms=132)
    assert "-tiles kernel runs this call" in explain(q, k, v, num_heads=8, input_layout="BNSD")


def test_merged_per_channel_antiquant_scales_take_dv_equal_to_d():
    """FIA's antiquant_scale per channel holds key's and value's channels in one array."""
    q = np.zeros((1, 8, 1, 192), np.float16)
    k8, v8 = (np.zeros((1, 8, 20, d), np.int8) for d in (192, 128))
    with pytest.raises(RuntimeError, match="antiquant_scale per channel holds key's and value's"):
        fused_infer_attention_score(q[:, :, :1], k8, v8, num_heads=8, input_layout="BNSD",
                                    antiquant_scale=np.ones((2, 8, 192), np.float16))
