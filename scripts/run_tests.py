"""Run the whole pfa_numba test suite: every pytest process, in order.

* CPU tests (tests/, one process);
* PTX checks (tests/ptx: ``cuda.compile_ptx`` needs the real numba.cuda);
* CUDA-simulator tests (tests/cudasim, when present: NUMBA_ENABLE_CUDASIM=1 must be set before
  Numba is imported, so they get a process of their own);
* notebooks (executed with nbmake).

Each process must pass and must run at least one test (pytest's exit code 5, "no tests ran",
counts as a failure). Extra arguments are passed to every pytest call.
"""
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def steps():
    py = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    yield "cpu", py + ["tests", "--ignore=tests/ptx", "--ignore=tests/cudasim"], {}
    yield "ptx", py + ["tests/ptx"], {}
    if os.path.isdir(os.path.join(ROOT, "tests", "cudasim")):
        yield "cudasim", py + ["tests/cudasim"], {"NUMBA_ENABLE_CUDASIM": "1"}
    yield "notebooks", py + ["--nbmake", "--nbmake-timeout=600", "notebooks"], {}


def main(extra):
    results = []
    for name, cmd, env in steps():
        print(f"\n=== {name}: {' '.join(cmd[1:] + extra)}", flush=True)
        t0 = time.time()
        rc = subprocess.call(cmd + extra, cwd=ROOT, env={**os.environ, **env})
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
