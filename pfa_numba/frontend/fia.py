"""Every user-facing error of fused_infer_attention_score (docs/fia.md, 'Errors'), on top of
prompt_flash_attention's (:mod:`frontend.pfa`), which check everything the two share.

:func:`validate` takes a :class:`FiaCall` and returns a :class:`ValidFia`: the checked
prompt_flash_attention call of the problem (its key and value stand-ins have the logical kv
extent's shape, so that mask, pse and length checks see the kv axis the contract names) and
the :class:`KvCache` the kernels read instead: contiguous rows at per-batch offsets (left
padding), paged blocks, and a shared prefix before them.
"""
import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from . import antiquant as AQ
from . import checks
from . import pfa as PV
from ..numerics.band import TOKENS_INF
from .problem import to_bnsd
from ..numerics.dtypes import F16, F32, I8, dtype_name, is_bf16

#: the tensors, which live on one device and which the kernels read in place (the other
#: array arguments are small: lengths, scales, the block table; read on the host)
TENSORS = ("query", "key", "value", "atten_mask", "pse_shift", "key_shared_prefix",
           "value_shared_prefix")
#: the arguments whose names differ from prompt_flash_attention's ({PFA's: FIA's}), whose
#: checks FIA's reuse
PFA_NAMES = {"attn_mask": "atten_mask", "deq_scale1": "dequant_scale1",
             "deq_scale2": "dequant_scale2", "scale_value": "scale",
             "return_softmax_lse": "softmax_lse_flag"}
#: ... and the other way round ({FIA's: PFA's})
FIA_NAMES = {fia: pfa for pfa, fia in PFA_NAMES.items()}
_PFA_NAME = re.compile(r"\b(" + "|".join(PFA_NAMES) + r")\b")
#: a padding size beyond any frame: every larger one leaves the same empty window
_PAD_BEYOND = 1 << 62
#: the most values of a paged cache's logical (B, Smax, Hkv) extent: offsets within int64
MAX_KV_ELEMENTS = 1 << 62


@dataclass(frozen=True, kw_only=True)
class FiaCall(checks.Arguments):
    """One fused_infer_attention_score call: every argument by its name, as passed (those
    prompt_flash_attention shares: :class:`.checks.Arguments`)."""
    atten_mask: Any = None
    dequant_scale1: Any = None
    dequant_scale2: Any = None
    antiquant_scale: Any = None
    antiquant_offset: Any = None
    key_antiquant_scale: Any = None
    key_antiquant_offset: Any = None
    value_antiquant_scale: Any = None
    value_antiquant_offset: Any = None
    block_table: Any = None
    query_padding_size: Any = None
    kv_padding_size: Any = None
    key_shared_prefix: Any = None
    value_shared_prefix: Any = None
    actual_shared_prefix_len: Any = None
    scale: Any = 1.0
    next_tokens: Any = TOKENS_INF
    block_size: Any = 0
    antiquant_mode: Any = 0
    key_antiquant_mode: Any = 0
    value_antiquant_mode: Any = 0
    softmax_lse_flag: Any = False
    learnable_sink: Any = None

    TENSORS = TENSORS

    def tensors(self):
        """{name: array or None} of the tensors (key / value lists not among them)."""
        return {name: None if isinstance(x, (list, tuple)) else x
                for name, x in super().tensors().items()}


@dataclass
class KvCache:
    """Where each batch's kv rows live, for the kernels. Own rows of batch b: logical row t is
    physical row ``kv_off[b] + t`` of contiguous key/value, or slot t % block_size of block
    ``block_table[b, t // block_size]`` of the pools; a prefix of P rows (batch 1) comes first."""
    key: np.ndarray                        # (B, Nkv, S, D) view, or the pool as (nb, Nkv, bs, D)
    value: np.ndarray
    antiquant: Optional[tuple]             # (key, value) frontend.antiquant.Planes of int8 key/value
    block_table: Optional[np.ndarray]      # int64 (B, max_blocks), or None
    block_size: int
    prefix_key: Optional[np.ndarray]       # (1, Nkv, P, D) views, or None
    prefix_value: Optional[np.ndarray]
    P: int
    kv_off: np.ndarray                     # int64[B]: first physical own row (left padding)
    rows_hold_heads: bool = False          # pools of (num_blocks, block_size, Hkv) rows


@dataclass
class ValidFia:
    pfa: PV.ValidCall                       # the problem, with stand-in key / value
    kv: KvCache
    q_off: np.ndarray                      # int64[B]: first physical query row
    decode: bool
    lse_flag: bool
    sinks: Optional[np.ndarray] = None     # float32 (N,): learnable_sink, or None


