"""Property-based tests: random VALID calls of ``prompt_flash_attention`` against the float64
``pfa_numba.reference`` (docs/contract.md), with random tile sizes.

Hypothesis draws a small, printable description of a problem (a dict of plain values plus a
seed); :func:`build_float` / :func:`build_quant` turn it into arrays deterministically, so a
failing example printed by Hypothesis is also its reproduction::

    args, kw, info = build_float({...the printed dict...})
    prompt_flash_attention(*args, **kw)

Profiles (selected by the environment variable ``PFA_HYPOTHESIS_PROFILE``):

* ``ci`` (default): about 60 examples per property, derandomized (the same examples on every
  run), no deadline;
* ``long``: 2000 examples per property, randomized. Run it with::

      PFA_HYPOTHESIS_PROFILE=long python -m pytest tests/test_properties.py -q -p no:cacheprovider
"""
import math
import warnings

import numpy as np
from hypothesis import event, given
from hypothesis import strategies as st

from pfa_numba import config, prompt_flash_attention, reference, trans_quant_param
from _cases import assert_matches_reference, to_layout
from _strategies import (BF16, F16, F32, FLOAT_DTYPES as DTYPES, I8, LAYOUTS, LEN_FORMS,
                         MASK_DTYPES, PADDED, QUANT_KINDS, SCALES, TND_MODES, VIEWS, as_form,
                         band_mask_spec, band_tokens, draw_dtype_name, draw_nkv_arg,
                         draw_padded_masking, draw_tnd_lengths, heads, ignore_underflow,
                         input_state, int8_scales, mask_2048, profile_settings, pse_dtype,
                         random_input, tnd_ends, tokens_used, view_variant)

PROFILE_SETTINGS = profile_settings(ci=("pfa-properties-ci", 60),
                                    long=("pfa-properties-long", 2000))

# --------------------------------------------------------------------------------------------
# helpers: tiles, snapshots, the band mask
# --------------------------------------------------------------------------------------------
_TILE_NAMES = ("CPU_Q_ROWS", "CPU_KV_COLS", "CPU_BAND_TILE_MIN", "CPU_THREADS")


class tiles:
    """Set config tiles for the duration of a ``with`` block (monkeypatch is function-scoped and
    cannot be used inside @given)."""

    def __init__(self, values):
        self.values = dict(zip(_TILE_NAMES, values))

    def __enter__(self):
        self.saved = {k: getattr(config, k) for k in _TILE_NAMES}
        for k, v in self.values.items():
            setattr(config, k, v)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(config, k, v)


tile_values = st.tuples(st.integers(1, 20), st.integers(1, 20),
                        st.sampled_from([1, 2, 3, 5, 64]), st.sampled_from([None, 1, 2]))


def snapshot(objs):
    """Bytes of every array (and of the memory it lives in), and copies of everything else."""
    return [input_state(x) for x in objs]


def assert_unchanged(objs, before, what="input"):
    after = snapshot(objs)
    for i, (b, a) in enumerate(zip(before, after)):
        assert b == a, f"{what} #{i} was modified by the call"


def band_mask(content, dtype_name, shape_kind, batch):
    """The (2048, 2048) mask of modes 2-4 in one of its accepted shapes."""
    m = mask_2048(content, MASK_DTYPES[dtype_name])
    return {"2": m, "12": m[None], "112": m[None, None],
            "B12": np.broadcast_to(m, (batch, 1, 2048, 2048))}[shape_kind]


