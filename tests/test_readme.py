"""README's two set-up commands stay true and come first, CI runs exactly the README's test
command, and every Python block of README runs as written."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(language):
    return re.findall(rf"```{language}\n(.+?)\n```", README, flags=re.S)


def _command(words):
    """The README's bash block holding ``words`` (exactly one)."""
    found = [block for block in _blocks("bash") if words in block]
    assert len(found) == 1, f"{len(found)} bash blocks of README hold {words!r}"
    return found[0]


def test_readme_has_the_two_commands_first():
    demo, tests = _command("python -m pfa_numba demo"), _command("scripts/run_tests.py")
    assert _blocks("bash")[:2] == [demo, tests]
    assert demo == "python -m pip install -e . && python -m pfa_numba demo"
    extras = re.search(r'pip install -e "\.\[([a-z,]+)\]"', tests)
    assert extras and "test" in extras.group(1).split(",")


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _command("scripts/run_tests.py") in ci


def test_the_extras_readme_names_exist():
    from importlib.metadata import metadata
    declared = metadata("pfa_numba").get_all("Provides-Extra")
    named = re.findall(r'pip install -e "\.\[([a-z]+)\]"', README)
    assert set(named) <= set(declared) and {"transformers", "notebooks", "bench"} <= set(named)


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_a_python_block_runs(index):
    block = _blocks("python")[index]
    if "transformers" in block:
        pytest.importorskip("transformers", reason="the transformers extra")
    exec(compile(block, f"README.md python block {index}", "exec"), {})
