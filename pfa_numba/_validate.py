"""Every user-facing error of prompt_flash_attention (docs/contract.md, section 10), only those.

One entry point, :func:`validate`, takes a :class:`Call` (the arguments by name) and returns a
:class:`ValidCall` or raises. Each check names the argument and the value received, and raises
the exception type MindSpore raises for it: TypeError for types and dtypes, ValueError for
values of the right type that make no sense (layout names, ranks, lengths, non-finite scale),
RuntimeError for the shape and argument rules the Ascend kernel enforces. Checks never use
``assert`` (it vanishes under -O).
"""
import dataclasses
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ._band import TOKENS_INF, reads_user_mask, tokens_to_band
from ._core import MASK_ADD_F16, MASK_DISCARD, MASK_NONE
from ._dtypes import F16, F32, I8, dtype_name, is_bf16
from ._torch import is_tensor

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

LAYOUTS = ("BSH", "BNSD", "BSND", "BNSD_BSND", "TND")
#: rank of query/key/value per layout
LAYOUT_RANK = {"BSH": 3, "BNSD": 4, "BSND": 4, "BNSD_BSND": 4, "TND": 3}
#: the sequence axis of query/key/value in the padded layouts
SEQ_AXIS = {"BSH": 1, "BSND": 1, "BNSD": 2, "BNSD_BSND": 2}

MAX_HEADS = 256
MAX_GROUP = 64
MAX_HEAD_DIM = 512
MAX_BATCH = 65536
BAND_MASK_SIDE = 2048

DISCARD_MASK_DTYPES = (np.dtype(np.bool_), I8, np.dtype(np.uint8))


def shape_str(shape):
    return str(tuple(int(s) for s in shape))


# ---------------------------------------------------------------------------------------------
# scalars
# ---------------------------------------------------------------------------------------------

def check_int(name, value):
    """A Python int or NumPy integer (never bool), within int64; returned as a Python int."""
    if type(value) is not int and (isinstance(value, (bool, np.bool_))    # ints skip the ABCs
                                   or not isinstance(value, (numbers.Integral, np.integer))):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    value = int(value)            # exact: value is an Integral
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must fit in int64, got {value}")
    return value


def check_scale_value(value, name="scale_value"):
    if type(value) is not float and (isinstance(value, (bool, np.bool_))  # floats skip the ABCs
                                     or not isinstance(value, numbers.Real)):  # NumPy's too
        raise TypeError(f"{name} must be a real number (int or float), got "
                        f"{type(value).__name__}: {value!r}")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got an int beyond the float range: "
                         f"{value}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {value!r}")
    return bool(value)


def check_layout(value):
    if not isinstance(value, str):
        raise TypeError(f"input_layout must be a str, got {type(value).__name__}: {value!r}")
    if value not in LAYOUTS:
        raise ValueError(f"input_layout must be one of {', '.join(LAYOUTS)}, got {value!r}")
    return value


def check_device(value):
    if value is not None and value not in ("cpu", "cuda"):
        raise ValueError(f"device must be None, 'cpu' or 'cuda', got {value!r}")
    return value


def check_placement(call):
    """The device the call runs on ('cpu' or 'cuda'): ``device``, or where the query lives.
    The call's tensors (query, key, value, attn_mask, pse_shift) all live on one device."""
    check_device(call.device)
    query_on_cuda = is_cuda_array(call.query)
    here = "a CUDA array" if query_on_cuda else "a host (NumPy) array"
    tensors = call.tensors()
    for name, x in tensors.items():
        if x is not None and is_cuda_array(x) != query_on_cuda:
            where = "a CUDA array" if not query_on_cuda else "a host (NumPy) array"
            raise RuntimeError(f"{name} is {where} but query is {here}: {', '.join(tensors)} "
                               f"must live on the same device (got {type(x).__name__})")
    return call.device or ("cuda" if query_on_cuda else "cpu")


def check_range(name, value, lo, hi):
    if not lo <= value <= hi:
        raise RuntimeError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def check_offset_like(oname, offset, sname, scale):
    """An offset argument has its scale's dtype (TypeError) and shape (RuntimeError)."""
    if offset.dtype != scale.dtype:
        raise TypeError(f"{oname} dtype must equal {sname}'s ({dtype_name(scale.dtype)}), got "
                        f"{dtype_name(offset.dtype)}")
    if offset.shape != scale.shape:
        raise RuntimeError(f"{oname} shape must equal {sname}'s {shape_str(scale.shape)}, got "
                           f"{shape_str(offset.shape)}")