# --------------------------------------------------------------------------------------------
# strategies (the pieces of a call are in _strategies)
# --------------------------------------------------------------------------------------------
@st.composite
def float_specs(draw):
    """A valid floating-point call (contract 'Signature' to 'pse_shift' and 'softmax_lse and
    merging'), described by plain values."""
    sp = {}
    sp["layout"] = layout = draw(st.sampled_from(LAYOUTS))
    sp["dtype"] = dt = draw(st.sampled_from(list(DTYPES)))
    sp["N"], sp["Nkv"] = n, nkv = draw(heads())
    sp["D"] = draw(st.sampled_from([16, 32, 48, 64]) if dt == "bf16" else
                   st.one_of(st.integers(1, 72), st.sampled_from([1, 16, 64, 72])))
    sp["nkv_arg"] = draw_nkv_arg(draw, n, nkv)
    if layout == "TND":
        batch, sp["q_lens"], sp["kv_lens"] = draw_tnd_lengths(draw, 3, 15)
        sp["ends_form"] = (draw(st.sampled_from(LEN_FORMS)), draw(st.sampled_from(LEN_FORMS)))
        sp["sparse_mode"] = mode = draw(st.sampled_from(TND_MODES))
        sp["mask"] = None if mode == 0 else draw(band_mask_spec())
        sp["pse"] = None
    else:
        sp["B"] = batch = draw(st.integers(0, 3))
        sp["Sq"] = sq = draw(st.integers(0, 40))
        sp["Skv"] = skv = draw(st.integers(0, 40))
        sp.update(draw_padded_masking(draw, dt, batch, sq, skv))
        mode = sp["sparse_mode"]
        sp["poison"] = draw(st.booleans())
        sp["views"] = tuple(draw(st.sampled_from(VIEWS)) for _ in range(3))
    used = tokens_used(mode, sp["mask"] is not None)
    sp["pre"], sp["next"] = draw(band_tokens(used))
    sp["scale"] = draw(st.one_of(st.just(1.0 / math.sqrt(sp["D"])), SCALES))
    sp["ip"] = draw(st.integers(0, 3))
    sp["lse"] = draw(st.booleans())
    sp["spread"] = draw(st.sampled_from([0.3, 1.0, 3.0]))
    sp["tiles"] = draw(tile_values)
    sp["seed"] = draw(st.integers(0, 2 ** 32 - 1))
    return sp


# --------------------------------------------------------------------------------------------
# builders
# --------------------------------------------------------------------------------------------
def _resolve_lengths(form_vals, batch, full):
    if form_vals is None:
        return None, np.full(batch, full, np.int64)
    form, vals = form_vals
    arg = as_form(vals, form)
    per_b = np.full(batch, vals[0], np.int64) if len(vals) == 1 else np.array(vals, np.int64)
    return arg, per_b.reshape(batch)


def _user_mask(rng, ms, batch, sq, skv):
    bm = batch if ms["shape"] in ("3B", "4B") else 1
    m = rng.random((bm, sq + ms["pad"][0], skv + ms["pad"][1])) < ms["density"]
    if ms["full_row"] and sq and bm:
        m[rng.integers(bm), rng.integers(sq), :] = True
    if ms["dtype"] == "float16":
        vals = rng.choice(np.array([1.0, 0.5, 2.0, 0.25], np.float16), size=m.shape)
        mask = np.where(m, vals, np.float16(0)).astype(np.float16)
    elif ms["dtype"] == "int8":
        mask = np.where(m, rng.choice(np.array([1, -1, 127, -128], np.int8), m.shape), 0
                        ).astype(np.int8)
    elif ms["dtype"] == "uint8":
        mask = np.where(m, rng.choice(np.array([1, 7, 255], np.uint8), m.shape), 0
                        ).astype(np.uint8)
    else:
        mask = m
    if ms["shape"] == "2":
        mask = mask[0]
    elif ms["shape"] in ("4B", "41"):
        mask = mask[:, None]
    fill = 1 if mask.dtype != F16 else np.float16(1)
    return view_variant(mask, ms["view"], fill)


def _mask(rng, ms, batch, sq, skv):
    """The attn_mask that the description ``ms`` holds: none, a band mask or a user mask."""
    if ms is None:
        return None
    if ms.get("band"):
        return band_mask(ms["content"], ms["dtype"], ms["shape"], batch)
    return _user_mask(rng, ms, batch, sq, skv)


