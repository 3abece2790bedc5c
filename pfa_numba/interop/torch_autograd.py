"""Attention on NumPy kernels as a torch autograd node: a ``torch.autograd.Function`` over a
forward and a backward given as functions of NumPy arrays (the SDPA drop-in's, in
:mod:`pfa_numba.sdpa`).

What it differentiates: query, key, value, a float attn_mask (the scores' additive term) and
sinks, each where it requires grad. The gradients come back in each argument's dtype and shape
(a broadcast attn_mask's gradient summed over the dimensions it was broadcast along). Imported
only by a call with a tensor that requires grad (so torch is imported).
"""
import numpy as np
import torch
from torch.autograd.function import once_differentiable

from .torch_tensors import as_tensor

ARGUMENTS = ("query", "key", "value", "attn_mask", "sinks")


def attention(forward, backward, query, key, value, attn_mask, sinks):
    """``forward(query, key, value, attn_mask, sinks)`` as a tensor with an autograd node.

    ``forward`` (called with grad mode off) returns (output array of the query's shape,
    state); ``backward(state, dout, want_dbias)`` returns float32 arrays (dq, dk, dv, dbias,
    dsinks) given the output's gradient ``dout`` (float32, the query's shape): dbias, the
    gradient of the scores' additive term in the scores' shape (..., Hq, L, S), where
    ``want_dbias``; dsinks where there are sinks."""
    for name, x in zip(ARGUMENTS, (query, key, value, attn_mask, sinks)):
        if isinstance(x, torch.Tensor) and x.requires_grad and x.device.type != "cpu":
            raise NotImplementedError(
                f"{name} requires grad on device '{x.device}': pfa_numba's attention backward "
                f"runs on the CPU only (no CUDA backward kernel)")
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"a call with tensors that require grad needs query as a torch tensor "
                        f"too, got {type(query).__name__}")
    return _Attention.apply(forward, backward, query, key, value, attn_mask, sinks)


class _Attention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, forward, backward, *args):
        out, ctx.state = forward(*args)
        ctx.backward = backward
        ctx.shapes = [None if x is None else tuple(x.shape) for x in args]
        ctx.dtypes = [None if x is None else x.dtype for x in args]
        return as_tensor(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        want = ctx.needs_input_grad[2:]
        dout = np.ascontiguousarray(grad_out.detach().float().numpy())
        arrays = ctx.backward(ctx.state, dout, want_dbias=want[3])
        shapes = list(ctx.shapes)
        if want[3]:
            arrays = list(arrays)
            arrays[3] = _sum_to_shape(arrays[3], shapes[3])
        ctx.state = None
        return (None, None, *(_tensor(g, shape, dtype) if wanted else None
                              for g, shape, dtype, wanted in zip(arrays, shapes, ctx.dtypes,
                                                                 want)))


def _tensor(g, shape, dtype):
    return torch.from_numpy(np.ascontiguousarray(g, np.float32).reshape(shape)).to(dtype)


def _sum_to_shape(g, shape):
    """``g`` summed over the dimensions an array of ``shape`` was broadcast along to g's
    shape (the leading ones it lacks, and those where it has 1)."""
    lead = g.ndim - len(shape)
    if lead:
        g = g.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g
