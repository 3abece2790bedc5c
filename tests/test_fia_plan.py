"""FiaPlan: a fused_infer_attention_score call planned once and run on the query, key and
value arrays of other layers: what the whole call gives (bit for bit) and what the float64
reference gives, the plan's own errors, and its captured arguments."""
import numpy as np
import pytest

from pfa_numba import FiaPlan, fused_infer_attention_score as fia, reference
from _cases import BF16, _eps

B, N, NKV, D = 3, 8, 2, 32
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)


def _x(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _kw(layout="BNSD", **kw):
    return dict(dict(num_heads=N, num_key_value_heads=NKV, input_layout=layout,
                     scale=D ** -0.5, softmax_lse_flag=True), **kw)


def _layers(make, count=3):
    """``count`` layers' (query, key, value): the same geometry, other data."""
    return [make(np.random.default_rng(100 + i)) for i in range(count)]


def _assert_like_the_call(plan, layers, kw, fast=True):
    """Each layer through the plan: bit-identical to the whole call, which (float outputs)
    is within twice the reference's own error in the input dtype of the float64 reference;
    no input written."""
    assert (plan._launch is not None) == fast
    for q, k, v in layers:
        before = [np.array(x, copy=True) for x in (q, k, v)] if not isinstance(k, list) else []
        out, lse = plan(q, k, v)
        want, want_lse = fia(q, k, v, **kw)
        assert out.dtype == want.dtype and out.shape == want.shape
        assert np.array_equal(out.view(np.uint8), want.view(np.uint8))
        assert np.array_equal(lse, want_lse)
        assert all(np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
                   for a, b in zip(before, (q, k, v)))
        if out.dtype == np.int8:
            continue
        ref, _ = reference.fused_infer_attention_score(q, k, v, **kw)
        low, _ = reference.fused_infer_attention_score(q, k, v, **kw, compute_dtype=out.dtype)
        fin = np.isfinite(ref)
        assert np.array_equal(np.isfinite(out.astype(np.float64)), fin)
        err = np.abs(out.astype(np.float64)[fin] - ref[fin]).max(initial=0.0)
        bound = 2 * np.abs(low[fin] - ref[fin]).max(initial=0.0) + (
            _eps(out.dtype) + 16 * _eps(np.float32)) * max(1.0, np.abs(ref[fin]).max(initial=0.0))
        assert err <= bound, (err, bound)


def _qkv_maker(layout, dtype, sq, skv):
    shapes = {"BNSD": ((B, N, sq, D), (B, NKV, skv, D)), "BSND": ((B, sq, N, D), (B, skv, NKV, D)),
              "BSH": ((B, sq, N * D), (B, skv, NKV * D))}[layout]
    return lambda rng: (_x(rng, shapes[0], dtype), _x(rng, shapes[1], dtype),
                        _x(rng, shapes[1], dtype))


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH"])
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("sq", [1, 13])
def test_contiguous(layout, dtype, sq):
    rng = np.random.default_rng(1)
    mask = rng.random((B, 1, sq, 70)) < 0.3
    kw = _kw(layout, atten_mask=mask if sq > 1 else mask[:, 0, 0],
             actual_seq_lengths_kv=[70, 33, 0], next_tokens=57,
             actual_seq_lengths=None if sq == 1 else [13, 5, 9])
    layers = _layers(_qkv_maker(layout, dtype, sq, 70))
    _assert_like_the_call(FiaPlan(*layers[0], **kw), layers, kw)


@pytest.mark.parametrize("pool", ["3-d", "4-d"])
def test_paged_with_nan_in_unused_slots(pool):
    """Each layer's pools hold NaN in every slot the table's used entries do not name."""
    bs, nb, lens = 8, 20, [45, 8, 0]
    table = np.full((B, 6), -1, np.int32)
    table[0] = np.random.default_rng(2).permutation(nb)[:6]
    table[1, 0] = table[0, 3]

    def layer(rng):
        pools = []
        for _ in range(2):
            x = np.full((nb, NKV, bs, D), np.nan, np.float32)
            for b, n in enumerate(lens):
                for t in range(n):
                    x[table[b, t // bs], :, t % bs] = rng.standard_normal((NKV, D))
            x = x.astype(F16)
            pools.append(x if pool == "4-d" else
                         np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(nb, bs, NKV * D))
        q = _x(rng, (B, N, 1, D) if pool == "4-d" else (B, 1, N * D), F16)
        return (q, *pools)

    kw = _kw("BNSD" if pool == "4-d" else "BSH", block_table=table, block_size=bs,
             actual_seq_lengths_kv=lens)
    layers = _layers(layer)
    plan = FiaPlan(*layers[0], **kw)
    _assert_like_the_call(plan, layers, kw)
    assert all(np.isfinite(plan(*x)[0]).all() for x in layers)


def test_left_padding_prefix_and_int8_caches():
    rng = np.random.default_rng(3)
    pad = _kw(kv_padding_size=np.array([4]), actual_seq_lengths_kv=[30, 56, 57])
    layers = _layers(_qkv_maker("BNSD", F32, 1, 60))
    _assert_like_the_call(FiaPlan(*layers[0], **pad), layers, pad)

    prefix = _kw(key_shared_prefix=_x(rng, (1, NKV, 12, D), F16),
                 value_shared_prefix=_x(rng, (1, NKV, 12, D), F16), actual_shared_prefix_len=9,
                 actual_seq_lengths_kv=[40, 17, 0])
    layers = _layers(_qkv_maker("BNSD", F16, 1, 40))
    _assert_like_the_call(FiaPlan(*layers[0], **prefix), layers, prefix)

    def int8_layer(r):
        return (_x(r, (B, N, 1, D), F16), r.integers(-127, 128, (B, NKV, 50, D), dtype=np.int8),
                r.integers(-127, 128, (B, NKV, 50, D), dtype=np.int8))

    int8 = _kw(key_antiquant_scale=np.abs(_x(rng, (NKV, D), F16)) / 60,
               value_antiquant_scale=np.abs(_x(rng, (B, 50), F32)) / 60,
               key_antiquant_mode=0, value_antiquant_mode=1, actual_seq_lengths_kv=[50, 21, 3])
    layers = _layers(int8_layer)
    _assert_like_the_call(FiaPlan(*layers[0], **int8), layers, int8)


def test_int8_query_and_output_and_prefill():
    def layer(r):
        q = r.integers(-20, 20, (B, N, 9, D)).astype(np.int8)
        return (q, *(r.integers(-20, 20, (B, NKV, 30, D)).astype(np.int8) for _ in range(2)))

    kw = _kw(dequant_scale1=np.array([0.02], np.float32), quant_scale1=np.array([50.0], np.float32),
             dequant_scale2=np.array([0.01], np.float32), quant_scale2=np.array([30.0], np.float32),
             actual_seq_lengths=[9, 4, 0], softmax_lse_flag=False)
    layers = _layers(layer)
    _assert_like_the_call(FiaPlan(*layers[0], **kw), layers, kw)


def test_strided_views_are_read_in_place():
    """Views that are not contiguous (kv rows reversed, a query sliced from a larger array)
    run on the plan's kernel call like contiguous ones."""
    def layer(r):
        q = _x(r, (B, N, 3, D), BF16)[:, :, 1:2]
        k, v = (_x(r, (B, NKV, 40, D), BF16)[:, :, ::-1] for _ in range(2))
        return q, k, v

    layers = _layers(layer)
    kw = _kw(actual_seq_lengths_kv=[40, 12, 39])
    _assert_like_the_call(FiaPlan(*layers[0], **kw), layers, kw)


def test_key_value_lists_run_whole_calls():
    def layer(r):
        return (_x(r, (B, 1, N * D), F16), [_x(r, (1, s, NKV * D), F16) for s in (7, 30, 2)],
                [_x(r, (1, s, NKV * D), F16) for s in (7, 30, 2)])

    layers = _layers(layer)
    kw = _kw("BSH")
    _assert_like_the_call(FiaPlan(*layers[0], **kw), layers, kw, fast=False)


def test_torch_tensors():
    torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")
    layers = _layers(_qkv_maker("BNSD", BF16, 1, 33))
    tensors = [tuple(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in layer)
               for layer in layers]
    kw = _kw(softmax_lse_flag=False)
    plan = FiaPlan(*tensors[0], **kw)
    assert plan._launch is not None
    for t, layer in zip(tensors, layers):
        out, lse = plan(*t)
        want, want_lse = fia(*layer, **kw)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
        assert np.array_equal(out.view(torch.int16).numpy(), want.view(np.int16))
        assert isinstance(lse, torch.Tensor) and np.array_equal(lse.numpy(), want_lse)


def test_captured_arguments():
    """The block table and lengths are the plan's as they were when it was made; the mask is
    read at each call."""
    rng = np.random.default_rng(4)
    bs, nb = 4, 12
    table = np.arange(nb, dtype=np.int64).reshape(B, 4)
    q, k, v = _x(rng, (B, N, 1, D), F32), _x(rng, (nb, NKV, bs, D), F32), \
        _x(rng, (nb, NKV, bs, D), F32)
    mask = np.zeros((B, 16), bool)
    lens = [16, 9, 5]
    kw = _kw(block_table=table, block_size=bs, actual_seq_lengths_kv=lens, atten_mask=mask)
    plan = FiaPlan(q, k, v, **kw)
    want = fia(q, k, v, **kw)[0]
    table[:] = table[::-1].copy()
    lens[0] = 3
    assert np.array_equal(plan(q, k, v)[0], want)
    mask[:, :2] = True
    masked = fia(q, k, v, **dict(kw, block_table=table[::-1].copy(),
                                 actual_seq_lengths_kv=[16, 9, 5]))[0]
    assert np.array_equal(plan(q, k, v)[0], masked)


def test_errors():
    rng = np.random.default_rng(5)
    q, k, v = _qkv_maker("BNSD", F16, 1, 20)(rng)
    with pytest.raises(RuntimeError) as called:
        fia(q, k, v, **_kw(num_key_value_heads=3))
    with pytest.raises(RuntimeError) as planned:
        FiaPlan(q, k, v, **_kw(num_key_value_heads=3))
    assert str(planned.value) == str(called.value)
    with pytest.raises(TypeError, match="fused_infer_attention_score's arguments.*not_an_arg"):
        FiaPlan(q, k, v, not_an_argument=1)
    plan = FiaPlan(q, k, v, **_kw())
    with pytest.raises(TypeError, match=r"key must be a float16 NumPy array .*got a float32"):
        plan(q, k.astype(F32), v)
    with pytest.raises(RuntimeError, match=r"value must be .* shape \(3, 2, 20, 32\).*got .* "
                                           r"shape \(3, 2, 21, 32\)"):
        plan(q, k, _x(rng, (B, NKV, 21, D), F16))
    with pytest.raises(RuntimeError, match="strides"):
        plan(q, k, np.asfortranarray(v))
    with pytest.raises(TypeError, match="query must be .* got a list of 3 elements"):
        plan(list(q), k, v)
    with pytest.raises(TypeError, match="key must be .* got a NoneType$"):
        plan(q, None, v)
    torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")
    with pytest.raises(TypeError, match="query must be a float16 NumPy array .* got a "
                                        "torch.float16 torch tensor"):
        plan(torch.from_numpy(q), k, v)
    tensors = FiaPlan(*(torch.from_numpy(x) for x in (q, k, v)), **_kw())
    with pytest.raises(RuntimeError, match="key must be .* on cpu, .* got .* on meta"):
        tensors(torch.from_numpy(q), torch.empty(k.shape, dtype=torch.float16, device="meta"),
                torch.from_numpy(v))


def test_arrays_not_read_in_place_run_whole_calls():
    """A misaligned array with the planned strides, and a torch tensor whose negation NumPy
    cannot see, run whole calls (the kernels would read a copy with the planned strides)."""
    rng = np.random.default_rng(6)
    q, v = _x(rng, (B, N, 1, D), F32), _x(rng, (B, NKV, 40, D), F32)
    planned = _x(rng, (B, NKV, 40, 2 * D), F32)[..., :D]
    kw = _kw()
    plan = FiaPlan(q, planned, v, **kw)
    assert plan._launch is not None
    words = sum((n - 1) * s for n, s in zip(planned.shape, planned.strides)) // 4 + 1
    odd = np.zeros(4 * words + 1, np.uint8)[1:]
    k = np.lib.stride_tricks.as_strided(np.ndarray((words,), F32, buffer=odd.data),
                                        planned.shape, planned.strides)
    k[...] = _x(rng, planned.shape, F32)
    assert not k.flags.aligned
    assert np.array_equal(plan(q, k, v)[0], fia(q, k, v, **kw)[0])
    torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")
    tq, tv = torch.from_numpy(q), torch.from_numpy(v)
    tplan = FiaPlan(tq, torch.randn(planned.shape, dtype=torch.complex64).imag, tv, **kw)
    negated = torch.randn(planned.shape, dtype=torch.complex64).conj().imag
    assert negated.is_neg()
    assert torch.equal(tplan(tq, negated, tv)[0], fia(tq, negated, tv, **kw)[0])


def test_whole_calls_use_the_arguments_as_planned():
    """A plan that runs whole calls (key / value lists) keeps its lengths as they were too."""
    rng = np.random.default_rng(7)
    q = _x(rng, (2, 1, N * D), F16)
    keys, values = ([_x(rng, (1, s, NKV * D), F16) for s in (10, 20)] for _ in range(2))
    lens = [10, 20]
    plan = FiaPlan(q, keys, values, **_kw("BSH", actual_seq_lengths_kv=lens))
    want = fia(q, keys, values, **_kw("BSH", actual_seq_lengths_kv=[10, 20]))[0]
    lens[1] = 3
    assert np.array_equal(plan(q, keys, values)[0], want)


@pytest.mark.parametrize("when", ["first call", "after a call"])
def test_a_plan_refuses_what_the_whole_call_refuses(when):
    """A masked array (whose mask the kernels would drop) is the whole call's TypeError, on a
    plan's first call and after the kernel has run; a memoryview is a TypeError, not an
    AttributeError, when the plan is made and when it is called."""
    rng = np.random.default_rng(8)
    q, k, v = _qkv_maker("BNSD", F16, 1, 20)(rng)
    kw = _kw()
    masked = np.ma.masked_array(k, mask=rng.random(k.shape) < 0.5)
    with pytest.raises(TypeError) as whole:
        fia(q, masked, v, **kw)
    plan = FiaPlan(q, k, v, **kw)
    if when == "after a call":
        plan(q, k, v)
    with pytest.raises(TypeError) as planned:
        plan(q, masked, v)
    assert str(planned.value) == str(whole.value)
    with pytest.raises(TypeError, match="query must be a NumPy array, a torch tensor or a CUDA "
                                        "array, got memoryview"):
        FiaPlan(memoryview(q), k, v, **kw)
    with pytest.raises(TypeError, match="value must be a float16 NumPy array .* got a memoryview"):
        plan(q, k, memoryview(v))
    torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")
    tensors = [torch.from_numpy(x) for x in (q, k, v)]
    tensor_plan = FiaPlan(*tensors, **kw)
    if when == "after a call":
        tensor_plan(*tensors)
    grad = torch.from_numpy(k).float().half().requires_grad_()
    with pytest.raises(RuntimeError) as whole:
        fia(tensors[0], grad, tensors[2], **kw)
    with pytest.raises(RuntimeError) as planned:
        tensor_plan(tensors[0], grad, tensors[2])
    assert "requires grad" in str(planned.value) and str(planned.value) == str(whole.value)


def test_token_scales_are_read_at_each_call_and_channel_scales_as_planned():
    """Scales indexed by token (as large as the cache) are read where they lie at each call,
    like the tensors; the others (here per-channel key scales) are the plan's."""
    rng = np.random.default_rng(9)
    q = _x(rng, (B, N, 1, D), F16)
    k, v = (rng.integers(-128, 128, (B, NKV, 30, D)).astype(np.int8) for _ in range(2))
    key_scale = np.full((NKV, D), 0.02, np.float16)
    value_scale = (rng.random((B, 30)) * 0.02 + 0.005).astype(np.float32)
    kw = _kw(key_antiquant_scale=key_scale, value_antiquant_scale=value_scale,
             key_antiquant_mode=0, value_antiquant_mode=1)
    plan = FiaPlan(q, k, v, **kw)
    assert plan._launch is not None
    planned_keys = key_scale.copy()
    key_scale *= 2
    value_scale[:, :7] *= 3
    want = fia(q, k, v, **dict(kw, key_antiquant_scale=planned_keys))
    got = plan(q, k, v)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
