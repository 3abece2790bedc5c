"""Which planned problems the tensor-core kernels (``tc_kernel``, ``decode_kernel``) take, and
which of their compile-time variants a problem gets: its 16-bit kind, whether its scores are
made per accumulator (``masked``: a user mask or pse to read, or a softcap), whether its kv
rows are walked through the kv sequence (``walk``), and, as reasons, what they do not run
(quantized outputs, scales beyond one float32 factor, softcaps beyond the SFU form's range,
unaligned rows, head spans past 32-bit offsets). ``dispatch`` reads these through
``launch.tensor_core_reasons`` and ``launch.decode_reasons``.
"""
import numpy as np

from ..numerics.core import MASK_NONE
from ..numerics.dtypes import F16, is_bf16
from ..numerics.kernel_args import scale_factors
from .guard import antiquant_reason, dequantizes
from .tc_kernel import BKV, ROWS


def reads_mask_or_pse(p):
    """Whether planned problem ``p`` reads a user mask (one the sparse mode reads) or pse: it
    then takes the masked variant (:func:`masked_variant`) and the V guard."""
    return p.mask_kind != MASK_NONE or p.pse is not None


def masked_variant(p):
    """Whether planned problem ``p`` takes the kernels' ``masked`` variants, whose scores are
    made per accumulator: a user mask or pse to read (:func:`reads_mask_or_pse`), or a
    softcap."""
    return reads_mask_or_pse(p) or p.softcap != 0


def walks(p):
    """Whether planned problem ``p``'s K/V rows are found through the kv sequence (the
    kernels' ``walk`` variants): a shared prefix, a block table, or an int8 cache (whose rows'
    token pairs are found there too)."""
    cache = p.cache
    return cache is not None and (cache.block_table is not None or bool(cache.P)
                                  or dequantizes(p))


def kind_of(dtype):
    """"f16" / "bf16" for float16 / bfloat16, else None."""
    return "f16" if np.dtype(dtype) == F16 else "bf16" if is_bf16(dtype) else None


def strides_aligned(x):
    """Rows of 16-bit values contiguous along D, every other used stride a multiple of 16
    bytes (axes of length 1 are never stepped along)."""
    if x.strides[-1] != x.itemsize:
        return False
    return all(st % 16 == 0 for n, st in zip(x.shape[:-1], x.strides[:-1]) if n > 1)


def scale_reason(scale):
    """None when the tensor-core kernels can fold ``scale`` into their weights (one nonzero
    float32 factor), else why not."""
    s1, s2, e = scale_factors(scale)
    if s2 != np.float32(1.0) or e != 0:
        return f"scale_value {scale!r} is outside float32's plain range (two factors)"
    if s1 == 0:
        return "scale_value 0: the tensor-core kernels fold a nonzero scale into their weights"
    return None


#: the softcaps the capped variants compute to about the float16 rounding of P: above, the
#: cap's float32 ulps (its error is a few of them) outweigh it; below, 2 log2 e / cap
#: overflows float32
SOFTCAP_RANGE = (2.0 ** -64, 1024.0)


def softcap_reason(softcap):
    """None when the tensor-core kernels compute ``softcap`` (0: none) to about P's 16-bit
    rounding (:data:`SOFTCAP_RANGE`), else why not."""
    lo, hi = SOFTCAP_RANGE
    if softcap == 0 or lo <= softcap <= hi:
        return None
    return (f"softcap {softcap!r} is outside [2^-64, {hi:g}]: the tensor-core kernels' cap (in "
            "log2 units, on the SFU) is accurate to P's 16-bit rounding inside it")


def rows_reason(p):
    """None when planned problem ``p``'s query, key and value rows (a shared prefix's too)
    are contiguous 16-byte-aligned runs and its mask and pse columns contiguous, as the
    tensor-core kernels read them, else why not."""
    arrays = [("query", p.q), ("key", p.k), ("value", p.v)]
    if p.cache is not None and p.cache.P:
        arrays += [("key_shared_prefix", p.cache.prefix_key),
                   ("value_shared_prefix", p.cache.prefix_value)]
    for name, x in arrays:
        if not strides_aligned(x):
            return f"{name} rows are not contiguous 16-byte-aligned runs (strides {x.strides})"
    for name, x in (("atten_mask", p.mask), ("pse_shift", p.pse)):
        if (reads_mask_or_pse(p) and x is not None and x.shape[-1] > 1
                and x.strides[-1] != x.itemsize):
            return (f"{name}'s columns are not contiguous (strides {x.strides}): the "
                    "tensor-core kernels read them at constant offsets")
    return None


def tensor_core_reason(p):
    """None when the tensor-core kernel can run planned problem ``p`` as far as the problem
    goes beyond what ``dispatch`` declares of the kernel (dtypes, head dims, compute
    capability), else why not. (Device pointers' alignment is the launch's situation,
    ``launch.Situation``; V's finiteness is decided on the device, ``guard.nonfinite_scan``.)"""
    if np.dtype(p.out_dtype) != np.dtype(p.dtype):
        return f"a {np.dtype(p.out_dtype).name} output (quantized): the scalar kernel writes it"
    why = (scale_reason(p.scale) or softcap_reason(p.softcap) or antiquant_reason(p)
           or rows_reason(p))
    if why is not None:
        return why
    axis = 0 if p.packed else 2                 # the row axis of the planned views
    spans = [("query", p.q, ROWS)]
    if not walks(p):                            # (walking, kv offsets are 64-bit)
        spans += [("key", p.k, p.k.shape[axis] + BKV), ("value", p.v, p.v.shape[axis] + BKV)]
    for name, x, rows in spans:
        if rows * abs(x.strides[axis]) // x.itemsize + x.shape[-1] >= 2 ** 31:
            return (f"{name}'s rows span 2^31 elements or more: the tensor-core kernel's row "
                    "offsets are 32-bit (a block's 64 query rows, one head's key and value "
                    "rows and a tile past them)")
    return None
