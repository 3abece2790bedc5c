"""Compiler options shared by the CPU kernels."""
from .. import config

#: fast-math flags of config.CPU_FASTMATH (they keep inf/NaN semantics)
FASTMATH = set(config.CPU_FASTMATH)
#: The helpers called per row or per tile take arrays but allocate none, and are compiled
#: without Numba's reference counting (NRT off): each counted array argument costs an atomic
#: call on every entry.
LEAF = dict(fastmath=FASTMATH, cache=True, _nrt=False)
#: A LEAF helper inlined into its caller at Numba's level: what a hot loop calls a few times an
#: iteration (LLVM does not inline a call from a large kernel by itself; a call there cost more
#: than the work it does, docs/tuning.md).
LEAF_INLINE = dict(LEAF, inline="always")
