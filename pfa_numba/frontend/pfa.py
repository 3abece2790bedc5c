"""Every user-facing error of prompt_flash_attention (docs/contract.md, section 10), only those.

One entry point, :func:`validate`, takes a :class:`Call` (the arguments by name) and returns a
:class:`ValidCall` or raises. Each check names the argument and the value received, and raises
the exception type MindSpore raises for it: TypeError for types and dtypes, ValueError for
values of the right type that make no sense (layout names, ranks, lengths, non-finite scale),
RuntimeError for the shape and argument rules the Ascend kernel enforces. Checks never use
``assert`` (it vanishes under -O).
"""
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..numerics.band import reads_user_mask
from ..numerics.core import MASK_NONE
from ..numerics.dtypes import I8, is_bf16
from .checks import (Arguments, MAX_BATCH, MAX_GROUP, MAX_HEADS, MAX_HEAD_DIM, SEQ_AXIS,
                     check_array, check_band_signs, check_bool, check_cumulative_ends, check_int,
                     check_layout, check_placement, check_qkv_dtypes, check_range, check_rank,
                     check_scale_value, check_seq_lengths, plain, require, shape_str)
from .quant import QuantParams, quant_params
from .masks import check_band_mask, pse_window, user_mask


# ---------------------------------------------------------------------------------------------
# the call and its validation
# ---------------------------------------------------------------------------------------------

QUANT_ARGS = ("deq_scale1", "quant_scale1", "deq_scale2", "quant_scale2", "quant_offset2")
#: the tensor arguments, which live on one device (host or CUDA)
TENSOR_ARGS = ("query", "key", "value", "attn_mask", "pse_shift")
#: every argument that may be an array
ARRAY_ARGS = TENSOR_ARGS + QUANT_ARGS + ("actual_seq_lengths", "actual_seq_lengths_kv")


@dataclass(frozen=True, kw_only=True)
class Call(Arguments):
    """One prompt_flash_attention call: every argument by its name, as the caller passed it
    (those FIA shares: :class:`.checks.Arguments`)."""
    attn_mask: Any = None
    deq_scale1: Any = None
    deq_scale2: Any = None
    scale_value: Any = 1.0
    next_tokens: Any = 0
    return_softmax_lse: Any = False

    TENSORS = TENSOR_ARGS


@dataclass
class ValidCall:
    """A call that passed every check, in checked form: Python ints, plain NumPy arrays, the
    sizes its shapes give, the user mask and pse as windows, decoded quantization scales."""
    layout: str
    dtype: np.dtype
    N: int
    Nkv: int
    G: int
    D: int
    Dv: int                          # value's head dim (an extension: D for Ascend's calls)
    B: int
    Sq: int
    Skv: int
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    qlen: np.ndarray                 # int64[B]
    klen: np.ndarray
    q_start: Optional[np.ndarray]    # TND: first packed row of each sequence (int64[B])
    kv_start: Optional[np.ndarray]
    sparse_mode: int
    pre_tokens: int
    next_tokens: int
    has_mask: bool                   # an attn_mask was passed (read or not)
    mask_kind: int
    mask: Optional[np.ndarray]       # (Bm, Sq, Skv) window of a user mask (modes 0 and 1)
    pse: Optional[np.ndarray]        # (Bp, N, Sq, Skv) window
    quant: Optional["QuantParams"]
    scale: float
    inner_precise: int
    want_lse: bool
    device: str                      # 'cpu' or 'cuda'
    staged: Any = None               # the CUDA arguments' Staged, or None


