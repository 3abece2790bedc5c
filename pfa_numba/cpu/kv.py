"""The kv sequence a work item walks (the float32, streaming and AMX kernels alike): a shared
prefix's rows (j < P, from the prefix arrays), then the batch's own rows (contiguous from the
batch's first row, or the slots of a paged pool's blocks, :func:`numerics.kernel_args.kv_row`), int8
ones dequantized as they load (:mod:`frontend.antiquant`; the AMX kernel takes none). The tile loads
read K and V rows at the element offsets these functions give; a tile never straddles the
prefix's end.

ins: the :class:`.records.Inputs` of the kernel arguments (of which these read the prefix
arrays, the block table, the channel planes and the token planes); geo: their
:class:`.records.Geometry`.
"""
import numpy as np
from numba import njit

from ..numerics.core import F32_ONE, F32_ZERO, antiquant
from ..numerics.kernel_args import (P_BLOCK, P_DEQUANT, P_KTOK, P_PREFIX, P_VTOK, S_ELEM, S_HEAD,
                                    S_ROW, T_K, T_KT, T_PK, T_PV, T_V, T_VT, kv_row)
from ._jit import LEAF, LEAF_INLINE
from ._vector import wide_vectors

#: rows of the channel planes (and of a tile's token scalars): key scale, key offset, value
#: scale, value offset
KEY, VALUE = 0, 2


@njit(**LEAF_INLINE)
def kv_tile_end(params, j0, tk, jend):
    """The end of the kv tile from column j0: tk columns, not past jend nor past the prefix."""
    j1 = min(j0 + tk, jend)
    if j0 < params[P_PREFIX]:
        j1 = min(j1, params[P_PREFIX])
    return j1


@njit(**LEAF)
def next_tile(ins, geo, b, g, j0, tk, jend, ro, rs):
    """The kv tile from column j0 (:func:`kv_tile_end`) and its rows' places
    (:func:`kv_tile_rows`): (its end j1, its columns, whether the rows are the prefix's, the
    key's and the value's element strides)."""
    j1 = kv_tile_end(geo.params, j0, tk, jend)
    prefix, sdk, sdv = kv_tile_rows(ins, geo, b, g, j0, j1 - j0, ro, rs)
    return j1, j1 - j0, prefix, sdk, sdv


@njit(**LEAF_INLINE)
def _token(scales, offsets, geo, table, t, mode, b, g, j):
    """(scale, offset) of own row j of kv head g in the token planes (geometry rows t, t + 1)
    of ``mode`` (1: by row, 2: by paged slot), or (1, 0) without them."""
    strides, boff, params = geo.strides, geo.boff, geo.params
    if mode == 0:
        return F32_ONE, F32_ZERO
    block = _plane_block(params, mode)
    s = kv_row(strides, boff, table, block, t, b, j) + g * strides[t, S_HEAD]
    o = kv_row(strides, boff, table, block, t + 1, b, j) + g * strides[t + 1, S_HEAD]
    return scales[s], offsets[o]


@njit(**LEAF_INLINE)
def _plane_block(params, mode):
    """The block size kv_row walks a token plane's rows by: the pool's for a plane by paged
    slot (mode 2), 0 (contiguous rows) for one by row."""
    return params[P_BLOCK] if mode == 2 else 0


@njit(**LEAF)
def kv_tile_rows(ins, geo, b, g, j0, nc, ro, rs):
    """The element offsets of kv rows j0 .. j0 + nc of kv head g of batch b: ro[0, c] in the
    key's array, ro[1, c] in the value's; with dequantization, the rows' token scales and
    offsets in rs[KEY:KEY + 2, c] and rs[VALUE:VALUE + 2, c] (ro[2]: scratch). Returns
    (whether the rows are the prefix's, the key's and the value's element strides)."""
    strides, params = geo.strides, geo.params
    table = ins.table
    P = params[P_PREFIX]
    prefix = _kv_rows(geo, table, T_PK, T_K, b, g, j0, nc, ro[0])
    _kv_rows(geo, table, T_PV, T_V, b, g, j0, nc, ro[1])
    if params[P_DEQUANT] != 0:
        if prefix:                   # a prefix takes the channel planes only
            for c in range(nc):
                rs[KEY, c], rs[KEY + 1, c] = F32_ONE, F32_ZERO
                rs[VALUE, c], rs[VALUE + 1, c] = F32_ONE, F32_ZERO
        else:
            _token_rows(ins.key_scales, ins.key_offsets, geo, table, np.int64(T_KT),
                        params[P_KTOK], b, g, j0 - P, nc, ro[2], rs, np.int64(KEY))
            _token_rows(ins.value_scales, ins.value_offsets, geo, table, np.int64(T_VT),
                        params[P_VTOK], b, g, j0 - P, nc, ro[2], rs, np.int64(VALUE))
    if prefix:
        return True, strides[T_PK, S_ELEM], strides[T_PV, S_ELEM]
    return False, strides[T_K, S_ELEM], strides[T_V, S_ELEM]


