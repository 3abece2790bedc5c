"""The cache where users deploy (pfa_numba.cache): a warmed image whose package folder is then
read-only loads its kernels (nothing compiles), and where nothing at all is writable ``import
pfa_numba`` works and calls compile. Each case runs in processes of its own over a copy of the
package, made read-only by its file modes (as root, which modes do not bind, by the immutable
attribute)."""
import os
import shutil
import subprocess
import sys

import pytest

import pfa_numba

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="read-only folders made by Linux file attributes")

#: an int8 call (its kernel the smallest to compile), then where the kernels are cached;
#: {tmp} replaces the temporary folder
CALL = """
import tempfile
tempfile.tempdir = {tmp!r}
import numpy as np, pfa_numba
from pfa_numba import cache
q = np.ones((1, 2, 8, 32), np.int8)
one = np.ones(1, np.float32)
out = pfa_numba.prompt_flash_attention(q, q, q, num_heads=2, input_layout="BNSD",
                                       deq_scale1=one, quant_scale1=one, deq_scale2=one)
assert np.isfinite(out.astype(np.float32)).all()
print("CACHE", cache.CACHE, cache.cache_folder())
"""
#: a folder nothing can be made in, whoever asks (its parent is a file)
NOWHERE = "/dev/null/nowhere"


def _read_only(folder, on):
    """Make ``folder`` and all below it read-only (``on``), or writable again."""
    if os.getuid() == 0:
        res = subprocess.run(["chattr", "-R", "+i" if on else "-i", folder],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot make a folder read-only for root here: {res.stderr.strip()}")
        return
    for path, dirs, files in os.walk(folder):
        for name in files:
            os.chmod(os.path.join(path, name), 0o444 if on else 0o644)
        os.chmod(path, 0o555 if on else 0o755)


@pytest.fixture
def site(tmp_path):
    """A folder holding a copy of the package (without caches); writable again afterwards."""
    root = str(tmp_path / "site")
    shutil.copytree(os.path.dirname(pfa_numba.__file__), os.path.join(root, "pfa_numba"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    yield root
    _read_only(root, False)


def _run(site, home, tmp):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME", "PYTHONPATH")}
    env.update(PYTHONPATH=site, HOME=home, PYTHONDONTWRITEBYTECODE="1")
    res = subprocess.run([sys.executable, "-c", CALL.format(tmp=tmp)], capture_output=True,
                         text=True, env=env, cwd=site, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_a_warmed_read_only_package_loads_its_kernels(site, tmp_path):
    tmp = str(tmp_path)
    warm = _run(site, str(tmp_path / "build-home"), tmp)
    assert "pfa_numba: compiling the CPU int8 kernel" in warm.stderr
    in_tree = os.path.join(site, "pfa_numba", "cpu", "__pycache__")
    assert f"CACHE True {in_tree}" in warm.stdout
    _read_only(site, True)
    home = str(tmp_path / "home")
    deployed = _run(site, home, tmp)
    assert "compiling" not in deployed.stderr, deployed.stderr
    assert f"CACHE True {home}" in deployed.stdout          # seeded there, loaded from there


def test_with_nothing_writable_calls_compile_and_run(site):
    _read_only(site, True)
    res = _run(site, NOWHERE, NOWHERE)
    assert "CACHE False nowhere" in res.stdout
    assert "pfa_numba: compiling the CPU int8 kernel" in res.stderr