def validate(call, stage=None, ascend_head_dims=True):
    """Check every argument of ``call`` (contract 'Errors') and return it as a :class:`ValidCall`.

    The device comes first; then ``stage(call, device)`` (from the API) gives the host-readable
    arrays the other checks read where the call holds CUDA arrays or torch tensors (or None). They
    run in a fixed order (scalars before tensors), so a call with several faults
    always reports the same one. ``ascend_head_dims``: Ascend's rule that a bfloat16 head dim is
    a multiple of 16 (the SDPA drop-in takes every head dim, as torch does; the kernels do)."""
    device = check_placement(call)
    staged = None if stage is None else stage(call, device)
    if staged is not None:
        call = staged.call
    num_heads = check_int("num_heads", call.num_heads)
    num_key_value_heads = check_int("num_key_value_heads", call.num_key_value_heads)
    pre_tokens = check_int("pre_tokens", call.pre_tokens)
    next_tokens = check_int("next_tokens", call.next_tokens)
    sparse_mode = check_int("sparse_mode", call.sparse_mode)
    inner_precise = check_int("inner_precise", call.inner_precise)
    scale = check_scale_value(call.scale_value)
    layout = check_layout(call.input_layout)
    want_lse = check_bool("return_softmax_lse", call.return_softmax_lse)
    check_range("sparse_mode", sparse_mode, 0, 4)
    check_range("inner_precise", inner_precise, 0, 3)
    if num_heads <= 0:
        raise RuntimeError(f"num_heads must be > 0, got {num_heads}")
    if num_key_value_heads < 0:
        raise RuntimeError(f"num_key_value_heads must be >= 0, got {num_key_value_heads}")

    query, key, value = (check_array(name, getattr(call, name))
                         for name in ("query", "key", "value"))
    attn_mask = plain("attn_mask", call.attn_mask)
    pse_shift = plain("pse_shift", call.pse_shift)
    dtype = check_qkv_dtypes(query, key, value)
    quant = {name: plain(name, getattr(call, name)) for name in QUANT_ARGS}
    is_quant = dtype == I8 or any(x is not None for x in quant.values())
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_rank(name, x, layout)

    n, nkv, d, dv = _heads_and_dims(layout, query, key, value, num_heads, num_key_value_heads)
    qparams = None
    if is_quant:
        if layout == "TND":
            given = [f"{k} of shape {shape_str(np.shape(x))}" for k, x in quant.items()
                     if x is not None] or [f"an int8 query of shape {shape_str(query.shape)}"]
            raise RuntimeError(f"input_layout 'TND' supports no quantization, got "
                               f"{', '.join(given)}")
        qparams = quant_params(dtype, quant, n, dv)
    _check_limit("num_heads", n, MAX_HEADS)
    if n % nkv:
        raise RuntimeError(f"num_heads ({n}) must be divisible by num_key_value_heads ({nkv})")
    g = n // nkv
    _check_limit("num_heads / num_key_value_heads", g, MAX_GROUP, f"{n} / {nkv} = ")
    if d == 0:
        raise RuntimeError(f"head dim D must be > 0, got 0 (query shape "
                           f"{shape_str(query.shape)})")
    _check_limit("head dim D", d, MAX_HEAD_DIM, "",
                 f" (query shape {shape_str(query.shape)})")
    if dv == 0:
        raise RuntimeError(f"value's head dim Dv must be > 0, got 0 (value shape "
                           f"{shape_str(value.shape)})")
    _check_limit("value's head dim Dv", dv, MAX_HEAD_DIM, "",
                 f" (value shape {shape_str(value.shape)})")
    if ascend_head_dims and is_bf16(dtype) and d % 16:
        raise RuntimeError(f"bfloat16 needs head dim D % 16 == 0, got D = {d} (query shape "
                           f"{shape_str(query.shape)})")

    if layout == "TND":
        batch, sq, skv, qlen, klen, q_start, kv_start = _packed_lengths(call, query, key, value)
        if reads_user_mask(sparse_mode, attn_mask is not None):
            raise RuntimeError(f"input_layout 'TND' supports no user attn_mask (sparse_mode 0 "
                               f"with a mask, or 1); got sparse_mode {sparse_mode} with attn_mask "
                               f"of shape {shape_str(attn_mask.shape) if attn_mask is not None else None}")
        if pse_shift is not None:
            raise RuntimeError(f"input_layout 'TND' does not support pse_shift, got shape "
                               f"{shape_str(getattr(pse_shift, 'shape', ()))}")
    else:
        batch, sq, skv, qlen, klen = _padded_lengths(call, layout, query, key, value)
        q_start = kv_start = None

    mask_kind, mask = MASK_NONE, None
    if sparse_mode == 0:
        if attn_mask is not None:
            mask_kind, mask = user_mask(attn_mask, dtype, batch, sq, skv)
            check_band_signs(pre_tokens, next_tokens, "sparse_mode 0 with attn_mask")
    elif sparse_mode == 1:
        require(attn_mask, RuntimeError, "sparse_mode 1 (allMask) requires attn_mask")
        mask_kind, mask = user_mask(attn_mask, dtype, batch, sq, skv)
    else:
        check_band_mask(attn_mask, sparse_mode, batch)
        if sparse_mode == 4:
            check_band_signs(pre_tokens, next_tokens, "sparse_mode 4",
                             int8_out=qparams is not None and qparams.out_dtype == I8)
    pse = None if pse_shift is None else pse_window(pse_shift, dtype, batch, n, sq, skv)
    return ValidCall(layout=layout, dtype=dtype, N=n, Nkv=nkv, G=g, D=d, Dv=dv, B=batch, Sq=sq,
                     Skv=skv, query=query, key=key, value=value, qlen=qlen, klen=klen,
                     q_start=q_start, kv_start=kv_start, sparse_mode=sparse_mode,
                     pre_tokens=pre_tokens, next_tokens=next_tokens,
                     has_mask=attn_mask is not None, mask_kind=mask_kind, mask=mask, pse=pse,
                     quant=qparams, scale=scale, inner_precise=inner_precise, want_lse=want_lse,
                     device=device, staged=staged)


