"""Fuzzed calls: random wrong things mixed into otherwise valid calls (docs/contract.md and
docs/fia.md, 'Errors'): prompt_flash_attention's, then fused_infer_attention_score's and
FiaPlan's (their section below says how).

Every example starts from a small VALID call and applies a few mutations. Each mutation knows
what it did to the call:

* ``independent`` / ``dependent`` mutations make the call invalid and name the exception types
  the contract allows for it (dependent ones are judged against the base call, so they are never
  mixed with a structural mutation);
* ``structural`` mutations (another layout, dtype, head count, sparse mode, zero sizes) may or may
  not leave the call valid;
* ``valid`` mutations (strided / read-only / unaligned views, NumPy scalars, other accepted
  forms of the lengths, in-range values) keep it valid.

The property: the call returns a result only if no mutation made it invalid, and then the
float result matches ``pfa_numba.reference``; otherwise it raises exactly TypeError, ValueError
or RuntimeError -- one allowed by the mutations when the error is predictable -- and nothing
else. No call ever writes into an input array. Sizes are tiny, so no call can hang.

Profiles (environment variable ``PFA_HYPOTHESIS_PROFILE``): ``ci`` (default, ~300 examples of
each, derandomized) and ``long`` (10,000 examples of each)::

    PFA_HYPOTHESIS_PROFILE=long python -m pytest tests/test_fuzz.py -q -p no:cacheprovider
"""
import math
import warnings

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from pfa_numba import (FiaPlan, fused_infer_attention_score, prompt_flash_attention, reference,
                       trans_quant_param)
from _cases import _eps, assert_matches_reference
from _strategies import (BF16, F16, F32, FLOAT_DTYPES, I8, INF, LAYOUTS, QUANT_KINDS, TND_MODES,
                         as_form, draw_dtype_name, draw_nkv_arg, draw_tnd_lengths,
                         ignore_underflow, input_state, int8_scales, mask_2048, profile_settings,
                         pse_dtype, random_input, tnd_ends, tokens_used, tokens_valid,
                         view_variant)
from test_fia_properties import FORMS, fia_calls

try:
    import torch
except ImportError:                     # the meta-tensor mutation needs torch
    torch = None

PROFILE_SETTINGS = profile_settings(ci=("pfa-fuzz-ci", 300), long=("pfa-fuzz-long", 10_000))

DTYPES = dict(FLOAT_DTYPES, int8=I8)
ALLOWED = (TypeError, ValueError, RuntimeError)
T, V_, R = TypeError, ValueError, RuntimeError
ANY = (T, V_, R)
VALID = "valid"          # a mutation that keeps the call valid
MAYBE = None             # a structural mutation: valid or not, depending on the call

POSITIONAL = ("query", "key", "value", "attn_mask", "actual_seq_lengths",
              "actual_seq_lengths_kv", "pse_shift", "deq_scale1", "quant_scale1", "deq_scale2",
              "quant_scale2", "quant_offset2", "num_heads", "scale_value", "pre_tokens",
              "next_tokens", "input_layout", "num_key_value_heads", "sparse_mode",
              "inner_precise")
QUANT = ("deq_scale1", "quant_scale1", "deq_scale2", "quant_scale2", "quant_offset2")
INT_ARGS = ("num_heads", "num_key_value_heads", "pre_tokens", "next_tokens", "sparse_mode",
            "inner_precise")


def band_mask(dtype=np.bool_, shape=(2048, 2048)):
    """(2048, 2048)-class masks, built once per dtype, read-only (never read by the library)."""
    m = mask_2048("triu", dtype)
    if shape == (2048, 2048):
        return m
    return np.broadcast_to(m.reshape((1,) * (len(shape) - 2) + m.shape), shape)


# --------------------------------------------------------------------------------------------
# the base call
# --------------------------------------------------------------------------------------------
@st.composite
def base_specs(draw):
    c = {}
    c["layout"] = layout = draw(st.sampled_from(LAYOUTS))
    kinds = ["float"] * 3 + ([] if layout == "TND" else list(QUANT_KINDS))
    c["kind"] = kind = draw(st.sampled_from(kinds))
    c["dtype"] = draw_dtype_name(draw, kind)
    nkv = draw(st.integers(1, 2))
    c["N"], c["Nkv"] = nkv * draw(st.integers(1, 2)), nkv
    c["nkv_arg"] = draw_nkv_arg(draw, c["N"], nkv)
    c["D"] = draw(st.sampled_from([16, 32]))
    if layout == "TND":
        c["B"], c["q_lens"], c["kv_lens"] = draw_tnd_lengths(draw, 2, 4)
        c["mode"] = mode = draw(st.sampled_from(TND_MODES))
        c["mask"] = None if mode == 0 else "band"
        c["pse"] = False
        c["lens"] = (None, None)
    else:
        c["B"] = b = draw(st.integers(0, 2))
        c["Sq"] = draw(st.integers(0, 5))
        c["Skv"] = draw(st.integers(0, 5))
        c["mode"] = mode = draw(st.integers(0, 4))
        if mode == 0:
            c["mask"] = draw(st.sampled_from([None, "B1", "2"]))
        elif mode == 1:
            c["mask"] = draw(st.sampled_from(["B1", "2"]))
        else:
            c["mask"] = "band"
        c["pse"] = draw(st.booleans())
        c["lens"] = tuple(draw(st.one_of(st.none(), st.lists(st.integers(0, s), min_size=b,
                                                              max_size=b)))
                          for s in (c["Sq"], c["Skv"]))
    c["pre"] = draw(st.sampled_from([0, 1, 3, INF]))
    c["next"] = draw(st.sampled_from([0, 2, INF]))
    c["scale"] = draw(st.sampled_from([1.0, 0.25, 0.5]))
    c["ip"] = draw(st.integers(0, 3))
    c["lse"] = draw(st.booleans())
    c["device"] = draw(st.sampled_from([None, "cpu"]))
    c["offset2"] = draw(st.booleans())
    c["positional"] = draw(st.booleans())
    c["seed"] = draw(st.integers(0, 2 ** 16))
    return c


def qkv_shapes(c, layout=None):
    layout = layout or c["layout"]
    n, nkv, d = c["N"], c["Nkv"], c["D"]
    if layout == "TND":
        return (sum(c["q_lens"]), n, d), (sum(c["kv_lens"]), nkv, d)
    b, sq, skv = c["B"], c["Sq"], c["Skv"]
    if layout == "BSH":
        return (b, sq, n * d), (b, skv, nkv * d)
    if layout == "BSND":
        return (b, sq, n, d), (b, skv, nkv, d)
    return (b, n, sq, d), (b, nkv, skv, d)


