"""Numba's cache of the kernels: where it is, and saying so when a call compiles.

A call whose kernel is not in the cache compiles it (tens of seconds a kernel on a small
machine, docs/performance.md) and caches it; later processes load it in well under a second.
While a call compiles, :class:`compile_notice` has the first compilation Numba starts
announced once, on stderr: what compiles, for what, that it happens once per machine, and
where the cache is (config.COMPILE_NOTICES = False silences it).
"""
import contextvars
import dataclasses
import sys

from numba.core import event

from . import config


@dataclasses.dataclass
class Compiling:
    """What a call compiles, in words: its device, kernel, storage and layout."""
    device: str
    kernel: str
    storage: str
    layout: str

    def __str__(self):
        return f"the {self.device} {self.kernel} kernel for {self.storage}, {self.layout}"


def cache_folder():
    """The folder Numba caches pfa_numba's CPU kernels in."""
    from .cpu.float_tiles import avx512_tiles
    return avx512_tiles._cache._cache_path


@dataclasses.dataclass
class _Notice:
    what: str
    said: bool = False


_CURRENT = contextvars.ContextVar("pfa_numba_compiling", default=None)
_announced = set()


class compile_notice:
    """While a call runs inside, the first compilation Numba starts (its cache had no code for
    this call) is announced once (:func:`announce`); ``what``: a :class:`Compiling`."""

    def __init__(self, what):
        self.what = what

    def __enter__(self):
        self._token = _CURRENT.set(_Notice(str(self.what)))

    def __exit__(self, *exc):
        _CURRENT.reset(self._token)


def announce(what):
    """Tell the user, once per process and ``what``, that it compiles now."""
    if not config.COMPILE_NOTICES or what in _announced:
        return
    _announced.add(what)
    print(f"pfa_numba: compiling {what} (once per machine; cached in {cache_folder()}; "
          "`python -m pfa_numba warmup` compiles every kernel ahead, "
          "pfa_numba.config.COMPILE_NOTICES = False silences this)", file=sys.stderr,
          flush=True)


class _Listener(event.Listener):
    def on_start(self, event):
        notice = _CURRENT.get()
        if notice is not None and not notice.said:
            notice.said = True
            announce(notice.what)

    def on_end(self, event):
        pass


event.register("numba:compile", _Listener())
