"""Packing Q, K and V tiles for AMX: bf16 bits as they are, float16 split exactly into bf16 hi
+ lo parts, in the VNNI pair layout the tile products read."""
import numpy as np
from numba import njit
from ..numerics.core import CODE_F16, f32_as_u32, u32_as_f32
from ._vector import wide_vectors
from .rows import widen_f16, as_u32
from ._jit import LEAF


# ---------------------------------------------------------------------------------------------
# bf16 and float16 on AMX: the operands of the tile products
# ---------------------------------------------------------------------------------------------

@njit(inline="always")
def _subnormal_key(u):
    """< 0x7F exactly when the bf16 bits u are a nonzero subnormal (AMX reads those as 0)."""
    return (np.uint32(u) & np.uint32(0x7FFF)) - np.uint32(1)


@njit(**LEAF)
def _pair(a, b):
    """Two 16-bit values as one uint32: a in the low half."""
    return as_u32(as_u32(a) | as_u32(as_u32(b) << as_u32(16)))


@njit(**LEAF)
def _f16_exp(u):
    """The exponent field of float16 bits u (all ones: inf or NaN)."""
    return as_u32(as_u32(u) & F16_EXP)


@njit(**LEAF)
def _split_f16(u):
    """float16 bits -> (hi, lo) bf16 bits with hi + lo equal to the value: hi is it rounded to 8
    significant bits (to nearest even), lo the remaining 3 (exact; never a bf16 subnormal).
    f32_to_bf16's rounding without its NaN branch (the caller rejects non-finite values, whose
    lo would be NaN), in 32-bit integer steps: in a split loop, about 2x faster per value than
    calling f32_to_bf16 or VCVTNEPS2BF16 (whose loop does not fill 512-bit vectors)."""
    x = widen_f16(u)
    b = f32_as_u32(x)
    hi = as_u32(as_u32(as_u32(b + as_u32(0x7FFF)) + as_u32(as_u32(b >> as_u32(16)) & as_u32(1))) >> as_u32(16))
    lo = as_u32(f32_as_u32(x - u32_as_f32(as_u32(hi << as_u32(16)))) >> as_u32(16))
    return np.uint16(hi), np.uint16(lo)


@njit(**LEAF)
def amx_pack_rows(dst, lo, ld, src, base, row_stride, sd, n_rows, D, Dp, code):
    """dst[r * ld + d] = src[base + r * row_stride + d * sd], columns D..Dp zero: bf16 bits as
    they are; float16 as bf16 hi parts, with the lo parts at dst[lo + r * ld + d]. Returns
    True when AMX computes these rows exactly (no bf16 subnormal, no non-finite float16)."""
    wide_vectors()
    key, ex = NOTHING_SCANNED
    for r in range(n_rows):
        drow = dst[r * ld:r * ld + Dp]
        lrow = dst[lo + r * ld:lo + r * ld + Dp]
        off = base + r * row_stride
        if sd == 1:        # a contiguous row: its own specialisation, which vectorises
            row_key, row_ex = _pack_row(drow, lrow, src[off:off + D], D, code)
        else:
            row_key, row_ex = _pack_row(drow, lrow, src[off:off + D * sd:sd], D, code)
        key, ex = min(key, row_key), max(ex, row_ex)
    return key >= SUBNORMAL_LIMIT and ex != F16_EXP


@njit(**LEAF)
def _pack_row(drow, lrow, row, D, code):
    """drow[:D] = row[:D] as bf16 bits, or for float16 their bf16 hi parts, with the lo parts
    in lrow; columns D.. of each part zero. Returns (smallest subnormal key, largest float16
    exponent field) as :func:`bf16_scan` does."""
    key, ex = NOTHING_SCANNED
    if code == CODE_F16:
        for d in range(D):
            u = row[d]
            ex = max(ex, _f16_exp(u))
            drow[d], lrow[d] = _split_f16(u)
        lrow[D:] = 0
    else:
        for d in range(D):
            u = row[d]
            drow[d] = u
            key = min(key, _subnormal_key(u))
    drow[D:] = 0
    return key, ex


@njit(**LEAF)
def bf16_scan(buf, n):
    """(smallest subnormal key, largest exponent field) of the bf16 bits buf[:n]: a nonzero
    subnormal makes the key < 0x7F, an inf or NaN makes the exponent 0x7F80."""
    wide_vectors()
    key, ex = NOTHING_SCANNED
    for i in range(n):
        u = np.uint32(buf[i])
        key = min(key, (u & np.uint32(0x7FFF)) - np.uint32(1))
        ex = max(ex, u & np.uint32(0x7F80))
    return key, ex


@njit(**LEAF)
def _split_pair(u0, u1):
    """Two float16 bits -> (hi pair word, lo pair word, exponent bits of either)."""
    h0, l0 = _split_f16(u0)
    h1, l1 = _split_f16(u1)
    return _pair(h0, h1), _pair(l0, l1), max(_f16_exp(u0), _f16_exp(u1))


@njit(**LEAF)
def _single_word(u, code):
    """A value whose pair partner is zero (an odd D's last K pair, an odd tile's last V row):
    (hi word, lo word, exponent bits) as in :func:`_split_pair` for float16; bf16 as it is."""
    if code == CODE_F16:
        h, l = _split_f16(u)
        return np.uint32(h), np.uint32(l), _f16_exp(u)
    return np.uint32(u), np.uint32(0), np.uint32(0)


