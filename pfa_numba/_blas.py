"""Row-major float32 GEMM for the CPU kernel, straight through SciPy's BLAS ``sgemm``.

``np.dot`` inside ``njit`` cannot accumulate into its output (beta = 1), so ``P @ V`` would need
a temporary and an extra pass per tile. Here the kernel calls the Fortran ``sgemm`` that
``scipy.linalg.cython_blas`` exports: its address is registered with LLVM under a fixed symbol
name, so kernels that call it stay cacheable (the cache holds the name, not the address).
"""
import ctypes

import numpy as np
import scipy.linalg.cython_blas as _cython_blas
from llvmlite import binding as _llvm
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

SYMBOL = "pfa_numba_scipy_sgemm"


def _capsule_address(capsule):
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return get_pointer(capsule, get_name(capsule))


_llvm.add_symbol(SYMBOL, _capsule_address(_cython_blas.__pyx_capi__["sgemm"]))

#: Fortran sgemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc): every
#: argument by pointer.
_sgemm = types.ExternalFunction(SYMBOL, types.void(*([types.voidptr] * 13)))


@intrinsic
def _elem_ptr(typingctx, arr, idx):
    """Address of ``arr.flat[idx]`` (a C-contiguous 1-D array) as a void pointer."""
    if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.bitcast(ptr, cgutils.voidptr_t)

    return types.voidptr(arr, idx), codegen


@njit(inline="always")
def scratch():
    """Per-thread argument block for :func:`gemm_rm` (ints, floats, transpose flags)."""
    ints = np.empty(6, np.int32)
    flts = np.empty(2, np.float32)
    chars = np.empty(2, np.uint8)
    chars[0] = 78  # 'N'
    chars[1] = 84  # 'T'
    return ints, flts, chars


@njit(inline="always")
def gemm_rm(ints, flts, chars, m, n, k, a, a_off, lda, trans_b, b, b_off, ldb, c, c_off, ldc,
            beta):
    """C[m, n] = A[m, k] @ op(B) + beta * C, all row-major float32 in flat buffers.

    ``op(B)`` is B[k, n] (``trans_b`` False) or B[n, k]^T (``trans_b`` True). Row-major C is
    column-major C^T, so this asks BLAS for C^T = op(B)^T @ A^T.
    """
    ints[0] = n
    ints[1] = m
    ints[2] = k
    ints[3] = ldb
    ints[4] = lda
    ints[5] = ldc
    flts[0] = np.float32(1.0)
    flts[1] = beta
    _sgemm(_elem_ptr(chars, 1 if trans_b else 0), _elem_ptr(chars, 0),
           _elem_ptr(ints, 0), _elem_ptr(ints, 1), _elem_ptr(ints, 2), _elem_ptr(flts, 0),
           _elem_ptr(b, b_off), _elem_ptr(ints, 3), _elem_ptr(a, a_off), _elem_ptr(ints, 4),
           _elem_ptr(flts, 1), _elem_ptr(c, c_off), _elem_ptr(ints, 5))