def _pse(rng, ps, dtype, batch, n, sq, skv, qlen, klen):
    bp = 1 if ps["batch1"] else batch
    shape = (bp, n, sq + ps["pad"][0], skv + ps["pad"][1])
    pse = (rng.standard_normal(shape) * ps["spread"]).astype(np.float32)
    # the padding beyond (Sq, Skv) and beyond every batch's actual lengths is never read
    hi_q = int(qlen.max()) if qlen.size else 0
    hi_k = int(klen.max()) if klen.size else 0
    pse[:, :, hi_q:, :] = np.nan
    pse[:, :, :, hi_k:] = np.nan
    if sq and skv and bp:
        for s in ps["specials"]:
            b, h, i, j = rng.integers(bp), rng.integers(n), rng.integers(sq), rng.integers(skv)
            if s == "-inf":
                pse[b, h, i, j] = -np.inf
            elif s == "-inf-row":
                pse[b, h, i, :] = -np.inf
            elif s == "+inf":
                pse[b, h, i, j] = np.inf
            else:
                pse[b, h, i, j] = np.nan
    return view_variant(pse.astype(dtype), ps["view"], np.nan)


@ignore_underflow
def build_float(sp):
    """(args, kwargs, info) of the call that ``sp`` (from :func:`float_specs`) describes."""
    rng = np.random.default_rng(sp["seed"])
    dtype = DTYPES[sp["dtype"]]
    layout, n, nkv, d = sp["layout"], sp["N"], sp["Nkv"], sp["D"]

    def rnd(*shape):
        return (rng.standard_normal(shape) * sp["spread"]).astype(np.float32)

    info = {"fp16_mask": False}
    if layout == "TND":
        t, tkv = sum(sp["q_lens"]), sum(sp["kv_lens"])
        q, k, v = (rnd(t, n, d).astype(dtype), rnd(tkv, nkv, d).astype(dtype),
                   rnd(tkv, nkv, d).astype(dtype))
        asl = as_form(tnd_ends(sp["q_lens"]), sp["ends_form"][0])
        aslkv = as_form(tnd_ends(sp["kv_lens"]), sp["ends_form"][1])
        mask = _mask(rng, sp["mask"], len(sp["q_lens"]), 0, 0)      # None or a band mask
        pse = None
    else:
        b, sq, skv = sp["B"], sp["Sq"], sp["Skv"]
        asl, qlen = _resolve_lengths(sp["asl"], b, sq)
        aslkv, klen = _resolve_lengths(sp["aslkv"], b, skv)
        q4, k4, v4 = rnd(b, n, sq, d), rnd(b, nkv, skv, d), rnd(b, nkv, skv, d)
        # rows >= qL and kv positions >= kL are never read (contract 'The computation')
        if sp["poison"]:
            for bb in range(b):
                q4[bb, :, qlen[bb]:] = np.nan
                k4[bb, :, klen[bb]:] = np.nan
                v4[bb, :, klen[bb]:] = np.inf
        q, k, v = (view_variant(to_layout(x.astype(dtype), layout), vk, np.nan)
                   for x, vk in zip((q4, k4, v4), sp["views"]))
        mask = _mask(rng, sp["mask"], b, sq, skv)
        info["fp16_mask"] = mask is not None and mask.dtype == F16
        pse = None if sp["pse"] is None else _pse(rng, sp["pse"], dtype, b, n, sq, skv, qlen,
                                                  klen)
    kw = dict(num_heads=n, scale_value=sp["scale"], pre_tokens=sp["pre"],
              next_tokens=sp["next"], input_layout=layout, num_key_value_heads=sp["nkv_arg"],
              sparse_mode=sp["sparse_mode"], inner_precise=sp["ip"])
    return (q, k, v, mask, asl, aslkv, pse), kw, info


