"""The int8 variants' dequantization (the tensor-core and decode kernels): an int8 cache's
rows, staged in shared memory as int8, dequantized by the rule every kernel uses
(``numerics.core.antiquant`` with the channel and token pairs of every antiquant mode) and rounded to
the query's type into the 16-bit tile the kernels' ``ldmatrix`` reads."""
import numpy as np
from numba import float32, uint32

from ..numerics.core import F32_ONE, F32_ZERO, antiquant
from . import ptx as X
from .kernels import array_function, device_function, kv_row


@array_function
def _s8(w):
    """The signed byte in the low 8 bits of ``w``, as int32."""
    return (np.int32(w & 0xFF) ^ np.int32(0x80)) - np.int32(0x80)


@array_function
def row_tokens(r, j, jend, dq):
    """The token pair (scale, offset) of kv row j of K (r = 0) or V (r = 1) (``kernels.kv_row``;
    (1, 0) for a row at or past jend, which is zero-filled). ``dq``: (channel, kts, kto, vts,
    vto, strides, boff, params, table, b, kv head)."""
    if j >= jend:
        return F32_ONE, F32_ZERO
    src = kv_row(dq[5], dq[6], dq[8], dq[7], r, dq[1], dq[2], dq[3], dq[4], dq[9], dq[10], j)
    return src[3], src[4]


def make_dequant(kind, d):
    """The int8 variants' step from a staged row chunk to a tile: ``dequant_chunk(raw, raw_at,
    tile, at0, at1, r, col, live, scale, offset, dq)`` reads 16 int8 values of a row of K
    (r = 0) or V (r = 1), head dims col .. col + 15, at 16-bit words raw_at .. raw_at + 7 of
    the shared ``raw``; dequantizes them as every kernel does (``numerics.core.antiquant`` with the
    channel plane's pairs and the row's token pair, :func:`row_tokens`), rounds them to
    ``kind`` (contract: the values may be rounded to the query's dtype before the products)
    and stores them as the two 8-value chunks at offsets at0 and at1 of ``tile`` (a swizzled
    row keeps each 16-byte chunk whole); zeros where the row is not ``live``."""
    pack = X.pack_f16x2 if kind == "f16" else X.pack_bf16x2
    D = d

    def dequant_chunk(raw, raw_at, tile, at0, at1, r, col, live, scale, offset, dq):
        channel, ch = dq[0], dq[10] * D + col
        for h in range(8):
            bits = uint32(0)
            if live:
                w = np.int32(raw[raw_at + h])
                c = ch + 2 * h
                bits = pack(antiquant(float32(_s8(w)), channel[2 * r, c], channel[2 * r + 1, c],
                                      scale, offset),
                            antiquant(float32(_s8(w >> 8)), channel[2 * r, c + 1],
                                      channel[2 * r + 1, c + 1], scale, offset))
            X.st_shared_u32(tile, (at0 if h < 4 else at1) + 2 * (h & 3), bits)
    return device_function(dequant_chunk)
