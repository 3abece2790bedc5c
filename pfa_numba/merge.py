"""Exact merging of attention results computed over disjoint key/value ranges
(docs/contract.md, section 9).

Each part is the ``(out, softmax_lse)`` pair that ``prompt_flash_attention(...,
return_softmax_lse=True)`` returns for the same queries and one slice of the keys/values::

    lse = logaddexp(lse_1, ..., lse_k)
    out = sum_p out_p * exp(lse_p - lse)

A part whose lse is -inf (it kept nothing for that row) weighs exactly 0, even where its output
is NaN; a row that is -inf in every part comes out 0 with lse -inf. The merge equals the single
call over the whole kv range (up to the output dtype's rounding) for every row with kept mass.

Attention sinks (``sinks``, one logit a query head) count once: parts computed without them
merge, and each head's sink joins the merged denominator and lse of every row some part kept,
as the single call with ``sinks`` gives.
"""
import numpy as np
from numba import njit

from .cache import CACHE
from .cpu.records import RowState
from .cpu.split_kv import merge_rows
from .frontend import checks
from .frontend.checks import sink_logits
from .interop import torch_tensors
from .numerics.core import F32_NEG_INF, F32_ONE, row_total, sink_of
from .numerics.dtypes import dtype_name


@njit(cache=CACHE)
def _merge(outs, lses, sinks, heads):
    """The merged rows of the parts' rows ``outs`` (P, R, D) and ``lses`` (P, R), float32:
    each part's row taken as a piece of online-softmax state (acc = out, m = lse, l = 1) and
    merged by the rule split-kv merges its pieces by (``cpu.split_kv.merge_rows``), then
    finished as a kernel's row is (``numerics.core.row_total``: row r's denominator with the
    sink of query head heads[r] where ``sinks`` is not empty); 0 and -inf where no part kept
    it."""
    P, R, D = outs.shape
    pml = np.empty((P, R, 2), np.float32)
    pml[:, :, 0] = lses
    pml[:, :, 1] = F32_ONE
    acc = np.empty(R * D, np.float32)
    state = RowState(np.empty(R, np.float32), np.empty(R, np.float32),
                     np.empty(R, np.float32))
    merge_rows((outs.reshape(P, R * D), pml), 0, P, R, D, D, acc, state, 0)
    out = np.zeros((R, D), np.float32)
    lse = np.empty(R, np.float32)
    for r in range(R):
        lse[r] = F32_NEG_INF
        if state.m[r] != F32_NEG_INF:
            total, lse[r] = row_total(state.m[r], state.l[r], sink_of(sinks, heads[r]), 0)
            out[r] = acc[r * D:(r + 1) * D] / total
    return out, lse


def _row_heads(shape, layout):
    """The query head of each row of (B, N, Sq) rows ((T, N) for TND), flattened."""
    heads = np.arange(shape[1], dtype=np.int64)
    if layout == "TND":
        return np.broadcast_to(heads[None, :], shape).reshape(-1).copy()
    return np.broadcast_to(heads[None, :, None], shape).reshape(-1).copy()


