"""The tensor-core kernel's own source, run against pfa_numba.reference: under the CUDA
simulator, where gpu/warp_sim.py stands in for its inline PTX (mma.sync, ldmatrix, cp.async,
the shuffles), or on a GPU when the process has one. Every case crosses several row blocks and
kv tiles (64 rows, 64 keys) with partial ones at the ends, and checks in the log that the
tensor-core kernel is the one that ran."""
import logging
import os
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numba  # noqa: E402
from numba import cuda  # noqa: E402

from pfa_numba import fused_infer_attention_score, prompt_flash_attention, reference  # noqa: E402
from pfa_numba.sdpa import _attend  # noqa: E402
from pfa_numba.gpu import device  # noqa: E402
from _cases import assert_matches_reference, qkv  # noqa: E402

SIMULATED = bool(numba.config.ENABLE_CUDASIM)
if not SIMULATED and not cuda.is_available():
    pytest.skip("no GPU here: run with NUMBA_ENABLE_CUDASIM=1 (scripts/run_tests.py does)",
                allow_module_level=True)

BF16 = np.dtype(ml_dtypes.bfloat16)
CAUSAL = np.triu(np.ones((2048, 2048), bool), 1)


@pytest.fixture(autouse=True)
def tensor_core_device(monkeypatch, caplog):
    """A device the tensor-core kernel runs on (the simulator reports none), and the log that
    says which kernel ran. The simulator's 128 threads a block trade the interpreter lock at
    every warp-wide step: a short switch interval keeps that from dominating."""
    if SIMULATED:
        monkeypatch.setattr(device, "compute_capability", lambda: (9, 0))
        interval = sys.getswitchinterval()
        sys.setswitchinterval(5e-4)
    caplog.set_level(logging.INFO, logger="pfa_numba.cuda")
    yield caplog
    if SIMULATED:
        sys.setswitchinterval(interval)


def _run(args, kw, dtype, log, lse=True):
    out = prompt_flash_attention(*args, **kw, device="cuda", return_softmax_lse=lse)
    out, got_lse = out if lse else (out, None)
    assert "cuda tensor-core queued: " in log.text, log.text
    assert isinstance(out, np.ndarray) and out.dtype == dtype
    assert_matches_reference(out, args, kw, dtype, lse=got_lse)
    return out


def test_dense_odd_sizes(tensor_core_device):
    q, k, v = qkv(np.random.default_rng(0), "BNSD", np.float16, 1, 1, 1, 70, 83, 64)
    _run((q, k, v), dict(num_heads=1, input_layout="BNSD"), np.float16, tensor_core_device)


def test_bottom_right_causal_gqa_bsh_d128(tensor_core_device):
    q, k, v = qkv(np.random.default_rng(1), "BSH", BF16, 1, 2, 1, 40, 100, 128)
    _run((q, k, v, CAUSAL), dict(num_heads=2, num_key_value_heads=1, input_layout="BSH",
                                 sparse_mode=3, scale_value=0.09), BF16, tensor_core_device)


def test_band_skipping_tiles(tensor_core_device):
    q, k, v = qkv(np.random.default_rng(2), "BNSD", np.float16, 1, 1, 1, 150, 150, 64)
    _run((q, k, v, CAUSAL), dict(num_heads=1, input_layout="BNSD", sparse_mode=4,
                                 pre_tokens=20, next_tokens=5), np.float16, tensor_core_device)


def test_band_with_inside_tiles_between_edges_and_a_negative_scale(tensor_core_device):
    """Rows 0-63 keep columns 0-259 under the band: tiles 1 and 2 lie inside every row's band
    (run first, with no band test), then tiles 0, 3 and 4 cross it; a negative scale negates
    Q."""
    q, k, v = qkv(np.random.default_rng(8), "BNSD", np.float16, 1, 1, 1, 64, 260, 64)
    _run((q, k, v, CAUSAL), dict(num_heads=1, input_layout="BNSD", sparse_mode=4,
                                 pre_tokens=30, next_tokens=200, scale_value=-0.07),
         np.float16, tensor_core_device)


