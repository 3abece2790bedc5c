"""The kernels' arguments, built once for both targets.

:func:`kernel_args` turns a planned problem and its output arrays into a :class:`KernelArgs`:
every tensor as a flat read-only array over its memory (no copy), element offsets per batch and
element strides in the (9, 4) ``strides`` and (9, B) ``boff`` arrays (rows ``T_*``), the
per-batch lengths and band edges in ``lens`` (rows ``L_*``), the integer ``params`` (slots
``P_*``; the CPU's tiling slots are 0 on CUDA), the float32 ``fparams`` (slots ``F_*``) and the
float16-rounded output quantization scales. The CPU and CUDA kernels index them by these names.
"""
import functools
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .core import CODE_BF16, CODE_F16, CODE_F32, CODE_I8, jit
from .dtypes import F16, is_bf16

# rows of the geometry arrays (strides: (13, 4) int64 in elements; boff: (13, B) int64): query,
# key, value, output, lse, mask, pse, a shared prefix's key and value, and the token planes of
# int8 key / value dequantization (frontend.antiquant): the key's scales and offsets, the value's (a
# token plane's offsets are the row after its scales)
T_Q, T_K, T_V, T_O, T_L, T_M, T_P, T_PK, T_PV, T_KT, T_KTO, T_VT, T_VTO = range(13)
# columns of strides: head, row, element, and the block of a paged pool
S_HEAD, S_ROW, S_ELEM, S_BLOCK = range(4)
# rows of lens ((5, B) int64): qL, kL, preE, nextE, output rows to write (Sq, or qL for TND)
L_QLEN, L_KLEN, L_PRE, L_NEXT, L_ROWS = range(5)
# the params vector (int64)
# (P_ROWS / P_COLS: the CPU's query rows per work item and head and kv columns per tile;
# P_BLOCK: the paged pool's block size, 0 for contiguous key/value; P_PREFIX: the shared
# prefix's length P, whose rows come before every batch's own; P_KVCODE: the storage code of
# key/value; P_DEQUANT: 1 when int8 key/value are dequantized as they load; P_KTOK / P_VTOK:
# their token planes, 0 none, 1 by row, 2 by paged slot; P_D: query and key's head dim,
# P_DV: value's and the output's)
(P_N, P_G, P_D, P_CODE, P_MASK, P_PSE, P_IP, P_LSE, P_ROWS, P_COLS, P_OCODE, P_FLAGS,
 P_SCALE_EXP, P_BLOCK, P_PREFIX, P_KVCODE, P_DEQUANT, P_KTOK, P_VTOK, P_DV) = range(20)
# the fparams vector (float32): scale_value as factors (see scale_factors), the int8 scales,
# the softcap (0: none), then where the call has sink logits one a query head (F_SINKS + n:
# head n's; the vector ends at F_SINKS without them)
F_SCALE, F_SCALE2, F_DEQ1, F_SCALE16, F_QS1, F_DEQ2, F_SOFTCAP, F_SINKS = range(8)


@functools.cache
def readonly_dummy(dtype):
    """One read-only zero of ``dtype``, shared: the argument of a tensor a problem lacks."""
    a = np.zeros(1, dtype=dtype)
    a.flags.writeable = False
    return a


