"""fused_infer_attention_score through the CUDA kernels, against its float64 reference
(tests/test_fia.py's check: twice the reference's own error in the input dtype): decode and
prefill over contiguous, left-padded, paged, prefixed, listed and int8 kv caches, rows with
nothing kept (their contract 'Empty rows' mean walks the same kv sequence), CUDA arrays in and
out. Small CUDA tiles (3 kv columns) make every case cross kv tiles, paged blocks and the
prefix's end inside a tile. Under the CUDA simulator, or on a real GPU."""
import functools
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numba  # noqa: E402
from numba import cuda  # noqa: E402

import test_fia  # noqa: E402
from pfa_numba import config, reference  # noqa: E402
from pfa_numba.fia import fused_infer_attention_score  # noqa: E402
from test_fia import _antiquant_args, _check, _int8, _x  # noqa: E402
from _cases import BF16  # noqa: E402

if not numba.config.ENABLE_CUDASIM and not cuda.is_available():
    pytest.skip("no GPU here: run with NUMBA_ENABLE_CUDASIM=1 (scripts/run_tests.py does)",
                allow_module_level=True)

B, N, NKV, D = 2, 2, 1, 16
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
on_cuda = functools.partial(fused_infer_attention_score, device="cuda")


@pytest.fixture(autouse=True)
def cuda_calls(monkeypatch):
    """test_fia's check calls fused_infer_attention_score on CUDA, with small tiles; every call
    is shown to reach the CUDA launch."""
    from pfa_numba.gpu import launch
    launches = []
    real = launch.prepare
    monkeypatch.setattr(launch, "prepare", lambda *a: launches.append(a) or real(*a))
    monkeypatch.setattr(test_fia, "fia", on_cuda)
    monkeypatch.setattr(config, "CUDA_Q_ROWS", 4)
    monkeypatch.setattr(config, "CUDA_KV_COLS", 3)
    yield
    assert launches


def _kw(layout="BNSD", **kw):
    return dict(dict(num_heads=N, num_key_value_heads=NKV, input_layout=layout,
                     scale=D ** -0.5, softmax_lse_flag=True), **kw)


def _qkv(rng, dtype, sq, skv, layout="BNSD"):
    if layout == "BSH":
        return (_x(rng, (B, sq, N * D), dtype), _x(rng, (B, skv, NKV * D), dtype),
                _x(rng, (B, skv, NKV * D), dtype))
    return (_x(rng, (B, N, sq, D), dtype), _x(rng, (B, NKV, skv, D), dtype),
            _x(rng, (B, NKV, skv, D), dtype))


@pytest.mark.parametrize("layout, dtype", [("BSH", F16), ("BNSD", BF16), ("BNSD", F32)])
def test_decode(layout, dtype):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, dtype, 1, 11, layout)
    mask = rng.random((B, 11)) < 0.3
    mask[1, :4] = True                        # batch 1 keeps nothing of its 4 columns
    _check((q, k, v), _kw(layout, atten_mask=mask, actual_seq_lengths_kv=[11, 4]), dtype)


@pytest.mark.parametrize("mode", [0, 3])
def test_prefill(mode):
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, F16, 6, 8)
    mask = rng.random((B, 1, 6, 8)) < 0.2 if mode == 0 else np.triu(np.ones((2048, 2048), bool), 1)
    _check((q, k, v), _kw(atten_mask=mask, pse_shift=_x(rng, (1, N, 6, 8), F16),
                          sparse_mode=mode, actual_seq_lengths=[6, 3],
                          actual_seq_lengths_kv=[8, 5]), F16)


@pytest.mark.parametrize("sq", [1, 5])
def test_left_padding(sq):
    """Windows at the end of the padded frame; the rows before them are zeros (lse -inf)."""
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, F32, sq, 10)
    kw = _kw(kv_padding_size=np.array([2]), actual_seq_lengths_kv=[5, 8],
             pse_shift=_x(rng, (B, N, sq, 10), F32))
    if sq > 1:
        kw.update(query_padding_size=np.array([1]), actual_seq_lengths=[3, 4])
    out, lse = _check((q, k, v), kw, F32)
    if sq > 1:
        assert not out[0, :, :1].any() and np.isneginf(lse[0, :, :1]).all()


