import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "quant: int8 quantization (SPEC section 8)")


@pytest.fixture(autouse=True)
def _numpy_warnings_stay_warnings():
    with np.errstate(all="warn"):
        yield
