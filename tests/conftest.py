import numpy as np
import pytest

from pfa_numba import config
from pfa_numba.cpu import _gemm


def pytest_configure(config):
    config.addinivalue_line("markers", "quant: int8 quantization (contract 'Quantization')")


@pytest.fixture(autouse=True)
def _numpy_warnings_stay_warnings():
    # underflow (a value rounding to a float16 subnormal or to zero) is how test data in the
    # narrow dtypes is made, and NumPy ignores it by default too
    with np.errstate(all="warn", under="ignore"):
        yield


@pytest.fixture(params=["register blocks", "blas"])
def products(request, monkeypatch):
    """Run a kernel test on each float32 product path (bf16 stays on AMX where the host has
    it, except on the BLAS path)."""
    if request.param == "register blocks" and not _gemm.available():
        pytest.skip("this CPU has no AVX-512 (tested where it has)")
    monkeypatch.setattr(config, "CPU_AVX512_GEMM", request.param != "blas")
    if request.param == "blas":
        monkeypatch.setattr(config, "CPU_AMX", False)  # bf16 through BLAS too
    return request.param
