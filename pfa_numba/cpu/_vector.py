"""Vector-level helpers for the CPU kernel's loops.

- :func:`wide_vectors`: LLVM's x86 backend prefers 256-bit vectors on AVX-512 CPUs (a frequency
  trade-off made for mixed code). The softmax, packing and rescale loops of the CPU kernel are
  pure vector arithmetic between the tile products, and run faster in 512-bit registers
  (measurements: docs/tuning.md). Called first in a function, it sets that function's LLVM
  attributes ``prefer-vector-width`` and ``min-legal-vector-width`` to 512; on CPUs without
  AVX-512 they change nothing.
- :func:`readonly`: a buffer typed as the read-only inputs are.
- :func:`take_next`: an atomic counter, so that threads take work items as they free up.
- :func:`prefetch`, ``bf16_bits_hw``, :func:`f16_bits_to_f32_hw`, ``f32_to_f16_bits_hw``,
  :func:`host_has`, :func:`llvm_function`: single instructions (and the host check for them)
  that NumPy-style code cannot name.
"""
import contextlib
import functools
import itertools

import numba
from llvmlite import binding as _llvm
from llvmlite import ir
from numba import types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

from ..numerics.core import float32_intrinsic

_ATTRIBUTES = ('"prefer-vector-width"="512"', '"min-legal-vector-width"="512"')


@intrinsic
def wide_vectors(typingctx):
    """Let the loop vectoriser use 512-bit vectors in the calling function (emits no code)."""
    def codegen(context, builder, sig, args):
        attrs = builder.function.attributes
        for a in _ATTRIBUTES:
            # llvmlite's FunctionAttributes.add() accepts keyword attributes only; LLVM reads
            # string attributes written the same way, so they go into the set directly.
            set.add(attrs, a)
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def own_unit(typingctx):
    """Keep the calling function out of its callers' code (LLVM's noinline; emits no code): a
    large function called once a tile or segment costs a call there, while inlined, every
    compiled unit that calls it would optimise a copy of it again (docs/performance.md)."""
    def codegen(context, builder, sig, args):
        builder.function.attributes.add("noinline")
        return context.get_dummy_value()
    return types.none(), codegen


_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)


@contextlib.contextmanager
def counted_loop(builder, count):
    """``for i in range(count)`` in LLVM IR (as numba's cgutils.for_range; yields i), its back
    edge marked llvm.loop.unroll.disable: the intrinsics' loops are unrolled as they are
    written, where LLVM would unroll them anew each time a unit that calls them is optimised
    (a decode product grew 2.4 times in its caller's unit, docs/performance.md)."""
    fn, start = builder.function, builder.block
    cond, body, end = (fn.append_basic_block(f"loop.{x}") for x in ("cond", "body", "end"))
    builder.branch(cond)
    builder.position_at_end(cond)
    index = builder.phi(count.type, name="loop.index")
    builder.cbranch(builder.icmp_signed("<", index, count), body, end)
    builder.position_at_end(body)
    yield index
    index.add_incoming(ir.Constant(count.type, 0), start)
    index.add_incoming(builder.add(index, ir.Constant(count.type, 1)), builder.block)
    builder.branch(cond).set_metadata("llvm.loop", _no_unroll(builder.module))
    builder.position_at_end(end)


def _no_unroll(module):
    """A new loop id (self-referential, one a loop) asking LLVM not to unroll the loop."""
    disable = module.add_metadata([ir.MetaDataString(module, "llvm.loop.unroll.disable")])
    unique = module.add_metadata([ir.MetaDataString(module, f"pfa_numba.loop.{next(_loops)}")])
    loop_id = module.add_metadata([unique, disable])
    loop_id.operands = (loop_id, disable)
    return loop_id


_loops = itertools.count()


def llvm_function(builder, name, ret, args):
    """The declaration of LLVM function (intrinsic) ``name`` in the builder's module, added on
    first use."""
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(ret, args), name)
    return fn


def element_args(arr, idx):
    """Whether an intrinsic's (arr, idx) are a 1-D array and an integer index."""
    return isinstance(arr, types.Array) and isinstance(idx, types.Integer)


def element_pointer(context, builder, sig, args):
    """In an intrinsic of (arr, idx): the address of ``arr.flat[idx]``."""
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    return builder.gep(ary.data, [args[1]])


def add_products(builder, fma, scalars, vectors, accs):
    """accs[r][j] = fma(splat(scalars[r]), vectors[j], accs[r][j]) for every r and j: the
    outer-product step of the register blocks (accs: pointers to the accumulator vectors)."""
    lanes = vectors[0].type.count
    for r, x in enumerate(scalars):
        xs = splat(builder, x, lanes)
        for j, vec in enumerate(vectors):
            builder.store(fma(builder, xs, vec, builder.load(accs[r][j])), accs[r][j])


