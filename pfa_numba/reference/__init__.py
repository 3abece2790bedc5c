"""The meaning of ``prompt_flash_attention``, written out in float64 NumPy.

This module is the executable form of docs/contract.md: tests, notebooks and users compare the fast
kernels against it.  It is deliberately slow and simple: every layout is converted to
(B, N, S, D) float64, grouped-query attention is done by repeating K/V heads, and for every
batch and head the full (Sq x Skv) score matrix, keep-mask and probability matrix are
materialised.  Nothing here is tiled and nothing depends on the kernels (no numba, no imports
from the rest of ``pfa_numba``).

Public functions
----------------
``prompt_flash_attention(query, key, value, ...)``
    Same positional arguments and defaults as contract 'Signature' (minus ``device``), plus the
    keyword-only ``return_softmax_lse`` and ``compute_dtype``.  Returns float64 arrays in the output
    layout of contract 'Layouts': the exact attention output before rounding to the output dtype
    (floating inputs), or the exact model of the quantized pipeline of contract 'Quantization'
    including its final rounding (int8 inputs and/or int8 output).
``keep_mask(Sq, Skv, qL, kL, ...)``
    The boolean (Sq, Skv) keep-mask of contract 'The band' (band), optionally intersected with a
    user discard mask (§4.2).  Handy for drawing the band in notebooks.
``band_edges(qL, kL, ...)``
    The (preE, nextE) pair of the §4.1 table that ``keep_mask`` uses (ints or ``math.inf``).
``trans_quant_param(scale)``
    Ascend's packed uint64 form of a float32 dequantization scale (contract 'Quantization').
``fused_infer_attention_score(query, key, value, ...)``
    FIA (:mod:`.fia`): the decode branch, paged / listed / prefixed / left-padded KV caches and
    int8 KV dequantization, reduced batch by batch to ``prompt_flash_attention``.

The input is assumed to be valid per contract 'Errors'; only a few clearly broken inputs raise
``ValueError``.
"""

import math

import ml_dtypes
import numpy as np

__all__ = ["prompt_flash_attention", "keep_mask", "band_edges", "trans_quant_param",
           "fused_infer_attention_score"]

#: pre_tokens / next_tokens at or above this value mean "+infinity" (contract 'The band').
INF_TOKENS = 2147483647

# Finite band edges are clipped to +-2**40: any value beyond the sequence lengths gives the same
# band, and clipping keeps the int64 index arithmetic from overflowing.
_EDGE_CLIP = 2 ** 40

_LAYOUTS = ("BSH", "BNSD", "BSND", "BNSD_BSND", "TND")


# ---------------------------------------------------------------------------------------------
# Small rounding helpers
# ---------------------------------------------------------------------------------------------

def _round_to(x, dtype):
    """Round float64 values to ``dtype`` (round to nearest, ties to even) and back to float64."""
    with np.errstate(over="ignore", under="ignore"):   # +-inf and subnormals are the rounding
        return np.asarray(x, dtype=np.float64).astype(dtype).astype(np.float64)


def _fp16(x):
    """the contract's ``fp16(x)``: round to float16 and return the value as float64."""
    return _round_to(x, np.float16)


def _fp32(x):
    """Round to float32 and return the value as float64."""
    return _round_to(x, np.float32)


def _saturate_int8(x):
    """``saturate_int8(round_half_even(x))`` of contract 'Quantization' (NaN stays NaN; the caller
    decides)."""
    return np.clip(np.rint(x), -128.0, 127.0)


# ---------------------------------------------------------------------------------------------
# Quantization parameters (contract 'Quantization')
# ---------------------------------------------------------------------------------------------