def check_band_signs(pre_tokens, next_tokens, where, int8_out=False):
    """Sign rules of contract 'The band', applied only where pre/next are used (``where`` says
    which)."""
    pre, nxt = tokens_to_band(pre_tokens), tokens_to_band(next_tokens)
    if pre is not None and nxt is not None:
        if pre < 0 and nxt < 0:
            raise RuntimeError(f"pre_tokens ({pre_tokens}) and next_tokens ({next_tokens}) must "
                               f"not both be negative ({where})")
        if pre + nxt < 0:
            raise RuntimeError(f"pre_tokens + next_tokens must be >= 0 ({where}): pre_tokens = "
                               f"{pre_tokens}, next_tokens = {next_tokens} leave an empty band")
    if int8_out and (pre_tokens < 0 or next_tokens < 0):
        raise RuntimeError(f"sparse_mode 4 with int8 output needs pre_tokens and next_tokens "
                           f">= 0, got pre_tokens = {pre_tokens}, next_tokens = {next_tokens}")


# ---------------------------------------------------------------------------------------------
# arrays
# ---------------------------------------------------------------------------------------------

def is_cuda_array(x):
    """CUDA arrays: __cuda_array_interface__ (Numba, CuPy, ...), PyTorch CUDA tensors (also
    bfloat16 ones, whose interface raises), and the CUDA simulator's device arrays."""
    if isinstance(x, np.ndarray) or x is None:
        return False
    if is_tensor(x):
        return bool(x.is_cuda)
    if "simulator" in type(x).__module__:
        return True
    try:
        return hasattr(x, "__cuda_array_interface__")
    except Exception:
        return False


def check_array(name, x):
    """A NumPy array, as a plain ndarray (CUDA arrays are recognised before this is called)."""
    if not isinstance(x, np.ndarray):
        shape = getattr(x, "shape", None)
        raise TypeError(f"{name} must be a NumPy array, a torch tensor or a CUDA array, got "
                        f"{type(x).__name__}" + (f" of shape {shape_str(shape)}"
                                                 if isinstance(shape, tuple) else ""))
    return _plain(name, x)


def _plain(name, x):
    """An ndarray subclass as a plain ndarray over the same memory (np.matrix, np.memmap, ...:
    their own indexing rules must not reach the kernels); a masked array is refused (its mask
    would be silently dropped: pass attn_mask instead). Anything else is returned as it is."""
    if x is None or type(x) is np.ndarray:           # the common cases, quickly
        return x
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} must be a plain NumPy array, got a masked array "
                        f"(np.ma.MaskedArray of shape {shape_str(x.shape)}); pass the positions "
                        f"to drop as attn_mask")
    if isinstance(x, np.ndarray):
        return x.view(np.ndarray)
    return x


def check_qkv_dtypes(query, key, value):
    dt = query.dtype
    if dt not in (F16, F32, I8) and not is_bf16(dt):
        raise TypeError(f"query dtype must be float16, bfloat16, float32 or int8, got "
                        f"{dtype_name(dt)}")
    for name, x in (("key", key), ("value", value)):
        if x.dtype != dt:
            raise TypeError(f"{name} dtype must equal the query dtype ({dtype_name(dt)}), got "
                            f"{dtype_name(x.dtype)}")
    return dt


def check_rank(name, x, layout):
    want = LAYOUT_RANK[layout]
    if x.ndim != want:
        raise ValueError(f"{name} must have rank {want} for input_layout {layout!r}, got shape "
                         f"{shape_str(x.shape)} (rank {x.ndim})")


def check_seq_lengths(name, value, batch, max_len):
    """actual_seq_lengths(_kv) of the padded layouts (contract 'Lengths'): int64, length B."""
    if value is None:
        return np.full(batch, max_len, dtype=np.int64)
    arr = _int_vector(name, value)
    if arr.size != 1 and arr.size != batch:
        raise ValueError(f"{name} must have 1 or B = {batch} values, got {arr.size}")
    bad = (arr < 0) | (arr > max_len)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name} values must be in [0, {max_len}]: {name}[{i}] = {int(arr[i])}")
    return np.full(batch, arr[0], dtype=np.int64) if arr.size == 1 else arr


