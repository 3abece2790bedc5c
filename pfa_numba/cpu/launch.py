"""Running a CPU kernel on every thread of a call: the parallel region, the kernel's own
compiled unit, its per-thread buffers.

A kernel is a ``worker(t, args)``: a LEAF function (:mod:`._jit`) that thread ``t`` runs once,
taking work items from a shared counter until none is left, over the records ``args[0]``
(a typed pointer to a tuple of records: namedtuples of arrays and numbers, :mod:`.records`).
One small ``parallel=True`` function, :func:`_on_threads`, starts the threads and calls the
worker through its address: Numba links what a function calls into that function's compiled
code and optimises it again there, so a parallel function calling the worker directly would
recompile the whole kernel twice more (its own code and the parallel loop's). Called by
address, each worker is compiled once, as one unit, and only when a call runs it; the launcher
takes integers only (the worker's address, the threads, the records' packed bytes,
:func:`_packed`), so one compiled launcher serves every worker.

A worker allocates nothing: its buffers are host arrays with one row a thread (:func:`rows`),
each starting a cache line.
"""
import math

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from ..cache import CACHE, compile_notice
from ._vector import LINE


@intrinsic
def _call(typingctx, address, t, args):
    """Call the Numba-compiled ``worker(t, args)`` at ``address`` (int64s all three; ``args``
    the address of its records' bytes, which the worker takes as a typed pointer: the same
    register), by Numba's own calling convention (what a call of a linked function compiles
    to); it returns nothing."""
    def codegen(context, builder, signature, llargs):
        at, index, records = llargs
        argtypes = [types.int64, types.int64]
        fnty = context.call_conv.get_function_type(types.none, argtypes)
        worker = builder.inttoptr(at, fnty.as_pointer())
        context.call_conv.call_function(builder, worker, types.none, argtypes, [index, records])
        return context.get_dummy_value()

    return types.void(address, t, args), codegen


@njit(cache=CACHE, _nrt=False, no_cpython_wrapper=True, no_cfunc_wrapper=True)
def _call_worker(address, t, args):
    _call(address, t, args)


@njit(parallel=True, cache=CACHE)
def _on_threads(address, threads, args):
    """Run the worker at ``address`` once on each of ``threads`` threads, over the records at
    ``args`` (int64s all three: one specialisation serves every worker)."""
    for t in prange(threads):
        _call_worker(address, np.int64(t), args)


@intrinsic
def _size_of(typingctx, value):
    """The bytes of ``value``'s native form."""
    def codegen(context, builder, signature, llargs):
        size = context.get_abi_sizeof(context.get_value_type(value))
        return context.get_constant(types.intp, size)
    return types.intp(value), codegen


@intrinsic
def _store(typingctx, buffer, value):
    """Write ``value``'s native form into ``buffer``'s bytes."""
    def codegen(context, builder, signature, llargs):
        data = context.make_array(buffer)(context, builder, llargs[0]).data
        builder.store(llargs[1], builder.bitcast(data,
                                                  context.get_value_type(value).as_pointer()))
        return context.get_dummy_value()
    return types.void(buffer, value), codegen


@njit(cache=CACHE)
def _packed(records):
    """The native bytes of ``records`` (a tuple of records: their arrays' descriptors, numbers),
    which a worker reads through a pointer; the arrays themselves stay the caller's."""
    out = np.empty(_size_of(records), np.uint8)
    _store(out, records)
    return out


class Worker:
    """A kernel's worker (see the module docstring) and its compiled addresses, one a
    signature of its records."""

    def __init__(self, function):
        self.function = function
        self._addresses = {}

    def run(self, threads, records, compiling, compile_only=False):
        """Run the worker on ``threads`` threads over ``records`` (a tuple of records);
        ``compiling``: what is compiled, in words, should this call compile it
        (:class:`..cache.compile_notice`). ``compile_only``: compile (or load from Numba's
        cache) what the run takes, and run nothing."""
        with compile_notice(compiling):
            address = self.address(records)
            if compile_only:         # compiled, not run: it may be for another CPU
                _packed.compile((numba.typeof(records),))
                _on_threads.compile((types.int64,) * 3)
                return
            packed = _packed(records)          # held while the threads read it
            _on_threads(address, threads, packed.ctypes.data)

    def address(self, records):
        """The address of the worker compiled for these records (compiled, or loaded from
        Numba's cache, at the first call with their types)."""
        key = tuple(_key(r) for r in records)
        address = self._addresses.get(key)
        if address is None:
            address = self._addresses[key] = self._compiled(records)
        return address

    def _compiled(self, records):
        signature = (types.int64, types.CPointer(numba.typeof(records)))
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
    """A C-contiguous array of ``threads`` rows of ``shape`` (each a thread's buffer), each row
    starting a cache line (a tile load 32 bytes past a line boundary takes several times as
    long, docs/tuning.md): ``shape``'s last length is rounded up to fill whole lines. Zeros
    where ``zero``."""
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    lead = int(np.prod(shape[:-1], dtype=np.int64)) * dtype.itemsize
    step = LINE // math.gcd(LINE, max(lead, 1))          # last-axis elements a whole line takes
    last = -(-max(shape[-1], 1) // step) * step
    n = int(np.prod(shape[:-1], dtype=np.int64)) * last
    raw = (np.zeros if zero else np.empty)(threads * n + LINE // dtype.itemsize, dtype)
    skip = (-raw.ctypes.data % LINE) // dtype.itemsize
    return raw[skip:skip + threads * n].reshape((threads,) + shape[:-1] + (last,))
