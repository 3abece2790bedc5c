"""The canonical problem: what every backend needs, as strided views, small int arrays and ints.

``plan(...)`` validates a call (with :mod:`._validate`) and turns it into a :class:`Problem`:

* query/key/value as strided views, never copies: ``(B, N, S, D)`` for the padded layouts, the
  packed ``(T, N, D)`` arrays plus per-sequence row starts for TND;
* per batch: qL, kL and the band edges (preE, nextE) of SPEC 4.1, with ``BAND_INF`` for +inf;
* the user mask as a ``(Bm, Sq, Skv)`` window (Bm = 1 or B) and its kind, pse as
  ``(Bp, N, Sq, Skv)``; sparse modes 2-4 keep no mask (their band comes from the table);
* the output dtype and layout.
"""
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import _validate as V
from ._band import band_edges
from ._core import CODE_BF16, CODE_F16, CODE_F32, MASK_ADD_F16, MASK_DISCARD, MASK_NONE

_QUANT_ARGS = ("deq_scale1", "quant_scale1", "deq_scale2", "quant_scale2", "quant_offset2")


@dataclass
class Problem:
    layout: str
    B: int
    N: int
    Nkv: int
    G: int
    Sq: int
    Skv: int
    D: int
    dtype: np.dtype          # query/key/value dtype
    out_dtype: np.dtype
    code: int                # storage code of query/key/value (CODE_*)
    q: np.ndarray            # (B, N, Sq, D) view, or (T, N, D) for TND
    k: np.ndarray            # (B, Nkv, Skv, D) view, or (Tkv, Nkv, D)
    v: np.ndarray
    q_start: Optional[np.ndarray]   # TND: first packed row of each sequence (int64[B])
    kv_start: Optional[np.ndarray]
    qlen: np.ndarray         # int64[B]
    klen: np.ndarray
    pre_e: np.ndarray        # int64[B], BAND_INF = unlimited
    next_e: np.ndarray
    mask_kind: int
    mask: Optional[np.ndarray]      # (Bm, Sq, Skv) window; Bm in (1, B)
    pse: Optional[np.ndarray]       # (Bp, N, Sq, Skv) window; Bp in (1, B)
    scale: float
    inner_precise: int
    want_lse: bool
    quant: Optional["QuantParams"] = None

    @property
    def packed(self):
        return self.layout == "TND"

    @property
    def out_shape(self):
        if self.layout == "TND":
            return (self.q.shape[0], self.N, self.D)
        if self.layout == "BSH":
            return (self.B, self.Sq, self.N * self.D)
        if self.layout in ("BSND", "BNSD_BSND"):
            return (self.B, self.Sq, self.N, self.D)
        return (self.B, self.N, self.Sq, self.D)

    @property
    def lse_shape(self):
        if self.layout == "TND":
            return (self.q.shape[0], self.N, 1)
        return (self.B, self.N, self.Sq, 1)

    def out_view(self, out):
        """The output array (in its final layout) seen as (B, N, Sq, D) / (T, N, D)."""
        if self.layout == "TND":
            return out
        if self.layout == "BSH":
            out = out.reshape(self.B, self.Sq, self.N, self.D)
        if self.layout in ("BSH", "BSND", "BNSD_BSND"):
            return out.transpose(0, 2, 1, 3)
        return out

    def lse_view(self, lse):
        """softmax_lse seen as (B, N, Sq) / (T, N)."""
        return lse[..., 0]


def storage_code(dtype):
    if dtype == V.F16:
        return CODE_F16
    if V.is_bf16(dtype):
        return CODE_BF16
    return CODE_F32


