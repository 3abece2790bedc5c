"""README's two set-up commands stay true, and CI runs exactly the README's test command."""
import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent


def _commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_has_the_two_commands_first():
    cmds = _commands()
    assert cmds[0].endswith("python -m pfa_numba demo")
    extras = re.search(r'pip install -e "\.\[([a-z,]+)\]"', cmds[1])
    assert extras and "test" in extras.group(1).split(",") and "run_tests.py" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _commands()[1] in ci
