"""The AMX kernel and the AVX-512 register-block tiles compile on any x86-64 host: they run only
where the CPU has AMX (AVX-512), so elsewhere their typing would go unchecked. Compiled (not
run) for a Sapphire Rapids target in a process of its own, with its own Numba cache."""
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="AMX and AVX-512 are x86-64 extensions")

COMPILE = """
import numpy as np, ml_dtypes
from pfa_numba import dispatch
from pfa_numba.cpu import driver
from pfa_numba.frontend import pfa as PV
from pfa_numba.frontend.problem import plan
driver.use_register_blocks = lambda: True        # the host check reads the target's features
for kernel, dtypes in (("amx", (np.float16, ml_dtypes.bfloat16)),
                       ("avx512-tiles", (np.float16, np.float32))):
    for dt in dtypes:
        q = np.zeros((1, 2, 8, 32), dt)
        p = plan(PV.validate(PV.Call(q, q, q, num_heads=2, input_layout='BNSD')))
        launch = driver.prepare(p, dispatch.kernel("cpu", kernel), driver.divide(p))
        launch.compile()
        print('compiled', kernel, np.dtype(dt).name)
"""


def test_amx_and_avx512_kernels_compile_for_an_amx_cpu(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_CPU_NAME="sapphirerapids",
               NUMBA_CPU_FEATURES="+amx-tile,+amx-bf16,+avx512f,+avx512bw,+avx512vl,+avx512dq,"
                                  "+avx512bf16,+f16c,+fma,+avx2")
    res = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                         env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split("\n")[:4] == ["compiled amx float16", "compiled amx bfloat16",
                                          "compiled avx512-tiles float16",
                                          "compiled avx512-tiles float32"]