def _real(name, x):
    return None if x is None else checks.check_array(name, checks.plain(name, x))


def _one_int(name, x):
    """query/kv_padding_size: one integer element (negative counts as 0)."""
    x = _real(name, x)
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold an integer, got dtype {dtype_name(x.dtype)}")
    if x.size != 1 or x.ndim > 1:
        raise RuntimeError(f"{name} must hold one element (shape (1,) or ()), got shape "
                           f"{checks.shape_str(x.shape)}")
    return min(max(int(x.reshape(-1)[0]), 0), _PAD_BEYOND)


def _kv_arrays(name, x):
    """key / value: an array, or a list of them (one element: that array)."""
    if isinstance(x, (list, tuple)):
        if not x:
            raise RuntimeError(f"{name} is an empty list")
        for i, e in enumerate(x):
            if not isinstance(e, np.ndarray):
                raise TypeError(f"{name}[{i}] must be an array, got {type(e).__name__}")
        if len(x) == 1:
            return checks.check_array(name, x[0]), None
        return None, [checks.check_array(f"{name}[{i}]", e) for i, e in enumerate(x)]
    return checks.check_array(name, x), None


def validate(call, device=None):
    """Check ``call`` (docs/fia.md, 'Errors') and return its :class:`ValidFia`; ``device``: the
    one it runs on, where the caller has placed it (else the call's own ``device``)."""
    valid = _validate(call, device)
    if call.learnable_sink is None:
        return valid
    if valid.pfa.dtype == I8:
        raise RuntimeError("learnable_sink takes a float query (the int8 pipeline has no sink "
                           "term), got an int8 query")
    return dataclasses.replace(valid, sinks=checks.sink_logits(call.learnable_sink, valid.pfa.N,
                                                               "learnable_sink"))