@ignore_underflow
def build_base(c):
    """The valid call ``c`` describes, as a dict of every argument by name."""
    rng = np.random.default_rng(c["seed"])
    dtype = DTYPES[c["dtype"]]
    qs, ks = qkv_shapes(c)

    def arr(shape):
        return random_input(rng, shape, dtype, 0.5)

    call = dict(query=arr(qs), key=arr(ks), value=arr(ks), attn_mask=None,
                actual_seq_lengths=None, actual_seq_lengths_kv=None, pse_shift=None,
                deq_scale1=None, quant_scale1=None, deq_scale2=None, quant_scale2=None,
                quant_offset2=None, num_heads=c["N"], scale_value=c["scale"],
                pre_tokens=c["pre"], next_tokens=c["next"], input_layout=c["layout"],
                num_key_value_heads=c["nkv_arg"], sparse_mode=c["mode"],
                inner_precise=c["ip"], device=c["device"], return_softmax_lse=c["lse"])
    if c["layout"] == "TND":
        call["actual_seq_lengths"] = tnd_ends(c["q_lens"]).tolist()
        call["actual_seq_lengths_kv"] = tnd_ends(c["kv_lens"]).tolist()
    else:
        call["actual_seq_lengths"], call["actual_seq_lengths_kv"] = (
            None if x is None else list(x) for x in c["lens"])
        b, sq, skv = c["B"], c["Sq"], c["Skv"]
        if c["mask"] == "B1":
            call["attn_mask"] = rng.random((b, 1, sq, skv)) < 0.3
        elif c["mask"] == "2":
            call["attn_mask"] = (rng.random((sq, skv)) < 0.3).astype(np.uint8)
        if c["pse"]:
            pse = rng.standard_normal((1, c["N"], sq, skv)).astype(np.float32)
            call["pse_shift"] = pse.astype(pse_dtype(dtype))
    if c["mask"] == "band":
        call["attn_mask"] = band_mask()
    if c["kind"].startswith("int8"):
        call["deq_scale1"], call["quant_scale1"], call["deq_scale2"] = int8_scales(c["D"])
    if c["kind"].endswith("->int8"):
        sdt = BF16 if dtype == BF16 and c["offset2"] else F32
        call["quant_scale2"] = np.array([0.5 if dtype == I8 else 20.0], np.float32).astype(sdt)
        if c["offset2"]:
            call["quant_offset2"] = np.array([1.0], np.float32).astype(sdt)
    return call


# --------------------------------------------------------------------------------------------
# mutations: each draws what it needs from ``data`` and returns what it expects
# --------------------------------------------------------------------------------------------
def _pick(data, options, label):
    return data.draw(st.sampled_from(options), label=label)


# ---- independent: invalid whatever the rest of the call --------------------------------------
def m_int_type(data, call, c):
    name = _pick(data, INT_ARGS, "int arg")
    call[name] = _pick(data, [True, False, np.bool_(True), 1.0, 2.5, "1", None, [1], (1,),
                              np.float32(1), 1 + 0j, np.array(1), np.array([1])], "bad int")
    return (T,)


def m_int_overflow(data, call, c):
    name = _pick(data, INT_ARGS, "int arg")
    call[name] = _pick(data, [2 ** 63, 2 ** 64 + 3, -2 ** 63 - 1, -2 ** 100, 10 ** 30],
                       "beyond int64")
    return (V_,)


def m_scale(data, call, c):
    value = _pick(data, ["nan", "inf", "-inf", "f32nan", "f16inf", "ldinf", "huge_int", "1j",
                         "c64", "str", "None", "True", "np_bool", "list", "arr0", "arr1",
                         "bytes"], "scale_value")
    table = {"nan": (float("nan"), V_), "inf": (float("inf"), V_), "-inf": (-math.inf, V_),
             "f32nan": (np.float32("nan"), V_), "f16inf": (np.float16("inf"), V_),
             "ldinf": (np.longdouble("inf"), V_), "huge_int": (10 ** 400, (T, V_)),
             "1j": (1 + 0j, T), "c64": (np.complex64(1), T), "str": ("1.0", T),
             "None": (None, T), "True": (True, T), "np_bool": (np.bool_(False), T),
             "list": ([1.0], T), "arr0": (np.array(1.0), T), "arr1": (np.array([1.0]), T),
             "bytes": (b"1", T)}
    call["scale_value"], exc = table[value]
    return exc if isinstance(exc, tuple) else (exc,)


def m_layout(data, call, c):
    value = _pick(data, ["bsh", "BSHD", "", "SBH", "BNSD ", "TND2", "NSD", "B S H", None, 0,
                         b"BSH", ["BSH"], ("BNSD",), 3.5], "input_layout")
    call["input_layout"] = value
    return (V_,) if isinstance(value, str) else (T,)


def m_device(data, call, c):
    call["device"] = _pick(data, ["gpu", "CPU", "cuda:0", "", " cpu", 0, 1, b"cpu", ["cpu"],
                                  "Cuda", "npu", 1.5], "device")
    return (V_,)


def m_lse(data, call, c):
    call["return_softmax_lse"] = _pick(data, [1, 0, "True", None, 1.0, [True],
                                              np.array(True), np.array([False])], "lse")
    return (T,)


def m_range(data, call, c):
    name, value = _pick(data, [("sparse_mode", 5), ("sparse_mode", -1), ("sparse_mode", 100),
                               ("sparse_mode", 2 ** 40), ("sparse_mode", np.int64(7)),
                               ("inner_precise", 4), ("inner_precise", -1),
                               ("inner_precise", 2 ** 31), ("inner_precise", np.int8(-3)),
                               ("num_heads", 0), ("num_heads", -1), ("num_heads", -2 ** 40),
                               ("num_heads", np.int32(0)), ("num_key_value_heads", -1),
                               ("num_key_value_heads", -2 ** 62)], "out of range")
    call[name] = value
    return (R,)


def m_qkv_dtype(data, call, c):
    target = _pick(data, ["query", "key", "value", "all"], "target")
    cur = DTYPES[c["dtype"]]
    bad = [np.float64, np.int32, np.int16, np.uint8, np.complex64, np.bool_, object,
           np.uint16, np.float128 if hasattr(np, "float128") else np.float64]
    if target != "all":
        bad += [d for d in (F16, BF16, F32, I8) if d != cur]
    dt = np.dtype(_pick(data, bad, "dtype"))
    for name in (("query", "key", "value") if target == "all" else (target,)):
        if isinstance(call[name], np.ndarray):
            with np.errstate(invalid="ignore", over="ignore"):   # a wrong dtype is the point
                call[name] = call[name].astype(dt)
    return (T,)