def _heads_first(out, layout, heads):
    """An output in ``layout`` as a (B, N, Sq, D) view ((T, N, D) for TND)."""
    if layout == "BSH":
        b, s, h = out.shape
        out = out.reshape(b, s, heads, h // heads)
    return out.transpose(0, 2, 1, 3) if layout in ("BSH", "BSND", "BNSD_BSND") else out


def _in_layout(rows, layout, shape):
    """(B, N, Sq, D) / (T, N, D) rows back in ``layout``'s output of ``shape``."""
    if layout in ("BSH", "BSND", "BNSD_BSND"):
        rows = rows.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(rows).reshape(shape)


def _lse_shape(shape, layout, heads):
    """softmax_lse's shape for an output of ``shape`` in ``layout`` with ``heads`` heads."""
    if layout == "TND":
        return (shape[0], shape[1], 1)
    if layout == "BNSD":
        return (shape[0], shape[1], shape[2], 1)
    return (shape[0], heads, shape[1], 1)


def merge_attention(parts, input_layout="BSH", *, sinks=None):
    """Merge ``[(out_1, lse_1), (out_2, lse_2), ...]`` over disjoint kv ranges.

    ``input_layout`` is the layout the parts were computed with (it fixes the output layout:
    BSH, BNSD, BSND, BNSD_BSND or TND). Outputs are float16, bfloat16 or float32 NumPy arrays
    of one shape and dtype; the lse arrays float32 (B, N, Sq, 1) or, for TND, (T, N, 1).
    The rows merge in float32 by the rule split-kv merges its pieces by (one online-softmax
    rule for both). ``sinks`` (an extension, as scaled_dot_product_attention's: None, or one
    real number a query head) joins the merged rows once, for parts computed without them.
    Returns ``(out, lse)`` in the parts' dtype and layout, rounded once; torch CPU tensor parts
    give torch tensors.
    """
    layout = checks.check_layout(input_layout)
    parts = list(parts)
    if not parts:
        raise ValueError("parts must hold at least one (out, softmax_lse) pair, got none")
    outs, lses = [], []
    for idx, part in enumerate(parts):
        try:
            out, lse = part
        except (TypeError, ValueError):
            raise TypeError(f"parts[{idx}] must be an (out, softmax_lse) pair, got "
                            f"{type(part).__name__}") from None
        if idx == 0:
            tensors = torch_tensors.is_cpu_tensor(out)
        out, lse = (torch_tensors.as_numpy(name, x) if torch_tensors.is_cpu_tensor(x) else x
                    for name, x in ((f"parts[{idx}] out", out), (f"parts[{idx}] softmax_lse", lse)))
        outs.append(checks.check_array(f"parts[{idx}] out", out))
        lses.append(checks.check_array(f"parts[{idx}] softmax_lse", lse))
    shape, dtype, lse_shape = outs[0].shape, outs[0].dtype, lses[0].shape
    for idx, (o, l) in enumerate(zip(outs, lses)):
        if o.shape != shape or o.dtype != dtype:
            raise ValueError(f"parts[{idx}] out is {dtype_name(o.dtype)} "
                             f"{checks.shape_str(o.shape)}, parts[0] out is "
                             f"{dtype_name(dtype)} {checks.shape_str(shape)}")
        if l.shape != lse_shape:
            raise ValueError(f"parts[{idx}] softmax_lse has shape {checks.shape_str(l.shape)}, "
                             f"parts[0] has {checks.shape_str(lse_shape)}")
    heads = lse_shape[1] if len(lse_shape) > 1 else 0
    if not heads or lse_shape != _lse_shape(shape, layout, heads) or \
            (layout == "BSH" and shape[2] % heads):
        raise ValueError(f"parts[0] softmax_lse has shape {checks.shape_str(lse_shape)}, which "
                         f"is not that of out {checks.shape_str(shape)} in layout {layout}")
    rows = [_heads_first(o, layout, heads) for o in outs]
    d = rows[0].shape[-1]
    sinks = np.empty(0, np.float32) if sinks is None else sink_logits(sinks, heads)
    merged, lse = _merge(np.stack([np.ascontiguousarray(x, np.float32).reshape(-1, d)
                                   for x in rows]),
                         np.stack([l.reshape(-1).astype(np.float32) for l in lses]), sinks,
                         _row_heads(rows[0].shape[:-1], layout))
    with np.errstate(over="ignore", under="ignore"):  # rounding to the output dtype, as a call does
        out = _in_layout(merged.reshape(rows[0].shape), layout, shape).astype(dtype)
    lse = lse.reshape(lse_shape)
    return (torch_tensors.as_tensor(out), torch_tensors.as_tensor(lse)) if tensors else (out, lse)