def _pool(rng, dtype, lens, table, bs, nb, pool):
    """Paged pools holding each batch's rows at its table's blocks, NaN in every other slot."""
    keys = np.full((nb, NKV, bs, D), np.nan, np.float32)
    vals = np.full((nb, NKV, bs, D), np.nan, np.float32)
    for b, n in enumerate(lens):
        for t in range(n):
            keys[table[b, t // bs], :, t % bs] = rng.standard_normal((NKV, D))
            vals[table[b, t // bs], :, t % bs] = rng.standard_normal((NKV, D))
    keys, vals = keys.astype(dtype), vals.astype(dtype)
    if pool == "3-d":
        keys, vals = (x.transpose(0, 2, 1, 3).reshape(nb, bs, NKV * D) for x in (keys, vals))
    return keys, vals


@pytest.mark.parametrize("pool, sq", [("4-d", 1), ("3-d", 1), ("4-d", 4)])
def test_paged(pool, sq):
    """Shuffled blocks, a partly used last block and unused entries (-1): NaN in every slot
    no used entry names never reaches the output."""
    rng = np.random.default_rng(4)
    bs, nb, lens = 4, 9, [10, 3]
    table = np.full((B, 4), -1, np.int32)
    table[0, :3] = [7, 2, 5]
    table[1, 0] = 0
    keys, vals = _pool(rng, F16, lens, table, bs, nb, pool)
    q = _x(rng, (B, N, sq, D), F16)
    layout = "BNSD"
    if pool == "3-d":
        q = np.ascontiguousarray(q.transpose(0, 2, 1, 3).reshape(B, sq, N * D))
        layout = "BSH"
    out, _ = _check((q, keys, vals), _kw(layout, block_table=table, block_size=bs,
                                         actual_seq_lengths_kv=lens), F16)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("sq, mode", [(1, 0), (5, 3)])
def test_shared_prefix(sq, mode):
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, F16, sq, 7)
    pk, pv = _x(rng, (1, NKV, 6, D), F16), _x(rng, (1, NKV, 6, D), F16)
    kw = _kw(key_shared_prefix=pk, value_shared_prefix=pv, actual_shared_prefix_len=4,
             actual_seq_lengths_kv=[7, 2], sparse_mode=mode)
    if mode == 3:
        kw["atten_mask"] = np.triu(np.ones((2048, 2048), bool), 1)
    _check((q, k, v), kw, F16)


def test_key_value_lists():
    rng = np.random.default_rng(9)
    q = _x(rng, (B, 1, N * D), BF16)
    k = [_x(rng, (1, s, NKV * D), BF16) for s in (5, 9)]
    v = [_x(rng, (1, s, NKV * D), BF16) for s in (5, 9)]
    _check((q, k, v), _kw("BSH"), BF16)


@pytest.mark.parametrize("form", ["merged per-channel", "per-token-head",
                                  "per-channel key, per-token value"])
def test_int8_kv_cache(form):
    """int8 key/value with a float query, dequantized as the tiles load, on a left-padded
    cache."""
    rng = np.random.default_rng(10)
    S = 9
    q = _x(rng, (B, N, 1, D), F16)
    k, v = _int8(rng, (B, NKV, S, D)), _int8(rng, (B, NKV, S, D))
    _check((q, k, v), _kw(kv_padding_size=np.array([1]), actual_seq_lengths_kv=[8, 3],
                          **_antiquant_args(rng, form, S, b=B, nkv=NKV, d=D)), F16)


@pytest.mark.parametrize("form", ["paged per-token", "paged per-token-head"])
def test_int8_paged_cache(form):
    rng = np.random.default_rng(11)
    nb, bs = 6, 4
    table = rng.permutation(nb)[:B * 3].reshape(B, 3).astype(np.int32)
    k, v = _int8(rng, (nb, NKV, bs, D)), _int8(rng, (nb, NKV, bs, D))
    q = _x(rng, (B, N, 1, D), F16)
    _check((q, k, v), _kw(block_table=table, block_size=bs, actual_seq_lengths_kv=[11, 5],
                          **_antiquant_args(rng, form, 12, nb, bs, b=B, nkv=NKV, d=D)), F16)


def test_rows_with_nothing_kept_average_the_kv_sequence():
    """inner_precise 0: a row whose every band column is masked is the mean of V over its
    band, read through the prefix, the paged blocks and the dequantization as the tiles are."""
    rng = np.random.default_rng(13)
    q = _x(rng, (B, N, 3, D), F16)
    k, v = _int8(rng, (B, NKV, 6, D)), _int8(rng, (B, NKV, 6, D))
    pk, pv = _int8(rng, (1, NKV, 4, D)), _int8(rng, (1, NKV, 4, D))
    mask = rng.random((B, 1, 3, 10)) < 0.2
    mask[:, :, 1] = True
    _check((q, k, v), _kw(key_shared_prefix=pk, value_shared_prefix=pv, atten_mask=mask,
                          inner_precise=0, actual_seq_lengths_kv=[6, 3],
                          **_antiquant_args(rng, "merged per-channel", 6, b=B, nkv=NKV, d=D)),
           F16)
    bs, nb, lens = 4, 5, [7, 2]
    table = np.array([[3, 0], [4, -1]], np.int32)
    keys, vals = _pool(rng, F32, lens, table, bs, nb, "4-d")
    mask = np.zeros((B, 1, 2, 8), bool)
    mask[:, :, 0] = True
    _check((_x(rng, (B, N, 2, D), F32), keys, vals),
           _kw(block_table=table, block_size=bs, actual_seq_lengths_kv=lens, atten_mask=mask,
               inner_precise=1), F32)


def test_int8_query_with_left_padding():
    """Full quantization (the int8 kernel) on a left-padded cache."""
    rng = np.random.default_rng(8)
    q = rng.integers(-20, 20, (B, N, 3, 32)).astype(np.int8)
    k, v = (rng.integers(-20, 20, (B, NKV, 7, 32)).astype(np.int8) for _ in range(2))
    kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout="BNSD", softmax_lse_flag=True,
              dequant_scale1=np.array([0.02], np.float32), quant_scale1=np.array([50.0], np.float32),
              dequant_scale2=np.array([0.01], np.float32), kv_padding_size=np.array([1]),
              actual_seq_lengths_kv=[4, 6])
    out, lse = on_cuda(q, k, v, **kw)
    ref, ref_lse = reference.fused_infer_attention_score(q, k, v, **kw)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_cuda_arrays_in_cuda_arrays_out():
    """A paged int8 cache as Numba device arrays: the results are device arrays equal to the
    NumPy call's on CUDA; the lse placeholder is a device array too; tensors live on one
    device."""
    rng = np.random.default_rng(20)
    nb, bs = 6, 4
    table = rng.permutation(nb)[:B * 3].reshape(B, 3).astype(np.int32)
    q = _x(rng, (B, N, 1, D), F16)
    k, v = _int8(rng, (nb, NKV, bs, D)), _int8(rng, (nb, NKV, bs, D))
    kw = _kw(block_table=table, block_size=bs, actual_seq_lengths_kv=[10, 5],
             **_antiquant_args(rng, "paged per-token", 12, nb, bs, b=B, nkv=NKV, d=D))
    host_out, host_lse = _check((q, k, v), kw, F16)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    dkw = dict(kw, block_table=cuda.to_device(table))
    out, lse = fused_infer_attention_score(dq, dk, dv, **dkw)
    assert hasattr(out, "copy_to_host") and hasattr(lse, "copy_to_host")
    assert np.array_equal(out.copy_to_host(), host_out)
    assert np.array_equal(lse.copy_to_host(), host_lse)
    _, placeholder = fused_infer_attention_score(dq, dk, dv, **dict(dkw, softmax_lse_flag=False))
    assert hasattr(placeholder, "copy_to_host") and not placeholder.copy_to_host().any()
    with pytest.raises(RuntimeError, match="value is a host"):
        fused_infer_attention_score(dq, dk, v, **kw)