def test_dense_whole_tiles_then_a_partial_one_d128(tensor_core_device):
    q, k, v = qkv(np.random.default_rng(9), "BSND", BF16, 1, 1, 1, 20, 200, 128)
    _run((q, k, v), dict(num_heads=1, input_layout="BSND", scale_value=0.088), BF16,
         tensor_core_device)


@pytest.mark.parametrize("ip", [1, 2])
def test_user_mask_pse_and_empty_rows(tensor_core_device, ip):
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, "BNSD", np.float16, 1, 1, 1, 70, 75, 64)
    mask = rng.random((70, 75)) < 0.3
    mask[5] = True                               # a row with no key: contract 'Empty rows'
    pse = rng.standard_normal((1, 1, 70, 75)).astype(np.float16)
    pse[0, 0, 66, :] = -np.inf
    _run((q, k, v, mask, None, None, pse), dict(num_heads=1, input_layout="BNSD", sparse_mode=0,
                                                 pre_tokens=40, next_tokens=10,
                                                 inner_precise=ip), np.float16,
         tensor_core_device)


@pytest.mark.parametrize("dtype,d", [(np.float16, 64), (BF16, 128)], ids=["fp16", "bf16"])
def test_sdpa_softcap_and_sinks_causal_gqa(tensor_core_device, dtype, d):
    """The SDPA drop-in's extensions on the tensor-core kernel: a softcap (the masked variant
    caps every accumulator) and sink logits (the finish: one far above the scores, whose rows
    are nearly all sink), causal (top-left) with GQA, and the lse taking the sinks."""
    rng = np.random.default_rng(10)
    q, k, v = qkv(rng, "BNSD", dtype, 1, 2, 1, 70, 83, d)
    q = (q.astype(np.float32) * 4).astype(dtype)      # scores well past the cap
    sinks = np.array([-1.0, 9.0], np.float32)
    options = dict(dropout_p=0.0, is_causal=True, scale=None, enable_gqa=True, softcap=2.0)
    out, lse = _attend((q, k, v, None, sinks), options, want_lse=True, device="cuda")
    assert "cuda tensor-core queued: " in tensor_core_device.text
    kw = dict(num_heads=2, num_key_value_heads=1, input_layout="BNSD", scale_value=d ** -0.5,
              inner_precise=2, sparse_mode=2, attn_mask=CAUSAL, softcap=2.0, sinks=sinks)
    ref = assert_matches_reference(out, (q, k, v), kw, dtype, lse=lse)
    plain = reference.prompt_flash_attention(q, k, v, **dict(kw, softcap=None, sinks=None))
    assert np.abs(plain - ref).max() > 0.05          # the extensions changed the result


@pytest.mark.skipif(not SIMULATED, reason="calls the device function as Python")
def test_the_sfu_softcap_is_the_tanh_cap():
    """The capped variants' softcap (cap2 - 2 cap2 / (1 + 2^(t k)), log2 units) is
    cap2 tanh(t / cap2) within a few float32 ulp of cap2 (exact exp2 and reciprocal here: the
    algebra and the special values), +-inf give +-cap2 and NaN stays NaN."""
    from pfa_numba.gpu.tc_kernel import LOG2E, make_softcap_log2, softcap_terms
    softcap_log2 = make_softcap_log2()
    for softcap in (0.5, 30.0, 50.0):
        cap = softcap_terms(np.array([0, 0, 0, 0, 0, 0, softcap], np.float32))
        cap2 = float(cap[0])
        assert cap2 == np.float32(softcap) * LOG2E
        for t in np.concatenate([np.linspace(-6, 6, 121) * cap2, [0.0, 1e-30, -1e-6]]):
            t = np.float32(t)
            got = float(softcap_log2(t, cap))
            assert abs(got - cap2 * np.tanh(np.float64(t) / cap2)) <= 8 * np.spacing(
                np.float32(cap2)), (softcap, t, got)
        assert softcap_log2(np.float32(np.inf), cap) == np.float32(cap2)
        assert softcap_log2(np.float32(-np.inf), cap) == -np.float32(cap2)
        assert np.isnan(softcap_log2(np.float32(np.nan), cap))


