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

import numpy as np

from .frontend import antiquant as AQ
from .interop import torch_tensors
from .frontend import checks
from .frontend import fia as FV
from . import dispatch
from .numerics.band import TOKENS_INF
from .frontend.problem import plan
from .interop.cuda_arrays import Staged, checked, to_host
from .plans import Plan


@checks.spelled(FV.PFA_NAMES)
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
        key_antiquant_mode=0, value_antiquant_mode=0, softmax_lse_flag=False,
        learnable_sink=None, device=None):
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

    ``learnable_sink`` (torch_npu's fused_infer_attention_score_v2 argument; None, or one real
    number a query head, in the scaled scores' units): each head's sink logit joins the
    softmax denominator (and softmax_lse) of every row that keeps a score, without a value row
    (gpt-oss's attention sinks, as the SDPA drop-in's ``sinks``); float queries only.

    ``device`` as prompt_flash_attention's: on CUDA (CUDA arrays, or ``device='cuda'``) the
    portable CUDA kernel walks the same kv sequence; the tensors of a CUDA query are read in
    place (lists are gathered on the host). Errors are those of docs/fia.md, 'Errors'.
    """
    call = FV.FiaCall(**locals())        # every argument, by its name
    device = checks.check_placement(call)
    call = _host(call)
    staged = Staged(call, device) if checks.is_cuda_array(query) else None
    valid = FV.validate(staged.call if staged else call, device)
    problem = planned(valid)
    out, lse = dispatch.choose(problem, device, staged).run(problem, staged)
    return _results(query, out, lse, valid.lse_flag, staged)


def _results(query, out, lse, lse_flag, staged=None):
    """(attention_out, softmax_lse) of the query's kind; without ``lse_flag``, float32 zeros of
    shape (1,) for softmax_lse."""
    if not lse_flag:
        lse = np.zeros(1, np.float32)
        if staged is not None and not staged.copied:     # results computed in place
            from .gpu.launch import placeholder_lse
            lse = placeholder_lse(query)
    if staged is not None:
        return staged.results(out, lse)
    if torch_tensors.is_tensor(query):
        return torch_tensors.as_tensor(out), torch_tensors.as_tensor(lse)
    return out, lse


def planned(valid):
    """The planned problem of a :class:`frontend.fia.ValidFia`: its prompt_flash_attention
    plan with the kv cache the kernels walk instead of the stand-in key and value."""
    problem = plan(valid.pfa, valid.kv, valid.q_off)
    return problem if valid.sinks is None else dataclasses.replace(problem, sinks=valid.sinks)


def _host(call):
    """The call with its small array arguments (lengths, scales, the block table) and any
    key / value list elements readable on the host (torch CPU tensors as NumPy arrays over their
    memory, CUDA arrays copied), and its other torch CPU tensors as NumPy arrays; the tensors
    of a CUDA query stay where they are (:class:`.interop.cuda_arrays.Staged` makes them
    readable)."""
    on_cuda = checks.is_cuda_array(call.query)
    arrays = {}
    for name, x in vars(call).items():
        if x is None or isinstance(x, (int, float, str)):       # most arguments, quickly
            continue
        if isinstance(x, (list, tuple)) and name in ("key", "value"):
            arrays[name] = type(x)(_host_element(f"{name}[{i}]", e, on_cuda)
                                   for i, e in enumerate(x))
        elif torch_tensors.is_cpu_tensor(x):
            arrays[name] = torch_tensors.as_numpy(name, x)
        elif checks.is_cuda_array(x) and name not in FV.TENSORS:
            arrays[name] = checked(name, to_host, x)
    return dataclasses.replace(call, **arrays) if arrays else call


def _host_element(name, x, on_cuda):
    """One key / value list element on the host; it lives where the query does."""
    if checks.is_cuda_array(x) != on_cuda:
        raise RuntimeError(f"{name} is {'a CUDA' if not on_cuda else 'a host (NumPy)'} array "
                           f"but query is {'a CUDA' if on_cuda else 'a host (NumPy)'} array: "
                           f"key / value list elements live on the query's device (got "
                           f"{type(x).__name__})")
    if on_cuda:
        return checked(name, to_host, x)
    return torch_tensors.as_numpy(name, x) if torch_tensors.is_cpu_tensor(x) else x


class FiaPlan(Plan):
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
    operator = staticmethod(fused_infer_attention_score)

    @classmethod
    def _checked(cls, arguments):
        call = FV.FiaCall(**arguments)
        device = checks.check_placement(call)
        # checked before anything is copied; a CPU launch holds its own copies of the
        # lengths, table and scales
        call = _host(call)
        staged = Staged(call, device) if checks.is_cuda_array(call.query) else None
        valid = FV.validate(staged.call if staged else call, device)
        return planned(valid), staged, valid.lse_flag, device

    def _read_at_each_call(self, kwargs):
        return FV.TENSORS + AQ.token_arguments(kwargs)

    def _results(self, query, out, lse, on_device):
        if on_device:
            from .gpu.launch import placeholder_lse
            return out, (lse if self._lse_flag else placeholder_lse(query))
        return _results(query, out, lse, self._lse_flag)


def explain_fia(query, key, value, **kwargs):
    """:func:`pfa_numba.explain` for ``fused_infer_attention_score(query, key, value,
    **kwargs)``: its kernel and why each other one was not taken, as text."""
    return FiaPlan.explain(query, key, value, **kwargs)
