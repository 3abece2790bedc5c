"""Inline-PTX intrinsics for the tensor-core kernel (numba-cuda has no mma / ldmatrix API).

Each function below is a ``numba.cuda.extending.intrinsic`` (or, for one float32 operand,
``numerics.core.float32_intrinsic``'s) that emits one PTX instruction (or a short scoped block)
through ``llvmlite.ir.InlineAsm``, the mechanism numba-cuda itself uses
for ``activemask`` or ``tanh.approx.f32``. Fragments are plain SSA values (uint32 / float32 and
tuples of them), so they live in registers; nothing is linked. They can be called from
``@cuda.jit`` code only; they compile without a GPU (``cuda.compile_ptx``). Under the CUDA
simulator (which cannot run inline PTX) the same names are bound to the Python forms of
:mod:`.warp_sim`, so a kernel written with them runs there too. Importing this module needs
numba-cuda but no GPU; ``import pfa_numba`` does not import it.

Which lane holds which element of each fragment is written once, as plain functions, in
:mod:`.fragments` (used by the kernel and by the NumPy model :mod:`.warp_model`); the layouts
are the PTX ISA's ("Matrix fragments for mma.m16n8k16", "ldmatrix").

Packing convention: a uint32 register holding two 16-bit values holds the element with the
lower column (A, C) or lower k (B) in its low half.

Shared-memory operands are given as (a shared ``uint16`` array, an element offset): the
instruction gets a 32-bit shared-window address, the array's base (``cvta.to.shared``, once)
plus the offset in 32 bits.
Shared arrays read by ``ldmatrix`` or written by ``cp.async`` need 16-byte alignment
(``cuda.shared.array(n, uint16, alignment=16)``) and offsets that are multiples of 8 elements.

Requires sm_80 or newer (``cvt.rn.bf16x2.f32``, bf16 ``mma``, ``cp.async``).
"""
import numba
from llvmlite import ir
from numba import cuda
from numba.cuda import types
from numba.cuda.extending import intrinsic

from ..numerics.core import float32_intrinsic

_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)


def _call_asm(builder, ret, arg_types, text, constraints, args, side_effect=True):
    fnty = ir.FunctionType(ret, arg_types)
    return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)


def _tuple_of(ctx, builder, tuple_type, struct, n):
    return ctx.make_tuple(builder, tuple_type, [builder.extract_value(struct, i) for i in range(n)])


def _address(ctx, builder, arr_type, arr, off_type, off):
    """The generic address (i64) of element ``off`` of the array ``arr``."""
    data = ctx.make_array(arr_type)(ctx, builder, arr).data
    idx = ctx.cast(builder, off, off_type, types.int64)
    return builder.ptrtoint(builder.gep(data, [idx]), _I64)


def _shared_address(ctx, builder, arr_type, arr, off_type, off):
    """The 32-bit shared-window address of element ``off`` of the shared array ``arr``: the
    array's base converted once (a pure asm the compiler hoists), the offset added in 32 bits,
    so that an address in a loop is one integer add, not a 64-bit multiply-add and a cvta."""
    data = ctx.make_array(arr_type)(ctx, builder, arr).data
    base = _call_asm(builder, _I64, [_I64], "cvta.to.shared.u64 $0, $1;", "=l,l",
                     [builder.ptrtoint(data, _I64)], side_effect=False)
    size = ctx.get_abi_sizeof(ctx.get_data_type(arr_type.dtype))
    idx = builder.trunc(ctx.cast(builder, off, off_type, types.int64), _I32)
    return builder.add(builder.trunc(base, _I32), builder.mul(idx, ir.Constant(_I32, size)))


def _is_u16_array(t):
    return isinstance(t, types.Array) and t.dtype == types.uint16


# ---------------------------------------------------------------------------------------------
# mma.sync m16n8k16, float32 accumulation
# ---------------------------------------------------------------------------------------------