def m_qkv_not_array(data, call, c):
    target = _pick(data, ["query", "key", "value"], "target")
    kind = _pick(data, ["list", "None", "float", "str", "tuple", "memoryview"], "replacement")
    x = np.asarray(call[target])
    call[target] = {"list": lambda: x.astype(np.float32).tolist(), "None": lambda: None,
                    "float": lambda: 1.0, "str": lambda: "query",
                    "tuple": lambda: tuple(x.astype(np.float32).reshape(-1).tolist()),
                    "memoryview": lambda: memoryview(np.ascontiguousarray(x).view(np.uint8)),
                    }[kind]()
    return (T,)


INDEPENDENT = dict(int_type=m_int_type, int_overflow=m_int_overflow, scale=m_scale,
                   layout=m_layout, device=m_device, lse=m_lse, range=m_range,
                   qkv_dtype=m_qkv_dtype, qkv_not_array=m_qkv_not_array)


# ---- dependent: invalid, judged against the base call -----------------------------------------
def _head_axis(layout):
    return {"BSH": 2, "BSND": 2, "TND": 1}.get(layout, 1)


def m_rank(data, call, c):
    target = _pick(data, ["query", "key", "value"], "target")
    how = _pick(data, ["add", "drop"], "rank change")
    x = call[target]
    call[target] = x[None] if how == "add" else x[..., 0]
    return (V_,)


def m_heads(data, call, c):
    target = _pick(data, ["query", "key", "value", "kv"], "target")
    ax = _head_axis(c["layout"])
    for name in (("key", "value") if target == "kv" else (target,)):
        x = call[name]
        extra = np.take(x, [0] * (c["D"] if c["layout"] == "BSH" else 1), axis=ax)
        call[name] = np.concatenate([x, extra], axis=ax)
    return (R,)


def m_headdim(data, call, c):
    target = _pick(data, ["query", "key", "value"], "target")
    delta = _pick(data, [1, -1], "delta")
    x = call[target]
    call[target] = (np.concatenate([x, x[..., :1]], axis=-1) if delta > 0 else
                    np.ascontiguousarray(x[..., :-1]))
    return (R,)


def m_batch(data, call, c):
    target = _pick(data, ["key", "value", "query"], "target")
    x = call[target]
    row = np.zeros((1,) + x.shape[1:], x.dtype)
    call[target] = np.concatenate([x, row], axis=0)
    if c["layout"] == "TND":
        return (R, V_)          # packed lengths differ (and the ends no longer match)
    return (R,)


def m_kv_seq(data, call, c):
    if c["layout"] == "TND":
        return m_batch(data, call, c)
    target = _pick(data, ["key", "value"], "target")
    x = call[target]
    ax = 2 if c["layout"] in ("BNSD", "BNSD_BSND") else 1
    shape = list(x.shape)
    shape[ax] = 1
    call[target] = np.concatenate([x, np.zeros(shape, x.dtype)], axis=ax)
    return (R,)


def m_zero_d(data, call, c):
    for name in ("query", "key", "value"):
        call[name] = call[name][..., :0]
    return (R,)


def m_to_int8(data, call, c):
    if c["kind"].startswith("int8"):
        return m_zero_d(data, call, c)
    for name in ("query", "key", "value"):
        call[name] = np.clip(call[name].astype(np.float32), -128, 127).astype(np.int8)
    return (R, T)


def _mask_ctx(c):
    return c["B"], c.get("Sq", 0), c.get("Skv", 0)


def m_mask_dtype(data, call, c):
    b, sq, skv = _mask_ctx(c)
    bad = [np.float32, np.float64, np.int32, np.int16, np.uint16, np.complex64, object]
    if c["dtype"] != "fp16":
        bad.append(np.float16)
    dt = np.dtype(_pick(data, bad, "mask dtype"))
    mode = call["sparse_mode"]
    if mode in (2, 3, 4):
        call["attn_mask"] = band_mask(_pick(data, [np.float16, np.float32, np.int32, np.int16],
                                            "band mask dtype"))
        return (T,)
    if c["layout"] == "TND":   # mode 0: no user mask at all with TND
        call["attn_mask"] = np.zeros((1, 1), dt)
        return (T, R)
    call["attn_mask"] = np.zeros((sq, skv), dt)
    return (T,)


def m_mask_shape(data, call, c):
    b, sq, skv = _mask_ctx(c)
    mode = call["sparse_mode"]
    if c["layout"] == "TND" and mode == 0:
        call["attn_mask"] = np.zeros((4, 4), bool)         # a user mask with TND
        return (R,)
    if mode in (2, 3, 4):
        shape = _pick(data, [None, (b + 2, 2048, 2048), (2048, 2047), (2049, 2049),
                             (1, 2, 2048, 2048), (b + 2, 1, 2048, 2048), (2, 1, 1, 2048, 2048),
                             (4, 4)], "band mask shape")
        call["attn_mask"] = None if shape is None else (
            band_mask(np.bool_, shape) if shape[-2:] == (2048, 2048) else np.zeros(shape, bool))
        return (R,)
    options = [(skv,), (1, 1, 1, sq, skv), (1, 2, sq, skv), (b + 2, sq, skv),
               (b + 2, 1, sq, skv), "list"]
    if mode == 1:
        options.append(None)
    if sq:
        options += [(sq - 1, skv), (1, 1, sq - 1, skv + 3)]
    if skv:
        options += [(sq, skv - 1), (b, sq + 2, skv - 1)]
    shape = _pick(data, options, "mask shape")
    if shape == "list":
        call["attn_mask"] = np.zeros((sq, skv), bool).tolist()
        return (T,)
    call["attn_mask"] = None if shape is None else np.zeros(shape, bool)
    return (R,)


def m_pse(data, call, c):
    dt = DTYPES[c["dtype"]]
    want = pse_dtype(dt)
    if c["layout"] == "TND":
        call["pse_shift"] = np.zeros((1, c["N"], 4, 4), want)
        return (R,)
    b, sq, skv = _mask_ctx(c)
    n = c["N"]
    what = _pick(data, ["dtype", "shape"], "pse wrong")
    if what == "dtype":
        bad = [d for d in (F16, BF16, F32, np.dtype(np.float64), I8, np.dtype(np.int32))
               if d != want]
        call["pse_shift"] = np.zeros((1, n, sq, skv), _pick(data, bad, "pse dtype"))
        return (T,)
    options = [(n, sq, skv), (1, n + 1, sq, skv), (b + 2, n, sq, skv), (1, 1, n, sq, skv),
               (1, n, sq, skv, 1), "list"]
    if n > 1:
        options.append((1, 1, sq, skv))
    if sq:
        options.append((1, n, sq - 1, skv))
    if skv:
        options.append((b, n, sq, skv - 1))
    shape = _pick(data, options, "pse shape")
    if shape == "list":
        call["pse_shift"] = np.zeros((1, n, sq, skv), want).astype(np.float32).tolist()
        return (T,)
    call["pse_shift"] = np.zeros(shape, want)
    return (R,)


