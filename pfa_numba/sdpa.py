"""``scaled_dot_product_attention``: torch's SDPA, argument for argument, on pfa_numba's kernels.

How it maps onto Ascend's arguments: query (..., Hq, L, E), key / value (..., Hkv, S, E) become
BNSD with B the product of the leading dimensions, N = Hq and num_key_value_heads = Hkv
(``enable_gqa``: query head h reads kv head h // (Hq / Hkv), as torch's repeat_interleave);
``scale`` (default 1/sqrt(E)) is scale_value; ``is_causal`` is the top-left band j <= i (sparse
mode 2's band, without its 2048 x 2048 mask); a bool ``attn_mask`` (True = take part) drops
what it excludes; a float ``attn_mask`` of the query's dtype is added to the scores in float32
(pse_shift's path); a row that keeps nothing is zeros (inner_precise 2's rule).

``softcap`` (an extension: torch's SDPA has none) caps the scaled scores as Gemma 2's attention
does: ``softcap * tanh(score / softcap)`` before the mask. ``sinks`` (an extension too): one
logit a query head (Hq,), in the units of the scaled scores, that joins the softmax denominator
of every row keeping a score without a value row (gpt-oss's attention sinks).

A bool mask also gives a band: the narrowest diagonal band i - pre <= j <= i + next holding
every True of the mask becomes sparse_mode 0's pre/next tokens, so the kernels never visit the
kv tiles outside it (a causal, padded or sliding-window mask costs what its band costs).
"""
import dataclasses
import math

import numpy as np

from .interop import cuda_arrays, torch_tensors
from .interop.cuda_arrays import Staged
from .frontend import checks
from .frontend import pfa as PV
from .numerics.dtypes import dtype_name, is_bf16
from . import dispatch
from .frontend.problem import plan


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, *, scale=None, enable_gqa=False,
                                 softcap=None, sinks=None, device=None):
    """torch.nn.functional.scaled_dot_product_attention on NumPy arrays or torch tensors (CPU
    or CUDA), returning the query's kind and dtype (float32, float16, bfloat16).

    Limits the kernels keep raise RuntimeError: head dim E <= 512, value's head dim equal to
    E, Hq a multiple of Hkv (with ``enable_gqa``; equal head counts without it). ``dropout_p``
    other than 0 is refused (pfa_numba has no dropout), and so is a mask with ``is_causal``
    (as torch does). ``softcap`` (None, or a finite number > 0): the scaled scores become
    ``softcap * tanh(score / softcap)`` before the mask. ``sinks`` (None, or Hq real numbers):
    each query head's sink logit joins its rows' softmax denominators. ``device`` (an extension,
    as prompt_flash_attention's: None, 'cpu' or 'cuda'): where NumPy arrays are computed
    (None: the CPU; 'cuda': copied to the GPU and back); torch tensors run where they live
    (None, or the device they live on).

    torch tensors run through the operator ``torch.ops.pfa_numba.sdpa``
    (:mod:`pfa_numba.interop.torch_ops`): ``torch.compile`` traces through it, and where a
    tensor argument (query, key, value, a float attn_mask, sinks) requires grad in grad mode the
    result carries its autograd node, whose backward is the CPU kernels'
    (:mod:`pfa_numba.cpu.backward`; on CUDA tensors it raises NotImplementedError). CUDA
    tensors stay on their device: the reshapes and the mask's conversion are torch operations
    there, the kernels read the tensors in place and the results are new tensors on that
    device; a bool mask's band and the sinks are read back to the host (a synchronisation)."""
    options = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                   enable_gqa=enable_gqa, softcap=softcap)
    return _attend((query, key, value, attn_mask, sinks), options, want_lse=False,
                   device=checks.check_device(device))[0]


def _attend(args, options, want_lse, device=None):
    """(result, softmax_lse) of a call: torch tensors through the operator (which gives the
    lse too), NumPy arrays on ``device``'s kernels (the CPU's for None; the lse where
    ``want_lse``, else None)."""
    query, key, value, attn_mask, sinks = args
    if all(torch_tensors.is_tensor(x) for x in (query, key, value)) and \
            all(x is None or torch_tensors.is_tensor(x) for x in (attn_mask, sinks)):
        return _through_operator(args, device, **options)
    if any(torch_tensors.requires_grad(x) for x in args):
        raise TypeError("a call with tensors that require grad takes query, key and value (and "
                        "attn_mask and sinks where given) as torch tensors, got "
                        + ", ".join(f"{n} {type(x).__name__}" for n, x in zip(ARGUMENTS, args)
                                    if x is not None))
    problem, staged = _planned(*args, **options, want_lse=want_lse)
    out, lse = _run(problem, staged, device or "cpu")
    out = out.reshape(_out_shape(query, value))
    return (torch_tensors.as_tensor(out) if torch_tensors.is_cpu_tensor(query) else out), lse


