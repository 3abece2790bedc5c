"""The checks of single arguments (docs/contract.md, section 10): scalars, arrays, layouts and
the limits of the contract, shared by the calls' validation (:mod:`.pfa`, :mod:`.fia`) and the
public functions; and :class:`Arguments`, what every call's record of its arguments shares.

Each check names the argument and the value received, and raises the exception type MindSpore
raises for it: TypeError for types and dtypes, ValueError for values of the right type that
make no sense (layout names, ranks, lengths, non-finite scale), RuntimeError for the shape and
argument rules the Ascend kernel enforces. Checks never use ``assert`` (it vanishes under -O).
"""
import dataclasses
import functools
import math
import numbers

from typing import Any

import numpy as np

from ..interop import cuda_arrays, torch_tensors
from ..interop.torch_tensors import is_tensor
from ..numerics.dtypes import F16, F32, I8, dtype_name, is_bf16
from ..numerics.band import TOKENS_INF, tokens_to_band

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


def spelled(own):
    """An operator whose keyword arguments, spelled as the other operator spells them (``own``:
    {that spelling: this operator's}), are a TypeError naming this operator's spelling, not
    Python's bare "unexpected keyword argument"."""
    def wrap(operator):
        @functools.wraps(operator)
        def call(*args, **kwargs):
            if kwargs.keys() & own.keys():
                raise TypeError(f"{operator.__name__}() got an unexpected keyword argument "
                                f"{spelling_hint(call, kwargs)}")
            return operator(*args, **kwargs)
        call.spellings = own
        return call
    return wrap


def spelling_hint(operator, kwargs):
    """'name': how ``operator`` (made by :func:`spelled`) spells the first of ``kwargs`` it
    spells otherwise; "" where there is none."""
    own = getattr(operator, "spellings", {})
    name = next((n for n in kwargs if n in own), None)
    return "" if name is None else f"{name!r}: {operator.__name__} spells it {own[name]!r}"


@dataclasses.dataclass(frozen=True)
class Arguments:
    """What a call's record of its arguments (:class:`.pfa.Call`, :class:`.fia.FiaCall`: frozen
    dataclasses, every argument by its name, as passed, all but query, key and value by
    keyword) shares: the arguments both operators take under one name, with one default, and
    its tensors, which live on one device, named by ``TENSORS``."""
    query: Any
    key: Any
    value: Any
    _: dataclasses.KW_ONLY
    pse_shift: Any = None
    actual_seq_lengths: Any = None
    actual_seq_lengths_kv: Any = None
    quant_scale1: Any = None
    quant_scale2: Any = None
    quant_offset2: Any = None
    num_heads: Any = 1
    pre_tokens: Any = TOKENS_INF
    input_layout: Any = "BSH"
    num_key_value_heads: Any = 0
    sparse_mode: Any = 0
    inner_precise: Any = 1
    device: Any = None

    TENSORS = ()

    def __post_init__(self):
        for name, x in vars(self).items():          # every argument: a call's hot path
            if type(x) not in _NEVER_MASKED:
                refuse_masked(name, x)

    def tensors(self):
        """{name: array or None} of the tensor arguments."""
        return {name: getattr(self, name) for name in self.TENSORS}

    def with_arrays(self, arrays):
        """This call with some arguments replaced ({name: value})."""
        return dataclasses.replace(self, **arrays)


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


def require(value, error, requirement):
    """A required argument is given: else ``error`` saying ``requirement``, got None."""
    if value is None:
        raise error(f"{requirement}, got None")


def check_offset_like(oname, offset, sname, scale):
    """An offset argument has its scale's dtype (TypeError) and shape (RuntimeError)."""
    check_same("dtype", sname, scale, oname, offset)
    check_same("shape", sname, scale, oname, offset)


