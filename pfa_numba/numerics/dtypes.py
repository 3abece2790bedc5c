"""The dtypes pfa_numba computes on, by the names users know them by."""
import numpy as np

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
I8 = np.dtype(np.int8)


def is_bf16(dt):
    """Whether ``dt`` is ml_dtypes' bfloat16. ml_dtypes is imported only for a dtype of that
    name (whoever made a bfloat16 array has imported it already), which keeps its import out
    of a fresh process's first call on other dtypes."""
    dt = np.dtype(dt)
    if dt.kind != "V" or dt.name != "bfloat16":      # ml_dtypes' types are kind 'V'
        return False
    import ml_dtypes
    return dt == np.dtype(ml_dtypes.bfloat16)


def dtype_name(dt):
    """The name users know a dtype by ('bfloat16', 'float16', ...)."""
    return np.dtype(dt).name
