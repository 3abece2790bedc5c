"""Full-width SIMD for the CPU kernel's elementwise loops.

LLVM's x86 backend prefers 256-bit vectors on AVX-512 CPUs (a frequency trade-off made for
mixed code). The softmax, packing and rescale loops of the CPU kernel are pure vector
arithmetic between BLAS / AMX calls, and run 1.5-1.8x faster in 512-bit registers (measured:
exp pass 0.50 -> 0.33 ns/element, row max 0.23 -> 0.15). :func:`wide_vectors`, called first in a
function, sets that function's LLVM attributes ``prefer-vector-width`` and
``min-legal-vector-width`` to 512; on CPUs without AVX-512 they change nothing.
"""
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

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


_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)


def llvm_function(builder, name, ret, args):
    """The declaration of LLVM function (intrinsic) ``name`` in the builder's module, added on
    first use."""
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(ret, args), name)
    return fn


@intrinsic
def prefetch(typingctx, arr, idx):
    """Software prefetch of the cache line holding ``arr.flat[idx]`` into L1 (no fault on any
    address, no effect on the result)."""
    if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), _I8P)
        fn = llvm_function(builder, "llvm.prefetch.p0", ir.VoidType(), [_I8P, _I32, _I32, _I32])
        # read, highest temporal locality, data cache
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(arr, idx), codegen