def m_lengths(data, call, c):
    which = _pick(data, ["actual_seq_lengths", "actual_seq_lengths_kv"], "which")
    if c["layout"] == "TND":
        ends = list(call[which])
        total = ends[-1] if ends else 0
        options = ["None", "past_end", "extra_end", "floats", "nested", "str", "scalar"]
        if len(ends) >= 2 and ends[0] < ends[-1]:
            options.append("decreasing")
        if ends:
            options += ["negative_first", "short_end"] if total else ["negative_first"]
        how = _pick(data, options, "bad ends")
        new = {"None": None, "past_end": ends[:-1] + [total + 1] if ends else [1],
               "extra_end": ends + [total], "floats": [float(e) for e in ends] or [0.0],
               "nested": [ends], "str": str(ends), "scalar": total,
               "decreasing": ends[::-1], "negative_first": [-1] + ends,
               "short_end": ends[:-1] + [total - 1]}[how]
        call[which] = new
        if how in ("floats", "str", "scalar", "nested"):
            return (T, V_)
        return (V_,)
    b = c["B"]
    full = c["Sq"] if which == "actual_seq_lengths" else c["Skv"]
    how = _pick(data, ["negative", "too_big", "count", "empty", "floats", "float_array",
                       "nested", "array2d", "scalar", "np_scalar", "str", "bools", "huge",
                       "uint64_huge", "object_array", "dict", "float_scalar"], "bad lengths")
    if how == "empty" and b == 0:
        how = "count"
    new = {"negative": [-1] if b == 0 else [-1] * b,
           "too_big": [full + 1],
           "count": [0] * (b + 1 if b else 2),
           "empty": [],
           "floats": [float(full)] * max(b, 1),
           "float_array": np.full(max(b, 1), float(full)),
           "nested": [[full]] * max(b, 1),
           "array2d": np.full((max(b, 1), 1), full),
           "scalar": full, "np_scalar": np.int64(full), "str": str(full),
           "bools": [True] * max(b, 1), "huge": [2 ** 64],
           "uint64_huge": np.array([2 ** 63], np.uint64),
           "object_array": np.array([full] * max(b, 1), dtype=object),
           "dict": {0: full}, "float_scalar": float(full)}[how]
    call[which] = new
    if how in ("negative", "too_big", "count", "empty", "uint64_huge"):
        return (V_,)
    return (T, V_)


def m_tokens(data, call, c):
    value = st.one_of(st.integers(-8, 8), st.sampled_from([INF, INF + 5, -INF, 2 ** 62,
                                                           -2 ** 62, -2 ** 63]))
    pre, nxt = data.draw(value, label="pre_tokens"), data.draw(value, label="next_tokens")
    call["pre_tokens"], call["next_tokens"] = pre, nxt

    def judge(final):       # judged on the final call (another mutation may add a mask)
        int8_out_mode4 = final["quant_scale2"] is not None and final["sparse_mode"] == 4
        used = tokens_used(final["sparse_mode"], final["attn_mask"] is not None)
        if tokens_valid(pre, nxt, used, int8_out_mode4):
            return VALID
        return (R,)
    return judge


def m_nkv(data, call, c):
    value = _pick(data, [0, 1, 2, 3, 4, 8], "num_key_value_heads")
    call["num_key_value_heads"] = value
    return VALID if (value or c["N"]) == c["Nkv"] else (R,)


def m_quant(data, call, c):
    kind = c["kind"]
    f32 = lambda v: np.array([v], np.float32)      # noqa: E731
    h = c["N"] * c["D"]
    if kind == "float" or c["layout"] == "TND":
        name = _pick(data, ["deq_scale1", "quant_scale1", "deq_scale2", "quant_offset2"]
                     + (["quant_scale2"] if c["layout"] == "TND" else []), "added")
        call[name] = f32(0.5)
        return (R,)
    if kind.startswith("int8"):
        options = ["drop_deq1", "drop_qs1", "drop_deq2", "deq1_f64", "deq2_f16", "deq_mixed",
                   "qs1_f16", "qs1_u64", "deq1_shape2", "deq1_shape0", "deq2_shape11",
                   "qs1_shape2", "deq1_list", "deq1_int64"]
        if kind == "int8->float16":
            options += ["add_offset2"]
        else:
            options += ["s2_f16", "s2_f64", "s2_bf16", "s2_shape2", "s2_shapeH1", "s2_shape11",
                        "o2_dtype", "o2_shape", "drop_s2_keep_o2"]
            if c["D"] % 32:
                options.append("s2_per_channel_D16")
    else:   # float -> int8
        options = ["add_deq1", "add_qs1", "add_deq2", "s2_f16", "s2_f64", "s2_shape2",
                   "s2_shapeH1", "o2_shape", "o2_dtype", "drop_s2_keep_o2", "s2_list"]
        if c["dtype"] != "bf16":
            options.append("s2_bf16")
        if c["D"] % 32:
            options.append("s2_per_channel_D16")
    how = _pick(data, options, "bad quant")
    s2 = call["quant_scale2"]
    sdt = s2.dtype if s2 is not None else F32
    actions = {
        "drop_deq1": ("deq_scale1", None, R), "drop_qs1": ("quant_scale1", None, R),
        "drop_deq2": ("deq_scale2", None, R),
        "deq1_f64": ("deq_scale1", np.array([1e-3]), T),
        "deq2_f16": ("deq_scale2", np.array([0.01], np.float16), T),
        "deq_mixed": ("deq_scale1", trans_quant_param(f32(1e-3)), T),   # deq2 stays float32
        "qs1_f16": ("quant_scale1", np.array([127], np.float16), T),
        "qs1_u64": ("quant_scale1", trans_quant_param(f32(127.0)), T),
        "deq1_shape2": ("deq_scale1", np.full(2, 1e-3, np.float32), R),
        "deq1_shape0": ("deq_scale1", np.array(1e-3, np.float32), R),
        "deq2_shape11": ("deq_scale2", np.full((1, 1), 0.01, np.float32), R),
        "qs1_shape2": ("quant_scale1", np.full(2, 127.0, np.float32), R),
        "deq1_list": ("deq_scale1", [1e-3], T),
        "deq1_int64": ("deq_scale1", np.array([1], np.int64), T),
        "add_offset2": ("quant_offset2", f32(1.0), R),
        "s2_f16": ("quant_scale2", np.array([0.5], np.float16), (T, R)),
        "s2_f64": ("quant_scale2", np.array([0.5]), (T, R)),
        "s2_bf16": ("quant_scale2", np.array([0.5], np.float32).astype(BF16), (T, R)),
        "s2_shape2": ("quant_scale2", np.full(2, 0.5, sdt), R),
        "s2_shapeH1": ("quant_scale2", np.full(h + 1, 0.5, sdt), R),
        "s2_shape11": ("quant_scale2", np.full((1, 1), 0.5, sdt), R),
        "s2_per_channel_D16": ("quant_scale2", np.full(h, 0.5, sdt), R),
        "o2_dtype": ("quant_offset2", np.array([1.0], np.float16), T),
        "o2_shape": ("quant_offset2", np.zeros(h, sdt), R),
        "drop_s2_keep_o2": ("quant_scale2", None, R),
        "s2_list": ("quant_scale2", [0.5], T),
        "add_deq1": ("deq_scale1", f32(1e-3), R), "add_qs1": ("quant_scale1", f32(127.0), R),
        "add_deq2": ("deq_scale2", f32(0.01), R),
    }
    name, value, exc = actions[how]
    call[name] = value
    if how == "drop_s2_keep_o2" and call["quant_offset2"] is None:
        call["quant_offset2"] = np.zeros(1, sdt)
    if how in ("o2_dtype", "o2_shape"):
        # the offset must follow quant_scale2 (the dtype check may come before the shape one)
        exc = (T, R)
    return exc if isinstance(exc, tuple) else (exc,)