def check_same(attribute, a_name, a, b_name, b):
    """Two arrays that go together have one ``attribute``: "dtype" (else TypeError) or "shape"
    (else RuntimeError)."""
    x, y = getattr(a, attribute), getattr(b, attribute)
    if x != y:
        error, show = (TypeError, dtype_name) if attribute == "dtype" else (RuntimeError, shape_str)
        raise error(f"{a_name} and {b_name} {attribute}s differ: {show(x)} and {show(y)}")


def check_key_value_shapes(k_name, k, v_name, v):
    """A key and its value have one shape but for the last axis (value's head dim Dv, an
    extension, may differ from key's D; BSH: the hidden size Nkv * Dv): else RuntimeError."""
    if k.ndim != v.ndim or k.shape[:-1] != v.shape[:-1]:
        raise RuntimeError(f"{k_name} and {v_name} shapes differ: {shape_str(k.shape)} and "
                           f"{shape_str(v.shape)} (they may differ in the last axis only: "
                           f"value's head dim)")


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
        return bool(torch_tensors.on_cuda(x))
    if "simulator" in type(x).__module__:
        return True
    try:
        return hasattr(x, "__cuda_array_interface__")
    except Exception:
        return False


def sink_logits(value, heads, name="sinks"):
    """Attention sinks (argument ``name``) as float32 (heads,) on the host: an array (NumPy, a
    torch tensor, a CUDA array: copied here) of real numbers (TypeError) with one value a query
    head (ValueError)."""
    if is_cuda_array(value):
        value = cuda_arrays.checked(name, cuda_arrays.to_host, value)
    elif torch_tensors.is_cpu_tensor(value):
        value = torch_tensors.as_numpy(name, value)
    arr = check_array(name, value)
    if arr.dtype.kind not in "fiu" and not is_bf16(arr.dtype):
        raise TypeError(f"{name} must hold real numbers, got dtype {dtype_name(arr.dtype)}")
    if arr.shape != (heads,):
        raise ValueError(f"{name} must have one value a query head, shape ({heads},), got "
                         f"shape {shape_str(arr.shape)}")
    return arr.astype(np.float32)


def check_array(name, x):
    """A NumPy array, as a plain ndarray (CUDA arrays are recognised before this is called)."""
    if not isinstance(x, np.ndarray):
        shape = getattr(x, "shape", None)
        raise TypeError(f"{name} must be a NumPy array, a torch tensor or a CUDA array, got "
                        f"{type(x).__name__}" + (f" of shape {shape_str(shape)}"
                                                 if isinstance(shape, tuple) else ""))
    return plain(name, x)


def plain(name, x):
    """An ndarray subclass as a plain ndarray over the same memory (np.matrix, np.memmap, ...:
    their own indexing rules must not reach the kernels); a masked array is refused (its mask
    would be silently dropped: pass attn_mask instead). Anything else is returned as it is."""
    if x is None or type(x) is np.ndarray:           # the common cases, quickly
        return x
    refuse_masked(name, x)
    if isinstance(x, np.ndarray):
        return x.view(np.ndarray)
    return x


def refuse_masked(name, x):
    """A masked array (or a list of arrays holding one) is a TypeError: the kernels would read
    its data and drop its mask."""
    if isinstance(x, (list, tuple)):
        for item in x:
            refuse_masked(name, item)
    elif isinstance(x, np.ma.MaskedArray):
        hint = ("pass the positions to drop in the attention mask" if name in MASKABLE
                else "its mask would be ignored")
        raise TypeError(f"{name} must be a plain NumPy array, got a masked array "
                        f"(np.ma.MaskedArray of shape {shape_str(x.shape)}); {hint}")


#: the types of most arguments, which hold no mask (checked by type, not by isinstance)
_NEVER_MASKED = frozenset({type(None), bool, int, float, str, np.ndarray})

#: the arguments whose masked positions an attention mask can drop instead
MASKABLE = ("query", "key", "value", "pse_shift")


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
    require(value, ValueError, f"{name} is required with input_layout 'TND' (cumulative "
            f"sequence ends)")
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
