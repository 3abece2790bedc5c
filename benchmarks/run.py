"""Run the side-by-side CPU benchmark (same as ``python -m pfa_numba bench``).

    python benchmarks/run.py [--quick] [--filter fp16] [--repeats 5] [--out benchmarks/results]
"""
import sys

from pfa_numba.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