def test_float16_additive_mask_d128(tensor_core_device):
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, "BNSD", np.float16, 1, 1, 1, 20, 70, 128)
    mask = (rng.random((20, 70)) < 0.5).astype(np.float16)
    with pytest.warns(DeprecationWarning):
        _run((q, k, v, mask), dict(num_heads=1, input_layout="BNSD", sparse_mode=1),
             np.float16, tensor_core_device, lse=False)


def test_tnd_lengths_causal(tensor_core_device):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((100, 2, 64)).astype(BF16)
    k = rng.standard_normal((140, 1, 64)).astype(BF16)
    v = rng.standard_normal((140, 1, 64)).astype(BF16)
    _run((q, k, v, CAUSAL, [30, 100], [50, 140]),
         dict(num_heads=2, num_key_value_heads=1, input_layout="TND", sparse_mode=3), BF16,
         tensor_core_device)


def test_padded_lengths_with_empty_batch(tensor_core_device):
    q, k, v = qkv(np.random.default_rng(6), "BNSD", np.float16, 2, 1, 1, 70, 70, 64)
    _run((q, k, v, None, [70, 0], [66, 3]), dict(num_heads=1, input_layout="BNSD"), np.float16,
         tensor_core_device)


def test_fia_prefill_on_a_contiguous_cache(tensor_core_device):
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, "BNSD", np.float16, 1, 2, 1, 65, 90, 64)
    kw = dict(num_heads=2, num_key_value_heads=1, input_layout="BNSD", sparse_mode=3)
    out, lse = fused_infer_attention_score(q, k, v, atten_mask=CAUSAL, **kw,
                                           softmax_lse_flag=True, device="cuda")
    assert "cuda tensor-core queued: " in tensor_core_device.text
    assert_matches_reference(out, (q, k, v, CAUSAL), kw, np.float16, lse=lse)


def _fia_check(args, kw, dtype, log):
    """fused_infer_attention_score on CUDA against the float64 reference of the operator, run
    on the tensor-core kernel."""
    from test_fia import _check
    import test_fia
    real = test_fia.fia
    test_fia.fia = lambda *a, **k: fused_infer_attention_score(*a, **k, device="cuda")
    try:
        _check(args, kw, dtype)
    finally:
        test_fia.fia = real
    assert "cuda tensor-core queued: " in log.text, log.text


def test_fia_prefill_on_a_paged_pool(tensor_core_device):
    """70 query rows over a paged BSH pool of 16-row blocks in shuffled order (kv lengths 100
    and 37), causal: the tiles walk the block table; the value pool a view with wider rows
    than the key pool's (K and V places differ)."""
    rng = np.random.default_rng(8)
    bs, lens, n, nkv, d = 16, [100, 37], 2, 1, 64
    table = np.full((2, 7), -1, np.int64)
    order = rng.permutation(10)
    table[0], table[1, :3] = order[:7], order[7:]
    keys = rng.standard_normal((10, bs, nkv * d)).astype(np.float16)
    vals = rng.standard_normal((10, bs, 2 * nkv * d)).astype(np.float16)[..., nkv * d:]
    q = rng.standard_normal((2, 70, n * d)).astype(np.float16)
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BSH", scale=d ** -0.5,
              softmax_lse_flag=True, block_table=table, block_size=bs,
              actual_seq_lengths_kv=lens, atten_mask=CAUSAL, sparse_mode=3)
    _fia_check((q, keys, vals), kw, np.float16, tensor_core_device)


