"""The AMX kernel compiles on any x86-64 host: it runs only where the CPU has AMX, so elsewhere
its typing would go unchecked. Compiled (not run) for a Sapphire Rapids target in a process of
its own, with its own Numba cache."""
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="AMX is an x86-64 extension")

COMPILE = """
import numba, numpy as np, ml_dtypes
from pfa_numba.cpu import driver
from pfa_numba.cpu.block_amx import attention_amx
from pfa_numba.frontend import pfa as PV
from pfa_numba.frontend.problem import plan
for dt in (np.float16, ml_dtypes.bfloat16):
    q = np.zeros((1, 2, 8, 32), dt)
    p = plan(PV.validate(PV.Call(q, q, q, num_heads=2, input_layout='BNSD')))
    launch = driver.prepare(p, "amx", driver.divide(p))
    out, lse, flags = np.zeros(p.out_shape, dt), np.zeros(p.lse_shape, np.float32), np.zeros(1, np.uint8)
    args = launch.records(out, lse, flags) + (launch.tuning, launch.work, launch.args.fparams)
    attention_amx.compile(tuple(numba.typeof(x) for x in args))
    print('compiled', np.dtype(dt).name)
"""


def test_amx_kernel_compiles_for_an_amx_cpu(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_CPU_NAME="sapphirerapids",
               NUMBA_CPU_FEATURES="+amx-tile,+amx-bf16,+avx512f,+avx512bw,+avx512vl,+avx512dq,"
                                  "+avx512bf16,+f16c,+fma,+avx2")
    res = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["compiled", "float16", "compiled", "bfloat16"]
