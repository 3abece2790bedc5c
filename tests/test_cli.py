"""The command line: info and warmup run and say what they should."""
import subprocess
import sys


def _run(*args):
    res = subprocess.run([sys.executable, "-m", "pfa_numba", *args], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_info_lists_backends_threads_and_cache():
    out = _run("info")
    for word in ("numba", "backend cpu", "backend cuda", "threads", "cache"):
        assert word in out


def test_warmup_compiles_every_cpu_kernel():
    out = _run("warmup")
    for word in ("uint16 storage", "float32 storage", "int8 pipeline"):
        assert word in out
