"""Which lane of a warp holds which matrix element: the tensor-core fragment layouts, the
ldmatrix address and register maps, and the XOR swizzle of the shared-memory tiles.

Written once and used twice: inlined into the ``@cuda.jit`` tensor-core kernel (they are
``@njit(inline='always')`` scalar functions over integers, like :mod:`pfa_numba.numerics.core`), and
called from Python by the NumPy model of one warp, :mod:`.warp_model`, which CI checks against
:mod:`pfa_numba.reference` (and by :mod:`.warp_sim`, which runs
the kernel's warp instructions under the CUDA simulator). A lane is 0..31; in every map
g = lane >> 2 (the "groupID" of the PTX ISA) and t = lane & 3 ("threadID_in_group").

Sources: PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" (A, B, C/D
figures for .f16/.bf16) and "Warp-level matrix load instruction: ldmatrix". A register holding
two 16-bit values holds the lower column (A) / lower k (B) in its low half.

Importing this module needs Numba only (no numba-cuda, no GPU).
"""
import numpy as np

from ..numerics.core import jit

#: lanes of a warp
WARP = 32
#: the mma shape: D (M x N) = A (M x K) B (K x N) + C
MMA_M, MMA_N, MMA_K = 16, 8, 16
#: 32-bit registers per lane of each fragment (A, B: two 16-bit values each; C/D: one float32)
A_REGS, B_REGS, C_REGS = 4, 2, 4
#: 16-bit elements per 16-byte chunk: one ldmatrix row, one cp.async copy, one swizzle unit
CHUNK = 8
#: rows of one swizzle period (8 chunks of 16 bytes = 128 bytes = the 32 four-byte banks)
SWIZZLE_ROWS = 8


@jit
def mma_a(lane, reg):
    """A fragment (16 x 16, row-major) of m16n8k16: (row, column) of the low half of register
    ``reg`` (0..3) of ``lane``; the high half is at column + 1. PTX ISA: a0 = (g, 2t..2t+1),
    a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..)."""
    return (lane >> 2) + 8 * (reg & 1), 2 * (lane & 3) + 8 * (reg >> 1)


@jit
def mma_b(lane, reg):
    """B fragment (16 x 8, K x N, ".col") of m16n8k16: (k, n) of the low half of register
    ``reg`` (0..1) of ``lane``; the high half is at k + 1. PTX ISA: b0 = (k 2t..2t+1, n g),
    b1 = (k 2t + 8..2t + 9, n g). For S = Q K^T, n is a key and k a head-dim index: b0 is
    K[key g, d 2t..2t+1], two adjacent values of one K row."""
    return 2 * (lane & 3) + 8 * reg, lane >> 2


@jit
def mma_c(lane, i):
    """C / D fragment (16 x 8 float32) of m16n8k16: (row, column) of accumulator ``i`` (0..3)
    of ``lane``. PTX ISA: c0, c1 = (g, 2t), (g, 2t + 1); c2, c3 = (g + 8, 2t), (g + 8, 2t + 1).
    A lane holds two rows (g and g + 8), the 4 lanes of a quad (same g) hold a whole row."""
    return (lane >> 2) + 8 * (i >> 1), 2 * (lane & 3) + (i & 1)


@jit
def ldsm_source(lane):
    """ldmatrix .x4: (matrix, row) of the 8x8 matrix row whose address ``lane`` supplies:
    lanes 8m..8m+7 give rows 0..7 of matrix m (each row: 8 contiguous 16-bit values)."""
    return lane >> 3, lane & 7


@jit
def ldsm_element(lane, half, trans):
    """ldmatrix: (row, column) inside each 8x8 matrix of the ``half``-th (0 low, 1 high)
    16-bit value that ``lane`` receives in that matrix's register. Plain: (g, 2t + half), the
    layout of an A or C fragment row; ``.trans``: (2t + half, g), the matrix transposed, which
    is the B fragment of a row-major K x N tile (V in O += P V)."""
    r, c = lane >> 2, 2 * (lane & 3) + half
    if trans:
        return c, r
    return r, c


@jit
def ldsm_a_addr(lane):
    """ldmatrix .x4 of a 16 x 16 block whose matrices are, in register order, rows 0-7 /
    8-15 of columns 0-7, then rows 0-7 / 8-15 of columns 8-15: (row, first column) of the
    row segment ``lane`` points at. Plain, on a row-major Q block, the registers are the A
    fragment a0..a3; ``.trans`` on a row-major V block (rows = keys k, columns = head dims n)
    they are b0, b1 of n-tile 0 and b0, b1 of n-tile 1 (head dims 8-15)."""
    return (lane & 7) + 8 * ((lane >> 3) & 1), 8 * (lane >> 4)


