"""Run the whole pfa_numba test suite: every pytest process, in order.

* CPU tests (tests/, one process);
* PTX checks (tests/ptx: ``cuda.compile_ptx`` needs the real numba.cuda);
* CUDA-simulator tests (tests/cudasim, when present: NUMBA_ENABLE_CUDASIM=1 must be set before
  Numba is imported, so they get a process of their own);
* notebooks (executed with nbmake);
* the docs site (Sphinx, warnings as errors, into a fresh folder, so the notebooks run again).

Each process must pass and each pytest process must run at least one test (pytest's exit code
5, "no tests ran", counts as a failure). Extra arguments are passed to every pytest call.
"""
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def steps(site):
    """(name, command, environment, takes the extra pytest arguments) of each part in order."""
    py = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    yield "cpu", py + ["tests", "--ignore=tests/ptx", "--ignore=tests/cudasim"], {}, True
    yield "ptx", py + ["tests/ptx"], {}, True
    if os.path.isdir(os.path.join(ROOT, "tests", "cudasim")):
        yield "cudasim", py + ["tests/cudasim"], {"NUMBA_ENABLE_CUDASIM": "1"}, True
    yield "notebooks", py + ["--nbmake", "--nbmake-timeout=600", "notebooks"], {}, True
    yield "docs", [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                   "docs", site], {}, False


def main(extra):
    results = []
    with tempfile.TemporaryDirectory() as site:
        for name, cmd, env, takes_extra in steps(site):
            cmd = cmd + extra if takes_extra else cmd
            print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
            t0 = time.time()
            rc = subprocess.call(cmd, cwd=ROOT, env={**os.environ, **env})
            results.append((name, rc, time.time() - t0))
    print("\n=== summary")
    failed = 0
    for name, rc, dt in results:
        status = "ok" if rc == 0 else ("NO TESTS RAN" if rc == 5 else f"FAILED (exit {rc})")
        failed += rc != 0
        print(f"  {name:10s} {status:22s} {dt:7.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
