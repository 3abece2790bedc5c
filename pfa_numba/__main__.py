"""``python -m pfa_numba``: the command line, :mod:`pfa_numba.cli.main`."""
import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
