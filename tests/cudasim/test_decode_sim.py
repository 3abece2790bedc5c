"""The split-kv decode kernel's own source (pfa_numba.gpu.decode_kernel), run against
pfa_numba.reference through fused_infer_attention_score: under the CUDA simulator, where
gpu/warp_sim.py stands in for its inline PTX, or on a GPU when the process has one. Each case
spans several 64-key tiles cut into several splits (config.CUDA_DECODE_MIN_TILES 1), with
partial tiles at the ends, and checks in the log that the decode kernel is the one chosen."""
import logging
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
from pfa_numba.gpu import device  # noqa: E402
from pfa_numba.sdpa import _attend  # noqa: E402
from _cases import BF16, assert_matches_reference  # noqa: E402
from test_fia import _check, _x  # noqa: E402

SIMULATED = bool(numba.config.ENABLE_CUDASIM)
if not SIMULATED and not cuda.is_available():
    pytest.skip("no GPU here: run with NUMBA_ENABLE_CUDASIM=1 (scripts/run_tests.py does)",
                allow_module_level=True)

F16 = np.dtype(np.float16)
CAUSAL = np.triu(np.ones((2048, 2048), bool), 1)


@pytest.fixture(autouse=True)
def decode_calls(monkeypatch, caplog):
    """fused_infer_attention_score on CUDA with splits of one tile, on a device the tensor-core
    kernels run on (the simulator reports none); the log says which kernel each call got."""
    if SIMULATED:
        monkeypatch.setattr(device, "compute_capability", lambda: (9, 0))
        interval = sys.getswitchinterval()
        sys.setswitchinterval(5e-4)
    monkeypatch.setattr(config, "CUDA_DECODE_MIN_TILES", 1)
    monkeypatch.setattr(test_fia, "fia", lambda *a, **kw: fused_infer_attention_score(
        *a, **kw, device="cuda"))
    caplog.set_level(logging.INFO, logger="pfa_numba.cuda")
    yield caplog
    said = " ".join(r.getMessage() for r in caplog.get_records("call"))
    assert "cuda decode queued: " in said, said
    if SIMULATED:
        sys.setswitchinterval(interval)


def _kw(n, nkv, d, layout="BNSD", **kw):
    return dict(dict(num_heads=n, num_key_value_heads=nkv, input_layout=layout,
                     scale=d ** -0.5, softmax_lse_flag=True), **kw)


def test_contiguous_gqa_lengths_and_a_negative_scale():
    """fp16, 2 query heads a kv head, kv lengths 150 and 70 (3 and 2 tiles, one split a
    tile), a negative scale (Q negated in registers)."""
    rng = np.random.default_rng(0)
    q, k, v = (_x(rng, s, F16) for s in ((2, 4, 1, 64), (2, 2, 150, 64), (2, 2, 150, 64)))
    _check((q, k, v), _kw(4, 2, 64, scale=-0.125, actual_seq_lengths_kv=[150, 70]), F16)