def check_cumulative_ends(name, value, total):
    """TND ends (contract 'Layouts'): required, 1-D, non-decreasing, from >= 0, last == total."""
    if value is None:
        raise ValueError(f"{name} is required with input_layout 'TND' (cumulative sequence "
                         f"ends), got None")
    arr = _int_vector(name, value)
    if arr.size and (arr[0] < 0 or np.any(np.diff(arr) < 0)):
        i = 0 if arr[0] < 0 else int(np.argmax(np.diff(arr) < 0)) + 1
        raise ValueError(f"{name} must be non-decreasing, >= 0: {name}[{i}] = {int(arr[i])}")
    last = int(arr[-1]) if arr.size else 0
    if last != total:
        raise ValueError(f"{name} must end at {total} (the packed length), it ends at {last}")
    return arr


def _int_vector(name, value):
    if isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Integral, np.integer)):
                raise TypeError(f"{name} must hold integers, got {type(v).__name__}: {v!r}")
        try:
            arr = np.asarray(value, dtype=np.int64) if len(value) else np.zeros(0, np.int64)
        except OverflowError:
            bad = next(v for v in value if not INT64_MIN <= v <= INT64_MAX)
            raise ValueError(f"{name} values must fit in int64, got {bad}") from None
    elif isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {dtype_name(value.dtype)}")
        if value.dtype == np.uint64 and value.size and value.max() > INT64_MAX:
            raise ValueError(f"{name} values must fit in int64, got {int(value.max())}")
        arr = value.astype(np.int64)
    elif isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be 1-D (a list, tuple or array of ints), got the "
                         f"scalar {value!r}")
    else:
        raise TypeError(f"{name} must be a list, tuple or array of ints, got "
                        f"{type(value).__name__}: {value!r}"[:300])
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {shape_str(arr.shape)}")
    return arr


# ---------------------------------------------------------------------------------------------
# the call and its validation
# ---------------------------------------------------------------------------------------------

QUANT_ARGS = ("deq_scale1", "quant_scale1", "deq_scale2", "quant_scale2", "quant_offset2")
#: the tensor arguments, which live on one device (host or CUDA)
TENSOR_ARGS = ("query", "key", "value", "attn_mask", "pse_shift")
#: every argument that may be an array
ARRAY_ARGS = TENSOR_ARGS + QUANT_ARGS + ("actual_seq_lengths", "actual_seq_lengths_kv")


@dataclass(frozen=True)
class Call:
    """One prompt_flash_attention call: every argument by its name, as the caller passed it."""
    query: Any
    key: Any
    value: Any
    attn_mask: Any = None
    actual_seq_lengths: Any = None
    actual_seq_lengths_kv: Any = None
    pse_shift: Any = None
    deq_scale1: Any = None
    quant_scale1: Any = None
    deq_scale2: Any = None
    quant_scale2: Any = None
    quant_offset2: Any = None
    num_heads: Any = 1
    scale_value: Any = 1.0
    pre_tokens: Any = TOKENS_INF
    next_tokens: Any = 0
    input_layout: Any = "BSH"
    num_key_value_heads: Any = 0
    sparse_mode: Any = 0
    inner_precise: Any = 1
    device: Any = None
    return_softmax_lse: Any = False

    def tensors(self):
        """{name: array or None} of the tensor arguments."""
        return {name: getattr(self, name) for name in TENSOR_ARGS}

    def with_arrays(self, arrays):
        """This call with some array arguments replaced ({name: array})."""
        return dataclasses.replace(self, **arrays)


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