@njit(**LEAF)
def _pair_words(src, a, b, step, n, t, tl, code):
    """t[p] = src[a + p * step] | src[b + p * step] << 16 (two bf16 as one uint32), p < n;
    float16: the pairs of hi parts, and of lo parts in tl. Returns the largest float16
    exponent field seen (0 for bf16). One loop per case, so that each vectorises."""
    ex = np.uint32(0)
    if step == 1:                              # the same column of two contiguous rows
        r0 = src[a:a + n]
        r1 = src[b:b + n]
        if code == CODE_F16:
            for p in range(n):
                t[p], tl[p], e = _split_pair(r0[p], r1[p])
                ex = max(ex, e)
        else:
            for p in range(n):
                t[p] = _pair(r0[p], r1[p])
    elif step == 2 and b == a + 1:             # neighbours in one contiguous row
        seg = src[a:a + 2 * n]
        if code == CODE_F16:
            for p in range(n):
                t[p], tl[p], e = _split_pair(seg[2 * p], seg[2 * p + 1])
                ex = max(ex, e)
        else:
            for p in range(n):
                t[p] = _pair(seg[2 * p], seg[2 * p + 1])
    elif code == CODE_F16:
        for p in range(n):
            t[p], tl[p], e = _split_pair(src[a + p * step], src[b + p * step])
            ex = max(ex, e)
    else:
        for p in range(n):
            t[p] = _pair(src[a + p * step], src[b + p * step])
    return ex


@njit(**LEAF)
def amx_pack_k(kt, lo, src, offs, sd, nc, ncp, D, Dp, tmp, code):
    """K tile (nc rows of src at element offsets offs[c], element stride sd; see
    :mod:`.kv`) as the VNNI B operand of S = Q K^T: as uint32 pairs,
    kt[p, c] = (K[c, 2p], K[c, 2p + 1]) with ld ncp, zero-padded to ncp columns and Dp / 2
    pairs (float16: bf16 hi parts, lo parts at kt[lo:]). Transposed through ``tmp`` (2 x 16 x
    Dp / 2 uint32) in blocks of 16 rows. Returns the largest float16 exponent field seen."""
    wide_vectors()
    half = (D + 1) // 2            # an odd D's last pair holds a zero
    ex = np.uint32(0)
    for c0 in range(0, nc, 16):
        cn = min(16, nc - c0)
        for cc in range(cn):
            off = offs[c0 + cc]
            t = tmp[cc * half:]
            tl = tmp[(16 + cc) * half:]
            ex = max(ex, _pair_words(src, off, off + sd, 2 * sd, D // 2, t, tl, code))
            if D % 2:
                t[half - 1], tl[half - 1], e = _single_word(src[off + (D - 1) * sd], code)
                ex = max(ex, e)
        for part in range(2 if code == CODE_F16 else 1):
            kt32 = kt[part * lo:part * lo + ncp * Dp].view(np.uint32)
            t = tmp[part * 16 * half:]
            for p in range(half):
                dst = kt32[p * ncp + c0:p * ncp + c0 + cn]
                for cc in range(cn):
                    dst[cc] = t[cc * half + p]
    for part in range(2 if code == CODE_F16 else 1):
        kt32 = kt[part * lo:part * lo + ncp * Dp].view(np.uint32)
        for p in range(half):
            kt32[p * ncp + nc:(p + 1) * ncp] = 0
        kt32[half * ncp:(Dp // 2) * ncp] = 0
    return ex


@njit(**LEAF)
def amx_pack_v(vv, lo, src, offs, sd, nc, ncp, D, Dp, code):
    """V tile (rows as :func:`amx_pack_k`'s) as the VNNI B operand of P V: as uint32 pairs,
    vv[c // 2, d] = (V[c, d], V[c + 1, d]) with ld Dp; rows nc..ncp and columns D..Dp zero
    (float16: bf16 hi parts, lo parts at vv[lo:]). Returns the largest float16 exponent field
    seen."""
    wide_vectors()
    ex = np.uint32(0)
    parts = 2 if code == CODE_F16 else 1
    for c in range(0, nc, 2):
        a = offs[c]
        dst = vv[(c // 2) * 2 * Dp:(c // 2) * 2 * Dp + 2 * Dp].view(np.uint32)
        dlo = vv[lo + (c // 2) * 2 * Dp:lo + (c // 2) * 2 * Dp + 2 * Dp].view(np.uint32) \
            if parts == 2 else dst
        if c + 1 == nc:      # the last odd row pairs with zeros
            for d in range(D):
                h, w, e = _single_word(src[a + d * sd], code)
                dst[d] = h
                if parts == 2:
                    dlo[d] = w
                ex = max(ex, e)
        else:
            ex = max(ex, _pair_words(src, a, offs[c + 1], sd, D, dst, dlo, code))
        for part in range(parts):
            vv[part * lo + (c // 2) * 2 * Dp + 2 * D:part * lo + (c // 2 + 1) * 2 * Dp] = 0
    for part in range(parts):
        vv[part * lo + ((nc + 1) // 2) * 2 * Dp:part * lo + (ncp // 2) * 2 * Dp] = 0
    return ex


#: AMX reads bf16 subnormals as zero and flushes products below float32's normal range (2^-126)
#: to zero. Work items whose Q or K hold a subnormal, or whose V holds a nonzero value below
#: 2^-100 (so that p * v with p >= 2^-26 could be flushed), take the float32 path. Scores are
#: scaled after the product, so a scale beyond 2^64 (lost products could matter) does too.
#: (key, exponent) of a scan that has seen no element: every later one lowers the key and
#: raises the exponent
NOTHING_SCANNED = (np.uint32(0xFFFFFFFF), np.uint32(0))
SUBNORMAL_LIMIT = np.uint32(0x7F)               # key (bits & 0x7FFF) - 1 below: subnormal
F16_EXP = np.uint32(0x7C00)                     # float16 exponent field; all ones: inf / NaN
TINY_V_LIMIT = np.uint32((127 - 100) << 7) - np.uint32(1)
AMX_MAX_SCALE = 2.0 ** 64