@njit(**LEAF)
def kv_key_rows(ins, geo, b, g, j0, nc, out):
    """out[c] = the element offset of K row j0 + c of kv head g of batch b, c < nc (a tile:
    all in the prefix or none); returns whether they are the prefix's rows."""
    return _kv_rows(geo, ins.table, T_PK, T_K, b, g, j0, nc, out)


@njit(**LEAF_INLINE)
def _kv_rows(geo, table, t_prefix, t_own, b, g, j0, nc, out):
    """out[c] = the element offset of kv row j0 + c of kv head g of batch b, c < nc: in the
    prefix's tensor t_prefix (j0 < P; a tile never straddles its end) or in the own tensor
    t_own (:func:`_own_rows`). Returns whether the rows are the prefix's."""
    strides, boff, params = geo.strides, geo.boff, geo.params
    P = params[P_PREFIX]
    if j0 < P:
        for c in range(nc):
            out[c] = (boff[t_prefix, b] + g * strides[t_prefix, S_HEAD]
                      + (j0 + c) * strides[t_prefix, S_ROW])
        return True
    # np.int64: the tensor's row as a number, not a literal (a call of each would compile anew)
    _own_rows(out, geo, table, params[P_BLOCK], np.int64(t_own), b, j0 - P, nc,
              g * strides[t_own, S_HEAD])
    return False


@njit(**LEAF)
def _own_rows(out, geo, table, block, t, b, j0, nc, head):
    """out[c] = the element offset of own row j0 + c of batch b in tensor t, plus ``head``
    (kv_row's rows): one run of consecutive rows a paged block (all of them without paging),
    each run one vectorised loop."""
    strides, boff = geo.strides, geo.boff
    step = strides[t, S_ROW]
    c = 0
    while c < nc:
        j = j0 + c
        n = nc - c if block == 0 else min(nc - c, block - j % block)
        first = kv_row(strides, boff, table, block, t, b, j) + head
        for i in range(n):
            out[np.uint64(c + i)] = first + i * step
        c += n


@njit(**LEAF)
def _token_rows(scales, offsets, geo, table, t, mode, b, g, j0, nc, offs, rs, row):
    """rs[row, c], rs[row + 1, c] = (scale, offset) of own row j0 + c of kv head g in the
    token planes (geometry rows t, t + 1) of ``mode`` (1: by row, 2: by paged slot), or (1, 0)
    without them; offs: scratch."""
    if mode == 0:
        for c in range(nc):
            rs[row, c], rs[row + 1, c] = F32_ONE, F32_ZERO
        return
    strides, params = geo.strides, geo.params
    block = _plane_block(params, mode)
    for i, plane in ((0, scales), (1, offsets)):
        _own_rows(offs, geo, table, block, t + i, b, j0, nc, g * strides[t + i, S_HEAD])
        for c in range(nc):
            rs[row + i, c] = plane[offs[c]]


@njit(**LEAF)
def load_dequant_row(dst, r, src, off, sd, D, cs, co, base, scale, offset):
    """dst[r, :D] = (int8 + offset) * scale of the int8 row at src[off + d * sd]: the channel
    plane's scales cs and offsets co from element ``base`` (kv head g: g * D), with the row's
    token (scale, offset). One pass; unsigned indices (a negative-index wrap stops the
    vectoriser)."""
    wide_vectors()
    b0 = np.uint64(base)
    if sd == 1:
        s0 = np.uint64(off)
        for d in range(D):
            i = np.uint64(d)
            dst[r, d] = antiquant(np.float32(src[s0 + i]), cs[b0 + i], co[b0 + i], scale, offset)
    else:
        for d in range(D):
            i = np.uint64(d)
            dst[r, d] = antiquant(np.float32(src[off + d * sd]), cs[b0 + i], co[b0 + i], scale,
                                  offset)


@njit(**LEAF)
def kv_value_row(ins, geo, b, g, j):
    """(whether in the prefix, element offset, element stride, token scale, token offset) of V
    row j of kv head g."""
    strides, boff, params = geo.strides, geo.boff, geo.params
    P = params[P_PREFIX]
    if j < P:
        return (True, boff[T_PV, b] + g * strides[T_PV, S_HEAD] + j * strides[T_PV, S_ROW],
                strides[T_PV, S_ELEM], F32_ONE, F32_ZERO)
    off = kv_row(strides, boff, ins.table, params[P_BLOCK], T_V, b, j - P)
    scale, offset = _token(ins.value_scales, ins.value_offsets, geo, ins.table, T_VT,
                           params[P_VTOK], b, g, j - P)
    return False, off + g * strides[T_V, S_HEAD], strides[T_V, S_ELEM], scale, offset
