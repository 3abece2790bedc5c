"""The meaning of ``fused_infer_attention_score`` (FIA), written out in float64 NumPy.

FIA is ``prompt_flash_attention`` plus a decode branch and KV caches. Each batch b is reduced
to the prompt_flash_attention reference on one batch: its qL query rows, starting at physical
row q0 (query left padding), against its *effective* kv sequence of kE = P + kL columns (a
shared prefix of P rows, then its own kL rows, read from a contiguous tensor at kv row k0 (kv
left padding), a list element, or the blocks of a paged pool), dequantized when int8 K/V meet
a float query (antiquant). Masks and pse are read at the physical rows q0 + i and columns
(e < P: e; else P + k0 + (e - P)); the band uses the logical indices. Rows outside the query
window are zeros with lse -inf. Like the prompt_flash_attention reference, nothing here
depends on the kernels, and the input is assumed valid.
"""
import numpy as np

from . import from_bnsd, actual_lengths, as_bnsd, prompt_flash_attention

__all__ = ["fused_infer_attention_score"]

_INF = 2147483647


def fused_infer_attention_score(
        query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
        actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
        dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
        antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
        value_antiquant_scale=None, value_antiquant_offset=None, block_table=None,
        query_padding_size=None, kv_padding_size=None, key_shared_prefix=None,
        value_shared_prefix=None, actual_shared_prefix_len=None, num_heads=1, scale=1.0,
        pre_tokens=_INF, next_tokens=_INF, input_layout="BSH", num_key_value_heads=0,
        sparse_mode=0, inner_precise=1, block_size=0, antiquant_mode=0, key_antiquant_mode=0,
        value_antiquant_mode=0, softmax_lse_flag=False, learnable_sink=None,
        compute_dtype=None):
    """Reference FIA: MindSpore's arguments (the FIA contract), returning (out, lse) in float64.

    out is in the output layout, as the prompt_flash_attention reference returns it (the exact
    value before rounding for float outputs, the quantized model's values for int8 ones); lse
    is (B, N, Sq, 1) with -inf for rows that kept nothing, or zeros (1,) without
    ``softmax_lse_flag``. ``compute_dtype`` as in the prompt_flash_attention reference.
    ``learnable_sink``: one logit a query head in every row's softmax denominator (the
    prompt_flash_attention reference's ``sinks``).
    """
    query = np.asarray(query)
    pfa = dict(pse_shift=pse_shift, deq_scale1=dequant_scale1, quant_scale1=quant_scale1,
               deq_scale2=dequant_scale2, quant_scale2=quant_scale2,
               quant_offset2=quant_offset2, num_heads=num_heads, scale_value=scale,
               pre_tokens=pre_tokens, next_tokens=next_tokens, sparse_mode=sparse_mode,
               inner_precise=inner_precise, return_softmax_lse=True,
               compute_dtype=compute_dtype,
               sinks=None if learnable_sink is None else np.asarray(learnable_sink, np.float64))
    if input_layout == "TND":                         # contiguous kv only: PFA as it is
        out, lse = prompt_flash_attention(query, _single(key), _single(value), atten_mask,
                                          actual_seq_lengths, actual_seq_lengths_kv,
                                          input_layout="TND",
                                          num_key_value_heads=num_key_value_heads, **pfa)
        return out, (lse if softmax_lse_flag else np.zeros(1))
    kv = _KvCaches(query, key, value, input_layout, num_heads, num_key_value_heads, block_table,
                   block_size, key_shared_prefix, value_shared_prefix, actual_shared_prefix_len)
    antiquant = _Antiquant(query.dtype, kv, antiquant_scale, antiquant_offset, antiquant_mode,
                           key_antiquant_scale, key_antiquant_offset, key_antiquant_mode,
                           value_antiquant_scale, value_antiquant_offset, value_antiquant_mode)
    q = as_bnsd(query, input_layout, num_heads)
    B, N, Sq, D = q.shape
    decode = Sq == 1
    q_lens = [1] * B if decode else actual_lengths(actual_seq_lengths, B, Sq, "actual_seq_lengths")
    kv_lens = kv.lengths(actual_seq_lengths_kv)
    q0s = _starts(None if decode else query_padding_size, actual_seq_lengths, Sq, q_lens)
    k0s = _starts(kv_padding_size, actual_seq_lengths_kv, kv.extent, kv_lens)
    if kv.paged or kv.listed or kv.P:
        k0s = [0] * B
    padded = query_padding_size is not None or kv_padding_size is not None
    if decode:                                        # every kv column; a mask is a user mask
        mode = 1 if atten_mask is not None else 0
    else:
        mode = 1 if (sparse_mode == 0 and atten_mask is not None and padded) else sparse_mode
    pfa.update(sparse_mode=mode)
    out = np.zeros((B, N, Sq, kv.Dv))
    lse = np.full((B, N, Sq, 1), -np.inf)
    for b in range(B):
        q0, k0, qL, kL = q0s[b], k0s[b], q_lens[b], kv_lens[b]
        if q0 < 0 or k0 < 0:                          # a window that does not fit: zero rows
            continue
        k, v = kv.effective(b, k0, kL, antiquant)
        cols = np.concatenate([np.arange(kv.P), kv.P + k0 + np.arange(kL)]).astype(np.int64)
        rows = q0 + np.arange(qL)
        ob, lb = prompt_flash_attention(
            q[b:b + 1, :, q0:q0 + qL], k, v, _mask_window(atten_mask, b, rows, cols, decode,
                                                           mode),
            input_layout="BNSD", num_key_value_heads=kv.Nkv,
            **dict(pfa, pse_shift=_pse_window(pse_shift, b, rows, cols)))
        out[b, :, q0:q0 + qL] = ob[0]
        lse[b, :, q0:q0 + qL] = lb[0]
    return from_bnsd(out, input_layout), (lse if softmax_lse_flag else np.zeros(1))


