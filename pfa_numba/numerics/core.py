"""The numerics of prompt flash attention, written once for every target.

Each function here is a small scalar helper compiled with ``@njit(inline='always')``:
Numba inlines it at the IR level into whichever kernel calls it, so the same source compiles
into the CPU kernel (``@njit(parallel=True)``) and into the CUDA kernel (``@cuda.jit``). That is
also why they use only float32 and integer arithmetic with ``np.float32`` constants (a bare
``0.0`` or ``math.inf`` would make GPU code fp64) and no allocation or NumPy array functions.
Float arguments are cast with ``np.float32`` on entry: a no-op in compiled code, and what keeps
the CUDA simulator (which calls these from Python, where results come back as Python floats)
on the float32 signatures.

Contents:

* bit casts (:func:`f32_as_u32`, :func:`u32_as_f32`, and int32 variants) as LLVM intrinsics;
* storage conversions: float16 / bfloat16 bits <-> float32, round to nearest, ties to even;
* :func:`exp_f32`, :func:`exp_nonpos`: vectorisable float32 exp (Cephes polynomial) with exact
  -inf/+inf/NaN; :func:`exp_nonpos5`, a shorter one for the AMX kernel;
* rounding steps: :func:`round_f16`, :func:`round_half_even`, :func:`saturate_int8`, and the
  contract 'Quantization' output quantization :func:`quantize_output`;
* :func:`order_key`: an order-preserving float -> int32 map, so a row max vectorises;
* the online-softmax step: :func:`online_update` (new max and rescale factor),
  :func:`softmax_weight`, :func:`running_sum`, :func:`lse_value`, with :func:`times_pow2` for a
  scale_value beyond float32's range;
* the int8 pipeline: :func:`int8_score`, :func:`int8_score_pse`, :func:`int8_weight` and
  :func:`int8_out_f16`, the output deq2 * A / l rounded once to float16 in exact integer
  arithmetic.

The band and the rule of contract 'Empty rows' for rows that keep nothing are in :mod:`numerics.band`.
"""
import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ..cache import CACHE

# ---------------------------------------------------------------------------------------------
# constants
# ---------------------------------------------------------------------------------------------

F32_ZERO = np.float32(0.0)
F32_ONE = np.float32(1.0)
F32_NEG_INF = np.float32(-np.inf)
F32_POS_INF = np.float32(np.inf)
#: The deprecated float16 additive mask adds -10000 * mask (contract 'The user mask').
F16_MASK_SCALE = np.float32(-10000.0)

# storage codes: how a tensor's elements are stored (plan -> kernels)
CODE_F32 = 0
CODE_F16 = 1
CODE_BF16 = 2
CODE_I8 = 3   # int8 output, quantized from the float16-rounded result (contract 'Quantization')

# mask kinds
MASK_NONE = 0
MASK_DISCARD = 1  # bool / int8 / uint8: nonzero = discard
MASK_ADD_F16 = 2  # deprecated float16 mask: s += -10000 * mask

#: Cephes' expf: log2(e), ln(2) split in two for the range reduction, the float32 limits of
#: exp (above _EXP_HI: +inf; below _EXP_LO: 0, float32's normal range), the coefficients of its
#: polynomial on [-ln(2) / 2, ln(2) / 2]
_LOG2E, _LN2_HI, _LN2_LO = np.float32([1.44269504088896341, 0.693359375, -2.12194440e-4])
_EXP_HI, _EXP_LO = np.float32([88.72283, -87.33654])
_P0, _P1, _P2, _P3, _P4, _P5 = np.float32([1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                           4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1])
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


def float32_intrinsic(emit, result=types.float32):
    """An intrinsic of one float32 argument whose value (of Numba type ``result``)
    ``emit(builder, x)`` builds in LLVM IR; its docstring is emit's."""
    @intrinsic
    def unary(typingctx, x):
        if x != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return emit(builder, args[0])

        return result(types.float32), codegen

    unary.__doc__ = emit.__doc__
    return unary


