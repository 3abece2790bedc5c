"""The command line (``python -m pfa_numba``) and its benchmarks."""
