"""The command line: info and warmup run and say what they should."""
import subprocess
import sys


def _run(*args):
    res = subprocess.run([sys.executable, "-m", "pfa_numba", *args], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_info_lists_kernels_threads_and_cache():
    from pfa_numba import dispatch
    out = _run("info")
    for word in ("numba", "threads", "cache", "float32 tiles"):
        assert word in out
    for kernel in dispatch.KERNELS:
        assert f"{kernel.device} {kernel.name} " in out and kernel.does in out


def test_info_explains_a_call():
    """info --call: the kernel a decode step gets, and a line for every other CPU kernel."""
    from pfa_numba import dispatch
    out = _run("info", "--call", "1,8,2,1,512,64", "--dtype", "float32")
    explanation = out[out.index("the cpu "):].splitlines()
    assert explanation[0].startswith("the cpu streaming kernel runs this call")
    assert sorted(line.split(":")[0].strip() for line in explanation[1:]
                  if line.startswith("  not ")) == sorted(
        f"not {k.name}" for k in dispatch.TARGETS["cpu"].kernels() if k.name != "streaming")


def test_a_closed_pipe_ends_the_output_quietly():
    """``info | head -1``: the reader closes the pipe after one line; no traceback, exit 0."""
    proc = subprocess.Popen([sys.executable, "-m", "pfa_numba", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, bufsize=0)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == 0 and "Traceback" not in err, err


def test_warmup_compiles_every_cpu_kernel():
    """Every CPU kernel, for every storage it is specialised for, each a line of the output
    as it starts and one as it ends."""
    from pfa_numba.cli.warmup import STORAGES
    from pfa_numba.cpu import _amx, driver
    out = _run("warmup")
    tiles = "avx512-tiles" if driver.use_register_blocks() else "blas-tiles"
    for what, _, _ in STORAGES:
        assert f"  {tiles}, streaming and merge, {what} ...\n    " in out
    for job in ("int8, int8 query, key and value", "backward kv pass and query pass",
                "quantize-output, float16 result, BNSD", "quantize-output, float32 result, BSH"):
        assert f"  {job}" in out
    assert ("amx, float16 and bfloat16" in out) == _amx.available()
    assert out.rstrip().splitlines()[-1].startswith("done in ")


def test_import_and_cpu_work_without_numba_cuda():
    """numba-cuda is optional: hide it, and pfa_numba still imports, runs on the CPU, and
    explains why device='cuda' is unavailable."""
    code = """
import sys, importlib.abc
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.startswith('numba_cuda') or name.startswith('numba.cuda'):
            raise ImportError('hidden: ' + name)
sys.meta_path.insert(0, Hide())
import numpy as np
from pfa_numba import prompt_flash_attention
q = np.ones((1, 1, 4, 16), np.float32)
assert prompt_flash_attention(q, q, q, num_heads=1, input_layout='BNSD').shape == (1, 1, 4, 16)
try:
    prompt_flash_attention(q, q, q, num_heads=1, input_layout='BNSD', device='cuda')
except RuntimeError as e:
    print('REFUSED', e)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "REFUSED" in res.stdout and "cuda:" in res.stdout
    assert "numba-cuda" in res.stdout or "numba.cuda" in res.stdout


def test_a_bare_command_prints_the_help():
    out = _run()
    assert out.startswith("usage: python -m pfa_numba")
    for command in ("demo", "bench", "bench-decode", "warmup", "info", "cuda-ptx"):
        assert command in out


def test_the_console_script_is_the_same_command():
    import shutil
    script = shutil.which("pfa-numba", path=f"{sys.prefix}/bin")
    assert script, "the pfa-numba console script is installed with the package"
    res = subprocess.run([script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("usage: pfa-numba"), res.stderr