@float32_intrinsic
def pow2_f32(builder, n):
    """2.0 ** n for a float32 holding an integer in [-126, 127], built from the exponent bits
    with 32-bit integer ops only (so loops stay 8/16 lanes wide)."""
    i32 = ir.IntType(32)
    i = builder.fptosi(n, i32)
    i = builder.add(i, ir.Constant(i32, 127))
    i = builder.shl(i, ir.Constant(i32, 23))
    return builder.bitcast(i, ir.FloatType())


@float32_intrinsic
def floor_f32(builder, x):
    """floor of a float32 as a float32 (LLVM's llvm.floor.f32: vectorises on the CPU, one
    instruction on CUDA; NumPy's np.floor is not available in CUDA kernels)."""
    fn = builder.module.declare_intrinsic("llvm.floor", [ir.FloatType()])
    return builder.call(fn, [x])


#: float32 -> its IEEE bits as uint32 (and back; int32 variants for signed tricks).
f32_as_u32 = _bitcast_intrinsic(types.float32, types.uint32)
u32_as_f32 = _bitcast_intrinsic(types.uint32, types.float32)
f32_as_i32 = _bitcast_intrinsic(types.float32, types.int32)
i32_as_f32 = _bitcast_intrinsic(types.int32, types.float32)

jit = njit(inline="always", cache=CACHE)


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
    u = f32_as_u32(np.float32(x))
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    u = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16(u >> np.uint32(16))


