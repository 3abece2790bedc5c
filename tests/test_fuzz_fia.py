"""Fuzzed fused_infer_attention_score and FiaPlan calls (docs/fia.md, 'Errors' and 'Planned
calls'; docs/guarantees.md).

Every example starts from a small valid call (tests/test_fia_properties.py's: a branch, a kv
cache form, int8 caches in a drawn antiquant mode, masks, pse, lengths) in a drawn layout, takes
a route, and applies one mutation that knows what it did:

* routes: the whole call; a plan made on the call and run on it, then on other data of the
  same geometry (both bit for bit the whole call's), then on the mutated arrays;
* mutations that make the call invalid name the exception types the contract allows: masked
  arrays, memoryviews, torch tensors on the meta device, ranks that differ (with a prefix or
  an int8 cache too), zero-stride pools of 2^62 values, dtypes that differ or are not
  allowed, wrong scalars, and for a plan arrays of another geometry;
* valid mutations give views of other strides: the result has the bits of the call on
  contiguous arrays (a plan refuses other strides: a RuntimeError).

The property: a valid call returns a result within the float64 reference's bound; an invalid
one raises exactly TypeError, ValueError or RuntimeError, with a message; nothing else is
raised, and no call writes into an input. Profiles (``PFA_HYPOTHESIS_PROFILE``): ``ci``
(default, derandomized) and ``long`` (10,000 calls)::

    PFA_HYPOTHESIS_PROFILE=long python -m pytest tests/test_fuzz_fia.py -q -p no:cacheprovider
"""
import math
import warnings

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from pfa_numba import FiaPlan, fused_infer_attention_score, reference
from _cases import _eps
from _strategies import input_state, profile_settings, view_variant
from test_fia_properties import FORMS, fia_calls

PROFILE_SETTINGS = profile_settings(ci=("pfa-fuzz-fia-ci", 300),
                                    long=("pfa-fuzz-fia-long", 10_000))
ALLOWED = (TypeError, ValueError, RuntimeError)
T, V_, R = TypeError, ValueError, RuntimeError
VALID = "valid"
QKV = ("query", "key", "value")

try:
    import torch
except ImportError:                     # the meta-tensor mutation needs torch
    torch = None


# --------------------------------------------------------------------------------------------
# the base call in a drawn layout
# --------------------------------------------------------------------------------------------
def _to_layout(x, layout, pool=False):
    """A BNSD tensor (B, N, S, D), or a 4-D block pool (blocks, Nkv, block_size, D), in
    ``layout``: pools become (blocks, block_size, Hkv) there."""
    if layout == "BNSD" or x.ndim != 4:
        return x
    rows = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    return rows.reshape(rows.shape[0], rows.shape[1], -1) if layout == "BSH" or pool else rows


@st.composite
def base_calls(draw, forms=FORMS):
    """((query, key, value), keywords): a valid call of test_fia_properties.fia_calls (a kv
    cache of one of ``forms``) in BNSD, BSH or BSND."""
    (q, k, v), kw, _ = draw(fia_calls(forms))
    layout = draw(st.sampled_from(["BNSD", "BSH", "BSND"]))
    if layout == "BNSD":
        return (q, k, v), kw
    paged = "block_table" in kw
    q = _to_layout(q, layout)
    k, v = ([_to_layout(e, layout) for e in x] if isinstance(x, list) else
            _to_layout(x, layout, pool=paged) for x in (k, v))
    for name in ("key_shared_prefix", "value_shared_prefix"):
        if name in kw:
            kw[name] = _to_layout(kw[name], layout)
    return (q, k, v), dict(kw, input_layout=layout)


# --------------------------------------------------------------------------------------------
# mutations: each edits args (a list) / kw in place and returns the allowed error types, VALID
# (the call stays valid), or ("plan", types): types for a plan's call, the whole call's for the
# rest of the routes
# --------------------------------------------------------------------------------------------
def _pick_tensor(data, args, names=QKV):
    return data.draw(st.sampled_from([QKV.index(n) for n in names]), label="tensor")


def _replace(args, i, fn):
    """args[i] (or every element of a key / value list) replaced by fn(array)."""
    x = args[i]
    args[i] = [fn(e) for e in x] if isinstance(x, list) else fn(x)


def m_masked(data, args, kw):
    i = _pick_tensor(data, args)
    _replace(args, i, lambda x: np.ma.masked_array(x, mask=np.zeros(x.shape, bool)))
    return (T,)


