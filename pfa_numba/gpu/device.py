"""Where a CUDA call reaches numba-cuda: devices, streams, device memory, copies, launches.

Every device operation of a call goes through these functions, and nothing else of the package
calls numba-cuda's runtime: what one call does on the device (allocations, copies,
synchronisations, launches) is what passes here, and tests/test_launch_counts.py counts it by
replacing them. Kernels are compiled lazily, at their first launch.
"""
import numba
import numpy as np
from numba import cuda

from ..interop.cuda_arrays import array_kind


def compute_capability():
    """(major, minor) of the current device."""
    return cuda.get_current_device().compute_capability


def multiprocessor_count():
    """Streaming multiprocessors of the current device (None where it does not say: the CUDA
    simulator)."""
    return getattr(cuda.get_current_device(), "MULTIPROCESSOR_COUNT", None)


def library_device(like):
    """The ordinal of the GPU a torch or CuPy array lives on (None: the current one)."""
    kind = array_kind(like)
    if kind == "torch":
        return like.device.index
    if kind == "cupy":
        return like.device.id
    return None


def select(ordinal):
    """Make GPU ``ordinal`` numba-cuda's current device, when it is not already (a call on a
    tensor of another GPU launches there); None leaves the current one."""
    if ordinal is not None and cuda.get_current_device().id != ordinal:
        cuda.select_device(ordinal)


def caller_stream(like):
    """The stream a call on ``like`` runs on: the current stream of its array library (torch,
    CuPy), a Numba device array's own stream, else Numba's default stream (NumPy inputs)."""
    kind = array_kind(like) if like is not None else None
    handle = 0
    if kind == "torch":
        import torch
        handle = torch.cuda.current_stream(like.device).cuda_stream
    elif kind == "cupy":
        import cupy
        handle = cupy.cuda.get_current_stream().ptr
    elif kind == "numba" and getattr(like, "stream", 0):
        return like.stream
    return cuda.external_stream(handle) if handle else cuda.default_stream()


def stream_key(stream):
    """A hashable name of ``stream`` (its handle; 0 for the default stream)."""
    handle = getattr(stream, "handle", None)
    value = getattr(handle, "value", handle)
    try:
        return int(value) if value is not None else 0
    except (TypeError, ValueError):
        return id(stream)


class _Span:
    """``n`` values of ``dtype`` at device pointer ``ptr``, as __cuda_array_interface__."""

    def __init__(self, ptr, n, dtype):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": np.dtype(dtype).str,
                                         "data": (ptr, False), "version": 3, "strides": None}


def span(ptr, n, dtype):
    """A flat Numba device array over ``n`` values of ``dtype`` at device pointer ``ptr`` (memory
    the caller owns: the kernel reads it in place)."""
    return cuda.as_cuda_array(_Span(ptr, n, dtype), sync=False)


def as_device(x):
    """A CUDA array (anything with __cuda_array_interface__) as a Numba device array over its
    memory, without synchronising on the stream that made it (the call runs on that stream)."""
    return cuda.as_cuda_array(x, sync=False)


def empty(n, dtype, stream):
    """A new flat device array of ``n`` values."""
    return cuda.device_array(n, dtype=dtype, stream=stream)


def upload(host, stream):
    """A new device array holding the host array ``host``, copied on ``stream`` (the copy is
    queued behind the stream's work: the host array may change once this returns)."""
    return cuda.to_device(np.ascontiguousarray(host), stream=stream)


def copy_in(device_array, host, stream):
    """Copy host bytes ``host`` into the start of the device byte array ``device_array`` on
    ``stream`` (queued in stream order; pageable host memory is staged before this returns)."""
    device_array[:host.size].copy_to_device(host, stream=stream)


def download(device_array, host, stream):
    """Copy ``device_array`` into the host array ``host`` on ``stream``."""
    device_array.copy_to_host(host, stream=stream)


def synchronize(stream):
    """Wait for everything queued on ``stream`` (NumPy results are finished arrays)."""
    stream.synchronize()


def launch(kernel, grid, block, stream, args):
    """Launch ``kernel`` on ``stream`` (asynchronously)."""
    kernel[grid, block, stream](*args)


def mark(stream):
    """An event recorded on ``stream`` now: done once the work queued before it has run (None
    under the CUDA simulator, which runs each launch to its end)."""
    if numba.config.ENABLE_CUDASIM:
        return None
    event = cuda.event(timing=False)
    event.record(stream)
    return event


def done(event):
    """Whether the work before ``event`` has run (without waiting)."""
    return event is None or event.query()
