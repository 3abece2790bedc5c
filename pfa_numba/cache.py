"""Numba's cache of the kernels: where it is, where users deploy it, and saying so when a call
compiles.

Where. Numba caches a function's compiled code next to its module (``__pycache__``) where
that folder is writable, else in ``NUMBA_CACHE_DIR`` or the user's cache folder, and reads a
cache only where it could write it. pfa_numba adds one rule for its own modules: where the
package folder is read-only (a deployment image warmed at build time, then run read-only), its
kernels are cached in a writable folder (NUMBA_CACHE_DIR's rule first, then the user's cache
folder, then one in the temporary folder), and each kernel's code found in the package's own
``__pycache__`` is copied there before Numba looks: a warmed image's kernels load, nothing
compiles. Where nothing at all is writable, nothing is cached (:data:`CACHE` False): every
process compiles what it runs, and ``import pfa_numba`` works. docs/deployment.md says the
same for users.

Saying so. A call whose kernel is not in the cache compiles it (seconds to a minute a kernel on
a small machine, docs/performance.md) and caches it; later processes load it in well under a
second. While a call compiles, :class:`compile_notice` has the first compilation Numba starts
announced once, on stderr: what compiles, for what, that it happens once per machine, and
where the cache is (config.COMPILE_NOTICES = False silences it).
"""
import contextvars
import dataclasses
import functools
import glob
import os
import shutil
import sys
import tempfile

import numba
from numba.core import caching, event

from . import config

#: the package's folder
PACKAGE = os.path.dirname(os.path.abspath(__file__))

_UserWide = getattr(caching, "UserWideCacheLocator", None) or \
    getattr(caching, "_UserWideCacheLocator")
_Impl = getattr(caching, "_CacheImpl", None) or getattr(caching, "CacheImpl")


@functools.lru_cache(maxsize=None)
def writable(path):
    """Whether a file can be made in folder ``path`` (made where missing)."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def _own_root():
    """The folder pfa_numba's kernels are cached in where its package folder is read-only:
    NUMBA_CACHE_DIR, else the user's cache folder, else one in the temporary folder; None
    where none is writable."""
    candidates = [numba.config.CACHE_DIR] if numba.config.CACHE_DIR else []
    candidates += [os.path.join(_user_cache_dir(), "pfa_numba"),
                   os.path.join(tempfile.gettempdir(), f"pfa_numba-cache-{_user()}")]
    return next((root for root in candidates if writable(root)), None)


def _user_cache_dir():
    """Numba's user-wide cache folder (where its UserWideCacheLocator would cache)."""
    probe = _UserWide(_user_cache_dir, __file__)
    return os.path.dirname(probe.get_cache_path())


def _user():
    return os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")


class _ReadOnlyPackageLocator(_UserWide):
    """Numba's cache locator for a function of pfa_numba where its package folder is read-only:
    the folder of :func:`_own_root`, seeded with the function's code from the package's own
    ``__pycache__`` (a warmed image's)."""

    def __init__(self, py_func, py_file):
        super().__init__(py_func, py_file)
        self._cache_path = os.path.join(ROOT, self.get_suitable_cache_subpath(py_file))
        self._seed(py_func, py_file)

    def _seed(self, py_func, py_file):
        """Copy the function's index and data files from the package's ``__pycache__`` where
        this folder has none (Numba's names: module.qualname-line.pyXY.nbi / .N.nbc)."""
        stem = os.path.splitext(os.path.basename(py_file))[0]
        qualname = getattr(py_func, "__qualname__", py_func.__name__)
        base = f"{stem}.{qualname}-{py_func.__code__.co_firstlineno}.py".replace("<", "") \
            .replace(">", "")
        source = os.path.join(os.path.dirname(py_file), "__pycache__")
        if glob.glob(os.path.join(glob.escape(self._cache_path), glob.escape(base) + "*.nbi")):
            return
        try:
            os.makedirs(self._cache_path, exist_ok=True)
            for path in glob.glob(os.path.join(glob.escape(source), glob.escape(base) + "*.nb*")):
                shutil.copy2(path, self._cache_path)
        except OSError:
            pass                     # nothing seeded: the function compiles, then caches here

    @classmethod
    def from_function(cls, py_func, py_file):
        if ROOT is None or not _in_package(py_file) or \
                writable(os.path.join(os.path.dirname(py_file), "__pycache__")):
            return None              # Numba's own rules
        return super().from_function(py_func, py_file)


def _in_package(path):
    path = os.path.abspath(path)
    return os.path.commonpath([path, PACKAGE]) == PACKAGE


#: the folder of pfa_numba's kernels where its package folder is read-only (None: nowhere)
ROOT = None if writable(os.path.join(PACKAGE, "__pycache__")) else _own_root()
#: whether pfa_numba's kernels are cached at all (False: nothing is writable)
CACHE = bool(numba.config.CACHE_DIR) or ROOT is not None or \
    writable(os.path.join(PACKAGE, "__pycache__"))
if ROOT is not None:
    _Impl._locator_classes.insert(0, _ReadOnlyPackageLocator)


def cache_folder():
    """The folder Numba caches pfa_numba's CPU kernels in (a description where there is
    none)."""
    if not CACHE:
        return "nowhere (no writable folder: every process compiles what it runs)"
    cpu = os.path.join(PACKAGE, "cpu")
    sub = _UserWide.get_suitable_cache_subpath(os.path.join(cpu, "launch.py"))
    if ROOT is not None or numba.config.CACHE_DIR:
        return os.path.join(ROOT or numba.config.CACHE_DIR, sub)
    return os.path.join(cpu, "__pycache__")


# ---------------------------------------------------------------------------------------------
# saying so while a call compiles
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Compiling:
    """What a call compiles, in words: its device, kernel, storage and layout."""
    device: str
    kernel: str
    storage: str
    layout: str

    def __str__(self):
        return f"the {self.device} {self.kernel} kernel for {self.storage}, {self.layout}"


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