def flat_view(x, storage):
    """A read-only 1-D array over the memory of strided ``x`` (no copy), with the element offset
    of ``x[0, ..., 0]`` in it and ``x``'s strides in elements.

    ``storage`` reinterprets the elements (uint16 for fp16/bf16, uint8 for bool masks)."""
    x = x.view(storage)
    if x.size == 0:
        return readonly_dummy(storage), 0, (0,) * x.ndim
    it = x.itemsize
    if not x.flags.aligned or (not x.flags.c_contiguous and any(s % it for s in x.strides)):
        x = np.ascontiguousarray(x)  # exotic byte strides only; ordinary views never copy
    elements = tuple(s // it for s in x.strides)
    if x.flags.c_contiguous:         # the common case, without as_strided's cost
        flat = x.reshape(-1)
        flat.flags.writeable = False
        return flat, 0, elements
    lo = sum((n - 1) * s for n, s in zip(x.shape, x.strides) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(x.shape, x.strides) if s > 0)
    corner = x[tuple(slice(n - 1, n) if s < 0 else slice(0, 1) for n, s in zip(x.shape, x.strides))]
    flat = as_strided(corner, shape=((hi - lo) // it + 1,), strides=(it,), writeable=False)
    return flat, -lo // it, elements


def storage(dtype):
    """How the kernels see elements of ``dtype``: uint16 bits for float16/bfloat16."""
    dtype = np.dtype(dtype)
    if dtype.itemsize == 2 and dtype.kind != "u":
        return np.uint16
    return dtype.type


def storage_code(dtype):
    """The CODE_* of query/key/value elements of ``dtype`` (int8 is read as float32 values)."""
    if np.dtype(dtype) == F16:
        return CODE_F16
    if is_bf16(dtype):
        return CODE_BF16
    return CODE_F32


def output_code(dtype):
    """The CODE_* a kernel writes an output array of ``dtype`` with."""
    return CODE_I8 if np.dtype(dtype) == np.int8 else storage_code(dtype)


@jit
def row_offset(base, row_stride, block_stride, block, block_id, j):
    """Element offset of own kv row j from a batch's first element ``base``: row j of
    contiguous rows (block 0), or slot j % block of pool block ``block_id`` (the block table's
    entry j // block) of a paged pool. Scalars only, for both targets."""
    if block == 0:
        return base + j * row_stride
    return base + block_id * block_stride + (j % block) * row_stride


@jit
def kv_row(strides, boff, table, block, t, b, j):
    """Element offset of own kv row j (logical, after any prefix) of batch b in tensor t (T_K,
    T_V or a token plane), head 0 (:func:`row_offset`; block 0: contiguous rows)."""
    block_id = table[b, j // block] if block != 0 else 0
    return row_offset(boff[t, b], strides[t, S_ROW], strides[t, S_BLOCK], block, block_id, j)


def geometry(p, out, lse):
    """Flat arrays, (13, 4) strides and (13, B) batch offsets for the kernels."""
    st = storage(p.dtype)
    kst = storage(p.k.dtype)                     # int8 key/value of a float query
    strides = np.zeros((13, 4), np.int64)
    boff = np.zeros((13, max(p.B, 1)), np.int64)
    bidx = np.arange(p.B, dtype=np.int64)

    def put(row, x, as_type, start=None):
        flat, origin, s = flat_view(x, as_type)
        if start is None:   # padded: x is (B|1, ...)
            boff[row, :p.B] = origin + bidx * (s[0] if x.shape[0] > 1 else 0)
            strides[row, :x.ndim - 1] = s[1:]
        else:               # packed TND: x is (T, N, D); batch b starts at row start[b]
            boff[row, :p.B] = origin + start * s[0]
            strides[row, :3] = [s[1], s[0], s[2]]
        return flat

    def put_pool(row, pool, as_type):
        """A paged pool (num_blocks, Nkv, block_size, D): every batch starts at block 0."""
        flat, origin, s = flat_view(pool, as_type)
        boff[row, :p.B] = origin
        strides[row] = [s[1], s[2], s[3], s[0]]
        return flat

    cache = p.cache
    qf = put(T_Q, p.q, st, p.q_start)
    if cache is not None and cache.block_table is not None:
        kf, vf = put_pool(T_K, p.k, kst), put_pool(T_V, p.v, kst)
    else:
        kf = put(T_K, p.k, kst, p.kv_start)
        vf = put(T_V, p.v, kst, p.kv_start)

    ov = p.out_view(out)
    o_flat = out.reshape(-1).view(storage(out.dtype))
    o_s = [s // out.itemsize for s in ov.strides]
    if p.packed:
        boff[T_O, :p.B] = p.q_start * o_s[0]
        strides[T_O, :3] = [o_s[1], o_s[0], o_s[2]]
    else:
        boff[T_O, :p.B] = bidx * o_s[0]
        strides[T_O, :3] = o_s[1:]
    lv = p.lse_view(lse)
    l_s = [s // 4 for s in lv.strides]
    if p.packed:
        boff[T_L, :p.B] = p.q_start * l_s[0]
        strides[T_L, :2] = [l_s[1], l_s[0]]
    else:
        boff[T_L, :p.B] = bidx * l_s[0]
        strides[T_L, :2] = l_s[1:]

    mask8, mask16 = readonly_dummy(np.uint8), readonly_dummy(np.uint16)
    if p.mask is not None:
        if p.mask.dtype == np.float16:
            mask16 = put(T_M, p.mask[:, None], np.uint16)
        else:
            mask8 = put(T_M, p.mask[:, None], np.uint8)
    pse = readonly_dummy(np.uint16 if p.dtype == np.int8 else st)
    if p.pse is not None:
        pse = put(T_P, p.pse, storage(p.pse.dtype))
    kp = vp = readonly_dummy(kst)
    # key scales, key offsets, value scales, value offsets; a plane not given is one zero
    # read at every row (strides 0)
    tokens = [readonly_dummy(np.float32)] * 4
    if cache is not None:
        if cache.P:
            kp, vp = put(T_PK, cache.prefix_key, kst), put(T_PV, cache.prefix_value, kst)
        for i, planes in enumerate(cache.antiquant or ()):
            rows = ((T_KT, T_KTO), (T_VT, T_VTO))[i]
            for j, (row, x) in enumerate(zip(rows, (planes.token_scale, planes.token_offset))):
                if x is not None:
                    tokens[2 * i + j] = _put_token_plane(strides, boff, row, x, planes.paged,
                                                         p.B)
        _shift_windows(strides, boff, p.B, p.q_off, cache.kv_off)
    return qf, kf, vf, o_flat, mask8, mask16, pse, strides, boff, kp, vp, tokens


def _put_token_plane(strides, boff, row, plane, paged, B):
    """An (R0, Nkv, R1) token plane: rows (b, p), or paged slots (block, slot). A head axis
    of stride 0 (one value for every kv head) is taken as one head, so that a plane
    flat_view must copy (a misaligned one) is copied once, not once a head."""
    shared = plane.strides[1] == 0
    flat, origin, s = flat_view(plane[:, :1] if shared else plane, np.float32)
    if paged:
        boff[row, :B] = origin
    else:
        boff[row, :B] = origin + np.arange(B, dtype=np.int64) * s[0]
    strides[row] = [0 if shared else s[1], s[2], 0, s[0]]
    return flat


def _shift_windows(strides, boff, B, q_off, kv_off):
    """Left padding: batch b's query, output and lse rows start at q_off[b], its contiguous kv
    rows at kv_off[b]; its mask and pse are read at the same physical rows and columns."""
    if not (q_off.any() or kv_off.any()):
        return
    for t in (T_Q, T_O, T_L):
        boff[t, :B] += q_off * strides[t, S_ROW]
    for t in (T_K, T_V, T_KT, T_KTO, T_VT, T_VTO):
        boff[t, :B] += kv_off * strides[t, S_ROW]
    for t in (T_M, T_P):
        boff[t, :B] += q_off * strides[t, S_ROW] + kv_off * strides[t, S_ELEM]


def scale_factors(scale):
    """scale_value as (s1, s2, e): the kernels scale Q by float32 s1 and s2 and the differences
    of the scores from their running max by 2^e, so that s = scale * dot = s1 * s2 * 2^e * dot.

    Ordinary scales give (float32(scale), 1, 0). A finite scale below float32's range is split
    into two factors of Q (s2 a power of two), so that q * s1 * s2 does not underflow where
    q * scale is representable; one beyond 2^100 keeps its power of two e for the differences
    (scores beyond float32's range still have a finite softmax and lse = m * 2^e + log(l)),
    and what is added to the scores (pse, the float16 mask) is scaled by 2^-e to match:
    exactly while |scale| < 2^190, with less precision up to 2^213, not at all beyond (where it
    could only tell apart scores that are equal in float32)."""
    if scale == 0.0 or 2.0 ** -100 <= abs(scale) <= 2.0 ** 100:
        return np.float32(scale), np.float32(1.0), 0
    log2 = float(np.log2(abs(scale)))
    if log2 < 0:
        e = int(np.round(log2 / 2))
        return np.float32(scale / 2.0 ** e), np.float32(2.0 ** e), 0
    e = int(np.ceil(log2)) - 64               # s1 in (2^63, 2^64]
    return np.float32(scale / 2.0 ** e), np.float32(1.0), e


def output_scales(quant):
    """quant_scale2 and quant_offset2 rounded to float16 (contract 'Quantization'), as float32: 1 or
    H values each (one 0 each without an int8 output)."""
    if quant is None or quant.out_dtype != np.int8:
        return np.zeros(1, np.float32), np.zeros(1, np.float32)
    with np.errstate(over="ignore"):                   # a scale beyond float16 is inf, as specified
        return (quant.scale2.astype(np.float16).astype(np.float32),
                quant.offset2.astype(np.float16).astype(np.float32))


@dataclass
class KernelArgs:
    """What a kernel reads and writes besides its own buffers (host arrays; the CUDA backend
    copies or maps them to the device)."""
    q: np.ndarray            # flat storage of query / key / value
    k: np.ndarray
    v: np.ndarray
    out: np.ndarray          # flat storage of the output array given
    lse: np.ndarray          # flat float32
    mask8: np.ndarray        # flat user mask (bool / int8 / uint8), or a dummy
    mask16: np.ndarray       # flat float16 additive mask bits, or a dummy
    pse: np.ndarray          # flat pse_shift storage, or a dummy
    kp: np.ndarray           # flat storage of a shared prefix's key / value, or dummies
    vp: np.ndarray
    table: np.ndarray        # int64 (B, max_blocks) block table of paged key/value, or a dummy
    channel: np.ndarray      # float32 (4, Nkv * D): key scale, key offset, value scale, offset
    tokens: tuple            # flat float32 token planes (see frontend.antiquant): key scales, key
                             # offsets, value scales, value offsets (a zero where not given)
    strides: np.ndarray
    boff: np.ndarray
    lens: np.ndarray
    params: np.ndarray
    fparams: np.ndarray
    scale2: np.ndarray       # float16-rounded quant_scale2 (1 or H values; 0 when unused)
    offset2: np.ndarray


def _channel_planes(aq):
    """The (4, Nkv * max(D, Dv)) float32 channel planes of an int8 cache's key and value:
    key scales, key offsets, value scales, value offsets (a row past its own channels: 0)."""
    width = max(planes.channel.shape[1] for planes in aq)
    channel = np.zeros((4, width), np.float32)
    for i, planes in enumerate(aq):
        channel[2 * i:2 * i + 2, :planes.channel.shape[1]] = planes.channel
    return channel


def kernel_args(p, out, lse, flags=False, rows=0, cols=0):
    """The :class:`KernelArgs` of planned problem ``p`` writing ``out`` (in the output layout;
    its dtype gives the output code) and ``lse``. ``flags`` (mark the rows computed, for a
    second pass) is the backend's choice; ``rows`` and ``cols`` the CPU's tiles: query rows
    per work item and head, kv columns per tile."""
    q, k, v, o_flat, mask8, mask16, pse, strides, boff, kp, vp, tokens = geometry(p, out, lse)
    cache = p.cache
    paged = cache is not None and cache.block_table is not None
    table = cache.block_table if paged else np.zeros((1, 1), np.int64)
    aq = cache.antiquant if cache is not None else None
    channel = np.zeros((4, 1), np.float32) if aq is None else _channel_planes(aq)
    tok = [0, 0] if aq is None else [0 if x.token_scale is None else (2 if x.paged else 1)
                                     for x in aq]
    rows_b = np.full(p.B, p.Sq, np.int64) if not p.packed else p.qlen
    if cache is not None:
        rows_b = rows_b - p.q_off                    # the frame's rows from the window on
    lens = np.array([p.qlen, p.klen, p.pre_e, p.next_e, rows_b], np.int64)
    s1, s2, post = scale_factors(p.scale)
    params = np.array([p.N, p.G, p.D, p.code, p.mask_kind, p.pse is not None, p.inner_precise,
                       p.want_lse, rows, cols, output_code(out.dtype), flags, post,
                       cache.block_size if paged else 0, cache.P if cache is not None else 0,
                       storage_code(p.k.dtype), aq is not None, tok[0], tok[1], p.Dv],
                      np.int64)
    fparams = np.zeros(F_SINKS + (0 if p.sinks is None else p.N), np.float32)
    fparams[F_SCALE], fparams[F_SCALE2], fparams[F_SOFTCAP] = s1, s2, p.softcap
    if p.sinks is not None:
        fparams[F_SINKS:] = p.sinks
    if p.quant is not None and p.dtype == np.int8:
        with np.errstate(over="ignore"):               # fp16(scale_value) may be inf, as specified
            scale16 = np.float16(p.scale)
        fparams[[F_DEQ1, F_SCALE16, F_QS1, F_DEQ2]] = (p.quant.deq1, scale16, p.quant.quant1,
                                                       p.quant.deq2)
    scale2, offset2 = output_scales(p.quant)
    return KernelArgs(q, k, v, o_flat, lse.reshape(-1), mask8, mask16, pse, kp, vp, table,
                      channel, tuple(tokens), strides, boff, lens, params, fparams, scale2,
                      offset2)
