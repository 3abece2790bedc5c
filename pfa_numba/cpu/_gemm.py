"""Register-blocked float32 tile products for the CPU kernel on AVX-512.

The kernel's two products per tile, ``S = Q K^T`` and ``acc += P V``, have a fixed shape: a few
hundred rows, a few hundred columns and an inner dimension of D or of the tile's kv columns.
BLAS spends part of each such call packing its operands into its own layout, and its kernels are
tuned for large square matrices. Here the operands are packed once, by the kernel's own loads,
into the layout a 6 x 64 register block wants, and the block itself is emitted as LLVM vector
code: 24 zmm accumulators, each step one broadcast of a row value and four vector loads feeding
24 fused multiply-adds. On these tiles both products outrun OpenBLAS's sgemm (measurements:
docs/tuning.md).

Layouts (all float32, flat buffers with element offsets):
- ``Q`` rows of D values, ``ldq`` apart; the products read MR rows at a time, so a buffer must
  hold MR - 1 rows past the last real one (their results land in padding and are ignored).
- ``K^T`` in panels of PANEL columns: panel p holds ``kt[p * PANEL * D + d * PANEL + c]`` =
  K[p * PANEL + c, d].
- ``P`` rows ``ldp`` apart, ``V`` rows ``ldv`` apart with ``ldv`` a multiple of 16 and the
  columns up to it zero, ``acc`` rows ``ldacc`` apart.

``available()`` says whether the host runs these natively; without AVX-512 the CPU kernel calls
BLAS instead.
"""
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..numerics.core import jit
from ._jit import LEAF_EXACT
from ._vector import add_products, host_has, llvm_function, wide_vectors

#: rows of one register block
MR = 6
#: float32 lanes of one vector register
LANES = 16
#: columns of a K^T panel (= of a register block of S)
PANEL = 64

_F32 = ir.FloatType()
_V = ir.VectorType(_F32, LANES)
_I32 = ir.IntType(32)
_VI = ir.VectorType(_I32, LANES)
_I64 = ir.IntType(64)

_available = None


def available():
    """True when Numba compiles for this host and the host has AVX-512F."""
    global _available
    if _available is None:
        _available = host_has("avx512f")
    return _available


def _fma(builder, a, b, c):
    return builder.call(llvm_function(builder, f"llvm.fma.v{LANES}f32", _V, [_V, _V, _V]), [a, b, c])


def _order_key(builder, x):
    """numerics.core.order_key of a float vector: a NaN of either sign as the positive one, then
    i ^ ((i >> 31) & 0x7fffffff)."""
    i = builder.bitcast(x, _VI)
    a = builder.and_(i, ir.Constant(_VI, [0x7FFFFFFF] * LANES))
    i = builder.select(builder.icmp_signed(">", a, ir.Constant(_VI, [0x7F800000] * LANES)), a, i)
    sign = builder.ashr(i, ir.Constant(_VI, [31] * LANES))
    return builder.xor(i, builder.and_(sign, ir.Constant(_VI, [0x7FFFFFFF] * LANES)))


def _smax(builder, a, b):
    return builder.select(builder.icmp_signed(">", a, b), a, b)


