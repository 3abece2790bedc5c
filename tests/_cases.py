"""Shared builders for the kernel tests: inputs per layout, and the data-derived tolerance."""
import ml_dtypes
import numpy as np

from pfa_numba import reference

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"fp16": np.dtype(np.float16), "bf16": BF16, "fp32": np.dtype(np.float32)}
NAMES = {v: k for k, v in DTYPES.items()}


def to_layout(x4, layout):
    """A (B, N, S, D) array as the layout's input tensor (a fresh contiguous array)."""
    b, n, s, d = x4.shape
    if layout == "BSH":
        return np.ascontiguousarray(x4.transpose(0, 2, 1, 3).reshape(b, s, n * d))
    if layout == "BSND":
        return np.ascontiguousarray(x4.transpose(0, 2, 1, 3))
    return np.ascontiguousarray(x4)


def qkv(rng, layout, dtype, B, N, Nkv, Sq, Skv, D, spread=1.0):
    """Random q, k, v in ``layout`` and ``dtype`` (values ~ N(0, spread))."""
    def r(*shape):
        return (rng.standard_normal(shape) * spread).astype(np.float32).astype(dtype)
    return (to_layout(r(B, N, Sq, D), layout), to_layout(r(B, Nkv, Skv, D), layout),
            to_layout(r(B, Nkv, Skv, D), layout))


def case_id(dtype, layout, sm, B, N, G, Sq, Skv, D, extra=""):
    return f"cpu-{NAMES[np.dtype(dtype)]}-{layout}-sm{sm}-B{B}N{N}G{G}-Sq{Sq}Skv{Skv}-D{D}{extra}"


def _eps(dtype):
    return float(ml_dtypes.finfo(dtype).eps)


def assert_matches_reference(got, args, kwargs, dtype, lse=None, k_factor=2.0):
    """Kernel output vs the float64 reference: the kernel's error must be at most ``k_factor``
    times the error of the same reference computed in the input dtype, plus a one-ulp floor.
    NaN positions must agree exactly; infinities must agree exactly."""
    kw = dict(kwargs)
    kw.pop("device", None)
    want_lse = lse is not None
    ref = reference.prompt_flash_attention(*args, **kw, return_softmax_lse=want_lse)
    if want_lse:
        ref, ref_lse = ref
    low = reference.prompt_flash_attention(*args, **kw, compute_dtype=dtype)
    got64 = np.asarray(got).astype(np.float64)
    assert got64.shape == ref.shape, (got64.shape, ref.shape)
    nan_ref, nan_got = np.isnan(ref), np.isnan(got64)
    assert np.array_equal(nan_ref, nan_got), (
        f"NaN pattern differs: {nan_got.sum()} NaN in the kernel output, {nan_ref.sum()} in the "
        f"reference; first mismatch at {np.argwhere(nan_ref != nan_got)[:3].tolist()}")
    fin = np.isfinite(ref)
    assert np.array_equal(got64[~fin & ~nan_ref], ref[~fin & ~nan_ref])
    if fin.any():
        err = np.abs(got64[fin] - ref[fin]).max()
        low_fin = np.isfinite(low) & fin
        err_low = np.abs(low[low_fin] - ref[low_fin]).max() if low_fin.any() else 0.0
        # floor: one ulp of the output dtype, plus float32 accumulation (the kernel computes
        # in float32, the reference rounds but sums in float64)
        scale = max(1.0, np.abs(ref[fin]).max())
        floor = (_eps(dtype) + 16 * _eps(np.float32)) * scale
        bound = k_factor * err_low + floor
        assert err <= bound, (f"max |kernel - ref| = {err:.3e} > {k_factor} x {err_low:.3e} "
                              f"(reference in {np.dtype(dtype).name}) + {floor:.3e}; worst at "
                              f"{np.unravel_index(np.argmax(np.where(fin, np.abs(got64 - ref), -1)), ref.shape)}")
    if want_lse:
        assert lse.dtype == np.float32 and lse.shape == ref_lse.shape
        neg = np.isneginf(ref_lse)
        assert np.array_equal(np.isneginf(lse), neg), "rows with -inf lse differ"
        ok = ~neg & np.isfinite(ref_lse)
        if ok.any():
            lerr = np.abs(lse[ok].astype(np.float64) - ref_lse[ok]).max()
            assert lerr <= 1e-4 * max(1.0, np.abs(ref_lse[ok]).max()), f"lse error {lerr:.3e}"
    return ref
