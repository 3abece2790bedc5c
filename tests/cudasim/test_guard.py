"""The tensor-core route's rule for a V holding inf or NaN, decided on the device: the scan
kernel writes the call's guard id where it finds one, and the portable kernel launched behind
the tensor-core kernel computes the call only then. Run under the CUDA simulator or on a GPU;
the tensor-core launch is left out here: the portable kernel's part is what is checked
(test_tc_sim.py runs the tensor-core kernel)."""
import os
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numba  # noqa: E402
from numba import cuda  # noqa: E402

from pfa_numba import config, prompt_flash_attention  # noqa: E402
from pfa_numba.gpu import device, guard as G, tc_conditions, tc_kernel as T  # noqa: E402
from _cases import assert_matches_reference, qkv  # noqa: E402

if not numba.config.ENABLE_CUDASIM and not cuda.is_available():
    pytest.skip("no GPU here: run with NUMBA_ENABLE_CUDASIM=1 (scripts/run_tests.py does)",
                allow_module_level=True)

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", [np.float16, BF16])
@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan])
def test_the_scan_writes_the_guard_id_where_v_is_not_finite(dtype, bad):
    v = np.linspace(-60000, 60000, 999).astype(dtype)
    if bad is not None:
        v[517] = bad
    guard = cuda.to_device(np.array([3], np.int64))
    scan = G.nonfinite_scan(tc_conditions.kind_of(dtype))
    scan[4, 32](cuda.to_device(v.view(np.uint16)), guard, 9)
    assert guard.copy_to_host()[0] == (3 if bad is None else 9)


@pytest.fixture
def tensor_core_route(monkeypatch):
    """The tensor-core route with the tensor-core kernel's launch left out; outputs start as
    NaN bits, so that a portable kernel that wrote nothing shows."""
    monkeypatch.setattr(config, "CUDA_Q_ROWS", 4)
    monkeypatch.setattr(config, "CUDA_KV_COLS", 3)
    monkeypatch.setattr(device, "compute_capability", lambda: (9, 0))
    launch = device.launch

    def without_tc(kernel, grid, block, stream, args):
        if getattr(kernel, "py_func", kernel).__name__ != "attention_tc":
            launch(kernel, grid, block, stream, args)

    def nan_filled(n, dtype, stream):     # 16-bit and 32-bit outputs: NaN bits
        bits = np.full(n * np.dtype(dtype).itemsize // 2, 0x7E00, np.uint16)
        return cuda.to_device(bits.view(dtype), stream=stream)

    def attention_tc(*args):
        """What stands in for the tensor-core kernel (never launched here)."""

    monkeypatch.setattr(T, "tc_kernel_for", lambda *spec: attention_tc)
    monkeypatch.setattr(device, "launch", without_tc)
    monkeypatch.setattr(device, "empty", nan_filled)


def test_the_portable_kernel_computes_only_calls_whose_v_is_not_finite(tensor_core_route):
    dtype = np.float16
    q, k, v = qkv(np.random.default_rng(1), "BNSD", dtype, 1, 2, 1, 9, 11, 64)
    m = np.triu(np.ones((2048, 2048), bool), 1)
    kw = dict(num_heads=2, num_key_value_heads=1, input_layout="BNSD", sparse_mode=2)
    out = prompt_flash_attention(q, k, v, m, **kw, device="cuda")
    assert np.all(out.view(np.uint16) == 0x7E00)        # left to the tensor-core kernel
    v[0, 0, 10] = np.inf                                 # the last row keeps it
    out, lse = prompt_flash_attention(q, k, v, m, **kw, device="cuda", return_softmax_lse=True)
    assert_matches_reference(out, (q, k, v, m), kw, np.dtype(dtype), lse=lse)
