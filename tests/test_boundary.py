"""Arguments are converted once, at the boundary: ndarray subclasses, bools where ints go, and
scale_value beyond float32's range (contract 'The computation', 'Quantization' and 'Errors')."""
import numpy as np
import pytest

from pfa_numba import prompt_flash_attention, reference
from _cases import BF16, assert_matches_reference, qkv

KW = dict(num_heads=2, input_layout="BNSD")


# np.matrix warns that it is not recommended: it is the subclass whose reading is tested here
@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("sparse_mode", [0, 1])
def test_matrix_mask_is_its_plain_array(sparse_mode):
    """An np.matrix attn_mask (whose indexing keeps two axes) means the same mask as its
    plain array."""
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, "BNSD", np.float32, 1, 2, 2, 64, 128, 32)
    plain = rng.random((64, 128)) < 0.4
    kw = dict(KW, sparse_mode=sparse_mode)
    want = prompt_flash_attention(q, k, v, plain, **kw)
    got = prompt_flash_attention(q, k, v, np.asmatrix(plain), **kw)
    np.testing.assert_array_equal(got, want)
    assert_matches_reference(got, (q, k, v, plain), kw, np.float32)


def test_subclassed_inputs_are_read_as_plain_arrays(tmp_path):
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, "BNSD", np.float16, 1, 2, 2, 20, 30, 16)
    mapped = np.lib.format.open_memmap(tmp_path / "k.npy", mode="w+", dtype=k.dtype, shape=k.shape)
    mapped[...] = k
    got = prompt_flash_attention(q, mapped, v, **KW)
    np.testing.assert_array_equal(got, prompt_flash_attention(q, k, v, **KW))


def test_masked_array_is_refused():
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, "BNSD", np.float32, 1, 2, 2, 8, 8, 16)
    with pytest.raises(TypeError, match="key .*masked array"):
        prompt_flash_attention(q, np.ma.masked_array(k, mask=k > 1), v, **KW)


#: every array argument of each operator, with a value it takes: (operator, name, value)
_ONE = np.ones(1, np.float32)
_ARRAY_ARGUMENTS = [
    ("pfa", "attn_mask", np.zeros((8, 8), bool)), ("pfa", "pse_shift", np.zeros((1, 2, 8, 8),
                                                                                 np.float32)),
    ("pfa", "actual_seq_lengths", np.array([8])), ("pfa", "actual_seq_lengths_kv", np.array([8])),
    ("pfa", "quant_scale2", _ONE), ("pfa", "quant_offset2", _ONE),
    ("fia", "atten_mask", np.zeros((1, 8), bool)), ("fia", "actual_seq_lengths_kv", np.array([8])),
    ("fia", "block_table", np.zeros((1, 1), np.int32)),
    ("fia", "kv_padding_size", np.array([0])),
    ("fia", "key_shared_prefix", np.zeros((1, 2, 2, 16), np.float32)),
    ("fia", "actual_shared_prefix_len", np.array([2])),
    ("fia", "key_antiquant_scale", _ONE)]


@pytest.mark.parametrize("operator, name, value", _ARRAY_ARGUMENTS,
                         ids=[f"{o}-{n}" for o, n, _ in _ARRAY_ARGUMENTS])
def test_a_masked_array_is_refused_for_every_array_argument(operator, name, value):
    """Its data would be read and its mask dropped: a TypeError naming the argument, whatever
    else the call holds."""
    from pfa_numba import fused_infer_attention_score
    q = np.ones((1, 2, 1 if operator == "fia" else 8, 16), np.float32)
    k = np.ones((1, 2, 8, 16), np.float32)
    call = fused_infer_attention_score if operator == "fia" else prompt_flash_attention
    masked = np.ma.masked_array(value, mask=np.ones(value.shape, bool))
    with pytest.raises(TypeError, match=rf"^{name} must be a plain NumPy array, got a masked "
                                        rf"array \(np.ma.MaskedArray of shape"):
        call(q, k, k, num_heads=2, input_layout="BNSD", **{name: masked})


