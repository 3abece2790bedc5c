"""The kv sequence a float32 work item walks: a shared prefix's rows (j < P, from the prefix
arrays), then the batch's own rows (contiguous from the batch's first row, or the slots of a
paged pool's blocks, :func:`~.._kernel_args.kv_row`). The tile loads read K and V rows at the
element offsets these functions give; a tile never straddles the prefix's end."""
from numba import njit

from .._kernel_args import (P_BLOCK, P_PREFIX, S_ELEM, S_HEAD, S_ROW, T_K, T_PK, T_PV, T_V,
                            kv_row)
from ._jit import LEAF


@njit(**LEAF)
def kv_tile_end(params, j0, tk, jend):
    """The end of the kv tile from column j0: tk columns, not past jend nor past the prefix."""
    j1 = min(j0 + tk, jend)
    if j0 < params[P_PREFIX]:
        j1 = min(j1, params[P_PREFIX])
    return j1


@njit(**LEAF)
def kv_tile_rows(table, geo, b, g, j0, nc, ro):
    """The element offsets of kv rows j0 .. j0 + nc of kv head g of batch b: ro[0, c] in the
    key's array, ro[1, c] in the value's. Returns (whether the rows are the prefix's, the key's
    and the value's element strides)."""
    strides, boff, _, params = geo
    P = params[P_PREFIX]
    if j0 < P:
        for c in range(nc):
            ro[0, c] = boff[T_PK, b] + g * strides[T_PK, S_HEAD] + (j0 + c) * strides[T_PK, S_ROW]
            ro[1, c] = boff[T_PV, b] + g * strides[T_PV, S_HEAD] + (j0 + c) * strides[T_PV, S_ROW]
        return True, strides[T_PK, S_ELEM], strides[T_PV, S_ELEM]
    block = params[P_BLOCK]
    for c in range(nc):
        j = j0 + c - P
        ro[0, c] = kv_row(strides, boff, table, block, T_K, b, j) + g * strides[T_K, S_HEAD]
        ro[1, c] = kv_row(strides, boff, table, block, T_V, b, j) + g * strides[T_V, S_HEAD]
    return False, strides[T_K, S_ELEM], strides[T_V, S_ELEM]


@njit(**LEAF)
def kv_value_row(table, geo, b, g, j):
    """(whether in the prefix, element offset, element stride) of V row j of kv head g."""
    strides, boff, _, params = geo
    P = params[P_PREFIX]
    if j < P:
        return (True, boff[T_PV, b] + g * strides[T_PV, S_HEAD] + j * strides[T_PV, S_ROW],
                strides[T_PV, S_ELEM])
    off = kv_row(strides, boff, table, params[P_BLOCK], T_V, b, j - P)
    return False, off + g * strides[T_V, S_HEAD], strides[T_V, S_ELEM]