def _validate(call, device):
    lse_flag = checks.check_bool("softmax_lse_flag", call.softmax_lse_flag)
    block_size = checks.check_int("block_size", call.block_size)
    for name in ("antiquant_mode", "key_antiquant_mode", "value_antiquant_mode"):
        checks.check_int(name, getattr(call, name))
    checks.check_scale_value(call.scale, name="scale")
    layout = checks.check_layout(call.input_layout)
    query = checks.check_array("query", checks.plain("query", call.query))
    key, key_list = _kv_arrays("key", call.key)
    value, value_list = _kv_arrays("value", call.value)
    checks.check_rank("query", query, layout)
    kdtype = (key if key is not None else key_list[0]).dtype
    _check_dtypes(query, kdtype, (value if value is not None else value_list[0]).dtype)
    decode = layout != "TND" and query.shape[checks.SEQ_AXIS[layout]] == 1
    mask = _plain_mask(call.atten_mask)
    table = _real("block_table", call.block_table)
    prefix_k = _real("key_shared_prefix", call.key_shared_prefix)
    prefix_v = _real("value_shared_prefix", call.value_shared_prefix)
    q_pad = None if decode or call.query_padding_size is None else \
        _one_int("query_padding_size", call.query_padding_size)
    kv_pad = None if call.kv_padding_size is None else \
        _one_int("kv_padding_size", call.kv_padding_size)
    padding = [name for name in ("kv_padding_size", "query_padding_size")
               if getattr(call, name) is not None and not (decode and name[0] == "q")]
    padded = bool(padding)
    # decode reads no band; left padding with sparse_mode 0 and a mask ignores it (docs/fia.md)
    band_ignored = decode or (padded and mask is not None
                              and checks.check_int("sparse_mode", call.sparse_mode) == 0)
    listed = key_list is not None or value_list is not None
    prefixed = prefix_k is not None or prefix_v is not None
    dequant = AQ.applies(call, query.dtype, kdtype)
    _exclusions(query, layout, table, padding, listed, prefixed, dequant)
    list_lens = None
    if listed:
        key, value, list_lens = _gathered(key_list, value_list, layout, query.shape[0])
    if table is None:
        checks.check_rank("key", key, layout)
        checks.check_rank("value", value, layout)
    else:
        _check_pools(query, key, value, table, block_size, layout)
    P = 0
    if prefixed:
        P = _prefix(call, layout, (key, value), prefix_k, prefix_v)
    if decode and mask is not None:
        mask = _decode_mask(mask, query.shape[0], _kv_extent(key, layout, table, block_size, P))
    if band_ignored and not decode:         # ints, but not read (docs/fia.md, 'Left padding')
        for name in ("pre_tokens", "next_tokens"):
            checks.check_int(name, getattr(call, name))
    pfa_call = PV.Call(
        query, key, value, attn_mask=mask,
        actual_seq_lengths=None if decode else call.actual_seq_lengths,
        actual_seq_lengths_kv=call.actual_seq_lengths_kv, pse_shift=call.pse_shift,
        deq_scale1=call.dequant_scale1, quant_scale1=call.quant_scale1,
        deq_scale2=call.dequant_scale2, quant_scale2=call.quant_scale2,
        quant_offset2=call.quant_offset2, num_heads=call.num_heads, scale_value=call.scale,
        pre_tokens=TOKENS_INF if band_ignored else call.pre_tokens,
        next_tokens=TOKENS_INF if band_ignored else call.next_tokens, input_layout=layout,
        num_key_value_heads=call.num_key_value_heads,
        sparse_mode=(1 if mask is not None else 0) if decode else call.sparse_mode,
        inner_precise=call.inner_precise, device=device or call.device, return_softmax_lse=lse_flag)
    if table is not None:
        return _paged(call, pfa_call, query, key, value, table, block_size, layout, decode,
                      lse_flag, dequant)
    stand_in = pfa_call
    if P or dequant:           # shapes with the prefix's rows; the query's dtype for int8 kv
        stand_in = pfa_call.with_arrays({name: _extended(x, layout, P, query.dtype)
                                         for name, x in (("key", key), ("value", value))})
    valid = _pfa_checked(stand_in)
    B = valid.B
    if list_lens is not None:
        valid = dataclasses.replace(valid, klen=_list_lengths(call, list_lens))
    k_off = np.zeros(B, np.int64)
    q_off = np.zeros(B, np.int64)
    if kv_pad is not None and call.actual_seq_lengths_kv is not None:
        k_off = valid.Skv - kv_pad - valid.klen
    if q_pad is not None and call.actual_seq_lengths is not None:
        q_off = valid.Sq - q_pad - valid.qlen
    valid = _empty_windows(valid, q_off, k_off)
    k4, v4 = (to_bnsd(x, layout, valid.Nkv) for x in (key, value))
    pk = pv = None
    if P:                      # kL counts own rows only; the band sees the P + kL columns
        own = key.shape[checks.SEQ_AXIS[layout]]
        klen = checks.check_seq_lengths("actual_seq_lengths_kv", call.actual_seq_lengths_kv, B, own)
        valid = dataclasses.replace(valid, klen=klen + P)
        pk, pv = (to_bnsd(x, layout, valid.Nkv)[:, :, :P] for x in (prefix_k, prefix_v))
    planes = AQ.plan(call, query.dtype, B, valid.Nkv, (valid.D, valid.Dv), k4.shape[2], False,
                     0, 0, bool(P)) if dequant else None
    kv = KvCache(k4, v4, planes, None, 0, pk, pv, P, np.maximum(k_off, 0))
    return ValidFia(valid, kv, np.maximum(q_off, 0), decode, lse_flag)


def _gathered(key_list, value_list, layout, batch):
    """key / value lists (one batch-1 tensor a batch, each its own length) gathered into one
    padded cache in the layout, and the lengths. (The one copy FIA makes: the kernels read a
    batch's rows from one array.)"""
    if key_list is None or value_list is None:
        raise RuntimeError("key and value must both be lists (or both tensors), got a list for "
                           + ("key" if key_list is not None else "value") + " only")
    if len(key_list) != batch or len(value_list) != batch:
        raise RuntimeError(f"key and value lists need one tensor a batch (B = {batch}), got "
                           f"{len(key_list)} and {len(value_list)}")
    axis = checks.SEQ_AXIS[layout]
    for i, (k, v) in enumerate(zip(key_list, value_list)):
        _batch_one_like(f"key[{i}]", k, "key[0]", key_list[0], layout)
        _batch_one_like(f"value[{i}]", v, "value[0]", value_list[0], layout)
        checks.check_key_value_shapes(f"key[{i}]", k, f"value[{i}]", v)
    lens = [k.shape[axis] for k in key_list]
    gathered = []
    for parts in (key_list, value_list):
        shape = list(parts[0].shape)
        shape[0], shape[axis] = batch, max(lens)
        x = np.zeros(shape, parts[0].dtype)
        for b, part in enumerate(parts):
            index = [slice(None)] * x.ndim
            index[0], index[axis] = b, slice(0, lens[b])
            x[tuple(index)] = part[0]
        gathered.append(x)
    return gathered[0], gathered[1], np.array(lens, np.int64)


