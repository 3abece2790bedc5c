"""The numerics of prompt flash attention, written once for every target.

Each function here is a small scalar helper compiled with ``@njit(inline='always')``:
Numba inlines it at the IR level into whichever kernel calls it, so the same source compiles
into the CPU kernel (``@njit(parallel=True)``) and into the CUDA kernel (``@cuda.jit``). That is
also why they use only float32/int32/uint32 arithmetic with ``np.float32`` constants (a bare
``0.0`` or ``math.inf`` would make GPU code fp64) and no allocation or NumPy array functions.
Float arguments are cast with ``np.float32`` on entry: a no-op in compiled code, and what keeps
the CUDA simulator (which calls these from Python, where results come back as Python floats)
on the float32 signatures.

Contents:

* bit casts (:func:`f32_as_u32`, :func:`u32_as_f32`, and int32 variants) as LLVM intrinsics;
* storage conversions: float16 / bfloat16 bits <-> float32, round to nearest, ties to even;
* :func:`exp_f32`, :func:`exp_nonpos`: vectorisable float32 exp (Cephes polynomial) with exact
  -inf/+inf/NaN; :func:`exp_nonpos5`, a shorter one for the AMX kernel;
* int8 quantization steps: :func:`round_f16`, :func:`round_half_even`, :func:`saturate_int8`;
* :func:`order_key`: an order-preserving float -> int32 map, so a row max vectorises;
* the online-softmax steps in the triton tutorial's order (acc, l, m):
  :func:`max_nan`, :func:`rescale_factor`, :func:`lse_value`.
"""
import math

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

# ---------------------------------------------------------------------------------------------
# constants
# ---------------------------------------------------------------------------------------------

F32_ZERO = np.float32(0.0)
F32_ONE = np.float32(1.0)
F32_NEG_INF = np.float32(-np.inf)
F32_POS_INF = np.float32(np.inf)
#: The deprecated float16 additive mask adds -10000 * mask (SPEC 4.2).
F16_MASK_SCALE = np.float32(-10000.0)

# storage codes: how a tensor's elements are stored (plan -> kernels)
CODE_F32 = 0
CODE_F16 = 1
CODE_BF16 = 2
CODE_I8 = 3   # int8 output, quantized from the float16-rounded result (SPEC 8)

# mask kinds
MASK_NONE = 0
MASK_DISCARD = 1  # bool / int8 / uint8: nonzero = discard
MASK_ADD_F16 = 2  # deprecated float16 mask: s += -10000 * mask

_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_HI = np.float32(88.72283)   # above: +inf
_EXP_LO = np.float32(-87.33654)  # below: 0 (float32 normal range)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
_HALF = np.float32(0.5)
_EXP_MAGIC = np.float32(12582912.0)                 # 1.5 * 2^23
_EXP_MAGIC_BITS = np.int32(0x4B400000)              # its bits: + n for |n| < 2^22


# ---------------------------------------------------------------------------------------------
# bit casts
# ---------------------------------------------------------------------------------------------

def _bitcast_intrinsic(src, dst):
    """An intrinsic reinterpreting the 32 bits of ``src`` as ``dst``.

    Integer arguments of any width are first converted to ``src`` (Numba promotes uint32
    shifts to 64 bits), so callers need no casts.
    """
    @intrinsic
    def cast(typingctx, x):
        if isinstance(src, types.Integer):
            if not isinstance(x, types.Integer):
                return None
        elif x != src:
            return None
        sig = dst(x)

        def codegen(context, builder, signature, args):
            val = context.cast(builder, args[0], signature.args[0], src)
            return builder.bitcast(val, context.get_value_type(dst))

        return sig, codegen

    return cast