def _out_shape(query, value):
    """The result's shape: the query's, with value's head dim (which may differ from the
    query's, as in multi-head latent attention)."""
    return tuple(np.shape(query)[:-1]) + tuple(np.shape(value)[-1:])


def _run(problem, staged, device):
    """(output, lse) of planned ``problem``: on the CUDA arrays ``staged`` holds, as arrays of
    their kind on their device, or (``staged`` None) on ``device``'s kernels."""
    if staged is None:
        return dispatch.choose(problem, device).run(problem)
    return staged.results(*dispatch.choose(problem, "cuda", staged).run(problem, staged))


#: the tensor arguments, in order
ARGUMENTS = ("query", "key", "value", "attn_mask", "sinks")


def _through_operator(args, device, dropout_p, is_causal, scale, enable_gqa, softcap):
    """The call on torch tensors, as ``torch.ops.pfa_numba.sdpa``: (result, softmax_lse). The
    tensors' device and the arguments that are not tensors are checked here (the operator's
    schema takes plain floats and bools), the tensors inside it, where they are read."""
    _check_devices(args, device)
    _check_dropout(dropout_p)
    scale = None if scale is None else checks.check_scale_value(scale, "scale")
    softcap = _softcap(softcap) or None
    from .interop import torch_ops          # registers the operator (imports torch)
    return torch_ops.sdpa(*args, scale, bool(is_causal), bool(enable_gqa), softcap)


def _check_devices(tensors, device):
    """The tensors live on one device, the CPU or CUDA (the ``device`` given, if any)."""
    query = tensors[0]
    for name, x in zip(ARGUMENTS, tensors):
        if x is not None and x.device.type not in ("cpu", "cuda"):
            raise NotImplementedError(
                f"{name} is on device '{x.device}' ({x.dtype} tensor of shape "
                f"{tuple(x.shape)}): pfa_numba's scaled_dot_product_attention runs on CPU and "
                f"CUDA tensors, its backward on CPU tensors")
        if x is not None and x.device != query.device:
            raise RuntimeError(f"{name} is on device '{x.device}' but query on "
                               f"'{query.device}': the tensors must live on one device")
    where = "cuda" if torch_tensors.on_cuda(query) else "cpu"
    if device not in (None, where):
        raise ValueError(f"device={device!r} but the tensors live on {where}: torch tensors "
                         f"run where they live (move them with .to({device!r}))")


def _operator_forward(query, key, value, attn_mask, sinks, options):
    """The operator's forward on NumPy arrays (the CPU's kernels) or on torch CUDA tensors
    (the GPU's, the results new tensors on its device): (output, softmax_lse) in the query's
    shape (the lse without the head dim)."""
    problem, staged = _planned(query, key, value, attn_mask, sinks, dropout_p=0.0, **options,
                               want_lse=True)
    out, lse = _run(problem, staged, "cpu")
    return out.reshape(_out_shape(query, value)), lse.reshape(query.shape[:-1])


def _operator_backward(state, dout, want_dbias):
    """The operator's backward on NumPy arrays: (dq, dk, dv, dbias in the scores' shape or
    None, dsinks or None), float32, from the call's arguments, its output and lse (``state``)
    and the output's gradient ``dout``."""
    query, key, value, attn_mask, sinks, out, lse, options = state
    p = attention_problem(query, key, value, attn_mask, sinks, dropout_p=0.0, **options)
    bnsd = (p.B, p.N, p.Sq, p.Dv)
    kernel = dispatch.choose(p, "cpu", operation="backward").kernel
    dq, dk, dv, dbias, dsinks = kernel.gradients(p, out.reshape(bnsd), dout.reshape(bnsd),
                                                 lse.reshape(bnsd[:3]), want_dbias)
    scores = query.shape[:-1] + key.shape[-2:-1]
    return dq, dk, dv, (None if dbias is None else dbias.reshape(scores)), dsinks


