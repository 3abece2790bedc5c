"""Compiler options shared by the CPU kernels."""
from .. import config
from ..cache import CACHE

#: fast-math flags of config.CPU_FASTMATH (they keep inf/NaN semantics)
FASTMATH = set(config.CPU_FASTMATH)
#: Every function of a kernel: it takes arrays but allocates none (its buffers come from the
#: host, :mod:`.launch`), so it is compiled without Numba's reference counting (NRT off: each
#: counted array argument would cost an atomic call on every entry), and without the wrappers
#: that make a function callable from Python (only :mod:`.launch` calls a kernel, by its
#: address; a wrapper is compiled code of its own for every specialisation). A view a function
#: returns holds no reference, so these functions are called only from one another.
#: LEAF_EXACT: without fast-math, where a true division or an in-order sum is the rule.
LEAF_EXACT = dict(cache=CACHE, _nrt=False, no_cpython_wrapper=True, no_cfunc_wrapper=True)
LEAF = dict(LEAF_EXACT, fastmath=FASTMATH)
#: A LEAF function inlined into its caller at Numba's level: what a hot loop calls a few times
#: an iteration (LLVM does not inline a call from a large kernel by itself; a call there cost
#: more than the work it does, docs/tuning.md), and the steps of a kernel's walk, so that a
#: kernel is a few compiled units, not a deep tree of them (each unit re-optimises all it
#: calls, docs/performance.md).
LEAF_INLINE = dict(LEAF, inline="always")
