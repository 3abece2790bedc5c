"""docs/guarantees.md, 'Determinism': a call's bits do not depend on the number of threads it
runs on, nor on the strides of its arrays (a view gives the bits of its contiguous copy), for
prompt_flash_attention, fused_infer_attention_score and FiaPlan, in decode (the streaming
products, split-kv) and in prefill."""
import numba
import numpy as np
import pytest

from pfa_numba import FiaPlan, config, fused_infer_attention_score, prompt_flash_attention
from _cases import DTYPES, to_layout

I8 = np.dtype(np.int8)


def _same_bits(a, b):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return all(x.dtype == y.dtype and x.shape == y.shape and
               np.array_equal(np.ascontiguousarray(x).view(np.uint8),
                              np.ascontiguousarray(y).view(np.uint8)) for x, y in zip(a, b))


def _views(x, rng):
    """Views equal to ``x`` (its layout's array) with other strides: rows backwards, every other
    element of a wider array, elements backwards, and a transposed copy seen in x's order."""
    rows = np.ascontiguousarray(np.flip(x, axis=1))
    wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
    wide[..., 1::2] = x
    backwards = np.ascontiguousarray(x[..., ::-1])
    swapped = np.ascontiguousarray(np.swapaxes(x, 0, 1))
    return {"rows backwards": np.flip(rows, axis=1), "every other element": wide[..., 1::2],
            "elements backwards": backwards[..., ::-1], "other axis order":
            np.swapaxes(swapped, 0, 1)}


def _case(rng, dtype, layout, B, N, Nkv, Sq, Skv, D, kv_dtype=None):
    def r(*shape, dt=dtype):
        if np.dtype(dt) == I8:
            return rng.integers(-128, 128, shape).astype(np.int8)
        return rng.standard_normal(shape).astype(np.float32).astype(dt)
    q = to_layout(r(B, N, Sq, D), layout)
    k, v = (to_layout(r(B, Nkv, Skv, D, dt=kv_dtype or dtype), layout) for _ in range(2))
    return q, k, v


DECODE_AND_PREFILL = [(1, 3000), (1, 90), (37, 150)]


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("sq, skv", DECODE_AND_PREFILL)
@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_views_give_the_bits_of_their_contiguous_copies(monkeypatch, dt, sq, skv, layout):
    """query, key and value each as every view of _views: prompt_flash_attention and
    fused_infer_attention_score (through a plan too) give the contiguous copies' bits."""
    monkeypatch.setattr(config, "CPU_SPLIT_KV_MIN_COLS", 256)     # the long decode splits
    rng = np.random.default_rng(abs(hash((dt, sq, skv, layout))) % 2 ** 32)
    q, k, v = _case(rng, DTYPES[dt], layout, 2, 8, 2, sq, skv, 64)
    pkw = dict(num_heads=8, num_key_value_heads=2, input_layout=layout, scale_value=0.125,
               next_tokens=65536, return_softmax_lse=True)
    fkw = dict(num_heads=8, num_key_value_heads=2, input_layout=layout, scale=0.125,
               softmax_lse_flag=True, actual_seq_lengths_kv=[skv, skv // 3])
    want_pfa = prompt_flash_attention(q, k, v, **pkw)
    want_fia = fused_infer_attention_score(q, k, v, **fkw)
    for which in range(3):
        for name, view in _views((q, k, v)[which], rng).items():
            args = [q, k, v]
            args[which] = view
            assert _same_bits(prompt_flash_attention(*args, **pkw), want_pfa), (which, name)
            assert _same_bits(fused_infer_attention_score(*args, **fkw), want_fia), (which, name)
            assert _same_bits(FiaPlan(*args, **fkw)(*args), want_fia), (which, name)


@pytest.mark.parametrize("form", ["paged", "int8", "prefix"])
def test_views_of_kv_caches_give_the_bits_of_their_contiguous_copies(monkeypatch, form):
    """Strided pools of a paged cache, an int8 cache and a shared prefix, in decode."""
    monkeypatch.setattr(config, "CPU_SPLIT_KV_MIN_COLS", 128)
    rng = np.random.default_rng(11)
    B, N, Nkv, D = 2, 8, 2, 32
    q = rng.standard_normal((B, N, 1, D)).astype(np.float16)
    kw = dict(num_heads=N, num_key_value_heads=Nkv, input_layout="BNSD", softmax_lse_flag=True)
    if form == "paged":
        k, v = (rng.standard_normal((40, Nkv, 16, D)).astype(np.float16) for _ in range(2))
        kw.update(block_table=rng.permutation(40)[:30].reshape(B, 15).astype(np.int32),
                  block_size=16, actual_seq_lengths_kv=[240, 77])
    elif form == "int8":
        k, v = _case(rng, I8, "BNSD", B, Nkv, Nkv, 700, 700, D)[1:]
        kw.update(key_antiquant_scale=np.full((Nkv, D), 0.01, np.float16),
                  value_antiquant_scale=(rng.random((B, 700)) * 0.02).astype(np.float32),
                  key_antiquant_mode=0, value_antiquant_mode=1)
    else:
        k, v = _case(rng, np.float16, "BNSD", B, Nkv, Nkv, 500, 500, D)[1:]
        kw.update(key_shared_prefix=rng.standard_normal((1, Nkv, 300, D)).astype(np.float16),
                  value_shared_prefix=rng.standard_normal((1, Nkv, 300, D)).astype(np.float16))
    want = fused_infer_attention_score(q, k, v, **kw)
    for name, view in _views(k, rng).items():
        assert _same_bits(fused_infer_attention_score(q, view, v, **kw), want), name
    if form == "prefix":
        for name, view in _views(kw["value_shared_prefix"], rng).items():
            got = fused_infer_attention_score(q, k, v, **dict(kw, value_shared_prefix=view))
            assert _same_bits(got, want), name


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("sq, skv", DECODE_AND_PREFILL)
def test_the_thread_count_changes_no_bit(monkeypatch, dt, sq, skv):
    """1, 2 and 3 threads (config.CPU_THREADS, numba.set_num_threads) on work divided for 4:
    a decode call split into pieces, and prefill."""
    monkeypatch.setattr(config, "CPU_WORK_THREADS", 4)
    monkeypatch.setattr(config, "CPU_SPLIT_KV_MIN_COLS", 256)
    rng = np.random.default_rng(5)
    q, k, v = _case(rng, DTYPES[dt], "BNSD", 1, 8, 1, sq, skv, 64)
    kw = dict(num_heads=8, num_key_value_heads=1, input_layout="BNSD", softmax_lse_flag=True)
    want = fused_infer_attention_score(q, k, v, **kw)
    for threads in (1, 2, 3):
        monkeypatch.setattr(config, "CPU_THREADS", threads)
        assert _same_bits(fused_infer_attention_score(q, k, v, **kw), want), threads
        assert _same_bits(FiaPlan(q, k, v, **kw)(q, k, v), want), threads   # planned on them
    monkeypatch.setattr(config, "CPU_THREADS", None)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        assert _same_bits(fused_infer_attention_score(q, k, v, **kw), want)
        assert _same_bits(prompt_flash_attention(q, k, v, num_heads=8, num_key_value_heads=1,
                                                 input_layout="BNSD", next_tokens=65536,
                                                 return_softmax_lse=True), want)
    finally:
        numba.set_num_threads(before)