@pytest.mark.parametrize("name", ["num_heads", "num_key_value_heads", "pre_tokens",
                                  "next_tokens", "sparse_mode", "inner_precise"])
@pytest.mark.parametrize("value", [True, np.True_, False])
def test_bool_where_an_int_goes_is_a_type_error(name, value):
    q = np.zeros((1, 2, 4, 16), np.float32)
    kw = dict(KW, **{name: value})
    with pytest.raises(TypeError, match=f"{name} must be an int, got bool"):
        prompt_flash_attention(q, q, q, **kw)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
@pytest.mark.parametrize("scale", [1e300, -1e300, 3e200, 1e39])
def test_scale_beyond_float32_range_gives_the_finite_softmax(dtype, scale):
    """s = scale * dot is finite in float64 (the reference), so is its softmax: the largest
    scores take all the weight. softmax_lse is that of the float64 meaning, rounded to float32
    (+-inf when it is beyond float32's range)."""
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, "BNSD", dtype, 1, 2, 2, 24, 40, 32)
    mask = rng.random((24, 40)) < 0.3
    kw = dict(KW, scale_value=scale, sparse_mode=1)
    out, lse = prompt_flash_attention(q, k, v, mask, **kw, return_softmax_lse=True)
    assert np.isfinite(out.astype(np.float32)).all()
    assert_matches_reference(out, (q, k, v, mask), kw, dtype)
    _, want = reference.prompt_flash_attention(q, k, v, mask, **kw, return_softmax_lse=True)
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(lse, want.astype(np.float32), rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("scale", [1e39, -3e45, 1e55])
def test_scale_beyond_float32_range_keeps_pse_and_the_float16_mask(dtype, scale):
    """Scores that tie (q = 0: every dot product is 0) leave the softmax to pse and the
    float16 additive mask, which are added at the scale of the scores whatever scale_value is."""
    rng = np.random.default_rng(5)
    _, k, v = qkv(rng, "BNSD", dtype, 1, 2, 2, 12, 20, 16)
    q = np.zeros((1, 2, 12, 16), dtype)
    pse = rng.standard_normal((1, 2, 12, 20)).astype(dtype)
    kw = dict(KW, scale_value=scale, pse_shift=pse)
    args = (q, k, v)
    if dtype == np.float16:
        mask = (rng.random((12, 20)) < 0.2).astype(np.float16) * np.float16(1e-4)
        kw.update(sparse_mode=1)
        args = (q, k, v, mask)
    with pytest.warns(DeprecationWarning) if dtype == np.float16 else _no_warning():
        out, lse = prompt_flash_attention(*args, **kw, return_softmax_lse=True)
    assert_matches_reference(out, args, kw, dtype)
    _, want = reference.prompt_flash_attention(*args, **kw, return_softmax_lse=True)
    np.testing.assert_allclose(lse, want.astype(np.float32), rtol=1e-5, atol=1e-5)


def _no_warning():
    import contextlib
    return contextlib.nullcontext()


def test_int8_scale_beyond_float16_range_follows_spec_8():
    """The int8 pipeline rounds scale_value to float16 (contract 'Quantization'): 1e300 becomes inf,
    and the kernel agrees with the reference on what that makes of every row."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.integers(-20, 20, (1, 2, 16, 32)).astype(np.int8) for _ in range(3))
    qkw = dict(deq_scale1=np.array([0.01], np.float32), quant_scale1=np.array([100.0], np.float32),
               deq_scale2=np.array([0.01], np.float32))
    kw = dict(KW, scale_value=1e300, **qkw)
    got = prompt_flash_attention(q, k, v, **kw).astype(np.float64)
    want = reference.prompt_flash_attention(q, k, v, **kw)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fin = ~np.isnan(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=2e-3, atol=1e-3)
