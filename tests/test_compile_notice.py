"""Saying so while a call compiles (pfa_numba.cache): the first compilation Numba starts inside
a call is announced on stderr, once per kernel and process; config.COMPILE_NOTICES silences it.
(The deployment-cache and compile-unit tests see the real notices of real compilations.)"""
from numba.core import event

from pfa_numba import cache, config
from pfa_numba.cli import cold


def _compile_event():
    """What Numba broadcasts when a dispatcher starts compiling (its data is not read here)."""
    with event.trigger_event("numba:compile", data={}):
        pass


def test_a_compiling_call_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(cache, "_announced", set())
    what = cache.Compiling("CPU", "streaming", "float16 query, key and value", "BSH")
    for _ in range(2):
        with cache.compile_notice(what):
            _compile_event()
            _compile_event()
    err = capsys.readouterr().err
    assert err.count("pfa_numba: compiling") == 1
    assert "the CPU streaming kernel for float16 query, key and value, BSH" in err
    assert "once per machine" in err and cache.cache_folder() in err
    assert "COMPILE_NOTICES = False silences this" in err


def test_nothing_is_said_outside_a_call_or_when_silenced(monkeypatch, capsys):
    monkeypatch.setattr(cache, "_announced", set())
    _compile_event()                                  # a user's own compilation
    monkeypatch.setattr(config, "COMPILE_NOTICES", False)
    with cache.compile_notice(cache.Compiling("CPU", "int8", "int8", "BNSD")):
        _compile_event()
    assert capsys.readouterr().err == ""


def test_the_cold_first_call_programs_are_python():
    """bench's cold-cache programs: each compiles as Python and names its call; the table has a
    row per result."""
    for case in cold.CASES:
        code = cold._program(case)
        compile(code, case, "exec")
        assert 'print("SECONDS"' in code
    table = cold.cold_markdown({"a": (12.0, 13.5, 0.4, 1.1)})
    assert table.splitlines()[-1] == "| a | 12.0 | 13.5 | 0.40 | 1.10 |"
