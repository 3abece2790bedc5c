"""Choose a backend by device and dtype, and explain every refusal.

Each backend declares what it supports; :func:`choose` returns the first that accepts the
problem, or raises one RuntimeError listing every backend's reasons.
"""
import importlib.util

from .frontend import checks

from .numerics.dtypes import dtype_name


def _numba_cuda_installed():
    try:
        return importlib.util.find_spec("numba_cuda") is not None
    except (ImportError, ValueError):
        return False


#: a module that numba-cuda imports when it compiles its first kernel: importing it tells
#: whether numba-cuda can compile with this NumPy (numba-cuda 0.30 cannot with NumPy >= 2.5,
#: which removed np.row_stack)
CUDA_COMPILER_MODULE = "numba.cuda.np.npyimpl"


def _numba_cuda_compile_problem():
    """Why numba-cuda cannot compile a kernel in this environment, or None."""
    try:
        importlib.import_module(CUDA_COMPILER_MODULE)
    except Exception as exc:  # noqa: BLE001 - any failure here would fail every kernel launch
        import numpy
        return (f"numba-cuda cannot compile kernels with NumPy {numpy.__version__} "
                f"({type(exc).__name__}: {exc}); numba-cuda 0.30 needs NumPy < 2.5")
    return None


class Backend:
    """What every backend declares: its devices and dtypes, the reasons it cannot run a problem
    (an empty list when it can), and ``run``."""
    name = ""
    devices = ()
    where = ""                       # the devices in words
    dtypes = ("float16", "bfloat16", "float32", "int8")
    layouts = checks.LAYOUTS
    max_head_dim = checks.MAX_HEAD_DIM

    def environment_problems(self):
        """Why this installation cannot run the backend at all (empty: it can)."""
        return []

    def not_supported_reasons(self, problem, device):
        if device not in self.devices:
            return [f"runs on {self.where}, not on {device!r}"]
        reasons = self.environment_problems()
        if problem is not None and dtype_name(problem.dtype) not in self.dtypes:
            reasons.append(f"dtype {dtype_name(problem.dtype)} is not supported")
        return reasons


class CpuBackend(Backend):
    name = "cpu"
    devices = ("cpu",)
    where = "the CPU"

    def run(self, problem, staged=None):
        """(out, lse or None) as NumPy arrays; CUDA arguments arrive as host copies."""
        from . import cpu
        return cpu.run(problem)

    def prepare(self, problem):
        """The problem's :class:`.cpu.driver.Launch`: ``launch.run()`` is :meth:`run`."""
        from .cpu import driver
        return driver.prepare(problem)


class CudaBackend(Backend):
    name = "cuda"
    devices = ("cuda",)
    where = "CUDA devices"

    def environment_problems(self):
        if not _numba_cuda_installed():
            return ["numba-cuda is not installed (pip install 'pfa_numba[cuda]')"]
        reasons = []
        broken = _numba_cuda_compile_problem()
        if broken:
            reasons.append(broken)
        try:
            from numba import cuda
            if not cuda.is_available():
                reasons.append("no CUDA device (numba.cuda.is_available() is False)")
        except Exception as exc:  # a broken driver must not hide the other reasons
            reasons.append(f"the CUDA driver could not be loaded ({exc})")
        return reasons

    def run(self, problem, staged=None):
        """(out, lse or None): NumPy arrays for NumPy inputs (copied in and out), arrays of the
        query's kind for CUDA inputs (read in place)."""
        from .gpu import launch
        if staged is None or staged.meta is None:
            return launch.run(problem)
        return launch.run(problem, staged.meta, staged.query)


BACKENDS = (CpuBackend(), CudaBackend())


def choose(problem, device):
    """The backend that computes ``problem`` on ``device`` ('cpu' or 'cuda')."""
    reasons = []
    for backend in BACKENDS:
        why = backend.not_supported_reasons(problem, device)
        if not why:
            return backend
        if device in backend.devices:
            reasons.extend(f"{backend.name}: {r}" for r in why)
    raise RuntimeError(f"no pfa_numba backend can run this call on device={device!r}:\n  "
                       + "\n  ".join(reasons))