def test_fia_prefill_after_a_shared_prefix_with_empty_rows(tensor_core_device):
    """bf16, a shared prefix of 70 rows before each batch's own, a user mask with a row that
    keeps nothing (contract 'Empty rows': the mean of V over the prefix and the own rows)."""
    rng = np.random.default_rng(9)
    n, nkv, d, sq = 2, 1, 64, 40
    q = rng.standard_normal((2, n, sq, d)).astype(BF16)
    k, v = (rng.standard_normal((2, nkv, 50, d)).astype(BF16) for _ in range(2))
    pk, pv = (rng.standard_normal((1, nkv, 80, d)).astype(BF16) for _ in range(2))
    mask = rng.random((2, 1, sq, 120)) < 0.3
    mask[:, :, 7] = True
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", scale=d ** -0.5,
              softmax_lse_flag=True, key_shared_prefix=pk, value_shared_prefix=pv,
              actual_shared_prefix_len=70, actual_seq_lengths_kv=[50, 20], atten_mask=mask)
    _fia_check((q, k, v), kw, BF16, tensor_core_device)


def test_an_inf_in_a_shared_prefix_value_row_dropped_by_a_row(tensor_core_device):
    """A masked prefill after a shared prefix whose V holds inf in a row the first rows drop:
    the guard scans the prefix's values too, and the portable kernel computes the call (the
    dropping rows stay finite)."""
    rng = np.random.default_rng(10)
    n, nkv, d, sq = 2, 1, 64, 20
    q = rng.standard_normal((1, n, sq, d)).astype(np.float16)
    k, v = (rng.standard_normal((1, nkv, 30, d)).astype(np.float16) for _ in range(2))
    pk, pv = (rng.standard_normal((1, nkv, 40, d)).astype(np.float16) for _ in range(2))
    mask = np.zeros((1, 1, sq, 70), bool)
    mask[0, 0, :5, 20:40] = True            # rows 0-4 drop prefix rows 20-39
    pv[0, 0, 39, 3] = np.inf                # kept by rows 5 on only
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", scale=d ** -0.5,
              softmax_lse_flag=True, key_shared_prefix=pk, value_shared_prefix=pv,
              actual_shared_prefix_len=40, atten_mask=mask)
    _fia_check((q, k, v), kw, np.float16, tensor_core_device)


def _int8(rng, shape):
    return rng.integers(-128, 128, shape).astype(np.int8)


def test_fia_prefill_on_an_int8_cache_causal(tensor_core_device):
    """70 query rows over an int8 cache (channel planes with offsets), causal: each tile
    staged as int8 rows and dequantized into the tile by the threads that copied them."""
    from test_fia import _antiquant_args
    rng = np.random.default_rng(11)
    n, nkv, d, s = 2, 1, 64, 100
    q = rng.standard_normal((1, n, 70, d)).astype(np.float16)
    k, v = _int8(rng, (1, nkv, s, d)), _int8(rng, (1, nkv, s, d))
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", scale=d ** -0.5,
              softmax_lse_flag=True, atten_mask=CAUSAL, sparse_mode=3,
              **_antiquant_args(rng, "merged per-channel", s, b=1, nkv=nkv, d=d))
    _fia_check((q, k, v), kw, np.float16, tensor_core_device)


def test_fia_prefill_on_an_int8_paged_pool_bf16_d128(tensor_core_device):
    """bf16 at D 128 over an int8 paged pool with token planes by paged slot (the guard scans
    their limits), kv lengths 90 and 20."""
    from test_fia import _antiquant_args
    rng = np.random.default_rng(12)
    bs, nb, n, nkv, d = 16, 10, 2, 1, 128
    table = rng.permutation(nb)[:8].reshape(2, 4).astype(np.int32)
    table = np.concatenate([table, rng.permutation(nb)[:4].reshape(2, 2).astype(np.int32)], 1)
    k, v = _int8(rng, (nb, nkv, bs, d)), _int8(rng, (nb, nkv, bs, d))
    q = rng.standard_normal((2, n, 65, d)).astype(BF16)
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", scale=d ** -0.5,
              softmax_lse_flag=True, block_table=table, block_size=bs,
              actual_seq_lengths_kv=[90, 20],
              **_antiquant_args(rng, "paged per-token", 96, nb, bs, b=2, nkv=nkv, d=d))
    _fia_check((q, k, v), kw, BF16, tensor_core_device)
