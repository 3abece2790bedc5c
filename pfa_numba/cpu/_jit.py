"""Compiler options shared by the CPU kernels."""
from .. import config

#: fast-math flags of config.CPU_FASTMATH (they keep inf/NaN semantics)
FASTMATH = set(config.CPU_FASTMATH)
#: The helpers called per row or per tile take arrays but allocate none, and are compiled
#: without Numba's reference counting (NRT off): each counted array argument costs an atomic
#: call on every entry.
LEAF = dict(fastmath=FASTMATH, cache=True, _nrt=False)