def _single(x):
    return x[0] if isinstance(x, (list, tuple)) else x


def _starts(padding, actual, S, lens):
    """First physical row of each batch's window: S - p - len with left padding p (active only
    with its actual lengths), else 0."""
    if padding is None or actual is None:
        return [0] * len(lens)
    p = max(int(np.asarray(padding).reshape(-1)[0]), 0)
    return [S - p - n for n in lens]


def _mask_window(mask, b, rows, cols, decode, mode):
    """The (qL, kE) discard mask of batch b at the physical rows and columns, where it is read
    (decode; prefill modes 0 and 1); the 2048 x 2048 mask of modes 2-4 as it is (not read)."""
    if mask is None:
        return None
    m = np.asarray(mask)
    if decode:                                        # (B|1, C), (B|1, 1, C), (B|1, 1, 1, C)
        row = m.reshape(m.shape[0], -1)[b if m.shape[0] > 1 else 0]
        return row[cols][None, :]
    if mode not in (0, 1):
        return m
    if m.ndim == 2:
        m2 = m
    else:
        m2 = m[b if m.shape[0] > 1 else 0].reshape(m.shape[-2], m.shape[-1])
    return m2[np.ix_(rows, cols)]


def _pse_window(pse, b, rows, cols):
    if pse is None:
        return None
    p = np.asarray(pse)
    return p[b if p.shape[0] > 1 else 0][:, rows][:, :, cols][None]