def _mma(kind):
    text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
            "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")
    constraints = "=f,=f,=f,=f," + ",".join(["r"] * 6 + ["f"] * 4)

    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        regs, accs = (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3)
        if not (all(isinstance(r, types.Integer) for r in regs)
                and all(isinstance(c, (types.Float, types.Integer)) for c in accs)):
            return None
        sig = types.UniTuple(types.float32, 4)(*regs, *accs)

        def codegen(ctx, builder, sig, args):
            vals = [ctx.cast(builder, a, t, types.uint32) for a, t in zip(args[:6], sig.args[:6])]
            vals += [ctx.cast(builder, a, t, types.float32) for a, t in zip(args[6:], sig.args[6:])]
            st = _call_asm(builder, ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4,
                           text, constraints, vals)
            return _tuple_of(ctx, builder, sig.return_type, st, 4)

        return sig, codegen

    mma.__name__ = f"mma_m16n8k16_{kind}"
    mma.__doc__ = f"""D = A B + C on one warp's tensor cores, {kind} inputs, float32 accumulation.

    ``d0, d1, d2, d3 = mma_m16n8k16_{kind}(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)``; every lane
    of the warp calls it (``.sync.aligned``: the same instruction, no divergence). PTX::

        {text}

    Fragments (g = lane >> 2, t = lane & 3; :func:`.fragments.mma_a`, ``mma_b``, ``mma_c``):
    A 16x16 row-major, a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..);
    B 16x8 ("col": K x N stored N-major), b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g);
    C / D 16x8 float32, c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1).
    a* and b* are uint32 holding two {kind} values (low half: lower column / k); c* float32.
    """
    return intrinsic(mma)


mma_m16n8k16_f16, mma_m16n8k16_bf16 = _mma("f16"), _mma("bf16")


# ---------------------------------------------------------------------------------------------
# ldmatrix x4 (plain and transposed) from shared memory
# ---------------------------------------------------------------------------------------------

def _ldmatrix(trans):
    op = "ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "") + ".shared.b16"
    text = op + " {$0,$1,$2,$3}, [$4];"

    def ldmatrix(typingctx, arr, off):
        if not (_is_u16_array(arr) and isinstance(off, types.Integer)):
            return None
        sig = types.UniTuple(types.uint32, 4)(arr, off)

        def codegen(ctx, builder, sig, args):
            addr = _shared_address(ctx, builder, sig.args[0], args[0], sig.args[1], args[1])
            st = _call_asm(builder, ir.LiteralStructType([_I32] * 4), [_I32], text,
                           "=r,=r,=r,=r,r,~{memory}", [addr])
            return _tuple_of(ctx, builder, sig.return_type, st, 4)

        return sig, codegen

    ldmatrix.__name__ = "ldmatrix_x4_trans" if trans else "ldmatrix_x4"
    element = ("(2t, g) and (2t+1, g): the matrix transposed" if trans
               else "(g, 2t) and (g, 2t+1)")
    ldmatrix.__doc__ = f"""Four 8x8 matrices of 16-bit values from shared memory into one warp.

    ``r0, r1, r2, r3 = {ldmatrix.__name__}(smem, off)``: ``smem`` a shared uint16 array, ``off``
    the element offset of this lane's row. PTX::

        {text}

    Lane l supplies the address of row l & 7 of matrix l >> 3 (8 contiguous 16-bit values,
    16-byte aligned; :func:`.fragments.ldsm_source`). Register ri of lane l (g = l >> 2,
    t = l & 3) holds matrix i's elements {element} (low half first;
    :func:`.fragments.ldsm_element`). Which 16x16 block each matrix covers is the caller's
    choice of addresses: :func:`.fragments.ldsm_a_addr` / ``ldsm_b_addr``.
    """
    return intrinsic(ldmatrix)


ldmatrix_x4, ldmatrix_x4_trans = _ldmatrix(False), _ldmatrix(True)


# ---------------------------------------------------------------------------------------------
# float32 pairs -> packed 16-bit registers
# ---------------------------------------------------------------------------------------------

def _float32_pair(name, text, result, accepted, doc):
    """An intrinsic of two scalar arguments of the ``accepted`` types, cast to float32, whose
    value (``result``: uint32 or float32) is the one PTX instruction ``text`` ($0 the result,
    $1 and $2 the arguments)."""
    def pair(typingctx, a, b):
        if not (isinstance(a, accepted) and isinstance(b, accepted)):
            return None

        def codegen(ctx, builder, sig, args):
            vals = [ctx.cast(builder, x, t, types.float32) for x, t in zip(args, sig.args)]
            out, letter = (_I32, "r") if result == types.uint32 else (_F32, "f")
            return _call_asm(builder, out, [_F32, _F32], text, f"={letter},f,f", vals,
                             side_effect=False)

        return result(a, b), codegen

    pair.__name__, pair.__doc__ = name, doc
    return intrinsic(pair)


