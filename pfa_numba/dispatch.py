"""Which kernel computes a call, and why every other one does not.

Every kernel variant is declared here (:data:`KERNELS`, each device's in its order of
preference): what it takes (dtypes, head dims, layouts, kv cache forms, machine features, the
config switch that turns it off) and, for what a declaration cannot say, a function of the
planned problem and its target's :meth:`Target.situation` (the CPU's division of the work, the
GPU's compute capability and pointers). One rule, :func:`choose`, takes the first kernel of the
call's device that nothing rules out (:meth:`Kernel.not_supported_reasons`); its
:class:`Choice` runs the call and says why each other kernel was not taken (``str(choice)``,
:func:`explain` for a call's arguments, the ``pfa_numba.cuda`` log line).
"""
import dataclasses
import importlib
import importlib.util
from typing import Any, Callable, Optional

from . import config
from .frontend import checks
from .gpu import HEAD_DIMS as CUDA_MMA_HEAD_DIMS
from .numerics.dtypes import dtype_name

FLOATS = ("float16", "bfloat16", "float32")
HALVES = ("float16", "bfloat16")
#: the forms of fused_infer_attention_score's kv cache a kernel may walk, in words (contiguous
#: and left-padded key / value every kernel reads)
CACHE_FORMS = {"paged": "a paged kv cache", "prefix": "a shared prefix",
               "int8": "an int8 kv cache"}
#: the CUDA feature the mma.bf16 and cp.async instructions need
SM80 = "compute capability 8.0"
#: the score terms the SDPA drop-in adds to the operators' (extensions, in a problem's
#: ``softcap`` and ``sinks``)
EXTENSIONS = {"softcap": "softcapped scores", "sinks": "attention sinks"}


def cache_forms(problem):
    """The :data:`CACHE_FORMS` of planned problem ``problem``'s kv cache."""
    c = problem.cache
    if c is None:
        return ()
    present = {"paged": c.block_table is not None, "prefix": c.P > 0,
               "int8": c.antiquant is not None}
    return tuple(form for form in CACHE_FORMS if present[form])


def extensions(problem):
    """The :data:`EXTENSIONS` planned problem ``problem`` takes."""
    present = {"softcap": problem.softcap != 0, "sinks": problem.sinks is not None}
    return tuple(x for x in EXTENSIONS if present[x])


def _from(module, function):
    """``module.function`` (a kernel's module, imported at the first use: it loads that
    target's compiler)."""
    def conditions(problem, situation):
        return getattr(importlib.import_module(module, __package__), function)(problem, situation)
    conditions.__qualname__ = f"{module}.{function}"
    return conditions


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel variant: the device it runs on, what it does, and what it takes."""
    name: str
    device: str                               # 'cpu' or 'cuda'
    does: str                                 # in a line, for explanations and ``info``
    dtypes: tuple = FLOATS + ("int8",)        # query storage
    head_dims: tuple = ()                     # (): any the contract allows
    layouts: tuple = checks.LAYOUTS
    caches: tuple = tuple(CACHE_FORMS)
    features: tuple = ()                      # of the machine (Target.features)
    extensions: tuple = tuple(EXTENSIONS)     # of the SDPA drop-in's score terms it computes
    switch: str = ""                          # the config attribute that turns it off
    conditions: Optional[Callable] = None     # (problem, situation) -> [reasons]

    def not_supported_reasons(self, problem=None, situation=None, features=()):
        """Why this kernel cannot run planned problem ``problem`` (None: any problem) on a
        machine with ``features``: [] when it can."""
        reasons = [f"needs {f}, which this machine lacks" for f in self.features
                   if f not in features]
        if self.switch and not getattr(config, self.switch):
            reasons.append(f"config.{self.switch} is False")
        if problem is None:
            return reasons
        dtype = dtype_name(problem.dtype)
        if dtype not in self.dtypes:
            reasons.append(f"{dtype} inputs (it takes {', '.join(self.dtypes)})")
        if self.head_dims and problem.D not in self.head_dims:
            reasons.append(f"head dim {problem.D} (it takes "
                           f"{', '.join(map(str, self.head_dims))})")
        if problem.layout not in self.layouts:
            reasons.append(f"layout {problem.layout} (it takes {', '.join(self.layouts)})")
        reasons += [f"{CACHE_FORMS[form]} (it reads contiguous key / value)"
                    for form in cache_forms(problem) if form not in self.caches]
        reasons += [f"{EXTENSIONS[x]} (it does not compute them)"
                    for x in extensions(problem) if x not in self.extensions]
        if not reasons and self.conditions is not None:
            reasons += self.conditions(problem, situation)
        return reasons


#: every kernel, each device's in its order of preference
KERNELS = (
    Kernel("int8", "cpu", "int8 query, key and value: int8 products on BLAS, the softmax "
           "quantized against its row max", dtypes=("int8",), caches=(), extensions=()),
    Kernel("split-kv", "cpu", "the float32 tiles over pieces of the kv range, run side by side "
           "and merged by the online-softmax rule: calls with fewer rows than threads",
           dtypes=FLOATS, conditions=_from(".cpu.driver", "split_kv_reasons")),
    Kernel("streaming", "cpu", "decode: the few query rows of a kv head's G heads read each "
           "K / V row once, as it streams", dtypes=FLOATS,
           conditions=_from(".cpu.driver", "streaming_reasons")),
    Kernel("amx", "cpu", "float16 / bfloat16 tile products on AMX tiles", dtypes=HALVES,
           caches=("paged", "prefix"), features=("AMX",), switch="CPU_AMX",
           conditions=_from(".cpu.driver", "amx_reasons")),
    Kernel("float32-tiles", "cpu", "tiles of query rows x kv columns in float32, the products "
           "on AVX-512 register blocks or BLAS sgemm", dtypes=FLOATS),
    Kernel("decode", "cuda", "split-kv decode on tensor cores: one block a kv head's G x Sq "
           "<= 16 rows, its kv range split across the multiprocessors", dtypes=HALVES,
           head_dims=CUDA_MMA_HEAD_DIMS, layouts=tuple(x for x in checks.LAYOUTS if x != "TND"),
           features=(SM80,), switch="CUDA_TENSOR_CORES",
           conditions=_from(".gpu.launch", "decode_reasons")),
    Kernel("tensor-core", "cuda", "mma.sync m16n8k16 tiles of 64 query rows x 64 keys, K / V "
           "through a cp.async pipeline", dtypes=HALVES, head_dims=CUDA_MMA_HEAD_DIMS,
           features=(SM80,), switch="CUDA_TENSOR_CORES",
           conditions=_from(".gpu.launch", "tensor_core_reasons")),
    Kernel("portable", "cuda", "one thread a query row, every dtype and feature"),
)


def kernel(device, name):
    """The declared kernel ``name`` of ``device``."""
    return next(k for k in KERNELS if k.device == device and k.name == name)


# ---------------------------------------------------------------------------------------------
# the targets: their environment, machine features and situation, and how they run a choice
# ---------------------------------------------------------------------------------------------

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


class Target:
    """A device's kernels: why this installation cannot run them at all, the machine's
    features, a problem's situation (what the kernels' conditions read), running a choice."""
    name = ""
    where = ""                       # the device in words

    def environment_problems(self):
        """Why this installation cannot run the target at all (empty: it can)."""
        return []

    def features(self, situation=None):
        """The machine features present (of those kernels declare), as far as ``situation``
        (None: ask the machine) tells."""
        return set()

    def situation(self, problem, staged=None):
        """What the kernels' conditions read of ``problem`` here (None: nothing)."""
        return None

    def kernels(self):
        return tuple(k for k in KERNELS if k.device == self.name)


