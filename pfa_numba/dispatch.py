"""Which kernel computes a call, and why every other one does not.

Every kernel variant is an object (:class:`.variant.Kernel`) of its device's module
(``cpu.variants``, ``gpu.variants``), listed here in :data:`KERNELS` (each device's in its order
of preference): what it takes, and for what a declaration cannot say, its conditions on the
planned problem and its target's :meth:`Target.situation` (the CPU's division of the work, the
GPU's compute capability and pointers). One rule, :func:`choose`, takes the first kernel of the
call's device that nothing rules out (:meth:`.variant.Kernel.not_supported_reasons`); its
:class:`Choice` runs the call on that kernel's own launch and says why each other kernel was not
taken and what can run beside it (``str(choice)``, :func:`explain` for a call's arguments).
"""
import dataclasses
import importlib
import importlib.util
import logging
from typing import Any

from .cpu import variants as cpu_variants
from .gpu import variants as gpu_variants
from .variant import CACHE_FORMS, EXTENSIONS, FLOATS, HALVES, Kernel, cache_forms, extensions

__all__ = ["CACHE_FORMS", "EXTENSIONS", "FLOATS", "HALVES", "KERNELS", "Kernel", "TARGETS",
           "Choice", "cache_forms", "choose", "extensions", "kernel"]

#: why a call gets its kernel (DEBUG; what ran: the devices' logs, INFO)
log = logging.getLogger("pfa_numba.dispatch")
#: the CUDA feature the mma.bf16 and cp.async instructions need
SM80 = gpu_variants.SM80

#: every kernel, each device's in its order of preference
KERNELS = cpu_variants.KERNELS + gpu_variants.KERNELS


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

    def environment_problems(self, machine=None):
        """Why this installation cannot run the target at all (empty: it can); ``machine``:
        a described machine (:func:`choose`), not this one."""
        return []

    def features(self, situation=None):
        """The machine features present (of those kernels declare), as far as ``situation``
        (None: ask the machine) tells."""
        return set()

    def situation(self, problem, staged=None, machine=None):
        """What the kernels' conditions read of ``problem`` here (or on ``machine``)."""
        return None

    def kernels(self, operation="forward"):
        return tuple(k for k in KERNELS if k.device == self.name and k.operation == operation)

    def run(self, launch, staged):
        """(out, lse or None) of a prepared launch."""
        return launch.run()


class CpuTarget(Target):
    name = "cpu"
    where = "the CPU"

    def features(self, situation=None):
        from .cpu import _amx, _gemm
        return ({"AMX"} if _amx.available() else set()) | \
            ({cpu_variants.AVX512} if _gemm.available() else set())

    def situation(self, problem, staged=None, machine=None):
        from .cpu import driver
        return driver.divide(problem)


class CudaTarget(Target):
    name = "cuda"
    where = "CUDA devices"

    def environment_problems(self, machine=None):
        if not _numba_cuda_installed():
            return ["numba-cuda is not installed (the cuda extra: python -m pip install -e "
                    "'.[cuda]' in a checkout)"]
        reasons = []
        broken = _numba_cuda_compile_problem()
        if broken:
            reasons.append(broken)
        if machine:
            return reasons
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

    def situation(self, problem, staged=None, machine=None):
        from .gpu import launch
        machine = machine or {}
        return launch.Situation.of(problem, staged.meta if staged is not None else None,
                                   cc=machine.get("compute_capability"), sms=machine.get("sms"))

    def run(self, launch, staged):
        """NumPy results for NumPy inputs (copied in and out), arrays of the query's kind for
        CUDA inputs (read in place)."""
        if staged is None or staged.meta is None:
            return launch.run()
        return launch.run(staged.query)


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
    fallbacks: list                  # what can run instead of the kernel or beside it

    def prepare(self, problem, staged=None):
        """The chosen kernel's launch of ``problem`` (``launch.run`` computes it)."""
        return self.kernel.prepare(problem, self.situation, staged)

    def run(self, problem, staged=None):
        """(out, lse or None) of ``problem`` on the chosen kernel."""
        return self.target.run(self.prepare(problem, staged), staged)

    def __str__(self):
        lines = [f"the {self.target.name} {self.kernel.name} kernel runs this call: "
                 f"{self.kernel.does}"]
        lines += [f"  and: {what}" for what in self.fallbacks]
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


def choose(problem, device, staged=None, machine=None, operation="forward"):
    """The :class:`Choice` of planned problem ``problem`` on ``device`` ('cpu' or 'cuda'):
    its first kernel of ``operation`` ('forward', or 'backward': the SDPA drop-in's
    gradients) that nothing rules out, or a RuntimeError with every kernel's reasons.
    ``machine``: for CUDA, a device described by ``compute_capability`` and ``sms`` (the
    choice such a device would make, here, without one)."""
    target = TARGETS[device]
    broken = target.environment_problems(machine)
    if broken:
        raise RuntimeError(f"no pfa_numba kernel can run this call on device={device!r}:\n  "
                           + "\n  ".join(f"{device}: {r}" for r in broken))
    situation = target.situation(problem, staged, machine)
    kernels = target.kernels(operation)
    reasons = {k.name: reasons_against(k, problem, situation) for k in kernels}
    chosen = next((k for k in kernels if not reasons[k.name]), None)
    if chosen is None:
        raise RuntimeError(f"no pfa_numba kernel can run this call on device={device!r}:\n  "
                           + "\n  ".join(f"{name}: {'; '.join(why)}"
                                         for name, why in reasons.items()))
    choice = Choice(chosen, target, situation, reasons, chosen.fallbacks(problem, situation))
    log.debug("%s", choice)
    return choice