def _to_bnsd(x, layout, heads):
    """A padded-layout tensor as a (B, heads, S, D) strided view (reshape copies only if the
    BSH hidden axis is itself not a uniform stride, which NumPy decides)."""
    if layout == "BSH":
        b, s, h = x.shape
        x = x.reshape(b, s, heads, h // heads)
        return x.transpose(0, 2, 1, 3)
    if layout == "BSND":
        return x.transpose(0, 2, 1, 3)
    return x  # BNSD, BNSD_BSND


def _heads_and_dims(layout, query, key, value, num_heads, num_kv_heads):
    """(N, Nkv, D) from the shapes, checking the head rules of SPEC 3 and 10."""
    n = num_heads
    nkv = num_kv_heads if num_kv_heads > 0 else n
    if layout == "BSH":
        h, hk, hv = query.shape[2], key.shape[2], value.shape[2]
        if h % n:
            raise RuntimeError(f"the query hidden size H ({h}) must be divisible by num_heads "
                               f"({n}); query shape {V.shape_str(query.shape)}")
        d = h // n
        for name, hx in (("key", hk), ("value", hv)):
            if num_kv_heads == 0 and hx != h:
                raise RuntimeError(f"{name} hidden size ({hx}) must equal the query hidden size "
                                   f"({h}) when num_key_value_heads is 0 (Nkv = N); {name} shape "
                                   f"{V.shape_str((key if name == 'key' else value).shape)}")
            if hx % nkv:
                raise RuntimeError(f"{name} hidden size Hkv ({hx}) must be divisible by "
                                   f"num_key_value_heads ({nkv})")
            if hx // nkv != d:
                raise RuntimeError(f"head dim D differs between query ({d}) and {name} "
                                   f"({hx // nkv} = {hx} / {nkv} heads)")
        return n, nkv, d
    if layout == "TND":
        head_axis = 1
    elif layout == "BSND":
        head_axis = 2
    else:
        head_axis = 1
    if query.shape[head_axis] != n:
        raise RuntimeError(f"query has {query.shape[head_axis]} heads in its shape "
                           f"{V.shape_str(query.shape)} but num_heads is {n}")
    for name, x in (("key", key), ("value", value)):
        if x.shape[head_axis] != nkv:
            raise RuntimeError(f"{name} has {x.shape[head_axis]} heads in its shape "
                               f"{V.shape_str(x.shape)} but num_key_value_heads gives "
                               f"Nkv = {nkv}")
    d = query.shape[-1]
    for name, x in (("key", key), ("value", value)):
        if x.shape[-1] != d:
            raise RuntimeError(f"head dim D differs between query ({d}) and {name} "
                               f"({x.shape[-1]}); {name} shape {V.shape_str(x.shape)}")
    return n, nkv, d


def _check_band_mask(attn_mask, sparse_mode, batch):
    """Modes 2-4: a (2048, 2048)-class mask must be present; it is never read."""
    if attn_mask is None:
        raise RuntimeError(f"sparse_mode {sparse_mode} requires attn_mask (a 2048x2048 "
                           f"triu(ones, 1) mask), got None")
    V.check_array("attn_mask", attn_mask)
    if attn_mask.dtype not in V.DISCARD_MASK_DTYPES:
        raise TypeError(f"attn_mask dtype must be bool, int8 or uint8 for sparse_mode "
                        f"{sparse_mode}, got {V.dtype_name(attn_mask.dtype)}")
    s = V.BAND_MASK_SIDE
    accepted = [(s, s), (1, s, s), (1, 1, s, s), (batch, 1, s, s)]
    if tuple(attn_mask.shape) not in accepted:
        raise RuntimeError(f"attn_mask shape for sparse_mode {sparse_mode} must be one of "
                           f"(2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048), (B, 1, 2048, "
                           f"2048) with B = {batch}, got {V.shape_str(attn_mask.shape)}")


def _user_mask(attn_mask, dtype, batch, sq, skv):
    """Modes 0 and 1: the user mask as a (Bm, Sq, Skv) window and its kind."""
    V.check_array("attn_mask", attn_mask)
    if attn_mask.dtype in V.DISCARD_MASK_DTYPES:
        kind = MASK_DISCARD
    elif attn_mask.dtype == V.F16:
        if dtype != V.F16:
            raise TypeError(f"a float16 attn_mask needs a float16 query, got query dtype "
                            f"{V.dtype_name(dtype)}")
        warnings.warn("a float16 attn_mask (additive, -10000 * mask) is deprecated; pass a "
                      "bool mask (True = discard)", DeprecationWarning, stacklevel=4)
        kind = MASK_ADD_F16
    else:
        raise TypeError(f"attn_mask dtype must be bool, int8, uint8 (or float16 with a float16 "
                        f"query), got {V.dtype_name(attn_mask.dtype)}")
    shape = attn_mask.shape
    ok = False
    if attn_mask.ndim == 2:
        m = attn_mask[None]
        ok = True
    elif attn_mask.ndim == 3 and shape[0] in (1, batch):
        m = attn_mask
        ok = True
    elif attn_mask.ndim == 4 and shape[0] in (1, batch) and shape[1] == 1:
        m = attn_mask[:, 0]
        ok = True
    if ok and (m.shape[1] < sq or m.shape[2] < skv):
        ok = False
    if not ok:
        raise RuntimeError(f"attn_mask shape {V.shape_str(shape)} is not accepted: expected "
                           f"(Sq, Skv), (B, Sq, Skv), (1, Sq, Skv), (B, 1, Sq, Skv) or "
                           f"(1, 1, Sq, Skv) with B = {batch}, Sq = {sq}, Skv = {skv} (the last "
                           f"two axes may be larger)")
    return kind, m[:, :sq, :skv]


def _pse(pse_shift, dtype, batch, n, sq, skv):
    V.check_array("pse_shift", pse_shift)
    want = V.F16 if dtype in (V.F16, V.I8) else dtype
    if pse_shift.dtype != want:
        raise TypeError(f"pse_shift dtype must be {V.dtype_name(want)} for a "
                        f"{V.dtype_name(dtype)} query, got {V.dtype_name(pse_shift.dtype)}")
    shape = pse_shift.shape
    if (pse_shift.ndim != 4 or shape[0] not in (1, batch) or shape[1] != n
            or shape[2] < sq or shape[3] < skv):
        raise RuntimeError(f"pse_shift shape must be (B, N, >=Sq, >=Skv) or (1, N, >=Sq, >=Skv) "
                           f"with B = {batch}, N = {n}, Sq = {sq}, Skv = {skv}, got "
                           f"{V.shape_str(shape)}")
    return pse_shift[:, :, :sq, :skv]


def plan(query, key, value, attn_mask, actual_seq_lengths, actual_seq_lengths_kv, pse_shift,
         quant, num_heads, scale_value, pre_tokens, next_tokens, input_layout,
         num_key_value_heads, sparse_mode, inner_precise, return_softmax_lse):
    """Validate one call and build its :class:`Problem` (NumPy inputs)."""
    # scalars first: their errors do not depend on the tensors
    num_heads = V.check_int("num_heads", num_heads)
    num_key_value_heads = V.check_int("num_key_value_heads", num_key_value_heads)
    pre_tokens = V.check_int("pre_tokens", pre_tokens)
    next_tokens = V.check_int("next_tokens", next_tokens)
    sparse_mode = V.check_int("sparse_mode", sparse_mode)
    inner_precise = V.check_int("inner_precise", inner_precise)
    scale = V.check_scale_value(scale_value)
    layout = V.check_layout(input_layout)
    want_lse = V.check_bool("return_softmax_lse", return_softmax_lse)
    V.check_range("sparse_mode", sparse_mode, 0, 4)
    V.check_range("inner_precise", inner_precise, 0, 3)
    if num_heads <= 0:
        raise RuntimeError(f"num_heads must be > 0, got {num_heads}")
    if num_key_value_heads < 0:
        raise RuntimeError(f"num_key_value_heads must be >= 0, got {num_key_value_heads}")

    for name, x in (("query", query), ("key", key), ("value", value)):
        V.check_array(name, x)
    dtype = V.check_qkv_dtypes(query, key, value)
    quant = dict(zip(_QUANT_ARGS, quant))
    is_quant = dtype == V.I8 or any(x is not None for x in quant.values())
    for name, x in (("query", query), ("key", key), ("value", value)):
        V.check_rank(name, x, layout)

    n, nkv, d = _heads_and_dims(layout, query, key, value, num_heads, num_key_value_heads)
    qparams = None
    if is_quant:
        if layout == "TND":
            given = [f"{k} of shape {V.shape_str(np.shape(x))}" for k, x in quant.items()
                     if x is not None] or [f"an int8 query of shape {V.shape_str(query.shape)}"]
            raise RuntimeError(f"input_layout 'TND' supports no quantization, got "
                               f"{', '.join(given)}")
        qparams = plan_quant(dtype, quant, n, d)
    if n > V.MAX_HEADS:
        raise RuntimeError(f"num_heads must be <= {V.MAX_HEADS}, got {n}")
    if n % nkv:
        raise RuntimeError(f"num_heads ({n}) must be divisible by num_key_value_heads ({nkv})")
    g = n // nkv
    if g > V.MAX_GROUP:
        raise RuntimeError(f"num_heads / num_key_value_heads must be <= {V.MAX_GROUP}, got "
                           f"{n} / {nkv} = {g}")
    if d == 0:
        raise RuntimeError(f"head dim D must be > 0, got 0 (query shape "
                           f"{V.shape_str(query.shape)})")
    if d > V.MAX_HEAD_DIM:
        raise RuntimeError(f"head dim D must be <= {V.MAX_HEAD_DIM}, got {d} (query shape "
                           f"{V.shape_str(query.shape)})")
    if V.is_bf16(dtype) and d % 16:
        raise RuntimeError(f"bfloat16 needs head dim D % 16 == 0, got D = {d} (query shape "
                           f"{V.shape_str(query.shape)})")

    if layout == "TND":
        t, tkv = query.shape[0], key.shape[0]
        if value.shape[0] != tkv:
            raise RuntimeError(f"key and value must have the same packed length Tkv, got key "
                               f"shape {V.shape_str(key.shape)} and value shape "
                               f"{V.shape_str(value.shape)}")
        q_ends = V.check_cumulative_ends("actual_seq_lengths", actual_seq_lengths, t)
        kv_ends = V.check_cumulative_ends("actual_seq_lengths_kv", actual_seq_lengths_kv, tkv)
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
        if batch > V.MAX_BATCH:
            raise RuntimeError(f"batch B must be <= {V.MAX_BATCH}, got {batch} sequences")
        user_mask_given = sparse_mode == 1 or (sparse_mode == 0 and attn_mask is not None)
        if user_mask_given:
            raise RuntimeError(f"input_layout 'TND' supports no user attn_mask (sparse_mode 0 "
                               f"with a mask, or 1); got sparse_mode {sparse_mode} with attn_mask "
                               f"of shape {V.shape_str(attn_mask.shape) if attn_mask is not None else None}")
        if pse_shift is not None:
            raise RuntimeError(f"input_layout 'TND' does not support pse_shift, got shape "
                               f"{V.shape_str(getattr(pse_shift, 'shape', ()))}")
        q4, k4, v4 = query, key, value
    else:
        batch = query.shape[0]
        for name, x in (("key", key), ("value", value)):
            if x.shape[0] != batch:
                raise RuntimeError(f"batch B differs between query ({batch}) and {name} "
                                   f"({x.shape[0]}); {name} shape {V.shape_str(x.shape)}")
        if batch > V.MAX_BATCH:
            raise RuntimeError(f"batch B must be <= {V.MAX_BATCH}, got {batch} (query shape "
                               f"{V.shape_str(query.shape)})")
        q4 = _to_bnsd(query, layout, n)
        k4 = _to_bnsd(key, layout, nkv)
        v4 = _to_bnsd(value, layout, nkv)
        sq, skv = q4.shape[2], k4.shape[2]
        if v4.shape[2] != skv:
            raise RuntimeError(f"Skv differs between key ({skv}) and value ({v4.shape[2]}); "
                               f"key shape {V.shape_str(key.shape)}, value shape "
                               f"{V.shape_str(value.shape)}")
        qlen = V.check_seq_lengths("actual_seq_lengths", actual_seq_lengths, batch, sq)
        klen = V.check_seq_lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, batch, skv)
        q_start = kv_start = None

    # masks, sparse modes and the band
    mask_kind, mask = MASK_NONE, None
    if sparse_mode == 0:
        if attn_mask is not None:
            mask_kind, mask = _user_mask(attn_mask, dtype, batch, sq, skv)
            V.check_band_signs(pre_tokens, next_tokens, "sparse_mode 0 with attn_mask")
    elif sparse_mode == 1:
        if attn_mask is None:
            raise RuntimeError("sparse_mode 1 (allMask) requires attn_mask, got None")
        mask_kind, mask = _user_mask(attn_mask, dtype, batch, sq, skv)
    else:
        _check_band_mask(attn_mask, sparse_mode, batch)
        if sparse_mode == 4:
            V.check_band_signs(pre_tokens, next_tokens, "sparse_mode 4",
                               int8_out=qparams is not None and qparams.out_dtype == V.I8)
    pse = None if pse_shift is None else _pse(pse_shift, dtype, batch, n, sq, skv)
    pre_e, next_e = band_edges(sparse_mode, attn_mask is not None, pre_tokens, next_tokens,
                                qlen, klen)

    return Problem(layout=layout, B=batch, N=n, Nkv=nkv, G=g, Sq=sq, Skv=skv, D=d, dtype=dtype,
                   out_dtype=dtype if qparams is None else qparams.out_dtype,
                   code=storage_code(dtype), q=q4, k=k4, v=v4,
                   q_start=q_start, kv_start=kv_start, qlen=qlen, klen=klen, pre_e=pre_e,
                   next_e=next_e, mask_kind=mask_kind, mask=mask, pse=pse, scale=scale,
                   inner_precise=inner_precise, want_lse=want_lse, quant=qparams)