def validate(call, stage=None):
    """Check every argument of ``call`` (contract 'Errors') and return it as a :class:`ValidCall`.

    The device comes first; then ``stage(call, device)`` (from the API) gives the host-readable
    arrays the other checks read where the call holds CUDA arrays or torch tensors (or None). They
    run in a fixed order (scalars before tensors), so a call with several faults
    always reports the same one."""
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
    attn_mask = _plain("attn_mask", call.attn_mask)
    pse_shift = _plain("pse_shift", call.pse_shift)
    dtype = check_qkv_dtypes(query, key, value)
    quant = {name: _plain(name, getattr(call, name)) for name in QUANT_ARGS}
    is_quant = dtype == I8 or any(x is not None for x in quant.values())
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_rank(name, x, layout)

    n, nkv, d = _heads_and_dims(layout, query, key, value, num_heads, num_key_value_heads)
    qparams = None
    if is_quant:
        if layout == "TND":
            given = [f"{k} of shape {shape_str(np.shape(x))}" for k, x in quant.items()
                     if x is not None] or [f"an int8 query of shape {shape_str(query.shape)}"]
            raise RuntimeError(f"input_layout 'TND' supports no quantization, got "
                               f"{', '.join(given)}")
        qparams = _quant(dtype, quant, n, d)
    if n > MAX_HEADS:
        raise RuntimeError(f"num_heads must be <= {MAX_HEADS}, got {n}")
    if n % nkv:
        raise RuntimeError(f"num_heads ({n}) must be divisible by num_key_value_heads ({nkv})")
    g = n // nkv
    if g > MAX_GROUP:
        raise RuntimeError(f"num_heads / num_key_value_heads must be <= {MAX_GROUP}, got "
                           f"{n} / {nkv} = {g}")
    if d == 0:
        raise RuntimeError(f"head dim D must be > 0, got 0 (query shape "
                           f"{shape_str(query.shape)})")
    if d > MAX_HEAD_DIM:
        raise RuntimeError(f"head dim D must be <= {MAX_HEAD_DIM}, got {d} (query shape "
                           f"{shape_str(query.shape)})")
    if is_bf16(dtype) and d % 16:
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
            mask_kind, mask = _user_mask(attn_mask, dtype, batch, sq, skv)
            check_band_signs(pre_tokens, next_tokens, "sparse_mode 0 with attn_mask")
    elif sparse_mode == 1:
        if attn_mask is None:
            raise RuntimeError("sparse_mode 1 (allMask) requires attn_mask, got None")
        mask_kind, mask = _user_mask(attn_mask, dtype, batch, sq, skv)
    else:
        _check_band_mask(attn_mask, sparse_mode, batch)
        if sparse_mode == 4:
            check_band_signs(pre_tokens, next_tokens, "sparse_mode 4",
                             int8_out=qparams is not None and qparams.out_dtype == I8)
    pse = None if pse_shift is None else _pse(pse_shift, dtype, batch, n, sq, skv)
    return ValidCall(layout=layout, dtype=dtype, N=n, Nkv=nkv, G=g, D=d, B=batch, Sq=sq,
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
    if batch > MAX_BATCH:
        raise RuntimeError(f"batch B must be <= {MAX_BATCH}, got {batch} sequences")
    return batch, sq, skv, qlen, klen, q_start, kv_start


def _padded_lengths(call, layout, query, key, value):
    """Padded layouts: (B, Sq, Skv, qL, kL)."""
    batch = query.shape[0]
    for name, x in (("key", key), ("value", value)):
        if x.shape[0] != batch:
            raise RuntimeError(f"batch B differs between query ({batch}) and {name} "
                               f"({x.shape[0]}); {name} shape {shape_str(x.shape)}")
    if batch > MAX_BATCH:
        raise RuntimeError(f"batch B must be <= {MAX_BATCH}, got {batch} (query shape "
                           f"{shape_str(query.shape)})")
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
    """(N, Nkv, D) from the shapes, checking the head rules of contract 'Layouts' and 'Errors'."""
    n = num_heads
    nkv = num_kv_heads if num_kv_heads > 0 else n
    if layout == "BSH":
        h, hk, hv = query.shape[2], key.shape[2], value.shape[2]
        if h % n:
            raise RuntimeError(f"the query hidden size H ({h}) must be divisible by num_heads "
                               f"({n}); query shape {shape_str(query.shape)}")
        d = h // n
        for name, hx in (("key", hk), ("value", hv)):
            if num_kv_heads == 0 and hx != h:
                raise RuntimeError(f"{name} hidden size ({hx}) must equal the query hidden size "
                                   f"({h}): num_key_value_heads = 0 means as many kv heads as "
                                   f"num_heads ({n}); for grouped-query attention pass "
                                   f"num_key_value_heads; {name} shape "
                                   f"{shape_str((key if name == 'key' else value).shape)}")
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
                           f"{shape_str(query.shape)} but num_heads is {n}")
    for name, x in (("key", key), ("value", value)):
        if x.shape[head_axis] != nkv:
            given = (f"num_key_value_heads = 0 means as many kv heads as num_heads ({n}); for "
                     f"grouped-query attention pass num_key_value_heads={x.shape[head_axis]}"
                     if num_kv_heads == 0 else f"num_key_value_heads is {nkv}")
            raise RuntimeError(f"{name} has {x.shape[head_axis]} heads in its shape "
                               f"{shape_str(x.shape)} but {given}")
    d = query.shape[-1]
    for name, x in (("key", key), ("value", value)):
        if x.shape[-1] != d:
            raise RuntimeError(f"head dim D differs between query ({d}) and {name} "
                               f"({x.shape[-1]}); {name} shape {shape_str(x.shape)}")
    return n, nkv, d


