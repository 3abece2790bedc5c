"""Intel AMX bfloat16 tile products for the CPU kernel.

CPUs with AMX (Sapphire Rapids and later) multiply bfloat16 matrices in 1 KiB tile registers at
several times the float32 FMA rate. A bf16 query/key/value is already exact in bfloat16, so the
score product ``Q K^T`` runs on AMX with no rounding of its inputs, and the float32
probabilities enter ``P V`` as a sum of two bfloat16 parts (hi + lo, relative error below
2^-16, far below the bfloat16 output's rounding). A float16 value (11 significant bits) is
exactly the sum of two bfloat16 parts, so float16 problems run here too: each product sums the
three part products hi.hi + lo.hi + hi.lo (the dropped lo.lo is below 2^-16 of a term).
Products accumulate in float32.

The instructions are reached through LLVM's ``llvm.x86.*`` AMX intrinsics; tile numbers are
compile-time literals. Every tile is configured as 16 rows x 64 bytes (16 x 32 bf16, or
16 x 16 float32): a product step multiplies a 32 x 32 bf16 block of A by a 32 x 32 block of B
into a 32 x 32 float32 block of C held in tiles 0-3 (A in 4-5, B in 6-7).

AMX reads subnormal inputs as zero and flushes products below float32's normal range to zero,
so the CPU kernel scans its bf16 inputs and takes the float32 path where that could matter.
"""
import ctypes
import platform
import sys

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ._jit import LEAF_EXACT
from ._vector import host_has, llvm_function

#: rows and columns of the float32 block one product step computes (2 x 2 tiles)
BLOCK = 32

_I8 = ir.IntType(8)
_I64 = ir.IntType(64)
_VOIDP = ir.IntType(8).as_pointer()

_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158            # x86-64 Linux

_available = None


def available():
    """True when this process can run the AMX kernel: an x86-64 Linux host whose CPU has
    AMX-BF16, Numba compiling for the host CPU, and the kernel granting tile data permission."""
    global _available
    if _available is None:
        _available = _probe()
    return _available


def _probe():
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if not (host_has("amx-tile") and host_has("amx-bf16")):
        return False              # no AMX, or compiling for another CPU that may lack it
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def _declare(builder, name, argtys):
    return llvm_function(builder, name, ir.VoidType(), argtys)


def _literals(*tys):
    return all(isinstance(t, types.IntegerLiteral) for t in tys)


@intrinsic
def _tile_config(typingctx, cfg):
    """ldtilecfg from a 64-byte uint8 array."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        builder.call(_declare(builder, "llvm.x86.ldtilecfg", [_VOIDP]),
                     [builder.bitcast(ary.data, _VOIDP)])
        return context.get_dummy_value()
    return types.none(cfg), codegen


@intrinsic
def _tile_release(typingctx):
    def codegen(context, builder, sig, args):
        builder.call(_declare(builder, "llvm.x86.tilerelease", []), [])
        return context.get_dummy_value()
    return types.none(), codegen


def _memory_op(name):
    @intrinsic
    def op(typingctx, tile, arr, idx, stride_bytes):
        if not _literals(tile):
            return None

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[1])(context, builder, args[1])
            ptr = builder.bitcast(builder.gep(ary.data, [args[2]]), _VOIDP)
            builder.call(_declare(builder, name, [_I8, _VOIDP, _I64]),
                         [ir.Constant(_I8, sig.args[0].literal_value), ptr, args[3]])
            return context.get_dummy_value()
        return types.none(tile, arr, idx, stride_bytes), codegen
    return op


_tile_load = _memory_op("llvm.x86.tileloadd64")

#: C tiles 0-3 as the 32 x 32 float32 block they hold: (tile, rows down, columns right)
_C_TILES = ((0, 0, 0), (1, 0, 16), (2, 16, 0), (3, 16, 16))


def _c_block_op(name):
    """An intrinsic ``(c, c0, ldc)``: the tile memory operation ``name`` on C tiles 0-3 and the
    32 x 32 float32 block of the row-major array c (ldc elements a row) from element c0."""
    @intrinsic
    def op(typingctx, arr, c0, ldc):
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            c0_, ldc_ = (context.cast(builder, x, t, types.int64)
                         for x, t in zip(args[1:], sig.args[1:]))
            fn = _declare(builder, name, [_I8, _VOIDP, _I64])
            for tile, down, right in _C_TILES:
                idx = builder.add(builder.add(c0_, builder.mul(ldc_, ir.Constant(_I64, down))),
                                  ir.Constant(_I64, right))
                ptr = builder.bitcast(builder.gep(ary.data, [idx]), _VOIDP)
                builder.call(fn, [ir.Constant(_I8, tile), ptr,
                                  builder.mul(ldc_, ir.Constant(_I64, 4))])
            return context.get_dummy_value()
        return types.none(arr, c0, ldc), codegen
    return op


_load_c = _c_block_op("llvm.x86.tileloadd64")
_store_c = _c_block_op("llvm.x86.tilestored64")


@intrinsic
def _zero_c(typingctx):
    """C tiles 0-3 = 0."""
    def codegen(context, builder, sig, args):
        fn = _declare(builder, "llvm.x86.tilezero", [_I8])
        for tile, _, _ in _C_TILES:
            builder.call(fn, [ir.Constant(_I8, tile)])
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def _tile_dot(typingctx, c, a, b):
    """tile c += tile a (16 x 32 bf16) . tile b (VNNI 16 x 16 pairs), float32 accumulation."""
    if not _literals(c, a, b):
        return None

    def codegen(context, builder, sig, args):
        builder.call(_declare(builder, "llvm.x86.tdpbf16ps", [_I8, _I8, _I8]),
                     [ir.Constant(_I8, t.literal_value) for t in sig.args])
        return context.get_dummy_value()
    return types.none(c, a, b), codegen


def tile_config():
    """The 64-byte palette-1 configuration: tiles 0-7, each 16 rows of 64 bytes."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    cfg[16:32:2] = 64
    cfg[48:56] = 16
    return cfg