# ---------------------------------------------------------------------------------------------
# quantization (SPEC 8)
# ---------------------------------------------------------------------------------------------

@dataclass
class QuantParams:
    kind: str                 # 'int8->int8', 'int8->float16' or 'float->int8'
    out_dtype: np.dtype
    deq1: float               # decoded float32 scales (0 where unused)
    quant1: float
    deq2: float
    scale2: Optional[np.ndarray]    # float32 (H,) (per-channel) or (1,) (per-tensor)
    offset2: Optional[np.ndarray]


def _scale_array(name, x):
    V.check_array(name, x)
    return x


def decode_deq_scale(x):
    """deq_scale as float32: uint64 is Ascend's packed form float32_from_bits(u64 & 0xFFFFE000)."""
    if x.dtype == np.uint64:
        bits = (x.reshape(-1) & np.uint64(0xFFFFE000)).astype(np.uint32)
        return float(bits.view(np.float32)[0])
    return float(x.reshape(-1)[0])


def plan_quant(dtype, quant, n, d):
    """Check the quantization arguments against SPEC 8's table; decode them."""
    given = {k: x for k, x in quant.items() if x is not None}
    for name, x in given.items():
        _scale_array(name, x)
    if dtype == V.I8:
        out_int8 = "quant_scale2" in given
        required = ["deq_scale1", "quant_scale1", "deq_scale2"] + (["quant_scale2"] if out_int8 else [])
        forbidden = [] if out_int8 else ["quant_offset2"]
        kind = "int8->int8" if out_int8 else "int8->float16"
        if not out_int8 and "quant_offset2" in given:
            raise RuntimeError("quant_offset2 needs quant_scale2 (int8 output); with int8 "
                               "query/key/value and float16 output quant_offset2 must be None, "
                               f"got shape {V.shape_str(given['quant_offset2'].shape)}")
    else:
        required = ["quant_scale2"]
        forbidden = ["deq_scale1", "quant_scale1", "deq_scale2"]
        kind = "float->int8"
        if "quant_scale2" not in given and "quant_offset2" in given:
            raise RuntimeError(f"quant_offset2 needs quant_scale2, got quant_offset2 of shape "
                               f"{V.shape_str(given['quant_offset2'].shape)} and quant_scale2 None")
    for name in forbidden:
        if name in given:
            raise RuntimeError(f"{name} must be None for {kind} ({V.dtype_name(dtype)} "
                               f"query/key/value), got an array of shape "
                               f"{V.shape_str(given[name].shape)}")
    for name in required:
        if name not in given:
            raise RuntimeError(f"{name} is required for {kind} ({V.dtype_name(dtype)} "
                               f"query/key/value), got None")

    deq1 = quant1 = deq2 = 0.0
    if dtype == V.I8:
        d1, q1, d2 = given["deq_scale1"], given["quant_scale1"], given["deq_scale2"]
        for name, x in (("deq_scale1", d1), ("deq_scale2", d2)):
            if x.dtype not in (np.dtype(np.uint64), V.F32):
                raise TypeError(f"{name} dtype must be uint64 or float32, got "
                                f"{V.dtype_name(x.dtype)}")
        if d1.dtype != d2.dtype:
            raise TypeError(f"deq_scale1 and deq_scale2 must have the same dtype, got deq_scale1 "
                            f"{V.dtype_name(d1.dtype)} and deq_scale2 {V.dtype_name(d2.dtype)}")
        if q1.dtype != V.F32:
            raise TypeError(f"quant_scale1 dtype must be float32, got {V.dtype_name(q1.dtype)}")
        for name, x in (("deq_scale1", d1), ("quant_scale1", q1), ("deq_scale2", d2)):
            if x.shape != (1,):
                raise RuntimeError(f"{name} must have shape (1,), got {V.shape_str(x.shape)}")
        deq1, quant1, deq2 = decode_deq_scale(d1), float(q1[0]), decode_deq_scale(d2)

    scale2 = offset2 = None
    out_dtype = V.F16
    if "quant_scale2" in given:
        out_dtype = V.I8
        s2 = given["quant_scale2"]
        bf16 = V.is_bf16(dtype)
        if not (s2.dtype == V.F32 or (bf16 and s2.dtype == dtype)):
            raise TypeError(f"quant_scale2 dtype must be float32{' or bfloat16' if bf16 else ''} "
                            f"for a {V.dtype_name(dtype)} query, got {V.dtype_name(s2.dtype)}")
        h = n * d
        per_channel_shapes = [(h,), (1, 1, h), (1, n, 1, d), (n, d), (1, 1, n, d)]
        if s2.shape == (1,):
            pass
        elif s2.shape in per_channel_shapes:
            if d % 32:
                raise RuntimeError(f"per-channel quant_scale2 (shape {V.shape_str(s2.shape)}) "
                                   f"needs head dim D % 32 == 0, got D = {d}")
        else:
            raise RuntimeError(f"quant_scale2 shape must be (1,) or one of "
                               f"{', '.join(V.shape_str(x) for x in per_channel_shapes)} (H = {h}), "
                               f"got {V.shape_str(s2.shape)}")
        scale2 = s2.astype(np.float32).reshape(-1)
        if "quant_offset2" in given:
            o2 = given["quant_offset2"]
            if o2.dtype != s2.dtype:
                raise TypeError(f"quant_offset2 dtype must equal quant_scale2's "
                                f"({V.dtype_name(s2.dtype)}), got {V.dtype_name(o2.dtype)}")
            if o2.shape != s2.shape:
                raise RuntimeError(f"quant_offset2 shape must equal quant_scale2's "
                                   f"{V.shape_str(s2.shape)}, got {V.shape_str(o2.shape)}")
            offset2 = o2.astype(np.float32).reshape(-1)
        else:
            offset2 = np.zeros_like(scale2)
    return QuantParams(kind=kind, out_dtype=out_dtype, deq1=deq1, quant1=quant1, deq2=deq2,
                       scale2=scale2, offset2=offset2)