class CpuTarget(Target):
    name = "cpu"
    where = "the CPU"

    def features(self, situation=None):
        from .cpu import _amx
        return {"AMX"} if _amx.available() else set()

    def situation(self, problem, staged=None):
        from .cpu import driver
        return driver.divide(problem)

    def prepare(self, problem, choice):
        """The problem's :class:`.cpu.driver.Launch`: ``launch.run()`` is :meth:`run`."""
        from .cpu import driver
        return driver.prepare(problem, choice.kernel.name, choice.situation)

    def run(self, problem, staged, choice):
        """(out, lse or None) as NumPy arrays; CUDA arguments arrive as host copies."""
        return self.prepare(problem, choice).run()


class CudaTarget(Target):
    name = "cuda"
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

    def features(self, situation=None):
        if situation is None:
            from .gpu import device
            cc = tuple(device.compute_capability())
        else:
            cc = situation.cc
        return {SM80} if cc >= (8, 0) else set()

    def situation(self, problem, staged=None):
        from .gpu import launch
        return launch.Situation.of(problem, staged.meta if staged is not None else None)

    def run(self, problem, staged, choice):
        """(out, lse or None): NumPy arrays for NumPy inputs (copied in and out), arrays of the
        query's kind for CUDA inputs (read in place)."""
        from .gpu import launch
        if staged is None or staged.meta is None:
            return launch.prepare(problem, None, choice).run()
        return launch.prepare(problem, staged.meta, choice).run(staged.query)


TARGETS = {"cpu": CpuTarget(), "cuda": CudaTarget()}


# ---------------------------------------------------------------------------------------------
# the rule
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Choice:
    """The kernel a planned problem gets, its target and situation, and every kernel of the
    device with the reasons it was not taken (none: it could have run, a kernel before it
    was preferred)."""
    kernel: Kernel
    target: Target
    situation: Any
    reasons: dict                    # {kernel name: [reasons]}, every kernel of the device

    def run(self, problem, staged=None):
        return self.target.run(problem, staged, self)

    def prepare(self, problem):
        return self.target.prepare(problem, self)

    def __str__(self):
        lines = [f"the {self.target.name} {self.kernel.name} kernel runs this call: "
                 f"{self.kernel.does}"]
        for name, why in self.reasons.items():
            if name != self.kernel.name:
                lines.append(f"  not {name}: " + ("; ".join(why) if why else
                                                  f"it could; {self.kernel.name} comes first"))
        return "\n".join(lines)


def reasons_against(kernel, problem, situation):
    """Why ``kernel`` cannot run planned problem ``problem`` in its target's ``situation``
    (``Target.situation``): [] when it can."""
    target = TARGETS[kernel.device]
    return kernel.not_supported_reasons(problem, situation, target.features(situation))


def choose(problem, device, staged=None):
    """The :class:`Choice` of planned problem ``problem`` on ``device`` ('cpu' or 'cuda'):
    its first kernel that nothing rules out, or a RuntimeError with every kernel's reasons."""
    target = TARGETS[device]
    broken = target.environment_problems()
    if broken:
        raise RuntimeError(f"no pfa_numba kernel can run this call on device={device!r}:\n  "
                           + "\n  ".join(f"{device}: {r}" for r in broken))
    situation = target.situation(problem, staged)
    reasons = {k.name: reasons_against(k, problem, situation) for k in target.kernels()}
    chosen = next((k for k in target.kernels() if not reasons[k.name]), None)
    if chosen is None:
        raise RuntimeError(f"no pfa_numba kernel can run this call on device={device!r}:\n  "
                           + "\n  ".join(f"{name}: {'; '.join(why)}"
                                         for name, why in reasons.items()))
    return Choice(chosen, target, situation, reasons)
