"""Row-major float32 GEMM for the CPU kernel, straight through SciPy's BLAS ``sgemm``.

``np.dot`` inside ``njit`` cannot accumulate into its output (beta = 1), so ``P @ V`` would need
a temporary and an extra pass per tile. Here the kernel calls the Fortran ``sgemm`` that
``scipy.linalg.cython_blas`` exports, through its address passed in at run time: compiled
kernels hold no address (they stay cacheable), and SciPy (slow to import) is only imported
by a call that uses BLAS (:func:`sgemm_address`).
"""
import ctypes

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._vector import element_args, element_pointer

_address = None


def sgemm_address():
    """Address of SciPy's Fortran sgemm (imports scipy.linalg on first use)."""
    global _address
    if _address is None:
        import scipy.linalg.cython_blas as cython_blas
        capsule = cython_blas.__pyx_capi__["sgemm"]
        get_name = ctypes.pythonapi.PyCapsule_GetName
        get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
        get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
        get_pointer.restype = ctypes.c_void_p
        get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        _address = get_pointer(capsule, get_name(capsule))
    return _address


_VOIDP = ir.IntType(8).as_pointer()
#: Fortran sgemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc): every
#: argument by pointer.
_SGEMM = ir.FunctionType(ir.VoidType(), [_VOIDP] * 13)


@intrinsic
def _call(typingctx, address, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Call the sgemm at ``address`` (an integer) with its 13 pointer arguments."""
    args = (transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
    if not isinstance(address, types.Integer) or any(x != types.voidptr for x in args):
        return None

    def codegen(context, builder, sig, llargs):
        fn = builder.inttoptr(llargs[0], _SGEMM.as_pointer())
        builder.call(fn, llargs[1:])
        return context.get_dummy_value()

    return types.none(address, *args), codegen


@intrinsic
def _elem_ptr(typingctx, arr, idx):
    """Address of ``arr.flat[idx]`` (a C-contiguous 1-D array) as a void pointer."""
    if not element_args(arr, idx):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(element_pointer(context, builder, sig, args), cgutils.voidptr_t)

    return types.voidptr(arr, idx), codegen


@njit(inline="always")
def gemm_rm(blas, m, n, k, a, a_off, lda, trans_b, b, b_off, ldb, c, c_off, ldc, beta):
    """C[m, n] = A[m, k] @ op(B) + beta * C, all row-major float32 in flat buffers.

    ``op(B)`` is B[k, n] (``trans_b`` False) or B[n, k]^T (``trans_b`` True). Row-major C is
    column-major C^T, so this asks BLAS for C^T = op(B)^T @ A^T. ``blas``: (six int32, two
    float32, the characters "NT", the sgemm address of :func:`sgemm_address`).
    """
    ints, flts, chars, address = blas
    ints[0] = n
    ints[1] = m
    ints[2] = k
    ints[3] = ldb
    ints[4] = lda
    ints[5] = ldc
    flts[0] = np.float32(1.0)
    flts[1] = beta
    _call(address, _elem_ptr(chars, 1 if trans_b else 0), _elem_ptr(chars, 0),
          _elem_ptr(ints, 0), _elem_ptr(ints, 1), _elem_ptr(ints, 2), _elem_ptr(flts, 0),
          _elem_ptr(b, b_off), _elem_ptr(ints, 3), _elem_ptr(a, a_off), _elem_ptr(ints, 4),
          _elem_ptr(flts, 1), _elem_ptr(c, c_off), _elem_ptr(ints, 5))
