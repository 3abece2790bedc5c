import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "quant: int8 quantization (SPEC section 8)")


def pytest_collection_modifyitems(config, items):
    from pfa_numba import _plan
    if getattr(_plan, "QUANT_IMPLEMENTED", False):
        return
    for item in items:
        if item.get_closest_marker("quant"):
            item.add_marker(pytest.mark.xfail(raises=NotImplementedError, strict=False,
                                              reason="int8 quantization is not implemented yet"))


@pytest.fixture(autouse=True)
def _no_numpy_warnings_leak():
    with np.errstate(all="warn"):
        yield