def _list_lengths(call, lens):
    """kL of each list element: actual_seq_lengths_kv (at most the element's length) or it."""
    if call.actual_seq_lengths_kv is None:
        return lens
    klen = checks.check_seq_lengths("actual_seq_lengths_kv", call.actual_seq_lengths_kv, lens.size,
                               int(lens.max()))
    if (klen > lens).any():
        b = int(np.argmax(klen > lens))
        raise ValueError(f"actual_seq_lengths_kv[{b}] = {int(klen[b])} exceeds key[{b}]'s "
                         f"length {int(lens[b])}")
    return klen


def _plain_mask(mask):
    if mask is None:
        return None
    mask = checks.plain("atten_mask", mask)
    if isinstance(mask, np.ndarray) and mask.dtype not in checks.DISCARD_MASK_DTYPES:
        raise TypeError(f"atten_mask must be bool, int8 or uint8 (fused_infer_attention_score "
                        f"takes no additive float mask), got {dtype_name(mask.dtype)} of "
                        f"shape {checks.shape_str(mask.shape)}")
    return mask


def _decode_mask(mask, batch, extent):
    """A decode mask ((B|1, C), (B|1, 1, C), (B|1, 1, 1, C), C >= the kv extent) as
    prompt_flash_attention's (B|1, 1, 1, C)."""
    if not isinstance(mask, np.ndarray):
        return mask
    ok = (mask.ndim in (2, 3, 4) and all(s == 1 for s in mask.shape[1:-1])
          and mask.shape[0] in (1, batch) and mask.shape[-1] >= extent)
    if not ok:
        raise RuntimeError(f"atten_mask shape {checks.shape_str(mask.shape)} is not accepted in "
                           f"decode (query length 1): expected (B, C), (B, 1, C) or "
                           f"(B, 1, 1, C) with batch B = {batch} or 1 and C >= {extent}, the "
                           f"kv length")
    return mask.reshape(mask.shape[0], 1, 1, mask.shape[-1])


def _kv_extent(key, layout, table, block_size, P):
    """The kv columns of the logical sequence: the prefix's P and the kv S extent (Smax =
    max_blocks * block_size of a paged cache)."""
    if table is None:
        return P + key.shape[checks.SEQ_AXIS[layout]]
    return table.shape[1] * block_size


def _pfa_checked(call):
    """prompt_flash_attention's checks of ``call``, its errors naming FIA's arguments."""
    try:
        return PV.validate(call)
    except (TypeError, ValueError, RuntimeError) as e:
        message = _PFA_NAME.sub(lambda m: PFA_NAMES[m.group(1)], str(e))
        if type(e) in (TypeError, ValueError, RuntimeError) and message != str(e):
            raise type(e)(message) from None
        raise


def _check_dtypes(query, kdtype, vdtype):
    """The dtypes of docs/fia.md, 'Dtypes' (TypeError), before any rule that depends on them:
    a float16, bfloat16, float32 or int8 query; key and value of one dtype, the query's, or
    int8 under a float query (a cache dequantized as it loads)."""
    q = query.dtype
    if q not in (F16, F32, I8) and not is_bf16(q):
        raise TypeError(f"query dtype must be float16, bfloat16, float32 or int8, got "
                        f"{dtype_name(q)}")
    if vdtype != kdtype:
        raise TypeError(f"value dtype must be key's ({dtype_name(kdtype)}), got "
                        f"{dtype_name(vdtype)}")
    if kdtype not in (q, I8):
        raise TypeError(f"key dtype must be the query's ({dtype_name(q)}), or int8 under a "
                        f"float query, got {dtype_name(kdtype)}")


def _exclusions(query, layout, table, padding, listed, prefixed, dequant):
    """The feature exclusions of docs/fia.md, 'Errors', each feature named by its arguments."""
    paged, padded = "block_table (paged KV)", f"{' / '.join(padding)} (left padding)"
    lists, prefix = "key / value lists", "key_shared_prefix / value_shared_prefix (a shared prefix)"
    named = {paged: table is not None, padded: bool(padding), lists: listed, prefix: prefixed}
    if layout == "TND":
        tnd = {**named, "int8 key/value with antiquant scales": dequant}
        given = [n for n, on in tnd.items() if on]
        if given:
            raise RuntimeError(f"input_layout 'TND' takes contiguous float key/value (or int8 "
                               f"with an int8 query) only, got {', '.join(given)}")
    pairs = [(paged, padded), (paged, lists), (paged, prefix), (prefix, padded),
             (prefix, lists), (padded, lists)]
    for a, b in pairs:
        if named[a] and named[b]:
            raise RuntimeError(f"{a} cannot be combined with {b}")
    for feature in (paged, lists, prefix):
        if named[feature] and query.dtype == I8:
            raise RuntimeError(f"{feature} does not take an int8 query (full quantization "
                               f"reads contiguous key/value), got query shape "
                               f"{checks.shape_str(query.shape)}")


