"""The int8 output's second pass (contract 'Quantization'): the float16 (or float32) result
quantized row by row."""
import numpy as np
from numba import njit

from ..numerics.core import quantize_output, widen
from ._jit import LEAF
from ._vector import take_next


@njit(**LEAF)
def quantize(t, args):
    """The quantize-output worker (thread t): y[b, n, i, :] = numerics.core.quantize_output of
    the rows computed (flags 1), one batch b a take; the others stay 0. o, y: (B, N, Sq, D)
    views; scale2 / offset2: float16-rounded, 1 or N*D values; code: o's storage code."""
    o, flags, scale2, offset2, y, taken, code = args[0]
    B, N, S, D = o.shape
    per_channel = scale2.size > 1
    b = take_next(taken)
    while b < B:
        for n in range(N):
            for i in range(S):
                if flags[b, n, i, 0] == 0:
                    continue
                for d in range(D):
                    c = n * D + d if per_channel else 0
                    y[b, n, i, d] = np.int8(quantize_output(widen(o[b, n, i, d], code),
                                                            scale2[c], offset2[c]))
        b = take_next(taken)