DEPENDENT = dict(rank=m_rank, heads=m_heads, headdim=m_headdim, batch=m_batch, kv_seq=m_kv_seq,
                 zero_d=m_zero_d, to_int8=m_to_int8, mask_dtype=m_mask_dtype,
                 mask_shape=m_mask_shape, pse=m_pse, lengths=m_lengths, tokens=m_tokens,
                 nkv=m_nkv, quant=m_quant)


# ---- structural: valid or not --------------------------------------------------------------
def s_layout(data, call, c):
    call["input_layout"] = _pick(data, [x for x in LAYOUTS if x != c["layout"]], "layout")
    return MAYBE


def s_dtype(data, call, c):
    dt = _pick(data, [d for d in (F16, BF16, F32) if d != DTYPES[c["dtype"]]], "dtype")
    for name in ("query", "key", "value"):
        call[name] = call[name].astype(dt)
    return MAYBE


def s_heads(data, call, c):
    call["num_heads"] = _pick(data, [x for x in (1, 2, 3, 4, 8, 32) if x != c["N"]], "heads")
    return MAYBE


def s_mode(data, call, c):
    call["sparse_mode"] = _pick(data, [x for x in range(5) if x != c["mode"]], "sparse_mode")
    return MAYBE


def s_zero(data, call, c):
    axis = _pick(data, ["B", "Sq", "Skv"], "zero axis")
    layout = c["layout"]
    if layout == "TND":
        for name in ("query", "key", "value"):
            call[name] = call[name][:0]
        call["actual_seq_lengths"] = [0] * len(call["actual_seq_lengths"])
        call["actual_seq_lengths_kv"] = [0] * len(call["actual_seq_lengths_kv"])
        return MAYBE
    seq_ax = 2 if layout in ("BNSD", "BNSD_BSND") else 1
    names = {"B": ("query", "key", "value"), "Sq": ("query",), "Skv": ("key", "value")}[axis]
    for name in names:
        x = call[name]
        idx = [slice(None)] * x.ndim
        idx[0 if axis == "B" else seq_ax] = slice(0, 0)
        call[name] = x[tuple(idx)]
    return MAYBE


def s_add_s2(data, call, c):
    call["quant_scale2"] = np.array([10.0], np.float32)
    return MAYBE


def s_byteorder(data, call, c):
    """Non-native byte order (the contract does not say whether '>f2' is 'float16'): valid or an
    error, never a misread."""
    names = data.draw(st.lists(st.sampled_from(["query", "key", "value", "pse_shift",
                                                "quant_scale2", "deq_scale1"]), min_size=1,
                               max_size=3, unique=True), label="byte-swapped")
    for name in names:
        x = call[name]
        if isinstance(x, np.ndarray) and x.dtype.itemsize > 1 and x.dtype.kind in "fiu":
            call[name] = x.astype(x.dtype.newbyteorder())
    return MAYBE


def s_cuda(data, call, c):
    call["device"] = "cuda"         # RuntimeError without a usable CUDA backend
    return MAYBE


STRUCTURAL = dict(s_layout=s_layout, s_dtype=s_dtype, s_heads=s_heads, s_mode=s_mode,
                  s_zero=s_zero, s_add_s2=s_add_s2, s_cuda=s_cuda, s_byteorder=s_byteorder)


# ---- valid: the call stays valid -----------------------------------------------------------
def _view(x, kind):
    """``view_variant`` (zeros around a "pad" window two wider); "bcast" changes the values
    (fine: the call stays valid)."""
    return x if x.dtype.hasobject else view_variant(x, kind, 0, pad=2)


def v_views(data, call, c, untouched):
    names = data.draw(st.lists(st.sampled_from(["query", "key", "value", "attn_mask",
                                                "pse_shift"] + list(QUANT)),
                               min_size=1, max_size=4, unique=True), label="viewed")
    for name in names:
        x = call[name]
        if not isinstance(x, np.ndarray) or x.shape[-2:] == (2048, 2048):
            continue
        call[name] = _view(x, _pick(data, ["F", "rev", "ro", "pad", "unaligned", "bcast",
                                           "struct"], f"{name} view"))
    return VALID


def v_scalars(data, call, c, untouched):
    names = [k for k in ("num_heads", "num_key_value_heads", "sparse_mode", "inner_precise",
                         "pre_tokens", "next_tokens", "scale_value", "input_layout", "device")
             if k in untouched]
    if not names:
        return VALID
    name = _pick(data, names, "scalar form")
    x = call[name]
    if name == "input_layout":
        call[name] = np.str_(x)
    elif name == "scale_value":
        call[name] = _pick(data, [np.float16(x), np.float32(x), np.float64(x)], "scale form")
    elif name == "device":
        call[name] = _pick(data, [None, "cpu"], "device")
    else:
        typ = _pick(data, [np.int64, np.int32, np.uint64, np.int16], "int form")
        if x < 0 and typ is np.uint64:
            typ = np.int64
        if not np.iinfo(typ).min <= x <= np.iinfo(typ).max:
            typ = np.int64
        call[name] = typ(x)
    return VALID


