"""Plans: an operator's call checked and planned once, then run on many query / key / value
arrays of the same geometry (a model's layers), on either target.

:class:`Plan` is the one pattern; ``fia.FiaPlan`` and ``api.PfaPlan`` say which operator they
plan (its signature, how a call is checked and planned, what it returns). A plan's call checks
that the arrays are like the planned ones (kind, dtype, device, shape, strides) and runs the
planned kernels on them: on the CPU the planned :class:`.cpu.driver.Launch` reads NumPy arrays
(and torch CPU tensors) in place; on CUDA the planned :class:`.gpu.launch.Launch` reads CUDA
arrays in place with its small arguments already on the device (no copy, no allocation of its
own, no synchronisation). Arrays the planned kernels cannot read as they read the planned ones
(misaligned, other byte strides), key / value lists and NumPy inputs run on CUDA run whole
calls with the plan's arguments.
"""
import inspect

import numpy as np

from .interop import torch_tensors
from .frontend import checks
from . import dispatch
from .numerics.kernel_args import flat_view, storage
from .interop.cuda_arrays import interface

_QKV = ("query", "key", "value")
#: what a plan runs instead of its planned launch (explain says it of every call)
PLAN_FALLBACK = ("a plan (PfaPlan, FiaPlan) runs whole calls for arrays its planned kernels "
                 "cannot read as planned (other strides, misaligned rows, key / value lists, "
                 "NumPy inputs on CUDA)")


class Plan:
    """A call of ``operator`` checked and planned once (see the module docstring). Subclasses
    set ``operator`` and define :meth:`_checked`, :meth:`_results` and, where the operator has
    such, :meth:`_read_at_each_call`."""
    operator = None

    def __init__(self, query, key, value, *args, **kwargs):
        arguments = self._bound(query, key, value, *args, **kwargs)
        problem, staged, self._lse_flag, device = self._checked(arguments)
        choice = dispatch.choose(problem, device, staged)
        self._launch = self._prepare(choice, problem, staged, (query, key, value))
        given = {name: x for name, x in arguments.items() if name not in _QKV}
        read_in_place = self._read_at_each_call(given)
        self._kwargs = {name: x if name in read_in_place else _snapshot(x)
                        for name, x in given.items()}
        self._like = tuple(_like(x) for x in (query, key, value))

    @classmethod
    def explain(cls, query, key, value, *args, compute_capability=None, sms=None, **kwargs):
        """Which kernel ``operator(query, key, value, *args, **kwargs)`` gets, what can run
        beside it or instead, and why every other kernel of its device was not taken, as text
        (the call is checked and planned, raising the operator's errors, and not run). With
        ``compute_capability`` ((major, minor)) and ``sms`` (multiprocessors), a
        ``device="cuda"`` call is explained for such a GPU, none needed here."""
        problem, staged, _, device = cls._checked(
            cls._bound(query, key, value, *args, **kwargs))
        machine = None
        if compute_capability is not None or sms is not None:
            machine = dict(compute_capability=compute_capability, sms=sms)
        choice = dispatch.choose(problem, device, staged, machine)
        choice.fallbacks.append(PLAN_FALLBACK)
        return str(choice)

    @classmethod
    def _bound(cls, *args, **kwargs):
        """{name: value} of every argument of an operator call with these arguments."""
        try:
            bound = inspect.signature(cls.operator).bind(*args, **kwargs)
        except TypeError as e:
            hint = checks.spelling_hint(cls.operator, kwargs)
            raise TypeError(f"{cls.__name__} takes {cls.operator.__name__}'s arguments: " + (
                f"got an unexpected keyword argument {hint}" if hint else str(e))) from None
        return {**_defaults(cls.operator), **bound.arguments}

    @classmethod
    def _checked(cls, arguments):
        """(planned problem, staged arrays or None, the lse flag, device) of a call with these
        bound arguments, raising the operator's errors."""
        raise NotImplementedError

    def _read_at_each_call(self, kwargs):
        """The names of the keyword arguments a call reads as they are then (tensors), where
        the others are kept as they were when the plan was made."""
        return ()

    def _results(self, query, out, lse, on_device):
        """What the operator returns for results ``out`` and ``lse`` (``on_device``: arrays of
        the CUDA query's kind already; else NumPy arrays)."""
        raise NotImplementedError

    def _prepare(self, choice, problem, staged, arrays):
        """The planned launch its calls run, or None (whole calls)."""
        if any(isinstance(x, (list, tuple)) for x in arrays):
            return None
        if choice.target.name == "cpu" and (staged is None or staged.meta is None) and \
                not checks.is_cuda_array(arrays[0]):
            return _CpuLaunch.of(choice.prepare(problem), arrays)
        if choice.target.name == "cuda" and staged is not None and staged.meta is not None:
            return _CudaLaunch(choice.prepare(problem, staged))
        return None

    def __call__(self, query, key, value):
        """What the planned call returns on these query, key and value."""
        given = (query, key, value)
        for name, x, like in zip(_QKV, given, self._like):
            _check_like(name, x, like)
        if self._launch is not None:
            results = self._launch.run(given)
            if results is not None:
                return self._results(query, *results, isinstance(self._launch, _CudaLaunch))
        return self.operator(query, key, value, **self._kwargs)


