"""``fused_infer_attention_score``: Ascend's FIA (MindSpore ``ops.fused_infer_attention_score``)
on the prompt_flash_attention kernels.

One entry point for the prefill branch (query length > 1: prompt_flash_attention's rules) and
the decode branch (query length 1 against a kv cache: every kv column, a mask is a user mask),
with left padding (per-batch windows of the padded frame), paged key/value (block pools and a
block table) and a shared prefix before every batch's own rows. The kernels walk that kv
sequence directly (:mod:`.cpu.kv`): no cache is gathered or copied. The contract is
docs/fia.md; ``pfa_numba.reference.fused_infer_attention_score`` is its float64 meaning.
"""
import dataclasses
import inspect

import numpy as np

from . import _antiquant as AQ
from . import _torch
from . import _validate as V
from . import _validate_fia as FV
from . import dispatch
from ._band import TOKENS_INF
from ._kernel_args import flat_view, storage
from ._plan import plan
from .gpu.arrays import Staged, checked, to_host, to_kind


def fused_infer_attention_score(
        query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
        actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
        dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
        antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
        value_antiquant_scale=None, value_antiquant_offset=None, block_table=None,
        query_padding_size=None, kv_padding_size=None, key_shared_prefix=None,
        value_shared_prefix=None, actual_shared_prefix_len=None, num_heads=1, scale=1.0,
        pre_tokens=TOKENS_INF, next_tokens=TOKENS_INF, input_layout="BSH",
        num_key_value_heads=0, sparse_mode=0, inner_precise=1, block_size=0, antiquant_mode=0,
        key_antiquant_mode=0, value_antiquant_mode=0, softmax_lse_flag=False, device=None):
    """Fused attention for inference, as Ascend's FusedInferAttentionScore: the prefill branch
    (prompt_flash_attention, with FIA's argument names ``atten_mask``, ``scale``,
    ``dequant_scale1/2`` and its default ``next_tokens=2147483647``) and the decode branch
    (query length 1), over a contiguous, left-padded, paged or prefixed kv cache.

    Only query, key and value are positional. Returns ``(attention_out, softmax_lse)``:
    softmax_lse is float32 (B, N, Sq, 1), ``m + log(l)`` over the kept scores, -inf for rows
    that kept nothing, with ``softmax_lse_flag=True``; float32 zeros of shape (1,) otherwise.

    Decode (query S axis 1): ``actual_seq_lengths``, ``pre_tokens``, ``next_tokens``,
    ``sparse_mode`` and ``query_padding_size`` are ignored; ``atten_mask`` of shape (B, C),
    (B, 1, C) or (B, 1, 1, C) (batch 1 too) drops the columns it marks.
    Left padding (``kv_padding_size`` with ``actual_seq_lengths_kv``; in prefill also
    ``query_padding_size`` with ``actual_seq_lengths``): batch b's rows are the last ones of
    the padded frame before p padding rows; masks and pse are read in the padded frame.
    Paged (``block_table`` (B, max_blocks) int32/int64, ``block_size``): key/value are block
    pools (num_blocks, block_size, Hkv), or (num_blocks, Nkv, block_size, D) with BNSD;
    ``actual_seq_lengths_kv`` is required; table entries past a batch's length are never
    read. Shared prefix (``key_shared_prefix``, ``value_shared_prefix``, batch 1, optional
    ``actual_shared_prefix_len``): prepended to every batch's kv.

    key/value lists: one batch-1 tensor a batch, each its own length (gathered into one padded
    cache per call). int8 key/value with a float query: dequantized as they load, ``(int8 +
    offset) * scale`` per tensor, channel, head, token or paged slot (``antiquant_*``,
    ``key_antiquant_*``, ``value_antiquant_*``; docs/fia.md, 'KV antiquant').

    ``device`` as prompt_flash_attention's: on CUDA (CUDA arrays, or ``device='cuda'``) the
    portable CUDA kernel walks the same kv sequence; the tensors of a CUDA query are read in
    place (lists are gathered on the host). Errors are those of docs/fia.md, 'Errors'.
    """
    call = FV.FiaCall(
        query, key, value, pse_shift, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
        dequant_scale1, quant_scale1, dequant_scale2, quant_scale2, quant_offset2,
        antiquant_scale, antiquant_offset, key_antiquant_scale, key_antiquant_offset,
        value_antiquant_scale, value_antiquant_offset, block_table, query_padding_size,
        kv_padding_size, key_shared_prefix, value_shared_prefix, actual_shared_prefix_len,
        num_heads, scale, pre_tokens, next_tokens, input_layout, num_key_value_heads,
        sparse_mode, inner_precise, block_size, antiquant_mode, key_antiquant_mode,
        value_antiquant_mode, softmax_lse_flag, device)
    device = V.check_placement(call)
    call = _host(call)
    staged = Staged(call, device) if V.is_cuda_array(query) else None
    valid = FV.validate(staged.call if staged else call, device)
    problem = planned(valid)
    out, lse = dispatch.choose(problem, device).run(problem, staged)
    return _results(query, out, lse, valid.lse_flag, staged)