@intrinsic
def pow2_f32(typingctx, n):
    """2.0 ** n for a float32 holding an integer in [-126, 127], built from the exponent bits
    with 32-bit integer ops only (so loops stay 8/16 lanes wide)."""
    if n != types.float32:
        return None
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        from llvmlite import ir
        i32 = ir.IntType(32)
        i = builder.fptosi(args[0], i32)
        i = builder.add(i, ir.Constant(i32, 127))
        i = builder.shl(i, ir.Constant(i32, 23))
        return builder.bitcast(i, ir.FloatType())

    return sig, codegen


@intrinsic
def floor_f32(typingctx, x):
    """floor of a float32 as a float32 (LLVM's llvm.floor.f32: vectorises on the CPU, one
    instruction on CUDA; NumPy's np.floor is not available in CUDA kernels)."""
    if x != types.float32:
        return None
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        from llvmlite import ir
        fn = builder.module.declare_intrinsic("llvm.floor", [ir.FloatType()])
        return builder.call(fn, [args[0]])

    return sig, codegen


#: float32 -> its IEEE bits as uint32 (and back; int32 variants for signed tricks).
f32_as_u32 = _bitcast_intrinsic(types.float32, types.uint32)
u32_as_f32 = _bitcast_intrinsic(types.uint32, types.float32)
f32_as_i32 = _bitcast_intrinsic(types.float32, types.int32)
i32_as_f32 = _bitcast_intrinsic(types.int32, types.float32)

jit = njit(inline="always", cache=True)


# ---------------------------------------------------------------------------------------------
# storage conversions
# ---------------------------------------------------------------------------------------------

_F16_SCALE_UP = np.float32(2.0 ** 112)  # 2^(127-15): rebias a half exponent to single


@jit
def f16_to_f32(h):
    """IEEE binary16 bits (any integer type) -> float32, exact (subnormals, inf, NaN)."""
    u = np.uint32(h) & np.uint32(0xFFFF)
    em = u & np.uint32(0x7FFF)
    sign = (u & np.uint32(0x8000)) << np.uint32(16)
    # normal and subnormal halves: move the bits into place and scale the exponent bias
    mag = u32_as_f32(em << np.uint32(13)) * _F16_SCALE_UP
    bits = f32_as_u32(mag)
    if em >= np.uint32(0x7C00):  # inf / NaN keep their payload
        bits = (em << np.uint32(13)) | np.uint32(0x7F800000)
    return u32_as_f32(bits | sign)


@jit
def bf16_to_f32(h):
    """bfloat16 bits -> float32 (exact: the top half of a float32)."""
    return u32_as_f32((np.uint32(h) & np.uint32(0xFFFF)) << np.uint32(16))


_F16_MAX_U = np.uint32((127 + 16) << 23)          # 65536.0: rounds to inf in half
_F32_INF_U = np.uint32(255 << 23)
_F16_MIN_NORMAL_U = np.uint32(113 << 23)          # 2^-14
_DENORM_MAGIC_U = np.uint32(((127 - 15) + (23 - 10) + 1) << 23)


@jit
def f32_to_f16(x):
    """float32 -> IEEE binary16 bits (uint16), round to nearest, ties to even.

    Overflow gives +-inf, NaN stays NaN (quiet), subnormal halves are rounded correctly.
    """
    x = np.float32(x)
    u = f32_as_u32(x)
    sign = u & np.uint32(0x80000000)
    u = u ^ sign
    if u >= _F16_MAX_U:
        o = np.uint32(0x7E00) if u > _F32_INF_U else np.uint32(0x7C00)
    elif u < _F16_MIN_NORMAL_U:
        # subnormal half (or zero): let a float add do the rounding at the right position
        f = u32_as_f32(u) + u32_as_f32(_DENORM_MAGIC_U)
        o = f32_as_u32(f) - _DENORM_MAGIC_U
    else:
        odd = (u >> np.uint32(13)) & np.uint32(1)
        u = u + np.uint32((15 - 127) << 23) + np.uint32(0xFFF) + odd
        o = u >> np.uint32(13)
    return np.uint16(o | (sign >> np.uint32(16)))