def v_lengths(data, call, c, untouched):
    names = [k for k in ("actual_seq_lengths", "actual_seq_lengths_kv") if k in untouched]
    if not names:
        return VALID
    which = _pick(data, names, "which")
    x = call[which]
    if x is None and c["layout"] != "TND":
        full = c["Sq"] if which == "actual_seq_lengths" else c["Skv"]
        x = [full] * _pick(data, [1, c["B"]], "count")
    form = _pick(data, ["tuple", "int32", "int64", "uint8", "list_np"], "form")
    call[which] = as_form(x, form, list_np=np.int32)
    return VALID


VALID_MUTS = dict(v_views=v_views, v_scalars=v_scalars, v_lengths=v_lengths)


def m_limits(data, call, c):
    """Replace the call by a tiny one at or beyond a size limit of contract 'Errors'."""
    case = _pick(data, ["N257", "G65", "D513", "B65537", "N256", "G64", "D512"], "limit")
    n, nkv, d, b = {"N257": (257, 257, 1, 1), "G65": (65, 1, 1, 1), "D513": (1, 1, 513, 1),
                    "B65537": (1, 1, 1, 65537), "N256": (256, 256, 1, 1), "G64": (64, 1, 1, 1),
                    "D512": (1, 1, 512, 1)}[case]
    dtype = _pick(data, [F16, F32], "dtype")
    for name in QUANT + ("attn_mask", "actual_seq_lengths", "actual_seq_lengths_kv",
                         "pse_shift"):
        call[name] = None
    call.update(query=np.full((b, n, 1, d), 0.5, dtype), key=np.full((b, nkv, 2, d), 0.25, dtype),
                value=np.ones((b, nkv, 2, d), dtype), num_heads=n, num_key_value_heads=nkv,
                input_layout="BNSD", sparse_mode=0)
    return VALID if case in ("N256", "G64", "D512") else (R,)


# --------------------------------------------------------------------------------------------
# the property
# --------------------------------------------------------------------------------------------
def describe(call):
    parts = []
    for k, x in call.items():
        if isinstance(x, np.ndarray):
            if x.size <= 4:
                parts.append(f"{k}=np.array({x.tolist()!r}, {x.dtype.name})")
            else:
                parts.append(f"{k}=<{x.dtype.name} {x.shape} strides={x.strides} "
                             f"writeable={x.flags.writeable} aligned={x.flags.aligned}>")
        else:
            r = repr(x)
            parts.append(f"{k}={r if len(r) < 120 else r[:117] + '...'}")
    return "prompt_flash_attention(" + ", ".join(parts) + ")"


def snapshot(call):
    return {k: input_state(x) for k, x in call.items()}


@st.composite
def mutation_plans(draw):
    kind = draw(st.sampled_from(["independent+dependent", "structural", "valid", "limits"]))
    if kind == "limits":
        return ["limits"]
    plan = []
    if kind == "structural":
        plan.append(draw(st.sampled_from(list(STRUCTURAL))))
        plan += draw(st.lists(st.sampled_from(list(INDEPENDENT)), max_size=1, unique=True))
    elif kind == "independent+dependent":
        # at most one dependent mutation (two could edit the same array), applied first
        plan += draw(st.lists(st.sampled_from(list(DEPENDENT)), max_size=1))
        plan += draw(st.lists(st.sampled_from(list(INDEPENDENT)), min_size=1 - len(plan),
                              max_size=2, unique=True))
    plan += draw(st.lists(st.sampled_from(list(VALID_MUTS)), min_size=1 if kind == "valid"
                          else 0, max_size=2, unique=True))
    return plan


ALL_MUTS = dict(INDEPENDENT, **DEPENDENT, **STRUCTURAL, **VALID_MUTS, limits=m_limits)


def run_call(call, positional):
    kw = dict(call)
    if positional:
        args = [kw.pop(name) for name in POSITIONAL]
        return prompt_flash_attention(*args, **kw)
    return prompt_flash_attention(**kw)


@PROFILE_SETTINGS
@given(data=st.data())
def test_fuzzed_calls_raise_only_spec_errors(data):
    c = data.draw(base_specs(), label="base")
    call = build_base(c)
    plan = data.draw(mutation_plans(), label="mutations")
    base = dict(call)
    expects = []
    for name in plan:
        if name in VALID_MUTS:
            # only arguments that still hold their base value (a valid form of an invalid
            # value could make it valid again)
            untouched = {k for k in call if call[k] is base[k]}
            expects.append(VALID_MUTS[name](data, call, c, untouched))
        else:
            expects.append(ALL_MUTS[name](data, call, c))
    expects = [e(call) if callable(e) else e for e in expects]
    certain = [e for e in expects if isinstance(e, tuple)]
    maybe = any(e is MAYBE for e in expects)
    text = describe(call)
    before = snapshot(call)
    exc = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            res = run_call(call, c["positional"])
    except ALLOWED as e:       # noqa: PERF203
        exc = e
    except Exception as e:     # anything else is a bug
        pytest.fail(f"{type(e).__name__} (not TypeError/ValueError/RuntimeError): {e}\n"
                    f"mutations {plan}\n{text}")
    event("raised " + type(exc).__name__ if exc is not None else "returned")
    event("expected: " + ("maybe" if maybe else "error" if certain else "valid"))
    after = snapshot(call)
    for k in before:
        assert before[k] == after[k], f"{k} was modified by the call\nmutations {plan}\n{text}"

    if exc is not None:
        assert type(exc) in ALLOWED, (
            f"{type(exc).__name__} is a subclass, not exactly TypeError/ValueError/RuntimeError: "
            f"{exc}\nmutations {plan}\n{text}")
        assert str(exc), f"empty {type(exc).__name__} message\n{text}"
        if not maybe:
            allowed = tuple({t for e in certain for t in e})
            assert allowed, (f"a valid call raised {type(exc).__name__}: {exc}\n"
                             f"mutations {plan}\n{text}")
            assert isinstance(exc, allowed), (
                f"raised {type(exc).__name__}: {exc}\nbut the contract says "
                f"{'/'.join(t.__name__ for t in allowed)} for mutations {plan} -> {expects}\n"
                f"{text}")
        return

    assert not certain, (f"an invalid call returned a result; mutations {plan} -> {expects}\n"
                         f"{text}")
    out, lse = res if call["return_softmax_lse"] else (res, None)
    assert isinstance(out, np.ndarray)
    if out.dtype in (F16, BF16, F32):
        args = tuple(call[k] for k in POSITIONAL[:7])
        kwargs = {k: call[k] for k in POSITIONAL[7:]}
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                assert_matches_reference(out, args, kwargs, out.dtype, lse=lse)
            except AssertionError as e:
                raise AssertionError(f"{e}\nmutations {plan}\n{text}") from None