def splat(builder, scalar, lanes):
    """A vector of ``lanes`` copies of ``scalar``."""
    vec = builder.insert_element(ir.Constant(ir.VectorType(scalar.type, lanes), ir.Undefined),
                                 scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes))


@intrinsic
def prefetch(typingctx, arr, idx):
    """Software prefetch of the cache line holding ``arr.flat[idx]`` into L1 (no fault on any
    address, no effect on the result)."""
    if not element_args(arr, idx):
        return None

    def codegen(context, builder, sig, args):
        emit_prefetch(builder, element_pointer(context, builder, sig, args), PREFETCH_L1)
        return context.get_dummy_value()
    return types.none(arr, idx), codegen


#: the locality hints of llvm.prefetch: into L1 (the highest), into L2
PREFETCH_L1, PREFETCH_L2 = 3, 2


def emit_prefetch(builder, ptr, locality):
    """A read prefetch of the cache line at ``ptr`` into the data cache (llvm.prefetch)."""
    fn = llvm_function(builder, "llvm.prefetch.p0", ir.VoidType(), [_I8P, _I32, _I32, _I32])
    builder.call(fn, [builder.bitcast(ptr, _I8P), ir.Constant(_I32, 0),
                      ir.Constant(_I32, locality), ir.Constant(_I32, 1)])


@intrinsic
def take_next(typingctx, counter):
    """counter[0] += 1 as one atomic step, returning the value before: each caller, on any
    thread, gets a different number (an int64 array shared by the threads)."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", ary.data, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(counter), codegen


#: bytes of alignment of the kernel's scratch buffers: one cache line, so that no 64-byte
#: vector load and no AMX tile row straddles two lines
LINE = 64


@intrinsic
def readonly(typingctx, arr):
    """``arr`` as a read-only array (the same array): where a kernel hands its own buffer to a
    function that also reads the caller's read-only inputs, one specialisation serves both."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        return impl_ret_borrowed(context, builder, sig.return_type, args[0])

    return arr.copy(readonly=True)(arr), codegen


class _BFloat(ir.types._BaseFloatType):
    """LLVM's ``bfloat`` (llvmlite.ir names half, float and double only)."""
    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"


_BFloat._create_instance()


def _host_answer(question):
    """question(), an LLVM query about the host CPU, where Numba compiles for this host (False
    elsewhere, or where LLVM cannot answer)."""
    try:
        return numba.config.CPU_NAME in (None, "host") and bool(question())
    except (RuntimeError, AttributeError):
        return False


def host_has(feature):
    """True when Numba compiles for this host and the host CPU has ``feature`` (LLVM name)."""
    return _host_answer(lambda: _llvm.get_host_cpu_features().get(feature))


@functools.cache
def host_is_zen():
    """True when Numba compiles for this host and it is an AMD Zen CPU (LLVM's znver names;
    asked once: LLVM takes about 0.1 ms to answer)."""
    return _host_answer(lambda: _llvm.get_host_cpu_name().startswith("znver"))


def _rounding_to_16_bits(narrow, doc):
    """Intrinsic float32 -> the 16 bits of LLVM type ``narrow`` by fptrunc (round to nearest
    even), which LLVM vectorises to the CPU's conversion instruction."""
    def convert(builder, x):
        return builder.bitcast(builder.fptrunc(x, narrow), ir.IntType(16))
    convert.__doc__ = doc
    return float32_intrinsic(convert, types.uint16)


bf16_bits_hw = _rounding_to_16_bits(_BFloat(), """float32 -> bfloat16 bits (round to nearest
    even) by VCVTNEPS2BF16. Only for code compiled where ``host_has("avx512bf16")``: elsewhere
    LLVM would call a runtime function that Numba does not link. The instruction flushes results
    below 2^-126 to zero.""")

f32_to_f16_bits_hw = _rounding_to_16_bits(ir.HalfType(), """float32 -> IEEE binary16 bits,
    round to nearest even, by VCVTPS2PH (subnormal and overflowing results as IEEE rounds them;
    NaN stays NaN). Only for code compiled where ``host_has("f16c")``.""")


@intrinsic
def f16_bits_to_f32_hw(typingctx, h):
    """IEEE binary16 bits (uint16) -> float32 by LLVM's fpext, which vectorises to VCVTPH2PS
    (exact for every half, subnormals included; a signalling NaN comes out quiet). Only for code
    compiled where ``host_has("f16c")``. Other argument types are cast to uint16 first (the
    kernels' float32 specialisations type this branch without running it)."""
    if not isinstance(h, (types.Integer, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        bits = context.cast(builder, args[0], sig.args[0], types.uint16)
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())
    return types.float32(h), codegen
