"""The FIA reference (pfa_numba.reference.fused_infer_attention_score): each way of holding a
kv cache means the same attention as the plain contiguous call it stands for."""
import numpy as np
import pytest

from pfa_numba import reference as R

rng = np.random.default_rng(11)
B, N, NKV, D = 3, 4, 2, 16


def _x(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _fia(q, k, v, **kw):
    kw = dict(dict(num_heads=N, num_key_value_heads=NKV, input_layout="BNSD", scale=0.25,
                   softmax_lse_flag=True), **kw)
    return R.fused_infer_attention_score(q, k, v, **kw)


def _close(a, b):
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)


def test_decode_is_the_last_row_of_a_prefill_over_the_same_kv():
    q, k, v = _x(B, N, 5, D), _x(B, NKV, 30, D), _x(B, NKV, 30, D)
    mask = rng.random((B, 1, 1, 30)) < 0.3
    lens = [30, 17, 0]
    out, lse = _fia(q[:, :, -1:], k, v, atten_mask=mask, actual_seq_lengths_kv=lens,
                    sparse_mode=2, pre_tokens=-5)            # ignored in decode
    full = np.broadcast_to(mask, (B, 1, 5, 30))
    want, wlse = R.prompt_flash_attention(q, k, v, full, num_heads=N, num_key_value_heads=NKV,
                                          input_layout="BNSD", scale_value=0.25, sparse_mode=1,
                                          actual_seq_lengths_kv=lens, return_softmax_lse=True)
    _close((out, lse), (want[:, :, -1:], wlse[:, :, -1:]))
    assert np.isneginf(lse[2]).all() and not out[2].any()


def test_lse_placeholder_without_the_flag():
    q, k, v = _x(1, N, 1, D), _x(1, NKV, 8, D), _x(1, NKV, 8, D)
    _, lse = _fia(q, k, v, softmax_lse_flag=False)
    assert lse.shape == (1,) and not lse.any()