# --------------------------------------------------------------------------------------------
# regressions: library bugs the fuzzer found (fixed in e2ef097), as minimal reproductions
# --------------------------------------------------------------------------------------------
_Q = np.ones((1, 2, 16), np.float16)


def test_query_none_is_a_type_error():
    """BUG-1: query=None raised KeyError('query') in api.py (contract 'Signature' and 'Errors':
    TypeError)."""
    with pytest.raises(TypeError, match="query"):
        prompt_flash_attention(None, _Q, _Q)


def test_huge_int_scale_value_is_a_value_error():
    """BUG-2: scale_value=10**400 raised OverflowError from float() (contract 'Errors': an int that
    is infinite as a float is a ValueError, like scale_value=inf)."""
    with pytest.raises(ValueError, match="scale_value"):
        prompt_flash_attention(_Q, _Q, _Q, scale_value=10 ** 400)


@pytest.mark.parametrize("which", ["actual_seq_lengths", "actual_seq_lengths_kv"])
@pytest.mark.parametrize("value", [-1, 99])
def test_length_one_value_checked_when_batch_is_zero(which, value):
    """BUG-3: with B = 0 a length-1 actual length was broadcast to nothing and never
    range-checked (contract 'Lengths': values in [0, Sq] / [0, Skv], ValueError otherwise)."""
    q = np.ones((0, 3, 16), np.float16)
    with pytest.raises(ValueError, match=which):
        prompt_flash_attention(q, q, q, **{which: [value]})


# --------------------------------------------------------------------------------------------
# fused_infer_attention_score and FiaPlan (docs/fia.md, 'Errors' and 'Planned calls')
#
# Every example starts from a small valid call (tests/test_fia_properties.py's: a branch, a kv
# cache form, int8 caches in a drawn antiquant mode, masks, pse, lengths) in a drawn layout,
# takes a route, and applies one mutation that knows what it did:
# * routes: the whole call; a plan made on the call and run on it, then on other data of the
#   same geometry (both bit for bit the whole call's), then on the mutated arrays;
# * mutations that make the call invalid name the exception types the contract allows: masked
#   arrays, memoryviews, torch tensors on the meta device, ranks that differ (with a prefix or
#   an int8 cache too), zero-stride pools of 2^62 values, dtypes that differ or are not
#   allowed, wrong scalars, and for a plan arrays of another geometry;
# * valid mutations give views of other strides: the result has the bits of the call on
#   contiguous arrays (a plan refuses other strides: a RuntimeError).
# A valid call returns a result within the float64 reference's bound; an invalid one raises
# exactly TypeError, ValueError or RuntimeError, with a message; nothing else is raised, and no
# call writes into an input.
# --------------------------------------------------------------------------------------------
FIA_PROFILE_SETTINGS = profile_settings(ci=("pfa-fuzz-fia-ci", 300),
                                        long=("pfa-fuzz-fia-long", 10_000))
QKV_NAMES = ("query", "key", "value")


# --------------------------------------------------------------------------------------------
# fused_infer_attention_score and FiaPlan: the base call in a drawn layout
# --------------------------------------------------------------------------------------------
def fia_to_layout(x, layout, pool=False):
    """A BNSD tensor (B, N, S, D), or a 4-D block pool (blocks, Nkv, block_size, D), in
    ``layout``: pools become (blocks, block_size, Hkv) there."""
    if layout == "BNSD" or x.ndim != 4:
        return x
    rows = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    return rows.reshape(rows.shape[0], rows.shape[1], -1) if layout == "BSH" or pool else rows


@st.composite
def fia_base_calls(draw, forms=FORMS):
    """((query, key, value), keywords): a valid call of test_fia_properties.fia_calls (a kv
    cache of one of ``forms``) in BNSD, BSH or BSND."""
    (q, k, v), kw, _ = draw(fia_calls(forms))
    layout = draw(st.sampled_from(["BNSD", "BSH", "BSND"]))
    if layout == "BNSD":
        return (q, k, v), kw
    paged = "block_table" in kw
    q = fia_to_layout(q, layout)
    k, v = ([fia_to_layout(e, layout) for e in x] if isinstance(x, list) else
            fia_to_layout(x, layout, pool=paged) for x in (k, v))
    for name in ("key_shared_prefix", "value_shared_prefix"):
        if name in kw:
            kw[name] = fia_to_layout(kw[name], layout)
    return (q, k, v), dict(kw, input_layout=layout)


# --------------------------------------------------------------------------------------------
# mutations: each edits args (a list) / kw in place and returns what the contract says of the
# result: the allowed error types, or VALID, for both routes, or {route: that} where a plan's
# call has rules of its own (the planned kind, dtype, geometry and strides)
# --------------------------------------------------------------------------------------------
def fia_pick_tensor(data, args, names=QKV_NAMES):
    return data.draw(st.sampled_from([QKV_NAMES.index(n) for n in names]), label="tensor")


def fia_replace(args, i, fn):
    """args[i] (or every element of a key / value list) replaced by fn(array)."""
    x = args[i]
    args[i] = [fn(e) for e in x] if isinstance(x, list) else fn(x)


def fm_masked(data, args, kw):
    i = fia_pick_tensor(data, args)
    fia_replace(args, i, lambda x: np.ma.masked_array(x, mask=np.zeros(x.shape, bool)))
    return (T,)


def fm_memoryview(data, args, kw):
    i = fia_pick_tensor(data, args)
    args[i] = memoryview(np.ascontiguousarray(fia_first(args[i])).view(np.uint8))
    return (T,)


def fm_meta(data, args, kw):
    i = fia_pick_tensor(data, args)
    x = fia_first(args[i])
    dtype = {"float16": torch.float16, "float32": torch.float32, "int8": torch.int8}.get(
        x.dtype.name, torch.bfloat16)
    fia_replace(args, i, lambda e: torch.empty(e.shape, dtype=dtype, device="meta"))
    return {"call": (R,), "plan": (T,) if not isinstance(args[i], list) else (R,)}