def m_memoryview(data, args, kw):
    i = _pick_tensor(data, args)
    args[i] = memoryview(np.ascontiguousarray(_first(args[i])).view(np.uint8))
    return (T,)


def m_meta(data, args, kw):
    i = _pick_tensor(data, args)
    x = _first(args[i])
    dtype = {"float16": torch.float16, "float32": torch.float32, "int8": torch.int8}.get(
        x.dtype.name, torch.bfloat16)
    _replace(args, i, lambda e: torch.empty(e.shape, dtype=dtype, device="meta"))
    return (R,)


def m_rank(data, args, kw):
    """A value (or key) of another rank, where a prefix or an int8 cache stands in for it."""
    i = _pick_tensor(data, args, ("key", "value"))
    fewer = data.draw(st.booleans(), label="fewer axes")
    _replace(args, i, lambda x: x[0] if fewer else x[None])
    return (V_, R)


def m_huge_pool(data, args, kw):
    """Zero-stride pools whose logical cache (B, max_blocks x block_size, Hkv) reaches 2^62
    (the base call is paged)."""
    k = args[1]
    bs = 1 << 31
    shape = (k.shape[0], bs, k.shape[2]) if k.ndim == 3 else (k.shape[0], k.shape[1], bs,
                                                               k.shape[3])
    args[1] = args[2] = np.broadcast_to(np.zeros((), k.dtype), shape)
    kw["block_table"] = np.broadcast_to(np.zeros((), np.int32), (kw["block_table"].shape[0], bs))
    kw["block_size"] = bs
    return (R,)


def m_value_dtype(data, args, kw):
    k = _first(args[1])
    other = np.float32 if k.dtype != np.float32 else np.float16
    other = data.draw(st.sampled_from([other, np.int8, np.int32]), label="value dtype")
    if np.dtype(other) == k.dtype:
        other = np.float64
    _replace(args, 2, lambda x: x.astype(other))
    return (T,)


def m_query_dtype(data, args, kw):
    dtype = data.draw(st.sampled_from([np.int32, np.uint8, np.float64, np.bool_]), label="dt")
    args[0] = args[0].astype(dtype)
    return (T,)


SCALARS = {
    "softmax_lse_flag": (1, T), "block_size": (True, T), "scale": (float("nan"), V_),
    "num_heads": (0, R), "input_layout": ("BHSD", V_), "antiquant_mode": (1.5, T),
    "num_key_value_heads": (-1, R), "inner_precise": (7, R),
}


def m_scalar(data, args, kw):
    name = data.draw(st.sampled_from(sorted(SCALARS)), label="scalar")
    kw[name], error = SCALARS[name]
    return (error,)


def m_view(data, args, kw):
    """q, k or v (or their list elements) as a view of other strides: valid, the same bits; a
    plan refuses other strides."""
    i = _pick_tensor(data, args)
    kind = data.draw(st.sampled_from(["rev", "pad", "step2", "F", "ro", "unaligned",
                                      "struct"]), label="view")
    before = _first(args[i]).strides
    _replace(args, i, lambda x: view_variant(x, kind))
    # a plan of lists runs whole calls; one of arrays checks their strides
    same = isinstance(args[i], list) or _first(args[i]).strides == before
    return ("plan", VALID if same else (R,))


def m_geometry(data, args, kw):
    """For a plan: another shape of one tensor (one more row or element); not made for the
    whole call (which takes some shapes and refuses others) nor for lists (whose plans run
    whole calls)."""
    i = _pick_tensor(data, args)
    if isinstance(args[i], list):
        return VALID
    x = args[i]
    pad = [(0, 0)] * x.ndim
    pad[-1 if data.draw(st.booleans(), label="last axis") else 0] = (0, 1)
    args[i] = np.pad(x, pad)
    return ("plan", (R,))


MUTATIONS = dict(masked=m_masked, memoryview=m_memoryview, rank=m_rank, huge_pool=m_huge_pool,
                 value_dtype=m_value_dtype, query_dtype=m_query_dtype, scalar=m_scalar,
                 view=m_view, geometry=m_geometry, none=lambda data, args, kw: VALID)
if torch is not None:
    MUTATIONS["meta"] = m_meta


def _first(x):
    return x[0] if isinstance(x, list) else x


# --------------------------------------------------------------------------------------------
# the property
# --------------------------------------------------------------------------------------------
def _arrays(args, kw):
    """Every writeable NumPy array a call holds (a read-only broadcast view cannot be written),
    list elements included."""
    for x in list(args) + list(kw.values()):
        for e in (x if isinstance(x, list) else [x]):
            if isinstance(e, np.ndarray) and e.flags.writeable:
                yield e


