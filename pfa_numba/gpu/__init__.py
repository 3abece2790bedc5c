"""The CUDA backend (package ``gpu``: a subpackage named ``cuda`` would be taken for numba.cuda
by numba-cuda's import hook).

Modules: ``arrays`` (CUDA arrays of any library without importing numba.cuda: their kind,
metadata, host/device copies), ``kernels`` (the ``@cuda.jit`` kernels over the shared
numerics) and ``launch`` (running a planned problem). Importing this package imports nothing
of numba-cuda: ``import pfa_numba`` never needs numba-cuda or a GPU.
"""