def _check_band_mask(attn_mask, sparse_mode, batch):
    """Modes 2-4: a (2048, 2048)-class mask must be present; it is never read."""
    if attn_mask is None:
        raise RuntimeError(f"sparse_mode {sparse_mode} requires attn_mask (a 2048x2048 "
                           f"triu(ones, 1) mask), got None")
    check_array("attn_mask", attn_mask)
    if attn_mask.dtype not in DISCARD_MASK_DTYPES:
        raise TypeError(f"attn_mask dtype must be bool, int8 or uint8 for sparse_mode "
                        f"{sparse_mode}, got {dtype_name(attn_mask.dtype)}")
    s = BAND_MASK_SIDE
    accepted = [(s, s), (1, s, s), (1, 1, s, s), (batch, 1, s, s)]
    if tuple(attn_mask.shape) not in accepted:
        raise RuntimeError(f"attn_mask shape for sparse_mode {sparse_mode} must be one of "
                           f"(2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048), (B, 1, 2048, "
                           f"2048) with B = {batch}, got {shape_str(attn_mask.shape)}")


def _user_mask(attn_mask, dtype, batch, sq, skv):
    """Modes 0 and 1: the user mask as a (Bm, Sq, Skv) window and its kind."""
    check_array("attn_mask", attn_mask)
    if attn_mask.dtype in DISCARD_MASK_DTYPES:
        kind = MASK_DISCARD
    elif attn_mask.dtype == F16:
        if dtype != F16:
            raise TypeError(f"a float16 attn_mask needs a float16 query, got query dtype "
                            f"{dtype_name(dtype)}")
        warnings.warn("a float16 attn_mask (additive, -10000 * mask) is deprecated; pass a "
                      "bool mask (True = discard)", DeprecationWarning, stacklevel=4)
        kind = MASK_ADD_F16
    else:
        raise TypeError(f"attn_mask dtype must be bool, int8, uint8 (or float16 with a float16 "
                        f"query), got {dtype_name(attn_mask.dtype)}")
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
        raise RuntimeError(f"attn_mask shape {shape_str(shape)} is not accepted: expected "
                           f"(Sq, Skv), (B, Sq, Skv), (1, Sq, Skv), (B, 1, Sq, Skv) or "
                           f"(1, 1, Sq, Skv) with B = {batch}, Sq = {sq}, Skv = {skv} (the last "
                           f"two axes may be larger)")
    return kind, m[:, :sq, :skv]


def _pse(pse_shift, dtype, batch, n, sq, skv):
    check_array("pse_shift", pse_shift)
    want = F16 if dtype in (F16, I8) else dtype
    if pse_shift.dtype != want:
        raise TypeError(f"pse_shift dtype must be {dtype_name(want)} for a "
                        f"{dtype_name(dtype)} query, got {dtype_name(pse_shift.dtype)}")
    shape = pse_shift.shape
    if (pse_shift.ndim != 4 or shape[0] not in (1, batch) or shape[1] != n
            or shape[2] < sq or shape[3] < skv):
        raise RuntimeError(f"pse_shift shape must be (B, N, >=Sq, >=Skv) or (1, N, >=Sq, >=Skv) "
                           f"with B = {batch}, N = {n}, Sq = {sq}, Skv = {skv}, got "
                           f"{shape_str(shape)}")
    return pse_shift[:, :, :sq, :skv]


@dataclass
class QuantParams:
    kind: str                 # 'int8->int8', 'int8->float16' or 'float->int8'
    out_dtype: np.dtype
    deq1: float               # decoded float32 scales (0 where unused)
    quant1: float
    deq2: float
    scale2: Optional[np.ndarray]    # float32 (H,) (per-channel) or (1,) (per-tensor)
    offset2: Optional[np.ndarray]


def decode_deq_scale(x):
    """deq_scale as float32: uint64 is Ascend's packed form float32_from_bits(u64 & 0xFFFFE000)."""
    if x.dtype == np.uint64:
        bits = (x.reshape(-1) & np.uint64(0xFFFFE000)).astype(np.uint32)
        return float(bits.view(np.float32)[0])
    return float(x.reshape(-1)[0])


