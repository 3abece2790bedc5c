"""Host-side geometry shared by the backends: every tensor as a flat read-only array over its
memory (no copy) plus element offsets per batch and element strides, in the (7, 3) ``strides``
and (7, B) ``boff`` arrays the kernels index with the ``T_*`` rows below."""
import numpy as np
from numpy.lib.stride_tricks import as_strided

# rows of the geometry arrays (strides: (7, 3) int64 in elements; boff: (7, B) int64)
T_Q, T_K, T_V, T_O, T_L, T_M, T_P = range(7)
# the params vector of the kernels
(P_N, P_G, P_D, P_CODE, P_MASK, P_PSE, P_IP, P_LSE, P_ROWS, P_COLS, P_THREADS, P_OCODE,
 P_FLAGS, P_SUB, P_SEG, P_GEMM, P_BLAS) = range(17)


def readonly_dummy(dtype):
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
    if any(s % it for s in x.strides) or not x.flags.aligned:
        x = np.ascontiguousarray(x)  # exotic byte strides only; ordinary views never copy
    lo = sum((n - 1) * s for n, s in zip(x.shape, x.strides) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(x.shape, x.strides) if s > 0)
    corner = x[tuple(slice(n - 1, n) if s < 0 else slice(0, 1) for n, s in zip(x.shape, x.strides))]
    flat = as_strided(corner, shape=((hi - lo) // it + 1,), strides=(it,), writeable=False)
    return flat, -lo // it, tuple(s // it for s in x.strides)


def storage(dtype):
    """How the kernels see elements of ``dtype``: uint16 bits for float16/bfloat16."""
    dtype = np.dtype(dtype)
    if dtype.itemsize == 2 and dtype.kind != "u":
        return np.uint16
    return dtype.type


def geometry(p, out, lse):
    """Flat arrays, (7, 3) strides and (7, B) batch offsets for the kernels."""
    st = storage(p.dtype)
    strides = np.zeros((7, 3), np.int64)
    boff = np.zeros((7, max(p.B, 1)), np.int64)
    bidx = np.arange(p.B, dtype=np.int64)

    def put(row, x, storage, start=None):
        flat, origin, s = flat_view(x, storage)
        if start is None:   # padded: x is (B|1, ...)
            boff[row, :p.B] = origin + bidx * (s[0] if x.shape[0] > 1 else 0)
            strides[row, :x.ndim - 1] = s[1:]
        else:               # packed TND: x is (T, N, D); batch b starts at row start[b]
            boff[row, :p.B] = origin + start * s[0]
            strides[row, :3] = [s[1], s[0], s[2]]
        return flat

    qf = put(T_Q, p.q, st, p.q_start)
    kf = put(T_K, p.k, st, p.kv_start)
    vf = put(T_V, p.v, st, p.kv_start)

    ov = p.out_view(out)
    o_flat = out.reshape(-1).view(storage(out.dtype))
    o_s = [s // out.itemsize for s in ov.strides]
    if p.packed:
        boff[T_O, :p.B] = p.q_start * o_s[0]
        strides[T_O] = [o_s[1], o_s[0], o_s[2]]
    else:
        boff[T_O, :p.B] = bidx * o_s[0]
        strides[T_O] = o_s[1:]
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
    return qf, kf, vf, o_flat, mask8, mask16, pse, strides, boff




def scale_factors(scale):
    """scale_value as two float32 factors (s1, s2), s2 a power of two, s1 * s2 = scale.

    The kernels fold the scale into Q in float32. A finite scale_value outside float32's range
    (SPEC uses it as given) is split so that q * s1 * s2 never overflows or underflows when
    q * scale itself is representable; ordinary scales give (float32(scale), 1)."""
    if scale == 0.0 or 2.0 ** -100 <= abs(scale) <= 2.0 ** 100:
        return np.array([scale, 1.0], dtype=np.float32)
    e = int(np.round(np.log2(abs(scale)) / 2))
    return np.array([scale / 2.0 ** e, 2.0 ** e], dtype=np.float32)