class _CpuLaunch:
    """A planned CPU launch and the byte strides of the query, key and value it reads."""

    def __init__(self, launch, strides):
        self.launch, self.strides = launch, strides

    @classmethod
    def of(cls, launch, arrays):
        """The plan's CPU launch, or None where its kernel reads copies of the arrays (which
        a plan's later arrays could not stand in for)."""
        arrays = [_host_array(name, x) for name, x in zip(_QKV, arrays)]
        if launch.kernel is not None:
            flats = (launch.args.q, launch.args.k, launch.args.v)
            if any(not _same_memory(_flat(x), f) for x, f in zip(arrays, flats)):
                return None
        return cls(launch, tuple(x.strides for x in arrays))

    def run(self, given):
        """(out, lse) over the given arrays' memory, or None where the kernels cannot read them
        as they read the planned ones (misaligned, other byte strides: a torch tensor NumPy
        cannot see in place has others). Raises what the whole call raises for an array it
        refuses (a masked array, a tensor that requires grad)."""
        arrays = [_host_array(name, x) for name, x in zip(_QKV, given)]
        if not all(x.flags.aligned and x.strides == s for x, s in zip(arrays, self.strides)):
            return None
        return self.launch.run(*(_flat(x) for x in arrays))


class _CudaLaunch:
    """A planned CUDA launch with its small arguments on the device, and the CUDA array
    argument names its query, key and value pointers replace."""

    def __init__(self, launch):
        from .gpu import device
        self.launch = launch
        if not self.launch.empty:
            self.launch.keep_arguments(device.caller_stream(None))

    def run(self, given):
        """(out, lse) queued on the caller's stream, or None where the kernel chosen cannot
        read these arrays (their pointers' alignment)."""
        if self.launch.empty:
            return self.launch.run(given[0])
        pointers = dict(self.launch.pointers)
        pointers.update((name, interface(x, name)[3]) for name, x in zip(_QKV, given))
        if not self.launch.aligned(pointers):
            return None
        return self.launch.run(given[0], pointers)


def _defaults(fn):
    """{name: default} of ``fn``'s parameters that have one."""
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _host_array(name, x):
    """A host tensor argument as the whole call's checks read it: a torch CPU tensor as the
    NumPy array over its memory, an ndarray subclass as the plain array over its memory; the
    whole call's error for what they refuse."""
    if torch_tensors.is_cpu_tensor(x):
        x = torch_tensors.as_numpy(name, x)
    return checks.check_array(name, x)


def _snapshot(x):
    """A copy of a small argument (lengths, a table, scales) as it is now."""
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, (list, tuple)):
        return type(x)(_snapshot(e) for e in x)
    return x.clone() if torch_tensors.is_cpu_tensor(x) else x


def _like(x):
    """What a plan's later arrays must share with ``x``: (kind, device, dtype, shape, strides);
    a key / value list only its kind and length (the whole call checks its elements)."""
    if isinstance(x, (list, tuple)):
        return type(x).__name__, None, None, (len(x),), None
    if torch_tensors.is_tensor(x):
        return "torch tensor", str(x.device), str(x.dtype), tuple(x.shape), x.stride()
    if isinstance(x, np.ndarray):
        return "NumPy array", "cpu", str(x.dtype), x.shape, x.strides
    if not checks.is_cuda_array(x):
        return type(x).__name__, None, None, None, None
    return (type(x).__name__, "cuda", str(x.dtype), tuple(x.shape), getattr(x, "strides", None))


def _check_like(name, x, like):
    got = _like(x)
    if got == like:
        return
    error = TypeError if (got[0], got[2]) != (like[0], like[2]) else RuntimeError
    raise error(f"{name} must be a {_described(like)} like the plan's, got a {_described(got)}")


def _described(like):
    kind, device, dtype, shape, strides = like
    if dtype is None:
        return kind if shape is None else f"{kind} of {shape[0]} elements"
    return (f"{dtype} {kind} on {device}, of shape {checks.shape_str(shape)} and strides "
            f"{strides}")


def _flat(x):
    """The flat storage the kernels read array ``x`` through (:func:`numerics.kernel_args.flat_view`)."""
    return flat_view(x, storage(x.dtype))[0]


def _same_memory(a, b):
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and \
        a.size == b.size
