"""The SDPA drop-in's score extensions on CUDA (``device="cuda"``): softcapped scores and
attention sinks on the portable kernel (head dim 16: the tensor-core kernels take 64 and 128;
their own cases are in test_tc_sim.py and test_decode_sim.py), against pfa_numba.reference,
with patched small tiles so every case crosses several query blocks and kv tiles: under the
CUDA simulator, or on a real GPU when the process has one."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numba  # noqa: E402
from numba import cuda  # noqa: E402

from pfa_numba import config, dispatch, reference, scaled_dot_product_attention  # noqa: E402
from pfa_numba.sdpa import attention_problem  # noqa: E402
from _cases import BF16, assert_matches_reference  # noqa: E402

if not numba.config.ENABLE_CUDASIM and not cuda.is_available():
    pytest.skip("no GPU here: run with NUMBA_ENABLE_CUDASIM=1 (scripts/run_tests.py does)",
                allow_module_level=True)

DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": BF16}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(config, "CUDA_Q_ROWS", 4)
    monkeypatch.setattr(config, "CUDA_KV_COLS", 3)


def _qkv(rng, dtype, n=4, nkv=2, sq=7, skv=9, d=16, spread=3.0):
    shapes = ((2, n, sq, d), (2, nkv, skv, d), (2, nkv, skv, d))
    return [(rng.standard_normal(s) * spread).astype(np.float32).astype(dtype) for s in shapes]


def _reference_kwargs(n, nkv, d, softcap, sinks):
    """The reference's arguments for an SDPA call without a mask (no band: every column)."""
    return dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD",
                scale_value=d ** -0.5, inner_precise=2, next_tokens=2147483647,
                softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("softcap,with_sinks", [(2.0, False), (None, True), (1.5, True)],
                         ids=["softcap", "sinks", "both"])
def test_extensions_match_the_reference(dtype, softcap, with_sinks):
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, DTYPES[dtype])
    # sinks from below the scores to far above them (a head whose rows are nearly all sink)
    sinks = np.linspace(-2.0, 12.0, 4).astype(np.float32) if with_sinks else None
    got = scaled_dot_product_attention(q, k, v, enable_gqa=True, softcap=softcap, sinks=sinks,
                                       device="cuda")
    assert isinstance(got, np.ndarray) and got.dtype == DTYPES[dtype]
    ref = assert_matches_reference(got, (q, k, v), _reference_kwargs(4, 2, 16, softcap, sinks),
                                   DTYPES[dtype])
    plain = reference.prompt_flash_attention(q, k, v, **_reference_kwargs(4, 2, 16, None, None))
    assert np.abs(plain - ref).max() > 0.05          # the extension changed the result


def test_with_a_mask_rows_that_keep_nothing_and_a_causal_band():
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, np.float16)
    keep = rng.random((7, 9)) < 0.5
    keep[3] = False                                  # a row that keeps nothing: zeros
    sinks = np.array([1.0, -1.0, 2.0, 0.0], np.float32)
    got = scaled_dot_product_attention(q, k, v, keep, enable_gqa=True, softcap=3.0,
                                       sinks=sinks, device="cuda")
    kw = _reference_kwargs(4, 2, 16, 3.0, sinks)
    assert_matches_reference(got, (q, k, v), dict(kw, attn_mask=~keep[None], sparse_mode=1),
                             np.float16)
    assert not got[:, :, 3].any()
    got = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, softcap=3.0,
                                       sinks=sinks, device="cuda")
    causal = np.triu(np.ones((2048, 2048), bool), 1)
    assert_matches_reference(got, (q, k, v), dict(kw, attn_mask=causal, sparse_mode=2),
                             np.float16)


def test_softmax_lse_takes_the_sink():
    from pfa_numba.sdpa import _attend
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, np.float32)
    sinks = np.array([0.5, 3.0, -1.0, 8.0], np.float32)
    options = dict(dropout_p=0.0, is_causal=False, scale=None, enable_gqa=True, softcap=2.5)
    _, lse = _attend((q, k, v, None, sinks), options, want_lse=True, device="cuda")
    _, want = reference.prompt_flash_attention(q, k, v, **_reference_kwargs(4, 2, 16, 2.5, sinks),
                                               return_softmax_lse=True)
    np.testing.assert_allclose(lse.reshape(want.shape), want, rtol=1e-5, atol=1e-5)


def test_every_cuda_kernel_computes_the_extensions():
    """The tensor-core and decode kernels declare softcapped scores and sinks as the portable
    one does (their runs: test_tc_sim.py, test_decode_sim.py)."""
    q, k, v = _qkv(np.random.default_rng(3), np.float16, d=64)
    p = attention_problem(q, k, v, None, np.zeros(4, np.float32), dropout_p=0.0,
                          is_causal=False, scale=None, enable_gqa=True, softcap=2.0)
    assert dispatch.extensions(p) == ("softcap", "sinks")
    for name in ("decode", "tensor-core", "portable"):
        assert dispatch.kernel("cuda", name).extensions == tuple(dispatch.EXTENSIONS), name


def test_softcaps_beyond_the_sfu_forms_range_take_the_portable_kernel():
    """The tensor-core kernels' softcap is accurate to P's rounding for caps up to 1024 (and
    down to 2^-64): others go to the portable kernel, with the reason."""
    from pfa_numba.gpu import decode_kernel, tc_conditions
    q, k, v = _qkv(np.random.default_rng(4), np.float16, d=64)
    for softcap, taken in ((50.0, True), (1024.0, True), (1025.0, False), (2.0 ** -70, False)):
        p = attention_problem(q, k, v, None, None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=True, softcap=softcap)
        for reason in (tc_conditions.tensor_core_reason, decode_kernel.decode_reason):
            why = reason(p)
            assert (why is None) == taken, (softcap, reason.__name__, why)
            assert taken or f"softcap {softcap!r}" in why
