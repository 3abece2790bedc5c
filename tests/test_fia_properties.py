"""Random valid fused_infer_attention_score calls against its float64 reference: a branch, a kv
cache form (contiguous, left-padded, paged, prefixed, a list), int8 key/value in a drawn
antiquant mode, masks, pse, lengths and tiles, all drawn together."""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pfa_numba import config
from _cases import BF16
from _strategies import profile_settings
from test_fia import _antiquant_args, _check

PROFILE_SETTINGS = profile_settings(ci=("pfa-fia-properties-ci", 40),
                                    long=("pfa-fia-properties-long", 1000))
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
FORMS = ["contiguous", "padded", "paged", "prefix", "list"]
AQ_CONTIGUOUS = ["merged per-tensor", "merged per-channel", "merged per-token",
                 "per-channel key, per-token value", "per-head", "per-token-head"]
AQ_PAGED = ["paged per-token", "paged per-token-head", "per-head"]


@st.composite
def fia_calls(draw, forms=FORMS):
    """(args, keywords, dtype) of one valid call, BNSD (layouts are tested elsewhere), its kv
    cache of one of ``forms``."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    B = draw(st.integers(1, 3))
    nkv = draw(st.sampled_from([1, 2]))
    N = nkv * draw(st.sampled_from([1, 2, 4]))
    D = draw(st.sampled_from([16, 32, 48]))
    sq = draw(st.sampled_from([1, 1, 2, 9]))
    S = draw(st.integers(1, 70))
    dtype = draw(st.sampled_from([F16, BF16, F32]))
    form = draw(st.sampled_from(forms))
    int8 = draw(st.booleans()) and form != "list"
    x = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(dtype)  # noqa: E731
    kvd = (lambda *shape: rng.integers(-128, 128, shape).astype(np.int8)) if int8 else x
    q = x(B, N, sq, D)
    lens = [int(rng.integers(0, S + 1)) for _ in range(B)]
    kw = dict(num_heads=N, num_key_value_heads=nkv, input_layout="BNSD",
              scale=float(draw(st.sampled_from([D ** -0.5, 0.05, 1.0]))),
              softmax_lse_flag=draw(st.booleans()), actual_seq_lengths_kv=lens,
              inner_precise=draw(st.sampled_from([0, 1, 2, 3])))
    extent, P = S, 0
    if form == "paged":
        bs = draw(st.sampled_from([1, 4, 16]))
        blocks = -(-S // bs)
        nb = B * blocks + 2
        table = rng.permutation(nb)[:B * blocks].reshape(B, blocks).astype(np.int32)
        k, v = kvd(nb, nkv, bs, D), kvd(nb, nkv, bs, D)
        kw.update(block_table=table, block_size=bs)
        extent = blocks * bs
    elif form == "list":
        sizes = [max(n, 1) for n in lens]
        k = [kvd(1, nkv, s, D) for s in sizes]
        v = [kvd(1, nkv, s, D) for s in sizes]
        extent = max(sizes)
    else:
        k, v = kvd(B, nkv, S, D), kvd(B, nkv, S, D)
        if form == "padded":
            kw["kv_padding_size"] = np.array([int(rng.integers(0, 4))])
            if sq > 1:
                kw.update(query_padding_size=np.array([int(rng.integers(0, 2))]),
                          actual_seq_lengths=[int(rng.integers(0, sq + 1)) for _ in range(B)])
        if form == "prefix":
            sp = int(rng.integers(1, 8))
            P = int(rng.integers(0, sp + 1))
            kw.update(key_shared_prefix=kvd(1, nkv, sp, D), value_shared_prefix=kvd(1, nkv, sp, D),
                      actual_shared_prefix_len=P)
    if int8:
        if form == "paged":
            aq = draw(st.sampled_from(AQ_PAGED))
            aqkw = _antiquant_args(rng, aq, extent, nb, bs, B, nkv, D)
        else:
            choices = AQ_CONTIGUOUS if form != "prefix" else ["merged per-channel", "per-head"]
            aqkw = _antiquant_args(rng, draw(st.sampled_from(choices)), extent, b=B, nkv=nkv,
                                   d=D)
        for name, a in aqkw.items():     # per-tensor/channel/head scales take the query dtype
            if isinstance(a, np.ndarray) and a.dtype == F16:
                a = a.astype(dtype)
            kw[name] = a
    if draw(st.booleans()):
        cols = P + extent
        mask = rng.random((B, 1, sq, cols)) < draw(st.sampled_from([0.1, 0.5, 1.0]))
        kw["atten_mask"] = mask[:, :, 0] if sq == 1 else mask
    if draw(st.booleans()) and not int8:
        kw["pse_shift"] = x(1, N, sq, P + extent)
    if sq > 1 and draw(st.booleans()) and "atten_mask" not in kw:
        kw.update(sparse_mode=draw(st.sampled_from([2, 3])),
                  atten_mask=np.triu(np.ones((2048, 2048), bool), 1))
    return (q, k, v), kw, dtype


@PROFILE_SETTINGS
@given(fia_calls(), st.sampled_from(["default", "small"]))
def test_random_calls_match_the_reference(call, tiles):
    args, kw, dtype = call
    saved = config.CPU_Q_ROWS, config.CPU_KV_COLS
    if tiles == "small":
        config.CPU_Q_ROWS, config.CPU_KV_COLS = 5, 3
    try:
        _check(args, kw, dtype)
    finally:
        config.CPU_Q_ROWS, config.CPU_KV_COLS = saved
