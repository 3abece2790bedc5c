"""The guard of the tensor-core kernels: what decides on the device, before they run, that
the portable kernel computes a call instead (the kernel variants' ``guard_scans`` say which scans a call
gets), and the host's part of that rule for int8 caches.

A value of V that is inf or NaN in a column some row drops would reach that row through
0 * inf in P V (:func:`nonfinite_scan`); an int8 cache's values, dequantized and rounded to
the query's type by the kernels' int8 variants, must stay finite there
(:func:`antiquant_limits`, :func:`limit_scan`). Each scan writes the call's guard id into its
stream's guard word; the kernels read it on the device: no host round trip decides.
"""
import numba
import numpy as np
from numba import cuda

from ..numerics.dtypes import F16

def dequantizes(p):
    """Whether planned problem ``p`` reads an int8 kv cache (the kernels' ``int8`` variants)."""
    return p.cache is not None and bool(p.cache.antiquant)


#: the largest finite values of the kernels' types (an int8 cache's rows are rounded to them)
TYPE_MAX = {"f16": 65504.0, "bf16": 3.3895313892515355e38}
#: the margin kept below TYPE_MAX for float32's rounding of the dequantization
_ROUNDING = 1.0 - 2.0 ** -8


def antiquant_limits(p):
    """How the tensor-core kernels, which round an int8 cache's dequantized values to the
    query's type, keep them finite there: [(token plane, limit)], where a call whose plane
    holds a value of magnitude beyond its limit or NaN is the portable kernel's (the guard
    scans the planes on the device), or None where the channel planes already decide that
    the values may not be finite (a scale or offset not finite, or beyond the range). With
    A = 128 + max |channel offset| and S = max |channel scale|: |x + offsets| <= 3 A while a
    token offset is <= 2 A, so |value| < max while a token scale is <= max / (3 A S)."""
    top = TYPE_MAX["f16" if np.dtype(p.dtype) == F16 else "bf16"] * _ROUNDING
    limits = []
    for planes, (ts, to) in zip(p.cache.antiquant, (("kts", "kto"), ("vts", "vto"))):
        scales, offsets = planes.channel
        if not (np.isfinite(scales).all() and np.isfinite(offsets).all()):
            return None
        a, sc = 128.0 + float(np.abs(offsets).max()), float(np.abs(scales).max())
        if planes.token_scale is None:
            if a * sc >= top:
                return None
            continue
        span = 3 * a if planes.token_offset is not None else a
        limits.append((ts, min(top / (span * sc), 3e38) if sc else 3e38))
        if planes.token_offset is not None:
            limits.append((to, 2 * a))
    return limits


def antiquant_reason(p):
    """None unless planned problem ``p`` reads an int8 cache whose dequantized values the
    channel planes say may not be finite in the query's type (:func:`antiquant_limits`)."""
    if not dequantizes(p) or antiquant_limits(p) is not None:
        return None
    return (f"an int8 cache whose channel scales or offsets are not finite or may take its "
            f"values beyond {np.dtype(p.dtype).name}'s range: the portable kernel keeps them "
            "in float32")


def _scan_source(exp_mask):
    mask = np.uint16(exp_mask)

    def nonfinite(x, guard, guard_id):
        for e in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
            if (x[e] & mask) == mask:
                guard[0] = guard_id
    return nonfinite


def _beyond(x, limit, guard, guard_id):
    for e in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        if not abs(x[e]) <= limit:
            guard[0] = guard_id


_SCANS = {}

#: the scan's grid: blocks and threads (a grid-stride loop: any grid covers V; the simulator
#: runs each thread as a Python thread)
SCAN_GRID = (1, 32) if numba.config.ENABLE_CUDASIM else (256, 256)


def nonfinite_scan(kind):
    """The kernel that writes its guard_id to guard[0] where a 16-bit value of its flat V span
    is inf or NaN (all exponent bits set). A dropped column of such a V would reach its rows
    through 0 * inf in P V, so the call is then the portable kernel's: the tensor-core kernel
    and the portable one are launched behind the scan, and each reads guard[0] on the device
    (:func:`.kernels.runs_here`): no host round trip decides."""
    if kind not in _SCANS:
        _SCANS[kind] = cuda.jit(_scan_source(0x7C00 if kind == "f16" else 0x7F80))
    return _SCANS[kind]


def limit_scan():
    """The kernel that writes its guard_id to guard[0] where a float32 value of its flat span
    (an int8 cache's token plane) is NaN or of magnitude beyond its ``limit``
    (:func:`antiquant_limits`), launched as :func:`nonfinite_scan` is."""
    if "limit" not in _SCANS:
        _SCANS["limit"] = cuda.jit(_beyond)
    return _SCANS["limit"]