def _pack(kind):
    text = f"cvt.rn.{kind}x2.f32 $0, $2, $1;"
    return _float32_pair(f"pack_{kind}x2", text, types.uint32, (types.Float, types.Integer), f"""
    Two float32 rounded to {kind} (to nearest, ties to even; inf and NaN kept) in one uint32:
    ``lo`` in the low half, ``hi`` in the high half. PTX (its first source goes to the upper
    half)::

        {text}

    The A fragment of P for the second product is ``pack(c0, c1)``, ``pack(c2, c3)`` of two S
    accumulator tiles (:func:`.fragments.p_from_s`).
    """)


pack_f16x2, pack_bf16x2 = _pack("f16"), _pack("bf16")


# ---------------------------------------------------------------------------------------------
# cp.async: global -> shared, 16 bytes, asynchronous
# ---------------------------------------------------------------------------------------------

def _statement(text):
    """The codegen of PTX statement ``text``, which takes no operands and orders memory."""
    def codegen(ctx, builder, sig, args):
        _call_asm(builder, ir.VoidType(), [], text, "~{memory}", [])
        return ctx.get_dummy_value()

    return codegen


def _cp_async_codegen(text, zfill):
    def codegen(ctx, builder, sig, args):
        vals = [_shared_address(ctx, builder, sig.args[0], args[0], sig.args[1], args[1]),
                _address(ctx, builder, sig.args[2], args[2], sig.args[3], args[3])]
        arg_types = [_I32, _I64]
        if zfill:
            vals.append(ctx.cast(builder, args[4], sig.args[4], types.uint32))
            arg_types.append(_I32)
        _call_asm(builder, ir.VoidType(), arg_types, text,
                  "r,l," + ("r," if zfill else "") + "~{memory}", vals)
        return ctx.get_dummy_value()

    return codegen


def _cp_async_args_ok(dst, src, *offsets):
    return (_is_u16_array(dst) and isinstance(src, types.Array)
            and all(isinstance(x, types.Integer) for x in offsets))


def _cp_async(zfill):
    size = ", $2" if zfill else ""
    text = ("{ .reg .u64 ga; cvta.to.global.u64 ga, $1; "
            f"cp.async.cg.shared.global [$0], [ga], 16{size}; }}")
    codegen = _cp_async_codegen(text, zfill)

    if zfill:
        def cp_async(typingctx, dst, dst_off, src, src_off, src_bytes):
            if not _cp_async_args_ok(dst, src, dst_off, src_off, src_bytes):
                return None
            return types.void(dst, dst_off, src, src_off, src_bytes), codegen
    else:
        def cp_async(typingctx, dst, dst_off, src, src_off):
            if not _cp_async_args_ok(dst, src, dst_off, src_off):
                return None
            return types.void(dst, dst_off, src, src_off), codegen

    cp_async.__name__ = "cp_async_16_zfill" if zfill else "cp_async_16"
    args = "dst, dst_off, src, src_off" + (", src_bytes" if zfill else "")
    tail = ("Only the first ``src_bytes`` (0..16) are read; the rest of the 16 are zero-filled "
            "(0: a zero chunk, for K/V rows past the end; the source address must still be a "
            "valid global address: clamp it)." if zfill else "All 16 bytes are read.")
    cp_async.__doc__ = f"""Start copying 16 bytes from global to shared memory: ``{cp_async.__name__}({args})``.

    ``dst`` a shared uint16 array, ``src`` a global array (any dtype), offsets in elements of
    each; both addresses 16-byte aligned. The copy bypasses L1 (``.cg``). {tail} PTX::

        {text}

    The copy completes asynchronously: :func:`cp_async_commit` closes a group, and
    :func:`cp_async_wait` (then a barrier) makes a group's data visible.
    """
    return intrinsic(cp_async)


cp_async_16, cp_async_16_zfill = _cp_async(False), _cp_async(True)


@intrinsic
def cp_async_commit(typingctx):
    """Close the group of this thread's cp.async copies issued since the last commit.
    PTX: ``cp.async.commit_group;``"""
    sig = types.void()
    return sig, _statement("cp.async.commit_group;")