@jit
def f32_to_bf16(x):
    """float32 -> bfloat16 bits (uint16), round to nearest, ties to even; NaN stays NaN."""
    x = np.float32(x)
    u = f32_as_u32(x)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    u = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16(u >> np.uint32(16))


@jit
def round_f16(x):
    """float32 -> the nearest float16 value (ties to even), as float32."""
    x = np.float32(x)
    return f16_to_f32(f32_to_f16(x))


@jit
def round_half_even(x):
    """Round a float32 to an integral float32, ties to even (NaN stays NaN)."""
    x = np.float32(x)
    n = floor_f32(x)
    d = x - n
    odd = floor_f32(n * _HALF) * np.float32(2.0) != n
    if d > _HALF or (d == _HALF and odd):
        n = n + F32_ONE
    return n


@jit
def saturate_int8(x):
    """Clip an integral float32 to [-128, 127] (NaN stays NaN)."""
    x = np.float32(x)
    if x < np.float32(-128.0):
        return np.float32(-128.0)
    if x > np.float32(127.0):
        return np.float32(127.0)
    return x


@jit
def quantize_output(o, scale2_16, offset2_16):
    """SPEC 8 output quantization of one element, as an integral float32:
    clip(round_half_even(fp16(fp16(fp16(o) * s2) + o2)), -128, 127), NaN -> 0, where s2 and o2
    are already rounded to float16."""
    o = np.float32(o)
    y = round_f16(round_f16(round_f16(o) * np.float32(scale2_16)) + np.float32(offset2_16))
    y = saturate_int8(round_half_even(y))
    return y if y == y else F32_ZERO


@jit
def widen(raw, code):
    """One stored element -> float32 (code: CODE_F32, CODE_F16 or CODE_BF16)."""
    if code == CODE_F16:
        return f16_to_f32(raw)
    if code == CODE_BF16:
        return bf16_to_f32(raw)
    return np.float32(raw)


@jit
def store(dst, idx, x, code):
    """Write float32 ``x`` to ``dst[idx]`` in the storage of ``code`` (rounded to nearest even)."""
    if code == CODE_F16:
        dst[idx] = f32_to_f16(x)
    elif code == CODE_BF16:
        dst[idx] = f32_to_bf16(x)
    else:
        dst[idx] = x


# ---------------------------------------------------------------------------------------------
# exp and max
# ---------------------------------------------------------------------------------------------

