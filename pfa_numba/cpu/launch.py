"""Running a CPU kernel on every thread of a call: the parallel region, the kernel's own
compiled unit, its per-thread buffers.

A kernel is a ``worker(t, a, b, c, d, e, f, g, h)``: a LEAF function (:mod:`._jit`) that thread
``t`` runs once, taking work items from a shared counter until none is left, over eight records
(namedtuples of arrays and numbers, :mod:`.records`). One small ``parallel=True`` function,
:func:`_on_threads`, starts the threads and calls the worker through its address: Numba links
what a function calls into that function's compiled code and optimises it again there, so a
parallel function calling the worker directly would recompile the whole kernel twice more (its
own code and the parallel loop's). Called by address, each worker is compiled once, as one
unit, and only when a call runs it; the launcher is compiled once a record signature.

A worker allocates nothing: its buffers are host arrays with one row a thread (:func:`rows`),
each starting a cache line.
"""
import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from ..cache import compile_notice
from ._vector import LINE


@intrinsic
def _call(typingctx, address, *args):
    """Call the Numba-compiled function at ``address`` (an int64) with ``args``, by Numba's own
    calling convention (what a call of a linked function compiles to); it returns nothing."""
    star = types.StarArgTuple.from_types(args)

    def codegen(context, builder, signature, llargs):
        at, packed = llargs
        values = [builder.extract_value(packed, i) for i in range(len(args))]
        fnty = context.call_conv.get_function_type(types.none, list(args))
        function = builder.inttoptr(at, fnty.as_pointer())
        context.call_conv.call_function(builder, function, types.none, list(args), values)
        return context.get_dummy_value()

    return types.void(address, star), codegen


@njit(cache=True, _nrt=False, no_cpython_wrapper=True, no_cfunc_wrapper=True)
def _call_worker(address, t, a, b, c, d, e, f, g, h):
    _call(address, t, a, b, c, d, e, f, g, h)


@njit(parallel=True, cache=True)
def _on_threads(address, threads, a, b, c, d, e, f, g, h):
    """Run the worker at ``address`` once on each of ``threads`` threads."""
    for t in prange(threads):
        _call_worker(address, np.int64(t), a, b, c, d, e, f, g, h)


class Worker:
    """A kernel's worker (see the module docstring) and its compiled addresses, one a
    signature of its records."""

    def __init__(self, function):
        self.function = function
        self._addresses = {}

    def run(self, threads, records, compiling):
        """Run the worker on ``threads`` threads over the eight ``records``; ``compiling``: what
        is compiled, in words, should this call compile it (:class:`..cache.compile_notice`)."""
        with compile_notice(compiling):
            _on_threads(self.address(records), threads, *records)

    def address(self, records):
        """The address of the worker compiled for these records (compiled, or loaded from
        Numba's cache, at the first call with their types)."""
        key = tuple(_key(r) for r in records)
        address = self._addresses.get(key)
        if address is None:
            address = self._addresses[key] = self._compiled(records)
        return address

    def _compiled(self, records):
        signature = (types.int64,) + tuple(numba.typeof(r) for r in records)
        self.function.compile(signature)
        result = self.function.overloads[signature]
        return result.library.get_pointer_to_function(result.fndesc.llvm_func_name)


def _key(x):
    """What Numba's type of record (or array, or number) ``x`` depends on, cheaply: an array's
    dtype, rank, layout, writability and alignment, a record's class and fields', a number's
    class."""
    if isinstance(x, np.ndarray):
        f = x.flags
        return x.dtype.num, x.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned
    if isinstance(x, tuple):
        return (type(x),) + tuple(_key(e) for e in x)
    return type(x)


def rows(threads, shape, dtype, zero=False):
    """An array of ``threads`` rows of ``shape`` (each a thread's buffer), each row starting a
    cache line (a tile load 32 bytes past a line boundary takes several times as long,
    docs/tuning.md); zeros where ``zero``."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    step = -(-max(n, 1) * dtype.itemsize // LINE) * LINE // dtype.itemsize
    raw = (np.zeros if zero else np.empty)(threads * step + LINE // dtype.itemsize, dtype)
    skip = (-raw.ctypes.data % LINE) // dtype.itemsize
    block = raw[skip:skip + threads * step].reshape(threads, step)
    return block[:, :n].reshape((threads,) + tuple(shape))