def _quant(dtype, quant, n, d):
    """Check the quantization arguments against the table of contract 'Quantization'; decode
    them."""
    given = {name: check_array(name, x) for name, x in quant.items() if x is not None}
    if dtype == I8:
        out_int8 = "quant_scale2" in given
        required = ["deq_scale1", "quant_scale1", "deq_scale2"] + (["quant_scale2"] if out_int8 else [])
        forbidden = [] if out_int8 else ["quant_offset2"]
        kind = "int8->int8" if out_int8 else "int8->float16"
        if not out_int8 and "quant_offset2" in given:
            raise RuntimeError("quant_offset2 needs quant_scale2 (int8 output); with int8 "
                               "query/key/value and float16 output quant_offset2 must be None, "
                               f"got shape {shape_str(given['quant_offset2'].shape)}")
    else:
        required = ["quant_scale2"]
        forbidden = ["deq_scale1", "quant_scale1", "deq_scale2"]
        kind = "float->int8"
        if "quant_scale2" not in given and "quant_offset2" in given:
            raise RuntimeError(f"quant_offset2 needs quant_scale2, got quant_offset2 of shape "
                               f"{shape_str(given['quant_offset2'].shape)} and quant_scale2 None")
    for name in forbidden:
        if name in given:
            raise RuntimeError(f"{name} must be None for {kind} ({dtype_name(dtype)} "
                               f"query/key/value), got an array of shape "
                               f"{shape_str(given[name].shape)}")
    for name in required:
        if name not in given:
            raise RuntimeError(f"{name} is required for {kind} ({dtype_name(dtype)} "
                               f"query/key/value), got None")

    deq1 = quant1 = deq2 = 0.0
    if dtype == I8:
        d1, q1, d2 = given["deq_scale1"], given["quant_scale1"], given["deq_scale2"]
        for name, x in (("deq_scale1", d1), ("deq_scale2", d2)):
            if x.dtype not in (np.dtype(np.uint64), F32):
                raise TypeError(f"{name} dtype must be uint64 or float32, got "
                                f"{dtype_name(x.dtype)}")
        if d1.dtype != d2.dtype:
            raise TypeError(f"deq_scale1 and deq_scale2 must have the same dtype, got deq_scale1 "
                            f"{dtype_name(d1.dtype)} and deq_scale2 {dtype_name(d2.dtype)}")
        if q1.dtype != F32:
            raise TypeError(f"quant_scale1 dtype must be float32, got {dtype_name(q1.dtype)}")
        for name, x in (("deq_scale1", d1), ("quant_scale1", q1), ("deq_scale2", d2)):
            if x.shape != (1,):
                raise RuntimeError(f"{name} must have shape (1,), got {shape_str(x.shape)}")
        deq1, quant1, deq2 = decode_deq_scale(d1), float(q1[0]), decode_deq_scale(d2)

    scale2 = offset2 = None
    out_dtype = F16
    if "quant_scale2" in given:
        out_dtype = I8
        s2 = given["quant_scale2"]
        bf16 = is_bf16(dtype)
        if not (s2.dtype == F32 or (bf16 and s2.dtype == dtype)):
            raise TypeError(f"quant_scale2 dtype must be float32{' or bfloat16' if bf16 else ''} "
                            f"for a {dtype_name(dtype)} query, got {dtype_name(s2.dtype)}")
        h = n * d
        per_channel_shapes = [(h,), (1, 1, h), (1, n, 1, d), (n, d), (1, 1, n, d)]
        if s2.shape == (1,):
            pass
        elif s2.shape in per_channel_shapes:
            if d % 32:
                raise RuntimeError(f"per-channel quant_scale2 (shape {shape_str(s2.shape)}) "
                                   f"needs head dim D % 32 == 0, got D = {d}")
        else:
            raise RuntimeError(f"quant_scale2 shape must be (1,) or one of "
                               f"{', '.join(shape_str(x) for x in per_channel_shapes)} (H = {h}), "
                               f"got {shape_str(s2.shape)}")
        scale2 = s2.astype(np.float32).reshape(-1)
        if "quant_offset2" in given:
            o2 = given["quant_offset2"]
            check_offset_like("quant_offset2", o2, "quant_scale2", s2)
            offset2 = o2.astype(np.float32).reshape(-1)
        else:
            offset2 = np.zeros_like(scale2)
    return QuantParams(kind=kind, out_dtype=out_dtype, deq1=deq1, quant1=quant1, deq2=deq2,
                       scale2=scale2, offset2=offset2)