@jit
def round_f16(x):
    """float32 -> the nearest float16 value (ties to even), as float32."""
    return f16_to_f32(f32_to_f16(np.float32(x)))


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
    """contract 'Quantization' output quantization of one element, as an integral float32:
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
def antiquant(x, channel_scale, channel_offset, token_scale, token_offset):
    """int8 key/value element ``x`` (as float32) dequantized: (x + offset) * scale with the
    channel plane's and the token plane's pair, one of each the identity (docs/fia.md, 'KV
    antiquant')."""
    return (x + channel_offset + token_offset) * (channel_scale * token_scale)


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
    xc = _by_range(x, _EXP_LO, x, _EXP_HI) if x == x else F32_ZERO
    n = floor_f32(xc * _LOG2E + _HALF)
    r = xc - n * _LN2_HI - n * _LN2_LO
    y = _exp_reduced(r)
    # 2^n as two normal factors, so n = 128 (x near ln(FLT_MAX)) does not overflow early
    n1 = floor_f32(n * _HALF)
    y = y * pow2_f32(n1) * pow2_f32(n - n1)
    return _by_range(x, F32_ZERO, y, F32_POS_INF)


@jit
def _exp_reduced(r):
    """exp(r) for |r| <= ln(2) / 2 by the Cephes polynomial."""
    y = (((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5)
    return y * (r * r) + r + F32_ONE


@jit
def _by_range(x, below, inside, above):
    """``below`` where x < _EXP_LO, ``above`` where x > _EXP_HI, x itself where it is NaN,
    else ``inside``: exp's special ranges."""
    if x > _EXP_HI:
        return above
    if x < _EXP_LO:
        return below
    if x != x:
        return x
    return inside


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
    y = _exp_reduced(r)
    return F32_ZERO if x < _EXP_LO else y * two_n


# degree-5 fit of exp on [-ln(2) / 2, ln(2) / 2] (relative error 1.1e-7 in exact arithmetic)
_Q2, _Q3, _Q4, _Q5 = np.float32([0.499992311000824, 0.16667121648788452, 0.041890256106853485,
                                   0.008311860263347626])


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
def times_pow2(x, e):
    """x * 2^e for an integer e, exact until it overflows to +-inf or leaves the normal range
    (0 stays 0, NaN NaN): the exponent of a scale_value beyond float32's range, applied to
    score differences (e > 0) and to what is added to the scaled-down scores (e < 0)."""
    x = np.float32(x)
    while e > 0:
        step = min(e, 126)
        x = x * pow2_f32(np.float32(step))
        e -= step
    while e < 0:
        step = min(-e, 126)
        x = x * pow2_f32(np.float32(-step))
        e += step
    return x


@jit
def rescale_factor(m_old, m_new, post_e):
    """The factor exp((m_old - m_new) * 2^post_e) for acc and l when the running max moves.

    A row that has kept nothing yet (m_new = -inf) keeps factor 1 (its acc and l are 0).
    """
    if m_new == F32_NEG_INF:
        return F32_ONE
    return exp_f32(times_pow2(np.float32(m_old) - np.float32(m_new), post_e))


@jit
def online_update(m_old, tile_max, post_e):
    """The online-softmax step of a row over one tile whose kept scores have the maximum
    ``tile_max``: (the new running max, the factor acc and l are rescaled by). Scores are
    s * 2^post_e (post_e > 0 only for a scale_value beyond float32's range: the kernels keep s
    and apply the power of two to differences from the max, see :func:`softmax_weight`)."""
    m_new = max_nan(m_old, tile_max)
    return m_new, rescale_factor(m_old, m_new, post_e)


@jit
def softmax_weight(s, m, post_e):
    """The unnormalised weight exp((s - m) * 2^post_e) of a score s against the running max m
    (0 for a dropped score, s = -inf)."""
    return exp_nonpos(times_pow2(np.float32(s) - np.float32(m), post_e))


@jit
def running_sum(l, alpha, tile_sum):
    """The running sum after a tile: the old one rescaled, plus the tile's weights."""
    return np.float32(l) * np.float32(alpha) + np.float32(tile_sum)


@jit
def lse_value(m, l, post_e):
    """softmax_lse of a finished row: m * 2^post_e + log(l), -inf when nothing was kept
    (contract 'softmax_lse and merging')."""
    m = np.float32(m)
    if m == F32_NEG_INF:
        return F32_NEG_INF
    return times_pow2(m, post_e) + np.float32(math.log(np.float32(l)))


@jit
def softcapped(s, cap):
    """cap * tanh(s / cap): score s softcapped (cap > 0, in the score's units: the kernels in
    log2 units cap t = s * log2 e by cap * log2 e, the same function)."""
    cap = np.float32(cap)
    return cap * np.float32(math.tanh(np.float32(s) / cap))


@jit
def sink_of(sinks, n):
    """Query head n's sink logit (``sinks``: one a query head), or -inf where ``sinks`` is
    empty: no sink, a term of 0."""
    return np.float32(sinks[n]) if sinks.size else F32_NEG_INF


@jit
def row_total(m, l, sink, post_e):
    """(denominator, softmax_lse) of a finished row that kept a score (running max m, sum l):
    l plus the term of the row's sink logit, exp(sink - m * 2^post_e), a score without a value
    row (0 for a sink of -inf: none). The lse is that of the denominator (NaN for a NaN row), or
    the sink's own logit where its term overflows (a sink that outweighs the row by e^88; the
    row's weights are then 0)."""
    sink = np.float32(sink)
    total = np.float32(l) + exp_f32(sink - times_pow2(np.float32(m), post_e))
    return total, (sink if total == F32_POS_INF else lse_value(m, total, post_e))


_LN2_F32 = np.float32(0.6931471805599453)


@jit
def online_update_log2(m_old, tile_max):
    """:func:`online_update` in log2 units, for kernels whose scores are t = s * scale * log2 e
    and whose weights are exp2(t - m) (the tensor-core kernel): (the new running max, the
    exponent whose exp2 rescales acc and l, the value the tile's weights exp2(t - it) subtract).
    A row that has kept nothing yet (new max -inf) rescales by exp2(0) = 1 and subtracts 0, so
    that its dropped scores weigh exp2(-inf) = 0; a first kept tile rescales the zeros by
    exp2(-inf) = 0; a NaN max makes both NaN (the row is NaN)."""
    m_old = np.float32(m_old)
    m_new = max_nan(m_old, tile_max)
    if m_new == F32_NEG_INF:
        return m_new, F32_ZERO, F32_ZERO
    return m_new, m_old - m_new, m_new


@jit
def lse_log2(m, l):
    """softmax_lse of a finished softmax row from its running max m in log2 units and its sum
    l: (m + log2 l) * ln 2 (:func:`lse_value` for kernels in log2 units)."""
    return (np.float32(m) + np.float32(math.log2(np.float32(l)))) * _LN2_F32


@jit
def row_total_log2(m, l, sink, term):
    """:func:`row_total` of a row whose running max m is in log2 units (the tensor-core
    kernels), given the sink's term exp2(sink * log2 e - m) as the kernel's exp2 makes it (0
    for a sink of -inf: then l and :func:`lse_log2`, as without sinks): (denominator,
    softmax_lse)."""
    total = np.float32(l) + np.float32(term)
    return total, sink_lse_log2(m, total, sink)


@jit
def sink_lse_log2(m, total, sink):
    """The softmax_lse of :func:`row_total_log2` from the row's denominator ``total``: the
    sink's own logit where its term overflowed, else :func:`lse_log2`."""
    return np.float32(sink) if np.float32(total) == F32_POS_INF else lse_log2(m, total)


# ---------------------------------------------------------------------------------------------
# the int8 pipeline (contract 'Quantization'): scores, softmax weights, and the output deq2 * A / l
# rounded once to float16
# ---------------------------------------------------------------------------------------------

@jit
def int8_score(a, deq1, scale16):
    """The score of an exact integer product sum a: fp16(fp16(a * deq_scale1) * scale16), with
    scale16 = fp16(scale_value)."""
    return round_f16(round_f16(np.float32(a) * np.float32(deq1)) * np.float32(scale16))


@jit
def int8_score_pse(s, pse_bits):
    """A score with its pse_shift element (float16 bits) added, rounded to float16 again."""
    return round_f16(np.float32(s) + f16_to_f32(pse_bits))


@jit
def int8_weight(p, qs1):
    """The quantized softmax weight of E = exp(s - m): clip(round_half_even(E * quant_scale1),
    -128, 127) as an integral float32 (NaN stays NaN)."""
    return saturate_int8(round_half_even(np.float32(p) * np.float32(qs1)))


F32_NAN = np.float32(np.nan)
_I64_ONE = np.int64(1)
_F16_NAN_BITS = np.uint16(0x7E00)


@jit
def _bit_length(x):
    """Number of significant bits of an int64 x >= 0 (0 for 0): a binary search over int64
    shifts, the same on every target (no count-leading-zeros intrinsic needed)."""
    x = np.int64(x)
    n = np.int64(0)
    step = np.int64(32)
    while step > np.int64(0):
        if x >= (_I64_ONE << step):
            x = x >> step
            n += step
        step = step >> np.int64(1)
    return n + x


@jit
def _f32_parts(x):
    """(m, e) with |x| = m * 2^e exactly and 2^23 <= m < 2^24, both int64, for a finite
    nonzero float32 x (subnormals are normalised)."""
    u = np.int64(f32_as_u32(np.float32(x)) & np.uint32(0x7FFFFFFF))
    be = u >> np.int64(23)
    m = u & np.int64(0x7FFFFF)
    if be == np.int64(0):
        s = np.int64(24) - _bit_length(m)
        return m << s, np.int64(-149) - s
    return m | np.int64(0x800000), be - np.int64(150)


@jit
def int8_out_f16(a, deq2, l):
    """The int8 pipeline's output element (contract 'Quantization'): float16 bits (uint16) of the
    exact real value deq2 * a / l, rounded once to nearest, ties to even; overflow is +-inf,
    subnormal halves are correct. The same integer procedure on every target, no floating-point
    rounding anywhere (and no fp64).

    a: the exact integer sum P8 . V (any int64 value); deq2, l: float32, l > 0 (the softmax sum,
    or the count of band columns for a contract 'Empty rows' mean row). Special values: l NaN is the
    NaN-row flag and gives NaN (so do deq2 NaN and l <= 0); an exact zero (a = 0 or deq2 = +-0)
    gives +0; deq2 = +-inf gives +-inf (NaN for a = 0, as inf * 0); l = +inf gives +0 (NaN with an
    infinite deq2). A nonzero value below half the smallest subnormal rounds to a signed zero.

    Why it is exact: with |deq2| = md * 2^ed and l = ml * 2^el (md, ml integers in
    [2^23, 2^24)) the value is |a| * md / ml * 2^(ed - el). |a| is cut to its top 37 bits,
    |a| = ah * 2^s + al (al < 2^s, s <= 26 for any int64), and
        n = ah * md + floor(al * md / 2^s) = floor(|a| * md / 2^s)          (exact, < 2^62)
    with a sticky bit for the dropped al * md mod 2^s (or n = (|a| * 2^-s) * md exactly when
    |a| has at most 37 bits). Then q = n // ml and, by floor(floor(x / 2^s) / ml) =
    floor(x / (2^s ml)), |value| = (q + f) * 2^(s + ed - el) with 0 <= f < 1 and f > 0 exactly
    when the sticky bit or n mod ml is nonzero. q lies in (2^35, 2^39): its bits below the
    float16 quantum (at least 25) plus that sticky bit decide the rounding exactly.
    All products stay below 2^62, so int64 never overflows.
    """
    a = np.int64(a)
    deq2 = np.float32(deq2)
    l = np.float32(l)
    if not (l > F32_ZERO) or deq2 != deq2:
        return _F16_NAN_BITS
    sign = np.int64(0x8000) if (a < np.int64(0)) != (deq2 < F32_ZERO) else np.int64(0)
    if deq2 == F32_POS_INF or deq2 == F32_NEG_INF:
        if a == np.int64(0) or l == F32_POS_INF:
            return _F16_NAN_BITS
        return np.uint16(sign | np.int64(0x7C00))
    if a == np.int64(0) or deq2 == F32_ZERO or l == F32_POS_INF:
        return np.uint16(0)
    ua = -a if a < np.int64(0) else a
    e2 = np.int64(0)
    if ua < np.int64(0):                      # a = -2^63: -a wraps; use 2^62 * 2 instead
        ua = _I64_ONE << np.int64(62)
        e2 = _I64_ONE
    md, ed = _f32_parts(deq2)
    ml, el = _f32_parts(l)
    s = _bit_length(ua) - np.int64(37)
    sticky = False
    if s > np.int64(0):
        ah = ua >> s                          # [2^36, 2^37)
        t = (ua - (ah << s)) * md             # al * md < 2^(s + 24) <= 2^50
        th = t >> s
        n = ah * md + th                      # [2^59, 2^61 + 2^26)
        sticky = t != (th << s)
    else:
        n = (ua << -s) * md                   # [2^59, 2^61), exact
    q = n // ml                               # (2^35, 2^39)
    sticky = sticky or n != q * ml
    e2 = e2 + s + ed - el                     # |value| = (q + f) * 2^e2, 0 <= f < 1
    bq = _bit_length(q)
    e = bq - _I64_ONE + e2                    # |value| in [2^e, 2^(e + 1))
    if e > np.int64(15):
        return np.uint16(sign | np.int64(0x7C00))
    qe = e - np.int64(10)                     # exponent of the float16 quantum at |value|
    if qe < np.int64(-24):
        qe = np.int64(-24)                    # subnormal halves: quantum 2^-24
    sh = qe - e2                              # bits of q below the quantum: >= 25
    if sh > bq:                               # |value| < 2^(qe - 1): below half a quantum
        return np.uint16(sign)
    mq = q >> sh
    r = q - (mq << sh)
    half = _I64_ONE << (sh - _I64_ONE)
    if r > half or (r == half and (sticky or (mq & _I64_ONE) == _I64_ONE)):
        mq += _I64_ONE
    # the quantum's exponent + 24 is the biased float16 exponent - 1 (0 for subnormals), and
    # mq's implicit bit 2^10 adds the 1; a carry to 2^11 moves up one binade: from e = 15
    # (65504 + half an ulp and above) to exactly 0x7C00, +-inf
    bits = ((qe + np.int64(24)) << np.int64(10)) + mq
    return np.uint16(sign | bits)
