"""The package as users get it outside a checkout: ``python -m build`` gives a wheel that
installs and runs the demo (docs/deployment.md)."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent


def test_the_wheel_installs_and_runs_the_demo(tmp_path):
    pytest.importorskip("build", reason="the test extra has build")
    res = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir",
                          str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    wheel, = (tmp_path / "dist").glob("pfa_numba-*.whl")
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile",
                          "--target", str(site), str(wheel)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(site), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    where = subprocess.run([sys.executable, "-c", "import pfa_numba; print(pfa_numba.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    demo = subprocess.run([sys.executable, "-m", "pfa_numba", "demo", "--seq", "128",
                           "--repeats", "1"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=900)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-3000:]
    assert "-> OK" in demo.stdout