class _KvCaches:
    """Where batch b's kv rows live: a contiguous tensor, a list of tensors, or a paged pool,
    after an optional shared prefix. Everything as (heads, rows, D) views."""

    def __init__(self, query, key, value, layout, N, Nkv, block_table, block_size, prefix_k,
                 prefix_v, prefix_len):
        self.layout = layout
        self.listed = isinstance(key, (list, tuple)) and len(key) > 1
        key, value = (x if self.listed else np.asarray(_single(x)) for x in (key, value))
        self.paged = block_table is not None
        D = np.asarray(query).shape[-1] if layout != "BSH" else np.asarray(query).shape[2] // N
        if self.paged:
            self.table = np.asarray(block_table)
            self.block_size = int(block_size)
            pool = np.asarray(key)
            self.Nkv = pool.shape[1] if pool.ndim == 4 else pool.shape[2] // D
            self.pools = tuple(self._pool(np.asarray(x)) for x in (key, value))
            self.extent = self.table.shape[1] * self.block_size
        elif self.listed:
            self.elems = [tuple(as_bnsd(np.asarray(x), layout,
                                        self._heads(pair[0], N, Nkv, D))[0] for x in pair)
                          for pair in zip(key, value)]
            self.Nkv = self.elems[0][0].shape[0]
            self.extent = max(k.shape[1] for k, _ in self.elems)
        else:
            self.Nkv = self._heads(key, N, Nkv, D)
            self.k, self.v = (as_bnsd(x, layout, self.Nkv) for x in (key, value))
            self.extent = self.k.shape[2]
        self.P = 0
        if prefix_k is not None:
            self.prefix = tuple(as_bnsd(np.asarray(x), layout, self.Nkv)[0]
                                for x in (prefix_k, prefix_v))
            self.P = (self.prefix[0].shape[1] if prefix_len is None
                      else int(np.asarray(prefix_len).reshape(-1)[0]))

    @staticmethod
    def _heads(x, N, Nkv, D):
        if np.asarray(x).ndim == 3:                   # BSH: Hkv / D
            return np.asarray(x).shape[2] // D
        return Nkv or N

    def _pool(self, pool):
        """A pool as (num_blocks, Nkv, block_size, its head dim)."""
        if pool.ndim == 4:
            return pool
        nb, bs, hkv = pool.shape
        return pool.reshape(nb, bs, self.Nkv, hkv // self.Nkv).transpose(0, 2, 1, 3)

    @property
    def Dv(self):
        """Value's head dim."""
        if self.paged:
            return self.pools[1].shape[3]
        return self.elems[0][1].shape[-1] if self.listed else self.v.shape[-1]

    def lengths(self, actual):
        B = self.table.shape[0] if self.paged else (len(self.elems) if self.listed
                                                    else self.k.shape[0])
        if actual is None:
            return [k.shape[1] for k, _ in self.elems] if self.listed else [self.extent] * B
        return actual_lengths(actual, B, self.extent, "actual_seq_lengths_kv")

    def own(self, b, k0, kL):
        """(K, V, token index p on the kv S axis, paged (block, offset) slots) of batch b's
        own rows, as (Nkv, kL, D) arrays."""
        t = np.arange(kL)
        if self.paged:
            blocks = self.table[b, t // self.block_size].astype(np.int64)
            offs = t % self.block_size
            k, v = (pool[blocks, :, offs].transpose(1, 0, 2) for pool in self.pools)
            return k, v, t, (blocks, offs)
        if self.listed:
            k, v = self.elems[b]
            return k[:, :kL], v[:, :kL], t, None
        return self.k[b, :, k0:k0 + kL], self.v[b, :, k0:k0 + kL], k0 + t, None

    def effective(self, b, k0, kL, antiquant):
        """Batch b's effective K and V, (1, Nkv, P + kL, D), dequantized where antiquant is."""
        k, v, tokens, slots = self.own(b, k0, kL)
        k, v = antiquant.apply(k, v, b, tokens, slots)
        if self.P:
            pk, pv = (x[:, :self.P] for x in self.prefix)
            pk, pv = antiquant.apply(pk, pv, b, None, None)
            k, v = (np.concatenate([a, c], axis=1) for a, c in ((pk, k), (pv, v)))
        return k[None], v[None]


class _Antiquant:
    """The (int8 + offset) * scale of int8 K/V with a float query, one parameter set per
    tensor: (kind, values) with kind 'tensor', 'channel', 'token', 'head', 'token-head',
    'paged-token', 'paged-token-head' (the FIA contract's tables)."""

    def __init__(self, qdtype, kv, merged_s, merged_o, merged_mode, ks, ko, kmode, vs, vo,
                 vmode):
        self.on = qdtype != np.int8 and (ks is not None or merged_s is not None)
        if not self.on:
            return
        self.Nkv = kv.Nkv
        if ks is not None:                            # the separate parameters win
            self.params = (self._separate(ks, ko, kmode), self._separate(vs, vo, vmode))
        else:
            self.params = tuple(self._merged(merged_s, merged_o, merged_mode, i) for i in (0, 1))

    @staticmethod
    def _f64(x):
        return None if x is None else np.asarray(x).astype(np.float64)

    def _merged(self, scale, offset, mode, i):
        s, o = self._f64(scale), self._f64(offset)
        pick = (lambda x: None if x is None else x[i])
        if mode == 1:
            return "token", pick(s), pick(o)
        if s.shape == (2,):
            return "tensor", s[i:i + 1], None if o is None else o[i:i + 1]
        return "channel", pick(s).reshape(-1), None if o is None else pick(o).reshape(-1)

    def _separate(self, scale, offset, mode):
        s, o = self._f64(scale), self._f64(offset)
        kind = {1: "token", 2: "head", 3: "token-head", 4: "paged-token",
                5: "paged-token-head"}.get(mode)
        if kind is None:
            kind = "tensor" if s.size == 1 else "channel"
        flat = kind in ("tensor", "channel", "head")
        if kind == "token" and s.ndim == 3:           # (1, B, S)
            s, o = s[0], None if o is None else o[0]
        return kind, (s.reshape(-1) if flat else s), \
            (None if o is None else (o.reshape(-1) if flat else o))

    def apply(self, k, v, b, tokens, slots):
        if not self.on:
            return k, v
        return tuple(self._dequant(x, p, b, tokens, slots) for x, p in ((k, self.params[0]),
                                                                        (v, self.params[1])))

    def _dequant(self, x, param, b, tokens, slots):
        """x (Nkv, rows, D) int8 -> float64 (x + offset) * scale."""
        kind, s, o = param
        nkv, rows, d = x.shape
        g = np.arange(nkv)[:, None, None]
        dd = np.arange(d)[None, None, :]
        if kind == "tensor":
            idx = (0,)
        elif kind == "channel":
            idx = (g * d + dd,)
        elif kind == "head":
            idx = (g,)
        elif kind == "token":
            idx = (b, tokens[None, :, None])
        elif kind == "token-head":
            idx = (b, g, tokens[None, :, None])
        elif kind == "paged-token":
            idx = (slots[0][None, :, None], slots[1][None, :, None])
        else:                                         # paged-token-head
            idx = (slots[0][None, :, None], g, slots[1][None, :, None])
        scale = np.broadcast_to(s[idx], x.shape)
        offset = 0.0 if o is None else np.broadcast_to(o[idx], x.shape)
        return (x.astype(np.float64) + offset) * scale