def test_paged_pool_with_unread_nan_slots():
    """A paged BSH pool of 16-row blocks in shuffled order, every unused slot NaN (never
    read), kv lengths 131 and 37."""
    rng = np.random.default_rng(1)
    bs, lens, n, nkv, d = 16, [131, 37], 4, 2, 64
    table = np.full((2, 9), -1, np.int64)
    order = rng.permutation(12)
    table[0, :9], table[1, :3] = order[:9], order[9:]
    keys = np.full((12, bs, nkv * d), np.nan, np.float32)
    vals = np.full((12, bs, nkv * d), np.nan, np.float32)
    for b, length in enumerate(lens):
        for t in range(length):
            keys[table[b, t // bs], t % bs] = rng.standard_normal(nkv * d)
            vals[table[b, t // bs], t % bs] = rng.standard_normal(nkv * d)
    q = _x(rng, (2, 1, n * d), F16)
    _check((q, keys.astype(F16), vals.astype(F16)),
           _kw(n, nkv, d, "BSH", block_table=table, block_size=bs, actual_seq_lengths_kv=lens),
           F16)


def test_shared_prefix():
    """A shared prefix of 70 rows (its end inside the second tile) before each batch's own
    rows; batch 1 has no own rows."""
    rng = np.random.default_rng(2)
    n, nkv, d = 4, 1, 64
    q = _x(rng, (2, n, 1, d), F16)
    k, v = (_x(rng, (2, nkv, 90, d), F16) for _ in range(2))
    pk, pv = (_x(rng, (1, nkv, 80, d), F16) for _ in range(2))
    _check((q, k, v), _kw(n, nkv, d, key_shared_prefix=pk, value_shared_prefix=pv,
                          actual_shared_prefix_len=70, actual_seq_lengths_kv=[60, 0]), F16)


def test_left_padded_windows():
    """Each batch's rows left-padded by 3 at the end of its 150 rows, kv lengths 120 and 65."""
    rng = np.random.default_rng(5)
    n, nkv, d = 2, 2, 64
    q = _x(rng, (2, n, 1, d), F16)
    k, v = (_x(rng, (2, nkv, 150, d), F16) for _ in range(2))
    _check((q, k, v), _kw(n, nkv, d, kv_padding_size=np.array([3]),
                          actual_seq_lengths_kv=[120, 65]), F16)


@pytest.mark.parametrize("poison", [False, True])
def test_speculative_rows_causal(poison):
    """3 query rows a head, causal (rows drop different columns inside a tile); with an inf
    in V at a column row 0 drops, the guard hands the call to the portable kernel on the
    device and row 0 stays finite."""
    rng = np.random.default_rng(3)
    n, nkv, d = 4, 1, 64
    q = _x(rng, (1, n, 3, d), F16)
    k, v = (_x(rng, (1, nkv, 100, d), F16) for _ in range(2))
    if poison:
        v[0, 0, 99, 5] = np.inf
    _check((q, k, v), _kw(n, nkv, d, atten_mask=CAUSAL, sparse_mode=3), F16)


def test_bf16_d128_eight_heads_a_group():
    """bfloat16 at D 128, 8 query heads a kv head (8 of the block's 16 rows), 200 keys."""
    rng = np.random.default_rng(4)
    q = _x(rng, (1, 8, 1, 128), BF16)
    k, v = (_x(rng, (1, 1, 200, 128), BF16) for _ in range(2))
    _check((q, k, v), _kw(8, 1, 128), BF16)



def test_masks_and_pse():
    """A bool decode mask (batch 1 keeps nothing: contract 'Empty rows' over the kv
    sequence) with fp16 pse per head, kv lengths 130 and 90; the masked variant tests every
    tile per accumulator."""
    rng = np.random.default_rng(6)
    n, nkv, d = 4, 2, 64
    q = _x(rng, (2, n, 1, d), F16)
    k, v = (_x(rng, (2, nkv, 130, d), F16) for _ in range(2))
    mask = rng.random((2, 130)) < 0.3
    mask[1] = True
    pse = _x(rng, (2, n, 1, 130), F16)
    _check((q, k, v), _kw(n, nkv, d, atten_mask=mask, pse_shift=pse,
                          actual_seq_lengths_kv=[130, 90]), F16)


def _int8(rng, shape):
    return rng.integers(-128, 128, shape).astype(np.int8)


@pytest.mark.parametrize("form", ["merged per-channel", "per-token-head"])
def test_int8_cache(form):
    """An int8 cache dequantized as the warps read it (channel planes; token planes, whose
    limits the guard scans), kv lengths 150 and 70."""
    rng = np.random.default_rng(7)
    n, nkv, d, s = 4, 2, 64, 150
    q = _x(rng, (2, n, 1, d), F16)
    k, v = _int8(rng, (2, nkv, s, d)), _int8(rng, (2, nkv, s, d))
    _check((q, k, v), _kw(n, nkv, d, actual_seq_lengths_kv=[150, 70],
                          **test_fia._antiquant_args(rng, form, s, b=2, nkv=nkv, d=d)), F16)


def test_int8_paged_pool_with_an_empty_row():
    """An int8 paged pool (token planes by paged slot, per head, with offsets), a mask that
    leaves batch 1's row empty (contract 'Empty rows': the mean of the dequantized V)."""
    rng = np.random.default_rng(8)
    bs, nb, n, nkv, d = 16, 12, 4, 2, 64
    table = rng.permutation(nb)[:10].reshape(2, 5).astype(np.int32)
    k, v = _int8(rng, (nb, nkv, bs, d)), _int8(rng, (nb, nkv, bs, d))
    q = _x(rng, (2, n, 1, d), F16)
    mask = rng.random((2, 80)) < 0.3
    mask[1] = True
    _check((q, k, v), _kw(n, nkv, d, block_table=table, block_size=bs, atten_mask=mask,
                          actual_seq_lengths_kv=[80, 37],
                          **test_fia._antiquant_args(rng, "paged per-token-head", 80, nb, bs,
                                                     b=2, nkv=nkv, d=d)), F16)


def test_int8_token_scale_beyond_float16_goes_to_the_portable_kernel():
    """A value token scale that takes a dequantized value past float16's range: the guard's
    scan of the token plane hands the call to the portable kernel (float32 values, finite
    output, as the reference)."""
    rng = np.random.default_rng(9)
    n, nkv, d, s = 4, 1, 64, 100
    q = _x(rng, (1, n, 1, d), F16)
    k, v = _int8(rng, (1, nkv, s, d)), _int8(rng, (1, nkv, s, d))
    kw = test_fia._antiquant_args(rng, "per-channel key, per-token value", s, b=1, nkv=nkv,
                                  d=d)
    kw["value_antiquant_scale"][0, 7] = 1000.0             # |v| up to 128000 in row 7
    _check((q, k, v), _kw(n, nkv, d, **kw), F16)


@pytest.mark.parametrize("masked", [False, True], ids=["dense", "bool mask"])
def test_sdpa_softcap_and_sinks(masked):
    """The SDPA drop-in's extensions on the decode kernel: a softcap (the masked variant caps
    every accumulator) and sink logits, which join each row's sum once, after the splits
    merge (one far above the scores), with the lse, and a negative scale (Q negated in
    registers: the cap sees the signed score); with a bool mask whose second batch keeps
    nothing (zeros: the sink does not join a row that kept no score)."""
    rng = np.random.default_rng(11)
    q = (_x(rng, (2, 4, 1, 64), F16).astype(np.float32) * 4).astype(F16)
    k, v = (_x(rng, (2, 2, 150, 64), F16) for _ in range(2))
    sinks = np.array([-2.0, 0.5, 3.0, 9.0], np.float32)
    keep = None
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale_value=-0.125,
              inner_precise=2, next_tokens=2147483647, softcap=3.0, sinks=sinks)
    if masked:
        keep = rng.random((2, 1, 1, 150)) < 0.7
        keep[1] = False
        kw.update(attn_mask=~keep, sparse_mode=1)
    options = dict(dropout_p=0.0, is_causal=False, scale=-0.125, enable_gqa=True, softcap=3.0)
    out, lse = _attend((q, k, v, keep, sinks), options, want_lse=True, device="cuda")
    ref = assert_matches_reference(out, (q, k, v), kw, F16, lse=lse)
    plain = reference.prompt_flash_attention(q, k, v, **dict(kw, softcap=None, sinks=None))
    assert np.abs(plain - ref).max() > 0.05          # the extensions changed the result
    if masked:
        assert not out[1].any()
