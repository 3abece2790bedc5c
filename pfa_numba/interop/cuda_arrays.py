"""CUDA arrays without importing numba.cuda: their kind, metadata, and host/device copies.

Any object with ``__cuda_array_interface__`` is a CUDA array; PyTorch tensors are recognised by
their module (a bfloat16 tensor's array interface cannot say bf16, so its dtype comes from
torch). :class:`Meta` lets the planner work on CUDA arrays through metadata-only NumPy arrays.
"""
import functools

import numpy as np

from ..numerics.dtypes import is_bf16
from . import torch_tensors


def checked(name, fn, x):
    """``fn(x)`` for CUDA array argument ``name``, with its failures as the errors of contract
    'Errors': a malformed __cuda_array_interface__ is a TypeError, a missing CUDA driver a
    RuntimeError."""
    try:
        return fn(x)
    except ImportError as exc:         # numba's CudaSupportError: no driver, no device
        raise RuntimeError(f"{name} is a CUDA array ({type(x).__name__}) but CUDA is not "
                           f"usable here: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise TypeError(f"{name} has a malformed __cuda_array_interface__ "
                        f"({type(x).__name__}): {type(exc).__name__}: {exc}") from None


def simulated(x):
    """True for the CUDA simulator's device arrays (NUMBA_ENABLE_CUDASIM=1): they hold host
    memory and have no __cuda_array_interface__."""
    return "simulator" in type(x).__module__


def array_kind(x):
    """'numpy', 'torch', 'cupy', 'numba' or 'cuda' (any other __cuda_array_interface__)."""
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return "torch"
    if mod == "cupy":
        return "cupy"
    if mod == "numba" or hasattr(x, "copy_to_host"):
        return "numba"
    return "cuda"


def interface(x, name="a CUDA array"):
    """(dtype, shape, strides in bytes, device pointer of element 0) of CUDA array ``x``
    (argument ``name``; a torch tensor that requires grad in grad mode is refused, see
    :func:`.torch_tensors.readable`)."""
    return _interface_of(_readable(name, x))


def _readable(name, x):
    """CUDA array ``x`` as its memory is read: a torch tensor through the grad-mode rule."""
    return torch_tensors.readable(name, x) if array_kind(x) == "torch" else x


def _interface_of(x):
    """:func:`interface` of an array :func:`_readable` gave."""
    if array_kind(x) == "torch":
        import torch
        dtype = torch_tensors.numpy_dtype(x)
        cai = (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).__cuda_array_interface__
    else:
        cai = x.__cuda_array_interface__
        dtype = np.dtype(getattr(x, "dtype", cai["typestr"]))
        if np.dtype(cai["typestr"]).itemsize != dtype.itemsize:
            dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if strides is None:
        strides = tuple(int(s) * dtype.itemsize for s in
                        np.cumprod((1,) + shape[:0:-1])[::-1]) if shape else ()
    return dtype, shape, tuple(strides), int(cai["data"][0])


class Meta:
    """NumPy arrays with CUDA arrays' shapes, dtypes and strides over dummy buffers: the planner
    reads only metadata (views, strides), never data, and any view's place in the device memory
    is recovered from its byte offset (:meth:`locate`)."""

    def __init__(self):
        self.roots = {}
        self.pointers = {}               # argument name -> device pointer of its element 0
        self.held = {}                   # argument name -> the array at that pointer

    def make(self, name, x):
        """The metadata-only array of CUDA array argument ``name``. The array is held: one made
        for the call (a converted mask, say) lives until the kernels reading it are queued."""
        x = _readable(name, x)
        dtype, shape, strides, ptr = _interface_of(x)
        self.held[name] = x
        root = np.zeros(1, dtype=dtype)
        meta = np.lib.stride_tricks.as_strided(root, shape=shape, strides=strides,
                                               writeable=False)
        self.roots[id(root)] = (root, meta.__array_interface__["data"][0], name)
        self.pointers[name] = ptr
        return meta

    @staticmethod
    def _root(view):
        # views, and as_strided results (whose .base is a DummyArray with its own .base)
        while getattr(view, "base", None) is not None:
            view = view.base
        return view

    def holds(self, view):
        """Whether ``view`` is a view of an array this Meta made (else it is host memory)."""
        return id(self._root(view)) in self.roots

    def locate(self, view):
        """(argument name, byte offset of ``view``'s first element from that argument's
        element 0) of a view this Meta holds."""
        _, meta_ptr, name = self.roots[id(self._root(view))]
        return name, view.__array_interface__["data"][0] - meta_ptr


def to_kind(x, like):
    """A NumPy result as an array of ``like``'s kind, on its device."""
    kind = array_kind(like)
    if kind == "torch":
        import torch
        if is_bf16(x.dtype):
            return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).to(like.device)
        return torch.from_numpy(np.ascontiguousarray(x)).to(like.device)
    if kind == "cupy":
        import cupy
        return cupy.asarray(x)
    return numba_device_array(x)


def numba_device_array(x):
    """A NumPy array copied to a new Numba device array of its dtype. bfloat16 goes as its
    uint16 bits: numba-cuda's host-to-device copy needs a buffer format, which ml_dtypes'
    bfloat16 has none of ("cannot include dtype 'E' in a buffer" on a GPU)."""
    from numba import cuda
    x = np.ascontiguousarray(x)
    if is_bf16(x.dtype):
        return cuda.to_device(x.view(np.uint16)).view(x.dtype)
    return cuda.to_device(x)


def to_host(x):
    """A CUDA array's contents as a NumPy array (bf16 as ml_dtypes.bfloat16)."""
    kind = array_kind(x)
    if kind == "torch":
        import torch
        if x.dtype == torch.bfloat16:
            import ml_dtypes
            return x.detach().view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
        return x.detach().cpu().numpy()
    if kind == "cupy":
        return x.get()
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    from numba import cuda
    return cuda.as_cuda_array(x).copy_to_host()


class Staged:
    """The CUDA array arguments of a call, made readable by the host-side checks and planner:
    host copies (``device='cpu'``, or the CUDA simulator's arrays, which hold host memory) or
    metadata-only arrays over the device memory (:class:`Meta`), which the CUDA backend reads
    in place."""

    def __init__(self, call, device):
        self.query = call.query
        self.copied = device == "cpu" or simulated(call.query)
        self.meta = None if self.copied else Meta()
        self.call = call.with_arrays({name: checked(name, self._readable(name), x)
                                      for name, x in call.tensors().items() if x is not None})

    def _readable(self, name):
        """How argument ``name`` is made readable on the host."""
        return to_host if self.copied else functools.partial(self.meta.make, name)

    def results(self, out, lse):
        """The results as arrays of the query's kind (those computed on host copies are copied
        to the device; the CUDA backend's are already there)."""
        if not self.copied:
            return out, lse
        return to_kind(out, self.query), (None if lse is None else to_kind(lse, self.query))
