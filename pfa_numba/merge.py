"""Exact merging of attention results computed over disjoint key/value ranges
(docs/contract.md, section 9).

Each part is the ``(out, softmax_lse)`` pair that ``prompt_flash_attention(...,
return_softmax_lse=True)`` returns for the same queries and one slice of the keys/values::

    lse = logaddexp(lse_1, ..., lse_k)
    out = sum_p out_p * exp(lse_p - lse)

A part whose lse is -inf (it kept nothing for that row) weighs exactly 0, even where its output
is NaN; a row that is -inf in every part comes out 0 with lse -inf. The merge equals the single
call over the whole kv range (up to the output dtype's rounding) for every row with kept mass.
"""
import numpy as np

from .interop import torch_tensors
from .frontend import checks
from .numerics.dtypes import dtype_name


def _weights_to_out_layout(w, layout, out_shape):
    """Per-row weights (B, N, Sq, 1) / (T, N, 1) broadcast against the output's layout."""
    if layout in ("BNSD", "TND"):
        return w
    w = w.transpose(0, 2, 1, 3)                       # (B, Sq, N, 1)
    if layout == "BSH":
        b, s, n, _ = w.shape
        d = out_shape[-1] // n
        return np.repeat(w, d, axis=3).reshape(b, s, n * d)
    return w                                          # BSND, BNSD_BSND: (B, Sq, N, D)


def merge_attention(parts, input_layout="BSH"):
    """Merge ``[(out_1, lse_1), (out_2, lse_2), ...]`` over disjoint kv ranges.

    ``input_layout`` is the layout the parts were computed with (it fixes the output layout:
    BSH, BNSD, BSND, BNSD_BSND or TND). Outputs are float16, bfloat16 or float32 NumPy arrays
    of one shape and dtype; the lse arrays float32 (B, N, Sq, 1) or, for TND, (T, N, 1).
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
    lse_all = np.stack([l.astype(np.float64) for l in lses])
    with np.errstate(invalid="ignore", over="ignore"):
        lse = np.logaddexp.reduce(lse_all, axis=0)      # -inf where every part is -inf
        acc = np.zeros(shape, np.float64)
        for o, lp in zip(outs, lse_all):
            kept = np.isfinite(lp) | (lp == np.inf)
            w = np.where(kept, np.exp(lp - np.where(np.isneginf(lse), 0.0, lse)), 0.0)
            w = _weights_to_out_layout(w, layout, shape)
            contrib = o.astype(np.float64) * w
            acc += np.where(w == 0, 0.0, contrib)       # weight 0: ignored, even if NaN
    with np.errstate(over="ignore", under="ignore"):  # rounding to the output dtype, as a call does
        out, lse = acc.astype(dtype), lse.astype(np.float32)
    return (torch_tensors.as_tensor(out), torch_tensors.as_tensor(lse)) if tensors else (out, lse)
