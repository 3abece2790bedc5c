"""Hypothesis strategies and input builders shared by the two hypothesis test files:
tests/test_fuzz.py (valid calls with wrong things mixed in, docs/contract.md, 'Errors') and
tests/test_properties.py (random valid calls against ``pfa_numba.reference``).

Here: the profiles (``PFA_HYPOTHESIS_PROFILE``), the dtype / layout / token constants, the
strategies that describe one piece of a call (heads, actual lengths, band tokens, masks, pse,
scales), the (2048, 2048) band masks, the memory arrangements (views) of an input, the accepted
forms of the lengths, and snapshots of the inputs (no call may write into one). Each test file
keeps its own call-level strategy and its own checks. Imported like ``_cases``
(``from _strategies import ...``; tests/ is on sys.path).
"""
import functools
import math
import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from _cases import DTYPES as FLOAT_DTYPES

# --------------------------------------------------------------------------------------------
# profiles
# --------------------------------------------------------------------------------------------
_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
PROFILE = os.environ.get("PFA_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"PFA_HYPOTHESIS_PROFILE must be 'ci' or 'long', got {PROFILE!r}")


def profile_settings(ci, long):
    """Register the profiles ``ci`` and ``long``, each a (name, max_examples) pair (``ci``
    derandomized: the same examples on every run; ``long`` randomized), and return the one that
    ``PFA_HYPOTHESIS_PROFILE`` (``ci``, the default, or ``long``) selects."""
    settings.register_profile(ci[0], max_examples=ci[1], derandomize=True, **_COMMON)
    settings.register_profile(long[0], max_examples=long[1], **_COMMON)
    return settings.get_profile({"ci": ci, "long": long}[PROFILE][0])


# --------------------------------------------------------------------------------------------
# constants
# --------------------------------------------------------------------------------------------
F16 = FLOAT_DTYPES["fp16"]
BF16 = FLOAT_DTYPES["bf16"]
F32 = FLOAT_DTYPES["fp32"]
I8 = np.dtype(np.int8)
PADDED = ("BSH", "BNSD", "BSND", "BNSD_BSND")
LAYOUTS = PADDED + ("TND",)
TND_MODES = (0, 2, 3, 4)            # no user mask with TND (contract 'Layouts')
QUANT_KINDS = ("int8->float16", "int8->int8", "float->int8")
INF = 2147483647                    # pre/next_tokens at or above mean +inf (contract 'The band')
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MASK_DTYPES = {"bool": np.dtype(np.bool_), "int8": I8, "uint8": np.dtype(np.uint8)}


def pse_dtype(dtype):
    """The pse_shift dtype of a query dtype (contract 'pse_shift')."""
    return F16 if dtype in (F16, I8) else dtype


def tokens_used(mode, has_mask):
    """Whether pre/next_tokens are used (contract 'The band': mode 4, or mode 0 with a mask)."""
    return mode == 4 or (mode == 0 and has_mask)


def tokens_valid(pre, nxt, used, int8_out_mode4):
    """contract 'The band' sign rules (values >= 2147483647 mean +inf)."""
    if not used:
        return True
    p = None if pre >= INF else pre
    n = None if nxt >= INF else nxt
    if p is not None and n is not None and (p + n < 0 or (p < 0 and n < 0)):
        return False
    if int8_out_mode4 and (pre < 0 or nxt < 0):
        return False
    return True


# --------------------------------------------------------------------------------------------
# builders
# --------------------------------------------------------------------------------------------
def ignore_underflow(build):
    """``build`` with float underflow ignored (values rounded to a narrow dtype)."""
    @functools.wraps(build)
    def quiet(*args, **kwargs):
        with np.errstate(under="ignore"):
            return build(*args, **kwargs)
    return quiet


def random_input(rng, shape, dtype, spread=1.0):
    """A query/key/value array: int8 uniform over its range, else ~ N(0, spread) rounded to
    float32, then to ``dtype``."""
    if dtype == I8:
        return rng.integers(-128, 128, shape, dtype=np.int8)
    return (rng.standard_normal(shape) * spread).astype(np.float32).astype(dtype)


def int8_scales(d, deq1_factor=1.0, qs1=127.0, deq2_factor=1.0):
    """(deq_scale1, quant_scale1, deq_scale2) of an int8 call (contract 'Quantization') with head
    size ``d``: scores of a few units, P quantized by ``qs1``, deq_scale2 = deq2_factor / qs1."""
    return (np.array([3.0 * deq1_factor / (math.sqrt(d) * 5000)], np.float32),
            np.array([qs1], np.float32), np.array([deq2_factor / qs1], np.float32))


def tnd_ends(lens):
    """The cumulative ends (TND actual_seq_lengths) of per-batch lengths."""
    return np.cumsum([0] + list(lens))[1:]


# the (2048, 2048) masks of modes 2-4, built once per content and dtype, read-only (their
# content is never read by the library)
_MASK2048 = {}


def mask_2048(content="triu", dtype=np.bool_):
    """``triu(ones, 1)`` (what Ascend requires) or ``zeros``, (2048, 2048), read-only."""
    key = (content, np.dtype(dtype))
    if key not in _MASK2048:
        if content == "triu":
            m = np.triu(np.ones((2048, 2048), bool), 1)
        else:
            m = np.zeros((2048, 2048), bool)
        m = m.astype(key[1])
        m.setflags(write=False)
        _MASK2048[key] = m
    return _MASK2048[key]


def view_variant(x, kind, fill=0, pad=3):
    """The same values as ``x`` in another memory arrangement (read in place by the library).
    ``pad``: how much wider the array a "pad" view is a window of (``fill`` around it)."""
    if kind == "c":
        return x
    if kind == "F":
        return np.asfortranarray(x)
    if kind == "ro":
        y = x.copy()
        y.setflags(write=False)
        return y
    if kind == "unaligned":  # data at an odd byte address
        buf = np.zeros(x.nbytes + x.itemsize + 1, np.uint8)
        y = buf[1:1 + x.nbytes].view(x.dtype).reshape(x.shape)
        y[...] = x
        return y
    if x.ndim == 0:
        return x
    if kind == "rev":
        return np.ascontiguousarray(x[::-1])[::-1]
    if kind == "pad":       # last axis a window of a wider array (garbage around it)
        big = np.full(x.shape[:-1] + (x.shape[-1] + pad,), fill, dtype=x.dtype)
        big[..., 1:1 + x.shape[-1]] = x
        return big[..., 1:1 + x.shape[-1]]
    if kind == "step2":     # every other element of the second axis
        shape = list(x.shape)
        shape[1] *= 2
        big = np.full(shape, fill, dtype=x.dtype)
        big[:, ::2] = x
        return big[:, ::2]
    if kind == "struct":     # a field of a structured array: byte strides not a multiple of
        rec = np.zeros(x.shape, dtype=[("pad", "u1"), ("x", x.dtype)])   # the item size
        rec["x"] = x
        return rec["x"]
    if kind == "bcast":      # zero stride on the first axis (every batch holds batch 0)
        return np.broadcast_to(x[:1], x.shape) if x.shape[0] else x
    raise AssertionError(kind)


VIEWS = ("c", "c", "c", "F", "rev", "ro", "pad", "step2", "unaligned", "struct", "bcast")
LEN_FORMS = ("list", "tuple", "list_np", "int64", "int32", "uint8", "uint64")


def as_form(values, form, list_np=np.int64):
    """Lengths / ends in one of the accepted Python and NumPy forms (``list_np``: a list of
    that NumPy integer type)."""
    if form == "list":
        return [int(x) for x in values]
    if form == "tuple":
        return tuple(int(x) for x in values)
    if form == "list_np":
        return [list_np(x) for x in values]
    if form in ("int64", "int32", "uint8", "uint64"):
        return np.array(values, dtype=form)
    raise AssertionError(form)


def root_base(a):
    """The array that owns the memory ``a`` lives in."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def input_state(x):
    """What a call must leave as it was: an array's bytes (and those of the memory it lives
    in), shape and strides; the repr of a list, tuple or dict; None for anything else."""
    if isinstance(x, np.ndarray):
        return (x.tobytes(), root_base(x).tobytes(), x.shape, x.strides)
    if isinstance(x, (list, tuple, dict)):
        return repr(x)
    return None


# --------------------------------------------------------------------------------------------
# strategies: pieces of a call
# --------------------------------------------------------------------------------------------
def draw_dtype_name(draw, kind):
    """The input dtype name of a call of ``kind`` ("float" or one of QUANT_KINDS)."""
    return "int8" if kind.startswith("int8") else draw(st.sampled_from(list(FLOAT_DTYPES)))


def draw_nkv_arg(draw, n, nkv):
    """num_key_value_heads as passed: 0 or N when there are as many kv heads as heads."""
    return draw(st.sampled_from([0, n])) if nkv == n else nkv


def draw_tnd_lengths(draw, max_batch, max_len):
    """(batch, q_lens, kv_lens) of a TND call."""
    nb = draw(st.integers(0, max_batch))
    return (nb, draw(st.lists(st.integers(0, max_len), min_size=nb, max_size=nb)),
            draw(st.lists(st.integers(0, max_len), min_size=nb, max_size=nb)))


ANY_TOKENS = st.one_of(st.integers(-45, 45),
                       st.sampled_from([INF, INF + 1, INF - 1, 2 ** 40, INT64_MAX, -2 ** 31,
                                        -2 ** 40, INT64_MIN, 0, -1]))


@st.composite
def band_tokens(draw, used, nonneg=False):
    """(pre_tokens, next_tokens): anything when unused; valid per contract 'The band' when used."""
    if not used:
        return draw(ANY_TOKENS), draw(ANY_TOKENS)
    if nonneg:
        big = st.sampled_from([INF, INT64_MAX, 2 ** 40])
        return (draw(st.one_of(st.integers(0, 45), big)),
                draw(st.one_of(st.integers(0, 45), big)))
    pre = draw(ANY_TOKENS)
    if pre >= INF:
        return pre, draw(ANY_TOKENS)
    lo = -pre           # pre + next >= 0 (and so never both negative)
    big = st.sampled_from([INF, INT64_MAX, 2 ** 40])
    if lo >= INF:       # only an unlimited next_tokens fits
        return pre, draw(st.sampled_from([INF, INT64_MAX]))
    nxt = draw(st.one_of(st.just(lo), st.integers(lo, max(lo, 0) + 45), big))
    return pre, nxt


SCALES = st.one_of(
    st.sampled_from([0, 1, -2, 3, 0.0, -0.5, 0.125, 2.5, np.float16(0.25), np.float32(-0.3),
                     np.float64(0.7), np.int32(2), np.int64(-1), np.uint8(1)]),
    st.floats(-3, 3, allow_nan=False, width=32))


@st.composite
def seq_lengths(draw, batch, full):
    """actual_seq_lengths(_kv) for the padded layouts (contract 'Lengths'): None, one value, or B
    values."""
    kind = draw(st.sampled_from(["none", "none", "one", "batch"]))
    if kind == "none":
        return None
    value = st.one_of(st.just(0), st.just(full), st.integers(0, full))
    vals = [draw(value)] if kind == "one" else draw(st.lists(value, min_size=batch,
                                                             max_size=batch))
    return (draw(st.sampled_from(LEN_FORMS)), vals)


@st.composite
def heads(draw, max_n=8):
    nkv = draw(st.integers(1, max_n))
    g = draw(st.integers(1, max_n // nkv))
    return nkv * g, nkv


@st.composite
def user_mask_spec(draw, fp16_ok):
    """A user mask (modes 0, 1); float16 (additive, deprecated) only for a float16 query."""
    choices = ["bool", "int8", "uint8"] + (["float16"] if fp16_ok else [])
    return dict(shape=draw(st.sampled_from(["2", "3B", "31", "4B", "41"])),
                pad=(draw(st.integers(0, 4)), draw(st.integers(0, 4))),
                dtype=draw(st.sampled_from(choices)),
                density=draw(st.sampled_from([0.0, 0.2, 0.5, 0.9, 1.0])),
                full_row=draw(st.booleans()),
                view=draw(st.sampled_from(["c", "c", "F", "rev", "step2", "ro", "struct",
                                           "bcast"])))


@st.composite
def band_mask_spec(draw):
    return dict(band=True, shape=draw(st.sampled_from(["2", "12", "112", "B12"])),
                dtype=draw(st.sampled_from(list(MASK_DTYPES))),
                content=draw(st.sampled_from(["triu", "zeros"])))


@st.composite
def pse_spec(draw):
    return dict(batch1=draw(st.booleans()),
                pad=(draw(st.integers(0, 3)), draw(st.integers(0, 3))),
                spread=draw(st.sampled_from([0.5, 2.0, 8.0])),
                specials=draw(st.lists(st.sampled_from(["-inf", "-inf-row", "+inf", "nan"]),
                                       max_size=2, unique=True)),
                view=draw(st.sampled_from(["c", "c", "F", "rev", "ro", "pad", "struct",
                                           "bcast"])))


def draw_padded_masking(draw, dtype_name, batch, sq, skv):
    """sparse_mode, mask, pse and actual lengths of a padded-layout valid call, as the entries
    of its description: mode 0 with or without a user mask, mode 1 with one, modes 2-4 with a
    band mask (contract 'The band', 'The user mask', 'Lengths' and 'pse_shift')."""
    sp = {}
    sp["sparse_mode"] = mode = draw(st.sampled_from([0, 0, 1, 2, 3, 4]))
    if mode == 0:
        sp["mask"] = draw(st.one_of(st.none(), user_mask_spec(dtype_name == "fp16")))
    elif mode == 1:
        sp["mask"] = draw(user_mask_spec(dtype_name == "fp16"))
    else:
        sp["mask"] = draw(band_mask_spec())
    sp["pse"] = draw(st.one_of(st.none(), pse_spec()))
    sp["asl"] = draw(seq_lengths(batch, sq))
    sp["aslkv"] = draw(seq_lengths(batch, skv))
    return sp