def _same_bits(a, b):
    return all(np.array_equal(np.ascontiguousarray(x).view(np.uint8),
                              np.ascontiguousarray(y).view(np.uint8)) for x, y in zip(a, b))


def _within_the_reference(args, kw, out):
    """The float result within twice the reference's own error in the output dtype."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        ref, _ = reference.fused_infer_attention_score(*args, **kw)
        low, _ = reference.fused_infer_attention_score(*args, **kw, compute_dtype=out.dtype)
    got = out.astype(np.float64)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), fin)
    err = np.abs(got[fin] - ref[fin]).max(initial=0.0)
    bound = 2 * np.abs(low[fin] - ref[fin]).max(initial=0.0) + (
        _eps(out.dtype) + 16 * _eps(np.float32)) * max(1.0, np.abs(ref[fin]).max(initial=0.0))
    assert err <= bound, (err, bound)


def _other_data(args, seed):
    """Arrays of the same geometry (dtype, shape, strides) with other values: another layer."""
    rng = np.random.default_rng(seed)

    def fresh(x):
        y = np.empty_like(x)                        # C order: the strides of contiguous x
        if x.dtype == np.int8:
            y[...] = rng.integers(-128, 128, x.shape)
        else:
            y[...] = rng.standard_normal(x.shape).astype(np.float32)
        return y if y.strides == x.strides else x
    return [[fresh(e) for e in x] if isinstance(x, list) else fresh(x) for x in args]


def _outcome(call):
    """(result, None) or (None, the allowed exception); anything else fails the test."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return call(), None
    except ALLOWED as e:            # noqa: PERF203
        return None, e


@PROFILE_SETTINGS
@given(data=st.data())
def test_fuzzed_fia_and_plan_calls_raise_only_spec_errors(data):
    name = data.draw(st.sampled_from(sorted(MUTATIONS)), label="mutation")
    route = data.draw(st.sampled_from(["call", "plan"]), label="route")
    args, kw = data.draw(base_calls(["paged"] if name == "huge_pool" else FORMS), label="base")
    args = list(args)
    base_args, base_kw = list(args), dict(kw)
    want = fused_infer_attention_score(*base_args, **base_kw)
    plan = None
    if route == "plan":
        plan = FiaPlan(*base_args, **base_kw)
        assert _same_bits(plan(*base_args), want)
        layer = _other_data(base_args, data.draw(st.integers(0, 2 ** 32 - 1), label="layer"))
        assert _same_bits(plan(*layer), fused_infer_attention_score(*layer, **base_kw))
    if name == "geometry" and route != "plan":
        name = "none"
    expected = MUTATIONS[name](data, args, kw)
    if isinstance(expected, tuple) and expected[0] == "plan":
        expected = expected[1] if route == "plan" else VALID
    kw_mutated = kw.keys() != base_kw.keys() or any(kw[n] is not base_kw[n] for n in kw)
    if route == "plan" and kw_mutated:             # the plan is made with the mutated keywords
        call = lambda: FiaPlan(*base_args, **kw)(*base_args)        # noqa: E731
        args = base_args
    elif route == "plan":
        call = lambda: plan(*args)                                  # noqa: E731
    else:
        call = lambda: fused_infer_attention_score(*args, **kw)     # noqa: E731
    if route == "plan" and name in ("masked", "memoryview", "meta", "rank", "value_dtype",
                                    "query_dtype"):
        expected = tuple(set(expected) | {T, R})       # a plan's kind / dtype / shape rules
    before = [(x, input_state(x)) for x in _arrays(args, kw)]
    result, exc = _outcome(call)
    event(f"{route} {name}: " + (type(exc).__name__ if exc is not None else "returned"))
    for x, state in before:
        assert input_state(x) == state, f"an input was written (mutation {name})"
    if exc is not None:
        assert type(exc) in ALLOWED and str(exc), repr(exc)
        assert expected != VALID, f"a valid call ({name}, {route}) raised {exc!r}"
        assert isinstance(exc, expected), f"{name} ({route}) raised {exc!r}, not {expected}"
        return
    assert expected == VALID, f"an invalid call ({name}, {route}) returned a result"
    assert _same_bits(result, want), f"{name} ({route}) changed the result's bits"
    out = result[0]
    if out.dtype != np.int8 and math.prod(out.shape):
        _within_the_reference(base_args, base_kw, out)