def _packed_lengths(call, query, key, value):
    """TND: (B, Sq, Skv, qL, kL, first rows of the sequences in q, in k/v) from the ends."""
    t, tkv = query.shape[0], key.shape[0]
    if value.shape[0] != tkv:
        raise RuntimeError(f"key and value must have the same packed length Tkv, got key "
                           f"shape {shape_str(key.shape)} and value shape "
                           f"{shape_str(value.shape)}")
    q_ends = check_cumulative_ends("actual_seq_lengths", call.actual_seq_lengths, t)
    kv_ends = check_cumulative_ends("actual_seq_lengths_kv", call.actual_seq_lengths_kv, tkv)
    if q_ends.size != kv_ends.size:
        raise ValueError(f"actual_seq_lengths and actual_seq_lengths_kv must have the same "
                         f"length (one end per sequence), got {q_ends.tolist()} and "
                         f"{kv_ends.tolist()}")
    batch = q_ends.size
    q_start = np.concatenate([[0], q_ends[:-1]]).astype(np.int64)
    kv_start = np.concatenate([[0], kv_ends[:-1]]).astype(np.int64)
    qlen, klen = q_ends - q_start, kv_ends - kv_start
    sq = int(qlen.max()) if batch else 0
    skv = int(klen.max()) if batch else 0
    _check_limit("batch B", batch, MAX_BATCH, "", " sequences")
    return batch, sq, skv, qlen, klen, q_start, kv_start


def _check_limit(what, value, limit, before="", after=""):
    """A size within its limit (RuntimeError: "<what> must be <= <limit>, got <before><value>
    <after>")."""
    if value > limit:
        raise RuntimeError(f"{what} must be <= {limit}, got {before}{value}{after}")


def _padded_lengths(call, layout, query, key, value):
    """Padded layouts: (B, Sq, Skv, qL, kL)."""
    batch = query.shape[0]
    for name, x in (("key", key), ("value", value)):
        if x.shape[0] != batch:
            raise RuntimeError(f"batch B differs between query ({batch}) and {name} "
                               f"({x.shape[0]}); {name} shape {shape_str(x.shape)}")
    _check_limit("batch B", batch, MAX_BATCH, "", f" (query shape {shape_str(query.shape)})")
    axis = SEQ_AXIS[layout]
    sq, skv, skv_v = query.shape[axis], key.shape[axis], value.shape[axis]
    if skv_v != skv:
        raise RuntimeError(f"Skv differs between key ({skv}) and value ({skv_v}); "
                           f"key shape {shape_str(key.shape)}, value shape "
                           f"{shape_str(value.shape)}")
    qlen = check_seq_lengths("actual_seq_lengths", call.actual_seq_lengths, batch, sq)
    klen = check_seq_lengths("actual_seq_lengths_kv", call.actual_seq_lengths_kv, batch, skv)
    return batch, sq, skv, qlen, klen


def _heads_and_dims(layout, query, key, value, num_heads, num_kv_heads):
    """(N, Nkv, D, Dv) from the shapes, checking the head rules of contract 'Layouts' and
    'Errors': query and key have head dim D, value its own head dim Dv."""
    n = num_heads
    nkv = num_kv_heads if num_kv_heads > 0 else n
    if layout == "BSH":
        h, hk, hv = query.shape[2], key.shape[2], value.shape[2]
        if h % n:
            raise RuntimeError(f"the query hidden size H ({h}) must be divisible by num_heads "
                               f"({n}); query shape {shape_str(query.shape)}")
        d = h // n
        if num_kv_heads == 0 and hk != h:
            raise RuntimeError(f"key hidden size ({hk}) must equal the query hidden size "
                               f"({h}): num_key_value_heads = 0 means as many kv heads as "
                               f"num_heads ({n}); for grouped-query attention pass "
                               f"num_key_value_heads; key shape {shape_str(key.shape)}")
        for name, hx in (("key", hk), ("value", hv)):
            if hx % nkv:
                raise RuntimeError(f"{name} hidden size Hkv ({hx}) must be divisible by "
                                   f"num_key_value_heads ({nkv})")
        if hk // nkv != d:
            raise RuntimeError(f"head dim D differs between query ({d}) and key "
                               f"({hk // nkv} = {hk} / {nkv} heads)")
        return n, nkv, d, hv // nkv
    if layout == "TND":
        head_axis = 1
    elif layout == "BSND":
        head_axis = 2
    else:
        head_axis = 1
    if query.shape[head_axis] != n:
        raise RuntimeError(f"query has {query.shape[head_axis]} heads in its shape "
                           f"{shape_str(query.shape)} but num_heads is {n}")
    for name, x in (("key", key), ("value", value)):
        if x.shape[head_axis] != nkv:
            given = (f"num_key_value_heads = 0 means as many kv heads as num_heads ({n}); for "
                     f"grouped-query attention pass num_key_value_heads={x.shape[head_axis]}"
                     if num_kv_heads == 0 else f"num_key_value_heads is {nkv}")
            raise RuntimeError(f"{name} has {x.shape[head_axis]} heads in its shape "
                               f"{shape_str(x.shape)} but {given}")
    d = query.shape[-1]
    if key.shape[-1] != d:
        raise RuntimeError(f"head dim D differs between query ({d}) and key "
                           f"({key.shape[-1]}); key shape {shape_str(key.shape)}")
    return n, nkv, d, value.shape[-1]