def trans_quant_param(scale):
    """Ascend's packed uint64 form of float32 scales, elementwise (contract 'Quantization').

    ``(bits(float32(scale)) & 0xFFFFE000) | (1 << 46)``: the 13 low mantissa bits are dropped and
    bit 46 is set.  Accepts any array-like of scales; the result has the same shape, dtype uint64.
    """
    bits = np.asarray(scale, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return (bits & np.uint64(0xFFFFE000)) | np.uint64(1 << 46)


def _dequant_scale(deq):
    """The float value of deq_scale1 / deq_scale2 (shape (1,)) as a Python float.

    uint64 (packed form): ``float32_from_bits(u64 & 0xFFFFE000)`` of the low 32 bits.
    float32: used as is (other floating dtypes are read as float32).
    """
    arr = np.asarray(deq)
    if arr.size != 1:
        raise ValueError(f"deq_scale must have exactly one element, got shape {arr.shape}")
    if arr.dtype == np.uint64 or arr.dtype == np.int64:
        low = int(arr.reshape(-1)[0]) & 0xFFFFFFFF & 0xFFFFE000
        return float(np.array(low, dtype=np.uint32).view(np.float32))
    return float(arr.reshape(-1)[0].astype(np.float32))


def _per_channel(param, N, D, default):
    """quant_scale2 / quant_offset2 as a float64 (N, D) table: element (n, d) is flat[n*D + d].

    Per-tensor parameters (one element) are broadcast; None gives ``default`` everywhere.
    """
    if param is None:
        return np.full((N, D), float(default))
    flat = np.asarray(param).astype(np.float64).reshape(-1)
    if flat.size == 1:
        return np.full((N, D), flat[0])
    if flat.size != N * D:
        raise ValueError(f"quant_scale2/quant_offset2 must have 1 or H={N * D} elements, "
                         f"got {flat.size}")
    return flat.reshape(N, D)


def _quantize_output(o, zero_rows, scale2, offset2):
    """Output quantization of contract 'Quantization' for one head.

    ``y = clip(round_half_even(fp16(fp16(fp16(O) * fp16(s2[c])) + fp16(o2[c]))), -128, 127)``,
    NaN becomes 0, and rows that are structural zeros (§5) stay 0 instead of round(offset).
    ``scale2`` / ``offset2`` are the (D,) channel values of this head.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        y = _fp16(_fp16(o) * _fp16(scale2)[None, :])
        y = _fp16(y + _fp16(offset2)[None, :])
        y = _saturate_int8(y)
    y[np.isnan(y)] = 0.0
    y[zero_rows] = 0.0
    return y


# ---------------------------------------------------------------------------------------------
# The band and the keep-mask (contract 'The band' and 'The user mask')
# ---------------------------------------------------------------------------------------------

def _as_edge(tokens):
    """pre_tokens / next_tokens as a band edge: +inf at or above 2147483647, else clipped int."""
    tokens = int(tokens)
    if tokens >= INF_TOKENS:
        return math.inf
    return max(-_EDGE_CLIP, min(_EDGE_CLIP, tokens))


def band_edges(qL, kL, sparse_mode=0, pre_tokens=INF_TOKENS, next_tokens=0, has_mask=False):
    """(preE, nextE) of the contract 'The band' table for one batch with actual lengths (qL, kL).

    Modes 3 and 4 are anchored at the bottom-right corner of the actual (qL, kL) rectangle.
    Edges are ints or ``math.inf``.
    """
    inf = math.inf
    if sparse_mode == 0:
        if not has_mask:
            return inf, inf                      # no mask: pre/next ignored
        return _as_edge(pre_tokens), _as_edge(next_tokens)
    if sparse_mode == 1:                         # allMask
        return inf, inf
    if sparse_mode == 2:                         # leftUpCausal
        return inf, 0
    if sparse_mode == 3:                         # rightDownCausal
        return inf, kL - qL
    if sparse_mode == 4:                         # band, anchored bottom-right
        return _as_edge(pre_tokens) - (kL - qL), _as_edge(next_tokens) + (kL - qL)
    raise ValueError(f"sparse_mode must be in 0..4, got {sparse_mode!r}")


def keep_mask(Sq, Skv, qL, kL, sparse_mode=0, pre_tokens=INF_TOKENS, next_tokens=0,
              has_mask=False, user_mask=None):
    """The boolean (Sq, Skv) keep-mask of one batch: True where query row i attends to column j.

    The band of contract 'The band': ``i < qL`` and ``0 <= j < kL`` and ``i - preE <= j <= i +
    nextE``, with (preE, nextE) from the sparse_mode table (``has_mask`` says whether an attn_mask
    was given, which decides whether mode 0 uses pre/next); pre/next >= 2147483647 mean +inf.  Rows
    ``i >= qL`` are all False.

    ``user_mask`` is a 2-D boolean *discard* mask (True = masked out, contract 'The user mask') of
    shape at least (Sq, Skv); its window [:Sq, :Skv] is removed from the band.  Only modes 0 and 1
    read a user mask: in modes 2, 3 and 4 it is ignored (Ascend never reads their 2048x2048 mask).
    Giving a ``user_mask`` implies ``has_mask=True``.
    """
    if not (0 <= qL <= Sq and 0 <= kL <= Skv):
        raise ValueError(f"need 0 <= qL <= Sq and 0 <= kL <= Skv, got qL={qL}, Sq={Sq}, "
                         f"kL={kL}, Skv={Skv}")
    has_mask = bool(has_mask) or user_mask is not None
    pre_e, next_e = band_edges(qL, kL, sparse_mode, pre_tokens, next_tokens, has_mask)
    i = np.arange(Sq)[:, None]
    j = np.arange(Skv)[None, :]
    keep = (i < qL) & (j < kL) & (j >= i - pre_e) & (j <= i + next_e)
    if user_mask is not None and sparse_mode in (0, 1):
        discard = np.asarray(user_mask)[:Sq, :Skv].astype(bool)
        keep &= ~discard
    return keep


def _user_mask_2d(attn_mask, b, Sq, Skv):
    """The (Sq, Skv) window of the user mask that applies to batch b (contract 'The user mask'
    shapes)."""
    m = np.asarray(attn_mask)
    if m.ndim == 2:                              # (Sq, Skv)
        m2 = m
    elif m.ndim == 3:                            # (B or 1, Sq, Skv)
        m2 = m[b if m.shape[0] > 1 else 0]
    elif m.ndim == 4:                            # (B or 1, 1, Sq, Skv)
        m2 = m[b if m.shape[0] > 1 else 0, 0]
    else:
        raise ValueError(f"attn_mask must have rank 2, 3 or 4, got shape {m.shape}")
    if m2.shape[0] < Sq or m2.shape[1] < Skv:
        raise ValueError(f"attn_mask window {m2.shape} smaller than (Sq, Skv)=({Sq}, {Skv})")
    return m2[:Sq, :Skv]


# ---------------------------------------------------------------------------------------------
# Layouts (contract 'Layouts')
# ---------------------------------------------------------------------------------------------

def as_bnsd(x, layout, heads):
    """An input tensor in ``layout`` as a (B, heads, S, D) array (dtype unchanged)."""
    x = np.asarray(x)
    if layout == "BSH":
        if x.ndim != 3:
            raise ValueError(f"BSH input must have rank 3, got shape {x.shape}")
        B, S, H = x.shape
        if H % heads:
            raise ValueError(f"hidden size {H} not divisible by {heads} heads")
        return x.reshape(B, S, heads, H // heads).transpose(0, 2, 1, 3)
    if x.ndim != 4:
        raise ValueError(f"{layout} input must have rank 4, got shape {x.shape}")
    if layout == "BSND":
        return x.transpose(0, 2, 1, 3)
    return x                                     # BNSD, BNSD_BSND


def from_bnsd(o, layout):
    """A (B, N, Sq, D) result in the output layout of contract 'Layouts'."""
    B, N, Sq, D = o.shape
    if layout == "BSH":
        return o.transpose(0, 2, 1, 3).reshape(B, Sq, N * D)
    if layout in ("BSND", "BNSD_BSND"):
        return o.transpose(0, 2, 1, 3)
    return o                                     # BNSD


def actual_lengths(actual, B, S, name):
    """Per-batch actual lengths (contract 'Lengths'): None -> S for all, length 1 -> broadcast."""
    if actual is None:
        return [S] * B
    vals = [int(v) for v in np.asarray(actual).reshape(-1)]
    if len(vals) == 1:
        vals = vals * B
    if len(vals) != B:
        raise ValueError(f"{name} must have 1 or B={B} values, got {len(vals)}")
    for v in vals:
        if not 0 <= v <= S:
            raise ValueError(f"{name} values must be in [0, {S}], got {v}")
    return vals


# ---------------------------------------------------------------------------------------------
# One (batch, head): floating-point inputs (contract 'The computation', 'Empty rows' and
# 'softmax_lse and merging')
# ---------------------------------------------------------------------------------------------

def _softmax_over_kept(s, kept):
    """Row max m, exp(s - m) over kept columns (0 elsewhere), row sum l.

    Masked columns are removed, not added as a large negative.  A kept +inf or NaN makes the
    row NaN through ordinary float arithmetic.  Rows with nothing kept get m = -inf, l = 0.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.max(np.where(kept, s, -np.inf), axis=1, initial=-np.inf)
        e = np.where(kept, np.exp(s - m[:, None]), 0.0)
    return m, e, e.sum(axis=1)


def _with_sink(m, e, l, sink):
    """(m, e, l) of :func:`_softmax_over_kept` with a sink logit in every row's softmax:
    the max over the kept scores and the sink, e rescaled to it, the sink's term in l."""
    m_new = np.maximum(m, sink)
    with np.errstate(invalid="ignore"):
        old = np.where(m == -np.inf, 0.0, np.exp(m - m_new))
    return m_new, e * old[:, None], l * old + np.exp(sink - m_new)


def _log_sum_exp(m, l, nothing_kept):
    """softmax_lse of contract 'softmax_lse and merging': ``m + log(l)``, -inf where nothing is
    kept."""
    with np.errstate(invalid="ignore", divide="ignore"):
        lse = m + np.log(l)
    lse[nothing_kept] = -np.inf
    return lse


def _weighted_sum(p, kept, v):
    """``sum over kept j of p[i, j] * v[j, :]``.

    Columns that are not kept contribute exactly nothing, even when V holds NaN/inf there
    (0 * NaN would be NaN), so in that case the rows are summed one at a time over their kept
    columns only.
    """
    if np.isfinite(v).all():
        return np.where(kept, p, 0.0) @ v
    out = np.zeros((p.shape[0], v.shape[1]))
    for i in range(p.shape[0]):
        out[i] = p[i, kept[i]] @ v[kept[i]]
    return out


def _band_mean_of_v(band, v, rows):
    """Mean of V over the band columns, for the given rows (contract 'Empty rows', inner_precise
    0/1)."""
    out = np.zeros((len(rows), v.shape[1]))
    for r, i in enumerate(rows):
        out[r] = v[band[i]].mean(axis=0)
    return out


def _attend_float(q, k, v, scale_value, bias, keep, band, inner_precise, compute_dtype,
                  softcap=None, sink=None):
    """Attention of one (batch, head) with floating inputs, all float64.

    q (Sq, D), k and v (Skv, D); ``bias`` (Sq, Skv) is pse plus the additive fp16 mask term (or
    None); ``keep`` is the keep-mask (band minus user mask), ``band`` the band alone.
    Returns (out (Sq, D), lse (Sq,), zero_rows (Sq,) bool: rows that are structural zeros).
    With ``compute_dtype``, q, k, v, the scores, the probabilities and the output are rounded to
    it (the reference run "in the input dtype", used to size tolerances). ``softcap`` (an
    extension, not Ascend's): the scaled scores become softcap * tanh(score / softcap) before
    pse and masks. ``sink`` (an extension: gpt-oss's attention sink of this head): a logit that
    joins the softmax denominator (and the lse) of every row that keeps a score, without a
    value row; a row that keeps nothing stays as contract 'Empty rows' makes it.
    """
    rnd = (lambda x: x) if compute_dtype is None else (lambda x: _round_to(x, compute_dtype))
    q, k, v = rnd(q), rnd(k), rnd(v)

    # Scores: scaled, pse (and fp16 additive mask) added after scaling.
    with np.errstate(invalid="ignore", over="ignore"):
        s = scale_value * (q @ k.T)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    # A kept score of -inf counts as masked (decided on the exact score).
    kept = keep & (s != -np.inf)
    s = rnd(s)

    m, e, l = _softmax_over_kept(s, kept)
    nothing_kept = ~kept.any(axis=1)
    if sink is not None:
        m, e, l = _with_sink(m, e, l, sink)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(kept, e / np.where(nothing_kept, 1.0, l)[:, None], 0.0)
    p = rnd(p)
    out = rnd(_weighted_sum(p, kept, v))
    lse = _log_sum_exp(m, l, nothing_kept)

    # contract 'Empty rows': rows with nothing to attend to.
    empty_band = ~band.any(axis=1)               # includes rows i >= qL and kL == 0
    fully_masked = nothing_kept & ~empty_band
    out[empty_band] = 0.0
    if inner_precise in (2, 3):
        out[fully_masked] = 0.0
        zero_rows = empty_band | fully_masked
    else:
        rows = np.flatnonzero(fully_masked)
        out[rows] = rnd(_band_mean_of_v(band, v, rows))
        zero_rows = empty_band
    return out, lse, zero_rows


# ---------------------------------------------------------------------------------------------
# One (batch, head): int8 inputs (contract 'Quantization')
# ---------------------------------------------------------------------------------------------

def _attend_int8(q, k, v, deq1, quant_scale1, deq2, scale_value, pse, keep, band,
                 inner_precise):
    """The int8 pipeline of contract 'Quantization' for one (batch, head), modelled step by step.

    q (Sq, D), k and v (Skv, D) are int8; ``pse`` (Sq, Skv) fp16 values or None.
    Returns (O (Sq, D) as fp16 values in float64, lse (Sq,), zero_rows (Sq,) bool).

    - A = sum_d q*k, exact integers.
    - s = fp16(fp16(A * deq1) * fp16(scale_value)) (+ pse, fp16): each product formed exactly
      in float64 and rounded once to fp16.
    - m = row max over kept; E = float32(exp(s - m)) (s - m is exact in float64);
      l = float32(sum of E) (summed in float64, rounded once).
    - P8 = saturate_int8(round_half_even(E * quant_scale1)) (product exact in float64).
    - O = fp16(deq2 * sum_j P8 * v / l): integer sum exact, one rounding at the end.
    Fully masked rows with inner_precise 0/1: as if every band score were equal (E = 1 on the
    band).  softmax_lse is log(sum exp(s)) over the kept fp16 scores, in float64.
    """
    qs1 = float(np.asarray(quant_scale1, dtype=np.float32).reshape(-1)[0])
    a = q.astype(np.int64) @ k.astype(np.int64).T                  # exact integer dot products
    s = _fp16(_fp16(a.astype(np.float64) * deq1) * _fp16(scale_value))
    if pse is not None:
        s = _fp16(s + pse)
    kept = keep & (s != -np.inf)
    nothing_kept = ~kept.any(axis=1)
    empty_band = ~band.any(axis=1)
    fully_masked = nothing_kept & ~empty_band

    m, e64, l64 = _softmax_over_kept(s, kept)
    lse = _log_sum_exp(m, l64, nothing_kept)

    e = _fp32(e64)                                                 # E in float32
    if inner_precise in (0, 1):
        e[fully_masked] = np.where(band[fully_masked], 1.0, 0.0)   # every band score equal
    l = _fp32(e.sum(axis=1))                                       # l in float32
    with np.errstate(invalid="ignore"):
        p8 = _saturate_int8(e * qs1)
        acc = p8 @ v.astype(np.float64)        # integer-valued, exact (< 2**53), NaN propagates
        o = _fp16(deq2 * acc / np.where(l == 0.0, 1.0, l)[:, None])
    o[empty_band] = 0.0
    zero_rows = empty_band.copy()
    if inner_precise in (2, 3):
        o[fully_masked] = 0.0
        zero_rows |= fully_masked
    return o, lse, zero_rows


# ---------------------------------------------------------------------------------------------
# The operator
# ---------------------------------------------------------------------------------------------

def _attention_bnsd(q, k, v, attn_mask, q_lens, kv_lens, pse_shift, deq_scale1, quant_scale1,
                    deq_scale2, quant_scale2, quant_offset2, scale_value, pre_tokens,
                    next_tokens, sparse_mode, inner_precise, compute_dtype, softcap=None,
                    sinks=None):
    """The computation on (B, N, Sq, D) / (B, Nkv, Skv, D) arrays; returns float64 (out, lse)."""
    B, N, Sq, D = q.shape
    Nkv, Skv = k.shape[1], k.shape[2]
    if N % Nkv:
        raise ValueError(f"query heads {N} not a multiple of key/value heads {Nkv}")
    G = N // Nkv
    # GQA: query head n reads kv head n // G.
    k = np.repeat(k, G, axis=1)
    v = np.repeat(v, G, axis=1)

    int8_in = q.dtype == np.int8
    int8_out = quant_scale2 is not None
    if int8_in:
        deq1 = _dequant_scale(deq_scale1)
        deq2 = _dequant_scale(deq_scale2)
    else:
        q, k, v = (x.astype(np.float64) for x in (q, k, v))
    if int8_in or int8_out:
        compute_dtype = None                      # quantized paths are exact models already
    Dv = v.shape[-1]                              # the value head dim (an extension: D's)
    if int8_out:
        scale2 = _per_channel(quant_scale2, N, Dv, 1.0)
        offset2 = _per_channel(quant_offset2, N, Dv, 0.0)

    has_mask = attn_mask is not None
    mask_arr = np.asarray(attn_mask) if has_mask else None
    mask_read = has_mask and sparse_mode in (0, 1)
    additive = mask_read and mask_arr.dtype == np.float16
    if additive and int8_in:
        raise ValueError("a float16 attn_mask needs a float16 query")

    out = np.zeros((B, N, Sq, Dv))
    lse = np.full((B, N, Sq), -np.inf)
    for b in range(B):
        qL, kL = q_lens[b], kv_lens[b]
        band = keep_mask(Sq, Skv, qL, kL, sparse_mode, pre_tokens, next_tokens, has_mask)
        keep = band
        mask_bias = None
        if mask_read:
            window = _user_mask_2d(mask_arr, b, Sq, Skv)
            if additive:
                # fp16 mask: additive -10000 * mask, the term computed in float32; removes nothing
                term = np.float32(-10000.0) * window.astype(np.float32)
                mask_bias = term.astype(np.float64)
            else:
                keep = band & (window == 0)       # nonzero = discard
        for n in range(N):
            pse = None
            if pse_shift is not None:
                ps = np.asarray(pse_shift)
                pse = ps[b if ps.shape[0] > 1 else 0, n, :Sq, :Skv].astype(np.float64)
            if int8_in:
                o, l, zero_rows = _attend_int8(q[b, n], k[b, n], v[b, n], deq1, quant_scale1,
                                               deq2, scale_value, pse, keep, band,
                                               inner_precise)
            else:
                bias = pse
                if mask_bias is not None:
                    bias = mask_bias if bias is None else bias + mask_bias
                o, l, zero_rows = _attend_float(q[b, n], k[b, n], v[b, n], float(scale_value),
                                                bias, keep, band, inner_precise, compute_dtype,
                                                softcap, None if sinks is None else sinks[n])
            if int8_out:
                o = _quantize_output(o, zero_rows, scale2[n], offset2[n])
            out[b, n] = o
            lse[b, n] = l
    return out, lse[..., None]


def _tnd_bounds(ends, total, name):
    """[start, end) row ranges of the packed sequences from cumulative ends (contract 'Layouts'
    TND)."""
    if ends is None:
        raise ValueError(f"TND layout requires {name}")
    ends = [int(e) for e in np.asarray(ends).reshape(-1)]
    if any(b < a for a, b in zip([0] + ends, ends)) or (ends[-1] if ends else 0) != total:
        raise ValueError(f"{name} must be non-decreasing cumulative ends ending at {total}, "
                         f"got {ends}")
    return list(zip([0] + ends[:-1], ends))


def prompt_flash_attention(
        query, key, value,                               # §3: shapes per input_layout
        attn_mask=None,                                  # §4.2
        actual_seq_lengths=None, actual_seq_lengths_kv=None,   # §6 (cumulative ends for TND)
        pse_shift=None,                                  # §7
        deq_scale1=None, quant_scale1=None, deq_scale2=None,   # §8
        quant_scale2=None, quant_offset2=None,           # §8: int8 output
        num_heads=1, scale_value=1.0,
        pre_tokens=2147483647, next_tokens=0,            # §4.1: the band
        input_layout='BSH', num_key_value_heads=0,
        sparse_mode=0,                                   # §4.1
        inner_precise=1,                                 # §5: rows that keep nothing
        *, return_softmax_lse=False,                     # §9
        compute_dtype=None, softcap=None, sinks=None):
    """Reference ``prompt_flash_attention`` (docs/contract.md), in float64 NumPy.

    Arguments are those of contract 'Signature' (NumPy arrays of float16, ml_dtypes.bfloat16,
    float32 or int8); the call is assumed valid per contract 'Errors'.

    Returns a float64 array in the output layout of contract 'Layouts' ((B, Sq, H) for BSH, (B, N,
    Sq, D) for BNSD, (B, Sq, N, D) for BSND and BNSD_BSND, (T, N, D) for TND):

    - floating inputs, floating output: the exact result before rounding to the output dtype;
    - int8 inputs with float16 output: the fp16 values of the §8 model (final rounding included);
    - int8 output (``quant_scale2`` given): the int8 values of the §8 model.

    ``return_softmax_lse=True`` returns ``(out, lse)``, lse float64 of shape (B, N, Sq, 1)
    (TND: (T, N, 1)): log of the sum of exp over the kept scores (scaled, pse added, fp16
    additive mask included), -inf for rows with nothing kept (contract 'softmax_lse and merging').

    ``compute_dtype`` (np.float16, np.float32 or ml_dtypes.bfloat16; floating paths only): run
    the same computation with q, k, v, the scores, the probabilities and the output rounded to
    that dtype.  The difference from the float64 run is "the error of the reference run in the
    input dtype", a yardstick for test tolerances.  Ignored when int8 is involved.

    ``softcap`` (an extension for the SDPA drop-in, not Ascend's; floating paths only): the
    scaled scores become ``softcap * tanh(score / softcap)`` before pse and masks (Gemma 2's
    attention logit softcapping). ``sinks`` (an extension, floating paths only): one logit a
    query head (N,) that joins each row's softmax denominator and its lse without a value row
    (gpt-oss's attention sinks).
    """
    if input_layout not in _LAYOUTS:
        raise ValueError(f"input_layout must be one of {_LAYOUTS}, got {input_layout!r}")
    if compute_dtype is not None:
        compute_dtype = np.dtype(compute_dtype)
    query, key, value = np.asarray(query), np.asarray(key), np.asarray(value)
    common = dict(deq_scale1=deq_scale1, quant_scale1=quant_scale1, deq_scale2=deq_scale2,
                  quant_scale2=quant_scale2, quant_offset2=quant_offset2,
                  scale_value=scale_value, pre_tokens=pre_tokens, next_tokens=next_tokens,
                  sparse_mode=sparse_mode, inner_precise=inner_precise,
                  compute_dtype=compute_dtype, softcap=softcap,
                  sinks=None if sinks is None else np.asarray(sinks, np.float64))

    if input_layout == "TND":
        out, lse = _prompt_flash_attention_tnd(query, key, value, attn_mask,
                                               actual_seq_lengths, actual_seq_lengths_kv,
                                               pse_shift, common)
    else:
        N = int(num_heads)
        if input_layout == "BSH":
            D = query.shape[2] // N
            Nkv = key.shape[2] // D if D else (int(num_key_value_heads) or N)
        else:
            Nkv = int(num_key_value_heads) or N
        q = as_bnsd(query, input_layout, N)
        k = as_bnsd(key, input_layout, Nkv)
        v = as_bnsd(value, input_layout, Nkv)
        B, Sq, Skv = q.shape[0], q.shape[2], k.shape[2]
        q_lens = actual_lengths(actual_seq_lengths, B, Sq, "actual_seq_lengths")
        kv_lens = actual_lengths(actual_seq_lengths_kv, B, Skv, "actual_seq_lengths_kv")
        out, lse = _attention_bnsd(q, k, v, attn_mask, q_lens, kv_lens, pse_shift, **common)
        out = from_bnsd(out, input_layout)
    return (out, lse) if return_softmax_lse else out


def _prompt_flash_attention_tnd(query, key, value, attn_mask, ends_q, ends_kv, pse_shift,
                                common):
    """TND: every packed sequence computed on its own with qL = Sq = its length, kL = Skv."""
    if query.ndim != 3 or key.ndim != 3:
        raise ValueError("TND query/key/value must have rank 3")
    if pse_shift is not None or (attn_mask is not None and common["sparse_mode"] in (0, 1)):
        raise ValueError("TND supports neither pse_shift nor a user mask (contract 'Layouts')")
    T, N, D = query.shape
    bounds_q = _tnd_bounds(ends_q, T, "actual_seq_lengths")
    bounds_kv = _tnd_bounds(ends_kv, key.shape[0], "actual_seq_lengths_kv")
    if len(bounds_q) != len(bounds_kv):
        raise ValueError("actual_seq_lengths and actual_seq_lengths_kv differ in length")
    out = np.zeros((T, N, value.shape[-1]))
    lse = np.full((T, N, 1), -np.inf)
    for (q0, q1), (k0, k1) in zip(bounds_q, bounds_kv):
        # (L, N, D) -> (1, N, L, D)
        q = query[q0:q1].transpose(1, 0, 2)[None]
        k = key[k0:k1].transpose(1, 0, 2)[None]
        v = value[k0:k1].transpose(1, 0, 2)[None]
        o, l = _attention_bnsd(q, k, v, attn_mask, [q1 - q0], [k1 - k0], None, **common)
        out[q0:q1] = o[0].transpose(1, 0, 2)
        lse[q0:q1] = l[0].transpose(1, 0, 2)
    return out, lse


from .fia import fused_infer_attention_score  # noqa: E402  (fia builds on the above)