def _results(query, out, lse, lse_flag, staged=None):
    """(attention_out, softmax_lse) of the query's kind; without ``lse_flag``, float32 zeros of
    shape (1,) for softmax_lse."""
    if not lse_flag:
        lse = np.zeros(1, np.float32)
        if staged is not None and not staged.copied:     # results computed in place
            lse = to_kind(lse, query)
    if staged is not None:
        return staged.results(out, lse)
    if _torch.is_tensor(query):
        return _torch.as_tensor(out), _torch.as_tensor(lse)
    return out, lse


def planned(valid):
    """The planned problem of a :class:`._validate_fia.ValidFia`: its prompt_flash_attention
    plan with the kv cache the kernels walk instead of the stand-in key and value."""
    return plan(valid.pfa, valid.kv, valid.q_off)


def _host(call):
    """The call with its small array arguments (lengths, scales, the block table) and any
    key / value list elements readable on the host (torch CPU tensors as NumPy arrays over their
    memory, CUDA arrays copied), and its other torch CPU tensors as NumPy arrays; the tensors
    of a CUDA query stay where they are (:class:`.gpu.arrays.Staged` makes them readable)."""
    on_cuda = V.is_cuda_array(call.query)
    arrays = {}
    for name, x in vars(call).items():
        if x is None or isinstance(x, (int, float, str)):       # most arguments, quickly
            continue
        if isinstance(x, (list, tuple)) and name in ("key", "value"):
            arrays[name] = type(x)(_host_element(f"{name}[{i}]", e, on_cuda)
                                   for i, e in enumerate(x))
        elif _torch.is_cpu_tensor(x):
            arrays[name] = _torch.as_numpy(name, x)
        elif V.is_cuda_array(x) and name not in FV.TENSORS:
            arrays[name] = checked(name, to_host, x)
    return dataclasses.replace(call, **arrays) if arrays else call


def _host_array(name, x):
    """A host tensor argument as the whole call's checks read it: a torch CPU tensor as the
    NumPy array over its memory, an ndarray subclass as the plain array over its memory; the
    whole call's error for what they refuse."""
    return V.check_array(name, _torch.as_numpy(name, x) if _torch.is_cpu_tensor(x) else x)


def _host_element(name, x, on_cuda):
    """One key / value list element on the host; it lives where the query does."""
    if V.is_cuda_array(x) != on_cuda:
        raise RuntimeError(f"{name} is {'a CUDA' if not on_cuda else 'a host (NumPy)'} array "
                           f"but query is {'a CUDA' if on_cuda else 'a host (NumPy)'} array: "
                           f"key / value list elements live on the query's device (got "
                           f"{type(x).__name__})")
    if on_cuda:
        return checked(name, to_host, x)
    return _torch.as_numpy(name, x) if _torch.is_cpu_tensor(x) else x