@pytest.mark.parametrize("form", ["3-d", "4-d"])
@pytest.mark.parametrize("sq", [1, 6])
def test_paged_cache_is_the_contiguous_cache(form, sq):
    """A shuffled block table over a pool whose unused slots hold NaN."""
    bs, S = 4, 22
    lens = [22, 9, 13]
    q, k, v = _x(B, N, sq, D), _x(B, NKV, S, D), _x(B, NKV, S, D)
    blocks = -(-S // bs)
    ids = rng.permutation(B * blocks + 3)[:B * blocks].reshape(B, blocks)
    pools = [np.full((B * blocks + 3, NKV, bs, D), np.nan, np.float32) for _ in range(2)]
    for b in range(B):
        for t in range(lens[b]):
            for pool, x in zip(pools, (k, v)):
                pool[ids[b, t // bs], :, t % bs] = x[b, :, t]
    if form == "3-d":
        pools = [p.transpose(0, 2, 1, 3).reshape(p.shape[0], bs, NKV * D) for p in pools]
    table = ids.astype(np.int32)
    table[1, -(-(blocks - -(-lens[1] // bs))):] = -1        # unused entries: never read
    kw = dict(actual_seq_lengths_kv=lens)
    got = _fia(q, *pools, block_table=table, block_size=bs, **kw)
    _close(got, _fia(q, k, v, **kw))
    assert np.isfinite(got[0]).all()


def test_a_list_of_tensors_is_the_padded_batch():
    sizes = [7, 12, 3]
    k = [_x(1, NKV, s, D) for s in sizes]
    v = [_x(1, NKV, s, D) for s in sizes]
    q = _x(B, N, 1, D)
    kp, vp = (np.zeros((B, NKV, 12, D), np.float32) for _ in range(2))
    for b, s in enumerate(sizes):
        kp[b, :, :s], vp[b, :, :s] = k[b][0], v[b][0]
    _close(_fia(q, k, v), _fia(q, kp, vp, actual_seq_lengths_kv=sizes))
    _close(_fia(q, k, v, actual_seq_lengths_kv=[5, 12, 0]),
           _fia(q, kp, vp, actual_seq_lengths_kv=[5, 12, 0]))


@pytest.mark.parametrize("sq, mode", [(1, 0), (6, 3), (6, 0)])
def test_a_shared_prefix_is_prepended_to_every_batch(sq, mode):
    P, S = 5, 9
    pk, pv = _x(1, NKV, P + 2, D), _x(1, NKV, P + 2, D)
    q, k, v = _x(B, N, sq, D), _x(B, NKV, S, D), _x(B, NKV, S, D)
    mask = rng.random((B, 1, sq, P + S)) < 0.2
    kw = dict(atten_mask=mask if mode == 0 else np.triu(np.ones((2048, 2048), bool), 1),
              sparse_mode=mode, next_tokens=3)
    got = _fia(q, k, v, key_shared_prefix=pk, value_shared_prefix=pv,
               actual_shared_prefix_len=P, actual_seq_lengths_kv=[9, 4, 0], **kw)
    cat = [np.concatenate([np.broadcast_to(p[:, :, :P], (B, NKV, P, D)), x], axis=2)
           for p, x in ((pk, k), (pv, v))]
    want = _fia(q, *cat, actual_seq_lengths_kv=[P + 9, P + 4, P], **kw)
    _close(got, want)


@pytest.mark.parametrize("sq", [1, 7])
def test_left_padding_is_the_window_at_the_end(sq):
    """kv (and in prefill query) rows of each batch end p rows before the padded frame's end;
    masks and pse are read in the padded frame."""
    S, p = 20, 3
    kl, ql = [10, 17, 0], [7, 2, 5][:B] if sq > 1 else [1, 1, 1]
    q, k, v = _x(B, N, sq, D), _x(B, NKV, S, D), _x(B, NKV, S, D)
    mask = rng.random((B, 1, sq, S)) < 0.2
    pse = _x(B, N, sq, S)
    kw = dict(kv_padding_size=np.array([p]), atten_mask=mask, pse_shift=pse,
              actual_seq_lengths_kv=kl)
    if sq > 1:
        kw.update(query_padding_size=np.array([p]), actual_seq_lengths=ql)
    out, lse = _fia(q, k, v, **kw)
    for b in range(B):
        k0, q0 = S - p - kl[b], (sq - p - ql[b]) if sq > 1 else 0
        qs = slice(q0, q0 + ql[b]) if q0 >= 0 else slice(0, 0)
        if q0 < 0:
            assert not out[b].any() and np.isneginf(lse[b]).all()
            continue
        m = mask[b:b + 1, :, qs, k0:k0 + kl[b]]
        if sq == 1:
            m = mask[b:b + 1, :, :1, k0:k0 + kl[b]]
        want, wl = R.prompt_flash_attention(
            q[b:b + 1, :, qs], k[b:b + 1, :, k0:k0 + kl[b]], v[b:b + 1, :, k0:k0 + kl[b]], m,
            pse_shift=pse[b:b + 1, :, qs, k0:k0 + kl[b]], num_heads=N, num_key_value_heads=NKV,
            input_layout="BNSD", scale_value=0.25, sparse_mode=1, return_softmax_lse=True)
        _close((out[b:b + 1, :, qs], lse[b:b + 1, :, qs]), (want, wl))
        rest = np.ones(sq, bool)
        rest[qs] = False
        assert not out[b][:, rest].any() and np.isneginf(lse[b][:, rest]).all()


def _int8(*shape):
    return rng.integers(-128, 128, shape).astype(np.int8)


@pytest.mark.parametrize("form", ["merged per-tensor", "merged per-channel", "merged per-token",
                                  "per-head", "per-token-head", "paged per-token"])
def test_antiquant_is_the_call_on_dequantized_values(form):
    S = 12
    q = _x(B, N, 1, D, dtype=np.float16)
    k8, v8 = _int8(B, NKV, S, D), _int8(B, NKV, S, D)
    # what each form means, element by element: scale and offset of (tensor, b, g, p, d)
    if form == "merged per-tensor":
        s, o = _x(2).astype(np.float16), _x(2).astype(np.float16)
        kw = dict(antiquant_scale=s, antiquant_offset=o)
        sc = lambda i, b, g, p, d: (s[i], o[i])                      # noqa: E731
    elif form == "merged per-channel":
        s, o = (_x(2, NKV, 1, D).astype(np.float16) for _ in range(2))
        kw = dict(antiquant_scale=s, antiquant_offset=o)
        sc = lambda i, b, g, p, d: (s[i, g, 0, d], o[i, g, 0, d])    # noqa: E731
    elif form == "merged per-token":
        s = _x(2, B, S)
        kw = dict(antiquant_scale=s, antiquant_mode=1)
        sc = lambda i, b, g, p, d: (s[i, b, p], 0.0)                 # noqa: E731
    elif form == "per-head":
        ks, vs = _x(NKV).astype(np.float16), _x(NKV).astype(np.float16)
        kw = dict(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_mode=2,
                  value_antiquant_mode=2)
        sc = lambda i, b, g, p, d: ((ks, vs)[i][g], 0.0)             # noqa: E731
    elif form == "per-token-head":
        ks, vs, ko, vo = (_x(B, NKV, S) for _ in range(4))
        kw = dict(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=ko,
                  value_antiquant_offset=vo, key_antiquant_mode=3, value_antiquant_mode=3)
        sc = lambda i, b, g, p, d: ((ks, vs)[i][b, g, p], (ko, vo)[i][b, g, p])  # noqa: E731
    deq = [np.zeros((B, NKV, S, D)) for _ in range(2)]
    if form == "paged per-token":
        bs = 4
        table = np.arange(B * 3).reshape(B, 3)[:, ::-1].astype(np.int32)
        pools = [np.zeros((B * 3, NKV, bs, D), np.int8) for _ in range(2)]
        ks, vs = _x(B * 3, bs), _x(B * 3, bs)
        for b in range(B):
            for t in range(S):
                blk, off = table[b, t // bs], t % bs
                for i, (pool, x) in enumerate(zip(pools, (k8, v8))):
                    pool[blk, :, off] = x[b, :, t]
                    deq[i][b, :, t] = x[b, :, t].astype(np.float64) * (ks, vs)[i][blk, off]
        got = _fia(q, *pools, block_table=table, block_size=bs, actual_seq_lengths_kv=[S] * B,
                   key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_mode=4,
                   value_antiquant_mode=4)
    else:
        for i, x in enumerate((k8, v8)):
            for b, g, p, d in np.ndindex(B, NKV, S, D):
                scale, offset = sc(i, b, g, p, d)
                deq[i][b, g, p, d] = (float(x[b, g, p, d]) + float(offset)) * float(scale)
        got = _fia(q, k8, v8, **kw)
    _close(got, _fia(q, *deq))