def attention_with_weights(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                           *, scale=None, enable_gqa=False, softcap=None, sinks=None):
    """(:func:`scaled_dot_product_attention`'s result, its softmax weights): the weights
    (..., Hq, L, S) in the query's dtype and kind, the probabilities each output row is the
    weighted sum of V rows by (zeros where a row keeps nothing; a sink's weight is not among
    them). A slow path for inspection (transformers' ``output_attentions``): a second pass over
    the tiles forms them from the forward's softmax_lse (:func:`pfa_numba.cpu.backward.
    attention_weights`), as large as the score matrix, and they carry no gradient."""
    options = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                   enable_gqa=enable_gqa, softcap=softcap)
    args = (query, key, value, attn_mask, sinks)
    out, lse = _attend(args, options, want_lse=True)
    data = [_on_host(x) for x in (*args, lse)]               # CUDA tensors' too: a copy
    problem = attention_problem(*data[:5], **options)         # the weights' geometry
    lse = data[5].numpy() if torch_tensors.is_tensor(data[5]) else data[5]
    from .cpu.backward import attention_weights       # the CPU kernels, as a call needs them
    weights = attention_weights(problem, lse).astype(problem.dtype)
    weights = weights.reshape(np.shape(query)[:-1] + np.shape(key)[-2:-1])
    if not torch_tensors.is_tensor(query):
        return out, weights
    return out, torch_tensors.as_tensor(weights).to(query.device)


def _on_host(x):
    """A call's argument or result as data on the host: CUDA arrays copied to NumPy, torch CPU
    tensors detached."""
    if checks.is_cuda_array(x):
        return cuda_arrays.to_host(x)
    return x.detach() if torch_tensors.is_tensor(x) else x


def attention_problem(query, key, value, attn_mask, sinks, *, dropout_p, is_causal, scale,
                      enable_gqa, softcap, want_lse=False):
    """The planned BNSD problem of a :func:`scaled_dot_product_attention` call (its checks
    raise here); with softmax_lse where ``want_lse``."""
    return _planned(query, key, value, attn_mask, sinks, dropout_p=dropout_p,
                    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, softcap=softcap,
                    want_lse=want_lse)[0]


def _planned(query, key, value, attn_mask, sinks, *, dropout_p, is_causal, scale, enable_gqa,
             softcap, want_lse=False):
    """(:func:`attention_problem`, the staged CUDA arrays the kernels read or None)."""
    q, k, v, mask = (torch_tensors.as_numpy(name, x) if torch_tensors.is_cpu_tensor(x) else x
                     for name, x in (("query", query), ("key", key), ("value", value),
                                     ("attn_mask", attn_mask)))
    xp = _library(q, k, v, mask)
    for name, x in (("query", q), ("key", k), ("value", v)):
        if xp is np:
            checks.check_array(name, x)
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., L, E), got shape "
                             f"{checks.shape_str(x.shape)}")
        if _dtype(x) not in (np.float16, np.float32) and not is_bf16(_dtype(x)):
            raise TypeError(f"{name} dtype must be float16, bfloat16 or float32 (the SDPA "
                            f"drop-in's dtypes), got {dtype_name(_dtype(x))}")
    softcap = _softcap(softcap)
    _check_dropout(dropout_p)
    if is_causal and mask is not None:
        raise RuntimeError("is_causal=True takes no attn_mask (as torch), got an attn_mask of "
                           f"shape {checks.shape_str(np.shape(mask))}")
    q4, k4, v4 = (_bnsd(x) for x in (q, k, v))
    hq, hkv = q4.shape[1], k4.shape[1]
    sinks = None if sinks is None else checks.sink_logits(sinks, hq)
    if hq != hkv and not enable_gqa:
        raise RuntimeError(f"query has {hq} heads and key {hkv}: pass enable_gqa=True for "
                           f"grouped-query attention")
    if scale is not None:
        scale = checks.check_scale_value(scale, "scale")
    else:                                   # head dim 0 is refused by the checks below
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    pse = discard = band = None
    if mask is not None:
        mask = checks.check_array("attn_mask", mask) if xp is np else mask
        pse, discard = _mask(mask, q, k, xp)
        band = _mask_band(mask, q.shape[-2], k.shape[-2], xp) \
            if _dtype(mask) == np.bool_ else None
    call = PV.Call(q4, k4, v4, attn_mask=discard, pse_shift=pse, num_heads=hq,
                   num_key_value_heads=hkv, scale_value=scale, input_layout="BNSD",
                   sparse_mode=0 if discard is None else 1, inner_precise=2,
                   return_softmax_lse=want_lse)
    valid = PV.validate(call, stage=None if xp is np else Staged, ascend_head_dims=False)
    if is_causal:
        valid = dataclasses.replace(valid, sparse_mode=2, has_mask=True)   # the band j <= i
    elif band is not None:
        valid = dataclasses.replace(valid, sparse_mode=0, has_mask=True, pre_tokens=band[0],
                                    next_tokens=band[1])
    return dataclasses.replace(plan(valid), softcap=softcap, sinks=sinks), valid.staged


