"""Running a planned problem on the GPU: device arrays in place or copied in, one kernel launch,
results of the query's kind.

Arrays: NumPy inputs with ``device='cuda'`` are copied in (only the memory their views span) and
the result is copied out. CUDA arrays (Numba device arrays, CuPy, PyTorch; anything with
``__cuda_array_interface__``) are read in place, and the result is allocated by the query's
library (zero-copy). Kernels launch on the default stream and the call synchronises before it
returns; callers using other streams should synchronise their producers first.
"""
import logging

import numpy as np
from numba import cuda

from .. import config
from .._kernel_args import L_ROWS, kernel_args
from .arrays import array_kind, to_kind
from .kernels import kernel_for, launch_config

#: the kernel a call gets and why (INFO: why not the tensor-core kernel)
log = logging.getLogger("pfa_numba.cuda")


class _DeviceSpan:
    """A flat read-only span of device memory exposed through __cuda_array_interface__."""

    def __init__(self, ptr, n, dtype, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": np.dtype(dtype).str,
                                         "data": (ptr, False), "version": 3, "strides": None}


def _output_like(query, shape, dtype):
    """An uninitialised CUDA array of the query's library (its bf16 as the library holds it)."""
    kind = array_kind(query)
    if kind == "torch":
        import torch
        tdt = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
               np.dtype(np.int8): torch.int8}.get(np.dtype(dtype), torch.bfloat16)
        return torch.empty(shape, dtype=tdt, device=query.device)
    if kind == "cupy":
        import cupy
        return cupy.empty(shape, dtype=dtype)
    return cuda.device_array(shape, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# running a planned problem
# ---------------------------------------------------------------------------------------------

def run(p, meta=None, query=None):
    """Compute planned problem ``p`` on the GPU.

    ``meta`` is None for NumPy inputs (copied in; NumPy results), or the :class:`.arrays.Meta`
    the plan's arrays were made with (CUDA inputs read in place; results of ``query``'s kind).
    """
    on_device = meta is not None
    out_host = np.empty(p.out_shape, dtype=p.out_dtype)
    lse_host = np.empty(p.lse_shape, dtype=np.float32)
    if out_host.size == 0 or p.B == 0:
        out_host[...] = 0
        lse_host[...] = -np.inf
        return _finish(out_host, lse_host if p.want_lse else None, on_device, query, p)

    a = kernel_args(p, out_host, lse_host)

    def dev(flat, original):
        """The device array a kernel reads: CUDA memory in place, host memory copied in (also
        a CUDA call's host-made arrays, such as gathered key/value lists)."""
        if original is None or not on_device or not meta.holds(original):
            return cuda.to_device(np.ascontiguousarray(flat))
        ptr, owner = meta.device_pointer(flat)
        return cuda.as_cuda_array(_DeviceSpan(ptr, flat.size, flat.dtype, owner))

    d_q, d_k, d_v = dev(a.q, p.q), dev(a.k, p.k), dev(a.v, p.v)
    d_m8 = dev(a.mask8, p.mask if p.mask is not None and p.mask.dtype != np.float16 else None)
    d_m16 = dev(a.mask16, p.mask if p.mask is not None and p.mask.dtype == np.float16 else None)
    d_pse = dev(a.pse, p.pse)

    out_storage = a.out.dtype
    if on_device:
        out_dev = _output_like(query, p.out_shape, p.out_dtype)
        lse_dev = _output_like(query, p.lse_shape, np.float32) if p.want_lse else \
            cuda.device_array(1, np.float32)
        d_out = _flat_device(out_dev, out_storage)
        d_lse = _flat_device(lse_dev, np.float32)
    else:
        d_out = cuda.device_array(a.out.size, dtype=out_storage)
        d_lse = cuda.device_array(a.lse.size if p.want_lse else 1, dtype=np.float32)
    if p.q_off is not None and p.q_off.any():   # left padding: the rows before the windows
        d_out.copy_to_device(np.zeros(d_out.size, out_storage))
        d_lse.copy_to_device(np.full(d_lse.size, -np.inf, np.float32))

    dpad, bq, bkv = launch_config(p)
    kern, threads = None, bq
    if config.CUDA_TENSOR_CORES:     # the tensor-core kernel where it applies (gpu.tc_kernel)
        from . import tc_kernel as tc
        cc = cuda.get_current_device().compute_capability
        why = tc.tensor_core_reason(p, cc) or tc.device_reason(p, d_q, d_k, d_v)
        if why is None:
            kern, bq, threads = tc.tc_kernel_for(tc.kind_of(p.dtype), p.D), tc.ROWS, tc.THREADS
        else:
            log.info("the portable CUDA kernel runs this call, not the tensor-core one: %s", why)
    qtiles = max(1, -(-int(a.lens[L_ROWS].max()) // bq))
    int8 = p.dtype == np.int8
    args = (d_q, d_k, d_v, d_out, d_lse, d_m8, d_m16, d_pse,
            *map(cuda.to_device, (a.strides, a.boff, a.lens, a.params)), qtiles,
            *map(cuda.to_device, (a.fparams, a.scale2, a.offset2)))
    if kern is None:                 # the portable kernels; the float one walks the kv cache
        kern = kernel_for(dpad, bq, bkv, int8=int8)
        if not int8:
            cache = p.cache
            prefixed = cache is not None and cache.P > 0
            args += (dev(a.kp, cache.prefix_key if prefixed else None),
                     dev(a.vp, cache.prefix_value if prefixed else None),
                     *map(cuda.to_device, (a.table, a.channel) + a.tokens))
    kern[(p.B * qtiles, p.N), threads](*args)
    cuda.synchronize()
    if on_device:
        return out_dev, (lse_dev if p.want_lse else None)
    out_host.reshape(-1).view(out_storage)[...] = d_out.copy_to_host()
    if p.want_lse:
        lse_host.reshape(-1)[...] = d_lse.copy_to_host()
    return out_host, (lse_host if p.want_lse else None)


def _flat_device(arr, storage_dtype):
    """A contiguous CUDA array of ours as a flat Numba device array of its storage type."""
    kind = array_kind(arr)
    if kind == "torch":
        import torch
        if arr.dtype == torch.bfloat16:
            arr = arr.view(torch.int16)
    d = cuda.as_cuda_array(arr) if kind != "numba" else arr
    return d.reshape(d.size).view(storage_dtype)


def _finish(out, lse, on_device, query, p):
    if not on_device:
        return out, lse
    return to_kind(out, query), (to_kind(lse, query) if lse is not None else None)
