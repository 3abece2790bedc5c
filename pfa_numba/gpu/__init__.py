"""The CUDA backend (package ``gpu``: a subpackage named ``cuda`` would be taken for numba.cuda
by numba-cuda's import hook).

Modules: ``kernels`` (the portable ``@cuda.jit`` kernel over the shared numerics and the kv
walk every kernel shares), ``tc_kernel`` and ``decode_kernel`` (the tensor-core kernels) with
``fragments``, ``ptx``, ``dequant`` and ``guard``, ``launch`` (running a planned problem),
``device`` (the driver calls a call makes), and the checks without a GPU (``warp_model``,
``warp_sim``, ``sass``). Importing this package imports nothing of numba-cuda:
``import pfa_numba`` never needs numba-cuda or a GPU.
"""

#: head dims of the tensor-core and decode kernels (their mma fragments' widths)
HEAD_DIMS = (64, 128)
