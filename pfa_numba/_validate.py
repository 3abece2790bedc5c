"""Every user-facing error of prompt_flash_attention (SPEC.md section 10), and nothing else.

Each check names the argument and the value received, and raises the exception type MindSpore
raises for it: TypeError for types and dtypes, ValueError for values of the right type that
make no sense (layout names, ranks, lengths, non-finite scale), RuntimeError for the shape and
argument rules the Ascend kernel enforces. Checks never use ``assert`` (it vanishes under -O).
"""
import numbers
import operator

import numpy as np

from ._band import tokens_to_band

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

LAYOUTS = ("BSH", "BNSD", "BSND", "BNSD_BSND", "TND")
#: rank of query/key/value per layout
LAYOUT_RANK = {"BSH": 3, "BNSD": 4, "BSND": 4, "BNSD_BSND": 4, "TND": 3}

MAX_HEADS = 256
MAX_GROUP = 64
MAX_HEAD_DIM = 512
MAX_BATCH = 65536
BAND_MASK_SIDE = 2048

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
I8 = np.dtype(np.int8)
DISCARD_MASK_DTYPES = (np.dtype(np.bool_), I8, np.dtype(np.uint8))


def is_bf16(dt):
    """Whether ``dt`` is ml_dtypes' bfloat16. ml_dtypes is imported only for a dtype of that
    name (whoever made a bfloat16 array has imported it already): its import costs about 25 ms
    of a fresh process's first call."""
    if dt.name != "bfloat16":
        return False
    import ml_dtypes
    return dt == np.dtype(ml_dtypes.bfloat16)


def dtype_name(dt):
    """The name users know a dtype by ('bfloat16', 'float16', ...)."""
    return np.dtype(dt).name


def shape_str(shape):
    return str(tuple(int(s) for s in shape))


# ---------------------------------------------------------------------------------------------
# scalars
# ---------------------------------------------------------------------------------------------

def check_int(name, value):
    """A Python int or NumPy integer (never bool), within int64; returned as a Python int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    value = operator.index(value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must fit in int64, got {value}")
    return value


def check_scale_value(value):
    if (isinstance(value, (bool, np.bool_))
            or not isinstance(value, (numbers.Real, np.integer, np.floating))
            or isinstance(value, (complex, np.complexfloating))):
        raise TypeError(f"scale_value must be a real number (int or float), got "
                        f"{type(value).__name__}: {value!r}")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"scale_value must be finite, got an int beyond the float range: "
                         f"{value}") from None
    if not np.isfinite(value):
        raise ValueError(f"scale_value must be finite, got {value}")
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


def check_range(name, value, lo, hi):
    if not lo <= value <= hi:
        raise RuntimeError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def check_band_signs(pre_tokens, next_tokens, where, int8_out=False):
    """Sign rules of SPEC 4.1, applied only where pre/next are used (``where`` says which)."""
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
    if type(x).__module__.split(".")[0] == "torch":
        return bool(getattr(x, "is_cuda", False))
    if "simulator" in type(x).__module__:
        return True
    try:
        return hasattr(x, "__cuda_array_interface__")
    except Exception:
        return False


def check_array(name, x):
    """A NumPy array (CUDA arrays are recognised by the dispatcher before this is called)."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array or a CUDA array, got "
                        f"{type(x).__name__}: {x!r}"[:300])
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
    """actual_seq_lengths(_kv) for the padded layouts (SPEC 6): an int64 array of length B."""
    if value is None:
        return np.full(batch, max_len, dtype=np.int64)
    arr = _int_vector(name, value)
    if arr.size != 1 and arr.size != batch:
        raise ValueError(f"{name} must have 1 or B = {batch} values, got {arr.size}: "
                         f"{arr.tolist()}")
    bad = (arr < 0) | (arr > max_len)
    if bad.any():
        raise ValueError(f"{name} values must be in [0, {max_len}], got {int(arr[bad][0])} "
                         f"(in {arr.tolist()})")
    return np.full(batch, arr[0], dtype=np.int64) if arr.size == 1 else arr


def check_cumulative_ends(name, value, total):
    """TND ends (SPEC 3): required, 1-D, non-decreasing, from >= 0, last == total."""
    if value is None:
        raise ValueError(f"{name} is required with input_layout 'TND' (cumulative sequence "
                         f"ends), got None")
    arr = _int_vector(name, value)
    if arr.size and (arr[0] < 0 or np.any(np.diff(arr) < 0)):
        raise ValueError(f"{name} must be non-decreasing cumulative ends >= 0, got "
                         f"{arr.tolist()}")
    last = int(arr[-1]) if arr.size else 0
    if last != total:
        raise ValueError(f"{name} must end at {total} (the packed length), got {arr.tolist()}")
    return arr


def _int_vector(name, value):
    if isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Integral, np.integer)):
                raise TypeError(f"{name} must hold integers, got {type(v).__name__}: {v!r}")
        try:
            arr = np.asarray(value, dtype=np.int64) if len(value) else np.zeros(0, np.int64)
        except OverflowError:
            raise ValueError(f"{name} values must fit in int64, got {list(value)}") from None
    elif isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {dtype_name(value.dtype)}")
        if value.dtype == np.uint64 and value.size and value.max() > INT64_MAX:
            raise ValueError(f"{name} values must fit in int64, got {value.tolist()}")
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