@jit
def exp_f32(x):
    """float32 exp, Cephes expf polynomial (about 1 ulp): branch-free so loops vectorise.

    exp(-inf) = 0, exp(+inf) = inf, exp(NaN) = NaN; results below float32's normal range are 0.
    """
    x = np.float32(x)
    xc = x
    if xc > _EXP_HI:
        xc = _EXP_HI
    if xc < _EXP_LO:
        xc = _EXP_LO
    if xc != xc:
        xc = F32_ZERO
    n = floor_f32(xc * _LOG2E + _HALF)
    r = xc - n * _LN2_HI - n * _LN2_LO
    z = r * r
    y = (((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5) * z + r + F32_ONE
    # 2^n as two normal factors, so n = 128 (x near ln(FLT_MAX)) does not overflow early
    n1 = floor_f32(n * _HALF)
    y = y * pow2_f32(n1) * pow2_f32(n - n1)
    if x > _EXP_HI:
        y = F32_POS_INF
    if x < _EXP_LO:
        y = F32_ZERO
    if x != x:
        y = x
    return y


@jit
def _reduce_nonpos(x):
    """(r, 2^n) for the exp of x <= 0: exp(xc) = 2^n * exp(r), |r| <= ln(2) / 2, where xc is x
    held at _EXP_LO. n = round(x / ln 2) comes from the low mantissa bits of
    x * log2(e) + 1.5 * 2^23 read as an integer, so 2^n and n need no float rounding
    instruction (the integer step also keeps fast-math reassociation from cancelling the magic
    constant)."""
    xc = _EXP_LO if x < _EXP_LO else x
    ni = np.int32(f32_as_i32(xc * _LOG2E + _EXP_MAGIC) - _EXP_MAGIC_BITS)   # 32-bit lanes
    n = np.float32(ni)
    r = xc - n * _LN2_HI - n * _LN2_LO
    return r, i32_as_f32(np.int32(ni + np.int32(127)) << np.int32(23))


@jit
def exp_nonpos(x):
    """exp for x <= 0 (the softmax's s - max), -inf and NaN: fewer operations than exp_f32.

    Same polynomial as :func:`exp_f32`; exp(-inf) = 0, NaN stays NaN (every select is written
    so that a NaN falls through it), results below float32's normal range are 0.
    """
    x = np.float32(x)
    r, two_n = _reduce_nonpos(x)
    z = r * r
    y = (((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5) * z + r + F32_ONE
    return F32_ZERO if x < _EXP_LO else y * two_n


# degree-5 fit of exp on [-ln(2) / 2, ln(2) / 2] (relative error 1.1e-7 in exact arithmetic)
_Q2 = np.float32(0.499992311000824)
_Q3 = np.float32(0.16667121648788452)
_Q4 = np.float32(0.041890256106853485)
_Q5 = np.float32(0.008311860263347626)


@jit
def exp_nonpos5(x):
    """:func:`exp_nonpos` with a degree-5 polynomial: 2.4 ulp at most instead of 1, three
    operations fewer. For the AMX kernel's probabilities, which enter the tile products as two
    bfloat16 parts (16 significant bits). Same special values; within that bound for
    0 < x <= 88 too, so it also serves a running max that is up to LAZY_MARGIN too small."""
    x = np.float32(x)
    r, two_n = _reduce_nonpos(x)
    y = F32_ONE + r * (F32_ONE + r * (_Q2 + r * (_Q3 + r * (_Q4 + r * _Q5))))
    return F32_ZERO if x < _EXP_LO else y * two_n


@jit
def order_key(x):
    """float32 -> int32 with the same order (-inf smallest, NaN of either sign largest).

    An integer max vectorises where a float max does not; the map is its own inverse
    (see :func:`from_order_key`). Every step is cast back to int32 (Numba widens int32
    arithmetic to int64, which would halve the vector lanes of a max over keys).
    """
    x = np.float32(x)
    i = f32_as_i32(x)
    a = np.int32(i & np.int32(0x7FFFFFFF))
    # every NaN as a positive one: x86's default NaN (inf - inf, 0 * inf) has the sign bit set
    i = a if a > np.int32(0x7F800000) else i
    return _flip_negative(i)


@jit
def _flip_negative(i):
    """i ^ 0x7fffffff for negative i (reverses the order of negative floats' bits), in int32."""
    return np.int32(i ^ np.int32(np.int32(i >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@jit
def from_order_key(k):
    """Inverse of :func:`order_key`."""
    return i32_as_f32(_flip_negative(np.int32(k)))


@jit
def max_nan(a, b):
    """max of two float32 that propagates NaN (a NaN running max makes the row NaN)."""
    a = np.float32(a)
    b = np.float32(b)
    if a != a or b != b:
        return a + b
    return a if a >= b else b


# ---------------------------------------------------------------------------------------------
# the online softmax
# ---------------------------------------------------------------------------------------------

@jit
def rescale_factor(m_old, m_new):
    """Online-softmax step 'update m/l': the factor exp(m_old - m_new) for acc and l.

    A row that has kept nothing yet (m_new = -inf) keeps factor 1 (its acc and l are 0).
    """
    m_old = np.float32(m_old)
    m_new = np.float32(m_new)
    if m_new == F32_NEG_INF:
        return F32_ONE
    return exp_f32(m_old - m_new)


@jit
def lse_value(m, l):
    """softmax_lse of a finished row: m + log(l), -inf when nothing was kept (SPEC 9)."""
    m = np.float32(m)
    l = np.float32(l)
    if m == F32_NEG_INF:
        return F32_NEG_INF
    return m + np.float32(math.log(l))