def fm_rank(data, args, kw):
    """A value (or key) of another rank, where a prefix or an int8 cache stands in for it (a
    plan's call: another shape, a RuntimeError; lists run whole calls)."""
    i = fia_pick_tensor(data, args, ("key", "value"))
    fewer = data.draw(st.booleans(), label="fewer axes")
    fia_replace(args, i, lambda x: x[0] if fewer else x[None])
    return (V_, R)


def fm_huge_pool(data, args, kw):
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


def fm_value_dtype(data, args, kw):
    k = fia_first(args[1])
    other = np.float32 if k.dtype != np.float32 else np.float16
    other = data.draw(st.sampled_from([other, np.int8, np.int32]), label="value dtype")
    if np.dtype(other) == k.dtype:
        other = np.float64
    fia_replace(args, 2, lambda x: x.astype(other))
    return (T,)


def fm_query_dtype(data, args, kw):
    dtype = data.draw(st.sampled_from([np.int32, np.uint8, np.float64, np.bool_]), label="dt")
    args[0] = args[0].astype(dtype)
    return (T,)


FIA_SCALARS = {
    "softmax_lse_flag": (1, T), "block_size": (True, T), "scale": (float("nan"), V_),
    "num_heads": (0, R), "input_layout": ("BHSD", V_), "antiquant_mode": (1.5, T),
    "num_key_value_heads": (-1, R), "inner_precise": (7, R),
}


def fm_scalar(data, args, kw):
    name = data.draw(st.sampled_from(sorted(FIA_SCALARS)), label="scalar")
    kw[name], error = FIA_SCALARS[name]
    return (error,)


def fm_view(data, args, kw):
    """q, k or v (or their list elements) as a view of other strides: valid, the same bits; a
    plan refuses other strides."""
    i = fia_pick_tensor(data, args)
    kind = data.draw(st.sampled_from(["rev", "pad", "step2", "F", "ro", "unaligned",
                                      "struct"]), label="view")
    before = fia_first(args[i]).strides
    fia_replace(args, i, lambda x: view_variant(x, kind))
    # a plan of lists runs whole calls; one of arrays checks their strides
    same = isinstance(args[i], list) or fia_first(args[i]).strides == before
    return {"call": VALID, "plan": VALID if same else (R,)}


def fm_geometry(data, args, kw):
    """For a plan: another shape of one tensor (one more row or element); not made for the
    whole call (which takes some shapes and refuses others) nor for lists (whose plans run
    whole calls)."""
    i = fia_pick_tensor(data, args)
    if isinstance(args[i], list):
        return VALID
    x = args[i]
    pad = [(0, 0)] * x.ndim
    pad[-1 if data.draw(st.booleans(), label="last axis") else 0] = (0, 1)
    args[i] = np.pad(x, pad)
    return {"call": VALID, "plan": (R,)}


FIA_MUTATIONS = dict(masked=fm_masked, memoryview=fm_memoryview, rank=fm_rank,
                     huge_pool=fm_huge_pool, value_dtype=fm_value_dtype,
                     query_dtype=fm_query_dtype, scalar=fm_scalar, view=fm_view,
                     geometry=fm_geometry, none=lambda data, args, kw: VALID)
if torch is not None:
    FIA_MUTATIONS["meta"] = fm_meta


def fia_first(x):
    return x[0] if isinstance(x, list) else x


# --------------------------------------------------------------------------------------------
# fused_infer_attention_score and FiaPlan: the property
# --------------------------------------------------------------------------------------------
def fia_arrays(args, kw):
    """Every writeable NumPy array a call holds (a read-only broadcast view cannot be written),
    list elements included."""
    for x in list(args) + list(kw.values()):
        for e in (x if isinstance(x, list) else [x]):
            if isinstance(e, np.ndarray) and e.flags.writeable:
                yield e


def fia_same_bits(a, b):
    return all(np.array_equal(np.ascontiguousarray(x).view(np.uint8),
                              np.ascontiguousarray(y).view(np.uint8)) for x, y in zip(a, b))


def fia_within_the_reference(args, kw, out):
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


def fia_other_data(args, seed):
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


def fia_outcome(call):
    """(result, None) or (None, the allowed exception); anything else fails the test."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return call(), None
    except ALLOWED as e:            # noqa: PERF203
        return None, e


@FIA_PROFILE_SETTINGS
@given(data=st.data())
def test_fuzzed_fia_and_plan_calls_raise_only_spec_errors(data):
    name = data.draw(st.sampled_from(sorted(FIA_MUTATIONS)), label="mutation")
    route = data.draw(st.sampled_from(["call", "plan"]), label="route")
    args, kw = data.draw(fia_base_calls(["paged"] if name == "huge_pool" else FORMS), label="base")
    args = list(args)
    base_args, base_kw = list(args), dict(kw)
    want = fused_infer_attention_score(*base_args, **base_kw)
    plan = None
    if route == "plan":
        plan = FiaPlan(*base_args, **base_kw)
        assert fia_same_bits(plan(*base_args), want)
        layer = fia_other_data(base_args, data.draw(st.integers(0, 2 ** 32 - 1), label="layer"))
        assert fia_same_bits(plan(*layer), fused_infer_attention_score(*layer, **base_kw))
    if name == "geometry" and route != "plan":
        name = "none"
    expected = FIA_MUTATIONS[name](data, args, kw)
    if isinstance(expected, dict):
        expected = expected[route]
    kw_mutated = kw.keys() != base_kw.keys() or any(kw[n] is not base_kw[n] for n in kw)
    if route == "plan" and kw_mutated:             # the plan is made with the mutated keywords
        call = lambda: FiaPlan(*base_args, **kw)(*base_args)        # noqa: E731
        args = base_args
    elif route == "plan":
        call = lambda: plan(*args)                                  # noqa: E731
    else:
        call = lambda: fused_infer_attention_score(*args, **kw)     # noqa: E731
    before = [(x, input_state(x)) for x in fia_arrays(args, kw)]
    result, exc = fia_outcome(call)
    event(f"{route} {name}: " + (type(exc).__name__ if exc is not None else "returned"))
    for x, state in before:
        assert input_state(x) == state, f"an input was written (mutation {name})"
    if exc is not None:
        assert type(exc) in ALLOWED and str(exc), repr(exc)
        assert expected != VALID, f"a valid call ({name}, {route}) raised {exc!r}"
        assert isinstance(exc, expected), f"{name} ({route}) raised {exc!r}, not {expected}"
        return
    assert expected == VALID, f"an invalid call ({name}, {route}) returned a result"
    assert fia_same_bits(result, want), f"{name} ({route}) changed the result's bits"
    out = result[0]
    if out.dtype != np.int8 and math.prod(out.shape):
        fia_within_the_reference(base_args, base_kw, out)
