"""Run the decode benchmark (same as ``python -m pfa_numba bench-decode``).

    python benchmarks/decode.py [--quick] [--repeats 5] [--out FILE.md]
"""
import sys

from pfa_numba.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench-decode", *sys.argv[1:]]))
