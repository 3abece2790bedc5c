"""Every script in examples/ runs and checks itself against the reference."""
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path):
    res = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    if res.stdout.startswith("SKIP:"):
        pytest.skip(res.stdout.strip())
    assert "OK" in res.stdout


def test_there_are_examples():
    assert EXAMPLES
