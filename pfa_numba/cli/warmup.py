"""Compiling every CPU kernel ahead (``python -m pfa_numba warmup``, a deployment image's build
step): each kernel's worker for each storage it runs on, compiled (or loaded from Numba's
cache) without running anything.

A worker is specialised by the types of its records, which follow the storage of the query and
of the key / value (float16 and bfloat16 share uint16 storage; an int8 kv cache is a storage of
its own), not the layout (the kernels read flat storage), except the int8 output's
quantization, which reads the output in its layout (contiguous, or a view).
"""
import time

import numpy as np

from .. import config
from ..api import PfaPlan
from ..cpu import _amx, backward, driver
from ..cpu.variants import KERNELS
from ..fia import FiaPlan

#: the storages of query and key / value a float kernel is compiled for
STORAGES = (("float16", np.float16, None), ("float32", np.float32, None),
            ("float16 query, int8 kv cache", np.float16, np.int8),
            ("float32 query, int8 kv cache", np.float32, np.int8))


def _problem(query_dtype, kv_dtype=None, layout="BNSD", **kwargs):
    """A small planned problem: PFA's, or FIA's over an int8 kv cache."""
    shape = (1, 2, 4, 16) if layout == "BNSD" else (1, 4, 32)
    q = np.ones(shape, query_dtype)
    if kv_dtype is None:
        return PfaPlan._checked(PfaPlan._bound(q, q, q, num_heads=2, input_layout=layout,
                                               **kwargs))[0]
    kv = np.ones(shape, kv_dtype)
    return FiaPlan._checked(FiaPlan._bound(q, kv, kv, num_heads=2, input_layout=layout,
                                           antiquant_scale=np.ones(2, query_dtype)))[0]


def _steps(p, *names):
    """Compile the steps ``names`` of driver.Steps for planned problem ``p``."""
    work = driver.divide(p)
    launch = driver.prepare(p, KERNELS[-1], work)
    out = np.zeros(p.out_shape, launch.direct_dtype)
    steps = driver.Steps(launch, launch.records(out, np.zeros(p.lse_shape, np.float32),
                                                np.zeros(1, np.uint8)), compile_only=True)
    for name in names:
        getattr(steps, name)(*(() if name == "merge" else (work.runs,)))


def _quantize(dtype, layout):
    """Compile the int8 output's quantization of a ``dtype`` result in ``layout``."""
    one = np.ones(1, np.float32)
    p = _problem(dtype, layout=layout, quant_scale2=one)
    out = np.zeros(p.out_shape, np.float16 if dtype == np.float16 else np.float32)
    driver.quantize_output(p, out, np.zeros(p.lse_shape, np.uint8), compile_only=True)


def _backward():
    """Compile the backward's kv pass and query pass (float32 whatever the inputs)."""
    p = _problem(np.float32)
    out = np.zeros(p.out_shape, np.float32)
    lse = np.zeros(p.lse_shape, np.float32)
    for whole_heads in (True, False):
        backward.attention_gradients(p, out, out, lse, False, whole_heads)
    backward.attention_weights(p, lse)


def jobs():
    """[(what, job)]: every CPU kernel's compilation, each storage a job."""
    tiles = "avx512-tiles" if driver.use_register_blocks() else "blas-tiles"
    found = []
    for what, q, kv in STORAGES:
        found.append((f"{tiles}, streaming and merge, {what}",
                      lambda q=q, kv=kv: _steps(_problem(q, kv), "tiles", "streaming",
                                                "merge")))
    deq = dict(deq_scale1=np.ones(1, np.float32), quant_scale1=np.ones(1, np.float32),
               deq_scale2=np.ones(1, np.float32))
    found.append(("int8, int8 query, key and value", lambda: _steps(_problem(np.int8, **deq),
                                                                    "int8")))
    for dtype in (np.float16, np.float32):
        for layout in ("BNSD", "BSH"):
            found.append((f"quantize-output, {np.dtype(dtype).name} result, {layout}",
                          lambda dtype=dtype, layout=layout: _quantize(dtype, layout)))
    if _amx.available() and config.CPU_AMX:
        found.append(("amx, float16 and bfloat16", lambda: _steps(_problem(np.float16),
                                                                  "amx")))
    found.append(("backward kv pass and query pass, float32", _backward))
    return found


def warm(report):
    """Compile every CPU kernel (:func:`jobs`), calling ``report(line)`` as each starts and
    ends; returns the seconds taken."""
    start = time.perf_counter()
    for what, job in jobs():
        report(f"  {what} ...")
        t0 = time.perf_counter()
        job()
        report(f"    {time.perf_counter() - t0:.1f} s")
    return time.perf_counter() - start