def _prefix(call, layout, kv, prefix_k, prefix_v):
    """Check the shared prefix beside kv = (key, value); returns its length P."""
    if prefix_k is None or prefix_v is None:
        given = "key_shared_prefix" if prefix_k is not None else "value_shared_prefix"
        raise RuntimeError(f"key_shared_prefix and value_shared_prefix come together, got "
                           f"only {given}")
    for name, x, ref_name, ref in (("key_shared_prefix", prefix_k, "key", kv[0]),
                                   ("value_shared_prefix", prefix_v, "value", kv[1])):
        _batch_one_like(name, x, ref_name, ref, layout)
    checks.check_key_value_shapes("key_shared_prefix", prefix_k, "value_shared_prefix",
                                  prefix_v)
    sp = prefix_k.shape[checks.SEQ_AXIS[layout]]
    if call.actual_shared_prefix_len is None:
        return sp
    n = call.actual_shared_prefix_len
    values = list(np.ravel(n)) if isinstance(n, (list, tuple, np.ndarray)) else [n]
    if len(values) != 1 or isinstance(values[0], (bool, np.bool_)) \
            or not isinstance(values[0], (int, np.integer)) or not 0 <= values[0] <= sp:
        got = (f"{type(n).__name__} of {len(values)} values" if len(values) != 1 else
               f"{type(values[0]).__name__} {values[0]!r}")
        raise ValueError(f"actual_shared_prefix_len must be one int in [0, {sp}], got {got}")
    return int(values[0])


def _batch_one_like(name, x, ref_name, ref, layout):
    """A batch-1 tensor of its own length beside ``ref`` (a list element, a shared prefix):
    ref's dtype (TypeError), the layout's rank, ref's heads and head dim (RuntimeError)."""
    checks.check_same("dtype", ref_name, ref, name, x)
    checks.check_rank(name, x, layout)
    if x.shape[0] != 1 or not _same_heads(x, ref, checks.SEQ_AXIS[layout]):
        raise RuntimeError(f"{name} must be batch 1 with {ref_name}'s heads and head dim and "
                           f"its own sequence length, got shape {checks.shape_str(x.shape)} "
                           f"({ref_name}: {checks.shape_str(ref.shape)})")


def _same_heads(x, ref, seq_axis):
    """Whether x has ref's shape but for the batch and sequence axes (heads, head dim)."""
    return all(x.shape[a] == ref.shape[a] for a in range(x.ndim) if a not in (0, seq_axis))


def _extended(x, layout, extra, dtype):
    """A zero-strided stand-in for ``x`` of ``dtype`` with ``extra`` more rows on the sequence
    axis (the logical kv extent a prefix adds), for the shape checks."""
    shape = list(x.shape)
    shape[checks.SEQ_AXIS[layout]] += extra
    return np.broadcast_to(np.zeros((), dtype), tuple(shape))


def _empty_windows(valid, q_off, k_off):
    """A batch whose padded window does not fit (q_off or k_off < 0) computes nothing."""
    bad = (q_off < 0) | (k_off < 0)
    if not bad.any():
        return valid
    return dataclasses.replace(valid, qlen=np.where(bad, 0, valid.qlen),
                               klen=np.where(bad, 0, valid.klen))