@jit
def lane_addresses(lane, row_elems):
    """This lane's ldmatrix offsets in the first 16 x 16 block of a swizzled tile of
    ``row_elems`` values a row: (as an A operand, :func:`ldsm_a_addr`; as a B operand,
    :func:`ldsm_b_addr`); the other blocks are :func:`swizzle_step` of them by constants."""
    ar, ac = ldsm_a_addr(lane)
    br, bc = ldsm_b_addr(lane)
    return swizzle(ar, ac, row_elems), swizzle(br, bc, row_elems)


@jit
def ldsm_b_addr(lane):
    """ldmatrix .x4 of a 16 x 16 block whose matrices are, in register order, columns 0-7 /
    8-15 of rows 0-7, then columns 0-7 / 8-15 of rows 8-15: (row, first column) of the row
    segment ``lane`` points at. Plain, on a row-major K block (rows = keys n, columns = head
    dims k), the registers are b0, b1 of n-tile 0 (keys 0-7) and b0, b1 of n-tile 1."""
    return (lane & 7) + 8 * (lane >> 4), 8 * ((lane >> 3) & 1)


@jit
def p_from_s(reg):
    """The A fragment of P for k-step kk (keys 16kk..16kk+15) from the S accumulators, with
    no data movement between lanes: register ``reg`` of P packs accumulators (i, i + 1) of S
    n-tile 2kk + tile, returned as (tile, i). a0 = S[2kk](c0, c1), a1 = S[2kk](c2, c3),
    a2 = S[2kk+1](c0, c1), a3 = S[2kk+1](c2, c3): both layouts put (g, 2t..2t+1) and
    (g + 8, 2t..2t+1) in the same lane."""
    return reg >> 1, 2 * (reg & 1)


@jit
def swizzle(row, col, row_elems):
    """Element offset of (row, col) in a shared-memory tile of 16-bit values with
    ``row_elems`` per row (a multiple of 64: 128-byte rows or wider), 16-byte chunks XOR
    swizzled: chunk (col >> 3) is stored at chunk (col >> 3) ^ (row & 7), the 8 values of a
    chunk stay together and in order. The 8 rows of one ldmatrix 8x8 matrix (one logical chunk
    of 8 consecutive rows) then land in 8 different 16-byte bank groups: conflict-free, where
    unswizzled 128-byte-multiple rows all hit the same 4 banks (8-way conflict). cp.async
    writes whole chunks, so it writes through the same map."""
    return row * row_elems + ((((col >> 3) ^ (row & 7)) << 3) | (col & 7))


@jit
def swizzle_step(base, row_step, col_step, row_elems):
    """swizzle(row + row_step, col + col_step, row_elems) from ``base`` = swizzle(row, col,
    row_elems), for ``row_step`` a multiple of 8 (the XOR pattern repeats every 8 rows),
    ``col_step`` a multiple of 16, col < 16, col + col_step < row_elems and ``row_elems`` a
    power of two: the column moves by XOR (col + col_step = col | col_step, and the swizzle is
    an XOR of the column), the row by an add. A kernel walking a tile computes one base per
    lane and reaches every other address by a constant, with no swizzle arithmetic."""
    return (base ^ col_step) + row_step * row_elems


@jit
def tile_chunk(idx, row_elems):
    """(row, first column) of the ``idx``-th 16-byte chunk of a tile with ``row_elems``
    16-bit values per row, in the order threads copy them: consecutive threads take
    consecutive chunks of a row (coalesced global reads)."""
    per_row = row_elems >> 3
    return idx // per_row, (idx % per_row) * CHUNK


@jit
def bank_group(offset):
    """The 16-byte bank group (0..7: banks 4q..4q+3 of the 32 four-byte banks) of the 16-bit
    element at ``offset`` of a 128-byte-aligned shared array."""
    return (offset >> 3) & 7


def lane_table(fn, nregs, *args):
    """NumPy tables of a map over every (lane, register): ``fn(lane, reg, *args)`` -> the two
    (WARP, nregs) int64 arrays of its results. For the model and the tests."""
    rows = np.empty((WARP, nregs), np.int64)
    cols = np.empty((WARP, nregs), np.int64)
    for lane in range(WARP):
        for reg in range(nregs):
            rows[lane, reg], cols[lane, reg] = fn(lane, reg, *args)
    return rows, cols
