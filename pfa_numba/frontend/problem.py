"""The canonical problem: what every backend needs, as strided views, small int arrays and ints.

``plan(valid)`` turns a :class:`frontend.pfa.ValidCall` into a :class:`Problem`; it checks
nothing (:func:`frontend.pfa.validate` has):

* query/key/value as strided views, never copies: ``(B, N, S, D)`` for the padded layouts, the
  packed ``(T, N, D)`` arrays plus per-sequence row starts for TND;
* per batch: qL, kL and the band edges (preE, nextE) of :mod:`numerics.band`, ``BAND_INF`` for +inf;
* the user mask as a ``(Bm, Sq, Skv)`` window (Bm = 1 or B) and its kind, pse as
  ``(Bp, N, Sq, Skv)``; sparse modes 2-4 keep no mask (their band comes from the table);
* the output dtype and layout.
"""
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .quant import QuantParams
from ..numerics.band import band_edges
from ..numerics.kernel_args import storage_code

@dataclass
class Problem:
    layout: str
    B: int
    N: int
    Nkv: int
    G: int
    Sq: int
    Skv: int
    D: int                   # query and key's head dim
    Dv: int                  # value's (and the output's) head dim
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
    quant: Optional[QuantParams] = None
    # fused_infer_attention_score's kv cache (a frontend.fia.KvCache: paged blocks, a shared
    # prefix, per-batch kv row offsets), with k / v then its arrays; q_off: first query rows
    cache: Optional[Any] = None
    q_off: Optional[np.ndarray] = None
    # scores become softcap * tanh(score / softcap) before pse and masks (0: not); an
    # extension the SDPA drop-in takes (Gemma 2's logit softcapping), not Ascend's
    softcap: float = 0.0
    # one logit a query head (N,) in every row's softmax denominator, without a value row (or
    # None); an extension the SDPA drop-in takes (gpt-oss's attention sinks)
    sinks: Optional[np.ndarray] = None

    @property
    def packed(self):
        return self.layout == "TND"

    @property
    def out_shape(self):
        if self.layout == "TND":
            return (self.q.shape[0], self.N, self.Dv)
        if self.layout == "BSH":
            return (self.B, self.Sq, self.N * self.Dv)
        if self.layout in ("BSND", "BNSD_BSND"):
            return (self.B, self.Sq, self.N, self.Dv)
        return (self.B, self.N, self.Sq, self.Dv)

    @property
    def kv_rows_hold_heads(self):
        """Whether a kv row holds every kv head side by side in the layout (BSH, BSND, TND and
        the (num_blocks, block_size, Hkv) pools): the layout's arrangement, not that of the
        strides given, so that a view is tiled (and computed, bit for bit) as its contiguous
        copy is."""
        if self.cache is not None and self.cache.block_table is not None:
            return self.cache.rows_hold_heads
        return self.layout in ("BSH", "BSND", "TND")

    @property
    def lse_shape(self):
        if self.layout == "TND":
            return (self.q.shape[0], self.N, 1)
        return (self.B, self.N, self.Sq, 1)

    def out_view(self, out):
        """The output array (in its final layout) seen as (B, N, Sq, Dv) / (T, N, Dv)."""
        if self.layout == "TND":
            return out
        if self.layout == "BSH":
            out = out.reshape(self.B, self.Sq, self.N, self.Dv)
        if self.layout in ("BSH", "BSND", "BNSD_BSND"):
            return out.transpose(0, 2, 1, 3)
        return out

    def lse_view(self, lse):
        """softmax_lse seen as (B, N, Sq) / (T, N)."""
        return lse[..., 0]


def to_bnsd(x, layout, heads):
    """A padded-layout tensor as a (B, heads, S, D) strided view (reshape copies only if the
    BSH hidden axis is itself not a uniform stride, which NumPy decides)."""
    if layout == "BSH":
        b, s, h = x.shape
        x = x.reshape(b, s, heads, h // heads)
        return x.transpose(0, 2, 1, 3)
    if layout == "BSND":
        return x.transpose(0, 2, 1, 3)
    return x  # BNSD, BNSD_BSND


def plan(valid, cache=None, q_off=None):
    """The :class:`Problem` of a :class:`frontend.pfa.ValidCall`; with fused_infer_attention_score's
    kv ``cache`` (and its first query rows ``q_off``), the cache's key and value are the ones
    the kernels walk."""
    c = valid
    if c.layout == "TND":
        q4, k4, v4 = c.query, c.key, c.value
    else:
        q4 = to_bnsd(c.query, c.layout, c.N)
        k4 = to_bnsd(c.key, c.layout, c.Nkv)
        v4 = to_bnsd(c.value, c.layout, c.Nkv)
    if cache is not None:
        k4, v4 = cache.key, cache.value
    pre_e, next_e = band_edges(c.sparse_mode, c.has_mask, c.pre_tokens, c.next_tokens, c.qlen,
                               c.klen)
    return Problem(layout=c.layout, B=c.B, N=c.N, Nkv=c.Nkv, G=c.G, Sq=c.Sq, Skv=c.Skv, D=c.D,
                   Dv=c.Dv,
                   dtype=c.dtype, out_dtype=c.dtype if c.quant is None else c.quant.out_dtype,
                   code=storage_code(c.dtype), q=q4, k=k4, v=v4, q_start=c.q_start,
                   kv_start=c.kv_start, qlen=c.qlen, klen=c.klen, pre_e=pre_e, next_e=next_e,
                   mask_kind=c.mask_kind, mask=c.mask, pse=c.pse, scale=c.scale,
                   inner_precise=c.inner_precise, want_lse=c.want_lse, quant=c.quant,
                   cache=cache, q_off=q_off)