@intrinsic
def cp_async_wait(typingctx, n):
    """Wait until at most ``n`` (an integer constant) of this thread's committed cp.async
    groups are still pending. PTX: ``cp.async.wait_group n;`` (n = 0: all of them). Other
    threads' copies become visible after a barrier (``cuda.syncthreads()``)."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    text = f"cp.async.wait_group {int(n.literal_value)};"
    sig = types.void(n)
    return sig, _statement(text)


# ---------------------------------------------------------------------------------------------
# the output's way out: packed pairs into shared memory, 16 bytes at a time to global memory
# ---------------------------------------------------------------------------------------------

@intrinsic
def st_shared_u32(typingctx, smem, off, value):
    """Store the 32 bits of ``value`` (two packed 16-bit values, low half first) at element
    ``off`` (even) of the shared uint16 array ``smem``: one ``st.shared.b32``."""
    if not (_is_u16_array(smem) and isinstance(off, types.Integer)
            and isinstance(value, types.Integer)):
        return None
    sig = types.void(smem, off, value)

    def codegen(ctx, builder, sig, args):
        addr = _shared_address(ctx, builder, sig.args[0], args[0], sig.args[1], args[1])
        val = ctx.cast(builder, args[2], sig.args[2], types.uint32)
        _call_asm(builder, ir.VoidType(), [_I32, _I32], "st.shared.b32 [$0], $1;",
                  "r,r,~{memory}", [addr, val])
        return ctx.get_dummy_value()

    return sig, codegen


@intrinsic
def copy_16_shared_to_global(typingctx, dst, dst_off, smem, smem_off):
    """Copy 16 bytes from element ``smem_off`` of the shared uint16 array ``smem`` to element
    ``dst_off`` of the global array ``dst`` (both 16-byte aligned): one ``ld.shared.v4`` and
    one ``st.global.v4``, the coalesced store of a staged output row segment."""
    if not (_is_u16_array(smem) and isinstance(dst, types.Array)
            and isinstance(dst_off, types.Integer) and isinstance(smem_off, types.Integer)):
        return None
    sig = types.void(dst, dst_off, smem, smem_off)
    text = ("{ .reg .u64 ga; .reg .b32 w0, w1, w2, w3; cvta.to.global.u64 ga, $0; "
            "ld.shared.v4.b32 {w0, w1, w2, w3}, [$1]; st.global.v4.b32 [ga], {w0, w1, w2, w3}; }")

    def codegen(ctx, builder, sig, args):
        vals = [_address(ctx, builder, sig.args[0], args[0], sig.args[1], args[1]),
                _shared_address(ctx, builder, sig.args[2], args[2], sig.args[3], args[3])]
        _call_asm(builder, ir.VoidType(), [_I64, _I32], text, "l,r,~{memory}", vals)
        return ctx.get_dummy_value()

    return sig, codegen


@intrinsic
def syncwarp(typingctx):
    """Every lane of the warp arrives before any goes on, and each then sees the shared-memory
    writes the others made before it. PTX: ``bar.warp.sync -1;``"""
    sig = types.void()
    return sig, _statement("bar.warp.sync -1;")


# ---------------------------------------------------------------------------------------------
# float32 functions on the SFU: exp2 for the online softmax, the reciprocal for the softcap
# ---------------------------------------------------------------------------------------------

def _float32_unary(name, text, doc):
    """An intrinsic of one float32 argument (``numerics.core.float32_intrinsic``) whose value
    is the one PTX instruction ``text`` ($0 the result, $1 the argument)."""
    def emit(builder, x):
        return _call_asm(builder, _F32, [_F32], text, "=f,f", [x], side_effect=False)

    emit.__name__, emit.__doc__ = name, doc
    return float32_intrinsic(emit)


def _exp2(ftz):
    text = "ex2.approx" + (".ftz" if ftz else "") + ".f32 $0, $1;"
    return _float32_unary("exp2_approx_ftz" if ftz else "exp2_approx", text, f"""2 ** x in
    float32 on the SFU: PTX ``{text}``.

    {"Subnormal inputs and results flush to 0 (one MUFU.EX2)." if ftz else
     "Subnormals kept (a MUFU.EX2 plus the range scaling around it)."} Special values are what
    the online softmax needs: 2^-inf = +0 (a dropped score weighs nothing), 2^+inf = +inf, NaN
    stays NaN, 2^0 = 1 exactly. The ISA gives a maximum relative error of about 2^-22 (a few
    float32 ulp), far below the 16-bit rounding P then goes through. The softmax uses it with
    the scale folded in: p = exp2(s * (scale * log2 e) - m) with m the running max of the same
    products; config.CUDA_EXP2_FTZ picks the form.
    """)


exp2_approx, exp2_approx_ftz = _exp2(False), _exp2(True)
rcp_approx_ftz = _float32_unary("rcp_approx_ftz", "rcp.approx.ftz.f32 $0, $1;", """1 / x in
    float32 on the SFU (one MUFU.RCP): PTX ``rcp.approx.ftz.f32``, within 1 ulp of the quotient
    over the whole range (the ISA); 1 / inf = +0, 1 / 0 = inf, NaN stays NaN, subnormals flush
    to 0.""")


def _load_if(bits):
    text = ("{ .reg .pred p; .reg .u64 ga; setp.ne.u32 p, $2, 0; cvta.to.global.u64 ga, $1; "
            f"mov.u32 $0, 0; @p ld.global.nc.u{bits} $0, [ga]; }}")

    def load_if(typingctx, arr, off, pred):
        if not (isinstance(arr, types.Array) and arr.dtype == getattr(types, f"uint{bits}")
                and isinstance(off, types.Integer)
                and isinstance(pred, (types.Boolean, types.Integer))):
            return None
        sig = types.uint32(arr, off, pred)

        def codegen(ctx, builder, sig, args):
            vals = [_address(ctx, builder, sig.args[0], args[0], sig.args[1], args[1]),
                    ctx.cast(builder, args[2], sig.args[2], types.uint32)]
            return _call_asm(builder, _I32, [_I64, _I32], text, "=r,l,r", vals,
                             side_effect=False)

        return sig, codegen

    load_if.__name__ = f"load_u{bits}_if"
    load_if.__doc__ = f"""``arr[off]`` (a read-only global uint{bits} array) where ``pred``, else
    0, as a uint32, with no branch: a predicated ``ld.global.nc.u{bits}`` (the element is not
    read, so it may lie outside the array, where ``pred`` is false). PTX::

        {text}
    """
    return intrinsic(load_if)


load_u8_if, load_u16_if = _load_if(8), _load_if(16)


@intrinsic
def fma_f32(typingctx, a, b, c):
    """a * b + c in float32 with one rounding: PTX ``fma.rn.f32`` (the weights' exponent
    s * scale - m in one instruction)."""
    if not all(isinstance(x, types.Float) for x in (a, b, c)):
        return None
    sig = types.float32(a, b, c)

    def codegen(ctx, builder, sig, args):
        vals = [ctx.cast(builder, x, t, types.float32) for x, t in zip(args, sig.args)]
        return _call_asm(builder, _F32, [_F32] * 3, "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f",
                         vals, side_effect=False)

    return sig, codegen


max_nan_f32 = _float32_pair("max_nan_f32", "max.NaN.f32 $0, $1, $2;", types.float32, types.Float,
                             """
    :func:`pfa_numba.numerics.core.max_nan` in one instruction: PTX ``max.NaN.f32`` (sm_80), the
    larger of two float32, NaN when either is NaN.""")


# ---------------------------------------------------------------------------------------------
# float16 -> float32, and the quad shuffle
# ---------------------------------------------------------------------------------------------

@intrinsic
def cvt_f32_f16(typingctx, h):
    """IEEE half bits (the low 16 of an integer) -> float32 by ``cvt.f32.f16`` (exact: subnormals,
    inf and NaN): one instruction where numerics.core.f16_to_f32's bit steps, written out per
    accumulator, cost registers and compile time."""
    if not isinstance(h, types.Integer):
        return None
    sig = types.float32(h)

    def codegen(ctx, builder, sig, args):
        bits = builder.trunc(ctx.cast(builder, args[0], sig.args[0], types.uint32), ir.IntType(16))
        return _call_asm(builder, _F32, [ir.IntType(16)], "cvt.f32.f16 $0, $1;", "=f,h", [bits],
                         side_effect=False)

    return sig, codegen


#: ``shfl.sync.bfly``: numba-cuda's own, named here so that the simulator can stand in for it
shfl_xor_sync = getattr(cuda, "shfl_xor_sync", None)


if numba.config.ENABLE_CUDASIM:     # the same names, rebound for the kernels that import them
    from .warp_sim import (cp_async_16, cp_async_16_zfill, cp_async_commit,  # noqa: F401,F811
                           copy_16_shared_to_global, cp_async_wait,  # noqa: F401,F811
                           cvt_f32_f16, exp2_approx, exp2_approx_ftz,  # noqa: F401,F811
                           fma_f32, load_u8_if, load_u16_if,  # noqa: F401,F811
                           max_nan_f32, rcp_approx_ftz, st_shared_u32,  # noqa: F401,F811
                           syncwarp,  # noqa: F401,F811
                           ldmatrix_x4, ldmatrix_x4_trans,  # noqa: F401,F811
                           mma_m16n8k16_bf16, mma_m16n8k16_f16,  # noqa: F401,F811
                           pack_bf16x2, pack_f16x2, shfl_xor_sync)  # noqa: F401,F811