class FiaPlan:
    """A :func:`fused_infer_attention_score` call checked and planned once, to run on many
    query / key / value arrays of the same geometry: the layers of a model's decode step, which
    share their lengths, block table and masks and differ only in their caches.

    ``FiaPlan(query, key, value, **kwargs)`` takes fused_infer_attention_score's arguments and
    raises its errors; ``plan(query, key, value)`` returns what
    ``fused_infer_attention_score(query, key, value, **kwargs)`` returns (bit for bit under the
    configuration the plan was made with: threads, ``pfa_numba.config``) for arrays of the
    planned kind, dtype, device, shape and strides (a TypeError names a kind or dtype that
    differs, a RuntimeError a device, shape or strides). Every other argument is the plan's,
    as it was when the plan was made, except the tensors atten_mask, pse_shift and the shared
    prefix, and the antiquant scales and offsets indexed by token (as large as the cache),
    which are read at each call. On the CPU a call costs the kernel and a few checks,
    not the checks and planning of a whole call; on CUDA, for key / value lists, and for
    arrays the kernels cannot read in place (misaligned ones), a call runs the whole of
    fused_infer_attention_score (on CUDA its errors are raised there, not when the plan is
    made). A plan holds the arrays it was made with.
    """

    def __init__(self, query, key, value, **kwargs):
        try:
            bound = _SIGNATURE.bind(query, key, value, **kwargs)
        except TypeError as e:
            raise TypeError(f"FiaPlan takes fused_infer_attention_score's arguments: {e}") \
                from None
        bound.apply_defaults()
        call = FV.FiaCall(**bound.arguments)
        device = V.check_placement(call)
        self._launch, self._lse_flag, self._strides = None, False, None
        if device == "cpu" and not V.is_cuda_array(query):
            # checked before anything is copied; the launch holds its own copies of the
            # lengths, table and scales
            self._prepare(_host(call), device)
        read_in_place = FV.TENSORS + AQ.token_arguments(kwargs)
        self._kwargs = {name: x if name in read_in_place else _snapshot(x)
                        for name, x in kwargs.items()}
        self._like = tuple(_like(x) for x in (query, key, value))

    def _prepare(self, call, device):
        """The CPU launch of ``call``, where the kernels read its query, key and value in
        place (a key / value list is gathered into a copy: such plans run whole calls)."""
        valid = FV.validate(call, device)
        problem = planned(valid)
        backend = dispatch.choose(problem, device)
        if backend.name != "cpu" or isinstance(call.key, (list, tuple)):
            return
        launch = backend.prepare(problem)
        arrays = (call.query, call.key, call.value)
        if launch.kernel is not None:
            flats = (launch.args.q, launch.args.k, launch.args.v)
            if any(not _same_memory(_flat(x), f) for x, f in zip(arrays, flats)):
                return
        self._launch, self._lse_flag = launch, valid.lse_flag
        self._strides = tuple(x.strides for x in arrays)

    def __call__(self, query, key, value):
        """(attention_out, softmax_lse) of the planned call on these query, key and value."""
        given = (query, key, value)
        for name, x, like in zip(_QKV, given, self._like):
            _check_like(name, x, like)
        arrays = self._read_in_place(given)
        if arrays is None:
            return fused_infer_attention_score(query, key, value, **self._kwargs)
        out, lse = self._launch.run(*(_flat(x) for x in arrays))
        return _results(query, out, lse, self._lse_flag)

    def _read_in_place(self, given):
        """The NumPy arrays over the given query, key and value's memory, where the planned
        kernel call can read them as it read the planned ones (aligned, with the planned byte
        strides: a torch tensor NumPy cannot see in place has others); else None. Raises what
        the whole call raises for an array it refuses (a masked array, a tensor that requires
        grad)."""
        if self._launch is None:
            return None
        arrays = [_host_array(name, x) for name, x in zip(_QKV, given)]
        if all(x.flags.aligned and x.strides == s for x, s in zip(arrays, self._strides)):
            return arrays
        return None


_SIGNATURE = inspect.signature(fused_infer_attention_score)
_QKV = ("query", "key", "value")


def _snapshot(x):
    """A copy of a small argument (lengths, a table, scales) as it is now."""
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, (list, tuple)):
        return type(x)(_snapshot(e) for e in x)
    return x.clone() if _torch.is_cpu_tensor(x) else x


def _like(x):
    """What a plan's later arrays must share with ``x``: (kind, device, dtype, shape, strides);
    a key / value list only its kind and length (the whole call checks its elements)."""
    if isinstance(x, (list, tuple)):
        return type(x).__name__, None, None, (len(x),), None
    if _torch.is_tensor(x):
        return "torch tensor", str(x.device), str(x.dtype), tuple(x.shape), x.stride()
    if isinstance(x, np.ndarray):
        return "NumPy array", "cpu", str(x.dtype), x.shape, x.strides
    if not V.is_cuda_array(x):
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
    return (f"{dtype} {kind} on {device}, of shape {V.shape_str(shape)} and strides "
            f"{strides}")


def _flat(x):
    """The flat storage the kernels read array ``x`` through (:func:`._kernel_args.flat_view`)."""
    return flat_view(x, storage(x.dtype))[0]


def _same_memory(a, b):
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and \
        a.size == b.size