def _library(query, key, value, mask):
    """The array library that reshapes and converts the arrays: NumPy for host arrays, torch
    for CUDA tensors (its operations run on their device). They live on one device."""
    call = PV.Call(query, key, value, attn_mask=mask)
    if checks.check_placement(call) == "cpu":
        return np
    foreign = [(name, type(x).__name__) for name, x in call.tensors().items()
               if x is not None and not torch_tensors.is_tensor(x)]
    if foreign:
        raise TypeError("{} is a CUDA array of {}: the SDPA drop-in takes CUDA arrays as torch "
                        "tensors".format(*foreign[0]))
    import torch
    return torch


def _dtype(x):
    """The NumPy dtype of an array's elements (a torch tensor's too)."""
    return torch_tensors.numpy_dtype(x) if torch_tensors.is_tensor(x) else x.dtype


def _check_dropout(dropout_p):
    if dropout_p != 0.0:
        raise RuntimeError(f"dropout_p must be 0.0 (pfa_numba's attention has no dropout), "
                           f"got {dropout_p!r}")


def _softcap(value):
    """The softcap as a float, 0.0 for None; a finite real number (as scale_value's check
    takes it) > 0."""
    if value is None:
        return 0.0
    value = checks.check_scale_value(value, "softcap")
    if value <= 0:
        raise ValueError(f"softcap must be > 0, got {value!r}")
    return value


def _bnsd(x):
    """(..., H, L, E) as (B, H, L, E), B the product of the leading dims ((L, E): B = H = 1)."""
    if x.ndim == 2:
        return x[None, None]
    return x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:]) if x.ndim > 3 else x[None]


def _mask(mask, q, k, xp):
    """torch's attn_mask as (pse_shift, discard mask) of the BNSD call, made with array library
    ``xp`` (:func:`_library`): a float mask (of the query's dtype) is added to the scores; a
    bool mask (True = take part) drops the rest, as a discard mask where it is the same for
    every head, else as -inf added to the scores."""
    scores = tuple(q.shape[:-1]) + (k.shape[-2],)           # (..., Hq, L, S)
    try:
        full = xp.broadcast_to(mask, scores)
    except (ValueError, RuntimeError):                      # NumPy's, torch's
        raise RuntimeError(f"attn_mask of shape {checks.shape_str(mask.shape)} does not "
                           f"broadcast to the scores' shape {checks.shape_str(scores)}") from None
    sq, skv = scores[-2:]
    if _dtype(mask) != np.bool_:
        if _dtype(mask) != _dtype(q):
            raise TypeError(f"a float attn_mask must have the query's dtype "
                            f"({dtype_name(_dtype(q))}), got {dtype_name(_dtype(mask))}")
        return full.reshape(math.prod(scores[:-3]), _heads(q), sq, skv), None
    if _differs_between_heads(mask) and q.ndim >= 3:
        bias = xp.zeros_like(full, dtype=q.dtype)
        bias[~full] = -math.inf
        return bias.reshape(math.prod(scores[:-3]), _heads(q), sq, skv), None
    head = mask[..., :1, :, :] if mask.ndim >= 3 else mask
    one_head = xp.broadcast_to(head, scores[:-3] + (1, sq, skv) if q.ndim >= 3 else scores)
    return None, ~one_head.reshape(math.prod(scores[:-3]), sq, skv)


def _differs_between_heads(mask):
    """Whether a bool mask has a head axis of its own: more than one head, not broadcast
    along it (an expanded mask's stride 0: one head's mask serves them all)."""
    if mask.ndim < 3 or mask.shape[-3] == 1:
        return False
    stride = mask.stride(-3) if torch_tensors.is_tensor(mask) else mask.strides[-3]
    return stride != 0


def _mask_band(mask, sq, skv, xp):
    """(pre, next) of the narrowest band i - pre <= j <= i + next that holds every True of the
    bool ``mask`` (broadcast to (..., sq, skv)); None when it holds no True (then the mask
    alone drops everything). pre + next >= 0, as sparse_mode 0 requires. The reductions over
    the mask run in its library ``xp``; their per-row results are read on the host at once
    (one copy from a CUDA tensor's device)."""
    if sq == 0 or skv == 0:
        return None
    m = xp.broadcast_to(mask, tuple(mask.shape[:-2]) + (sq, skv)).view(xp.int8)
    ends = xp.stack((xp.argmax(m, -1), xp.argmax(xp.flip(m, (-1,)), -1),
                     m.any(-1) * 1))                   # first, skv - 1 - last, kept
    first, from_end, kept = cuda_arrays.to_host(ends) if xp is not np else ends
    kept = kept.astype(bool)
    if not kept.any():
        return None
    rows, last = np.arange(sq), skv - 1 - from_end
    return int((rows - first)[kept].max()), int((last - rows)[kept].max())


def _heads(x):
    return x.shape[-3] if x.ndim >= 3 else 1


torch_tensors.OPERATORS.update({"sdpa.forward": _operator_forward,
                                "sdpa.backward": _operator_backward})
