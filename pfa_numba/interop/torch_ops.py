"""pfa_numba's attention as a torch operator: ``torch.ops.pfa_numba.sdpa`` and its backward
``torch.ops.pfa_numba.sdpa_backward``, registered with ``torch.library`` when this module is
imported, over a forward and a backward that the SDPA drop-in (:mod:`pfa_numba.sdpa`) puts in
:data:`.torch_tensors.OPERATORS`: on NumPy arrays for CPU tensors; the forward takes CUDA
tensors as they are, and the backward raises NotImplementedError for them.

As an operator the call is one opaque node to torch: ``torch.compile`` traces models through
it (fake implementations give the results' shapes, no kernel runs while tracing), and autograd
differentiates it by the registered backward: query, key, value, a float attn_mask (the scores'
additive term) and sinks, each where it requires grad, the gradients in each argument's dtype
and shape (a broadcast attn_mask's summed over the dimensions it was broadcast along).
Imported by the first call with torch tensors (so torch is imported) and by the transformers
integration (so a model compiled before any call finds the operator registered).
"""
from typing import Optional

import numpy as np
import torch

from .torch_tensors import OPERATORS, as_numpy, as_tensor, on_cuda

ARGUMENTS = ("query", "key", "value", "attn_mask", "sinks")


def _implementation(name):
    """The NumPy function registered as ``name`` in :data:`.torch_tensors.OPERATORS` (by the
    module that defines it, at its import):

    ``forward(query, key, value, attn_mask, sinks, options)`` (NumPy arrays, or torch CUDA
    tensors; options a dict of the call's other arguments) returns (output of the query's
    shape, softmax_lse of the query's shape without its last dim, float32), arrays of the
    arguments' kind; ``backward(state, dout, want_dbias)`` (NumPy arrays) with
    state (query, key, value, attn_mask, sinks, output, lse, options) returns float32 arrays
    (dq, dk, dv, dbias, dsinks): dbias, the gradient of the scores' additive term in the
    scores' shape (..., Hq, L, S), where ``want_dbias``; dsinks where there are sinks."""
    return OPERATORS[name]


@torch.library.custom_op("pfa_numba::sdpa", mutates_args=())
def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attn_mask: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
         scale: Optional[float], is_causal: bool, enable_gqa: bool,
         softcap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, softmax_lse) of torch's SDPA arguments on pfa_numba's kernels: the CPU's for
    CPU tensors (read as NumPy arrays), the GPU's for CUDA tensors (read in place)."""
    options = _options(scale, is_causal, enable_gqa, softcap)
    if on_cuda(query):                     # read in place; the autograd is the registered one
        tensors = (None if t is None else t.detach() for t in (query, key, value, attn_mask,
                                                                 sinks))
        return _implementation("sdpa.forward")(*tensors, options)
    arrays = _arrays(query, key, value, attn_mask, sinks)
    out, lse = _implementation("sdpa.forward")(*arrays, options)
    return as_tensor(out), torch.from_numpy(np.ascontiguousarray(lse, np.float32))


@sdpa.register_fake
def _(query, key, value, attn_mask, sinks, scale, is_causal, enable_gqa, softcap):
    return (query.new_empty(query.shape[:-1] + value.shape[-1:]),
            query.new_empty(query.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("pfa_numba::sdpa_backward", mutates_args=())
def sdpa_backward(dout: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attn_mask: Optional[torch.Tensor],
                  sinks: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor,
                  scale: Optional[float], is_causal: bool, enable_gqa: bool,
                  softcap: Optional[float], want_dmask: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor]:
    """The gradients (dq, dk, dv, dmask, dsinks) of :func:`sdpa` given the output's gradient
    ``dout``, contiguous; an empty tensor in place of dmask unless ``want_dmask``, and of
    dsinks without sinks. CPU tensors only: there is no backward kernel on CUDA."""
    if on_cuda(query):
        raise NotImplementedError(
            f"the backward of pfa_numba's scaled_dot_product_attention runs on CPU tensors: on "
            f"CUDA ({query.dtype} query of shape {tuple(query.shape)} on {query.device}) its "
            f"kernels compute the forward only; train through torch's SDPA there, or on CPU "
            f"tensors")
    arrays = _arrays(query, key, value, attn_mask, sinks, out, lse)
    state = (*arrays, _options(scale, is_causal, enable_gqa, softcap))
    dout = np.ascontiguousarray(as_numpy("dout", dout.detach().float()))
    dq, dk, dv, dbias, dsinks = _implementation("sdpa.backward")(state, dout, want_dmask)
    dmask = _sum_to_shape(dbias, attn_mask.shape) if want_dmask else None
    return tuple(query.new_empty(0) if g is None else _gradient(g, like) for g, like in zip(
        (dq, dk, dv, dmask, dsinks), (query, key, value, attn_mask, sinks)))


@sdpa_backward.register_fake
def _(dout, query, key, value, attn_mask, sinks, out, lse, scale, is_causal, enable_gqa,
      softcap, want_dmask):
    formed = (query, key, value, attn_mask if want_dmask else None, sinks)
    return tuple(query.new_empty(0) if x is None else x.new_empty(x.shape) for x in formed)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5], *output)
    ctx.options = inputs[5:]
    ctx.given = [x is not None for x in inputs[:5]]


def _differentiate(ctx, dout, _dlse):
    query, key, value, attn_mask, sinks, out, lse = ctx.saved_tensors
    want = ctx.needs_input_grad[:5]
    grads = torch.ops.pfa_numba.sdpa_backward(dout, query, key, value, attn_mask, sinks, out,
                                              lse, *ctx.options, bool(want[3]))
    return (*(g if wanted and given else None
              for g, wanted, given in zip(grads, want, ctx.given)), None, None, None, None)


sdpa.register_autograd(_differentiate, setup_context=_setup_context)


def _arrays(*tensors):
    """The tensors as NumPy arrays over their memory (None stays None); read as data: the
    operator's autograd is the registered one."""
    return tuple(None if t is None else as_numpy(name, t.detach())
                 for name, t in zip(ARGUMENTS + ("out", "lse"), tensors))


def _options(scale, is_causal, enable_gqa, softcap):
    return dict(scale=scale, is_causal=is_causal, enable_gqa=enable_gqa, softcap=softcap)


def _gradient(g, like):
    """A float32 gradient array as a contiguous tensor of ``like``'s dtype and shape (what the
    fake implementation gives)."""
    return torch.from_numpy(np.ascontiguousarray(g, np.float32).reshape(like.shape)) \
        .to(like.dtype)


def _sum_to_shape(g, shape):
    """``g`` summed over the dimensions an array of ``shape`` was broadcast along to g's
    shape (the leading ones it lacks, and those where it has 1)."""
    lead = g.ndim - len(shape)
    if lead:
        g = g.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g