def expected_shapes(args, kw):
    q = args[0]
    layout, n = kw["input_layout"], kw["num_heads"]
    if layout == "TND":
        return q.shape, (q.shape[0], n, 1)
    if layout == "BSH":
        b, sq, h = q.shape
        return q.shape, (b, n, sq, 1)
    if layout == "BSND":
        return q.shape, (q.shape[0], n, q.shape[1], 1)
    b, _, sq, d = q.shape
    if layout == "BNSD":
        return q.shape, (b, n, sq, 1)
    return (b, sq, n, d), (b, n, sq, 1)


def call(args, kw, want_lse):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        res = prompt_flash_attention(*args, **kw, return_softmax_lse=want_lse)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    return res, deprecations


# --------------------------------------------------------------------------------------------
# property 1: floating point inputs
# --------------------------------------------------------------------------------------------
@PROFILE_SETTINGS
@given(sp=float_specs())
def test_float_calls_match_reference(sp):
    args, kw, info = build_float(sp)
    dtype = DTYPES[sp["dtype"]]
    before = snapshot(args)
    with tiles(sp["tiles"]):
        res, deprecations = call(args, kw, sp["lse"])
    assert_unchanged(args, before)
    out, lse = res if sp["lse"] else (res, None)
    out_shape, lse_shape = expected_shapes(args, kw)
    assert isinstance(out, np.ndarray) and out.dtype == dtype and out.shape == out_shape
    assert not any(np.shares_memory(out, a) for a in args if isinstance(a, np.ndarray))
    if lse is not None:
        assert lse.dtype == F32 and lse.shape == lse_shape
    # a float16 additive mask (modes 0/1 only) is deprecated; nothing else warns that way
    assert bool(deprecations) == info["fp16_mask"], deprecations
    with warnings.catch_warnings(), np.errstate(under="ignore", over="ignore"):   # reference
        warnings.simplefilter("ignore", DeprecationWarning)
        assert_float_output(out, args, kw, dtype, lse)


EPS32 = float(np.finfo(np.float32).eps)


def _finite(x):
    x = np.asarray(x).astype(np.float64)
    return np.where(np.isfinite(x), x, 0.0)


