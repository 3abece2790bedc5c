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


@pytest.fixture(autouse=True)
def _explain_names_what_runs(monkeypatch):
    """Every CPU call the suite makes runs only what explain says of it: the chosen kernel,
    and the kernels its explanation names as running beside it or instead (its fallbacks)."""
    from pfa_numba.cpu import driver
    run = driver.Launch.run

    def checked(self, *args, **kwargs):
        results = run(self, *args, **kwargs)
        told = " ".join(self.kernel.fallbacks(self.p, self.work)) if self.kernel else ""
        for name, _ in self.ran:
            assert name == self.kernel.name or name in told, \
                (f"{name} ran beside the {self.kernel.name} kernel, which explain does not say: "
                 f"{told!r}")
        return results

    monkeypatch.setattr(driver.Launch, "run", checked)
