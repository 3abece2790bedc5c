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

from pfa_numba import fused_infer_attention_score, prompt_flash_attention  # noqa: E402
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
    assert "the tensor-core kernel runs this call" in log.text, log.text
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
    assert "the tensor-core kernel runs this call" in tensor_core_device.text
    assert_matches_reference(out, (q, k, v, CAUSAL), kw, np.float16, lse=lse)