def score_bound(args, kw):
    """An upper bound of |s| over every (b, n, i, j): |scale| max |q . k| + max |pse|."""
    q, k = args[0], args[1]
    n, layout = kw["num_heads"], kw["input_layout"]
    if layout == "TND":
        q4, k4 = _finite(q).transpose(1, 0, 2)[None], _finite(k).transpose(1, 0, 2)[None]
    else:
        q4 = _finite(bnsd(q, layout, n))
        k4 = _finite(bnsd(k, layout, kw["num_key_value_heads"] or n))
    if q4.size == 0 or k4.size == 0:
        return 0.0
    k4 = np.repeat(k4, q4.shape[1] // k4.shape[1], axis=1)
    dots = np.abs(np.einsum("bnid,bnjd->bnij", q4, k4))
    pse = args[6]
    return (abs(float(kw["scale_value"])) * float(dots.max(initial=0.0))
            + (float(np.abs(_finite(pse)).max(initial=0.0)) if pse is not None else 0.0))


def assert_float_output(out, args, kw, dtype, lse):
    """``assert_matches_reference`` (the kernel error at most twice that of the reference run in
    the input dtype, plus one ulp).

    Its yardstick rounds every score once. A float32 kernel forms a score from D float32
    products, the scale and pse (contract 'Dtypes': float32 accumulation), about sqrt(D) + 2
    roundings of |s|; with large logits (|s| in the hundreds) that dominates: e.g. 7e-5 where the
    yardstick gives 2e-6. So for float32 inputs only, when the yardstick check fails, the error may
    instead be up to what score errors of (sqrt(D) + 2) float32 ulps of max |s| can do to a
    softmax-weighted mean of V (each moves an output by at most 2 |dS| max|V|); NaN/inf
    patterns and softmax_lse are checked as before."""
    try:
        assert_matches_reference(out, args, kw, dtype, lse=lse)
        return
    except AssertionError:
        if dtype != F32:
            raise
    event("float32: large-logit fallback bound")
    assert_matches_reference(out, args, kw, dtype, lse=lse, k_factor=1e300)   # patterns, lse
    ref = reference.prompt_flash_attention(*args, **kw)
    fin = np.isfinite(ref)
    if not fin.any():
        return
    d = args[0].shape[-1] if kw["input_layout"] != "BSH" else args[0].shape[-1] // kw["num_heads"]
    vmax = float(np.abs(_finite(args[2])).max(initial=0.0))
    ds = (math.sqrt(d) + 2) * EPS32 * score_bound(args, kw)
    scale = max(1.0, float(np.abs(ref[fin]).max()))
    bound = 17 * EPS32 * scale + 2 * ds * vmax
    err = float(np.abs(out.astype(np.float64)[fin] - ref[fin]).max())
    assert err <= bound, (f"float32: max |kernel - ref| = {err:.3e} > {bound:.3e} (score "
                          f"error model {ds:.3e}, max|V| {vmax:.3g})")


@PROFILE_SETTINGS
@given(sp=float_specs(), pair=st.sampled_from([(0, 1), (2, 3)]))
def test_inner_precise_bit0_changes_nothing(sp, pair):
    """contract 'Dtypes': inner_precise 0 and 1 give bit-identical output, and so do 2 and 3."""
    args, kw, _ = build_float(sp)
    outs = []
    with tiles(sp["tiles"]), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for ip in pair:
            outs.append(prompt_flash_attention(*args, **dict(kw, inner_precise=ip),
                                               return_softmax_lse=True))
    (o0, l0), (o1, l1) = outs
    assert o0.tobytes() == o1.tobytes() and l0.tobytes() == l1.tobytes()


# --------------------------------------------------------------------------------------------
# property 2: int8 quantization (contract 'Quantization')
# --------------------------------------------------------------------------------------------
PER_CHANNEL = ("H", "11H", "1N1D", "ND", "11ND")


@st.composite
def quant_specs(draw):
    sp = {}
    sp["kind"] = kind = draw(st.sampled_from(QUANT_KINDS))
    sp["dtype"] = dt = draw_dtype_name(draw, kind)
    sp["layout"] = draw(st.sampled_from(PADDED))
    sp["N"], sp["Nkv"] = n, nkv = draw(heads(max_n=4))
    sp["nkv_arg"] = draw_nkv_arg(draw, n, nkv)
    out_int8 = kind != "int8->float16"
    sp["s2_shape"] = draw(st.sampled_from(("1",) * 3 + PER_CHANNEL)) if out_int8 else None
    if sp["s2_shape"] not in (None, "1"):
        sp["D"] = draw(st.sampled_from([32, 64]))
    elif dt == "bf16":
        sp["D"] = draw(st.sampled_from([16, 32, 48]))
    else:
        sp["D"] = draw(st.integers(1, 72))
    sp["B"] = batch = draw(st.integers(0, 3))
    sp["Sq"] = sq = draw(st.integers(0, 24))
    sp["Skv"] = skv = draw(st.integers(0, 24))
    sp.update(draw_padded_masking(draw, dt, batch, sq, skv))
    mode = sp["sparse_mode"]
    used = tokens_used(mode, sp["mask"] is not None)
    sp["pre"], sp["next"] = draw(band_tokens(used, nonneg=out_int8 and mode == 4))
    sp["ip"] = draw(st.integers(0, 3))
    sp["views"] = tuple(draw(st.sampled_from(VIEWS)) for _ in range(3))
    if dt == "int8":
        sp["deq_dtype"] = draw(st.sampled_from(["float32", "uint64"]))
        sp["deq1_factor"] = draw(st.sampled_from([0.3, 1.0, 3.0, 10.0]))
        sp["qs1"] = draw(st.sampled_from([127.0, 100.0, 50.0, 20.0]))
        # 3000: the float16 output overflows to +-inf on some rows
        sp["deq2_factor"] = draw(st.sampled_from([1.0, 0.5, 2.0, 3000.0]))
        sp["scale"] = draw(st.sampled_from([1.0, 1, 0.5, 2.0, np.float32(0.7)]))
    else:
        sp["scale"] = draw(st.one_of(st.just(1.0 / math.sqrt(sp["D"])),
                                     st.sampled_from([0, 1, 0.5, -0.25, np.float16(0.2)])))
        sp["spread"] = draw(st.sampled_from([0.3, 1.0, 2.0]))
    if out_int8:
        # int8 inputs: a fraction of 0.9 / (deq2 * 128), so that one P8 step (deq2 * |V| / l,
        # l >= 1) moves an output by less than one LSB; float inputs: absolute scales
        sp["s2_range"] = draw(st.sampled_from(
            [(0.05, 0.3), (0.2, 1.0)] if dt == "int8" else [(1.0, 10.0), (10.0, 60.0)]))
        sp["offset2"] = draw(st.sampled_from([None, "zero", "random"]))
        sp["s2_bf16"] = dt == "bf16" and draw(st.booleans())
    sp["lse"] = draw(st.booleans())
    sp["tiles"] = draw(tile_values)
    sp["seed"] = draw(st.integers(0, 2 ** 32 - 1))
    return sp


def _channel_shape(kind, n, d):
    return {"1": (1,), "H": (n * d,), "11H": (1, 1, n * d), "1N1D": (1, n, 1, d),
            "ND": (n, d), "11ND": (1, 1, n, d)}[kind]


@ignore_underflow
def build_quant(sp):
    """(args, kwargs, dtype) of the quantized call that ``sp`` (:func:`quant_specs`) describes."""
    rng = np.random.default_rng(sp["seed"])
    layout, n, nkv, d = sp["layout"], sp["N"], sp["Nkv"], sp["D"]
    b, sq, skv = sp["B"], sp["Sq"], sp["Skv"]
    asl, qlen = _resolve_lengths(sp["asl"], b, sq)
    aslkv, klen = _resolve_lengths(sp["aslkv"], b, skv)
    kw = dict(num_heads=n, scale_value=sp["scale"], pre_tokens=sp["pre"],
              next_tokens=sp["next"], input_layout=layout, num_key_value_heads=sp["nkv_arg"],
              sparse_mode=sp["sparse_mode"], inner_precise=sp["ip"])
    dtype = I8 if sp["dtype"] == "int8" else DTYPES[sp["dtype"]]
    q4, k4, v4 = (random_input(rng, s, dtype, sp.get("spread", 1.0))
                  for s in ((b, n, sq, d), (b, nkv, skv, d), (b, nkv, skv, d)))
    if dtype == I8:
        deq1, qs1, deq2 = int8_scales(d, sp["deq1_factor"], sp["qs1"], sp["deq2_factor"])
        if sp["deq_dtype"] == "uint64":
            deq1, deq2 = trans_quant_param(deq1), trans_quant_param(deq2)
        kw.update(deq_scale1=deq1, quant_scale1=qs1, deq_scale2=deq2)
    q, k, v = (view_variant(to_layout(x, layout), vk, 0)
               for x, vk in zip((q4, k4, v4), sp["views"]))
    if sp["kind"] != "int8->float16":
        shape = _channel_shape(sp["s2_shape"], n, d)
        sdt = BF16 if sp["s2_bf16"] else F32
        unit = 1.0
        if dtype == I8:
            unit = 0.9 / (decoded(kw["deq_scale2"]) * 128)
        s2 = (rng.uniform(*sp["s2_range"], size=shape) * unit).astype(np.float32).astype(sdt)
        kw["quant_scale2"] = s2
        if sp["offset2"] == "zero":
            kw["quant_offset2"] = np.zeros(shape, sdt)
        elif sp["offset2"] == "random":
            kw["quant_offset2"] = rng.uniform(-8, 8, size=shape).astype(np.float32).astype(sdt)
    mask = _mask(rng, sp["mask"], b, sq, skv)
    pdt = pse_dtype(dtype)
    ps = sp["pse"]
    # a NaN / +inf score has no int8 P8 (contract 'Quantization')
    if ps is not None and dtype == I8:
        ps = dict(ps, specials=[s for s in ps["specials"] if s in ("-inf", "-inf-row")])
    pse = None if ps is None else _pse(rng, ps, pdt, b, n, sq, skv, qlen, klen)
    return (q, k, v, mask, asl, aslkv, pse), kw, dtype


def bnsd(x, layout, n):
    """An input (query/key/value) or output array of ``layout`` as (B, heads, S, D)."""
    x = np.asarray(x)
    if layout == "BSH":
        b, s_, h = x.shape
        return x.reshape(b, s_, n, h // n).transpose(0, 2, 1, 3)
    if layout == "BSND":
        return x.transpose(0, 2, 1, 3)
    return x


def bnsd_out(x, layout, n):
    return x.transpose(0, 2, 1, 3) if layout == "BNSD_BSND" else bnsd(x, layout, n)


def decoded(deq):
    if deq.dtype == np.uint64:
        return float((deq & np.uint64(0xFFFFE000)).astype(np.uint32).view(np.float32)[0])
    return float(deq[0])


def float32_formed_rows(args, kw):
    """(B, N, Sq) rows of an int8 call in which some score fp16(A * deq1) depends on how the
    product is formed: contract 'Quantization' lets it be formed in float32 (then rounded to fp16, a
    double rounding) or exactly, and the two fp16 values differ by one ulp. Such a row may
    legitimately differ from the exact reference by more than the tolerances below (the changed
    score moves every weight of its row); no other row may."""
    n, layout = kw["num_heads"], kw["input_layout"]
    nkv = kw["num_key_value_heads"] or n
    q = bnsd(args[0], layout, n).astype(np.int64)
    k = bnsd(args[1], layout, nkv).astype(np.int64)
    k = np.repeat(k, n // nkv, axis=1)
    a = np.einsum("bnid,bnjd->bnij", q, k)
    deq1 = decoded(kw["deq_scale1"])
    exact = (a * deq1).astype(np.float16)
    via_f32 = (a.astype(np.float32) * np.float32(deq1)).astype(np.float16)
    return (exact != via_f32).any(axis=-1)


def check_rows(bad, exempt, what):
    """Elements failing a check (B, N, Sq, X) must all lie in exempt rows (B, N, Sq)."""
    rows = bad.any(axis=tuple(range(3, bad.ndim)))
    unexplained = rows & ~exempt
    assert not unexplained.any(), (f"{what} at (b, n, i) = "
                                   f"{np.argwhere(unexplained)[:3].tolist()} (no float32-formed "
                                   f"score there)")


F16_OVERFLOW = 65520.0     # values at or beyond round to +-inf in float16


def fp16_out_bad(got, want, deq2, v):
    """Elements beyond one fp16 ulp plus two P8 steps of one unit (each changes O by
    deq2 * |V| / l, l >= 1); an overflow to +-inf (contract 'Errors': IEEE, never wrapped) must
    match up to that bound. Returns the boolean array of failing elements."""
    g = got.astype(np.float64)
    bad = np.isnan(g) != np.isnan(want)
    ok = ~np.isnan(want) & ~bad
    vmax = float(np.abs(v.astype(np.float64)).max()) if v.size else 0.0
    slack = 2 * float(deq2) * vmax
    with np.errstate(over="ignore", invalid="ignore"):
        ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
        ulp = np.where(np.isfinite(ulp), ulp, 0.0)
        near = np.abs(want) + slack + ulp >= F16_OVERFLOW
        inf_g, inf_w = np.isinf(g), np.isinf(want)
        bad |= ok & (inf_g != inf_w) & ~near
        bad |= ok & inf_g & inf_w & (np.sign(g) != np.sign(want))
        fin = ok & ~inf_g & ~inf_w
        bad |= fin & (np.abs(g - want) > ulp + slack)
    return bad


@PROFILE_SETTINGS
@given(sp=quant_specs())
def test_quant_calls_match_reference(sp):
    """int8 outputs within 1 LSB of the reference, float16 outputs of the int8 pipeline within
    one ulp plus two P8 steps (tests/test_quant.py explains both), softmax_lse within 1e-4
    relative; rows whose scores contract 'Quantization' lets be formed in float32 are exempt."""
    args, kw, dtype = build_quant(sp)
    allargs = list(args) + [kw.get(k) for k in ("deq_scale1", "quant_scale1", "deq_scale2",
                                                  "quant_scale2", "quant_offset2")]
    before = snapshot(allargs)
    with tiles(sp["tiles"]), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        got = prompt_flash_attention(*args, **kw, return_softmax_lse=sp["lse"])
        with np.errstate(under="ignore", over="ignore"):
            want, want_lse = reference.prompt_flash_attention(*args, **kw,
                                                              return_softmax_lse=True)
    assert_unchanged(allargs, before)
    if sp["lse"]:
        got, lse = got
    out_shape, lse_shape = expected_shapes(args, kw)
    assert got.shape == out_shape == want.shape
    assert got.dtype == (F16 if sp["kind"] == "int8->float16" else I8)
    layout, n = kw["input_layout"], kw["num_heads"]
    g4, w4 = bnsd_out(got, layout, n), bnsd_out(want, layout, n)
    exempt = (float32_formed_rows(args, kw) if dtype == I8
              else np.zeros(g4.shape[:3], bool))
    if exempt.any():
        event("int8 rows with a float32-formed score")
    if sp["kind"] == "int8->float16":
        check_rows(fp16_out_bad(g4, w4, decoded(kw["deq_scale2"]), args[2]), exempt,
                   "float16 output beyond one ulp + 2 deq2 max|V|")
    else:
        diff = np.abs(g4.astype(np.int32) - w4.astype(np.int32))
        check_rows(diff > 1, exempt, f"int8 output differs by {diff.max(initial=0)} LSB")
    if sp["lse"]:
        assert lse.dtype == F32 and lse.shape == lse_shape == want_lse.shape
        neg = np.isneginf(want_lse)
        assert np.array_equal(np.isneginf(lse), neg), "rows with -inf softmax_lse differ"
        with np.errstate(invalid="ignore"):
            lerr = np.where(neg, 0.0, np.abs(lse.astype(np.float64) - want_lse))
        bound = 1e-4 * np.maximum(1.0, np.abs(np.where(neg, 0.0, want_lse)))
        check_rows(lerr > bound, exempt, "softmax_lse error beyond 1e-4 relative")


# --------------------------------------------------------------------------------------------
# regression: a library bug found here (fixed in e2ef097), as a minimal reproduction
# --------------------------------------------------------------------------------------------
def test_scale_value_beyond_float32_range():
    """BUG-4: a finite scale_value beyond the float32 range (1e39) was cast to float32 inf
    before scaling, so small scores became inf and the output NaN (contract 'The computation': s =
    scale_value *
    dot, used as given; contract 'Errors' rejects only NaN/infinite scale_value)."""
    q = np.full((1, 1, 16), 1e-20, np.float32)       # dot(q, k) = 1.6e-39, s = 1.6 exactly
    k = np.full((1, 2, 16), 1e-20, np.float32)
    v = np.stack([np.zeros(16, np.float32), np.ones(16, np.float32)])[None]
    out, lse = prompt_flash_attention(q, k, v, scale_value=1e39, return_softmax_lse=True)
    # both scores equal: the mean of the two value rows; lse = s + log(2)
    np.testing.assert_allclose(out, np.full((1, 1, 16), 0.5, np.float32), rtol=1e-6)
    np.testing.assert_allclose(lse.ravel(), [1e39 * 16 * 1e-40 + math.log(2)], rtol=1e-5)
