"""torch CPU tensors in and out without copies: a tensor is read as the NumPy array over its
memory (bfloat16 by its bits), results come back as tensors over the NumPy results' memory.

torch is never imported here unless a torch tensor arrives (whoever made one has imported it).
A tensor that requires grad while grad mode is on is never read here (its gradient would be
dropped silently): :func:`as_numpy` refuses it, and the SDPA drop-in runs torch tensors
through the operator of :mod:`.torch_ops`, whose backward is registered with autograd.
"""
import sys

import numpy as np

from ..numerics.dtypes import is_bf16


#: the NumPy implementations of :mod:`.torch_ops`' operators, by name ("sdpa.forward",
#: "sdpa.backward"), put here at import by the module that defines them (a higher layer)
OPERATORS = {}


def is_tensor(x):
    """Whether ``x`` is a torch tensor (of any device)."""
    torch = sys.modules.get("torch")         # none was made where torch is not imported
    return torch is not None and isinstance(x, torch.Tensor)


def on_cuda(t):
    """Whether torch tensor ``t`` lives on a CUDA device (the one place this is asked, so the
    CUDA simulator's tests can place CPU tensors there)."""
    return t.is_cuda


def is_cpu_tensor(x):
    """Whether ``x`` is a torch tensor that is not on CUDA: a CPU tensor, or one of a device
    :func:`as_numpy` refuses."""
    return is_tensor(x) and not on_cuda(x)


def numpy_dtype(t):
    """The NumPy dtype of torch tensor ``t``'s elements (bfloat16: ml_dtypes')."""
    import torch
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(str(t.dtype).replace("torch.", ""))


def requires_grad(x):
    """Whether ``x`` is a torch tensor whose gradient grad mode would record."""
    if not is_tensor(x) or not x.requires_grad:
        return False
    import torch
    return torch.is_grad_enabled()


def as_numpy(name, t):
    """The NumPy array over the memory of CPU tensor ``t`` (argument ``name``), no copy; a
    tensor on another device than the CPU (CUDA tensors go elsewhere) is a RuntimeError."""
    import torch
    if t.device.type != "cpu":
        raise RuntimeError(f"{name} is a torch tensor on device '{t.device}' ({t.dtype} tensor "
                           f"of shape {tuple(t.shape)}): pfa_numba reads CPU and CUDA tensors")
    t = readable(name, t)
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    try:
        return t.numpy()
    except TypeError:
        raise TypeError(f"{name} has a dtype NumPy cannot view ({t.dtype} tensor of shape "
                        f"{tuple(t.shape)})") from None


def readable(name, t):
    """Tensor ``t`` (argument ``name``, on any device) detached, for its data to be read; one
    that requires grad while grad mode is on is a RuntimeError (its gradient would be dropped
    silently)."""
    import torch
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{name} requires grad ({t.dtype} tensor of shape {tuple(t.shape)}): "
                           f"this pfa_numba operator computes the forward pass only (the SDPA "
                           f"drop-in has a backward); call it under torch.no_grad() or "
                           f"torch.inference_mode()")
    return t.detach().resolve_conj().resolve_neg()


def as_tensor(x):
    """A NumPy result as a CPU tensor over its memory (bfloat16 by its bits)."""
    import torch
    if is_bf16(x.dtype):
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


class HostTensors:
    """The torch CPU tensor arguments of a call, read as NumPy arrays; the results as tensors
    when the query is one. (``meta`` None: nothing lives on a device.)"""
    meta = None

    def __init__(self, call, names):
        self.query_is_tensor = is_tensor(call.query)
        self.call = call.with_arrays({name: as_numpy(name, getattr(call, name))
                                      for name in names if is_cpu_tensor(getattr(call, name))})

    def results(self, out, lse):
        if not self.query_is_tensor:
            return out, lse
        return as_tensor(out), (None if lse is None else as_tensor(lse))
