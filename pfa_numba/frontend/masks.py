"""The user mask and pse of a call (contract 'Errors'): their dtypes and shapes checked, and
the windows the kernels read."""
import warnings

from ..numerics.core import MASK_ADD_F16, MASK_DISCARD
from ..numerics.dtypes import F16, I8, dtype_name
from .checks import BAND_MASK_SIDE, DISCARD_MASK_DTYPES, check_array, require, shape_str


def check_band_mask(attn_mask, sparse_mode, batch):
    """Modes 2-4: a (2048, 2048)-class mask must be present; it is never read."""
    require(attn_mask, RuntimeError, f"sparse_mode {sparse_mode} requires attn_mask (a "
            f"2048x2048 triu(ones, 1) mask)")
    check_array("attn_mask", attn_mask)
    if attn_mask.dtype not in DISCARD_MASK_DTYPES:
        raise TypeError(f"attn_mask dtype must be bool, int8 or uint8 for sparse_mode "
                        f"{sparse_mode}, got {dtype_name(attn_mask.dtype)}")
    s = BAND_MASK_SIDE
    accepted = [(s, s), (1, s, s), (1, 1, s, s), (batch, 1, s, s)]
    if tuple(attn_mask.shape) not in accepted:
        raise RuntimeError(f"attn_mask shape for sparse_mode {sparse_mode} must be one of "
                           f"{', '.join(map(str, accepted))}, got {shape_str(attn_mask.shape)}")


def user_mask(attn_mask, dtype, batch, sq, skv):
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


def pse_window(pse_shift, dtype, batch, n, sq, skv):
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
