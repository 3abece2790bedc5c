"""Run the whole pfa_numba test suite: every pytest process, in two lanes at once.

* lane "cpu": the CPU tests (tests/, one process; the notebooks among them, executed and
  their figures checked), then the docs site (Sphinx, warnings as errors, into a fresh
  folder, so the notebooks run again) and a check that its notebook pages show their
  figures, which share the CPU kernels' Numba cache the CPU tests fill; then the
  CUDA-simulator tests (tests/cudasim, when present: NUMBA_ENABLE_CUDASIM=1 must be set
  before Numba is imported, so they get a process of their own).
* lane "cuda": the PTX checks (tests/ptx: ``cuda.compile_ptx`` needs the real numba.cuda): they
  compile and assemble CUDA kernels, the longest single step, one core's work that the CPU
  lane does not wait for.

Each process must pass and each pytest process must run at least one test (pytest's exit code
5, "no tests ran", counts as a failure). A step's output is printed whole when it ends. Extra
arguments are passed to every pytest call.
"""
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lanes(site):
    """{lane: [(name, command, environment, takes the extra pytest arguments)]}, each lane's
    steps in order."""
    py = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cpu = [("cpu", py + ["tests", "--ignore=tests/ptx", "--ignore=tests/cudasim"], {}, True),
           ("docs", [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                     "docs", site], {}, False),
           ("figures", [sys.executable, os.path.join(ROOT, "scripts", "check_site.py"), site],
            {}, False)]
    if os.path.isdir(os.path.join(ROOT, "tests", "cudasim")):
        cpu.append(("cudasim", py + ["tests/cudasim"], {"NUMBA_ENABLE_CUDASIM": "1"}, True))
    return {"cpu": cpu, "cuda": [("ptx", py + ["tests/ptx"], {}, True)]}


def run_lane(steps, extra, results, printing):
    """Run ``steps`` in order, each to the end whatever the others did; (name, rc, seconds) of
    each into ``results``."""
    for name, cmd, env, takes_extra in steps:
        cmd = cmd + extra if takes_extra else cmd
        t0 = time.time()
        with tempfile.TemporaryFile("w+") as log:
            rc = subprocess.call(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=log,
                                 stderr=subprocess.STDOUT)
            log.seek(0)
            with printing:
                print(f"\n=== {name}: {' '.join(cmd[1:])}\n{log.read()}", end="", flush=True)
        results.append((name, rc, time.time() - t0))


def main(extra):
    results, printing = [], threading.Lock()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as site:
        planned = lanes(site)
        threads = [threading.Thread(target=run_lane, args=(steps, extra, results, printing))
                   for steps in planned.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    print("\n=== summary")
    failed = 0
    for name, rc, dt in results:
        status = "ok" if rc == 0 else ("NO TESTS RAN" if rc == 5 else f"FAILED (exit {rc})")
        failed += rc != 0
        print(f"  {name:10s} {status:22s} {dt:7.1f} s")
    print(f"  {'all':10s} {'':22s} {time.time() - t0:7.1f} s")
    expected = sum(len(steps) for steps in planned.values())     # a lane that died ran fewer
    return 1 if failed or len(results) != expected else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