@njit(inline="always")
def _dots():
    """C tiles 0-3 += A tiles 4-5 . B tiles 6-7."""
    _tile_dot(0, 4, 6)
    _tile_dot(1, 4, 7)
    _tile_dot(2, 5, 6)
    _tile_dot(3, 5, 7)


@njit(inline="always")
def _dot_step(a, a_idx, lda_b):
    _tile_load(4, a, a_idx, lda_b)
    _tile_load(5, a, a_idx + 16 * (lda_b // 2), lda_b)
    _dots()


@njit(**LEAF_EXACT)
def gemm_bf16(cfg, a, a2_off, lda, b, b2_off, ldb, c, ldc, m, n, k, accumulate):
    """C[m, n] (+)= A[m, k] @ B[k, n]  (+ A2[m, k] @ B[k, n] when ``a2_off >= 0``)
    (+ A[m, k] @ B2[k, n] when ``b2_off >= 0``).

    A (and A2 at element offset ``a2_off`` of ``a``): row-major bf16 bits, ``lda`` elements per
    row. B (and B2 at element offset ``b2_off`` of ``b``): bf16 bits in the VNNI layout
    ``B[k // 2, n, k % 2]``, ``ldb`` elements per pair-row (>= 2 n). C: row-major float32,
    ``ldc`` per row, loaded first when ``accumulate``. m, n and k are multiples of
    :data:`BLOCK`. With both parts, the three products of two-part operands (hi + lo) but
    lo . lo are summed in one pass over C.
    """
    _tile_config(cfg)
    lda_b = lda * 2
    ldb_b = ldb * 2
    for i in range(0, m, BLOCK):
        for j in range(0, n, BLOCK):
            c0 = i * ldc + j
            if accumulate:
                _load_c(c, c0, ldc)
            else:
                _zero_c()
            for kk in range(0, k, BLOCK):
                b0 = (kk // 2) * ldb + 2 * j
                _tile_load(6, b, b0, ldb_b)
                _tile_load(7, b, b0 + 32, ldb_b)
                if a2_off >= 0:
                    _dot_step(a, a2_off + i * lda + kk, lda_b)
                _dot_step(a, i * lda + kk, lda_b)
                if b2_off >= 0:          # A is still in tiles 4-5
                    _tile_load(6, b, b2_off + b0, ldb_b)
                    _tile_load(7, b, b2_off + b0 + 32, ldb_b)
                    _dots()
            _store_c(c, c0, ldc)
    _tile_release()


@njit(inline="always")
def padded(x):
    """x rounded up to a multiple of :data:`BLOCK`."""
    return -(-x // BLOCK) * BLOCK