def _register_block(nv, accumulate):
    """Intrinsic ``block(a, a_off, lda, b, b_off, ldb, c, c_off, ldc, k, keys, keys_off)``:
    C[MR, nv * 16] (+)= A[MR, k] @ B[k, nv * 16]; A is read one broadcast element at a time,
    B and C as rows of vectors (unaligned). ``accumulate`` False overwrites C. With an int32
    array ``keys`` (not None), keys[keys_off + r] becomes the max of itself and the order keys
    (numerics.core.order_key) of the MR x nv * 16 results of row r."""

    @intrinsic
    def block(typingctx, a, a_off, lda, b, b_off, ldb, c, c_off, ldc, k, keys, keys_off):
        sig = types.none(a, a_off, lda, b, b_off, ldb, c, c_off, ldc, k, keys, keys_off)
        want_keys = isinstance(keys, types.Array)

        def codegen(context, builder, sig, args):
            def base(i):
                ary = context.make_array(sig.args[i])(context, builder, args[i])
                off = context.cast(builder, args[i + 1], sig.args[i + 1], types.intp)
                return builder.gep(ary.data, [off])

            def intp(i):
                return context.cast(builder, args[i], sig.args[i], types.intp)

            ap, bp, cp = base(0), base(3), base(6)
            lda_, ldb_, ldc_, kk = intp(2), intp(5), intp(8), intp(9)

            def at(ptr, row, ld, col):
                off = builder.add(builder.mul(ir.Constant(_I64, row), ld), ir.Constant(_I64, col))
                return builder.gep(ptr, [off])

            cvec = [[builder.bitcast(at(cp, r, ldc_, LANES * j), _V.as_pointer())
                     for j in range(nv)] for r in range(MR)]
            arow = [at(ap, r, lda_, 0) for r in range(MR)]
            # accumulators live in allocas that LLVM promotes to registers
            accs = [[cgutils.alloca_once_value(
                builder, builder.load(cvec[r][j], align=4) if accumulate else ir.Constant(_V, None))
                for j in range(nv)] for r in range(MR)]
            with cgutils.for_range(builder, kk) as loop:
                d = loop.index
                brow = builder.gep(bp, [builder.mul(d, ldb_)])
                bv = [builder.load(builder.bitcast(builder.gep(brow, [ir.Constant(_I64, LANES * j)]),
                                                   _V.as_pointer()), align=4) for j in range(nv)]
                add_products(builder, _fma, [builder.load(builder.gep(arow[r], [d]))
                                             for r in range(MR)], bv, accs)
            for r in range(MR):
                for j in range(nv):
                    builder.store(builder.load(accs[r][j]), cvec[r][j], align=4)
            if want_keys:
                kp = base(10)
                for r in range(MR):
                    best = None
                    for j in range(nv):
                        key = _order_key(builder, builder.load(accs[r][j]))
                        best = key if best is None else _smax(builder, best, key)
                    top = builder.call(llvm_function(builder, f"llvm.vector.reduce.smax.v{LANES}i32",
                                                 _I32, [_VI]), [best])
                    slot = builder.gep(kp, [ir.Constant(_I64, r)])
                    old = builder.load(slot)
                    builder.store(builder.select(builder.icmp_signed(">", top, old), top, old), slot)
            return context.get_dummy_value()

        return sig, codegen

    return block


_scores_block = _register_block(PANEL // LANES, False)
_acc_block_4 = _register_block(4, True)
_acc_block_3 = _register_block(3, True)
_acc_block_2 = _register_block(2, True)
_acc_block_1 = _register_block(1, True)


@jit
def panels(n):
    """K^T panels holding n columns."""
    return -(-n // PANEL)


@jit
def padded_rows(n):
    """n rounded up to a multiple of MR: the rows a product over n rows touches."""
    return -(-n // MR) * MR


@jit
def vector_width(n):
    """n rounded up to a multiple of 16 (row length of V and acc)."""
    return -(-n // LANES) * LANES


@njit(**LEAF_EXACT)
def scores(q, q_off, ldq, kt, kt_off, D, s, lds, rows, n_panels, keys):
    """S[r, :] = Q[r, :D] @ K^T for r < padded_rows(rows), over n_panels K^T panels (S row r
    at s[r * lds:], lds >= n_panels * PANEL; the panels from kt[kt_off:]). With an int32 array
    ``keys`` (else None), keys[r] also becomes the max of itself and the order keys of S row r
    over all n_panels * PANEL columns."""
    wide_vectors()
    for p in range(n_panels):
        for r in range(0, rows, MR):
            _scores_block(q, q_off + r * ldq, ldq, kt, kt_off + p * PANEL * D, PANEL,
                          s, r * lds + p * PANEL, lds, D, keys, r)


@njit(**LEAF_EXACT)
def accumulate(p, ldp, v, v_off, ldv, acc, acc_off, ldacc, rows, k):
    """acc[r, :ldv] += P[r, :k] @ V[:k, :ldv] for r < padded_rows(rows) (P row r at
    p[r * ldp:], V row c at v[v_off + c * ldv:], acc row r at acc[acc_off + r * ldacc:])."""
    wide_vectors()
    for d0 in range(0, ldv, PANEL):
        nv = min(PANEL, ldv - d0) // LANES
        for r in range(0, rows, MR):
            po = r * ldp
            ao = acc_off + r * ldacc + d0
            if nv == 4:
                _acc_block_4(p, po, ldp, v, v_off + d0, ldv, acc, ao, ldacc, k, None, 0)
            elif nv == 3:
                _acc_block_3(p, po, ldp, v, v_off + d0, ldv, acc, ao, ldacc, k, None, 0)
            elif nv == 2:
                _acc_block_2(p, po, ldp, v, v_off + d0, ldv, acc, ao, ldacc, k, None, 0)
            else:
                _acc_block_1(p, po, ldp, v, v_off + d0, ldv, acc, ao, ldacc, k, None, 0)