def _check_pools(query, key, value, table, block_size, layout):
    """The block table, block size and pools of paged KV (docs/fia.md, 'Paged KV'): their
    types, ranks and shapes, and a logical cache (B, Smax, Hkv) the kernels can address."""
    if table.dtype not in (np.int32, np.int64):
        raise TypeError(f"block_table must be int32 or int64, got {dtype_name(table.dtype)}")
    if block_size < 1:
        raise RuntimeError(f"block_size must be >= 1 with a block_table, got {block_size}")
    B = query.shape[0]
    if table.ndim != 2 or table.shape[0] != B:
        raise RuntimeError(f"block_table must be (B, max_blocks) with B = {B}, got shape "
                           f"{checks.shape_str(table.shape)}")
    checks.check_key_value_shapes("key pool", key, "value pool", value)
    if key.ndim == 4 and layout not in ("BNSD", "BNSD_BSND"):
        raise RuntimeError(f"a 4-D block pool (num_blocks, Nkv, block_size, D) needs "
                           f"input_layout BNSD or BNSD_BSND, got {layout!r} with pool shape "
                           f"{checks.shape_str(key.shape)}")
    if key.ndim not in (3, 4):
        raise RuntimeError(f"paged key/value must be (num_blocks, block_size, Hkv) or "
                           f"(num_blocks, Nkv, block_size, D), got shape "
                           f"{checks.shape_str(key.shape)}")
    if key.ndim == 3 and layout != "BSH" and key.shape[2] % max(query.shape[-1], 1):
        raise RuntimeError(f"the pool's Hkv ({key.shape[2]}) must be Nkv * D with the query's "
                           f"D = {query.shape[-1]}; pool shape {checks.shape_str(key.shape)}")
    bs_axis = 1 if key.ndim == 3 else 2
    if key.shape[bs_axis] != block_size:
        raise RuntimeError(f"the pool's block axis ({key.shape[bs_axis]}) must equal "
                           f"block_size ({block_size}); pool shape {checks.shape_str(key.shape)}")
    smax = table.shape[1] * block_size
    hkv = key.shape[2] if key.ndim == 3 else key.shape[1] * key.shape[3]
    if B * smax * hkv >= MAX_KV_ELEMENTS:
        raise RuntimeError(f"block_table's {table.shape[1]} blocks a batch times block_size "
                           f"{block_size} make a kv cache of (B, Smax, Hkv) = ({B}, {smax}, "
                           f"{hkv}) values, beyond the 2^62 the kernels address")


def _paged(call, pfa_call, query, key, value, table, block_size, layout, decode, lse_flag,
           dequant):
    """Paged KV (pools checked by :func:`_check_pools`): the problem's kv extent is Smax."""
    B = query.shape[0]
    checks.require(call.actual_seq_lengths_kv, ValueError,
                   "paged KV (block_table) needs actual_seq_lengths_kv")
    smax = _kv_extent(key, layout, table, block_size, 0)
    dtype = query.dtype if dequant else key.dtype
    nkv = key.shape[2] // query.shape[-1] if key.ndim == 3 and query.shape[-1] else 0
    valid = _pfa_checked(pfa_call.with_arrays(
        {name: _pool_stand_in(pool, layout, B, smax, nkv, dtype)
         for name, pool in (("key", key), ("value", value))}))
    used = -(-valid.klen // block_size)
    nb = key.shape[0]
    for b in range(B):
        ids = table[b, :used[b]]
        if ids.size and (ids.min() < 0 or ids.max() >= nb):
            bad = int(ids[(ids < 0) | (ids >= nb)][0])
            raise ValueError(f"block_table[{b}] names block {bad}, outside [0, {nb}) (the "
                             f"pool has {nb} blocks)")
    pools = [x if x.ndim == 4 else
             x.reshape(nb, block_size, valid.Nkv, d).transpose(0, 2, 1, 3)
             for x, d in ((key, valid.D), (value, valid.Dv))]
    zeros = np.zeros(B, np.int64)
    planes = AQ.plan(call, query.dtype, B, valid.Nkv, (valid.D, valid.Dv), smax, True, nb,
                     block_size, False) if dequant else None
    kv = KvCache(pools[0], pools[1], planes, table.astype(np.int64), block_size, None, None, 0,
                 zeros, rows_hold_heads=key.ndim == 3)
    return ValidFia(valid, kv, zeros.copy(), decode, lse_flag)


def _pool_stand_in(pool, layout, B, smax, nkv, dtype):
    """A zero-strided (B, Smax, ...) key or value of ``dtype`` in ``layout`` with the pool's
    heads (a 3-D pool's rows hold ``nkv`` heads side by side), for the checks."""
    if pool.ndim == 3:
        hkv = pool.shape[2]
        shape = (B, smax, hkv) if layout == "BSH" else None
        if shape is None:
            d = hkv // nkv if nkv else 0
            shape = (B, smax, nkv, d) if layout == "BSND" else (B, nkv, smax, d)
    else:
        shape = (B, pool.shape[1], smax, pool.shape[3])
    return np.broadcast_to(np.zeros((), dtype), shape)
